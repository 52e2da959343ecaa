"""Integer arithmetic prompts ("What is 7 + 12?" -> "19") as JSONL prompt sets, a train file and
a held-out test file, for a real chat model and the ``final_number`` reward.

    bapo-make-arithmetic --out data/arithmetic            # a + b, a and b in 1..20
    bapo-make-arithmetic --out data/mixed --ops '+-*' --low 1 --high 50 --train 5000 --test 500

Each row is one problem in the layout :func:`bapo_megatron.data.prompts.load_prompts` reads:
``{"id": "train-0", "prompt": [{"role": "user", "content": "What is 7 + 12?"}], "answer":
"19", "data_source": "arithmetic"}``. A problem is a triple (a, operator, b) with a and b drawn
uniformly from ``low..high``; the two files together hold each problem at most once, so no test
problem is seen in training. With the defaults (``+`` over 1..20) there are 400 distinct
problems: the test file takes 200 and the train file, by default, all the others (200). Sizes
that ask for more problems than exist are refused. The same seed writes the same files.
"""

from __future__ import annotations

import argparse
import json
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bapo_megatron.files.atomic import write_text_atomically

OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
DATA_SOURCE = "arithmetic"
MAX_ENUMERATED = 1_000_000
"""Most distinct problems for a train set of "all the rest" (they are all held in memory)."""


@dataclass(frozen=True)
class Problem:
    """``a op b``."""

    a: int
    op: str
    b: int

    @property
    def question(self) -> str:
        """The user turn; a negative operand in parentheses ("What is 3 - (-4)?")."""

        def shown(n: int) -> str:
            return f"({n})" if n < 0 else str(n)

        return f"What is {shown(self.a)} {self.op} {shown(self.b)}?"

    @property
    def answer(self) -> int:
        """The exact result."""
        return OPERATORS[self.op](self.a, self.b)


def _check_options(low: int, high: int, ops: str) -> str:
    """The distinct operators of ``ops`` in their order; ``ValueError`` for a bad range or an
    unknown operator."""
    if low > high:
        raise ValueError(f"operand range: low ({low}) must not exceed high ({high})")
    if not ops:
        raise ValueError(f"ops: give one or more of {''.join(OPERATORS)}")
    unknown = sorted(set(ops) - set(OPERATORS))
    if unknown:
        raise ValueError(f"ops {ops!r}: unknown operator(s) {unknown}; known: {list(OPERATORS)}")
    return "".join(dict.fromkeys(ops))


def split_problems(
    *,
    test: int = 200,
    train: int | None = None,
    seed: int = 0,
    low: int = 1,
    high: int = 20,
    ops: str = "+",
) -> tuple[list[Problem], list[Problem]]:
    """``(train, test)`` problems, disjoint, drawn without replacement from every (a, op, b)
    with a and b in ``low..high`` and op in ``ops``; ``train=None`` takes every problem the
    test set leaves. ``ValueError`` when the sizes ask for more problems than there are."""
    ops = _check_options(low, high, ops)
    if test < 0 or (train is not None and train < 0):
        raise ValueError(f"sizes must not be negative (train={train}, test={test})")
    width = high - low + 1
    total = width * width * len(ops)
    what = f"{' '.join(ops)} over operands {low}..{high}"
    if train is None:
        if total > MAX_ENUMERATED:
            raise ValueError(
                f"{what} make {total:,} distinct problems, too many to take all the rest as the "
                "train set: give the train size"
            )
        train = total - test
        if train <= 0:
            raise ValueError(
                f"a test set of {test} leaves no problem for training: {what} make only "
                f"{total} distinct problems"
            )
    if train + test > total:
        raise ValueError(
            f"{train} train + {test} test problems asked, but {what} make only {total} "
            "distinct problems: lower the sizes or widen the range (--low, --high, --ops)"
        )
    # Sampling indices of the enumeration without replacement makes the two sets disjoint by
    # construction, and random.sample over a range never builds the whole enumeration.
    chosen = random.Random(seed).sample(range(total), train + test)

    def problem(index: int) -> Problem:
        op_index, rest = divmod(index, width * width)
        a, b = divmod(rest, width)
        return Problem(low + a, ops[op_index], low + b)

    problems = [problem(i) for i in chosen]
    return problems[test:], problems[:test]


def rows(problems: list[Problem], split: str) -> list[dict]:
    """The JSONL rows of ``problems``, ids ``{split}-{index}``."""
    return [
        {
            "id": f"{split}-{index}",
            "prompt": [{"role": "user", "content": p.question}],
            "answer": str(p.answer),
            "data_source": DATA_SOURCE,
        }
        for index, p in enumerate(problems)
    ]


def write_rows(path: Path, records: list[dict]) -> None:
    """``records`` as JSONL at ``path``, replaced atomically."""
    write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in records))


def write_task(out: str | Path, **options) -> tuple[Path, Path, int, int]:
    """Write ``out/train.jsonl`` and ``out/test.jsonl`` (``out`` is created if missing) from
    :func:`split_problems` with ``options``; ``(train path, test path, train rows, test rows)``."""
    train, test = split_problems(**options)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_path, test_path = out / "train.jsonl", out / "test.jsonl"
    write_rows(train_path, rows(train, "train"))
    write_rows(test_path, rows(test, "test"))
    return train_path, test_path, len(train), len(test)


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for train.jsonl and test.jsonl")
    parser.add_argument(
        "--train", type=int, default=None, help="train problems (default: all the test leaves)"
    )
    parser.add_argument("--test", type=int, default=200, help="held-out problems (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--low", type=int, default=1, help="smallest operand (default 1)")
    parser.add_argument("--high", type=int, default=20, help="largest operand (default 20)")
    parser.add_argument(
        "--ops",
        default="+",
        help="operators, any of + - * in one word (default +; write --ops=-* when it starts "
        "with -)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run the command line ``argv`` (default: the process's arguments); exit code 2 on bad
    input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        train_path, test_path, train, test = write_task(
            args.out,
            test=args.test,
            train=args.train,
            seed=args.seed,
            low=args.low,
            high=args.high,
            ops=args.ops,
        )
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(
        f"wrote {train_path} ({train} problems) and {test_path} ({test} problems): "
        f"{' '.join(args.ops)} over operands {args.low}..{args.high}, seed {args.seed}",
        flush=True,
    )

"""Evaluate a checkpoint on a benchmark: avg@k and pass@k, written to a JSON report.

    # an HF folder on an AIME-format JSONL or parquet file (fields problem/prompt, answer, id)
    bapo-evaluate Qwen2.5-Math-1.5B/ aime24.parquet --k 16 --out report.json
    # a verl-format parquet file (chat messages, the answer in reward_model.ground_truth),
    # scored by verl's compute_score
    bapo-evaluate Qwen2.5-Math-1.5B/ math500.parquet --answer-key reward_model.ground_truth \\
        --reward verl.utils.reward_score:default_compute_score
    # a Megatron checkpoint (converted, or a trainer's: its step folder or its checkpoint root)
    bapo-evaluate run/checkpoints aime24.jsonl --tokenizer Qwen2.5-Math-1.5B/ \\
        --k 8 --max-new-tokens 4096 --temperature 0.6 --top-p 0.95 --out report.json
    # on a GPU, through vLLM or SGLang in this process
    bapo-evaluate R1-Distill-Qwen-7B/ aime25.parquet --engine vllm --k 32

Prompts go through the tokenizer's chat template (``--system`` adds a system turn); answers are
scored by a reward (``--reward``, default ``math``: math-verify on the last ``\\boxed{}``).
Malformed rows and answers the reward cannot score are counted in the report, not fatal, but a
benchmark none of whose rows can be evaluated is an error; ``--out`` is checked before the
evaluation starts, so that an unwritable path does not lose its results. The library code is
:mod:`bapo_megatron.evaluation.evaluate`; ``python tools/evaluate.py`` is the same command.
"""

from __future__ import annotations

import argparse
import sys


def _ks(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint",
        help="HF folder, Megatron checkpoint folder, or a run's "
        "checkpoint root (its latest step is taken)",
    )
    parser.add_argument(
        "benchmark",
        help="JSONL or parquet file with problem (or prompt), answer and optional id, or the "
        "fields --prompt-key and --answer-key name",
    )
    parser.add_argument(
        "--prompt-key",
        default="prompt",
        help="field holding each problem, text or chat messages; a dotted path into nested "
        "objects (default prompt, or problem in rows without it)",
    )
    parser.add_argument(
        "--answer-key",
        default="answer",
        help="field holding each answer; a dotted path into nested objects, e.g. "
        "reward_model.ground_truth (default answer)",
    )
    parser.add_argument("--out", default="report.json", help="report file (default report.json)")
    parser.add_argument("--k", type=int, default=16, help="samples per problem (default 16)")
    parser.add_argument(
        "--pass-k",
        type=_ks,
        default=None,
        help="comma-separated k of the pass@k reported, each <= --k (default 1,2,4,... and k)",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8, help="problems per engine call")
    parser.add_argument(
        "--engine",
        choices=["embedded", "vllm", "sglang"],
        default="embedded",
        help="embedded (transformers, CPU) or vLLM/SGLang in this process",
    )
    parser.add_argument(
        "--engine-tp", type=int, default=1, help="tensor parallelism of a vLLM/SGLang engine"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder (default: the checkpoint's; needed for trainer "
        "checkpoints, which carry none)",
    )
    parser.add_argument("--system", default=None, help="system prompt before each problem")
    parser.add_argument(
        "--reward",
        default="math",
        help="registered reward name or package.module:function (default math)",
    )
    parser.add_argument(
        "--correct-threshold",
        type=float,
        default=1.0,
        help="a response is correct when its reward is at least this",
    )
    parser.add_argument("--reward-workers", type=int, default=2)
    parser.add_argument(
        "--reward-timeout",
        type=float,
        default=10.0,
        help="seconds per answer check; an overrun counts as a timeout",
    )
    parser.add_argument(
        "--keep-responses",
        action="store_true",
        help="put every response and its reward in the report",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run(argv: list[str] | None = None) -> dict:
    """Run the command line ``argv`` (default: the process's arguments) and return the report;
    exit code 2 on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Heavy imports here, not at the top: the reward pool's (spawn) workers re-import the main
    # module, which imports this one.
    from bapo_megatron.evaluation.evaluate import (
        EvalSettings,
        check_report_path,
        run_evaluation,
        write_report,
    )

    try:
        check_report_path(args.out)  # before the evaluation, whose results it would lose
        settings = EvalSettings(
            k=args.k,
            pass_ks=args.pass_k,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            batch_size=args.batch_size,
            reward=args.reward,
            correct_threshold=args.correct_threshold,
            reward_workers=args.reward_workers,
            reward_timeout_s=args.reward_timeout,
            system=args.system,
            prompt_key=args.prompt_key,
            answer_key=args.answer_key,
            keep_responses=args.keep_responses,
        )
        report = run_evaluation(
            args.checkpoint,
            args.benchmark,
            settings,
            engine=args.engine,
            tokenizer=args.tokenizer,
            engine_tp=args.engine_tp,
            progress=not args.no_progress,
        )
    except ValueError as err:  # bad input: the message names the file, field or setting
        print(f"{parser.prog}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    write_report(report, args.out)
    scores = ", ".join(  # run_evaluation refuses a benchmark that leaves no problem
        [f"avg@{settings.k} {report['avg@k']:.4f}"]
        + [f"pass@{k} {value:.4f}" for k, value in report["pass@k"].items()]
    )
    print(
        f"{report['problems']} problems x {settings.k} samples: {scores}; "
        f"bad rows {report['bad_rows']}, scoring errors "
        f"{report['scoring_errors']}, timeouts {report['timeouts']}, "
        f"{report['wall_time_s']:.0f} s -> {args.out}",
        flush=True,
    )
    return report


def main(argv: list[str] | None = None) -> None:
    """The console script's entry point: :func:`run`, with nothing returned (exit code 0)."""
    run(argv)

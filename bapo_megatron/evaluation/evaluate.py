"""Evaluate a checkpoint on a benchmark: avg@k and pass@k of sampled answers, checked by a reward.

For each problem i of the benchmark, ``n`` responses are sampled (``EvalSettings.k``) and
scored with a named reward (default ``math``: math-verify on the last ``\\boxed{}``); a response
is correct when its reward is at least ``correct_threshold``. The benchmark is read as the
trainer reads its prompt file (:mod:`bapo_megatron.data.prompts`: the fields
``EvalSettings.prompt_key`` and ``answer_key`` name, prompts as text or chat messages), and the
reward may be verl's ``compute_score`` (:mod:`bapo_megatron.rewards.calling`); the numbers a
dict result carries beside its score are averaged in the report's ``reward_metrics``. With c_i
correct responses of n:

- avg@k (k = n, the samples per problem) = mean_i c_i / n, the expected accuracy of one sample;
- pass@k = mean_i [1 - C(n - c_i, k) / C(n, k)] for each k <= n: the unbiased estimator of the
  chance that at least one of k samples is correct (Chen et al. 2021, "Evaluating Large Language
  Models Trained on Code"), computed as a product so that large n does not overflow.

The checkpoint is an HF folder (config.json, safetensors, tokenizer) or a Megatron checkpoint
written by :mod:`bapo_megatron.weights.megatron_checkpoint` or by the trainer
(:mod:`bapo_megatron.trainer.checkpoint`; a run's checkpoint root means its latest step). A Megatron
checkpoint is read in this process at TP1/PP1 and its weights exported into the embedded engine,
or, for vLLM/SGLang, which load from disk, converted to an HF folder in a temporary directory.

Nothing about a single row or answer is fatal: malformed benchmark rows and prompts too long for
the model are counted as bad rows, a reward that raises or overruns its time counts as an error
or a timeout (and the response as incorrect); only a benchmark that leaves no problem at all is
refused. The report is one JSON object
(:func:`write_report`, written aside and renamed into place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bapo_megatron.data.prompts import (
    DEFAULT_ANSWER_KEY,
    DEFAULT_PROMPT_KEY,
    PromptRow,
    load_prompts,
    prompt_token_ids,
)
from bapo_megatron.evaluation.checkpoint_source import (
    load_tokenizer,
    model_config,
    open_engine,
    resolve_checkpoint,
    stop_tokens,
)
from bapo_megatron.files.atomic import write_text_atomically
from bapo_megatron.rewards.pool import RewardPool
from bapo_megatron.rewards.registry import get_reward
from bapo_megatron.rollout.protocol import RolloutEngine, SamplingParams

TIMEOUT = -math.inf
"""Reward the pool gives an overrun check (:func:`reward_pool`); the pool only counts timeouts,
so this value marks which samples they were (a reward that itself returned -inf would be
counted as a timeout too). They count as incorrect."""
_MAX_MESSAGES = 20  # error messages kept in the report per kind; the counts are complete


# ------------------------------------------------------------------------ the estimator


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn without replacement,
    include at least one of the c correct ones. Evaluated as 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def default_pass_ks(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = {n}
    k = 1
    while k < n:
        ks.add(k)
        k *= 2
    return tuple(sorted(ks))


# ------------------------------------------------------------------------ settings and results


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """How a benchmark is evaluated; all of it is written into the report."""

    k: int = 16
    """Samples per problem (n of the estimators)."""
    pass_ks: tuple[int, ...] | None = None
    """The k of each pass@k reported, each <= ``k``; None: 1, 2, 4, ... and ``k``."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024
    """Response length cap; a response cut there is scored as it is and counted as truncated."""
    seed: int = 0
    """Sampling seed; the engine call for the b-th batch of problems uses ``seed + b``."""
    batch_size: int = 8
    """Problems per engine call (each with ``k`` samples)."""
    reward: str = "math"
    """A registered reward name or ``package.module:function``."""
    correct_threshold: float = 1.0
    """A response is correct when its reward is at least this."""
    reward_workers: int = 2
    reward_timeout_s: float = 10.0
    system: str | None = None
    """System prompt put before each problem in the chat template (except problems given as
    chat messages with a system message of their own); None: none."""
    prompt_key: str = DEFAULT_PROMPT_KEY
    """Field of each benchmark row holding the problem, a dotted path (as ``data.prompt_key``:
    with the default, ``problem`` in rows without ``prompt``)."""
    answer_key: str = DEFAULT_ANSWER_KEY
    """Field of each benchmark row holding the answer, a dotted path (as ``data.answer_key``,
    e.g. ``reward_model.ground_truth``)."""
    keep_responses: bool = False
    """Put every decoded response and its reward in the report."""

    def __post_init__(self) -> None:
        for name in ("k", "max_new_tokens", "batch_size", "reward_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.pass_ks is None:
            object.__setattr__(self, "pass_ks", default_pass_ks(self.k))
        ks = tuple(sorted({int(k) for k in self.pass_ks}))
        if not ks or ks[0] < 1 or ks[-1] > self.k:
            raise ValueError(f"pass_ks must lie in [1, k={self.k}], got {list(self.pass_ks)}")
        object.__setattr__(self, "pass_ks", ks)
        self.sampling(0)  # validates temperature, top_p, top_k
        for name in ("prompt_key", "answer_key"):
            path = getattr(self, name)
            if not path or not all(part.strip() for part in path.split(".")):
                raise ValueError(
                    f"{name} must be a field name or a dotted path of field names, got {path!r}"
                )

    def sampling(self, batch: int, stop_token_ids: Sequence[int] = ()) -> SamplingParams:
        return SamplingParams(
            n=self.k,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=tuple(stop_token_ids),
            seed=self.seed + batch,
        )


@dataclass
class ProblemResult:
    """The outcome of one problem's ``n`` samples."""

    id: str
    n: int
    correct: int
    scoring_errors: int = 0
    timeouts: int = 0
    truncated: int = 0
    """Responses cut at ``max_new_tokens``."""
    response_tokens: int = 0
    """Tokens generated over all samples."""
    responses: list[dict[str, Any]] | None = None


@dataclass
class Counts:
    """What went wrong along the way, counted, with the first messages of each kind."""

    bad_rows: list[str] = field(default_factory=list)
    scoring_errors: list[str] = field(default_factory=list)
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)
    """The numbers the reward's dict results carried beside their scores, by name."""


# ------------------------------------------------------------------------ generation and scoring


def reward_pool(settings: EvalSettings) -> RewardPool:
    """The pool :func:`evaluate_rows` expects: timeouts score :data:`TIMEOUT`."""
    return RewardPool(
        settings.reward,
        workers=settings.reward_workers,
        timeout_s=settings.reward_timeout_s,
        timeout_reward=TIMEOUT,
    )


def encode_rows(
    tokenizer,
    rows: Sequence[PromptRow],
    settings: EvalSettings,
    *,
    max_positions: int | None = None,
    counts: Counts | None = None,
) -> list[tuple[PromptRow, list[int]]]:
    """Each row with its prompt's token ids in the chat template. Rows whose prompt plus
    ``max_new_tokens`` exceed ``max_positions`` are left out and recorded in
    ``counts.bad_rows``."""
    encoded = []
    for row in rows:
        ids = prompt_token_ids(tokenizer, row, system=settings.system)
        if max_positions is not None and len(ids) + settings.max_new_tokens > max_positions:
            if counts is not None:
                counts.bad_rows.append(
                    f"problem {row.id!r}: {len(ids)} prompt tokens + "
                    f"max_new_tokens ({settings.max_new_tokens}) exceed the "
                    f"model's {max_positions} positions"
                )
            continue
        encoded.append((row, ids))
    return encoded


def evaluate_rows(
    engine: RolloutEngine,
    tokenizer,
    encoded: Sequence[tuple[PromptRow, list[int]]],
    settings: EvalSettings,
    pool: RewardPool,
    *,
    stop_token_ids: Sequence[int] = (),
    counts: Counts | None = None,
    progress: bool = True,
) -> list[ProblemResult]:
    """Sample ``settings.k`` responses per row of ``encoded`` (from :func:`encode_rows`) with
    ``engine`` (any rollout engine), decode them with ``tokenizer`` and score them with ``pool``
    (from :func:`reward_pool`); reward errors are recorded in ``counts.scoring_errors``."""
    counts = counts if counts is not None else Counts()
    results: list[ProblemResult] = []
    n = settings.k
    bar = tqdm(total=len(encoded), desc="evaluate", unit="problem", disable=not progress)
    with bar:
        for batch_index, start in enumerate(range(0, len(encoded), settings.batch_size)):
            batch = encoded[start : start + settings.batch_size]
            samples = engine.generate(
                [ids for _, ids in batch], settings.sampling(batch_index, stop_token_ids)
            )
            texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
            rows = [row for row, _ in batch for _ in range(n)]
            scored = pool.score(
                texts,
                [row.answer for row in rows],
                data_sources=[row.data_source for row in rows],
                extra_infos=[row.extra_info for row in rows],
            )
            for returned in scored.metrics:
                for name, value in returned.items():
                    counts.reward_metrics.setdefault(name, []).append(value)
            failed = {}  # sample position -> "error" / "timeout"
            for message in scored.errors:
                position, _, text = message.partition(": ")
                failed[int(position)] = "error"
                row, sample = batch[int(position) // n][0], int(position) % n
                counts.scoring_errors.append(f"problem {row.id!r} sample {sample}: {text}")
            # The pool reports timeouts as a count; their reward is the pool's TIMEOUT sentinel.
            for position, reward in enumerate(scored.rewards):
                if reward == TIMEOUT and position not in failed:
                    failed[position] = "timeout"
            for p, (row, _) in enumerate(batch):
                span = range(p * n, (p + 1) * n)  # samples are prompt-major
                result = ProblemResult(
                    id=row.id,
                    n=n,
                    correct=sum(
                        scored.rewards[i] >= settings.correct_threshold and i not in failed
                        for i in span
                    ),
                    scoring_errors=sum(failed.get(i) == "error" for i in span),
                    timeouts=sum(failed.get(i) == "timeout" for i in span),
                    truncated=sum(samples[i].finish_reason == "length" for i in span),
                    response_tokens=sum(len(samples[i].token_ids) for i in span),
                )
                if settings.keep_responses:
                    result.responses = [
                        {
                            "text": texts[i],
                            "finish_reason": samples[i].finish_reason,
                            "reward": None if i in failed else scored.rewards[i],
                            **({"failed": failed[i]} if i in failed else {}),
                        }
                        for i in span
                    ]
                results.append(result)
            bar.update(len(batch))
    return results


def summarize(results: Sequence[ProblemResult], settings: EvalSettings) -> dict[str, Any]:
    """avg@k, pass@k and the per-problem table of ``results``."""
    count = len(results)
    samples = sum(r.n for r in results)
    return {
        "problems": count,
        "samples": samples,
        "avg@k": sum(r.correct / r.n for r in results) / count if count else None,
        "pass@k": {
            str(k): (sum(pass_at_k(r.n, r.correct, k) for r in results) / count if count else None)
            for k in settings.pass_ks
        },
        "truncated": sum(r.truncated for r in results),
        "mean_response_tokens": (
            sum(r.response_tokens for r in results) / samples if samples else None
        ),
        "per_problem": [
            {key: value for key, value in dataclasses.asdict(r).items() if value is not None}
            for r in results
        ],
    }


def run_evaluation(
    checkpoint: str | Path,
    benchmark: str | Path,
    settings: EvalSettings,
    *,
    engine: str = "embedded",
    tokenizer: str | Path | None = None,
    engine_tp: int = 1,
    progress: bool = True,
    context=None,
) -> dict[str, Any]:
    """Evaluate ``checkpoint`` on the benchmark file and return the report (see the module
    docstring). ``ValueError`` for a bad checkpoint, tokenizer, settings or an unreadable
    benchmark without a single usable row; bad rows and answers are only counted."""

    started = time.monotonic()
    get_reward(settings.reward)  # an unknown reward fails before the model is loaded
    prompts = load_prompts(
        benchmark,
        prompt_key=settings.prompt_key,
        answer_key=settings.answer_key,
        skip_bad_rows=True,
    )
    counts = Counts(bad_rows=list(prompts.skipped))
    source = resolve_checkpoint(checkpoint)
    model = model_config(source)
    tok = load_tokenizer(source, tokenizer)
    if len(tok) > model.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tok)} tokens, more than the model's "
            f"vocab_size {model.vocab_size}"
        )
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    encoded = encode_rows(
        tok, prompts.rows, settings, max_positions=model.max_position_embeddings, counts=counts
    )
    if not encoded:  # a report of 0 problems would look like a result
        raise ValueError(
            f"benchmark {benchmark}: no problem left to evaluate: all "
            f"{len(counts.bad_rows)} row(s) were skipped; the first: {counts.bad_rows[0]}"
        )
    longest = max((len(ids) for _, ids in encoded), default=0) + settings.max_new_tokens
    with tempfile.TemporaryDirectory(prefix="bapo-eval-") as work_dir:
        policy = open_engine(
            source,
            engine,
            pad_token_id=int(pad),
            work_dir=Path(work_dir),
            tokenizer_dir=tokenizer,
            max_model_len=longest,
            engine_tp=engine_tp,
            context=context,
        )
        with reward_pool(settings) as pool:
            results = evaluate_rows(
                policy,
                tok,
                encoded,
                settings,
                pool,
                stop_token_ids=stop_tokens(tok, source),
                counts=counts,
                progress=progress,
            )
    summary = summarize(results, settings)
    per_problem = summary.pop("per_problem")
    return {
        "checkpoint": str(source.path),
        "checkpoint_kind": source.kind,
        "benchmark": str(benchmark),
        "engine": engine,
        "tokenizer": str(tokenizer if tokenizer is not None else source.files),
        "settings": dataclasses.asdict(settings),
        **summary,
        "bad_rows": len(counts.bad_rows),
        "bad_row_messages": counts.bad_rows[:_MAX_MESSAGES],
        "scoring_errors": sum(r.scoring_errors for r in results),
        "scoring_error_messages": counts.scoring_errors[:_MAX_MESSAGES],
        "timeouts": sum(r.timeouts for r in results),
        # the mean of each, over the checks that returned it
        "reward_metrics": {
            name: sum(values) / len(values)
            for name, values in sorted(counts.reward_metrics.items())
        },
        "per_problem": per_problem,
        "wall_time_s": time.monotonic() - started,
    }


def check_report_path(path: str | Path) -> None:
    """``ValueError`` naming ``path`` unless a report can be written there: its folder exists or
    can be created, and a file can be created in it. Called before the evaluation, so that a bad
    ``--out`` does not cost the whole run's results. Folders created for the check are removed
    again (:func:`write_report` creates them)."""
    path = Path(path).absolute()
    if path.is_dir():
        raise ValueError(f"report path {path} is a folder; give a file name")
    folders = [path.parent, *path.parent.parents]
    created = [folder for folder in folders if not folder.exists()]
    existing = next(folder for folder in folders if folder.exists())
    if not existing.is_dir():
        raise ValueError(f"report path {path}: {existing} is not a folder; give another --out")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".check")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"report path {path} is not writable: cannot create a file in {path.parent} "
            f"({err.strerror or err}); give another --out"
        ) from None
    finally:
        for folder in created:  # innermost first
            with contextlib.suppress(OSError):
                folder.rmdir()


def write_report(report: dict[str, Any], path: str | Path) -> None:
    """Write ``report`` as JSON at ``path`` atomically: aside in the same folder, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(report, indent=2) + "\n")

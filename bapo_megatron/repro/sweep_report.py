"""The markdown report of a staleness sweep (:mod:`bapo_megatron.repro.sweep`): per run group (one
staleness setting) a table of every run, the seed means per method, the run plots, and for each
of the paper's claims a sentence of what was measured, whichever way it falls.

Numbers come from each run's ``tensorboard/metrics.jsonl`` (the same values as its event files,
one record per rollout step and per optimizer step, so rollout steps that trained nothing, the
first ``lag`` steps of a lag run, keep their own record). Windows: "final" is the mean of the
last :func:`window` records, "first"/"last" entropy the means of the first/last window of
optimizer steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from pathlib import Path

from bapo_megatron.repro.plots import RunGroup, plot_runs
from bapo_megatron.repro.sweep_settings import METHODS, staleness_overrides

RHO0 = 0.4
"""The positive-contribution target of the `paper` preset (share P/(P+N)); the `reference`
preset's q0 = P/N = 1 is a share of 0.5."""
BAPO_METHODS = ("bapo-paper", "bapo-reference")
FIXED_METHODS = ("grpo", "clip-higher", "fixed-0.6")


def window(count: int) -> int:
    """Records averaged for "final" / "first" / "last": a fifth of them, 1 to 10."""
    return max(1, min(10, count // 5))


def _mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def _largest(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return max(values) if values else float("nan")


def summarize_run(output_dir: Path) -> dict[str, float]:
    """The table's numbers of one finished run (NaN where the run logged nothing)."""
    path = Path(output_dir) / "tensorboard" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rollouts = [r for r in records if "reward/mean" in r]
    updates = [r for r in records if "epoch" in r and "bapo/rho_after" in r]
    # An update whose tokens all have advantage 0 (every group of its mini-batch all right or all
    # wrong) has no positive or negative contribution: rho is undefined there (logged as 0) and
    # the gradient is zero, so rho, target and grad-norm statistics leave such updates out.
    signal = [r for r in updates if r["bapo/positive_tokens"] + r["bapo/negative_tokens"] > 0]
    rewards = [r["reward/mean"] for r in rollouts]
    entropy = [r["entropy"] for r in updates]
    grad = [r["grad_norm"] for r in signal]
    rho = [r["bapo/rho_after"] for r in signal]
    w_r, w_u = window(len(rewards)), window(len(updates))
    early = rollouts[: window(len(rollouts))]
    return {
        "final_reward": _mean(rewards[-w_r:]),
        "average_reward": _mean(rewards),
        "entropy_first": _mean(entropy[:w_u]),
        "entropy_last": _mean(entropy[-w_u:]),
        "mean_rho": _mean(rho),
        "rho_at_target": _mean([float(v >= RHO0) for v in rho]),
        "search_target_met": _mean(r["bapo/target_met"] for r in signal),
        "rho_before_below_target": _mean([float(r["bapo/rho_before"] < RHO0) for r in signal]),
        "updates_without_signal": 1 - len(signal) / len(updates) if updates else float("nan"),
        "clip_frac_positive": _mean(r.get("bapo/clip_frac_positive") for r in updates),
        "clip_frac_negative": _mean(r.get("bapo/clip_frac_negative") for r in updates),
        "max_grad_norm": max(grad) if grad else float("nan"),  # the same with or without zeros
        "median_grad_norm": statistics.median(grad) if grad else float("nan"),
        "optimizer_steps": float(len(updates)),
        # policy versions between a token's sampling and its update (reuse, lag, async alike)
        "staleness_mean": _mean(r.get("staleness/mean") for r in updates),
        "staleness_max": _largest(r.get("staleness/max") for r in updates),
        "dropped_groups": float(sum(r.get("async/dropped_groups", 0.0) for r in rollouts)),
        "rollout_steps": float(len(rollouts)),
        # the task check: lengths and truncation in the first window, right after the warm-up
        "early_accuracy": _mean(r["reward/accuracy"] for r in early),
        "early_length_right": _mean(
            r["response_length/right"] for r in early if r["reward/accuracy"] > 0
        ),
        "early_length_wrong": _mean(
            r["response_length/wrong"] for r in early if r["reward/accuracy"] < 1
        ),
        "early_truncated": _mean(r["rollout/truncated_fraction"] for r in early),
    }


def _fmt(value: float, digits: int = 3) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


_COLUMNS = (
    ("final reward", "final_reward", 3),
    ("avg reward", "average_reward", 3),
    ("entropy first -> last", None, 3),
    ("mean rho", "mean_rho", 3),
    ("clip+ (A>0, r>c_high)", "clip_frac_positive", 4),
    ("clip- (A<0, r<c_low)", "clip_frac_negative", 4),
    ("max grad norm", "max_grad_norm", 2),
)


def _row(label: list[str], s: dict[str, float], wall: float | None) -> str:
    cells = list(label)
    for _, key, digits in _COLUMNS:
        if key is None:
            cells.append(f"{_fmt(s['entropy_first'])} -> {_fmt(s['entropy_last'])}")
        else:
            cells.append(_fmt(s[key], digits))
    cells.append("n/a" if wall is None else f"{wall:.0f}")
    return "| " + " | ".join(cells) + " |"


def _header(first: list[str]) -> list[str]:
    names = [*first, *(name for name, _, _ in _COLUMNS), "wall s"]
    return ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]


def seed_means(summaries: list[dict[str, float]]) -> dict[str, float]:
    return {key: _mean(s[key] for s in summaries) for key in summaries[0]}


def _spread(values: list[float]) -> str:
    values = [v for v in values if math.isfinite(v)]
    if len(values) < 2:
        return "one seed, no spread"
    return f"seeds {min(values):.3f}..{max(values):.3f}"


def claims(groups: dict[str, dict[str, list[dict[str, float]]]]) -> list[str]:
    """One paragraph per claim, from ``groups[staleness][method] = [summary per seed]``."""
    lines = []

    def per_group(key: str, digits: int = 3) -> list[str]:
        out = []
        for staleness, methods in groups.items():
            parts = [
                f"{m} {_fmt(_mean(s[key] for s in runs), digits)}" for m, runs in methods.items()
            ]
            out.append(f"{staleness}: " + ", ".join(parts))
        return out

    def compare(key: str, better) -> str:
        """How often each BAPO preset beat every fixed-clip method present, by seed means."""
        verdicts = []
        for bapo in BAPO_METHODS:
            wins = total = 0
            for methods in groups.values():
                fixed = [m for m in FIXED_METHODS if m in methods]
                if bapo not in methods or not fixed:
                    continue
                total += 1
                mine = _mean(s[key] for s in methods[bapo])
                wins += all(better(mine, _mean(s[key] for s in methods[m])) for m in fixed)
            if total:
                verdicts.append(
                    f"{bapo} beat every fixed-clip method in {wins} of {total} settings"
                )
        return "; ".join(verdicts) if verdicts else "no BAPO and fixed-clip pair to compare"

    lines.append(
        "**The premise** (paper: negative tokens dominate the clipped objective, so the "
        f"positive contribution before any adaptation sits below rho0). Share of optimizer "
        f"steps whose rho before the search was below {RHO0}: "
        + "; ".join(per_group("rho_before_below_target", 2))
        + ". Where that share is small, the bounds have little to correct on this task and "
        "the methods can only differ through the lower bound's clipping of negative tokens."
    )
    lines.append(
        "**Entropy preserved** (paper: entropy falls with fixed clipping as staleness "
        "grows, stays higher with BAPO). Last-window entropy, seed means: "
        + "; ".join(per_group("entropy_last"))
        + ". Ending with higher entropy: "
        + compare("entropy_last", lambda a, b: a > b)
        + "."
    )
    lines.append(
        f"**Positive contribution held near rho0** ({RHO0} for `paper`; `reference` aims "
        "at P/N >= 1, a share of 0.5). Mean rho after the search: "
        + "; ".join(per_group("mean_rho"))
        + ". Share of optimizer steps with "
        f"rho >= {RHO0}: "
        + "; ".join(per_group("rho_at_target", 2))
        + ". Share of BAPO's searches that met their target (the rest stopped at the "
        "bounds' maxima): "
        + "; ".join(
            f"{st}: "
            + ", ".join(
                f"{m} {_fmt(_mean(s['search_target_met'] for s in runs), 2)}"
                for m, runs in methods.items()
                if m in BAPO_METHODS
            )
            for st, methods in groups.items()
        )
        + ". Higher mean rho: "
        + compare("mean_rho", lambda a, b: a > b)
        + "."
    )
    lines.append(
        "**Grad norm without spikes** (paper: fixed clipping spikes under staleness). "
        "Max / median grad norm, seed means: "
        + "; ".join(
            f"{st}: "
            + ", ".join(
                f"{m} {_fmt(_mean(s['max_grad_norm'] for s in runs), 2)}/"
                f"{_fmt(_mean(s['median_grad_norm'] for s in runs), 2)}"
                for m, runs in methods.items()
            )
            for st, methods in groups.items()
        )
        + ". Lower max grad norm: "
        + compare("max_grad_norm", lambda a, b: a < b)
        + "."
    )
    reward_lines = []
    for staleness, methods in groups.items():
        parts = [
            f"{m} {_fmt(_mean(s['final_reward'] for s in runs))} "
            f"({_spread([s['final_reward'] for s in runs])})"
            for m, runs in methods.items()
        ]
        reward_lines.append(f"{staleness}: " + ", ".join(parts))
    lines.append(
        "**Higher reward under staleness.** Final reward, seed means: "
        + "; ".join(reward_lines)
        + ". Higher final reward: "
        + compare("final_reward", lambda a, b: a > b)
        + " (ties do not count). A difference smaller than the seed spread is not evidence "
        "either way."
    )
    return lines


def _timing(runs, records: list[dict], jobs: int) -> str:
    """The sweep's wall time, from the first run's start to the last one's end (each finished
    run's ``run.json`` is written as it ends, after ``wall_s`` seconds), so a sweep continued
    after an interruption counts the pause too."""
    spans = []
    for run, record in zip(runs, records):
        path = run.output_dir / "run.json"
        if record["returncode"] == 0 and path.is_file():
            end = path.stat().st_mtime
            spans.append((end - record["wall_s"], end))
    if not spans:
        return "No run finished; no timing."
    total = sum(record["wall_s"] for record in records)
    span = max(end for _, end in spans) - min(start for start, _ in spans)
    return (
        f"The sweep took {span / 60:.1f} minutes from the first run's start to the last "
        f"run's end ({len(spans)} finished runs, {jobs} at a time, {total / 60:.1f} "
        f"run-minutes in all, on a machine with {os.cpu_count()} CPUs); the shared warm-up "
        "start comes before that."
    )


def write_report(settings, out: Path, runs, records: list[dict], config: Path) -> Path:
    """``<out>/report.md`` (and ``<out>/plots/<staleness>/*.png``); returns its path."""

    out = Path(out)
    lines = [
        "# BAPO staleness sweep",
        "",
        (
            f"Task `{settings.task}`; {len(runs)} runs "
            f"({len(settings.methods)} methods x {len(settings.staleness)} staleness settings x "
            f"{len(settings.seeds)} seeds), all from one shared warm-up start "
            f"(`{out / 'start' / 'model'}`). Settings were fixed before any run:"
        ),
        "",
        "```json",
        json.dumps(dataclasses.asdict(settings), indent=2),
        "```",
        "",
        (
            f"Base configuration: `{config}`. Methods: "
            + "; ".join(f"`{m}`: `{' '.join(METHODS[m])}`" for m in settings.methods)
            + ". Staleness: "
            + "; ".join(
                f"`{s}`: `{' '.join(staleness_overrides(s, settings))}`" for s in settings.staleness
            )
            + "."
        ),
        "",
        (
            "Final reward: mean of the last window of rollout steps; entropy first -> last: means "
            "of the first and last window of optimizer steps (a window is a fifth of the records, "
            "1 to 10); mean rho: `bapo/rho_after` over optimizer steps that had tokens with a "
            "non-zero advantage (rho, the search's target and the grad-norm statistics leave out "
            "updates whose groups were all right or all wrong: no contribution, zero gradient); "
            "clip fractions: "
            "`bapo/clip_frac_positive`, `bapo/clip_frac_negative`."
        ),
        "",
    ]
    summaries: dict[str, dict] = {}
    failed = []
    for run, record in zip(runs, records):
        if record["returncode"] != 0:
            failed.append(
                f"{run.name} (exit {record['returncode']}, log {run.output_dir / 'train.log'})"
            )
            continue
        summaries[run.name] = summarize_run(run.output_dir)
    if failed:
        lines += ["**Failed runs** (left out of the tables): " + "; ".join(failed), ""]

    done = list(summaries.values())
    if done:
        lines += [
            "## The task after the warm-up",
            "",
            (
                "First window of rollout steps, mean over all runs: accuracy "
                f"{_fmt(_mean(s['early_accuracy'] for s in done))}, response length right "
                f"{_fmt(_mean(s['early_length_right'] for s in done), 1)} / wrong "
                f"{_fmt(_mean(s['early_length_wrong'] for s in done), 1)} tokens (cap "
                f"{settings.max_new_tokens}), truncated fraction "
                f"{_fmt(_mean(s['early_truncated'] for s in done))}."
            ),
            "",
        ]

    groups: dict[str, dict[str, list[dict]]] = {}
    for staleness in settings.staleness:
        members = [(run, rec) for run, rec in zip(runs, records) if run.staleness == staleness]
        lines += [f"## {staleness}", "", *_header(["method", "seed"])]
        for run, record in members:
            if run.name in summaries:
                lines.append(
                    _row([run.method, str(run.seed)], summaries[run.name], record["wall_s"])
                )
                groups.setdefault(staleness, {}).setdefault(run.method, []).append(
                    summaries[run.name]
                )
        lines += ["", "Seed means:", "", *_header(["method", "seeds"])]
        for method, per_seed in groups.get(staleness, {}).items():
            walls = [
                rec["wall_s"]
                for run, rec in members
                if run.method == method and run.name in summaries
            ]
            lines.append(_row([method, str(len(per_seed))], seed_means(per_seed), _mean(walls)))
        if staleness in groups:
            empty = _mean(
                s["updates_without_signal"] for runs in groups[staleness].values() for s in runs
            )
            members_done = [s for runs in groups[staleness].values() for s in runs]
            lines += [
                "",
                (
                    f"Optimizer steps whose tokens all had advantage 0: {_fmt(100 * empty, 1)}% "
                    "(left out of the rho and grad-norm statistics). Staleness of the trained "
                    "tokens (policy versions behind): mean "
                    f"{_fmt(_mean(s['staleness_mean'] for s in members_done), 2)}, max "
                    f"{_fmt(_largest(s['staleness_max'] for s in members_done), 0)}; groups "
                    "dropped as older than eta: "
                    f"{sum(s['dropped_groups'] for s in members_done):.0f}."
                ),
            ]
        plot_groups = [
            RunGroup(
                label=method,
                log_dirs=tuple(
                    run.output_dir / "tensorboard"
                    for run, _ in members
                    if run.method == method and run.name in summaries
                ),
            )
            for method in settings.methods
        ]
        plot_groups = [g for g in plot_groups if g.log_dirs]
        if plot_groups:
            result = plot_runs(plot_groups, out / "plots" / staleness, rho0=RHO0)
            lines += [
                "",
                " ".join(
                    f"![{p.stem}]({p.relative_to(out)})"
                    for p in result.files
                    if p.stem == "overview"
                ),
                "",
                "Panels: " + ", ".join(f"[{p.stem}]({p.relative_to(out)})" for p in result.files),
            ]
        lines.append("")
    lines += [_timing(runs, records, settings.jobs), ""]
    lines += ["## The paper's claims, as this sweep measured them", ""]
    lines += [f"- {line}" for line in claims(groups)] if groups else ["- No run finished."]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report

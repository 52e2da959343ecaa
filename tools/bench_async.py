"""Benchmark asynchronous training: colocated synchronous against disaggregated eta = 0, 1, 2, 4.

Every mode trains the tiny CPU example (examples/tiny_cpu/train.yaml) from one shared warm start
(its supervised warm-up and one RL step, built once, loaded with ``train.load_checkpoint``) on
the same data, seeds and settings, with one optimizer step per rollout step
(``algorithm.optimizer_steps_per_rollout=1``, so eta = k lets the engine run k rollout steps
ahead), and the same CPU cores. The defaults (16 prompts x 8 samples, micro-batches of 128,
100 rollout steps) make generation and training cost about the same in the colocated run
(``time/rollout`` against the rest of the step; the JSON reports the balance as
``colocated_rollout_over_train``).

- ``colocated``: one process, 2 threads (``OMP_NUM_THREADS=2``): the synchronous loop, generation
  and training alternating on both cores. One process and not two (TP2 or DP2): a colocated
  engine runs on each replica's first rank only, so at TP2 one core would idle during every
  rollout, and DP2 halves the prompts per engine and adds a gradient all-reduce; one process
  with two threads is what gives the synchronous loop both cores in both phases.
- ``colocated-1t``: the same with 1 thread (a reference: does the second thread help?).
- ``eta<k>``: torchrun with 2 processes x 1 thread, rank 0 trains and rank 1 runs the embedded
  engine (``rollout.placement=disaggregated rollout.engine_ranks=1
  algorithm.max_staleness=k``); eta0 is the synchronous loop over the two processes.

Steady state: the rollout steps after the first ``--skip`` (start-up, the first generation, the
pipeline filling). Wall time comes from the TensorBoard events of the rollout-step records
(``reward/mean``; the trainer stamps each with ``time.time()`` when it logs it): steps per
minute = steps of the window / wall seconds between the record before the window and its last.
Per step (rollout-step record of metrics.jsonl):

- rollout time: the engine's generation seconds of the step's item (``async/engine_generate_s``)
  in asynchronous modes, ``time/rollout`` otherwise;
- train time: the trainer's work, ``time/step - time/rollout`` (reward, old log-probs, train,
  weight push: every phase but the wait for the rollout);
- trainer idle share: sum of ``time/rollout`` (generating in a colocated process, waiting for
  the rollout otherwise) / wall; engine idle share: 1 - sum of rollout time / wall;
- weight update: ``time/weight_sync`` (the trainer's push) and, asynchronous, the engine's load
  (``async/engine_weight_load_s``), each as a share of the wall time;
- staleness: ``staleness/mean`` and ``staleness/max`` of the window's optimizer steps.

Targets: eta >= 1 at >= 1.5x the colocated steps per minute; median step time <=
1.15x max(rollout time, train time) of the step; weight update < 5% of the step. The last line
printed is one JSON object with every figure, the ratios and the targets.

Usage: python3 tools/bench_async.py [--steps 100] [--modes colocated,eta0,eta1,eta2,eta4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny_cpu" / "train.yaml"
MODES = ("colocated", "colocated-1t", "eta0", "eta1", "eta2", "eta4")
DEFAULT_MODES = "colocated,colocated-1t,eta0,eta1,eta2,eta4"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, from {MODES}")
    parser.add_argument("--steps", type=int, default=100, help="rollout steps per mode")
    parser.add_argument("--skip", type=int, default=5, help="rollout steps before steady state")
    parser.add_argument("--prompts", type=int, default=16, help="rollout.prompts_per_step")
    parser.add_argument("--samples", type=int, default=8, help="rollout.samples_per_prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=128)
    parser.add_argument(
        "--sync-interval",
        type=int,
        default=1,
        help="rollout.sync_interval of the asynchronous modes (capped at their eta)",
    )
    parser.add_argument("--warmup-steps", type=int, default=150, help="of the shared warm start")
    parser.add_argument("--data-size", type=int, default=4000, help="data.synthetic_size")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per mode")
    parser.add_argument("--keep", help="folder for the runs (default: a temporary one)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny configuration for the smoke test (4 rollout steps of 4 x 4 samples, a "
        "warm start of 1 warm-up step)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.skip, args.prompts, args.samples = 4, 1, 4, 4
        args.max_new_tokens, args.micro_batch_size = 8, 16
        # one warm-up step runs the warm-up's code; its quality matters to no figure here
        args.warmup_steps, args.data_size = 1, 200
    if not 1 <= args.skip < args.steps:
        parser.error(f"--skip must be in [1, --steps), got {args.skip} with --steps {args.steps}")
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    return args


# ------------------------------------------------------------------------ runs


def run_settings(args: argparse.Namespace) -> list[str]:
    """Overrides every run shares (the warm start adds its own)."""
    return [
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"actor.micro_batch_size={args.micro_batch_size}",
        f"data.synthetic_size={args.data_size}",
        "algorithm.optimizer_steps_per_rollout=1",
        # every step the same work: no periodic recomputation of the actor's log-probs
        "logging.logprob_diff_interval=0",
        "logging.console=false",
        "checkpoint.interval=0",
        "train.seed=0",
    ]


def environment(threads: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "ignore"
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def run(command: list[str], threads: int, output: Path, timeout: float, what: str) -> float:
    """Run ``command`` (log into ``output``/bench.log); its wall seconds. Raises naming ``what``."""
    output.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with open(output / "bench.log", "w") as log:
        # a session of its own: on timeout every rank torchrun started goes too
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=environment(threads),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RuntimeError(f"{what} did not finish within {timeout:.0f} s") from None
    if code != 0:
        tail = (output / "bench.log").read_text()[-4000:]
        raise RuntimeError(f"{what} failed (exit {code}); log {output / 'bench.log'}:\n{tail}")
    return time.monotonic() - began


def train_command(overrides: list[str], processes: int) -> list[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    return [
        sys.executable,
        *(launcher if processes > 1 else []),
        "-m",
        "bapo_megatron.train",
        "--config",
        str(CONFIG),
        *overrides,
    ]


def build_warm_start(args: argparse.Namespace, folder: Path) -> Path:
    """The tiny example after its warm-up and one RL step of its own settings (one process,
    2 threads): a trainer checkpoint every mode starts from. A start already in ``folder`` from
    the same warm-up (``--keep`` of an earlier call) is reused."""
    checkpoint = folder / "checkpoints" / "step_00000001"
    key = {"warmup_steps": args.warmup_steps, "data_size": args.data_size}
    key_file = folder / "warm_start.json"
    if checkpoint.is_dir() and key_file.is_file() and json.loads(key_file.read_text()) == key:
        return checkpoint
    overrides = [
        f"data.synthetic_size={args.data_size}",
        f"warmup.steps={args.warmup_steps}",
        "train.steps=1",
        "checkpoint.interval=0",
        "logging.console=false",
        f"train.output_dir={folder}",
    ]
    run(train_command(overrides, 1), 2, folder, args.timeout, "the warm start")
    key_file.write_text(json.dumps(key) + "\n")
    return checkpoint


def run_mode(mode: str, args: argparse.Namespace, start: Path, folder: Path) -> dict:
    """Train ``mode`` from ``start`` into ``folder`` (emptied first: a run left there would be
    resumed); its figures (:func:`steady_state`)."""
    shutil.rmtree(folder, ignore_errors=True)
    overrides = [
        *run_settings(args),
        "warmup.steps=0",
        f"train.load_checkpoint={start}",
        f"train.steps={args.steps}",
        f"train.output_dir={folder}",
    ]
    if mode.startswith("colocated"):
        threads, processes = (1 if mode == "colocated-1t" else 2), 1
    else:
        threads, processes = 1, 2
        overrides += [
            "rollout.placement=disaggregated",
            "rollout.engine_ranks=1",
            f"algorithm.max_staleness={int(mode[3:])}",
        ]
        eta = int(mode[3:])
        if eta:  # at most eta, so that the engines always keep one rollout step of lookahead
            overrides.append(f"rollout.sync_interval={min(args.sync_interval, eta)}")
    wall = run(train_command(overrides, processes), threads, folder, args.timeout, f"mode {mode}")
    asynchronous = mode.startswith("eta") and mode != "eta0"
    figures = steady_state(folder, args.skip, asynchronous=asynchronous)
    return {"processes": processes, "threads": threads, "process_wall_s": wall, **figures}


# ------------------------------------------------------------------------ figures


def records(folder: Path) -> tuple[list[dict], list[dict]]:
    """(rollout-step records, optimizer-step records) of a run's metrics.jsonl."""
    lines = (folder / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    every = [json.loads(line) for line in lines if line.strip()]
    rollouts = [r for r in every if "reward/mean" in r]
    updates = [r for r in every if "grad_norm" in r and "reward/mean" not in r]
    return rollouts, updates


def record_wall_times(folder: Path) -> list[float]:
    """When each rollout-step record was logged (its TensorBoard events' wall time), in order."""
    accumulator = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [event.wall_time for event in accumulator.Scalars("reward/mean")]


def steady_state(folder: Path, skip: int, *, asynchronous: bool) -> dict:
    """The figures of the rollout steps after the first ``skip`` (see the module docstring)."""
    rollouts, updates = records(folder)
    walls = record_wall_times(folder)
    if len(walls) != len(rollouts):
        raise RuntimeError(
            f"{folder}: {len(rollouts)} rollout records but {len(walls)} TensorBoard events"
        )
    window = rollouts[skip:]
    intervals = [b - a for a, b in zip(walls[skip - 1 :], walls[skip:])]
    wall = walls[-1] - walls[skip - 1]
    rollout_s = [
        r["async/engine_generate_s"] if asynchronous else r["time/rollout"] for r in window
    ]
    waits = [r["time/rollout"] for r in window]
    train_s = [r["time/step"] - r["time/rollout"] for r in window]
    bound = [i / max(g, t) for i, g, t in zip(intervals, rollout_s, train_s)]
    steps = {r["rollout_step"] for r in window}
    stale = [u for u in updates if u["rollout_step"] in steps]
    out = {
        "steady_steps": len(window),
        "steady_wall_s": wall,
        "steps_per_minute": 60.0 * len(window) / wall,
        "step_s_median": statistics.median(intervals),
        "rollout_s_mean": statistics.fmean(rollout_s),
        "train_s_mean": statistics.fmean(train_s),
        "time_train_s_mean": statistics.fmean(r.get("time/train", 0.0) for r in window),
        "step_over_bound_median": statistics.median(bound),
        "step_over_bound_max": max(bound),
        "steps_within_1_15": sum(b <= 1.15 for b in bound) / len(bound),
        "trainer_idle_share": sum(waits) / wall,
        "engine_idle_share": max(0.0, 1.0 - sum(rollout_s) / wall),
        "weight_update_s_mean": statistics.fmean(r.get("time/weight_sync", 0.0) for r in window),
        "weight_update_share": sum(r.get("time/weight_sync", 0.0) for r in window) / wall,
        "staleness_mean": statistics.fmean(u["staleness/mean"] for u in stale),
        "staleness_max": max(u["staleness/max"] for u in stale),
        "reward_mean": statistics.fmean(r["reward/mean"] for r in window),
        "generated_tokens_mean": statistics.fmean(r["rollout/generated_tokens"] for r in window),
    }
    if asynchronous:
        load = sum(r["async/engine_weight_load_s"] for r in window)
        out["engine_weight_load_share"] = load / wall
        out["dropped_groups"] = sum(r["async/dropped_groups"] for r in window)
        out["queued_items_mean"] = statistics.fmean(r["async/queued_items"] for r in window)
    return out


def targets(report: dict) -> dict:
    """Ratios against the colocated run and each issue-16 target, met or not, per mode."""
    base = report.get("colocated")
    out = {}
    for mode, figures in report.items():
        entry = {
            "step_time_within_1_15x_bound": figures["step_over_bound_median"] <= 1.15,
            "weight_update_below_5_percent": figures["weight_update_share"] < 0.05,
        }
        if base is not None:
            ratio = figures["steps_per_minute"] / base["steps_per_minute"]
            entry["steps_per_minute_vs_colocated"] = ratio
            if mode.startswith("eta") and mode != "eta0":
                entry["async_at_least_1_5x"] = ratio >= 1.5
        out[mode] = entry
    return out


def summary_line(mode: str, f: dict, t: dict) -> str:
    ratio = t.get("steps_per_minute_vs_colocated")
    return (
        f"{mode:13s} {f['steps_per_minute']:6.1f} steps/min"
        + (f" ({ratio:4.2f}x)" if ratio is not None else "")
        + f"  step {f['step_s_median']:5.2f} s = {f['step_over_bound_median']:4.2f}x bound"
        f"  rollout {f['rollout_s_mean']:5.2f} s  train {f['train_s_mean']:5.2f} s"
        f"  idle trainer {100 * f['trainer_idle_share']:3.0f}%"
        f" engine {100 * f['engine_idle_share']:3.0f}%"
        f"  weights {100 * f['weight_update_share']:4.1f}%"
        f"  staleness {f['staleness_mean']:4.2f} (max {f['staleness_max']:.0f})"
    )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        start = build_warm_start(args, work / "start")
        print(f"warm start ready ({time.monotonic() - began:.0f} s)", flush=True)
        report = {}
        for mode in args.modes:
            report[mode] = run_mode(mode, args, start, work / mode)
            print(summary_line(mode, report[mode], targets(report)[mode]), flush=True)
    colocated = report.get("colocated")
    balance = colocated["rollout_s_mean"] / colocated["train_s_mean"] if colocated else None
    config = {k: v for k, v in vars(args).items() if k != "keep"}
    print(f"benchmark took {time.monotonic() - began:.0f} s", flush=True)
    print(
        json.dumps(
            dict(
                benchmark="async",
                config=config,
                colocated_rollout_over_train=balance,
                modes=report,
                targets=targets(report),
            )
        )
    )


if __name__ == "__main__":
    from bapo_megatron.process.end import skip_final_collection
    from bapo_megatron.process.start import prepare_process

    prepare_process()
    main(sys.argv[1:])
    skip_final_collection()

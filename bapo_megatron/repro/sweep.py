"""The staleness sweep: clipping methods x staleness settings x seeds on a synthetic
task, on the CPU, all from one shared warm-up, then a markdown report
(:mod:`bapo_megatron.repro.sweep_report`).

    python tools/sweep.py --out runs/sweep [--minimal] [--jobs 2]

1. The start, once: a model of the tiny example's architecture from random weights, trained with the
   supervised warm-up (:mod:`bapo_megatron.trainer.warmup`) on the task's reference responses to a
   success rate between 0 and 1, written as an HF folder (weights, ``config.json``, the task's
   tokenizer) next to the task's prompts as a JSONL file. Every run starts from that folder
   (``train.model_path``) on that file (``data.train_file``), so runs differ only in their method,
   staleness and seed. (The folder, not ``data.synthetic_task`` plus ``train.load_checkpoint``,
   because the run's prompts and weights are then fixed files every run shares.)
2. Each run is its own ``python -m bapo_megatron.train`` process (``OMP_NUM_THREADS=1``), up to
   ``--jobs`` processes at a time, in ``<out>/runs/<staleness>/<method>/seed<k>``; an `async<k>`
   run is two processes under torchrun (a trainer and an engine rank) and counts twice. A
   finished run leaves ``run.json`` and is not run again, so an interrupted sweep continues
   where it stopped.
3. The report reads the runs' TensorBoard logs (``<out>/report.md``, plots in ``<out>/plots``).

Every setting is fixed in :class:`SweepSettings` before any run starts and written into
``<out>/settings.json`` and the report; nothing is tuned on the outcome.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.config.loading import load_config
from bapo_megatron.data.synthetic_task import counting_tokenizer, synthetic_rows
from bapo_megatron.data.task import Task
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.repro.sweep_report import write_report
from bapo_megatron.repro.sweep_settings import (
    METHODS,
    SweepSettings,
    processes,
    staleness_overrides,
)
from bapo_megatron.trainer.warmup import run_warmup
from bapo_megatron.weights.convert import write_hf_folder


@dataclass
class RunSpec:
    staleness: str
    method: str
    seed: int
    output_dir: Path
    overrides: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.staleness}/{self.method}/seed{self.seed}"


def plan_runs(settings: SweepSettings, out: Path) -> list[RunSpec]:
    """Every run of the sweep, staleness-major (so a group's runs finish together)."""
    runs = []
    for staleness in settings.staleness:
        for method in settings.methods:
            for seed in settings.seeds:
                directory = out / "runs" / staleness / method / f"seed{seed}"
                overrides = [
                    *METHODS[method],
                    *staleness_overrides(staleness, settings),
                    f"train.seed={seed}",
                    f"train.output_dir={directory}",
                    *settings.extra_overrides,
                ]
                runs.append(RunSpec(staleness, method, seed, directory, overrides))
    return runs


# ------------------------------------------------------------------ the shared start


def _tiny_config(settings: SweepSettings, overrides: list[str]):
    root = Path(__file__).resolve().parents[2]  # the checkout (bapo_megatron/repro/sweep.py)
    return load_config(
        root / "examples" / "tiny_cpu" / "train.yaml",
        [
            f"warmup.steps={settings.warmup_steps}",
            f"warmup.lr={settings.warmup_lr}",
            f"warmup.batch_size={settings.warmup_batch_size}",
            f"actor.micro_batch_size={settings.micro_batch_size}",
            f"actor.temperature={settings.temperature}",
            f"rollout.max_new_tokens={settings.max_new_tokens}",
            # the warm-up's references are the task's (`count_up_and_stop`'s often run on)
            f"data.synthetic_task={settings.task}",
            "train.seed=0",
            *overrides,
        ],
    )


def prepare_start(settings: SweepSettings, start: Path) -> Path:
    """Write the shared start into ``start`` (``prompts.jsonl`` and the HF folder ``model/``)
    unless it is there already; returns ``start``. Runs the warm-up in this process, one thread."""

    model_dir = start / "model"
    if (model_dir / "config.json").is_file():
        return start
    start.mkdir(parents=True, exist_ok=True)
    rows = synthetic_rows(settings.task, settings.task_size, seed=0)
    with open(start / "prompts.jsonl", "w") as f:
        f.writelines(
            json.dumps({"id": row.id, "prompt": row.prompt, "answer": row.answer}) + "\n"
            for row in rows
        )
    cfg = _tiny_config(settings, [])
    tokenizer = counting_tokenizer()
    task = Task(rows=rows, tokenizer=tokenizer, model=cfg.model)
    files = start / "hf_files"
    files.mkdir(exist_ok=True)
    tokenizer.save_pretrained(files)
    (files / "config.json").write_text(json.dumps(cfg.model.to_hf_config(), indent=2) + "\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    context = ParallelContext.initialize(cfg.parallel)
    try:
        actor = build_actor(task.model, cfg.actor, cfg.optimizer, context)
        losses = []
        run_warmup(cfg, task, actor, lambda step, m: losses.append(m["warmup/cross_entropy"]))
        write_hf_folder(
            actor.chunks,
            task.model,
            model_dir,
            context,
            files=sorted(files.iterdir()),
            dtype=torch.float32,
        )
    finally:
        context.teardown()
        torch.set_num_threads(threads)
    (start / "warmup.json").write_text(json.dumps({"cross_entropy": losses}) + "\n")
    return start


def base_config(settings: SweepSettings, start: Path, path: Path) -> Path:
    """The YAML every run starts from (its overrides add method, staleness, seed, folder)."""

    config = {
        "data": {"train_file": str(start / "prompts.jsonl")},
        "reward": {"name": "exact_match", "workers": 1},
        "rollout": {
            "engine": "embedded",
            "prompts_per_step": settings.prompts_per_step,
            "samples_per_prompt": settings.samples_per_prompt,
            "max_new_tokens": settings.max_new_tokens,
        },
        "loss": {"aggregation": "token-mean", "clip": {"preset": "paper"}},
        "actor": {
            "micro_batch_size": settings.micro_batch_size,
            "temperature": settings.temperature,
            "seed": 1,
        },
        "optimizer": {"lr": settings.lr, "weight_decay": 0.0, "clip_grad": 1.0},
        "train": {"model_path": str(start / "model"), "steps": settings.steps},
        "checkpoint": {"interval": 0, "keep_last": 1},
        "logging": {"console": True, "logprob_diff_interval": 0},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ------------------------------------------------------------------ running


def run_environment() -> dict[str, str]:
    """One thread per run, the repository importable, no inherited torchrun variables."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def training_command(config: Path, run: RunSpec) -> list[str]:
    """The run's command: one process, or torchrun with a process per rank (async runs)."""
    count = processes(run.staleness)
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={count}"]
    return [
        sys.executable,
        *(launcher if count > 1 else []),
        "-m",
        "bapo_megatron.train",
        "--config",
        str(config),
        *run.overrides,
    ]


class ProcessSlots:
    """At most ``total`` training processes at a time: a run holds as many slots as it starts
    processes (capped at ``total``, so a run never waits for more than there are)."""

    def __init__(self, total: int) -> None:
        self.total, self._free = total, total
        self._changed = threading.Condition()

    def acquire(self, count: int) -> int:
        """Wait for ``count`` free slots (at most ``total``) and take them; returns the number."""
        count = min(count, self.total)
        with self._changed:
            self._changed.wait_for(lambda: self._free >= count)
            self._free -= count
        return count

    def release(self, count: int) -> None:
        with self._changed:
            self._free += count
            self._changed.notify_all()


def execute(config: Path, run: RunSpec, timeout_s: float | None = None) -> dict:
    """Run one training process (unless ``run.json`` says it finished); its record."""
    record_path = run.output_dir / "run.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    run.output_dir.mkdir(parents=True, exist_ok=True)
    command = training_command(config, run)
    began = time.monotonic()
    with open(run.output_dir / "train.log", "w") as log:
        # a session of its own: on timeout, the ranks torchrun started are ended with it
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=run_environment(),
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = "timeout"
    record = {
        "name": run.name,
        "staleness": run.staleness,
        "method": run.method,
        "seed": run.seed,
        "returncode": code,
        "wall_s": time.monotonic() - began,
        "command": " ".join(command),
    }
    if code == 0:
        record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def run_sweep(settings: SweepSettings, out: str | Path, *, progress=print) -> Path:
    """The whole sweep into ``out``; returns the report's path."""

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(dataclasses.asdict(settings), indent=2) + "\n")
    began = time.monotonic()
    start = prepare_start(settings, out / "start")
    progress(f"shared start ready in {start} ({time.monotonic() - began:.0f} s)")
    config = base_config(settings, start, out / "base.yaml")
    runs = plan_runs(settings, out)
    records = []
    slots = ProcessSlots(settings.jobs)

    def one(run: RunSpec) -> dict:
        taken = slots.acquire(processes(run.staleness))
        try:
            record = execute(config, run)
        finally:
            slots.release(taken)
        records.append(record)
        returncode = record["returncode"]
        status = "ok" if returncode == 0 else "FAILED (" + str(returncode) + ")"
        progress(f"[{len(records)}/{len(runs)}] {run.name}: {status} in {record['wall_s']:.0f} s")
        return record

    with ThreadPoolExecutor(max_workers=settings.jobs) as pool:
        results = list(pool.map(one, runs))
    report = write_report(settings, out, runs, results, config)
    progress(f"report: {report} (sweep {time.monotonic() - began:.0f} s)")
    return report

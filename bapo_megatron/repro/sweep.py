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
   because the trainer's task loader only generates `walk` rows.)
2. Each run is its own ``python -m bapo_megatron.train`` process (``OMP_NUM_THREADS=1``), up to
   ``--jobs`` at a time, in ``<out>/runs/<staleness>/<method>/seed<k>``. A finished run leaves
   ``run.json`` and is not run again, so an interrupted sweep continues where it stopped.
3. The report reads the runs' TensorBoard logs (``<out>/report.md``, plots in ``<out>/plots``).

Every setting is fixed in :class:`SweepSettings` before any run starts and written into
``<out>/settings.json`` and the report; nothing is tuned on the outcome.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

METHODS: dict[str, tuple[str, ...]] = {
    "grpo": ("loss.clip.preset=grpo",),  # fixed [0.8, 1.2]
    "clip-higher": ("loss.clip.preset=clip-higher",),  # fixed [0.8, 1.28] (DAPO)
    # BAPO's start bounds without the adaptation: does the looser lower bound alone do the work?
    "fixed-0.6": ("loss.clip.preset=grpo", "loss.clip.c_low_start=0.6", "loss.clip.c_low_max=0.6"),
    "bapo-paper": ("loss.clip.preset=paper",),
    "bapo-reference": ("loss.clip.preset=reference",),
}
"""Clipping method -> its dotted overrides (docs/algorithm.md section 7)."""

REUSE = (1, 4, 8)
LAGS = (8, 16)


@dataclass(kw_only=True)
class SweepSettings:
    """Everything a sweep runs with (fixed before the first run; written into the report)."""

    task: str = "seek"
    """Synthetic task (:data:`bapo_megatron.data.synthetic_task.SYNTHETIC_TASKS`)."""
    task_size: int = 4000
    """Prompts generated for the task (seed 0)."""
    warmup_steps: int = 150
    """Supervised warm-up steps of the shared start."""
    warmup_lr: float = 3e-3
    warmup_batch_size: int = 64
    methods: tuple[str, ...] = tuple(METHODS)
    staleness: tuple[str, ...] = ("reuse1", "reuse4", "reuse8", "lag8", "lag16", "partial8")
    """`reuse<k>`: k optimizer steps (mini-batches) per rollout batch; `lag<k>`: train on the batch
    generated k rollout steps earlier (k extra rollout steps, so every run trains as often);
    `partial<b>`: partial rollout, b tokens per round."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """``train.seed`` of each run (prompt order, sampling); the start is shared."""
    steps: int = 60
    """Rollout steps that train (lag runs add their lag)."""
    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    max_new_tokens: int = 32
    lr: float = 3e-4
    temperature: float = 1.0
    micro_batch_size: int = 64
    extra_overrides: tuple[str, ...] = ()
    """Further dotted overrides given to every run."""
    jobs: int = 2
    """Runs at a time."""

    @classmethod
    def minimal(cls, **changes) -> SweepSettings:
        """A tiny sweep for CI: 2 methods x 1 staleness x 1 seed x a few steps."""
        base = {
            "task_size": 200,
            "warmup_steps": 20,
            "warmup_batch_size": 16,
            "methods": ("grpo", "bapo-paper"),
            "staleness": ("reuse4",),
            "seeds": (0,),
            "steps": 4,
            "prompts_per_step": 4,
            "samples_per_prompt": 4,
            "max_new_tokens": 16,
            "micro_batch_size": 16,
        }
        return cls(**{**base, **changes})

    def __post_init__(self) -> None:
        self.methods, self.staleness, self.seeds = (
            tuple(self.methods),
            tuple(self.staleness),
            tuple(self.seeds),
        )
        self.extra_overrides = tuple(self.extra_overrides)
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"sweep: unknown methods {unknown}; known: {list(METHODS)}")
        for name in self.staleness:
            staleness_overrides(name, self)  # raises for an unknown setting
        if self.jobs < 1:
            raise ValueError(f"sweep: jobs must be >= 1, got {self.jobs}")


def staleness_overrides(name: str, settings: SweepSettings) -> list[str]:
    """Dotted overrides of staleness setting ``name`` (see :attr:`SweepSettings.staleness`)."""
    for prefix in ("reuse", "lag", "partial"):
        if (
            name.startswith(prefix)
            and name[len(prefix) :].isdigit()
            and int(name[len(prefix) :]) > 0
        ):
            value = int(name[len(prefix) :])
            break
    else:
        raise ValueError(f"sweep: staleness setting {name!r} is not reuse<k>, lag<k> or partial<b>")
    if prefix == "reuse":
        if settings.prompts_per_step % value:
            raise ValueError(
                f"sweep: {name} needs prompts_per_step ({settings.prompts_per_step}) "
                f"to be a multiple of {value}"
            )
        return [f"algorithm.optimizer_steps_per_rollout={value}", f"train.steps={settings.steps}"]
    if prefix == "lag":
        return [f"algorithm.rollout_lag={value}", f"train.steps={settings.steps + value}"]
    return [f"rollout.partial_tokens_per_round={value}", f"train.steps={settings.steps}"]


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
    from bapo_megatron.config.loading import load_config

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
            "train.seed=0",
            *overrides,
        ],
    )


def prepare_start(settings: SweepSettings, start: Path) -> Path:
    """Write the shared start into ``start`` (``prompts.jsonl`` and the HF folder ``model/``)
    unless it is there already; returns ``start``. Runs the warm-up in this process, one thread."""
    import torch

    from bapo_megatron.actor.actor import build_actor
    from bapo_megatron.data.synthetic_task import synthetic_rows, walk_tokenizer
    from bapo_megatron.data.task import Task
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.trainer.warmup import run_warmup
    from bapo_megatron.weights.convert import write_hf_folder

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
    tokenizer = walk_tokenizer()
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
    import yaml

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
    return [sys.executable, "-m", "bapo_megatron.train", "--config", str(config), *run.overrides]


def execute(config: Path, run: RunSpec, timeout_s: float | None = None) -> dict:
    """Run one training process (unless ``run.json`` says it finished); its record."""
    record_path = run.output_dir / "run.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    run.output_dir.mkdir(parents=True, exist_ok=True)
    command = training_command(config, run)
    began = time.monotonic()
    with open(run.output_dir / "train.log", "w") as log:
        try:
            code = subprocess.run(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=run_environment(),
                timeout=timeout_s,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
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
    from bapo_megatron.repro.sweep_report import write_report

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(dataclasses.asdict(settings), indent=2) + "\n")
    began = time.monotonic()
    start = prepare_start(settings, out / "start")
    progress(f"shared start ready in {start} ({time.monotonic() - began:.0f} s)")
    config = base_config(settings, start, out / "base.yaml")
    runs = plan_runs(settings, out)
    records = []

    def one(run: RunSpec) -> dict:
        record = execute(config, run)
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

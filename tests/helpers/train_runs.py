"""Short training runs of the tiny CPU example for the loop tests: in this process, as a
subprocess (``python -m bapo_megatron.train``, to be killed), or as one subprocess per rank
with the environment torchrun would give them (:func:`start_ranks`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from tests.helpers import preloaded_processes
from tests.helpers.gloo_launch import ONE_THREAD, REPO_ROOT

TINY_CONFIG = REPO_ROOT / "examples" / "tiny_cpu" / "train.yaml"
# Small and short: a few rollout steps of 4 prompts x 4 samples after a 20-step warm-up, two
# mini-batches per rollout batch (one fresh, one a version stale; the tiny CPU run runs four).
FAST = [
    "algorithm.optimizer_steps_per_rollout=2",
    "warmup.steps=20",
    "train.steps=4",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=16",
    "checkpoint.interval=0",
    "logging.console=false",
    "actor.micro_batch_size=16",
    "warmup.batch_size=16",
    "data.synthetic_size=200",
]


def read_metrics(output_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records."""
    path = Path(output_dir) / "tensorboard" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rollout_records(records: list[dict]) -> list[dict]:
    """One record per rollout step (the ones with rollout statistics)."""
    return [r for r in records if "reward/mean" in r]


def run_in_process(output_dir: Path, *overrides: str, config: Path = TINY_CONFIG) -> list[dict]:
    import torch

    from bapo_megatron.config.loading import load_config
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.trainer.loop import train

    cfg = load_config(config, [*FAST, f"train.output_dir={output_dir}", *overrides])
    # One thread, as in the subprocess runs: results compared across them must not depend on
    # how a reduction was split over threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    context = ParallelContext.initialize(cfg.parallel)
    try:
        train(cfg, context)
    finally:
        context.teardown()
        torch.set_num_threads(threads)
    return read_metrics(output_dir)


def training_command(output_dir: Path, *overrides: str, config: Path = TINY_CONFIG) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bapo_megatron.train",
        "--config",
        str(config),
        *FAST,
        f"train.output_dir={output_dir}",
        *overrides,
    ]


def subprocess_env() -> dict[str, str]:
    env = {**os.environ, **ONE_THREAD}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
    )
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE",
    ):
        env.pop(var, None)
    return env


def run_subprocess(
    output_dir: Path, *overrides: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    return preloaded_processes.run(
        training_command(output_dir, *overrides),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Ranks(list):
    """The rank processes of :func:`start_ranks`, and the rendezvous store they meet in (kept
    alive here as long as the processes are)."""

    store: dist.TCPStore

    @classmethod
    def serving(cls) -> Ranks:
        """No rank yet, and the rendezvous store the ranks will connect to. As under torchrun,
        it is served by the launcher (this process, on a port the system picks) and the ranks
        connect to it (``TORCHELASTIC_USE_AGENT_STORE``): no rank has to bind a port that
        something else could take first."""
        ranks = cls()
        ranks.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return ranks

    def start(
        self, command: list[str], rank: int, world_size: int, extra_env: dict | None = None
    ) -> subprocess.Popen:
        """``command`` as rank ``rank`` of ``world_size``, with the variables torchrun sets,
        output merged into the process's stdout pipe; appended, and returned. The caller ends
        it."""
        env = {
            **subprocess_env(),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            **(extra_env or {}),
        }
        process = preloaded_processes.popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.append(process)
        return process


def start_ranks(command: list[str], world_size: int, extra_env: dict | None = None) -> Ranks:
    """``command`` once per rank (:meth:`Ranks.start`), ``ranks[r]`` being rank ``r``. The caller
    ends them."""
    ranks = Ranks.serving()
    for rank in range(world_size):
        ranks.start(command, rank, world_size, extra_env)
    return ranks


# Per-update values a parallel run must reproduce (to float rounding, or bitwise).
UPDATE_KEYS = ("loss", "grad_norm", "entropy", "bapo/rho_after", "bapo/c_high")


def update_records(records: list[dict]) -> list[dict]:
    """One record per optimizer update (not the rollout-step records)."""
    return [r for r in records if "grad_norm" in r and "reward/mean" not in r]


def assert_same_run(
    records: list[dict],
    reference: list[dict],
    *,
    rollout_steps: int,
    updates: int,
    bitwise: bool = False,
) -> None:
    """``records`` repeat ``reference``'s run: the same rollouts exactly (reward, generated
    tokens, policy version) and the same updates, bitwise (every ``bapo/*`` metric too) or to
    float rounding (rel 1e-3 on :data:`UPDATE_KEYS`, as layouts reduce in other orders)."""
    import pytest

    ours, theirs = rollout_records(records), rollout_records(reference)
    assert len(ours) == len(theirs) == rollout_steps
    assert any(r["reward/mean"] > 0 for r in theirs)  # a run that learned nothing proves little
    for a, b in zip(ours, theirs):
        for key in ("reward/mean", "rollout/generated_tokens", "policy_version"):
            assert a[key] == b[key], key
    ours, theirs = update_records(records), update_records(reference)
    assert len(ours) == len(theirs) == updates
    for a, b in zip(ours, theirs):
        if bitwise:
            keys = [
                *UPDATE_KEYS,
                "response_tokens",
                "staleness/max",
                *(k for k in b if k.startswith("bapo/")),
            ]
            assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        else:
            for key in UPDATE_KEYS:
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key


def kill_after(
    output,
    overrides,
    checkpoint_step: int,
    extra_delay: float,
    *,
    while_writing: bool = False,
    config: Path = TINY_CONFIG,
) -> None:
    """Start the trainer (on ``config``) as a process, SIGKILL it ``extra_delay`` s after
    checkpoint ``checkpoint_step`` appears, or (``while_writing``) as soon as its staging folder
    appears, in the middle of writing it."""
    proc = preloaded_processes.popen(
        training_command(output, *overrides, config=config),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    name = f"step_{checkpoint_step:08d}"
    target = output / "checkpoints" / (f".{name}.incomplete" if while_writing else name)
    deadline = time.monotonic() + 300
    try:
        while not target.exists():
            if proc.poll() is not None:
                raise AssertionError(
                    f"the run ended (exit {proc.returncode}) before {target.name}: "
                    f"{proc.stderr.read()[-3000:]}"
                )
            assert time.monotonic() < deadline, f"no {target.name} within 300 s"
            time.sleep(0.002 if while_writing else 0.02)
        time.sleep(extra_delay)
    finally:
        children = [
            int(pid)
            for path in Path(f"/proc/{proc.pid}/task").glob("*/children")
            for pid in path.read_text().split()
        ]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    # what the trainer started (its reward workers) ends with it
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in children), f"the killed trainer's {children} live on"


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; it only waits to be reaped

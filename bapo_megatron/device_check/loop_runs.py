"""The RL loop end to end on one device, as the device check runs it: the tiny CPU run's
configuration (``examples/tiny_cpu/train.yaml``) through ``python -m bapo_megatron.train`` on the
device, with the embedded engine on the same device, checkpoints, TensorBoard, and a run killed
with SIGKILL and resumed, whose metrics must equal the uninterrupted run's; and the loop with
vLLM colocated (:func:`vllm_loop_inputs`)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bapo_megatron.config import ModelConfig
from bapo_megatron.data.synthetic_task import counting_tokenizer, synthetic_rows
from bapo_megatron.device_check.start_folder import write_start_folder

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = REPO_ROOT / "examples" / "tiny_cpu" / "train.yaml"
# Values a resumed run must repeat exactly; times and throughput do not.
COMPARED = (
    "reward/mean",
    "rollout/generated_tokens",
    "response_length/mean",
    "loss",
    "grad_norm",
    "entropy",
    "bapo/rho_after",
    "bapo/c_low",
    "bapo/c_high",
    "staleness/max",
    "lr",
)
# The ~0.5B model's layer shapes (Qwen2.5-0.5B) over the task's own 16-token vocabulary.
SMALL_MODEL = (
    "model.model_type=qwen2",
    "model.num_layers=24",
    "model.hidden_size=896",
    "model.ffn_hidden_size=4864",
    "model.num_attention_heads=14",
    "model.num_query_groups=2",
)


def read_records(output: Path) -> list[dict]:
    path = output / "tensorboard" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def comparable(records: list[dict]) -> list:
    return [
        (r["step"], {k: r[k] for k in COMPARED if k in r})
        for r in records
        if "warmup/cross_entropy" not in r
    ]


def train_command(output: Path, overrides: list[str]) -> list[str]:
    """The training command; a ``--config=FILE`` entry in ``overrides`` replaces the tiny CPU run's
    configuration."""
    config = next((o.split("=", 1)[1] for o in overrides if o.startswith("--config=")), CONFIG)
    rest = [o for o in overrides if not o.startswith("--config=")]
    return [
        sys.executable,
        "-m",
        "bapo_megatron.train",
        "--config",
        str(config),
        f"train.output_dir={output}",
        "logging.console=false",
        *rest,
    ]


def run_training(output: Path, overrides: list[str], env: dict, timeout: float) -> float:
    """Run to the end; returns the wall time. ``RuntimeError`` with the log's tail on failure."""
    began = time.monotonic()
    log = output.parent / f"{output.name}.log"
    with log.open("w") as sink:
        proc = subprocess.run(
            train_command(output, overrides),
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            cwd=REPO_ROOT,
            check=False,
        )
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"training exited with {proc.returncode}:\n{tail}")
    return time.monotonic() - began


def kill_when_checkpointed(
    output: Path, overrides: list[str], env: dict, step: int, timeout: float
) -> bool:
    """Start the run and SIGKILL it once checkpoint ``step`` is complete; returns whether it was
    killed (False: it finished first, which the comparison then covers anyway)."""
    target = output / "checkpoints" / f"step_{step:08d}"
    log = output.parent / f"{output.name}.killed.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            train_command(output, overrides),
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if target.is_dir() and time.monotonic() < deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return True
                if time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise RuntimeError(f"no {target.name} within {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return False


def loop_check(work: Path, device: str, overrides: list[str], env: dict, timeout: float) -> dict:
    """One run of the tiny CPU run on ``device``: reward trajectory, log-prob gap, throughput."""
    output = work / "run"
    base = [f"parallel.device={device}", "logging.logprob_diff_interval=1", *overrides]
    wall = run_training(output, base, env, timeout)
    records = read_records(output)
    rollouts = [r for r in records if "reward/mean" in r]
    gaps = [r["logprob_diff/mean_abs"] for r in records if "logprob_diff/mean_abs" in r]
    gaps_max = [r["logprob_diff/max_abs"] for r in records if "logprob_diff/max_abs" in r]
    rewards = [r["reward/mean"] for r in rollouts]
    first, last = rewards[: min(5, len(rewards))], rewards[-min(5, len(rewards)) :]
    checkpoints = sorted(p.name for p in (output / "checkpoints").glob("step_*"))
    events = list((output / "tensorboard").glob("events.out.tfevents.*"))
    throughput = [r["throughput/tokens_per_s"] for r in rollouts if "throughput/tokens_per_s" in r]
    return {
        "status": "passed" if rollouts and checkpoints and events else "failed",
        "overrides": base,
        "wall_s": round(wall, 1),
        "rollout_steps": len(rollouts),
        "reward_first5": sum(first) / max(1, len(first)),
        "reward_last5": sum(last) / max(1, len(last)),
        "logprob_gap_mean_abs_worst_step": max(gaps) if gaps else None,
        "logprob_gap_max_abs_worst_step": max(gaps_max) if gaps_max else None,
        "generated_tokens_per_s_median": sorted(throughput)[len(throughput) // 2]
        if throughput
        else None,
        "checkpoints": checkpoints,
        "tensorboard_event_files": len(events),
    }


def resume_check(
    work: Path, device: str, overrides: list[str], env: dict, kill_step: int, timeout: float
) -> dict:
    """Uninterrupted run vs the same run SIGKILLed after checkpoint ``kill_step`` and resumed."""
    base = [f"parallel.device={device}", "parallel.deterministic=true", *overrides]
    whole, broken = work / "whole", work / "killed"
    run_training(whole, base, env, timeout)
    killed = kill_when_checkpointed(broken, base, env, kill_step, timeout)
    run_training(broken, base, env, timeout)
    want, got = comparable(read_records(whole)), comparable(read_records(broken))
    differ = [a[0] for a, b in zip(want, got) if a != b]
    same = want == got and bool(want)
    return {
        "status": "passed" if same else "failed",
        "killed_after_checkpoint": kill_step if killed else None,
        "records": len(want),
        "resumed_records": len(got),
        "first_differing_steps": differ[:5],
    }


# A 2-layer Qwen2 over the synthetic tasks' 15-token vocabulary, heads of 64 (GPU attention
# kernels) or 32 (vLLM's CPU attention takes 32, 64, 80, ...).
VLLM_LOOP_MODEL = ModelConfig(
    model_type="qwen2",
    num_layers=2,
    hidden_size=128,
    ffn_hidden_size=256,
    num_attention_heads=2,
    num_query_groups=1,
    vocab_size=16,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    rope_theta=1e6,
)


def vllm_loop_inputs(work: Path, *, gpu: bool) -> list[str]:
    """What the loop with an in-process vLLM starts from, written into ``work``: an HF folder
    (random weights, the synthetic tasks' tokenizer saved beside them: vLLM starts from a
    folder, ``train.model_path``), a prompt file of `count_to` problems, and the run's YAML (JSON is
    YAML); returns the overrides that name it. On a GPU the engine sleeps while the actor
    trains (``rollout.release_memory_during_training``), bf16 with the distributed optimizer."""
    model = (
        VLLM_LOOP_MODEL
        if gpu
        else dataclasses.replace(VLLM_LOOP_MODEL, hidden_size=64, head_dim=None)
    )
    folder = write_start_folder(model, work / "start", seed=0)
    counting_tokenizer().save_pretrained(folder)
    prompts = work / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": row.id, "prompt": row.prompt, "answer": row.answer}) + "\n"
            for row in synthetic_rows("count_to", 200, seed=0)
        )
    )
    config = {
        "data": {"train_file": str(prompts)},
        "reward": {"name": "exact_match", "workers": 1},
        "warmup": {"steps": 0},
        "rollout": {
            "engine": "vllm",
            "prompts_per_step": 8,
            "samples_per_prompt": 4,
            "max_new_tokens": 16,
            "gpu_memory_utilization": 0.3,
            "release_memory_during_training": gpu,
        },
        "loss": {"aggregation": "token-mean", "clip": {"preset": "paper"}},
        "actor": {"micro_batch_size": 32, "temperature": 1.0, "seed": 1},
        "optimizer": {
            "lr": 1.0e-4,
            "weight_decay": 0.0,
            "clip_grad": 1.0,
            "use_distributed_optimizer": gpu,
        },
        "train": {
            "steps": 6 if gpu else 3,
            "model_path": str(folder),
            "seed": 0,
            "params_dtype": "bfloat16" if gpu else "float32",
        },
        "checkpoint": {"interval": 3},
    }
    path = work / "train.yaml"
    path.write_text(json.dumps(config, indent=1))
    return [f"--config={path}"]

"""The recipe ``examples/smollm2-135m-cpu/train.yaml`` made small for the real-model tier's
runs: 2 prompts x 2 samples of up to 16 tokens on the embedded engine, one rollout step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from bapo_megatron.data.arithmetic_task import write_task
from tests.helpers import preloaded_processes
from tests.helpers.gloo_launch import REPO_ROOT
from tests.helpers.train_runs import subprocess_env

PROMPTS, SAMPLES, MAX_NEW_TOKENS = 2, 2, 16
RUN_TIMEOUT_S = 1200
"""A guard against a hung run, not a speed requirement (a run takes one to two minutes here)."""

RECIPE = REPO_ROOT / "examples" / "smollm2-135m-cpu" / "train.yaml"


def merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


def run_config(real_model, tmp_path) -> dict:
    train_file, _, rows, _ = write_task(tmp_path / "data", train=8, test=8)
    assert rows == 8
    small = {
        "data": {"train_file": str(train_file)},
        "rollout": {
            "engine": "embedded",
            "prompts_per_step": PROMPTS,
            "samples_per_prompt": SAMPLES,
            "max_new_tokens": MAX_NEW_TOKENS,
        },
        "algorithm": {"old_logprobs": "recompute", "optimizer_steps_per_rollout": 1},
        "optimizer": {"lr": 1.0e-6},
        "train": {
            "model_path": str(real_model),
            "steps": 1,
            # room for the chat-template prompt and the response; bounds the engine's context
            "max_position_embeddings": 256,
            "output_dir": str(tmp_path / "run"),
        },
        "checkpoint": {"interval": 1},
        "logging": {"logprob_diff_interval": 1},
    }
    config = merged(yaml.safe_load(RECIPE.read_text()), small)
    assert config["reward"]["name"] == "final_number" and config["actor"]["pack_sequences"]
    return config


def train(config: dict, folder: Path) -> subprocess.CompletedProcess:
    """``python -m bapo_megatron.train --config FILE`` as a user runs it, FILE ``config`` written
    into ``folder``; its exit status and captured output."""
    path = folder / "train.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return preloaded_processes.run(
        [sys.executable, "-m", "bapo_megatron.train", "--config", str(path)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )

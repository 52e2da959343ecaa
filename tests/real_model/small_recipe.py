"""The recipe ``examples/smollm2-135m-cpu/train.yaml`` made small for the real-model tier's
runs: 2 prompts x 2 samples of up to 16 tokens on the embedded engine, one rollout step."""

from __future__ import annotations

import yaml

from bapo_megatron.data.arithmetic_task import write_task
from tests.helpers.gloo_launch import REPO_ROOT

PROMPTS, SAMPLES, MAX_NEW_TOKENS = 2, 2, 16

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

"""The training loop with vLLM spread over two worker processes (the optional vLLM tier): the main
job's configuration with ``rollout.engine=vllm`` and ``rollout.engine_tensor_parallel_size=2``,
colocated (the engine in the trainer's process, its workers beside it) and disaggregated (a
trainer rank and an engine rank whose vLLM spans two workers), the weights sent shard to shard
in both (``rollout.weight_transport=shard-to-shard``: in the disaggregated run the engine rank
answers the sync's requests over its request link and its workers join the trainer's transfer
group). vLLM starts from the model
section's config on dummy weights; the first weight sync gives it the warmed-up actor's.

Each run must learn as the embedded engine's does (tests/e2e/test_learning.py: the first rollout
step's mean reward -> the mean of the last 3 of 8 rises by at least 0.2; measured with vLLM at
TP 2: 0.43 -> 0.77), move BAPO's bounds, and report behaviour log-probs that the actor's
recompute matches to float32 rounding at every step (measured: at most 2e-5). The model has 2
heads of 32 (vLLM's CPU attention refuses heads of 16) sharing one key/value head, which vLLM
replicates on both workers. Skipped where vLLM is not installed.

Two shorter runs check that a colocated vLLM run says nothing alarming: one training step of a
tied model with vLLM in the trainer's process prints no traceback (vLLM's exit-time shutdown
used to destroy groups the trainer had already destroyed) and no "Failed to load weights" (the
in-place reload of a tied model); and an engine closed while the trainer's world lives leaves
that world to the trainer (bapo_megatron/rollout/vllm/borrowed_world.py).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from bapo_megatron.trainer.run_summary import bounds_moved
from tests.helpers import hf_models
from tests.helpers.train_runs import (
    REPO_ROOT,
    TINY_CONFIG,
    read_metrics,
    rollout_records,
    start_ranks,
    subprocess_env,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (optional tier: requirements-vllm.txt)",
)

STEPS = 8
MARGIN = 0.2
"""Rise of the mean reward (first rollout step -> mean of the last 3), as for the embedded
engine."""
LOGPROB_ATOL = 1e-4
"""Largest engine/actor log-prob gap allowed at any step (float32 on both sides)."""
PAPER_START = (0.6, 1.2)
"""The bounds the tiny CPU run's search starts from (its loss preset, `paper`)."""
RUN_TIMEOUT_S = 1800
"""Bounds a hang only; a run takes one to a few minutes."""
VLLM_TP2 = [
    "rollout.engine=vllm",
    "rollout.engine_tensor_parallel_size=2",
    "rollout.engine_eager=true",
    "model.num_attention_heads=2",
    "model.num_query_groups=1",
    f"train.steps={STEPS}",
    "logging.logprob_diff_interval=1",
    "logging.console=false",
    "checkpoint.interval=0",
]


def command(output_dir, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bapo_megatron.train",
        "--config",
        str(TINY_CONFIG),
        f"train.output_dir={output_dir}",
        *VLLM_TP2,
        *overrides,
    ]


def check_learned(output_dir) -> None:
    rollouts = rollout_records(read_metrics(output_dir))
    assert len(rollouts) == STEPS
    rewards = [r["reward/mean"] for r in rollouts]
    assert sum(rewards[-3:]) / 3 - rewards[0] >= MARGIN, rewards
    gaps = [r["logprob_diff/max_abs"] for r in rollouts]
    assert max(gaps) <= LOGPROB_ATOL, gaps
    updates = [r for r in read_metrics(output_dir) if "bapo/c_high" in r]
    moved = [u for u in updates if bounds_moved(u, *PAPER_START)]
    assert len(updates) == 4 * STEPS and moved, "BAPO's bounds never left where they start"


def test_the_colocated_loop_learns_with_vllm_over_two_workers_shard_to_shard(tmp_path):
    """Colocated, every sync shard to shard: both workers join the trainer's transfer group and
    each receives its own shard."""
    run = subprocess.run(
        command(tmp_path / "run", "rollout.weight_transport=shard-to-shard"),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    check_learned(tmp_path / "run")


def test_the_disaggregated_loop_learns_with_an_engine_rank_spanning_two_workers(tmp_path):
    """Disaggregated, every sync shard to shard into the engine rank's two workers."""
    overrides = [
        "rollout.placement=disaggregated",
        "rollout.engine_ranks=1",
        "rollout.weight_transport=shard-to-shard",
    ]
    ranks = start_ranks(command(tmp_path / "run", *overrides), world_size=2)
    try:
        outputs = [rank.communicate(timeout=RUN_TIMEOUT_S)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.communicate()
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    check_learned(tmp_path / "run")


QUIET_RUN = [
    "rollout.engine=vllm",
    "rollout.engine_eager=true",
    "model.num_attention_heads=2",
    "model.num_query_groups=1",
    "model.tie_word_embeddings=true",
    "train.steps=1",
    "warmup.steps=0",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=2",
    "checkpoint.interval=0",
]
"""One rollout step of the tiny CPU run's model with 2 heads of 32, tied, on vLLM at TP 1 in the
trainer's process (its worker adopts the trainer's world of one rank)."""


def test_a_colocated_vllm_run_prints_no_traceback_and_no_load_warning(tmp_path):
    """One step, then a normal exit: exit code 0, and neither stream holds a traceback (vLLM's
    exit-time shutdown raised `ValueError: Invalid process group specified` on the groups the
    trainer's teardown had destroyed; its start logged the traceback of a chat template warmup
    without a tokenizer) nor vLLM's "Failed to load weights" (the weight syncs of a tied model)."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bapo_megatron.train",
            "--config",
            str(TINY_CONFIG),
            f"train.output_dir={tmp_path / 'run'}",
            *QUIET_RUN,
        ],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert len(rollout_records(read_metrics(tmp_path / "run"))) == 1
    assert "Traceback" not in output, output[-3000:]
    assert "Failed to load weights" not in output, output[-3000:]


CLOSE_WHILE_THE_WORLD_LIVES = """
import sys
import torch.distributed as dist
from bapo_megatron.rollout.vllm.engine import VLLMEngine

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
engine = VLLMEngine.from_pretrained(sys.argv[1], enforce_eager=True, max_model_len=64)
engine.close()
assert dist.is_initialized(), "closing the engine destroyed the world it found"
dist.barrier()  # and the world still works
dist.destroy_process_group()
print("the world outlived the engine")
# without a world vLLM makes its own, and takes it down with it
engine = VLLMEngine.from_pretrained(sys.argv[1], enforce_eager=True, max_model_len=64)
assert dist.is_initialized()
engine.close()
assert not dist.is_initialized(), "the world vLLM made outlived it"
print("the world vLLM made ended with it")
"""


def test_closing_a_vllm_engine_leaves_the_world_it_found(tmp_path):
    """vLLM's shutdown ends with `torch.distributed.destroy_process_group()`: an engine closed
    before the trainer tears down would take the trainer's world with it. A world vLLM made
    itself is still its own to end."""
    hf_models.save_hf_folder(tmp_path, "llama32-tied", heads=2, kv_heads=1)
    run = subprocess.run(
        [sys.executable, "-c", CLOSE_WHILE_THE_WORLD_LIVES, str(tmp_path)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "the world outlived the engine" in run.stdout
    assert "the world vLLM made ended with it" in run.stdout
    assert "Traceback" not in output, output[-3000:]

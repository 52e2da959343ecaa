"""The training loop with vLLM spread over two worker processes (the optional vLLM tier): the main
job's configuration with ``rollout.engine=vllm`` and ``rollout.engine_tensor_parallel_size=2``,
colocated (the engine in the trainer's process, its workers beside it) and disaggregated (a
trainer rank and an engine rank whose vLLM spans two workers), the weights sent shard to shard
in both (``rollout.weight_transport=shard-to-shard``: in the disaggregated run the engine rank
answers the sync's requests over its request link and its workers join the trainer's transfer
group). vLLM starts from the model
section's config on dummy weights; the first weight sync gives it the warmed-up actor's.

The colocated run must learn as the embedded engine's does (tests/e2e/test_learning.py: the
first rollout step's mean reward -> the mean of the last 3 of 8 rises by at least 0.2; measured
with vLLM at TP 2: 0.43 -> 0.77) and move BAPO's bounds; both runs report behaviour log-probs
that the actor's recompute matches to float32 rounding at every step (measured: at most 2e-5),
so every step sampled from the weights just sent. The model has 2 heads of 32 (vLLM's CPU
attention refuses heads of 16) sharing one key/value head, which vLLM replicates on both
workers.

An engine closed while the trainer's world lives leaves that world to the trainer
(bapo_megatron/rollout/vllm/borrowed_world.py). That a colocated run with vLLM in the trainer's
process prints no traceback and no "Failed to load weights" (a tied model) is checked on the
real model (tests/real_model/test_vllm_real_model.py).
"""

from __future__ import annotations

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

pytestmark = pytest.mark.vllm

STEPS = 8
DISAGGREGATED_STEPS = 3
MARGIN = 0.2
"""Rise of the mean reward (first rollout step -> mean of the last 3), as for the embedded
engine."""
LOGPROB_ATOL = 1e-4
"""Largest engine/actor log-prob gap allowed at any step (float32 on both sides)."""
PAPER_START = (0.6, 1.2)
"""The bounds the tiny CPU run's search starts from (its loss preset, `paper`)."""
RUN_TIMEOUT_S = 1800
"""Bounds a hang only; a run takes one to a few minutes."""
TWO_HEADS = ["model.num_attention_heads=2", "model.num_query_groups=1"]
VLLM_TP2 = [
    "rollout.engine=vllm",
    "rollout.engine_tensor_parallel_size=2",
    "rollout.engine_eager=true",
    *TWO_HEADS,
    "logging.logprob_diff_interval=1",
    "logging.console=false",
    "checkpoint.interval=0",
]


@pytest.fixture(scope="module", autouse=True)
def warm_start_run(tmp_path_factory):
    """The tiny CPU run's model (2 heads) trained by its own warm-up, started in the background
    when the module starts (the closing test runs beside it) and saved as a checkpoint both
    loop runs start from, instead of paying the 300 warm-up steps each. (The loop has no run of
    zero steps: its one rollout step, on the embedded engine, trains at learning rate 0, so the
    checkpoint holds the warm-up's weights.) A process of its own: a later vLLM started in this
    one (the uniproc executor) cannot register its CPU kernels once numba's llvmlite is
    imported, as the loss's CPU kernel does. Its output folder and process."""
    output = tmp_path_factory.mktemp("warm-start")
    command = [
        sys.executable,
        "-m",
        "bapo_megatron.train",
        "--config",
        str(TINY_CONFIG),
        f"train.output_dir={output}",
        *TWO_HEADS,
        "train.steps=1",
        "optimizer.lr=0",
        "logging.console=false",
    ]
    log = output.with_name(output.name + ".log").open("w+")
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT
    )
    yield output, process, log
    if process.poll() is None:
        process.kill()
    process.wait()
    log.close()


@pytest.fixture(scope="module")
def warm_start(warm_start_run) -> str:
    """The warm-up's checkpoint, once its run ended: the override that starts from it."""
    output, process, log = warm_start_run
    code = process.wait(timeout=RUN_TIMEOUT_S)
    log.seek(0)
    assert code == 0, log.read()[-3000:]
    return f"train.load_checkpoint={output / 'checkpoints' / 'step_00000001'}"


def command(output_dir, warm_start: str, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bapo_megatron.train",
        "--config",
        str(TINY_CONFIG),
        f"train.output_dir={output_dir}",
        *VLLM_TP2,
        "warmup.steps=0",
        warm_start,
        *overrides,
    ]


def check_run(output_dir, steps: int, *, learned: bool) -> None:
    """Every step's engine/actor log-prob gap at float32 rounding (the engine held the weights
    just sent), every update ran; with ``learned``, the reward rose by MARGIN and BAPO's bounds
    moved."""
    rollouts = rollout_records(read_metrics(output_dir))
    assert len(rollouts) == steps
    gaps = [r["logprob_diff/max_abs"] for r in rollouts]
    assert max(gaps) <= LOGPROB_ATOL, gaps
    updates = [r for r in read_metrics(output_dir) if "bapo/c_high" in r]
    assert len(updates) == 4 * steps
    if learned:
        rewards = [r["reward/mean"] for r in rollouts]
        assert sum(rewards[-3:]) / 3 - rewards[0] >= MARGIN, rewards
        moved = [u for u in updates if bounds_moved(u, *PAPER_START)]
        assert moved, "BAPO's bounds never left where they start"


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


def test_the_colocated_loop_learns_with_vllm_over_two_workers_shard_to_shard(tmp_path, warm_start):
    """Colocated, every sync shard to shard: both workers join the trainer's transfer group and
    each receives its own shard."""
    run = subprocess.run(
        command(
            tmp_path / "run",
            warm_start,
            "rollout.weight_transport=shard-to-shard",
            f"train.steps={STEPS}",
        ),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    check_run(tmp_path / "run", STEPS, learned=True)


def test_the_disaggregated_loop_syncs_into_an_engine_rank_spanning_two_workers(
    tmp_path, warm_start
):
    """Disaggregated, every sync shard to shard into the engine rank's two workers: each step's
    samples come from the weights just sent. (That the loop learns is the colocated run's
    check: the placement moves the same weights by another route.)"""
    overrides = [
        f"train.steps={DISAGGREGATED_STEPS}",
        "rollout.placement=disaggregated",
        "rollout.engine_ranks=1",
        "rollout.weight_transport=shard-to-shard",
    ]
    ranks = start_ranks(command(tmp_path / "run", warm_start, *overrides), world_size=2)
    try:
        outputs = [rank.communicate(timeout=RUN_TIMEOUT_S)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.communicate()
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    check_run(tmp_path / "run", DISAGGREGATED_STEPS, learned=False)

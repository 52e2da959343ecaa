"""Fixtures shared by the test files, and the device the suite runs on."""

from __future__ import annotations

import os

import pytest

# The suite is a CPU suite on every machine: on a GPU node it must test the same code paths
# (gloo, the CPU patches) as on a laptop and CI, not skip them. `parallel.device: auto` follows
# this variable, in this process and in every process the tests start. The GPU paths are
# exercised by tools/gpu_check.py (its CPU mode is a test here).
os.environ["BAPO_DEVICE"] = "cpu"

# Tests marked `vllm` run in the vLLM tier only; one that skips for a missing vLLM unmarked fails.
# The fake vLLM's fixture (`fake_vllm`) serves every test of the vLLM adapters.
pytest_plugins = ["tests.helpers.vllm_tier_plugin", "tests.helpers.fake_vllm"]

# tests/real_model needs a pretrained model that .ci/real-model-tier downloads and converts,
# then names in BAPO_REAL_MODEL; without it those tests could only fail or skip, so the main
# suite does not collect them.
if not os.environ.get("BAPO_REAL_MODEL"):
    collect_ignore = ["real_model"]


def pytest_configure(config):
    # The tests run the command lines' code in this process too (``main()`` of the trainer and
    # the tools): prepare it as they prepare theirs, before any test module imports megatron.
    from bapo_megatron.process.start import prepare_process

    prepare_process()
    # Every trainer, worker and tool process the tests start, themselves or through torchrun,
    # a script or a tool, is forked from one server that imported torch, Megatron-Core and
    # transformers once (tests/helpers/preloaded_processes.py); it imports while tests collect.
    from tests.helpers import preloaded_processes

    preloaded_processes.start_server()


@pytest.fixture
def single_process():
    """A one-process ParallelContext (gloo world of one rank), torn down after the test."""
    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext

    context = ParallelContext.initialize(ParallelConfig())
    try:
        yield context
    finally:
        context.teardown()


@pytest.fixture
def context(single_process):
    """The same one-process context, under the name the train-step and weights tests use."""
    return single_process


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory):
    """The tiny example's model after its supervised warm-up (150 steps) and one RL step, as a
    trainer checkpoint: the training-loop tests start from it (``train.load_checkpoint``), so
    their rewards are not all zero and none of them pays for the warm-up again. Returns
    ``(overrides that start from it, the warm-up run's metric records)``."""
    from tests.helpers.train_runs import run_in_process

    output = tmp_path_factory.mktemp("warm_start")
    records = run_in_process(output, "warmup.steps=150", "warmup.batch_size=64", "train.steps=1")
    checkpoint = output / "checkpoints" / "step_00000001"
    return ["warmup.steps=0", f"train.load_checkpoint={checkpoint}"], records


@pytest.fixture(scope="session")
def colocated_three_steps(tmp_path_factory, warm_start):
    """Three rollout steps of the FAST tiny run from the warm start in this process (trainer
    TP1, PP1, colocated engine, synchronous): the reference the two-process, disaggregated and
    multi-node runs of the same settings must repeat. Its metric records."""
    from tests.helpers.train_runs import run_in_process

    return run_in_process(tmp_path_factory.mktemp("colocated"), *warm_start[0], "train.steps=3")

"""One rollout step of training SmolLM2-135M-Instruct, as a user starts it: ``python -m
bapo_megatron.train --config FILE``, FILE the recipe ``examples/smollm2-135m-cpu/train.yaml``
made small, with ``train.model_path`` its HF folder, arithmetic prompts
in its chat template ("What is 7 + 12?", bapo_megatron/data/arithmetic_task.py), the
``final_number`` reward and the embedded engine: 2 prompts x 2 samples of up to 16 tokens, old
log-probs recomputed by the actor.

The engine and the actor hold the same float32 weights, so the log-probs the engine sampled with
and the ones the actor recomputes for the same tokens agree to float32 rounding: the run's
``logprob_diff/max_abs`` over every generated token stays below 1e-3 (3e-5 here). The step
trains every generated token in one optimizer step, the ratio against the recomputed log-probs
is 1, and the run ends with its checkpoint.

Sixteen tokens are often too few for this model to finish an answer, so the rewards (and then
the advantages and the gradient) may all be zero: the test asserts that the step ran and what it
trained, not that it learned.
"""

from __future__ import annotations

import math
import shutil

import pytest

from tests.helpers.train_runs import read_metrics, rollout_records, update_records
from tests.real_model.small_recipe import MAX_NEW_TOKENS, PROMPTS, SAMPLES, run_config, train


@pytest.fixture(scope="module")
def trained(real_model, tmp_path_factory):
    """(the run's folder, its metric records, its console output) of the one-step run."""
    tmp_path = tmp_path_factory.mktemp("train")
    done = train(run_config(real_model, tmp_path), tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    yield tmp_path / "run", read_metrics(tmp_path / "run"), done.stdout
    # the checkpoint (weights and Adam moments, 1.6 GB) is not kept with the test's folders
    shutil.rmtree(tmp_path / "run" / "checkpoints")


def test_engine_and_actor_log_probs_agree_to_float32_rounding(trained):
    _, records, _ = trained
    [rollout] = rollout_records(records)
    generated = rollout["rollout/generated_tokens"]
    assert 0 < generated <= PROMPTS * SAMPLES * MAX_NEW_TOKENS
    assert rollout["logprob_diff/tokens"] == generated  # every sampled token compared
    assert rollout["logprob_diff/max_abs"] < 1e-3
    assert rollout["logprob_diff/mean_abs"] < 1e-4


def test_the_step_trained_every_generated_token(trained):
    run, records, console = trained
    [rollout] = rollout_records(records)
    [update] = update_records(records)
    assert update["step"] == 1 and update["skipped"] == 0 and update["lr"] == 1.0e-6
    assert update["response_tokens"] == rollout["rollout/generated_tokens"]
    for key in ("loss", "grad_norm", "entropy"):
        assert math.isfinite(update[key]), key
    assert update["entropy"] > 0  # sampled at temperature 1 from a real distribution
    # the ratio's denominator is the actor's own recomputed log-prob: 1 before the update
    assert update["bapo/ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert update["bapo/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert rollout["policy_version"] == 1
    assert 0 <= rollout["reward/mean"] <= 1 and rollout["reward/errors"] == 0
    assert rollout["data/skipped_rows"] == 0
    assert any(line.startswith("step 1/1 | reward ") for line in console.splitlines())
    assert (run / "checkpoints" / "step_00000001" / "bapo_checkpoint.json").is_file()

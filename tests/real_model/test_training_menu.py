"""The recipe's one rollout step (tests/real_model/small_recipe.py) with what a verl or DAPO user
brings beside BAPO switched on at once, on the real model: a KL term to the starting weights
(k3, in the loss), an entropy bonus, the overlong penalty and IcePop's band on the engine/actor
ratio. The run ends, every term reports its metric, and the reference (the starting weights,
which the actor still holds for this first step) gives a KL of float32 rounding. Dynamic
sampling's refill is left out: at 16 tokens most groups' rewards are all equal, and a step it
filters empty trains nothing to look at. What each term computes is tested against float64
references in tests/unit."""

from __future__ import annotations

import math
import shutil

from tests.helpers.train_runs import read_metrics, rollout_records, update_records
from tests.real_model.small_recipe import MAX_NEW_TOKENS, merged, run_config, train

MENU = {
    "algorithm": {
        "kl": {"coef": 0.05, "estimator": "k3", "placement": "loss"},
        "off_policy_correction": "icepop",
    },
    "loss": {
        "entropy_coef": 0.001,
        "mismatch_band_low": 0.5,
        "mismatch_band_high": 2.0,
        "overlong": {"buffer_length": MAX_NEW_TOKENS // 2, "penalty_factor": 1.0},
    },
}


def test_the_recipe_step_runs_with_kl_entropy_overlong_and_icepop(real_model, tmp_path):
    done = train(merged(run_config(real_model, tmp_path), MENU), tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    records = read_metrics(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # 1.6 GB of weights and Adam moments
    [rollout] = rollout_records(records)
    assert abs(rollout["kl/rollout_mean"]) < 1e-4  # the reference is the starting weights
    for key in ("overlong/penalty_mean", "overlong/penalized_fraction"):
        assert math.isfinite(rollout[key]) and rollout[key] <= 1, key
    # the engine and the actor hold the same weights: no token leaves IcePop's band
    assert rollout["off_policy/masked_token_share"] == 0
    [update] = update_records(records)
    assert abs(update["kl/mean"]) < 1e-4
    for key in ("loss", "actor/entropy_bonus", "actor/policy_loss", "kl/loss"):
        assert math.isfinite(update[key]), key
    assert update["actor/entropy_bonus"] > 0

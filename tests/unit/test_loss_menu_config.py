"""Configuration of the loss's extra terms: bad values are refused naming their fields, the
band masks need their band or a cap, and the verl presets hold verl's defaults."""

from __future__ import annotations

import pytest

from bapo_megatron.config import ClipSearchConfig, check_training
from bapo_megatron.config.loading import load_config
from tests.unit.test_config import RECOMPUTE, TRAINABLE


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["loss.mismatch_band_low=2.0", "loss.mismatch_band_high=0.5"],
            "loss.mismatch_band_low=2.0 is above loss.mismatch_band_high=0.5",
        ),
        (
            ["loss.mismatch_band_low=0.5"],
            "loss.mismatch_band_low and loss.mismatch_band_high are set together",
        ),
        (["loss.mismatch_band_low=1.2", "loss.mismatch_band_high=2.0"], "the band must contain 1"),
        (["loss.mismatch_band_low=-0.1", "loss.mismatch_band_high=2.0"], "the band must contain 1"),
        (["loss.entropy_coef=-0.01"], "loss.entropy_coef must be a finite number >= 0"),
        (["loss.overlong.buffer_length=-1"], "loss.overlong.buffer_length must be an integer >= 0"),
        (
            ["loss.overlong.penalty_factor=-1"],
            "loss.overlong.penalty_factor must be a finite number >= 0",
        ),
        (["algorithm.one_sample_advantage=raw"], "algorithm.one_sample_advantage"),
    ],
)
def test_bad_values_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.max_new_tokens=16", "loss.overlong.buffer_length=32"],
            "loss.overlong.buffer_length=32 is longer than the responses may be "
            "(rollout.max_new_tokens=16)",
        ),
        (
            RECOMPUTE + ["algorithm.off_policy_correction=icepop"],
            "algorithm.off_policy_correction=icepop needs loss.truncated_is_cap (or "
            "loss.mismatch_band_low/_high, its band",
        ),
        (
            RECOMPUTE + ["algorithm.off_policy_correction=token-mask", "loss.truncated_is_cap=0.5"],
            "algorithm.off_policy_correction=token-mask keeps the tokens whose weight lies in "
            "[1/C, C]",
        ),
        (
            ["algorithm.off_policy_correction=geometric-mask", "loss.truncated_is_cap=2"],
            "algorithm.off_policy_correction=geometric-mask needs algorithm.old_logprobs=recompute",
        ),
        (
            RECOMPUTE
            + [
                "algorithm.off_policy_correction=token-truncate",
                "loss.truncated_is_cap=2",
                "loss.mismatch_band_low=0.5",
                "loss.mismatch_band_high=2",
            ],
            "loss.mismatch_band_low/_high set a masking band, but "
            "algorithm.off_policy_correction=token-truncate masks nothing",
        ),
        (
            RECOMPUTE + ["loss.mismatch_band_low=0.5", "loss.mismatch_band_high=2"],
            "loss.mismatch_band_low/_high set a masking band, but "
            "algorithm.off_policy_correction=unset masks nothing",
        ),
        (
            [
                "loss.overlong.buffer_length=4",
                "loss.overlong.penalty_factor=1",
                "loss.overlong.filter=true",
                "algorithm.kl.coef=0.1",
                "algorithm.kl.placement=reward",
            ],
            "loss.overlong.filter=true with algorithm.kl.placement='reward'",
        ),
    ],
)
def test_training_rules_name_the_fields(overrides, message):
    cfg = load_config(None, TRAINABLE + overrides)
    with pytest.raises(ValueError) as raised:
        check_training(cfg)
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize("correction", ["token-mask", "icepop", "sequence-mask", "geometric-mask"])
def test_a_band_mask_trains_with_its_band_alone(correction):
    overrides = [
        f"algorithm.off_policy_correction={correction}",
        "loss.mismatch_band_low=0.5",
        "loss.mismatch_band_high=5",
    ]
    cfg = load_config(None, TRAINABLE + RECOMPUTE + overrides)
    check_training(cfg)
    assert cfg.loss.mismatch_band() == (0.5, 5.0)


def test_one_sample_per_prompt_trains_with_verls_rule():
    cfg = load_config(
        None, TRAINABLE + ["rollout.samples_per_prompt=1", "algorithm.one_sample_advantage=reward"]
    )
    check_training(cfg)
    cfg = load_config(None, TRAINABLE + ["rollout.samples_per_prompt=1"])
    with pytest.raises(ValueError, match="algorithm.one_sample_advantage=reward"):
        check_training(cfg)


def test_the_verl_presets_hold_verls_defaults():
    grpo, dapo = (
        ClipSearchConfig.from_preset("verl-grpo"),
        ClipSearchConfig.from_preset("verl-dapo"),
    )
    for clip, high in ((grpo, 1.2), (dapo, 1.28)):
        assert (clip.c_low_start, clip.c_low_max) == (0.8, 0.8)  # 1 - clip_ratio_low
        assert (clip.c_high_start, clip.c_high_max) == (high, high)  # 1 + clip_ratio_high
        assert clip.dual_clip == 3.0  # clip_ratio_c

"""Typed configuration: presets, validation messages, YAML and dotted overrides."""

from __future__ import annotations

import pytest

from bapo_megatron.config import ClipSearchConfig, Config
from bapo_megatron.config_loading import load_config


def test_presets_match_the_spec():
    paper = ClipSearchConfig.from_preset("paper")
    assert (paper.c_low_start, paper.c_low_max, paper.c_low_step) == (0.6, 0.9, 0.02)
    assert (paper.c_high_start, paper.c_high_max, paper.c_high_step) == (1.2, 3.0, 0.05)
    assert (paper.schedule, paper.semantics, paper.target_unit, paper.target) == ("paper", "gradient", "share", 0.4)
    assert paper.dual_clip is None
    ref = ClipSearchConfig.from_preset("reference")
    assert (ref.c_low_start, ref.c_low_max, ref.c_low_step) == (0.6, 0.8, 0.05)
    assert (ref.c_high_start, ref.c_high_max, ref.c_high_step) == (1.2, 2.0, 0.05)
    assert (ref.schedule, ref.semantics, ref.target_unit, ref.target) == ("reference", "surrogate", "ratio", 1.0)
    assert ref.dual_clip == 3.0


def test_yaml_with_preset_and_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("loss:\n  aggregation: seq-mean-token-mean\n  clip:\n    preset: reference\n    c_high_max: 2.5\n")
    cfg = load_config(path, ["loss.clip.dual_clip=null", "loss.clip.target=1.5"])
    assert isinstance(cfg, Config)
    assert cfg.loss.aggregation == "seq-mean-token-mean"
    clip = cfg.loss.clip
    assert (clip.preset, clip.schedule, clip.c_high_max, clip.dual_clip, clip.target) == (
        "reference", "reference", 2.5, None, 1.5)


@pytest.mark.parametrize("overrides,message", [
    (["loss.clip.c_hgh_max=2"], "loss.clip: unknown field"),
    (["loss.clip.c_high_max=abc"], "loss.clip.c_high_max: expected a number"),
    (["loss.clip.preset=ppo"], "loss.clip.preset must be one of"),
    (["loss.clip.schedule=fast"], "loss.clip.schedule: expected one of"),
    (["loss.aggregation=mean"], "loss.aggregation: expected one of"),
    (["loss.clip.c_low_max=0.5"], "c_low_start <= c_low_max"),
    (["loss.clip.c_high_start=0.9"], "1 <= c_high_start"),
    (["loss.clip.c_low_step=0"], "loss.clip.c_low_step must be > 0"),
    (["loss.clip.target=1.5"], "loss.clip.target is a share"),
    (["loss.clip.dual_clip=0.5"], "loss.clip.dual_clip must be > 1"),
    (["loss.clip=3"], "loss.clip: expected a mapping"),
    (["loss.clip.target"], "expected dotted.key=value"),
])
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, overrides)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")

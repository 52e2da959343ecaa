"""The loss demo runs and reports every preset; the synthetic data is what the demo claims."""

from __future__ import annotations

from bapo_megatron.config import CLIP_PRESETS
from bapo_megatron.repro import loss_demo as demo
from bapo_megatron.repro.stale_batches import off_policy_batch


def test_demo_prints_every_preset_and_a_custom_row(tmp_path, capsys):
    cfg = tmp_path / "loss.yaml"
    cfg.write_text("loss:\n  clip:\n    preset: reference\n    dual_clip: null\n")
    demo.main(
        [
            "--config",
            str(cfg),
            "--staleness",
            "4",
            "--prompts",
            "8",
            "--max-tokens",
            "64",
            "loss.clip.c_high_max=2.5",
        ]
    )
    out = capsys.readouterr().out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.split() and line.split()[0] in (*CLIP_PRESETS, "custom")
    ]
    assert [r[0] for r in rows] == [*CLIP_PRESETS, "custom"]
    for row in rows:
        c_low, c_high, steps, before, after = map(float, row[1:6])
        assert 0 < c_low < 1 < c_high and steps >= 0 and 0 <= before <= 1 and 0 <= after <= 1
    paper = rows[0]
    assert float(paper[5]) >= float(paper[4])  # gradient semantics: rho never falls


def test_synthetic_batches_are_stale_and_negative_heavy():
    fresh = off_policy_batch(16, 8, 128, staleness=0.0, seed=1)
    stale = off_policy_batch(16, 8, 128, staleness=8.0, seed=1)
    assert (fresh.logp_new == fresh.logp_old).all()
    spread = lambda b: (b.logp_new - b.logp_old)[b.mask].abs().mean()  # noqa: E731
    assert spread(stale) > 0.1
    neg_tokens = stale.mask[stale.advantages < 0].sum()
    pos_tokens = stale.mask[stale.advantages > 0].sum()
    assert neg_tokens > pos_tokens

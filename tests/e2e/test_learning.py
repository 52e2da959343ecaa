"""Does RL learn? A short run of the tiny CPU run's own configuration (examples/tiny_cpu/train.yaml:
same seeds, warm-up, task and hyperparameters, only fewer rollout steps) must raise the mean reward
by a stated margin, and BAPO's bounds must move where the positive share rho is below its target
while a fixed clip's stay put.

Why these numbers: after its warm-up the policy answers about 63% of the `count_up_and_stop` prompts
right (it often does not stop); 8 rollout steps of 32 x 8 samples (32 optimizer steps) raise that to
0.82 over the last 3 (0.629 -> 0.824, measured on 2 cores, one thread), 10 steps further. (With
torch's unfused Adam the warm-up ended at 0.465 and 8 steps reached 0.801: the warm-up's 300 steps
at lr 3e-3 carry the two kernels' rounding to different policies.) The margin of 0.2 is well above
the sampling noise of one step's mean (256 samples: a standard deviation near 0.03), and the run is
deterministic in one thread, so the test is not flaky. Checked by hand when written: with the
advantages' sign flipped (in ``grpo_advantages``) the reward falls to 0.100, with ``optimizer.lr=0``
it drifts to 0.535, and the test fails in both.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.train_runs import TINY_CONFIG, read_metrics, rollout_records  # noqa: E402

STEPS = 10
"""Rollout steps of the learning run (the tiny CPU run runs 100)."""
MARGIN = 0.2
"""Rise of the mean reward (first rollout step -> mean of the last 3) the run must show."""


def run_tiny_cpu(output_dir, *overrides: str) -> list[dict]:
    """The tiny CPU run's configuration with ``overrides``, in this process on one thread."""
    from bapo_megatron.config.loading import load_config
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.trainer.loop import train

    cfg = load_config(
        TINY_CONFIG,
        [f"train.output_dir={output_dir}", "logging.console=false", *overrides],
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    context = ParallelContext.initialize(cfg.parallel)
    try:
        train(cfg, context)
    finally:
        context.teardown()
        torch.set_num_threads(threads)
    return read_metrics(output_dir)


def update_records(records: list[dict]) -> list[dict]:
    return [r for r in records if "bapo/rho_before" in r]


def informative_below(updates: list[dict], rho0: float) -> list[dict]:
    """Updates with a non-zero advantage whose rho before the search is below ``rho0``."""
    return [
        u
        for u in updates
        if u["bapo/positive_contribution"] + u["bapo/negative_contribution"] > 0
        and u["bapo/rho_before"] < rho0
    ]


def moved_off(update: dict, c_low: float, c_high: float) -> bool:
    """Whether ``update``'s bounds differ from (c_low, c_high) by more than float rounding."""
    return update["bapo/c_low"] != pytest.approx(c_low) or update["bapo/c_high"] != pytest.approx(
        c_high
    )


@pytest.fixture(scope="module")
def bapo_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("learning")
    records = run_tiny_cpu(output, f"train.steps={STEPS}", f"checkpoint.interval={STEPS}")
    return output, records


def test_rl_raises_the_reward_of_the_tiny_cpu_run(bapo_run):
    _, records = bapo_run
    rewards = [r["reward/mean"] for r in rollout_records(records)]
    assert len(rewards) == STEPS
    assert 0.1 < rewards[0] < 0.9  # the warm-up leaves room to learn
    last = sum(rewards[-3:]) / 3
    assert last >= rewards[0] + MARGIN, f"reward {rewards[0]:.3f} -> {last:.3f} (last 3)"


def test_bapo_bounds_move_where_rho_is_below_target_and_a_fixed_clip_stays(bapo_run, tmp_path):
    output, records = bapo_run
    updates = update_records(records)
    below = informative_below(updates, 0.4)
    # the premise holds in this run: failures run long, rho < rho0 in most updates
    assert len(below) >= len(updates) / 2
    moved = [u for u in below if moved_off(u, 0.6, 1.2)]
    assert len(moved) >= 0.9 * len(below)
    assert max(u["bapo/c_high"] for u in updates) > 1.2

    # the same policy under GRPO's fixed clip: rho is as low, the bounds never move
    checkpoint = output / "checkpoints" / f"step_{STEPS:08d}"
    fixed = update_records(
        run_tiny_cpu(
            tmp_path,
            "train.steps=2",
            "warmup.steps=0",
            f"train.load_checkpoint={checkpoint}",
            "loss.clip.preset=grpo",
            "checkpoint.interval=0",
        )
    )
    assert len(fixed) == 8
    assert informative_below(fixed, 0.4)
    assert not any(moved_off(u, 0.8, 1.2) for u in fixed)

"""The numba and torch statistics backends build the same vector; the core imports light."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bapo_megatron.algo import SearchPlan, contribution_stats, importance_ratio
from bapo_megatron.config import ClipSearchConfig
from tests.random_batches import SEARCH_VARIANTS, random_batch


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("preset,overrides", SEARCH_VARIANTS)
def test_numba_and_torch_backends_agree(preset, overrides, dtype):
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset(preset, **overrides))
    for seed in range(10):
        batch = random_batch(seed, dtype=dtype, batch=40, tokens=300)
        ratio, log_ratio = importance_ratio(batch["logp_new"].detach(), batch["logp_old"])
        adv = batch["advantages"]
        adv = adv[:, None].expand_as(ratio) if adv.dim() == 1 else adv
        by_numba, ext_numba = contribution_stats(ratio, log_ratio, adv, batch["mask"], plan, "numba")
        by_torch, ext_torch = contribution_stats(ratio, log_ratio, adv, batch["mask"], plan, "torch")
        torch.testing.assert_close(by_numba, by_torch, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(ext_numba, ext_torch, rtol=0, atol=0)


def test_ties_on_grid_values_follow_the_loss_convention():
    # r exactly on a candidate: unclipped (counted) on both sides, in both backends.
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper"))
    ratio = torch.tensor([1.2, 1.25, 0.6, 0.62, 3.0, 0.9], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(6, dtype=torch.bool)
    for backend in ("numba", "torch"):
        stats, _ = contribution_stats(ratio, ratio.log(), adv, mask, plan, backend)
        counts = stats[2 * (38 + 18): 3 * (38 + 18)]
        pos, neg = counts[:38], counts[38:]
        assert pos[0] == 1 and pos[1] == 1 and pos[36] == 1  # #{h < r} = 0, 1, 36
        assert neg[1] == 1 and neg[2] == 1 and neg[16] == 1  # #{l <= r} = 1, 2, 16


def test_core_imports_without_heavy_packages():
    blocked = ["megatron", "transformer_engine", "vllm", "sglang", "apex", "transformers"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "import bapo_megatron.algo, bapo_megatron.config, bapo_megatron.config_loading\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

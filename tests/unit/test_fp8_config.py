"""FP8 training configuration (``parallel.fp8``, ``parallel.fp8_recipe``): refused where
Transformer Engine's layers cannot run it, handed to Megatron's ``TransformerConfig`` unchanged,
and the token multiple the packer must pad a micro-batch to. FP8 itself runs on a GPU only
(docs/validation.md)."""

from __future__ import annotations

import pytest

from bapo_megatron.config import ParallelConfig
from bapo_megatron.config.parallel import fp8_length_multiple
from bapo_megatron.distributed.layout import Accelerator, validate_layout
from tests.helpers.tiny_models import tiny_model

TINY = tiny_model(params_dtype="bfloat16")


def test_fp8_is_refused_where_transformer_engine_does_not_run_it():
    with pytest.raises(ValueError, match=r"parallel.fp8='hybrid' runs in Transformer Engine's "
                       r"layers on a CUDA GPU, but parallel.device is 'cpu'"):
        ParallelConfig(fp8="hybrid", device="cpu")
    layout = ParallelConfig(fp8="e4m3")
    no_te = Accelerator(transformer_engine=False, cuda=True, fp8_gpu=True)
    with pytest.raises(ValueError, match=r"parallel.fp8='e4m3' needs Transformer Engine, which "
                       "is not installed"):
        validate_layout(TINY, layout, 1, no_te)
    te_without_gpu = Accelerator(transformer_engine=True, cuda=False, fp8_gpu=False)
    with pytest.raises(ValueError, match=r"needs a GPU with FP8 support .* found no GPU"):
        validate_layout(TINY, layout, 1, te_without_gpu)
    hopper = Accelerator(transformer_engine=True, cuda=True, fp8_gpu=True)
    assert validate_layout(TINY, layout, 1, hopper) == 1


@pytest.mark.parametrize(
    ("recipe", "multiple"),
    [("delayed", 16), ("tensorwise", 16), ("mxfp8", 32), ("blockwise", 128)],
)
def test_fp8_length_multiple_per_recipe(recipe, multiple):
    assert fp8_length_multiple(ParallelConfig(fp8="hybrid", fp8_recipe=recipe)) == multiple
    assert fp8_length_multiple(ParallelConfig(fp8_recipe=recipe)) == 1  # no FP8: no padding


def test_every_recipe_reaches_megatrons_transformer_config():
    from bapo_megatron.actor.megatron_config import to_transformer_config

    for fp8 in ("e4m3", "hybrid"):
        for recipe in ("delayed", "tensorwise", "mxfp8", "blockwise"):
            layout = ParallelConfig(fp8=fp8, fp8_recipe=recipe)
            tc = to_transformer_config(TINY, layout, use_cpu_initialization=True)
            assert (tc.fp8, tc.fp8_recipe, tc.bf16) == (fp8, recipe, True)
    assert to_transformer_config(TINY, ParallelConfig(), use_cpu_initialization=True).fp8 is None

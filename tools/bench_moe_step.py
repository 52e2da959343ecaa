"""Benchmark the mixture-of-experts actor's train step: expert parallel 1 vs 2, and the cost of
routing replay, as ratios measured in one run.

Both layouts run on 2 gloo processes under torchrun (one thread each), data parallel 2: `ep1`
(every rank holds every expert, expert gradients summed over the 2 ranks) and `ep2` (each rank
holds half of the experts, tokens travel to them with the alltoall dispatcher), one after the
other in the same two processes (one launch: the ranks start and import once). Per layout, each
rank builds the same small Qwen3-MoE, records the routes of its batch once (a forward pass),
then trains ``--warmup`` untimed and ``--steps`` timed steps with routes replayed and without,
interleaved step by step so machine noise hits both (the `paper` preset at granularity `step`,
so every step also has its no-grad statistics pass, replayed too).

Per layout: the median step time with and without replay, tokens/s, and `replay_ratio` (with /
without: the target is under 1.05). Then `ep2_vs_ep1` (ep2 step / ep1 step, without replay).
The last line printed is one JSON object with those numbers.

Usage: python3 tools/bench_moe_step.py [--steps 5] [--experts 8] [--topk 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {"ep1": 1, "ep2": 2}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layouts", default="ep1,ep2", help=f"comma-separated, from {sorted(LAYOUTS)}"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    parser.add_argument("--sequences", type=int, default=8, help="per rank")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set for the worker processes
    return parser.parse_args(argv)


# ------------------------------------------------------------------------ worker


def layout_names(args: argparse.Namespace) -> list[str]:
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; choose from {sorted(LAYOUTS)}")
    return names


def join_world() -> None:
    """Join torchrun's world here, once: a ParallelContext that creates the world destroys it
    at teardown, and torchrun's store cannot host a second one for the next layout."""
    import datetime

    import torch

    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.device import uses_cuda

    cuda = uses_cuda()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=ParallelConfig().collective_timeout_s)
    torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=timeout)


def worker(args: argparse.Namespace) -> None:
    import torch

    join_world()
    results = {name: measure_layout(args, LAYOUTS[name]) for name in layout_names(args)}
    torch.distributed.destroy_process_group()
    Path(args.worker_out.format(rank=os.environ["RANK"])).write_text(json.dumps(results))


def measure_layout(args: argparse.Namespace, expert_parallel: int) -> dict:
    """This rank's step times (live and replayed routes) at ``expert_parallel``."""
    import torch

    from bapo_megatron.actor.actor import build_actor
    from bapo_megatron.actor.batch import PolicyBatch
    from bapo_megatron.actor.logprobs import compute_logprobs_and_routes
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
    from bapo_megatron.config.moe import MoeConfig
    from bapo_megatron.distributed.context import ParallelContext

    context = ParallelContext.initialize(ParallelConfig(expert_model_parallel_size=expert_parallel))
    model = ModelConfig(
        model_type="qwen3_moe",
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=4 * args.hidden,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=args.vocab,
        max_position_embeddings=max(args.length, 64),
        moe=MoeConfig(
            num_experts=args.experts,
            num_experts_per_tok=args.topk,
            moe_intermediate_size=args.hidden,
        ),
    )
    actor = build_actor(
        model,
        ActorConfig(micro_batch_size=args.micro_batch_size),
        OptimizerConfig(lr=1e-6),
        context,
    )
    g = torch.Generator().manual_seed(context.dp_rank)
    n, s = args.sequences, args.length
    tokens = torch.randint(0, args.vocab, (n, s), generator=g)
    mask = torch.zeros(n, s, dtype=torch.bool)
    mask[:, s // 4 :] = True
    old = torch.where(
        mask,
        -torch.log(torch.tensor(float(args.vocab))) + 0.5 * torch.randn(n, s, generator=g),
        0.0,
    )
    batch = PolicyBatch(
        tokens=tokens, response_mask=mask, old_logprobs=old, advantages=torch.randn(n, generator=g)
    )
    _, routes = compute_logprobs_and_routes(
        actor.chunks,
        batch,
        context,
        actor.routing_replay,
        batching=Batching(args.micro_batch_size),
        temperature=1.0,
    )
    variants = {"live": batch, "replay": dataclasses.replace(batch, routes=routes)}
    clip = ClipSearchConfig.from_preset("paper", granularity="step")
    times = {name: [] for name in variants}
    for step in range(args.warmup + args.steps):
        for name, data in variants.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            train_step(actor, data, LossConfig(clip=clip), SearchPlan.from_config(clip))
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    result = dict(times=times, tokens=n * s * context.dp_size)
    context.teardown()
    return result


# ------------------------------------------------------------------------ driver


def run_layouts(names: list[str], args: argparse.Namespace, argv: list[str], workdir: Path):
    """Every layout of ``names`` in one torchrun launch; the ranks' results."""
    world = 2
    outs = [workdir / f"rank{rank}.json" for rank in range(world)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        __file__,
        *argv,
        "--worker-out",
        str(workdir / "rank{rank}.json"),
    ]
    timeout = args.timeout * len(names)
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"layouts {names} did not finish within {timeout:.0f} s") from None
    if done.returncode != 0 or not all(o.exists() for o in outs):
        raise RuntimeError(
            f"layouts {names} failed (exit {done.returncode}):\n{done.stdout[-4000:]}"
            f"\n{done.stderr[-4000:]}"
        )
    return [json.loads(o.read_text()) for o in outs]


def layout_figures(results: list[dict], steps: int) -> dict:
    """One layout's figures from its ranks' ``results``."""
    # a step ends when its slowest rank ends
    step = {
        variant: [max(r["times"][variant][i] for r in results) for i in range(steps)]
        for variant in ("live", "replay")
    }
    live, replay = statistics.median(step["live"]), statistics.median(step["replay"])
    return dict(
        processes=len(results),
        step_ms=round(1e3 * live, 2),
        replay_step_ms=round(1e3 * replay, 2),
        tokens_per_s=round(results[0]["tokens"] / live, 1),
        replay_ratio=round(replay / live, 3),
    )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker_out:
        worker(args)
        return
    names = layout_names(args)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_layouts(names, args, argv, Path(tmp))
    report: dict = {}
    for name in names:
        report[name] = r = layout_figures([rank[name] for rank in ranks], args.steps)
        print(
            f"{name:4s} {r['processes']} proc  step {r['step_ms']:9.2f} ms  "
            f"with replay {r['replay_step_ms']:9.2f} ms  {r['tokens_per_s']:10.1f} tok/s  "
            f"replay/live {r['replay_ratio']:.3f}",
            flush=True,
        )
    ratios = {}
    if "ep1" in report and "ep2" in report:
        ratios["ep2_vs_ep1"] = round(report["ep2"]["step_ms"] / report["ep1"]["step_ms"], 3)
    config = {k: v for k, v in vars(args).items() if k != "worker_out"}
    print(json.dumps(dict(benchmark="moe_step", config=config, layouts=report, **ratios)))


if __name__ == "__main__":
    from bapo_megatron.process.end import skip_final_collection
    from bapo_megatron.process.start import prepare_process

    prepare_process()
    main(sys.argv[1:])
    skip_final_collection()

"""Benchmark one actor train step (Megatron schedule + BAPO loss + optimizer) at several layouts.

For each layout in ``--layouts`` (default tp1, tp2, pp2, tp2-pp2; data parallel 1), this script
starts tp x pp gloo processes under torchrun (tp1: one process, no launcher; one thread each) that
build the same small Qwen2-style model, train ``--warmup`` untimed steps and then ``--steps`` timed
steps on random off-policy data (``--sequences`` sequences of ``--length`` tokens, micro-batches of
``--micro-batch-size``), in four cases interleaved step by step so machine noise hits all of them:
the `paper` preset at granularity `step` on stale data (search statistics from a no-grad forward
pass, one reduce, then the bounds), the same when the ratios are known to be 1 (the first
mini-batch after recomputed old log-probs: no extra pass), the `reference` preset on stale data,
and fixed `grpo` clips (no search, no extra pass). With one micro-batch per step (``--sequences``
<= ``--micro-batch-size``, as in the tiny CPU run) the stale cases skip the extra pass too: the loss
searches on the step's statistics.

Per layout it reports the median step time, tokens/s (all tokens of the step, prompt and
response, over the median step), the share of the `paper` step spent in the BAPO search itself
(statistics + bound choice, timed around those calls on the last stage; 0 with one micro-batch,
where the search runs inside the loss, untimed), and the ratio of the
`paper` step to the fixed-clip step (what the search and its extra forward pass cost), and under
``cases`` each case's median step and its ratio to the fixed-clip step.
The last line printed is one JSON object with those numbers.

With ``--packing`` it measures instead what packed rows and token budgets save on a long-tailed
batch (one process, TP1): ``--sequences`` responses capped at ``--length`` tokens, a quarter of
them at the cap and the rest log-normal with median cap/8, after prompts of about cap/16 tokens
(fixed seed), trained with the `paper` preset at granularity `step` in three cases, each in a
process of its own so that its peak memory is its own: padded micro-batches of 4 and of 1
sequence, and packed rows filled up to ``--budget`` tokens. Per case: real tokens/s (prompt and
response tokens, padding excluded, over the median step), the share of computed positions that
are padding, and the peak memory above what the process held before the first step (resident
memory on the CPU, allocated device memory on a GPU). The last line is one JSON object with
``packed_over_padded`` (tokens/s of the packed case over each padded case) and
``padding_share`` (per case).

Usage: python3 tools/bench_actor_step.py [--layouts tp1,tp2,pp2,tp2-pp2] [--steps 5]
       python3 tools/bench_actor_step.py --packing [--length 1024] [--budget 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2-pp2": (2, 2)}
# The ranks import the package from this checkout, installed or not (as the other tools do).


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layouts", default="tp1,tp2,pp2,tp2-pp2", help=f"comma-separated, from {sorted(LAYOUTS)}"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per preset")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per preset first")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    parser.add_argument(
        "--packing", action="store_true", help="padded against packed rows (see above)"
    )
    parser.add_argument("--budget", type=int, default=0, help="--packing: tokens (0: 4 x length)")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set for the worker processes
    return parser.parse_args(argv)


# ------------------------------------------------------------------------ worker


def bench_model(args: argparse.Namespace, positions: int):
    """The benchmarks' Qwen2-style model: ``--layers``, ``--hidden``, 8 heads in 4 groups."""
    from bapo_megatron.config import ModelConfig

    return ModelConfig(
        model_type="qwen2",
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=4 * args.hidden,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=args.vocab,
        max_position_embeddings=positions,
    )


def off_policy_batch(tokens, mask, vocab: int, g):
    """``tokens`` with response ``mask``: old log-probs around a typical value for ``vocab``
    (ratios spread around 1), one random advantage per sequence."""
    import torch

    from bapo_megatron.actor.batch import PolicyBatch

    n, s = tokens.shape
    noise = 0.5 * torch.randn(n, s, generator=g)
    old = torch.where(mask, -torch.log(torch.tensor(float(vocab))) + noise, 0.0)
    advantages = torch.randn(n, generator=g)
    return PolicyBatch(tokens=tokens, response_mask=mask, old_logprobs=old, advantages=advantages)


def worker(args: argparse.Namespace) -> None:
    import torch

    from bapo_megatron.actor import train_step as train_step_module
    from bapo_megatron.actor.actor import build_actor
    from bapo_megatron.algo.search_plan import SearchPlan
    from bapo_megatron.config import (
        ActorConfig,
        ClipSearchConfig,
        LossConfig,
        OptimizerConfig,
        ParallelConfig,
    )
    from bapo_megatron.distributed.context import ParallelContext

    if args.packing:
        packing_worker(args)
        return
    tp, pp = int(os.environ["BENCH_TP"]), int(os.environ["BENCH_PP"])
    context = ParallelContext.initialize(
        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    )
    model = bench_model(args, max(args.length, 64))
    actor = build_actor(
        model,
        ActorConfig(micro_batch_size=args.micro_batch_size),
        OptimizerConfig(lr=1e-6),
        context,
    )
    g = torch.Generator().manual_seed(0)
    n, s = args.sequences, args.length
    tokens = torch.randint(0, args.vocab, (n, s), generator=g)
    mask = torch.zeros(n, s, dtype=torch.bool)
    mask[:, s // 4 :] = True
    batch = off_policy_batch(tokens, mask, args.vocab, g)

    search_seconds = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                search_seconds[0] += time.perf_counter() - start

        return wrapper

    # The search proper: statistics of each micro-batch and the bound choice (bench-only timers).
    train_step_module.search_statistics = timed(train_step_module.search_statistics)
    train_step_module.choose_bounds = timed(train_step_module.choose_bounds)

    paper = ClipSearchConfig.from_preset("paper", granularity="step")
    cases = {  # name: (clip, the caller knows every ratio is 1)
        "paper": (paper, False),
        "paper_ratios_known": (paper, True),
        "reference": (ClipSearchConfig.from_preset("reference", granularity="step"), False),
        "grpo": (ClipSearchConfig.from_preset("grpo"), False),
    }
    times = {name: [] for name in cases}
    search_share = []
    for step in range(args.warmup + args.steps):
        for name, (clip, ratios_are_one) in cases.items():
            search_seconds[0] = 0.0
            torch.distributed.barrier()
            start = time.perf_counter()
            train_step_module.train_step(
                actor,
                batch,
                LossConfig(clip=clip),
                SearchPlan.from_config(clip),
                ratios_are_one=ratios_are_one,
            )
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[name].append(elapsed)
                if name == "paper" and context.is_last_stage():
                    search_share.append(search_seconds[0] / elapsed)
    result = dict(
        times=times, search_share=search_share, last_stage=context.is_last_stage(), tokens=n * s
    )
    context.teardown()
    Path(args.worker_out.format(rank=context.rank)).write_text(json.dumps(result))


def long_tailed_lengths(sequences: int, cap: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) lengths: a quarter of the responses at ``cap``, the rest log-normal
    with median cap / 8 (sigma 0.8) within [4, cap]; prompts log-normal around cap / 16."""
    import random

    draw = random.Random(seed)
    pairs = []
    for i in range(sequences):
        tail = int(min(cap, max(4, draw.lognormvariate(0, 0.8) * cap / 8)))
        response = cap if i % 4 == 0 else tail
        prompt = int(min(cap // 4, max(2, draw.lognormvariate(0, 0.3) * cap / 16)))
        pairs.append((prompt, response))
    return pairs


def packing_worker(args: argparse.Namespace) -> None:
    """One case of ``--packing`` in this process (``BENCH_CASE``)."""
    import resource

    import torch

    from bapo_megatron.actor.actor import build_actor
    from bapo_megatron.actor.train_step import train_step
    from bapo_megatron.algo.search_plan import SearchPlan
    from bapo_megatron.config import (
        ActorConfig,
        ClipSearchConfig,
        LossConfig,
        OptimizerConfig,
        ParallelConfig,
    )
    from bapo_megatron.distributed.context import ParallelContext

    case = os.environ["BENCH_CASE"]
    actor_config = {
        "padded_mb4": ActorConfig(micro_batch_size=4),
        "padded_mb1": ActorConfig(micro_batch_size=1),
        "packed": ActorConfig(
            pack_sequences=True, max_tokens_per_microbatch=args.budget or 4 * args.length
        ),
    }[case]
    context = ParallelContext.initialize(ParallelConfig())
    pairs = long_tailed_lengths(args.sequences, args.length)
    width = max(p + r for p, r in pairs)
    model = bench_model(args, width)
    actor = build_actor(model, actor_config, OptimizerConfig(lr=1e-6), context)
    g = torch.Generator().manual_seed(0)
    n = len(pairs)
    tokens = torch.randint(1, args.vocab, (n, width), generator=g)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, (prompt, response) in enumerate(pairs):
        mask[i, prompt : prompt + response] = True
        tokens[i, prompt + response :] = 0
    batch = off_policy_batch(tokens, mask, args.vocab, g)
    clip = ClipSearchConfig.from_preset("paper", granularity="step")
    cuda = context.device.type == "cuda"
    if cuda:  # the device's memory, not the host's
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    times, metrics = [], {}
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        metrics = train_step(actor, batch, LossConfig(clip=clip), SearchPlan.from_config(clip))
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    result = dict(
        step_s=statistics.median(times),
        real_tokens=sum(p + r for p, r in pairs),
        padding_share=metrics["actor/padding_share"],
        micro_batches=metrics["num_microbatches"],
        peak_step_bytes=max(0, peak - before),
        peak_bytes=peak,
    )
    context.teardown()
    Path(args.worker_out.format(rank="0")).write_text(json.dumps(result))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_packing(args: argparse.Namespace, argv: list[str], workdir: Path) -> dict:
    """Every ``--packing`` case, one process each, and their ratios."""
    cases = {}
    for case in ("padded_mb4", "padded_mb1", "packed"):
        out = workdir / f"{case}.json"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "NUMBA_NUM_THREADS": "1",
            "BENCH_CASE": case,
            "PYTHONWARNINGS": "ignore",
        }
        cmd = [sys.executable, __file__, *argv, "--worker-out", str(out)]
        try:
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"case {case} did not finish within {args.timeout:.0f} s") from None
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"case {case} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        r = json.loads(out.read_text())
        cases[case] = dict(
            step_ms=round(1e3 * r["step_s"], 1),
            real_tokens_per_s=round(r["real_tokens"] / r["step_s"], 1),
            padding_share=round(r["padding_share"], 4),
            micro_batches=int(r["micro_batches"]),
            peak_step_mb=round(r["peak_step_bytes"] / 2**20, 1),
            peak_mb=round(r["peak_bytes"] / 2**20, 1),
        )
        c = cases[case]
        print(
            f"{case:11s} step {c['step_ms']:9.1f} ms  {c['real_tokens_per_s']:9.1f} real tok/s  "
            f"padding {100 * c['padding_share']:5.1f}%  {c['micro_batches']:3d} micro-batches  "
            f"peak +{c['peak_step_mb']:.0f} MiB",
            flush=True,
        )
    packed = cases["packed"]
    return dict(
        cases=cases,
        packed_over_padded={
            name: round(packed["real_tokens_per_s"] / cases[name]["real_tokens_per_s"], 3)
            for name in ("padded_mb4", "padded_mb1")
        },
        peak_memory_over_padded={
            name: round(packed["peak_step_mb"] / max(cases[name]["peak_step_mb"], 1e-9), 3)
            for name in ("padded_mb4", "padded_mb1")
        },
        padding_share={name: c["padding_share"] for name, c in cases.items()},
    )


# ------------------------------------------------------------------------ driver


def run_layout(name: str, args: argparse.Namespace, argv: list[str], workdir: Path) -> dict:
    tp, pp = LAYOUTS[name]
    world = tp * pp
    outs = [workdir / f"{name}-rank{rank}.json" for rank in range(world)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
        "BENCH_TP": str(tp),
        "BENCH_PP": str(pp),
        "PYTHONWARNINGS": "ignore",
    }
    # torchrun starts the ranks and stops them all when one fails; one process needs no launcher
    # (torchrun's own start would cost more than a small step): it makes its world of one.
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    if world == 1:
        launcher = []
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
    cmd = [
        sys.executable,
        *launcher,
        __file__,
        *argv,
        "--worker-out",
        str(workdir / f"{name}-rank{{rank}}.json"),
    ]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"layout {name} did not finish within {args.timeout:.0f} s") from None
    if done.returncode != 0 or not all(o.exists() for o in outs):
        raise RuntimeError(
            f"layout {name} failed (exit {done.returncode}):\n{done.stdout[-4000:]}"
            f"\n{done.stderr[-4000:]}"
        )
    results = [json.loads(o.read_text()) for o in outs]
    # A step ends when its slowest rank ends: per step, the max over ranks.
    step = {
        name_: [max(r["times"][name_][i] for r in results) for i in range(args.steps)]
        for name_ in results[0]["times"]
    }
    shares = [x for r in results if r["last_stage"] for x in r["search_share"]]
    paper, grpo = statistics.median(step["paper"]), statistics.median(step["grpo"])
    return dict(
        processes=world,
        step_ms=round(1e3 * paper, 2),
        fixed_clip_step_ms=round(1e3 * grpo, 2),
        tokens_per_s=round(results[0]["tokens"] / paper, 1),
        search_share=round(statistics.median(shares), 4),
        step_vs_fixed_clip=round(paper / grpo, 3),
        cases={
            case: dict(
                step_ms=round(1e3 * statistics.median(seconds), 2),
                vs_fixed_clip=round(statistics.median(seconds) / grpo, 3),
            )
            for case, seconds in step.items()
        },
    )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker_out:
        worker(args)
        return
    if args.packing:
        with tempfile.TemporaryDirectory() as tmp:
            report = run_packing(args, argv, Path(tmp))
        config = {k: v for k, v in vars(args).items() if k != "worker_out"}
        config["budget"] = args.budget or 4 * args.length
        print(json.dumps(dict(benchmark="actor_step_packing", config=config, **report)))
        return
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; choose from {sorted(LAYOUTS)}")
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            report[name] = run_layout(name, args, argv, Path(tmp))
            r = report[name]
            print(
                f"{name:8s} {r['processes']} proc  step {r['step_ms']:9.2f} ms  "
                f"fixed-clip step {r['fixed_clip_step_ms']:9.2f} ms  "
                f"{r['tokens_per_s']:10.1f} tok/s  "
                f"search {100 * r['search_share']:5.2f}% of step  "
                f"paper/fixed {r['step_vs_fixed_clip']:.3f}  ("
                + ", ".join(f"{c} {v['vs_fixed_clip']:.3f}" for c, v in r["cases"].items())
                + ")",
                flush=True,
            )
    config = {k: v for k, v in vars(args).items() if k != "worker_out"}
    print(json.dumps(dict(benchmark="actor_step", config=config, layouts=report)))


if __name__ == "__main__":
    from bapo_megatron.process.end import skip_final_collection
    from bapo_megatron.process.start import prepare_process

    prepare_process()
    main(sys.argv[1:])
    skip_final_collection()

"""Benchmark the BAPO loss against the fixed-clip loss and a step-by-step bound search.

Measures forward + backward (``loss.backward()`` w.r.t. ``logp_new``) on synthetic off-policy
data of each size given by ``--sizes`` (default 1M and 8M token slots, float32, [batch, tokens]
with padding):

    a   fixed clip: importance_ratio + clipped_surrogate + aggregate with the `grpo` bounds
        (0.8, 1.2) as plain floats; no search, no statistics. The baseline of the targets.
    a'  bapo_loss with the `grpo` preset: empty search ranges, but the statistics are still built.
    b   bapo_loss with the vectorised search of ``--preset`` (one statistics pass, one reduce).
    b+  the same with check_inputs=True (validation on; every other variant has it off).
    c   step-by-step search (tests/helpers/bapo_reference.py::search: one reduce and one host
        sync per step, as the authors' code does), then the loss at the chosen bounds.

Every variant runs ``--warmup`` untimed times (numba compiles or loads its cache on the first
call), then ``--repeats`` timed times, the variants interleaved so machine noise hits all of
them. The table shows the min and median; the ratios use ``--stat`` (min by default, as noise
only ever adds time). `steps` is the number of moves the search took (the data is built so the
`paper` search takes 20+), `reduces` the number of calls of the reduce callable in one forward.
The `b parts` row splits variant b into its stages (ratio, statistics, bound choice,
surrogate + aggregation, backward), each its own min/median over the repeats.

The last line printed is one JSON object; its `targets` per size say whether b/a <= 1.15,
c/b >= 10 (null when the search took fewer than 20 steps), b decided with exactly one
reduction, c reduced steps + 1 times, and b and c chose the same bounds.

Usage (from the checkout, whose tests/ it imports):
    PYTHONPATH=. python3 tools/bench_bapo_loss.py [--sizes 64K,1M,8M] [--repeats 5] [--threads N]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from bapo_megatron.algo import (
    SearchPlan,
    aggregate,
    bapo_loss,
    choose_bounds,
    clipped_surrogate,
    contribution_stats,
    identity_reduce,
    importance_ratio,
    loss_normalizer,
)
from bapo_megatron.config import CLIP_PRESETS, ClipSearchConfig
from tests.helpers import bapo_reference

SHAPES = {"64K": (64, 1024), "1M": (512, 2048), "8M": (2048, 4096)}  # [batch, tokens]
AGGREGATION = "token-mean"
VARIANTS = {
    "a": "fixed clip (grpo)",
    "a'": "bapo_loss, grpo preset",
    "b": "bapo, vectorised",
    "b+": "bapo, vectorised +check",
    "c": "bapo, step-by-step",
}
PARTS = ("ratio", "stats", "choose", "surrogate", "backward")


class CountingReduce:
    """The identity reduce of one process, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return identity_reduce(x)


def parse_shape(size: str) -> tuple[int, int]:
    """[batch, tokens] of a size name: 64K, 1M, 8M, or e.g. 2M / 300K (2048-token rows)."""
    if size in SHAPES:
        return SHAPES[size]
    scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:].upper(), 1)
    total = int(float(size.rstrip("KkMm")) * scale)
    tokens = min(2048, total)
    return max(1, total // tokens), tokens


def synchronize() -> None:
    """Wait for queued GPU work, so that a clock reading covers it (nothing to wait for on the
    CPU)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def make_data(batch: int, tokens: int, seed: int, device: str = "cpu"):
    """Off-policy GRPO-like batch: 30% of sequences have A > 0 (so rho starts low), response
    lengths uniform in [tokens/4, tokens] (the rest is padding), token-level advantages (the
    sequence's value copied to its tokens), and stale behaviour log-probs: the current policy
    moved up on positive-advantage tokens (|N(0, 0.8)|) and down on negative ones (|N(0, 0.3)|),
    so many positive tokens sit above c_high and the `paper` search walks c_high far up."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(tokens // 4, tokens + 1, (batch,), generator=g)
    mask = torch.arange(tokens)[None, :] < lengths[:, None]
    sign = torch.where(torch.rand(batch, generator=g) < 0.3, 1.0, -1.0)
    seq_adv = sign * (0.2 + torch.rand(batch, generator=g))
    advantages = seq_adv[:, None].expand(batch, tokens).contiguous()
    logp_old = -torch.empty(batch, tokens).exponential_(1.0, generator=g)
    drift = torch.randn(batch, tokens, generator=g).abs()
    drift = torch.where(advantages > 0, 0.8 * drift, -0.3 * drift)
    logp_new = (logp_old + drift).to(device).requires_grad_(True)
    return logp_new, logp_old.to(device), advantages.to(device), mask.to(device)


def build_variants(data, cfg: ClipSearchConfig):
    """One forward per variant: ``fn(reduce) -> (loss, decision info or None)``."""
    logp_new, logp_old, adv, mask = data
    norm = loss_normalizer(mask, AGGREGATION)
    plan = SearchPlan.from_config(cfg)
    grpo_plan = SearchPlan.from_config(ClipSearchConfig.from_preset("grpo"))
    low, high = CLIP_PRESETS["grpo"]["c_low_start"], CLIP_PRESETS["grpo"]["c_high_start"]

    def fixed(reduce):
        ratio, _ = importance_ratio(logp_new, logp_old)
        return aggregate(clipped_surrogate(ratio, adv, low, high), mask, AGGREGATION, norm), None

    def unified(the_plan, check):
        def forward(reduce):
            return bapo_loss(
                logp_new,
                logp_old,
                adv,
                mask,
                plan=the_plan,
                normalizer=norm,
                aggregation=AGGREGATION,
                reduce=reduce,
                check_inputs=check,
            )

        return forward

    def stepwise(reduce):
        ratio, _ = importance_ratio(logp_new, logp_old)
        res = bapo_reference.search(ratio.detach(), adv, mask, cfg, reduce=reduce)
        per_token = clipped_surrogate(ratio, adv, res.c_low, res.c_high, cfg.dual_clip)
        return aggregate(per_token, mask, AGGREGATION, norm), res

    def parts(reduce):
        """Variant b written out stage by stage (what bapo_loss does), with a clock per stage."""
        synchronize()
        marks = [time.perf_counter()]
        ratio, log_ratio = importance_ratio(logp_new, logp_old)
        synchronize()
        marks.append(time.perf_counter())
        with torch.no_grad():
            stats, _ = contribution_stats(ratio, log_ratio, adv, mask, plan)
            synchronize()
            marks.append(time.perf_counter())
            decision = choose_bounds(reduce(stats), plan)
        synchronize()
        marks.append(time.perf_counter())
        per_token = clipped_surrogate(ratio, adv, decision.c_low, decision.c_high, cfg.dual_clip)
        loss = aggregate(per_token, mask, AGGREGATION, norm)
        synchronize()
        marks.append(time.perf_counter())
        loss.backward()
        synchronize()
        marks.append(time.perf_counter())
        return [(t1 - t0) * 1e3 for t0, t1 in itertools.pairwise(marks)]

    return {
        "a": fixed,
        "a'": unified(grpo_plan, False),
        "b": unified(plan, False),
        "b+": unified(plan, True),
        "c": stepwise,
    }, parts


def time_once(forward, logp_new: torch.Tensor):
    """(ms of forward + backward, reduce calls, (steps, c_low, c_high) or Nones)."""
    reduce = CountingReduce()
    logp_new.grad = None
    synchronize()
    start = time.perf_counter()
    loss, info = forward(reduce)
    loss.backward()
    synchronize()
    ms = (time.perf_counter() - start) * 1e3
    if info is None:
        return ms, reduce.calls, (None, None, None)
    if isinstance(info, bapo_reference.ReferenceResult):
        return ms, reduce.calls, (info.steps, info.c_low, info.c_high)
    steps = int(info["bapo/search_steps"])
    return ms, reduce.calls, (steps, float(info["bapo/c_low"]), float(info["bapo/c_high"]))


def bench_size(size: str, args, cfg: ClipSearchConfig) -> dict:
    batch, tokens = parse_shape(size)
    data = make_data(batch, tokens, args.seed, args.device)
    variants, parts = build_variants(data, cfg)
    times = {v: [] for v in [*VARIANTS, "b parts"]}
    part_times, calls, decisions = [], {}, {}
    for rep in range(args.warmup + args.repeats):
        for name, forward in variants.items():  # interleaved: noise hits every variant alike
            ms, calls[name], decisions[name] = time_once(forward, data[0])
            if rep >= args.warmup:
                times[name].append(ms)
        data[0].grad = None
        split = parts(CountingReduce())
        if rep >= args.warmup:
            part_times.append(split)
            times["b parts"].append(sum(split))
    pick = min if args.stat == "min" else statistics.median
    part_times = list(zip(*part_times, strict=True))  # one column per stage
    ms = {v: pick(t) for v, t in times.items()}
    steps = decisions["b"][0]
    res = {
        "shape": [batch, tokens],
        "response_tokens": int(data[3].sum()),
        "ms": {v: round(t, 2) for v, t in ms.items()},
        "ms_min": {v: round(min(t), 2) for v, t in times.items()},
        "ms_median": {v: round(statistics.median(t), 2) for v, t in times.items()},
        "b_parts_ms": {p: round(pick(col), 2) for p, col in zip(PARTS, part_times, strict=True)},
        "steps": steps,
        "variant_steps": {v: d[0] for v, d in decisions.items()},
        "bounds": {v: list(decisions[v][1:]) for v in ("b", "c")},
        "reductions": calls,
        "b_over_a": round(ms["b"] / ms["a"], 4),
        "b_over_a_unified": round(ms["b"] / ms["a'"], 4),
        "b_checked_over_a": round(ms["b+"] / ms["a"], 4),
        "c_over_b": round(ms["c"] / ms["b"], 3),
    }
    res["targets"] = {
        "b_over_a_le_1.15": res["b_over_a"] <= 1.15,
        "c_over_b_ge_10": res["c_over_b"] >= 10 if steps >= 20 else None,
        "one_reduction_per_decision": all(calls[v] == 1 for v in ("a'", "b", "b+")),
        "stepwise_reductions_eq_steps_plus_1": calls["c"] == decisions["c"][0] + 1,
        "bounds_agree_b_c": decisions["b"] == decisions["c"],
    }
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,8M", help="comma list: 64K, 1M, 8M, or e.g. 2M")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per variant first")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's own; the numba kernel is serial)",
    )
    parser.add_argument("--preset", default="paper", help="clip preset of variants b and c")
    parser.add_argument("--stat", choices=("min", "median"), default="min", help="for the ratios")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the tensors' device)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = ClipSearchConfig.from_preset(args.preset)
    threads = torch.get_num_threads()
    print(
        f"torch {torch.__version__}, {threads} threads, preset {args.preset}, "
        f"forward + backward, {args.repeats} repeats after {args.warmup} warm-up, "
        f"ratios on the {args.stat}"
    )
    header = (
        f"{'size':>5}  {'variant':<27} {'min ms':>9} {'median ms':>10} {'steps':>6} {'reduces':>8}"
    )
    print(header + "\n" + "-" * len(header))
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": threads,
        "preset": args.preset,
        "repeats": args.repeats,
        "stat": args.stat,
        "sizes": {},
    }
    for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
        res = report["sizes"][size] = bench_size(size, args, cfg)
        for v, label in [*VARIANTS.items(), ("b parts", "sum of the stages below")]:
            steps = res["variant_steps"].get(v)
            print(
                f"{size:>5}  {(v + ' ' + label):<27} {res['ms_min'][v]:>9.1f} "
                f"{res['ms_median'][v]:>10.1f} {'-' if steps is None else steps:>6} "
                f"{res['reductions'].get(v, '-'):>8}"
            )
        print(
            f"{size:>5}    b parts ({args.stat}, ms): "
            + ", ".join(f"{p} {t:.1f}" for p, t in res["b_parts_ms"].items())
        )
        print(
            f"{size:>5}    b/a = {res['b_over_a']:.3f} (target <= 1.15), "
            f"b/a' = {res['b_over_a_unified']:.3f}, b+/a = {res['b_checked_over_a']:.3f}, "
            f"c/b = {res['c_over_b']:.1f} (target >= 10 at {res['steps']} steps)"
        )
        if not res["targets"]["bounds_agree_b_c"]:
            print(f"{size:>5}    WARNING: b and c chose different bounds: {res['bounds']}")
    report["all_targets_met"] = all(
        ok is not False for res in report["sizes"].values() for ok in res["targets"].values()
    )
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    from bapo_megatron.process.end import skip_final_collection
    from bapo_megatron.process.start import prepare_process

    prepare_process()
    main()
    skip_final_collection()

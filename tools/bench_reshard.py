"""Benchmark the shard-to-shard weight sync against the broadcast path on the CPU (gloo, real
processes, one thread each).

For each trainer layout (``--layouts``: tp2, tp2pp2) and engine (``--engines``: vllm, an
in-process vLLM at tensor parallel 2; embedded), it starts the trainer's ranks, builds a
Qwen2-style model (default about 0.49 GB in float32: hidden 1024, 8 layers, 16 heads in 4 query
groups, MLP 2816, vocabulary 32000, tied) with random weights, starts the engine on the replica's
first rank (vLLM on dummy weights), syncs once by each path to warm up, then ``--repeats`` times
by each path in turn, with barriers around each sync (the time is the slowest rank's). It counts
the bytes each engine worker received where it received them (vLLM's workers report them for
both paths; the embedded engine's rank counts what the shard-to-shard transfer brought it from
other ranks, and its broadcast bytes, brought by the export's gathers, are not counted), the
tensor gathers and whole-tensor assemblies during the shard-to-shard syncs (none expected), the
largest bucket any worker receives from other ranks, and how far each vLLM worker's resident
memory rises during a sync above where it was before (Linux: the peak resident set, reset
through ``/proc/<pid>/clear_refs`` before each sync).

The last printed line is one JSON object: per case the median times and bytes, and, for the
first vLLM case, ``bytes_ratio`` (shard-to-shard / broadcast bytes received per engine worker)
and ``time_ratio`` (shard-to-shard / broadcast median sync time).

Usage: python3 tools/bench_reshard.py [--engines vllm,embedded] [--layouts tp2,tp2pp2]
       [--repeats 5] [--bucket-mib 64] [--dtype float32]
       [--hidden 1024 --layers 8 --ffn 2816 --heads 16 --kv-heads 4 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {"tp2": (2, 1), "tp2pp2": (2, 2)}
ENGINE_TP = 2


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="vllm,embedded")
    parser.add_argument("--layouts", default="tp2,tp2pp2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--timeout", type=float, default=1800.0)
    # a rank's own flags
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--case", default=None)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace):
    from bapo_megatron.config import ModelConfig

    return ModelConfig(
        model_type="qwen2",
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        params_dtype=args.dtype,
    )


def start_engine(kind: str, model, work: Path, dtype: str):
    if kind == "embedded":
        from bapo_megatron.rollout.embedded.engine import EmbeddedEngine

        return EmbeddedEngine(model)
    from bapo_megatron.rollout.vllm.engine import VLLMEngine

    folder = work / "engine-start"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.to_hf_config()))
    engine = VLLMEngine.from_pretrained(
        folder,
        dtype=dtype,
        tensor_parallel_size=ENGINE_TP,
        load_format="dummy",
        enforce_eager=True,
        max_model_len=256,
        kv_cache_gib=1,
    )
    # the broadcast path's per-worker reports (bytes received), kept for the benchmark
    load, engine.broadcast_reports = engine._load_weights, []

    def recorded(*args, **kwargs):
        reports = load(*args, **kwargs)
        engine.broadcast_reports.append(reports)
        return reports

    engine._load_weights = recorded
    return engine


def worker_pids(engine) -> list[int]:
    """The pids of an in-process vLLM's worker processes."""
    from bapo_megatron.rollout.vllm.tensor_parallel import executor_of

    return [handle.proc.pid for handle in executor_of(engine.llm).workers]


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def peak_reset(pid: int) -> int:
    """Reset the process's peak resident set (Linux: ``5`` into ``clear_refs``); its resident
    bytes now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kib(pid, "VmRSS") * 1024


def peak(pid: int) -> int:
    """The process's peak resident bytes since the last :func:`peak_reset`."""
    return _status_kib(pid, "VmHWM") * 1024


def rank_main(args: argparse.Namespace) -> None:
    import types

    import torch
    import torch.distributed as dist

    import bapo_megatron.weights.tp_assembly as transports
    from bapo_megatron.actor.model import build_model
    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.trainer.replicas import holds_engine
    from bapo_megatron.weight_sync.colocated_stream import push_weights
    from bapo_megatron.weight_sync.shard_to_shard import ShardSync, push_shards

    layout, kind = args.case.split(":")
    tp, pp = LAYOUTS[layout]
    dist.init_process_group("gloo", rank=args.rank, world_size=tp * pp)
    ctx = ParallelContext.initialize(
        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    )
    model = model_config(args)
    chunks = build_model(model, ctx.config, ctx, seed=1)
    actor = types.SimpleNamespace(context=ctx, chunks=chunks, model_config=model)
    work = Path(args.out).parent
    engine = start_engine(kind, model, work, args.dtype) if holds_engine(ctx) else None
    bucket = args.bucket_mib * 2**20
    sync = ShardSync()
    gathers = [0]

    def counting(original):
        def call(*a, **k):
            gathers[0] += 1
            return original(*a, **k)

        return call

    def timed(action, version: int) -> tuple[float, object]:
        dist.barrier()
        start = time.perf_counter()
        out = action(version)
        dist.barrier()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took.item()), out

    def shards(version: int):
        names = ("gather", "all_gather", "all_gather_into_tensor", "all_gather_single")
        saved = [(dist, n, getattr(dist, n)) for n in names if hasattr(dist, n)]
        saved.append((transports, "place_shard", transports.place_shard))
        for module, name, original in saved:
            setattr(module, name, counting(original))
        try:
            return push_shards(actor, engine, sync, version=version, bucket_bytes=bucket)
        finally:
            for module, name, original in saved:
                setattr(module, name, original)

    def broadcast(version: int):
        return push_weights(actor, engine, version=version, bucket_bytes=bucket)

    times = {"shard_to_shard": [], "broadcast": []}
    received = {"shard_to_shard": [], "broadcast": []}
    peaks = {"shard_to_shard": [], "broadcast": []}
    workers = worker_pids(engine) if kind == "vllm" and engine is not None else []
    for repeat in range(args.repeats + 1):  # the first of each: warm-up (and the plan)
        for path, action in (("shard_to_shard", shards), ("broadcast", broadcast)):
            resident = [peak_reset(pid) for pid in workers]
            took, reports = timed(action, 2 * repeat + (path == "broadcast"))
            if repeat == 0:
                continue
            times[path].append(took)
            if workers:  # how far each worker's resident memory rose above where it started
                peaks[path].append(max(peak(pid) - rss for pid, rss in zip(workers, resident)))
            if engine is None:
                continue
            if path == "shard_to_shard":
                per_worker = (
                    [r["received_bytes"] for r in reports]
                    if kind == "vllm"
                    else [sync.last.received_bytes]
                )
            elif kind == "vllm":
                per_worker = [r["received_bytes"] for r in engine.broadcast_reports[-1]]
            else:  # the export's gathers bring it the other ranks' shards: not counted
                continue
            received[path].append(max(per_worker))
    if args.rank == 0:
        plan = sync.plan
        biggest = max(
            sum(m.numel for m in bucket_ if m.receiver == receiver != m.sender) * plan.element_bytes
            for bucket_ in plan.buckets
            for receiver in {m.receiver for m in bucket_}
        )
        result = {
            "seconds": {path: statistics.median(values) for path, values in times.items()},
            "all_seconds": times,
            "received_bytes_per_engine_worker": {
                path: statistics.median(values) if values else None
                for path, values in received.items()
            },
            "gathers_during_shard_to_shard": gathers[0],
            "worker_peak_rise_bytes": {
                path: statistics.median(values) if values else None
                for path, values in peaks.items()
            },
            "largest_bucket_received_bytes": biggest,
            "buckets": len(plan.buckets),
            "messages": plan.message_count,
        }
        Path(args.out).write_text(json.dumps(result))
    if engine is not None and hasattr(engine, "close"):
        engine.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def log_tails(work: Path, case: str) -> str:
    """The end of every rank's log of ``case`` (the folder goes when the benchmark ends)."""
    return "\n".join(
        f"----- {log.name}\n{log.read_text(errors='replace')[-2500:]}"
        for log in sorted(work.glob(f"{case.replace(':', '-')}-rank*.log"))
    )


def run_case(argv: list[str], case: str, args: argparse.Namespace, work: Path) -> dict:
    layout, _ = case.split(":")
    tp, pp = LAYOUTS[layout]
    out = work / f"{case.replace(':', '-')}.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONWARNINGS": "ignore",
    }
    logs, procs = [], []
    for rank in range(tp * pp):
        log = open(work / f"{case.replace(':', '-')}-rank{rank}.log", "wb")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    *argv,
                    "--rank",
                    str(rank),
                    "--case",
                    case,
                    "--out",
                    str(out),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"{case}: a rank failed or timed out\n{log_tails(work, case)}")
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{case}: a rank failed\n{log_tails(work, case)}")
    return json.loads(out.read_text())


def main(argv: list[str]) -> None:
    args = arguments(argv)
    if args.rank is not None:
        rank_main(args)
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-reshard-") as folder:
        for kind in args.engines.split(","):
            for layout in args.layouts.split(","):
                case = f"{layout}:{kind}"
                result = results[case] = run_case(argv, case, args, Path(folder))
                seconds, received = result["seconds"], result["received_bytes_per_engine_worker"]
                mib = {
                    path: "n/a" if value is None else f"{value / 2**20:.1f} MiB"
                    for path, value in received.items()
                }
                rise = {
                    path: "n/a" if value is None else f"{value / 2**20:.1f} MiB"
                    for path, value in result["worker_peak_rise_bytes"].items()
                }
                print(
                    f"{case:20s} sync {seconds['shard_to_shard']:.3f} s shard-to-shard, "
                    f"{seconds['broadcast']:.3f} s broadcast; received per engine worker "
                    f"{mib['shard_to_shard']} vs {mib['broadcast']}; worker memory peak "
                    f"rise {rise['shard_to_shard']} vs {rise['broadcast']}; gathers "
                    f"{result['gathers_during_shard_to_shard']}",
                    flush=True,
                )
    summary = {"cases": results}
    first = next((case for case in results if case.endswith(":vllm")), None)
    if first is not None:
        result = results[first]
        received, seconds = result["received_bytes_per_engine_worker"], result["seconds"]
        summary["case"] = first
        summary["bytes_ratio"] = round(received["shard_to_shard"] / received["broadcast"], 4)
        summary["time_ratio"] = round(seconds["shard_to_shard"] / seconds["broadcast"], 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    from bapo_megatron.process.start import prepare_process

    prepare_process()
    main(sys.argv[1:])

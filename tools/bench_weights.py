"""Benchmark the live weight export and the HF -> Megatron conversion at TP2/PP2 on the CPU.

Starts 4 gloo processes (one thread each; forked from one process that imported torch and
Megatron-Core once, instead of four interpreters importing them side by side) that build a
Llama-style model (default about 1B parameters: hidden 2048, 18 layers, 16 heads in 8 query
groups, MLP 5632, vocab 32000, untied, bf16, random weights) at TP2/PP2 and measure, with
barriers around each phase and the slowest rank's time:

    copy        every rank clones its own parameter shards into new tensors: a plain in-memory
                copy of the same bytes, at the same parallelism (the floor the export is
                compared with; new tensors, as the export hands out new tensors)
    warm copy   the same copy into tensors already allocated (no page faults; for reference)
    export      ``export_weights`` at TP2/PP2: each stage gathers its TP shards into its first
                TP rank and yields whole HF tensors in ``--bucket-mib`` buckets (consumer: drop),
                new tensors for every bucket (compare with copy)
    export, kept buffer
                the same with one transport built once with ``reuse=True``: every bucket refills
                one kept shared-memory buffer (compare with warm copy)
    to HF       ``write_hf_folder``: the export written as safetensors shards by each stage
    to Megatron ``hf_to_megatron``'s phases on that folder at TP2/PP2: open and validate, build
                the model without Megatron's random init (as the conversion does), read each
                rank's slices into it, save the torch_dist checkpoint
    read+write  every rank reads a quarter of the HF shard files and writes the bytes to new
                files (fsync, as Megatron's checkpoint writer): the I/O floor of the conversion

Throughputs count the bytes of the whole model once. The last printed line is one JSON object
with the numbers and the ratios export/copy and kept-buffer export/warm copy (target >= 0.5),
and to-Megatron/read+write (with and without the model build).

Usage: python3 tools/bench_weights.py [--dtype bfloat16] [--bucket-mib 512] [--repeats 3]
       [--transport auto|collective|shared_memory]
       [--hidden 2048 --layers 18 --ffn 5632 --heads 16 --kv-heads 8 --vocab 32000]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

WORLD, TP, PP = 4, 2, 2
# What the ranks import: loaded once before they are forked (see start_ranks).
WORKER_MODULES = (
    "torch.distributed",
    "bapo_megatron.actor.model",
    "bapo_megatron.config",
    "bapo_megatron.distributed.context",
    "bapo_megatron.weights.convert",
    "bapo_megatron.weights.export",
    "bapo_megatron.weights.hf_checkpoint",
    "bapo_megatron.weights.megatron_checkpoint",
    "bapo_megatron.weights.tp_assembly",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--bucket-mib", type=float, default=512.0, help="export bucket bound")
    parser.add_argument("--repeats", type=int, default=3, help="timed copies and exports (min)")
    parser.add_argument(
        "--transport",
        choices=["auto", "collective", "shared_memory"],
        default="auto",
        help="how TP shards reach the receiving rank",
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set for the worker processes
    return parser.parse_args(argv)


# ------------------------------------------------------------------------ worker


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from bapo_megatron.actor.model import build_model
    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.weights.convert import load_hf_weights, write_hf_folder
    from bapo_megatron.weights.export import export_weights
    from bapo_megatron.weights.hf_checkpoint import DTYPE_NAMES, HFCheckpoint, non_weight_files
    from bapo_megatron.weights.megatron_checkpoint import save_megatron_checkpoint
    from bapo_megatron.weights.tp_assembly import make_transport

    dtype = getattr(torch, args.dtype)
    work = Path(args.workdir)
    context = ParallelContext.initialize(
        ParallelConfig(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    )
    model = ModelConfig(
        model_type="llama",
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        params_dtype=args.dtype,
    )

    def timed(fn, *fn_args, **fn_kwargs):
        """(result of fn, seconds on the slowest rank), with barriers before and after."""
        dist.barrier()
        start = time.perf_counter()
        result = fn(*fn_args, **fn_kwargs)
        dist.barrier()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return result, float(elapsed)

    def total(value: int) -> int:
        summed = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(summed)
        return int(summed)

    def clone_all(tensors):
        return [t.clone() for t in tensors]

    def copy_all(targets, tensors):
        for target, tensor in zip(targets, tensors):
            target.copy_(tensor)

    def export(chunks, transport) -> int:
        sent = 0
        for bucket in export_weights(
            chunks,
            model,
            context,
            version=1,
            bucket_bytes=int(args.bucket_mib * 2**20),
            dtype=dtype,
            transport=transport,
        ):
            sent += bucket.nbytes  # the consumer drops the bucket
        return sent

    chunks, build_s = timed(build_model, model, context.config, context)
    params = [p.detach() for chunk in chunks for p in chunk.parameters()]
    model_bytes = total(sum(p.numel() * p.element_size() for p in params))
    # built once and passed to every export: one kept buffer, refilled bucket after bucket
    kept = make_transport(args.transport, context, torch.device("cpu"), False, reuse=True)
    copy_s, warm_s, export_s, reused_s = [], [], [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits all of them
        copies, seconds = timed(clone_all, params)
        copy_s.append(seconds)
        warm_s.append(timed(copy_all, copies, params)[1])
        del copies
        sent, seconds = timed(export, chunks, args.transport)
        export_s.append(seconds)
        reused_s.append(timed(export, chunks, kept)[1])
    exported_bytes = total(sent)
    del kept

    hf_dir, megatron_dir, io_dir = work / "hf", work / "megatron", work / "io-floor"
    if context.rank == 0:
        (work / "hf-files").mkdir()
        (work / "hf-files" / "config.json").write_text(
            json.dumps(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": args.hidden,
                    "intermediate_size": args.ffn,
                    "num_hidden_layers": args.layers,
                    "num_attention_heads": args.heads,
                    "num_key_value_heads": args.kv_heads,
                    "vocab_size": args.vocab,
                    "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-6,
                    "rope_theta": 10000.0,
                    "tie_word_embeddings": False,
                    "hidden_act": "silu",
                    "torch_dtype": DTYPE_NAMES[dtype],
                },
                indent=2,
            )
        )
        io_dir.mkdir()
    _, to_hf_s = timed(
        write_hf_folder,
        chunks,
        model,
        hf_dir,
        context,
        files=[work / "hf-files" / "config.json"],
        dtype=dtype,
    )
    del chunks, params
    shards = sorted(hf_dir.glob("*.safetensors"))
    hf_bytes = sum(path.stat().st_size for path in shards)

    def read_write() -> None:
        for path in shards[context.rank :: WORLD]:
            data = path.read_bytes()
            with open(io_dir / path.name, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())

    io_s = timed(read_write)[1]

    # hf_to_megatron, phase by phase
    hf, open_s = timed(HFCheckpoint.open, hf_dir, params_dtype=args.dtype)
    chunks, build2_s = timed(build_model, hf.model, context.config, context, initialize=False)
    load_s = timed(load_hf_weights, chunks, hf, context)[1]
    save_s = timed(
        save_megatron_checkpoint,
        chunks,
        hf.model,
        megatron_dir,
        hf_dtype=hf.dtype,
        hf_files=non_weight_files(hf_dir),
    )[1]
    hf.close()
    context.teardown()
    if context.rank == 0:
        Path(args.worker_out).write_text(
            json.dumps(
                {
                    "model_bytes": model_bytes,
                    "exported_bytes": exported_bytes,
                    "hf_bytes": hf_bytes,
                    "build_s": build_s,
                    "copy_s": min(copy_s),
                    "warm_copy_s": min(warm_s),
                    "export_s": min(export_s),
                    "export_all_s": export_s,
                    "reused_s": min(reused_s),
                    "reused_all_s": reused_s,
                    "to_hf_s": to_hf_s,
                    "io_s": io_s,
                    "open_s": open_s,
                    "build2_s": build2_s,
                    "load_s": load_s,
                    "save_s": save_s,
                }
            )
        )


# ------------------------------------------------------------------------ driver


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(args: argparse.Namespace) -> None:
    """The launched process: import the ranks' modules, then fork the ``WORLD`` ranks (this
    process holds no thread and no device yet, so each child starts clean). Exits 1 as soon as
    a rank fails, killing the others, so that none waits forever at a barrier."""
    for name in WORKER_MODULES:
        importlib.import_module(name)
    if threading.active_count() > 1:  # a thread would not be copied, nor the locks it holds
        raise RuntimeError(f"importing the ranks' modules started threads: {threading.enumerate()}")
    pids = [fork_rank(rank, args) for rank in range(WORLD)]
    while pids:
        pid, status = os.wait()
        pids.remove(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            for other in pids:
                os.kill(other, signal.SIGKILL)
                os.waitpid(other, 0)
            sys.exit(1)


def fork_rank(rank: int, args: argparse.Namespace) -> int:
    """Fork rank ``rank`` running :func:`worker`; its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
        worker(args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not the parent's exit handlers


def launch(argv: list[str], args: argparse.Namespace, work: Path) -> dict:
    out, log_path = work / "result.json", work / "ranks.log"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
        "WORLD_SIZE": str(WORLD),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONWARNINGS": "ignore",
    }
    with open(log_path, "wb") as log:
        # a session of its own: on timeout, the ranks it forked go too
        process = subprocess.Popen(
            [sys.executable, __file__, *argv, "--workdir", str(work), "--worker-out", str(out)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    if code != 0 or not out.exists():
        what = "timed out" if code is None else f"exit {code}"
        logs = log_path.read_text(errors="replace")[-8000:]
        raise RuntimeError(f"benchmark workers failed ({what}):\n{logs}")
    return json.loads(out.read_text())


def _significant(value: float) -> float:
    # Four significant digits, not fixed decimals: a tiny smoke-test model on a fast disk takes
    # milliseconds, which two decimals would report as zero.
    return float(f"{value:.4g}")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker_out:
        start_ranks(args)
        return
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        r = launch(argv, args, Path(tmp))
    gb = 1e9
    params = r["model_bytes"] // (2 if args.dtype == "bfloat16" else 4)
    copy, warm = r["model_bytes"] / r["copy_s"] / gb, r["model_bytes"] / r["warm_copy_s"] / gb
    export = r["exported_bytes"] / r["export_s"] / gb
    reused = r["exported_bytes"] / r["reused_s"] / gb
    print(
        f"model: {params / 1e9:.3f} B parameters, {r['model_bytes'] / gb:.2f} GB {args.dtype}, "
        f"TP{TP}/PP{PP}; build (random init) {r['build_s']:.1f} s"
    )
    print(f"copy        {copy:7.2f} GB/s   (clone of every rank's shards, min of {args.repeats})")
    print(f"warm copy   {warm:7.2f} GB/s   (into allocated tensors)")
    print(
        f"export      {export:7.2f} GB/s   ({r['exported_bytes'] / gb:.2f} GB in "
        f"{args.bucket_mib:g} MiB buckets; runs: "
        f"{', '.join(f'{s:.2f}' for s in r['export_all_s'])} s)"
    )
    print(
        f"export, kept buffer {reused:7.2f} GB/s   (one reused buffer; runs: "
        f"{', '.join(f'{s:.2f}' for s in r['reused_all_s'])} s; the first one allocates it)"
    )
    print(f"to HF       {r['to_hf_s']:7.2f} s      (export + safetensors shards)")
    print(f"read+write  {r['io_s']:7.2f} s      ({r['hf_bytes'] / gb:.2f} GB of HF shards, fsync)")
    to_megatron = r["open_s"] + r["build2_s"] + r["load_s"] + r["save_s"]
    print(
        f"to Megatron {to_megatron:7.2f} s      (open {r['open_s']:.2f} + build without init "
        f"{r['build2_s']:.2f} + read slices {r['load_s']:.2f} + torch_dist save "
        f"{r['save_s']:.2f})"
    )
    report = {
        "benchmark": "weights",
        "config": {
            k: v for k, v in vars(args).items() if k not in ("worker_out", "workdir", "timeout")
        },
        "parameters": params,
        "model_bytes": r["model_bytes"],
        "copy_gbps": _significant(copy),
        "warm_copy_gbps": _significant(warm),
        "export_gbps": _significant(export),
        "export_over_copy": _significant(export / copy),
        "export_over_warm_copy": _significant(export / warm),
        "export_kept_buffer_gbps": _significant(reused),
        "export_kept_buffer_over_copy": _significant(reused / copy),
        "export_kept_buffer_over_warm_copy": _significant(reused / warm),
        "to_hf_s": _significant(r["to_hf_s"]),
        "read_write_s": _significant(r["io_s"]),
        "hf_to_megatron_s": _significant(to_megatron),
        "hf_to_megatron_phases_s": {
            "open_and_validate": _significant(r["open_s"]),
            "build_without_init": _significant(r["build2_s"]),
            "read_slices": _significant(r["load_s"]),
            "torch_dist_save": _significant(r["save_s"]),
        },
        "hf_to_megatron_over_read_write": _significant(to_megatron / r["io_s"]),
        "targets": {
            "export_over_copy_at_least_0_5": export / copy >= 0.5,
            "export_kept_buffer_over_warm_copy_at_least_0_5": reused / warm >= 0.5,
        },
    }
    print(json.dumps(report))


if __name__ == "__main__":
    from bapo_megatron.process.end import skip_final_collection
    from bapo_megatron.process.start import prepare_process

    prepare_process()
    main(sys.argv[1:])
    skip_final_collection()

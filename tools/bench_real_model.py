"""Benchmark a real model's RL step on the CPU: this trainer against TRL's GRPOTrainer.

Both sides run the same work, one after the other, from the same HF folder and prompt file:
``--prompts-per-step`` prompts x ``--samples`` samples, ``--max-new-tokens`` new tokens at
temperature 0.7, one optimizer step per rollout step, a fixed clip [0.8, 1.2], no KL, in
float32 or (``--dtype bfloat16``) bfloat16 mixed precision. This trainer runs
``python -m bapo_megatron.train`` (``--bapo-python``: the vLLM tier's environment for
``--engine vllm``), TRL runs ``tools/real_model_bench/trl_side.py`` in its own environment
(``--trl-python``; ``tools/real_model_bench/requirements-trl.txt``). Each side's peak resident
memory is the largest sum over its process tree (the root's resident memory and its children's
unique memory), sampled every 0.2 s.

The benchmark also measures the machine's matmul rate at the model's shapes (the step's tokens
times each linear layer, in the run's dtype) and reports the training phase's share of it: the
phase's matmul FLOPs (6 x parameters x tokens for the 30 layers; the output layer at the
positions that predict a response token only, as the actor computes it) over its seconds.

Steady figures are medians over the steps after ``--warmup``. The last line printed is one JSON
object: both sides' steady step, phases and peak memory, the ratios this/TRL, and the share.

Usage: python3 tools/bench_real_model.py --model DIR --prompts train.jsonl \\
           --bapo-python ~/.cache/bapo-megatron/vllm-venv/bin/python --engine vllm \\
           --trl-python ~/.cache/bapo-megatron/trl-venv/bin/python [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
TRL_SIDE = REPO / "tools" / "real_model_bench" / "trl_side.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF folder")
    parser.add_argument("--prompts", required=True, help="JSONL prompt file (chat messages)")
    parser.add_argument("--steps", type=int, default=8, help="rollout steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--engine", choices=("vllm", "embedded"), default="vllm")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="vLLM compiles its model (rollout.engine_eager=false): minutes more to start, "
        "faster steps",
    )
    parser.add_argument("--bapo-python", default=sys.executable, help="python of this trainer")
    parser.add_argument("--trl-python", help="python of TRL's environment (none: TRL skipped)")
    parser.add_argument("--out", help="folder for both runs (default: a temporary one)")
    return parser.parse_args(argv)


class PeakTreeMemory:
    """The largest summed resident memory of a process and its descendants, polled."""

    def __init__(self, pid: int) -> None:
        self.peak = 0
        self._root = psutil.Process(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(0.2):
            try:
                tree = [self._root, *self._root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for process in tree:  # a child's pages shared with its parent count once
                try:
                    # the root's smaps would cost the run itself: its plain resident size
                    if process is self._root:
                        total += process.memory_info().rss
                    else:
                        total += process.memory_full_info().uss
                except psutil.NoSuchProcess:
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.peak / 2**30


def run_side(command: list[str], log: Path, env: dict[str, str]) -> float:
    """Run ``command`` to its end (its output into ``log``); its peak tree memory in GiB."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        memory = PeakTreeMemory(process.pid)
        code = process.wait()
    peak = memory.stop()
    if code != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{command[0]} ... exited with {code}; the end of {log}:\n{tail}")
    return peak


def trainer_config(args: argparse.Namespace, out: Path) -> str:
    rollout = {
        "engine": args.engine,
        "prompts_per_step": args.prompts_per_step,
        "samples_per_prompt": args.samples,
        "max_new_tokens": args.max_new_tokens,
    }
    if args.engine == "vllm":
        rollout["engine_eager"] = not args.compiled
    config = {
        "train": {
            "model_path": args.model,
            "output_dir": str(out),
            "params_dtype": args.dtype,
            "steps": args.steps,
            "seed": 0,
        },
        "data": {"train_file": args.prompts},
        "reward": {"name": "final_number", "workers": 1},
        "rollout": rollout,
        "loss": {"aggregation": "token-mean", "clip": {"preset": "grpo"}},
        "actor": {"temperature": 0.7, "pack_sequences": True, "max_tokens_per_microbatch": 4096},
        "optimizer": {"lr": 5e-6, "weight_decay": 0.0, "clip_grad": 1.0},
        "algorithm": {"optimizer_steps_per_rollout": 1},
        "checkpoint": {"interval": 0},
        "logging": {"tensorboard": True, "console": True},
    }
    return json.dumps(config)  # YAML reads JSON


def steady(values: list[float], warmup: int) -> float:
    kept = values[warmup:] or values
    return statistics.median(kept)


def matmul_rate(shapes: list[tuple[int, int]], tokens: int, dtype: str) -> float:
    """GFLOP/s of ``[tokens, k] @ [k, n]`` over the layer shapes, best of 3 rounds."""
    import torch

    torch_dtype = getattr(torch, dtype)
    best = 0.0
    pairs = [
        (torch.randn(tokens, k, dtype=torch_dtype), torch.randn(k, n, dtype=torch_dtype))
        for k, n in shapes
    ]
    for _ in range(3):
        start = time.perf_counter()
        for a, b in pairs:
            a @ b
        seconds = time.perf_counter() - start
        best = max(best, sum(2 * tokens * k * n for k, n in shapes) / seconds / 1e9)
    return best


def model_shapes(model: Path) -> tuple[list[tuple[int, int]], int, int]:
    """The linear layers' (in, out) of one transformer layer, the layer count and the output
    layer's (in, out) flattened as hidden x vocabulary."""
    config = json.loads((model / "config.json").read_text())
    h, f = config["hidden_size"], config["intermediate_size"]
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    layer = [(h, heads * d + 2 * groups * d), (heads * d, h), (h, 2 * f), (f, h)]
    return layer, config["num_hidden_layers"], config["vocab_size"]


def prompt_lengths(model: Path, prompts: Path) -> float:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    texts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for row in rows
    ]
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    return statistics.mean(lengths)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, prompts = Path(args.model), Path(args.prompts)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-real-model-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONPATH": str(REPO)}

    config = out / "bapo.yaml"
    config.write_text(trainer_config(args, out / "bapo"))
    print(f"this trainer ({args.engine}, {args.dtype}): {args.steps} steps ...", flush=True)
    bapo_peak = run_side(
        [args.bapo_python, "-m", "bapo_megatron.train", "--config", str(config)],
        out / "bapo.log",
        env,
    )
    lines = (out / "bapo" / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    # one record per rollout step (the optimizer steps' records carry no time/step)
    records = [r for r in map(json.loads, lines) if "time/step" in r]
    phases = ("step", "rollout", "train", "old_logprobs", "weight_sync", "reward")
    bapo = {
        f"steady_{p}_s": steady([r.get(f"time/{p}", 0.0) for r in records], args.warmup)
        for p in phases
    }
    generated = steady([r["rollout/generated_tokens"] for r in records], args.warmup)
    bapo["peak_rss_gib"] = bapo_peak

    # the training phase's matmul FLOPs and the machine's rate at the same shapes
    layer, layers, vocab = model_shapes(model)
    samples = args.prompts_per_step * args.samples
    tokens = round(samples * prompt_lengths(model, prompts) + generated)
    hidden = layer[0][0]
    train_flops = 6 * (layers * sum(k * n for k, n in layer) * tokens + hidden * vocab * generated)
    rate = matmul_rate([*layer, (hidden, vocab)], tokens, args.dtype)
    share = train_flops / bapo["steady_train_s"] / 1e9 / rate

    trl = None
    if args.trl_python:
        print(f"TRL GRPOTrainer ({args.dtype}): {args.steps} steps ...", flush=True)
        command = [
            args.trl_python,
            str(TRL_SIDE),
            "--model",
            str(model),
            "--prompts",
            str(prompts),
            "--steps",
            str(args.steps),
            "--out",
            str(out / "trl"),
            "--prompts-per-step",
            str(args.prompts_per_step),
            "--num-generations",
            str(args.samples),
            "--max-completion-length",
            str(args.max_new_tokens),
        ]
        if args.dtype == "bfloat16":
            command.append("--bf16")
        trl_peak = run_side(command, out / "trl.log", env)
        trl = json.loads((out / "trl.log").read_text().strip().splitlines()[-1])
        trl["peak_tree_rss_gib"] = trl_peak

    result = {
        "dtype": args.dtype,
        "engine": args.engine,
        "compiled": args.compiled,
        "steps": args.steps,
        "bapo": bapo,
        "tokens_per_step": tokens,
        "matmul_gflops": rate,
        "train_share_of_matmul_rate": share,
    }
    if trl is not None:
        result["trl"] = {k: trl[k] for k in trl if k != "steps"}
        result["step_ratio"] = bapo["steady_step_s"] / trl["steady_step_s"]
        result["memory_ratio"] = bapo_peak / trl["peak_tree_rss_gib"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()

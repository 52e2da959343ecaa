"""The device check: everything of this project that a single GPU can run, in one command that
fits a lent GPU's minutes, and the same command on the CPU (tiny sizes, under a minute) so that
it cannot rot between GPU runs. Each check runs in a process of its own with a deadline; a check
that fails or overruns is recorded with its error and the others still run. Writes
``device_check.json`` (every figure) and ``device_check.md`` (a summary) into ``--out``.

    python -m bapo_megatron.device_check.run --device cuda --out $OUT
    python -m bapo_megatron.device_check.run --device cpu --out /tmp/check   # CI-sized

What one GPU cannot run (NCCL groups across ranks, TP/PP on CUDA, the NCCL weight broadcast)
and what cannot be carried to the lent machine (Transformer Engine, FP8, vLLM, SGLang) is listed
in the report as not run, with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import megatron.core
import torch
import transformers

from bapo_megatron.device_check import loop_runs
from bapo_megatron.device_check.compare import compare_actor_runs, summary_markdown
from bapo_megatron.device_check.shapes import model_config, write_start_folder

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL_VARIANTS = "paper/step,paper/microbatch,reference/step,reference/microbatch"
NOT_RUN = {
    "multi-GPU NCCL (TP/PP/DP on CUDA, NCCL weight broadcast)": "the lent machine has one GPU; "
    "NCCL refuses two ranks on one device",
    "Transformer Engine layers and FP8": "Transformer Engine (171 MiB wheel plus a source-only "
    "extension) cannot be carried to the lent machine",
    "vLLM and SGLang on a GPU": "their wheels (311 MiB, > 900 MiB) cannot be carried",
    "Transformer Engine's fused attention": "it comes with Transformer Engine; the local layer "
    "spec's attention (torch SDPA) ran instead",
}


class Checks:
    """Runs the check processes of one invocation and collects their results."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.gpu = args.device == "cuda"
        self.results: dict[str, dict] = {}
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )}
        if not self.gpu:
            self.env.setdefault("OMP_NUM_THREADS", "1")

    def python(self, module: str, *argv: str, timeout: float, env: dict | None = None) -> dict:
        """Run ``python -m module argv --json FILE`` and return the JSON it wrote."""
        out = self.work / f"{module.rsplit('.', 1)[-1]}-{time.monotonic_ns()}.json"
        proc = subprocess.run(
            [sys.executable, "-m", module, *argv, "--json", str(out)],
            env=env or self.env, cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=timeout, check=False,
        )
        if proc.returncode or not out.exists():
            raise RuntimeError(f"{module} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())

    def record(self, name: str, check, *args) -> None:
        began = time.monotonic()
        try:
            result = check(*args)
        except subprocess.TimeoutExpired as error:
            result = {"status": "timed out", "error": f"no result within {error.timeout:.0f} s"}
        except Exception as error:  # noqa: BLE001 - recorded, the other checks go on
            result = {"status": "error", "error": f"{type(error).__name__}: {error}"[-4000:]}
        result["seconds"] = round(time.monotonic() - began, 1)
        self.results[name] = result
        print(f"[device check] {name}: {result['status']} ({result['seconds']} s)", flush=True)


def actor_comparison(checks: Checks, size: str, variants: str, steps: int, cpu_variants: str,
                     cpu_steps: int, sequences: int, length: int) -> dict:
    """``size`` trained on the device (bf16 on a GPU) against the same steps in float32 on the
    CPU, from one HF folder of bf16 weights."""
    a = checks.args
    start = write_start_folder(model_config(size, cpu_sized=not checks.gpu),
                               checks.work / f"start-{size}", seed=0)
    common = ["--start", str(start), "--sequences", str(sequences), "--length", str(length),
              "--micro-batch-size", str(min(4, sequences))]
    reference_env = {**checks.env, "CUDA_VISIBLE_DEVICES": "", "BAPO_DEVICE": "cpu"}
    if a.reference_pythonpath is not None:
        reference_env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [a.reference_pythonpath])])
    reference = BackgroundActorRun(checks, reference_env, [
        "--device", "cpu", "--dtype", "float32", "--variants", cpu_variants,
        "--steps", str(cpu_steps), "--threads", str(a.cpu_threads if checks.gpu else 1), *common,
    ])
    dtype = "bfloat16" if checks.gpu else "float32"
    device_run = checks.python(
        "bapo_megatron.device_check.actor_steps", "--device", a.device, "--dtype", dtype,
        "--variants", variants, "--steps", str(steps), *common, timeout=a.check_timeout,
    )
    return compare_actor_runs(device_run, reference.result(a.check_timeout), bf16=checks.gpu)


class BackgroundActorRun:
    """An actor_steps process started now (the CPU reference runs while the GPU works)."""

    def __init__(self, checks: Checks, env: dict, argv: list[str]) -> None:
        fd, name = tempfile.mkstemp(suffix=".json", dir=checks.work)
        os.close(fd)
        os.unlink(name)
        self.out = Path(name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bapo_megatron.device_check.actor_steps", *argv,
             "--json", name], env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )

    def result(self, timeout: float) -> dict:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        if self.proc.returncode or not self.out.exists():
            raise RuntimeError(f"CPU reference exited with {self.proc.returncode}:\n{err[-3000:]}")
        return json.loads(self.out.read_text())


def same_run_twice(checks: Checks, argv: list[str]) -> dict:
    """Two processes with the same seeds in deterministic mode: bitwise equal parameters?"""
    runs = [checks.python("bapo_megatron.device_check.actor_steps", *argv, "--deterministic",
                          timeout=checks.args.check_timeout) for _ in range(2)]
    digests = [[v["parameters_sha256"] for v in r["variants"]] for r in runs]
    losses = [[[s["loss"] for s in v["steps"]] for v in r["variants"]] for r in runs]
    same = digests[0] == digests[1] and losses[0] == losses[1]
    return {"status": "passed" if same else "failed", "parameters_bitwise_equal": same,
            "losses": losses[0]}


def distributed_optimizer(checks: Checks, argv: list[str]) -> dict:
    plain, sharded = (
        checks.python("bapo_megatron.device_check.actor_steps", *argv, *extra,
                      timeout=checks.args.check_timeout)
        for extra in ([], ["--distributed-optimizer"])
    )
    a = [s["loss"] for s in plain["variants"][0]["steps"]]
    b = [s["loss"] for s in sharded["variants"][0]["steps"]]
    worst = max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(a, b))
    return {"status": "passed" if worst <= 1e-3 else "failed", "losses_plain": a,
            "losses_distributed_optimizer": b, "max_relative_difference": worst,
            "tolerance": "1e-3 relative (one data-parallel rank: the same updates, other order)"}


MEMORY_MODELS = {
    "qwen3-8b-4l": "Qwen3-8B layer shapes, 4 layers",
    "qwen3-30b-a3b-2l": "Qwen3-30B-A3B layer shapes, 2 layers of 128 experts (top-8), all on "
    "the one device",
}


def memory(checks: Checks, size: str = "qwen3-8b-4l") -> dict:
    argv = ["--device", checks.args.device, "--size", size, "--variants", "paper/step",
            "--steps", "2", "--distributed-optimizer", "--memory", "--micro-batch-size", "2",
            "--dtype", "bfloat16" if checks.gpu else "float32"]
    argv += ["--sequences", "4", "--length", "1024"] if checks.gpu else ["--cpu-sized",
                                                                         "--sequences", "2",
                                                                         "--length", "32"]
    run = checks.python("bapo_megatron.device_check.actor_steps", *argv,
                        timeout=checks.args.check_timeout)
    variant = run["variants"][0]
    if "memory" not in variant:
        return {"status": "not run", "why": "memory is measured with torch.cuda only"}
    return {"status": "passed", "model": f"{MEMORY_MODELS[size]}, bf16, distributed optimizer, "
            "SDPA attention", **variant["memory"]}


def loss_bench(checks: Checks) -> dict:
    sizes = "1M,8M" if checks.gpu else "64K"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "bench_bapo_loss.py"), "--sizes", sizes,
         "--repeats", "5" if checks.gpu else "2", "--device", checks.args.device],
        env=checks.env, cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=checks.args.check_timeout, check=False,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"status": "passed", **report}


def model_check(checks: Checks, name: str, *argv: str) -> dict:
    return checks.python("bapo_megatron.device_check.model_checks", name, "--device",
                         checks.args.device, *argv, timeout=checks.args.check_timeout)


def loop(checks: Checks, small: bool) -> dict:
    a = checks.args
    fast = [] if checks.gpu else ["warmup.steps=20", "rollout.prompts_per_step=4",
                                  "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16",
                                  "actor.micro_batch_size=16", "warmup.batch_size=16",
                                  "data.synthetic_size=200"]
    # bf16 with the distributed optimizer, as the GPU recipes run
    dtype = ["model.params_dtype=bfloat16", "optimizer.use_distributed_optimizer=true"] if \
        checks.gpu else []
    if small:
        overrides = [*fast, *dtype, *(loop_runs.SMALL_MODEL if checks.gpu else ()),
                     "warmup.steps=10", "train.steps=3", "checkpoint.interval=3",
                     "actor.micro_batch_size=32"]
    else:
        overrides = [*fast, *dtype, f"train.steps={20 if checks.gpu else 4}",
                     "checkpoint.interval=10"]
    folder = checks.work / ("loop-small" if small else "loop-tiny")
    folder.mkdir()
    return loop_runs.loop_check(folder, a.device, overrides, checks.env, a.check_timeout)


def loop_moe(checks: Checks) -> dict:
    """The tiny Qwen3-MoE example (routing replay R3) through the loop on the device."""
    fast = [] if checks.gpu else ["warmup.steps=20", "rollout.prompts_per_step=4",
                                  "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16",
                                  "actor.micro_batch_size=16", "warmup.batch_size=16",
                                  "data.synthetic_size=200"]
    # bf16 with the distributed optimizer on the GPU: expert parameters in its buffers too
    dtype = ["model.params_dtype=bfloat16", "optimizer.use_distributed_optimizer=true"] if \
        checks.gpu else []
    config = REPO_ROOT / "examples" / "tiny_cpu_moe" / "train.yaml"
    overrides = [f"--config={config}", *fast, *dtype, f"train.steps={10 if checks.gpu else 3}",
                 "checkpoint.interval=0"]
    folder = checks.work / "loop-moe"
    folder.mkdir()
    result = loop_runs.loop_check(folder, checks.args.device, overrides, checks.env,
                                  checks.args.check_timeout)
    result["status"] = "passed" if result["rollout_steps"] else "failed"  # no checkpoints asked
    return result


def resume(checks: Checks) -> dict:
    fast = ["warmup.steps=20", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=16", "actor.micro_batch_size=16", "warmup.batch_size=16",
            "data.synthetic_size=200", "train.steps=6", "checkpoint.interval=2"]
    dtype = ["model.params_dtype=bfloat16", "optimizer.use_distributed_optimizer=true"] if \
        checks.gpu else []
    folder = checks.work / "resume"
    folder.mkdir()
    return loop_runs.resume_check(folder, checks.args.device, [*fast, *dtype], checks.env,
                                  kill_step=2, timeout=checks.args.check_timeout)


def speed(checks: Checks) -> dict:
    """Actor train-step tokens/s against transformers' model with SDPA, same loss and batch."""
    size = "small"
    start = write_start_folder(model_config(size, cpu_sized=not checks.gpu),
                               checks.work / f"start-{size}", seed=0)
    dtype = "bfloat16" if checks.gpu else "float32"
    length = 1024 if checks.gpu else 32
    common = ["--start", str(start), "--sequences", "16" if checks.gpu else "4", "--length",
              str(length), "--micro-batch-size", "4", "--dtype", dtype, "--steps", "4"]
    ours = checks.python("bapo_megatron.device_check.actor_steps", "--device",
                         checks.args.device, "--variants",
                         "paper/microbatch,paper/step,grpo/microbatch", *common,
                         timeout=checks.args.check_timeout)
    theirs = model_check(checks, "hf-speed", *common)
    fastest = {v["variant"]: min(v["step_seconds"][1:]) for v in ours["variants"]}
    tokens_per_s = ours["tokens_per_step"] / fastest["paper/microbatch"]
    model = ours["model"]
    flops_per_token = 6 * dense_parameters(model) + 6 * model["num_layers"] * model[
        "hidden_size"] * length  # attention scores and values, forward + backward
    peak = 989e12 if checks.gpu else None  # H100/H200 SXM dense bf16
    return {
        "status": "passed",
        "actor_tokens_per_s": tokens_per_s,
        "transformers_sdpa_tokens_per_s": theirs["tokens_per_s"],
        "actor_over_transformers": tokens_per_s / theirs["tokens_per_s"],
        "step_seconds": fastest,
        # what BAPO's search (and, at granularity step, its extra forward) adds to a fixed clip
        "paper_microbatch_over_fixed_clip": fastest["paper/microbatch"]
        / fastest["grpo/microbatch"],
        "paper_step_over_fixed_clip": fastest["paper/step"] / fastest["grpo/microbatch"],
        "model_flops_per_token": flops_per_token,
        "actor_mfu": tokens_per_s * flops_per_token / peak if peak else None,
        "mfu_peak_flops": peak,
    }


def dense_parameters(model: dict) -> int:
    """Matrix parameters a token's forward multiplies by (embedding lookup excluded, output
    layer included)."""
    h, f, layers = model["hidden_size"], model["ffn_hidden_size"], model["num_layers"]
    d = model.get("head_dim") or h // model["num_attention_heads"]
    q, kv = model["num_attention_heads"] * d, model["num_query_groups"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    return layers * per_layer + h * model["vocab_size"]


def run_all(args: argparse.Namespace, work: Path) -> dict:
    checks = Checks(args, work)
    gpu = checks.gpu
    only = set(args.only.split(",")) if args.only else None

    def want(name: str) -> bool:
        return only is None or name in only

    if want("actor_tiny"):
        # CPU-sized: one variant per preset and granularity is enough to keep the path alive
        variants = ALL_VARIANTS if gpu else "paper/step,reference/microbatch"
        checks.record("actor_tiny", actor_comparison, checks, "tiny", variants, 3 if gpu else 2,
                      variants, 3 if gpu else 2, 8, 128 if gpu else 32)
    if want("actor_moe"):
        variants = "paper/step,paper/microbatch" if gpu else "paper/step"
        checks.record("actor_moe", actor_comparison, checks, "tiny-moe", variants,
                      3 if gpu else 2, variants, 3 if gpu else 2, 8, 128 if gpu else 32)
    if want("actor_small"):
        checks.record("actor_small", actor_comparison, checks, "small",
                      ALL_VARIANTS, 3, "paper/step", 1, 8, 256 if gpu else 32)
    tiny_argv = ["--device", args.device, "--size", "tiny", "--variants", "paper/step",
                 "--steps", "3", "--dtype", "bfloat16" if gpu else "float32"]
    if want("distributed_optimizer"):
        checks.record("distributed_optimizer", distributed_optimizer, checks, tiny_argv)
    if want("deterministic"):
        size = ["--size", "small"] + ([] if gpu else ["--cpu-sized"])
        checks.record("deterministic", same_run_twice, checks, [*tiny_argv[:2], *size,
                      *tiny_argv[4:], "--length", "256" if gpu else "32"])
    if want("memory"):
        checks.record("memory", memory, checks)
    if want("memory_moe"):
        checks.record("memory_moe", memory, checks, "qwen3-30b-a3b-2l")
    if want("loss_bench"):
        checks.record("loss_bench", loss_bench, checks)
    if want("engine"):
        engine_argv = ["--dtype", "bfloat16"] if gpu else ["--cpu-sized", "--prompts", "4",
                                                           "--max-new-tokens", "8"]
        checks.record("engine", model_check, checks, "engine", *engine_argv)
    if want("conversion"):
        (work / "conversion").mkdir()
        checks.record("conversion", model_check, checks, "conversion", "--work",
                      str(work / "conversion"))
    if want("speed"):
        checks.record("speed", speed, checks)
    if want("loop_tiny"):
        checks.record("loop_tiny", loop, checks, False)
    if want("resume"):
        checks.record("resume", resume, checks)
    if want("loop_small"):
        checks.record("loop_small", loop, checks, True)
    if want("loop_moe"):
        checks.record("loop_moe", loop_moe, checks)
    return checks.results


def environment(device: str) -> dict:

    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
            text=True, check=False,
        ).stdout.strip() or None
    except OSError:
        info["commit"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--out", required=True, help="folder for device_check.json/.md")
    parser.add_argument("--only", help="comma list of check names (default: all)")
    parser.add_argument("--check-timeout", type=float, default=300.0, help="seconds per check")
    parser.add_argument("--cpu-threads", type=int, default=8, help="of the CPU reference runs")
    parser.add_argument("--label", default="", help="a name for this run in the report")
    parser.add_argument(
        "--reference-pythonpath", default=None,
        help="PYTHONPATH of the CPU reference runs (default: this process's); the pass against "
        "a newer megatron-core keeps its CPU references on the pinned one, which the CPU "
        "patches need")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="device-check-") as work:
        results = run_all(args, Path(work))
    report = {
        "label": args.label,
        "environment": environment(args.device),
        "wall_s": round(time.monotonic() - began, 1),
        "checks": results,
        "not_run": NOT_RUN,
    }
    stem = f"device_check{'-' + args.label if args.label else ''}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(summary_markdown(report))
    print(json.dumps({name: r["status"] for name, r in results.items()}))
    return 0 if all(r["status"] in ("passed", "not run") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

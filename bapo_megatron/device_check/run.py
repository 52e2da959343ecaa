"""The device check: everything of this project that a single GPU can run, in one command that
fits a lent GPU's minutes, and the same command on the CPU (tiny sizes, under a minute) so that
it cannot rot between GPU runs. Each check runs in a process of its own with a deadline; a check
that fails or overruns is recorded with its error and the others still run. Writes
``device_check[-LABEL].json`` (every figure) and ``.md`` (a summary) into ``--out``.

    python -m bapo_megatron.device_check.run --device cuda --out $OUT
    python -m bapo_megatron.device_check.run --device cpu --out /tmp/check   # CI-sized
    python -m bapo_megatron.device_check.run --device cuda --out $OUT --spec te   # TE pass
    python -m bapo_megatron.device_check.run --device cuda --out $OUT --only vllm # vLLM pass

The Transformer Engine and vLLM passes need packages the GPU image lacks
(:mod:`bapo_megatron.device_check.passes`); without them they are refused, with a report that
says why, and exit status 2. What a run did not cover is listed in its report with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
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

from bapo_megatron.device_check import loop_runs, passes
from bapo_megatron.device_check.compare import compare_actor_runs, summary_markdown
from bapo_megatron.device_check.measurements import (
    loss_bench,
    memory,
    model_check,
    packing,
    packing_bench,
    speed,
)
from bapo_megatron.device_check.shapes import model_config
from bapo_megatron.device_check.start_folder import write_start_folder

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL_VARIANTS = "paper/step,paper/microbatch,reference/step,reference/microbatch"
FP8_RECIPES = ("delayed", "tensorwise", "blockwise")
"""The FP8 recipes a Hopper GPU runs (``mxfp8`` is Blackwell's)."""


CPU_LOOP_OVERRIDES = [
    "warmup.steps=20",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=16",
    "actor.micro_batch_size=16",
    "warmup.batch_size=16",
    "data.synthetic_size=200",
]
"""The loop checks' sizes on the CPU, where the full tiny run would take minutes."""


class Checks:
    """Runs the check processes of one invocation and collects their results."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.gpu = args.device == "cuda"
        self.results: dict[str, dict] = {}
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        if not self.gpu:
            self.env.setdefault("OMP_NUM_THREADS", "1")

    def python(self, module: str, *argv: str, timeout: float, env: dict | None = None) -> dict:
        """Run ``python -m module argv --json FILE`` and return the JSON it wrote."""
        out = self.work / f"{module.rsplit('.', 1)[-1]}-{time.monotonic_ns()}.json"
        proc = subprocess.run(
            [sys.executable, "-m", module, *argv, "--json", str(out)],
            env=env or self.env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
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


def actor_comparison(
    checks: Checks,
    size: str,
    variants: str,
    steps: int,
    cpu_variants: str,
    cpu_steps: int,
    sequences: int,
    length: int,
    fp8_recipes: tuple[str, ...] = (),
) -> dict:
    """``size`` trained on the device (bf16 on a GPU) against the same steps in float32 on the
    CPU, from one HF folder of bf16 weights. With ``fp8_recipes``, one device run per recipe
    in FP8 (`hybrid`) against the one reference instead. In the TE pass the device runs must
    have been built from Transformer Engine's layers."""
    a = checks.args
    start = write_start_folder(
        model_config(size, cpu_sized=not checks.gpu), checks.work / f"start-{size}", seed=0
    )
    common = [
        "--start",
        str(start),
        "--sequences",
        str(sequences),
        "--length",
        str(length),
        "--micro-batch-size",
        str(min(4, sequences)),
    ]
    reference_env = {**checks.env, "CUDA_VISIBLE_DEVICES": "", "BAPO_DEVICE": "cpu"}
    if a.reference_pythonpath is not None:
        reference_env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [a.reference_pythonpath])]
        )
    reference = BackgroundActorRun(
        checks,
        reference_env,
        [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--variants",
            cpu_variants,
            "--steps",
            str(cpu_steps),
            "--threads",
            str(a.cpu_threads if checks.gpu else 1),
            *common,
        ],
    )
    dtype = "bfloat16" if checks.gpu else "float32"
    device_argv = [
        "--device",
        a.device,
        "--dtype",
        dtype,
        "--variants",
        variants,
        "--steps",
        str(steps),
        *common,
    ]
    if not fp8_recipes:
        device_run = checks.python(
            "bapo_megatron.device_check.actor_steps", *device_argv, timeout=a.check_timeout
        )
        return _judged(checks, device_run, reference.result(a.check_timeout), fp8=False)
    runs = {}
    for recipe in fp8_recipes:
        try:
            runs[recipe] = checks.python(
                "bapo_megatron.device_check.actor_steps",
                *device_argv,
                "--fp8",
                "hybrid",
                "--fp8-recipe",
                recipe,
                timeout=a.check_timeout,
            )
        except Exception as error:  # noqa: BLE001 - recorded, the other recipes go on
            runs[recipe] = {"status": "error", "error": f"{type(error).__name__}: {error}"[-4000:]}
    cpu = reference.result(a.check_timeout)
    recipes = {
        r: run if "error" in run else _judged(checks, run, cpu, fp8=True) for r, run in runs.items()
    }
    passed = all(r["status"] == "passed" for r in recipes.values())
    return {"status": "passed" if passed else "failed", "format": "hybrid", "recipes": recipes}


def _judged(checks: Checks, device_run: dict, reference: dict, *, fp8: bool) -> dict:
    result = compare_actor_runs(device_run, reference, bf16=checks.gpu, fp8=fp8)
    result["layer_spec"] = device_run.get("layer_spec")
    if checks.args.spec == "te" and result["layer_spec"] != "te":
        result.update(
            status="failed",
            error="--spec te, but the actor was built from the "
            f"{result['layer_spec']!r} layer spec, not Transformer Engine's",
        )
    return result


class BackgroundActorRun:
    """An actor_steps process started now (the CPU reference runs while the GPU works)."""

    def __init__(self, checks: Checks, env: dict, argv: list[str]) -> None:
        fd, name = tempfile.mkstemp(suffix=".json", dir=checks.work)
        os.close(fd)
        os.unlink(name)
        self.out = Path(name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bapo_megatron.device_check.actor_steps", *argv, "--json", name],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
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
    runs = [
        checks.python(
            "bapo_megatron.device_check.actor_steps",
            *argv,
            "--deterministic",
            timeout=checks.args.check_timeout,
        )
        for _ in range(2)
    ]
    digests = [[v["parameters_sha256"] for v in r["variants"]] for r in runs]
    losses = [[[s["loss"] for s in v["steps"]] for v in r["variants"]] for r in runs]
    same = digests[0] == digests[1] and losses[0] == losses[1]
    return {
        "status": "passed" if same else "failed",
        "parameters_bitwise_equal": same,
        "losses": losses[0],
    }


def distributed_optimizer(checks: Checks, argv: list[str]) -> dict:
    plain, sharded = (
        checks.python(
            "bapo_megatron.device_check.actor_steps",
            *argv,
            *extra,
            timeout=checks.args.check_timeout,
        )
        for extra in ([], ["--distributed-optimizer"])
    )
    a = [s["loss"] for s in plain["variants"][0]["steps"]]
    b = [s["loss"] for s in sharded["variants"][0]["steps"]]
    worst = max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(a, b))
    return {
        "status": "passed" if worst <= 1e-3 else "failed",
        "losses_plain": a,
        "losses_distributed_optimizer": b,
        "max_relative_difference": worst,
        "tolerance": "1e-3 relative (one data-parallel rank: the same updates, other order)",
    }


def loop(checks: Checks, small: bool) -> dict:
    a = checks.args
    fast = [] if checks.gpu else CPU_LOOP_OVERRIDES
    # bf16 with the distributed optimizer, as the GPU recipes run
    dtype = (
        ["model.params_dtype=bfloat16", "optimizer.use_distributed_optimizer=true"]
        if checks.gpu
        else []
    )
    if small:
        overrides = [
            *fast,
            *dtype,
            *(loop_runs.SMALL_MODEL if checks.gpu else ()),
            "warmup.steps=10",
            "train.steps=3",
            "checkpoint.interval=3",
            "actor.micro_batch_size=32",
        ]
    else:
        overrides = [
            *fast,
            *dtype,
            f"train.steps={20 if checks.gpu else 4}",
            "checkpoint.interval=10",
        ]
    folder = checks.work / ("loop-small" if small else "loop-tiny")
    folder.mkdir()
    return loop_runs.loop_check(folder, a.device, overrides, checks.env, a.check_timeout)


def loop_moe(checks: Checks) -> dict:
    """The tiny Qwen3-MoE example (routing replay R3) through the loop on the device."""
    fast = [] if checks.gpu else CPU_LOOP_OVERRIDES
    # bf16 with the distributed optimizer on the GPU: expert parameters in its buffers too
    dtype = (
        ["model.params_dtype=bfloat16", "optimizer.use_distributed_optimizer=true"]
        if checks.gpu
        else []
    )
    config = REPO_ROOT / "examples" / "tiny_cpu_moe" / "train.yaml"
    overrides = [
        f"--config={config}",
        *fast,
        *dtype,
        f"train.steps={10 if checks.gpu else 3}",
        "checkpoint.interval=0",
    ]
    folder = checks.work / "loop-moe"
    folder.mkdir()
    result = loop_runs.loop_check(
        folder, checks.args.device, overrides, checks.env, checks.args.check_timeout
    )
    result["status"] = "passed" if result["rollout_steps"] else "failed"  # no checkpoints asked
    return result


def resume(checks: Checks) -> dict:
    fast = [
        "warmup.steps=20",
        "rollout.prompts_per_step=8",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=16",
        "actor.micro_batch_size=16",
        "warmup.batch_size=16",
        "data.synthetic_size=200",
        "train.steps=6",
        "checkpoint.interval=2",
    ]
    dtype = (
        ["model.params_dtype=bfloat16", "optimizer.use_distributed_optimizer=true"]
        if checks.gpu
        else []
    )
    folder = checks.work / "resume"
    folder.mkdir()
    return loop_runs.resume_check(
        folder,
        checks.args.device,
        [*fast, *dtype],
        checks.env,
        kill_step=2,
        timeout=checks.args.check_timeout,
    )


def conversion(checks: Checks) -> dict:
    """HF -> Megatron -> HF on the device (:mod:`~bapo_megatron.device_check.model_checks`); in
    the TE pass, through TE's layers and their fused norm names."""
    (checks.work / "conversion").mkdir()
    result = model_check(checks, "conversion", "--work", str(checks.work / "conversion"))
    if checks.args.spec == "te" and result.get("layer_spec") != "te":
        result.update(
            status="failed",
            error="--spec te, but the converted model was built from "
            f"the {result.get('layer_spec')!r} layer spec, not Transformer Engine's",
        )
    return result


def vllm_engine(checks: Checks, quantization: str | None) -> dict:
    """Our vLLM adapter against the actor on the device (:mod:`.vllm_checks`)."""
    folder = checks.work / f"vllm-{quantization or 'bf16'}"
    folder.mkdir()
    return checks.python(
        "bapo_megatron.device_check.vllm_checks",
        "--device",
        checks.args.device,
        "--work",
        str(folder),
        *(["--quantization", quantization] if quantization else []),
        timeout=checks.args.check_timeout,
    )


def loop_vllm(checks: Checks) -> dict:
    """The loop with vLLM colocated (``rollout.engine=vllm``), from an HF folder with a
    tokenizer and a prompt file (:func:`~.loop_runs.vllm_loop_inputs`)."""
    folder = checks.work / "loop-vllm"
    folder.mkdir()
    overrides = loop_runs.vllm_loop_inputs(folder, gpu=checks.gpu)
    return loop_runs.loop_check(
        folder, checks.args.device, overrides, checks.env, checks.args.check_timeout
    )


def not_on_this_device(why: str) -> dict:
    return {"status": "not run", "why": why}


def run_all(args: argparse.Namespace, work: Path) -> dict:
    checks = Checks(args, work)
    gpu = checks.gpu
    only = passes.wanted_checks(args)

    def want(name: str) -> bool:
        return passes.selected(name, only)

    if want("actor_tiny"):
        # CPU-sized: one variant per preset and granularity is enough to keep the path alive
        variants = ALL_VARIANTS if gpu else "paper/step,reference/microbatch"
        checks.record(
            "actor_tiny",
            actor_comparison,
            checks,
            "tiny",
            variants,
            3 if gpu else 2,
            variants,
            3 if gpu else 2,
            8,
            128 if gpu else 32,
        )
    if want("actor_moe"):
        variants = "paper/step,paper/microbatch" if gpu else "paper/step"
        checks.record(
            "actor_moe",
            actor_comparison,
            checks,
            "tiny-moe",
            variants,
            3 if gpu else 2,
            variants,
            3 if gpu else 2,
            8,
            128 if gpu else 32,
        )
    if want("actor_small"):
        checks.record(
            "actor_small",
            actor_comparison,
            checks,
            "small",
            ALL_VARIANTS,
            3,
            "paper/step",
            1,
            8,
            256 if gpu else 32,
        )
    if want("actor_fp8"):  # the ~0.5B model's matrix dimensions are multiples of 128
        checks.record(
            "actor_fp8",
            actor_comparison,
            checks,
            "small",
            "paper/step",
            2,
            "paper/step",
            1,
            8,
            256,
            FP8_RECIPES,
        )
    tiny_argv = [
        "--device",
        args.device,
        "--size",
        "tiny",
        "--variants",
        "paper/step",
        "--steps",
        "3",
        "--dtype",
        "bfloat16" if gpu else "float32",
    ]
    if want("distributed_optimizer"):
        checks.record("distributed_optimizer", distributed_optimizer, checks, tiny_argv)
    if want("deterministic"):
        size = ["--size", "small"] + ([] if gpu else ["--cpu-sized"])
        checks.record(
            "deterministic",
            same_run_twice,
            checks,
            [*tiny_argv[:2], *size, *tiny_argv[4:], "--length", "256" if gpu else "32"],
        )
    if want("memory"):
        checks.record("memory", memory, checks)
    if want("memory_moe"):
        checks.record("memory_moe", memory, checks, "qwen3-30b-a3b-2l")
    if want("loss_bench"):
        checks.record("loss_bench", loss_bench, checks)
    if want("packing"):
        checks.record("packing", packing, checks)
    if want("packing_bench"):
        checks.record("packing_bench", packing_bench, checks)
    if want("engine"):
        engine_argv = (
            ["--dtype", "bfloat16"]
            if gpu
            else ["--cpu-sized", "--prompts", "4", "--max-new-tokens", "8"]
        )
        checks.record("engine", model_check, checks, "engine", *engine_argv)
    if want("conversion"):
        checks.record("conversion", conversion, checks)
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
    for name, quantization in (("vllm_engine", None), ("vllm_engine_fp8", "fp8")):
        if want(name):
            if not gpu and name in passes.GPU_ONLY:
                checks.record(name, not_on_this_device, passes.GPU_ONLY[name])
            else:
                checks.record(name, vllm_engine, checks, quantization)
    if want("loop_vllm"):
        checks.record("loop_vllm", loop_vllm, checks)
    return checks.results


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str, repo_root: os.PathLike) -> dict:
    """The versions, device and commit of this run."""
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "transformers": transformers.__version__,
        "transformer_engine": _version("transformer_engine"),
        "vllm": _version("vllm"),
        "device": device,
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    try:
        info["commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=repo_root,
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            or None
        )
    except OSError:
        info["commit"] = None
    return info


def write_report(out: Path, label: str, report: dict) -> None:
    stem = f"device_check{'-' + label if label else ''}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(summary_markdown(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--out", required=True, help="folder for device_check.json/.md")
    parser.add_argument(
        "--only",
        help="comma list of check names, `vllm` for the vLLM pass's "
        "(default: all of the base pass, or of the TE pass with --spec te)",
    )
    parser.add_argument(
        "--spec",
        choices=("auto", "te"),
        default="auto",
        help="te: the Transformer Engine pass (refused without TE)",
    )
    parser.add_argument("--check-timeout", type=float, default=300.0, help="seconds per check")
    parser.add_argument("--cpu-threads", type=int, default=8, help="of the CPU reference runs")
    parser.add_argument("--label", default="", help="a name for this run in the report")
    parser.add_argument(
        "--reference-pythonpath",
        default=None,
        help="PYTHONPATH of the CPU reference runs (default: this process's); the pass against "
        "a newer megatron-core keeps its CPU references on the pinned one, which the CPU "
        "patches need",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    report = {"label": args.label, "environment": environment(args.device, REPO_ROOT)}
    reason = passes.refusal(args, passes.wanted_checks(args))
    if reason is not None:
        print(f"device check refused: {reason}", file=sys.stderr)
        report.update(wall_s=0.0, refused=reason, checks={}, not_run=passes.not_run(args, ()))
        write_report(out, args.label, report)
        return 2
    with tempfile.TemporaryDirectory(prefix="device-check-") as work:
        results = run_all(args, Path(work))
    report.update(
        wall_s=round(time.monotonic() - began, 1),
        checks=results,
        not_run=passes.not_run(args, results),
    )
    write_report(out, args.label, report)
    print(json.dumps({name: r["status"] for name, r in results.items()}))
    return 0 if all(r["status"] in ("passed", "not run") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

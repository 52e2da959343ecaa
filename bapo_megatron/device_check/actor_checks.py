"""The device check's actor checks: train steps on the device (bf16 on a GPU) against the same
steps in float32 on the CPU from one HF folder of bf16 weights, the distributed optimizer
against the plain one, deterministic mode run twice, and the HF -> Megatron -> HF conversion.
In the Transformer Engine pass (``--spec te``) a model built from other layers fails."""

from __future__ import annotations

import os

from bapo_megatron.device_check.compare import compare_actor_runs
from bapo_megatron.device_check.processes import REPO_ROOT, BackgroundActorRun, Checks
from bapo_megatron.device_check.shapes import model_config
from bapo_megatron.device_check.start_folder import write_start_folder

ALL_VARIANTS = "paper/step,paper/microbatch,reference/step,reference/microbatch"
FP8_RECIPES = ("delayed", "tensorwise", "blockwise")
"""The FP8 recipes a Hopper GPU runs (``mxfp8`` is Blackwell's)."""


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


def model_check(checks: Checks, name: str, *argv: str) -> dict:
    return checks.python(
        "bapo_megatron.device_check.model_checks",
        name,
        "--device",
        checks.args.device,
        *argv,
        timeout=checks.args.check_timeout,
    )


def packing(checks: Checks) -> dict:
    """Packed rows against padded rows on the device (:mod:`.packed_rows`): the ~0.5B shape in
    bf16 with 2k-token responses on a GPU, the tiny model on the CPU."""
    argv = ["--device", checks.args.device]
    argv += (
        ["--size", "small", "--dtype", "bfloat16", "--sequences", "32", "--length", "2048"]
        if checks.gpu
        else ["--size", "tiny", "--sequences", "8", "--length", "48"]
    )
    run = checks.python(
        "bapo_megatron.device_check.packed_rows", *argv, timeout=checks.args.check_timeout
    )
    if run["status"] != "passed":
        raise RuntimeError(f"packed rows differ from padded rows beyond tolerance: {run}")
    return run

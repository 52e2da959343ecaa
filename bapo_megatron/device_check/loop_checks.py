"""The device check's loop checks: ``bapo-train`` on the device with the tiny CPU run's config, the
~0.5B shapes, the tiny MoE example (routing replay R3), a SIGKILLed run resumed, and the loop
and the adapter with vLLM colocated. Sizes and overrides live here; running the trainer and
reading its output is :mod:`~bapo_megatron.device_check.loop_runs`."""

from __future__ import annotations

from bapo_megatron.device_check import loop_runs
from bapo_megatron.device_check.processes import REPO_ROOT, Checks

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


VLLM_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
"""Set for the vLLM checks unless the environment sets it: the adapter's full-vocabulary
log-prob hook wraps the V1 model runner's sampler."""


def vllm_engine(checks: Checks, quantization: str | None) -> dict:
    """The vLLM adapter against the actor on the device (:mod:`.vllm_checks`)."""
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
        env={**VLLM_ENV, **checks.env},
    )


def loop_vllm(checks: Checks) -> dict:
    """The loop with vLLM colocated (``rollout.engine=vllm``), from an HF folder with a
    tokenizer and a prompt file (:func:`~.loop_runs.vllm_loop_inputs`)."""
    folder = checks.work / "loop-vllm"
    folder.mkdir()
    overrides = loop_runs.vllm_loop_inputs(folder, gpu=checks.gpu)
    env = {**VLLM_ENV, **checks.env}
    return loop_runs.loop_check(
        folder, checks.args.device, overrides, env, checks.args.check_timeout
    )

"""How the device check judges a device run against its CPU float32 reference, and the markdown
summary of a report (the device benchmarks' too).

Tolerances for a bfloat16 GPU run against float32 on the CPU, from the same bf16 weights and the
same batch. bfloat16 keeps 8 significant bits (unit roundoff 2^-8 = 0.0039); Megatron's GEMMs
accumulate in float32 but every activation is rounded to bf16 between layers, so each layer adds
a relative error of order 2^-8 to the hidden state, and log-softmax turns a logit error into a
log-prob error of the same absolute size. Averaged over hundreds of response tokens the loss and
entropy keep a relative error of order 10^-2 at most (random, partly cancelling errors of 2-24
layers); the gradient norm, a sum of squares over every parameter, of order a few 10^-2. So:

- first step: loss and entropy within 3% (relative), gradient norm within 10%;
- the step-granularity bounds c_low/c_high within one candidate of the preset's grid (a ratio on
  the grid's edge may cross it under bf16; the bounds move by grid steps of 0.01-0.05);
- later steps are reported, not judged: after an update the two runs hold different weights.

A float32 run on the CPU against the CPU reference (the CI-sized check) must agree to 1e-5.

FP8 (the TE pass's ``actor_fp8``: Transformer Engine's GEMMs in e4m3 for activations and
weights, e5m2 for gradients under `hybrid`, accumulated in float32): e4m3 keeps 4 significant
bits (unit roundoff 2^-4 = 0.0625) and e5m2 3, with one scale per tensor (or per block). A GEMM
output's relative error is then of order 2^-4 (random, partly cancelling over the inner
dimension), some 16x bf16's, hence first-step loss and entropy within 5 %, gradient norm within
25 % (its own GEMMs run in e5m2) and bounds within 0.1. A first setting, to be reset from the
first GPU run's figures (never run yet).
"""

from __future__ import annotations

BF16_TOLERANCE = {"loss": 0.03, "entropy": 0.03, "grad_norm": 0.10}
FP32_TOLERANCE = {"loss": 1e-5, "entropy": 1e-5, "grad_norm": 1e-5}
BOUND_TOLERANCE = 0.05
FP8_TOLERANCE = {"loss": 0.05, "entropy": 0.05, "grad_norm": 0.25}
FP8_BOUND_TOLERANCE = 0.10


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-6)


def compare_actor_runs(device_run: dict, reference: dict, *, bf16: bool, fp8: bool = False
                       ) -> dict:
    """Per variant present in both: first-step relative differences and the verdict (FP8
    tolerances for an ``fp8`` device run)."""
    tolerance = FP8_TOLERANCE if fp8 else BF16_TOLERANCE if bf16 else FP32_TOLERANCE
    bound_tolerance = FP8_BOUND_TOLERANCE if fp8 else BOUND_TOLERANCE
    ref = {v["variant"]: v for v in reference["variants"]}
    variants, passed = {}, True
    for run in device_run["variants"]:
        name = run["variant"]
        entry = {
            "device_losses": [s["loss"] for s in run["steps"]],
            "device_grad_norms": [s["grad_norm"] for s in run["steps"]],
            "device_bounds": [(s["bapo/c_low"], s["bapo/c_high"]) for s in run["steps"]],
            "device_tokens_per_s": run["tokens_per_s"],
        }
        if name in ref:
            mine, theirs = run["steps"][0], ref[name]["steps"][0]
            rel = {k: _relative(mine[k], theirs[k]) for k in tolerance}
            bounds = max(abs(mine["bapo/c_low"] - theirs["bapo/c_low"]),
                         abs(mine["bapo/c_high"] - theirs["bapo/c_high"]))
            ok = all(rel[k] <= tolerance[k] for k in tolerance) and bounds <= bound_tolerance
            passed &= ok
            entry.update(
                reference_losses=[s["loss"] for s in ref[name]["steps"]],
                reference_grad_norms=[s["grad_norm"] for s in ref[name]["steps"]],
                reference_bounds=[(s["bapo/c_low"], s["bapo/c_high"])
                                  for s in ref[name]["steps"]],
                first_step_relative_difference=rel,
                first_step_bound_difference=bounds,
                within_tolerance=ok,
            )
        variants[name] = entry
    compared = [v for v in variants.values() if "within_tolerance" in v]
    return {
        "status": "passed" if passed and compared else "failed",
        "device_dtype": device_run["dtype"],
        "reference": "float32 on the CPU",
        "model": {k: device_run["model"][k] for k in ("model_type", "num_layers", "hidden_size",
                                                      "vocab_size")},
        "tokens_per_step": device_run["tokens_per_step"],
        "tolerance": {**tolerance, "bounds": bound_tolerance},
        "variants": variants,
    }


def summary_markdown(report: dict, title: str = "Device check", headlines=None) -> str:
    """A short human summary: environment, one line per check, what was not run (``headlines``:
    name -> the figures of its result worth a glance; default :data:`CHECK_HEADLINES`)."""
    env = report["environment"]
    lines = [
        f"# {title} {report.get('label') or ''}".rstrip(),
        "",
        f"{env.get('gpu', 'CPU')} ({env['device']}), {env['date']}, commit {env.get('commit')}, "
        f"torch {env['torch']}, megatron-core {env['megatron_core']}, transformers "
        f"{env['transformers']}; {report['wall_s']} s in all.",
        "",
        "| check | status | s | figures |",
        "|---|---|---|---|",
    ]
    for name, result in report["checks"].items():
        lines.append(f"| {name} | {result['status']} | {result['seconds']} | "
                     f"{headline(name, result, headlines)} |")
    if report.get("refused"):
        lines += ["", f"Refused: {report['refused']}"]
    if report["not_run"]:
        lines += ["", "Not run:", ""]
        lines += [f"- {what}: {why}" for what, why in report["not_run"].items()]
    return "\n".join(lines) + "\n"


def headline(name: str, result: dict, headlines=None) -> str:
    """The figures worth a glance of check ``name``'s result (``headlines``: as
    :func:`summary_markdown`'s)."""
    if "error" in result:
        return result["error"].splitlines()[-1][:160].replace("|", "/")
    if name.startswith("actor_") and name != "actor_fp8":
        rel = [v["first_step_relative_difference"]["loss"] for v in result["variants"].values()
               if "first_step_relative_difference" in v]
        speed = max(v["device_tokens_per_s"] for v in result["variants"].values())
        return f"worst first-step loss rel. diff {max(rel):.2e}; {speed:,.0f} tokens/s"
    picks = CHECK_HEADLINES if headlines is None else headlines
    try:
        return picks[name](result) if name in picks else ""
    except (KeyError, TypeError, ValueError):
        return ""


def _fp8_headline(result: dict) -> str:
    worst = {
        recipe: max(v["first_step_relative_difference"]["loss"]
                    for v in comparison["variants"].values()
                    if "first_step_relative_difference" in v)
        for recipe, comparison in result["recipes"].items()
        if "variants" in comparison
    }
    return ", ".join(f"{recipe}: loss rel. diff {w:.1e}" for recipe, w in worst.items())


def _vllm_headline(result: dict) -> str:
    gaps = [g["mean_abs"] for g in result["logprob_gaps"].values()]
    return f"engine/actor log-prob gap mean {max(gaps):.1e} (worst phase)"


CHECK_HEADLINES = {
    "conversion": lambda r: f"logits max diff {r['logits_max_abs_diff_vs_transformers']:.2e}",
    "loop_tiny": lambda r: f"reward {r['reward_first5']:.3f} -> {r['reward_last5']:.3f}",
    "loop_small": lambda r: f"reward {r['reward_first5']:.3f} -> {r['reward_last5']:.3f}",
    "resume": lambda r: f"killed after {r['killed_after_checkpoint']}, {r['records']} records",
    "deterministic": lambda r: f"bitwise {r['parameters_bitwise_equal']}",
    "actor_fp8": _fp8_headline,
    "vllm_engine": _vllm_headline,
    "vllm_engine_fp8": _vllm_headline,
    "loop_vllm": lambda r: f"reward {r['reward_first5']:.3f} -> {r['reward_last5']:.3f}, "
    f"gap {r['logprob_gap_mean_abs_worst_step']}",
    "distributed_optimizer": lambda r: f"max rel. diff {r['max_relative_difference']:.1e}",
}
"""Per check, the figures of its result worth a glance in the summary."""

"""The device check's Transformer Engine and vLLM passes (bapo_megatron/device_check/passes.py)
in what runs without TE, vLLM or a GPU: their refusals (with a report that says why), which
checks each pass runs, the TE pass's verdict on an actor built without TE, the FP8 tolerances,
and the inputs of the loop with vLLM. The passes themselves run on a GPU (docs/validation.md)."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch

from bapo_megatron.config import check_training, load_config
from bapo_megatron.device_check import actor_checks, passes, run
from bapo_megatron.device_check.actor_steps import parallel_config
from bapo_megatron.device_check.compare import compare_actor_runs
from bapo_megatron.device_check.loop_runs import vllm_loop_inputs

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def args(**values) -> argparse.Namespace:
    defaults = {"device": "cpu", "only": None, "spec": "auto", "check_timeout": 60.0,
                "cpu_threads": 1, "label": "", "reference_pythonpath": None}
    return argparse.Namespace(**{**defaults, **values})


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed here")
def test_the_te_pass_is_refused_without_transformer_engine(tmp_path):
    code = run.main(["--device", "cpu", "--out", str(tmp_path), "--spec", "te", "--label", "te"])
    report = json.loads((tmp_path / "device_check-te.json").read_text())
    assert code == 2 and report["checks"] == {}
    assert "Transformer Engine is not installed" in report["refused"]
    assert "Refused: --spec te: Transformer Engine is not installed" in (
        tmp_path / "device_check-te.md").read_text()


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here (the vLLM tier runs the pass)")
def test_the_vllm_pass_is_refused_without_vllm(tmp_path):
    assert run.main(["--device", "cpu", "--out", str(tmp_path), "--only", "vllm"]) == 2
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert "vLLM checks: vLLM is not installed" in report["refused"]
    assert "vLLM on a GPU" in report["not_run"]


def test_each_pass_runs_its_own_checks_and_reports_what_it_left():
    assert passes.wanted_checks(args()) is None  # the base pass: all of its checks
    assert passes.wanted_checks(args(spec="te")) == set(passes.TE_CHECKS)
    assert passes.wanted_checks(args(only="vllm,actor_tiny")) == {*passes.VLLM_CHECKS,
                                                                   "actor_tiny"}
    te = passes.not_run(args(spec="te"), passes.TE_CHECKS)
    assert "Transformer Engine layers and FP8" not in te and "FP8 through the loop" in te
    assert "vLLM on a GPU" not in passes.not_run(args(only="vllm"), ["vllm_engine"])
    assert passes.refusal(args(spec="auto"), None) is None  # the base pass needs nothing
    # the base pass never runs what needs TE or vLLM
    assert passes.selected("actor_tiny", None) and not passes.selected("actor_fp8", None)
    assert not any(passes.selected(name, None) for name in passes.VLLM_CHECKS)
    assert passes.selected("actor_fp8", passes.wanted_checks(args(spec="te")))


def test_the_layer_spec_is_read_from_the_model():
    te_linear = type("Linear", (torch.nn.Module,), {"__module__": "transformer_engine.pytorch"})
    chunk = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert passes.layer_spec_of([chunk]) == "local"
    chunk.append(te_linear())
    assert passes.layer_spec_of([chunk]) == "te"
    chunk[1].register_parameter("layer_norm_weight", torch.nn.Parameter(torch.ones(2)))
    assert passes.fused_norm_parameters([chunk]) == 1


def test_the_te_pass_fails_an_actor_built_from_the_local_spec(monkeypatch, tmp_path):
    step = {"loss": 0.8, "entropy": 5.0, "grad_norm": 1.0, "bapo/c_low": 0.6, "bapo/c_high": 1.2}
    run_json = {"dtype": "bfloat16", "layer_spec": "local", "tokens_per_step": 64,
                "model": {"model_type": "llama", "num_layers": 2, "hidden_size": 8,
                          "vocab_size": 16},
                "variants": [{"variant": "paper/step", "steps": [step], "tokens_per_s": 1.0}]}
    monkeypatch.setattr(actor_checks, "write_start_folder", lambda model, folder, seed: folder)
    monkeypatch.setattr(actor_checks, "BackgroundActorRun", lambda *a: type(
        "Done", (), {"result": lambda self, timeout: run_json})())
    checks = run.Checks(args(spec="te", device="cpu"), tmp_path)
    monkeypatch.setattr(checks, "python", lambda *a, **k: run_json)
    result = actor_checks.actor_comparison(checks, "tiny", "paper/step", 1, "paper/step", 1, 8, 32)
    assert result["status"] == "failed" and "'local' layer spec" in result["error"]
    checks.args.spec = "auto"
    assert actor_checks.actor_comparison(checks, "tiny", "paper/step", 1, "paper/step", 1, 8,
                                32)["status"] == "passed"


def test_fp8_runs_are_judged_by_their_own_tolerances():
    def one(loss: float) -> dict:
        step = {"loss": loss, "entropy": 5.0, "grad_norm": 1.0, "bapo/c_low": 0.6,
                "bapo/c_high": 1.2}
        return {"dtype": "bfloat16", "tokens_per_step": 64,
                "model": {"model_type": "qwen2", "num_layers": 2, "hidden_size": 8,
                          "vocab_size": 16},
                "variants": [{"variant": "paper/step", "steps": [step], "tokens_per_s": 1.0}]}

    assert compare_actor_runs(one(0.832), one(0.8), bf16=True, fp8=True)["status"] == "passed"
    assert compare_actor_runs(one(0.832), one(0.8), bf16=True)["status"] == "failed"
    assert compare_actor_runs(one(0.9), one(0.8), bf16=True, fp8=True)["status"] == "failed"


def test_the_actor_process_takes_its_fp8_mode_from_the_command_line():
    layout = parallel_config(argparse.Namespace(device="cuda", fp8="hybrid",
                                                fp8_recipe="blockwise"))
    assert (layout.fp8, layout.fp8_recipe) == ("hybrid", "blockwise")
    with pytest.raises(ValueError, match="parallel.fp8='hybrid' runs in Transformer Engine"):
        parallel_config(argparse.Namespace(device="cpu", fp8="hybrid", fp8_recipe="delayed"))


def test_the_loop_with_vllm_starts_from_a_folder_with_a_tokenizer(tmp_path):
    [config] = vllm_loop_inputs(tmp_path, gpu=False)
    cfg = load_config(config.split("=", 1)[1])
    check_training(cfg)
    assert cfg.rollout.engine == "vllm" and cfg.model is None
    assert (tmp_path / "start" / "tokenizer.json").is_file()
    assert len((tmp_path / "prompts.jsonl").read_text().splitlines()) == 200

"""The README's "Train a real model" walk-through, checked as far as a CPU allows: every
command in it is read from the README itself, and each trainer launch loads and passes the
training checks with its overrides at its world size, the recipe passes the layout planner on
two nodes of 8 GPUs and the one-node recipe on one, and the converter's and evaluator's arguments
parse. (That the runs work on
GPUs is not checked anywhere: the README says so.)"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from bapo_megatron.config import check_training, load_config
from bapo_megatron.evaluation.cli import build_parser as evaluate_parser
from bapo_megatron.planning.cli import main as plan_layout
from bapo_megatron.weights.convert_cli import build_parser as convert_parser
from tests.helpers.gloo_launch import REPO_ROOT
from tests.helpers.published_configs import config_path

HF_CONFIG = "DeepSeek-R1-Distill-Qwen-7B"  # the walk-through's model


def walkthrough() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("## Train a real model (")  # the GPU one, not "... on the CPU"
    return text[start : text.index("\n## ", start + 1)]


def commands(program: str) -> list[list[str]]:
    """Every command of the walk-through that runs ``program``, as shell words: the lines of its
    code blocks (continuation lines joined) and its inline code spans."""
    parts = walkthrough().split("```")
    lines = [line for block in parts[1::2] for line in block.replace("\\\n", " ").splitlines()]
    lines += [span for prose in parts[0::2] for span in re.findall(r"`([^`]+)`", prose)]
    found = [
        words
        for words in (shlex.split(line, comments=True) for line in lines)
        if any(word.endswith(program) for word in words)
    ]
    assert found, f"the walk-through runs no {program}"
    return found


def test_each_trainer_launch_passes_the_training_checks():
    for words in commands("torchrun_multinode.sh"):
        env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
        script = next(i for i, w in enumerate(words) if w.endswith("torchrun_multinode.sh"))
        config, *overrides = words[script + 1 :]
        cfg = load_config(REPO_ROOT / config, overrides)
        check_training(cfg)
        world = int(env["NNODES"]) * int(env["GPUS_PER_NODE"])
        parallel = cfg.parallel
        replicas = world // (
            parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
        )
        assert replicas >= 1 and cfg.rollout.prompts_per_step % replicas == 0, words


def plan(words: list[str], capsys) -> dict:
    """The planner's JSON summary for the walk-through's command ``words``, on 80 GB GPUs."""
    code = plan_layout([*words[1:], "--hf-config", str(config_path(HF_CONFIG))])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["ok"], summary["problems"]
    assert summary["gpu_memory_gb"] == 80
    assert 0 < summary["worst_rank_memory_gb"]["total"] <= 80
    return summary


def planned_worlds() -> dict[int, list[str]]:
    """The walk-through's planner commands by the world size each passes."""
    found = {}
    for words in commands("bapo-plan-layout"):
        world = int(words[words.index("--world-size") + 1])
        assert world not in found, f"two planner commands at world size {world}"
        found[world] = words
    return found


def test_the_recipe_fits_two_nodes_of_8_gpus(capsys):
    summary = plan(planned_worlds()[16], capsys)
    assert summary["world_size"] == 16 and summary["data_parallel_size"] == 8  # TP2 x DP8


def test_the_one_node_recipe_fits_one_node_of_8_gpus(capsys):
    words = planned_worlds()[8]
    summary = plan(words, capsys)
    assert summary["world_size"] == 8 and summary["data_parallel_size"] == 2  # TP4 x DP2
    # the launch comment of the recipe the README names starts one node
    recipe = (REPO_ROOT / words[1]).read_text()
    assert re.search(r"^#.*\bNNODES=1 GPUS_PER_NODE=8\b", recipe, re.MULTILINE)


def test_the_conversion_and_evaluation_commands_parse():
    for words in commands("bapo-convert-checkpoint"):
        script = words.index("bapo-convert-checkpoint")
        convert_parser().parse_args(words[script + 1 :])
    for words in commands("bapo-evaluate"):
        script = words.index("bapo-evaluate")
        evaluate_parser().parse_args(words[script + 1 :])
    with pytest.raises(SystemExit):  # the parsers do refuse what they do not know
        convert_parser().parse_args(["megatron-to-hf", "a", "b", "--no-such-flag"])

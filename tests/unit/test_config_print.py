"""``--print-config``: the trainer prints the configuration a file and its dotted overrides
resolve to, as YAML that loads back to an equal configuration, and exits 0 without running
anything else (bapo_megatron/config/loading.py ``config_yaml``)."""

from __future__ import annotations

import sys

import pytest
import yaml

from bapo_megatron.config.loading import config_yaml, load_config
from bapo_megatron.trainer.main import main
from tests.helpers import preloaded_processes
from tests.helpers.gloo_launch import REPO_ROOT
from tests.helpers.train_runs import TINY_CONFIG

EXAMPLES = sorted((REPO_ROOT / "examples").rglob("*.yaml"))


def load_printed(text: str, tmp_path):
    printed = tmp_path / "printed.yaml"
    printed.write_text(text)
    return load_config(printed)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_example_prints_as_yaml_that_loads_back_equal(example, tmp_path):
    config = load_config(example)
    assert load_printed(config_yaml(config), tmp_path) == config


def test_print_config_prints_the_overrides_applied_and_runs_nothing(tmp_path, capsys):
    output = tmp_path / "never_made"
    overrides = ["train.steps=7", "loss.clip.preset=grpo", f"train.output_dir={output}"]
    main(["--config", str(TINY_CONFIG), *overrides, "--print-config"])
    printed = capsys.readouterr().out
    tree = yaml.safe_load(printed)
    assert tree["train"]["steps"] == 7 and tree["loss"]["clip"]["preset"] == "grpo"
    assert load_printed(printed, tmp_path) == load_config(TINY_CONFIG, overrides)
    assert load_config(TINY_CONFIG, overrides) != load_config(TINY_CONFIG)
    assert not output.exists()


def test_the_command_line_prints_and_exits_0(tmp_path):
    done = preloaded_processes.run(
        [sys.executable, "-m", "bapo_megatron.train", "--config", str(TINY_CONFIG)]
        + ["rollout.max_new_tokens=12", "--print-config"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = load_config(TINY_CONFIG, ["rollout.max_new_tokens=12"])
    assert load_printed(done.stdout, tmp_path) == expected


def test_a_bad_override_is_refused_before_printing(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(TINY_CONFIG), "train.steps=many", "--print-config"])
    assert str(stop.value.code).startswith("error: train.steps")
    assert capsys.readouterr().out == ""

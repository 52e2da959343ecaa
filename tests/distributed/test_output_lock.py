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
    """Take the lock of ``args.held`` (another process holds it), then of ``args.free``."""
    from bapo_megatron.weights.convert import output_locked

    gloo_launch.join_group(args, timeout_s=60)
    outcomes = {}
    for name, target in (("held", args.held), ("free", args.free)):
        try:
            with output_locked(target):
                outcomes[name] = "locked"
        except ValueError as error:
            outcomes[name] = str(error)
    gloo_launch.save_result(outcomes, args.out)


def test_every_rank_agrees_on_the_lock(tmp_path):
    """One launch for both cases: the refusal (another process holds the lock) leaves no rank
    behind, and then every rank takes a free lock."""
    held, free = tmp_path / "held", tmp_path / "free"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(held)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(gloo_launch.REPO_ROOT)},
    )
    try:
        assert holder.stdout.readline() == "held\n"
        results = gloo_launch.launch(__file__, 2, tmp_path, ["--held", held, "--free", free])
    finally:
        holder.stdin.close()
        holder.wait()
    assert [r["free"] for r in results] == ["locked", "locked"]
    outcomes = [r["held"] for r in results]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].startswith(f"output {held}: rank 0: {held} is in use by another process")
    assert f"PID {holder.pid} on host " in outcomes[0]


if __name__ == "__main__":
    worker(gloo_launch.worker_arguments(sys.argv[1:], held=Path, free=Path))
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()

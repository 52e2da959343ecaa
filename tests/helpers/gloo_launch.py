"""Start real worker processes for the multi-process tests and collect what they write.

A test file re-runs itself as a script: worker ``r`` gets ``--rank r --world-size N --init
<rendezvous file> --out <result file>`` plus the test's own flags, joins a gloo group through a
``file://`` store, and writes its results with ``torch.save``. The workers are forked from the
test session's fork server (``tests/helpers/preloaded_processes.py``): new processes that need
not import torch and Megatron-Core again. Every pool is one thread. The
launch fails, with every rank's output, as soon as one worker exits non-zero, a worker leaves no
result, or the timeout passes; workers still running are then killed, so a rank blocked in a
collective cannot hang the test run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


class WorkerFailure(AssertionError):
    """A multi-process launch failed; the message holds every rank's output."""


def launch(
    script: str | Path,
    world_size: int,
    workdir: Path,
    extra_args: list[str] = (),
    timeout: float = 180.0,
) -> list[dict]:
    """Run ``world_size`` copies of ``script`` and return each rank's saved results."""
    from tests.helpers.preloaded_processes import popen

    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": python_path}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a torchrun around pytest must not leak into the workers
    init = workdir / "rendezvous"  # the FileStore; one per launch
    logs = [workdir / f"rank{rank}.log" for rank in range(world_size)]
    outs = [workdir / f"rank{rank}.pt" for rank in range(world_size)]
    procs: list[subprocess.Popen] = []
    problem = None
    deadline = time.monotonic() + timeout
    try:
        for rank in range(world_size):
            cmd = [
                sys.executable,
                "-u",
                str(Path(script).resolve()),
                "--rank",
                str(rank),
                "--world-size",
                str(world_size),
                "--init",
                str(init),
                "--out",
                str(outs[rank]),
                *map(str, extra_args),
            ]
            with open(logs[rank], "wb") as log:
                procs.append(
                    popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
                )
        while problem is None:
            codes = [p.poll() for p in procs]
            if all(code == 0 for code in codes):
                break
            failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                problem = f"rank(s) {failed} exited with {[codes[r] for r in failed]}"
            elif time.monotonic() > deadline:
                problem = f"timed out after {timeout:.0f} s (exit codes {codes})"
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if problem is None and not all(out.exists() for out in outs):
        problem = "a rank exited 0 without writing its results"
    if problem is not None:
        parts = [f"{world_size}-process launch of {Path(script).name} failed: {problem}"]
        for rank, log in enumerate(logs):
            text = log.read_text(errors="replace") if log.exists() else "(no output)"
            code = procs[rank].returncode if rank < len(procs) else "not started"
            parts.append(f"----- rank {rank} (exit {code}) -----\n{text[-6000:]}")
        raise WorkerFailure("\n".join(parts))
    return [torch.load(out, weights_only=False) for out in outs]


def worker_arguments(argv: list[str], **extra: type) -> argparse.Namespace:
    """Parse the flags :func:`launch` passes, plus ``extra`` (name -> type) of the test's own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--out", required=True)
    for name, kind in extra.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, required=True)
    return parser.parse_args(argv)


def join_group(args: argparse.Namespace, timeout_s: float) -> None:
    """Join the launch's gloo group (``args`` from :func:`worker_arguments`); a collective that
    waits longer than ``timeout_s`` fails instead of hanging the worker."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def save_result(results: object, out: str | Path) -> None:
    """Write a worker's results aside, then rename: a half-written file is never read."""
    out = Path(out)
    torch.save(results, out.with_suffix(".tmp"))
    os.replace(out.with_suffix(".tmp"), out)

"""Rewards that misbehave on purpose, for the fault-injection tests (named as
``tests.helpers.fault_rewards:<function>`` in ``reward.name``). Each is deterministic: whether it
misbehaves depends only on the response text (CRC-32, the same in every process), or on a file
the test creates before the run starts."""

from __future__ import annotations

import os
import signal
import time
import zlib
from pathlib import Path

from bapo_megatron.rewards.exact_match import exact_match_reward


def _picked(response: str, one_in: int) -> bool:
    return zlib.crc32(response.encode()) % one_in == 0


def dies_sometimes(response: str, truth: str) -> float:
    """Kills its own worker process (as an OOM kill or a segfault would) on one response in 4."""
    if _picked(response, 4):
        os.kill(os.getpid(), signal.SIGKILL)
    return exact_match_reward(response, truth)


def hangs_sometimes(response: str, truth: str) -> float:
    """Never finishes (for an hour) on one response in 4, like a pathological check."""
    if _picked(response, 4):
        time.sleep(3600)
    return exact_match_reward(response, truth)


def freezes_rank_1(response: str, truth: str) -> float:
    """On data-parallel rank 1, stops the trainer process that started this worker (SIGSTOP,
    as a frozen node would), at its first check."""
    if os.environ.get("RANK") == "1":
        os.kill(os.getppid(), signal.SIGSTOP)
    return exact_match_reward(response, truth)


HANG_FILE = "BAPO_TEST_HANG_FILE"
"""Environment variable naming the file :func:`hangs_while_told` looks for."""
HANG_AFTER = "BAPO_TEST_HANG_AFTER"
"""Environment variable naming a path that must exist too before :func:`hangs_while_told`
waits (a checkpoint folder: the rewards of the rollout steps after it)."""


def hangs_while_told(response: str, truth: str) -> float:
    """While the file named by ``$BAPO_TEST_HANG_FILE`` exists (and, if ``$BAPO_TEST_HANG_AFTER``
    names a path, that path exists too), marks that it was reached (``<file>.reached``) and
    waits (up to an hour) until the file is gone: the trainer is then certainly in the middle of
    a rollout step, waiting for its rewards, until the test lets it go on. Otherwise an
    exact-match reward."""
    told, after = os.environ.get(HANG_FILE), os.environ.get(HANG_AFTER)
    if told and Path(told).exists() and (not after or Path(after).exists()):
        Path(told + ".reached").touch()
        deadline = time.monotonic() + 3600
        while Path(told).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return exact_match_reward(response, truth)


KILL_WORKER = "BAPO_TEST_KILL_WORKER"
"""Environment variable: ``NODE LOCAL``, the launcher's node rank (``BAPO_NODE_RANK``) and the
local rank of the torchrun worker :func:`kills_a_rank_once` kills."""
KILL_AFTER = "BAPO_TEST_KILL_AFTER"
"""Environment variable: the path (a checkpoint folder) that must exist before it kills."""
KILL_MARK = "BAPO_TEST_KILL_MARK"
"""Environment variable: the file it creates when it kills, so that it kills once per run."""


def kills_a_rank_once(response: str, truth: str) -> float:
    """Once ``$BAPO_TEST_KILL_AFTER`` exists, at the first check after it: SIGKILLs the
    torchrun worker ``$BAPO_TEST_KILL_WORKER`` of this attempt (as an ECC error or an OOM kill
    would), having created ``$BAPO_TEST_KILL_MARK`` first, so that no later check, in this
    attempt or a restarted one, kills again. The worker is this reward worker's own trainer, or
    one without reward workers (an engine rank), found by its environment (torchrun's, with the
    same ``MASTER_PORT``: this attempt's). Otherwise an exact-match reward."""
    after, mark = os.environ.get(KILL_AFTER), os.environ.get(KILL_MARK)
    if after and mark and Path(after).exists():
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return exact_match_reward(response, truth)
        target = os.environ[KILL_WORKER].split()
        if target == _worker_name(os.environ):
            os.kill(os.getppid(), signal.SIGKILL)
        else:
            os.kill(_worker_pid(target), signal.SIGKILL)
    return exact_match_reward(response, truth)


def _worker_name(env) -> list[str]:
    return [env.get("BAPO_NODE_RANK", ""), env.get("LOCAL_RANK", "")]


def _worker_pid(name: list[str]) -> int:
    """The PID of the process torchrun started as worker ``name`` in this process's world."""
    import psutil

    port = os.environ["MASTER_PORT"]
    found = []
    for process in psutil.process_iter():
        try:
            env = process.environ()
        except (psutil.Error, OSError):  # ended, or not ours to read
            continue
        if _worker_name(env) == name and env.get("MASTER_PORT") == port:
            found.append(process.pid)
    if len(found) != 1:
        raise RuntimeError(f"not one torchrun worker {name} at port {port}: {found}")
    return found[0]

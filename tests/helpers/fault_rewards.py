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

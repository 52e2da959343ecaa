"""Score many responses in worker processes, each check bounded in time.

One pathological answer (math-verify can spend seconds on ``9^{9^{9^{9}}}``) must not stall a
training step: every check gets ``timeout_s``; one that overruns scores ``timeout_reward`` and
is counted, and the pool's workers are replaced after the batch (a stuck worker is killed, as
threads cannot be). A check that raises scores ``error_reward`` and is counted with its message.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass, field

from bapo_megatron.megatron_patches.child_processes import exit_with_parent
from bapo_megatron.rewards.registry import get_reward


def _score(name: str, response: str, ground_truth: str) -> tuple[float | None, str | None]:
    try:
        return float(get_reward(name)(response, ground_truth)), None
    except Exception as err:  # noqa: BLE001 - reported to the caller, counted, never fatal
        return None, f"{type(err).__name__}: {err}"


def _load(name: str) -> None:
    get_reward(name)


@dataclass
class ScoredBatch:
    """Rewards of one batch and what went wrong while scoring it."""

    rewards: list[float]
    timed_out: int = 0
    """Checks that overran the time limit (scored ``timeout_reward``)."""
    errors: list[str] = field(default_factory=list)
    """Messages of checks that raised (scored ``error_reward``), by position: ``"i: message"``."""


class RewardPool:
    """A process pool that scores (response, ground truth) pairs with the reward ``name``."""

    def __init__(self, name: str, *, workers: int = 2, timeout_s: float = 10.0,
                 timeout_reward: float = 0.0, error_reward: float = 0.0) -> None:
        get_reward(name)  # fail early on an unknown name
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"RewardPool: workers must be >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.name, self.workers, self.timeout_s = name, workers, timeout_s
        self.timeout_reward, self.error_reward = timeout_reward, error_reward
        # spawn: workers must not inherit the trainer's threads, process groups or CUDA state.
        self._context = multiprocessing.get_context("spawn")
        self._pool = self._start()

    def _start(self):
        pool = self._context.Pool(self.workers, initializer=exit_with_parent)
        # Import the reward in the workers now, so start-up is not charged to the first checks.
        pool.map(_load, [self.name] * self.workers, chunksize=1)
        return pool

    def score(self, responses: list[str], ground_truths: list[str]) -> ScoredBatch:
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        pending = [self._pool.apply_async(_score, (self.name, r, g))
                   for r, g in zip(responses, ground_truths)]
        batch = ScoredBatch(rewards=[])
        stuck = False
        for index, result in enumerate(pending):
            # Each check gets timeout_s from the moment it is waited on; checks queued behind a
            # stuck worker run on the others meanwhile.
            try:
                reward, error = result.get(timeout=self.timeout_s)
            except multiprocessing.TimeoutError:
                stuck = True
                batch.timed_out += 1
                batch.rewards.append(self.timeout_reward)
                continue
            if error is not None:
                batch.errors.append(f"{index}: {error}")
                batch.rewards.append(self.error_reward)
            else:
                batch.rewards.append(reward)
        if stuck:
            self._pool.terminate()
            self._pool = self._start()
        return batch

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

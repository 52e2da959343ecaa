"""Score many responses in worker processes, each check and each batch bounded in time.

One pathological answer (math-verify can spend seconds on ``9^{9^{9^{9}}}``) must not stall a
training step, and neither may a worker that dies (an OOM kill, a segfault in a native parser):

- every check gets ``timeout_s`` from the moment a worker starts it; one that overruns scores
  ``timeout_reward``, is counted, and its worker is killed and replaced (threads cannot be);
- the whole batch gets ``batch_timeout_s``: what has not finished by then scores
  ``timeout_reward`` and is counted, so many slow checks cannot add up to an unbounded wait;
- a check that raises, returns something that is not a finite number (or a dict with one
  under ``score``), or whose worker dies, scores ``error_reward`` and is counted with a message
  naming the reward and the response; a dead worker is replaced and the batch goes on.

Each check is called in the reward's own signature, with the row's ``data_source`` and
``extra_info`` where it asks for them, and a dict result's other numbers are kept as the check's
metrics (:mod:`bapo_megatron.rewards.calling`).

Each worker is a process of its own with its own pipe (not a ``multiprocessing.Pool``, whose
``terminate`` blocks for good once one of its workers has died).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import time
from collections import deque
from dataclasses import dataclass, field

from bapo_megatron.megatron_patches.child_processes import exit_with_parent
from bapo_megatron.rewards.calling import RewardInput, read_outcome, reward_caller
from bapo_megatron.rewards.registry import get_reward

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
"""How long a new worker may take to import its reward before the pool gives up on it."""
_LOGGED_ERRORS = 5  # error messages logged per batch; all are counted and kept in ScoredBatch


def _score(call, given: RewardInput) -> tuple[float | None, str | None, dict[str, float]]:
    """(score, None, metrics) of one check, or (None, what went wrong, {})."""
    try:
        value = call(given)
    except Exception as err:  # noqa: BLE001 - reported to the caller, counted, never fatal
        return None, f"{type(err).__name__}: {err}", {}
    try:
        outcome = read_outcome(value)
    except ValueError as err:
        return None, str(err), {}
    return outcome.score, None, outcome.metrics


def _serve(connection: multiprocessing.connection.Connection, name: str) -> None:
    """A worker: load the reward, say so, then score ``(index, RewardInput)`` requests until
    the pipe closes or ``None`` arrives."""
    exit_with_parent()
    # imported now, so start-up is not charged to the first check
    call = reward_caller(get_reward(name))
    connection.send("ready")
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request is None:
            return
        index, given = request
        connection.send((index, *_score(call, given)))


@dataclass
class ScoredBatch:
    """Rewards of one batch and what went wrong while scoring it."""

    rewards: list[float]
    timed_out: int = 0
    """Checks that overran ``timeout_s`` or the batch's ``batch_timeout_s`` (scored
    ``timeout_reward``)."""
    errors: list[str] = field(default_factory=list)
    """Messages of checks that failed (raised, returned no finite number, or lost their worker;
    scored ``error_reward``), by position: ``"i: message"``."""
    metrics: list[dict[str, float]] = field(default_factory=list)
    """Per response, the metrics its check returned beside the score (empty for a number, a
    failure or a timeout)."""


class _Worker:
    """One scoring process and the check it is running."""

    def __init__(self, context, name: str, number: int) -> None:
        """Start the process; :meth:`wait_ready` waits until it has imported its reward (apart,
        so that a pool's workers import theirs at the same time)."""
        self.reward = name
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, name), daemon=True, name=f"reward-worker-{number}"
        )
        self.process.start()
        child.close()
        self.item: int | None = None
        self.started = 0.0
        self._stopping = False

    def wait_ready(self, deadline: float) -> None:
        """Wait (until the ``time.monotonic()`` ``deadline``) for the worker's "ready"; a worker
        that dies or stays silent is killed and named."""
        if not self.connection.poll(max(0.0, deadline - time.monotonic())):
            self.kill()
            raise RuntimeError(
                f"reward worker {self.process.name} (reward {self.reward!r}) did not start "
                f"within {STARTUP_TIMEOUT_S:.0f} s (exit code {self.process.exitcode})"
            )
        try:
            self.connection.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(
                f"reward worker {self.process.name} (reward {self.reward!r}) died while "
                f"starting (exit code {self.process.exitcode})"
            ) from None

    def start(self, item: int, given: RewardInput) -> None:
        self.item, self.started = item, time.monotonic()
        self.connection.send((item, given))

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.connection.close()

    def request_stop(self) -> None:
        """Ask the worker to exit once it is idle (a pool asks all of them before waiting, so
        that their interpreters shut down at the same time)."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self.connection.send(None)
        except OSError:
            pass  # gone already, or killed: the join below returns at once

    def stop(self) -> None:
        """End the worker politely (it finishes no check), or kill it."""
        self.request_stop()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.connection.close()


class RewardPool:
    """Processes that score (response, ground truth) pairs with the reward ``name``."""

    def __init__(
        self,
        name: str,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        batch_timeout_s: float | None = None,
        timeout_reward: float = 0.0,
        error_reward: float = 0.0,
    ) -> None:
        reward_caller(get_reward(name))  # fail early on an unknown name
        if workers < 1 or timeout_s <= 0 or (batch_timeout_s is not None and batch_timeout_s <= 0):
            raise ValueError(
                f"RewardPool: workers must be >= 1, timeout_s and batch_timeout_s > 0, "
                f"got {workers}, {timeout_s}, {batch_timeout_s}"
            )
        self.name, self.timeout_s, self.batch_timeout_s = name, timeout_s, batch_timeout_s
        self.timeout_reward, self.error_reward = timeout_reward, error_reward
        # spawn: workers must not inherit the trainer's threads, process groups or CUDA state.
        self._context = multiprocessing.get_context("spawn")
        self._started = 0
        self._workers: list[_Worker] = []
        try:
            for _ in range(workers):
                self._workers.append(self._start_worker())
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            for worker in self._workers:
                worker.wait_ready(deadline)
        except BaseException:
            self.close()
            raise

    def _start_worker(self) -> _Worker:
        self._started += 1
        return _Worker(self._context, self.name, self._started)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        new = self._start_worker()
        self._workers[self._workers.index(worker)] = new
        new.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)

    def score(
        self,
        responses: list[str],
        ground_truths: list[str],
        *,
        data_sources: list[str | None] | None = None,
        extra_infos: list[dict | None] | None = None,
    ) -> ScoredBatch:
        """Rewards of ``responses`` in order, each checked against its ground truth (and, for
        rewards that ask, its row's data source and extra information; None: none); returns
        within ``batch_timeout_s`` (plus the time to replace killed workers)."""
        count = len(responses)
        data_sources = [None] * count if data_sources is None else data_sources
        extra_infos = [None] * count if extra_infos is None else extra_infos
        if not count == len(ground_truths) == len(data_sources) == len(extra_infos):
            raise ValueError(
                f"{count} responses but {len(ground_truths)} ground truths, "
                f"{len(data_sources)} data sources, {len(extra_infos)} extra infos"
            )
        inputs = [
            RewardInput(response=r, ground_truth=t, data_source=d, extra_info=e)
            for r, t, d, e in zip(responses, ground_truths, data_sources, extra_infos)
        ]
        rewards: list[float | None] = [None] * count
        metrics: list[dict[str, float]] = [{} for _ in range(count)]
        timed_out: set[int] = set()
        errors: dict[int, str] = {}
        waiting = deque(range(len(responses)))
        batch_end = (
            None if self.batch_timeout_s is None else time.monotonic() + self.batch_timeout_s
        )

        def fail(item: int, message: str) -> None:
            errors[item] = (
                f"reward {self.name!r} on response {item} ({responses[item][:80]!r}): {message}"
            )

        while waiting or any(w.item is not None for w in self._workers):
            for worker in self._workers:
                if worker.item is None and waiting:
                    item = waiting.popleft()
                    worker.start(item, inputs[item])
            busy = [w for w in self._workers if w.item is not None]
            ends = [w.started + self.timeout_s for w in busy] + ([batch_end] if batch_end else [])
            multiprocessing.connection.wait(
                [w.connection for w in busy] + [w.process.sentinel for w in busy],
                timeout=max(0.0, min(ends) - time.monotonic()),
            )
            for worker in busy:
                item = worker.item
                closed = False
                if worker.connection.poll():  # a result sent before a death is still taken
                    try:
                        _, reward, error, returned = worker.connection.recv()
                    except (EOFError, OSError):
                        closed = True  # the worker is gone or going: wait for its exit code
                        worker.process.join(timeout=STARTUP_TIMEOUT_S)
                    else:
                        worker.item = None
                        if error is None:
                            rewards[item], metrics[item] = reward, returned
                        else:
                            fail(item, error)
                        continue
                if closed or not worker.process.is_alive():
                    fail(
                        item,
                        f"its worker process died (exit code {worker.process.exitcode}); "
                        "the worker was replaced",
                    )
                    self._replace(worker)
                elif time.monotonic() >= worker.started + self.timeout_s:
                    timed_out.add(item)
                    self._replace(worker)
            if batch_end is not None and time.monotonic() >= batch_end:
                for worker in [w for w in self._workers if w.item is not None]:
                    timed_out.add(worker.item)
                    self._replace(worker)
                timed_out.update(waiting)
                waiting.clear()
        batch = ScoredBatch(rewards=[], timed_out=len(timed_out))
        for item, reward in enumerate(rewards):
            if item in timed_out:
                batch.rewards.append(self.timeout_reward)
            elif item in errors:
                batch.errors.append(f"{item}: {errors[item]}")
                batch.rewards.append(self.error_reward)
            else:
                batch.rewards.append(reward)
            batch.metrics.append({} if item in timed_out or item in errors else metrics[item])
        for message in batch.errors[:_LOGGED_ERRORS]:
            log.warning("reward error (scored %s): %s", self.error_reward, message)
        return batch

    def close(self) -> None:
        for worker in self._workers:
            worker.request_stop()
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

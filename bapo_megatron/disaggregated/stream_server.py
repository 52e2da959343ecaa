"""The engine rank's side of asynchronous training (``algorithm.max_staleness`` >= 1): it
generates the rollout items its trainer replica admits, one after another, while weight
updates arrive and are loaded in between.

Two threads, each the only user of its groups, so no gloo group is ever driven from two threads:

- the control thread receives on the request link: ``work`` (a rollout item: one rollout step's
  prompts of this replica, queued), ``update_weights`` (every pipeline stage received completely
  from the stage broadcasts, then staged as the newest complete version; with
  ``inflight_update=resume`` the engine is paused so that generation stops at the next token),
  the shard-to-shard sync's requests
  (:mod:`~bapo_megatron.disaggregated.remote_shard_receiver`: queued for the generating thread,
  the engine paused likewise) and ``stop``;
- the generating thread (the caller of :meth:`StreamServer.serve`) loads a staged version
  before it starts an item and, while one runs, between two tokens (``continue``: the embedded
  engine's ``token_boundary``) or after pausing the samples, which are then resumed from their
  prefix (``resume``); it answers each finished item on the result link with its samples and
  :class:`ItemStats`. At the same boundaries (or at once when idle) it runs the queued shard
  requests and answers each on the result link: a shard-to-shard update is written straight
  into the engine's weights, so it lands at a boundary while the trainer waits for it, and no
  staged copy is kept.

The trainer admits an item only after the weight updates it must be generated with were sent,
and the control thread stages an update before it queues any later item, so an item never
starts on weights older than those its admission counted on. Each token keeps the version and
behaviour log-prob it was sampled with. A trainer that goes away ends the control thread's wait
with :class:`~bapo_megatron.distributed.messages.PeerLost`, which aborts generation and is
raised from :meth:`StreamServer.serve`; an engine call that fails is answered as an error (the
trainer stops naming this engine) and the server waits for its ``stop``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bapo_megatron.disaggregated.remote_shard_receiver import (
    SHARD_REQUESTS,
    EngineRankReceiver,
    answer_shard_request,
)
from bapo_megatron.disaggregated.server import IDLE_LIMIT, TRAINER, receive_version
from bapo_megatron.distributed.collectives import describe_failure
from bapo_megatron.distributed.messages import GroupMessenger
from bapo_megatron.rollout.protocol import RolloutEngine, RolloutSample, SamplingParams
from bapo_megatron.weight_sync.stage_broadcast_wire import StageBroadcast

log = logging.getLogger(__name__)


@dataclass
class WorkItem:
    """One rollout item: the prompts of rollout step ``item`` for this engine's replica."""

    item: int
    prompts: list[list[int]]
    params: SamplingParams


@dataclass
class ItemStats:
    """How the engine spent its time on one item (sent back with its samples)."""

    idle_s: float = 0.0
    """Seconds it waited with nothing admitted before the item started."""
    generate_s: float = 0.0
    """Seconds generating the item (weight loads inside it included)."""
    tokens: int = 0
    """Tokens it generated."""
    loads: int = 0
    """Weight versions loaded while it ran or while it waited to start (staged ones loaded, or
    shard-to-shard updates received)."""
    load_s: float = 0.0
    """Seconds those loads took."""


class StreamServer:
    """Serve asynchronous rollout items with ``engine`` (see the module docstring).

    ``requests`` / ``results``: the request and result links (this process is group rank 1);
    ``stages``: the weight broadcasts of the trainer's pipeline stages, in order;
    ``inflight_update``: `continue` or `resume` (``rollout.inflight_update``)."""

    def __init__(
        self,
        engine: RolloutEngine,
        requests: GroupMessenger,
        results: GroupMessenger,
        stages: Sequence[StageBroadcast],
        *,
        inflight_update: str,
        idle_limit: datetime.timedelta = IDLE_LIMIT,
    ) -> None:
        if inflight_update == "continue" and not hasattr(engine, "token_boundary"):
            raise ValueError(
                f"rollout.inflight_update=continue needs an engine that loads weights between "
                f"two tokens; {type(engine).__name__} cannot (use rollout.inflight_update=resume)"
            )
        self.engine, self.requests, self.results = engine, requests, results
        self.stages, self.inflight_update, self.idle_limit = stages, inflight_update, idle_limit
        self._changed = threading.Condition()
        self._work: deque[WorkItem] = deque()
        self._shard_requests: deque[tuple] = deque()
        self.receiver = EngineRankReceiver(engine)
        self._staged: tuple[int, list[tuple[str, Any]]] | None = None
        self._refused: str | None = None
        self._stopped = False
        self._lost: BaseException | None = None
        self._stats = ItemStats()

    # -------------------------------------------------------------- generating thread

    def serve(self) -> int:
        """Generate admitted items until the trainer says stop; returns the items answered.
        Raises :class:`PeerLost` when the trainer went away."""
        control = threading.Thread(target=self._control, name="engine-control", daemon=True)
        control.start()
        if self.inflight_update == "continue":
            self.engine.token_boundary = self._between_tokens
        answered = 0
        try:
            while (item := self._next_item()) is not None:
                samples = self._generate(item)
                if self._stop_requested():
                    break
                self.results.send(("samples", item.item, samples, self._stats), TRAINER)
                answered += 1
        except Exception as error:  # noqa: BLE001 - answered: the trainer stops naming this engine
            if self._lost is None:
                self._answer_error(describe_failure(error))
        control.join(self.idle_limit.total_seconds())
        self.receiver.close()
        if self._lost is not None:
            raise self._lost
        # the last message: it ends the trainer's receiving thread
        self.results.send(("stopped",), TRAINER)
        log.info("engine stopped by its trainer after %d rollout items", answered)
        return answered

    def _next_item(self) -> WorkItem | None:
        """The next admitted item (None once stopped), with the newest staged weights loaded
        before it starts; the wait counts as idle time."""
        waited = time.perf_counter()
        self._stats = ItemStats()
        while True:
            with self._changed:
                self._changed.wait_for(
                    lambda: self._work or self._stopped or self._refused or self._shard_requests
                )
                if self._refused is not None:
                    refused, self._refused = self._refused, None
                    raise RuntimeError(refused)
                if self._stopped:
                    return None
                item = self._work.popleft() if self._work else None
            if item is not None:
                break
            self._answer_shard_requests()
        self._stats.idle_s = time.perf_counter() - waited
        self._at_boundary()
        self.engine.resume()  # a pause meant for the previous item must not cut this one
        return item

    def _generate(self, item: WorkItem) -> list[RolloutSample]:
        started = time.perf_counter()
        samples = self.engine.generate(item.prompts, item.params)
        rounds = 0
        while any(s.resumable for s in samples) and not self._stop_requested():
            # `resume`: paused for a weight update; load it and go on from each prefix
            rounds += 1
            self._at_boundary()
            self.engine.resume()
            seed = None if item.params.seed is None else item.params.seed + rounds
            self.engine.continue_generation(samples, dataclasses.replace(item.params, seed=seed))
        self._stats.generate_s = time.perf_counter() - started
        self._stats.tokens = sum(len(s.token_ids) for s in samples)
        return samples

    def _between_tokens(self) -> None:
        """`continue`: the engine calls this before each token."""
        if self._stop_requested():
            self.engine.abort()
        elif self._staged is not None or self._shard_requests:
            self._at_boundary()

    def _at_boundary(self) -> None:
        """Between two items, two tokens or two rounds of resumed samples: what the trainer
        sent meanwhile takes effect."""
        self._answer_shard_requests()
        self._load_staged()

    def _answer_shard_requests(self) -> None:
        while True:
            with self._changed:
                if not self._shard_requests:
                    return
                request = self._shard_requests.popleft()
            started = time.perf_counter()
            status, value = answer_shard_request(self.receiver, request)
            if request[0] == "receive_shards" and status == "ok":
                self._stats.loads += 1
                self._stats.load_s += time.perf_counter() - started
            self.results.send(("shards", status, value), TRAINER)

    def _load_staged(self) -> None:
        with self._changed:
            staged, self._staged = self._staged, None
        if staged is None:
            return
        version, tensors = staged
        started = time.perf_counter()
        self.engine.update_weights(tensors, version=version)
        self._stats.loads += 1
        self._stats.load_s += time.perf_counter() - started

    def _stop_requested(self) -> bool:
        with self._changed:
            return self._stopped

    def _answer_error(self, message: str) -> None:
        try:
            self.results.send(("error", message), TRAINER)
        except RuntimeError as error:  # the trainer is gone too: nothing left to tell
            log.warning("could not report %r to the trainer: %s", message, error)

    def wait_staged(self, version: int, timeout: float) -> bool:
        """Wait until weight version ``version`` is staged and not yet loaded (False after
        ``timeout`` seconds): lets a test hold generation until an update has arrived."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._staged is not None and self._staged[0] == version, timeout
            )

    # -------------------------------------------------------------- control thread

    def _control(self) -> None:
        try:
            while True:
                request = self.requests.recv(TRAINER, timeout=self.idle_limit)
                kind = request[0]
                if kind == "stop":
                    self._stop()
                    return
                if kind == "work":
                    _, item, prompts, params = request
                    with self._changed:
                        self._work.append(WorkItem(item, prompts, params))
                        self._changed.notify_all()
                elif kind == "update_weights":
                    self._stage(int(request[1]))
                elif kind in SHARD_REQUESTS:
                    with self._changed:
                        self._shard_requests.append(request)
                        self._changed.notify_all()
                    if self.inflight_update == "resume":
                        self.engine.pause()
                else:
                    with self._changed:
                        self._refused = f"unknown request {kind!r}"
                        self._changed.notify_all()
        except BaseException as error:  # noqa: BLE001 - the link is gone: stop and raise it
            self._lost = error
            self._stop()

    def _stage(self, version: int) -> None:
        tensors, problem = receive_version(self.stages, version)
        with self._changed:
            if problem is not None:
                self._refused = problem
            else:
                self._staged = (version, tensors)  # a newer complete version replaces an older
            self._changed.notify_all()
        if problem is None:
            if self.inflight_update == "resume":
                self.engine.pause()

    def _stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        self.engine.abort()

"""The trainer's side of asynchronous training (``algorithm.max_staleness`` >= 1): rollout items
sent to an engine rank's :class:`~bapo_megatron.disaggregated.stream_server.StreamServer` as
they are admitted, weight updates sent without waiting for the engine to load them, and the
finished items collected by a receiving thread while the trainer trains.

The main thread alone sends on the request link (work, weight updates, stop) and the receiving
thread alone receives on the result link, so no gloo group is driven from two threads. A failure
of the engine (its error answer, its rank going away, no answer within the deadline) is raised
by :meth:`StreamingEngine.take` as :class:`~bapo_megatron.rollout.guard.EngineFailure` naming
the engine rank.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from bapo_megatron.disaggregated.client import ENGINE
from bapo_megatron.disaggregated.remote_shard_receiver import RemoteShardReceiving
from bapo_megatron.disaggregated.server import IDLE_LIMIT
from bapo_megatron.disaggregated.stream_server import ItemStats
from bapo_megatron.distributed.messages import GroupMessenger, PeerLost
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.protocol import RolloutSample, SamplingParams
from bapo_megatron.weight_sync.stage_broadcast_wire import StageBroadcast

log = logging.getLogger(__name__)


class StreamingEngine(RemoteShardReceiving):
    """An engine replica on another rank that generates admitted rollout items continuously.

    ``weights``: the stage-0 weight broadcast on data-parallel replica 0's first rank (None on
    other replicas, whose engines take replica 0's broadcast, and everywhere when the weights go
    shard to shard: the requests of
    :class:`~bapo_megatron.disaggregated.remote_shard_receiver.RemoteShardReceiving`, answered on
    the result link at the engine's next boundary); ``timeout``: how long
    :meth:`take` waits for an item (``rollout.timeout_s``); ``name`` names the engine in errors."""

    def __init__(
        self,
        requests: GroupMessenger,
        results: GroupMessenger,
        *,
        weights: StageBroadcast | None,
        bucket_bytes: int,
        timeout: datetime.timedelta,
        name: str,
    ) -> None:
        self.requests, self.results, self.weights = requests, results, weights
        self.bucket_bytes, self.timeout, self.name = bucket_bytes, timeout, name
        self.version = -1
        """The newest version sent (the engine loads it before its next item starts)."""
        self._arrived: queue.Queue[tuple] = queue.Queue()
        self._shard_answers: queue.Queue[tuple] = queue.Queue()
        self._failure: str | None = None
        """Why the engine can answer nothing more (its error, its rank gone)."""
        self._ready: dict[int, tuple[list[RolloutSample], ItemStats]] = {}
        self._submitted: set[int] = set()
        self._closing = threading.Event()
        self._receiver = threading.Thread(target=self._receive, name="rollout-results", daemon=True)
        self._receiver.start()

    # -------------------------------------------------------------- main thread

    def submit(self, item: int, prompts: list[list[int]], params: SamplingParams) -> None:
        """Admit rollout item ``item``: the engine generates it after the items before it."""
        if item in self._submitted:
            raise ValueError(f"rollout item {item} was already admitted")
        self._submitted.add(item)
        self.requests.send(("work", int(item), prompts, params), ENGINE)

    @property
    def in_flight(self) -> int:
        """Items admitted and not yet taken."""
        return len(self._submitted)

    def take(self, item: int) -> tuple[list[RolloutSample], ItemStats]:
        """The samples of admitted item ``item`` and the engine's stats of it, waiting for them
        at most ``timeout``; :class:`EngineFailure` naming the engine otherwise."""
        if item not in self._submitted:
            raise ValueError(f"rollout item {item} was never admitted")
        deadline = time.monotonic() + self.timeout.total_seconds()
        while item not in self._ready:
            try:
                message = self._arrived.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise EngineFailure(
                    f"{self.name}: no rollout of item {item} within "
                    f"{self.timeout.total_seconds():g} s (rollout.timeout_s)"
                ) from None
            kind = message[0]
            if kind == "samples":
                _, done, samples, stats = message
                self._ready[int(done)] = (samples, stats)
            elif kind == "error":
                raise EngineFailure(f"{self.name} failed: {message[1]}")
            else:  # "lost"
                raise EngineFailure(f"{self.name}: {message[1]}")
        self._submitted.discard(item)
        return self._ready.pop(item)

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        checksum: bool = False,
    ) -> None:
        """Send the update to ``version`` and, on replica 0's first rank, this stage's tensors
        (elsewhere ``named_tensors`` must be empty, and is still run to its end after the
        request went out, as in the synchronous client); returns once they are sent: the engine
        loads the version at its next token or item boundary. ``checksum`` is not offered here
        (no answer is awaited)."""
        if checksum:
            raise ValueError("asynchronous weight updates do not return a checksum")
        self.requests.send(("update_weights", int(version)), ENGINE)
        if self.weights is not None:
            self.weights.send(named_tensors, version=version, bucket_bytes=self.bucket_bytes)
        elif any(True for _ in named_tensors):
            raise ValueError(
                "update_weights: only data-parallel replica 0 sends tensors to the engines"
            )
        self.version = int(version)

    def _shard_call(self, request: tuple, timeout: datetime.timedelta | None) -> Any:
        """Send a shard request; its answer arrives on the result link (the receiving thread
        hands it over), once the engine reached a boundary."""
        if self._failure is None:
            self.requests.send(request, ENGINE)
            wait_s = (timeout or self.timeout).total_seconds()
            try:
                answer = self._shard_answers.get(timeout=wait_s)
            except queue.Empty:
                raise EngineFailure(
                    f"{self.name}: no answer to {request[0]!r} within {wait_s:g} s"
                ) from None
        if self._failure is not None:
            raise EngineFailure(f"{self.name}: {self._failure}")
        _, status, value = answer
        if status != "ok":
            raise EngineFailure(f"{self.name} refused {request[0]!r}: {value}")
        return value

    def close(self, wait_s: float = 60.0) -> None:
        """Tell the engine rank to stop (once) and wait up to ``wait_s`` for its last message;
        a rank already gone is not an error."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            self.requests.send(("stop",), ENGINE)
        except RuntimeError as error:
            log.warning("could not stop %s: %s", self.name, error)
        self._receiver.join(wait_s)
        if self._receiver.is_alive():
            log.warning("%s did not confirm its stop within %g s", self.name, wait_s)

    # -------------------------------------------------------------- receiving thread

    def _receive(self) -> None:
        while True:
            try:
                message: Any = self.results.recv(ENGINE, timeout=IDLE_LIMIT)
            except PeerLost as error:
                if not self._closing.is_set():
                    self._failed(("lost", str(error)))
                return
            if message[0] == "stopped":
                return
            if message[0] == "shards":
                self._shard_answers.put(message)
            elif message[0] == "error":
                self._failed(message)
            else:
                self._arrived.put(message)

    def _failed(self, message: tuple) -> None:
        """The engine failed (``("error", why)``) or its rank went away (``("lost", why)``):
        :meth:`take` raises it, and so does a shard request waiting for its answer."""
        self._failure = message[1] if message[0] == "lost" else f"failed: {message[1]}"
        self._arrived.put(message)
        self._shard_answers.put(message)

"""Asynchronous training with external servers as the engines (``rollout.placement:
disaggregated``, ``rollout.engine_ranks: 0``, ``rollout.engine: vllm-server | sglang-server``):
the server has no rank in the torchrun world, so the stream server that drives it runs as a
thread of the replica's first trainer rank, reached through in-process queues instead of gloo
groups. :class:`~bapo_megatron.disaggregated.stream_server.StreamServer` and
:class:`~bapo_megatron.disaggregated.stream_client.StreamingEngine` are used unchanged: the
links here offer the messenger's ``send`` / ``recv`` and the stage broadcast's ``send`` /
``receive``, and the weights reach the server through the server client's own route
(``rollout.weight_transport``) when the stream server loads them.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Iterable
from typing import Any

import torch

from bapo_megatron.disaggregated.stream_client import StreamingEngine
from bapo_megatron.disaggregated.stream_server import StreamServer
from bapo_megatron.distributed.messages import PeerLost
from bapo_megatron.rollout.protocol import RolloutEngine


class LocalLink:
    """Both ends of a two-member link in one process: ``send(obj, dst)`` puts ``obj`` in
    member ``dst``'s queue, ``recv(src)`` takes from this member's; ``names`` as a messenger's."""

    def __init__(self, names: list[str], what: str) -> None:
        self.names, self.what = names, what
        self._queues: list[queue.Queue] = [queue.Queue(), queue.Queue()]

    def end(self, rank: int) -> _LocalEnd:
        """Member ``rank``'s end (0: trainer, 1: engine)."""
        return _LocalEnd(self, rank)


class _LocalEnd:
    def __init__(self, link: LocalLink, rank: int) -> None:
        self.link, self.rank, self.names = link, rank, link.names

    def send(self, obj: Any, dst: int) -> None:
        self.link._queues[dst].put(obj)

    def recv(self, src: int, *, timeout: datetime.timedelta | None = None) -> Any:
        try:
            return self.link._queues[self.rank].get(
                timeout=None if timeout is None else timeout.total_seconds()
            )
        except queue.Empty:
            raise PeerLost(
                f"{self.link.what}: waiting for {self.names[src]}: no answer within "
                f"{timeout.total_seconds():g} s"
            ) from None


class LocalStage:
    """A weight "broadcast" to the in-process stream server: the tensors are handed over as
    they are (the server client sends them on to its server when the version is loaded)."""

    def __init__(self) -> None:
        self.stage = 0
        self.sent_bytes = 0
        self._versions: queue.Queue = queue.Queue()

    def send(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, bucket_bytes: int
    ) -> int:
        # the stream goes on to the pipeline group's exchanges: take copies, not views
        tensors = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
        sent = sum(t.numel() * t.element_size() for _, t in tensors)
        self._versions.put((tensors, int(version)))
        self.sent_bytes += sent
        return sent

    def receive(self) -> tuple[list[tuple[str, torch.Tensor]], int]:
        return self._versions.get()


def serve_in_thread(
    engine: RolloutEngine,
    *,
    inflight_update: str,
    timeout: datetime.timedelta,
    name: str,
) -> StreamingEngine:
    """A streaming client whose stream server drives ``engine`` from a thread of this process
    (see the module docstring); closing the client stops the thread."""
    names = ["the trainer", name]
    requests = LocalLink(names, "rollout requests")
    results = LocalLink(names, "rollout results")
    stage = LocalStage()
    server = StreamServer(
        engine,
        requests.end(1),
        results.end(1),
        [stage],
        inflight_update=inflight_update,
    )
    threading.Thread(target=server.serve, name="stream-server", daemon=True).start()
    return StreamingEngine(
        requests.end(0),
        results.end(0),
        weights=stage,
        bucket_bytes=2**30,
        timeout=timeout,
        name=name,
    )

"""Weights to a separately started server over a process group (``rollout.weight_transport:
process-group``): the trainer's process that holds the server's client is group rank 0 and the
server's workers join as ranks 1, 2, ...; every update broadcasts each tensor from rank 0.

The group is built the way SGLang's ``/init_weights_update_group`` builds its side (a TCP
store that group rank 0 serves at ``master_address:master_port``, prefixed with the group's
name, then torch's process-group constructor), so an SGLang server and the vLLM worker extension
(:mod:`bapo_megatron.rollout.vllm.worker_extension`, which joins with :func:`join_weight_group`)
meet the trainer the same way. gloo carries CPU tensors (tested); NCCL carries CUDA tensors
(written to the same API, never run: docs/validation.md).

Per update the server is told the names, dtypes and shapes of every tensor in one request
(SGLang's ``/update_weights_from_distributed``; vLLM's ``/collective_rpc``
``bapo_receive_weights``), receives all of them and only then loads them: a broadcast cut off
part-way leaves the server on its previous weights. The request runs on a helper thread while
this one broadcasts, because the server answers it only once everything arrived.
"""

from __future__ import annotations

import datetime
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future
from concurrent.futures import wait as wait_futures
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

JoinRequest = Callable[[dict], None]
"""Asks the server to join a group: called with ``master_address``, ``master_port``,
``rank_offset``, ``world_size``, ``group_name``, ``backend`` (SGLang's field names); returns
once the server has joined, raises if it could not."""
ReceiveRequest = Callable[[dict], None]
"""Asks the server to receive an update: called with ``names``, ``dtypes`` (torch names without
the ``torch.`` prefix), ``shapes``, ``group_name``; returns once it loaded, raises if it did
not."""


class WeightGroupError(RuntimeError):
    """The weight group could not be built, or an update over it did not complete."""


def join_weight_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout: datetime.timedelta,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Join the weight group ``group_name`` as ``rank`` of ``world_size`` (blocks until every
    member joined, at most ``timeout``). Members other than rank 0 reach rank 0's TCP store at
    ``master_address:master_port``; rank 0 passes the ``store`` it serves. The group lives
    beside any default group and needs none."""
    if store is None:
        store = dist.TCPStore(
            master_address, master_port, world_size, False, timeout, multi_tenant=True
        )
    prefixed = dist.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        prefixed,
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {member: member for member in range(world_size)}
    return group


def leave_weight_group(group: dist.ProcessGroup) -> None:
    """Destroy a weight group (its connections close); one already broken is forgotten."""
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError):  # a group whose peer went away may not shut down cleanly
        pass


def address_towards(base_url: str) -> str:
    """This host's address on the interface that reaches the server at ``base_url``: where the
    server's workers find the group's store."""
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # a datagram socket sends nothing: this only picks a route
        return probe.getsockname()[0]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: how the servers' requests name dtypes."""
    return str(dtype).removeprefix("torch.")


class ServerWeightGroup:
    """The trainer's side of one server's weight group.

    ``server`` names the server in errors; ``server_ranks`` is how many of its processes join
    (one per tensor-parallel worker); ``join`` and ``receive`` send the server's requests
    (:data:`JoinRequest`, :data:`ReceiveRequest`); ``timeout`` bounds building the group and
    every broadcast. The group's backend follows the tensors of the first update: gloo for CPU
    tensors, NCCL for CUDA ones.

    The group is built on the first update. After a failed update it is dropped and the next
    update builds a new one under a new name (a gloo group whose peer went away is unusable).
    """

    def __init__(
        self,
        *,
        server: str,
        base_url: str,
        server_ranks: int,
        join: JoinRequest,
        receive: ReceiveRequest,
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    ) -> None:
        if server_ranks < 1:
            raise ValueError(f"{server}: server_ranks must be at least 1, got {server_ranks}")
        self.server, self.base_url, self.server_ranks = server, base_url, server_ranks
        self.join, self.receive, self.timeout = join, receive, timeout
        self.group: dist.ProcessGroup | None = None
        self.group_name: str | None = None
        self._store: dist.TCPStore | None = None
        self.answer: Any = None
        """The server's answer to the last completed update's receive request."""

    @property
    def world_size(self) -> int:
        return 1 + self.server_ranks

    def update(self, named_tensors: Sequence[tuple[str, torch.Tensor]], **fields: Any) -> int:
        """Send ``named_tensors`` to the server as one update (building the group first when
        there is none; ``fields`` go into the server's receive request as they are); returns the
        bytes broadcast. Raises :class:`WeightGroupError` naming the server if it did not load
        them."""
        try:
            if self.group is None:
                self._build(_backend_for(named_tensors))
            return self._send(named_tensors, fields)
        except BaseException:
            # not destroyed: shutting a group down waits for the broadcast still pending on
            # the other thread; it ends at its timeout (or when the peer's connection closes)
            self.group = self.group_name = self._store = None
            raise

    def _build(self, backend: str) -> None:
        address = address_towards(self.base_url)
        store = dist.TCPStore(
            "0.0.0.0",
            0,
            self.world_size,
            True,
            self.timeout,
            wait_for_workers=False,
            multi_tenant=True,
        )
        name = f"bapo-weights-{uuid.uuid4().hex[:12]}"
        request = {
            "master_address": address,
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": self.world_size,
            "group_name": name,
            "backend": backend,
        }
        joined = in_background(self.join, request)
        built = in_background(
            join_weight_group,
            master_address=address,
            master_port=store.port,
            rank=0,
            world_size=self.world_size,
            group_name=name,
            backend=backend,
            timeout=self.timeout,
            store=store,
        )
        self._wait(joined, built, f"joining the weight group {name} at {address}:{store.port}")
        self.group, self.group_name, self._store = built.result(), name, store

    def _send(self, named_tensors: Sequence[tuple[str, torch.Tensor]], fields: dict) -> int:
        tensors = [(name, tensor.detach().contiguous()) for name, tensor in named_tensors]
        request = {
            "names": [name for name, _ in tensors],
            "dtypes": [dtype_name(t.dtype) for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
            "group_name": self.group_name,
            **fields,
        }
        received = in_background(self.receive, request)
        sent = in_background(self._broadcast, [t for _, t in tensors])
        self._wait(received, sent, f"sending {len(tensors)} tensors over {self.group_name}")
        self.answer = received.result()
        return sent.result()

    def _broadcast(self, tensors: list[torch.Tensor]) -> int:
        """Every tensor from group rank 0, in order (the server receives them in that order)."""
        options = dist.BroadcastOptions()
        options.rootRank, options.timeout = 0, self.timeout
        works = [self.group.broadcast([tensor], options) for tensor in tensors]
        for work in works:
            work.wait(self.timeout)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _wait(self, request: Future, local: Future, doing: str) -> None:
        """Both futures, failing as soon as either fails: a server that refuses answers at
        once, while the local side would wait for it until the timeout."""
        wait_futures([request, local], return_when=FIRST_EXCEPTION)
        for future, side in ((request, "the server's answer"), (local, "this process")):
            if future.done() and future.exception() is not None:
                error = future.exception()
                raise WeightGroupError(
                    f"{self.server}: {doing} failed ({side}): {type(error).__name__}: "
                    f"{str(error)[:500]}"
                ) from error

    def close(self) -> None:
        """Destroy the group (after a completed update: nothing is pending on it)."""
        if self.group is not None:
            leave_weight_group(self.group)
        self.group = self.group_name = self._store = None


def _backend_for(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones (the backend that carries them)."""
    devices = {tensor.device.type for _, tensor in named_tensors}
    if devices == {"cuda"}:
        return "nccl"
    if devices <= {"cpu"}:
        return "gloo"
    raise ValueError(f"a weight update's tensors must all be on the CPU or all on CUDA: {devices}")


def in_background(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """``function`` on a daemon thread: after a failure the other side of an operation may stay
    blocked until its timeout, and must not hold up the process's exit."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(function(*args, **kwargs))
        except BaseException as error:  # handed to the waiting thread
            future.set_exception(error)

    threading.Thread(target=run, name="weight-group", daemon=True).start()
    return future

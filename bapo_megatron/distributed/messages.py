"""Objects and tensors between the members of one process group that lives outside the default
group: the links between a disaggregated run's trainer and its engine ranks.

Megatron takes the default group for the trainer ranks alone, so these groups are built
directly (``torch.distributed.ProcessGroupGloo`` on a prefixed store), and ``dist.send`` and
friends, which look groups up in the default world, cannot drive them: :class:`GroupMessenger`
calls the group's own ``send`` / ``recv`` / ``broadcast`` and waits on each with a deadline.
Every failure (a peer that went away, a deadline that passed) is raised as :class:`PeerLost`
naming the peer. A gloo wait that times out closes the connection, so a messenger is unusable
after its first failure: the run stops, it never retries.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


class PeerLost(RuntimeError):
    """A peer of a messenger's group went away or did not answer by the deadline; the message
    names it."""


class GroupMessenger:
    """Pickled objects and tensors over ``group`` (this process is group rank ``group.rank()``).

    ``names[i]`` is how group rank ``i`` is called in errors (e.g. ``engine rank 2``);
    ``timeout`` is the default deadline of every wait; ``what`` names the link."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        names: Sequence[str],
        timeout: datetime.timedelta,
        what: str,
    ) -> None:
        if len(names) != group.size():
            raise ValueError(f"{what}: {len(names)} names for a group of {group.size()} ranks")
        self.group, self.names, self.timeout, self.what = group, list(names), timeout, what

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.group.rank()

    # -------------------------------------------------------------- point to point

    def send(self, obj: Any, dst: int) -> None:
        """Send the pickled ``obj`` to group rank ``dst``."""
        frame, rest = _frames(obj)
        self._wait(lambda: self.group.send([frame], dst, 0), dst, "sending to")
        if rest is not None:
            self._wait(lambda: self.group.send([rest], dst, 0), dst, "sending to")

    def recv(self, src: int, *, timeout: datetime.timedelta | None = None) -> Any:
        """The next object group rank ``src`` sends, waiting at most ``timeout`` (default: the
        messenger's) for it to begin."""
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        self._wait(lambda: self.group.recv([frame], src, 0), src, "waiting for", timeout)

        def receive_rest(rest: torch.Tensor) -> None:
            self._wait(lambda: self.group.recv([rest], src, 0), src, "receiving from")

        return _unframe(frame, receive_rest)

    # -------------------------------------------------------------- collectives

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``obj`` of group rank ``root`` on every rank (others pass None)."""
        if self.rank == root:
            frame, rest = _frames(obj)
            self.broadcast_tensor(frame, root)
            if rest is not None:
                self.broadcast_tensor(rest, root)
            return obj
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        self.broadcast_tensor(frame, root)
        return _unframe(frame, lambda rest: self.broadcast_tensor(rest, root))

    def broadcast_tensor(self, tensor: torch.Tensor, root: int) -> None:
        """Group rank ``root``'s ``tensor`` into every rank's ``tensor`` (same shape and dtype)."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.timeout = self.timeout
        peer = root if self.rank != root else None
        self._wait(lambda: self.group.broadcast([tensor], options), peer, "broadcasting with")

    # -------------------------------------------------------------- errors

    def _wait(
        self,
        start: Callable[[], dist.Work],
        peer: int | None,
        doing: str,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        """Start an operation and wait for it; a connection found closed when it starts (a
        peer gone) is reported as one lost while waiting."""
        timeout = timeout or self.timeout
        try:
            start().wait(timeout)
        except RuntimeError as error:
            who = (
                self.names[peer]
                if peer is not None
                else " and ".join(n for i, n in enumerate(self.names) if i != self.rank)
            )
            late = "timed out" in str(error).lower()
            cause = (
                f"no answer within {timeout.total_seconds():g} s"
                if late
                else f"connection lost ({str(error).splitlines()[0][:200]})"
            )
            raise PeerLost(f"{self.what}: {doing} {who}: {cause}") from error


FRAME_BYTES = 4096
"""Size of an object's first transfer: its pickled length (8 bytes) and the first bytes of the
pickle. Headers, requests and small answers fit in it, so they cost one wait on the group instead
of two; a longer pickle follows in a second transfer of exactly the remaining bytes."""
_HEAD = FRAME_BYTES - 8


def _frames(obj: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``obj`` pickled, as its first frame and the rest (None when it fits in the frame)."""
    payload = pickle.dumps(obj)
    frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    frame[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    head = payload[:_HEAD]
    if head:
        frame[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    rest = payload[_HEAD:]
    return frame, torch.frombuffer(bytearray(rest), dtype=torch.uint8) if rest else None


def _unframe(frame: torch.Tensor, receive_rest: Callable[[torch.Tensor], None]) -> Any:
    """The object whose first frame is ``frame``; ``receive_rest`` fills the remaining bytes."""
    length = int(frame[:8].view(torch.int64)[0])
    payload = frame[8 : 8 + min(length, _HEAD)].numpy().tobytes()
    if length > _HEAD:
        rest = torch.empty(length - _HEAD, dtype=torch.uint8)
        receive_rest(rest)
        payload += rest.numpy().tobytes()
    return pickle.loads(payload)


def gloo_group(
    store: dist.Store, prefix: str, rank: int, size: int, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """A gloo group of ``size`` processes, this one group rank ``rank``, that meet under
    ``prefix`` in ``store`` (each member calls it with the same prefix and size); it needs no
    default group. Blocks until every member has joined (at most ``timeout``)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)

"""The start of a torchrun attempt: reach the rendezvous store and wait for every rank, within
``parallel.startup_timeout_s``, before any process group is built.

torchrun restarts its worker group in place (``--max-restarts``); each attempt's ranks meet in
a namespace of the store of their own (``bapo/attempt<TORCHELASTIC_RESTART_COUNT>``), so that
no rank reads what a dead attempt left there (torch's own groups would: pytorch/pytorch#135712).
Every rank announces itself in that namespace and waits for the others; a rank that does not
arrive in time stops the attempt with :class:`WorldNotFormed` naming the store's address and the
missing ranks, instead of a process group waiting for it until the collective timeout.

Under ``examples/launch/torchrun_multinode.sh`` (``BAPO_NODE_RANK`` set) the ranks are numbered
node by node in the order of the launcher's node ranks, whatever order torchrun's rendezvous
gave the nodes (its c10d rendezvous orders them by address): the disaggregated split puts the
engines on the last ranks, which must be those of the last nodes.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch.distributed as dist

RESTART_VARIABLE = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of the restarts of this node's worker group (0: the first attempt)."""
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
NODE_RANK_VARIABLE = "BAPO_NODE_RANK"
"""The launcher's index of this node, which orders the ranks (see the module docstring)."""


class WorldNotFormed(RuntimeError):
    """The ranks of an attempt did not all reach the rendezvous within the start-up deadline."""


@dataclass(frozen=True)
class Rendezvous:
    """This rank's place in the attempt's world."""

    store: dist.Store
    """The attempt's namespace in the rendezvous store: every group of the attempt meets in it."""
    rank: int
    world_size: int
    endpoint: str
    """``MASTER_ADDR:MASTER_PORT``, the store's address (for errors)."""


def restart_count() -> int:
    """How many times torchrun has restarted this node's worker group (0 outside torchrun)."""
    return int(os.environ.get(RESTART_VARIABLE, "0") or 0)


def join_rendezvous(startup_timeout_s: float, collective_timeout: datetime.timedelta) -> Rendezvous:
    """Reach torchrun's store and wait until every rank of this attempt has, at most
    ``startup_timeout_s`` in all; then the store's operations wait up to ``collective_timeout``.
    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``LOCAL_RANK``,
    ``BAPO_NODE_RANK``); sets ``RANK`` to the launcher-ordered rank when that differs."""
    missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name)]
    if missing:
        raise ValueError(f"a torchrun rank needs the environment variables {missing}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    endpoint = f"{host}:{port}"
    began = time.monotonic()
    budget = datetime.timedelta(seconds=startup_timeout_s)
    setting = f"parallel.startup_timeout_s={startup_timeout_s:g}"
    # torchrun's agent serves the store, or (TORCHELASTIC_USE_AGENT_STORE not True) rank 0 does;
    # rank 0 does not wait for the others to connect here: the arrivals below name who is late
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    serves = rank == 0 and not agent_serves
    try:
        store = dist.TCPStore(
            host, port, world_size, serves, budget, wait_for_workers=False, multi_tenant=serves
        )
    except (RuntimeError, ValueError) as error:  # DistNetworkError, DistStoreError
        server = "torchrun" if agent_serves else "rank 0"
        raise WorldNotFormed(
            f"the rendezvous store at {endpoint} (served by {server}) could not be reached "
            f"within {setting} ({type(error).__name__}: {str(error)[:300]})"
        ) from error
    attempt = restart_count()
    namespace = dist.PrefixStore(f"bapo/attempt{attempt}", store)
    node = os.environ.get(NODE_RANK_VARIABLE)
    local = os.environ.get("LOCAL_RANK", "0")
    namespace.set(f"arrived/{rank}", f"{node or 0} {local} {rank}")
    keys = [f"arrived/{r}" for r in range(world_size)]
    left = max(budget.total_seconds() - (time.monotonic() - began), 0.001)
    try:
        namespace.wait(keys, datetime.timedelta(seconds=left))
    except RuntimeError as error:  # DistStoreError: the wait's deadline
        missing = [r for r in range(world_size) if not namespace.check([keys[r]])]
        if missing:  # else everyone came just as the deadline passed
            raise WorldNotFormed(
                f"the ranks of torchrun attempt {attempt} did not all reach the "
                f"rendezvous at {endpoint} within {setting}: rank(s) "
                f"{', '.join(map(str, missing))} of {world_size} did not arrive (a peer that "
                "never started or died while starting, or a node of another attempt)"
            ) from error
    store.set_timeout(collective_timeout)
    if node is not None:
        arrivals = [tuple(map(int, v.decode().split())) for v in namespace.multi_get(keys)]
        ordered = sorted(arrivals).index((int(node), int(local), rank))
        if ordered != rank:
            os.environ["RANK"] = str(ordered)
        rank = ordered
    return Rendezvous(store=namespace, rank=rank, world_size=world_size, endpoint=endpoint)

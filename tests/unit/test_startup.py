"""The start of a torchrun attempt (:mod:`bapo_megatron.distributed.startup`), in this process
against a store it serves, the other rank's arrival written into the store as that rank would:
the launcher's node order decides the ranks, and a restarted attempt never counts what a dead
one left in the store."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch.distributed as dist

from bapo_megatron.distributed.startup import WorldNotFormed, join_rendezvous

COLLECTIVE = datetime.timedelta(seconds=60)


@pytest.fixture
def store(monkeypatch):
    """A store served here, and this process as torchrun's rank 0 of 2 meeting in it."""
    served = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(served.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("BAPO_NODE_RANK", raising=False)
    return served


def test_ranks_follow_the_launchers_node_order(store, monkeypatch):
    # torchrun ranked this node (launcher node 1) first; the other node (launcher node 0)
    # started torchrun's rank 1
    monkeypatch.setenv("BAPO_NODE_RANK", "1")
    store.set("bapo/attempt0/arrived/1", "0 0 1")
    joined = join_rendezvous(30, COLLECTIVE)
    assert (joined.rank, joined.world_size) == (1, 2)
    assert os.environ["RANK"] == "1"  # what the process reads later (errors, rewards) agrees
    # the attempt's groups meet under its namespace
    joined.store.set("probe", "x")
    assert store.get("bapo/attempt0/probe") == b"x"


def test_without_the_launchers_node_rank_torchruns_rank_stands(store):
    store.set("bapo/attempt0/arrived/1", "0 1 1")
    assert join_rendezvous(30, COLLECTIVE).rank == 0


def test_a_restarted_attempt_does_not_count_the_dead_attempts_arrivals(store, monkeypatch):
    store.set("bapo/attempt0/arrived/1", "0 1 1")  # rank 1 of the first attempt, now dead
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(WorldNotFormed) as failed:
        join_rendezvous(0.5, COLLECTIVE)
    assert str(failed.value) == (
        "the ranks of torchrun attempt 1 did not all reach the rendezvous at "
        f"127.0.0.1:{store.port} within parallel.startup_timeout_s=0.5: rank(s) 1 of 2 did not "
        "arrive (a peer that never started or died while starting, or a node of another attempt)"
    )


def test_a_store_that_cannot_be_reached_is_named(monkeypatch):
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        for name, value in {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(
            WorldNotFormed,
            match=rf"^the rendezvous store at 127.0.0.1:{port} \(served by torchrun\) could not",
        ):
            join_rendezvous(1, COLLECTIVE)


def test_rank_0_serving_the_store_names_the_rank_that_did_not_connect(monkeypatch):
    """Without torchrun's shared store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), rank 0
    serves its attempt's store; a peer that never comes is named, not a store timeout."""
    with socket.socket() as holder:  # the port stays ours until the store listens on it
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        for name, value in {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
        with pytest.raises(WorldNotFormed, match=r": rank\(s\) 1 of 2 did not arrive "):
            join_rendezvous(0.5, COLLECTIVE)

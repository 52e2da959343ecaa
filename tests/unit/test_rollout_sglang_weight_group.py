"""The SGLang server client's process-group weight route against a fake SGLang server: an HTTP
server in this process whose "scheduler" is a subprocess that joins the gloo group for real, the
way SGLang's ``/init_weights_update_group`` does (torch's TCP rendezvous at the trainer's address,
the group's name as store prefix, torch's process-group constructor), and receives like SGLang's
``/update_weights_from_distributed``: every tensor the call names, broadcast from group rank 0,
then loads them all, or on any failure answers ``success: false`` and loads nothing.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.config import RolloutConfig
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.registry import build_engine
from bapo_megatron.rollout.sglang.server_client import SGLangServerClient
from bapo_megatron.rollout.weight_group import WeightGroupError

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0


def scheduler(connection) -> None:
    """The fake server's worker process: joins groups and receives updates as SGLang does."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    groups: dict = {}
    weights: dict = {}
    while True:
        command, request = connection.recv()
        if command == "stop":
            return
        if command == "weights":
            connection.send(weights)
            continue
        try:
            if command == "join":
                timeout = datetime.timedelta(seconds=TIMEOUT_S)
                url = f"tcp://{request['master_address']}:{request['master_port']}"
                rank = request["rank_offset"]
                store, rank, size = next(
                    dist.rendezvous(url, rank, request["world_size"], timeout=timeout)
                )
                store.set_timeout(timeout)
                group, _ = c10d._new_process_group_helper(
                    size,
                    rank,
                    [],
                    dist.Backend(request["backend"]),
                    dist.PrefixStore(request["group_name"], store),
                    group_name=request["group_name"],
                    timeout=timeout,
                )
                c10d._world.pg_group_ranks[group] = {i: i for i in range(size)}
                groups[request["group_name"]] = group
            else:  # receive
                received, handles = [], []
                for name, dtype, shape in zip(
                    request["names"], request["dtypes"], request["shapes"]
                ):
                    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                    group = groups[request["group_name"]]
                    handles.append(dist.broadcast(tensor, src=0, group=group, async_op=True))
                    received.append((name, tensor))
                for handle in handles:
                    handle.wait()
                weights = dict(received)  # loaded only once everything arrived
            connection.send((True, "ok"))
        except Exception as error:
            connection.send((False, f"{type(error).__name__}: {error}"))


class FakeSGLang:
    """The HTTP routes the process-group route uses, each recorded; ``refuse_next_update``
    makes the next ``/update_weights_from_distributed`` answer 400 without receiving."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, theirs = context.Pipe()
        self.worker = context.Process(target=scheduler, args=(theirs,), daemon=True)
        self.worker.start()
        self.requests: list[tuple[str, dict]] = []
        self.refuse_next_update = False
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def answer(self, status: int, body) -> None:
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                self.answer(200 if self.path == "/health" else 404, {})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                fake.requests.append((self.path, body))
                commands = {
                    "/init_weights_update_group": "join",
                    "/update_weights_from_distributed": "receive",
                }
                if self.path == "/flush_cache":
                    self.answer(200, {"success": True})
                elif self.path not in commands:
                    self.answer(404, {"detail": "Not Found"})
                elif self.path.startswith("/update") and fake.refuse_next_update:
                    fake.refuse_next_update = False
                    self.answer(400, {"success": False, "message": "refused by the test"})
                else:
                    success, message = fake.ask(commands[self.path], body)
                    self.answer(200 if success else 400, {"success": success, "message": message})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def ask(self, command: str, request=None):
        with self.lock:
            self.connection.send((command, request))
            return self.connection.recv()

    def weights(self) -> dict[str, torch.Tensor]:
        return self.ask("weights")

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def close(self) -> None:
        self.http.shutdown()
        self.ask_stop()

    def ask_stop(self) -> None:
        with self.lock:
            self.connection.send(("stop", None))
        self.worker.join(timeout=60)


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.close()


def client_of(fake: FakeSGLang) -> SGLangServerClient:
    return SGLangServerClient(
        fake.url, suite.MODEL, weight_transport="process-group", timeout=TIMEOUT_S
    )


def assert_holds(fake: FakeSGLang, weights: dict[str, torch.Tensor]) -> None:
    held = fake.weights()
    assert list(held) == list(weights)
    for name, tensor in weights.items():
        assert held[name].dtype == tensor.dtype and torch.equal(held[name], tensor), name


def test_sglang_server_receives_each_update_over_the_group_bitwise(fake):
    client = client_of(fake)
    first, second = suite.random_weights(1), suite.random_weights(2)
    client.update_weights(first.items(), version=1)
    assert_holds(fake, first)
    assert client.version == 1
    client.update_weights(second.items(), version=2)
    assert_holds(fake, second)
    # one group, then one receive call per update naming every tensor, then one cache flush
    assert fake.paths() == [
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/flush_cache",
        "/update_weights_from_distributed",
        "/flush_cache",
    ]
    join, update = fake.requests[0][1], fake.requests[3][1]
    assert join["rank_offset"] == 1 and join["world_size"] == 2 and join["backend"] == "gloo"
    assert join["master_address"] == "127.0.0.1" and join["group_name"].startswith("bapo-")
    assert update["names"] == list(second)
    assert update["dtypes"] == ["float32"] * len(second)
    assert update["shapes"] == [list(t.shape) for t in second.values()]
    assert update["group_name"] == join["group_name"]
    assert update["weight_version"] == "2" and update["flush_cache"] is False


def test_a_refused_update_names_the_server_and_the_next_one_builds_a_new_group(fake):
    client = client_of(fake)
    first, second = suite.random_weights(1), suite.random_weights(2)
    client.update_weights(first.items(), version=1)
    fake.refuse_next_update = True
    with pytest.raises(WeightGroupError, match=rf"^SGLang at {fake.url}: sending .*refused"):
        client.update_weights(second.items(), version=2)
    assert client.version == 1
    assert_holds(fake, first)
    client.update_weights(second.items(), version=3)
    assert_holds(fake, second)
    joins = [body["group_name"] for path, body in fake.requests if path.startswith("/init")]
    assert len(joins) == 2 and joins[0] != joins[1]


CUT_SENDER = """
import os, sys
import tests.unit.test_rollout_engines as suite
from bapo_megatron.rollout.sglang.server_client import SGLangServerClient
from bapo_megatron.rollout.weight_group import ServerWeightGroup

def first_then_die(self, tensors):
    options = __import__("torch").distributed.BroadcastOptions()
    options.rootRank = 0
    self.group.broadcast([tensors[0]], options).wait()
    os._exit(17)  # the trainer dies part-way through the update

ServerWeightGroup._broadcast = first_then_die
client = SGLangServerClient(sys.argv[1], suite.MODEL, weight_transport="process-group", timeout=120)
client.update_weights(suite.random_weights(2).items(), version=2)
"""


def test_a_broadcast_cut_off_part_way_leaves_the_server_on_its_previous_weights_and_it_rejoins(
    fake,
):
    first = suite.random_weights(1)
    client_of(fake).update_weights(first.items(), version=1)
    cut = subprocess.run(
        [sys.executable, "-c", CUT_SENDER, fake.url],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cut.returncode == 17, cut.stderr[-2000:]
    # the cut update was one call naming every tensor: the server received one, loaded none
    path, request = fake.requests[-1]
    assert path == "/update_weights_from_distributed"
    assert request["names"] == list(first)
    assert_holds(fake, first)
    # the server outlives its trainer: a restarted trainer's client (a new one, as in a new
    # process) builds a group of its own with it and updates it
    again = suite.random_weights(3)
    client_of(fake).update_weights(again.items(), version=3)
    assert_holds(fake, again)
    joins = [body["group_name"] for path, body in fake.requests if path.startswith("/init")]
    assert len(joins) == len(set(joins)) == 3


def test_a_server_url_that_does_not_answer_is_refused_at_startup():
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        refused_at_startup(url)


def refused_at_startup(url: str) -> None:
    rollout = RolloutConfig(engine="sglang-server", server_urls=(url,))
    with pytest.raises(
        EngineFailure,
        match=rf"^rollout engine 'sglang-server' of data-parallel replica 0 at {url} could "
        rf"not start: RuntimeError: SGLang server at {url} does not answer GET /health",
    ):
        build_engine(
            rollout, suite.MODEL, model_path=None, dp_rank=0, work_dir=Path("."), pad_token_id=0
        )

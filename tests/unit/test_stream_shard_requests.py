"""The shard-to-shard sync's requests across asynchronous training's links (real gloo groups
between threads of this process): the stream server answers them from its generating thread at a
boundary (between two tokens with ``continue``, once the paused samples returned with
``resume``, at once when idle). The transfer itself is stood in for by a receiver that writes
the version's weights into the embedded engine, so what the samples show is where the update
landed; generation is held at a chosen token until the request is queued, never by a race."""

from __future__ import annotations

import threading

import pytest

from bapo_megatron.disaggregated.stream_client import StreamingEngine
from bapo_megatron.disaggregated.stream_server import StreamServer
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.shard_receiver_protocol import ShardLayout
from tests.unit.test_disaggregated_links import TIMEOUT, messengers
from tests.unit.test_rollout_engines import MODEL, PROMPTS, random_weights
from tests.unit.test_stream_links import (
    NAME,
    PARAMS,
    WAIT_S,
    assert_resumed_under_version_2,
    local_samples,
)

LAYOUT = ShardLayout((), "float32", in_process=False, instance="stand-in")


class WritingReceiver:
    """Stands in for the engine's side of a transfer: receiving version ``v`` writes
    ``random_weights(request["seed"])`` into the engine as ``v``; records the forward passes
    done by then."""

    def __init__(self, engine: EmbeddedEngine, passes: list[int]) -> None:
        self.engine, self.passes = engine, passes
        self.received_at: list[int] = []
        self.threads: set[str] = set()

    def shard_layout(self, hf_shapes):
        self.threads.add(threading.current_thread().name)
        if not hf_shapes:
            raise ValueError("no tensors to lay out")
        return LAYOUT

    def join_transfer_group(self, request):
        self.threads.add(threading.current_thread().name)

    def receive_shards(self, request, *, version):
        self.threads.add(threading.current_thread().name)
        self.received_at.append(self.passes[0])
        self.engine.update_weights(random_weights(request["seed"]).items(), version=version)
        return [{"received_bytes": 0, "checksum": None}]

    def close(self):
        pass


class ShardStreamed:
    """A streaming client and a stream server (in a thread) with no stage broadcast: the
    weights come by shard requests only."""

    def __init__(self, inflight_update: str) -> None:
        requests, results = (messengers(p, 2) for p in ("requests", "results"))
        self.engine = EmbeddedEngine(MODEL)
        self.passes = [0]
        self.server = StreamServer(
            self.engine, requests[1], results[1], [], inflight_update=inflight_update
        )
        self.receiver = WritingReceiver(self.engine, self.passes)
        self.server.receiver = self.receiver
        self.loop = threading.Thread(target=self.server.serve, name="generating")
        self.loop.start()
        self.client = StreamingEngine(
            requests[0], results[0], weights=None, bucket_bytes=2**16, timeout=TIMEOUT, name=NAME
        )
        forward = self.engine.model.forward

        def counted(*args, **kwargs):
            self.passes[0] += 1
            return forward(*args, **kwargs)

        self.engine.model.forward = counted

    def receive(self, seed: int, version: int) -> list[dict]:
        return self.client.receive_shards({"timeout_s": WAIT_S, "seed": seed}, version=version)

    def hold_at_pass(self, index: int) -> threading.Event:
        """Make forward pass ``index`` (counted over the run) wait until a shard request is
        queued; the returned event is set when that pass is reached."""
        reached = threading.Event()
        forward, server = self.engine.model.forward, self.server

        def held(*args, **kwargs):
            if self.passes[0] + 1 == index:
                reached.set()
                with server._changed:
                    queued = server._changed.wait_for(lambda: server._shard_requests, WAIT_S)
                assert queued, "the shard request never arrived"
            return forward(*args, **kwargs)

        self.engine.model.forward = held
        return reached

    def close(self) -> None:
        self.client.close(WAIT_S)
        self.loop.join(timeout=WAIT_S)
        assert not self.loop.is_alive()


@pytest.fixture
def continuing():
    streamed = ShardStreamed("continue")
    yield streamed
    streamed.close()


def test_requests_are_answered_at_once_while_idle_and_failures_come_back_named(continuing):
    hf_shapes = {"model.norm.weight": (64,)}
    assert continuing.client.shard_layout(hf_shapes) == LAYOUT
    assert continuing.client.shard_layout(hf_shapes) == LAYOUT  # asked once, then kept
    continuing.client.join_transfer_group({"timeout_s": WAIT_S})
    assert continuing.receive(seed=1, version=1) == [{"received_bytes": 0, "checksum": None}]
    assert continuing.engine.version == continuing.client.version == 1
    assert continuing.receiver.threads == {"generating"}  # only that thread touches the engine
    with pytest.raises(EngineFailure, match=rf"{NAME} refused 'shard_layout': ValueError: no "):
        continuing.client.shard_layout({})


@pytest.mark.parametrize("held_pass", [2, 4])
def test_an_update_requested_mid_item_lands_between_two_tokens(continuing, held_pass):
    continuing.receive(seed=1, version=1)
    reached = continuing.hold_at_pass(held_pass)
    continuing.client.submit(0, PROMPTS, PARAMS)
    assert reached.wait(WAIT_S)
    continuing.receive(seed=2, version=2)  # returns once written, with generation in flight
    samples, stats = continuing.client.take(0)
    # the held pass (and those before it) sampled under version 1; the update landed right
    # after it, before the next token
    assert continuing.receiver.received_at == [0, held_pass]
    before = held_pass
    for sample in samples:
        assert sample.versions == [1] * before + [2] * (PARAMS.max_new_tokens - before)
    assert stats.loads == 2  # the idle one before the item started, and the one inside it
    old = local_samples(random_weights(1), PROMPTS, PARAMS)
    for sample, reference in zip(samples, old):
        assert sample.token_ids[:before] == reference.token_ids[:before]
        assert sample.logprobs[:before] == reference.logprobs[:before]


def test_resume_pauses_and_the_update_lands_before_the_samples_resume():
    streamed = ShardStreamed("resume")
    try:
        streamed.receive(seed=1, version=1)
        reached = streamed.hold_at_pass(3)
        streamed.client.submit(0, PROMPTS, PARAMS)
        assert reached.wait(WAIT_S)
        streamed.receive(seed=2, version=2)
        samples, _ = streamed.client.take(0)
    finally:
        streamed.close()
    # the held pass still samples under version 1 (the pause takes effect after it): a fresh
    # version-2 engine continues the version-1 prefix of 3 tokens with seed + 1
    assert streamed.receiver.received_at == [0, 3]
    assert_resumed_under_version_2(samples, prefix_tokens=3)


def test_a_request_after_the_engine_failed_raises_its_failure(continuing):
    continuing.client.submit(0, PROMPTS, PARAMS)  # no weights loaded yet: the engine refuses
    with pytest.raises(EngineFailure, match=rf"{NAME} failed: .*before a complete"):
        continuing.client.take(0)
    with pytest.raises(EngineFailure, match=rf"{NAME}: failed: .*before a complete"):
        continuing.receive(seed=1, version=1)

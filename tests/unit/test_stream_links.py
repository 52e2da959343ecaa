"""Asynchronous training's links on real gloo groups between threads of this process: the
trainer's streaming client against an engine rank's stream server with an embedded engine.
Generation is held at a chosen token (the model's forward waits) until a weight update has
arrived, so an update in flight happens at a known token, never by a race."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from bapo_megatron.disaggregated.local_link import serve_in_thread
from bapo_megatron.disaggregated.stream_client import StreamingEngine
from bapo_megatron.disaggregated.stream_server import StreamServer
from bapo_megatron.distributed.messages import PeerLost
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.weight_sync.stage_broadcast_wire import StageBroadcast
from tests.unit.test_disaggregated_links import TIMEOUT, CutStage, in_threads, messengers
from tests.unit.test_rollout_engines import MODEL, PROMPTS, random_weights

PARAMS = SamplingParams(n=2, max_new_tokens=6, seed=5)  # no stop token: every sample has 6
NAME = "rollout engine 'embedded' on engine rank 1"
WAIT_S = 60.0


class Streamed:
    """A streaming client and a stream server (in a thread) over fresh groups."""

    def __init__(self, inflight_update: str, timeout=TIMEOUT) -> None:
        requests, results, stage = (messengers(p, 2) for p in ("requests", "results", "weights"))
        self.engine = EmbeddedEngine(MODEL)
        self.server = StreamServer(
            self.engine,
            requests[1],
            results[1],
            [StageBroadcast(stage[1], 0)],
            inflight_update=inflight_update,
        )
        self.answered: list[int] = []
        self.loop = threading.Thread(target=lambda: self.answered.append(self.server.serve()))
        self.loop.start()
        self.client = StreamingEngine(
            requests[0],
            results[0],
            weights=StageBroadcast(stage[0], 0),
            bucket_bytes=2**16,
            timeout=timeout,
            name=NAME,
        )

    def hold_at_token(self, token: int, version: int) -> threading.Event:
        """Make the engine's ``token``-th forward pass (counted over the whole run) wait until
        weight ``version`` is staged; the returned event is set when that pass is reached."""
        reached = threading.Event()
        forward, calls = self.engine.model.forward, [0]

        def held(*args, **kwargs):
            calls[0] += 1
            if calls[0] == token:
                reached.set()
                assert self.server.wait_staged(version, WAIT_S), "the update never arrived"
            return forward(*args, **kwargs)

        self.engine.model.forward = held
        return reached

    def close(self) -> None:
        self.client.close(WAIT_S)
        self.loop.join(timeout=WAIT_S)
        assert not self.loop.is_alive()
        assert not self.client._receiver.is_alive()  # the engine's last message ended it


@pytest.fixture(params=["continue", "resume"])
def streamed(request):
    streamed = Streamed(request.param)
    yield streamed
    streamed.close()


def local_samples(weights, prompts, params):
    engine = EmbeddedEngine(MODEL)
    engine.update_weights(weights.items(), version=1)
    return engine.generate(prompts, params)


def test_admitted_items_come_back_as_a_local_engine_generates_them(streamed):
    client = streamed.client
    client.update_weights(random_weights(1).items(), version=1)
    second = dataclasses.replace(PARAMS, seed=6)
    client.submit(0, PROMPTS, PARAMS)
    client.submit(1, PROMPTS[:2], second)
    assert client.in_flight == 2
    taken = {item: client.take(item) for item in (1, 0)}  # taken in any order
    assert client.in_flight == 0
    for item, params, prompts in ((0, PARAMS, PROMPTS), (1, second, PROMPTS[:2])):
        samples, stats = taken[item]
        expected = local_samples(random_weights(1), prompts, params)
        assert [(s.token_ids, s.logprobs, s.versions) for s in samples] == [
            (s.token_ids, s.logprobs, s.versions) for s in expected
        ]
        assert stats.tokens == sum(len(s.token_ids) for s in samples)
    assert taken[0][1].loads == 1 and taken[1][1].loads == 0  # version 1 loaded before item 0
    with pytest.raises(ValueError, match="item 0 was never admitted"):
        client.take(0)


@pytest.mark.parametrize("held_token", [2, 4])
def test_an_update_in_flight_gives_samples_whose_tokens_carry_two_versions(streamed, held_token):
    client = streamed.client
    client.update_weights(random_weights(1).items(), version=1)
    reached = streamed.hold_at_token(held_token, version=2)
    client.submit(0, PROMPTS, PARAMS)
    assert reached.wait(WAIT_S)
    client.update_weights(random_weights(2).items(), version=2)
    samples, stats = client.take(0)
    before = held_token  # the held pass samples its token with version 1, the next ones with 2
    for sample in samples:
        assert sample.versions == [1] * before + [2] * (PARAMS.max_new_tokens - before)
    assert stats.loads == 2 and streamed.engine.version == 2
    old = local_samples(random_weights(1), PROMPTS, PARAMS)
    for sample, reference in zip(samples, old):  # the tokens before the update are version 1's
        assert sample.token_ids[:before] == reference.token_ids[:before]
        assert sample.logprobs[:before] == reference.logprobs[:before]


def test_resume_recomputes_the_prefix_under_the_new_weights():
    streamed = Streamed("resume")
    try:
        client = streamed.client
        client.update_weights(random_weights(1).items(), version=1)
        reached = streamed.hold_at_token(3, version=2)
        client.submit(0, PROMPTS, PARAMS)
        assert reached.wait(WAIT_S)
        client.update_weights(random_weights(2).items(), version=2)
        samples, _ = client.take(0)
    finally:
        streamed.close()
    assert_resumed_under_version_2(samples, prefix_tokens=3)


def assert_resumed_under_version_2(samples, prefix_tokens: int) -> None:
    """``samples`` are what a fresh engine holding version 2 continues (seed + 1) from the
    version-1 samples cut after ``prefix_tokens`` tokens."""
    prefix = local_samples(random_weights(1), PROMPTS, PARAMS)
    for sample in prefix:
        del sample.token_ids[prefix_tokens:], sample.logprobs[prefix_tokens:]
        del sample.versions[prefix_tokens:]
        sample.finish_reason = "paused"
    fresh = EmbeddedEngine(MODEL)
    fresh.update_weights(random_weights(2).items(), version=2)
    fresh.continue_generation(prefix, dataclasses.replace(PARAMS, seed=PARAMS.seed + 1))
    assert [(s.token_ids, s.logprobs, s.versions) for s in samples] == [
        (s.token_ids, s.logprobs, s.versions) for s in prefix
    ]


def test_an_engine_error_stops_the_trainer_naming_the_engine(streamed):
    streamed.client.submit(0, PROMPTS, PARAMS)  # no weights loaded yet: the engine refuses
    with pytest.raises(EngineFailure, match=rf"{NAME} failed: .*before a complete"):
        streamed.client.take(0)


def test_a_rollout_that_does_not_come_is_a_named_failure_within_the_deadline():
    streamed = Streamed("continue", timeout=TIMEOUT / 120)  # 0.5 s
    try:
        client = streamed.client
        client.update_weights(random_weights(1).items(), version=1)
        streamed.hold_at_token(1, version=99)  # held until the test ends: never comes
        client.submit(0, PROMPTS, PARAMS)
        with pytest.raises(EngineFailure, match=rf"{NAME}: no rollout of item 0 within 0\.5 s"):
            client.take(0)
    finally:
        with streamed.server._changed:  # release the held pass: stage the version it waits for
            streamed.server._staged = (99, list(random_weights(1).items()))
            streamed.server._changed.notify_all()
        streamed.close()


def test_a_refused_update_is_answered_and_the_old_weights_stay(streamed):
    client = streamed.client
    client.update_weights(random_weights(1).items(), version=1)
    client.submit(0, PROMPTS, PARAMS)
    client.take(0)  # version 1 loaded
    bad = {"model.no_such.weight": torch.zeros(2)}
    client.update_weights(bad.items(), version=2)
    client.submit(1, PROMPTS, PARAMS)
    with pytest.raises(EngineFailure, match="no_such.*is not a parameter"):
        client.take(1)
    assert streamed.engine.version == 1


def test_an_item_is_admitted_once():
    streamed = Streamed("continue")
    try:
        streamed.client.update_weights(random_weights(1).items(), version=1)
        streamed.client.submit(0, PROMPTS, PARAMS)
        with pytest.raises(ValueError, match="rollout item 0 was already admitted"):
            streamed.client.submit(0, PROMPTS, PARAMS)
        streamed.client.take(0)
    finally:
        streamed.close()


def test_a_server_engine_is_driven_from_a_thread_of_the_trainer_rank():
    # servers have no rank: the same stream server runs in a thread, over in-process links
    engine = EmbeddedEngine(MODEL)  # stands in for a server client: any engine of the protocol
    client = serve_in_thread(engine, inflight_update="resume", timeout=TIMEOUT, name=NAME)
    try:
        client.update_weights(random_weights(1).items(), version=1)
        client.submit(0, PROMPTS, PARAMS)
        samples, stats = client.take(0)
        expected = local_samples(random_weights(1), PROMPTS, PARAMS)
        assert [(s.token_ids, s.logprobs) for s in samples] == [
            (s.token_ids, s.logprobs) for s in expected
        ]
        assert stats.loads == 1 and client.weights.sent_bytes > 0
        client.update_weights(random_weights(2).items(), version=2)
        client.submit(1, PROMPTS, PARAMS)
        samples, _ = client.take(1)
        assert all(s.versions == [2] * len(s.token_ids) for s in samples)
    finally:
        client.close(WAIT_S)
    assert not client._receiver.is_alive()


def test_a_broadcast_cut_off_part_way_stops_the_engine_on_its_previous_version():
    requests, results = messengers("requests", 2), messengers("results", 2)
    engine = EmbeddedEngine(MODEL)
    engine.update_weights(random_weights(1).items(), version=1)
    before = {name: p.clone() for name, p in engine.model.named_parameters()}
    name, tensor = next(iter(random_weights(2).items()))
    server = StreamServer(
        engine,
        requests[1],
        results[1],
        [StageBroadcast(CutStage(name, tensor), 0)],
        inflight_update="continue",
    )
    with pytest.raises(PeerLost, match="trainer rank 0"):
        in_threads(lambda: requests[0].send(("update_weights", 2), 1), server.serve)
    assert engine.version == 1
    for key, parameter in engine.model.named_parameters():
        assert torch.equal(parameter, before[key]), key

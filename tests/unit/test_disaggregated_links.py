"""The links of a disaggregated run, on real gloo groups between threads of this process (each
thread one member): messages and their deadlines, the per-stage weight broadcast, and the engine
client against the serving loop with an embedded engine. A sender cut off part-way is a scripted
stand-in for the stage's messenger."""

from __future__ import annotations

import datetime
import pickle
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from bapo_megatron.disaggregated.client import RemoteEngine
from bapo_megatron.disaggregated.server import serve
from bapo_megatron.disaggregated.world import weight_backend
from bapo_megatron.distributed.messages import FRAME_BYTES, GroupMessenger, PeerLost, gloo_group
from bapo_megatron.rollout.checksum import checksum
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.guard import EngineFailure, GuardedEngine
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.weight_sync.stage_broadcast_wire import StageBroadcast
from tests.unit.test_rollout_engines import MODEL, PROMPTS, random_weights

TIMEOUT = datetime.timedelta(seconds=60)
PARAMS = SamplingParams(n=2, max_new_tokens=6, seed=5)


def in_threads(*calls: Callable[[], object]) -> list[object]:
    """Run ``calls`` at once, one thread each; their results, or the first error raised."""
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def messengers(prefix: str, size: int, store=None) -> list[GroupMessenger]:
    """A group of ``size`` members (one per rank), built together."""
    store = store or torch.distributed.HashStore()
    groups = in_threads(
        *(lambda r=r: gloo_group(store, prefix, r, size, TIMEOUT) for r in range(size))
    )
    names = [f"member {r}" for r in range(size)]
    return [GroupMessenger(g, names=names, timeout=TIMEOUT, what=prefix) for g in groups]


def test_objects_travel_both_ways_and_a_silent_peer_is_named():
    a, b = messengers("pair", 2)
    sent = {"prompts": [[1, 2]], "params": PARAMS}
    _, got = in_threads(lambda: a.send(sent, 1), lambda: b.recv(0))
    assert got == sent
    with pytest.raises(PeerLost, match=r"pair: waiting for member 0: no answer within 0\.2 s"):
        b.recv(0, timeout=datetime.timedelta(seconds=0.2))


def pickled_to(size: int) -> bytes:
    """A bytes object whose pickle is exactly ``size`` bytes long."""
    obj = b""
    while len(pickle.dumps(obj)) < size:
        obj += b"x"
    assert len(pickle.dumps(obj)) == size
    return obj


@pytest.mark.parametrize("size", [FRAME_BYTES - 9, FRAME_BYTES - 8, FRAME_BYTES - 7, 50_000])
def test_objects_either_side_of_the_first_frame_arrive_whole(size):
    obj = pickled_to(size)
    a, b = messengers("pair", 2)
    _, got = in_threads(lambda: a.send(obj, 1), lambda: b.recv(0))
    three = messengers("three", 3)
    results = in_threads(
        lambda: three[0].broadcast_object(obj, 0),
        *(lambda m=m: m.broadcast_object(None, 0) for m in three[1:]),
    )
    assert got == obj and results == [obj] * 3
    # the messenger stays in step: the next object after it arrives too
    _, after = in_threads(lambda: a.send({"next": 1}, 1), lambda: b.recv(0))
    assert after == {"next": 1}


def test_a_stage_reaches_every_engine_in_bounded_buckets_in_the_wire_dtype():
    sender, *engines = (StageBroadcast(m, 1) for m in messengers("stage", 3))
    weights = random_weights(0)
    bucket = 4 * 64 * 64  # bytes: a few small tensors per bucket, the embedding alone
    results = in_threads(
        lambda: sender.send(
            weights.items(), version=3, bucket_bytes=bucket, wire_dtype=torch.bfloat16
        ),
        *(engine.receive for engine in engines),
    )
    sent_bytes = results[0]
    assert sent_bytes == sum(t.numel() * 2 for t in weights.values())
    for received, version in results[1:]:
        assert version == 3
        assert [name for name, _ in received] == list(weights)
        for name, tensor in received:
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, weights[name].to(torch.bfloat16))


class CutStage:
    """A stage messenger whose sender goes away after its first bucket."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        header = {"end": False, "dtype": tensor.dtype, "tensors": [(name, tuple(tensor.shape))]}
        self.objects, self.tensors = [header], [tensor.reshape(-1)]

    def broadcast_object(self, obj, root):
        if not self.objects:
            raise PeerLost("weights of pipeline stage 0: broadcasting with trainer rank 0: gone")
        return self.objects.pop(0)

    def broadcast_tensor(self, tensor, root):
        tensor.copy_(self.tensors.pop(0))


@pytest.fixture
def served():
    """A remote engine client (its own stage-0 broadcast) and the serving loop of an embedded
    engine, in a thread; yields (guarded client, engine); stops the loop after the test."""
    requests = messengers("requests", 2)
    stage = messengers("weights", 2)
    engine = EmbeddedEngine(MODEL)
    box: list[object] = []
    loop = threading.Thread(
        target=lambda: box.append(serve(engine, requests[1], [StageBroadcast(stage[1], 0)]))
    )
    loop.start()
    client = RemoteEngine(
        requests[0],
        weights=StageBroadcast(stage[0], 0),
        bucket_bytes=2**16,
        generation_timeout=TIMEOUT,
    )
    guarded = GuardedEngine(client, name="rollout engine 'embedded' on engine rank 1")
    yield guarded, engine
    client.close()
    loop.join(timeout=60)
    assert box and not loop.is_alive()  # the loop answered its requests, then stopped


def test_the_client_drives_the_engine_rank_like_a_local_engine(served):
    client, engine = served
    weights = random_weights(1)
    loaded = client.update_weights(weights.items(), version=4, checksum=True)
    assert loaded == checksum(weights.items())
    assert client.version == engine.version == 4 and client.health()
    local = EmbeddedEngine(MODEL)
    local.update_weights(weights.items(), version=4)
    remote = client.generate(PROMPTS, PARAMS, round_tokens=3)
    expected = local.generate(PROMPTS, PARAMS, round_tokens=3)
    assert [(s.token_ids, s.logprobs, s.versions) for s in remote] == [
        (s.token_ids, s.logprobs, s.versions) for s in expected
    ]
    # continued in place on the caller's objects, as a local engine does
    client.continue_generation(remote, PARAMS)
    local.continue_generation(expected, PARAMS)
    assert [(s.token_ids, s.finish_reason) for s in remote] == [
        (s.token_ids, s.finish_reason) for s in expected
    ]


def test_nothing_generated_under_one_version_is_reused_under_the_next(served):
    client, _ = served
    client.update_weights(random_weights(1).items(), version=1)
    first = client.generate(PROMPTS, PARAMS)
    client.update_weights(random_weights(2).items(), version=2)
    second = client.generate(PROMPTS, PARAMS)
    fresh = EmbeddedEngine(MODEL)
    fresh.update_weights(random_weights(2).items(), version=2)
    expected = fresh.generate(PROMPTS, PARAMS)
    assert [s.logprobs for s in second] == [s.logprobs for s in expected]
    assert [s.logprobs for s in second] != [s.logprobs for s in first]
    assert all(s.versions == [2] * len(s.token_ids) for s in second)


def test_an_engine_error_reaches_the_trainer_named_and_the_engine_serves_on(served):
    client, engine = served
    with pytest.raises(EngineFailure, match=r"engine rank 1: generate failed: .*before a complete"):
        client.generate(PROMPTS, PARAMS)  # no weights yet
    bad = {"model.no_such.weight": torch.zeros(2)}
    with pytest.raises(EngineFailure, match="no_such.*is not a parameter"):
        client.update_weights(bad.items(), version=1)
    assert engine.version == -1
    client.update_weights(random_weights(1).items(), version=1)
    assert len(client.generate(PROMPTS, PARAMS)) == len(PROMPTS) * PARAMS.n


def test_a_broadcast_cut_off_part_way_leaves_the_previous_complete_version():
    requests = messengers("requests", 2)
    engine = EmbeddedEngine(MODEL)
    engine.update_weights(random_weights(1).items(), version=1)
    before = {name: p.clone() for name, p in engine.model.named_parameters()}
    name, tensor = next(iter(random_weights(2).items()))
    cut = StageBroadcast(CutStage(name, tensor), 0)
    with pytest.raises(PeerLost, match="trainer rank 0"):
        in_threads(
            lambda: requests[0].send(("update_weights", 2, False), 1),
            lambda: serve(engine, requests[1], [cut]),
        )
    assert engine.version == 1
    for key, parameter in engine.model.named_parameters():
        assert torch.equal(parameter, before[key]), key


def test_only_replica_zero_sends_tensors():
    requests = messengers("requests", 2)
    client = RemoteEngine(requests[0], weights=None, bucket_bytes=2**16, generation_timeout=TIMEOUT)
    received = []
    with pytest.raises(ValueError, match="only data-parallel replica 0 sends tensors"):
        in_threads(
            lambda: client.update_weights(random_weights(1).items(), version=1),
            lambda: received.append(requests[1].recv(0)),
        )
    assert received == [("update_weights", 1, False)]


def test_buffers_on_a_group_of_their_own_arrive_as_on_one_group():
    # the NCCL layout (headers on gloo, buffers on a second group), with gloo for both here
    headers, buffers = messengers("stage", 3), messengers("stage-data", 3)
    sender, *engines = (StageBroadcast(h, 0, data=b) for h, b in zip(headers, buffers))
    weights = random_weights(3)
    results = in_threads(
        lambda: sender.send(weights.items(), version=2, bucket_bytes=4 * 64 * 64),
        *(engine.receive for engine in engines),
    )
    for received, version in results[1:]:
        assert version == 2 and [n for n, _ in received] == list(weights)
        for name, tensor in received:
            assert torch.equal(tensor, weights[name])


def test_the_sender_chooses_the_buffers_backend_and_the_engines_follow():
    store = torch.distributed.HashStore()
    trainer = SimpleNamespace(is_engine=False, store=store, rank=0)
    engine = SimpleNamespace(is_engine=True, store=store, rank=2)
    assert weight_backend(trainer, 1, "cpu") == "gloo"  # a CPU run, whatever the machine has
    assert weight_backend(engine, 1, "cpu") == "gloo"
    store.set("bapo/weights/stage0/backend", "nccl")  # a sender with a GPU
    with pytest.raises(ValueError, match=r"stage 0 .* over NCCL .* engine rank 2 has no GPU"):
        weight_backend(engine, 0, "cpu")

"""An in-process engine over several devices, without vLLM: the head rule checked before any
worker starts, the thread binding and GPUs its workers get, a worker that ends, the agreement of
the workers' checksums, and the configuration's refusals. (The real vLLM at tensor parallel 2:
the vLLM tier, tests/vllm/test_rollout_vllm_engine.py.)"""

from __future__ import annotations

import dataclasses
import types

import pytest

import tests.unit.test_rollout_engines as suite
from bapo_megatron.config import ModelConfig, check_training, load_config
from bapo_megatron.config.checks import check_engine_heads, check_model
from bapo_megatron.rollout.checksum import agreed_checksum, checksum
from bapo_megatron.rollout.vllm import engine_worker_gpus
from bapo_megatron.rollout.vllm import tensor_parallel as tp_module
from bapo_megatron.rollout.vllm.engine import VLLMEngine
from bapo_megatron.rollout.vllm.tensor_parallel import (
    THREADS_BIND,
    WorkerFailure,
    cpu_thread_binding,
    dead_workers,
    executor_backend,
    failed_workers_error,
    start_failure,
    visible_to_workers,
    worker_gpus,
)
from tests.helpers.fake_vllm import FakeLLM
from tests.unit.test_config import TRAINABLE


def model_with(heads: int, kv_heads: int) -> ModelConfig:
    """A model of those head counts (64-wide heads, as the rule reads only the counts)."""
    return dataclasses.replace(
        suite.MODEL,
        hidden_size=64 * heads,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        head_dim=None,
    )


def splits_over(heads: int, kv_heads: int, tp: int) -> bool:
    """The rule written as the assignment it allows: every worker gets heads / tp query heads
    and whole key/value heads, each key/value head on tp / kv_heads workers when they are fewer
    than the workers, and the query heads of a group stay with its key/value head."""
    if heads % tp:
        return False
    per_worker = [range(w * heads // tp, (w + 1) * heads // tp) for w in range(tp)]
    group = heads // kv_heads
    if kv_heads >= tp:
        return kv_heads % tp == 0 and all(len(q) % group == 0 for q in per_worker)
    if tp % kv_heads:
        return False
    return all(len({h // group for h in q}) == 1 for q in per_worker)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("heads,kv_heads", [(2, 1), (4, 2), (4, 4), (8, 2), (12, 4), (40, 8)])
def test_the_head_rule_is_the_split_it_allows(heads, kv_heads, tp):
    model = model_with(heads, kv_heads)
    if splits_over(heads, kv_heads, tp):
        check_engine_heads(model, tp)
    else:
        with pytest.raises(ValueError, match=rf"rollout.engine_tensor_parallel_size={tp} must"):
            check_engine_heads(model, tp)


def test_the_run_checks_the_engine_size_against_the_model_and_the_engine_kind():
    with pytest.raises(ValueError, match="rollout.engine='embedded' runs in one process"):
        check_training(load_config(None, [*TRAINABLE, "rollout.engine_tensor_parallel_size=2"]))
    cfg = load_config(
        None, [*TRAINABLE, "rollout.engine=vllm", "rollout.engine_tensor_parallel_size=2"]
    )
    check_training(cfg)  # the model section's 4 heads in 2 groups split over 2 workers
    check_model(cfg, model_with(4, 1))  # one key/value head, replicated
    with pytest.raises(ValueError, match="=2 must divide the model's 3 attention heads"):
        check_model(cfg, model_with(3, 1))
    too_many = [*TRAINABLE, "rollout.engine=vllm", "rollout.engine_tensor_parallel_size=8"]
    with pytest.raises(ValueError, match="=8 must divide the model's 4 attention heads"):
        check_training(load_config(None, too_many))


def test_one_worker_runs_in_process_and_several_in_processes_of_their_own():
    assert executor_backend(1) == "uni" and executor_backend(2) == executor_backend(8) == "mp"
    # beside a trainer world of several ranks the one worker gets a process of its own
    assert executor_backend(1, world_size=2) == "mp"


def test_thread_binding_starts_on_a_host_with_fewer_numa_nodes_than_workers(monkeypatch):
    monkeypatch.setattr(tp_module, "numa_nodes", lambda: 1)
    env: dict[str, str] = {}
    assert cpu_thread_binding(1, env) is None and env == {}
    assert cpu_thread_binding(2, env) == "nobind" and env == {THREADS_BIND: "nobind"}
    mine = {THREADS_BIND: "0-3|4-7"}
    assert cpu_thread_binding(2, mine) is None and mine == {THREADS_BIND: "0-3|4-7"}
    monkeypatch.setattr(tp_module, "numa_nodes", lambda: 2)
    env = {}
    assert cpu_thread_binding(2, env) is None and env == {}  # vLLM's own binding fits


def test_workers_take_the_nodes_gpus_from_the_ranks_own():
    assert worker_gpus(0, 4, None, "f") == "0,1,2,3"
    assert worker_gpus(4, 4, None, "f") == "4,5,6,7"
    assert worker_gpus(1, 2, "3,5,6,7", "f") == "5,6"
    with pytest.raises(ValueError, match=r"f=4 needs GPUs 6..9 .*shows 8"):
        worker_gpus(6, 4, "0,1,2,3,4,5,6,7", "f")
    assert engine_worker_gpus("cpu", 4) is None and engine_worker_gpus("cuda:0", 1) is None


def test_visible_devices_change_only_inside_the_block():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    with visible_to_workers("2,3", env):
        assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env = {}
    with pytest.raises(RuntimeError), visible_to_workers("1", env):
        raise RuntimeError("the engine did not start")
    assert env == {}
    with visible_to_workers(None, env):
        assert env == {}


def executor_llm(*exit_codes):
    """A stand-in ``vllm.LLM`` whose multiprocess executor has workers with these exit codes
    (None: running)."""
    workers = [
        types.SimpleNamespace(
            proc=types.SimpleNamespace(name=f"VllmWorker-{rank}", pid=100 + rank, exitcode=code)
        )
        for rank, code in enumerate(exit_codes)
    ]
    executor = types.SimpleNamespace(
        workers=workers, is_failed=any(c is not None for c in exit_codes)
    )
    core = types.SimpleNamespace(engine_core=types.SimpleNamespace(model_executor=executor))
    return types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=core))


def test_a_worker_that_ended_is_named():
    assert dead_workers(executor_llm(None, None)) == []
    assert failed_workers_error(executor_llm(None, None), "x", RuntimeError("y")) is None
    llm = executor_llm(None, -9)
    assert dead_workers(llm) == ["VllmWorker-1 (pid 101, exit code -9)"]
    error = failed_workers_error(llm, "loading weights", RuntimeError("cancelled"))
    assert isinstance(error, WorkerFailure)
    assert "VllmWorker-1 (pid 101, exit code -9) ended while loading weights" in str(error)
    assert "RuntimeError: cancelled" in str(error)
    assert "(VllmWorker-0, VllmWorker-1, VllmWorker-2) failed to start" in str(
        start_failure(3, Exception("WorkerProc initialization failed"))
    )


def test_the_step_loop_names_a_worker_that_ended_and_stops_serving(fake_vllm):  # noqa: F811
    llm = FakeLLM()
    engine = VLLMEngine(llm, suite.MODEL, version=0)

    def step():
        llm.llm_engine.engine_core = executor_llm(None, -9).llm_engine.engine_core
        raise RuntimeError("cancelled")

    llm.llm_engine.step = step
    with pytest.raises(WorkerFailure, match=r"VllmWorker-1 .* ended while generating"):
        engine.generate([[1, 2]], suite.SamplingParams(max_new_tokens=3))
    assert not engine.health()
    assert llm.llm_engine.aborted == []  # nothing is sent to an executor that is gone


def test_every_worker_must_report_the_bytes_sent(fake_vllm):  # noqa: F811
    weights = suite.random_weights(0)
    sent = checksum(weights.items())
    assert agreed_checksum([{"checksum": sent}] * 2, sent, "e") == sent
    with pytest.raises(RuntimeError, match=r"e: workers \[1\] of 2 loaded other bytes"):
        agreed_checksum([{"checksum": sent}, {"checksum": "0" * 64}], sent, "e")
    with pytest.raises(RuntimeError, match="reported no checksum"):
        agreed_checksum([{"checksum": sent}, {"loaded": 3}], sent, "e")

    llm = FakeLLM()
    llm.workers = 2
    engine = VLLMEngine(llm, suite.MODEL, version=0)
    assert engine.update_weights(weights.items(), version=1, checksum=True) == sent
    reports = llm.collective_rpc

    def one_worker_loads_other_bytes(method, args=()):
        answers = reports(method, args)
        if method == "bapo_load_weights":
            answers[1] = {**answers[1], "checksum": "f" * 64}
        return answers

    llm.collective_rpc = one_worker_loads_other_bytes
    with pytest.raises(RuntimeError, match=r"vLLM: workers \[1\] of 2 loaded other bytes"):
        engine.update_weights(weights.items(), version=2, checksum=True)
    assert engine.version == 1

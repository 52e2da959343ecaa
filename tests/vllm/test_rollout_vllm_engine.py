"""The rollout conformance suite (tests/unit/test_rollout_engines.py) against a real in-process
``vllm.LLM`` at tensor-parallel sizes 1 and 2 (against a real vLLM server:
test_rollout_vllm_server.py).

The suite's model has head size 16, which vLLM's CPU attention refuses (it wants 32, 64, 80,
...). Rather than change the suite's model for every engine, this file runs the suite's own test
functions with its module-level ``MODEL`` swapped for a same-shaped model of head size 32
(``VLLM_MODEL``, tests/helpers/vllm_models.py); everything else in those tests is unchanged.
The central check, behaviour log-probs equal to a teacher-forced recompute, also runs on the
Qwen3 and Llama 3.x families (``VLLM_FAMILIES``), each vLLM started on a folder transformers
saved."""

import logging
import os
import signal
import threading

import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.vllm.engine import (
    VLLMEngine,
)
from bapo_megatron.rollout.vllm.tensor_parallel import WorkerFailure, executor_of
from tests.helpers import hf_models
from tests.helpers.vllm_models import (
    TENSOR_PARALLEL,
    VLLM_FAMILIES,
    VLLM_MODEL,
    long_seeded_continuations,
)
from tests.helpers.vllm_shard_checks import check_engine_shard_maps, in_place_modules

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_engines(tmp_path_factory):
    """In-process vLLMs on one folder of VLLM_MODEL, by tensor-parallel size, each started when
    a test first asks for it and kept for the module (a start takes seconds, more at TP 2)."""
    folder = tmp_path_factory.mktemp("vllm-model")
    torch.manual_seed(0)
    EmbeddedEngine(VLLM_MODEL).model.save_pretrained(folder)
    engines: dict[int, VLLMEngine] = {}
    threads: dict[int, tuple[int, int]] = {}

    def engine_at(tensor_parallel_size: int) -> VLLMEngine:
        if tensor_parallel_size not in engines:
            # started as in a process without OMP_NUM_THREADS, where vLLM lowers the torch
            # threads of the process it starts in: the count before and after is kept
            unset = os.environ.pop("OMP_NUM_THREADS", None)
            before = torch.get_num_threads()
            try:
                engines[tensor_parallel_size] = VLLMEngine.from_pretrained(
                    folder, enforce_eager=True, tensor_parallel_size=tensor_parallel_size
                )
            finally:
                if unset is not None:
                    os.environ["OMP_NUM_THREADS"] = unset
            threads[tensor_parallel_size] = (before, torch.get_num_threads())
        return engines[tensor_parallel_size]

    engine_at.threads = threads
    yield engine_at
    for engine in engines.values():
        engine.close()


def suite_factory(engine: VLLMEngine):
    """The suite's ``make_engine``: loads the given weights into ``engine`` (checking that every
    worker loaded the bytes sent) and hands it over."""

    def make_engine(weights):
        engine.resume()
        engine.resume_memory()
        engine.update_weights(weights.items(), version=0, checksum=True)
        return engine

    return make_engine


@pytest.fixture(params=TENSOR_PARALLEL, ids=lambda tp: f"tp{tp}")
def vllm_suite(request, vllm_engines, monkeypatch):
    """The suite's test functions with their model swapped for VLLM_MODEL, and a factory that
    loads the given weights into the shared engine of each size."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
    return suite_factory(vllm_engines(request.param))


@pytest.fixture(scope="module")
def vllm_family_engines(tmp_path_factory):
    """Starts one in-process vLLM per family of VLLM_FAMILIES and size, on a folder transformers
    saved (seed 100: the tests load other weights), when a test first asks for it; each is kept
    for the module."""
    engines: dict[tuple[str, int], VLLMEngine] = {}
    probes: dict[tuple[str, int], object] = {}

    def engine_for(variant: str, tensor_parallel_size: int) -> VLLMEngine:
        key = (variant, tensor_parallel_size)
        if key not in engines:
            folder = tmp_path_factory.mktemp(variant)
            hf_models.save_hf_folder(folder, variant, seed=100, **VLLM_FAMILIES[variant])
            engines[key] = VLLMEngine.from_pretrained(
                folder, enforce_eager=True, tensor_parallel_size=tensor_parallel_size
            )
            # the shard-map probe runs once per engine start, before any in-place reload
            try:
                probes[key] = check_engine_shard_maps(engines[key], tensor_parallel_size)
            except AssertionError as failure:
                probes[key] = failure
        return engines[key]

    engine_for.probes = probes
    yield engine_for
    for engine in engines.values():
        engine.close()


@pytest.fixture(
    params=[(variant, tp) for variant in ("qwen2", *VLLM_FAMILIES) for tp in TENSOR_PARALLEL],
    ids=lambda param: f"{param[0]}-tp{param[1]}",
)
def vllm_family_suite(request, monkeypatch, tmp_path, vllm_engines):
    """:func:`vllm_suite` for each family and size: VLLM_MODEL's shared engines for qwen2; for
    the others the family's engine, with the suite's ``MODEL`` the config that engine read from
    its folder (so the suite's teacher-forced recompute is the embedded engine's, i.e.
    transformers', on that family) and the suite's ``random_weights(seed)`` the HF tensors
    transformers saves for the family with that seed (random norms included, so a dropped or
    swapped q/k norm shows)."""
    variant, tensor_parallel_size = request.param
    if variant == "qwen2":
        monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
        return suite_factory(vllm_engines(tensor_parallel_size))
    engine = request.getfixturevalue("vllm_family_engines")(variant, tensor_parallel_size)
    monkeypatch.setattr(suite, "MODEL", engine.model_config)

    def random_weights(seed: int) -> dict[str, torch.Tensor]:
        folder = tmp_path / f"seed-{seed}"
        hf_models.save_hf_folder(folder, variant, seed=seed, **VLLM_FAMILIES[variant])
        return hf_models.read_hf_tensors(folder)

    monkeypatch.setattr(suite, "random_weights", random_weights)
    return suite_factory(engine)


def test_vllm_logprobs_match_a_teacher_forced_recompute(vllm_family_suite):
    suite.test_logprobs_match_a_teacher_forced_recompute(vllm_family_suite)


@pytest.mark.parametrize("tp", TENSOR_PARALLEL, ids=lambda tp: f"tp{tp}")
@pytest.mark.parametrize("variant", sorted(VLLM_FAMILIES))
def test_vllm_family_shard_maps_equal_what_vllms_loaders_do(vllm_family_engines, variant, tp):
    """Each worker's shard map read off vLLM's own loaders equals the described one
    (tests/helpers/vllm_shard_checks.py), probed on the family engines of the log-prob check as
    each started."""
    vllm_family_engines(variant, tp)
    outcome = vllm_family_engines.probes[(variant, tp)]
    if isinstance(outcome, AssertionError):
        raise outcome
    assert len(outcome) == tp


def test_vllm_layers_written_in_place_are_those_whose_processing_keeps_them(
    vllm_family_engines, tmp_path
):
    """Shard to shard, a layer is written where it lives, then processed again, when vLLM's
    post-load processing keeps its checkpoint-format parameters where they are: the norms (no
    processing), and the embedding and output layers (vLLM's CPU build packs a copy beside the
    weight; on CUDA their processing does nothing). vLLM's CPU packing drops a linear layer's
    weight, so linear layers are taken apart and put together."""
    engine = vllm_family_engines("qwen3-untied", 1)
    hf_models.save_hf_folder(tmp_path, "qwen3-untied", seed=3, **VLLM_FAMILIES["qwen3-untied"])
    weights = hf_models.read_hf_tensors(tmp_path)
    engine.update_weights(weights.items(), version=1)  # judged after an in-place reload
    in_place = in_place_modules(engine)
    norms = {name for name in in_place if name.endswith("norm")}
    assert in_place - norms == {"model.embed_tokens", "lm_head"}
    assert {
        "model.norm",
        "model.layers.0.self_attn.k_norm",
        "model.layers.1.input_layernorm",
    } <= norms
    layer = "model.layers.0"
    assert not in_place & {f"{layer}.self_attn.qkv_proj", f"{layer}.mlp.gate_up_proj"}


def test_vllm_updates_of_a_tied_model_log_no_warning(vllm_family_engines, tmp_path):
    """vLLM's in-place reload warned on every update "ParallelLMHead: Failed to load weights"
    (the tied output layer, which a tied checkpoint does not hold) and "RotaryEmbedding: ..."
    (its non-persistent cache), until the worker told it which tensors never come
    (bapo_megatron/rollout/vllm/reload_expectations.py). Its loggers, read in this process (the
    one worker of TP 1 lives here), must log no warning during an update; the log-prob check on
    the same family (test_vllm_logprobs_match_a_teacher_forced_recompute) checks the weights."""
    engine = vllm_family_engines("llama32-tied", 1)
    hf_models.save_hf_folder(tmp_path, "llama32-tied", seed=5, **VLLM_FAMILIES["llama32-tied"])
    weights = hf_models.read_hf_tensors(tmp_path)
    assert "lm_head.weight" not in weights  # what a tied checkpoint, and the trainer, send
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload")
    reload_logger.addHandler(handler)
    try:
        engine.update_weights(weights.items(), version=1)
    finally:
        reload_logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == []


@pytest.mark.parametrize("tp", TENSOR_PARALLEL, ids=lambda tp: f"tp{tp}")
def test_vllm_qwen2_shard_maps_equal_what_vllms_loaders_do(vllm_engines, tp):
    """The same on the module's Qwen2 engines (q/k/v bias, tied, one key/value head that both
    workers of TP 2 hold), probed whenever this runs: after in-place reloads too."""
    assert len(check_engine_shard_maps(vllm_engines(tp), tp)) == tp


def test_vllm_stop_tokens_seed_and_n(vllm_suite):
    suite.test_stop_tokens_seed_and_n(vllm_suite)


def test_vllm_partial_rollout_keeps_each_tokens_version_and_logprob(vllm_suite):
    suite.test_partial_rollout_keeps_each_tokens_version_and_logprob(vllm_suite)


# Six requests of 1500+ tokens: more prompt tokens than one step of vLLM takes by default
# (max_num_batched_tokens 4096 in process, 2048 for a server), so a vLLM that prefills in chunks
# splits them, and on CPU its worker then crashes on the seeded requests' generators
# ("CPU Generator does not use offset"; see bapo_megatron/rollout/vllm/engine.py).


def test_vllm_long_seeded_continuations_run_and_repeat(vllm_suite):
    engine = vllm_suite(suite.random_weights(10))
    assert not engine.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill
    long_seeded_continuations(vllm_suite)


def after_first_vllm_tokens(engine, samples, action):
    """The suite's ``after_first_tokens`` for the in-process engine: wraps ``llm_engine.step``
    until every one of the call's ``samples`` requests has output a token, then runs ``action``
    on another thread and waits for it; the step loop sees it before its next step."""
    llm_engine = engine.llm.llm_engine
    step, seen = llm_engine.step, set()

    def first_steps():
        outputs = step()
        seen.update(o.request_id for o in outputs if o.outputs[0].token_ids)
        if len(seen) >= samples:
            del llm_engine.step  # back to the class's own
            caller = threading.Thread(target=action)
            caller.start()
            caller.join()
        return outputs

    llm_engine.step = first_steps


def test_vllm_abort_and_pause_from_another_thread(vllm_suite, monkeypatch):
    monkeypatch.setattr(suite, "after_first_tokens", after_first_vllm_tokens)
    suite.test_abort_and_pause_from_another_thread(vllm_suite)


def test_vllm_weight_updates_are_checked_and_memory_can_be_released(vllm_suite):
    suite.test_weight_updates_are_checked_and_memory_can_be_released(vllm_suite)


def test_vllm_refuses_bad_prompts(vllm_suite):
    engine = vllm_suite(suite.random_weights(6))
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 128\)"):
        engine.generate([[1, 500]], SamplingParams())


def test_vllm_logprobs_are_full_vocabulary_under_top_k(vllm_suite):
    """With top-k 3, vLLM's own processed_logprobs would be renormalized over 3 tokens (each
    >= log 1/3 ... summing to 1); the hook reports the full-vocabulary ones."""
    weights = suite.random_weights(8)
    engine = vllm_suite(weights)
    params = SamplingParams(n=4, top_k=3, max_new_tokens=6, seed=2)
    for sample in engine.generate(suite.PROMPTS, params):
        torch.testing.assert_close(
            torch.tensor(sample.logprobs, dtype=torch.float64),
            suite.teacher_forced(weights, sample, 1.0),
            rtol=0,
            atol=2e-5,
        )


# ------------------------------------------------------------- tensor parallel 2 (optional tier)

# float32 tolerance between the two sizes: at TP 2 each worker sums half of every row-parallel
# product and an all-reduce adds the halves, which rounds differently from one sum (seen: 1e-6).
TP_LOGPROB_ATOL = 1e-5


def test_starting_an_engine_leaves_this_process_its_torch_threads(vllm_engines):
    """vLLM's multiprocess executor (tensor parallel 2 here; also a size-1 engine beside a
    world of several ranks) lowers the torch threads of the process that starts it to one: a
    trainer sharing that process would train on one thread."""
    vllm_engines(2)
    before, after = vllm_engines.threads[2]
    assert before >= 2, "the check needs a process of two threads or more"
    assert after == before, f"torch threads {before} -> {after} across the engine's start"


def test_vllm_tp2_generates_what_tp1_generates_on_the_same_weights(vllm_engines, monkeypatch):
    """After the same update (every worker of both engines reports the bytes sent), greedy
    tokens (top-k 1) and seeded samples of the TP 2 engine equal the TP 1 engine's, log-probs
    within :data:`TP_LOGPROB_ATOL`; VLLM_MODEL's single key/value head is replicated on both
    workers."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
    weights = suite.random_weights(11)
    engines = [vllm_engines(tp) for tp in TENSOR_PARALLEL]
    digests = {e.update_weights(weights.items(), version=3, checksum=True) for e in engines}
    assert digests == {suite.checksum(weights.items())}
    for params in (
        SamplingParams(n=1, top_k=1, max_new_tokens=24),
        SamplingParams(n=2, max_new_tokens=24, seed=4),
    ):
        one, two = (engine.generate(suite.PROMPTS, params) for engine in engines)
        assert [s.token_ids for s in one] == [s.token_ids for s in two]
        for a, b in zip(one, two):
            assert a.versions == b.versions == [3] * len(a.token_ids)
            torch.testing.assert_close(
                torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=TP_LOGPROB_ATOL
            )


def run_bounded(action, deadline_s: float = 600.0):
    """``action()`` on another thread; its result or error. The deadline only bounds a hang
    (the call must end by itself, whatever the machine's speed)."""
    result: dict = {}

    def run():
        try:
            result["value"] = action()
        except BaseException as error:
            result["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(deadline_s)
    assert not worker.is_alive(), f"still running after {deadline_s} s: a hang"
    return result


def test_a_tp2_engine_whose_worker_cannot_start_is_refused(tmp_path):
    """A worker extension that does not import makes both worker processes fail at start: the
    engine's start ends with an error that says so and where their tracebacks are."""
    torch.manual_seed(0)
    EmbeddedEngine(VLLM_MODEL).model.save_pretrained(tmp_path)
    outcome = run_bounded(
        lambda: VLLMEngine.from_pretrained(
            tmp_path,
            enforce_eager=True,
            tensor_parallel_size=2,
            worker_extension_cls="bapo_megatron.rollout.vllm.no_such_module.Extension",
        )
    )
    error = outcome.get("error")
    assert isinstance(error, WorkerFailure), outcome
    assert (
        "tensor_parallel_size=2: a worker process (VllmWorker-0, VllmWorker-1) failed to start"
        in str(error)
    )


def test_a_tp2_worker_that_dies_is_named_and_the_engine_stops_serving(vllm_engines, monkeypatch):
    """SIGKILL one of two worker processes of the module's TP 2 engine once every sample holds a
    token: the generation call ends with an error naming that worker and its exit, the engine
    reports itself unhealthy and refuses further calls with the same kind of error. It ends that
    engine: the module's last test to use it."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
    engine = vllm_engines(2)
    engine.update_weights(suite.random_weights(12).items(), version=1)
    worker = executor_of(engine.llm).workers[1].proc
    kill = lambda: os.kill(worker.pid, signal.SIGKILL)  # noqa: E731
    after_first_vllm_tokens(engine, len(suite.PROMPTS), kill)
    params = SamplingParams(max_new_tokens=400)
    outcome = run_bounded(lambda: engine.generate(suite.PROMPTS, params))
    error = outcome.get("error")
    assert isinstance(error, WorkerFailure), outcome
    assert f"VllmWorker-1 (pid {worker.pid}, exit code -9)" in str(error)
    assert "while generating" in str(error) and not engine.health()
    again = run_bounded(lambda: engine.update_weights(suite.random_weights(12).items(), version=2))
    assert isinstance(again.get("error"), WorkerFailure), again

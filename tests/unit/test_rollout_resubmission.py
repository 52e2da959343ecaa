"""The pieces the vLLM and SGLang adapters share (:mod:`bapo_megatron.rollout.resubmission`):
rounds that resubmit a prompt with the tokens so far, outputs taken into samples, cut rounds;
and that none of the adapter modules imports an engine package at import time."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bapo_megatron.rollout.protocol import RolloutSample, SamplingParams
from bapo_megatron.rollout.resubmission import (
    EngineOutput,
    RoundRequest,
    apply_output,
    plan_round,
    sample_seed,
    wait_cutting,
)


def test_adapters_import_without_engine_packages():
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['sglang'] = None\n"
        "import bapo_megatron.rollout.vllm.engine, bapo_megatron.rollout.vllm.server_client\n"
        "import bapo_megatron.rollout.vllm.worker_extension\n"
        "import bapo_megatron.rollout.sglang.engine, bapo_megatron.rollout.sglang.server_client\n"
        "from bapo_megatron.rollout.registry import engine_kinds\n"
        "assert len(engine_kinds()) == 5, engine_kinds()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def sample(tokens=(), prompt=(1, 2)) -> RolloutSample:
    s = RolloutSample(prompt_index=0, sample_index=0, prompt_token_ids=list(prompt))
    s.token_ids, s.logprobs, s.versions = list(tokens), [-1.0] * len(tokens), [0] * len(tokens)
    return s


def test_rounds_resubmit_prompt_plus_tokens_with_the_rest_of_the_budget():
    params = SamplingParams(max_new_tokens=10, seed=4)
    fresh, half = sample(), sample(tokens=(7, 8, 9, 10, 11, 12, 13, 14))
    first, second = plan_round([fresh, half], params, round_tokens=3)
    assert first.context == [1, 2] and first.max_new_tokens == 3 and not first.final
    assert second.context == [1, 2, 7, 8, 9, 10, 11, 12, 13, 14]
    assert second.max_new_tokens == 2 and second.final
    assert first.seed != second.seed and first.seed == sample_seed(4, fresh)
    assert sample_seed(None, fresh) is None and 0 <= sample_seed(2**40, fresh) < 2**31
    with pytest.raises(ValueError, match="round_tokens must be a positive integer"):
        plan_round([fresh], params, round_tokens=0)
    with pytest.raises(ValueError, match="already generated max_new_tokens"):
        plan_round([sample(tokens=range(10))], params, None)


def test_outputs_append_with_the_current_version_and_map_finish_reasons():
    def run(finish, n_tokens, *, cap=3, final=False, pausing=False):
        s = sample(tokens=(5,))
        request = RoundRequest(
            sample=s, context=[1, 2, 5], max_new_tokens=cap, final=final, seed=None
        )
        apply_output(
            request,
            EngineOutput(
                token_ids=list(range(n_tokens)), logprobs=[-0.5] * n_tokens, finish=finish
            ),
            version=4,
            pausing=pausing,
            where="out",
        )
        return s

    s = run("length", 3)
    assert (
        s.finish_reason == "paused" and s.token_ids == [5, 0, 1, 2] and s.versions == [0, 4, 4, 4]
    )
    assert run("length", 3, final=True).finish_reason == "length"
    assert run("length", 2).finish_reason == "length"  # below the cap: the context window
    assert run("stop", 2).finish_reason == "stop"
    assert run("abort", 1).finish_reason == "abort"
    assert run("abort", 1, pausing=True).finish_reason == "paused"
    request = RoundRequest(sample=sample(), context=[1], max_new_tokens=2, final=True, seed=None)
    bad = [
        (EngineOutput([1, 2], [-1.0], "length"), "'logprobs' has 1 entries for 2"),
        (
            EngineOutput([1, 2, 3], [-1.0] * 3, "length"),
            "'token_ids' holds 3 tokens, the request allowed 2",
        ),
        (
            EngineOutput([1], [float("nan")], "stop"),
            r"'logprobs'\[0\] = nan is not a log-probability",
        ),
        (EngineOutput([1], [0.5], "stop"), r"'logprobs'\[0\] = 0.5"),
        (EngineOutput([], [], "stop"), "'stop' with no generated token"),
    ]
    for output, message in bad:
        with pytest.raises(ValueError, match=message):
            apply_output(request, output, version=0, pausing=False, where="out")


def test_a_cut_round_keeps_aborting_until_every_request_is_back():
    released = threading.Event()
    aborts = []

    def abort_all():  # the held request returns only after the second abort
        aborts.append(time.monotonic())
        if len(aborts) == 2:
            released.set()

    with ThreadPoolExecutor(max_workers=2) as pool:
        quick = pool.submit(lambda: "quick")
        held = pool.submit(lambda: released.wait(10) and "held")
        assert wait_cutting([quick, held], lambda: True, abort_all, interval=0.01) == [
            "quick",
            "held",
        ]
    assert len(aborts) == 2
    with ThreadPoolExecutor(max_workers=1) as pool:  # not cut: never aborts
        assert wait_cutting([pool.submit(lambda: 1)], lambda: False, abort_all, interval=0.01) == [
            1
        ]
    assert len(aborts) == 2

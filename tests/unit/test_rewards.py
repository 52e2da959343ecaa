"""Rewards: math answers through math-verify, the registry, the signatures a reward may have
(ours, verl's), the time-bounded pool, and the metrics the trainer logs from dict results."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from bapo_megatron.rewards.calling import RewardInput, read_outcome, reward_caller
from bapo_megatron.rewards.pool import RewardPool
from bapo_megatron.rewards.registry import get_reward, register_reward
from tests.helpers import verl_rewards


@pytest.mark.parametrize(
    "response, truth, boxed, lenient",
    [
        ("so the answer is \\boxed{0.5}", "1/2", 1.0, 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
        ("first \\boxed{3}, no wait: \\boxed{2}", "2", 1.0, 1.0),
        ("\\boxed{2}", "\\frac{1}{2}", 0.0, 0.0),
        ("so 0.5", "1/2", 0.0, 1.0),  # no box: the default reward does not guess
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0, 1.0),  # symbolic equivalence
        ("import os; os.system('rm -rf /')", "1", 0.0, 0.0),
    ],
)
def test_math_rewards(response, truth, boxed, lenient):
    assert get_reward("math")(response, truth) == boxed
    assert get_reward("math_lenient")(response, truth) == lenient


def test_registry_names_and_errors():
    @register_reward("test_length")
    def length(response: str, truth: str) -> float:
        return float(len(response) == int(truth))

    assert get_reward("test_length")("abc", "3") == 1.0
    assert get_reward("tests.unit.test_rewards:slow_reward") is slow_reward
    with pytest.raises(ValueError, match="unknown reward 'nope'; registered: .*'math'"):
        get_reward("nope")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("tests.no_such_module:f")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math")(length)


def test_a_builtin_reward_imports_only_its_own_module():
    # in a fresh interpreter, as a reward worker is: exact_match without math-verify, and a
    # name clash with a built-in whose module was not imported yet still refused
    code = (
        "import sys\n"
        "from bapo_megatron.rewards.registry import get_reward, register_reward\n"
        "assert get_reward('exact_match')('4', '4') == 1.0\n"
        "assert 'math_verify' not in sys.modules, 'math-verify imported for exact_match'\n"
        "try:\n"
        "    register_reward('math_lenient')(len)\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip() == "reward 'math_lenient' is already registered"


def slow_reward(response: str, truth: str) -> float:
    """Sleeps ``response`` seconds when it is a number (a stand-in for a pathological check);
    ``die`` kills its own process (as an OOM kill or a segfault would), ``nan`` returns NaN."""
    if response == "raise":
        raise RuntimeError("bad output")
    if response == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "nan":
        return float("nan")
    time.sleep(float(response))
    return 1.0


def test_pool_bounds_each_check_and_counts_failures():
    with RewardPool("tests.unit.test_rewards:slow_reward", workers=2, timeout_s=2.0) as pool:
        batch = pool.score(["0", "30", "raise", "0"], ["", "", "", ""])
        assert batch.rewards == [1.0, 0.0, 0.0, 1.0]
        assert batch.timed_out == 1
        assert batch.errors == [
            "2: reward 'tests.unit.test_rewards:slow_reward' on response 2 "
            "('raise'): RuntimeError: bad output"
        ]
        # The stuck worker was replaced: the pool still works.
        assert pool.score(["0"], [""]).rewards == [1.0]


def test_pool_scores_math_in_workers():
    with RewardPool("math", workers=1, timeout_s=30.0) as pool:
        batch = pool.score(["\\boxed{4}", "\\boxed{5}"], ["4", "4"])
    assert batch.rewards == [1.0, 0.0] and batch.timed_out == 0 and not batch.errors
    with (
        RewardPool("math", workers=1) as pool,
        pytest.raises(ValueError, match="2 responses but 1"),
    ):
        pool.score(["a", "b"], ["c"])


def test_a_worker_that_dies_is_replaced_and_its_check_counted():
    with RewardPool("tests.unit.test_rewards:slow_reward", workers=2, timeout_s=60.0) as pool:
        first = [w.process.pid for w in pool._workers]
        batch = pool.score(["0", "die", "0", "die", "0"], [""] * 5)
        assert batch.rewards == [1.0, 0.0, 1.0, 0.0, 1.0] and batch.timed_out == 0
        assert [m.split(":")[0] for m in batch.errors] == ["1", "3"]
        assert all("worker process died (exit code -9)" in m for m in batch.errors)
        assert len({w.process.pid for w in pool._workers} - set(first)) >= 1
        assert pool.score(["0", "0"], ["", ""]).rewards == [1.0, 1.0]
        workers = [w.process for w in pool._workers]
    assert not any(process.is_alive() for process in workers)  # close ends every worker


def test_workers_that_cannot_start_are_named_and_none_is_left_running():
    # the pool starts its workers together and waits for all: a failure in one still ends both
    before = set(multiprocessing.active_children())
    with pytest.raises(
        RuntimeError,
        match=r"reward worker reward-worker-1 \(reward 'tests\.helpers\.reward_that_cannot_start"
        r":score'\) died while starting",
    ):
        RewardPool("tests.helpers.reward_that_cannot_start:score", workers=2, timeout_s=60.0)
    assert set(multiprocessing.active_children()) == before


def test_the_whole_batch_is_bounded_in_time():
    # eight checks that would each run for an hour, under a per-check limit of an hour: the
    # batch limit ends them all, and the pool works again afterwards
    with RewardPool(
        "tests.unit.test_rewards:slow_reward", workers=2, timeout_s=3600.0, batch_timeout_s=1.0
    ) as pool:
        batch = pool.score(["3600"] * 8, [""] * 8)
        assert batch.timed_out == 8 and batch.rewards == [0.0] * 8 and not batch.errors
        assert pool.score(["0"], [""]).rewards == [1.0]


def test_a_reward_that_is_not_a_finite_number_is_an_error_naming_reward_and_response():
    with RewardPool("tests.unit.test_rewards:slow_reward", workers=1, timeout_s=60.0) as pool:
        batch = pool.score(["0", "nan"], ["", ""])
    assert batch.rewards == [1.0, 0.0]
    assert batch.errors == [
        "1: reward 'tests.unit.test_rewards:slow_reward' on response 1 ('nan'): "
        "returned nan, not a finite number"
    ]


def test_each_signature_is_called_with_what_it_names():
    given = RewardInput(
        response="8 9", ground_truth="8 9", data_source="count_to", extra_info={"index": 4}
    )
    # verl's compute_score(data_source, solution_str, ground_truth, extra_info), by keyword
    assert reward_caller(verl_rewards.compute_score)(given) == {
        "score": 1.0,
        "acc": True,
        "index": 4,
        "pred": "8 9",
    }
    # ours, with data_source asked for and extra_info not
    call = reward_caller(verl_rewards.length_over_source)
    assert call(given) == 3.0 and call(RewardInput("8 9", "", data_source="double")) == 6.0
    # ours, plain: the row is not passed; **kwargs: all of it is
    assert reward_caller(get_reward("exact_match"))(given) == 1.0
    seen = {}
    reward_caller(lambda response, truth, **row: seen.update(row) or 0.0)(given)
    assert seen == {"data_source": "count_to", "extra_info": {"index": 4}}


@pytest.mark.parametrize(
    "value, score, metrics",
    [
        (1, 1.0, {}),
        (
            {"score": 0.5, "acc": True, "n": 3, "pred": "x", "bad": float("nan")},
            0.5,
            {"acc": 1.0, "n": 3.0},
        ),
    ],
)
def test_a_number_or_a_dict_with_a_score_is_a_result(value, score, metrics):
    outcome = read_outcome(value)
    assert outcome.score == score and outcome.metrics == metrics


@pytest.mark.parametrize(
    "value, message",
    [
        ({"acc": 1.0}, "returned a dict without a 'score' key (keys ['acc'])"),
        ({"score": "high"}, "returned 'high', not a number"),
        ({"score": float("inf")}, "returned inf, not a finite number"),
        (None, "returned None, not a number"),
    ],
)
def test_a_result_without_a_finite_score_is_refused_saying_why(value, message):
    with pytest.raises(ValueError) as raised:
        read_outcome(value)
    assert str(raised.value) == message


def test_pool_runs_a_verl_reward_unchanged_and_keeps_its_metrics():
    with RewardPool("tests.helpers.verl_rewards:compute_score", workers=1, timeout_s=60.0) as pool:
        batch = pool.score(
            ["8 9", "7", "a b c", "x"],
            ["8 9", "8", "c", "x"],
            data_sources=["count_to", "count_to", "words", "gsm8k"],
            extra_infos=[{"index": 0}, None, None, None],
        )
    assert batch.rewards == [1.0, 0.0, 1.0, 0.0] and batch.timed_out == 0
    assert batch.metrics == [
        {"acc": 1.0, "index": 0.0},
        {"acc": 0.0, "index": -1.0},
        {"words": 3.0},
        {},
    ]
    assert batch.errors == [
        "3: reward 'tests.helpers.verl_rewards:compute_score' on response 3 ('x'): "
        "NotImplementedError: Reward function is not implemented for data_source='gsm8k'"
    ]


def test_the_trainer_logs_returned_numbers_as_their_mean_over_the_checks(single_process):
    from bapo_megatron.trainer.metrics import RolloutCounts, rollout_metrics

    counts = RolloutCounts(samples=4.0, reward=2.0, correct=2.0)
    counts.add_reward_metrics([{"acc": 1.0, "accuracy": 0.0}, {}, {"acc": 0.0}, {"acc": 1.0}])
    metrics = rollout_metrics(counts, single_process)
    assert metrics["reward/acc"] == 2 / 3  # over the 3 checks that returned it
    # a name the trainer uses itself keeps the trainer's value; the returned one is renamed
    assert metrics["reward/accuracy"] == 0.5 and metrics["reward/returned_accuracy"] == 0.0
    assert "reward/acc" not in rollout_metrics(RolloutCounts(), single_process)  # none returned

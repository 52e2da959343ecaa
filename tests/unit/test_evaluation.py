"""Evaluation (bapo_megatron.evaluation.evaluate, tools/evaluate.py): the pass@k estimator, the
settings and benchmark formats, and reward errors and timeouts.

The estimator is checked against a float64 enumeration of every k-subset of n samples. Reward
errors and timeouts are counted per problem (a fake engine and a reward that hangs on one
answer). Whole runs on a model whose answers are known: test_evaluation_runs.py.

Top-level imports stay light: the reward pool's workers import this module for `_hanging_reward`.
"""

from __future__ import annotations

import itertools
import random
import time

import pytest

from tests.helpers.known_answers import (
    known_answer_tokenizer,
)


def _hanging_reward(response: str, ground_truth: str) -> float:
    """Exact match, except that the response "9" hangs the check."""
    if response.strip() == "9":
        time.sleep(600)
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


# ------------------------------------------------------------------------ the estimator


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration_of_all_subsets():
    import numpy as np

    from bapo_megatron.evaluation.evaluate import pass_at_k

    rng = random.Random(0)
    cases = [(n, c, k) for n in (1, 2, 5) for c in range(n + 1) for k in range(1, n + 1)]
    sizes = [rng.randint(6, 12) for _ in range(40)]
    cases += [(n, rng.randint(0, n), rng.randint(1, n)) for n in sizes]
    for n, c, k in cases:
        want = np.float64(_brute_force_pass_at_k(n, c, k))
        assert abs(pass_at_k(n, c, k) - want) <= 1e-12, (n, c, k)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)  # pass@1 is the accuracy
    assert pass_at_k(1000, 1, 1000) == 1.0 and 0 < pass_at_k(10**6, 1, 1) < 1e-5  # no overflow
    for bad in [(4, 5, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_settings_are_validated():
    from bapo_megatron.evaluation.evaluate import EvalSettings

    assert EvalSettings(k=6).pass_ks == (1, 2, 4, 6)
    assert EvalSettings(k=8, pass_ks=(8, 1, 1)).pass_ks == (1, 8)
    for bad in [{"k": 0}, {"k": 4, "pass_ks": (5,)}, {"temperature": 0.0}, {"batch_size": 0}]:
        with pytest.raises(ValueError):
            EvalSettings(**bad)


def test_aime_format_parquet_is_read(tmp_path):
    """AIME-format files name the field `problem` and store integer ids and answers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bapo_megatron.data.prompts import PromptRow, load_prompts

    rows = [
        {"id": 60, "problem": "Find x.", "answer": 204, "solution": "..."},
        {"id": 61, "problem": "", "answer": 1, "solution": "..."},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "aime.parquet")
    loaded = load_prompts(tmp_path / "aime.parquet", skip_bad_rows=True)
    assert loaded.rows == [PromptRow(id="60", prompt="Find x.", answer="204")]
    assert len(loaded.skipped) == 1 and "row 1: field 'problem'" in loaded.skipped[0]


# ------------------------------------------------------------------------ errors and timeouts


class _FixedEngine:
    """A rollout engine whose responses are fixed texts, one list per prompt."""

    def __init__(self, tokenizer, texts: list[list[str]]):
        self.tokenizer, self.texts, self.calls = tokenizer, texts, 0

    def generate(self, prompts, params, *, round_tokens=None):
        from bapo_megatron.rollout.protocol import RolloutSample

        samples = []
        for p, _ in enumerate(prompts):
            texts = self.texts[self.calls + p]
            assert len(texts) == params.n
            samples += [
                RolloutSample(
                    prompt_index=p,
                    sample_index=i,
                    prompt_token_ids=[2],
                    token_ids=self.tokenizer.encode(text) + [1],
                    finish_reason="stop",
                )
                for i, text in enumerate(texts)
            ]
        self.calls += len(prompts)
        return samples


def test_reward_errors_and_timeouts_are_counted_per_problem():
    from bapo_megatron.data.prompts import PromptRow
    from bapo_megatron.evaluation.evaluate import (
        Counts,
        EvalSettings,
        encode_rows,
        evaluate_rows,
        reward_pool,
    )

    tokenizer = known_answer_tokenizer()
    rows = [PromptRow(id="a", prompt="a", answer="1"), PromptRow(id="b", prompt="b", answer="2")]
    engine = _FixedEngine(tokenizer, [["1", "9", "1"], ["2", "3", "9"]])
    settings = EvalSettings(
        k=3,
        reward="tests.unit.test_evaluation:_hanging_reward",
        reward_workers=2,
        reward_timeout_s=1.0,
        batch_size=2,
    )
    counts = Counts()
    with reward_pool(settings) as pool:
        results = evaluate_rows(
            engine,
            tokenizer,
            encode_rows(tokenizer, rows, settings),
            settings,
            pool,
            counts=counts,
            progress=False,
        )
    assert [(r.id, r.correct, r.timeouts, r.scoring_errors) for r in results] == [
        ("a", 2, 1, 0),
        ("b", 1, 1, 0),
    ]
    assert not counts.scoring_errors and not counts.bad_rows

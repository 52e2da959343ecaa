"""The synthetic `seek` task (count up the ring to the first number with the prompt's last digit):
rows, reference responses, that they fit the walk tokenizer and the sweep's length cap, and
that the exact-match reward rejects every way of missing the stop."""

from __future__ import annotations

import pytest

from bapo_megatron.data.prompts import prompt_token_ids
from bapo_megatron.data.synthetic_task import (
    RING_SIZE,
    SYNTHETIC_TASKS,
    seek_longest_response_tokens,
    seek_response,
    seek_rows,
    synthetic_rows,
    walk_rows,
    walk_tokenizer,
)
from bapo_megatron.rewards.registry import get_reward


def test_reference_responses():
    assert seek_response(23, 7) == "24 25 26 27"
    assert seek_response(37, 2) == "38 39 0 1 2"  # wraps around the ring
    assert seek_response(5, 5) == "6 7 8 9 10 11 12 13 14 15"  # a whole decade
    with pytest.raises(ValueError):
        seek_response(RING_SIZE, 1)


def test_rows_are_seeded_and_right():
    rows = seek_rows(500, seed=7)
    assert rows == seek_rows(500, seed=7) and rows != seek_rows(500, seed=8)
    for row in rows:
        start, digit = map(int, row.prompt.split(">"))
        assert 0 <= start < RING_SIZE and 0 <= digit <= 9 and digit != start % 10
        numbers = [int(n) for n in row.answer.split(" ")]
        assert numbers == [(start + k) % RING_SIZE for k in range(1, len(numbers) + 1)]
        assert 1 <= len(numbers) <= 9
        assert numbers[-1] % 10 == digit and all(n % 10 != digit for n in numbers[:-1])


def test_fits_the_walk_tokenizer_and_the_cap():
    tokenizer = walk_tokenizer()
    for row in seek_rows(200, seed=1):
        ids = tokenizer(row.answer, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == row.answer
        assert tokenizer.decode(prompt_token_ids(tokenizer, row)) == row.prompt + ":"
    # a right response fits the sweep's cap of 32 tokens; missing the stop by a decade does not
    assert seek_longest_response_tokens() <= 32
    assert len(seek_response(9, 8)) + 1 + len(" 19 20 21 22 23 24 25 26 27 28") > 32


def test_registry():
    assert set(SYNTHETIC_TASKS) == {"walk", "seek", "runon"}
    assert synthetic_rows("walk", 20, seed=3) == walk_rows(20, seed=3)
    assert synthetic_rows("seek", 20, seed=3) == seek_rows(20, seed=3)
    with pytest.raises(ValueError, match="unknown synthetic task"):
        synthetic_rows("nope", 1, seed=0)


def test_every_miss_is_wrong():
    reward = get_reward("exact_match")
    for row in seek_rows(100, seed=2):
        numbers = row.answer.split(" ")
        start = int(row.prompt.split(">")[0])
        assert reward(row.answer, row.answer) == 1.0
        assert reward(" ".join(numbers[:-1]), row.answer) == 0.0  # stopped short
        passed = numbers + [str((start + len(numbers) + 1) % RING_SIZE)]
        assert reward(" ".join(passed), row.answer) == 0.0  # walked past the stop

"""The ``final_number`` reward (bapo_megatron/rewards/final_number.py): the last number of a
free-text response against a numeric ground truth."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bapo_megatron.rewards.final_number import final_number_reward
from bapo_megatron.rewards.registry import get_reward


def test_it_is_registered_by_name():
    assert get_reward("final_number") is final_number_reward


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("7 + 12 = 19", "19", 1.0),
        ("The answer is 19.", "19", 1.0),  # a sentence's period is no decimal point
        ("The answer is 19.0", "19", 1.0),
        ("It is 19.5.", "19.5", 1.0),
        ("about .5 of it", "0.5", 1.0),
        ("the answer is 19. Then 20 apples", "19", 0.0),  # the last number wins
        ("the answer is 19. Then 20 apples", "20", 1.0),
        ("It costs $1,234.", "1234", 1.0),
        ("It costs $1,234.50", "1,234.5", 1.0),
        ("in all 1,000,000 grains", "1000000", 1.0),
        ("12,34 is a list", "34", 1.0),  # not a thousands group: two numbers
        ("x = -3", "-3", 1.0),
        ("x = -3", "3", 0.0),
        ("x = 3", "-3", 0.0),
        ("the change is -$5", "-5", 1.0),
        ("20-1", "1", 1.0),  # the dash after a term is subtraction
        ("(4)-2", "2", 1.0),
        ("so +7 it is", "7", 1.0),
        ("19", " 19 ", 1.0),
        ("nineteen", "19", 0.0),  # no number at all
        ("", "19", 0.0),
        ("٣ is three in Arabic-Indic digits", "3", 0.0),  # only 0-9 are digits
        ("12345678901234567890123", "12345678901234567890123", 1.0),  # exact beyond floats
        ("12345678901234567890124", "12345678901234567890123", 0.0),
        ("-10000000000000000000000000001", "-10000000000000000000000000000", 0.0),
    ],
)
def test_the_last_number_is_compared_numerically(response, truth, score):
    assert final_number_reward(response, truth) == score


@pytest.mark.parametrize("truth", ["nineteen", "", "19 or 20", "1/2", "19!", "--3", "1e5"])
def test_a_ground_truth_that_is_not_one_number_is_refused_naming_it(truth):
    with pytest.raises(ValueError, match=f"ground truth {truth!r} is not a number"):
        final_number_reward("19", truth)


NOISE = st.text(st.characters(blacklist_characters="0123456789"), max_size=40)


@given(a=st.integers(min_value=-(10**30), max_value=10**30), noise=NOISE)
def test_an_integer_after_text_without_digits_is_its_final_number(a, noise):
    response = f"{noise} {a}"
    assert final_number_reward(response, str(a)) == 1.0
    assert final_number_reward(response, str(a + 1)) == 0.0

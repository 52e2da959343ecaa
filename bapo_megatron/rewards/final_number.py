"""The final number of a free-text answer against a numeric ground truth (``final_number``).

For tasks whose answer is one number and whose responses are plain text, such as arithmetic
(:mod:`bapo_megatron.data.arithmetic_task`): the last number written in the response counts,
wherever it stands, as in the "flexible" extraction of GSM8K scorers. A number here is what a
person writes: an optional sign, an optional ``$``, digits with optional thousands separators
(``1,234``) and an optional decimal part (``12.0``, ``.5``). A period that ends a sentence is no
decimal point ("... is 19."), and a dash right after a word, a digit or a closing parenthesis is
subtraction, not a sign ("20-1" holds 20 and 1). Numbers compare exactly, as decimals of any
length: 19.0 equals 19, -3 differs from 3, and no float rounding makes two large integers equal.
"""

from __future__ import annotations

import re
from decimal import Decimal

from bapo_megatron.rewards.registry import register_reward

# [0-9], not \d: \d also matches other scripts' digits, which Decimal would read as well but a
# ground truth never holds.
_DIGITS = r"(?:[0-9]{1,3}(?:,[0-9]{3}(?![0-9]))+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
_NUMBER = re.compile(
    r"(?P<sign>(?<![\w)])[-+])?"  # a sign, unless the dash follows a term (subtraction)
    r"\$?"
    rf"(?<![0-9.])(?P<digits>{_DIGITS})"  # never the tail of a longer number
)
_GROUND_TRUTH = re.compile(rf"\s*(?P<sign>[-+])?\$?(?P<digits>{_DIGITS})\s*")


def _value(match: re.Match[str]) -> Decimal:
    # the sign goes into the text: negating a Decimal rounds it to the context's 28 digits
    sign = "-" if match["sign"] == "-" else ""
    return Decimal(sign + match["digits"].replace(",", ""))


def final_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (see the module docstring), or None."""
    last = None
    for match in _NUMBER.finditer(text):
        last = match
    return None if last is None else _value(last)


@register_reward("final_number")
def final_number_reward(response: str, ground_truth: str) -> float:
    """1.0 when the last number in ``response`` equals the number ``ground_truth``, else 0.0
    (also when the response holds no number). A ground truth that is not one number raises
    ``ValueError`` naming it."""
    gold = _GROUND_TRUTH.fullmatch(str(ground_truth))
    if gold is None:
        raise ValueError(
            f"ground truth {ground_truth!r} is not a number (the final_number reward compares "
            "numbers, e.g. 19, -3, 1,234 or 12.5)"
        )
    answer = final_number(response)
    return 1.0 if answer is not None and answer == _value(gold) else 0.0

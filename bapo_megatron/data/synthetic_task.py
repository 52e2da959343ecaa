"""Synthetic verifiable tasks whose failures are long: count from one number to another
(`count_to`), or count upwards and stop, from a policy that often runs on (`count_up_and_stop`,
the tiny CPU run's; its section below).

Prompt ``"7>12"``; the one right response counts there one step at a time, ``"8 9 10 11 12"``,
then ends. A policy that walks past the target without stopping keeps counting until the length
cap, so wrong responses tend to be longer than right ones, as in reasoning RL where failed
attempts run long (the paper's explanation of why negative tokens dominate the loss). On a task
of fixed length, the positive contribution sits near 0.5 by construction and clipping methods do
not separate. How much longer is an empirical matter: in the tiny CPU run (after its warm-up)
wrong responses averaged 11-16 tokens against 9-12 for right ones, and few reached the cap.

The task brings its own character tokenizer (digits, space, ``>`` and the ``:`` that opens the
response), built with the ``tokenizers`` library and wrapped as a transformers fast tokenizer,
so the chat-template and decoding paths are the ones real models take.
"""

from __future__ import annotations

import random

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from bapo_megatron.data.prompts import PromptRow

CHARACTERS = "0123456789 >:"
PAD, EOS = "<pad>", "<eos>"
# The user turn is the prompt itself; the generation prompt ":" opens the response.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}:{% endif %}"
)
MAX_NUMBER = 39
MAX_DISTANCE = 8


def character_tokenizer(
    characters: str, chat_template: str
) -> transformers.PreTrainedTokenizerFast:
    """One token per character of ``characters`` (in that order after ``<pad>`` = 0 and
    ``<eos>`` = 1), as a transformers fast tokenizer with ``chat_template``."""
    vocab = {PAD: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(characters)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def counting_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The synthetic tasks' tokenizer: digits, space, ``>`` and ``:``, one token each."""
    return character_tokenizer(CHARACTERS, CHAT_TEMPLATE)


def count_response(start: int, target: int) -> str:
    """The right response: every number after ``start`` up to ``target``, space separated."""
    step = 1 if target > start else -1
    return " ".join(str(n) for n in range(start + step, target + step, step))


def count_to_rows(count: int, seed: int) -> list[PromptRow]:
    """``count`` problems with start and target in [0, MAX_NUMBER], 1 to MAX_DISTANCE apart
    (both directions); the answer is the right response."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        start = rng.randint(0, MAX_NUMBER)
        choices = [
            t
            for t in range(max(0, start - MAX_DISTANCE), min(MAX_NUMBER, start + MAX_DISTANCE) + 1)
            if t != start
        ]
        target = rng.choice(choices)
        rows.append(
            PromptRow(
                id=f"count_to-{index}",
                prompt=f"{start}>{target}",
                answer=count_response(start, target),
            )
        )
    return rows


def longest_response_tokens() -> int:
    """Tokens of the longest right response, its end token included (for length caps)."""
    longest = max(
        len(count_response(s, t))
        for s in range(MAX_NUMBER + 1)
        for t in range(max(0, s - MAX_DISTANCE), min(MAX_NUMBER, s + MAX_DISTANCE) + 1)
        if t != s
    )
    return longest + 1


# ------------------------------------------------------------ the `count_up_and_stop` variant
# `count_to` upwards, from a policy that often does not stop (the tiny CPU run's task). What
# differs from `count_to` is the warm-up's reference: for a share RUN_ON_SHARE of the warm-up's
# examples (drawn afresh each time, so no prompt is tied to either), it counts past the target
# without the end token to the length cap, as a pretrained model that has not learned to stop
# does. The warmed-up policy then fails mostly by running on to the cap, as failed reasoning
# attempts run long, and RL must teach it to stop: the situation the BAPO paper describes, where the
# negative-advantage tokens outweigh the positive ones in the loss.

RUN_ON_SHARE = 0.35
"""Share of the `count_up_and_stop` warm-up's references that run on past the target to the
length cap."""
COUNT_UP_DISTANCE = 4
"""Largest distance from start to target of a `count_up_and_stop` problem: right responses stay
short, so that a run-on to the cap is several times as long as a success."""


def count_up_and_stop_rows(count: int, seed: int) -> list[PromptRow]:
    """``count`` `count_up_and_stop` problems ``"<start>><target>"``: start in [0, MAX_NUMBER],
    target 1 to COUNT_UP_DISTANCE above it; the answer is the right (upward) count.

    On the tiny CPU run (``examples/tiny_cpu/train.yaml``) the warmed-up policy's wrong responses
    are about 2.5x as long as its right ones, and rho before the bound search sits below rho0
    in most optimizer steps: the situation BAPO is for (``tools/task_figures.py`` prints these
    figures for a run; docs/benchmarks.md has a run's).
    """
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        start = rng.randint(0, MAX_NUMBER)
        target = start + rng.randint(1, COUNT_UP_DISTANCE)
        rows.append(
            PromptRow(
                id=f"count_up_and_stop-{index}",
                prompt=f"{start}>{target}",
                answer=count_response(start, target),
            )
        )
    return rows


def run_on_response(row: PromptRow, max_new_tokens: int) -> str:
    """The run-on reference of a `count_up_and_stop` ``row``: the count from its start upwards,
    past the target, cut at ``max_new_tokens`` characters (one token each), where a capped
    generation ends."""
    start = int(row.prompt.split(">")[0])
    numbers, n = [], start
    while len(" ".join(numbers)) < max_new_tokens:
        n += 1
        numbers.append(str(n))
    return " ".join(numbers)[:max_new_tokens]


def warmup_reference(
    task: str, row: PromptRow, rng: random.Random, max_new_tokens: int
) -> tuple[str, bool]:
    """(reference response, whether the end token follows it) for one warm-up example of
    ``row`` of the synthetic task ``task``: the row's answer and the end token, except for
    `count_up_and_stop`, whose reference runs on to the cap with probability :data:`RUN_ON_SHARE`
    (``rng`` draws it)."""
    if task == "count_up_and_stop" and rng.random() < RUN_ON_SHARE:
        return run_on_response(row, max_new_tokens), False
    return row.answer, True


# Rows of each synthetic task (all use :func:`counting_tokenizer` and the `exact_match` reward).
SYNTHETIC_TASKS = {"count_to": count_to_rows, "count_up_and_stop": count_up_and_stop_rows}


def synthetic_rows(task: str, count: int, seed: int) -> list[PromptRow]:
    """``count`` rows of the synthetic task named ``task`` (a key of :data:`SYNTHETIC_TASKS`)."""
    if task not in SYNTHETIC_TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(SYNTHETIC_TASKS)}")
    return SYNTHETIC_TASKS[task](count, seed)

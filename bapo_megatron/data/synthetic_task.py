"""A synthetic verifiable task whose failures are long: walk from one number to another.

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
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}:{% endif %}")
MAX_NUMBER = 39
MAX_DISTANCE = 8


def walk_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per character, ``<pad>`` = 0 and ``<eos>`` = 1."""
    vocab = {PAD: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(CHARACTERS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD,
                                                     eos_token=EOS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def walk_response(start: int, target: int) -> str:
    """The right response: every number after ``start`` up to ``target``, space separated."""
    step = 1 if target > start else -1
    return " ".join(str(n) for n in range(start + step, target + step, step))


def walk_rows(count: int, seed: int) -> list[PromptRow]:
    """``count`` problems with start and target in [0, MAX_NUMBER], 1 to MAX_DISTANCE apart
    (both directions); the answer is the right response."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        start = rng.randint(0, MAX_NUMBER)
        choices = [t for t in range(max(0, start - MAX_DISTANCE), min(MAX_NUMBER, start + MAX_DISTANCE) + 1)
                   if t != start]
        target = rng.choice(choices)
        rows.append(PromptRow(id=f"walk-{index}", prompt=f"{start}>{target}",
                              answer=walk_response(start, target)))
    return rows


def longest_response_tokens() -> int:
    """Tokens of the longest right response, its end token included (for length caps)."""
    longest = max(len(walk_response(s, t)) for s in range(MAX_NUMBER + 1)
                  for t in range(max(0, s - MAX_DISTANCE), min(MAX_NUMBER, s + MAX_DISTANCE) + 1) if t != s)
    return longest + 1


# ------------------------------------------------------------------ the `ring` variant
# The numbers 0..RING_SIZE-1 stand on a ring (after RING_SIZE - 1 comes 0 again) and the walk
# always goes up: "37>2" -> "38 39 0 1 2". The only place a response may stop is right after the
# target (the end token is the stop marker, exact match the reward), and a policy that walks past
# the target does not meet it again for a whole lap (RING_SIZE numbers, about 110 tokens), so a
# miss that keeps counting runs to the length cap: failures are long by the task's structure, not
# only by what the policy happens to learn. A policy can still stop at a wrong number (a short
# wrong answer); how often it does is measured, not assumed. Same characters as `walk`, so the
# same tokenizer serves both.

RING_SIZE = MAX_NUMBER + 1


def ring_response(start: int, target: int) -> str:
    """The right response: the numbers after ``start`` going up around the ring, up to
    ``target``, space separated."""
    distance = (target - start) % RING_SIZE
    if distance == 0:
        raise ValueError("ring_response: start and target must differ")
    return " ".join(str((start + k) % RING_SIZE) for k in range(1, distance + 1))


def ring_rows(count: int, seed: int) -> list[PromptRow]:
    """``count`` problems with start in [0, RING_SIZE) and target 1 to MAX_DISTANCE steps
    further up the ring (wrapping past RING_SIZE - 1); the answer is the right response."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        start = rng.randrange(RING_SIZE)
        target = (start + rng.randint(1, MAX_DISTANCE)) % RING_SIZE
        rows.append(PromptRow(id=f"ring-{index}", prompt=f"{start}>{target}",
                              answer=ring_response(start, target)))
    return rows


def ring_longest_response_tokens() -> int:
    """Tokens of the longest right `ring` response, its end token included (for length caps)."""
    return max(len(ring_response(s, (s + d) % RING_SIZE)) for s in range(RING_SIZE)
               for d in range(1, MAX_DISTANCE + 1)) + 1


# Rows of each synthetic task (all of them use :func:`walk_tokenizer` and the `exact_match` reward).
SYNTHETIC_TASKS = {"walk": walk_rows, "ring": ring_rows}


def synthetic_rows(task: str, count: int, seed: int) -> list[PromptRow]:
    """``count`` rows of the synthetic task named ``task`` (a key of :data:`SYNTHETIC_TASKS`)."""
    if task not in SYNTHETIC_TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(SYNTHETIC_TASKS)}")
    return SYNTHETIC_TASKS[task](count, seed)

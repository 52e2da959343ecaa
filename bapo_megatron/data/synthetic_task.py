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

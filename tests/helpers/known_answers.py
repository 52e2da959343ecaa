"""A tiny Llama whose answers are known exactly, and a benchmark of it, for the evaluation tests
(tests/unit/test_evaluation*.py): its attention and MLP outputs are zero, so the hidden state at
the last position is the embedding of the last token, and embeddings and output layer are set so
that each letter a..j is followed by the digit 0..9, a digit by the end token, and the letter z
by 1 or 2 with equal probability. A problem ending in "d" is answered "3"; one ending in "z" gets
a seeded coin flip per sample. Imports stay light (torch and transformers inside functions): the
reward pool's workers import the test module that imports this one."""

from __future__ import annotations

import json
from pathlib import Path

from bapo_megatron.data.synthetic_task import EOS, character_tokenizer

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz ?"
K = 4

# (row as written to the benchmark file, correct count expected, or None for the coin flip)
ROWS = [
    ({"id": "p1", "problem": "find d", "answer": "3"}, K),
    ({"problem": "what is h", "answer": "7.0"}, K),  # id: its position, "1"
    ({"id": "p3", "prompt": "take c", "answer": "\\frac{4}{2}"}, K),  # `prompt`, not `problem`
    ({"id": "wrong", "problem": "say b", "answer": "5"}, 0),
    ({"id": "coin", "problem": "flip z", "answer": "1"}, None),
    ({"id": "unscorable", "problem": "give e", "answer": "\\boxed{}"}, 0),  # reward raises
]
BAD_LINES = [
    '{"problem": "", "answer": "1"}',
    '{"problem": "x"}',
    "not json",
    json.dumps({"id": "long", "problem": "a" * 70, "answer": "0"}),
]  # > 64 positions


def known_answer_tokenizer():
    # The user turn alone, so the last prompt token is the problem's last character.
    return character_tokenizer(
        CHARS, "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    )


def write_known_answer_folder(folder: Path) -> None:
    import torch
    import transformers

    tokenizer = known_answer_tokenizer()
    vocab, hidden = len(tokenizer), 64
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()  # no layer writes to the residual stream
        # The final norm turns one-hot embeddings into 8 * one-hot; each logit row then reads one
        # input token: 5 * 8 = 40 for the followers, 0 elsewhere (others get ~1e-16 probability).
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(vocab, hidden)
        for token in range(vocab):
            head[ids(EOS), token] = 5.0
        for letter, digit in zip("abcdefghij", "0123456789"):
            head[:, ids(letter)] = 0.0
            head[ids(digit), ids(letter)] = 5.0
        head[:, ids("z")] = 0.0
        head[ids("1"), ids("z")] = head[ids("2"), ids("z")] = 5.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_known_answers(root: Path) -> tuple[Path, Path]:
    """(an HF folder with known answers, a benchmark file with good and bad rows) under ``root``."""
    write_known_answer_folder(root / "hf")
    lines = (
        [json.dumps(row) for row, _ in ROWS[:4]]
        + BAD_LINES[:2]
        + [json.dumps(row) for row, _ in ROWS[4:]]
        + BAD_LINES[2:]
    )
    (root / "bench.jsonl").write_text("\n".join(lines) + "\n")
    return root / "hf", root / "bench.jsonl"


def without_origin(report: dict) -> dict:
    return {
        key: value
        for key, value in report.items()
        if key not in ("checkpoint", "checkpoint_kind", "engine", "tokenizer", "wall_time_s")
    }


def evaluate_command_line(argv: list[str]) -> dict:
    """The command line (tools/evaluate.py, bapo-evaluate) in this process (a second interpreter
    start is slow here)."""
    from bapo_megatron.evaluation.cli import run

    return run(argv)


def command_line_args(out: Path) -> list[str]:
    return [
        "--k",
        str(K),
        "--pass-k",
        "1,2,4",
        "--max-new-tokens",
        "4",
        "--batch-size",
        "3",
        "--reward",
        "math_lenient",
        "--reward-workers",
        "1",
        "--reward-timeout",
        "60",
        "--seed",
        "3",
        "--no-progress",
        "--out",
        str(out),
    ]

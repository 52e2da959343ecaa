"""Prompt sets from JSONL and parquet files the test writes, the chat template, and the rows a
training task keeps (prompts too long for the model are bad rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from bapo_megatron.config.loading import load_config
from bapo_megatron.data.prompts import PromptRow, chat_messages, load_prompts, prompt_token_ids
from bapo_megatron.data.record_fields import ChatMessage
from bapo_megatron.data.task import encode_prompt, load_task
from tests.helpers.prompt_files import counting_model_folder, write_jsonl, write_parquet

ROWS = [
    {"prompt": "What is 2+3?", "answer": "5", "id": "a"},
    {"prompt": "Compute 7*6.", "answer": 42},
    {"prompt": "Half of one?", "answer": "\\frac{1}{2}", "id": 7},
]


def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    jsonl = load_prompts(write_jsonl(tmp_path / "p.jsonl", ROWS))
    table = pa.Table.from_pylist(
        [{**r, "answer": str(r["answer"]), "id": str(r.get("id", i))} for i, r in enumerate(ROWS)]
    )
    pq.write_table(table, tmp_path / "p.parquet")
    parquet = load_prompts(tmp_path / "p.parquet")
    want = [
        PromptRow(id="a", prompt="What is 2+3?", answer="5"),
        PromptRow(id="1", prompt="Compute 7*6.", answer="42"),
        PromptRow(id="7", prompt="Half of one?", answer="\\frac{1}{2}"),
    ]
    assert jsonl.rows == want and parquet.rows == want and not jsonl.skipped


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"prompt": "", "answer": "1"}', "field 'prompt' must be a non-empty string"),
        (
            '{"prompt": "x"}',
            "field 'answer' must be a non-empty string or a finite number, got None",
        ),
        ('{"prompt": "x", "answer": true}', "field 'answer'"),
        ('{"prompt": "x", "answer": "1", "id": [1]}', "field 'id'"),
        ("[1, 2]", "expected an object"),
        ('{"prompt": "x", "answer": ', "not valid JSON"),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS[:1], [bad])
    with pytest.raises(
        ValueError, match=f"{path}:2: .*{message}".replace("[", r"\[").replace("(", r"\(")
    ):
        load_prompts(path)
    skipped = load_prompts(path, skip_bad_rows=True)
    assert len(skipped.rows) == 1 and len(skipped.skipped) == 1 and ":2:" in skipped.skipped[0]


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "p.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unsupported prompt file type '.csv'"):
        load_prompts(tmp_path / "p.csv")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="cannot be read as parquet"):
        load_prompts(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="no usable rows"):
        load_prompts(write_jsonl(tmp_path / "e.jsonl", [], ['{"prompt": 1}']), skip_bad_rows=True)


def _word_tokenizer() -> PreTrainedTokenizerFast:
    """One token per word, with a chat template that writes each turn as ``<role> text </turn>``."""
    words = [
        "<pad>",
        "<user>",
        "<assistant>",
        "<system>",
        "</turn>",
        "What",
        "is",
        "2+3?",
        "Be",
        "brief.",
    ]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </turn> "
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


def test_chat_template_wraps_the_prompt():
    tokenizer = _word_tokenizer()
    row = PromptRow(id="0", prompt="What is 2+3?", answer="5")
    assert prompt_token_ids(tokenizer, row) == [1, 5, 6, 7, 4, 2]
    assert prompt_token_ids(tokenizer, row, system="Be brief.") == [3, 8, 9, 4, 1, 5, 6, 7, 4, 2]


def test_chat_messages_go_through_the_template_as_the_text_does():
    tokenizer = _word_tokenizer()
    text = PromptRow(id="0", prompt="What is 2+3?", answer="5")
    user = ChatMessage(role="user", content="What is 2+3?")
    system = ChatMessage(role="system", content="Be brief.")
    messages = PromptRow(id="0", prompt=(user,), answer="5")
    with_system = PromptRow(id="0", prompt=(system, user), answer="5")
    assert prompt_token_ids(tokenizer, messages) == prompt_token_ids(tokenizer, text)
    assert prompt_token_ids(tokenizer, messages, system="Be brief.") == prompt_token_ids(
        tokenizer, text, system="Be brief."
    )
    assert prompt_token_ids(tokenizer, with_system) == [3, 8, 9, 4, 1, 5, 6, 7, 4, 2]
    # the row's own system message is the one used: the configured one is not added twice
    assert chat_messages(with_system, system="What") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
    ]


GOOD = {"prompt": "What is 2+3?", "answer": "5"}


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"prompt": "x"},
            "field 'answer' must be a non-empty string or a finite number, got None",
        ),  # null in parquet
        ({"prompt": "", "answer": "1"}, "field 'prompt' must be a non-empty string, got ''"),
        ({"prompt": "  ", "answer": "1"}, "field 'prompt' must be a non-empty string"),
        (
            {"prompt": "x", "answer": "1", "id": [1]},
            "field 'id' must be a string or an integer, got [1]",
        ),
        (
            {"prompt": 7, "answer": "1"},
            "field 'prompt' must be a non-empty string or a list of chat messages "
            "(objects with 'role' and 'content'), got 7",
        ),
    ],
)
def test_bad_parquet_rows_name_file_row_and_field(tmp_path, bad, message):
    # a parquet column has one type, so a wrong-typed prompt needs the good row to use `problem`
    good = (
        {"problem": GOOD["prompt"], "answer": "5"}
        if not isinstance(bad.get("prompt", ""), str)
        else GOOD
    )
    path = write_parquet(tmp_path / "p.parquet", [good, bad])
    with pytest.raises(ValueError) as raised:
        load_prompts(path)
    assert str(raised.value).startswith(f"{path} 0-based row 1: {message}")
    skipped = load_prompts(path, skip_bad_rows=True)
    assert skipped.rows == [PromptRow(id="0", prompt=GOOD["prompt"], answer="5")]
    assert len(skipped.skipped) == 1 and skipped.skipped[0].startswith(f"{path} 0-based row 1: ")


def test_skip_mode_counts_every_bad_row_of_a_parquet_file(tmp_path):
    rows = [
        GOOD,
        {"prompt": "x"},
        {"prompt": "", "answer": "1"},
        {"prompt": "Compute 7*6.", "answer": "42"},
        {"prompt": "y", "answer": "2", "id": [2]},
    ]
    path = write_parquet(tmp_path / "p.parquet", rows)
    loaded = load_prompts(path, skip_bad_rows=True)
    assert [r.id for r in loaded.rows] == ["0", "3"]
    assert [m.split(":")[0] for m in loaded.skipped] == [
        f"{path} 0-based row {i}" for i in (1, 2, 4)
    ]


def test_a_null_id_is_the_row_position(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{**GOOD, "id": "a"}, {**GOOD, "id": None}])
    assert [r.id for r in load_prompts(path).rows] == ["a", "1"]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_prompt_too_long_for_the_model_is_a_bad_row(tmp_path, suffix):
    # the counting tasks' chat template is the prompt's characters then ":", one token each: a
    # prompt of n characters is n + 1 tokens, and 16 positions hold n + 1 + 8 new tokens up to n = 7
    rows = [
        {"prompt": "7>12", "answer": "8 9 10 11 12"},
        {"prompt": "1234567>9", "answer": "no"},
        {"prompt": "12345>6", "answer": "6", "id": "fits-exactly"},
    ]
    path = tmp_path / f"train{suffix}"
    (write_jsonl if suffix == ".jsonl" else write_parquet)(path, rows)
    model = counting_model_folder(tmp_path / "model", max_position_embeddings=64)
    common = [
        "model=null",
        f"train.model_path={model}",
        f"data.train_file={path}",
        "train.max_position_embeddings=16",
        "rollout.max_new_tokens=8",
    ]
    where = f"{path}:2" if suffix == ".jsonl" else f"{path} 0-based row 1"
    message = (
        f"{where}: the prompt is 10 tokens in the chat template; with rollout.max_new_tokens (8) "
        "that is 18, more than the model's max_position_embeddings (16)"
    )
    with pytest.raises(ValueError) as raised:
        load_task(load_config(None, common))
    assert str(raised.value) == message
    task = load_task(load_config(None, common + ["data.skip_bad_rows=true"]))
    assert [row.id for row in task.rows] == ["0", "fits-exactly"] and task.skipped_rows == 1
    assert task.model.max_position_embeddings == 16
    # every kept row encodes at rollout time; the dropped one is refused there with the same reason
    assert len(encode_prompt(task, task.rows[1], None, 8)) == 8
    with pytest.raises(ValueError, match="prompt '1': the prompt is 10 tokens"):
        encode_prompt(task, PromptRow(id="1", prompt="1234567>9", answer="no"), None, 8)


def test_the_system_prompt_counts_toward_the_length(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "12345>6", "answer": "6"}])
    model = counting_model_folder(tmp_path / "model", max_position_embeddings=16)
    common = [
        "model=null",
        f"train.model_path={model}",
        f"data.train_file={path}",
        "rollout.max_new_tokens=8",
    ]
    assert load_task(load_config(None, common)).skipped_rows == 0
    with pytest.raises(ValueError, match=f"{path}: no usable rows \\(1 skipped\\)"):
        load_task(load_config(None, common + ["data.system_prompt='1'", "data.skip_bad_rows=true"]))


def test_a_synthetic_task_that_does_not_fit_the_model_is_a_config_error():
    tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu" / "train.yaml"
    assert load_task(load_config(tiny)).skipped_rows == 0
    cfg = load_config(tiny, ["model.max_position_embeddings=8", "rollout.max_new_tokens=4"])
    message = "data.synthetic_task 'count_up_and_stop': prompt '.*': the prompt is "
    with pytest.raises(ValueError, match=message):
        load_task(cfg)


@pytest.mark.parametrize("skip", [False, True])
def test_a_line_that_is_not_utf8_is_a_bad_row(tmp_path, skip):
    path = tmp_path / "p.jsonl"
    path.write_bytes(
        json.dumps(GOOD).encode()
        + b'\n{"prompt": "caf\xe9", "answer": "1"}\n'
        + json.dumps(ROWS[1]).encode()
        + b"\n"
    )
    if not skip:
        with pytest.raises(
            ValueError, match=f"^{path}:2: not valid UTF-8 \\(byte 0xe9 at column 16\\)$"
        ):
            load_prompts(path)
        return
    loaded = load_prompts(path, skip_bad_rows=True)
    assert [row.prompt for row in loaded.rows] == [GOOD["prompt"], "Compute 7*6."]
    assert loaded.skipped == [f"{path}:2: not valid UTF-8 (byte 0xe9 at column 16)"]


@pytest.mark.parametrize("answer", [float("nan"), float("inf")])
def test_a_missing_number_in_parquet_is_not_an_answer(tmp_path, answer):
    path = write_parquet(
        tmp_path / "p.parquet", [{"prompt": "x", "answer": 5.0}, {"prompt": "y", "answer": answer}]
    )
    with pytest.raises(
        ValueError,
        match=f"0-based row 1: field 'answer' must be a non-empty string "
        f"or a finite number, got {answer}",
    ):
        load_prompts(path)
    assert load_prompts(path, skip_bad_rows=True).skipped[0].startswith(f"{path} 0-based row 1: ")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_prompt_the_tokenizer_cannot_encode_is_a_bad_row(tmp_path, suffix):
    # the counting tasks' tokenizer knows digits and a few signs only, and has no unknown token
    rows = [{"prompt": "7>9", "answer": "8 9"}, {"prompt": "7>x", "answer": "no"}]
    path = tmp_path / f"train{suffix}"
    (write_jsonl if suffix == ".jsonl" else write_parquet)(path, rows)
    model = counting_model_folder(tmp_path / "model", max_position_embeddings=64)
    common = [
        "model=null",
        f"train.model_path={model}",
        f"data.train_file={path}",
        "rollout.max_new_tokens=8",
    ]
    where = f"{path}:2" if suffix == ".jsonl" else f"{path} 0-based row 1"
    with pytest.raises(ValueError, match=f"^{where}: the tokenizer cannot encode the prompt "):
        load_task(load_config(None, common))
    task = load_task(load_config(None, common + ["data.skip_bad_rows=true"]))
    assert [row.prompt for row in task.rows] == ["7>9"] and task.skipped_rows == 1

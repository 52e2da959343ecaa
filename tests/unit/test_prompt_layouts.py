"""Prompt sets in the layouts of other trainers' data (verl's chat messages and nested reward
field, OpenRLHF's keys), read from JSONL and parquet files the test writes, with bad rows named
by file, line and field."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from bapo_megatron.config.loading import load_config
from bapo_megatron.data.experience import row_from_plain, row_to_plain
from bapo_megatron.data.prompts import PromptRow, chat_messages, load_prompts
from bapo_megatron.data.record_fields import ChatMessage
from bapo_megatron.data.task import encode_prompt, load_task
from tests.helpers.prompt_files import counting_model_folder, write_jsonl, write_parquet

# verl's preprocessed GSM8K / MATH / DAPO-Math-17k layout: chat messages, the answer nested in
# `reward_model`, the row described by `data_source` and `extra_info`
VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 2+3?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Half of one?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
        "extra_info": {"split": "train", "index": 1},
    },
]
VERL_WANT = [
    PromptRow(
        id="0",
        prompt=(ChatMessage(role="user", content="What is 2+3?"),),
        answer="5",
        data_source="openai/gsm8k",
        extra_info={"split": "train", "index": 0},
    ),
    PromptRow(
        id="1",
        prompt=(
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content="Half of one?"),
        ),
        answer="\\frac{1}{2}",
        data_source="DigitalLearningGmbH/MATH-lighteval",
        extra_info={"split": "train", "index": 1},
    ),
]


def test_verl_layout_is_read_from_parquet_and_jsonl(tmp_path):
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), parquet)
    assert pa.types.is_list(pq.read_schema(parquet).field("prompt").type)  # nested columns
    for path in (parquet, write_jsonl(tmp_path / "train.jsonl", VERL_ROWS)):
        loaded = load_prompts(path, answer_key="reward_model.ground_truth")
        assert loaded.rows == VERL_WANT and not loaded.skipped, path
    # a trainer checkpoint keeps rows as plain data, and gets them back
    plain = [row_to_plain(row) for row in VERL_WANT]
    torch.save(plain, tmp_path / "rows.pt")
    back = torch.load(tmp_path / "rows.pt", weights_only=True)
    assert [row_from_plain(p) for p in back] == VERL_WANT


def test_openrlhf_layout_names_its_own_keys(tmp_path):
    rows = [
        {"input": "What is 2+3?", "label": "5"},
        {"input": [{"role": "user", "content": "Compute 7*6."}], "label": 42},
        {"input": "Half of one?", "meta": {"label": "\\frac{1}{2}"}},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    loaded = load_prompts(path, prompt_key="input", answer_key="label", skip_bad_rows=True)
    assert loaded.rows == [
        PromptRow(id="0", prompt="What is 2+3?", answer="5"),
        PromptRow(id="1", prompt=(ChatMessage(role="user", content="Compute 7*6."),), answer="42"),
    ]
    assert loaded.skipped == [
        f"{path}:3: field 'label' must be a non-empty string or a finite number, got None"
    ]
    nested = load_prompts(path, prompt_key="input", answer_key="meta.label", skip_bad_rows=True)
    assert [row.answer for row in nested.rows] == ["\\frac{1}{2}"]
    assert nested.skipped[0] == f"{path}:1: field 'meta.label' is missing"


VERL_GOOD = {"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "1"}}


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {**VERL_GOOD, "prompt": [{"role": "bot", "content": "x"}]},
            "field 'prompt' message 0: 'role' must be one of ['system', 'user', 'assistant'], "
            "got 'bot'",
        ),
        (
            {**VERL_GOOD, "prompt": [{"role": "user", "content": "x"}, {"role": "user"}]},
            "field 'prompt' message 1: 'content' must be a string, got None",
        ),
        (
            {**VERL_GOOD, "prompt": ["x"]},
            "field 'prompt' message 0 must be an object with 'role' and 'content', got 'x'",
        ),
        ({**VERL_GOOD, "prompt": []}, "field 'prompt' is an empty list of chat messages"),
        (
            {**VERL_GOOD, "prompt": [{"role": "system", "content": "Be brief."}]},
            "field 'prompt' has no user message with text",
        ),
        (
            {**VERL_GOOD, "reward_model": {"style": "rule"}},
            "field 'reward_model.ground_truth' is missing ('reward_model' has no key "
            "'ground_truth')",
        ),
        (
            {"prompt": "x", "reward_model": None},
            "field 'reward_model.ground_truth' is missing ('reward_model' is null)",
        ),
        ({"prompt": "x"}, "field 'reward_model.ground_truth' is missing"),
        (
            {"prompt": "x", "reward_model": "rule"},
            "field 'reward_model.ground_truth': 'reward_model' is 'rule', not an object with a "
            "key 'ground_truth'",
        ),
        ({**VERL_GOOD, "data_source": 3}, "field 'data_source' must be a string, got 3"),
        ({**VERL_GOOD, "extra_info": [1]}, "field 'extra_info' must be an object, got [1]"),
    ],
)
def test_bad_rows_of_the_verl_layout_name_file_line_and_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "p.jsonl", [VERL_GOOD, bad])
    with pytest.raises(ValueError) as raised:
        load_prompts(path, answer_key="reward_model.ground_truth")
    assert str(raised.value) == f"{path}:2: {message}"
    skipped = load_prompts(path, answer_key="reward_model.ground_truth", skip_bad_rows=True)
    assert len(skipped.rows) == 1 and skipped.skipped == [f"{path}:2: {message}"]


def test_bad_rows_of_a_verl_parquet_file_name_the_row_and_nested_field(tmp_path):
    import datetime

    rows = [
        VERL_ROWS[0],
        {**VERL_ROWS[0], "reward_model": None},
        {**VERL_ROWS[0], "reward_model": {"style": "rule", "ground_truth": None}},
        {**VERL_ROWS[0], "prompt": [{"role": "tool", "content": "x"}]},
    ]
    path = write_parquet(tmp_path / "p.parquet", rows)
    loaded = load_prompts(path, answer_key="reward_model.ground_truth", skip_bad_rows=True)
    assert loaded.rows == VERL_WANT[:1]
    assert loaded.skipped == [
        f"{path} 0-based row 1: field 'reward_model.ground_truth' is missing "
        "('reward_model' is null)",
        f"{path} 0-based row 2: field 'reward_model.ground_truth' must be a non-empty string "
        "or a finite number, got None",
        f"{path} 0-based row 3: field 'prompt' message 0: 'role' must be one of "
        "['system', 'user', 'assistant'], got 'tool'",
    ]
    # extra_info must stay plain data (a checkpoint holds it): a timestamp is refused
    stamped = {**VERL_ROWS[0], "extra_info": {"at": datetime.datetime(2026, 1, 1)}}
    path = write_parquet(tmp_path / "t.parquet", [stamped])
    with pytest.raises(ValueError, match=r"0-based row 0: field 'extra_info.at' holds a datetime"):
        load_prompts(path, answer_key="reward_model.ground_truth")


@pytest.mark.parametrize("key", ["", "reward_model.", "a..b"])
def test_a_key_that_is_not_a_path_is_refused(key):
    with pytest.raises(ValueError, match="data.answer_key must be a field name or a dotted path"):
        load_config(None, ["model=null", "data.train_file=x.jsonl", f"data.answer_key='{key}'"])


def test_the_trainer_reads_the_verl_layout_with_its_keys(tmp_path):
    rows = [
        {
            "data_source": "count_to",
            "prompt": [{"role": "user", "content": "7>12"}],
            "reward_model": {"style": "rule", "ground_truth": "8 9 10 11 12"},
            "extra_info": {"index": 0},
        },
        {
            "data_source": "count_to",
            "prompt": [{"role": "system", "content": "1"}, {"role": "user", "content": "3>5"}],
            "reward_model": {"style": "rule", "ground_truth": "4 5"},
            "extra_info": {"index": 1},
        },
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    model = counting_model_folder(tmp_path / "model", max_position_embeddings=64)
    cfg = load_config(
        None,
        [
            "model=null",
            f"train.model_path={model}",
            f"data.train_file={path}",
            "data.answer_key=reward_model.ground_truth",
            "data.system_prompt='2'",
            "rollout.max_new_tokens=8",
        ],
    )
    task = load_task(cfg)
    assert [(r.answer, r.data_source, r.extra_info) for r in task.rows] == [
        ("8 9 10 11 12", "count_to", {"index": 0}),
        ("4 5", "count_to", {"index": 1}),
    ]
    # the counting template writes the turns' texts, then ":"; the configured system turn comes
    # before a prompt without one, a prompt's own system message replaces it
    encode = task.tokenizer.convert_tokens_to_ids
    assert encode_prompt(task, task.rows[0], "2", 8) == encode(list("27>12:"))
    assert encode_prompt(task, task.rows[1], "2", 8) == encode(list("13>5:"))


def test_the_readme_example_is_read_as_the_readme_says(tmp_path, monkeypatch):
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("## Bring your own data")
    section = readme[start : readme.index("\n## ", start + 1)]
    code = section.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})  # writes train.parquet
    answer_key = re.search(r"data\.answer_key=([\w.]+)", section).group(1)
    [row] = load_prompts(tmp_path / "train.parquet", answer_key=answer_key).rows
    assert row.answer == "42" and row.data_source == "openai/gsm8k"
    assert chat_messages(row) == [
        {"role": "user", "content": "What is 6 times 7? Put the answer in \\boxed{}."}
    ]

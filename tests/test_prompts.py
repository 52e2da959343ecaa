"""Prompt sets from JSONL and parquet files the test writes, and the chat template."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from bapo_megatron.data.prompts import PromptRow, load_prompts, prompt_token_ids

ROWS = [{"prompt": "What is 2+3?", "answer": "5", "id": "a"},
        {"prompt": "Compute 7*6.", "answer": 42},
        {"prompt": "Half of one?", "answer": "\\frac{1}{2}", "id": 7}]


def write_jsonl(path, records, extra_lines=()):
    path.write_text("\n".join([json.dumps(r) for r in records] + list(extra_lines)) + "\n")
    return path


def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    jsonl = load_prompts(write_jsonl(tmp_path / "p.jsonl", ROWS))
    table = pa.Table.from_pylist([{**r, "answer": str(r["answer"]), "id": str(r.get("id", i))}
                                  for i, r in enumerate(ROWS)])
    pq.write_table(table, tmp_path / "p.parquet")
    parquet = load_prompts(tmp_path / "p.parquet")
    want = [PromptRow(id="a", prompt="What is 2+3?", answer="5"),
            PromptRow(id="1", prompt="Compute 7*6.", answer="42"),
            PromptRow(id="7", prompt="Half of one?", answer="\\frac{1}{2}")]
    assert jsonl.rows == want and parquet.rows == want and not jsonl.skipped


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "", "answer": "1"}', "field 'prompt' must be a non-empty string"),
    ('{"prompt": "x"}', "field 'answer' must be a non-empty string or a number, got None"),
    ('{"prompt": "x", "answer": true}', "field 'answer'"),
    ('{"prompt": "x", "answer": "1", "id": [1]}', "field 'id'"),
    ('[1, 2]', "expected an object"),
    ('{"prompt": "x", "answer": ', "not valid JSON"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS[:1], [bad])
    with pytest.raises(ValueError, match=f"{path}:2: .*{message}".replace("[", r"\[").replace("(", r"\(")):
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


def test_chat_template_wraps_the_prompt():
    words = ["<pad>", "<user>", "<assistant>", "<system>", "</turn>", "What", "is", "2+3?", "Be", "brief."]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </turn> "
                               "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    row = PromptRow(id="0", prompt="What is 2+3?", answer="5")
    assert prompt_token_ids(tokenizer, row) == [1, 5, 6, 7, 4, 2]
    assert prompt_token_ids(tokenizer, row, system="Be brief.") == [3, 8, 9, 4, 1, 5, 6, 7, 4, 2]

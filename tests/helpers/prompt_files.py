"""Prompt files the tests write: JSONL lines and parquet rows from dicts, and a model folder
whose context the prompts must fit."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq


def write_jsonl(path, records, extra_lines=()):
    path.write_text("\n".join([json.dumps(r) for r in records] + list(extra_lines)) + "\n")
    return path


def write_parquet(path, records):
    # pyarrow takes the columns from the first record only; a key missing from a record is null
    columns = list(dict.fromkeys(key for record in records for key in record))
    pq.write_table(
        pa.Table.from_pylist([{key: r.get(key) for key in columns} for r in records]), path
    )
    return path


def counting_model_folder(folder, max_position_embeddings):
    """An HF folder with a config.json (no weights: the task reads only the architecture) and
    the counting tasks' one-token-per-character tokenizer."""
    import transformers

    from bapo_megatron.data.synthetic_task import counting_tokenizer

    tokenizer = counting_tokenizer()
    transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder

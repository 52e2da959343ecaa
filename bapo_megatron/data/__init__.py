"""Training data: prompt sets read from JSONL/parquet (:mod:`.prompts`)."""

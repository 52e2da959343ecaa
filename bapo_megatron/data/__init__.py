"""Training data: prompt sets read from JSONL/parquet (:mod:`.prompts`), synthetic tasks with
their own tokenizer (:mod:`.synthetic_task`), and integer arithmetic prompt sets for real chat
models (:mod:`.arithmetic_task`, ``bapo-make-arithmetic``)."""

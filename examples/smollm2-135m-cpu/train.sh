#!/usr/bin/env bash
# Trains the recipe on the model and prompts prepare.sh wrote ($BAPO_CACHE, by default
# ~/.cache/bapo-megatron); extra arguments are dotted overrides (rollout.engine=vllm ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
cache="${BAPO_CACHE:-$HOME/.cache/bapo-megatron}"
exec python3 -m bapo_megatron.train --config examples/smollm2-135m-cpu/train.yaml \
    train.model_path="$cache/models/SmolLM2-135M-Instruct" \
    data.train_file="$cache/data/arithmetic/train.jsonl" "$@"

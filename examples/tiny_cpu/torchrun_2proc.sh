#!/usr/bin/env bash
# The tiny CPU run over 2 processes with torchrun: tensor parallel by default, or pipeline
# parallel with LAYOUT=pp2. One thread per process (the machine has 2 cores). Extra arguments
# are dotted overrides, e.g. train.steps=20.
#   bash examples/tiny_cpu/torchrun_2proc.sh train.steps=20
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${LAYOUT:-tp2}" in
  tp2) layout=(parallel.tensor_model_parallel_size=2) ;;
  pp2) layout=(parallel.pipeline_model_parallel_size=2) ;;
  *) echo "LAYOUT must be tp2 or pp2, got ${LAYOUT}" >&2; exit 2 ;;
esac
export OMP_NUM_THREADS=1
exec python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m bapo_megatron.train \
  --config examples/tiny_cpu/train.yaml "${layout[@]}" \
  train.output_dir="runs/tiny_cpu_${LAYOUT:-tp2}" "$@"

#!/usr/bin/env bash
# The tiny CPU run with its rollout engine on a process of its own: torchrun starts 2 processes,
# rank 0 trains and rank 1 (rollout.engine_ranks=1, the last rank) runs the embedded engine;
# prompts, samples and weights travel between them over gloo groups (rollout.placement=
# disaggregated, docs/async-design.md). algorithm.max_staleness=4 lets the engine generate the
# next rollout step while the trainer learns: with the run's 4 optimizer steps per rollout step,
# each rollout step moves the policy 4 versions, so eta=4 admits one step ahead (the asynchronous
# loop, docs/async-design.md). algorithm.max_staleness=0 keeps the synchronous loop, whose
# numbers are bitwise those of the one-process run. One thread per process (the machine has 2
# cores). Extra arguments are dotted overrides, e.g. train.steps=20.
#   bash examples/tiny_cpu/torchrun_async.sh train.steps=20
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
exec python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m bapo_megatron.train \
  --config examples/tiny_cpu/train.yaml \
  rollout.placement=disaggregated rollout.engine_ranks=1 algorithm.max_staleness=4 \
  train.output_dir=runs/tiny_cpu_async "$@"

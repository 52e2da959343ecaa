#!/usr/bin/env bash
# Launch bapo_megatron.trainer.loop with torchrun on this node; run it once on every node of the job.
#
#   usage: examples/launch/torchrun_multinode.sh CONFIG.yaml [dotted.key=value ...]
#
# Run from the repository root with the package installed (pip install -e .): CONFIG and the
# paths inside it are read relative to the current directory. The job's shape comes from the
# environment (defaults: one node, 8 GPUs):
#   NNODES         nodes in the job                      (default 1)
#   NODE_RANK      this node's index, 0 .. NNODES-1      (default 0)
#   MASTER_ADDR    address of node 0, reachable by all   (default 127.0.0.1)
#   MASTER_PORT    a free TCP port on node 0             (default 29500)
#   GPUS_PER_NODE  ranks started on this node            (default 8)
# e.g. on the second of two nodes:
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 examples/launch/torchrun_multinode.sh \
#     examples/qwen2.5-7b/train.yaml train.steps=10
# BAPO_DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
CONFIG=$1
shift

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

# Megatron: with one hardware queue per device, kernels run in the order they are issued, which
# its tensor/sequence-parallel communication overlap relies on (Megatron asks for it whenever
# sequence_parallel is on).
export CUDA_DEVICE_MAX_CONNECTIONS=1
# Hugging Face tokenizers start threads; each rank is its own process already.
export TOKENIZERS_PARALLELISM=false
# Not set on purpose: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. vLLM's sleep mode
# (which the colocated engine is started with) refuses expandable segments.

# NCCL, site-specific; uncomment what your cluster needs.
# export NCCL_SOCKET_IFNAME=eth0          # interface for NCCL's bootstrap and socket transport
# export NCCL_IB_HCA=mlx5                 # InfiniBand adapters to use between nodes
# export NCCL_IB_GID_INDEX=3              # RoCE clusters
# export NCCL_DEBUG=WARN                  # INFO to see the rings/trees and transports chosen
# export NCCL_NVLS_ENABLE=0               # if NVLink SHARP fails to initialise on your nodes
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # a failed collective ends the job instead of hanging

command=(torchrun
    --nnodes "$NNODES"
    --nproc-per-node "$GPUS_PER_NODE"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
    -m bapo_megatron.train --config "$CONFIG" "$@")

if [[ -n "${BAPO_DRY_RUN:-}" ]]; then
    printf '%q ' "${command[@]}"
    printf '\n'
    exit 0
fi
exec "${command[@]}"

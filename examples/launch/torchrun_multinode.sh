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
#
# Disaggregated runs (rollout.placement=disaggregated): torchrun numbers the ranks node by node
# (static rendezvous on MASTER_ADDR:MASTER_PORT, node NODE_RANK's ranks after those of the nodes
# before it), and the last rollout.engine_ranks ranks run the engines, so the first nodes train
# and the last ones generate. Engine nodes may start another number of ranks than trainer nodes:
#   ENGINE_NODES          the last nodes of the job, which only generate  (default 0)
#   ENGINE_RANKS_PER_NODE ranks started on each of them                   (default GPUS_PER_NODE)
# e.g. examples/qwen2.5-32b/train_async.yaml: 4 trainer nodes x 8 ranks, then 2 nodes with one
# engine rank each (an SGLang engine over the node's 8 GPUs), on every node i of 0..5:
#   NNODES=6 NODE_RANK=i ENGINE_NODES=2 ENGINE_RANKS_PER_NODE=1 MASTER_ADDR=10.0.0.1 \
#     examples/launch/torchrun_multinode.sh examples/qwen2.5-32b/train_async.yaml
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
ENGINE_NODES=${ENGINE_NODES:-0}
ENGINE_RANKS_PER_NODE=${ENGINE_RANKS_PER_NODE:-$GPUS_PER_NODE}

if ((NODE_RANK < 0 || NODE_RANK >= NNODES)); then
    echo "NODE_RANK=$NODE_RANK must lie in 0 .. NNODES-1 = $((NNODES - 1))" >&2
    exit 2
fi
if ((ENGINE_NODES < 0 || ENGINE_NODES >= NNODES)); then
    echo "ENGINE_NODES=$ENGINE_NODES must leave at least one of the NNODES=$NNODES nodes to" \
        "train (0 .. $((NNODES - 1)))" >&2
    exit 2
fi
# The last ENGINE_NODES nodes start ENGINE_RANKS_PER_NODE ranks; torchrun gives each node's
# ranks the global ranks after those of the nodes before it, whatever their count.
NPROC_PER_NODE=$GPUS_PER_NODE
if ((NODE_RANK >= NNODES - ENGINE_NODES)); then
    NPROC_PER_NODE=$ENGINE_RANKS_PER_NODE
fi

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

# Static rendezvous: node 0's agent serves the store on MASTER_ADDR:MASTER_PORT and each node
# keeps the NODE_RANK it is given (a dynamic rendezvous would number the nodes in join order).
command=(torchrun
    --rdzv-backend static
    --nnodes "$NNODES"
    --nproc-per-node "$NPROC_PER_NODE"
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

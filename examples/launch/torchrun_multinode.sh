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
#   MAX_RESTARTS   times torchrun restarts the job's workers in place after one fails; each
#                  restart resumes from the newest checkpoint     (default 3; 0: none)
#   RDZV_ID        the job's rendezvous id, the same on every node (default bapo-MASTER_PORT)
#   RDZV_READ_TIMEOUT  seconds a node waits for node 0's rendezvous store      (default 300)
#   LOCAL_ADDR     this node's address as the others reach it   (default: its host name)
# e.g. on the second of two nodes:
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 examples/launch/torchrun_multinode.sh \
#     examples/deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml train.steps=10
#
# Disaggregated runs (rollout.placement=disaggregated): the trainer numbers the ranks node by
# node in NODE_RANK order (BAPO_NODE_RANK, bapo_megatron/distributed/startup.py), and the last
# rollout.engine_ranks ranks run the engines, so the first nodes train and the last ones
# generate. Engine nodes may start another number of ranks than trainer nodes:
#   ENGINE_NODES          the last nodes of the job, which only generate  (default 0)
#   ENGINE_RANKS_PER_NODE ranks started on each of them                   (default GPUS_PER_NODE)
# e.g. examples/deepseek-r1-distill-qwen-32b/train_async.yaml: 4 trainer nodes x 8 ranks, then 2
# nodes with one engine rank each (a vLLM engine over the node's 8 GPUs), on every node i of 0..5:
#   NNODES=6 NODE_RANK=i ENGINE_NODES=2 ENGINE_RANKS_PER_NODE=1 MASTER_ADDR=10.0.0.1 \
#     examples/launch/torchrun_multinode.sh examples/deepseek-r1-distill-qwen-32b/train_async.yaml
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
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_ID=${RDZV_ID:-bapo-$MASTER_PORT}

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

# Restarts in place (--max-restarts): when a worker dies, torchrun stops this node's workers,
# and the nodes meet again in a new round of the rendezvous and start them all anew; the trainer
# resumes from its newest verified checkpoint, so a restart costs the steps since then.
# c10d rendezvous, not static: a static one never tells the other nodes' agents that one node's
# workers restarted (theirs go on until a collective with the dead rank fails, with NCCL at the
# collective timeout, and each node counts its restarts alone), and it always shares its store
# with the workers. A c10d restart starts a new round on every node at once;
# node 0's agent serves it on MASTER_ADDR:MASTER_PORT (is_host), the others wait up to
# read_timeout seconds for it. It orders the nodes by address, not NODE_RANK: the trainer
# orders the ranks by BAPO_NODE_RANK itself.
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each round's workers get a store of their own (served by
# rank 0 on a free port) instead of sharing the agents', where the restarted workers would read
# the dead attempt's addresses and fail or hang in init_process_group
# (https://github.com/pytorch/pytorch/issues/135712).
IS_HOST=false
if ((NODE_RANK == 0)); then
    IS_HOST=true
fi
# LOCAL_ADDR (--local-addr): where the node torchrun ranks first serves its workers' store.
command=(env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "BAPO_NODE_RANK=$NODE_RANK"
    torchrun
    --rdzv-backend c10d
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
    --rdzv-id "$RDZV_ID"
    --rdzv-conf "is_host=$IS_HOST,read_timeout=${RDZV_READ_TIMEOUT:-300}"
    ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"}
    --nnodes "$NNODES"
    --nproc-per-node "$NPROC_PER_NODE"
    --max-restarts "$MAX_RESTARTS"
    -m bapo_megatron.train --config "$CONFIG" "$@")

if [[ -n "${BAPO_DRY_RUN:-}" ]]; then
    printf '%q ' "${command[@]}"
    printf '\n'
    exit 0
fi
exec "${command[@]}"

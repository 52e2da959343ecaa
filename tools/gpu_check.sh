#!/usr/bin/env bash
# The GPU check on a machine with one CUDA GPU (docs/gpu-checks.md): every path of this project
# that one GPU can run, compared with float32 CPU references, in about 8 minutes on an H100.
#
#   bash tools/gpu_check.sh [OUT_FOLDER] [extra arguments of bapo_megatron.device_check.run]
#   GPU_PASS=te bash tools/gpu_check.sh [OUT_FOLDER] [...]     # the Transformer Engine pass
#   GPU_PASS=vllm bash tools/gpu_check.sh [OUT_FOLDER] [...]   # the vLLM pass
#
# Packages the GPU image lacks travel as wheels in .whl/ (megatron-core 0.16.1, math-verify and
# its parser) and, for the second pass against a newer Megatron-Core, .whl19/ (megatron-core
# 0.19.x); fetch them on a machine with pip (tools/gpu_carry.py base; docs/gpu-checks.md). They
# are installed into folders under /tmp with --target, never over the image's torch. Without
# .whl/ the packages must be importable already. The report (device_check*.json and .md) goes
# to OUT_FOLDER (default: $OUT, else runs/gpu_check).
#
# GPU_PASS=te|vllm runs that pass instead (and nothing else): its package set, carried in parts
# stashed under /root/parts (tools/gpu_carry.py, tools/gpu_parts.py), is joined and installed
# by tools/gpu_install.sh (Transformer Engine's extension built there), then the pass's checks
# run, labelled te / vllm unless --label says otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-runs/gpu_check}}"
shift || true
export PYTHONUNBUFFERED=1
base_path="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/bapo-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/bapo-site:$base_path"
else
    export PYTHONPATH="$base_path"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
status=0
pass="${GPU_PASS:-}"
if [ -n "$pass" ]; then
    site="$(bash tools/gpu_install.sh "$pass")" || exit 1
    reference_path="$PYTHONPATH"  # the float32 CPU references: without TE, which needs CUDA
    export PYTHONPATH="$site:$PYTHONPATH"
    case "$pass" in
        te) python3 -m bapo_megatron.device_check.run --device cuda --out "$out" --spec te \
                --label te --reference-pythonpath "$reference_path" "$@" || status=1 ;;
        # flashinfer is not carried (it compiles at run time); vLLM 0.26 runs dense models on
        # Model Runner V2, whose sampler the full-vocabulary log-prob hook does not know yet
        vllm) VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
                VLLM_USE_V2_MODEL_RUNNER=0 python3 -m bapo_megatron.device_check.run \
                --device cuda --out "$out" --only vllm --label vllm --check-timeout 420 \
                "$@" || status=1 ;;
        *) echo "GPU_PASS must be te or vllm, got $pass" >&2; exit 2 ;;
    esac
    exit $status
fi
python3 -m bapo_megatron.device_check.run --device cuda --out "$out" "$@" || status=1
if [ -d .whl19 ] && [ -z "${SKIP_MCORE19:-}" ]; then
    # the same actor and loop checks against megatron-core 0.19.x (math-verify from .whl/); the
    # float32 CPU references they compare with stay on 0.16.1, which the CPU patches are for
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/bapo-site19 .whl19/*.whl || exit 1
    PYTHONPATH="/tmp/bapo-site19:$PYTHONPATH" python3 -m bapo_megatron.device_check.run \
        --device cuda --out "$out" --label mcore-0.19 \
        --reference-pythonpath "$PYTHONPATH" \
        --only "${MCORE19_CHECKS:-actor_tiny,actor_moe,loop_tiny,resume,loop_moe}" || status=1
fi
exit $status

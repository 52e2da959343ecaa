#!/usr/bin/env bash
# The GPU check on a machine with one CUDA GPU (docs/gpu-checks.md): every path of this project
# that one GPU can run, compared with float32 CPU references, in about 8 minutes on an H100.
#
#   bash tools/gpu_check.sh [OUT_FOLDER] [extra arguments of bapo_megatron.device_check.run]
#
# Packages the GPU image lacks travel as wheels in .whl/ (megatron-core 0.16.1, math-verify and
# its parser) and, for the second pass against a newer Megatron-Core, .whl19/ (megatron-core
# 0.19.x); fetch them on a machine with pip (docs/gpu-checks.md says how). They are installed
# into folders under /tmp with --target, never over the image's torch. Without .whl/ the
# packages must be importable already. The report (device_check*.json and .md) goes to
# OUT_FOLDER (default: $OUT, else runs/gpu_check).
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

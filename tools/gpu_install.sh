#!/usr/bin/env bash
# Install a carried package set on the lent GPU machine (docs/gpu-checks.md): join its parts
# stashed under /root/parts (tools/gpu_parts.py; every SHA-256 checked), install its wheels with
# pip --target into /tmp/SET-site (never over the image's torch), and for `te` build Transformer
# Engine's PyTorch extension against the image's torch (about 3 minutes on 16 cores) unless the
# set carries a built one; a built wheel of at most 16 MiB is copied to $OUT, to be carried
# next time (tools/gpu_carry.py te --built WHEEL). A set installed earlier on this warm machine is
# left as it is. The last line printed is the site folder to put first on PYTHONPATH.
#
#   bash tools/gpu_install.sh te|vllm
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:?usage: gpu_install.sh te|vllm}"
unpacked="/root/carry/$name"
site="/tmp/$name-site"
stamp="$site/.bapo-installed"
if [ -f "$stamp" ]; then
    echo "gpu_install: $name already installed in $site" >&2
    echo "$site"
    exit 0
fi
rm -rf "$unpacked" "$site"
PYTHONPATH=. python3 tools/gpu_parts.py --parts "${GPU_PARTS:-/root/parts}" join "$name" \
    --out "$unpacked" >&2
install_into() {  # target folder, wheels
    local target="$1"
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" \
        "$@" >&2
}
shopt -s nullglob
tools=("$unpacked"/setuptools-*.whl "$unpacked"/wheel-*.whl)  # te: for the build only
wheels=()
for wheel in "$unpacked"/*.whl; do
    case " ${tools[*]} " in *" $wheel "*) ;; *) wheels+=("$wheel") ;; esac
done
install_into "$site" "${wheels[@]}"
sources=("$unpacked"/transformer_engine_torch-*.tar.gz)
if [ "$name" = te ] && [ ${#sources[@]} -eq 1 ]; then  # no built extension was carried
    build=/root/te-build
    rm -rf "$build" /tmp/te-build-tools
    mkdir -p "$build"
    install_into /tmp/te-build-tools "${tools[@]}"
    # the image's CUDA wheels carry the headers (cudnn.h among them); gcc reads CPATH
    nvidia="$(python3 -c 'import nvidia; print(":".join(nvidia.__path__))' 2>/dev/null || true)"
    includes="$(IFS=:; for root in $nvidia; do ls -d "$root"/*/include; done | paste -sd:)"
    cudnn="$(IFS=:; for root in $nvidia; do ls -d "$root/cudnn"; done | head -1)"
    echo "gpu_install: CUDA headers from ${includes:-the toolkit only}; CUDNN_PATH=$cudnn" >&2
    began=$SECONDS
    echo "gpu_install: building transformer_engine_torch (MAX_JOBS=${MAX_JOBS:-16})" >&2
    NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-16}" \
        CUDNN_PATH="${CUDNN_PATH:-$cudnn}" CPATH="$includes${CPATH:+:$CPATH}" \
        PYTHONPATH="/tmp/te-build-tools:$site${PYTHONPATH:+:$PYTHONPATH}" \
        python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$build" \
        "${sources[0]}" >&2
    echo "gpu_install: built in $((SECONDS - began)) s" >&2
    built=("$build"/transformer_engine_torch-*.whl)
    install_into "$site" "${built[0]}"
    if [ -n "${OUT:-}" ] && [ "$(stat -c %s "${built[0]}")" -le $((16 * 2**20)) ]; then
        mkdir -p "$OUT" && cp "${built[0]}" "$OUT/"
    fi
fi
touch "$stamp"
echo "$site"

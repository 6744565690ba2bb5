#!/usr/bin/env bash
# Registers and spills of every kernel in crates/dynmoe/src/backend/cuda/kernels/, as the
# backend builds them (NVRTC's PTX for compute_90, then ptxas for sm_90), on a machine
# without a GPU or a CUDA toolkit: NVRTC and ptxas come from NVIDIA's PyPI wheels, cached
# in $PTXAS_CACHE (default ~/.cache/dynmoe-ptxas). Arguments are kernel constants, as
# the backend takes them (DYNMOE_CUDA=define=NAME=VALUE):
#
#   bash tools/ptxas-resources/run.sh [DMMA_UNITS=8 ...] | grep dense_mma
#   bash tools/ptxas-resources/run.sh --check tools/ptxas-resources/spills.txt
#
# --check (CI runs it) fails when a kernel spills more than spills.txt allows.
# A spill here is a spill on the GPU (the GPU script's `resources` step reads nvcc's);
# the toolkit version may differ from the device's by a register or two.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# The toolkit of the GPU machine the backend is measured on (CUDA 13.0).
version=13.0.88
cache=${PTXAS_CACHE:-$HOME/.cache/dynmoe-ptxas}/$version
fetch() {
    if ! python3 -m pip --version > /dev/null 2>&1 && [ "$(id -u)" = 0 ] &&
        command -v apt-get > /dev/null; then
        apt-get update -qq && apt-get install -y -qq python3-pip > /dev/null
    fi
    mkdir -p "$cache/wheels" &&
        python3 -m pip download --quiet --no-deps -d "$cache/wheels" \
            "nvidia-cuda-nvcc==$version" "nvidia-cuda-nvrtc==$version" &&
        for w in "$cache"/wheels/*.whl; do python3 -m zipfile -e "$w" "$cache" || return 1; done &&
        chmod +x "$cache"/nvidia/cu13/bin/*
}
if [ ! -x "$cache/nvidia/cu13/bin/ptxas" ] || ! ls "$cache"/nvidia/cu13/lib/libnvrtc.so* > /dev/null 2>&1; then
    # PTXAS_OPTIONAL=1: a machine that cannot fetch the wheels says so and skips.
    if ! fetch; then
        [ "${PTXAS_OPTIONAL:-0}" = 1 ] && echo "ptxas-resources: skipped, NVRTC and ptxas $version not fetched from PyPI" && exit 0
        echo "ptxas-resources: could not fetch NVRTC and ptxas $version from PyPI" >&2
        exit 1
    fi
fi
# NVRTC opens its builtins library by name.
export LD_LIBRARY_PATH="$cache/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}"
python3 "$here/resources.py" "$cache" "$here/../../crates/dynmoe/src/backend/cuda/kernels/program.cu" "$@"

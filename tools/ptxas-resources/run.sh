#!/usr/bin/env bash
# Registers and spills of every kernel in crates/dynmoe/src/backend/cuda/kernels.cu, as the
# backend builds them (NVRTC's PTX for compute_90, then ptxas for sm_90), on a machine
# without a GPU or a CUDA toolkit: NVRTC and ptxas come from NVIDIA's PyPI wheels, cached
# in $PTXAS_CACHE (default ~/.cache/dynmoe-ptxas). Arguments are kernel constants, as
# DYNMOE_CUDA_DEFINES takes them:
#
#   bash tools/ptxas-resources/run.sh [DMMA_UNITS=8 ...] | grep dense_mma
#
# A spill here is a spill on the GPU (the GPU script's `resources` step reads nvcc's);
# the toolkit version may differ from the device's by a register or two.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${PTXAS_CACHE:-$HOME/.cache/dynmoe-ptxas}
if [ ! -x "$cache/nvidia/cu13/bin/ptxas" ] || ! ls "$cache"/nvidia/cu13/lib/libnvrtc.so* > /dev/null 2>&1; then
    mkdir -p "$cache/wheels"
    python3 -m pip download --quiet --no-deps -d "$cache/wheels" nvidia-cuda-nvcc nvidia-cuda-nvrtc
    for w in "$cache"/wheels/*.whl; do python3 -m zipfile -e "$w" "$cache"; done
    chmod +x "$cache"/nvidia/cu13/bin/*
fi
python3 "$here/resources.py" "$cache" "$here/../../crates/dynmoe/src/backend/cuda/kernels.cu" "$@"

#!/usr/bin/env bash
# Runs the dense affine one-row kernels, the routed kernels, the decode step attention and the step's end (argmax, advance) of crates/dynmoe/src/backend/cuda/kernels/ on the CPU
# (shim.h: a fiber per CUDA thread) against check.cpp's reference; no GPU needed. Takes
# a few minutes; `run.sh dense`, `route`, `affine`, `gemm`, `attention`, `decode` or `routed` runs one family. CXX picks the compiler (default g++; any C++17 compiler will do); CXXFLAGS may set the kernels' tunable constants (-DRMMA_GATE_UP_UNITS=2).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$here/prepare.py" "$here/../../crates/dynmoe/src/backend/cuda/kernels/program.cu" \
    "$work/kernels_host.cpp"
cp "$here/shim.h" "$here/check.cpp" "$here/sample_cases.txt" "$work/"
# The kernels' own code is written for nvcc; its warnings here say nothing about it.
"${CXX:-g++}" -std=c++17 -O2 -w ${CXXFLAGS:-} -I"$work" -o "$work/check" "$work/check.cpp"
"$work/check" "$@"

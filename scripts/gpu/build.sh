#!/usr/bin/env bash
# Builds the executables scripts/gpu/run.sh needs (Linux x86-64, CUDA not required) and
# copies them, stripped, with run.sh, kernel_times.py, pdl_order.sh and the kernels' sources
# (program.cu and the files it includes, for nvcc there), into the directory given (default
# .gpu/).
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.gpu}
mkdir -p "$dest"
cargo build --release --features cuda -p dynmoe-cli
tests=$(cargo test --release -p dynmoe --features cuda --test cuda --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
bench=$(cargo bench -p dynmoe --features cuda --bench cuda_kernels --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
cpu_vq=$(cargo bench -p dynmoe --features cuda --bench vq_kernels --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
cp target/release/dynmoe "$dest/dynmoe"
cp "$tests" "$dest/cuda-tests"
cp "$bench" "$dest/cuda_kernels"
cp "$cpu_vq" "$dest/vq_kernels"
strip "$dest/dynmoe" "$dest/cuda-tests" "$dest/cuda_kernels" "$dest/vq_kernels"
cp scripts/gpu/run.sh scripts/gpu/kernel_times.py scripts/gpu/pdl_order.sh "$dest/"
cp crates/dynmoe/src/backend/cuda/kernels/* "$dest/"
du -sh "$dest"

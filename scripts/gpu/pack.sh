#!/usr/bin/env bash
# Builds the GPU executables (scripts/gpu/build.sh) and packs the three that run.sh needs
# into one xz archive, .gpux/gpu.tar.xz: the repository with its fixtures is close to what
# a copy to the GPU machine may carry, and the executables share most of their code, which
# one archive with a large dictionary compresses about 5×. There, from the repository root:
#
#   mkdir -p .gpu && python3 -c 'import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' \
#       .gpux/gpu.tar.xz | tar x -C .gpu && cp scripts/gpu/*.sh scripts/gpu/*.py \
#       crates/dynmoe/src/backend/cuda/kernels/* .gpu/ && BIN=.gpu bash .gpu/run.sh ...
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/gpu/build.sh .gpu
mkdir -p .gpux
tar cf - -C .gpu dynmoe cuda-tests cuda_kernels | xz -T2 -9e > .gpux/gpu.tar.xz.part
mv .gpux/gpu.tar.xz.part .gpux/gpu.tar.xz
du -h .gpux/gpu.tar.xz

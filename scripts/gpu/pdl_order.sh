#!/usr/bin/env bash
# Checks, on a machine with the CUDA toolkit, that no kernel touches global memory before
# its programmatic-launch wait (`griddepcontrol.wait`, ACQBULK in SASS). ptxas may hoist a
# load through a `const __restrict__` pointer (LDG.E.CONSTANT) above the wait, and the
# kernel then reads what the kernel before it has not yet written. The one-row dense
# kernels (bf16 and affine, rows and tiles, and the affine kernels of a few rows) load
# their first weights before the wait on
# purpose (no kernel writes weights), the grouped decode attention its position and the
# caches' earlier rows, the routed gate/up its input and the expert table, when asked
# (`early`: the kernel before starts them only after its own wait), and the routed down
# its first words once gate/up's flag says the route is written (`ready`); they are
# listed in EARLY. affine_tiles_from_rows runs on the copy stream, launched without
# programmatic launch, so it has no wait (PLAIN).
#
#   bash scripts/gpu/pdl_order.sh [program.cu] [arch]
set -euo pipefail
src=${1:-crates/dynmoe/src/backend/cuda/kernels/program.cu}
arch=${2:-sm_90}
EARLY="matvec_bf16_one matvec_bf16_3_one matvec_bf16_norm_one_late dense_mma_q4 dense_mma_q3 dense_mma_q2 dense_mma_norm_q4 dense_mma_norm_q3 dense_mma_norm_q2 attention_group_64 attention_group_128 attention_group_256 matvec_bf16_one_late routed_mma_gate_up_q3 dense_mma_tiled_q4 dense_mma_tiled_q2 dense_mma_norm_tiled_q4 dense_mma_norm_tiled_q2 routed_mma_down_q3 routed_mma_down_tiled_q4 routed_mma_down_tiled_q2 dense_mma_rows_q4 dense_mma_rows_q3 dense_mma_rows_q2 dense_mma_rows_tiled_q4 dense_mma_rows_tiled_q2"
PLAIN="affine_tiles_from_rows"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# program.cu includes the kernel files beside it.
nvcc -std=c++17 -arch="$arch" -cubin -o "$tmp/kernels.cubin" "$src"
cuobjdump -sass "$tmp/kernels.cubin" > "$tmp/kernels.sass"
# Per function: the first global load, store or atomic before ACQBULK, if any.
awk -v early="$EARLY $PLAIN" '
    BEGIN { n = split(early, e, " "); for (i = 1; i <= n; i++) ok[e[i]] = 1 }
    /Function : / { f = $3; waited = 0; next }
    /ACQBULK/ { waited = 1 }
    !waited && f != "" && !(f in ok) && /(LDG|STG|ATOMG|RED\.|LD\.E|ST\.E)/ {
        print f ": " $0; bad = 1; waited = 1
    }
    END { exit bad }
' "$tmp/kernels.sass" && echo "pdl order: every kernel waits before touching global memory"

// A prompt's routed affine experts: their (row, expert) pairs grouped by expert on the
// device, and the grouped GEMMs on tensor cores over those groups.

// ---- Affine experts on tensor cores: the grouped GEMM of a prompt's MoE dispatch ----
//
// A block computes a tile of MMA_BM (row, expert) pairs × MMA_BN output rows of one
// expert's matrix with mma.sync m16n8k16 (f16 inputs, f32 accumulation), a 64-column
// scale group at a time. The weights enter as their codes q, which f16 holds exactly, so
// a group's partial product P is Σ x·q and the group adds a·scale·P + (o·scale + bias)·Σx,
// as the matrix-vector kernels do. x enters as two f16 parts, hi = x rounded and lo = the
// rest rounded, so the products keep about 22 bits of x: the result stays within f32
// rounding of the reference, not f16's.
//
// Four warps split the output rows, 16 each (two n8 fragments), and each covers all 32
// pair rows (two m16 fragments). A lane decodes its weight fragments straight from the
// words it loads: no weight tile passes through shared memory. Only the x tile does,
// in rows of 72 halves (64 + 8), so the fragment loads of a warp's 32 lanes fall in 32
// different banks.
#define MMA_BM 32
#define MMA_BN 64
#define MMA_LD 72

// Pair tile `blockIdx.y` is entry (group, first row) of `tiles` (those at or past
// `*tiles_n`, when given, do nothing); blockIdx.x picks MMA_BN output rows. GATED (gate and up, table entries 0 and 1): input row r is x[x_rows[p]],
// out[p] = silu(gate) ⊙ up for pair p. Otherwise (down, entry 2): input row r is x[p] and
// out[x_rows[p]] += pair_scales[p] · down, atomically (a token's experts add into its row).
// With TILED (4 and 2 bits) the matrices are in unit tiles (load_tile_words): a warp's 16
// output rows are one tile, the entry's scales point at the tiles' scales and biases and
// its biases are not read.
template <int BITS, bool GATED, bool TILED = false>
__device__ void expert_mma(const unsigned long long* table, const unsigned* tiles,
                           const unsigned* tiles_n, const unsigned* x_rows,
                           const float* pair_scales, const float* x, float* out, int rows,
                           int cols, int in_dim) {
    constexpr int M = GATED ? 2 : 1;
    // A grid sized for the most tiles there could be, when the device counted them.
    if (tiles_n && blockIdx.y >= *tiles_n) return;
    __shared__ __align__(16) unsigned xs_hi[MMA_BM * MMA_LD / 2];
    __shared__ __align__(16) unsigned xs_lo[MMA_BM * MMA_LD / 2];
    __shared__ float xsum[MMA_BM];
    __shared__ __align__(8) float wscale[M][MMA_BN];
    __shared__ __align__(8) float wbias[M][MMA_BN];

    const unsigned long long* e = table + (size_t)tiles[2 * blockIdx.y] * GROUP_ENTRY;
    int first = (int)e[9] + (int)tiles[2 * blockIdx.y + 1];
    int count = min(MMA_BM, (int)e[10] - (int)tiles[2 * blockIdx.y + 1]);
    int n0 = blockIdx.x * MMA_BN;
    const unsigned* words[M];
    const unsigned short* scales[M];
    const unsigned short* biases[M];
#pragma unroll
    for (int m = 0; m < M; m++) {
        int proj = GATED ? m : 2;
        words[m] = (const unsigned*)e[3 * proj];
        scales[m] = (const unsigned short*)e[3 * proj + 1];
        biases[m] = (const unsigned short*)e[3 * proj + 2];
    }

    int t = threadIdx.x, lane = t % WARP, warp = t / WARP;
    int g = lane >> 2, q = lane & 3;
    int groups = cols / 64;
    size_t stride = row_words<BITS>(cols);
    // The lane's two output rows (one per n8 fragment); a row past the matrix reads row 0
    // and is never stored. In tiles, the warp's rows are tile `tile` (past the matrix:
    // tile 0, never stored).
    const unsigned* wrow[M][2];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int jt = 0; jt < 2; jt++) {
            int o = n0 + 16 * warp + 8 * jt + g;
            wrow[m][jt] = words[m] + (o < rows ? o : 0) * stride;
        }
    size_t tile = n0 + 16 * warp < rows ? (size_t)(n0 / 16 + warp) : 0;
    // This thread's share of the x tile: row t/4, columns 16·(t%4) .. +16 of the group.
    int xr = t >> 2, xq = t & 3;
    const float* xrow = nullptr;
    if (xr < count) {
        size_t src = GATED ? (size_t)x_rows[first + xr] : (size_t)(first + xr);
        xrow = x + src * in_dim;
    }
    bool vec = in_dim % 4 == 0 && ((size_t)x & 15) == 0;  // whole float4s, aligned
    // This thread's scale and bias, if any: matrix t / 64, output row t % 64.
    int sm = t / MMA_BN, so = n0 + t % MMA_BN;
    bool scaler = sm < M && so < rows;
    const unsigned short* my_scales = sm == 1 ? scales[M - 1] : scales[0];
    const unsigned short* my_biases = sm == 1 ? biases[M - 1] : biases[0];
    const float a = recon_a<BITS>(), off = recon_o<BITS>();

    // The next group's x values, code words, scale and bias, loaded into registers one
    // group ahead so that their latency overlaps the current group's products.
    float v[16];
    unsigned w[M][2][2];
    unsigned short sraw = 0, braw = 0;
    auto fetch = [&](int gi) {
        load_x16(xrow, gi * 64 + 16 * xq, in_dim, vec, v);
#pragma unroll
        for (int m = 0; m < M; m++) {
            if constexpr (TILED)
                load_tile_words<BITS>(words[m], tile * groups + gi, lane, w[m]);
            else
#pragma unroll
                for (int jt = 0; jt < 2; jt++)
                    load_lane_words<BITS>(wrow[m][jt], gi, q, w[m][jt]);
        }
        if (scaler) {
            if constexpr (TILED) {
                // The row's scale and bias, side by side in its unit.
                unsigned sb = reinterpret_cast<const unsigned*>(
                    my_scales)[((size_t)(so / 16) * groups + gi) * 16 + so % 16];
                sraw = (unsigned short)(sb & 0xffffu);
                braw = (unsigned short)(sb >> 16);
            } else {
                size_t sg = (size_t)so * groups + gi;
                sraw = my_scales[sg];
                braw = my_biases[sg];
            }
        }
    };

    float acc[M][2][2][4];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int jt = 0; jt < 2; jt++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[m][mt][jt][i] = 0.0f;

    fetch(0);
    for (int gi = 0; gi < groups; gi++) {
        // The previous group's fragment reads are done before the tile is rewritten.
        __syncthreads();
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; j++) s += v[j];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (xq == 0) xsum[xr] = s;
        unsigned hi[8], lo[8];
        split_pairs<BITS>(v, hi, lo);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            // Word 4·ks + h of the quarter: k positions 16·ks + 8·h + 2·xq.
            int at = xr * (MMA_LD / 2) + 8 * (j / 2) + 4 * (j % 2) + xq;
            xs_hi[at] = hi[j];
            xs_lo[at] = lo[j];
        }
        if (sm < M) {
            // value = (a·q + o)·scale + bias, so w·x = a·scale·Σ q·x + (o·scale + bias)·Σ x.
            float sc = bf16_bits(sraw);
            wscale[sm][t % MMA_BN] = a * sc;
            wbias[sm][t % MMA_BN] = off * sc + bf16_bits(braw);
        }
        unsigned b[M][2][8];
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int jt = 0; jt < 2; jt++) decode_fragments<BITS>(w[m][jt], q, b[m][jt]);
        __syncthreads();
        if (gi + 1 < groups) fetch(gi + 1);

        float part[M][2][2][4];
#pragma unroll
        for (int ks = 0; ks < 4; ks++)
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                int at = (16 * mt + g) * (MMA_LD / 2) + 8 * ks + q;
                const int down8 = 8 * (MMA_LD / 2);
                unsigned ah[4] = {xs_hi[at], xs_hi[at + down8], xs_hi[at + 4],
                                  xs_hi[at + down8 + 4]};
                unsigned al[4] = {xs_lo[at], xs_lo[at + down8], xs_lo[at + 4],
                                  xs_lo[at + down8 + 4]};
#pragma unroll
                for (int m = 0; m < M; m++)
#pragma unroll
                    for (int jt = 0; jt < 2; jt++) {
                        unsigned b0 = b[m][jt][2 * ks], b1 = b[m][jt][2 * ks + 1];
                        if (ks == 0)
                            mma_f16_first(part[m][mt][jt], ah, b0, b1);
                        else
                            mma_f16(part[m][mt][jt], ah, b0, b1);
                        mma_f16(part[m][mt][jt], al, b0, b1);
                    }
            }
        // Fragment element i sits at pair row 16·mt + g (+8 for i ≥ 2) and output row
        // 16·warp + 8·jt + 2q (+1 for odd i).
        float xs4[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            xs4[mt][0] = xsum[16 * mt + g];
            xs4[mt][1] = xsum[16 * mt + g + 8];
        }
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int jt = 0; jt < 2; jt++) {
                int c = 16 * warp + 8 * jt + 2 * q;
                float2 sc = *reinterpret_cast<const float2*>(&wscale[m][c]);
                float2 bi = *reinterpret_cast<const float2*>(&wbias[m][c]);
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float scv = i & 1 ? sc.y : sc.x, biv = i & 1 ? bi.y : bi.x;
                        acc[m][mt][jt][i] += scv * part[m][mt][jt][i] + biv * xs4[mt][i >> 1];
                    }
            }
    }

    if constexpr (GATED) {
        for_fragments(n0 + 16 * warp, [&](int mt, int jt, int i, int r, int c) {
            if (r >= count || c >= rows) return;
            float gv = acc[0][mt][jt][i];
            out[(size_t)(first + r) * rows + c] = gv / (1.0f + expf(-gv)) * acc[M - 1][mt][jt][i];
        });
    } else {
        add_down_fragments(acc[0], n0 + 16 * warp, count, rows, first, x_rows, pair_scales, out);
    }
}

// NAME is the kernels' suffix: q4, q3, q2 for matrices in rows, and tiled_q4, tiled_q2
// for experts in unit tiles.
#define EXPERT_MMA_ENTRY(B, NAME, TILED)                                                       \
    extern "C" __global__ void __launch_bounds__(128, 3) expert_mma_gate_up_##NAME(            \
        const unsigned long long* table, const unsigned* tiles, const unsigned* tiles_n,       \
        const unsigned* x_rows, const float* x, float* h, int rows, int cols, int in_dim) {    \
        PDL_ENTRY();                                                                           \
        expert_mma<B, true, TILED>(table, tiles, tiles_n, x_rows, nullptr, x, h, rows, cols,   \
                                   in_dim);                                                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) expert_mma_down_##NAME(                  \
        const unsigned long long* table, const unsigned* tiles, const unsigned* tiles_n,       \
        const unsigned* x_rows, const float* pair_scales, const float* h, float* out,          \
        int rows, int cols, int in_dim) {                                                      \
        PDL_ENTRY();                                                                           \
        expert_mma<B, false, TILED>(table, tiles, tiles_n, x_rows, pair_scales, h, out, rows,  \
                                    cols, in_dim);                                             \
    }

EXPERT_MMA_ENTRY(4, q4, false)
EXPERT_MMA_ENTRY(3, q3, false)
EXPERT_MMA_ENTRY(2, q2, false)
EXPERT_MMA_ENTRY(4, tiled_q4, true)
EXPERT_MMA_ENTRY(2, tiled_q2, true)

// A routed block's (row, expert) pairs grouped by expert for the grouped GEMMs, on the
// device so that a prompt's MoE layer needs no host round trip. One block; dynamic
// shared memory holds three counters per expert. `ids`/`weights` are moe_route's (pair
// p is row p / top_k). Writes each expert's group entry (its nine pointers from `table`,
// then its first pair and count), the pairs' rows and weights in expert order (the order
// within an expert is the atomics', which changes no pair's result), the pairs themselves
// when `pair_ids` is not null (the VQ GEMMs read inputs rotated per pair), and the tiles
// (expert, first pair) of MMA_BM pairs with their count in `*tiles_n`.
extern "C" __global__ void moe_group_pairs(const int* ids, const float* weights, int pairs,
                                           int top_k, int experts,
                                           const unsigned long long* table,
                                           unsigned long long* groups, unsigned* pair_rows,
                                           float* pair_weights, unsigned* pair_ids,
                                           unsigned* tiles, unsigned* tiles_n) {
    PDL_ENTRY();
    extern __shared__ unsigned counters[];
    unsigned* count = counters;
    unsigned* first = counters + experts;
    unsigned* cursor = counters + 2 * experts;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) count[e] = cursor[e] = 0u;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[ids[p]], 1u);
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned at = 0, n = 0;
        for (int e = 0; e < experts; e++) {
            first[e] = at;
            for (unsigned s = 0; s < count[e]; s += MMA_BM) {
                tiles[2 * n] = e;
                tiles[2 * n + 1] = s;
                n++;
            }
            at += count[e];
        }
        *tiles_n = n;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        for (int j = 0; j < ROUTED_ENTRY; j++)
            groups[(size_t)e * GROUP_ENTRY + j] = table[(size_t)e * ROUTED_ENTRY + j];
        groups[(size_t)e * GROUP_ENTRY + 9] = first[e];
        groups[(size_t)e * GROUP_ENTRY + 10] = count[e];
    }
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int e = ids[p];
        unsigned at = first[e] + atomicAdd(&cursor[e], 1u);
        pair_rows[at] = p / top_k;
        pair_weights[at] = weights[p];
        if (pair_ids) pair_ids[at] = p;
    }
}

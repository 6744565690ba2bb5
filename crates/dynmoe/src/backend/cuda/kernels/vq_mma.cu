// VQ-ladder experts on tensor cores, each codeword looked up straight into an mma.sync
// fragment: a prompt's grouped GEMMs and a decode step's routed products.

// ---- VQ experts of a prompt: grouped GEMMs on tensor cores ----
//
// expert_mma for experts at a VQ rung of 4-, 8- or 16-value vectors and rotation blocks
// of at least 64 values: a tile of MMA_BM pairs of one expert (moe_group_pairs) against
// 16 output rows a warp, over the rotated inputs a 64-column group at a time. Quarter q
// of a warp takes columns 16q .. 16q + 15 of a group for its output row, so k step ks
// pairs columns 16q + 4ks + (0, 1) (b0) and + (2, 3) (b1): the codewords' own f16
// pairs in their stored order, looked up from the book straight into B fragments with
// no conversion. The inputs are staged as f16 hi and lo parts in column order, so the A
// fragments of the same k step are words 2ks and 2ks + 1 of the lane's eight in a row,
// and the products keep the f32 inputs' precision. A row's norm is one number over its
// rotation block, so the products of a block add up unscaled and are scaled once.
// Gate and up: warps 0-3 take gate and 4-7 up, over 64 output rows a block; down: all
// eight take down, over 128.
#define VQG_WARPS 8
#define VQG_LDU 9  // 16-byte units a staged row: 8, and 1 so that rows g and g + 1 of an
                   // A fragment load fall in different banks

// The lane's 16 columns of one output row in a group as 8 f16 pairs (b[2ks + h]), from
// its 16 / P codewords.
template <int P>
__device__ __forceinline__ void vqg_fragments(const unsigned short* book,
                                              const unsigned (&idx)[16 / P], unsigned (&b)[8]) {
    if constexpr (P == 4) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint2 v = reinterpret_cast<const uint2*>(book)[idx[j]];
            b[2 * j] = v.x;
            b[2 * j + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8 / (P / 2); j++)
#pragma unroll
            for (int h = 0; h < P / 8; h++) {
                uint4 v = reinterpret_cast<const uint4*>(book)[(size_t)idx[j] * (P / 8) + h];
                int at = 4 * (j * (P / 8) + h);
                b[at] = v.x;
                b[at + 1] = v.y;
                b[at + 2] = v.z;
                b[at + 3] = v.w;
            }
    }
}

// The 16 / P indices of the lane's columns, from the code words `w` (the words from the
// one its first index starts in; `off` the bit there) of k-bit indices.
template <int P>
__device__ __forceinline__ void vqg_indices(const unsigned (&w)[4], int off, int k,
                                            unsigned (&idx)[16 / P]) {
    unsigned mask = (1u << k) - 1u;
#pragma unroll
    for (int j = 0; j < 16 / P; j++) {
        int s = off + j * k;
        unsigned lo = s < 32 ? w[0] : s < 64 ? w[1] : w[2];
        unsigned hi = s < 32 ? w[1] : s < 64 ? w[2] : w[3];
        idx[j] = __funnelshift_r(lo, hi, s & 31) & mask;
    }
}

// Pair tile blockIdx.y ((group, first pair) in `tiles`, nothing past `*tiles_n`) of
// inputs `xr` rotated per pair in pair order (routed_vq_rotate): [pairs, 2, width] for
// gate and up, [pairs, width] for down. GATED: h[p] = silu(gate) ⊙ up for pair p =
// pair_ids[row]; otherwise out[x_rows[row]] += pair_scales[row] · down, atomically.
// Dynamic shared memory: the book first when `book_shared`, then the staged tiles.
template <int P, bool GATED>
__device__ void vq_expert_mma(const unsigned long long* groups,
                              const unsigned* tiles, const unsigned* tiles_n,
                              const unsigned* pair_ids,
                              const unsigned* x_rows,
                              const float* pair_scales,
                              const float* xr, float* out, int rows,
                              int width, const unsigned short* __restrict__ book, int k,
                              int block, size_t row_bytes, int book_shared) {
    constexpr int M = GATED ? 2 : 1;
    constexpr int BN = GATED ? 64 : 128;
    constexpr int N = 16 / P;
    if (blockIdx.y >= *tiles_n) return;
    extern __shared__ float4 vqg_shared[];
    const unsigned long long* e = groups + (size_t)tiles[2 * blockIdx.y] * GROUP_ENTRY;
    int first = (int)e[9] + (int)tiles[2 * blockIdx.y + 1];
    int count = min(MMA_BM, (int)e[10] - (int)tiles[2 * blockIdx.y + 1]);
    int t = threadIdx.x, lane = t % WARP, warp = t / WARP, g = lane >> 2, q = lane & 3;
    int m = GATED ? warp / 4 : 0, wr = GATED ? warp % 4 : warp;
    int n0 = blockIdx.x * BN + 16 * wr;

    const unsigned short* bk = book;
    uint4* xs = reinterpret_cast<uint4*>(vqg_shared);
    if (book_shared) {
        size_t bytes = ((size_t)P << k) * 2;
        stage_floats(reinterpret_cast<const float*>(book), reinterpret_cast<float*>(vqg_shared),
                     (int)(bytes / 4));
        bk = reinterpret_cast<const unsigned short*>(vqg_shared);
        xs += bytes / 16;
    }
    uint4* xs_hi = xs;                                  // [M][MMA_BM][VQG_LDU]
    uint4* xs_lo = xs + M * MMA_BM * VQG_LDU;           // the same
    float* wscale = reinterpret_cast<float*>(xs_lo + M * MMA_BM * VQG_LDU);  // [8 · 16]

    int proj = GATED ? m : 2;
    const unsigned* codes = reinterpret_cast<const unsigned*>(e[3 * proj]);
    int blocks = width / block, per_block = block / 64, n_groups = width / 64;
    // The lane's two output rows (one per n8 fragment); a row past the matrix reads row 0
    // and is never stored.
    size_t bit0[2];
#pragma unroll
    for (int jt = 0; jt < 2; jt++) {
        int o = n0 + 8 * jt + g;
        bit0[jt] = (size_t)(o < rows ? o : 0) * row_bytes * 8 + (size_t)(16 * q / P) * k;
    }
    // This thread's norm, staged once a rotation block: that of warp t / 16's row t % 16.
    int so = blockIdx.x * BN + 16 * (GATED ? (t / 16) % 4 : t / 16) + t % 16;
    bool scaler = t < VQG_WARPS * 16 && so < rows;
    const unsigned short* my_norms =
        reinterpret_cast<const unsigned short*>(e[3 * (GATED ? t / 64 : 2) + 1]);
    float inv_root = 1.0f / sqrtf((float)block);
    // This thread's share of the input tile: 2M float4s, item i being float4 u % 16 of
    // row (u % 512) / 16 of matrix u / 512, u = t + 256 i.
    const float* src[2 * M];
#pragma unroll
    for (int i = 0; i < 2 * M; i++) {
        int u = t + VQG_WARPS * WARP * i, mi = u / 512, r = (u % 512) / 16;
        src[i] = r < count ? xr + (size_t)pair_ids[first + r] * M * width + (size_t)mi * width +
                                 4 * (u % 16)
                           : nullptr;
    }

    float4 v[2 * M];
    unsigned words[2][4];
    int offs[2];
    unsigned short nraw = 0;
    auto fetch = [&](int gi) {
#pragma unroll
        for (int i = 0; i < 2 * M; i++)
            v[i] = src[i] ? *reinterpret_cast<const float4*>(src[i] + 64 * gi)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int jt = 0; jt < 2; jt++) {
            size_t bit = bit0[jt] + (size_t)gi * (64 / P) * k;
            const unsigned* w = codes + (bit >> 5);
            int off = (int)(bit & 31), last = (off + (N - 1) * k) >> 5;
            offs[jt] = off;
            words[jt][0] = w[0];
            words[jt][1] = w[1];
            words[jt][2] = last >= 1 ? w[2] : 0u;
            words[jt][3] = last >= 2 ? w[3] : 0u;
        }
        if (scaler && gi % per_block == 0) nraw = my_norms[(size_t)so * blocks + gi / per_block];
    };

    float acc[2][2][4], part[2][2][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int jt = 0; jt < 2; jt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][jt][i] = 0.0f;

    fetch(0);
    for (int gi = 0; gi < n_groups; gi++) {
        // The previous group's fragment reads (and the book's staging) are done.
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 2 * M; i++) {
            int u = t + VQG_WARPS * WARP * i, at = ((u / 512) * MMA_BM + (u % 512) / 16) * VQG_LDU;
            unsigned h0 = pack_f16x2(v[i].x, v[i].y), h1 = pack_f16x2(v[i].z, v[i].w);
            float2 r0 = unpack_f16x2(h0), r1 = unpack_f16x2(h1);
            int word = 2 * (u % 16);
            reinterpret_cast<uint2*>(xs_hi + at)[word / 2] = make_uint2(h0, h1);
            reinterpret_cast<uint2*>(xs_lo + at)[word / 2] = make_uint2(
                pack_f16x2(v[i].x - r0.x, v[i].y - r0.y), pack_f16x2(v[i].z - r1.x, v[i].w - r1.y));
        }
        if (scaler && gi % per_block == 0) wscale[t] = half_bits(nraw) * inv_root;
        __syncthreads();
        unsigned b[2][8];
#pragma unroll
        for (int jt = 0; jt < 2; jt++) {
            unsigned idx[N];
            vqg_indices<P>(words[jt], offs[jt], k, idx);
            vqg_fragments<P>(bk, idx, b[jt]);
        }
        if (gi + 1 < n_groups) fetch(gi + 1);

        bool opens = gi % per_block == 0;
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const uint4* rh = xs_hi + (m * MMA_BM + 16 * mt + g) * VQG_LDU + 2 * q + c;
                const uint4* rl = xs_lo + (m * MMA_BM + 16 * mt + g) * VQG_LDU + 2 * q + c;
                uint4 h0 = rh[0], h8 = rh[8 * VQG_LDU], l0 = rl[0], l8 = rl[8 * VQG_LDU];
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    int ks = 2 * c + s;
                    unsigned ah[4] = {s ? h0.z : h0.x, s ? h8.z : h8.x, s ? h0.w : h0.y,
                                      s ? h8.w : h8.y};
                    unsigned al[4] = {s ? l0.z : l0.x, s ? l8.z : l8.x, s ? l0.w : l0.y,
                                      s ? l8.w : l8.y};
#pragma unroll
                    for (int jt = 0; jt < 2; jt++) {
                        unsigned b0 = b[jt][2 * ks], b1 = b[jt][2 * ks + 1];
                        if (ks == 0 && opens)
                            mma_f16_first(part[mt][jt], ah, b0, b1);
                        else
                            mma_f16(part[mt][jt], ah, b0, b1);
                        mma_f16(part[mt][jt], al, b0, b1);
                    }
                }
            }
        if (gi % per_block == per_block - 1) {
            // Fragment element i sits at output row 16·wr + 8·jt + 2q (+1 for odd i).
#pragma unroll
            for (int jt = 0; jt < 2; jt++) {
                float2 sc = *reinterpret_cast<const float2*>(wscale + 16 * warp + 8 * jt + 2 * q);
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) acc[mt][jt][i] += (i & 1 ? sc.y : sc.x) * part[mt][jt][i];
            }
        }
    }

    if (GATED) {
        // Gate and up meet in shared memory (over the staged tiles): red[m][row][col].
        __syncthreads();
        float* red = reinterpret_cast<float*>(xs_hi);
        for_fragments(16 * wr, [&](int mt, int jt, int i, int r, int c) {
            red[(m * MMA_BM + r) * BN + c] = acc[mt][jt][i];
        });
        __syncthreads();
        for (int u = t; u < MMA_BM * BN; u += VQG_WARPS * WARP) {
            int r = u / BN, c = blockIdx.x * BN + u % BN;
            if (r >= count || c >= rows) continue;
            float gv = red[u], uv = red[MMA_BM * BN + u];
            out[(size_t)pair_ids[first + r] * rows + c] = gv / (1.0f + expf(-gv)) * uv;
        }
    } else {
        add_down_fragments(acc, n0, count, rows, first, x_rows, pair_scales, out);
    }
}

#define VQG_ENTRY(P)                                                                           \
    extern "C" __global__ void __launch_bounds__(VQG_WARPS * WARP, 2) vq_expert_mma_gate_up_p##P( \
        const unsigned long long* groups, const unsigned* tiles, const unsigned* tiles_n,      \
        const unsigned* pair_ids, const float* xr, float* h, int rows, int width,              \
        const unsigned short* book, int k, int block, unsigned long long row_bytes,            \
        int book_shared) {                                                                     \
        PDL_ENTRY();                                                                           \
        vq_expert_mma<P, true>(groups, tiles, tiles_n, pair_ids, nullptr, nullptr, xr, h,      \
                               rows, width, book, k, block, row_bytes, book_shared);           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(VQG_WARPS * WARP, 2) vq_expert_mma_down_p##P( \
        const unsigned long long* groups, const unsigned* tiles, const unsigned* tiles_n,      \
        const unsigned* pair_ids, const unsigned* x_rows, const float* pair_scales,            \
        const float* hr, float* out, int rows, int width, const unsigned short* book, int k,   \
        int block, unsigned long long row_bytes, int book_shared) {                            \
        PDL_ENTRY();                                                                           \
        vq_expert_mma<P, false>(groups, tiles, tiles_n, pair_ids, x_rows, pair_scales, hr,     \
                                out, rows, width, book, k, block, row_bytes, book_shared);     \
    }

VQG_ENTRY(4)
VQG_ENTRY(8)
VQG_ENTRY(16)

// ---- VQ experts of a decode step on tensor cores ----
//
// The routed VQ kernels with each warp's products on tensor cores, as routed_mma does
// for affine codes: mma.sync takes 16 weight rows as A, their codewords looked up from
// the book straight into fragments in the column order of vq_expert_mma (lane quarter q
// takes columns 16q .. 16q + 15 of a 64-column unit), and the rotated activations as B:
// column 0 their f16 hi part, column 1 the lo part, the other six zero. The block first
// queues asynchronous copies of the book and of its rows' codes and norms into shared
// memory, rotates what it reads (a warp per rotation block, straight into f16 hi and lo
// halves) while they land, and only then looks anything up: no lookup waits on device
// memory. The warps split a row tile's units; the block adds their partial sums in a
// fixed order. For 4-, 8- and 16-value vectors and rotation blocks of at least 64 values.
#define VQM_TILES 2  // 16-row tiles of gate and up a block

// Staged activations of one matrix: `width` f16 hi halves, 4 words of padding (so the
// lanes reading hi and those reading lo fall in different banks), the lo halves, 4 more.
__device__ __forceinline__ int vqm_stride(int width) { return width + 8; }  // in words

__device__ __forceinline__ unsigned short f16_bits(float v) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}

// Stores value i of a rotated row as its f16 hi and lo halves.
__device__ __forceinline__ void vqm_store(unsigned* staged, int width, int i, float v) {
    unsigned short* hi = reinterpret_cast<unsigned short*>(staged);
    unsigned short* lo = reinterpret_cast<unsigned short*>(staged + width / 2 + 4);
    unsigned short hv = f16_bits(v);
    hi[i] = hv;
    lo[i] = f16_bits(v - half_bits(hv));
}

// Bytes of shared memory that hold `bytes` bytes from any offset, staged whole 16-byte
// chunks at a time (stage_bytes_async).
__device__ __forceinline__ int staged_bytes(int bytes) { return (bytes + 15) / 16 * 16 + 16; }

// Queues copies of bytes [begin, end) of `src` (16-byte aligned, readable to the end of
// the chunk holding byte end - 1: the device copies' padding) into `dst`, whole 16-byte
// chunks from the one holding `begin`, by the block's threads. Byte b lands at
// dst + b - (begin & ~15).
__device__ __forceinline__ void stage_bytes_async(void* dst, const void* src, size_t begin,
                                                  size_t end) {
    size_t first = begin & ~(size_t)15;
    int chunks = (int)((end - first + 15) / 16);
    const float4* from = reinterpret_cast<const float4*>(reinterpret_cast<const char*>(src) + first);
    for (int i = threadIdx.x; i < chunks; i += blockDim.x)
        copy16_async(reinterpret_cast<float4*>(dst) + i, from + i, true);
}

// Bytes a staged row of codes takes in shared memory: room for its 16-byte chunks, an
// odd number of them, so that the 8 rows a warp reads at once start in different banks.
__device__ __forceinline__ int vqm_code_stride(size_t row_bytes) {
    int chunks = (int)((row_bytes + 15) / 16) + 1;
    return 16 * (chunks | 1);
}

// Rows of a matrix's codes and norms staged in shared memory from row o0 on
// (vqm_stage_rows): row o's codes from bit ((o - o0) · stride + (o · row_bytes) % 16) · 8 of
// `codes`, and its norm of block b at entry o · blocks + b - norm0 of `norms`.
struct VqmRows {
    const unsigned* codes;
    const unsigned short* norms;
    int o0, stride;
    size_t norm0;
};

__device__ __forceinline__ VqmRows vqm_staged(const char* codes, const char* norms, int o0,
                                              int blocks, size_t row_bytes) {
    return VqmRows{reinterpret_cast<const unsigned*>(codes),
                   reinterpret_cast<const unsigned short*>(norms), o0,
                   vqm_code_stride(row_bytes), ((size_t)o0 * blocks * 2 & ~(size_t)15) / 2};
}

// Queues the copies of rows [o0, o0 + n) of a matrix's codes and norms (its table words
// `m`) into `codes` and `norms` (shared), as vqm_staged finds them: each code row the
// 16-byte chunks that hold it, the norms as one range.
__device__ __forceinline__ void vqm_stage_rows(const unsigned long long* m, int o0, int n,
                                               int blocks, size_t row_bytes, char* codes,
                                               char* norms) {
    const char* src = reinterpret_cast<const char*>(m[0]);
    int stride = vqm_code_stride(row_bytes), per = stride / 16;
    for (int i = threadIdx.x; i < n * per; i += blockDim.x) {
        int r = i / per, c = i % per;
        size_t first = ((size_t)(o0 + r) * row_bytes & ~(size_t)15) + 16 * c;
        if (first < (size_t)(o0 + r + 1) * row_bytes)
            copy16_async(reinterpret_cast<float4*>(codes + (size_t)r * stride) + c,
                         reinterpret_cast<const float4*>(src + first), true);
    }
    size_t n0 = (size_t)o0 * blocks * 2;
    stage_bytes_async(norms, reinterpret_cast<const void*>(m[1]), n0,
                      n0 + (size_t)n * blocks * 2);
}

// Σ over units [u0, u1) of the lane's rows o_g and o_g8 (g and g + 8 of a tile; rows
// past the matrix clamped to a staged one) of the staged rows `w` times the staged
// activations, each unit's products scaled by the rows' norms of its rotation block.
// Lanes with q = 0 get the two sums; the others hold parts of no use.
template <int P>
__device__ __forceinline__ float2 vqm_rows(const VqmRows& w, const unsigned short* book,
                                           const unsigned* staged, int width, int o_g, int o_g8,
                                           int u0, int u1, int k, int block, size_t row_bytes) {
    int lane = threadIdx.x % WARP, g = lane >> 2, q = lane & 3;
    int blocks = width / block;
    auto first_bit = [&](int o) {
        size_t lead = (size_t)o * row_bytes & 15;
        return ((size_t)(o - w.o0) * w.stride + lead) * 8 + (size_t)(16 * q / P) * k;
    };
    size_t bits[2] = {first_bit(o_g), first_bit(o_g8)};
    const unsigned short* norm[2] = {w.norms + (size_t)o_g * blocks - w.norm0,
                                     w.norms + (size_t)o_g8 * blocks - w.norm0};
    // Lane groups 0 and 1 feed B's columns 0 (hi) and 1 (lo); the rest, zeros.
    const unsigned* bsrc = staged + (g == 1 ? width / 2 + 4 : 0) + 8 * q;
    float2 acc = make_float2(0.0f, 0.0f);
#pragma unroll 2
    for (int u = u0; u < u1; u++) {
        unsigned a[2][8];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            size_t bit = bits[r] + (size_t)u * (64 / P) * k;
            const unsigned* c = w.codes + (bit >> 5);
            int off = (int)(bit & 31), last = (off + (16 / P - 1) * k) >> 5;
            unsigned words[4] = {c[0], c[1], last >= 1 ? c[2] : 0u, last >= 2 ? c[3] : 0u};
            unsigned idx[16 / P];
            vqg_indices<P>(words, off, k, idx);
            vqg_fragments<P>(book, idx, a[r]);
        }
        unsigned bx[8];
        if (g < 2) {
            uint4 v0 = reinterpret_cast<const uint4*>(bsrc + 32 * u)[0];
            uint4 v1 = reinterpret_cast<const uint4*>(bsrc + 32 * u)[1];
            bx[0] = v0.x, bx[1] = v0.y, bx[2] = v0.z, bx[3] = v0.w;
            bx[4] = v1.x, bx[5] = v1.y, bx[6] = v1.z, bx[7] = v1.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) bx[i] = 0u;
        }
        float c[4];
#pragma unroll
        for (int ks = 0; ks < 4; ks++) {
            unsigned af[4] = {a[0][2 * ks], a[1][2 * ks], a[0][2 * ks + 1], a[1][2 * ks + 1]};
            if (ks == 0)
                mma_f16_first(c, af, bx[0], bx[1]);
            else
                mma_f16(c, af, bx[2 * ks], bx[2 * ks + 1]);
        }
        int b = u * 64 / block;
        acc.x += half_bits(norm[0][b]) * (c[0] + c[1]);
        acc.y += half_bits(norm[1][b]) * (c[2] + c[3]);
    }
    float inv_root = 1.0f / sqrtf((float)block);
    return make_float2(acc.x * inv_root, acc.y * inv_root);
}

// Units [u0, u1) of `units`, split `parts` ways: part `part`'s.
__device__ __forceinline__ int2 vqm_units(int units, int parts, int part) {
    int per = (units + parts - 1) / parts;
    int u0 = min(units, part * per);
    return make_int2(u0, min(units, u0 + per));
}

// The dynamic shared memory of a routed_vq_*_mma block: the book (when `book_shared`,
// else it is read from `book`), `mats` rotated rows (vqm_stride words each), each
// matrix's `rows` rows of codes and norms, staged, and `red` floats of partial sums.
struct VqmShared {
    const unsigned short* book;
    unsigned* staged;
    char* codes;
    char* norms;
    float* red;
    int code_stride, norm_stride;
};

template <int P>
__device__ __forceinline__ VqmShared vqm_shared(const unsigned short* book, int k, int book_shared,
                                                int mats, int width, int rows, int blocks,
                                                size_t row_bytes) {
    extern __shared__ float4 vqm_smem[];
    char* at = reinterpret_cast<char*>(vqm_smem);
    VqmShared sh;
    sh.book = book;
    if (book_shared) {
        size_t bytes = ((size_t)P << k) * 2;
        stage_bytes_async(at, book, 0, bytes);
        sh.book = reinterpret_cast<const unsigned short*>(at);
        at += bytes;
    }
    sh.staged = reinterpret_cast<unsigned*>(at);
    at += (size_t)mats * vqm_stride(width) * 4;
    sh.code_stride = rows * vqm_code_stride(row_bytes);
    sh.norm_stride = staged_bytes(rows * blocks * 2);
    sh.codes = at;
    at += (size_t)mats * sh.code_stride;
    sh.norms = at;
    at += (size_t)mats * sh.norm_stride;
    sh.red = reinterpret_cast<float*>(at);
    return sh;
}

// h[pair, o] = silu(gate_e(x_t)[o]) · up_e(x_t)[o] for pair = blockIdx.y, over
// VQM_TILES · 16 rows o a block. Warp w takes matrix w / 8 (gate, up), tile (w / 4) % 2 and
// a quarter of the units.
template <int P>
__device__ void routed_vq_gate_up_mma(const unsigned long long* table, const int* ids, int top_k,
                                      const float* x, float* h, int inter, int hidden,
                                      const unsigned short* __restrict__ book, int k, int block,
                                      size_t row_bytes, int book_shared) {
    constexpr int PARTS = VQR_WARPS / (2 * VQM_TILES);
    constexpr int ROWS = 16 * VQM_TILES;
    int pair = blockIdx.y, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int g = lane >> 2, q = lane & 3;
    int blocks = (hidden + block - 1) / block, width = blocks * block, stride = vqm_stride(width);
    const unsigned long long* ent = table + (size_t)ids[pair] * ROUTED_ENTRY;
    const float* xt = x + (size_t)(pair / top_k) * hidden;
    int mat = warp / (VQM_TILES * PARTS), tile = (warp / PARTS) % VQM_TILES, part = warp % PARTS;
    int b0 = blockIdx.x * ROWS, n = min(ROWS, inter - b0);
    VqmShared sh = vqm_shared<P>(book, k, book_shared, 2, width, ROWS, blocks, row_bytes);
    for (int m = 0; m < 2; m++)
        vqm_stage_rows(ent + 3 * m, b0, n, blocks, row_bytes, sh.codes + m * sh.code_stride,
                       sh.norms + m * sh.norm_stride);
    copies_commit();
    for (int c = warp; c < 2 * blocks; c += VQR_WARPS) {
        int m = c / blocks, b = c % blocks;
        unsigned* dst = sh.staged + m * stride;
        vq_rotate_block_to(xt + b * block, hidden - b * block, signs_of(ent + 3 * m), block,
                           [&](int i, float v) { vqm_store(dst, width, b * block + i, v); });
    }
    copies_wait();
    __syncthreads();
    int r0 = b0 + 16 * tile;
    int o_g = r0 + g < inter ? r0 + g : b0, o_g8 = r0 + g + 8 < inter ? r0 + g + 8 : b0;
    int2 us = vqm_units(width / 64, PARTS, part);
    VqmRows rows = vqm_staged(sh.codes + mat * sh.code_stride, sh.norms + mat * sh.norm_stride,
                              b0, blocks, row_bytes);
    float2 s = vqm_rows<P>(rows, sh.book, sh.staged + mat * stride, width, o_g, o_g8, us.x, us.y,
                           k, block, row_bytes);
    if (q == 0) {
        sh.red[warp * 16 + g] = s.x;
        sh.red[warp * 16 + g + 8] = s.y;
    }
    __syncthreads();
    int t = threadIdx.x;
    if (t < ROWS && t < n) {
        int tl = t / 16, r = t % 16;
        float gv = 0.0f, uv = 0.0f;
        for (int p = 0; p < PARTS; p++) {
            gv += sh.red[((0 * VQM_TILES + tl) * PARTS + p) * 16 + r];
            uv += sh.red[((1 * VQM_TILES + tl) * PARTS + p) * 16 + r];
        }
        h[(size_t)pair * inter + b0 + t] = gv / (1.0f + expf(-gv)) * uv;
    }
}

// out[t, o] = Σ_q weights[t·top_k + q] · down_e(h[t·top_k + q])[o], the pairs added in
// order, for token t = blockIdx.y, over 16 rows o a block. The warps split the pairs, and
// each pair's units `parts` ways (VQR_WARPS / top_k when that is more than one).
template <int P>
__device__ void routed_vq_down_mma(const unsigned long long* table, const int* ids,
                                   const float* weights, int top_k, const float* h, float* out,
                                   int hidden, int inter, const unsigned short* __restrict__ book,
                                   int k, int block, size_t row_bytes, int book_shared) {
    int t = blockIdx.y, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int g = lane >> 2, q = lane & 3;
    int blocks = (inter + block - 1) / block, width = blocks * block, stride = vqm_stride(width);
    int parts = max(1, VQR_WARPS / top_k), slots = VQR_WARPS / parts;
    int part = warp % parts, r0 = blockIdx.x * 16, n = min(16, hidden - r0);
    VqmShared sh = vqm_shared<P>(book, k, book_shared, top_k, width, 16, blocks, row_bytes);
    for (int p = 0; p < top_k; p++) {
        const unsigned long long* ent = table + (size_t)ids[t * top_k + p] * ROUTED_ENTRY;
        vqm_stage_rows(ent + 6, r0, n, blocks, row_bytes, sh.codes + p * sh.code_stride,
                       sh.norms + p * sh.norm_stride);
    }
    copies_commit();
    for (int c = warp; c < top_k * blocks; c += VQR_WARPS) {
        int p = c / blocks, b = c % blocks, pair = t * top_k + p;
        const unsigned long long* ent = table + (size_t)ids[pair] * ROUTED_ENTRY;
        unsigned* dst = sh.staged + p * stride;
        vq_rotate_block_to(h + (size_t)pair * inter + b * block, inter - b * block,
                           signs_of(ent + 6), block,
                           [&](int i, float v) { vqm_store(dst, width, b * block + i, v); });
    }
    copies_wait();
    __syncthreads();
    int o_g = r0 + g < hidden ? r0 + g : r0, o_g8 = r0 + g + 8 < hidden ? r0 + g + 8 : r0;
    int2 us = vqm_units(width / 64, parts, part);
    for (int p = warp / parts; p < top_k; p += slots) {
        VqmRows rows = vqm_staged(sh.codes + p * sh.code_stride, sh.norms + p * sh.norm_stride,
                                  r0, blocks, row_bytes);
        float2 s = vqm_rows<P>(rows, sh.book, sh.staged + p * stride, width, o_g, o_g8, us.x,
                               us.y, k, block, row_bytes);
        if (q == 0) {
            sh.red[(p * parts + part) * 16 + g] = s.x;
            sh.red[(p * parts + part) * 16 + g + 8] = s.y;
        }
    }
    __syncthreads();
    int r = threadIdx.x;
    if (r < n) {
        float total = 0.0f;
        for (int p = 0; p < top_k; p++) {
            float d = 0.0f;
            for (int j = 0; j < parts; j++) d += sh.red[(p * parts + j) * 16 + r];
            total += weights[t * top_k + p] * d;
        }
        out[(size_t)t * hidden + r0 + r] = total;
    }
}

// Blocks an SM, the launch bound of these two: tunable (DYNMOE_CUDA=define=...). At 2 ptxas
// holds them to 64 registers and they spill 16-48 bytes (tools/ptxas-resources); at 1 they
// take up to 128 and spill nothing, and the vq1.5 plan's decode measured 988 tok/s
// against 905 at 2 (H200, 12-layer Qwen3-30B-A3B shape, bf16 dense layers, one binary).
#ifndef VQM_BLOCKS
#define VQM_BLOCKS 1
#endif
#define VQM_ENTRY(P)                                                                           \
    extern "C" __global__ void __launch_bounds__(VQR_WARPS * WARP, VQM_BLOCKS)                 \
        routed_vq_gate_up_mma_p##P(const unsigned long long* table, const int* ids, int top_k, \
                                   const float* x, float* h, int inter, int hidden,            \
                                   const unsigned short* book, int k, int block,               \
                                   unsigned long long row_bytes, int book_shared) {            \
        PDL_ENTRY();                                                                           \
        routed_vq_gate_up_mma<P>(table, ids, top_k, x, h, inter, hidden, book, k, block,       \
                                 row_bytes, book_shared);                                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(VQR_WARPS * WARP, VQM_BLOCKS)                 \
        routed_vq_down_mma_p##P(                                                               \
        const unsigned long long* table, const int* ids, const float* weights, int top_k,      \
        const float* h, float* out, int hidden, int inter, const unsigned short* book, int k,  \
        int block, unsigned long long row_bytes, int book_shared) {                            \
        PDL_ENTRY();                                                                           \
        routed_vq_down_mma<P>(table, ids, weights, top_k, h, out, hidden, inter, book, k,      \
                              block, row_bytes, book_shared);                                  \
    }

VQM_ENTRY(4)
VQM_ENTRY(8)
VQM_ENTRY(16)

// Affine-coded matrices on CUDA cores: matrix-vector products, the grouped dispatch of
// host-routed experts, expansion to f32 for a GEMM, and a decode step's routed experts.
// They run where the tensor-core kernels do not: before sm_80, with tensor cores off,
// and for shapes whose staged units do not fit a block.

// ---- Affine-quantized weights (MLX 4-bit, the 3- and 2-bit layouts of seed 000) ----
//
// A row is cut into chunks of 32 columns; a thread decodes one chunk: 4 words at 4 bits,
// 2 at 2 bits, 3 at 3 bits (two of upper bits in the 2-bit layout, one of lowest bits).
// `codes[j]` is the code of column j of the chunk. Scales and biases are per 64 columns:
// value = (a·q + o)·scale + bias with (a, o) = (1, 0), (2, ½), (4, 1½) at 4, 3, 2 bits.

// Column of the code at word k, 2-bit group p, byte b of a 2-bit chunk (lowbit::column).
__device__ __forceinline__ int q2_column(int k, int p, int b) {
    return p < 2 ? 2 * (8 * k + 4 * p + b) : 2 * (8 * k + 4 * (p - 2) + b) + 1;
}

template <int BITS>
__device__ __forceinline__ void decode_chunk(const unsigned* words, size_t chunk, float* codes) {
    if (BITS == 4) {
        uint4 w = *reinterpret_cast<const uint4*>(words + 4 * chunk);
        unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int l = 0; l < 4; l++)
#pragma unroll
            for (int n = 0; n < 8; n++) codes[8 * l + n] = (float)((ws[l] >> (4 * n)) & 15u);
    } else if (BITS == 2) {
        uint2 w = *reinterpret_cast<const uint2*>(words + 2 * chunk);
        unsigned ws[2] = {w.x, w.y};
#pragma unroll
        for (int k = 0; k < 2; k++)
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int b = 0; b < 4; b++)
                    codes[q2_column(k, p, b)] = (float)((ws[k] >> (8 * b + 2 * p)) & 3u);
    } else {
        const unsigned* c = words + 3 * chunk;
        unsigned ws[2] = {c[0], c[1]};
        unsigned low = c[2];
#pragma unroll
        for (int k = 0; k < 2; k++)
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    unsigned up = (ws[k] >> (8 * b + 2 * p)) & 3u;
                    unsigned lo = (low >> (8 * b + 4 * k + p)) & 1u;
                    codes[q2_column(k, p, b)] = (float)(2u * up + lo);
                }
    }
}

template <int BITS> __device__ __forceinline__ float recon_a() { return BITS == 4 ? 1.0f : (BITS == 3 ? 2.0f : 4.0f); }
template <int BITS> __device__ __forceinline__ float recon_o() { return BITS == 4 ? 0.0f : (BITS == 3 ? 0.5f : 1.5f); }

// Words per row: cols/8, 3·cols/32, cols/16.
template <int BITS> __device__ __forceinline__ size_t row_words(int cols) {
    return BITS == 4 ? cols / 8 : (BITS == 3 ? 3 * cols / 32 : cols / 16);
}

#define AFF_MAXB 4
#define AFF_WARPS 8

// One warp's share of output row `o` for `nb` (≤ AFF_MAXB) rows of x staged in shared
// memory `xs` (each 32-column chunk padded to 33 floats, so that lanes reading the same
// column of neighbouring chunks hit different banks): lanes stride over the row's
// chunks, the warp sum is written to `out[b·out_stride]` by lane 0.
template <int BITS>
__device__ __forceinline__ void matvec_row(const unsigned* words, const unsigned short* scales,
                                           const unsigned short* biases, const float* xs,
                                           float* out, size_t out_stride, int o, int cols, int nb) {
    int lane = threadIdx.x % WARP;
    int chunks = cols / 32;
    const unsigned* wr = words + (size_t)o * row_words<BITS>(cols);
    const unsigned short* sr = scales + (size_t)o * (cols / 64);
    const unsigned short* br = biases + (size_t)o * (cols / 64);
    float acc[AFF_MAXB];
#pragma unroll
    for (int b = 0; b < AFF_MAXB; b++) acc[b] = 0.0f;
    const float a = recon_a<BITS>(), off = recon_o<BITS>();
    for (int c = lane; c < chunks; c += WARP) {
        float codes[32];
        decode_chunk<BITS>(wr, c, codes);
        float s = bf16_bits(sr[c / 2]), bias = bf16_bits(br[c / 2]);
        float ws = a * s, wb = off * s + bias;
#pragma unroll
        for (int b = 0; b < AFF_MAXB; b++) {
            if (b < nb) {
                const float* xc = xs + b * chunks * 33 + c * 33;
                float sqx = 0.0f, sx = 0.0f;
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    sqx += codes[j] * xc[j];
                    sx += xc[j];
                }
                acc[b] += ws * sqx + wb * sx;
            }
        }
    }
#pragma unroll
    for (int b = 0; b < AFF_MAXB; b++) {
        if (b < nb) {
            float t = warp_sum(acc[b]);
            if (lane == 0) out[(size_t)b * out_stride] = t;
        }
    }
}

// Stages rows `src_row(0 .. nb)` of x (`in_dim` wide, zeros up to `cols`) into `xs`.
template <typename RowOf>
__device__ __forceinline__ void stage_rows(float* xs, const float* x, RowOf src_row, int nb,
                                           int cols, int in_dim) {
    int chunks = cols / 32;
    for (int i = threadIdx.x; i < nb * cols; i += blockDim.x) {
        int b = i / cols, c = i % cols;
        xs[b * chunks * 33 + (c / 32) * 33 + c % 32] =
            c < in_dim ? x[(size_t)src_row(b) * in_dim + c] : 0.0f;
    }
}

// out[b·rows + o] = Σ_i x[b·in_dim + i]·w[o, i] for `batch` (≤ AFF_MAXB) rows of x, which
// has `in_dim` ≤ cols columns (the rest read as zeros). A warp per output row.
template <int BITS>
__device__ void affine_matvec(const unsigned* words, const unsigned short* scales,
                              const unsigned short* biases, const float* x, float* out,
                              int rows, int cols, int in_dim, int batch) {
    extern __shared__ float xs[];
    stage_rows(xs, x, [](int b) { return b; }, batch, cols, in_dim);
    __syncthreads();
    int o = blockIdx.x * AFF_WARPS + threadIdx.x / WARP;
    if (o < rows) matvec_row<BITS>(words, scales, biases, xs, out + o, rows, o, cols, batch);
}

// Many experts in one launch (the MoE dispatch of a decode step): blockIdx.y is the
// group, whose entry in `table` holds device pointers to the words, scales and biases
// of its gate, up and down matrices, then the first of its rows in the pair list and
// their count. Pair p reads row `x_rows[p]` of x (row p when `x_rows` is null) and
// writes row p of `out`. Rows go `tile` (≤ AFF_MAXB) at a time.
#define GROUP_ENTRY 11
template <int BITS>
__device__ void affine_grouped(const unsigned long long* table, int proj, const unsigned* x_rows,
                               const float* x, float* out, int rows, int cols, int in_dim,
                               int tile) {
    extern __shared__ float xs[];
    const unsigned long long* e = table + (size_t)blockIdx.y * GROUP_ENTRY;
    const unsigned* words = (const unsigned*)e[3 * proj];
    const unsigned short* scales = (const unsigned short*)e[3 * proj + 1];
    const unsigned short* biases = (const unsigned short*)e[3 * proj + 2];
    int first = (int)e[9], count = (int)e[10];
    int o = blockIdx.x * AFF_WARPS + threadIdx.x / WARP;
    for (int t0 = 0; t0 < count; t0 += tile) {
        int nb = min(tile, count - t0);
        int p0 = first + t0;
        __syncthreads();  // the previous tile's reads of xs are done
        stage_rows(xs, x, [&](int b) { return x_rows ? x_rows[p0 + b] : (unsigned)(p0 + b); },
                   nb, cols, in_dim);
        __syncthreads();
        if (o < rows)
            matvec_row<BITS>(words, scales, biases, xs, out + (size_t)p0 * rows + o, rows, o,
                             cols, nb);
    }
}

// Chunk `c` (32 values) of row `o` expanded to f32 at `dst`.
template <int BITS>
__device__ __forceinline__ void affine_chunk(const unsigned* words, const unsigned short* scales,
                                             const unsigned short* biases, size_t o, size_t c,
                                             int cols, float* out) {
    float codes[32];
    decode_chunk<BITS>(words + o * row_words<BITS>(cols), c, codes);
    size_t g = o * (cols / 64) + c / 2;
    float s = bf16_bits(scales[g]), bias = bf16_bits(biases[g]);
    const float a = recon_a<BITS>(), off = recon_o<BITS>();
    float4* dst = reinterpret_cast<float4*>(out);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float4 v;
        v.x = (a * codes[4 * j] + off) * s + bias;
        v.y = (a * codes[4 * j + 1] + off) * s + bias;
        v.z = (a * codes[4 * j + 2] + off) * s + bias;
        v.w = (a * codes[4 * j + 3] + off) * s + bias;
        dst[j] = v;
    }
}

// The matrix expanded to f32 `[rows, cols]`, a thread per chunk: for products with
// many rows, which then run as one dense GEMM.
template <int BITS>
__device__ void affine_dequant(const unsigned* words, const unsigned short* scales,
                               const unsigned short* biases, float* out, int rows, int cols) {
    size_t chunks = (size_t)rows * (cols / 32);
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    size_t o = i / (cols / 32), c = i % (cols / 32);
    affine_chunk<BITS>(words, scales, biases, o, c, cols, out + o * cols + c * 32);
}

// Rows ids[r] of the matrix expanded to f32 `[n, cols]` (an embedding lookup of a coded
// table), a thread per chunk; an id past `rows` gives a row of NaN, as `embed` does.
template <int BITS>
__device__ void affine_gather(const unsigned* words, const unsigned short* scales,
                              const unsigned short* biases, const unsigned* ids, float* out, int n,
                              int cols, unsigned rows) {
    size_t chunks = (size_t)n * (cols / 32);
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    size_t r = i / (cols / 32), c = i % (cols / 32);
    unsigned id = ids[r];
    float* dst = out + r * cols + c * 32;
    if (id >= rows) {
        for (int j = 0; j < 32; j++) dst[j] = __int_as_float(0x7fc00000);
        return;
    }
    affine_chunk<BITS>(words, scales, biases, id, c, cols, dst);
}

#define AFFINE_ENTRY(B)                                                                       \
    extern "C" __global__ void affine_matvec_q##B(const unsigned* w, const unsigned short* s,  \
                                                  const unsigned short* bi, const float* x,    \
                                                  float* out, int rows, int cols, int in_dim,  \
                                                  int batch) {                                 \
        PDL_ENTRY();                                                                           \
        affine_matvec<B>(w, s, bi, x, out, rows, cols, in_dim, batch);                         \
    }                                                                                          \
    extern "C" __global__ void affine_gate_up_q##B(                                           \
        const unsigned long long* table, const unsigned* x_rows, const float* x, float* gate,  \
        float* up, int rows, int cols, int in_dim, int tile) {                                 \
        PDL_ENTRY();                                                                           \
        int proj = blockIdx.z;                                                                 \
        affine_grouped<B>(table, proj, x_rows, x, proj == 0 ? gate : up, rows, cols, in_dim,   \
                          tile);                                                               \
    }                                                                                          \
    extern "C" __global__ void affine_down_q##B(const unsigned long long* table, const float* x, \
                                                float* out, int rows, int cols, int in_dim,    \
                                                int tile) {                                    \
        PDL_ENTRY();                                                                           \
        affine_grouped<B>(table, 2, nullptr, x, out, rows, cols, in_dim, tile);                \
    }                                                                                          \
    extern "C" __global__ void affine_dequant_q##B(const unsigned* w, const unsigned short* s, \
                                                   const unsigned short* bi, float* out,       \
                                                   int rows, int cols) {                       \
        PDL_ENTRY();                                                                           \
        affine_dequant<B>(w, s, bi, out, rows, cols);                                          \
    }                                                                                          \
    extern "C" __global__ void affine_gather_q##B(const unsigned* w, const unsigned short* s,  \
                                                  const unsigned short* bi, const unsigned* ids, \
                                                  float* out, int n, int cols, unsigned rows) { \
        PDL_ENTRY();                                                                           \
        affine_gather<B>(w, s, bi, ids, out, n, cols, rows);                                   \
    }

AFFINE_ENTRY(4)
AFFINE_ENTRY(3)
AFFINE_ENTRY(2)

// One routed expert product per (AFF_WARPS · ROUTED_ROWS output rows, pair): blockIdx.y is the pair
// (row pair / top_k of x, rank pair % top_k), whose expert ids[pair] picks a 9-pointer
// entry of `table` (gate, up, down: words, scales, biases). With `up` null the input is
// row pair / top_k of x; otherwise it is silu(x[pair]) ⊙ up[pair] (the down projection,
// the SwiGLU fused into its staging). Writes row `pair` of `out`. Dynamic shared memory:
// the staged input (33 floats a chunk) and a sum per chunk.
#define ROUTED_ENTRY 9
#define ROUTED_ROWS 4
template <int BITS>
__device__ void affine_routed(const unsigned long long* table, const int* ids, int top_k, int proj,
                              const float* x, const float* up, float* out, int rows, int cols,
                              int in_dim) {
    extern __shared__ float xs[];
    int pair = blockIdx.y;
    const unsigned long long* e = table + (size_t)ids[pair] * ROUTED_ENTRY;
    const unsigned* words = (const unsigned*)e[3 * proj];
    const unsigned short* scales = (const unsigned short*)e[3 * proj + 1];
    const unsigned short* biases = (const unsigned short*)e[3 * proj + 2];
    size_t src = (size_t)(up ? pair : pair / top_k) * in_dim;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = 0.0f;
        if (c < in_dim) {
            v = x[src + c];
            if (up) v = v / (1.0f + expf(-v)) * up[src + c];
        }
        xs[(c / 32) * 33 + c % 32] = v;
    }
    // Sums of each staged chunk, shared by every row (the bias term of a group).
    int chunks = cols / 32;
    float* csum = xs + chunks * 33;
    __syncthreads();
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float t = 0.0f;
        for (int j = 0; j < 32; j++) t += xs[c * 33 + j];
        csum[c] = t;
    }
    __syncthreads();
    // ROUTED_ROWS output rows a warp, their chunks loaded together so more loads are in
    // flight, and the staged input serves more of the matrix.
    int lane = threadIdx.x % WARP;
    int first = (blockIdx.x * AFF_WARPS + threadIdx.x / WARP) * ROUTED_ROWS;
    const float a = recon_a<BITS>(), off = recon_o<BITS>();
    float acc[ROUTED_ROWS];
#pragma unroll
    for (int j = 0; j < ROUTED_ROWS; j++) acc[j] = 0.0f;
    for (int c = lane; c < chunks; c += WARP) {
        const float* xc = xs + c * 33;
#pragma unroll
        for (int j = 0; j < ROUTED_ROWS; j++) {
            int o = first + j;
            if (o < rows) {
                float codes[32];
                decode_chunk<BITS>(words + (size_t)o * row_words<BITS>(cols), c, codes);
                size_t g = (size_t)o * (cols / 64) + c / 2;
                float sc = bf16_bits(scales[g]), bias = bf16_bits(biases[g]);
                float sqx = 0.0f;
#pragma unroll
                for (int k = 0; k < 32; k++) sqx += codes[k] * xc[k];
                acc[j] += a * sc * sqx + (off * sc + bias) * csum[c];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < ROUTED_ROWS; j++) {
        int o = first + j;
        if (o < rows) {
            float t = warp_sum(acc[j]);
            if (lane == 0) out[(size_t)pair * rows + o] = t;
        }
    }
}

#define ROUTED_AFFINE(B)                                                                      \
    extern "C" __global__ void affine_routed_gate_up_q##B(                                    \
        const unsigned long long* table, const int* ids, int top_k, const float* x,            \
        float* gate, float* up, int rows, int cols, int in_dim) {                              \
        PDL_ENTRY();                                                                           \
        int proj = blockIdx.z;                                                                 \
        affine_routed<B>(table, ids, top_k, proj, x, nullptr, proj == 0 ? gate : up, rows,     \
                         cols, in_dim);                                                        \
    }                                                                                          \
    extern "C" __global__ void affine_routed_down_q##B(                                       \
        const unsigned long long* table, const int* ids, int top_k, const float* gate,         \
        const float* up, float* out, int rows, int cols, int in_dim) {                         \
        PDL_ENTRY();                                                                           \
        affine_routed<B>(table, ids, top_k, 2, gate, up, out, rows, cols, in_dim);             \
    }

ROUTED_AFFINE(4)
ROUTED_AFFINE(3)
ROUTED_AFFINE(2)

// out[r] = Σ_k weights[r·top_k + k] · down[r·top_k + k]; overwrites. A thread per output
// value (rows · width of them), so the block's sums spread over the device instead of
// one block walking every column.
extern "C" __global__ void moe_combine(const float* down, const float* weights, float* out,
                                       int top_k, int width, long long n) {
    PDL_ENTRY();
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    size_t r = j / width, i = j % width;
    const float* w = weights + r * top_k;
    float s = 0.0f;
    for (int k = 0; k < top_k; k++) s += w[k] * down[(r * top_k + k) * width + i];
    out[j] = s;
}

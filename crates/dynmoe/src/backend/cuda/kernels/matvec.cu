// Dense products of a few rows (a decode step's) with f32 and bf16 matrices: a warp per
// output row, or per part of one, reading each weight once for every row of x. cuBLAS
// runs far under bandwidth there, and these keep it out of a recorded step.

// out[b·rows + o] = Σ_i x[b·cols + i]·w[o·cols + i] for `batch` (≤ 4) rows of x: a warp
// per output row, 16-byte loads of w (cols a multiple of 4), x read through the cache.
// For decode, where cuBLAS' GEMM runs far under bandwidth.
#define MV_MAXB 4
extern "C" __global__ void matvec_f32(const float* w, const float* x, float* out, int rows,
                                      int cols, int batch) {
    PDL_ENTRY();
    int o = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (o >= rows) return;
    const float4* wr = reinterpret_cast<const float4*>(w + (size_t)o * cols);
    int n4 = cols / 4;
    float acc[MV_MAXB];
#pragma unroll
    for (int b = 0; b < MV_MAXB; b++) acc[b] = 0.0f;
#pragma unroll 4
    for (int j = lane; j < n4; j += WARP) {
        float4 a = wr[j];
#pragma unroll
        for (int b = 0; b < MV_MAXB; b++) {
            if (b < batch) {
                float4 c = reinterpret_cast<const float4*>(x + (size_t)b * cols)[j];
                acc[b] += a.x * c.x + a.y * c.y + a.z * c.z + a.w * c.w;
            }
        }
    }
#pragma unroll
    for (int b = 0; b < MV_MAXB; b++) {
        if (b < batch) {
            float t = warp_sum(acc[b]);
            if (lane == 0) out[(size_t)b * rows + o] = t;
        }
    }
}

// matvec_f32 with w in bf16 (raw 16 bits), accumulated in f32 the same way: a warp per
// output row, 16-byte loads of w (8 values) when cols is a multiple of 8, which keeps
// every row 16-byte aligned; one value per lane otherwise. Half the bytes of the f32
// kernel, which decode is bound by. The caller has issued PDL_LAUNCH; a lane's first
// EARLY loads go out before PDL_WAIT. MAXB is the most rows of x (`acc` holds a sum each).
template <int MAXB>
__device__ __forceinline__ void dot_bf16x8(float (&acc)[MAXB], uint4 a, const float* x, int cols,
                                           int j, int batch) {
    // Little-endian: the lower half of each word is the earlier value.
    float v[8] = {__uint_as_float(a.x << 16), __uint_as_float(a.x & 0xffff0000u),
                  __uint_as_float(a.y << 16), __uint_as_float(a.y & 0xffff0000u),
                  __uint_as_float(a.z << 16), __uint_as_float(a.z & 0xffff0000u),
                  __uint_as_float(a.w << 16), __uint_as_float(a.w & 0xffff0000u)};
#pragma unroll
    for (int b = 0; b < MAXB; b++) {
        if (b < batch) {
            const float4* xb = reinterpret_cast<const float4*>(x + (size_t)b * cols) + 2 * j;
            float4 c = xb[0], d = xb[1];
            acc[b] += v[0] * c.x + v[1] * c.y + v[2] * c.z + v[3] * c.w + v[4] * d.x +
                      v[5] * d.y + v[6] * d.z + v[7] * d.w;
        }
    }
}

// Output row o (< rows, or none: the warp only waits) of that product, by one warp, for
// up to MV_MAXB rows of x.
__device__ __forceinline__ void matvec_bf16_row(const unsigned short* w, const float* x, float* out,
                                                int rows, int o, int cols, int batch) {
    constexpr int EARLY = 4;
    int lane = threadIdx.x % WARP;
    bool live = o < rows;
    const unsigned short* wr = w + (size_t)(live ? o : 0) * cols;
    float acc[MV_MAXB];
#pragma unroll
    for (int b = 0; b < MV_MAXB; b++) acc[b] = 0.0f;
    if (cols % 8 == 0) {
        const uint4* w8 = reinterpret_cast<const uint4*>(wr);
        int n8 = cols / 8;
        uint4 early[EARLY];
#pragma unroll
        for (int i = 0; i < EARLY; i++) {
            int j = lane + WARP * i;
            if (live && j < n8) early[i] = w8[j];
        }
        PDL_WAIT();
        if (!live) return;
#pragma unroll
        for (int i = 0; i < EARLY; i++) {
            int j = lane + WARP * i;
            if (j < n8) dot_bf16x8(acc, early[i], x, cols, j, batch);
        }
#pragma unroll 4
        for (int j = lane + WARP * EARLY; j < n8; j += WARP) dot_bf16x8(acc, w8[j], x, cols, j, batch);
    } else {
        PDL_WAIT();
        if (!live) return;
        for (int i = lane; i < cols; i += WARP) {
            float a = bf16_bits(wr[i]);
#pragma unroll
            for (int b = 0; b < MV_MAXB; b++)
                if (b < batch) acc[b] += a * x[(size_t)b * cols + i];
        }
    }
#pragma unroll
    for (int b = 0; b < MV_MAXB; b++) {
        if (b < batch) {
            float t = warp_sum(acc[b]);
            if (lane == 0) out[(size_t)b * rows + o] = t;
        }
    }
}

extern "C" __global__ void matvec_bf16(const unsigned short* w, const float* x, float* out,
                                       int rows, int cols, int batch) {
    PDL_LAUNCH();
    int o = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    matvec_bf16_row(w, x, out, rows, o, cols, batch);
}

// Three products of the same rows of x in one launch (a layer's q, k and v projections
// in decode, where the two narrow ones would each be a launch's latency for a few
// blocks' work): the warps' output rows run through w0's r0 rows, then w1's, then w2's.
extern "C" __global__ void matvec_bf16_3(const unsigned short* w0, const unsigned short* w1,
                                         const unsigned short* w2, const float* x, float* o0,
                                         float* o1, float* o2, int r0, int r1, int r2, int cols,
                                         int batch) {
    PDL_LAUNCH();
    int o = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (o < r0) {
        matvec_bf16_row(w0, x, o0, r0, o, cols, batch);
    } else if (o - r0 < r1) {
        matvec_bf16_row(w1, x, o1, r1, o - r0, cols, batch);
    } else {
        matvec_bf16_row(w2, x, o2, r2, o - r0 - r1, cols, batch);
    }
}

// The one-row kernels: a lane holds all of its share's loads at once, 8 of them, so a warp
// takes MV_ONE_COLS columns of a row; a wider row is cut into mv_one_parts(cols) parts (a
// power of two, at most 8), one warp each, which add through shared memory. A block of 8
// warps then takes 8 / parts rows. Rows of whole 8s only (the host sends others to the
// general kernels).
#define MV_ONE_COLS 2048
// Blocks an SM, the one-row kernels' launch bound: tunable (DYNMOE_CUDA=define=...). At 5,
// ptxas holds them to 48 registers and they spill (matvec_bf16_one 24 bytes stored,
// matvec_bf16_3_one 52); at 4, 64 registers and 8 and 52 bytes. Not yet timed.
#ifndef MV_ONE_BLOCKS
#define MV_ONE_BLOCKS 5
#endif
__device__ __forceinline__ int mv_one_parts(int cols) {
    int parts = 1;
    while (parts < 8 && parts * MV_ONE_COLS < cols) parts *= 2;
    return parts;
}

// The sum over this warp's part of row o (rows past `rows` read row 0, and are not
// stored), the lane's first loads before PDL_WAIT. `row` is what the weights multiply:
// once the wait is over, row.ready() runs (every thread of the block calls it), then
// row.dot(a, j) gives the eight weights `a` times the row's columns 8·j ...
template <typename Row>
__device__ __forceinline__ float matvec_bf16_part(const unsigned short* w, Row& row, int rows,
                                                  int o, int cols, int part, int parts) {
    int lane = threadIdx.x % WARP;
    const uint4* w8 = reinterpret_cast<const uint4*>(w + (size_t)(o < rows ? o : 0) * cols);
    int n8 = cols / 8, per = (n8 + parts - 1) / parts;
    int j0 = part * per, j1 = min(n8, j0 + per);
    constexpr int EARLY = MV_ONE_COLS / 8 / WARP;
    uint4 early[EARLY];
#pragma unroll
    for (int i = 0; i < EARLY; i++) {
        int j = j0 + lane + WARP * i;
        if (j < j1) early[i] = w8[j];
    }
    PDL_WAIT();
    row.ready();
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < EARLY; i++) {
        int j = j0 + lane + WARP * i;
        if (j < j1) acc += row.dot(early[i], j);
    }
    for (int j = j0 + lane + WARP * EARLY; j < j1; j += WARP) acc += row.dot(w8[j], j);
    return warp_sum(acc);
}

// The row x as it is.
struct RowAsIs {
    const float* x;
    __device__ void ready() const {}
    __device__ float dot(uint4 a, int j) const {
        float acc[1] = {0.0f};
        dot_bf16x8(acc, a, x, 0, j, 1);
        return acc[0];
    }
};

// The row as it is, the next kernel let start only now (past this one's wait).
struct RowThenLaunch : RowAsIs {
    __device__ void ready() const { PDL_LAUNCH(); }
};

// RMSNorm(x + delta)·w before its 1/rms (the fold above), staged once a block: once the
// wait is over (the next kernel may then start), stage_norm_row puts the row in `row`
// (shared memory) and the thread's Σ (x + delta)² in `ss`; the warps' products read the
// row there, as RowAsIs reads its x. (Read from global memory by every warp instead, it
// measured slower: each warp then reads three rows, not one.)
struct NormedRowStaged : RowAsIs {
    float* row;  // what RowAsIs's x points at
    const float* src;
    const float* delta;
    const float* w;
    float* sum;
    int cols;
    int2 slice;
    float ss;
    __device__ void ready() {
        PDL_LAUNCH();
        ss = stage_norm_row(src, delta, w, row, cols, sum, slice);
        __syncthreads();
    }
};

// Adds the parts of each of the block's rows (warp 0 of a row's parts writes it).
__device__ __forceinline__ void matvec_bf16_parts_done(float v, float* out, int rows, int o,
                                                       int part, int parts) {
    __shared__ float sums[8];
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (parts == 1) {
        if (lane == 0 && o < rows) out[o] = v;
        return;
    }
    if (lane == 0) sums[warp] = v;
    __syncthreads();
    if (lane == 0 && part == 0 && o < rows) {
        float t = 0.0f;
        for (int k = 0; k < parts; k++) t += sums[warp + k];
        out[o] = t;
    }
}

extern "C" __global__ void __launch_bounds__(256, MV_ONE_BLOCKS)
    matvec_bf16_one(const unsigned short* w, const float* x, float* out, int rows, int cols,
                    int batch) {
    PDL_LAUNCH();
    int warp = threadIdx.x / WARP, parts = mv_one_parts(cols);
    int o = blockIdx.x * (8 / parts) + warp / parts, part = warp % parts;
    RowAsIs row{x};
    float v = matvec_bf16_part(w, row, rows, o, cols, part, parts);
    matvec_bf16_parts_done(v, out, rows, o, part, parts);
}

// matvec_bf16_one for a decode step's router: the next kernel (the routed gate/up with
// `early`) may start only once this one's wait is over, so every kernel before this one
// has finished and that one may stage x and read the expert table before its own wait.
extern "C" __global__ void __launch_bounds__(256, MV_ONE_BLOCKS)
    matvec_bf16_one_late(const unsigned short* w, const float* x, float* out, int rows,
                         int cols, int batch) {
    int warp = threadIdx.x / WARP, parts = mv_one_parts(cols);
    int o = blockIdx.x * (8 / parts) + warp / parts, part = warp % parts;
    RowThenLaunch row{{x}};
    float v = matvec_bf16_part(w, row, rows, o, cols, part, parts);
    matvec_bf16_parts_done(v, out, rows, o, part, parts);
}

// matvec_bf16_one_late of RMSNorm(x + delta)·norm_w in one pass (NormedRowStaged): a
// decode step's router, which reads the post-attention norm, its row staged in dynamic
// shared memory (cols floats, whole 4s). The products are scaled by the norm's 1/rms at
// the end, from the block's sum of squares, so no reduction comes before the first
// product; block b writes its slice of x + delta to `sum`. A router's grid is a few
// blocks (16 for 128 experts), so its launch bound is not the other one-row kernels' but
// what holds a lane's early words beside the staging without spilling.
extern "C" __global__ void __launch_bounds__(256, 2)
    matvec_bf16_norm_one_late(const unsigned short* w, const float* x, const float* delta,
                              const float* norm_w, float eps, float* sum, float* out, int rows,
                              int cols) {
    extern __shared__ __align__(16) float staged_row[];
    __shared__ float scratch[32];
    int warp = threadIdx.x / WARP, parts = mv_one_parts(cols);
    int o = blockIdx.x * (8 / parts) + warp / parts, part = warp % parts;
    int2 slice = row_slice(cols, 4);
    NormedRowStaged row{{staged_row}, staged_row, x, delta, norm_w, sum, cols, slice, 0.0f};
    float v = matvec_bf16_part(w, row, rows, o, cols, part, parts);
    float inv = 1.0f / sqrtf(block_sum(row.ss, scratch) / (float)cols + eps);
    matvec_bf16_parts_done(v * inv, out, rows, o, part, parts);
}

extern "C" __global__ void __launch_bounds__(256, MV_ONE_BLOCKS)
    matvec_bf16_3_one(const unsigned short* w0, const unsigned short* w1,
                      const unsigned short* w2, const float* x, float* o0, float* o1,
                      float* o2, int r0, int r1, int r2, int cols, int batch) {
    PDL_LAUNCH();
    int warp = threadIdx.x / WARP, parts = mv_one_parts(cols);
    int o = blockIdx.x * (8 / parts) + warp / parts, part = warp % parts;
    const unsigned short* w = o < r0 ? w0 : (o - r0 < r1 ? w1 : w2);
    float* out = o < r0 ? o0 : (o - r0 < r1 ? o1 : o2);
    int rows = o < r0 ? r0 : (o - r0 < r1 ? r1 : r2);
    int row = o < r0 ? o : (o - r0 < r1 ? o - r0 : o - r0 - r1);
    RowAsIs input{x};
    float v = matvec_bf16_part(w, input, rows, row, cols, part, parts);
    matvec_bf16_parts_done(v, out, rows, row, part, parts);
}

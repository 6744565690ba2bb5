// Kernels of the CUDA backend, compiled by NVRTC for the device's architecture when
// the backend is made. Every one is checked against the CPU reference of the same op
// (crates/dynmoe/tests/cuda.rs). Tensors are row-major f32; bf16 scales and biases
// arrive as their raw 16 bits.

#define WARP 32
// NVRTC compiles without the C headers that define INFINITY.
#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90 and later): every kernel lets the next one on its
// stream be scheduled at once, then waits until the previous one has finished and its
// writes are visible before it touches memory. So a chain of small kernels (a decode
// step) overlaps each launch with the tail of the kernel before it, and nothing reads
// early. Both are no-ops for a launch that did not ask for it. The dense matrix-vector
// kernels split the two (PDL_LAUNCH, then PDL_WAIT): between them they load the first of
// their weights, which no kernel writes, so those loads overlap the kernel before. A
// "late" kernel (attn_preamble_at, matvec_bf16_one_late) takes them the other way round:
// it lets the next one start only once its own wait is over. A kernel finishes only
// after its wait, so the one after a late kernel knows that every kernel before the late
// one has finished, and with `early` it loads what those wrote before its own wait.
#if __CUDA_ARCH__ >= 900
#define PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#ifdef TIMELINE
// With TIMELINE defined (DYNMOE_CUDA=define=TIMELINE=<slots>), the first thread of
// each kernel's first block stamps the global timer as its wait returns, in launch order
// (`Cuda::timeline_take`): the gap to the next kernel's stamp is what this kernel adds
// to the chain, programmatic launch's overlap included. Off, it costs nothing.
__device__ unsigned long long timeline_stamps[TIMELINE];
__device__ unsigned timeline_count;
__device__ __forceinline__ void timeline_mark() {
    if ((blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x | threadIdx.y | threadIdx.z) == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        unsigned i = atomicAdd(&timeline_count, 1u);
        if (i < TIMELINE) timeline_stamps[i] = t;
    }
}
#define PDL_WAIT()                                              \
    do {                                                        \
        asm volatile("griddepcontrol.wait;" ::: "memory");      \
        timeline_mark();                                        \
    } while (0)
#else
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#endif
#else
#define PDL_LAUNCH()
#define PDL_WAIT()
#endif
// With PHASES defined (DYNMOE_CUDA=define=PHASES=<blocks>), thread 0 of each of the
// first <blocks> blocks of the routed gate/up (kernel 0) and down (kernel 1) launches
// stamps the global timer at each phase of its work, each launch over the one before, so
// after a decode they hold the last layer's (`Cuda::phase_stamps`): where a launch's
// share of the chain goes, block by block. Off, it costs nothing.
#define PHASE_SLOTS 8
#ifdef PHASES
__device__ unsigned long long phase_stamps[2][PHASES][PHASE_SLOTS];
__device__ __forceinline__ void phase_mark(int kernel, int k) {
    unsigned b = blockIdx.x + blockIdx.y * gridDim.x;
    if (threadIdx.x == 0 && b < PHASES) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        phase_stamps[kernel][b][k] = t;
    }
}
#define PHASE(kernel, k) phase_mark(kernel, k)
#else
#define PHASE(kernel, k)
#endif

#define PDL_ENTRY() \
    PDL_LAUNCH();   \
    PDL_WAIT()

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int warps = (blockDim.x + WARP - 1) / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int warps = (blockDim.x + WARP - 1) / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(t);
}

// A softmax's first half over the block: exp(x[i] − max) into e[i] (e may be x) for the
// n values, their max into `m` and their sum returned; every thread gets both, and e is
// complete for every thread (block_sum's barriers publish it). `scratch` holds 32 floats.
__device__ __forceinline__ float block_exp_sum(const float* x, float* e, int n, float& m,
                                               float* scratch) {
    m = NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, x[i]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = expf(x[i] - m);
        e[i] = v;
        s += v;
    }
    return block_sum(s, scratch);
}

__device__ __forceinline__ float bf16_bits(unsigned short h) {
    return __uint_as_float(((unsigned)h) << 16);
}

extern "C" __global__ void fill(float* x, float v, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) x[i] = v;
}

// Grid: one block per row.
extern "C" __global__ void embed(const float* table, const unsigned* ids, float* out, int dim) {
    PDL_ENTRY();
    const float* src = table + (size_t)ids[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = src[d];
}

// The same from a table of bf16 values (their raw 16 bits).
extern "C" __global__ void embed_bf16(const unsigned short* table, const unsigned* ids, float* out,
                                      int dim) {
    PDL_ENTRY();
    const unsigned short* src = table + (size_t)ids[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = bf16_bits(src[d]);
}

// dst[..n] = src[..n] widened from bf16: a bf16 matrix made ready for cuBLAS' sgemm.
extern "C" __global__ void bf16_to_f32(const unsigned short* src, float* dst, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) dst[i] = bf16_bits(src[i]);
}

// x split into two bf16 parts, hi = x rounded and lo = (x - hi) rounded, for tensor-core
// products with a bf16 matrix: W·hi + W·lo carries about 16 bits of x, where a single
// bf16 rounding would keep 8.
extern "C" __global__ void split_bf16(const float* x, unsigned short* hi, unsigned short* lo,
                                      long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        float v = x[i];
        unsigned short h = 0, l = 0;
#if __CUDA_ARCH__ >= 800
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(l) : "f"(v - bf16_bits(h)));
#else
        __trap();  // the host takes this path only on sm_80 and later
#endif
        hi[i] = h;
        lo[i] = l;
    }
}

// RMSNorm of rows of `dim`, optionally after a residual add (ADD: the sum x + delta
// written to `sum`, which may be x itself, then normalised). A team of threads per row: a
// warp (rows of at most NORM_WARP_DIM values, several rows a block) or the whole block
// (wider rows, one a block). 16-byte loads when every row is 16-byte aligned, else one
// value at a time. In place when `out == x`: each thread writes only what it read, after
// the reduction. The second pass reads the row again (an L1 hit) rather than holding it
// in registers, so any width works.
#define NORM_WARP_DIM 512
template <bool ADD>
__device__ __forceinline__ void norm_row(const float* x, const float* delta, const float* w,
                                         float* sum, float* out, int dim, float eps, int t,
                                         int team, float* scratch) {
    bool vec = dim % 4 == 0 &&
               ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(w) |
                 reinterpret_cast<size_t>(out) | reinterpret_cast<size_t>(delta) |
                 reinterpret_cast<size_t>(sum)) & 15) == 0;
    float s = 0.0f;
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        for (int j = t; j < dim / 4; j += team) {
            float4 v = x4[j];
            if (ADD) {
                float4 e = reinterpret_cast<const float4*>(delta)[j];
                v.x += e.x;
                v.y += e.y;
                v.z += e.z;
                v.w += e.w;
                reinterpret_cast<float4*>(sum)[j] = v;
            }
            s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int d = t; d < dim; d += team) {
            float v = x[d];
            if (ADD) {
                v += delta[d];
                sum[d] = v;
            }
            s += v * v;
        }
    }
    s = scratch ? block_sum(s, scratch) : warp_sum(s);
    float inv = 1.0f / sqrtf(s / (float)dim + eps);
    const float* y = ADD ? sum : x;
    if (vec) {
        const float4* y4 = reinterpret_cast<const float4*>(y);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4* o4 = reinterpret_cast<float4*>(out);
        for (int j = t; j < dim / 4; j += team) {
            float4 v = y4[j], g = w4[j];
            o4[j] = make_float4(g.x * (v.x * inv), g.y * (v.y * inv), g.z * (v.z * inv),
                                g.w * (v.w * inv));
        }
    } else {
        for (int d = t; d < dim; d += team) out[d] = w[d] * (y[d] * inv);
    }
}

// Rows of at most NORM_WARP_DIM: a warp per row, blockDim / 32 rows a block. Wider: a
// block per row. `delta` and `sum` are read only with ADD.
template <bool ADD>
__device__ void norm_rows(const float* x, const float* delta, const float* w, float* sum,
                          float* out, int rows, int dim, float eps) {
    __shared__ float scratch[32];
    if (dim <= NORM_WARP_DIM) {
        int r = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
        if (r >= rows) return;  // whole warps leave: no block barrier on this path
        size_t o = (size_t)r * dim;
        norm_row<ADD>(x + o, ADD ? delta + o : nullptr, w, ADD ? sum + o : nullptr, out + o,
                      dim, eps, threadIdx.x % WARP, WARP, nullptr);
    } else {
        size_t o = (size_t)blockIdx.x * dim;
        norm_row<ADD>(x + o, ADD ? delta + o : nullptr, w, ADD ? sum + o : nullptr, out + o,
                      dim, eps, threadIdx.x, blockDim.x, scratch);
    }
}

extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int rows, int dim,
                                    float eps) {
    PDL_ENTRY();
    norm_rows<false>(x, nullptr, w, nullptr, out, rows, dim, eps);
}

extern "C" __global__ void rms_norm_inplace(float* x, const float* w, int rows, int dim, float eps) {
    PDL_ENTRY();
    norm_rows<false>(x, nullptr, w, nullptr, x, rows, dim, eps);
}

// x += delta, then out = RMSNorm(x)·w: the residual add and the next norm in one pass.
extern "C" __global__ void add_rms_norm(float* x, const float* delta, const float* w, float* out,
                                        int rows, int dim, float eps) {
    PDL_ENTRY();
    norm_rows<true>(x, delta, w, x, out, rows, dim, eps);
}

// sum = x + delta, then out = RMSNorm(sum)·w, x left as it is.
extern "C" __global__ void add_rms_norm_to(const float* x, const float* delta, const float* w,
                                           float* sum, float* out, int rows, int dim,
                                           float eps) {
    PDL_ENTRY();
    norm_rows<true>(x, delta, w, sum, out, rows, dim, eps);
}

// ---- The residual add and norm in the product that reads them ----
//
// A decode step's q/k/v projections, router and LM head read RMSNorm(x + delta)·w of one
// row, where delta is what the last block added to the residual x. Rather than a launch
// of its own for that, the products read x + delta through the norm's weights in the same
// pass that stages or multiplies it, keep the sum of its squares beside, and scale their
// outputs by the norm's 1/rms at the end: the norm is linear in its input's scale, so no
// block has to reduce the row before its first product. The blocks write their slices of
// x + delta to `sum` (a buffer other than x: the other blocks still read x). The routed
// gate/up kernel, which stages its row before its launch wait, norms it there instead.

// The columns [d0, d1) of a row that block blockIdx.x of a 1-D grid writes: whole `align`s.
__device__ __forceinline__ int2 row_slice(int dim, int align) {
    int per = (dim + (int)gridDim.x * align - 1) / ((int)gridDim.x * align) * align;
    int d0 = min(dim, (int)blockIdx.x * per);
    return make_int2(d0, min(dim, d0 + per));
}

// The first 16-byte boundary at or after p (the host leaves 16 bytes for it), as float*.
__device__ __forceinline__ float* align16(const void* p) {
    return reinterpret_cast<float*>(((size_t)p + 15) & ~(size_t)15);
}

// One pass over a row of `dim` by every thread of the block: `row` (shared memory) gets
// w ⊙ (x + delta), not yet scaled by the norm's 1/rms, and `sum` (unless null) the
// columns [slice.x, slice.y) of x + delta; returns the thread's share of Σ (x + delta)².
// Coalesced float4 loads where the rows are whole 4s and aligned. The caller syncs
// before reading `row`. Products then stage `row` as their input, from shared memory:
// folded into their own staging, the three rows' loads sat on top of the words the
// products had loaded before their wait, and ptxas spilled both.
__device__ float stage_norm_row(const float* x, const float* delta, const float* w, float* row,
                                int dim, float* sum, int2 slice) {
    float ss = 0.0f;
    bool vec = dim % 4 == 0 && (((size_t)x | (size_t)delta | (size_t)w) & 15) == 0;
    if (vec) {
        for (int d = 4 * threadIdx.x; d < dim; d += 4 * blockDim.x) {
            float4 r = *reinterpret_cast<const float4*>(x + d);
            if (delta) {
                float4 e = *reinterpret_cast<const float4*>(delta + d);
                r = make_float4(r.x + e.x, r.y + e.y, r.z + e.z, r.w + e.w);
            }
            float4 g = *reinterpret_cast<const float4*>(w + d);
            ss += r.x * r.x + r.y * r.y + r.z * r.z + r.w * r.w;
            *reinterpret_cast<float4*>(row + d) =
                make_float4(g.x * r.x, g.y * r.y, g.z * r.z, g.w * r.w);
            if (sum && d >= slice.x && d < slice.y) *reinterpret_cast<float4*>(sum + d) = r;
        }
    } else {
        for (int d = threadIdx.x; d < dim; d += blockDim.x) {
            float r = x[d] + (delta ? delta[d] : 0.0f);
            ss += r * r;
            row[d] = w[d] * r;
            if (sum && d >= slice.x && d < slice.y) sum[d] = r;
        }
    }
    return ss;
}

extern "C" __global__ void add_bias(float* x, const float* bias, int dim, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % dim];
}

extern "C" __global__ void add(float* x, const float* y, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void silu_mul(float* gate, const float* up, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

extern "C" __global__ void clamp_values(float* x, float limit, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fminf(fmaxf(x[i], -limit), limit);
}

// One block per row.
extern "C" __global__ void softmax_rows(float* x, int dim) {
    PDL_ENTRY();
    __shared__ float scratch[32];
    float* row = x + (size_t)blockIdx.x * dim;
    float m;
    float s = block_exp_sum(row, row, dim, m, scratch);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) row[d] /= s;
}

// One block per (row, head); threads over the first half of the head. Row r is at
// position positions[r], or pos0 + r when `positions` is null.
extern "C" __global__ void rope(float* x, const unsigned* positions, unsigned pos0,
                                const float* inv_freq, int heads, int head_dim) {
    PDL_ENTRY();
    int r = blockIdx.x / heads, h = blockIdx.x % heads;
    int half = head_dim / 2;
    float* v = x + ((size_t)r * heads + h) * head_dim;
    float p = (float)(positions ? positions[r] : pos0 + r);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
    }
}

// One block per row.
extern "C" __global__ void gather_rows(const float* src, const unsigned* rows, float* dst, int width) {
    PDL_ENTRY();
    const float* s = src + (size_t)rows[blockIdx.x] * width;
    float* d = dst + (size_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
}

// One block per source row. Atomic, since nothing forbids a row appearing twice.
extern "C" __global__ void scatter_add_rows(const float* src, const unsigned* rows,
                                            const float* scales, float* dst, int width) {
    PDL_ENTRY();
    const float* s = src + (size_t)blockIdx.x * width;
    float* d = dst + (size_t)rows[blockIdx.x] * width;
    float k = scales[blockIdx.x];
    for (int i = threadIdx.x; i < width; i += blockDim.x) atomicAdd(&d[i], k * s[i]);
}

// Causal grouped-query attention, one block of 128 threads per (query row, head), keys
// in tiles with an online softmax so any context fits in shared memory. A warp takes a
// key at a time (lanes across the head: coalesced reads); each thread owns up to two
// output dimensions (head_dim <= 256).
#define ATT_TILE 1024
extern "C" __global__ void attention(const float* q, const float* k, const float* v, float* out,
                                     int pos0, int heads, int kv_heads, int head_dim, int window) {
    PDL_ENTRY();
    __shared__ float scratch[32];
    __shared__ float qs[256];
    __shared__ float sc[ATT_TILE];
    int r = blockIdx.x / heads, h = blockIdx.x % heads;
    int p = pos0 + r;
    int lo = window > 0 ? max(0, p + 1 - window) : 0;
    int kvh = h / (heads / kv_heads);
    size_t kvw = (size_t)kv_heads * head_dim;
    const float* qrow = q + ((size_t)r * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qrow[d];
    __syncthreads();
    float scale = 1.0f / sqrtf((float)head_dim);
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    int d0 = threadIdx.x, d1 = threadIdx.x + blockDim.x;
    float m = NEG_INF, l = 0.0f, acc0 = 0.0f, acc1 = 0.0f;
    for (int t0 = lo; t0 <= p; t0 += ATT_TILE) {
        int tn = min(ATT_TILE, p + 1 - t0);
        for (int j = warp; j < tn; j += warps) {
            const float* kr = k + (size_t)(t0 + j) * kvw + (size_t)kvh * head_dim;
            float s = 0.0f;
            for (int d = lane; d < head_dim; d += WARP) s += qs[d] * kr[d];
            s = warp_sum(s);
            if (lane == 0) sc[j] = s * scale;
        }
        __syncthreads();
        float tm = NEG_INF;
        for (int j = threadIdx.x; j < tn; j += blockDim.x) tm = fmaxf(tm, sc[j]);
        tm = block_max(tm, scratch);
        float nm = fmaxf(m, tm);
        float ts = 0.0f;
        for (int j = threadIdx.x; j < tn; j += blockDim.x) {
            float e = expf(sc[j] - nm);
            sc[j] = e;
            ts += e;
        }
        ts = block_sum(ts, scratch);  // its barriers also publish sc
        float corr = expf(m - nm);
        l = l * corr + ts;
        acc0 *= corr;
        acc1 *= corr;
        const float* vb = v + (size_t)t0 * kvw + (size_t)kvh * head_dim;
        for (int j = 0; j < tn; j++) {
            float w = sc[j];
            const float* vr = vb + (size_t)j * kvw;
            if (d0 < head_dim) acc0 += w * vr[d0];
            if (d1 < head_dim) acc1 += w * vr[d1];
        }
        m = nm;
        __syncthreads();
    }
    float* o = out + ((size_t)r * heads + h) * head_dim;
    if (d0 < head_dim) o[d0] = acc0 / l;
    if (d1 < head_dim) o[d1] = acc1 / l;
}

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

// The matrix expanded to f32 `[rows, cols]`, a thread per chunk: for products with
// many rows, which then run as one dense GEMM.
template <int BITS>
__device__ void affine_dequant(const unsigned* words, const unsigned short* scales,
                               const unsigned short* biases, float* out, int rows, int cols) {
    size_t chunks = (size_t)rows * (cols / 32);
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= chunks) return;
    size_t o = i / (cols / 32), c = i % (cols / 32);
    float codes[32];
    decode_chunk<BITS>(words + o * row_words<BITS>(cols), c, codes);
    size_t g = o * (cols / 64) + c / 2;
    float s = bf16_bits(scales[g]), bias = bf16_bits(biases[g]);
    const float a = recon_a<BITS>(), off = recon_o<BITS>();
    float4* dst = reinterpret_cast<float4*>(out + o * cols + c * 32);
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
    }

AFFINE_ENTRY(4)
AFFINE_ENTRY(3)
AFFINE_ENTRY(2)

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

__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ float2 unpack_f16x2(unsigned v) {
    float a, b;
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}"
        : "=f"(a), "=f"(b)
        : "r"(v));
    return make_float2(a, b);
}

// 16 bytes global → shared without passing through registers; zeros when !full.
__device__ __forceinline__ void copy16_async(float4* dst, const float4* src, bool full) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
                 "r"(full ? 16 : 0)
                 : "memory");
}
// One word global → shared, as copy16_async, for sources aligned to no more than a word.
__device__ __forceinline__ void copy4_async(unsigned* dst, const unsigned* src) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// c += a · b for one m16n8k16 fragment (row-major a, column-major b).
__device__ __forceinline__ void mma_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                        unsigned b1) {
#if __CUDA_ARCH__ < 800
    __trap();  // the host takes this path only on sm_80 and later
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// c = a · b, the accumulator starting from zero (no registers zeroed first).
__device__ __forceinline__ void mma_f16_first(float (&c)[4], const unsigned (&a)[4],
                                              unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ < 800
    __trap();
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
#endif
}

// Codes decoded straight to f16 pairs: a code c placed in the low bits of a half whose
// exponent field reads 1024 is the f16 value 1024 + c, and one f16x2 subtraction leaves c,
// exactly. A lane of quarter q (lane % 4) needs, for its output row, the 16 codes at
// the k positions 16·ks + 8·h + 2·q + e (ks < 4: the k step, h: b0 or b1, e: the half)
// of a 64-column group. Those are columns 16q .. 16q + 15 in the order the codes' words
// hold them: column 16q + stage_column(ks, h, e). The x tile is stored in the same
// order, so every product pairs the same column on both sides.
template <int BITS>
__device__ __forceinline__ int stage_column(int ks, int h, int e) {
    if (BITS == 4) return 8 * h + ks + 4 * e;  // word 2q + h, nibbles ks and ks + 4
    // Word q of the group (2 bits, and the upper bits of 3), bit pair ks of bytes h and
    // h + 2: columns q2_column(q % 2, ks, h + 2e) of chunk q / 2.
    int b = h + 2 * e;
    return ks < 2 ? 2 * (4 * ks + b) : 2 * (4 * (ks - 2) + b) + 1;
}

// The words a lane of quarter q decodes from one row's group `gi`: two at 4 bits (words
// 2q and 2q + 1), one at 2 bits (word q), at 3 bits the chunk's upper-bit word and its
// lowest-bit word.
template <int BITS>
__device__ __forceinline__ void load_lane_words(const unsigned* row, int gi, int q,
                                                unsigned (&w)[2]) {
    if (BITS == 4) {
        uint2 v = *reinterpret_cast<const uint2*>(row + gi * 8 + 2 * q);
        w[0] = v.x;
        w[1] = v.y;
    } else if (BITS == 2) {
        w[0] = row[gi * 4 + q];
        w[1] = 0u;
    } else {
        const unsigned* c = row + gi * 6 + 3 * (q / 2);
        w[0] = c[q % 2];
        w[1] = c[2];
    }
}

// A matrix in unit tiles (TILED; 4 and 2 bits): the lane words of unit (tile t, group gi)
// are contiguous, lane l's at ((t·groups + gi)·32 + l)·W (W = 4 at 4 bits: row g's two
// words, then row g + 8's; 2 at 2 bits: row g's word, then row g + 8's), and the unit's
// scales and biases at ((t·groups + gi)·16 + r)·2 (+1 for the bias) for its row r. A
// warp's unit is then 4 (or 2) whole cache lines and one 64-byte piece, where rows take
// 16 lines and 16 pieces: the LM head's rounds stream ~16% faster
// (tools/gpu-microbench). The words' bits are the store's, so decode_fragments applies.
template <int BITS>
__device__ __forceinline__ void load_tile_words(const unsigned* words, size_t unit, int lane,
                                                unsigned (&w)[2][2]) {
    static_assert(BITS == 4 || BITS == 2, "tiles of 4- and 2-bit words");
    if (BITS == 4) {
        uint4 v = reinterpret_cast<const uint4*>(words)[unit * WARP + lane];
        w[0][0] = v.x;
        w[0][1] = v.y;
        w[1][0] = v.z;
        w[1][1] = v.w;
    } else {
        uint2 v = reinterpret_cast<const uint2*>(words)[unit * WARP + lane];
        w[0][0] = v.x;
        w[0][1] = 0u;
        w[1][0] = v.y;
        w[1][1] = 0u;
    }
}

__device__ __forceinline__ unsigned sub_f16x2(unsigned x, unsigned y) {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 800
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(y));
#endif
    return r;
}

// b[2·ks + h]: the lane's b0 (h = 0) and b1 (h = 1) of k step ks, as f16 codes.
template <int BITS>
__device__ __forceinline__ void decode_fragments(const unsigned (&w)[2], int q, unsigned (&b)[8]) {
    const unsigned magic = 0x64006400u;  // 1024 in both halves
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            unsigned c;
            if (BITS == 4) {
                c = (w[h] >> (4 * ks)) & 0x000F000Fu;
            } else {
                c = (w[0] >> (8 * h + 2 * ks)) & 0x00030003u;
                if (BITS == 3)
                    c = (c << 1) | ((w[1] >> (8 * h + 4 * (q % 2) + ks)) & 0x00010001u);
            }
            b[2 * ks + h] = sub_f16x2(c | magic, magic);
        }
}

// Codes as subnormals: the 4- and 2-bit products of unit_products take each code as the
// f16 whose bits it is once shifted into the high bits of the significand and masked: a
// code c at bit p (p + BITS <= 10) is the subnormal c·2^(p - 24), exact, and the tensor
// cores multiply subnormals as they are. That drops decode_fragments' f16 subtraction a
// register, and where a code already sits at its place, its shift (decode_fragments
// stays for 3 bits and the grouped GEMMs). At 4
// bits every nibble goes to bits 4..7 (one accumulator); at 2 bits the even k steps'
// codes go to bits 8..9 and the odd ones' to bits 6..7, from the same shifted words, so
// they sum apart and are scaled back apart.
// The codes go high because in the lowest bits (c·2^-24) the products lost precision on
// the GPU: ten times decode_fragments' error at 4 bits and 1e-5 at 2. That fits tensor
// cores that align a k step's products and the accumulator at the largest exponent
// field among them, since a subnormal's field says 2^-14 whatever its leading zeros.
// Placed high, the GPU tests of every reader pass at decode_fragments' precision, and
// decode measured +6.3% at 4 bits and +7.4% at 2 (docs/GPU_NOTES.md, eighteenth round).

// The bit at which subnormal_fragments puts k step ks's codes.
template <int BITS> __device__ __forceinline__ constexpr int subnormal_place(int ks) {
    return BITS == 4 ? 4 : (ks % 2 ? 6 : 8);
}

// What a subnormal code of k step ks is multiplied by to be the code: 2^(24 - place).
template <int BITS> __device__ __forceinline__ constexpr float subnormal_unit(int ks) {
    return float(1u << (24 - subnormal_place<BITS>(ks)));
}

// decode_fragments' b[2·ks + h] as subnormal f16 codes at subnormal_place: at 4 bits k
// step ks takes bits 4·ks of word h, at 2 bits bits 2·(4·h + ks) of word 0 (as
// decode_fragments), each half of the word shifted as one.
template <int BITS>
__device__ __forceinline__ void subnormal_fragments(const unsigned (&w)[2], unsigned (&b)[8]) {
    static_assert(BITS == 4 || BITS == 2, "subnormal codes at 4 and 2 bits");
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            unsigned word = BITS == 4 ? w[h] : w[0];
            int from = BITS == 4 ? 4 * ks : 2 * (4 * h + ks), to = subnormal_place<BITS>(ks);
            unsigned src = to >= from ? word << (to - from) : word >> (from - to);
            unsigned mask = ((1u << BITS) - 1u) << to;
            b[2 * ks + h] = src & (mask | mask << 16);
        }
}

// The 16 x values of columns 16q .. 16q + 15 as f16 hi and lo parts, paired in the
// lane order above: word 4·ks + h holds positions 16·ks + 8·h + 2q + (0, 1). The indices
// fold to constants, so `v` stays in registers.
template <int BITS>
__device__ __forceinline__ void split_pairs(const float (&v)[16], unsigned (&hi)[8],
                                            unsigned (&lo)[8]) {
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float v0 = v[stage_column<BITS>(ks, h, 0)], v1 = v[stage_column<BITS>(ks, h, 1)];
            unsigned x = pack_f16x2(v0, v1);
            float2 r = unpack_f16x2(x);
            hi[2 * ks + h] = x;
            lo[2 * ks + h] = pack_f16x2(v0 - r.x, v1 - r.y);
        }
}

// Columns k0 .. k0 + 15 of `row` (`in_dim` wide; zeros past it, and for a null row), by
// float4 when `vec` says the row's float4s are whole and aligned.
__device__ __forceinline__ void load_x16(const float* row, int k0, int in_dim, bool vec,
                                         float (&v)[16]) {
    if (row && vec && k0 + 16 <= in_dim) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float4 f = *reinterpret_cast<const float4*>(row + k0 + 4 * j);
            v[4 * j] = f.x;
            v[4 * j + 1] = f.y;
            v[4 * j + 2] = f.z;
            v[4 * j + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 16; j++) v[j] = row && k0 + j < in_dim ? row[k0 + j] : 0.0f;
    }
}

// f(mt, jt, i, r, c) for each element i of a warp's (mt, jt) accumulator fragments over
// 32 pair rows and 16 output columns: pair row r = 16·mt + g (+8 for i ≥ 2), output
// column c = c0 + 8·jt + 2q (+1 for odd i).
template <typename F>
__device__ __forceinline__ void for_fragments(int c0, F f) {
    int lane = threadIdx.x % WARP, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int jt = 0; jt < 2; jt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                f(mt, jt, i, 16 * mt + g + (i >= 2 ? 8 : 0), c0 + 8 * jt + 2 * q + (i & 1));
}

// A down GEMM tile's products (for_fragments from column c0) added into their rows:
// out[x_rows[first + r], c] += pair_scales[first + r] · acc, atomically (a token's experts
// add into its row). Rows from `count` on and columns from `rows` on are not there.
__device__ __forceinline__ void add_down_fragments(const float (&acc)[2][2][4], int c0, int count,
                                                   int rows, int first, const unsigned* x_rows,
                                                   const float* pair_scales, float* out) {
    for_fragments(c0, [&](int mt, int jt, int i, int r, int c) {
        if (r < count && c < rows)
            atomicAdd(out + (size_t)x_rows[first + r] * rows + c,
                      pair_scales[first + r] * acc[mt][jt][i]);
    });
}

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

// Device-to-device copy at full width, the bandwidth ceiling kernels are compared with.
extern "C" __global__ void copy_f4(const float4* src, float4* dst, long long n4) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n4; i += stride) dst[i] = src[i];
}

// ---- A MoE block routed on the device (decode): no host round trip ----

// The best (value, index) over the block, ties to the lower index; every thread gets it.
__device__ void block_argmax(float& v, int& i, float* sv, int* si) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int warps = (blockDim.x + WARP - 1) / WARP;
    for (int o = WARP / 2; o > 0; o /= 2) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = lane < warps ? sv[lane] : NEG_INF;
    i = lane < warps ? si[lane] : 0x7fffffff;
    for (int o = WARP / 2; o > 0; o /= 2) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
}

// Most experts a routed expert kernel routes itself, its candidates in static shared
// memory (the host routes more in moe_route first).
#define ROUTE_SHARED_MAX 256

// The place of each of `experts` candidates (`cand`, shared memory, written before the
// call) among them: the top_k, best first, ties to the lower id, into out_ids (and their
// values into out_w unless it is null). Each candidate's place is its rank, counted by
// its own thread, so no thread waits on a pick of one expert after another. `cand` must
// be complete for every thread (after a barrier); the ids are when it returns. Every
// thread of the block calls.
__device__ void rank_candidates(const float* cand, int experts, int top_k, int* out_ids,
                                float* out_w) {
    bool vec = experts % 4 == 0;
    for (int d = threadIdx.x; d < experts; d += blockDim.x) {
        float x = cand[d];
        int rank = 0;
        // Better scores, and equal ones of lower ids, until top_k are found.
        if (vec) {
            const float4* c4 = reinterpret_cast<const float4*>(cand);
            for (int j = 0; j < experts / 4 && rank < top_k; j++) {
                float4 y = c4[j];
                int e = 4 * j;
                rank += (y.x > x || (y.x == x && e < d)) + (y.y > x || (y.y == x && e + 1 < d)) +
                        (y.z > x || (y.z == x && e + 2 < d)) + (y.w > x || (y.w == x && e + 3 < d));
            }
        } else {
            for (int j = 0; j < experts && rank < top_k; j++)
                rank += cand[j] > x || (cand[j] == x && j < d);
        }
        if (rank < top_k) {
            out_ids[rank] = d;
            if (out_w) out_w[rank] = x;
        }
    }
    __syncthreads();
}

// route_block's probabilities alone: the row's softmax into `probs` (unless null; it may
// be `row`), and into `cand` the candidates route_block ranks, the mask's kept share
// rescaled to one and the rest (and NaNs) at -inf; both complete for every thread when it
// returns. Every thread of the block calls.
__device__ void route_probabilities(const float* row, float* probs, const unsigned char* keep,
                                    int experts, float* cand, float* scratch) {
    float m;
    float s = block_exp_sum(row, cand, experts, m, scratch);
    float kept = 0.0f;
    for (int d = threadIdx.x; d < experts; d += blockDim.x) {
        float p = cand[d] / s;
        if (probs) probs[d] = p;
        cand[d] = p;
        if (!keep || keep[d]) kept += p;
    }
    if (keep) kept = block_sum(kept, scratch);
    for (int d = threadIdx.x; d < experts; d += blockDim.x) {
        float p = !keep ? cand[d] : (keep[d] ? cand[d] / kept : NEG_INF);
        cand[d] = p == p ? p : NEG_INF;  // NaN ranks as masked: never above a number
    }
    __syncthreads();
}

// The chosen weights divided by their sum, added in rank order as the host does, by
// thread 0; complete for every thread when it returns.
__device__ void renormalize_route(float* w, int top_k) {
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int k = 0; k < top_k; k++) t += w[k];
        for (int k = 0; k < top_k; k++) w[k] /= t;
    }
    __syncthreads();
}

// The route of one row of `experts` router logits by every thread of the block: softmax,
// then among the experts `keep` marks (all when null) the top_k, best first, ties to the
// lower id, with their weights. As on the host (moe::route after residency::confine), a
// mask first rescales the kept probabilities to sum to one; `renormalize` divides the
// chosen ones by their sum. Each candidate's place is its rank among all of them, counted
// by its own thread against `cand` in shared memory (`experts` floats), so no thread waits
// on a pick of one expert after another: a single warp picking top-8 of 128 by shuffles
// took ~7 µs, most of a decode step's routed experts. Writes the unmasked probabilities to
// `probs` when it is not null (it may be `row`: a thread reads and writes only its own
// experts), the ids and weights to `out_ids`/`out_w` (complete for every thread when this
// returns). `scratch`: 32 shared floats. Every thread of the block calls.
__device__ void route_block(const float* row, float* probs, const unsigned char* keep,
                            int* out_ids, float* out_w, int experts, int top_k, int renormalize,
                            float* cand, float* scratch) {
    route_probabilities(row, probs, keep, experts, cand, scratch);
    rank_candidates(cand, experts, top_k, out_ids, out_w);
    if (renormalize) renormalize_route(out_w, top_k);
}

// The route of route_block chosen by the logits themselves, the softmax's reductions
// left out: the top_k of a softmax are the top_k of its logits, and a mask's rescaling
// keeps the order among the kept. Only a tie after rounding differs: two logits apart by
// less than the probabilities resolve fall to the higher logit here, to the lower id
// there. With `weights` the block also takes route_block's probabilities and gives the
// chosen ones route_block's weights (the same bits); without, `out_w` is not written.
// Every thread of the block calls; `out_ids` (and `out_w`) are complete when it returns.
__device__ void route_by_logits(const float* row, const unsigned char* keep, int* out_ids,
                                float* out_w, int experts, int top_k, int renormalize,
                                bool weights, float* cand, float* scratch) {
    for (int d = threadIdx.x; d < experts; d += blockDim.x) {
        float l = keep && !keep[d] ? NEG_INF : row[d];
        cand[d] = l == l ? l : NEG_INF;  // NaN ranks as masked
    }
    __syncthreads();
    rank_candidates(cand, experts, top_k, out_ids, nullptr);
    if (!weights) return;
    // cand becomes the masked probabilities; the chosen ones' are their weights.
    route_probabilities(row, nullptr, keep, experts, cand, scratch);
    for (int k = threadIdx.x; k < top_k; k += blockDim.x) out_w[k] = cand[out_ids[k]];
    __syncthreads();
    if (renormalize) renormalize_route(out_w, top_k);
}

// One block per row of router logits `probs` ([rows, experts], replaced by their softmax,
// unmasked): the row's route (route_block) into ids[row·top_k ..] and weights[row·top_k ..].
// Dynamic shared memory: experts floats.
extern "C" __global__ void moe_route(float* probs, const unsigned char* keep, int* ids,
                                     float* weights, int experts, int top_k, int renormalize) {
    PDL_ENTRY();
    extern __shared__ float cand[];
    __shared__ float scratch[32];
    float* row = probs + (size_t)blockIdx.x * experts;
    route_block(row, row, keep, ids + (size_t)blockIdx.x * top_k,
                weights + (size_t)blockIdx.x * top_k, experts, top_k, renormalize, cand, scratch);
}

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

// ---- Routed experts on tensor cores: a decode step's MoE dispatch ----
//
// The matrix-vector kernels above convert every code to a float on its own and issue a
// row's loads only after the block has staged x. Here every lane first issues the loads
// of all the words it will decode, then the block stages x. The codes become f16 by the
// exponent trick of the grouped GEMMs, and mma.sync takes 16 weight rows as its A
// operand (a lane of group g holds rows g and g + 8) and x as B: column 0 holds the f16
// hi part of x, column 1 the lo part, the other six are zero. Lane (g, q = 0) then holds
// rows g and g + 8 times both parts, and adds them per 64-column group with its scale
// and bias, as every affine kernel does.
//
// A block takes RMMA_ROWS output rows. A unit is one 64-column group of one input row;
// the warps split the units, and the block adds their partial sums in a fixed order, so
// results do not depend on timing. A warp loads at most UNITS units' words at once and
// takes more in further rounds.
#define RMMA_WARPS 8
// The down kernel's blocks take 16 warps: a decode step has one block per RMMA_ROWS output
// rows (128 for a 2048-wide model), a block an SM, and each warp's chain of units is what
// the step waits for, so twice the warps halve it.
#define RMMA_DOWN_WARPS 16
#define RMMA_ROWS 16
// A staged unit: f16x2 words [hi/lo][ks][q][h]; the lo half starts 40 words on, so the
// two lane groups that read them (g = 0 and g = 1) fall in different banks.
#define RMMA_HALF 40
#define RMMA_UNIT (2 * RMMA_HALF)

// Stages `units` units into `xs` (RMMA_UNIT words each) in the fragment order of
// decode_fragments, and each unit's sum into `xsum`. Unit u is group u % groups of row
// row_of(u / groups) of x, which is `in_dim` wide (zeros past it). A thread takes 16
// columns (a quarter of a group) at a time; a unit's four quarters sit in consecutive
// lanes. Threads `tid` of `threads` (whole warps) share the work; each must call it.
// `input` (for one row) may change the 16 values a thread loads. With `xscale`, each unit is staged
// times the power of two that puts its largest value in [2^14, 2^15), and xscale[u] gets
// its inverse: a row that is not normed yet may be far outside f16's range, and powers
// of two scale it exactly. `xsum` stays unscaled.
struct InputAsIs {
    __device__ void operator()(int, float (&)[16]) const {}
};

// The values times the norm's 1/rms, for a row stage_norm_row put in shared memory.
struct InputScaled {
    float inv;
    __device__ void operator()(int, float (&v)[16]) const {
#pragma unroll
        for (int j = 0; j < 16; j++) v[j] *= inv;
    }
};

template <int BITS, typename RowOf, typename Input = InputAsIs>
__device__ void stage_units(unsigned* xs, float* xsum, const float* x, RowOf row_of, int units,
                             int groups, int in_dim, int tid, int threads, Input input = {},
                             float* xscale = nullptr) {
    bool vec = in_dim % 4 == 0 && ((size_t)x & 15) == 0;  // whole float4s, aligned
    int items = 4 * units;
    for (int base = 0; base < items; base += threads) {
        int i = base + tid;
        bool live = i < items;
        int u = live ? i / 4 : 0, q = i % 4;
        const float* src = x + (size_t)row_of(u / groups) * in_dim;
        float v[16];
        int k0 = (u % groups) * 64 + 16 * q;
        load_x16(live ? src : nullptr, k0, in_dim, vec, v);
        if (live) input(k0, v);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; j++) s += v[j];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (xscale) {
            float m = 0.0f;
#pragma unroll
            for (int j = 0; j < 16; j++) m = fmaxf(m, fabsf(v[j]));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            // Below 2^-100 a unit is as good as zero; the bound keeps 2^(14 - e) finite.
            int e = m > 0.0f ? max(-100, ilogbf(m)) : 0;
            float up = ldexpf(1.0f, 14 - e);
#pragma unroll
            for (int j = 0; j < 16; j++) v[j] *= up;
            if (live && q == 0) xscale[u] = ldexpf(1.0f, e - 14);
        }
        if (!live) continue;
        if (q == 0) xsum[u] = s;
        unsigned hi[8], lo[8];
        split_pairs<BITS>(v, hi, lo);
        unsigned* dst = xs + (size_t)u * RMMA_UNIT + 2 * q;
#pragma unroll
        for (int ks = 0; ks < 4; ks++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                dst[8 * ks + h] = hi[2 * ks + h];
                dst[RMMA_HALF + 8 * ks + h] = lo[2 * ks + h];
            }
    }
}

// One unit's products for the lane's rows g and g + 8 of a matrix: the partial sums
// Σ q·x of the group (on lanes with q = 0; the others hold zeros), from the lane's words
// `w` (row g, row g + 8) and the staged unit's B fragments `bx`.
template <int BITS>
__device__ __forceinline__ float2 unit_products(const unsigned (&w)[2][2], int q,
                                                const unsigned (&bx)[8]) {
    if constexpr (BITS != 3) {
        unsigned a0[8], a1[8];
        subnormal_fragments<BITS>(w[0], a0);
        subnormal_fragments<BITS>(w[1], a1);
        // Steps whose codes sit at one place share an accumulator: all four at 4 bits,
        // the even and the odd apart at 2.
        constexpr bool apart = subnormal_place<BITS>(0) != subnormal_place<BITS>(1);
        float even[4], odd[4];
#pragma unroll
        for (int ks = 0; ks < 4; ks++) {
            unsigned a[4] = {a0[2 * ks], a1[2 * ks], a0[2 * ks + 1], a1[2 * ks + 1]};
            float(&c)[4] = apart && ks % 2 ? odd : even;
            if (ks < (apart ? 2 : 1))
                mma_f16_first(c, a, bx[2 * ks], bx[2 * ks + 1]);
            else
                mma_f16(c, a, bx[2 * ks], bx[2 * ks + 1]);
        }
        const float unit = subnormal_unit<BITS>(0), unit_odd = subnormal_unit<BITS>(1);
        if constexpr (!apart)
            return make_float2((even[0] + even[1]) * unit, (even[2] + even[3]) * unit);
        return make_float2((even[0] + even[1]) * unit + (odd[0] + odd[1]) * unit_odd,
                           (even[2] + even[3]) * unit + (odd[2] + odd[3]) * unit_odd);
    }
    unsigned a0[8], a1[8];
    decode_fragments<BITS>(w[0], q, a0);
    decode_fragments<BITS>(w[1], q, a1);
    float c[4];
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        unsigned a[4] = {a0[2 * ks], a1[2 * ks], a0[2 * ks + 1], a1[2 * ks + 1]};
        if (ks == 0)
            mma_f16_first(c, a, bx[0], bx[1]);
        else
            mma_f16(c, a, bx[2 * ks], bx[2 * ks + 1]);
    }
    return make_float2(c[0] + c[1], c[2] + c[3]);
}

// The B fragments of staged unit u for lane (g, q): hi for g = 0, lo for g = 1, zeros
// for the rest.
__device__ __forceinline__ void unit_fragments(const unsigned* xs, int u, int g, int q,
                                               unsigned (&bx)[8]) {
    const unsigned* src = xs + (size_t)u * RMMA_UNIT + g * RMMA_HALF + 2 * q;
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        uint2 v = g < 2 ? *reinterpret_cast<const uint2*>(src + 8 * ks) : make_uint2(0u, 0u);
        bx[2 * ks] = v.x;
        bx[2 * ks + 1] = v.y;
    }
}

// Scale and bias of rows g and g + 8 for lanes with q = 0: lane q of each quad loads
// one of the four (scale g, bias g, scale g + 8, bias g + 8) as `mine`.
__device__ __forceinline__ float4 quad_scales(unsigned short mine, int lane) {
    float v = bf16_bits(mine);
    int base = lane & ~3;
    return make_float4(v, __shfl_sync(0xffffffffu, v, base + 1),
                       __shfl_sync(0xffffffffu, v, base + 2),
                       __shfl_sync(0xffffffffu, v, base + 3));
}

// One unit's w·x for the lane's rows g and g + 8 (valid on lanes with q = 0): the codes'
// products with the staged unit's fragments `bx`, scaled by the rows' scale and bias
// (`sb`, quad_scales' item) with the unit's sum `s` of x. value = (a·q + o)·scale + bias,
// so w·x = a·scale·Σ q·x + (o·scale + bias)·Σ x.
// `xs` is the unit's xscale where stage_units scaled it.
template <int BITS>
__device__ __forceinline__ float2 unit_dot(const unsigned (&w)[2][2], unsigned short sb,
                                           const unsigned (&bx)[8], float s, int q, int lane,
                                           float xs = 1.0f) {
    const float a = recon_a<BITS>(), off = recon_o<BITS>();
    float2 p = unit_products<BITS>(w, q, bx);
    float4 f = quad_scales(sb, lane);
    return make_float2(a * f.x * (p.x * xs) + (off * f.x + f.y) * s,
                       a * f.z * (p.y * xs) + (off * f.z + f.w) * s);
}

// The lane's words of unit group `gi` for rows g and g + 8 (`rows0`, `rows1` point at
// them), and its quad item of the scales and biases.
template <int BITS>
__device__ __forceinline__ void load_unit(const unsigned* row0, const unsigned* row1,
                                          const unsigned short* scales,
                                          const unsigned short* biases, size_t sb_row0,
                                          size_t sb_row1, int gi, int q, unsigned (&w)[2][2],
                                          unsigned short& sb) {
    load_lane_words<BITS>(row0, gi, q, w[0]);
    load_lane_words<BITS>(row1, gi, q, w[1]);
    const unsigned short* src = (q & 1) ? biases : scales;
    sb = src[(q < 2 ? sb_row0 : sb_row1) + gi];
}

// One block's RMMA_ROWS rows (from r0) of one pair's gate and up products, its warps
// splitting the units of the pair's input row, which the block stages in xs / xsum
// (stage_units). `entry` is the expert's ROUTED_ENTRY pointers. The caller issues
// load(u0) (which may go out before x is staged), then calls finish once x is staged.
// Which rows and units of one RMMA_ROWS-row tile a thread takes: lane (g, q) holds rows
// r0 + g and r0 + g + 8 (a row past the matrix reads row 0 and is never stored), its warp
// (of the block's `warps`) units [u0, u1) of `units`; rows are `stride` words.
struct TileLanes {
    int groups, rows, r0, lane, warp, warps, g, q, u0, u1, o0, o1;
    size_t stride;

    __device__ TileLanes(int r0_, int rows_, int cols, int units, size_t stride_)
        : groups(cols / 64), rows(rows_), r0(r0_), stride(stride_) {
        lane = threadIdx.x % WARP;
        warp = threadIdx.x / WARP;
        warps = blockDim.x / WARP;
        g = lane >> 2;
        q = lane & 3;
        o0 = r0 + g < rows ? r0 + g : 0;
        o1 = r0 + g + 8 < rows ? r0 + g + 8 : 0;
        int per = (units + warps - 1) / warps;
        u0 = min(units, warp * per);
        u1 = min(units, u0 + per);
    }
};

// The lane's words of a unit in tiles and its quad item of the scales and biases (as
// load_unit).
template <int BITS>
__device__ __forceinline__ void load_unit_tiled(const unsigned* words, const unsigned short* sb,
                                                size_t unit, int lane, int g, int q,
                                                unsigned (&w)[2][2], unsigned short& s) {
    load_tile_words<BITS>(words, unit, lane, w);
    s = sb[(unit * RMMA_ROWS + (q < 2 ? g : g + 8)) * 2 + (q & 1)];
}

// With TILED, the expert's matrices are in unit tiles (load_unit_tiled): the entry's
// words and scales point at the tiles, its biases are not read.
template <int BITS, int UNITS, bool TILED = false>
struct GateUpTile : TileLanes {
    const unsigned* rw[2][2];
    const unsigned short* sc[2];
    const unsigned short* bi[2];
    unsigned w[UNITS][2][2][2];
    unsigned short sb[UNITS][2];
    float acc[2][2];

    __device__ GateUpTile(const unsigned long long* entry, int r0_, int rows_, int cols)
        : TileLanes(r0_, rows_, cols, cols / 64, row_words<BITS>(cols)) {
#pragma unroll
        for (int m = 0; m < 2; m++) {
            const unsigned* words = (const unsigned*)entry[3 * m];
            rw[m][0] = TILED ? words : words + o0 * stride;
            rw[m][1] = TILED ? words : words + o1 * stride;
            sc[m] = (const unsigned short*)entry[3 * m + 1];
            bi[m] = (const unsigned short*)entry[3 * m + 2];
            acc[m][0] = acc[m][1] = 0.0f;
        }
    }

    __device__ void load(int base) {
#pragma unroll
        for (int j = 0; j < UNITS; j++)
            if (base + j < u1)
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    if constexpr (TILED)
                        load_unit_tiled<BITS>(rw[m][0], sc[m],
                                              (size_t)(r0 / RMMA_ROWS) * groups + base + j,
                                              lane, g, q, w[j][m], sb[j][m]);
                    else
                        load_unit<BITS>(rw[m][0], rw[m][1], sc[m], bi[m], (size_t)o0 * groups,
                                        (size_t)o1 * groups, base + j, q, w[j][m], sb[j][m]);
                }
    }

    __device__ void compute(int base, const unsigned* xs, const float* xsum) {
#pragma unroll
        for (int j = 0; j < UNITS; j++) {
            if (base + j >= u1) break;
            unsigned bx[8];
            unit_fragments(xs, base + j, g, q, bx);
            float s = xsum[base + j];
#pragma unroll
            for (int m = 0; m < 2; m++) {
                float2 d = unit_dot<BITS>(w[j][m], sb[j][m], bx, s, q, lane);
                acc[m][0] += d.x;
                acc[m][1] += d.y;
            }
        }
    }

    // The rest of the units after load(u0), then the warps' sums added in order (through
    // `red`, [warps][2][RMMA_ROWS]) into h[r0 ..] = silu(gate) ⊙ up. Every thread
    // calls; `red` may be reused when it returns.
    __device__ void finish(const unsigned* xs, const float* xsum, float* red, float* h) {
        compute(u0, xs, xsum);
        for (int base = u0 + UNITS; base < u1; base += UNITS) {
            load(base);
            compute(base, xs, xsum);
        }
        if (q == 0) {
#pragma unroll
            for (int m = 0; m < 2; m++) {
                red[(warp * 2 + m) * RMMA_ROWS + g] = acc[m][0];
                red[(warp * 2 + m) * RMMA_ROWS + g + 8] = acc[m][1];
            }
        }
        __syncthreads();
        PHASE(0, 4);
        int t = threadIdx.x;
        if (t < RMMA_ROWS && r0 + t < rows) {
            float gv = 0.0f, uv = 0.0f;
            for (int k = 0; k < warps; k++) {
                gv += red[(k * 2) * RMMA_ROWS + t];
                uv += red[(k * 2 + 1) * RMMA_ROWS + t];
            }
            h[r0 + t] = gv / (1.0f + expf(-gv)) * uv;
        }
        __syncthreads();
        PHASE(0, 5);
    }
};

// One block's RMMA_ROWS rows (from r0) of a token's down projections, weighted by its
// route and added in a fixed order: out[r0 ..] = Σ_k weights[k] · down_{ids[k]}(h_k).
// Unit u is group u % groups of pair u / groups, staged by the block in xs / xsum; `ids`
// and `weights` are the token's top_k (global or shared memory). As GateUpTile: load(u0),
// then finish once h is staged.
template <int BITS, int UNITS, bool TILED = false>
struct DownTile : TileLanes {
    const unsigned long long* table;
    const int* ids;
    const float* weights;
    unsigned w[UNITS][2][2];
    unsigned short sb[UNITS];
    float pw[UNITS];
    float acc[2];

    __device__ DownTile(const unsigned long long* table_, const int* ids_, const float* weights_,
                        int top_k, int r0_, int rows_, int cols)
        : TileLanes(r0_, rows_, cols, top_k * (cols / 64), row_words<BITS>(cols)),
          table(table_), ids(ids_), weights(weights_) {
        acc[0] = acc[1] = 0.0f;
    }

    __device__ void load(int base) {
#pragma unroll
        for (int j = 0; j < UNITS; j++) {
            int u = base + j;
            if (u < u1) {
                int k = u / groups;
                const unsigned long long* e = table + (size_t)ids[k] * ROUTED_ENTRY;
                const unsigned* words = (const unsigned*)e[6];
                if constexpr (TILED)
                    load_unit_tiled<BITS>(words, (const unsigned short*)e[7],
                                          (size_t)(r0 / RMMA_ROWS) * groups + u % groups, lane,
                                          g, q, w[j], sb[j]);
                else
                    load_unit<BITS>(words + o0 * stride, words + o1 * stride,
                                    (const unsigned short*)e[7], (const unsigned short*)e[8],
                                    (size_t)o0 * groups, (size_t)o1 * groups, u % groups, q,
                                    w[j], sb[j]);
                pw[j] = weights[k];
            }
        }
    }

    __device__ void compute(int base, const unsigned* xs, const float* xsum) {
#pragma unroll
        for (int j = 0; j < UNITS; j++) {
            if (base + j >= u1) break;
            unsigned bx[8];
            unit_fragments(xs, base + j, g, q, bx);
            float2 d = unit_dot<BITS>(w[j], sb[j], bx, xsum[base + j], q, lane);
            acc[0] += pw[j] * d.x;
            acc[1] += pw[j] * d.y;
        }
    }

    // As GateUpTile::finish, into out[r0 ..] (`red`: [warps][RMMA_ROWS]).
    __device__ void finish(const unsigned* xs, const float* xsum, float* red, float* out) {
        compute(u0, xs, xsum);
        for (int base = u0 + UNITS; base < u1; base += UNITS) {
            load(base);
            compute(base, xs, xsum);
        }
        if (q == 0) {
            red[warp * RMMA_ROWS + g] = acc[0];
            red[warp * RMMA_ROWS + g + 8] = acc[1];
        }
        __syncthreads();
        PHASE(1, 3);
        int t = threadIdx.x;
        if (t < RMMA_ROWS && r0 + t < rows) {
            float v = 0.0f;
            for (int k = 0; k < warps; k++) v += red[k * RMMA_ROWS + t];
            out[r0 + t] = v;
        }
        __syncthreads();
        PHASE(1, 4);
    }
};

// Waits until *c ≥ target (the acquire makes the writes before the increments visible to
// this thread; the caller's fence and barrier pass them to its block).
__device__ __forceinline__ void wait_count(const unsigned* c, unsigned target) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        unsigned v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
        if (v >= target) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > 2000000000ull) __trap();
        __nanosleep(32);
    }
}

// Gate and up of pair blockIdx.y (input row pair / top_k of x, its expert of rank
// pair % top_k), RMMA_ROWS rows from blockIdx.x·RMMA_ROWS: h[pair] = silu(gate) ⊙ up. The
// unit is a group of x's row. With `logits` null the pair's expert is ids[pair], routed
// before; otherwise the block routes its token itself (route_block on its row of
// `logits`: at most ROUTE_SHARED_MAX experts), issues its words' loads and stages x while
// they come, and the first block of the token's first pair writes the token's ids and
// weights for the down kernel. The logits are left as they are: blocks of the same
// token read them until the last has routed (the down kernel writes the probabilities).
//
// With `early` (the router before is matvec_bf16_one_late, which lets this kernel start
// only once its own wait is over, so x and the table are final), the block stages x and
// copies every expert's gate and up pointers into shared memory (after the staged units'
// space: 6 words an expert) before its own wait; after it, only the route and the words
// of the chosen expert are left. The caller does PDL_LAUNCH; this waits.
//
// With `norm_w` (one row), the block reads its row as RMSNorm(x + delta)·norm_w, x being
// the residual: the router before folds the same norm into its own products, so no
// kernel writes the normed row, and with `early` all of it happens before the wait.
//
// With `ready` (one row, routed here), the block that writes the route then raises
// ready[0] for the down kernel (routed_mma_down).
#define GATE_UP_POINTERS 6

template <int BITS, int UNITS, bool TILED = false>
__device__ void routed_mma_gate_up(const unsigned long long* table, const float* logits,
                                   const unsigned char* keep, int experts, int renormalize,
                                   int* ids, float* weights, int top_k, const float* x,
                                   float* h, int rows, int cols, int in_dim, bool early,
                                   const float* delta, const float* norm_w, float eps,
                                   unsigned* ready) {
    extern __shared__ __align__(16) unsigned smem[];
    __shared__ int route_ids[ROUTE_SHARED_MAX];
    __shared__ float route_w[ROUTE_SHARED_MAX];
    __shared__ __align__(16) float cand[ROUTE_SHARED_MAX];
    __shared__ float scratch[32];
    int groups = cols / 64;
    unsigned* xs = smem;
    float* xsum = reinterpret_cast<float*>(smem + (size_t)groups * RMMA_UNIT);
    float* red = xsum + groups;
    int pair = blockIdx.y, token = pair / top_k, rank = pair % top_k;
    // Every expert's gate and up pointers, 8-byte aligned after `red`.
    unsigned long long* pointers = reinterpret_cast<unsigned long long*>(
        smem + (((size_t)groups * RMMA_UNIT + groups + RMMA_WARPS * 2 * RMMA_ROWS + 1) & ~(size_t)1));
    // With the norm, the row through it (in_dim floats) after every expert's pointers.
    float* normed = align16(pointers + (size_t)experts * GATE_UP_POINTERS);
    auto stage_x = [&] {
        auto row = [&](int) { return token; };
        if (norm_w) {
            float ss = stage_norm_row(x, delta, norm_w, normed, in_dim, nullptr, {0, 0});
            float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)in_dim + eps);
            stage_units<BITS>(xs, xsum, normed, row, groups, groups, in_dim, threadIdx.x,
                              blockDim.x, InputScaled{inv});
        } else {
            stage_units<BITS>(xs, xsum, x, row, groups, groups, in_dim, threadIdx.x, blockDim.x);
        }
    };
    PHASE(0, 0);
    if (early) {
        for (int i = threadIdx.x; i < experts * GATE_UP_POINTERS; i += blockDim.x)
            pointers[i] = table[(size_t)(i / GATE_UP_POINTERS) * ROUTED_ENTRY + i % GATE_UP_POINTERS];
        stage_x();
        __syncthreads();
        PDL_WAIT();
    } else {
        PDL_WAIT();
    }
    PHASE(0, 1);
    int expert;
    if (logits) {
        // By the logits: only the block that writes the route takes its weights.
        bool writes = blockIdx.x == 0 && rank == 0;
        route_by_logits(logits + (size_t)token * experts, keep, route_ids, route_w, experts,
                        top_k, renormalize, writes, cand, scratch);
        if (writes) {
            for (int k = threadIdx.x; k < top_k; k += blockDim.x) {
                ids[token * top_k + k] = route_ids[k];
                weights[token * top_k + k] = route_w[k];
            }
            // With `ready`, the down kernel's blocks load their words once it is raised,
            // before their own wait.
            if (ready) {
                __threadfence();
                __syncthreads();
                if (threadIdx.x == 0) atomicExch(ready, 1u);
            }
        }
        expert = route_ids[rank];
    } else {
        expert = ids[pair];
    }
    PHASE(0, 2);
    GateUpTile<BITS, UNITS, TILED> tile(early ? pointers + (size_t)expert * GATE_UP_POINTERS
                                       : table + (size_t)expert * ROUTED_ENTRY,
                                 blockIdx.x * RMMA_ROWS, rows, cols);
    // The words' loads go out before x is staged, to overlap their latency.
    tile.load(tile.u0);
    if (!early) stage_x();
    __syncthreads();
    PHASE(0, 3);
    tile.finish(xs, xsum, red, h + (size_t)pair * rows);
}

// Down projections of token blockIdx.y's top_k pairs, RMMA_ROWS rows from
// blockIdx.x·RMMA_ROWS, weighted by the route and added: out[token] = Σ_k weights[pair]
// · down_k(h[pair]) (moe_combine folded in). With `logits` not null (the gate and up
// kernel routed), the token's first block also replaces its row of `experts` logits by
// their probabilities.
//
// With `ready` (one row whose gate/up kernel routed it and raises ready[0] once the route
// is written), a block loads its first words before its launch wait: as soon as the
// route is there, while gate/up's last blocks still run. ready[1] counts the blocks that
// saw the flag; the last lowers both, for the next launch. The caller does PDL_LAUNCH;
// this waits.
template <int BITS, int UNITS, bool TILED = false>
__device__ void routed_mma_down(const unsigned long long* table, const int* ids,
                                const float* weights, int top_k, const float* h, float* out,
                                int rows, int cols, int in_dim, float* logits, int experts,
                                unsigned* ready) {
    extern __shared__ __align__(16) unsigned smem[];
    int groups = cols / 64, units = top_k * groups;
    unsigned* xs = smem;
    float* xsum = reinterpret_cast<float*>(smem + (size_t)units * RMMA_UNIT);
    float* red = xsum + units;
    int token = blockIdx.y;
    if (ready) {
        if (threadIdx.x == 0) {
            wait_count(ready, 1);
            __threadfence();
            if (atomicAdd(&ready[1], 1u) == gridDim.x * gridDim.y - 1) {
                ready[0] = 0;
                ready[1] = 0;
            }
        }
        __syncthreads();
    } else {
        PDL_WAIT();
    }
    DownTile<BITS, UNITS, TILED> tile(table, ids + token * top_k, weights + token * top_k, top_k,
                               blockIdx.x * RMMA_ROWS, rows, cols);
    tile.load(tile.u0);
    // h, and the logits that gate/up blocks may still be routing by, only after the wait.
    if (ready) PDL_WAIT();
    PHASE(1, 1);
    // While its words are on their way: the probabilities, by every thread of the block.
    if (logits && blockIdx.x == 0) {
        __shared__ __align__(16) float cand[ROUTE_SHARED_MAX];
        __shared__ float scratch[32];
        float* row = logits + (size_t)token * experts;
        route_probabilities(row, row, nullptr, experts, cand, scratch);
    }
    stage_units<BITS>(xs, xsum, h, [&](int k) { return token * top_k + k; }, units, groups,
                      in_dim, threadIdx.x, blockDim.x);
    __syncthreads();
    PHASE(1, 2);
    tile.finish(xs, xsum, red, out + (size_t)token * rows);
}

// Units a warp loads at once: gate and up take two matrices a unit; a down warp of a
// top-8 step of 768-wide experts takes 6. Gate/up blocks an SM is its launch bound. All
// three are tunable (DYNMOE_CUDA=define=...; RMMA_GATE_UP_UNITS for rows and tiles alike):
// nothing on the host depends on them. Gate/up from rows at one unit a round measured
// fastest on the H200 (1 303 tok/s against 1 261 at four, in the 12-layer Qwen3-30B-A3B
// shape; 1 612 against 1 586 at two, a later build), from tiles at two: a tiled unit is
// one 16- or 8-byte load a lane where rows take two, so two units are no more loads in
// flight than one of rows (4 bits: 1 665 tok/s against 1 653 at one and 1 624 at four;
// 2 bits: 1 640, 1 571, 1 625).
#ifdef RMMA_GATE_UP_UNITS
#define RMMA_GATE_UP_UNITS_OF(TILED) RMMA_GATE_UP_UNITS
#else
#define RMMA_GATE_UP_UNITS_OF(TILED) ((TILED) ? 2 : 1)
#endif
#ifndef RMMA_DOWN_UNITS
#define RMMA_DOWN_UNITS 6
#endif
#ifndef RMMA_GATE_UP_BLOCKS
#define RMMA_GATE_UP_BLOCKS 3
#endif
// NAME is the kernels' suffix: q3 for experts in rows (3 bits have no tile layout), and
// tiled_q4, tiled_q2 for experts in unit tiles (load_unit_tiled; the table's words and
// scales point at the tiles), which is how 4- and 2-bit experts are held wherever these
// kernels run.
#define ROUTED_MMA(B, NAME, TILED)                                                            \
    extern "C" __global__ void __launch_bounds__(RMMA_WARPS * WARP, RMMA_GATE_UP_BLOCKS)       \
        routed_mma_gate_up_##NAME(const unsigned long long* table, const float* logits,        \
                                  const unsigned char* keep, int experts, int renormalize,     \
                                  int* ids, float* weights, int top_k, const float* x,         \
                                  float* h, int rows, int cols, int in_dim, int early,         \
                                  const float* delta, const float* norm_w, float eps,          \
                                  unsigned* ready) {                                           \
        PDL_LAUNCH();                                                                          \
        routed_mma_gate_up<B, RMMA_GATE_UP_UNITS_OF(TILED), TILED>(                           \
            table, logits, keep, experts, renormalize, ids, weights, top_k, x, h, rows, cols,  \
            in_dim, early != 0, delta, norm_w, eps, ready);                                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(RMMA_DOWN_WARPS * WARP)                       \
        routed_mma_down_##NAME(const unsigned long long* table, const int* ids,                \
                               const float* weights, int top_k, const float* h, float* out,    \
                               int rows, int cols, int in_dim, float* logits, int experts,     \
                               unsigned* ready) {                                              \
        PHASE(1, 0);                                                                           \
        PDL_LAUNCH();                                                                          \
        routed_mma_down<B, RMMA_DOWN_UNITS, TILED>(table, ids, weights, top_k, h, out, rows,   \
                                                   cols, in_dim, logits, experts, ready);      \
    }

ROUTED_MMA(3, q3, false)
ROUTED_MMA(4, tiled_q4, true)
ROUTED_MMA(2, tiled_q2, true)

// A 4- or 2-bit affine matrix from its rows (`words`, `scales`, `biases` as stored) into
// unit tiles (`tile_words`, `sb`: load_tile_words' layout, which the host's unit_tiles
// also makes). A thread per lane of each unit moves the lane's words of rows g and g + 8
// and, on lanes below RMMA_ROWS, that row's scale and bias; rows past the matrix are
// zeros. Resident slots hold their experts so: a record is copied in rows to a staging
// buffer and taken into its slot by this kernel, both on the copy stream.
extern "C" __global__ void affine_tiles_from_rows(const unsigned* words,
                                                  const unsigned short* scales,
                                                  const unsigned short* biases, int rows,
                                                  int cols, int bits, unsigned* tile_words,
                                                  unsigned short* sb) {
    const int groups = cols / 64, lane_words = bits == 4 ? 2 : 1;
    const int unit_row_words = 4 * lane_words, row_words = groups * unit_row_words;
    const size_t units = (size_t)((rows + RMMA_ROWS - 1) / RMMA_ROWS) * groups;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < units * WARP;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t unit = i / WARP;
        int lane = (int)(i % WARP), t = (int)(unit / groups), gi = (int)(unit % groups);
        int g = lane >> 2, q = lane & 3;
        for (int half = 0; half < 2; half++) {
            int r = t * RMMA_ROWS + g + 8 * half;
            const unsigned* src = words + (size_t)r * row_words + gi * unit_row_words + q * lane_words;
            for (int j = 0; j < lane_words; j++)
                tile_words[(i * 2 + half) * lane_words + j] = r < rows ? src[j] : 0u;
        }
        if (lane < RMMA_ROWS) {
            int r = t * RMMA_ROWS + lane;
            size_t from = (size_t)r * groups + gi, to = (unit * RMMA_ROWS + lane) * 2;
            sb[to] = r < rows ? scales[from] : (unsigned short)0;
            sb[to + 1] = r < rows ? biases[from] : (unsigned short)0;
        }
    }
}

// ---- Dense affine matrices of one input row on tensor cores ----
//
// The LM head and attention projections of a decode step coded as affine q4/q3/q2
// (`--dense-codec`, `--head-codec`): the routed kernels' units and fragments, with no
// route. Up to three matrices of one input (a layer's q, k and v) share a launch. A job
// is a tile of RMMA_ROWS rows of one matrix; the `parts` warps of a job split its units
// (parts divides RMMA_WARPS) and add their sums in a fixed order, so a block takes
// RMMA_WARPS / parts jobs a round. Blocks stage x once and loop over rounds, so a grid
// sized for the device streams a 151936-row head without staging x 9 496 times. Every
// warp's first units go out before PDL_WAIT: no kernel writes weights. Units a warp
// loads at once and blocks an SM (the launch bound, which the host's grid assumes) are
// tunable (DYNMOE_CUDA=define=...). Four units a round measured fastest on the H200 (decode
// 1 246 tok/s against 1 208 at eight and 1 231 at two, 12-layer Qwen3-30B-A3B shape, q4
// dense layers and head, on a build that spilled at each), and here ptxas spills nothing
// at four (24 bytes at eight).
#ifndef DMMA_UNITS
#define DMMA_UNITS 4
#endif
#ifndef DMMA_BLOCKS
#define DMMA_BLOCKS 3
#endif
struct DenseMat {
    const unsigned* words;
    const unsigned short* scales;
    const unsigned short* biases;
    float* out;
    int rows;
};

// The input of a dense product read as RMSNorm(x + delta)·w, x + delta written to `sum`
// (null: not written); with `w` null, x as it is.
struct NormArgs {
    const float* delta;
    const float* w;
    float eps;
    float* sum;
};

template <int BITS, bool NORM, bool TILED = false>
__device__ void dense_mma(const DenseMat (&m)[3], int mats, const float* x, int cols,
                          int in_dim, int parts, const NormArgs& norm) {
    extern __shared__ __align__(16) unsigned smem[];
    int groups = cols / 64;
    unsigned* xs = smem;
    float* xsum = reinterpret_cast<float*>(smem + (size_t)groups * RMMA_UNIT);
    float* red = xsum + groups;  // [RMMA_WARPS][RMMA_ROWS]
    // With NORM: each unit's xscale (after the routed kernels' [RMMA_WARPS][2][RMMA_ROWS]
    // that routed_mma_shared counts) and the row through the norm (16-byte aligned).
    float* xscale = red + RMMA_WARPS * 2 * RMMA_ROWS;
    float* normed = align16(xscale + groups);
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, q = lane & 3;
    int per_round = RMMA_WARPS / parts, slot = warp / parts, part = warp % parts;
    int tiles[3];
#pragma unroll
    for (int i = 0; i < 3; i++) tiles[i] = i < mats ? (m[i].rows + RMMA_ROWS - 1) / RMMA_ROWS : 0;
    int jobs = tiles[0] + tiles[1] + tiles[2];
    int per = (groups + parts - 1) / parts;
    int u0 = min(groups, part * per), u1 = min(groups, u0 + per);
    size_t stride = row_words<BITS>(cols);
    // The job's matrix (picked by selects: an indexed array of them would sit in local
    // memory), first row and rows g, g + 8 (a row past the matrix reads row 0 and is
    // never stored).
    DenseMat cur = m[0];
    int r0 = 0, o0 = 0, o1 = 0;
    auto place = [&](int job) {
        int mi = job < tiles[0] ? 0 : (job < tiles[0] + tiles[1] ? 1 : 2);
        job -= mi == 0 ? 0 : (mi == 1 ? tiles[0] : tiles[0] + tiles[1]);
        cur = mi == 0 ? m[0] : (mi == 1 ? m[1] : m[2]);
        r0 = job * RMMA_ROWS;
        o0 = r0 + g < cur.rows ? r0 + g : 0;
        o1 = r0 + g + 8 < cur.rows ? r0 + g + 8 : 0;
    };
    unsigned w[DMMA_UNITS][2][2];
    unsigned short sb[DMMA_UNITS];
    auto load = [&](int base) {
#pragma unroll
        for (int j = 0; j < DMMA_UNITS; j++) {
            if (base + j >= u1) continue;
            if constexpr (TILED)
                load_unit_tiled<BITS>(cur.words, cur.scales,
                                      (size_t)(r0 / RMMA_ROWS) * groups + base + j, lane, g, q,
                                      w[j], sb[j]);
            else
                load_unit<BITS>(cur.words + o0 * stride, cur.words + o1 * stride, cur.scales,
                                cur.biases, (size_t)o0 * groups, (size_t)o1 * groups, base + j,
                                q, w[j], sb[j]);
        }
    };
    float acc[2];
    auto compute = [&](int base) {
#pragma unroll
        for (int j = 0; j < DMMA_UNITS; j++) {
            if (base + j >= u1) break;
            unsigned bx[8];
            unit_fragments(xs, base + j, g, q, bx);
            float2 d = unit_dot<BITS>(w[j], sb[j], bx, xsum[base + j], q, lane,
                                      NORM ? xscale[base + j] : 1.0f);
            acc[0] += d.x;
            acc[1] += d.y;
        }
    };
    int first = blockIdx.x * per_round + slot, step = gridDim.x * per_round;
    bool live = first < jobs;
    if (live) {
        place(first);
        load(u0);
    }
    PDL_WAIT();
    // The norm's 1/rms, which the outputs take (1 without NORM).
    float inv = 1.0f;
    if (NORM) {
        float ss = stage_norm_row(x, norm.delta, norm.w, normed, in_dim, norm.sum,
                                  row_slice(in_dim, 4));
        // `red` is free until the rounds, and block_sum's 32 floats fit in it; its
        // barriers also make `normed` whole before it is staged.
        inv = 1.0f / sqrtf(block_sum(ss, red) / (float)in_dim + norm.eps);
        stage_units<BITS>(xs, xsum, normed, [](int) { return 0; }, groups, groups, in_dim,
                          threadIdx.x, blockDim.x, InputAsIs{}, xscale);
    } else {
        stage_units<BITS>(xs, xsum, x, [](int) { return 0; }, groups, groups, in_dim,
                          threadIdx.x, blockDim.x);
    }
    __syncthreads();
    // Every warp runs every round (the block adds parts through shared memory); a warp
    // whose job is past the last only takes part in the barriers.
    for (int round = blockIdx.x * per_round; round < jobs; round += step) {
        int job = round + slot;
        live = job < jobs;
        acc[0] = acc[1] = 0.0f;
        if (live) {
            if (job != first) {
                place(job);
                load(u0);
            }
            compute(u0);
            for (int base = u0 + DMMA_UNITS; base < u1; base += DMMA_UNITS) {
                load(base);
                compute(base);
            }
        }
        if (parts == 1) {
            if (live && q == 0) {
                if (r0 + g < cur.rows) cur.out[r0 + g] = acc[0] * inv;
                if (r0 + g + 8 < cur.rows) cur.out[r0 + g + 8] = acc[1] * inv;
            }
            continue;
        }
        if (q == 0) {
            red[warp * RMMA_ROWS + g] = acc[0];
            red[warp * RMMA_ROWS + g + 8] = acc[1];
        }
        __syncthreads();
        // The first part's warp adds the job's parts, in order.
        if (live && part == 0 && lane < RMMA_ROWS && r0 + lane < cur.rows) {
            float v = 0.0f;
            for (int k = 0; k < parts; k++) v += red[(warp + k) * RMMA_ROWS + lane];
            cur.out[r0 + lane] = v * inv;
        }
        __syncthreads();
    }
}

// The kernels: x as it is, and (`_norm_`) through the residual add and norm. Two entries,
// not a branch: a branch on the norm in one kernel made ptxas spill the loaded words of
// the plain one (420 bytes at q4 against 24).
#define DENSE_MMA_ARGS                                                                        \
    const unsigned *w0, const unsigned short *s0, const unsigned short *b0, float *out0,      \
        int rows0, const unsigned *w1, const unsigned short *s1, const unsigned short *b1,    \
        float *out1, int rows1, const unsigned *w2, const unsigned short *s2,                 \
        const unsigned short *b2, float *out2, int rows2, int mats, const float *x, int cols, \
        int in_dim, int parts
#define DENSE_MATS                                                                            \
    {{w0, s0, b0, out0, rows0}, {w1, s1, b1, out1, rows1}, { w2, s2, b2, out2, rows2 }}
#define DENSE_MMA(B)                                                                          \
    extern "C" __global__ void __launch_bounds__(RMMA_WARPS * WARP, DMMA_BLOCKS)              \
        dense_mma_q##B(DENSE_MMA_ARGS) {                                                      \
        PDL_LAUNCH();                                                                         \
        const DenseMat m[3] = DENSE_MATS;                                                     \
        dense_mma<B, false>(m, mats, x, cols, in_dim, parts, {});                             \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(RMMA_WARPS * WARP, DMMA_BLOCKS)              \
        dense_mma_norm_q##B(DENSE_MMA_ARGS, const float* delta, const float* norm_w, float eps, \
                            float* sum) {                                                     \
        PDL_LAUNCH();                                                                         \
        const DenseMat m[3] = DENSE_MATS;                                                     \
        dense_mma<B, true>(m, mats, x, cols, in_dim, parts, {delta, norm_w, eps, sum});       \
    }

// The same on matrices in unit tiles (load_unit_tiled; `s*` the tiles' scales and biases,
// `b*` unused), at 4 and 2 bits.
#define DENSE_MMA_TILED(B)                                                                    \
    extern "C" __global__ void __launch_bounds__(RMMA_WARPS * WARP, DMMA_BLOCKS)              \
        dense_mma_tiled_q##B(DENSE_MMA_ARGS) {                                                \
        PDL_LAUNCH();                                                                         \
        const DenseMat m[3] = DENSE_MATS;                                                     \
        dense_mma<B, false, true>(m, mats, x, cols, in_dim, parts, {});                       \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(RMMA_WARPS * WARP, DMMA_BLOCKS)              \
        dense_mma_norm_tiled_q##B(DENSE_MMA_ARGS, const float* delta, const float* norm_w,    \
                                  float eps, float* sum) {                                    \
        PDL_LAUNCH();                                                                         \
        const DenseMat m[3] = DENSE_MATS;                                                     \
        dense_mma<B, true, true>(m, mats, x, cols, in_dim, parts, {delta, norm_w, eps, sum}); \
    }

DENSE_MMA(4)
DENSE_MMA(3)
DENSE_MMA(2)
DENSE_MMA_TILED(4)
DENSE_MMA_TILED(2)

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

// ---- Decode steps whose per-call values live in device memory ----

// dst row *pos = src row 0.
extern "C" __global__ void write_row_at(const float* src, float* dst, const unsigned* pos, int width) {
    PDL_ENTRY();
    float* d = dst + (size_t)*pos * width;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x)
        d[i] = src[i];
}

// The attention preamble of a one-row decode step in one launch: block b < heads takes
// query head b, the next kv_heads blocks key head b − heads, the last kv_heads blocks
// value head b − heads − kv_heads. A q or k head is normalised (per-head RMSNorm with
// `qn`/`kn`, when non-null) and rotated (RoPE at position *pos, as `rope`), written back
// to q or k; a k or v head is also copied to row *pos of its cache. A thread owns the
// pairs (i, i + half) it rotates, PRE_PAIRS at most, so head_dim ≤ 2·PRE_PAIRS·blockDim.
// With `late`, the kernel lets the next one start only once its own wait is over, so the
// kernel after it (attention_group_* with `early`) knows every kernel before this one has
// finished, and may load the caches' earlier rows before its own wait.
#define PRE_PAIRS 4
extern "C" __global__ void attn_preamble_at(float* q, float* k, const float* v, const float* qn,
                                            const float* kn, float eps, const unsigned* pos,
                                            const float* inv_freq, float* k_cache,
                                            float* v_cache, int heads, int kv_heads,
                                            int head_dim, int late) {
    if (late) {
        PDL_WAIT();
        PDL_LAUNCH();
    } else {
        PDL_ENTRY();
    }
    __shared__ float scratch[32];
    int b = blockIdx.x;
    size_t kvw = (size_t)kv_heads * head_dim;
    unsigned p = *pos;
    if (b >= heads + kv_heads) {
        int h = b - heads - kv_heads;
        const float* src = v + (size_t)h * head_dim;
        float* dst = v_cache + (size_t)p * kvw + (size_t)h * head_dim;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) dst[d] = src[d];
        return;
    }
    bool is_q = b < heads;
    int h = is_q ? b : b - heads;
    float* x = (is_q ? q : k) + (size_t)h * head_dim;
    const float* nw = is_q ? qn : kn;
    int half = head_dim / 2;
    float a[PRE_PAIRS], c[PRE_PAIRS];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PRE_PAIRS; j++) {
        int i = threadIdx.x + j * blockDim.x;
        a[j] = i < half ? x[i] : 0.0f;
        c[j] = i < half ? x[i + half] : 0.0f;
        ss += a[j] * a[j] + c[j] * c[j];
    }
    if (nw) {
        // Every thread of the block reaches this barrier: the branch is on a kernel argument.
        ss = block_sum(ss, scratch);
        float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
#pragma unroll
        for (int j = 0; j < PRE_PAIRS; j++) {
            int i = threadIdx.x + j * blockDim.x;
            if (i < half) {
                a[j] = nw[i] * (a[j] * inv);
                c[j] = nw[i + half] * (c[j] * inv);
            }
        }
    }
    float fp = (float)p;
    float* cache = is_q ? nullptr : k_cache + (size_t)p * kvw + (size_t)h * head_dim;
#pragma unroll
    for (int j = 0; j < PRE_PAIRS; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (i < half) {
            float sn, cs;
            sincosf(fp * inv_freq[i], &sn, &cs);
            float lo = a[j] * cs - c[j] * sn, hi = c[j] * cs + a[j] * sn;
            x[i] = lo;
            x[i + half] = hi;
            if (cache) {
                cache[i] = lo;
                cache[i + half] = hi;
            }
        }
    }
}

// The index of each row's largest value (the lowest on ties; NaN never wins; 0 when
// every value is NaN), its bits stored in out[r]. Grid (splits, rows): block s of row r
// takes `chunk` values from s·chunk and writes its best to part (values) and part_i
// (indices); the last block of a row to finish (counted in `count[r]`, which it resets
// to zero for the next launch) merges the row's partials. One launch, no second pass
// over the row, and no host work: it may run inside a recorded step.
#define ARGMAX_THREADS 256
extern "C" __global__ void argmax_rows(const float* x, unsigned* out, int dim, int chunk,
                                       unsigned* count, float* part, int* part_i) {
    PDL_ENTRY();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int last;
    int s = blockIdx.x, r = blockIdx.y, splits = gridDim.x;
    const float* row = x + (size_t)r * dim;
    int lo = s * chunk, hi = min(dim, lo + chunk);
    float v = NEG_INF;
    int i = 0x7fffffff;
    // Ascending indices per thread, so a strict > keeps the lower index of a tie; four
    // loads issued before their compares.
    for (int d0 = lo + threadIdx.x; d0 < hi; d0 += 4 * ARGMAX_THREADS) {
        float a[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int d = d0 + u * ARGMAX_THREADS;
            a[u] = d < hi ? row[d] : NEG_INF;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int d = d0 + u * ARGMAX_THREADS;
            if (d < hi && (a[u] > v || (a[u] == v && d < i))) { v = a[u]; i = d; }
        }
    }
    block_argmax(v, i, sv, si);
    size_t at = (size_t)r * splits;
    if (threadIdx.x == 0) {
        part[at + s] = v;
        part_i[at + s] = i;
        // The partial is visible to every block before the count says it is there.
        __threadfence();
        last = atomicAdd(&count[r], 1u) == (unsigned)(splits - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    v = NEG_INF;
    i = 0x7fffffff;
    for (int k = threadIdx.x; k < splits; k += blockDim.x) {
        // Past L1, which may hold nothing of another block's writes but must not be trusted.
        float pv = __ldcg(part + at + k);
        int pi = __ldcg(part_i + at + k);
        if (pv > v || (pv == v && pi < i)) { v = pv; i = pi; }
    }
    block_argmax(v, i, sv, si);
    if (threadIdx.x == 0) {
        out[r] = (unsigned)(i == 0x7fffffff ? 0 : i);
        count[r] = 0;
    }
}

// The last op of a decode step: the token argmax_rows chose (its bits at *chosen) becomes
// the step's input at the next position, so the recorded step can be replayed again with
// no upload in between, each replay reading what the one before left. One thread.
extern "C" __global__ void advance_step(unsigned* step, const unsigned* chosen) {
    PDL_ENTRY();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        step[0] = *chosen;
        step[1] += 1u;
    }
}

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

// ---- Decode attention split over the keys ----
//
// One query row has only `heads` (query head) blocks of work; each would walk the whole
// context alone. Here the context is cut into chunks of `chunk` keys, a block per (head,
// chunk) writes its partial softmax: the unnormalised output to `acc` ([heads, splits,
// head_dim]) and (max, sum) to `ml` ([heads, splits, 2]); attention_combine merges them.
// Chunks past the position (or before a window) write (−inf, 0) and no output, so the
// grid can be fixed by the cache's capacity and the position read from `pos_at` (when
// non-null) in a replayed step. attention_group below does the same work reading each
// K/V row once per GQA group; this kernel remains for head widths it does not take.
#define SPLIT_CHUNK_MAX 1024
extern "C" __global__ void attention_split(const float* q, const float* k, const float* v,
                                           float* acc, float* ml, int pos0, int heads,
                                           int kv_heads, int head_dim, int window,
                                           const unsigned* pos_at, int chunk) {
    PDL_ENTRY();
    __shared__ float scratch[32];
    __shared__ float qs[256];
    __shared__ float sc[SPLIT_CHUNK_MAX];
    int h = blockIdx.x, s = blockIdx.y;
    int p = pos_at ? (int)*pos_at : pos0;
    int lo = window > 0 ? max(0, p + 1 - window) : 0;
    int t0 = max(lo, s * chunk), t1 = min(p + 1, (s + 1) * chunk);
    size_t at = (size_t)h * gridDim.y + s;
    if (t0 >= t1) {
        if (threadIdx.x == 0) {
            ml[2 * at] = NEG_INF;
            ml[2 * at + 1] = 0.0f;
        }
        return;
    }
    int kvh = h / (heads / kv_heads);
    size_t kvw = (size_t)kv_heads * head_dim;
    const float* qrow = q + (size_t)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qrow[d];
    __syncthreads();
    float scale = 1.0f / sqrtf((float)head_dim);
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    int tn = t1 - t0;
    for (int j = warp; j < tn; j += warps) {
        const float* kr = k + (size_t)(t0 + j) * kvw + (size_t)kvh * head_dim;
        float a = 0.0f;
        for (int d = lane; d < head_dim; d += WARP) a += qs[d] * kr[d];
        a = warp_sum(a);
        if (lane == 0) sc[j] = a * scale;
    }
    __syncthreads();
    float m;
    float l = block_exp_sum(sc, sc, tn, m, scratch);
    const float* vb = v + (size_t)t0 * kvw + (size_t)kvh * head_dim;
    int d0 = threadIdx.x, d1 = threadIdx.x + blockDim.x;
    float acc0 = 0.0f, acc1 = 0.0f;
    for (int j = 0; j < tn; j++) {
        float w = sc[j];
        const float* vr = vb + (size_t)j * kvw;
        if (d0 < head_dim) acc0 += w * vr[d0];
        if (d1 < head_dim) acc1 += w * vr[d1];
    }
    if (threadIdx.x == 0) {
        ml[2 * at] = m;
        ml[2 * at + 1] = l;
    }
    float* o = acc + at * head_dim;
    if (d0 < head_dim) o[d0] = acc0;
    if (d1 < head_dim) o[d1] = acc1;
}

// ---- Decode attention, a block per (KV head, chunk of keys) ----
//
// attention_split reads every K and V row once per query head: 8 times over at a GQA
// group of 8, and each score is a warp-wide reduction. Here a block takes up to
// ATT_GROUP query heads of one KV head (a group of more is cut into tiles of ATT_GROUP,
// a block each) and a chunk of keys, loads each K row once and scores it against all of
// its heads, then loads each V row once and adds it into all of their outputs.
//
// Scores: ATT_LANES = ATT_GROUP lanes per key, each holding NV float4 of the row (head
// widths up to 32·NV); a lane's 8 partial dots (one per head) are summed over the 8 lanes
// by three halving exchanges (4 + 2 + 1 shuffles, not 8 × 3), which leave lane i of the 8
// with head i's score. Heads past the block's are zero in shared memory and never
// written. Each lane loads 8 float4 of K (8/NV keys) before using any, and the first V
// rows are loaded before the scores are computed, so their latency overlaps the scores.
// V: a thread per (float4 of the head, key residue mod 128/(head_dim/4)), each with the
// block's heads' outputs for its 4 dims in registers; the residues are summed through
// shared memory in a fixed order. 128 threads, whole warps (the shuffles need them).
#define ATT_GROUP 8
#define ATT_LANES 8
#define ATT_THREADS 128
#define ATT_CHUNK_MAX 256
#define ATT_VB 8

// Each of 8 values summed over the 8 lanes of an aligned group of lanes; lane `sub` of
// the group gets the sum of value `sub`.
__device__ __forceinline__ float group8_sums(const float (&d)[8], int sub) {
    float u[4], w[2];
    bool hi = sub & 4;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float keep = hi ? d[i + 4] : d[i], give = hi ? d[i] : d[i + 4];
        u[i] = keep + __shfl_xor_sync(0xffffffffu, give, 4);
    }
    hi = sub & 2;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        float keep = hi ? u[i + 2] : u[i], give = hi ? u[i] : u[i + 2];
        w[i] = keep + __shfl_xor_sync(0xffffffffu, give, 2);
    }
    hi = sub & 1;
    float keep = hi ? w[1] : w[0], give = hi ? w[0] : w[1];
    return keep + __shfl_xor_sync(0xffffffffu, give, 1);
}

__device__ __forceinline__ void fma4(float4& a, float w, float4 x) {
    a.x += w * x.x;
    a.y += w * x.y;
    a.z += w * x.z;
    a.w += w * x.w;
}

// With `early` (the kernel before is attn_preamble_at with `late`, so every kernel before
// that one has finished: the position and the caches' rows before it are final), a block
// reads the position and issues its first keys' and values' loads before its own wait,
// which then overlaps them with the preamble. Row p itself, which the preamble writes, is
// read after the wait. The caller does PDL_LAUNCH; this waits.
template <int NV>
__device__ void attention_group(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, float* __restrict__ acc_out,
                                float* __restrict__ ml, int pos0, int heads, int kv_heads,
                                int head_dim, int window, const unsigned* pos_at, int chunk,
                                bool early) {
    static_assert(ATT_LANES == ATT_GROUP, "lane i of a key's lanes ends with head i's score");
    constexpr int KB = 8 / NV;  // keys a lane group loads at once
    constexpr int STEP = (ATT_THREADS / ATT_LANES) * KB;
    __shared__ float4 qs[ATT_GROUP][NV * ATT_LANES];
    __shared__ float sc[ATT_GROUP][ATT_CHUNK_MAX];
    __shared__ float4 red[ATT_GROUP][ATT_THREADS];
    __shared__ float stat[ATT_GROUP][2];
    int group = heads / kv_heads, tiles = (group + ATT_GROUP - 1) / ATT_GROUP;
    int kvh = blockIdx.x / tiles, tile = blockIdx.x % tiles;
    int h0 = kvh * group + tile * ATT_GROUP, gt = min(ATT_GROUP, group - tile * ATT_GROUP);
    int s = blockIdx.y, splits = gridDim.y, tid = threadIdx.x;
    if (!early) PDL_WAIT();
    int p = pos_at ? (int)*pos_at : pos0;
    int lo = window > 0 ? max(0, p + 1 - window) : 0;
    int t0 = max(lo, s * chunk), t1 = min(p + 1, (s + 1) * chunk);
    if (t0 >= t1) {
        if (early) PDL_WAIT();
        if (tid < gt) {
            size_t at = (size_t)(h0 + tid) * splits + s;
            ml[2 * at] = NEG_INF;
            ml[2 * at + 1] = 0.0f;
        }
        return;
    }
    int tn = t1 - t0, f4 = head_dim / 4;
    size_t row4 = (size_t)kv_heads * f4;
    const float4* k4 = reinterpret_cast<const float4*>(k) + (size_t)t0 * row4 + (size_t)kvh * f4;
    const float4* v4 = reinterpret_cast<const float4*>(v) + (size_t)t0 * row4 + (size_t)kvh * f4;
    const float4* q4 = reinterpret_cast<const float4*>(q) + (size_t)h0 * f4;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // The chunk's key at position p when the kernel before writes it (early): read only
    // after the wait (-1: none).
    int jl = early && p < t1 ? p - t0 : -1;
    // V pass layout, its first rows requested now; the score pass's first keys too.
    int kg_n = ATT_THREADS / f4, f = tid % f4, kg = tid / f4;
    bool v_lane = kg < kg_n;
    int grp = tid / ATT_LANES, sub = tid % ATT_LANES;
    auto v_row = [&](int j) {
        return v_lane && j < tn ? v4[(size_t)j * row4 + f] : zero;
    };
    auto k_part = [&](int j, int i) {
        int c = sub + i * ATT_LANES;
        return j < tn && c < f4 ? k4[(size_t)j * row4 + c] : zero;
    };
    float4 vb[ATT_VB], kr[KB][NV];
#pragma unroll
    for (int b = 0; b < ATT_VB; b++) {
        int j = kg + b * kg_n;
        vb[b] = j != jl ? v_row(j) : zero;
    }
#pragma unroll
    for (int b = 0; b < KB; b++) {
        int j = grp + b * (ATT_THREADS / ATT_LANES);
#pragma unroll
        for (int i = 0; i < NV; i++) kr[b][i] = j != jl ? k_part(j, i) : zero;
    }
    if (early) {
        PDL_WAIT();
        if (jl >= 0) {
#pragma unroll
            for (int b = 0; b < ATT_VB; b++)
                if (kg + b * kg_n == jl) vb[b] = v_row(jl);
#pragma unroll
            for (int b = 0; b < KB; b++)
                if (grp + b * (ATT_THREADS / ATT_LANES) == jl)
#pragma unroll
                    for (int i = 0; i < NV; i++) kr[b][i] = k_part(jl, i);
        }
    }
    for (int i = tid; i < ATT_GROUP * NV * ATT_LANES; i += ATT_THREADS) {
        int g = i / (NV * ATT_LANES), c = i % (NV * ATT_LANES);
        qs[g][c] = g < gt && c < f4 ? q4[(size_t)g * f4 + c] : zero;
    }
    __syncthreads();

    float scale = 1.0f / sqrtf((float)head_dim);
    for (int j0 = 0; j0 < tn; j0 += STEP) {
        if (j0 > 0) {
#pragma unroll
            for (int b = 0; b < KB; b++) {
                int j = j0 + grp + b * (ATT_THREADS / ATT_LANES);
#pragma unroll
                for (int i = 0; i < NV; i++) kr[b][i] = k_part(j, i);
            }
        }
#pragma unroll
        for (int b = 0; b < KB; b++) {
            float d[ATT_GROUP];
#pragma unroll
            for (int g = 0; g < ATT_GROUP; g++) {
                float a = 0.0f;
#pragma unroll
                for (int i = 0; i < NV; i++) {
                    float4 x = qs[g][sub + i * ATT_LANES], y = kr[b][i];
                    a += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
                }
                d[g] = a;
            }
            float score = group8_sums(d, sub);
            int j = j0 + grp + b * (ATT_THREADS / ATT_LANES);
            if (j < tn && sub < gt) sc[sub][j] = score * scale;
        }
    }
    __syncthreads();

    // Softmax over the chunk, a warp per head.
    int lane = tid % WARP;
    for (int g = tid / WARP; g < gt; g += ATT_THREADS / WARP) {
        float m = NEG_INF;
        for (int j = lane; j < tn; j += WARP) m = fmaxf(m, sc[g][j]);
        m = warp_max(m);
        float l = 0.0f;
        for (int j = lane; j < tn; j += WARP) {
            float e = expf(sc[g][j] - m);
            sc[g][j] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            stat[g][0] = m;
            stat[g][1] = l;
        }
    }
    __syncthreads();

    float4 acc[ATT_GROUP];
#pragma unroll
    for (int g = 0; g < ATT_GROUP; g++) acc[g] = zero;
    for (int j0 = 0; j0 < tn; j0 += kg_n * ATT_VB) {
        if (j0 > 0) {
#pragma unroll
            for (int b = 0; b < ATT_VB; b++) vb[b] = v_row(j0 + kg + b * kg_n);
        }
#pragma unroll
        for (int b = 0; b < ATT_VB; b++) {
            int j = j0 + kg + b * kg_n;
            if (j < tn) {
#pragma unroll
                for (int g = 0; g < ATT_GROUP; g++)
                    if (g < gt) fma4(acc[g], sc[g][j], vb[b]);
            }
        }
    }
#pragma unroll
    for (int g = 0; g < ATT_GROUP; g++) red[g][tid] = acc[g];
    __syncthreads();
    float4* out4 = reinterpret_cast<float4*>(acc_out);
    for (int i = tid; i < gt * f4; i += ATT_THREADS) {
        int g = i / f4, c = i % f4;
        float4 a = red[g][c];
        for (int r = 1; r < kg_n; r++) {
            float4 b = red[g][r * f4 + c];
            a.x += b.x;
            a.y += b.y;
            a.z += b.z;
            a.w += b.w;
        }
        out4[((size_t)(h0 + g) * splits + s) * f4 + c] = a;
    }
    if (tid < gt) {
        size_t at = (size_t)(h0 + tid) * splits + s;
        ml[2 * at] = stat[tid][0];
        ml[2 * at + 1] = stat[tid][1];
    }
}

// Head widths up to 64, 128 and 256, a multiple of 4 (float4 rows).
#define ATTENTION_GROUP(W, NV)                                                                  \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                  \
        attention_group_##W(const float* q, const float* k, const float* v, float* acc,       \
                            float* ml, int pos0, int heads, int kv_heads, int head_dim,       \
                            int window, const unsigned* pos_at, int chunk, int early) {       \
        PDL_LAUNCH();                                                                          \
        attention_group<NV>(q, k, v, acc, ml, pos0, heads, kv_heads, head_dim, window, pos_at, \
                            chunk, early != 0);                                                \
    }
ATTENTION_GROUP(64, 2)
ATTENTION_GROUP(128, 4)
ATTENTION_GROUP(256, 8)

// One block per head: out = Σ_s acc_s·e^(m_s − M) / Σ_s l_s·e^(m_s − M) over the splits,
// M the largest m_s. A split with no keys has (m, l) = (−inf, 0) and its acc is never
// read (its weight selects zero). The weights go through shared memory a tile of splits
// at a time; a thread per (dim, split residue), the residues summed in a fixed order.
#define COMBINE_THREADS 512
#define COMBINE_TILE 1024
#define COMBINE_EARLY 8
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
    attention_combine(const float* acc, const float* ml, float* out, int splits, int head_dim) {
    PDL_ENTRY();
    __shared__ float scratch[32];
    __shared__ float w[COMBINE_TILE];
    __shared__ float red[COMBINE_THREADS];
    int h = blockIdx.x, tid = threadIdx.x;
    int sg_n = blockDim.x / head_dim, d = tid % head_dim, sg = tid / head_dim;
    const float* ah = acc + (size_t)h * splits * head_dim + d;
    // The thread's first COMBINE_EARLY outputs, loaded before the block's reductions over
    // (max, sum) so that their latency overlaps those rather than following them.
    float early[COMBINE_EARLY];
#pragma unroll
    for (int i = 0; i < COMBINE_EARLY; i++) {
        int s = sg + i * sg_n;
        early[i] = sg < sg_n && s < splits ? ah[(size_t)s * head_dim] : 0.0f;
    }
    const float* mh = ml + (size_t)h * splits * 2;
    float mx = NEG_INF;
    for (int s = tid; s < splits; s += blockDim.x) mx = fmaxf(mx, mh[2 * s]);
    mx = block_max(mx, scratch);
    float l = 0.0f;
    for (int s = tid; s < splits; s += blockDim.x) {
        float m = mh[2 * s];
        if (m != NEG_INF) l += mh[2 * s + 1] * expf(m - mx);
    }
    l = block_sum(l, scratch);
    float a = 0.0f;
    for (int s0 = 0; s0 < splits; s0 += COMBINE_TILE) {
        int sn = min(COMBINE_TILE, splits - s0);
        __syncthreads();  // the previous tile's weights are read
        for (int s = tid; s < sn; s += blockDim.x) {
            float m = mh[2 * (s0 + s)];
            w[s] = m == NEG_INF ? 0.0f : expf(m - mx);
        }
        __syncthreads();
        if (sg < sg_n) {
            int s = sg;
            if (s0 == 0) {
#pragma unroll
                for (int i = 0; i < COMBINE_EARLY; i++, s += sg_n) {
                    if (s < sn) {
                        float ws = w[s];
                        a += ws != 0.0f ? ws * early[i] : 0.0f;
                    }
                }
            }
#pragma unroll 4
            for (; s < sn; s += sg_n) {
                float ws = w[s], x = ah[(size_t)(s0 + s) * head_dim];
                a += ws != 0.0f ? ws * x : 0.0f;
            }
        }
    }
    red[tid] = a;
    __syncthreads();
    if (tid < head_dim) {
        float t = 0.0f;
        for (int r = 0; r < sg_n; r++) t += red[r * head_dim + tid];
        out[(size_t)h * head_dim + tid] = t / l;
    }
}

// ---- Prefill attention, a block per (tiles of query slots, KV head) ----
//
// `attention` gives each (query row, head) a block that walks its keys alone: every K and
// V row is read once per row and head, with a warp-wide sum per score. Here a tile is
// PA_BM query slots of one KV head, slot i being row i / group, head i % group of its GQA
// group (the heads of a row are adjacent slots). K and V come in tiles of PA_BN keys staged
// in shared memory, each used by every row and every head of the tile; a tile spans
// PA_BM / group positions (8 at a group of 8), so the causal diagonal wastes little. Keys
// run from the first any slot may see to the last slot's position; each slot keeps an
// online softmax in f32. A block takes two tiles, the t-th from the end and the t-th from
// the start, so every block has about the same number of keys (causal tiles grow with
// their position) and no wave ends waiting on the longest tile.
//
// Scores: a thread per (2 slots, key residue mod 8), 2 × 4 scores, float4 along the head.
// Q and K rows are padded by a float4, so the 8 keys of one load start 4 banks apart
// (conflict-free); the 8 threads of a slot pair are adjacent lanes, so a slot's max and
// sum take three shuffles. P is written to shared memory as [key][slot].
// Output: a thread per (4 slots, float4 residue mod 16 of the head), 4 × FO float4 in
// registers, rescaled by the slots' factors each tile; per key one float4 of P (4 slots)
// and FO float4 of V.
// K and V tiles are double-buffered: the next tile's asynchronous copies (cp.async, no
// registers) are issued before the current one's scores, so their latency hides behind
// its arithmetic.
#define PA_BM 64
#define PA_BN 32
#define PA_THREADS 256

// Queues the copies of keys (and values) first .. first + PA_BN - 1 of one KV head into
// a tile of shared memory (K rows `qw` float4s apart, V rows `f4`); keys past `p_last`
// are zero-filled, and never read past the cache.
__device__ __forceinline__ void copy_kv_tile(float4* kd, float4* vd, const float4* k4,
                                             const float4* v4, int first, int p_last, int f4,
                                             int qw, size_t row4, int tid) {
    for (int i = tid; i < PA_BN * f4; i += PA_THREADS) {
        int j = i / f4, c = i % f4, kp = min(first + j, p_last);
        size_t at = (size_t)kp * row4 + c;
        copy16_async(kd + j * qw + c, k4 + at, first + j <= p_last);
        copy16_async(vd + j * f4 + c, v4 + at, first + j <= p_last);
    }
    copies_commit();
}

template <int FO>
__device__ void attention_tiled(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, float* __restrict__ out, int rows,
                                int pos0, int heads, int kv_heads, int head_dim, int window) {
    extern __shared__ float4 pa_smem[];
    const int f4 = head_dim / 4, qw = f4 + 1, pw = PA_BM + 4;
    float4* qs = pa_smem;                                      // [PA_BM][qw]
    float4* ks = qs + PA_BM * qw;                              // [2][PA_BN][qw]
    float4* vs = ks + 2 * PA_BN * qw;                          // [2][PA_BN][f4]
    float* ps = reinterpret_cast<float*>(vs + 2 * PA_BN * f4); // [PA_BN][pw]
    float* corr = ps + PA_BN * pw;                             // [PA_BM]
    float* lsum = corr + PA_BM;                                // [PA_BM]
    const int group = heads / kv_heads, tiles = (rows * group + PA_BM - 1) / PA_BM;
    const int pair = blockIdx.x / kv_heads, kvh = blockIdx.x % kv_heads;
    const int h0 = kvh * group, tid = threadIdx.x;
    const size_t row4 = (size_t)kv_heads * f4;
    const float4* q4 = reinterpret_cast<const float4*>(q);
    const float4* k4 = reinterpret_cast<const float4*>(k) + (size_t)kvh * f4;
    const float4* v4 = reinterpret_cast<const float4*>(v) + (size_t)kvh * f4;
    float4* out4 = reinterpret_cast<float4*>(out);
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float scale = 1.0f / sqrtf((float)head_dim);
    const int kx = tid % 8, sy = tid / 8;   // score layout: slots 2sy, 2sy + 1
    const int dx = tid % 16, so = tid / 16; // output layout: slots 4so .. 4so + 3
    bool col[FO];
#pragma unroll
    for (int u = 0; u < FO; u++) col[u] = dx + 16 * u < f4;

    for (int pass = 0; pass < 2; pass++) {
        const int tile = pass == 0 ? tiles - 1 - pair : pair;
        if (pass == 1 && tile == tiles - 1 - pair) break;  // an odd count: the middle alone
        const int slot0 = tile * PA_BM;
        // Every tile has a slot of a real row: the tiles cover rows·group slots.
        const int p_first = pos0 + slot0 / group;
        const int p_last = pos0 + min(rows - 1, (slot0 + PA_BM - 1) / group);
        const int lo_first = window > 0 ? max(0, p_first + 1 - window) : 0;

        // The first K/V tile's copies, then Q (the previous pass read Q and the buffers
        // before its last barrier).
        copy_kv_tile(ks, vs, k4, v4, lo_first, p_last, f4, qw, row4, tid);
        for (int i = tid; i < PA_BM * f4; i += PA_THREADS) {
            int s = i / f4, c = i % f4, at = slot0 + s, r = at / group;
            qs[s * qw + c] = r < rows ? q4[((size_t)r * heads + h0 + at % group) * f4 + c] : zero;
        }
        // A slot past the last row sees no key (position −1).
        int sp[2], slo[2];
        float m[2], l[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int r = (slot0 + 2 * sy + i) / group;
            sp[i] = r < rows ? pos0 + r : -1;
            slo[i] = window > 0 ? max(0, sp[i] + 1 - window) : 0;
            m[i] = NEG_INF;
            l[i] = 0.0f;
        }
        float4 o[4][FO];
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int u = 0; u < FO; u++) o[a][u] = zero;

        for (int kt = lo_first, buf = 0; kt <= p_last; kt += PA_BN, buf ^= 1) {
            const int kn = min(PA_BN, p_last + 1 - kt);
            // This tile's copies have landed (each thread waits for its own, the barrier
            // for everyone's); the previous tile's K, V, P and factors are read, so the
            // other buffer and P may be written.
            copies_wait();
            __syncthreads();
            const int nt = kt + PA_BN;
            if (nt <= p_last) {
                copy_kv_tile(ks + (buf ^ 1) * PA_BN * qw, vs + (buf ^ 1) * PA_BN * f4, k4, v4,
                             nt, p_last, f4, qw, row4, tid);
            }
            const float4* kr = ks + buf * PA_BN * qw + kx * qw;
            const float4* vr = vs + buf * PA_BN * f4 + dx;

            float sc[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) sc[i][j] = 0.0f;
            const float4* qa = qs + 2 * sy * qw;
#pragma unroll 2
            for (int c = 0; c < f4; c++) {
                float4 x0 = qa[c], x1 = qa[qw + c];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    float4 y = kr[8 * j * qw + c];
                    sc[0][j] = fmaf(x0.x, y.x, sc[0][j]);
                    sc[0][j] = fmaf(x0.y, y.y, sc[0][j]);
                    sc[0][j] = fmaf(x0.z, y.z, sc[0][j]);
                    sc[0][j] = fmaf(x0.w, y.w, sc[0][j]);
                    sc[1][j] = fmaf(x1.x, y.x, sc[1][j]);
                    sc[1][j] = fmaf(x1.y, y.y, sc[1][j]);
                    sc[1][j] = fmaf(x1.z, y.z, sc[1][j]);
                    sc[1][j] = fmaf(x1.w, y.w, sc[1][j]);
                }
            }
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float t = NEG_INF;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    int kp = kt + kx + 8 * j;
                    bool seen = kx + 8 * j < kn && kp >= slo[i] && kp <= sp[i];
                    sc[i][j] = seen ? sc[i][j] * scale : NEG_INF;
                    t = fmaxf(t, sc[i][j]);
                }
                for (int x = 1; x < 8; x *= 2) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, x));
                // A slot that has seen no key yet keeps m = −inf: its factor is 0 (it has
                // nothing to rescale) and its weights 0, never exp(−inf − −inf).
                float nm = fmaxf(m[i], t);
                float cr = m[i] == NEG_INF ? 0.0f : expf(m[i] - nm);
                float ts = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    float e = sc[i][j] == NEG_INF ? 0.0f : expf(sc[i][j] - nm);
                    ps[(kx + 8 * j) * pw + 2 * sy + i] = e;
                    ts += e;
                }
                for (int x = 1; x < 8; x *= 2) ts += __shfl_xor_sync(0xffffffffu, ts, x);
                l[i] = l[i] * cr + ts;
                m[i] = nm;
                if (kx == 0) corr[2 * sy + i] = cr;
            }
            __syncthreads();

#pragma unroll
            for (int a = 0; a < 4; a++) {
                float cr = corr[4 * so + a];
#pragma unroll
                for (int u = 0; u < FO; u++) {
                    o[a][u].x *= cr;
                    o[a][u].y *= cr;
                    o[a][u].z *= cr;
                    o[a][u].w *= cr;
                }
            }
#pragma unroll 4
            for (int j = 0; j < kn; j++) {
                float4 w = *reinterpret_cast<const float4*>(ps + j * pw + 4 * so);
#pragma unroll
                for (int u = 0; u < FO; u++) {
                    if (!col[u]) continue;
                    float4 y = vr[j * f4 + 16 * u];
                    fma4(o[0][u], w.x, y);
                    fma4(o[1][u], w.y, y);
                    fma4(o[2][u], w.z, y);
                    fma4(o[3][u], w.w, y);
                }
            }
        }
        if (kx == 0) {
            lsum[2 * sy] = l[0];
            lsum[2 * sy + 1] = l[1];
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < 4; a++) {
            int s = 4 * so + a, at = slot0 + s, r = at / group;
            if (r >= rows) continue;
            // A real row sees at least its own key, so its sum is at least 1.
            float inv = 1.0f / lsum[s];
            float4* dst = out4 + ((size_t)r * heads + h0 + at % group) * f4;
#pragma unroll
            for (int u = 0; u < FO; u++)
                if (col[u]) {
                    float4 x = o[a][u];
                    dst[dx + 16 * u] = make_float4(x.x * inv, x.y * inv, x.z * inv, x.w * inv);
                }
        }
    }
}

// Head widths up to 64, 128 and 256, a multiple of 4 (float4 rows); dynamic shared
// memory as `tiled_shared` on the host computes it.
extern "C" __global__ void __launch_bounds__(PA_THREADS, 2)
    attention_tiled_64(const float* q, const float* k, const float* v, float* out, int rows,
                       int pos0, int heads, int kv_heads, int head_dim, int window) {
    PDL_ENTRY();
    attention_tiled<1>(q, k, v, out, rows, pos0, heads, kv_heads, head_dim, window);
}
extern "C" __global__ void __launch_bounds__(PA_THREADS, 2)
    attention_tiled_128(const float* q, const float* k, const float* v, float* out, int rows,
                        int pos0, int heads, int kv_heads, int head_dim, int window) {
    PDL_ENTRY();
    attention_tiled<2>(q, k, v, out, rows, pos0, heads, kv_heads, head_dim, window);
}
// At 256 the shared memory (203 KB) allows one block an SM: all registers to it.
extern "C" __global__ void __launch_bounds__(PA_THREADS, 1)
    attention_tiled_256(const float* q, const float* k, const float* v, float* out, int rows,
                        int pos0, int heads, int kv_heads, int head_dim, int window) {
    PDL_ENTRY();
    attention_tiled<4>(q, k, v, out, rows, pos0, heads, kv_heads, head_dim, window);
}

// ---- VQ-ladder products straight from the codes (codec::vq) ----
//
// A weight row is cut into blocks of R values; block b of row o is
// w = n[o, b] · D H v / √R (fp16 norm n, seeded signs D, orthonormal Walsh–Hadamard H,
// codewords v), so w · x = n[o, b] / √R · v · (H D x). vq_rotate takes each activation
// block to H D x once; the products then look up each vector's codeword and dot it with
// the rotated activations, scaled per block. Indices are k bits, packed LSB-first per
// row; the device copy of the codes carries 8 bytes of padding so the 3-byte read of the
// last index, and the routed kernels' aligned 8-byte window around it, stay inside it.
// Codebooks are all 2^k codewords of p fp16 values.

__device__ __forceinline__ float half_bits(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// The k-bit index at bit `at` of `codes` (k ≤ 16, so it lies within 3 bytes).
__device__ __forceinline__ unsigned vq_index(const unsigned char* codes, size_t at, int k) {
    const unsigned char* c = codes + (at >> 3);
    unsigned v = (unsigned)c[0] | ((unsigned)c[1] << 8) | ((unsigned)c[2] << 16);
    return (v >> (at & 7)) & ((1u << k) - 1u);
}

// Entry i of the rotation's sign vector for `seed` (rotation::signs): the i-th output
// of SplitMix64, whose state after i + 1 steps is seed + (i + 1)·γ, so each entry is
// computed alone instead of being copied from the host.
__device__ __forceinline__ float vq_sign(unsigned long long seed, int i) {
    unsigned long long z = seed + (unsigned long long)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return ((z ^ (z >> 31)) & 1ull) == 0 ? 1.0f : -1.0f;
}

// One block per (activation block, row): xr[r, b·R ..] = H D x[r, b·R ..], the ragged
// tail block read as zeros. `block` is at most 1024; the transform runs in shared memory
// with the CPU's butterfly order and its 1/√R, so the values match it exactly.
extern "C" __global__ void vq_rotate(const float* x, unsigned long long seed, float* xr, int cols,
                                     int block) {
    PDL_ENTRY();
    __shared__ float buf[1024];
    int b = blockIdx.x, r = blockIdx.y, blocks = gridDim.x;
    const float* src = x + (size_t)r * cols;
    for (int i = threadIdx.x; i < block; i += blockDim.x) {
        int c = b * block + i;
        buf[i] = c < cols ? src[c] * vq_sign(seed, i) : 0.0f;
    }
    __syncthreads();
    for (int h = 1; h < block; h *= 2) {
        for (int t = threadIdx.x; t < block / 2; t += blockDim.x) {
            int i = (t / h) * 2 * h + t % h;
            float p = buf[i], q = buf[i + h];
            buf[i] = p + q;
            buf[i + h] = p - q;
        }
        __syncthreads();
    }
    float scale = 1.0f / sqrtf((float)block);
    float* dst = xr + ((size_t)r * blocks + b) * block;
    for (int i = threadIdx.x; i < block; i += blockDim.x) dst[i] = buf[i] * scale;
}

// The P fp16 values of codeword `idx` of `book` (global or shared memory), widened.
template <int P>
__device__ __forceinline__ void vq_codeword(const unsigned short* book, unsigned idx, float* cw) {
    const unsigned* w = reinterpret_cast<const unsigned*>(book + (size_t)idx * P);
    if constexpr (P == 2) {
        unsigned a = w[0];
        cw[0] = half_bits(a & 0xffffu);
        cw[1] = half_bits(a >> 16);
    } else if constexpr (P == 4) {
        uint2 a = *reinterpret_cast<const uint2*>(w);
        unsigned ws[2] = {a.x, a.y};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            cw[2 * i] = half_bits(ws[i] & 0xffffu);
            cw[2 * i + 1] = half_bits(ws[i] >> 16);
        }
    } else {
#pragma unroll
        for (int q = 0; q < P / 8; q++) {
            uint4 a = reinterpret_cast<const uint4*>(w)[q];
            unsigned ws[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                cw[8 * q + 2 * i] = half_bits(ws[i] & 0xffffu);
                cw[8 * q + 2 * i + 1] = half_bits(ws[i] >> 16);
            }
        }
    }
}

// out[b·rows + o] = Σ_i x[b, i]·w[o, i] for `batch` (≤ VQ_MAXB) rows of rotated
// activations `xr` ([batch, width], width = blocks·R). A warp per output row (rows
// strided over the grid), lanes over the row's vectors. Dynamic shared memory: the
// codebook (2^k·P fp16) when `book_shared`, then the batch's rotated rows.
#define VQ_MAXB 4
#define VQ_WARPS 8
template <int P>
__device__ void vq_matvec(const unsigned char* __restrict__ codes,
                          const unsigned short* __restrict__ norms,
                          const unsigned short* __restrict__ book, const float* __restrict__ xr,
                          float* __restrict__ out, int rows,
                          int k, int block, int blocks, size_t row_bytes, float inv_root,
                          int batch, int book_shared) {
    extern __shared__ float4 vq_shared[];
    int width = blocks * block;
    const unsigned short* bk = book;
    float* xs = reinterpret_cast<float*>(vq_shared);
    if (book_shared) {
        unsigned short* sb = reinterpret_cast<unsigned short*>(vq_shared);
        int n4 = ((1 << k) * P) / 8;  // 16-byte units; every book is a whole number of them
        const uint4* src = reinterpret_cast<const uint4*>(book);
        for (int i = threadIdx.x; i < n4; i += blockDim.x) reinterpret_cast<uint4*>(sb)[i] = src[i];
        bk = sb;
        xs = reinterpret_cast<float*>(sb + (size_t)(1 << k) * P);
    }
    for (int i = threadIdx.x; i < batch * width; i += blockDim.x) xs[i] = xr[i];
    __syncthreads();
    int lane = threadIdx.x % WARP;
    int per_block = block / P, vectors = width / P;
    for (int o = blockIdx.x * VQ_WARPS + threadIdx.x / WARP; o < rows;
         o += gridDim.x * VQ_WARPS) {
        const unsigned char* rc = codes + (size_t)o * row_bytes;
        const unsigned short* rn = norms + (size_t)o * blocks;
        float acc[VQ_MAXB];
#pragma unroll
        for (int b = 0; b < VQ_MAXB; b++) acc[b] = 0.0f;
        // Unrolled so that several vectors' code and codeword loads are in flight at
        // once: each lookup waits on its code bytes, and a row has few warps.
#pragma unroll 4
        for (int j = lane; j < vectors; j += WARP) {
            float cw[P];
            vq_codeword<P>(bk, vq_index(rc, (size_t)j * k, k), cw);
            float scale = half_bits(rn[j / per_block]) * inv_root;
#pragma unroll
            for (int b = 0; b < VQ_MAXB; b++) {
                if (b < batch) {
                    // Vector loads: lanes P floats apart would otherwise hit the
                    // same shared-memory banks P ways.
                    const float* xv = xs + (size_t)b * width + (size_t)j * P;
                    float d = 0.0f;
                    if constexpr (P == 2) {
                        float2 v = *reinterpret_cast<const float2*>(xv);
                        d = cw[0] * v.x + cw[1] * v.y;
                    } else {
#pragma unroll
                        for (int q = 0; q < P / 4; q++) {
                            float4 v = reinterpret_cast<const float4*>(xv)[q];
                            d += cw[4 * q] * v.x + cw[4 * q + 1] * v.y + cw[4 * q + 2] * v.z +
                                 cw[4 * q + 3] * v.w;
                        }
                    }
                    acc[b] += scale * d;
                }
            }
        }
#pragma unroll
        for (int b = 0; b < VQ_MAXB; b++) {
            if (b < batch) {
                float t = warp_sum(acc[b]);
                if (lane == 0) out[(size_t)b * rows + o] = t;
            }
        }
    }
}

// The matrix in the rotated domain, `[rows, width]`: value i of row o is its codeword
// value times n[o, i / R] / √R, so a GEMM with the rotated activations gives the product
// (for many rows, where the matrix-vector kernel would read the codes once per 4).
// A thread per vector.
template <int P>
__device__ void vq_decode(const unsigned char* codes, const unsigned short* norms,
                          const unsigned short* book, float* out, int rows, int k, int block,
                          int blocks, size_t row_bytes, float inv_root) {
    size_t vectors = (size_t)blocks * block / P;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * vectors) return;
    size_t o = i / vectors, j = i % vectors;
    float cw[P];
    vq_codeword<P>(book, vq_index(codes + o * row_bytes, j * k, k), cw);
    float scale = half_bits(norms[o * blocks + j * P / block]) * inv_root;
    float* dst = out + o * vectors * P + j * P;
#pragma unroll
    for (int l = 0; l < P; l++) dst[l] = cw[l] * scale;
}

#define VQ_ENTRY(P)                                                                           \
    extern "C" __global__ void vq_matvec_p##P(                                                \
        const unsigned char* codes, const unsigned short* norms, const unsigned short* book,   \
        const float* xr, float* out, int rows, int k, int block, int blocks,                   \
        unsigned long long row_bytes, float inv_root, int batch, int book_shared) {            \
        PDL_ENTRY();                                                                           \
        vq_matvec<P>(codes, norms, book, xr, out, rows, k, block, blocks, row_bytes, inv_root, \
                     batch, book_shared);                                                      \
    }                                                                                          \
    extern "C" __global__ void vq_decode_p##P(                                                \
        const unsigned char* codes, const unsigned short* norms, const unsigned short* book,   \
        float* out, int rows, int k, int block, int blocks, unsigned long long row_bytes,      \
        float inv_root) {                                                                      \
        PDL_ENTRY();                                                                           \
        vq_decode<P>(codes, norms, book, out, rows, k, block, blocks, row_bytes, inv_root);    \
    }

VQ_ENTRY(2)
VQ_ENTRY(4)
VQ_ENTRY(8)
VQ_ENTRY(16)

// ---- VQ experts of a decode step, routed on the device ----
//
// The routed experts of a layer coded at a VQ rung, chosen by the route kernel. Every
// matrix has its own rotation seed, so each block rotates the activations it needs
// itself: a warp per block of R = 32·V values, lane l holding values l, l + 32, ...,
// the butterflies across lanes by shuffles first (h < 32) and then within a lane, in
// vq_rotate's order (h = 1, 2, 4, ...), so the rotated values are the same floats; the
// strided layout keeps the loads coalesced and the shared-memory stores free of bank
// conflicts. Before rotating, each warp asks for its rows' codes (and the block for a
// small book) to be brought into L1, so the lookups after it do not wait on HBM. A warp
// then takes several output rows at once, so that each rotated value it reads from
// shared memory serves all of them. A book that fits (the host decides, `book_shared`)
// is copied into shared memory first: the rows of one block touch most of it, and a
// warp's 32 scattered codeword loads cost far more through L1 than from shared memory.
// Larger books (up to 1 MiB) are read from global memory through L1. An expert's
// table entry (ROUTED_ENTRY words) holds the codes, the norms and the rotation's sign
// bits of gate, up and down in turn (bit i of word w set where entry 32w + i is −1, made
// on the host once per matrix: hashing each entry's sign here cost more than the rest of
// the rotation).
// The kernels wait on dependent loads (code words, then codewords), so they want many
// warps: 16 a block, two blocks an SM beside a 64 KiB book (64 registers a thread), and
// few rows a warp (under Nsight Compute 8 warps of 4 and 2 rows issued an instruction
// every 5 cycles per scheduler).
#define VQR_WARPS 16
#define VQR_GATE_UP_ROWS 2
#define VQR_DOWN_ROWS 1

template <int V, typename Store>
__device__ __forceinline__ void vq_rotate_warp(const float* src, int valid, const unsigned* signs,
                                               Store store) {
    int lane = threadIdx.x % WARP;
    float a[V];
#pragma unroll
    for (int r = 0; r < V; r++) {
        int i = r * WARP + lane;
        float v = i < valid ? src[i] : 0.0f;
        a[r] = (signs[r] >> lane) & 1u ? -v : v;
    }
#pragma unroll
    for (int m = 1; m < WARP; m *= 2) {
        bool upper = (lane & m) != 0;
#pragma unroll
        for (int r = 0; r < V; r++) {
            float o = __shfl_xor_sync(0xffffffffu, a[r], m);
            a[r] = upper ? o - a[r] : a[r] + o;
        }
    }
#pragma unroll
    for (int h = 1; h < V; h *= 2) {
#pragma unroll
        for (int r = 0; r < V; r++) {
            if ((r & h) == 0) {
                float p = a[r], q = a[r + h];
                a[r] = p + q;
                a[r + h] = p - q;
            }
        }
    }
    float scale = 1.0f / sqrtf((float)(V * WARP));
#pragma unroll
    for (int r = 0; r < V; r++) store(r * WARP + lane, a[r] * scale);
}

__device__ __forceinline__ void prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// Asks for the 128-byte lines of [p, p + bytes) to be brought into L1, a lane a line.
__device__ __forceinline__ void prefetch_lines(const void* p, size_t bytes) {
    const char* c = reinterpret_cast<const char*>((size_t)p & ~(size_t)127);
    const char* end = reinterpret_cast<const char*>(p) + bytes;
    for (c += (threadIdx.x % WARP) * 128; c < end; c += WARP * 128) prefetch_l1(c);
}

// Books up to this size are fetched into L1 by every block before its lookups.
#define VQR_PREFETCH_BOOK (64 << 10)

// Copies n floats (n a multiple of 4, both 16-byte aligned) into shared memory, 16
// bytes a thread at a time; the bits are copied as they are.
__device__ __forceinline__ void stage_floats(const float* src, float* dst, int n) {
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x)
        reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(src)[i];
}

// The warp's ROWS rows from o0 of a matrix (codes and norms) into L1.
__device__ __forceinline__ void prefetch_rows(const unsigned long long* m, int o0, int n,
                                              int blocks, size_t row_bytes) {
    prefetch_lines(reinterpret_cast<const char*>(m[0]) + (size_t)o0 * row_bytes, n * row_bytes);
    prefetch_lines(reinterpret_cast<const unsigned short*>(m[1]) + (size_t)o0 * blocks,
                   (size_t)n * blocks * 2);
}

// The dynamic shared memory of a routed VQ block: the book first when `book_shared`,
// then the rotated activations. Returns the book to look codewords up in and sets `xs`.
// A book left in global memory is asked into L1 when small (all of it by every block:
// blocks on one SM share L1).
template <int P>
__device__ __forceinline__ const unsigned short* vqr_shared_book(const unsigned short* book, int k,
                                                                 int book_shared, float*& xs) {
    extern __shared__ float4 vqr_shared[];
    size_t bytes = ((size_t)P << k) * 2;
    xs = reinterpret_cast<float*>(vqr_shared);
    if (!book_shared) {
        for (size_t at = threadIdx.x * 128; bytes <= VQR_PREFETCH_BOOK && at < bytes;
             at += blockDim.x * 128)
            prefetch_l1(reinterpret_cast<const char*>(book) + at);
        return book;
    }
    stage_floats(reinterpret_cast<const float*>(book), xs, (int)(bytes / 4));
    xs += bytes / 4;
    return reinterpret_cast<const unsigned short*>(vqr_shared);
}

// store(i, value i) for i < block of H D src[0 .. block) / √block by the calling warp, src
// read as zeros from `valid` on, D's signs as bits (`signs`, block / 32 words). `block` is
// a power of two from 32 to 1024 (the host checks).
template <typename Store>
__device__ __forceinline__ void vq_rotate_block_to(const float* src, int valid,
                                                   const unsigned* signs, int block, Store store) {
    switch (block) {
    case 32: vq_rotate_warp<1>(src, valid, signs, store); break;
    case 64: vq_rotate_warp<2>(src, valid, signs, store); break;
    case 128: vq_rotate_warp<4>(src, valid, signs, store); break;
    case 256: vq_rotate_warp<8>(src, valid, signs, store); break;
    case 512: vq_rotate_warp<16>(src, valid, signs, store); break;
    default: vq_rotate_warp<32>(src, valid, signs, store); break;
    }
}

// dst[0 .. block) = H D src[0 .. block) / √block (vq_rotate_block_to).
__device__ __forceinline__ void vq_rotate_block(const float* src, int valid, const unsigned* signs,
                                                int block, float* dst) {
    vq_rotate_block_to(src, valid, signs, block, [&](int i, float v) { dst[i] = v; });
}

__device__ __forceinline__ const unsigned* signs_of(const unsigned long long* m) {
    return reinterpret_cast<const unsigned*>(m[2]);
}

// out[r] = row o0 + r of matrix `m` (its table words: codes, norms, signs) · the rotated
// activations `xs` (shared memory), for the calling warp's ROWS rows from o0 (those below
// `rows`), in every lane. Lane l takes
// vectors l, l + 32, ...: 32 vectors are 32·k bits, k whole words, so a lane's index
// sits at the same shift in every round, read by one funnel shift of two aligned words.
template <int P, int ROWS>
__device__ __forceinline__ void vq_rows(const unsigned long long* m,
                                        const unsigned short* __restrict__ book, const float* xs,
                                        int o0, int rows, int k, int block, int blocks,
                                        size_t row_bytes, float (&out)[ROWS]) {
    const unsigned* codes = reinterpret_cast<const unsigned*>(m[0]);
    const unsigned short* norms = reinterpret_cast<const unsigned short*>(m[1]);
    int lane = threadIdx.x % WARP;
    int vectors = blocks * block / P, n = min(ROWS, rows - o0);
    int block_shift = __ffs(block / P) - 1;
    float inv_root = 1.0f / sqrtf((float)block);
    unsigned mask = (1u << k) - 1u;
    const unsigned* words[ROWS];
    const unsigned short* norm[ROWS];
    int shift[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        size_t bit = (size_t)(o0 + min(r, n - 1)) * row_bytes * 8 + (size_t)lane * k;
        words[r] = codes + (bit >> 5);
        shift[r] = (int)(bit & 31);
        norm[r] = norms + (size_t)(o0 + min(r, n - 1)) * blocks;
    }
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
#pragma unroll 2
    for (int j = lane, w = 0; j < vectors; j += WARP, w += k) {
        float xv[P];
        if constexpr (P == 2) {
            float2 v = *reinterpret_cast<const float2*>(xs + (size_t)j * P);
            xv[0] = v.x;
            xv[1] = v.y;
        } else {
#pragma unroll
            for (int q = 0; q < P / 4; q++) {
                float4 v = reinterpret_cast<const float4*>(xs + (size_t)j * P)[q];
                xv[4 * q] = v.x;
                xv[4 * q + 1] = v.y;
                xv[4 * q + 2] = v.z;
                xv[4 * q + 3] = v.w;
            }
        }
        int b = j >> block_shift;
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r < n) {
                unsigned idx = __funnelshift_r(words[r][w], words[r][w + 1], shift[r]) & mask;
                float cw[P];
                vq_codeword<P>(book, idx, cw);
                float d = 0.0f;
#pragma unroll
                for (int q = 0; q < P; q++) d += cw[q] * xv[q];
                acc[r] += half_bits(norm[r][b]) * inv_root * d;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) out[r] = warp_sum(acc[r]);
}

// A prompt's routed pairs' activations rotated once each, for the products to stage
// rather than rotate in every block: warp blockIdx.x · VQR_WARPS + warp of pair
// blockIdx.y rotates block b of the m-th of `mats` matrices from matrix `first` (0 gate,
// 2 down) of the pair's source row (row pair / top_k of `src`, or row pair with
// `by_pair`) into dst[pair, m, b · block ..].
extern "C" __global__ void __launch_bounds__(VQR_WARPS * WARP)
    routed_vq_rotate(const unsigned long long* table, const int* ids, int top_k, const float* src,
                     int by_pair, float* dst, int cols, int block, int mats, int first) {
    PDL_ENTRY();
    int pair = blockIdx.y, c = blockIdx.x * VQR_WARPS + threadIdx.x / WARP;
    int blocks = (cols + block - 1) / block, width = blocks * block;
    if (c >= mats * blocks) return;
    int m = c / blocks, b = c % blocks;
    const unsigned long long* ent = table + (size_t)ids[pair] * ROUTED_ENTRY;
    const float* row = src + (size_t)(by_pair ? pair : pair / top_k) * cols;
    vq_rotate_block(row + b * block, cols - b * block, signs_of(ent + 3 * (first + m)), block,
                    dst + ((size_t)pair * mats + m) * width + b * block);
}

// h[pair, o] = silu(gate_e(x_t)[o]) · up_e(x_t)[o] for pair = blockIdx.y (token
// t = pair / top_k, expert e = ids[pair]), over VQR_WARPS · VQR_GATE_UP_ROWS rows o a
// block. Dynamic shared memory: x_t rotated for gate and for up, 2 · width floats,
// staged from `xr` ([pairs, 2, width], routed_vq_rotate) when it is not null.
template <int P>
__device__ void routed_vq_gate_up(const unsigned long long* table,
                                  const int* ids, int top_k,
                                  const float* x, const float* xr,
                                  float* h, int inter, int hidden,
                                  const unsigned short* __restrict__ book, int k, int block,
                                  size_t row_bytes, int book_shared) {
    int pair = blockIdx.y, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int blocks = (hidden + block - 1) / block, width = blocks * block;
    const unsigned long long* ent = table + (size_t)ids[pair] * ROUTED_ENTRY;
    const float* xt = x + (size_t)(pair / top_k) * hidden;
    int o0 = (blockIdx.x * VQR_WARPS + warp) * VQR_GATE_UP_ROWS;
    int n = min(VQR_GATE_UP_ROWS, inter - o0);
    if (n > 0) {
        prefetch_rows(ent, o0, n, blocks, row_bytes);
        prefetch_rows(ent + 3, o0, n, blocks, row_bytes);
    }
    float* xs;
    const unsigned short* bk = vqr_shared_book<P>(book, k, book_shared, xs);
    if (xr) {
        stage_floats(xr + (size_t)pair * 2 * width, xs, 2 * width);
    } else {
        for (int c = warp; c < 2 * blocks; c += VQR_WARPS) {
            int m = c / blocks, b = c % blocks;
            vq_rotate_block(xt + b * block, hidden - b * block, signs_of(ent + 3 * m), block,
                            xs + m * width + b * block);
        }
    }
    __syncthreads();
    if (n <= 0) return;
    float g[VQR_GATE_UP_ROWS], u[VQR_GATE_UP_ROWS];
    vq_rows<P, VQR_GATE_UP_ROWS>(ent, bk, xs, o0, inter, k, block, blocks, row_bytes, g);
    vq_rows<P, VQR_GATE_UP_ROWS>(ent + 3, bk, xs + width, o0, inter, k, block, blocks, row_bytes,
                                 u);
#pragma unroll
    for (int r = 0; r < VQR_GATE_UP_ROWS; r++) {
        if (lane == r && o0 + r < inter) {
            h[(size_t)pair * inter + o0 + r] = g[r] / (1.0f + expf(-g[r])) * u[r];
        }
    }
}

// out[t, o] = Σ_q weights[t·top_k + q] · down_e(h[t·top_k + q])[o], the pairs added in
// order, for token t = blockIdx.y, over VQR_WARPS · VQR_DOWN_ROWS rows o a block. Dynamic
// shared memory: each of the token's pairs' h rotated with its expert's seed,
// top_k · width floats, staged from `hr` ([pairs, width]) when it is not null.
template <int P>
__device__ void routed_vq_down(const unsigned long long* table,
                               const int* ids, const float* weights,
                               int top_k, const float* h,
                               const float* hr, float* out, int hidden,
                               int inter, const unsigned short* __restrict__ book, int k,
                               int block, size_t row_bytes, int book_shared) {
    int t = blockIdx.y, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int blocks = (inter + block - 1) / block, width = blocks * block;
    int o0 = (blockIdx.x * VQR_WARPS + warp) * VQR_DOWN_ROWS;
    int n = min(VQR_DOWN_ROWS, hidden - o0);
    for (int q = 0; n > 0 && q < top_k; q++)
        prefetch_rows(table + (size_t)ids[t * top_k + q] * ROUTED_ENTRY + 6, o0, n, blocks,
                      row_bytes);
    float* hs;
    const unsigned short* bk = vqr_shared_book<P>(book, k, book_shared, hs);
    if (hr) {
        stage_floats(hr + (size_t)t * top_k * width, hs, top_k * width);
    } else {
        for (int c = warp; c < top_k * blocks; c += VQR_WARPS) {
            int q = c / blocks, b = c % blocks, pair = t * top_k + q;
            const unsigned long long* ent = table + (size_t)ids[pair] * ROUTED_ENTRY;
            vq_rotate_block(h + (size_t)pair * inter + b * block, inter - b * block,
                            signs_of(ent + 6), block, hs + q * width + b * block);
        }
    }
    __syncthreads();
    if (n <= 0) return;
    float total[VQR_DOWN_ROWS];
#pragma unroll
    for (int r = 0; r < VQR_DOWN_ROWS; r++) total[r] = 0.0f;
    for (int q = 0; q < top_k; q++) {
        int pair = t * top_k + q;
        const unsigned long long* ent = table + (size_t)ids[pair] * ROUTED_ENTRY;
        float d[VQR_DOWN_ROWS];
        vq_rows<P, VQR_DOWN_ROWS>(ent + 6, bk, hs + q * width, o0, hidden, k, block, blocks,
                                  row_bytes, d);
        float w = weights[pair];
#pragma unroll
        for (int r = 0; r < VQR_DOWN_ROWS; r++) total[r] += w * d[r];
    }
#pragma unroll
    for (int r = 0; r < VQR_DOWN_ROWS; r++) {
        if (lane == r && o0 + r < hidden) out[(size_t)t * hidden + o0 + r] = total[r];
    }
}

#define VQR_ENTRY(P)                                                                           \
    extern "C" __global__ void __launch_bounds__(VQR_WARPS * WARP, 2) routed_vq_gate_up_p##P(  \
        const unsigned long long* table, const int* ids, int top_k, const float* x,            \
        const float* xr, float* h, int inter, int hidden, const unsigned short* book, int k,   \
        int block, unsigned long long row_bytes, int book_shared) {                            \
        PDL_ENTRY();                                                                           \
        routed_vq_gate_up<P>(table, ids, top_k, x, xr, h, inter, hidden, book, k, block,       \
                             row_bytes, book_shared);                                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(VQR_WARPS * WARP, 2) routed_vq_down_p##P(     \
        const unsigned long long* table, const int* ids, const float* weights, int top_k,      \
        const float* h, const float* hr, float* out, int hidden, int inter,                    \
        const unsigned short* book, int k, int block, unsigned long long row_bytes,            \
        int book_shared) {                                                                     \
        PDL_ENTRY();                                                                           \
        routed_vq_down<P>(table, ids, weights, top_k, h, hr, out, hidden, inter, book, k,      \
                          block, row_bytes, book_shared);                                      \
    }

VQR_ENTRY(2)
VQR_ENTRY(4)
VQR_ENTRY(8)
VQR_ENTRY(16)

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

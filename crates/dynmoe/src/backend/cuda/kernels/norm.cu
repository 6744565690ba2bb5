// Norms and the residual add (alone, or folded into the products that read them),
// elementwise ops, embedding, RoPE, and the copies a decode step makes in place: what is
// bound by a launch's latency rather than by its bytes.

extern "C" __global__ void fill(float* x, float v, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) x[i] = v;
}

// Grid: one block per row. An id past the table's `rows` (NOT_A_TOKEN, which a queued
// decode step can be handed by the step before it when that one's logits were not finite)
// gives a row of NaN, which the step's pick answers with NOT_A_TOKEN again, rather than a
// read outside the table.
extern "C" __global__ void embed(const float* table, const unsigned* ids, float* out, int dim,
                                 unsigned rows) {
    PDL_ENTRY();
    unsigned id = ids[blockIdx.x];
    float* dst = out + (size_t)blockIdx.x * dim;
    if (id >= rows) {
        for (int d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = __int_as_float(0x7fc00000);
        return;
    }
    const float* src = table + (size_t)id * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = src[d];
}

// The same from a table of bf16 values (their raw 16 bits).
extern "C" __global__ void embed_bf16(const unsigned short* table, const unsigned* ids, float* out,
                                      int dim, unsigned rows) {
    PDL_ENTRY();
    unsigned id = ids[blockIdx.x];
    float* dst = out + (size_t)blockIdx.x * dim;
    if (id >= rows) {
        for (int d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = __int_as_float(0x7fc00000);
        return;
    }
    const unsigned short* src = table + (size_t)id * dim;
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

// Device-to-device copy at full width, the bandwidth ceiling kernels are compared with.
extern "C" __global__ void copy_f4(const float4* src, float4* dst, long long n4) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n4; i += stride) dst[i] = src[i];
}

// ---- Decode steps whose per-call values live in device memory ----

// dst row *pos = src row 0.
extern "C" __global__ void write_row_at(const float* src, float* dst, const unsigned* pos, int width) {
    PDL_ENTRY();
    float* d = dst + (size_t)*pos * width;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x)
        d[i] = src[i];
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

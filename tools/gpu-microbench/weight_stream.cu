// How fast can a warp-per-16-row-tile kernel stream q4 weights? The one-row dense
// kernels (dense_mma, the LM head) read each unit (16 rows x 64 columns) as two 8-byte
// loads per lane from 8 rows each, plus one 2-byte scale or bias per lane from 16 rows;
// this measures that access against a layout where a unit's words (512 bytes) and its
// scales and biases (64 bytes) are contiguous, with and without the kernels' decode and
// mma.sync work, beside a plain float4 read of the same bytes.
//
//   nvcc -O3 -arch=sm_90 -o weight_stream weight_stream.cu && ./weight_stream
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

#define ROWS 151936
#define COLS 2048
#define GROUPS (COLS / 64)
#define TILES (ROWS / 16)
#define ROW_WORDS (COLS / 8)
#define WARPS 8
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    std::printf("%s: %s\n", #x, cudaGetErrorString(e)); std::exit(1); } } while (0)

__device__ __forceinline__ unsigned sub_f16x2(unsigned x, unsigned y) {
    unsigned r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(y));
    return r;
}
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float bf16(unsigned short h) { return __uint_as_float((unsigned)h << 16); }

// TILED: unit (tile, group) is 128 contiguous words and its 32 scales/biases contiguous.
// WORK: 0 xor the words, 1 decode them and multiply on tensor cores as unit_dot does.
template <bool TILED, bool SCALES, int U, int WORK>
__global__ void __launch_bounds__(WARPS * 32, 3)
    stream(const unsigned* words, const unsigned short* scales, const unsigned short* biases,
           float* out) {
    __shared__ unsigned xs[GROUPS * 80];
    for (int i = threadIdx.x; i < GROUPS * 80; i += blockDim.x) xs[i] = 0x3c003c00u ^ (i * 7);
    __syncthreads();
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane >> 2, q = lane & 3;
    for (int t = blockIdx.x * WARPS + warp; t < TILES; t += gridDim.x * WARPS) {
        int o0 = t * 16 + g, o1 = o0 + 8;
        float acc0 = 0.f, acc1 = 0.f;
        unsigned x = 0;
        for (int base = 0; base < GROUPS; base += U) {
            unsigned w[U][4];
            unsigned short sb[U];
#pragma unroll
            for (int j = 0; j < U; j++) {
                int gi = base + j;
                if (TILED) {
                    uint4 v = reinterpret_cast<const uint4*>(words)[((size_t)t * GROUPS + gi) * 32 + lane];
                    w[j][0] = v.x; w[j][1] = v.y; w[j][2] = v.z; w[j][3] = v.w;
                    if (SCALES) {
                        const unsigned short* s = (q & 1) ? biases : scales;
                        sb[j] = s[((size_t)t * GROUPS + gi) * 16 + (q < 2 ? g : g + 8)];
                    }
                } else {
                    uint2 a = *reinterpret_cast<const uint2*>(words + (size_t)o0 * ROW_WORDS + gi * 8 + 2 * q);
                    uint2 b = *reinterpret_cast<const uint2*>(words + (size_t)o1 * ROW_WORDS + gi * 8 + 2 * q);
                    w[j][0] = a.x; w[j][1] = a.y; w[j][2] = b.x; w[j][3] = b.y;
                    if (SCALES) {
                        const unsigned short* s = (q & 1) ? biases : scales;
                        sb[j] = s[(size_t)(q < 2 ? o0 : o1) * GROUPS + gi];
                    }
                }
                if (!SCALES) sb[j] = 0x3f80;
            }
#pragma unroll
            for (int j = 0; j < U; j++) {
                int gi = base + j;
                if (WORK == 0) {
                    x ^= w[j][0] ^ w[j][1] ^ w[j][2] ^ w[j][3] ^ sb[j];
                    continue;
                }
                const unsigned magic = 0x64006400u;
                unsigned a0[8], a1[8];
#pragma unroll
                for (int ks = 0; ks < 4; ks++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        a0[2 * ks + h] = sub_f16x2(((w[j][h] >> (4 * ks)) & 0x000F000Fu) | magic, magic);
                        a1[2 * ks + h] = sub_f16x2(((w[j][2 + h] >> (4 * ks)) & 0x000F000Fu) | magic, magic);
                    }
                unsigned bx[8];
                const unsigned* src = xs + gi * 80 + (g & 1) * 40 + 2 * q;
#pragma unroll
                for (int ks = 0; ks < 4; ks++) {
                    uint2 v = g < 2 ? *reinterpret_cast<const uint2*>(src + 8 * ks) : make_uint2(0u, 0u);
                    bx[2 * ks] = v.x; bx[2 * ks + 1] = v.y;
                }
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ks = 0; ks < 4; ks++) {
                    unsigned a[4] = {a0[2 * ks], a1[2 * ks], a0[2 * ks + 1], a1[2 * ks + 1]};
                    mma(c, a, bx[2 * ks], bx[2 * ks + 1]);
                }
                float v = bf16(sb[j]);
                int b4 = lane & ~3;
                float f1 = __shfl_sync(0xffffffffu, v, b4 + 1), f2 = __shfl_sync(0xffffffffu, v, b4 + 2),
                      f3 = __shfl_sync(0xffffffffu, v, b4 + 3);
                acc0 += v * (c[0] + c[1]) + f1 * 0.5f;
                acc1 += f2 * (c[2] + c[3]) + f3 * 0.5f;
            }
        }
        if (q == 0) {
            out[o0] = acc0 + (float)(x & 1);
            out[o1] = acc1;
        }
    }
}

__global__ void copy_read(const float4* src, size_t n, float* out) {
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float4 v = src[i];
        a.x += v.x; a.y += v.y; a.z += v.z; a.w += v.w;
    }
    if (a.x + a.y + a.z + a.w == 1234.5f) out[0] = a.x;
}

template <typename F>
float time_us(F f, int reps = 30) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int i = 0; i < reps + 3; i++) {
        CK(cudaEventRecord(a));
        f();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (i >= 3) t.push_back(ms * 1000.f);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    size_t wbytes = (size_t)ROWS * ROW_WORDS * 4, sbytes = (size_t)ROWS * GROUPS * 2;
    unsigned* words;
    unsigned short *scales, *biases;
    float* out;
    CK(cudaMalloc(&words, wbytes));
    CK(cudaMalloc(&scales, sbytes));
    CK(cudaMalloc(&biases, sbytes));
    CK(cudaMalloc(&out, ROWS * 4));
    CK(cudaMemset(words, 0x5a, wbytes));
    CK(cudaMemset(scales, 0x3c, sbytes));
    CK(cudaMemset(biases, 0x3c, sbytes));
    // A buffer bigger than L2 read between runs, so each run starts from HBM.
    size_t flush_bytes = 256u << 20;
    float4* flush;
    CK(cudaMalloc(&flush, flush_bytes));
    CK(cudaMemset(flush, 0, flush_bytes));
    auto flushed = [&](auto f) {
        return [&, f]() { copy_read<<<sms * 8, 256>>>(flush, flush_bytes / 16, out); f(); };
    };
    float flush_us = time_us([&] { copy_read<<<sms * 8, 256>>>(flush, flush_bytes / 16, out); });
    size_t total = wbytes + 2 * sbytes;
    float copy_us = time_us(flushed([&] { copy_read<<<sms * 8, 256>>>((const float4*)words, wbytes / 16, out); })) - flush_us;
    std::printf("%d SMs; words %.1f MB, scales+biases %.1f MB\n", sms, wbytes / 1e6, 2 * sbytes / 1e6);
    std::printf("%-40s %9s %9s\n", "kernel", "us", "GB/s");
    std::printf("%-40s %9.2f %9.1f\n", "float4 read of the words", copy_us, wbytes / copy_us / 1e3);
    int grid = 3 * sms;
#define RUN(T, S, U, W, name)                                                                    \
    {                                                                                            \
        float us = time_us(flushed([&] { stream<T, S, U, W><<<grid, WARPS * 32>>>(words, scales, biases, out); })) - flush_us; \
        CK(cudaGetLastError());                                                                  \
        std::printf("%-40s %9.2f %9.1f\n", name, us, total / us / 1e3);                          \
    }
    RUN(false, true, 4, 0, "rows, scales, U=4, loads only");
    RUN(false, false, 4, 0, "rows, no scales, U=4, loads only");
    RUN(true, true, 4, 0, "tiled, scales, U=4, loads only");
    RUN(true, false, 4, 0, "tiled, no scales, U=4, loads only");
    RUN(false, true, 8, 0, "rows, scales, U=8, loads only");
    RUN(true, true, 8, 0, "tiled, scales, U=8, loads only");
    RUN(false, true, 4, 1, "rows, scales, U=4, decode+mma");
    RUN(false, false, 4, 1, "rows, no scales, U=4, decode+mma");
    RUN(true, true, 4, 1, "tiled, scales, U=4, decode+mma");
    RUN(true, false, 4, 1, "tiled, no scales, U=4, decode+mma");
    RUN(false, true, 8, 1, "rows, scales, U=8, decode+mma");
    RUN(true, true, 8, 1, "tiled, scales, U=8, decode+mma");
    RUN(true, true, 2, 1, "tiled, scales, U=2, decode+mma");
    return 0;
}

// VQ-ladder matrices on CUDA cores: rotation, matrix-vector products and decoding of
// dense matrices, and routed experts at every rung (those the tensor-core kernels do not
// take: 2-value codewords, small rotation blocks, tensor cores off).

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

// The unnormalised Walsh–Hadamard butterflies of `block` values in shared memory, in
// the CPU's order (rotation::fwht), by the block's threads; synchronised after each stage.
__device__ __forceinline__ void block_butterflies(float* buf, int block) {
    for (int h = 1; h < block; h *= 2) {
        for (int t = threadIdx.x; t < block / 2; t += blockDim.x) {
            int i = (t / h) * 2 * h + t % h;
            float p = buf[i], q = buf[i + h];
            buf[i] = p + q;
            buf[i + h] = p - q;
        }
        __syncthreads();
    }
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
    block_butterflies(buf, block);
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

// Rows ids[r] of the matrix decoded to f32 `[n, cols]` (an embedding lookup of a coded
// table): a block per (rotation block, row) looks up the block's codewords, applies the
// butterfly, and scales each value by its sign, the block's norm and 1/R, in the order
// rotation::unrotate does. An id past `rows` gives a row of NaN, as `embed` does.
template <int P>
__device__ void vq_gather(const unsigned char* codes, const unsigned short* norms,
                          const unsigned short* book, const unsigned* ids, float* out, int cols,
                          int rows, int k, int block, int blocks, size_t row_bytes,
                          float inv_root, unsigned long long seed) {
    __shared__ float buf[1024];
    int b = blockIdx.x, r = blockIdx.y;
    unsigned id = ids[r];
    float* dst = out + (size_t)r * cols;
    if (id >= (unsigned)rows) {
        for (int i = threadIdx.x; i < block; i += blockDim.x)
            if (b * block + i < cols) dst[b * block + i] = __int_as_float(0x7fc00000);
        return;
    }
    const unsigned char* row = codes + (size_t)id * row_bytes;
    for (int j = threadIdx.x; j < block / P; j += blockDim.x) {
        float cw[P];
        vq_codeword<P>(book, vq_index(row, ((size_t)b * block / P + j) * k, k), cw);
#pragma unroll
        for (int l = 0; l < P; l++) buf[j * P + l] = cw[l];
    }
    __syncthreads();
    block_butterflies(buf, block);
    float norm = half_bits(norms[(size_t)id * blocks + b]);
    for (int i = threadIdx.x; i < block; i += blockDim.x) {
        int c = b * block + i;
        if (c < cols) dst[c] = buf[i] * inv_root * inv_root * vq_sign(seed, i) * norm;
    }
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
    }                                                                                          \
    extern "C" __global__ void vq_gather_p##P(                                                \
        const unsigned char* codes, const unsigned short* norms, const unsigned short* book,   \
        const unsigned* ids, float* out, int cols, int rows, int k, int block, int blocks,     \
        unsigned long long row_bytes, float inv_root, unsigned long long seed) {               \
        PDL_ENTRY();                                                                           \
        vq_gather<P>(codes, norms, book, ids, out, cols, rows, k, block, blocks, row_bytes,    \
                     inv_root, seed);                                                          \
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

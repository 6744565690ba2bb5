// Enough of CUDA to run the backend's kernels on the CPU: each CUDA thread of a block is
// a fiber (ucontext), the blocks of a grid run one after another, `__syncthreads`,
// shuffles and `mma.sync` are barriers among the fibers of a block or a warp, and a spin
// on a counter lets the other fibers run. Nothing runs in parallel, so atomics are plain updates. It checks what a kernel computes,
// never how fast: prepare.py rewrites the kernels for it (the inline PTX helpers and the
// shared-memory declarations), and check.cpp runs kernels against plain references.
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <math.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __trap() (std::fprintf(stderr, "__trap\n"), std::abort())

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) int2 {
    int x, y;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
// CUDA's min and max take any two arithmetic types.
template <typename A, typename B>
inline auto min(A a, B b) -> decltype(a + b) {
    return a < b ? a : b;
}
template <typename A, typename B>
inline auto max(A a, B b) -> decltype(a + b) {
    return a < b ? b : a;
}

namespace shim {

enum State { RUN, SPIN, BLOCK_BARRIER, WARP_BARRIER, DONE };

// A fiber starts through its ucontext and switches by _setjmp/_longjmp after that:
// swapcontext saves the signal mask with a system call at every switch.
struct Fiber {
    ucontext_t ctx;
    jmp_buf jump;
    bool started = false;
    dim3 idx, block;
    unsigned linear = 0;  // within its block
    unsigned index = 0;   // among every fiber of the launch
    unsigned block_id = 0;
    State state = RUN;
};

// One stack a thread, kept from launch to launch (a kernel's frames are small).
constexpr size_t STACK = 128 << 10;
inline std::vector<std::unique_ptr<char[]>> stacks;

inline std::vector<Fiber> fibers;
inline Fiber* current = nullptr;
inline jmp_buf scheduler;
inline dim3 block_dim, grid_dim;
inline unsigned block_threads = 0;
// Dynamic shared memory of each block that runs, 16-byte aligned.
inline std::vector<std::vector<float4>> dynamic_shared;
// Words each lane leaves for its warp's collective ops.
inline std::vector<uint32_t> exchange;
inline std::function<void()> body;
// Counts every step a fiber takes other than another turn of a spin loop.
inline unsigned long long progress = 0;

inline void yield(State s) {
    current->state = s;
    if (s != SPIN) progress++;
    if (!_setjmp(current->jump)) _longjmp(scheduler, 1);
}

inline void entry() {
    body();
    current->state = DONE;
    progress++;
    _longjmp(scheduler, 1);
}

// Runs `f` until it waits at a barrier, spins or ends.
inline void resume(Fiber& f) {
    current = &f;
    if (_setjmp(scheduler)) return;
    if (f.started) _longjmp(f.jump, 1);
    f.started = true;
    ucontext_t here;
    swapcontext(&here, &f.ctx);
}

// Releases the warps of fibers [b0, b1) (one block) whose every live lane waits at a
// warp barrier, else the block when every live thread waits at __syncthreads. A block
// whose live threads wait at different barriers, with nothing to release, is a deadlock.
inline bool release_block(unsigned b0, unsigned b1) {
    bool warps = false;
    for (unsigned w0 = b0; w0 < b1; w0 += 32) {
        bool all = true, some = false;
        for (unsigned t = w0; t < std::min(b1, w0 + 32); t++) {
            if (fibers[t].state == DONE) continue;
            some = true;
            all = all && fibers[t].state == WARP_BARRIER;
        }
        if (some && all) {
            for (unsigned t = w0; t < std::min(b1, w0 + 32); t++)
                if (fibers[t].state == WARP_BARRIER) fibers[t].state = RUN;
            warps = true;
        }
    }
    if (warps) return true;
    bool all = true, some = false;
    for (unsigned t = b0; t < b1; t++) {
        if (fibers[t].state == DONE) continue;
        some = true;
        all = all && fibers[t].state == BLOCK_BARRIER;
    }
    if (some && all) {
        for (unsigned t = b0; t < b1; t++)
            if (fibers[t].state == BLOCK_BARRIER) fibers[t].state = RUN;
        return true;
    }
    return false;
}

// Makes the fibers of blocks [first, last) of the grid.
inline void make_fibers(unsigned first, unsigned last) {
    unsigned threads = block_threads;
    fibers.assign((size_t)(last - first) * threads, Fiber{});
    while (stacks.size() < fibers.size()) stacks.emplace_back(new char[STACK]);
    dim3 block = block_dim, grid = grid_dim;
    for (unsigned b = first; b < last; b++)
        for (unsigned t = 0; t < threads; t++) {
            unsigned i = (b - first) * threads + t;
            Fiber& f = fibers[i];
            f.linear = t;
            f.index = i;
            f.block_id = b - first;
            f.idx = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
            f.block = {b % grid.x, b / grid.x % grid.y, b / (grid.x * grid.y)};
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = stacks[i].get();
            f.ctx.uc_stack.ss_size = STACK;
            f.ctx.uc_link = nullptr;
            makecontext(&f.ctx, entry, 0);
        }
}

// Runs the fibers until every one has ended. Each block runs as far as it can (to its
// end, or until its threads spin) before the next one starts, so that a block reading
// what others write without waiting for them reads their poison. A fiber that spins
// gives the others their turn; a whole pass in which nothing but spinning happened is a
// deadlock.
inline void run_fibers() {
    unsigned n = (unsigned)fibers.size();
    for (;;) {
        unsigned long long before = progress;
        bool live = false;
        for (unsigned b0 = 0; b0 < n; b0 += block_threads) {
            unsigned b1 = std::min(n, b0 + block_threads);
            for (unsigned t = b0; t < b1; t++)
                if (fibers[t].state == SPIN) fibers[t].state = RUN;
            do {
                for (unsigned t = b0; t < b1; t++)
                    while (fibers[t].state == RUN) resume(fibers[t]);
            } while (release_block(b0, b1));
            for (unsigned t = b0; t < b1; t++) live = live || fibers[t].state != DONE;
        }
        if (!live) return;
        bool spinning = false;
        for (auto& f : fibers) spinning = spinning || f.state == SPIN;
        if (!spinning || progress == before) {
            std::fprintf(stderr, "deadlock: threads wait at different barriers or spin forever\n");
            std::abort();
        }
    }
}

// The kernel before a launch, for a kernel that reads some of what that one writes only
// after its programmatic-launch wait and the rest before it: `before` leaves memory as it
// is while that kernel still runs (its outputs poisoned), `after` as that kernel leaves
// it. Each block starts under `before`; PDL_WAIT is then a barrier of the block, past
// which `after` holds. Null: PDL_WAIT does nothing.
struct Predecessor {
    std::function<void()> before, after;
};
inline const Predecessor* predecessor = nullptr;

inline void pdl_wait() {
    if (!predecessor) return;
    yield(BLOCK_BARRIER);
    if (current->linear == 0) predecessor->after();
    yield(BLOCK_BARRIER);
}

// Runs `kernel` over `grid` blocks of `block` threads with `shared` bytes of dynamic
// shared memory each, poisoned with NaNs so that nothing reads what no thread wrote. The
// blocks run one after another.
inline void launch(dim3 grid, dim3 block, size_t shared, std::function<void()> kernel) {
    grid_dim = grid;
    block_dim = block;
    block_threads = block.x * block.y * block.z;
    unsigned blocks = grid.x * grid.y * grid.z;
    body = kernel;
    for (unsigned b = 0; b < blocks; b++) {
        unsigned last = b + 1;
        if (predecessor) predecessor->before();
        dynamic_shared.assign(last - b, std::vector<float4>(shared / 16 + 1, float4{NAN, NAN, NAN, NAN}));
        exchange.assign((size_t)(last - b) * block_threads * 16, 0);
        make_fibers(b, last);
        run_fibers();
    }
    current = nullptr;
}

inline unsigned lane() { return current->linear % 32; }
inline unsigned warp_base() { return current->index - lane(); }
inline void* block_shared() { return dynamic_shared[current->block_id].data(); }

// The value `v` of lane `src` of the calling warp (every lane calls).
template <typename T>
T from_lane(T v, unsigned src) {
    static_assert(sizeof(T) == 4, "shuffles of 32-bit values");
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    exchange[current->index * 16] = bits;
    yield(WARP_BARRIER);
    uint32_t got = exchange[(warp_base() + src % 32) * 16];
    yield(WARP_BARRIER);
    T r;
    std::memcpy(&r, &got, 4);
    return r;
}

}  // namespace shim

#define threadIdx (shim::current->idx)
#define blockIdx (shim::current->block)
#define blockDim (shim::block_dim)
#define gridDim (shim::grid_dim)

inline void __syncthreads() { shim::yield(shim::BLOCK_BARRIER); }
// Blocks run one after another, so one word serves every block; the barriers around the
// read keep a thread that runs ahead from clearing or setting it before all have read.
namespace shim {
inline int block_or = 0;
}
inline int __syncthreads_or(int p) {
    if (p) shim::block_or = 1;
    __syncthreads();
    int any = shim::block_or;
    __syncthreads();
    if (threadIdx.x == 0) shim::block_or = 0;
    __syncthreads();
    return any;
}
inline void __syncwarp(unsigned = 0xffffffffu) { shim::yield(shim::WARP_BARRIER); }
inline void __threadfence() {}
template <typename T>
T __shfl_xor_sync(unsigned, T v, int mask) {
    return shim::from_lane(v, shim::lane() ^ (unsigned)mask);
}
template <typename T>
T __shfl_sync(unsigned, T v, int src) {
    return shim::from_lane(v, (unsigned)src);
}
template <typename T>
T __ldcg(const T* p) {
    return *p;
}
inline float atomicAdd(float* p, float v) {
    float old = *p;
    *p = old + v;
    return old;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    unsigned old = *p;
    *p = old + v;
    return old;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    unsigned long long old = *p;
    *p = old + v;
    return old;
}
inline unsigned atomicExch(unsigned* p, unsigned v) {
    unsigned old = *p;
    *p = v;
    return old;
}
inline float __uint_as_float(unsigned v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline float __int_as_float(int v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    uint64_t v = ((uint64_t)hi << 32) | lo;
    return (unsigned)(v >> (shift & 31));
}
inline int __ffs(int v) { return __builtin_ffs(v); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline unsigned __float_as_uint(float f) {
    unsigned v;
    std::memcpy(&v, &f, 4);
    return v;
}

// The inline-PTX helpers of the kernels (prepare.py removes their definitions there).
// IEEE half precision in software, so that any C++17 compiler will do.
inline float half_bits(unsigned short h) {
    unsigned sign = (h >> 15) & 1u, exp = (h >> 10) & 31u, man = h & 1023u;
    float v;
    if (exp == 0)
        v = std::ldexp((float)man, -24);
    else if (exp == 31)
        v = man ? NAN : INFINITY;
    else
        v = std::ldexp((float)(man | 1024u), (int)exp - 25);
    return sign ? -v : v;
}
// Rounded to nearest even, as cvt.rn.f16.f32.
inline unsigned short f16_bits(float v) {
    unsigned bits;
    std::memcpy(&bits, &v, 4);
    unsigned short sign = (unsigned short)((bits >> 16) & 0x8000u);
    float a = std::fabs(v);
    if (std::isnan(v)) return sign | 0x7e00u;
    if (a >= 65520.0f) return sign | 0x7c00u;  // rounds past the largest half
    int e;
    std::frexp(a, &e);  // a = m · 2^e, m in [0.5, 1)
    // Units of the last place: 2^(e - 11) for normals, 2^-24 below 2^-14.
    int ulp = std::max(e - 11, -24);
    float q = std::nearbyint(std::ldexp(a, -ulp));  // ties to even (default rounding)
    float r = std::ldexp(q, ulp);
    if (r == 0.0f) return sign;
    int re;
    std::frexp(r, &re);
    if (re - 1 < -14) return sign | (unsigned short)std::ldexp(r, 24);  // subnormal
    unsigned man = (unsigned)std::ldexp(r, 11 - re) - 1024u;
    return sign | (unsigned short)(((re - 1 + 15) << 10) | man);
}
inline unsigned pack_f16x2(float lo, float hi) {
    return (unsigned)f16_bits(lo) | ((unsigned)f16_bits(hi) << 16);
}
inline float2 unpack_f16x2(unsigned v) {
    return make_float2(half_bits(v & 0xffffu), half_bits(v >> 16));
}
inline unsigned sub_f16x2(unsigned x, unsigned y) {
    float2 a = unpack_f16x2(x), b = unpack_f16x2(y);
    return pack_f16x2(a.x - b.x, a.y - b.y);
}
inline void prefetch_l1(const void*) {}
inline void copy16_async(float4* dst, const float4* src, bool full) {
    if (full)
        std::memcpy(dst, src, 16);
    else
        std::memset(dst, 0, 16);
}
inline void copy4_async(unsigned* dst, const unsigned* src) { *dst = *src; }
// A spin on a counter that other blocks raise: the other fibers run meanwhile.
inline void wait_count(const unsigned* c, unsigned target) {
    while (*(volatile const unsigned*)c < target) shim::yield(shim::SPIN);
}
inline void copies_commit() {}
inline void copies_wait() {}

// c (+)= a · b for one m16n8k16 fragment, f16 inputs and f32 sums, in mma.sync's
// register layout: lane = 4 g + t holds A's rows g and g + 8 at columns 2t, 2t + 1 and
// 2t + 8, 2t + 9; B's column g at rows 2t, 2t + 1, 2t + 8, 2t + 9; C's rows g and g + 8
// at columns 2t, 2t + 1. Every lane of the warp calls.
inline void shim_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, bool add) {
    uint32_t* x = &shim::exchange[shim::current->index * 16];
    for (int i = 0; i < 4; i++) x[i] = a[i];
    x[4] = b0;
    x[5] = b1;
    shim::yield(shim::WARP_BARRIER);
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; l++) {
        const uint32_t* r = &shim::exchange[(shim::warp_base() + l) * 16];
        unsigned g = l / 4, t = l % 4;
        for (int h = 0; h < 2; h++) {
            A[g][2 * t + h] = half_bits((unsigned short)(r[0] >> (16 * h)));
            A[g + 8][2 * t + h] = half_bits((unsigned short)(r[1] >> (16 * h)));
            A[g][2 * t + 8 + h] = half_bits((unsigned short)(r[2] >> (16 * h)));
            A[g + 8][2 * t + 8 + h] = half_bits((unsigned short)(r[3] >> (16 * h)));
            B[2 * t + h][g] = half_bits((unsigned short)(r[4] >> (16 * h)));
            B[2 * t + 8 + h][g] = half_bits((unsigned short)(r[5] >> (16 * h)));
        }
    }
    shim::yield(shim::WARP_BARRIER);
    unsigned l = shim::lane(), g = l / 4, t = l % 4;
    const unsigned rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; i++) {
        float s = 0.0f;
        for (int k = 0; k < 16; k++) s += A[rows[i]][k] * B[k][cols[i]];
        c[i] = (add ? c[i] : 0.0f) + s;
    }
}
inline void mma_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    shim_mma(c, a, b0, b1, true);
}
inline void mma_f16_first(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    shim_mma(c, a, b0, b1, false);
}

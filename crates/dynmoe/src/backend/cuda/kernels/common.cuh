// What every kernel file uses (program.cu puts it first): programmatic dependent launch
// and the timeline and phase instruments built on it, warp and block reductions, bf16
// and f16 conversions, asynchronous copies into shared memory and the mma.sync products.
// Tensors are row-major f32; bf16 scales and biases arrive as their raw 16 bits.

#define WARP 32
// NVRTC compiles without the C headers that define INFINITY.
#define NEG_INF __int_as_float(0xff800000)
// backend::NOT_A_TOKEN: the token of a row of logits that holds a NaN or an infinity.
#define NOT_A_TOKEN 4294967295u
// A block's partial index that says its slice of the row was not all finite.
#define ROW_NOT_FINITE (-2)

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

__device__ __forceinline__ unsigned sub_f16x2(unsigned x, unsigned y) {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 800
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(y));
#endif
    return r;
}

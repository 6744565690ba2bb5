// Attention: a decode step's preamble (per-head norms, RoPE, the caches' new row), its
// one row against chunks of keys a block per KV head and their merge, and prompts in
// shared-memory tiles of query slots; a block per (row, head) for head widths the tiled
// and grouped kernels do not take.

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
                                bool early, const unsigned long long* rows = nullptr) {
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
    if (rows) {
        // Several sequences' rows (attention_group_rows_*): this block's row is
        // blockIdx.z, its caches and position in the table the host wrote before.
        const unsigned long long* row = rows + 3 * blockIdx.z;
        k = reinterpret_cast<const float*>(row[0]);
        v = reinterpret_cast<const float*>(row[1]);
        pos0 = (int)row[2];
        pos_at = nullptr;
    }
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

// Several sequences decoded together, a query row each (row r of `q`), each against its
// own caches: `rows` holds, per row, its key cache, its value cache and its position
// (three words). Row r is blockIdx.z; its partial outputs go to its own part of `acc` and
// `ml`, so attention_combine over rows × heads blocks merges every row at once.
#define ATTENTION_GROUP_ROWS(W, NV)                                                             \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_group_rows_##W(       \
        const float* q, const unsigned long long* rows, float* acc, float* ml, int heads,     \
        int kv_heads, int head_dim, int window, int chunk) {                                  \
        PDL_LAUNCH();                                                                          \
        size_t r = blockIdx.z, parts = (size_t)heads * gridDim.y;                              \
        attention_group<NV>(q + r * heads * head_dim, nullptr, nullptr,                        \
                            acc + r * parts * head_dim, ml + r * parts * 2, 0, heads,          \
                            kv_heads, head_dim, window, nullptr, chunk, false, rows);          \
    }
ATTENTION_GROUP_ROWS(64, 2)
ATTENTION_GROUP_ROWS(128, 4)
ATTENTION_GROUP_ROWS(256, 8)

// Each row's new key and value (row r of `k` and `v`, `kvw` wide) into its own caches at
// its position, from the table attention_group_rows_* reads: a block a row.
extern "C" __global__ void cache_write_rows(const float* k, const float* v,
                                            const unsigned long long* rows, int kvw) {
    PDL_ENTRY();
    const unsigned long long* row = rows + 3 * blockIdx.x;
    size_t at = (size_t)row[2] * kvw, r = blockIdx.x;
    float* kc = reinterpret_cast<float*>(row[0]) + at;
    float* vc = reinterpret_cast<float*>(row[1]) + at;
    for (int i = threadIdx.x; i < kvw; i += blockDim.x) {
        kc[i] = k[r * kvw + i];
        vc[i] = v[r * kvw + i];
    }
}

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

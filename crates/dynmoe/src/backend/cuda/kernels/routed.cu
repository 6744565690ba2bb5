// A decode step's routed affine experts on tensor cores: gate/up, which routes its row
// itself, and down, which adds each token's experts weighted in a fixed order; and the
// copy of a resident slot's rows into unit tiles.

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

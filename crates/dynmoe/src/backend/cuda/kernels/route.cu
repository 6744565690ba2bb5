// Routes on the device: a row of router logits to its softmax, mask and top-k by every
// thread of a block, and the argmax that picks a decode step's token.

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
    bool finite = true;
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
            if (d < hi && !isfinite(a[u])) finite = false;
        }
    }
    // A row with a NaN or an infinity has no largest value (Backend::argmax_rows): the
    // block marks its partial, and the row's token is NOT_A_TOKEN.
    bool spoilt = __syncthreads_or(!finite);
    block_argmax(v, i, sv, si);
    size_t at = (size_t)r * splits;
    if (threadIdx.x == 0) {
        part[at + s] = v;
        part_i[at + s] = spoilt ? ROW_NOT_FINITE : i;
        // The partial is visible to every block before the count says it is there.
        __threadfence();
        last = atomicAdd(&count[r], 1u) == (unsigned)(splits - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    v = NEG_INF;
    i = 0x7fffffff;
    finite = true;
    for (int k = threadIdx.x; k < splits; k += blockDim.x) {
        // Past L1, which may hold nothing of another block's writes but must not be trusted.
        float pv = __ldcg(part + at + k);
        int pi = __ldcg(part_i + at + k);
        if (pi == ROW_NOT_FINITE) finite = false;
        if (pv > v || (pv == v && pi < i)) { v = pv; i = pi; }
    }
    spoilt = __syncthreads_or(!finite);
    block_argmax(v, i, sv, si);
    if (threadIdx.x == 0) {
        out[r] = spoilt ? NOT_A_TOKEN : (unsigned)(i == 0x7fffffff ? 0 : i);
        count[r] = 0;
    }
}

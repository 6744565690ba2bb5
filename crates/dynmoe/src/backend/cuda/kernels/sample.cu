// Picking a decode step's token on the device, as backend::sample defines it: penalties
// and temperature (sample_scale), the top-k/top-p cut through a histogram of bins and a
// sort of the candidates the cut falls among (sample_hist, sample_cut, sample_gather,
// sample_settle), and a Gumbel argmax over the kept tokens (sample_draw). Every sum is of
// integers and every reduction a max, so the token does not depend on the order blocks
// run in. The host chooses the chain from the settings: greedy without penalties is
// argmax_rows alone, greedy with them sample_scale then argmax_rows, a draw with neither
// top-k nor top-p sample_scale then sample_draw.

// backend::sample's BINS, BINS_PER_UNIT and BIN_SORT_MAX.
#define SAMPLE_BINS 4096
#define SAMPLE_BINS_PER_UNIT 128.0f
#define SAMPLE_SORT_MAX 16384
#define SAMPLE_THREADS 256
#define SAMPLE_HIST_SHARED (SAMPLE_BINS * 12)

// How sample_settle left the cut for sample_draw (SampleCut::mode).
#define CUT_NONE 0   // every candidate is kept
#define CUT_EXACT 1  // candidates at or before (tau_s, tau_id) in the order
#define CUT_BINS 2   // candidates in bins up to `bin`

struct SampleCut {
    // What sample_cut found: whether top-k applies (then `bin` is its bin and every
    // candidate up to it was gathered), else top-p's bin (its candidates gathered).
    int top_k_cut;
    int bin;
    unsigned long long ahead;  // top-p alone: the weight of the bins before `bin`
    unsigned long long goal;   // top-p alone: the weight the prefix must reach
    unsigned gathered;         // candidates sample_gather found (may pass SAMPLE_SORT_MAX)
    // What sample_settle decided.
    int mode;
    float tau_s;
    int tau_id;
};

// The penalized logit of a token the sequence holds `count` times.
__device__ __forceinline__ float sample_penalized(float l, float count, float rep, float pres,
                                                  float freq) {
    if (count == 0.0f) return l;
    l = l > 0.0f ? l / rep : l * rep;
    return l - pres - freq * count;
}

__device__ __forceinline__ int sample_bin(float s, float m) {
    return (int)fminf((m - s) * SAMPLE_BINS_PER_UNIT, (float)(SAMPLE_BINS - 1));
}

__device__ __forceinline__ unsigned long long sample_weight(float w) {
    return (unsigned long long)((double)w * 4294967296.0);
}

// The largest of the blocks' maxima: every block of the next kernels recomputes it.
__device__ float sample_max(const float* bmax, int blocks, float* scratch) {
    float m = NEG_INF;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) m = fmaxf(m, bmax[b]);
    return block_max(m, scratch);
}

// Philox4x32-10's first word for (counter, key), as rng::philox4x32.
__device__ unsigned sample_philox(unsigned c0, unsigned c1, unsigned c2, unsigned c3,
                                  unsigned k0, unsigned k1) {
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        unsigned n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    return c0;
}

// backend::sample::gumbel.
__device__ float sample_gumbel(unsigned seed_lo, unsigned seed_hi, unsigned long long pos, int id) {
    unsigned w = sample_philox((unsigned)id, (unsigned)pos, (unsigned)(pos >> 32), 0u, seed_lo,
                               seed_hi);
    float u = ((float)(w >> 8) + 0.5f) * (1.0f / 16777216.0f);
    return -logf(-logf(u));
}

// s = penalized(logit) / temperature over one block's slice of each row (blockIdx.y), and
// the slice's maximum. `counts` may be null (no penalty); greedy (temperature <= 0)
// divides by nothing. A logit that is not finite becomes a NaN in s, which the kernel that
// picks the token (argmax_rows or sample_draw) answers with NOT_A_TOKEN, as the host does.
extern "C" __global__ void sample_scale(const float* logits, const float* counts, float* s,
                                        float* bmax, int vocab, int chunk, float temperature,
                                        float rep, float pres, float freq) {
    PDL_ENTRY();
    __shared__ float red[32];
    int r = blockIdx.y, lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
    const float* l = logits + (size_t)r * vocab;
    const float* c = counts ? counts + (size_t)r * vocab : nullptr;
    float* out = s + (size_t)r * vocab;
    float m = NEG_INF;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = c ? sample_penalized(l[i], c[i], rep, pres, freq) : l[i];
        if (temperature > 0.0f) v = v / temperature;
        if (!isfinite(l[i])) v = __int_as_float(0x7fc00000);
        out[i] = v;
        m = fmaxf(m, v);
    }
    m = block_max(m, red);
    if (threadIdx.x == 0) bmax[(size_t)r * gridDim.x + blockIdx.x] = m;
}

// The histogram of the candidates (min-p's, or every token) by bin: their count and their
// integer weight, in one block's dynamic shared memory (SAMPLE_HIST_SHARED bytes), then
// added to the row's.
extern "C" __global__ void sample_hist(const float* s, const float* bmax, unsigned* hist_count,
                                       unsigned long long* hist_mass, int vocab, int chunk,
                                       float min_p) {
    PDL_ENTRY();
    __shared__ float red[32];
    // The block's histogram, 48 KB: past what a block gets without asking.
    extern __shared__ float hist_smem[];
    unsigned long long* mass = reinterpret_cast<unsigned long long*>(hist_smem);
    unsigned* count = reinterpret_cast<unsigned*>(mass + SAMPLE_BINS);
    int r = blockIdx.y, lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
    for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
        count[b] = 0;
        mass[b] = 0;
    }
    float m = sample_max(bmax + (size_t)r * gridDim.x, gridDim.x, red);
    const float* row = s + (size_t)r * vocab;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float w = expf(row[i] - m);
        if (min_p > 0.0f && !(w >= min_p)) continue;
        int b = sample_bin(row[i], m);
        atomicAdd(&count[b], 1u);
        atomicAdd(&mass[b], sample_weight(w));
    }
    __syncthreads();
    unsigned* gc = hist_count + (size_t)r * SAMPLE_BINS;
    unsigned long long* gm = hist_mass + (size_t)r * SAMPLE_BINS;
    for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
        if (count[b]) {
            atomicAdd(&gc[b], count[b]);
            atomicAdd(&gm[b], mass[b]);
        }
    }
}

// The first bin at which a running sum over the histogram `v` reaches `goal` (the last
// bin when it never does), by the first warp: each lane sums its run of bins, then one lane
// finds the run and the bin within it. The sums are integers, so the answer does not depend
// on how they are split. `runs` holds WARP values; every thread of the block calls.
__device__ int sample_first_reaching(const unsigned long long* v, unsigned long long goal,
                                     unsigned long long* runs, int* found) {
    const int per = SAMPLE_BINS / WARP;
    if (threadIdx.x < WARP) {
        unsigned long long s = 0;
        for (int b = threadIdx.x * per; b < (threadIdx.x + 1) * per; b++) s += v[b];
        runs[threadIdx.x] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long acc = 0;
        int bin = SAMPLE_BINS - 1;
        for (int r = 0; r < WARP; r++) {
            if (acc + runs[r] < goal) {
                acc += runs[r];
                continue;
            }
            for (int b = r * per; b < (r + 1) * per; b++) {
                acc += v[b];
                if (acc >= goal) {
                    bin = b;
                    break;
                }
            }
            break;
        }
        *found = bin;
    }
    __syncthreads();
    return *found;
}

// Where the cut falls, from the histogram (one block a row): with top-k below the number of
// candidates, the bin where their count reaches k (sample_gather then takes every candidate
// up to it); else with top-p, the bin where their weight reaches p of all of theirs (then
// the candidates of that bin alone). Also readies the gather's count.
extern "C" __global__ void sample_cut(const unsigned* hist_count,
                                      const unsigned long long* hist_mass, SampleCut* cut,
                                      int top_k, float top_p) {
    PDL_ENTRY();
    __shared__ unsigned long long v[SAMPLE_BINS];
    __shared__ unsigned long long runs[WARP];
    __shared__ unsigned long long total;
    __shared__ int found;
    int r = blockIdx.x;
    const unsigned* hc = hist_count + (size_t)r * SAMPLE_BINS;
    const unsigned long long* hm = hist_mass + (size_t)r * SAMPLE_BINS;
    SampleCut* c = cut + r;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    // Candidates in all.
    unsigned long long part = 0;
    for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
        v[b] = hc[b];
        part += hc[b];
    }
    atomicAdd(&total, part);
    __syncthreads();
    bool by_k = top_k > 0 && (unsigned long long)top_k < total;
    if (!by_k && top_p >= 1.0f) {
        // Top-k keeps every candidate and there is no top-p: nothing to gather or cut.
        if (threadIdx.x == 0) {
            c->top_k_cut = 0;
            c->bin = -1;
            c->gathered = 0;
        }
        return;
    }
    unsigned long long goal;
    if (by_k) {
        goal = (unsigned long long)top_k;
    } else {
        __syncthreads();
        if (threadIdx.x == 0) total = 0;
        __syncthreads();
        part = 0;
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
            v[b] = hm[b];
            part += hm[b];
        }
        atomicAdd(&total, part);
        __syncthreads();
        goal = (unsigned long long)ceil((double)top_p * (double)total);
    }
    int bin = sample_first_reaching(v, goal, runs, &found);
    // The weight of the bins before the cut's.
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    part = 0;
    for (int b = threadIdx.x; b < bin; b += blockDim.x) part += hm[b];
    atomicAdd(&total, part);
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long ahead = total;
        c->top_k_cut = by_k;
        c->bin = bin;
        c->ahead = ahead;
        c->goal = goal;
        c->gathered = 0;
    }
}

// The candidates sample_settle sorts: up to the cut's bin with top-k, in it without,
// appended in any order (the sort decides), at most SAMPLE_SORT_MAX stored, all counted.
extern "C" __global__ void sample_gather(const float* s, const float* bmax, SampleCut* cut,
                                         float* list_s, int* list_id, int vocab, int chunk,
                                         float min_p) {
    PDL_ENTRY();
    __shared__ float red[32];
    int r = blockIdx.y, lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
    float m = sample_max(bmax + (size_t)r * gridDim.x, gridDim.x, red);
    SampleCut* c = cut + r;
    int bin_hi = c->bin, bin_lo = c->top_k_cut ? 0 : c->bin;
    if (bin_hi < 0) return;
    const float* row = s + (size_t)r * vocab;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = row[i];
        if (min_p > 0.0f && !(expf(v - m) >= min_p)) continue;
        int b = sample_bin(v, m);
        if (b < bin_lo || b > bin_hi) continue;
        unsigned at = atomicAdd(&c->gathered, 1u);
        if (at < SAMPLE_SORT_MAX) {
            list_s[(size_t)r * SAMPLE_SORT_MAX + at] = v;
            list_id[(size_t)r * SAMPLE_SORT_MAX + at] = i;
        }
    }
}

// A key that sorts ascending as the order does: larger s first, the lower id on ties.
__device__ __forceinline__ unsigned long long sample_key(float s, int id) {
    unsigned u = __float_as_uint(s);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending with s
    return ((unsigned long long)(~u) << 32) | (unsigned)id;
}

// The exact cut among the gathered candidates (one block a row, their keys sorted in
// dynamic shared memory), or whole bins where there were too many to sort.
extern "C" __global__ void sample_settle(const float* bmax, int blocks, const unsigned long long* hist_mass,
                                         SampleCut* cut, const float* list_s,
                                         const int* list_id, int top_k, float top_p) {
    PDL_ENTRY();
    extern __shared__ float settle_smem[];
    unsigned long long* keys = reinterpret_cast<unsigned long long*>(settle_smem);
    __shared__ float red[32];
    int r = blockIdx.x;
    SampleCut* c = cut + r;
    float m = sample_max(bmax + (size_t)r * blocks, blocks, red);
    if (c->bin < 0) {
        if (threadIdx.x == 0) c->mode = CUT_NONE;
        return;
    }
    unsigned n = c->gathered;
    const unsigned long long* hm = hist_mass + (size_t)r * SAMPLE_BINS;
    if (n > SAMPLE_SORT_MAX) {
        if (threadIdx.x == 0) {
            int bin = c->bin;
            if (c->top_k_cut && top_p < 1.0f) {
                // Top-p over the whole bins up to top-k's.
                unsigned long long t = 0;
                for (int b = 0; b <= bin; b++) t += hm[b];
                unsigned long long goal = (unsigned long long)ceil((double)top_p * (double)t);
                unsigned long long acc = 0;
                for (int b = 0; b <= bin; b++) {
                    acc += hm[b];
                    if (acc >= goal) {
                        bin = b;
                        break;
                    }
                }
            }
            c->mode = CUT_BINS;
            c->bin = bin;
        }
        return;
    }
    int p2 = 1;
    while (p2 < (int)n) p2 *= 2;
    const float* ls = list_s + (size_t)r * SAMPLE_SORT_MAX;
    const int* li = list_id + (size_t)r * SAMPLE_SORT_MAX;
    for (int k = threadIdx.x; k < p2; k += blockDim.x)
        keys[k] = k < (int)n ? sample_key(ls[k], li[k]) : ~0ull;
    __syncthreads();
    // Bitonic sort, ascending.
    for (int size = 2; size <= p2; size *= 2) {
        for (int stride = size / 2; stride > 0; stride /= 2) {
            for (int k = threadIdx.x; k < p2; k += blockDim.x) {
                int j = k ^ stride;
                if (j > k) {
                    bool up = (k & size) == 0;
                    unsigned long long a = keys[k], b = keys[j];
                    if ((a > b) == up) {
                        keys[k] = b;
                        keys[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    if (threadIdx.x != 0) return;
    // The sorted candidates: their ids are the keys' low words; each weight again from s.
    auto id_at = [&](int k) { return (int)(unsigned)(keys[k] & 0xffffffffu); };
    auto s_at = [&](int k) {
        unsigned u = ~(unsigned)(keys[k] >> 32);
        u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
        return __uint_as_float(u);
    };
    int last;
    if (c->top_k_cut) {
        last = top_k - 1;
        if (top_p < 1.0f) {
            unsigned long long t = 0;
            for (int k = 0; k < top_k; k++) t += sample_weight(expf(s_at(k) - m));
            unsigned long long goal = (unsigned long long)ceil((double)top_p * (double)t);
            unsigned long long acc = 0;
            for (last = 0; last < top_k - 1; last++) {
                acc += sample_weight(expf(s_at(last) - m));
                if (acc >= goal) break;
            }
        }
    } else {
        unsigned long long acc = c->ahead;
        for (last = 0; last < (int)n - 1; last++) {
            acc += sample_weight(expf(s_at(last) - m));
            if (acc >= c->goal) break;
        }
    }
    c->mode = CUT_EXACT;
    c->tau_s = s_at(last);
    c->tau_id = id_at(last);
}

// The kept token with the largest s + Gumbel noise (the lower id on ties), written as bits
// to out[r * out_stride + at]; the last block of a row merges the blocks' bests. `cut` is
// null when every candidate is kept. Readies the histogram and the counts for the next
// step when `hist_count` is not null.
extern "C" __global__ void sample_draw(const float* s, const float* bmax, const SampleCut* cut,
                                       const unsigned* step, unsigned* out, int out_stride, int at,
                                       int vocab, int chunk, float min_p, unsigned seed_lo,
                                       unsigned seed_hi, unsigned* count, float* part,
                                       int* part_i, unsigned* hist_count,
                                       unsigned long long* hist_mass) {
    PDL_ENTRY();
    __shared__ float red[32];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int last;
    int r = blockIdx.y, lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
    int blocks = gridDim.x;
    float m = sample_max(bmax + (size_t)r * blocks, blocks, red);
    // The token goes to the position after the one the step feeds.
    unsigned long long pos = (unsigned long long)step[2 * r + 1] + 1;
    int mode = cut ? cut[r].mode : CUT_NONE;
    float tau_s = cut ? cut[r].tau_s : 0.0f;
    int tau_id = cut ? cut[r].tau_id : 0, tau_bin = cut ? cut[r].bin : 0;
    const float* row = s + (size_t)r * vocab;
    float v = NEG_INF;
    int i = 0x7fffffff;
    bool finite = true;
    for (int d = lo + threadIdx.x; d < hi; d += blockDim.x) {
        float x = row[d];
        if (isnan(x)) finite = false;
        if (min_p > 0.0f && !(expf(x - m) >= min_p)) continue;
        if (mode == CUT_EXACT && !(x > tau_s || (x == tau_s && d <= tau_id))) continue;
        if (mode == CUT_BINS && sample_bin(x, m) > tau_bin) continue;
        float g = x + sample_gumbel(seed_lo, seed_hi, pos, d);
        if (g > v || (g == v && d < i)) {
            v = g;
            i = d;
        }
    }
    bool spoilt = __syncthreads_or(!finite);
    block_argmax(v, i, sv, si);
    size_t base = (size_t)r * blocks;
    if (threadIdx.x == 0) {
        part[base + blockIdx.x] = v;
        part_i[base + blockIdx.x] = spoilt ? ROW_NOT_FINITE : i;
        __threadfence();
        last = atomicAdd(&count[r], 1u) == (unsigned)(blocks - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    v = NEG_INF;
    i = 0x7fffffff;
    finite = true;
    for (int k = threadIdx.x; k < blocks; k += blockDim.x) {
        float pv = __ldcg(part + base + k);
        int pi = __ldcg(part_i + base + k);
        if (pi == ROW_NOT_FINITE) finite = false;
        if (pv > v || (pv == v && pi < i)) {
            v = pv;
            i = pi;
        }
    }
    spoilt = __syncthreads_or(!finite);
    block_argmax(v, i, sv, si);
    if (threadIdx.x == 0) {
        out[(size_t)r * out_stride + at] = spoilt ? NOT_A_TOKEN : (unsigned)i;
        count[r] = 0;
    }
    if (hist_count) {
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
            hist_count[(size_t)r * SAMPLE_BINS + b] = 0;
            hist_mass[(size_t)r * SAMPLE_BINS + b] = 0;
        }
    }
}

// counts[r][token] += 1 for the token whose bits are out[r * out_stride + at]: the
// sequence holds it from the next step on.
extern "C" __global__ void count_token(float* counts, const unsigned* out, int out_stride,
                                       int at, int vocab) {
    PDL_ENTRY();
    int r = blockIdx.x;
    if (threadIdx.x == 0) counts[(size_t)r * vocab + out[(size_t)r * out_stride + at]] += 1.0f;
}

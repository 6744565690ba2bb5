// The routed VQ kernels (a MoE layer's experts at a VQ rung, routed on the device) run on
// the CPU through shim.h against a plain double-precision reference of their definition,
// on fresh random inputs with the outputs poisoned first. For each rung shape (values a
// codeword, bits an index) and each expert shape, both decode paths (CUDA cores and
// tensor cores), the book in shared memory and not, gate/up (SiLU · up per pair) and down
// (each token's pairs, weighted, in order). Exits non-zero when any case is off by more
// than 1e-4 relative (norm of the difference over norm of the reference). Every block gets
// the 227 KiB of shared memory an H200 block may opt into, poisoned with NaNs; the sizes
// the host asks for are pinned by the backend's unit tests. block_size and row_bytes
// restate codec::vq's for this C++ program.
#include "kernels_host.cpp"

#include <random>
#include <string>

namespace {

constexpr int ENTRY = 9;  // the backend's ROUTED_ENTRY: codes, norms, signs of 3 matrices
constexpr size_t OPT_IN_SHARED = 227 << 10;

std::mt19937_64 rng(7);

float normal() { return std::normal_distribution<float>(0.0f, 1.0f)(rng); }

int block_size(int cols) {
    int divisor = 1 << std::min(__builtin_ctz(cols), 10);
    if (divisor >= 256) return divisor;
    int p = 1;
    while (p < cols) p *= 2;
    return std::clamp(p, 16, 1024);
}

size_t row_bytes(int p, int k, int cols) {
    int b = block_size(cols);
    size_t vectors = (size_t)((cols + b - 1) / b) * b / p;
    return (vectors * k + 7) / 8;
}

// One VQ matrix as the device holds it: codes and norms padded by 16 bytes, signs as bits.
struct Matrix {
    int rows, cols, block, blocks;
    size_t rb;
    std::vector<unsigned char> codes;
    std::vector<unsigned short> norms;
    std::vector<unsigned> signs;

    Matrix(int rows, int cols, int p, int k) : rows(rows), cols(cols) {
        block = block_size(cols);
        blocks = (cols + block - 1) / block;
        rb = row_bytes(p, k, cols);
        codes.resize(rows * rb + 16);
        for (auto& c : codes) c = (unsigned char)rng();
        norms.resize((size_t)rows * blocks + 8);
        for (auto& n : norms) n = f16_bits(0.5f + std::abs(normal()));
        signs.resize((block + 31) / 32);
        for (auto& s : signs) s = (unsigned)rng();
    }

    unsigned index(int row, size_t vector, int k) const {
        size_t bit = (size_t)row * rb * 8 + vector * k;
        unsigned v = 0;
        for (int i = 0; i < k; i++) {
            size_t b = bit + i;
            v |= ((codes[b / 8] >> (b % 8)) & 1u) << i;
        }
        return v;
    }

    // y = W x by the definition: each block of x sign-flipped, Hadamard-transformed and
    // divided by √block, dotted with the row's codewords, scaled by norm / √block.
    std::vector<double> apply(const float* x, const std::vector<unsigned short>& book, int p,
                              int k) const {
        std::vector<double> xs((size_t)blocks * block, 0.0);
        for (int b = 0; b < blocks; b++) {
            double* v = &xs[(size_t)b * block];
            for (int i = 0; i < block && b * block + i < cols; i++) {
                bool minus = (signs[i / 32] >> (i % 32)) & 1u;
                v[i] = minus ? -x[b * block + i] : x[b * block + i];
            }
            for (int h = 1; h < block; h *= 2)
                for (int s = 0; s < block; s += 2 * h)
                    for (int i = s; i < s + h; i++) {
                        double a = v[i], c = v[i + h];
                        v[i] = a + c;
                        v[i + h] = a - c;
                    }
            for (int i = 0; i < block; i++) v[i] /= std::sqrt((double)block);
        }
        std::vector<double> y(rows);
        for (int o = 0; o < rows; o++) {
            double acc = 0.0;
            for (int b = 0; b < blocks; b++) {
                double d = 0.0;
                for (int i = 0; i < block; i += p) {
                    unsigned idx = index(o, ((size_t)b * block + i) / p, k);
                    for (int q = 0; q < p; q++)
                        d += half_bits(book[(size_t)idx * p + q]) * xs[(size_t)b * block + i + q];
                }
                acc += half_bits(norms[(size_t)o * blocks + b]) / std::sqrt((double)block) * d;
            }
            y[o] = acc;
        }
        return y;
    }
};

struct Expert {
    Matrix gate, up, down;
    Expert(int hidden, int inter, int p, int k)
        : gate(inter, hidden, p, k), up(inter, hidden, p, k), down(hidden, inter, p, k) {}
};

double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
    double d = 0.0, n = 0.0;
    for (size_t i = 0; i < want.size(); i++) {
        double e = std::isfinite(got[i]) ? got[i] - want[i] : INFINITY;
        d += e * e;
        n += want[i] * want[i];
    }
    return std::sqrt(d / std::max(n, 1e-30));
}

using GateUp = void (*)(const unsigned long long*, const int*, int, const float*, float*, int,
                        int, const unsigned short*, int, int, unsigned long long, int);
using GateUpCores = void (*)(const unsigned long long*, const int*, int, const float*,
                             const float*, float*, int, int, const unsigned short*, int, int,
                             unsigned long long, int);
using Down = void (*)(const unsigned long long*, const int*, const float*, int, const float*,
                      float*, int, int, const unsigned short*, int, int, unsigned long long, int);
using DownCores = void (*)(const unsigned long long*, const int*, const float*, int,
                           const float*, const float*, float*, int, int, const unsigned short*,
                           int, int, unsigned long long, int);

struct Kernels {
    GateUp gate_up_mma;
    Down down_mma;
    GateUpCores gate_up;
    DownCores down;
};

#define KERNELS(P)                                                                      \
    Kernels {                                                                           \
        routed_vq_gate_up_mma_p##P, routed_vq_down_mma_p##P, routed_vq_gate_up_p##P,    \
            routed_vq_down_p##P                                                         \
    }

Kernels kernels(int p) {
    switch (p) {
    case 4: return KERNELS(4);
    case 8: return KERNELS(8);
    default: return KERNELS(16);
    }
}

// One rung and expert shape: `tokens` tokens routed to `top_k` of `experts` experts.
double check(const char* rung, int p, int k, int hidden, int inter, int experts, int top_k,
             int tokens) {
    std::vector<unsigned short> book(((size_t)p << k) + 8);
    for (auto& v : book) v = f16_bits(normal());
    std::vector<Expert> ex;
    for (int e = 0; e < experts; e++) ex.emplace_back(hidden, inter, p, k);
    std::vector<unsigned long long> table;
    for (auto& e : ex)
        for (Matrix* m : {&e.gate, &e.up, &e.down}) {
            table.push_back((unsigned long long)m->codes.data());
            table.push_back((unsigned long long)m->norms.data());
            table.push_back((unsigned long long)m->signs.data());
        }
    int pairs = tokens * top_k;
    std::vector<int> ids(pairs);
    std::vector<float> weights(pairs);
    for (int t = 0; t < tokens; t++) {
        std::vector<int> all(experts);
        for (int e = 0; e < experts; e++) all[e] = e;
        std::shuffle(all.begin(), all.end(), rng);
        for (int q = 0; q < top_k; q++) {
            ids[t * top_k + q] = all[q];
            weights[t * top_k + q] = std::abs(normal());
        }
    }
    std::vector<float> x((size_t)tokens * hidden), h((size_t)pairs * inter);
    for (auto& v : x) v = normal();
    for (auto& v : h) v = normal();

    std::vector<double> want_h((size_t)pairs * inter), want_out((size_t)tokens * hidden, 0.0);
    for (int pr = 0; pr < pairs; pr++) {
        const Expert& e = ex[ids[pr]];
        const float* xt = &x[(size_t)(pr / top_k) * hidden];
        auto g = e.gate.apply(xt, book, p, k), u = e.up.apply(xt, book, p, k);
        for (int o = 0; o < inter; o++)
            want_h[(size_t)pr * inter + o] = g[o] / (1.0 + std::exp(-g[o])) * u[o];
        auto d = e.down.apply(&h[(size_t)pr * inter], book, p, k);
        for (int o = 0; o < hidden; o++)
            want_out[(size_t)(pr / top_k) * hidden + o] += weights[pr] * d[o];
    }

    Kernels f = kernels(p);
    const auto* tb = table.data();
    unsigned long long up_rb = row_bytes(p, k, hidden), down_rb = row_bytes(p, k, inter);
    int up_block = block_size(hidden), down_block = block_size(inter);
    double worst = 0.0;
    for (int mma = 0; mma < 2; mma++)
        for (int book_shared = 0; book_shared < 2; book_shared++) {
            std::vector<float> got_h(h.size(), NAN), got_out(want_out.size(), NAN);
            dim3 threads{512, 1, 1};
            shim::launch({(unsigned)(inter + 31) / 32, (unsigned)pairs, 1}, threads,
                         OPT_IN_SHARED, [&] {
                             if (mma)
                                 f.gate_up_mma(tb, ids.data(), top_k, x.data(), got_h.data(),
                                               inter, hidden, book.data(), k, up_block, up_rb,
                                               book_shared);
                             else
                                 f.gate_up(tb, ids.data(), top_k, x.data(), nullptr,
                                           got_h.data(), inter, hidden, book.data(), k,
                                           up_block, up_rb, book_shared);
                         });
            shim::launch({(unsigned)(hidden + 15) / 16, (unsigned)tokens, 1}, threads,
                         OPT_IN_SHARED, [&] {
                             if (mma)
                                 f.down_mma(tb, ids.data(), weights.data(), top_k, h.data(),
                                            got_out.data(), hidden, inter, book.data(), k,
                                            down_block, down_rb, book_shared);
                             else
                                 f.down(tb, ids.data(), weights.data(), top_k, h.data(), nullptr,
                                        got_out.data(), hidden, inter, book.data(), k,
                                        down_block, down_rb, book_shared);
                         });
            double eg = rel_err(got_h, want_h), ed = rel_err(got_out, want_out);
            std::printf("%-6s %5d x %-5d top-%d of %d, %s, book %s: gate/up %.2e, down %.2e\n",
                        rung, hidden, inter, top_k, experts,
                        mma ? "tensor cores" : "CUDA cores  ", book_shared ? "shared" : "global",
                        eg, ed);
            worst = std::max({worst, eg, ed});
        }
    return worst;
}

}  // namespace

int main() {
    struct Rung {
        const char* name;
        int p, k;
    };
    const Rung rungs[] = {{"vq1.5", 8, 12}, {"vq3", 4, 12}, {"vq0.7", 16, 11}, {"vq1", 8, 8}};
    // The small fixture's experts (256 x 80: down's rows one padded block of 128), and
    // Qwen3-30B-A3B's (2048 x 768), for two tokens.
    const int shapes[][4] = {{256, 80, 6, 4}, {2048, 768, 16, 8}};
    double worst = 0.0;
    for (const Rung& r : rungs)
        for (const auto& s : shapes)
            worst = std::max(worst, check(r.name, r.p, r.k, s[0], s[1], s[2], s[3], 2));
    std::printf("worst %.2e\n", worst);
    return worst < 1e-4 ? 0 : 1;
}

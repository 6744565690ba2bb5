// The dense affine one-row kernels and the routed VQ kernels (a MoE layer's experts at a
// VQ rung, routed on the device) run on the CPU through shim.h against a plain double-precision reference of their definition,
// on fresh random inputs with the outputs poisoned first. For each rung shape (values a
// codeword, bits an index) and each expert shape, both decode paths (CUDA cores and
// tensor cores), the book in shared memory and not, gate/up (SiLU · up per pair) and down
// (each token's pairs, weighted, in order). Exits non-zero when any case is off by more
// than 1e-4 relative (norm of the difference over norm of the reference). Every block gets
// the 227 KiB of shared memory an H200 block may opt into, poisoned with NaNs; the sizes
// the host asks for are pinned by the backend's unit tests. block_size and row_bytes
// restate codec::vq's for this C++ program.
#include "kernels_host.cpp"

#include <array>
#include <cstring>
#include <random>
#include <string>

namespace {

constexpr int ENTRY = 9;  // the backend's ROUTED_ENTRY: codes, norms, signs of 3 matrices
constexpr size_t OPT_IN_SHARED = 227 << 10;

std::mt19937_64 rng(7);

float normal() { return std::normal_distribution<float>(0.0f, 1.0f)(rng); }

// The bf16 of v (truncated: test inputs need only be bf16 values), and a bf16 widened.
unsigned short bf16_of(float v) {
    unsigned u;
    std::memcpy(&u, &v, 4);
    return (unsigned short)(u >> 16);
}
float bf16_value(unsigned short h) {
    unsigned u = (unsigned)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

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

// ---- Dense affine matrices of one input row (dense_mma_q*) ----

// Column of the code at word k, bit pair p, byte b of a 32-column chunk in seed 000's
// 2-bit layout (docs/FORMAT.md): even columns from the first half of the chunk's
// deinterleaved stream, odd ones from the second.
int chunk_column(int k, int p, int b) {
    return p < 2 ? 2 * (8 * k + 4 * p + b) : 2 * (8 * k + 4 * (p - 2) + b) + 1;
}

// One affine matrix as the device holds it: words, bf16 scales and biases per 64 columns.
struct Affine {
    int bits, rows, cols;
    std::vector<unsigned> words;
    std::vector<unsigned short> scales, biases;

    Affine(int bits, int rows, int cols) : bits(bits), rows(rows), cols(cols) {
        words.resize((size_t)rows * cols * bits / 32 + 4);
        for (auto& w : words) w = (unsigned)rng();
        for (int i = 0; i < rows * cols / 64; i++) {
            scales.push_back(bf16_of(0.01f * (1.0f + std::abs(normal()))));
            biases.push_back(bf16_of(0.05f * normal()));
        }
    }

    int code(int row, int col) const {
        int chunk = col / 32, j = col % 32;
        if (bits == 4) return (words[(size_t)row * cols / 8 + col / 8] >> (4 * (col % 8))) & 15;
        const unsigned* c = &words[(size_t)row * cols * bits / 32 + (size_t)chunk * bits];
        for (int k = 0; k < 2; k++)
            for (int p = 0; p < 4; p++)
                for (int b = 0; b < 4; b++)
                    if (chunk_column(k, p, b) == j) {
                        int up = (c[k] >> (8 * b + 2 * p)) & 3;
                        return bits == 2 ? up : 2 * up + ((c[2] >> (8 * b + 4 * k + p)) & 1);
                    }
        std::abort();
    }

    double value(int row, int col) const {
        double a = bits == 4 ? 1.0 : (bits == 3 ? 2.0 : 4.0);
        double o = bits == 4 ? 0.0 : (bits == 3 ? 0.5 : 1.5);
        size_t g = (size_t)row * (cols / 64) + col / 64;
        return (a * code(row, col) + o) * bf16_value(scales[g]) + bf16_value(biases[g]);
    }
};

// An affine matrix in unit tiles, as the backend uploads one for dense_mma_*tiled_q*
// (kernels/affine_mma.cu, load_unit_tiled): each unit's lane words, then each unit's scales and
// biases row by row; rows past the matrix are zeros.
struct Tiles {
    std::vector<unsigned> words;
    std::vector<unsigned short> sb;
};

Tiles tile_affine(const Affine& m) {
    int groups = m.cols / 64, tiles = (m.rows + 15) / 16, per = m.bits == 4 ? 4 : 2;
    size_t row_words = (size_t)m.cols * m.bits / 32;
    Tiles t;
    t.words.assign((size_t)tiles * groups * 32 * per, 0u);
    t.sb.assign((size_t)tiles * groups * 16 * 2, 0);
    for (int tile = 0; tile < tiles; tile++)
        for (int gi = 0; gi < groups; gi++) {
            size_t unit = (size_t)tile * groups + gi;
            for (int lane = 0; lane < 32; lane++)
                for (int half = 0; half < 2; half++) {
                    int r = tile * 16 + lane / 4 + 8 * half, q = lane % 4;
                    if (r >= m.rows) continue;
                    const unsigned* row = &m.words[r * row_words];
                    unsigned* dst = &t.words[(unit * 32 + lane) * per];
                    if (m.bits == 4) {
                        dst[2 * half] = row[gi * 8 + 2 * q];
                        dst[2 * half + 1] = row[gi * 8 + 2 * q + 1];
                    } else {
                        dst[half] = row[gi * 4 + q];
                    }
                }
            for (int r = 0; r < 16 && tile * 16 + r < m.rows; r++) {
                size_t g = (size_t)(tile * 16 + r) * groups + gi;
                t.sb[(unit * 16 + r) * 2] = m.scales[g];
                t.sb[(unit * 16 + r) * 2 + 1] = m.biases[g];
            }
        }
    return t;
}

// affine_tiles_from_rows (a slot's record taken into tiles on the device) against
// tile_affine, word for word, over outputs poisoned first; a grid smaller than the units
// so threads loop. Returns 0 when equal, 1 otherwise.
double check_tiles_from_rows(int bits, int rows, int cols) {
    Affine m(bits, rows, cols);
    Tiles want = tile_affine(m);
    Tiles got{std::vector<unsigned>(want.words.size(), 0xDEADBEEFu),
              std::vector<unsigned short>(want.sb.size(), 0xBEEF)};
    shim::launch({3, 1, 1}, {64, 1, 1}, 0, [&] {
        affine_tiles_from_rows(m.words.data(), m.scales.data(), m.biases.data(), rows, cols,
                               bits, got.words.data(), got.sb.data());
    });
    bool same = got.words == want.words && got.sb == want.sb;
    std::printf("tiles from rows q%d %4d x %4d: %s\n", bits, rows, cols, same ? "same" : "DIFFER");
    return same ? 0.0 : 1.0;
}

using DenseKernel = void (*)(const unsigned*, const unsigned short*, const unsigned short*,
                             float*, int, const unsigned*, const unsigned short*,
                             const unsigned short*, float*, int, const unsigned*,
                             const unsigned short*, const unsigned short*, float*, int, int,
                             const float*, int, int, int);
using DenseRowsKernel = void (*)(const unsigned*, const unsigned short*, const unsigned short*,
                                 float*, int, const unsigned*, const unsigned short*,
                                 const unsigned short*, float*, int, const unsigned*,
                                 const unsigned short*, const unsigned short*, float*, int, int,
                                 const float*, int, int, int, int);
using DenseNormKernel = void (*)(const unsigned*, const unsigned short*, const unsigned short*,
                                 float*, int, const unsigned*, const unsigned short*,
                                 const unsigned short*, float*, int, const unsigned*,
                                 const unsigned short*, const unsigned short*, float*, int, int,
                                 const float*, int, int, int, const float*, const float*, float,
                                 float*);

// What a one-row product reads as its input, with the residual add and norm the kernel may
// fold in: x as it is (ADD_NONE), RMSNorm(x)·w (ADD_NORM), or RMSNorm(x + delta)·w with
// the sum written (ADD_SUM). `input` is the row the product sees, in double. With
// `outliers`, a few channels of x are as large as real checkpoints' residuals get (10^5,
// past f16's range once through the norm's weights, before its 1/rms).
enum AddMode { ADD_NONE, ADD_NORM, ADD_SUM };
struct NormedRow {
    std::vector<float> x, delta, w;
    std::vector<double> input, sum;
    float eps = 1e-6f;

    NormedRow(int dim, AddMode mode, bool outliers = false)
        : x(dim), delta(dim, 0.0f), w(dim, 1.0f) {
        for (auto& v : x) v = normal();
        if (outliers)
            for (int d = 3; d < dim; d += 97) x[d] = (d % 2 ? 1e5f : -2e5f) * (1.0f + normal() * 0.1f);
        if (mode == ADD_SUM)
            for (auto& v : delta) v = normal();
        if (mode != ADD_NONE)
            for (auto& v : w) v = normal();
        double ss = 0.0;
        for (int d = 0; d < dim; d++) {
            sum.push_back((double)x[d] + delta[d]);
            ss += sum[d] * sum[d];
        }
        double inv = mode == ADD_NONE ? 1.0 : 1.0 / std::sqrt(ss / dim + eps);
        for (int d = 0; d < dim; d++) input.push_back(w[d] * sum[d] * inv);
    }
};

// `rows` of up to three matrices of `cols` columns times one row of `in_dim` values (read
// as zeros up to `cols`), split `parts` ways over a grid of `blocks` blocks; through the
// residual add and norm of `mode` (with `outliers`: NormedRow's), whose sum every block
// writes a slice of.
// With `tiled` (4 and 2 bits), the matrices in unit tiles (dense_mma_*tiled_q*). With
// `nrows` (1 to 4, x as it is), that many input rows at once through dense_mma_rows_*,
// each matrix's output `[nrows, rows]`.
double check_dense(int bits, std::vector<int> rows, int cols, int in_dim, int parts, int blocks,
                   AddMode mode = ADD_NONE, bool outliers = false, bool tiled = false,
                   int nrows = 0) {
    DenseRowsKernel several = bits == 4 ? (tiled ? dense_mma_rows_tiled_q4 : dense_mma_rows_q4)
                              : bits == 3 ? dense_mma_rows_q3
                                          : (tiled ? dense_mma_rows_tiled_q2 : dense_mma_rows_q2);
    DenseKernel plain = bits == 4 ? dense_mma_q4 : (bits == 3 ? dense_mma_q3 : dense_mma_q2);
    DenseNormKernel normed =
        bits == 4 ? dense_mma_norm_q4 : (bits == 3 ? dense_mma_norm_q3 : dense_mma_norm_q2);
    if (tiled) {
        plain = bits == 4 ? dense_mma_tiled_q4 : dense_mma_tiled_q2;
        normed = bits == 4 ? dense_mma_norm_tiled_q4 : dense_mma_norm_tiled_q2;
    }
    std::vector<Affine> mats;
    for (int r : rows) mats.emplace_back(bits, r, cols);
    std::vector<Tiles> tiles;
    for (auto& m : mats) tiles.push_back(tiled ? tile_affine(m) : Tiles{});
    NormedRow x(in_dim, mode, outliers);
    // The input rows: x, then (with nrows) fresh ones after it.
    std::vector<NormedRow> more;
    std::vector<float> xs = x.x;
    for (int r = 1; r < nrows; r++) {
        more.emplace_back(in_dim, mode, outliers);
        xs.insert(xs.end(), more.back().x.begin(), more.back().x.end());
    }
    auto input = [&](int r) -> const std::vector<double>& { return r == 0 ? x.input : more[r - 1].input; };
    std::vector<std::vector<float>> got;
    std::vector<double> want;
    std::vector<float> flat;
    for (auto& m : mats) {
        got.emplace_back((size_t)std::max(nrows, 1) * m.rows, NAN);
        for (int r = 0; r < std::max(nrows, 1); r++)
            for (int o = 0; o < m.rows; o++) {
                double acc = 0.0;
                for (int c = 0; c < in_dim; c++) acc += m.value(o, c) * input(r)[c];
                want.push_back(acc);
            }
    }
    std::vector<float> sum(in_dim, NAN);
    auto arg = [&](int i) -> const Affine& { return mats[std::min<size_t>(i, mats.size() - 1)]; };
    auto words = [&](int i) {
        size_t j = std::min<size_t>(i, mats.size() - 1);
        return tiled ? tiles[j].words.data() : mats[j].words.data();
    };
    auto scales = [&](int i) {
        size_t j = std::min<size_t>(i, mats.size() - 1);
        return tiled ? tiles[j].sb.data() : mats[j].scales.data();
    };
    auto out = [&](int i) { return got[std::min<size_t>(i, got.size() - 1)].data(); };
    auto live = [&](int i) { return i < (int)mats.size() ? mats[i].rows : 0; };
    // As the host's dense_mma_shared: the normed kernel adds a scale a group and the row
    // through the norm, from the next 16-byte boundary.
    size_t shared = (size_t)(cols / 64) * (80 * 4 + 4) + 8 * 2 * 16 * 4 +
                    (mode == ADD_NONE ? 0 : (size_t)(cols / 64 + cols) * 4 + 16);
    // dense_mma_rows_*: the rows' units, then partial sums of DMMA_ROWS rows.
    if (nrows > 0) shared = (size_t)nrows * (cols / 64) * (80 * 4 + 4) + 8 * 4 * 16 * 4;
    shim::launch({(unsigned)blocks, 1, 1}, {256, 1, 1}, shared, [&] {
#define DENSE_CHECK_ARGS                                                                        \
    words(0), scales(0), arg(0).biases.data(), out(0), live(0), words(1), scales(1),           \
        arg(1).biases.data(), out(1), live(1), words(2), scales(2), arg(2).biases.data(),      \
        out(2), live(2),                                                                       \
        (int)mats.size(), xs.data(), cols, in_dim, parts
        if (nrows > 0)
            several(DENSE_CHECK_ARGS, nrows);
        else if (mode == ADD_NONE)
            plain(DENSE_CHECK_ARGS);
        else
            normed(DENSE_CHECK_ARGS, mode == ADD_SUM ? x.delta.data() : nullptr, x.w.data(),
                   x.eps, mode == ADD_SUM ? sum.data() : nullptr);
#undef DENSE_CHECK_ARGS
    });
    for (auto& g : got) flat.insert(flat.end(), g.begin(), g.end());
    double e = rel_err(flat, want);
    if (mode == ADD_SUM) e = std::max(e, rel_err(sum, x.sum));
    std::printf("dense q%d%s, %d input row(s), %zu matrices of %d..%d rows x %d (x %d wide), %d parts, "
                "%d blocks, %s%s: %.2e\n",
                bits, tiled ? " in tiles" : "", std::max(nrows, 1), rows.size(), *std::min_element(rows.begin(), rows.end()),
                *std::max_element(rows.begin(), rows.end()), cols, in_dim, parts, blocks,
                mode == ADD_NONE ? "x as it is" : (mode == ADD_NORM ? "normed" : "added, normed"),
                outliers ? ", outliers" : "", e);
    return e;
}

// ---- The route of a row of router logits (moe_route, route_block) ----

// A route by its definition: softmax, the mask's kept share rescaled to one, the top_k
// best (ties to the lower id), renormalised when asked.
struct Route {
    std::vector<double> probs;   // every expert's, unmasked
    std::vector<int> ids;        // best first
    std::vector<double> weights;
};

// Router logits, distinct but for a few exact ties and two of the best on one score (so
// that the tie decides their places).
std::vector<float> route_logits(int experts) {
    std::vector<float> logits(experts);
    for (int e = 0; e < experts; e++) logits[e] = 0.25f * normal();
    for (int t = 0; t < experts / 8; t++) logits[rng() % experts] = logits[rng() % experts];
    if (experts > 2) logits[rng() % experts] = logits[rng() % experts] = 2.0f;
    return logits;
}

// The route by its definition, in double precision.
Route reference_route(const std::vector<float>& logits, const std::vector<unsigned char>& keep,
                      int top_k, bool renormalize) {
    int experts = (int)logits.size();
    double m = *std::max_element(logits.begin(), logits.end()), sum = 0.0, kept = 0.0;
    std::vector<double> p(experts), c(experts);
    for (int e = 0; e < experts; e++) sum += p[e] = std::exp((double)logits[e] - m);
    for (int e = 0; e < experts; e++) {
        p[e] /= sum;
        if (keep[e]) kept += p[e];
    }
    std::vector<int> order;
    for (int e = 0; e < experts; e++)
        if (keep[e]) order.push_back(e);
    for (int e : order) c[e] = p[e] / kept;
    // Equal logits give equal scores in any precision: ties go to the lower id.
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
    });
    Route r{p, {}, {}};
    double chosen = 0.0;
    for (int k = 0; k < top_k; k++) chosen += c[order[k]];
    for (int k = 0; k < top_k; k++) {
        r.ids.push_back(order[k]);
        r.weights.push_back(renormalize ? c[order[k]] / chosen : c[order[k]]);
    }
    return r;
}

// A row's route through moe_route with `threads` threads, against the definition.
// Returns the worst relative error of probabilities and weights; a wrong id is reported
// and fails.
double check_route(int experts, int top_k, int threads, bool masked, bool renormalize) {
    std::vector<float> logits = route_logits(experts);
    std::vector<unsigned char> keep(experts, 1);
    if (masked)
        for (int e = 0; e < experts; e++) keep[e] = (rng() % 3) != 0 || e < top_k;
    Route want = reference_route(logits, keep, top_k, renormalize);
    std::vector<float> probs = logits, got_w(top_k, NAN);
    std::vector<int> got_ids(top_k, -1);
    shim::launch({1, 1, 1}, {(unsigned)threads, 1, 1}, experts * 4 + 16, [&] {
        moe_route(probs.data(), masked ? keep.data() : nullptr, got_ids.data(), got_w.data(),
                  experts, top_k, renormalize);
    });
    bool ids_ok = got_ids == want.ids;
    double ep = rel_err(probs, want.probs), ew = rel_err(got_w, want.weights);
    // Chosen by the logits (route_by_logits, in the routed gate/up kernels): the same ids
    // and weights as moe_route's to the bit, and only the ids without `weights`.
    std::vector<float> logit_w(top_k, NAN), no_w(top_k, NAN);
    std::vector<int> logit_ids(top_k, -1), ids_only(top_k, -1);
    for (int weights = 0; weights < 2; weights++)
        shim::launch({1, 1, 1}, {(unsigned)threads, 1, 1}, experts * 4 + 16, [&] {
            float* cand = reinterpret_cast<float*>(shim::block_shared());
            static float scratch[32];
            route_by_logits(logits.data(), masked ? keep.data() : nullptr,
                            (weights ? logit_ids : ids_only).data(),
                            (weights ? logit_w : no_w).data(), experts, top_k, renormalize,
                            weights, cand, scratch);
        });
    bool by_logits = logit_ids == got_ids && ids_only == got_ids &&
                     std::memcmp(logit_w.data(), got_w.data(), got_w.size() * 4) == 0 &&
                     std::all_of(no_w.begin(), no_w.end(), [](float w) { return w != w; });
    std::printf("route top-%d of %d, %d threads, mask %d, renormalise %d: ids %s, probs %.2e, "
                "weights %.2e, by the logits: %s\n",
                top_k, experts, threads, masked, renormalize, ids_ok ? "same" : "DIFFER", ep, ew,
                by_logits ? "same bits" : "DIFFERENT");
    return ids_ok && by_logits ? std::max(ep, ew) : INFINITY;
}

// A router of `experts` bf16 rows `cols` wide, an input row and the logits in double
// precision, and (when `masked`) a mask that keeps at least the first top_k experts.
struct RouterCase {
    std::vector<unsigned short> w;
    std::vector<float> x, logits;
    std::vector<unsigned char> keep;

    RouterCase(int experts, int cols, int top_k, bool masked)
        : w((size_t)experts * cols), x(cols), logits(experts), keep(experts, 1) {
        for (auto& v : w) v = bf16_of(0.05f * normal());
        for (auto& v : x) v = normal();
        for (int e = 0; e < experts; e++) {
            double acc = 0.0;
            for (int c = 0; c < cols; c++)
                acc += (double)bf16_value(w[(size_t)e * cols + c]) * x[c];
            logits[e] = (float)acc;
        }
        if (masked)
            for (int e = 0; e < experts; e++) keep[e] = (rng() % 3) != 0 || e < top_k;
    }
};

// A decode step's router reading the post-attention norm it folds in
// (matvec_bf16_norm_one_late): the logits of bf16 rows `cols` wide, and the sum that its
// blocks write a slice each of.
double check_router_norm(int experts, int cols, AddMode mode, bool outliers = false) {
    RouterCase r(experts, cols, 1, false);
    NormedRow x(cols, mode, outliers);
    std::vector<double> want(experts);
    for (int e = 0; e < experts; e++) {
        double acc = 0.0;
        for (int c = 0; c < cols; c++) acc += (double)bf16_value(r.w[(size_t)e * cols + c]) * x.input[c];
        want[e] = acc;
    }
    std::vector<float> logits(experts, NAN), sum(cols, NAN);
    int rows_a_block = 8 / mv_one_parts(cols);
    unsigned blocks = (unsigned)((experts + rows_a_block - 1) / rows_a_block);
    shim::launch({blocks, 1, 1}, {256, 1, 1}, (size_t)cols * 4, [&] {
        matvec_bf16_norm_one_late(r.w.data(), x.x.data(),
                                  mode == ADD_SUM ? x.delta.data() : nullptr, x.w.data(), x.eps,
                                  mode == ADD_SUM ? sum.data() : nullptr, logits.data(), experts,
                                  cols);
    });
    double e = rel_err(logits, want);
    if (mode == ADD_SUM) e = std::max(e, rel_err(sum, x.sum));
    std::printf("router of the norm %d x %d, %u blocks, %s%s: %.2e\n", experts, cols, blocks,
                mode == ADD_SUM ? "added, normed" : "normed", outliers ? ", outliers" : "", e);
    return e;
}

// ---- A decode step's attention: attn_preamble_at, attention_group_*, attention_combine ----

// One query head `qr` attending over positions lo..p of the caches `kc` and `vc` (rows
// `kvw` wide, the head's KV head `kvh`), in double precision: the softmax-weighted values
// added into `out` (head_dim of them).
template <typename Q>
void reference_head(const Q* qr, const std::vector<double>& kc, const std::vector<double>& vc,
                    int kvw, int kvh, int head_dim, int lo, int p, double* out) {
    std::vector<double> sc(p + 1 - lo);
    double m = -INFINITY, l = 0.0;
    for (int t = lo; t <= p; t++) {
        double d = 0.0;
        for (int i = 0; i < head_dim; i++) d += (double)qr[i] * kc[(size_t)t * kvw + kvh * head_dim + i];
        sc[t - lo] = d / std::sqrt((double)head_dim);
        m = std::max(m, sc[t - lo]);
    }
    for (auto& x : sc) l += (x = std::exp(x - m));
    for (int t = lo; t <= p; t++)
        for (int i = 0; i < head_dim; i++)
            out[i] += sc[t - lo] / l * vc[(size_t)t * kvw + kvh * head_dim + i];
}

// Heads of `head_dim` at position p: q and k per-head normed (when `normed`) and rotated,
// k and v into the caches' row p, then each query head's softmax over the keys its window
// sees, against a double-precision reference. The caches' row p starts as NaNs, and the
// other rows must come back as they were. Each attention block finds q and the caches'
// row p poisoned until its launch wait (shim::Predecessor), as they are while the
// preamble still runs. With `early`, the preamble is late and the attention loads its
// keys and values before its wait.
double check_attention_step(int heads, int kv_heads, int head_dim, int p, int capacity,
                            int window, int chunk, bool normed, bool early = false) {
    int kvw = kv_heads * head_dim, half = head_dim / 2, group = heads / kv_heads;
    auto fresh = [](size_t n) {
        std::vector<float> x(n);
        for (auto& v : x) v = normal();
        return x;
    };
    std::vector<float> q = fresh((size_t)heads * head_dim), k = fresh(kvw), v = fresh(kvw);
    std::vector<float> qn = fresh(head_dim), kn = fresh(head_dim), inv_freq(half);
    for (int i = 0; i < half; i++) inv_freq[i] = (float)std::pow(1e6, -2.0 * i / head_dim);
    std::vector<float> kc = fresh((size_t)capacity * kvw), vc = fresh((size_t)capacity * kvw);
    for (int i = 0; i < kvw; i++) kc[(size_t)p * kvw + i] = vc[(size_t)p * kvw + i] = NAN;
    const std::vector<float> kc0 = kc, vc0 = vc;
    const float eps = 1e-6f;

    // The reference: normed and rotated heads, the caches with row p, the softmax.
    auto head = [&](const float* x, const float* w) {
        std::vector<double> y(head_dim);
        double ss = 0.0;
        for (int i = 0; i < head_dim; i++) ss += (double)x[i] * x[i];
        double inv = 1.0 / std::sqrt(ss / head_dim + eps);
        for (int i = 0; i < head_dim; i++) y[i] = w ? w[i] * (x[i] * inv) : x[i];
        std::vector<double> r(head_dim);
        for (int i = 0; i < half; i++) {
            double a = (double)p * inv_freq[i], cs = std::cos(a), sn = std::sin(a);
            r[i] = y[i] * cs - y[i + half] * sn;
            r[i + half] = y[i + half] * cs + y[i] * sn;
        }
        return r;
    };
    std::vector<double> want_kc(kc0.begin(), kc0.end()), want_vc(vc0.begin(), vc0.end());
    for (int h = 0; h < kv_heads; h++) {
        auto kr = head(&k[(size_t)h * head_dim], normed ? kn.data() : nullptr);
        for (int i = 0; i < head_dim; i++) {
            want_kc[(size_t)p * kvw + h * head_dim + i] = kr[i];
            want_vc[(size_t)p * kvw + h * head_dim + i] = v[(size_t)h * head_dim + i];
        }
    }
    int lo = window > 0 ? std::max(0, p + 1 - window) : 0;
    std::vector<double> want_out((size_t)heads * head_dim, 0.0);
    for (int h = 0; h < heads; h++) {
        auto qr = head(&q[(size_t)h * head_dim], normed ? qn.data() : nullptr);
        reference_head(qr.data(), want_kc, want_vc, kvw, h / group, head_dim, lo, p,
                       &want_out[(size_t)h * head_dim]);
    }

    // The kernels, grid as the backend sizes it (the splits follow the capacity).
    int tiles = (group + ATT_GROUP - 1) / ATT_GROUP, splits = (capacity + chunk - 1) / chunk;
    std::vector<float> acc((size_t)heads * splits * head_dim, NAN), ml((size_t)heads * splits * 2, NAN);
    std::vector<float> out((size_t)heads * head_dim, NAN);
    unsigned pos = (unsigned)p;
    const dim3 grid{(unsigned)(kv_heads * tiles), (unsigned)splits, 1};
    unsigned threads = std::clamp((half + 31) / 32 * 32, 32, 256);
    shim::launch({(unsigned)(heads + 2 * kv_heads), 1, 1}, {threads, 1, 1}, 0, [&] {
        attn_preamble_at(q.data(), k.data(), v.data(), normed ? qn.data() : nullptr,
                         normed ? kn.data() : nullptr, eps, &pos, inv_freq.data(), kc.data(),
                         vc.data(), heads, kv_heads, head_dim, early ? 1 : 0);
    });
    // What the preamble writes that attention reads: q, and row p of each cache.
    const std::vector<float> q_done = q, kc_done = kc, vc_done = vc;
    size_t row = (size_t)p * kvw;
    shim::Predecessor pre{[&] {
                              std::fill(q.begin(), q.end(), NAN);
                              std::fill_n(kc.begin() + row, kvw, NAN);
                              std::fill_n(vc.begin() + row, kvw, NAN);
                          },
                          [&] {
                              q = q_done;
                              std::copy_n(kc_done.begin() + row, kvw, kc.begin() + row);
                              std::copy_n(vc_done.begin() + row, kvw, vc.begin() + row);
                          }};
    auto group_kernel = head_dim <= 64    ? attention_group_64
                        : head_dim <= 128 ? attention_group_128
                                          : attention_group_256;
    shim::predecessor = &pre;
    shim::launch(grid, {ATT_THREADS, 1, 1}, 0, [&] {
        group_kernel(q.data(), kc.data(), vc.data(), acc.data(), ml.data(), 0, heads, kv_heads,
                     head_dim, window, &pos, chunk, early ? 1 : 0);
    });
    shim::predecessor = nullptr;
    shim::launch({(unsigned)heads, 1, 1}, {COMBINE_THREADS, 1, 1}, 0, [&] {
        attention_combine(acc.data(), ml.data(), out.data(), splits, head_dim);
    });
    double e = std::max({rel_err(out, want_out), rel_err(kc, want_kc), rel_err(vc, want_vc)});
    std::printf("attention %s %d/%d x %d @%d of %d, window %d, chunk %d, norm %d: %.2e\n",
                early ? "late preamble, early group" : "preamble, group", heads, kv_heads, head_dim, p, capacity,
                window, chunk, normed, e);
    return e;
}

// ---- Several sequences' decode rows: cache_write_rows, attention_group_rows_*, combine ----

// `positions.size()` rows, row r at positions[r] in caches of its own (capacities[r]
// positions, their rows past the position NaN): each row's k and v into its caches at its
// position, then each row's attention over its own keys, against a double-precision
// reference. The caches' other rows must come back as they were, and no row may read
// another's. The splits follow the largest capacity, as the backend sizes them.
double check_attention_rows(int heads, int kv_heads, int head_dim, std::vector<int> positions,
                            std::vector<int> capacities, int window, int chunk) {
    int rows = (int)positions.size(), kvw = kv_heads * head_dim, group = heads / kv_heads;
    auto fresh = [](size_t n) {
        std::vector<float> x(n);
        for (auto& v : x) v = normal();
        return x;
    };
    std::vector<float> q = fresh((size_t)rows * heads * head_dim);
    std::vector<float> k = fresh((size_t)rows * kvw), v = fresh((size_t)rows * kvw);
    std::vector<std::vector<float>> kc(rows), vc(rows);
    std::vector<unsigned long long> table(3 * rows);
    int widest = 0;
    for (int r = 0; r < rows; r++) {
        int p = positions[r], cap = capacities[r];
        widest = std::max(widest, cap);
        kc[r] = fresh((size_t)cap * kvw);
        vc[r] = fresh((size_t)cap * kvw);
        for (size_t i = (size_t)p * kvw; i < (size_t)cap * kvw; i++) kc[r][i] = vc[r][i] = NAN;
        table[3 * r] = (unsigned long long)kc[r].data();
        table[3 * r + 1] = (unsigned long long)vc[r].data();
        table[3 * r + 2] = (unsigned long long)p;
    }
    // The reference: each row's caches with its new row, then its heads' softmax.
    std::vector<std::vector<double>> want_kc(rows), want_vc(rows);
    std::vector<double> want_out((size_t)rows * heads * head_dim, 0.0);
    for (int r = 0; r < rows; r++) {
        int p = positions[r];
        want_kc[r].assign(kc[r].begin(), kc[r].end());
        want_vc[r].assign(vc[r].begin(), vc[r].end());
        for (int i = 0; i < kvw; i++) {
            want_kc[r][(size_t)p * kvw + i] = k[(size_t)r * kvw + i];
            want_vc[r][(size_t)p * kvw + i] = v[(size_t)r * kvw + i];
        }
        int lo = window > 0 ? std::max(0, p + 1 - window) : 0;
        for (int h = 0; h < heads; h++)
            reference_head(&q[((size_t)r * heads + h) * head_dim], want_kc[r], want_vc[r], kvw,
                           h / group, head_dim, lo, p,
                           &want_out[((size_t)r * heads + h) * head_dim]);
    }
    int tiles = (group + ATT_GROUP - 1) / ATT_GROUP, splits = (widest + chunk - 1) / chunk;
    std::vector<float> acc((size_t)rows * heads * splits * head_dim, NAN);
    std::vector<float> ml((size_t)rows * heads * splits * 2, NAN);
    std::vector<float> out((size_t)rows * heads * head_dim, NAN);
    shim::launch({(unsigned)rows, 1, 1}, {256, 1, 1}, 0,
                 [&] { cache_write_rows(k.data(), v.data(), table.data(), kvw); });
    auto rows_kernel = head_dim <= 64    ? attention_group_rows_64
                       : head_dim <= 128 ? attention_group_rows_128
                                         : attention_group_rows_256;
    const dim3 grid{(unsigned)(kv_heads * tiles), (unsigned)splits, (unsigned)rows};
    shim::launch(grid, {ATT_THREADS, 1, 1}, 0, [&] {
        rows_kernel(q.data(), table.data(), acc.data(), ml.data(), heads, kv_heads, head_dim,
                    window, chunk);
    });
    shim::launch({(unsigned)(rows * heads), 1, 1}, {COMBINE_THREADS, 1, 1}, 0, [&] {
        attention_combine(acc.data(), ml.data(), out.data(), splits, head_dim);
    });
    double e = rel_err(out, want_out);
    for (int r = 0; r < rows; r++) {
        // Up to the position against the reference; past it, the NaNs left as they were.
        size_t n = (size_t)(positions[r] + 1) * kvw;
        std::vector<float> got_k(kc[r].begin(), kc[r].begin() + n), got_v(vc[r].begin(), vc[r].begin() + n);
        std::vector<double> wk(want_kc[r].begin(), want_kc[r].begin() + n), wv(want_vc[r].begin(), want_vc[r].begin() + n);
        e = std::max({e, rel_err(got_k, wk), rel_err(got_v, wv)});
        for (size_t i = n; i < kc[r].size(); i++)
            if (!std::isnan(kc[r][i]) || !std::isnan(vc[r][i])) e = std::max(e, 1.0);
    }
    std::printf("attention rows %d/%d x %d, %d rows, window %d, chunk %d: %.2e\n", heads,
                kv_heads, head_dim, rows, window, chunk, e);
    return e;
}

// ---- A decode step's routed affine experts (routed_mma_gate_up_q*, routed_mma_down_q*) ----

using AffineGateUp = void (*)(const unsigned long long*, const float*, const unsigned char*, int,
                              int, int*, float*, int, const float*, float*, int, int, int, int,
                              const float*, const float*, float, unsigned*);
using AffineDown = void (*)(const unsigned long long*, const int*, const float*, int,
                            const float*, float*, int, int, int, float*, int, unsigned*);

// A MoE layer's affine experts (gate, up: inter × hidden; down: hidden × down_cols, its
// input padded past inter as stores pad it) and the device's table of their pointers
// (ROUTED_ENTRY a expert).
struct AffineExperts {
    std::vector<std::array<Affine, 3>> ex;
    std::vector<unsigned long long> table;
    // With tile(): each matrix in unit tiles, and the table of those (words, the tiles'
    // scales and biases twice), as the routed tiled kernels read them.
    std::vector<Tiles> tiles;
    std::vector<unsigned long long> tiled_table;

    void tile() {
        tiles.reserve(ex.size() * 3);
        for (auto& e : ex)
            for (auto& m : e) {
                tiles.push_back(tile_affine(m));
                tiled_table.push_back((unsigned long long)tiles.back().words.data());
                tiled_table.push_back((unsigned long long)tiles.back().sb.data());
                tiled_table.push_back((unsigned long long)tiles.back().sb.data());
            }
    }

    AffineExperts(int bits, int hidden, int inter, int experts, int down_cols = 0) {
        for (int e = 0; e < experts; e++)
            ex.push_back({Affine(bits, inter, hidden), Affine(bits, inter, hidden),
                          Affine(bits, hidden, down_cols ? down_cols : inter)});
        for (auto& e : ex)
            for (auto& m : e) {
                table.push_back((unsigned long long)m.words.data());
                table.push_back((unsigned long long)m.scales.data());
                table.push_back((unsigned long long)m.biases.data());
            }
    }

    static double product(const Affine& m, const float* v, int o) {
        double acc = 0.0;
        for (int c = 0; c < m.cols; c++) acc += m.value(o, c) * v[c];
        return acc;
    }

    // SiLU(gate) · up of x for each routed expert, [top_k][inter].
    std::vector<double> gate_up(const Route& r, const std::vector<float>& x, int inter) const {
        std::vector<double> h(r.ids.size() * inter);
        for (size_t k = 0; k < r.ids.size(); k++)
            for (int o = 0; o < inter; o++) {
                const auto& e = ex[r.ids[k]];
                double g = product(e[0], x.data(), o), u = product(e[1], x.data(), o);
                h[k * inter + o] = g / (1.0 + std::exp(-g)) * u;
            }
        return h;
    }

    // Σ_k weight_k · down_k(h_k), [hidden].
    std::vector<double> down(const Route& r, const std::vector<float>& h, int hidden,
                             int inter) const {
        std::vector<double> out(hidden, 0.0);
        for (size_t k = 0; k < r.ids.size(); k++)
            for (int o = 0; o < hidden; o++)
                out[o] += r.weights[k] * product(ex[r.ids[k]][2], &h[k * inter], o);
        return out;
    }
};

// One token routed to top_k of `experts` affine experts (hidden × inter), the route taken
// inside the gate/up kernel from the router logits, the probabilities written by the down
// kernel: ids, weights, SiLU · up per pair and the weighted sum against the definition.
// At 4 and 2 bits the experts are in unit tiles (routed_mma_*_tiled_q*), at 3 in rows.
double check_routed_affine(int bits, int hidden, int inter, int experts, int top_k) {
    bool tiled = bits != 3;
    AffineGateUp gate_up = bits == 4   ? routed_mma_gate_up_tiled_q4
                           : bits == 3 ? routed_mma_gate_up_q3
                                       : routed_mma_gate_up_tiled_q2;
    AffineDown down = bits == 4   ? routed_mma_down_tiled_q4
                      : bits == 3 ? routed_mma_down_q3
                                  : routed_mma_down_tiled_q2;
    AffineExperts ex(bits, hidden, inter, experts);
    if (tiled) ex.tile();
    const auto& table = tiled ? ex.tiled_table : ex.table;
    std::vector<float> logits = route_logits(experts), x(hidden);
    for (auto& v : x) v = normal();
    std::vector<unsigned char> keep(experts, 1);
    Route want = reference_route(logits, keep, top_k, true);
    std::vector<double> want_h = ex.gate_up(want, x, inter);
    std::vector<float> got_h(want_h.size(), NAN), got_out(hidden, NAN), probs = logits;
    std::vector<float> got_w(top_k, NAN);
    std::vector<int> got_ids(top_k, -1);
    size_t up_shared = (size_t)(hidden / 64) * (80 * 4 + 4) + 8 * 2 * 16 * 4;
    size_t down_shared = (size_t)(top_k * inter / 64) * (80 * 4 + 4) + 8 * 2 * 16 * 4;
    shim::launch({(unsigned)(inter + 15) / 16, (unsigned)top_k, 1}, {256, 1, 1}, up_shared, [&] {
        gate_up(table.data(), probs.data(), nullptr, experts, 1, got_ids.data(), got_w.data(),
                top_k, x.data(), got_h.data(), inter, hidden, hidden, 0, nullptr, nullptr, 0.0f, nullptr);
    });
    // Down reads the reference's h, so that its error is its own.
    std::vector<float> h(want_h.begin(), want_h.end());
    std::vector<double> want_out = ex.down(want, h, hidden, inter);
    const dim3 down_grid{(unsigned)(hidden + 15) / 16, 1, 1};
    const dim3 down_block{RMMA_DOWN_WARPS * 32, 1, 1};
    shim::launch(down_grid, down_block, down_shared, [&] {
        down(table.data(), got_ids.data(), got_w.data(), top_k, h.data(), got_out.data(), hidden,
             inter, inter, probs.data(), experts, nullptr);
    });
    // Down started before its wait (`ready`): gate/up raises ready[0] once it has written
    // the route; down's blocks load their words on it, read h only after their wait (h
    // poisoned until then), and the last lowers the flag and the count for the next
    // launch. The same ids, probabilities and output, to the bit.
    std::vector<unsigned> ready = {0, 0};
    std::vector<float> ready_logits = logits, ready_h(want_h.size(), NAN), ready_w(top_k, NAN);
    std::vector<float> ready_out(hidden, NAN), h_late(h.size(), NAN);
    std::vector<int> ready_ids(top_k, -1);
    shim::launch({(unsigned)(inter + 15) / 16, (unsigned)top_k, 1}, {256, 1, 1}, up_shared, [&] {
        gate_up(table.data(), ready_logits.data(), nullptr, experts, 1, ready_ids.data(),
                ready_w.data(), top_k, x.data(), ready_h.data(), inter, hidden, hidden, 0,
                nullptr, nullptr, 0.0f, ready.data());
    });
    bool raised = ready[0] == 1 && ready[1] == 0;
    shim::Predecessor gate_up_before{[&] { std::fill(h_late.begin(), h_late.end(), NAN); },
                                     [&] { h_late = h; }};
    shim::predecessor = &gate_up_before;
    shim::launch(down_grid, down_block, down_shared, [&] {
        down(table.data(), ready_ids.data(), ready_w.data(), top_k, h_late.data(),
             ready_out.data(), hidden, inter, inter, ready_logits.data(), experts, ready.data());
    });
    shim::predecessor = nullptr;
    bool same_ready = raised && ready[0] == 0 && ready[1] == 0 && ready_ids == got_ids &&
                      std::memcmp(ready_out.data(), got_out.data(), got_out.size() * 4) == 0 &&
                      std::memcmp(ready_logits.data(), probs.data(), probs.size() * 4) == 0;
    bool ids_ok = got_ids == want.ids;
    double ew = rel_err(got_w, want.weights), ep = rel_err(probs, want.probs);
    double eh = rel_err(got_h, want_h), eo = rel_err(got_out, want_out);
    // Routed before (moe_route, for more experts than a block routes): both kernels read
    // the ids, and give the same bits.
    std::vector<float> again_h(want_h.size(), NAN), again_out(hidden, NAN);
    shim::launch({(unsigned)(inter + 15) / 16, (unsigned)top_k, 1}, {256, 1, 1}, up_shared, [&] {
        gate_up(table.data(), nullptr, nullptr, experts, 1, got_ids.data(), got_w.data(), top_k,
                x.data(), again_h.data(), inter, hidden, hidden, 0, nullptr, nullptr, 0.0f, nullptr);
    });
    shim::launch(down_grid, down_block, down_shared, [&] {
        down(table.data(), got_ids.data(), got_w.data(), top_k, h.data(), again_out.data(),
             hidden, inter, inter, nullptr, experts, nullptr);
    });
    // Gate/up started early (after matvec_bf16_one_late): x staged and the table copied
    // into shared memory beside the units before the wait, the logits (the router's
    // output) poisoned until each block's wait.
    std::vector<float> early_h(want_h.size(), NAN), early_w(top_k, NAN);
    std::vector<int> early_ids(top_k, -1);
    std::vector<float> router_out = logits;
    shim::Predecessor router{[&] { std::fill(router_out.begin(), router_out.end(), NAN); },
                             [&] { router_out = logits; }};
    size_t early_shared = (up_shared + 7) / 8 * 8 + (size_t)experts * GATE_UP_POINTERS * 8;
    shim::predecessor = &router;
    shim::launch({(unsigned)(inter + 15) / 16, (unsigned)top_k, 1}, {256, 1, 1}, early_shared, [&] {
        gate_up(table.data(), router_out.data(), nullptr, experts, 1, early_ids.data(),
                early_w.data(), top_k, x.data(), early_h.data(), inter, hidden, hidden, 1, nullptr,
                nullptr, 0.0f, nullptr);
    });
    // Early, reading its row through the post-attention norm (the router folds it in):
    // the residual, the delta and the norm's weights, outlier channels among them; the
    // route is the same, h is within rounding of the reference on the normed row.
    NormedRow row(hidden, ADD_SUM, true);
    std::vector<float> normed(row.input.begin(), row.input.end());
    std::vector<double> want_normed_h = ex.gate_up(want, normed, inter);
    std::vector<float> normed_h(want_h.size(), NAN), normed_w(top_k, NAN);
    std::vector<int> normed_ids(top_k, -1);
    shim::launch({(unsigned)(inter + 15) / 16, (unsigned)top_k, 1}, {256, 1, 1},
                 early_shared + (size_t)hidden * 4 + 16, [&] {
        gate_up(table.data(), router_out.data(), nullptr, experts, 1, normed_ids.data(),
                normed_w.data(), top_k, row.x.data(), normed_h.data(), inter, hidden, hidden, 1,
                row.delta.data(), row.w.data(), row.eps, nullptr);
    });
    shim::predecessor = nullptr;
    double en = normed_ids == want.ids ? rel_err(normed_h, want_normed_h) : INFINITY;
    bool same = std::memcmp(again_h.data(), got_h.data(), got_h.size() * 4) == 0 &&
                std::memcmp(again_out.data(), got_out.data(), got_out.size() * 4) == 0;
    bool same_early = early_ids == got_ids &&
                      std::memcmp(early_w.data(), got_w.data(), got_w.size() * 4) == 0 &&
                      std::memcmp(early_h.data(), got_h.data(), got_h.size() * 4) == 0;
    std::printf("routed q%d%s %d x %d, top-%d of %d: ids %s, weights %.2e, probs %.2e, gate/up "
                "%.2e, down %.2e, routed before: %s, early: %s, early through the norm %.2e, "
                "down early: %s\n",
                bits, tiled ? " in tiles" : "", hidden, inter, top_k, experts, ids_ok ? "same" : "DIFFER", ew, ep, eh, eo,
                same ? "same bits" : "DIFFERENT", same_early ? "same bits" : "DIFFERENT", en,
                same_ready ? "same bits" : "DIFFERENT");
    return ids_ok && same && same_early && same_ready
               ? std::max({ew, ep, eh, eo, en})
               : INFINITY;
}

// ---- A prompt's grouped expert GEMMs (expert_mma_gate_up_q*, expert_mma_down_q*) ----

using GemmGateUp = void (*)(const unsigned long long*, const unsigned*, const unsigned*,
                            const unsigned*, const float*, float*, int, int, int);
using GemmDown = void (*)(const unsigned long long*, const unsigned*, const unsigned*,
                          const unsigned*, const float*, const float*, float*, int, int, int);

// `rows` input rows each routed to `top_k` distinct experts of `experts` (hidden × inter;
// down's input padded to down_cols), grouped by expert as moe_group_pairs leaves them:
// a GROUP_ENTRY table (the expert's nine pointers, its first grouped pair and count),
// each grouped pair's row and weight, and (group, first pair) tiles of MMA_BM pairs.
// Gate/up (SiLU · up a grouped pair) and down (each pair's weighted output added into its
// row) against the definition; down reads the reference's h so its error is its own.
// With `tiled` (4 and 2 bits) the experts are in unit tiles, and both outputs must be the
// row-major kernels' to the bit.
double check_expert_gemm(int bits, int hidden, int inter, int down_cols, int experts,
                         int rows, int top_k, bool tiled) {
    AffineExperts ex(bits, hidden, inter, experts, down_cols);
    ex.tile();
    std::vector<float> x((size_t)rows * hidden);
    for (auto& v : x) v = normal();
    // Each row's experts: a random draw of top_k, each with a positive weight.
    std::vector<std::vector<std::pair<int, float>>> by_expert(experts);
    for (int r = 0; r < rows; r++) {
        std::vector<int> ids(experts);
        for (int e = 0; e < experts; e++) ids[e] = e;
        std::shuffle(ids.begin(), ids.end(), rng);
        for (int k = 0; k < top_k; k++)
            by_expert[ids[k]].push_back({r, 0.1f + std::abs(normal())});
    }
    auto run = [&](bool in_tiles, std::vector<float>& h, std::vector<float>& out,
                   const std::vector<float>& h_in) {
        const auto& experts_table = in_tiles ? ex.tiled_table : ex.table;
        std::vector<unsigned long long> table;
        std::vector<unsigned> pair_rows, tiles;
        std::vector<float> scales;
        int g = 0;
        for (int e = 0; e < experts; e++) {
            if (by_expert[e].empty()) continue;
            for (int i = 0; i < ROUTED_ENTRY; i++) table.push_back(experts_table[e * ROUTED_ENTRY + i]);
            table.push_back(pair_rows.size());
            table.push_back(by_expert[e].size());
            for (size_t first = 0; first < by_expert[e].size(); first += MMA_BM)
                tiles.insert(tiles.end(), {(unsigned)g, (unsigned)first});
            for (auto [r, w] : by_expert[e]) {
                pair_rows.push_back(r);
                scales.push_back(w);
            }
            g++;
        }
        GemmGateUp gate_up = bits == 4 ? (in_tiles ? expert_mma_gate_up_tiled_q4 : expert_mma_gate_up_q4)
                             : bits == 3 ? expert_mma_gate_up_q3
                                         : (in_tiles ? expert_mma_gate_up_tiled_q2 : expert_mma_gate_up_q2);
        GemmDown down = bits == 4 ? (in_tiles ? expert_mma_down_tiled_q4 : expert_mma_down_q4)
                        : bits == 3 ? expert_mma_down_q3
                                    : (in_tiles ? expert_mma_down_tiled_q2 : expert_mma_down_q2);
        unsigned n_tiles = tiles.size() / 2;
        shim::launch({(unsigned)(inter + MMA_BN - 1) / MMA_BN, n_tiles, 1}, {128, 1, 1}, 0, [&] {
            gate_up(table.data(), tiles.data(), nullptr, pair_rows.data(), x.data(), h.data(), inter,
                    hidden, hidden);
        });
        // The down GEMM adds into its rows: they start at zero, as the backend fills them.
        std::fill(out.begin(), out.end(), 0.0f);
        shim::launch({(unsigned)(hidden + MMA_BN - 1) / MMA_BN, n_tiles, 1}, {128, 1, 1}, 0, [&] {
            down(table.data(), tiles.data(), nullptr, pair_rows.data(), scales.data(), h_in.data(),
                 out.data(), hidden, down_cols, inter);
        });
        return pair_rows;
    };
    size_t pairs = (size_t)rows * top_k;
    std::vector<double> want_h(pairs * inter), want_out((size_t)rows * hidden, 0.0);
    {
        size_t p = 0;
        for (int e = 0; e < experts; e++)
            for (auto [r, w] : by_expert[e]) {
                const float* xr = &x[(size_t)r * hidden];
                for (int o = 0; o < inter; o++) {
                    double gv = AffineExperts::product(ex.ex[e][0], xr, o);
                    double uv = AffineExperts::product(ex.ex[e][1], xr, o);
                    want_h[p * inter + o] = gv / (1.0 + std::exp(-gv)) * uv;
                }
                p++;
            }
    }
    // Down's input: the reference's h, its rows padded with zeros to down_cols.
    std::vector<float> h_in(want_h.begin(), want_h.end());
    {
        size_t p = 0;
        std::vector<float> padded(down_cols, 0.0f);
        for (int e = 0; e < experts; e++)
            for (auto [r, w] : by_expert[e]) {
                std::copy_n(&h_in[p * inter], inter, padded.begin());
                for (int o = 0; o < hidden; o++)
                    want_out[(size_t)r * hidden + o] +=
                        w * AffineExperts::product(ex.ex[e][2], padded.data(), o);
                p++;
            }
    }
    std::vector<float> h(pairs * inter, NAN), out((size_t)rows * hidden, NAN);
    run(false, h, out, h_in);
    double eh = rel_err(h, want_h), eo = rel_err(out, want_out);
    bool same = true;
    if (tiled) {
        std::vector<float> th(pairs * inter, NAN), tout((size_t)rows * hidden, NAN);
        run(true, th, tout, h_in);
        same = std::memcmp(th.data(), h.data(), h.size() * 4) == 0 &&
               std::memcmp(tout.data(), out.data(), out.size() * 4) == 0;
    }
    std::printf("grouped GEMMs q%d %d x %d (down %d wide), %d rows top-%d of %d: gate/up %.2e, "
                "down %.2e%s\n",
                bits, hidden, inter, down_cols, rows, top_k, experts, eh, eo,
                tiled ? (same ? ", in tiles: same bits" : ", in tiles: DIFFERENT") : "");
    return same ? std::max(eh, eo) : INFINITY;
}

// ---- The end of a decode step: argmax_rows, then advance_step ----

// Two replays of a step's end: a row of `dim` logits argmaxed over blocks of 1024 values
// into probs[at] (the maximum planted, tied at the row's last index, which must lose),
// then advance_step. The step tensor must hold each chosen token at the position after
// the last, the values before probs[at] kept and argmax_rows' count back at zero.
double check_advance(int dim) {
    const int chunk = 4 * ARGMAX_THREADS, splits = (dim + chunk - 1) / chunk, at = 5;
    std::vector<float> x(dim), part(splits, NAN);
    std::vector<int> part_i(splits, -1);
    std::vector<unsigned> count(1, 0), probs(at + 1, 0xdeadbeefu), step{17u, 40u};
    bool ok = true;
    for (int round = 0; round < 2; round++) {
        for (auto& v : x) v = normal();
        int best = round == 0 ? dim - 3 : 7;
        x[best] = 100.0f;
        x[dim - 1] = 100.0f;
        shim::launch({(unsigned)splits, 1, 1}, {ARGMAX_THREADS, 1, 1}, 0, [&] {
            argmax_rows(x.data(), probs.data() + at, dim, chunk, count.data(), part.data(),
                        part_i.data());
        });
        shim::launch({1, 1, 1}, {1, 1, 1}, 0, [&] { advance_step(step.data(), probs.data() + at); });
        bool right = step[0] == (unsigned)best && step[1] == 41u + round && count[0] == 0 &&
                     probs[at - 1] == 0xdeadbeefu;
        std::printf("advance %d values over %d blocks, round %d: token %u at %u, count %u: %s\n",
                    dim, splits, round, step[0], step[1], count[0], right ? "right" : "WRONG");
        ok = ok && right;
    }
    return ok ? 0.0 : INFINITY;
}

// ---- Picking the token: the sampler's kernels against backend::sample ----

// The cases' inputs, as backend::sample's tests make them: SplitMix64's finalizer of
// seed + t · φ.
uint64_t case_bits(uint64_t seed, uint64_t t) {
    uint64_t z = seed + t * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float float_of(unsigned bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Runs the chain the backend launches (backend/cuda/sample.rs) on each case of
// sample_cases.txt, which backend::sample's tests write with the token the host sampler
// picks, and counts the cases whose token differs. The settle kernel gets the shared
// memory the backend grants it.
double check_sample(const std::string& path) {
    FILE* f = std::fopen(path.c_str(), "r");
    if (!f) {
        std::printf("sample: %s missing\n", path.c_str());
        return INFINITY;
    }
    char line[512];
    int cases = 0, wrong = 0;
    while (std::fgets(line, sizeof line, f)) {
        if (line[0] == '#') continue;
        int vocab, top_k, penalized, spoil;
        unsigned tp, mp, rp, pp, fp, tt, spread_bits, want;
        unsigned long long seed, position, k;
        if (std::sscanf(line, "%d %d %x %x %x %x %x %x %llu %llu %llu %x %d %d %u", &vocab,
                        &top_k, &tp, &mp, &rp, &pp, &fp, &tt, &seed, &position, &k, &spread_bits,
                        &penalized, &spoil, &want) != 15) {
            std::printf("sample: a malformed case: %s", line);
            return INFINITY;
        }
        float top_p = float_of(tp), min_p = float_of(mp), temp = float_of(tt);
        float spread = float_of(spread_bits);
        std::vector<float> logits(vocab), counts;
        for (int t = 0; t < vocab; t++)
            logits[t] = t % 17 == 3 ? 1.0f
                                    : ((float)(case_bits(k, t) >> 40) / 16777216.0f - 0.5f) * spread;
        if (spoil == 1) logits[vocab / 3] = NAN;
        if (spoil == 2) logits[vocab / 2] = INFINITY;
        if (spoil == 3) logits[5] = -INFINITY;
        if (penalized) {
            counts.resize(vocab);
            for (int t = 0; t < vocab; t++)
                counts[t] = case_bits(k ^ 0xC0FFEE00ull, t) % 8 == 0 ? 2.0f : 0.0f;
        }
        const int sms = 132;
        int blocks = std::clamp((vocab + 4 * SAMPLE_THREADS - 1) / (4 * SAMPLE_THREADS), 1, 2 * sms);
        int chunk = (vocab + blocks - 1) / blocks;
        std::vector<float> s(vocab, NAN), bmax(blocks, NAN), list_s(SAMPLE_SORT_MAX, NAN),
            part(blocks, NAN);
        std::vector<int> list_id(SAMPLE_SORT_MAX, -1), part_i(blocks, -1);
        std::vector<unsigned> hist_count(SAMPLE_BINS, 0), count(1, 0), out(1, 0xdeadbeefu);
        std::vector<unsigned long long> hist_mass(SAMPLE_BINS, 0);
        SampleCut cut{};
        unsigned step[2] = {0u, (unsigned)(position - 1)};
        const float* cp = penalized ? counts.data() : nullptr;
        shim::launch({(unsigned)blocks, 1, 1}, {SAMPLE_THREADS, 1, 1}, 0, [&] {
            sample_scale(logits.data(), cp, s.data(), bmax.data(), vocab, chunk, temp,
                         float_of(rp), float_of(pp), float_of(fp));
        });
        if (temp <= 0.0f) {
            int pass = 4 * ARGMAX_THREADS;
            int achunk = std::max(1, ((vocab + 1023) / 1024 + pass - 1) / pass) * pass;
            int splits = (vocab + achunk - 1) / achunk;
            std::vector<float> apart(splits, NAN);
            std::vector<int> apart_i(splits, -1);
            shim::launch({(unsigned)splits, 1, 1}, {ARGMAX_THREADS, 1, 1}, 0, [&] {
                argmax_rows(s.data(), out.data(), vocab, achunk, count.data(), apart.data(),
                            apart_i.data());
            });
        } else {
            bool cuts = top_k > 0 || top_p < 1.0f;
            if (cuts) {
                shim::launch({(unsigned)blocks, 1, 1}, {SAMPLE_THREADS, 1, 1}, SAMPLE_HIST_SHARED, [&] {
                    sample_hist(s.data(), bmax.data(), hist_count.data(), hist_mass.data(), vocab,
                                chunk, min_p);
                });
                shim::launch({1, 1, 1}, {1024, 1, 1}, 0, [&] {
                    sample_cut(hist_count.data(), hist_mass.data(), &cut, top_k, top_p);
                });
                shim::launch({(unsigned)blocks, 1, 1}, {SAMPLE_THREADS, 1, 1}, 0, [&] {
                    sample_gather(s.data(), bmax.data(), &cut, list_s.data(), list_id.data(),
                                  vocab, chunk, min_p);
                });
                shim::launch({1, 1, 1}, {1024, 1, 1}, 8 * SAMPLE_SORT_MAX, [&] {
                    sample_settle(bmax.data(), blocks, hist_mass.data(), &cut, list_s.data(),
                                  list_id.data(), top_k, top_p);
                });
            }
            shim::launch({(unsigned)blocks, 1, 1}, {SAMPLE_THREADS, 1, 1}, 0, [&] {
                sample_draw(s.data(), bmax.data(), cuts ? &cut : nullptr, step, out.data(), 0, 0,
                            vocab, chunk, min_p, (unsigned)seed, (unsigned)(seed >> 32),
                            count.data(), part.data(), part_i.data(),
                            cuts ? hist_count.data() : nullptr, cuts ? hist_mass.data() : nullptr);
            });
        }
        bool clean = count[0] == 0 &&
                     std::all_of(hist_count.begin(), hist_count.end(), [](unsigned c) { return c == 0; });
        cases++;
        if (out[0] != want || !clean) {
            wrong++;
            std::printf("sample case %d (vocab %d, top-k %d, top-p %g, min-p %g, T %g): token %u, "
                        "the host picks %u%s\n",
                        cases, vocab, top_k, top_p, min_p, temp, out[0], want,
                        clean ? "" : "; scratch not left at zero");
        }
    }
    std::fclose(f);
    std::printf("sample: %d of %d cases pick the host's token\n", cases - wrong, cases);
    return wrong == 0 && cases > 0 ? 0.0 : INFINITY;
}

}  // namespace

// With an argument, only the checks whose family it names (dense, route, affine, gemm,
// attention, decode, sample, routed).
int main(int argc, char** argv) {
    auto wanted = [&](const char* family) { return argc < 2 || std::string(argv[1]) == family; };
    struct Rung {
        const char* name;
        int p, k;
    };
    const Rung rungs[] = {{"vq1.5", 8, 12}, {"vq3", 4, 12}, {"vq0.7", 16, 11}, {"vq1", 8, 8}};
    // The small fixture's experts (256 x 80: down's rows one padded block of 128), and
    // Qwen3-30B-A3B's (2048 x 768), for two tokens.
    const int shapes[][4] = {{256, 80, 6, 4}, {2048, 768, 16, 8}};
    double worst = 0.0;
    // Dense one-row products: ragged tiles, several matrices a launch, every split of a
    // job, grids that loop over rounds and grids with blocks to spare, a padded input.
    for (int bits : {4, 3, 2}) {
        if (!wanted("dense")) break;
        worst = std::max(worst, check_dense(bits, {100, 40, 24}, 256, 256, 1, 2));
        worst = std::max(worst, check_dense(bits, {100, 40, 24}, 256, 256, 4, 1));
        worst = std::max(worst, check_dense(bits, {37}, 640, 600, 8, 3));
        worst = std::max(worst, check_dense(bits, {16, 16}, 128, 128, 2, 5));
        // Rows of 16 units, one warp a job: several rounds a job, and jobs a warp.
        worst = std::max(worst, check_dense(bits, {40, 24}, 1024, 1000, 1, 1));
        // The residual add and norm folded in: more blocks than columns, a padded input.
        worst = std::max(worst, check_dense(bits, {100, 40, 24}, 256, 256, 4, 3, ADD_SUM));
        worst = std::max(worst, check_dense(bits, {37}, 640, 600, 8, 3, ADD_NORM));
        worst = std::max(worst, check_dense(bits, {16, 16}, 128, 128, 1, 200, ADD_SUM));
        // Residuals past f16's range before the norm's 1/rms: each unit's scale.
        worst = std::max(worst, check_dense(bits, {100, 40, 24}, 256, 256, 4, 3, ADD_SUM, true));
        worst = std::max(worst, check_dense(bits, {40, 24}, 1024, 1000, 1, 2, ADD_NORM, true));
        // Several input rows at once (dense_mma_rows_*): 1 to 4 rows, one part and
        // several, a padded input, a grid that loops over rounds; in tiles too.
        for (int n : {1, 2, 3, 4}) {
            worst = std::max(worst, check_dense(bits, {100, 40, 24}, 256, 256, 1, 2, ADD_NONE, false, false, n));
            worst = std::max(worst, check_dense(bits, {37}, 640, 600, 8, 3, ADD_NONE, false, false, n));
            worst = std::max(worst, check_dense(bits, {40, 24}, 1024, 1000, 4, 1, ADD_NONE, false, false, n));
            if (bits != 3)
                worst = std::max(worst, check_dense(bits, {100, 40, 24}, 256, 256, 2, 3, ADD_NONE, false, true, n));
        }
        // In unit tiles (4 and 2 bits): a ragged matrix whose grid loops over rounds, with
        // and without the norm, several jobs a warp and parts of a job.
        if (bits == 3) continue;
        worst = std::max(worst, check_dense(bits, {100}, 256, 256, 1, 1, ADD_NONE, false, true));
        worst = std::max(worst, check_dense(bits, {200}, 1024, 1000, 2, 3, ADD_SUM, false, true));
        worst = std::max(worst, check_dense(bits, {37}, 640, 600, 8, 3, ADD_NORM, true, true));
        worst = std::max(worst, check_dense(bits, {100, 40, 24}, 256, 256, 4, 3, ADD_SUM, false, true));
    }
    // Routes: one and several experts a thread, widths off whole float4s, masks, ties.
    const int routes[][3] = {{128, 8, 128}, {128, 8, 256}, {12, 4, 32}, {130, 2, 256},
                             {256, 8, 256}, {300, 8, 256}, {64, 1, 64}};
    for (const auto& r : routes) {
        if (!wanted("route")) break;
        for (int masked = 0; masked < 2; masked++)
            for (int renorm = 0; renorm < 2; renorm++)
                worst = std::max(worst, check_route(r[0], r[1], r[2], masked, renorm));
    }
    // The router through the norm: one block (8 rows), a row split over warps, many
    // blocks, outlier channels.
    if (wanted("route")) {
        worst = std::max(worst, check_router_norm(128, 2048, ADD_SUM));
        worst = std::max(worst, check_router_norm(6, 4096, ADD_NORM));
        worst = std::max(worst, check_router_norm(300, 256, ADD_SUM));
        worst = std::max(worst, check_router_norm(128, 2048, ADD_SUM, true));
    }
    // The affine experts of a decode step (in unit tiles at 4 and 2 bits, rows at 3): the
    // small fixture's shape (256 × 80 is padded to whole groups: 256 × 128), a narrow
    // Qwen3-like one, experts wide enough that a down warp takes a second round of units
    // (8 × 1 024 / 64 over 16 warps: 8 of 6), and rows wide enough that a gate/up warp
    // takes several.
    for (int bits : {4, 3, 2}) {
        if (!wanted("affine")) break;
        worst = std::max(worst, check_routed_affine(bits, 256, 128, 12, 4));
        worst = std::max(worst, check_routed_affine(bits, 512, 192, 128, 8));
        worst = std::max(worst, check_routed_affine(bits, 128, 1024, 16, 8));
        // Rows 2112 wide: gate/up warps take 5 units of 33, so several rounds each.
        worst = std::max(worst, check_routed_affine(bits, 2112, 64, 6, 2));
    }
    // Rows into tiles on the device: whole tiles, and rows past the last whole one.
    for (int bits : {4, 2}) {
        if (!wanted("gemm")) break;
        worst = std::max(worst, check_tiles_from_rows(bits, 48, 128));
        worst = std::max(worst, check_tiles_from_rows(bits, 80, 256));
        worst = std::max(worst, check_tiles_from_rows(bits, 37, 192));
    }
    // A prompt's grouped GEMMs: the small fixture's 80-wide experts (a block's last warp
    // past the rows, down's input padded to 128), experts with more pairs than a tile
    // (several tiles a group), rows of several groups; in tiles at 4 and 2 bits.
    for (int bits : {4, 3, 2}) {
        if (!wanted("gemm")) break;
        worst = std::max(worst, check_expert_gemm(bits, 256, 80, 128, 12, 40, 4, bits != 3));
        worst = std::max(worst, check_expert_gemm(bits, 512, 192, 192, 4, 100, 2, bits != 3));
    }
    // A decode step's attention with its preamble, the keys and values loaded after the
    // attention's wait: Qwen3-30B-A3B's heads over several splits (the last one holding
    // p, later ones empty), a window that empties the first splits, more query heads than
    // a block takes (two tiles), narrow and wide heads, the first position.
    if (wanted("attention")) {
        worst = std::max(worst, check_attention_step(32, 4, 128, 40, 64, 0, 16, true));
        worst = std::max(worst, check_attention_step(32, 4, 128, 40, 64, 0, 16, false));
        worst = std::max(worst, check_attention_step(8, 2, 128, 90, 100, 20, 32, true));
        worst = std::max(worst, check_attention_step(24, 2, 64, 17, 48, 0, 16, true));
        worst = std::max(worst, check_attention_step(4, 2, 256, 5, 20, 0, 16, true));
        worst = std::max(worst, check_attention_step(4, 1, 96, 0, 16, 0, 16, false));
        // Keys and values loaded before the wait: row p inside a chunk's
        // first score step, first in its chunk, in the second score step (and V round) of
        // a 64-key chunk, and in a window.
        worst = std::max(worst, check_attention_step(32, 4, 128, 40, 64, 0, 32, true, true));
        worst = std::max(worst, check_attention_step(32, 4, 128, 40, 64, 0, 16, false, true));
        worst = std::max(worst, check_attention_step(32, 4, 128, 32, 64, 0, 32, true, true));
        worst = std::max(worst, check_attention_step(32, 4, 128, 40, 64, 0, 64, true, true));
        // 38 splits with keys: the combine's threads take more than their COMBINE_EARLY.
        worst = std::max(worst, check_attention_step(32, 4, 128, 600, 640, 0, 16, true, true));
        worst = std::max(worst, check_attention_step(8, 2, 128, 90, 100, 20, 32, true, true));
        worst = std::max(worst, check_attention_step(24, 2, 64, 17, 48, 0, 16, true, true));
        worst = std::max(worst, check_attention_step(4, 2, 256, 5, 20, 0, 16, true, true));
        worst = std::max(worst, check_attention_step(4, 1, 96, 0, 16, 0, 16, false, true));
        // Several sequences together: positions in different splits (the first, one
        // chunk's last key, a later split), caches of different capacities, a window,
        // two tiles of query heads, narrow and wide heads.
        worst = std::max(worst, check_attention_rows(32, 4, 128, {0, 15, 40, 63}, {64, 64, 48, 64}, 0, 16));
        worst = std::max(worst, check_attention_rows(8, 2, 128, {90, 5}, {100, 32}, 20, 32));
        worst = std::max(worst, check_attention_rows(24, 2, 64, {17, 3, 30}, {48, 48, 48}, 0, 16));
        worst = std::max(worst, check_attention_rows(4, 2, 256, {5, 19}, {20, 20}, 0, 16));
    }
    // The token a step picks by sampling settings: backend::sample's own cases.
    if (wanted("sample")) {
        std::string exe = argv[0];
        worst = std::max(worst, check_sample(exe.substr(0, exe.rfind('/') + 1) + "sample_cases.txt"));
    }
    // The token a step chose carried into the next: one block, several.
    if (wanted("decode")) {
        worst = std::max(worst, check_advance(1000));
        worst = std::max(worst, check_advance(5000));
    }
    for (const Rung& r : rungs) {
        if (!wanted("routed")) break;
        for (const auto& s : shapes)
            worst = std::max(worst, check(r.name, r.p, r.k, s[0], s[1], s[2], s[3], 2));
    }
    std::printf("worst %.2e\n", worst);
    return worst < 1e-4 ? 0 : 1;
}

// Affine codes on tensor cores: how a 64-column group's codes and inputs become
// mma.sync fragments (shared by the grouped GEMMs, the routed kernels and these), and the
// one-row dense products of a decode step (attention projections, LM head) built on them.

// Codes decoded straight to f16 pairs: a code c placed in the low bits of a half whose
// exponent field reads 1024 is the f16 value 1024 + c, and one f16x2 subtraction leaves c,
// exactly. A lane of quarter q (lane % 4) needs, for its output row, the 16 codes at
// the k positions 16·ks + 8·h + 2·q + e (ks < 4: the k step, h: b0 or b1, e: the half)
// of a 64-column group. Those are columns 16q .. 16q + 15 in the order the codes' words
// hold them: column 16q + stage_column(ks, h, e). The x tile is stored in the same
// order, so every product pairs the same column on both sides.
template <int BITS>
__device__ __forceinline__ int stage_column(int ks, int h, int e) {
    if (BITS == 4) return 8 * h + ks + 4 * e;  // word 2q + h, nibbles ks and ks + 4
    // Word q of the group (2 bits, and the upper bits of 3), bit pair ks of bytes h and
    // h + 2: columns q2_column(q % 2, ks, h + 2e) of chunk q / 2.
    int b = h + 2 * e;
    return ks < 2 ? 2 * (4 * ks + b) : 2 * (4 * (ks - 2) + b) + 1;
}

// The words a lane of quarter q decodes from one row's group `gi`: two at 4 bits (words
// 2q and 2q + 1), one at 2 bits (word q), at 3 bits the chunk's upper-bit word and its
// lowest-bit word.
template <int BITS>
__device__ __forceinline__ void load_lane_words(const unsigned* row, int gi, int q,
                                                unsigned (&w)[2]) {
    if (BITS == 4) {
        uint2 v = *reinterpret_cast<const uint2*>(row + gi * 8 + 2 * q);
        w[0] = v.x;
        w[1] = v.y;
    } else if (BITS == 2) {
        w[0] = row[gi * 4 + q];
        w[1] = 0u;
    } else {
        const unsigned* c = row + gi * 6 + 3 * (q / 2);
        w[0] = c[q % 2];
        w[1] = c[2];
    }
}

// A matrix in unit tiles (TILED; 4 and 2 bits): the lane words of unit (tile t, group gi)
// are contiguous, lane l's at ((t·groups + gi)·32 + l)·W (W = 4 at 4 bits: row g's two
// words, then row g + 8's; 2 at 2 bits: row g's word, then row g + 8's), and the unit's
// scales and biases at ((t·groups + gi)·16 + r)·2 (+1 for the bias) for its row r. A
// warp's unit is then 4 (or 2) whole cache lines and one 64-byte piece, where rows take
// 16 lines and 16 pieces: the LM head's rounds stream ~16% faster
// (tools/gpu-microbench). The words' bits are the store's, so decode_fragments applies.
template <int BITS>
__device__ __forceinline__ void load_tile_words(const unsigned* words, size_t unit, int lane,
                                                unsigned (&w)[2][2]) {
    static_assert(BITS == 4 || BITS == 2, "tiles of 4- and 2-bit words");
    if (BITS == 4) {
        uint4 v = reinterpret_cast<const uint4*>(words)[unit * WARP + lane];
        w[0][0] = v.x;
        w[0][1] = v.y;
        w[1][0] = v.z;
        w[1][1] = v.w;
    } else {
        uint2 v = reinterpret_cast<const uint2*>(words)[unit * WARP + lane];
        w[0][0] = v.x;
        w[0][1] = 0u;
        w[1][0] = v.y;
        w[1][1] = 0u;
    }
}

// b[2·ks + h]: the lane's b0 (h = 0) and b1 (h = 1) of k step ks, as f16 codes.
template <int BITS>
__device__ __forceinline__ void decode_fragments(const unsigned (&w)[2], int q, unsigned (&b)[8]) {
    const unsigned magic = 0x64006400u;  // 1024 in both halves
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            unsigned c;
            if (BITS == 4) {
                c = (w[h] >> (4 * ks)) & 0x000F000Fu;
            } else {
                c = (w[0] >> (8 * h + 2 * ks)) & 0x00030003u;
                if (BITS == 3)
                    c = (c << 1) | ((w[1] >> (8 * h + 4 * (q % 2) + ks)) & 0x00010001u);
            }
            b[2 * ks + h] = sub_f16x2(c | magic, magic);
        }
}

// Codes as subnormals: the 4- and 2-bit products of unit_products take each code as the
// f16 whose bits it is once shifted into the high bits of the significand and masked: a
// code c at bit p (p + BITS <= 10) is the subnormal c·2^(p - 24), exact, and the tensor
// cores multiply subnormals as they are. That drops decode_fragments' f16 subtraction a
// register, and where a code already sits at its place, its shift (decode_fragments
// stays for 3 bits and the grouped GEMMs). At 4
// bits every nibble goes to bits 4..7 (one accumulator); at 2 bits the even k steps'
// codes go to bits 8..9 and the odd ones' to bits 6..7, from the same shifted words, so
// they sum apart and are scaled back apart.
// The codes go high because in the lowest bits (c·2^-24) the products lost precision on
// the GPU: ten times decode_fragments' error at 4 bits and 1e-5 at 2. That fits tensor
// cores that align a k step's products and the accumulator at the largest exponent
// field among them, since a subnormal's field says 2^-14 whatever its leading zeros.
// Placed high, the GPU tests of every reader pass at decode_fragments' precision, and
// decode measured +6.3% at 4 bits and +7.4% at 2 (docs/notes/gpu-06-2026-12-03-rounds-16-18.md, eighteenth round).

// The bit at which subnormal_fragments puts k step ks's codes.
template <int BITS> __device__ __forceinline__ constexpr int subnormal_place(int ks) {
    return BITS == 4 ? 4 : (ks % 2 ? 6 : 8);
}

// What a subnormal code of k step ks is multiplied by to be the code: 2^(24 - place).
template <int BITS> __device__ __forceinline__ constexpr float subnormal_unit(int ks) {
    return float(1u << (24 - subnormal_place<BITS>(ks)));
}

// decode_fragments' b[2·ks + h] as subnormal f16 codes at subnormal_place: at 4 bits k
// step ks takes bits 4·ks of word h, at 2 bits bits 2·(4·h + ks) of word 0 (as
// decode_fragments), each half of the word shifted as one.
template <int BITS>
__device__ __forceinline__ void subnormal_fragments(const unsigned (&w)[2], unsigned (&b)[8]) {
    static_assert(BITS == 4 || BITS == 2, "subnormal codes at 4 and 2 bits");
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            unsigned word = BITS == 4 ? w[h] : w[0];
            int from = BITS == 4 ? 4 * ks : 2 * (4 * h + ks), to = subnormal_place<BITS>(ks);
            unsigned src = to >= from ? word << (to - from) : word >> (from - to);
            unsigned mask = ((1u << BITS) - 1u) << to;
            b[2 * ks + h] = src & (mask | mask << 16);
        }
}

// The 16 x values of columns 16q .. 16q + 15 as f16 hi and lo parts, paired in the
// lane order above: word 4·ks + h holds positions 16·ks + 8·h + 2q + (0, 1). The indices
// fold to constants, so `v` stays in registers.
template <int BITS>
__device__ __forceinline__ void split_pairs(const float (&v)[16], unsigned (&hi)[8],
                                            unsigned (&lo)[8]) {
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float v0 = v[stage_column<BITS>(ks, h, 0)], v1 = v[stage_column<BITS>(ks, h, 1)];
            unsigned x = pack_f16x2(v0, v1);
            float2 r = unpack_f16x2(x);
            hi[2 * ks + h] = x;
            lo[2 * ks + h] = pack_f16x2(v0 - r.x, v1 - r.y);
        }
}

// Columns k0 .. k0 + 15 of `row` (`in_dim` wide; zeros past it, and for a null row), by
// float4 when `vec` says the row's float4s are whole and aligned.
__device__ __forceinline__ void load_x16(const float* row, int k0, int in_dim, bool vec,
                                         float (&v)[16]) {
    if (row && vec && k0 + 16 <= in_dim) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float4 f = *reinterpret_cast<const float4*>(row + k0 + 4 * j);
            v[4 * j] = f.x;
            v[4 * j + 1] = f.y;
            v[4 * j + 2] = f.z;
            v[4 * j + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 16; j++) v[j] = row && k0 + j < in_dim ? row[k0 + j] : 0.0f;
    }
}

// f(mt, jt, i, r, c) for each element i of a warp's (mt, jt) accumulator fragments over
// 32 pair rows and 16 output columns: pair row r = 16·mt + g (+8 for i ≥ 2), output
// column c = c0 + 8·jt + 2q (+1 for odd i).
template <typename F>
__device__ __forceinline__ void for_fragments(int c0, F f) {
    int lane = threadIdx.x % WARP, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int jt = 0; jt < 2; jt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                f(mt, jt, i, 16 * mt + g + (i >= 2 ? 8 : 0), c0 + 8 * jt + 2 * q + (i & 1));
}

// A down GEMM tile's products (for_fragments from column c0) added into their rows:
// out[x_rows[first + r], c] += pair_scales[first + r] · acc, atomically (a token's experts
// add into its row). Rows from `count` on and columns from `rows` on are not there.
__device__ __forceinline__ void add_down_fragments(const float (&acc)[2][2][4], int c0, int count,
                                                   int rows, int first, const unsigned* x_rows,
                                                   const float* pair_scales, float* out) {
    for_fragments(c0, [&](int mt, int jt, int i, int r, int c) {
        if (r < count && c < rows)
            atomicAdd(out + (size_t)x_rows[first + r] * rows + c,
                      pair_scales[first + r] * acc[mt][jt][i]);
    });
}

// ---- Routed experts on tensor cores: a decode step's MoE dispatch ----
//
// The matrix-vector kernels above convert every code to a float on its own and issue a
// row's loads only after the block has staged x. Here every lane first issues the loads
// of all the words it will decode, then the block stages x. The codes become f16 by the
// exponent trick of the grouped GEMMs, and mma.sync takes 16 weight rows as its A
// operand (a lane of group g holds rows g and g + 8) and x as B: column 0 holds the f16
// hi part of x, column 1 the lo part, the other six are zero. Lane (g, q = 0) then holds
// rows g and g + 8 times both parts, and adds them per 64-column group with its scale
// and bias, as every affine kernel does.
//
// A block takes RMMA_ROWS output rows. A unit is one 64-column group of one input row;
// the warps split the units, and the block adds their partial sums in a fixed order, so
// results do not depend on timing. A warp loads at most UNITS units' words at once and
// takes more in further rounds.
#define RMMA_WARPS 8
// The down kernel's blocks take 16 warps: a decode step has one block per RMMA_ROWS output
// rows (128 for a 2048-wide model), a block an SM, and each warp's chain of units is what
// the step waits for, so twice the warps halve it.
#define RMMA_DOWN_WARPS 16
#define RMMA_ROWS 16
// A staged unit: f16x2 words [hi/lo][ks][q][h]; the lo half starts 40 words on, so the
// two lane groups that read them (g = 0 and g = 1) fall in different banks.
#define RMMA_HALF 40
#define RMMA_UNIT (2 * RMMA_HALF)

// Stages `units` units into `xs` (RMMA_UNIT words each) in the fragment order of
// decode_fragments, and each unit's sum into `xsum`. Unit u is group u % groups of row
// row_of(u / groups) of x, which is `in_dim` wide (zeros past it). A thread takes 16
// columns (a quarter of a group) at a time; a unit's four quarters sit in consecutive
// lanes. Threads `tid` of `threads` (whole warps) share the work; each must call it.
// `input` (for one row) may change the 16 values a thread loads. With `xscale`, each unit is staged
// times the power of two that puts its largest value in [2^14, 2^15), and xscale[u] gets
// its inverse: a row that is not normed yet may be far outside f16's range, and powers
// of two scale it exactly. `xsum` stays unscaled.
struct InputAsIs {
    __device__ void operator()(int, float (&)[16]) const {}
};

// The values times the norm's 1/rms, for a row stage_norm_row put in shared memory.
struct InputScaled {
    float inv;
    __device__ void operator()(int, float (&v)[16]) const {
#pragma unroll
        for (int j = 0; j < 16; j++) v[j] *= inv;
    }
};

template <int BITS, typename RowOf, typename Input = InputAsIs>
__device__ void stage_units(unsigned* xs, float* xsum, const float* x, RowOf row_of, int units,
                             int groups, int in_dim, int tid, int threads, Input input = {},
                             float* xscale = nullptr) {
    bool vec = in_dim % 4 == 0 && ((size_t)x & 15) == 0;  // whole float4s, aligned
    int items = 4 * units;
    for (int base = 0; base < items; base += threads) {
        int i = base + tid;
        bool live = i < items;
        int u = live ? i / 4 : 0, q = i % 4;
        const float* src = x + (size_t)row_of(u / groups) * in_dim;
        float v[16];
        int k0 = (u % groups) * 64 + 16 * q;
        load_x16(live ? src : nullptr, k0, in_dim, vec, v);
        if (live) input(k0, v);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; j++) s += v[j];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (xscale) {
            float m = 0.0f;
#pragma unroll
            for (int j = 0; j < 16; j++) m = fmaxf(m, fabsf(v[j]));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            // Below 2^-100 a unit is as good as zero; the bound keeps 2^(14 - e) finite.
            int e = m > 0.0f ? max(-100, ilogbf(m)) : 0;
            float up = ldexpf(1.0f, 14 - e);
#pragma unroll
            for (int j = 0; j < 16; j++) v[j] *= up;
            if (live && q == 0) xscale[u] = ldexpf(1.0f, e - 14);
        }
        if (!live) continue;
        if (q == 0) xsum[u] = s;
        unsigned hi[8], lo[8];
        split_pairs<BITS>(v, hi, lo);
        unsigned* dst = xs + (size_t)u * RMMA_UNIT + 2 * q;
#pragma unroll
        for (int ks = 0; ks < 4; ks++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                dst[8 * ks + h] = hi[2 * ks + h];
                dst[RMMA_HALF + 8 * ks + h] = lo[2 * ks + h];
            }
    }
}

// One unit's products for the lane's rows g and g + 8 of a matrix: the partial sums
// Σ q·x of the group (on lanes with q = 0; the others hold zeros), from the lane's words
// `w` (row g, row g + 8) and the staged unit's B fragments `bx`.
template <int BITS>
__device__ __forceinline__ float2 unit_products(const unsigned (&w)[2][2], int q,
                                                const unsigned (&bx)[8]) {
    if constexpr (BITS != 3) {
        unsigned a0[8], a1[8];
        subnormal_fragments<BITS>(w[0], a0);
        subnormal_fragments<BITS>(w[1], a1);
        // Steps whose codes sit at one place share an accumulator: all four at 4 bits,
        // the even and the odd apart at 2.
        constexpr bool apart = subnormal_place<BITS>(0) != subnormal_place<BITS>(1);
        float even[4], odd[4];
#pragma unroll
        for (int ks = 0; ks < 4; ks++) {
            unsigned a[4] = {a0[2 * ks], a1[2 * ks], a0[2 * ks + 1], a1[2 * ks + 1]};
            float(&c)[4] = apart && ks % 2 ? odd : even;
            if (ks < (apart ? 2 : 1))
                mma_f16_first(c, a, bx[2 * ks], bx[2 * ks + 1]);
            else
                mma_f16(c, a, bx[2 * ks], bx[2 * ks + 1]);
        }
        const float unit = subnormal_unit<BITS>(0), unit_odd = subnormal_unit<BITS>(1);
        if constexpr (!apart)
            return make_float2((even[0] + even[1]) * unit, (even[2] + even[3]) * unit);
        return make_float2((even[0] + even[1]) * unit + (odd[0] + odd[1]) * unit_odd,
                           (even[2] + even[3]) * unit + (odd[2] + odd[3]) * unit_odd);
    }
    unsigned a0[8], a1[8];
    decode_fragments<BITS>(w[0], q, a0);
    decode_fragments<BITS>(w[1], q, a1);
    float c[4];
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        unsigned a[4] = {a0[2 * ks], a1[2 * ks], a0[2 * ks + 1], a1[2 * ks + 1]};
        if (ks == 0)
            mma_f16_first(c, a, bx[0], bx[1]);
        else
            mma_f16(c, a, bx[2 * ks], bx[2 * ks + 1]);
    }
    return make_float2(c[0] + c[1], c[2] + c[3]);
}

// The B fragments of staged unit u for lane (g, q): hi for g = 0, lo for g = 1, zeros
// for the rest.
__device__ __forceinline__ void unit_fragments(const unsigned* xs, int u, int g, int q,
                                               unsigned (&bx)[8]) {
    const unsigned* src = xs + (size_t)u * RMMA_UNIT + g * RMMA_HALF + 2 * q;
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        uint2 v = g < 2 ? *reinterpret_cast<const uint2*>(src + 8 * ks) : make_uint2(0u, 0u);
        bx[2 * ks] = v.x;
        bx[2 * ks + 1] = v.y;
    }
}

// The B fragments of staged unit u of input row g / 2 for lane (g, q) (hi for even g, lo
// for odd), zeros past the `rows` staged: unit_fragments with a row in each pair of
// columns, so that lane q of each quad ends with input row q's sums. Row r's units start
// at r · groups.
__device__ __forceinline__ void unit_fragments_rows(const unsigned* xs, int u, int g, int q,
                                                    int groups, int rows,
                                                    unsigned (&bx)[8]) {
    int r = g >> 1;
    const unsigned* src =
        xs + ((size_t)r * groups + u) * RMMA_UNIT + (g & 1) * RMMA_HALF + 2 * q;
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        uint2 v = r < rows ? *reinterpret_cast<const uint2*>(src + 8 * ks) : make_uint2(0u, 0u);
        bx[2 * ks] = v.x;
        bx[2 * ks + 1] = v.y;
    }
}

// Scale and bias of rows g and g + 8 for lanes with q = 0 (with ALL, for every lane):
// lane q of each quad loads one of the four (scale g, bias g, scale g + 8, bias g + 8) as
// `mine`.
template <bool ALL = false>
__device__ __forceinline__ float4 quad_scales(unsigned short mine, int lane) {
    float v = bf16_bits(mine);
    int base = lane & ~3;
    float own = ALL ? __shfl_sync(0xffffffffu, v, base) : v;
    return make_float4(own, __shfl_sync(0xffffffffu, v, base + 1),
                       __shfl_sync(0xffffffffu, v, base + 2),
                       __shfl_sync(0xffffffffu, v, base + 3));
}

// One unit's w·x for the lane's rows g and g + 8 (valid on lanes with q = 0): the codes'
// products with the staged unit's fragments `bx`, scaled by the rows' scale and bias
// (`sb`, quad_scales' item) with the unit's sum `s` of x. value = (a·q + o)·scale + bias,
// so w·x = a·scale·Σ q·x + (o·scale + bias)·Σ x.
// `xs` is the unit's xscale where stage_units scaled it.
// With ALL, valid on every lane (each with its own `s`: dense_mma_rows_*).
template <int BITS, bool ALL = false>
__device__ __forceinline__ float2 unit_dot(const unsigned (&w)[2][2], unsigned short sb,
                                           const unsigned (&bx)[8], float s, int q, int lane,
                                           float xs = 1.0f) {
    const float a = recon_a<BITS>(), off = recon_o<BITS>();
    float2 p = unit_products<BITS>(w, q, bx);
    float4 f = quad_scales<ALL>(sb, lane);
    return make_float2(a * f.x * (p.x * xs) + (off * f.x + f.y) * s,
                       a * f.z * (p.y * xs) + (off * f.z + f.w) * s);
}

// The lane's words of unit group `gi` for rows g and g + 8 (`rows0`, `rows1` point at
// them), and its quad item of the scales and biases.
template <int BITS>
__device__ __forceinline__ void load_unit(const unsigned* row0, const unsigned* row1,
                                          const unsigned short* scales,
                                          const unsigned short* biases, size_t sb_row0,
                                          size_t sb_row1, int gi, int q, unsigned (&w)[2][2],
                                          unsigned short& sb) {
    load_lane_words<BITS>(row0, gi, q, w[0]);
    load_lane_words<BITS>(row1, gi, q, w[1]);
    const unsigned short* src = (q & 1) ? biases : scales;
    sb = src[(q < 2 ? sb_row0 : sb_row1) + gi];
}

// One block's RMMA_ROWS rows (from r0) of one pair's gate and up products, its warps
// splitting the units of the pair's input row, which the block stages in xs / xsum
// (stage_units). `entry` is the expert's ROUTED_ENTRY pointers. The caller issues
// load(u0) (which may go out before x is staged), then calls finish once x is staged.
// Which rows and units of one RMMA_ROWS-row tile a thread takes: lane (g, q) holds rows
// r0 + g and r0 + g + 8 (a row past the matrix reads row 0 and is never stored), its warp
// (of the block's `warps`) units [u0, u1) of `units`; rows are `stride` words.
struct TileLanes {
    int groups, rows, r0, lane, warp, warps, g, q, u0, u1, o0, o1;
    size_t stride;

    __device__ TileLanes(int r0_, int rows_, int cols, int units, size_t stride_)
        : groups(cols / 64), rows(rows_), r0(r0_), stride(stride_) {
        lane = threadIdx.x % WARP;
        warp = threadIdx.x / WARP;
        warps = blockDim.x / WARP;
        g = lane >> 2;
        q = lane & 3;
        o0 = r0 + g < rows ? r0 + g : 0;
        o1 = r0 + g + 8 < rows ? r0 + g + 8 : 0;
        int per = (units + warps - 1) / warps;
        u0 = min(units, warp * per);
        u1 = min(units, u0 + per);
    }
};

// The lane's words of a unit in tiles and its quad item of the scales and biases (as
// load_unit).
template <int BITS>
__device__ __forceinline__ void load_unit_tiled(const unsigned* words, const unsigned short* sb,
                                                size_t unit, int lane, int g, int q,
                                                unsigned (&w)[2][2], unsigned short& s) {
    load_tile_words<BITS>(words, unit, lane, w);
    s = sb[(unit * RMMA_ROWS + (q < 2 ? g : g + 8)) * 2 + (q & 1)];
}

// ---- Dense affine matrices of one input row on tensor cores ----
//
// The LM head and attention projections of a decode step coded as affine q4/q3/q2
// (`--dense-codec`, `--head-codec`): the routed kernels' units and fragments, with no
// route. Up to three matrices of one input (a layer's q, k and v) share a launch. A job
// is a tile of RMMA_ROWS rows of one matrix; the `parts` warps of a job split its units
// (parts divides RMMA_WARPS) and add their sums in a fixed order, so a block takes
// RMMA_WARPS / parts jobs a round. Blocks stage x once and loop over rounds, so a grid
// sized for the device streams a 151936-row head without staging x 9 496 times. Every
// warp's first units go out before PDL_WAIT: no kernel writes weights. Units a warp
// loads at once and blocks an SM (the launch bound, which the host's grid assumes) are
// tunable (DYNMOE_CUDA=define=...). Four units a round measured fastest on the H200 (decode
// 1 246 tok/s against 1 208 at eight and 1 231 at two, 12-layer Qwen3-30B-A3B shape, q4
// dense layers and head, on a build that spilled at each), and here ptxas spills nothing
// at four (24 bytes at eight).
#ifndef DMMA_UNITS
#define DMMA_UNITS 4
#endif
#ifndef DMMA_BLOCKS
#define DMMA_BLOCKS 3
#endif
struct DenseMat {
    const unsigned* words;
    const unsigned short* scales;
    const unsigned short* biases;
    float* out;
    int rows;
};

// The input of a dense product read as RMSNorm(x + delta)·w, x + delta written to `sum`
// (null: not written); with `w` null, x as it is.
struct NormArgs {
    const float* delta;
    const float* w;
    float eps;
    float* sum;
};

// R > 1 (dense_mma_rows_*): `nrows` ≤ R input rows at once, x and each output `[nrows,
// width]`; input row r takes columns 2r and 2r + 1 of the B fragments
// (unit_fragments_rows), so one decode of each weight unit serves every row, and lane q
// of a quad ends with row q's sums. No norm then.
template <int BITS, bool NORM, bool TILED = false, int R = 1>
__device__ void dense_mma(const DenseMat (&m)[3], int mats, const float* x, int cols,
                          int in_dim, int parts, const NormArgs& norm, int nrows = 1) {
    static_assert(R == 1 || (!NORM && R <= 4), "up to 4 rows in the 8 columns, no norm");
    extern __shared__ __align__(16) unsigned smem[];
    int groups = cols / 64;
    unsigned* xs = smem;
    // The staged units of the `nrows` rows, their sums, then the parts' sums.
    float* xsum = reinterpret_cast<float*>(smem + (size_t)nrows * groups * RMMA_UNIT);
    float* red = xsum + nrows * groups;  // [RMMA_WARPS][R][RMMA_ROWS]
    // With NORM: each unit's xscale (after the routed kernels' [RMMA_WARPS][2][RMMA_ROWS]
    // that routed_mma_shared counts) and the row through the norm (16-byte aligned).
    float* xscale = red + RMMA_WARPS * (R > 2 ? R : 2) * RMMA_ROWS;
    float* normed = align16(xscale + groups);
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, q = lane & 3;
    int per_round = RMMA_WARPS / parts, slot = warp / parts, part = warp % parts;
    int tiles[3];
#pragma unroll
    for (int i = 0; i < 3; i++) tiles[i] = i < mats ? (m[i].rows + RMMA_ROWS - 1) / RMMA_ROWS : 0;
    int jobs = tiles[0] + tiles[1] + tiles[2];
    int per = (groups + parts - 1) / parts;
    int u0 = min(groups, part * per), u1 = min(groups, u0 + per);
    size_t stride = row_words<BITS>(cols);
    // The job's matrix (picked by selects: an indexed array of them would sit in local
    // memory), first row and rows g, g + 8 (a row past the matrix reads row 0 and is
    // never stored).
    DenseMat cur = m[0];
    int r0 = 0, o0 = 0, o1 = 0;
    auto place = [&](int job) {
        int mi = job < tiles[0] ? 0 : (job < tiles[0] + tiles[1] ? 1 : 2);
        job -= mi == 0 ? 0 : (mi == 1 ? tiles[0] : tiles[0] + tiles[1]);
        cur = mi == 0 ? m[0] : (mi == 1 ? m[1] : m[2]);
        r0 = job * RMMA_ROWS;
        o0 = r0 + g < cur.rows ? r0 + g : 0;
        o1 = r0 + g + 8 < cur.rows ? r0 + g + 8 : 0;
    };
    unsigned w[DMMA_UNITS][2][2];
    unsigned short sb[DMMA_UNITS];
    auto load = [&](int base) {
#pragma unroll
        for (int j = 0; j < DMMA_UNITS; j++) {
            if (base + j >= u1) continue;
            if constexpr (TILED)
                load_unit_tiled<BITS>(cur.words, cur.scales,
                                      (size_t)(r0 / RMMA_ROWS) * groups + base + j, lane, g, q,
                                      w[j], sb[j]);
            else
                load_unit<BITS>(cur.words + o0 * stride, cur.words + o1 * stride, cur.scales,
                                cur.biases, (size_t)o0 * groups, (size_t)o1 * groups, base + j,
                                q, w[j], sb[j]);
        }
    };
    float acc[2];
    auto compute = [&](int base) {
#pragma unroll
        for (int j = 0; j < DMMA_UNITS; j++) {
            if (base + j >= u1) break;
            unsigned bx[8];
            float s;
            if constexpr (R == 1) {
                unit_fragments(xs, base + j, g, q, bx);
                s = xsum[base + j];
            } else {
                unit_fragments_rows(xs, base + j, g, q, groups, nrows, bx);
                s = q < nrows ? xsum[q * groups + base + j] : 0.0f;
            }
            float2 d = unit_dot<BITS, (R > 1)>(w[j], sb[j], bx, s, q, lane,
                                               NORM ? xscale[base + j] : 1.0f);
            acc[0] += d.x;
            acc[1] += d.y;
        }
    };
    int first = blockIdx.x * per_round + slot, step = gridDim.x * per_round;
    bool live = first < jobs;
    if (live) {
        place(first);
        load(u0);
    }
    PDL_WAIT();
    // The norm's 1/rms, which the outputs take (1 without NORM).
    float inv = 1.0f;
    if (NORM) {
        float ss = stage_norm_row(x, norm.delta, norm.w, normed, in_dim, norm.sum,
                                  row_slice(in_dim, 4));
        // `red` is free until the rounds, and block_sum's 32 floats fit in it; its
        // barriers also make `normed` whole before it is staged.
        inv = 1.0f / sqrtf(block_sum(ss, red) / (float)in_dim + norm.eps);
        stage_units<BITS>(xs, xsum, normed, [](int) { return 0; }, groups, groups, in_dim,
                          threadIdx.x, blockDim.x, InputAsIs{}, xscale);
    } else {
        stage_units<BITS>(xs, xsum, x, [](int r) { return r; }, nrows * groups, groups, in_dim,
                          threadIdx.x, blockDim.x);
    }
    __syncthreads();
    // Every warp runs every round (the block adds parts through shared memory); a warp
    // whose job is past the last only takes part in the barriers.
    for (int round = blockIdx.x * per_round; round < jobs; round += step) {
        int job = round + slot;
        live = job < jobs;
        acc[0] = acc[1] = 0.0f;
        if (live) {
            if (job != first) {
                place(job);
                load(u0);
            }
            compute(u0);
            for (int base = u0 + DMMA_UNITS; base < u1; base += DMMA_UNITS) {
                load(base);
                compute(base);
            }
        }
        if (parts == 1) {
            if (live && q < nrows) {
                float* out = cur.out + (size_t)q * cur.rows;
                if (r0 + g < cur.rows) out[r0 + g] = acc[0] * inv;
                if (r0 + g + 8 < cur.rows) out[r0 + g + 8] = acc[1] * inv;
            }
            continue;
        }
        if (q < R) {
            red[(warp * R + q) * RMMA_ROWS + g] = acc[0];
            red[(warp * R + q) * RMMA_ROWS + g + 8] = acc[1];
        }
        __syncthreads();
        // The first part's warp adds the job's parts, in order, for each input row.
        for (int i = lane; live && part == 0 && i < nrows * RMMA_ROWS; i += WARP) {
            int row = i / RMMA_ROWS, o = i % RMMA_ROWS;
            if (r0 + o >= cur.rows) continue;
            float v = 0.0f;
            for (int k = 0; k < parts; k++) v += red[((warp + k) * R + row) * RMMA_ROWS + o];
            cur.out[(size_t)row * cur.rows + r0 + o] = v * inv;
        }
        __syncthreads();
    }
}

// The kernels: x as it is, and (`_norm_`) through the residual add and norm. Two entries,
// not a branch: a branch on the norm in one kernel made ptxas spill the loaded words of
// the plain one (420 bytes at q4 against 24).
#define DENSE_MMA_ARGS                                                                        \
    const unsigned *w0, const unsigned short *s0, const unsigned short *b0, float *out0,      \
        int rows0, const unsigned *w1, const unsigned short *s1, const unsigned short *b1,    \
        float *out1, int rows1, const unsigned *w2, const unsigned short *s2,                 \
        const unsigned short *b2, float *out2, int rows2, int mats, const float *x, int cols, \
        int in_dim, int parts
#define DENSE_MATS                                                                            \
    {{w0, s0, b0, out0, rows0}, {w1, s1, b1, out1, rows1}, { w2, s2, b2, out2, rows2 }}
#define DENSE_MMA(B)                                                                          \
    extern "C" __global__ void __launch_bounds__(RMMA_WARPS * WARP, DMMA_BLOCKS)              \
        dense_mma_q##B(DENSE_MMA_ARGS) {                                                      \
        PDL_LAUNCH();                                                                         \
        const DenseMat m[3] = DENSE_MATS;                                                     \
        dense_mma<B, false>(m, mats, x, cols, in_dim, parts, {});                             \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(RMMA_WARPS * WARP, DMMA_BLOCKS)              \
        dense_mma_norm_q##B(DENSE_MMA_ARGS, const float* delta, const float* norm_w, float eps, \
                            float* sum) {                                                     \
        PDL_LAUNCH();                                                                         \
        const DenseMat m[3] = DENSE_MATS;                                                     \
        dense_mma<B, true>(m, mats, x, cols, in_dim, parts, {delta, norm_w, eps, sum});       \
    }

// The same on matrices in unit tiles (load_unit_tiled; `s*` the tiles' scales and biases,
// `b*` unused), at 4 and 2 bits.
#define DENSE_MMA_TILED(B)                                                                    \
    extern "C" __global__ void __launch_bounds__(RMMA_WARPS * WARP, DMMA_BLOCKS)              \
        dense_mma_tiled_q##B(DENSE_MMA_ARGS) {                                                \
        PDL_LAUNCH();                                                                         \
        const DenseMat m[3] = DENSE_MATS;                                                     \
        dense_mma<B, false, true>(m, mats, x, cols, in_dim, parts, {});                       \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(RMMA_WARPS * WARP, DMMA_BLOCKS)              \
        dense_mma_norm_tiled_q##B(DENSE_MMA_ARGS, const float* delta, const float* norm_w,    \
                                  float eps, float* sum) {                                    \
        PDL_LAUNCH();                                                                         \
        const DenseMat m[3] = DENSE_MATS;                                                     \
        dense_mma<B, true, true>(m, mats, x, cols, in_dim, parts, {delta, norm_w, eps, sum}); \
    }

// Up to DMMA_ROWS input rows at once (several sequences' decode rows), x as it is, in
// rows or (at 4 and 2 bits) in unit tiles.
#define DMMA_ROWS 4
#define DENSE_MMA_ROWS(B, NAME, TILED)                                                        \
    extern "C" __global__ void __launch_bounds__(RMMA_WARPS * WARP, DMMA_BLOCKS)              \
        dense_mma_rows_##NAME(DENSE_MMA_ARGS, int nrows) {                                    \
        PDL_LAUNCH();                                                                         \
        const DenseMat m[3] = DENSE_MATS;                                                     \
        dense_mma<B, false, TILED, DMMA_ROWS>(m, mats, x, cols, in_dim, parts, {}, nrows);    \
    }

DENSE_MMA(4)
DENSE_MMA(3)
DENSE_MMA(2)
DENSE_MMA_TILED(4)
DENSE_MMA_TILED(2)
DENSE_MMA_ROWS(4, q4, false)
DENSE_MMA_ROWS(3, q3, false)
DENSE_MMA_ROWS(2, q2, false)
DENSE_MMA_ROWS(4, tiled_q4, true)
DENSE_MMA_ROWS(2, tiled_q2, true)

//! Affine and VQ products: matrix-vector, one-row tensor-core (with and without the
//! folded residual norm), grouped GEMMs, and VQ experts through grouped SwiGLU.

use super::*;

#[test]
fn affine_products_match_the_reference_at_every_width_and_batch() {
    let Some(_) = gpu() else { return };
    // Expert shapes of Qwen3-30B-A3B (768 x 2048 and back), a padded input (80 columns
    // of a 128-column matrix), batches on the matrix-vector path (1, 3, 4, 6: one and
    // two tiles) and on the expand-then-GEMM path (9, 40).
    let shapes = [(768, 2048, 2048), (2048, 768, 768), (96, 128, 80)];
    for bits in [4, 3, 2] {
        for (i, &(rows, cols, in_dim)) in shapes.iter().enumerate() {
            let m = affine(rows, cols, bits, 40 + i as u64);
            for batch in [1, 3, 4, 6, 9, 40] {
                let x = fresh(batch * in_dim, 50 + batch as u64);
                let w = m.view();
                both!(
                    &format!("affine q{bits} {rows}x{cols} (in {in_dim}) batch {batch}"),
                    &[&x],
                    batch * rows,
                    1e-5,
                    |b, t, o| b.matmul_affine(&t[0], &w, batch, in_dim, o)
                );
            }
        }
    }
}

#[test]
fn dense_affine_products_match_the_reference_every_way() {
    let Some(_) = gpu() else { return };
    // Dense layers at an affine codec: the LM head and attention shapes of Qwen3-30B-A3B
    // (one row: `dense_mma`, which splits a job of the narrow ones over warps and loops a
    // grid over the head's 9 496 tiles), a ragged 100-row matrix with a padded input;
    // several sequences' decode rows (`dense_mma_rows`, four rows a launch, two for the
    // 4096-column output projection, whose staged rows would not fit four), and prompts
    // of 17 and 300 rows (the grouped GEMM with one group). Each also the other way: a few
    // rows through the matrix-vector kernel, prompts through expand-then-GEMM.
    let shapes = [
        (151936, 2048, 2048, 1),
        (4096, 2048, 2048, 1),
        (2048, 4096, 4096, 1),
        (512, 2048, 2048, 1),
        (100, 192, 150, 1),
        (151936, 2048, 2048, 8),
        (4096, 2048, 2048, 9),
        (2048, 4096, 4096, 5),
        (100, 192, 150, 2),
        (100, 192, 150, 16),
        (512, 2048, 2048, 17),
        (512, 2048, 2048, 300),
        (100, 192, 150, 40),
    ];
    for bits in [4, 3, 2] {
        for (i, &(rows, cols, in_dim, batch)) in shapes.iter().enumerate() {
            let m = affine(rows, cols, bits, 70 + i as u64);
            let x = fresh(batch * in_dim, 75 + i as u64);
            let w = m.view();
            for tensor_cores in [true, false] {
                both!(
                    on device(tensor_cores);
                    &format!(
                        "dense q{bits} {rows}x{cols} (in {in_dim}) rows {batch} mma {tensor_cores}"
                    ),
                    &[&x],
                    batch * rows,
                    1e-5,
                    |b, t, o| b.matmul_affine(&t[0], &w, batch, in_dim, o)
                );
            }
        }
        // A layer's q, k and v at the codec in one launch (on tensor cores), and a ragged
        // three, for one row and for six (two launches of the rows kernel); without tensor
        // cores, one product after another.
        let cases = [
            ([4096, 512, 512], 2048, 1),
            ([37, 5, 21], 128, 1),
            ([4096, 512, 512], 2048, 6),
        ];
        for (case, (dims, cols, rows)) in cases.into_iter().enumerate() {
            let ms: Vec<Affine> = (0..3)
                .map(|j| affine(dims[j], cols, bits, 80 + 3 * case as u64 + j as u64))
                .collect();
            let x = fresh(rows * cols, 85 + case as u64);
            let total: usize = rows * dims.iter().sum::<usize>();
            for tensor_cores in [true, false] {
                both!(
                    on device(tensor_cores);
                    &format!("linear3 q{bits} {dims:?} x {cols}, {rows} rows, mma {tensor_cores}"),
                    &[&x],
                    total,
                    1e-5,
                    |b, t, o| {
                        let [mut q, mut k, mut v] = dims.map(|d| b.alloc(rows * d));
                        b.linear3(
                            &t[0],
                            [0, 1, 2].map(|j| Weight::Affine(ms[j].view())),
                            rows,
                            cols,
                            dims,
                            [&mut q, &mut k, &mut v],
                        );
                        let parts = [(&q, rows * dims[0]), (&k, rows * dims[1]), (&v, rows * dims[2])];
                        concat(b, &parts, o)
                    }
                );
            }
        }
    }
}

/// The [`AddNorm`] of inputs `[x, delta, w]` (`dim` wide), with the add or without;
/// without, `sum` (which no op then writes) is set to x, the residual it stands for.
fn add_norm_case<'t, B: Backend>(
    b: &B,
    t: &'t [B::Tensor],
    added: bool,
    eps: f32,
    sum: &mut B::Tensor,
    dim: usize,
) -> AddNorm<'t, B::Tensor> {
    if !added {
        b.write_rows(&t[0], sum, 0, 1, dim);
    }
    AddNorm {
        x: &t[0],
        delta: added.then_some(&t[1]),
        w: &t[2],
        eps,
    }
}

#[test]
fn residual_norms_folded_into_the_products_match_the_reference() {
    let Some(_) = gpu() else { return };
    // A decode step's q/k/v (one `dense_mma` launch that adds the residual and norms its
    // input itself) and its LM head, at each codec: Qwen3-30B-A3B's shapes and a ragged
    // three over a padded input; with the residual add and without it (the first
    // layer's norm reads the embedding), and each also through the separate norm
    // (matrix-vector kernels). Outputs: the products, then the sum.
    let eps = 1e-6;
    for bits in [4, 3, 2] {
        for (case, (dims, cols, in_dim)) in
            [([4096, 512, 512], 2048, 2048), ([37, 5, 21], 192, 150)]
                .into_iter()
                .enumerate()
        {
            let salt = 300 + 10 * case as u64 + bits as u64;
            let ms: Vec<Affine> = (0..3)
                .map(|j| affine(dims[j], cols, bits, salt + j as u64))
                .collect();
            let head = affine(if case == 0 { 151936 } else { 300 }, cols, bits, salt + 3);
            let (x, d, w) = (
                fresh(in_dim, salt + 4),
                fresh(in_dim, salt + 5),
                fresh(in_dim, salt + 6),
            );
            for (added, tensor_cores) in [(true, true), (false, true), (true, false)] {
                let g = device(tensor_cores);
                let label = format!(
                    "q{bits} {dims:?} x {cols} (in {in_dim}) add {added} mma {tensor_cores}"
                );
                let total: usize = dims.iter().sum();
                both!(
                    on g;
                    &format!("add_rms_norm_linear3 {label}"),
                    &[&x, &d, &w],
                    total + in_dim,
                    1e-5,
                    |b, t, o| {
                        let (mut q, mut k, mut v) =
                            (b.alloc(dims[0]), b.alloc(dims[1]), b.alloc(dims[2]));
                        let (mut sum, mut xn) = (b.alloc(in_dim), b.alloc(in_dim));
                        let n = add_norm_case(b, t, added, eps, &mut sum, in_dim);
                        b.add_rms_norm_linear3(
                            n,
                            &mut sum,
                            &mut xn,
                            [0, 1, 2].map(|j| Weight::Affine(ms[j].view())),
                            1,
                            in_dim,
                            dims,
                            [&mut q, &mut k, &mut v],
                        );
                        let parts = [(&q, dims[0]), (&k, dims[1]), (&v, dims[2]), (&sum, in_dim)];
                        concat(b, &parts, o)
                    }
                );
                let rows = head.rows;
                both!(
                    on g;
                    &format!("add_rms_norm_linear head {rows} {label}"),
                    &[&x, &d, &w],
                    rows + in_dim,
                    1e-5,
                    |b, t, o| {
                        let (mut out, mut sum, mut xn) =
                            (b.alloc(rows), b.alloc(in_dim), b.alloc(in_dim));
                        let n = add_norm_case(b, t, added, eps, &mut sum, in_dim);
                        let view = Weight::Affine(head.view());
                        b.add_rms_norm_linear(
                            n, &mut sum, &mut xn, view, 1, in_dim, rows, &mut out,
                        );
                        concat(b, &[(&out, rows), (&sum, in_dim)], o)
                    }
                );
            }
        }
    }
}

#[test]
fn vq_products_match_the_reference() {
    let Some(_) = gpu() else { return };
    use dynmoe::codec::vq::{VqMatrix, LADDER};
    // Ragged widths (80 columns: one block of 128; 1500: a block of 1024 and a padded
    // tail), the expert shapes (2048 columns: two blocks of 1024; 768: three of 256),
    // at every rung: books in shared memory and in global memory, vectors of 2 to 16
    // values. Batches 1-4 run from the codes, 5 and 40 decode and run a GEMM.
    let shapes = [(96usize, 80usize), (37, 1500), (768, 2048), (2048, 768)];
    for (ri, rung) in LADDER.into_iter().enumerate() {
        for (si, &(rows, cols)) in shapes.iter().enumerate() {
            let w = fresh(rows * cols, 90 + si as u64);
            let m = VqMatrix::encode(&w, rows, cols, rung, 7 + (ri * 4 + si) as u64).unwrap();
            let view = m.view();
            for batch in [1, 2, 3, 4, 5, 40] {
                let x = fresh(batch * cols, 95 + batch as u64);
                both!(
                    &format!("{} {rows}x{cols} batch {batch}", rung.name()),
                    &[&x],
                    batch * rows,
                    1e-5,
                    |b, t, o| b.matmul_vq(&t[0], &view, batch, o)
                );
            }
        }
    }
}

#[test]
fn coded_embeddings_decode_the_rows_looked_up() {
    let Some(g) = gpu() else { return };
    use dynmoe::codec::vq::{VqMatrix, LADDER};
    // Tables at every affine width and every rung (a vocabulary of 300; 256 values a
    // row, and for VQ a ragged 1500: a block of 1024 and a padded tail), looked up by
    // host ids (repeated, first and last) and by a decode step's id on the device; an
    // id past the table gives a row of NaN on the device.
    let ids = [0u32, 299, 17, 17, 150];
    let vocab = 300;
    let mut tables: Vec<(String, usize, Coded)> = Vec::new();
    for bits in [4u32, 3, 2] {
        let m = affine(vocab, 256, bits, 70 + bits as u64);
        tables.push((format!("q{bits}"), 256, Coded::Affine(m)));
    }
    for (ri, rung) in LADDER.into_iter().enumerate() {
        for dim in [256usize, 1500] {
            let w = fresh(vocab * dim, 80 + ri as u64);
            let m = VqMatrix::encode(&w, vocab, dim, rung, 5 + ri as u64).unwrap();
            tables.push((format!("{} x{dim}", rung.name()), dim, Coded::Vq(m)));
        }
    }
    for (name, dim, table) in &tables {
        let dim = *dim;
        both!(
            &format!("embed {name} ids {ids:?}"),
            &[],
            ids.len() * dim,
            1e-6,
            |b, _t, o| b.embed(table.weight(), dim, &ids, o)
        );
        let step = [f32::from_bits(299), f32::from_bits(0)];
        both!(
            &format!("embed_at {name} id 299"),
            &[&step],
            dim,
            1e-6,
            |b, t, o| b.embed_at(table.weight(), dim, &t[0], o)
        );
        let step = g.upload(&[f32::from_bits(vocab as u32), f32::from_bits(0)]);
        let mut out = g.upload(&fresh(dim, 611));
        g.embed_at(table.weight(), dim, &step, &mut out);
        let mut got = vec![0.0f32; dim];
        g.download(&out, &mut got);
        assert!(got.iter().all(|v| v.is_nan()), "{name}: id past the table");
    }
}

/// A coded embedding table of the test above.
enum Coded {
    Affine(Affine),
    Vq(dynmoe::codec::vq::VqMatrix),
}

impl Coded {
    fn weight<T>(&self) -> Weight<'_, T> {
        match self {
            Coded::Affine(m) => Weight::Affine(m.view()),
            Coded::Vq(m) => Weight::Vq(m.view()),
        }
    }
}

#[test]
fn vq_rotation_matches_the_cpu_rotation() {
    let Some(g) = gpu() else { return };
    use dynmoe::codec::vq::rotation::{block_size, rotate_row, signs};
    // rotate_row also divides each block by its stored norm and multiplies by √R; the
    // activations are rotated without either, so its output is scaled back to compare.
    for (rows, cols, seed) in [
        (3usize, 1500usize, 11u64),
        (4, 80, 12),
        (2, 2048, 13),
        (1, 13, 14),
    ] {
        let block = block_size(cols);
        let blocks = cols.div_ceil(block);
        let x = fresh(rows * cols, 700 + seed);
        let s = signs(seed, block);
        let mut want = Vec::with_capacity(rows * blocks * block);
        for row in x.chunks_exact(cols) {
            let mut dst = vec![0.0f32; blocks * block];
            let mut norms = Vec::new();
            rotate_row(row, &s, &mut dst, |n| norms.push(n.to_f32()));
            for (d, n) in dst.chunks_exact(block).zip(&norms) {
                want.extend(d.iter().map(|v| v * n / (block as f32).sqrt()));
            }
        }
        let xd = g.upload(&x);
        let mut out = g.alloc(want.len());
        g.vq_rotate(&xd, rows, cols, seed, block, &mut out);
        let mut got = vec![0.0; want.len()];
        g.download(&out, &mut got);
        let e = rel_err(&got, &want);
        println!("check vq rotation {rows}x{cols} (block {block}) rel_err {e:.2e}");
        assert!(e < 1e-5, "vq rotation {rows}x{cols}: rel err {e:.2e}");
    }
}

#[test]
fn vq_experts_through_swiglu_groups_match_the_reference() {
    let Some(_) = gpu() else { return };
    use dynmoe::codec::vq::{Rung, VqMatrix};
    // Experts 80 wide (the down input one padded block of 128) over 256-wide rows, with
    // 1 to 20 rows each (matrix-vector and GEMM paths), at a rung with the book in shared
    // memory and one with it in global memory; an affine expert rides along.
    let (hidden, inter, tokens) = (256, 80, 24);
    let x = fresh(tokens * hidden, 170);
    let base = fresh(tokens * hidden, 171);
    let mut rng = Rng::new(172);
    let counts = [1usize, 4, 5, 20];
    for rung in ["3", "2"] {
        let rung = Rung::parse(rung).unwrap();
        let mats: Vec<[VqMatrix; 3]> = (0..counts.len() as u64)
            .map(|e| {
                let enc = |rows, cols, salt| {
                    VqMatrix::encode(&fresh(rows * cols, salt), rows, cols, rung, salt).unwrap()
                };
                [
                    enc(inter, hidden, 180 + 3 * e),
                    enc(inter, hidden, 181 + 3 * e),
                    enc(hidden, inter, 182 + 3 * e),
                ]
            })
            .collect();
        let rows: Vec<Vec<u32>> = counts
            .iter()
            .map(|&n| {
                let mut r: Vec<u32> = (0..tokens as u32).collect();
                for i in (1..r.len()).rev() {
                    r.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                }
                r.truncate(n);
                r
            })
            .collect();
        let scales: Vec<Vec<f32>> = counts.iter().map(|&n| fresh(n, 190 + n as u64)).collect();
        let aff = [
            affine(inter, hidden, 4, 195),
            affine(inter, hidden, 4, 196),
            affine(hidden, 128, 4, 197),
        ];
        let aff_rows: Vec<u32> = (0..tokens as u32).step_by(5).collect();
        let aff_scales = fresh(aff_rows.len(), 198);
        both!(
            &format!("swiglu_groups {} rows {counts:?} + affine q4", rung.name()),
            &[&x, &base],
            tokens * hidden,
            1e-5,
            |b, t, o| {
                b.write_rows(&t[1], o, 0, tokens, hidden);
                let mut groups: Vec<SwiGluGroup<'_, _>> = mats
                    .iter()
                    .zip(rows.iter().zip(&scales))
                    .map(|(m, (r, s))| SwiGluGroup {
                        gate: Weight::Vq(m[0].view()),
                        up: Weight::Vq(m[1].view()),
                        down: Weight::Vq(m[2].view()),
                        intermediate: inter,
                        rows: r,
                        scales: s,
                    })
                    .collect();
                groups.push(SwiGluGroup {
                    gate: Weight::Affine(aff[0].view()),
                    up: Weight::Affine(aff[1].view()),
                    down: Weight::Affine(aff[2].view()),
                    intermediate: inter,
                    rows: &aff_rows,
                    scales: &aff_scales,
                });
                b.swiglu_groups(&t[0], hidden, &groups, o)
            }
        );
    }
}

//! MoE blocks routed on the device: the grouped dispatch, the routed experts against
//! the host route (affine and VQ), and the device weight caches following the host.

use super::*;

#[test]
fn moe_dispatch_matches_the_reference() {
    let Some(_) = gpu() else { return };
    // Experts 80 wide (the down input padded to 128) over 256-wide rows, with 1 to 70
    // rows each; a dense group rides along. On tensor cores every affine group runs
    // through the grouped GEMMs (ragged tiles of 32 pairs, 64 outputs); without, the
    // grouped matrix-vector launch takes the groups of at most 8 rows and the rest run
    // one by one (expand then GEMM).
    let (hidden, inter, tokens) = (256, 80, 80);
    let x = fresh(tokens * hidden, 70);
    let base = fresh(tokens * hidden, 71);
    let mut rng = Rng::new(72);
    let counts = [1usize, 3, 5, 8, 9, 20, 2, 33, 70];
    for (bits, tensor_cores) in [
        (4, true),
        (3, true),
        (2, true),
        (4, false),
        (3, false),
        (2, false),
    ] {
        let mats: Vec<[Affine; 3]> = (0..counts.len() as u64)
            .map(|e| {
                [
                    affine(inter, hidden, bits, 80 + 3 * e),
                    affine(inter, hidden, bits, 81 + 3 * e),
                    affine(hidden, 128, bits, 82 + 3 * e),
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
        let scales: Vec<Vec<f32>> = counts.iter().map(|&n| fresh(n, 90 + n as u64)).collect();
        // The dense group in bf16 at 4 and 2 bits, in f32 at 3; its 8 rows take the
        // widen-then-cuBLAS path for bf16.
        let dense_bf16 = bits != 3;
        let dense = [
            fresh(inter * hidden, 95),
            fresh(inter * hidden, 96),
            fresh(hidden * inter, 97),
        ]
        .map(|m| if dense_bf16 { bf16_values(&m) } else { m });
        let dense_rows: Vec<u32> = (0..tokens as u32).step_by(3).collect();
        let dense_scales = fresh(dense_rows.len(), 98);
        both!(
            on device(tensor_cores);
            &format!("swiglu_groups q{bits} tensor cores {tensor_cores} + dense bf16 {dense_bf16}"),
            &[&x, &base],
            tokens * hidden,
            1e-5,
            |b, t, o| {
                b.write_rows(&t[1], o, 0, tokens, hidden);
                let d = [
                    b.upload_matrix(&dense[0], inter, hidden),
                    b.upload_matrix(&dense[1], inter, hidden),
                    b.upload_matrix(&dense[2], hidden, inter),
                ];
                let mut groups: Vec<SwiGluGroup<'_, _>> = mats
                    .iter()
                    .zip(rows.iter().zip(&scales))
                    .map(|(m, (r, s))| SwiGluGroup {
                        gate: Weight::Affine(m[0].view()),
                        up: Weight::Affine(m[1].view()),
                        down: Weight::Affine(m[2].view()),
                        intermediate: inter,
                        rows: r,
                        scales: s,
                    })
                    .collect();
                groups.push(SwiGluGroup {
                    gate: Weight::Dense(&d[0]),
                    up: Weight::Dense(&d[1]),
                    down: Weight::Dense(&d[2]),
                    intermediate: inter,
                    rows: &dense_rows,
                    scales: &dense_scales,
                });
                b.swiglu_groups(&t[0], hidden, &groups, o)
            }
        );
    }
}

/// The host route of the block: probabilities `[rows, E]` and the output of the chosen
/// experts, on the CPU reference.
#[allow(clippy::too_many_arguments)]
fn routed_reference<'w>(
    x: &[f32],
    gate: &[f32],
    rows: usize,
    hidden: usize,
    experts: usize,
    weights: &dyn Fn(usize) -> [Weight<'w, Vec<f32>>; 3],
    top_k: usize,
    renormalize: bool,
    keep: Option<&[bool]>,
) -> (Vec<f32>, Vec<f32>) {
    let cpu = Cpu::reference();
    let mut probs = vec![f32::NAN; rows * experts];
    cpu.matmul(
        &x.to_vec(),
        &gate.to_vec(),
        rows,
        hidden,
        experts,
        &mut probs,
    );
    cpu.softmax_rows(&mut probs, rows, experts);
    let mut routed: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); experts];
    for r in 0..rows {
        let p = &probs[r * experts..(r + 1) * experts];
        let router = Router::SoftmaxTopK { renormalize };
        let chosen = match keep {
            Some(k) => route(&confine(p, k, router), None, top_k, router),
            None => route(p, None, top_k, router),
        };
        for (&e, &w) in chosen.experts.iter().zip(&chosen.weights) {
            routed[e as usize].0.push(r as u32);
            routed[e as usize].1.push(w);
        }
    }
    let groups: Vec<SwiGluGroup<'_, Vec<f32>>> = routed
        .iter()
        .enumerate()
        .filter(|(_, (r, _))| !r.is_empty())
        .map(|(e, (r, s))| {
            let [gate, up, down] = weights(e);
            SwiGluGroup {
                gate,
                up,
                down,
                intermediate: match gate {
                    Weight::Affine(a) => a.rows,
                    Weight::Vq(v) => v.rows,
                    Weight::Dense(_) => unreachable!("quantized experts"),
                },
                rows: r,
                scales: s,
            }
        })
        .collect();
    let mut out = vec![0.0f32; rows * hidden];
    cpu.swiglu_groups(&x.to_vec(), hidden, &groups, &mut out);
    (probs, out)
}

/// The codes of the experts [`check_routed`] makes: affine at a width, or a VQ rung.
#[derive(Clone, Copy)]
enum Codes {
    Affine(u32),
    Vq(&'static str),
}

/// Random experts `inter` wide over `hidden`-wide rows, gate, up and down each.
enum Experts {
    Affine(Vec<[Affine; 3]>),
    Vq(Vec<[dynmoe::codec::vq::VqMatrix; 3]>),
}

impl Experts {
    fn new(codes: Codes, experts: usize, hidden: usize, inter: usize) -> Experts {
        let salt = |e: usize, p: usize| 300 + (3 * e + p) as u64;
        match codes {
            Codes::Affine(bits) => {
                // The down input padded to whole quantization groups.
                let down_cols = inter.next_multiple_of(64);
                Experts::Affine(
                    (0..experts)
                        .map(|e| {
                            [
                                affine(inter, hidden, bits, salt(e, 0)),
                                affine(inter, hidden, bits, salt(e, 1)),
                                affine(hidden, down_cols, bits, salt(e, 2)),
                            ]
                        })
                        .collect(),
                )
            }
            Codes::Vq(rung) => {
                use dynmoe::codec::vq::{Rung, VqMatrix};
                let rung = Rung::parse(rung).unwrap();
                let enc = |rows, cols, salt| {
                    VqMatrix::encode(&fresh(rows * cols, salt), rows, cols, rung, salt).unwrap()
                };
                Experts::Vq(
                    (0..experts)
                        .map(|e| {
                            [
                                enc(inter, hidden, salt(e, 0)),
                                enc(inter, hidden, salt(e, 1)),
                                enc(hidden, inter, salt(e, 2)),
                            ]
                        })
                        .collect(),
                )
            }
        }
    }

    fn weights<T>(&self, e: usize) -> [Weight<'_, T>; 3] {
        match self {
            Experts::Affine(m) => m[e].each_ref().map(|m| Weight::Affine(m.view())),
            Experts::Vq(m) => m[e].each_ref().map(|m| Weight::Vq(m.view())),
        }
    }
}

impl std::fmt::Display for Codes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Codes::Affine(bits) => write!(f, "q{bits}"),
            Codes::Vq(rung) => write!(f, "vq{rung}"),
        }
    }
}

/// [`Cuda::routed_moe`] against the host route for `experts` random experts (`inter`
/// wide over `hidden`-wide rows) coded as `codes`, for each case (rows, top-k,
/// renormalise, plan mask). With `tie`, experts 3 and 7 have the same router row, the
/// largest logit of row 0 (so top-1 must pick expert 3, the lower id).
fn check_routed(g: &Cuda, hidden: usize, inter: usize, experts: usize, codes: Codes, tie: bool) {
    let keep: Vec<bool> = (0..experts).map(|e| e % 3 != 1).collect();
    let mats = Experts::new(codes, experts, hidden, inter);
    // Past 4 rows of affine experts (several sequences' step, a prompt) and past 8 of VQ
    // ones, pairs are grouped by expert on the device and run through the grouped GEMMs
    // on tensor cores (VQ ones over 512 rows of top-8 in chunks of 4 096 pairs); VQ rungs
    // of 2-value vectors, and rotation blocks under 64, through the decode kernels.
    let mut cases = vec![
        (1, 4, true, false),
        (1, 2, false, true),
        (3, 4, false, false),
        (8, 3, true, true),
        (9, 4, true, false),
        (40, 3, false, true),
    ];
    if experts >= 16 {
        cases.extend([
            (1, 8, true, false),
            (5, 8, true, true),
            (2, 8, false, false),
            (300, 8, true, true),
        ]);
        if matches!(codes, Codes::Vq(_)) {
            cases.push((600, 8, false, true));
        }
    }
    if tie {
        cases.extend([(1, 1, false, false), (1, 1, true, false)]);
    }
    for (case, &(rows, top_k, renormalize, masked)) in cases.iter().enumerate() {
        let salt = 400 + 10 * case as u64 + experts as u64;
        let x = fresh(rows * hidden, salt);
        // Router weights scaled so the probabilities are spread, not one-hot; in bf16
        // (as a checkpoint's) on every other case.
        let mut gate: Vec<f32> = fresh(experts * hidden, salt + 1)
            .iter()
            .map(|v| v * 0.1)
            .collect();
        if tie {
            for e in [3, 7] {
                for (w, xv) in gate[e * hidden..(e + 1) * hidden].iter_mut().zip(&x) {
                    *w = 0.05 * xv;
                }
            }
        }
        let gate_bf16 = case % 2 == 0;
        let gate = if gate_bf16 { bf16_values(&gate) } else { gate };
        let keep = masked.then_some(keep.as_slice());
        let host = |e: usize| -> [Weight<'_, Vec<f32>>; 3] { mats.weights(e) };
        let (want_p, want) = routed_reference(
            &x,
            &gate,
            rows,
            hidden,
            experts,
            &host,
            top_k,
            renormalize,
            keep,
        );
        let dev = |e: usize| -> [Weight<'_, _>; 3] { mats.weights(e) };
        // One block id for every case: each new set of weights under it must replace
        // the device table, never reuse it.
        let ex = RoutedExperts {
            id: 7,
            count: experts,
            weights: &dev,
        };
        let r = DeviceRoute {
            top_k,
            renormalize,
            keep,
        };
        // The probabilities land after `at` poisoned values, as a layer's do.
        let at = 5;
        let (xd, gd) = (g.upload(&x), g.upload_matrix(&gate, experts, hidden));
        assert_eq!(gd.is_bf16(), gate_bf16);
        let mut probs = g.alloc(at + rows * experts);
        let mut out = g.alloc(rows * hidden);
        // Without tensor cores a prompt's affine experts would each be read once per row:
        // the device declines them for the host path, and leaves the outputs alone.
        let declines = !g.tensor_cores() && rows > 8 && matches!(codes, Codes::Affine(_));
        assert_eq!(
            g.routed_moe(
                MoeInput::Rows(&xd),
                rows,
                hidden,
                &gd,
                &ex,
                r,
                &mut probs,
                at,
                &mut out
            ),
            !declines,
            "experts of one shape and codes route on the device (declines {declines})"
        );
        if declines {
            let mut left = vec![0.0; rows * hidden];
            g.download(&out, &mut left);
            assert!(left.iter().all(|v| v.is_nan()), "a declined block wrote");
            continue;
        }
        let mut got = vec![0.0; rows * hidden];
        g.download(&out, &mut got);
        let mut got_p = vec![0.0; at + rows * experts];
        g.download(&probs, &mut got_p);
        let (e_out, e_p) = (rel_err(&got, &want), rel_err(&got_p[at..], &want_p));
        println!(
            "check routed moe {codes} E {experts} rows {rows} top-{top_k} renorm {renormalize:<5} \
             mask {masked:<5} gate bf16 {gate_bf16:<5} tie {tie:<5} tensor cores {:<5} \
             out {e_out:.2e} probs {e_p:.2e}",
            g.tensor_cores(),
        );
        // Past 8 rows a bf16 router's product runs on tensor cores over two bf16 parts of
        // x (about 16 of its bits), and the probabilities differ from the reference by up
        // to ~8e-6 (cuBLAS picks the GEMM per call); the experts' weights carry that.
        let tol = if rows > 8 && gate_bf16 { 2e-5 } else { 1e-5 };
        assert!(
            e_out < tol && e_p < tol,
            "routed moe: {e_out:.2e} {e_p:.2e} over {tol:.0e}"
        );
        assert!(
            got_p[..at].iter().all(|v| v.is_nan()),
            "wrote before its slot"
        );
        if rows == 1 {
            check_routed_add_norm(g, &gate, &gd, &ex, r, hidden, salt, &host, keep);
        }
    }
}

/// A decode step's MoE block reading its row through the post-attention residual add
/// and norm ([`MoeInput::AddNorm`], which the router folds in where it can): the output
/// and probabilities against the reference on the normed row, and the sum the block
/// writes (and the normed row, where the norm is a launch of its own: folded in, nothing
/// writes it).
#[allow(clippy::too_many_arguments)]
fn check_routed_add_norm<'w>(
    g: &Cuda,
    gate: &[f32],
    gd: &<Cuda as Backend>::Matrix,
    ex: &RoutedExperts<'_, <Cuda as Backend>::Matrix>,
    r: DeviceRoute<'_>,
    hidden: usize,
    salt: u64,
    host: &dyn Fn(usize) -> [Weight<'w, Vec<f32>>; 3],
    keep: Option<&[bool]>,
) {
    let (x, d, w) = (
        fresh(hidden, salt + 5),
        fresh(hidden, salt + 6),
        fresh(hidden, salt + 7),
    );
    let eps = 1e-6;
    let sum: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b).collect();
    let mut xn = vec![0.0; hidden];
    Cpu::reference().rms_norm(&sum, &w, 1, hidden, eps, &mut xn);
    let experts = ex.count;
    let (want_p, want) = routed_reference(
        &xn,
        gate,
        1,
        hidden,
        experts,
        host,
        r.top_k,
        r.renormalize,
        keep,
    );
    let (xd, dd, wd) = (g.upload(&x), g.upload(&d), g.upload(&w));
    {
        let (mut sum_d, mut xn_d) = (g.alloc(hidden), g.alloc(hidden));
        let mut probs = g.alloc(experts);
        let mut out = g.alloc(hidden);
        let input = MoeInput::AddNorm {
            n: AddNorm {
                x: &xd,
                delta: Some(&dd),
                w: &wd,
                eps,
            },
            sum: &mut sum_d,
            xn: &mut xn_d,
        };
        assert!(g.routed_moe(input, 1, hidden, gd, ex, r, &mut probs, 0, &mut out));
        let got = |t: &<Cuda as Backend>::Tensor, n: usize| {
            let mut v = vec![0.0; n];
            g.download(t, &mut v);
            v
        };
        // Folded (the router and the routed gate/up read the residual through the norm),
        // the normed row is left as `alloc` made it: NaN.
        let row = got(&xn_d, hidden);
        let fold = row.iter().all(|v| v.is_nan());
        let [e_out, e_p, e_sum, e_xn] = [
            rel_err(&got(&out, hidden), &want),
            rel_err(&got(&probs, experts), &want_p),
            rel_err(&got(&sum_d, hidden), &sum),
            if fold { 0.0 } else { rel_err(&row, &xn) },
        ];
        println!(
            "check routed moe through the residual norm, folded {fold:<5}: out {e_out:.2e} \
             probs {e_p:.2e} sum {e_sum:.2e} row {e_xn:.2e}"
        );
        assert!(
            [e_out, e_p, e_sum, e_xn].iter().all(|&e| e < 1e-5),
            "routed moe with its norm: {e_out:.2e} {e_p:.2e} {e_sum:.2e} {e_xn:.2e}"
        );
    }
}

#[test]
fn moe_routed_on_the_device_matches_the_host_route() {
    let Some(g) = gpu() else { return };
    // 12 experts 80 wide (the down input padded to 128) over 256-wide rows; top-k with
    // and without renormalisation and a plan's mask, one row (decode) to 300 (a prompt,
    // through the grouped GEMMs). Then 128 experts (a block routes its row), with a tie,
    // and 260 (past the 256 a block routes: the route kernel first). At 4 and 2 bits the
    // experts are held in unit tiles (the tiled routed kernels and grouped GEMMs), at 3 in
    // rows. Rows 2112 wide and experts 1600 wide give the tensor-core warps more 64-column
    // units than they load at once (33 for gate and up: 5 a warp and none for the last;
    // 4 × 26 for down), so those take a second round. One row through a bf16 router
    // starts the gate/up kernel early (x staged and the table copied before its launch
    // wait) and down's blocks load their words before theirs; a router in f32 does not.
    // Then the same without tensor cores: decode steps through the matrix-vector kernels,
    // the experts in rows, prompts declined for the host path.
    for g in [g, portable()] {
        for bits in [4, 3, 2] {
            check_routed(g, 256, 80, 12, Codes::Affine(bits), false);
        }
        check_routed(g, 128, 32, 128, Codes::Affine(4), true);
        check_routed(g, 128, 32, 260, Codes::Affine(2), true);
        check_routed(g, 2112, 1600, 6, Codes::Affine(3), false);
    }
}

#[test]
fn vq_experts_routed_on_the_device_match_the_host_route() {
    let Some(g) = gpu() else { return };
    // Experts 80 wide over 256-wide rows (gate and up rotated in one block of 256, down
    // in one padded block of 128) at a rung of each vector length: 8 (book of 64 KiB and
    // of 1 MiB), 4, 16 and 2; prompts take the grouped GEMMs but at 2. Then 128 experts
    // top-8 as Qwen3-30B-A3B routes them, with a tie and past 512 rows (two chunks), over
    // 32-value blocks (down's: prompts through the decode kernels); and that model's own
    // shape (two blocks of 1024 for gate and up, three of 256 for down).
    // Then without tensor cores: decode steps and prompts on CUDA cores (with them, but at
    // 2 values a vector and under 64-value blocks, on tensor cores).
    for g in [g, portable()] {
        for rung in ["1.5", "2", "3", "0.7", "5"] {
            check_routed(g, 256, 80, 12, Codes::Vq(rung), false);
        }
        check_routed(g, 128, 32, 128, Codes::Vq("1.5"), true);
        check_routed(g, 2048, 768, 10, Codes::Vq("1.5"), false);
    }
}

#[test]
fn device_weight_copies_follow_the_host_words() {
    let Some(g) = gpu() else { return };
    // The same host buffer rewritten in place: the cached device copy must not be
    // served for the new words.
    let mut m = affine(64, 128, 4, 60);
    let x = fresh(128, 61);
    let xt = g.upload(&x);
    let mut first = vec![0.0; 64];
    let mut out = g.alloc(64);
    g.matmul_affine(&xt, &m.view(), 1, 128, &mut out);
    g.download(&out, &mut first);
    let fresh_words = affine(64, 128, 4, 62).words;
    m.words.copy_from_slice(&fresh_words);
    let mut second = vec![0.0; 64];
    g.matmul_affine(&xt, &m.view(), 1, 128, &mut out);
    g.download(&out, &mut second);
    let mut want = vec![0.0; 64];
    Cpu::reference().matmul_affine(&x, &m.view(), 1, 128, &mut want);
    assert!(rel_err(&second, &want) < 1e-5);
    assert!(rel_err(&first, &want) > 1e-2);
}

#[test]
fn device_vq_copies_follow_the_host_codes() {
    let Some(g) = gpu() else { return };
    use dynmoe::codec::vq::{Rung, VqMatrix};
    // Codes rewritten in place, the seed and norms unchanged: the fingerprint's sampled
    // code bytes must tell the copies apart.
    let rung = Rung::parse("3").unwrap();
    let (rows, cols) = (64, 256);
    let mut m = VqMatrix::encode(&fresh(rows * cols, 160), rows, cols, rung, 5).unwrap();
    let other = VqMatrix::encode(&fresh(rows * cols, 161), rows, cols, rung, 5).unwrap();
    let x = fresh(cols, 162);
    let xt = g.upload(&x);
    let mut out = g.alloc(rows);
    let mut first = vec![0.0; rows];
    g.matmul_vq(&xt, &m.view(), 1, &mut out);
    g.download(&out, &mut first);
    m.codes.copy_from_slice(&other.codes);
    let mut second = vec![0.0; rows];
    g.matmul_vq(&xt, &m.view(), 1, &mut out);
    g.download(&out, &mut second);
    let mut want = vec![0.0; rows];
    Cpu::reference().matmul_vq(&x, &m.view(), 1, &mut want);
    assert!(rel_err(&second, &want) < 1e-5);
    assert!(rel_err(&first, &want) > 1e-2);
}

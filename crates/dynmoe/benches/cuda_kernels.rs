//! Quantized expert kernels on the GPU against the copy bandwidth measured in the same
//! run: affine q4/q3/q2 and VQ vq1.5/vq2/vq3 products at Qwen3-30B-A3B's expert shapes
//! (768 × 2048 gate/up, 2048 × 768 down) and decode-sized batches, dense f32 cuBLAS for
//! context, and the dense matrix-vector kernels (f32 and bf16) at the attention and
//! LM-head shapes. A VQ product's time includes rotating its activations. Attention at
//! Qwen3-30B-A3B's heads: decode over caches of 16–4096 keys, prefill of 512 and 2048 rows.
//!
//! Each kernel rotates over enough copies of its matrix to exceed the 60 MB L2 several
//! times, so weights come from device memory. Times are CUDA-event medians of 15 runs of
//! one pass over all copies, after a warm-up pass (which also uploads the weights).
//! Prints a table and writes `cuda_kernels.json` to `bench/results/` (or to the
//! directory `DYNMOE_BENCH_OUT` names).
//!
//! `cargo bench -p dynmoe --features cuda --bench cuda_kernels`

use dynmoe::backend::cuda::Tuning;
use dynmoe::backend::{
    attention_preamble_one_by_one, AttentionShape, Backend, Cuda, DeviceRoute, HeadNorm, MoeInput,
    RoutedExperts, SwiGluGroup, Weight,
};
use dynmoe::codec::affine::kernels::AffineView;
use dynmoe::codec::affine::lowbit::words_per_row;
use dynmoe::codec::vq::{rotation, row_bytes, Rung, VqView};
use dynmoe::testing::{fresh, Rng};
use half::{bf16, f16};
use serde::Serialize;

const SHAPES: [(usize, usize); 2] = [(768, 2048), (2048, 768)];
const BATCHES: [usize; 3] = [1, 4, 8];
/// Bytes of weights each case rotates over.
const WORKING_SET: usize = 512 << 20;
const REPEATS: usize = 15;

#[derive(Serialize)]
struct Row {
    kernel: String,
    rows: usize,
    cols: usize,
    batch: usize,
    weight_bytes: usize,
    copies: usize,
    median_us_per_call: f64,
    gb_s: f64,
    fraction_of_copy: f64,
}

impl Row {
    /// `kernel`'s row: `[rows, cols, batch]`, `per_call` µs a call moving `bytes`, over
    /// `copies` copies of the weights, against the copy kernel's `copy_gb_s`.
    fn new(
        kernel: impl Into<String>,
        [rows, cols, batch]: [usize; 3],
        bytes: usize,
        copies: usize,
        per_call: f64,
        copy_gb_s: f64,
    ) -> Row {
        let gb_s = bytes as f64 / (per_call * 1e-6) / 1e9;
        Row {
            kernel: kernel.into(),
            rows,
            cols,
            batch,
            weight_bytes: bytes,
            copies,
            median_us_per_call: per_call,
            gb_s,
            fraction_of_copy: gb_s / copy_gb_s,
        }
    }
}

/// Prints `row` as a line of the table under `label`, `note` after it, and keeps it for
/// the JSON.
fn report(rows_out: &mut Vec<Row>, label: &str, row: Row, note: &str) {
    println!(
        "{label:<10} {:>6} {:>6} {:>5} {:>10.2} {:>8.0} {:>7.2}{note}",
        row.rows, row.cols, row.batch, row.median_us_per_call, row.gb_s, row.fraction_of_copy
    );
    rows_out.push(row);
}

#[derive(Serialize)]
struct Report {
    device: String,
    arch: String,
    copy_gb_s: f64,
    copy_bytes: usize,
    rows: Vec<Row>,
}

/// Calls of a small kernel recorded in one graph, for [`graph_us`].
const GRAPH_CALLS: usize = 200;

/// Median µs per call of `op`: [`GRAPH_CALLS`] calls recorded once as a CUDA graph (the
/// way a decode step runs them) and replayed, so the host's cost of a launch is not
/// counted. One call first, outside the record, grows any scratch the op needs. `op`
/// gets the call's index (to rotate over copies of its weights).
fn graph_us(g: &Cuda, key: u64, mut op: impl FnMut(usize)) -> f64 {
    op(0);
    g.synchronize();
    let mut body = || {
        for i in 0..GRAPH_CALLS {
            op(i);
        }
        true
    };
    let ms = time_ms(g, || {
        assert!(
            g.replay_step((usize::MAX - 1, key), &mut body),
            "the calls were recorded as a graph"
        );
    });
    ms * 1e3 / GRAPH_CALLS as f64
}

/// Median milliseconds of `f` over `REPEATS` event-timed runs, after one warm-up.
fn time_ms(g: &Cuda, mut f: impl FnMut()) -> f64 {
    f();
    g.synchronize();
    let mut ts: Vec<f64> = (0..REPEATS).map(|_| g.time_ms(&mut f)).collect();
    ts.sort_by(f64::total_cmp);
    ts[REPEATS / 2]
}

/// `len` fresh values (seed `salt`) rounded to bf16, as a checkpoint's dense matrices are
/// (so the device keeps them in bf16).
fn fresh_bf16(len: usize, salt: u64) -> Vec<f32> {
    fresh(len, salt)
        .into_iter()
        .map(|v| bf16::from_f32(v).to_f32())
        .collect()
}

/// A routed MoE block's inputs on one device: decode rows, a bf16 router and the
/// probabilities' and output's buffers (`rows` rows of them).
struct StepInputs {
    hidden: usize,
    xs: Vec<<Cuda as Backend>::Tensor>,
    gate: <Cuda as Backend>::Matrix,
    probs: <Cuda as Backend>::Tensor,
    out: <Cuda as Backend>::Tensor,
}

impl StepInputs {
    /// `tokens` fresh rows (seeds from `x_salt`) of `hidden` and a router over `experts`
    /// (seed `gate_salt`) on `d`.
    fn new(
        d: &Cuda,
        [hidden, experts, tokens, rows]: [usize; 4],
        [gate_salt, x_salt]: [u64; 2],
    ) -> Self {
        StepInputs {
            hidden,
            xs: (0..tokens)
                .map(|t| d.upload(&fresh(hidden, x_salt + t as u64)))
                .collect(),
            gate: d.upload_matrix(&fresh_bf16(experts * hidden, gate_salt), experts, hidden),
            probs: d.alloc(rows * experts),
            out: d.alloc(rows * hidden),
        }
    }

    /// Row `t` through `routed` on `d` (which the inputs are on), its probabilities at the
    /// start of `probs`.
    fn route(
        &mut self,
        d: &Cuda,
        t: usize,
        routed: &RoutedExperts<'_, <Cuda as Backend>::Matrix>,
        route: DeviceRoute<'_>,
    ) -> bool {
        d.routed_moe(
            MoeInput::Rows(&self.xs[t]),
            1,
            self.hidden,
            &self.gate,
            routed,
            route,
            &mut self.probs,
            0,
            &mut self.out,
        )
    }
}

/// One decode token's routed step (`routed`, each of `tokens` rows of `inputs` in turn) two
/// ways: on tensor cores (`devices[0]`, graph key `key`), then on CUDA cores (`devices[1]`,
/// `key + 1`), each launched call by call and then recorded as a graph (as a decode step
/// runs): a printed line and a row `name_{mma,matvec}_{eager,graph}` of each, `bytes` a
/// token.
#[allow(clippy::too_many_arguments)]
fn routed_step_rows(
    devices: [&Cuda; 2],
    inputs: &mut [StepInputs; 2],
    key: u64,
    tokens: usize,
    routed: &RoutedExperts<'_, <Cuda as Backend>::Matrix>,
    route: DeviceRoute<'_>,
    [label, name]: [&str; 2],
    [inter, hidden]: [usize; 2],
    bytes: usize,
    copy_gb_s: f64,
    rows_out: &mut Vec<Row>,
) {
    for (i, way) in ["mma", "matvec"].into_iter().enumerate() {
        let (d, inputs) = (devices[i], &mut inputs[i]);
        let mut step = |t: usize| {
            let done = inputs.route(d, t % tokens, routed, route);
            assert!(done, "experts of one shape route on the device");
        };
        let ms = time_ms(d, || (0..tokens).for_each(&mut step));
        let eager = ms * 1e3 / tokens as f64;
        let graph = graph_us(d, key + i as u64, step);
        for (per_token, launched) in [(eager, "eager"), (graph, "graph")] {
            let row = Row::new(
                format!("{name}_{way}_{launched}"),
                [inter, hidden, 1],
                bytes,
                tokens,
                per_token,
                copy_gb_s,
            );
            report(rows_out, &format!("{label} {way} {launched}"), row, "");
        }
    }
}

struct HostAffine {
    words: Vec<u32>,
    scales: Vec<bf16>,
    biases: Vec<bf16>,
}

impl HostAffine {
    /// Random codes, scales and biases of a `rows` × `cols` matrix at `bits`.
    fn random(rng: &mut Rng, rows: usize, cols: usize, bits: u32) -> HostAffine {
        let groups = rows * cols / 64;
        HostAffine {
            words: (0..rows * words_per_row(cols, bits))
                .map(|_| rng.next_u64() as u32)
                .collect(),
            scales: (0..groups)
                .map(|_| bf16::from_f32(0.01 + 0.01 * rng.uniform()))
                .collect(),
            biases: (0..groups)
                .map(|_| bf16::from_f32(-0.08 * rng.uniform()))
                .collect(),
        }
    }

    fn view(&self, bits: u32, rows: usize, cols: usize) -> AffineView<'_> {
        AffineView {
            bits,
            rows,
            cols,
            words: &self.words,
            scales: &self.scales,
            biases: &self.biases,
        }
    }
}

fn main() {
    let g = match Cuda::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    println!("{} ({})", g.device_name(), g.arch());
    // The same device without tensor cores: the portable kernels, measured beside them.
    let portable = Tuning {
        tensor_cores: false,
        ..g.tuning().clone()
    };
    let portable = Cuda::with_tuning(0, portable).expect("the device was made once");

    // Copy ceiling: 1 GiB read + 1 GiB written per pass.
    let copy_bytes = 2 << 30;
    let copy_gb_s = g.copy_bandwidth();
    println!("copy kernel: {copy_gb_s:.0} GB/s (read + write, 1 GiB each way)");

    // DYNMOE_BENCH_ONLY=moe,attention runs only the sections named (affine, vq, moe,
    // moe-vq, dense, attention, prefill, small); every one by default.
    let only = std::env::var("DYNMOE_BENCH_ONLY").ok();
    let want = |section: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|s| s.trim() == section))
    };
    let mut rows_out = Vec::new();
    println!(
        "{:<10} {:>6} {:>6} {:>5} {:>10} {:>8} {:>7}",
        "kernel", "rows", "cols", "batch", "us/call", "GB/s", "of copy"
    );
    let mut rng = Rng::new(7);
    if want("affine") {
        for (rows, cols) in SHAPES {
            let groups = rows * cols / 64;
            for bits in [4u32, 3, 2] {
                let nw = rows * words_per_row(cols, bits);
                let bytes = nw * 4 + groups * 4;
                let copies = WORKING_SET.div_ceil(bytes);
                let mats: Vec<HostAffine> = (0..copies)
                    .map(|_| HostAffine::random(&mut rng, rows, cols, bits))
                    .collect();
                let views: Vec<AffineView<'_>> =
                    mats.iter().map(|m| m.view(bits, rows, cols)).collect();
                for batch in BATCHES {
                    let x = g.upload(&fresh(batch * cols, 9));
                    let mut out = g.alloc(batch * rows);
                    let ms = time_ms(&g, || {
                        for v in &views {
                            g.matmul_affine(&x, v, batch, cols, &mut out);
                        }
                    });
                    let per_call = ms * 1e3 / copies as f64;
                    let row = Row::new(
                        format!("affine_q{bits}"),
                        [rows, cols, batch],
                        bytes,
                        copies,
                        per_call,
                        copy_gb_s,
                    );
                    report(&mut rows_out, &format!("q{bits}"), row, "");
                }
                drop(views);
                g.clear_weight_cache();
            }
            // Dense f32 through cuBLAS, fewer copies (4 bytes a weight).
            let bytes = rows * cols * 4;
            let copies = WORKING_SET.div_ceil(bytes);
            let ws: Vec<_> = (0..copies)
                .map(|i| g.upload_matrix(&fresh(rows * cols, 100 + i as u64), rows, cols))
                .collect();
            for batch in BATCHES {
                let x = g.upload(&fresh(batch * cols, 9));
                let mut out = g.alloc(batch * rows);
                let ms = time_ms(&g, || {
                    for w in &ws {
                        g.matmul(&x, w, batch, cols, rows, &mut out);
                    }
                });
                let per_call = ms * 1e3 / copies as f64;
                let row = Row::new(
                    "cublas_sgemm_f32",
                    [rows, cols, batch],
                    bytes,
                    copies,
                    per_call,
                    copy_gb_s,
                );
                report(&mut rows_out, "f32 sgemm", row, "");
            }
        }
    }

    if want("vq") {
        // VQ-ladder products read from the codes (`matmul_vq`: the activations rotated, then
        // the matrix-vector kernel), random codes and norms; bytes are the codes and norms.
        for (rows, cols) in SHAPES {
            for rung in ["1.5", "2", "3"] {
                let rung = Rung::parse(rung).expect("a ladder rung");
                let blocks = cols.div_ceil(rotation::block_size(cols));
                let code_bytes = rows * row_bytes(rung, cols);
                let bytes = code_bytes + rows * blocks * 2;
                let copies = WORKING_SET.div_ceil(bytes);
                let mats: Vec<(Vec<u8>, Vec<f16>)> = (0..copies)
                    .map(|_| {
                        let codes = (0..code_bytes.div_ceil(8))
                            .flat_map(|_| rng.next_u64().to_le_bytes())
                            .take(code_bytes)
                            .collect();
                        let norms = (0..rows * blocks)
                            .map(|_| f16::from_f32(20.0 + 10.0 * rng.uniform()))
                            .collect();
                        (codes, norms)
                    })
                    .collect();
                let views: Vec<VqView<'_>> = mats
                    .iter()
                    .map(|(c, n)| VqView::from_parts(rows, cols, rung, 3, n, c).expect("sizes"))
                    .collect();
                for batch in [1, 4] {
                    let x = g.upload(&fresh(batch * cols, 9));
                    let mut out = g.alloc(batch * rows);
                    let ms = time_ms(&g, || {
                        for v in &views {
                            g.matmul_vq(&x, v, batch, &mut out);
                        }
                    });
                    let per_call = ms * 1e3 / copies as f64;
                    let row = Row::new(
                        format!("{}_matvec", rung.name()),
                        [rows, cols, batch],
                        bytes,
                        copies,
                        per_call,
                        copy_gb_s,
                    );
                    report(&mut rows_out, &rung.name(), row, "");
                }
                drop(views);
                g.clear_weight_cache();
            }
        }
    }

    let (hidden, inter, experts, top_k, tokens) = (2048, 768, 128, 8, 64);
    if want("moe") {
        // The MoE dispatch of one decode token: top-8 of 128 experts (gate, up, down at
        // 768 x 2048), each token's 8 drawn anew, through `swiglu_groups` (one grouped
        // launch for gate and up, one for down).
        for bits in [4u32, 3, 2] {
            let mk =
                |rows: usize, cols: usize, rng: &mut Rng| HostAffine::random(rng, rows, cols, bits);
            let mats: Vec<[HostAffine; 3]> = (0..experts)
                .map(|_| {
                    [
                        mk(inter, hidden, &mut rng),
                        mk(inter, hidden, &mut rng),
                        mk(hidden, inter, &mut rng),
                    ]
                })
                .collect();
            let picks: Vec<Vec<usize>> = (0..tokens)
                .map(|_| {
                    let mut p: Vec<usize> = (0..experts).collect();
                    for i in 0..top_k {
                        let j = i + (rng.next_u64() % (experts - i) as u64) as usize;
                        p.swap(i, j);
                    }
                    p.truncate(top_k);
                    p
                })
                .collect();
            let row0 = [0u32];
            let scales = vec![0.125f32; top_k];
            let x = g.upload(&fresh(hidden, 11));
            let mut out = g.zeros(hidden);
            let ms = time_ms(&g, || {
                for p in &picks {
                    let groups: Vec<SwiGluGroup<'_, _>> = p
                        .iter()
                        .map(|&e| SwiGluGroup {
                            gate: Weight::Affine(mats[e][0].view(bits, inter, hidden)),
                            up: Weight::Affine(mats[e][1].view(bits, inter, hidden)),
                            down: Weight::Affine(mats[e][2].view(bits, hidden, inter)),
                            intermediate: inter,
                            rows: &row0,
                            scales: &scales[..1],
                        })
                        .collect();
                    g.swiglu_groups(&x, hidden, &groups, &mut out);
                }
            });
            let per_token = ms * 1e3 / tokens as f64;
            let bytes = top_k
                * (2 * (inter * words_per_row(hidden, bits) * 4 + inter * hidden / 64 * 4)
                    + hidden * words_per_row(inter, bits) * 4
                    + hidden * inter / 64 * 4);
            let row = Row::new(
                format!("moe_decode_top8_q{bits}"),
                [inter, hidden, 1],
                bytes,
                tokens,
                per_token,
                copy_gb_s,
            );
            report(&mut rows_out, &format!("moe8 q{bits}"), row, "");
            // The same experts routed on the device (`routed_moe`: router, top-8, grouped
            // products and combine, no host round trip), a fresh input row per token.
            let weights = |e: usize| {
                [
                    Weight::Affine(mats[e][0].view(bits, inter, hidden)),
                    Weight::Affine(mats[e][1].view(bits, inter, hidden)),
                    Weight::Affine(mats[e][2].view(bits, hidden, inter)),
                ]
            };
            let routed = RoutedExperts {
                id: 1,
                count: experts,
                weights: &weights,
            };
            let route = DeviceRoute {
                top_k,
                renormalize: true,
                keep: None,
            };
            let mut inputs = [&g, &portable]
                .map(|d| StepInputs::new(d, [hidden, experts, tokens, 1], [12, 200]));
            routed_step_rows(
                [&g, &portable],
                &mut inputs,
                100 + 4 * bits as u64,
                tokens,
                &routed,
                route,
                [
                    &format!("routed q{bits}"),
                    &format!("moe_routed_on_device_top8_q{bits}"),
                ],
                [inter, hidden],
                bytes,
                copy_gb_s,
                &mut rows_out,
            );
            // Where the routed step's time goes: its router product alone, the same step with
            // the route confined to 8 experts (their 20 MB then stay in L2), and with top-1 of
            // all 128 (an eighth of the bytes, the same launches). Tensor cores, in a graph.
            let eight: Vec<bool> = (0..experts).map(|e| e % 16 == 3).collect();
            let cases = [
                (
                    "l2",
                    "routed step, 8 experts kept (in L2)",
                    top_k,
                    Some(&eight[..]),
                    bytes,
                ),
                ("top1", "routed step, top-1", 1, None, bytes / top_k),
            ];
            let [inputs, _] = &mut inputs;
            let mut logits = g.alloc(experts);
            let us = graph_us(&g, 299 + 4 * bits as u64, |t| {
                g.matmul(
                    &inputs.xs[t % tokens],
                    &inputs.gate,
                    1,
                    hidden,
                    experts,
                    &mut logits,
                )
            });
            let row = Row::new(
                format!("moe_router_q{bits}"),
                [experts, hidden, 1],
                experts * hidden * 2,
                GRAPH_CALLS,
                us,
                copy_gb_s,
            );
            report(
                &mut rows_out,
                &format!("router product alone q{bits}"),
                row,
                "",
            );
            for (i, (name, label, k, keep, b)) in cases.into_iter().enumerate() {
                let route = DeviceRoute {
                    top_k: k,
                    renormalize: true,
                    keep,
                };
                let mut step = |t: usize| {
                    inputs.route(&g, t % tokens, &routed, route);
                };
                step(0);
                let us = graph_us(&g, 300 + 4 * bits as u64 + i as u64, step);
                let row = Row::new(
                    format!("moe_routed_on_device_{name}_q{bits}"),
                    [inter, hidden, 1],
                    b,
                    GRAPH_CALLS,
                    us,
                    copy_gb_s,
                );
                report(&mut rows_out, &format!("{label} q{bits}"), row, "");
            }
            // A 512-token prompt's dispatch of the same experts (each token's top-8 drawn
            // anew, ~32 rows an expert): the grouped GEMMs on tensor cores, then the path
            // without them (grouped matrix-vector for groups of up to 8 rows, the rest one
            // by one). Bytes: every expert's weights read once.
            let prompt = 512;
            let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); experts];
            for t in 0..prompt {
                let mut p: Vec<usize> = (0..experts).collect();
                for i in 0..top_k {
                    let j = i + (rng.next_u64() % (experts - i) as u64) as usize;
                    p.swap(i, j);
                }
                p[..top_k].iter().for_each(|&e| rows_of[e].push(t as u32));
            }
            let gates = vec![0.125f32; prompt];
            let layer_bytes = bytes / top_k * experts;
            let flops = 2.0 * 3.0 * (prompt * top_k * inter * hidden) as f64;
            for (d, tensor_cores) in [(&g, true), (&portable, false)] {
                let xp = d.upload(&fresh(prompt * hidden, 13));
                let mut outp = d.zeros(prompt * hidden);
                let groups: Vec<SwiGluGroup<'_, _>> = rows_of
                    .iter()
                    .enumerate()
                    .map(|(e, r)| SwiGluGroup {
                        gate: Weight::Affine(mats[e][0].view(bits, inter, hidden)),
                        up: Weight::Affine(mats[e][1].view(bits, inter, hidden)),
                        down: Weight::Affine(mats[e][2].view(bits, hidden, inter)),
                        intermediate: inter,
                        rows: r,
                        scales: &gates[..r.len()],
                    })
                    .collect();
                let us = time_ms(d, || d.swiglu_groups(&xp, hidden, &groups, &mut outp)) * 1e3;
                let way = if tensor_cores { "gemm" } else { "1by1" };
                let kind = if tensor_cores {
                    "tensor_core_gemm"
                } else {
                    "without_tensor_cores"
                };
                let row = Row::new(
                    format!("moe_prompt512_top8_q{bits}_{kind}"),
                    [inter, hidden, prompt],
                    layer_bytes,
                    1,
                    us,
                    copy_gb_s,
                );
                let tflops = flops / (us * 1e-6) / 1e12;
                let note = format!("  {tflops:.1} TFLOP/s");
                report(&mut rows_out, &format!("moe512 q{bits} {way}"), row, &note);
            }
            g.clear_weight_cache();
            portable.clear_weight_cache();
        }
    }

    if want("moe-vq") {
        // The same routed step with the experts at VQ rungs (random codes and norms): a
        // decode token's route and top-8 of 128, then a 512-token prompt's, both through the
        // routed VQ kernels. Bytes: the chosen experts' codes and norms (every expert's once
        // for the prompt).
        for rung in ["1.5", "2"] {
            let rung = Rung::parse(rung).expect("a ladder rung");
            let matrix = |rows: usize, cols: usize, rng: &mut Rng| {
                let code_bytes = rows * row_bytes(rung, cols);
                let blocks = cols.div_ceil(rotation::block_size(cols));
                let codes: Vec<u8> = (0..code_bytes.div_ceil(8))
                    .flat_map(|_| rng.next_u64().to_le_bytes())
                    .take(code_bytes)
                    .collect();
                let norms: Vec<f16> = (0..rows * blocks)
                    .map(|_| f16::from_f32(0.5 + 0.5 * rng.uniform()))
                    .collect();
                (codes, norms)
            };
            let mats: Vec<[(Vec<u8>, Vec<f16>); 3]> = (0..experts)
                .map(|_| {
                    [
                        matrix(inter, hidden, &mut rng),
                        matrix(inter, hidden, &mut rng),
                        matrix(hidden, inter, &mut rng),
                    ]
                })
                .collect();
            let expert_bytes: usize = mats[0].iter().map(|(c, n)| c.len() + 2 * n.len()).sum();
            let weights = |e: usize| {
                let view = |p: usize, rows, cols| {
                    let (c, n) = &mats[e][p];
                    let seed = (3 * e + p) as u64;
                    Weight::Vq(VqView::from_parts(rows, cols, rung, seed, n, c).expect("sizes"))
                };
                [
                    view(0, inter, hidden),
                    view(1, inter, hidden),
                    view(2, hidden, inter),
                ]
            };
            let routed = RoutedExperts {
                id: 2,
                count: experts,
                weights: &weights,
            };
            let route = DeviceRoute {
                top_k,
                renormalize: true,
                keep: None,
            };
            let prompt = 512;
            let mut inputs = [&g, &portable]
                .map(|d| StepInputs::new(d, [hidden, experts, tokens, prompt], [14, 300]));
            routed_step_rows(
                [&g, &portable],
                &mut inputs,
                200 + 4 * rung.position() as u64,
                tokens,
                &routed,
                route,
                [
                    &format!("routed {}", rung.name()),
                    &format!("moe_routed_on_device_top8_{}", rung.name()),
                ],
                [inter, hidden],
                top_k * expert_bytes,
                copy_gb_s,
                &mut rows_out,
            );
            let xp = g.upload(&fresh(prompt * hidden, 15));
            let [inputs, _] = &mut inputs;
            let us = time_ms(&g, || {
                let done = g.routed_moe(
                    MoeInput::Rows(&xp),
                    prompt,
                    hidden,
                    &inputs.gate,
                    &routed,
                    route,
                    &mut inputs.probs,
                    0,
                    &mut inputs.out,
                );
                assert!(done, "VQ experts route on the device");
            }) * 1e3;
            let layer_bytes = experts * expert_bytes;
            let flops = 2.0 * 3.0 * (prompt * top_k * inter * hidden) as f64;
            let row = Row::new(
                format!("moe_routed_prompt512_top8_{}", rung.name()),
                [inter, hidden, prompt],
                layer_bytes,
                1,
                us,
                copy_gb_s,
            );
            let note = format!("  {:.1} TFLOP/s", flops / (us * 1e-6) / 1e12);
            report(
                &mut rows_out,
                &format!("routed512 {}", rung.name()),
                row,
                &note,
            );
            g.clear_weight_cache();
            portable.clear_weight_cache();
        }
    }

    if want("dense") {
        // A prompt's dense products (512 rows through a bf16 4096 × 2048 projection): on
        // tensor cores (x split into two bf16 parts, two cuBLAS bf16 GEMMs), then the matrix
        // widened to f32 for cuBLAS' sgemm.
        {
            let (rows, cols, prompt) = (4096, 2048, 512);
            for (d, tensor_cores) in [(&g, true), (&portable, false)] {
                let m = d.upload_matrix(&fresh_bf16(rows * cols, 31), rows, cols);
                let x = d.upload(&fresh(prompt * cols, 32));
                let mut out = d.alloc(prompt * rows);
                let us = time_ms(d, || d.matmul(&x, &m, prompt, cols, rows, &mut out)) * 1e3;
                let tflops = 2.0 * (prompt * rows * cols) as f64 / (us * 1e-6) / 1e12;
                let way = if tensor_cores { "split" } else { "sgemm" };
                let bytes = rows * cols * 2;
                let kind = if tensor_cores {
                    "tensor_core_split"
                } else {
                    "widened_sgemm"
                };
                let row = Row::new(
                    format!("dense_bf16_prompt512_{kind}"),
                    [rows, cols, prompt],
                    bytes,
                    1,
                    us,
                    copy_gb_s,
                );
                let note = format!("  {tflops:.1} TFLOP/s");
                report(&mut rows_out, &format!("bf16 {way}"), row, &note);
            }
        }

        // Dense products of one row at the attention and LM-head shapes (the matrix-vector
        // kernels): f32 values, and the same values rounded to bf16, which the device keeps
        // in bf16 (2 bytes a weight).
        for (rows, cols) in [(4096, 2048), (151936, 2048)] {
            for bf16_weights in [false, true] {
                let width = if bf16_weights { 2 } else { 4 };
                let bytes = rows * cols * width;
                let copies = WORKING_SET.div_ceil(bytes).max(1);
                let ws: Vec<_> = (0..copies)
                    .map(|i| {
                        let mut w = fresh(rows * cols, 300 + i as u64);
                        if bf16_weights {
                            w.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32());
                        }
                        let m = g.upload_matrix(&w, rows, cols);
                        assert_eq!(m.bytes(), bytes, "bf16 values kept in bf16");
                        m
                    })
                    .collect();
                let x = g.upload(&fresh(cols, 9));
                let mut out = g.alloc(rows);
                let ms = time_ms(&g, || {
                    for w in &ws {
                        g.matmul(&x, w, 1, cols, rows, &mut out);
                    }
                });
                let per_call = ms * 1e3 / copies as f64;
                let name = if bf16_weights { "bf16" } else { "f32" };
                let row = Row::new(
                    format!("matvec_{name}"),
                    [rows, cols, 1],
                    bytes,
                    copies,
                    per_call,
                    copy_gb_s,
                );
                report(&mut rows_out, &format!("{name} matvec"), row, "");
            }
        }
    }
    let (heads, kv_heads, head_dim) = (32, 4, 128);
    if want("attention") {
        // Decode attention at Qwen3-30B-A3B's heads (32 query, 4 KV, 128 wide) over a cache of
        // `ctx` positions, the query at the last: the grouped kernel (a block per KV head and
        // chunk), timed as the other rows are (calls queued back to back on the stream,
        // launch costs included) and in a recorded graph (as a decode step runs it).
        for ctx in [16, 640, 4096] {
            let kvw = kv_heads * head_dim;
            let bytes = 2 * ctx * kvw * 4;
            let copies = 12;
            let caches: Vec<_> = (0..copies)
                .map(|i| {
                    (
                        g.upload(&fresh(ctx * kvw, 400 + i as u64)),
                        g.upload(&fresh(ctx * kvw, 500 + i as u64)),
                    )
                })
                .collect();
            let q = g.upload(&fresh(heads * head_dim, 13));
            let mut out = g.alloc(heads * head_dim);
            let shape = AttentionShape {
                rows: 1,
                pos0: ctx - 1,
                heads,
                kv_heads,
                head_dim,
                window: None,
            };
            let ms = time_ms(&g, || {
                for (k, v) in &caches {
                    g.attention(&q, k, v, shape, &mut out);
                }
            });
            let queued = ms * 1e3 / copies as f64;
            let graph = graph_us(&g, 100 + ctx as u64 * 4, |i| {
                let (k, v) = &caches[i % copies];
                g.attention(&q, k, v, shape, &mut out)
            });
            for (label, kernel, per_call) in [
                ("attn dec", "attention_decode", queued),
                ("attn dec g", "attention_decode_graph", graph),
            ] {
                let row = Row::new(kernel, [ctx, kvw, 1], bytes, copies, per_call, copy_gb_s);
                report(&mut rows_out, label, row, "");
            }
        }
    }
    if want("prefill") {
        // Prefill attention at the same heads: a prompt of `n` rows from position 0, causal,
        // through the tiled kernel, timed as the rows above (calls queued back to back, over copies of q and the caches). Bound by
        // arithmetic, not bytes: the table's last columns are GFLOP/s (4 per visible
        // (row, head, key) and head dimension) and, in the JSON, bytes are q, K, V and out.
        for n in [512, 2048] {
            let kvw = kv_heads * head_dim;
            let qw = heads * head_dim;
            let bytes = 2 * n * (qw + kvw) * 4;
            let flop = 4.0 * (heads * head_dim) as f64 * (n * (n + 1) / 2) as f64;
            let copies = 4;
            let inputs: Vec<_> = (0..copies)
                .map(|i| {
                    (
                        g.upload(&fresh(n * qw, 600 + i as u64)),
                        g.upload(&fresh(n * kvw, 700 + i as u64)),
                        g.upload(&fresh(n * kvw, 800 + i as u64)),
                    )
                })
                .collect();
            let mut out = g.alloc(n * qw);
            let shape = AttentionShape {
                rows: n,
                pos0: 0,
                heads,
                kv_heads,
                head_dim,
                window: None,
            };
            let ms = time_ms(&g, || {
                for (q, k, v) in &inputs {
                    g.attention(q, k, v, shape, &mut out);
                }
            });
            let per_call = ms * 1e3 / copies as f64;
            let gflop_s = flop / (per_call * 1e-6) / 1e9;
            let label = "attn pre";
            println!("{label:<10} {n:>6} {kvw:>6} {n:>5} {per_call:>10.2} {gflop_s:>8.0} GFLOP/s");
            rows_out.push(Row::new(
                "attention_prefill_tiled",
                [n, kvw, n],
                bytes,
                copies,
                per_call,
                copy_gb_s,
            ));
        }
    }

    if want("small") {
        // The small kernels of a decode step at Qwen3-30B-A3B's shapes (hidden 2048, 32/4
        // heads of 128, vocabulary 151936), each in a recorded graph; their data stays in L2,
        // so these are latency figures. Bytes: what each call reads and writes. The routed MoE
        // rows above include moe_route and moe_combine.
        let (hidden, vocab) = (2048, 151936);
        let eps = 1e-6;
        let x = g.upload(&fresh(vocab, 20));
        let w = g.upload(&fresh(hidden, 21));
        let delta = g.upload(&fresh(hidden, 22));
        let mut xs = g.upload(&fresh(hidden, 23));
        let mut out = g.alloc(vocab);
        let mut small: Vec<(String, usize, usize, usize, f64)> = Vec::new();
        let us = graph_us(&g, 1, |_| g.argmax_rows(&x, 1, vocab, &mut out, 0));
        small.push(("argmax_rows".into(), 1, vocab, vocab * 4, us));
        let us = graph_us(&g, 2, |_| g.rms_norm(&xs, &w, 1, hidden, eps, &mut out));
        small.push(("rms_norm".into(), 1, hidden, 3 * hidden * 4, us));
        let us = graph_us(&g, 3, |_| {
            g.add_rms_norm(&mut xs, &delta, &w, 1, hidden, eps, &mut out)
        });
        small.push(("add_rms_norm".into(), 1, hidden, 5 * hidden * 4, us));
        let us = graph_us(&g, 4, |_| {
            g.add(&mut xs, &delta, hidden);
            g.rms_norm(&xs, &w, 1, hidden, eps, &mut out)
        });
        small.push(("add_then_rms_norm".into(), 1, hidden, 6 * hidden * 4, us));
        let (heads, kv_heads, head_dim) = (32, 4, 128);
        let qn = g.upload(&fresh(head_dim, 24));
        let mut q = g.upload(&fresh(heads * head_dim, 25));
        let us = graph_us(&g, 5, |_| {
            g.rms_norm_inplace(&mut q, &qn, heads, head_dim, eps)
        });
        small.push((
            "rms_norm_inplace".into(),
            heads,
            head_dim,
            2 * heads * head_dim * 4,
            us,
        ));
        let ctx = 4096;
        let kvw = kv_heads * head_dim;
        let kn = g.upload(&fresh(head_dim, 26));
        let mut k = g.upload(&fresh(kvw, 27));
        let v = g.upload(&fresh(kvw, 28));
        let (mut kc, mut vc) = (g.zeros(ctx * kvw), g.zeros(ctx * kvw));
        let step = g.upload(&[f32::from_bits(1), f32::from_bits(1000)]);
        let inv_freq = dynmoe::model::forward::rope_inv_freq(1e6, head_dim, 1.0);
        let shape = AttentionShape {
            rows: 1,
            pos0: 0,
            heads,
            kv_heads,
            head_dim,
            window: None,
        };
        let norm = HeadNorm {
            q: &qn,
            k: &kn,
            eps,
        };
        let pre_bytes = (2 * heads * head_dim + 5 * kvw) * 4;
        let us = graph_us(&g, 6, |_| {
            g.attention_preamble_at(
                &mut q,
                &mut k,
                &v,
                Some(norm),
                shape,
                &inv_freq,
                &step,
                &mut kc,
                &mut vc,
            )
        });
        small.push((
            "attention_preamble_at".into(),
            heads,
            head_dim,
            pre_bytes,
            us,
        ));
        let us = graph_us(&g, 7, |_| {
            attention_preamble_one_by_one(
                &g,
                &mut q,
                &mut k,
                &v,
                Some(norm),
                shape,
                &inv_freq,
                &step,
                &mut kc,
                &mut vc,
            )
        });
        small.push((
            "attention_preamble_six_ops".into(),
            heads,
            head_dim,
            pre_bytes,
            us,
        ));
        println!(
            "{:<26} {:>6} {:>6} {:>10} {:>8} {:>7}",
            "decode kernel (graph)", "rows", "cols", "us/call", "GB/s", "of copy"
        );
        // A layer's q, k and v products (4096, 512 and 512 rows over 2048, bf16): one launch
        // beside three, over 8 copies (160 MB) so the weights come from device memory.
        let dims = [4096, 512, 512];
        let copies: Vec<Vec<_>> = (0..8)
            .map(|c| {
                dims.iter()
                    .enumerate()
                    .map(|(j, &r)| {
                        g.upload_matrix(&fresh_bf16(r * hidden, 30 + 3 * c + j as u64), r, hidden)
                    })
                    .collect()
            })
            .collect();
        let xq = g.upload(&fresh(hidden, 29));
        let (mut out_q, mut out_k, mut out_v) =
            (g.alloc(dims[0]), g.alloc(dims[1]), g.alloc(dims[2]));
        let qkv_bytes = dims.iter().sum::<usize>() * hidden * 2;
        let us = graph_us(&g, 8, |i| {
            let m = &copies[i % copies.len()];
            g.linear3(
                &xq,
                [
                    Weight::Dense(&m[0]),
                    Weight::Dense(&m[1]),
                    Weight::Dense(&m[2]),
                ],
                1,
                hidden,
                dims,
                [&mut out_q, &mut out_k, &mut out_v],
            )
        });
        small.push(("linear3_qkv_bf16".into(), 5120, hidden, qkv_bytes, us));
        let us = graph_us(&g, 9, |i| {
            let m = &copies[i % copies.len()];
            g.matmul(&xq, &m[0], 1, hidden, dims[0], &mut out_q);
            g.matmul(&xq, &m[1], 1, hidden, dims[1], &mut out_k);
            g.matmul(&xq, &m[2], 1, hidden, dims[2], &mut out_v);
        });
        small.push(("three_matvec_bf16_qkv".into(), 5120, hidden, qkv_bytes, us));
        // The attention output (2048 rows over 4096) and the router (128 rows over 2048).
        for (rows, cols, key) in [(hidden, 4096, 10), (128, hidden, 11)] {
            let mats: Vec<_> = (0..8)
                .map(|c| g.upload_matrix(&fresh_bf16(rows * cols, 60 + c), rows, cols))
                .collect();
            let x = g.upload(&fresh(cols, 59));
            let mut y = g.alloc(rows);
            let us = graph_us(&g, key, |i| {
                g.matmul(&x, &mats[i % mats.len()], 1, cols, rows, &mut y)
            });
            small.push(("matvec_bf16".into(), rows, cols, rows * cols * 2, us));
        }
        // The same dense products with the matrices at affine codecs (`--dense-codec`,
        // `--head-codec`: one row on tensor cores), and the LM head (151936 × 2048) in bf16
        // and coded; the head is larger than L2, one copy of it.
        let bf16_head = g.upload_matrix(&fresh_bf16(vocab * hidden, 70), vocab, hidden);
        let mut logits = g.alloc(vocab);
        let us = graph_us(&g, 12, |_| {
            g.matmul(&xq, &bf16_head, 1, hidden, vocab, &mut logits)
        });
        small.push(("lm_head_bf16".into(), vocab, hidden, vocab * hidden * 2, us));
        drop(bf16_head);
        let mut rng = Rng::new(71);
        for bits in [4u32, 3, 2] {
            let bytes = |rows: usize, cols: usize| {
                rows * words_per_row(cols, bits) * 4 + rows * cols / 64 * 4
            };
            let qkv: Vec<[HostAffine; 3]> = (0..8)
                .map(|_| dims.map(|r| HostAffine::random(&mut rng, r, hidden, bits)))
                .collect();
            // Device copies are made at first use, which a recording may not do.
            let mut qkv_step = |i: usize| {
                let m = &qkv[i % qkv.len()];
                g.linear3(
                    &xq,
                    [0, 1, 2].map(|j| Weight::Affine(m[j].view(bits, dims[j], hidden))),
                    1,
                    hidden,
                    dims,
                    [&mut out_q, &mut out_k, &mut out_v],
                )
            };
            (0..qkv.len()).for_each(&mut qkv_step);
            let us = graph_us(&g, 20 + bits as u64, qkv_step);
            let qkv_bytes = dims.iter().map(|&r| bytes(r, hidden)).sum();
            small.push((format!("linear3_qkv_q{bits}"), 5120, hidden, qkv_bytes, us));
            drop(qkv);
            let o: Vec<HostAffine> = (0..8)
                .map(|_| HostAffine::random(&mut rng, hidden, 4096, bits))
                .collect();
            let xo = g.upload(&fresh(4096, 72));
            let mut y = g.alloc(hidden);
            let mut o_step = |i: usize| {
                let v = o[i % o.len()].view(bits, hidden, 4096);
                g.matmul_affine(&xo, &v, 1, 4096, &mut y)
            };
            (0..o.len()).for_each(&mut o_step);
            let us = graph_us(&g, 30 + bits as u64, o_step);
            small.push((
                format!("dense_q{bits}"),
                hidden,
                4096,
                bytes(hidden, 4096),
                us,
            ));
            drop(o);
            let head = HostAffine::random(&mut rng, vocab, hidden, bits);
            let v = head.view(bits, vocab, hidden);
            let us = graph_us(&g, 40 + bits as u64, |_| {
                g.matmul_affine(&xq, &v, 1, hidden, &mut logits)
            });
            small.push((
                format!("lm_head_q{bits}"),
                vocab,
                hidden,
                bytes(vocab, hidden),
                us,
            ));
            g.clear_weight_cache();
        }
        for (kernel, rows, cols, bytes, per_call) in small {
            let gb_s = bytes as f64 / (per_call * 1e-6) / 1e9;
            println!(
                "{kernel:<26} {rows:>6} {cols:>6} {per_call:>10.2} {gb_s:>8.0} {:>7.2}",
                gb_s / copy_gb_s
            );
            rows_out.push(Row::new(
                kernel,
                [rows, cols, 1],
                bytes,
                GRAPH_CALLS,
                per_call,
                copy_gb_s,
            ));
        }
    }

    let report = Report {
        device: g.device_name().to_string(),
        arch: g.arch().to_string(),
        copy_gb_s,
        copy_bytes,
        rows: rows_out,
    };
    let json = serde_json::to_string_pretty(&report).unwrap();
    let path =
        dynmoe::testing::write_bench_report("cuda_kernels.json", &json).expect("write results");
    println!("wrote {}", path.display());
}

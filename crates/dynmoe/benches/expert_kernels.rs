//! Expert matmul kernels from packed affine words: MLX 4-bit, the 3- and 2-bit layouts
//! of seed 000, the older code-at-a-time 2-bit layout, and a dense f32 product for
//! context, at expert shapes and decode-sized batches.
//!
//! Weights are read from memory, not cache: each kernel rotates over enough copies of
//! its matrix to exceed 256 MB. Every case runs with all threads and with one; the
//! machine's read bandwidth is measured the same two ways in the same run, and each
//! kernel's weight traffic (words, scales, biases) is reported as a fraction of it.
//! The kernels of a case take turns call by call, so that a noisy neighbour slows all
//! of them alike and the ratios (q2/q4, q3/q4, naive-q2/q2) stay meaningful; the times
//! are medians. Prints a table and writes `bench/results/expert_kernels.json`.
//!
//! `cargo bench -p dynmoe --bench expert_kernels`

use std::time::{Duration, Instant};

use dynmoe::codec::affine::kernels::{self, AffineView};
use dynmoe::codec::affine::{lowbit, quantize};
use dynmoe::testing::fresh;
use half::bf16;
use rayon::prelude::*;
use serde::Serialize;

/// Gate/up (768 outputs from 2048 inputs) and down (2048 from 768).
const SHAPES: [(usize, usize); 2] = [(768, 2048), (2048, 768)];
const BATCHES: [usize; 3] = [1, 2, 8];
/// Bytes each kernel's copies of a matrix span, well past the 32 MB of L3.
const WORKING_SET: usize = 256 << 20;
/// Time spent per kernel on each (threads, shape, batch) case.
const BUDGET: Duration = Duration::from_millis(300);

#[derive(Serialize)]
struct Row {
    threads: usize,
    rows: usize,
    cols: usize,
    batch: usize,
    kernel: &'static str,
    weight_bytes: usize,
    copies: usize,
    calls: usize,
    median_us: f64,
    gb_s: f64,
    fraction_of_bandwidth: f64,
}

#[derive(Serialize)]
struct Ratios {
    threads: usize,
    rows: usize,
    cols: usize,
    batch: usize,
    q2_over_q4: f64,
    q3_over_q4: f64,
    naive_q2_over_q2: f64,
}

#[derive(Serialize)]
struct Bandwidth {
    threads: usize,
    read_gb_s: f64,
}

#[derive(Serialize)]
struct Report {
    cpu: String,
    avx2_fma: bool,
    avx512vl: bool,
    bandwidth: Vec<Bandwidth>,
    working_set_bytes: usize,
    rows: Vec<Row>,
    ratios: Vec<Ratios>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Read bandwidth of the current pool's threads summing their shares of `buf`: the
/// best of several passes, as a peak should be. Thirty-two u64 lanes in four
/// independent vectors keep the adds off the critical path, so the loads are what is
/// timed.
fn read_bandwidth(buf: &[u64]) -> f64 {
    let pass = || {
        let t = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 17)
            .map(|c| {
                let mut acc = [0u64; 32];
                for v in c.chunks_exact(32) {
                    for l in 0..32 {
                        acc[l] = acc[l].wrapping_add(v[l]);
                    }
                }
                acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
            })
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
        std::mem::size_of_val(buf) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    (0..7).map(|_| pass()).fold(0.0, f64::max)
}

/// Distinct copies of one matrix's storage, enough to span [`WORKING_SET`], so that
/// rotating over them reads memory rather than cache.
struct Copies<W> {
    words: Vec<Vec<W>>,
    scales: Vec<Vec<bf16>>,
    biases: Vec<Vec<bf16>>,
}

impl<W: Clone> Copies<W> {
    fn new(words: &[W], scales: &[bf16], biases: &[bf16]) -> Copies<W> {
        let bytes = std::mem::size_of_val(words) + (scales.len() + biases.len()) * 2;
        let n = WORKING_SET.div_ceil(bytes);
        Copies {
            words: (0..n).map(|_| words.to_vec()).collect(),
            scales: (0..n).map(|_| scales.to_vec()).collect(),
            biases: (0..n).map(|_| biases.to_vec()).collect(),
        }
    }

    fn bytes(&self) -> usize {
        std::mem::size_of_val(&self.words[0][..])
            + (self.scales[0].len() + self.biases[0].len()) * 2
    }
}

type Kernel = fn(&[f32], usize, &AffineView<'_>, &mut [f32]);

fn main() {
    #[cfg(target_arch = "x86_64")]
    let (avx2_fma, avx512vl) = (
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl"),
    );
    #[cfg(not(target_arch = "x86_64"))]
    let (avx2_fma, avx512vl) = (false, false);
    let all = rayon::current_num_threads();
    let pools: Vec<(usize, rayon::ThreadPool)> = [all, 1]
        .into_iter()
        .map(|n| {
            (
                n,
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .unwrap(),
            )
        })
        .collect();

    let buf: Vec<u64> = (0..(1usize << 30) / 8)
        .into_par_iter()
        .map(|i| i as u64)
        .collect();
    let bandwidth: Vec<Bandwidth> = pools
        .iter()
        .map(|(n, pool)| Bandwidth {
            threads: *n,
            read_gb_s: pool.install(|| read_bandwidth(&buf)),
        })
        .collect();
    drop(buf);
    println!(
        "{} (AVX2+FMA {}, AVX-512VL {}); read bandwidth {}",
        dynmoe::testing::cpu_name(),
        if avx2_fma { "yes" } else { "no" },
        if avx512vl { "yes" } else { "no" },
        bandwidth
            .iter()
            .map(|b| format!("{:.1} GB/s with {} thread(s)", b.read_gb_s, b.threads))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "{:>7} {:>9} {:>5} {:<9} {:>8} {:>6} {:>9} {:>7} {:>6}",
        "threads", "shape", "batch", "kernel", "bytes", "copies", "median us", "GB/s", "of bw"
    );

    let mut rows_out = Vec::new();
    for (si, &(rows, cols)) in SHAPES.iter().enumerate() {
        let q = quantize(&fresh(rows * cols, 1000 + si as u64), rows, cols, 4).unwrap();
        let pack = |bits| {
            let mut d = vec![0u32; rows * lowbit::words_per_row(cols, bits)];
            lowbit::pack_matrix(&q.words, rows, cols, bits, &mut d);
            d
        };
        let mut naive = vec![0u32; rows * cols / 16];
        lowbit::pack_matrix_naive_q2(&q.words, rows, cols, &mut naive);
        let quantized: Vec<(&'static str, u32, Copies<u32>, Kernel)> = vec![
            (
                "q4",
                4,
                Copies::new(&q.words, &q.scales, &q.biases),
                kernels::matmul,
            ),
            (
                "q3",
                3,
                Copies::new(&pack(3), &q.scales, &q.biases),
                kernels::matmul,
            ),
            (
                "q2",
                2,
                Copies::new(&pack(2), &q.scales, &q.biases),
                kernels::matmul,
            ),
            (
                "naive-q2",
                2,
                Copies::new(&naive, &q.scales, &q.biases),
                kernels::matmul_naive_q2,
            ),
        ];
        let dense = Copies::new(&fresh(rows * cols, 1200 + si as u64), &[], &[]);
        let mut cases: Vec<Case<'_>> = quantized
            .iter()
            .map(|(name, bits, c, kernel)| Case {
                name,
                bytes: c.bytes(),
                copies: c.words.len(),
                call: Box::new(move |i, x, batch, out| {
                    let w = AffineView {
                        bits: *bits,
                        rows,
                        cols,
                        words: &c.words[i],
                        scales: &c.scales[i],
                        biases: &c.biases[i],
                    };
                    kernel(x, batch, &w, out);
                }),
            })
            .collect();
        // Dense f32 for context, through the same thread pool.
        cases.push(Case {
            name: "f32",
            bytes: dense.bytes(),
            copies: dense.words.len(),
            call: Box::new(|i, x, batch, out| {
                dynmoe::codec::dense::matmul(x, &dense.words[i], batch, cols, rows, out)
            }),
        });
        for ((threads, pool), bw) in pools.iter().zip(&bandwidth) {
            for &batch in &BATCHES {
                let x = fresh(batch * cols, 1100 + batch as u64);
                let times = pool.install(|| time_round_robin(&cases, &x, batch, rows));
                for (case, times) in cases.iter().zip(times) {
                    let calls = times.len();
                    let median_s = median(times);
                    let gb_s = case.bytes as f64 / median_s / 1e9;
                    let row = Row {
                        threads: *threads,
                        rows,
                        cols,
                        batch,
                        kernel: case.name,
                        weight_bytes: case.bytes,
                        copies: case.copies,
                        calls,
                        median_us: median_s * 1e6,
                        gb_s,
                        fraction_of_bandwidth: gb_s / bw.read_gb_s,
                    };
                    println!(
                        "{:>7} {:>9} {:>5} {:<9} {:>8} {:>6} {:>9.1} {:>7.2} {:>5.0}%",
                        threads,
                        format!("{rows}x{cols}"),
                        batch,
                        case.name,
                        case.bytes,
                        case.copies,
                        row.median_us,
                        gb_s,
                        100.0 * row.fraction_of_bandwidth
                    );
                    rows_out.push(row);
                }
            }
        }
    }

    let mut ratios = Vec::new();
    let find = |threads: usize, rows: usize, batch: usize, kernel: &str| {
        rows_out
            .iter()
            .find(|r| {
                r.threads == threads && r.rows == rows && r.batch == batch && r.kernel == kernel
            })
            .map(|r| r.median_us)
            .unwrap()
    };
    for (threads, _) in &pools {
        for &(rows, cols) in &SHAPES {
            for &batch in &BATCHES {
                let t = |k| find(*threads, rows, batch, k);
                ratios.push(Ratios {
                    threads: *threads,
                    rows,
                    cols,
                    batch,
                    q2_over_q4: t("q2") / t("q4"),
                    q3_over_q4: t("q3") / t("q4"),
                    naive_q2_over_q2: t("naive-q2") / t("q2"),
                });
            }
        }
    }
    println!();
    println!(
        "{:>7} {:>9} {:>5} {:>8} {:>8} {:>12}",
        "threads", "shape", "batch", "q2/q4", "q3/q4", "naive-q2/q2"
    );
    for r in &ratios {
        println!(
            "{:>7} {:>9} {:>5} {:>8.2} {:>8.2} {:>12.2}",
            r.threads,
            format!("{}x{}", r.rows, r.cols),
            r.batch,
            r.q2_over_q4,
            r.q3_over_q4,
            r.naive_q2_over_q2
        );
    }

    let report = Report {
        cpu: dynmoe::testing::cpu_name(),
        avx2_fma,
        avx512vl,
        bandwidth,
        working_set_bytes: WORKING_SET,
        rows: rows_out,
        ratios,
    };
    let json = serde_json::to_string_pretty(&report).unwrap();
    let out = dynmoe::testing::write_bench_report("expert_kernels.json", &json).unwrap();
    println!("wrote {}", out.display());
}

/// `call(copy, x, batch, out)`: one product on weight copy `copy`.
type Call<'a> = Box<dyn Fn(usize, &[f32], usize, &mut [f32]) + Sync + 'a>;

/// One kernel under test.
struct Case<'a> {
    name: &'static str,
    bytes: usize,
    copies: usize,
    call: Call<'a>,
}

/// Each case's call times, the cases taking turns (one call each per round) so that
/// whatever else the machine does at the time weighs on all of them alike, each
/// rotating over its own copies. A few untimed rounds first.
fn time_round_robin(cases: &[Case<'_>], x: &[f32], batch: usize, rows: usize) -> Vec<Vec<f64>> {
    let mut out = vec![0.0f32; batch * rows];
    let mut times = vec![Vec::new(); cases.len()];
    let start = Instant::now();
    let mut round = 0usize;
    while start.elapsed() < BUDGET * cases.len() as u32 || round < 30 {
        for (case, times) in cases.iter().zip(&mut times) {
            let t = Instant::now();
            (case.call)(round % case.copies, x, batch, &mut out);
            std::hint::black_box(&out);
            if round >= 3 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        round += 1;
    }
    times
}

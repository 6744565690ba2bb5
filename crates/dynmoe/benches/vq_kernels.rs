//! VQ products straight from the codes (rungs 1, 1.5, 2, 3, 4 bits) beside the affine
//! q2 and q4 kernels, at expert shapes and decode-sized batches, all threads.
//!
//! As in `expert_kernels`, each kernel rotates over copies of its matrix spanning more
//! than the 32 MB L3, so weights come from memory; the kernels of a case take turns
//! call by call so that a noisy neighbour slows all of them alike, and the times are
//! medians of one run. The ratio that matters is VQ 2 bits over affine q2 on the same
//! shape and batch. More rows bound the 2-bit product: `vq2-cw0` runs the same
//! kernel on codes that are all zero, so every lookup hits one codeword and only the
//! 1 MiB codebook's cache misses are gone; `vq2-512k` and `vq2-32k` cut every index to
//! its low 15 or 11 bits, so the lookups stay in the first 512 KiB (half a core's L2)
//! or 32 KiB (its L1) of the book, which prices the book's size alone; `vq2-hot` reuses
//! one copy of the codes, so they come from cache instead of memory. Prints a table and
//! writes `bench/results/vq_kernels.json`.
//!
//! `cargo bench -p dynmoe --bench vq_kernels`

use std::time::{Duration, Instant};

use dynmoe::codec::affine::kernels::{self, AffineView};
use dynmoe::codec::affine::{lowbit, quantize};
use dynmoe::codec::vq::{self, Rung, VqMatrix, VqView};
use dynmoe::testing::fresh;
use half::{bf16, f16};
use serde::Serialize;

const SHAPES: [(usize, usize); 2] = [(768, 2048), (2048, 768)];
const BATCHES: [usize; 4] = [1, 2, 4, 8];
const VQ_RUNGS: [&str; 5] = ["1", "1.5", "2", "3", "4"];
/// Bytes each kernel's copies of a matrix span, past the 32 MB of L3.
const WORKING_SET: usize = 64 << 20;
/// Time per kernel on each (shape, batch) case.
const BUDGET: Duration = Duration::from_millis(300);

#[derive(Serialize)]
struct Row {
    rows: usize,
    cols: usize,
    batch: usize,
    kernel: String,
    bits_per_weight: f64,
    weight_bytes: usize,
    calls: usize,
    median_us: f64,
    over_affine_q2: f64,
}

#[derive(Serialize)]
struct Report {
    cpu: String,
    threads: usize,
    working_set_bytes: usize,
    rows: Vec<Row>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A matrix in one format, copied enough times to exceed the cache.
enum Mat {
    Affine {
        bits: u32,
        words: Vec<Vec<u32>>,
        scales: Vec<bf16>,
        biases: Vec<bf16>,
    },
    Vq {
        m: VqMatrix,
        norms: Vec<Vec<f16>>,
        codes: Vec<Vec<u8>>,
    },
}

impl Mat {
    fn copies(&self) -> usize {
        match self {
            Mat::Affine { words, .. } => words.len(),
            Mat::Vq { codes, .. } => codes.len(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Mat::Affine {
                words,
                scales,
                biases,
                ..
            } => 4 * words[0].len() + 2 * (scales.len() + biases.len()),
            Mat::Vq { m, .. } => m.code_bytes() + m.norm_bytes(),
        }
    }

    fn call(
        &self,
        copy: usize,
        x: &[f32],
        batch: usize,
        rows: usize,
        cols: usize,
        out: &mut [f32],
    ) {
        match self {
            Mat::Affine {
                bits,
                words,
                scales,
                biases,
            } => kernels::matmul(
                x,
                batch,
                &AffineView {
                    bits: *bits,
                    rows,
                    cols,
                    words: &words[copy],
                    scales,
                    biases,
                },
                out,
            ),
            Mat::Vq { m, norms, codes } => {
                let v = VqView::from_parts(rows, cols, m.rung, m.seed, &norms[copy], &codes[copy])
                    .expect("parts of an encoded matrix");
                vq::kernels::matmul(x, batch, &v, out)
            }
        }
    }
}

/// 2-bit codes with every 16-bit index cut to its low `bits` bits, so that the lookups
/// stay in the first `2^bits` codewords.
fn confined(codes: &[u8], bits: u32) -> Vec<u8> {
    let mask = (1u16 << bits) - 1;
    codes
        .chunks_exact(2)
        .flat_map(|c| (u16::from_le_bytes([c[0], c[1]]) & mask).to_le_bytes())
        .collect()
}

fn main() {
    let threads = rayon::current_num_threads();
    println!("{}, {threads} threads", dynmoe::testing::cpu_name());
    println!(
        "{:>10} {:>5} {:<8} {:>7} {:>9} {:>6} {:>10} {:>8}",
        "shape", "batch", "kernel", "bits/w", "bytes", "calls", "median us", "/ q2"
    );
    let mut out_rows = Vec::new();
    for (si, &(rows, cols)) in SHAPES.iter().enumerate() {
        let w = fresh(rows * cols, 2000 + si as u64);
        let q = quantize(&w, rows, cols, 4).unwrap();
        let mut mats: Vec<(String, f64, Mat)> = Vec::new();
        for bits in [2u32, 4] {
            let mut d = vec![0u32; rows * lowbit::words_per_row(cols, bits)];
            lowbit::pack_matrix(&q.words, rows, cols, bits, &mut d);
            let bytes = 4 * d.len() + 4 * q.scales.len();
            let n = WORKING_SET.div_ceil(bytes);
            mats.push((
                format!("affine-q{bits}"),
                8.0 * bytes as f64 / (rows * cols) as f64,
                Mat::Affine {
                    bits,
                    words: (0..n).map(|_| d.clone()).collect(),
                    scales: q.scales.clone(),
                    biases: q.biases.clone(),
                },
            ));
        }
        for r in VQ_RUNGS {
            let rung = Rung::parse(r).unwrap();
            let m = VqMatrix::encode(&w, rows, cols, rung, 7).unwrap();
            let n = WORKING_SET.div_ceil(m.code_bytes() + m.norm_bytes());
            let mut variants = vec![(rung.name(), n, m.codes.clone())];
            if r == "2" {
                variants.push(("vq2-cw0".into(), n, vec![0; m.codes.len()]));
                variants.push(("vq2-512k".into(), n, confined(&m.codes, 15)));
                variants.push(("vq2-32k".into(), n, confined(&m.codes, 11)));
                variants.push(("vq2-hot".into(), 1, m.codes.clone()));
            }
            for (name, n, codes) in variants {
                mats.push((
                    name,
                    rung.bits_per_weight(cols),
                    Mat::Vq {
                        norms: (0..n).map(|_| m.norms.clone()).collect(),
                        codes: (0..n).map(|_| codes.clone()).collect(),
                        m: m.clone(),
                    },
                ));
            }
        }
        for &batch in &BATCHES {
            let x = fresh(batch * cols, 3000 + batch as u64);
            let mut out = vec![0.0f32; batch * rows];
            let mut times: Vec<Vec<f64>> = vec![Vec::new(); mats.len()];
            let mut next = vec![0usize; mats.len()];
            let start = Instant::now();
            while start.elapsed() < BUDGET * mats.len() as u32 {
                for (i, (_, _, m)) in mats.iter().enumerate() {
                    let t = Instant::now();
                    m.call(next[i], &x, batch, rows, cols, &mut out);
                    times[i].push(t.elapsed().as_secs_f64() * 1e6);
                    next[i] = (next[i] + 1) % m.copies();
                }
            }
            let q2 = median(times[0].clone());
            for ((name, bits, m), t) in mats.iter().zip(&times) {
                let med = median(t.clone());
                println!(
                    "{:>10} {:>5} {:<8} {:>7.3} {:>9} {:>6} {:>10.1} {:>8.2}",
                    format!("{rows}x{cols}"),
                    batch,
                    name,
                    bits,
                    m.bytes(),
                    t.len(),
                    med,
                    med / q2
                );
                out_rows.push(Row {
                    rows,
                    cols,
                    batch,
                    kernel: name.clone(),
                    bits_per_weight: *bits,
                    weight_bytes: m.bytes(),
                    calls: t.len(),
                    median_us: med,
                    over_affine_q2: med / q2,
                });
            }
        }
    }
    let report = Report {
        cpu: dynmoe::testing::cpu_name(),
        threads,
        working_set_bytes: WORKING_SET,
        rows: out_rows,
    };
    let json = serde_json::to_string_pretty(&report).unwrap();
    let path = dynmoe::testing::write_bench_report("vq_kernels.json", &json).unwrap();
    println!("wrote {}", path.display());
}

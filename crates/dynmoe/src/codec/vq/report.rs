//! The measurements behind `dynmoe bench codecs`: per rung of the ladder, the stored
//! bits per weight, the distortion on unit Gaussian data and on real weights beside the
//! Gaussian bound and the bitsandbytes reference constants, encode and decode speed,
//! and the fit of `φ(b) = 2^(a − c·b)` to the distortions.

use std::time::Instant;

use serde::Serialize;

use super::codebook::Codebook;
use super::{kernels, Rung, VqMatrix};
use crate::codec::CodecError;

/// Mean squared error of unit-variance Gaussian data through the public bitsandbytes
/// kernels (docs/ARCHITECTURE.md, The VQ ladder), by bits per weight.
pub const REFERENCE: [(f64, f64); 5] = [
    (1.0, 0.429),
    (1.5, 0.201),
    (2.0, 0.094),
    (3.0, 0.026),
    (4.0, 0.0068),
];

/// The paper's fit of `φ(b) = 2^(a − c·b)`.
pub const PAPER_FIT: Fit = Fit { a: 1.710, c: 2.264 };

/// `φ(b) = 2^(a − c·b)`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Fit {
    /// Intercept, in bits.
    pub a: f64,
    /// Slope.
    pub c: f64,
}

/// A matrix of real weights to measure on.
pub struct RealMatrix {
    /// Tensor name.
    pub name: String,
    /// `[rows, cols]`, row-major.
    pub values: Vec<f32>,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
}

/// Every routed expert's weight matrix of the checkpoint in `dir` (tensors named
/// `*.mlp.experts.*.weight`, in name order), every `stride`-th one.
pub fn expert_matrices(
    dir: &std::path::Path,
    stride: usize,
) -> Result<Vec<RealMatrix>, crate::checkpoint::Error> {
    let ck = crate::checkpoint::Checkpoint::open(dir)?;
    let mut names: Vec<&str> = ck
        .names()
        .into_iter()
        .filter(|n| n.contains(".mlp.experts.") && n.ends_with(".weight"))
        .collect();
    names.sort_unstable();
    names
        .into_iter()
        .step_by(stride.max(1))
        .filter_map(|name| {
            let info = match ck.info(name) {
                Ok(i) => i,
                Err(e) => return Some(Err(e)),
            };
            let [rows, cols] = info.shape[..] else {
                return None;
            };
            Some(ck.f32(name, &[rows, cols]).map(|values| RealMatrix {
                name: name.to_string(),
                values,
                rows,
                cols,
            }))
        })
        .collect()
}

/// One rung's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct RungReport {
    /// `vq1.5`.
    pub name: String,
    /// Nominal bits per weight.
    pub nominal: f64,
    /// Vector length `p`.
    pub dim: usize,
    /// Index bits `k`.
    pub index_bits: u32,
    /// The codebook's symmetry: `None`, `Signs` or `SignsThenFree`.
    pub symmetry: String,
    /// `k / p`.
    pub rate: f64,
    /// Stored bits per weight of the Gaussian test matrix (codes and fp16 norms).
    pub bits_per_weight: f64,
    /// Squared error over squared value of the Gaussian test matrix, encoded and
    /// decoded through the codec.
    pub gaussian_mse: f64,
    /// The same with every vector's nearest codeword found by a full scan.
    pub gaussian_mse_exact: f64,
    /// Fraction of vectors whose codeword differs between the two searches.
    pub search_mismatch: f64,
    /// `2^(−2·rate)`, the Gaussian rate–distortion bound.
    pub bound: f64,
    /// bitsandbytes' constant at this rate, where there is one.
    pub reference: Option<f64>,
    /// `gaussian_mse / reference`: below 1 is better than the reference.
    pub over_reference: Option<f64>,
    /// Squared error of the real weights over their variance (summed over matrices).
    pub real_mse: f64,
    /// Stored bits per weight over the real matrices.
    pub real_bits_per_weight: f64,
    /// Weights encoded per second, all threads.
    pub encode_weights_per_s: f64,
    /// Weights decoded to f32 per second by the reference decoder, one thread.
    pub decode_weights_per_s: f64,
    /// Weights per second through the batch-1 product, all threads.
    pub matvec_weights_per_s: f64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Shape of the Gaussian test matrix.
    pub gaussian_shape: [usize; 2],
    /// Real matrices measured and their weights.
    pub real_matrices: usize,
    /// Weights in them.
    pub real_weights: usize,
    /// Threads of the rayon pool.
    pub threads: usize,
    /// Per rung.
    pub rungs: Vec<RungReport>,
    /// Least-squares fit of `log2 φ = a − c·b` over the rungs' Gaussian distortions,
    /// with `b` the rate.
    pub fit: Fit,
    /// The same fit to the real-weight distortions.
    pub fit_real: Fit,
    /// The paper's constants.
    pub paper_fit: Fit,
}

fn sq(v: &[f32]) -> f64 {
    v.iter().map(|&x| (x as f64).powi(2)).sum()
}

fn sq_err(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum()
}

/// Least squares of `log2 y = a − c·b`.
pub fn fit(points: &[(f64, f64)]) -> Fit {
    let n = points.len() as f64;
    let (sb, sy) = points
        .iter()
        .fold((0.0, 0.0), |(sb, sy), &(b, y)| (sb + b, sy + y.log2()));
    let (mb, my) = (sb / n, sy / n);
    let (mut num, mut den) = (0.0, 0.0);
    for &(b, y) in points {
        num += (b - mb) * (y.log2() - my);
        den += (b - mb).powi(2);
    }
    let slope = num / den;
    Fit {
        a: my - slope * mb,
        c: -slope,
    }
}

/// Measures the rung of every codebook of `books` (the shipped ones, or candidates)
/// on a `[rows, cols]` Gaussian matrix (seeded) and on `real`; `progress` is told each
/// rung as it starts.
pub fn measure(
    books: &[&Codebook],
    rows: usize,
    cols: usize,
    real: &[RealMatrix],
    mut progress: impl FnMut(Rung),
) -> Result<Report, CodecError> {
    let g = super::codebook::gaussian(0xBE7C_4000, rows * cols);
    let x = super::codebook::gaussian(0xBE7C_4001, cols);
    let g_sq = sq(&g);
    let mut out = Vec::new();
    for &book in books {
        let rung = book.rung();
        progress(rung);
        let t = Instant::now();
        let m = VqMatrix::encode_with(&g, rows, cols, rung, 1, book, false)?;
        let encode_s = t.elapsed().as_secs_f64();
        let exact = VqMatrix::encode_with(&g, rows, cols, rung, 1, book, true)?;
        let t = Instant::now();
        let back = m.view().decode_with(book);
        let decode_s = t.elapsed().as_secs_f64();
        let back_exact = exact.view().decode_with(book);
        let k = rung.index_bits as usize;
        let per_row = m.view().blocks() * m.block / rung.dim;
        let vectors = rows * per_row;
        let rb = super::row_bytes(rung, cols);
        let mismatch = (0..m.rows)
            .flat_map(|r| (0..per_row).map(move |j| (r, j)))
            .filter(|&(r, j)| {
                let row = r * rb..(r + 1) * rb;
                super::get_bits(&m.codes[row.clone()], j * k, k)
                    != super::get_bits(&exact.codes[row], j * k, k)
            })
            .count();
        let mut y = vec![0.0f32; rows];
        kernels::matmul(&x, 1, &m.view(), &mut y);
        let t = Instant::now();
        let mut calls = 0;
        while calls < 5 || t.elapsed().as_secs_f64() < 0.2 {
            kernels::matmul(&x, 1, &m.view(), &mut y);
            calls += 1;
        }
        let matvec_s = t.elapsed().as_secs_f64() / calls as f64;

        let (mut err, mut var, mut bits, mut n) = (0.0, 0.0, 0.0, 0usize);
        for r in real {
            let q = VqMatrix::encode_with(&r.values, r.rows, r.cols, rung, 1, book, false)?;
            let back = q.view().decode_with(book);
            err += sq_err(&back, &r.values);
            let len = r.values.len() as f64;
            let mean = r.values.iter().map(|&v| v as f64).sum::<f64>() / len;
            var += r
                .values
                .iter()
                .map(|&v| (v as f64 - mean).powi(2))
                .sum::<f64>();
            bits += 8.0 * (q.code_bytes() + q.norm_bytes()) as f64;
            n += r.values.len();
        }
        let reference = REFERENCE
            .iter()
            .find(|(b, _)| *b == rung.nominal.parse::<f64>().unwrap_or(f64::NAN))
            .map(|&(_, c)| c);
        let gaussian_mse = sq_err(&back, &g) / g_sq;
        out.push(RungReport {
            name: rung.name(),
            nominal: rung.nominal.parse().unwrap_or(f64::NAN),
            dim: rung.dim,
            index_bits: rung.index_bits,
            symmetry: format!("{:?}", book.params().symmetry),
            rate: rung.rate(),
            bits_per_weight: rung.bits_per_weight(cols),
            gaussian_mse,
            gaussian_mse_exact: sq_err(&back_exact, &g) / g_sq,
            search_mismatch: mismatch as f64 / vectors.max(1) as f64,
            bound: 2f64.powf(-2.0 * rung.rate()),
            reference,
            over_reference: reference.map(|c| gaussian_mse / c),
            real_mse: if var > 0.0 { err / var } else { f64::NAN },
            real_bits_per_weight: if n > 0 { bits / n as f64 } else { f64::NAN },
            encode_weights_per_s: (rows * cols) as f64 / encode_s,
            decode_weights_per_s: (rows * cols) as f64 / decode_s,
            matvec_weights_per_s: (rows * cols) as f64 / matvec_s,
        });
    }
    let fit_g = fit(&out
        .iter()
        .map(|r| (r.rate, r.gaussian_mse))
        .collect::<Vec<_>>());
    let fit_r = fit(&out
        .iter()
        .filter(|r| r.real_mse.is_finite())
        .map(|r| (r.rate, r.real_mse))
        .collect::<Vec<_>>());
    Ok(Report {
        gaussian_shape: [rows, cols],
        real_matrices: real.len(),
        real_weights: real.iter().map(|r| r.values.len()).sum(),
        threads: rayon::current_num_threads(),
        rungs: out,
        fit: fit_g,
        fit_real: fit_r,
        paper_fit: PAPER_FIT,
    })
}

/// The report as a table.
pub fn table(r: &Report) -> String {
    let mut s = format!(
        "VQ ladder: Gaussian {}×{} matrix, {} real matrices ({} weights), {} threads\n",
        r.gaussian_shape[0], r.gaussian_shape[1], r.real_matrices, r.real_weights, r.threads
    );
    s += &format!(
        "{:<8} {:>4} {:>3} {:>13} {:>7} {:>7} {:>8} {:>8} {:>6} {:>8} {:>8} {:>7} {:>8} {:>7} {:>9} {:>9} {:>9}\n",
        "rung", "p", "k", "symmetry", "rate", "bits/w", "mse", "exact", "miss%", "bound", "bnb", "ours/bnb",
        "real", "real b/w", "enc Mw/s", "dec Mw/s", "mv Mw/s"
    );
    for x in &r.rungs {
        let opt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
        s += &format!(
            "{:<8} {:>4} {:>3} {:>13} {:>7.4} {:>7.4} {:>8.5} {:>8.5} {:>6.2} {:>8.5} {:>8} {:>7} {:>8.5} {:>7.3} {:>9.2} {:>9.1} {:>9.0}\n",
            x.name,
            x.dim,
            x.index_bits,
            x.symmetry,
            x.rate,
            x.bits_per_weight,
            x.gaussian_mse,
            x.gaussian_mse_exact,
            100.0 * x.search_mismatch,
            x.bound,
            opt(x.reference, 4),
            opt(x.over_reference, 3),
            x.real_mse,
            x.real_bits_per_weight,
            x.encode_weights_per_s / 1e6,
            x.decode_weights_per_s / 1e6,
            x.matvec_weights_per_s / 1e6,
        );
    }
    s += &format!(
        "fit φ(b) = 2^(a − c·b): Gaussian a = {:.3}, c = {:.3}; real a = {:.3}, c = {:.3}; paper a = {:.3}, c = {:.3}\n",
        r.fit.a, r.fit.c, r.fit_real.a, r.fit_real.c, r.paper_fit.a, r.paper_fit.c
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_an_exact_exponential() {
        let pts: Vec<(f64, f64)> = [1.0, 2.0, 3.5]
            .iter()
            .map(|&b| (b, 2f64.powf(1.7 - 2.26 * b)))
            .collect();
        let f = fit(&pts);
        assert!(
            (f.a - 1.7).abs() < 1e-9 && (f.c - 2.26).abs() < 1e-9,
            "{f:?}"
        );
    }

    #[test]
    fn gaussian_distortion_beats_the_reference_at_every_rung_that_has_one() {
        let books: Vec<&Codebook> = REFERENCE
            .iter()
            .map(|(b, _)| Rung::parse(&b.to_string()).unwrap().codebook().unwrap())
            .collect();
        let r = measure(&books, 64, 1024, &[], |_| {}).unwrap();
        for x in &r.rungs {
            let c = x.reference.unwrap();
            assert!(x.gaussian_mse < c, "{}: {} vs {c}", x.name, x.gaussian_mse);
            assert!(x.gaussian_mse > x.bound, "{}: below the bound", x.name);
        }
    }
}

//! How far a compressed model's next-token distributions are from the uncompressed
//! model's: mean KL divergence and top-1 agreement over the positions perplexity
//! scores, so the two numbers describe the same tokens.

use serde::Serialize;

use super::ppl::{chunk, chunking, forward_in_steps, nll, PplError, PplOptions};
use crate::backend::Backend;
use crate::model::LoadedModel;

/// What a KL-divergence run measured.
#[derive(Debug, Clone, Serialize)]
pub struct KldReport {
    /// Mean KL(reference ‖ model) in nats per scored token.
    pub kld_mean: f64,
    /// Share of scored positions where both models' most likely token agree.
    pub top1_agreement: f64,
    /// Perplexity of the model under test over the same positions.
    pub ppl: f64,
    /// Perplexity of the reference over the same positions.
    pub ppl_reference: f64,
    /// Positions scored.
    pub tokens_scored: usize,
    /// Chunks evaluated.
    pub chunks: usize,
}

/// `log_softmax` of one row of logits, in f64.
fn log_probs(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&l| l as f64 - lse).collect()
}

/// KL(p ‖ q) from log-probabilities.
pub fn kl(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| {
            if lp == f64::NEG_INFINITY {
                0.0
            } else {
                lp.exp() * (lp - lq)
            }
        })
        .sum()
}

fn argmax(row: &[f32]) -> usize {
    crate::runtime::generate::argmax(row) as usize
}

/// Runs `model` and `reference` over the chunks perplexity would score (llama.cpp's
/// chunking, [`super::ppl`]) and compares their distributions at every scored position.
/// Both models must share the tokenizer. `opts.micro_batch` applies to `model` (a
/// dynamic resident set changes between its forward calls); the reference runs each
/// chunk in one call.
pub fn kl_divergence<B: Backend, R: Backend>(
    model: &LoadedModel<B>,
    reference: &LoadedModel<R>,
    text: &str,
    opts: PplOptions,
) -> Result<KldReport, PplError> {
    let ctx = opts.ctx;
    let (tokens, chunks) = chunking(model, text, opts)?;
    let first = ctx / 2;
    let vocab = model.model.config.vocab_size;
    let mut state = model.model.new_state(ctx);
    let mut ref_state = reference.model.new_state(ctx);
    let (mut kld, mut agree, mut nll_m, mut nll_r, mut n) = (0.0, 0usize, 0.0, 0.0, 0usize);
    for c in 0..chunks {
        let chunk = chunk(model, &tokens, c, ctx);
        state.clear();
        ref_state.clear();
        let logits = forward_in_steps(model, &mut state, &chunk, first, opts.micro_batch)?;
        let ref_logits = reference.model.forward(&mut ref_state, &chunk, first)?;
        for r in 0..ctx - 1 - first {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let ref_row = &ref_logits[r * vocab..(r + 1) * vocab];
            let target = tokens[c * ctx + first + r + 1];
            kld += kl(&log_probs(ref_row), &log_probs(row));
            agree += usize::from(argmax(row) == argmax(ref_row));
            nll_m += nll(row, target);
            nll_r += nll(ref_row, target);
            n += 1;
        }
    }
    let n_f = n as f64;
    Ok(KldReport {
        kld_mean: kld / n_f,
        top1_agreement: agree as f64 / n_f,
        ppl: (nll_m / n_f).exp(),
        ppl_reference: (nll_r / n_f).exp(),
        tokens_scored: n,
        chunks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_and_positive_otherwise() {
        let p = log_probs(&[1.0, 2.0, 3.0, -1.0]);
        let q = log_probs(&[1.0, 2.5, 2.0, 0.0]);
        assert!(kl(&p, &p).abs() < 1e-12);
        let d = kl(&p, &q);
        // Direct formula on probabilities.
        let (pp, qq): (Vec<f64>, Vec<f64>) = (
            p.iter().map(|v| v.exp()).collect(),
            q.iter().map(|v| v.exp()).collect(),
        );
        let want: f64 = pp.iter().zip(&qq).map(|(a, b)| a * (a / b).ln()).sum();
        assert!(d > 0.0 && (d - want).abs() < 1e-12, "{d} vs {want}");
    }
}

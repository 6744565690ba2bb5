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
    crate::model::argmax(row) as usize
}

/// The reference model's logits at every position perplexity scores in a text, kept so
/// that many models can be compared with one run of the reference.
pub struct ReferenceLogits {
    opts: PplOptions,
    tokens: Vec<u32>,
    chunks: usize,
    vocab: usize,
    /// Per chunk, `[ctx - 1 - ctx/2, vocab]`.
    logits: Vec<Vec<f32>>,
}

/// Runs `reference` over the chunks perplexity would score in `text` (llama.cpp's
/// chunking, [`super::ppl`]), each chunk in one forward call, and keeps the logits of the
/// scored positions.
pub fn reference_logits<R: Backend>(
    reference: &LoadedModel<R>,
    text: &str,
    opts: PplOptions,
) -> Result<ReferenceLogits, PplError> {
    let ctx = opts.ctx;
    let (tokens, chunks) = chunking(reference, text, opts)?;
    let mut state = reference.model.new_state(ctx);
    let mut logits = Vec::with_capacity(chunks);
    for c in 0..chunks {
        let chunk = chunk(reference, &tokens, c, ctx);
        state.clear();
        logits.push(reference.model.forward(&mut state, &chunk, ctx / 2)?);
    }
    Ok(ReferenceLogits {
        opts,
        tokens,
        chunks,
        vocab: reference.model.config.vocab_size,
        logits,
    })
}

/// Runs `model` over the chunks perplexity would score and compares its distributions
/// with `reference`'s at every scored position. Both models must share the tokenizer.
/// `micro_batch` applies to `model` (a dynamic resident set changes between its forward
/// calls); the rest of the chunking is the reference's.
pub fn kl_divergence_to<B: Backend>(
    model: &LoadedModel<B>,
    reference: &ReferenceLogits,
    micro_batch: Option<usize>,
) -> Result<KldReport, PplError> {
    let ctx = reference.opts.ctx;
    let first = ctx / 2;
    let (tokens, vocab) = (&reference.tokens, reference.vocab);
    if model.model.config.vocab_size != vocab {
        return Err(PplError::Model(crate::model::Error::Config(format!(
            "vocabularies differ: {} against the reference's {vocab}",
            model.model.config.vocab_size
        ))));
    }
    let mut state = model.model.new_state(ctx);
    let (mut kld, mut agree, mut nll_m, mut nll_r, mut n) = (0.0, 0usize, 0.0, 0.0, 0usize);
    for (c, ref_logits) in reference.logits.iter().enumerate() {
        let chunk = chunk(model, tokens, c, ctx);
        state.clear();
        let logits = forward_in_steps(model, &mut state, &chunk, first, micro_batch)?;
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
        chunks: reference.chunks,
    })
}

/// [`kl_divergence_to`] a reference run here on `text`: `opts.micro_batch` applies to
/// `model`, the reference runs each chunk in one call.
pub fn kl_divergence<B: Backend, R: Backend>(
    model: &LoadedModel<B>,
    reference: &LoadedModel<R>,
    text: &str,
    opts: PplOptions,
) -> Result<KldReport, PplError> {
    let r = reference_logits(reference, text, opts)?;
    kl_divergence_to(model, &r, opts.micro_batch)
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

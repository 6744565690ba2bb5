//! Perplexity with llama.cpp's `perplexity` semantics, so numbers compare with it:
//! the whole text tokenised once (BOS only if the tokenizer adds one), chunks of `ctx`
//! tokens with the KV cache cleared for each, the chunk's first token replaced by BOS
//! when BOS is used, and only the second half of each chunk scored: the tokens at
//! positions `ctx/2 + 1 .. ctx` from the logits at `ctx/2 .. ctx - 1`.

use serde::Serialize;

use crate::backend::Backend;
use crate::model::{Error, LoadedModel};

/// What a perplexity run measured.
#[derive(Debug, Clone, Serialize)]
pub struct PplReport {
    /// exp(mean negative log-likelihood).
    pub ppl: f64,
    /// Standard error of `ppl`, as llama.cpp prints it.
    pub ppl_stderr: f64,
    /// Mean negative log-likelihood (nats per token).
    pub nll_mean: f64,
    /// Tokens whose likelihood was scored.
    pub tokens_scored: usize,
    /// Chunks evaluated.
    pub chunks: usize,
    /// Chunk length.
    pub ctx: usize,
    /// Tokens in the whole text.
    pub tokens_total: usize,
    /// Wall time of the forward passes, seconds.
    pub seconds: f64,
    /// Tokens run through the model per second (all positions of every chunk).
    pub tokens_per_second: f64,
}

/// Options of a perplexity run.
#[derive(Debug, Clone, Copy)]
pub struct PplOptions {
    /// Chunk length (llama.cpp's `n_ctx`).
    pub ctx: usize,
    /// Evaluate at most this many chunks.
    pub max_chunks: Option<usize>,
    /// Run each chunk in forward calls of this many tokens (the KV cache carried on),
    /// so that a dynamic resident set can change inside a chunk; `None`: one call.
    pub micro_batch: Option<usize>,
}

impl Default for PplOptions {
    fn default() -> Self {
        PplOptions {
            ctx: 512,
            max_chunks: None,
            micro_batch: None,
        }
    }
}

/// Why a perplexity run could not happen.
#[derive(Debug, thiserror::Error)]
pub enum PplError {
    /// The model failed.
    #[error(transparent)]
    Model(#[from] Error),
    /// The text is too short for even one scored chunk.
    #[error("the text has {tokens} tokens; perplexity with ctx {ctx} needs at least {}", 2 * ctx)]
    TooShort {
        /// Tokens in the text.
        tokens: usize,
        /// Requested chunk length.
        ctx: usize,
    },
    /// The chunk length is unusable.
    #[error("ctx {0} is too small: it must be at least 4 and even")]
    BadCtx(usize),
    /// The chunk length is longer than the model's context.
    #[error("ctx {ctx} is longer than the model's context (max_position_embeddings {max} in config.json)")]
    CtxBeyondModel {
        /// Requested chunk length.
        ctx: usize,
        /// The model's context.
        max: usize,
    },
}

impl From<crate::checkpoint::Error> for PplError {
    fn from(e: crate::checkpoint::Error) -> PplError {
        PplError::Model(e.into())
    }
}

/// Negative log-likelihood of `target` under one row of logits, in f64.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    max + sum.ln() - logits[target as usize] as f64
}

/// Runs perplexity over `text`. `progress(done, total)` is called after every chunk.
pub fn perplexity<B: Backend>(
    m: &LoadedModel<B>,
    text: &str,
    opts: PplOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<PplReport, PplError> {
    let tokens = m.tokenizer.encode(text)?;
    perplexity_tokens(m, &tokens, opts, progress)
}

/// [`perplexity`] of a text tokenised already.
pub fn perplexity_tokens<B: Backend>(
    m: &LoadedModel<B>,
    tokens: &[u32],
    opts: PplOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<PplReport, PplError> {
    let ctx = opts.ctx;
    let max = m.model.config.max_position_embeddings;
    if ctx > max {
        return Err(PplError::CtxBeyondModel { ctx, max });
    }
    let chunks = chunk_count(tokens.len(), opts)?;
    let first = ctx / 2;
    let vocab = m.model.config.vocab_size;
    let mut state = m.model.new_state(ctx);
    let (mut sum, mut sum_sq, mut count) = (0.0f64, 0.0f64, 0usize);
    let start = std::time::Instant::now();
    for c in 0..chunks {
        let chunk = chunk(m, tokens, c, ctx);
        state.clear();
        let logits = forward_in_steps(m, &mut state, &chunk, first, opts.micro_batch)?;
        // Row r holds the logits at position first + r, predicting token first + r + 1.
        for r in 0..ctx - 1 - first {
            let target = tokens[c * ctx + first + r + 1];
            let v = nll(&logits[r * vocab..(r + 1) * vocab], target);
            sum += v;
            sum_sq += v * v;
            count += 1;
        }
        progress(c + 1, chunks);
    }
    let seconds = start.elapsed().as_secs_f64();
    let mean = sum / count as f64;
    let var = sum_sq / count as f64 - mean * mean;
    let ppl = mean.exp();
    let ppl_stderr = if count > 1 && var > 0.0 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    Ok(PplReport {
        ppl,
        ppl_stderr,
        nll_mean: mean,
        tokens_scored: count,
        chunks,
        ctx,
        tokens_total: tokens.len(),
        seconds,
        tokens_per_second: (chunks * ctx) as f64 / seconds.max(1e-9),
    })
}

/// The text tokenised once and the number of whole chunks of `opts.ctx` tokens to
/// evaluate, after checking that at least one can be scored.
pub(crate) fn chunking<B: Backend>(
    m: &LoadedModel<B>,
    text: &str,
    opts: PplOptions,
) -> Result<(Vec<u32>, usize), PplError> {
    let tokens = m.tokenizer.encode(text)?;
    let chunks = chunk_count(tokens.len(), opts)?;
    Ok((tokens, chunks))
}

/// Whole chunks of `opts.ctx` among `tokens` tokens, capped by `opts.max_chunks`.
fn chunk_count(tokens: usize, opts: PplOptions) -> Result<usize, PplError> {
    let ctx = opts.ctx;
    if ctx < 4 || !ctx.is_multiple_of(2) {
        return Err(PplError::BadCtx(ctx));
    }
    if tokens < 2 * ctx {
        return Err(PplError::TooShort { tokens, ctx });
    }
    Ok((tokens / ctx).min(opts.max_chunks.unwrap_or(usize::MAX)))
}

/// Chunk `c`: its `ctx` tokens, the first replaced by BOS when the tokenizer uses one.
pub(crate) fn chunk<B: Backend>(
    m: &LoadedModel<B>,
    tokens: &[u32],
    c: usize,
    ctx: usize,
) -> Vec<u32> {
    let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
    if let Some(bos) = m.tokenizer.bos {
        chunk[0] = bos;
    }
    chunk
}

/// The logits of `tokens[from..]`, running `tokens` in calls of `step` tokens.
pub(crate) fn forward_in_steps<B: Backend>(
    m: &LoadedModel<B>,
    state: &mut crate::model::State<B>,
    tokens: &[u32],
    from: usize,
    step: Option<usize>,
) -> Result<Vec<f32>, Error> {
    let step = step.unwrap_or(tokens.len()).max(1);
    if step >= tokens.len() {
        return m.model.forward(state, tokens, from);
    }
    let mut logits = Vec::new();
    for (i, part) in tokens.chunks(step).enumerate() {
        let start = i * step;
        let local = from.saturating_sub(start).min(part.len());
        logits.extend(m.model.forward(state, part, local)?);
    }
    Ok(logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_log_sum_exp_minus_target() {
        let logits = [1.0f32, 2.0, 3.0];
        let want = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln() - 2.0;
        assert!((nll(&logits, 1) - want).abs() < 1e-12);
    }

    #[test]
    fn uniform_logits_give_vocabulary_size() {
        let logits = vec![0.5f32; 1000];
        assert!((nll(&logits, 7).exp() - 1000.0).abs() < 1e-9);
    }
}

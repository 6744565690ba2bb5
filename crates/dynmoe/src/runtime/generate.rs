//! Text generation: prefill the prompt in one chunk, then decode token by token with a
//! seeded sampler (greedy at temperature 0).

use serde::Serialize;

use crate::backend::Backend;
use crate::checkpoint::Tokenizer;
use crate::model::{argmax, DecodeOptions, Error, LoadedModel};
use crate::rng::Rng;

/// Sampling parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: all).
    pub top_p: f32,
    /// Seed of the sampler.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// Picks tokens from logits.
pub struct Sampler {
    params: Sampling,
    rng: Rng,
}

impl Sampler {
    /// A sampler with these parameters.
    pub fn new(params: Sampling) -> Sampler {
        Sampler {
            params,
            rng: Rng::seeded(params.seed),
        }
    }

    /// The next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        let max = logits[order[0] as usize];
        let mut probs: Vec<f32> = order
            .iter()
            .map(|&t| ((logits[t as usize] - max) / p.temperature).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|v| *v /= sum);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|&v| {
                    acc += v;
                    acc >= p.top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            order.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        let mut u = self.rng.uniform() * total;
        for (&t, &v) in order.iter().zip(&probs) {
            if u < v {
                return t;
            }
            u -= v;
        }
        *order.last().expect("at least one candidate")
    }
}

/// What a generation produced and how fast.
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    /// Generated text.
    pub text: String,
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens per second (prefill).
    pub prefill_tokens_per_second: f64,
    /// Generated tokens per second (decode).
    pub decode_tokens_per_second: f64,
    /// Whether generation stopped at an end-of-sequence token.
    pub stopped_at_eos: bool,
    /// Whether generation stopped because the prompt and the reply filled the model's
    /// context (`max_position_embeddings`) before `max_tokens` were generated.
    pub stopped_at_context: bool,
}

/// Generates up to `max_tokens` tokens after `prompt`, stopping at the model's
/// end-of-sequence tokens, calling `on_token` with each piece of text as it is produced.
pub fn generate<B: Backend>(
    m: &LoadedModel<B>,
    prompt: &str,
    max_tokens: usize,
    sampling: Sampling,
    on_token: &mut dyn FnMut(&str),
) -> Result<Generation, Error> {
    let ids = m.tokenizer.encode(prompt)?;
    if ids.is_empty() {
        return Err(crate::checkpoint::Error::Tokenizer {
            path: m.dir.join("tokenizer.json"),
            reason: "the prompt encodes to no tokens".into(),
        }
        .into());
    }
    let eos: Vec<u32> = m
        .tokenizer
        .eos
        .iter()
        .chain(&m.model.config.eos_token_ids)
        .copied()
        .collect();
    generate_ids(m, &ids, max_tokens, sampling, &eos, on_token)
}

/// Generates up to `max_tokens` tokens after the prompt `ids`, stopping early at any
/// token of `stop`: one prefill of the whole prompt, then one decode step per token.
pub fn generate_ids<B: Backend>(
    m: &LoadedModel<B>,
    ids: &[u32],
    max_tokens: usize,
    sampling: Sampling,
    stop: &[u32],
    on_token: &mut dyn FnMut(&str),
) -> Result<Generation, Error> {
    // Never past the model's context: positions beyond it were never trained.
    let context = m.model.config.max_position_embeddings;
    if ids.len() > context {
        return Err(Error::ContextOverflow {
            needed: ids.len(),
            capacity: context,
        });
    }
    let room = context - ids.len();
    let stopped_at_context = max_tokens > room;
    let max_tokens = max_tokens.min(room);
    let mut state = m.model.new_state(ids.len() + max_tokens);
    let mut sampler = Sampler::new(sampling);
    let vocab = m.model.config.vocab_size;

    let t0 = std::time::Instant::now();
    let mut logits = m
        .model
        .forward(&mut state, ids, ids.len().saturating_sub(1))?;
    let prefill = t0.elapsed().as_secs_f64();

    let t1 = std::time::Instant::now();
    let mut out = TextStream::default();
    let mut stopped_at_eos = false;
    if sampling.temperature > 0.0 {
        while out.tokens().len() < max_tokens {
            let next = sampler.sample(&logits[..vocab]);
            if stop.contains(&next) {
                stopped_at_eos = true;
                break;
            }
            emit(&mut out, &m.tokenizer, next, on_token)?;
            if out.tokens().len() < max_tokens {
                logits = m.model.forward(&mut state, &[next], 0)?;
            }
        }
    } else if max_tokens > 0 {
        // The first token is the prefill's; the backend picks the rest, its steps queued
        // back to back, and each token is handed out here while the next step runs.
        let first = sampler.sample(&logits[..vocab]);
        if stop.contains(&first) {
            stopped_at_eos = true;
        } else {
            emit(&mut out, &m.tokenizer, first, on_token)?;
            let mut failed = None;
            m.model.decode(
                &mut state,
                first,
                DecodeOptions {
                    max_tokens: max_tokens - 1,
                },
                &mut |t| {
                    if stop.contains(&t) {
                        stopped_at_eos = true;
                        return false;
                    }
                    match emit(&mut out, &m.tokenizer, t, on_token) {
                        Ok(()) => true,
                        Err(e) => {
                            failed = Some(e);
                            false
                        }
                    }
                },
            )?;
            if let Some(e) = failed {
                return Err(e);
            }
        }
    }
    let decode = t1.elapsed().as_secs_f64();
    let rest = out.take_rest();
    if !rest.is_empty() {
        on_token(rest);
    }
    Ok(Generation {
        text: out.text().to_string(),
        prompt_tokens: ids.len(),
        prefill_tokens_per_second: ids.len() as f64 / prefill.max(1e-9),
        decode_tokens_per_second: out.tokens().len() as f64 / decode.max(1e-9),
        stopped_at_context: stopped_at_context && !stopped_at_eos,
        tokens: out.tokens().to_vec(),
        stopped_at_eos,
    })
}

/// Appends a generated token to `out` and hands `on_token` the text it completes.
fn emit(
    out: &mut TextStream,
    tok: &Tokenizer,
    id: u32,
    on_token: &mut dyn FnMut(&str),
) -> Result<(), Error> {
    out.push(tok, id)?;
    let piece = out.take(0);
    if !piece.is_empty() {
        on_token(piece);
    }
    Ok(())
}

/// Generated tokens turned into text as they arrive. The whole output is decoded
/// again after each token, so a character split across tokens comes out whole; text
/// is handed out only up to a complete character.
#[derive(Debug, Default)]
pub struct TextStream {
    tokens: Vec<u32>,
    text: String,
    /// Bytes of `text` already taken.
    shown: usize,
}

impl TextStream {
    /// Appends a token and decodes the output again.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<(), Error> {
        self.tokens.push(id);
        self.text = tok.decode(&self.tokens)?;
        // A later token can rewrite earlier text (a merged character); never hand
        // out less than was already shown.
        if !self.text.is_char_boundary(self.shown.min(self.text.len())) {
            self.shown = self.text.len();
        }
        Ok(())
    }

    /// Tokens so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// All text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Bytes of the text already taken.
    pub fn shown(&self) -> usize {
        self.shown
    }

    /// Text not yet taken, keeping back its last `hold` bytes (a possible start of a
    /// stop sequence); nothing while the text ends inside a character.
    pub fn take(&mut self, hold: usize) -> &str {
        if self.text.ends_with('\u{FFFD}') || self.shown > self.text.len() {
            return "";
        }
        let mut end = self.text.len().saturating_sub(hold).max(self.shown);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        let from = self.shown;
        self.shown = end;
        &self.text[from..end]
    }

    /// Everything not yet taken, up to byte `end` of the text (the start of a stop
    /// sequence, or its length).
    pub fn take_until(&mut self, end: usize) -> &str {
        let from = self.shown.min(end);
        self.shown = self.shown.max(end);
        &self.text[from..end]
    }

    /// Everything not yet taken.
    pub fn take_rest(&mut self) -> &str {
        self.take_until(self.text.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(Sampling::default());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(Sampling {
            temperature: 5.0,
            top_k: 1,
            top_p: 1.0,
            seed: 9,
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
        }
    }

    #[test]
    fn same_seed_same_samples() {
        let params = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            seed: 42,
        };
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut a, mut b) = (Sampler::new(params), Sampler::new(params));
        let xs: Vec<u32> = (0..30).map(|_| a.sample(&logits)).collect();
        let ys: Vec<u32> = (0..30).map(|_| b.sample(&logits)).collect();
        assert_eq!(xs, ys);
        assert!(
            xs.iter().collect::<std::collections::HashSet<_>>().len() > 1,
            "sampling never varied"
        );
    }
}

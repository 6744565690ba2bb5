//! Text generation: prefill the prompt in one chunk, then decode token by token, each
//! token picked by the sampling settings (`backend::sample`; greedy at temperature 0).

use serde::Serialize;

use crate::backend::sample::{self, Sampling};
use crate::backend::Backend;
use crate::checkpoint::Tokenizer;
use crate::model::{DecodeOptions, Decoding, Error, LoadedModel};

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
    if let Err(why) = sampling.check() {
        return Err(Error::Config(format!("sampling: {why}")));
    }
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
    let vocab = m.model.config.vocab_size;

    let t0 = std::time::Instant::now();
    let logits = m
        .model
        .forward(&mut state, ids, ids.len().saturating_sub(1))?;
    let prefill = t0.elapsed().as_secs_f64();

    let t1 = std::time::Instant::now();
    let mut out = TextStream::default();
    let mut stopped_at_eos = false;
    if max_tokens > 0 {
        // The first token is the prefill's; the backend picks the rest, its steps queued
        // back to back, and each token is handed out here while the next step runs.
        let counts = match sampling.penalizes() {
            true => sample::counts(ids, vocab),
            false => Vec::new(),
        };
        let first = sample::sample(&logits[..vocab], &counts, &sampling, ids.len() as u64);
        if stop.contains(&first) {
            stopped_at_eos = true;
        } else {
            emit(&mut out, &m.tokenizer, first, on_token)?;
            let mut failed = None;
            let opts = DecodeOptions {
                max_tokens: max_tokens - 1,
                sampling,
            };
            m.model.decode(
                &mut [Decoding::new(&mut state, first, opts)],
                &mut |_, t| {
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

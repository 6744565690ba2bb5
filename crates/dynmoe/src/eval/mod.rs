//! Measuring a model: llama.cpp-compatible perplexity ([`ppl`]) and where its
//! parameters and bytes are ([`inspect`]).

pub mod inspect;
pub mod ppl;

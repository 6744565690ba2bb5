//! Measuring a model: llama.cpp-compatible perplexity ([`ppl`]), KL divergence to the
//! uncompressed model ([`kld`]) and where its parameters and bytes are ([`inspect`]).

pub mod inspect;
pub mod kld;
pub mod plot;
pub mod ppl;

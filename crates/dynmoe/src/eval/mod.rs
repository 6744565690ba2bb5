//! Measuring a model: llama.cpp-compatible perplexity ([`ppl`]), the routing hit rate
//! of static and dynamic resident sets ([`hitrate`]) and where its parameters and
//! bytes are ([`inspect`]).

pub mod hitrate;
pub mod inspect;
pub mod ppl;

//! Measuring a model: llama.cpp-compatible perplexity ([`ppl`]), KL divergence to the
//! uncompressed model ([`kld`]), the routing hit rate of static and dynamic resident
//! sets ([`hitrate`]), where its parameters and bytes are ([`inspect`]) and what it keeps
//! resident under a choice of codecs ([`bits`]) or as a compressed directory has it
//! ([`compressed_bits`]), and plots of
//! the results ([`plot`]).

pub mod bits;
pub mod compressed_bits;
pub mod hitrate;
pub mod inspect;
pub mod kld;
pub mod plot;
pub mod ppl;

//! dynmoe compresses Mixture-of-Experts language models and runs them.
//!
//! The modules follow the data flow: [`model`] loads a Hugging Face checkpoint and runs
//! its forward pass against a [`backend::Backend`]; [`eval`] measures it
//! (llama.cpp-compatible perplexity, routing hit rate, parameter and byte
//! accounting); [`calib`] hooks the forward for REAP saliency; [`residency`] keeps a
//! resident expert set per layer that follows the text; [`alloc`] decides per layer
//! the codec and the resident count under a byte budget; [`runtime`] generates text;
//! [`serve`] answers OpenAI-style HTTP requests.
//!
//! ```no_run
//! use dynmoe::backend::Cpu;
//! let m = dynmoe::model::load(std::path::Path::new("fixtures/models/small-moe"), Cpu::fast())?;
//! let ids = m.tokenizer.encode("The whale")?;
//! let mut state = m.model.new_state(512);
//! let logits = m.model.forward(&mut state, &ids, ids.len() - 1)?;
//! assert_eq!(logits.len(), m.model.config.vocab_size);
//! # Ok::<(), dynmoe::model::Error>(())
//! ```
#![deny(missing_docs)]

pub mod alloc;
pub mod backend;
pub mod calib;
pub mod checkpoint;
pub mod codec;
pub mod eval;
pub mod model;
pub mod residency;
pub mod rng;
pub mod runtime;
pub mod serve;
pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod synth;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

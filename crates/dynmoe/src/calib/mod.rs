//! Calibration: hooks on the forward pass that measure what offline decisions need.
//! [`reap`] computes REAP saliency, which ranks the experts a static resident set keeps
//! and seeds a dynamic one; [`probe`] measures the calibration loss of a checkpoint with
//! any layer's codec and removed experts changed, for the allocator.

pub mod probe;
pub mod reap;

pub use reap::{reap_saliency, Reap, Saliency};

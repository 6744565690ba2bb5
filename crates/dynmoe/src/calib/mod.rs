//! Calibration: hooks on the forward pass that measure what offline decisions need.
//! [`reap`] computes REAP saliency, which ranks the experts a static resident set keeps
//! and seeds a dynamic one. The allocator's probes, which measure the calibration loss
//! with any layer's codec and removed experts changed, are in `alloc::probe`.

pub mod reap;

pub use reap::{reap_saliency, Reap, Saliency};

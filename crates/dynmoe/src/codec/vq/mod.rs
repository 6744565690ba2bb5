//! Rotate-then-vector-quantize codecs (HIGGS style, DESIGN.md §5).
//!
//! So far only the rotation exists ([`rotation`]): each weight row is cut into blocks,
//! each block stored as its fp16 L2 norm and a unit-Gaussian-like vector obtained by a
//! seeded sign flip and a Walsh–Hadamard transform. The codebooks, the encoder and the
//! decode kernels of the 0.7–5 bit ladder build on it.

pub mod rotation;

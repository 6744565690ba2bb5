//! Where the resident bytes go: per layer, a codec for its experts and how many of them
//! stay resident (docs/ARCHITECTURE.md, Allocation).
//!
//! [`law`] turns a few probes per layer into a cost for every setting (the distortion
//! law φ across codecs, the removal law `a_i·f^p` across resident fractions);
//! [`lagrange`] spends one byte budget across all layers by a multiplier found by
//! bisection; [`isp`] probes, allocates and re-probes around the plan it made;
//! [`cache`] keeps every probe result on disk so an interrupted run resumes;
//! [`plan`] is the file the result is written to.

pub mod cache;
pub mod compress;
pub mod isp;
pub mod lagrange;
pub mod law;
pub mod probe;

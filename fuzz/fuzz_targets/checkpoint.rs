//! The `checkpoint` target: see `bodies::checkpoint`.
#![no_main]

mod bodies;

libfuzzer_sys::fuzz_target!(|data: &[u8]| bodies::checkpoint(data));

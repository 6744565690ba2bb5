//! The `store` target: see `bodies::store`.
#![no_main]

mod bodies;

libfuzzer_sys::fuzz_target!(|data: &[u8]| bodies::store(data));

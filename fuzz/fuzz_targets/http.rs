//! The `http` target: see `bodies::http`.
#![no_main]

mod bodies;

libfuzzer_sys::fuzz_target!(|data: &[u8]| bodies::http(data));

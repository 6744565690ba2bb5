//! The `config` target: see `bodies::config`.
#![no_main]

mod bodies;

libfuzzer_sys::fuzz_target!(|data: &[u8]| bodies::config(data));

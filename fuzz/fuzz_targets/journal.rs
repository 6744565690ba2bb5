//! The `journal` target: see `bodies::journal`.
#![no_main]

mod bodies;

libfuzzer_sys::fuzz_target!(|data: &[u8]| bodies::journal(data));

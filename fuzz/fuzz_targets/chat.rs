//! The `chat` target: see `bodies::chat`.
#![no_main]

mod bodies;

libfuzzer_sys::fuzz_target!(|data: &[u8]| bodies::chat(data));

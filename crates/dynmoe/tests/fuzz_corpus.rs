//! The fuzz targets' committed corpus (`fuzz/corpus/TARGET/`), replayed through the same
//! functions the libFuzzer targets run (`fuzz/fuzz_targets/bodies.rs`): a cheap check on
//! every `cargo test` that no input the fuzzers kept, nor any crash they once found and
//! whose input was added there, fails again. `tools/fuzz/run.sh` fuzzes for real.

#[path = "../../../fuzz/fuzz_targets/bodies.rs"]
mod bodies;

use std::path::Path;

#[test]
fn fuzz_corpus_replays_without_a_failure() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    for (name, target) in bodies::TARGETS {
        let dir = corpus.join(name);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "{}: no corpus", dir.display());
        for input in inputs {
            eprintln!("{name}: {}", input.display());
            target(&std::fs::read(&input).unwrap());
        }
    }
}

//! Golden greedy decode: from the first 16 oracle tokens of each domain, dynmoe's
//! generation loop (one prefill, then one decode step per token) must produce exactly
//! the 24 tokens transformers' `generate(do_sample=False)` produced for the same
//! checkpoint (`greedy.json`, written by `tools/fixtures/train.py greedy`).

use dynmoe::backend::Cpu;
use dynmoe::model;
use dynmoe::runtime::generate::{generate_ids, Sampling};
use dynmoe::testing::fixture_dirs;

#[derive(serde::Deserialize)]
struct Golden {
    new_tokens: usize,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    domain: String,
    prompt: Vec<u32>,
    generated: Vec<u32>,
}

#[test]
fn greedy_decode_matches_transformers_on_every_fixture() {
    let dirs = fixture_dirs();
    assert!(dirs.len() >= 5, "expected the five bundled fixtures");
    for dir in dirs {
        let path = dir.join("greedy.json");
        let golden: Golden = serde_json::from_str(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap();
        let m = model::load(&dir, Cpu::fast()).unwrap();
        for case in &golden.cases {
            let g = generate_ids(
                &m,
                &case.prompt,
                golden.new_tokens,
                Sampling::default(),
                &[],
                &mut |_| {},
            )
            .unwrap();
            assert_eq!(
                g.tokens,
                case.generated,
                "{} [{}]",
                dir.display(),
                case.domain
            );
        }
    }
}

//! The Rust forward pass against transformers' float32 logits.
//!
//! Every checkpoint under `fixtures/models/` carries `oracle.safetensors`, written by
//! `tools/fixtures/train.py`: for each corpus domain a 64-token sequence and
//! transformers' logits at a few of its positions. The sequence is run once as a single
//! prefill chunk and once token by token through the KV cache, on the fast and the
//! reference CPU backends; every compared row must agree within 1e-4 relative error.

use std::collections::BTreeSet;
use std::path::Path;

use dynmoe::backend::{Backend, Cpu};
use dynmoe::model::{self, LoadedModel};
use dynmoe::testing::{fixture_dirs, rel_err};
use safetensors::SafeTensors;

const TOLERANCE: f64 = 1e-4;

struct Case {
    domain: String,
    tokens: Vec<u32>,
    positions: Vec<usize>,
    /// `[positions, vocab]`.
    logits: Vec<f32>,
}

fn i64s(st: &SafeTensors, name: &str) -> Vec<i64> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    t.data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn read_oracle(path: &Path) -> Vec<Case> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let domains: BTreeSet<String> = st
        .names()
        .iter()
        .filter_map(|n| n.strip_suffix(".tokens").map(str::to_string))
        .collect();
    domains
        .into_iter()
        .map(|d| {
            let logits = st.tensor(&format!("{d}.logits")).unwrap();
            Case {
                tokens: i64s(&st, &format!("{d}.tokens"))
                    .into_iter()
                    .map(|t| t as u32)
                    .collect(),
                positions: i64s(&st, &format!("{d}.positions"))
                    .into_iter()
                    .map(|p| p as usize)
                    .collect(),
                logits: logits
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                domain: d,
            }
        })
        .collect()
}

/// Logits at every position of `tokens`, as one prefill chunk or one token at a time.
fn run<B: Backend>(m: &LoadedModel<B>, tokens: &[u32], stepwise: bool) -> Vec<f32> {
    let mut state = m.model.new_state(tokens.len());
    if !stepwise {
        return m.model.forward(&mut state, tokens, 0).unwrap();
    }
    tokens
        .iter()
        .flat_map(|&t| m.model.forward(&mut state, &[t], 0).unwrap())
        .collect()
}

fn check_model(dir: &Path, backend: Cpu) -> usize {
    let m = model::load(dir, backend).unwrap_or_else(|e| panic!("{e}"));
    let vocab = m.model.config.vocab_size;
    let cases = read_oracle(&dir.join("oracle.safetensors"));
    assert!(
        cases.len() >= 5,
        "{}: oracle holds {} domains",
        dir.display(),
        cases.len()
    );
    let (mut rows, mut worst) = (0, 0.0f64);
    for case in &cases {
        for stepwise in [false, true] {
            let got = run(&m, &case.tokens, stepwise);
            for (i, &p) in case.positions.iter().enumerate() {
                let want = &case.logits[i * vocab..(i + 1) * vocab];
                let e = rel_err(&got[p * vocab..(p + 1) * vocab], want);
                assert!(
                    e < TOLERANCE,
                    "{} [{}] {} position {p}: relative error {e:.2e} (backend {}, {})",
                    dir.display(),
                    case.domain,
                    if stepwise { "decode" } else { "prefill" },
                    backend.name(),
                    m.model.config.arch.model_type()
                );
                rows += 1;
                worst = worst.max(e);
            }
        }
    }
    println!(
        "{} on {}: {rows} rows, worst relative error {worst:.2e}",
        dir.file_name().unwrap().to_string_lossy(),
        backend.name()
    );
    rows
}

#[test]
fn every_fixture_has_an_oracle_and_all_architectures_are_covered() {
    let mut archs = BTreeSet::new();
    for dir in fixture_dirs() {
        assert!(
            dir.join("oracle.safetensors").exists(),
            "{} has no oracle",
            dir.display()
        );
        let cfg = dynmoe::checkpoint::Config::from_file(&dir.join("config.json")).unwrap();
        archs.insert(cfg.arch.model_type());
    }
    assert_eq!(
        archs.into_iter().collect::<Vec<_>>(),
        vec![
            "deepseek_v3",
            "glm4_moe",
            "mixtral",
            "olmoe",
            "qwen2_moe",
            "qwen3_moe"
        ]
    );
}

#[test]
fn fast_backend_matches_transformers_on_every_fixture() {
    for dir in fixture_dirs() {
        let rows = check_model(&dir, Cpu::fast());
        assert!(rows >= 10, "{}: only {rows} rows compared", dir.display());
    }
}

#[test]
fn reference_backend_matches_transformers_on_tiny_fixtures() {
    // The reference backend is single-threaded; the small model is covered by the fast
    // backend above and by the parity tests of each kernel.
    for dir in fixture_dirs()
        .into_iter()
        .filter(|d| d.file_name().unwrap().to_str().unwrap().starts_with("tiny"))
    {
        check_model(&dir, Cpu::reference());
    }
}

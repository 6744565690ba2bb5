//! Perplexity end to end: llama.cpp semantics reproduce the perplexity transformers
//! computed for the same checkpoint, the trained small model is far better than chance
//! and than the tiny one, and WikiText-2 gives a finite number.

use std::path::{Path, PathBuf};

use dynmoe::backend::Cpu;
use dynmoe::eval::ppl::{perplexity, PplOptions, PplReport};
use dynmoe::model::{self, LoadedModel};

const DOMAINS: [&str; 5] = ["en", "code", "zh", "math", "json"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn load(name: &str) -> LoadedModel<Cpu> {
    model::load(&root().join("fixtures/models").join(name), Cpu::fast()).unwrap()
}

fn test_split(domain: &str) -> String {
    std::fs::read_to_string(root().join("data/corpus").join(domain).join("test.txt")).unwrap()
}

fn ppl(m: &LoadedModel<Cpu>, text: &str, chunks: Option<usize>) -> PplReport {
    perplexity(
        m,
        text,
        PplOptions {
            ctx: 512,
            max_chunks: chunks,
            micro_batch: None,
        },
        &mut |_, _| {},
    )
    .unwrap()
}

/// The per-domain test perplexities transformers computed when the model was trained,
/// from the table in the model's README.
fn transformers_table(name: &str) -> Vec<(String, f64)> {
    let readme =
        std::fs::read_to_string(root().join("fixtures/models").join(name).join("README.md"))
            .unwrap();
    readme
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (cells.len() == 6 && DOMAINS.contains(&cells[1])).then(|| {
                (
                    cells[1].to_string(),
                    cells[2].parse().expect("a numeric perplexity"),
                )
            })
        })
        .collect()
}

#[test]
fn full_split_perplexity_matches_transformers_for_the_tiny_model() {
    let m = load("tiny-moe");
    let table = transformers_table("tiny-moe");
    assert_eq!(table.len(), DOMAINS.len(), "README table incomplete");
    for (domain, want) in table {
        let r = ppl(&m, &test_split(&domain), None);
        assert_eq!(r.tokens_scored, r.chunks * 255);
        let rel = (r.ppl - want).abs() / want;
        // The README prints three decimals; the two float32 implementations agree far closer.
        assert!(
            rel < 1e-4 + 0.0006 / want,
            "{domain}: dynmoe {} vs transformers {want}",
            r.ppl
        );
    }
}

#[test]
fn small_model_beats_tiny_and_chance_on_every_domain() {
    let (tiny, small) = (load("tiny-moe"), load("small-moe"));
    let vocab = small.model.config.vocab_size as f64;
    for d in DOMAINS {
        let text = test_split(d);
        let (t, s) = (ppl(&tiny, &text, Some(3)), ppl(&small, &text, Some(3)));
        assert!(
            s.ppl.is_finite() && s.ppl > 1.0 && s.ppl < vocab / 10.0,
            "{d}: small {}",
            s.ppl
        );
        assert!(
            t.ppl > s.ppl,
            "{d}: tiny {} not above small {}",
            t.ppl,
            s.ppl
        );
        assert!(s.ppl_stderr > 0.0 && s.ppl_stderr < s.ppl);
    }
}

#[test]
fn wikitext2_gives_a_finite_perplexity() {
    let path = root().join("data/wikitext-2-raw/wiki.test.raw");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let r = ppl(&load("small-moe"), &text, Some(4));
    assert_eq!((r.chunks, r.tokens_scored), (4, 4 * 255));
    assert!(r.ppl.is_finite() && r.ppl > 1.0, "{}", r.ppl);
}

#[test]
fn text_shorter_than_two_chunks_is_refused() {
    let m = load("tiny-moe");
    let e = perplexity(&m, "a short text", PplOptions::default(), &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("needs at least 1024"), "{e}");
}

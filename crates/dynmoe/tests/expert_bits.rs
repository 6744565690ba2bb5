//! Running a converted model straight from its expert stores at 4, 3 and 2 bits.
//!
//! The forward pass with experts read in place from `experts.bin`, `experts3.bin` and
//! `experts2.bin` must agree with the same forward pass on the dequantized weights
//! (so the quantized kernels, the padding of the expert width and the store reader
//! are right), stay close to the bf16 checkpoint at 4 bits, and get worse as bits fall.

use std::path::{Path, PathBuf};

use dynmoe::backend::Cpu;
use dynmoe::eval::ppl::{perplexity, PplOptions};
use dynmoe::model::{self, Error, ExpertBits};
use dynmoe::testing::{fixture, rel_err, TempDir};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A converted copy of a fixture in a temporary directory.
fn converted(name: &str) -> TempDir {
    let dir = TempDir::new("expert-bits");
    dynmoe::store::base::convert(&fixture(name), dir.dir(), &mut |_, _| {}).unwrap();
    dir
}

fn bits(b: u32) -> ExpertBits {
    ExpertBits {
        default: Some(b),
        ..ExpertBits::default()
    }
}

fn logits(dir: &Path, b: Option<u32>, backend: Cpu, tokens: &[u32]) -> Vec<f32> {
    let m = model::load_with(dir, backend, &b.map(bits).unwrap_or_default()).unwrap();
    let mut state = m.model.new_state(tokens.len());
    m.model.forward(&mut state, tokens, 0).unwrap()
}

fn tokens(n: usize) -> Vec<u32> {
    let m = model::load(&root().join("fixtures/models/tiny-moe"), Cpu::fast()).unwrap();
    let text = std::fs::read_to_string(root().join("data/corpus/en/test.txt")).unwrap();
    m.tokenizer.encode(&text).unwrap()[..n].to_vec()
}

#[test]
fn fast_kernels_match_the_reference_backend_at_every_precision() {
    // small-moe's experts are 80 wide: the down projection's input is padded to 128.
    let c = converted("small-moe");
    let t = tokens(40);
    for b in [4, 3, 2] {
        let fast = logits(c.dir(), Some(b), Cpu::fast(), &t);
        let reference = logits(c.dir(), Some(b), Cpu::reference(), &t);
        let e = rel_err(&fast, &reference);
        assert!(e < 1e-4, "{b} bits: fast vs reference {e:.2e}");
    }
}

#[test]
fn error_against_bf16_grows_as_bits_fall() {
    let c = converted("small-moe");
    let t = tokens(64);
    let full = logits(
        &root().join("fixtures/models/small-moe"),
        None,
        Cpu::fast(),
        &t,
    );
    let errs: Vec<f64> = [4, 3, 2]
        .iter()
        .map(|&b| rel_err(&logits(c.dir(), Some(b), Cpu::fast(), &t), &full))
        .collect();
    assert!(errs[0] < 0.1, "4-bit logits {:.3} from bf16", errs[0]);
    assert!(
        errs[0] < errs[1] && errs[1] < errs[2],
        "errors not ordered: {errs:?}"
    );
}

#[test]
fn perplexity_is_ordered_bf16_4_3_2() {
    let c = converted("small-moe");
    let text = std::fs::read_to_string(root().join("data/corpus/code/test.txt")).unwrap();
    let opts = PplOptions {
        ctx: 512,
        max_chunks: Some(4),
        micro_batch: None,
    };
    let ppl = |dir: &Path, b: Option<u32>| {
        let m = model::load_with(dir, Cpu::fast(), &b.map(bits).unwrap_or_default()).unwrap();
        perplexity(&m, &text, opts, &mut |_, _| {}).unwrap().ppl
    };
    let full = ppl(&root().join("fixtures/models/small-moe"), None);
    let q: Vec<f64> = [4, 3, 2].iter().map(|&b| ppl(c.dir(), Some(b))).collect();
    assert!(q[0] < full * 1.05, "4-bit {} vs bf16 {full}", q[0]);
    assert!(q[0] < q[1] && q[1] < q[2], "not ordered 4 < 3 < 2: {q:?}");
}

#[test]
fn per_layer_override_mixes_precisions() {
    let c = converted("tiny-moe");
    let t = tokens(24);
    let mixed = ExpertBits {
        default: Some(2),
        per_layer: [(0, 4)].into_iter().collect(),
    };
    let m = model::load_with(c.dir(), Cpu::fast(), &mixed).unwrap();
    let mut state = m.model.new_state(t.len());
    let got = m.model.forward(&mut state, &t, 0).unwrap();
    let (all4, all2) = (
        logits(c.dir(), Some(4), Cpu::fast(), &t),
        logits(c.dir(), Some(2), Cpu::fast(), &t),
    );
    assert!(
        rel_err(&got, &all4) > 0.0 && rel_err(&got, &all2) > 0.0,
        "override had no effect"
    );
}

#[test]
fn bad_precision_and_unconverted_directories_are_refused() {
    let c = converted("tiny-moe");
    let e = model::load_with(c.dir(), Cpu::fast(), &bits(5))
        .err()
        .expect("5 bits refused");
    assert!(matches!(e, Error::ExpertBits { bits: 5, .. }), "{e}");
    let e = model::load_with(
        &root().join("fixtures/models/tiny-moe"),
        Cpu::fast(),
        &bits(2),
    )
    .err()
    .expect("an unconverted directory has no stores");
    assert!(matches!(e, Error::NoExpertStore { .. }), "{e}");
}

#[test]
fn kl_divergence_to_bf16_is_zero_for_itself_and_grows_as_bits_fall() {
    use dynmoe::eval::kld::kl_divergence;
    let c = converted("tiny-moe");
    let text = std::fs::read_to_string(root().join("data/corpus/en/test.txt")).unwrap();
    let opts = PplOptions {
        ctx: 128,
        max_chunks: Some(4),
        ..PplOptions::default()
    };
    let full = model::load(&root().join("fixtures/models/tiny-moe"), Cpu::fast()).unwrap();
    let same = kl_divergence(&full, &full, &text, opts).unwrap();
    assert!(same.kld_mean.abs() < 1e-9, "{same:?}");
    assert_eq!(same.top1_agreement, 1.0);
    assert_eq!(same.ppl, same.ppl_reference);
    let at = |b| {
        let m = model::load_with(c.dir(), Cpu::fast(), &bits(b)).unwrap();
        kl_divergence(&m, &full, &text, opts).unwrap()
    };
    let (q4, q2) = (at(4), at(2));
    assert!(
        q4.kld_mean > 0.0 && q4.kld_mean < q2.kld_mean,
        "{q4:?} {q2:?}"
    );
    assert!(q4.top1_agreement >= q2.top1_agreement, "{q4:?} {q2:?}");
    let direct = perplexity(&full, &text, opts, &mut |_, _| {}).unwrap().ppl;
    assert!((q4.ppl_reference - direct).abs() < 1e-9 * direct);
}

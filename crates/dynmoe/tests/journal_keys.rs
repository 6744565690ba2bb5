//! The probe journal of `compress` is keyed by what was probed: the checkpoint's bytes
//! and each calibration text's bytes. A file changed under the same name is probed
//! again, with a notice; an unchanged one is answered from the journal; a damaged line
//! is never trusted.

use std::path::Path;
use std::sync::Mutex;

use dynmoe::alloc::compress::{compress, BudgetScope, CompressOptions};
use dynmoe::checkpoint::Checkpoint;
use dynmoe::store::content_fingerprint;
use dynmoe::testing::{fixture_copy, TempDir};

/// Probes answered from the journal (a run asks for some settings more than once, so
/// even a fresh run has some), probes measured (lines the run appended), and the notices
/// the run gave.
struct Run {
    reused: u64,
    measured: usize,
    notices: Vec<String>,
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.lines().count())
}

fn run(model: &Path, calib: &Path, out: &Path) -> Run {
    let opts = CompressOptions {
        bits: 6.0,
        scope: BudgetScope::Experts,
        rounds: 1,
        anneal: Vec::new(),
        chunks: 1,
        ctx: 128,
        dense_codec: None,
        shadow: None,
    };
    let text = std::fs::read_to_string(calib).unwrap();
    let journal = out.join("probes.jsonl");
    let before = lines(&journal);
    let notices = Mutex::new(Vec::new());
    let plan = compress(
        model,
        &[("calib.txt".into(), text)],
        out,
        &opts,
        &|_| {},
        &|n| notices.lock().unwrap().push(n.to_string()),
    )
    .unwrap();
    Run {
        reused: plan.rounds["probes_from_journal"].as_u64().unwrap(),
        measured: lines(&journal) - before,
        notices: notices.into_inner().unwrap(),
    }
}

/// Flips the lowest mantissa bit of the checkpoint's last bf16 weight: a finite weight
/// that differs, in a file of the same name and size.
fn nudge_last_weight(model: &Path) {
    let path = model.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 2] ^= 1;
    std::fs::write(&path, bytes).unwrap();
}

#[test]
fn changed_texts_or_weights_are_probed_again_and_unchanged_ones_reused() {
    let model = fixture_copy("tiny-moe");
    let work = TempDir::new("journal-keys");
    let calib = work.path("calib.txt");
    let text = std::fs::read("../../data/corpus/code/calib.txt").unwrap();
    std::fs::write(&calib, &text).unwrap();
    let out = work.path("out");

    let first = run(model.dir(), &calib, &out);
    let (asked, fresh) = (first.reused as usize + first.measured, first.reused);
    assert!(first.measured > 4, "{} probes", first.measured);
    assert!(first.notices.is_empty(), "{:?}", first.notices);

    let same = run(model.dir(), &calib, &out);
    assert_eq!((same.reused as usize, same.measured), (asked, 0));
    assert!(same.notices.is_empty(), "{:?}", same.notices);

    // One byte of the calibration text, same name and length.
    let mut edited = text.clone();
    let i = edited.iter().position(|&b| b == b'e').unwrap();
    edited[i] = b'a';
    std::fs::write(&calib, &edited).unwrap();
    let text_changed = run(model.dir(), &calib, &out);
    assert_eq!(text_changed.reused, fresh);
    assert_eq!(text_changed.measured, first.measured);
    let said = text_changed.notices.join("\n");
    assert!(
        said.contains(&format!(
            "{} probes were recorded under another key",
            first.measured
        )) && said.contains("not trusted"),
        "{said}"
    );

    // One weight of the checkpoint, same file name and size.
    nudge_last_weight(model.dir());
    let weight_changed = run(model.dir(), &calib, &out);
    assert_eq!(weight_changed.reused, fresh);
    assert_eq!(weight_changed.measured, first.measured);

    // The first text with the nudged checkpoint is a pair never probed.
    std::fs::write(&calib, &text).unwrap();
    let both_back = run(model.dir(), &calib, &out);
    assert_eq!(both_back.measured, first.measured);
    let again = run(model.dir(), &calib, &out);
    assert_eq!((again.reused as usize, again.measured), (asked, 0));

    // A journalled loss changed on disk is not trusted, and said so: that probe alone
    // is measured again.
    let journal = out.join("probes.jsonl");
    let mut lines: Vec<String> = std::fs::read_to_string(&journal)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    let last = lines.len() - 1;
    let at = lines[last].find("\"loss\":").unwrap() + "\"loss\":".len();
    let digit = if lines[last][at..].starts_with('9') {
        "8"
    } else {
        "9"
    };
    lines[last].replace_range(at..at + 1, digit);
    std::fs::write(&journal, lines.join("\n") + "\n").unwrap();
    let damaged = run(model.dir(), &calib, &out);
    assert_eq!(damaged.measured, 1);
    assert_eq!(damaged.reused as usize, asked - 1);
    let said = damaged.notices.join("\n");
    assert!(
        said.contains(&format!("line(s) {} damaged", last + 1)) && said.contains("probes.jsonl"),
        "{said}"
    );
}

#[test]
fn the_content_fingerprint_follows_every_byte_not_the_name() {
    let a = fixture_copy("tiny-moe");
    let b = fixture_copy("tiny-moe");
    let print = |dir: &Path| content_fingerprint(&Checkpoint::open(dir).unwrap(), dir).unwrap();
    assert_eq!(print(a.dir()), print(b.dir()));
    nudge_last_weight(b.dir());
    assert_ne!(print(a.dir()), print(b.dir()));
    // The tokenizer decides what the calibration tokens are.
    let c = fixture_copy("tiny-moe");
    let path = c.path("tokenizer.json");
    let mut t = std::fs::read(&path).unwrap();
    t.push(b'\n');
    std::fs::write(&path, t).unwrap();
    assert_ne!(print(a.dir()), print(c.dir()));
}

//! What each fuzz target does with an input, shared by the libFuzzer targets beside this
//! file (`cargo fuzz`, tools/fuzz/run.sh) and by the test that replays the committed
//! corpus on every `cargo test` (crates/dynmoe/tests/fuzz_corpus.rs). Every function
//! takes any bytes; a panic, a hang or an abort is a bug found.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use dynmoe::checkpoint::{Checkpoint, Config, Tokenizer};
use dynmoe::runtime::chat::{ChatTemplate, Message};
use dynmoe::serve::api::{parse_chat, parse_completion, ApiError, Params};
use dynmoe::store::journal::Journal;
use dynmoe::store::plan::Plan;
use dynmoe::store::{lowbit, vq::VqManifest, ExpertStore, Manifest};

/// What a target does with one input.
pub type Target = fn(&[u8]);

/// The targets, by name: what tools/fuzz/run.sh and the corpus directories are called.
#[allow(dead_code)]
pub const TARGETS: [(&str, Target); 7] = [
    ("checkpoint", checkpoint),
    ("config", config),
    ("chat", chat),
    ("store", store),
    ("plan", plan),
    ("journal", journal),
    ("http", http),
];

/// A directory of this process's own, emptied of `names` before each input.
fn scratch(names: &[&str]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dynmoe-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for n in names {
        let _ = std::fs::remove_file(dir.join(n));
    }
    dir
}

/// `data` cut at its first 0xFF byte (which no UTF-8 text holds): the part before, and
/// the rest (empty when there is no 0xFF).
fn split(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|&b| b == 0xFF) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}

/// `config.json`: any text resolves to a configuration or an error naming the file,
/// never a panic or an allocation sized by a field.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = Config::from_json(text, Path::new("config.json")) {
        // What loading sizes from it is bounded.
        assert!(c.layers.len() <= 4096);
        assert!(c.rms_norm_eps > 0.0 && c.rms_norm_eps.is_finite());
        assert!(c.rope.theta > 0.0 && c.rope.linear_factor > 0.0);
        assert!(c
            .eos_token_ids
            .iter()
            .all(|&id| (id as usize) < c.vocab_size));
        let _ = (c.q_dim(), c.kv_dim(), c.moe_layers().count());
    }
}

/// Safetensors shards and their index: an index (before the first 0xFF) and a shard's
/// bytes (after it; with no index, the single `model.safetensors`). Opening checks every
/// header; each tensor is then read.
pub fn checkpoint(data: &[u8]) {
    const SHARD: &str = "model-00001-of-00001.safetensors";
    const INDEX: &str = "model.safetensors.index.json";
    let dir = scratch(&[SHARD, INDEX, "model.safetensors"]);
    let (index, shard) = split(data);
    if index.is_empty() {
        std::fs::write(dir.join("model.safetensors"), shard).unwrap();
    } else {
        std::fs::write(dir.join(INDEX), index).unwrap();
        std::fs::write(dir.join(SHARD), shard).unwrap();
    }
    let Ok(ckpt) = Checkpoint::open(&dir) else {
        return;
    };
    for name in ckpt.names() {
        let Ok(info) = ckpt.info(name) else { continue };
        let Ok(raw) = ckpt.raw(name) else { continue };
        // Offsets were checked against the file: every byte is there.
        let _ = raw.bytes.iter().fold(0u8, |a, &b| a ^ b);
        if info.shape.iter().product::<usize>() <= 1 << 16 {
            let _ = ckpt.f32(name, &info.shape);
        }
    }
}

static TOKENIZER: Mutex<Option<Tokenizer>> = Mutex::new(None);

/// The tiny fixture's directory, found from the crate being built (this file is built by
/// the fuzz crate and by the dynmoe crate's tests).
fn tiny() -> PathBuf {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    while !dir.join("fixtures/models/tiny-moe").exists() {
        assert!(dir.pop(), "no fixtures/models/tiny-moe above the crate");
    }
    dir.join("fixtures/models/tiny-moe")
}

/// `tokenizer_config.json` (before the first 0xFF) and a user's message (after it): the
/// special tokens and chat template the config names are taken, the template compiled and
/// rendered, and the prompt encoded with the message's special tokens as text.
pub fn chat(data: &[u8]) {
    let mut guard = TOKENIZER.lock().unwrap_or_else(|e| e.into_inner());
    let tok = guard.get_or_insert_with(|| Tokenizer::from_dir(&tiny()).unwrap());
    let (config, message) = split(data);
    let content = String::from_utf8_lossy(message);
    if tok
        .apply_config_json(config, Path::new("tokenizer_config.json"))
        .is_err()
    {
        return;
    }
    let Ok(template) = ChatTemplate::for_tokenizer(tok) else {
        return;
    };
    let messages = [
        Message::new("system", "Be brief."),
        Message::new("user", &content),
    ];
    let Ok(ids) = template.encode(tok, &messages) else {
        return;
    };
    // Under the default ChatML template a message cannot add control tokens: the prompt
    // has the template's own three starts (system, user, the reply's), and a fourth where
    // the tokenizer's BOS token is that token.
    if tok.chat_template.is_none() {
        let start = tok.token_id("<|im_start|>").unwrap();
        let starts = ids.iter().filter(|&&t| t == start).count();
        let bos = usize::from(tok.bos == Some(start));
        assert_eq!(starts, 3 + bos, "{content:?}");
    }
}

/// An affine expert store: `experts.json` (before the first 0xFF) and `experts.bin` (after
/// it), checked in full as `dynmoe store verify` does and, if usable, opened and every
/// layer's records checked as a model's first forward call does; and the same manifest
/// read as a VQ store's.
pub fn store(data: &[u8]) {
    let dir = scratch(&["experts.json", "experts.bin", "experts-vq2.json"]);
    let (manifest, records) = split(data);
    std::fs::write(dir.join("experts.json"), manifest).unwrap();
    std::fs::write(dir.join("experts-vq2.json"), manifest).unwrap();
    std::fs::write(dir.join("experts.bin"), records).unwrap();
    if let Ok(m) = serde_json::from_slice::<Manifest>(manifest) {
        let _ = m.layout(&dir.join("experts.json"));
    }
    let _ = VqManifest::read(&dir.join("experts-vq2.json"));
    if lowbit::verify(&dir, &[4]).is_ok() {
        let store = ExpertStore::open(&dir, 4).unwrap();
        for &layer in store.layers() {
            store.verify_layer(layer).unwrap();
            let r = store.record(layer, 0);
            assert_eq!(r.down.rows, store.layout().hidden);
        }
    }
}

/// `plan.json`: any bytes parse and validate to a plan or an error naming the field.
pub fn plan(data: &[u8]) {
    if let Ok(plan) = serde_json::from_slice::<Plan>(data) {
        let _ = plan.validate(Path::new("plan.json"));
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Probe {
    key: String,
    loss: f64,
}

/// The probe journal (`probes.jsonl`): any file reopens, keeping the lines of its context
/// that parse, and a line appended after whatever torn line it ended with is read back.
pub fn journal(data: &[u8]) {
    let dir = scratch(&["probes.jsonl"]);
    let path = dir.join("probes.jsonl");
    std::fs::write(&path, data).unwrap();
    let (journal, before) = Journal::open::<Probe>(&path, "ctx").unwrap();
    let before = before.entries;
    let probe = Probe {
        key: "q4:0".into(),
        loss: 1.5,
    };
    journal.append(&probe).unwrap();
    drop(journal);
    let (_, after) = Journal::open::<Probe>(&path, "ctx").unwrap();
    assert_eq!(
        after.entries.len(),
        before.len() + 1,
        "the appended line was lost"
    );
}

/// A request body of `/v1/completions` and of `/v1/chat/completions`: any bytes give
/// settings the sampler accepts, or an OpenAI error object naming what is wrong, never a
/// panic.
pub fn http(data: &[u8]) {
    let settled = |got: Result<Params, ApiError>| match got {
        Ok(p) => {
            if let Err(e) = p.sampling.check() {
                panic!("a body's settings the sampler refuses: {e}");
            }
            assert!(p.stop.len() <= 4, "{} stop sequences", p.stop.len());
        }
        Err(e) => {
            assert!((400..600).contains(&e.status), "status {}", e.status);
            let body = e.body();
            assert!(body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()));
        }
    };
    settled(parse_completion(data, 7).map(|(_, p)| p));
    settled(parse_chat(data, 7).map(|(messages, p)| {
        assert!(!messages.is_empty());
        p
    }));
}

//! Bad checkpoints and inputs give clear errors naming the file and the field or
//! tensor, never a panic. Each test damages a copy of the tiny fixture one way.

use std::path::{Path, PathBuf};

use dynmoe::backend::Cpu;
use dynmoe::checkpoint::Error as CkError;
use dynmoe::model::{self, Error};
use dynmoe::testing::{fixture, TempDir};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

/// A copy of a fixture directory, to be damaged one way.
struct Scratch(TempDir);

impl Scratch {
    fn copy_of(name: &str) -> Scratch {
        let dir = TempDir::new("bad-input");
        for entry in std::fs::read_dir(fixture(name)).unwrap() {
            let p = entry.unwrap().path();
            std::fs::copy(&p, dir.path(p.file_name().unwrap().to_str().unwrap())).unwrap();
        }
        Scratch(dir)
    }

    fn dir(&self) -> &Path {
        self.0.dir()
    }

    fn path(&self, file: &str) -> PathBuf {
        self.0.path(file)
    }

    fn load_err(&self) -> Error {
        match model::load(self.dir(), Cpu::fast()) {
            Ok(_) => panic!("{} loaded despite the damage", self.dir().display()),
            Err(e) => e,
        }
    }

    /// Rewrites model.safetensors after `edit` changes the list of (name, dtype, shape, bytes).
    fn rewrite_weights(
        &self,
        edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
    ) {
        let path = self.path("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<_> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
            .collect();
        edit(&mut tensors);
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
    }
}

fn edit_config(s: &Scratch, from: &str, to: &str) {
    let p = s.path("config.json");
    let text = std::fs::read_to_string(&p).unwrap();
    assert!(text.contains(from), "config.json has no {from:?}");
    std::fs::write(&p, text.replacen(from, to, 1)).unwrap();
}

fn assert_mentions(e: &Error, parts: &[&str]) {
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "error {msg:?} does not mention {p:?}");
    }
}

#[test]
fn unsupported_model_type() {
    let s = Scratch::copy_of("tiny-moe");
    edit_config(&s, "\"qwen3_moe\"", "\"deepseek_v3\"");
    let e = s.load_err();
    assert!(matches!(
        e,
        Error::Checkpoint(CkError::UnsupportedArch { .. })
    ));
    assert_mentions(&e, &["config.json", "deepseek_v3"]);
}

#[test]
fn malformed_config_json() {
    let s = Scratch::copy_of("tiny-moe");
    std::fs::write(s.path("config.json"), "{\"model_type\": \"qwen3_moe\", ").unwrap();
    let e = s.load_err();
    assert!(matches!(e, Error::Checkpoint(CkError::Json { .. })));
    assert_mentions(&e, &["config.json"]);
}

#[test]
fn config_field_of_the_wrong_type() {
    let s = Scratch::copy_of("tiny-moe");
    edit_config(&s, "\"hidden_size\": 64", "\"hidden_size\": \"sixty-four\"");
    let e = s.load_err();
    assert_mentions(&e, &["config.json", "hidden_size"]);
}

#[test]
fn missing_tensor() {
    let s = Scratch::copy_of("tiny-moe");
    let gone = "model.layers.1.mlp.experts.3.up_proj.weight";
    s.rewrite_weights(|t| t.retain(|(n, ..)| n != gone));
    let e = s.load_err();
    assert!(matches!(
        e,
        Error::Checkpoint(CkError::MissingTensor { .. })
    ));
    assert_mentions(&e, &[gone, "model.safetensors"]);
}

#[test]
fn misshapen_tensor() {
    let s = Scratch::copy_of("tiny-moe");
    let bent = "model.layers.0.self_attn.q_proj.weight";
    s.rewrite_weights(|t| {
        let entry = t.iter_mut().find(|(n, ..)| n == bent).unwrap();
        let numel: usize = entry.2.iter().product();
        entry.2 = vec![numel / 2, 2];
    });
    let e = s.load_err();
    assert!(matches!(e, Error::Checkpoint(CkError::TensorShape { .. })));
    assert_mentions(&e, &[bent, "model.safetensors"]);
}

#[test]
fn tensor_of_an_unreadable_dtype() {
    let s = Scratch::copy_of("tiny-moe");
    let odd = "model.norm.weight";
    s.rewrite_weights(|t| {
        let entry = t.iter_mut().find(|(n, ..)| n == odd).unwrap();
        entry.1 = safetensors::Dtype::I16;
    });
    let e = s.load_err();
    assert!(matches!(e, Error::Checkpoint(CkError::TensorDtype { .. })));
    assert_mentions(&e, &[odd]);
}

#[test]
fn truncated_safetensors() {
    let s = Scratch::copy_of("tiny-moe");
    let p = s.path("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 1000).unwrap();
    let e = s.load_err();
    assert!(
        matches!(e, Error::Checkpoint(CkError::Safetensors { .. })),
        "{e}"
    );
    assert_mentions(&e, &["model.safetensors"]);
}

#[test]
fn garbage_safetensors_header() {
    let s = Scratch::copy_of("tiny-moe");
    std::fs::write(
        s.path("model.safetensors"),
        b"\xff\xff\xff\xff\xff\xff\xff\x7fnot a header",
    )
    .unwrap();
    let e = s.load_err();
    assert!(
        matches!(e, Error::Checkpoint(CkError::Safetensors { .. })),
        "{e}"
    );
}

#[test]
fn no_weights_at_all() {
    let s = Scratch::copy_of("tiny-moe");
    std::fs::remove_file(s.path("model.safetensors")).unwrap();
    let e = s.load_err();
    assert!(
        matches!(e, Error::Checkpoint(CkError::NoWeights { .. })),
        "{e}"
    );
}

#[test]
fn index_naming_a_missing_shard() {
    let s = Scratch::copy_of("tiny-mixtral");
    let shard = std::fs::read_dir(s.dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(".safetensors"))
        .unwrap();
    std::fs::remove_file(&shard).unwrap();
    let e = s.load_err();
    assert!(matches!(e, Error::Checkpoint(CkError::Io { .. })), "{e}");
    assert_mentions(&e, &[shard.file_name().unwrap().to_str().unwrap()]);
}

#[test]
fn malformed_index() {
    let s = Scratch::copy_of("tiny-mixtral");
    std::fs::write(
        s.path("model.safetensors.index.json"),
        "{\"weight_map\": 3}",
    )
    .unwrap();
    let e = s.load_err();
    assert!(matches!(e, Error::Checkpoint(CkError::Json { .. })), "{e}");
    assert_mentions(&e, &["model.safetensors.index.json"]);
}

#[test]
fn broken_tokenizer() {
    let s = Scratch::copy_of("tiny-moe");
    std::fs::write(s.path("tokenizer.json"), "{\"model\": 1}").unwrap();
    let e = s.load_err();
    assert!(
        matches!(e, Error::Checkpoint(CkError::Tokenizer { .. })),
        "{e}"
    );
    assert_mentions(&e, &["tokenizer.json"]);
}

#[test]
fn token_outside_the_vocabulary_and_context_overflow() {
    let m = model::load(&fixture("tiny-moe"), Cpu::fast()).unwrap();
    let vocab = m.model.config.vocab_size as u32;
    let mut state = m.model.new_state(4);
    let e = m.model.forward(&mut state, &[1, vocab], 0).unwrap_err();
    assert!(matches!(e, Error::TokenOutOfRange { .. }), "{e}");
    let e = m
        .model
        .forward(&mut state, &[1, 2, 3, 4, 5], 0)
        .unwrap_err();
    assert!(matches!(e, Error::ContextOverflow { .. }), "{e}");
    // The state is still usable after refused calls.
    assert_eq!(
        m.model.forward(&mut state, &[1, 2], 1).unwrap().len(),
        vocab as usize
    );
}

//! What the issue "no silent corruption, no panic" found, as a user meets it through the
//! binary: damaged stores and weights end in an error that names them (exit 1), never in
//! a `PPL = NaN` with exit 0; a closed stdout ends a command quietly; generation stops at
//! the model's context.

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};

mod common;

use common::{dynmoe, fixture, root};
use dynmoe::store::Layout;
use dynmoe::testing::TempDir;
use serde_json::Value;

fn ok(args: &[&str]) -> String {
    let out = dynmoe(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The stderr of a command that must fail with exit 1 (an error, not a panic's 101).
fn failure(args: &[&str]) -> String {
    let out = dynmoe(args);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn overwrite(path: &Path, at: u64, bytes: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

fn copy_of(name: &str) -> TempDir {
    let dir = TempDir::new("hardening");
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path(p.file_name().unwrap().to_str().unwrap())).unwrap();
    }
    dir
}

fn converted(name: &str) -> TempDir {
    let dir = TempDir::new("hardening");
    ok(&[
        "convert",
        "--model",
        fixture(name).to_str().unwrap(),
        "-o",
        dir.dir().to_str().unwrap(),
    ]);
    dir
}

const TEXT: &str = "data/corpus/en/test.txt";

fn ppl_args<'a>(dir: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "eval", "ppl", "--model", dir, "--text", TEXT, "--chunks", "1", "--ctx", "32",
    ];
    v.extend_from_slice(extra);
    v
}

#[test]
fn damaged_experts_bin_is_an_error_not_a_derived_store() {
    let out = converted("tiny-moe");
    let dir = out.dir().to_str().unwrap();
    overwrite(&out.path("experts.bin"), 0, &[0u8; 4096]);
    let err = failure(&ppl_args(dir, &["--expert-bits", "2"]));
    assert!(
        err.contains("experts.bin") && err.contains("record 0") && err.contains("damaged"),
        "{err}"
    );
    assert!(!out.path("experts2.json").exists());
    let err = failure(&["store", "ensure", "--model", dir, "--bits", "2"]);
    assert!(
        err.contains("experts.bin") && err.contains("damaged"),
        "{err}"
    );
    let err = failure(&["store", "verify", "--model", dir]);
    assert!(
        err.contains("experts.bin") && err.contains("record 0"),
        "{err}"
    );
}

#[test]
fn damaged_low_bit_record_is_named_not_scored_as_nan_and_ensure_rebuilds_it() {
    let out = converted("small-moe");
    let dir = out.dir().to_str().unwrap();
    ok(&["store", "ensure", "--model", dir, "--bits", "2"]);
    let l2 = Layout::new(2, 256, 80).unwrap();
    let scales = l2.scale_blocks()[0];
    let at = l2.record_offset(1) + scales.offset as u64;
    overwrite(&out.path("experts2.bin"), at, &vec![0xFF; scales.len]);

    let err = failure(&ppl_args(dir, &["--expert-bits", "2"]));
    assert!(
        err.contains("experts2.bin") && err.contains("record 1 ") && err.contains("damaged"),
        "{err}"
    );
    let err = failure(&["store", "verify", "--model", dir, "--bits", "2"]);
    assert!(
        err.contains("experts2.bin") && err.contains("record 1 "),
        "{err}"
    );
    let ensured = ok(&["store", "ensure", "--model", dir, "--bits", "2"]);
    assert!(ensured.contains("2-bit built"), "{ensured}");
    let verified = ok(&["store", "verify", "--model", dir]);
    assert!(
        verified.contains("4-bit ok") && verified.contains("2-bit ok"),
        "{verified}"
    );
    let scored = ok(&ppl_args(dir, &["--expert-bits", "2"]));
    assert!(
        scored.contains("PPL = ") && !scored.contains("NaN"),
        "{scored}"
    );
}

/// Writes bf16 `value` over element `index` of tensor `name` of `model.safetensors`.
fn poison(dir: &TempDir, name: &str, index: usize, value: f32) {
    let path = dir.path("model.safetensors");
    let mut f = std::fs::File::open(&path).unwrap();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).unwrap();
    let len = u64::from_le_bytes(len) as usize;
    let mut header = vec![0u8; len];
    f.read_exact(&mut header).unwrap();
    let header: Value = serde_json::from_slice(&header).unwrap();
    let t = &header[name];
    assert_eq!(t["dtype"], "BF16");
    let start = t["data_offsets"][0].as_u64().unwrap();
    let bits = (value.to_bits() >> 16) as u16;
    overwrite(
        &path,
        8 + len as u64 + start + 2 * index as u64,
        &bits.to_le_bytes(),
    );
}

#[test]
fn nan_weights_are_an_error_with_or_without_the_weight_check() {
    let model = copy_of("tiny-moe");
    let dir = model.dir().to_str().unwrap();
    let name = "model.layers.0.self_attn.q_proj.weight";
    poison(&model, name, 5, f32::NAN);
    let err = failure(&ppl_args(dir, &[]));
    assert!(
        err.contains(name) && err.contains("not a finite number"),
        "{err}"
    );
    // Loaded anyway, the NaN reaches the logits: an error, not `PPL = NaN`.
    let err = failure(&ppl_args(dir, &["--no-check-weights"]));
    assert!(err.contains("not finite numbers"), "{err}");
    // Nor empty text reported as a stop at EOS.
    let err = failure(&[
        "run",
        "--model",
        dir,
        "--prompt",
        "Call me",
        "-n",
        "4",
        "--no-check-weights",
    ]);
    assert!(err.contains("not finite numbers"), "{err}");
}

#[test]
fn a_closed_stdout_ends_run_and_chat_quietly() {
    let tiny = fixture("tiny-moe");
    for (args, input) in [
        (
            vec!["run", "--prompt", "Call me Ishmael", "-n", "200"],
            None,
        ),
        (
            vec!["chat", "-n", "64"],
            Some("Call me Ishmael\nSome years ago\n"),
        ),
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dynmoe"))
            .args(&args)
            .args(["--model", tiny.to_str().unwrap()])
            .current_dir(root())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        if let Some(text) = input {
            use std::io::Write;
            stdin.write_all(text.as_bytes()).unwrap();
        }
        // `| head -c1`: one byte read, then the pipe closed.
        let mut one = [0u8; 1];
        child.stdout.take().unwrap().read_exact(&mut one).unwrap();
        drop(stdin);
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() || out.status.signal() == Some(libc_sigpipe()),
            "{args:?}: {:?}: {stderr}",
            out.status
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// SIGPIPE's number on Linux.
fn libc_sigpipe() -> i32 {
    13
}

#[test]
fn generation_stops_at_the_model_context_and_longer_ctx_is_refused() {
    let model = copy_of("tiny-moe");
    let dir = model.dir().to_str().unwrap();
    let config = model.path("config.json");
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "\"max_position_embeddings\": 2048",
        "\"max_position_embeddings\": 32",
    );
    std::fs::write(&config, text).unwrap();
    let out = dynmoe(&[
        "run", "--model", dir, "--prompt", "Call me", "-n", "3000", "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let g: Value = serde_json::from_slice(&out.stdout).unwrap();
    let used = g["prompt_tokens"].as_u64().unwrap() + g["tokens"].as_array().unwrap().len() as u64;
    assert!(used <= 32, "{used} positions of a 32-token model");
    assert!(
        g["stopped_at_context"] == true || g["stopped_at_eos"] == true,
        "{g}"
    );
    let err = failure(&[
        "eval", "ppl", "--model", dir, "--text", TEXT, "--chunks", "1", "--ctx", "64",
    ]);
    assert!(err.contains("max_position_embeddings"), "{err}");
    let err = failure(&["serve", "--model", dir, "--ctx", "64", "--port", "0"]);
    assert!(err.contains("--ctx 64"), "{err}");
}

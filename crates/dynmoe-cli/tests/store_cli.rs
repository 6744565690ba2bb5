//! `dynmoe convert` and `dynmoe store ensure` as a user runs them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn dynmoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dynmoe"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("the binary runs")
}

fn json_of(args: &[&str]) -> Value {
    let out = dynmoe(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e})"))
}

/// A temporary directory, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn convert_then_ensure_builds_then_keeps() {
    let out =
        Scratch(std::env::temp_dir().join(format!("dynmoe-cli-store-{}", std::process::id())));
    let dir = out.0.to_str().unwrap();
    let model = root().join("fixtures/models/tiny-moe");
    let report = json_of(&[
        "convert",
        "--model",
        model.to_str().unwrap(),
        "-o",
        dir,
        "--json",
    ]);
    assert_eq!(report["records"], 16);
    assert_eq!(report["record_size"], 16384);

    let first = json_of(&["store", "ensure", "--model", dir, "--bits", "2,3", "--json"]);
    let built: Vec<(u64, bool)> = first["stores"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["bits"].as_u64().unwrap(), s["built"].as_bool().unwrap()))
        .collect();
    assert_eq!(built, [(2, true), (3, true)]);
    assert_eq!(first["stores"][0]["bytes"], 16 * 16384);

    let again = json_of(&[
        "store", "ensure", "--model", dir, "--bits", "3,2,3", "--json",
    ]);
    let stores = again["stores"].as_array().unwrap();
    assert_eq!(stores.len(), 2);
    assert!(stores.iter().all(|s| s["built"] == false));

    let text = dynmoe(&["store", "ensure", "--model", dir, "--bits", "2"]);
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(
        stdout.contains("2-bit kept") && stdout.contains("experts2.bin"),
        "{stdout}"
    );
}

#[test]
fn ensure_without_a_converted_model_names_the_missing_file() {
    let out = dynmoe(&[
        "store",
        "ensure",
        "--model",
        "fixtures/models/tiny-moe",
        "--bits",
        "2",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("experts.json") && err.contains("dynmoe convert"),
        "{err}"
    );
    let out = dynmoe(&[
        "store",
        "ensure",
        "--model",
        "fixtures/models/tiny-moe",
        "--bits",
        "7",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("7-bit"));
}

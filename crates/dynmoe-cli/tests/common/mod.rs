//! What the binary's test files share: where the repository and its fixtures are, and
//! running `dynmoe` from the repository root.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A fixture model directory.
pub fn fixture(name: &str) -> PathBuf {
    root().join("fixtures/models").join(name)
}

/// `dynmoe ARGS` from the repository root, to the end.
pub fn dynmoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dynmoe"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("the binary runs")
}

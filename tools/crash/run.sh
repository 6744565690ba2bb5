#!/usr/bin/env bash
# Crash safety, long: `convert`, `store ensure`, VQ encoding and `compress` each killed
# with SIGKILL at 20 random points and run again; the files and the perplexity must equal
# an uninterrupted run's (crates/dynmoe-cli/tests/crash.rs). `cargo test` runs a few
# trials of each; this runs the 20-trial versions (about ten minutes on two cores).
# DYNMOE_CRASH_SEED=N repeats the kill times of an earlier run (each run prints its seed).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec cargo test -p dynmoe-cli --test crash --locked -- --ignored --nocapture --test-threads 1 "$@"

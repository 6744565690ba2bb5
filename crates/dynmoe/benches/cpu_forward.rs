//! CPU prefill and decode speed of the small fixture: fast kernels against the plain
//! reference on the bf16 checkpoint, and the fast kernels on a converted copy whose
//! experts are read from the 4-, 3- and 2-bit stores. Prints a table and writes
//! `bench/results/cpu_forward.json`.
//!
//! `cargo bench -p dynmoe --bench cpu_forward [-- MODEL_DIR]`

use std::path::{Path, PathBuf};
use std::time::Instant;

use dynmoe::backend::{Backend, Cpu};
use dynmoe::model::{self, ExpertBits, LoadedModel};
use serde::Serialize;

const PREFILL: usize = 512;
const DECODE: usize = 128;
const REPEATS: usize = 5;

#[derive(Serialize)]
struct Row {
    backend: &'static str,
    experts: String,
    prefill_tokens: usize,
    prefill_tok_s_median: f64,
    prefill_runs_s: Vec<f64>,
    decode_tokens: usize,
    decode_tok_s_median: f64,
    decode_runs_s: Vec<f64>,
}

#[derive(Serialize)]
struct Report {
    model: String,
    threads: usize,
    cpu: String,
    params_active_per_token: u64,
    rows: Vec<Row>,
    prefill_speedup: f64,
    decode_speedup: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `REPEATS` prefills of `PREFILL` tokens and decodes of `DECODE` tokens after a
/// one-token prompt (every step a one-row forward through the KV cache).
fn measure(m: &LoadedModel<Cpu>, experts: &str, tokens: &[u32], repeats: usize) -> Row {
    let mut state = m.model.new_state(PREFILL + DECODE + 1);
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    // One untimed pass to fault in pages and warm the caches.
    m.model
        .forward(&mut state, &tokens[..PREFILL], PREFILL - 1)
        .unwrap();
    for _ in 0..repeats {
        state.clear();
        let t = Instant::now();
        m.model
            .forward(&mut state, &tokens[..PREFILL], PREFILL - 1)
            .unwrap();
        prefill.push(t.elapsed().as_secs_f64());

        state.clear();
        let t = Instant::now();
        for &tok in &tokens[..DECODE] {
            m.model.forward(&mut state, &[tok], 0).unwrap();
        }
        decode.push(t.elapsed().as_secs_f64());
    }
    Row {
        backend: m.model.backend().name(),
        experts: experts.to_string(),
        prefill_tokens: PREFILL,
        prefill_tok_s_median: PREFILL as f64 / median(prefill.clone()),
        prefill_runs_s: prefill,
        decode_tokens: DECODE,
        decode_tok_s_median: DECODE as f64 / median(decode.clone()),
        decode_runs_s: decode,
    }
}

fn main() {
    // As the commands run models: from a thread of the kernels' pool.
    dynmoe::backend::cpu::run_as_pool_thread(run);
}

fn run() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("fixtures/models/small-moe"));
    let text =
        std::fs::read_to_string(root.join("data/corpus/en/test.txt")).expect("corpus test split");

    let mut rows = Vec::new();
    let mut active = 0;
    for backend in [Cpu::fast(), Cpu::reference()] {
        let m = model::load(&dir, backend).unwrap_or_else(|e| panic!("{e}"));
        let tokens = m.tokenizer.encode(&text).unwrap();
        assert!(tokens.len() > PREFILL + DECODE, "test split too short");
        let inv = dynmoe::eval::inspect::inspect_dir(&dir).unwrap();
        active = inv.params_active_per_token;
        // The reference is slow; fewer repeats keep the run short, the median still holds.
        let repeats = if backend.name() == "cpu" { REPEATS } else { 3 };
        rows.push(measure(&m, "bf16", &tokens, repeats));
    }
    let converted = dynmoe::testing::TempDir::new("bench-forward");
    dynmoe::store::base::convert(&dir, converted.dir(), &mut |_, _| {}).unwrap();
    for bits in [4, 3, 2] {
        let want = ExpertBits {
            default: Some(bits),
            ..ExpertBits::default()
        };
        let m = model::load_with(converted.dir(), Cpu::fast(), &want).unwrap();
        let tokens = m.tokenizer.encode(&text).unwrap();
        rows.push(measure(&m, &format!("q{bits}"), &tokens, REPEATS));
    }
    let report = Report {
        model: dir.display().to_string(),
        threads: rayon::current_num_threads(),
        cpu: dynmoe::testing::cpu_name(),
        params_active_per_token: active,
        prefill_speedup: rows[0].prefill_tok_s_median / rows[1].prefill_tok_s_median,
        decode_speedup: rows[0].decode_tok_s_median / rows[1].decode_tok_s_median,
        rows,
    };

    println!(
        "model {} on {} ({} threads)",
        report.model, report.cpu, report.threads
    );
    println!(
        "{:<14} {:>8} {:>16} {:>16}",
        "backend", "experts", "prefill tok/s", "decode tok/s"
    );
    for r in &report.rows {
        println!(
            "{:<14} {:>8} {:>16.1} {:>16.1}",
            r.backend, r.experts, r.prefill_tok_s_median, r.decode_tok_s_median
        );
    }
    println!(
        "{:<14} {:>8} {:>15.2}x {:>15.2}x",
        "fast/ref", "bf16", report.prefill_speedup, report.decode_speedup
    );

    let json = serde_json::to_string_pretty(&report).unwrap();
    let out = dynmoe::testing::write_bench_report("cpu_forward.json", &json).unwrap();
    println!("wrote {}", out.display());
}

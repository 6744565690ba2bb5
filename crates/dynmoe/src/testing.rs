//! Helpers for checking kernels: fresh random inputs, poisoned outputs, normalised error.
//! Public so that integration tests and benchmarks use the same definitions.

use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// A seed drawn once per process, so every run checks kernels on inputs no earlier run
/// used; printed by [`process_seed`] for reproducing a failure.
pub fn process_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        let seed = match std::env::var("DYNMOE_TEST_SEED") {
            Ok(s) => s.parse().expect("DYNMOE_TEST_SEED must be an integer"),
            Err(_) => std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
        };
        eprintln!("kernel checks use DYNMOE_TEST_SEED={seed}");
        seed
    })
}

pub use crate::rng::Rng;

impl Rng {
    /// A generator for this salt, mixed with the process seed: test data no earlier run
    /// drew.
    pub fn new(salt: u64) -> Rng {
        Rng::seeded(process_seed() ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

/// `n` standard-normal values, fresh for this process and salt.
pub fn fresh(n: usize, salt: u64) -> Vec<f32> {
    let mut rng = Rng::new(salt);
    (0..n).map(|_| rng.normal()).collect()
}

/// An output buffer filled with NaN, so an element no kernel wrote fails the comparison.
pub fn poisoned(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

/// ‖got − want‖ / ‖want‖, computed in f64; infinite if either holds a NaN.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        if g.is_nan() || w.is_nan() {
            return f64::INFINITY;
        }
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// The directory of fixture models: `fixtures/models`, or the one named by
/// `DYNMOE_FIXTURES`.
pub fn fixtures_root() -> PathBuf {
    match std::env::var_os("DYNMOE_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models"),
    }
}

/// A fixture model directory by name.
pub fn fixture(name: &str) -> PathBuf {
    fixtures_root().join(name)
}

/// A copy of fixture `name`'s checkpoint, config and tokenizer files in a fresh
/// directory, for tests that write beside a checkpoint (VQ expert stores) without
/// touching the committed fixtures.
pub fn fixture_copy(name: &str) -> TempDir {
    let src = fixture(name);
    let dir = TempDir::new(&format!("fixture-{name}"));
    for entry in std::fs::read_dir(&src).unwrap_or_else(|e| panic!("{}: {e}", src.display())) {
        let path = entry.expect("a readable directory entry").path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let checkpoint = file.starts_with("model") && file.ends_with(".safetensors");
        if checkpoint || file.ends_with(".json") && !file.starts_with("experts") {
            std::fs::copy(&path, dir.path(&file))
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
    dir
}

/// Mean and (population) standard deviation of `v`, in f64.
pub fn mean_std(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// A Qwen3-MoE shape small enough for tests of synthetic directories (a few MB written,
/// with the small-moe fixture's tokenizer and its 8192-entry vocabulary): an expert width
/// of 96, which is neither a multiple of 64 (affine stores pad it) nor of a rotation
/// block (VQ rotations pad it to 128).
pub const TINY_SHAPE: crate::synth::Shape = crate::synth::Shape {
    family: crate::synth::Family::Qwen3Moe,
    name: "tiny-synth",
    hidden: 128,
    moe_intermediate: 96,
    layers: 3,
    heads: 4,
    kv_heads: 2,
    head_dim: 32,
    experts: 8,
    top_k: 2,
    vocab: 8192,
    rope_theta: 1e6,
};

/// Every fixture model directory (those holding a `config.json`), sorted.
pub fn fixture_dirs() -> Vec<PathBuf> {
    let root = fixtures_root();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.expect("a readable directory entry").path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    dirs.sort();
    dirs
}

/// A fresh, empty directory under the system's temporary directory, removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    /// A new directory whose name carries `tag`, the process id and a counter.
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "dynmoe-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        TempDir(dir)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.0
    }

    /// A file in the directory.
    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The logits of every position of `text`, run from an empty state.
pub fn logits_of<B: crate::backend::Backend>(
    m: &crate::model::LoadedModel<B>,
    text: &str,
) -> Vec<f32> {
    let ids = m.tokenizer.encode(text).unwrap();
    let mut state = m.model.new_state(ids.len());
    m.model.forward(&mut state, &ids, 0).unwrap()
}

/// What [`greedy_reference`] decoded.
pub struct GreedyReference<B: crate::backend::Backend> {
    /// The state after the last token.
    pub state: crate::model::State<B>,
    /// The token the prefill chose.
    pub first: u32,
    /// Each decoded token.
    pub tokens: Vec<u32>,
    /// The router probabilities after each token.
    pub probs: Vec<Vec<Vec<f32>>>,
}

/// The token after `token`: [`Model::decode`](crate::model::Model::decode) of one token,
/// as a caller decoding token by token runs it.
pub fn decode_one<B: crate::backend::Backend>(
    model: &crate::model::Model<B>,
    state: &mut crate::model::State<B>,
    token: u32,
) -> Result<u32, crate::model::Error> {
    let mut next = None;
    let opts = crate::model::DecodeOptions::greedy(1);
    model.decode(
        &mut [crate::model::Decoding::new(&mut *state, token, opts)],
        &mut |_, t| {
            next = Some(t);
            true
        },
    )?;
    Ok(next.expect("one token decoded"))
}

/// Greedy decode by its definition, to test other ways of decoding against: the prompt's
/// prefill into a fresh state with room for `n` more positions, then `n` tokens through
/// [`decode_one`], one call a token.
///
/// # Panics
/// If a step fails.
pub fn greedy_reference<B: crate::backend::Backend>(
    model: &crate::model::Model<B>,
    prompt: &[u32],
    n: usize,
) -> GreedyReference<B> {
    let p = prompt.len();
    let mut state = model.new_state(p + n);
    let first = crate::model::argmax(&model.forward(&mut state, prompt, p - 1).unwrap());
    let (mut tokens, mut probs) = (Vec::new(), Vec::new());
    let mut t = first;
    for _ in 0..n {
        t = decode_one(model, &mut state, t).unwrap();
        tokens.push(t);
        probs.push(state.router_probs.clone());
    }
    GreedyReference {
        state,
        first,
        tokens,
        probs,
    }
}

/// Writes `ckpt` to `path` as one safetensors file, each tensor as it is stored except
/// those in `replaced` (name → row-major values), written as f32: the checkpoint that
/// holds the weights a codec's codes stand for.
///
/// # Panics
/// If a tensor cannot be read or the file cannot be written.
pub fn write_checkpoint_replacing(
    ckpt: &crate::checkpoint::Checkpoint,
    replaced: &std::collections::BTreeMap<String, Vec<f32>>,
    path: &Path,
) {
    use safetensors::tensor::TensorView;
    let data: Vec<(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)> = ckpt
        .names()
        .into_iter()
        .map(|name| {
            let raw = ckpt.raw(name).unwrap();
            match replaced.get(name) {
                Some(w) => (
                    name,
                    safetensors::Dtype::F32,
                    raw.shape.to_vec(),
                    w.iter().flat_map(|x| x.to_le_bytes()).collect(),
                ),
                None => (name, raw.dtype, raw.shape.to_vec(), raw.bytes.to_vec()),
            }
        })
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = data
        .iter()
        .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Writes a benchmark's JSON report as `name` into the directory `DYNMOE_BENCH_OUT`
/// names, or the repository's `bench/results/` (a staged bench binary on another machine
/// has no repository), and returns the path.
pub fn write_bench_report(name: &str, json: &str) -> std::io::Result<PathBuf> {
    let dir = std::env::var_os("DYNMOE_BENCH_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/results"));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(name);
    std::fs::write(&path, format!("{}\n", json.trim_end()))?;
    Ok(path)
}

/// The processor's model name, for benchmark reports.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The host's read bandwidth in GB/s: the best of three passes of every thread summing a
/// 1 GiB buffer (far past the caches), for the floor a memory-bound decode on the CPU
/// cannot beat.
pub fn host_read_gb_s() -> f64 {
    use rayon::prelude::*;
    const BYTES: usize = 1 << 30;
    // Written first, so that the pages exist and the passes time reads only.
    let buf = vec![1.0f32; BYTES / 4];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let total: f32 = buf
            .par_chunks(1 << 18)
            .map(|c| {
                let mut acc = [0.0f32; 16];
                for v in c.chunks_exact(16) {
                    for (a, x) in acc.iter_mut().zip(v) {
                        *a += x;
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(total);
        best = best.min(t.elapsed().as_secs_f64());
    }
    BYTES as f64 / best / 1e9
}

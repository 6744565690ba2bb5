//! Crash safety: `convert`, `store ensure`, VQ encoding (on first use of a rung) and
//! `compress` killed with SIGKILL at random points, then run again, leave the same files
//! and the same perplexity as a run that was never interrupted (docs/FORMAT.md, §9,
//! §13.4 and §14).
//!
//! Each default test runs a few trials on the tiny fixture (seconds); the ignored ones
//! run 20 trials each (`tools/crash/run.sh`, or `cargo test -p dynmoe-cli --test crash
//! -- --ignored`). `DYNMOE_CRASH_SEED` repeats a run's kill times; every trial prints
//! its seed and delay.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{fixture, root};
use dynmoe::testing::TempDir;
use serde_json::Value;

fn tiny() -> PathBuf {
    fixture("tiny-moe")
}

fn command(args: &[String]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dynmoe"));
    c.args(args)
        .current_dir(root())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// Runs `args` to the end; returns how long it took.
fn complete(args: &[String]) -> Duration {
    let t = Instant::now();
    let out = command(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    t.elapsed()
}

/// Starts `args` and kills it with SIGKILL after `delay` (if it is still running).
fn killed_after(args: &[String], delay: Duration) {
    let mut child = command(args).spawn().unwrap();
    std::thread::sleep(delay);
    let _ = child.kill();
    let _ = child.wait();
}

/// A small seeded generator for kill times: `DYNMOE_CRASH_SEED` or the clock.
struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        let seed = std::env::var("DYNMOE_CRASH_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        eprintln!("DYNMOE_CRASH_SEED={seed}");
        Rng(seed)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Fields that differ between two runs by design: when a file was written; the
/// identities that mix in the time and process of a conversion; how many probes a
/// compression took from its journal (a resumed run takes more), and so the checksum of
/// the plan that counts them (loading checks it against the plan); and `model.name`, the
/// directory's name (below).
const VOLATILE: [&str; 5] = [
    "created",
    "fingerprint",
    "unix_time",
    "probes_from_journal",
    "plan_checksum",
];

fn stable(v: &mut Value) {
    match v {
        Value::Object(o) => {
            for k in VOLATILE {
                o.remove(k);
            }
            // A store names the directory it sits in: each trial's differs.
            if let Some(Value::Object(m)) = o.get_mut("model") {
                m.remove("name");
            }
            o.values_mut().for_each(stable);
        }
        Value::Array(a) => a.iter_mut().for_each(stable),
        _ => {}
    }
}

/// Every file of `dir` but the lock and `skip`, JSON without its volatile fields. No
/// temporary file may be left.
fn contents(dir: &Path, skip: &[&str]) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            !name.contains(".tmp."),
            "{name} left behind in {}",
            dir.display()
        );
        if name == "experts.lock" || skip.contains(&name.as_str()) || path.is_dir() {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let bytes = match serde_json::from_slice::<Value>(&bytes) {
            Ok(mut v) if name.ends_with(".json") => {
                stable(&mut v);
                serde_json::to_vec(&v).unwrap()
            }
            _ => bytes,
        };
        files.insert(name, bytes);
    }
    files
}

fn assert_same(
    found: &BTreeMap<String, Vec<u8>>,
    expected: &BTreeMap<String, Vec<u8>>,
    what: &str,
) {
    let names = |m: &BTreeMap<String, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(found), names(expected), "{what}: other files");
    for (name, bytes) in expected {
        if found[name] != *bytes && name.ends_with(".json") {
            panic!(
                "{what}: {name} differs:\n{}\nexpected\n{}",
                String::from_utf8_lossy(&found[name]),
                String::from_utf8_lossy(bytes)
            );
        }
        assert!(found[name] == *bytes, "{what}: {name} differs");
    }
}

/// Perplexity of the model in `dir` (extra flags `extra`) on a little text.
fn ppl(dir: &Path, extra: &[&str]) -> f64 {
    let mut args: Vec<String> = [
        "eval",
        "ppl",
        "--model",
        dir.to_str().unwrap(),
        "--text",
        "data/corpus/en/test.txt",
        "--chunks",
        "2",
        "--ctx",
        "64",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = command(&args).stdout(Stdio::piped()).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["ppl"].as_f64().unwrap()
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// A copy of a fixture (its weights, config and tokenizer).
fn copy_of(fixture: &Path) -> TempDir {
    let dir = TempDir::new("crash");
    for entry in std::fs::read_dir(fixture).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap();
        if p.is_file() && !name.starts_with("experts") && !name.starts_with("dense-vq") {
            std::fs::copy(&p, dir.path(name)).unwrap();
        }
    }
    dir
}

/// One kind of interrupted work: `prepare` makes a fresh directory to work in, `args`
/// the command run on it, `skip` files whose bytes are allowed to differ, and `ppl` the
/// flags perplexity is measured with afterwards.
struct Work<'a> {
    what: &'a str,
    prepare: &'a dyn Fn() -> TempDir,
    args: &'a dyn Fn(&Path) -> Vec<String>,
    skip: &'a [&'a str],
    ppl: &'a [&'a str],
}

fn trials(w: &Work, n: usize) {
    let reference = (w.prepare)();
    let took = complete(&(w.args)(reference.dir()));
    let expected = contents(reference.dir(), w.skip);
    let expected_ppl = ppl(reference.dir(), w.ppl);
    let mut rng = Rng::new();
    for t in 0..n {
        let dir = (w.prepare)();
        let args = (w.args)(dir.dir());
        // Kill times spread over the whole run, start-up included.
        let delay = took.mul_f64(rng.unit() * 1.1);
        eprintln!("{}: trial {t}, killed after {delay:?} of {took:?}", w.what);
        killed_after(&args, delay);
        complete(&args);
        assert_same(&contents(dir.dir(), w.skip), &expected, w.what);
        let p = ppl(dir.dir(), w.ppl);
        assert_eq!(
            p.to_bits(),
            expected_ppl.to_bits(),
            "{}: perplexity",
            w.what
        );
    }
}

/// `convert` writes into a directory it creates (`out` inside a scratch one), so it is
/// compared one level down; perplexity runs from the 4-bit store it wrote.
fn convert_work(n: usize) {
    let run = |d: &Path| {
        strings(&[
            "convert",
            "--model",
            tiny().to_str().unwrap(),
            "-o",
            d.join("out").to_str().unwrap(),
        ])
    };
    let reference = TempDir::new("crash-convert");
    let took = complete(&run(reference.dir()));
    let expected = contents(&reference.path("out"), &[]);
    let expected_ppl = ppl(&reference.path("out"), &["--expert-bits", "4"]);
    let mut rng = Rng::new();
    for t in 0..n {
        let dir = TempDir::new("crash-convert");
        let delay = took.mul_f64(rng.unit() * 1.1);
        eprintln!("convert: trial {t}, killed after {delay:?} of {took:?}");
        killed_after(&run(dir.dir()), delay);
        complete(&run(dir.dir()));
        assert_same(&contents(&dir.path("out"), &[]), &expected, "convert");
        let p = ppl(&dir.path("out"), &["--expert-bits", "4"]);
        assert_eq!(p.to_bits(), expected_ppl.to_bits(), "convert: perplexity");
    }
}

fn ensure_work(n: usize) {
    // One conversion; each trial builds the low-bit stores in a copy of it.
    let base = TempDir::new("crash-base");
    complete(&strings(&[
        "convert",
        "--model",
        tiny().to_str().unwrap(),
        "-o",
        base.dir().to_str().unwrap(),
    ]));
    let base_dir = base.dir().to_path_buf();
    trials(
        &Work {
            what: "store ensure",
            prepare: &|| {
                let d = TempDir::new("crash-ensure");
                for name in [
                    "experts.bin",
                    "experts.json",
                    "dense.safetensors",
                    "config.json",
                ] {
                    std::fs::copy(base_dir.join(name), d.path(name)).unwrap();
                }
                for name in [
                    "tokenizer.json",
                    "tokenizer_config.json",
                    "generation_config.json",
                ] {
                    let _ = std::fs::copy(base_dir.join(name), d.path(name));
                }
                d
            },
            args: &|d| {
                strings(&[
                    "store",
                    "ensure",
                    "--model",
                    d.to_str().unwrap(),
                    "--bits",
                    "2,3",
                ])
            },
            skip: &[],
            ppl: &["--expert-bits", "2"],
        },
        n,
    );
}

fn vq_work(n: usize) {
    trials(
        &Work {
            what: "VQ encoding",
            prepare: &|| copy_of(&tiny()),
            // The store is encoded beside the checkpoint by the first load at the rung.
            args: &|d| {
                strings(&[
                    "run",
                    "--model",
                    d.to_str().unwrap(),
                    "--codec",
                    "vq2",
                    "--prompt",
                    "Call me",
                    "-n",
                    "1",
                ])
            },
            skip: &[],
            ppl: &["--codec", "vq2"],
        },
        n,
    );
}

fn compress_work(n: usize) {
    trials(
        &Work {
            what: "compress",
            prepare: &|| TempDir::new("crash-compress"),
            args: &|d| {
                strings(&[
                    "compress",
                    "--model",
                    tiny().to_str().unwrap(),
                    "--bits",
                    "6",
                    "--scope",
                    "experts",
                    "--calib",
                    "data/corpus/en/calib.txt",
                    "--chunks",
                    "1",
                    "-o",
                    d.to_str().unwrap(),
                ])
            },
            // The probe journal keeps a line per probe run: an interrupted run may have
            // written a torn line, cut off on the rerun, and probes again.
            skip: &["probes.jsonl"],
            ppl: &[],
        },
        n,
    );
}

const QUICK: usize = 3;
const LONG: usize = 20;

#[test]
fn convert_killed_at_random_points_reruns_to_the_same_files() {
    convert_work(QUICK);
}

#[test]
fn store_ensure_killed_at_random_points_reruns_to_the_same_files() {
    ensure_work(QUICK);
}

#[test]
fn vq_encoding_killed_at_random_points_reruns_to_the_same_files() {
    vq_work(QUICK);
}

#[test]
fn compress_killed_at_random_points_reruns_to_the_same_files() {
    compress_work(QUICK);
}

#[test]
#[ignore]
fn convert_killed_20_times() {
    convert_work(LONG);
}

#[test]
#[ignore]
fn store_ensure_killed_20_times() {
    ensure_work(LONG);
}

#[test]
#[ignore]
fn vq_encoding_killed_20_times() {
    vq_work(LONG);
}

#[test]
#[ignore]
fn compress_killed_20_times() {
    compress_work(LONG);
}

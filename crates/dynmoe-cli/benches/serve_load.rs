//! A bounded load test of `dynmoe serve`: starts the server as a second process on a
//! loopback port, sends a fixed number of completion requests from several client
//! threads under a time limit, and reports requests served, errors, latency
//! percentiles and tokens per second. The server's resident memory (VmRSS) is read
//! from /proc after a warm-up and after every block of requests, to show whether it
//! stays flat over the run. Prints a table and writes `bench/results/serve_load.json`.
//!
//! `cargo bench -p dynmoe-cli --bench serve_load [-- --model DIR --requests N
//!  --concurrency C --max-tokens T --max-seqs S --time-limit SECONDS]`

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

struct Options {
    model: PathBuf,
    requests: usize,
    concurrency: usize,
    max_tokens: usize,
    max_seqs: usize,
    time_limit: Duration,
}

fn options(root: &Path) -> Options {
    let mut o = Options {
        model: root.join("fixtures/models/tiny-moe"),
        requests: 500,
        concurrency: 8,
        max_tokens: 32,
        max_seqs: 4,
        time_limit: Duration::from_secs(300),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        // `cargo bench` passes --bench to every bench binary.
        if flag == "--bench" {
            continue;
        }
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let number = || -> usize {
            value
                .parse()
                .unwrap_or_else(|_| panic!("{flag}: {value:?} is not a number"))
        };
        match flag.as_str() {
            "--model" => o.model = PathBuf::from(value),
            "--requests" => o.requests = number(),
            "--concurrency" => o.concurrency = number(),
            "--max-tokens" => o.max_tokens = number(),
            "--max-seqs" => o.max_seqs = number(),
            "--time-limit" => o.time_limit = Duration::from_secs(number() as u64),
            _ => panic!("unknown option {flag}"),
        }
    }
    o
}

/// The server process; killed when dropped so a failed run leaves nothing behind.
struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(o: &Options) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dynmoe"))
        .args(["serve", "--model"])
        .arg(&o.model)
        .args(["--host", "127.0.0.1", "--port", "0", "--max-seqs"])
        .arg(o.max_seqs.to_string())
        .args(["--queue", "1024"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("the dynmoe binary starts");
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let base = loop {
        let line = lines
            .next()
            .expect("the server printed its address")
            .expect("readable stderr");
        if let Some(rest) = line.strip_prefix("dynmoe serving ") {
            let url = rest.rsplit(' ').next().unwrap();
            break url.to_string();
        }
    };
    // Keep draining stderr so the server never blocks writing to it.
    std::thread::spawn(move || for _ in lines {});
    Server { child, base }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

#[derive(Clone, Copy)]
struct Outcome {
    status: u16,
    latency: Duration,
    completion_tokens: u64,
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

fn one_request(
    agent: &ureq::Agent,
    base: &str,
    prompt: &str,
    max_tokens: usize,
    seed: usize,
) -> Outcome {
    let body =
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed});
    let t = Instant::now();
    let resp = agent
        .post(format!("{base}/v1/completions"))
        .header("Content-Type", "application/json")
        .send(body.to_string());
    let (status, tokens) = match resp {
        Ok(mut r) => {
            let status = r.status().as_u16();
            let v: Value = r
                .body_mut()
                .read_to_string()
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or(Value::Null);
            (
                status,
                v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
            )
        }
        // A transport failure counts as an error with no status.
        Err(_) => (0, 0),
    };
    Outcome {
        status,
        latency: t.elapsed(),
        completion_tokens: tokens,
    }
}

/// Sends `n` requests from `concurrency` threads, stopping early at `deadline`;
/// `after_each` sees the count of requests finished so far.
fn run_load(
    base: &str,
    prompts: &[String],
    n: usize,
    o: &Options,
    deadline: Instant,
    after_each: &(dyn Fn(usize) + Sync),
) -> Vec<Outcome> {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let out = Mutex::new(Vec::with_capacity(n));
    std::thread::scope(|s| {
        for _ in 0..o.concurrency {
            s.spawn(|| {
                let agent = agent();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n || Instant::now() >= deadline {
                        break;
                    }
                    let r = one_request(&agent, base, &prompts[i % prompts.len()], o.max_tokens, i);
                    out.lock().unwrap().push(r);
                    after_each(done.fetch_add(1, Ordering::Relaxed) + 1);
                }
            });
        }
    });
    out.into_inner().unwrap()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[derive(Serialize)]
struct RssSample {
    requests_done: usize,
    rss_kib: u64,
}

#[derive(Serialize)]
struct Report {
    model: String,
    cpu: String,
    server_max_sequences: usize,
    client_concurrency: usize,
    max_tokens: usize,
    requests_planned: usize,
    time_limit_s: f64,
    warmup_requests: usize,
    requests_sent: usize,
    served: usize,
    errors: usize,
    errors_by_status: Vec<(u16, usize)>,
    elapsed_s: f64,
    completion_tokens: u64,
    tokens_per_second: f64,
    requests_per_second: f64,
    latency_ms_p50: f64,
    latency_ms_p90: f64,
    latency_ms_p99: f64,
    latency_ms_max: f64,
    server_busy_tokens_per_second: f64,
    rss_kib_after_warmup: u64,
    rss_kib_end: u64,
    rss_growth_kib: i64,
    rss_samples: Vec<RssSample>,
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root");
    let o = options(&root);
    let prompts: Vec<String> = ["en", "code", "zh", "math", "json"]
        .iter()
        .flat_map(|d| {
            let text = std::fs::read_to_string(root.join(format!("data/corpus/{d}/test.txt")))
                .expect("the test corpus");
            text.lines()
                .filter(|l| l.trim().len() > 20)
                .take(40)
                .map(|l| l.chars().take(200).collect::<String>())
                .collect::<Vec<_>>()
        })
        .collect();
    let server = start_server(&o);
    let pid = server.child.id();
    let deadline = Instant::now() + o.time_limit;

    // Warm-up: allocator pools, tokenizer caches and thread stacks reach their
    // working size before the baseline is read.
    let warmup = 50.min(o.requests);
    let w = run_load(&server.base, &prompts, warmup, &o, deadline, &|_| {});
    assert!(w.iter().all(|r| r.status == 200), "warm-up requests failed");
    let rss_after_warmup = rss_kib(pid);

    let samples = Mutex::new(vec![RssSample {
        requests_done: 0,
        rss_kib: rss_after_warmup,
    }]);
    let block = (o.requests / 10).max(1);
    let t = Instant::now();
    let outcomes = run_load(&server.base, &prompts, o.requests, &o, deadline, &|done| {
        if done % block == 0 {
            samples.lock().unwrap().push(RssSample {
                requests_done: done,
                rss_kib: rss_kib(pid),
            });
        }
    });
    let elapsed = t.elapsed().as_secs_f64();
    let rss_end = rss_kib(pid);

    let metrics = agent()
        .get(format!("{}/metrics", server.base))
        .call()
        .ok()
        .and_then(|mut r| r.body_mut().read_to_string().ok())
        .unwrap_or_default();
    let busy_tps =
        dynmoe::serve::metrics::value_of(&metrics, "dynmoe_tokens_per_second").unwrap_or(f64::NAN);
    drop(server);

    let served: Vec<&Outcome> = outcomes.iter().filter(|r| r.status == 200).collect();
    let mut by_status: Vec<(u16, usize)> = Vec::new();
    for r in outcomes.iter().filter(|r| r.status != 200) {
        match by_status.iter_mut().find(|(s, _)| *s == r.status) {
            Some((_, n)) => *n += 1,
            None => by_status.push((r.status, 1)),
        }
    }
    let mut lat: Vec<f64> = served
        .iter()
        .map(|r| r.latency.as_secs_f64() * 1e3)
        .collect();
    lat.sort_by(f64::total_cmp);
    let tokens: u64 = served.iter().map(|r| r.completion_tokens).sum();
    let report = Report {
        model: o.model.display().to_string(),
        cpu: dynmoe::testing::cpu_name(),
        server_max_sequences: o.max_seqs,
        client_concurrency: o.concurrency,
        max_tokens: o.max_tokens,
        requests_planned: o.requests,
        time_limit_s: o.time_limit.as_secs_f64(),
        warmup_requests: warmup,
        requests_sent: outcomes.len(),
        served: served.len(),
        errors: outcomes.len() - served.len(),
        errors_by_status: by_status,
        elapsed_s: elapsed,
        completion_tokens: tokens,
        tokens_per_second: tokens as f64 / elapsed,
        requests_per_second: served.len() as f64 / elapsed,
        latency_ms_p50: percentile(&lat, 50.0),
        latency_ms_p90: percentile(&lat, 90.0),
        latency_ms_p99: percentile(&lat, 99.0),
        latency_ms_max: lat.last().copied().unwrap_or(f64::NAN),
        server_busy_tokens_per_second: busy_tps,
        rss_kib_after_warmup: rss_after_warmup,
        rss_kib_end: rss_end,
        rss_growth_kib: rss_end as i64 - rss_after_warmup as i64,
        rss_samples: samples.into_inner().unwrap(),
    };

    println!(
        "dynmoe serve {} on {}: {} sequences, {} client threads, max_tokens {}",
        report.model, report.cpu, o.max_seqs, o.concurrency, o.max_tokens
    );
    println!(
        "{:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>8} {:>7}",
        "sent", "served", "errors", "p50 ms", "p90 ms", "p99 ms", "tok/s", "req/s", "secs"
    );
    println!(
        "{:>6} {:>6} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>7.1}",
        report.requests_sent,
        report.served,
        report.errors,
        report.latency_ms_p50,
        report.latency_ms_p90,
        report.latency_ms_p99,
        report.tokens_per_second,
        report.requests_per_second,
        report.elapsed_s
    );
    println!(
        "server RSS: {} KiB after {} warm-up requests, {} KiB after {} more ({:+} KiB)",
        report.rss_kib_after_warmup,
        warmup,
        report.rss_kib_end,
        report.requests_sent,
        report.rss_growth_kib
    );
    let series: Vec<String> = report
        .rss_samples
        .iter()
        .map(|s| format!("{}:{}", s.requests_done, s.rss_kib))
        .collect();
    println!("RSS KiB by requests done: {}", series.join(" "));

    let out = root.join("bench/results/serve_load.json");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::write(&out, serde_json::to_string_pretty(&report).unwrap() + "\n").unwrap();
    println!("wrote {}", out.display());
}

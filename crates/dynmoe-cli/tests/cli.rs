//! The `dynmoe` binary as a user runs it: JSON output fields, exit codes, errors that
//! name what is wrong, and `convert` / `store ensure` on a fixture.

use std::process::{Command, Output};

mod common;

use common::{dynmoe, root};
use dynmoe::testing::TempDir;
use serde_json::Value;

fn tiny() -> String {
    root()
        .join("fixtures/models/tiny-moe")
        .display()
        .to_string()
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

fn failure_of(args: &[&str]) -> String {
    let out = dynmoe(args);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{args:?}: a panic would exit 101"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn eval_ppl_reports_the_llama_cpp_fields() {
    let text = root()
        .join("data/corpus/code/test.txt")
        .display()
        .to_string();
    let r = json_of(&[
        "eval",
        "ppl",
        "--model",
        &tiny(),
        "--text",
        &text,
        "--chunks",
        "2",
        "--json",
    ]);
    assert_eq!(r["chunks"], 2);
    assert_eq!(r["tokens_scored"], 510);
    assert_eq!(r["ctx"], 512);
    let ppl = r["ppl"].as_f64().unwrap();
    assert!(ppl.is_finite() && ppl > 1.0 && ppl < 8192.0, "{ppl}");
    assert!(r["ppl_stderr"].as_f64().unwrap() > 0.0);
}

#[test]
fn inspect_counts_parameters_by_kind() {
    let r = json_of(&["inspect", &tiny(), "--json"]);
    assert_eq!(r["arch"], "qwen3_moe");
    assert_eq!(r["experts_per_layer"], 8);
    let total = r["params_total"].as_u64().unwrap();
    let by_kind: u64 = r["params_by_kind"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(by_kind, total);
    // 2 layers x 8 experts x 3 projections of 64x64.
    assert_eq!(r["params_by_kind"]["routed_experts"], 2 * 8 * 3 * 64 * 64);
    assert_eq!(r["bytes_by_dtype"]["BF16"], 2 * total);
}

/// `inspect --dense-codec q4 --head-codec q4` prices the attention projections and the
/// LM head at 4.5 bits a weight (codes and a bf16 scale and bias per 64), the rest as
/// before.
#[test]
fn inspect_prices_affine_dense_layers_and_head() {
    let bf16 = json_of(&["inspect", &tiny(), "--json"]);
    let q4 = json_of(&[
        "inspect",
        &tiny(),
        "--dense-codec",
        "q4",
        "--head-codec",
        "q4",
        "--json",
    ]);
    for kind in ["attention", "lm_head"] {
        let params = bf16["params_by_kind"][kind].as_u64().unwrap();
        assert_eq!(
            q4["bits"]["resident_by_kind"][kind].as_u64().unwrap() * 16,
            params * 9,
            "{kind}"
        );
    }
    for kind in ["embedding", "router", "routed_experts", "norm"] {
        assert_eq!(
            q4["bits"]["resident_by_kind"][kind], bf16["bits"]["resident_by_kind"][kind],
            "{kind}"
        );
    }
    assert_eq!(q4["bits"]["codebook_bytes"], 0);
}

#[test]
fn run_generates_deterministically_with_a_seed() {
    let args = [
        "run",
        "--model",
        &tiny(),
        "--prompt",
        "fn main() {",
        "-n",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "7",
        "--json",
    ];
    let (a, b) = (json_of(&args), json_of(&args));
    assert_eq!(a["tokens"], b["tokens"]);
    let n = a["tokens"].as_array().unwrap().len();
    assert!(
        n == 12 || a["stopped_at_eos"] == true,
        "{n} tokens without EOS"
    );
}

#[test]
fn demo_runs_on_a_given_model() {
    let r = json_of(&[
        "demo",
        "--model",
        &tiny(),
        "--chunks",
        "1",
        "-n",
        "4",
        "--json",
    ]);
    let domains = r["domains"].as_array().unwrap();
    assert_eq!(domains.len(), 5);
    for d in domains {
        assert!(d["perplexity"]["ppl"].as_f64().unwrap().is_finite());
    }
    let stores = r["stores"].as_array().unwrap();
    let bits: Vec<u64> = stores.iter().map(|s| s["bits"].as_u64().unwrap()).collect();
    assert_eq!(bits, vec![4, 3, 2]);
    for s in stores {
        let ppl = s["ppl"].as_array().unwrap();
        assert_eq!(ppl.len(), 5);
        assert!(ppl.iter().all(|p| p.as_f64().unwrap().is_finite()));
    }
}

#[test]
fn a_missing_model_directory_is_named() {
    let err = failure_of(&["run", "--model", "no/such/model", "--prompt", "x"]);
    assert!(err.contains("no/such/model"), "{err}");
}

#[test]
fn a_missing_text_file_is_named() {
    let err = failure_of(&[
        "eval",
        "ppl",
        "--model",
        &tiny(),
        "--text",
        "no-such-file.txt",
    ]);
    assert!(err.contains("no-such-file.txt"), "{err}");
}

#[test]
fn out_of_range_sampling_parameters_are_refused() {
    let err = failure_of(&["run", "--model", &tiny(), "--prompt", "x", "--top-p", "0"]);
    assert!(err.contains("--top-p"), "{err}");
    let err = failure_of(&[
        "run",
        "--model",
        &tiny(),
        "--prompt",
        "x",
        "--temperature=-1",
    ]);
    assert!(err.contains("--temperature"), "{err}");
}

#[test]
fn convert_then_ensure_builds_then_keeps() {
    let out = TempDir::new("cli-store");
    let dir = out.dir().to_str().unwrap();
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
    let tiny = "fixtures/models/tiny-moe";
    let err = failure_of(&["store", "ensure", "--model", tiny, "--bits", "2"]);
    assert!(
        err.contains("experts.json") && err.contains("dynmoe convert"),
        "{err}"
    );
    let err = failure_of(&["store", "ensure", "--model", tiny, "--bits", "7"]);
    assert!(err.contains("7-bit"), "{err}");
}

/// Runs `dynmoe chat` with `input` piped to stdin.
fn chat_with(input: &str, extra: &[&str]) -> Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_dynmoe"))
        .args(["chat", "--model", &tiny(), "-n", "12"])
        .args(extra)
        .current_dir(root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    // A refusal can exit before reading stdin; the exit status tells.
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    child.wait_with_output().unwrap()
}

#[test]
fn chat_reads_piped_lines_keeps_history_and_reports_speed() {
    use dynmoe::backend::sample::Sampling;
    use dynmoe::backend::Cpu;
    use dynmoe::runtime::chat::{stop_tokens, ChatTemplate, Message};
    use dynmoe::runtime::generate::generate_ids;

    let out = chat_with("Hello there\n\nWrite a loop\n", &["--system", "Be brief."]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The same conversation through the library, greedy: the second reply is generated
    // with the first exchange in the prompt.
    let m = dynmoe::model::load(&root().join("fixtures/models/tiny-moe"), Cpu::fast()).unwrap();
    let template = ChatTemplate::for_tokenizer(&m.tokenizer).unwrap();
    let stop = stop_tokens(&m.tokenizer, &m.model.config.eos_token_ids);
    let mut history = vec![Message::new("system", "Be brief.")];
    let mut expected = String::new();
    for user in ["Hello there", "Write a loop"] {
        history.push(Message::new("user", user));
        let ids = m
            .tokenizer
            .encode(&template.render(&history).unwrap())
            .unwrap();
        let g = generate_ids(&m, &ids, 12, Sampling::default(), &stop, &mut |_| {}).unwrap();
        expected.push_str(&g.text);
        expected.push('\n');
        history.push(Message::new("assistant", &g.text));
    }
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let status_lines: Vec<&str> = stderr.lines().filter(|l| l.contains("tok/s")).collect();
    assert_eq!(status_lines.len(), 2, "{stderr}");
    assert!(status_lines[0].starts_with('['), "{stderr}");
}

#[test]
fn chat_refuses_bad_sampling_before_loading() {
    let out = chat_with("hi\n", &["--top-p", "0"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--top-p"));
}

#[test]
fn serve_answers_on_the_printed_address_and_stops_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_dynmoe"))
        .args(["serve", "--model", &tiny(), "--port", "0", "--name", "tiny"])
        .current_dir(root())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let url = loop {
        let line = lines.next().expect("an address line").unwrap();
        if let Some(rest) = line.strip_prefix("dynmoe serving tiny on ") {
            break rest.to_string();
        }
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let models = agent
        .get(format!("{url}/v1/models"))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    let v: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(v["data"][0]["id"], "tiny");
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "SIGTERM should shut down cleanly: {status}"
    );
}

#[test]
fn sigterm_ends_serve_within_its_deadline_with_a_half_sent_header_open() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let mut child = Command::new(env!("CARGO_BIN_EXE_dynmoe"))
        .args(["serve", "--model", &tiny(), "--port", "0", "--name", "tiny"])
        .args(["--header-timeout", "60", "--shutdown-timeout", "0.5"])
        .current_dir(root())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("an address line").unwrap();
        if let Some(rest) = line.strip_prefix("dynmoe serving tiny on http://") {
            break rest.to_string();
        }
    };
    let mut half = std::net::TcpStream::connect(&addr).unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            panic!("serve was still running 5 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn serve_refuses_bad_limits_before_loading() {
    for (args, flag) in [
        (["--header-timeout", "0"], "--header-timeout"),
        (["--body-timeout", "inf"], "--body-timeout"),
        (["--max-connections", "0"], "--max-connections"),
        (["--api-key", " "], "--api-key"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_dynmoe"))
            .args(["serve", "--model", &tiny(), "--port", "0"])
            .args(args)
            .current_dir(root())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn eval_hitrate_prints_the_grid_as_json() {
    let text = |d: &str| {
        root()
            .join(format!("data/corpus/{d}/test.txt"))
            .display()
            .to_string()
    };
    let domains = format!("{},{}", text("en"), text("code"));
    let out = TempDir::new("cli-hitrate");
    let path = out.path("hitrate.json").display().to_string();
    let r = json_of(&[
        "eval",
        "hitrate",
        "--model",
        &tiny(),
        "--domains",
        &domains,
        "--resident-fraction",
        "0.5",
        "--ctx",
        "64",
        "--chunks",
        "4",
        "--calib-chunks",
        "2",
        "--swap-interval",
        "32",
        "--half-lives",
        "20,200",
        "--out",
        &path,
        "--json",
    ]);
    assert_eq!(r["resident_per_layer"], 4);
    assert_eq!(r["spare_slots_per_layer"], 4);
    let cells = r["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 4);
    assert_eq!(
        (cells[1]["calib"].as_str(), cells[1]["test"].as_str()),
        (Some("en"), Some("code"))
    );
    for c in cells {
        for run in ["static", "dynamic"] {
            let h = c[run]["hit_rate"].as_f64().unwrap();
            assert!(
                h > 0.0 && h <= c[run]["oracle_hit_rate"].as_f64().unwrap() + 1e-9,
                "{c}"
            );
            assert!(c[run]["ppl"].as_f64().unwrap() > 1.0);
        }
        assert_eq!(c["static"]["swaps"], 0);
    }
    let written: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(written["cells"], r["cells"]);
}

#[test]
fn residency_flags_run_and_report() {
    let r = json_of(&[
        "run",
        "--model",
        &tiny(),
        "--prompt",
        "Once upon a time",
        "-n",
        "40",
        "--json",
        "--resident-count",
        "4",
        "--reservoir",
        "disk",
        "--swap-interval",
        "8",
    ]);
    assert_eq!(r["tokens"].as_array().unwrap().len(), 40);
    assert_eq!(r["residency"]["resident_per_layer"], 4);
    assert_eq!(r["residency"]["reservoir"], "disk");
    assert_eq!(r["residency"]["stalls"], 0);
    // Without the flags, no residency report and the plain path.
    let r = json_of(&[
        "run",
        "--model",
        &tiny(),
        "--prompt",
        "Once upon a time",
        "-n",
        "4",
        "--json",
    ]);
    assert!(r.get("residency").is_none());
    let e = failure_of(&[
        "run",
        "--model",
        &tiny(),
        "--prompt",
        "x",
        "--resident-count",
        "1",
    ]);
    assert!(e.contains("between 2 and 8 must be resident"), "{e}");
    let e = failure_of(&[
        "run",
        "--model",
        &tiny(),
        "--prompt",
        "x",
        "--resident-fraction",
        "0.5",
        "--residency",
        "static",
    ]);
    assert!(e.contains("--calib"), "{e}");
}

#[test]
fn compress_fits_the_budget_resumes_from_its_journal_and_the_plan_runs() {
    let out = dynmoe::testing::TempDir::new("compress");
    let dir = out.dir().display().to_string();
    let calib = "data/corpus/en/calib.txt,data/corpus/code/calib.txt";
    let args = [
        "compress",
        "--model",
        &tiny(),
        "--bits",
        "6",
        "--scope",
        "experts",
        "--calib",
        calib,
        "--chunks",
        "1",
        "-o",
        &dir,
        "--json",
    ];
    let plan = json_of(&args);
    let (resident, budget) = (
        plan["resident_bytes"].as_u64().unwrap(),
        plan["budget_bytes"].as_u64().unwrap(),
    );
    assert!(resident <= budget, "{resident} > {budget}");
    let probes = std::fs::read_to_string(out.path("probes.jsonl")).unwrap();
    let lines = probes.lines().count();
    assert!(lines > 4, "{lines} probes journalled");

    // An interruption: the plan never written, the last probe torn mid-line.
    std::fs::remove_file(out.path("plan.json")).unwrap();
    let torn = &probes[..probes.len() - probes.lines().last().unwrap().len() / 2 - 1];
    std::fs::write(out.path("probes.jsonl"), torn).unwrap();
    let again = json_of(&args);
    assert_eq!(
        again["layers"], plan["layers"],
        "a resumed run reaches the same plan"
    );
    let reused = again["rounds"]["probes_from_journal"].as_u64().unwrap();
    assert!(
        reused as usize >= lines - 1,
        "{reused} of {lines} probes reused"
    );

    let ppl = json_of(&[
        "eval",
        "ppl",
        "--model",
        &tiny(),
        "--plan",
        &out.path("plan.json").display().to_string(),
        "--text",
        "data/corpus/en/test.txt",
        "--chunks",
        "2",
        "--json",
    ]);
    assert!(ppl["ppl"].as_f64().unwrap().is_finite());

    // The output directory is itself the compressed model: it runs without the
    // checkpoint, with the plan's resident sets following the text by default, exactly
    // as the checkpoint run with the plan.
    let compressed = json_of(&[
        "eval",
        "ppl",
        "--model",
        &dir,
        "--text",
        "data/corpus/en/test.txt",
        "--chunks",
        "2",
        "--json",
    ]);
    assert_eq!(compressed["ppl"], ppl["ppl"]);
    assert_eq!(compressed["residency"]["mode"], "dynamic");
    assert_eq!(
        compressed["residency"]["resident_by_layer"],
        ppl["residency"]["resident_by_layer"]
    );
    // A plan edited after compression no longer matches the directory.
    let plan_path = out.path("plan.json");
    let text = std::fs::read_to_string(&plan_path).unwrap();
    let edited = text.replacen("\"version\": 2", "\"version\":  2", 1);
    assert_ne!(edited, text, "the edit changes the plan's bytes");
    std::fs::write(&plan_path, edited).unwrap();
    let e = failure_of(&[
        "eval",
        "ppl",
        "--model",
        &dir,
        "--text",
        "data/corpus/en/test.txt",
        "--chunks",
        "1",
    ]);
    assert!(
        e.contains("compressed.json") && e.contains("plan_checksum"),
        "{e}"
    );
    std::fs::write(&plan_path, text).unwrap();

    // A budget no plan can meet is refused, not written.
    let e = failure_of(&[
        "compress",
        "--model",
        &tiny(),
        "--bits",
        "0.01",
        "--calib",
        calib,
        "--chunks",
        "1",
        "-o",
        &out.path("none").display().to_string(),
    ]);
    assert!(e.contains("budget"), "{e}");
    assert!(!out.path("none/plan.json").exists());
}

/// `--codec vq2` writes the VQ store beside the checkpoint on the first run and reads it
/// on the second, which scores the same; residency runs over it from disk.
#[test]
fn vq_codec_builds_its_store_once_and_runs_resident_sets_over_it() {
    let copy = dynmoe::testing::fixture_copy("tiny-moe");
    let dir = copy.dir().display().to_string();
    let args = [
        "eval",
        "ppl",
        "--model",
        &dir,
        "--codec",
        "vq2",
        "--codec-layer",
        "1=vq1.5",
        "--text",
        "data/corpus/en/test.txt",
        "--chunks",
        "1",
        "--json",
    ];
    let first = json_of(&args);
    let manifests = ["experts-vq2.json", "experts-vq1.5.json"].map(|f| copy.path(f));
    let stamps = manifests
        .clone()
        .map(|m| std::fs::metadata(m).unwrap().modified().unwrap());
    let second = json_of(&args);
    assert_eq!(first["ppl"], second["ppl"]);
    for (m, t) in manifests.iter().zip(stamps) {
        assert_eq!(
            std::fs::metadata(m).unwrap().modified().unwrap(),
            t,
            "{m:?} rewritten"
        );
    }
    let resident = json_of(&[
        "run",
        "--model",
        &dir,
        "--codec",
        "vq2",
        "--prompt",
        "The whale",
        "-n",
        "40",
        "--resident-fraction",
        "0.5",
        "--reservoir",
        "disk",
        "--swap-interval",
        "8",
        "--json",
    ]);
    assert_eq!(resident["residency"]["resident_per_layer"], 4, "{resident}");
    assert_eq!(resident["residency"]["loads_failed"], 0, "{resident}");
}

/// `synth --vq` takes one rung of the ladder, not `--bits` beside it: both mistakes are
/// usage errors that say what is wrong, before anything is written.
#[test]
fn synth_vq_refuses_bits_beside_it_and_rungs_off_the_ladder() {
    let out = TempDir::new("cli-synth-vq");
    let dir = out.path("q30").display().to_string();
    let base = [
        "synth",
        "--like",
        "qwen3-30b-a3b",
        "--layers",
        "1",
        "-o",
        &dir,
    ];
    let cases: [(&[&str], &[&str]); 2] = [
        (
            &["--vq", "vq1.5", "--bits", "2"],
            &["--vq", "--bits", "cannot be used with"],
        ),
        (&["--vq", "vq1.4"], &["vq1.4", "rung", "1.5", "0.7"]),
    ];
    for (extra, want) in cases {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let o = dynmoe(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: a usage error");
        let err = String::from_utf8_lossy(&o.stderr);
        for w in want {
            assert!(err.contains(w), "{args:?}: {w:?} not in {err}");
        }
        assert!(!out.path("q30").exists(), "{args:?} wrote {dir}");
    }
}

/// A compressed directory of the tiny synthetic shape's first two layers, every MoE
/// layer's experts at vq1.5 (random records), and that rung.
fn tiny_vq_model(name: &str) -> (TempDir, dynmoe::codec::vq::Rung) {
    let out = TempDir::new(name);
    let rung = dynmoe::codec::vq::Rung::parse("vq1.5").unwrap();
    let tok = root().join("fixtures/models/small-moe");
    let shape = dynmoe::testing::TINY_SHAPE;
    dynmoe::synth::synth_compressed(&shape, Some(2), rung, &tok, out.dir(), 0, &mut |_, _| {})
        .unwrap();
    (out, rung)
}

/// `bench decode` on a compressed directory measures its plan once, labelled by it, with
/// the VQ records' codes and norms counted in the bytes a token reads; `--bits` is
/// refused there.
#[test]
fn bench_decode_runs_a_compressed_directory_at_its_plan() {
    use dynmoe::store::{synth_vq, vq::VqLayout};
    use dynmoe::testing::TINY_SHAPE as S;
    let (out, rung) = tiny_vq_model("cli-bench-vq");
    let dir = out.dir().display().to_string();
    let err = failure_of(&["bench", "decode", &dir, "--bits", "4"]);
    assert!(
        err.contains("compressed") && err.contains("--bits") && err.contains("vq1.5"),
        "{err}"
    );

    let json = out.path("bench.json").display().to_string();
    let o = dynmoe(&[
        "bench",
        "decode",
        &dir,
        "--prompt",
        "4",
        "--generate",
        "2",
        "--repeats",
        "1",
        "--json",
        &json,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.lines().any(|l| l.trim_start().starts_with("vq1.5")),
        "{table}"
    );
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let cases = r["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 1);
    let c = &cases[0];
    assert_eq!(c["plan"], "vq1.5");
    let expert =
        synth_vq::expert_bytes(&VqLayout::new(rung, S.hidden, S.moe_intermediate).unwrap());
    let per_weight = expert as f64 * 8.0 / (3 * S.hidden * S.moe_intermediate) as f64;
    assert!((c["expert_bits_per_weight"].as_f64().unwrap() - per_weight).abs() < 1e-9);
    assert_eq!(c["bits"], per_weight.round() as u64);
    // Dense matrices at 4 bytes (f32 on the CPU): two layers' attention projections and
    // routers, and the LM head; then top-2 experts of both MoE layers.
    let (q, kv) = (S.heads * S.head_dim, S.kv_heads * S.head_dim);
    let dense =
        2 * (2 * q * S.hidden + 2 * kv * S.hidden + S.experts * S.hidden) + S.vocab * S.hidden;
    assert_eq!(
        c["decode_bytes_per_token"].as_u64().unwrap() as usize,
        4 * dense + 2 * S.top_k * expert
    );
    assert!(c["llama_cpp_decode_tok_s"].is_null());
    assert!(c["decode_tok_s"].as_f64().unwrap() > 0.0);
    assert!(c["decode_sync_tok_s"].as_f64().unwrap() > 0.0);
    assert_eq!(c["decode_sync_runs_tok_s"].as_array().unwrap().len(), 1);
    assert_eq!(c["decode_paths_agree"], true);
}

/// `bench decode --dense-codec q4 --head-codec q4` on a converted directory runs every
/// setting with them: its JSON names the codecs and counts the attention projections and
/// the LM head at their codes, scales and biases (the routers stay at 4 bytes a weight on
/// the CPU), fewer bytes than without; a compressed directory refuses them.
#[test]
fn bench_decode_takes_dense_and_head_codecs() {
    use dynmoe::codec::Codec;
    use dynmoe::testing::TINY_SHAPE as S;
    let out = TempDir::new("cli-bench-dense-codec");
    let tok = root().join("fixtures/models/small-moe");
    let model = out.path("model");
    dynmoe::synth::synth_converted(&S, Some(2), &[4], &tok, &model, 0, &mut |_, _| {}).unwrap();
    let dir = model.display().to_string();
    let bench = |extra: &[&str], json: &str| -> Value {
        let json = out.path(json).display().to_string();
        let args = [
            &["bench", "decode", &dir, "--bits", "4", "--prompt", "4"][..],
            &["--generate", "2", "--repeats", "1", "--json", &json],
            extra,
        ]
        .concat();
        let o = dynmoe(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let header = String::from_utf8_lossy(&o.stdout);
        let codecs = match extra {
            [] => "dense bf16, LM head bf16",
            _ => "dense q4, LM head q4",
        };
        assert!(header.lines().next().unwrap().contains(codecs), "{header}");
        let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        r["cases"][0].clone()
    };
    let plain = bench(&[], "bf16.json");
    let coded = bench(&["--dense-codec", "q4", "--head-codec", "q4"], "q4.json");
    assert_eq!(
        (&plain["dense_codec"], &plain["head_codec"]),
        (&"bf16".into(), &"bf16".into())
    );
    assert_eq!(
        (&coded["dense_codec"], &coded["head_codec"]),
        (&"q4".into(), &"q4".into())
    );
    let bytes = |c: &Value| c["decode_bytes_per_token"].as_u64().unwrap() as usize;
    let (q, kv) = (S.heads * S.head_dim, S.kv_heads * S.head_dim);
    let q4 = |rows: usize, cols: usize| {
        Codec::Affine { bits: 4 }.matrix_bytes(rows, cols).unwrap() as usize
    };
    let attention = 2 * q * S.hidden + 2 * kv * S.hidden;
    let attention_q4 = q4(q, S.hidden) + q4(S.hidden, q) + 2 * q4(kv, S.hidden);
    assert_eq!(
        bytes(&plain) - bytes(&coded),
        2 * (4 * attention - attention_q4) + 4 * S.vocab * S.hidden - q4(S.vocab, S.hidden)
    );
    assert!(coded["decode_tok_s"].as_f64().unwrap() > 0.0);

    let (compressed, _) = tiny_vq_model("cli-bench-dense-codec-vq");
    let err = failure_of(&[
        "bench",
        "decode",
        &compressed.dir().display().to_string(),
        "--dense-codec",
        "q4",
    ]);
    assert!(
        err.contains("compressed") && err.contains("--dense-codec") && err.contains("dense bf16"),
        "{err}"
    );
}

/// `bench residency` on a compressed directory runs its plan with half of each layer's
/// VQ experts resident, beside all of them: the report names the plan and counts the VQ
/// records' bytes; `--bits` is refused there.
#[test]
fn bench_residency_runs_a_compressed_directory_at_its_plan() {
    use dynmoe::store::{synth_vq, vq::VqLayout};
    use dynmoe::testing::TINY_SHAPE as S;
    let (out, rung) = tiny_vq_model("cli-bench-residency-vq");
    let dir = out.dir().display().to_string();
    let common = [
        "bench",
        "residency",
        &dir,
        "--backend",
        "cpu",
        "--resident-fraction",
        "0.5",
    ];
    let err = failure_of(&[&common[..], &["--bits", "2"]].concat());
    assert!(
        err.contains("compressed") && err.contains("--bits") && err.contains("vq1.5"),
        "{err}"
    );
    let json = out.path("residency.json").display().to_string();
    let args = [
        "--prompt",
        "4",
        "--generate",
        "48",
        "--repeats",
        "1",
        "--swap-interval",
        "4",
        "--swap-margin",
        "0",
        "--json",
        &json,
    ];
    let o = dynmoe(&[&common[..], &args[..]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r["plan"], "vq1.5");
    assert!(r["bits"].is_null());
    let expert =
        synth_vq::expert_bytes(&VqLayout::new(rung, S.hidden, S.moe_intermediate).unwrap());
    assert_eq!(
        r["all_expert_bytes"].as_u64().unwrap() as usize,
        2 * S.experts * expert
    );
    assert_eq!(r["residency"]["resident_per_layer"], S.experts / 2);
    assert_eq!(r["residency"]["loads_failed"], 0);
    assert!(r["full_tok_s"].as_f64().unwrap() > 0.0 && r["resident_tok_s"].as_f64().unwrap() > 0.0);
}

/// `inspect` on a compressed directory reports the bytes it holds, not the checkpoint's
/// precision: its routed experts at vq1.5 bring the whole model under 16 bits, and the
/// parameters are the inventory's.
#[test]
fn inspect_reports_a_compressed_directory_as_stored() {
    let (dir, _) = tiny_vq_model("cli-inspect-compressed");
    let dir = dir.dir().display().to_string();
    let r = json_of(&["inspect", &dir, "--json"]);
    let bits = &r["bits"];
    assert_eq!(bits["total"]["params"], r["params_total"]);
    let experts = &bits["groups"]["routed_experts"];
    assert_eq!(experts["params"], r["params_by_kind"]["routed_experts"]);
    assert!(
        experts["resident_bits"].as_f64().unwrap() < 4.0,
        "{experts}"
    );
    let total = bits["total"]["resident_bits"].as_f64().unwrap();
    assert!(total < 16.0, "{total}");
    assert!(bits["codebook_bytes"].as_u64().unwrap() > 0);
    let text = dynmoe(&["inspect", &dir]);
    let out = String::from_utf8_lossy(&text.stdout);
    assert!(
        out.contains("whole model") && out.contains("codebooks"),
        "{out}"
    );
}

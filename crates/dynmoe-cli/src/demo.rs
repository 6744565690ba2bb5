//! `dynmoe demo`: the whole pipeline as it stands, on the bundled small model.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use dynmoe::backend::sample::Sampling;
use dynmoe::backend::Cpu;
use dynmoe::eval::{inspect, ppl};
use dynmoe::model::ExpertBits;
use dynmoe::runtime::generate;
use dynmoe::store;
use serde::Serialize;

use crate::progress;

/// The five corpus domains, in report order.
pub const DOMAINS: [&str; 5] = ["en", "code", "zh", "math", "json"];

#[derive(Args)]
pub struct DemoArgs {
    /// Model directory (default: the bundled fixtures/models/small-moe).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Corpus directory holding <domain>/test.txt (default: the bundled data/corpus).
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Chunks of 512 tokens scored per domain (0: the whole test split).
    #[arg(long, default_value_t = 8)]
    chunks: usize,
    /// Tokens generated per prompt.
    #[arg(short = 'n', long, default_value_t = 32)]
    max_tokens: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct DomainResult {
    domain: String,
    prompt: String,
    completion: String,
    decode_tokens_per_second: f64,
    perplexity: ppl::PplReport,
}

/// The model run from its expert stores at one precision.
#[derive(Serialize)]
struct StoreResult {
    /// Bits per expert code.
    bits: u32,
    /// Bytes of the store file × 8 per routed expert parameter.
    bits_per_expert_weight: f64,
    /// Perplexity per domain, in DOMAINS order.
    ppl: Vec<f64>,
}

#[derive(Serialize)]
struct DemoReport {
    model: PathBuf,
    params_total: u64,
    params_active_per_token: u64,
    domains: Vec<DomainResult>,
    wikitext2: ppl::PplReport,
    stores: Vec<StoreResult>,
}

/// The repository's root: the working directory if it holds the fixtures, else the
/// checkout this binary was built from.
fn repo_root() -> PathBuf {
    let here = PathBuf::from(".");
    if here.join("fixtures/models").is_dir() {
        return here;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The first line of at least 20 characters in the text, cut to about 60 bytes: a
/// prompt in the domain's own style.
fn prompt_from(text: &str) -> String {
    let line = text
        .lines()
        .find(|l| l.trim().chars().count() >= 20)
        .unwrap_or(text)
        .trim();
    let mut end = line.len().min(60);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    line[..end].to_string()
}

pub fn run(a: DemoArgs) -> Result<()> {
    let root = repo_root();
    let dir = a
        .model
        .unwrap_or_else(|| root.join("fixtures/models/small-moe"));
    let corpus = a.corpus.unwrap_or_else(|| root.join("data/corpus"));
    let inv =
        inspect::inspect_dir(&dir).with_context(|| format!("inspecting {}", dir.display()))?;
    let m = crate::load(&dir, Cpu::fast(), &Default::default())?;
    if !a.json {
        println!(
            "{}: {} layers, {} experts/layer, top-{}; {:.2} M parameters, {:.2} M active per token",
            dir.display(),
            inv.layers,
            inv.experts_per_layer,
            inv.top_k,
            inv.params_total as f64 / 1e6,
            inv.params_active_per_token as f64 / 1e6
        );
    }
    let opts = ppl::PplOptions {
        ctx: 512,
        max_chunks: (a.chunks > 0).then_some(a.chunks),
        micro_batch: None,
    };
    let mut domains = Vec::new();
    for d in DOMAINS {
        let path = corpus.join(d).join("test.txt");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let prompt = prompt_from(&text);
        let g = generate::generate(&m, &prompt, a.max_tokens, Sampling::default(), &mut |_| {})?;
        let bar = progress::bar(d);
        let report = ppl::perplexity(&m, &text, opts, &mut |done, total| {
            progress::update(&bar, done, total)
        })
        .with_context(|| format!("perplexity of {}", path.display()))?;
        bar.finish_and_clear();
        if !a.json {
            println!(
                "\n[{d}] {prompt}\u{2590}{}",
                g.text.replace('\n', "\u{21b5}")
            );
            println!(
                "[{d}] PPL = {:.3} +/- {:.3} over {} tokens; decode {:.0} tok/s, eval {:.0} tok/s",
                report.ppl,
                report.ppl_stderr,
                report.tokens_scored,
                g.decode_tokens_per_second,
                report.tokens_per_second
            );
        }
        domains.push(DomainResult {
            domain: d.to_string(),
            prompt,
            completion: g.text,
            decode_tokens_per_second: g.decode_tokens_per_second,
            perplexity: report,
        });
    }
    let wiki = root.join("data/wikitext-2-raw/wiki.test.raw");
    let text =
        std::fs::read_to_string(&wiki).with_context(|| format!("reading {}", wiki.display()))?;
    let wikitext2 = ppl::perplexity(&m, &text, opts, &mut |_, _| {})?;
    if !a.json {
        println!(
            "\n[wikitext-2] PPL = {:.3} +/- {:.3} over {} tokens",
            wikitext2.ppl, wikitext2.ppl_stderr, wikitext2.tokens_scored
        );
    }
    let texts: Vec<String> = DOMAINS
        .iter()
        .map(|d| std::fs::read_to_string(corpus.join(d).join("test.txt")))
        .collect::<Result<_, _>>()?;
    let stores = run_from_stores(&dir, &texts, opts, a.json)?;
    if a.json {
        let report = DemoReport {
            model: dir,
            params_total: inv.params_total,
            params_active_per_token: inv.params_active_per_token,
            domains,
            wikitext2,
            stores,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// Converts the model into a scratch directory (experts to 4-bit records, then the 3-
/// and 2-bit stores derived from them) and measures each domain's perplexity with the
/// experts read from each store.
fn run_from_stores(
    dir: &Path,
    texts: &[String],
    opts: ppl::PplOptions,
    json: bool,
) -> Result<Vec<StoreResult>> {
    let scratch = std::env::temp_dir().join(format!("dynmoe-demo-{}", std::process::id()));
    let result = (|| {
        store::base::convert(dir, &scratch, &mut |_, _| {})?;
        store::lowbit::ensure_many(&scratch, &[3, 2])?;
        let inv = inspect::inspect_dir(&scratch)?;
        if !json {
            println!("\nexperts from the stores of a converted copy (perplexity per domain):");
            println!(
                "{:<8} {:>10} {}",
                "store",
                "disk b/w",
                DOMAINS.map(|d| format!("{d:>9}")).join("")
            );
        }
        let mut results = Vec::new();
        for st in &inv.expert_stores {
            let bits = ExpertBits {
                default: Some(st.bits),
                ..ExpertBits::default()
            };
            let m = crate::load(&scratch, Cpu::fast(), &(&bits).into())?;
            let ppl: Vec<f64> = texts
                .iter()
                .map(|t| ppl::perplexity(&m, t, opts, &mut |_, _| {}).map(|r| r.ppl))
                .collect::<Result<_, _>>()?;
            if !json {
                let cells: String = ppl.iter().map(|p| format!("{p:>9.3}")).collect();
                println!(
                    "{:<8} {:>10.3} {cells}",
                    format!("q{}", st.bits),
                    st.bits_per_weight
                );
            }
            results.push(StoreResult {
                bits: st.bits,
                bits_per_expert_weight: st.bits_per_weight,
                ppl,
            });
        }
        Ok(results)
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

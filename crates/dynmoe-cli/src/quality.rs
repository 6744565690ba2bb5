//! `dynmoe bench quality`: perplexity and KL divergence to the uncompressed model against
//! resident bits per routed-expert weight, for ISP plans and the baselines they must beat
//! (docs/ARCHITECTURE.md, Allocation).
//!
//! Methods, all measured on the same chunks of every text:
//! - ISP with two rounds and with one (the second reuses the first's probe journal, so
//!   its one round is the first round of the other), run with dynamic residency: each
//!   layer starts from the experts the plan keeps and follows the text;
//! - static REAP at the same residency: the two-round plan with its sets fixed;
//! - uniform VQ rungs and uniform affine q2/q3/q4, every expert resident;
//! - a hand heuristic in the style of dynamic quants: down projections a rung with at
//!   least half a bit more than gate and up, every expert resident.
//!
//! Bits count the resident expert bytes (codes, norms or scales, and each codebook once)
//! over the routed experts' parameters.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::compress::ScopeArg;
use crate::read_text;
use dynmoe::alloc::compress::{self, BudgetScope, CompressOptions};
use dynmoe::alloc::{probe::assemble, probe::load_plan};
use dynmoe::backend::Cpu;
use dynmoe::checkpoint::experts::ExpertShape;
use dynmoe::checkpoint::{Checkpoint, Config};
use dynmoe::codec::vq::{Rung, LADDER};
use dynmoe::codec::Codec;
use dynmoe::eval::bits::{account, Assignment};
use dynmoe::eval::kld::{kl_divergence_to, reference_logits, ReferenceLogits};
use dynmoe::eval::plot::{Plot, Series};
use dynmoe::eval::ppl::PplOptions;
use dynmoe::model::{self, ExpertBits, LoadedModel};
use dynmoe::residency::{Mode, ResidencyConfig};
use dynmoe::runtime::residency::follow_plan;
use dynmoe::store::dense_vq::{CodedLayers, GroupCodecs};
use dynmoe::store::journal::Journal;
use dynmoe::store::manifest::Fnv64;
use dynmoe::store::plan::Plan;
use dynmoe::store::{vq_encode::encode_experts_by_projection, vq_encode::VqExperts};

const DOMAINS: [&str; 5] = ["en", "code", "zh", "math", "json"];

#[derive(Args)]
pub struct QualityArgs {
    /// The Hugging Face checkpoint to compress.
    #[arg(long, default_value = "fixtures/models/small-moe")]
    model: PathBuf,
    /// Resident bit budgets for the ISP plans and the heuristic.
    #[arg(long, value_delimiter = ',', default_values_t = [1.25, 1.5, 2.0, 2.5, 3.0])]
    budgets: Vec<f64>,
    /// Uniform codecs to compare with.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "vq1,vq1.25,vq1.5,vq1.75,vq2,vq2.25,vq2.5,vq3,q2,q3,q4"
    )]
    uniform: Vec<Codec>,
    /// Folder holding `<domain>/calib.txt` and `<domain>/test.txt`.
    #[arg(long, default_value = "data/corpus")]
    corpus: PathBuf,
    /// WikiText-2 test split, scored too when the file exists.
    #[arg(long, default_value = "data/wikitext-2-raw/wiki.test.raw")]
    wikitext: PathBuf,
    /// Calibration chunks per domain for each probe.
    #[arg(long, default_value_t = 2)]
    calib_chunks: usize,
    /// Chunks of 512 tokens scored per text.
    #[arg(long, default_value_t = 8)]
    eval_chunks: usize,
    /// Where plans, probe journals and the converted stores are kept; a rerun reuses them.
    #[arg(long, default_value = "target/bench-quality")]
    work: PathBuf,
    /// JSON results.
    #[arg(long, default_value = "bench/results/quality.json")]
    out: PathBuf,
    /// The plot of perplexity against bits.
    #[arg(long, default_value = "bench/results/quality.svg")]
    svg: PathBuf,
    /// Measure nothing: read the rows of an earlier `--out` and write the table, the
    /// JSON and the plot again (with this build's summaries).
    #[arg(long)]
    from_json: Option<PathBuf>,
    /// What the budgets count: the routed experts' bits (`experts`), or every tensor of
    /// the model (`model`), where ISP allocates the embeddings, the LM head and each
    /// layer's dense weights too and the uniform recipes code every tensor.
    #[arg(long, value_enum, default_value = "experts")]
    scope: ScopeArg,
    /// With `--scope model`: also plan every budget with shadows at each of these VQ
    /// rungs (priced; the probes and the runs use them), beside the plans without.
    #[arg(long, value_delimiter = ',')]
    shadow: Vec<Codec>,
}

/// One layer's setting in a row: codecs of gate, up and down, and resident experts.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LayerSetting {
    layer: usize,
    codecs: [Codec; 3],
    resident: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Row {
    method: String,
    family: String,
    budget_bits: Option<f64>,
    /// Resident bits per routed-expert weight.
    expert_bits: f64,
    /// Resident bits per weight of the whole model (every tensor counted, codebooks
    /// aside), for rows of a whole-model comparison.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model_bits: Option<f64>,
    /// Codecs of the tensor groups outside the routed experts, where not bf16.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    groups: BTreeMap<String, Codec>,
    layers: Vec<LayerSetting>,
    ppl: BTreeMap<String, f64>,
    kld: BTreeMap<String, f64>,
    top1_agreement: BTreeMap<String, f64>,
    /// exp of the mean log-perplexity over the domains' test splits (WikiText-2 has
    /// its own column: see [`summarize`]).
    geomean_ppl: f64,
    /// Mean KL divergence over the domains' test splits.
    mean_kld: f64,
    /// Hit rate of the resident sets, averaged over texts (dynamic or static rows).
    hit_rate: Option<f64>,
    seconds: f64,
}

#[derive(Serialize, Deserialize)]
struct Report {
    model: String,
    scope: String,
    calib_chunks_per_text: usize,
    eval_chunks_per_text: usize,
    texts: Vec<String>,
    rows: Vec<Row>,
    /// Rows that could not be made, and why (a budget below the smallest plan).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    left_out: Vec<String>,
}

/// The model under test and everything that makes its rows: the checkpoint, the
/// reference's logits on every text, a cache of encodings shared by every method, and
/// the rows measured so far (kept in `rows.jsonl` so an interrupted run resumes).
struct Bench {
    dir: PathBuf,
    config: Config,
    ckpt: Checkpoint,
    shape: ExpertShape,
    texts: Vec<(String, ReferenceLogits)>,
    encoded: HashMap<(usize, [Codec; 3]), VqExperts>,
    journal: Journal,
    done: HashMap<String, Row>,
}

/// A journal entry: one measured row.
#[derive(Serialize, Deserialize)]
struct Measured {
    row: Row,
}

impl Bench {
    fn layers(&self) -> Vec<usize> {
        self.config.moe_layers().collect()
    }

    /// Resident bits per routed-expert weight of `layers` (the codebooks, constants of
    /// the program, aside).
    fn expert_bits(&self, layers: &[LayerSetting]) -> Result<f64> {
        let (mut bytes, mut params) = (0u64, 0u64);
        for l in layers {
            for (p, codec) in l.codecs.iter().enumerate() {
                let [rows, cols] = self.shape.matrix(p);
                bytes += l.resident as u64 * codec.matrix_bytes(rows, cols)?;
                params += (self.shape.experts * rows * cols) as u64;
            }
        }
        Ok(bytes as f64 * 8.0 / params as f64)
    }

    /// The model with each layer's experts at `layers`' VQ codecs (bf16 where a layer
    /// is bf16), every expert routable.
    fn vq_model(
        &mut self,
        layers: &[LayerSetting],
        dense: &CodedLayers,
    ) -> Result<LoadedModel<Cpu>> {
        let mut vq = BTreeMap::new();
        for l in layers {
            if l.codecs.iter().all(|c| *c == Codec::Bf16) {
                continue;
            }
            let key = (l.layer, l.codecs);
            if !self.encoded.contains_key(&key) {
                let rungs = l.codecs.map(|c| c.rung().ok().flatten());
                let [Some(g), Some(u), Some(d)] = rungs else {
                    anyhow::bail!(
                        "layer {}: {:?} mixes VQ and other codecs",
                        l.layer,
                        l.codecs
                    );
                };
                let e = encode_experts_by_projection(&self.config, &self.ckpt, l.layer, [g, u, d])?;
                self.encoded.insert(key, e);
            }
            vq.insert(l.layer, self.encoded[&key].clone());
        }
        Ok(assemble(
            &self.dir,
            self.config.clone(),
            &self.ckpt,
            &vq,
            dense,
            &BTreeMap::new(),
        )?)
    }

    /// Perplexity, KL divergence and top-1 agreement on every text; `reset` runs before
    /// each text (fresh resident sets, so no text starts from another's).
    #[allow(clippy::too_many_arguments)]
    fn score(
        &mut self,
        m: &mut LoadedModel<Cpu>,
        method: String,
        family: &str,
        budget_bits: Option<f64>,
        layers: Vec<LayerSetting>,
        whole: Option<(f64, BTreeMap<String, Codec>)>,
        reset: &dyn Fn(&mut LoadedModel<Cpu>) -> Result<()>,
    ) -> Result<Row> {
        if let Some(row) = self.done.get(&method) {
            eprintln!(
                "{method:<44} measured before ({})",
                self.journal.path().display()
            );
            return Ok(row.clone());
        }
        let start = Instant::now();
        let expert_bits = self.expert_bits(&layers)?;
        let (mut ppl, mut kld, mut top1) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        let mut hits = Vec::new();
        for (name, reference) in &self.texts {
            reset(m)?;
            let micro_batch = m.model.residency().map(|_| 32);
            let r = kl_divergence_to(m, reference, micro_batch)
                .with_context(|| format!("{method} on {name}"))?;
            ppl.insert(name.clone(), r.ppl);
            kld.insert(name.clone(), r.kld_mean);
            top1.insert(name.clone(), r.top1_agreement);
            if let Some(res) = m.model.residency() {
                hits.push(res.report().hit_rate);
            }
        }
        let (model_bits, groups) = whole.map_or((None, BTreeMap::new()), |(b, g)| (Some(b), g));
        let mut row = Row {
            method,
            family: family.to_string(),
            budget_bits,
            expert_bits,
            model_bits,
            groups,
            layers,
            geomean_ppl: f64::NAN,
            mean_kld: f64::NAN,
            ppl,
            kld,
            top1_agreement: top1,
            hit_rate: (!hits.is_empty()).then(|| hits.iter().sum::<f64>() / hits.len() as f64),
            seconds: start.elapsed().as_secs_f64(),
        };
        summarize(&mut row);
        eprintln!(
            "{:<44} {:>6.3} bits  geomean ppl {:>8.3}  KLD {:.4}  ({:.0} s)",
            row.method,
            row.model_bits.unwrap_or(row.expert_bits),
            row.geomean_ppl,
            row.mean_kld,
            row.seconds
        );
        self.journal
            .append(&Measured { row: row.clone() })
            .with_context(|| format!("writing {}", self.journal.path().display()))?;
        self.done.insert(row.method.clone(), row.clone());
        Ok(row)
    }

    /// Every layer at `codecs`, every expert resident.
    fn uniform(&self, codecs: [Codec; 3]) -> Vec<LayerSetting> {
        self.layers()
            .into_iter()
            .map(|layer| LayerSetting {
                layer,
                codecs,
                resident: self.shape.experts,
            })
            .collect()
    }

    fn plan_layers(plan: &Plan) -> Vec<LayerSetting> {
        plan.layers
            .iter()
            .map(|l| LayerSetting {
                layer: l.layer,
                codecs: [l.codec; 3],
                resident: l.resident,
            })
            .collect()
    }
}

/// The down projection's rung for gate/up rung `lo`: the lowest with at least half a bit
/// more.
fn down_rung(lo: Rung) -> Option<Rung> {
    LADDER.iter().copied().find(|r| r.rate() >= lo.rate() + 0.5)
}

fn codec_of(r: Rung) -> Codec {
    r.name().parse().expect("rung names parse")
}

/// The row's summaries over the domains' test splits. WikiText-2 is left out of them: the
/// fixtures never saw text like it (bf16 perplexity ~360), and compressing them often
/// *lowers* its perplexity, so there it measures noise rather than fidelity; the table
/// shows it in its own column.
fn summarize(row: &mut Row) {
    let of = |m: &BTreeMap<String, f64>| -> Vec<f64> {
        DOMAINS.iter().filter_map(|d| m.get(*d).copied()).collect()
    };
    let (ppl, kld) = (of(&row.ppl), of(&row.kld));
    row.geomean_ppl = (ppl.iter().map(|p| p.ln()).sum::<f64>() / ppl.len() as f64).exp();
    row.mean_kld = kld.iter().sum::<f64>() / kld.len() as f64;
}

/// Writes the table, the JSON and the plot of `report`.
fn publish(a: &QualityArgs, report: &Report) -> Result<()> {
    print_table(report);
    write(&a.out, &serde_json::to_string_pretty(report)?)?;
    write(&a.svg, &plot(report).to_svg())?;
    eprintln!("wrote {} and {}", a.out.display(), a.svg.display());
    Ok(())
}

pub fn quality(a: QualityArgs) -> Result<()> {
    if let Some(path) = &a.from_json {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut report: Report = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a quality report", path.display()))?;
        report.rows.iter_mut().for_each(summarize);
        return publish(&a, &report);
    }
    let start = Instant::now();
    let dir = a.model.clone();
    let config = Config::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(&dir)?;
    let mut texts = Vec::new();
    let mut calib = Vec::new();
    for d in DOMAINS {
        let folder = a.corpus.join(d);
        texts.push((d.to_string(), read_text(&folder.join("test.txt"))?));
        calib.push((
            folder.join("calib.txt").display().to_string(),
            read_text(&folder.join("calib.txt"))?,
        ));
    }
    if a.wikitext.exists() {
        texts.push(("wikitext2".to_string(), read_text(&a.wikitext)?));
    } else {
        eprintln!("{} not found: WikiText-2 left out", a.wikitext.display());
    }
    let opts = PplOptions {
        ctx: 512,
        max_chunks: Some(a.eval_chunks),
        micro_batch: None,
    };
    let reference = model::load(&dir, Cpu::fast())?;
    let mut refs = Vec::new();
    for (name, text) in &texts {
        eprintln!("reference logits on {name}");
        let r = reference_logits(&reference, text, opts)
            .with_context(|| format!("the uncompressed model on {name}"))?;
        refs.push((name.clone(), r));
    }
    drop(reference);
    std::fs::create_dir_all(&a.work).with_context(|| format!("creating {}", a.work.display()))?;
    let path = a.work.join("rows.jsonl");
    // Rows are reused only under the same model, texts and chunking, each known by its
    // contents: a file changed under the same name is measured again.
    let hash = |t: &str| Fnv64::default().bytes(t.as_bytes()).hex();
    let context = format!(
        "checkpoint {} texts={:?} calib={:?} eval_chunks={} calib_chunks={}",
        dynmoe::store::content_fingerprint(&ckpt, &dir)?,
        texts
            .iter()
            .map(|(n, t)| format!("{n}={}", hash(t)))
            .collect::<Vec<_>>(),
        calib.iter().map(|(_, t)| hash(t)).collect::<Vec<_>>(),
        a.eval_chunks,
        a.calib_chunks
    );
    let (journal, rows) = Journal::open::<Measured>(&path, &context)
        .with_context(|| format!("opening {}", path.display()))?;
    if rows.skipped.untrusted() > 0 {
        eprintln!(
            "{}: {} damaged or unchecked row(s) not trusted; measuring them again",
            path.display(),
            rows.skipped.untrusted()
        );
    }
    let done = rows
        .entries
        .into_iter()
        .map(|mut m| {
            summarize(&mut m.row);
            (m.row.method.clone(), m.row)
        })
        .collect();
    let mut b = Bench {
        shape: ExpertShape::of(&config),
        dir: dir.clone(),
        config,
        ckpt,
        texts: refs,
        encoded: HashMap::new(),
        journal,
        done,
    };
    let mut rows = Vec::new();
    let no_reset = |_: &mut LoadedModel<Cpu>| Ok(());

    let whole_model = matches!(a.scope, ScopeArg::Model);
    let mut left_out = Vec::new();
    let bf16 = b.uniform([Codec::Bf16; 3]);
    let mut m = model::load(&dir, Cpu::fast())?;
    rows.push(b.score(
        &mut m,
        "bf16".into(),
        "reference",
        None,
        bf16,
        Some((16.0, BTreeMap::new())).filter(|_| whole_model),
        &no_reset,
    )?);

    if whole_model {
        whole_model_rows(&a, &mut b, &calib, &mut rows, &mut left_out)?;
    }
    for &bits in a.budgets.iter().filter(|_| !whole_model) {
        let mut plans = Vec::new();
        for rounds in [2usize, 1] {
            let out = a.work.join(format!("isp-{bits}-r{rounds}"));
            std::fs::create_dir_all(&out)?;
            // One round is the two-round run's first: start from its journal.
            let journal = out.join("probes.jsonl");
            let first = a.work.join(format!("isp-{bits}-r2")).join("probes.jsonl");
            if rounds == 1 && !journal.exists() && first.exists() {
                std::fs::copy(&first, &journal)?;
            }
            let opts = CompressOptions {
                bits,
                scope: BudgetScope::Experts,
                rounds,
                anneal: Vec::new(),
                chunks: a.calib_chunks,
                ctx: 512,
                dense_codec: None,
                shadow: None,
            };
            let say = |msg: &str| eprintln!("[ISP {bits} b, {rounds} round(s)] {msg}");
            let plan = compress::compress(&dir, &calib, &out, &opts, &say, &say)
                .with_context(|| format!("compressing to {bits} bits"))?;
            plans.push((rounds, plan));
        }
        for (rounds, plan) in &plans {
            let layers = Bench::plan_layers(plan);
            // Resident sets read VQ records from a store: the plan's, beside the model.
            let mut m = load_plan(&dir, plan, &mut |_, _| {})?;
            let modes: &[Mode] = if *rounds == 2 {
                &[Mode::Dynamic, Mode::Static]
            } else {
                &[Mode::Dynamic]
            };
            for &mode in modes {
                let reset = |m: &mut LoadedModel<Cpu>| -> Result<()> {
                    let config = ResidencyConfig {
                        mode,
                        ..ResidencyConfig::default()
                    };
                    Ok(follow_plan(m, plan, config)?)
                };
                let (method, family) = match (rounds, mode) {
                    (2, Mode::Dynamic) => (format!("ISP 2 rounds, {bits} b, dynamic"), "isp2"),
                    (_, Mode::Dynamic) => (format!("ISP 1 round, {bits} b, dynamic"), "isp1"),
                    _ => (
                        format!("static REAP (ISP 2-round plan), {bits} b"),
                        "static",
                    ),
                };
                rows.push(b.score(
                    &mut m,
                    method,
                    family,
                    Some(bits),
                    layers.clone(),
                    None,
                    &reset,
                )?);
            }
        }
        // The heuristic: the richest (gate/up, down) pair within the budget.
        let mut best: Option<(f64, [Codec; 3])> = None;
        for lo in LADDER {
            let Some(hi) = down_rung(lo) else { continue };
            let codecs = [codec_of(lo), codec_of(lo), codec_of(hi)];
            let got = b.expert_bits(&b.uniform(codecs))?;
            if got <= bits && best.is_none_or(|(g, _)| got > g) {
                best = Some((got, codecs));
            }
        }
        if let Some((_, codecs)) = best {
            let layers = b.uniform(codecs);
            let mut m = b.vq_model(&layers, &CodedLayers::new())?;
            let method = format!(
                "heuristic {}/{}/{} (gate/up/down), {bits} b",
                codecs[0], codecs[1], codecs[2]
            );
            rows.push(b.score(
                &mut m,
                method,
                "heuristic",
                Some(bits),
                layers,
                None,
                &no_reset,
            )?);
        }
    }

    let mut converted = None;
    for &codec in a.uniform.iter().filter(|_| !whole_model) {
        let layers = b.uniform([codec; 3]);
        let mut m = match codec {
            Codec::Vq { .. } => b.vq_model(&layers, &CodedLayers::new())?,
            Codec::Bf16 => model::load(&dir, Cpu::fast())?,
            Codec::Affine { bits } => {
                let conv = match &converted {
                    Some(c) => c,
                    None => converted.insert(convert(&dir, &a.work.join("converted"))?),
                };
                dynmoe::store::lowbit::ensure(conv, bits)?;
                let eb = ExpertBits {
                    default: Some(bits),
                    ..ExpertBits::default()
                };
                model::load_with(conv, Cpu::fast(), &eb)?
            }
        };
        let family = if codec.rung()?.is_some() {
            "vq"
        } else {
            "affine"
        };
        rows.push(b.score(
            &mut m,
            format!("uniform {codec}"),
            family,
            None,
            layers,
            None,
            &no_reset,
        )?);
    }

    let report = Report {
        model: dir.display().to_string(),
        scope: if whole_model {
            "whole model".into()
        } else {
            "routed experts".into()
        },
        calib_chunks_per_text: a.calib_chunks,
        eval_chunks_per_text: a.eval_chunks,
        texts: b.texts.iter().map(|(n, _)| n.clone()).collect(),
        rows,
        left_out,
    };
    publish(&a, &report)?;
    eprintln!("{:.0} s", start.elapsed().as_secs_f64());
    Ok(())
}

/// The rows of a whole-model comparison: ISP under a whole-model budget (every tensor
/// group allocated, dynamic residency from the plan's sets) at each budget, beside
/// uniform recipes that code every tensor: everything q4, experts q2 with the rest q4,
/// and each VQ rung of `--uniform` everywhere. Bits count every tensor, codebooks aside.
fn whole_model_rows(
    a: &QualityArgs,
    b: &mut Bench,
    calib: &[(String, String)],
    rows: &mut Vec<Row>,
    left_out: &mut Vec<String>,
) -> Result<()> {
    let dir = b.dir.clone();
    let no_reset = |_: &mut LoadedModel<Cpu>| Ok(());
    // A uniform recipe's whole-model bits and the codecs of its tensor groups.
    let uniform_whole = |b: &Bench, experts: Codec, rest: Codec| {
        let assignment = Assignment {
            tensors: GroupCodecs::uniform(rest, rest, rest),
            layers: BTreeMap::new(),
            default_experts: experts,
        };
        let bits = account(&b.config, &b.ckpt, &assignment, None)?.resident_bits_per_weight;
        let groups = ["dense", "lm_head", "embedding"]
            .map(|n| (n.to_string(), rest))
            .into();
        anyhow::Ok(Some((bits, groups)))
    };
    let names = |g: &BTreeMap<dynmoe::checkpoint::arch::CodedGroup, Codec>| {
        g.iter()
            .filter(|(_, c)| **c != Codec::Bf16)
            .map(|(g, c)| (g.to_string(), *c))
            .collect::<BTreeMap<_, _>>()
    };
    let variants = std::iter::once(None).chain(a.shadow.iter().copied().map(Some));
    for (shadow, &bits) in variants.flat_map(|s| a.budgets.iter().map(move |b| (s, b))) {
        let tag = shadow.map_or(String::new(), |c| format!("-shadow-{c}"));
        let out = a.work.join(format!("model-isp-{bits}{tag}"));
        std::fs::create_dir_all(&out)?;
        let opts = CompressOptions {
            bits,
            scope: BudgetScope::Model,
            rounds: 2,
            anneal: Vec::new(),
            chunks: a.calib_chunks,
            ctx: 512,
            dense_codec: None,
            shadow,
        };
        let say = |msg: &str| eprintln!("[ISP whole model {bits} b{tag}] {msg}");
        let plan = match compress::compress(&dir, calib, &out, &opts, &say, &say) {
            Err(e @ compress::CompressError::BudgetTooSmall { .. }) => {
                let why = format!("{bits} b{tag}: {e}");
                eprintln!("left out: {why}");
                left_out.push(why);
                continue;
            }
            r => r.with_context(|| format!("compressing to {bits} bits over the whole model"))?,
        };
        let layers = Bench::plan_layers(&plan);
        let mut m = load_plan(&dir, &plan, &mut |_, _| {})?;
        let reset = |m: &mut LoadedModel<Cpu>| -> Result<()> {
            Ok(follow_plan(m, &plan, ResidencyConfig::default())?)
        };
        let whole = Some((plan.resident_bits(), names(&plan.groups)));
        let (method, family) = match shadow {
            None => (format!("ISP whole model, {bits} b, dynamic"), "isp-model"),
            Some(c) => (
                format!("ISP whole model + {c} shadows, {bits} b, dynamic"),
                "isp-model-shadows",
            ),
        };
        rows.push(b.score(&mut m, method, family, Some(bits), layers, whole, &reset)?);
    }
    let (q4, q2) = (Codec::Affine { bits: 4 }, Codec::Affine { bits: 2 });
    let converted = convert(&dir, &a.work.join("converted"))?;
    for (experts, rest) in [(q4, q4), (q2, q4)] {
        let Codec::Affine { bits } = experts else {
            unreachable!("affine recipes")
        };
        dynmoe::store::lowbit::ensure(&converted, bits)?;
        let codecs = model::Codecs {
            default: Some(experts),
            dense: Some(rest),
            head: Some(rest),
            embedding: Some(rest),
            ..model::Codecs::default()
        };
        let mut m = model::load_with_codecs(&converted, Cpu::fast(), &codecs)?;
        let layers = b.uniform([experts; 3]);
        let whole = uniform_whole(b, experts, rest)?;
        let method = format!("uniform experts {experts}, the rest {rest}");
        rows.push(b.score(&mut m, method, "affine", None, layers, whole, &no_reset)?);
    }
    for &codec in a.uniform.iter().filter(|c| matches!(c, Codec::Vq { .. })) {
        let layers = b.uniform([codec; 3]);
        let all = GroupCodecs::uniform(codec, codec, codec);
        let coded = model::coded_layers(&dir, &b.ckpt, &b.config, &all, false, &mut |_, _| {})?;
        let mut m = b.vq_model(&layers, &coded)?;
        let whole = uniform_whole(b, codec, codec)?;
        let method = format!("uniform {codec} everywhere");
        rows.push(b.score(&mut m, method, "vq", None, layers, whole, &no_reset)?);
    }
    Ok(())
}

/// The 4-bit store of `dir` under `out`, converted once and reused.
fn convert(dir: &Path, out: &Path) -> Result<PathBuf> {
    if dynmoe::store::ExpertStore::open(out, 4).is_err() {
        dynmoe::store::base::convert(dir, out, &mut |_, _| {})
            .with_context(|| format!("converting {} into {}", dir.display(), out.display()))?;
    }
    Ok(out.to_path_buf())
}

fn write(path: &Path, text: &str) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    dynmoe::store::atomic::write_file(path, text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

fn print_table(r: &Report) {
    let mut head = format!("| {:<46} | {:>6} |", "method", "bits");
    for t in &r.texts {
        head += &format!(" {t:>9} |");
    }
    head += " geomean |    KLD | WikiText-2 KLD | hit rate |";
    println!("{head}");
    println!("{}", head.replace(|c: char| c != '|', "-"));
    for row in &r.rows {
        let bits = row.model_bits.unwrap_or(row.expert_bits);
        let mut line = format!("| {:<46} | {:>6.3} |", row.method, bits);
        for t in &r.texts {
            line += &format!(" {:>9.3} |", row.ppl[t]);
        }
        let hit = row
            .hit_rate
            .map_or("-".to_string(), |h| format!("{:.1}%", 100.0 * h));
        let wiki_kld = row
            .kld
            .get("wikitext2")
            .map_or("-".to_string(), |k| format!("{k:.4}"));
        line += &format!(
            " {:>7.3} | {:>6.4} | {:>14} | {:>8} |",
            row.geomean_ppl, row.mean_kld, wiki_kld, hit
        );
        println!("{line}");
    }
    for why in &r.left_out {
        println!("left out: {why}");
    }
}

fn plot(r: &Report) -> Plot {
    let families = [
        ("isp2", "ISP, 2 rounds, dynamic"),
        ("isp1", "ISP, 1 round, dynamic"),
        ("isp-model", "ISP, every tensor allocated, dynamic"),
        ("isp-model-shadows", "the same with shadows"),
        ("static", "static REAP, same plan"),
        ("heuristic", "heuristic (down +0.5 b)"),
        ("vq", "uniform VQ"),
        ("affine", "uniform affine"),
    ];
    let series = families
        .iter()
        .map(|(family, label)| {
            let mut points: Vec<(f64, f64)> = r
                .rows
                .iter()
                .filter(|row| row.family == *family)
                .map(|row| (row.model_bits.unwrap_or(row.expert_bits), row.geomean_ppl))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series {
                label: label.to_string(),
                points,
            }
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    Plot {
        title: format!(
            "{}: perplexity (geometric mean over the {} domains' test splits) against resident bits",
            Path::new(&r.model)
                .file_name()
                .map_or(r.model.clone(), |n| n.to_string_lossy().into_owned()),
            DOMAINS.len()
        ),
        x_label: if r.scope == "whole model" {
            "resident bits per weight, every tensor".into()
        } else {
            "resident bits per routed-expert weight".into()
        },
        y_label: "perplexity".into(),
        log_y: true,
        series,
    }
}

//! `dynmoe synth` and `dynmoe bench decode`: random checkpoints (or converted or
//! compressed directories) of published shapes, and batch-1 prefill and decode speed on
//! them at each expert precision, or at a compressed directory's plan.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{ArgGroup, Args, Subcommand, ValueEnum};

use crate::{cuda_backend, BackendKind, DenseCodecArgs};
use dynmoe::backend::sample::Sampling;
use dynmoe::backend::Backend;
use dynmoe::checkpoint::Config;
use dynmoe::codec::vq::Rung;
use dynmoe::codec::Codec;
use dynmoe::model::argmax;
use dynmoe::model::{Codecs, DecodeOptions, Decoding, ExpertBits, LoadedModel};
use dynmoe::store::compressed;
use dynmoe::store::{plan::Plan, plan::PLAN_FILE};
use dynmoe::synth;
use dynmoe::testing::{decode_one, Rng};
use serde::Serialize;

use crate::progress;

#[derive(Args)]
#[command(group(ArgGroup::new("stores").args(["bits", "vq"])))]
pub struct SynthArgs {
    /// Shape to copy: qwen3-30b-a3b, qwen3-235b-a22b or qwen3-coder-480b-a35b.
    #[arg(long)]
    like: String,
    /// Keep only the first N decoder layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Output directory.
    #[arg(long, short)]
    out: PathBuf,
    /// Model directory whose tokenizer files are copied (default: the bundled small-moe).
    #[arg(long)]
    tokenizer_from: Option<PathBuf>,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write a converted model directory with expert stores of random records at these
    /// precisions (4, 3, 2; without 4 the low-bit stores stand alone) instead of a bf16
    /// checkpoint to convert.
    #[arg(long, value_delimiter = ',')]
    bits: Vec<u32>,
    /// Write a compressed model directory instead, every MoE layer's routed experts at
    /// this rung of the VQ ladder (`vq1.5` or `1.5`, ...) and resident, its store of
    /// random records generated directly (no encoding) beside a plan that says so.
    #[arg(long, value_parser = parse_rung)]
    vq: Option<Rung>,
    /// With --bits or --vq: write as many of the layers as fit in this many bytes (dense
    /// weights and stores), saying so when that is fewer than asked.
    #[arg(long, requires = "stores")]
    fit_in: Option<u64>,
}

fn parse_rung(s: &str) -> Result<Rung, String> {
    Rung::parse(s).map_err(|e| e.to_string())
}

pub fn synth(a: SynthArgs) -> Result<()> {
    let shape = synth::shape(&a.like)?;
    let tok = a
        .tokenizer_from
        .clone()
        .unwrap_or_else(|| dynmoe::testing::fixture("small-moe"));
    if let Some(rung) = a.vq {
        return synth_compressed(&a, &shape, rung, &tok);
    }
    if !a.bits.is_empty() {
        return synth_converted(&a, &shape, &tok);
    }
    let start = Instant::now();
    let r = writing(&a.out, "synth", 0, |progress| {
        synth::synth(&shape, a.layers, &tok, &a.out, a.seed, progress)
    })?;
    println!(
        "{}: {} layers of {}, {:.2} B parameters, {:.1} GB bf16 in {:.0} s",
        r.dir.display(),
        r.layers,
        shape.name,
        r.params as f64 / 1e9,
        r.bytes as f64 / 1e9,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// What `write` returns, under a progress bar labelled `label` that shows its (done,
/// total) counts shifted right by `shift` bits; an error names `out`.
fn writing<T, E>(
    out: &std::path::Path,
    label: &str,
    shift: u32,
    write: impl FnOnce(&mut dyn FnMut(usize, usize)) -> Result<T, E>,
) -> Result<T>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let bar = progress::bar(label);
    let r = write(&mut |d, t| progress::update(&bar, d >> shift, t >> shift))
        .with_context(|| format!("writing {}", out.display()))?;
    bar.finish_and_clear();
    Ok(r)
}

/// The layers to write: as asked, or with `--fit-in` the most that `fitting` says fit,
/// saying so when that is fewer. `what` names the stores in messages.
fn layers_to_write(
    a: &SynthArgs,
    shape: &synth::Shape,
    what: &str,
    fitting: impl Fn(usize, u64) -> Result<usize, dynmoe::model::Error>,
) -> Result<usize> {
    let asked = a.layers.unwrap_or(shape.layers);
    let Some(budget) = a.fit_in else {
        return Ok(asked);
    };
    let n = fitting(asked.min(shape.layers), budget)?;
    if n == 0 {
        bail!(
            "not one layer of {} fits in {:.1} GB at {what}",
            shape.name,
            budget as f64 / 1e9,
        );
    }
    if n < asked {
        eprintln!(
            "only {n} of {asked} layers of {} fit in {:.1} GB at {what}: writing {n}",
            shape.name,
            budget as f64 / 1e9,
        );
    }
    Ok(n)
}

/// `dynmoe synth --bits`: a converted directory of random records, no conversion.
fn synth_converted(a: &SynthArgs, shape: &synth::Shape, tok: &std::path::Path) -> Result<()> {
    let layers = layers_to_write(a, shape, &format!("{:?} bits", a.bits), |n, budget| {
        shape.layers_fitting(n, &a.bits, budget)
    })?;
    let r = writing(&a.out, "synth MB", 20, |progress| {
        synth::synth_converted(shape, Some(layers), &a.bits, tok, &a.out, a.seed, progress)
    })?;
    for s in &r.stores {
        println!(
            "  {}: {}-bit, {:.2} GB ({} bytes per record)",
            s.path.display(),
            s.bits,
            s.bytes as f64 / 1e9,
            s.record_size
        );
    }
    let stores = (r.bytes() - r.dense_bytes) as f64 / 1e9;
    let store_seconds = r.seconds - r.dense_seconds;
    println!(
        "{}: {} layers of {}: dense {:.2} GB in {:.1} s ({:.2} GB/s), stores {:.2} GB in {:.1} s \
         ({:.2} GB/s); {:.2} GB in {:.1} s ({:.2} GB/s)",
        r.dir.display(),
        r.layers,
        shape.name,
        r.dense_bytes as f64 / 1e9,
        r.dense_seconds,
        r.dense_bytes as f64 / 1e9 / r.dense_seconds,
        stores,
        store_seconds,
        stores / store_seconds,
        r.bytes() as f64 / 1e9,
        r.seconds,
        r.bytes() as f64 / 1e9 / r.seconds
    );
    Ok(())
}

/// `dynmoe synth --vq`: a compressed directory of random VQ records, no encoding.
fn synth_compressed(
    a: &SynthArgs,
    shape: &synth::Shape,
    rung: Rung,
    tok: &std::path::Path,
) -> Result<()> {
    let layers = layers_to_write(a, shape, &rung.name(), |n, budget| {
        shape.layers_fitting_vq(n, rung, budget)
    })?;
    let r = writing(&a.out, "synth MB", 20, |progress| {
        synth::synth_compressed(shape, Some(layers), rung, tok, &a.out, a.seed, progress)
    })?;
    let s = &r.store;
    println!(
        "  {}: {}, {:.2} GB ({} bytes per record, {} of codes and norms per expert)",
        s.path.display(),
        s.rung,
        s.bytes as f64 / 1e9,
        s.record_size,
        s.expert_bytes
    );
    let store_seconds = r.seconds - r.dense_seconds;
    println!(
        "{}: {} layers of {} at {} ({:.3} resident bits per weight): dense {:.2} GB in {:.1} s, \
         store {:.2} GB in {:.1} s ({:.2} GB/s); {:.2} GB in {:.1} s",
        r.dir.display(),
        r.layers,
        shape.name,
        s.rung,
        r.resident_bits,
        r.dense_bytes as f64 / 1e9,
        r.dense_seconds,
        s.bytes as f64 / 1e9,
        store_seconds,
        s.bytes as f64 / 1e9 / store_seconds,
        r.bytes() as f64 / 1e9,
        r.seconds,
    );
    Ok(())
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Batch-1 prefill and decode tokens per second at each expert precision.
    Decode(DecodeArgs),
    /// The VQ ladder: bits per weight, distortion on Gaussian and real weights beside
    /// the bound and the bitsandbytes constants, encode and decode speed, fit of φ(b).
    Codecs(crate::codecs::CodecsArgs),
    /// Perplexity and KL divergence against resident bits: ISP plans beside uniform
    /// codecs, static REAP and a hand heuristic; a table, JSON and an SVG plot.
    Quality(crate::quality::QualityArgs),
    /// Decode speed with resident sets smaller than the model beside every expert
    /// resident: swaps, bytes moved, stalls.
    Residency(crate::bench_residency::ResidencyBenchArgs),
}

#[derive(Args)]
pub struct DecodeArgs {
    /// A converted model directory (`dynmoe convert`, `dynmoe synth --bits`), measured at
    /// each of --bits; or a compressed one (`dynmoe compress`, `dynmoe synth --vq`),
    /// measured once, at its plan.
    model: PathBuf,
    /// Compute backend.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Expert precisions of a converted directory to measure [default: 4,3,2]. A
    /// compressed directory runs the codecs of its plan and refuses this.
    #[arg(long, value_delimiter = ',')]
    bits: Vec<u32>,
    /// Prompt tokens (random ids), processed as one prefill.
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    /// Tokens decoded one at a time after the prompt (greedy).
    #[arg(long, default_value_t = 128)]
    generate: usize,
    /// Timed repetitions; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// The dense layers and LM head of every setting measured (a converted directory's).
    #[command(flatten)]
    dense: DenseCodecArgs,
    /// Also measure aggregate decode with this many sequences at once (comma-separated,
    /// e.g. 1,4,8,16,32,64): each a 128-token prompt, then 128 tokens each, greedy, all
    /// the sequences decoded together.
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// On the CPU, also decode once more with every op timed: where a token's time goes.
    /// (On CUDA, build the kernels with `DYNMOE_CUDA=define=TIMELINE=1` instead.)
    #[arg(long)]
    timeline: bool,
    /// Also write the report here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn bench(c: BenchCommand) -> Result<()> {
    match c {
        BenchCommand::Decode(a) => decode(a),
        BenchCommand::Codecs(a) => crate::codecs::bench_codecs(a),
        BenchCommand::Quality(a) => crate::quality::quality(a),
        BenchCommand::Residency(a) => crate::bench_residency::bench_residency(a),
    }
}

/// What one measured case runs.
pub(crate) enum Setting {
    /// A converted directory's routed experts at this many bits.
    Affine(u32),
    /// A compressed directory at its own plan.
    Plan(Box<Plan>),
}

impl Setting {
    /// The case's name in the table: the bits, or the plan's codecs (one rung's name, or
    /// the distinct ones in layer order joined by `+`).
    pub(crate) fn label(&self) -> String {
        match self {
            Setting::Affine(bits) => bits.to_string(),
            Setting::Plan(plan) => {
                let mut codecs: Vec<String> = Vec::new();
                for l in &plan.layers {
                    let c = l.codec.to_string();
                    if !codecs.contains(&c) {
                        codecs.push(c);
                    }
                }
                codecs.join("+")
            }
        }
    }

    /// The codecs to load with: the affine precision and `dense`, or for a plan the
    /// defaults (a compressed directory runs its plan's and refuses others).
    pub(crate) fn codecs(&self, dense: &DenseCodecArgs) -> Codecs {
        match self {
            Setting::Affine(bits) => dense.apply(Codecs::from(&ExpertBits {
                default: Some(*bits),
                ..ExpertBits::default()
            })),
            Setting::Plan(_) => Codecs::default(),
        }
    }

    /// The codecs the dense linear layers and the LM head run at: `dense`'s (bf16 where
    /// unset), or a plan's dense and head codecs.
    pub(crate) fn dense_codecs(&self, dense: &DenseCodecArgs) -> DenseCodecs {
        match self {
            Setting::Affine(_) => DenseCodecs {
                dense: dense.dense_codec.unwrap_or(Codec::Bf16),
                head: dense.head_codec.unwrap_or(Codec::Bf16),
            },
            // A plan that gives layers' dense weights codecs of their own is priced at
            // its default here: these benches read plans of one dense codec.
            Setting::Plan(plan) => DenseCodecs {
                dense: plan.dense_codec,
                head: plan
                    .group_codecs()
                    .of(dynmoe::checkpoint::arch::CodedGroup::Head),
            },
        }
    }

    /// Bytes of one routed expert of each MoE layer as the kernels read it: affine codes
    /// with their scales and biases; a VQ record's codes and block norms (its
    /// `VqLayout`'s parts, header and page padding left out); bf16 experts of a plan at
    /// `dense` bytes a weight, as the backend keeps dense matrices.
    pub(crate) fn expert_bytes(&self, c: &Config, dense: usize) -> Result<Vec<usize>> {
        let (h, i) = (c.hidden_size, c.moe.expert_intermediate);
        match self {
            Setting::Affine(bits) => Ok(vec![expert_bytes(c, *bits)?; c.moe_layers().count()]),
            Setting::Plan(plan) => plan
                .layers
                .iter()
                .map(|l| match l.codec.rung()? {
                    Some(rung) => {
                        let layout = dynmoe::store::vq::VqLayout::new(rung, h, i)?;
                        Ok(dynmoe::store::synth_vq::expert_bytes(&layout))
                    }
                    None if l.codec == Codec::Bf16 => Ok(3 * h * i * dense),
                    None => bail!(
                        "layer {}: plans run bf16 and VQ rungs, not {}",
                        l.layer,
                        l.codec
                    ),
                })
                .collect(),
        }
    }
}

/// What to measure in `model`: a compressed directory at its plan (refusing `bits` and
/// `dense`), or a converted one at each of `bits` (`default` when none are given).
pub(crate) fn settings(
    model: &Path,
    bits: &[u32],
    default: &[u32],
    dense: &DenseCodecArgs,
) -> Result<Vec<Setting>> {
    if compressed::is_compressed(model) {
        let (_, plan) =
            compressed::open(model).with_context(|| format!("reading {}", model.display()))?;
        let dense_codec = plan.dense_codec;
        let plan = Setting::Plan(Box::new(plan));
        let refused = if !bits.is_empty() {
            "--bits picks the affine stores of a converted directory"
        } else if dense.is_set() {
            "--dense-codec and --head-codec apply to a converted directory"
        } else {
            return Ok(vec![plan]);
        };
        bail!(
            "{} is a compressed model: it runs the codecs of its {PLAN_FILE} ({}, dense \
             {dense_codec}); {refused}",
            model.display(),
            plan.label(),
        );
    }
    let bits = if bits.is_empty() { default } else { bits };
    Ok(bits.iter().map(|&b| Setting::Affine(b)).collect())
}

impl Setting {
    /// Bytes of the largest record a resident slot holds: the affine store's, or the
    /// largest of the plan's VQ stores'.
    pub(crate) fn record_bytes(&self, c: &Config) -> Result<usize> {
        let (h, i) = (c.hidden_size, c.moe.expert_intermediate);
        match self {
            Setting::Affine(bits) => Ok(dynmoe::store::Layout::new(*bits, h, i)?.record_size),
            Setting::Plan(plan) => {
                let mut most = 0;
                for l in &plan.layers {
                    let Some(rung) = l.codec.rung()? else {
                        bail!(
                            "layer {}: resident slots hold affine or VQ records, not {}",
                            l.layer,
                            l.codec
                        );
                    };
                    most = most.max(dynmoe::store::vq::VqLayout::new(rung, h, i)?.record_size);
                }
                Ok(most)
            }
        }
    }
}

/// llama.cpp's CUDA build on an H200 on the 12-layer Qwen3-30B-A3B shape at batch 1
/// (decode of 128, prefill of 512 tokens) at Q4_K_M and Q2_K, as (decode, prefill)
/// tokens per second; `None` for other shapes and precisions.
fn llama_cpp(c: &Config, bits: u32) -> Option<(f64, f64)> {
    let shape = synth::shape("qwen3-30b-a3b").ok()?;
    let same = c.hidden_size == shape.hidden
        && c.layers.len() == 12
        && c.moe.num_experts == shape.experts
        && c.moe.expert_intermediate == shape.moe_intermediate;
    if !same {
        return None;
    }
    match bits {
        4 => Some((809.0, 27993.0)),
        2 => Some((747.0, 22165.0)),
        _ => None,
    }
}

/// The codecs of a setting's dense linear layers and LM head.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct DenseCodecs {
    /// Attention projections (and shared experts, dense MLPs).
    #[serde(rename = "dense_codec")]
    pub(crate) dense: Codec,
    /// An untied LM head (a tied one is the embedding table, at the dense bytes).
    #[serde(rename = "head_codec")]
    pub(crate) head: Codec,
}

#[derive(Serialize)]
struct Case {
    /// The routed experts' precision in whole bits: the affine bits; for a compressed
    /// directory, its experts' stored bits per weight rounded to the nearest integer
    /// (2 for vq1.5), so that readers of this field see a number of the same kind; `plan`
    /// and `expert_bits_per_weight` say exactly what ran.
    bits: u32,
    /// Codecs of the attention projections and the LM head.
    #[serde(flatten)]
    codecs: DenseCodecs,
    /// For a compressed directory, the codecs of its plan's MoE layers (`vq1.5`, or the
    /// distinct ones joined by `+`); absent for a converted directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    plan: Option<String>,
    /// Stored bits per routed-expert weight, the per-group scales and biases or per-block
    /// norms included (4.5 at 4 bits, about 1.52 at vq1.5 on Qwen3-30B-A3B's shape),
    /// averaged over the MoE layers.
    expert_bits_per_weight: f64,
    prefill_tok_s: f64,
    /// Greedy decode with the token picked on the backend, the steps queued back to back
    /// on the device and each token read back as it lands (`Model::decode`;
    /// on CUDA each step replayed from a graph). Where the step cannot be recorded (the
    /// CPU, dense or host-routed feed-forward layers, graphs off) it runs token by token,
    /// as `decode_sync_tok_s` does.
    decode_tok_s: f64,
    /// The same positions in the same run decoded token by token (`Model::decode` of one token a call):
    /// each token read back, and waited for, before the next step is issued.
    decode_sync_tok_s: f64,
    prefill_runs_tok_s: Vec<f64>,
    decode_runs_tok_s: Vec<f64>,
    decode_sync_runs_tok_s: Vec<f64>,
    /// The steps run eagerly (CUDA with graphs off, so token by token; `None` elsewhere).
    decode_eager_tok_s: Option<f64>,
    /// Decode through `Model::forward`, the logits read back and the argmax taken on the
    /// host every step.
    decode_logits_tok_s: f64,
    /// Decode sampling at temperature 0.8 and top-p 0.95 (seed 1), through the same
    /// `Model::decode` as greedy.
    decode_sampled_tok_s: f64,
    decode_sampled_runs_tok_s: Vec<f64>,
    /// Aggregate decode tokens per second with several sequences at once (`--batch`).
    batches: Vec<BatchCase>,
    /// Whether the decode paths (queued, token by token, through the logits) chose the
    /// same tokens in every run.
    decode_paths_agree: bool,
    /// Weight bytes one decode step must read: attention projections and the LM head at
    /// their codecs (bf16 ones as the backend stores dense matrices, see
    /// `dense_bytes_per_weight`; affine ones as codes with a bf16 scale and bias per 64
    /// weights), routers at the dense bytes, and top-k experts of every MoE layer at
    /// `bits`, or at its plan's codec (a VQ expert's codes and block norms).
    decode_bytes_per_token: usize,
    /// Bytes a dense weight takes on the backend: 2 on CUDA, which keeps a bf16
    /// checkpoint's matrices in bf16, 4 on the CPU (f32).
    dense_bytes_per_weight: usize,
    /// The device's copy bandwidth (the host's read bandwidth on the CPU) over those bytes.
    decode_floor_tok_s: Option<f64>,
    llama_cpp_decode_tok_s: Option<f64>,
    llama_cpp_prefill_tok_s: Option<f64>,
    /// With `--timeline` on the CPU: a decode token op by op.
    #[serde(skip_serializing_if = "Option::is_none")]
    timeline: Option<crate::bench_timeline::Timeline>,
}

/// Several sequences decoded at once.
#[derive(Serialize)]
struct BatchCase {
    /// Sequences.
    batch: usize,
    /// Tokens per second of all the sequences together, median of the runs.
    decode_tok_s: f64,
    decode_runs_tok_s: Vec<f64>,
}

#[derive(Serialize)]
struct Report {
    model: PathBuf,
    backend: String,
    device: String,
    layers: usize,
    prompt: usize,
    generate: usize,
    repeats: usize,
    copy_gb_s: Option<f64>,
    cases: Vec<Case>,
}

/// Bytes of a `[rows, cols]` matrix at `codec` as the kernels read it: `dense` bytes a
/// weight at bf16 (the backend's dense matrices), else the codec's codes with their scales
/// and biases or norms.
fn matrix_bytes(codec: Codec, rows: usize, cols: usize, dense: usize) -> Result<usize> {
    Ok(match codec {
        Codec::Bf16 => dense * rows * cols,
        _ => codec.matrix_bytes(rows, cols)? as usize,
    })
}

/// Bytes a decode step reads, from the configuration, with dense weights of `dense`
/// bytes each and routed experts of `experts` bytes in each MoE layer (see [`Case`]).
fn decode_bytes(c: &Config, experts: &[usize], dense: usize, codecs: DenseCodecs) -> Result<usize> {
    Ok(layer_dense_bytes(c, dense, codecs.dense)?
        + head_bytes(c, dense, codecs.head)?
        + c.moe.top_k * experts.iter().sum::<usize>())
}

/// Bytes of every layer's attention projections at `codec` and every MoE router at
/// `dense` bytes a weight: the dense matrices besides embeddings and LM head.
pub(crate) fn layer_dense_bytes(c: &Config, dense: usize, codec: Codec) -> Result<usize> {
    let (h, q, kv) = (c.hidden_size, c.q_dim(), c.kv_dim());
    let attention = 2 * matrix_bytes(codec, kv, h, dense)?
        + matrix_bytes(codec, q, h, dense)?
        + matrix_bytes(codec, h, q, dense)?;
    Ok(c.layers.len() * attention + c.moe_layers().count() * c.moe.num_experts * h * dense)
}

/// Bytes of the LM head: an untied one at `codec`, a tied one (the embedding table) at
/// `dense` bytes a weight.
pub(crate) fn head_bytes(c: &Config, dense: usize, codec: Codec) -> Result<usize> {
    let codec = if c.tie_word_embeddings {
        Codec::Bf16
    } else {
        codec
    };
    matrix_bytes(codec, c.vocab_size, c.hidden_size, dense)
}

/// Bytes of one routed expert (gate, up, down) at `bits`.
pub(crate) fn expert_bytes(c: &Config, bits: u32) -> Result<usize> {
    let (h, i) = (c.hidden_size, c.moe.expert_intermediate);
    let codec = Codec::Affine { bits };
    Ok(2 * codec.matrix_bytes(i, h)? as usize + codec.matrix_bytes(h, i)? as usize)
}

/// Tokens per second of each run of one way of decoding.
#[derive(Default)]
struct Runs {
    prefill: Vec<f64>,
    /// Through `Model::decode`: steps queued back to back.
    greedy: Vec<f64>,
    /// Through `Model::decode`, one token a call.
    sync: Vec<f64>,
    /// Through `Model::forward` and a host argmax.
    logits: Vec<f64>,
    /// Through `Model::decode`, sampling.
    sampled: Vec<f64>,
    agree: bool,
}

/// The sampling `bench decode` measures: what llama.cpp's and most servers' defaults are
/// near.
const BENCH_SAMPLING: Sampling = Sampling {
    temperature: 0.8,
    top_p: 0.95,
    seed: 1,
    ..Sampling::GREEDY
};

/// `prompt` token ids drawn at random (seed 1) from the model's vocabulary: the same
/// prompt for every run and every precision.
pub(crate) fn random_prompt<B: Backend>(m: &LoadedModel<B>, prompt: usize) -> Vec<u32> {
    let vocab = m.model.config.vocab_size as u64;
    let mut rng = Rng::seeded(1);
    (0..prompt)
        .map(|_| (rng.next_u64() % vocab) as u32)
        .collect()
}

/// Prefill and decode tokens per second over `repeats` runs, after a warm-up run (which
/// also brings every touched expert onto the device, and records the decode step where
/// the backend does). Each run decodes three times from the same prefill position: greedy
/// on the backend with the steps queued back to back, greedy on the backend token by
/// token, then through the logits.
fn measure<B: Backend>(
    m: &LoadedModel<B>,
    prompt: usize,
    generate: usize,
    repeats: usize,
) -> Result<Runs> {
    let ids = random_prompt(m, prompt);
    let mut state = m.model.new_state(prompt + generate);
    let mut runs = Runs {
        agree: true,
        ..Runs::default()
    };
    for run in 0..=repeats {
        state.clear();
        let t = Instant::now();
        // Downloading the logits waits for the device.
        let logits = m.model.forward(&mut state, &ids, prompt - 1)?;
        let prefill = t.elapsed().as_secs_f64();
        let first = argmax(&logits);
        let mut tokens = [(); 3].map(|_| Vec::with_capacity(generate));
        let t = Instant::now();
        m.model.decode(
            &mut [Decoding::new(
                &mut state,
                first,
                DecodeOptions::greedy(generate),
            )],
            &mut |_, next| {
                tokens[0].push(next);
                true
            },
        )?;
        let greedy = t.elapsed().as_secs_f64();
        // The same positions again: the cache rows are rewritten as they are reached.
        state.pos = prompt;
        let mut next = first;
        let t = Instant::now();
        for _ in 0..generate {
            next = decode_one(&m.model, &mut state, next)?;
            tokens[1].push(next);
        }
        let sync = t.elapsed().as_secs_f64();
        state.pos = prompt;
        next = first;
        let t = Instant::now();
        for _ in 0..generate {
            let logits = m.model.forward(&mut state, &[next], 0)?;
            next = argmax(&logits);
            tokens[2].push(next);
        }
        let through_logits = t.elapsed().as_secs_f64();
        state.pos = prompt;
        let opts = DecodeOptions {
            max_tokens: generate,
            sampling: BENCH_SAMPLING,
        };
        let t = Instant::now();
        m.model.decode(
            &mut [Decoding::new(&mut state, first, opts)],
            &mut |_, _| true,
        )?;
        let sampled = t.elapsed().as_secs_f64();
        runs.agree &= tokens[0] == tokens[1] && tokens[1] == tokens[2];
        if run > 0 {
            runs.prefill.push(prompt as f64 / prefill);
            runs.greedy.push(generate as f64 / greedy);
            runs.sync.push(generate as f64 / sync);
            runs.logits.push(generate as f64 / through_logits);
            runs.sampled.push(generate as f64 / sampled);
        }
    }
    Ok(runs)
}

/// Aggregate decode tokens per second of `b` sequences at once, for each `b` of
/// `batches`, over `repeats` runs after a warm-up: each sequence a 128-token random prompt
/// (prefilled alone), then 128 greedy tokens each, every sequence in every step's pass.
fn measure_batches<B: Backend>(
    m: &LoadedModel<B>,
    batches: &[usize],
    repeats: usize,
) -> Result<Vec<BatchCase>> {
    const PROMPT: usize = 128;
    const GENERATE: usize = 128;
    let ids = random_prompt(m, PROMPT);
    let mut out = Vec::new();
    for &b in batches {
        if b == 0 {
            bail!("--batch sizes must be positive");
        }
        let mut states: Vec<_> = (0..b)
            .map(|_| m.model.new_state(PROMPT + GENERATE))
            .collect();
        let mut runs = Vec::new();
        for run in 0..=repeats {
            let mut firsts = Vec::new();
            for s in &mut states {
                s.clear();
                firsts.push(argmax(&m.model.forward(s, &ids, PROMPT - 1)?));
            }
            let mut seqs: Vec<Decoding<'_, B>> = states
                .iter_mut()
                .zip(&firsts)
                .map(|(s, &f)| Decoding::new(s, f, DecodeOptions::greedy(GENERATE)))
                .collect();
            let t = Instant::now();
            let done = m.model.decode(&mut seqs, &mut |_, _| true)?;
            let seconds = t.elapsed().as_secs_f64();
            if run > 0 {
                runs.push(done.iter().sum::<usize>() as f64 / seconds);
            }
        }
        println!("  {b:>3} sequences at once: {:.1} tok/s", median(&runs));
        out.push(BatchCase {
            batch: b,
            decode_tok_s: median(&runs),
            decode_runs_tok_s: runs,
        });
    }
    Ok(out)
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn decode(a: DecodeArgs) -> Result<()> {
    if a.prompt == 0 || a.repeats == 0 {
        bail!("--prompt and --repeats must be positive");
    }
    let config = Config::from_file(&a.model.join("config.json"))
        .with_context(|| format!("reading {}", a.model.display()))?;
    let settings = settings(&a.model, &a.bits, &[4, 3, 2], &a.dense)?;
    let (device, copy_gb_s) = device_info(a.backend)?;
    let mut cases = Vec::new();
    let codecs = settings[0].dense_codecs(&a.dense);
    println!(
        "{} ({} layers) on {device}, prefill {} / decode {} tokens, batch 1, median of {}, \
         dense {}, LM head {}",
        a.model.display(),
        config.layers.len(),
        a.prompt,
        a.generate,
        a.repeats,
        codecs.dense,
        codecs.head
    );
    println!(
        "{:>6} {:>12} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>13} {:>14}",
        "bits",
        "prefill t/s",
        "decode t/s",
        "sampled t/s",
        "sync t/s",
        "eager t/s",
        "logits t/s",
        "floor t/s",
        "MB/token",
        "llama.cpp dec",
        "llama.cpp pre"
    );
    let expert_weights = 3 * config.hidden_size * config.moe.expert_intermediate;
    for setting in &settings {
        let codecs = setting.codecs(&a.dense);
        let mut timeline = None;
        // A backend per model, so that each precision's device weights go with it.
        let (runs, batches, eager, dense) = match a.backend {
            BackendKind::Cuda => {
                let (runs, batches, dense) = {
                    let m = crate::load(&a.model, cuda_backend()?, &codecs)?;
                    (
                        measure(&m, a.prompt, a.generate, a.repeats)?,
                        measure_batches(&m, &a.batch, a.repeats)?,
                        dense_bytes(&m),
                    )
                };
                // Once the first model has freed the device.
                let eager =
                    eager_runs(&a.model, &codecs, a.prompt, a.generate, a.repeats, &a.batch)?;
                (runs, batches, eager, dense)
            }
            other => {
                let m = crate::load(&a.model, other.cpu(), &codecs)?;
                let runs = measure(&m, a.prompt, a.generate, a.repeats)?;
                if a.timeline {
                    let t = crate::bench_timeline::cpu_timeline(&m, a.prompt, a.generate)?;
                    crate::bench_timeline::print(&setting.label(), &t);
                    timeline = Some(t);
                }
                (runs, measure_batches(&m, &a.batch, a.repeats)?, None, 4)
            }
        };
        let agree = runs.agree && eager.as_ref().is_none_or(|e| e.agree);
        let (pre, dec) = (runs.prefill, runs.greedy);
        let experts = setting.expert_bytes(&config, dense)?;
        let dense_codecs = setting.dense_codecs(&a.dense);
        let bytes = decode_bytes(&config, &experts, dense, dense_codecs)?;
        let floor = copy_gb_s.map(|bw| bw * 1e9 / bytes as f64);
        let expert_bits_per_weight = experts.iter().sum::<usize>() as f64 * 8.0
            / (experts.len() * expert_weights).max(1) as f64;
        let (bits, plan, ll) = match setting {
            // Measured on the GPU: nothing to say beside a CPU run.
            Setting::Affine(bits) => (
                *bits,
                None,
                matches!(a.backend, BackendKind::Cuda)
                    .then(|| llama_cpp(&config, *bits))
                    .flatten(),
            ),
            Setting::Plan(_) => (
                expert_bits_per_weight.round() as u32,
                Some(setting.label()),
                None,
            ),
        };
        let case = Case {
            bits,
            codecs: dense_codecs,
            plan,
            expert_bits_per_weight,
            prefill_tok_s: median(&pre),
            decode_tok_s: median(&dec),
            decode_sync_tok_s: median(&runs.sync),
            prefill_runs_tok_s: pre,
            decode_runs_tok_s: dec,
            decode_sync_runs_tok_s: runs.sync,
            decode_eager_tok_s: eager.map(|e| median(&e.greedy)),
            decode_logits_tok_s: median(&runs.logits),
            decode_sampled_tok_s: median(&runs.sampled),
            decode_sampled_runs_tok_s: runs.sampled,
            batches,
            decode_paths_agree: agree,
            decode_bytes_per_token: bytes,
            dense_bytes_per_weight: dense,
            decode_floor_tok_s: floor,
            llama_cpp_decode_tok_s: ll.map(|l| l.0),
            llama_cpp_prefill_tok_s: ll.map(|l| l.1),
            timeline,
        };
        let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
        let label = setting.label();
        if !case.decode_paths_agree {
            eprintln!("warning: greedy decode at {label} differs between the decode paths");
        }
        println!(
            "{label:>6} {:>12.0} {:>11.1} {:>11.1} {:>11.1} {:>11} {:>11.1} {:>11} {:>11.1} {:>13} {:>14}",
            case.prefill_tok_s,
            case.decode_tok_s,
            case.decode_sampled_tok_s,
            case.decode_sync_tok_s,
            case.decode_eager_tok_s
                .map_or("-".to_string(), |v| format!("{v:.1}")),
            case.decode_logits_tok_s,
            opt(floor),
            bytes as f64 / 1e6,
            opt(case.llama_cpp_decode_tok_s),
            opt(case.llama_cpp_prefill_tok_s)
        );
        cases.push(case);
    }
    let report = Report {
        model: a.model.clone(),
        backend: a
            .backend
            .to_possible_value()
            .map_or_else(String::new, |v| v.get_name().to_string()),
        device,
        layers: config.layers.len(),
        prompt: a.prompt,
        generate: a.generate,
        repeats: a.repeats,
        copy_gb_s,
        cases,
    };
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The decode runs again, the model at `dir` loaded on a backend with CUDA graphs off:
/// what recording the step buys. With the kernels built with `TIMELINE`, the timeline of
/// one sequence's decode and of each of `batches`' several.
#[cfg(feature = "cuda")]
fn eager_runs(
    dir: &Path,
    codecs: &Codecs,
    prompt: usize,
    generate: usize,
    repeats: usize,
    batches: &[usize],
) -> Result<Option<Runs>> {
    use dynmoe::backend::cuda::Tuning;
    let tuning = Tuning {
        graphs: false,
        ..Tuning::from_env()?
    };
    let m = crate::load(dir, dynmoe::backend::Cuda::with_tuning(0, tuning)?, codecs)?;
    let runs = measure(&m, prompt, generate, repeats)?;
    if m.model.backend().timeline_on() {
        print_timeline(&m, prompt, generate, 1)?;
        for &b in batches.iter().filter(|&&b| b > 1) {
            print_timeline(&m, prompt, generate, b)?;
        }
    }
    Ok(Some(runs))
}

/// With the kernels built with `TIMELINE`, one more eager decode of `sequences` at once,
/// each launch timed from its wait's return to the next one's: what each kernel adds to a
/// step, by kernel and the kernel before it (the same kernel plays several parts in a
/// layer). A gap the host leaves between two launches counts to the first.
#[cfg(feature = "cuda")]
fn print_timeline(
    m: &LoadedModel<dynmoe::backend::Cuda>,
    prompt: usize,
    generate: usize,
    sequences: usize,
) -> Result<()> {
    let b = m.model.backend();
    let ids = random_prompt(m, prompt);
    let mut states: Vec<_> = (0..sequences)
        .map(|_| m.model.new_state(prompt + generate))
        .collect();
    let mut firsts = Vec::new();
    for s in &mut states {
        firsts.push(argmax(&m.model.forward(s, &ids, prompt - 1)?));
    }
    let mut seqs: Vec<_> = states
        .iter_mut()
        .zip(firsts)
        .map(|(s, f)| Decoding::new(s, f, DecodeOptions::greedy(generate)))
        .collect();
    b.timeline_start()?;
    m.model.decode(&mut seqs, &mut |_, _| true)?;
    let marks = b.timeline_take()?;
    // The first token's launches run while the host is still queueing them.
    let skip = marks.len() / generate.max(1);
    let mut rows: Vec<(String, usize, f64)> = Vec::new();
    for w in marks[skip.min(marks.len())..].windows(2) {
        // The gap before w[1]'s wait returned is w[0]'s part of the chain.
        let key = format!("{} -> {}", w[0].0, w[1].0);
        let dt = w[1].1.saturating_sub(w[0].1) as f64 / 1e3;
        match rows.iter_mut().find(|r| r.0 == key) {
            Some(r) => {
                r.1 += 1;
                r.2 += dt;
            }
            None => rows.push((key, 1, dt)),
        }
    }
    let tokens = generate.saturating_sub(1).max(1) as f64;
    rows.sort_by(|a, b| b.2.total_cmp(&a.2));
    println!("timeline of {sequences} sequence(s) decoded together, a step:");
    println!(
        "{:<60} {:>8} {:>9} {:>10}",
        "kernel -> next", "a step", "us each", "us a step"
    );
    for (key, n, total) in &rows {
        println!(
            "{key:<60} {:>8.1} {:>9.2} {:>10.1}",
            *n as f64 / tokens,
            total / *n as f64,
            total / tokens
        );
    }
    let all: f64 = rows.iter().map(|r| r.2).sum();
    println!("{:<60} {:>8} {:>9} {:>10.1}", "all", "", "", all / tokens);
    if let Some(stamps) = b.phase_stamps()? {
        print_phases(&stamps);
    }
    Ok(())
}

/// With the kernels built with `PHASES`, the last routed gate/up and down launches block
/// by block: for each phase, when its blocks reached it (µs after the first gate/up
/// block's wait returned), as minimum, median, 90th percentile and maximum.
#[cfg(feature = "cuda")]
fn print_phases(stamps: &[Vec<[u64; dynmoe::backend::cuda::PHASE_SLOTS]>; 2]) {
    const NAMES: [&[&str]; 2] = [
        &[
            "entry",
            "waited",
            "routed",
            "loads out, x staged",
            "products summed",
            "h written",
        ],
        &[
            "entry",
            "waited",
            "h staged",
            "products summed",
            "out written",
        ],
    ];
    let Some(t0) = stamps[0].iter().map(|b| b[1]).filter(|&t| t > 0).min() else {
        return;
    };
    println!(
        "\n{:<36} {:>7} {:>8} {:>8} {:>8} {:>8}",
        "phase (us after gate/up's first wait)", "blocks", "min", "median", "p90", "max"
    );
    for (k, names) in NAMES.iter().enumerate() {
        let kernel = ["gate/up", "down"][k];
        for (p, name) in names.iter().enumerate() {
            let mut t: Vec<f64> = stamps[k]
                .iter()
                .filter(|b| b[p] > 0)
                .map(|b| (b[p] as f64 - t0 as f64) / 1e3)
                .collect();
            if t.is_empty() {
                continue;
            }
            t.sort_by(f64::total_cmp);
            let at = |q: f64| t[((t.len() - 1) as f64 * q).round() as usize];
            println!(
                "{:<36} {:>7} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                format!("{kernel}: {name}"),
                t.len(),
                t[0],
                at(0.5),
                at(0.9),
                t[t.len() - 1]
            );
        }
    }
}

/// Bytes a dense weight takes on the device. Checkpoints (synthetic ones too) are bf16,
/// so every dense matrix is bf16-exact and kept at 2 bytes.
#[cfg(feature = "cuda")]
fn dense_bytes(_: &LoadedModel<dynmoe::backend::Cuda>) -> usize {
    2
}

/// Without the feature the "CUDA" model is never made (see `cuda_backend`).
#[cfg(not(feature = "cuda"))]
fn dense_bytes<B: Backend>(_: &LoadedModel<B>) -> usize {
    4
}

/// Without the feature the "CUDA" model is never made (see `cuda_backend`).
#[cfg(not(feature = "cuda"))]
fn eager_runs(
    _: &Path,
    _: &Codecs,
    _: usize,
    _: usize,
    _: usize,
    _: &[usize],
) -> Result<Option<Runs>> {
    Ok(None)
}

/// The device's name and copy bandwidth (GB/s) for the report; on the CPU, the host's read
/// bandwidth.
#[cfg(feature = "cuda")]
fn device_info(backend: BackendKind) -> Result<(String, Option<f64>)> {
    match backend {
        BackendKind::Cuda => {
            let g = cuda_backend()?;
            Ok((g.device_name().to_string(), Some(g.copy_bandwidth())))
        }
        _ => Ok((
            dynmoe::testing::cpu_name(),
            Some(dynmoe::testing::host_read_gb_s()),
        )),
    }
}

/// The processor's name; `--backend cuda` fails here without the feature.
#[cfg(not(feature = "cuda"))]
fn device_info(backend: BackendKind) -> Result<(String, Option<f64>)> {
    if let BackendKind::Cuda = backend {
        cuda_backend()?;
    }
    Ok((
        dynmoe::testing::cpu_name(),
        Some(dynmoe::testing::host_read_gb_s()),
    ))
}

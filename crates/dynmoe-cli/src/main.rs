//! The `dynmoe` command line: parses arguments, calls the library, prints results.

/// Loads the model the arguments name on their backend and evaluates `$body` with it
/// bound to `$m`: the body is generic code instantiated once per backend type.
macro_rules! with_model {
    ($args:expr, |$m:pat_param| $body:expr) => {{
        dynmoe::checkpoint::set_finite_check(!$args.no_check_weights);
        match $args.backend {
            BackendKind::Cuda => {
                let $m = load(&$args.model, cuda_backend()?, &$args.expert_codecs())?;
                $body
            }
            other => {
                let $m = load(&$args.model, other.cpu(), &$args.expert_codecs())?;
                $body
            }
        }
    }};
}

mod bench;
mod bench_residency;
mod bench_timeline;
mod codecs;
mod compress;
mod demo;
mod progress;
mod quality;
mod residency;
mod serve;
mod store;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use dynmoe::backend::sample::Sampling;
use dynmoe::backend::{Backend, Cpu};
use dynmoe::codec::Codec;
use dynmoe::eval::{bits, inspect, ppl};
use dynmoe::model::{self, Codecs, ExpertBits, LoadedModel};
use dynmoe::runtime::generate;
use dynmoe::store::dense_vq::GroupCodecs;

/// Mixture-of-Experts models at 1.5-2 resident bits per weight, with a resident expert
/// set that follows the text.
#[derive(Parser)]
#[command(name = "dynmoe", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Run(RunArgs),
    /// Chat in the terminal: one message per line on stdin, replies streamed.
    Chat(serve::ChatArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Evaluate a model.
    #[command(subcommand)]
    Eval(EvalCommand),
    /// Show a model's architecture, parameters by kind and bytes by dtype.
    Inspect(InspectArgs),
    /// Run the pipeline on the bundled small model: load, generate, perplexity per
    /// domain, then convert it to expert stores and measure it at 4, 3 and 2 bits.
    Demo(demo::DemoArgs),
    /// Convert a Hugging Face checkpoint: experts to 4-bit records, the rest copied.
    Convert(store::ConvertArgs),
    /// Expert stores of a converted model.
    #[command(subcommand)]
    Store(store::StoreCommand),
    /// Spend a resident bit budget across the MoE layers (ISP) and write plan.json.
    Compress(compress::CompressArgs),
    /// Codebooks of the VQ codec ladder.
    #[command(subcommand)]
    Codebooks(codecs::CodebooksCommand),
    /// Write a checkpoint, or with --bits a converted directory, with a published
    /// model's shapes and random weights.
    Synth(bench::SynthArgs),
    /// Measurements: codecs, decode speed.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

#[derive(Subcommand)]
enum EvalCommand {
    /// Perplexity with llama.cpp's semantics (chunks of --ctx tokens, second half scored).
    Ppl(PplArgs),
    /// Routing hit rate and perplexity of static REAP sets calibrated on each domain,
    /// against dynamic sets, evaluated on every domain.
    Hitrate(residency::HitrateArgs),
}

/// Which implementation of the ops runs the model.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum BackendKind {
    /// Threaded CPU kernels.
    Cpu,
    /// Plain single-threaded f32 reference (the oracle; slow).
    Reference,
    /// The first CUDA GPU (needs a build with `--features cuda`).
    Cuda,
}

impl BackendKind {
    /// The CPU backend this names (the fast one for `cuda`, which callers handle first).
    fn cpu(self) -> Cpu {
        match self {
            BackendKind::Reference => Cpu::reference(),
            BackendKind::Cpu | BackendKind::Cuda => Cpu::fast(),
        }
    }
}

/// The first CUDA device.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_backend() -> Result<dynmoe::backend::Cuda> {
    Ok(dynmoe::backend::Cuda::new(0)?)
}

/// Without the feature there is no device type; the `Cpu` type only lets callers be
/// written once, as this never returns one.
#[cfg(not(feature = "cuda"))]
pub(crate) fn cuda_backend() -> Result<Cpu> {
    anyhow::bail!("this dynmoe was built without the `cuda` feature (cargo build --features cuda)")
}

#[derive(Args)]
pub(crate) struct ModelArgs {
    /// Model directory (Hugging Face layout: config.json, *.safetensors, tokenizer.json).
    #[arg(long, short)]
    model: PathBuf,
    /// Compute backend.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Bits of the routed experts of a converted model (4, 3 or 2; default 4).
    #[arg(long)]
    expert_bits: Option<u32>,
    /// Per-layer expert bits overriding --expert-bits, as LAYER=BITS pairs: `0=4,5=4`.
    #[arg(long, value_delimiter = ',', value_parser = parse_layer_bits)]
    expert_bits_layer: Vec<(usize, u32)>,
    /// Codec of the routed experts: q4, q3, q2 (a converted directory's stores) or a VQ
    /// rung such as vq1.5 (from the VQ store beside a checkpoint, encoded from its bf16
    /// experts on first use).
    #[arg(long, conflicts_with_all = ["expert_bits", "expert_bits_layer"])]
    codec: Option<Codec>,
    /// Per-layer codecs overriding --codec, as LAYER=CODEC pairs: `0=vq4,5=vq2`.
    #[arg(long, value_delimiter = ',', value_parser = parse_layer_codec,
          conflicts_with_all = ["expert_bits", "expert_bits_layer"])]
    codec_layer: Vec<(usize, Codec)>,
    #[command(flatten)]
    dense: DenseCodecArgs,
    /// Load weights without checking that every one is a finite number (the check is a
    /// parallel scan as the checkpoint is read; NaN or infinite weights are refused by
    /// default, naming the tensor).
    #[arg(long)]
    no_check_weights: bool,
}

/// The codecs of the dense linear layers and of an untied LM head.
#[derive(Args, Clone, Copy)]
pub(crate) struct DenseCodecArgs {
    /// Codec of the dense linear layers (attention projections, shared experts, dense
    /// MLPs): bf16; q4, q3 or q2 (MLX affine, quantized at load from the checkpoint or a
    /// converted directory); or a VQ rung such as vq3 (from `dense-vq3.safetensors` beside
    /// the checkpoint, encoded from its bf16 weights on first use). A compressed
    /// directory runs its plan's.
    #[arg(long)]
    pub(crate) dense_codec: Option<Codec>,
    /// Codec of an untied LM head: bf16, q4, q3, q2 or a VQ rung, coded like
    /// --dense-codec's layers.
    #[arg(long)]
    pub(crate) head_codec: Option<Codec>,
    /// Codec of the token embeddings (and of a head tied to them): bf16, q4, q3, q2 or a
    /// VQ rung, coded like --dense-codec's layers; a lookup decodes only its rows.
    #[arg(long)]
    pub(crate) embed_codec: Option<Codec>,
}

impl DenseCodecArgs {
    /// Whether any was given.
    pub(crate) fn is_set(&self) -> bool {
        self.dense_codec.is_some() || self.head_codec.is_some() || self.embed_codec.is_some()
    }

    /// `codecs` with these dense, head and embedding codecs.
    pub(crate) fn apply(&self, codecs: Codecs) -> Codecs {
        Codecs {
            dense: self.dense_codec,
            head: self.head_codec,
            embedding: self.embed_codec,
            ..codecs
        }
    }
}

impl ModelArgs {
    fn expert_codecs(&self) -> Codecs {
        self.dense
            .apply(if self.codec.is_some() || !self.codec_layer.is_empty() {
                Codecs {
                    default: self.codec,
                    per_layer: self.codec_layer.iter().copied().collect(),
                    ..Codecs::default()
                }
            } else {
                Codecs::from(&ExpertBits {
                    default: self.expert_bits,
                    per_layer: self.expert_bits_layer.iter().copied().collect(),
                })
            })
    }
}

fn parse_layer_codec(s: &str) -> Result<(usize, Codec), String> {
    let (layer, codec) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not LAYER=CODEC"))?;
    let layer = layer
        .trim()
        .parse()
        .map_err(|_| format!("{layer:?} is not a layer index"))?;
    Ok((layer, codec.parse().map_err(|e| format!("{e}"))?))
}

fn parse_layer_bits(s: &str) -> Result<(usize, u32), String> {
    let (layer, bits) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not LAYER=BITS"))?;
    let layer = layer
        .trim()
        .parse()
        .map_err(|_| format!("{layer:?} is not a layer index"))?;
    let bits = bits
        .trim()
        .parse()
        .map_err(|_| format!("{bits:?} is not a bit width"))?;
    Ok((layer, bits))
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt.
    #[arg(long, short)]
    prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long, default_value_t = 64)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    residency: residency::ResidencyArgs,
    /// Print a JSON report instead of streaming text.
    #[arg(long)]
    json: bool,
}

/// Sampler settings shared by `run` and `chat`.
#[derive(Args)]
pub(crate) struct SamplingArgs {
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the fewest most likely tokens whose probability reaches p (1: all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep tokens at least this fraction as likely as the most likely one (0: all).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Above 1, makes tokens the text already holds less likely (1: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Subtracted from the logit of every token the text already holds.
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Subtracted from a token's logit once per time the text already holds it.
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Sampler seed: the same seed, prompt and settings give the same text on every
    /// backend.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SamplingArgs {
    /// The settings, refused when out of range.
    pub(crate) fn checked(&self) -> Result<Sampling> {
        if self.temperature.is_nan() || self.temperature < 0.0 {
            anyhow::bail!("--temperature must be >= 0, got {}", self.temperature);
        }
        let s = Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
        };
        // The settings' own names, as flags.
        s.check()
            .map_err(|why| anyhow::anyhow!("--{}", why.replacen('_', "-", 2)))?;
        Ok(s)
    }
}

#[derive(Args)]
struct PplArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text file to score.
    #[arg(long)]
    text: PathBuf,
    /// Chunk length.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Score at most this many chunks.
    #[arg(long)]
    chunks: Option<usize>,
    /// Tokens per forward call within a chunk (default: the whole chunk, or 32 with a
    /// dynamic resident set so swaps take effect inside a chunk).
    #[arg(long)]
    micro_batch: Option<usize>,
    #[command(flatten)]
    residency: residency::ResidencyArgs,
    /// Run the checkpoint as this plan (`dynmoe compress`) configures it: per-layer
    /// codecs, and per layer as many resident experts as the plan keeps, starting from
    /// its choice and following the text (`--residency static` keeps them fixed).
    #[arg(long, conflicts_with_all = ["codec", "codec_layer", "expert_bits", "expert_bits_layer"])]
    plan: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct InspectArgs {
    /// Model directory.
    dir: PathBuf,
    /// Price the routed experts in this codec (bf16, q4, q3, q2, vq<bits>).
    #[arg(long, default_value = "bf16")]
    codec: Codec,
    /// Price the dense linear layers (attention, shared experts) in this codec.
    #[arg(long, default_value = "bf16")]
    dense_codec: Codec,
    /// Price an untied LM head in this codec.
    #[arg(long, default_value = "bf16")]
    head_codec: Codec,
    /// Price the token embeddings (and a head tied to them) in this codec.
    #[arg(long, default_value = "bf16")]
    embed_codec: Codec,
    /// Share of each MoE layer's experts kept resident; the rest is reservoir.
    #[arg(long, default_value_t = 1.0)]
    resident_fraction: f64,
    /// Also price the KV cache of one sequence of this many tokens.
    #[arg(long)]
    kv_context: Option<usize>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn main() {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Serve(_)) {
        // Rust ignores SIGPIPE, so a print to a closed pipe (`dynmoe run ... | head -c1`)
        // would panic. A command that only prints ends quietly instead, as `cat` does;
        // the server keeps ignoring it and sees closed connections as errors.
        // SAFETY: setting a signal's disposition to its default, before any thread runs.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // A server's models run on its scheduler thread, which joins a pool of its own.
    let result = dynmoe::backend::cpu::run_as_pool_thread(|| match cli.command {
        Command::Run(a) => cmd_run(a),
        Command::Chat(a) => serve::chat(a),
        Command::Serve(a) => serve::serve(a),
        Command::Eval(EvalCommand::Ppl(a)) => cmd_ppl(a),
        Command::Eval(EvalCommand::Hitrate(a)) => residency::cmd_hitrate(a),
        Command::Inspect(a) => cmd_inspect(a),
        Command::Demo(a) => demo::run(a),
        Command::Convert(a) => store::convert(a),
        Command::Store(c) => store::store(c),
        Command::Compress(a) => compress::compress(a),
        Command::Codebooks(c) => codecs::codebooks(c),
        Command::Synth(a) => bench::synth(a),
        Command::Bench(c) => bench::bench(c),
    });
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Loads a model directory onto a backend, with a spinner while it loads (and builds any
/// expert store the requested precision needs).
pub(crate) fn load<B: Backend>(dir: &Path, backend: B, codecs: &Codecs) -> Result<LoadedModel<B>> {
    let spinner = progress::spinner(&format!("loading {}", dir.display()));
    let bar = VqBuildBar::default();
    let m = model::load_with_progress(dir, backend, codecs, &mut |d, t| bar.update(&spinner, d, t))
        .with_context(|| format!("loading model {}", dir.display()))?;
    bar.finish();
    spinner.finish_and_clear();
    Ok(m)
}

/// The bar of a VQ expert store being built during a load, shown (in place of the
/// loading spinner) only once a build starts.
#[derive(Default)]
pub(crate) struct VqBuildBar(std::cell::OnceCell<indicatif::ProgressBar>);

impl VqBuildBar {
    fn update(&self, spinner: &indicatif::ProgressBar, done: usize, total: usize) {
        let bar = self.0.get_or_init(|| {
            spinner.finish_and_clear();
            progress::bar("VQ experts")
        });
        progress::update(bar, done, total);
    }

    fn finish(&self) {
        if let Some(bar) = self.0.get() {
            bar.finish_and_clear();
        }
    }
}

pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn cmd_run(a: RunArgs) -> Result<()> {
    let sampling = a.sampling.checked()?;
    with_model!(a.model, |m| run_on(m, &a, sampling))
}

fn run_on<B: Backend>(mut m: LoadedModel<B>, a: &RunArgs, sampling: Sampling) -> Result<()> {
    a.residency.install(&mut m)?;
    let json = a.json;
    let mut print = |piece: &str| {
        if !json {
            use std::io::Write;
            print!("{piece}");
            let _ = std::io::stdout().flush();
        }
    };
    if !json {
        print!("{}", a.prompt);
    }
    let g = generate::generate(&m, &a.prompt, a.max_tokens, sampling, &mut print)?;
    let report = m.model.residency().map(|r| r.report());
    if json {
        let mut v = serde_json::to_value(&g)?;
        if let Some(r) = &report {
            v["residency"] = serde_json::to_value(r)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!();
        if g.stopped_at_context {
            eprintln!(
                "[stopped at the model's context of {} tokens (max_position_embeddings)]",
                m.model.config.max_position_embeddings
            );
        }
        eprintln!(
            "[{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s]",
            g.prompt_tokens,
            g.prefill_tokens_per_second,
            g.tokens.len(),
            g.decode_tokens_per_second
        );
        if let Some(r) = &report {
            print_residency(r);
        }
    }
    Ok(())
}

fn print_residency(r: &dynmoe::residency::ResidencyReport) {
    eprintln!(
        "[{:?} residency, {} of {} experts per layer (+{} spare slots), reservoir {:?}: hit rate {:.1}% (ceiling {:.1}%), {} swaps, {} bytes moved ({:.0} per 1000 tokens, {:.0} MB/s read), {} stalls, {} late boundaries]",
        r.mode,
        r.resident_per_layer,
        r.experts_per_layer,
        r.spare_slots_per_layer,
        r.reservoir,
        100.0 * r.hit_rate,
        100.0 * r.oracle_hit_rate,
        r.counters.swaps,
        r.counters.bytes_moved,
        r.bytes_moved_per_1000_tokens,
        r.read_bandwidth_mb_s,
        r.counters.stalls,
        r.counters.late_boundaries
    );
}

fn cmd_ppl(a: PplArgs) -> Result<()> {
    let text = read_text(&a.text)?;
    if let Some(path) = &a.plan {
        let plan = dynmoe::store::plan::Plan::load(path)?;
        let spinner = progress::spinner(&format!("loading {}", a.model.model.display()));
        let bar = VqBuildBar::default();
        let mut m = dynmoe::alloc::probe::load_plan(&a.model.model, &plan, &mut |d, t| {
            bar.update(&spinner, d, t)
        })
        .with_context(|| format!("loading {} as {}", a.model.model.display(), path.display()))?;
        bar.finish();
        spinner.finish_and_clear();
        let config = a.residency.install_plan(&mut m, &plan)?;
        return ppl_on(m, &a, &text, Some(config));
    }
    with_model!(a.model, |mut m| {
        let config = a.residency.install(&mut m)?;
        ppl_on(m, &a, &text, config)
    })
}

fn ppl_on<B: Backend>(
    m: LoadedModel<B>,
    a: &PplArgs,
    text: &str,
    resident: Option<dynmoe::residency::ResidencyConfig>,
) -> Result<()> {
    let dynamic = resident.is_some_and(|c| c.mode == dynmoe::residency::Mode::Dynamic);
    let micro_batch = a.micro_batch.or(dynamic.then_some(32));
    let bar = progress::bar("perplexity");
    let report = ppl::perplexity(
        &m,
        text,
        ppl::PplOptions {
            ctx: a.ctx,
            max_chunks: a.chunks,
            micro_batch,
        },
        &mut |done, total| progress::update(&bar, done, total),
    )
    .with_context(|| format!("perplexity of {}", a.text.display()))?;
    bar.finish_and_clear();
    let res = m.model.residency().map(|r| r.report());
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        if let Some(r) = &res {
            v["residency"] = serde_json::to_value(r)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "PPL = {:.4} +/- {:.5}  ({} tokens scored in {} chunks of {}; {:.0} tok/s)",
            report.ppl,
            report.ppl_stderr,
            report.tokens_scored,
            report.chunks,
            report.ctx,
            report.tokens_per_second
        );
        if let Some(r) = &res {
            print_residency(r);
        }
    }
    Ok(())
}

fn cmd_inspect(a: InspectArgs) -> Result<()> {
    let inv =
        inspect::inspect_dir(&a.dir).with_context(|| format!("inspecting {}", a.dir.display()))?;
    if !(a.resident_fraction > 0.0 && a.resident_fraction <= 1.0) {
        anyhow::bail!(
            "--resident-fraction must be in (0, 1], got {}",
            a.resident_fraction
        );
    }
    if dynmoe::store::compressed::is_compressed(&a.dir) {
        return inspect_compressed(&a, &inv);
    }
    let config = dynmoe::checkpoint::Config::from_file(&a.dir.join("config.json"))?;
    let ckpt = dynmoe::checkpoint::Checkpoint::open(&a.dir)?;
    let e = config.moe.num_experts;
    let resident =
        ((e as f64 * a.resident_fraction).round() as usize).clamp(config.moe.top_k.min(e), e);
    let assignment = bits::Assignment {
        tensors: GroupCodecs::uniform(a.dense_codec, a.head_codec, a.embed_codec),
        layers: config
            .moe_layers()
            .map(|l| (l, (a.codec, resident)))
            .collect(),
        default_experts: a.codec,
    };
    let priced = bits::account(&config, &ckpt, &assignment, a.kv_context)?;
    if a.json {
        let mut v = serde_json::to_value(&inv)?;
        v["bits"] = serde_json::to_value(&priced)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{}: {} layers ({} MoE), {} experts per layer, top-{}",
        inv.arch, inv.layers, inv.moe_layers, inv.experts_per_layer, inv.top_k
    );
    println!("{:<16} {:>14} {:>7}", "kind", "parameters", "share");
    for (kind, n) in &inv.params_by_kind {
        let name = serde_json::to_value(kind)?
            .as_str()
            .unwrap_or("?")
            .to_string();
        println!(
            "{:<16} {:>14} {:>6.1}%",
            name,
            n,
            100.0 * *n as f64 / inv.params_total as f64
        );
    }
    println!("{:<16} {:>14}", "total", inv.params_total);
    println!("{:<16} {:>14}", "per expert", inv.params_per_expert);
    println!("{:<16} {:>14}", "active/token", inv.params_active_per_token);
    for (dtype, bytes) in &inv.bytes_by_dtype {
        println!("bytes {dtype:<10} {bytes:>14}");
    }
    println!("{:<16} {:>14}", "file bytes", inv.file_bytes);
    match inv.expanded_kv_bytes_per_position {
        Some(expanded) => println!(
            "KV cache: {} bytes per position of context (latent; {expanded} with each head's key and value expanded)",
            inv.kv_cache_bytes_per_position
        ),
        None => println!(
            "KV cache: {} bytes per position of context",
            inv.kv_cache_bytes_per_position
        ),
    }
    for st in &inv.expert_stores {
        println!(
            "{:<16} {:>14} bytes, {}-bit codes, {:.3} bits per expert weight",
            st.file, st.bytes, st.bits, st.bits_per_weight
        );
    }
    println!(
        "\nexperts {}, dense {}, LM head {}, {resident} of {e} experts resident per MoE layer:",
        a.codec, a.dense_codec, a.head_codec
    );
    println!(
        "{:<6} {:>12} {:>14} {:>14} {:>12}",
        "layer", "expert B", "resident B", "reservoir B", "dense B"
    );
    for l in &priced.layers {
        println!(
            "{:<6} {:>12} {:>14} {:>14} {:>12}",
            l.layer, l.expert_bytes, l.resident_bytes, l.reservoir_bytes, l.dense_bytes
        );
    }
    for (kind, bytes) in &priced.resident_by_kind {
        let name = serde_json::to_value(kind)?
            .as_str()
            .unwrap_or("?")
            .to_string();
        println!("resident {name:<16} {bytes:>14}");
    }
    println!("resident {:<16} {:>14}", "codebooks", priced.codebook_bytes);
    if let Some(kv) = priced.kv_cache_bytes {
        println!("KV cache {:<16} {kv:>14}", "(f32)");
    }
    println!(
        "resident {} bytes = {:.3} bits per weight; reservoir {} bytes; stored {:.3} bits per weight",
        priced.resident_bytes,
        priced.resident_bits_per_weight,
        priced.reservoir_bytes,
        priced.stored_bits_per_weight
    );
    Ok(())
}

/// A compressed directory is reported as it is stored, not priced under the codec flags
/// (which would count its bf16 leftovers as the whole model).
fn inspect_compressed(a: &InspectArgs, inv: &inspect::Inventory) -> Result<()> {
    let report = dynmoe::eval::compressed_bits::compressed_bits(&a.dir)
        .with_context(|| format!("reading the compressed model {}", a.dir.display()))?;
    if a.json {
        let mut v = serde_json::to_value(inv)?;
        v["bits"] = serde_json::to_value(&report)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{}: compressed, {} layers ({} MoE), {} experts per layer, top-{}",
        inv.arch, inv.layers, inv.moe_layers, inv.experts_per_layer, inv.top_k
    );
    println!(
        "{:<24} {:>14} {:>14} {:>10} {:>14} {:>10}",
        "group", "parameters", "resident B", "bits", "disk B", "bits"
    );
    let row = |name: &str, g: &dynmoe::eval::compressed_bits::GroupBits| {
        println!(
            "{:<24} {:>14} {:>14} {:>10.3} {:>14} {:>10.3}",
            name, g.params, g.resident_bytes, g.resident_bits, g.disk_bytes, g.disk_bits
        )
    };
    for (group, g) in &report.groups {
        let name = serde_json::to_value(group)?
            .as_str()
            .unwrap_or("?")
            .to_string();
        row(&name, g);
    }
    row("whole model", &report.total);
    println!(
        "{:<24} {:>14} {:>14}   (resident once each, not in the model's bits)",
        "codebooks", "", report.codebook_bytes
    );
    Ok(())
}

//! The resident-set flags every running command shares (`run`, `eval ppl`,
//! `eval hitrate`, and later `chat` and `serve`), and `eval hitrate` itself.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use dynmoe::backend::Backend;
use dynmoe::codec::Codec;
use dynmoe::eval::hitrate::{self, Domain, HitrateOptions, HitrateReport};
use dynmoe::eval::ppl::PplOptions;
use dynmoe::model::LoadedModel;
use dynmoe::residency::{Mode, PolicyParams, ReservoirKind, ResidencyConfig, ResidentCount};
use dynmoe::runtime::residency::{ResidencyRequest, SetupError};
use dynmoe::store::plan::Plan;

use crate::{cuda_backend, load, progress, read_text, BackendKind, ModelArgs};

/// Whether the resident set follows the text.
#[derive(Clone, Copy, ValueEnum)]
pub enum ModeArg {
    /// Dynamic REAP: swaps at checkpoints.
    Dynamic,
    /// A fixed set: the K most salient experts of --calib.
    Static,
}

/// Where non-resident experts live.
#[derive(Clone, Copy, ValueEnum)]
pub enum ReservoirArg {
    /// A copy in host memory.
    Ram,
    /// The model's own files (checkpoint shard or expert store), read with pread.
    Disk,
}

/// Resident expert sets. Without --resident-fraction/--resident-count (or at 1.0)
/// every expert runs and nothing else here applies.
#[derive(Args, Clone)]
pub struct ResidencyArgs {
    /// Share of each MoE layer's experts kept resident, in (0, 1].
    #[arg(long)]
    pub resident_fraction: Option<f32>,
    /// Resident experts per MoE layer (instead of --resident-fraction).
    #[arg(long, conflicts_with = "resident_fraction")]
    pub resident_count: Option<usize>,
    /// Follow the text (dynamic REAP) or keep a fixed set.
    #[arg(long, value_enum, default_value = "dynamic")]
    pub residency: ModeArg,
    /// Where non-resident experts live.
    #[arg(long, value_enum, default_value = "ram")]
    pub reservoir: ReservoirArg,
    /// Routed tokens between swap checkpoints.
    #[arg(long, default_value_t = 256)]
    pub swap_interval: usize,
    /// Exchanges per checkpoint (and the fewest qualifying pairs for any to happen).
    #[arg(long, default_value_t = 4)]
    pub max_swaps: usize,
    /// Relative margin an incoming expert's rank must beat the outgoing one's by.
    #[arg(long, default_value_t = 0.05)]
    pub swap_margin: f32,
    /// Half-lives of the two routing averages, in tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [100.0, 1000.0])]
    pub half_lives: Vec<f32>,
    /// Threads reading incoming experts from the reservoir.
    #[arg(long, default_value_t = 2)]
    pub loader_threads: usize,
    /// Also hold every expert of a layer that keeps only some resident at this VQ rung
    /// (e.g. vq1), so that a token routed outside the set runs the expert's shadow
    /// instead of being confined to the residents. Routing then runs on the host.
    #[arg(long)]
    pub shadow: Option<Codec>,
    /// Calibration text for REAP saliency: the static set, and where a dynamic set
    /// starts (without it a dynamic set starts from the lowest expert ids).
    #[arg(long)]
    pub calib: Option<PathBuf>,
    /// Calibration chunks of 512 tokens.
    #[arg(long, default_value_t = 8)]
    pub calib_chunks: usize,
}

impl ResidencyArgs {
    /// The request these flags make, without the calibration text (which `install`
    /// reads).
    fn request(&self) -> Result<ResidencyRequest> {
        if self.half_lives.len() != 2 {
            bail!("--half-lives takes two values, got {:?}", self.half_lives);
        }
        Ok(ResidencyRequest {
            resident: match (self.resident_fraction, self.resident_count) {
                (Some(f), _) => Some(ResidentCount::Fraction(f)),
                (None, Some(k)) => Some(ResidentCount::Count(k)),
                (None, None) => None,
            },
            config: ResidencyConfig {
                mode: match self.residency {
                    ModeArg::Dynamic => Mode::Dynamic,
                    ModeArg::Static => Mode::Static,
                },
                reservoir: match self.reservoir {
                    ReservoirArg::Ram => ReservoirKind::Ram,
                    ReservoirArg::Disk => ReservoirKind::Disk,
                },
                policy: PolicyParams {
                    interval: self.swap_interval,
                    max_swaps: self.max_swaps,
                    margin: self.swap_margin,
                    half_lives: [self.half_lives[0], self.half_lives[1]],
                },
                loader_threads: self.loader_threads,
                shadow: match self.shadow {
                    None => None,
                    Some(c) => Some(c.rung()?.ok_or_else(|| {
                        anyhow!("--shadow takes a rung of the VQ ladder (vq0.7 … vq5), not {c}")
                    })?),
                },
                ..ResidencyConfig::default()
            },
            calib: None,
        })
    }

    /// The request with the calibration text read.
    fn request_with_calib(&self) -> Result<ResidencyRequest> {
        let mut request = self.request()?;
        if let Some(path) = &self.calib {
            request.calib = Some((read_text(path)?, self.calib_chunks));
        }
        Ok(request)
    }

    /// The configuration, or `None` when every expert stays resident.
    pub fn config(&self) -> Result<Option<ResidencyConfig>> {
        self.request()?.config().map_err(flags)
    }

    /// Installs the resident sets of `plan` on `m` (loaded by `load_plan`).
    pub fn install_plan<B: Backend>(
        &self,
        m: &mut LoadedModel<B>,
        plan: &Plan,
    ) -> Result<ResidencyConfig> {
        self.request_with_calib()?
            .install_plan(m, plan)
            .map_err(flags)
    }

    /// Installs the resident sets these flags ask for on `m` (a compressed model's
    /// plan's unless --resident-fraction or --resident-count say otherwise); returns
    /// their configuration, if any.
    pub fn install<B: Backend>(&self, m: &mut LoadedModel<B>) -> Result<Option<ResidencyConfig>> {
        let request = self.request_with_calib()?;
        let Some(path) = &self.calib else {
            return request.install(m, &mut |_, _| {}).map_err(flags);
        };
        let bar = progress::bar("REAP saliency");
        let config = request
            .install(m, &mut |d, t| progress::update(&bar, d, t))
            .map_err(flags)
            .with_context(|| format!("calibrating on {}", path.display()))?;
        bar.finish_and_clear();
        Ok(config)
    }
}

/// A set-up error in the words of these flags.
fn flags(e: SetupError) -> anyhow::Error {
    match e {
        SetupError::StaticWithoutCalibration => {
            anyhow!("--residency static needs --calib TEXT to choose its experts")
        }
        SetupError::PlanSetsResidency => anyhow!(
            "a plan sets each layer's resident experts; drop --resident-fraction, \
             --resident-count and --calib"
        ),
        SetupError::SwapMargin(m) => anyhow!("--swap-margin must be >= 0, got {m}"),
        other => other.into(),
    }
}

/// `eval hitrate` arguments.
#[derive(Args)]
pub struct HitrateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Test texts, one per domain, comma-separated (a domain is named after the file's
    /// directory, or the file when that is ambiguous).
    #[arg(long, value_delimiter = ',', required = true)]
    domains: Vec<PathBuf>,
    /// Calibration texts in the same order (default: the test texts themselves).
    #[arg(long, value_delimiter = ',')]
    calib_texts: Vec<PathBuf>,
    #[command(flatten)]
    residency: ResidencyArgs,
    /// Chunk length.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Test chunks per domain (default: all).
    #[arg(long)]
    chunks: Option<usize>,
    /// Tokens per forward call in the dynamic runs.
    #[arg(long, default_value_t = 32)]
    micro_batch: usize,
    /// Also write the JSON report here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn domain_names(paths: &[PathBuf]) -> Vec<String> {
    let by_dir: Vec<String> = paths
        .iter()
        .map(|p| {
            p.parent()
                .and_then(|d| d.file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .collect();
    let unique = by_dir.iter().all(|n| !n.is_empty())
        && by_dir
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len()
            == by_dir.len();
    if unique {
        return by_dir;
    }
    paths.iter().map(|p| p.display().to_string()).collect()
}

/// `dynmoe eval hitrate`.
pub fn cmd_hitrate(a: HitrateArgs) -> Result<()> {
    let Some(config) = a.residency.config()? else {
        bail!("eval hitrate needs --resident-fraction below 1 or --resident-count");
    };
    if !a.calib_texts.is_empty() && a.calib_texts.len() != a.domains.len() {
        bail!(
            "--calib-texts names {} files for {} --domains",
            a.calib_texts.len(),
            a.domains.len()
        );
    }
    let names = domain_names(&a.domains);
    let mut domains = Vec::new();
    for (i, (name, test)) in names.iter().zip(&a.domains).enumerate() {
        let calib = a.calib_texts.get(i).unwrap_or(test);
        domains.push(Domain {
            name: name.clone(),
            calib: read_text(calib)?,
            test: read_text(test)?,
        });
    }
    let opts = HitrateOptions {
        residency: config,
        ppl: PplOptions {
            ctx: a.ctx,
            max_chunks: a.chunks,
            micro_batch: Some(a.micro_batch),
        },
        calib_chunks: Some(a.residency.calib_chunks),
    };
    let bar = progress::bar("hit rate");
    let mut progress = |d: usize, t: usize, what: &str| {
        progress::update(&bar, d - 1, t);
        bar.set_message(what.to_string());
    };
    let report = with_model!(a.model, |mut m| hitrate::hitrate_grid(
        &mut m,
        &domains,
        opts,
        &mut progress
    )?);
    bar.finish_and_clear();
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(out) = &a.out {
        dynmoe::store::atomic::write_file(out, json.as_bytes())
            .with_context(|| format!("writing {}", out.display()))?;
    }
    if a.json {
        println!("{json}");
    } else {
        print_grid(&report);
    }
    Ok(())
}

/// One table of the grid: a header of test domains, then a row per calibration domain
/// with `cell` of each pair.
fn print_table(names: &[&str], cells: &[hitrate::Cell], cell: impl Fn(&hitrate::Cell) -> String) {
    print!("{:<8}", "");
    names.iter().for_each(|n| print!("{n:>16}"));
    println!();
    for row in cells.chunks(names.len()) {
        print!("{:<8}", row[0].calib);
        row.iter().for_each(|c| print!("{:>16}", cell(c)));
        println!();
    }
}

/// The grid as tables: rows are calibration domains, columns test domains.
pub fn print_grid(r: &HitrateReport) {
    let names: Vec<&str> = r
        .cells
        .iter()
        .map(|c| c.test.as_str())
        .take(r.full_ppl.len())
        .collect();
    println!(
        "hit rate, static / dynamic, {} of {} experts resident (rows: calibrated on, columns: evaluated on)",
        r.resident_per_layer, r.experts_per_layer
    );
    print_table(&names, &r.cells, |c| {
        format!(
            "{:.1}/{:.1}",
            100.0 * c.static_.hit_rate,
            100.0 * c.dynamic.hit_rate
        )
    });
    println!("perplexity, static / dynamic (full model in the last row)");
    print_table(&names, &r.cells, |c| {
        format!("{:.2}/{:.2}", c.static_.ppl, c.dynamic.ppl)
    });
    print!("{:<8}", "full");
    names
        .iter()
        .for_each(|n| print!("{:>16}", format!("{:.2}", r.full_ppl[*n])));
    println!();
    print!("{:<8}", "ceiling");
    for c in r.cells.iter().take(names.len()) {
        print!(
            "{:>16}",
            format!("{:.1}", 100.0 * c.static_.oracle_hit_rate)
        );
    }
    println!("   (each token's own best K experts; no set of K does better)");
    let swaps: u64 = r.cells.iter().map(|c| c.dynamic.swaps).sum();
    let bytes: u64 = r.cells.iter().map(|c| c.dynamic.bytes_moved).sum();
    let tokens: u64 = r.cells.iter().map(|c| c.dynamic.tokens).sum();
    let stalls: u64 = r.cells.iter().map(|c| c.dynamic.stalls).sum();
    println!(
        "dynamic: {swaps} swaps, {bytes} bytes moved ({:.0} per 1000 tokens), {stalls} stalls, over {tokens} tokens; {:.0} s",
        bytes as f64 * 1000.0 / tokens.max(1) as f64,
        r.seconds
    );
}

//! The hit-rate grid (docs/ARCHITECTURE.md, Residency): a static REAP set calibrated on each domain,
//! evaluated on every domain, against a dynamic set that starts from the same
//! calibration and follows the text. Hit rate is the share of the unmasked routing
//! probability that lands on resident experts; perplexity is reported for both.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

use super::ppl::{perplexity, PplError, PplOptions};
use crate::backend::Backend;
use crate::calib::reap_saliency;
use crate::model::LoadedModel;
use crate::residency::{self, Mode, ResidencyConfig, ResidencyReport};

/// One domain: a calibration text and a test text.
#[derive(Debug, Clone)]
pub struct Domain {
    /// Short name (`en`, `code`, ...).
    pub name: String,
    /// Text the static set is calibrated on.
    pub calib: String,
    /// Text hit rate and perplexity are measured on.
    pub test: String,
}

/// Options of a grid run.
#[derive(Debug, Clone, Copy)]
pub struct HitrateOptions {
    /// Residency of every run; its `mode` is ignored (both are run).
    pub residency: ResidencyConfig,
    /// Perplexity chunking of the test texts (`micro_batch` applies to dynamic runs).
    pub ppl: PplOptions,
    /// Calibration chunks (of `ppl.ctx` tokens) per domain.
    pub calib_chunks: Option<usize>,
}

/// One run: a set calibrated on `calib`, measured on `test`.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// Hit rate over every routed token and MoE layer.
    pub hit_rate: f64,
    /// Per MoE layer.
    pub hit_rate_per_layer: BTreeMap<usize, f64>,
    /// Probability on each token's own K best experts: the ceiling of any set.
    pub oracle_hit_rate: f64,
    /// Perplexity on the test text.
    pub ppl: f64,
    /// Its standard error.
    pub ppl_stderr: f64,
    /// Exchanges committed.
    pub swaps: u64,
    /// Bytes read from the reservoir for them.
    pub bytes_moved: u64,
    /// Loads in flight at the following checkpoint.
    pub stalls: u64,
    /// Token boundaries served by an outgoing expert while its successor loaded.
    pub late_boundaries: u64,
    /// Tokens routed.
    pub tokens: u64,
}

impl Run {
    fn new(r: &ResidencyReport, ppl: f64, ppl_stderr: f64) -> Run {
        Run {
            hit_rate: r.hit_rate,
            hit_rate_per_layer: r.hit_rate_per_layer.clone(),
            oracle_hit_rate: r.oracle_hit_rate,
            ppl,
            ppl_stderr,
            swaps: r.counters.swaps,
            bytes_moved: r.counters.bytes_moved,
            stalls: r.counters.stalls,
            late_boundaries: r.counters.late_boundaries,
            tokens: r.counters.tokens,
        }
    }
}

/// One cell of the grid.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// Calibration domain.
    pub calib: String,
    /// Test domain.
    pub test: String,
    /// The static REAP set.
    #[serde(rename = "static")]
    pub static_: Run,
    /// The dynamic set.
    pub dynamic: Run,
}

/// The whole grid.
#[derive(Debug, Clone, Serialize)]
pub struct HitrateReport {
    /// Experts per MoE layer.
    pub experts_per_layer: usize,
    /// Resident experts per MoE layer.
    pub resident_per_layer: usize,
    /// Spare slots per MoE layer of the dynamic runs.
    pub spare_slots_per_layer: usize,
    /// The rung of the shadows every expert outside a set ran at, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow: Option<String>,
    /// Bytes the shadows held, over all layers (0 without).
    pub shadow_bytes: usize,
    /// Where the dynamic runs' reservoir was.
    pub reservoir: residency::ReservoirKind,
    /// The policy of the dynamic runs.
    pub policy: residency::PolicyParams,
    /// Chunk length of the test texts.
    pub ctx: usize,
    /// Chunks per test text (`None`: all).
    pub chunks: Option<usize>,
    /// Forward call length of the dynamic runs.
    pub micro_batch: Option<usize>,
    /// Calibration chunks per domain.
    pub calib_chunks: Option<usize>,
    /// Perplexity of the full model (every expert) on each test text.
    pub full_ppl: BTreeMap<String, f64>,
    /// Calibration × test, row-major in the order the domains were given.
    pub cells: Vec<Cell>,
    /// Wall time, seconds.
    pub seconds: f64,
}

/// Why a grid could not be run.
#[derive(Debug, thiserror::Error)]
pub enum HitrateError {
    /// Perplexity failed.
    #[error("{domain}: {source}")]
    Ppl {
        /// The domain.
        domain: String,
        /// Why.
        source: PplError,
    },
    /// Calibration failed.
    #[error("{domain}: calibration: {source}")]
    Calib {
        /// The domain.
        domain: String,
        /// Why.
        source: crate::model::Error,
    },
    /// Residency could not be set up.
    #[error(transparent)]
    Residency(#[from] residency::Error),
}

/// Runs the grid on `m` (whose resident set, if any, is replaced and removed at the
/// end). `progress(step, steps, what)` is called before each run.
pub fn hitrate_grid<B: Backend>(
    m: &mut LoadedModel<B>,
    domains: &[Domain],
    opts: HitrateOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<HitrateReport, HitrateError> {
    let start = std::time::Instant::now();
    m.model.set_residency(None);
    let n = domains.len();
    let steps = n + n + 2 * n * n;
    let mut step = 0;
    let mut tick = |what: String| {
        step += 1;
        progress(step, steps, &what);
    };
    let ppl_err = |d: &Domain| {
        let domain = d.name.clone();
        move |source| HitrateError::Ppl { domain, source }
    };

    let mut full_ppl = BTreeMap::new();
    let mut rankings = Vec::with_capacity(n);
    for d in domains {
        tick(format!("full model on {}", d.name));
        let r = perplexity(
            m,
            &d.test,
            PplOptions {
                micro_batch: None,
                ..opts.ppl
            },
            &mut |_, _| {},
        )
        .map_err(ppl_err(d))?;
        full_ppl.insert(d.name.clone(), r.ppl);
        tick(format!("REAP saliency on {}", d.name));
        let s = reap_saliency(m, &d.calib, opts.ppl.ctx, opts.calib_chunks, &mut |_, _| {})
            .map_err(|source| HitrateError::Calib {
                domain: d.name.clone(),
                source,
            })?;
        rankings.push(s.ranking());
    }

    let reservoir = m.model.reservoir(opts.residency.reservoir)?;
    let mut cells = Vec::with_capacity(n * n);
    let (mut k, mut spare, mut shadow_bytes) = (0, 0, 0);
    for (a, ranking) in domains.iter().zip(&rankings) {
        for b in domains {
            let mut runs = Vec::with_capacity(2);
            for mode in [Mode::Static, Mode::Dynamic] {
                tick(format!("{mode:?} {} -> {}", a.name, b.name));
                let config = ResidencyConfig {
                    mode,
                    ..opts.residency
                };
                let res = m
                    .model
                    .new_residency(Arc::clone(&reservoir), config, ranking)?;
                m.model.set_residency(Some(res));
                let ppl_opts = PplOptions {
                    micro_batch: (mode == Mode::Dynamic)
                        .then_some(opts.ppl.micro_batch)
                        .flatten(),
                    ..opts.ppl
                };
                let r = perplexity(m, &b.test, ppl_opts, &mut |_, _| {}).map_err(ppl_err(b));
                let res = m.model.set_residency(None).expect("installed above");
                let r = r?;
                let report = res.report();
                k = report.resident_per_layer;
                shadow_bytes = report.shadow_bytes;
                if mode == Mode::Dynamic {
                    spare = report.spare_slots_per_layer;
                }
                runs.push(Run::new(&report, r.ppl, r.ppl_stderr));
            }
            let dynamic = runs.pop().expect("two runs");
            let static_ = runs.pop().expect("two runs");
            cells.push(Cell {
                calib: a.name.clone(),
                test: b.name.clone(),
                static_,
                dynamic,
            });
        }
    }
    Ok(HitrateReport {
        experts_per_layer: m.model.config.moe.num_experts,
        resident_per_layer: k,
        spare_slots_per_layer: spare,
        shadow: opts.residency.shadow.map(|r| r.name()),
        shadow_bytes,
        reservoir: opts.residency.reservoir,
        policy: opts.residency.policy,
        ctx: opts.ppl.ctx,
        chunks: opts.ppl.max_chunks,
        micro_batch: opts.ppl.micro_batch,
        calib_chunks: opts.calib_chunks,
        full_ppl,
        cells,
        seconds: start.elapsed().as_secs_f64(),
    })
}

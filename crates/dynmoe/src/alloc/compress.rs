//! `dynmoe compress`: probe a checkpoint, spend a resident byte budget across its MoE
//! layers by ISP, and write the plan (docs/ARCHITECTURE.md, Allocation).
//!
//! Candidates per layer are bf16 and every rung of the VQ ladder, times a ladder of
//! removal levels (eighths of the experts, never fewer than top-k resident). The VQ
//! rungs' codebooks are constants of the program, outside every budget. Codec probes
//! run at the 0.7-, 1.5- and 4-bit rungs (the middle one lets the cost curve bend);
//! removal probes at 25%, 50% and the most top-k allows (at most 95%). Every probe is
//! journalled in the output directory, so an interrupted run resumes where it stopped.

use std::path::Path;

use serde::Serialize;

use super::cache::{CacheError, CachedProber};
use super::isp::{isp, CodecOption, IspError, Problem, Round, Setting, Unit};
use crate::alloc::probe::{resident_count, ModelProber, ProbeUnit};
use crate::checkpoint::arch::{CodedGroup, TensorKind};
use crate::codec::affine::AffineMatrix;
use crate::codec::vq::{codebook, VqMatrix, LADDER};
use crate::codec::{Codec, CodecError};
use crate::eval::bits::{account, Assignment};
use crate::eval::ppl::{PplError, PplOptions};
use crate::model::Error;
use crate::store::dense_vq::GroupCodecs;
use crate::store::journal::Skipped;
use crate::store::manifest::Fnv64;
use crate::store::plan::{LayerPlan, Plan, PlanError, FORMAT, PLAN_FILE, VERSION};

/// What the budget is a share of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BudgetScope {
    /// Resident bytes of the whole model, every tensor priced, over all parameters
    /// (bits per weight as docs/ARCHITECTURE.md, Allocation, defines them).
    Model,
    /// Resident bytes of the routed experts (codebooks aside) over the routed
    /// experts' parameters; everything else stays as the checkpoint has it.
    Experts,
}

/// Settings of a compression.
#[derive(Debug, Clone)]
pub struct CompressOptions {
    /// Target resident bits per weight.
    pub bits: f64,
    /// What `bits` is measured over.
    pub scope: BudgetScope,
    /// Rounds at the final budget (the loop stops earlier when the plan is unchanged).
    pub rounds: usize,
    /// Stepping-stone budgets in bits per weight, one round each, before the final one.
    pub anneal: Vec<f64>,
    /// Calibration chunks of `ctx` tokens scored per text and probe.
    pub chunks: usize,
    /// Chunk length.
    pub ctx: usize,
    /// Codec of the dense linear layers (attention, shared experts, dense MLPs), fixed
    /// rather than allocated: probes run with it, and under [`BudgetScope::Model`] the
    /// budget pays for it. `None`: under [`BudgetScope::Model`] each layer's dense
    /// weights are a tensor group the allocator gives a codec, as it does the
    /// embeddings and the LM head; under [`BudgetScope::Experts`] they stay bf16.
    pub dense_codec: Option<Codec>,
    /// The VQ rung of shadows: every layer that keeps only some experts also holds every
    /// expert at this rung (priced in the budget), and its probes run with them.
    pub shadow: Option<Codec>,
}

/// Why compression stopped.
#[derive(Debug, thiserror::Error)]
pub enum CompressError {
    /// The model could not be read or run.
    #[error(transparent)]
    Model(#[from] Error),
    /// A probe failed.
    #[error("probe: {0}")]
    Probe(String),
    /// A codec could not be priced or measured.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// No plan fits the budget, or the plan could not be written.
    #[error("{0}")]
    Plan(String),
    /// The budget is below the smallest model the allocation can make: the tensors it
    /// does not allocate, with everything it allocates at its cheapest.
    #[error(
        "--bits {bits} is below the smallest model this can make: {minimum:.3} bits per weight over {scope}, of which {fixed:.3} are the tensors kept at their codecs ({dense}); raise --bits to at least {minimum:.3}{hint}"
    )]
    BudgetTooSmall {
        /// The bits asked for.
        bits: f64,
        /// Bits per weight of the smallest plan.
        minimum: f64,
        /// Of those, the bits of what the allocation does not spend.
        fixed: f64,
        /// What the bits are measured over.
        scope: &'static str,
        /// What those tensors are.
        dense: String,
        /// What else would help.
        hint: &'static str,
    },
    /// Writing failed.
    #[error(transparent)]
    Write(#[from] PlanError),
}

impl From<crate::checkpoint::Error> for CompressError {
    fn from(e: crate::checkpoint::Error) -> CompressError {
        CompressError::Model(e.into())
    }
}

/// Relative mean squared error of `codec` on unit Gaussian data (0 for bf16): the
/// distortion the laws interpolate through.
pub fn gaussian_distortion(codec: Codec) -> Result<f64, CodecError> {
    let (rows, cols) = (64, 1024);
    let w = codebook::gaussian(0xD15, rows * cols);
    let d = match (codec, codec.rung()?) {
        (Codec::Affine { bits }, _) => AffineMatrix::quantize(&w, rows, cols, bits)?.dequantize(),
        (_, Some(rung)) => VqMatrix::encode(&w, rows, cols, rung, 1)?.decode()?,
        (_, None) => return Ok(0.0),
    };
    let err: f64 = w
        .iter()
        .zip(&d)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let var: f64 = w.iter().map(|a| (*a as f64).powi(2)).sum();
    Ok(err / var)
}

/// Runs ISP on the checkpoint at `model` with the calibration `texts` (name, text) and
/// writes `out/plan.json` (and the probe journal `out/probes.jsonl`). `progress` hears
/// what is being done; `notice` what a user should know whether or not they follow
/// progress (journalled probes that are not reused, and why).
pub fn compress(
    model: &Path,
    texts: &[(String, String)],
    out: &Path,
    opts: &CompressOptions,
    progress: &(dyn Fn(&str) + Sync),
    notice: &(dyn Fn(&str) + Sync),
) -> Result<Plan, CompressError> {
    if let Some(c) = opts.dense_codec {
        crate::store::dense_vq::rung_of(c).map_err(CompressError::Plan)?;
    }
    let shadow_rung = match opts.shadow {
        None => None,
        Some(c) => Some(c.rung()?.ok_or_else(|| {
            CompressError::Plan(format!("shadows take a rung of the VQ ladder, not {c}"))
        })?),
    };
    std::fs::create_dir_all(out).map_err(|source| {
        CompressError::Model(Error::from(crate::checkpoint::Error::Io {
            path: out.to_path_buf(),
            source,
        }))
    })?;
    // Experts take bf16 and the VQ rungs; tensor groups the affine widths too.
    let expert_codecs = 1 + LADDER.len();
    let codecs: Vec<Codec> = std::iter::once(Codec::Bf16)
        .chain(
            LADDER
                .iter()
                .map(|r| r.name().parse().expect("rung names parse")),
        )
        .chain([4, 3, 2].map(|bits| Codec::Affine { bits }))
        .collect();
    progress("measuring codec distortions");
    let options = codecs
        .iter()
        .map(|&c| {
            Ok(CodecOption {
                name: c.to_string(),
                distortion: gaussian_distortion(c)?,
            })
        })
        .collect::<Result<Vec<_>, CodecError>>()?;
    progress("REAP saliency of the calibration texts");
    let calib: Vec<String> = texts.iter().map(|(_, t)| t.clone()).collect();
    let ppl = PplOptions {
        ctx: opts.ctx,
        max_chunks: Some(opts.chunks),
        micro_batch: None,
    };
    let config = crate::checkpoint::Config::from_file(&model.join("config.json"))?;
    let ckpt = crate::checkpoint::Checkpoint::open(model)?;
    let prober = ModelProber::new(model, codecs.clone(), &calib, ppl)?;
    let prober = match opts.dense_codec {
        None | Some(Codec::Bf16) => prober,
        Some(c) => {
            progress(&format!("coding the dense layers at {c}"));
            prober.with_dense_codec(c, &mut |_, _| {})?
        }
    };
    // Under a whole-model budget every tensor group that carries bytes is allocated:
    // the embeddings, an untied head, and each layer's dense weights unless fixed.
    let groups: Vec<CodedGroup> = match opts.scope {
        BudgetScope::Experts => Vec::new(),
        BudgetScope::Model => crate::store::dense_vq::group_weights(&ckpt, &config)
            .map_err(Error::from)?
            .into_keys()
            .filter(|g| opts.dense_codec.is_none() || !matches!(g, CodedGroup::Dense(_)))
            .collect(),
    };
    let prober = prober.with_groups(&groups)?;
    let prober = match shadow_rung {
        Some(rung) => prober.with_shadow(rung),
        None => prober,
    };
    let (e, top_k) = (config.moe.num_experts, config.moe.top_k);
    let (h, inter) = (config.hidden_size, config.moe.expert_intermediate);
    let fixed_dense = opts.dense_codec.unwrap_or(Codec::Bf16);
    let assignment = Assignment {
        tensors: GroupCodecs::uniform(fixed_dense, Codec::Bf16, Codec::Bf16),
        ..Assignment::uncompressed()
    };
    let priced = account(&config, &ckpt, &assignment, None)?;
    let group_bytes = |group: CodedGroup, codec: Codec| -> Result<u64, CodecError> {
        prober
            .group_weights(group)
            .iter()
            .map(|(_, [rows, cols])| codec.matrix_bytes(*rows, *cols))
            .sum()
    };
    let expert_params = (config.moe_layers().count() * e * 3 * h * inter) as u64;
    let (dense_bytes, denominator) = match opts.scope {
        BudgetScope::Model => {
            let allocated = groups
                .iter()
                .map(|&g| group_bytes(g, Codec::Bf16))
                .sum::<Result<u64, _>>()?;
            (
                priced.resident_bytes
                    - priced.resident_by_kind[&TensorKind::RoutedExperts]
                    - allocated,
                priced.params_total,
            )
        }
        BudgetScope::Experts => (0, expert_params),
    };
    let budget_of = |bits: f64| (bits * denominator as f64 / 8.0).floor() as u64;
    let expert_bytes = codecs
        .iter()
        .map(|&c| crate::eval::bits::expert_bytes(c, h, inter))
        .collect::<Result<Vec<u64>, CodecError>>()?;
    let max_removed = 1.0 - top_k as f64 / e as f64;
    let mut removals: Vec<f64> = (0..8)
        .map(|i| i as f64 / 8.0)
        .filter(|&f| f <= max_removed + 1e-9)
        .collect();
    if !removals.contains(&max_removed) {
        removals.push(max_removed);
    }
    // A layer that keeps only some of its experts holds slots for the swaps in flight
    // beside them (docs/ARCHITECTURE.md, Residency): priced with it.
    let spare = crate::residency::policy::PolicyParams::default().max_swaps;
    let slots = |removed: f64| {
        let k = resident_count(e, top_k, removed);
        k + crate::residency::spare_slots(e, k, spare)
    };
    // Shadows: every expert of a layer that keeps only some, at their codes' size.
    let shadow_expert = match opts.shadow {
        Some(c) => 2 * c.matrix_bytes(inter, h)? + c.matrix_bytes(h, inter)?,
        None => 0,
    };
    let shadow_bytes = |removed: f64| -> u64 {
        if resident_count(e, top_k, removed) < e {
            e as u64 * shadow_expert
        } else {
            0
        }
    };
    let units = prober.units().to_vec();
    // Bytes of every unit at every codec, priced once.
    let unit_bytes: Vec<Vec<u64>> = units
        .iter()
        .map(|u| match u {
            ProbeUnit::Experts(_) => Ok(expert_bytes.clone()),
            ProbeUnit::Group(g) => codecs.iter().map(|&c| group_bytes(*g, c)).collect(),
        })
        .collect::<Result<_, CodecError>>()?;
    let price = |unit: usize, s: Setting| match units[unit] {
        ProbeUnit::Experts(_) => {
            slots(s.removed) as u64 * unit_bytes[unit][s.codec] + shadow_bytes(s.removed)
        }
        ProbeUnit::Group(_) => unit_bytes[unit][s.codec],
    };
    // Refused before any probe: every unit at its cheapest, beside the fixed bytes.
    let minimum = dense_bytes
        + units
            .iter()
            .enumerate()
            .map(|(i, u)| match u {
                ProbeUnit::Experts(_) => {
                    slots(max_removed) as u64
                        * unit_bytes[i][..expert_codecs].iter().min().unwrap_or(&0)
                        + shadow_bytes(max_removed)
                }
                ProbeUnit::Group(_) => unit_bytes[i].iter().copied().min().unwrap_or(0),
            })
            .sum::<u64>();
    if budget_of(opts.bits) < minimum {
        let bits = |bytes: u64| bytes as f64 * 8.0 / denominator as f64;
        return Err(CompressError::BudgetTooSmall {
            bits: opts.bits,
            minimum: bits(minimum),
            fixed: bits(dense_bytes),
            scope: match opts.scope {
                BudgetScope::Model => "every tensor of the model",
                BudgetScope::Experts => "the routed experts",
            },
            dense: match (opts.scope, opts.dense_codec) {
                (BudgetScope::Experts, _) => "none: only the routed experts count".into(),
                (BudgetScope::Model, None) => "routers and norms".into(),
                (BudgetScope::Model, Some(c)) => {
                    format!("routers, norms, and the dense layers at {c}")
                }
            },
            hint: match (opts.scope, opts.dense_codec) {
                (BudgetScope::Model, Some(_)) => {
                    ", or let the allocator code the dense layers (leave out --dense-codec)"
                }
                (BudgetScope::Model, None) => {
                    ", or spend the budget on the routed experts alone (--scope experts)"
                }
                (BudgetScope::Experts, _) => "",
            },
        });
    }
    let probe_codecs: Vec<usize> = ["vq0.7", "vq1.5", "vq4"]
        .iter()
        .filter_map(|name| codecs.iter().position(|c| c.to_string() == *name))
        .collect();

    // Probes are keyed by what they measure, not by where it lies: the checkpoint's
    // bytes, each calibration text's bytes, and the settings. A file changed under the
    // same name is probed again. The fixed dense codec and the units a settings vector
    // lists are part of the key too.
    progress("hashing the checkpoint and the calibration texts");
    let dense_context = match opts.dense_codec {
        None | Some(Codec::Bf16) => String::new(),
        Some(c) => format!(" | dense {c}"),
    } + &opts
        .shadow
        .map_or(String::new(), |c| format!(" | shadows {c}"));
    let unit_names: Vec<String> = units.iter().map(|u| u.to_string()).collect();
    let context = format!(
        "checkpoint {} | calib {} | ctx {} chunks {} | {:?} | units {}{dense_context}",
        crate::store::content_fingerprint(&ckpt, model).map_err(Error::from)?,
        texts
            .iter()
            .map(|(_, t)| Fnv64::default().bytes(t.as_bytes()).hex())
            .collect::<Vec<_>>()
            .join(","),
        opts.ctx,
        opts.chunks,
        codecs.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
        unit_names.join(",")
    );
    let journal = out.join("probes.jsonl");
    let cached = CachedProber::open(prober, &journal, &context).map_err(|e| match e {
        CacheError::Io { path, source } => {
            CompressError::Model(crate::checkpoint::Error::Io { path, source }.into())
        }
        CacheError::Probe(p) => CompressError::Probe(p.to_string()),
    })?;
    for line in journal_notices(&journal, &context, cached.skipped()) {
        notice(&line);
    }

    let start = Setting {
        codec: 0,
        removed: 0.0,
    };
    let problem = Problem {
        units: units
            .iter()
            .map(|u| match u {
                // bf16 experts run from f32 slots when some are not resident, twice
                // what they are priced at: a bf16 layer keeps every expert.
                ProbeUnit::Experts(_) => Unit {
                    settings: (0..expert_codecs)
                        .flat_map(|codec| {
                            let bf16 = codecs[codec] == Codec::Bf16;
                            removals
                                .iter()
                                .filter(move |&&r| !bf16 || r == 0.0)
                                .map(move |&removed| Setting { codec, removed })
                        })
                        .collect(),
                    probe_codecs: probe_codecs.clone(),
                    probe_removals: vec![0.25, 0.5, max_removed.min(0.95)],
                    start,
                },
                ProbeUnit::Group(_) => Unit {
                    settings: (0..codecs.len())
                        .map(|codec| Setting {
                            codec,
                            removed: 0.0,
                        })
                        .collect(),
                    probe_codecs: probe_codecs.clone(),
                    probe_removals: Vec::new(),
                    start,
                },
            })
            .collect(),
        codecs: options.clone(),
        bytes: &price,
        fixed_bytes: dense_bytes,
    };
    let anneal: Vec<u64> = opts.anneal.iter().map(|&b| budget_of(b)).collect();
    let report = |round: usize, done: usize, total: usize| {
        progress(&format!("round {}: probe {done}/{total}", round + 1))
    };
    let rounds: Vec<Round> = isp(
        &problem,
        &cached,
        budget_of(opts.bits),
        &anneal,
        opts.rounds,
        &report,
    )
    .map_err(|e| match e {
        IspError::Probe(p) => CompressError::Probe(p.to_string()),
        IspError::Alloc(a) => CompressError::Plan(a.to_string()),
    })?;
    let last = rounds.last().expect("ISP runs at least one round");
    let prober = cached.inner();
    let mut layers: Vec<LayerPlan> = Vec::new();
    let mut chosen_groups = std::collections::BTreeMap::new();
    let mut group_total = 0u64;
    for (i, (unit, s)) in units.iter().zip(&last.plan).enumerate() {
        match *unit {
            ProbeUnit::Experts(layer) => {
                let resident = resident_count(e, top_k, s.removed);
                layers.push(LayerPlan {
                    layer,
                    codec: codecs[s.codec],
                    experts: e,
                    resident,
                    spare_slots: Some(slots(s.removed) - resident),
                    shadow_bytes: shadow_bytes(s.removed),
                    resident_bytes: slots(s.removed) as u64 * expert_bytes[s.codec]
                        + shadow_bytes(s.removed),
                    reservoir_bytes: (e - resident) as u64 * expert_bytes[s.codec],
                    keep: if resident < e {
                        prober.kept(layer, s.removed)
                    } else {
                        Vec::new()
                    },
                });
            }
            ProbeUnit::Group(g) => {
                chosen_groups.insert(g, codecs[s.codec]);
                group_total += unit_bytes[i][s.codec];
            }
        }
    }
    // Reported on their own line: the codebooks of the rungs the plan runs.
    let codebook_bytes: u64 = used_codecs(&codecs, &rounds, opts.dense_codec)
        .iter()
        .map(|c| c.codebook_bytes())
        .sum::<Result<u64, _>>()?;
    let dense_bytes = dense_bytes + group_total;
    let resident_bytes = dense_bytes + layers.iter().map(|l| l.resident_bytes).sum::<u64>();
    let budget_bytes = budget_of(opts.bits);
    let plan = Plan {
        format: FORMAT.into(),
        version: VERSION,
        model_type: config.arch.model_type().to_string(),
        source: model.display().to_string(),
        budget_bits: opts.bits,
        budget_bytes,
        params_total: denominator,
        dense_codec: fixed_dense,
        groups: chosen_groups,
        shadow: opts.shadow,
        dense_bytes,
        resident_bytes,
        reservoir_bytes: layers.iter().map(|l| l.reservoir_bytes).sum(),
        unspent_bytes: budget_bytes.saturating_sub(resident_bytes),
        layers,
        rounds: serde_json::json!({
            "scope": opts.scope,
            "codebook_bytes": codebook_bytes,
            "probes_from_journal": cached.hits(),
            "journal_lines_not_trusted": cached.skipped().untrusted() + cached.skipped().other_contexts.values().sum::<usize>(),
            "codecs": options,
            "candidates": codecs.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
            "units": unit_names,
            "removals": removals,
            "rounds": rounds,
        }),
    };
    if plan.resident_bytes > plan.budget_bytes {
        return Err(CompressError::Plan(format!(
            "the plan needs {} resident bytes, over the budget of {}",
            plan.resident_bytes, plan.budget_bytes
        )));
    }
    plan.save(&out.join(PLAN_FILE))?;
    Ok(plan)
}

/// What a user is told about journalled probes that are not reused.
fn journal_notices(path: &Path, context: &str, skipped: &Skipped) -> Vec<String> {
    let name = path.display();
    let mut out = Vec::new();
    let other: usize = skipped.other_contexts.values().sum();
    if other > 0 {
        out.push(format!(
            "{name}: {other} probes were recorded under another key (the checkpoint's \
             contents, a calibration text's contents or the settings differ) and are not \
             trusted; probing again"
        ));
        for (key, n) in &skipped.other_contexts {
            out.push(format!("  {n} under: {key}"));
        }
        out.push(format!("  key now: {context}"));
    }
    if !skipped.damaged.is_empty() {
        let lines: Vec<String> = skipped.damaged.iter().map(|n| n.to_string()).collect();
        out.push(format!(
            "{name}: line(s) {} damaged (not JSON, or a checksum that does not match the \
             line); not trusted, probing again",
            lines.join(", ")
        ));
    }
    if skipped.unchecked > 0 {
        out.push(format!(
            "{name}: {} line(s) carry no checksum (written by an older dynmoe); not trusted, \
             probing again",
            skipped.unchecked
        ));
    }
    out
}

/// The codecs a plan uses: its units' and the fixed dense layers' (each VQ rung's
/// codebook is loaded once).
fn used_codecs(codecs: &[Codec], rounds: &[Round], dense: Option<Codec>) -> Vec<Codec> {
    let mut used: Vec<Codec> = rounds
        .last()
        .map(|r| r.plan.iter().map(|s| codecs[s.codec]).collect())
        .unwrap_or_default();
    used.extend(dense);
    used.sort();
    used.dedup();
    used
}

impl From<PplError> for CompressError {
    fn from(e: PplError) -> CompressError {
        CompressError::Probe(e.to_string())
    }
}

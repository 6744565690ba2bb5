//! `dynmoe bench residency`: decode speed with a resident set smaller than the model,
//! beside the same model fully resident, with what the swaps cost (docs/ARCHITECTURE.md, Residency).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use crate::bench::{
    head_bytes, layer_dense_bytes, median, random_prompt, settings, DenseCodecs, Setting,
};
use crate::residency::ResidencyArgs;
use crate::{cuda_backend, BackendKind, DenseCodecArgs};
use dynmoe::backend::Backend;
use dynmoe::checkpoint::Config;
use dynmoe::model::argmax;
use dynmoe::model::LoadedModel;
use dynmoe::residency::ResidencyReport;
use dynmoe::testing::decode_one;

#[derive(Args)]
pub struct ResidencyBenchArgs {
    /// A converted model directory, or a compressed one (run at its plan).
    model: PathBuf,
    /// Compute backend.
    #[arg(long, value_enum, default_value = "cuda")]
    backend: BackendKind,
    /// Expert precision of a converted directory (default 2).
    #[arg(long)]
    bits: Option<u32>,
    /// The dense layers and LM head (a converted directory's).
    #[command(flatten)]
    dense: DenseCodecArgs,
    /// Prompt tokens (random ids).
    #[arg(long, default_value_t = 16)]
    prompt: usize,
    /// Tokens decoded greedily after the prompt, per run.
    #[arg(long, default_value_t = 256)]
    generate: usize,
    /// Timed runs after a warm-up run; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[command(flatten)]
    residency: ResidencyArgs,
    /// Device memory the resident model may take, in GB: sets each layer's resident
    /// count to what fits beside the dense weights, the spare slots of loads in flight
    /// and 1 GB for activations and scratch (instead of --resident-fraction/-count).
    #[arg(long)]
    device_budget_gb: Option<f64>,
    /// Also write the report here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    model: PathBuf,
    backend: String,
    layers: usize,
    /// The affine experts' bits; `null` for a compressed directory.
    bits: Option<u32>,
    /// A compressed directory's plan: its MoE layers' codecs (`vq1.5`, or several
    /// joined by `+`).
    plan: Option<String>,
    /// Codecs of the attention projections and the LM head.
    #[serde(flatten)]
    codecs: DenseCodecs,
    prompt: usize,
    generate: usize,
    repeats: usize,
    /// Decode tok/s of each timed run with every expert resident.
    full_runs_tok_s: Vec<f64>,
    full_tok_s: f64,
    /// The same with the resident sets.
    resident_runs_tok_s: Vec<f64>,
    resident_tok_s: f64,
    /// `resident_tok_s / full_tok_s`.
    ratio: f64,
    /// Bytes of every routed expert as the kernels read it (what full residency keeps).
    all_expert_bytes: usize,
    /// Bytes of the dense weights on the backend: attention projections and LM head at
    /// their codecs, the rest at the backend's dense precision (bf16 on CUDA).
    dense_bytes: usize,
    /// The device memory budget asked for, in GB.
    device_budget_gb: Option<f64>,
    /// What the resident sets measured over the timed runs.
    residency: ResidencyReport,
}

/// Bytes of the non-expert weights: attention and an untied LM head at `codecs`, routers
/// and embeddings at `dense` bytes each.
fn dense_weight_bytes(c: &Config, dense: usize, codecs: DenseCodecs) -> Result<usize> {
    let embedding = if c.tie_word_embeddings {
        0 // the LM head
    } else {
        dense * c.vocab_size * c.hidden_size
    };
    Ok(layer_dense_bytes(c, dense, codecs.dense)? + head_bytes(c, dense, codecs.head)? + embedding)
}

/// Greedy decode tok/s of `repeats` runs after a warm-up run, each from a fresh prefill
/// of the same random prompt; `between` runs after the warm-up.
fn decode_runs<B: Backend>(
    m: &LoadedModel<B>,
    prompt: usize,
    generate: usize,
    repeats: usize,
    between: &mut dyn FnMut(),
) -> Result<Vec<f64>> {
    let ids = random_prompt(m, prompt);
    let mut state = m.model.new_state(prompt + generate);
    let mut runs = Vec::new();
    for run in 0..=repeats {
        if run == 1 {
            between();
        }
        state.clear();
        let mut next = argmax(&m.model.forward(&mut state, &ids, prompt - 1)?);
        let t = Instant::now();
        for _ in 0..generate {
            next = decode_one(&m.model, &mut state, next)?;
        }
        if run > 0 {
            runs.push(generate as f64 / t.elapsed().as_secs_f64());
        }
    }
    Ok(runs)
}

pub fn bench_residency(a: ResidencyBenchArgs) -> Result<()> {
    if a.prompt == 0 || a.repeats == 0 || a.generate == 0 {
        bail!("--prompt, --generate and --repeats must be positive");
    }
    if a.residency.config()?.is_none() && a.device_budget_gb.is_none() {
        bail!("give --device-budget-gb, --resident-fraction (below 1) or --resident-count: what to compare full residency with");
    }
    let setting = settings(&a.model, a.bits.as_slice(), &[2], &a.dense)?
        .pop()
        .expect("one setting");
    let codecs = setting.codecs(&a.dense);
    match a.backend {
        BackendKind::Cuda => {
            let mut m = crate::load(&a.model, cuda_backend()?, &codecs)?;
            run(&a, &setting, &mut m, 2, &mut |m| free_device_copies(m))
        }
        other => {
            let mut m = crate::load(&a.model, other.cpu(), &codecs)?;
            run(&a, &setting, &mut m, 4, &mut |_| {})
        }
    }
}

/// Resident experts per MoE layer that fit `budget` bytes beside `dense` bytes of dense
/// weights, with `spare` more slots per layer and 1 GB of activations and scratch.
fn count_in_budget(
    c: &Config,
    budget: f64,
    dense: usize,
    record: usize,
    spare: usize,
) -> Result<usize> {
    let layers = c.moe_layers().count().max(1);
    let room = budget - dense as f64 - 1e9;
    let slots = (room / (layers * record) as f64).floor();
    let k = slots as i64 - spare as i64;
    if k < c.moe.top_k as i64 {
        bail!(
            "{:.1} GB of device memory leaves room for {k} resident experts per layer beside {:.1} GB of dense weights; routing needs {}",
            budget / 1e9,
            dense as f64 / 1e9,
            c.moe.top_k
        );
    }
    Ok((k as usize).min(c.moe.num_experts))
}

fn run<B: Backend>(
    a: &ResidencyBenchArgs,
    setting: &Setting,
    m: &mut LoadedModel<B>,
    dense: usize,
    free: &mut dyn FnMut(&LoadedModel<B>),
) -> Result<()> {
    let c = m.model.config.clone();
    let experts = setting.expert_bytes(&c, dense)?;
    let all_expert_bytes = c.moe.num_experts * experts.iter().sum::<usize>();
    let expert = all_expert_bytes / (c.moe.num_experts * experts.len()).max(1);
    let codecs = setting.dense_codecs(&a.dense);
    let dense_bytes = dense_weight_bytes(&c, dense, codecs)?;
    let label = setting.label();
    println!(
        "{} ({} layers, {} experts of {:.1} MB at {label}: {:.2} GB; dense {:.2} GB at {}, LM head {}), prompt {} / decode {} tokens, median of {}",
        a.model.display(),
        c.layers.len(),
        c.moe.num_experts,
        expert as f64 / 1e6,
        all_expert_bytes as f64 / 1e9,
        dense_bytes as f64 / 1e9,
        codecs.dense,
        codecs.head,
        a.prompt,
        a.generate,
        a.repeats
    );
    let full = decode_runs(m, a.prompt, a.generate, a.repeats, &mut || {})?;
    println!("every expert resident: {:.1} tok/s", median(&full));
    // The full copies go, so that the resident sets are what the device holds.
    free(m);
    let mut residency_args = a.residency.clone();
    if let Some(gb) = a.device_budget_gb {
        let record = setting.record_bytes(&c)?;
        let k = count_in_budget(&c, gb * 1e9, dense_bytes, record, a.residency.max_swaps)?;
        println!(
            "{gb} GB of device memory: {k} of {} experts resident per layer (+{} spare slots)",
            c.moe.num_experts, a.residency.max_swaps
        );
        residency_args.resident_fraction = None;
        residency_args.resident_count = Some(k);
    }
    residency_args
        .install(m)
        .context("installing the resident sets")?;
    let residency = m.model.residency().expect("installed");
    let resident = decode_runs(m, a.prompt, a.generate, a.repeats, &mut || {
        residency.reset_counters()
    })?;
    let rep = residency.report();
    let ratio = median(&resident) / median(&full);
    let c_ = &rep.counters;
    println!(
        "{:>10} {:>10} {:>7} {:>11} {:>11} {:>7} {:>10} {:>8} {:>7} {:>7} {:>11}",
        "full t/s",
        "set t/s",
        "ratio",
        "resident",
        "device GB",
        "swaps",
        "GB moved",
        "stalls",
        "late",
        "hit",
        "loads GB/s"
    );
    println!(
        "{:>10.1} {:>10.1} {:>7.3} {:>5} of {:<3} {:>11.2} {:>7} {:>10.2} {:>8} {:>7} {:>7.3} {:>11.2}",
        median(&full),
        median(&resident),
        ratio,
        rep.resident_per_layer,
        rep.experts_per_layer,
        (rep.device_bytes + dense_bytes) as f64 / 1e9,
        c_.swaps,
        c_.bytes_moved as f64 / 1e9,
        c_.stalls,
        c_.late_boundaries,
        rep.hit_rate,
        rep.read_bandwidth_mb_s / 1e3
    );
    let report = Report {
        model: a.model.clone(),
        backend: m.model.backend().name().to_string(),
        layers: c.layers.len(),
        bits: match setting {
            Setting::Affine(bits) => Some(*bits),
            Setting::Plan(_) => None,
        },
        plan: matches!(setting, Setting::Plan(_)).then_some(label),
        codecs,
        prompt: a.prompt,
        generate: a.generate,
        repeats: a.repeats,
        full_tok_s: median(&full),
        full_runs_tok_s: full,
        resident_tok_s: median(&resident),
        resident_runs_tok_s: resident,
        ratio,
        all_expert_bytes,
        dense_bytes,
        device_budget_gb: a.device_budget_gb,
        residency: rep,
    };
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn free_device_copies(m: &LoadedModel<dynmoe::backend::Cuda>) {
    m.model.backend().clear_weight_cache();
}

/// Without the feature the "CUDA" model is never made (see `cuda_backend`).
#[cfg(not(feature = "cuda"))]
fn free_device_copies<B: Backend>(_: &LoadedModel<B>) {}

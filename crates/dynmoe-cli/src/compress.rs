//! `dynmoe compress`: ISP over a checkpoint's MoE layers, written as plan.json.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use dynmoe::alloc::compress::{self, BudgetScope, CompressOptions};
use dynmoe::codec::Codec;

use crate::read_text;

#[derive(Clone, Copy, ValueEnum)]
pub enum ScopeArg {
    /// Bits per weight of the whole model, every tensor priced.
    Model,
    /// Bits per routed-expert weight; the rest of the model stays as it is.
    Experts,
}

#[derive(Args)]
pub struct CompressArgs {
    /// Hugging Face checkpoint directory.
    #[arg(long, short)]
    model: PathBuf,
    /// Target resident bits per weight.
    #[arg(long)]
    bits: f64,
    /// What --bits is measured over.
    #[arg(long, value_enum, default_value = "model")]
    scope: ScopeArg,
    /// Calibration texts, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    calib: Vec<PathBuf>,
    /// Output directory: the compressed model (plan.json, dense.safetensors, the VQ
    /// stores, compressed.json) and the probe journal.
    #[arg(short = 'o', long)]
    out: PathBuf,
    /// Write plan.json (and the journal) only, not the model.
    #[arg(long)]
    plan_only: bool,
    /// Rounds at the final budget; fewer when the plan stops changing.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Stepping-stone budgets in bits per weight, one round each, e.g. 4.5,2.25.
    #[arg(long, value_delimiter = ',')]
    anneal: Vec<f64>,
    /// Calibration chunks of 512 tokens scored per text and probe.
    #[arg(long, default_value_t = 4)]
    chunks: usize,
    /// Fix the dense linear layers (attention, shared experts, dense MLPs) at this codec
    /// instead of allocating one per layer: bf16, q4, q3, q2 (kept bf16 in the
    /// directory, quantized at load) or a VQ rung such as vq4. Under --scope model the
    /// budget pays for it; left out, --scope model gives each layer's dense weights a
    /// codec from the budget, as it does the embeddings and the LM head, and --scope
    /// experts keeps them bf16.
    #[arg(long)]
    dense_codec: Option<Codec>,
    /// Give every layer that keeps only some experts shadows at this VQ rung (e.g. vq1):
    /// every expert also held at the rung, priced in the budget, and run for a token
    /// routed outside the set instead of confining its routing. The probes run with them.
    #[arg(long)]
    shadow: Option<Codec>,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

pub fn compress(a: CompressArgs) -> Result<()> {
    if !(a.bits > 0.0 && a.bits.is_finite()) || a.anneal.iter().any(|b| b.is_nan() || *b <= 0.0) {
        anyhow::bail!("--bits and --anneal must be positive bits per weight");
    }
    if a.rounds == 0 || a.chunks == 0 {
        anyhow::bail!("--rounds and --chunks must be at least 1");
    }
    let texts = a
        .calib
        .iter()
        .map(|p| Ok((p.display().to_string(), read_text(p)?)))
        .collect::<Result<Vec<_>>>()?;
    let opts = CompressOptions {
        bits: a.bits,
        scope: match a.scope {
            ScopeArg::Model => BudgetScope::Model,
            ScopeArg::Experts => BudgetScope::Experts,
        },
        rounds: a.rounds,
        anneal: a.anneal.clone(),
        chunks: a.chunks,
        ctx: 512,
        dense_codec: a.dense_codec,
        shadow: a.shadow,
    };
    let quiet = a.json;
    let progress = |msg: &str| {
        if !quiet {
            eprintln!("{msg}");
        }
    };
    let notice = |msg: &str| eprintln!("{msg}");
    let plan = compress::compress(&a.model, &texts, &a.out, &opts, &progress, &notice)
        .with_context(|| format!("compressing {}", a.model.display()))?;
    if !a.plan_only {
        if !quiet {
            eprintln!("writing the compressed model");
        }
        let bar = crate::progress::bar("encoding experts");
        dynmoe::store::compressed::write(&a.model, &a.out, &plan, &mut |d, t| {
            crate::progress::update(&bar, d, t)
        })
        .with_context(|| format!("writing the compressed model to {}", a.out.display()))?;
        bar.finish_and_clear();
    }
    // The plan's own bits are over its budget's scope; what the written directory takes
    // over the whole model is read back from it.
    let model_bits = if a.plan_only {
        None
    } else {
        Some(
            dynmoe::eval::compressed_bits::compressed_bits(&a.out)
                .with_context(|| format!("reading back {}", a.out.display()))?,
        )
    };
    if a.json {
        let mut v = serde_json::to_value(&plan)?;
        if let Some(bits) = &model_bits {
            v["model_bits"] = serde_json::to_value(bits)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<6} {:>8} {:>10} {:>14}",
        "layer", "codec", "resident", "resident B"
    );
    for l in &plan.layers {
        println!(
            "{:<6} {:>8} {:>6} / {:<3} {:>12}",
            l.layer,
            l.codec.to_string(),
            l.resident,
            l.experts,
            l.resident_bytes
        );
    }
    println!(
        "resident {} of {} budget bytes ({:.3} of {:.3} bits per weight, {} unspent); {} in {}",
        plan.resident_bytes,
        plan.budget_bytes,
        plan.resident_bits(),
        plan.budget_bits,
        plan.unspent_bytes,
        if a.plan_only { "plan" } else { "model" },
        a.out.display()
    );
    if let Some(b) = model_bits {
        println!(
            "whole model: {:.3} bits per weight resident, {:.3} on disk ({} codebook bytes apart)",
            b.total.resident_bits, b.total.disk_bits, b.codebook_bytes
        );
    }
    Ok(())
}

//! `dynmoe convert` and `dynmoe store ensure`: writing the expert stores.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use dynmoe::store::{base, lowbit};
use serde::Serialize;

use crate::progress;

#[derive(Args)]
pub struct ConvertArgs {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files).
    #[arg(long, short)]
    model: PathBuf,
    /// Output model directory: experts.bin, experts.json, dense.safetensors, config and
    /// tokenizer files.
    #[arg(long, short)]
    out: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
pub enum StoreCommand {
    /// Build the low-bit expert stores that are missing, stale or damaged; keep the rest.
    Ensure(EnsureArgs),
    /// Read every record of the expert stores and check it against its checksum; exits
    /// non-zero naming the first damaged file and record.
    Verify(VerifyArgs),
}

#[derive(Args)]
pub struct VerifyArgs {
    /// Converted model directory.
    #[arg(long, short)]
    model: PathBuf,
    /// Precisions, comma-separated (4, 3, 2); default: every store in the directory.
    #[arg(long, value_delimiter = ',')]
    bits: Vec<u32>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct EnsureArgs {
    /// Converted model directory (holding experts.bin).
    #[arg(long, short)]
    model: PathBuf,
    /// Precisions, comma-separated (2, 3; 4 checks the base store).
    #[arg(long, value_delimiter = ',', default_value = "2,3")]
    bits: Vec<u32>,
    /// Rebuild even usable stores.
    #[arg(long)]
    force: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// `dynmoe convert`.
pub fn convert(a: ConvertArgs) -> Result<()> {
    let bar = progress::bar("quantizing");
    let report = base::convert(&a.model, &a.out, &mut |done, total| {
        progress::update(&bar, done, total)
    })
    .with_context(|| format!("converting {} into {}", a.model.display(), a.out.display()))?;
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{}: {} expert records of {} bytes in experts.bin ({}), {} dense tensors in dense.safetensors ({}), {:.1} s",
        report.out_dir.display(),
        report.records,
        report.record_size,
        size(report.experts_bytes),
        report.dense_tensors,
        size(report.dense_bytes),
        report.seconds
    );
    Ok(())
}

#[derive(Serialize)]
struct EnsureReport {
    dir: PathBuf,
    stores: Vec<lowbit::Ensured>,
    seconds: f64,
}

/// `dynmoe store ...`.
pub fn store(c: StoreCommand) -> Result<()> {
    match c {
        StoreCommand::Ensure(a) => ensure(a),
        StoreCommand::Verify(a) => verify(a),
    }
}

fn verify(a: VerifyArgs) -> Result<()> {
    let stores = lowbit::verify(&a.model, &a.bits)
        .with_context(|| format!("verifying the expert stores in {}", a.model.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&stores)?);
        return Ok(());
    }
    for s in &stores {
        println!(
            "{}-bit ok     {} ({} records, {})",
            s.bits,
            s.path.display(),
            s.records,
            size(s.bytes)
        );
    }
    Ok(())
}

fn ensure(a: EnsureArgs) -> Result<()> {
    let start = std::time::Instant::now();
    let bar = progress::bar("packing");
    let json = a.json;
    let stores = lowbit::ensure_with_policy(
        &a.model,
        &a.bits,
        &mut lowbit::Policy {
            force: a.force,
            progress: &mut |done, total| progress::update(&bar, done, total),
            notice: &mut |line| {
                if !json {
                    bar.suspend(|| eprintln!("{line}"));
                }
            },
        },
    )
    .with_context(|| format!("expert stores in {}", a.model.display()))?;
    bar.finish_and_clear();
    let report = EnsureReport {
        dir: a.model,
        stores,
        seconds: start.elapsed().as_secs_f64(),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    for s in &report.stores {
        println!(
            "{}-bit {:<6} {} ({}, {} bytes per record) in {:.2} s",
            s.bits,
            if s.built { "built" } else { "kept" },
            s.path.display(),
            size(s.bytes),
            s.record_size,
            s.seconds
        );
    }
    Ok(())
}

/// A byte count for people: MiB or GiB with one decimal.
fn size(bytes: u64) -> String {
    let mib = bytes as f64 / (1u64 << 20) as f64;
    if mib >= 1024.0 {
        format!("{:.1} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

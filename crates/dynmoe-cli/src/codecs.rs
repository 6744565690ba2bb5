//! `dynmoe codebooks build` and `dynmoe bench codecs`: the VQ ladder's codebooks and
//! its measurements.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use dynmoe::codec::vq::codebook::{self, BuildParams};
use dynmoe::codec::vq::report;
use dynmoe::codec::vq::{Rung, LADDER};

#[derive(Subcommand)]
pub enum CodebooksCommand {
    /// Build codebooks from their seeds (the shipped ones are in crates/dynmoe/codebooks).
    Build(BuildArgs),
}

#[derive(Args)]
pub struct BuildArgs {
    /// Output directory.
    #[arg(long, short)]
    out: PathBuf,
    /// Rungs to build, by nominal bits (`1,1.5`); all when absent.
    #[arg(long, value_delimiter = ',')]
    rungs: Vec<String>,
}

pub fn codebooks(c: CodebooksCommand) -> Result<()> {
    let CodebooksCommand::Build(a) = c;
    let rungs = parse_rungs(&a.rungs)?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("{}", a.out.display()))?;
    for r in rungs {
        let t = Instant::now();
        let params = BuildParams::for_rung(r);
        let book = codebook::build(r, params);
        let path = a.out.join(codebook::file_name(r));
        book.write(&path)?;
        println!(
            "{:<8} p={:<2} k={:<2} {:>6} codewords {:>8} samples {:>5.1} s  {}",
            r.name(),
            r.dim,
            r.index_bits,
            r.codewords(),
            params.samples_per_codeword as usize * r.codewords(),
            t.elapsed().as_secs_f64(),
            path.display()
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct CodecsArgs {
    /// Checkpoint whose routed experts give the real-weight distortion.
    #[arg(long, default_value = "fixtures/models/small-moe")]
    model: PathBuf,
    /// Use every n-th expert matrix of the checkpoint.
    #[arg(long, default_value = "1")]
    stride: usize,
    /// Rows of the Gaussian test matrix (its columns are 2048).
    #[arg(long, default_value = "512")]
    rows: usize,
    /// Rungs to measure, by nominal bits; all when absent.
    #[arg(long, value_delimiter = ',')]
    rungs: Vec<String>,
    /// Where the JSON goes.
    #[arg(long, default_value = "bench/results/codecs.json")]
    out: PathBuf,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn bench_codecs(a: CodecsArgs) -> Result<()> {
    let rungs = parse_rungs(&a.rungs)?;
    let real = report::expert_matrices(&a.model, a.stride)
        .with_context(|| format!("reading expert weights of {}", a.model.display()))?;
    let r = report::measure(&rungs, a.rows, 2048, &real, |r| {
        if !a.json {
            eprintln!("measuring {}", r.name());
        }
    })?;
    let json = serde_json::to_string_pretty(&r)?;
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
    }
    dynmoe::store::atomic::write_file(&a.out, json.as_bytes())?;
    if a.json {
        println!("{json}");
    } else {
        print!("{}", report::table(&r));
        println!("wrote {}", a.out.display());
    }
    Ok(())
}

fn parse_rungs(names: &[String]) -> Result<Vec<Rung>> {
    Ok(if names.is_empty() {
        LADDER.to_vec()
    } else {
        names
            .iter()
            .map(|s| Rung::parse(s))
            .collect::<Result<_, _>>()?
    })
}

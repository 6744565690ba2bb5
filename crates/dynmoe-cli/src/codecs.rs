//! `dynmoe codebooks build` and `dynmoe bench codecs`: the VQ ladder's codebooks and
//! its measurements.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use dynmoe::codec::vq::codebook::{self, BuildParams, Codebook, Symmetry};
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
    /// Build with this symmetry instead of the shipped book's, to compare the two
    /// (`dynmoe bench codecs --codebooks DIR`).
    #[arg(long, value_enum)]
    symmetry: Option<SymmetryArg>,
}

#[derive(Clone, Copy, ValueEnum)]
enum SymmetryArg {
    None,
    Signs,
    SignsThenFree,
}

pub fn codebooks(c: CodebooksCommand) -> Result<()> {
    let CodebooksCommand::Build(a) = c;
    let rungs = parse_rungs(&a.rungs)?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("{}", a.out.display()))?;
    for r in rungs {
        let t = Instant::now();
        let params = match a.symmetry {
            None => BuildParams::for_rung(r),
            Some(SymmetryArg::None) => BuildParams::with_symmetry(r, Symmetry::None),
            Some(SymmetryArg::Signs) => BuildParams::with_symmetry(r, Symmetry::Signs),
            Some(SymmetryArg::SignsThenFree) => {
                BuildParams::with_symmetry(r, Symmetry::SignsThenFree)
            }
        };
        let book = codebook::build(r, params);
        let path = a.out.join(codebook::file_name(r));
        // Written as every store is: a crash leaves the old file or the new one.
        dynmoe::store::atomic::write_file(&path, &book.to_bytes())?;
        println!(
            "{:<8} p={:<2} k={:<2} {:>6} codewords {:?} {:>9} samples {:>3} iterations {:>6.1} s  {}",
            r.name(),
            r.dim,
            r.index_bits,
            r.codewords(),
            params.symmetry,
            params.samples_per_codeword as usize * params.symmetry.stored_codewords(r),
            params.iterations,
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
    /// Measure the codebooks in this directory (`dynmoe codebooks build -o DIR`)
    /// instead of the shipped ones.
    #[arg(long)]
    codebooks: Option<PathBuf>,
}

pub fn bench_codecs(a: CodecsArgs) -> Result<()> {
    let rungs = parse_rungs(&a.rungs)?;
    let real = report::expert_matrices(&a.model, a.stride)
        .with_context(|| format!("reading expert weights of {}", a.model.display()))?;
    let read: Vec<Codebook> = match &a.codebooks {
        Some(dir) => rungs
            .iter()
            .map(|&r| Codebook::read(&dir.join(codebook::file_name(r)), r))
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let books: Vec<&Codebook> = if a.codebooks.is_some() {
        read.iter().collect()
    } else {
        rungs
            .iter()
            .map(|r| r.codebook())
            .collect::<Result<_, _>>()?
    };
    let r = report::measure(&books, a.rows, 2048, &real, |r| {
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

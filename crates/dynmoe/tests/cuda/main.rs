//! The CUDA backend against the CPU reference: every op on fresh random inputs with
//! poisoned outputs (‖gpu − ref‖ / ‖ref‖ printed for each), dense weights both as bf16
//! (values rounded to bf16 first, as checkpoints hold them) and as f32, then the fixtures
//! (bf16 checkpoints) end to end
//! (perplexity within 1e-3 relative and identical greedy decodes, from the checkpoint
//! and from its 4-, 3- and 2-bit expert stores).
//!
//! Without the `cuda` feature this target is empty; with it but on a machine without a
//! GPU, each test prints why it was skipped and passes.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::sync::OnceLock;

use dynmoe::backend::cuda::Tuning;
use dynmoe::backend::route::confine;
use dynmoe::backend::route::route;
use dynmoe::backend::sample::Sampling;
use dynmoe::backend::{
    AddNorm, AttentionShape, Backend, Cpu, Cuda, DeviceRoute, HeadNorm, MoeInput, RoutedExperts,
    SwiGluGroup, Weight,
};
use dynmoe::checkpoint::config::Router;
use dynmoe::codec::affine::AffineMatrix;
use dynmoe::eval::ppl::{perplexity, PplOptions};
use dynmoe::model::{self, Codecs, DecodeOptions, Decoding, ExpertBits};
use dynmoe::runtime::generate::generate_ids;
use dynmoe::testing::{
    fixture, fixtures_root, fresh, greedy_reference, rel_err, GreedyReference, Rng, TempDir,
};
use half::bf16;

/// The device, or `None` after printing why the test is skipped.
fn gpu() -> Option<&'static Cuda> {
    static GPU: OnceLock<Result<Cuda, String>> = OnceLock::new();
    match GPU.get_or_init(|| Cuda::new(0).map_err(|e| e.to_string())) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// The device run without tensor cores (the portable kernels older devices run), once
/// [`gpu`] has found it.
fn portable() -> &'static Cuda {
    static PORTABLE: OnceLock<Cuda> = OnceLock::new();
    PORTABLE.get_or_init(|| {
        let g = gpu().expect("checked by the caller");
        let tuning = Tuning {
            tensor_cores: false,
            ..g.tuning().clone()
        };
        Cuda::with_tuning(0, tuning).expect("the device was made once")
    })
}

/// The device as [`gpu`] runs it (tensor cores where it has them), or [`portable`].
fn device(tensor_cores: bool) -> &'static Cuda {
    if tensor_cores {
        gpu().expect("checked by the caller")
    } else {
        portable()
    }
}

fn root() -> PathBuf {
    fixtures_root().join("../..")
}

/// `v` rounded to bf16 values: a matrix the device keeps in bf16.
fn bf16_values(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Runs `op` on a backend with the inputs uploaded and an output of `out_len` made by
/// `alloc` (NaN on both backends), and returns the output.
fn run<B: Backend>(
    b: &B,
    inputs: &[&[f32]],
    out_len: usize,
    op: impl FnOnce(&B, &[B::Tensor], &mut B::Tensor),
) -> Vec<f32> {
    let ts: Vec<B::Tensor> = inputs.iter().map(|x| b.upload(x)).collect();
    let mut out = b.alloc(out_len);
    op(b, &ts, &mut out);
    let mut host = vec![0.0; out_len];
    b.download(&out, &mut host);
    host
}

/// The same op on the reference and the device `g`; asserts and prints the error.
fn check(
    g: &Cuda,
    label: &str,
    inputs: &[&[f32]],
    out_len: usize,
    tol: f64,
    op_cpu: impl FnOnce(&Cpu, &[Vec<f32>], &mut Vec<f32>),
    op_gpu: impl FnOnce(&Cuda, &[<Cuda as Backend>::Tensor], &mut <Cuda as Backend>::Tensor),
) {
    let want = run(&Cpu::reference(), inputs, out_len, op_cpu);
    let got = run(g, inputs, out_len, op_gpu);
    let e = rel_err(&got, &want);
    println!("check {label:<44} rel_err {e:.2e}");
    assert!(e < tol, "{label}: rel err {e:.2e} over {tol:.0e}");
}

/// The same op on both, written once: a macro because the two backends' tensor types
/// differ and a closure cannot be generic. `on g;` first: on device `g` rather than
/// [`gpu`].
macro_rules! both {
    ($label:expr, $inputs:expr, $out_len:expr, $tol:expr, |$b:ident, $t:ident, $o:ident| $body:expr) => {
        both!(on gpu().expect("checked by the caller"); $label, $inputs, $out_len, $tol, |$b, $t, $o| $body)
    };
    (on $g:expr; $label:expr, $inputs:expr, $out_len:expr, $tol:expr, |$b:ident, $t:ident, $o:ident| $body:expr) => {
        check(
            $g,
            $label,
            $inputs,
            $out_len,
            $tol,
            |$b, $t, $o| $body,
            |$b, $t, $o| $body,
        )
    };
}

/// `parts` (each a tensor and how many of its values) laid out one after another in
/// `out`, as rows of width 1 so that any offset can be written.
fn concat<B: Backend>(b: &B, parts: &[(&B::Tensor, usize)], out: &mut B::Tensor) {
    let mut at = 0;
    for &(t, n) in parts {
        b.write_rows(t, out, at, n, 1);
        at += n;
    }
}

/// A random matrix quantized to MLX 4 bits and repacked at `bits`.
type Affine = AffineMatrix;

fn affine(rows: usize, cols: usize, bits: u32, salt: u64) -> Affine {
    AffineMatrix::quantize(&fresh(rows * cols, salt), rows, cols, bits).unwrap()
}

mod attention;
mod end_to_end;
mod moe;
mod ops;
mod quantized;

//! The kernels as one NVRTC program, and every kernel's name and parameter list.
//!
//! The CUDA C sources are kept one op family a file under `kernels/`, and compiled as one
//! program: the files one after another in `kernels/program.cu`'s order, `common.cuh`
//! first. Each kernel so compiles as it would from a single file (same text, same
//! machine code), and NVRTC runs once per device.
//!
//! Each family's launcher file (norm.rs, matvec.rs, ...) names its kernels as constants
//! and writes each parameter list once, as an [`Args`](super::launch::Args) type;
//! [`SIGNATURES`] lists them all, which is what the backend loads. The host tests below
//! check the lists against the sources: every kernel the sources define is loaded, by
//! one parameter list, whose names and types are the kernel's; and the constants the
//! host mirrors from the sources' `#define`s agree.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use super::launch::{signature, Signature};
use super::{
    affine, affine_mma, attention, driver, expert_gemm, matvec, norm, route, routed, sample, vq,
    vq_mma, CudaError,
};
use crate::codec::vq::codebook::fnv1a;
use crate::store::atomic;

/// The kernel sources by file, in the order `kernels/program.cu` includes them: joined,
/// they are one NVRTC program ([`source`]).
pub const SOURCES: [(&str, &str); 12] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("norm.cu", include_str!("kernels/norm.cu")),
    ("matvec.cu", include_str!("kernels/matvec.cu")),
    ("affine.cu", include_str!("kernels/affine.cu")),
    ("affine_mma.cu", include_str!("kernels/affine_mma.cu")),
    ("expert_gemm.cu", include_str!("kernels/expert_gemm.cu")),
    ("route.cu", include_str!("kernels/route.cu")),
    ("routed.cu", include_str!("kernels/routed.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("vq.cu", include_str!("kernels/vq.cu")),
    ("vq_mma.cu", include_str!("kernels/vq_mma.cu")),
    ("sample.cu", include_str!("kernels/sample.cu")),
];

/// The kernels' CUDA C source: [`SOURCES`] one after another, as `kernels/program.cu`
/// includes them.
pub fn source() -> &'static str {
    static SOURCE: OnceLock<String> = OnceLock::new();
    SOURCE.get_or_init(|| SOURCES.iter().map(|(_, s)| *s).collect())
}

/// Every parameter list of the sources, each with the kernels that take it.
pub(super) const SIGNATURES: &[Signature] = &[
    signature::<norm::Fill>(),
    signature::<norm::Embed>(),
    signature::<norm::Bf16ToF32>(),
    signature::<norm::SplitBf16>(),
    signature::<norm::RmsNorm>(),
    signature::<norm::RmsNormInplace>(),
    signature::<norm::AddRmsNorm>(),
    signature::<norm::AddRmsNormTo>(),
    signature::<norm::AddBias>(),
    signature::<norm::Add>(),
    signature::<norm::SiluMul>(),
    signature::<norm::ClampValues>(),
    signature::<norm::SoftmaxRows>(),
    signature::<norm::Rope>(),
    signature::<norm::GatherRows>(),
    signature::<norm::ScatterAddRows>(),
    signature::<norm::CopyF4>(),
    signature::<norm::WriteRowAt>(),
    signature::<norm::AdvanceStep>(),
    signature::<matvec::Matvec>(),
    signature::<matvec::Matvec3>(),
    signature::<matvec::MatvecNormOneLate>(),
    signature::<affine::AffineMatvec>(),
    signature::<affine::AffineDequant>(),
    signature::<affine::AffineGather>(),
    signature::<affine::AffineGateUp>(),
    signature::<affine::AffineDown>(),
    signature::<affine::AffineRoutedGateUp>(),
    signature::<affine::AffineRoutedDown>(),
    signature::<affine::MoeCombine>(),
    signature::<affine_mma::DenseMma>(),
    signature::<affine_mma::DenseMmaNorm>(),
    signature::<expert_gemm::ExpertMmaGateUp>(),
    signature::<expert_gemm::ExpertMmaDown>(),
    signature::<expert_gemm::MoeGroupPairs>(),
    signature::<route::MoeRoute>(),
    signature::<route::ArgmaxRows>(),
    signature::<routed::RoutedMmaGateUp>(),
    signature::<routed::RoutedMmaDown>(),
    signature::<routed::AffineTilesFromRows>(),
    signature::<attention::Attention>(),
    signature::<attention::AttnPreambleAt>(),
    signature::<attention::AttentionSplit>(),
    signature::<attention::AttentionGroup>(),
    signature::<attention::AttentionCombine>(),
    signature::<attention::AttentionTiled>(),
    signature::<attention::AttentionGroupRows>(),
    signature::<affine_mma::DenseMmaRows>(),
    signature::<attention::CacheWriteRows>(),
    signature::<vq::VqRotate>(),
    signature::<vq::VqMatvec>(),
    signature::<vq::VqDecode>(),
    signature::<vq::VqGather>(),
    signature::<vq::RoutedVqRotate>(),
    signature::<vq::RoutedVqGateUp>(),
    signature::<vq::RoutedVqDown>(),
    signature::<vq_mma::VqExpertMmaGateUp>(),
    signature::<vq_mma::VqExpertMmaDown>(),
    signature::<vq_mma::RoutedVqGateUpMma>(),
    signature::<vq_mma::RoutedVqDownMma>(),
    signature::<sample::SampleScale>(),
    signature::<sample::SampleHist>(),
    signature::<sample::SampleCut>(),
    signature::<sample::SampleGather>(),
    signature::<sample::SampleSettle>(),
    signature::<sample::SampleDraw>(),
    signature::<sample::CountToken>(),
];

/// Every kernel of [`SIGNATURES`].
fn kernel_names() -> impl Iterator<Item = &'static str> {
    SIGNATURES.iter().flat_map(|s| s.kernels.iter().copied())
}

/// A kernel's builds, one for each of `keys`: the bits of its affine words, the values of
/// its VQ vectors or the widest head it takes ([`builds!`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Builds<const N: usize> {
    pub keys: [u32; N],
    pub names: [&'static str; N],
}

impl<const N: usize> Builds<N> {
    /// The build for `key`, if the kernel has one.
    pub fn get(&self, key: u32) -> Option<&'static str> {
        let at = self.keys.iter().position(|&k| k == key)?;
        Some(self.names[at])
    }

    /// The build for `key`; a caller asks only for one the kernel has.
    pub fn of(&self, key: u32) -> &'static str {
        self.get(key).unwrap_or_else(|| {
            panic!(
                "no build of {} for {key} (only {:?})",
                self.names[0], self.keys
            )
        })
    }
}

impl Builds<3> {
    /// These builds and those of `other`, one list.
    pub const fn and(&self, other: &Builds<2>) -> [&'static str; 5] {
        let (a, b) = (self.names, other.names);
        [a[0], a[1], a[2], b[0], b[1]]
    }
}

/// The [`Builds`] of kernel `$name`: `$name` then each suffix, for its key.
macro_rules! builds {
    ($name:literal: $($key:literal => $suffix:literal),+) => {
        $crate::backend::cuda::program::Builds {
            keys: [$($key),+],
            names: [$(concat!($name, $suffix)),+],
        }
    };
}
pub(super) use builds;

/// The builds of kernel `$name` for affine words of 4, 3 and 2 bits, as stored.
macro_rules! bits {
    ($name:literal) => {
        $crate::backend::cuda::program::builds!($name: 4 => "_q4", 3 => "_q3", 2 => "_q2")
    };
}
pub(super) use bits;

/// The builds of kernel `$name` for affine words of 4 and 2 bits in unit tiles
/// ([`unit_tiles`](super::affine::unit_tiles)).
macro_rules! tiled {
    ($name:literal) => {
        $crate::backend::cuda::program::builds!($name: 4 => "_tiled_q4", 2 => "_tiled_q2")
    };
}
pub(super) use tiled;

/// The builds of VQ kernel `$name` for vectors of 2, 4, 8 and 16 values; with `mma`, of
/// a tensor-core kernel, whose fragments take whole vectors of 4 values and up.
macro_rules! dims {
    (mma $name:literal) => {
        $crate::backend::cuda::program::builds!($name: 4 => "_p4", 8 => "_p8", 16 => "_p16")
    };
    ($name:literal) => {
        $crate::backend::cuda::program::builds!(
            $name: 2 => "_p2", 4 => "_p4", 8 => "_p8", 16 => "_p16"
        )
    };
}
pub(super) use dims;

/// The kernel constants [`Tuning::defines`](super::Tuning::defines) may set: those the
/// source leaves to be defined first (`#ifndef NAME`) and the instruments it builds only
/// when asked (`#ifdef NAME`).
pub(super) fn tunables() -> Vec<&'static str> {
    let mut names: Vec<&str> = source()
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            l.strip_prefix("#ifndef ")
                .or_else(|| l.strip_prefix("#ifdef "))
        })
        .map(str::trim)
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// PTX of [`source`] per architecture and kernel constants
/// ([`Tuning::defines`](super::Tuning::defines)): compiled once per process, and kept
/// between runs in the kernel cache ([`cache_dir`]), so that only a program's first run
/// on a machine waits for NVRTC. (The driver keeps its own cache of the machine code it
/// makes from PTX, keyed by the PTX's text, so an unchanged PTX loads without that step
/// as well.)
pub(super) fn ptx_for(arch: &str, defines: &[(String, String)]) -> Result<Ptx, CudaError> {
    static CACHE: OnceLock<Mutex<HashMap<Vec<String>, String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut cache = cache.lock().expect("PTX cache lock");
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    options.extend(defines.iter().map(|(n, v)| format!("-D{n}={v}")));
    if let Some(src) = cache.get(&options) {
        return Ok(Ptx::from_src(src.clone()));
    }
    let kept = CachedPtx::new(arch, &options, &nvrtc_version());
    let dir = cache_dir();
    if let Some(ptx) = dir.as_deref().and_then(|d| kept.read(d)) {
        cache.insert(options, ptx.clone());
        return Ok(Ptx::from_src(ptx));
    }
    let opts = CompileOptions {
        options: options.clone(),
        ..CompileOptions::default()
    };
    let ptx = compile_ptx_with_opts(source(), opts).map_err(|e| CudaError::Compile {
        arch: arch.to_string(),
        log: match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        },
    })?;
    let text = ptx.to_src();
    if let Some(dir) = dir {
        // A cache that cannot be written (a read-only home) only costs the next run the
        // compile again.
        let _ = kept.write(&dir, &text);
    }
    cache.insert(options, text);
    Ok(ptx)
}

/// Where compiled kernels are kept between runs: `$XDG_CACHE_HOME/dynmoe/kernels`, else
/// `$HOME/.cache/dynmoe/kernels`; none when neither is set.
fn cache_dir() -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => PathBuf::from(std::env::var_os("HOME").filter(|v| !v.is_empty())?).join(".cache"),
    };
    Some(base.join("dynmoe").join("kernels"))
}

/// NVRTC's version, `major.minor`: PTX is kept per compiler, as a newer one's may not
/// load under an older driver.
fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters the call writes.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    match r {
        cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS => format!("{major}.{minor}"),
        _ => "unknown".into(),
    }
}

/// One program's entry in the kernel cache: a file named by a hash of everything its PTX
/// follows from (the source, the compile options, the compiler), whose first line states
/// all of that and the PTX's own hash, checked when it is read. An entry that does not
/// match, damaged or cut short, is compiled again and overwritten; entries are written
/// through a temporary file and renamed, so a crash leaves none half-written.
struct CachedPtx {
    /// The first line, less the PTX's hash.
    key: String,
    file: String,
}

impl CachedPtx {
    fn new(arch: &str, options: &[String], nvrtc: &str) -> CachedPtx {
        Self::of(arch, options, nvrtc, source())
    }

    fn of(arch: &str, options: &[String], nvrtc: &str, source: &str) -> CachedPtx {
        let key = format!(
            "// dynmoe kernels: nvrtc {nvrtc}; source fnv1a64:{:016x} of {} bytes; options {}",
            fnv1a(source.as_bytes()),
            source.len(),
            options.join(" ")
        );
        let file = format!("{arch}-{:016x}.ptx", fnv1a(key.as_bytes()));
        CachedPtx { key, file }
    }

    /// The PTX kept in `dir`, if this entry is there whole.
    fn read(&self, dir: &Path) -> Option<String> {
        let text = std::fs::read_to_string(dir.join(&self.file)).ok()?;
        let (first, ptx) = text.split_once('\n')?;
        let hash = first.strip_prefix(self.key.as_str())?;
        (hash == format!("; ptx fnv1a64:{:016x}", fnv1a(ptx.as_bytes())) && !ptx.is_empty())
            .then(|| ptx.to_string())
    }

    fn write(&self, dir: &Path, ptx: &str) -> Result<(), crate::store::Error> {
        std::fs::create_dir_all(dir).map_err(|e| crate::store::Error::Io {
            path: dir.to_path_buf(),
            source: e,
        })?;
        let first = format!("{}; ptx fnv1a64:{:016x}\n", self.key, fnv1a(ptx.as_bytes()));
        atomic::write_file(&dir.join(&self.file), (first + ptx).as_bytes())
    }
}

/// The kernels of [`source`], loaded by the names of [`SIGNATURES`].
pub(super) struct Kernels {
    pub module: Arc<CudaModule>,
    pub f: HashMap<&'static str, CudaFunction>,
}

impl Kernels {
    /// Loads `ptx` into `ctx` and finds every kernel of [`SIGNATURES`] in it.
    pub fn load(ctx: &Arc<CudaContext>, ptx: Ptx) -> Result<Kernels, CudaError> {
        let module = driver(ctx.load_module(ptx))?;
        let mut f = HashMap::new();
        for name in kernel_names() {
            f.insert(name, driver(module.load_function(name))?);
        }
        Ok(Kernels { module, f })
    }
}

#[cfg(test)]
mod tests {
    use super::super::launch::Param;
    use super::{kernel_names, source, SIGNATURES, SOURCES};

    /// A `__global__` entry of the source: its name (a macro's expanded once per
    /// top-level use of the macro, each `##PARAM` replaced by that use's argument) and its
    /// parameters' types and names.
    #[derive(Debug)]
    struct Entry {
        name: String,
        params: Vec<(Param, String)>,
    }

    /// The source with line continuations joined, as the preprocessor reads it.
    fn joined() -> String {
        source().replace("\\\n", " ")
    }

    /// The value of each object-like `#define NAME VALUE` (the last one where a name is
    /// defined more than once), comments dropped.
    fn object_macros(src: &str) -> Vec<(String, String)> {
        src.lines()
            .filter_map(|l| l.trim_start().strip_prefix("#define "))
            .filter_map(|l| {
                let end = l
                    .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .unwrap_or(l.len());
                let (name, rest) = l.split_at(end);
                // `NAME(` is a function-like macro.
                (!rest.starts_with('(')).then(|| {
                    let value = rest.split("//").next().unwrap_or("").trim();
                    (name.to_string(), value.to_string())
                })
            })
            .collect()
    }

    /// `text` with each whole word that names one of `macros` replaced by its value.
    fn expand(text: &str, macros: &[(String, String)]) -> String {
        let mut out = String::new();
        let mut word = String::new();
        let flush = |word: &mut String, out: &mut String| {
            match macros.iter().rev().find(|(n, _)| n == word) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(word),
            }
            word.clear();
        };
        for c in text.chars() {
            if c.is_alphanumeric() || c == '_' {
                word.push(c);
            } else {
                flush(&mut word, &mut out);
                out.push(c);
            }
        }
        flush(&mut word, &mut out);
        out
    }

    /// A parameter's type as the source writes it.
    fn param_type(ty: &str) -> Param {
        if ty.contains('*') {
            return Param::Ptr;
        }
        let words: Vec<&str> = ty
            .split_whitespace()
            .filter(|w| !matches!(*w, "const" | "__restrict__"))
            .collect();
        match words.join(" ").as_str() {
            "int" => Param::I32,
            "unsigned" | "unsigned int" => Param::U32,
            "long long" => Param::I64,
            "unsigned long long" => Param::U64,
            "float" => Param::F32,
            other => panic!("a kernel parameter of type `{other}`"),
        }
    }

    /// The `__global__` entries of the source.
    fn entries() -> Vec<Entry> {
        let src = joined();
        let macros = object_macros(&src);
        let mut out = Vec::new();
        let mut at = 0;
        while let Some(found) = src[at..].find("__global__ void") {
            let start = at + found;
            at = start + "__global__ void".len();
            let mut rest = src[at..].trim_start();
            if let Some(bounds) = rest.strip_prefix("__launch_bounds__") {
                rest = bounds.split_once(')').map_or("", |(_, r)| r).trim_start();
            }
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '#'))
                .unwrap_or(rest.len());
            let name = rest[..end].to_string();
            let list = rest[end..]
                .trim_start()
                .strip_prefix('(')
                .expect("a parameter list");
            let list = &list[..list.find(')').expect("a parameter list's end")];
            let params = expand(list, &macros)
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let split = p
                        .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .expect("a type before the name");
                    (param_type(&p[..=split]), p[split + 1..].to_string())
                })
                .collect::<Vec<_>>();
            if !name.contains("##") {
                out.push(Entry { name, params });
                continue;
            }
            // The macro that holds this entry: the last `#define M(params)` before it.
            let define = src[..start]
                .rfind("#define ")
                .expect("a macro entry's #define");
            let head = &src[define + "#define ".len()..];
            let (macro_name, rest) = head.split_once('(').expect("a macro with parameters");
            let names: Vec<&str> = rest
                .split_once(')')
                .expect("a macro's parameter list")
                .0
                .split(',')
                .map(str::trim)
                .collect();
            let uses = src.lines().filter_map(|line| {
                line.strip_prefix(macro_name)?
                    .strip_prefix('(')?
                    .split_once(')')
                    .map(|(args, _)| args)
            });
            for args in uses {
                let mut expanded = name.clone();
                for (param, arg) in names.iter().zip(args.split(',').map(str::trim)) {
                    expanded = expanded.replace(&format!("##{param}"), arg);
                }
                out.push(Entry {
                    name: expanded,
                    params: params.clone(),
                });
            }
        }
        out
    }

    #[test]
    fn every_kernel_the_source_defines_is_loaded() {
        // The host finds a function only by a name of SIGNATURES, and a name there that
        // the source lacks fails the module's load.
        let entries = entries();
        assert!(
            entries.iter().any(|e| e.name == "expert_mma_down_tiled_q2"),
            "macro uses expand: {entries:?}"
        );
        let names: Vec<&str> = kernel_names().collect();
        let missing: Vec<_> = entries
            .iter()
            .filter(|e| !names.contains(&e.name.as_str()))
            .map(|e| &e.name)
            .collect();
        assert!(missing.is_empty(), "kernels no launcher names: {missing:?}");
        let unknown: Vec<_> = names
            .iter()
            .filter(|k| !entries.iter().any(|e| e.name == **k))
            .collect();
        assert!(
            unknown.is_empty(),
            "kernel names the source does not define: {unknown:?}"
        );
        // Each kernel in one parameter list, once.
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "a kernel named twice");
        assert_eq!(names.len(), entries.len(), "a kernel defined twice");
    }

    #[test]
    fn every_launch_passes_what_the_kernel_declares() {
        let entries = entries();
        let mut wrong = Vec::new();
        for sig in SIGNATURES {
            assert_eq!(
                (sig.params)().len(),
                (sig.names)().len(),
                "{:?}",
                sig.kernels
            );
            for kernel in sig.kernels {
                let e = entries
                    .iter()
                    .find(|e| e.name == *kernel)
                    .unwrap_or_else(|| panic!("{kernel} is not in the source"));
                let declared: Vec<(Param, &str)> =
                    e.params.iter().map(|(p, n)| (*p, n.as_str())).collect();
                let passed: Vec<(Param, &str)> =
                    (sig.params)().into_iter().zip((sig.names)()).collect();
                if passed != declared {
                    wrong.push(format!(
                        "{kernel}: passes {passed:?}, declares {declared:?}"
                    ));
                }
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    /// The value of the source's `#define name`, worked out (integers, `+ - * <<`,
    /// parentheses and other defines).
    fn define(name: &str) -> i64 {
        let macros = object_macros(&joined());
        let value = &macros
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no #define {name}"))
            .1;
        let mut tokens: Vec<String> = Vec::new();
        let mut word = String::new();
        for c in expand(value, &macros).chars() {
            if c.is_alphanumeric() || c == '_' {
                word.push(c);
                continue;
            }
            if !word.is_empty() {
                tokens.push(std::mem::take(&mut word));
            }
            match c {
                // The second `<` of a shift.
                '<' if tokens.last().is_some_and(|t| t == "<") => {
                    tokens.pop();
                    tokens.push("<<".into());
                }
                c if c.is_whitespace() => {}
                c => tokens.push(c.to_string()),
            }
        }
        if !word.is_empty() {
            tokens.push(word);
        }
        let mut at = 0;
        let v = shift(&tokens, &mut at);
        assert_eq!(at, tokens.len(), "#define {name} {value}: {tokens:?}");
        v
    }

    fn shift(t: &[String], at: &mut usize) -> i64 {
        let mut v = sum(t, at);
        while t.get(*at).is_some_and(|s| s == "<<") {
            *at += 1;
            v <<= sum(t, at);
        }
        v
    }

    fn sum(t: &[String], at: &mut usize) -> i64 {
        let mut v = product(t, at);
        while let Some(op) = t.get(*at).filter(|s| *s == "+" || *s == "-") {
            let add = op == "+";
            *at += 1;
            let r = product(t, at);
            v = if add { v + r } else { v - r };
        }
        v
    }

    fn product(t: &[String], at: &mut usize) -> i64 {
        let mut v = atom(t, at);
        while t.get(*at).is_some_and(|s| s == "*") {
            *at += 1;
            v *= atom(t, at);
        }
        v
    }

    fn atom(t: &[String], at: &mut usize) -> i64 {
        let tok = &t[*at];
        *at += 1;
        if tok == "(" {
            let v = shift(t, at);
            assert_eq!(t[*at], ")");
            *at += 1;
            return v;
        }
        // An unsigned literal's `u` changes its type, not its value.
        let digits = tok.strip_suffix('u').unwrap_or(tok);
        digits
            .parse()
            .unwrap_or_else(|_| panic!("`{tok}` in a #define"))
    }

    #[test]
    fn the_constants_the_host_mirrors_agree_with_the_source() {
        use super::super::*;
        let mirrored: &[(&str, usize)] = &[
            ("MV_MAXB", matvec::MATVEC_MAX_BATCH),
            ("VQ_MAXB", matvec::MATVEC_MAX_BATCH),
            ("MV_ONE_COLS", matvec::MV_ONE_COLS),
            ("NORM_WARP_DIM", norm::NORM_WARP_DIM),
            ("AFF_MAXB", affine::AFFINE_MAX_BATCH),
            ("AFF_WARPS", affine::AFFINE_WARPS),
            ("GROUP_ENTRY", affine::GROUP_ENTRY),
            ("ROUTED_ENTRY", affine::ROUTED_ENTRY),
            ("ROUTED_ROWS", affine::ROUTED_ROWS),
            ("RMMA_ROWS", affine_mma::RMMA_ROWS),
            ("RMMA_WARPS", affine_mma::RMMA_WARPS),
            ("RMMA_DOWN_WARPS", affine_mma::RMMA_DOWN_WARPS),
            ("RMMA_UNIT", affine_mma::RMMA_UNIT),
            ("DMMA_BLOCKS", affine_mma::DMMA_BLOCKS),
            ("GATE_UP_POINTERS", routed::GATE_UP_POINTERS),
            ("MMA_BM", expert_gemm::EXPERT_TILE_ROWS),
            ("MMA_BN", expert_gemm::EXPERT_TILE_OUTPUTS),
            ("ROUTE_SHARED_MAX", route::ROUTE_SHARED_MAX),
            ("ARGMAX_THREADS", route::ARGMAX_THREADS),
            ("PRE_PAIRS", attention::PRE_PAIRS),
            ("ATT_GROUP", attention::ATT_GROUP),
            ("ATT_THREADS", attention::ATT_THREADS as usize),
            ("ATT_CHUNK_MAX", attention::ATT_CHUNK_MAX),
            ("COMBINE_THREADS", attention::COMBINE_THREADS as usize),
            ("PA_BM", attention::PA_BM),
            ("PA_BN", attention::PA_BN),
            ("PA_THREADS", attention::PA_THREADS as usize),
            ("VQ_WARPS", vq::VQ_WARPS),
            ("VQR_WARPS", vq::VQR_WARPS),
            ("VQR_GATE_UP_ROWS", vq::VQR_GATE_UP_ROWS),
            ("VQR_DOWN_ROWS", vq::VQR_DOWN_ROWS),
            ("VQR_PREFETCH_BOOK", vq::VQR_SHARED_BOOK),
            ("VQG_WARPS", vq_mma::VQG_WARPS),
            ("VQG_LDU", vq_mma::VQG_LDU),
            ("VQM_TILES", vq_mma::VQM_TILES),
            ("PHASE_SLOTS", PHASE_SLOTS),
            ("SAMPLE_BINS", crate::backend::sample::BINS),
            ("SAMPLE_SORT_MAX", crate::backend::sample::BIN_SORT_MAX),
            ("SAMPLE_THREADS", sample::SAMPLE_THREADS),
            ("SAMPLE_HIST_SHARED", sample::HIST_SHARED),
            ("NOT_A_TOKEN", crate::backend::NOT_A_TOKEN as usize),
        ];
        for &(name, host) in mirrored {
            assert_eq!(define(name), host as i64, "#define {name}");
        }
        // A step of the grouped decode attention's score pass: a block's lane groups.
        assert_eq!(
            attention::ATT_STEP as i64,
            define("ATT_THREADS") / define("ATT_LANES")
        );
    }

    #[test]
    fn the_sources_are_what_program_cu_includes_in_its_order() {
        let includes: Vec<&str> = include_str!("kernels/program.cu")
            .lines()
            .filter_map(|l| l.strip_prefix("#include \"")?.strip_suffix('"'))
            .collect();
        let names: Vec<&str> = SOURCES.iter().map(|(n, _)| *n).collect();
        assert_eq!(includes, names);
        // Every kernel file is one of them.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda/kernels");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| f != "program.cu")
            .collect();
        files.sort();
        let mut names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        names.sort();
        assert_eq!(files, names);
    }

    #[test]
    fn a_kept_ptx_reads_back_and_a_damaged_or_different_one_does_not() {
        use super::CachedPtx;
        let tmp = crate::testing::TempDir::new("kernel-cache");
        let opts = vec!["--gpu-architecture=sm_90".to_string(), "-DA=1".into()];
        let entry = CachedPtx::of("sm_90", &opts, "13.0", "kernel source");
        assert_eq!(entry.read(tmp.dir()), None, "nothing kept yet");
        let ptx = ".version 8.0\n.target sm_90\n// body\n";
        entry.write(tmp.dir(), ptx).unwrap();
        assert_eq!(entry.read(tmp.dir()).as_deref(), Some(ptx));

        // Another source, options or compiler is another entry (another file, and a first
        // line that would not match even under the same name).
        for other in [
            CachedPtx::of("sm_90", &opts, "13.0", "kernel sourcf"),
            CachedPtx::of("sm_90", &opts[..1], "13.0", "kernel source"),
            CachedPtx::of("sm_90", &opts, "12.8", "kernel source"),
        ] {
            assert_ne!(other.file, entry.file);
            let renamed = CachedPtx {
                key: other.key.clone(),
                file: entry.file.clone(),
            };
            assert_eq!(renamed.read(tmp.dir()), None);
        }

        // Damage anywhere in the PTX, or a file cut short, is not read as PTX.
        let path = tmp.dir().join(&entry.file);
        let whole = std::fs::read(&path).unwrap();
        let mut flipped = whole.clone();
        let last = flipped.len() - 3;
        flipped[last] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        assert_eq!(entry.read(tmp.dir()), None);
        std::fs::write(&path, &whole[..whole.len() - 5]).unwrap();
        assert_eq!(entry.read(tmp.dir()), None);
        std::fs::write(&path, b"").unwrap();
        assert_eq!(entry.read(tmp.dir()), None);
        // Written again, it reads back.
        entry.write(tmp.dir(), ptx).unwrap();
        assert_eq!(entry.read(tmp.dir()).as_deref(), Some(ptx));
    }
}

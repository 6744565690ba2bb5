//! Making the CUDA backend: the libraries probed for, the context and its one stream,
//! the kernels compiled for the device and loaded, and what the device grants them
//! (shared memory beyond the default, multiprocessors), measured once here.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaContext;

use super::launch::Args;
use super::program::{self, Kernels};
use super::{
    affine_mma, attention, driver, routed, sample, vq, vq_mma, Cuda, Tuning, SHARED_LIMIT,
};

/// Why the CUDA backend could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library is not installed or not on the loader's path.
    #[error("CUDA is not available: {library} could not be loaded ({hint})")]
    Unavailable {
        /// The library looked for.
        library: &'static str,
        /// What to check.
        hint: &'static str,
    },
    /// The driver refused a call (no device, a device fault).
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// NVRTC rejected the kernels.
    #[error("NVRTC could not compile the kernels for {arch}: {log}")]
    Compile {
        /// Target architecture.
        arch: String,
        /// Compiler output.
        log: String,
    },
    /// cuBLAS could not be set up.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// `DYNMOE_CUDA` holds an item [`Tuning::parse`] does not take.
    #[error("DYNMOE_CUDA: `{item}`: {expected}")]
    Tuning {
        /// The item.
        item: String,
        /// What it should be.
        expected: String,
    },
}

/// Whether the driver, NVRTC and cuBLAS libraries can be loaded, without touching a
/// device. `Err` names the first one missing.
pub fn probe() -> Result<(), CudaError> {
    // SAFETY: each call only tries to open the shared library by its usual names.
    let present = unsafe {
        [
            (
                cudarc::driver::sys::is_culib_present(),
                "libcuda (the NVIDIA driver)",
            ),
            (cudarc::nvrtc::sys::is_culib_present(), "libnvrtc"),
            (cudarc::cublas::sys::is_culib_present(), "libcublas"),
        ]
    };
    for (ok, library) in present {
        if !ok {
            return Err(CudaError::Unavailable {
                library,
                hint: "install the CUDA 13 runtime or add its lib directory to LD_LIBRARY_PATH",
            });
        }
    }
    Ok(())
}

impl Cuda {
    /// The backend on device `ordinal`, tuned as `DYNMOE_CUDA` says ([`Tuning::from_env`]).
    pub fn new(ordinal: usize) -> Result<Cuda, CudaError> {
        Self::with_tuning(ordinal, Tuning::from_env()?)
    }

    /// The backend on device `ordinal`, run as `tuning` says: probes for the libraries,
    /// makes the context, compiles the kernels for the device's compute capability (with
    /// the tuning's constants) and loads them.
    pub fn with_tuning(ordinal: usize, tuning: Tuning) -> Result<Cuda, CudaError> {
        use cudarc::driver::sys::CUdevice_attribute;
        probe()?;
        let ctx = driver(CudaContext::new(ordinal))?;
        // One stream carries every op in order; per-buffer events would only add work.
        // SAFETY: no buffer of this context is ever used on another stream.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = driver(ctx.compute_capability())?;
        let arch = format!("sm_{major}{minor}");
        let device_name = driver(ctx.name())?;
        let sms =
            driver(ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT))?
                as usize;
        let ptx = program::ptx_for(&arch, &tuning.defines)?;
        let dmma_blocks = match tuning.define("DMMA_BLOCKS") {
            Some(v) => v.parse().map_err(|_| CudaError::Tuning {
                item: format!("define=DMMA_BLOCKS={v}"),
                expected: "a count of blocks".into(),
            })?,
            None => affine_mma::DMMA_BLOCKS,
        };
        let k = Kernels::load(&ctx, ptx)?;
        let f = &k.f;
        // The tiled prefill kernels take more than the 48 KB of shared memory a block gets
        // without asking (107 KB at a head of 128); a device that allows less keeps the
        // per-row kernel for those widths.
        let optin =
            driver(ctx.attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            ))? as usize;
        let mut tiled_head_dim = 0;
        for width in [64, 128, 256] {
            let bytes = attention::tiled_shared(width);
            let name = attention::ATTENTION_TILED.of(width as u32);
            if !routed::grant_shared(f, &[name], bytes, optin) {
                break;
            }
            tiled_head_dim = width;
        }
        // The routed VQ kernels and the VQ GEMMs copy a book into shared memory beside
        // their activations: they may take the device's opt-in where every one of them
        // was granted it, else what a block gets without asking (and read the book
        // through L1).
        let vq_kernels: Vec<&str> = [
            <vq::RoutedVqGateUp as Args>::KERNELS,
            <vq::RoutedVqDown as Args>::KERNELS,
            <vq_mma::RoutedVqGateUpMma as Args>::KERNELS,
            <vq_mma::RoutedVqDownMma as Args>::KERNELS,
            <vq_mma::VqExpertMmaGateUp as Args>::KERNELS,
            <vq_mma::VqExpertMmaDown as Args>::KERNELS,
        ]
        .concat();
        let vq_routed_shared = if routed::grant_shared(f, &vq_kernels, optin, optin) {
            optin
        } else {
            SHARED_LIMIT
        };
        let down_alone = routed::down_alone(&ctx, f, optin)?;
        let samples = routed::grant_shared(
            f,
            &[sample::SAMPLE_HIST, sample::SAMPLE_SETTLE],
            sample::SETTLE_SHARED,
            optin,
        );
        // A stream of its own: the legacy default stream cannot be recorded into a graph.
        let stream = driver(ctx.new_stream())?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Blas(format!("{e:?}")))?;
        let copies = driver(ctx.new_stream())?;
        let down_ready = driver(stream.alloc_zeros::<u32>(2))?;
        let timeline = k
            .module
            .get_global("timeline_count", &stream)
            .is_ok()
            .then(|| Mutex::new(Vec::new()));
        Ok(Cuda {
            ctx,
            stream,
            copies,
            blas,
            k,
            arch,
            device_name,
            affine: Mutex::new(HashMap::new()),
            vq: Mutex::new(HashMap::new()),
            vq_books: Mutex::new(HashMap::new()),
            vq_scratch: Mutex::new(None),
            constants: Mutex::new(Vec::new()),
            routed: Mutex::new(HashMap::new()),
            routed_scratch: Mutex::new(None),
            graphs: Mutex::new(Vec::new()),
            reads: Mutex::new(Vec::new()),
            attn_scratch: Mutex::new(None),
            argmax_scratch: Mutex::new(None),
            dense_scratch: Mutex::new(None),
            split_scratch: Mutex::new(None),
            sample_scratch: Mutex::new(None),
            samples,
            tensor_cores: major >= 8 && tuning.tensor_cores,
            down_ready,
            down_alone,
            bf16_one_row_dense: AtomicBool::new(false),
            programmatic: major >= 9 && tuning.pdl,
            dmma_blocks,
            tuning,
            timeline,
            tiled_head_dim,
            vq_routed_shared,
            sms,
        })
    }
}

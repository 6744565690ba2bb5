//! Kernel launches through `cuLaunchKernelEx`, so that a launch can ask for programmatic
//! dependent launch: on sm_90 and later the next kernel on the stream is scheduled while
//! the one before it finishes, and waits in its first instruction (`PDL_ENTRY` in the
//! kernels) until that one's writes are visible. A decode step is a chain of small
//! kernels, each of which would otherwise wait for its predecessor to drain before it is
//! even scheduled. Recorded graphs keep the launches' programmatic edges.
//!
//! Each kernel's parameters are written once, as a struct of [`kernel_args!`] whose
//! fields are the parameters of the kernel's source in order, under the same names: a
//! call site names every value it passes, and the host test `every_launch_passes_what_the_kernel_declares`
//! (program.rs) checks each struct against the source.

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaStream, DriverError, LaunchConfig};

/// A device address passed as a kernel's pointer parameter; [`Ptr::NULL`] where the
/// kernel takes a null pointer to mean "none".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ptr(pub u64);

impl Ptr {
    pub const NULL: Ptr = Ptr(0);

    /// The address `n` floats (4 bytes each) past this one.
    pub fn floats(self, n: usize) -> Ptr {
        Ptr(self.0 + 4 * n as u64)
    }

    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

/// A kernel parameter's type as the source declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// Any pointer.
    Ptr,
    /// `int`.
    I32,
    /// `unsigned`.
    U32,
    /// `long long`.
    I64,
    /// `unsigned long long`.
    U64,
    /// `float`.
    F32,
}

/// Values a kernel takes as parameters: one (a pointer or a scalar, passed under the
/// name of the field that holds it) or a group of them ([`kernel_params!`], passed under
/// their own names, in order), each in the low bytes of a 64-bit slot (little-endian, so
/// a 4-byte parameter reads its value).
pub trait KernelParams {
    /// Appends the parameters' names; `field` names the field that holds them.
    fn names(field: &'static str, out: &mut Vec<&'static str>);
    /// Appends the parameters' types.
    fn params(out: &mut Vec<Param>);
    /// Appends the arguments' bits.
    fn bits(&self, out: &mut Vec<u64>);
}

macro_rules! one_param {
    ($($t:ty => $p:ident, |$v:ident| $bits:expr);* $(;)?) => {$(
        impl KernelParams for $t {
            fn names(field: &'static str, out: &mut Vec<&'static str>) {
                out.push(field);
            }
            fn params(out: &mut Vec<Param>) {
                out.push(Param::$p);
            }
            fn bits(&self, out: &mut Vec<u64>) {
                let $v = *self;
                out.push($bits);
            }
        }
    )*};
}

// Signed values go in as their bit pattern.
one_param! {
    Ptr => Ptr, |v| v.0;
    i32 => I32, |v| v as u32 as u64;
    u32 => U32, |v| v as u64;
    i64 => I64, |v| v as u64;
    u64 => U64, |v| v;
    f32 => F32, |v| v.to_bits() as u64;
}

/// One parameter list of the kernel sources and the kernels that take it.
pub trait Args: KernelParams {
    /// Every kernel these arguments launch (the variants of one parameter list).
    const KERNELS: &'static [&'static str];
}

/// The parameters' names of `P`, in order.
pub fn names<P: KernelParams>() -> Vec<&'static str> {
    let mut out = Vec::new();
    P::names("", &mut out);
    out
}

/// The parameters' types of `P`, in order.
pub fn params<P: KernelParams>() -> Vec<Param> {
    let mut out = Vec::new();
    P::params(&mut out);
    out
}

/// The parameter list of the kernels of one [`Args`] type, for the registry the kernels
/// are loaded from and checked by (program.rs).
#[derive(Clone, Copy, Debug)]
pub struct Signature {
    pub kernels: &'static [&'static str],
    // The tests that check each list against the source read these.
    #[cfg_attr(not(test), allow(dead_code))]
    pub names: fn() -> Vec<&'static str>,
    #[cfg_attr(not(test), allow(dead_code))]
    pub params: fn() -> Vec<Param>,
}

/// The [`Signature`] of `A`.
pub const fn signature<A: Args>() -> Signature {
    Signature {
        kernels: A::KERNELS,
        names: names::<A>,
        params: params::<A>,
    }
}

/// A struct of parameters: each field a parameter as the source names it, with its Rust
/// type ([`Ptr`], `i32`, `u32`, `i64`, `u64` or `f32`), or a group of parameters (another
/// struct of this macro, under any field name), in the source's order.
macro_rules! kernel_params {
    ($(#[$m:meta])* $name:ident => {
        $($(#[$fm:meta])* $field:ident: $ty:ty),* $(,)?
    }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug)]
        pub(super) struct $name {
            $($(#[$fm])* pub $field: $ty,)*
        }

        impl $crate::backend::cuda::launch::KernelParams for $name {
            fn names(_: &'static str, out: &mut Vec<&'static str>) {
                $(<$ty as $crate::backend::cuda::launch::KernelParams>::names(
                    stringify!($field),
                    out,
                );)*
            }
            fn params(out: &mut Vec<$crate::backend::cuda::launch::Param>) {
                $(<$ty as $crate::backend::cuda::launch::KernelParams>::params(out);)*
            }
            fn bits(&self, out: &mut Vec<u64>) {
                $($crate::backend::cuda::launch::KernelParams::bits(&self.$field, out);)*
            }
        }
    };
}
pub(super) use kernel_params;

/// A struct of one kernel's whole parameter list ([`kernel_params!`]), for the kernels of
/// `$kernels` (a `&'static [&'static str]`).
macro_rules! kernel_args {
    ($(#[$m:meta])* $name:ident for $kernels:expr => { $($body:tt)* }) => {
        $crate::backend::cuda::launch::kernel_params! { $(#[$m])* $name => { $($body)* } }

        impl $crate::backend::cuda::launch::Args for $name {
            const KERNELS: &'static [&'static str] = $kernels;
        }
    };
}
pub(super) use kernel_args;

/// Queues `func` on `stream` with `args`, programmatic where asked.
///
/// # Safety
/// `args` must be the parameters of `func` (the kernel of their [`Args::KERNELS`] of that
/// name), and every buffer they point into must stay allocated until the kernel has run.
pub unsafe fn launch<A: Args>(
    stream: &CudaStream,
    func: &CudaFunction,
    programmatic: bool,
    cfg: LaunchConfig,
    args: &A,
) -> Result<(), DriverError> {
    stream.context().bind_to_thread()?;
    let mut slots = Vec::with_capacity(24);
    args.bits(&mut slots);
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|a| a as *mut u64 as *mut c_void)
        .collect();
    // SAFETY: a plain C struct and union; zero is a valid value of every field.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: if programmatic {
            &mut attr
        } else {
            std::ptr::null_mut()
        },
        numAttrs: programmatic as u32,
    };
    // SAFETY: `params` points at one live slot per argument for the whole call; the
    // caller vouches that they are the kernel's.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }
}

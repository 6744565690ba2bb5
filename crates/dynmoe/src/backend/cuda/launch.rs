//! Kernel launches through `cuLaunchKernelEx`, so that a launch can ask for programmatic
//! dependent launch: on sm_90 and later the next kernel on the stream is scheduled while
//! the one before it finishes, and waits in its first instruction (`PDL_ENTRY` in the
//! kernels) until that one's writes are visible. A decode step is a chain of small
//! kernels, each of which would otherwise wait for its predecessor to drain before it is
//! even scheduled. Recorded graphs keep the launches' programmatic edges.

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DriverError,
    LaunchConfig,
};

/// A kernel argument as the bytes the kernel reads: a device address or a scalar, in
/// the low bytes of a 64-bit slot (little-endian, so a 4-byte parameter reads its value).
pub trait KernelArg {
    fn bits(&self, stream: &CudaStream) -> u64;
}

impl<T> KernelArg for CudaSlice<T> {
    fn bits(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}

impl<T> KernelArg for CudaView<'_, T> {
    fn bits(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}

impl<T> KernelArg for CudaViewMut<'_, T> {
    fn bits(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}

macro_rules! scalar_arg {
    ($($t:ty => $u:ty),*) => {$(
        impl KernelArg for $t {
            fn bits(&self, _: &CudaStream) -> u64 {
                // Sign or bit pattern into the slot's low bytes.
                *self as $u as u64
            }
        }
    )*};
}

scalar_arg!(u64 => u64, i64 => u64, i32 => u32, u32 => u32);

impl KernelArg for f32 {
    fn bits(&self, _: &CudaStream) -> u64 {
        self.to_bits() as u64
    }
}

/// One launch being built: the function and its arguments' bytes.
pub struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    programmatic: bool,
    args: Vec<u64>,
}

impl<'a> Launch<'a> {
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction, programmatic: bool) -> Self {
        Launch {
            stream,
            func,
            programmatic,
            args: Vec::with_capacity(16),
        }
    }

    /// The next argument, in the kernel's parameter order.
    pub fn arg<A: KernelArg + ?Sized>(&mut self, a: &A) -> &mut Self {
        self.args.push(a.bits(self.stream));
        self
    }

    /// Queues the kernel on the stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and size, and
    /// every buffer must stay allocated until the kernel has run.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        let mut params: Vec<*mut c_void> = self
            .args
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
            hStream: self.stream.cu_stream(),
            attrs: if self.programmatic {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: self.programmatic as u32,
        };
        // SAFETY: `params` points at one live slot per argument for the whole call; the
        // caller vouches that they match the kernel.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        }
    }
}

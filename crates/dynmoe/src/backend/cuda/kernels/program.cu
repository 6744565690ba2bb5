// The CUDA backend's kernels as one NVRTC program, compiled for the device's
// architecture when the backend is made (backend/cuda/program.rs joins these files in
// this order, as nvcc does reading this one). One program rather than one a family: the
// kernels compile as they did in a single file, in one NVRTC call. A file may use what the
// files before it define; each holds one family of ops, and every kernel is checked
// against the CPU reference of its op (crates/dynmoe/tests/cuda).
#include "common.cuh"
#include "norm.cu"
#include "matvec.cu"
#include "affine.cu"
#include "affine_mma.cu"
#include "expert_gemm.cu"
#include "route.cu"
#include "routed.cu"
#include "attention.cu"
#include "vq.cu"
#include "vq_mma.cu"
#include "sample.cu"

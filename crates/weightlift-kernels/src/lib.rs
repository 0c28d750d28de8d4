//! CPU kernels (rayon + std::arch SIMD, scalar fallback) and the CUDA backend, behind one Backend trait.
//!
//! - [`cpu`]: the reference kernels, used by the engine's `cpu` and `virtual` devices and by
//!   `Checkpoint.dequantize`. Free functions on slices, each with a `_with(Isa, ...)` twin.
//! - [`Backend`]: allocate, copy (strided rows by [`Backend::copy_2d`], to another device by
//!   [`Backend::copy_peer`]), run an [`Op`], synchronise; implemented by [`CpuBackend`] and
//!   [`CudaBackend`] (a stub returning [`KernelError::NotCompiledWithCuda`] unless the `cuda`
//!   feature is on). A CUDA device also has a [`CopyStream`] for uploads that overlap compute.
//! - `kernels/*.cu` at the repository root: the CUDA twins, named `{op}_{dtype}`. Their
//!   per-block decode maths lives in `kernels/*.cuh` (`__host__ __device__`, no `cuda_fp16.h`),
//!   which `build.rs` also compiles for the host so tests compare it with the Rust kernels.
//!
//! Status of the CUDA kernels: every source is compiled by NVRTC for compute_80/compute_90
//! (PTX) and sm_80/sm_90 (CUBIN) in the tests, warnings are errors, and the shared decoders
//! run on the host; none of the kernels, nor the CUDA copies and copy stream, has run on a GPU
//! yet.
//!
//! - [`cuda_libs`]: where libnvrtc and libcublas are found at run time: the loader's path, a
//!   CUDA toolkit's folders, or pip's `nvidia/*/lib` in a site folder.
//!
//! Tests: `cargo test -p weightlift-kernels` runs everything that needs no GPU; with
//! `--features cuda` (or `nvrtc-check`) it also compiles every kernel, with libnvrtc from the
//! repository's `.venv` (`make venv`), a CUDA toolkit or `LD_LIBRARY_PATH` (the tests fail,
//! saying why, when libnvrtc cannot be loaded).

pub mod backend;
pub mod cpu;
pub mod cpu_backend;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;
pub mod cuda_libs;
pub mod error;
pub mod types;

pub use backend::{
    Backend, Op, OpCounter, Product, Rows, StartAt, Uploads, matmul_each, matmul_swiglu_unfused,
    rope_kv_store_unfused,
};
pub use cpu::Isa;
pub use cpu::convert::{bf16_to_f16_slice, f16_to_f32_slice, f32_to_f16_slice, scan_non_finite};
pub use cpu::int8::{
    INT8_DEFAULT_THRESHOLD, Int8Activations, Int8Weights, int8_matmul, int8_quantize_activations,
    int8_quantize_rows, int8_quantize_rows_from,
};
pub use cpu::kv::{KV_GROUP, KvType, kv_dequantize, kv_quantize};
pub use cpu::kv_format::{KvFormat, e4m3, hadamard, kv_decode, kv_encode};
pub use cpu::matvec::{MatvecMode, matmul, matmul_f16, matvec, matvec_f16};
pub use cpu::ops::{
    RopeParams, RopeStyle, add, geglu_tanh_in_place, gelu_tanh, rms_norm, rope, rope_in_place,
    rope_inv_freqs, rope_qk_in_place, scale_in_place, softcap_in_place, softmax, swiglu,
};
pub use cpu::quantize::{
    QUANTIZE_TYPES, can_quantize, quantize_row, quantize_rows, quantize_rows_from,
    quantize_rows_from_at, quantized_row_bytes,
};
pub use cpu::{dequantize_f16, dequantize_f32};
pub use cpu_backend::{CpuBackend, CpuBuffer};
pub use cuda::{CopyStream, CudaBackend, CudaBuffer, CudaStepGraph, HostPins};
pub use error::{KernelError, Result};
pub use types::{FloatType, QuantType};

#[cfg(wl_host_shim)]
#[doc(hidden)]
pub mod host_shim;
#[cfg(feature = "nvrtc-check")]
pub mod nvrtc;
#[cfg(feature = "nvrtc-check")]
pub mod nvrtc_cache;
pub mod sources;

/// Whether the host C++ twin of the CUDA headers was built (a C++ compiler was found).
pub const HAS_HOST_SHIM: bool = cfg!(wl_host_shim);

/// A rayon pool of `threads` threads; run CPU kernels inside `pool.install(|| ...)` to bound
/// their parallelism (the benches compare 1 and 2 threads this way).
pub fn thread_pool(threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| KernelError::ThreadPool {
            threads,
            message: e.to_string(),
        })
}

/// The weight types the CUDA kernels (and their host twins) multiply with 8-bit activations; the
/// CPU's list is `cpu::matvec::Q8_WEIGHT_TYPES` (it also has q5_0 and q5_1).
pub const CUDA_Q8_WEIGHT_TYPES: &str = "q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q6_k";

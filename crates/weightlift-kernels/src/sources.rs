//! The CUDA kernel sources, embedded at build time with their headers inlined, and the PTX
//! that nvcc produced when one was found (`build.rs`).

include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));

/// The source of module `name` (`attention`, `convert`, `dequant`, `int8`, `kv`, `matvec`, `ops`).
pub fn source(name: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// Device memory our kernel modules hold once all are loaded on a GPU, which the plan charges
/// with a measured CUDA context: each module's sm_90 CUBIN (code and constants) rounded up to
/// 2 MiB, the granularity the driver allocates device memory in. `nvrtc_compile` checks it
/// against the CUBINs NVRTC produces (seven modules of 35 to 240 KB each: 14 MiB, and room for
/// one more).
pub const MODULE_BYTES: u64 = 16 << 20;

/// nvcc's PTX for module `name`, if the build had nvcc.
pub fn prebuilt_ptx(name: &str) -> Option<&'static str> {
    PTX.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// One kernel parameter, as the CUDA backend pushes it at launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Param {
    /// A device pointer (`const T*` / `T*`).
    Ptr,
    /// `wl_u64` (`unsigned long long`): element, row and block counts.
    U64,
    /// `int`.
    I32,
    /// `float`.
    F32,
}

impl Param {
    /// The `.param` type NVRTC writes for it in PTX (pointers are `.u64` there too).
    pub const fn ptx_type(self) -> &'static str {
        match self {
            Param::Ptr | Param::U64 => ".u64",
            Param::I32 => ".u32",
            Param::F32 => ".f32",
        }
    }
}

use Param::{F32, I32, Ptr, U64};

use crate::types::QuantType;

/// The weight types the CUDA matmul multiplies with 8-bit activations
/// ([`MatvecMode::Q8`](crate::MatvecMode::Q8); `q8_matmul_{type}`), as
/// [`crate::CUDA_Q8_WEIGHT_TYPES`] names them.
pub const CUDA_Q8_TYPES: &[QuantType] = &[
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q8_0,
    QuantType::Q4_K,
    QuantType::Q6_K,
];

/// The weight types the CUDA matmul multiplies exactly (`matvec_{type}_{act}`,
/// `matmul_{type}_{act}`, and the dequantise-then-`gemm` path).
pub const CUDA_EXACT_TYPES: &[QuantType] = &[
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q8_0,
    QuantType::Q4_K,
    QuantType::Q6_K,
    QuantType::F16,
    QuantType::F32,
];

/// The parameter list of every kernel family, by name prefix: the ABI between `kernels/*.cu`
/// and the launches in `cuda.rs`. The CUDA backend refuses a launch whose arguments differ from
/// this, and a test checks it against the parameters of every `.entry` in NVRTC's PTX, so a
/// kernel signature and its launch cannot drift apart silently.
pub const SIGNATURES: &[(&str, &[Param])] = &[
    // (src, dst, n values)
    ("dequantize_", &[Ptr, Ptr, U64]),
    ("convert_", &[Ptr, Ptr, U64]),
    // (src, n values or blocks, first)
    ("scan_", &[Ptr, U64, Ptr]),
    // (w, x, y, rows, cols)
    ("matvec_", &[Ptr, Ptr, Ptr, U64, U64]),
    // (w, x, y, rows, cols, n_tok)
    ("matmul_", &[Ptr, Ptr, Ptr, U64, U64, U64]),
    // (x, out, n_blocks): activations to 40-byte Q8 blocks
    ("q8_quantize_", &[Ptr, Ptr, U64]),
    // (w, xq, y, rows, cols, n_tok)
    ("q8_matmul_", &[Ptr, Ptr, Ptr, U64, U64, U64]),
    // (wd, x, y, n_rows, cols, n_tok, row0, rows)
    ("gemm_", &[Ptr, Ptr, Ptr, U64, U64, U64, U64, U64]),
    // (x, weight, out, n_cols, eps)
    ("rms_norm_", &[Ptr, Ptr, Ptr, U64, F32]),
    // in place, before the families their names start with: (x, positions, inv_freqs,
    // n_pairs, n_heads, head_dim, n_dims)
    ("rope_inplace_", &[Ptr, Ptr, Ptr, U64, U64, I32, I32]),
    // (x, y, n): x += y, x = silu(x) * y
    ("add_inplace_", &[Ptr, Ptr, U64]),
    ("swiglu_inplace_", &[Ptr, Ptr, U64]),
    // (x, bias, n values, n_cols)
    ("add_bias_", &[Ptr, Ptr, U64, U64]),
    // (q, k, v, out, n_q, start, n_heads, kv_heads, head_dim, scale, f16_operands)
    (
        "attention_",
        &[Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, I32, F32, I32],
    ),
    // (x, positions, out, n_pairs, n_heads, head_dim, n_dims, freq_base, freq_scale)
    ("rope_", &[Ptr, Ptr, Ptr, U64, U64, I32, I32, F32, F32]),
    // (x, out, n_cols)
    ("softmax_", &[Ptr, Ptr, U64]),
    // (a, b, out, n)
    ("swiglu_", &[Ptr, Ptr, Ptr, U64]),
    ("add_", &[Ptr, Ptr, Ptr, U64]),
    // (src, dst, n values): the cache codec (kv.cu)
    ("kv_store_", &[Ptr, Ptr, U64]),
    ("kv_load_", &[Ptr, Ptr, U64]),
    // LLM.int8 (int8.cu): (x, flags, out_cols, n_out, n_tok, cols, threshold)
    ("int8_outliers_", &[Ptr, Ptr, Ptr, Ptr, U64, U64, F32]),
    // (x, flags or null, q, scales, n_rows, cols, threshold)
    ("int8_quantize_", &[Ptr, Ptr, Ptr, Ptr, U64, U64, F32]),
    // (wq, w_scales, x, xq, x_scales, out_cols, n_out, y, rows, cols, n_tok)
    (
        "int8_matmul_",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64],
    ),
];

/// The parameter list of kernel `name` (see [`SIGNATURES`]).
pub fn signature(name: &str) -> Option<&'static [Param]> {
    SIGNATURES
        .iter()
        .find(|(prefix, _)| name.starts_with(prefix))
        .map(|(_, p)| *p)
}

/// Bytes of one Q8 activation block on the device (`kernels/wl_q8.cuh`): the CPU's
/// `#[repr(C)] Q8Block` (f32 `d`, i32 `sum`, 32 × i8), little-endian.
pub const Q8_BLOCK_BYTES: usize = 40;

/// Tokens from which an exact-mode matmul on CUDA takes the dequantised path (dequantise a
/// chunk of weight rows, then the tiled `gemm_{act}`) instead of the warp-per-row kernels,
/// which decode every weight again for every token. The CPU backend dequantises tiles of rows
/// at every token count and meets them with its outer-product register tiles from 8 tokens
/// (one AVX2 vector); below that, decoding in registers costs a GPU less than a round trip
/// through scratch memory.
pub const DQ_PATH_MIN_TOKENS: usize = 8;

/// The most values one dequantised chunk holds on the device (64 MiB of f32), whatever
/// `max_dq_size` allows: larger chunks only save launches.
pub const DQ_CHUNK_CAP: usize = 16 << 20;

/// Weight rows per dequantised chunk of a `rows × cols` matmul under `max_dq_size` (values):
/// as many whole rows as fit in `min(max_dq_size, DQ_CHUNK_CAP)`, at most `rows`, rounded down
/// to whole [`GEMM_BLOCK_ROWS`]-row GEMM blocks when that is more than one block but not all
/// rows. `None` when not even one row fits (or `cols` is 0): the dequantised path cannot honour
/// `max_dq_size` then, so the CUDA backend uses the in-register kernels, which need no scratch
/// (the CPU backend dequantises one row at a time in that case).
pub fn dq_chunk_rows(rows: usize, cols: usize, max_dq_size: usize) -> Option<usize> {
    let fit = max_dq_size.min(DQ_CHUNK_CAP).checked_div(cols)?.min(rows);
    match fit {
        0 => None,
        n if n == rows || n <= GEMM_BLOCK_ROWS => Some(n),
        n => Some(n / GEMM_BLOCK_ROWS * GEMM_BLOCK_ROWS),
    }
}

/// The GEMM's K tile (`WL_GEMM_TILE` in `kernels/wl_matvec.cuh`).
pub const GEMM_TILE: usize = 16;
/// Weight rows per GEMM thread block (`WL_GEMM_BM`).
pub const GEMM_BLOCK_ROWS: usize = 64;
/// Tokens per GEMM thread block (`WL_GEMM_BN`).
pub const GEMM_BLOCK_TOKENS: usize = 64;
/// Threads per GEMM thread block, one-dimensional (`WL_GEMM_THREADS`).
pub const GEMM_THREADS: usize = 256;

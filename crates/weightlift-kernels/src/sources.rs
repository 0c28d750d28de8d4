//! The CUDA kernel sources, embedded at build time with their headers inlined, and the PTX
//! that nvcc produced when one was found (`build.rs`).

include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));

/// The source of module `name` (`attention`, `convert`, `dequant`, `int8`, `kv`, `matvec`, `ops`).
pub fn source(name: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

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
    QuantType::BF16,
    QuantType::F32,
];

/// [`CUDA_EXACT_TYPES`] as the error messages name them.
pub const CUDA_EXACT_NAMES: &str = "q4_0, q4_1, q8_0, q4_k, q6_k, f16, bf16, f32";

/// The float weight types, whose `matvec_`/`matmul_` kernels are the bandwidth kernels of
/// `kernels/matvec.cu` (16-byte chunks spread over [`float_row_threads`] threads a row).
pub const CUDA_FLOAT_TYPES: &[QuantType] = &[QuantType::F16, QuantType::BF16, QuantType::F32];

/// Threads per float-kernel block (`WL_FV_THREADS`): `256 / tpr` rows of `tpr` threads.
pub const FLOAT_BLOCK_THREADS: usize = 256;

/// The threads a row the float kernels take (`blockDim.x`): half a warp, a warp, or 2, 4 or 8
/// warps.
pub const FLOAT_ROW_THREADS: [usize; 5] = [16, 32, 64, 128, 256];

/// Tokens one float `matmul_` thread carries per pass (`WL_FV_NT`).
pub const FLOAT_TOKENS_PER_PASS: usize = 4;

/// Bytes of one float-kernel chunk (`WL_FV_CHUNK`): one 128-bit load.
const FLOAT_CHUNK_BYTES: usize = 16;

/// Resident warps per SM the float kernels aim for before they spread a row over more threads:
/// half of the 64 an SM of compute capability 8.0 to 9.0 holds (the register budget of
/// `__launch_bounds__(256, 4)` allows 32), enough loads in flight to cover memory latency.
const FLOAT_WARPS_PER_SM: usize = 32;

/// Threads per row (`blockDim.x`, one of [`FLOAT_ROW_THREADS`]) of a float `matvec_`/`matmul_`
/// launch over `rows` rows of `cols` values of `elem_bytes` bytes, with `passes` token passes
/// side by side on grid.y, on a device of `sm_count` SMs:
///
/// - rows of at most 32 chunks of 16 bytes take half a warp (two rows a warp), longer ones a
///   warp;
/// - then, while the grid's warps are fewer than [`FLOAT_WARPS_PER_SM`] per SM and every thread
///   would still load at least two chunks, a row takes twice the threads (up to a whole block).
///
/// A pure function of the shape and the SM count, so the host twin can replay any launch; the
/// sum order (and so the last bits of a result) follows the threads per row.
pub fn float_row_threads(
    rows: usize,
    cols: usize,
    elem_bytes: usize,
    passes: usize,
    sm_count: usize,
) -> usize {
    let chunks = cols.saturating_mul(elem_bytes).div_ceil(FLOAT_CHUNK_BYTES);
    let want = FLOAT_WARPS_PER_SM.saturating_mul(sm_count.max(1));
    let warps = |tpr: usize| {
        rows.saturating_mul(tpr)
            .div_ceil(32)
            .saturating_mul(passes.max(1))
    };
    let mut tpr = if chunks <= 32 { 16 } else { 32 };
    while tpr < FLOAT_BLOCK_THREADS && chunks >= 4 * tpr && warps(tpr) < want {
        tpr *= 2;
    }
    tpr
}

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
    // (w, x, y, rows, cols); the float types' kernels too, whose threads a row ride blockDim
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The shapes the float kernels are written for (a 1.1B llama's and an 8B's projections and
    /// heads on a 132-SM H200), tiny rows, and token passes that fill the grid on their own.
    #[test]
    fn float_row_threads_fill_the_sms_and_keep_two_chunks_a_thread() {
        // 2048 x 2048 f16: 256 chunks a row; 32 threads give 2048 warps (15 an SM), 64 give
        // 31, 128 give 62 with two chunks a thread
        assert_eq!(float_row_threads(2048, 2048, 2, 1, 132), 128);
        // 4096 x 14336 f16: 64 threads a row already make 62 warps an SM
        assert_eq!(float_row_threads(4096, 14336, 2, 1, 132), 64);
        // a 32000-row head needs no help
        assert_eq!(float_row_threads(32000, 2048, 2, 1, 132), 32);
        // 256 k/v rows of 2048: more threads, but never fewer than two chunks each
        assert_eq!(float_row_threads(256, 2048, 2, 1, 132), 128);
        // short rows: half a warp each (the tiny llama's 256 values of bf16 are 32 chunks)
        assert_eq!(float_row_threads(768, 256, 2, 1, 132), 16);
        assert_eq!(float_row_threads(7, 100, 4, 1, 132), 16);
        // one very long row takes the whole block
        assert_eq!(float_row_threads(1, 1 << 20, 4, 1, 132), 256);
        // eight token passes fill the grid with a warp a row
        assert_eq!(float_row_threads(2048, 2048, 2, 8, 132), 32);
        // fewer SMs, fewer threads a row
        assert_eq!(float_row_threads(2048, 2048, 2, 1, 16), 32);
        for (rows, cols) in [(0, 0), (1, 1), (3, 33), (100_000, 8)] {
            assert!(FLOAT_ROW_THREADS.contains(&float_row_threads(rows, cols, 2, 1, 0)));
        }
    }
}

//! The CUDA kernel sources, embedded at build time with their headers inlined, and the PTX
//! that nvcc produced when one was found (`build.rs`).

include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));

/// The source of module `name` (`attention`, `attention_prefill`, `attention_prefill_mma`,
/// `convert`, `dequant`, `int8`, `kv`, `matvec`, `ops`, `quantize`).
pub fn source(name: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// Device memory our kernel modules hold once all are loaded on a GPU, which the plan charges
/// with a measured CUDA context: each module's sm_90 CUBIN (code and constants) rounded up to
/// 2 MiB, the granularity the driver allocates device memory in. `nvrtc_compile` checks it
/// against the CUBINs NVRTC produces (with NVRTC 12.9: ten modules of 35 KB to 1.5 MB, one
/// granule each: 20 MiB).
pub const MODULE_BYTES: u64 = 20 << 20;

/// The module that holds attention kernel `kernel`: `attention_{format}` and
/// `attention_reduce_f32` (decode) are in `attention`, `attention_prefill_{format}` in
/// `attention_prefill`, `attention_prefill_mma_{format}` in `attention_prefill_mma`. They are
/// three modules because a device compiles each module with NVRTC at its first use in a process:
/// one module of all three took 76 s of one core for sm_90, most of it ptxas on the prompt
/// kernels, which a process that only decodes, or takes only the tensor-core prompt kernel,
/// never launches.
pub fn attention_module(kernel: &str) -> &'static str {
    if kernel.starts_with("attention_prefill_mma_") {
        "attention_prefill_mma"
    } else if kernel.starts_with("attention_prefill_") {
        "attention_prefill"
    } else {
        "attention"
    }
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

use crate::MatvecMode;
use crate::types::QuantType;

/// The weight types the CUDA matmul multiplies with 8-bit activations
/// ([`MatvecMode::Q8`](crate::MatvecMode::Q8); `q8_matmul_{type}`), as
/// [`crate::CUDA_Q8_WEIGHT_TYPES`] names them.
pub const CUDA_Q8_TYPES: &[QuantType] = &[
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q8_0,
    QuantType::Q4_K,
    QuantType::Q6_K,
];

/// The weight types the CUDA matmul multiplies exactly (`matvec_{type}_{act}`,
/// `matmul_{type}_{act}`, and the dequantise-then-`gemm` path).
pub const CUDA_EXACT_TYPES: &[QuantType] = &[
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q8_0,
    QuantType::Q2_K,
    QuantType::Q3_K,
    QuantType::Q4_K,
    QuantType::Q5_K,
    QuantType::Q6_K,
    QuantType::F16,
    QuantType::BF16,
    QuantType::F32,
];

/// The float weight types CUDA multiplies in [`MatvecMode::Q8`](crate::MatvecMode::Q8), the
/// fast mode, besides [`CUDA_Q8_TYPES`]: one token and short prompts as in exact mode (their
/// kernels round nothing), prompts from [`CUBLAS_MIN_TOKENS`] tokens on tensor cores with the
/// activations rounded to the weights' type (llama.cpp's CUDA backend does the same).
pub const CUDA_FAST_FLOAT_TYPES: &[QuantType] = &[QuantType::F16, QuantType::BF16];

/// The weight types of CUDA's fast mode ([`CUDA_Q8_TYPES`] and [`CUDA_FAST_FLOAT_TYPES`]) as
/// the error messages name them.
pub const CUDA_FAST_NAMES: &str = "q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q6_k, f16, bf16";

/// [`CUDA_EXACT_TYPES`] as the error messages name them.
pub const CUDA_EXACT_NAMES: &str =
    "q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, f16, bf16, f32";

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

/// The grouped decode products' parameters (see [`SIGNATURES`]).
const GROUPED: &[Param] = &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64];

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
    // quantise-on-load (quantize.cu): (src, dst, n_blocks, first value's index in the tensor,
    // found: the non-finite report word)
    ("quantize_", &[Ptr, Ptr, U64, U64, Ptr]),
    // (w, xq, y, rows, cols, n_tok)
    ("q8_matmul_", &[Ptr, Ptr, Ptr, U64, U64, U64]),
    // the same on int8 tensor cores (wl_mmq.cuh): (w, xq, y, rows, cols, n_tok)
    ("q8_mma_", &[Ptr, Ptr, Ptr, U64, U64, U64]),
    // (w, xq, y, rows, cols): one token
    ("q8_matvec_", &[Ptr, Ptr, Ptr, U64, U64]),
    // up to three matrices of one input in one launch, decode's q, k and v: (w0, w1, w2, x or
    // xq, y0, y1, y2, rows0, rows1, rows2, cols)
    ("matvec3_", GROUPED),
    ("q8_matvec3_", GROUPED),
    ("q8_wide_matvec3_", GROUPED),
    // decode's wide lanes (wl_q8w.cuh): (w, xq, y, rows, cols), and gate and up with SwiGLU
    // (w_gate, w_up, xq, y, rows, cols), before the swiglu_ family
    ("q8_wide_matvec_", &[Ptr, Ptr, Ptr, U64, U64]),
    ("swiglu_q8_wide_matvec_", &[Ptr, Ptr, Ptr, Ptr, U64, U64]),
    // gate and up with SwiGLU, one token, before the swiglu_ family: (w_gate, w_up, x or xq,
    // y, rows, cols)
    ("swiglu_matvec_", &[Ptr, Ptr, Ptr, Ptr, U64, U64]),
    ("swiglu_q8_matvec_", &[Ptr, Ptr, Ptr, Ptr, U64, U64]),
    // (wd, x, y, n_rows, cols, n_tok, row0, rows)
    ("gemm_", &[Ptr, Ptr, Ptr, U64, U64, U64, U64, U64]),
    // (x, weight, out, n_cols, eps)
    ("rms_norm_", &[Ptr, Ptr, Ptr, U64, F32]),
    // (x, h, weight, xq, n_cols, eps): the same, and h quantised to Q8 blocks at xq, before
    // the add_rms_norm_ family
    ("add_rms_norm_q8_", &[Ptr, Ptr, Ptr, Ptr, U64, F32]),
    // (x, h, weight, n_cols, eps): x += h, h = rms_norm(x), before the add_ families
    ("add_rms_norm_", &[Ptr, Ptr, Ptr, U64, F32]),
    // in place, before the families their names start with: (x, positions, inv_freqs,
    // n_pairs, n_heads, head_dim, n_dims, mscale)
    ("rope_inplace_", &[Ptr, Ptr, Ptr, U64, U64, I32, I32, F32]),
    // (q, k, v, positions, inv_freqs, k_cache, v_cache, n_tok, n_heads, kv_heads, head_dim,
    // n_dims, neox, mscale, cap): RoPE and the cache store in one launch (cap: the caches' rows
    // when each token goes to row position % cap, 0 when they are the rows written)
    (
        "rope_kv_store_",
        &[
            Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U64, U64, I32, I32, I32, F32, U64,
        ],
    ),
    // (x, y, n): x += y, x = silu(x) * y
    ("add_inplace_", &[Ptr, Ptr, U64]),
    ("swiglu_inplace_", &[Ptr, Ptr, U64]),
    ("geglu_tanh_inplace_", &[Ptr, Ptr, U64]),
    // (x, s, n): x *= s
    ("scale_inplace_", &[Ptr, F32, U64]),
    // (dst, rows, src, n values, n_cols, src_rows): dst row k = src row rows[k]
    ("gather_rows_", &[Ptr, Ptr, Ptr, U64, U64, U64]),
    // (dst, rows, weights, src, n values, n_cols, dst_rows): dst row rows[k] += weights[k] ·
    // src row k
    ("scatter_add_rows_", &[Ptr, Ptr, Ptr, Ptr, U64, U64, U64]),
    // (x, bias, n values, n_cols)
    ("add_bias_", &[Ptr, Ptr, U64, U64]),
    // the splits merged, and the output quantised to Q8 blocks at xq, before the family its
    // name starts with: (part, out, xq, n_q, n_heads, head_dim, n_splits, start, positions or
    // null, span, window)
    (
        "attention_reduce_q8_",
        &[Ptr, Ptr, Ptr, U64, U64, I32, U64, U64, Ptr, U64, U64],
    ),
    // the splits merged, before the family its name starts with: (part, out, n_q, n_heads,
    // head_dim, n_splits, start, positions or null, span, window)
    (
        "attention_reduce_",
        &[Ptr, Ptr, U64, U64, I32, U64, U64, Ptr, U64, U64],
    ),
    // prompts, before the family its name starts with: (q, k, v, out, n_q, start, n_heads,
    // kv_heads, head_dim, scale, f16_operands, window, softcap, cache rows); the tensor-core
    // attention_prefill_mma_{format} too
    (
        "attention_prefill_",
        &[
            Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, I32, F32, I32, U64, F32, U64,
        ],
    ),
    // (q, k, v, out or partial results, n_q, start, n_heads, kv_heads, head_dim, scale,
    // f16_operands, n_splits, window, softcap, positions or null, span, cache rows): with
    // positions, the first query's position is read on the device and span keys split from its
    // window's start; the key at position p is in cache row p % cache rows
    (
        "attention_",
        &[
            Ptr, Ptr, Ptr, Ptr, U64, U64, U64, U64, I32, F32, I32, U64, U64, F32, Ptr, U64, U64,
        ],
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

/// Threads per block of decode's Q8 kernel `q8_matvec_{type}` (`WL_Q8V_THREADS` in
/// `kernels/matvec.cu`): `256 / (32 wpr)` rows of [`q8_matvec_warps`] warps each.
pub const Q8_MATVEC_THREADS: usize = 256;

/// Threads per block of the quantise-on-load kernels `quantize_{type}_{src}` (`WL_QZ_THREADS`
/// in `kernels/quantize.cu`, their launch bounds), one block of ggml values each.
pub const QUANTIZE_THREADS: usize = 128;

/// Warps per weight row of decode's Q8 kernel (1, 2, 4 or 8): enough that the launch has about
/// 64 warps per SM in flight (a decode product is too short for a second wave to hide the
/// first's memory latency), and no more than leave every lane two groups of the row.
pub fn q8_matvec_warps(rows: usize, cols: usize, sm_count: usize) -> usize {
    let want = (sm_count.max(1) * 64)
        .div_ceil(rows.max(1))
        .next_power_of_two();
    // a row of g groups keeps 32 * wpr lanes busy for two groups each when wpr <= g / 8
    let most = 1usize << (cols / 32 / 8).max(1).ilog2();
    want.min(most).min(8)
}

/// The weight types of decode's wide-lane Q8 kernels (`q8_wide_matvec_{type}` and
/// `swiglu_q8_wide_matvec_{type}`, `kernels/wl_q8w.cuh`).
pub const Q8_WIDE_WEIGHT_TYPES: &[QuantType] = &[QuantType::Q4_K, QuantType::Q6_K];

/// Which kernels decode's Q8-mode products (one token) run on CUDA, for the weight types of
/// [`Q8_WIDE_WEIGHT_TYPES`]; the other types always take the narrow ones. The wide lanes are
/// the default: on an H200 they took TinyLlama-shaped Q4_K_M decode from 313 to 542 tokens/s
/// (the kernel bench: 8.0 µs against 13.5 for a 2,048² Q4_K product, 18 against 83 for a
/// 14,336×4,096 one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Q8Decode {
    /// `q8_matvec_{type}`: a lane takes one 4-byte word of a 32-value group a step.
    Narrow,
    /// `q8_wide_matvec_{type}`: a lane takes 64 values of a block a step, in far fewer loads.
    #[default]
    Wide,
}

impl Q8Decode {
    /// The environment variable a CUDA backend reads when it is made.
    pub const ENV: &'static str = "WEIGHTLIFT_Q8V";

    /// The choice for a value of [`Q8Decode::ENV`]: `narrow` picks the narrow lanes; unset,
    /// empty, `wide` or anything else keeps the default, the wide lanes (as
    /// `WEIGHTLIFT_CUBLAS_MIN_TOKENS` ignores what it cannot read).
    pub fn from_env_value(value: Option<&str>) -> Self {
        match value.map(|v| v.trim().to_ascii_lowercase()) {
            Some(v) if v == "narrow" => Q8Decode::Narrow,
            _ => Q8Decode::Wide,
        }
    }

    /// The choice [`Q8Decode::ENV`] makes in this process.
    pub fn from_env() -> Self {
        Self::from_env_value(std::env::var(Self::ENV).ok().as_deref())
    }

    /// Whether a one-token product of `ty` takes the wide kernels under this choice.
    pub fn wide_for(self, ty: QuantType) -> bool {
        self == Q8Decode::Wide && Q8_WIDE_WEIGHT_TYPES.contains(&ty)
    }
}

/// Warps per weight row of decode's wide-lane Q8 kernel (1, 2, 4 or 8): as
/// [`q8_matvec_warps`], about 64 warps per SM wanted, but no more than leave every lane one
/// 64-value unit of the row (a 2,048-value row is 32 units: one warp).
pub fn q8_wide_matvec_warps(rows: usize, cols: usize, sm_count: usize) -> usize {
    let want = (sm_count.max(1) * 64)
        .div_ceil(rows.max(1))
        .next_power_of_two();
    let most = 1usize << (cols / 64 / 32).max(1).ilog2();
    want.min(most).min(8)
}

/// Tokens from which an exact-mode matmul on CUDA takes the dequantised path (dequantise a
/// chunk of weight rows, then the tiled `gemm_{act}`) instead of the warp-per-row kernels,
/// which decode every weight again for every token. The CPU backend dequantises tiles of rows
/// at every token count and meets them with its outer-product register tiles from 8 tokens
/// (one AVX2 vector); below that, decoding in registers costs a GPU less than a round trip
/// through scratch memory.
pub const DQ_PATH_MIN_TOKENS: usize = 8;

/// Tokens from which a prompt's products run on cuBLAS (`cublasGemmEx`) on CUDA, where
/// libcublas is found: exact mode as f32 GEMMs of dequantised chunks (no TF32), fast mode on
/// tensor cores with the activations rounded to f16 (bf16 for bf16 weights) and quantised
/// weights dequantised chunk by chunk to f16. Below it, the backend's own kernels (decode and
/// short prompts read each weight once; a GEMM's tiles would mostly wait).
/// `WEIGHTLIFT_CUBLAS_MIN_TOKENS` overrides it per process, and [`CUBLAS_MIN_TOKENS_BY_TYPE`]
/// per weight type and mode. On an H200 cuBLAS was faster from 8 tokens in exact mode too
/// (the kernel bench's route table), but exact mode keeps 32 until tensor-parallel ranks on
/// CUDA, whose 16-token prompts then took cuBLAS and left the host pass's logits, are
/// explained (see the README's GPU status).
pub const CUBLAS_MIN_TOKENS: usize = 32;

/// Weight types and modes whose products take cuBLAS from a token count other than
/// [`CUBLAS_MIN_TOKENS`]: (type, mode, tokens), fast mode's crossovers from the CUDA kernel
/// bench's route table on an H200 (2026-11-30). From 8 tokens the backend's float kernels take
/// a tiled path 5-48x slower than cuBLAS (a decode batch of 8 bf16 sequences ran at 0.27x the
/// rate of one), and the quantised kernels were slower than dequantising the weights for
/// cuBLAS from 2 tokens (Q8_0: 53 against 27 µs for 2 tokens of a 2,048² product; f16 about
/// tied). The types of decode's wide lanes go to cuBLAS only past
/// [`Q8_WIDE_ALONE_MAX_TOKENS`], below which they run the one-token kernel once a token (on
/// cuBLAS from two tokens, two Q4_K sequences decoded at 0.46x the rate of one). The other
/// types and exact mode keep [`CUBLAS_MIN_TOKENS`]; `usize::MAX` would keep a type on the
/// backend's own kernels.
pub const CUBLAS_MIN_TOKENS_BY_TYPE: &[(QuantType, MatvecMode, usize)] = &[
    (QuantType::BF16, MatvecMode::Q8, 8),
    (QuantType::F16, MatvecMode::Q8, 2),
    (QuantType::Q8_0, MatvecMode::Q8, 2),
    (
        QuantType::Q4_K,
        MatvecMode::Q8,
        Q8_WIDE_ALONE_MAX_TOKENS + 1,
    ),
    (
        QuantType::Q6_K,
        MatvecMode::Q8,
        Q8_WIDE_ALONE_MAX_TOKENS + 1,
    ),
];

/// The most tokens a fast-mode product of a type with decode's wide lanes
/// ([`Q8_WIDE_WEIGHT_TYPES`], under [`Q8Decode::Wide`]) runs as that many one-token launches of
/// `q8_wide_matvec_{type}` on CUDA, each token's activations and output its own: a decode batch
/// of a few sequences then reads the weights once a sequence at the wide lanes' rate, and each
/// gets the bits it gets alone.
pub const Q8_WIDE_ALONE_MAX_TOKENS: usize = 8;

/// The weight types of the Q8 mode's prompt product on int8 tensor cores (`q8_mma_{type}`,
/// `kernels/wl_mmq.cuh`): every type of [`CUDA_Q8_TYPES`].
pub const MMQ_TYPES: &[QuantType] = CUDA_Q8_TYPES;

/// Weight rows one block of `q8_mma_{type}` takes (`WL_MMQ_ROWS`): four warps of 16, one
/// m16n8k32 A fragment each.
pub const MMQ_BLOCK_ROWS: usize = 64;
/// Tokens one block of `q8_mma_{type}` takes a pass (`WL_MMQ_TOKS`): eight n-blocks of 8.
pub const MMQ_BLOCK_TOKENS: usize = 64;
/// Threads a block of `q8_mma_{type}` (`WL_MMQ_THREADS`).
pub const MMQ_THREADS: usize = 128;

/// Weight types whose fast-mode prompt products take the int8 tensor-core kernels
/// `q8_mma_{type}` from a token count, as (type, mode, tokens): the third prompt route, beside
/// the dp4a kernels `q8_matmul_{type}` and cuBLAS. Empty until a GPU run measures it (the CUDA
/// kernel bench's route table prints the crossovers), so no product takes it by default;
/// `WEIGHTLIFT_MMQ_MIN_TOKENS` sets one count for every type of [`MMQ_TYPES`] per process. Only
/// [`MatvecMode::Q8`] entries count (the kernels multiply the Q8 mode's quantised activations),
/// and only on compute capability 8.0 and later. The kernels add each group's scaled integer
/// dot in group order, the CPU's Q8 prompt tiles' order: the CPU's bits past its batch of
/// [`Q8_BATCH_MAX_TOKENS`](crate::cpu::matvec::Q8_BATCH_MAX_TOKENS) tokens, and within the Q8
/// mode's bound of `q8_matmul_{type}` (whose lanes keep the CPU matvec's order).
pub const MMQ_MIN_TOKENS_BY_TYPE: &[(QuantType, MatvecMode, usize)] = &[];

/// Which route a prompt product takes on CUDA ([`CublasMinTokens::route`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptRoute {
    /// The backend's own CUDA-core kernels (`q8_matmul_{type}`, the exact kernels or the
    /// dequantised path).
    Kernels,
    /// The int8 tensor-core kernels `q8_mma_{type}`.
    Mma,
    /// cuBLAS (see [`cublas_route`]).
    Cublas,
}

/// Tokens from which a CUDA backend's prompt products leave its own kernels: for cuBLAS, one
/// count for every weight type and mode and counts of their own for some; for the int8
/// tensor-core kernels, counts per type and mode only (none by default). The default is
/// [`CUBLAS_MIN_TOKENS`] with [`CUBLAS_MIN_TOKENS_BY_TYPE`] and [`MMQ_MIN_TOKENS_BY_TYPE`]; the
/// bench makes backends that force one route or another with [`CublasMinTokens::uniform`] and
/// [`CublasMinTokens::with_mma_every`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CublasMinTokens {
    every: usize,
    by_type: Vec<(QuantType, MatvecMode, usize)>,
    mma: Vec<(QuantType, MatvecMode, usize)>,
}

impl Default for CublasMinTokens {
    fn default() -> Self {
        Self {
            every: CUBLAS_MIN_TOKENS,
            by_type: CUBLAS_MIN_TOKENS_BY_TYPE.to_vec(),
            mma: MMQ_MIN_TOKENS_BY_TYPE.to_vec(),
        }
    }
}

impl CublasMinTokens {
    /// The environment variable that sets the int8 tensor-core kernels' count for every type of
    /// [`MMQ_TYPES`] ([`CublasMinTokens::with_mma_env_value`]).
    pub const MMA_ENV: &'static str = "WEIGHTLIFT_MMQ_MIN_TOKENS";

    /// `n` tokens for every type and mode: 1 sends every prompt product cuBLAS takes there,
    /// `usize::MAX` none. No product takes the int8 tensor-core kernels.
    pub fn uniform(n: usize) -> Self {
        Self {
            every: n,
            by_type: Vec::new(),
            mma: Vec::new(),
        }
    }

    /// These counts with `n` tokens for cuBLAS for every type and mode (the counts of their own
    /// dropped), the int8 tensor-core kernels' counts kept.
    pub fn with_cublas_every(mut self, n: usize) -> Self {
        self.every = n;
        self.by_type.clear();
        self
    }

    /// These counts with fast-mode products of `ty` taking the int8 tensor-core kernels from
    /// `n` tokens (replacing its count; a type without such kernels never takes them).
    pub fn with_mma(mut self, ty: QuantType, n: usize) -> Self {
        self.mma.retain(|&(t, _, _)| t != ty);
        self.mma.push((ty, MatvecMode::Q8, n));
        self
    }

    /// These counts with every type of [`MMQ_TYPES`] taking the int8 tensor-core kernels from
    /// `n` tokens (`usize::MAX`: never).
    pub fn with_mma_every(self, n: usize) -> Self {
        MMQ_TYPES.iter().fold(self, |c, &ty| c.with_mma(ty, n))
    }

    /// These counts under a value of [`CublasMinTokens::MMA_ENV`]: a number is every type's
    /// count for the int8 tensor-core kernels; unset or anything else keeps these (as
    /// `WEIGHTLIFT_CUBLAS_MIN_TOKENS` ignores what it cannot read).
    pub fn with_mma_env_value(self, value: Option<&str>) -> Self {
        match value.and_then(|v| v.trim().parse().ok()) {
            Some(n) => self.with_mma_every(n),
            None => self,
        }
    }

    /// Tokens from which a product of `ty` in `mode` takes the int8 tensor-core kernels where
    /// the device has them (`usize::MAX`: never).
    pub fn mma_of(&self, ty: QuantType, mode: MatvecMode) -> usize {
        if mode != MatvecMode::Q8 || !MMQ_TYPES.contains(&ty) {
            return usize::MAX;
        }
        self.mma
            .iter()
            .find(|&&(t, m, _)| (t, m) == (ty, mode))
            .map_or(usize::MAX, |&(_, _, n)| n)
    }

    /// Whether a product of `n_tok` tokens of `ty` in `mode` takes the int8 tensor-core
    /// kernels on a device of compute capability `cc` when it does not take cuBLAS: its count
    /// is reached, and the device has `mma.sync` on s8 operands (8.0 and later).
    pub fn mma_takes(&self, ty: QuantType, mode: MatvecMode, n_tok: usize, cc: (i32, i32)) -> bool {
        cc >= (8, 0) && n_tok >= self.mma_of(ty, mode)
    }

    /// The route of a product of `n_tok` tokens of `ty` in `mode` on a device of compute
    /// capability `cc`: of the routes whose count `n_tok` reaches, the one with the largest
    /// count (a route measured to win from more tokens takes over from those winning from
    /// fewer), the int8 tensor-core kernels on a tie with cuBLAS; the backend's own kernels when
    /// none is reached. cuBLAS may still decline at run time (no libcublas, f16 activations),
    /// and the product then takes [`CublasMinTokens::mma_takes`]'s choice.
    pub fn route(
        &self,
        ty: QuantType,
        mode: MatvecMode,
        n_tok: usize,
        cc: (i32, i32),
    ) -> PromptRoute {
        let cublas = self.of(ty, mode);
        let mma = self.mma_takes(ty, mode, n_tok, cc);
        match (n_tok >= cublas, mma) {
            (true, true) if cublas > self.mma_of(ty, mode) => PromptRoute::Cublas,
            (_, true) => PromptRoute::Mma,
            (true, false) => PromptRoute::Cublas,
            (false, false) => PromptRoute::Kernels,
        }
    }

    /// These counts with `n` tokens for products of `ty` in `mode` (replacing its count).
    pub fn with(mut self, ty: QuantType, mode: MatvecMode, n: usize) -> Self {
        self.by_type.retain(|&(t, m, _)| (t, m) != (ty, mode));
        self.by_type.push((ty, mode, n));
        self
    }

    /// The count for the types and modes without one of their own.
    pub fn every(&self) -> usize {
        self.every
    }

    /// The fewest tokens from which some product of some type and mode takes cuBLAS.
    pub fn least(&self) -> usize {
        self.by_type
            .iter()
            .map(|&(_, _, n)| n)
            .fold(self.every, usize::min)
    }

    /// Tokens from which a product of `ty` in `mode` takes cuBLAS.
    pub fn of(&self, ty: QuantType, mode: MatvecMode) -> usize {
        self.by_type
            .iter()
            .find(|&&(t, m, _)| (t, m) == (ty, mode))
            .map_or(self.every, |&(_, _, n)| n)
    }
}

/// The smallest token count from which cuBLAS wins at every larger count measured: the
/// crossover a [`CublasMinTokens`] count should be, from `times` of one weight type and mode as
/// (tokens, seconds through the backend's own kernels, seconds through cuBLAS), in any order.
/// cuBLAS wins at a count when both times are there and its own is the smaller. `None` when it
/// does not win at the largest count measured (it never wins, or wins only in the middle: the
/// kernels then stay, as a count above every one measured would keep them).
pub fn cublas_crossover(times: &[(usize, Option<f64>, Option<f64>)]) -> Option<usize> {
    let mut sorted = times.to_vec();
    sorted.sort_by_key(|&(n, _, _)| n);
    let wins = |&(_, kernels, cublas): &(usize, Option<f64>, Option<f64>)| matches!((kernels, cublas), (Some(k), Some(c)) if c < k);
    sorted
        .iter()
        .rev()
        .take_while(|t| wins(t))
        .last()
        .map(|&(n, _, _)| n)
}

/// One token count's times of a prompt product through each route: (tokens, seconds through the
/// backend's own kernels, through the int8 tensor-core kernels, through cuBLAS), `None` where
/// that route did not run.
pub type RouteTimes = (usize, Option<f64>, Option<f64>, Option<f64>);

/// The counts one weight type and mode should have in a [`CublasMinTokens`], from `times` (any
/// order of counts): (the int8 kernels' count, cuBLAS's count), `None` for a
/// route that should stay off. cuBLAS's is [`cublas_crossover`] against the faster of the other
/// two at each count; the int8 kernels' is [`cublas_crossover`] of them against the backend's
/// kernels over the counts below cuBLAS's (all of them when cuBLAS never wins for good). Under
/// [`CublasMinTokens::route`] (the larger count reached wins) every count measured then takes
/// its fastest route when each route's wins are one run.
pub fn prompt_crossovers(times: &[RouteTimes]) -> (Option<usize>, Option<usize>) {
    let best = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let cublas = cublas_crossover(
        &times
            .iter()
            .map(|&(n, k, m, c)| (n, best(k, m), c))
            .collect::<Vec<_>>(),
    );
    let mma = cublas_crossover(
        &times
            .iter()
            .filter(|&&(n, ..)| cublas.is_none_or(|c| n < c))
            .map(|&(n, k, m, _)| (n, k, m))
            .collect::<Vec<_>>(),
    );
    (mma, cublas)
}

/// What a prompt product on cuBLAS runs ([`cublas_route`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CublasRoute {
    /// The kernel that rounds the f32 activations once before the GEMMs (`convert_f32_f16`,
    /// `convert_f32_bf16`), or `None`: exact mode reads them as they are.
    pub convert: Option<&'static str>,
    /// The kernel that dequantises each chunk of weight rows into scratch
    /// (`dequantize_{type}_{f32,f16}`), or `None`: the weights are the GEMM's operand as stored.
    pub dequantize: Option<String>,
    /// Weight rows per GEMM (all of them when the weights are read as stored).
    pub chunk: usize,
    /// The type of both GEMM operands: `f32` (exact mode, no TF32), `f16` or `bf16` (tensor
    /// cores, f32 accumulation).
    pub operands: &'static str,
}

/// The cuBLAS route of a prompt product of `rows × cols` weights of `ty` in fast or exact
/// mode under `max_dq_size` (the CUDA backend takes it from [`CUBLAS_MIN_TOKENS`] tokens of f32
/// activations): exact mode reads f32 weights as stored and dequantises the others to f32 in
/// the chunks of [`dq_chunk_rows`]; fast mode reads f16 and bf16 weights as stored with the
/// activations rounded to their type, and dequantises the others to f16. `None` when there is
/// nothing to multiply, the type has no CUDA kernels in that mode, or not one row fits in
/// `max_dq_size` (the kernels then run without scratch).
pub fn cublas_route(
    fast: bool,
    ty: QuantType,
    rows: usize,
    cols: usize,
    max_dq_size: usize,
) -> Option<CublasRoute> {
    if rows == 0 || cols == 0 {
        return None;
    }
    let known = if fast {
        CUDA_Q8_TYPES.contains(&ty) || CUDA_FAST_FLOAT_TYPES.contains(&ty)
    } else {
        CUDA_EXACT_TYPES.contains(&ty)
    };
    if !known {
        return None;
    }
    let direct = if fast {
        CUDA_FAST_FLOAT_TYPES.contains(&ty)
    } else {
        ty == QuantType::F32
    };
    let operands = match (fast, ty) {
        (false, _) => "f32",
        (true, QuantType::BF16) => "bf16",
        (true, _) => "f16",
    };
    let convert = match operands {
        "f32" => None,
        "bf16" => Some("convert_f32_bf16"),
        _ => Some("convert_f32_f16"),
    };
    if direct {
        return Some(CublasRoute {
            convert,
            dequantize: None,
            chunk: rows,
            operands,
        });
    }
    Some(CublasRoute {
        convert,
        dequantize: Some(format!("dequantize_{}_{operands}", ty.name())),
        chunk: dq_chunk_rows(rows, cols, max_dq_size)?,
        operands,
    })
}

/// The cuBLAS workspace a CUDA backend allocates once and gives its handle
/// (`cublasSetWorkspace`), so cuBLAS allocates none of its own: 32 MiB on Hopper (sm_90) and
/// later, 4 MiB before, as the cuBLAS documentation recommends. weightlift-plan's
/// `cublas_workspace` charges the same (the engine tests that they agree).
pub fn cublas_workspace_bytes((major, _minor): (i32, i32)) -> usize {
    if major < 9 { 4 << 20 } else { 32 << 20 }
}

/// The kernels a CUDA product of `ty` weights in `mode` runs when it does not take cuBLAS:
/// float weights have no Q8 kernels, and fast mode allows their activations to be rounded
/// without requiring it, so they run the exact kernels.
pub fn cuda_kernel_mode(mode: MatvecMode, ty: QuantType) -> MatvecMode {
    if CUDA_FAST_FLOAT_TYPES.contains(&ty) {
        MatvecMode::Exact
    } else {
        mode
    }
}

/// The largest Q8 activation buffer the CUDA backend keeps between products: 64 KiB, 1,638
/// blocks of 32 values (a token of up to 52,416 values, or a few tokens of a short prompt).
/// Larger ones are allocated per product, so a long prompt leaves nothing behind that the plan
/// does not count.
pub const Q8_KEPT_BYTES: usize = 64 << 10;

/// The fewest tokens from which a CUDA product of `ty` weights in `mode`, `cols` values a row,
/// takes scratch memory under `counts` (`usize::MAX`: never): from its cuBLAS count (weights
/// dequantised, or activations rounded, into scratch); where it runs the exact kernels, from
/// [`DQ_PATH_MIN_TOKENS`] (the dequantised path); in Q8 mode, once its tokens' activation
/// blocks outgrow the [`Q8_KEPT_BYTES`] the backend keeps. Below it, the product's launches
/// can be recorded as a graph without the graph making memory of its own, which no plan would
/// count.
pub fn scratch_from_tokens(
    counts: &CublasMinTokens,
    ty: QuantType,
    mode: MatvecMode,
    cols: usize,
) -> usize {
    let own = match cuda_kernel_mode(mode, ty) {
        MatvecMode::Exact => DQ_PATH_MIN_TOKENS,
        MatvecMode::Q8 => match (cols / 32).checked_mul(Q8_BLOCK_BYTES) {
            Some(0) => usize::MAX,
            Some(per_token) => Q8_KEPT_BYTES / per_token + 1,
            None => 1,
        },
    };
    counts.of(ty, mode).min(own)
}

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

/// The largest head the attention kernel takes (`WL_ATT_MAX_HD` in
/// `kernels/wl_attention.cuh`).
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;

/// The widest head the prompt attention kernel `attention_prefill_{format}` takes
/// (`WL_FA_MAX_HD`); prompts of wider heads take `attention_{format}`.
pub const ATTENTION_PREFILL_MAX_HEAD_DIM: usize = 128;

/// Queries from which a call of CUDA attention takes the prompt kernel
/// `attention_prefill_{format}` (K/V tiles in shared memory met by a block of (query, head)
/// rows) instead of `attention_{format}` (one block per query, keys split across blocks): a few
/// queries fill the GPU only through the splits. A first guess, for the GPU bench to tune.
pub const ATTENTION_PREFILL_MIN_QUERIES: usize = 16;

/// Keys per tile of the prompt attention kernel (`WL_FA_KEYS`).
pub const ATTENTION_PREFILL_KEYS: usize = 32;

/// The (query, query head) rows one block of the tensor-core prompt kernel
/// `attention_prefill_mma_{format}` takes (`WL_FAM_ROWS` in `kernels/wl_fa_mma.cuh`): four warps of
/// 16, one m16n8k16 A fragment each.
pub const ATTENTION_PREFILL_MMA_ROWS: usize = 64;

/// Which kernel a CUDA backend's prompt attention runs where the tensor-core one can:
/// `attention_prefill_mma_{format}` (`mma.sync` m16n8k16, f16 operands and f32 sums) takes
/// every cache format in fast mode with heads of 64 or 128 values on compute capability 8.0 and
/// later ([`PrefillAttention::takes_mma`]); every other prompt keeps
/// `attention_prefill_{format}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillAttention {
    /// The tensor-core kernel wherever it applies.
    #[default]
    Mma,
    /// `attention_prefill_{format}` always: f32 products on the CUDA cores.
    F32,
}

impl PrefillAttention {
    /// The environment variable a CUDA backend reads when it is made.
    pub const ENV: &'static str = "WEIGHTLIFT_FA_MMA";

    /// The choice for a value of [`PrefillAttention::ENV`]: `0` keeps prompts off tensor cores;
    /// unset or anything else keeps the default.
    pub fn from_env_value(value: Option<&str>) -> Self {
        match value.map(str::trim) {
            Some("0") => PrefillAttention::F32,
            _ => PrefillAttention::Mma,
        }
    }

    /// The choice [`PrefillAttention::ENV`] makes in this process.
    pub fn from_env() -> Self {
        Self::from_env_value(std::env::var(Self::ENV).ok().as_deref())
    }

    /// Whether a prompt's attention takes `attention_prefill_mma_{format}` under this choice:
    /// f16 operands (fast mode; exact mode keeps f32 products), a head of 64 or 128 values, and
    /// a device of compute capability `cc` 8.0 or later, whatever the cache format (every pair
    /// of formats with a prompt kernel has a tensor-core one). The kernel rounds the keys and
    /// values it reads to f16, as an f16 cache stores them: exact for f16, e4m3 and bf16 within
    /// f16's normal range, a rounding of 2⁻¹¹ relative for f32 and the turned q8/q4 caches'
    /// decoded values (their host twin stays within fast mode's bound, at a third of it at
    /// most); a value below 6.1e-5 keeps f16's subnormal steps of 6e-8, and one past 65,504
    /// would become infinite.
    pub fn takes_mma(self, f16_operands: bool, head_dim: usize, cc: (i32, i32)) -> bool {
        self == PrefillAttention::Mma
            && f16_operands
            && matches!(head_dim, 64 | 128)
            && cc >= (8, 0)
    }
}

/// The (query, query head) rows one prompt attention block takes for heads of `head_dim`
/// values (`wl_fa_rows`): 32 up to 64 values, 16 up to 128 (the staged queries stay at 2,048
/// floats of shared memory).
pub fn attention_prefill_rows(head_dim: usize) -> usize {
    if head_dim.div_ceil(32) <= 2 { 32 } else { 16 }
}

/// Warps per attention block (`WL_ATT_WARPS` in `kernels/wl_attention.cuh`).
pub const ATTENTION_WARPS: usize = 4;

/// Query values one lane of an attention block holds for all the block's heads
/// (`WL_ATT_REGS`): heads per block × values per lane.
const ATTENTION_REGS: usize = 16;

/// The most query heads of one KV group an attention block takes (`WL_ATT_MAX_GROUP`).
const ATTENTION_MAX_GROUP: usize = 8;

/// The most key splits of one attention call (`WL_ATT_MAX_SPLITS`), counted over all its
/// queries: a call of `n_q` queries takes at most `ATTENTION_MAX_SPLITS / n_q` splits, so its
/// partial results fit in `n_heads × ATTENTION_MAX_SPLITS × (head_dim + 2)` values. The plan
/// reserves that much (weightlift-plan's `ATTENTION_SPLITS`, tested equal in the engine).
pub const ATTENTION_MAX_SPLITS: usize = 128;

/// The fewest keys worth a split of their own: a block's fixed cost (loading its queries,
/// merging its warps, writing its partial results) is a few memory round trips, and each warp
/// walks its keys one after another. On an H200, 32 keys a split (eight a warp) made decode
/// attention at 64 positions cost 23 µs a layer, most of it those walks; 16 halves them. The
/// plan bounds the splits of a cache of `n` positions by `ceil(n / ATTENTION_MIN_SPLIT_KEYS)`
/// (weightlift-plan's `ATTENTION_SPLIT_KEYS`).
pub const ATTENTION_MIN_SPLIT_KEYS: usize = 16;

/// The fewest keys a decode step's attention splits when it reads its position on the device
/// (see [`attention_decode_span`]).
pub const ATTENTION_MIN_SPAN: usize = 256;

/// The keys a one-query attention call splits when it reads its position from device memory
/// (`StartAt::span`), for a query that sees `keys` keys of a cache of `capacity` rows: `keys`
/// rounded up to a power of two, at least [`ATTENTION_MIN_SPAN`], at most `capacity`. The grid
/// follows the span, not the position, so a captured CUDA graph replays at every position of
/// one span. Spans that follow the keys (rather than the cache's capacity) keep the splits as
/// many as the keys need: a 32k-row cache split over its capacity would give a query at 2,048
/// positions a tenth of the blocks. A generation crosses a few spans (256, 512, 1,024, ...),
/// each captured once.
pub fn attention_decode_span(keys: usize, capacity: usize) -> usize {
    keys.max(ATTENTION_MIN_SPAN)
        .checked_next_power_of_two()
        .unwrap_or(usize::MAX)
        .min(capacity)
}

/// The keys a one-query attention call of a layer with a sliding window of `window` keys (0:
/// none) splits, given the step's [`attention_decode_span`] `span` for `n_q` queries: its
/// splits start at the first query's window start, so its queries see at most
/// `window + n_q - 1` keys from there, and a span of more would give most of its blocks no key
/// (a 128k-token gemma3 step split over 128k keys where each sliding layer sees 1,024). The
/// span is then `span` while the window is not yet full, and `window + n_q - 1` once it is: a
/// function of `span`, so every position of a step's span keeps one grid and a captured graph
/// replays at each. It never passes a ring's rows, which hold the window's keys.
pub fn attention_window_span(span: usize, window: usize, n_q: usize) -> usize {
    match window {
        0 => span,
        w => span.min(w.saturating_add(n_q.saturating_sub(1))),
    }
}

/// Attention blocks per SM the splits aim for: two blocks of four warps give each SM eight
/// warps to hide the latency of the cache reads with.
pub const ATTENTION_BLOCKS_PER_SM: usize = 2;

/// Query heads one attention block takes for heads of `head_dim` values
/// (`wl_att_block_heads`): the values per lane (`ceil(head_dim / 32)` rounded up to 2, 4 or 8)
/// times the heads stay within `ATTENTION_REGS`, and at most `ATTENTION_MAX_GROUP`. A KV
/// group of more query heads takes several blocks ("chunks") per split.
pub fn attention_block_heads(head_dim: usize) -> usize {
    let per_lane = head_dim.div_ceil(32).next_power_of_two().clamp(2, 8);
    (ATTENTION_REGS / per_lane).min(ATTENTION_MAX_GROUP)
}

/// How many ways to split the keys of an attention call (the flash-decoding split): enough
/// that `n_groups` blocks per split (KV heads × chunks of their query heads × queries) give
/// every one of `sm_count` SMs [`ATTENTION_BLOCKS_PER_SM`] blocks, but no split under
/// [`ATTENTION_MIN_SPLIT_KEYS`] of the `n_keys` keys, and at most [`ATTENTION_MAX_SPLITS`].
/// 1 (no split, no reduce kernel) when the grid is full without one, and when any count is 0.
pub fn attention_splits(n_keys: usize, n_groups: usize, sm_count: usize) -> usize {
    if n_keys == 0 || n_groups == 0 || sm_count == 0 {
        return 1;
    }
    let fill = sm_count
        .saturating_mul(ATTENTION_BLOCKS_PER_SM)
        .div_ceil(n_groups);
    let by_keys = n_keys.div_ceil(ATTENTION_MIN_SPLIT_KEYS);
    fill.min(by_keys).clamp(1, ATTENTION_MAX_SPLITS)
}

/// Values of the partial results of an attention call split `n_splits` ways
/// (`wl_att_part_*`): a maximum, a sum and `head_dim` accumulators per query, head and split.
/// `None` on overflow.
pub fn attention_scratch_values(
    n_q: usize,
    n_heads: usize,
    head_dim: usize,
    n_splits: usize,
) -> Option<usize> {
    n_q.checked_mul(n_heads)?
        .checked_mul(n_splits)?
        .checked_mul(head_dim.checked_add(2)?)
}

/// The launch of one attention call: its keys split `splits` ways, `blocks` blocks along x
/// (splits × KV heads × chunks of their query heads), and the query rows along y.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionGrid {
    pub splits: usize,
    pub blocks: usize,
}

/// The grid of an attention call of `[n_heads, kv_heads, head_dim, n_q, start]` (a checked
/// shape: `kv_heads` divides `n_heads`), splitting `start + n_q` keys (a call with a sliding
/// window splits those from its first query's window start, and counts `start` from there), on
/// a GPU of `sm_count` SMs: the split that fills it
/// ([`attention_splits`]), cut to what `scratch_values` f32 of scratch hold for the call's
/// partial results ([`attention_scratch_values`]; no room for two splits: no split).
pub fn attention_grid(
    [n_heads, kv_heads, head_dim, n_q, start]: [usize; 5],
    sm_count: usize,
    scratch_values: usize,
) -> AttentionGrid {
    let chunks = n_heads
        .checked_div(kv_heads)
        .unwrap_or(0)
        .div_ceil(attention_block_heads(head_dim));
    let groups = kv_heads.saturating_mul(chunks);
    let n_keys = start.saturating_add(n_q);
    let want = attention_splits(n_keys, groups.saturating_mul(n_q), sm_count);
    let per_split = attention_scratch_values(n_q, n_heads, head_dim, 1).unwrap_or(usize::MAX);
    let room = scratch_values / per_split.max(1);
    let splits = want.min(room).clamp(1, ATTENTION_MAX_SPLITS);
    AttentionGrid {
        splits,
        blocks: groups.saturating_mul(splits),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor-core prompt kernel takes every cache format in fast mode with heads of 64 or
    /// 128 on 8.0 and later, unless switched off; `WEIGHTLIFT_FA_MMA=0` switches it off.
    #[test]
    fn prompt_attention_takes_tensor_cores_only_where_the_kernel_applies() {
        let on = PrefillAttention::Mma;
        assert!(on.takes_mma(true, 64, (8, 0)));
        assert!(on.takes_mma(true, 128, (9, 0)));
        assert!(!on.takes_mma(false, 128, (9, 0)), "exact mode");
        for hd in [32, 40, 80, 96, 256] {
            assert!(!on.takes_mma(true, hd, (9, 0)), "head_dim {hd}");
        }
        assert!(!on.takes_mma(true, 128, (7, 5)), "sm_75");
        assert!(!PrefillAttention::F32.takes_mma(true, 128, (9, 0)));
        let env = PrefillAttention::from_env_value;
        assert_eq!(env(Some("0")), PrefillAttention::F32);
        assert_eq!(env(Some(" 0\n")), PrefillAttention::F32);
        for v in [None, Some(""), Some("1"), Some("on")] {
            assert_eq!(env(v), PrefillAttention::Mma, "{v:?}");
        }
    }

    /// The crossover is where cuBLAS starts to win for good: never, always, won then lost,
    /// lost then won, and counts where one route did not run.
    #[test]
    fn cublas_crossover_is_the_start_of_the_last_run_of_wins() {
        let t = |v: &[(usize, f64, f64)]| -> Vec<(usize, Option<f64>, Option<f64>)> {
            v.iter().map(|&(n, k, c)| (n, Some(k), Some(c))).collect()
        };
        // never: the kernels are faster at every count
        assert_eq!(
            cublas_crossover(&t(&[(2, 1.0, 2.0), (32, 3.0, 4.0), (512, 9.0, 10.0)])),
            None
        );
        // always: from the smallest count measured
        assert_eq!(
            cublas_crossover(&t(&[(2, 2.0, 1.0), (32, 4.0, 3.0), (512, 10.0, 9.0)])),
            Some(2)
        );
        // wins in the middle, then loses at the largest count: stay on the kernels
        assert_eq!(
            cublas_crossover(&t(&[(2, 1.0, 2.0), (32, 4.0, 3.0), (512, 9.0, 10.0)])),
            None
        );
        // wins early, loses, then wins from 64 on; the input in any order
        assert_eq!(
            cublas_crossover(&t(&[
                (512, 10.0, 5.0),
                (4, 2.0, 1.0),
                (16, 2.0, 3.0),
                (64, 4.0, 3.0),
                (128, 6.0, 4.0),
            ])),
            Some(64)
        );
        // a tie is not a win
        assert_eq!(
            cublas_crossover(&t(&[(16, 2.0, 2.0), (32, 4.0, 3.0)])),
            Some(32)
        );
        // a count where cuBLAS did not run (or the kernels did not) is not a win
        assert_eq!(
            cublas_crossover(&[(16, Some(2.0), Some(1.0)), (32, Some(4.0), None)]),
            None
        );
        assert_eq!(
            cublas_crossover(&[(16, None, Some(1.0)), (32, Some(4.0), Some(3.0))]),
            Some(32)
        );
        assert_eq!(cublas_crossover(&[]), None);
    }

    /// A type's own count replaces the common one for that type and mode only, and a second
    /// count for the same pair replaces the first.
    #[test]
    fn cublas_min_tokens_by_type_and_mode() {
        let d = CublasMinTokens::default();
        assert_eq!(d.every(), CUBLAS_MIN_TOKENS);
        let t = CublasMinTokens::uniform(32)
            .with(QuantType::Q4_K, MatvecMode::Q8, 64)
            .with(QuantType::Q4_K, MatvecMode::Q8, 48)
            .with(QuantType::BF16, MatvecMode::Exact, usize::MAX);
        assert_eq!(t.of(QuantType::Q4_K, MatvecMode::Q8), 48);
        assert_eq!(t.of(QuantType::Q4_K, MatvecMode::Exact), 32);
        assert_eq!(t.of(QuantType::BF16, MatvecMode::Exact), usize::MAX);
        assert_eq!(t.of(QuantType::Q8_0, MatvecMode::Q8), 32);
        assert_eq!(
            CublasMinTokens::uniform(1).of(QuantType::F16, MatvecMode::Q8),
            1
        );
        assert_eq!(t.least(), 32);
        assert_eq!(t.with(QuantType::F16, MatvecMode::Q8, 2).least(), 2);
        assert_eq!(CublasMinTokens::uniform(usize::MAX).least(), usize::MAX);
        assert!(d.least() <= d.every());
    }

    /// A product takes scratch from its cuBLAS count, from the dequantised path's count where
    /// it runs the exact kernels, and in Q8 mode from the tokens whose activation blocks
    /// outgrow the kept buffer, whichever comes first.
    #[test]
    fn scratch_from_tokens_is_the_first_route_into_scratch() {
        use MatvecMode::{Exact, Q8};
        use QuantType::{BF16, F32, Q4_K, Q8_0};
        let d = CublasMinTokens::default();
        // fast mode: Q4_K's cuBLAS count (9) before its activations outgrow 64 KiB
        assert_eq!(scratch_from_tokens(&d, Q4_K, Q8, 2048), 9);
        // 14,336 values a token: 448 blocks of 40 bytes, 17,920 bytes; the fourth token spills
        assert_eq!(scratch_from_tokens(&d, Q4_K, Q8, 14336), 4);
        // Q8_0 takes cuBLAS from two tokens
        assert_eq!(scratch_from_tokens(&d, Q8_0, Q8, 2048), 2);
        // bf16 in fast mode runs the exact kernels: its cuBLAS count and the dequantised path's
        assert_eq!(scratch_from_tokens(&d, BF16, Q8, 2048), 8);
        assert_eq!(DQ_PATH_MIN_TOKENS, 8);
        // exact mode: the dequantised path, before cuBLAS's 32
        assert_eq!(
            scratch_from_tokens(&d, Q4_K, Exact, 2048),
            DQ_PATH_MIN_TOKENS
        );
        assert_eq!(
            scratch_from_tokens(&d, F32, Exact, 2048),
            DQ_PATH_MIN_TOKENS
        );
        // counts that never take cuBLAS leave the kernels' own routes
        let never = CublasMinTokens::uniform(usize::MAX);
        assert_eq!(
            scratch_from_tokens(&never, Q4_K, Q8, 2048),
            Q8_KEPT_BYTES / (64 * Q8_BLOCK_BYTES) + 1
        );
        assert_eq!(scratch_from_tokens(&never, Q4_K, Q8, 0), usize::MAX);
    }

    /// The int8 kernels' count is where they beat the backend's kernels for good below
    /// cuBLAS's; cuBLAS's is where it beats the faster of the two for good.
    #[test]
    fn prompt_crossovers_give_each_count_its_fastest_route() {
        let t = |v: &[(usize, f64, Option<f64>, Option<f64>)]| -> Vec<_> {
            v.iter().map(|&(n, k, m, c)| (n, Some(k), m, c)).collect()
        };
        // kernels, then int8, then cuBLAS
        let three = t(&[
            (2, 1.0, Some(2.0), Some(3.0)),
            (16, 4.0, Some(3.0), Some(5.0)),
            (64, 9.0, Some(6.0), Some(7.0)),
            (512, 40.0, Some(30.0), Some(20.0)),
        ]);
        assert_eq!(prompt_crossovers(&three), (Some(16), Some(512)));
        // cuBLAS beats the kernels from 64 but the int8 kernels only at 512
        let late = t(&[
            (2, 1.0, Some(2.0), Some(3.0)),
            (64, 9.0, Some(6.0), Some(8.0)),
            (512, 40.0, Some(30.0), Some(20.0)),
        ]);
        assert_eq!(prompt_crossovers(&late), (Some(64), Some(512)));
        // the int8 kernels never win; no int8 times at all
        let never = t(&[(2, 1.0, Some(2.0), None), (64, 9.0, Some(10.0), None)]);
        assert_eq!(prompt_crossovers(&never), (None, None));
        let none = t(&[(2, 1.0, None, Some(3.0)), (64, 9.0, None, Some(5.0))]);
        assert_eq!(prompt_crossovers(&none), (None, Some(64)));
        // cuBLAS wins everywhere: nothing is left below it for the int8 kernels
        let all = t(&[
            (2, 3.0, Some(2.0), Some(1.0)),
            (64, 9.0, Some(6.0), Some(5.0)),
        ]);
        assert_eq!(prompt_crossovers(&all), (None, Some(2)));
    }

    /// The int8 tensor-core route is off by default, counts only in fast mode for the types
    /// with `q8_mma_` kernels on 8.0 and later, and between it and cuBLAS the larger count
    /// reached wins (it on a tie); the environment's number sets every type's count.
    #[test]
    fn mma_route_by_type_mode_count_and_device() {
        use PromptRoute::{Cublas, Kernels, Mma};
        let (q4k, q8) = (QuantType::Q4_K, MatvecMode::Q8);
        let sm90 = (9, 0);
        let d = CublasMinTokens::default();
        assert_eq!(d.mma_of(q4k, q8), usize::MAX);
        assert_eq!(d.route(q4k, q8, 4, sm90), Kernels);
        assert_eq!(d.route(q4k, q8, 512, sm90), Cublas);
        let t = CublasMinTokens::uniform(256).with_mma(q4k, 16);
        assert_eq!(t.route(q4k, q8, 8, sm90), Kernels);
        assert_eq!(t.route(q4k, q8, 16, sm90), Mma);
        assert_eq!(t.route(q4k, q8, 255, sm90), Mma);
        assert_eq!(t.route(q4k, q8, 256, sm90), Cublas);
        assert_eq!(t.route(q4k, q8, 16, (7, 5)), Kernels, "sm_75");
        assert_eq!(t.route(q4k, q8, 256, (8, 6)), Cublas);
        assert!(!t.mma_takes(q4k, q8, 16, (7, 5)));
        assert_eq!(t.route(q4k, MatvecMode::Exact, 16, sm90), Kernels, "exact");
        assert_eq!(t.route(QuantType::Q8_0, q8, 16, sm90), Kernels, "no count");
        // a larger count than cuBLAS's takes over from it; a tie goes to the kernels
        let late = CublasMinTokens::uniform(32).with_mma(q4k, 128);
        assert_eq!(late.route(q4k, q8, 64, sm90), Cublas);
        assert_eq!(late.route(q4k, q8, 128, sm90), Mma);
        let tie = CublasMinTokens::uniform(32).with_mma(q4k, 32);
        assert_eq!(tie.route(q4k, q8, 32, sm90), Mma);
        // types without q8_mma_ kernels never take it
        let f16 = CublasMinTokens::uniform(usize::MAX).with_mma(QuantType::F16, 1);
        assert_eq!(f16.route(QuantType::F16, q8, 64, sm90), Kernels);
        let every = CublasMinTokens::uniform(usize::MAX).with_mma_env_value(Some(" 8 "));
        for &ty in MMQ_TYPES {
            assert_eq!(every.mma_of(ty, q8), 8, "{ty}");
            assert_eq!(every.mma_of(ty, MatvecMode::Exact), usize::MAX, "{ty}");
        }
        assert_eq!(d.clone().with_mma_env_value(Some("many")), d);
        assert_eq!(d.clone().with_mma_env_value(None), d);
        let moved = CublasMinTokens::uniform(64)
            .with_mma(q4k, 8)
            .with_cublas_every(16);
        assert_eq!(moved.of(q4k, q8), 16);
        assert_eq!(moved.mma_of(q4k, q8), 8);
    }

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

    /// The routes of the prompt products: what is converted, dequantised and multiplied, for
    /// the types the tests run on a GPU (f16, bf16, q8_0, q4_k) and f32, in both modes.
    #[test]
    fn cublas_routes_convert_dequantise_and_chunk_as_documented() {
        use QuantType::{BF16, F16, F32, Q4_K, Q5_K, Q8_0};
        let r = |fast, ty, max_dq| cublas_route(fast, ty, 5632, 2048, max_dq);
        let big = 1 << 30;
        // exact: f32 as stored, the others dequantised to f32 in chunks of whole GEMM blocks
        let e = r(false, F32, big).unwrap();
        assert_eq!(
            (e.convert, e.dequantize, e.chunk, e.operands),
            (None, None, 5632, "f32")
        );
        for (ty, name) in [(F16, "f16"), (BF16, "bf16"), (Q8_0, "q8_0"), (Q4_K, "q4_k")] {
            let e = r(false, ty, big).unwrap();
            assert_eq!(e.convert, None);
            assert_eq!(e.dequantize, Some(format!("dequantize_{name}_f32")));
            assert_eq!(e.operands, "f32");
            // 16 Mi values (DQ_CHUNK_CAP) of 2048 are 8192 rows: all 5632 in one chunk
            assert_eq!(e.chunk, 5632);
            let e = r(false, ty, 2048 * 100).unwrap();
            assert_eq!(e.chunk, 64, "100 rows fit: one GEMM block");
        }
        // fast: f16 and bf16 as stored with the activations rounded to their type
        let f = r(true, F16, big).unwrap();
        assert_eq!(
            (f.convert, f.dequantize, f.chunk, f.operands),
            (Some("convert_f32_f16"), None, 5632, "f16")
        );
        let b = r(true, BF16, big).unwrap();
        assert_eq!(
            (b.convert, b.dequantize, b.chunk, b.operands),
            (Some("convert_f32_bf16"), None, 5632, "bf16")
        );
        // fast, quantised: dequantised to f16, activations to f16
        for (ty, name) in [(Q8_0, "q8_0"), (Q4_K, "q4_k")] {
            let q = r(true, ty, big).unwrap();
            assert_eq!(q.convert, Some("convert_f32_f16"));
            assert_eq!(q.dequantize, Some(format!("dequantize_{name}_f16")));
            assert_eq!(q.operands, "f16");
        }
        // no route: a type without fast-mode kernels, f32 in fast mode, a row past
        // max_dq_size (the kernels need no scratch), nothing to multiply
        assert_eq!(r(true, Q5_K, big), None);
        assert_eq!(r(true, F32, big), None);
        assert_eq!(r(false, Q4_K, 2047), None);
        assert_eq!(r(true, Q8_0, 2047), None);
        assert!(r(true, F16, 2047).is_some(), "as stored: no chunk to fit");
        assert_eq!(cublas_route(false, F16, 0, 2048, big), None);
        assert_eq!(cublas_route(false, F16, 8, 0, big), None);
    }

    #[test]
    fn grid_takes_the_split_the_scratch_holds() {
        let planned = |nh: usize, hd: usize| nh * ATTENTION_MAX_SPLITS * (hd + 2);
        // a 1.1B llama's decode step at 2,048 positions on 132 SMs: 4 KV heads of 8 query
        // heads, 66 splits of 32 keys (the last of 16), 264 blocks: two an SM
        let g = attention_grid([32, 4, 64, 1, 2047], 132, planned(32, 64));
        assert_eq!(
            g,
            AttentionGrid {
                splits: 66,
                blocks: 264
            }
        );
        // at 64 positions: four splits of 16 keys
        let g = attention_grid([32, 4, 64, 1, 63], 132, planned(32, 64));
        assert_eq!(
            g,
            AttentionGrid {
                splits: 4,
                blocks: 16
            }
        );
        // 12 query heads of 128 a KV head: three chunks of four
        let g = attention_grid([12, 1, 128, 1, 4095], 132, planned(12, 128));
        assert_eq!(
            g,
            AttentionGrid {
                splits: 88,
                blocks: 264
            }
        );
        // 5 queries share the planned room: at most 128 / 5 splits
        let g = attention_grid([4, 1, 64, 5, 1 << 20], 132, planned(4, 64));
        assert_eq!(g.splits, ATTENTION_MAX_SPLITS / 5);
        // room for two splits, then none
        let two = attention_scratch_values(1, 32, 64, 2).unwrap();
        assert_eq!(attention_grid([32, 4, 64, 1, 2047], 132, two).splits, 2);
        assert_eq!(attention_grid([32, 4, 64, 1, 2047], 132, two - 1).splits, 1);
        assert_eq!(attention_grid([32, 4, 64, 1, 2047], 132, 0).splits, 1);
        // a prompt fills the GPU by itself
        let g = attention_grid([32, 4, 64, 512, 0], 132, planned(32, 64));
        assert_eq!(
            g,
            AttentionGrid {
                splits: 1,
                blocks: 4
            }
        );
    }

    #[test]
    fn block_heads_follow_the_register_budget() {
        for (hd, want) in [
            (1, 8),
            (32, 8),
            (40, 8),
            (64, 8),
            (80, 4),
            (96, 4),
            (128, 4),
            (160, 2),
            (256, 2),
        ] {
            assert_eq!(attention_block_heads(hd), want, "head_dim {hd}");
        }
    }

    #[test]
    fn q8_wide_decode_rows_keep_a_unit_a_lane() {
        // a 1.1B llama on 132 SMs: rows of 2,048 values are 32 units, one warp; the FFN's
        // down rows (5,632 values, 88 units) two; 4096 x 14336 (224 units) four
        assert_eq!(q8_wide_matvec_warps(256, 2048, 132), 1);
        assert_eq!(q8_wide_matvec_warps(2048, 2048, 132), 1);
        assert_eq!(q8_wide_matvec_warps(5632, 2048, 132), 1);
        assert_eq!(q8_wide_matvec_warps(2048, 5632, 132), 2);
        assert_eq!(q8_wide_matvec_warps(4096, 14336, 132), 4);
        assert_eq!(q8_wide_matvec_warps(14336, 4096, 132), 1);
        assert_eq!(q8_wide_matvec_warps(32000, 2048, 132), 1);
        // short rows: one warp, some lanes idle; nothing to fill
        assert_eq!(q8_wide_matvec_warps(8, 256, 132), 1);
        assert_eq!(q8_wide_matvec_warps(0, 65536, 0), 8);
    }

    #[test]
    fn q8_decode_reads_its_switch() {
        assert_eq!(Q8Decode::from_env_value(None), Q8Decode::Wide);
        assert_eq!(Q8Decode::from_env_value(Some("")), Q8Decode::Wide);
        assert_eq!(Q8Decode::from_env_value(Some("Narrow ")), Q8Decode::Narrow);
        assert_eq!(Q8Decode::from_env_value(Some("wide")), Q8Decode::Wide);
        assert_eq!(Q8Decode::default(), Q8Decode::Wide);
        assert!(Q8Decode::Wide.wide_for(QuantType::Q4_K));
        assert!(Q8Decode::Wide.wide_for(QuantType::Q6_K));
        assert!(!Q8Decode::Wide.wide_for(QuantType::Q4_0));
        assert!(!Q8Decode::Narrow.wide_for(QuantType::Q4_K));
    }

    #[test]
    fn q8_decode_rows_take_warps_to_fill_the_device() {
        // a 1.1B llama on 132 SMs (about 8,448 warps wanted): k/v (256 rows) and q/o (2,048
        // rows) of 2,048 values take eight warps a row, the FFN's 5,632 rows two, the head's
        // 32,000 rows one
        assert_eq!(q8_matvec_warps(256, 2048, 132), 8);
        assert_eq!(q8_matvec_warps(2048, 2048, 132), 8);
        assert_eq!(q8_matvec_warps(5632, 2048, 132), 2);
        assert_eq!(q8_matvec_warps(32000, 2048, 132), 1);
        // short rows keep two groups a lane: 512 values (16 groups) take two warps at most,
        // 256 values one
        assert_eq!(q8_matvec_warps(8, 512, 132), 2);
        assert_eq!(q8_matvec_warps(8, 256, 132), 1);
        // nothing to fill, or rows shorter than a block
        assert_eq!(q8_matvec_warps(0, 2048, 0), 8);
        assert_eq!(q8_matvec_warps(1, 32, 132), 1);
    }

    #[test]
    fn splits_fill_the_sms_with_enough_keys_each() {
        // a 1.1B llama's decode step on 132 SMs: 4 KV heads, one chunk of 8 query heads each
        assert_eq!(attention_splits(2048, 4, 132), 66, "two blocks an SM");
        assert_eq!(attention_splits(64, 4, 132), 4, "16 keys a split");
        assert_eq!(attention_splits(65, 4, 132), 5, "a last split of one key");
        // 66 splits fill 132 SMs twice over; more keys do not make more
        assert_eq!(attention_splits(1 << 20, 4, 132), 66);
        // one KV head (a tensor-parallel rank, or multi-query attention) stops at the cap
        assert_eq!(attention_splits(1 << 20, 1, 132), ATTENTION_MAX_SPLITS);
        // a prompt of 512 queries fills the GPU without a split
        assert_eq!(attention_splits(4096, 4 * 512, 132), 1);
        // few keys, or nothing to split
        assert_eq!(attention_splits(1, 4, 132), 1);
        assert_eq!(attention_splits(15, 4, 132), 1);
        assert_eq!(attention_splits(17, 4, 132), 2);
        for zero in [(0, 4, 132), (64, 0, 132), (64, 4, 0)] {
            assert_eq!(attention_splits(zero.0, zero.1, zero.2), 1, "{zero:?}");
        }
        assert_eq!(
            attention_splits(usize::MAX, 1, usize::MAX),
            ATTENTION_MAX_SPLITS
        );
    }

    #[test]
    fn decode_spans_follow_the_keys_in_powers_of_two_within_the_cache() {
        assert_eq!(attention_decode_span(1, 4096), ATTENTION_MIN_SPAN);
        assert_eq!(attention_decode_span(256, 4096), 256);
        assert_eq!(attention_decode_span(257, 4096), 512);
        assert_eq!(attention_decode_span(2048, 32768), 2048);
        assert_eq!(attention_decode_span(2049, 32768), 4096);
        // never past the cache, which holds every key
        assert_eq!(attention_decode_span(3000, 3000), 3000);
        assert_eq!(attention_decode_span(100, 128), 128);
        assert_eq!(attention_decode_span(usize::MAX, 64), 64);
    }

    #[test]
    fn a_sliding_layers_span_is_its_window_once_full() {
        // no window: the step's span
        assert_eq!(attention_window_span(4096, 0, 1), 4096);
        // gemma3's 1,024-key window: the step's span until it passes the window, then the
        // window at every longer span
        assert_eq!(attention_window_span(256, 1024, 1), 256);
        assert_eq!(attention_window_span(1024, 1024, 1), 1024);
        for span in [2048, 4096, 1 << 17] {
            assert_eq!(attention_window_span(span, 1024, 1), 1024);
        }
        // three queries see up to two keys more from the first one's window start
        assert_eq!(attention_window_span(4096, 1024, 3), 1026);
        assert_eq!(attention_window_span(usize::MAX, usize::MAX, 2), usize::MAX);
    }

    #[test]
    fn split_scratch_is_bounded_by_the_heads_and_the_cap() {
        assert_eq!(attention_scratch_values(1, 32, 64, 64), Some(32 * 64 * 66));
        assert_eq!(
            attention_scratch_values(1, 32, 64, ATTENTION_MAX_SPLITS),
            Some(32 * ATTENTION_MAX_SPLITS * 66)
        );
        assert_eq!(attention_scratch_values(usize::MAX, 2, 64, 2), None);
    }
}

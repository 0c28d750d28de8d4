//! The host C++ build of `kernels/*.cuh` (see `shim/host_shim.cpp`), for tests that check the
//! device maths without a GPU: block decoders and layouts, the `scan_{type}` block check, the
//! matvec kernels' per-lane dot products and warp butterfly (and the float-weight kernels'
//! chunked chains and reduction), SwiGLU's product, RoPE fused with the cache store, f16
//! rounding and the KV-cache codecs, the Q8-activation
//! mode and dequantised-path GEMM of the matmul kernels, the split attention with its
//! reduce, the prompt attention, the tensor-core prompt kernel's lane arithmetic ([`fa_mma`]), the int8
//! tensor-core Q8 prompt product's ([`mmq`]),
//! and quantise-on-load's block quantisers with their non-finite report.
//! Present when `build.rs` found a C++ compiler.
// Calling the C++ shim is FFI; each wrapper checks the buffer sizes the shim relies on.
#![allow(unsafe_code)]

use crate::cpu::attention::AttnShape;
use crate::cpu::kv::KvType;
use crate::cpu::kv_format::KvFormat;
use crate::error::{KernelError, Result};
use crate::types::{FloatType, QuantType};

unsafe extern "C" {
    fn wl_host_dequant(ty: i32, src: *const u8, dst: *mut f32, nblocks: usize) -> i32;
    fn wl_host_dequant8(ty: i32, src: *const u8, dst: *mut f32, n: usize) -> i32;
    fn wl_host_f32_to_f16(src: *const f32, dst: *mut u16, n: usize);
    fn wl_host_block_layout(ty: i32, out: *mut i32) -> i32;
    fn wl_host_scan_blocks(ty: i32, src: *const u8, nblocks: usize) -> u64;
    fn wl_host_matmul(
        ty: i32,
        act_f16: i32,
        w: *const u8,
        x: *const u8,
        y: *mut f32,
        rows: usize,
        cols: usize,
        n_tok: usize,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn wl_host_float_matmul(
        ty: i32,
        act_f16: i32,
        w: *const u8,
        x: *const u8,
        y: *mut f32,
        rows: usize,
        cols: usize,
        n_tok: usize,
        tpr: i32,
        nt_max: i32,
    ) -> i32;
    fn wl_host_silu_mul(gate: *const f32, up: *const f32, out: *mut f32, n: usize);
    #[allow(clippy::too_many_arguments)]
    fn wl_host_rope_kv_store(
        kf: i32,
        vf: i32,
        q: *mut f32,
        k: *const f32,
        v: *const f32,
        pos: *const i32,
        freqs: *const f32,
        kc: *mut u8,
        vc: *mut u8,
        n_tok: usize,
        n_heads: usize,
        kv_heads: usize,
        head_dim: i32,
        n_dims: i32,
        neox: i32,
        mscale: f32,
        cap: usize,
    );
    fn wl_host_q8_quantize(act_f16: i32, x: *const u8, out: *mut u8, n_blocks: usize);
    fn wl_host_quantize(
        ty: i32,
        src_ty: i32,
        src: *const u8,
        dst: *mut u8,
        n_blocks: usize,
        first: u64,
    ) -> u64;
    #[allow(clippy::too_many_arguments)]
    fn wl_host_q8_matvec(
        ty: i32,
        al: i32,
        wpr: i32,
        w: *const u8,
        xq: *const u8,
        y: *mut f32,
        rows: usize,
        cols: usize,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn wl_host_q8_wide_matvec(
        ty: i32,
        al: i32,
        wpr: i32,
        w: *const u8,
        xq: *const u8,
        y: *mut f32,
        rows: usize,
        cols: usize,
    ) -> i32;
    fn wl_host_q8_matmul(
        ty: i32,
        w: *const u8,
        xq: *const u8,
        y: *mut f32,
        rows: usize,
        cols: usize,
        n_tok: usize,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn wl_host_gemm(
        act_f16: i32,
        wd: *const f32,
        x: *const u8,
        y: *mut f32,
        n_rows: usize,
        cols: usize,
        n_tok: usize,
        row0: usize,
        rows: usize,
        grid_y: usize,
    );
    fn wl_host_kv_quantize(x: *const f32, out: *mut u8, n_groups: usize, qmax: i32);
    fn wl_host_kv_dequantize(src: *const u8, out: *mut f32, n_groups: usize, qmax: i32);
    fn wl_host_kv_store(x: *const f32, out: *mut u8, n_groups: usize, qmax: i32);
    fn wl_host_kv_load(src: *const u8, out: *mut f32, n_groups: usize, qmax: i32);
    fn wl_host_att_block_heads(head_dim: i32) -> i32;
    fn wl_host_fa_rows(head_dim: i32) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn wl_host_attention_prefill(
        k_fmt: i32,
        v_fmt: i32,
        q: *const f32,
        k: *const u8,
        v: *const u8,
        out: *mut f32,
        n_q: usize,
        start: usize,
        n_heads: usize,
        kv_heads: usize,
        head_dim: i32,
        scale: f32,
        f16_operands: i32,
        window: usize,
        softcap: f32,
        cache_rows: usize,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn wl_host_attention(
        k_fmt: i32,
        v_fmt: i32,
        q: *const f32,
        k: *const u8,
        v: *const u8,
        out: *mut f32,
        part: *mut f32,
        n_q: usize,
        start: usize,
        n_heads: usize,
        kv_heads: usize,
        head_dim: i32,
        scale: f32,
        f16_operands: i32,
        n_splits: usize,
        pos: *const i32,
        span: usize,
        window: usize,
        softcap: f32,
        rows: usize,
    ) -> i32;
    fn wl_host_att_splits(
        pos: *const i32,
        start: usize,
        n_q: usize,
        window: usize,
        span: usize,
        n_splits: usize,
        i: usize,
        ranges: *mut usize,
    ) -> i64;
}

/// Dequantises with the host build of `wl_dequant.cuh`, value by value (`wl_dq_<type>`).
pub fn dequantize_f32(ty: QuantType, src: &[u8], out: &mut [f32]) -> Result<()> {
    dequantize_with(ty, src, out, false)
}

/// Dequantises as the `dequantize_{type}` kernels do: eight values at a time (`wl_dq8_<type>`).
pub fn dequantize_f32_by_eights(ty: QuantType, src: &[u8], out: &mut [f32]) -> Result<()> {
    dequantize_with(ty, src, out, true)
}

fn dequantize_with(ty: QuantType, src: &[u8], out: &mut [f32], eights: bool) -> Result<()> {
    let n = ty.blocks_in("src", src.len())?;
    let expected = n * ty.block_size();
    if out.len() != expected {
        return Err(KernelError::LengthMismatch {
            what: "host dequantize output values",
            expected,
            got: out.len(),
        });
    }
    let id = ty.ggml_id() as i32;
    // SAFETY: src holds n whole blocks and out n * block_size floats, which is all the shim touches.
    let ok = unsafe {
        if eights {
            wl_host_dequant8(id, src.as_ptr(), out.as_mut_ptr(), expected)
        } else {
            wl_host_dequant(id, src.as_ptr(), out.as_mut_ptr(), n)
        }
    };
    if ok == 0 {
        return Err(KernelError::Unsupported {
            op: "host dequantize",
            ty: ty.to_string(),
            supported: "all QuantType values",
        });
    }
    Ok(())
}

/// The header's `wl_block_layout` for `ty`: `[values, bytes, scale offset, second scale
/// offset]` per block, offsets -1 where the type has none; `None` for a type it does not know.
pub fn block_layout(ty: QuantType) -> Option<[i32; 4]> {
    let mut out = [0i32; 4];
    // SAFETY: the shim writes exactly four i32s to `out`.
    let ok = unsafe { wl_host_block_layout(ty.ggml_id() as i32, out.as_mut_ptr()) };
    (ok != 0).then_some(out)
}

/// What the `scan_{type}` kernels compute, with the header's `wl_block_scales_non_finite`: the
/// first element of the first block of `src` with a NaN/inf scale (quantised types only).
pub fn scan_blocks(ty: QuantType, src: &[u8]) -> Result<Option<usize>> {
    let n = ty.blocks_in("src", src.len())?;
    // SAFETY: src holds n whole blocks, all the shim reads.
    let first = unsafe { wl_host_scan_blocks(ty.ggml_id() as i32, src.as_ptr(), n) };
    Ok((first != u64::MAX).then_some(first as usize))
}

/// Activations for [`matmul`]: f32 values or f16 bits.
#[derive(Debug, Clone, Copy)]
pub enum Act<'a> {
    /// f32 activations.
    F32(&'a [f32]),
    /// f16 activations (bit patterns).
    F16(&'a [u16]),
}

/// What the `matmul_{type}_{act}` / `matvec_` kernels compute, with the header's per-lane dot
/// products and the kernel's warp butterfly replayed in order: `y[t * rows + r]` for `n_tok`
/// tokens of `cols` activations each.
pub fn matmul(
    ty: QuantType,
    w: &[u8],
    x: Act<'_>,
    y: &mut [f32],
    rows: usize,
    cols: usize,
) -> Result<()> {
    let bs = ty.block_size();
    let row_bytes = cols / bs * ty.block_bytes();
    let (x_len, act_f16, x_ptr) = match x {
        Act::F32(v) => (v.len(), 0, v.as_ptr().cast::<u8>()),
        Act::F16(v) => (v.len(), 1, v.as_ptr().cast::<u8>()),
    };
    let n_tok = x_len.checked_div(cols).unwrap_or(0);
    let shape_ok = cols.is_multiple_of(bs)
        && n_tok * cols == x_len
        && rows.checked_mul(row_bytes) == Some(w.len())
        && y.len() == rows * n_tok;
    if !shape_ok {
        return Err(KernelError::Shape {
            op: "host matmul",
            reason: format!(
                "{rows} x {cols} {ty} weights in {} bytes, {x_len} activations, {} outputs",
                w.len(),
                y.len()
            ),
        });
    }
    // SAFETY: w holds rows whole rows of cols / bs blocks, x n_tok * cols activations of the
    // declared width and y rows * n_tok floats (checked above): all the shim touches.
    let ok = unsafe {
        wl_host_matmul(
            ty.ggml_id() as i32,
            act_f16,
            w.as_ptr(),
            x_ptr,
            y.as_mut_ptr(),
            rows,
            cols,
            n_tok,
        )
    };
    if ok == 0 {
        return Err(KernelError::Unsupported {
            op: "host matmul",
            ty: ty.to_string(),
            supported: "q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k (float weights: float_matmul)",
        });
    }
    Ok(())
}

/// What the float-weight kernels `matvec_{f16,bf16,f32}_{act}` (`matmul` false: one token a
/// pass) and `matmul_…` (`matmul` true: [`crate::sources::FLOAT_TOKENS_PER_PASS`] tokens a pass)
/// compute with `tpr` threads a row, every thread's FMA chains (the header's `wl_fv_lane_*`) and
/// the kernel's reduction replayed in order: `y[t * rows + r]` for the tokens in `x`.
#[allow(clippy::too_many_arguments)]
pub fn float_matmul(
    ty: QuantType,
    w: &[u8],
    x: Act<'_>,
    y: &mut [f32],
    rows: usize,
    cols: usize,
    tpr: usize,
    matmul: bool,
) -> Result<()> {
    let (x_len, act_f16, x_ptr) = x.raw();
    let n_tok = x_len.checked_div(cols).unwrap_or(0);
    let shape_ok = n_tok * cols == x_len
        && rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(ty.block_bytes()))
            == Some(w.len())
        && y.len() == rows * n_tok
        && ty.block_size() == 1
        && crate::sources::FLOAT_ROW_THREADS.contains(&tpr);
    if !shape_ok {
        return Err(KernelError::Shape {
            op: "host float matmul",
            reason: format!(
                "{rows} x {cols} {ty} weights in {} bytes, {x_len} activations, {} outputs, {tpr} threads a row",
                w.len(),
                y.len()
            ),
        });
    }
    let nt_max = if matmul {
        crate::sources::FLOAT_TOKENS_PER_PASS
    } else {
        1
    };
    // SAFETY: w holds rows × cols values of the type's width, x n_tok * cols activations of the
    // declared width and y rows * n_tok floats (checked above): all the shim touches.
    let ok = unsafe {
        wl_host_float_matmul(
            ty.ggml_id() as i32,
            act_f16,
            w.as_ptr(),
            x_ptr,
            y.as_mut_ptr(),
            rows,
            cols,
            n_tok,
            tpr as i32,
            nt_max as i32,
        )
    };
    if ok == 0 {
        return Err(KernelError::Unsupported {
            op: "host float matmul",
            ty: ty.to_string(),
            supported: "f16, bf16, f32",
        });
    }
    Ok(())
}

/// SwiGLU's product of each gate and up value with the header's `WL_SILU_MUL`: what the fused
/// gate/up kernels and `swiglu_inplace_f32` make of a row's two sums.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    if gate.len() != out.len() || up.len() != out.len() {
        return Err(KernelError::Shape {
            op: "host silu_mul",
            reason: format!(
                "{} gate, {} up and {} output values; all three must be equal",
                gate.len(),
                up.len(),
                out.len()
            ),
        });
    }
    // SAFETY: all three slices hold out.len() floats (checked above).
    unsafe { wl_host_silu_mul(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), out.len()) }
    Ok(())
}

/// The cache formats' codes in `kernels/wl_rope_kv.cuh` (`WL_KVF_*`).
fn kvf_code(format: KvFormat) -> i32 {
    match format {
        KvFormat::F32 => 0,
        KvFormat::F16 => 1,
        KvFormat::BF16 => 2,
        KvFormat::E4M3 => 3,
        KvFormat::Q8 => 4,
        KvFormat::Q4 => 5,
    }
}

/// What the fused `rope_kv_store_{format}` kernel computes, work unit by work unit with the
/// header's own functions: `q` (`positions.len() × n_heads × head_dim`) rotated in place, and
/// `k` rotated and `v` as it is (each `positions.len() × kv_heads × head_dim`) encoded into the
/// cache rows `k_cache` (as `k_format`) and `v_cache` (as `v_format`); `k` is left as it was.
/// `cap` 0: the caches are the rows being written; else they hold `cap` rows and each token is
/// written at row `position % cap` (a negative position: skipped), as the kernel's `cap`.
#[allow(clippy::too_many_arguments)]
pub fn rope_kv_store(
    params: &crate::cpu::ops::RopeParams,
    (n_heads, kv_heads): (usize, usize),
    (k_format, v_format): (KvFormat, KvFormat),
    q: &mut [f32],
    k: &[f32],
    v: &[f32],
    positions: &[i32],
    inv_freqs: &[f32],
    k_cache: &mut [u8],
    v_cache: &mut [u8],
    cap: usize,
) -> Result<()> {
    params.check()?;
    let (n_tok, hd) = (positions.len(), params.head_dim);
    let kvn = n_tok * kv_heads * hd;
    k_format.check_values("host rope_kv_store", 0, kvn)?;
    v_format.check_values("host rope_kv_store", 0, kvn)?;
    let rows = if cap == 0 { n_tok } else { cap };
    let cached = rows * kv_heads * hd;
    if cap > 0 {
        // a row starts at a whole group
        k_format.check_values("host rope_kv_store", kv_heads * hd, cached)?;
        v_format.check_values("host rope_kv_store", kv_heads * hd, cached)?;
    }
    let shape_ok = q.len() == n_tok * n_heads * hd
        && k.len() == kvn
        && v.len() == kvn
        && inv_freqs.len() == params.n_dims / 2
        && k_cache.len() == k_format.byte_at(cached)
        && v_cache.len() == v_format.byte_at(cached)
        && i32::try_from(hd).is_ok();
    if !shape_ok {
        return Err(KernelError::Shape {
            op: "host rope_kv_store",
            reason: format!(
                "{n_tok} tokens of {n_heads} query and {kv_heads} key heads of {hd}: {} query, \
                 {} key, {} value values, {} angles, {} and {} cache bytes",
                q.len(),
                k.len(),
                v.len(),
                inv_freqs.len(),
                k_cache.len(),
                v_cache.len()
            ),
        });
    }
    // SAFETY: every slice holds what the shape needs (checked above): the shim touches no more.
    unsafe {
        wl_host_rope_kv_store(
            kvf_code(k_format),
            kvf_code(v_format),
            q.as_mut_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            positions.as_ptr(),
            inv_freqs.as_ptr(),
            k_cache.as_mut_ptr(),
            v_cache.as_mut_ptr(),
            n_tok,
            n_heads,
            kv_heads,
            hd as i32,
            params.n_dims as i32,
            i32::from(params.style == crate::cpu::ops::RopeStyle::Neox),
            params.attn_factor,
            cap,
        )
    }
    Ok(())
}

/// f32 to f16 bits with the header's `wl_f32_to_f16`.
pub fn f32_to_f16(src: &[f32], out: &mut [u16]) {
    let n = src.len().min(out.len());
    // SAFETY: both buffers hold at least n elements.
    unsafe { wl_host_f32_to_f16(src.as_ptr(), out.as_mut_ptr(), n) }
}

/// KV quantisation with `wl_kv.cuh`.
pub fn kv_quantize(kt: KvType, x: &[f32], out: &mut [u8]) -> Result<()> {
    let g = x.len() / 32;
    if !x.len().is_multiple_of(32) || out.len() != kt.bytes_for(x.len()) {
        return Err(KernelError::LengthMismatch {
            what: "host kv bytes",
            expected: kt.bytes_for(x.len()),
            got: out.len(),
        });
    }
    // SAFETY: x has g groups of 32 floats and out g groups of group_bytes.
    unsafe { wl_host_kv_quantize(x.as_ptr(), out.as_mut_ptr(), g, kt.qmax()) };
    Ok(())
}

/// KV dequantisation with `wl_kv.cuh`.
pub fn kv_dequantize(kt: KvType, src: &[u8], out: &mut [f32]) -> Result<()> {
    let g = out.len() / 32;
    if !out.len().is_multiple_of(32) || src.len() != kt.bytes_for(out.len()) {
        return Err(KernelError::LengthMismatch {
            what: "host kv bytes",
            expected: kt.bytes_for(out.len()),
            got: src.len(),
        });
    }
    // SAFETY: src has g groups of group_bytes and out g groups of 32 floats.
    unsafe { wl_host_kv_dequantize(src.as_ptr(), out.as_mut_ptr(), g, kt.qmax()) };
    Ok(())
}

/// The shim's code for a cache format the kv kernels encode (e4m3 0, bf16 1; turned q8/q4
/// their qmax), and the units it counts (values or groups of 32) for `n` values.
fn kv_format_code(format: KvFormat, n: usize, bytes: usize) -> Result<(i32, usize)> {
    let code = match format {
        KvFormat::E4M3 => 0,
        KvFormat::BF16 => 1,
        KvFormat::Q8 | KvFormat::Q4 => format.quant().map_or(0, KvType::qmax),
        other => {
            return Err(KernelError::Unsupported {
                op: "host kv codec",
                ty: other.name().into(),
                supported: "e4m3, bf16, q8, q4",
            });
        }
    };
    format.check_values("host kv codec", 0, n)?;
    if bytes != format.byte_at(n) {
        return Err(KernelError::LengthMismatch {
            what: "host kv bytes",
            expected: format.byte_at(n),
            got: bytes,
        });
    }
    Ok((code, n / format.granule()))
}

/// Encodes cache rows with `wl_kv.cuh` (the `kv_store_{format}` kernels' maths).
pub fn kv_store(format: KvFormat, x: &[f32], out: &mut [u8]) -> Result<()> {
    let (code, units) = kv_format_code(format, x.len(), out.len())?;
    // SAFETY: x holds `units` groups (or values) and out their bytes (checked above).
    unsafe { wl_host_kv_store(x.as_ptr(), out.as_mut_ptr(), units, code) };
    Ok(())
}

/// Decodes cache rows with `wl_kv.cuh` (the `kv_load_{format}` kernels' maths).
pub fn kv_load(format: KvFormat, src: &[u8], out: &mut [f32]) -> Result<()> {
    let (code, units) = kv_format_code(format, out.len(), src.len())?;
    // SAFETY: src holds `units` groups (or values) of bytes and out their values (checked).
    unsafe { wl_host_kv_load(src.as_ptr(), out.as_mut_ptr(), units, code) };
    Ok(())
}

impl Act<'_> {
    /// (values, 1 for f16, the bytes).
    fn raw(&self) -> (usize, i32, *const u8) {
        match self {
            Act::F32(v) => (v.len(), 0, v.as_ptr().cast::<u8>()),
            Act::F16(v) => (v.len(), 1, v.as_ptr().cast::<u8>()),
        }
    }
}

/// What the `quantize_{type}_{src}` kernels compute (`kernels/wl_quantize.cuh`'s
/// `wl_quantize_block` over every block): `src` (little-endian `src_ty` values, whole blocks of
/// `ty`) into `dst` (as many blocks of `ty`). Returns the merged non-finite report the kernels
/// leave in their `found` word (0 when every value is finite; see
/// [`crate::cpu::quantize::non_finite_report`]), indices counted from `first`.
pub fn quantize(
    ty: QuantType,
    src_ty: FloatType,
    src: &[u8],
    dst: &mut [u8],
    first: usize,
) -> Result<u64> {
    let unit = src_ty.size() * ty.block_size();
    let n_blocks = src.len() / unit;
    if !src.len().is_multiple_of(unit) || dst.len() != n_blocks * ty.block_bytes() {
        return Err(KernelError::LengthMismatch {
            what: "host quantize destination bytes",
            expected: n_blocks * ty.block_bytes(),
            got: dst.len(),
        });
    }
    let src_code = match src_ty {
        FloatType::F32 => 0,
        FloatType::F16 => 1,
        FloatType::BF16 => 30,
    };
    // SAFETY: src holds n_blocks whole blocks of source values and dst n_blocks blocks of ty,
    // which is all the shim touches.
    let word = unsafe {
        wl_host_quantize(
            ty.ggml_id() as i32,
            src_code,
            src.as_ptr(),
            dst.as_mut_ptr(),
            n_blocks,
            first as u64,
        )
    };
    if word == u64::MAX {
        return Err(KernelError::Unsupported {
            op: "host quantize",
            ty: ty.to_string(),
            supported: crate::cpu::quantize::QUANTIZE_NAMES,
        });
    }
    Ok(word)
}

/// What the `q8_quantize_{act}` kernels compute: whole blocks of 32 activations into
/// [`crate::sources::Q8_BLOCK_BYTES`]-byte blocks (the CPU's `Q8Block` layout).
pub fn q8_quantize(x: Act<'_>, out: &mut [u8]) -> Result<()> {
    let (n, act_f16, ptr) = x.raw();
    let want = n / 32 * crate::sources::Q8_BLOCK_BYTES;
    if !n.is_multiple_of(32) || out.len() != want {
        return Err(KernelError::LengthMismatch {
            what: "host q8 activation block bytes",
            expected: want,
            got: out.len(),
        });
    }
    // SAFETY: x holds n / 32 whole blocks of its declared width, out as many 40-byte blocks.
    unsafe { wl_host_q8_quantize(act_f16, ptr, out.as_mut_ptr(), n / 32) };
    Ok(())
}

/// What the `q8_matmul_{type}` kernels compute, their 8 lanes per row and shuffle tree
/// replayed: `y[t * rows + r]` for `xq` holding `n_tok × cols / 32` blocks from
/// [`q8_quantize`].
pub fn q8_matmul(
    ty: QuantType,
    w: &[u8],
    xq: &[u8],
    y: &mut [f32],
    rows: usize,
    cols: usize,
) -> Result<()> {
    let bs = ty.block_size();
    let row_bytes = cols / bs * ty.block_bytes();
    let per_tok = cols / 32 * crate::sources::Q8_BLOCK_BYTES;
    let n_tok = xq.len().checked_div(per_tok).unwrap_or(0);
    let shape_ok = cols.is_multiple_of(bs)
        && cols.is_multiple_of(32)
        && n_tok * per_tok == xq.len()
        && rows.checked_mul(row_bytes) == Some(w.len())
        && y.len() == rows * n_tok;
    if !shape_ok {
        return Err(KernelError::Shape {
            op: "host q8 matmul",
            reason: format!(
                "{rows} x {cols} {ty} weights in {} bytes, {} activation block bytes, {} outputs",
                w.len(),
                xq.len(),
                y.len()
            ),
        });
    }
    // SAFETY: w holds rows whole rows, xq n_tok * cols / 32 blocks and y rows * n_tok floats
    // (checked above): all the shim touches.
    let ok = unsafe {
        wl_host_q8_matmul(
            ty.ggml_id() as i32,
            w.as_ptr(),
            xq.as_ptr(),
            y.as_mut_ptr(),
            rows,
            cols,
            n_tok,
        )
    };
    if ok == 0 {
        return Err(KernelError::Unsupported {
            op: "host q8 matmul",
            ty: ty.to_string(),
            supported: crate::CUDA_Q8_WEIGHT_TYPES,
        });
    }
    Ok(())
}

/// What the decode kernel `q8_matvec_{type}` computes for one token's `cols / 32` activation
/// blocks `xq` with `wpr` warps a row (1, 2, 4 or 8): 32 · wpr lane chains a row in its own
/// order, each warp's butterfly and the warps' sums. `word_loads` picks the kernel's aligned
/// word loads or its byte-by-byte path (the same words either way).
pub fn q8_matvec(
    ty: QuantType,
    word_loads: bool,
    wpr: usize,
    w: &[u8],
    xq: &[u8],
    y: &mut [f32],
    cols: usize,
) -> Result<()> {
    let kernel = (
        "host q8 matvec",
        crate::CUDA_Q8_WEIGHT_TYPES,
        wl_host_q8_matvec as Q8MatvecShim,
    );
    decode_matvec(kernel, ty, (word_loads, wpr), (w, xq, y), cols)
}

/// What decode's wide-lane kernel `q8_wide_matvec_{type}` (Q4_K and Q6_K) computes for one
/// token's `cols / 32` activation blocks `xq` with `wpr` warps a row (1, 2, 4 or 8): each lane's
/// chains over its 64-value units in `kernels/wl_q8w.cuh`'s order, each warp's butterfly and the
/// warps' sums. `word_loads` picks the kernel's 128-bit loads or its byte-by-byte path (the
/// same words either way).
pub fn q8_wide_matvec(
    ty: QuantType,
    word_loads: bool,
    wpr: usize,
    w: &[u8],
    xq: &[u8],
    y: &mut [f32],
    cols: usize,
) -> Result<()> {
    let kernel = (
        "host q8 wide matvec",
        "q4_k, q6_k",
        wl_host_q8_wide_matvec as Q8MatvecShim,
    );
    if !crate::sources::Q8_WIDE_WEIGHT_TYPES.contains(&ty) {
        return Err(KernelError::Unsupported {
            op: kernel.0,
            ty: ty.to_string(),
            supported: kernel.1,
        });
    }
    decode_matvec(kernel, ty, (word_loads, wpr), (w, xq, y), cols)
}

/// The shim's entry points of the decode kernels' two orders (the same arguments).
type Q8MatvecShim =
    unsafe extern "C" fn(i32, i32, i32, *const u8, *const u8, *mut f32, usize, usize) -> i32;

/// A decode kernel's shim, `(op name, types it takes, entry point)`, on checked shapes.
fn decode_matvec(
    (op, supported, shim): (&'static str, &'static str, Q8MatvecShim),
    ty: QuantType,
    (word_loads, wpr): (bool, usize),
    (w, xq, y): (&[u8], &[u8], &mut [f32]),
    cols: usize,
) -> Result<()> {
    let bs = ty.block_size();
    let row_bytes = cols / bs * ty.block_bytes();
    let rows = y.len();
    let shape_ok = cols.is_multiple_of(bs)
        && cols.is_multiple_of(32)
        && xq.len() == cols / 32 * crate::sources::Q8_BLOCK_BYTES
        && rows.checked_mul(row_bytes) == Some(w.len())
        && [1, 2, 4, 8].contains(&wpr);
    if !shape_ok {
        return Err(KernelError::Shape {
            op,
            reason: format!(
                "{rows} x {cols} {ty} weights in {} bytes, {} activation block bytes, {wpr} \
                 warps a row",
                w.len(),
                xq.len(),
            ),
        });
    }
    // SAFETY: w holds rows whole rows, xq cols / 32 blocks and y rows floats (checked above):
    // all the shim touches.
    let ok = unsafe {
        shim(
            ty.ggml_id() as i32,
            i32::from(word_loads),
            wpr as i32,
            w.as_ptr(),
            xq.as_ptr(),
            y.as_mut_ptr(),
            rows,
            cols,
        )
    };
    if ok == 0 {
        return Err(KernelError::Unsupported {
            op,
            ty: ty.to_string(),
            supported,
        });
    }
    Ok(())
}

/// What the `gemm_{act}` kernel computes, block by block and phase by phase with the kernel's
/// own header functions: `wd` holds `wd.len() / cols` dequantised weight rows (rows `row0..` of
/// a `rows`-row layer), `x` the tokens; writes `y[t * rows + row0 + r]`. `grid_y` is the
/// launch's grid.y (token blocks that stride when there are more).
pub fn gemm(
    wd: &[f32],
    x: Act<'_>,
    y: &mut [f32],
    cols: usize,
    row0: usize,
    rows: usize,
    grid_y: usize,
) -> Result<()> {
    let (n, act_f16, ptr) = x.raw();
    let n_rows = wd.len().checked_div(cols).unwrap_or(0);
    let n_tok = n.checked_div(cols).unwrap_or(0);
    let shape_ok = cols > 0
        && grid_y > 0
        && n_rows * cols == wd.len()
        && n_tok * cols == n
        && row0.checked_add(n_rows).is_some_and(|e| e <= rows)
        && y.len() == rows * n_tok;
    if !shape_ok {
        return Err(KernelError::Shape {
            op: "host gemm",
            reason: format!(
                "{} weight values, {n} activations, {} outputs for cols {cols}, rows {row0}.. of {rows}, grid.y {grid_y}",
                wd.len(),
                y.len()
            ),
        });
    }
    // SAFETY: wd holds n_rows rows of cols, x n_tok rows of cols of its declared width, and y
    // n_tok rows of `rows` with row0 + n_rows <= rows (checked above).
    unsafe {
        wl_host_gemm(
            act_f16,
            wd.as_ptr(),
            ptr,
            y.as_mut_ptr(),
            n_rows,
            cols,
            n_tok,
            row0,
            rows,
            grid_y,
        )
    };
    Ok(())
}

/// The header's `wl_att_block_heads`: query heads one attention block takes for heads of
/// `head_dim` values.
pub fn attention_block_heads(head_dim: usize) -> usize {
    let hd = i32::try_from(head_dim).unwrap_or(i32::MAX);
    // SAFETY: a pure function of an integer.
    let h = unsafe { wl_host_att_block_heads(hd) };
    usize::try_from(h).unwrap_or(0)
}

/// The shim's code for a cache format the attention kernels read (`wl_att_row`).
fn attention_format_code(format: KvFormat) -> Result<i32> {
    match format {
        KvFormat::F32 => Ok(0),
        KvFormat::F16 => Ok(1),
        KvFormat::E4M3 => Ok(2),
        KvFormat::Q8 => Ok(3),
        KvFormat::Q4 => Ok(4),
        KvFormat::BF16 => Ok(5),
        #[allow(unreachable_patterns)]
        other => Err(KernelError::Unsupported {
            op: "host attention",
            ty: other.name().into(),
            supported: "f32, f16, e4m3, q8, q4, bf16",
        }),
    }
}

/// The checks both attention replays make before calling the shim: heads of at most `max_hd`
/// values (a multiple of 32 for a quantised cache), formats the header knows, at least one
/// cache row, and buffers holding what the shape reads and writes (`names`: the query, key,
/// value and output buffers as the errors call them; the cache's `rows`, or its first
/// `start + n_q` when it has more). The header's codes of the two formats.
fn check_attention(
    op: &'static str,
    names: [&'static str; 4],
    (k_format, v_format): (KvFormat, KvFormat),
    (shape, rows): (&AttnShape, usize),
    max_hd: usize,
    (q, k, v, out): (&[f32], &[u8], &[u8], &[f32]),
) -> Result<(i32, i32)> {
    let (n_q, n_heads, head_dim) = (shape.n_q, shape.n_heads, shape.head_dim);
    if rows == 0 {
        return Err(KernelError::Shape {
            op,
            reason: "a cache of no rows".into(),
        });
    }
    let turned = k_format.quant().is_some() || v_format.quant().is_some();
    if head_dim > max_hd || (turned && head_dim % 32 != 0) {
        return Err(KernelError::Shape {
            op,
            reason: format!(
                "head_dim {head_dim}: the kernel takes at most {max_hd}, a multiple of 32 for a \
                 quantised cache"
            ),
        });
    }
    let codes = (
        attention_format_code(k_format)?,
        attention_format_code(v_format)?,
    );
    let qn = n_q * n_heads * head_dim;
    let kvn = (shape.start + n_q).min(rows) * shape.kv_heads * head_dim;
    let lens = [
        (qn, q.len()),
        (k_format.byte_at(kvn), k.len()),
        (v_format.byte_at(kvn), v.len()),
        (qn, out.len()),
    ];
    for (what, (expected, got)) in names.into_iter().zip(lens) {
        if got < expected {
            return Err(KernelError::LengthMismatch {
                what,
                expected,
                got,
            });
        }
    }
    Ok(codes)
}

/// What `attention_{format}` computes with its keys split `splits` ways, then
/// `attention_reduce_f32` (when `splits > 1`), replayed block by block, warp by warp and lane by
/// lane with the kernels' own header functions: `out` (`n_q × n_heads × head_dim`) for queries
/// `q` over the cache rows `k` and `v` (stored as `k_format` and `v_format`, at least
/// `start + n_q` rows each, or `rows` rows holding the key at position `j` in row `j % rows`).
/// `span` 0: the keys the queries see are split, as for a call given its position; else the
/// kernel reads `start` from device memory and splits `span` keys. Either way the splits start
/// at the first query's window start (`AttnShape::first_key`), and the queries see at most
/// `span` keys from there. The shape's window and soft-cap apply as the kernel applies them.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    k_format: KvFormat,
    v_format: KvFormat,
    shape: AttnShape,
    (splits, span, rows): (usize, usize, usize),
    q: &[f32],
    k: &[u8],
    v: &[u8],
    out: &mut [f32],
) -> Result<()> {
    let bad = |reason: String| KernelError::Shape {
        op: "host attention",
        reason,
    };
    let AttnShape {
        n_heads,
        kv_heads,
        head_dim,
        n_q,
        start,
        scale,
        f16_operands,
        window,
        softcap,
    } = shape;
    if splits == 0 || splits > crate::sources::ATTENTION_MAX_SPLITS {
        return Err(bad(format!(
            "{splits} splits: the kernel takes 1 to {}",
            crate::sources::ATTENTION_MAX_SPLITS
        )));
    }
    let (kc, vc) = check_attention(
        "host attention",
        [
            "host attention query values",
            "host attention key bytes",
            "host attention value bytes",
            "host attention output values",
        ],
        (k_format, v_format),
        (&shape, rows),
        crate::sources::ATTENTION_MAX_HEAD_DIM,
        (q, k, v, out),
    )?;
    let part_len = crate::sources::attention_scratch_values(n_q, n_heads, head_dim, splits)
        .ok_or_else(|| bad("the partial results overflow".into()))?;
    let mut part = vec![0f32; if splits > 1 { part_len } else { 0 }];
    let pos = [i32::try_from(start).map_err(|_| bad(format!("position {start} past i32")))?];
    // the keys split start at the first query's window start
    let first = shape.first_key();
    if span > 0 && start + n_q - first > span {
        return Err(bad(format!(
            "{n_q} queries from {start} past a span of {span} keys from key {first}"
        )));
    }
    // SAFETY: q, k, v and out hold what the shape reads and writes (checked above), part the
    // split's partial results (wl_att_part_*), and the shim refuses splits and heads outside
    // its arrays.
    let ok = unsafe {
        wl_host_attention(
            kc,
            vc,
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            out.as_mut_ptr(),
            part.as_mut_ptr(),
            n_q,
            start,
            n_heads,
            kv_heads,
            head_dim as i32,
            scale,
            i32::from(f16_operands),
            splits,
            if span > 0 {
                pos.as_ptr()
            } else {
                std::ptr::null()
            },
            span,
            window,
            softcap,
            rows,
        )
    };
    if ok == 0 {
        return Err(bad(format!(
            "{n_heads} heads over {kv_heads} kv heads of {head_dim} in {splits} splits"
        )));
    }
    Ok(())
}

/// The keys each block of `attention_{format}` split `splits` ways folds for query `i` of a call
/// of `n_q` queries from position `start` with a sliding window of `window` keys (0: none):
/// `[lo, hi)` for each split holding keys of the query, in split order, as the kernel's own
/// header finds them. `span` 0: the position given at launch; else read from device memory,
/// with `span` keys split. `None` where the kernel computes nothing: a position whose queries
/// see more than `span` keys from the first query's window start, or a call outside its shapes.
pub fn attention_splits(
    (start, n_q, window): (usize, usize, usize),
    (splits, span): (usize, usize),
    i: usize,
) -> Option<Vec<std::ops::Range<usize>>> {
    if splits == 0 || splits > crate::sources::ATTENTION_MAX_SPLITS {
        return None;
    }
    let pos = [i32::try_from(start).ok()?];
    let mut ranges = vec![0usize; 2 * splits];
    // SAFETY: `ranges` holds two values for each of the `splits` splits (at most the header's
    // WL_ATT_MAX_SPLITS, checked), all the shim writes; `pos` one position.
    let live = unsafe {
        wl_host_att_splits(
            if span > 0 {
                pos.as_ptr()
            } else {
                std::ptr::null()
            },
            start,
            n_q,
            window,
            span,
            splits,
            i,
            ranges.as_mut_ptr(),
        )
    };
    let live = usize::try_from(live).ok()?;
    Some(
        ranges[..2 * live]
            .chunks_exact(2)
            .map(|r| r[0]..r[1])
            .collect(),
    )
}

/// The header's `wl_fa_rows`: the (query, head) rows one `attention_prefill_{format}` block
/// takes for heads of `head_dim` values.
pub fn attention_prefill_rows(head_dim: usize) -> usize {
    let hd = i32::try_from(head_dim).unwrap_or(i32::MAX);
    // SAFETY: a pure function of an integer.
    let r = unsafe { wl_host_fa_rows(hd) };
    usize::try_from(r).unwrap_or(0)
}

/// What `attention_prefill_{format}` computes, replayed block by block, key tile by key tile
/// and lane by lane with the kernel's own header functions: `out` (`n_q × n_heads × head_dim`)
/// for queries `q` over the cache rows `k` and `v` (stored as `k_format` and `v_format`, at
/// least `start + n_q` rows each, or `rows` rows as [`attention`] reads them), with a sliding
/// `window` (0: none) and `softcap` (0: none).
#[allow(clippy::too_many_arguments)]
pub fn attention_prefill(
    k_format: KvFormat,
    v_format: KvFormat,
    shape: AttnShape,
    (window, softcap, rows): (usize, f32, usize),
    q: &[f32],
    k: &[u8],
    v: &[u8],
    out: &mut [f32],
) -> Result<()> {
    let bad = |reason: String| KernelError::Shape {
        op: "host prompt attention",
        reason,
    };
    let AttnShape {
        n_heads,
        kv_heads,
        head_dim,
        n_q,
        start,
        scale,
        f16_operands,
        ..
    } = shape;
    let (kc, vc) = check_attention(
        "host prompt attention",
        [
            "host prompt attention query values",
            "host prompt attention key bytes",
            "host prompt attention value bytes",
            "host prompt attention output values",
        ],
        (k_format, v_format),
        (&shape, rows),
        crate::sources::ATTENTION_PREFILL_MAX_HEAD_DIM,
        (q, k, v, out),
    )?;
    // SAFETY: q, k, v and out hold what the shape reads and writes (checked above), and the
    // shim refuses heads outside its arrays.
    let ok = unsafe {
        wl_host_attention_prefill(
            kc,
            vc,
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            out.as_mut_ptr(),
            n_q,
            start,
            n_heads,
            kv_heads,
            head_dim as i32,
            scale,
            i32::from(f16_operands),
            window,
            softcap,
            rows,
        )
    };
    if ok == 0 {
        return Err(bad(format!(
            "{n_heads} heads over {kv_heads} kv heads of {head_dim}"
        )));
    }
    Ok(())
}

/// The error of a lane wrapper of `op` (the `fa_mma` and `mmq` replays).
fn lane_error(op: &'static str, reason: String) -> crate::error::KernelError {
    crate::error::KernelError::Shape { op, reason }
}

/// Fails unless `x < n`: an index the header trusts, checked by a wrapper of `op`.
fn below(op: &'static str, what: &str, x: usize, n: usize) -> crate::error::Result<i32> {
    if x < n {
        Ok(x as i32)
    } else {
        Err(lane_error(
            op,
            format!("{what} {x}: the kernel's are below {n}"),
        ))
    }
}

/// The lane arithmetic of `attention_prefill_mma_{format}` (`kernels/wl_fa_mma.cuh`), one
/// function of the header each, for a test that replays the kernel's warps on the host: the
/// m16n8k16 fragment maps (which matrix element each lane's register halves hold), where the
/// block's staged queries, keys and transposed values sit in shared memory, the fragment loads,
/// and a lane's share of a tile's softmax step. The wrappers check the indices the header
/// trusts.
pub mod fa_mma {
    use crate::error::{KernelError, Result};

    unsafe extern "C" {
        fn wl_host_mma_a(lane: i32, reg: i32, hf: i32, row: *mut i32, col: *mut i32);
        fn wl_host_mma_b(lane: i32, reg: i32, hf: i32, k: *mut i32, n: *mut i32);
        fn wl_host_mma_c(lane: i32, reg: i32, row: *mut i32, col: *mut i32);
        fn wl_host_fam_shape(q: *mut i32, k: *mut i32, v: *mut i32, rows: *mut i32);
        fn wl_host_fam_pack(lo: f32, hi: f32) -> u32;
        fn wl_host_fam_q_word(row: i32, d: i32, head_dim: i32) -> i32;
        fn wl_host_fam_k_word(key: i32, d: i32, head_dim: i32) -> i32;
        fn wl_host_fam_v_word(d: i32, key: i32) -> i32;
        fn wl_host_fam_q_frag(sq: *const u32, row0: i32, hd: i32, lane: i32, ks: i32, a: *mut u32);
        fn wl_host_fam_k_frag(sk: *const u32, hd: i32, lane: i32, nb: i32, ks: i32, b: *mut u32);
        fn wl_host_fam_v_frag(svt: *const u32, lane: i32, db: i32, kk: i32, b: *mut u32);
        fn wl_host_fam_p_frag(p: *const f32, kk: i32, a: *mut u32);
        #[allow(clippy::too_many_arguments)]
        fn wl_host_fam_weigh(
            s: *mut f32,
            lane: i32,
            t0: u64,
            qi: *const u64,
            start: u64,
            window: u64,
            key_end: u64,
            scale: f32,
            softcap: f32,
            mx: *mut f32,
        );
        fn wl_host_fam_probs(
            s: *mut f32,
            m: *const f32,
            mt: *const f32,
            m_new: *mut f32,
            keep: *mut f32,
            ps: *mut f32,
        );
        fn wl_host_fam_fold(
            m: *mut f32,
            l: *mut f32,
            m_new: *const f32,
            keep: *const f32,
            psum: *const f32,
        );
        fn wl_host_fam_rescale(o: *mut f32, keep: *const f32);
    }

    /// The kernel's shared arrays and rows a block: words of staged queries, keys and
    /// transposed values, and the (query, head) rows one block takes.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Shape {
        pub q_words: usize,
        pub k_words: usize,
        pub v_words: usize,
        pub rows: usize,
    }

    /// The header's sizes (`WL_FAM_*`).
    pub fn shape() -> Shape {
        let (mut q, mut k, mut v, mut rows) = (0, 0, 0, 0);
        // SAFETY: writes four integers through valid pointers.
        unsafe { wl_host_fam_shape(&mut q, &mut k, &mut v, &mut rows) };
        let u = |x: i32| usize::try_from(x).unwrap_or(0);
        Shape {
            q_words: u(q),
            k_words: u(k),
            v_words: u(v),
            rows: u(rows),
        }
    }

    fn bad(reason: String) -> KernelError {
        super::lane_error(OP, reason)
    }

    const OP: &str = "host mma attention lane";

    fn below(what: &str, x: usize, n: usize) -> Result<i32> {
        super::below(OP, what, x, n)
    }

    /// Fails unless the head is one the kernel takes (64 or 128 values).
    fn head(head_dim: usize) -> Result<i32> {
        match head_dim {
            64 | 128 => Ok(head_dim as i32),
            _ => Err(bad(format!(
                "head_dim {head_dim}: the kernel takes 64 or 128"
            ))),
        }
    }

    /// Fails unless `words` holds `want` words.
    fn room(what: &str, words: usize, want: usize) -> Result<()> {
        if words >= want {
            Ok(())
        } else {
            Err(bad(format!(
                "{what}: {words} words, the kernel stages {want}"
            )))
        }
    }

    /// A: (row, column) of half `hf` of register `reg` of `lane`.
    pub fn a_elem(lane: usize, reg: usize, hf: usize) -> Result<(usize, usize)> {
        let (l, r, h) = (
            below("lane", lane, 32)?,
            below("register", reg, 4)?,
            below("half", hf, 2)?,
        );
        let (mut row, mut col) = (0, 0);
        // SAFETY: writes two integers through valid pointers.
        unsafe { wl_host_mma_a(l, r, h, &mut row, &mut col) };
        Ok((row as usize, col as usize))
    }

    /// B: (k, n) of half `hf` of register `reg` of `lane`.
    pub fn b_elem(lane: usize, reg: usize, hf: usize) -> Result<(usize, usize)> {
        let (l, r, h) = (
            below("lane", lane, 32)?,
            below("register", reg, 2)?,
            below("half", hf, 2)?,
        );
        let (mut k, mut n) = (0, 0);
        // SAFETY: writes two integers through valid pointers.
        unsafe { wl_host_mma_b(l, r, h, &mut k, &mut n) };
        Ok((k as usize, n as usize))
    }

    /// C and D: (row, column) of register `reg` of `lane`.
    pub fn c_elem(lane: usize, reg: usize) -> Result<(usize, usize)> {
        let (l, r) = (below("lane", lane, 32)?, below("register", reg, 4)?);
        let (mut row, mut col) = (0, 0);
        // SAFETY: writes two integers through valid pointers.
        unsafe { wl_host_mma_c(l, r, &mut row, &mut col) };
        Ok((row as usize, col as usize))
    }

    /// Two values as one f16-pair register (round to nearest even), `lo` the lower element.
    pub fn pack(lo: f32, hi: f32) -> u32 {
        // SAFETY: a pure function of two floats.
        unsafe { wl_host_fam_pack(lo, hi) }
    }

    /// The word of staged query row `row` holding dims `d` and `d + 1` (`d` even).
    pub fn q_word(row: usize, d: usize, head_dim: usize) -> Result<usize> {
        let hd = head(head_dim)?;
        let (r, d) = (below("row", row, shape().rows)?, below("dim", d, head_dim)?);
        // SAFETY: a pure function of integers.
        Ok(unsafe { wl_host_fam_q_word(r, d, hd) } as usize)
    }

    /// The word of key `key` of the tile holding dims `d` and `d + 1` (`d` even).
    pub fn k_word(key: usize, d: usize, head_dim: usize) -> Result<usize> {
        let hd = head(head_dim)?;
        let (k, d) = (below("key", key, 32)?, below("dim", d, head_dim)?);
        // SAFETY: a pure function of integers.
        Ok(unsafe { wl_host_fam_k_word(k, d, hd) } as usize)
    }

    /// The word of dim `d` holding keys `key` and `key + 1` (`key` even) of the tile's values.
    pub fn v_word(d: usize, key: usize) -> Result<usize> {
        let (d, k) = (below("dim", d, 128)?, below("key", key, 32)?);
        // SAFETY: a pure function of integers.
        Ok(unsafe { wl_host_fam_v_word(d, k) } as usize)
    }

    /// `lane`'s A fragment of k-step `ks` of the 16 query rows from staged row `row0`.
    pub fn q_frag(
        sq: &[u32],
        row0: usize,
        head_dim: usize,
        lane: usize,
        ks: usize,
    ) -> Result<[u32; 4]> {
        let hd = head(head_dim)?;
        room("staged queries", sq.len(), shape().q_words)?;
        let r0 = below("first row", row0, shape().rows - 15)?;
        let (l, k) = (
            below("lane", lane, 32)?,
            below("k-step", ks, head_dim / 16)?,
        );
        let mut a = [0u32; 4];
        // SAFETY: sq holds every word the kernel stages and the indices are in its ranges.
        unsafe { wl_host_fam_q_frag(sq.as_ptr(), r0, hd, l, k, a.as_mut_ptr()) };
        Ok(a)
    }

    /// `lane`'s B fragment of S's n-block `nb` and k-step `ks`.
    pub fn k_frag(
        sk: &[u32],
        head_dim: usize,
        lane: usize,
        nb: usize,
        ks: usize,
    ) -> Result<[u32; 2]> {
        let hd = head(head_dim)?;
        room("staged keys", sk.len(), shape().k_words)?;
        let (l, n, k) = (
            below("lane", lane, 32)?,
            below("n-block", nb, 4)?,
            below("k-step", ks, head_dim / 16)?,
        );
        let mut b = [0u32; 2];
        // SAFETY: sk holds every word the kernel stages and the indices are in its ranges.
        unsafe { wl_host_fam_k_frag(sk.as_ptr(), hd, l, n, k, b.as_mut_ptr()) };
        Ok(b)
    }

    /// `lane`'s B fragment of O's n-block `db` and k-step `kk` (`head_dim` bounds `db`).
    pub fn v_frag(
        svt: &[u32],
        head_dim: usize,
        lane: usize,
        db: usize,
        kk: usize,
    ) -> Result<[u32; 2]> {
        head(head_dim)?;
        room("staged values", svt.len(), shape().v_words)?;
        let (l, d, k) = (
            below("lane", lane, 32)?,
            below("n-block", db, head_dim / 8)?,
            below("k-step", kk, 2)?,
        );
        let mut b = [0u32; 2];
        // SAFETY: svt holds every word the kernel stages and the indices are in its ranges.
        unsafe { wl_host_fam_v_frag(svt.as_ptr(), l, d, k, b.as_mut_ptr()) };
        Ok(b)
    }

    /// P's A fragment of k-step `kk` from the probabilities in S's accumulator layout.
    pub fn p_frag(p: &[f32; 16], kk: usize) -> Result<[u32; 4]> {
        let k = below("k-step", kk, 2)?;
        let mut a = [0u32; 4];
        // SAFETY: p has the 16 values the header reads, a the 4 it writes.
        unsafe { wl_host_fam_p_frag(p.as_ptr(), k, a.as_mut_ptr()) };
        Ok(a)
    }

    /// The scores of `lane` (keys from `t0`) weighed and masked in place; returns each half's
    /// largest weight among the lane's 8. `qi`: the query of each half's row; `masks`:
    /// (start, window, key_end, scale, softcap).
    pub fn weigh(
        s: &mut [f32; 16],
        lane: usize,
        t0: u64,
        qi: [u64; 2],
        (start, window, key_end, scale, softcap): (u64, u64, u64, f32, f32),
    ) -> Result<[f32; 2]> {
        let l = below("lane", lane, 32)?;
        let mut mx = [0f32; 2];
        // SAFETY: s has 16 values, qi 2, mx room for 2.
        unsafe {
            wl_host_fam_weigh(
                s.as_mut_ptr(),
                l,
                t0,
                qi.as_ptr(),
                start,
                window,
                key_end,
                scale,
                softcap,
                mx.as_mut_ptr(),
            )
        };
        Ok(mx)
    }

    /// The weights turned into probabilities in place against the rows' maxima `m` and the
    /// tile's `mt`; returns (m_new, keep, the lane's probability sums).
    pub fn probs(s: &mut [f32; 16], m: [f32; 2], mt: [f32; 2]) -> ([f32; 2], [f32; 2], [f32; 2]) {
        let (mut m_new, mut keep, mut ps) = ([0f32; 2], [0f32; 2], [0f32; 2]);
        // SAFETY: s has 16 values, the others 2 each.
        unsafe {
            wl_host_fam_probs(
                s.as_mut_ptr(),
                m.as_ptr(),
                mt.as_ptr(),
                m_new.as_mut_ptr(),
                keep.as_mut_ptr(),
                ps.as_mut_ptr(),
            )
        };
        (m_new, keep, ps)
    }

    /// The rows' maximum `m` and sum `l` after the tile.
    pub fn fold(
        m: &mut [f32; 2],
        l: &mut [f32; 2],
        m_new: [f32; 2],
        keep: [f32; 2],
        psum: [f32; 2],
    ) {
        // SAFETY: every array has the 2 values the header reads or writes.
        unsafe {
            wl_host_fam_fold(
                m.as_mut_ptr(),
                l.as_mut_ptr(),
                m_new.as_ptr(),
                keep.as_ptr(),
                psum.as_ptr(),
            )
        };
    }

    /// One 8-dim block of O's accumulators scaled by their rows' `keep`.
    pub fn rescale(o: &mut [f32; 4], keep: [f32; 2]) {
        // SAFETY: o has 4 values, keep 2.
        unsafe { wl_host_fam_rescale(o.as_mut_ptr(), keep.as_ptr()) };
    }
}

/// The lane arithmetic of `q8_mma_{type}` (`kernels/wl_mmq.cuh`), one function of the header
/// each, for a test that replays the kernel's warps on the host: the m16n8k32 s8 fragment maps
/// (which matrix element each byte of a lane's registers holds), the staging of a pass of
/// weight and activation groups, the fragment loads from there, and a lane's epilogue of one
/// product. The wrappers check the indices and sizes the header trusts.
pub mod mmq {
    use crate::error::{KernelError, Result};
    use crate::sources::Q8_BLOCK_BYTES;
    use crate::types::QuantType;

    unsafe extern "C" {
        fn wl_host_mmq_a(lane: i32, reg: i32, byte: i32, row: *mut i32, col: *mut i32);
        fn wl_host_mmq_b(lane: i32, reg: i32, byte: i32, k: *mut i32, n: *mut i32);
        fn wl_host_mmq_c(lane: i32, reg: i32, row: *mut i32, col: *mut i32);
        fn wl_host_mmq_shape(v: *mut i32);
        fn wl_host_mmq_kind(ty: i32, kind: *mut i32, halves: *mut i32) -> i32;
        #[allow(clippy::too_many_arguments)]
        fn wl_host_mmq_stage_w(
            ty: i32,
            w: *const u8,
            rows: u64,
            cols: u64,
            r0: u64,
            g0: u64,
            e: i32,
            sw: *mut u32,
            sdw: *mut f32,
            smw: *mut f32,
        ) -> i32;
        #[allow(clippy::too_many_arguments)]
        fn wl_host_mmq_stage_x(
            xq: *const u8,
            n_tok: u64,
            n_groups: u64,
            t0: u64,
            g0: u64,
            e: i32,
            sx: *mut u32,
            sxd: *mut f32,
            sxs: *mut i32,
        );
        fn wl_host_mmq_a_frag(
            sw: *const u32,
            row0: i32,
            kk: i32,
            lane: i32,
            halves: i32,
            h: i32,
            a: *mut u32,
        );
        fn wl_host_mmq_b_frag(sx: *const u32, tok0: i32, kk: i32, lane: i32, b: *mut u32);
        #[allow(clippy::too_many_arguments)]
        fn wl_host_mmq_epilogue(
            c: *const i32,
            lane: i32,
            row0: i32,
            tok0: i32,
            kk: i32,
            h: i32,
            kind: i32,
            sdw: *const f32,
            smw: *const f32,
            sxd: *const f32,
            sxs: *const i32,
            acc: *mut f32,
            ext: *mut f32,
        );
    }

    /// The kernel's block: weight rows, rows a warp, tokens and 32-value groups a pass, threads;
    /// and its shared arrays' sizes (words of staged weights and activations, entries of the
    /// per-group arrays of rows and of tokens).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Shape {
        pub rows: usize,
        pub warp_rows: usize,
        pub tokens: usize,
        pub groups: usize,
        pub threads: usize,
        pub w_words: usize,
        pub x_words: usize,
        pub w_groups: usize,
        pub x_groups: usize,
    }

    /// The header's sizes (`WL_MMQ_*`).
    pub fn shape() -> Shape {
        let mut v = [0i32; 9];
        // SAFETY: writes nine integers into `v`.
        unsafe { wl_host_mmq_shape(v.as_mut_ptr()) };
        let u = |x: i32| usize::try_from(x).unwrap_or(0);
        Shape {
            rows: u(v[0]),
            warp_rows: u(v[1]),
            tokens: u(v[2]),
            groups: u(v[3]),
            threads: u(v[4]),
            w_words: u(v[5]),
            x_words: u(v[6]),
            w_groups: u(v[7]),
            x_groups: u(v[8]),
        }
    }

    /// A block's shared memory: staged weight words with each group's two half scales and
    /// min factor, staged activation words with each block's scale and sum.
    #[derive(Debug, Clone)]
    pub struct Staged {
        pub w: Vec<u32>,
        pub dw: Vec<f32>,
        pub mw: Vec<f32>,
        pub x: Vec<u32>,
        pub xd: Vec<f32>,
        pub xs: Vec<i32>,
    }

    impl Default for Staged {
        fn default() -> Self {
            let s = shape();
            Staged {
                w: vec![0; s.w_words],
                dw: vec![0.0; 2 * s.w_groups],
                mw: vec![0.0; s.w_groups],
                x: vec![0; s.x_words],
                xd: vec![0.0; s.x_groups],
                xs: vec![0; s.x_groups],
            }
        }
    }

    impl Staged {
        /// Fails unless every array has the header's size.
        fn check(&self) -> Result<()> {
            let s = shape();
            let ok = self.w.len() == s.w_words
                && self.dw.len() == 2 * s.w_groups
                && self.mw.len() == s.w_groups
                && self.x.len() == s.x_words
                && self.xd.len() == s.x_groups
                && self.xs.len() == s.x_groups;
            if ok {
                Ok(())
            } else {
                Err(bad("staged arrays of other sizes than the kernel's".into()))
            }
        }
    }

    fn bad(reason: String) -> KernelError {
        super::lane_error(OP, reason)
    }

    const OP: &str = "host q8 mma lane";

    fn below(what: &str, x: usize, n: usize) -> Result<i32> {
        super::below(OP, what, x, n)
    }

    /// A: (row, column) of byte `byte` of register `reg` of `lane`.
    pub fn a_elem(lane: usize, reg: usize, byte: usize) -> Result<(usize, usize)> {
        let (l, r, b) = (
            below("lane", lane, 32)?,
            below("register", reg, 4)?,
            below("byte", byte, 4)?,
        );
        let (mut row, mut col) = (0, 0);
        // SAFETY: writes two integers through valid pointers.
        unsafe { wl_host_mmq_a(l, r, b, &mut row, &mut col) };
        Ok((row as usize, col as usize))
    }

    /// B: (k, n) of byte `byte` of register `reg` of `lane`.
    pub fn b_elem(lane: usize, reg: usize, byte: usize) -> Result<(usize, usize)> {
        let (l, r, b) = (
            below("lane", lane, 32)?,
            below("register", reg, 2)?,
            below("byte", byte, 4)?,
        );
        let (mut k, mut n) = (0, 0);
        // SAFETY: writes two integers through valid pointers.
        unsafe { wl_host_mmq_b(l, r, b, &mut k, &mut n) };
        Ok((k as usize, n as usize))
    }

    /// C and D: (row, column) of register `reg` of `lane`.
    pub fn c_elem(lane: usize, reg: usize) -> Result<(usize, usize)> {
        let (l, r) = (below("lane", lane, 32)?, below("register", reg, 4)?);
        let (mut row, mut col) = (0, 0);
        // SAFETY: writes two integers through valid pointers.
        unsafe { wl_host_mmq_c(l, r, &mut row, &mut col) };
        Ok((row as usize, col as usize))
    }

    /// The min term's kind of `ty` (`WL_Q8_KIND_{type}`: 1 added, -1 subtracted, 0 none) and
    /// its products a group (2 for Q6_K's halves, else 1); fails for a type without kernels.
    pub fn kind(ty: QuantType) -> Result<(i32, usize)> {
        let (mut kind, mut halves) = (0, 0);
        // SAFETY: writes two integers through valid pointers.
        let ok = unsafe { wl_host_mmq_kind(ty.ggml_id() as i32, &mut kind, &mut halves) };
        if ok == 0 {
            return Err(KernelError::Unsupported {
                op: "host q8 mma",
                ty: ty.to_string(),
                supported: crate::CUDA_Q8_WEIGHT_TYPES,
            });
        }
        Ok((kind, halves as usize))
    }

    /// Element `e` of the weight pass of groups `g0..` for the block of rows `r0..` of the
    /// `rows × cols` weights `w` of `ty`, into `s`.
    #[allow(clippy::too_many_arguments)]
    pub fn stage_w(
        ty: QuantType,
        w: &[u8],
        (rows, cols): (usize, usize),
        r0: usize,
        g0: usize,
        e: usize,
        s: &mut Staged,
    ) -> Result<()> {
        s.check()?;
        kind(ty)?;
        let sh = shape();
        let e = below("element", e, sh.rows * sh.groups * 8)?;
        let bs = ty.block_size();
        let fits = cols.is_multiple_of(bs)
            && rows.checked_mul(cols / bs * ty.block_bytes()) == Some(w.len());
        if !fits {
            return Err(bad(format!(
                "{rows} x {cols} {ty} weights in {} bytes",
                w.len()
            )));
        }
        // SAFETY: w holds rows whole rows of cols values (checked), the shim reads inside them
        // (rows and groups past the end stage zeros); the staged arrays have the header's sizes
        // and `e` is one of the pass's elements.
        unsafe {
            wl_host_mmq_stage_w(
                ty.ggml_id() as i32,
                w.as_ptr(),
                rows as u64,
                cols as u64,
                r0 as u64,
                g0 as u64,
                e,
                s.w.as_mut_ptr(),
                s.dw.as_mut_ptr(),
                s.mw.as_mut_ptr(),
            )
        };
        Ok(())
    }

    /// Element `e` of the activation pass of groups `g0..` for the tokens `t0..` of `xq`
    /// (`n_tok × n_groups` blocks from [`super::q8_quantize`]), into `s`.
    pub fn stage_x(
        xq: &[u8],
        (n_tok, n_groups): (usize, usize),
        t0: usize,
        g0: usize,
        e: usize,
        s: &mut Staged,
    ) -> Result<()> {
        s.check()?;
        let sh = shape();
        let e = below("element", e, sh.tokens * sh.groups * 10)?;
        if n_tok
            .checked_mul(n_groups)
            .and_then(|n| n.checked_mul(Q8_BLOCK_BYTES))
            != Some(xq.len())
        {
            return Err(bad(format!(
                "{n_tok} tokens of {n_groups} blocks in {} bytes",
                xq.len()
            )));
        }
        // SAFETY: xq holds n_tok * n_groups blocks (checked); the staged arrays have the
        // header's sizes and `e` is one of the pass's elements.
        unsafe {
            wl_host_mmq_stage_x(
                xq.as_ptr(),
                n_tok as u64,
                n_groups as u64,
                t0 as u64,
                g0 as u64,
                e,
                s.x.as_mut_ptr(),
                s.xd.as_mut_ptr(),
                s.xs.as_mut_ptr(),
            )
        };
        Ok(())
    }

    /// Fails unless a warp's rows from `row0` or an n-block's tokens from `tok0` lie in the
    /// block, and `kk` is a group of the pass.
    fn tile(what: &str, first: usize, n: usize, of: usize, kk: usize) -> Result<(i32, i32)> {
        if !first.is_multiple_of(n) || first + n > of {
            return Err(bad(format!(
                "{what} {first}: not a tile of {n} of the block's {of}"
            )));
        }
        Ok((first as i32, below("group", kk, shape().groups)?))
    }

    /// `lane`'s A fragment of group `kk` for the warp's rows from `row0`: with `halves` 2,
    /// half `h`'s registers only.
    pub fn a_frag(
        s: &Staged,
        row0: usize,
        kk: usize,
        lane: usize,
        (halves, h): (usize, usize),
    ) -> Result<[u32; 4]> {
        s.check()?;
        let sh = shape();
        let (row0, kk) = tile("row", row0, sh.warp_rows, sh.rows, kk)?;
        let (l, hv) = (below("lane", lane, 32)?, below("halves", halves, 3)?);
        let h = below("half", h, halves)?;
        if hv == 0 {
            return Err(bad("no halves".into()));
        }
        let mut a = [0u32; 4];
        // SAFETY: the fragment's words lie in the staged weights (the indices were checked).
        unsafe { wl_host_mmq_a_frag(s.w.as_ptr(), row0, kk, l, hv, h, a.as_mut_ptr()) };
        Ok(a)
    }

    /// `lane`'s B fragment of group `kk` for the n-block's tokens from `tok0`.
    pub fn b_frag(s: &Staged, tok0: usize, kk: usize, lane: usize) -> Result<[u32; 2]> {
        s.check()?;
        let (tok0, kk) = tile("token", tok0, 8, shape().tokens, kk)?;
        let l = below("lane", lane, 32)?;
        let mut b = [0u32; 2];
        // SAFETY: the fragment's words lie in the staged activations (the indices were checked).
        unsafe { wl_host_mmq_b_frag(s.x.as_ptr(), tok0, kk, l, b.as_mut_ptr()) };
        Ok(b)
    }

    /// `lane`'s epilogue of product `c` (group `kk`, half `h`, the warp's rows from `row0`, the
    /// n-block's tokens from `tok0`) into its chains `acc` and `ext`; `kind` from [`kind`].
    #[allow(clippy::too_many_arguments)]
    pub fn epilogue(
        c: &[i32; 4],
        lane: usize,
        (row0, tok0): (usize, usize),
        (kk, h): (usize, usize),
        kind: i32,
        s: &Staged,
        acc: &mut [f32; 4],
        ext: &mut [f32; 4],
    ) -> Result<()> {
        s.check()?;
        let sh = shape();
        let (row0, kk) = tile("row", row0, sh.warp_rows, sh.rows, kk)?;
        let (tok0, _) = tile("token", tok0, 8, sh.tokens, 0)?;
        let (l, h) = (below("lane", lane, 32)?, below("half", h, 2)?);
        // SAFETY: the lane's rows and tokens lie in the staged per-group arrays (the indices
        // were checked); c, acc and ext hold four values each.
        unsafe {
            wl_host_mmq_epilogue(
                c.as_ptr(),
                l,
                row0,
                tok0,
                kk,
                h,
                kind.signum(),
                s.dw.as_ptr(),
                s.mw.as_ptr(),
                s.xd.as_ptr(),
                s.xs.as_ptr(),
                acc.as_mut_ptr(),
                ext.as_mut_ptr(),
            )
        };
        Ok(())
    }
}

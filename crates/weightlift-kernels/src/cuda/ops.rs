//! Every operation of the backend, as launches of `kernels/*.cu`.

// cudarc's launch API is unsafe; each call says why its arguments are sound.
#![allow(unsafe_code)]

use super::launch::*;
use super::matmul::MatShape;
use super::*;

pub use crate::sources::ATTENTION_MAX_HEAD_DIM;

/// Threads per attention block (`WL_ATT_THREADS`).
const ATTENTION_THREADS: u32 = ATTENTION_WARPS as u32 * 32;

/// The attention kernel for a cache stored as `k` keys and `v` values: one per cache dtype
/// (`attention_q8_q4` is the q6 cache).
fn attention_kernel(k: KvFormat, v: KvFormat) -> Result<String> {
    use KvFormat::{BF16, E4M3, F16, F32, Q4, Q8};
    match (k, v) {
        (F32, F32) | (F16, F16) | (BF16, BF16) | (E4M3, E4M3) | (Q8, Q8) | (Q4, Q4) => {
            Ok(format!("attention_{}", k.name()))
        }
        (Q8, Q4) => Ok("attention_q8_q4".into()),
        _ => Err(KernelError::Unsupported {
            op: "attention on cuda",
            ty: format!(
                "keys stored as {} with values stored as {}",
                k.name(),
                v.name()
            ),
            supported: "f32, f16, bf16, e4m3, q8 or q4 for both, or q8 keys with q4 values",
        }),
    }
}
/// The fused RoPE-and-store kernel for a cache of `k` keys and `v` values (`kernels/kv.cu`),
/// named by the cache dtype as the attention kernels are; `None` for a pair no cache dtype
/// makes (the four ops run then).
fn rope_kv_kernel(k: KvFormat, v: KvFormat) -> Option<&'static str> {
    use KvFormat::{BF16, E4M3, F16, F32, Q4, Q8};
    Some(match (k, v) {
        (F32, F32) => "rope_kv_store_f32",
        (F16, F16) => "rope_kv_store_f16",
        (BF16, BF16) => "rope_kv_store_bf16",
        (E4M3, E4M3) => "rope_kv_store_e4m3",
        (Q8, Q8) => "rope_kv_store_q8",
        (Q4, Q4) => "rope_kv_store_q4",
        (Q8, Q4) => "rope_kv_store_q8_q4",
        _ => return None,
    })
}

/// Whether [`Op::MatmulSwiGlu`] of one token has a fused kernel for gate and up matrices of
/// `gate` and `up` types in `mode`: one type for both, a float type in exact mode
/// (`swiglu_matvec_{type}_{act}`) or a Q8 type in Q8 mode (`swiglu_q8_matvec_{type}`), and
/// rows that are not empty.
fn swiglu_fuses(mode: MatvecMode, gate: QuantType, up: QuantType, cols: usize) -> bool {
    gate == up
        && cols > 0
        && match mode {
            MatvecMode::Exact => CUDA_FLOAT_TYPES.contains(&gate),
            MatvecMode::Q8 => CUDA_Q8_TYPES.contains(&gate),
        }
}

impl CudaBackend {
    /// Every [`Op`] on this device (see [`Backend::run`]).
    pub(super) fn run_op(&self, op: Op<'_, CudaBuffer>) -> Result<()> {
        let s = &self.stream;
        // the activations the op before quantised for this one, if any (nobody else's)
        let ready = self.lock_q8_ready().take();
        match op {
            Op::Dequantize {
                ty,
                out,
                n,
                src,
                dst,
            } => {
                self.own(src)?;
                self.own(dst)?;
                if out == FloatType::BF16 {
                    return Err(KernelError::Unsupported {
                        op: "dequantize",
                        ty: "bf16 output".into(),
                        supported: "f32, f16",
                    });
                }
                need("dequantize source bytes", src, quant_bytes(ty, n)?)?;
                need("dequantize output bytes", dst, mul(n, out.size()))?;
                let name = format!("dequantize_{}_{}", ty.name(), out.name());
                let mut args = [
                    KArg::In(&src.slice),
                    KArg::Out(&mut dst.slice),
                    KArg::U64(n as u64),
                ];
                // SAFETY: the kernel reads quant_bytes(ty, n) bytes of src and writes n values of
                // dst, both checked above.
                unsafe { self.launch("dequant", &name, dequantize(n)?, &mut args) }?;
            }
            Op::ConvertToF16 { from, n, src, dst } => {
                self.own(src)?;
                self.own(dst)?;
                need("convert input bytes", src, mul(n, from.size()))?;
                need("convert output bytes", dst, mul(n, 2))?;
                if from == FloatType::F16 {
                    let view = src.slice.slice(0..2 * n);
                    let mut out = dst.slice.slice_mut(0..2 * n);
                    return s
                        .memcpy_dtod(&view, &mut out)
                        .map_err(drv("copying f16 values"));
                }
                let name = format!("convert_{}_f16", from.name());
                let mut args = [
                    KArg::In(&src.slice),
                    KArg::Out(&mut dst.slice),
                    KArg::U64(n as u64),
                ];
                // SAFETY: n values in and out, sizes checked above.
                unsafe { self.launch("convert", &name, elementwise(n)?, &mut args) }?;
            }
            Op::Matmul {
                ty,
                mode,
                act,
                rows,
                cols,
                n_tok,
                max_dq_size,
                w,
                x,
                y,
            } => {
                let shape = MatShape {
                    ty,
                    act,
                    rows,
                    cols,
                    n_tok,
                };
                self.check_matmul(mode, shape, w, x, y)?;
                if n_tok == 0 || rows == 0 {
                    return Ok(());
                }
                if self.matmul_cublas(mode, shape, max_dq_size, w, x, y)? {
                    return Ok(());
                }
                match cuda_kernel_mode(mode, ty) {
                    MatvecMode::Q8 => self.matmul_q8(shape, w, x, y, ready)?,
                    MatvecMode::Exact => match dq_chunk_rows(rows, cols, max_dq_size) {
                        Some(chunk) if n_tok >= DQ_PATH_MIN_TOKENS => {
                            self.matmul_dq(shape, chunk, w, x, y)?
                        }
                        _ => self.matmul_exact(shape, w, x, y)?,
                    },
                }
            }
            Op::MatmulShared {
                mode: MatvecMode::Q8,
                act,
                cols,
                n_tok,
                x,
                mut products,
                ..
            } if products.iter().all(|p| CUDA_Q8_TYPES.contains(&p.ty))
                && !self.cublas_takes_any(
                    products.iter().map(|p| p.ty),
                    MatvecMode::Q8,
                    n_tok,
                    act,
                )? =>
            {
                // the activations quantised once, for every member
                let shape =
                    |p: &crate::backend::Product<'_, CudaBuffer>| MatShape::of(p, act, cols, n_tok);
                for p in &products {
                    self.check_matmul(MatvecMode::Q8, shape(p), p.w, x, p.y)?;
                }
                if n_tok == 0 || cols == 0 {
                    return Ok(());
                }
                let first = shape(&products[0]);
                let grouped = products
                    .iter()
                    .all(|p| self.q8_each_token_route(p.ty, n_tok));
                self.q8_activations(first, x, ready, |xq| {
                    let at_once = (act, cols, n_tok);
                    if grouped && self.grouped_decode(MatvecMode::Q8, at_once, xq, &mut products)? {
                        return Ok(());
                    }
                    for p in &mut products {
                        if p.rows > 0 {
                            self.q8_product(shape(p), p.w, xq, p.y)?;
                        }
                    }
                    Ok(())
                })?;
            }
            Op::MatmulShared {
                mode,
                act,
                cols,
                n_tok,
                max_dq_size,
                x,
                mut products,
            } => {
                // one token of float weights in the exact kernels, as one launch where the
                // members' own launches allow it
                if n_tok == 1
                    && products
                        .iter()
                        .all(|p| cuda_kernel_mode(mode, p.ty) == MatvecMode::Exact)
                    && !self.cublas_takes_any(products.iter().map(|p| p.ty), mode, 1, act)?
                {
                    for p in &products {
                        self.check_matmul(mode, MatShape::of(p, act, cols, n_tok), p.w, x, p.y)?;
                    }
                    let at_once = (act, cols, n_tok);
                    let exact = MatvecMode::Exact;
                    if self.grouped_decode(exact, at_once, &x.slice, &mut products)? {
                        return Ok(());
                    }
                }
                // each member as its own product, the activations rounded once for those that
                // take cuBLAS
                let shape = (mode, act, cols, n_tok, max_dq_size);
                self.matmul_shared_cublas(shape, x, products, |p| self.run_op(p.alone(shape, x)))?;
            }
            Op::MatmulSwiGlu {
                mode,
                act,
                cols,
                n_tok,
                x,
                gate,
                up,
                ..
            } if swiglu_fuses(cuda_kernel_mode(mode, gate.ty), gate.ty, up.ty, cols)
                && (n_tok == 1 || self.q8_each_token_takes(mode, gate.ty, n_tok, act)?) =>
            {
                let shape = MatShape {
                    ty: gate.ty,
                    act,
                    rows: gate.rows,
                    cols,
                    n_tok,
                };
                crate::backend::swiglu_values(gate.rows, up.rows, n_tok)?;
                self.own(up.y)?;
                let mode = cuda_kernel_mode(mode, gate.ty);
                self.matvec_swiglu(mode, shape, [gate.w, up.w], x, gate.y, ready)?;
            }
            op @ Op::MatmulSwiGlu { .. } => {
                crate::backend::matmul_swiglu_unfused(op, |op| self.run_op(op))?
            }
            Op::Int8Matmul {
                rows,
                cols,
                n_tok,
                threshold,
                w,
                x,
                y,
            } => {
                self.own(w)?;
                self.own(x)?;
                self.own(y)?;
                self.int8_matmul(rows, cols, n_tok, threshold, w, x, y)?;
            }
            Op::RmsNorm {
                n_rows,
                n_cols,
                eps,
                x,
                weight,
                out,
            } => {
                self.own(x)?;
                self.own(weight)?;
                self.own(out)?;
                let n = mul(n_rows, n_cols);
                need("rms_norm input bytes", x, mul(n, 4))?;
                need("rms_norm weight bytes", weight, mul(n_cols, 4))?;
                need("rms_norm output bytes", out, mul(n, 4))?;
                if n_rows == 0 {
                    // one block per row: a launch of at least one block would touch row 0
                    return Ok(());
                }
                let mut args = [
                    KArg::In(&x.slice),
                    KArg::In(&weight.slice),
                    KArg::Out(&mut out.slice),
                    KArg::U64(n_cols as u64),
                    KArg::F32(eps),
                ];
                // SAFETY: one block per row below n_rows, n_cols values each; sizes checked above.
                unsafe { self.launch("ops", "rms_norm_f32", per_row(n_rows)?, &mut args) }?;
            }
            Op::AddRmsNorm {
                n_rows,
                n_cols,
                eps,
                x,
                h,
                weight,
                q8_next,
            } => {
                self.own(x)?;
                self.own(h)?;
                self.own(weight)?;
                let n = mul(n_rows, n_cols);
                need("add_rms_norm residual bytes", x, mul(n, 4))?;
                need("add_rms_norm block output bytes", h, mul(n, 4))?;
                need("add_rms_norm weight bytes", weight, mul(n_cols, 4))?;
                if n_rows == 0 {
                    return Ok(());
                }
                if q8_next && self.add_rms_norm_q8(n_rows, n_cols, eps, x, h, weight)? {
                    return Ok(());
                }
                let mut args = [
                    KArg::Out(&mut x.slice),
                    KArg::Out(&mut h.slice),
                    KArg::In(&weight.slice),
                    KArg::U64(n_cols as u64),
                    KArg::F32(eps),
                ];
                // SAFETY: one block per row below n_rows, n_cols values each of x and h (each
                // thread rewrites only the values it read); sizes checked above.
                unsafe { self.launch("ops", "add_rms_norm_f32", per_row(n_rows)?, &mut args) }?;
            }
            Op::Rope {
                params,
                n_tok,
                n_heads,
                x,
                positions,
                out,
            } => {
                self.own(x)?;
                self.own(positions)?;
                self.own(out)?;
                params.check()?;
                let hd = params.head_dim;
                let n = mul(mul(n_tok, n_heads), hd);
                need("rope input bytes", x, mul(n, 4))?;
                need("rope positions bytes", positions, mul(n_tok, 4))?;
                need("rope output bytes", out, mul(n, 4))?;
                let name = match params.style {
                    RopeStyle::Normal => "rope_norm_f32",
                    RopeStyle::Neox => "rope_neox_f32",
                };
                let pairs = mul(mul(n_tok, n_heads), params.n_dims / 2);
                let mut args = [
                    KArg::In(&x.slice),
                    KArg::In(&positions.slice),
                    KArg::Out(&mut out.slice),
                    KArg::U64(pairs as u64),
                    KArg::U64(n_heads as u64),
                    KArg::I32(arg_i32("head_dim", hd)?),
                    KArg::I32(arg_i32("n_dims", params.n_dims)?),
                    KArg::F32(params.freq_base),
                    KArg::F32(params.freq_scale),
                ];
                // SAFETY: one thread per rotated pair, each inside its head; sizes checked above.
                unsafe { self.launch("ops", name, elementwise(pairs)?, &mut args) }?;
            }
            Op::Softmax {
                n_rows,
                n_cols,
                x,
                out,
            } => {
                self.own(x)?;
                self.own(out)?;
                let n = mul(n_rows, n_cols);
                need("softmax input bytes", x, mul(n, 4))?;
                need("softmax output bytes", out, mul(n, 4))?;
                if n_rows == 0 {
                    return Ok(());
                }
                let mut args = [
                    KArg::In(&x.slice),
                    KArg::Out(&mut out.slice),
                    KArg::U64(n_cols as u64),
                ];
                // SAFETY: one block per row below n_rows, n_cols values each; sizes checked above.
                unsafe { self.launch("ops", "softmax_f32", per_row(n_rows)?, &mut args) }?;
            }
            Op::SwiGlu { n, gate, up, out } => self.binary("swiglu_f32", n, gate, up, out)?,
            Op::Add { n, a, b, out } => self.binary("add_f32", n, a, b, out)?,
            Op::KvStore {
                format,
                n,
                src,
                dst,
            } => {
                self.own(src)?;
                self.own(dst)?;
                format.check_values("kv store", 0, n)?;
                need("kv input bytes", src, mul(n, 4))?;
                need("kv cache bytes", dst, format.byte_at(n))?;
                match format {
                    KvFormat::F32 => self.copy(src, 0, dst, 0, 4 * n)?,
                    KvFormat::F16 => self.run(Op::ConvertToF16 {
                        from: FloatType::F32,
                        n,
                        src,
                        dst,
                    })?,
                    _ => self.kv_codec("kv_store", format, n, &src.slice, &mut dst.slice)?,
                }
            }
            Op::KvLoad {
                format,
                n,
                src,
                dst,
            } => {
                self.own(src)?;
                self.own(dst)?;
                format.check_values("kv load", 0, n)?;
                need("kv cache bytes", src, format.byte_at(n))?;
                need("kv output bytes", dst, mul(n, 4))?;
                match format {
                    KvFormat::F32 => self.copy(src, 0, dst, 0, 4 * n)?,
                    KvFormat::F16 => self.run(Op::Dequantize {
                        ty: QuantType::F16,
                        out: FloatType::F32,
                        n,
                        src,
                        dst,
                    })?,
                    _ => self.kv_codec("kv_load", format, n, &src.slice, &mut dst.slice)?,
                }
            }
            Op::RopeInPlace {
                params,
                n_tok,
                n_heads,
                x,
                positions,
                inv_freqs,
            } => {
                self.own(x)?;
                self.own(positions)?;
                self.own(inv_freqs)?;
                params.check()?;
                let hd = params.head_dim;
                let n = mul(mul(n_tok, n_heads), hd);
                need("rope values bytes", x, mul(n, 4))?;
                need("rope positions bytes", positions, mul(n_tok, 4))?;
                need(
                    "rope frequencies bytes",
                    inv_freqs,
                    mul(params.n_dims / 2, 4),
                )?;
                let name = match params.style {
                    RopeStyle::Normal => "rope_inplace_norm_f32",
                    RopeStyle::Neox => "rope_inplace_neox_f32",
                };
                let pairs = mul(mul(n_tok, n_heads), params.n_dims / 2);
                if pairs == 0 {
                    return Ok(());
                }
                let mut args = [
                    KArg::Out(&mut x.slice),
                    KArg::In(&positions.slice),
                    KArg::In(&inv_freqs.slice),
                    KArg::U64(pairs as u64),
                    KArg::U64(n_heads as u64),
                    KArg::I32(arg_i32("head_dim", hd)?),
                    KArg::I32(arg_i32("n_dims", params.n_dims)?),
                    KArg::F32(params.attn_factor),
                ];
                // SAFETY: one thread per rotated pair below n_tok * n_heads * n_dims / 2, each
                // inside its head, reading its token's position and its pair's frequency; sizes
                // checked above.
                unsafe { self.launch("ops", name, elementwise(pairs)?, &mut args) }?;
            }
            Op::RopeKvStore {
                params,
                n_tok,
                n_heads,
                kv_heads,
                q,
                k,
                v,
                positions,
                inv_freqs,
                k_format,
                v_format,
                k_cache,
                v_cache,
                cache_rows,
            } if rope_kv_kernel(k_format, v_format).is_some() => {
                for b in [&*q, &*k, v, positions, inv_freqs, &*k_cache, &*v_cache] {
                    self.own(b)?;
                }
                params.check()?;
                let hd = params.head_dim;
                let kvn = crate::backend::kv_values(n_tok, kv_heads, hd)?;
                k_format.check_values("kv store", 0, kvn)?;
                v_format.check_values("kv store", 0, kvn)?;
                // the values the caches hold: the rows written, or the layer's rows (the
                // kernel's `cap`, 0 for the first)
                let (cached, cap) = match cache_rows {
                    None => (kvn, 0),
                    Some(0) => {
                        return Err(KernelError::Shape {
                            op: "rope_kv_store",
                            reason: "a cache of 0 rows holds no position".into(),
                        });
                    }
                    Some(rows) => {
                        let kvd = crate::backend::kv_values(1, kv_heads, hd)?;
                        let cached = crate::backend::kv_values(rows, kv_heads, hd)?;
                        // each row starts at a whole group (the kernel's groups stay in a row)
                        k_format.check_values("kv store", kvd, cached)?;
                        v_format.check_values("kv store", kvd, cached)?;
                        (cached, rows as u64)
                    }
                };
                need("rope values bytes", q, mul(mul(mul(n_tok, n_heads), hd), 4))?;
                need("rope_kv_store key bytes", k, mul(kvn, 4))?;
                need("rope_kv_store value bytes", v, mul(kvn, 4))?;
                need("rope positions bytes", positions, mul(n_tok, 4))?;
                need(
                    "rope frequencies bytes",
                    inv_freqs,
                    mul(params.n_dims / 2, 4),
                )?;
                need("kv cache key bytes", k_cache, k_format.byte_at(cached))?;
                need("kv cache value bytes", v_cache, v_format.byte_at(cached))?;
                let units = mul(mul(n_tok, n_heads), params.n_dims / 2)
                    .saturating_add(kvn / k_format.granule())
                    .saturating_add(kvn / v_format.granule());
                if units == 0 {
                    return Ok(());
                }
                let name = rope_kv_kernel(k_format, v_format).expect("matched above");
                let mut args = [
                    KArg::Out(&mut q.slice),
                    KArg::In(&k.slice),
                    KArg::In(&v.slice),
                    KArg::In(&positions.slice),
                    KArg::In(&inv_freqs.slice),
                    KArg::Out(&mut k_cache.slice),
                    KArg::Out(&mut v_cache.slice),
                    KArg::U64(n_tok as u64),
                    KArg::U64(n_heads as u64),
                    KArg::U64(kv_heads as u64),
                    KArg::I32(arg_i32("head_dim", hd)?),
                    KArg::I32(arg_i32("n_dims", params.n_dims)?),
                    KArg::I32(i32::from(params.style == RopeStyle::Neox)),
                    KArg::F32(params.attn_factor),
                    KArg::U64(cap),
                ];
                // SAFETY: one thread per work unit below `units` (the kernel's own count of the
                // same shape): a query pair inside its head (n_tok * n_heads * head_dim checked),
                // a key or value (or group of 32) below kvn of k and v (checked), written at the
                // same index of the caches (cap 0, their bytes checked for kvn) or at its
                // position's row p % cap (negative positions skipped; cap rows checked), each
                // token's position and each pair's angle (checked).
                unsafe { self.launch("kv", name, elementwise(units)?, &mut args) }?;
            }
            op @ Op::RopeKvStore { .. } => {
                crate::backend::rope_kv_store_unfused(op, |op| self.run_op(op))?
            }
            Op::AddInPlace { n, x, y } => self.binary_in_place("add_inplace_f32", n, x, y)?,
            Op::AddBias {
                n_rows,
                n_cols,
                x,
                bias,
            } => {
                self.own(x)?;
                self.own(bias)?;
                let n = mul(n_rows, n_cols);
                need("biased values bytes", x, mul(n, 4))?;
                need("bias bytes", bias, mul(n_cols, 4))?;
                if n == 0 {
                    return Ok(());
                }
                let mut args = [
                    KArg::Out(&mut x.slice),
                    KArg::In(&bias.slice),
                    KArg::U64(n as u64),
                    KArg::U64(n_cols as u64),
                ];
                // SAFETY: one thread per value below n_rows * n_cols, reading bias[i % n_cols];
                // sizes checked above.
                unsafe { self.launch("ops", "add_bias_f32", elementwise(n)?, &mut args) }?;
            }
            Op::SwiGluInPlace { n, gate, up } => {
                self.binary_in_place("swiglu_inplace_f32", n, gate, up)?
            }
            Op::GeGluTanhInPlace { n, gate, up } => {
                self.binary_in_place("geglu_tanh_inplace_f32", n, gate, up)?
            }
            Op::ScaleInPlace { n, s, x } => {
                self.own(x)?;
                need("scaled bytes", x, mul(n, 4))?;
                let mut args = [KArg::Out(&mut x.slice), KArg::F32(s), KArg::U64(n as u64)];
                // SAFETY: one thread per value below n; x holds n f32 (checked above).
                unsafe { self.launch("ops", "scale_inplace_f32", elementwise(n)?, &mut args) }?;
            }
            Op::GatherRows {
                n_rows,
                n_cols,
                src_rows,
                rows,
                src,
                dst,
            } => {
                self.own(rows)?;
                self.own(src)?;
                self.own(dst)?;
                let n = mul(n_rows, n_cols);
                need("gathered row index bytes", rows, mul(n_rows, 4))?;
                need("gather source bytes", src, mul(mul(src_rows, n_cols), 4))?;
                need("gathered bytes", dst, mul(n, 4))?;
                if n == 0 {
                    return Ok(());
                }
                let mut args = [
                    KArg::Out(&mut dst.slice),
                    KArg::In(&rows.slice),
                    KArg::In(&src.slice),
                    KArg::U64(n as u64),
                    KArg::U64(n_cols as u64),
                    KArg::U64(src_rows as u64),
                ];
                // SAFETY: one thread per value below n_rows * n_cols, writing dst[i] (n f32,
                // checked) and reading rows[i / n_cols] (n_rows u32, checked) and, for an index
                // below src_rows only, src's row of it (src_rows rows, checked).
                unsafe { self.launch("ops", "gather_rows_f32", elementwise(n)?, &mut args) }?;
            }
            Op::ScatterAddRows {
                n_rows,
                n_cols,
                dst_rows,
                rows,
                weights,
                src,
                dst,
            } => {
                self.own(rows)?;
                self.own(weights)?;
                self.own(src)?;
                self.own(dst)?;
                let n = mul(n_rows, n_cols);
                need("scattered row index bytes", rows, mul(n_rows, 4))?;
                need("scattered row weight bytes", weights, mul(n_rows, 4))?;
                need("scattered bytes", src, mul(n, 4))?;
                need("scatter sum bytes", dst, mul(mul(dst_rows, n_cols), 4))?;
                if n == 0 {
                    return Ok(());
                }
                let mut args = [
                    KArg::Out(&mut dst.slice),
                    KArg::In(&rows.slice),
                    KArg::In(&weights.slice),
                    KArg::In(&src.slice),
                    KArg::U64(n as u64),
                    KArg::U64(n_cols as u64),
                    KArg::U64(dst_rows as u64),
                ];
                // SAFETY: one thread per value below n_rows * n_cols, reading src[i] (n f32),
                // rows and weights at i / n_cols (n_rows each), all checked above, and writing,
                // for an index below dst_rows only, that row of dst (dst_rows rows, checked);
                // distinct indices keep any two threads off one value.
                unsafe { self.launch("ops", "scatter_add_rows_f32", elementwise(n)?, &mut args) }?;
            }
            Op::Attention {
                k_format,
                v_format,
                n_heads,
                kv_heads,
                head_dim,
                n_q,
                start,
                scale,
                window,
                softcap,
                cache_rows,
                tile: _,
                f16_operands,
                q,
                k,
                v,
                out,
                scratch,
                start_at,
                q8_next,
            } => {
                for b in [q, k, v] {
                    self.own(b)?;
                }
                self.own(out)?;
                if let Some(b) = &scratch {
                    self.own(b)?;
                }
                let name = attention_kernel(k_format, v_format)?;
                // with the position read on the device, the shape checked is that of the last
                // position the span allows without a window: the cache must hold all its rows
                // (with a window the span counts keys from the window's start, any position
                // may come, and the cache must hold all its ring's rows)
                let start = match &start_at {
                    None => start,
                    Some(at) => {
                        self.own(at.positions)?;
                        need("attention position bytes", at.positions, 4)?;
                        if n_q >= ATTENTION_PREFILL_MIN_QUERIES || n_q > at.span {
                            return Err(KernelError::Shape {
                                op: "attention on cuda",
                                reason: format!(
                                    "{n_q} queries with the position read on the device over \
                                     {} cache rows: only decode's few queries (below {}) read \
                                     it there, inside the span",
                                    at.span, ATTENTION_PREFILL_MIN_QUERIES
                                ),
                            });
                        }
                        at.span - n_q
                    }
                };
                let sh = AttShape::check(n_heads, kv_heads, head_dim, n_q, start, 1)?;
                if head_dim > ATTENTION_MAX_HEAD_DIM {
                    return Err(KernelError::Shape {
                        op: "attention on cuda",
                        reason: format!(
                            "head_dim {head_dim} is above the kernel's {ATTENTION_MAX_HEAD_DIM}"
                        ),
                    });
                }
                need("attention query bytes", q, mul(sh.q_values(), 4))?;
                let turned = k_format.quant().is_some() || v_format.quant().is_some();
                if turned && !head_dim.is_multiple_of(32) {
                    return Err(KernelError::Shape {
                        op: "attention on cuda",
                        reason: format!(
                            "a quantised cache is decoded by whole warps: head_dim {head_dim} \
                             must be a multiple of 32"
                        ),
                    });
                }
                // the keys the queries see all in the ring (position p in row p % cache_rows),
                // and the rows read in the buffers
                let shape = crate::cpu::attention::AttnShape::new(
                    n_heads,
                    kv_heads,
                    head_dim,
                    n_q,
                    start,
                    scale,
                    f16_operands,
                )?
                .masked(window, softcap);
                shape.check_rows(cache_rows)?;
                let last = match &start_at {
                    Some(_) if window > 0 => cache_rows,
                    _ => sh.start + n_q,
                };
                let held = mul(mul(last.min(cache_rows), kv_heads), head_dim);
                need("attention key bytes", k, k_format.byte_at(held))?;
                need("attention value bytes", v, v_format.byte_at(held))?;
                need("attention output bytes", out, mul(sh.q_values(), 4))?;
                if n_q == 0 {
                    return Ok(());
                }
                if n_q >= ATTENTION_PREFILL_MIN_QUERIES
                    && head_dim <= ATTENTION_PREFILL_MAX_HEAD_DIM
                {
                    // a prompt: K/V tiles in shared memory, met by blocks of (query, head)
                    // rows; in fast mode on tensor cores where the device has them
                    let mma = self
                        .prefill_attention
                        .takes_mma(f16_operands, head_dim, self.cc);
                    let (name, block_rows) = if mma {
                        (
                            name.replacen("attention_", "attention_prefill_mma_", 1),
                            ATTENTION_PREFILL_MMA_ROWS,
                        )
                    } else {
                        (
                            name.replacen("attention_", "attention_prefill_", 1),
                            attention_prefill_rows(head_dim),
                        )
                    };
                    let rows = mul(n_q, n_heads / kv_heads);
                    let blocks = mul(kv_heads, rows.div_ceil(block_rows));
                    let cfg = LaunchConfig {
                        grid_dim: (grid_for(blocks, 1, "attention blocks")?, 1, 1),
                        block_dim: (ATTENTION_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let mut args = [
                        KArg::In(&q.slice),
                        KArg::In(&k.slice),
                        KArg::In(&v.slice),
                        KArg::Out(&mut out.slice),
                        KArg::U64(n_q as u64),
                        KArg::U64(start as u64),
                        KArg::U64(n_heads as u64),
                        KArg::U64(kv_heads as u64),
                        KArg::I32(arg_i32("head_dim", head_dim)?),
                        KArg::F32(scale),
                        KArg::I32(i32::from(f16_operands)),
                        KArg::U64(window as u64),
                        KArg::F32(softcap),
                        KArg::U64(cache_rows as u64),
                    ];
                    // SAFETY: block (kh, b) reads the query rows of its (query, head) pairs
                    // (n_q * n_heads * head_dim checked), cache rows below
                    // min(start + n_q, cache_rows) of KV head kh (those rows checked; positions
                    // past the rows read row p % cache_rows), and writes the output rows of its
                    // pairs (checked); head_dim is within the kernel's shared arrays (checked
                    // against ATTENTION_PREFILL_MAX_HEAD_DIM; the mma kernel's are 64 or 128 by
                    // takes_mma), and kv_heads divides n_heads (AttShape::check).
                    unsafe { self.launch(attention_module(&name), &name, cfg, &mut args) }?;
                    return Ok(());
                }
                let room = scratch.as_deref().map_or(0, |b| b.slice.len() / 4);
                // the keys split, from the first query's window start (wl_att_where): the span,
                // or those the queries see
                let keys = start_at
                    .as_ref()
                    .map_or(start + n_q - shape.first_key(), |at| at.span);
                let grid = attention_grid(
                    [n_heads, kv_heads, head_dim, n_q, keys - n_q],
                    self.sm_count,
                    room,
                );
                let rows = n_q.min(MAX_GRID_YZ) as u32;
                let cfg = LaunchConfig {
                    grid_dim: (grid_for(grid.blocks, 1, "attention blocks")?, rows, 1),
                    block_dim: (ATTENTION_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let split = match scratch {
                    Some(part) if grid.splits > 1 => Some(part),
                    _ => None,
                };
                let fixed = AttentionArgs {
                    n_q: n_q as u64,
                    start: start as u64,
                    n_heads: n_heads as u64,
                    kv_heads: kv_heads as u64,
                    head_dim: arg_i32("head_dim", head_dim)?,
                    scale,
                    f16_operands: i32::from(f16_operands),
                    splits: grid.splits as u64,
                    window: window as u64,
                    softcap,
                    span: start_at.as_ref().map_or(0, |at| at.span as u64),
                    rows: cache_rows as u64,
                };
                let pos = start_at.as_ref().map(|at| &*at.positions.slice);
                let Some(part) = split else {
                    // SAFETY: block (x, i) reads query rows i of the heads of one chunk of KV
                    // head x (n_q * n_heads * head_dim checked) and cache rows below
                    // min(start + i + 1, cache_rows) of that KV head (those rows checked;
                    // positions past the rows read row p % cache_rows), and writes
                    // those heads' output rows i (n_q * n_heads * head_dim checked); head_dim
                    // is within the kernel's shared arrays (checked).
                    return unsafe { self.attention_pass(&name, cfg, [q, k, v], out, pos, &fixed) };
                };
                // SAFETY: as above, with block (x, i) reading split x % splits of the keys and
                // writing its heads' partial results (attention_grid cut the splits to what the
                // scratch holds) instead of the output.
                unsafe { self.attention_pass(&name, cfg, [q, k, v], part, pos, &fixed) }?;
                let reduce = LaunchConfig {
                    grid_dim: (grid_for(n_heads, 1, "heads")?, rows, 1),
                    block_dim: (ATTENTION_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // the merge's arguments after its buffers
                let tail = || {
                    [
                        KArg::U64(fixed.n_q),
                        KArg::U64(fixed.n_heads),
                        KArg::I32(fixed.head_dim),
                        KArg::U64(fixed.splits),
                        KArg::U64(fixed.start),
                        pos.map_or(KArg::Null, KArg::In),
                        KArg::U64(fixed.span),
                        KArg::U64(fixed.window),
                    ]
                };
                // the output's Q8 blocks for the next op's products, in the kept buffer
                let (out_at, n_blocks) = (out.device_addr(), mul(mul(n_q, n_heads), head_dim / 32));
                let quantised = q8_next
                    && head_dim.is_multiple_of(32)
                    && self.quantise_ahead(out_at, n_blocks, |xq| {
                        let mut args = vec![
                            KArg::In(&part.slice),
                            KArg::Out(&mut out.slice),
                            KArg::Out(xq),
                        ];
                        args.extend(tail());
                        // SAFETY: as below, and each block also writes its output row's
                        // head_dim / 32 blocks of 40 bytes into the kept buffer (n_blocks of
                        // them fit, checked by quantise_ahead).
                        unsafe {
                            self.launch("attention", "attention_reduce_q8_f32", reduce, &mut args)
                        }
                    })?;
                if !quantised {
                    let mut args = vec![KArg::In(&part.slice), KArg::Out(&mut out.slice)];
                    args.extend(tail());
                    // SAFETY: block (h, i) reads the partial results of the splits holding keys
                    // of query i (those the pass above wrote, found by the same position rule)
                    // of head h inside the scratch, and writes output row i of head h (n_q *
                    // n_heads * head_dim checked); splits <= ATTENTION_MAX_SPLITS, the kernel's
                    // shared weights (attention_grid).
                    unsafe { self.launch("attention", "attention_reduce_f32", reduce, &mut args) }?;
                }
            }
        }
        Ok(())
    }
}

/// The scalar arguments of `attention_{format}`, in its order after the four buffers.
struct AttentionArgs {
    n_q: u64,
    start: u64,
    n_heads: u64,
    kv_heads: u64,
    head_dim: i32,
    scale: f32,
    f16_operands: i32,
    splits: u64,
    window: u64,
    softcap: f32,
    /// The keys split (from the first query's window start) when the position is read on the
    /// device (0: it is `start`).
    span: u64,
    /// The rows the cache layer holds: the key at position `p` is in row `p % rows`.
    rows: u64,
}

impl CudaBackend {
    /// [`Op::AddRmsNorm`] with its output quantised for the next op (`q8_next`):
    /// `add_rms_norm_q8_f32` writes `h` and its Q8 blocks into the kept buffer in one launch,
    /// and the next op's products take them (see [`CudaBackend::q8_activations`]). Returns
    /// false, having launched nothing, where the blocks would not fit the kept buffer, the rows
    /// are not whole blocks, or the buffer does not exist yet while a graph is recorded.
    fn add_rms_norm_q8(
        &self,
        n_rows: usize,
        n_cols: usize,
        eps: f32,
        x: &mut CudaBuffer,
        h: &mut CudaBuffer,
        weight: &CudaBuffer,
    ) -> Result<bool> {
        if !n_cols.is_multiple_of(32) {
            return Ok(false);
        }
        let n_blocks = mul(n_rows, n_cols / 32);
        self.quantise_ahead(h.device_addr(), n_blocks, |xq| {
            let mut args = [
                KArg::Out(&mut x.slice),
                KArg::Out(&mut h.slice),
                KArg::In(&weight.slice),
                KArg::Out(xq),
                KArg::U64(n_cols as u64),
                KArg::F32(eps),
            ];
            // SAFETY: one block per row below n_rows, n_cols values each of x and h (checked
            // by the caller; each thread rewrites only the values it read, and reads the
            // normed row after the block's barrier), and n_cols / 32 blocks of 40 bytes a row
            // of the kept buffer (n_blocks of them fit, checked by quantise_ahead).
            unsafe { self.launch("ops", "add_rms_norm_q8_f32", per_row(n_rows)?, &mut args) }
        })
    }

    /// One launch of `attention_{format}` writing `dst` (the output, or the partial results of
    /// a split call).
    ///
    /// # Safety
    ///
    /// As [`CudaBackend::launch`]: the caller checked the buffers against the arguments.
    unsafe fn attention_pass(
        &self,
        name: &str,
        cfg: LaunchConfig,
        [q, k, v]: [&CudaBuffer; 3],
        dst: &mut CudaBuffer,
        pos: Option<&CudaSlice<u8>>,
        a: &AttentionArgs,
    ) -> Result<()> {
        let mut args = [
            KArg::In(&q.slice),
            KArg::In(&k.slice),
            KArg::In(&v.slice),
            KArg::Out(&mut dst.slice),
            KArg::U64(a.n_q),
            KArg::U64(a.start),
            KArg::U64(a.n_heads),
            KArg::U64(a.kv_heads),
            KArg::I32(a.head_dim),
            KArg::F32(a.scale),
            KArg::I32(a.f16_operands),
            KArg::U64(a.splits),
            KArg::U64(a.window),
            KArg::F32(a.softcap),
            pos.map_or(KArg::Null, KArg::In),
            KArg::U64(a.span),
            KArg::U64(a.rows),
        ];
        // SAFETY: the caller's contract (the position, when read on the device, only within
        // the span of rows the caller checked).
        unsafe { self.launch(attention_module(name), name, cfg, &mut args) }
    }
}

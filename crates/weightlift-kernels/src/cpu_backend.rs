//! The CPU backend: host memory, the kernels of [`crate::cpu`]. With a capacity it is the
//! engine's `virtual:N` device: an allocation past the capacity fails as a GPU's would.
//!
//! Besides its own allocations, a [`CpuBuffer`] can be a view of host memory owned elsewhere
//! ([`CpuBackend::borrow`], [`Backend::view`], [`Backend::split`]): the engine computes on its
//! workspaces, weights and cache through this backend without copying them.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use crate::backend::{Backend, Op, Rows, check_range, check_ranges, check_rows, quant_bytes};
use crate::cpu;
use crate::error::{KernelError, Result};
use crate::types::{FloatType, QuantType};

/// Host memory, 64-byte aligned, counted against its backend's capacity until dropped; or a
/// view of host memory owned elsewhere (not counted, never freed).
#[derive(Debug)]
pub struct CpuBuffer {
    mem: Mem,
    len: usize,
    used: Arc<AtomicUsize>,
    device: Arc<str>,
}

#[derive(Debug)]
enum Mem {
    Owned(Vec<Align64>),
    /// `len` bytes owned elsewhere (see [`CpuBackend::borrow`] for the contract).
    Borrowed(NonNull<u8>),
}

// SAFETY: an owned buffer is a Vec of plain bytes. A borrowed one stands for the `&[u8]` or
// `&mut [u8]` it was made from (both Send and Sync), and the unsafe constructors make the
// caller keep that memory valid and otherwise untouched for as long as the view lives.
#[allow(unsafe_code)]
unsafe impl Send for CpuBuffer {}
// SAFETY: as above; `&CpuBuffer` only reads.
#[allow(unsafe_code)]
unsafe impl Sync for CpuBuffer {}

#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Align64([u8; 64]);

// SAFETY: Align64 is 64 plain bytes with no padding; any bit pattern is valid.
#[allow(unsafe_code)]
unsafe impl bytemuck::Zeroable for Align64 {}
// SAFETY: as above; the type is Copy, repr(C), 'static and has no padding.
#[allow(unsafe_code)]
unsafe impl bytemuck::Pod for Align64 {}

impl CpuBuffer {
    /// The bytes.
    #[allow(unsafe_code)]
    pub fn as_bytes(&self) -> &[u8] {
        match &self.mem {
            Mem::Owned(d) => &bytemuck::cast_slice(d)[..self.len],
            // SAFETY: a view points at `len` bytes that stay valid while it lives (the contract
            // of the constructors that made it).
            Mem::Borrowed(p) => unsafe { std::slice::from_raw_parts(p.as_ptr(), self.len) },
        }
    }

    /// The bytes, mutable.
    #[allow(unsafe_code)]
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Mem::Owned(d) => &mut bytemuck::cast_slice_mut(d)[..self.len],
            // SAFETY: as above, and a view that may be written was made from exclusive memory
            // (`borrow_mut`, `split`); a read-only view is never handed out as `&mut` by contract.
            Mem::Borrowed(p) => unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), self.len) },
        }
    }

    /// Whether this buffer is a view of memory owned elsewhere.
    pub fn is_view(&self) -> bool {
        matches!(self.mem, Mem::Borrowed(_))
    }

    /// The first `n` values as `T` (f32, u16, i32), or a length (or alignment) error naming
    /// `what`.
    pub fn typed<T: bytemuck::Pod>(&self, what: &'static str, n: usize) -> Result<&[T]> {
        let bytes = n.saturating_mul(size_of::<T>());
        check_range(what, self.len, 0, bytes)?;
        bytemuck::try_cast_slice(&self.as_bytes()[..bytes]).map_err(|_| misaligned::<T>(what))
    }

    /// The first `n` values as mutable `T`.
    pub fn typed_mut<T: bytemuck::Pod>(
        &mut self,
        what: &'static str,
        n: usize,
    ) -> Result<&mut [T]> {
        let bytes = n.saturating_mul(size_of::<T>());
        check_range(what, self.len, 0, bytes)?;
        bytemuck::try_cast_slice_mut(&mut self.as_bytes_mut()[..bytes])
            .map_err(|_| misaligned::<T>(what))
    }
}

fn misaligned<T>(what: &'static str) -> KernelError {
    KernelError::Shape {
        op: what,
        reason: format!(
            "the bytes are not aligned to {} (a view at an odd offset?)",
            align_of::<T>()
        ),
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        if let Mem::Owned(_) = self.mem {
            self.used.fetch_sub(self.len, Ordering::Relaxed);
        }
    }
}

/// The CPU backend. Work runs on rayon's current pool, synchronously.
#[derive(Debug, Clone)]
pub struct CpuBackend {
    name: Arc<str>,
    capacity: Option<usize>,
    used: Arc<AtomicUsize>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// Host memory without a cap, named `cpu`.
    pub fn new() -> Self {
        CpuBackend {
            name: "cpu".into(),
            capacity: None,
            used: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Host memory without a cap, named `name` (the engine's `cpu` or `virtual:N` computing on
    /// memory it owns itself).
    pub fn named(name: &str) -> Self {
        CpuBackend {
            name: name.into(),
            capacity: None,
            used: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// A device with a hard capacity in bytes (the engine's `virtual:N`).
    pub fn with_capacity(name: &str, capacity: usize) -> Self {
        CpuBackend {
            name: name.into(),
            capacity: Some(capacity),
            used: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Bytes currently allocated.
    pub fn allocated(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// The capacity, if any.
    pub fn capacity(&self) -> Option<usize> {
        self.capacity
    }

    /// Wraps host bytes as a buffer of this backend (copies them).
    pub fn buffer_from(&self, bytes: &[u8]) -> Result<CpuBuffer> {
        let mut b = self.alloc(bytes.len())?;
        b.as_bytes_mut().copy_from_slice(bytes);
        Ok(b)
    }

    /// A read-only buffer of this backend over `bytes` (no copy, not counted, never freed).
    ///
    /// # Safety
    ///
    /// The buffer must be dropped before the borrow of `bytes` ends, and nothing may be written
    /// through it (it is an operation's input only, never an output or a copy's destination).
    #[allow(unsafe_code)]
    pub unsafe fn borrow(&self, bytes: &[u8]) -> CpuBuffer {
        self.view_of(NonNull::from(bytes).cast(), bytes.len())
    }

    /// A buffer of this backend that reads and writes `bytes` in place (no copy, not counted,
    /// never freed).
    ///
    /// # Safety
    ///
    /// The buffer must be dropped before the borrow of `bytes` ends.
    #[allow(unsafe_code)]
    pub unsafe fn borrow_mut(&self, bytes: &mut [u8]) -> CpuBuffer {
        let len = bytes.len();
        self.view_of(NonNull::from(bytes).cast(), len)
    }

    fn view_of(&self, ptr: NonNull<u8>, len: usize) -> CpuBuffer {
        CpuBuffer {
            mem: Mem::Borrowed(ptr),
            len,
            used: self.used.clone(),
            device: self.name.clone(),
        }
    }

    fn own(&self, b: &CpuBuffer) -> Result<()> {
        if Arc::ptr_eq(&b.used, &self.used) {
            Ok(())
        } else {
            Err(KernelError::WrongDevice {
                buffer_device: b.device.to_string(),
                backend: self.name.to_string(),
                got: b.len,
            })
        }
    }
}

/// `x += y`, value by value, in parallel chunks.
fn add_in_place(x: &mut [f32], y: &[f32]) {
    x.par_chunks_mut(PAR_ELEMS)
        .zip(y.par_chunks(PAR_ELEMS))
        .for_each(|(x, y)| x.iter_mut().zip(y).for_each(|(a, b)| *a += b));
}

impl CpuBackend {
    /// Does one operation ([`Backend::run`] counts it first).
    fn run_op(&self, op: Op<'_, CpuBuffer>) -> Result<()> {
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
                let nb = quant_bytes(ty, n)?;
                check_range("dequantize source bytes", src.len, 0, nb)?;
                let s = &src.as_bytes()[..nb];
                match out {
                    FloatType::F32 => {
                        cpu::dequantize_f32(ty, s, dst.typed_mut("dequantize output values", n)?)
                    }
                    FloatType::F16 => {
                        cpu::dequantize_f16(ty, s, dst.typed_mut("dequantize output values", n)?)
                    }
                    FloatType::BF16 => Err(KernelError::Unsupported {
                        op: "dequantize",
                        ty: "bf16 output".into(),
                        supported: "f32, f16",
                    }),
                }
            }
            Op::ConvertToF16 { from, n, src, dst } => {
                self.own(src)?;
                self.own(dst)?;
                let d = dst.typed_mut::<u16>("convert output values", n)?;
                match from {
                    FloatType::F32 => {
                        cpu::convert::f32_to_f16_slice(src.typed("convert input values", n)?, d)
                    }
                    FloatType::BF16 => {
                        cpu::convert::bf16_to_f16_slice(src.typed("convert input values", n)?, d)
                    }
                    FloatType::F16 => {
                        d.copy_from_slice(src.typed("convert input values", n)?);
                        Ok(())
                    }
                }
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
                for b in [w, x] {
                    self.own(b)?;
                }
                self.own(y)?;
                let wb = rows.saturating_mul(quant_bytes(ty, cols)?);
                check_range("matmul weight bytes", w.len, 0, wb)?;
                let w = &w.as_bytes()[..wb];
                let nx = n_tok.saturating_mul(cols);
                let y = y.typed_mut("matmul output values", n_tok.saturating_mul(rows))?;
                // One token is the matrix-vector product, as the engine's host forward pass
                // calls it (its own kernels, not a one-column matrix product).
                match (act, n_tok) {
                    (FloatType::F32, 1) => cpu::matvec::matvec(
                        mode,
                        ty,
                        w,
                        rows,
                        cols,
                        x.typed("matmul activation values", nx)?,
                        y,
                    ),
                    (FloatType::F16, 1) => cpu::matvec::matvec_f16(
                        mode,
                        ty,
                        w,
                        rows,
                        cols,
                        x.typed("matmul activation values", nx)?,
                        y,
                    ),
                    (FloatType::F32, _) => cpu::matvec::matmul(
                        mode,
                        ty,
                        w,
                        rows,
                        cols,
                        x.typed("matmul activation values", nx)?,
                        n_tok,
                        y,
                        max_dq_size,
                    ),
                    (FloatType::F16, _) => cpu::matvec::matmul_f16(
                        mode,
                        ty,
                        w,
                        rows,
                        cols,
                        x.typed("matmul activation values", nx)?,
                        n_tok,
                        y,
                        max_dq_size,
                    ),
                    (FloatType::BF16, _) => Err(KernelError::Unsupported {
                        op: "matmul",
                        ty: "bf16 activations".into(),
                        supported: "f32, f16",
                    }),
                }
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
                for b in [w, x] {
                    self.own(b)?;
                }
                self.own(y)?;
                // the host path's call on the same bytes, so both give the same bits
                cpu::int8::int8_matmul_packed(
                    w.as_bytes(),
                    rows,
                    cols,
                    x.typed("int8 matmul activation values", n_tok.saturating_mul(cols))?,
                    n_tok,
                    threshold,
                    y.typed_mut("int8 matmul output values", n_tok.saturating_mul(rows))?,
                )
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
                let n = n_rows.saturating_mul(n_cols);
                cpu::ops::rms_norm(
                    x.typed("rms_norm input values", n)?,
                    weight.typed("rms_norm weight values", n_cols)?,
                    eps,
                    out.typed_mut("rms_norm output values", n)?,
                )
            }
            Op::AddRmsNorm {
                n_rows,
                n_cols,
                eps,
                x,
                h,
                weight,
                q8_next: _,
            } => {
                self.own(x)?;
                self.own(h)?;
                self.own(weight)?;
                let n = n_rows.saturating_mul(n_cols);
                let xs = x.typed_mut::<f32>("add_rms_norm residual values", n)?;
                let hs = h.typed_mut::<f32>("add_rms_norm block output values", n)?;
                add_in_place(xs, hs);
                cpu::ops::rms_norm(
                    xs,
                    weight.typed("add_rms_norm weight values", n_cols)?,
                    eps,
                    hs,
                )
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
                let n = n_tok
                    .checked_mul(n_heads)
                    .and_then(|v| v.checked_mul(params.head_dim))
                    .unwrap_or(usize::MAX);
                cpu::ops::rope(
                    x.typed("rope input values", n)?,
                    positions.typed("rope positions", n_tok)?,
                    &params,
                    out.typed_mut("rope output values", n)?,
                )
            }
            Op::Softmax {
                n_rows,
                n_cols,
                x,
                out,
            } => {
                self.own(x)?;
                self.own(out)?;
                let n = n_rows.saturating_mul(n_cols);
                cpu::ops::softmax(
                    x.typed("softmax input values", n)?,
                    n_cols,
                    out.typed_mut("softmax output values", n)?,
                )
            }
            Op::SwiGlu { n, gate, up, out } => {
                self.own(gate)?;
                self.own(up)?;
                self.own(out)?;
                cpu::ops::swiglu(
                    gate.typed("swiglu gate values", n)?,
                    up.typed("swiglu up values", n)?,
                    out.typed_mut("swiglu output values", n)?,
                )
            }
            Op::Add { n, a, b, out } => {
                self.own(a)?;
                self.own(b)?;
                self.own(out)?;
                cpu::ops::add(
                    a.typed("add lhs values", n)?,
                    b.typed("add rhs values", n)?,
                    out.typed_mut("add output values", n)?,
                )
            }
            Op::KvStore {
                format,
                n,
                src,
                dst,
            } => {
                self.own(src)?;
                self.own(dst)?;
                format.check_values("kv store", 0, n)?;
                let nb = format.byte_at(n);
                check_range("kv cache bytes", dst.len, 0, nb)?;
                cpu::kv_format::kv_encode(
                    format,
                    src.typed("kv input values", n)?,
                    &mut dst.as_bytes_mut()[..nb],
                )
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
                let nb = format.byte_at(n);
                check_range("kv cache bytes", src.len, 0, nb)?;
                cpu::kv_format::kv_decode(
                    format,
                    &src.as_bytes()[..nb],
                    dst.typed_mut("kv output values", n)?,
                )
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
                let n = n_tok
                    .checked_mul(n_heads)
                    .and_then(|v| v.checked_mul(params.head_dim))
                    .unwrap_or(usize::MAX);
                if n_tok == 0 || n_heads == 0 {
                    return Ok(());
                }
                cpu::ops::rope_in_place(
                    x.typed_mut("rope values", n)?,
                    positions.typed("rope positions", n_tok)?,
                    &params,
                    inv_freqs.typed("rope frequencies", params.n_dims / 2)?,
                )
            }
            Op::AddInPlace { n, x, y } => {
                self.own(x)?;
                self.own(y)?;
                let y = y.typed::<f32>("add addend values", n)?;
                add_in_place(x.typed_mut::<f32>("add accumulator values", n)?, y);
                Ok(())
            }
            Op::AddBias {
                n_rows,
                n_cols,
                x,
                bias,
            } => {
                self.own(x)?;
                self.own(bias)?;
                let b = bias.typed::<f32>("bias values", n_cols)?;
                let x = x.typed_mut::<f32>("biased values", n_rows.saturating_mul(n_cols))?;
                if n_cols > 0 {
                    x.par_chunks_mut(n_cols).for_each(|r| {
                        r.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                    });
                }
                Ok(())
            }
            Op::SwiGluInPlace { n, gate, up } => {
                self.own(gate)?;
                self.own(up)?;
                swiglu_in_place(
                    gate.typed_mut("swiglu gate values", n)?,
                    up.typed("swiglu up values", n)?,
                )
            }
            Op::GeGluTanhInPlace { n, gate, up } => {
                self.own(gate)?;
                self.own(up)?;
                cpu::ops::geglu_tanh_in_place(
                    gate.typed_mut("geglu gate values", n)?,
                    up.typed("geglu up values", n)?,
                )
            }
            Op::ScaleInPlace { n, s, x } => {
                self.own(x)?;
                cpu::ops::scale_in_place(x.typed_mut("scaled values", n)?, s);
                Ok(())
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
                let rows = rows.typed::<u32>("gathered row indices", n_rows)?;
                let src =
                    src.typed::<f32>("gather source values", src_rows.saturating_mul(n_cols))?;
                let dst = dst.typed_mut::<f32>("gathered values", n_rows.saturating_mul(n_cols))?;
                for (&r, out) in rows.iter().zip(dst.chunks_exact_mut(n_cols.max(1))) {
                    let r = row_index("gather_rows", r, src_rows)?;
                    out.copy_from_slice(&src[r * n_cols..(r + 1) * n_cols]);
                }
                Ok(())
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
                let rows = rows.typed::<u32>("scattered row indices", n_rows)?;
                let weights = weights.typed::<f32>("scattered row weights", n_rows)?;
                let src = src.typed::<f32>("scattered values", n_rows.saturating_mul(n_cols))?;
                let dst = dst.typed_mut::<f32>("scatter sums", dst_rows.saturating_mul(n_cols))?;
                for ((&r, &w), y) in rows
                    .iter()
                    .zip(weights)
                    .zip(src.chunks_exact(n_cols.max(1)))
                {
                    let r = row_index("scatter_add_rows", r, dst_rows)?;
                    dst[r * n_cols..(r + 1) * n_cols]
                        .iter_mut()
                        .zip(y)
                        .for_each(|(o, v)| *o += w * v);
                }
                Ok(())
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
                tile,
                f16_operands,
                q,
                k,
                v,
                out,
                scratch,
                start_at,
                q8_next: _,
            } => {
                for b in [q, k, v] {
                    self.own(b)?;
                }
                self.own(out)?;
                // the CPU folds every query's keys in one pass: no partial results to keep
                if let Some(b) = scratch {
                    self.own(b)?;
                }
                let start = match &start_at {
                    None => start,
                    Some(at) => {
                        self.own(at.positions)?;
                        let start = read_start(at, n_q, window)?;
                        // the cache holds the span's rows (the ring's, when fewer), as CUDA
                        // checks; with a window the span counts keys from the window's start,
                        // so any position may come, and the cache holds all its rows
                        let last = if window > 0 { cache_rows } else { at.span };
                        let rows =
                            crate::backend::kv_values(last.min(cache_rows), kv_heads, head_dim)?;
                        check_range("attention key bytes", k.len, 0, k_format.byte_at(rows))?;
                        check_range("attention value bytes", v.len, 0, v_format.byte_at(rows))?;
                        start
                    }
                };
                let s = AttShape::check(n_heads, kv_heads, head_dim, n_q, start, tile)?;
                let qn = s.q_values();
                // the host forward pass's kernel over the same tiles: the same bits
                let shape = cpu::attention::AttnShape::new(
                    s.n_heads,
                    s.kv_heads,
                    s.head_dim,
                    s.n_q,
                    s.start,
                    scale,
                    f16_operands,
                )?
                .masked(window, softcap);
                shape.check_rows(cache_rows)?;
                // the keys from the first tile any query sees, each from its ring row
                let base = shape.first_tile(s.tile);
                let span = (base, s.start + s.n_q);
                let kf = ring_values(k_format, k, span, (cache_rows, shape.kv_dim()), "key")?;
                let vf = ring_values(v_format, v, span, (cache_rows, shape.kv_dim()), "value")?;
                cpu::attention::attention_from(
                    crate::cpu::Isa::detect(),
                    shape,
                    s.tile,
                    base,
                    q.typed("attention query values", qn)?,
                    &kf,
                    &vf,
                    out.typed_mut("attention output values", qn)?,
                )
            }
            op @ Op::MatmulShared { .. } => crate::backend::matmul_each(op, |op| self.run_op(op)),
            // the reference: the products, then SwiGLU over the gate's output
            op @ Op::MatmulSwiGlu { .. } => {
                crate::backend::matmul_swiglu_unfused(op, |op| self.run_op(op))
            }
            // RoPE as the rows form, then each token's rows encoded at its position's row
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
                cache_rows: Some(rows),
            } => {
                for b in [&*k_cache, &*v_cache, positions] {
                    self.own(b)?;
                }
                let kvd = crate::backend::kv_values(1, kv_heads, params.head_dim)?;
                let kvn = crate::backend::kv_values(n_tok, kv_heads, params.head_dim)?;
                let cached = crate::backend::kv_values(rows, kv_heads, params.head_dim)?;
                for f in [k_format, v_format] {
                    // every row starts at a whole group
                    f.check_values("rope_kv_store", kvd, cached)?;
                }
                check_range(
                    "kv cache key bytes",
                    k_cache.len,
                    0,
                    k_format.byte_at(cached),
                )?;
                check_range(
                    "kv cache value bytes",
                    v_cache.len,
                    0,
                    v_format.byte_at(cached),
                )?;
                // each token at its position's row of the ring (its position, below the rows)
                let at: Vec<usize> = positions
                    .typed::<i32>("rope positions", n_tok)?
                    .iter()
                    .enumerate()
                    .map(|(t, &p)| {
                        usize::try_from(p)
                            .ok()
                            .filter(|_| rows > 0)
                            .map(|p| p % rows)
                            .ok_or_else(|| KernelError::Shape {
                                op: "rope_kv_store",
                                reason: format!(
                                    "token {t} is at position {p}, which no row of the cache's \
                                     {rows} rows holds"
                                ),
                            })
                    })
                    .collect::<Result<_>>()?;
                for (x, n_heads) in [(&mut *q, n_heads), (&mut *k, kv_heads)] {
                    self.run_op(Op::RopeInPlace {
                        params,
                        n_tok,
                        n_heads,
                        x,
                        positions,
                        inv_freqs,
                    })?;
                }
                for (src, dst, f, what) in [
                    (&*k, k_cache, k_format, "rope_kv_store key values"),
                    (v, v_cache, v_format, "rope_kv_store value values"),
                ] {
                    let src = src.typed::<f32>(what, kvn)?;
                    let dst = dst.as_bytes_mut();
                    for (row, x) in at.iter().zip(src.chunks_exact(kvd.max(1))) {
                        let (b0, b1) = (f.byte_at(row * kvd), f.byte_at((row + 1) * kvd));
                        cpu::kv_format::kv_encode(f, x, &mut dst[b0..b1])?;
                    }
                }
                Ok(())
            }
            // the reference: RoPE on the queries and keys, then the two cache stores
            op @ Op::RopeKvStore { .. } => {
                crate::backend::rope_kv_store_unfused(op, |op| self.run_op(op))
            }
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn name(&self) -> String {
        self.name.to_string()
    }

    fn alloc(&self, bytes: usize) -> Result<CpuBuffer> {
        let oom = || KernelError::OutOfMemory {
            device: self.name.to_string(),
            bytes,
        };
        // reserve first, so concurrent allocations cannot overshoot the capacity together
        let prev = self.used.fetch_add(bytes, Ordering::Relaxed);
        if let Some(cap) = self.capacity
            && prev.checked_add(bytes).is_none_or(|t| t > cap)
        {
            self.used.fetch_sub(bytes, Ordering::Relaxed);
            return Err(oom());
        }
        let words = bytes.div_ceil(64);
        let mut data = Vec::new();
        if data.try_reserve_exact(words).is_err() {
            self.used.fetch_sub(bytes, Ordering::Relaxed);
            return Err(oom());
        }
        data.resize(words, Align64([0; 64]));
        Ok(CpuBuffer {
            mem: Mem::Owned(data),
            len: bytes,
            used: self.used.clone(),
            device: self.name.clone(),
        })
    }

    fn len(&self, buf: &CpuBuffer) -> usize {
        buf.len
    }

    fn copy_from_host(&self, src: &[u8], dst: &mut CpuBuffer, offset: usize) -> Result<()> {
        self.own(dst)?;
        check_range("copy destination bytes", dst.len, offset, src.len())?;
        crate::backend::record_upload(src.len());
        dst.as_bytes_mut()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn copy_to_host(&self, src: &CpuBuffer, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.own(src)?;
        check_range("copy source bytes", src.len, offset, dst.len())?;
        dst.copy_from_slice(&src.as_bytes()[offset..offset + dst.len()]);
        Ok(())
    }

    fn copy(
        &self,
        src: &CpuBuffer,
        so: usize,
        dst: &mut CpuBuffer,
        d_o: usize,
        bytes: usize,
    ) -> Result<()> {
        self.own(src)?;
        self.own(dst)?;
        check_range("copy source bytes", src.len, so, bytes)?;
        check_range("copy destination bytes", dst.len, d_o, bytes)?;
        dst.as_bytes_mut()[d_o..d_o + bytes].copy_from_slice(&src.as_bytes()[so..so + bytes]);
        Ok(())
    }

    fn copy_2d(
        &self,
        src: &CpuBuffer,
        from: Rows,
        dst: &mut CpuBuffer,
        to: Rows,
        width: usize,
        rows: usize,
    ) -> Result<()> {
        self.own(src)?;
        self.own(dst)?;
        check_rows("copy_2d source bytes", src.len, from, width, rows)?;
        check_rows("copy_2d destination bytes", dst.len, to, width, rows)?;
        if width == 0 {
            return Ok(());
        }
        let (s, d) = (src.as_bytes(), dst.as_bytes_mut());
        for r in 0..rows {
            // in bounds: the last row ends within each buffer (checked above)
            let (a, b) = (from.offset + r * from.pitch, to.offset + r * to.pitch);
            d[b..b + width].copy_from_slice(&s[a..a + width]);
        }
        Ok(())
    }

    fn peer_access(&self, _to: &CpuBackend) -> bool {
        true
    }

    fn copy_peer(
        &self,
        src: &CpuBuffer,
        so: usize,
        to: &CpuBackend,
        dst: &mut CpuBuffer,
        d_o: usize,
        bytes: usize,
    ) -> Result<()> {
        self.own(src)?;
        to.own(dst)?;
        check_range("copy source bytes", src.len, so, bytes)?;
        check_range("copy destination bytes", dst.len, d_o, bytes)?;
        dst.as_bytes_mut()[d_o..d_o + bytes].copy_from_slice(&src.as_bytes()[so..so + bytes]);
        Ok(())
    }

    fn run(&self, op: Op<'_, CpuBuffer>) -> Result<()> {
        crate::backend::record(&op);
        self.run_op(op)
    }

    fn scan_non_finite(
        &self,
        ty: QuantType,
        buf: &CpuBuffer,
        bytes: usize,
    ) -> Result<Option<usize>> {
        self.own(buf)?;
        check_range("scan bytes", buf.len, 0, bytes)?;
        cpu::convert::scan_non_finite(ty, &buf.as_bytes()[..bytes])
    }

    fn quantize_rows(
        &self,
        ty: QuantType,
        src_ty: FloatType,
        src: &[u8],
        n_per_row: usize,
        dst: &mut CpuBuffer,
        offset: usize,
        first: usize,
        found: &mut CpuBuffer,
    ) -> Result<()> {
        self.own(dst)?;
        self.own(found)?;
        check_range("quantize report bytes", found.len, 0, 8)?;
        let rows = src.len() / src_ty.size() / n_per_row.max(1);
        let row_bytes = cpu::quantize::quantized_row_bytes(ty, n_per_row)?;
        let out_bytes = rows.saturating_mul(row_bytes);
        check_range("quantize destination bytes", dst.len, offset, out_bytes)?;
        let out = &mut dst.as_bytes_mut()[offset..offset + out_bytes];
        let report =
            cpu::quantize::quantize_rows_from_reported(ty, src_ty, src, n_per_row, out, first)?;
        let word = &mut found.as_bytes_mut()[..8];
        let merged = u64::from_le_bytes(word.try_into().unwrap_or([0; 8])).max(report);
        word.copy_from_slice(&merged.to_le_bytes());
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    #[allow(unsafe_code)]
    unsafe fn view(&self, buf: &CpuBuffer, offset: usize, len: usize) -> Result<CpuBuffer> {
        self.own(buf)?;
        check_range("view bytes", buf.len, offset, len)?;
        let bytes = &buf.as_bytes()[offset..offset + len];
        // SAFETY: the caller keeps `buf` alive and unwritten while the view lives, and writes
        // nothing through it (this function's contract).
        Ok(unsafe { self.borrow(bytes) })
    }

    #[allow(unsafe_code)]
    unsafe fn split(
        &self,
        buf: &mut CpuBuffer,
        ranges: &[(usize, usize)],
    ) -> Result<Vec<CpuBuffer>> {
        self.own(buf)?;
        check_ranges(buf.len, ranges)?;
        let base = NonNull::from(buf.as_bytes_mut()).cast::<u8>();
        Ok(ranges
            .iter()
            .map(|&(offset, len)| {
                // SAFETY: the ranges lie inside `buf` and do not overlap (checked above), so
                // each part is an exclusive piece of it; the caller drops every part before it
                // uses `buf` again (this function's contract).
                let at = unsafe { base.add(offset) };
                self.view_of(at, len)
            })
            .collect())
    }
}

/// Values per parallel task of the elementwise operations.
const PAR_ELEMS: usize = 16 * 1024;

/// `gate = silu(gate) * up` through [`cpu::ops::swiglu`] in stack-sized pieces (the engine's
/// host forward pass does the same, so the two agree to the bit).
fn swiglu_in_place(gate: &mut [f32], up: &[f32]) -> Result<()> {
    const PIECE: usize = 1024;
    gate.par_chunks_mut(PIECE)
        .zip(up.par_chunks(PIECE))
        .try_for_each(|(g, u)| {
            let mut tmp = [0f32; PIECE];
            let t = &mut tmp[..g.len()];
            cpu::ops::swiglu(g, u, t)?;
            g.copy_from_slice(t);
            Ok(())
        })
}

/// The checked sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttShape {
    pub n_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub n_q: usize,
    pub start: usize,
    pub tile: usize,
}

impl AttShape {
    /// The shape, or a shape error: heads a multiple of the kv heads, non-empty heads and tile,
    /// and every count small enough that the buffer sizes do not overflow.
    pub(crate) fn check(
        n_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        n_q: usize,
        start: usize,
        tile: usize,
    ) -> Result<AttShape> {
        // The kernel's own checks (heads, head size, buffer sizes); the scale and operand
        // rounding do not enter them.
        cpu::attention::AttnShape::new(n_heads, kv_heads, head_dim, n_q, start, 1.0, false)?;
        if tile == 0 {
            return Err(KernelError::Shape {
                op: "attention",
                reason: "tile must be above 0".into(),
            });
        }
        Ok(AttShape {
            n_heads,
            kv_heads,
            head_dim,
            n_q,
            start,
            tile,
        })
    }

    /// Values of the queries (and of the output).
    pub(crate) fn q_values(&self) -> usize {
        self.n_q * self.n_heads * self.head_dim
    }
}

/// The cache rows of positions `from..to` (of `kvd` values each) stored as `format` in a cache
/// of `rows` rows, the key at position `p` in row `p % rows`, as f32 in position order: the
/// contiguous rows when no position wraps (borrowed when they are f32), else gathered row by
/// row (`what`: "key" or "value", for the errors).
fn ring_values<'b>(
    format: cpu::kv_format::KvFormat,
    buf: &'b CpuBuffer,
    (from, to): (usize, usize),
    (rows, kvd): (usize, usize),
    what: &'static str,
) -> Result<std::borrow::Cow<'b, [f32]>> {
    let (label, bytes) = match what {
        "key" => ("attention key values", "attention key bytes"),
        _ => ("attention value values", "attention value bytes"),
    };
    // every row starts at a whole group
    format.check_values("attention", kvd, from.saturating_mul(kvd))?;
    let held = to.min(rows).saturating_mul(kvd);
    check_range(bytes, buf.len, 0, format.byte_at(held))?;
    let src = &buf.as_bytes()[..format.byte_at(held)];
    if to <= rows {
        let (v0, v1) = (from * kvd, to * kvd);
        if format == cpu::kv_format::KvFormat::F32 {
            let all: &[f32] = buf.typed(label, v1)?;
            return Ok(std::borrow::Cow::Borrowed(&all[v0..]));
        }
        let mut out = vec![0f32; v1 - v0];
        cpu::kv_format::kv_decode(format, &src[format.byte_at(v0)..], &mut out)?;
        return Ok(std::borrow::Cow::Owned(out));
    }
    let mut out = vec![0f32; (to - from) * kvd];
    for (p, dst) in (from..to).zip(out.chunks_exact_mut(kvd.max(1))) {
        let r = p % rows;
        let (b0, b1) = (format.byte_at(r * kvd), format.byte_at((r + 1) * kvd));
        cpu::kv_format::kv_decode(format, &src[b0..b1], dst)?;
    }
    Ok(std::borrow::Cow::Owned(out))
}

/// The first query's position of an [`Op::Attention`] that reads it from `at`, refused when it is
/// negative or its `n_q` queries pass the span: see more than `span` keys from the first
/// query's window start (of `window` keys, 0: none), as CUDA's kernel refuses them.
fn read_start(
    at: &crate::backend::StartAt<'_, CpuBuffer>,
    n_q: usize,
    window: usize,
) -> Result<usize> {
    let p = at.positions.typed::<i32>("attention position", 1)?[0];
    usize::try_from(p)
        .ok()
        .filter(|&s| {
            s.checked_add(n_q)
                .is_some_and(|end| end - cpu::attention::window_start(s, window) <= at.span)
        })
        .ok_or_else(|| KernelError::Shape {
            op: "attention",
            reason: format!(
                "{n_q} queries from position {p} pass the span of {} cache rows",
                at.span
            ),
        })
}

/// Row index `r` of an op over a buffer of `n` rows, refused when it is past them.
fn row_index(op: &'static str, r: u32, n: usize) -> Result<usize> {
    let r = r as usize;
    if r >= n {
        return Err(KernelError::Shape {
            op,
            reason: format!("row index {r} is past the buffer's {n} rows"),
        });
    }
    Ok(r)
}

//! The CPU backend: host memory, the kernels of [`crate::cpu`]. With a capacity it is the
//! engine's `virtual:N` device: an allocation past the capacity fails as a GPU's would.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::backend::{Backend, Op, check_range, quant_bytes};
use crate::cpu;
use crate::error::{KernelError, Result};
use crate::types::{FloatType, QuantType};

/// Host memory, 64-byte aligned, counted against its backend's capacity until dropped.
#[derive(Debug)]
pub struct CpuBuffer {
    data: Vec<Align64>,
    len: usize,
    used: Arc<AtomicUsize>,
    device: Arc<str>,
}

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
    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.data)[..self.len]
    }

    /// The bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.data)[..self.len]
    }

    /// The first `n` values as `T` (f32, u16, i32), or a length error naming `what`.
    pub fn typed<T: bytemuck::Pod>(&self, what: &'static str, n: usize) -> Result<&[T]> {
        let bytes = n.saturating_mul(size_of::<T>());
        check_range(what, self.len, 0, bytes)?;
        Ok(bytemuck::cast_slice(&self.as_bytes()[..bytes]))
    }

    /// The first `n` values as mutable `T`.
    pub fn typed_mut<T: bytemuck::Pod>(
        &mut self,
        what: &'static str,
        n: usize,
    ) -> Result<&mut [T]> {
        let bytes = n.saturating_mul(size_of::<T>());
        check_range(what, self.len, 0, bytes)?;
        Ok(bytemuck::cast_slice_mut(&mut self.as_bytes_mut()[..bytes]))
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        self.used.fetch_sub(self.len, Ordering::Relaxed);
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
            data,
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

    fn run(&self, op: Op<'_, CpuBuffer>) -> Result<()> {
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
                match act {
                    FloatType::F32 => cpu::matvec::matmul(
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
                    FloatType::F16 => cpu::matvec::matmul_f16(
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
                    FloatType::BF16 => Err(KernelError::Unsupported {
                        op: "matmul",
                        ty: "bf16 activations".into(),
                        supported: "f32, f16",
                    }),
                }
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
            Op::KvQuantize { kt, n, x, out } => {
                self.own(x)?;
                self.own(out)?;
                let nb = kt.bytes_for(n);
                check_range("kv cache bytes", out.len, 0, nb)?;
                cpu::kv::kv_quantize(
                    kt,
                    x.typed("kv input values", n)?,
                    &mut out.as_bytes_mut()[..nb],
                )
            }
            Op::KvDequantize { kt, n, src, out } => {
                self.own(src)?;
                self.own(out)?;
                let nb = kt.bytes_for(n);
                check_range("kv cache bytes", src.len, 0, nb)?;
                cpu::kv::kv_dequantize(
                    kt,
                    &src.as_bytes()[..nb],
                    out.typed_mut("kv output values", n)?,
                )
            }
        }
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

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

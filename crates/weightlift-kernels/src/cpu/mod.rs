//! The CPU backend's kernels: the reference every other backend is tested against.
//!
//! Each entry point comes in two forms: `op(...)`, which uses the best instruction set this
//! CPU has ([`Isa::detect`]), and `op_with(isa, ...)`, which forces one, so tests can run the
//! scalar fallback and the SIMD path on the same input. Work is split over rayon's current
//! thread pool; run inside `ThreadPool::install` to choose the thread count.

// The SIMD paths call std::arch intrinsics (unsafe) behind run-time feature detection; each
// call site says which detection makes it sound.
#![allow(unsafe_code)]

pub mod attention;
mod attention_rows;
pub mod convert;
pub mod dequant_scalar;
pub(crate) mod exp;
pub mod half;
pub mod int8;
pub mod kv;
pub mod kv_format;
pub mod matvec;
pub mod ops;
pub mod quantize;
pub(crate) mod quantize_blocks;
mod token_pass;
pub(crate) mod x86;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_dequant;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_gemm;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_int8;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_matvec;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_matvec512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_matvec_batch;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_ops;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_quantize;

use std::sync::OnceLock;

use rayon::prelude::*;

use crate::error::{KernelError, Result};
use crate::types::QuantType;

/// An output written by many tasks at once, each writing only its own elements (a product's
/// tasks own row ranges, and its output is token-major, so no task's elements are one slice).
pub(crate) struct SharedOut<'a> {
    ptr: *mut f32,
    len: usize,
    _out: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: tasks write disjoint elements (the contract of `write`), and the borrow of the
// output lasts as long as this value.
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    pub(crate) fn new(out: &'a mut [f32]) -> Self {
        Self {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            _out: std::marker::PhantomData,
        }
    }

    /// Writes `src` at element `at`.
    ///
    /// # Safety
    /// No other thread reads or writes `at..at + src.len()` meanwhile.
    pub(crate) unsafe fn write(&self, at: usize, src: &[f32]) {
        assert!(
            at + src.len() <= self.len,
            "shared output: {at} + {} of {}",
            src.len(),
            self.len
        );
        // SAFETY: inside the output (asserted); exclusive by this function's contract.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(at), src.len()) };
    }
}

/// `Ok` when an operand holds the `expected` number of values, else the typed mismatch.
pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(KernelError::LengthMismatch {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// An instruction set level for the CPU kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust, no `std::arch`.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 + FMA + F16C plus AVX-512 F/BW/VL: the exact-mode matvec, both matmul modes, the
    /// Q8-mode matvec of the 32-value types (two rows per vector, with AVX512-VNNI), the tiled
    /// attention, RMSNorm, softmax, SwiGLU and dequantisation to f16 of every type but Q8_0,
    /// Q6_K, F16 and BF16 (through f16 code tables) use 512-bit forms; dequantisation to f32
    /// and the KV-cache quantisers use their AVX2 forms at this level (the 512-bit forms
    /// measured no faster).
    Avx512,
}

/// Environment variable that caps the instruction set: `scalar`, `avx2` or `avx512`.
pub const ISA_ENV: &str = "WEIGHTLIFT_CPU_ISA";

impl Isa {
    /// The best level this CPU supports, capped by `WEIGHTLIFT_CPU_ISA` (read once).
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Isa::best_supported();
            let cap = match std::env::var(ISA_ENV)
                .ok()
                .as_deref()
                .map(str::to_ascii_lowercase)
                .as_deref()
            {
                Some("scalar") => Isa::Scalar,
                Some("avx2") => Isa::Avx2,
                _ => Isa::Avx512,
            };
            best.min(cap)
        })
    }

    /// The best level the hardware supports, ignoring the environment (detected once: the
    /// kernels ask on every call, some of them per 64-value dot product).
    #[inline]
    pub fn best_supported() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(Isa::detect_hardware)
    }

    /// [`Isa::best_supported`], uncached.
    fn detect_hardware() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            let avx512 = std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl");
            if avx2 && avx512 {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Every level this CPU can run, lowest first (tests iterate over it).
    pub fn all_supported() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| *i <= Isa::best_supported())
            .collect()
    }

    /// Whether the AVX2 kernels may run.
    #[inline]
    pub(crate) fn has_avx2(self) -> bool {
        self >= Isa::Avx2 && Isa::best_supported() >= Isa::Avx2
    }

    /// Whether the AVX-512 kernels may run.
    #[inline]
    pub(crate) fn has_avx512(self) -> bool {
        self >= Isa::Avx512 && Isa::best_supported() >= Isa::Avx512
    }

    /// The VNNI byte dot-product instruction the Q8-mode matvec and matmul use at this level
    /// on this CPU: AVX-VNNI at [`Isa::Avx2`]; AVX512-VNNI (else AVX-VNNI) at [`Isa::Avx512`].
    /// `None` below AVX2, without either extension, or when `WEIGHTLIFT_CPU_VNNI` is `0` or
    /// `off`. (The 512-bit matmul tiles use AVX512-VNNI only; with AVX-VNNI alone they take
    /// the `pmaddubsw` form.)
    pub fn vnni(self) -> Option<Vnni> {
        static VNNI: OnceLock<(bool, bool)> = OnceLock::new();
        let (avx, avx512) = *VNNI.get_or_init(|| {
            let off = matches!(
                std::env::var(VNNI_ENV)
                    .ok()
                    .as_deref()
                    .map(str::to_ascii_lowercase)
                    .as_deref(),
                Some("0" | "off")
            );
            #[cfg(target_arch = "x86_64")]
            if !off {
                return (
                    std::arch::is_x86_feature_detected!("avxvnni"),
                    std::arch::is_x86_feature_detected!("avx512vnni"),
                );
            }
            let _ = off;
            (false, false)
        });
        if self.has_avx512() && avx512 {
            Some(Vnni::Avx512Vnni)
        } else if self.has_avx2() && avx {
            Some(Vnni::AvxVnni)
        } else {
            None
        }
    }
}

/// Environment variable that turns the VNNI form of the Q8-mode matvec and matmul off (`0` or
/// `off`); results are the same bits either way.
pub const VNNI_ENV: &str = "WEIGHTLIFT_CPU_VNNI";

/// A VNNI extension (`vpdpbusd`: four unsigned-by-signed byte products summed into each i32
/// lane in one instruction), used on 256-bit vectors by the Q8-mode matvec and on 256- or
/// 512-bit vectors by the Q8-mode matmul.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Vnni {
    /// AVX-VNNI (VEX encoding).
    AvxVnni,
    /// AVX512-VNNI with AVX512-VL (EVEX encoding); [`Isa::Avx512`] only.
    Avx512Vnni,
}

/// Elements per parallel work item: big enough to amortise rayon, small enough for L2.
pub(crate) const CHUNK_ELEMS: usize = 16 * 1024;

/// Checks `src` is whole blocks and `out` has room for exactly their values; returns the count.
fn check_dequant(ty: QuantType, src: &[u8], out_len: usize) -> Result<usize> {
    let n = ty.blocks_in("src", src.len())?;
    let expected = n * ty.block_size();
    if out_len != expected {
        return Err(KernelError::LengthMismatch {
            what: "dequantize output values",
            expected,
            got: out_len,
        });
    }
    Ok(n)
}

/// An element the dequantisers write: f32, or f16 as its bit pattern in a `u16`.
pub(crate) trait DqOut: Copy + Send + Sync + 'static {
    /// Whether the elements are f16 bit patterns (rounded to nearest even from f32).
    const F16: bool;
    /// This element from the f32 value the decoders compute.
    fn from_f32(x: f32) -> Self;
    /// The slice as f32, when the elements are f32.
    fn as_f32(s: &mut [Self]) -> Option<&mut [f32]>;
}

impl DqOut for f32 {
    const F16: bool = false;
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn as_f32(s: &mut [f32]) -> Option<&mut [f32]> {
        Some(s)
    }
}

impl DqOut for u16 {
    const F16: bool = true;
    #[inline(always)]
    fn from_f32(x: f32) -> u16 {
        self::half::f32_to_f16(x)
    }
    fn as_f32(_: &mut [u16]) -> Option<&mut [f32]> {
        None
    }
}

/// Dequantises `src` (whole blocks of `ty`) into `out` on one thread.
fn dequant_seq(isa: Isa, ty: QuantType, src: &[u8], out: &mut [f32]) {
    dequant_seq_stream(isa, ty, src, out, false)
}

/// Outputs at least this large are written with non-temporal stores (they cannot stay in L2).
const STREAM_BYTES: usize = 8 << 20;

/// [`dequant_seq`] into f32 or f16, optionally with cache-bypassing stores (used only when
/// `out` is 16-byte aligned).
fn dequant_seq_stream<T: DqOut>(isa: Isa, ty: QuantType, src: &[u8], out: &mut [T], stream: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        let nt = stream && (out.as_ptr() as usize).is_multiple_of(16);
        if isa.has_avx512() && x86_dequant::has_avx512::<T>(ty) {
            // SAFETY: has_avx512 checked AVX-512F/BW/VL, AVX2, FMA and F16C at run time;
            // the callers checked lengths; `nt` only when 16-byte aligned.
            unsafe {
                if nt {
                    x86_dequant::dequant_avx512::<T, true>(ty, src, out);
                } else {
                    x86_dequant::dequant_avx512::<T, false>(ty, src, out);
                }
            }
            return;
        }
        if isa.has_avx2() && x86_dequant::has_avx2(ty) {
            // SAFETY: has_avx2 checked AVX2, FMA and F16C at run time; the rest as above.
            unsafe {
                if nt {
                    x86_dequant::dequant_avx2::<T, true>(ty, src, out);
                } else {
                    x86_dequant::dequant_avx2::<T, false>(ty, src, out);
                }
            }
            return;
        }
    }
    let _ = (isa, stream);
    dequant_scalar_into(ty, src, out);
}

/// The scalar fallback: f32 straight from the block decoders, f16 through one block of f32
/// on the stack.
fn dequant_scalar_into<T: DqOut>(ty: QuantType, src: &[u8], out: &mut [T]) {
    if let Some(out) = T::as_f32(out) {
        dequant_scalar::dequant_blocks(ty, src, out);
        return;
    }
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    let mut tmp = [0f32; 256];
    let tmp = &mut tmp[..bs];
    for (blk, o) in src.chunks_exact(bb).zip(out.chunks_exact_mut(bs)) {
        dequant_scalar::dequant_block(ty, blk, tmp);
        for (o, x) in o.iter_mut().zip(tmp.iter()) {
            *o = T::from_f32(*x);
        }
    }
}

/// Splits whole blocks over rayon's pool and dequantises each piece.
fn dequant_par<T: DqOut>(isa: Isa, ty: QuantType, src: &[u8], out: &mut [T]) -> Result<()> {
    let n = check_dequant(ty, src, out.len())?;
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    let per = (CHUNK_ELEMS / bs).max(1);
    let stream = std::mem::size_of_val(out) >= STREAM_BYTES;
    if n <= per {
        dequant_seq_stream(isa, ty, src, out, stream);
    } else {
        src.par_chunks(per * bb)
            .zip(out.par_chunks_mut(per * bs))
            .for_each(|(s, o)| dequant_seq_stream(isa, ty, s, o, stream));
    }
    Ok(())
}

/// Dequantises `src`, whole blocks of `ty`, to f32 with the best instruction set.
///
/// `out.len()` must be the number of values (`blocks * ty.block_size()`). Bit-identical to
/// gguf-py's `gguf.quants.dequantize` for every supported type.
pub fn dequantize_f32(ty: QuantType, src: &[u8], out: &mut [f32]) -> Result<()> {
    dequantize_f32_with(Isa::detect(), ty, src, out)
}

/// [`dequantize_f32`] with a forced instruction set.
pub fn dequantize_f32_with(isa: Isa, ty: QuantType, src: &[u8], out: &mut [f32]) -> Result<()> {
    dequant_par(isa, ty, src, out)
}

/// Dequantises `src` to f16 (bit patterns in `out`), rounding each f32 value to nearest even,
/// as `gguf.quants.dequantize(...).astype(np.float16)` does.
pub fn dequantize_f16(ty: QuantType, src: &[u8], out: &mut [u16]) -> Result<()> {
    dequantize_f16_with(Isa::detect(), ty, src, out)
}

/// [`dequantize_f16`] with a forced instruction set.
pub fn dequantize_f16_with(isa: Isa, ty: QuantType, src: &[u8], out: &mut [u16]) -> Result<()> {
    if ty == QuantType::F16 {
        check_dequant(ty, src, out.len())?;
        // f16 to f16 is a copy (bit patterns kept, NaN payloads included)
        src.par_chunks(2 * CHUNK_ELEMS)
            .zip(out.par_chunks_mut(CHUNK_ELEMS))
            .for_each(|(s, o)| {
                if cfg!(target_endian = "little") {
                    bytemuck::cast_slice_mut::<u16, u8>(o).copy_from_slice(s);
                } else {
                    for (o, c) in o.iter_mut().zip(s.chunks_exact(2)) {
                        *o = u16::from_le_bytes([c[0], c[1]]);
                    }
                }
            });
        return Ok(());
    }
    dequant_par(isa, ty, src, out)
}

/// Reinterprets little-endian bytes as f32 values without copying when aligned, else copies.
pub fn f32_from_le_bytes(src: &[u8]) -> Result<std::borrow::Cow<'_, [f32]>> {
    if !src.len().is_multiple_of(4) {
        return Err(KernelError::RaggedBlocks {
            what: "f32 data",
            ty: QuantType::F32,
            got: src.len(),
            block_bytes: 4,
        });
    }
    Ok(match bytemuck::try_cast_slice::<u8, f32>(src) {
        Ok(s) if cfg!(target_endian = "little") => std::borrow::Cow::Borrowed(s),
        _ => std::borrow::Cow::Owned(
            src.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
    })
}

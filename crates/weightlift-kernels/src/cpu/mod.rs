//! The CPU backend's kernels: the reference every other backend is tested against.
//!
//! Each entry point comes in two forms: `op(...)`, which uses the best instruction set this
//! CPU has ([`Isa::detect`]), and `op_with(isa, ...)`, which forces one, so tests can run the
//! scalar fallback and the SIMD path on the same input. Work is split over rayon's current
//! thread pool; run inside `ThreadPool::install` to choose the thread count.

// The SIMD paths call std::arch intrinsics (unsafe) behind run-time feature detection; each
// call site says which detection makes it sound.
#![allow(unsafe_code)]

pub mod convert;
pub mod dequant_scalar;
pub mod half;
pub mod kv;
pub mod matvec;
pub mod ops;
pub(crate) mod x86;

use std::sync::OnceLock;

use rayon::prelude::*;

use crate::error::{KernelError, Result};
use crate::types::QuantType;

/// An instruction set level for the CPU kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust, no `std::arch`.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 + FMA + F16C plus AVX-512 F/BW/VL: the exact-mode matvec and the f32 dot products
    /// of the matmul path use 512-bit forms; every other kernel uses its AVX2 form at this level.
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

    /// The best level the hardware supports, ignoring the environment.
    pub fn best_supported() -> Isa {
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

/// Dequantises `src` (whole blocks of `ty`) into `out` on one thread.
fn dequant_seq(isa: Isa, ty: QuantType, src: &[u8], out: &mut [f32]) {
    dequant_seq_stream(isa, ty, src, out, false)
}

/// Outputs at least this large are written with non-temporal stores (they cannot stay in L2).
const STREAM_BYTES: usize = 8 << 20;

/// [`dequant_seq`], optionally with cache-bypassing stores (when `out` is 16-byte aligned).
fn dequant_seq_stream(isa: Isa, ty: QuantType, src: &[u8], out: &mut [f32], stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && x86::imp::dequant_has_avx2(ty) {
        if stream && (out.as_ptr() as usize).is_multiple_of(16) {
            // SAFETY: has_avx2 checked AVX2+FMA+F16C at run time; the callers checked lengths;
            // the output is 16-byte aligned as non-temporal stores need.
            unsafe { x86::imp::dequant_avx2::<true>(ty, src, out) };
        } else {
            // SAFETY: as above, with ordinary stores.
            unsafe { x86::imp::dequant_avx2::<false>(ty, src, out) };
        }
        return;
    }
    let _ = stream;
    let _ = isa;
    dequant_scalar::dequant_blocks(ty, src, out);
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
    let n = check_dequant(ty, src, out.len())?;
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    let per = (CHUNK_ELEMS / bs).max(1);
    let stream = out.len() * 4 >= STREAM_BYTES;
    if n <= per {
        dequant_seq_stream(isa, ty, src, out, stream);
    } else {
        src.par_chunks(per * bb)
            .zip(out.par_chunks_mut(per * bs))
            .for_each(|(s, o)| dequant_seq_stream(isa, ty, s, o, stream));
    }
    Ok(())
}

/// Dequantises `src` to f16 (bit patterns in `out`), rounding each f32 value to nearest even,
/// as `gguf.quants.dequantize(...).astype(np.float16)` does.
pub fn dequantize_f16(ty: QuantType, src: &[u8], out: &mut [u16]) -> Result<()> {
    dequantize_f16_with(Isa::detect(), ty, src, out)
}

/// [`dequantize_f16`] with a forced instruction set.
pub fn dequantize_f16_with(isa: Isa, ty: QuantType, src: &[u8], out: &mut [u16]) -> Result<()> {
    let n = check_dequant(ty, src, out.len())?;
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    if ty == QuantType::F16 {
        for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = u16::from_le_bytes([c[0], c[1]]);
        }
        return Ok(());
    }
    let per = (CHUNK_ELEMS / bs).max(1);
    let work = |s: &[u8], o: &mut [u16]| {
        let mut tmp = vec![0f32; o.len()];
        dequant_seq(isa, ty, s, &mut tmp);
        convert::f32_to_f16_seq(isa, &tmp, o);
    };
    if n <= per {
        work(src, out);
    } else {
        src.par_chunks(per * bb)
            .zip(out.par_chunks_mut(per * bs))
            .for_each(|(s, o)| work(s, o));
    }
    Ok(())
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

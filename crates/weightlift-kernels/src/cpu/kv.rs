//! KV-cache quantisation: groups of 32 values with one f16 scale, symmetric.
//!
//! | type | group bytes | per value | quant | scale |
//! |---|---|---|---|---|
//! | q8 | 34: f16 d, 32 × i8 | 8.5 bits | `q = round(x/d)` in [−127, 127] | `d = amax/127` |
//! | q4 | 18: f16 d, 16 × two nibbles | 4.5 bits | `q = round(x/d)` in [−7, 7], stored `q + 8` | `d = amax/7` |
//!
//! The q4 nibble order is ggml's Q4_0 order (value `j` in the low nibble of byte `j`, value
//! `j + 16` in its high nibble), but unlike ggml's Q4_0 (`d = max/−8`, range [−8, 7]) the
//! range is symmetric, so the bound below holds for both signs.
//!
//! `d` is rounded *up* to the next f16, so `|x/d| ≤ qmax` and no value is clipped. The
//! reconstruction `x̂ = q·d` is exact in f32, and for every value
//!
//! ```text
//! |x − x̂| ≤ d · (1/2 + 2⁻¹⁶)
//! ```
//!
//! where the 2⁻¹⁶ covers the rounding of the f32 division `x/d` (|x/d| ≤ 127 < 2⁷, so it is off
//! by at most 2⁷·2⁻²⁴ before `round`). The bound holds for |x| ≤ 65504·qmax (past that the f16
//! scale saturates at 65504 and values are clamped to ±qmax·65504). Non-finite values: NaN is
//! left out of `amax` and stored as quant 0; ±inf makes the scale 65504 and is stored as ±qmax,
//! the group's finite values being quantised against that scale; callers that care scan
//! first ([`scan_non_finite`](super::convert::scan_non_finite)).
//!
//! `q = round(x · (1/d))` rounds half away from zero (`f32::round`). The AVX2 path (used at
//! the AVX2 and AVX-512 levels) writes the same bytes as the scalar path, so caches are
//! portable; dequantisation is bit-identical on every level.

use rayon::prelude::*;

use super::Isa;
use super::half::{f16_to_f32, f32_to_f16, rd_f16};
use crate::error::{KernelError, Result};

/// Values per group.
pub const KV_GROUP: usize = 32;

/// A KV-cache storage type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvType {
    /// 8-bit quants, 34 bytes per 32 values.
    Q8,
    /// 4-bit quants, 18 bytes per 32 values.
    Q4,
}

impl KvType {
    /// Bytes per group of [`KV_GROUP`] values.
    pub const fn group_bytes(self) -> usize {
        match self {
            KvType::Q8 => 34,
            KvType::Q4 => 18,
        }
    }

    /// The largest quant magnitude.
    pub const fn qmax(self) -> i32 {
        match self {
            KvType::Q8 => 127,
            KvType::Q4 => 7,
        }
    }

    /// The lower-case name used in kernel names.
    pub const fn name(self) -> &'static str {
        match self {
            KvType::Q8 => "q8",
            KvType::Q4 => "q4",
        }
    }

    /// Bytes needed for `n` values (`n` a multiple of 32).
    pub const fn bytes_for(self, n: usize) -> usize {
        n / KV_GROUP * self.group_bytes()
    }
}

/// The f16 scale for a group with largest magnitude `amax`: `amax/qmax` rounded up to f16.
pub fn kv_scale(kt: KvType, amax: f32) -> u16 {
    let d = amax / kt.qmax() as f32;
    let mut h = f32_to_f16(d);
    if f16_to_f32(h) < d && h < 0x7bff {
        h += 1; // positive finite f16: the next pattern is the next value up
    }
    if h >= 0x7c00 && !d.is_nan() {
        h = 0x7bff;
    }
    h
}

fn check(kt: KvType, n_values: usize, n_bytes: usize) -> Result<()> {
    if !n_values.is_multiple_of(KV_GROUP) {
        return Err(KernelError::Shape {
            op: "kv quantize",
            reason: format!("{n_values} values are not whole groups of {KV_GROUP}"),
        });
    }
    let expected = kt.bytes_for(n_values);
    if n_bytes != expected {
        return Err(KernelError::LengthMismatch {
            what: "kv cache bytes",
            expected,
            got: n_bytes,
        });
    }
    Ok(())
}

const GROUPS_PER_TASK: usize = 512;

/// Quantises `x` into `out` (`kt.bytes_for(x.len())` bytes).
pub fn kv_quantize(kt: KvType, x: &[f32], out: &mut [u8]) -> Result<()> {
    kv_quantize_with(Isa::detect(), kt, x, out)
}

/// [`kv_quantize`] with a forced instruction set. Every level writes the same bytes, so caches
/// are portable between machines.
pub fn kv_quantize_with(isa: Isa, kt: KvType, x: &[f32], out: &mut [u8]) -> Result<()> {
    check(kt, x.len(), out.len())?;
    let gb = kt.group_bytes();
    let qmax = kt.qmax() as f32;
    x.par_chunks(KV_GROUP * GROUPS_PER_TASK)
        .zip(out.par_chunks_mut(gb * GROUPS_PER_TASK))
        .for_each(|(xs, os)| {
            #[cfg(target_arch = "x86_64")]
            if isa.has_avx2() {
                // SAFETY: AVX2 and F16C detected at run time; `check` made `xs` whole groups
                // and `os` exactly their bytes.
                return unsafe { super::x86_ops::imp::kv_quantize_avx2(kt == KvType::Q4, xs, os) };
            }
            let _ = isa;
            for (g, o) in xs.chunks_exact(KV_GROUP).zip(os.chunks_exact_mut(gb)) {
                let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
                let h = kv_scale(kt, amax);
                o[..2].copy_from_slice(&h.to_le_bytes());
                let d = f16_to_f32(h);
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q = |v: f32| (v * id).round().clamp(-qmax, qmax) as i32;
                match kt {
                    KvType::Q8 => {
                        for (b, v) in o[2..].iter_mut().zip(g) {
                            *b = q(*v) as i8 as u8;
                        }
                    }
                    KvType::Q4 => {
                        for j in 0..16 {
                            let lo = (q(g[j]) + 8) as u8;
                            let hi = (q(g[j + 16]) + 8) as u8;
                            o[2 + j] = lo | (hi << 4);
                        }
                    }
                }
            }
        });
    Ok(())
}

/// Dequantises `src` (`kt.bytes_for(out.len())` bytes) into `out`: `x̂ = q · d`.
pub fn kv_dequantize(kt: KvType, src: &[u8], out: &mut [f32]) -> Result<()> {
    kv_dequantize_with(Isa::detect(), kt, src, out)
}

/// [`kv_dequantize`] with a forced instruction set (bit-identical on every level).
pub fn kv_dequantize_with(isa: Isa, kt: KvType, src: &[u8], out: &mut [f32]) -> Result<()> {
    check(kt, out.len(), src.len())?;
    let gb = kt.group_bytes();
    src.par_chunks(gb * GROUPS_PER_TASK)
        .zip(out.par_chunks_mut(KV_GROUP * GROUPS_PER_TASK))
        .for_each(|(ss, os)| {
            #[cfg(target_arch = "x86_64")]
            if isa.has_avx2() {
                // SAFETY: AVX2 and F16C detected at run time; `check` made `ss` whole groups
                // and `os` exactly their values.
                return unsafe {
                    super::x86_ops::imp::kv_dequantize_avx2(kt == KvType::Q4, ss, os)
                };
            }
            let _ = isa;
            for (g, o) in ss.chunks_exact(gb).zip(os.chunks_exact_mut(KV_GROUP)) {
                let d = rd_f16(g, 0);
                match kt {
                    KvType::Q8 => {
                        for (v, b) in o.iter_mut().zip(&g[2..]) {
                            *v = (*b as i8) as f32 * d;
                        }
                    }
                    KvType::Q4 => {
                        for j in 0..16 {
                            o[j] = ((g[2 + j] & 0x0f) as i32 - 8) as f32 * d;
                            o[j + 16] = ((g[2 + j] >> 4) as i32 - 8) as f32 * d;
                        }
                    }
                }
            }
        });
    Ok(())
}

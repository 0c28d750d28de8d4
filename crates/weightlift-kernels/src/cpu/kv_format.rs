//! How one of K or V is stored in a KV cache, and the codec between those bytes and f32 values.
//!
//! | format | bytes per value | stored |
//! |---|---|---|
//! | f32 | 4 | the value |
//! | f16 | 2 | the value rounded to nearest (even) f16 |
//! | bf16 | 2 | the value rounded to nearest (even) bf16 (transformers' default cache dtype) |
//! | e4m3 | 1 | OCP FP8 E4M3, round to nearest even, saturating at ±448 |
//! | q8 | 34 per 32 | each group of 32 turned by the Walsh-Hadamard transform, then [`KvType::Q8`] |
//! | q4 | 18 per 32 | likewise with [`KvType::Q4`] |
//!
//! The turn (as exllamav2's quantised caches do it): keys have outlier channels, and one outlier
//! would set the scale of the 31 small values of its group; the orthonormal transform spreads
//! it over the whole group first. It is its own inverse, so decoding dequantises and turns back.
//!
//! This is the one codec of the cache: the engine's host path encodes and decodes rows with it,
//! the CPU backend's cache operations call it, and the CUDA kernels are its twin (the host
//! build of `kernels/wl_kv.cuh` is tested against it), so a cache written by one is read alike
//! by the others.

use super::half::f16_to_f32;
use super::kv::{KV_GROUP, KvType, kv_dequantize, kv_quantize};
use crate::error::{KernelError, Result};
use crate::types::QuantType;

/// The storage of one of K or V in a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// f32, 4 bytes.
    F32,
    /// IEEE half, 2 bytes.
    F16,
    /// bfloat16, 2 bytes: f32's range with 8 bits of precision.
    BF16,
    /// FP8 E4M3, 1 byte.
    E4M3,
    /// Hadamard-turned groups of 8-bit quants (34 bytes per 32 values).
    Q8,
    /// Hadamard-turned groups of 4-bit quants (18 bytes per 32 values).
    Q4,
}

impl KvFormat {
    /// The lower-case name used in kernel names and messages.
    pub const fn name(self) -> &'static str {
        match self {
            KvFormat::F32 => "f32",
            KvFormat::F16 => "f16",
            KvFormat::BF16 => "bf16",
            KvFormat::E4M3 => "e4m3",
            KvFormat::Q8 => "q8",
            KvFormat::Q4 => "q4",
        }
    }

    /// The group quantiser of a quantised format.
    pub const fn quant(self) -> Option<KvType> {
        match self {
            KvFormat::Q8 => Some(KvType::Q8),
            KvFormat::Q4 => Some(KvType::Q4),
            _ => None,
        }
    }

    /// Values that must be encoded together: a group for the quantised formats, else one.
    pub const fn granule(self) -> usize {
        if self.quant().is_some() { KV_GROUP } else { 1 }
    }

    /// The byte offset of value `at` (a multiple of [`KvFormat::granule`]).
    pub const fn byte_at(self, at: usize) -> usize {
        match self {
            KvFormat::F32 => at * 4,
            KvFormat::F16 | KvFormat::BF16 => at * 2,
            KvFormat::E4M3 => at,
            KvFormat::Q8 => KvType::Q8.bytes_for(at),
            KvFormat::Q4 => KvType::Q4.bytes_for(at),
        }
    }

    /// Checks that `n` values start and end on whole granules.
    pub fn check_values(self, op: &'static str, at: usize, n: usize) -> Result<()> {
        let g = self.granule();
        if !at.is_multiple_of(g) || !n.is_multiple_of(g) {
            return Err(KernelError::Shape {
                op,
                reason: format!(
                    "values {at}..{} of a {} cache are not whole groups of {g}",
                    at + n,
                    self.name()
                ),
            });
        }
        Ok(())
    }
}

/// Encodes `values` into `out` (exactly `format.byte_at(values.len())` bytes).
pub fn kv_encode(format: KvFormat, values: &[f32], out: &mut [u8]) -> Result<()> {
    format.check_values("kv encode", 0, values.len())?;
    expect_bytes(format, values.len(), out.len())?;
    match format {
        KvFormat::F32 => {
            for (d, x) in out.chunks_exact_mut(4).zip(values) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        KvFormat::F16 => match bytemuck::try_cast_slice_mut::<u8, u16>(out) {
            // as BF16 below: straight into an aligned row, else through a buffer
            Ok(words) if cfg!(target_endian = "little") => {
                super::convert::f32_to_f16_slice(values, words)?
            }
            _ => {
                let mut words = vec![0u16; values.len()];
                super::convert::f32_to_f16_slice(values, &mut words)?;
                for (d, w) in out.chunks_exact_mut(2).zip(&words) {
                    d.copy_from_slice(&w.to_le_bytes());
                }
            }
        },
        KvFormat::BF16 => match bytemuck::try_cast_slice_mut::<u8, u16>(out) {
            // the cache rows are 2-byte aligned in every cache this crate allocates; the
            // fallback keeps an odd view correct
            Ok(words) if cfg!(target_endian = "little") => {
                super::convert::f32_to_bf16_slice(values, words)?
            }
            _ => {
                for (d, x) in out.chunks_exact_mut(2).zip(values) {
                    d.copy_from_slice(&super::half::f32_to_bf16(*x).to_le_bytes());
                }
            }
        },
        KvFormat::E4M3 => {
            for (d, &x) in out.iter_mut().zip(values) {
                *d = e4m3::encode(x);
            }
        }
        KvFormat::Q8 | KvFormat::Q4 => {
            let kt = format.quant().unwrap_or(KvType::Q8);
            // group by group through a stack copy: this runs for every token of every layer
            for (group, dst) in values
                .chunks_exact(KV_GROUP)
                .zip(out.chunks_exact_mut(kt.group_bytes()))
            {
                let mut turned = [0f32; KV_GROUP];
                turned.copy_from_slice(group);
                hadamard(&mut turned);
                kv_quantize(kt, &turned, dst)?;
            }
        }
    }
    Ok(())
}

/// Decodes `src` (exactly `format.byte_at(out.len())` bytes) into `out`.
pub fn kv_decode(format: KvFormat, src: &[u8], out: &mut [f32]) -> Result<()> {
    format.check_values("kv decode", 0, out.len())?;
    expect_bytes(format, out.len(), src.len())?;
    match format {
        KvFormat::F32 => {
            for (x, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        KvFormat::F16 => match bytemuck::try_cast_slice::<u8, u16>(src) {
            Ok(words) => super::convert::f16_to_f32_slice(words, out)?,
            Err(_) => {
                for (x, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *x = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
        },
        // the bf16 weight dequantiser: widened exactly, SIMD where the CPU has it
        KvFormat::BF16 => super::dequantize_f32(QuantType::BF16, src, out)?,
        KvFormat::E4M3 => {
            for (x, &b) in out.iter_mut().zip(src) {
                *x = e4m3::decode(b);
            }
        }
        KvFormat::Q8 | KvFormat::Q4 => {
            let kt = format.quant().unwrap_or(KvType::Q8);
            kv_dequantize(kt, src, out)?;
            out.chunks_exact_mut(KV_GROUP).for_each(hadamard);
        }
    }
    Ok(())
}

fn expect_bytes(format: KvFormat, n: usize, got: usize) -> Result<()> {
    let expected = format.byte_at(n);
    if got != expected {
        return Err(KernelError::LengthMismatch {
            what: "kv cache bytes",
            expected,
            got,
        });
    }
    Ok(())
}

/// The orthonormal Walsh-Hadamard transform of one group, in place; it is its own inverse. The
/// butterflies run in this fixed order (and the CUDA twin keeps it), so every implementation
/// gives the same bits.
pub fn hadamard(g: &mut [f32]) {
    let n = g.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (g[j], g[j + h]);
                g[j] = a + b;
                g[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let norm = 1.0 / (n as f32).sqrt();
    g.iter_mut().for_each(|x| *x *= norm);
}

/// OCP FP8 E4M3 (bias 7, no infinities, 0x7F/0xFF NaN, max 448), as CUDA's `__nv_fp8_e4m3`.
pub mod e4m3 {
    /// Decode one byte.
    pub fn decode(b: u8) -> f32 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((b >> 3) & 0x0F);
        let m = f32::from(b & 0x07);
        if e == 0x0F && b & 0x07 == 0x07 {
            return f32::NAN;
        }
        let mag = if e == 0 {
            m / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f32.powi(e - 7)
        };
        sign * mag
    }

    /// Encode with round-to-nearest-even, saturating at ±448 (CUDA's `__NV_SATFINITE`).
    pub fn encode(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7F;
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = x.abs();
        // Codes 0x00..=0x7E are the finite non-negative values, in increasing order.
        let (mut lo, mut hi) = (0u8, 0x7Eu8);
        if a >= decode(hi) {
            return sign | hi;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if decode(mid) <= a { lo = mid } else { hi = mid }
        }
        let (dl, dh) = (a - decode(lo), decode(hi) - a);
        let code = if dl < dh || (dl == dh && lo % 2 == 0) {
            lo
        } else {
            hi
        };
        sign | code
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3::decode(0x7E), 448.0);
        assert_eq!(e4m3::decode(0x01), 2f32.powi(-9));
        assert_eq!(e4m3::encode(1000.0), 0x7E);
        assert_eq!(e4m3::encode(-1.0), 0xB8);
        for b in 0..=0xFEu8 {
            if b & 0x7F != 0x7F {
                assert_eq!(e4m3::encode(e4m3::decode(b)), b, "{b:#x}");
            }
        }
    }

    #[test]
    fn hadamard_is_its_own_inverse_and_keeps_the_norm() {
        let g0: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut g = g0.clone();
        hadamard(&mut g);
        let n0: f32 = g0.iter().map(|x| x * x).sum();
        let n1: f32 = g.iter().map(|x| x * x).sum();
        assert!((n0 - n1).abs() <= 1e-4 * n0);
        hadamard(&mut g);
        for (a, b) in g.iter().zip(&g0) {
            assert!((a - b).abs() <= 1e-5, "{a} {b}");
        }
    }

    #[test]
    fn every_format_round_trips_within_its_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 7919) % 97) as f32 / 13.0 - 3.5)
            .collect();
        for f in [
            KvFormat::F32,
            KvFormat::F16,
            KvFormat::BF16,
            KvFormat::E4M3,
            KvFormat::Q8,
            KvFormat::Q4,
        ] {
            let mut bytes = vec![0u8; f.byte_at(x.len())];
            kv_encode(f, &x, &mut bytes).unwrap();
            let mut y = vec![0f32; x.len()];
            kv_decode(f, &bytes, &mut y).unwrap();
            // per value of group g: f16 |x|·2⁻¹¹, bf16 |x|·2⁻⁸, e4m3 |x|·2⁻⁴ + 2⁻¹⁰,
            // q √32·‖g‖/(2·qmax)
            for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                let g = &x[i / 32 * 32..][..32];
                let norm = g.iter().map(|v| v * v).sum::<f32>().sqrt();
                let bound = match f {
                    KvFormat::F32 => 0.0,
                    KvFormat::F16 => a.abs() / 2048.0,
                    KvFormat::BF16 => a.abs() / 256.0,
                    KvFormat::E4M3 => a.abs() / 16.0 + 1.0 / 1024.0,
                    KvFormat::Q8 => 32f32.sqrt() * norm / 254.0 * 1.01,
                    KvFormat::Q4 => 32f32.sqrt() * norm / 14.0 * 1.01,
                };
                assert!((a - b).abs() <= bound, "{} value {i}: {a} vs {b}", f.name());
            }
        }
    }

    /// f16 and bf16 rows are the `half` crate's bytes (round to nearest even), whether the
    /// cache bytes are 2-byte aligned or not, and decode to exactly those values.
    #[test]
    fn f16_and_bf16_rows_are_the_half_crate_bytes_at_any_alignment() {
        let x: Vec<f32> = (0..203)
            .map(|i| ((i * 7919) % 997) as f32 * 1.37e-3 - 0.6)
            .chain([1e-40, 6e-8, -3e38, 70000.0, 3.4e38, f32::INFINITY, f32::NAN])
            .collect();
        // each format, the half crate's encoding and decoding of one value
        type ByHalf = (KvFormat, fn(f32) -> [u8; 2], fn([u8; 2]) -> f32);
        let by_half: [ByHalf; 2] = [
            (
                KvFormat::F16,
                |v| half::f16::from_f32(v).to_le_bytes(),
                |b| half::f16::from_le_bytes(b).to_f32(),
            ),
            (
                KvFormat::BF16,
                |v| half::bf16::from_f32(v).to_le_bytes(),
                |b| half::bf16::from_le_bytes(b).to_f32(),
            ),
        ];
        for (format, encode, decode) in by_half {
            let want: Vec<u8> = x.iter().flat_map(|v| encode(*v)).collect();
            let mut buf = vec![0u8; want.len() + 1];
            for off in [0, 1] {
                let out = &mut buf[off..off + want.len()];
                kv_encode(format, &x, out).unwrap();
                assert!(out == &want[..], "{} offset {off}", format.name());
                let mut back = vec![0f32; x.len()];
                kv_decode(format, out, &mut back).unwrap();
                for (b, w) in back.iter().zip(want.chunks_exact(2)) {
                    let w = decode([w[0], w[1]]);
                    assert!(b.to_bits() == w.to_bits() || (b.is_nan() && w.is_nan()));
                }
            }
        }
    }

    #[test]
    fn partial_groups_and_wrong_lengths_are_refused() {
        let mut out = vec![0u8; 34];
        let e = kv_encode(KvFormat::Q8, &[0.0; 16], &mut out).unwrap_err();
        assert!(e.to_string().contains("whole groups of 32"), "{e}");
        let e = kv_encode(KvFormat::F16, &[0.0; 4], &mut out).unwrap_err();
        assert!(
            matches!(
                e,
                KernelError::LengthMismatch {
                    expected: 8,
                    got: 34,
                    ..
                }
            ),
            "{e}"
        );
    }
}

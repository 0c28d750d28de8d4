//! Scalar f16 / bf16 conversions, by bit manipulation (the CUDA headers do the same).

/// f16 bits to f32, exactly (subnormals, infinities and NaN payloads included).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    if exp == 0x1f {
        f32::from_bits(sign | 0x7f80_0000 | (man << 13))
    } else if exp == 0 {
        // zero or subnormal: man * 2^-24, exact in f32
        let v = man as f32 * (1.0 / 16_777_216.0);
        f32::from_bits(sign | v.to_bits())
    } else {
        f32::from_bits(sign | ((exp + 112) << 23) | (man << 13))
    }
}

/// f32 to f16 bits, rounding to nearest even (as numpy's `astype(float16)` and F16C do).
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// bf16 bits to f32, exactly.
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// f32 to bf16 bits, rounding to nearest even (as torch's `.to(torch.bfloat16)` and the `half`
/// crate do); overflow gives ±inf, and NaN stays NaN with its sign and top payload bits (the
/// quiet bit set, so a signalling NaN cannot truncate to infinity).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if b & 0x7fff_ffff > 0x7f80_0000 {
        return ((b >> 16) | 0x0040) as u16;
    }
    // adding 0x7fff plus the kept part's lowest bit rounds half to even in one carry
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Reads the little-endian u16 at `off` of `b` (callers pass whole blocks, so it is in bounds).
#[inline(always)]
pub(crate) fn rd_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

/// Reads the little-endian f16 at `off` of `b` as f32.
#[inline(always)]
pub(crate) fn rd_f16(b: &[u8], off: usize) -> f32 {
    f16_to_f32(rd_u16(b, off))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_like_the_half_crate() {
        // `half` is the reference: an independent implementation of bfloat16. Every f32 whose
        // low 16 bits sit at, beside or between the rounding points, for every upper half.
        for hi in 0..=u16::MAX {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000] {
                let x = f32::from_bits((u32::from(hi) << 16) | lo);
                let theirs = half::bf16::from_f32(x).to_bits();
                assert_eq!(f32_to_bf16(x), theirs, "{:#010x}", x.to_bits());
            }
        }
    }

    #[test]
    fn f16_round_trips_every_pattern_through_half() {
        // `half` is the reference here: an independent implementation of IEEE binary16.
        for bits in 0..=u16::MAX {
            let ours = f16_to_f32(bits);
            let theirs = half::f16::from_bits(bits).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{bits:#06x}");
            }
        }
    }
}

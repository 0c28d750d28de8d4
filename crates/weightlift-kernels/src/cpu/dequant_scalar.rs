//! Scalar per-block decoders, one per type, following the block layouts of llama.cpp's
//! `ggml-common.h`. The order of float operations is the one gguf-py's `gguf.quants` uses
//! (multiply, then add or subtract; no fused multiply-add), so results are bit-identical to it.

use super::half::{bf16_to_f32, rd_f16, rd_u16};
use crate::types::QuantType;

/// IQ4_NL's non-linear code book (`kvalues_iq4nl` in ggml-common.h).
pub const IQ4NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K block (`get_scale_min_k4`).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        let sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (sc, m)
    }
}

/// The 16 signed 6-bit scales of a Q3_K block (bytes 96..108), already offset by -32: scale
/// `i` has its low four bits in the nibbles of bytes 0..8 (low nibbles for 0..8, high for
/// 8..16) and its top two in bytes 8..12 (byte `8 + i % 4`, bits `2 · (i / 4)`), unpacked four
/// scales at a time (a few word operations, where the matvecs ran one loop a scale).
#[inline(always)]
pub(crate) fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let w = |k: usize| u32::from_le_bytes([s[4 * k], s[4 * k + 1], s[4 * k + 2], s[4 * k + 3]]);
    let (a0, a1, a2) = (w(0), w(1), w(2));
    let (low4, top2) = (0x0f0f_0f0f_u32, 0x0303_0303_u32);
    let words = [
        (a0 & low4) | ((a2 & top2) << 4),
        (a1 & low4) | (((a2 >> 2) & top2) << 4),
        ((a0 >> 4) & low4) | (((a2 >> 4) & top2) << 4),
        ((a1 >> 4) & low4) | (((a2 >> 6) & top2) << 4),
    ];
    std::array::from_fn(|i| (words[i / 4].to_le_bytes()[i % 4] as i8).wrapping_sub(32))
}

/// Decodes one block of `ty` (`blk.len() == ty.block_bytes()`) into `out`
/// (`out.len() == ty.block_size()`).
pub fn dequant_block(ty: QuantType, blk: &[u8], out: &mut [f32]) {
    match ty {
        QuantType::F32 => out[0] = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]),
        QuantType::F16 => out[0] = rd_f16(blk, 0),
        QuantType::BF16 => out[0] = bf16_to_f32(rd_u16(blk, 0)),
        QuantType::Q4_0 => {
            let d = rd_f16(blk, 0);
            let qs = &blk[2..18];
            for j in 0..16 {
                out[j] = d * ((qs[j] & 0x0f) as i32 - 8) as f32;
                out[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
            }
        }
        QuantType::Q4_1 => {
            let d = rd_f16(blk, 0);
            let m = rd_f16(blk, 2);
            let qs = &blk[4..20];
            for j in 0..16 {
                out[j] = d * (qs[j] & 0x0f) as f32 + m;
                out[j + 16] = d * (qs[j] >> 4) as f32 + m;
            }
        }
        QuantType::Q5_0 => {
            let d = rd_f16(blk, 0);
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            let qs = &blk[6..22];
            for j in 0..16 {
                let lo = (qs[j] & 0x0f) as u32 | (((qh >> j) & 1) << 4);
                let hi = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
                out[j] = d * (lo as i32 - 16) as f32;
                out[j + 16] = d * (hi as i32 - 16) as f32;
            }
        }
        QuantType::Q5_1 => {
            let d = rd_f16(blk, 0);
            let m = rd_f16(blk, 2);
            let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
            let qs = &blk[8..24];
            for j in 0..16 {
                let lo = (qs[j] & 0x0f) as u32 | (((qh >> j) & 1) << 4);
                let hi = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
                out[j] = d * lo as f32 + m;
                out[j + 16] = d * hi as f32 + m;
            }
        }
        QuantType::Q8_0 => {
            let d = rd_f16(blk, 0);
            for j in 0..32 {
                out[j] = (blk[2 + j] as i8) as f32 * d;
            }
        }
        QuantType::IQ4_NL => {
            let d = rd_f16(blk, 0);
            let qs = &blk[2..18];
            for j in 0..16 {
                out[j] = d * IQ4NL_VALUES[(qs[j] & 0x0f) as usize] as f32;
                out[j + 16] = d * IQ4NL_VALUES[(qs[j] >> 4) as usize] as f32;
            }
        }
        QuantType::Q2_K => {
            // scales[16] | qs[64] | d | dmin; value 128h + 32s + l is bits 2s..2s+2 of qs[32h + l]
            let scales = &blk[0..16];
            let qs = &blk[16..80];
            let d = rd_f16(blk, 80);
            let dmin = rd_f16(blk, 82);
            for h in 0..2 {
                for sh in 0..4 {
                    let e0 = 128 * h + 32 * sh;
                    for half in 0..2 {
                        let sc = scales[e0 / 16 + half];
                        let dl = d * (sc & 0x0f) as f32;
                        let ml = dmin * (sc >> 4) as f32;
                        for l in 16 * half..16 * half + 16 {
                            let q = (qs[32 * h + l] >> (2 * sh)) & 3;
                            out[e0 + l] = dl * q as f32 - ml;
                        }
                    }
                }
            }
        }
        QuantType::Q3_K => {
            // hmask[32] | qs[64] | scales[12] | d; value e = 128h + 32s + l has its low bits in
            // qs[32h + l] >> 2s and its high bit (inverted: 0 means minus 4) in hmask[l] >> (e/32)
            let hmask = &blk[0..32];
            let qs = &blk[32..96];
            let sc = q3k_scales(&blk[96..108]);
            let d = rd_f16(blk, 108);
            for h in 0..2 {
                for sh in 0..4 {
                    let e0 = 128 * h + 32 * sh;
                    let bit = 4 * h + sh;
                    for half in 0..2 {
                        let dl = d * sc[e0 / 16 + half] as f32;
                        for l in 16 * half..16 * half + 16 {
                            let ql = ((qs[32 * h + l] >> (2 * sh)) & 3) as i32;
                            let q = ql - if (hmask[l] >> bit) & 1 == 0 { 4 } else { 0 };
                            out[e0 + l] = dl * q as f32;
                        }
                    }
                }
            }
        }
        QuantType::Q4_K => {
            // d | dmin | scales[12] | qs[128]
            let d = rd_f16(blk, 0);
            let dmin = rd_f16(blk, 2);
            let scales = &blk[4..16];
            let qs = &blk[16..144];
            for sb in 0..8 {
                let (sc, m) = scale_min_k4(sb, scales);
                let d1 = d * sc as f32;
                let m1 = dmin * m as f32;
                let (c, shift) = (sb / 2, 4 * (sb % 2));
                for l in 0..32 {
                    let q = (qs[c * 32 + l] >> shift) & 0x0f;
                    out[sb * 32 + l] = d1 * q as f32 - m1;
                }
            }
        }
        QuantType::Q5_K => {
            // d | dmin | scales[12] | qh[32] | qs[128]
            let d = rd_f16(blk, 0);
            let dmin = rd_f16(blk, 2);
            let scales = &blk[4..16];
            let qh = &blk[16..48];
            let qs = &blk[48..176];
            for sb in 0..8 {
                let (sc, m) = scale_min_k4(sb, scales);
                let d1 = d * sc as f32;
                let m1 = dmin * m as f32;
                let (c, shift) = (sb / 2, 4 * (sb % 2));
                for l in 0..32 {
                    let q = ((qs[c * 32 + l] >> shift) & 0x0f) | (((qh[l] >> sb) & 1) << 4);
                    out[sb * 32 + l] = d1 * q as f32 - m1;
                }
            }
        }
        QuantType::Q6_K => {
            // ql[128] | qh[64] | scales[16] (i8) | d
            let ql = &blk[0..128];
            let qh = &blk[128..192];
            let scales = &blk[192..208];
            let d = rd_f16(blk, 208);
            for e in 0..256 {
                let h = e / 128;
                let r = e % 128;
                let lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
                let hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
                let q = (lo | (hi << 4)) as i32 - 32;
                let dl = d * (scales[e / 16] as i8) as f32;
                out[e] = dl * q as f32;
            }
        }
    }
}

/// Decodes whole blocks: `src.len() == n * ty.block_bytes()`, `out.len() == n * ty.block_size()`.
pub fn dequant_blocks(ty: QuantType, src: &[u8], out: &mut [f32]) {
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    for (blk, o) in src.chunks_exact(bb).zip(out.chunks_exact_mut(bs)) {
        dequant_block(ty, blk, o);
    }
}

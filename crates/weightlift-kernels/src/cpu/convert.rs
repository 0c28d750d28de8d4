//! Dtype conversion to f16 and bf16, and the NaN/Inf scan used by `check_tensors`.

use rayon::prelude::*;

use super::half::{f32_to_bf16, f32_to_f16, rd_u16};
use super::{CHUNK_ELEMS, Isa, check_len};
use crate::error::Result;
use crate::types::QuantType;

pub(crate) fn f32_to_f16_seq(isa: Isa, src: &[f32], out: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 and F16C were detected at run time; lengths are equal (checked by callers).
        unsafe { super::x86::imp::f32_to_f16_avx2(src, out) };
        return;
    }
    let _ = isa;
    for (o, x) in out.iter_mut().zip(src) {
        *o = f32_to_f16(*x);
    }
}

/// f32 to f16 bit patterns, round to nearest even (overflow gives ±inf, as IEEE says).
pub fn f32_to_f16_slice(src: &[f32], out: &mut [u16]) -> Result<()> {
    f32_to_f16_slice_with(Isa::detect(), src, out)
}

/// [`f32_to_f16_slice`] with a forced instruction set.
pub fn f32_to_f16_slice_with(isa: Isa, src: &[f32], out: &mut [u16]) -> Result<()> {
    check_len("f16 output values", src.len(), out.len())?;
    src.par_chunks(CHUNK_ELEMS)
        .zip(out.par_chunks_mut(CHUNK_ELEMS))
        .for_each(|(s, o)| f32_to_f16_seq(isa, s, o));
    Ok(())
}

pub(crate) fn f32_to_bf16_seq(isa: Isa, src: &[f32], out: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 was detected at run time; lengths are equal (checked by callers).
        unsafe { super::x86::imp::f32_to_bf16_avx2(src, out) };
        return;
    }
    let _ = isa;
    for (o, x) in out.iter_mut().zip(src) {
        *o = f32_to_bf16(*x);
    }
}

/// f32 to bf16 bit patterns, round to nearest even (see [`f32_to_bf16`]: overflow gives ±inf,
/// NaN stays a quiet NaN). Every instruction set writes the same bits.
pub fn f32_to_bf16_slice(src: &[f32], out: &mut [u16]) -> Result<()> {
    f32_to_bf16_slice_with(Isa::detect(), src, out)
}

/// [`f32_to_bf16_slice`] with a forced instruction set.
pub fn f32_to_bf16_slice_with(isa: Isa, src: &[f32], out: &mut [u16]) -> Result<()> {
    check_len("bf16 output values", src.len(), out.len())?;
    src.par_chunks(CHUNK_ELEMS)
        .zip(out.par_chunks_mut(CHUNK_ELEMS))
        .for_each(|(s, o)| f32_to_bf16_seq(isa, s, o));
    Ok(())
}

/// bf16 bit patterns to f16 bit patterns (through f32, which holds every bf16 exactly).
pub fn bf16_to_f16_slice(src: &[u16], out: &mut [u16]) -> Result<()> {
    bf16_to_f16_slice_with(Isa::detect(), src, out)
}

/// [`bf16_to_f16_slice`] with a forced instruction set.
pub fn bf16_to_f16_slice_with(isa: Isa, src: &[u16], out: &mut [u16]) -> Result<()> {
    check_len("f16 output values", src.len(), out.len())?;
    // The BF16 dequantiser widens to f32 and rounds to f16 in registers.
    super::dequantize_f16_with(isa, QuantType::BF16, bytemuck::cast_slice(src), out)
}

/// f16 bit patterns to f32.
pub fn f16_to_f32_slice(src: &[u16], out: &mut [f32]) -> Result<()> {
    check_len("f32 output values", src.len(), out.len())?;
    let bytes: &[u8] = bytemuck::cast_slice(src);
    super::dequantize_f32(QuantType::F16, bytes, out)
}

/// Byte offsets of the f16 scales inside one block of `ty` (what llama.cpp's
/// `ggml_validate_row_data` checks for quantised types).
fn scale_offsets(ty: QuantType) -> &'static [usize] {
    match ty {
        QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 | QuantType::IQ4_NL => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        QuantType::Q2_K => &[80, 82],
        QuantType::Q3_K => &[108],
        QuantType::Q6_K => &[208],
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => &[],
    }
}

/// The index of the first element that is NaN or ±inf, or `None`.
///
/// For the float types it is the element itself. For quantised types it is the first element
/// of the first block whose f16 scale (or min) is NaN or ±inf: a block with finite scales
/// cannot decode to NaN (it can still overflow to inf in f32 arithmetic only for f16 scales
/// near 65504 with large multipliers, which llama.cpp does not flag either).
pub fn scan_non_finite(ty: QuantType, src: &[u8]) -> Result<Option<usize>> {
    let n = ty.blocks_in("src", src.len())?;
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    let per = (CHUNK_ELEMS / bs).max(1);
    let scan_chunk = |chunk_idx: usize, s: &[u8]| -> Option<usize> {
        let base = chunk_idx * per;
        match ty {
            QuantType::F32 => {
                // OR-reduce a flag over the chunk first (vectorises), then find the exact index.
                let bad = |c: &[u8]| {
                    (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7f80_0000) == 0x7f80_0000
                };
                if !s.chunks_exact(4).fold(false, |acc, c| acc | bad(c)) {
                    return None;
                }
                s.chunks_exact(4).position(bad).map(|i| base + i)
            }
            QuantType::F16 | QuantType::BF16 => {
                let m: u16 = if ty == QuantType::F16 { 0x7c00 } else { 0x7f80 };
                let bad = |c: &[u8]| (u16::from_le_bytes([c[0], c[1]]) & m) == m;
                if !s.chunks_exact(2).fold(false, |acc, c| acc | bad(c)) {
                    return None;
                }
                s.chunks_exact(2).position(bad).map(|i| base + i)
            }
            _ => {
                let offs = scale_offsets(ty);
                s.chunks_exact(bb)
                    .position(|blk| offs.iter().any(|o| (rd_u16(blk, *o) & 0x7c00) == 0x7c00))
                    .map(|b| (base + b) * bs)
            }
        }
    };
    if n <= per {
        return Ok(scan_chunk(0, src));
    }
    Ok(src
        .par_chunks(per * bb)
        .enumerate()
        .find_map_first(|(i, s)| scan_chunk(i, s)))
}

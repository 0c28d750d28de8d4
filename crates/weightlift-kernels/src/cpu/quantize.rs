//! Quantise-on-load: float rows to ggml block types, byte for byte as llama.cpp's reference
//! quantisers write them.
//!
//! [`quantize_rows`] turns f32 rows into Q8_0, Q4_K, Q6_K (and Q4_0, Q4_1, Q5_0, Q5_1) blocks
//! identical to what `ggml_quantize_chunk` writes without an importance matrix (the
//! `quantize_row_*_ref` functions of ggml). [`quantize_rows_from`] reads the checkpoint's own
//! little-endian f32, f16 or bf16 bytes and widens one block at a time on the stack, so a loader
//! can quantise straight from the mmap into the destination without an f32 copy of the tensor.
//!
//! Work is split into runs of whole blocks over rayon's current pool (every block is quantised
//! on its own, so rows need not be kept together). The scalar block quantisers are the
//! reference; the AVX2 and AVX-512 forms compute every value with the same float operations in
//! the same order (the K-quants' sub-block fits run side by side, one per vector lane), so every
//! [`Isa`] level writes the same bytes.
//!
//! Inputs must be finite: NaN or ±inf is refused with the index of the first bad value
//! (llama.cpp's output for such blocks depends on undefined float to integer conversions).

use rayon::prelude::*;

use super::half::{bf16_to_f32, f16_to_f32};
use super::quantize_blocks as blocks;
use super::{CHUNK_ELEMS, Isa};
use crate::error::{KernelError, Result};
use crate::types::{FloatType, QuantType};

/// The types [`quantize_rows`] writes.
pub const QUANTIZE_TYPES: [QuantType; 7] = [
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q8_0,
    QuantType::Q4_K,
    QuantType::Q6_K,
];

/// [`QUANTIZE_TYPES`] as the error messages name them.
pub const QUANTIZE_NAMES: &str = "q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q6_k";

/// Whether [`quantize_rows`] can write `ty`.
pub fn can_quantize(ty: QuantType) -> bool {
    QUANTIZE_TYPES.contains(&ty)
}

/// Bytes of one quantised row of `n_per_row` values of `ty`, or a typed error when `ty` cannot
/// be written or `n_per_row` is not a positive multiple of its block size (ggml's rule).
pub fn quantized_row_bytes(ty: QuantType, n_per_row: usize) -> Result<usize> {
    if !can_quantize(ty) {
        return Err(KernelError::Unsupported {
            op: "quantize",
            ty: ty.name().to_string(),
            supported: QUANTIZE_NAMES,
        });
    }
    let bs = ty.block_size();
    if n_per_row == 0 || !n_per_row.is_multiple_of(bs) {
        return Err(KernelError::Shape {
            op: "quantize",
            reason: format!(
                "rows of {n_per_row} values are not a positive multiple of {ty}'s {bs}-value \
                 block; this tensor cannot be stored as {ty} (choose q8_0, whose blocks are 32, \
                 or keep it in float)"
            ),
        });
    }
    Ok(n_per_row / bs * ty.block_bytes())
}

/// Where the values come from: f32 values, or a checkpoint's little-endian float bytes.
#[derive(Clone, Copy)]
enum Source<'a> {
    F32(&'a [f32]),
    Bytes(FloatType, &'a [u8]),
}

impl<'a> Source<'a> {
    fn len(self) -> usize {
        match self {
            Source::F32(s) => s.len(),
            Source::Bytes(ft, b) => b.len() / ft.size(),
        }
    }

    /// Values `start..start + n`.
    fn slice(self, start: usize, n: usize) -> Source<'a> {
        match self {
            Source::F32(s) => Source::F32(&s[start..start + n]),
            Source::Bytes(ft, b) => {
                Source::Bytes(ft, &b[start * ft.size()..(start + n) * ft.size()])
            }
        }
    }
}

/// Validates the shapes; returns the number of blocks.
fn check(ty: QuantType, n_values: usize, n_per_row: usize, dst_len: usize) -> Result<usize> {
    let row_bytes = quantized_row_bytes(ty, n_per_row)?;
    if !n_values.is_multiple_of(n_per_row) {
        return Err(KernelError::Shape {
            op: "quantize",
            reason: format!(
                "{n_values} source values are not whole rows of {n_per_row}; the tensor's shape \
                 and the row length disagree"
            ),
        });
    }
    let rows = n_values / n_per_row;
    let expected = rows
        .checked_mul(row_bytes)
        .ok_or_else(|| KernelError::Shape {
            op: "quantize",
            reason: format!("{rows} rows of {row_bytes} bytes overflow usize"),
        })?;
    if dst_len != expected {
        return Err(KernelError::LengthMismatch {
            what: "quantize destination bytes",
            expected,
            got: dst_len,
        });
    }
    Ok(n_values / ty.block_size())
}

/// The error for a non-finite source value at `index`.
fn non_finite(index: usize, value: f32) -> KernelError {
    KernelError::Unsupported {
        op: "quantize",
        ty: format!("the non-finite source value {value} at index {index}"),
        supported: "finite values only; the tensor holds NaN or inf (a corrupted checkpoint, \
                    or one saved after an overflow?)",
    }
}

/// Quantises one row (any whole number of blocks of `ty`) on the calling thread, with the best
/// instruction set. `dst` must be exactly the row's bytes.
pub fn quantize_row(ty: QuantType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    quantize_row_with(Isa::detect(), ty, src, dst)
}

/// [`quantize_row`] with a forced instruction set (every level writes the same bytes).
pub fn quantize_row_with(isa: Isa, ty: QuantType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    // the whole slice is the row (an empty one writes nothing)
    let n = src.len().max(ty.block_size());
    check(ty, src.len(), n, dst.len())?;
    quantize_run(isa, ty, Source::F32(src), dst).map_err(|(i, v)| non_finite(i, v))
}

/// Quantises `src` (whole rows of `n_per_row` values) into `dst` (exactly
/// `rows * quantized_row_bytes(ty, n_per_row)` bytes), split over rayon's current pool.
///
/// The bytes equal llama.cpp's `ggml_quantize_chunk(ty, src, dst, 0, rows, n_per_row, NULL)`.
pub fn quantize_rows(ty: QuantType, src: &[f32], n_per_row: usize, dst: &mut [u8]) -> Result<()> {
    quantize_rows_with(Isa::detect(), ty, src, n_per_row, dst)
}

/// [`quantize_rows`] with a forced instruction set.
pub fn quantize_rows_with(
    isa: Isa,
    ty: QuantType,
    src: &[f32],
    n_per_row: usize,
    dst: &mut [u8],
) -> Result<()> {
    let n_blocks = check(ty, src.len(), n_per_row, dst.len())?;
    quantize_par(isa, ty, Source::F32(src), n_blocks, dst)
}

/// [`quantize_rows`] from a checkpoint's little-endian `src_ty` bytes (f32, f16 or bf16),
/// widened to f32 one block at a time (exactly, so the bytes equal those of [`quantize_rows`] on
/// the widened values).
pub fn quantize_rows_from(
    ty: QuantType,
    src_ty: FloatType,
    src: &[u8],
    n_per_row: usize,
    dst: &mut [u8],
) -> Result<()> {
    quantize_rows_from_with(Isa::detect(), ty, src_ty, src, n_per_row, dst)
}

/// [`quantize_rows_from`] with a forced instruction set.
pub fn quantize_rows_from_with(
    isa: Isa,
    ty: QuantType,
    src_ty: FloatType,
    src: &[u8],
    n_per_row: usize,
    dst: &mut [u8],
) -> Result<()> {
    let n_blocks = check(ty, source_values(src_ty, src)?, n_per_row, dst.len())?;
    quantize_par(isa, ty, Source::Bytes(src_ty, src), n_blocks, dst)
}

/// [`quantize_rows_from`] for rows that start at value `first` of a larger tensor: a
/// non-finite value's index in the error counts from the tensor's start, as a device
/// quantising the same rows reports it ([`check_non_finite_report`]).
pub fn quantize_rows_from_at(
    ty: QuantType,
    src_ty: FloatType,
    src: &[u8],
    n_per_row: usize,
    dst: &mut [u8],
    first: usize,
) -> Result<()> {
    check_non_finite_report(quantize_rows_from_reported(
        ty, src_ty, src, n_per_row, dst, first,
    )?)
}

/// [`quantize_rows_from`], with a non-finite source value given back as its report word
/// ([`non_finite_report`], index counted from `first`) instead of an error: what a backend's
/// `quantize_rows` records for a load to check after the tensor. Shape errors are errors.
pub(crate) fn quantize_rows_from_reported(
    ty: QuantType,
    src_ty: FloatType,
    src: &[u8],
    n_per_row: usize,
    dst: &mut [u8],
    first: usize,
) -> Result<u64> {
    let n_blocks = check(ty, source_values(src_ty, src)?, n_per_row, dst.len())?;
    let src = Source::Bytes(src_ty, src);
    Ok(
        match quantize_par_found(Isa::detect(), ty, src, n_blocks, dst) {
            Ok(()) => 0,
            Err((i, v)) => non_finite_report(first.saturating_add(i), v),
        },
    )
}

/// The word that reports a non-finite source value of a quantisation whose blocks run in any
/// order (the CUDA kernels' `wl_qz_report` in `kernels/wl_quantize.cuh`): the complement of
/// `index << 2 | kind`, kind 0 for NaN, 1 for +inf and 2 for -inf, so the largest of several
/// reports names the smallest index and 0 means none.
pub fn non_finite_report(index: usize, value: f32) -> u64 {
    let kind = if value.is_nan() {
        0
    } else if value.is_sign_negative() {
        2
    } else {
        1
    };
    !(((index as u64) << 2) | kind)
}

/// The error a report word ([`non_finite_report`]) stands for: the one the CPU quantiser gives
/// for that value at that index; `Ok` for 0.
pub fn check_non_finite_report(word: u64) -> Result<()> {
    if word == 0 {
        return Ok(());
    }
    let key = !word;
    let value = match key & 3 {
        0 => f32::NAN,
        1 => f32::INFINITY,
        _ => f32::NEG_INFINITY,
    };
    Err(non_finite(
        usize::try_from(key >> 2).unwrap_or(usize::MAX),
        value,
    ))
}

/// The values of `src_ty` in `src`, or an error when its bytes are not whole values.
pub(crate) fn source_values(src_ty: FloatType, src: &[u8]) -> Result<usize> {
    let es = src_ty.size();
    if !src.len().is_multiple_of(es) {
        return Err(KernelError::RaggedBlocks {
            what: "quantize source",
            ty: float_as_quant(src_ty),
            got: src.len(),
            block_bytes: es,
        });
    }
    Ok(src.len() / es)
}

fn float_as_quant(ft: FloatType) -> QuantType {
    match ft {
        FloatType::F32 => QuantType::F32,
        FloatType::F16 => QuantType::F16,
        FloatType::BF16 => QuantType::BF16,
    }
}

/// Splits `n_blocks` blocks into runs over rayon's pool.
fn quantize_par(
    isa: Isa,
    ty: QuantType,
    src: Source<'_>,
    n_blocks: usize,
    dst: &mut [u8],
) -> Result<()> {
    quantize_par_found(isa, ty, src, n_blocks, dst).map_err(|(i, v)| non_finite(i, v))
}

/// [`quantize_par`], with a non-finite value given back as `(index, value)`.
fn quantize_par_found(
    isa: Isa,
    ty: QuantType,
    src: Source<'_>,
    n_blocks: usize,
    dst: &mut [u8],
) -> Result<(), (usize, f32)> {
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    // the K-quants cost about 50x more per value than Q8_0: smaller runs keep threads busy
    let per = if bs == 256 { 16 } else { CHUNK_ELEMS / bs };
    if n_blocks <= per {
        return quantize_run(isa, ty, src, dst);
    }
    // every run goes to its end (a bad block stops only its own run), so the error names the
    // tensor's first non-finite value whichever thread meets it first, as a device reports it
    let first_bad = dst
        .par_chunks_mut(per * bb)
        .enumerate()
        .filter_map(|(k, out)| {
            let first = k * per * bs;
            let n = out.len() / bb * bs;
            quantize_run(isa, ty, src.slice(first, n), out)
                .err()
                .map(|(i, v)| (first + i, v))
        })
        .min_by_key(|&(i, _)| i);
    first_bad.map_or(Ok(()), Err)
}

/// Quantises a run of whole blocks on this thread; `Err((index, value))` names the first
/// non-finite value of the first bad block.
fn quantize_run(
    isa: Isa,
    ty: QuantType,
    src: Source<'_>,
    dst: &mut [u8],
) -> Result<(), (usize, f32)> {
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    assert_eq!(src.len() / bs * bb, dst.len());
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = super::x86_quantize::pick(isa, ty) {
        return simd.run(src_parts(src), dst);
    }
    let _ = isa;
    let quant = scalar_block(ty);
    let mut buf = [0f32; 256];
    for (b, out) in dst.chunks_exact_mut(bb).enumerate() {
        let x: &[f32] = match src {
            Source::F32(s) => &s[b * bs..(b + 1) * bs],
            Source::Bytes(ft, bytes) => {
                widen(
                    ft,
                    &bytes[b * bs * ft.size()..(b + 1) * bs * ft.size()],
                    &mut buf[..bs],
                );
                &buf[..bs]
            }
        };
        check_finite(x).map_err(|(i, v)| (b * bs + i, v))?;
        quant(x, out);
    }
    Ok(())
}

/// The source as the SIMD forms take it: f32 values, or bytes with their type.
#[cfg(target_arch = "x86_64")]
fn src_parts(src: Source<'_>) -> super::x86_quantize::Src<'_> {
    match src {
        Source::F32(s) => super::x86_quantize::Src::F32(s),
        Source::Bytes(ft, b) => super::x86_quantize::Src::Bytes(ft, b),
    }
}

/// The scalar quantiser of one block of `ty` (a quantisable type).
pub(crate) fn scalar_block(ty: QuantType) -> fn(&[f32], &mut [u8]) {
    match ty {
        QuantType::Q4_0 => blocks::q4_0,
        QuantType::Q4_1 => blocks::q4_1,
        QuantType::Q5_0 => blocks::q5_0,
        QuantType::Q5_1 => blocks::q5_1,
        QuantType::Q8_0 => blocks::q8_0,
        QuantType::Q4_K => blocks::q4_k,
        QuantType::Q6_K => blocks::q6_k,
        _ => unreachable!("checked by quantized_row_bytes"),
    }
}

/// Widens little-endian `ft` bytes into `out` (exact).
pub(crate) fn widen(ft: FloatType, bytes: &[u8], out: &mut [f32]) {
    match ft {
        FloatType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        FloatType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        FloatType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
    }
}

/// `Err((index, value))` of the first NaN or ±inf in `x`.
#[inline]
pub(crate) fn check_finite(x: &[f32]) -> Result<(), (usize, f32)> {
    // an OR over the exponent test vectorises; the position is looked for only on failure
    let bad = |v: &f32| (v.to_bits() & 0x7f80_0000) == 0x7f80_0000;
    if !x.iter().fold(false, |acc, v| acc | bad(v)) {
        return Ok(());
    }
    let i = x.iter().position(bad).unwrap_or(0);
    Err((i, x[i]))
}

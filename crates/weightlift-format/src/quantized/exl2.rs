//! EXL2 linears, as exllamav2's converter (`AdaptiveGPTQ.pack`) writes them:
//!
//! - `q_weight` int32 `[qrows, columns]`: the inputs in a permuted order, cut into groups; each
//!   group's codes run as a little-endian bit stream down every column (`pack_columns`), and
//!   the group starts on a fresh word row. `columns` is the output count padded to 32.
//! - `q_groups` int16 `[2 * groups]`: (bits, first word row) of each group, widths in the
//!   descending order exllamav2's kernels walk them (8, 6, 5, 4, 3, 2). A group's input count is
//!   its word rows times 32 / bits; the last group takes the inputs that are left.
//! - `q_scale` int32 `[groups, columns / 8]`: a 4-bit scale code per group and output, eight to a
//!   word (`pack_rows_4`, which stores the code minus 1).
//! - `q_scale_max` f16 `[groups]`, `q_invperm` int32 `[in]` (the stored row of each input), and
//!   optionally `q_perm` (its inverse; exllamav2's loader recomputes it) and `bias`.
//!
//! A weight is `f16(q - 2^(bits-1)) * scale` with `scale = f16((code + 1)^2) *
//! f16(q_scale_max / 256)`, every product rounded to f16 (exllamav2's `dq_scale`, `dq_ns` and
//! `__hmul2`; its quantiser rounds the same way), so EXL2 weights are f16 values.

use std::ops::Range;
use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::packed::{Words, float_at, i32_values, words_for};
use super::part::{Part, expect_dtype, expect_shape, lookup};
use super::{Element, for_each_row};
use crate::error::hint;
use crate::{Checkpoint, DType, FormatError, Result};

/// The code widths exllamav2 writes (and its kernels decode).
pub const EXL2_BITS: [u32; 6] = [8, 6, 5, 4, 3, 2];

/// One run of inputs quantised with one width and one scale per output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exl2Group {
    pub bits: u32,
    /// First stored (permuted) input row of the group.
    pub first_row: usize,
    pub rows: usize,
    /// First word row of the group in `q_weight`.
    pub first_qrow: usize,
}

/// The EXL2 tensors and layout of one linear, checked at open time.
#[derive(Debug, Clone, PartialEq)]
pub struct Exl2Linear {
    groups: Vec<Exl2Group>,
    /// Stored row of each input (`q_invperm`), checked to be a permutation.
    invperm: Arc<[u32]>,
    columns: usize,
    q_weight: String,
    q_invperm: String,
    q_scale: String,
    q_scale_max: String,
    q_groups: String,
    q_perm: Option<String>,
}

impl Exl2Linear {
    pub fn groups(&self) -> &[Exl2Group] {
        &self.groups
    }

    /// Columns of `q_weight`: the outputs padded to a multiple of 32.
    pub fn stored_columns(&self) -> usize {
        self.columns
    }

    pub fn q_weight(&self) -> &str {
        &self.q_weight
    }

    pub fn q_scale(&self) -> &str {
        &self.q_scale
    }

    pub fn q_scale_max(&self) -> &str {
        &self.q_scale_max
    }

    /// Word rows of `q_weight`: where the last group ends.
    fn qrows(&self) -> usize {
        self.groups
            .last()
            .map_or(0, |g| g.first_qrow + words_for(g.rows, g.bits).unwrap_or(0))
    }

    pub(super) fn tensor_names(&self) -> impl Iterator<Item = &str> {
        [
            &self.q_weight,
            &self.q_invperm,
            &self.q_scale,
            &self.q_scale_max,
            &self.q_groups,
        ]
        .into_iter()
        .map(String::as_str)
        .chain(self.q_perm.as_deref())
    }
}

/// The stored bytes of the three tensors an EXL2 weight is decoded from, wherever they are held
/// (the permutation and the groups were read when the checkpoint opened).
#[derive(Debug, Clone, Copy)]
pub struct Exl2Bytes<'a> {
    pub q_weight: &'a [u8],
    pub q_scale: &'a [u8],
    pub q_scale_max: &'a [u8],
}

const WORDS: &[DType] = &[DType::I32, DType::U32];
const SHORTS: &[DType] = &[DType::I16, DType::U16];

/// Check one linear's tensors; `expect` is (in, out) from the model's architecture where the
/// role is known, `bias_len` the length of its bias. Returns the linear and its (in, out).
pub(super) fn validate(
    ckpt: &Checkpoint,
    prefix: &str,
    expect: Option<(usize, usize)>,
    bias_len: Option<usize>,
) -> Result<(Exl2Linear, usize, usize)> {
    let q_weight = lookup(ckpt, prefix, "q_weight")?;
    let q_invperm = lookup(ckpt, prefix, "q_invperm")?;
    let q_scale = lookup(ckpt, prefix, "q_scale")?;
    let q_scale_max = lookup(ckpt, prefix, "q_scale_max")?;
    let q_groups = lookup(ckpt, prefix, "q_groups")?;
    let q_perm = ckpt
        .tensor(&format!("{prefix}.q_perm"))
        .ok()
        .map(|t| Part::new(ckpt, t));

    expect_dtype(&q_weight, WORDS)?;
    let [qrows, columns] = q_weight.matrix()?;
    expect_dtype(&q_invperm, &[DType::I32])?;
    let n_in = q_invperm.vector()?;
    if n_in == 0 || columns == 0 || columns % 8 != 0 {
        return Err(q_weight.invalid(
            "at least one input, and columns in whole words of 4-bit scales (a multiple of 8; exllamav2 pads to 32)".into(),
            format!("{n_in} inputs and {columns} columns"),
            hint::QUANT_TENSORS,
        ));
    }
    let n_out = out_features(&q_weight, columns, expect.map(|e| e.1), bias_len)?;
    if let Some((e_in, _)) = expect
        && e_in != n_in
    {
        return Err(q_invperm.invalid(
            format!("{e_in} inputs, as config.json's architecture gives this projection"),
            format!("{n_in} inputs"),
            hint::QUANT_CONFIG,
        ));
    }

    expect_dtype(&q_groups, SHORTS)?;
    let pairs = q_groups.vector()?;
    if pairs == 0 || pairs % 2 != 0 || pairs / 2 > n_in {
        return Err(q_groups.invalid(
            format!("(bits, first row) pairs for 1 to {n_in} groups"),
            format!("{pairs} values"),
            hint::QUANT_TENSORS,
        ));
    }
    let raw: Vec<usize> = q_groups
        .bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
        .collect();
    let groups = groups(&q_groups, &raw, n_in, qrows)?;
    let n_groups = groups.len();

    expect_dtype(&q_scale, WORDS)?;
    expect_shape(&q_scale, &[n_groups, columns / 8], || {
        format!("{n_groups} groups, {columns} columns of 4-bit scale codes")
    })?;
    expect_dtype(&q_scale_max, &[DType::F16])?;
    expect_shape(&q_scale_max, &[n_groups], || format!("{n_groups} groups"))?;

    let mut seen = vec![false; n_in];
    let mut invperm = Vec::with_capacity(n_in);
    for (i, v) in i32_values(q_invperm.bytes).enumerate() {
        let row = usize::try_from(v).ok().filter(|&r| r < n_in);
        let Some(row) = row.filter(|&r| !std::mem::replace(&mut seen[r], true)) else {
            return Err(q_invperm.invalid(
                format!("a permutation of 0..{n_in}"),
                format!("{v} at input {i} (out of range or repeated)"),
                hint::QUANT_TENSORS,
            ));
        };
        invperm.push(row as u32);
    }
    if let Some(p) = &q_perm {
        expect_dtype(p, &[DType::I32])?;
        expect_shape(p, &[n_in], || "one entry per input".into())?;
        for (j, v) in i32_values(p.bytes).enumerate() {
            let back = usize::try_from(v).ok().and_then(|i| invperm.get(i));
            if back.is_none_or(|&r| r as usize != j) {
                return Err(p.invalid(
                    "the inverse of q_invperm".into(),
                    format!("{v} at stored row {j}"),
                    hint::QUANT_TENSORS,
                ));
            }
        }
    }
    let linear = Exl2Linear {
        groups,
        invperm: invperm.into(),
        columns,
        q_weight: q_weight.info.name.clone(),
        q_invperm: q_invperm.info.name.clone(),
        q_scale: q_scale.info.name.clone(),
        q_scale_max: q_scale_max.info.name.clone(),
        q_groups: q_groups.info.name.clone(),
        q_perm: q_perm.map(|p| p.info.name.clone()),
    };
    Ok((linear, n_in, n_out))
}

/// The real output count: the bias length or the architecture's, which the stored columns pad
/// to a multiple of 32; the stored columns when neither is known.
fn out_features(
    q_weight: &Part<'_>,
    columns: usize,
    expected: Option<usize>,
    bias_len: Option<usize>,
) -> Result<usize> {
    let fits = |n: usize| n == columns || (n > 0 && n.next_multiple_of(32) == columns);
    for (n, whose) in [
        (bias_len, "its bias"),
        (expected, "config.json's architecture"),
    ] {
        if let Some(n) = n
            && !fits(n)
        {
            return Err(q_weight.invalid(
                format!("{n} outputs (from {whose}), padded to a multiple of 32 columns"),
                format!("{columns} columns"),
                hint::QUANT_CONFIG,
            ));
        }
    }
    match (bias_len, expected) {
        (Some(b), Some(e)) if b != e => Err(q_weight.invalid(
            format!("{e} outputs, as config.json's architecture gives this projection"),
            format!("a bias of {b}"),
            hint::QUANT_CONFIG,
        )),
        (Some(n), _) | (None, Some(n)) => Ok(n),
        (None, None) => Ok(columns),
    }
}

/// Decode and check `q_groups`: widths exllamav2 writes, in its descending order, word rows
/// that start at 0 and rise, and input counts that add up to `n_in`.
fn groups(part: &Part<'_>, raw: &[usize], n_in: usize, qrows: usize) -> Result<Vec<Exl2Group>> {
    let n = raw.len() / 2;
    let mut out: Vec<Exl2Group> = Vec::with_capacity(n);
    let mut first_row = 0usize;
    for g in 0..n {
        let (bits, first_qrow) = (raw[2 * g], raw[2 * g + 1]);
        let bad = |expected: String, got: String| {
            Err(part.invalid(expected, format!("{got} in group {g}"), hint::QUANT_TENSORS))
        };
        let Some(bits) = EXL2_BITS.iter().copied().find(|&b| b as usize == bits) else {
            return bad(
                "widths of 2, 3, 4, 5, 6 or 8 bits".into(),
                format!("{bits} bits"),
            );
        };
        if let Some(prev) = out.last()
            && bits > prev.bits
        {
            return bad(
                "widths in descending order, the order exllamav2's kernels decode them in".into(),
                format!("{bits} bits after {} bits", prev.bits),
            );
        }
        let end_qrow = if g + 1 < n { raw[2 * g + 3] } else { qrows };
        let expected_start = out
            .last()
            .map_or(0, |p| p.first_qrow + words_for(p.rows, p.bits).unwrap_or(0));
        if first_qrow != expected_start || end_qrow <= first_qrow || end_qrow > qrows {
            return bad(
                format!("a group starting at word row {expected_start} and ending by row {qrows}"),
                format!("word rows {first_qrow}..{end_qrow}"),
            );
        }
        let span = end_qrow - first_qrow;
        let rows = if g + 1 < n {
            if (span * 32) % bits as usize != 0 {
                return bad(
                    format!("a whole number of {bits}-bit inputs in its word rows"),
                    format!("{span} word rows"),
                );
            }
            span * 32 / bits as usize
        } else {
            n_in.saturating_sub(first_row)
        };
        if rows == 0 || first_row + rows > n_in || words_for(rows, bits) != Some(span) {
            return bad(
                format!("inputs that add up to {n_in} (from q_invperm)"),
                format!("{rows} inputs from input {first_row} in {span} word rows"),
            );
        }
        out.push(Exl2Group {
            bits,
            first_row,
            rows,
            first_qrow,
        });
        first_row += rows;
    }
    Ok(out)
}

/// Rows `rows` (outputs) and columns `cols` (inputs) of the weight into `out`, row-major, from
/// the checkpoint's tensors. The ranges and `out` were checked by the caller.
pub(super) fn dequantize<T: Element>(
    ckpt: &Checkpoint,
    lin: &Exl2Linear,
    n_in: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &mut [T],
) -> Result<()> {
    let n_groups = lin.groups.len();
    let q_weight = Part::sized(ckpt, &lin.q_weight, WORDS, &[lin.qrows(), lin.columns])?;
    let q_scale = Part::sized(ckpt, &lin.q_scale, WORDS, &[n_groups, lin.columns / 8])?;
    let q_scale_max = Part::sized(ckpt, &lin.q_scale_max, &[DType::F16], &[n_groups])?;
    let bytes = Exl2Bytes {
        q_weight: q_weight.bytes,
        q_scale: q_scale.bytes,
        q_scale_max: q_scale_max.bytes,
    };
    dequantize_bytes(lin, bytes, n_in, rows, cols, out)
}

/// As [`dequantize`], from the tensors' bytes: each must be the size the linear opened with.
pub(super) fn dequantize_bytes<T: Element>(
    lin: &Exl2Linear,
    b: Exl2Bytes<'_>,
    n_in: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &mut [T],
) -> Result<()> {
    let n_groups = lin.groups.len();
    let sizes = [
        (&lin.q_weight, b.q_weight, lin.qrows() * lin.columns * 4),
        (&lin.q_scale, b.q_scale, n_groups * (lin.columns / 8) * 4),
        (&lin.q_scale_max, b.q_scale_max, n_groups * 2),
    ];
    for (name, bytes, want) in sizes {
        if bytes.len() != want {
            return Err(FormatError::Request {
                what: format!("EXL2 tensor '{name}'"),
                expected: format!("{want} bytes, the size it was opened with"),
                got: format!("{} bytes; it was loaded for another layout", bytes.len()),
            });
        }
    }
    if lin.invperm.len() != n_in {
        return Err(FormatError::Request {
            what: format!("quantised linear with '{}'", lin.q_weight),
            expected: format!("{n_in} inputs"),
            got: format!("a permutation of {}", lin.invperm.len()),
        });
    }
    let q = Words::new(b.q_weight, lin.columns);
    let sc = Words::new(b.q_scale, lin.columns / 8);
    // The loader divides q_scale_max by 256 in f16 (exact but for f16 subnormals).
    let max_scale: Vec<f32> = (0..n_groups)
        .map(|g| f16::from_f32(float_at(b.q_scale_max, DType::F16, g) / 256.0).to_f32())
        .collect();
    for_each_row(
        out,
        rows,
        cols.len(),
        || (vec![0f32; n_in], vec![f16::ZERO; n_in]),
        |(wide, narrow): &mut (Vec<f32>, Vec<f16>), o, dst: &mut [T]| {
            let parts = (&q, &sc, max_scale.as_slice());
            dequantize_row(lin, parts, o, cols.clone(), dst, (wide, narrow));
        },
    );
    Ok(())
}

/// Output row `o`, inputs `cols`, into `dst`. The stored row's products
/// `f16(q - 2^(bits-1)) * scale` are each exact in f32 (an integer of at most 8 bits times an
/// f16); they are rounded to f16 together (`narrow`), as exllamav2's `__hmul2` rounds each,
/// and widened back into `wide`. That gives the same bits as one conversion each way per
/// weight, in a fraction of the time: the slice conversions take eight values an instruction
/// where the CPU has F16C. The inputs are then read through the permutation.
fn dequantize_row<T: Element>(
    lin: &Exl2Linear,
    (q, sc, max_scale): (&Words<'_>, &Words<'_>, &[f32]),
    o: usize,
    cols: Range<usize>,
    dst: &mut [T],
    (wide, narrow): (&mut [f32], &mut [f16]),
) {
    for (g, grp) in lin.groups.iter().enumerate() {
        let code = (sc.at(g, o / 8) >> (4 * (o % 8))) & 0xf;
        let square = ((code + 1) * (code + 1)) as f32;
        let scale = f16::from_f32(square * max_scale[g]).to_f32();
        let run = &mut wide[grp.first_row..grp.first_row + grp.rows];
        let at = (q, o, grp.first_qrow);
        match grp.bits {
            2 => products::<2>(at, scale, run),
            3 => products::<3>(at, scale, run),
            4 => products::<4>(at, scale, run),
            5 => products::<5>(at, scale, run),
            6 => products::<6>(at, scale, run),
            _ => products::<8>(at, scale, run),
        }
    }
    narrow.convert_from_f32_slice(wide);
    narrow.convert_to_f32_slice(wide);
    // f16 values widen exactly, so `from_f32` gives back the f16 for an f16 output.
    for (d, &i) in dst.iter_mut().zip(&lin.invperm[cols]) {
        *d = T::from_f32(wide[i as usize]);
    }
}

/// One group's products for output `o`, unrounded: `(q - 2^(BITS-1)) * scale` for each of
/// its `BITS`-bit codes down column `o` of `q_weight` from word row `first_qrow` (the layout
/// [`Words::code_down`] reads a code at a time). Every 32 codes fill `BITS` whole words, so
/// they are decoded from those words with shifts known at compile time; the rest (a group of
/// 3, 5 or 6 bits may end inside a run of 32) go through a bit buffer each word enters once.
#[inline]
fn products<const BITS: u32>(
    (q, o, first_qrow): (&Words<'_>, usize, usize),
    scale: f32,
    run: &mut [f32],
) {
    let zero = 1i32 << (BITS - 1);
    let mask = (1u64 << BITS) - 1;
    let product = |v: u64| ((v & mask) as i32 - zero) as f32 * scale;
    let mut row = first_qrow;
    let (chunks, rest) = run.as_chunks_mut::<32>();
    for chunk in chunks {
        let mut words = [0u64; 9];
        for (k, w) in words[..BITS as usize].iter_mut().enumerate() {
            *w = u64::from(q.at(row + k, o));
        }
        row += BITS as usize;
        for (n, d) in chunk.iter_mut().enumerate() {
            let bit = n * BITS as usize;
            let (k, shift) = (bit / 32, bit % 32);
            // the code's high bits come from the next word when it straddles two
            let pair = words[k] | (words[k + 1] << 32);
            *d = product(pair >> shift);
        }
    }
    let (mut buffer, mut have) = (0u64, 0u32);
    for d in rest {
        if have < BITS {
            buffer |= u64::from(q.at(row, o)) << have;
            have += 32;
            row += 1;
        }
        *d = product(buffer);
        buffer >>= BITS;
        have -= BITS;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The word-at-a-time decoder reads the codes [`Words::code_down`] reads one at a time
    /// (whose layout the packing tests check bit by bit), for every width, in whole runs of 32
    /// codes and in the rest after them, from a group that starts below the first word row.
    #[test]
    fn products_decode_the_codes_code_down_reads() {
        let (columns, first_qrow, n) = (3usize, 2usize, 32 * 2 + 13);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let bytes: Vec<u8> = (0..(first_qrow + 8 * 3) * columns)
            .flat_map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state as u32).to_le_bytes()
            })
            .collect();
        let q = Words::new(&bytes, columns);
        let scale = f16::from_f32(0.0123).to_f32();
        for bits in EXL2_BITS {
            for o in 0..columns {
                let mut got = vec![f32::NAN; n];
                let at = (&q, o, first_qrow);
                match bits {
                    2 => products::<2>(at, scale, &mut got),
                    3 => products::<3>(at, scale, &mut got),
                    4 => products::<4>(at, scale, &mut got),
                    5 => products::<5>(at, scale, &mut got),
                    6 => products::<6>(at, scale, &mut got),
                    _ => products::<8>(at, scale, &mut got),
                }
                let zero = 1i32 << (bits - 1);
                for (k, g) in got.iter().enumerate() {
                    let v = q.code_down(o, first_qrow, k, bits) as i32;
                    let want = (v - zero) as f32 * scale;
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "{bits} bits, column {o}, code {k}"
                    );
                }
            }
        }
    }
}

//! GPTQ linears: `qweight` int32 `[ceil(in * bits / 32), out]` (codes packed down each column,
//! along the inputs), `qzeros` int32 `[n_groups, ceil(out * bits / 32)]` (zero points packed
//! along each row, across the outputs), `scales` `[n_groups, out]`, `g_idx` int32 `[in]` (the
//! group of each input) and an optional `bias`, as auto-gptq's and gptqmodel's `QuantLinear`
//! store them. The weight is `W[o, i] = (q[i, o] - z[g, o]) * s[g, o]` with `g = g_idx[i]`, in
//! f32 as gptqmodel's dequantiser computes it; v1 checkpoints store `z - 1`.

use std::ops::Range;
use std::sync::Arc;

use super::config::{GptqConfig, GptqFormat};
use super::packed::{Words, float_at, i32_values, mask, words_for};
use super::part::{Part, expect_dtype, expect_shape, lookup};
use super::{Element, for_each_row};
use crate::error::hint;
use crate::{Checkpoint, DType, FormatError, Result};

/// The group of each input.
#[derive(Debug, Clone, PartialEq)]
enum GroupIndex {
    /// `i / group_size`: no `g_idx`, or one that says just that.
    Sequential(usize),
    /// Act-order: a table read (and range-checked) at open time.
    Table(Arc<[u32]>),
}

impl GroupIndex {
    #[inline]
    fn of(&self, i: usize) -> usize {
        match self {
            GroupIndex::Sequential(gs) => i / gs,
            GroupIndex::Table(t) => t.get(i).map_or(0, |&g| g as usize),
        }
    }
}

/// The GPTQ tensors and layout of one linear, checked against the config at open time.
#[derive(Debug, Clone, PartialEq)]
pub struct GptqLinear {
    bits: u32,
    format: GptqFormat,
    group_size: usize,
    n_groups: usize,
    groups: GroupIndex,
    qweight: String,
    qzeros: String,
    scales: String,
    g_idx: Option<String>,
}

impl GptqLinear {
    pub fn bits(&self) -> u32 {
        self.bits
    }

    pub fn format(&self) -> GptqFormat {
        self.format
    }

    /// Inputs per group (`in_features` for `group_size: -1`).
    pub fn group_size(&self) -> usize {
        self.group_size
    }

    pub fn n_groups(&self) -> usize {
        self.n_groups
    }

    /// The group of input `i` (from `g_idx`, or `i / group_size` without one).
    pub fn group_of(&self, i: usize) -> usize {
        self.groups.of(i)
    }

    /// Whether `g_idx` reorders the groups (act-order), so that a group's inputs are not a
    /// contiguous range.
    pub fn act_order(&self) -> bool {
        matches!(self.groups, GroupIndex::Table(_))
    }

    pub fn qweight(&self) -> &str {
        &self.qweight
    }

    pub fn qzeros(&self) -> &str {
        &self.qzeros
    }

    pub fn scales(&self) -> &str {
        &self.scales
    }

    pub fn g_idx(&self) -> Option<&str> {
        self.g_idx.as_deref()
    }

    pub(super) fn tensor_names(&self) -> impl Iterator<Item = &str> {
        [&self.qweight, &self.qzeros, &self.scales]
            .into_iter()
            .map(String::as_str)
            .chain(self.g_idx.as_deref())
    }
}

const FLOATS: &[DType] = &[DType::F16, DType::BF16, DType::F32];
const WORDS: &[DType] = &[DType::I32, DType::U32];

/// Check one linear's tensors against the config; `expect` is (in, out) from the model's
/// architecture where the role is known. Returns the linear and its (in, out) features.
pub(super) fn validate(
    ckpt: &Checkpoint,
    cfg: &GptqConfig,
    prefix: &str,
    expect: Option<(usize, usize)>,
) -> Result<(GptqLinear, usize, usize)> {
    let bits = cfg.bits;
    let qweight = lookup(ckpt, prefix, "qweight")?;
    let qzeros = lookup(ckpt, prefix, "qzeros")?;
    let scales = lookup(ckpt, prefix, "scales")?;
    let g_idx = match ckpt.tensor(&format!("{prefix}.g_idx")) {
        Ok(t) => Some(Part::new(ckpt, t)),
        Err(_) => None,
    };
    expect_dtype(&qweight, WORDS)?;
    let [packed_rows, out] = qweight.matrix()?;
    let n_in = match &g_idx {
        Some(g) => {
            expect_dtype(g, &[DType::I32])?;
            g.vector()?
        }
        None if (packed_rows * 32) % bits as usize == 0 => packed_rows * 32 / bits as usize,
        None => {
            return Err(qweight.invalid(
                format!("a row count that is a whole number of {bits}-bit codes times 32 / {bits}"),
                format!("{packed_rows} rows"),
                hint::QUANT_CONFIG,
            ));
        }
    };
    if n_in == 0 || out == 0 {
        return Err(qweight.invalid(
            "at least one input and one output".into(),
            format!("{n_in} inputs and {out} outputs"),
            hint::QUANT_TENSORS,
        ));
    }
    if let Some((e_in, e_out)) = expect
        && (e_in, e_out) != (n_in, out)
    {
        return Err(qweight.invalid(
            format!("{e_in} inputs and {e_out} outputs, as config.json's architecture gives this projection"),
            format!("{n_in} inputs and {out} outputs at {bits} bits"),
            hint::QUANT_CONFIG,
        ));
    }
    let want_rows = words_for(n_in, bits).unwrap_or(usize::MAX);
    expect_shape(&qweight, &[want_rows, out], || {
        format!("{n_in} inputs at {bits} bits")
    })?;

    let group_size = cfg.group_size.map_or(n_in, |g| g as usize);
    let n_groups = n_in.div_ceil(group_size);
    expect_dtype(&scales, FLOATS)?;
    expect_shape(&scales, &[n_groups, out], || {
        format!("{group_size} inputs per group, {n_groups} in all")
    })?;
    expect_dtype(&qzeros, WORDS)?;
    let zero_words = words_for(out, bits).unwrap_or(usize::MAX);
    expect_shape(&qzeros, &[n_groups, zero_words], || {
        format!("{n_groups} in all, {out} outputs at {bits} bits")
    })?;

    let groups = match &g_idx {
        None if cfg.desc_act => {
            return Err(FormatError::Invalid {
                path: qweight.path(),
                what: format!("tensor '{prefix}.g_idx'"),
                expected: "a g_idx tensor, since desc_act is true and the group of each input is only in it".into(),
                got: "no such tensor".into(),
                hint: hint::QUANT_TENSORS,
            });
        }
        None => GroupIndex::Sequential(group_size),
        Some(g) => {
            let mut table = Vec::with_capacity(n_in);
            let mut sequential = true;
            for (i, v) in i32_values(g.bytes).enumerate() {
                let Some(v) = u32::try_from(v).ok().filter(|&v| (v as usize) < n_groups) else {
                    return Err(g.invalid(
                        format!("group numbers in 0..{n_groups}"),
                        format!("{v} at input {i}"),
                        hint::QUANT_TENSORS,
                    ));
                };
                sequential &= v as usize == i / group_size;
                table.push(v);
            }
            if sequential {
                GroupIndex::Sequential(group_size)
            } else {
                GroupIndex::Table(table.into())
            }
        }
    };
    let linear = GptqLinear {
        bits,
        format: cfg.format,
        group_size,
        n_groups,
        groups,
        qweight: qweight.info.name.clone(),
        qzeros: qzeros.info.name.clone(),
        scales: scales.info.name.clone(),
        g_idx: g_idx.map(|g| g.info.name.clone()),
    };
    Ok((linear, n_in, out))
}

/// Rows `rows` (outputs) and columns `cols` (inputs) of the weight into `out`, row-major.
/// The ranges and `out` were checked by the caller.
pub(super) fn dequantize<T: Element>(
    ckpt: &Checkpoint,
    lin: &GptqLinear,
    dims: (usize, usize),
    rows: Range<usize>,
    cols: Range<usize>,
    out: &mut [T],
) -> Result<()> {
    let (n_in, n_out) = dims;
    let bits = lin.bits;
    let zero_words = words_for(n_out, bits).unwrap_or(usize::MAX);
    let packed_rows = words_for(n_in, bits).unwrap_or(usize::MAX);
    let qweight = Part::sized(ckpt, &lin.qweight, WORDS, &[packed_rows, n_out])?;
    let qzeros = Part::sized(ckpt, &lin.qzeros, WORDS, &[lin.n_groups, zero_words])?;
    let scales = Part::sized(ckpt, &lin.scales, FLOATS, &[lin.n_groups, n_out])?;
    let q = Words::new(qweight.bytes, n_out);
    let z = Words::new(qzeros.bytes, zero_words);
    let (s_bytes, s_dtype) = (scales.bytes, scales.info.dtype);
    let add = match lin.format {
        GptqFormat::V1 => 1,
        GptqFormat::V2 => 0,
    };
    let n_groups = lin.n_groups;
    for_each_row(
        out,
        rows,
        cols.len(),
        || (Vec::with_capacity(n_groups), Vec::with_capacity(n_groups)),
        |(zs, ss): &mut (Vec<f32>, Vec<f32>), o, dst: &mut [T]| {
            zs.clear();
            ss.clear();
            for g in 0..n_groups {
                let zero = z.code_along(g, o, bits).wrapping_add(add) & mask(bits);
                zs.push(zero as f32);
                ss.push(float_at(s_bytes, s_dtype, g * n_out + o));
            }
            for (d, i) in dst.iter_mut().zip(cols.clone()) {
                let g = lin.groups.of(i);
                let code = q.code_down(o, 0, i, bits) as f32;
                // (q - z) is exact in f32; one rounding for the product, as gptqmodel.
                *d = T::from_f32((code - zs[g]) * ss[g]);
            }
        },
    );
    Ok(())
}

//! GPTQ linears (auto-gptq / gptqmodel safetensors) on the host path: four held tensors
//! (`qweight`, `qzeros`, `scales`, and `g_idx`, whose validated table the format crate already
//! read), dequantised a row at a time to `W[o, i] = (q[i, o] − z[g, o]) · s[g, o]` with
//! gptqmodel's arithmetic for the packed product.

use weightlift_format::quantized::{GptqFormat, LinearScheme};
use weightlift_format::{DType, QuantizedLinear, TensorInfo};

use super::{DequantRows, PartBytes, packed_product};
use crate::error::{Result, invalid};

/// The group of each input of a GPTQ linear.
#[derive(Debug)]
enum Groups {
    /// `i / group_size`.
    Contiguous(usize),
    /// Act-order (`desc_act`): the `g_idx` table, range-checked when the checkpoint opened.
    Table(Box<[u32]>),
}

/// A GPTQ linear as the forward pass reads it: its layout, and the held tensors that hold it.
#[derive(Debug)]
pub(crate) struct Gptq {
    bits: u32,
    /// Added to each stored zero point: 1 for v1 checkpoints, which store `z − 1`.
    zero_add: u32,
    n_groups: usize,
    groups: Groups,
    /// Indices of the held `qweight`, `qzeros` and `scales`.
    qweight: usize,
    qzeros: usize,
    scales: usize,
}

/// A GPTQ linear's held bytes, checked against its layout.
pub(crate) struct GptqBytes<'a> {
    qweight: &'a [u8],
    qzeros: &'a [u8],
    scales: &'a [u8],
    scales_dtype: DType,
}

/// Words of `n` codes of `bits` bits.
fn words_for(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(32)
}

/// Little-endian word `i` of `bytes` (0 past the end: the lengths are checked before any read).
#[inline]
fn word(bytes: &[u8], i: usize) -> u32 {
    bytes
        .get(i * 4..i * 4 + 4)
        .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

#[inline]
fn scale_at(bytes: &[u8], dtype: DType, i: usize) -> f32 {
    let two = |b: &[u8]| [b[0], b[1]];
    match dtype {
        DType::F32 => bytes
            .get(i * 4..i * 4 + 4)
            .map_or(0.0, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::BF16 => bytes
            .get(i * 2..i * 2 + 2)
            .map_or(0.0, |b| half::bf16::from_le_bytes(two(b)).to_f32()),
        _ => bytes
            .get(i * 2..i * 2 + 2)
            .map_or(0.0, |b| half::f16::from_le_bytes(two(b)).to_f32()),
    }
}

impl Gptq {
    /// The GPTQ form of `lin` (validated when the checkpoint opened), with the indices of its
    /// tensors in `infos`.
    pub fn new(lin: &QuantizedLinear, infos: &[TensorInfo]) -> Result<Gptq> {
        let LinearScheme::Gptq(g) = lin.scheme() else {
            return Err(invalid(
                format!("quantised linear '{}'", lin.prefix()),
                "a GPTQ linear",
                "an EXL2 linear",
            ));
        };
        let index = |name: &str| {
            infos.iter().position(|t| t.name == name).ok_or_else(|| {
                invalid(
                    format!("GPTQ linear '{}'", lin.prefix()),
                    format!("its tensor '{name}' in the checkpoint"),
                    "no such tensor",
                )
            })
        };
        let groups = if g.act_order() {
            let table = (0..lin.in_features())
                .map(|i| u32::try_from(g.group_of(i)).unwrap_or(u32::MAX))
                .collect();
            Groups::Table(table)
        } else {
            Groups::Contiguous(g.group_size().max(1))
        };
        Ok(Gptq {
            bits: g.bits(),
            zero_add: match g.format() {
                GptqFormat::V1 => 1,
                GptqFormat::V2 => 0,
            },
            n_groups: g.n_groups(),
            groups,
            qweight: index(g.qweight())?,
            qzeros: index(g.qzeros())?,
            scales: index(g.scales())?,
        })
    }

    /// The held tensor indices, `qweight` first (the one a linear's slot names).
    pub fn tensors(&self) -> [usize; 3] {
        [self.qweight, self.qzeros, self.scales]
    }

    /// The bytes of a `rows × cols` (outputs × inputs) linear named `name`, from its parts
    /// (`qweight`, `qzeros`, `scales`, as [`super::PackedLinear::parts`] reads them), checked
    /// against its layout: the dtypes and sizes it opened with.
    pub fn bytes<'a>(
        &self,
        [qweight, qzeros, scales]: [PartBytes<'a>; 3],
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<GptqBytes<'a>> {
        let check = |(bytes, dtype): PartBytes<'a>, what: &str, dtypes: &[DType], len: usize| {
            if !dtypes.contains(&dtype) {
                return Err(invalid(
                    format!("GPTQ tensor '{name}.{what}'"),
                    format!("held as {dtypes:?}"),
                    dtype,
                ));
            }
            let size = match dtype {
                DType::F32 | DType::I32 | DType::U32 => 4,
                _ => 2,
            };
            let want = len * size;
            if bytes.len() != want {
                return Err(invalid(
                    format!("GPTQ tensor '{name}.{what}'"),
                    format!("{want} bytes for {rows} outputs × {cols} inputs"),
                    format!("{} bytes; it was loaded for another layout", bytes.len()),
                ));
            }
            Ok((bytes, dtype))
        };
        let words = [DType::I32, DType::U32];
        let (qweight, _) = check(
            qweight,
            "qweight",
            &words,
            words_for(cols, self.bits) * rows,
        )?;
        let (qzeros, _) = check(
            qzeros,
            "qzeros",
            &words,
            self.n_groups * words_for(rows, self.bits),
        )?;
        let (scales, scales_dtype) = check(
            scales,
            "scales",
            &[DType::F16, DType::BF16, DType::F32],
            self.n_groups * rows,
        )?;
        Ok(GptqBytes {
            qweight,
            qzeros,
            scales,
            scales_dtype,
        })
    }

    #[inline]
    fn group(&self, i: usize) -> usize {
        match &self.groups {
            Groups::Contiguous(gs) => i / gs,
            // the table was range-checked at open; the clamp only keeps a bad one from panicking
            Groups::Table(t) => t.get(i).map_or(0, |&g| (g as usize).min(self.n_groups - 1)),
        }
    }

    /// Output row `o` of the weight into `dst` (`cols` values): `(q − z) · s` with `q − z`
    /// exact in f32 and one rounding for the product, as gptqmodel computes it (so the values
    /// equal the format crate's `dequantize_linear_into`). `zs` and `ss` are scratch for the
    /// row's zero points and scales, one per group.
    fn dequantize_row(
        &self,
        b: &GptqBytes<'_>,
        rows: usize,
        o: usize,
        dst: &mut [f32],
        zs: &mut Vec<f32>,
        ss: &mut Vec<f32>,
    ) {
        let bits = self.bits;
        let mask = (1u32 << bits) - 1;
        let zero_words = words_for(rows, bits);
        zs.clear();
        ss.clear();
        for g in 0..self.n_groups {
            // zero point `o` of the bit stream along row g of qzeros
            let bit = o * bits as usize;
            let (w, sh) = (g * zero_words + bit / 32, (bit % 32) as u32);
            let mut z = word(b.qzeros, w) >> sh;
            if sh + bits > 32 {
                z |= word(b.qzeros, w + 1) << (32 - sh);
            }
            zs.push((z.wrapping_add(self.zero_add) & mask) as f32);
            ss.push(scale_at(b.scales, b.scales_dtype, g * rows + o));
        }
        // the codes of input i run down column o of qweight as one bit stream
        let per = (32 / bits) as usize;
        if let Groups::Contiguous(gs) = self.groups
            && 32 % bits == 0
            && gs.is_multiple_of(per)
        {
            // every word's codes share a group: decode and scale in one pass, unrolled per width
            match bits {
                2 => decode_scaled::<2>(b.qweight, rows, o, dst, gs, zs, ss),
                4 => decode_scaled::<4>(b.qweight, rows, o, dst, gs, zs, ss),
                _ => decode_scaled::<8>(b.qweight, rows, o, dst, gs, zs, ss),
            }
            return;
        }
        if 32 % bits == 0 {
            for (wr, piece) in dst.chunks_mut(per).enumerate() {
                let w = word(b.qweight, wr * rows + o);
                for (j, d) in piece.iter_mut().enumerate() {
                    *d = ((w >> (j as u32 * bits)) & mask) as f32;
                }
            }
        } else {
            for (i, d) in dst.iter_mut().enumerate() {
                let bit = i * bits as usize;
                let (wr, sh) = (bit / 32, (bit % 32) as u32);
                let mut v = word(b.qweight, wr * rows + o) >> sh;
                if sh + bits > 32 {
                    v |= word(b.qweight, (wr + 1) * rows + o) << (32 - sh);
                }
                *d = (v & mask) as f32;
            }
        }
        match &self.groups {
            Groups::Contiguous(gs) => {
                for (g, piece) in dst.chunks_mut(*gs).enumerate() {
                    let (z, s) = (zs[g], ss[g]);
                    piece.iter_mut().for_each(|d| *d = (*d - z) * s);
                }
            }
            Groups::Table(_) => {
                for (i, d) in dst.iter_mut().enumerate() {
                    let g = self.group(i);
                    *d = (*d - zs[g]) * ss[g];
                }
            }
        }
    }

    /// `y = W x` for `n` tokens of this `rows × cols` linear through the packed product
    /// ([`packed_product`]).
    #[allow(clippy::too_many_arguments)]
    pub fn product(
        &self,
        b: &GptqBytes<'_>,
        name: &str,
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        max_dq: usize,
    ) -> Result<()> {
        let src = GptqRows {
            gptq: self,
            bytes: b,
            rows,
            cols,
        };
        packed_product(&src, name, rows, cols, x, n, y, max_dq)
    }
}

/// A GPTQ linear's rows as the packed product reads them.
struct GptqRows<'a> {
    gptq: &'a Gptq,
    bytes: &'a GptqBytes<'a>,
    rows: usize,
    cols: usize,
}

impl DequantRows for GptqRows<'_> {
    fn rows_into(&self, r0: usize, out: &mut [f32]) -> Result<()> {
        let (mut zs, mut ss) = (Vec::new(), Vec::new());
        for (k, dst) in out.chunks_exact_mut(self.cols).enumerate() {
            self.gptq
                .dequantize_row(self.bytes, self.rows, r0 + k, dst, &mut zs, &mut ss);
        }
        Ok(())
    }
}

/// Row `o` of a `BITS`-bit GPTQ weight (`BITS` dividing 32, `gs` a multiple of `32 / BITS`)
/// into `dst`: `(q − z) · s` per code, with the group's zero point and scale.
fn decode_scaled<const BITS: u32>(
    qweight: &[u8],
    rows: usize,
    o: usize,
    dst: &mut [f32],
    gs: usize,
    zs: &[f32],
    ss: &[f32],
) {
    let per = (32 / BITS) as usize;
    let mask = (1u32 << BITS) - 1;
    let one = |wr: usize, piece: &mut [f32]| {
        let w = word(qweight, wr * rows + o);
        let g = wr * per / gs;
        let (z, s) = (zs[g], ss[g]);
        for (j, d) in piece.iter_mut().enumerate() {
            *d = (((w >> (j as u32 * BITS)) & mask) as f32 - z) * s;
        }
    };
    // whole words first, so the inner loop has a constant trip count
    let whole = dst.len() / per;
    let mut words = dst.chunks_exact_mut(per);
    for (wr, piece) in (&mut words).enumerate() {
        one(wr, piece);
    }
    let rest = words.into_remainder();
    if !rest.is_empty() {
        one(whole, rest);
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::source::Source;

    fn fixture(variant: &str) -> weightlift_format::Checkpoint {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../weightlift-format/tests/data/gptq")
            .join(variant)
            .join("model.safetensors");
        weightlift_format::Checkpoint::open(&p, weightlift_format::OpenOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// Every fixture's every linear (auto-gptq's packing at 2, 3, 4 and 8 bits, act-order, v1
    /// and v2 zero points, one group over all inputs) dequantises, chunk by chunk from the
    /// bytes, to the format crate's weights bit for bit (which equal gptqmodel's dequantiser).
    #[test]
    fn dequantised_rows_equal_the_format_crates_for_every_fixture() {
        for variant in [
            "g32",
            "act_order",
            "int8",
            "int3",
            "int2",
            "v2",
            "per_channel",
        ] {
            let ckpt = fixture(variant);
            let quant = ckpt.quantization().expect("a GPTQ fixture");
            assert!(!quant.linears().is_empty(), "{variant}");
            for lin in quant.linears() {
                let g = Gptq::new(lin, Source::tensors(&ckpt)).unwrap();
                let (rows, cols) = (lin.out_features(), lin.in_features());
                let part = |i: usize| {
                    let info = &Source::tensors(&ckpt)[i];
                    (ckpt.bytes(info), info.dtype)
                };
                let (qweight, qzeros, (scales, scales_dtype)) =
                    (part(g.qweight).0, part(g.qzeros).0, part(g.scales));
                let b = GptqBytes {
                    qweight,
                    qzeros,
                    scales,
                    scales_dtype,
                };
                let want = ckpt.dequantize_linear(lin).unwrap();
                // in chunks of 3 rows, so a chunk starts mid-way through the outputs
                let src = GptqRows {
                    gptq: &g,
                    bytes: &b,
                    rows,
                    cols,
                };
                let mut got = vec![0f32; rows * cols];
                for r0 in (0..rows).step_by(3) {
                    let nr = 3.min(rows - r0);
                    src.rows_into(r0, &mut got[r0 * cols..(r0 + nr) * cols])
                        .unwrap();
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{variant}: {}", lin.prefix());
            }
        }
    }

    /// The product is the f32 product of the whole dequantised weight: for a prompt the
    /// kernels' matrix product bit for bit, whatever `max_dq_size` cuts the rows into (one row,
    /// three and a bit, all); for one token each row's f32 dot. Both are within f32 rounding of
    /// the f64 product.
    #[test]
    fn the_chunked_product_equals_the_whole_float_product() {
        let ckpt = fixture("act_order");
        let infos = Source::tensors(&ckpt);
        let quant = ckpt.quantization().unwrap();
        for lin in quant.linears() {
            let g = Gptq::new(lin, infos).unwrap();
            let (rows, cols) = (lin.out_features(), lin.in_features());
            let bytes = |i: usize| ckpt.bytes(&infos[i]);
            let b = GptqBytes {
                qweight: bytes(g.qweight),
                qzeros: bytes(g.qzeros),
                scales: bytes(g.scales),
                scales_dtype: infos[g.scales].dtype,
            };
            let dense = ckpt.dequantize_linear(lin).unwrap();
            for n in [1usize, 5, 40] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
                    .collect();
                let want = super::super::dense_product(&dense, rows, cols, &x, n);
                for (t, xt) in x.chunks_exact(cols).enumerate() {
                    for (o, w) in dense.chunks_exact(cols).enumerate() {
                        let exact: f64 = w.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let mag: f64 = w
                            .iter()
                            .zip(xt)
                            .map(|(a, b)| (*a as f64 * *b as f64).abs())
                            .sum();
                        let got = want[t * rows + o] as f64;
                        assert!(
                            (got - exact).abs() <= 1e-5 * mag + 1e-12,
                            "{}: token {t} row {o}: {got} vs f64 {exact}",
                            lin.prefix()
                        );
                    }
                }
                for max_dq in [cols, 3 * cols + 1, 1 << 20] {
                    let mut got = vec![0f32; n * rows];
                    g.product(&b, lin.prefix(), rows, cols, &x, n, &mut got, max_dq)
                        .unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{}: {n} tokens, max_dq {max_dq}",
                        lin.prefix()
                    );
                }
            }
        }
    }
}

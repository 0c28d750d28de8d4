//! EXL2 linears (exllamav2) on the host path: three held tensors carry the weight (`q_weight`,
//! `q_scale`, `q_scale_max`); the input permutation and the per-group widths were read from
//! `q_invperm` and `q_groups` when the checkpoint opened. Rows are decoded by the format crate's
//! dequantiser from the held bytes, wherever the plan put them, for the packed product.

use weightlift_format::quantized::{Exl2Bytes, LinearScheme};
use weightlift_format::{DType, QuantizedLinear, TensorInfo};

use super::{DequantRows, PartBytes, packed_product};
use crate::error::{Result, invalid};

/// An EXL2 linear as the forward pass reads it: the linear as it opened (its groups,
/// permutation and real output count), and the held tensors that hold its weight.
#[derive(Debug)]
pub(crate) struct Exl2 {
    linear: QuantizedLinear,
    /// Indices of the held `q_weight`, `q_scale` and `q_scale_max`.
    q_weight: usize,
    q_scale: usize,
    q_scale_max: usize,
}

impl Exl2 {
    /// The EXL2 form of `lin` (validated when the checkpoint opened), with the indices of its
    /// tensors in `infos`.
    pub fn new(lin: &QuantizedLinear, infos: &[TensorInfo]) -> Result<Exl2> {
        let LinearScheme::Exl2(e) = lin.scheme() else {
            return Err(invalid(
                format!("quantised linear '{}'", lin.prefix()),
                "an EXL2 linear",
                "a GPTQ linear",
            ));
        };
        let index = |name: &str| {
            infos.iter().position(|t| t.name == name).ok_or_else(|| {
                invalid(
                    format!("EXL2 linear '{}'", lin.prefix()),
                    format!("its tensor '{name}' in the checkpoint"),
                    "no such tensor",
                )
            })
        };
        Ok(Exl2 {
            linear: lin.clone(),
            q_weight: index(e.q_weight())?,
            q_scale: index(e.q_scale())?,
            q_scale_max: index(e.q_scale_max())?,
        })
    }

    /// The held tensor indices, `q_weight` first (the one a linear's slot names).
    pub fn tensors(&self) -> [usize; 3] {
        [self.q_weight, self.q_scale, self.q_scale_max]
    }

    /// The bytes of the linear named `name`, from its parts (`q_weight`, `q_scale`,
    /// `q_scale_max`, as [`super::PackedLinear::parts`] reads them), in the dtypes it opened
    /// with (their sizes are checked when rows are decoded).
    pub fn bytes<'a>(
        &self,
        [q_weight, q_scale, q_scale_max]: [PartBytes<'a>; 3],
        name: &str,
    ) -> Result<Exl2Bytes<'a>> {
        let check = |(bytes, dtype): PartBytes<'a>, what: &str, dtypes: &[DType]| {
            if !dtypes.contains(&dtype) {
                return Err(invalid(
                    format!("EXL2 tensor '{name}.{what}'"),
                    format!("held as {dtypes:?}"),
                    dtype,
                ));
            }
            Ok(bytes)
        };
        let words = [DType::I32, DType::U32];
        Ok(Exl2Bytes {
            q_weight: check(q_weight, "q_weight", &words)?,
            q_scale: check(q_scale, "q_scale", &words)?,
            q_scale_max: check(q_scale_max, "q_scale_max", &[DType::F16])?,
        })
    }

    /// `y = W x` for `n` tokens through the packed product ([`packed_product`]); the weight is
    /// `out_features × in_features` as the linear opened (the stored padding columns are never
    /// read).
    pub fn product(
        &self,
        bytes: Exl2Bytes<'_>,
        name: &str,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        max_dq: usize,
    ) -> Result<()> {
        let (rows, cols) = (self.linear.out_features(), self.linear.in_features());
        let src = Exl2Rows {
            linear: &self.linear,
            bytes,
            cols,
        };
        packed_product(&src, name, rows, cols, x, n, y, max_dq)
    }
}

/// An EXL2 linear's rows as the packed product reads them.
struct Exl2Rows<'a> {
    linear: &'a QuantizedLinear,
    bytes: Exl2Bytes<'a>,
    cols: usize,
}

impl DequantRows for Exl2Rows<'_> {
    fn rows_into(&self, r0: usize, out: &mut [f32]) -> Result<()> {
        let nr = out.len() / self.cols;
        self.linear
            .dequantize_exl2_into(self.bytes, r0..r0 + nr, 0..self.cols, out)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::source::Source;

    fn fixture() -> weightlift_format::Checkpoint {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../weightlift-format/tests/data/exl2/model.safetensors");
        weightlift_format::Checkpoint::open(&p, weightlift_format::OpenOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    fn bytes_of<'a>(ckpt: &'a weightlift_format::Checkpoint, e: &Exl2) -> Exl2Bytes<'a> {
        let infos = Source::tensors(ckpt);
        let [w, s, m] = e.tensors().map(|i| ckpt.bytes(&infos[i]));
        Exl2Bytes {
            q_weight: w,
            q_scale: s,
            q_scale_max: m,
        }
    }

    /// The product is the f32 product of the format crate's whole dequantised weight (which the
    /// format crate's tests tie to exllamav2's arithmetic): for a prompt the kernels' matrix
    /// product bit for bit, whatever `max_dq_size` cuts the rows into (one row, three and a
    /// bit, all), a block starting mid-way through the outputs; for one token each row's f32
    /// dot. The head's 48 outputs are stored padded to 64 columns.
    #[test]
    fn the_packed_product_equals_the_float_product_of_the_dequantised_weight() {
        let ckpt = fixture();
        let quant = ckpt.quantization().expect("an EXL2 fixture");
        assert_eq!(quant.linears().len(), 8);
        for lin in quant.linears() {
            let e = Exl2::new(lin, Source::tensors(&ckpt)).unwrap();
            let b = bytes_of(&ckpt, &e);
            let (rows, cols) = (lin.out_features(), lin.in_features());
            let dense = ckpt.dequantize_linear(lin).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            // rows 5.. from the held bytes equal the checkpoint's
            let mut tail = vec![0f32; (rows - 5) * cols];
            let src = Exl2Rows {
                linear: lin,
                bytes: b,
                cols,
            };
            src.rows_into(5, &mut tail).unwrap();
            assert_eq!(bits(&tail), bits(&dense[5 * cols..]), "{}", lin.prefix());
            for n in [1usize, 5, 40] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
                    .collect();
                let want = super::super::dense_product(&dense, rows, cols, &x, n);
                for max_dq in [cols, 3 * cols + 1, 1 << 20] {
                    let mut got = vec![0f32; n * rows];
                    e.product(b, lin.prefix(), &x, n, &mut got, max_dq).unwrap();
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

    /// Held bytes of another size than the linear opened with are a typed error naming the
    /// tensor, not a read out of bounds.
    #[test]
    fn held_bytes_of_another_layout_are_refused_by_name() {
        let ckpt = fixture();
        let lin = &ckpt.quantization().unwrap().linears()[0];
        let e = Exl2::new(lin, Source::tensors(&ckpt)).unwrap();
        let mut b = bytes_of(&ckpt, &e);
        b.q_scale = &b.q_scale[..b.q_scale.len() - 4];
        let x = vec![0.5f32; lin.in_features()];
        let mut y = vec![0f32; lin.out_features()];
        let err = e
            .product(b, lin.prefix(), &x, 1, &mut y, 1 << 20)
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("{}.q_scale", lin.prefix())) && msg.contains("bytes"),
            "{msg}"
        );
    }
}

//! How the forward pass reads a matrix that is not a ggml or float tensor.
//!
//! - **LLM.int8** ([`DType::INT8`], quantised on load): one held tensor, the row-major i8
//!   quants followed by one f32 absmax per row. Both compute modes run bitsandbytes' mixed
//!   product ([`weightlift_kernels::cpu::int8`]), outlier columns `|x| ≥ threshold` in f32, as
//!   transformers' `load_in_8bit` does: that product is the model's arithmetic, so there is no
//!   "more exact" form to fall back to.
//! - **Packed linears**, GPTQ (auto-gptq / gptqmodel, [`Gptq`]) and EXL2 (exllamav2,
//!   [`Exl2`]): several held tensors each, which stay packed where the plan put them. A
//!   product dequantises whole output rows to f32 with the scheme's own arithmetic (gptqmodel's
//!   for GPTQ; for EXL2 the format crate's dequantiser, exllamav2's f16 arithmetic with its
//!   input permutation and per-group widths) and multiplies them with the kernels' f32 products
//!   ([`packed_product`]). Both compute modes run it; it runs on the host path only.
//!
//! The dequantised rows live in transient scratch bounded by `max_dq_size`, one rule for both
//! schemes. With `B = min(max_dq_size, DQ_CHUNK)` values: one token holds [`DECODE_ROWS`]
//! rows of `cols` per worker thread, each met with the token at once; a prompt of `n` tokens
//! holds a tile of `r = clamp(B / max(cols, n), 1, rows)` dequantised rows and that tile's
//! `n × r` products, so each is at most `max(B, cols, n)` values. Like the kernels' own
//! dequantisation tiles, which `max_dq_size` also bounds, this scratch is not a workspace
//! region: the plan charges packed weights at their stored bytes and reserves no
//! dequantisation buffer.

mod exl2;
mod gptq;

use rayon::prelude::*;
use weightlift_format::quantized::LinearScheme;
use weightlift_format::{Checkpoint, DType, Quantization, QuantizedLinear, TensorInfo};
use weightlift_kernels::cpu::matvec::{dot_f32, matmul};
use weightlift_kernels::{MatvecMode, QuantType};

pub(crate) use exl2::Exl2;
pub(crate) use gptq::Gptq;

use super::exec::kernel_type;
use super::host_bytes;
use crate::error::{EngineError, Result, invalid};
use crate::model::Held;

/// How a matrix's held bytes are multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Packing {
    /// ggml block types and floats: the kernels' `matvec` / `matmul` (`Op::Matmul`).
    Blocks(QuantType),
    /// LLM.int8 rows and their scales: `int8_matmul_packed` (`Op::Int8Matmul`).
    Int8,
}

impl Packing {
    /// How a matrix held as `dtype` is multiplied, or why it cannot be.
    pub fn of(name: &str, dtype: DType) -> Result<Packing> {
        if dtype == DType::INT8 {
            return Ok(Packing::Int8);
        }
        kernel_type(name, dtype).map(Packing::Blocks)
    }
}

/// Values one tile of a prompt's packed product dequantises at most, whatever `max_dq_size`
/// allows (16 MiB of f32): larger tiles only save calls.
const DQ_CHUNK: usize = 4 << 20;

/// Output rows a task dequantises at once: a one-token product's task, or a block of a
/// prompt's tile.
const DECODE_ROWS: usize = 16;

/// The packed form of a quantised linear, by scheme.
#[derive(Debug)]
pub(crate) enum PackedLinear {
    Gptq(Box<Gptq>),
    Exl2(Box<Exl2>),
}

impl PackedLinear {
    /// The packed form of `lin` (validated when the checkpoint opened), with the indices of its
    /// tensors in `infos`.
    pub fn new(lin: &QuantizedLinear, infos: &[TensorInfo]) -> Result<PackedLinear> {
        Ok(match lin.scheme() {
            LinearScheme::Gptq(_) => PackedLinear::Gptq(Box::new(Gptq::new(lin, infos)?)),
            LinearScheme::Exl2(_) => PackedLinear::Exl2(Box::new(Exl2::new(lin, infos)?)),
        })
    }

    /// The scheme's name, for messages.
    pub fn scheme(&self) -> &'static str {
        match self {
            PackedLinear::Gptq(_) => "GPTQ",
            PackedLinear::Exl2(_) => "EXL2",
        }
    }

    /// The held tensor a linear's slot names: the packed codes (`qweight`, `q_weight`).
    pub fn codes(&self) -> usize {
        self.tensors()[0]
    }

    /// The held tensors the product reads, in the order an onload slot lays them out: GPTQ's
    /// `qweight`, `qzeros`, `scales`; EXL2's `q_weight`, `q_scale`, `q_scale_max`. The index
    /// tables (`g_idx`, `q_invperm`, `q_groups`) were read when the checkpoint opened and are
    /// not among them.
    pub fn tensors(&self) -> [usize; 3] {
        match self {
            PackedLinear::Gptq(g) => g.tensors(),
            PackedLinear::Exl2(e) => e.tensors(),
        }
    }

    /// The names of [`PackedLinear::tensors`] after the linear's prefix, for messages.
    fn part_names(&self) -> [&'static str; 3] {
        match self {
            PackedLinear::Gptq(_) => ["qweight", "qzeros", "scales"],
            PackedLinear::Exl2(_) => ["q_weight", "q_scale", "q_scale_max"],
        }
    }

    /// The bytes and held dtypes of the tensors the product of linear `name` reads: where the
    /// model holds them, or, for an offloaded layer, their copies in its group's onload slot
    /// (`slot`, and the offset of the first there), laid out back to back in
    /// [`PackedLinear::tensors`] order as `Onload::assign` placed them.
    pub fn parts<'a>(
        &self,
        held: &'a [Held],
        slot: Option<(&'a [u8], usize)>,
        name: &str,
    ) -> Result<[PartBytes<'a>; 3]> {
        let names = self.part_names();
        let mut at = slot.map_or(0, |(_, at)| at);
        let mut out: [PartBytes<'a>; 3] = [(&[], DType::F32); 3];
        for ((o, &i), what) in out.iter_mut().zip(&self.tensors()).zip(names) {
            let full = format!("{name}.{what}");
            let h = held
                .get(i)
                .ok_or_else(|| invalid("held tensors", format!("tensor {i} ('{full}')"), "none"))?;
            *o = match (slot, h) {
                (None, h) => host_bytes(h, &full)?,
                (Some((s, _)), Held::Whole { tensor, .. }) => {
                    let len = usize::try_from(tensor.nbytes()).unwrap_or(usize::MAX);
                    let bytes = at.checked_add(len).and_then(|end| s.get(at..end));
                    let bytes = bytes.ok_or_else(|| {
                        invalid(
                            format!("onloaded '{full}'"),
                            format!("{len} bytes from offset {at}"),
                            format!("a slot of {} bytes", s.len()),
                        )
                    })?;
                    at += len;
                    (bytes, tensor.dtype())
                }
                // a split tensor is never onloaded: refused by name
                (Some(_), Held::Split { .. }) => host_bytes(h, &full)?,
            };
        }
        Ok(out)
    }

    /// `y = W x` for `n` tokens of this `rows × cols` linear from its tensors' bytes
    /// ([`PackedLinear::parts`]), through the packed product; the bias is not added.
    #[allow(clippy::too_many_arguments)]
    pub fn product(
        &self,
        parts: [PartBytes<'_>; 3],
        name: &str,
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        max_dq: usize,
    ) -> Result<()> {
        match self {
            PackedLinear::Gptq(g) => {
                let b = g.bytes(parts, name, rows, cols)?;
                g.product(&b, name, rows, cols, x, n, y, max_dq)
            }
            PackedLinear::Exl2(e) => e.product(e.bytes(parts, name)?, name, x, n, y, max_dq),
        }
    }
}

/// One tensor of a packed linear as its product reads it: its bytes and its held dtype.
pub(crate) type PartBytes<'a> = (&'a [u8], DType);

/// Where a packed product reads its weight: output rows dequantised to f32 on request.
pub(crate) trait DequantRows: Sync {
    /// Output rows `r0 .. r0 + out.len() / cols` of the weight, f32, row-major into `out`.
    fn rows_into(&self, r0: usize, out: &mut [f32]) -> Result<()>;
}

/// `y = W x` for `n` tokens of a packed `rows × cols` linear (`x`: `n × cols`, `y`: `n × rows`,
/// token-major), within the scratch the module's rule bounds. One token: each task dequantises
/// [`DECODE_ROWS`] rows into a buffer that stays in cache and meets each with `x` in the
/// kernels' f32 dot product at once. More: tiles of whole rows, dequantised in parallel blocks,
/// each multiplied with the kernels' exact f32 matrix product, which reuses every dequantised
/// weight across the tokens. Either way each output is the f32 product of the whole
/// dequantised weight, whatever the tiles.
#[allow(clippy::too_many_arguments)]
pub(crate) fn packed_product(
    src: &impl DequantRows,
    name: &str,
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    max_dq: usize,
) -> Result<()> {
    let kernel = |e: weightlift_kernels::KernelError| EngineError::Device {
        device: "cpu".into(),
        detail: format!("{name}: {e}"),
    };
    if rows == 0 || cols == 0 || n == 0 {
        return Ok(());
    }
    if x.len() < n * cols || y.len() < n * rows {
        return Err(invalid(
            format!("packed product '{name}'"),
            format!("{n} tokens of {cols} inputs and {rows} outputs"),
            format!("{} inputs and {} outputs", x.len(), y.len()),
        ));
    }
    if n == 1 {
        let (isa, x) = (super::isa(), &x[..cols]);
        return y[..rows]
            .par_chunks_mut(DECODE_ROWS)
            .enumerate()
            .try_for_each_init(Vec::new, |block: &mut Vec<f32>, (k, ys)| {
                block.resize(ys.len() * cols, 0.0);
                src.rows_into(k * DECODE_ROWS, block)?;
                for (yv, w) in ys.iter_mut().zip(block.chunks_exact(cols)) {
                    *yv = dot_f32(isa, w, x);
                }
                Ok(())
            });
    }
    let tile = dq_tile_rows(rows, cols, n, max_dq);
    let mut wd = vec![0f32; tile * cols];
    let mut part = vec![0f32; n * tile];
    for r0 in (0..rows).step_by(tile) {
        let nr = tile.min(rows - r0);
        let w = &mut wd[..nr * cols];
        w.par_chunks_mut(DECODE_ROWS * cols)
            .enumerate()
            .try_for_each(|(k, block)| src.rows_into(r0 + k * DECODE_ROWS, block))?;
        let wb: &[u8] = bytemuck::cast_slice(w);
        let p = &mut part[..n * nr];
        matmul(
            MatvecMode::Exact,
            QuantType::F32,
            wb,
            nr,
            cols,
            &x[..n * cols],
            n,
            p,
            max_dq,
        )
        .map_err(kernel)?;
        for (yt, pt) in y.chunks_exact_mut(rows).zip(p.chunks_exact(nr)) {
            yt[r0..r0 + nr].copy_from_slice(pt);
        }
    }
    Ok(())
}

/// Rows of a prompt's dequantised tile: `clamp(B / max(cols, n), 1, rows)` with
/// `B = min(max_dq, DQ_CHUNK)`, so the tile (`r × cols`) and its products (`n × r`) each stay
/// within `max(B, cols, n)` values.
fn dq_tile_rows(rows: usize, cols: usize, n: usize, max_dq: usize) -> usize {
    (max_dq.min(DQ_CHUNK) / cols.max(n).max(1)).clamp(1, rows.max(1))
}

/// The quantisation of a checkpoint whose tensors include GPTQ or EXL2 parts; parts without the
/// settings that describe them are refused by name. `None` for a checkpoint without quantised
/// parts.
pub(crate) fn runnable_quantization<'a>(
    ckpt: Option<&'a Checkpoint>,
    infos: &[TensorInfo],
) -> Result<Option<&'a Quantization>> {
    let Some(t) = infos
        .iter()
        .find(|t| weightlift_format::is_quantized_part(&t.name))
    else {
        return Ok(None);
    };
    match ckpt.and_then(Checkpoint::quantization) {
        None => Err(EngineError::Unsupported {
            what: format!("running quantised tensor '{}'", t.name),
            detail: "its quantisation settings were not read (no checkpoint config); open the \
                     checkpoint folder with its config.json"
                .into(),
        }),
        Some(q) => Ok(Some(q)),
    }
}

/// The products of the dense f32 weight `dense` (`rows × cols`) with `n` tokens of `x`, as the
/// kernels compute a float weight's: the reference a packed product must equal bit for bit.
#[cfg(test)]
pub(crate) fn dense_product(
    dense: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    use weightlift_kernels::QuantType;
    use weightlift_kernels::cpu::matvec::{MatvecMode, dot_f32, matmul};
    let mut want = vec![0f32; n * rows];
    if n == 1 {
        for (y, w) in want.iter_mut().zip(dense.chunks_exact(cols)) {
            *y = dot_f32(crate::forward::isa(), w, x);
        }
    } else {
        let wb: &[u8] = bytemuck::cast_slice(dense);
        matmul(
            MatvecMode::Exact,
            QuantType::F32,
            wb,
            rows,
            cols,
            x,
            n,
            &mut want,
            1 << 20,
        )
        .unwrap();
    }
    want
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prompt tile and its products stay within `max(B, cols, n)` values, and a tile is at
    /// least one row and at most all of them.
    #[test]
    fn the_prompt_tile_stays_within_its_bound() {
        for (rows, cols, n, max_dq) in [
            (4096, 4096, 2048, 512 << 20),
            (152_064, 3584, 32, 512 << 20),
            (1536, 576, 2048, 512 << 20),
            (64, 128, 16, 128),
            (64, 128, 16, 1),
            (3, 7, 5, 1 << 20),
        ] {
            let r = dq_tile_rows(rows, cols, n, max_dq);
            let bound = max_dq.min(DQ_CHUNK).max(cols).max(n);
            assert!(
                (1..=rows).contains(&r),
                "{rows}×{cols}, {n} tokens: {r} rows"
            );
            assert!(
                r * cols <= bound && n * r <= bound,
                "{rows}×{cols}, {n}: {r}"
            );
        }
    }

    /// An offloaded linear reads its tensors where `Onload::assign` laid them out, back to back
    /// from the linear's offset in the slot, not where the model holds them; a slot too short
    /// for them is a typed error naming the tensor.
    #[test]
    fn packed_parts_are_read_from_the_onload_slot() {
        use std::path::PathBuf;

        use crate::device::{Device, DeviceTensor};
        use crate::source::Source;

        let data =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../weightlift-format/tests/data");
        for (file, last) in [
            ("gptq/act_order/model.safetensors", "scales"),
            ("exl2/model.safetensors", "q_scale_max"),
        ] {
            let path = data.join(file);
            let ckpt = Checkpoint::open(&path, weightlift_format::OpenOptions::default())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let infos = Source::tensors(&ckpt);
            let cpu = Device::cpu(None);
            let held: Vec<Held> = infos
                .iter()
                .map(|t| Held::Whole {
                    tensor: DeviceTensor::from_host(&cpu, t.shape.clone(), t.dtype, ckpt.bytes(t))
                        .unwrap(),
                    device: "cpu".into(),
                })
                .collect();
            let lin = &ckpt.quantization().unwrap().linears()[0];
            let p = PackedLinear::new(lin, infos).unwrap();
            let name = lin.prefix();
            let from_held = p.parts(&held, None, name).unwrap();
            // five bytes of another linear before this one, and three after
            let at = 5;
            let mut slot = vec![0xa5u8; at];
            for (b, _) in from_held {
                slot.extend_from_slice(b);
            }
            slot.extend_from_slice(&[0xa5; 3]);
            let from_slot = p.parts(&held, Some((&slot, at)), name).unwrap();
            let inside = slot.as_ptr_range();
            for ((s, sd), (h, hd)) in from_slot.iter().zip(&from_held) {
                assert_eq!((s, sd), (h, hd), "{file}");
                assert!(
                    inside.contains(&s.as_ptr()),
                    "{file}: not read from the slot"
                );
            }
            let short = &slot[..slot.len() - 4];
            let e = p
                .parts(&held, Some((short, at)), name)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("onloaded '{name}.{last}'")) && e.contains("a slot of"),
                "{e}"
            );
        }
    }
}

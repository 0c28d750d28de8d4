//! The parts of the graph: which held tensor each norm, bias and matrix of a layer reads, and
//! the f32 copies of the small ones made once at build.

use std::sync::Arc;

use weightlift_format::{DType, TensorInfo};

use super::exec;
use super::host_weight;
use super::layer::kernel;
use super::weights::PackedLinear;
use crate::device::{Buffer, Device, Storage};
use crate::error::Result;
use crate::model::Held;

/// A held tensor: in the model's tensor list, or one of its extra copies (a tied head).
#[derive(Debug, Clone, Copy)]
pub(super) enum Slot {
    Tensor(usize),
    Copy(usize),
}

/// f32 parameters read once at build: a norm's weight or a bias. The host paths read the host
/// copy; a cuda device reads the held tensor in place when it is f32 on that device, else a copy
/// made there at build (a few KiB per layer).
#[derive(Debug)]
pub(crate) struct Floats {
    pub host: Vec<f32>,
    /// The held tensor it was read from.
    pub index: usize,
    pub name: String,
    /// The held tensor is f32 on the computing cuda device and is read there.
    pub held_on_device: bool,
    /// A copy on the computing cuda device.
    pub device: Option<Buffer>,
    /// The values are computed from the held tensor (shifted) or from no tensor (a RoPE
    /// table): a cuda device reads a copy, never the tensor.
    pub derived: bool,
}

impl Floats {
    /// Values made at build, read from no tensor.
    pub fn computed(name: String, host: Vec<f32>) -> Floats {
        Floats {
            host,
            index: usize::MAX,
            name,
            held_on_device: false,
            device: None,
            derived: true,
        }
    }
}

/// A matrix `rows × cols` and its optional f32 bias.
#[derive(Debug)]
pub(crate) struct Linear {
    pub slot: Slot,
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub bias: Option<Floats>,
    /// Offset in its group's onload slot, when the layer is offloaded.
    pub onload_at: Option<usize>,
    /// The packed layout of a GPTQ or EXL2 linear (its slot names the packed codes).
    pub packed: Option<PackedLinear>,
    /// The part of a split held tensor this device multiplies (tensor parallelism).
    pub part: Option<usize>,
    /// `(first, total)`: the matrix is rows `first..first + rows` of a held tensor of `total`
    /// rows (a block of phi3's stacked qkv or gate_up), read in place.
    pub rows_of: Option<(usize, usize)>,
}

impl Linear {
    /// The scheme of a packed linear (`"GPTQ"`, `"EXL2"`), which runs on the host path only.
    pub fn packed(&self) -> Option<&'static str> {
        self.packed.as_ref().map(PackedLinear::scheme)
    }

    /// The byte range `(offset, len)` of its rows in its held tensor of `nbytes` bytes: all of
    /// them, or its block of a stacked matrix (every row is the same whole number of bytes).
    pub fn byte_range(&self, nbytes: usize) -> (usize, usize) {
        match self.rows_of {
            None => (0, nbytes),
            Some((first, total)) => {
                let per = nbytes / total.max(1);
                (first * per, self.rows * per)
            }
        }
    }

    /// Index of the held tensor (or of the tensor a copy copies).
    pub fn index(&self) -> usize {
        match self.slot {
            Slot::Tensor(i) | Slot::Copy(i) => i,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Layer {
    pub site: usize,
    pub kv_heads: usize,
    pub attn_norm: Floats,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    /// Per-head RMSNorm weights of the queries and keys (`head_dim` each), applied after the
    /// projections and before RoPE, when the architecture has them (qwen3, gemma3).
    pub qk_norm: Option<[Floats; 2]>,
    pub ffn_norm: Floats,
    pub ffn: Ffn,
    /// Norms of the attention block's and the MLP's outputs before their residual adds
    /// (gemma2, gemma3).
    pub post_attn_norm: Option<Floats>,
    pub post_ffn_norm: Option<Floats>,
    /// The sliding window of this layer's attention (0: full).
    pub window: usize,
    /// This layer's own RoPE angles, where they differ from the model's (gemma3's local and
    /// global bases).
    pub rope: Option<Floats>,
    /// The onload group, when the layer's weights stay on cpu or disk and are copied in.
    pub group: Option<usize>,
}

/// A layer's feed-forward block.
// One per layer, built once and read in place: the dense variant's size is never copied around.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Ffn {
    /// One gated MLP: `down(act(gate x) · up x)`.
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// Routed experts (mixtral, qwen3moe).
    Moe(Moe),
}

/// A mixture-of-experts block: the router's scores pick each token's `n_used` experts, each a
/// gated MLP of its own, and their outputs are summed weighted by the routing weights.
#[derive(Debug)]
pub(crate) struct Moe {
    /// `n_experts × hidden`.
    pub router: Linear,
    /// Per expert from `first`: gate, up, down. An expert of a stacked GGUF tensor is its rows
    /// of that tensor, read in place (`Linear::rows_of`). A layer split holds every expert; a
    /// device under tensor parallelism its range of the expert table, and computes only those.
    pub experts: Vec<[Linear; 3]>,
    /// The index of the first expert of `experts`.
    pub first: usize,
    pub n_used: usize,
    /// Renormalise the chosen experts' softmax weights to sum to 1.
    pub norm_topk_prob: bool,
    /// Through the backend op sequence: the experts are in host memory and computed by the
    /// host (else they are on the computing device and computed there). Decided at build from
    /// where the model holds them; the host path ignores it.
    pub experts_on_host: bool,
}

impl Moe {
    /// The experts a token chooses among: the router's rows.
    pub fn n_experts(&self) -> usize {
        self.router.rows
    }

    /// Expert `e`'s matrices, where this block holds it.
    pub fn expert(&self, e: usize) -> Option<&[Linear; 3]> {
        self.experts.get(e.checked_sub(self.first)?)
    }
}

impl Layer {
    /// The matrices, in the order they are laid out in an onload slot.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out = vec![&self.q, &self.k, &self.v, &self.o];
        match &self.ffn {
            Ffn::Dense { gate, up, down } => out.extend([gate, up, down]),
            Ffn::Moe(m) => {
                out.push(&m.router);
                out.extend(m.experts.iter().flatten());
            }
        }
        out
    }

    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut out = vec![&mut self.q, &mut self.k, &mut self.v, &mut self.o];
        match &mut self.ffn {
            Ffn::Dense { gate, up, down } => out.extend([gate, up, down]),
            Ffn::Moe(m) => {
                out.push(&mut m.router);
                out.extend(m.experts.iter_mut().flatten());
            }
        }
        out
    }
}

/// A small tensor (a norm's weight, a bias) as f32 on the host, read back from device memory
/// where it lives there.
pub(super) fn f32_vector(held: &Held, info: &TensorInfo) -> Result<Vec<f32>> {
    let n = info.n_elements() as usize;
    let mut out = vec![0f32; n];
    if let Held::Whole { tensor, .. } = held
        && tensor.host_bytes().is_none()
    {
        let ty = exec::kernel_type(&info.name, tensor.dtype())?;
        let bytes = tensor.to_host()?;
        weightlift_kernels::dequantize_f32(ty, &bytes, &mut out)
            .map_err(|e| kernel(&info.name, e))?;
        return Ok(out);
    }
    let (bytes, ty) = host_weight(held, &info.name)?;
    weightlift_kernels::dequantize_f32(ty, bytes, &mut out).map_err(|e| kernel(&info.name, e))?;
    Ok(out)
}

pub(super) fn floats(held: &[Held], infos: &[TensorInfo], i: usize) -> Result<Floats> {
    shifted(held, infos, i, 0.0)
}

/// [`floats`] plus `offset` on every value (a `(1 + w)` norm stored as `w`).
pub(super) fn shifted(
    held: &[Held],
    infos: &[TensorInfo],
    i: usize,
    offset: f32,
) -> Result<Floats> {
    let mut host = f32_vector(&held[i], &infos[i])?;
    if offset != 0.0 {
        host.iter_mut().for_each(|v| *v += offset);
    }
    Ok(Floats {
        host,
        index: i,
        name: infos[i].name.clone(),
        held_on_device: false,
        device: None,
        derived: offset != 0.0,
    })
}

/// Makes `f` readable on cuda `device`: the held tensor in place when it is f32 there, else a
/// copy.
pub(super) fn place(f: &mut Floats, held: &[Held], device: &Arc<Device>) -> Result<()> {
    if let Some(Held::Whole { tensor, .. }) = held.get(f.index)
        && !f.derived
        && tensor.dtype() == DType::F32
        && tensor.device().name() == device.name()
        && matches!(tensor.storage(), Storage::Owned(b) if b.cuda().is_some())
    {
        f.held_on_device = true;
        return Ok(());
    }
    let mut buf = device.alloc(f.host.len() as u64 * 4)?;
    buf.write(0, bytemuck::cast_slice(&f.host))?;
    f.device = Some(buf);
    Ok(())
}

//! The llama-family graph over a loaded model: which held tensor plays which part in each
//! layer, on which device each part computes, and the forward call that runs it.
//!
//! The family variants are data read once from the checkpoint, never tests on the
//! architecture name inside the layer code: the RoPE pairing ([`RopeStyle`]), the q/k/v biases
//! (qwen2), a tied head (`token_embd` when there is no `output.weight`) and Llama 3 frequency
//! factors.
//!
//! Each device computes its parts one of two ways ([`SiteExec`]): the host path below (the CPU
//! kernels on slices of host memory: `cpu`, `disk`, `virtual:N`), or the op sequence of
//! [`super::exec`] through the kernels' `Backend` trait (`cuda:N`, and host devices when
//! asked). Hidden states move between devices the same way whichever path each side takes.

use std::sync::Arc;

use weightlift_format::{DType, Format, ModelSpec, Role, TensorInfo, is_quantized_part};
use weightlift_kernels::cpu::matvec::{matmul, matvec};
use weightlift_kernels::{
    Backend, CpuBackend, CpuBuffer, CudaBackend, CudaBuffer, RopeParams, RopeStyle,
};
use weightlift_plan::{Dims, Hosts, RuntimeSpec, Workspace};

use super::attention::{self, Shape, Tiles};
use super::exec::{self, Ctx, Regions, kernel_on};
use super::onload::{Copier, Onload, onload_group};
use super::weights::{Gptq, Packing, runnable_quantization};
use super::{
    Compute, Copies, Logits, Site, SiteExec, Views, carve, check_tokens, host_bytes, host_weight,
};
use crate::cache::Cache;
use crate::device::{Buffer, Device, DeviceKind, Storage, link_rate, pace_link};
use crate::error::{EngineError, Result, invalid};
use crate::model::Held;
use crate::source::Source;

/// Runs `$host` with the host path's views, or `$gen` (one body, compiled for each backend)
/// with a backend and its regions.
macro_rules! on_site {
    ($work:expr, $v:ident => $host:expr, ($b:ident, $r:ident) => $gen:expr) => {
        match $work {
            Work::Host($v) => $host,
            Work::Cpu($b, $r) => $gen,
            Work::Cuda($b, $r) => $gen,
        }
    };
}

/// The architectures the forward pass runs.
pub const SUPPORTED: &[&str] = &["llama", "mistral", "qwen2"];

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
    /// The packed layout of a GPTQ linear (its slot names the `qweight`).
    pub gptq: Option<Box<Gptq>>,
}

impl Linear {
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
    pub ffn_norm: Floats,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    /// The onload group, when the layer's weights stay on cpu or disk and are copied in.
    pub group: Option<usize>,
}

impl Layer {
    /// The matrices, in the order they are laid out in an onload slot.
    pub fn linears(&self) -> [&Linear; 7] {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
    }

    pub fn linears_mut(&mut self) -> [&mut Linear; 7] {
        [
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
        ]
    }
}

/// The graph of a loaded model, with one workspace per computing device.
#[derive(Debug)]
pub(crate) struct Graph {
    sites: Vec<Site>,
    layers: Vec<Layer>,
    embed: Linear,
    embed_site: usize,
    out_norm: Floats,
    head: Linear,
    head_site: usize,
    dims: Dims,
    eps: f32,
    rope: RopeParams,
    inv_freqs: Vec<f32>,
    max_dq: usize,
    onload: Option<Onload>,
}

/// What the model's state lends the graph to build it.
pub(crate) struct Loaded<'a> {
    pub source: &'a dyn Source,
    pub held: &'a [Held],
    pub copies: &'a [(usize, Held)],
    pub scratch: &'a [Buffer],
    pub layer_devices: &'a [String],
    pub onload: Option<&'a weightlift_plan::OnloadPlan>,
    pub resolve: &'a dyn Fn(&str) -> Result<Arc<Device>>,
}

/// A small tensor (a norm's weight, a bias) as f32 on the host, read back from device memory
/// where it lives there.
fn f32_vector(held: &Held, info: &TensorInfo) -> Result<Vec<f32>> {
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

fn floats(held: &[Held], infos: &[TensorInfo], i: usize) -> Result<Floats> {
    Ok(Floats {
        host: f32_vector(&held[i], &infos[i])?,
        index: i,
        name: infos[i].name.clone(),
        held_on_device: false,
        device: None,
    })
}

/// Makes `f` readable on cuda `device`: the held tensor in place when it is f32 there, else a
/// copy.
fn place(f: &mut Floats, held: &[Held], device: &Arc<Device>) -> Result<()> {
    if let Some(Held::Whole { tensor, .. }) = held.get(f.index)
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

pub(super) fn kernel(what: &str, e: weightlift_kernels::KernelError) -> EngineError {
    EngineError::Device {
        device: "cpu".into(),
        detail: format!("{what}: {e}"),
    }
}

impl Graph {
    /// The graph for the model's spec and held tensors. `forward` is the runtime and cache
    /// shape the plan reserved scratch for (`None`: no scratch was reserved; each device's
    /// workspace is then allocated here, for `runtime` and `cache`).
    ///
    /// `host_backend`: host devices compute through the CPU backend's op sequence (the path
    /// cuda devices take) instead of the host path.
    pub fn build(
        m: &Loaded<'_>,
        spec: &ModelSpec,
        runtime: &RuntimeSpec,
        seq_batch: (u64, u64),
        host_backend: bool,
    ) -> Result<Graph> {
        if !SUPPORTED.contains(&spec.architecture.as_str()) {
            return Err(EngineError::Unsupported {
                what: format!("running the '{}' architecture", spec.architecture),
                detail: format!(
                    "the forward pass supports {}; this model can still be opened, planned and \
                     loaded",
                    SUPPORTED.join(", ")
                ),
            });
        }
        let infos = m.source.tensors();
        // GPTQ linears run (their packed tensors stand for the weight); EXL2 is refused by name.
        let quant = runnable_quantization(m.source.checkpoint(), infos)?;
        let quantized = |role: Role, layer: Option<u32>| {
            quant.and_then(|q| {
                q.linears()
                    .iter()
                    .find(|l| l.role() == Some(role) && l.layer() == layer)
            })
        };
        let find = |role: Role, layer: Option<u32>| -> Option<usize> {
            infos.iter().position(|t| {
                t.role == Some(role) && t.layer == layer && !is_quantized_part(&t.name)
            })
        };
        let need = |role: Role, layer: Option<u32>| -> Result<usize> {
            find(role, layer).ok_or_else(|| EngineError::Validation {
                path: m.source.path().to_path_buf(),
                architecture: spec.architecture.clone(),
                problems: match layer {
                    Some(l) => format!("layer {l} has no {} tensor", role.name()),
                    None => format!("no {} tensor", role.name()),
                },
            })
        };
        let finish = |slot: Slot,
                      name: &str,
                      (rows, cols): (usize, usize),
                      gptq: Option<Box<Gptq>>,
                      bias: Option<Role>,
                      layer: Option<u32>|
         -> Result<Linear> {
            let bias = match bias.and_then(|b| find(b, layer)) {
                Some(b) => Some(floats(m.held, infos, b)?),
                None => None,
            };
            if let Some(b) = &bias
                && b.host.len() != rows
            {
                return Err(invalid(
                    format!("bias of '{name}'"),
                    format!("{rows} values"),
                    b.host.len(),
                ));
            }
            Ok(Linear {
                slot,
                name: name.to_owned(),
                rows,
                cols,
                bias,
                onload_at: None,
                gptq,
            })
        };
        let linear = |i: usize, bias: Option<Role>, layer: Option<u32>| -> Result<Linear> {
            let info = &infos[i];
            let dims = match info.shape.as_slice() {
                [r, c] => (*r as usize, *c as usize),
                other => {
                    return Err(invalid(
                        format!("tensor '{}'", info.name),
                        "a 2-D matrix",
                        format!("shape {other:?}"),
                    ));
                }
            };
            finish(Slot::Tensor(i), &info.name, dims, None, bias, layer)
        };
        // A projection: a GPTQ linear where the checkpoint has one for the role, else its weight.
        let matrix = |role: Role, bias: Option<Role>, layer: Option<u32>| -> Result<Linear> {
            match quantized(role, layer) {
                Some(q) => {
                    let g = Gptq::new(q, infos)?;
                    let slot = Slot::Tensor(g.tensors()[0]);
                    let dims = (q.out_features(), q.in_features());
                    finish(slot, q.prefix(), dims, Some(Box::new(g)), bias, layer)
                }
                None => linear(need(role, layer)?, bias, layer),
            }
        };
        let norm = |i: usize| floats(m.held, infos, i);

        // Where each part computes: layers on their devices, the embedding and head on the
        // devices holding their tensors (a tied head on its copy, when the plan made one).
        let device_of = |h: &Held| -> String {
            match h {
                Held::Whole { device, .. } => device.clone(),
                Held::Split { spec, .. } => spec
                    .shards
                    .first()
                    .map_or_else(|| "cpu".into(), |s| s.0.clone()),
            }
        };
        let embd = need(Role::TokenEmbd, None)?;
        let head_gptq = match quantized(Role::Output, None) {
            Some(_) => Some(matrix(Role::Output, None, None)?),
            None => None,
        };
        let (head_slot, head_dev) = match (&head_gptq, find(Role::Output, None)) {
            (Some(h), _) => (h.slot, device_of(&m.held[h.index()])),
            (None, Some(i)) => (Slot::Tensor(i), device_of(&m.held[i])),
            (None, None) => match m.copies.iter().position(|(i, _)| *i == embd) {
                Some(c) => (Slot::Copy(c), device_of(&m.copies[c].1)),
                None => (Slot::Tensor(embd), device_of(&m.held[embd])),
            },
        };
        let head_index = match head_slot {
            Slot::Tensor(i) => i,
            Slot::Copy(c) => m.copies[c].0,
        };
        let head = match head_gptq {
            Some(h) => h,
            None => {
                let mut h = linear(head_index, None, None)?;
                h.slot = head_slot;
                h
            }
        };

        let mut sites: Vec<(String, Hosts)> = Vec::new();
        let mut site = |name: &str, f: &dyn Fn(&mut Hosts)| -> usize {
            // `disk` layers are computed by the host, as the planner charges them.
            let name = if name == "disk" { "cpu" } else { name };
            let i = match sites.iter().position(|(n, _)| n == name) {
                Some(i) => i,
                None => {
                    sites.push((name.to_owned(), Hosts::default()));
                    sites.len() - 1
                }
            };
            f(&mut sites[i].1);
            i
        };
        let embed_site = site(&device_of(&m.held[embd]), &|h| h.embed = true);
        let mut layers = Vec::with_capacity(spec.n_layers as usize);
        for l in 0..spec.n_layers {
            let dev = m.layer_devices.get(l as usize).ok_or_else(|| {
                invalid(
                    "layer devices",
                    format!("{} layers", spec.n_layers),
                    m.layer_devices.len(),
                )
            })?;
            let s = site(dev, &|h| h.layers = true);
            let at = Some(l);
            layers.push(Layer {
                site: s,
                kv_heads: spec.n_kv_heads_at(l) as usize,
                attn_norm: norm(need(Role::AttnNorm, at)?)?,
                q: matrix(Role::AttnQ, Some(Role::AttnQBias), at)?,
                k: matrix(Role::AttnK, Some(Role::AttnKBias), at)?,
                v: matrix(Role::AttnV, Some(Role::AttnVBias), at)?,
                o: matrix(Role::AttnOutput, Some(Role::AttnOutputBias), at)?,
                ffn_norm: norm(need(Role::FfnNorm, at)?)?,
                gate: matrix(Role::FfnGate, None, at)?,
                up: matrix(Role::FfnUp, None, at)?,
                down: matrix(Role::FfnDown, None, at)?,
                group: None,
            });
        }
        let head_site = site(&head_dev, &|h| h.head = true);
        let out_norm = norm(need(Role::OutputNorm, None)?)?;
        let mut embed = linear(embd, None, None)?;
        embed.slot = Slot::Tensor(embd);

        let dims = Dims::new(spec, runtime, seq_batch.0, seq_batch.1);
        if dims.tokens == 0 {
            return Err(invalid(
                "runtime max_input_len",
                "at least 1 token per forward chunk",
                0,
            ));
        }
        let onload = match m.onload {
            Some(p) if !p.groups.is_empty() => {
                let site = sites
                    .iter()
                    .position(|(n, _)| *n == p.device)
                    .ok_or_else(|| {
                        invalid(
                            "offload execution device",
                            "a device that computes the offloaded layers",
                            &p.device,
                        )
                    })?;
                let from = (m.resolve)("cpu")?;
                let to = (m.resolve)(&p.device)?;
                Some(Onload {
                    site,
                    groups: p
                        .groups
                        .iter()
                        .map(|g| g.iter().map(|&l| l as usize).collect())
                        .collect(),
                    slot_bytes: usize::try_from(p.slot_bytes).unwrap_or(usize::MAX),
                    holds: vec![None; p.slots as usize],
                    rate: link_rate(&from, &to),
                })
            }
            _ => None,
        };
        let sites = sites
            .into_iter()
            .enumerate()
            .map(|(i, (name, hosts))| -> Result<Site> {
                let device = (m.resolve)(&name)?;
                let layout = Workspace::new(&dims, hosts);
                let scratch = m
                    .scratch
                    .iter()
                    .position(|b| b.device().name() == device.name());
                let slots = onload
                    .as_ref()
                    .filter(|o| o.site == i)
                    .map_or(0, |o| o.bytes() as u64);
                let own = match scratch {
                    Some(_) => None,
                    None => Some(device.alloc(layout.bytes + slots)?),
                };
                let exec = match device.kind() {
                    DeviceKind::Cuda => SiteExec::Cuda,
                    _ if host_backend => SiteExec::Cpu(CpuBackend::named(device.name())),
                    _ => SiteExec::Host,
                };
                Ok(Site {
                    device,
                    layout,
                    own,
                    scratch,
                    exec,
                })
            })
            .collect::<Result<Vec<_>>>()?;

        let (rope, inv_freqs) = rope_of(m, spec)?;
        let mut g = Graph {
            sites,
            layers,
            embed,
            embed_site,
            out_norm,
            head,
            head_site,
            dims,
            eps: spec.rms_norm_eps as f32,
            rope,
            inv_freqs,
            max_dq: usize::try_from(runtime.max_dq_size.max(1)).unwrap_or(usize::MAX),
            onload,
        };
        g.check_shapes(spec)?;
        g.check_packings(m.held, m.copies)?;
        g.place_floats(m.held)?;
        if let Some(o) = &g.onload {
            if !matches!(g.sites[o.site].exec, SiteExec::Host) {
                return Err(EngineError::Unsupported {
                    what: format!(
                        "offloaded execution on {} through the backend op sequence",
                        g.sites[o.site].device.name()
                    ),
                    detail: "offload=\"sequential\" and \"group\" run on cpu kernels over \
                             virtual devices for now; on cuda:N leave offload=None (each layer \
                             computes where it is placed)"
                        .into(),
                });
            }
            o.assign(&mut g.layers, m.held)?;
        }
        Ok(g)
    }

    /// Every matrix can be multiplied where it computes: the embedding is a lookup of block or
    /// float rows; GPTQ linears run on the host path, and not from onload slots (their packed
    /// parts are several tensors, a slot holds one per matrix).
    fn check_packings(&self, held: &[Held], copies: &[(usize, Held)]) -> Result<()> {
        let dtype = |l: &Linear| {
            let h = match l.slot {
                Slot::Tensor(i) => held.get(i),
                Slot::Copy(c) => copies.get(c).map(|(_, h)| h),
            };
            match h {
                Some(Held::Whole { tensor, .. }) => Some(tensor.dtype()),
                _ => None,
            }
        };
        if let Some(d) = dtype(&self.embed)
            && !matches!(Packing::of(&self.embed.name, d)?, Packing::Blocks(_))
        {
            return Err(EngineError::Unsupported {
                what: format!("a token embedding '{}' held as {d}", self.embed.name),
                detail: "the embedding is a row lookup of float or ggml rows; LLM.int8 \
                         quantises linears only (keep the embedding in its float type)"
                    .into(),
            });
        }
        let gptq_off_host = |site: usize, l: &Linear| -> Result<()> {
            let s = &self.sites[site];
            if l.gptq.is_some() && !matches!(s.exec, SiteExec::Host) {
                return Err(EngineError::Unsupported {
                    what: format!(
                        "GPTQ linear '{}' computed on {} through the backend op sequence",
                        l.name,
                        s.device.name()
                    ),
                    detail: "GPTQ linears run on the host path (cpu, disk, virtual:N) for now; \
                             place their layers there, and leave the host backend off"
                        .into(),
                });
            }
            Ok(())
        };
        for l in &self.layers {
            for lin in l.linears() {
                gptq_off_host(l.site, lin)?;
            }
        }
        gptq_off_host(self.head_site, &self.head)?;
        if let Some(o) = &self.onload {
            let packed = o
                .groups
                .iter()
                .flatten()
                .filter_map(|&li| self.layers.get(li))
                .flat_map(|l| l.linears())
                .find(|lin| lin.gptq.is_some());
            if let Some(lin) = packed {
                return Err(EngineError::Unsupported {
                    what: format!("offloaded execution of GPTQ linear '{}'", lin.name),
                    detail: "onload slots copy one tensor per matrix and a GPTQ linear is \
                             several; load with offload=None"
                        .into(),
                });
            }
        }
        Ok(())
    }

    /// Makes the norms and biases of every part computed on a cuda device readable there.
    fn place_floats(&mut self, held: &[Held]) -> Result<()> {
        let on_cuda = |site: usize| {
            let s = &self.sites[site];
            matches!(s.exec, SiteExec::Cuda).then(|| Arc::clone(&s.device))
        };
        for l in &mut self.layers {
            let Some(dev) = on_cuda(l.site) else { continue };
            place(&mut l.attn_norm, held, &dev)?;
            place(&mut l.ffn_norm, held, &dev)?;
            for lin in [&mut l.q, &mut l.k, &mut l.v, &mut l.o] {
                if let Some(b) = &mut lin.bias {
                    place(b, held, &dev)?;
                }
            }
        }
        if let Some(dev) = on_cuda(self.head_site) {
            place(&mut self.out_norm, held, &dev)?;
        }
        Ok(())
    }

    fn check_shapes(&self, spec: &ModelSpec) -> Result<()> {
        let h = self.dims.hidden as usize;
        let hd = spec.head_dim as usize;
        let nh = spec.n_heads as usize;
        let expect = |l: &Linear, rows: usize, cols: usize| -> Result<()> {
            if (l.rows, l.cols) != (rows, cols) {
                return Err(invalid(
                    format!("tensor '{}'", l.name),
                    format!("{rows} × {cols} for this architecture"),
                    format!("{} × {}", l.rows, l.cols),
                ));
            }
            Ok(())
        };
        let i = self.dims.inter as usize;
        for l in &self.layers {
            if l.kv_heads == 0 || !nh.is_multiple_of(l.kv_heads) {
                return Err(invalid(
                    "kv heads",
                    format!("a divisor of the {nh} attention heads"),
                    l.kv_heads,
                ));
            }
            expect(&l.q, nh * hd, h)?;
            expect(&l.k, l.kv_heads * hd, h)?;
            expect(&l.v, l.kv_heads * hd, h)?;
            expect(&l.o, h, nh * hd)?;
            expect(&l.gate, i, h)?;
            expect(&l.up, i, h)?;
            expect(&l.down, h, i)?;
        }
        expect(&self.head, self.dims.vocab as usize, h)?;
        expect(&self.embed, self.dims.vocab as usize, h)
    }

    /// The devices the graph computes on, with the bytes of each workspace.
    pub fn workspaces(&self) -> Vec<(String, u64)> {
        self.sites
            .iter()
            .map(|s| (s.device.name().to_owned(), s.layout.bytes))
            .collect()
    }

    /// Run `ids` through the model, appending to `cache` at its `seq_len`, and write the
    /// logits asked for into `out` (`rows × vocab`, row-major). Returns the copies made.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        held: &[Held],
        copies: &[(usize, Held)],
        scratch: &mut [Buffer],
        cache: &Arc<Cache>,
        ids: &[u32],
        logits: Logits,
        (compute, int8_threshold): (Compute, f32),
        out: &mut Vec<f32>,
    ) -> Result<Copies> {
        let vocab = self.dims.vocab as usize;
        let start = check_tokens(ids, self.dims.vocab, cache)? as usize;
        let rows = match logits {
            Logits::Last => 1,
            Logits::All => ids.len(),
        };
        out.clear();
        out.resize(rows * vocab, 0.0);
        let devs: Vec<Arc<Device>> = self.sites.iter().map(|s| Arc::clone(&s.device)).collect();

        // Every site's workspace at once (distinct buffers), as its path sees it.
        let mut spare: Vec<Option<&mut Buffer>> = scratch.iter_mut().map(Some).collect();
        let mut works: Vec<Work<'_>> = Vec::with_capacity(self.sites.len());
        // The onload slots: the tail of the execution device's workspace buffer.
        let onload_site = self
            .onload
            .as_ref()
            .map(|o| (o.site, o.slot_bytes, o.slots()));
        let mut slot_mem: Vec<Option<&mut [u8]>> = Vec::new();
        for (si, s) in self.sites.iter_mut().enumerate() {
            let Site {
                device,
                layout,
                own,
                scratch,
                exec,
            } = s;
            let buf = match (own, *scratch) {
                (Some(b), _) => b,
                (None, Some(i)) => spare[i].take().ok_or_else(|| {
                    invalid("forward workspaces", "one per device", "a shared buffer")
                })?,
                (None, None) => {
                    return Err(invalid(
                        "forward workspace",
                        "a buffer",
                        format!("none on {}", device.name()),
                    ));
                }
            };
            let work = match exec {
                SiteExec::Host => {
                    let name = device.name().to_owned();
                    let bytes = buf.host_mut().ok_or_else(|| EngineError::Device {
                        device: name,
                        detail: "the host forward pass needs a workspace in host memory".into(),
                    })?;
                    let bytes = match onload_site {
                        Some((os, per, n)) if os == si => {
                            let ws = layout.bytes as usize;
                            if bytes.len() < ws + per * n {
                                return Err(invalid(
                                    format!("scratch on {}", device.name()),
                                    format!(
                                        "{} bytes: workspace and {n} onload slot(s)",
                                        ws + per * n
                                    ),
                                    format!(
                                        "{}; the model was loaded for another plan",
                                        bytes.len()
                                    ),
                                ));
                            }
                            let (ws, mut tail) = bytes.split_at_mut(ws);
                            for _ in 0..n {
                                let (slot, rest) = std::mem::take(&mut tail).split_at_mut(per);
                                slot_mem.push(Some(slot));
                                tail = rest;
                            }
                            ws
                        }
                        _ => bytes,
                    };
                    Work::Host(carve(bytes, layout)?)
                }
                SiteExec::Cpu(b) => Work::Cpu(b, Regions::new(b, buf, layout)?),
                SiteExec::Cuda => {
                    let b = device.cuda_backend().ok_or_else(|| EngineError::Device {
                        device: device.name().to_owned(),
                        detail: "a cuda device without its backend".into(),
                    })?;
                    Work::Cuda(b, Regions::new(b, buf, layout)?)
                }
            };
            works.push(work);
        }

        let c = Consts {
            hidden: self.dims.hidden as usize,
            n_heads: self.dims.n_heads as usize,
            head_dim: self.dims.head_dim as usize,
            kv_tile: self.dims.kv_tile as usize,
            q_tile: self.dims.q_tile as usize,
            eps: self.eps,
            rope: self.rope,
            max_dq: self.max_dq,
            compute,
            int8_threshold,
        };
        let cx = |site: usize| Ctx {
            c: &c,
            held,
            copies,
            device: devs[site].name(),
        };
        let freqs: &[u8] = bytemuck::cast_slice(&self.inv_freqs);
        for (i, w) in works.iter_mut().enumerate() {
            on_site!(w, v => {
                let len = self.inv_freqs.len().min(v.freqs.len());
                let f = &mut v.freqs[..len];
                f.copy_from_slice(&self.inv_freqs[..f.len()]);
            }, (b, r) => {
                // only the sites that compute layers hold the table
                if b.len(&r.freqs) >= freqs.len() {
                    b.copy_from_host(freqs, &mut r.freqs, 0)
                        .map_err(|e| kernel_on(devs[i].name(), "rope frequencies", e))?;
                }
            });
        }
        let mut copies_made = Copies::default();
        let chunk = self.dims.tokens as usize;
        let h = c.hidden;
        let mut done = 0usize;
        std::thread::scope(|scope| -> Result<()> {
            let mut copier: Option<Copier<'_, '_>> = None;
            for part in ids.chunks(chunk) {
                let n = part.len();
                let pos = start + done;
                // Embedding rows, dequantised into the embedding device's residual stream.
                let es = self.embed_site;
                on_site!(&mut works[es], v => {
                let (ebytes, ety) = match weight_of(held, copies, &self.embed, None)? {
                    (b, Packing::Blocks(ty)) => (b, ty),
                    _ => return Err(invalid(
                        format!("embedding '{}'", self.embed.name),
                        "float or ggml rows",
                        "int8 rows",
                    )),
                };
                let row_bytes = ebytes.len() / self.embed.rows;
                for (t, id) in part.iter().enumerate() {
                    let r = *id as usize;
                    weightlift_kernels::dequantize_f32(
                        ety,
                        &ebytes[r * row_bytes..(r + 1) * row_bytes],
                        &mut v.x[t * h..(t + 1) * h],
                    )
                    .map_err(|e| kernel(&self.embed.name, e))?;
                }
            }, (b, r) => exec::embed(*b, &cx(es), &self.embed, part, &mut r.x)?);
                for (i, w) in works.iter_mut().enumerate() {
                    on_site!(w, _v => (), (b, r) => exec::positions(*b, devs[i].name(), pos, n, r)?);
                }
                let mut at = self.embed_site;
                for (li, layer) in self.layers.iter().enumerate() {
                    if layer.site != at {
                        move_rows(
                            &mut works,
                            &devs,
                            at,
                            layer.site,
                            0,
                            n * h,
                            &mut copies_made,
                        )?;
                        at = layer.site;
                    }
                    let slot = match (layer.group, self.onload.as_mut()) {
                        (Some(g), Some(o)) => {
                            let si = onload_group(
                                o,
                                g,
                                &self.layers,
                                held,
                                copies,
                                &mut slot_mem,
                                &mut copier,
                                scope,
                                &mut copies_made,
                            )?;
                            slot_mem[si].as_deref()
                        }
                        _ => None,
                    };
                    let wts = Weights { held, copies, slot };
                    on_site!(&mut works[at],
                    v => run_layer(&c, layer, li, &wts, cache, pos, n, v)?,
                    (b, r) => exec::layer(*b, &cx(at), layer, li, cache, pos, n, r)?);
                }
                cache.note_ids(pos as u64, part);
                cache.set_seq_len((pos + n) as u64)?;
                // The head: only the rows asked for.
                let first = match logits {
                    Logits::Last if done + n < ids.len() => {
                        done += n;
                        continue;
                    }
                    Logits::Last => n - 1,
                    Logits::All => 0,
                };
                let need = n - first;
                if self.head_site != at {
                    move_rows(
                        &mut works,
                        &devs,
                        at,
                        self.head_site,
                        first * h,
                        need * h,
                        &mut copies_made,
                    )?;
                }
                let per = self.dims.logit_rows as usize;
                let out_row0 = match logits {
                    Logits::Last => 0,
                    Logits::All => done,
                };
                let rows_out = &mut out[out_row0 * vocab..(out_row0 + need) * vocab];
                let hs = self.head_site;
                on_site!(&mut works[hs], w => {
                let xs = &w.x[first * h..(first + need) * h];
                weightlift_kernels::rms_norm(xs, &self.out_norm.host, c.eps, &mut w.xn[..need * h])
                    .map_err(|e| kernel("output_norm", e))?;
                let hw = Weights { held, copies, slot: None };
                for r0 in (0..need).step_by(per) {
                    let nr = per.min(need - r0);
                    let y = &mut w.logits[..nr * vocab];
                    linear_on(&c, &hw, &self.head, &w.xn[r0 * h..], nr, y)?;
                    rows_out[r0 * vocab..(r0 + nr) * vocab].copy_from_slice(y);
                }
            }, (b, r) => exec::head(*b, &cx(hs), &self.out_norm, &self.head, first, per, rows_out, r)?);
                done += n;
            }
            Ok(())
        })?;
        Ok(copies_made)
    }
}

/// One device's workspace for a forward call, as its path sees it.
// One per device per forward call, built once and never moved: the sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Work<'a> {
    /// The host path: f32 slices of host memory.
    Host(Views<'a>),
    /// The backend path on the CPU backend, over the same host memory.
    Cpu(&'a CpuBackend, Regions<'a, CpuBuffer>),
    /// The backend path on a CUDA device.
    Cuda(&'a CudaBackend, Regions<'a, CudaBuffer>),
}

/// Constants of one forward call.
pub(crate) struct Consts {
    pub hidden: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    pub kv_tile: usize,
    pub q_tile: usize,
    pub eps: f32,
    pub rope: RopeParams,
    pub max_dq: usize,
    pub compute: Compute,
    /// The LLM.int8 outlier threshold.
    pub int8_threshold: f32,
}

/// A matrix's bytes and packing: where the model holds it, or in `slot` (its group's onload slot)
/// when the layer is offloaded.
pub(crate) fn weight_of<'a>(
    held: &'a [Held],
    copies: &'a [(usize, Held)],
    l: &Linear,
    slot: Option<&'a [u8]>,
) -> Result<(&'a [u8], Packing)> {
    let h = match l.slot {
        Slot::Tensor(i) => &held[i],
        Slot::Copy(c) => &copies[c].1,
    };
    let (bytes, dtype) = host_bytes(h, &l.name)?;
    let packing = Packing::of(&l.name, dtype)?;
    match (slot, l.onload_at) {
        (Some(s), Some(at)) => {
            let b = s.get(at..at + bytes.len()).ok_or_else(|| {
                invalid(
                    format!("onloaded '{}'", l.name),
                    format!("{} bytes from offset {at}", bytes.len()),
                    format!("a slot of {} bytes", s.len()),
                )
            })?;
            Ok((b, packing))
        }
        _ => Ok((bytes, packing)),
    }
}

/// `y = W x (+ bias)` for `n` tokens: a matrix–vector product for one token, else a matrix
/// product that reuses each decoded weight across the tokens.
fn product(
    c: &Consts,
    packing: Packing,
    w: &[u8],
    l: &Linear,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<()> {
    let r = match packing {
        Packing::Int8 => weightlift_kernels::cpu::int8::int8_matmul_packed(
            w,
            l.rows,
            l.cols,
            x,
            n,
            c.int8_threshold,
            y,
        ),
        Packing::Blocks(ty) if n == 1 => matvec(c.compute.mode(ty), ty, w, l.rows, l.cols, x, y),
        Packing::Blocks(ty) => {
            let mode = c.compute.mode(ty);
            matmul(mode, ty, w, l.rows, l.cols, x, n, y, c.max_dq)
        }
    };
    r.map_err(|e| kernel(&l.name, e))?;
    add_bias(l, y);
    Ok(())
}

/// `y += bias`, per token.
fn add_bias(l: &Linear, y: &mut [f32]) {
    if let Some(b) = &l.bias {
        for yr in y.chunks_exact_mut(l.rows) {
            yr.iter_mut().zip(&b.host).for_each(|(v, b)| *v += b);
        }
    }
}

fn linear_on(
    c: &Consts,
    wts: &Weights<'_>,
    l: &Linear,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<()> {
    let (x, y) = (&x[..n * l.cols], &mut y[..n * l.rows]);
    if let Some(g) = &l.gptq {
        let b = g.bytes(wts.held, &l.name, l.rows, l.cols)?;
        g.product(&b, &l.name, l.rows, l.cols, x, n, y, c.max_dq)?;
        add_bias(l, y);
        return Ok(());
    }
    let (w, packing) = weight_of(wts.held, wts.copies, l, wts.slot)?;
    product(c, packing, w, l, x, n, y)
}

/// The residual stream of a site as host bytes, where it is host memory.
fn x_host<'w>(w: &'w Work<'_>) -> Option<&'w [u8]> {
    match w {
        Work::Host(v) => Some(bytemuck::cast_slice(&*v.x)),
        Work::Cpu(_, r) => Some(r.x.as_bytes()),
        Work::Cuda(..) => None,
    }
}

/// As [`x_host`], mutably.
fn x_host_mut<'w>(w: &'w mut Work<'_>) -> Option<&'w mut [u8]> {
    match w {
        Work::Host(v) => Some(bytemuck::cast_slice_mut(&mut *v.x)),
        Work::Cpu(_, r) => Some(r.x.as_bytes_mut()),
        Work::Cuda(..) => None,
    }
}

/// Copies `dst.len()` bytes of a device's residual stream at byte `offset` to the host.
fn read_x(w: &Work<'_>, name: &str, offset: usize, dst: &mut [u8]) -> Result<()> {
    match w {
        Work::Cuda(b, r) => b
            .copy_to_host(&r.x, offset, dst)
            .map_err(|e| kernel_on(name, "copying the hidden state out", e)),
        _ => {
            let src = x_host(w).and_then(|x| x.get(offset..offset + dst.len()));
            let src = src.ok_or_else(|| invalid("hidden state copy", "in range", offset))?;
            dst.copy_from_slice(src);
            Ok(())
        }
    }
}

/// Copies host bytes into a device's residual stream at byte `offset`.
fn write_x(w: &mut Work<'_>, name: &str, offset: usize, src: &[u8]) -> Result<()> {
    match w {
        Work::Cuda(b, r) => b
            .copy_from_host(src, &mut r.x, offset)
            .map_err(|e| kernel_on(name, "copying the hidden state in", e)),
        _ => {
            let dst = x_host_mut(w).and_then(|x| x.get_mut(offset..offset + src.len()));
            let dst = dst.ok_or_else(|| invalid("hidden state copy", "in range", offset))?;
            dst.copy_from_slice(src);
            Ok(())
        }
    }
}

/// Copy `len` values of the residual stream at `offset` from site `from` to site `to`: a
/// memcpy between host memories, or through the CUDA backend's copies to and from the host.
fn move_rows(
    works: &mut [Work<'_>],
    devs: &[Arc<Device>],
    from: usize,
    to: usize,
    offset: usize,
    len: usize,
    copies: &mut Copies,
) -> Result<()> {
    let (src, dst) = if from < to {
        let (a, b) = works.split_at_mut(to);
        (&a[from], &mut b[0])
    } else {
        let (a, b) = works.split_at_mut(from);
        (&b[0], &mut a[to])
    };
    let since = std::time::Instant::now();
    let (at, bytes) = (offset * 4, len * 4);
    let (sn, dn) = (devs[from].name(), devs[to].name());
    if let Some(s) = x_host(src) {
        let s = s
            .get(at..at + bytes)
            .ok_or_else(|| invalid("hidden state copy", "in range", at))?;
        write_x(dst, dn, at, s)?;
    } else if let Some(d) = x_host_mut(dst) {
        let d = d
            .get_mut(at..at + bytes)
            .ok_or_else(|| invalid("hidden state copy", "in range", at))?;
        read_x(src, sn, at, d)?;
    } else {
        let mut tmp = vec![0u8; bytes];
        read_x(src, sn, at, &mut tmp)?;
        write_x(dst, dn, at, &tmp)?;
    }
    pace_link(&devs[from], &devs[to], bytes as u64, since);
    copies.note(bytes as u64, since);
    Ok(())
}

/// Where a layer's matrices are read: the model's tensors, or its group's onload slot.
struct Weights<'a> {
    held: &'a [Held],
    copies: &'a [(usize, Held)],
    slot: Option<&'a [u8]>,
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// One decoder layer on `n` tokens at positions `pos..pos + n`, in place on `w.x`.
#[allow(clippy::too_many_arguments)]
fn run_layer(
    c: &Consts,
    l: &Layer,
    li: usize,
    wts: &Weights<'_>,
    cache: &Arc<Cache>,
    pos: usize,
    n: usize,
    w: &mut Views<'_>,
) -> Result<()> {
    let (h, hd, nh) = (c.hidden, c.head_dim, c.n_heads);
    let (qd, kvd) = (nh * hd, l.kv_heads * hd);
    let err = |what: &'static str| move |e| kernel(&format!("layer {li} {what}"), e);
    // attention
    weightlift_kernels::rms_norm(&w.x[..n * h], &l.attn_norm.host, c.eps, &mut w.xn[..n * h])
        .map_err(err("attn_norm"))?;
    linear_on(c, wts, &l.q, w.xn, n, w.q)?;
    linear_on(c, wts, &l.k, w.xn, n, w.k)?;
    linear_on(c, wts, &l.v, w.xn, n, w.v)?;
    for (t, p) in w.pos[..n].iter_mut().enumerate() {
        *p = (pos + t) as i32;
    }
    let freqs = &w.freqs[..c.rope.n_dims / 2];
    weightlift_kernels::rope_in_place(&mut w.q[..n * qd], &w.pos[..n], &c.rope, freqs)
        .map_err(err("rope"))?;
    weightlift_kernels::rope_in_place(&mut w.k[..n * kvd], &w.pos[..n], &c.rope, freqs)
        .map_err(err("rope"))?;
    cache.write_rows(li, pos as u64, &w.k[..n * kvd], &w.v[..n * kvd])?;
    let resident = if cache.is_offloaded() {
        Some(cache.fetch(li)?)
    } else {
        None
    };
    let shape = Shape {
        n_heads: nh,
        kv_heads: l.kv_heads,
        head_dim: hd,
        kv_tile: c.kv_tile,
        q_tile: c.q_tile,
        f16_operands: c.compute == Compute::Fast
            && cache.config().dtype == crate::cache::CacheDType::Fp16,
    };
    let tiles = Tiles {
        kt: w.kt,
        vt: w.vt,
        scores: w.scores,
        stats: w.stats,
        acc: w.att,
    };
    // The rotated queries are read from `q`; the attention output replaces them there.
    attention::attend(
        shape,
        cache,
        li,
        resident.as_ref(),
        pos,
        &mut w.q[..n * qd],
        tiles,
    )?;
    drop(resident);
    linear_on(c, wts, &l.o, w.q, n, w.xn)?;
    add_in_place(&mut w.x[..n * h], &w.xn[..n * h]);
    // MLP
    weightlift_kernels::rms_norm(&w.x[..n * h], &l.ffn_norm.host, c.eps, &mut w.xn[..n * h])
        .map_err(err("ffn_norm"))?;
    let i = l.gate.rows;
    linear_on(c, wts, &l.gate, w.xn, n, w.gate)?;
    linear_on(c, wts, &l.up, w.xn, n, w.up)?;
    swiglu_in_place(&mut w.gate[..n * i], &w.up[..n * i]).map_err(err("swiglu"))?;
    linear_on(c, wts, &l.down, w.gate, n, w.xn)?;
    add_in_place(&mut w.x[..n * h], &w.xn[..n * h]);
    Ok(())
}

/// `gate = silu(gate) * up`, through the kernel in stack-sized pieces.
pub(super) fn swiglu_in_place(gate: &mut [f32], up: &[f32]) -> weightlift_kernels::Result<()> {
    use rayon::prelude::*;
    const PIECE: usize = 1024;
    gate.par_chunks_mut(PIECE)
        .zip(up.par_chunks(PIECE))
        .try_for_each(|(g, u)| {
            let mut tmp = [0f32; PIECE];
            let t = &mut tmp[..g.len()];
            weightlift_kernels::swiglu(g, u, t)?;
            g.copy_from_slice(t);
            Ok(())
        })
}

/// RoPE pairing and per-pair angles: adjacent pairs for GGUF llama/mistral (whose q/k rows
/// the converter permuted), rotate-half (NeoX) for qwen2 and for Hugging Face checkpoints;
/// Llama 3 frequency factors from `rope_freqs.weight` or the config's `rope_scaling`.
pub(super) fn rope_of(m: &Loaded<'_>, spec: &ModelSpec) -> Result<(RopeParams, Vec<f32>)> {
    let gguf = m.source.checkpoint().map(|c| c.format()) == Some(Format::Gguf);
    let style = if gguf && spec.architecture != "qwen2" {
        RopeStyle::Normal
    } else {
        RopeStyle::Neox
    };
    let head_dim = spec.head_dim as usize;
    let n_dims = (spec.rope_dim as usize).clamp(2, head_dim) & !1;
    let mut p = RopeParams {
        style,
        head_dim,
        n_dims,
        freq_base: spec.rope_theta as f32,
        freq_scale: 1.0,
    };
    let infos = m.source.tensors();
    let factors = match infos.iter().position(|t| t.role == Some(Role::RopeFreqs)) {
        Some(i) => Some(f32_vector(&m.held[i], &infos[i])?),
        None => {
            let cfg = m.source.checkpoint().and_then(|c| c.config());
            match cfg.and_then(rope_scaling) {
                Some(Scaling::Linear(f)) => {
                    p.freq_scale = 1.0 / f;
                    None
                }
                Some(Scaling::Llama3 {
                    factor,
                    low,
                    high,
                    original,
                }) => Some(llama3_factors(&p, factor, low, high, original)),
                None => None,
            }
        }
    };
    let inv = weightlift_kernels::rope_inv_freqs(&p, factors.as_deref())
        .map_err(|e| kernel("rope frequencies", e))?;
    Ok((p, inv))
}

enum Scaling {
    Linear(f32),
    Llama3 {
        factor: f32,
        low: f32,
        high: f32,
        original: f32,
    },
}

/// `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5) of a config.
fn rope_scaling(cfg: &serde_json::Value) -> Option<Scaling> {
    let r = cfg
        .get("rope_scaling")
        .filter(|v| !v.is_null())
        .or_else(|| cfg.get("rope_parameters"))?;
    let kind = r
        .get("rope_type")
        .or_else(|| r.get("type"))
        .and_then(|v| v.as_str())?;
    let num = |k: &str| {
        r.get(k)
            .and_then(serde_json::Value::as_f64)
            .map(|v| v as f32)
    };
    match kind {
        "linear" => Some(Scaling::Linear(num("factor")?)),
        "llama3" => Some(Scaling::Llama3 {
            factor: num("factor")?,
            low: num("low_freq_factor")?,
            high: num("high_freq_factor")?,
            original: num("original_max_position_embeddings")?,
        }),
        _ => None,
    }
}

/// Llama 3's per-pair divisors of the angle (transformers' `_compute_llama3_parameters`):
/// long wavelengths slow down by `factor`, short ones stay, and the band between is blended.
fn llama3_factors(p: &RopeParams, factor: f32, low: f32, high: f32, original: f32) -> Vec<f32> {
    let low_wavelen = original / low;
    let high_wavelen = original / high;
    (0..p.n_dims / 2)
        .map(|i| {
            let inv = p.freq_base.powf(-2.0 * i as f32 / p.n_dims as f32);
            let wavelen = 2.0 * std::f32::consts::PI / inv;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                let scaled = (1.0 - smooth) * inv / factor + smooth * inv;
                inv / scaled
            }
        })
        .collect()
}

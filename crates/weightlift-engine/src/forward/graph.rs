//! The llama-family graph over a loaded model: which held tensor plays which part in each
//! layer, on which device each part computes, and the forward call that runs it.
//!
//! The family variants are data read once from the checkpoint, never tests on the
//! architecture name inside the layer code: the RoPE pairing
//! ([`RopeStyle`](weightlift_kernels::RopeStyle)), the q/k/v biases (qwen2), the per-head
//! q/k RMSNorms (qwen3), stacked qkv and gate_up matrices read by row blocks (phi3), a tied
//! head (`token_embd` when there is no `output.weight`) and Llama 3 frequency factors.
//!
//! Each device computes its parts one of two ways ([`SiteExec`]): the host path of
//! [`super::layer`] (the CPU kernels on slices of host memory: `cpu`, `disk`, `virtual:N`), or
//! the op sequence of [`super::exec`] through the kernels' `Backend` trait (`cuda:N`, and host
//! devices when asked). Hidden states move between devices the same way whichever path each
//! side takes.

mod run;
mod step;

pub(crate) use step::enabled_by_env as cuda_graphs_by_env;

use std::sync::Arc;

use std::collections::HashMap;

use weightlift_format::{ModelSpec, MoeSpec, Role, expert_of, is_quantized_part};
use weightlift_kernels::{CpuBackend, RopeParams};
use weightlift_plan::{Dims, Hosts, RuntimeSpec, Workspace};

use super::family::Family;
use super::onload::Onload;
use super::parts::{Ffn, Floats, Layer, Linear, Moe, Slot, floats, place, shifted};
use super::rope::rope_of;
use super::weights::{PackedLinear, Packing, runnable_quantization};
use super::{Site, SiteExec};
use crate::device::{Buffer, Device, DeviceKind, link_rate};
use crate::error::{EngineError, Result, invalid};
use crate::model::Held;
use crate::source::Source;

/// The architectures the forward pass runs: those whose tensor roles the format crate knows.
pub const SUPPORTED: &[&str] = ModelSpec::SUPPORTED_ARCHITECTURES;

/// `Ok` when the forward pass runs `architecture`; otherwise the refusal, naming what the
/// architecture needs that the engine lacks. Loading checks this before it reads a byte, so a
/// model the engine cannot run is refused at `load` and still opens and plans.
pub fn check_runs(architecture: &str) -> Result<()> {
    if SUPPORTED.contains(&architecture) {
        return Ok(());
    }
    let needs = match architecture {
        "gemma" => "Gemma 1's layer list (gemma2 and gemma3 run)",
        "gemma3n" => "Gemma 3n's per-layer embeddings and its AltUp and LAuReL blocks",
        "qwen2moe" | "deepseek" => {
            "mixture-of-experts routing with shared experts (mixtral and qwen3moe run)"
        }
        "deepseek2" => "multi-head latent attention (MLA) and mixture-of-experts routing",
        "mamba" | "mamba2" => "state-space (selective scan) layers instead of attention",
        "bert" | "nomic-bert" | "jina-bert-v2" => "a bidirectional encoder with absolute positions",
        _ => "its own layer definitions",
    };
    Err(EngineError::Unsupported {
        what: format!("running the '{architecture}' architecture"),
        detail: format!(
            "the forward pass runs {}, and '{architecture}' needs {needs}; inspect and plan \
             still work for it",
            SUPPORTED.join(", ")
        ),
    })
}

/// `Ok` when the tensor-parallel pass runs `architecture` (it runs the forward pass's
/// architectures, gemma's with its post-norms on the reduced rows, and mixtral's and qwen3moe's
/// experts split whole by the expert table).
pub fn check_tensor_parallel(architecture: &str) -> Result<()> {
    check_runs(architecture)
}

/// The routing of the checkpoint's expert layers (GGUF metadata or config.json); `None` for a
/// dense model.
pub(super) fn moe_spec_of(m: &Loaded<'_>) -> Result<Option<MoeSpec>> {
    let Some(ck) = m.source.checkpoint() else {
        return Ok(None);
    };
    crate::planned::moe_of(ck).map_err(|e| EngineError::Validation {
        path: m.source.path().to_path_buf(),
        architecture: ck
            .spec()
            .map_or_else(|_| String::new(), |s| s.architecture.clone()),
        problems: format!("expert routing: {e}"),
    })
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
    family: Family,
    /// The decode step captured as a CUDA graph (see `step`).
    steps: step::StepGraphs,
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
        check_runs(&spec.architecture)?;
        let infos = m.source.tensors();
        // GPTQ and EXL2 linears run: their packed tensors stand for the weight.
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
                      packed: Option<PackedLinear>,
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
                packed,
                part: None,
                rows_of: None,
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
        // A projection: a packed linear where the checkpoint has one for the role, else its
        // weight.
        let matrix = |role: Role, bias: Option<Role>, layer: Option<u32>| -> Result<Linear> {
            match quantized(role, layer) {
                Some(q) => {
                    let p = PackedLinear::new(q, infos)?;
                    let slot = Slot::Tensor(p.codes());
                    let dims = (q.out_features(), q.in_features());
                    finish(slot, q.prefix(), dims, Some(p), bias, layer)
                }
                None => linear(need(role, layer)?, bias, layer),
            }
        };
        let family = Family::of(m, spec)?;
        let norm = |i: usize| shifted(m.held, infos, i, family.norm_offset);
        let optional = |role: Role, layer: Option<u32>| -> Result<Option<Floats>> {
            find(role, layer).map(norm).transpose()
        };
        let (rope, inv_freqs) = rope_of(m, spec, seq_batch.0)?;
        let mut rope_tables = family.rope_tables(&rope)?;
        // The row blocks of a stacked matrix (phi3's qkv and gate_up), `parts` rows each in
        // order, each multiplied as a matrix of its own from its rows of the held tensor.
        let stacked = |role: Role, parts: &[usize], layer: Option<u32>| -> Result<Vec<Linear>> {
            let i = need(role, layer)?;
            if quantized(role, layer).is_some() {
                return Err(EngineError::Unsupported {
                    what: format!("a packed (GPTQ or EXL2) stacked matrix '{}'", infos[i].name),
                    detail: "stacked qkv and gate_up matrices run from float or ggml weights"
                        .into(),
                });
            }
            let total: usize = parts.iter().sum();
            let mut first = 0;
            let mut out = Vec::with_capacity(parts.len());
            for &rows in parts {
                let mut l = linear(i, None, layer)?;
                if l.rows != total {
                    let sizes: Vec<String> = parts.iter().map(usize::to_string).collect();
                    return Err(invalid(
                        format!("tensor '{}'", l.name),
                        format!("{total} rows ({}) for this architecture", sizes.join(" + ")),
                        format!("{} rows", l.rows),
                    ));
                }
                l.name = format!("{} rows {first}..{}", l.name, first + rows);
                l.rows = rows;
                l.rows_of = Some((first, total));
                first += rows;
                out.push(l);
            }
            Ok(out)
        };

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
        // Mixture of experts: the routing, and each expert's own tensor (transformers' names)
        // by (layer, role, expert).
        let moe_spec = moe_spec_of(m)?;
        let per_expert: HashMap<(u32, Role, u32), usize> = infos
            .iter()
            .enumerate()
            .filter_map(|(i, t)| Some(((t.layer?, t.role?, expert_of(&t.name)?), i)))
            .collect();
        let moe = |router: usize, l: u32| -> Result<Moe> {
            let at = Some(l);
            let Some(ms) = &moe_spec else {
                return Err(EngineError::Validation {
                    path: m.source.path().to_path_buf(),
                    architecture: spec.architecture.clone(),
                    problems: format!(
                        "layer {l} has a router '{}' but the checkpoint names no expert count \
                         (expert_count, num_experts or num_local_experts)",
                        infos[router].name
                    ),
                });
            };
            let n = ms.n_experts as usize;
            let expert = |role: Role, e: usize| -> Result<Linear> {
                if let Some(&i) = per_expert.get(&(l, role, e as u32)) {
                    return linear(i, None, at);
                }
                // one 3-D tensor of every expert's matrices: expert e is its rows
                // e·rows..(e + 1)·rows
                let i = infos
                    .iter()
                    .position(|t| {
                        t.role == Some(role) && t.layer == at && expert_of(&t.name).is_none()
                    })
                    .ok_or_else(|| EngineError::Validation {
                        path: m.source.path().to_path_buf(),
                        architecture: spec.architecture.clone(),
                        problems: format!("layer {l} has no {} tensor of expert {e}", role.name()),
                    })?;
                let info = &infos[i];
                let [experts, rows, cols] = info.shape[..] else {
                    return Err(invalid(
                        format!("tensor '{}'", info.name),
                        "a 3-D tensor [experts, rows, columns]",
                        format!("shape {:?}", info.shape),
                    ));
                };
                if experts as usize != n {
                    return Err(invalid(
                        format!("tensor '{}'", info.name),
                        format!("{n} experts (the checkpoint's expert count)"),
                        experts,
                    ));
                }
                let (rows, cols) = (rows as usize, cols as usize);
                let name = format!("{} expert {e}", info.name);
                let mut lin = finish(Slot::Tensor(i), &name, (rows, cols), None, None, at)?;
                lin.rows_of = Some((e * rows, n * rows));
                Ok(lin)
            };
            let experts = (0..n)
                .map(|e| {
                    Ok([
                        expert(Role::FfnGateExps, e)?,
                        expert(Role::FfnUpExps, e)?,
                        expert(Role::FfnDownExps, e)?,
                    ])
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Moe {
                router: linear(router, None, at)?,
                experts,
                first: 0,
                n_used: ms.n_used as usize,
                norm_topk_prob: ms.norm_topk_prob,
                experts_on_host: false,
            })
        };

        let embd = need(Role::TokenEmbd, None)?;
        let head_packed = match quantized(Role::Output, None) {
            Some(_) => Some(matrix(Role::Output, None, None)?),
            None => None,
        };
        let (head_slot, head_dev) = match (&head_packed, find(Role::Output, None)) {
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
        let head = match head_packed {
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
        let dims_q = spec.n_heads as usize * spec.head_dim as usize;
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
            let qk_norm = if spec.per_head_qk_norm() {
                Some([
                    norm(need(Role::AttnQNorm, at)?)?,
                    norm(need(Role::AttnKNorm, at)?)?,
                ])
            } else {
                None
            };
            let kv_heads = spec.n_kv_heads_at(l) as usize;
            let router = find(Role::FfnGateInp, at);
            let (q, k, v, ffn) = if let Some(r) = router {
                if spec.fused_projections() {
                    return Err(EngineError::Unsupported {
                        what: format!("experts in a '{}' layer", spec.architecture),
                        detail: "routed experts run beside separate q/k/v projections".into(),
                    });
                }
                let [q, k, v] = [
                    matrix(Role::AttnQ, Some(Role::AttnQBias), at)?,
                    matrix(Role::AttnK, Some(Role::AttnKBias), at)?,
                    matrix(Role::AttnV, Some(Role::AttnVBias), at)?,
                ];
                let ffn = Ffn::Moe(moe(r, l)?);
                (q, k, v, ffn)
            } else if spec.fused_projections() {
                let (qd, kvd) = (dims_q, kv_heads * spec.head_dim as usize);
                let inter = spec.intermediate_size as usize;
                let qkv = stacked(Role::AttnQkv, &[qd, kvd, kvd], at)?;
                let gate_up = stacked(Role::FfnGateUp, &[inter, inter], at)?;
                match (
                    <[Linear; 3]>::try_from(qkv),
                    <[Linear; 2]>::try_from(gate_up),
                ) {
                    (Ok([q, k, v]), Ok([gate, up])) => {
                        let down = matrix(Role::FfnDown, None, at)?;
                        (q, k, v, Ffn::Dense { gate, up, down })
                    }
                    _ => return Err(invalid("stacked matrices", "3 and 2 row blocks", "others")),
                }
            } else {
                let [q, k, v, gate, up, down] = [
                    matrix(Role::AttnQ, Some(Role::AttnQBias), at)?,
                    matrix(Role::AttnK, Some(Role::AttnKBias), at)?,
                    matrix(Role::AttnV, Some(Role::AttnVBias), at)?,
                    matrix(Role::FfnGate, None, at)?,
                    matrix(Role::FfnUp, None, at)?,
                    matrix(Role::FfnDown, None, at)?,
                ];
                (q, k, v, Ffn::Dense { gate, up, down })
            };
            layers.push(Layer {
                site: s,
                kv_heads,
                attn_norm: norm(need(Role::AttnNorm, at)?)?,
                q,
                k,
                v,
                o: matrix(Role::AttnOutput, Some(Role::AttnOutputBias), at)?,
                qk_norm,
                ffn_norm: norm(need(Role::FfnNorm, at)?)?,
                ffn,
                post_attn_norm: optional(Role::AttnPostNorm, at)?,
                post_ffn_norm: optional(Role::FfnPostNorm, at)?,
                window: family.windows[l as usize],
                rope: rope_tables[l as usize]
                    .take()
                    .map(|t| Floats::computed(format!("layer {l} rope angles"), t)),
                group: None,
            });
        }
        let head_site = site(&head_dev, &|h| h.head = true);
        let out_norm = norm(need(Role::OutputNorm, None)?)?;
        let mut embed = linear(embd, None, None)?;
        embed.slot = Slot::Tensor(embd);

        // the plan sizes the MLP regions for the experts the same way
        let dense = weightlift_plan::has_dense_layers(spec.n_layers, infos);
        let dims = Dims::new(spec, runtime, seq_batch.0, seq_batch.1)
            .with_experts(moe_spec.as_ref(), dense);
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
                    pins: None,
                    pin_warning: None,
                })
            }
            _ => None,
        };
        let sites = sites
            .into_iter()
            .enumerate()
            .map(|(i, (name, hosts))| -> Result<Site> {
                let device = (m.resolve)(&name)?;
                // CUDA's attention kernels keep their tiles on the chip: no host tiles
                // (the plan charges the same layout)
                let layout = match device.kind() {
                    DeviceKind::Cuda => Workspace::for_kernel_attention(&dims, hosts),
                    _ => Workspace::new(&dims, hosts),
                };
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
                    rope_table: false,
                })
            })
            .collect::<Result<Vec<_>>>()?;

        // An offloaded MoE layer copies its router and every expert into its onload slot (they
        // are among `Layer::linears`), each expert of a stacked tensor its own rows, and
        // computes them there, as weight offload streams every weight. Otherwise, through the
        // backend op sequence a MoE layer's experts are computed where the model holds them:
        // by the host when they are all whole in host memory (host RAM or the mapped file, as
        // `n_cpu_moe` or an `exps` override leave them), else by the computing device when it
        // holds them all; any other split is refused by name.
        let onloaded = |li: usize| {
            m.onload
                .is_some_and(|p| p.groups.iter().flatten().any(|&l| l as usize == li))
        };
        for (li, l) in layers.iter_mut().enumerate() {
            let site = &sites[l.site];
            let Ffn::Moe(moe) = &mut l.ffn else { continue };
            if matches!(site.exec, SiteExec::Host) {
                continue;
            }
            if onloaded(li) {
                super::exec::check_moe_workspace(&site.device, &site.layout, moe, li)?;
                continue;
            }
            let whole = |lin: &Linear| match lin.slot {
                Slot::Tensor(i) => m.held.get(i),
                Slot::Copy(c) => m.copies.get(c).map(|(_, h)| h),
            };
            let in_host = |lin: &Linear| {
                matches!(whole(lin), Some(Held::Whole { tensor, .. })
                    if tensor.device().kind() == DeviceKind::Cpu && tensor.host_bytes().is_some())
            };
            let on_site = |lin: &Linear| {
                matches!(whole(lin), Some(Held::Whole { tensor, .. })
                    if tensor.device().name() == site.device.name())
            };
            let all = |f: &dyn Fn(&Linear) -> bool| moe.experts.iter().flatten().all(f);
            if all(&in_host) {
                moe.experts_on_host = true;
                super::exec::check_moe_workspace(&site.device, &site.layout, moe, li)?;
                continue;
            }
            if all(&on_site) {
                super::exec::check_moe_workspace(&site.device, &site.layout, moe, li)?;
                continue;
            }
            let odd = moe
                .experts
                .iter()
                .flatten()
                .find(|lin| !on_site(lin))
                .ok_or_else(|| invalid("experts", "one held elsewhere", "none"))?;
            let held_on = whole(odd).map_or_else(|| "nowhere".into(), &device_of);
            return Err(super::exec::experts_split(
                li,
                &odd.name,
                &held_on,
                site.device.name(),
            ));
        }
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
            family,
            steps: step::StepGraphs::default(),
        };
        g.check_shapes(spec)?;
        g.check_packings(m.held, m.copies)?;
        g.place_floats(m.held)?;
        if let Some(o) = g.onload.as_mut() {
            o.assign(&mut g.layers, m.held)?;
            let device = Arc::clone(&g.sites[o.site].device);
            o.pin_warning = o.pin(&device, &g.layers, m.held, m.copies)?;
        }
        Ok(g)
    }

    /// Decode steps captured as a CUDA graph, and replayed, since the graph was built; and why
    /// the driver refused the last capture, if it did.
    pub(crate) fn cuda_graph_counts(&self) -> (u64, u64, Option<String>) {
        let s = &self.steps;
        (s.captures, s.replays, s.refused().map(str::to_owned))
    }

    /// What building the graph found worth telling the user (host memory the driver would not
    /// page-lock for offloaded copies), once.
    pub(crate) fn take_warnings(&mut self) -> Vec<String> {
        self.onload
            .as_mut()
            .and_then(|o| o.pin_warning.take())
            .into_iter()
            .collect()
    }

    /// Every matrix can be multiplied where it computes: the embedding is a lookup of block or
    /// float rows; packed (GPTQ and EXL2) linears run on the host path, from where the model
    /// holds them or, offloaded, from their copies in an onload slot of a host device.
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
        for l in self.layers.iter().flat_map(Layer::linears) {
            if let (Some(_), Some(d)) = (l.rows_of, dtype(l))
                && !matches!(Packing::of(&l.name, d)?, Packing::Blocks(_))
            {
                return Err(EngineError::Unsupported {
                    what: format!("'{}' held as {d}", l.name),
                    detail: "a block of a stacked qkv or gate_up matrix is read as its rows of \
                             float or ggml blocks; LLM.int8 packs the whole matrix (load without \
                             quantize=\"int8\")"
                        .into(),
                });
            }
        }
        let packed_off_host = |site: usize, l: &Linear| -> Result<()> {
            let s = &self.sites[site];
            if let Some(scheme) = l.packed()
                && !matches!(s.exec, SiteExec::Host)
            {
                return Err(EngineError::Unsupported {
                    what: format!(
                        "{scheme} linear '{}' computed on {} through the backend op sequence",
                        l.name,
                        s.device.name()
                    ),
                    detail: format!(
                        "{scheme} linears run on the host path (cpu, disk, virtual:N) for now; \
                         place their layers there, and leave the host backend off"
                    ),
                });
            }
            Ok(())
        };
        for l in &self.layers {
            for lin in l.linears() {
                packed_off_host(l.site, lin)?;
            }
        }
        packed_off_host(self.head_site, &self.head)?;
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
            for n in l.qk_norm.iter_mut().flatten() {
                place(n, held, &dev)?;
            }
            for f in [&mut l.post_attn_norm, &mut l.post_ffn_norm, &mut l.rope]
                .into_iter()
                .flatten()
            {
                place(f, held, &dev)?;
            }
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
        // the dense layers' width; the MLP regions (`dims.inter`) are at least as wide
        let i = spec.intermediate_size as usize;
        let region = self.dims.inter as usize;
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
            for n in l.qk_norm.iter().flatten() {
                if n.host.len() != hd {
                    return Err(invalid(
                        format!("tensor '{}'", n.name),
                        format!("{hd} values (one per head dimension)"),
                        n.host.len(),
                    ));
                }
            }
            match &l.ffn {
                Ffn::Dense { gate, up, down } => {
                    expect(gate, i, h)?;
                    expect(up, i, h)?;
                    expect(down, h, i)?;
                }
                Ffn::Moe(m) => {
                    expect(&m.router, m.experts.len(), h)?;
                    for [gate, up, down] in &m.experts {
                        let f = gate.rows;
                        expect(up, f, h)?;
                        expect(gate, f, h)?;
                        expect(down, h, f)?;
                    }
                }
            }
            // the post-norms' output is written to the gate region on the way back
            if (l.post_attn_norm.is_some() || l.post_ffn_norm.is_some()) && region < h {
                return Err(EngineError::Unsupported {
                    what: format!(
                        "post-norms with an intermediate size {region} below the hidden size {h}"
                    ),
                    detail: "the forward pass norms the block outputs through the MLP's workspace"
                        .into(),
                });
            }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_parallel_runs_gemma() {
        for arch in ["gemma2", "gemma3", "gemma3_text"] {
            assert!(check_tensor_parallel(arch).is_ok(), "{arch}");
        }
        assert!(check_tensor_parallel("qwen2").is_ok());
        // mixture-of-experts layers run by the expert table
        assert!(check_tensor_parallel("mixtral").is_ok());
        assert!(check_tensor_parallel("qwen3_moe").is_ok());
        // an architecture the engine does not run is refused as at load
        assert!(check_tensor_parallel("mamba").is_err());
    }
}

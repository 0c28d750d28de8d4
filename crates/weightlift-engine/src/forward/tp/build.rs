//! Building the tensor-parallel graph: each device's part of every split tensor, checked
//! against the tables, and everything the tensor-parallel pass cannot run refused by name
//! before any compute.

use super::*;
use std::collections::HashMap;
use weightlift_format::{MoeSpec, expert_of};
use weightlift_kernels::CpuBackend;

/// What the tensor-parallel pass cannot run, refused by name.
fn refuse(what: String, detail: &str) -> EngineError {
    EngineError::Unsupported {
        what,
        detail: detail.to_owned(),
    }
}

/// f32 values of a held tensor's part `p` (a replicated norm, a bias slice).
fn part_f32(held: &Held, p: usize, name: &str) -> Result<Vec<f32>> {
    let Held::Split { parts, .. } = held else {
        let (bytes, ty) = super::super::host_weight(held, name)?;
        let n = bytes.len() / ty.block_bytes() * ty.block_size();
        let mut out = vec![0f32; n];
        weightlift_kernels::dequantize_f32(ty, bytes, &mut out).map_err(|e| kernel(name, e))?;
        return Ok(out);
    };
    let t = parts.get(p).ok_or_else(|| {
        invalid(
            format!("parts of '{name}'"),
            format!("a part {p}"),
            parts.len(),
        )
    })?;
    let ty = super::super::exec::kernel_type(name, t.dtype())?;
    // a part in device memory (a norm replica on a GPU) is read back once, at build
    let read;
    let bytes = match t.host_bytes() {
        Some(b) => b,
        None => {
            read = t.to_host()?;
            &read
        }
    };
    let mut out = vec![0f32; t.shape().iter().product::<u64>() as usize];
    weightlift_kernels::dequantize_f32(ty, bytes, &mut out).map_err(|e| kernel(name, e))?;
    Ok(out)
}

/// Which part of a split tensor lives on `device`.
fn part_on(held: &Held, device: &str, name: &str) -> Result<usize> {
    match held {
        Held::Split { parts, .. } => parts
            .iter()
            .position(|t| t.device().name() == device)
            .ok_or_else(|| {
                invalid(
                    format!("parts of '{name}'"),
                    format!("one on {device}"),
                    "none",
                )
            }),
        Held::Whole { device: d, .. } => Err(invalid(
            format!("tensor '{name}' under tensor parallelism"),
            "split over the tp devices",
            format!("whole on {d}; the model was not loaded with load_tp"),
        )),
    }
}

struct Ctx<'a> {
    infos: &'a [TensorInfo],
    held: &'a [Held],
    copies: &'a [(usize, Held)],
    /// transformers' own tensor of each expert, by (layer, role, expert)
    per_expert: HashMap<(u32, Role, u32), usize>,
    /// Added to every norm weight as it is read ([`super::super::family::Family::norm_offset`]).
    norm_offset: f32,
}

impl Ctx<'_> {
    fn find(&self, role: Role, layer: Option<u32>) -> Option<usize> {
        self.infos
            .iter()
            .position(|t| t.role == Some(role) && t.layer == layer && !is_quantized_part(&t.name))
    }

    fn need(&self, role: Role, layer: Option<u32>) -> Result<usize> {
        self.find(role, layer).ok_or_else(|| {
            invalid(
                format!("{} of layer {layer:?}", role.name()),
                "a tensor in the checkpoint",
                "none",
            )
        })
    }

    /// A replicated vector's copy on `device`.
    fn replica(&self, i: usize, device: &str) -> Result<Vec<f32>> {
        let name = &self.infos[i].name;
        part_f32(&self.held[i], part_on(&self.held[i], device, name)?, name)
    }

    /// A replicated norm's weights on `device`, as the layer split reads them (`1 + w` where
    /// the checkpoint stores `w`).
    fn norm(&self, i: usize, device: &str) -> Result<Vec<f32>> {
        let mut w = self.replica(i, device)?;
        if self.norm_offset != 0.0 {
            w.iter_mut().for_each(|v| *v += self.norm_offset);
        }
        Ok(w)
    }

    /// Device `device`'s part of matrix `i` (or of copy `copy`), expected `rows × cols` and
    /// starting at `start` of its split axis, with its bias rows.
    #[allow(clippy::too_many_arguments)]
    fn mat(
        &self,
        i: usize,
        copy: Option<usize>,
        device: &str,
        (rows, cols): (usize, usize),
        start: u64,
        bias: Option<usize>,
    ) -> Result<Mat> {
        let name = self.infos[i].name.clone();
        let held = match copy {
            Some(c) => &self.copies[c].1,
            None => &self.held[i],
        };
        // A stacked matrix has several parts on a device: the one whose rows start at `start`.
        let p = match held {
            Held::Split { parts, spec } => parts
                .iter()
                .zip(&spec.shards)
                .position(|(t, s)| t.device().name() == device && s.1 == start),
            Held::Whole { .. } => None,
        };
        let p = match p {
            Some(p) => p,
            None => part_on(held, device, &name)?,
        };
        let Held::Split { parts, spec } = held else {
            return Err(invalid(format!("tensor '{name}'"), "split", "whole"));
        };
        let t = &parts[p];
        let packing = Packing::of(&name, t.dtype())?;
        let Packing::Blocks(ty) = packing else {
            return Err(refuse(
                format!("a tensor-parallel forward pass over LLM.int8 weight '{name}'"),
                "int8 linears are not split by the tp tables; load without quantize=\"int8\" \
                 or with a layer split",
            ));
        };
        let shard = spec.shards.get(p).map(|s| s.1);
        if t.shape() != [rows as u64, cols as u64] || shard != Some(start) {
            return Err(invalid(
                format!("part of '{name}' on {device}"),
                format!("{rows} × {cols} from {start}, as the tp tables split it"),
                format!("shape {:?} from {shard:?}", t.shape()),
            ));
        }
        let bias = match bias {
            Some(b) => {
                let v = part_f32(&self.held[b], part_on(&self.held[b], device, &name)?, &name)?;
                if v.len() != rows {
                    return Err(invalid(
                        format!("bias of '{name}' on {device}"),
                        format!("{rows} values"),
                        v.len(),
                    ));
                }
                Some(v)
            }
            None => None,
        };
        Ok(Mat {
            name,
            index: copy.unwrap_or(i),
            copy: copy.is_some(),
            part: p,
            rows,
            cols,
            ty,
            bias,
        })
    }
}

impl Ctx<'_> {
    /// Device `dev`'s share of layer `l`'s mixture-of-experts block: its replicas of the MLP
    /// norm and of the router (`router`), and experts `first..end` of the expert table, each
    /// its own tensor (transformers' names, whole on this device) or its rows of this device's
    /// part of a stacked GGUF tensor (the part holding exactly those experts).
    fn experts(
        &self,
        (l, router): (u32, usize),
        ms: &MoeSpec,
        dev: &Arc<crate::device::Device>,
        (first, end): (u64, u64),
        h: usize,
    ) -> Result<Experts> {
        let at = Some(l);
        let name = dev.name();
        let (n, f) = (ms.n_experts as usize, ms.expert_ffn as usize);
        let norm = self.need(Role::FfnNorm, at)?;
        let norm = exec::floats_on(
            &self.replica(norm, name)?,
            norm,
            &format!("layer {l} ffn_norm"),
            dev,
        )?;
        let router = exec::linear_of(&self.mat(router, None, name, (n, h), 0, None)?, dev)?;
        let count = (end - first) as usize;
        let mut experts = Vec::with_capacity(count);
        for e in first as usize..end as usize {
            let mut three = Vec::with_capacity(3);
            for (role, (rows, cols)) in [
                (Role::FfnGateExps, (f, h)),
                (Role::FfnUpExps, (f, h)),
                (Role::FfnDownExps, (h, f)),
            ] {
                if let Some(&i) = self.per_expert.get(&(l, role, e as u32)) {
                    let m = self.mat(i, None, name, (rows, cols), 0, None)?;
                    three.push(exec::linear_of(&m, dev)?);
                    continue;
                }
                let i = self
                    .infos
                    .iter()
                    .position(|t| {
                        t.role == Some(role) && t.layer == at && expert_of(&t.name).is_none()
                    })
                    .ok_or_else(|| {
                        invalid(
                            format!("{} of expert {e} in layer {l}", role.name()),
                            "a tensor in the checkpoint",
                            "none",
                        )
                    })?;
                let tname = &self.infos[i].name;
                let p = part_on(&self.held[i], name, tname)?;
                let Held::Split { parts, spec } = &self.held[i] else {
                    return Err(invalid(format!("tensor '{tname}'"), "split", "whole"));
                };
                let t = &parts[p];
                let want = [count as u64, rows as u64, cols as u64];
                let shard = spec.shards.get(p).map(|s| s.1);
                if t.shape() != want || shard != Some(first) {
                    return Err(invalid(
                        format!("part of '{tname}' on {name}"),
                        format!("experts {first}..{end} ({want:?}), as the expert table splits it"),
                        format!("shape {:?} from {shard:?}", t.shape()),
                    ));
                }
                if let Packing::Int8 = Packing::of(tname, t.dtype())? {
                    return Err(refuse(
                        format!("a tensor-parallel forward pass over LLM.int8 weight '{tname}'"),
                        "int8 experts are not split by the tp tables; load without \
                         quantize=\"int8\" or with a layer split",
                    ));
                }
                let k = e - first as usize;
                three.push(Linear {
                    slot: Slot::Tensor(i),
                    name: format!("{tname} expert {e}"),
                    rows,
                    cols,
                    bias: None,
                    onload_at: None,
                    packed: None,
                    part: Some(p),
                    rows_of: Some((k * rows, count * rows)),
                });
            }
            let Ok(three) = <[Linear; 3]>::try_from(three) else {
                return Err(invalid("expert matrices", "gate, up and down", "others"));
            };
            experts.push(three);
        }
        Ok(Experts {
            norm,
            moe: Moe {
                router,
                experts,
                first: first as usize,
                n_used: ms.n_used as usize,
                norm_topk_prob: ms.norm_topk_prob,
                experts_on_host: false,
            },
        })
    }
}

/// The start of device `d`'s range in `table` (0 when absent).
fn start_of(table: &SplitTable, d: usize) -> Option<(u64, u64)> {
    table.iter().find(|e| e.0 == d).map(|&(_, a, b)| (a, b))
}

impl TpGraph {
    /// The graph for a model loaded tensor-parallel with `ctx`'s tables. `forward` is what the
    /// plan sized the workspaces for.
    pub fn build(
        m: &Loaded<'_>,
        spec: &ModelSpec,
        (runtime, max_seq_len, batch): (&RuntimeSpec, u64, u64),
        ctx: &TpContext,
        host_backend: bool,
    ) -> Result<TpGraph> {
        super::super::graph::check_tensor_parallel(&spec.architecture)?;
        let family = super::super::family::Family::of(m, spec)?;
        let infos = m.source.tensors();
        let moe_spec = super::super::graph::moe_spec_of(m)?;
        if let Some(t) = infos.iter().find(|t| is_quantized_part(&t.name)) {
            return Err(refuse(
                format!(
                    "a tensor-parallel forward pass over quantised linear '{}'",
                    t.name
                ),
                "GPTQ and EXL2 weights are packed across their input columns and are not split \
                 by the tp tables; load them with a layer split",
            ));
        }
        // A rank-local load computes only its own device; the others are stand-ins.
        let rank = ctx.rank();
        let ours = |d: usize| rank.is_none_or(|r| r == d);
        let computing: Vec<&Arc<crate::device::Device>> = (ctx.devices().iter().enumerate())
            .filter(|&(d, _)| ours(d))
            .map(|(_, x)| x)
            .collect();
        let on_cuda = computing
            .iter()
            .filter(|d| d.kind() == DeviceKind::Cuda)
            .count();
        if on_cuda > 0 && on_cuda < computing.len() {
            let names: Vec<&str> = ctx.devices().iter().map(|d| d.name()).collect();
            return Err(refuse(
                format!("a tensor-parallel forward pass over {}", names.join(", ")),
                "every tp device computes through the same kind of backend: make them all \
                 cuda devices, or all host devices",
            ));
        }
        let heads = spec.n_kv_heads_at(0);
        if (0..spec.n_layers).any(|l| spec.n_kv_heads_at(l) != heads) {
            return Err(refuse(
                "a tensor-parallel forward pass with per-layer kv head counts".into(),
                "the kv table splits one head count for every layer",
            ));
        }
        let splits = ctx.splits().clone();
        // the plan sizes an expert device's MLP regions for its experts the same way
        let dense = weightlift_plan::has_dense_layers(spec.n_layers, infos);
        let dims =
            Dims::new(spec, runtime, max_seq_len, batch).with_experts(moe_spec.as_ref(), dense);
        if dims.tokens == 0 {
            return Err(invalid(
                "runtime max_input_len",
                "at least 1 token per forward chunk",
                0,
            ));
        }
        let plan_split = weightlift_plan::TpSplit {
            kv: splits.kv.clone(),
            id: splits.id.clone(),
            vc: splits.vc.clone(),
            rs: splits.rs.clone(),
            q: splits.q.clone(),
            ex: splits.ex.clone(),
            ranks: None,
        };
        let nd = ctx.devices().len();
        let shares: Vec<TpShare> = (0..nd)
            .map(|d| plan_split.share(d, spec.vocab_size))
            .collect();
        let layouts = shares.iter().map(|s| TpWorkspace::new(&dims, *s)).collect();
        let c = Ctx {
            infos,
            held: m.held,
            copies: m.copies,
            per_expert: infos
                .iter()
                .enumerate()
                .filter_map(|(i, t)| Some(((t.layer?, t.role?, expert_of(&t.name)?), i)))
                .collect(),
            norm_offset: family.norm_offset,
        };
        let (h, hd) = (spec.hidden_size as usize, spec.head_dim as usize);
        // Stacked matrices (phi3's qkv and gate|up): each device's parts of them start at its
        // rows of each block.
        let fused = spec.fused_projections();
        let (q_rows, kv_rows) = (spec.n_heads as u64 * hd as u64, heads as u64 * hd as u64);
        let inter = spec.intermediate_size;
        let attn_mats = |at: Option<u32>| -> Result<[(usize, u64); 3]> {
            Ok(if fused {
                let i = c.need(Role::AttnQkv, at)?;
                [(i, 0), (i, q_rows), (i, q_rows + kv_rows)]
            } else {
                [
                    (c.need(Role::AttnQ, at)?, 0),
                    (c.need(Role::AttnK, at)?, 0),
                    (c.need(Role::AttnV, at)?, 0),
                ]
            })
        };
        let mlp_mats = |at: Option<u32>| -> Result<[(usize, u64); 2]> {
            Ok(if fused {
                let i = c.need(Role::FfnGateUp, at)?;
                [(i, 0), (i, inter)]
            } else {
                [
                    (c.need(Role::FfnGate, at)?, 0),
                    (c.need(Role::FfnUp, at)?, 0),
                ]
            })
        };
        let name = |d: usize| ctx.device(d).map(|x| x.name().to_owned());
        // the sliding-window layers and their RoPE bases, as the layer split runs them
        let windows = &family.windows;
        let (rope, inv_freqs) = rope_of(m, spec, max_seq_len)?;
        let rope_tables = family.rope_tables(&rope)?;
        let mut layers = Vec::with_capacity(spec.n_layers as usize);
        for l in 0..spec.n_layers {
            let at = Some(l);
            let mut attn: Vec<Option<Attn>> = (0..nd).map(|_| None).collect();
            let mut mlp: Vec<Option<Mlp>> = (0..nd).map(|_| None).collect();
            for (i, &(d, ka, kb)) in splits.kv.iter().enumerate() {
                if !ours(d) {
                    continue;
                }
                // A rank-local cache holds only this rank's part.
                let cache_part = if rank.is_some() { 0 } else { i };
                let dev = name(d)?;
                let (qa, qb) = start_of(&splits.q, d).unwrap_or((0, 0));
                let (qh, kh) = ((qb - qa) as usize, (kb - ka) as usize);
                let (hdu, q0, k0) = (hd as u64, qa * hd as u64, ka * hd as u64);
                let [(qi, qs), (ki, ks), (vi, vs)] = attn_mats(at)?;
                attn[d] = Some(Attn {
                    norm: c.norm(c.need(Role::AttnNorm, at)?, &dev)?,
                    q: c.mat(
                        qi,
                        None,
                        &dev,
                        (qh * hd, h),
                        qs + q0,
                        c.find(Role::AttnQBias, at),
                    )?,
                    k: c.mat(
                        ki,
                        None,
                        &dev,
                        (kh * hd, h),
                        ks + k0,
                        c.find(Role::AttnKBias, at),
                    )?,
                    v: c.mat(
                        vi,
                        None,
                        &dev,
                        (kh * hd, h),
                        vs + k0,
                        c.find(Role::AttnVBias, at),
                    )?,
                    o: c.mat(
                        c.need(Role::AttnOutput, at)?,
                        None,
                        &dev,
                        (h, qh * hd),
                        qa * hdu,
                        None,
                    )?,
                    qk_norm: if spec.per_head_qk_norm() {
                        Some([
                            c.norm(c.need(Role::AttnQNorm, at)?, &dev)?,
                            c.norm(c.need(Role::AttnKNorm, at)?, &dev)?,
                        ])
                    } else {
                        None
                    },
                    q_heads: qh,
                    kv_heads: kh,
                    cache_part,
                    window: windows.get(l as usize).copied().unwrap_or(0),
                    rope: rope_tables.get(l as usize).cloned().flatten(),
                });
            }
            let mut experts: Vec<Option<Arc<Experts>>> = (0..nd).map(|_| None).collect();
            // a MoE llama GGUF (mixtral) is named `llama`: the router tensor tells
            let router = c.find(Role::FfnGateInp, at);
            match (router, moe_spec.as_ref(), splits.ex.is_empty()) {
                (Some(r), Some(ms), false) => {
                    for &(d, a, b) in splits.ex.iter().filter(|e| ours(e.0)) {
                        let dev = ctx.device(d)?;
                        let x = c.experts((l, r), ms, dev, (a, b), h)?;
                        experts[d] = Some(Arc::new(x));
                    }
                }
                (None, _, true) => {}
                (Some(r), _, _) => {
                    return Err(refuse(
                        format!(
                            "tensor parallelism for mixture-of-experts layer {l} ('{}')",
                            infos[r].name
                        ),
                        "the model was loaded without an expert table (its expert count \
                         unread, or tables made for a dense model); plan it again with \
                         tensor_parallel, or load with a layer split (autosplit, layers, \
                         balanced)",
                    ));
                }
                // a dense layer beside expert ones (a Qwen MoE's `mlp_only_layers` or
                // `decoder_sparse_step`): its MLP follows the intermediate table, as a dense
                // model's does
                (None, _, false) if !splits.id.is_empty() => {}
                (None, _, false) => {
                    return Err(refuse(
                        format!(
                            "tensor parallelism for dense layer {l} of a mixture-of-experts model"
                        ),
                        "the tp tables were made without an intermediate table for its dense \
                         MLP (tables made for a model whose every layer routes); plan it again \
                         with tensor_parallel, or load with a layer split (autosplit, layers, \
                         balanced)",
                    ));
                }
            }
            let dense_ids = if router.is_none() {
                &splits.id[..]
            } else {
                &[]
            };
            for &(d, a, b) in dense_ids.iter().filter(|e| ours(e.0)) {
                let dev = name(d)?;
                let w = (b - a) as usize;
                let [(gi, gs), (ui, us)] = mlp_mats(at)?;
                mlp[d] = Some(Mlp {
                    norm: c.norm(c.need(Role::FfnNorm, at)?, &dev)?,
                    gate: c.mat(gi, None, &dev, (w, h), gs + a, None)?,
                    up: c.mat(ui, None, &dev, (w, h), us + a, None)?,
                    down: c.mat(c.need(Role::FfnDown, at)?, None, &dev, (h, w), a, None)?,
                });
            }
            // A bias after a partial sum is replicated; the residual's owners add it once. A
            // post-norm is replicated too; each owner norms whole rows with it.
            let first = name(rank.unwrap_or(splits.rs.first().map_or(0, |x| x.0)))?;
            let whole = |role: Role| -> Result<Option<Vec<f32>>> {
                c.find(role, at).map(|i| c.replica(i, &first)).transpose()
            };
            let post = |role: Role| -> Result<Option<Vec<f32>>> {
                c.find(role, at).map(|i| c.norm(i, &first)).transpose()
            };
            layers.push(Layer {
                attn,
                mlp,
                experts,
                o_bias: whole(Role::AttnOutputBias)?,
                down_bias: None,
                post_norms: [post(Role::AttnPostNorm)?, post(Role::FfnPostNorm)?],
            });
        }
        let embed = c.need(Role::TokenEmbd, None)?;
        let embed_ty = match &m.held[embed] {
            Held::Whole { tensor, .. } => match Packing::of(&infos[embed].name, tensor.dtype())? {
                Packing::Blocks(ty) => ty,
                Packing::Int8 => {
                    return Err(refuse(
                        "an int8 token embedding".into(),
                        "the embedding is a row lookup of float or ggml rows",
                    ));
                }
            },
            Held::Split { .. } => {
                return Err(refuse(
                    "a tensor-parallel forward pass over a split token embedding".into(),
                    "the plan keeps the embedding whole on the host; load with load_tp",
                ));
            }
        };
        let (head_i, head_copy) = match c.find(Role::Output, None) {
            Some(i) => (i, None),
            None => {
                let k = m
                    .copies
                    .iter()
                    .position(|(i, _)| *i == embed)
                    .ok_or_else(|| {
                        invalid(
                            "tied output head",
                            "a copy of token_embd split by the vc table",
                            "none",
                        )
                    })?;
                (embed, Some(k))
            }
        };
        let out_norm = c.need(Role::OutputNorm, None)?;
        let vocab = spec.vocab_size;
        let mut heads_of: Vec<Option<Head>> = (0..nd).map(|_| None).collect();
        for &(d, a, b) in splits.vc.iter().filter(|e| ours(e.0)) {
            if a >= vocab {
                continue;
            }
            let dev = name(d)?;
            let rows = (b.min(vocab) - a) as usize;
            heads_of[d] = Some(Head {
                norm: c.norm(out_norm, &dev)?,
                mat: c.mat(head_i, head_copy, &dev, (rows, h), a, None)?,
            });
        }
        let mut graph = TpGraph {
            splits,
            layers,
            heads: heads_of,
            embed,
            embed_ty,
            layouts,
            dims,
            eps: spec.rms_norm_eps as f32,
            rope,
            inv_freqs,
            max_dq: usize::try_from(runtime.max_dq_size.max(1)).unwrap_or(usize::MAX),
            family,
            backend: None,
        };
        let devices = ctx.devices();
        let backends = if on_cuda > 0 {
            Some(exec::Backends::Cuda)
        } else if host_backend || rank.is_some() {
            // A rank-local pass always runs through the backends.
            let cpus = devices.iter().map(|d| CpuBackend::named(d.name()));
            Some(exec::Backends::Cpu(cpus.collect()))
        } else {
            None
        };
        if let Some(b) = backends {
            graph.backend = Some(exec::BackendGraph::new(&graph, devices, b)?);
        }
        Ok(graph)
    }
}

/// [`crate::Model::forward`] and [`crate::Model::forward_batch`] of a model loaded
/// tensor-parallel: the graph is built on first use, then run under the context's lock on the
/// model's thread pool. Consecutive sequences run together while [`TpGraph::batches`] says so,
/// else one at a time; `out` gets each one's rows in order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    state: &mut crate::model::State,
    tp: &std::sync::Mutex<TpContext>,
    (source, inventory): (&dyn crate::source::Source, &crate::device::Inventory),
    spec: &ModelSpec,
    seqs: &[(&Arc<Cache>, &[u32])],
    (output, out): (Output, &mut Vec<f32>),
    (compute, int8_threshold, host_backend): (Compute, f32, bool),
    pool: Option<Arc<rayon::ThreadPool>>,
) -> Result<Copies> {
    let mut ctx = tp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if state.tp_graph.is_none() {
        let plan = state
            .forward
            .as_ref()
            .ok_or_else(|| EngineError::NotLoaded {
                what: "the plan's forward sizes for tensor parallelism".into(),
            })?;
        let resolve = |name: &str| crate::model::resolve_in(inventory, name);
        let loaded = Loaded {
            source,
            held: &state.held,
            copies: &state.copies,
            scratch: &state.scratch,
            layer_devices: &state.layer_devices,
            onload: None,
            resolve: &resolve,
        };
        let sizes = (&plan.runtime, plan.max_seq_len, plan.batch);
        state.tp_graph = Some(TpGraph::build(&loaded, spec, sizes, &ctx, host_backend)?);
    }
    let crate::model::State {
        tp_graph,
        held,
        copies,
        ..
    } = state;
    let graph = tp_graph.as_ref().ok_or_else(|| EngineError::NotLoaded {
        what: "the tensor-parallel graph".into(),
    })?;
    let ctx = &mut *ctx;
    let modes = (compute, int8_threshold);
    let mut go = || -> Result<Copies> {
        let mut made = Copies::default();
        let mut rows = Vec::new();
        out.clear();
        let mut at = 0;
        while at < seqs.len() {
            // the longest run of sequences from `at` that goes together (at least one)
            let end = (at + 2..=seqs.len())
                .rev()
                .find(|&e| graph.batches(&seqs[at..e], output))
                .unwrap_or(at + 1);
            made.add(if end - at > 1 {
                graph.forward_batch(held, copies, ctx, &seqs[at..end], modes, &mut rows)?
            } else {
                let (cache, ids) = seqs[at];
                graph.forward(held, copies, ctx, cache, ids, output, modes, &mut rows)?
            });
            out.extend_from_slice(&rows);
            at = end;
        }
        // the final soft-cap on the gathered vocabulary rows, as the layer split caps its logits
        let cap = graph.family.final_softcap;
        if cap > 0.0 && matches!(output, Output::Logits(_)) {
            weightlift_kernels::softcap_in_place(out, cap);
        }
        Ok(made)
    };
    match pool {
        Some(p) => p.install(go),
        None => go(),
    }
}

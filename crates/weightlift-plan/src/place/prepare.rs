//! Preparing the context: [`Ctx::new`] validates the request (spec, tensor table, cache,
//! devices and their per-device options), resolves every device's budget (capacity capped by
//! `max_memory`, reserve less the tweak's cut, overhead), adds the implicit cpu and disk, groups
//! the tensors into units, sizes each layer's KV cache (cut to the window for sliding-window
//! layers) and the offloaded total, and builds the scratch model every strategy charges
//! against.

use weightlift_format::{ModelSpec, Role, TensorInfo};

use super::{Ctx, Dev, Tweak, Unit, UnitKind};
use crate::device::DeviceKind;
use crate::error::{PlanError, Result};
use crate::memory::ScratchModel;
use crate::overhead::Overhead;
use crate::quantize::Quantize;
use crate::request::{BudgetRule, PlanRequest, SplitMode, Strategy};
use crate::synth::converted;
use crate::window::{layer_cache, planned_window};

/// The role of a tensor outside the repeating blocks, for every architecture: the one the
/// checkpoint gave (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3), else the one its name says. llama.cpp names the
/// input embedding, the output norm and the head `token_embd`, `output_norm` and `output` in
/// every architecture; transformers calls them `*embed_tokens`, `model.norm` and `lm_head` (under
/// `language_model` in a multimodal model).
fn global_role(t: &TensorInfo) -> Option<Role> {
    if t.role.is_some() || t.layer.is_some() {
        return t.role;
    }
    let name = t.name.as_str();
    match name {
        "token_embd.weight" => Some(Role::TokenEmbd),
        "output.weight" | "lm_head.weight" | "language_model.lm_head.weight" => Some(Role::Output),
        "output_norm.weight"
        | "model.norm.weight"
        | "model.language_model.norm.weight"
        | "language_model.model.norm.weight" => Some(Role::OutputNorm),
        "rope_freqs.weight" => Some(Role::RopeFreqs),
        "rope_factors_long.weight" | "rope_factors_short.weight" => Some(Role::RopeFactors),
        _ if name.ends_with(".embed_tokens.weight") => Some(Role::TokenEmbd),
        _ => None,
    }
}

impl<'a> Ctx<'a> {
    pub fn new(req: &'a PlanRequest, tweak: Tweak) -> Result<Self> {
        let spec = &req.spec;
        // A recurrent architecture (mamba, rwkv) has no heads: its plan places the weights and
        // no KV cache.
        let attends = spec.n_kv_heads.iter().any(|&h| h > 0);
        if spec.n_layers == 0
            || spec.n_kv_heads.len() != spec.n_layers as usize
            || (attends && spec.head_dim == 0)
        {
            return Err(PlanError::Spec {
                detail: format!(
                    "need n_layers > 0, head_dim > 0 where layers have KV heads, and one n_kv_heads entry per layer; got {} layers, head_dim {}, {} kv-head entries",
                    spec.n_layers,
                    spec.head_dim,
                    spec.n_kv_heads.len()
                ),
            });
        }
        if req.tensors.is_empty() {
            return Err(PlanError::Spec {
                detail: "the tensor table is empty; pass a checkpoint's tensors or synthesize_tensors(spec, ...)".into(),
            });
        }
        let allow_disk = tweak.allow_disk.unwrap_or(req.allow_disk);
        let cache = tweak.cache.unwrap_or(req.cache);
        if let Some(c) = &cache {
            c.check()?;
        }
        let mut warnings = Vec::new();
        if !ModelSpec::supports_roles(&spec.architecture) {
            warnings.push(format!(
                "architecture '{}' is planned, but the engine runs only {}: this plan sizes the \
                 memory, and loading it is refused",
                spec.architecture,
                ModelSpec::SUPPORTED_ARCHITECTURES.join(", ")
            ));
        }

        // Devices.
        if req.devices.is_empty() {
            return Err(PlanError::option(
                "devices",
                "at least one device",
                "an empty list",
            ));
        }
        let cpu_share = req.budget_rule == BudgetRule::Transformers
            && req.max_memory.is_empty()
            && matches!(
                req.strategy,
                Strategy::Sequential | Strategy::Balanced | Strategy::BalancedLow0
            );
        let mut devs: Vec<Dev> = Vec::with_capacity(req.devices.len() + 2);
        for d in &req.devices {
            if devs.iter().any(|o| o.name == d.name) {
                return Err(PlanError::option(
                    "devices",
                    "each device once",
                    format!("{} twice", d.name),
                ));
            }
            let cap = req.max_memory.get(&d.name).copied().unwrap_or(u64::MAX);
            let mut limit = d.capacity.min(cap);
            // transformers' get_max_memory: with no max_memory at all, 90% of the host RAM.
            if d.kind == DeviceKind::Cpu && limit != u64::MAX && cpu_share {
                limit = limit / 10 * 9 + limit % 10 * 9 / 10;
            }
            devs.push(Dev {
                name: d.name.clone(),
                kind: d.kind,
                limit,
                reserve: req
                    .reserve
                    .get(&d.name)
                    .copied()
                    .unwrap_or(d.reserve)
                    .saturating_sub(tweak.reserve_cut),
                // the user's overhead= replaces the measured or default parts
                overhead: match req.overhead.get(&d.name) {
                    Some(&given) => Overhead::given(given),
                    None => d.overhead.clone(),
                },
                implicit: false,
                held_back: 0,
            });
        }
        for (what, map) in [
            ("reserve", &req.reserve),
            ("max_memory", &req.max_memory),
            ("overhead", &req.overhead),
        ] {
            if let Some(k) = map.keys().find(|k| !devs.iter().any(|d| &d.name == *k)) {
                return Err(PlanError::UnknownDevice {
                    device: k.clone(),
                    context: what.to_string(),
                    known: devs
                        .iter()
                        .map(|d| d.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        let host = match devs.iter().position(|d| d.kind == DeviceKind::Cpu) {
            Some(i) => {
                if devs[i].limit == u64::MAX {
                    warnings.push("cpu capacity unknown: host RAM is not checked".to_string());
                }
                i
            }
            None => {
                devs.push(Dev {
                    name: "cpu".into(),
                    kind: DeviceKind::Cpu,
                    limit: u64::MAX,
                    reserve: 0,
                    overhead: Overhead::default(),
                    implicit: true,
                    held_back: 0,
                });
                devs.len() - 1
            }
        };
        let mut disk = devs.iter().position(|d| d.kind == DeviceKind::Disk);
        if disk.is_none() && allow_disk {
            devs.push(Dev {
                name: "disk".into(),
                kind: DeviceKind::Disk,
                limit: u64::MAX,
                reserve: 0,
                overhead: Overhead::default(),
                implicit: false,
                held_back: 0,
            });
            disk = Some(devs.len() - 1);
        }
        let accel: Vec<usize> = (0..devs.len())
            .filter(|&i| devs[i].kind.is_accelerator())
            .collect();

        // Tensors and units.
        let n_layers = spec.n_layers as usize;
        let mut bytes = Vec::with_capacity(req.tensors.len());
        let mut dtypes = Vec::with_capacity(req.tensors.len());
        let mut embed = Unit {
            kind: UnitKind::Embed,
            tensors: vec![],
            weights: 0,
            kv: 0,
        };
        let mut layers: Vec<Unit> = (0..spec.n_layers)
            .map(|l| Unit {
                kind: UnitKind::Layer(l),
                tensors: vec![],
                weights: 0,
                kv: 0,
            })
            .collect();
        let mut norm = Unit {
            kind: UnitKind::Norm,
            tensors: vec![],
            weights: 0,
            kv: 0,
        };
        let mut output = Unit {
            kind: UnitKind::Output,
            tensors: vec![],
            weights: 0,
            kv: 0,
        };
        let mut embd_tensor = None;
        let mut has_output = false;
        let mut roles = Vec::with_capacity(req.tensors.len());
        if let Some(q) = req.quantize {
            q.check(&req.tensors)?;
            match &req.strategy {
                // A ggml type's blocks stand alone, so a shard quantises by itself into the
                // blocks the whole tensor has there; LLM.int8's row scales and outlier columns
                // are the whole row's, which a column shard does not see.
                Strategy::TensorParallel(_) if q == Quantize::Int8 => {
                    return Err(PlanError::option(
                        "quantize",
                        "q8_0, q4_k or q6_k with tensor_parallel",
                        "quantize=int8 with tensor_parallel: LLM.int8's row-wise scales and \
                         outlier columns are taken over whole rows, and the column shards of \
                         o_proj and down_proj would each need their own (load with a layer \
                         split, or pick a ggml type)",
                    ));
                }
                Strategy::Layers(o) if o.split_mode == SplitMode::Row => {
                    return Err(PlanError::option(
                        "quantize",
                        "a layer split (autosplit, layers, balanced, sequential or a device map) \
                         or tensor_parallel",
                        format!(
                            "quantize={} with split_mode='row', whose shards are cut from the \
                             stored rows",
                            q.name()
                        ),
                    ));
                }
                _ => {}
            }
        }
        for (i, t) in req.tensors.iter().enumerate() {
            let role = global_role(t);
            let quantized = req.quantize.and_then(|q| q.target(t, role));
            let (dt, b) = match quantized.and_then(|d| Some((d, d.bytes_for_shape(&t.shape)?))) {
                Some(held) => held,
                // A GPTQ/EXL2 linear's float parts (scales) are read as stored.
                None if weightlift_format::is_quantized_part(&t.name) => (t.dtype, t.nbytes),
                None => converted(t, req.dtype),
            };
            bytes.push(b);
            dtypes.push(dt);
            roles.push(role);
            let unit = match (t.layer, role) {
                (Some(l), _) => {
                    let Some(u) = layers.get_mut(l as usize) else {
                        return Err(PlanError::Tensor {
                            tensor: t.name.clone(),
                            detail: format!(
                                "layer {l} is out of range for a model of {n_layers} layers"
                            ),
                        });
                    };
                    u
                }
                (None, Some(Role::TokenEmbd | Role::RopeFreqs | Role::RopeFactors)) => &mut embed,
                (None, Some(Role::Output)) => {
                    has_output = true;
                    &mut output
                }
                (None, Some(Role::OutputNorm)) => &mut norm,
                (None, _) if t.name.contains("embd") || t.name.contains("embed") => &mut embed,
                (None, _) => &mut norm,
            };
            if role == Some(Role::TokenEmbd) && embd_tensor.is_none() {
                embd_tensor = Some(i);
            }
            unit.tensors.push(i);
            unit.weights = unit.weights.saturating_add(b);
        }
        // Tied when there is an embedding and no head of its own, whatever the config says: the
        // head then reads the embedding (llama.cpp falls back to token_embd the same way).
        let tied_bytes = match (has_output, embd_tensor) {
            (false, Some(e)) => bytes[e],
            _ => 0,
        };
        let runtime = tweak.runtime.unwrap_or(req.runtime);
        let window = planned_window(req);
        let kv: Vec<u64> = (0..n_layers)
            .map(|l| {
                cache.map_or(0, |c| {
                    layer_cache(&c, window, l, &runtime).layer_bytes(spec, l)
                })
            })
            .collect();
        if let Some(w) = &req.sliding_window
            && w.any()
        {
            let layers = crate::plan::ranges(&w.sliding_ranges());
            let note = match (window, cache) {
                (Some(_), Some(c)) => Some(format!(
                    "layers {layers} attend to a sliding window of {} tokens: each keeps {} \
                     cells of kv per sequence (llama.cpp's SWA cache: the window and one \
                     chunk of input, padded to {}), the other layers all {}",
                    w.window,
                    w.cells(
                        w.layers.iter().position(|&s| s).unwrap_or(0),
                        c.max_seq_len,
                        crate::window::ubatch(&runtime, c.max_seq_len)
                    ),
                    crate::window::SWA_PAD,
                    c.max_seq_len
                )),
                (Some(_), None) => Some(format!(
                    "layers {layers} attend to a sliding window of {} tokens",
                    w.window
                )),
                (None, _) => None,
            };
            warnings.extend(note);
        }
        for (u, &k) in layers.iter_mut().zip(&kv) {
            u.kv = k;
        }
        let offload = cache.is_some_and(|c| c.offload);
        let offload_total = if offload {
            kv.iter().fold(0u64, |a, &b| a.saturating_add(b))
        } else {
            0
        };
        let mut units = Vec::with_capacity(n_layers + 3);
        units.push(embed);
        units.extend(layers);
        units.push(norm);
        units.push(output);

        let (seq, batch) = cache.map_or((runtime.max_input_len.max(1), 1), |c| {
            (c.max_seq_len, c.batch_size)
        });
        let scratch = ScratchModel::new(spec, &req.tensors, req.moe.as_ref(), &runtime, seq, batch);
        // A chunk holds stored bytes (before any conversion), at most one staging size.
        let largest = req
            .tensors
            .iter()
            .map(|t| t.nbytes)
            .chain(bytes.iter().copied())
            .max();
        let staging_bound = 2 * req.staging_bytes.min(largest.unwrap_or(0));
        Ok(Ctx {
            req,
            tweak,
            devs,
            host,
            accel,
            disk,
            bytes,
            dtypes,
            units,
            scratch,
            cache,
            offload,
            offload_total,
            tied_bytes,
            embd_tensor,
            roles,
            runtime,
            window,
            staging_bound,
            warnings,
        })
    }
}

//! `Model`: a checkpoint, the devices it may use, and (once loaded) every tensor in place, with
//! the lazily allocated cache beside each layer.

use std::sync::{Arc, Mutex};

use weightlift_format::{DType, Role, TensorInfo};

use crate::cache::{Cache, CacheConfig, CacheDType};
use crate::device::{Device, DeviceKind, DeviceTensor, Inventory};
use crate::error::{EngineError, Result, invalid};
use crate::loader::{LoadOptions, Progress, TensorTarget, load};
use crate::source::Source;
use crate::tp::{HostStaged, SplitTable, Splits, TpContext};

/// How a tensor is spread over several devices (tensor parallelism, llama.cpp's row split).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitSpec {
    /// 0: rows (the first numpy axis), 1: columns (the last).
    pub axis: u8,
    /// Every shard is a full copy (norms under tensor parallelism).
    pub replicated: bool,
    /// `(device name, start, end)` along the axis.
    pub shards: Vec<(String, u64, u64)>,
}

/// Where one tensor goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlace {
    /// `"cpu"`, `"virtual:1"`, `"cuda:0"` or `"disk"` (the main device of a split tensor).
    pub device: String,
    /// The dtype to hold it in (the stored one, or F16 for a conversion).
    pub dtype: DType,
    pub split: Option<SplitSpec>,
}

/// Where every tensor goes: the Plan, reduced to what the loader needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Per tensor, in checkpoint order.
    pub tensors: Vec<TensorPlace>,
    /// Per layer: the device name.
    pub layers: Vec<String>,
    /// Extra copies: `(tensor index, where)`: a tied output head beside the last layer, or split
    /// by the vocab table under tensor parallelism.
    pub copies: Vec<(usize, TensorPlace)>,
    /// Compute scratch to reserve per device, in bytes: each device's forward workspace.
    pub scratch: Vec<(String, u64)>,
    /// The runtime and cache shape the scratch was planned for (`None`: no scratch was
    /// planned; the first forward pass allocates each workspace for the attached cache).
    pub forward: Option<ForwardPlan>,
    /// Offloaded execution: the layers whose weights stay on cpu or disk and are copied to
    /// the device in `layers` before they run (`layers` names where each layer computes).
    pub onload: Option<weightlift_plan::OnloadPlan>,
}

/// What a plan sized the forward workspaces for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardPlan {
    pub runtime: weightlift_plan::RuntimeSpec,
    pub max_seq_len: u64,
    pub batch: u64,
    /// Tensor parallelism: the plan's split tables (device indices count the accelerators).
    /// The load then splits the cache by kv heads and builds the [`TpContext`] the forward
    /// pass runs through.
    pub tp: Option<Splits>,
}

impl Placement {
    /// Every tensor on one device in its stored dtype.
    pub fn all_on(source: &dyn Source, device: &str, n_layers: u32) -> Placement {
        Placement {
            tensors: source
                .tensors()
                .iter()
                .map(|t| TensorPlace {
                    device: device.to_owned(),
                    dtype: t.dtype,
                    split: None,
                })
                .collect(),
            layers: vec![device.to_owned(); n_layers as usize],
            copies: Vec::new(),
            scratch: Vec::new(),
            forward: None,
            onload: None,
        }
    }
}

/// How a TP-loaded tensor is cut (exllamav2's `load_tp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Rows `a·unit .. b·unit` of table `t` on each device.
    Rows { table: usize, unit: u64 },
    /// Columns `a·unit .. b·unit` of table `t` on each device.
    Cols { table: usize, unit: u64 },
    /// A full copy on every device of the KV table.
    Replicate,
}

/// One loaded tensor.
#[derive(Debug)]
pub enum Held {
    Whole {
        tensor: DeviceTensor,
        device: String,
    },
    /// Parts in shard order, with the spec they follow.
    Split {
        parts: Vec<DeviceTensor>,
        spec: SplitSpec,
    },
}

#[derive(Debug)]
pub(crate) struct State {
    /// Declared first: unlocked before the tensors that own the mapped ranges are dropped.
    pub locked: crate::mlock::Locked,
    /// Declared before the tensors: its workspaces are returned before the weights.
    pub graph: Option<crate::forward::Graph>,
    pub held: Vec<Held>,
    pub copies: Vec<(usize, Held)>,
    pub scratch: Vec<crate::device::Buffer>,
    pub layer_devices: Vec<String>,
    pub cache: Option<Arc<Cache>>,
    /// `cache` was made by [`Model::own_cache_for`], not handed in: it may be replaced by a
    /// larger one.
    pub cache_made: bool,
    pub warnings: Vec<String>,
    pub forward: Option<ForwardPlan>,
    pub onload: Option<weightlift_plan::OnloadPlan>,
    /// Tensor parallelism: the context the forward pass runs through (shared with the
    /// bindings' `Model.tp`), and the graph built on first use.
    pub tp: Option<Arc<Mutex<TpContext>>>,
    pub tp_graph: Option<crate::forward::TpGraph>,
}

/// The device named `name` in `inv`; `disk` resolves to the cpu, which computes and holds what
/// stays on disk.
pub(crate) fn resolve_in(inv: &Inventory, name: &str) -> Result<Arc<Device>> {
    if name == "disk" {
        return Ok(Arc::clone(inv.cpu()));
    }
    inv.get(name)
}

/// A model: nothing is loaded until [`Model::load`] (tensor parallelism: [`Model::tp_placement`]).
pub struct Model {
    source: Arc<dyn Source>,
    inventory: Inventory,
    pub(crate) state: Option<State>,
    pub(crate) runner: crate::forward::Runner,
    /// Built on first use from the checkpoint's metadata or tokenizer files.
    tokenizer: std::sync::OnceLock<Arc<weightlift_text::Tokenizer>>,
    /// The tokenizer's chat template, compiled on first use (`None`: the model has none).
    chat: std::sync::OnceLock<Option<Arc<weightlift_text::ChatTemplate>>>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("source", &self.source.path())
            .field("inventory", &self.inventory)
            .field("loaded", &self.state.is_some())
            .finish()
    }
}

impl Model {
    pub fn new(source: Arc<dyn Source>, inventory: Inventory) -> Model {
        Model {
            source,
            inventory,
            state: None,
            runner: crate::forward::Runner::default(),
            tokenizer: std::sync::OnceLock::new(),
            chat: std::sync::OnceLock::new(),
        }
    }

    /// The tokenizer: from the GGUF's `tokenizer.ggml.*` keys, or from `tokenizer.json` in a
    /// safetensors checkpoint's folder. Built once, on first use; needs no load.
    pub fn tokenizer(&self) -> Result<Arc<weightlift_text::Tokenizer>> {
        if let Some(t) = self.tokenizer.get() {
            return Ok(Arc::clone(t));
        }
        let ckpt = self
            .source
            .checkpoint()
            .ok_or_else(|| EngineError::Unsupported {
                what: "a tokenizer for this model".into(),
                detail: "it was not opened from a checkpoint file".into(),
            })?;
        let built = match ckpt.format() {
            weightlift_format::Format::Gguf => {
                weightlift_text::Tokenizer::from_gguf(ckpt.metadata())?
            }
            weightlift_format::Format::Safetensors => {
                let path = ckpt.path();
                let dir = if path.is_dir() {
                    path
                } else {
                    path.parent().unwrap_or(path)
                };
                weightlift_text::Tokenizer::from_files(dir)?
            }
        };
        Ok(Arc::clone(self.tokenizer.get_or_init(|| Arc::new(built))))
    }

    /// The chat template compiled once, or `None` when the checkpoint has none.
    pub fn chat_template(&self) -> Result<Option<Arc<weightlift_text::ChatTemplate>>> {
        if let Some(t) = self.chat.get() {
            return Ok(t.clone());
        }
        let built = self.tokenizer()?.chat()?.map(Arc::new);
        Ok(self.chat.get_or_init(|| built).clone())
    }

    /// Rows of the embedding: token ids must be below it.
    pub fn vocab_size(&self) -> Result<u64> {
        self.source
            .spec()
            .map(|s| s.vocab_size)
            .ok_or_else(|| EngineError::Unsupported {
                what: "running this checkpoint".into(),
                detail: "its architecture could not be read from the metadata or config.json"
                    .into(),
            })
    }

    /// The cache that calls without one run on, with room for `tokens` positions: the one
    /// attached at load or by the caller, whatever its size; else, as transformers' `generate`
    /// makes its own cache, an fp16 cache of `tokens` positions rounded up to
    /// [`weightlift_plan::SEQ_STEP`], allocated beside the layers now and kept, and replaced
    /// by a larger one when a later call needs more. A model loaded tensor-parallel has its
    /// cache from `load_tp`.
    pub fn own_cache_for(&mut self, tokens: u64) -> Result<Arc<Cache>> {
        let state = self.state()?;
        if let Some(c) = &state.cache
            && (!state.cache_made || c.config().max_seq_len >= tokens)
        {
            return Ok(Arc::clone(c));
        }
        if state.tp.is_some() {
            return self.own_cache();
        }
        let step = weightlift_plan::SEQ_STEP;
        let max_seq_len = tokens.max(1).div_ceil(step) * step;
        let config = self.cache_config(max_seq_len, 1, CacheDType::Fp16, false)?;
        let cache = Arc::new(Cache::new(config)?);
        // The smaller one goes first, so both never need room at once.
        if let Some(s) = self.state.as_mut()
            && s.cache_made
            && let Some(old) = s.cache.take()
        {
            old.free();
        }
        self.attach_cache(&cache)?;
        if let Some(s) = self.state.as_mut() {
            s.cache_made = true;
        }
        Ok(cache)
    }

    /// The cache attached at load or by the caller (`Model.forward(cache=None)` and generation
    /// use it).
    pub fn own_cache(&self) -> Result<Arc<Cache>> {
        self.state
            .as_ref()
            .ok_or_else(|| EngineError::NotLoaded {
                what: "the model".into(),
            })?
            .cache
            .clone()
            .ok_or_else(|| EngineError::NotLoaded {
                what: "a KV cache for this model (pass cache=, load with one, or create \
                       Cache(model, max_seq_len=N))"
                    .into(),
            })
    }

    pub fn source(&self) -> &Arc<dyn Source> {
        &self.source
    }

    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    pub fn is_loaded(&self) -> bool {
        self.state.is_some()
    }

    /// Record a warning about the current load (shown by `warnings()` until unload).
    pub fn push_warning(&mut self, w: String) {
        if let Some(s) = self.state.as_mut() {
            s.warnings.push(w);
        }
    }

    /// Bytes of mapped tensors locked in RAM by `use_mlock`.
    pub fn locked_bytes(&self) -> u64 {
        self.state.as_ref().map_or(0, |s| s.locked.bytes())
    }

    pub fn warnings(&self) -> &[String] {
        self.state.as_ref().map_or(&[], |s| &s.warnings)
    }

    /// Number of repeating layers (from the spec, else from the tensor names).
    pub fn n_layers(&self) -> u32 {
        self.source.spec().map(|s| s.n_layers).unwrap_or_else(|| {
            self.source
                .tensors()
                .iter()
                .filter_map(|t| t.layer)
                .max()
                .map_or(0, |l| l + 1)
        })
    }

    /// The cache shape of this model's architecture.
    pub fn cache_config(
        &self,
        max_seq_len: u64,
        batch_size: u64,
        dtype: CacheDType,
        offload: bool,
    ) -> Result<CacheConfig> {
        let spec = self.source.spec().ok_or_else(|| EngineError::Unsupported {
            what: "a cache for this checkpoint".into(),
            detail: "its architecture (n_kv_heads, head_dim) could not be read".into(),
        })?;
        Ok(CacheConfig {
            max_seq_len,
            batch_size,
            dtype,
            n_kv_heads: (0..spec.n_layers).map(|l| spec.n_kv_heads_at(l)).collect(),
            head_dim: spec.head_dim,
            offload,
        })
    }

    fn resolve(&self, name: &str) -> Result<Arc<Device>> {
        resolve_in(&self.inventory, name)
    }

    /// Load by `placement`. A lazy `cache` is allocated layer by layer, on each layer's device,
    /// as the layer's weights land. Split tensors are then cut from the mmap and copied to their
    /// devices. On any failure or cancellation, everything allocated by this call (weights and
    /// cache layers) is freed before returning.
    pub fn load(
        &mut self,
        placement: &Placement,
        opts: &LoadOptions,
        cache: Option<&Arc<Cache>>,
        validate: bool,
        progress: &mut dyn FnMut(&Progress<'_>) -> bool,
    ) -> Result<()> {
        self.unload();
        for d in self.inventory.all() {
            d.reset_peak();
        }
        let result = self.load_inner(placement, opts, cache, validate, progress);
        if result.is_err()
            && let Some(c) = cache
        {
            c.free();
        }
        result
    }

    fn load_inner(
        &mut self,
        placement: &Placement,
        opts: &LoadOptions,
        cache: Option<&Arc<Cache>>,
        validate: bool,
        progress: &mut dyn FnMut(&Progress<'_>) -> bool,
    ) -> Result<()> {
        let infos = self.source.tensors();
        if placement.tensors.len() != infos.len() {
            return Err(invalid(
                "placement",
                format!("{} tensors", infos.len()),
                placement.tensors.len(),
            ));
        }
        let mut warnings = if validate {
            crate::validate::validate(self.source.as_ref())?
        } else {
            Vec::new()
        };
        let layer_devs: Vec<Arc<Device>> = placement
            .layers
            .iter()
            .map(|n| self.resolve(n))
            .collect::<Result<_>>()?;
        let mut targets = Vec::with_capacity(infos.len());
        for (info, place) in infos.iter().zip(&placement.tensors) {
            if place.split.is_some() {
                // A ggml block type quantises shard by shard; LLM.int8's scales and outlier
                // columns span whole rows, and nothing else converts per shard.
                let per_shard =
                    place.dtype != DType::INT8 && crate::convert::quantizing(info, place.dtype);
                if place.dtype != info.dtype && !per_shard {
                    return Err(EngineError::Unsupported {
                        what: format!("converting split tensor '{}' to {}", info.name, place.dtype),
                        detail: "split tensors are held in their stored dtype, or quantised \
                                 shard by shard from a float matrix to a ggml block type"
                            .into(),
                    });
                }
                targets.push(None);
                continue;
            }
            if place.device == "disk" && place.dtype != info.dtype {
                return Err(invalid(
                    format!("tensor '{}' on disk", info.name),
                    format!("its stored dtype {}", info.dtype),
                    place.dtype,
                ));
            }
            targets.push(Some(TensorTarget {
                device: self.resolve(&place.device)?,
                dtype: place.dtype,
                // Weights left on disk stay views of the file whatever use_mmap says.
                mapped: place.device == "disk",
            }));
        }
        if let Some(c) = cache
            && c.n_layers() != layer_devs.len()
        {
            return Err(invalid(
                "cache",
                format!("{} layers", layer_devs.len()),
                c.n_layers(),
            ));
        }
        let bytes_total: u64 = infos.iter().map(|t| t.nbytes).sum::<u64>()
            + placement
                .copies
                .iter()
                .filter_map(|(i, _)| infos.get(*i))
                .map(|t| t.nbytes)
                .sum::<u64>();
        let cpu = Arc::clone(self.inventory.cpu());
        let tp = placement.forward.as_ref().and_then(|f| f.tp.as_ref());
        let mut done = 0u64;
        let loaded = load(
            &self.source,
            &targets,
            opts,
            &mut |p| {
                done = p.bytes_done;
                progress(&Progress { bytes_total, ..*p })
            },
            &mut |layer| match (cache, layer_devs.get(layer as usize)) {
                (Some(c), Some(d)) if tp.is_none() => c.allocate_layer(layer as usize, d, &cpu),
                _ => Ok(()),
            },
        )?;
        match (cache, tp) {
            // Tensor parallelism: each device holds its kv heads of every layer.
            (Some(c), Some(t)) => c.allocate_tp(&self.tp_cache_parts(t)?)?,
            // Layers without tensors of their own (or all split) still get their cache slot.
            (Some(c), None) => {
                for (l, d) in layer_devs.iter().enumerate() {
                    c.allocate_layer(l, d, &cpu)?;
                }
            }
            (None, _) => {}
        }
        warnings.extend(loaded.warnings);
        let mut held = Vec::with_capacity(infos.len());
        let mut report = |done: &mut u64, name: &str, dev: &str, n: u64| -> Result<()> {
            *done += n;
            if progress(&Progress {
                bytes_done: *done,
                bytes_total,
                tensor: name,
                device: dev,
            }) {
                Ok(())
            } else {
                Err(EngineError::Cancelled {
                    bytes_done: *done,
                    bytes_total,
                })
            }
        };
        for ((i, t), place) in loaded
            .tensors
            .into_iter()
            .enumerate()
            .zip(&placement.tensors)
        {
            match (t, &place.split) {
                (Some(tensor), _) => held.push(Held::Whole {
                    tensor,
                    device: place.device.clone(),
                }),
                (None, Some(spec)) => {
                    let info = &infos[i];
                    held.push(self.load_split(i, spec, place.dtype)?);
                    report(&mut done, &info.name, &place.device, info.nbytes)?;
                }
                (None, None) => {
                    return Err(EngineError::Device {
                        device: place.device.clone(),
                        detail: format!("tensor '{}' was not loaded", infos[i].name),
                    });
                }
            }
        }
        let mut copies = Vec::new();
        for (i, place) in &placement.copies {
            let info = infos.get(*i).ok_or_else(|| {
                invalid(
                    "tensor copy",
                    format!("a tensor index below {}", infos.len()),
                    i,
                )
            })?;
            let copy = match &place.split {
                Some(spec) => self.load_split(*i, spec, place.dtype)?,
                None => {
                    let device = self.resolve(&place.device)?;
                    // A converted or quantised original is copied as held, so the copy has the
                    // type (and the bytes) the plan counted.
                    let converted = match held.get(*i) {
                        Some(Held::Whole { tensor, .. })
                            if place.dtype != info.dtype && tensor.dtype() == place.dtype =>
                        {
                            Some(tensor.to_host()?)
                        }
                        _ => None,
                    };
                    let (dtype, bytes) = match &converted {
                        Some(b) => (place.dtype, &b[..]),
                        None => (info.dtype, self.source.bytes(*i)),
                    };
                    let tensor =
                        DeviceTensor::from_host(&device, info.shape.clone(), dtype, bytes)?;
                    Held::Whole {
                        tensor,
                        device: place.device.clone(),
                    }
                }
            };
            copies.push((*i, copy));
            report(&mut done, &info.name, &place.device, info.nbytes)?;
        }
        let mut scratch = Vec::new();
        let tp_ctx = match (tp, &placement.forward) {
            (Some(t), Some(f)) => Some(self.tp_context(t, f, &placement.scratch)?),
            _ => None,
        };
        for (dev, bytes) in &placement.scratch {
            // Under tensor parallelism the context holds the accelerators' scratch and the
            // host's staging buffers; the host keeps the rest (the load's staging).
            let bytes = match &tp_ctx {
                Some(c) => bytes
                    .saturating_sub(c.memory().iter().find(|(n, _)| n == dev).map_or(0, |x| x.1)),
                None => *bytes,
            };
            if bytes > 0 && dev != "disk" {
                scratch.push(self.resolve(dev)?.alloc(bytes)?);
            }
        }
        let mut locked = crate::mlock::Locked::default();
        if opts.mlock {
            let mapped = held.iter().filter_map(|h| match h {
                Held::Whole { tensor, .. } if tensor.is_mapped() => tensor.host_bytes(),
                _ => None,
            });
            let (l, warning) = crate::mlock::Locked::lock(mapped);
            locked = l;
            warnings.extend(warning);
        }
        self.state = Some(State {
            locked,
            graph: None,
            forward: placement.forward.clone(),
            onload: placement.onload.clone(),
            tp: tp_ctx.map(|c| Arc::new(Mutex::new(c))),
            tp_graph: None,
            held,
            copies,
            scratch,
            layer_devices: placement.layers.clone(),
            cache: cache.cloned(),
            cache_made: false,
            warnings,
        });
        Ok(())
    }

    /// The tensor-parallel context the forward pass runs through, once loaded with a
    /// `tensor_parallel` plan: shared, so the bindings' `Model.tp` is this very context.
    pub fn tp_context_shared(&self) -> Option<Arc<Mutex<TpContext>>> {
        self.state.as_ref().and_then(|s| s.tp.clone())
    }

    /// The cache's split by the kv table: `(device, first head, end head)`.
    fn tp_cache_parts(&self, splits: &Splits) -> Result<Vec<(Arc<Device>, u32, u32)>> {
        let accel = self.inventory.accelerators();
        splits
            .kv
            .iter()
            .map(|&(d, a, b)| {
                let dev = accel.get(d).ok_or_else(|| {
                    invalid("tp kv table device", format!("below {}", accel.len()), d)
                })?;
                Ok((Arc::clone(dev), a as u32, b as u32))
            })
            .collect()
    }

    /// exllamav2's TPContext for a loaded plan: the plan's tables over the accelerators,
    /// host-staged collectives, each accelerator's scratch as the plan reserved it
    /// ([`weightlift_plan::TpWorkspace`]) and the two staging buffers of
    /// [`weightlift_plan::tp_staging_bytes`] on the host.
    fn tp_context(
        &self,
        splits: &Splits,
        f: &ForwardPlan,
        planned: &[(String, u64)],
    ) -> Result<TpContext> {
        let spec = self.source.spec().ok_or_else(|| EngineError::Unsupported {
            what: "tensor-parallel loading".into(),
            detail: "the checkpoint's architecture could not be read".into(),
        })?;
        let accel = self.inventory.accelerators().to_vec();
        let rope = crate::tp::Rope {
            theta: spec.rope_theta,
            dim: spec.rope_dim,
            head_dim: spec.head_dim,
            max_seq_len: f.max_seq_len,
        };
        let mut ctx = TpContext::new(splits.clone(), accel.clone(), rope, Box::new(HostStaged))?;
        let dims = weightlift_plan::Dims::new(spec, &f.runtime, f.max_seq_len, f.batch);
        if dims.tokens > 0 {
            ctx.finalize(
                self.inventory.cpu(),
                weightlift_plan::tp_staging_bytes(&dims),
            )?;
        }
        let scratch: Vec<u64> = accel
            .iter()
            .map(|d| {
                planned
                    .iter()
                    .find(|(n, _)| n == d.name())
                    .map_or(0, |x| x.1)
            })
            .collect();
        ctx.reserve_scratch(&scratch)?;
        Ok(ctx)
    }

    /// Cut tensor `i` by `spec` from the mmap and copy each part to its device.
    /// Cut tensor `i` into `spec`'s shards, each held as `dtype`: its stored type, or a ggml
    /// block type each shard is quantised to from the stored rows.
    fn load_split(&self, i: usize, spec: &SplitSpec, dtype: DType) -> Result<Held> {
        let info = &self.source.tensors()[i];
        let bytes = self.source.bytes(i);
        let mut parts = Vec::with_capacity(spec.shards.len());
        for (dev, a, b) in &spec.shards {
            let device = self.resolve(dev)?;
            let (shape, data) = match (spec.replicated, dtype == info.dtype) {
                (true, true) => (info.shape.clone(), bytes.to_vec()),
                (false, true) => slice_tensor(info, bytes, spec.axis, *a, *b)?,
                (true, false) => {
                    let rows = info.shape.first().copied().unwrap_or(0);
                    crate::convert::quantize_shard(info, bytes, 0, 0, rows, dtype)?
                }
                (false, false) => {
                    crate::convert::quantize_shard(info, bytes, spec.axis, *a, *b, dtype)?
                }
            };
            parts.push(DeviceTensor::from_host(&device, shape, dtype, &data)?);
        }
        Ok(Held::Split {
            parts,
            spec: spec.clone(),
        })
    }

    /// The placement of exllamav2's `load_tp` for `splits`: Q/K/V rows and the output
    /// projection's columns by the Q/KV tables, the MLP by the ID table, the embedding and head
    /// by the VC table; norms are replicated on every device of the KV table. Table device
    /// indices name the inventory's accelerators.
    pub fn tp_placement(&self, splits: &Splits) -> Result<Placement> {
        let spec = self.source.spec().ok_or_else(|| EngineError::Unsupported {
            what: "tensor-parallel loading".into(),
            detail: "the checkpoint's architecture could not be read".into(),
        })?;
        let hd = u64::from(spec.head_dim);
        let accel = self.inventory.accelerators();
        let name = |d: usize| -> Result<String> {
            accel
                .get(d)
                .map(|x| x.name().to_owned())
                .ok_or_else(|| invalid("tp device index", format!("below {}", accel.len()), d))
        };
        let mut tensors = Vec::new();
        for info in self.source.tensors() {
            let cut = tp_cut(info, hd);
            let (table, axis, unit, replicated): (&SplitTable, u8, u64, bool) = match cut {
                Cut::Rows { table, unit } => (splits.get(table)?, 0, unit, false),
                Cut::Cols { table, unit } => (splits.get(table)?, 1, unit, false),
                Cut::Replicate => (&splits.kv, 0, 1, true),
            };
            let axis = if info.shape.len() == 1 { 0 } else { axis };
            let len = if axis == 0 {
                info.shape.first().copied().unwrap_or(0)
            } else {
                info.shape.last().copied().unwrap_or(0)
            };
            let mut shards = Vec::new();
            for &(d, a, b) in table {
                let (s, e) = if replicated {
                    (0, len)
                } else {
                    ((a * unit).min(len), (b * unit).min(len))
                };
                shards.push((name(d)?, s, e));
            }
            let device = shards
                .first()
                .map_or_else(|| "cpu".to_owned(), |s| s.0.clone());
            tensors.push(TensorPlace {
                device,
                dtype: info.dtype,
                split: Some(SplitSpec {
                    axis,
                    replicated,
                    shards,
                }),
            });
        }
        let kv_dev = splits
            .kv
            .first()
            .map_or(Ok("cpu".to_owned()), |&(d, _, _)| name(d))?;
        Ok(Placement {
            tensors,
            layers: vec![kv_dev; spec.n_layers as usize],
            copies: Vec::new(),
            scratch: Vec::new(),
            forward: None,
            onload: None,
        })
    }

    /// Allocate `cache` beside the loaded layers (each layer on its device) and count it in
    /// [`Model::memory`]; the model frees it on unload.
    pub fn attach_cache(&mut self, cache: &Arc<Cache>) -> Result<()> {
        let cpu = Arc::clone(self.inventory.cpu());
        let devs: Vec<Arc<Device>> = self
            .layer_devices()?
            .iter()
            .map(|n| self.resolve(n))
            .collect::<Result<_>>()?;
        if cache.n_layers() != devs.len() {
            return Err(invalid(
                "cache",
                format!("{} layers", devs.len()),
                cache.n_layers(),
            ));
        }
        for (l, d) in devs.iter().enumerate() {
            if let Err(e) = cache.allocate_layer(l, d, &cpu) {
                cache.free();
                return Err(e);
            }
        }
        if let Some(s) = self.state.as_mut() {
            // A cache made for calls without one is nobody else's: it goes.
            if let Some(made) = s.cache.take().filter(|_| s.cache_made) {
                made.free();
            }
            s.cache = Some(Arc::clone(cache));
            s.cache_made = false;
        }
        Ok(())
    }

    /// The tensor dequantised (or converted) to f32 from the bytes on its device, at most
    /// `max_dq_size` values at a time (exllamav2's chunk limit; rounded down to whole blocks,
    /// at least one block). Host-resident tensors are decoded straight from their memory; the
    /// rest (CUDA memory, split tensors) go through one transient host buffer of at most one
    /// chunk's bytes. The output itself is the only allocation the size of the tensor.
    pub fn dequantized(&self, name: &str, max_dq_size: u64) -> Result<Dequantized> {
        let i = self.index(name)?;
        let info = &self.source.tensors()[i];
        let held = &self.state()?.held[i];
        let (dtype, shape) = match held {
            Held::Whole { tensor, .. } => (tensor.dtype(), tensor.shape().to_vec()),
            Held::Split { .. } => (held_split_type(info, held).0, info.shape.clone()),
        };
        let n: u64 = shape.iter().product();
        if dtype == DType::INT8 {
            // Its row scales follow every quant, so it decodes as one buffer.
            let bytes;
            let data = match held {
                Held::Whole { tensor, .. } => match tensor.host_bytes() {
                    Some(h) => h,
                    None => {
                        bytes = tensor.to_host()?;
                        &bytes[..]
                    }
                },
                Held::Split { .. } => {
                    return Err(invalid(
                        format!("dequantising tensor '{name}'"),
                        "a whole INT8 tensor",
                        "a split one",
                    ));
                }
            };
            let mut values = vec![0f32; usize::try_from(n).unwrap_or(usize::MAX)];
            crate::convert::dequantize_into(dtype, data, &mut values)?;
            return Ok(Dequantized {
                values,
                shape,
                chunks: 1,
                transient_bytes: if tensor_on_host(held) {
                    0
                } else {
                    data.len() as u64
                },
            });
        }
        let bs = dtype.block_size().max(1);
        let per = (max_dq_size / bs).max(1) * bs;
        let bytes_of = |e: u64| {
            dtype.bytes_for(e).ok_or_else(|| {
                invalid(
                    format!("dequantising tensor '{name}'"),
                    format!("whole {bs}-element blocks of {dtype}"),
                    format!("{e} elements"),
                )
            })
        };
        let host = match held {
            Held::Whole { tensor, .. } => tensor.host_bytes(),
            Held::Split { .. } => None,
        };
        let mut values = vec![0f32; usize::try_from(n).unwrap_or(usize::MAX)];
        let mut transient: Vec<u8> = Vec::new();
        let mut chunks = 0usize;
        let mut e0 = 0u64;
        while e0 < n {
            let m = per.min(n - e0);
            let (b0, blen) = (bytes_of(e0)? as usize, bytes_of(m)? as usize);
            let data: &[u8] = match host {
                Some(h) => h.get(b0..b0 + blen).ok_or_else(|| {
                    invalid(
                        format!("tensor '{name}'"),
                        format!("{} bytes", b0 + blen),
                        h.len(),
                    )
                })?,
                None => {
                    transient.reserve_exact(blen.saturating_sub(transient.len()));
                    transient.resize(blen, 0);
                    read_held(info, held, b0 as u64, &mut transient[..blen])?;
                    &transient[..blen]
                }
            };
            let out = &mut values[e0 as usize..(e0 + m) as usize];
            crate::convert::dequantize_into(dtype, data, out)?;
            chunks += 1;
            e0 += m;
        }
        Ok(Dequantized {
            values,
            shape,
            chunks,
            transient_bytes: transient.capacity() as u64,
        })
    }

    /// Free every tensor and the cache layers this model allocated.
    pub fn unload(&mut self) {
        if let Some(s) = self.state.take() {
            if let Some(c) = &s.cache {
                c.free();
            }
            // The bindings may still hold the context: its buffers go now all the same.
            if let Some(tp) = &s.tp {
                tp.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .unload();
            }
        }
    }

    fn index(&self, name: &str) -> Result<usize> {
        self.source
            .tensors()
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| {
                invalid(
                    "tensor name",
                    format!("a tensor of {}", self.source.path().display()),
                    format!("'{name}'"),
                )
            })
    }

    fn state(&self) -> Result<&State> {
        self.state.as_ref().ok_or_else(|| EngineError::NotLoaded {
            what: "the model".into(),
        })
    }

    pub fn held(&self, name: &str) -> Result<&Held> {
        let i = self.index(name)?;
        Ok(&self.state()?.held[i])
    }

    /// The checkpoint's entry for a tensor.
    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        Ok(&self.source.tensors()[self.index(name)?])
    }

    /// The dtype a loaded tensor is held in and its bytes there (a split tensor's bytes are
    /// those of one copy: its shards together, or one replica).
    pub fn held_type(&self, name: &str) -> Result<(DType, u64)> {
        let info = self.tensor_info(name)?;
        Ok(match self.held(name)? {
            Held::Whole { tensor, .. } => (tensor.dtype(), tensor.nbytes()),
            held @ Held::Split { .. } => held_split_type(info, held),
        })
    }

    /// The device a tensor was placed on (`"tp"` joins the devices of a split tensor).
    pub fn device_of(&self, name: &str) -> Result<String> {
        Ok(match self.held(name)? {
            Held::Whole { device, .. } => device.clone(),
            Held::Split { parts, .. } => parts
                .iter()
                .map(|t| t.device().name())
                .collect::<Vec<_>>()
                .join(","),
        })
    }

    pub fn layer_devices(&self) -> Result<&[String]> {
        Ok(&self.state()?.layer_devices)
    }

    /// The tensor's stored bytes, copied from wherever they live (split tensors are
    /// reassembled, CUDA memory is copied back), with its dtype and shape.
    pub fn tensor_bytes(&self, name: &str) -> Result<(Vec<u8>, DType, Vec<u64>)> {
        let i = self.index(name)?;
        let info = &self.source.tensors()[i];
        match &self.state()?.held[i] {
            Held::Whole { tensor, .. } => {
                Ok((tensor.to_host()?, tensor.dtype(), tensor.shape().to_vec()))
            }
            held @ Held::Split { .. } => {
                let (dtype, nbytes) = held_split_type(info, held);
                let mut out = vec![0u8; nbytes as usize];
                read_held(info, held, 0, &mut out)?;
                Ok((out, dtype, info.shape.clone()))
            }
        }
    }

    /// Bytes held per device name, every device of the inventory listed (and `disk` when used):
    /// weights (mmap views count on `cpu`, as page cache), cache layers and reserved scratch.
    pub fn memory(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self
            .inventory
            .all()
            .iter()
            .map(|d| (d.name().to_owned(), 0))
            .collect();
        let mut add = |name: &str, b: u64| match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => *v += b,
            None => out.push((name.to_owned(), b)),
        };
        if let Some(s) = &self.state {
            for h in &s.held {
                match h {
                    Held::Whole { tensor, device } => add(device, tensor.nbytes()),
                    Held::Split { parts, .. } => parts
                        .iter()
                        .for_each(|t| add(t.device().name(), t.nbytes())),
                }
            }
            for (_, h) in &s.copies {
                match h {
                    Held::Whole { tensor, .. } => add(tensor.device().name(), tensor.nbytes()),
                    Held::Split { parts, .. } => parts
                        .iter()
                        .for_each(|t| add(t.device().name(), t.nbytes())),
                }
            }
            for b in &s.scratch {
                add(b.device().name(), b.len() as u64);
            }
            if let Some(tp) = &s.tp {
                let tp = tp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                for (n, b) in tp.memory() {
                    add(&n, b);
                }
            }
            if let Some(c) = &s.cache {
                for (n, b) in c.memory() {
                    add(&n, b);
                }
            }
        }
        out
    }

    /// Anonymous bytes currently held per device (arena/heap accounting, no mmap views).
    pub fn device_usage(&self) -> Vec<(String, u64)> {
        self.inventory
            .all()
            .iter()
            .map(|d| (d.name().to_owned(), d.used()))
            .collect()
    }

    /// The most anonymous bytes held at once per device since the last load began (weights,
    /// cache, scratch and anything a forward pass allocated): what the plan's columns promise.
    pub fn peak_memory(&self) -> Vec<(String, u64)> {
        self.inventory
            .all()
            .iter()
            .map(|d| (d.name().to_owned(), d.peak()))
            .collect()
    }

    /// The accelerators (in order) and cpu, as devices.
    pub fn devices(&self) -> Vec<Arc<Device>> {
        self.inventory.all()
    }

    /// True when every device is an accelerator of kind `kind`.
    pub fn has_kind(&self, kind: DeviceKind) -> bool {
        self.inventory
            .accelerators()
            .iter()
            .any(|d| d.kind() == kind)
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        self.unload();
    }
}

/// exllamav2's TP cut of each role.
pub fn tp_cut(info: &TensorInfo, head_dim: u64) -> Cut {
    use crate::tp::{BROADCAST_ID, BROADCAST_KV, BROADCAST_Q, BROADCAST_VC};
    match info.role {
        Some(Role::AttnQ | Role::AttnQBias) => Cut::Rows {
            table: BROADCAST_Q,
            unit: head_dim,
        },
        Some(Role::AttnK | Role::AttnV | Role::AttnKBias | Role::AttnVBias) => Cut::Rows {
            table: BROADCAST_KV,
            unit: head_dim,
        },
        Some(Role::AttnOutput) => Cut::Cols {
            table: BROADCAST_Q,
            unit: head_dim,
        },
        Some(Role::FfnGate | Role::FfnUp) => Cut::Rows {
            table: BROADCAST_ID,
            unit: 1,
        },
        Some(Role::FfnDown) => Cut::Cols {
            table: BROADCAST_ID,
            unit: 1,
        },
        Some(Role::TokenEmbd | Role::Output) => Cut::Rows {
            table: BROADCAST_VC,
            unit: 1,
        },
        _ => Cut::Replicate,
    }
}

/// Rows (`axis` 0) or columns (`axis` 1) `start..end` of a 1-D or 2-D tensor. Column cuts of
/// block-quantised data must fall on block boundaries.
fn slice_tensor(
    info: &TensorInfo,
    bytes: &[u8],
    axis: u8,
    start: u64,
    end: u64,
) -> Result<(Vec<u64>, Vec<u8>)> {
    let bad = |what: &str| EngineError::Unsupported {
        what: format!(
            "splitting tensor '{}' ({}, shape {:?})",
            info.name, info.dtype, info.shape
        ),
        detail: what.to_owned(),
    };
    let (rows, cols, one_d) = match *info.shape.as_slice() {
        [r, c] => (r, c, false),
        [c] => (1, c, true),
        _ => return Err(bad("only 1-D and 2-D tensors split")),
    };
    let row_bytes = info
        .dtype
        .bytes_for(cols)
        .ok_or_else(|| bad("rows are not whole blocks"))? as usize;
    if axis == 0 && !one_d {
        let (r0, r1) = (start.min(rows), end.min(rows).max(start.min(rows)));
        return Ok((
            vec![r1 - r0, cols],
            bytes[r0 as usize * row_bytes..r1 as usize * row_bytes].to_vec(),
        ));
    }
    let (c0, c1) = (start.min(cols), end.min(cols).max(start.min(cols)));
    let bs = info.dtype.block_size();
    if c0 % bs != 0 || (c1 % bs != 0 && c1 != cols) {
        return Err(bad(&format!(
            "columns {c0}..{c1} do not fall on {bs}-element block boundaries"
        )));
    }
    let b0 = (c0 / bs * info.dtype.type_size()) as usize;
    let b1 = (c1.div_ceil(bs) * info.dtype.type_size()) as usize;
    let mut out = Vec::with_capacity(rows as usize * (b1 - b0));
    for r in 0..rows as usize {
        out.extend_from_slice(&bytes[r * row_bytes + b0..r * row_bytes + b1]);
    }
    let shape = if one_d {
        vec![c1 - c0]
    } else {
        vec![rows, c1 - c0]
    };
    Ok((shape, out))
}

/// Bytes `offset..offset + dst.len()` of a held tensor as the checkpoint lays it out: split
/// parts are reassembled (row splits concatenate, column splits interleave per row).
fn read_held(info: &TensorInfo, held: &Held, offset: u64, dst: &mut [u8]) -> Result<()> {
    let (parts, spec) = match held {
        Held::Whole { tensor, .. } => return tensor.read(offset, dst),
        Held::Split { parts, spec } => (parts, spec),
    };
    let want = dst.len();
    let short = |filled: usize| {
        invalid(
            format!("reading split tensor '{}'", info.name),
            format!("{want} bytes at {offset}"),
            format!("{filled} bytes in its parts"),
        )
    };
    if spec.replicated {
        return parts.first().ok_or_else(|| short(0))?.read(offset, dst);
    }
    let mut filled = 0usize;
    let mut off = offset;
    if spec.axis == 0 || info.shape.len() == 1 {
        let mut base = 0u64;
        for t in parts {
            let n = t.nbytes();
            if filled < want && off >= base && off < base + n {
                let take = ((base + n - off) as usize).min(want - filled);
                t.read(off - base, &mut dst[filled..filled + take])?;
                filled += take;
                off += take as u64;
            }
            base += n;
        }
    } else {
        let rows = info.shape.first().copied().unwrap_or(1).max(1);
        let widths: Vec<u64> = parts.iter().map(|t| t.nbytes() / rows).collect();
        let row_bytes: u64 = widths.iter().sum();
        while filled < want && row_bytes > 0 {
            let (r, mut c) = (off / row_bytes, off % row_bytes);
            let mut p = 0;
            while p < widths.len() && c >= widths[p] {
                c -= widths[p];
                p += 1;
            }
            let Some(t) = parts.get(p) else { break };
            let take = ((widths[p] - c) as usize).min(want - filled);
            t.read(r * widths[p] + c, &mut dst[filled..filled + take])?;
            filled += take;
            off += take as u64;
        }
    }
    if filled != want {
        return Err(short(filled));
    }
    Ok(())
}

/// The type a split tensor's parts hold and the bytes of one whole copy of it: the stored
/// type and size, or the type its shards were quantised to and their sum.
fn held_split_type(info: &TensorInfo, held: &Held) -> (DType, u64) {
    match held {
        Held::Split { parts, spec } => {
            let dtype = parts.first().map_or(info.dtype, DeviceTensor::dtype);
            let nbytes = if spec.replicated {
                parts.first().map_or(info.nbytes, DeviceTensor::nbytes)
            } else {
                parts.iter().map(DeviceTensor::nbytes).sum()
            };
            (dtype, nbytes)
        }
        Held::Whole { tensor, .. } => (tensor.dtype(), tensor.nbytes()),
    }
}

/// A tensor dequantised to f32 by [`Model::dequantized`].
#[derive(Debug)]
pub struct Dequantized {
    pub values: Vec<f32>,
    pub shape: Vec<u64>,
    /// How many chunks of at most `max_dq_size` values it took.
    pub chunks: usize,
    /// Bytes of the transient host buffer used (0 when decoded straight from host memory).
    pub transient_bytes: u64,
}

/// Whether a held tensor's bytes are host memory (read in place).
fn tensor_on_host(held: &Held) -> bool {
    matches!(held, Held::Whole { tensor, .. } if tensor.host_bytes().is_some())
}

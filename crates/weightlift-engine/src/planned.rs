//! The bridge to the planner: a model's devices and tensors become a `PlanRequest`, and a
//! `Plan` becomes the [`Placement`] the loader carries out.

use weightlift_plan::{
    DeviceKind as PlanKind, DeviceSpec, MemoryProbe, Plan, PlanError, PlanRequest, TpKind, TpSplit,
};

use crate::cache::CacheConfig;
use crate::device::{DeviceKind, HostProbe, Inventory};
use crate::error::{EngineError, Result, invalid};
use crate::model::{Model, Placement, SplitSpec, TensorPlace};
use crate::source::Source;
use crate::tp::Splits;

/// The planner's view of an inventory: accelerators in order (a `cuda:N` with the capacity and
/// the measured overhead of [`crate::Device::planned`]), then `cpu` (unbounded unless capped),
/// then `disk` when it was named.
pub fn device_specs(inv: &Inventory) -> Vec<DeviceSpec> {
    let mut out: Vec<DeviceSpec> = inv
        .accelerators()
        .iter()
        .map(|d| match (d.kind(), d.planned()) {
            (DeviceKind::Cuda, Some((capacity, overhead))) => {
                DeviceSpec::cuda(d.name(), capacity, overhead)
            }
            (DeviceKind::Cuda, None) => {
                DeviceSpec::new(d.name(), PlanKind::Cuda, d.capacity().unwrap_or(u64::MAX))
            }
            _ => DeviceSpec::new(
                d.name(),
                PlanKind::Virtual,
                d.capacity().unwrap_or(u64::MAX),
            ),
        })
        .collect();
    if inv.cpu_listed {
        out.push(DeviceSpec::new(
            "cpu",
            PlanKind::Cpu,
            inv.cpu().capacity().unwrap_or(u64::MAX),
        ));
    }
    if inv.disk {
        out.push(DeviceSpec::new("disk", PlanKind::Disk, u64::MAX));
    }
    out
}

/// This machine's devices as `weightlift devices` lists them: `cpu` at MemAvailable, then
/// every CUDA GPU the engine can see (at its free memory, with its measured overhead), then
/// `disk`.
pub fn machine_devices() -> std::result::Result<Vec<DeviceSpec>, PlanError> {
    let mut items = vec!["cpu".to_owned()];
    items.extend((0..HostProbe.cuda_count()).map(|i| format!("cuda:{i}")));
    items.push("disk".into());
    weightlift_plan::parse_devices_with(&items.join(","), &HostProbe)
}

/// The devices a plan is made for: those of `spec` (`"virtual:2x8GiB,cpu"`; a `cuda:N` or
/// `cpu` without a size is probed on this machine), or without one this machine's, every CUDA
/// GPU then `cpu` ([`weightlift_plan::inventory`]), as a model made without devices has them.
pub fn plan_devices(spec: Option<&str>) -> std::result::Result<Vec<DeviceSpec>, PlanError> {
    match spec {
        Some(spec) => weightlift_plan::parse_devices_with(spec, &HostProbe),
        None => Ok(weightlift_plan::inventory(&HostProbe)),
    }
}

/// The planner's cache request for an engine cache: its shape, dtype and offload flag. An
/// offloaded cache is planned as what the engine allocates for it: every layer on `cpu`, and
/// on each layer device `min(layers there, SLOTS)` prefetch slots of its largest layer
/// ([`crate::cache::SLOTS`] is the planner's [`weightlift_plan::OFFLOAD_SLOTS`]), so the plan's
/// kv column is what [`crate::Model::memory`] reports for the cache.
pub fn cache_spec(cfg: &CacheConfig) -> weightlift_plan::CacheSpec {
    weightlift_plan::CacheSpec::new(cfg.max_seq_len, cfg.batch_size, cfg.dtype)
        .with_offload(cfg.offload)
}

/// The TP tables of a plan.
pub fn splits(tp: &TpSplit) -> Splits {
    Splits {
        kv: tp.table(TpKind::Kv).to_vec(),
        id: tp.table(TpKind::Id).to_vec(),
        vc: tp.table(TpKind::Vc).to_vec(),
        rs: tp.table(TpKind::Rs).to_vec(),
        q: tp.table(TpKind::Q).to_vec(),
        ex: tp.table(TpKind::Ex).to_vec(),
    }
}

/// What a model's own plan request takes from the model rather than the call: its `dtype`,
/// its quantise-on-load mode and its runtime limits.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PlanDefaults {
    pub dtype: weightlift_plan::DTypeChoice,
    pub quantize: Option<weightlift_plan::Quantize>,
    pub runtime: weightlift_plan::RuntimeSpec,
}

impl Model {
    /// A plan request for this model: its architecture, its real tensor table and its devices,
    /// with exllamav2's default strategy (the caller sets the rest).
    pub fn plan_request(&self) -> Result<PlanRequest> {
        let spec = self
            .source()
            .spec()
            .cloned()
            .ok_or_else(|| EngineError::Unsupported {
                what: "planning this checkpoint".into(),
                detail: "its architecture could not be read from the metadata or config.json"
                    .into(),
            })?;
        let mut req = PlanRequest::new(
            spec,
            self.source().tensors().to_vec(),
            device_specs(self.inventory()),
        );
        req.sliding_window = self.sliding_window()?;
        req.moe = match self.source().checkpoint() {
            Some(ckpt) => moe_of(ckpt)?,
            None => None,
        };
        Ok(req)
    }

    /// Load by `plan`, or plan now with `options` over this model's own request (its
    /// `defaults`: dtype, quantisation and runtime, and `opts`' mmap and staging), and return
    /// the plan loaded. A given plan takes no placement options; a plan that reserved a cache
    /// (given, or asked for by `options.cache`), or a tensor-parallel plan (whose cache is
    /// `expect_cache_tokens`, split by kv heads as exllamav2's TP cache), gets that cache made
    /// beside its layers when `cache` is `None`; a cache of N sequences is made as N caches of
    /// one, the own cache and [`Model::planned_sequences`]. A plan with a `rank` loads only
    /// that rank's share, on this model's one accelerator.
    pub fn plan_and_load(
        &mut self,
        plan: Option<Plan>,
        options: weightlift_plan::PlanOptions,
        defaults: &PlanDefaults,
        mut cache: Option<std::sync::Arc<crate::Cache>>,
        opts: &crate::LoadOptions,
        progress: &mut dyn FnMut(&crate::Progress<'_>) -> bool,
    ) -> Result<Plan> {
        let rank = options.rank;
        let plan = match plan {
            Some(_) if options != weightlift_plan::PlanOptions::default() => {
                return Err(invalid(
                    "load",
                    "a plan or placement options",
                    "both; a plan already says where everything goes, so pass one or the other",
                ));
            }
            Some(p) => p,
            None => {
                let mut req = self.plan_request()?;
                req.dtype = defaults.dtype;
                req.quantize = defaults.quantize;
                req.runtime = defaults.runtime;
                req.use_mmap = opts.use_mmap;
                req.staging_bytes = opts.staging_bytes as u64;
                // Offloaded, the plan charges the whole cache to the cpu and the prefetch
                // slots to each layer device, as the cache allocates them.
                req.cache = cache.as_ref().map(|c| cache_spec(c.config()));
                options.apply(&mut req)?;
                weightlift_plan::plan(&req)?
            }
        };
        let own = plan.cache().filter(|_| cache.is_none());
        // A plan's cache of several sequences is that many caches of one: the own cache and
        // the rest beside it, or split like it over a tensor-parallel plan's devices (the
        // forward pass runs caches of one sequence). Its rings are those the plan counted: for
        // the plan's runtime.
        let mut sequences = 1;
        if let Some(spec) = own {
            let mut one = *spec;
            (sequences, one.batch_size) = (spec.batch_size, 1);
            let config = self.cache_config_for(
                (one.max_seq_len, one.batch_size),
                one.dtype,
                one.offload,
                plan.runtime(),
            )?;
            cache = Some(std::sync::Arc::new(crate::Cache::new(config)?));
        }
        let placement = match rank {
            Some(r) => self.own_rank_placement(&plan, r)?,
            None => self.placement(&plan)?,
        };
        self.load(&placement, opts, cache.as_ref(), true, progress)?;
        if sequences > 1 {
            let n_ctx = self.own_cache()?.config().max_seq_len;
            let more = (1..sequences)
                .map(|_| self.sequence_cache(n_ctx))
                .collect::<Result<Vec<_>>>();
            match (more, self.state.as_mut()) {
                (Ok(more), Some(s)) => s.sequences = more,
                (Err(e), _) => {
                    self.unload();
                    return Err(e);
                }
                (Ok(_), None) => {}
            }
        }
        Ok(plan)
    }

    /// The placement that carries out `plan`.
    pub fn placement(&self, plan: &Plan) -> Result<Placement> {
        placement(plan, self.source().as_ref())
    }

    /// The placement that loads rank `rank` of a tensor-parallel `plan` on this model's one
    /// accelerator: a rank's process drives one GPU.
    pub fn own_rank_placement(&self, plan: &Plan, rank: usize) -> Result<Placement> {
        let accel = self.inventory().accelerators();
        let [own] = accel else {
            return Err(invalid(
                "devices of a rank's process",
                "one accelerator, this rank's GPU (cuda:$LOCAL_RANK)",
                format!("{} accelerators", accel.len()),
            ));
        };
        rank_placement(plan, self.source().as_ref(), rank, Some(own.name()))
    }

    /// The placement that loads rank `rank` of a tensor-parallel `plan` on `device`
    /// ([`rank_placement`]).
    pub fn rank_placement(
        &self,
        plan: &Plan,
        rank: usize,
        device: Option<&str>,
    ) -> Result<Placement> {
        rank_placement(plan, self.source().as_ref(), rank, device)
    }
}

/// A plan as a placement for `source`: every tensor's device and dtype, splits (llama.cpp row
/// split, tensor parallelism), layer devices, and the tied output copy.
pub fn placement(plan: &Plan, source: &dyn Source) -> Result<Placement> {
    let infos = source.tensors();
    let placed = plan.tensors();
    if placed.len() != infos.len() {
        return Err(invalid(
            "plan",
            format!(
                "{} tensors (as in {})",
                infos.len(),
                source.path().display()
            ),
            format!(
                "{} tensors; the plan was made for another checkpoint",
                placed.len()
            ),
        ));
    }
    let mut tensors = Vec::with_capacity(infos.len());
    for (info, p) in infos.iter().zip(placed) {
        if p.name != info.name {
            return Err(invalid(
                "plan tensor order",
                format!("'{}'", info.name),
                format!("'{}'", p.name),
            ));
        }
        let split = p.split.as_ref().map(|s| SplitSpec {
            axis: s.axis,
            replicated: s.replicated,
            shards: s
                .shards
                .iter()
                .map(|sh| (sh.device.clone(), sh.start, sh.end))
                .collect(),
        });
        tensors.push(TensorPlace {
            device: p.device.clone(),
            dtype: p.dtype,
            split,
        });
    }
    let mut copies = Vec::new();
    if let Some(dev) = plan.tied_output_copy() {
        let embd = infos
            .iter()
            .position(|t| t.role == Some(weightlift_format::Role::TokenEmbd))
            .ok_or_else(|| {
                invalid(
                    "plan",
                    "a token_embd tensor for the tied output copy",
                    "none in the checkpoint",
                )
            })?;
        let place = match plan.tp() {
            // Under tensor parallelism the tied head is split by the vocab table.
            Some(tp) => {
                let accel = accelerators(plan);
                let mut shards = Vec::new();
                for &(d, a, b) in tp.table(TpKind::Vc) {
                    let name = accel.get(d).ok_or_else(|| {
                        invalid(
                            "plan vc table",
                            format!("device indices below {}", accel.len()),
                            d,
                        )
                    })?;
                    shards.push(((*name).to_owned(), a, b));
                }
                TensorPlace {
                    device: dev.to_owned(),
                    dtype: tensors[embd].dtype,
                    split: Some(SplitSpec {
                        axis: 0,
                        replicated: false,
                        shards,
                    }),
                }
            }
            None => TensorPlace {
                device: dev.to_owned(),
                dtype: tensors[embd].dtype,
                split: None,
            },
        };
        copies.push((embd, place));
    }
    let scratch = plan
        .devices()
        .iter()
        // the kernels' own share (CUDA's prompt tiles) is theirs to allocate
        .map(|d| (d.name.clone(), d.scratch.saturating_sub(d.kernel_scratch)))
        .collect();
    let (max_seq_len, batch) = plan
        .cache()
        .map_or((plan.runtime().max_input_len.max(1), 1), |c| {
            (c.max_seq_len, c.batch_size)
        });
    // Offloaded layers compute on the execution device, and their cache lives there.
    let mut layers = plan.layer_devices().to_vec();
    if let Some(o) = plan.onload() {
        for &l in o.groups.iter().flatten() {
            if let Some(d) = layers.get_mut(l as usize) {
                d.clone_from(&o.device);
            }
        }
    }
    Ok(Placement {
        tensors,
        layers,
        copies,
        scratch,
        onload: plan.onload().cloned(),
        forward: Some(crate::model::ForwardPlan {
            runtime: *plan.runtime(),
            max_seq_len,
            batch,
            tp: plan.tp().map(splits),
            rank: None,
        }),
    })
}

/// The names of a plan's accelerators: what its split tables' device indices count.
fn accelerators(plan: &Plan) -> Vec<&str> {
    plan.devices()
        .iter()
        .filter(|d| d.kind.is_accelerator())
        .map(|d| d.name.as_str())
        .collect()
}

/// The share of a tensor-parallel `plan` that the process running rank `rank` loads: its
/// parts of every split tensor (renamed from the plan's `rank`-th accelerator, which stood for
/// it, to `device`), the host's whole tensors, its scratch and the host's; the other ranks'
/// parts are left to their processes. `device` defaults to the rank's device in the plan's
/// world (`cuda:{local_rank}`), else the accelerator that stood for it.
pub fn rank_placement(
    plan: &Plan,
    source: &dyn Source,
    rank: usize,
    device: Option<&str>,
) -> Result<Placement> {
    if plan.tp().is_none() {
        return Err(invalid(
            "plan for a rank-local load",
            "a tensor_parallel plan",
            format!("a {} plan", plan.strategy()),
        ));
    }
    let accel = accelerators(plan);
    let planned = *accel.get(rank).ok_or_else(|| {
        invalid(
            "tp rank",
            format!("below the plan's {} ranks (its accelerators)", accel.len()),
            rank,
        )
    })?;
    let local = match (device, plan.tp_ranks()) {
        (Some(d), _) => d.to_owned(),
        (None, Some(ranks)) => ranks
            .get(rank)
            .map_or_else(|| planned.to_owned(), |r| r.device.clone()),
        (None, None) => planned.to_owned(),
    };
    let mut p = placement(plan, source)?;
    let elsewhere = |d: &str| accel.contains(&d) && d != planned;
    let keep = |place: &mut TensorPlace, name: &str| -> Result<()> {
        match &mut place.split {
            Some(s) => {
                s.shards.retain(|sh| sh.0 == planned);
                s.shards.iter_mut().for_each(|sh| sh.0.clone_from(&local));
                place.device.clone_from(&local);
            }
            None if place.device == planned => place.device.clone_from(&local),
            None if elsewhere(&place.device) => {
                return Err(invalid(
                    format!("tensor '{name}' in a rank-local load"),
                    format!("split over the ranks, or whole on the host or on {planned}"),
                    format!("whole on {}, another rank's device", place.device),
                ));
            }
            None => {}
        }
        Ok(())
    };
    for (place, info) in p.tensors.iter_mut().zip(source.tensors()) {
        keep(place, &info.name)?;
    }
    for (i, place) in &mut p.copies {
        let name = source.tensors().get(*i).map_or("?", |t| t.name.as_str());
        keep(place, name)?;
    }
    p.layers.iter_mut().for_each(|l| l.clone_from(&local));
    p.scratch.retain(|(d, _)| !elsewhere(d));
    for (d, _) in &mut p.scratch {
        if d == planned {
            d.clone_from(&local);
        }
    }
    if let Some(f) = &mut p.forward {
        f.rank = Some(crate::model::RankPlace {
            rank,
            world_size: accel.len(),
            device: local,
        });
    }
    Ok(p)
}

/// The sliding-window layers of `ckpt` (of architecture `spec`): its GGUF metadata with
/// llama.cpp's per-architecture patterns, or its config.json by transformers' rules
/// ([`weightlift_plan::SlidingWindow`]); `None` when it has none. The one reading of them: plans
/// size caches by it, the forward pass masks attention with it and the cache keeps those
/// layers as rings of the cells the plan counts.
pub fn sliding_window_of(
    ckpt: &weightlift_format::Checkpoint,
    spec: &weightlift_format::ModelSpec,
) -> Result<Option<weightlift_plan::SlidingWindow>> {
    use weightlift_format::{Format, FormatError};
    let window = match (ckpt.format(), ckpt.config()) {
        (Format::Gguf, _) => weightlift_plan::SlidingWindow::from_gguf(ckpt.metadata(), spec),
        (Format::Safetensors, Some(config)) => {
            weightlift_plan::SlidingWindow::from_hf_config(config, spec)
        }
        (Format::Safetensors, None) => Ok(None),
    };
    Ok(window.map_err(|e| FormatError::Spec {
        key: "sliding window".into(),
        detail: format!("{}: {e}", ckpt.path().display()),
    })?)
}

/// How the layers of `ckpt` route to experts: its GGUF metadata or its config.json
/// ([`weightlift_format::MoeSpec`]); `None` for a dense model. The one reading of them: plans
/// size the workspace by it and the forward pass routes by it.
pub fn moe_of(
    ckpt: &weightlift_format::Checkpoint,
) -> weightlift_format::Result<Option<weightlift_format::MoeSpec>> {
    use weightlift_format::{Format, MoeSpec};
    match (ckpt.format(), ckpt.config()) {
        (Format::Gguf, _) => MoeSpec::from_gguf(ckpt.metadata()),
        (Format::Safetensors, Some(config)) => MoeSpec::from_hf_config(config),
        (Format::Safetensors, None) => Ok(None),
    }
}

/// What `plan()` and `fit()` plan for, with the model's sliding-window layers: a checkpoint,
/// an HF config (a dict, a config.json, or a folder holding only one) or a bare spec. Planning
/// reads no tensor data; opening a path reads the headers.
#[derive(Debug, Clone)]
pub struct PlanSource {
    model: weightlift_plan::ModelSource,
    window: Option<weightlift_plan::SlidingWindow>,
    moe: Option<weightlift_format::MoeSpec>,
}

impl PlanSource {
    /// A spec alone: its tensors are synthesised at the weight type the options name.
    pub fn spec(spec: weightlift_format::ModelSpec) -> PlanSource {
        PlanSource {
            model: weightlift_plan::ModelSource::Config(spec, None, None, false),
            window: None,
            moe: None,
        }
    }

    /// An HF `config.json`'s contents; its `torch_dtype` is the weight type unless the options
    /// name one.
    pub fn hf_config(config: &serde_json::Value) -> Result<PlanSource> {
        let spec = weightlift_format::ModelSpec::from_hf_config(config)?;
        let window = weightlift_plan::SlidingWindow::from_hf_config(config, &spec)?;
        let moe = weightlift_format::MoeSpec::from_hf_config(config)?;
        let dtype = weightlift_format::hf_config::stored_dtype(config).map(str::to_owned);
        let longrope = weightlift_format::hf_config::has_longrope_factors(config);
        Ok(PlanSource {
            model: weightlift_plan::ModelSource::Config(spec, dtype, moe.clone(), longrope),
            window,
            moe,
        })
    }

    /// A path: a folder holding only a config.json or the config itself is read as a config,
    /// anything else is opened as a checkpoint.
    pub fn path(path: &std::path::Path) -> Result<PlanSource> {
        use weightlift_format::hf_config;
        if let Some(config) = hf_config::config_only(path) {
            return PlanSource::hf_config(&hf_config::read(&config)?);
        }
        let ckpt = weightlift_format::Checkpoint::open(path, Default::default())?;
        PlanSource::checkpoint(&ckpt)
    }

    /// An opened checkpoint's tensor table, which needs its architecture; one opened
    /// `vocab_only` has no table to plan.
    pub fn checkpoint(ckpt: &weightlift_format::Checkpoint) -> Result<PlanSource> {
        use weightlift_format::FormatError;
        let path = ckpt.path().to_path_buf();
        if ckpt.vocab_only() {
            return Err(invalid(
                path.display().to_string(),
                "a tensor table to plan; open it without vocab_only",
                "a checkpoint opened with vocab_only=True",
            ));
        }
        let spec = ckpt.spec().map_err(|e| FormatError::Unsupported {
            path: path.clone(),
            what: "planning without the architecture".into(),
            detail: e.to_owned(),
        })?;
        let window = sliding_window_of(ckpt, spec)?;
        Ok(PlanSource {
            model: weightlift_plan::ModelSource::Tensors(spec.clone(), ckpt.tensors().to_vec()),
            window,
            moe: moe_of(ckpt)?,
        })
    }

    /// The request for `options` on `devices`.
    pub fn request(
        self,
        options: weightlift_plan::PlanOptions,
        devices: Vec<DeviceSpec>,
    ) -> Result<PlanRequest> {
        let mut req = options.into_request(self.model, devices)?;
        req.sliding_window = self.window;
        req.moe = self.moe;
        Ok(req)
    }
}

#[cfg(test)]
mod machine_tests {
    use super::*;

    #[test]
    fn the_machine_lists_cpu_first_and_disk_last_and_a_spec_is_taken_as_given() {
        let all = machine_devices().unwrap();
        let names: Vec<&str> = all.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names.first(), Some(&"cpu"));
        assert_eq!(names.last(), Some(&"disk"));
        assert_eq!(all.len() as u32, HostProbe.cuda_count() + 2);
        let given = plan_devices(Some("virtual:2x1GiB,cpu:2GiB")).unwrap();
        let given: Vec<(&str, u64)> = given
            .iter()
            .map(|d| (d.name.as_str(), d.capacity))
            .collect();
        assert_eq!(
            given,
            [
                ("virtual:0", 1 << 30),
                ("virtual:1", 1 << 30),
                ("cpu", 2 << 30)
            ]
        );
        // Without a spec: the accelerators, then the cpu; never disk.
        let own = plan_devices(None).unwrap();
        assert_eq!(own.last().map(|d| d.name.as_str()), Some("cpu"));
        assert_eq!(own.len() as u32, HostProbe.cuda_count() + 1);
    }
}

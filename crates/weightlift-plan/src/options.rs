//! The one place where user options become a [`PlanRequest`].
//!
//! Every entry point (`plan`, `fit`, `Model.load`, `load_autosplit`, `load_tp`,
//! `from_pretrained`, `load_gguf`, `TPContext` and the CLI) fills a [`PlanOptions`] with what
//! the user passed and nothing more (read from the keywords users write by
//! [`crate::keywords`]), then calls [`PlanOptions::into_request`] (a fresh request)
//! or [`PlanOptions::apply`] (a model's own request). So the same arguments mean the same thing
//! everywhere:
//!
//! - **Strategy inference.** With no `strategy`, a `device_map` preset names its strategy, a
//!   `device_map` dict means `map`, a llama.cpp option or `overrides` alone mean `layers`
//!   (llama.cpp applies `-ot` rules over the `-ngl` placement; with a map they win over its
//!   entries), and
//!   `gpu_split`, an expected TP cache or a multi-process `world` mean `tensor_parallel`; otherwise the request's own
//!   strategy stays (exllamav2's autosplit by default). Options of another strategy than the
//!   one named are an error naming both, never silently dropped.
//! - **`device_map`** is a preset (`"auto"` and `"balanced"` = balanced, `"balanced_low_0"`,
//!   `"sequential"`), a single device name (everything there), or prefix → device entries
//!   where `re:PATTERN` keys are llama.cpp `-ot` overrides. A preset sizes budgets as
//!   transformers 5's `from_pretrained(device_map=...)` does ([`BudgetRule::Transformers`]);
//!   a strategy named without one, as accelerate's `get_balanced_memory` does.
//! - **Sizes per device** (`reserve`, `max_memory`, `overhead`): one size for every
//!   accelerator, a list in accelerator order (exllamav2's `reserve_vram`), or a map keyed by
//!   device name or accelerator index (accelerate's `max_memory`).
//! - **`gpu_split`** is in GB of 1024 MiB, as exllamav2 takes it, rounded to the nearest MiB.
//! - **Config-only sources** need a weight type (`weight_dtype`, or the config's
//!   `torch_dtype`); their tensor table is synthesised.

use std::collections::BTreeMap;

use weightlift_format::{ModelSpec, MoeSpec, TensorInfo};

use crate::FIT_CACHE;
use crate::device::{DeviceSpec, resolve_device};
use crate::error::{PlanError, Result};
use crate::memory::{CacheDType, CacheSpec, RuntimeSpec};
use crate::request::{
    BudgetRule, DeviceMap, FitTarget, PlanRequest, SplitMode, Strategy, TpOptions,
};
use crate::synth::{DTypeChoice, WeightType, longrope_tensors, synthesize_tensors};

/// Sizes per device, as users pass them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerDevice {
    /// One size for every accelerator.
    All(u64),
    /// Sizes in accelerator order; fewer values than accelerators leave the rest unset.
    List(Vec<u64>),
    /// Sizes by device name (`"cuda:1"`, `"cpu"`) or accelerator index (`"0"`).
    Map(Vec<(String, u64)>),
}

impl PerDevice {
    /// The sizes by normalised device name. `what` names the option in errors.
    pub fn resolve(&self, devices: &[DeviceSpec], what: &str) -> Result<BTreeMap<String, u64>> {
        let accelerators = || devices.iter().filter(|d| d.kind.is_accelerator());
        let mut out = BTreeMap::new();
        match self {
            PerDevice::All(v) => {
                for d in accelerators() {
                    out.insert(d.name.clone(), *v);
                }
            }
            PerDevice::List(values) => {
                let n = accelerators().count();
                if values.len() > n {
                    return Err(PlanError::option(
                        what,
                        &format!("at most one value per accelerator ({n})"),
                        format!("{} values", values.len()),
                    ));
                }
                for (d, v) in accelerators().zip(values) {
                    out.insert(d.name.clone(), *v);
                }
            }
            PerDevice::Map(entries) => {
                for (key, v) in entries {
                    let i = resolve_device(devices, key, what)?;
                    out.insert(devices[i].name.clone(), *v);
                }
            }
        }
        Ok(out)
    }
}

/// A `device_map` as accelerate and transformers take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceMapArg {
    /// `"auto"`, `"balanced"`, `"balanced_low_0"`, `"sequential"`, or one device name.
    Named(String),
    /// Module or layer prefix → device name or accelerator index; `re:PATTERN` keys are
    /// llama.cpp `-ot` overrides, checked first.
    Entries(Vec<(String, String)>),
}

impl DeviceMapArg {
    /// Whether this is one of transformers' presets, which size budgets by its rules.
    fn is_preset(&self) -> bool {
        matches!(self, DeviceMapArg::Named(name) if matches!(
            name.trim().to_ascii_lowercase().as_str(),
            "auto" | "balanced" | "balanced_low_0" | "sequential"
        ))
    }

    /// The strategy this map stands for.
    fn strategy(&self) -> Strategy {
        match self {
            DeviceMapArg::Named(name) => match name.trim().to_ascii_lowercase().as_str() {
                "auto" | "balanced" => Strategy::Balanced,
                "balanced_low_0" => Strategy::BalancedLow0,
                "sequential" => Strategy::Sequential,
                device => Strategy::Map(DeviceMap {
                    entries: vec![(String::new(), device.to_owned())],
                    overrides: Vec::new(),
                }),
            },
            DeviceMapArg::Entries(entries) => {
                let mut map = DeviceMap::default();
                for (key, dev) in entries {
                    match key.strip_prefix("re:") {
                        Some(pattern) => map.overrides.push((pattern.to_owned(), dev.clone())),
                        None => map.entries.push((key.clone(), dev.clone())),
                    }
                }
                Strategy::Map(map)
            }
        }
    }
}

/// What a plan is made for: a real tensor table, or a config whose tensors are synthesised.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// A checkpoint's spec and its tensor table.
    Tensors(ModelSpec, Vec<TensorInfo>),
    /// A spec from an HF config or a ModelSpec, with the config's `torch_dtype` if it has one,
    /// its routing to experts if it has experts, and whether it scales RoPE by LongRoPE
    /// ([`weightlift_format::hf_config::has_longrope_factors`]): the synthesised table holds
    /// the experts and the factor lists ([`crate::longrope_tensors`]), and the request carries
    /// the routing.
    Config(ModelSpec, Option<String>, Option<MoeSpec>, bool),
}

/// The cache exllamav2's TPContext subtracts before splitting: `tokens` (0: the model's
/// context length) at batch 1, of `dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectCache {
    pub tokens: u64,
    pub dtype: CacheDType,
}

/// Every placement option any entry point takes, each `None` (or empty) when not given.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlanOptions {
    /// `"autosplit"`, `"sequential"`, `"balanced"`, `"balanced_low_0"`, `"layers"`,
    /// `"tensor_parallel"` or `"map"`; `None` infers it (see the module docs).
    pub strategy: Option<String>,
    /// `"auto"`, `"float16"`, `"bfloat16"`, `"float32"`.
    pub dtype: Option<String>,
    /// Weight type of a config-only source (`"bfloat16"`, `"q4_k_m"`, ...).
    pub weight_dtype: Option<String>,
    pub cache: Option<CacheSpec>,
    /// Offload `cache` to host RAM (transformers' `OffloadedCache`); an error without a cache.
    pub cache_offload: bool,
    pub runtime: Option<RuntimeSpec>,
    pub reserve: Option<PerDevice>,
    pub max_memory: Option<PerDevice>,
    pub overhead: Option<PerDevice>,
    pub n_gpu_layers: Option<i64>,
    /// `"none"`, `"layer"`, `"row"`.
    pub split_mode: Option<String>,
    pub tensor_split: Option<Vec<f32>>,
    pub main_gpu: Option<usize>,
    pub device_map: Option<DeviceMapArg>,
    /// llama.cpp `-ot` rules (`regex`, `device`), checked before `device_map`.
    pub overrides: Vec<(String, String)>,
    /// llama.cpp `--n-cpu-moe N`: the expert tensors of the first N layers stay in host RAM
    /// (`cpu`) while the rest of each layer goes where the strategy says, and are computed
    /// there. It is `-ot` rules, one per layer, after `overrides` (as llama.cpp appends them);
    /// see [`PlanOptions::moe_overrides`].
    pub n_cpu_moe: Option<u32>,
    /// exllamav2 `gpu_split`, GB per accelerator.
    pub gpu_split: Option<Vec<f64>>,
    pub expect_cache: Option<ExpectCache>,
    pub allow_disk: Option<bool>,
    pub use_mmap: Option<bool>,
    /// accelerate/diffusers offloaded execution ([`crate::onload`]).
    pub offload: Option<crate::onload::WeightOffload>,
    /// `"int8"`, `"q8_0"`, `"q4_k"` or `"q6_k"`: quantise the float linears on load
    /// ([`crate::quantize`]).
    pub quantize: Option<String>,
    /// The ranks of a multi-process tensor-parallel run, `"host:gpus[,host:gpus...]"` in
    /// torchrun's order ([`crate::tp::TpWorld::parse`]); implies `tensor_parallel`.
    pub world: Option<String>,
    /// The rank of `world` this process runs: the request's one accelerator (this process's
    /// GPU) then stands for every rank, as `virtual:0 .. virtual:{world_size - 1}` of its
    /// capacity (the nodes of a torchrun job are alike), so every rank makes the same plan.
    pub rank: Option<usize>,
}

impl PlanOptions {
    /// The `-ot` rules that `n_cpu_moe` stands for: layer `l < N`'s expert projections (GGUF's
    /// `blk.l.ffn_{up,down,gate}_exps`, llama.cpp's `llm_ffn_exps_block_regex`, and
    /// transformers' `model.layers.l.mlp.experts.*` / `block_sparse_moe.experts.*`) on `cpu`.
    pub fn moe_overrides(n_cpu_moe: u32) -> Vec<(String, String)> {
        (0..n_cpu_moe)
            .flat_map(|l| {
                [
                    format!(r"^blk\.{l}\.ffn_(up|down|gate|gate_up)_exps\."),
                    format!(r"^model\.layers\.{l}\.(mlp|block_sparse_moe)\.experts\."),
                ]
            })
            .map(|re| (re, "cpu".to_owned()))
            .collect()
    }

    /// `overrides` then the rules of `n_cpu_moe`: every `-ot` rule the options give.
    fn all_overrides(&self) -> Vec<(String, String)> {
        let mut out = self.overrides.clone();
        out.extend(Self::moe_overrides(self.n_cpu_moe.unwrap_or(0)));
        out
    }

    /// exllamav2's TPContext sizing, as `load_tp` and `TPContext` take it: `gpu_split` in GB per
    /// accelerator (`None`: each device's free memory), less the cache expected beside the
    /// weights, `expect_cache_tokens` (0: the model's context length) of `expect_cache_base`
    /// (fp16 when not given).
    pub fn tensor_parallel(
        gpu_split: Option<Vec<f64>>,
        expect_cache_tokens: u64,
        expect_cache_base: Option<CacheDType>,
    ) -> PlanOptions {
        PlanOptions {
            strategy: Some("tensor_parallel".into()),
            gpu_split,
            expect_cache: Some(ExpectCache {
                tokens: expect_cache_tokens,
                dtype: expect_cache_base.unwrap_or(CacheDType::Fp16),
            }),
            ..PlanOptions::default()
        }
    }

    /// exllamav2's `load_autosplit`: fill the accelerators in order, keeping `reserve` free.
    pub fn autosplit(reserve: Option<PerDevice>) -> PlanOptions {
        PlanOptions {
            strategy: Some("autosplit".into()),
            reserve,
            ..PlanOptions::default()
        }
    }

    /// transformers' `from_pretrained(device_map=..., max_memory=...)`, whose map is `"auto"`
    /// when not given.
    pub fn from_pretrained(
        device_map: Option<DeviceMapArg>,
        max_memory: Option<PerDevice>,
    ) -> PlanOptions {
        PlanOptions {
            device_map: Some(device_map.unwrap_or_else(|| DeviceMapArg::Named("auto".into()))),
            max_memory,
            ..PlanOptions::default()
        }
    }

    /// llama.cpp's placement (`-ngl`, `-sm`, `-ts`, `-mg`), as `load_gguf` takes it. With no
    /// accelerator there is nothing to offload to, so everything goes to the cpu whatever the
    /// numbers say, as llama.cpp runs a CPU-only build.
    pub fn llama(
        n_gpu_layers: i64,
        split_mode: &str,
        tensor_split: Option<Vec<f32>>,
        main_gpu: usize,
        has_accelerator: bool,
    ) -> PlanOptions {
        if !has_accelerator {
            return PlanOptions {
                device_map: Some(DeviceMapArg::Named("cpu".into())),
                ..PlanOptions::default()
            };
        }
        PlanOptions {
            n_gpu_layers: Some(n_gpu_layers),
            split_mode: Some(split_mode.to_owned()),
            tensor_split,
            main_gpu: Some(main_gpu),
            ..PlanOptions::default()
        }
    }

    /// A fresh request for `source` on `devices`.
    pub fn into_request(
        self,
        source: ModelSource,
        devices: Vec<DeviceSpec>,
    ) -> Result<PlanRequest> {
        let (spec, tensors, moe) = match source {
            ModelSource::Tensors(spec, tensors) => {
                if self.weight_dtype.is_some() {
                    return Err(PlanError::option(
                        "weight_dtype",
                        "no weight_dtype with a checkpoint, whose stored types are used (dtype= \
                         converts float weights)",
                        format!("weight_dtype='{}'", self.weight_dtype.unwrap_or_default()),
                    ));
                }
                (spec, tensors, None)
            }
            ModelSource::Config(spec, torch_dtype, moe, longrope) => {
                let Some(name) = self.weight_dtype.clone().or(torch_dtype) else {
                    return Err(PlanError::option(
                        "weight_dtype",
                        "a weight type when planning from a config without torch_dtype, e.g. \
                         \"bfloat16\", \"float16\", \"q8_0\" or \"q4_k_m\"",
                        "none",
                    ));
                };
                let weights = synthesize_tensors(&spec, WeightType::parse(&name)?, moe.as_ref())?;
                // the converter writes the factor lists first
                let mut tensors = if longrope {
                    longrope_tensors(&spec)?
                } else {
                    Vec::new()
                };
                tensors.extend(weights);
                (spec, tensors, moe)
            }
        };
        let mut req = PlanRequest::new(spec, tensors, devices);
        req.moe = moe;
        self.apply(&mut req)?;
        Ok(req)
    }

    /// Applies the options given to `req`; what was not given keeps the request's value.
    pub fn apply(self, req: &mut PlanRequest) -> Result<()> {
        if let Some(strategy) = self.strategy()? {
            req.strategy = strategy;
        }
        if let Some(d) = &self.dtype {
            req.dtype = DTypeChoice::parse(d)?;
        }
        if let Some(r) = self.rank {
            self.stand_in_for_ranks(r, req)?;
        }
        match (self.cache, self.cache_offload) {
            (Some(c), offload) => req.cache = Some(c.with_offload(c.offload || offload)),
            (None, true) => {
                return Err(PlanError::OptionConflict {
                    option: "cache_offload=True".into(),
                    detail: "there is no cache to offload; pass cache=CacheSpec(...) too".into(),
                });
            }
            (None, false) => {}
        }
        if let Some(e) = self.expect_cache {
            let tokens = if e.tokens == 0 {
                req.spec.context_length.max(1)
            } else {
                e.tokens
            };
            req.cache = Some(CacheSpec::new(tokens, 1, e.dtype));
        }
        if let Some(r) = self.runtime {
            req.runtime = r;
        }
        for (sizes, what, field) in [
            (&self.reserve, "reserve", &mut req.reserve),
            (&self.max_memory, "max_memory", &mut req.max_memory),
            (&self.overhead, "overhead", &mut req.overhead),
        ] {
            if let Some(s) = sizes {
                *field = s.resolve(&req.devices, what)?;
            }
        }
        if let Some(b) = self.allow_disk {
            req.allow_disk = b;
        }
        if let Some(b) = self.use_mmap {
            req.use_mmap = b;
        }
        // A device_map preset is transformers' from_pretrained, which sizes the balanced
        // budgets its own way; a strategy named alone is accelerate's.
        if self
            .device_map
            .as_ref()
            .is_some_and(DeviceMapArg::is_preset)
        {
            req.budget_rule = BudgetRule::Transformers;
        }
        if self.offload.is_some() {
            req.offload = self.offload;
        }
        if let Some(q) = &self.quantize {
            req.quantize = Some(crate::quantize::Quantize::parse(q)?);
        }
        if let Some(w) = &self.world {
            req.world = Some(crate::tp::TpWorld::parse(w)?);
        }
        Ok(())
    }

    /// The request of one rank's process (see [`PlanOptions::rank`]): its one accelerator
    /// becomes a stand-in for each rank of the world.
    fn stand_in_for_ranks(&self, rank: usize, req: &mut PlanRequest) -> Result<()> {
        let Some(world) = &self.world else {
            return Err(PlanError::option(
                "rank",
                "a world too (\"host:gpus[,host:gpus...]\"): the rank of which run",
                format!("rank={rank} alone"),
            ));
        };
        let n = crate::tp::TpWorld::parse(world)?.world_size();
        if rank >= n {
            return Err(PlanError::option(
                "rank",
                &format!("below the world's {n} ranks ('{world}')"),
                rank,
            ));
        }
        let accel: Vec<&DeviceSpec> = req
            .devices
            .iter()
            .filter(|d| d.kind.is_accelerator())
            .collect();
        let [own] = accel.as_slice() else {
            return Err(PlanError::option(
                "devices of a rank's process",
                "one accelerator, this rank's GPU (cuda:$LOCAL_RANK)",
                format!("{} accelerators", accel.len()),
            ));
        };
        let ranks = (0..n).map(|i| DeviceSpec {
            name: format!("virtual:{i}"),
            ..(*own).clone()
        });
        let hosts: Vec<DeviceSpec> = (req.devices.iter())
            .filter(|d| !d.kind.is_accelerator())
            .cloned()
            .collect();
        req.devices = ranks.chain(hosts).collect();
        Ok(())
    }

    /// `fit()`'s options: the `n_gpu_layers` target is a llama.cpp question, so it names the
    /// layers strategy when nothing else names one. `cache_dtype` gives the dtype of the cache
    /// searched with (fp16 without it); it must agree with `cache` when both are given. An
    /// offloaded fit with no cache offloads the one [`crate::fit`] searches with.
    pub fn for_fit(mut self, target: FitTarget, cache_dtype: Option<&str>) -> Result<Self> {
        let named = self.strategy.is_some()
            || self.device_map.is_some()
            || !self.all_overrides().is_empty()
            || self.gpu_split.is_some()
            || self.expect_cache.is_some()
            || self.world.is_some();
        if target == FitTarget::NCpuMoe && self.n_cpu_moe.is_some() {
            return Err(PlanError::OptionConflict {
                option: "n_cpu_moe".into(),
                detail: "fit target n_cpu_moe searches for it; give one of them".into(),
            });
        }
        if matches!(target, FitTarget::NGpuLayers | FitTarget::NCpuMoe) && !named {
            self.strategy = Some("layers".into());
        }
        if let Some(d) = cache_dtype {
            let dtype = CacheDType::parse(d)?;
            match self.cache {
                None => self.cache = Some(CacheSpec { dtype, ..FIT_CACHE }),
                Some(c) if c.dtype != dtype => {
                    return Err(PlanError::OptionConflict {
                        option: "cache_dtype".into(),
                        detail: format!(
                            "'{}' contradicts cache.dtype '{}'; give one of them",
                            dtype.name(),
                            c.dtype.name()
                        ),
                    });
                }
                Some(_) => {}
            }
        }
        if self.cache_offload && self.cache.is_none() {
            self.cache = Some(FIT_CACHE);
        }
        Ok(self)
    }

    /// The strategy named or implied, with its options; `None` when nothing names one.
    fn strategy(&self) -> Result<Option<Strategy>> {
        let llama = self.n_gpu_layers.is_some()
            || self.split_mode.is_some()
            || self.tensor_split.is_some()
            || self.main_gpu.is_some();
        let tp = self.gpu_split.is_some()
            || self.expect_cache.is_some()
            || self.world.is_some()
            || self.rank.is_some();
        let implied = self.device_map.as_ref().map(DeviceMapArg::strategy);
        let mut strategy = match (&self.strategy, implied) {
            (Some(name), implied) => {
                let named = Strategy::parse(name)?;
                match implied {
                    // A preset must agree with the strategy named; entries fill a map.
                    Some(Strategy::Map(m)) if matches!(named, Strategy::Map(_)) => Strategy::Map(m),
                    Some(s) if s.name() != named.name() => {
                        return Err(PlanError::option(
                            "device_map",
                            &format!("a map that agrees with strategy='{}'", named.name()),
                            format!("a device_map meaning strategy='{}'", s.name()),
                        ));
                    }
                    _ => named,
                }
            }
            (None, Some(s)) => s,
            // llama.cpp applies -ot over -ngl's placement, whose default offloads every layer.
            (None, None) if llama || !self.all_overrides().is_empty() => Strategy::parse("layers")?,
            (None, None) if tp => Strategy::parse("tensor_parallel")?,
            (None, None) => return Ok(None),
        };
        let name = strategy.name();
        let misplaced = |what: &str, wants: &str| {
            PlanError::option(
                what,
                &format!("strategy='{wants}' (or no strategy)"),
                format!("strategy='{name}'"),
            )
        };
        match &mut strategy {
            Strategy::Layers(o) => {
                if let Some(n) = self.n_gpu_layers {
                    o.n_gpu_layers = n;
                }
                if let Some(m) = &self.split_mode {
                    o.split_mode = SplitMode::parse(m)?;
                }
                if let Some(t) = &self.tensor_split {
                    o.tensor_split = t.clone();
                }
                if let Some(g) = self.main_gpu {
                    o.main_gpu = g;
                }
            }
            _ if llama => {
                return Err(misplaced(
                    "n_gpu_layers/split_mode/tensor_split/main_gpu",
                    "layers",
                ));
            }
            _ => {}
        }
        let overrides = self.all_overrides();
        if !overrides.is_empty() {
            match &mut strategy {
                Strategy::Map(m) => {
                    // explicit rules first, then the device_map's `re:` keys
                    let from_map = std::mem::take(&mut m.overrides);
                    m.overrides = overrides.into_iter().chain(from_map).collect();
                }
                Strategy::Layers(o) => o.overrides = overrides,
                // Tensor parallelism places every expert by the expert table, each computed on
                // the device that holds it; host-held experts belong to a layer split.
                Strategy::TensorParallel(_) => {
                    return Err(PlanError::option(
                        "overrides/n_cpu_moe",
                        "no -ot rules with strategy='tensor_parallel', which splits a \
                         mixture-of-experts model's experts whole over the accelerators (the \
                         expert table); to keep experts in host RAM use strategy='layers' \
                         (llama.cpp's n_cpu_moe) or 'map', or drop n_cpu_moe and overrides",
                        "strategy='tensor_parallel'",
                    ));
                }
                _ => return Err(misplaced("overrides/n_cpu_moe", "map or layers")),
            }
        }
        match &mut strategy {
            Strategy::TensorParallel(TpOptions { gpu_split_mib }) => {
                if let Some(g) = &self.gpu_split {
                    *gpu_split_mib = Some(gb_to_mib(g)?);
                }
            }
            _ if tp => {
                return Err(misplaced(
                    "gpu_split/expect_cache/world/rank",
                    "tensor_parallel",
                ));
            }
            _ => {}
        }
        Ok(Some(strategy))
    }
}

/// exllamav2's `gpu_split` (GB of 1024 MiB) in MiB, rounded to the nearest MiB.
fn gb_to_mib(gb: &[f64]) -> Result<Vec<u64>> {
    if gb.iter().any(|g| !g.is_finite() || *g < 0.0 || *g > 1e9) {
        return Err(PlanError::option(
            "gpu_split",
            "GB per accelerator, each finite and ≥ 0",
            format!("{gb:?}"),
        ));
    }
    Ok(gb.iter().map(|g| (g * 1024.0).round() as u64).collect())
}

#[cfg(test)]
mod tests;

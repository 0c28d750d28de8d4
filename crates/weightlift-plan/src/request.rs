//! What a plan is asked for: the model, the devices, the strategy and its options.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use weightlift_format::{ModelSpec, MoeSpec, TensorInfo};

use crate::device::DeviceSpec;
use crate::error::{PlanError, Result};
use crate::memory::{CacheSpec, RuntimeSpec};
use crate::quantize::Quantize;
use crate::synth::DTypeChoice;
use crate::window::SlidingWindow;

/// llama.cpp's `split_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SplitMode {
    /// Every offloaded layer on `main_gpu`.
    None,
    /// Whole layers spread over the GPUs in proportion to `tensor_split`.
    #[default]
    Layer,
    /// Each offloaded matrix's rows spread over the GPUs by `tensor_split`; the rest of each
    /// layer (norms, biases, KV) on `main_gpu`.
    Row,
}

impl SplitMode {
    pub fn parse(s: &str) -> Result<SplitMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(SplitMode::None),
            "layer" => Ok(SplitMode::Layer),
            "row" => Ok(SplitMode::Row),
            _ => Err(PlanError::option(
                "split_mode",
                "none, layer or row",
                format!("'{s}'"),
            )),
        }
    }
    pub const fn name(self) -> &'static str {
        match self {
            SplitMode::None => "none",
            SplitMode::Layer => "layer",
            SplitMode::Row => "row",
        }
    }
}

/// llama.cpp's offload options (`-ngl`, `-sm`, `-ts`, `-mg`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerOptions {
    /// Number of layers to offload, counting the output layer as layer `n_layer`; negative
    /// means all (llama.cpp's `-1`).
    pub n_gpu_layers: i64,
    pub split_mode: SplitMode,
    /// One weight per accelerator; empty means "in proportion to each device's free memory"
    /// (llama.cpp's default).
    pub tensor_split: Vec<f32>,
    /// Index among the accelerators.
    pub main_gpu: usize,
    /// Row-split boundaries are rounded down to a multiple of this many rows. ggml-cuda uses
    /// an architecture-dependent MMQ tile height; 64 is our default.
    pub row_rounding: u64,
    /// llama.cpp `-ot` rules (`regex`, `device`), applied over the layer assignment: a tensor
    /// whose name matches goes to that device, the first match winning; its layer still
    /// computes where the layer is.
    #[serde(default)]
    pub overrides: Vec<(String, String)>,
}

impl Default for LayerOptions {
    fn default() -> Self {
        LayerOptions {
            n_gpu_layers: -1,
            split_mode: SplitMode::Layer,
            tensor_split: Vec::new(),
            main_gpu: 0,
            row_rounding: 64,
            overrides: Vec::new(),
        }
    }
}

/// exllamav2 TPContext options.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TpOptions {
    /// Per-accelerator budgets in MiB (exllamav2's `gpu_split` in GB × 1024). `None`: each
    /// device's capacity less reserve and overhead, like exllamav2's free-memory default.
    pub gpu_split_mib: Option<Vec<u64>>,
}

/// An explicit device map.
///
/// `entries` map a module or layer prefix to a device; a tensor matches an entry when the
/// tensor's name equals the prefix or starts with it followed by `.`. Layer entries also match
/// across naming schemes: `blk.3`, `layers.3` and `model.layers.3` all mean layer 3, and
/// `blk.0-11` (any of the three spellings) is an inclusive range. `model.embed_tokens` /
/// `token_embd`, `model.norm` / `output_norm` and `lm_head` / `output` match by role. The
/// prefix `""` (or `"*"`) is a default for everything no other entry matches. Two non-default
/// entries matching one tensor with different devices are a conflict.
///
/// `overrides` are llama.cpp `-ot` rules (`regex=device`): regexes searched in tensor names,
/// checked in order before the entries; the first match wins.
///
/// Devices are normalised names (`"cuda:0"`, `"cpu"`, `"disk"`) or an accelerator index
/// (`"0"`), as in accelerate.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DeviceMap {
    pub entries: Vec<(String, String)>,
    pub overrides: Vec<(String, String)>,
}

impl DeviceMap {
    /// Parse llama.cpp `-ot` syntax: `"blk\\.\\d+\\.ffn_.*=cpu"`; several rules separated by
    /// commas.
    pub fn parse_overrides(text: &str) -> Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        for rule in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (pat, dev) = rule.rsplit_once('=').ok_or_else(|| {
                PlanError::option(
                    "override",
                    "REGEX=DEVICE, e.g. blk\\.\\d+\\.ffn_.*=cpu",
                    format!("'{rule}'"),
                )
            })?;
            out.push((pat.to_string(), dev.trim().to_string()));
        }
        Ok(out)
    }
}

/// Placement strategies, each named after the system it reproduces.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Strategy {
    /// exllamav2 `load_autosplit`.
    Autosplit,
    /// accelerate `device_map="sequential"`.
    Sequential,
    /// accelerate `device_map="balanced"`.
    Balanced,
    /// accelerate `device_map="balanced_low_0"`.
    BalancedLow0,
    /// llama.cpp `n_gpu_layers` / `split_mode` / `tensor_split` / `main_gpu`.
    Layers(LayerOptions),
    /// exllamav2 TPContext.
    TensorParallel(TpOptions),
    /// An explicit device map with regex overrides.
    Map(DeviceMap),
}

impl Strategy {
    /// Parse a strategy name with default options: `autosplit`, `sequential`, `balanced`,
    /// `balanced_low_0`, `layers` (alias `n_gpu_layers`), `tensor_parallel` (alias `tp`), `map`
    /// (alias `device_map`).
    pub fn parse(s: &str) -> Result<Strategy> {
        match s.trim().to_ascii_lowercase().as_str() {
            "autosplit" | "auto" => Ok(Strategy::Autosplit),
            "sequential" => Ok(Strategy::Sequential),
            "balanced" => Ok(Strategy::Balanced),
            "balanced_low_0" => Ok(Strategy::BalancedLow0),
            "layers" | "n_gpu_layers" | "llama.cpp" => {
                Ok(Strategy::Layers(LayerOptions::default()))
            }
            "tensor_parallel" | "tp" => Ok(Strategy::TensorParallel(TpOptions::default())),
            "map" | "device_map" => Ok(Strategy::Map(DeviceMap::default())),
            _ => Err(PlanError::option(
                "strategy",
                "autosplit, sequential, balanced, balanced_low_0, layers, tensor_parallel or map",
                format!("'{s}'"),
            )),
        }
    }

    /// The strategy's name as `parse` accepts it.
    pub fn name(&self) -> &'static str {
        match self {
            Strategy::Autosplit => "autosplit",
            Strategy::Sequential => "sequential",
            Strategy::Balanced => "balanced",
            Strategy::BalancedLow0 => "balanced_low_0",
            Strategy::Layers(_) => "layers",
            Strategy::TensorParallel(_) => "tensor_parallel",
            Strategy::Map(_) => "map",
        }
    }
}

/// How the accelerate-family strategies (`sequential`, `balanced`, `balanced_low_0`) size each
/// device's budget. The two libraries agree on the fill and differ in the balanced share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetRule {
    /// accelerate's `get_balanced_memory`: every GPU but the last is capped at its share of the
    /// model plus 1.25 × the larger of the FIRST decoder block and the MEAN leaf module.
    /// `plan(strategy="balanced")` and friends follow it.
    #[default]
    Accelerate,
    /// transformers 5's `from_pretrained(device_map=...)`: the share plus 1.25 × the larger of
    /// the LARGEST decoder block and the LARGEST leaf module (usually the embedding), so
    /// `balanced` fills GPU 0 further; and with no `max_memory` at all, 90% of the cpu.
    /// A `device_map` preset (`"auto"`, `"balanced"`, `"balanced_low_0"`, `"sequential"`)
    /// follows it.
    Transformers,
}

/// Everything `plan()` needs. Build it with [`PlanRequest::new`] and set the fields you need.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRequest {
    pub spec: ModelSpec,
    /// The tensor table: a checkpoint's real one, or [`crate::synthesize_tensors`]'s.
    pub tensors: Vec<TensorInfo>,
    pub devices: Vec<DeviceSpec>,
    pub strategy: Strategy,
    pub dtype: DTypeChoice,
    /// `None` plans no KV cache.
    pub cache: Option<CacheSpec>,
    pub runtime: RuntimeSpec,
    /// Per-device reserve by normalised name; replaces `DeviceSpec::reserve`.
    pub reserve: BTreeMap<String, u64>,
    /// accelerate-style caps by normalised name: a device never gets more than this.
    pub max_memory: BTreeMap<String, u64>,
    /// Per-device fixed overhead by normalised name; replaces `DeviceSpec::overhead`.
    pub overhead: BTreeMap<String, u64>,
    /// Allow weights to stay on disk (streamed) when nothing else has room.
    pub allow_disk: bool,
    /// CPU tensors whose dtype is unchanged stay views of the mmap (page cache, not anonymous
    /// memory). With `false` they are read into owned memory.
    pub use_mmap: bool,
    /// Size of one host staging buffer for device uploads (the loader double-buffers). The
    /// default, 4 MiB, is the loader's (`weightlift_engine::LoadOptions`).
    pub staging_bytes: u64,
    /// Execute the layers kept on `cpu`/`disk` on the main accelerator ([`crate::onload`]);
    /// `None` computes every layer where its weights are.
    pub offload: Option<crate::onload::WeightOffload>,
    /// Which library's budgets the accelerate-family strategies follow.
    #[serde(default)]
    pub budget_rule: BudgetRule,
    /// The model's sliding-window layers ([`SlidingWindow::from_gguf`],
    /// [`SlidingWindow::from_hf_config`]). Their caches are cut to the window for
    /// architectures the engine does not run; the engine keeps every position in the caches
    /// of those it runs, and their plans keep every cache full.
    #[serde(default)]
    pub sliding_window: Option<SlidingWindow>,
    /// How the model's layers route to experts ([`MoeSpec::from_gguf`],
    /// [`MoeSpec::from_hf_config`]); `None` for a dense model. The workspace's MLP regions are
    /// sized for the widest MLP the model runs ([`crate::Dims::with_experts`]).
    #[serde(default)]
    pub moe: Option<MoeSpec>,
    /// Quantise the float linears on load ([`crate::quantize`]); `None` keeps the stored
    /// types (and `dtype`'s conversion).
    #[serde(default)]
    pub quantize: Option<Quantize>,
    /// For `tensor_parallel` across processes: where each rank runs, one rank per accelerator
    /// of `devices` (which give each rank's capacity). `None`: one process drives every device.
    #[serde(default)]
    pub world: Option<crate::tp::TpWorld>,
}

impl PlanRequest {
    /// A request with exllamav2's default strategy and runtime, no cache, no caps.
    pub fn new(spec: ModelSpec, tensors: Vec<TensorInfo>, devices: Vec<DeviceSpec>) -> Self {
        PlanRequest {
            spec,
            tensors,
            devices,
            strategy: Strategy::Autosplit,
            dtype: DTypeChoice::Auto,
            cache: None,
            runtime: RuntimeSpec::default(),
            reserve: BTreeMap::new(),
            max_memory: BTreeMap::new(),
            overhead: BTreeMap::new(),
            allow_disk: false,
            offload: None,
            use_mmap: true,
            staging_bytes: 4 << 20,
            budget_rule: BudgetRule::Accelerate,
            sliding_window: None,
            moe: None,
            quantize: None,
            world: None,
        }
    }
}

/// What `fit()` maximises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FitTarget {
    /// Largest cache length, in multiples of 256 tokens (exllamav2's cache page), capped at
    /// the model's `context_length` (which is returned as is when it fits).
    MaxSeqLen,
    /// Largest batch size at the request's cache length.
    BatchSize,
    /// Largest llama.cpp `n_gpu_layers` (0..=n_layer+1); needs the `layers` strategy.
    NGpuLayers,
    /// Smallest llama.cpp `n_cpu_moe` (0..=n_layer): the fewest layers whose experts stay in
    /// host RAM, so the most expert weights on the accelerators; needs the `layers` strategy
    /// and a mixture-of-experts model.
    NCpuMoe,
}

impl FitTarget {
    pub fn parse(s: &str) -> Result<FitTarget> {
        match s.trim().to_ascii_lowercase().as_str() {
            "max_seq_len" | "ctx" | "context" => Ok(FitTarget::MaxSeqLen),
            "batch_size" | "batch" => Ok(FitTarget::BatchSize),
            "n_gpu_layers" | "ngl" => Ok(FitTarget::NGpuLayers),
            "n_cpu_moe" | "ncmoe" => Ok(FitTarget::NCpuMoe),
            _ => Err(PlanError::option(
                "fit target",
                "max_seq_len, batch_size, n_gpu_layers or n_cpu_moe",
                format!("'{s}'"),
            )),
        }
    }
}

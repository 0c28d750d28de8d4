//! The Plan: an immutable, deterministic, serialisable record of where everything goes.

use serde::{Deserialize, Serialize};
use weightlift_format::DType;

use crate::device::DeviceKind;
use crate::error::{PlanError, Result};
use crate::memory::{CacheSpec, RuntimeSpec};
use crate::overhead::OverheadPart;
use crate::size::{fmt_bytes, gib, mib};
use crate::tp::{TpKind, TpSplit};

/// A contiguous part of a split tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub device: String,
    /// Range along the split axis (rows or columns).
    pub start: u64,
    pub end: u64,
    pub bytes: u64,
}

/// How a tensor is spread over several devices (llama.cpp row split, tensor parallelism).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSplit {
    /// 0: rows (output features), 1: columns (input features).
    pub axis: u8,
    /// True when every shard is a full copy (norms under tensor parallelism).
    pub replicated: bool,
    pub shards: Vec<Shard>,
}

/// Where one tensor goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorPlacement {
    pub name: String,
    /// The device holding it, or its main device when it is split.
    pub device: String,
    /// The dtype after any conversion.
    pub dtype: DType,
    /// Bytes after any conversion.
    pub bytes: u64,
    pub layer: Option<u32>,
    pub split: Option<TensorSplit>,
}

/// One device's share of the plan, in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceUsage {
    pub name: String,
    pub kind: DeviceKind,
    /// Capacity after any `max_memory` cap (`u64::MAX` when unbounded).
    pub capacity: u64,
    pub weights: u64,
    /// KV cache of the layers computed here (on the cpu, also that of layers left on disk).
    /// With an offloaded cache ([`CacheSpec::offload`]): on the cpu, the whole cache; on every
    /// device that computes layers (the cpu included), its prefetch slots,
    /// `min(layers computed here, OFFLOAD_SLOTS) × its largest layer's cache`.
    pub kv: u64,
    /// Compute scratch; on the cpu, plus the host staging buffers for uploads
    /// ([`HostUsage::staging`]) whenever the inventory has an accelerator.
    pub scratch: u64,
    /// The part of `scratch` the kernels allocate for themselves rather than the engine's
    /// workspace buffer: on `cuda:N`, its prompt products' tiles
    /// ([`crate::workspace::cuda_product_tiles`]) or, when larger, the scratch a quantising
    /// load takes there (one staging size of float rows, quantised on the device; loads and
    /// prompts never overlap); 0 elsewhere. The engine allocates `scratch - kernel_scratch`.
    #[serde(default)]
    pub kernel_scratch: u64,
    /// The device's fixed overhead, charged when it allocates anything: the sum of
    /// `overhead_parts`.
    pub overhead: u64,
    /// What the overhead is, part by part (for `cuda:N`: its context and modules, cuBLAS
    /// workspace and graph memory, each with where the figure comes from); empty when none is
    /// charged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overhead_parts: Vec<OverheadPart>,
    pub reserve: u64,
    /// `capacity - weights - kv - scratch - overhead - reserve`.
    pub free: u64,
    /// Inclusive layer ranges whose blocks (or main part) live here.
    pub layers: Vec<(u32, u32)>,
    /// Non-layer parts held here: `"token_embd"`, `"output_norm"`, `"output"`,
    /// `"output (tied copy)"`, and on the cpu `"kv and compute of disk layers A-B"` (layers
    /// left on disk are streamed and computed by the host, which holds their KV and scratch).
    pub holds: Vec<String>,
    /// True when the device was not in the user's list (the host, added because the input
    /// layer must live there).
    pub implicit: bool,
}

impl DeviceUsage {
    /// Bytes the device has, or `None` when it is unbounded (`disk`, a `cpu` of unknown size).
    pub fn bounded_capacity(&self) -> Option<u64> {
        crate::device::bounded(self.capacity)
    }

    /// Bytes left free, or `None` on an unbounded device.
    pub fn bounded_free(&self) -> Option<u64> {
        self.bounded_capacity().map(|_| self.free)
    }

    /// Layers placed here.
    pub fn n_layers(&self) -> u32 {
        self.layers.iter().map(|(a, b)| b - a + 1).sum()
    }

    /// weights + kv + scratch + overhead + reserve.
    pub fn used(&self) -> u64 {
        self.weights
            .saturating_add(self.kv)
            .saturating_add(self.scratch)
            .saturating_add(self.overhead)
            .saturating_add(self.reserve)
    }

    /// The row as the Python bindings show it: `capacity` and `free` are `None` on an unbounded
    /// device, `used` is [`DeviceUsage::used`], and the overhead parts are `(name, bytes,
    /// source)` rows.
    pub fn view(&self) -> impl Serialize + '_ {
        #[derive(Serialize)]
        struct View<'a> {
            name: &'a str,
            kind: DeviceKind,
            capacity: Option<u64>,
            weights: u64,
            kv: u64,
            scratch: u64,
            kernel_scratch: u64,
            overhead: u64,
            overhead_parts: Vec<(&'a str, u64, &'a str)>,
            reserve: u64,
            free: Option<u64>,
            used: u64,
            layers: &'a [(u32, u32)],
            holds: &'a [String],
            implicit: bool,
        }
        View {
            name: &self.name,
            kind: self.kind,
            capacity: self.bounded_capacity(),
            weights: self.weights,
            kv: self.kv,
            scratch: self.scratch,
            kernel_scratch: self.kernel_scratch,
            overhead: self.overhead,
            overhead_parts: crate::overhead::rows(&self.overhead_parts),
            reserve: self.reserve,
            free: self.bounded_free(),
            used: self.used(),
            layers: &self.layers,
            holds: &self.holds,
            implicit: self.implicit,
        }
    }
}

impl TensorPlacement {
    /// The row as the Python bindings show it: `bytes` named `nbytes`, and a split as its
    /// `(device, start, end, bytes)` shards.
    pub fn view(&self) -> impl Serialize + '_ {
        #[derive(Serialize)]
        struct View<'a> {
            name: &'a str,
            device: &'a str,
            dtype: DType,
            nbytes: u64,
            layer: Option<u32>,
            shards: Option<Vec<(&'a str, u64, u64, u64)>>,
        }
        View {
            name: &self.name,
            device: &self.device,
            dtype: self.dtype,
            nbytes: self.bytes,
            layer: self.layer,
            shards: self.split.as_ref().map(|s| {
                s.shards
                    .iter()
                    .map(|sh| (sh.device.as_str(), sh.start, sh.end, sh.bytes))
                    .collect()
            }),
        }
    }
}

/// Host RAM during loading. mmap-backed CPU tensors cost page cache, which the kernel can
/// drop and re-read, not anonymous memory; they are reported apart.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HostUsage {
    /// Staging buffers for device uploads: 2 × min(staging size, largest tensor), charged
    /// whenever the inventory has an accelerator.
    pub staging: u64,
    /// CPU tensors read into owned memory (converted dtype, or `use_mmap=False`).
    pub owned_weights: u64,
    /// CPU tensors that stay views of the mmap.
    pub mapped_weights: u64,
    /// Tensors left on disk, streamed through the page cache when used.
    pub disk_weights: u64,
    /// KV cache of CPU layers and of layers left on disk (the host computes those); with an
    /// offloaded cache, the whole cache (plus the prefetch slots of layers the host computes).
    pub kv: u64,
    /// CPU compute scratch (including that of layers left on disk), without the staging.
    pub scratch: u64,
    /// Peak anonymous memory while loading: staging + owned + kv + scratch.
    pub peak_anon: u64,
    /// Peak including page cache of mapped CPU tensors.
    pub peak_total: u64,
}

/// The result of planning. Immutable: read it through the accessors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub(crate) strategy: String,
    pub(crate) architecture: String,
    pub(crate) n_layers: u32,
    pub(crate) dtype: String,
    pub(crate) cache: Option<CacheSpec>,
    pub(crate) runtime: RuntimeSpec,
    pub(crate) tensors: Vec<TensorPlacement>,
    pub(crate) layers: Vec<String>,
    pub(crate) embed_device: String,
    pub(crate) head_device: String,
    /// `(device, bytes)` of the tied output copy: one entry, or one per TP shard.
    pub(crate) tied_output: Vec<(String, u64)>,
    pub(crate) tp: Option<TpSplit>,
    pub(crate) devices: Vec<DeviceUsage>,
    pub(crate) host: HostUsage,
    pub(crate) warnings: Vec<String>,
    /// Offloaded execution: the layers that visit the main accelerator and its slots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) onload: Option<crate::onload::OnloadPlan>,
    /// The quantise-on-load mode the sizes assume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) quantize: Option<crate::quantize::Quantize>,
}

impl Plan {
    pub fn strategy(&self) -> &str {
        &self.strategy
    }
    /// The quantise-on-load mode the sizes assume, if any.
    pub fn quantize(&self) -> Option<crate::quantize::Quantize> {
        self.quantize
    }
    pub fn architecture(&self) -> &str {
        &self.architecture
    }
    pub fn n_layers(&self) -> u32 {
        self.n_layers
    }
    /// Offloaded execution, when the request asked for it and layers stay on cpu or disk.
    pub fn onload(&self) -> Option<&crate::onload::OnloadPlan> {
        self.onload.as_ref()
    }
    pub fn cache(&self) -> Option<&CacheSpec> {
        self.cache.as_ref()
    }
    pub fn runtime(&self) -> &RuntimeSpec {
        &self.runtime
    }
    /// Every tensor, in the tensor table's order.
    pub fn tensors(&self) -> &[TensorPlacement] {
        &self.tensors
    }
    /// The device of a tensor, or `None` for an unknown name. A tensor split across devices
    /// (llama.cpp row split, tensor parallelism) gives the device of every shard, in shard
    /// order and joined by commas, as the loaded model's `device_of` does; its
    /// [`TensorPlacement::device`] stays the main device.
    pub fn device_of(&self, tensor: &str) -> Option<String> {
        let t = self.tensors.iter().find(|t| t.name == tensor)?;
        Some(match &t.split {
            Some(s) => s
                .shards
                .iter()
                .map(|x| x.device.as_str())
                .collect::<Vec<_>>()
                .join(","),
            None => t.device.clone(),
        })
    }
    /// The device of each repeating layer (where its KV lives).
    pub fn layer_devices(&self) -> &[String] {
        &self.layers
    }
    /// Where the input embedding lives.
    pub fn embed_device(&self) -> &str {
        &self.embed_device
    }
    /// Where the output head is computed.
    pub fn head_device(&self) -> &str {
        &self.head_device
    }
    /// Device holding a second copy of a tied `token_embd` to serve as the output layer
    /// (llama.cpp and exllamav2 both load one when the head is on another device).
    pub fn tied_output_copy(&self) -> Option<&str> {
        self.tied_output.first().map(|x| x.0.as_str())
    }
    /// Every `(device, bytes)` part of the tied output copy (several under tensor parallelism).
    pub fn tied_output_parts(&self) -> &[(String, u64)] {
        &self.tied_output
    }
    /// The per-device breakdown, in the inventory's order.
    pub fn devices(&self) -> &[DeviceUsage] {
        &self.devices
    }
    pub fn host(&self) -> &HostUsage {
        &self.host
    }
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
    /// The tensor-parallel tables, if the strategy is `tensor_parallel`.
    pub fn tp(&self) -> Option<&TpSplit> {
        self.tp.as_ref()
    }
    /// One TP table: `(device_index, start, end)`.
    /// The ranks of a multi-process tensor-parallel plan (rank `r` is the tables' device `r`).
    pub fn tp_ranks(&self) -> Option<&[crate::tp::TpRank]> {
        self.tp.as_ref().and_then(|t| t.ranks.as_deref())
    }
    pub fn tp_split(&self, kind: TpKind) -> Option<&[(usize, u64, u64)]> {
        self.tp.as_ref().map(|t| t.table(kind))
    }

    /// [`Plan::tp_split`], refusing a plan that is not tensor-parallel with what to ask for.
    pub fn require_tp_split(&self, kind: TpKind) -> Result<&[(usize, u64, u64)]> {
        self.tp_split(kind)
            .ok_or_else(|| PlanError::OptionConflict {
                option: "tp_split".into(),
                detail: format!(
                    "the plan has no tensor-parallel split (strategy {}); plan with \
                 strategy=\"tensor_parallel\"",
                    self.strategy()
                ),
            })
    }

    /// The plan as the Python bindings show it: what the accessors return, by their names, with
    /// the tensor and device rows as their views. Unlike [`Plan::to_json`], it is not read
    /// back.
    pub fn view(&self) -> impl Serialize + '_ {
        #[derive(Serialize)]
        struct View<'a, T, D> {
            strategy: &'a str,
            architecture: &'a str,
            n_layers: u32,
            quantize: Option<crate::quantize::Quantize>,
            cache: Option<&'a CacheSpec>,
            runtime: &'a RuntimeSpec,
            layer_devices: &'a [String],
            embed_device: &'a str,
            head_device: &'a str,
            tied_output_copy: Option<&'a str>,
            tensors: Vec<T>,
            devices: Vec<D>,
            host: &'a HostUsage,
            warnings: &'a [String],
        }
        View {
            strategy: &self.strategy,
            architecture: &self.architecture,
            n_layers: self.n_layers,
            quantize: self.quantize,
            cache: self.cache.as_ref(),
            runtime: &self.runtime,
            layer_devices: &self.layers,
            embed_device: &self.embed_device,
            head_device: &self.head_device,
            tied_output_copy: self.tied_output_copy(),
            tensors: self.tensors.iter().map(TensorPlacement::view).collect(),
            devices: self.devices.iter().map(DeviceUsage::view).collect(),
            host: &self.host,
            warnings: &self.warnings,
        }
    }

    /// Pretty-printed JSON.
    pub fn to_json(&self) -> String {
        // A Plan holds only strings, integers, floats and enums: serialisation cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    pub fn from_json(text: &str) -> Result<Plan> {
        serde_json::from_str(text).map_err(|e| PlanError::Json(e.to_string()))
    }

    /// A readable table: one row per device with layer ranges and GiB columns, then each
    /// device's overhead part by part, host RAM and warnings.
    pub fn explain(&self) -> String {
        let mut s = String::new();
        let ctx = match &self.cache {
            Some(c) => format!(
                "ctx {} × batch {}, cache {}{}",
                c.max_seq_len,
                c.batch_size,
                c.dtype.name(),
                if c.offload {
                    " offloaded to host ram"
                } else {
                    ""
                }
            ),
            None => "no kv cache".to_string(),
        };
        s.push_str(&format!(
            "plan: {} ({} layers), strategy {}, dtype {}{}, {}\n",
            self.architecture,
            self.n_layers,
            self.strategy,
            self.dtype,
            self.quantize
                .map(|q| format!(", quantize {}", q.name()))
                .unwrap_or_default(),
            ctx
        ));
        // GiB columns, or MiB when every accelerator is small (host RAM alone does not decide:
        // a 100 MB model on two small devices reads best in MiB even on a 64 GiB host).
        let accelerators = || {
            self.devices
                .iter()
                .filter(|d| !matches!(d.kind, DeviceKind::Cpu | DeviceKind::Disk))
        };
        let sized = |d: &DeviceUsage| {
            (d.capacity != u64::MAX)
                .then_some(d.capacity)
                .into_iter()
                .chain(Some(d.used()))
        };
        let largest = if accelerators().next().is_some() {
            accelerators().flat_map(sized).max()
        } else {
            self.devices.iter().flat_map(sized).max()
        };
        let big = largest.unwrap_or(0) >= 4 << 30;
        let (unit, col): (&str, fn(u64) -> String) = if big { ("GiB", gib) } else { ("MiB", mib) };
        s.push_str(&format!(
            "{:<11} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}  holds\n",
            "device", "capacity", "weights", "kv", "scratch", "overhd", "reserve", "free"
        ));
        s.push_str(&format!("{:<11} {:>9}\n", "", format!("({unit})")));
        for d in &self.devices {
            let holds = describe_holds(d);
            s.push_str(&format!(
                "{:<11} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}  {}\n",
                if d.implicit {
                    format!("{}*", d.name)
                } else {
                    d.name.clone()
                },
                col(d.capacity),
                col(d.weights),
                col(d.kv),
                col(d.scratch),
                col(d.overhead),
                col(d.reserve),
                col(d.free),
                holds
            ));
        }
        if self.devices.iter().any(|d| d.implicit) {
            s.push_str("* not in the device list: added for the input layer, host RAM unchecked\n");
        }
        for d in self.devices.iter().filter(|d| !d.overhead_parts.is_empty()) {
            s.push_str(&format!(
                "overhead of {}: {}\n",
                d.name,
                crate::overhead::describe(&d.overhead_parts)
            ));
        }
        if let Some(tp) = &self.tp {
            let fmt = |t: &[(usize, u64, u64)]| {
                t.iter()
                    .map(|(d, a, b)| format!("{d}:{a}..{b}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            s.push_str(&format!(
                "tensor parallel: kv [{}] q [{}] id [{}] rs [{}] vc [{}]\n",
                fmt(&tp.kv),
                fmt(&tp.q),
                fmt(&tp.id),
                fmt(&tp.rs),
                fmt(&tp.vc)
            ));
            if !tp.ex.is_empty() {
                s.push_str(&format!(
                    "tensor parallel experts (whole experts per device, router on each): ex [{}]\n",
                    fmt(&tp.ex)
                ));
            }
            if let Some(ranks) = &tp.ranks {
                s.push_str(&format!("ranks ({}, one process per gpu):\n", ranks.len()));
                for r in ranks {
                    s.push_str(&format!(
                        "  rank {:>3}  {} {}  (planned as {})\n",
                        r.rank, r.host, r.device, r.planned_as
                    ));
                }
            }
        }
        let h = &self.host;
        s.push_str(&format!(
            "host ram at load peak: {} anonymous (staging {}, owned weights {}, kv {}, scratch {}) + {} mmap page cache; {} streamed from disk\n",
            fmt_bytes(h.peak_anon),
            fmt_bytes(h.staging),
            fmt_bytes(h.owned_weights),
            fmt_bytes(h.kv),
            fmt_bytes(h.scratch),
            fmt_bytes(h.mapped_weights),
            fmt_bytes(h.disk_weights)
        ));
        for w in &self.warnings {
            s.push_str(&format!("warning: {w}\n"));
        }
        s
    }

    /// An SVG chart: one stacked bar per device (weights, kv, scratch, overhead, reserve,
    /// free), scaled to the device's capacity, with layer ranges labelled and a legend.
    pub fn to_svg(&self) -> String {
        crate::svg::render(self)
    }
}

/// `"layers 0-11, 20-29 + token_embd"`.
pub(crate) fn describe_holds(d: &DeviceUsage) -> String {
    let mut parts = Vec::new();
    if !d.layers.is_empty() {
        parts.push(format!("layers {}", ranges(&d.layers)));
    }
    parts.extend(d.holds.iter().cloned());
    if parts.is_empty() {
        "-".to_string()
    } else {
        parts.join(" + ")
    }
}

pub(crate) fn ranges(r: &[(u32, u32)]) -> String {
    r.iter()
        .map(|(a, b)| {
            if a == b {
                format!("{a}")
            } else {
                format!("{a}-{b}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Collapse sorted layer indices into inclusive ranges.
pub(crate) fn to_ranges(layers: impl IntoIterator<Item = u32>) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for l in layers {
        match out.last_mut() {
            Some((_, b)) if *b + 1 == l => *b = l,
            _ => out.push((l, l)),
        }
    }
    out
}

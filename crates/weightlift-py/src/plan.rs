//! Python bindings for weightlift-plan: `plan()`, `fit()`, `devices()`, `parse_devices()`,
//! `CacheSpec`, `RuntimeSpec` and `Plan`.

use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use pyo3::types::PyDict;
use weightlift_format as wf;
use weightlift_plan as wp;

use crate::errors::{Exc, enter, io_error, py_err, raise};
use crate::format::{Checkpoint, ModelSpec};
use crate::options::{CacheArg, DeviceMapValue, DevicesSpec, Overrides, RuntimeArg, Sizes};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(fit, m)?)?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(parse_devices, m)?)?;
    m.add_class::<CacheSpec>()?;
    m.add_class::<RuntimeSpec>()?;
    m.add_class::<Device>()?;
    m.add_class::<DeviceUsage>()?;
    m.add_class::<Placement>()?;
    m.add_class::<Plan>()?;
    Ok(())
}

// The real machine is read through the engine's probe (MemAvailable, and the CUDA driver in a
// build with the `cuda` feature); the planner itself does no I/O.
use weightlift_engine::HostProbe;

const UNBOUNDED: u64 = u64::MAX;

fn bounded(v: u64) -> Option<u64> {
    (v != UNBOUNDED).then_some(v)
}

fn kind_name(k: wp::DeviceKind) -> &'static str {
    match k {
        wp::DeviceKind::Cpu => "cpu",
        wp::DeviceKind::Cuda => "cuda",
        wp::DeviceKind::Virtual => "virtual",
        wp::DeviceKind::Disk => "disk",
    }
}

// --------------------------------------------------------------------------------------------
// Argument conversion

fn parse_device_arg(spec: &DevicesSpec) -> PyResult<Vec<wp::DeviceSpec>> {
    wp::parse_devices_with(&spec.0, &HostProbe).map_err(py_err)
}

/// The largest config.json we read.
const CONFIG_CAP: u64 = 64 << 20;

fn read_config(path: &Path) -> PyResult<serde_json::Value> {
    let meta = std::fs::metadata(path).map_err(|e| io_error(path, &e))?;
    if meta.len() > CONFIG_CAP {
        return Err(raise(
            Exc::Format,
            format!(
                "{}: config: expected at most {CONFIG_CAP} bytes, got {}; this is not an HF config.json",
                path.display(),
                meta.len()
            ),
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| io_error(path, &e))?;
    serde_json::from_str(&text).map_err(|e| {
        raise(
            Exc::Format,
            format!(
                "{}: config: expected a JSON object, got a parse error: {e}",
                path.display()
            ),
        )
    })
}

fn config_dtype(config: &serde_json::Value) -> Option<String> {
    ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| config.get(k).and_then(|v| v.as_str()).map(str::to_owned))
}

/// What a plan is made for, with the model's sliding-window layers.
struct Source {
    model: wp::ModelSource,
    window: Option<wp::SlidingWindow>,
}

impl Source {
    /// The request for these options on `devices`.
    fn request(
        self,
        options: wp::PlanOptions,
        devices: Vec<wp::DeviceSpec>,
    ) -> PyResult<wp::PlanRequest> {
        let mut req = options.into_request(self.model, devices).map_err(py_err)?;
        req.sliding_window = self.window;
        Ok(req)
    }
}

fn spec_from_config(config: &serde_json::Value) -> PyResult<Source> {
    let spec = wf::ModelSpec::from_hf_config(config).map_err(py_err)?;
    let window = wp::SlidingWindow::from_hf_config(config, &spec).map_err(py_err)?;
    Ok(Source {
        model: wp::ModelSource::Config(spec, config_dtype(config)),
        window,
    })
}

/// True for a folder that holds no weights but a config.json (plan from the config alone).
fn is_config_only_dir(path: &Path) -> bool {
    if !path.is_dir() || !path.join("config.json").is_file() {
        return false;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return false;
    };
    !entries.flatten().any(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        name.ends_with(".safetensors") || name.ends_with(".gguf") || name.ends_with(".index.json")
    })
}

/// What a plan is made for: a checkpoint's tensor table, or a config's spec.
fn resolve_source(py: Python<'_>, source: &Bound<'_, PyAny>) -> PyResult<Source> {
    if let Ok(ckpt) = source.cast::<Checkpoint>() {
        let ckpt = ckpt.get().shared()?;
        return checkpoint_source(&ckpt);
    }
    if let Ok(spec) = source.cast::<ModelSpec>() {
        return Ok(Source {
            model: wp::ModelSource::Config(spec.get().inner.clone(), None),
            window: None,
        });
    }
    if let Ok(dict) = source.cast::<PyDict>() {
        let text: String = py
            .import("json")?
            .call_method1("dumps", (dict,))?
            .extract()?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            raise(
                Exc::Plan,
                format!("config dict: not JSON-serialisable: {e}"),
            )
        })?;
        return spec_from_config(&value);
    }
    let path: PathBuf = source.extract().map_err(|_| {
        raise(
            Exc::Plan,
            format!(
                "source: expected a Checkpoint, a path, an HF config (path or dict) or a ModelSpec, got {}",
                source.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ),
        )
    })?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if path.is_file() && name.ends_with(".json") && !name.ends_with(".index.json") {
        return spec_from_config(&read_config(&path)?);
    }
    if is_config_only_dir(&path) {
        return spec_from_config(&read_config(&path.join("config.json"))?);
    }
    let ckpt = enter(py, || {
        wf::Checkpoint::open(&path, wf::OpenOptions::default())
    })?;
    checkpoint_source(&ckpt)
}

fn checkpoint_source(ckpt: &wf::Checkpoint) -> PyResult<Source> {
    if ckpt.vocab_only() {
        return Err(raise(
            Exc::Plan,
            format!(
                "{}: opened with vocab_only=True, so it has no tensor table to plan; open it without vocab_only",
                ckpt.path().display()
            ),
        ));
    }
    let spec = ckpt.spec().map_err(|e| {
        raise(
            Exc::Format,
            format!(
                "{}: cannot plan without the architecture: {e}",
                ckpt.path().display()
            ),
        )
    })?;
    let window = match (ckpt.format(), ckpt.config()) {
        (wf::Format::Gguf, _) => wp::SlidingWindow::from_gguf(ckpt.metadata(), spec),
        (wf::Format::Safetensors, Some(config)) => wp::SlidingWindow::from_hf_config(config, spec),
        (wf::Format::Safetensors, None) => Ok(None),
    }
    .map_err(|e| raise(Exc::Format, format!("{}: {e}", ckpt.path().display())))?;
    Ok(Source {
        model: wp::ModelSource::Tensors(spec.clone(), ckpt.tensors().to_vec()),
        window,
    })
}

// --------------------------------------------------------------------------------------------
// Functions

/// The placement keywords shared by `plan()`, `fit()` and `Model.load()`, as converted from
/// Python: each is `None` when not given.
pub(crate) struct PlacementArgs {
    pub strategy: Option<String>,
    pub reserve: Option<Sizes>,
    pub max_memory: Option<Sizes>,
    pub overhead: Option<Sizes>,
    pub n_gpu_layers: Option<i64>,
    pub split_mode: Option<String>,
    pub tensor_split: Option<Vec<f32>>,
    pub main_gpu: Option<usize>,
    pub device_map: Option<DeviceMapValue>,
    pub overrides: Option<Overrides>,
    pub gpu_split: Option<Vec<f64>>,
}

impl PlacementArgs {
    /// The planner's options for these keywords.
    pub fn options(self) -> wp::PlanOptions {
        wp::PlanOptions {
            strategy: self.strategy,
            reserve: self.reserve.map(|s| s.0),
            max_memory: self.max_memory.map(|s| s.0),
            overhead: self.overhead.map(|s| s.0),
            n_gpu_layers: self.n_gpu_layers,
            split_mode: self.split_mode,
            tensor_split: self.tensor_split,
            main_gpu: self.main_gpu,
            device_map: self.device_map.map(|d| d.0),
            overrides: self.overrides.map(|o| o.0).unwrap_or_default(),
            gpu_split: self.gpu_split,
            ..wp::PlanOptions::default()
        }
    }
}

/// `cache_offload=True` offloads the cache asked for (or `fallback`, when none was).
fn offloaded(
    cache: Option<wp::CacheSpec>,
    cache_offload: bool,
    fallback: Option<wp::CacheSpec>,
) -> PyResult<Option<wp::CacheSpec>> {
    if !cache_offload {
        return Ok(cache);
    }
    match cache.or(fallback) {
        Some(c) => Ok(Some(c.with_offload(true))),
        None => Err(raise(
            Exc::Plan,
            "cache_offload=True: there is no cache to offload; pass cache=CacheSpec(...) too",
        )),
    }
}

/// Plan where every tensor and every layer's KV cache goes, by arithmetic, before a byte is read.
///
/// `source` is a Checkpoint, a path (checkpoint, HF config.json, or a folder holding only a
/// config.json), an HF config dict, or a ModelSpec. Config-only sources need `weight_dtype`
/// (`"bfloat16"`, `"float16"`, `"q8_0"`, `"q4_k_m"`, ...) unless the config names its
/// `torch_dtype`. `devices` is a spec string (`"virtual:2x8GiB,cpu,disk"`) or a list of them.
///
/// `strategy` is `autosplit` (exllamav2), `sequential`, `balanced`, `balanced_low_0`
/// (accelerate), `layers` (llama.cpp: `n_gpu_layers`, `split_mode`, `tensor_split`,
/// `main_gpu`), `tensor_parallel` (exllamav2 TPContext: `gpu_split` in GB) or `map`
/// (`device_map` prefixes and llama.cpp `-ot` style `overrides`). Left at None, a `device_map`
/// preset names its strategy (`"auto"` = `balanced`), a `device_map` dict or `overrides` imply
/// `map`, the llama.cpp options imply `layers`, `gpu_split` implies `tensor_parallel`, and
/// otherwise it is `autosplit`.
///
/// The two ways to ask for a balanced split give the maps of two libraries:
/// `device_map="auto" | "balanced" | "balanced_low_0" | "sequential"` gives transformers 5's
/// `from_pretrained(device_map=...)` (each GPU but the last gets its share of the model plus
/// 1.25 × the larger of the largest decoder layer and the largest module, usually the
/// embedding; with no `max_memory` at all, 90% of the cpu), as `from_pretrained` does;
/// `strategy="balanced"` (or `"balanced_low_0"`, `"sequential"`) without a preset gives
/// accelerate's `infer_auto_device_map(get_balanced_memory(...))` (the share plus 1.25 × the
/// larger of the first decoder layer and the mean module).
///
/// `reserve`, `max_memory` and `overhead` take one size for every accelerator, a list in
/// accelerator order, or a dict keyed by device name or accelerator index; sizes are ints or
/// strings such as `"512MiB"`. `cache` is a `CacheSpec`, a `Cache` or a dict; `runtime` a
/// `RuntimeSpec` or a dict. `cache_offload=True` offloads `cache` to host RAM (as
/// `CacheSpec(..., offload=True)`): the cpu's kv column holds the whole cache and each device
/// that computes layers two prefetch slots of its largest layer. `quantize` (`"int8"`,
/// `"q8_0"`, `"q4_k"`, `"q6_k"`) sizes a float checkpoint's linears as a quantising load will
/// hold them: the blocks' linears in that type (a ggml type falls back as llama.cpp does when a
/// row is not whole blocks: Q4_K to Q5_0, Q6_K to Q8_0), the embedding and head kept in full
/// precision under int8 (as transformers) and promoted to Q6_K (q4_k, q6_k) or Q8_0 (q8_0)
/// otherwise, norms and biases as they are. `offload="sequential"` or `"group"`
/// (`blocks_per_group`, `prefetch`) plans accelerate's and diffusers' offloaded execution: the
/// layers kept on cpu or disk computed on the first accelerator, their onload slots charged to
/// its scratch (see `Model.load`). Raises `OutOfMemoryError` (with
/// `.shortfalls` and `.fixes`) when it does not fit, and `PlanError` for an invalid request.
#[pyfunction]
#[pyo3(signature = (
    source, *, devices, strategy = None, dtype = "auto", cache = None, runtime = None,
    reserve = None, max_memory = None, n_gpu_layers = None, split_mode = None,
    tensor_split = None, main_gpu = None, device_map = None, allow_disk = false,
    weight_dtype = None, overhead = None, overrides = None, gpu_split = None, use_mmap = true,
    cache_offload = false, quantize = None, offload = None, blocks_per_group = 1, prefetch = true
))]
#[allow(clippy::too_many_arguments)]
fn plan(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    devices: DevicesSpec,
    strategy: Option<String>,
    dtype: &str,
    cache: Option<CacheArg>,
    runtime: Option<RuntimeArg>,
    reserve: Option<Sizes>,
    max_memory: Option<Sizes>,
    n_gpu_layers: Option<i64>,
    split_mode: Option<String>,
    tensor_split: Option<Vec<f32>>,
    main_gpu: Option<usize>,
    device_map: Option<DeviceMapValue>,
    allow_disk: bool,
    weight_dtype: Option<String>,
    overhead: Option<Sizes>,
    overrides: Option<Overrides>,
    gpu_split: Option<Vec<f64>>,
    use_mmap: bool,
    cache_offload: bool,
    quantize: Option<String>,
    offload: Option<String>,
    blocks_per_group: u32,
    prefetch: bool,
) -> PyResult<Plan> {
    let placement = PlacementArgs {
        strategy,
        reserve,
        max_memory,
        overhead,
        n_gpu_layers,
        split_mode,
        tensor_split,
        main_gpu,
        device_map,
        overrides,
        gpu_split,
    };
    let options = wp::PlanOptions {
        dtype: Some(dtype.to_owned()),
        weight_dtype,
        cache: offloaded(cache.map(|c| c.0), cache_offload, None)?,
        runtime: runtime.map(|r| r.0),
        allow_disk: Some(allow_disk),
        use_mmap: Some(use_mmap),
        quantize,
        offload: wp::WeightOffload::parse(offload.as_deref(), blocks_per_group, prefetch)
            .map_err(py_err)?,
        ..placement.options()
    };
    let req = resolve_source(py, source)?.request(options, parse_device_arg(&devices)?)?;
    let inner = enter(py, || wp::plan(&req))?;
    Ok(Plan { inner })
}

/// The largest `target` that fits: `"max_seq_len"` (multiples of 256 up to the model's context
/// length), `"batch_size"`, or `"n_gpu_layers"` (strategy `layers`). Same options as `plan()`;
/// `cache` (or just `cache_dtype`) gives the cache dtype and batch (fp16, batch 1 without one);
/// `cache_offload=True` offloads that cache to host RAM. Raises `OutOfMemoryError` when even the
/// smallest value does not fit.
#[pyfunction]
#[pyo3(signature = (
    source, *, devices, target = "max_seq_len", strategy = None, dtype = "auto",
    cache = None, cache_dtype = None, runtime = None, reserve = None, max_memory = None, n_gpu_layers = None,
    split_mode = None, tensor_split = None, main_gpu = None, device_map = None, allow_disk = false,
    weight_dtype = None, overhead = None, overrides = None, gpu_split = None, use_mmap = true,
    cache_offload = false, quantize = None, offload = None, blocks_per_group = 1, prefetch = true
))]
#[allow(clippy::too_many_arguments)]
fn fit(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    devices: DevicesSpec,
    target: &str,
    strategy: Option<String>,
    dtype: &str,
    cache: Option<CacheArg>,
    cache_dtype: Option<&str>,
    runtime: Option<RuntimeArg>,
    reserve: Option<Sizes>,
    max_memory: Option<Sizes>,
    n_gpu_layers: Option<i64>,
    split_mode: Option<String>,
    tensor_split: Option<Vec<f32>>,
    main_gpu: Option<usize>,
    device_map: Option<DeviceMapValue>,
    allow_disk: bool,
    weight_dtype: Option<String>,
    overhead: Option<Sizes>,
    overrides: Option<Overrides>,
    gpu_split: Option<Vec<f64>>,
    use_mmap: bool,
    cache_offload: bool,
    quantize: Option<String>,
    offload: Option<String>,
    blocks_per_group: u32,
    prefetch: bool,
) -> PyResult<u64> {
    let target = wp::FitTarget::parse(target).map_err(py_err)?;
    let cache = match (cache.map(|c| c.0), cache_dtype) {
        (c, None) => c,
        (None, Some(d)) => Some(wp::CacheSpec::new(
            wp::SEQ_STEP,
            1,
            wp::CacheDType::parse(d).map_err(py_err)?,
        )),
        (Some(c), Some(d)) => {
            let d = wp::CacheDType::parse(d).map_err(py_err)?;
            if d != c.dtype {
                return Err(raise(
                    Exc::Plan,
                    format!(
                        "cache_dtype: '{}' contradicts cache.dtype '{}'; give one of them",
                        d.name(),
                        c.dtype.name()
                    ),
                ));
            }
            Some(c)
        }
    };
    // Offloading applies to the cache asked for, or to fit()'s default one (fp16, batch 1).
    let default_cache = wp::CacheSpec::new(wp::SEQ_STEP, 1, wp::CacheDType::Fp16);
    let placement = PlacementArgs {
        strategy,
        reserve,
        max_memory,
        overhead,
        n_gpu_layers,
        split_mode,
        tensor_split,
        main_gpu,
        device_map,
        overrides,
        gpu_split,
    };
    let options = wp::PlanOptions {
        dtype: Some(dtype.to_owned()),
        weight_dtype,
        cache: offloaded(cache, cache_offload, Some(default_cache))?,
        runtime: runtime.map(|r| r.0),
        allow_disk: Some(allow_disk),
        use_mmap: Some(use_mmap),
        quantize,
        offload: wp::WeightOffload::parse(offload.as_deref(), blocks_per_group, prefetch)
            .map_err(py_err)?,
        ..placement.options()
    };
    let req = resolve_source(py, source)?
        .request(options.for_fit(target), parse_device_arg(&devices)?)?;
    enter(py, || wp::fit(&req, target))
}

/// The real machine's devices: `cpu` with MemAvailable, then any CUDA GPUs the engine can see,
/// then `disk`.
#[pyfunction]
fn devices(py: Python<'_>) -> PyResult<Vec<Device>> {
    let list = enter(py, || {
        let mut items = vec!["cpu".to_owned()];
        items.extend((0..wp::MemoryProbe::cuda_count(&HostProbe)).map(|i| format!("cuda:{i}")));
        items.push("disk".into());
        wp::parse_devices_with(&items.join(","), &HostProbe)
    })?;
    Ok(list.into_iter().map(|inner| Device { inner }).collect())
}

/// Parse a device spec string (`"cpu"`, `"cuda:0:24GiB"`, `"virtual:2x24GiB"`,
/// `"virtual:24GiB,virtual:12GiB,cpu:64GiB,disk"`) into normalised devices. `cpu` without a
/// size is the machine's MemAvailable.
#[pyfunction]
fn parse_devices(spec: DevicesSpec) -> PyResult<Vec<Device>> {
    Ok(parse_device_arg(&spec)?
        .into_iter()
        .map(|inner| Device { inner })
        .collect())
}

// --------------------------------------------------------------------------------------------
// Classes

/// The KV cache to plan for: `max_seq_len` tokens × `batch_size`, in `dtype` (fp16, fp8, q8,
/// q6 or q4; the quantised ones carry one f16 scale per 32 values, q6 is 8-bit K, 4-bit V).
/// `offload=True` plans transformers' `OffloadedCache`: the whole cache in host RAM (the cpu's
/// kv column) and, on each device that computes layers, two prefetch slots of its largest layer
/// (one when it computes a single layer).
#[pyclass(module = "weightlift._native", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct CacheSpec {
    pub(crate) inner: wp::CacheSpec,
}

#[pymethods]
impl CacheSpec {
    #[new]
    #[pyo3(signature = (max_seq_len, batch_size = 1, dtype = "fp16", offload = false))]
    pub(crate) fn new(
        max_seq_len: u64,
        batch_size: u64,
        dtype: &str,
        offload: bool,
    ) -> PyResult<Self> {
        if max_seq_len == 0 || batch_size == 0 {
            return Err(raise(
                Exc::Plan,
                format!(
                    "CacheSpec: expected max_seq_len and batch_size of at least 1, got {max_seq_len} and {batch_size}"
                ),
            ));
        }
        let dtype = wp::CacheDType::parse(dtype).map_err(py_err)?;
        Ok(CacheSpec {
            inner: wp::CacheSpec::new(max_seq_len, batch_size, dtype).with_offload(offload),
        })
    }
    #[getter]
    fn max_seq_len(&self) -> u64 {
        self.inner.max_seq_len
    }
    #[getter]
    fn batch_size(&self) -> u64 {
        self.inner.batch_size
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }
    /// True for a cache offloaded to host RAM.
    #[getter]
    fn offload(&self) -> bool {
        self.inner.offload
    }
    /// Bytes of the whole cache for a model.
    fn nbytes(&self, spec: PyRef<'_, ModelSpec>) -> u64 {
        self.inner.total_bytes(&spec.inner)
    }
    fn __repr__(&self) -> String {
        let offload = if self.inner.offload {
            ", offload=True"
        } else {
            ""
        };
        format!(
            "CacheSpec(max_seq_len={}, batch_size={}, dtype='{}'{offload})",
            self.inner.max_seq_len,
            self.inner.batch_size,
            self.inner.dtype.name()
        )
    }
}

/// Runtime limits that decide per-device scratch, named and defaulted as exllamav2's config.
#[pyclass(module = "weightlift._native", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RuntimeSpec {
    pub(crate) inner: wp::RuntimeSpec,
}

#[pymethods]
impl RuntimeSpec {
    #[new]
    // Defaults are exllamav2's: 2048 tokens, 2048² attention elements, 512 Mi dequant elements.
    #[pyo3(signature = (max_input_len = 2048, max_attention_size = 4_194_304, max_dq_size = 536_870_912, low_mem = false))]
    fn new(max_input_len: u64, max_attention_size: u64, max_dq_size: u64, low_mem: bool) -> Self {
        RuntimeSpec {
            inner: wp::RuntimeSpec {
                max_input_len,
                max_attention_size,
                max_dq_size,
                low_mem,
            },
        }
    }
    #[getter]
    fn max_input_len(&self) -> u64 {
        self.inner.max_input_len
    }
    #[getter]
    fn max_attention_size(&self) -> u64 {
        self.inner.max_attention_size
    }
    #[getter]
    fn max_dq_size(&self) -> u64 {
        self.inner.max_dq_size
    }
    #[getter]
    fn low_mem(&self) -> bool {
        self.inner.low_mem
    }
    fn __repr__(&self) -> String {
        let r = &self.inner;
        format!(
            "RuntimeSpec(max_input_len={}, max_attention_size={}, max_dq_size={}, low_mem={})",
            r.max_input_len,
            r.max_attention_size,
            r.max_dq_size,
            if r.low_mem { "True" } else { "False" }
        )
    }
}

/// One device of an inventory. `capacity` is None for an unbounded device (`disk`, or `cpu`
/// when its memory is unknown).
#[pyclass(module = "weightlift._native", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct Device {
    inner: wp::DeviceSpec,
}

#[pymethods]
impl Device {
    /// Normalised name: `"cpu"`, `"cuda:0"`, `"virtual:1"`, `"disk"`.
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    /// `"cpu"`, `"cuda"`, `"virtual"` or `"disk"`.
    #[getter]
    fn kind(&self) -> &'static str {
        kind_name(self.inner.kind)
    }
    /// Bytes, or None when unbounded.
    #[getter]
    fn capacity(&self) -> Option<u64> {
        bounded(self.inner.capacity)
    }
    #[getter]
    fn reserve(&self) -> u64 {
        self.inner.reserve
    }
    #[getter]
    fn overhead(&self) -> u64 {
        self.inner.overhead
    }
    fn __repr__(&self) -> String {
        match bounded(self.inner.capacity) {
            Some(c) => format!("Device('{}', capacity={c})", self.inner.name),
            None => format!("Device('{}', capacity=None)", self.inner.name),
        }
    }
}

/// A device's share of a plan, in bytes. `capacity` and `free` are None for unbounded devices.
#[pyclass(module = "weightlift._native", frozen)]
#[derive(Clone)]
pub struct DeviceUsage {
    inner: wp::DeviceUsage,
}

#[pymethods]
impl DeviceUsage {
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    #[getter]
    fn kind(&self) -> &'static str {
        kind_name(self.inner.kind)
    }
    #[getter]
    fn capacity(&self) -> Option<u64> {
        bounded(self.inner.capacity)
    }
    /// Bytes of the weights placed here, after any dtype conversion.
    #[getter]
    fn weights(&self) -> u64 {
        self.inner.weights
    }
    /// Bytes of the KV cache of the layers placed here.
    #[getter]
    fn kv(&self) -> u64 {
        self.inner.kv
    }
    #[getter]
    fn scratch(&self) -> u64 {
        self.inner.scratch
    }
    #[getter]
    fn overhead(&self) -> u64 {
        self.inner.overhead
    }
    #[getter]
    fn reserve(&self) -> u64 {
        self.inner.reserve
    }
    #[getter]
    fn free(&self) -> Option<u64> {
        bounded(self.inner.capacity).map(|_| self.inner.free)
    }
    /// weights + kv + scratch + overhead + reserve.
    #[getter]
    fn used(&self) -> u64 {
        self.inner.used()
    }
    /// Inclusive layer ranges placed here, e.g. `[(0, 11)]`.
    #[getter]
    fn layers(&self) -> Vec<(u32, u32)> {
        self.inner.layers.clone()
    }
    /// Other things held here (`"token_embd"`, `"output"`, ...).
    #[getter]
    fn holds(&self) -> Vec<String> {
        self.inner.holds.clone()
    }
    /// True when the planner added the device (not in the given list).
    #[getter]
    fn implicit(&self) -> bool {
        self.inner.implicit
    }
    fn __repr__(&self) -> String {
        let d = &self.inner;
        format!(
            "DeviceUsage('{}', weights={}, kv={}, scratch={}, overhead={}, reserve={}, free={})",
            d.name,
            d.weights,
            d.kv,
            d.scratch,
            d.overhead,
            d.reserve,
            bounded(d.capacity).map_or("None".into(), |_| d.free.to_string())
        )
    }
}

/// Where one tensor goes. `shards` lists `(device, start, end, bytes)` row ranges when the
/// tensor is split across devices (llama.cpp row split, tensor parallel), else None.
#[pyclass(module = "weightlift._native", frozen)]
#[derive(Clone)]
pub struct Placement {
    inner: wp::TensorPlacement,
}

#[pymethods]
impl Placement {
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    #[getter]
    fn device(&self) -> &str {
        &self.inner.device
    }
    /// The dtype after any conversion.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.bytes
    }
    #[getter]
    fn layer(&self) -> Option<u32> {
        self.inner.layer
    }
    #[getter]
    fn shards(&self) -> Option<Vec<(String, u64, u64, u64)>> {
        self.inner.split.as_ref().map(|s| {
            s.shards
                .iter()
                .map(|sh| (sh.device.clone(), sh.start, sh.end, sh.bytes))
                .collect()
        })
    }
    fn __repr__(&self) -> String {
        format!(
            "Placement('{}' -> {}, {} bytes {})",
            self.inner.name,
            self.inner.device,
            self.inner.bytes,
            self.inner.dtype.name()
        )
    }
}

/// An immutable, deterministic placement plan. Round-trips through JSON.
#[pyclass(module = "weightlift._native", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct Plan {
    pub(crate) inner: wp::Plan,
}

#[pymethods]
impl Plan {
    /// The strategy that made the plan.
    #[getter]
    fn strategy(&self) -> &str {
        self.inner.strategy()
    }
    #[getter]
    fn architecture(&self) -> &str {
        self.inner.architecture()
    }
    #[getter]
    fn n_layers(&self) -> u32 {
        self.inner.n_layers()
    }
    /// The quantise-on-load mode the sizes assume (`"int8"`, `"q8_0"`, ...), or None.
    #[getter]
    fn quantize(&self) -> Option<&'static str> {
        self.inner.quantize().map(wp::Quantize::name)
    }
    #[getter]
    fn cache(&self) -> Option<CacheSpec> {
        self.inner.cache().map(|c| CacheSpec { inner: *c })
    }
    #[getter]
    fn runtime(&self) -> RuntimeSpec {
        RuntimeSpec {
            inner: *self.inner.runtime(),
        }
    }
    /// The device of a tensor; a tensor split across devices (row split, tensor parallelism)
    /// gives every shard's device in shard order, joined by commas, as `Model.device_of` does.
    /// KeyError for a name the plan does not hold.
    fn device_of(&self, name: &str) -> PyResult<String> {
        self.inner
            .device_of(name)
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.to_owned()))
    }
    /// The device of every repeating layer, in layer order.
    #[getter]
    fn layer_devices(&self) -> Vec<String> {
        self.inner.layer_devices().to_vec()
    }
    /// The device of the token embedding.
    #[getter]
    fn embed_device(&self) -> &str {
        self.inner.embed_device()
    }
    /// The device of the output head.
    #[getter]
    fn head_device(&self) -> &str {
        self.inner.head_device()
    }
    /// The device holding a separate copy of a tied output head (exllamav2 loads the tied
    /// embedding again as the head), or None.
    #[getter]
    fn tied_output_copy(&self) -> Option<&str> {
        self.inner.tied_output_copy()
    }
    /// Every tensor's placement, in checkpoint order.
    #[getter]
    fn tensors(&self) -> Vec<Placement> {
        self.inner
            .tensors()
            .iter()
            .map(|t| Placement { inner: t.clone() })
            .collect()
    }
    /// Per-device breakdown: weights, kv, scratch, overhead, reserve and free, in bytes.
    #[getter]
    fn devices(&self) -> Vec<DeviceUsage> {
        self.inner
            .devices()
            .iter()
            .map(|d| DeviceUsage { inner: d.clone() })
            .collect()
    }
    /// Host RAM at its peak during loading, in bytes: `staging`, `owned_weights`,
    /// `mapped_weights` (page cache), `disk_weights`, `kv`, `scratch`, `peak_anon`, `peak_total`.
    #[getter]
    fn host<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let h = self.inner.host();
        let d = PyDict::new(py);
        d.set_item("staging", h.staging)?;
        d.set_item("owned_weights", h.owned_weights)?;
        d.set_item("mapped_weights", h.mapped_weights)?;
        d.set_item("disk_weights", h.disk_weights)?;
        d.set_item("kv", h.kv)?;
        d.set_item("scratch", h.scratch)?;
        d.set_item("peak_anon", h.peak_anon)?;
        d.set_item("peak_total", h.peak_total)?;
        Ok(d)
    }
    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.inner.warnings().to_vec()
    }
    /// A tensor-parallel split table as `(device index, start, end)` rows, for `kind` in
    /// `"kv"`, `"id"`, `"vc"`, `"rs"`, `"q"`. Raises `PlanError` for a plan that is not
    /// tensor-parallel.
    fn tp_split(&self, kind: &str) -> PyResult<Vec<(usize, u64, u64)>> {
        let k = wp::TpKind::parse(kind).map_err(py_err)?;
        self.inner.tp_split(k).map(<[_]>::to_vec).ok_or_else(|| {
            raise(
                Exc::Plan,
                format!(
                    "tp_split: the plan has no tensor-parallel split (strategy {}); plan with strategy=\"tensor_parallel\"",
                    self.inner.strategy()
                ),
            )
        })
    }
    /// The plan as JSON; `Plan.from_json` reads it back to an equal plan.
    fn to_json(&self) -> String {
        self.inner.to_json()
    }
    /// Read a plan written by `to_json`.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Plan> {
        Ok(Plan {
            inner: wp::Plan::from_json(text).map_err(py_err)?,
        })
    }
    /// A readable table: one row per device, then host RAM and warnings.
    fn explain(&self) -> String {
        self.inner.explain()
    }
    /// The plan as an SVG chart: one stacked bar per device (weights, kv, scratch, reserve,
    /// free) with layer ranges labelled.
    fn to_svg(&self) -> String {
        self.inner.to_svg()
    }
    /// Write `to_svg()` to a file.
    fn save_svg(&self, path: PathBuf) -> PyResult<()> {
        std::fs::write(&path, self.inner.to_svg()).map_err(|e| io_error(&path, &e))
    }
    fn __repr__(&self) -> String {
        let devs: Vec<String> = self
            .inner
            .devices()
            .iter()
            .map(|d| {
                format!(
                    "{}: {} layers",
                    d.name,
                    d.layers.iter().map(|(a, b)| b - a + 1).sum::<u32>()
                )
            })
            .collect();
        format!(
            "<Plan {} {} ({} layers): {}>",
            self.inner.strategy(),
            self.inner.architecture(),
            self.inner.n_layers(),
            devs.join(", ")
        )
    }
}

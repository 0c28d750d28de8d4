//! Python bindings for weightlift-plan: `plan()`, `fit()`, `devices()`, `parse_devices()`,
//! `CacheSpec`, `RuntimeSpec` and `Plan`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use weightlift_format as wf;
use weightlift_plan as wp;

use crate::errors::{Exc, enter, io_error, py_err, raise};
use crate::format::{Checkpoint, ModelSpec};

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

/// A size in bytes: an int, or a string such as `"512MiB"`.
fn size_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if let Ok(s) = obj.cast::<PyString>() {
        return wp::parse_size(s.to_str()?).map_err(py_err);
    }
    obj.extract::<u64>().map_err(|_| {
        raise(
            Exc::Plan,
            format!("{what}: expected a size in bytes (a non-negative int) or a string such as \"512MiB\", got {}", obj.repr().map(|r| r.to_string()).unwrap_or_default()),
        )
    })
}

/// A device key as users write it: an accelerator index (`0`) or a name (`"cuda:0"`, `"cpu"`).
fn device_key(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(i) = obj.extract::<u64>() {
        return Ok(i.to_string());
    }
    obj.extract::<String>()
}

/// Per-device sizes: one value for every accelerator, a list in device order, or a dict keyed
/// by device name or accelerator index. Returns normalised names.
fn per_device(
    obj: Option<&Bound<'_, PyAny>>,
    devices: &[wp::DeviceSpec],
    what: &str,
) -> PyResult<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    let Some(obj) = obj else { return Ok(out) };
    if obj.is_none() {
        return Ok(out);
    }
    if let Ok(dict) = obj.cast::<PyDict>() {
        for (k, v) in dict.iter() {
            let key = device_key(&k)?;
            let idx = wp::resolve_device(devices, &key, what).map_err(py_err)?;
            out.insert(devices[idx].name.clone(), size_arg(&v, what)?);
        }
    } else if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let items: Vec<Bound<'_, PyAny>> = obj.try_iter()?.collect::<PyResult<_>>()?;
        if items.len() > devices.len() {
            return Err(raise(
                Exc::Plan,
                format!(
                    "{what}: expected at most one value per device ({}), got {}",
                    devices.len(),
                    items.len()
                ),
            ));
        }
        for (d, v) in devices.iter().zip(&items) {
            out.insert(d.name.clone(), size_arg(v, what)?);
        }
    } else {
        let v = size_arg(obj, what)?;
        for d in devices.iter().filter(|d| d.kind.is_accelerator()) {
            out.insert(d.name.clone(), v);
        }
    }
    Ok(out)
}

fn parse_device_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<wp::DeviceSpec>> {
    let spec = if let Ok(s) = obj.cast::<PyString>() {
        s.to_str()?.to_owned()
    } else {
        let items: Vec<String> = obj
            .try_iter()
            .and_then(|it| it.map(|x| x?.extract::<String>()).collect())
            .map_err(|_| {
                raise(
                    Exc::Plan,
                    "devices: expected a spec string such as \"virtual:2x8GiB,cpu\" or a list of such strings",
                )
            })?;
        items.join(",")
    };
    wp::parse_devices_with(&spec, &HostProbe).map_err(py_err)
}

/// What `source` resolved to before planning.
enum Source {
    Checkpoint(std::sync::Arc<wf::Checkpoint>),
    /// A spec from a config or a ModelSpec, with the config's own `torch_dtype` if it has one.
    Spec(wf::ModelSpec, Option<String>),
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

fn spec_from_config(config: &serde_json::Value) -> PyResult<Source> {
    let spec = wf::ModelSpec::from_hf_config(config).map_err(py_err)?;
    Ok(Source::Spec(spec, config_dtype(config)))
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

fn resolve_source(py: Python<'_>, source: &Bound<'_, PyAny>) -> PyResult<Source> {
    if let Ok(ckpt) = source.cast::<Checkpoint>() {
        return Ok(Source::Checkpoint(ckpt.get().shared()?));
    }
    if let Ok(spec) = source.cast::<ModelSpec>() {
        return Ok(Source::Spec(spec.get().inner.clone(), None));
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
    Ok(Source::Checkpoint(std::sync::Arc::new(ckpt)))
}

/// The keyword options shared by `plan()` and `fit()`, extracted while the GIL is held.
struct Options<'a, 'py> {
    devices: &'a Bound<'py, PyAny>,
    strategy: &'a str,
    dtype: &'a str,
    cache: Option<wp::CacheSpec>,
    runtime: Option<PyRef<'py, RuntimeSpec>>,
    reserve: Option<&'a Bound<'py, PyAny>>,
    max_memory: Option<&'a Bound<'py, PyAny>>,
    overhead: Option<&'a Bound<'py, PyAny>>,
    n_gpu_layers: Option<i64>,
    split_mode: Option<&'a str>,
    tensor_split: Option<Vec<f32>>,
    main_gpu: usize,
    device_map: Option<&'a Bound<'py, PyAny>>,
    overrides: Option<&'a Bound<'py, PyAny>>,
    gpu_split: Option<Vec<f64>>,
    allow_disk: bool,
    use_mmap: bool,
    weight_dtype: Option<&'a str>,
}

fn build_request(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    o: Options<'_, '_>,
) -> PyResult<wp::PlanRequest> {
    let devices = parse_device_arg(o.devices)?;
    let (spec, tensors) = match resolve_source(py, source)? {
        Source::Checkpoint(ckpt) => {
            if o.weight_dtype.is_some() {
                return Err(raise(
                    Exc::Plan,
                    "weight_dtype: applies to planning from a config or a ModelSpec; a checkpoint's real tensor types are used as stored (use dtype= to convert float weights)",
                ));
            }
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
            (spec.clone(), ckpt.tensors().to_vec())
        }
        Source::Spec(spec, config_dtype) => {
            let Some(wt) = o.weight_dtype.map(str::to_owned).or(config_dtype) else {
                return Err(raise(
                    Exc::Plan,
                    "weight_dtype: required when planning from a config or a ModelSpec without torch_dtype; expected e.g. \"bfloat16\", \"float16\", \"q8_0\" or \"q4_k_m\"",
                ));
            };
            let weights = wp::WeightType::parse(&wt).map_err(py_err)?;
            let tensors = wp::synthesize_tensors(&spec, weights).map_err(py_err)?;
            (spec, tensors)
        }
    };

    // Options imply their strategy when the strategy is left at its default.
    let layer_opts = o.n_gpu_layers.is_some() || o.split_mode.is_some() || o.tensor_split.is_some();
    let mut name = o.strategy.to_owned();
    if name == "autosplit" {
        if o.device_map.is_some() || o.overrides.is_some() {
            name = "map".into();
        } else if layer_opts {
            name = "layers".into();
        }
    }
    let mut strategy = wp::Strategy::parse(&name).map_err(py_err)?;
    let misplaced = |opt: &str, wants: &str| {
        raise(
            Exc::Plan,
            format!("{opt}: applies to strategy '{wants}', got strategy '{name}'"),
        )
    };
    match &mut strategy {
        wp::Strategy::Layers(lo) => {
            if let Some(n) = o.n_gpu_layers {
                lo.n_gpu_layers = n;
            }
            if let Some(sm) = o.split_mode {
                lo.split_mode = wp::SplitMode::parse(sm).map_err(py_err)?;
            }
            if let Some(ts) = &o.tensor_split {
                lo.tensor_split = ts.clone();
            }
            lo.main_gpu = o.main_gpu;
        }
        _ if layer_opts => return Err(misplaced("n_gpu_layers/split_mode/tensor_split", "layers")),
        _ => {}
    }
    match &mut strategy {
        wp::Strategy::TensorParallel(tp) => {
            if let Some(gs) = &o.gpu_split {
                // exllamav2's gpu_split is in GB of 1024 MiB.
                tp.gpu_split_mib = Some(gs.iter().map(|g| (g * 1024.0).max(0.0) as u64).collect());
            }
        }
        _ if o.gpu_split.is_some() => return Err(misplaced("gpu_split", "tensor_parallel")),
        _ => {}
    }
    match &mut strategy {
        wp::Strategy::Map(dm) => {
            if let Some(map) = o.device_map {
                let dict = map.cast::<PyDict>().map_err(|_| {
                    raise(
                        Exc::Plan,
                        "device_map: expected a dict of {module or layer prefix: device}",
                    )
                })?;
                for (k, v) in dict.iter() {
                    dm.entries.push((k.extract::<String>()?, device_key(&v)?));
                }
            }
            if let Some(ov) = o.overrides {
                if let Ok(s) = ov.cast::<PyString>() {
                    dm.overrides = wp::DeviceMap::parse_overrides(s.to_str()?).map_err(py_err)?;
                } else if let Ok(d) = ov.cast::<PyDict>() {
                    for (k, v) in d.iter() {
                        dm.overrides.push((k.extract::<String>()?, device_key(&v)?));
                    }
                } else {
                    for rule in ov.try_iter()? {
                        let rule: String = rule?.extract()?;
                        dm.overrides
                            .extend(wp::DeviceMap::parse_overrides(&rule).map_err(py_err)?);
                    }
                }
            }
        }
        _ if o.device_map.is_some() || o.overrides.is_some() => {
            return Err(misplaced("device_map/overrides", "map"));
        }
        _ => {}
    }

    let reserve = per_device(o.reserve, &devices, "reserve")?;
    let max_memory = per_device(o.max_memory, &devices, "max_memory")?;
    let overhead = per_device(o.overhead, &devices, "overhead")?;
    let mut req = wp::PlanRequest::new(spec, tensors, devices);
    req.strategy = strategy;
    req.dtype = wp::DTypeChoice::parse(o.dtype).map_err(py_err)?;
    req.cache = o.cache;
    req.runtime = o.runtime.map(|r| r.inner).unwrap_or_default();
    req.reserve = reserve;
    req.max_memory = max_memory;
    req.overhead = overhead;
    req.allow_disk = o.allow_disk;
    req.use_mmap = o.use_mmap;
    Ok(req)
}

// --------------------------------------------------------------------------------------------
// Functions

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
/// (`device_map` prefixes and llama.cpp `-ot` style `overrides`). Left at `autosplit`, the
/// llama.cpp options imply `layers` and `device_map`/`overrides` imply `map`.
///
/// `reserve`, `max_memory` and `overhead` take one size for every accelerator, a list in device
/// order, or a dict keyed by device name or accelerator index; sizes are ints or strings such
/// as `"512MiB"`. `cache_offload=True` offloads `cache` to host RAM (as
/// `CacheSpec(..., offload=True)`): the cpu's kv column holds the whole cache and each device
/// that computes layers two prefetch slots of its largest layer. Raises `OutOfMemoryError` (with
/// `.shortfalls` and `.fixes`) when it does not fit, and `PlanError` for an invalid request.
#[pyfunction]
#[pyo3(signature = (
    source, *, devices, strategy = "autosplit", dtype = "auto", cache = None, runtime = None,
    reserve = None, max_memory = None, n_gpu_layers = None, split_mode = None,
    tensor_split = None, main_gpu = 0, device_map = None, allow_disk = false,
    weight_dtype = None, overhead = None, overrides = None, gpu_split = None, use_mmap = true,
    cache_offload = false
))]
#[allow(clippy::too_many_arguments)]
fn plan<'py>(
    py: Python<'py>,
    source: &Bound<'py, PyAny>,
    devices: &Bound<'py, PyAny>,
    strategy: &str,
    dtype: &str,
    cache: Option<PyRef<'py, CacheSpec>>,
    runtime: Option<PyRef<'py, RuntimeSpec>>,
    reserve: Option<&Bound<'py, PyAny>>,
    max_memory: Option<&Bound<'py, PyAny>>,
    n_gpu_layers: Option<i64>,
    split_mode: Option<&str>,
    tensor_split: Option<Vec<f32>>,
    main_gpu: usize,
    device_map: Option<&Bound<'py, PyAny>>,
    allow_disk: bool,
    weight_dtype: Option<&str>,
    overhead: Option<&Bound<'py, PyAny>>,
    overrides: Option<&Bound<'py, PyAny>>,
    gpu_split: Option<Vec<f64>>,
    use_mmap: bool,
    cache_offload: bool,
) -> PyResult<Plan> {
    let cache = cache.map(|c| c.inner);
    if cache_offload && cache.is_none() {
        return Err(raise(
            Exc::Plan,
            "cache_offload=True: there is no cache to offload; pass cache=CacheSpec(...) too",
        ));
    }
    let opts = Options {
        devices,
        strategy,
        dtype,
        cache: cache.map(|c| {
            if cache_offload {
                c.with_offload(true)
            } else {
                c
            }
        }),
        runtime,
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
        allow_disk,
        use_mmap,
        weight_dtype,
    };
    let req = build_request(py, source, opts)?;
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
    source, *, devices, target = "max_seq_len", strategy = "autosplit", dtype = "auto",
    cache = None, cache_dtype = None, runtime = None, reserve = None, max_memory = None, n_gpu_layers = None,
    split_mode = None, tensor_split = None, main_gpu = 0, device_map = None, allow_disk = false,
    weight_dtype = None, overhead = None, overrides = None, gpu_split = None, use_mmap = true,
    cache_offload = false
))]
#[allow(clippy::too_many_arguments)]
fn fit<'py>(
    py: Python<'py>,
    source: &Bound<'py, PyAny>,
    devices: &Bound<'py, PyAny>,
    target: &str,
    strategy: &str,
    dtype: &str,
    cache: Option<PyRef<'py, CacheSpec>>,
    cache_dtype: Option<&str>,
    runtime: Option<PyRef<'py, RuntimeSpec>>,
    reserve: Option<&Bound<'py, PyAny>>,
    max_memory: Option<&Bound<'py, PyAny>>,
    n_gpu_layers: Option<i64>,
    split_mode: Option<&str>,
    tensor_split: Option<Vec<f32>>,
    main_gpu: usize,
    device_map: Option<&Bound<'py, PyAny>>,
    allow_disk: bool,
    weight_dtype: Option<&str>,
    overhead: Option<&Bound<'py, PyAny>>,
    overrides: Option<&Bound<'py, PyAny>>,
    gpu_split: Option<Vec<f64>>,
    use_mmap: bool,
    cache_offload: bool,
) -> PyResult<u64> {
    let target = wp::FitTarget::parse(target).map_err(py_err)?;
    let cache = match (cache.map(|c| c.inner), cache_dtype) {
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
    let cache = if cache_offload {
        Some(
            cache
                .unwrap_or(wp::CacheSpec::new(wp::SEQ_STEP, 1, wp::CacheDType::Fp16))
                .with_offload(true),
        )
    } else {
        cache
    };
    let opts = Options {
        devices,
        strategy,
        dtype,
        cache,
        runtime,
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
        allow_disk,
        use_mmap,
        weight_dtype,
    };
    let req = build_request(py, source, opts)?;
    enter(py, || wp::fit(&req, target))
}

/// The real machine's devices: `cpu` with MemAvailable, then any CUDA GPUs the engine can see,
/// then `disk`.
#[pyfunction]
fn devices(py: Python<'_>) -> PyResult<Vec<Device>> {
    let spec = py.detach(|| {
        let mut items = vec!["cpu".to_owned()];
        items.extend((0..wp::MemoryProbe::cuda_count(&HostProbe)).map(|i| format!("cuda:{i}")));
        items.push("disk".into());
        items.join(",")
    });
    let list = enter(py, || wp::parse_devices_with(&spec, &HostProbe))?;
    Ok(list.into_iter().map(|inner| Device { inner }).collect())
}

/// Parse a device spec string (`"cpu"`, `"cuda:0:24GiB"`, `"virtual:2x24GiB"`,
/// `"virtual:24GiB,virtual:12GiB,cpu:64GiB,disk"`) into normalised devices. `cpu` without a
/// size is the machine's MemAvailable.
#[pyfunction]
fn parse_devices(spec: &Bound<'_, PyAny>) -> PyResult<Vec<Device>> {
    Ok(parse_device_arg(spec)?
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
    inner: wp::CacheSpec,
}

#[pymethods]
impl CacheSpec {
    #[new]
    #[pyo3(signature = (max_seq_len, batch_size = 1, dtype = "fp16", offload = false))]
    fn new(max_seq_len: u64, batch_size: u64, dtype: &str, offload: bool) -> PyResult<Self> {
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
    inner: wp::RuntimeSpec,
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
    /// The device of a tensor; KeyError for a name the plan does not hold.
    fn device_of(&self, name: &str) -> PyResult<String> {
        self.inner
            .device_of(name)
            .map(str::to_owned)
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

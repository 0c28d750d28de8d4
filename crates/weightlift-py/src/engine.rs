//! Python bindings for weightlift-engine: `tensor()`, `DeviceTensor`, `Model`, `Cache`,
//! `TPContext`, `from_pretrained()` and `load_gguf()`.
//!
//! Loads run with the GIL released (`py.detach`); the progress path re-attaches only to call the
//! user's callback and `Python::check_signals`, so Ctrl-C becomes a `KeyboardInterrupt` after
//! the load has freed everything it allocated.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use numpy::{PyArray1, PyReadonlyArrayDyn};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyTuple};
use weightlift_engine::cache::{Cache as ECache, CacheDType};
use weightlift_engine::tp::{HostStaged, Rope, TpContext};
use weightlift_engine::{
    self as we, Device, EngineError, Inventory, LoadOptions, Model as EModel, Progress,
};
use weightlift_format::{self as wf, DType};
use weightlift_plan::{self as wp, PlanError, PlanRequest, Strategy};

use crate::errors::{Exc, ToPyErr, io_error, raise};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(tensor, m)?)?;
    m.add_function(wrap_pyfunction!(use_devices, m)?)?;
    m.add_function(wrap_pyfunction!(from_pretrained, m)?)?;
    m.add_function(wrap_pyfunction!(load_gguf, m)?)?;
    m.add_class::<DeviceTensor>()?;
    m.add_class::<Model>()?;
    m.add_class::<Cache>()?;
    m.add_class::<TPContext>()?;
    m.add("BROADCAST_KV", we::tp::BROADCAST_KV)?;
    m.add("BROADCAST_ID", we::tp::BROADCAST_ID)?;
    m.add("BROADCAST_VC", we::tp::BROADCAST_VC)?;
    m.add("BROADCAST_RS", we::tp::BROADCAST_RS)?;
    m.add("BROADCAST_Q", we::tp::BROADCAST_Q)?;
    Ok(())
}

impl ToPyErr for EngineError {
    fn to_pyerr(self) -> PyErr {
        match self {
            EngineError::OutOfMemory { .. } => raise(Exc::OutOfMemory, self.to_string()),
            EngineError::Device { .. } => raise(Exc::Device, self.to_string()),
            EngineError::CudaUnavailable { .. } => raise(Exc::CudaUnavailable, self.to_string()),
            EngineError::Cancelled { .. } => raise(Exc::LoadCancelled, self.to_string()),
            EngineError::Io {
                path,
                tensor,
                source,
            } => {
                let _ = tensor;
                io_error(&path, &source)
            }
            EngineError::Format(e) => e.to_pyerr(),
            EngineError::Plan(e) => plan_err(*e),
            EngineError::Validation { .. } | EngineError::NonFinite { .. } => {
                raise(Exc::Format, self.to_string())
            }
            EngineError::Invalid { .. } => raise(Exc::Plan, self.to_string()),
            EngineError::Unsupported { .. } => raise(Exc::Unsupported, self.to_string()),
            EngineError::NotLoaded { .. } => raise(Exc::Weightlift, self.to_string()),
            EngineError::ContextFull { .. } => raise(Exc::ContextFull, self.to_string()),
            EngineError::Text(e) => e.to_pyerr(),
        }
    }
}

/// Planner errors map as the plan bindings map them (errors.rs): OutOfMemoryError or PlanError.
fn plan_err(e: PlanError) -> PyErr {
    e.to_pyerr()
}

fn eng<T>(r: Result<T, EngineError>) -> PyResult<T> {
    r.map_err(ToPyErr::to_pyerr)
}

// ---------------------------------------------------------------------------------------------
// Devices

/// The devices `tensor()` resolves names against: the last inventory made by `use_devices` or
/// a `Model(devices=...)`, else the real machine's (`cpu` plus any CUDA devices).
static REGISTRY: Mutex<Option<Inventory>> = Mutex::new(None);

fn registry() -> MutexGuard<'static, Option<Inventory>> {
    REGISTRY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The devices of `spec`, or with `None` the real inventory: `cpu` at MemAvailable plus every
/// CUDA device the kernels' backend reports (the same devices as `weightlift.devices()`, less
/// `disk`; none in a build without the `cuda` feature).
fn inventory_for(devices: Option<&str>) -> PyResult<Inventory> {
    let inv = match devices {
        Some(spec) => eng(Inventory::parse(spec))?,
        None => eng(Inventory::detect())?,
    };
    *registry() = Some(inv.clone());
    Ok(inv)
}

fn resolve_device(name: &str) -> PyResult<Arc<Device>> {
    let mut reg = registry();
    let inv = match reg.clone() {
        Some(inv) => inv,
        None => {
            let inv = eng(Inventory::detect())?;
            *reg = Some(inv.clone());
            inv
        }
    };
    drop(reg);
    inv.get(name).map_err(|_| {
        let known: Vec<String> = inv.all().iter().map(|d| d.name().to_owned()).collect();
        raise(
            Exc::Device,
            format!(
                "no device '{name}' (known: {}); create devices with use_devices('virtual:2x64MiB') or Model(..., devices=...)",
                known.join(", ")
            ),
        )
    })
}

/// Create the devices of `spec` (e.g. `"virtual:2x64MiB"`; `cpu` is always there) and make them
/// the ones `tensor()` places on. Returns `[(name, capacity or None)]`.
#[pyfunction]
fn use_devices(spec: &str) -> PyResult<Vec<(String, Option<u64>)>> {
    let inv = inventory_for(Some(spec))?;
    Ok(inv
        .all()
        .iter()
        .map(|d| (d.name().to_owned(), d.capacity()))
        .collect())
}

fn numpy_dtype(d: DType) -> (&'static str, bool) {
    // (numpy dtype, exact): types numpy has no dtype for come back as raw unsigned words.
    match d {
        DType::F32 => ("float32", true),
        DType::F16 => ("float16", true),
        DType::F64 => ("float64", true),
        DType::I8 => ("int8", true),
        DType::I16 => ("int16", true),
        DType::I32 => ("int32", true),
        DType::I64 => ("int64", true),
        DType::U8 => ("uint8", true),
        DType::U16 => ("uint16", true),
        DType::U32 => ("uint32", true),
        DType::U64 => ("uint64", true),
        DType::BOOL => ("bool", true),
        DType::BF16 => ("uint16", false),
        _ => ("uint8", false),
    }
}

fn dtype_of_numpy(name: &str) -> PyResult<DType> {
    Ok(match name {
        "float32" => DType::F32,
        "float16" => DType::F16,
        "float64" => DType::F64,
        "int8" => DType::I8,
        "int16" => DType::I16,
        "int32" => DType::I32,
        "int64" => DType::I64,
        "uint8" => DType::U8,
        "uint16" => DType::U16,
        "uint32" => DType::U32,
        "uint64" => DType::U64,
        "bool" => DType::BOOL,
        _ => {
            return Err(PyTypeError::new_err(format!(
                "numpy dtype {name} has no weightlift dtype"
            )));
        }
    })
}

/// Bytes as a numpy array: plain types get their dtype and `shape`; quantised blocks come back
/// as `uint8` rows (`shape[:-1] + (row bytes,)`, as gguf-py's reader shows them) and BF16 as
/// `uint16`.
fn to_numpy<'py>(
    py: Python<'py>,
    bytes: &[u8],
    dtype: DType,
    shape: &[u64],
) -> PyResult<Bound<'py, PyAny>> {
    let np = py.import("numpy")?;
    let (name, _) = numpy_dtype(dtype);
    let mut dims: Vec<u64> = shape.to_vec();
    if dtype.block_size() > 1
        && let Some(last) = dims.last_mut()
    {
        *last = dtype.bytes_for(*last).unwrap_or(0);
    }
    let buf = PyBytes::new(py, bytes);
    let arr = np.call_method1("frombuffer", (buf, name))?;
    arr.call_method1("reshape", (PyTuple::new(py, dims)?,))?
        .call_method0("copy")
}

/// A tensor held on a device. `numpy()` copies it back to the host.
#[pyclass(module = "weightlift._native", frozen)]
pub struct DeviceTensor {
    inner: Mutex<Option<we::DeviceTensor>>,
}

impl DeviceTensor {
    fn new(t: we::DeviceTensor) -> Self {
        DeviceTensor {
            inner: Mutex::new(Some(t)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<we::DeviceTensor>> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn with<T>(&self, f: impl FnOnce(&we::DeviceTensor) -> PyResult<T>) -> PyResult<T> {
        match self.lock().as_ref() {
            Some(t) => f(t),
            None => Err(raise(Exc::Device, "this device tensor was freed")),
        }
    }
}

#[pymethods]
impl DeviceTensor {
    /// The device name, e.g. `"virtual:1"`.
    #[getter]
    fn device(&self) -> PyResult<String> {
        self.with(|t| Ok(t.device().name().to_owned()))
    }

    #[getter]
    fn shape(&self) -> PyResult<Vec<u64>> {
        self.with(|t| Ok(t.shape().to_vec()))
    }

    /// The weightlift dtype name (`"F32"`, `"Q4_K"`, ...).
    #[getter]
    fn dtype(&self) -> PyResult<&'static str> {
        self.with(|t| Ok(t.dtype().name()))
    }

    /// Bytes held on the device.
    #[getter]
    fn nbytes(&self) -> PyResult<u64> {
        self.with(|t| Ok(t.nbytes()))
    }

    /// A host copy as a numpy array.
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (bytes, dtype, shape) =
            self.with(|t| Ok((eng(t.to_host())?, t.dtype(), t.shape().to_vec())))?;
        to_numpy(py, &bytes, dtype, &shape)
    }

    /// A copy on another device.
    fn to(&self, device: &str) -> PyResult<DeviceTensor> {
        let dev = resolve_device(device)?;
        self.with(|t| eng(t.copy_to(&dev)).map(DeviceTensor::new))
    }

    /// Release the device memory now.
    fn free(&self) {
        *self.lock() = None;
    }

    fn __repr__(&self) -> String {
        match self.lock().as_ref() {
            Some(t) => format!(
                "DeviceTensor(device='{}', shape={:?}, dtype={})",
                t.device().name(),
                t.shape(),
                t.dtype()
            ),
            None => "DeviceTensor(freed)".into(),
        }
    }
}

/// Copy a numpy array onto `device` (`"cpu"`, `"virtual:0"`, ...). The allocation counts against
/// the device's capacity; past it, `OutOfMemoryError` names the device, the request and what is
/// free.
#[pyfunction]
fn tensor(py: Python<'_>, array: &Bound<'_, PyAny>, device: &str) -> PyResult<DeviceTensor> {
    let np = py.import("numpy")?;
    let arr = np.call_method1("ascontiguousarray", (array,))?;
    let name: String = arr.getattr("dtype")?.getattr("name")?.extract()?;
    let dtype = dtype_of_numpy(&name)?;
    let shape: Vec<u64> = arr.getattr("shape")?.extract()?;
    let bytes: Vec<u8> = arr.call_method0("tobytes")?.extract()?;
    let dev = resolve_device(device)?;
    let t = py.detach(|| we::DeviceTensor::from_host(&dev, shape, dtype, &bytes));
    eng(t).map(DeviceTensor::new)
}

// ---------------------------------------------------------------------------------------------
// Progress and cancellation

/// The progress path of a load: the user's callback and/or a tqdm bar, and signal checks. Runs
/// on the loading thread with the GIL re-acquired only for the call.
struct Reporter {
    callback: Option<Py<PyAny>>,
    /// llama.cpp style: the callback takes one float (the fraction done).
    fraction: bool,
    bar: Option<Py<PyAny>>,
    want_bar: bool,
    last: u64,
    error: Option<PyErr>,
}

impl Reporter {
    fn new(callback: Option<Py<PyAny>>, progress: bool) -> Self {
        Reporter {
            callback,
            fraction: false,
            bar: None,
            want_bar: progress,
            last: 0,
            error: None,
        }
    }

    fn report(&mut self, p: &Progress<'_>) -> bool {
        Python::attach(|py| {
            if let Err(e) = py.check_signals() {
                self.error = Some(e);
                return false;
            }
            if self.want_bar && self.bar.is_none() {
                let bar = py.import("tqdm").and_then(|m| {
                    let kw = PyDict::new(py);
                    kw.set_item("total", p.bytes_total)?;
                    kw.set_item("unit", "B")?;
                    kw.set_item("unit_scale", true)?;
                    kw.set_item("desc", "loading")?;
                    m.getattr("tqdm")?.call((), Some(&kw))
                });
                match bar {
                    Ok(b) => self.bar = Some(b.unbind()),
                    Err(_) => self.want_bar = false,
                }
            }
            if let Some(bar) = &self.bar {
                let _ = bar
                    .bind(py)
                    .call_method1("update", (p.bytes_done.saturating_sub(self.last),));
                if p.bytes_done >= p.bytes_total {
                    let _ = bar.bind(py).call_method0("close");
                }
            }
            self.last = p.bytes_done;
            let Some(cb) = &self.callback else {
                return true;
            };
            let r = if self.fraction {
                let f = if p.bytes_total == 0 {
                    1.0
                } else {
                    p.bytes_done as f64 / p.bytes_total as f64
                };
                cb.bind(py).call1((f,))
            } else {
                cb.bind(py)
                    .call1((p.bytes_done, p.bytes_total, p.tensor, p.device))
            };
            match r {
                Ok(v) => !v.is(&*PyBool::new(py, false)),
                Err(e) => {
                    self.error = Some(e);
                    false
                }
            }
        })
    }

    /// The error to raise: the callback's own exception or KeyboardInterrupt first.
    fn finish(self, r: Result<(), EngineError>) -> PyResult<()> {
        if let Some(bar) = self.bar {
            Python::attach(|py| {
                let _ = bar.bind(py).call_method0("close");
            });
        }
        match (r, self.error) {
            (Ok(()), _) => Ok(()),
            (Err(EngineError::Cancelled { .. }), Some(e)) => Err(e),
            (Err(e), _) => Err(e.to_pyerr()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Model

pub(crate) struct ModelInner {
    pub(crate) model: EModel,
    plan: Option<wp::Plan>,
    dtype: wp::DTypeChoice,
    runtime: wp::RuntimeSpec,
    devices_spec: String,
    /// The sampling seed when a call gives none (`load_gguf(seed=...)`, as `Llama(seed=...)`).
    pub(crate) seed: Option<u64>,
    /// The last generation's timings (`Model.timings`).
    pub(crate) timings: Option<we::Timings>,
}

/// A model: a checkpoint and the devices it may use. Nothing is loaded until `load()`,
/// `load_autosplit()` or `load_tp()`.
#[pyclass(module = "weightlift._native", frozen)]
pub struct Model {
    pub(crate) inner: Mutex<ModelInner>,
    checkpoint: Arc<wf::Checkpoint>,
}

fn runtime_from(obj: Option<&Bound<'_, PyAny>>) -> PyResult<wp::RuntimeSpec> {
    let mut rt = wp::RuntimeSpec::default();
    let Some(o) = obj else { return Ok(rt) };
    if o.is_none() {
        return Ok(rt);
    }
    let get = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        if let Ok(d) = o.cast::<PyDict>() {
            return d.get_item(k);
        }
        Ok(o.getattr(k).ok())
    };
    if let Some(v) = get("max_input_len")? {
        rt.max_input_len = v.extract()?;
    }
    if let Some(v) = get("max_attention_size")? {
        rt.max_attention_size = v.extract()?;
    }
    if let Some(v) = get("max_dq_size")? {
        rt.max_dq_size = v.extract()?;
    }
    if let Some(v) = get("low_mem")? {
        rt.low_mem = v.extract()?;
    }
    Ok(rt)
}

fn size_of(v: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(n) = v.extract::<u64>() {
        return Ok(n);
    }
    let s: String = v.extract().map_err(|_| {
        PyTypeError::new_err("a size must be an int (bytes) or a string such as '512MiB'")
    })?;
    wp::parse_size(&s).map_err(plan_err)
}

/// `(max_seq_len, batch_size, dtype, offload)` from a `Cache`, a `CacheSpec`-like object or a
/// dict.
fn cache_spec_from(o: &Bound<'_, PyAny>) -> PyResult<wp::CacheSpec> {
    if let Ok(c) = o.cast::<Cache>() {
        return Ok(we::planned::cache_spec(c.get().cache.config()));
    }
    let get = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        if let Ok(d) = o.cast::<PyDict>() {
            return d.get_item(k);
        }
        Ok(o.getattr(k).ok())
    };
    let max_seq_len: u64 = get("max_seq_len")?
        .ok_or_else(|| PyTypeError::new_err("cache needs max_seq_len"))?
        .extract()?;
    let batch: u64 = get("batch_size")?
        .map(|v| v.extract())
        .transpose()?
        .unwrap_or(1);
    let dtype: String = get("dtype")?
        .map(|v| v.extract())
        .transpose()?
        .unwrap_or_else(|| "fp16".into());
    let d = wp::CacheDType::parse(&dtype).map_err(plan_err)?;
    let offload: bool = get("offload")?
        .map(|v| v.extract())
        .transpose()?
        .unwrap_or(false);
    Ok(wp::CacheSpec::new(max_seq_len, batch, d).with_offload(offload))
}

/// Apply `weightlift.plan`-style keyword options to a request.
fn apply_plan_options(
    req: &mut PlanRequest,
    inv: &Inventory,
    opts: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    let Some(opts) = opts else { return Ok(()) };
    let accel: Vec<String> = inv
        .accelerators()
        .iter()
        .map(|d| d.name().to_owned())
        .collect();
    let dev_name = |k: &Bound<'_, PyAny>| -> PyResult<String> {
        if let Ok(i) = k.extract::<usize>() {
            return accel.get(i).cloned().ok_or_else(|| {
                PyValueError::new_err(format!(
                    "device index {i}: there are {} accelerators",
                    accel.len()
                ))
            });
        }
        k.extract::<String>()
    };
    let mut layers = wp::LayerOptions::default();
    let mut layered = false;
    for (k, v) in opts.iter() {
        let key: String = k.extract()?;
        if v.is_none() {
            continue;
        }
        match key.as_str() {
            "strategy" => {
                let s: String = v.extract()?;
                req.strategy = Strategy::parse(&s).map_err(plan_err)?;
                layered |= matches!(req.strategy, Strategy::Layers(_));
            }
            "cache" => req.cache = Some(cache_spec_from(&v)?),
            "runtime" => req.runtime = runtime_from(Some(&v))?,
            "dtype" => {
                req.dtype = wp::DTypeChoice::parse(&v.extract::<String>()?).map_err(plan_err)?
            }
            "allow_disk" => req.allow_disk = v.extract()?,
            "reserve" | "reserve_vram" => {
                if let Ok(d) = v.cast::<PyDict>() {
                    for (dk, dv) in d.iter() {
                        req.reserve.insert(dev_name(&dk)?, size_of(&dv)?);
                    }
                } else {
                    let list: Vec<Bound<'_, PyAny>> = v.extract()?;
                    let sizes = list.iter().map(size_of).collect::<PyResult<Vec<u64>>>()?;
                    *req = req.clone().with_reserve_list(&sizes).map_err(plan_err)?;
                }
            }
            "max_memory" => {
                let d = v.cast::<PyDict>().map_err(|_| {
                    PyTypeError::new_err("max_memory must be a dict of device -> size")
                })?;
                for (dk, dv) in d.iter() {
                    req.max_memory.insert(dev_name(&dk)?, size_of(&dv)?);
                }
            }
            "n_gpu_layers" => {
                layers.n_gpu_layers = v.extract()?;
                layered = true;
            }
            "split_mode" => {
                layers.split_mode =
                    wp::SplitMode::parse(&v.extract::<String>()?).map_err(plan_err)?;
                layered = true;
            }
            "tensor_split" => {
                layers.tensor_split = v.extract()?;
                layered = true;
            }
            "main_gpu" => {
                layers.main_gpu = v.extract()?;
                layered = true;
            }
            "device_map" => {
                if let Ok(s) = v.extract::<String>() {
                    req.strategy = match s.as_str() {
                        "auto" | "balanced" => Strategy::Balanced,
                        "sequential" | "balanced_low_0" => Strategy::parse(&s).map_err(plan_err)?,
                        dev => Strategy::Map(wp::DeviceMap {
                            entries: vec![(String::new(), dev.to_owned())],
                            overrides: Vec::new(),
                        }),
                    };
                } else {
                    let d = v.cast::<PyDict>().map_err(|_| PyTypeError::new_err("device_map must be 'auto', 'balanced', 'sequential', 'balanced_low_0', a device name or a dict"))?;
                    let mut m = wp::DeviceMap::default();
                    for (dk, dv) in d.iter() {
                        let dev = dev_name(&dv)?;
                        let key: String = dk.extract()?;
                        match key.strip_prefix("re:") {
                            Some(pat) => m.overrides.push((pat.to_owned(), dev)),
                            None => m.entries.push((key, dev)),
                        }
                    }
                    req.strategy = Strategy::Map(m);
                }
            }
            "gpu_split" => {
                let gb: Vec<f64> = v.extract()?;
                let mib = gb.iter().map(|g| (g * 1024.0).round() as u64).collect();
                req.strategy = Strategy::TensorParallel(wp::TpOptions {
                    gpu_split_mib: Some(mib),
                });
            }
            _ => {
                return Err(PyTypeError::new_err(format!(
                    "unknown plan option '{key}'; known: strategy, cache, runtime, dtype, allow_disk, reserve, max_memory, \
                     n_gpu_layers, split_mode, tensor_split, main_gpu, device_map, gpu_split"
                )));
            }
        }
    }
    if layered && matches!(req.strategy, Strategy::Layers(_) | Strategy::Autosplit) {
        req.strategy = Strategy::Layers(layers);
    }
    Ok(())
}

impl Model {
    pub(crate) fn lock(&self) -> PyResult<MutexGuard<'_, ModelInner>> {
        match self.inner.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(PyRuntimeError::new_err(
                "the model is busy (a load is running on another thread)",
            )),
        }
    }

    fn open_source(source: &Bound<'_, PyAny>) -> PyResult<Arc<wf::Checkpoint>> {
        if let Ok(c) = source.cast::<crate::format::Checkpoint>() {
            return c.get().shared();
        }
        let path: PathBuf = source.extract().map_err(|_| {
            PyTypeError::new_err("source must be a weightlift.Checkpoint or a path")
        })?;
        let py = source.py();
        let ckpt = py.detach(|| wf::Checkpoint::open(&path, wf::OpenOptions::default()));
        ckpt.map(Arc::new).map_err(ToPyErr::to_pyerr)
    }

    /// Plan (unless a plan is given) and load, with the GIL released.
    #[allow(clippy::too_many_arguments)]
    fn run_load(
        &self,
        py: Python<'_>,
        plan: Option<wp::Plan>,
        mut req_fn: impl FnMut(&mut PlanRequest, &Inventory) -> PyResult<()>,
        cache: Option<Arc<ECache>>,
        opts: LoadOptions,
        mut reporter: Reporter,
    ) -> PyResult<()> {
        let mut inner = self.lock()?;
        let plan = match plan {
            Some(p) => p,
            None => {
                let mut req = eng(inner.model.plan_request())?;
                req.dtype = inner.dtype;
                req.runtime = inner.runtime;
                req.use_mmap = opts.use_mmap;
                req.staging_bytes = opts.staging_bytes as u64;
                if let Some(c) = &cache {
                    // Offloaded, the plan charges the whole cache to the cpu and the prefetch
                    // slots to each layer device, as the cache allocates them.
                    req.cache = Some(we::planned::cache_spec(c.config()));
                }
                let inv = inner.model.inventory().clone();
                req_fn(&mut req, &inv)?;
                py.detach(|| wp::plan(&req)).map_err(plan_err)?
            }
        };
        let placement = eng(inner.model.placement(&plan))?;
        let inner_ref = &mut *inner;
        let r = py.detach(|| {
            inner_ref
                .model
                .load(&placement, &opts, cache.as_ref(), true, &mut |p| {
                    reporter.report(p)
                })
        });
        reporter.finish(r)?;
        inner.plan = Some(plan);
        Ok(())
    }
}

fn load_options(
    use_mmap: bool,
    use_direct_io: bool,
    check_tensors: bool,
    staging_bytes: Option<u64>,
) -> LoadOptions {
    let mut o = LoadOptions {
        use_mmap,
        use_direct_io,
        check_tensors,
        ..LoadOptions::default()
    };
    if let Some(s) = staging_bytes {
        o.staging_bytes = s as usize;
    }
    o
}

fn plan_from_obj(plan: &Bound<'_, PyAny>) -> PyResult<wp::Plan> {
    let json: String = if let Ok(s) = plan.extract::<String>() {
        s
    } else {
        plan.call_method0("to_json")?.extract()?
    };
    wp::Plan::from_json(&json).map_err(plan_err)
}

fn cache_arg(cache: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Arc<ECache>>> {
    match cache {
        None => Ok(None),
        Some(c) if c.is_none() => Ok(None),
        Some(c) => Ok(Some(Arc::clone(
            &c.cast::<Cache>()
                .map_err(|_| PyTypeError::new_err("cache must be a weightlift.Cache"))?
                .get()
                .cache,
        ))),
    }
}

#[pymethods]
impl Model {
    /// `source`: a `Checkpoint` or a path. `devices`: the accelerator inventory as a spec
    /// (`"virtual:2x64MiB"`, `"cuda:0,cuda:1"`); `cpu` is always available. `None` is the real
    /// machine: `cpu` plus every CUDA device found (in a build with the `cuda` feature). `dtype`: `"auto"`
    /// keeps stored dtypes, `"float16"` converts F32/BF16 weights. `runtime`: a `RuntimeSpec`
    /// or dict (`max_input_len`, `max_attention_size`, `max_dq_size`, `low_mem`). `compute`:
    /// `"fast"` (8-bit activations with quantised weights, as llama.cpp) or `"exact"` (f32 on
    /// dequantised weights). `n_threads`: the forward pass's threads (default: physical cores).
    #[new]
    #[pyo3(signature = (source, *, devices = None, dtype = "auto", runtime = None, compute = "fast", n_threads = None))]
    fn new(
        source: &Bound<'_, PyAny>,
        devices: Option<&str>,
        dtype: &str,
        runtime: Option<&Bound<'_, PyAny>>,
        compute: &str,
        n_threads: Option<usize>,
    ) -> PyResult<Self> {
        let compute = eng(we::forward::Compute::parse(compute))?;
        let ckpt = Model::open_source(source)?;
        let inv = inventory_for(devices)?;
        let dtype = wp::DTypeChoice::parse(dtype).map_err(plan_err)?;
        let runtime = runtime_from(runtime)?;
        let src: Arc<dyn we::Source> = Arc::clone(&ckpt) as Arc<dyn we::Source>;
        let devices_spec = devices.map_or_else(|| inv.spec(), str::to_owned);
        let mut model = EModel::new(src, inv);
        model.set_compute(compute);
        if let Some(n) = n_threads {
            eng(model.set_threads(n))?;
        }
        Ok(Model {
            inner: Mutex::new(ModelInner {
                model,
                plan: None,
                dtype,
                runtime,
                devices_spec,
                seed: None,
                timings: None,
            }),
            checkpoint: ckpt,
        })
    }

    /// Load by `plan` (a `Plan` or its JSON), or plan now with `plan_options` (the keywords of
    /// `weightlift.plan`: strategy, cache, reserve, max_memory, n_gpu_layers, split_mode,
    /// tensor_split, main_gpu, device_map, allow_disk, dtype, runtime). A lazy `cache` is
    /// allocated layer by layer beside each layer.
    ///
    /// `callback(bytes_done, bytes_total, tensor, device)` returning False cancels: everything
    /// is freed and `LoadCancelled` is raised. Ctrl-C raises KeyboardInterrupt the same way.
    #[pyo3(signature = (plan = None, *, progress = false, callback = None, cache = None, use_mmap = true,
                        use_direct_io = false, check_tensors = false, staging_bytes = None, **plan_options))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        &self,
        py: Python<'_>,
        plan: Option<&Bound<'_, PyAny>>,
        progress: bool,
        callback: Option<Py<PyAny>>,
        cache: Option<&Bound<'_, PyAny>>,
        use_mmap: bool,
        use_direct_io: bool,
        check_tensors: bool,
        staging_bytes: Option<u64>,
        plan_options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let plan = plan
            .filter(|p| !p.is_none())
            .map(plan_from_obj)
            .transpose()?;
        // A Cache is allocated lazily during the load; a CacheSpec (or dict) makes the model
        // allocate one of that shape itself, so what is held matches the plan.
        let cache = match cache.filter(|c| !c.is_none()) {
            Some(c) if c.cast::<Cache>().is_err() => {
                let spec = cache_spec_from(c)?;
                let inner = self.lock()?;
                let dtype = spec.dtype;
                let cfg = eng(inner.model.cache_config(
                    spec.max_seq_len,
                    spec.batch_size,
                    dtype,
                    spec.offload,
                ))?;
                Some(Arc::new(eng(ECache::new(cfg))?))
            }
            other => cache_arg(other)?,
        };
        let opts = load_options(use_mmap, use_direct_io, check_tensors, staging_bytes);
        self.run_load(
            py,
            plan,
            |req, inv| apply_plan_options(req, inv, plan_options),
            cache,
            opts,
            Reporter::new(callback, progress),
        )
    }

    /// exllamav2's `load_autosplit`: fill the accelerators in order, each layer's cache beside
    /// it, keeping `reserve_vram` (a list in device order, bytes or strings) free.
    #[pyo3(signature = (cache = None, reserve_vram = None, *, progress = false, callback = None))]
    fn load_autosplit(
        &self,
        py: Python<'_>,
        cache: Option<&Bound<'_, PyAny>>,
        reserve_vram: Option<&Bound<'_, PyAny>>,
        progress: bool,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let cache = cache_arg(cache)?;
        let reserves: Vec<u64> = match reserve_vram.filter(|r| !r.is_none()) {
            Some(r) => r
                .extract::<Vec<Bound<'_, PyAny>>>()?
                .iter()
                .map(size_of)
                .collect::<PyResult<_>>()?,
            None => Vec::new(),
        };
        self.run_load(
            py,
            None,
            |req, _| {
                req.strategy = Strategy::Autosplit;
                *req = req.clone().with_reserve_list(&reserves).map_err(plan_err)?;
                Ok(())
            },
            cache,
            LoadOptions::default(),
            Reporter::new(callback, progress),
        )
    }

    /// exllamav2's `load_tp`: weights split over the accelerators by the TPContext tables.
    /// `gpu_split` in GB per device (None: each device's free memory); the expected cache
    /// (`expect_cache_tokens`, 0 = the model's context length; `expect_cache_base` a cache dtype)
    /// is subtracted when splitting.
    #[pyo3(signature = (gpu_split = None, expect_cache_tokens = 0, expect_cache_base = None, *, progress = false, callback = None))]
    fn load_tp(
        &self,
        py: Python<'_>,
        gpu_split: Option<Vec<f64>>,
        expect_cache_tokens: u64,
        expect_cache_base: Option<&str>,
        progress: bool,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let ctx = self
            .checkpoint
            .spec()
            .map(|s| s.context_length)
            .unwrap_or(2048);
        let tokens = if expect_cache_tokens == 0 {
            ctx
        } else {
            expect_cache_tokens
        };
        let base = wp::CacheDType::parse(expect_cache_base.unwrap_or("fp16")).map_err(plan_err)?;
        self.run_load(
            py,
            None,
            |req, _| {
                let mib = gpu_split
                    .as_ref()
                    .map(|g| g.iter().map(|x| (x * 1024.0).round() as u64).collect());
                req.strategy = Strategy::TensorParallel(wp::TpOptions { gpu_split_mib: mib });
                req.cache = Some(wp::CacheSpec::new(tokens, 1, base));
                Ok(())
            },
            None,
            LoadOptions::default(),
            Reporter::new(callback, progress),
        )
    }

    /// Free every tensor and cache layer this model holds.
    fn unload(&self, py: Python<'_>) -> PyResult<()> {
        let mut inner = self.lock()?;
        let inner_ref = &mut *inner;
        py.detach(|| inner_ref.model.unload());
        inner.plan = None;
        Ok(())
    }

    #[getter]
    fn loaded(&self) -> PyResult<bool> {
        Ok(self.lock()?.model.is_loaded())
    }

    /// The plan of the last load (a `weightlift.Plan` when the plan bindings are present, else
    /// its JSON as a dict), or None.
    #[getter]
    fn plan<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(json) = self.lock()?.plan.as_ref().map(wp::Plan::to_json) else {
            return Ok(None);
        };
        let native = py.import("weightlift._native")?;
        if let Ok(cls) = native.getattr("Plan")
            && let Ok(p) = cls.call_method1("from_json", (json.as_str(),))
        {
            return Ok(Some(p));
        }
        Ok(Some(py.import("json")?.call_method1("loads", (json,))?))
    }

    /// The last plan as JSON (None before a load).
    fn plan_json(&self) -> PyResult<Option<String>> {
        Ok(self.lock()?.plan.as_ref().map(wp::Plan::to_json))
    }

    /// Bytes held per device: weights (mmap views count on `cpu`), cache layers, scratch.
    fn memory(&self) -> PyResult<HashMap<String, u64>> {
        Ok(self.lock()?.model.memory().into_iter().collect())
    }

    /// Bytes allocated right now per device (arena accounting; mmap views are not allocations).
    fn device_usage(&self) -> PyResult<HashMap<String, u64>> {
        Ok(self.lock()?.model.device_usage().into_iter().collect())
    }

    /// The device spec this model was made with (with `devices=None`, the detected machine's,
    /// e.g. `"cuda:0,cpu"`).
    #[getter]
    fn devices(&self) -> PyResult<String> {
        Ok(self.lock()?.devices_spec.clone())
    }

    /// Bytes of memory-mapped tensors locked in RAM (`use_mlock`).
    #[getter]
    fn locked_bytes(&self) -> PyResult<u64> {
        Ok(self.lock()?.model.locked_bytes())
    }

    /// Warnings from the last load (O_DIRECT fallback, unvalidated architecture, ...).
    #[getter]
    fn warnings(&self) -> PyResult<Vec<String>> {
        Ok(self.lock()?.model.warnings().to_vec())
    }

    /// The device of a tensor; a split tensor gives its devices joined by commas.
    fn device_of(&self, name: &str) -> PyResult<String> {
        eng(self.lock()?.model.device_of(name))
    }

    /// The device of each layer.
    #[getter]
    fn layer_devices(&self) -> PyResult<Vec<String>> {
        Ok(eng(self.lock()?.model.layer_devices())?.to_vec())
    }

    /// A numpy copy of a tensor from wherever it lives (split tensors are reassembled, CUDA
    /// memory is copied back). Raw quantised blocks come back as uint8 rows; `dequantize=True`
    /// gives float32, decoded at most `runtime.max_dq_size` values at a time so transient
    /// buffers stay within that chunk limit.
    #[pyo3(signature = (name, dequantize = false))]
    fn tensor<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        dequantize: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.lock()?;
        if dequantize {
            let max_dq = inner.runtime.max_dq_size;
            let model = &inner.model;
            let d = eng(py.detach(|| model.dequantized(name, max_dq)))?;
            drop(inner);
            let arr = PyArray1::from_vec(py, d.values);
            return arr.call_method1("reshape", (PyTuple::new(py, d.shape)?,));
        }
        let (bytes, dtype, shape) = eng(inner.model.tensor_bytes(name))?;
        drop(inner);
        to_numpy(py, &bytes, dtype, &shape)
    }

    fn __repr__(&self) -> String {
        match self.inner.try_lock() {
            Ok(i) => format!(
                "Model('{}', devices='{}', loaded={})",
                self.checkpoint.path().display(),
                i.devices_spec,
                i.model.is_loaded()
            ),
            Err(_) => format!("Model('{}', loading)", self.checkpoint.path().display()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Cache

/// A KV cache for a model. `dtype`: fp16, fp8 (e4m3), q8, q6 (8-bit K, 4-bit V) or q4, the
/// quantised ones with one f16 scale per 32 values. A lazy cache is allocated during the load,
/// layer by layer on each layer's device; on a loaded model it is allocated at once. `offload`
/// keeps it in host RAM and prefetches the next layer to its device on a second thread.
#[pyclass(module = "weightlift._native", frozen)]
pub struct Cache {
    pub(crate) cache: Arc<ECache>,
}

#[pymethods]
impl Cache {
    #[new]
    #[pyo3(signature = (model, max_seq_len, batch_size = 1, dtype = "fp16", lazy = true, offload = false))]
    fn new(
        model: &Bound<'_, Model>,
        max_seq_len: u64,
        batch_size: u64,
        dtype: &str,
        lazy: bool,
        offload: bool,
    ) -> PyResult<Self> {
        let d = CacheDType::parse(dtype).map_err(plan_err)?;
        let m = model.get();
        let mut inner = m.lock()?;
        let cfg = eng(inner
            .model
            .cache_config(max_seq_len, batch_size, d, offload))?;
        let cache = Arc::new(eng(ECache::new(cfg))?);
        if inner.model.is_loaded() {
            eng(inner.model.attach_cache(&cache))?;
        } else if !lazy {
            return Err(raise(
                Exc::Weightlift,
                "a non-lazy cache needs a loaded model; load the model first or pass lazy=True and hand the cache to load_autosplit()",
            ));
        }
        Ok(Cache { cache })
    }

    #[getter]
    fn max_seq_len(&self) -> u64 {
        self.cache.config().max_seq_len
    }

    #[getter]
    fn batch_size(&self) -> u64 {
        self.cache.config().batch_size
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        self.cache.config().dtype.name()
    }

    #[getter]
    fn offload(&self) -> bool {
        self.cache.config().offload
    }

    #[getter]
    fn allocated(&self) -> bool {
        self.cache.is_allocated()
    }

    /// Tokens held: where the next `Model.forward(ids, cache=...)` appends.
    #[getter]
    fn seq_len(&self) -> u64 {
        self.cache.seq_len()
    }

    /// Forget every token (the memory stays allocated).
    fn reset(&self) {
        self.cache.reset();
    }

    /// Bytes held per device: the layers, and an offloaded cache's prefetch slots.
    fn memory(&self) -> HashMap<String, u64> {
        self.cache.memory().into_iter().collect()
    }

    /// What `memory()` should hold for the devices the layers were allocated for: each layer's
    /// K and V on its device; offloaded, every layer on `cpu` plus, on each layer device, two
    /// prefetch slots of its largest layer (one when it computes a single layer). A plan made
    /// for this cache predicts the same bytes in its kv column.
    fn expected_memory(&self) -> PyResult<HashMap<String, u64>> {
        Ok(eng(self.cache.expected_memory())?.into_iter().collect())
    }

    /// The device layer `layer` computes on (and, unless offloaded, lives on).
    fn device_of(&self, layer: usize) -> PyResult<String> {
        eng(self.cache.device_of(layer))
    }

    /// Write `k` and `v` (float32, `(batch, n_kv_heads, n_tokens, head_dim)`) at position `pos`.
    fn write(
        &self,
        py: Python<'_>,
        layer: usize,
        pos: u64,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let np = py.import("numpy")?;
        let kk = np.call_method1("ascontiguousarray", (k, "float32"))?;
        let vv = np.call_method1("ascontiguousarray", (v, "float32"))?;
        let shape: Vec<u64> = kk.getattr("shape")?.extract()?;
        let vshape: Vec<u64> = vv.getattr("shape")?.extract()?;
        let cfg = self.cache.config();
        let heads = cfg.n_kv_heads.get(layer).copied().unwrap_or(0);
        if shape.len() != 4
            || shape != vshape
            || shape[0] != cfg.batch_size
            || shape[1] != u64::from(heads)
            || shape[3] != u64::from(cfg.head_dim)
        {
            return Err(PyValueError::new_err(format!(
                "k and v must both be float32 ({}, {heads}, n_tokens, {}); got {shape:?} and {vshape:?}",
                cfg.batch_size, cfg.head_dim
            )));
        }
        let ka: PyReadonlyArrayDyn<'_, f32> = kk.extract()?;
        let va: PyReadonlyArrayDyn<'_, f32> = vv.extract()?;
        let ks = ka
            .as_slice()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let vs = va
            .as_slice()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        eng(self.cache.write(layer, pos, shape[2], ks, vs))
    }

    /// Read positions `start..end` back as float32 `(k, v)`, each
    /// `(batch, n_kv_heads, end - start, head_dim)`.
    fn read<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        start: u64,
        end: u64,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let (k, v) = eng(self.cache.read(layer, start, end))?;
        let cfg = self.cache.config();
        let heads = cfg.n_kv_heads.get(layer).copied().unwrap_or(0);
        let shape = PyTuple::new(
            py,
            [
                cfg.batch_size,
                u64::from(heads),
                end - start,
                u64::from(cfg.head_dim),
            ],
        )?;
        let k = PyArray1::from_vec(py, k).call_method1("reshape", (&shape,))?;
        let v = PyArray1::from_vec(py, v).call_method1("reshape", (&shape,))?;
        Ok((k, v))
    }

    /// Offload: copy `layer` to its device (taking the prefetched copy when there is one) and
    /// start prefetching the next layer on a second thread. Returns the device name.
    fn fetch(&self, py: Python<'_>, layer: usize) -> PyResult<String> {
        let c = Arc::clone(&self.cache);
        let r = py.detach(|| c.fetch(layer));
        let r = eng(r)?;
        Ok(r.k.device().name().to_owned())
    }

    /// Free every layer.
    fn free(&self) {
        self.cache.free();
    }

    fn __repr__(&self) -> String {
        let c = self.cache.config();
        format!(
            "Cache(max_seq_len={}, batch_size={}, dtype='{}', offload={})",
            c.max_seq_len,
            c.batch_size,
            c.dtype.name(),
            c.offload
        )
    }
}

// ---------------------------------------------------------------------------------------------
// TPContext

/// exllamav2's `TPContext`: the five split tables (from the planner), collectives over the
/// accelerators (host-staged copies; real copies between virtual arenas), per-device RoPE
/// tables and scratch.
#[pyclass(module = "weightlift._native", frozen, name = "TPContext")]
pub struct TPContext {
    ctx: Mutex<TpContext>,
    cpu: Arc<Device>,
    staging_bytes: u64,
    _model: Py<Model>,
}

fn tensors_of(list: &Bound<'_, PyAny>) -> PyResult<Vec<Py<DeviceTensor>>> {
    let list: Vec<Bound<'_, PyAny>> = list.extract()?;
    list.iter()
        .map(|t| {
            t.cast::<DeviceTensor>()
                .map(|b| b.clone().unbind())
                .map_err(|_| PyTypeError::new_err("expected a list of DeviceTensor"))
        })
        .collect()
}

impl TPContext {
    fn lock(&self) -> MutexGuard<'_, TpContext> {
        self.ctx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[pymethods]
impl TPContext {
    /// `gpu_split`: GB per accelerator (None: each device's free memory). `expect_cache_tokens`
    /// (0: the model's context length × batch 1) of `expect_cache_base` (a cache dtype) are
    /// subtracted before splitting, as exllamav2 does.
    #[new]
    #[pyo3(signature = (model, gpu_split = None, expect_cache_tokens = 0, expect_cache_base = None))]
    fn new(
        py: Python<'_>,
        model: &Bound<'_, Model>,
        gpu_split: Option<Vec<f64>>,
        expect_cache_tokens: u64,
        expect_cache_base: Option<&str>,
    ) -> PyResult<Self> {
        let m = model.get();
        let inner = m.lock()?;
        let spec = m.checkpoint.spec().map_err(|e| {
            raise(
                Exc::Unsupported,
                format!("tensor parallelism needs the architecture: {e}"),
            )
        })?;
        let tokens = if expect_cache_tokens == 0 {
            spec.context_length
        } else {
            expect_cache_tokens
        };
        let base = wp::CacheDType::parse(expect_cache_base.unwrap_or("fp16")).map_err(plan_err)?;
        // Reuse a TP plan from load_tp; otherwise plan the split now.
        let tp = match inner.plan.as_ref().and_then(|p| p.tp()) {
            Some(tp) if gpu_split.is_none() => tp.clone(),
            _ => {
                let mut req = eng(inner.model.plan_request())?;
                req.runtime = inner.runtime;
                let mib = gpu_split
                    .as_ref()
                    .map(|g| g.iter().map(|x| (x * 1024.0).round() as u64).collect());
                req.strategy = Strategy::TensorParallel(wp::TpOptions { gpu_split_mib: mib });
                req.cache = Some(wp::CacheSpec::new(tokens, 1, base));
                let plan = py.detach(|| wp::plan(&req)).map_err(plan_err)?;
                plan.tp().cloned().ok_or_else(|| {
                    raise(
                        Exc::Weightlift,
                        "the planner returned no tensor-parallel tables",
                    )
                })?
            }
        };
        let devices = inner.model.inventory().accelerators().to_vec();
        let cpu = Arc::clone(inner.model.inventory().cpu());
        let rope = Rope {
            theta: spec.rope_theta,
            dim: spec.rope_dim,
            head_dim: spec.head_dim,
            max_seq_len: tokens.min(spec.context_length.max(1)),
        };
        let ctx = eng(TpContext::new(
            we::planned::splits(&tp),
            devices,
            rope,
            Box::new(HostStaged),
        ))?;
        // exllamav2 sizes its pinned temps as max(max_input_len × vocab, max_input_len × intermediate)
        // halves.
        let rt = inner.runtime;
        let staging_bytes = rt
            .max_input_len
            .saturating_mul(spec.vocab_size.max(spec.intermediate_size))
            .saturating_mul(2);
        drop(inner);
        Ok(TPContext {
            ctx: Mutex::new(ctx),
            cpu,
            staging_bytes,
            _model: model.clone().unbind(),
        })
    }

    #[getter]
    fn kv_split(&self) -> Vec<(usize, u64, u64)> {
        self.lock().splits().kv.clone()
    }
    #[getter]
    fn id_split(&self) -> Vec<(usize, u64, u64)> {
        self.lock().splits().id.clone()
    }
    #[getter]
    fn vc_split(&self) -> Vec<(usize, u64, u64)> {
        self.lock().splits().vc.clone()
    }
    #[getter]
    fn rs_split(&self) -> Vec<(usize, u64, u64)> {
        self.lock().splits().rs.clone()
    }
    #[getter]
    fn q_split(&self) -> Vec<(usize, u64, u64)> {
        self.lock().splits().q.clone()
    }

    fn get_split(&self, broadcast_type: usize) -> PyResult<Vec<(usize, u64, u64)>> {
        eng(self.lock().get_split(broadcast_type).cloned())
    }

    fn get_devs(&self, broadcast_type: usize) -> PyResult<Vec<usize>> {
        eng(self.lock().get_devs(broadcast_type))
    }

    fn all_devices(&self) -> Vec<usize> {
        self.lock().all_devices()
    }

    /// The device name of table index `i`.
    fn device_name(&self, i: usize) -> PyResult<String> {
        eng(self.lock().device(i).map(|d| d.name().to_owned()))
    }

    /// Allocate the two host staging buffers (exllamav2's pinned temps).
    fn finalize(&self) -> PyResult<()> {
        eng(self.lock().finalize(&self.cpu, self.staging_bytes))
    }

    fn unload(&self) {
        self.lock().unload();
    }

    /// One copy of `tensor` on each device of table `broadcast_type`.
    #[pyo3(signature = (buffer, tensor, broadcast_type, dim = 1))]
    fn broadcast(
        &self,
        buffer: usize,
        tensor: &Bound<'_, DeviceTensor>,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<Vec<DeviceTensor>> {
        let ctx = self.lock();
        tensor.get().with(|t| {
            eng(ctx.broadcast(buffer, t, broadcast_type, dim))
                .map(|v| v.into_iter().map(DeviceTensor::new).collect())
        })
    }

    /// Concatenate per-device slices (one per device of the table, in order) along the columns
    /// into a host numpy array `(rows, end·dim)`.
    #[pyo3(signature = (buffer, inputs, broadcast_type, dim = 1))]
    fn gather<'py>(
        &self,
        py: Python<'py>,
        buffer: usize,
        inputs: &Bound<'py, PyAny>,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let list = tensors_of(inputs)?;
        let guards: Vec<_> = list.iter().map(|t| t.get().lock()).collect();
        let refs: Vec<&we::DeviceTensor> = guards
            .iter()
            .map(|g| {
                g.as_ref()
                    .ok_or_else(|| raise(Exc::Device, "a gather input was freed"))
            })
            .collect::<PyResult<_>>()?;
        let dtype = refs.first().map_or(DType::F32, |t| t.dtype());
        let (bytes, rows, cols) = eng(self.lock().gather(buffer, &refs, broadcast_type, dim))?;
        drop(guards);
        to_numpy(py, &bytes, dtype, &[rows, cols])
    }

    /// Gather over `broadcast_type_g`, then broadcast the result to table `broadcast_type_b`.
    #[pyo3(signature = (buffer, inputs, broadcast_type_g, broadcast_type_b, dim = 1))]
    fn allgather(
        &self,
        buffer: usize,
        inputs: &Bound<'_, PyAny>,
        broadcast_type_g: usize,
        broadcast_type_b: usize,
        dim: u64,
    ) -> PyResult<Vec<DeviceTensor>> {
        let list = tensors_of(inputs)?;
        let guards: Vec<_> = list.iter().map(|t| t.get().lock()).collect();
        let refs: Vec<&we::DeviceTensor> = guards
            .iter()
            .map(|g| {
                g.as_ref()
                    .ok_or_else(|| raise(Exc::Device, "an allgather input was freed"))
            })
            .collect::<PyResult<_>>()?;
        let out =
            eng(self
                .lock()
                .allgather(buffer, &refs, broadcast_type_g, broadcast_type_b, dim))?;
        Ok(out.into_iter().map(DeviceTensor::new).collect())
    }

    /// On each device `i` of the table: `target[i] += source[i][:, a·dim : b·dim]` (in place).
    #[pyo3(signature = (target, source, broadcast_type, dim = 1))]
    fn add_residual(
        &self,
        target: &Bound<'_, PyAny>,
        source: &Bound<'_, PyAny>,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<()> {
        let targets = tensors_of(target)?;
        let sources = tensors_of(source)?;
        let mut taken = Vec::with_capacity(targets.len());
        for t in &targets {
            match t.get().lock().take() {
                Some(x) => taken.push(x),
                None => {
                    for (t, x) in targets.iter().zip(taken) {
                        *t.get().lock() = Some(x);
                    }
                    return Err(raise(Exc::Device, "an add_residual target was freed"));
                }
            }
        }
        let result = {
            let guards: Vec<_> = sources.iter().map(|t| t.get().lock()).collect();
            let refs: Option<Vec<&we::DeviceTensor>> = guards.iter().map(|g| g.as_ref()).collect();
            match refs {
                Some(refs) => eng(self
                    .lock()
                    .add_residual(&mut taken, &refs, broadcast_type, dim)),
                None => Err(raise(
                    Exc::Device,
                    "an add_residual source was freed (or is also a target)",
                )),
            }
        };
        for (t, x) in targets.iter().zip(taken) {
            *t.get().lock() = Some(x);
        }
        result
    }

    fn wait_streams(&self) -> PyResult<()> {
        eng(self.lock().wait_streams())
    }

    /// Per-device RoPE tables: `(sin, cos)`, two lists of DeviceTensors `(max_seq_len, head_dim)`
    /// f32, one per device of `all_devices()`.
    fn get_sin_cos(&self) -> PyResult<(Vec<DeviceTensor>, Vec<DeviceTensor>)> {
        let mut ctx = self.lock();
        let tables = eng(ctx.get_sin_cos())?;
        let mut sin = Vec::new();
        let mut cos = Vec::new();
        for (s, c) in tables {
            sin.push(DeviceTensor::new(eng(s.copy_to(s.device()))?));
            cos.push(DeviceTensor::new(eng(c.copy_to(c.device()))?));
        }
        Ok((sin, cos))
    }

    fn begin_scratch_alloc_tp(&self) {
        self.lock().begin_scratch_alloc_tp();
    }

    /// Reserve scratch bytes per device index.
    fn reserve_scratch(&self, scratch: Vec<u64>) -> PyResult<()> {
        eng(self.lock().reserve_scratch(&scratch))
    }

    /// One scratch slice per device of the table, `(rows, (b - a)·dim)`: a list of
    /// `(device_index, offset, rows, cols)`.
    #[pyo3(signature = (rows, dtype, broadcast_type, dim = 1))]
    fn get_scratch_slice_tp(
        &self,
        rows: u64,
        dtype: &str,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<Vec<(usize, u64, u64, u64)>> {
        let d = scratch_dtype(dtype)?;
        let s = eng(self
            .lock()
            .get_scratch_slice_tp(rows, d, broadcast_type, dim))?;
        Ok(slice_tuples(s))
    }

    /// One full-width scratch slice per device of the table, `(rows, end·dim)`.
    #[pyo3(signature = (rows, dtype, broadcast_type, dim = 1))]
    fn get_scratch_slice_tp_bc(
        &self,
        rows: u64,
        dtype: &str,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<Vec<(usize, u64, u64, u64)>> {
        let d = scratch_dtype(dtype)?;
        let s = eng(self
            .lock()
            .get_scratch_slice_tp_bc(rows, d, broadcast_type, dim))?;
        Ok(slice_tuples(s))
    }
}

/// Scratch slices as Python tuples `(device_index, offset, rows, cols)`.
fn slice_tuples<S: IntoIterator<Item = weightlift_engine::tp::ScratchSlice>>(
    slices: S,
) -> Vec<(usize, u64, u64, u64)> {
    slices
        .into_iter()
        .map(|x| (x.device, x.offset, x.rows, x.cols))
        .collect()
}

fn scratch_dtype(s: &str) -> PyResult<DType> {
    match s {
        "float16" | "half" | "f16" => Ok(DType::F16),
        "float32" | "float" | "f32" => Ok(DType::F32),
        _ => Err(PyValueError::new_err(format!(
            "scratch dtype must be 'float16' or 'float32', got '{s}'"
        ))),
    }
}

// ---------------------------------------------------------------------------------------------
// Convenience loaders

/// `from_pretrained`'s `device_map`: a strategy or device name (default `"auto"`), or anything
/// else (a dict, or None for `"auto"`), which `apply_plan_options` checks.
#[derive(FromPyObject)]
enum DeviceMapArg<'py> {
    Name(String),
    Other(Bound<'py, PyAny>),
}

/// accelerate style: open `path`, plan with `device_map` (`"auto"` = balanced, `"balanced"`,
/// `"balanced_low_0"`, `"sequential"`, a device name, or a dict of module/layer prefix ->
/// device, with `"re:PATTERN"` keys as llama.cpp `-ot` overrides) and `max_memory`
/// (device -> size), and load. Returns the loaded Model.
// The text signatures are spelled out because PyO3 renders `-1` and non-literal defaults as
// `...`, which `inspect.signature` (and mypy.stubtest against _native.pyi) would report.
#[pyfunction]
#[pyo3(
    signature = (path, *, device_map = DeviceMapArg::Name(String::from("auto")), max_memory = None,
                 dtype = "auto", devices = None, runtime = None, progress = false, callback = None,
                 compute = "fast", n_threads = None),
    text_signature = "(path, *, device_map='auto', max_memory=None, dtype='auto', devices=None, runtime=None, progress=False, callback=None, compute='fast', n_threads=None)"
)]
#[allow(clippy::too_many_arguments)]
fn from_pretrained(
    py: Python<'_>,
    path: &Bound<'_, PyAny>,
    device_map: DeviceMapArg<'_>,
    max_memory: Option<&Bound<'_, PyAny>>,
    dtype: &str,
    devices: Option<&str>,
    runtime: Option<&Bound<'_, PyAny>>,
    progress: bool,
    callback: Option<Py<PyAny>>,
    compute: &str,
    n_threads: Option<usize>,
) -> PyResult<Model> {
    let model = Model::new(path, devices, dtype, runtime, compute, n_threads)?;
    let opts = PyDict::new(py);
    match device_map {
        DeviceMapArg::Name(name) => opts.set_item("device_map", name)?,
        DeviceMapArg::Other(d) if !d.is_none() => opts.set_item("device_map", d)?,
        DeviceMapArg::Other(_) => opts.set_item("device_map", "auto")?,
    }
    if let Some(m) = max_memory.filter(|m| !m.is_none()) {
        opts.set_item("max_memory", m)?;
    }
    model.run_load(
        py,
        None,
        |req, inv| apply_plan_options(req, inv, Some(&opts)),
        None,
        LoadOptions::default(),
        Reporter::new(callback, progress),
    )?;
    Ok(model)
}

/// llama.cpp style: `n_gpu_layers` (-1 all; the last N layers go to the accelerators, the
/// output too when N > n_layer), `split_mode` (`none`, `layer`, `row`), `tensor_split`,
/// `main_gpu`; `use_mmap`, `use_direct_io`, `check_tensors`. `progress_callback(fraction)` is
/// called with the fraction loaded, as in llama.cpp, and returning False cancels
/// (`LoadCancelled`). `vocab_only` opens the metadata and tokenizer only and loads no tensors.
/// `use_mlock` locks the memory-mapped tensors in RAM (a locked-memory limit that refuses is
/// reported in `Model.warnings`).
#[pyfunction]
#[pyo3(signature = (path, *, n_gpu_layers = -1, split_mode = "layer", tensor_split = None, main_gpu = 0,
                    use_mmap = true, use_direct_io = false, use_mlock = false, check_tensors = false,
                    vocab_only = false, progress_callback = None, devices = None, runtime = None,
                    n_ctx = 512, n_batch = 512, type_k = "f16", type_v = "f16", n_threads = None,
                    compute = "fast", seed = None),
       text_signature = "(path, *, n_gpu_layers=-1, split_mode='layer', tensor_split=None, main_gpu=0, use_mmap=True, use_direct_io=False, use_mlock=False, check_tensors=False, vocab_only=False, progress_callback=None, devices=None, runtime=None, n_ctx=512, n_batch=512, type_k='f16', type_v='f16', n_threads=None, compute='fast', seed=None)")]
#[allow(clippy::too_many_arguments)]
fn load_gguf(
    py: Python<'_>,
    path: &Bound<'_, PyAny>,
    n_gpu_layers: i64,
    split_mode: &str,
    tensor_split: Option<Vec<f32>>,
    main_gpu: usize,
    use_mmap: bool,
    use_direct_io: bool,
    use_mlock: bool,
    check_tensors: bool,
    vocab_only: bool,
    progress_callback: Option<Py<PyAny>>,
    devices: Option<&str>,
    runtime: Option<&Bound<'_, PyAny>>,
    n_ctx: u64,
    n_batch: u64,
    type_k: &str,
    type_v: &str,
    n_threads: Option<usize>,
    compute: &str,
    seed: Option<u64>,
) -> PyResult<Model> {
    if vocab_only {
        let p: PathBuf = path.extract()?;
        let ckpt = py
            .detach(|| {
                wf::Checkpoint::open(
                    &p,
                    wf::OpenOptions {
                        check_tensors: false,
                        vocab_only: true,
                    },
                )
            })
            .map_err(ToPyErr::to_pyerr)?;
        let ckpt = Arc::new(ckpt);
        let inv = inventory_for(devices)?;
        let src: Arc<dyn we::Source> = Arc::clone(&ckpt) as Arc<dyn we::Source>;
        let devices_spec = devices.map_or_else(|| inv.spec(), str::to_owned);
        return Ok(Model {
            inner: Mutex::new(ModelInner {
                model: EModel::new(src, inv),
                plan: None,
                dtype: wp::DTypeChoice::Auto,
                runtime: runtime_from(runtime)?,
                devices_spec,
                seed: load_seed(seed),
                timings: None,
            }),
            checkpoint: ckpt,
        });
    }
    let model = Model::new(path, devices, "auto", runtime, compute, n_threads)?;
    let cache_dtype = llama_cache_dtype(type_k, type_v)?;
    let cache = {
        let mut inner = model.lock()?;
        inner.seed = load_seed(seed);
        if runtime.is_none() {
            inner.runtime.max_input_len = n_batch;
        }
        let cfg = eng(inner.model.cache_config(n_ctx, 1, cache_dtype, false))?;
        Arc::new(eng(ECache::new(cfg))?)
    };
    let layers = wp::LayerOptions {
        n_gpu_layers,
        split_mode: wp::SplitMode::parse(split_mode).map_err(plan_err)?,
        tensor_split: tensor_split.unwrap_or_default(),
        main_gpu,
        ..wp::LayerOptions::default()
    };
    let mut reporter = Reporter::new(progress_callback, false);
    reporter.fraction = true;
    let mut opts = load_options(use_mmap, use_direct_io, check_tensors, None);
    opts.mlock = use_mlock;
    let no_accel = model.lock()?.model.inventory().accelerators().is_empty();
    model.run_load(
        py,
        None,
        |req, _| {
            req.strategy = if no_accel {
                Strategy::Map(wp::DeviceMap {
                    entries: vec![(String::new(), "cpu".into())],
                    overrides: Vec::new(),
                })
            } else {
                Strategy::Layers(layers.clone())
            };
            Ok(())
        },
        Some(cache),
        opts,
        reporter,
    )?;
    Ok(model)
}

/// `load_gguf(seed=...)`: llama.cpp's `LLAMA_DEFAULT_SEED` (0xFFFFFFFF) means a random seed.
fn load_seed(seed: Option<u64>) -> Option<u64> {
    seed.filter(|&s| s != u64::from(u32::MAX))
}

/// llama.cpp's `type_k` / `type_v` pair as one cache dtype: equal types, or q8_0 keys with
/// q4_0 values (the q6 cache).
fn llama_cache_dtype(type_k: &str, type_v: &str) -> PyResult<CacheDType> {
    let k = CacheDType::parse(type_k).map_err(plan_err)?;
    let v = CacheDType::parse(type_v).map_err(plan_err)?;
    match (k, v) {
        (a, b) if a == b => Ok(a),
        (CacheDType::Q8, CacheDType::Q4) => Ok(CacheDType::Q6),
        _ => Err(raise(
            Exc::Unsupported,
            format!(
                "cache type_k={type_k}, type_v={type_v}: expected equal types (f32, f16, q8_0, q4_0) or type_k=q8_0 with type_v=q4_0"
            ),
        )),
    }
}

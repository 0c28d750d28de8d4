//! What the planner answers: `Device` (one device of an inventory), and a `Plan` with its
//! `DeviceUsage` and `Placement` rows.

use std::path::PathBuf;

use pyo3::prelude::*;
use weightlift_plan as wp;

use super::{CacheSpec, RuntimeSpec};
use crate::errors::{io_error, py_err};

/// Overhead parts as Python tuples.
fn parts(p: &[wp::OverheadPart]) -> Vec<(String, u64, String)> {
    p.iter()
        .map(|x| (x.name.clone(), x.bytes, x.source.clone()))
        .collect()
}

/// One device of an inventory. `capacity` is None for an unbounded device (`disk`, or `cpu`
/// when its memory is unknown).
#[pyclass(module = "weightlift._native", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct Device {
    /// Normalised name: `"cpu"`, `"cuda:0"`, `"virtual:1"`, `"disk"`.
    #[pyo3(get)]
    name: String,
    /// `"cpu"`, `"cuda"`, `"virtual"` or `"disk"`.
    #[pyo3(get)]
    kind: &'static str,
    /// Bytes, or None when unbounded.
    #[pyo3(get)]
    capacity: Option<u64>,
    #[pyo3(get)]
    reserve: u64,
    /// Bytes of fixed overhead: for `cuda:N` its context and modules, cuBLAS workspace and
    /// graph memory (see `overhead_parts`).
    #[pyo3(get)]
    overhead: u64,
    /// The overhead part by part: `[(name, bytes, where the figure comes from)]`.
    #[pyo3(get)]
    overhead_parts: Vec<(String, u64, String)>,
}

impl From<wp::DeviceSpec> for Device {
    fn from(d: wp::DeviceSpec) -> Self {
        Device {
            kind: d.kind.name(),
            capacity: d.bounded_capacity(),
            reserve: d.reserve,
            overhead: d.overhead.total(),
            overhead_parts: parts(d.overhead.parts()),
            name: d.name,
        }
    }
}

#[pymethods]
impl Device {
    fn __repr__(&self) -> String {
        let capacity = self.capacity.map_or("None".into(), |c| c.to_string());
        format!("Device('{}', capacity={capacity})", self.name)
    }
}

/// A device's share of a plan, in bytes. `capacity` and `free` are None for unbounded devices.
#[pyclass(module = "weightlift._native", frozen, get_all)]
#[derive(Clone)]
pub struct DeviceUsage {
    name: String,
    kind: &'static str,
    capacity: Option<u64>,
    /// Bytes of the weights placed here, after any dtype conversion.
    weights: u64,
    /// Bytes of the KV cache of the layers placed here.
    kv: u64,
    scratch: u64,
    /// Bytes of fixed overhead charged here (0 on a device that holds nothing).
    overhead: u64,
    /// The overhead charged here, part by part: `[(name, bytes, where the figure comes from)]`,
    /// e.g. `("cuda context and modules", 569376768, "measured on this sm_90")`.
    overhead_parts: Vec<(String, u64, String)>,
    reserve: u64,
    free: Option<u64>,
    /// weights + kv + scratch + overhead + reserve.
    used: u64,
    /// Inclusive layer ranges placed here, e.g. `[(0, 11)]`.
    layers: Vec<(u32, u32)>,
    /// Other things held here (`"token_embd"`, `"output"`, ...).
    holds: Vec<String>,
    /// True when the planner added the device (not in the given list).
    implicit: bool,
}

impl From<&wp::DeviceUsage> for DeviceUsage {
    fn from(d: &wp::DeviceUsage) -> Self {
        DeviceUsage {
            name: d.name.clone(),
            kind: d.kind.name(),
            capacity: d.bounded_capacity(),
            weights: d.weights,
            kv: d.kv,
            scratch: d.scratch,
            overhead: d.overhead,
            overhead_parts: parts(&d.overhead_parts),
            reserve: d.reserve,
            free: d.bounded_free(),
            used: d.used(),
            layers: d.layers.clone(),
            holds: d.holds.clone(),
            implicit: d.implicit,
        }
    }
}

#[pymethods]
impl DeviceUsage {
    fn __repr__(&self) -> String {
        format!(
            "DeviceUsage('{}', weights={}, kv={}, scratch={}, overhead={}, reserve={}, free={})",
            self.name,
            self.weights,
            self.kv,
            self.scratch,
            self.overhead,
            self.reserve,
            self.free.map_or("None".into(), |f| f.to_string())
        )
    }
}

/// Where one tensor goes. `shards` lists `(device, start, end, bytes)` row ranges when the
/// tensor is split across devices (llama.cpp row split, tensor parallel), else None.
#[pyclass(module = "weightlift._native", frozen, get_all)]
#[derive(Clone)]
pub struct Placement {
    name: String,
    device: String,
    /// The dtype after any conversion.
    dtype: &'static str,
    nbytes: u64,
    layer: Option<u32>,
    shards: Option<Vec<(String, u64, u64, u64)>>,
}

impl From<&wp::TensorPlacement> for Placement {
    fn from(t: &wp::TensorPlacement) -> Self {
        Placement {
            name: t.name.clone(),
            device: t.device.clone(),
            dtype: t.dtype.name(),
            nbytes: t.bytes,
            layer: t.layer,
            shards: t.split.as_ref().map(|s| {
                s.shards
                    .iter()
                    .map(|sh| (sh.device.clone(), sh.start, sh.end, sh.bytes))
                    .collect()
            }),
        }
    }
}

#[pymethods]
impl Placement {
    fn __repr__(&self) -> String {
        format!(
            "Placement('{}' -> {}, {} bytes {})",
            self.name, self.device, self.nbytes, self.dtype
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
        self.inner.tensors().iter().map(Placement::from).collect()
    }
    /// Per-device breakdown: weights, kv, scratch, overhead, reserve and free, in bytes.
    #[getter]
    fn devices(&self) -> Vec<DeviceUsage> {
        self.inner.devices().iter().map(DeviceUsage::from).collect()
    }
    /// Host RAM at its peak during loading, in bytes: `staging`, `owned_weights`,
    /// `mapped_weights` (page cache), `disk_weights`, `kv`, `scratch`, `peak_anon`, `peak_total`.
    #[getter]
    fn host<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, self.inner.host())?)
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
        self.inner
            .require_tp_split(k)
            .map(<[_]>::to_vec)
            .map_err(py_err)
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
            .map(|d| format!("{}: {} layers", d.name, d.n_layers()))
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

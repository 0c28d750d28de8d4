//! What the planner answers: `Device` (one device of an inventory), and a `Plan` with its
//! `DeviceUsage` and `Placement` rows.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use weightlift_plan as wp;

use super::{CacheSpec, RuntimeSpec};
use crate::errors::{Exc, io_error, py_err, raise};

/// A capacity as Python sees it: None for an unbounded device (the planner's `u64::MAX`).
fn bounded(v: u64) -> Option<u64> {
    (v != u64::MAX).then_some(v)
}

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
    pub(super) inner: wp::DeviceSpec,
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
        self.inner.kind.name()
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
    /// Bytes of fixed overhead: for `cuda:N` its context and modules, cuBLAS workspace and
    /// graph memory (see `overhead_parts`).
    #[getter]
    fn overhead(&self) -> u64 {
        self.inner.overhead.total()
    }
    /// The overhead part by part: `[(name, bytes, where the figure comes from)]`.
    #[getter]
    fn overhead_parts(&self) -> Vec<(String, u64, String)> {
        parts(self.inner.overhead.parts())
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
        self.inner.kind.name()
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
    /// Bytes of fixed overhead charged here (0 on a device that holds nothing).
    #[getter]
    fn overhead(&self) -> u64 {
        self.inner.overhead
    }
    /// The overhead charged here, part by part: `[(name, bytes, where the figure comes from)]`,
    /// e.g. `("cuda context and modules", 569376768, "measured on this sm_90")`.
    #[getter]
    fn overhead_parts(&self) -> Vec<(String, u64, String)> {
        parts(&self.inner.overhead_parts)
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

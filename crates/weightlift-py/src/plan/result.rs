//! What the planner answers: `Device` (one device of an inventory), and a `Plan`, whose
//! `DeviceUsage` and `Placement` rows are records too.

use std::path::PathBuf;

use pyo3::prelude::*;
use weightlift_plan as wp;

use super::{CacheSpec, RuntimeSpec};
use crate::errors::{io_error, py_err};
use crate::format::record;

/// One device of an inventory, handed to Python as a `weightlift.Device` record.
pub struct Device(wp::DeviceSpec);

impl From<wp::DeviceSpec> for Device {
    fn from(d: wp::DeviceSpec) -> Self {
        Device(d)
    }
}

impl<'py> IntoPyObject<'py> for Device {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        record(py, "Device", &self.0.view())
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
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        self.inner
            .tensors()
            .iter()
            .map(|t| record(py, "Placement", &t.view()))
            .collect()
    }
    /// Per-device breakdown: weights, kv, scratch, overhead, reserve and free, in bytes.
    #[getter]
    fn devices<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        self.inner
            .devices()
            .iter()
            .map(|d| record(py, "DeviceUsage", &d.view()))
            .collect()
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

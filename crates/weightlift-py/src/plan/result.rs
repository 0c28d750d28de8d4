//! What the planner answers: `Device` (one device of an inventory), and a `Plan`, declared in
//! Python over the native plan, whose `DeviceUsage` and `Placement` rows are records too.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use weightlift_plan as wp;

use crate::errors::{io_error, py_err};
use crate::format::{class, record};

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

/// A plan, handed to Python as a `weightlift.Plan` (declared in `weightlift/_types.py`) over a
/// [`NativePlan`], as the records are.
pub struct Plan {
    pub(crate) inner: wp::Plan,
}

impl<'py> IntoPyObject<'py> for Plan {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        let native = Bound::new(py, NativePlan(Arc::new(self.inner)))?;
        class(py, "Plan")?.call1((native,))
    }
}

/// The native side of `weightlift.Plan`: the plan, its view, and what answers from its rules.
#[pyclass(module = "weightlift._native", name = "Plan", frozen, eq, subclass)]
#[derive(PartialEq)]
pub struct NativePlan(Arc<wp::Plan>);

#[pymethods]
impl NativePlan {
    /// The same plan, as the class it is called on (how `Plan`'s Python class is made).
    #[new]
    fn new(plan: &Bound<'_, Self>) -> Self {
        NativePlan(Arc::clone(&plan.get().0))
    }
    /// What the properties of `weightlift.Plan` read ([`wp::Plan::view`]).
    fn _view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, &self.0.view())?)
    }
    /// The device of a tensor; a tensor split across devices (row split, tensor parallelism)
    /// gives every shard's device in shard order, joined by commas, as `Model.device_of` does.
    /// KeyError for a name the plan does not hold.
    fn device_of(&self, name: &str) -> PyResult<String> {
        self.0
            .device_of(name)
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.to_owned()))
    }
    /// A tensor-parallel split table as `(device index, start, end)` rows, for `kind` in
    /// `"kv"`, `"id"`, `"vc"`, `"rs"`, `"q"`, or `"ex"` (a mixture-of-experts model's whole
    /// experts per device; empty for a dense model, as `"id"` is for a MoE one). Raises
    /// `PlanError` for a plan that is not tensor-parallel.
    fn tp_split(&self, kind: &str) -> PyResult<Vec<(usize, u64, u64)>> {
        let k = wp::TpKind::parse(kind).map_err(py_err)?;
        self.0
            .require_tp_split(k)
            .map(<[_]>::to_vec)
            .map_err(py_err)
    }
    /// The plan as JSON; `Plan.from_json` reads it back to an equal plan.
    fn to_json(&self) -> String {
        self.0.to_json()
    }
    /// Read a plan written by `to_json`.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Plan> {
        let inner = wp::Plan::from_json(text).map_err(py_err)?;
        Ok(Plan { inner })
    }
    /// A readable table: one row per device, then host RAM and warnings.
    fn explain(&self) -> String {
        self.0.explain()
    }
    /// The plan as an SVG chart: one stacked bar per device (weights, kv, scratch, reserve,
    /// free) with layer ranges labelled.
    fn to_svg(&self) -> String {
        self.0.to_svg()
    }
    /// Write `to_svg()` to a file.
    fn save_svg(&self, path: PathBuf) -> PyResult<()> {
        std::fs::write(&path, self.0.to_svg()).map_err(|e| io_error(&path, &e))
    }
}

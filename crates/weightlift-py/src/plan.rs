//! Python bindings for weightlift-plan: `plan()`, `fit()`, `devices()`, `parse_devices()`,
//! `CacheSpec`, `RuntimeSpec` and `Plan`.

mod result;
mod source;
mod specs;

use pyo3::prelude::*;
// The real machine is read through the engine's probe (MemAvailable, and the CUDA driver in a
// build with the `cuda` feature); the planner itself does no I/O.
use weightlift_engine::planned;
use weightlift_plan as wp;

use crate::errors::{eng, enter, py_err};
use crate::options::{Kw, keyword};
pub use result::{Device, Plan};
pub use specs::{CacheSpec, RuntimeSpec};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Private: `weightlift.plan` and `weightlift.fit` are their Python wrappers.
    m.setattr("_plan", wrap_pyfunction!(_plan, m)?)?;
    m.setattr("_fit", wrap_pyfunction!(_fit, m)?)?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(parse_devices, m)?)?;
    m.add_class::<CacheSpec>()?;
    m.add_class::<RuntimeSpec>()?;
    m.add_class::<result::NativePlan>()?;
    Ok(())
}

/// The request for `source` on the devices `kw` names (this machine's when none), with
/// `options`.
fn request(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    kw: &wp::Keywords,
    options: wp::PlanOptions,
) -> PyResult<wp::PlanRequest> {
    let spec = kw.devices().map_err(py_err)?;
    let devices = planned::plan_devices(spec.as_deref()).map_err(py_err)?;
    eng(source::resolve(py, source)?.request(options, devices))
}

/// `weightlift.plan`, whose signature and docstring are in `weightlift/_api.py`.
#[pyfunction]
fn _plan(py: Python<'_>, source: &Bound<'_, PyAny>, kw: Kw<'_>) -> PyResult<Plan> {
    let kw = kw.data()?;
    let req = request(py, source, &kw, kw.plan_options().map_err(py_err)?)?;
    let inner = enter(py, || wp::plan(&req))?;
    Ok(Plan { inner })
}

/// `weightlift.fit`, whose signature and docstring are in `weightlift/_api.py`.
#[pyfunction]
fn _fit(py: Python<'_>, source: &Bound<'_, PyAny>, kw: Kw<'_>) -> PyResult<u64> {
    let kw = kw.data()?;
    let (target, options) = kw.fit_options().map_err(py_err)?;
    let req = request(py, source, &kw, options)?;
    enter(py, || wp::fit(&req, target))
}

/// The real machine's devices: `cpu` with MemAvailable, then any CUDA GPUs the engine can see,
/// then `disk`.
#[pyfunction]
fn devices(py: Python<'_>) -> PyResult<Vec<Device>> {
    let list = enter(py, planned::machine_devices)?;
    Ok(list.into_iter().map(Device::from).collect())
}

/// Parse a device spec string (`"cpu"`, `"cuda:0:24GiB"`, `"virtual:2x24GiB"`,
/// `"virtual:24GiB,virtual:12GiB,cpu:64GiB,disk"`) into normalised devices. `cpu` without a
/// size is the machine's MemAvailable.
#[pyfunction]
fn parse_devices(spec: &Bound<'_, PyAny>) -> PyResult<Vec<Device>> {
    let spec = keyword::<wp::DevicesArg>("spec", spec)?
        .unwrap_or_default()
        .0;
    let devices = planned::plan_devices(Some(&spec)).map_err(py_err)?;
    Ok(devices.into_iter().map(Device::from).collect())
}

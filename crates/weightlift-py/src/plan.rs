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
use crate::options::{DevicesSpec, Kw, plan_options};
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

/// The devices of `spec`, or this machine's ([`planned::plan_devices`]).
fn parse_device_arg(spec: Option<&DevicesSpec>) -> PyResult<Vec<wp::DeviceSpec>> {
    planned::plan_devices(spec.map(|s| s.0.as_str())).map_err(py_err)
}

/// The request for `source` on the devices `kw` names, with `options`.
fn request(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    kw: &Kw<'_>,
    options: wp::PlanOptions,
) -> PyResult<wp::PlanRequest> {
    let devices = parse_device_arg(kw.opt::<DevicesSpec>("devices")?.as_ref())?;
    eng(source::resolve(py, source)?.request(options, devices))
}

/// `weightlift.plan`, whose signature and docstring are in `weightlift/_api.py`.
#[pyfunction]
fn _plan(py: Python<'_>, source: &Bound<'_, PyAny>, kw: Kw<'_>) -> PyResult<Plan> {
    let req = request(py, source, &kw, plan_options(&kw, false)?)?;
    let inner = enter(py, || wp::plan(&req))?;
    Ok(Plan { inner })
}

/// `weightlift.fit`, whose signature and docstring are in `weightlift/_api.py`.
#[pyfunction]
fn _fit(py: Python<'_>, source: &Bound<'_, PyAny>, kw: Kw<'_>) -> PyResult<u64> {
    let target = wp::FitTarget::parse(&kw.get::<String>("target")?).map_err(py_err)?;
    let cache_dtype = kw.opt::<String>("cache_dtype")?;
    let options = plan_options(&kw, false)?
        .for_fit(target, cache_dtype.as_deref())
        .map_err(py_err)?;
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
fn parse_devices(spec: DevicesSpec) -> PyResult<Vec<Device>> {
    Ok(parse_device_arg(Some(&spec))?
        .into_iter()
        .map(Device::from)
        .collect())
}

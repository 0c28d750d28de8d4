//! Python bindings for weightlift-plan: `plan()` and `fit()` of whatever Python passed (a
//! `Checkpoint`, a path to a checkpoint, an HF config.json or a folder holding only one, an HF
//! config dict, or a `ModelSpec`), `devices()`, `parse_devices()`, `CacheSpec`, `RuntimeSpec` and
//! `Plan`.

mod result;
mod specs;

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use pythonize::Depythonizer;
// The real machine is read through the engine's probe (MemAvailable, and the CUDA driver in a
// build with the `cuda` feature); the planner itself does no I/O.
use weightlift_engine::planned::{self, PlanSource};
use weightlift_plan as wp;
use weightlift_plan::keywords::json_value;

use crate::errors::{Exc, eng, enter, py_err, raise};
use crate::format::{Checkpoint, ModelSpec};
use crate::options::{Kw, keyword};
pub use result::{Device, Plan};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Private: `weightlift.plan`, `weightlift.fit` and the specs of `weightlift/_specs.py` are
    // their Python wrappers.
    m.setattr("_plan", wrap_pyfunction!(_plan, m)?)?;
    m.setattr("_fit", wrap_pyfunction!(_fit, m)?)?;
    m.setattr("_spec_fields", wrap_pyfunction!(specs::_spec_fields, m)?)?;
    m.setattr("_cache_nbytes", wrap_pyfunction!(specs::_cache_nbytes, m)?)?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(parse_devices, m)?)?;
    m.add_class::<result::NativePlan>()?;
    Ok(())
}

/// `weightlift.plan`, whose signature and docstring are in `weightlift/_api.py`.
#[pyfunction]
fn _plan(py: Python<'_>, source: &Bound<'_, PyAny>, kw: Kw<'_>) -> PyResult<Plan> {
    let (source, kw) = (resolve(py, source)?, kw.data()?);
    let inner = enter(py, || source.plan_keywords(&kw))?;
    Ok(Plan { inner })
}

/// `weightlift.fit`, whose signature and docstring are in `weightlift/_api.py`.
#[pyfunction]
fn _fit(py: Python<'_>, source: &Bound<'_, PyAny>, kw: Kw<'_>) -> PyResult<u64> {
    let (source, kw) = (resolve(py, source)?, kw.data()?);
    enter(py, || source.fit_keywords(&kw))
}

/// The real machine's devices: `cpu` with MemAvailable, then any CUDA GPUs the engine can see,
/// then `disk`.
#[pyfunction]
fn devices(py: Python<'_>) -> PyResult<Vec<Device>> {
    let devices = enter(py, planned::machine_devices)?;
    Ok(devices.into_iter().map(Device::from).collect())
}

/// Parse a device spec string (`"cpu"`, `"cuda:0:24GiB"`, `"virtual:2x24GiB"`,
/// `"virtual:24GiB,virtual:12GiB,cpu:64GiB,disk"`) into normalised devices. `cpu` without a
/// size is the machine's MemAvailable.
#[pyfunction]
fn parse_devices(spec: &Bound<'_, PyAny>) -> PyResult<Vec<Device>> {
    let spec = keyword::<wp::DevicesArg>("spec", spec)?.unwrap_or_default();
    let devices = planned::plan_devices(Some(&spec.0)).map_err(py_err)?;
    Ok(devices.into_iter().map(Device::from).collect())
}

/// What `source` names; opening a checkpoint path releases the GIL.
fn resolve(py: Python<'_>, source: &Bound<'_, PyAny>) -> PyResult<PlanSource> {
    if let Ok(ckpt) = source.cast::<Checkpoint>() {
        return eng(PlanSource::checkpoint(&*ckpt.get().shared()?));
    }
    if let Some(spec) = ModelSpec::of(source)? {
        return Ok(PlanSource::spec(spec.inner));
    }
    if source.is_instance_of::<PyDict>() {
        let value = json_value(&mut Depythonizer::from_object(source)).map_err(|e| {
            raise(
                Exc::Plan,
                format!("config dict: not JSON-serialisable: {e}"),
            )
        })?;
        return eng(PlanSource::hf_config(&value));
    }
    let Ok(path) = source.extract::<PathBuf>() else {
        let expected = "a Checkpoint, a path, an HF config (path or dict) or a ModelSpec";
        let got = source.get_type().name()?;
        let message = format!("source: expected {expected}, got {got}");
        return Err(raise(Exc::Plan, message));
    };
    enter(py, || PlanSource::path(&path))
}

//! What `plan()` and `fit()` plan for, from whatever Python passed: a `Checkpoint`, a path (a
//! checkpoint, an HF config.json, or a folder holding only a config.json), an HF config dict,
//! or a `ModelSpec`, as the engine's [`PlanSource`].

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use pythonize::Depythonizer;
use weightlift_engine::planned::PlanSource;
use weightlift_plan::keywords::json_value;

use crate::errors::{Exc, eng, enter, raise};
use crate::format::{Checkpoint, ModelSpec};

/// What `source` names; opening a checkpoint path releases the GIL.
pub(super) fn resolve(py: Python<'_>, source: &Bound<'_, PyAny>) -> PyResult<PlanSource> {
    if let Ok(ckpt) = source.cast::<Checkpoint>() {
        let ckpt = ckpt.get().shared()?;
        return eng(PlanSource::checkpoint(&ckpt));
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
    let path: PathBuf = source.extract().map_err(|_| {
        raise(
            Exc::Plan,
            format!(
                "source: expected a Checkpoint, a path, an HF config (path or dict) or a ModelSpec, got {}",
                source.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ),
        )
    })?;
    enter(py, || PlanSource::path(&path))
}

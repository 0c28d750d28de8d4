//! llama-cpp-python's `logits_processor` and `stopping_criteria` as the engine's generation
//! hooks: each call takes the GIL, hands Python the ids so far (`numpy.intc`) and a float32
//! copy of the logits, and (for a processor) copies the returned scores back. A Python
//! exception is kept in the call's [`HookError`] slot and raised as it is once the step ends.

use std::sync::{Arc, Mutex};

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use weightlift_engine::EngineError;
use weightlift_engine::generate::{Hook, LogitsFn, StopFn};

use super::args::{Args, Call};

/// The Python exception a hook raised, if one did.
#[derive(Clone, Default)]
pub(super) struct HookError(Arc<Mutex<Option<PyErr>>>);

impl HookError {
    fn keep(&self, what: &str, e: PyErr) -> EngineError {
        let detail = e.to_string();
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
        EngineError::Hook {
            what: what.to_owned(),
            detail,
        }
    }

    /// `err` as Python sees it: the hook's own exception when a hook failed.
    pub(super) fn raise(&self, err: PyErr) -> PyErr {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .unwrap_or(err)
    }
}

fn ids_array<'py>(py: Python<'py>, ids: &[u32]) -> Bound<'py, PyArray1<i32>> {
    PyArray1::from_iter(
        py,
        ids.iter().map(|&i| i32::try_from(i).unwrap_or(i32::MAX)),
    )
}

/// Install `logits_processor` and `stopping_criteria` (callables, or lists of them as
/// llama-cpp-python's `LogitsProcessorList` and `StoppingCriteriaList` are) on `call`.
pub(super) fn install(call: &mut Call, args: &Args<'_>) -> PyResult<()> {
    if let Some(f) = args.any("logits_processor")? {
        let f = f.clone().unbind();
        let slot = call.hook_error.clone();
        let hook: Arc<LogitsFn> = Arc::new(move |ids: &[u32], logits: &mut [f32]| {
            Python::attach(|py| -> PyResult<()> {
                let scores = PyArray1::from_slice(py, logits);
                let out = f.call1(py, (ids_array(py, ids), scores))?;
                let out = py
                    .import("numpy")?
                    .call_method1("ascontiguousarray", (out, "float32"))?;
                let out: PyReadonlyArray1<'_, f32> = out.extract()?;
                let out = out.as_slice()?;
                if out.len() != logits.len() {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "logits_processor: expected {} scores back, got {}",
                        logits.len(),
                        out.len()
                    )));
                }
                logits.copy_from_slice(out);
                Ok(())
            })
            .map_err(|e| slot.keep("logits_processor", e))
        });
        call.options.logits_hook = Some(Hook(hook));
    }
    if let Some(f) = args.any("stopping_criteria")? {
        let f = f.clone().unbind();
        let slot = call.hook_error.clone();
        let hook: Arc<StopFn> = Arc::new(move |ids: &[u32], logits: &[f32]| {
            Python::attach(|py| -> PyResult<bool> {
                let out = f.call1(py, (ids_array(py, ids), PyArray1::from_slice(py, logits)))?;
                out.bind(py).is_truthy()
            })
            .map_err(|e| slot.keep("stopping_criteria", e))
        });
        call.options.stop_hook = Some(Hook(hook));
    }
    Ok(())
}

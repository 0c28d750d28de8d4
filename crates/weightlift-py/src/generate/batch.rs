//! `Batch`: generations stepped together on one model (the engine's continuous batching). A
//! completion call given `batch=` starts in one of its slots and returns an id; `step()` runs
//! one token of every generation and returns what each said. `weightlift.Batch` is declared
//! over this class in `weightlift/_objects.py`. Conversion only: slots, steps and response
//! shapes are the engine's `generate::batch`.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::prelude::*;
use pyo3::types::PyString;
use weightlift_engine::Timings;
use weightlift_engine::generate::batch::{Answer, Batch as EBatch, Event};

use super::args::Call;
use super::hooks::HookError;
use super::respond::to_dict;
use crate::errors::{ToPyErr, eng, enter};
use crate::model::Model;

struct State {
    batch: EBatch,
    /// Where each generation's Python hook exception waits.
    hooks: HashMap<u64, HookError>,
}

#[pyclass(module = "weightlift._native", frozen, subclass)]
pub struct Batch {
    model: Py<Model>,
    state: Mutex<State>,
}

impl Batch {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Start `call` in a slot, answering as `answer`; its id.
    pub(super) fn start(&self, model: &Model, call: Call, answer: Answer) -> PyResult<u64> {
        let inner = model.lock()?;
        let mut state = self.state();
        let id = eng(state
            .batch
            .start(&inner.model, &call.prompt, call.options, answer))?;
        state.hooks.insert(id, call.hook_error);
        Ok(id)
    }

    /// Whether this batch runs on `model`.
    pub(super) fn serves(&self, model: &Bound<'_, Model>) -> bool {
        self.model.is(model)
    }
}

fn report(py: Python<'_>, t: Timings) -> PyResult<Py<PyAny>> {
    Ok(pythonize::pythonize(py, &t.report())?.unbind())
}

#[pymethods]
impl Batch {
    #[new]
    #[pyo3(signature = (model, parallel = 1))]
    fn new(model: &Bound<'_, Model>, parallel: usize) -> PyResult<Self> {
        let batch = eng(EBatch::new(&model.get().lock()?.model, parallel))?;
        Ok(Batch {
            model: model.clone().unbind(),
            state: Mutex::new(State {
                batch,
                hooks: HashMap::new(),
            }),
        })
    }

    #[getter]
    fn parallel(&self) -> usize {
        self.state().batch.parallel()
    }

    #[getter]
    fn running(&self) -> usize {
        self.state().batch.running()
    }

    #[getter]
    fn n_ctx(&self) -> u64 {
        self.state().batch.n_ctx()
    }

    #[allow(clippy::type_complexity)]
    fn step(
        &self,
        py: Python<'_>,
    ) -> PyResult<Vec<(u64, &'static str, Py<PyAny>, Option<Py<PyAny>>)>> {
        let model = self.model.bind(py).get();
        let mut inner = model.lock()?;
        let mut state = self.state();
        let State { batch, hooks } = &mut *state;
        let engine = &mut inner.model;
        let events = match enter(py, || batch.step(engine)) {
            Ok(e) => e,
            Err(e) => {
                hooks.clear();
                return Err(e);
            }
        };
        let mut out = Vec::with_capacity(events.len());
        for (id, event) in events {
            let ended = !matches!(event, Event::Text(_) | Event::Chunk(_));
            let hook = if ended { hooks.remove(&id) } else { None };
            out.push(match event {
                Event::Text(t) => (id, "text", PyString::new(py, &t).into_any().unbind(), None),
                Event::Chunk(c) => (id, "chunk", to_dict(py, &c)?, None),
                Event::Whole(w, t) => (id, "whole", to_dict(py, &w)?, Some(report(py, t)?)),
                Event::End(u, t) => (
                    id,
                    "end",
                    pythonize::pythonize(py, &u)?.unbind(),
                    Some(report(py, t)?),
                ),
                Event::Failed(e) => {
                    let err = hook.unwrap_or_default().raise(e.to_pyerr());
                    (id, "error", err.into_value(py).into_any(), None)
                }
            });
        }
        Ok(out)
    }

    fn cancel(&self, id: u64) -> bool {
        let mut state = self.state();
        state.hooks.remove(&id);
        state.batch.cancel(id)
    }
}

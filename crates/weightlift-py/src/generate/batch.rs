//! `Batch`: generations stepped together on one model (the engine's continuous batching). A
//! completion call given `batch=` starts in one of its slots and returns an id; `step()` runs
//! one token of every generation and returns what each said. Conversion only: slots, steps and
//! response shapes are the engine's `generate::batch`.

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

/// Up to `parallel` generations of `model` at once, each in a slot: the model's own cache and
/// `parallel - 1` more of its length. A slot keeps its tokens after a generation, and a new
/// one goes to the free slot holding the longest prefix of its prompt, so a repeated system
/// prompt runs once per slot. `create_completion(..., batch=b)` and
/// `create_chat_completion(..., batch=b)` start a generation and return its id; `step()` runs
/// one token of each generation (their forward calls as one) and returns `(id, kind, value,
/// timings)` tuples: `"chunk"` (a streamed chunk), `"text"`, `"whole"` (the whole response of a
/// call with `stream=False`; it has ended), `"end"` (a stream has ended; the value is its
/// `usage` dict) or `"error"` (the exception it ended with). `timings` is the finished generation's `Model.timings`, else None.
/// A generation's tokens are those it gets alone.
#[pyclass(module = "weightlift._native", frozen)]
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

    /// Slots in all.
    #[getter]
    fn parallel(&self) -> usize {
        self.state().batch.parallel()
    }

    /// Generations running.
    #[getter]
    fn running(&self) -> usize {
        self.state().batch.running()
    }

    /// Positions of each slot.
    #[getter]
    fn n_ctx(&self) -> u64 {
        self.state().batch.n_ctx()
    }

    /// One token of every running generation; see the class. Raises when the shared forward
    /// call fails (a device out of memory): every running generation has then ended.
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

    /// End generation `id` now (its client went away), freeing its slot; False when it is not
    /// running.
    fn cancel(&self, id: u64) -> bool {
        let mut state = self.state();
        state.hooks.remove(&id);
        state.batch.cancel(id)
    }
}

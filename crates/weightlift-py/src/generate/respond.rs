//! A generation's output as each entry point returns it: text, llama-cpp-python's
//! OpenAI-style `text_completion` and `chat.completion` dicts, or a `CompletionStream` of
//! pieces or chunks. The objects are the engine's typed responses ([`Responder`]); this hands
//! them to Python as dicts.

use pyo3::prelude::*;
use pyo3::types::PyString;
use weightlift_engine::Generation;
use weightlift_engine::generate::batch::{Answer, generate_each, seeded};
use weightlift_engine::generate::openai::Response;
use weightlift_engine::generate::respond::{Kind, Responder, ResponseOptions};

use super::args::Call;
use super::hooks::HookError;
use crate::errors::{ToPyErr, eng, enter};
use crate::model::Model;

/// A response as the dict llama-cpp-python returns: the engine's JSON, parsed by Python's.
pub(super) fn to_dict(py: Python<'_>, r: &Response) -> PyResult<Py<PyAny>> {
    Ok(py
        .import("json")?
        .call_method1("loads", (r.to_json(),))?
        .unbind())
}

/// Run `job` to the end with the GIL released, looking for Ctrl-C after every token.
fn run_to_end(py: Python<'_>, model: &Model, job: &mut Generation) -> PyResult<String> {
    let mut inner = model.lock()?;
    let session = &mut inner.session;
    enter(py, || -> PyResult<String> {
        let mut text = String::new();
        while let Some(piece) = session.step(job).map_err(ToPyErr::to_pyerr)? {
            text.push_str(&piece.text);
            Python::attach(|py| py.check_signals())?;
        }
        Ok(text)
    })
}

/// A generation being streamed to Python: an iterator of text pieces or of response chunks.
#[pyclass(module = "weightlift._native")]
pub struct CompletionStream {
    model: Py<Model>,
    job: Generation,
    /// `None` for text pieces.
    responder: Option<Responder>,
    hook_error: HookError,
}

#[pymethods]
impl CompletionStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        if let Some(r) = self.responder.as_mut().and_then(Responder::ready) {
            return to_dict(py, &r).map(Some);
        }
        loop {
            let model = self.model.bind(py).get();
            let piece = {
                let mut inner = model.lock()?;
                let (session, job) = (&mut inner.session, &mut self.job);
                enter(py, || session.step(job)).map_err(|e| self.hook_error.raise(e))?
            };
            let Some(piece) = piece else {
                return Ok(None);
            };
            match &mut self.responder {
                None if piece.text.is_empty() && piece.finish.is_none() => {}
                None if piece.text.is_empty() => return Ok(None),
                None => return Ok(Some(PyString::new(py, &piece.text).into_any().unbind())),
                Some(r) => {
                    if let Some(chunk) = eng(r.chunk(&self.job, &piece))? {
                        return to_dict(py, &chunk).map(Some);
                    }
                }
            }
        }
    }

    /// The reason the generation ended (`"stop"` or `"length"`), or None while it runs.
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.job.finish_reason().map(|f| f.name())
    }
}

impl Model {
    /// A whole response of `kind` or a stream of its chunks, as llama-cpp-python returns them,
    /// named `name` (the model's path when None); without a kind, the text or a stream of text
    /// pieces. `echo` puts the prompt's text first; `tool` is the tool a chat answers by
    /// calling.
    pub(super) fn respond(
        slf: &Bound<'_, Model>,
        mut call: Call,
        kind: Option<Kind>,
        stream: bool,
        echo: bool,
        name: Option<String>,
        tool: Option<String>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let model = slf.get();
        let options = match kind {
            Some(kind) => {
                let inner = model.lock()?;
                let (prompt, o) = (&call.prompt, &mut call.options);
                let r = inner
                    .model
                    .response_options(kind, name, prompt, echo, stream, o);
                let append = call.append.take();
                Some((
                    kind,
                    ResponseOptions {
                        tool,
                        append,
                        ..eng(r)?
                    },
                ))
            }
            None => None,
        };
        let hook_error = call.hook_error.clone();
        if let Some(batch) = call.batch.take() {
            let answer = match options {
                None => Answer::Text,
                Some((kind, o)) if stream => Answer::Stream(kind, o),
                Some((kind, o)) => Answer::Whole(kind, o),
            };
            let id = batch.get().start(model, call, answer)?;
            return Ok(id.into_pyobject(py)?.into_any().unbind());
        }
        let mut job = {
            let mut inner = model.lock()?;
            eng(Generation::start(
                &mut inner.model,
                &call.prompt,
                call.cache.as_ref(),
                call.options,
            ))?
        };
        let responder = options.map(|(kind, o)| Responder::new(kind, &job, o));
        if stream {
            let s = CompletionStream {
                model: slf.clone().unbind(),
                job,
                responder,
                hook_error,
            };
            return Ok(Py::new(py, s)?.into_any());
        }
        let generated = run_to_end(py, model, &mut job).map_err(|e| hook_error.raise(e))?;
        match responder {
            None => Ok(PyString::new(py, &generated).into_any().unbind()),
            Some(r) => to_dict(py, &eng(r.whole(&job, &generated))?),
        }
    }

    /// `Model.generate(num_return_sequences=n)`: `n` generations of `call`'s prompt at once,
    /// their seeds `seed`, `seed + 1`, ...; a list of their texts.
    pub(super) fn generate_each(
        slf: &Bound<'_, Model>,
        call: Call,
        n: usize,
    ) -> PyResult<Py<PyAny>> {
        let each = seeded(&call.options, n);
        let py = slf.py();
        let model = slf.get();
        let mut inner = model.lock()?;
        let engine = &mut inner.model;
        let prompt = &call.prompt;
        let texts = enter(py, || generate_each(engine, prompt, each))
            .map_err(|e| call.hook_error.raise(e))?;
        Ok(pyo3::types::PyList::new(py, texts)?.into_any().unbind())
    }

    /// Default seed of this model (`load_gguf(seed=...)`).
    pub(super) fn default_seed(&self) -> PyResult<Option<u64>> {
        Ok(self.lock()?.seed)
    }
}

//! A call's keyword dict as the engine's [`Keywords`], beside the live Python objects it also
//! holds (a `LlamaGrammar`, a `Cache`, a `Batch`, hooks), gathered into a [`Call`] before the
//! GIL is released.

use std::sync::Arc;

use pyo3::exceptions::{PyException, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};
use pythonize::Depythonizer;
use serde::de::DeserializeOwned;
use weightlift_engine::GenerateOptions;
use weightlift_engine::generate::keywords::Keywords;
use weightlift_engine::generate::request::Request;
use weightlift_engine::grammar::Grammar;

use super::grammar::LlamaGrammar;
use crate::errors::eng;
use crate::model::Model;

/// `obj` read by the engine's grammar, `what` naming it. A value of the wrong kind raises
/// TypeError naming where it sits (`logit_bias.7`), as a wrong argument type does; an error
/// Python raised while reading one (an int too large) keeps its class.
pub(super) fn read<T: DeserializeOwned>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<T> {
    serde_path_to_error::deserialize(&mut Depythonizer::from_object(obj)).map_err(|e| {
        let py = obj.py();
        let at = match e.path().to_string() {
            p if p == "." => what.to_owned(),
            p if what.is_empty() => p,
            p => format!("{what}.{p}"),
        };
        let err = PyErr::from(e.into_inner());
        // serde's own messages come back as a bare Exception.
        let class = match err.get_type(py) {
            c if c.is(py.get_type::<PyException>()) => py.get_type::<PyTypeError>(),
            c => c,
        };
        PyErr::from_type(class, format!("{at}: {}", err.value(py)))
    })
}

/// The keywords of a call (the `locals()` of its declaration in `weightlift/_api.py`).
pub(super) struct Args<'py> {
    pub(super) kw: Keywords,
    dict: Bound<'py, PyDict>,
    /// A `LlamaGrammar` given as `grammar` (taken out before the engine reads the rest).
    parsed: Option<Arc<Grammar>>,
}

impl<'py> Args<'py> {
    pub(super) fn read(dict: Bound<'py, PyDict>) -> PyResult<Self> {
        let parsed = dict.get_item("grammar")?.and_then(|g| {
            let g = g.cast::<LlamaGrammar>().ok()?;
            Some(Arc::clone(&g.get().grammar))
        });
        let rest = dict.copy()?;
        if parsed.is_some() {
            rest.del_item("grammar")?;
        }
        // Token ids that are no serde data (a numpy array, numpy ints) go on as a list.
        if let Some(p) = rest.get_item("prompt")?
            && !p.is_instance_of::<PyString>()
            && !p.is_instance_of::<PyBytes>()
            && let Ok(ids) = p.extract::<Vec<u32>>()
        {
            rest.set_item("prompt", ids)?;
        }
        let kw = read(&rest, "")?;
        Ok(Args { kw, dict, parsed })
    }

    /// `grammar`: a `LlamaGrammar`'s, or the GBNF text's.
    pub(super) fn grammar(&self) -> PyResult<Option<Arc<Grammar>>> {
        match &self.parsed {
            Some(g) => Ok(Some(Arc::clone(g))),
            None => eng(self.kw.grammar()),
        }
    }

    /// `request` with a `LlamaGrammar` given as `grammar`.
    pub(super) fn with_grammar(&self, mut request: Request) -> Request {
        if let Some(g) = &self.parsed {
            request.grammar = Some(Arc::clone(g));
        }
        request
    }

    /// The Python object under `key`, None when absent or None.
    pub(super) fn any(&self, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.dict.get_item(key)?.filter(|v| !v.is_none()))
    }

    /// The `T` under `key` (`class` naming it in the error), None when absent or None.
    pub(super) fn live<T: pyo3::PyClass>(
        &self,
        key: &str,
        class: &str,
    ) -> PyResult<Option<Bound<'py, T>>> {
        self.any(key)?
            .map(|v| {
                v.cast_into::<T>().map_err(|e| {
                    let got = e.into_inner().get_type().name().map(|n| n.to_string());
                    let got = got.unwrap_or_else(|_| "?".into());
                    PyTypeError::new_err(format!("{key}: expected {class}, got {got}"))
                })
            })
            .transpose()
    }
}

/// Everything a generation call needs, gathered before the GIL is released.
pub(super) struct Call {
    pub(super) prompt: Vec<u32>,
    pub(super) options: GenerateOptions,
    pub(super) cache: Option<Arc<weightlift_engine::Cache>>,
    /// Where a Python hook's exception waits to be raised.
    pub(super) hook_error: super::hooks::HookError,
    /// Text to put after the generated text (a `suffix` without fill-in-the-middle tokens).
    pub(super) append: Option<String>,
    /// The batch to start in, instead of running now.
    pub(super) batch: Option<Py<super::batch::Batch>>,
}

impl Call {
    pub(super) fn new(
        model: &Model,
        prompt: Vec<u32>,
        request: Request,
        cache: Option<Arc<weightlift_engine::Cache>>,
    ) -> PyResult<Call> {
        Ok(Call {
            prompt,
            options: eng(request.options(model.default_seed()?))?,
            cache,
            hook_error: super::hooks::HookError::default(),
            append: None,
            batch: None,
        })
    }
}

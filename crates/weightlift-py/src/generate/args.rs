//! Python values as generation inputs: prompts, stop strings, chat messages and sampler
//! settings, with the llama-cpp-python arguments this build refuses by name.

use std::sync::Arc;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyString};
use weightlift_engine::GenerateOptions;
use weightlift_engine::generate::request::{self, BiasKey, Request};
use weightlift_engine::session::Prompt;

use crate::errors::{Exc, eng, raise};
use crate::model::Model;

/// `str` or `bytes` (llama-cpp-python passes UTF-8 bytes) as a string.
pub(super) fn text_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.to_owned());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return String::from_utf8(b.as_bytes().to_vec()).map_err(|e| {
            raise(
                Exc::Plan,
                format!("{what}: expected UTF-8 text, got bytes that are not UTF-8 ({e})"),
            )
        });
    }
    Err(PyTypeError::new_err(format!(
        "{what}: expected str or bytes, got {}",
        obj.get_type().name()?
    )))
}

/// A prompt: text (str, or UTF-8 bytes) or token ids.
pub(super) struct PromptArg(pub(super) Prompt);

impl<'a, 'py> FromPyObject<'a, 'py> for PromptArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.cast::<PyString>().is_ok() || obj.cast::<PyBytes>().is_ok() {
            return Ok(PromptArg(Prompt::Text(text_of(&obj, "prompt")?)));
        }
        obj.extract::<Vec<u32>>()
            .map(|ids| PromptArg(Prompt::Ids(ids)))
            .map_err(|_| {
                PyTypeError::new_err(format!(
                    "prompt: expected str, bytes or a list of token ids, got {}",
                    type_name(&obj)
                ))
            })
    }
}

/// Stop strings: None, one string, or a list of strings.
pub(super) fn stops(stop: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    match stop {
        None => Ok(Vec::new()),
        Some(s) if s.is_none() => Ok(Vec::new()),
        Some(s) if s.cast::<PyString>().is_ok() => Ok(vec![text_of(s, "stop")?]),
        Some(s) => s
            .extract::<Vec<String>>()
            .map_err(|_| PyTypeError::new_err("stop: expected a string or a list of strings")),
    }
}

/// `logprobs` (a completion's): how many alternatives to list per token. None and False list
/// nothing; a negative count is refused.
pub(super) fn logprobs_count(
    obj: Option<&Bound<'_, PyAny>>,
    what: &str,
) -> PyResult<Option<usize>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    if obj.cast::<PyBool>().is_ok_and(|b| !b.is_true()) {
        return Ok(None);
    }
    let n: i64 = obj.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}: expected an int or None, got {}",
            type_name(obj)
        ))
    })?;
    eng(request::alternatives(n, what)).map(Some)
}

/// `logit_bias`: a dict of token id to bias, its keys as the engine's [`BiasKey`]s.
pub(super) fn logit_bias_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<(u32, f32)>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    let d = obj.cast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "logit_bias: expected a dict of token id to bias, got {}",
            type_name(obj)
        ))
    })?;
    let mut entries = Vec::with_capacity(d.len());
    for (k, v) in d.iter() {
        let key = match (k.extract::<i64>(), k.cast::<PyString>()) {
            (Ok(n), _) => BiasKey::Id(n),
            (_, Ok(s)) => BiasKey::Text(s.to_str()?.to_owned()),
            _ => BiasKey::Other(k.repr().map_or_else(|_| "?".into(), |r| r.to_string())),
        };
        let bias: f32 = v.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "logit_bias[{}]: expected a number, got {}",
                k.str().map_or_else(|_| "?".into(), |r| r.to_string()),
                type_name(&v)
            ))
        })?;
        entries.push((key, bias));
    }
    eng(request::logit_bias(entries))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
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
        mut request: Request,
        stop: Option<&Bound<'_, PyAny>>,
        cache: Option<Arc<weightlift_engine::Cache>>,
    ) -> PyResult<Call> {
        request.stop = stops(stop)?;
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

/// Token ids given as one int or a list of ints (transformers' `eos_token_id`).
pub(super) fn token_ids_arg(
    obj: Option<&Bound<'_, PyAny>>,
    what: &str,
) -> PyResult<Option<Vec<u32>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    if let Ok(id) = obj.extract::<u32>() {
        return Ok(Some(vec![id]));
    }
    obj.extract::<Vec<u32>>().map(Some).map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}: expected a token id (an int >= 0) or a list of them, got {}",
            type_name(obj)
        ))
    })
}

/// A Python value as JSON (through Python's `json`, so it takes what `json.dumps` takes);
/// None and absent are `None`.
pub(super) fn json_arg(
    obj: Option<&Bound<'_, PyAny>>,
    what: &str,
) -> PyResult<Option<serde_json::Value>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let text: String = obj
        .py()
        .import("json")?
        .call_method1("dumps", (obj,))
        .map_err(|e| PyTypeError::new_err(format!("{what}: expected JSON-like data; {e}")))?
        .extract()?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| PyTypeError::new_err(format!("{what}: expected JSON-like data; {e}")))
}

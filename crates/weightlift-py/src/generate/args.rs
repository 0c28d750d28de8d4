//! Python values as generation inputs: prompts, stop strings, chat messages and sampler
//! settings, with the llama-cpp-python arguments this build refuses by name.

use std::sync::Arc;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyString};
use weightlift_engine::GenerateOptions;
use weightlift_engine::sample::{Mirostat, SamplingParams};
use weightlift_text::Message;

use crate::errors::{Exc, eng, raise};

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

/// A prompt: text (tokenized by the model, `completion` choosing `create_completion`'s rules) or
/// token ids.
pub(super) fn prompt_ids(
    model: &weightlift_engine::Model,
    prompt: &Bound<'_, PyAny>,
    add_bos: Option<bool>,
    completion: bool,
) -> PyResult<Vec<u32>> {
    if prompt.cast::<PyString>().is_ok() || prompt.cast::<PyBytes>().is_ok() {
        let text = text_of(prompt, "prompt")?;
        return eng(if completion {
            model.completion_prompt(&text)
        } else {
            model.prompt_ids(&text, add_bos)
        });
    }
    prompt.extract::<Vec<u32>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "prompt: expected str, bytes or a list of token ids, got {}",
            prompt
                .get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })
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

/// llama-cpp-python arguments this build does not implement: refused by name, never ignored.
pub(super) fn refuse(name: &str, given: bool, detail: &str) -> PyResult<()> {
    if given {
        return Err(raise(
            Exc::Unsupported,
            format!("{name} is not supported: {detail}"),
        ));
    }
    Ok(())
}

/// `logprobs` (a completion's) or `top_logprobs` (a chat's): how many alternatives to list per
/// token. None and False list nothing; a negative count is refused.
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
            obj.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    alternatives(n, what).map(Some)
}

/// A count of alternatives per token, refused when negative.
pub(super) fn alternatives(n: i64, what: &str) -> PyResult<usize> {
    usize::try_from(n).map_err(|_| {
        raise(
            Exc::Plan,
            format!(
                "{what}: expected a number of alternatives per token >= 0, got {n}; pass None \
                 for no log-probabilities"
            ),
        )
    })
}

pub(super) fn is_given(obj: Option<&Bound<'_, PyAny>>) -> bool {
    obj.is_some_and(|o| !o.is_none())
}

/// The sampling arguments of llama-cpp-python's completion calls that this build refuses.
pub(super) fn refuse_sampling(
    tfs_z: f32,
    logits_processor: Option<&Bound<'_, PyAny>>,
    logit_bias: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    refuse(
        "tfs_z",
        tfs_z != 1.0,
        "llama.cpp removed tail-free sampling; use 1.0",
    )?;
    refuse("logits_processor", is_given(logits_processor), "not built")?;
    refuse("logit_bias", is_given(logit_bias), "not built")
}

/// The sampler's knobs as each entry point names them.
pub(super) struct Knobs {
    pub(super) temperature: f32,
    pub(super) top_k: i32,
    pub(super) top_p: f32,
    pub(super) min_p: f32,
    pub(super) typical_p: f32,
    pub(super) repeat_penalty: f32,
    pub(super) presence_penalty: f32,
    pub(super) frequency_penalty: f32,
    pub(super) seed: Option<u64>,
    pub(super) mirostat: Mirostat,
}

impl Knobs {
    fn params(&self, default_seed: Option<u64>) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            typical_p: self.typical_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed.or(default_seed),
            mirostat: self.mirostat,
            ..SamplingParams::default()
        }
    }
}

/// Everything a generation call needs, gathered before the GIL is released.
pub(super) struct Call {
    pub(super) prompt: Vec<u32>,
    pub(super) options: GenerateOptions,
    pub(super) cache: Option<Arc<weightlift_engine::Cache>>,
}

impl Call {
    pub(super) fn new(
        prompt: Vec<u32>,
        knobs: &Knobs,
        default_seed: Option<u64>,
        max_tokens: Option<i64>,
        stop: Option<&Bound<'_, PyAny>>,
        cache: Option<Arc<weightlift_engine::Cache>>,
    ) -> PyResult<Call> {
        Ok(Call {
            prompt,
            options: GenerateOptions {
                max_tokens: token_budget(max_tokens),
                sampling: knobs.params(default_seed),
                stop: stops(stop)?,
                stop_at_eog: true,
                ..GenerateOptions::default()
            },
            cache,
        })
    }
}

/// `max_tokens`: None or <= 0 generates until the cache is full.
pub(super) fn token_budget(n: Option<i64>) -> Option<u64> {
    n.and_then(|n| u64::try_from(n).ok()).filter(|&n| n > 0)
}

/// A chat message dict: `role` and `content` (a string, None, or a list of `{"type": "text"}`
/// parts).
pub(super) fn message(obj: &Bound<'_, PyAny>) -> PyResult<Message> {
    let d = obj
        .cast::<PyDict>()
        .map_err(|_| PyTypeError::new_err("messages: expected a list of dicts"))?;
    let role: String = d
        .get_item("role")?
        .ok_or_else(|| PyTypeError::new_err("messages: every message needs a 'role'"))?
        .extract()?;
    let content = match d.get_item("content")? {
        None => String::new(),
        Some(c) if c.is_none() => String::new(),
        Some(c) if c.cast::<PyString>().is_ok() => c.extract()?,
        Some(c) => {
            let mut text = String::new();
            for part in c.try_iter()? {
                let part = part?;
                let part = part.cast::<PyDict>().map_err(|_| {
                    PyTypeError::new_err("message content: expected a string or a list of parts")
                })?;
                let kind: Option<String> =
                    part.get_item("type")?.map(|t| t.extract()).transpose()?;
                if kind.as_deref() != Some("text") {
                    return Err(raise(
                        Exc::Unsupported,
                        format!(
                            "message content part of type {kind:?} is not supported: only text parts are"
                        ),
                    ));
                }
                if let Some(t) = part.get_item("text")? {
                    text.push_str(&t.extract::<String>()?);
                }
            }
            text
        }
    };
    Ok(Message::new(role, content))
}

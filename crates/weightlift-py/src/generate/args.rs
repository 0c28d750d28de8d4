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

/// The sampling argument of llama-cpp-python's completion calls that this build refuses.
pub(super) fn refuse_sampling(tfs_z: f32) -> PyResult<()> {
    refuse(
        "tfs_z",
        tfs_z != 1.0,
        "llama.cpp removed tail-free sampling; use 1.0",
    )
}

/// `logit_bias`: a mapping of token id (an int, or its decimal string as OpenAI's JSON sends
/// it) to the number added to that token's logit. The engine checks ids and values.
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
    let mut out = Vec::with_capacity(d.len());
    for (k, v) in d.iter() {
        let id = match k.extract::<u32>() {
            Ok(id) => Some(id),
            Err(_) => k
                .extract::<String>()
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok()),
        };
        let id = id.ok_or_else(|| {
            raise(
                Exc::Plan,
                format!(
                    "logit_bias: expected token ids (ints >= 0, or their decimal strings) as \
                     keys, got {}",
                    k.repr().map_or_else(|_| "?".into(), |r| r.to_string())
                ),
            )
        })?;
        let bias: f32 = v.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "logit_bias[{id}]: expected a number, got {}",
                type_name(&v)
            ))
        })?;
        out.push((id, bias));
    }
    Ok(out)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
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
    pub(super) fn params(&self, default_seed: Option<u64>) -> SamplingParams {
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
    /// Where a Python hook's exception waits to be raised.
    pub(super) hook_error: super::hooks::HookError,
    /// Text to put after the generated text (a `suffix` without fill-in-the-middle tokens).
    pub(super) append: Option<String>,
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
            hook_error: super::hooks::HookError::default(),
            append: None,
        })
    }
}

/// `generate`'s sampling defaults: llama.cpp's when `do_sample` is not given (greedy unless a
/// temperature is), transformers' when it is.
pub(super) struct SampleDefaults {
    do_sample: Option<bool>,
    pub(super) top_k: i32,
    pub(super) top_p: f32,
    pub(super) min_p: f32,
}

impl SampleDefaults {
    pub(super) fn of(do_sample: Option<bool>) -> SampleDefaults {
        match do_sample {
            Some(_) => SampleDefaults {
                do_sample,
                top_k: 50,
                top_p: 1.0,
                min_p: 0.0,
            },
            None => SampleDefaults {
                do_sample,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
            },
        }
    }

    /// `do_sample=False` is greedy whatever the temperature, as transformers.
    pub(super) fn temperature(&self, given: Option<f32>) -> f32 {
        match self.do_sample {
            Some(false) => 0.0,
            Some(true) => given.unwrap_or(1.0),
            None => given.unwrap_or(0.0),
        }
    }
}

/// One knob under two names (llama.cpp's and transformers'): either, or both when they agree.
pub(super) fn same_knob(
    name: &str,
    value: Option<f32>,
    alias: &str,
    alias_value: Option<f32>,
) -> PyResult<Option<f32>> {
    match (value, alias_value) {
        (Some(a), Some(b)) if a != b => Err(raise(
            Exc::Plan,
            format!("{name}={a} and {alias}={b} name the same penalty; pass one of them"),
        )),
        (a, b) => Ok(a.or(b)),
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

/// `max_new_tokens`, or what transformers' `max_length` (prompt included) leaves after a
/// prompt of `prompt_len` tokens; `max_new_tokens` wins when both are given.
pub(super) fn new_token_budget(
    max_new_tokens: Option<i64>,
    max_length: Option<i64>,
    prompt_len: usize,
) -> PyResult<Option<i64>> {
    match (max_new_tokens, max_length) {
        (Some(n), _) => Ok(Some(n)),
        (None, Some(total)) => {
            let prompt = i64::try_from(prompt_len).unwrap_or(i64::MAX);
            if total <= prompt {
                return Err(raise(
                    Exc::Plan,
                    format!(
                        "max_length={total} counts the prompt, which is already {prompt} tokens; \
                         pass a larger max_length or max_new_tokens"
                    ),
                ));
            }
            Ok(Some(total - prompt))
        }
        (None, None) => Ok(Some(32)),
    }
}

/// `max_tokens`: None or <= 0 generates until the cache is full.
pub(super) fn token_budget(n: Option<i64>) -> Option<u64> {
    n.and_then(|n| u64::try_from(n).ok()).filter(|&n| n > 0)
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

/// A chat message dict: `role` and `content` (a string, None, or a list of `{"type": "text"}`
/// parts), and its other fields (`tool_calls`, `tool_call_id`, `name`) as JSON for the
/// template.
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
    let mut m = Message::new(role, content);
    for (k, v) in d.iter() {
        let key: String = k.extract()?;
        if key != "role"
            && key != "content"
            && let Some(v) = json_arg(Some(&v), &format!("message field '{key}'"))?
        {
            m.extra.insert(key, v);
        }
    }
    Ok(m)
}

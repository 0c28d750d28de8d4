//! Text in and out of a loaded model: `tokenize`, `detokenize`, `generate`, and
//! llama-cpp-python's `create_completion` / `__call__` / `create_chat_completion` with their
//! OpenAI-style dicts and streamed chunks. Conversion only: generation is the engine's
//! `Generation`, tokenizers and chat templates the `weightlift-text` crate.
//!
//! The GIL is released while tokens are generated. A whole completion runs in Rust and looks
//! for Ctrl-C after every token (a `KeyboardInterrupt` ends it; the cache keeps what was
//! written); a stream is a Python iterator that returns to Python after every piece.

use std::sync::Arc;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use weightlift_engine::sample::SamplingParams;
use weightlift_engine::{EngineError, GenerateOptions, Generation, Piece, Timings};
use weightlift_text::Message;

use crate::cache::Cache;
use crate::errors::{Exc, ToPyErr, enter, raise};
use crate::model::Model;

fn eng<T>(r: Result<T, EngineError>) -> PyResult<T> {
    r.map_err(ToPyErr::to_pyerr)
}

/// `str` or `bytes` (llama-cpp-python passes UTF-8 bytes) as a string.
fn text_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
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

/// A prompt: text (tokenized here) or token ids.
/// A prompt: text (tokenized by the model, `completion` choosing `create_completion`'s rules) or
/// token ids.
fn prompt_ids(
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
fn stops(stop: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
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
fn refuse(name: &str, given: bool, detail: &str) -> PyResult<()> {
    if given {
        return Err(raise(
            Exc::Unsupported,
            format!("{name} is not supported: {detail}"),
        ));
    }
    Ok(())
}

fn is_given(obj: Option<&Bound<'_, PyAny>>) -> bool {
    obj.is_some_and(|o| !o.is_none())
}

/// The sampling arguments of llama-cpp-python's completion calls that this build refuses.
fn refuse_sampling(
    tfs_z: f32,
    mirostat_mode: i32,
    logits_processor: Option<&Bound<'_, PyAny>>,
    grammar: Option<&Bound<'_, PyAny>>,
    logit_bias: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    refuse(
        "tfs_z",
        tfs_z != 1.0,
        "llama.cpp removed tail-free sampling; use 1.0",
    )?;
    refuse(
        "mirostat_mode",
        mirostat_mode != 0,
        "mirostat sampling is not built",
    )?;
    refuse("logits_processor", is_given(logits_processor), "not built")?;
    refuse(
        "grammar",
        is_given(grammar),
        "grammar-constrained sampling is not built",
    )?;
    refuse("logit_bias", is_given(logit_bias), "not built")
}

/// The sampler's knobs as each entry point names them.
struct Knobs {
    temperature: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    typical_p: f32,
    repeat_penalty: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    seed: Option<u64>,
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
            ..SamplingParams::default()
        }
    }
}

/// How a stream presents its pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// `Model.generate(stream=True)`: text pieces.
    Text,
    /// `create_completion(stream=True)`: `text_completion` chunks.
    Completion,
    /// `create_chat_completion(stream=True)`: `chat.completion.chunk` deltas.
    Chat,
}

/// The fields every OpenAI-style response and chunk repeats.
#[derive(Debug, Clone)]
struct Head {
    id: String,
    created: u64,
    model: String,
}

impl Head {
    fn new(prefix: &str, model: String) -> Head {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Head {
            id: format!("{prefix}-{}", random_hex()),
            created,
            model,
        }
    }

    fn dict<'py>(&self, py: Python<'py>, object: &str) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("id", &self.id)?;
        d.set_item("object", object)?;
        d.set_item("created", self.created)?;
        d.set_item("model", &self.model)?;
        Ok(d)
    }
}

/// 32 hex digits for response ids (uniqueness, not secrecy: std's randomly keyed hasher).
fn random_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut out = String::new();
    for i in 0..2u8 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u8(i);
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out
}

fn usage<'py>(py: Python<'py>, prompt: u64, completion: u64) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("prompt_tokens", prompt)?;
    d.set_item("completion_tokens", completion)?;
    d.set_item("total_tokens", prompt + completion)?;
    Ok(d)
}

/// One `choices` entry of a completion (`text`) or a chat completion (`message` or `delta`).
fn choice<'py>(
    py: Python<'py>,
    shape: Shape,
    body: Bound<'py, PyDict>,
    finish: Option<&str>,
    streaming: bool,
) -> PyResult<Bound<'py, PyList>> {
    let c = PyDict::new(py);
    match shape {
        Shape::Chat if streaming => c.set_item("delta", body)?,
        Shape::Chat => c.set_item("message", body)?,
        Shape::Completion | Shape::Text => {
            for (k, v) in body.iter() {
                c.set_item(k, v)?;
            }
        }
    }
    c.set_item("index", 0)?;
    c.set_item("logprobs", py.None())?;
    c.set_item("finish_reason", finish)?;
    PyList::new(py, [c])
}

/// Run `job` to the end with the GIL released, looking for Ctrl-C after every token.
fn run_to_end(py: Python<'_>, model: &Model, job: &mut Generation) -> PyResult<String> {
    let mut inner = model.lock()?;
    let engine = &mut inner.model;
    let out = enter(py, || -> PyResult<String> {
        let mut text = String::new();
        loop {
            let piece = job.step(engine).map_err(ToPyErr::to_pyerr)?;
            let Some(piece) = piece else { break };
            text.push_str(&piece.text);
            Python::attach(|py| py.check_signals())?;
        }
        Ok(text)
    });
    inner.timings = Some(job.timings());
    out
}

/// A generation being streamed to Python: an iterator of text pieces or of response chunks.
#[pyclass(module = "weightlift._native")]
pub struct CompletionStream {
    model: Py<Model>,
    job: Generation,
    shape: Shape,
    head: Head,
    /// Text to put before the first piece (`echo=True`), or the chat role delta not yet sent.
    lead: Option<String>,
}

#[pymethods]
impl CompletionStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        if let Some(lead) = self.lead.take() {
            if self.shape == Shape::Chat {
                let delta = PyDict::new(py);
                delta.set_item("role", "assistant")?;
                return self.chunk(py, delta, None).map(Some);
            }
            if !lead.is_empty() {
                return self.text_chunk(py, &lead, None).map(Some);
            }
        }
        loop {
            let model = self.model.bind(py).get();
            let piece = {
                let mut inner = model.lock()?;
                let engine = &mut inner.model;
                let job = &mut self.job;
                let piece = enter(py, || job.step(engine));
                inner.timings = Some(self.job.timings());
                piece?
            };
            let Some(Piece { text, finish, .. }) = piece else {
                return Ok(None);
            };
            if text.is_empty() && finish.is_none() {
                continue;
            }
            let finish = finish.map(|f| f.name());
            if self.shape == Shape::Text {
                if text.is_empty() {
                    return Ok(None);
                }
                return Ok(Some(PyString::new(py, &text).into_any().unbind()));
            }
            return self.text_chunk(py, &text, finish).map(Some);
        }
    }

    /// The reason the generation ended (`"stop"` or `"length"`), or None while it runs.
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.job.finish_reason().map(|f| f.name())
    }
}

impl CompletionStream {
    fn text_chunk(&self, py: Python<'_>, text: &str, finish: Option<&str>) -> PyResult<Py<PyAny>> {
        let body = PyDict::new(py);
        match self.shape {
            Shape::Chat if text.is_empty() => {}
            Shape::Chat => body.set_item("content", text)?,
            Shape::Completion | Shape::Text => body.set_item("text", text)?,
        }
        self.chunk(py, body, finish)
    }

    fn chunk(
        &self,
        py: Python<'_>,
        body: Bound<'_, PyDict>,
        finish: Option<&str>,
    ) -> PyResult<Py<PyAny>> {
        let object = match self.shape {
            Shape::Chat => "chat.completion.chunk",
            Shape::Completion | Shape::Text => "text_completion",
        };
        let d = self.head.dict(py, object)?;
        d.set_item("choices", choice(py, self.shape, body, finish, true)?)?;
        Ok(d.into_any().unbind())
    }
}

/// Everything a generation call needs, gathered before the GIL is released.
struct Call {
    prompt: Vec<u32>,
    options: GenerateOptions,
    cache: Option<Arc<weightlift_engine::Cache>>,
}

impl Call {
    fn new(
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
            },
            cache,
        })
    }
}

impl Model {
    fn start(&self, call: Call) -> PyResult<Generation> {
        let inner = self.lock()?;
        eng(Generation::new(
            &inner.model,
            &call.prompt,
            call.cache.as_ref(),
            call.options,
        ))
    }

    fn model_name(&self) -> PyResult<String> {
        Ok(self.lock()?.model.source().path().display().to_string())
    }

    /// A whole completion or a stream of chunks, as llama-cpp-python returns them.
    fn respond(
        slf: &Bound<'_, Model>,
        call: Call,
        shape: Shape,
        stream: bool,
        echo: Option<String>,
        name: Option<String>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let model = slf.get();
        let prompt_tokens = call.prompt.len() as u64;
        let mut job = model.start(call)?;
        let name = match name {
            Some(n) => n,
            None => model.model_name()?,
        };
        let head = Head::new(
            if shape == Shape::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            name,
        );
        if stream {
            let lead = match shape {
                Shape::Chat => Some(String::new()),
                _ => echo,
            };
            let s = CompletionStream {
                model: slf.clone().unbind(),
                job,
                shape,
                head,
                lead,
            };
            return Ok(Py::new(py, s)?.into_any());
        }
        let generated = run_to_end(py, model, &mut job)?;
        if shape == Shape::Text {
            return Ok(PyString::new(py, &generated).into_any().unbind());
        }
        let finish = job.finish_reason().map(|f| f.name());
        let body = PyDict::new(py);
        if shape == Shape::Chat {
            body.set_item("role", "assistant")?;
            body.set_item("content", &generated)?;
        } else {
            body.set_item("text", echo.unwrap_or_default() + &generated)?;
        }
        let object = if shape == Shape::Chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        let d = head.dict(py, object)?;
        d.set_item("choices", choice(py, shape, body, finish, false)?)?;
        d.set_item(
            "usage",
            usage(py, prompt_tokens, job.tokens().len() as u64)?,
        )?;
        Ok(d.into_any().unbind())
    }

    /// Default seed of this model (`load_gguf(seed=...)`).
    fn default_seed(&self) -> PyResult<Option<u64>> {
        Ok(self.lock()?.seed)
    }
}

/// `max_tokens`: None or <= 0 generates until the cache is full.
fn token_budget(n: Option<i64>) -> Option<u64> {
    n.and_then(|n| u64::try_from(n).ok()).filter(|&n| n > 0)
}

/// A chat message dict: `role` and `content` (a string, None, or a list of `{"type": "text"}`
/// parts).
fn message(obj: &Bound<'_, PyAny>) -> PyResult<Message> {
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

fn timings_dict<'py>(py: Python<'py>, t: &Timings) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("prompt_tokens", t.prompt_tokens)?;
    d.set_item("prompt_ms", t.prompt_secs * 1e3)?;
    d.set_item(
        "prompt_per_second",
        Timings::rate(t.prompt_tokens, t.prompt_secs),
    )?;
    d.set_item("reused_tokens", t.reused_tokens)?;
    d.set_item("eval_tokens", t.eval_tokens)?;
    d.set_item("eval_ms", t.eval_secs * 1e3)?;
    d.set_item("eval_per_second", Timings::rate(t.eval_tokens, t.eval_secs))?;
    d.set_item("sample_ms", t.sample_secs * 1e3)?;
    Ok(d)
}

#[pymethods]
impl Model {
    /// Token ids of `text` (str, or UTF-8 bytes as llama-cpp-python takes). `add_bos=None`
    /// follows the tokenizer (`tokenizer.ggml.add_bos_token` / the tokenizer config); True or
    /// False forces it. Special tokens such as `<|im_start|>` are parsed only with
    /// `special=True`. Needs no load.
    #[pyo3(signature = (text, add_bos = None, special = false))]
    fn tokenize(
        &self,
        text: &Bound<'_, PyAny>,
        add_bos: Option<bool>,
        special: bool,
    ) -> PyResult<Vec<u32>> {
        let text = text_of(text, "text")?;
        let tok = eng(self.lock()?.model.tokenizer())?;
        tok.encode(&text, add_bos, special)
            .map_err(ToPyErr::to_pyerr)
    }

    /// The text of token `ids`. Special tokens are left out unless `special=True`.
    #[pyo3(signature = (ids, special = false))]
    fn detokenize(&self, ids: Vec<u32>, special: bool) -> PyResult<String> {
        let tok = eng(self.lock()?.model.tokenizer())?;
        tok.decode(&ids, !special).map_err(ToPyErr::to_pyerr)
    }

    /// Generate text after `prompt` (a string or token ids): the text, or with `stream=True` an
    /// iterator of text pieces. `temperature=0` is greedy over the whole vocabulary. Without a
    /// `cache` the model's own cache is used and the prefix it already holds is reused; with one
    /// the prompt is appended to it.
    #[pyo3(signature = (prompt, *, max_new_tokens = 32, temperature = 0.0, top_k = 40,
                        top_p = 0.95, min_p = 0.05, typical_p = 1.0, repeat_penalty = 1.0,
                        presence_penalty = 0.0, frequency_penalty = 0.0, seed = None,
                        stop = None, stream = false, cache = None, add_bos = None))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        slf: &Bound<'_, Model>,
        prompt: &Bound<'_, PyAny>,
        max_new_tokens: Option<i64>,
        temperature: f32,
        top_k: i32,
        top_p: f32,
        min_p: f32,
        typical_p: f32,
        repeat_penalty: f32,
        presence_penalty: f32,
        frequency_penalty: f32,
        seed: Option<u64>,
        stop: Option<&Bound<'_, PyAny>>,
        stream: bool,
        cache: Option<&Bound<'_, Cache>>,
        add_bos: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let model = slf.get();
        let knobs = Knobs {
            temperature,
            top_k,
            top_p,
            min_p,
            typical_p,
            repeat_penalty,
            presence_penalty,
            frequency_penalty,
            seed,
        };
        let ids = prompt_ids(&model.lock()?.model, prompt, add_bos, false)?;
        let call = Call::new(
            ids,
            &knobs,
            model.default_seed()?,
            max_new_tokens,
            stop,
            cache.map(|c| Arc::clone(&c.get().cache)),
        )?;
        Model::respond(slf, call, Shape::Text, stream, None, None)
    }

    /// llama-cpp-python's `Llama.create_completion`: the same arguments and defaults, and an
    /// OpenAI-style `text_completion` dict (`["choices"][0]["text"]`, `["usage"]`), or with
    /// `stream=True` an iterator of chunks. Arguments it has that this build does not implement
    /// (`suffix`, `logprobs`, mirostat, `tfs_z` other than 1, grammars, logits processors,
    /// stopping criteria, `logit_bias`) raise `UnsupportedError` when given.
    #[pyo3(signature = (prompt, suffix = None, max_tokens = 16, temperature = 0.8,
                        top_p = 0.95, min_p = 0.05, typical_p = 1.0, logprobs = None,
                        echo = false, stop = None, frequency_penalty = 0.0,
                        presence_penalty = 0.0, repeat_penalty = 1.0, top_k = 40, stream = false,
                        seed = None, tfs_z = 1.0, mirostat_mode = 0, mirostat_tau = 5.0,
                        mirostat_eta = 0.1, model = None, stopping_criteria = None,
                        logits_processor = None, grammar = None, logit_bias = None))]
    #[allow(clippy::too_many_arguments)]
    fn create_completion(
        slf: &Bound<'_, Model>,
        prompt: &Bound<'_, PyAny>,
        suffix: Option<&Bound<'_, PyAny>>,
        max_tokens: Option<i64>,
        temperature: f32,
        top_p: f32,
        min_p: f32,
        typical_p: f32,
        logprobs: Option<&Bound<'_, PyAny>>,
        echo: bool,
        stop: Option<&Bound<'_, PyAny>>,
        frequency_penalty: f32,
        presence_penalty: f32,
        repeat_penalty: f32,
        top_k: i32,
        stream: bool,
        seed: Option<u64>,
        tfs_z: f32,
        mirostat_mode: i32,
        mirostat_tau: f32,
        mirostat_eta: f32,
        model: Option<String>,
        stopping_criteria: Option<&Bound<'_, PyAny>>,
        logits_processor: Option<&Bound<'_, PyAny>>,
        grammar: Option<&Bound<'_, PyAny>>,
        logit_bias: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let _ = (mirostat_tau, mirostat_eta);
        refuse(
            "suffix",
            is_given(suffix),
            "fill-in-the-middle prompts are not built",
        )?;
        refuse(
            "logprobs",
            is_given(logprobs),
            "log-probabilities are not returned yet",
        )?;
        refuse(
            "stopping_criteria",
            is_given(stopping_criteria),
            "use stop strings",
        )?;
        refuse_sampling(tfs_z, mirostat_mode, logits_processor, grammar, logit_bias)?;
        let me = slf.get();
        let knobs = Knobs {
            temperature,
            top_k,
            top_p,
            min_p,
            typical_p,
            repeat_penalty,
            presence_penalty,
            frequency_penalty,
            seed,
        };
        let ids = prompt_ids(&me.lock()?.model, prompt, None, true)?;
        let echo = if echo {
            let tok = eng(me.lock()?.model.tokenizer())?;
            Some(tok.decode(&ids, true).map_err(ToPyErr::to_pyerr)?)
        } else {
            None
        };
        let call = Call::new(ids, &knobs, me.default_seed()?, max_tokens, stop, None)?;
        Model::respond(slf, call, Shape::Completion, stream, echo, model)
    }

    /// `create_completion`, as `Llama.__call__`.
    #[pyo3(signature = (prompt, *args, **kwargs))]
    fn __call__(
        slf: &Bound<'_, Model>,
        prompt: &Bound<'_, PyAny>,
        args: &Bound<'_, pyo3::types::PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        let mut all = vec![prompt.clone()];
        all.extend(args.iter());
        let args = pyo3::types::PyTuple::new(slf.py(), all)?;
        Ok(slf
            .getattr("create_completion")?
            .call(args, kwargs)?
            .unbind())
    }

    /// llama-cpp-python's `Llama.create_chat_completion`: `messages` (dicts with `role` and
    /// `content`) rendered with the model's chat template and a generation prompt; returns a
    /// `chat.completion` dict (`["choices"][0]["message"]["content"]`), or with `stream=True`
    /// an iterator of `chat.completion.chunk` dicts (a role delta, content deltas, then an empty
    /// delta with the finish reason). Tools, functions, response formats, grammars, logprobs and
    /// logit biases raise `UnsupportedError` when given.
    #[pyo3(signature = (messages, functions = None, function_call = None, tools = None,
                        tool_choice = None, temperature = 0.2, top_p = 0.95, top_k = 40,
                        min_p = 0.05, typical_p = 1.0, stream = false, stop = None, seed = None,
                        response_format = None, max_tokens = None, presence_penalty = 0.0,
                        frequency_penalty = 0.0, repeat_penalty = 1.0, tfs_z = 1.0,
                        mirostat_mode = 0, mirostat_tau = 5.0, mirostat_eta = 0.1, model = None,
                        logits_processor = None, grammar = None, logit_bias = None,
                        logprobs = None, top_logprobs = None))]
    #[allow(clippy::too_many_arguments)]
    fn create_chat_completion(
        slf: &Bound<'_, Model>,
        messages: &Bound<'_, PyAny>,
        functions: Option<&Bound<'_, PyAny>>,
        function_call: Option<&Bound<'_, PyAny>>,
        tools: Option<&Bound<'_, PyAny>>,
        tool_choice: Option<&Bound<'_, PyAny>>,
        temperature: f32,
        top_p: f32,
        top_k: i32,
        min_p: f32,
        typical_p: f32,
        stream: bool,
        stop: Option<&Bound<'_, PyAny>>,
        seed: Option<u64>,
        response_format: Option<&Bound<'_, PyAny>>,
        max_tokens: Option<i64>,
        presence_penalty: f32,
        frequency_penalty: f32,
        repeat_penalty: f32,
        tfs_z: f32,
        mirostat_mode: i32,
        mirostat_tau: f32,
        mirostat_eta: f32,
        model: Option<String>,
        logits_processor: Option<&Bound<'_, PyAny>>,
        grammar: Option<&Bound<'_, PyAny>>,
        logit_bias: Option<&Bound<'_, PyAny>>,
        logprobs: Option<bool>,
        top_logprobs: Option<i32>,
    ) -> PyResult<Py<PyAny>> {
        let _ = (mirostat_tau, mirostat_eta);
        let tool_use = is_given(functions)
            || is_given(function_call)
            || is_given(tools)
            || is_given(tool_choice);
        refuse("tools and functions", tool_use, "tool calling is not built")?;
        refuse(
            "response_format",
            is_given(response_format),
            "JSON modes are not built",
        )?;
        refuse_sampling(tfs_z, mirostat_mode, logits_processor, grammar, logit_bias)?;
        refuse(
            "logprobs",
            logprobs == Some(true) || top_logprobs.is_some(),
            "log-probabilities are not returned yet",
        )?;
        let msgs = messages
            .try_iter()?
            .map(|m| message(&m?))
            .collect::<PyResult<Vec<_>>>()?;
        let me = slf.get();
        let prompt = eng(me.lock()?.model.chat_prompt(&msgs))?;
        let knobs = Knobs {
            temperature,
            top_k,
            top_p,
            min_p,
            typical_p,
            repeat_penalty,
            presence_penalty,
            frequency_penalty,
            seed,
        };
        let call = Call::new(prompt, &knobs, me.default_seed()?, max_tokens, stop, None)?;
        Model::respond(slf, call, Shape::Chat, stream, None, model)
    }

    /// The last generation's timings: `prompt_tokens`, `prompt_ms`, `prompt_per_second`,
    /// `reused_tokens` (prompt tokens the cache already held), `eval_tokens`, `eval_ms`,
    /// `eval_per_second` and `sample_ms`; None before any.
    #[getter]
    fn timings<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let t = self.lock()?.timings;
        t.map(|t| timings_dict(py, &t)).transpose()
    }

    /// Positions in the model's own cache (`Llama.n_ctx()`).
    fn n_ctx(&self) -> PyResult<u64> {
        Ok(eng(self.lock()?.model.own_cache())?.config().max_seq_len)
    }

    /// Rows of the token embedding (`Llama.n_vocab()`).
    fn n_vocab(&self) -> PyResult<u64> {
        eng(self.lock()?.model.vocab_size())
    }

    /// The BOS id, or -1 (`Llama.token_bos()`).
    fn token_bos(&self) -> PyResult<i64> {
        let tok = eng(self.lock()?.model.tokenizer())?;
        Ok(tok.bos_id().map_or(-1, i64::from))
    }

    /// The EOS id, or -1 (`Llama.token_eos()`).
    fn token_eos(&self) -> PyResult<i64> {
        let tok = eng(self.lock()?.model.tokenizer())?;
        Ok(tok.eos_id().map_or(-1, i64::from))
    }
}

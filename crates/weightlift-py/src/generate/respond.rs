//! A generation's output as each entry point returns it: text, llama-cpp-python's
//! OpenAI-style `text_completion` and `chat.completion` dicts, or a `CompletionStream` of
//! pieces or chunks.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use weightlift_engine::{Generation, Piece, Timings};

use super::args::Call;
use super::logprobs::{Entry, Lister, chat_logprobs, completion_logprobs};
use crate::errors::{ToPyErr, eng, enter};
use crate::model::Model;

/// How a stream presents its pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
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
    logprobs: Option<Bound<'py, PyDict>>,
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
    c.set_item("logprobs", logprobs)?;
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
    /// With `logprobs`: names and places each token for its chunk's log-probabilities.
    lister: Option<Lister>,
    /// The finish reason of a last token sent in a chunk of its own, for the closing chunk.
    closing: Option<&'static str>,
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
                return self.chunk(py, delta, None, None).map(Some);
            }
            if !lead.is_empty() {
                return self.text_chunk(py, &lead, None, None).map(Some);
            }
        }
        if let Some(finish) = self.closing.take() {
            return self.text_chunk(py, "", None, Some(finish)).map(Some);
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
            let Some(Piece {
                token,
                text,
                finish,
                ..
            }) = piece
            else {
                return Ok(None);
            };
            // With log-probabilities every token gets its chunk, even one whose text is held
            // back for now (a possible stop string, part of a character).
            let entry = match (&mut self.lister, token) {
                (Some(lister), Some(t)) => {
                    let scored = self.job.token_logprobs().last();
                    Some(lister.entry(py, t, scored)?)
                }
                _ => None,
            };
            if text.is_empty() && finish.is_none() && entry.is_none() {
                continue;
            }
            let finish = finish.map(|f| f.name());
            if self.shape == Shape::Text {
                if text.is_empty() {
                    return Ok(None);
                }
                return Ok(Some(PyString::new(py, &text).into_any().unbind()));
            }
            if entry.is_some() && finish.is_some() {
                // As llama-cpp-python: a token's chunk, then a closing chunk with the finish
                // reason and no log-probabilities.
                self.closing = finish;
                return self.text_chunk(py, &text, entry, None).map(Some);
            }
            return self.text_chunk(py, &text, entry, finish).map(Some);
        }
    }

    /// The reason the generation ended (`"stop"` or `"length"`), or None while it runs.
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.job.finish_reason().map(|f| f.name())
    }
}

impl CompletionStream {
    fn text_chunk<'py>(
        &self,
        py: Python<'py>,
        text: &str,
        entry: Option<Entry<'py>>,
        finish: Option<&str>,
    ) -> PyResult<Py<PyAny>> {
        let logprobs = match entry {
            None => None,
            Some(e) if self.shape == Shape::Chat => Some(chat_logprobs(py, &[e])?),
            Some(e) => Some(completion_logprobs(py, &[e])?),
        };
        let body = PyDict::new(py);
        match self.shape {
            // A token's chunk keeps its (empty) content; the closing chunk is `{}`.
            Shape::Chat if text.is_empty() && logprobs.is_none() => {}
            Shape::Chat => body.set_item("content", text)?,
            Shape::Completion | Shape::Text => body.set_item("text", text)?,
        }
        self.chunk(py, body, logprobs, finish)
    }

    fn chunk<'py>(
        &self,
        py: Python<'py>,
        body: Bound<'py, PyDict>,
        logprobs: Option<Bound<'py, PyDict>>,
        finish: Option<&str>,
    ) -> PyResult<Py<PyAny>> {
        let object = match self.shape {
            Shape::Chat => "chat.completion.chunk",
            Shape::Completion | Shape::Text => "text_completion",
        };
        let d = self.head.dict(py, object)?;
        d.set_item(
            "choices",
            choice(py, self.shape, body, logprobs, finish, true)?,
        )?;
        Ok(d.into_any().unbind())
    }
}

impl Model {
    fn start(&self, call: Call) -> PyResult<Generation> {
        let mut inner = self.lock()?;
        if call.cache.is_none() {
            // Room for the prompt and the tokens asked for (a cache's first step when the
            // length is open), made now if the model has no cache of its own.
            let asked = call.options.max_tokens.unwrap_or(weightlift_plan::SEQ_STEP);
            eng(inner.model.own_cache_for(call.prompt.len() as u64 + asked))?;
        }
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

    /// A whole completion or a stream of chunks, as llama-cpp-python returns them. `echo` is
    /// the prompt's text with `echo=True`; `prompt_chars` the length of the prompt's text, where
    /// the generated text's `text_offset`s start when it is not echoed.
    pub(super) fn respond(
        slf: &Bound<'_, Model>,
        mut call: Call,
        shape: Shape,
        stream: bool,
        echo: Option<String>,
        prompt_chars: usize,
        name: Option<String>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let model = slf.get();
        let prompt_tokens = call.prompt.len() as u64;
        let scoring = call.options.logprobs.is_some();
        // A stream sends the echoed prompt as its first chunk, before anything runs: its tokens
        // are not scored there (llama-cpp-python does not echo a stream at all).
        call.options.prompt_logprobs = scoring && echo.is_some() && !stream;
        let prompt_ids = if call.options.prompt_logprobs {
            call.prompt.clone()
        } else {
            Vec::new()
        };
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
            let base = echo.as_ref().map_or(prompt_chars, |e| e.chars().count());
            let lead = match shape {
                Shape::Chat => Some(String::new()),
                _ => echo,
            };
            let lister = scoring.then(|| Lister::new(std::sync::Arc::clone(job.tokenizer()), base));
            let s = CompletionStream {
                model: slf.clone().unbind(),
                job,
                shape,
                head,
                lead,
                lister,
                closing: None,
            };
            return Ok(Py::new(py, s)?.into_any());
        }
        let generated = run_to_end(py, model, &mut job)?;
        if shape == Shape::Text {
            return Ok(PyString::new(py, &generated).into_any().unbind());
        }
        let finish = job.finish_reason().map(|f| f.name());
        let logprobs = if scoring {
            let entries = whole_entries(py, &job, &prompt_ids, echo.is_some(), prompt_chars)?;
            Some(if shape == Shape::Chat {
                chat_logprobs(py, &entries)?
            } else {
                completion_logprobs(py, &entries)?
            })
        } else {
            None
        };
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
        d.set_item("choices", choice(py, shape, body, logprobs, finish, false)?)?;
        d.set_item(
            "usage",
            usage(py, prompt_tokens, job.tokens().len() as u64)?,
        )?;
        Ok(d.into_any().unbind())
    }

    /// Default seed of this model (`load_gguf(seed=...)`).
    pub(super) fn default_seed(&self) -> PyResult<Option<u64>> {
        Ok(self.lock()?.seed)
    }
}

/// The entries of a whole completion, as llama-cpp-python lists them: with `echo` the prompt's
/// tokens first (without a leading BOS, the first one unscored), then the generated ones; BOS
/// tokens are never listed.
fn whole_entries<'py>(
    py: Python<'py>,
    job: &Generation,
    prompt: &[u32],
    echo: bool,
    prompt_chars: usize,
) -> PyResult<Vec<Entry<'py>>> {
    let tokenizer = job.tokenizer();
    let bos = tokenizer.bos_id();
    let mut lister = Lister::new(
        std::sync::Arc::clone(tokenizer),
        if echo { 0 } else { prompt_chars },
    );
    let scored_prompt = job.prompt_logprobs();
    let prompt_part = prompt
        .iter()
        .enumerate()
        .map(|(j, &t)| (t, scored_prompt.get(j).and_then(Option::as_ref)));
    let generated = job
        .tokens()
        .iter()
        .zip(job.token_logprobs())
        .map(|(&t, s)| (t, Some(s)));
    let mut entries = Vec::new();
    for (token, scored) in prompt_part.chain(generated) {
        if Some(token) == bos {
            continue;
        }
        // llama-cpp-python writes null for the first echoed token, whatever came before it.
        let scored = if echo && entries.is_empty() {
            None
        } else {
            scored
        };
        entries.push(lister.entry(py, token, scored)?);
    }
    Ok(entries)
}

pub(super) fn timings_dict<'py>(py: Python<'py>, t: &Timings) -> PyResult<Bound<'py, PyDict>> {
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

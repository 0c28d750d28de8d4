//! Text in and out of a loaded model: `tokenize`, `detokenize`, `generate`, and
//! llama-cpp-python's `create_completion` / `__call__` / `create_chat_completion` with their
//! OpenAI-style dicts and streamed chunks. Conversion only: generation is the engine's
//! `Generation`, tokenizers and chat templates the `weightlift-text` crate.
//!
//! The GIL is released while tokens are generated. A whole completion runs in Rust and looks
//! for Ctrl-C after every token (a `KeyboardInterrupt` ends it; the cache keeps what was
//! written); a stream is a Python iterator that returns to Python after every piece.

mod args;
mod batch;
mod grammar;
mod hooks;
mod respond;

use std::sync::Arc;

use pyo3::prelude::*;

use crate::cache::Cache;
use crate::errors::{ToPyErr, eng};
use crate::model::Model;
use crate::options::Kw;
use args::{Call, PromptArg, json_arg, logit_bias_arg, logprobs_count, text_of, token_ids_arg};
pub use batch::Batch;
pub use grammar::LlamaGrammar;
use grammar::{grammar_arg, response_format_grammar};
pub use respond::CompletionStream;
use weightlift_engine::generate::request::{self, Request, Sampling, TransformersArgs};
use weightlift_engine::generate::respond::Kind;
use weightlift_engine::generate::tools::chat_tools;
use weightlift_engine::session::Prompt;

#[pymethods]
impl Model {
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

    #[pyo3(signature = (ids, special = false))]
    fn detokenize(&self, ids: Vec<u32>, special: bool) -> PyResult<String> {
        let tok = eng(self.lock()?.model.tokenizer())?;
        tok.decode(&ids, !special).map_err(ToPyErr::to_pyerr)
    }

    #[pyo3(signature = (ids, special = false))]
    fn detokenize_bytes<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        special: bool,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let tok = eng(self.lock()?.model.tokenizer())?;
        let bytes = tok
            .decode_bytes(&ids, !special)
            .map_err(ToPyErr::to_pyerr)?;
        Ok(pyo3::types::PyBytes::new(py, &bytes))
    }

    /// `Model.generate`; see `weightlift/_api.py`.
    fn _generate(slf: &Bound<'_, Model>, prompt: PromptArg, kw: Kw<'_>) -> PyResult<Py<PyAny>> {
        let model = slf.get();
        let n = kw.get("num_return_sequences")?;
        let words = TransformersArgs {
            do_sample: kw.opt("do_sample")?,
            temperature: kw.opt("temperature")?,
            top_k: kw.opt("top_k")?,
            top_p: kw.opt("top_p")?,
            min_p: kw.opt("min_p")?,
            repeat_penalty: kw.opt("repeat_penalty")?,
            repetition_penalty: kw.opt("repetition_penalty")?,
            max_new_tokens: kw.opt("max_new_tokens")?,
            max_length: kw.opt("max_length")?,
            num_return_sequences: n,
        };
        let grammar = grammar_arg(kw.any("grammar")?.as_ref())?;
        let eog_tokens = token_ids_arg(kw.any("eos_token_id")?.as_ref(), "eos_token_id")?;
        let add_bos = kw.opt("add_bos")?;
        let ids = eng(model.lock()?.prompt_ids(prompt.0, add_bos))?;
        let (sampling, max_tokens) = eng(words.resolve(sampling(&kw)?, ids.len()))?;
        let req = Request {
            sampling,
            max_tokens,
            grammar,
            eog_tokens,
            ..Request::default()
        };
        let cache = kw.opt::<Bound<'_, Cache>>("cache")?;
        let cache = cache.map(|c| Arc::clone(&c.get().cache));
        let stream = kw.get("stream")?;
        let call = Call::new(model, ids, req, kw.any("stop")?.as_ref(), cache)?;
        if n > 1 {
            return Model::generate_each(slf, call, n as usize, stream);
        }
        Model::respond(slf, call, None, stream, false, None, None)
    }

    /// `Model.create_completion`; see `weightlift/_api.py`.
    fn _create_completion(
        slf: &Bound<'_, Model>,
        prompt: PromptArg,
        kw: Kw<'_>,
    ) -> PyResult<Py<PyAny>> {
        eng(request::refuse_tfs_z(kw.get("tfs_z")?))?;
        let me = slf.get();
        let req = Request {
            sampling: sampling(&kw)?,
            max_tokens: kw.opt("max_tokens")?,
            logprobs: logprobs_count(kw.any("logprobs")?.as_ref(), "logprobs")?,
            grammar: grammar_arg(kw.any("grammar")?.as_ref())?,
            logit_bias: logit_bias_arg(kw.any("logit_bias")?.as_ref())?,
            ..Request::default()
        };
        let suffix = kw
            .any("suffix")?
            .map(|s| text_of(&s, "suffix"))
            .transpose()?;
        if suffix.is_some() && matches!(prompt.0, Prompt::Ids(_)) {
            // A Python type error, as llama-cpp-python raises it (the engine refuses it too).
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "suffix: a fill-in-the-middle prompt is text (str or bytes), not ids",
            ));
        }
        let (ids, append) = eng(me.lock()?.completion_ids(prompt.0, suffix.as_deref()))?;
        let mut call = Call::new(me, ids, req, kw.any("stop")?.as_ref(), None)?;
        hooks::install(&mut call, &kw)?;
        call.append = append;
        call.batch = batch_arg(slf, &kw)?;
        let (stream, echo) = (kw.get("stream")?, kw.get("echo")?);
        let name = kw.opt("model")?;
        Model::respond(slf, call, Some(Kind::Completion), stream, echo, name, None)
    }

    /// `Model.create_chat_completion`; see `weightlift/_api.py`.
    fn _create_chat_completion(
        slf: &Bound<'_, Model>,
        messages: &Bound<'_, PyAny>,
        kw: Kw<'_>,
    ) -> PyResult<Py<PyAny>> {
        let json = |key: &str| json_arg(kw.any(key)?.as_ref(), key);
        let tools = chat_tools(
            json("functions")?,
            json("function_call")?,
            json("tools")?,
            json("tool_choice")?,
        );
        eng(request::refuse_tfs_z(kw.get("tfs_z")?))?;
        let response_format = response_format_grammar(kw.any("response_format")?.as_ref())?;
        let grammar = grammar_arg(kw.any("grammar")?.as_ref())?;
        let msgs = messages
            .try_iter()?
            .map(|m| Ok(json_arg(Some(&m?), "messages")?.unwrap_or_default()))
            .collect::<PyResult<Vec<_>>>()?;
        let me = slf.get();
        let chat = eng(me.lock()?.model.chat(msgs, tools, response_format, grammar))?;
        let logprobs = (kw.opt("logprobs")?, kw.opt("top_logprobs")?);
        let req = Request {
            sampling: sampling(&kw)?,
            max_tokens: kw.opt("max_tokens")?,
            logprobs: eng(request::chat_logprobs(logprobs.0, logprobs.1))?,
            grammar: chat.grammar,
            logit_bias: logit_bias_arg(kw.any("logit_bias")?.as_ref())?,
            ..Request::default()
        };
        let mut call = Call::new(me, chat.prompt, req, kw.any("stop")?.as_ref(), None)?;
        call.options.stop.extend(chat.stop.map(str::to_owned));
        hooks::install(&mut call, &kw)?;
        call.batch = batch_arg(slf, &kw)?;
        let (stream, name) = (kw.get("stream")?, kw.opt("model")?);
        Model::respond(slf, call, Some(Kind::Chat), stream, false, name, chat.tool)
    }

    #[getter]
    fn timings<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let t = self.lock()?.timings;
        Ok(t.map(|t| pythonize::pythonize(py, &t.report()))
            .transpose()?)
    }

    fn n_ctx(&self) -> PyResult<u64> {
        Ok(eng(self.lock()?.model.own_cache())?.config().max_seq_len)
    }

    fn n_vocab(&self) -> PyResult<u64> {
        eng(self.lock()?.model.vocab_size())
    }

    fn token_bos(&self) -> PyResult<i64> {
        let tok = eng(self.lock()?.model.tokenizer())?;
        Ok(tok.bos_id().map_or(-1, i64::from))
    }

    fn token_eos(&self) -> PyResult<i64> {
        let tok = eng(self.lock()?.model.tokenizer())?;
        Ok(tok.eos_id().map_or(-1, i64::from))
    }
}

/// `batch=`: a `Batch` of this model.
fn batch_arg(model: &Bound<'_, Model>, kw: &Kw<'_>) -> PyResult<Option<Py<Batch>>> {
    match kw.opt::<Bound<'_, Batch>>("batch")? {
        Some(b) if !b.get().serves(model) => Err(pyo3::exceptions::PyValueError::new_err(
            "batch: expected a Batch of this model, got one made for another Model",
        )),
        b => Ok(b.map(Bound::unbind)),
    }
}

/// The sampler settings of a call: each keyword given (not None) over the engine's defaults.
fn sampling(kw: &Kw<'_>) -> PyResult<Sampling> {
    let d = Sampling::default();
    Ok(Sampling {
        temperature: kw.opt("temperature")?.unwrap_or(d.temperature),
        top_k: kw.opt("top_k")?.unwrap_or(d.top_k),
        top_p: kw.opt("top_p")?.unwrap_or(d.top_p),
        min_p: kw.opt("min_p")?.unwrap_or(d.min_p),
        typical_p: kw.opt("typical_p")?.unwrap_or(d.typical_p),
        repeat_penalty: kw.opt("repeat_penalty")?.unwrap_or(d.repeat_penalty),
        presence_penalty: kw.opt("presence_penalty")?.unwrap_or(d.presence_penalty),
        frequency_penalty: kw.opt("frequency_penalty")?.unwrap_or(d.frequency_penalty),
        seed: kw.opt("seed")?,
        mirostat_mode: kw.opt("mirostat_mode")?.unwrap_or(d.mirostat_mode),
        mirostat_tau: kw.opt("mirostat_tau")?.unwrap_or(d.mirostat_tau),
        mirostat_eta: kw.opt("mirostat_eta")?.unwrap_or(d.mirostat_eta),
    })
}

/// `weightlift.sample`; see `weightlift/_api.py`.
#[pyfunction]
pub fn _sample(
    logits: numpy::PyReadonlyArray1<'_, f32>,
    history: Vec<u32>,
    kw: Kw<'_>,
) -> PyResult<u32> {
    let logits = logits.as_slice().map_err(|e| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "logits: expected one contiguous float32 row; {e}"
        ))
    })?;
    eng(sampling(&kw)?.sample_row(logits, &history))
}

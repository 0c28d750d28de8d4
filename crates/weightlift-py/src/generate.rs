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

use std::borrow::Cow;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use weightlift_engine::generate::keywords::{Keywords, Text};
use weightlift_engine::generate::respond::Kind;
use weightlift_engine::session::Prompt;

use crate::cache::Cache;
use crate::errors::{ToPyErr, eng};
use crate::model::Model;
use crate::options::TokenIds;
use args::{Args, Call, read};
pub use batch::Batch;
pub use grammar::LlamaGrammar;
pub use respond::CompletionStream;

#[pymethods]
impl Model {
    #[pyo3(signature = (text, add_bos = None, special = false))]
    fn tokenize(
        &self,
        text: &Bound<'_, PyAny>,
        add_bos: Option<bool>,
        special: bool,
    ) -> PyResult<Vec<u32>> {
        let text = eng(read::<Text>(text, "text")?.into_string("text"))?;
        let tok = eng(self.lock()?.model.tokenizer())?;
        tok.encode(&text, add_bos, special)
            .map_err(ToPyErr::to_pyerr)
    }

    #[pyo3(signature = (ids, special = false))]
    fn detokenize(&self, ids: TokenIds, special: bool) -> PyResult<String> {
        let tok = eng(self.lock()?.model.tokenizer())?;
        tok.decode(&ids.0, !special).map_err(ToPyErr::to_pyerr)
    }

    #[pyo3(signature = (ids, special = false))]
    fn detokenize_bytes(&self, ids: TokenIds, special: bool) -> PyResult<Cow<'static, [u8]>> {
        let tok = eng(self.lock()?.model.tokenizer())?;
        let bytes = tok.decode_bytes(&ids.0, !special);
        Ok(Cow::Owned(bytes.map_err(ToPyErr::to_pyerr)?))
    }

    /// `Model.generate`; see `weightlift/_api.py`.
    fn _generate(slf: &Bound<'_, Model>, kw: Bound<'_, PyDict>) -> PyResult<Py<PyAny>> {
        let args = Args::read(kw)?;
        let k = &args.kw;
        let model = slf.get();
        let ids = eng(model.lock()?.prompt_ids(eng(k.prompt())?, k.add_bos))?;
        let req = args.with_grammar(eng(k.generate(ids.len()))?);
        let cache = args.live::<Cache>("cache", "a Cache")?;
        let cache = cache.map(|c| Arc::clone(&c.get().cache));
        let n = eng(k.sequences(cache.is_some()))?;
        let call = Call::new(model, ids, req, cache)?;
        if n > 1 {
            return Model::generate_each(slf, call, n);
        }
        Model::respond(slf, call, None, k.stream, false, None, None)
    }

    /// `Model.create_completion`; see `weightlift/_api.py`.
    fn _create_completion(slf: &Bound<'_, Model>, kw: Bound<'_, PyDict>) -> PyResult<Py<PyAny>> {
        let args = Args::read(kw)?;
        let k = &args.kw;
        let req = args.with_grammar(eng(k.completion())?);
        let (prompt, suffix) = (eng(k.prompt())?, eng(k.suffix())?);
        if suffix.is_some() && matches!(prompt, Prompt::Ids(_)) {
            // A Python type error, as llama-cpp-python raises it (the engine refuses it too).
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "suffix: a fill-in-the-middle prompt is text (str or bytes), not ids",
            ));
        }
        let me = slf.get();
        let (ids, append) = eng(me.lock()?.completion_ids(prompt, suffix.as_deref()))?;
        let mut call = Call::new(me, ids, req, None)?;
        hooks::install(&mut call, &args)?;
        call.append = append;
        call.batch = batch_arg(slf, &args)?;
        let name = k.model.clone();
        Model::respond(
            slf,
            call,
            Some(Kind::Completion),
            k.stream,
            k.echo,
            name,
            None,
        )
    }

    /// `Model.create_chat_completion`; see `weightlift/_api.py`.
    fn _create_chat_completion(
        slf: &Bound<'_, Model>,
        kw: Bound<'_, PyDict>,
    ) -> PyResult<Py<PyAny>> {
        let args = Args::read(kw)?;
        let k = &args.kw;
        let mut req = eng(k.chat())?;
        let (response_format, grammar) = (eng(k.response_format())?, args.grammar()?);
        let msgs = k.messages.clone().unwrap_or_default();
        let me = slf.get();
        let chat = eng(me
            .lock()?
            .model
            .chat(msgs, k.tools(), response_format, grammar))?;
        req.grammar = chat.grammar;
        let mut call = Call::new(me, chat.prompt, req, None)?;
        call.options.stop.extend(chat.stop.map(str::to_owned));
        hooks::install(&mut call, &args)?;
        call.batch = batch_arg(slf, &args)?;
        let name = k.model.clone();
        Model::respond(
            slf,
            call,
            Some(Kind::Chat),
            k.stream,
            false,
            name,
            chat.tool,
        )
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
fn batch_arg(model: &Bound<'_, Model>, args: &Args<'_>) -> PyResult<Option<Py<Batch>>> {
    match args.live::<Batch>("batch", "a Batch")? {
        Some(b) if !b.get().serves(model) => Err(pyo3::exceptions::PyValueError::new_err(
            "batch: expected a Batch of this model, got one made for another Model",
        )),
        b => Ok(b.map(Bound::unbind)),
    }
}

/// `weightlift.sample`; see `weightlift/_api.py`.
#[pyfunction]
pub fn _sample(
    logits: numpy::PyReadonlyArray1<'_, f32>,
    history: Vec<u32>,
    kw: Bound<'_, PyDict>,
) -> PyResult<u32> {
    let logits = logits.as_slice().map_err(|e| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "logits: expected one contiguous float32 row; {e}"
        ))
    })?;
    let kw: Keywords = read(&kw, "")?;
    eng(kw.sampling().and_then(|s| s.sample_row(logits, &history)))
}

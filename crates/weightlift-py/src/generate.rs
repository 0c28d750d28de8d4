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
use pyo3::types::{PyDict, PyTuple};

use crate::cache::Cache;
use crate::errors::{ToPyErr, eng};
use crate::model::Model;
use args::{Call, json_arg, logit_bias_arg, logprobs_count, prompt_ids, text_of, token_ids_arg};
pub use batch::Batch;
pub use grammar::LlamaGrammar;
use grammar::{grammar_arg, response_format_grammar};
pub use respond::CompletionStream;
use weightlift_engine::generate::request::{self, Request, Sampling, TransformersArgs};
use weightlift_engine::generate::respond::Kind;
use weightlift_engine::generate::tools::chat_tools;

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

    /// The bytes of token `ids` (llama-cpp-python's `Llama.detokenize`): `detokenize` before
    /// the UTF-8 check, so a cut through a character stays cut.
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

    /// Generate text after `prompt` (a string or token ids): the text, or with `stream=True` an
    /// iterator of text pieces. `temperature=0` is greedy over the whole vocabulary.
    /// `mirostat_mode=1` or `2` samples with Mirostat (target surprise `mirostat_tau` bits,
    /// learning rate `mirostat_eta`) in place of top-k, typical, top-p, min-p and the
    /// temperature, as llama-cpp-python does. `grammar` (GBNF text or a `LlamaGrammar`) keeps
    /// the text inside a grammar. Without a `cache` the model's own cache is used and the prefix
    /// it already holds is reused (a model loaded without one makes an fp16 cache for the prompt
    /// and `max_new_tokens`, as transformers' generate does); with one the prompt is appended to
    /// it.
    ///
    /// transformers' words work too: `do_sample=False` is greedy and `do_sample=True` samples
    /// with transformers' defaults for what is not given (temperature 1, top-k 50, top-p 1, no
    /// min-p); `max_length` counts the prompt (`max_new_tokens` wins when both are given; with
    /// neither, 32 new tokens; `max_new_tokens <= 0` runs until the cache is full);
    /// `repetition_penalty` is `repeat_penalty` (over the last 64 tokens, as llama.cpp);
    /// `eos_token_id` (an id or a list) replaces the tokenizer's end-of-generation tokens;
    /// `pad_token_id` is accepted and unused (one sequence needs no padding);
    /// `num_return_sequences=N` above 1 samples N texts from the prompt at once (a `Batch` of
    /// N slots) and returns their list; their seeds are `seed`, `seed + 1`, ... (random
    /// without one); greedy decoding, `stream` and `cache` are refused with it.
    #[pyo3(signature = (prompt, *, max_new_tokens = None, temperature = None, top_k = None,
                        top_p = None, min_p = None, typical_p = 1.0, repeat_penalty = None,
                        presence_penalty = 0.0, frequency_penalty = 0.0, mirostat_mode = 0,
                        mirostat_tau = 5.0, mirostat_eta = 0.1, grammar = None, seed = None,
                        stop = None, stream = false, cache = None, add_bos = None,
                        do_sample = None, max_length = None, repetition_penalty = None,
                        eos_token_id = None, pad_token_id = None, num_return_sequences = 1))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        slf: &Bound<'_, Model>,
        prompt: &Bound<'_, PyAny>,
        max_new_tokens: Option<i64>,
        temperature: Option<f32>,
        top_k: Option<i32>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        typical_p: f32,
        repeat_penalty: Option<f32>,
        presence_penalty: f32,
        frequency_penalty: f32,
        mirostat_mode: i64,
        mirostat_tau: f32,
        mirostat_eta: f32,
        grammar: Option<&Bound<'_, PyAny>>,
        seed: Option<u64>,
        stop: Option<&Bound<'_, PyAny>>,
        stream: bool,
        cache: Option<&Bound<'_, Cache>>,
        add_bos: Option<bool>,
        do_sample: Option<bool>,
        max_length: Option<i64>,
        repetition_penalty: Option<f32>,
        eos_token_id: Option<&Bound<'_, PyAny>>,
        pad_token_id: Option<i64>,
        num_return_sequences: i64,
    ) -> PyResult<Py<PyAny>> {
        let _ = pad_token_id;
        let model = slf.get();
        let words = TransformersArgs {
            do_sample,
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            repetition_penalty,
            max_new_tokens,
            max_length,
            num_return_sequences,
        };
        let rest = Sampling {
            typical_p,
            presence_penalty,
            frequency_penalty,
            seed,
            mirostat_mode,
            mirostat_tau,
            mirostat_eta,
            ..Sampling::default()
        };
        let grammar = grammar_arg(grammar)?;
        let eog_tokens = token_ids_arg(eos_token_id, "eos_token_id")?;
        let ids = prompt_ids(&model.lock()?.model, prompt, add_bos, false)?;
        let (sampling, max_tokens) = eng(words.resolve(rest, ids.len()))?;
        let req = Request {
            sampling,
            max_tokens,
            grammar,
            eog_tokens,
            ..Request::default()
        };
        let cache = cache.map(|c| Arc::clone(&c.get().cache));
        let call = Call::new(model, ids, req, stop, cache)?;
        if num_return_sequences > 1 {
            return Model::generate_each(slf, call, num_return_sequences as usize, stream);
        }
        Model::respond(slf, call, None, stream, false, None, None)
    }

    /// llama-cpp-python's `Llama.create_completion`: the same arguments and defaults, and an
    /// OpenAI-style `text_completion` dict (`["choices"][0]["text"]`, `["usage"]`), or with
    /// `stream=True` an iterator of chunks. `logprobs=N` adds `["choices"][0]["logprobs"]`:
    /// `tokens`, `text_offset`, `token_logprobs` (the log-softmax of the raw logits, before any
    /// sampling transform) and `top_logprobs` (the N most likely tokens keyed by their text, plus
    /// the chosen one), per generated token, after the prompt's tokens with `echo=True` (the
    /// first one null); each streamed chunk carries its token's. `logprobs=0` lists only the
    /// chosen token, None or False none. `mirostat_mode=1` or `2` samples with Mirostat in place
    /// of top-k, typical, top-p, min-p and the temperature; `grammar` (GBNF text or a
    /// `LlamaGrammar`) keeps the text inside a grammar. Arguments it has that this build does
    /// not implement (`tfs_z` other than 1) raise `UnsupportedError` when given. `suffix`
    /// asks for the text between `prompt` and it: a fill-in-the-middle prompt on a model whose
    /// vocabulary has FIM tokens (`spm_infill` at load puts the suffix first), else the
    /// completion of `prompt` with `suffix` put after it, as llama-cpp-python does.
    /// `logits_processor` (`(input_ids, scores) -> scores`, after the bias) and
    /// `stopping_criteria` (`(input_ids, logits) -> bool`) are called with the GIL on every
    /// token, as llama-cpp-python calls them; they cannot call this model. `logit_bias`
    /// (`{token_id: bias}`) is added to those tokens' logits before sampling;
    /// log-probabilities stay the model's own. With `batch` (a `Batch` of this model) the
    /// completion starts in one of the batch's slots and its id is returned; `Batch.step()`
    /// runs it with the others and hands over its chunks, or with `stream=False` the dict.
    #[pyo3(signature = (prompt, suffix = None, max_tokens = 16, temperature = 0.8,
                        top_p = 0.95, min_p = 0.05, typical_p = 1.0, logprobs = None,
                        echo = false, stop = None, frequency_penalty = 0.0,
                        presence_penalty = 0.0, repeat_penalty = 1.0, top_k = 40, stream = false,
                        seed = None, tfs_z = 1.0, mirostat_mode = 0, mirostat_tau = 5.0,
                        mirostat_eta = 0.1, model = None, stopping_criteria = None,
                        logits_processor = None, grammar = None, logit_bias = None,
                        batch = None))]
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
        mirostat_mode: i64,
        mirostat_tau: f32,
        mirostat_eta: f32,
        model: Option<String>,
        stopping_criteria: Option<&Bound<'_, PyAny>>,
        logits_processor: Option<&Bound<'_, PyAny>>,
        grammar: Option<&Bound<'_, PyAny>>,
        logit_bias: Option<&Bound<'_, PyAny>>,
        batch: Option<&Bound<'_, Batch>>,
    ) -> PyResult<Py<PyAny>> {
        eng(request::refuse_tfs_z(tfs_z))?;
        let me = slf.get();
        let req = Request {
            sampling: Sampling {
                temperature,
                top_k,
                top_p,
                min_p,
                typical_p,
                repeat_penalty,
                presence_penalty,
                frequency_penalty,
                seed,
                mirostat_mode,
                mirostat_tau,
                mirostat_eta,
            },
            max_tokens,
            logprobs: logprobs_count(logprobs, "logprobs")?,
            grammar: grammar_arg(grammar)?,
            logit_bias: logit_bias_arg(logit_bias)?,
            ..Request::default()
        };
        let suffix = suffix.filter(|s| !s.is_none());
        let (ids, append) = {
            let inner = me.lock()?;
            match suffix {
                Some(_) if prompt.cast::<pyo3::types::PyList>().is_ok() => {
                    return Err(pyo3::exceptions::PyTypeError::new_err(
                        "suffix: a fill-in-the-middle prompt is text (str or bytes), not ids",
                    ));
                }
                Some(sfx) => eng(inner.model.suffixed_prompt(
                    &text_of(prompt, "prompt")?,
                    &text_of(sfx, "suffix")?,
                    inner.spm_infill,
                ))?,
                None => (prompt_ids(&inner.model, prompt, None, true)?, None),
            }
        };
        let mut call = Call::new(me, ids, req, stop, None)?;
        hooks::install(&mut call, logits_processor, stopping_criteria);
        call.append = append;
        call.batch = batch_arg(slf, batch)?;
        Model::respond(slf, call, Some(Kind::Completion), stream, echo, model, None)
    }

    /// `create_completion`, as `Llama.__call__`.
    #[pyo3(signature = (prompt, *args, **kwargs))]
    fn __call__(
        slf: &Bound<'_, Model>,
        prompt: &Bound<'_, PyAny>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        let mut all = vec![prompt.clone()];
        all.extend(args.iter());
        let args = PyTuple::new(slf.py(), all)?;
        Ok(slf
            .getattr("create_completion")?
            .call(args, kwargs)?
            .unbind())
    }

    /// llama-cpp-python's `Llama.create_chat_completion`: `messages` (dicts with `role` and
    /// `content`) rendered with the model's chat template and a generation prompt; returns a
    /// `chat.completion` dict (`["choices"][0]["message"]["content"]`), or with `stream=True`
    /// an iterator of `chat.completion.chunk` dicts (a role delta, content deltas, then an empty
    /// delta with the finish reason). `logprobs=True` with `top_logprobs=N` adds
    /// `["choices"][0]["logprobs"]["content"]`: per generated token its `token` text,
    /// `logprob` and `top_logprobs` (`{token, logprob, bytes}` for the N most likely and the
    /// chosen one), `bytes` None, as llama-cpp-python (which, like this, returns None for
    /// `logprobs=True` without `top_logprobs`). `response_format={"type": "json_object"}` keeps
    /// the reply inside llama-cpp-python's JSON grammar (in place of `grammar`), and with a
    /// `"schema"` (or OpenAI's `{"type": "json_schema", "json_schema": {"schema": ...}}`)
    /// inside the schema's grammar (`LlamaGrammar.from_json_schema`); mirostat and `grammar`
    /// and `logit_bias` are as in `create_completion`. `tools` and `tool_choice` (or the
    /// legacy `functions` and `function_call`) go to the chat template; a `tool_choice` naming
    /// one tool returns a tool call (`message.tool_calls`, `finish_reason` `"tool_calls"`)
    /// whose arguments are kept inside the tool's `parameters` schema. `tfs_z` other than 1
    /// raises `UnsupportedError`; `batch` is as in `create_completion`.
    #[pyo3(signature = (messages, functions = None, function_call = None, tools = None,
                        tool_choice = None, temperature = 0.2, top_p = 0.95, top_k = 40,
                        min_p = 0.05, typical_p = 1.0, stream = false, stop = None, seed = None,
                        response_format = None, max_tokens = None, presence_penalty = 0.0,
                        frequency_penalty = 0.0, repeat_penalty = 1.0, tfs_z = 1.0,
                        mirostat_mode = 0, mirostat_tau = 5.0, mirostat_eta = 0.1, model = None,
                        logits_processor = None, grammar = None, logit_bias = None,
                        logprobs = None, top_logprobs = None, batch = None))]
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
        mirostat_mode: i64,
        mirostat_tau: f32,
        mirostat_eta: f32,
        model: Option<String>,
        logits_processor: Option<&Bound<'_, PyAny>>,
        grammar: Option<&Bound<'_, PyAny>>,
        logit_bias: Option<&Bound<'_, PyAny>>,
        logprobs: Option<bool>,
        top_logprobs: Option<i64>,
        batch: Option<&Bound<'_, Batch>>,
    ) -> PyResult<Py<PyAny>> {
        let tools = chat_tools(
            json_arg(functions, "functions")?,
            json_arg(function_call, "function_call")?,
            json_arg(tools, "tools")?,
            json_arg(tool_choice, "tool_choice")?,
        );
        eng(request::refuse_tfs_z(tfs_z))?;
        let response_format = response_format_grammar(response_format)?;
        let grammar = grammar_arg(grammar)?;
        let msgs = messages
            .try_iter()?
            .map(|m| Ok(json_arg(Some(&m?), "messages")?.unwrap_or_default()))
            .collect::<PyResult<Vec<_>>>()?;
        let me = slf.get();
        let chat = eng(me.lock()?.model.chat(msgs, tools, response_format, grammar))?;
        let req = Request {
            sampling: Sampling {
                temperature,
                top_k,
                top_p,
                min_p,
                typical_p,
                repeat_penalty,
                presence_penalty,
                frequency_penalty,
                seed,
                mirostat_mode,
                mirostat_tau,
                mirostat_eta,
            },
            max_tokens,
            logprobs: eng(request::chat_logprobs(logprobs, top_logprobs))?,
            grammar: chat.grammar,
            logit_bias: logit_bias_arg(logit_bias)?,
            ..Request::default()
        };
        let mut call = Call::new(me, chat.prompt, req, stop, None)?;
        call.options.stop.extend(chat.stop.map(str::to_owned));
        hooks::install(&mut call, logits_processor, None);
        call.batch = batch_arg(slf, batch)?;
        Model::respond(slf, call, Some(Kind::Chat), stream, false, model, chat.tool)
    }

    /// The last generation's timings: `prompt_tokens`, `prompt_ms`, `prompt_per_second`,
    /// `reused_tokens` (prompt tokens the cache already held), `eval_tokens`, `eval_ms`,
    /// `eval_per_second` and `sample_ms`; None before any.
    #[getter]
    fn timings<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let t = self.lock()?.timings;
        Ok(t.map(|t| pythonize::pythonize(py, &t.report()))
            .transpose()?)
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

/// `batch=`: a `Batch` of this model.
fn batch_arg(
    model: &Bound<'_, Model>,
    batch: Option<&Bound<'_, Batch>>,
) -> PyResult<Option<Py<Batch>>> {
    match batch {
        Some(b) if !b.get().serves(model) => Err(pyo3::exceptions::PyValueError::new_err(
            "batch: expected a Batch of this model, got one made for another Model",
        )),
        b => Ok(b.map(|b| b.clone().unbind())),
    }
}

/// One token from `logits` (one row, float32) through the engine's sampler chain, with the
/// penalties over `history`: llama-cpp-python's `Llama.sample` on logits the caller holds.
/// `temperature=0` is the argmax, lowest id on ties.
#[pyfunction]
#[pyo3(signature = (logits, history = Vec::new(), *, temperature = 0.8, top_k = 40, top_p = 0.95,
                    min_p = 0.05, typical_p = 1.0, repeat_penalty = 1.0, presence_penalty = 0.0,
                    frequency_penalty = 0.0, mirostat_mode = 0, mirostat_tau = 5.0,
                    mirostat_eta = 0.1, seed = None))]
#[allow(clippy::too_many_arguments)]
pub fn sample(
    logits: numpy::PyReadonlyArray1<'_, f32>,
    history: Vec<u32>,
    temperature: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    typical_p: f32,
    repeat_penalty: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    mirostat_mode: i64,
    mirostat_tau: f32,
    mirostat_eta: f32,
    seed: Option<u64>,
) -> PyResult<u32> {
    let knobs = Sampling {
        temperature,
        top_k,
        top_p,
        min_p,
        typical_p,
        repeat_penalty,
        presence_penalty,
        frequency_penalty,
        seed,
        mirostat_mode,
        mirostat_tau,
        mirostat_eta,
    };
    let logits = logits.as_slice().map_err(|e| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "logits: expected one contiguous float32 row; {e}"
        ))
    })?;
    eng(knobs.sample_row(logits, &history))
}

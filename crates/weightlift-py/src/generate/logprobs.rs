//! Log-probabilities as llama-cpp-python's dicts: a completion's `{"tokens", "text_offset",
//! "token_logprobs", "top_logprobs"}` and a chat completion's `{"content": [...], "refusal":
//! None}`. The numbers are the engine's; this only names tokens by their text and lays them out.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use weightlift_engine::generate::logprobs::{TextOffsets, TokenLogprobs, text_ignoring_invalid};
use weightlift_text::Tokenizer;

use crate::errors::ToPyErr;

/// One listed token: its text, where that text starts, its log-probability, and the most likely
/// tokens at its position keyed by their text (`None` where llama-cpp-python writes null).
pub(super) struct Entry<'py> {
    text: String,
    offset: usize,
    logprob: Option<f64>,
    top: Option<Bound<'py, PyDict>>,
}

/// Lays out entries as llama-cpp-python does: token texts are the token's own bytes with invalid
/// UTF-8 dropped, special tokens empty; `text_offset` counts the characters of the listed
/// tokens before it, from `base`.
pub(super) struct Lister {
    tokenizer: Arc<Tokenizer>,
    offsets: TextOffsets,
    base: usize,
}

impl Lister {
    pub(super) fn new(tokenizer: Arc<Tokenizer>, base: usize) -> Lister {
        Lister {
            tokenizer,
            offsets: TextOffsets::new(),
            base,
        }
    }

    fn text(&self, id: u32) -> PyResult<String> {
        let piece = self
            .tokenizer
            .token_piece(id, false)
            .map_err(ToPyErr::to_pyerr)?;
        Ok(text_ignoring_invalid(&piece))
    }

    /// The entry of `token`, scored or not (the first token of an echoed prompt).
    pub(super) fn entry<'py>(
        &mut self,
        py: Python<'py>,
        token: u32,
        scored: Option<&TokenLogprobs>,
    ) -> PyResult<Entry<'py>> {
        let piece = self
            .tokenizer
            .token_piece(token, false)
            .map_err(ToPyErr::to_pyerr)?;
        let text = text_ignoring_invalid(&piece);
        let offset = self.base + self.offsets.chars();
        self.offsets.push(&piece);
        let top = match scored {
            None => None,
            Some(s) => {
                // A dict keyed by text, as llama-cpp-python's: tokens with the same text keep
                // the first one's place and the last one's value, and the chosen token is
                // added (or overwrites its text's value) after the top ones.
                let d = PyDict::new(py);
                for &(id, logprob) in &s.top {
                    d.set_item(self.text(id)?, logprob)?;
                }
                d.set_item(&text, s.logprob)?;
                Some(d)
            }
        };
        Ok(Entry {
            text,
            offset,
            logprob: scored.map(|s| s.logprob),
            top,
        })
    }
}

/// `choices[0]["logprobs"]` of a completion or one of its chunks.
pub(super) fn completion_logprobs<'py>(
    py: Python<'py>,
    entries: &[Entry<'py>],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(
        "tokens",
        entries.iter().map(|e| &e.text).collect::<Vec<_>>(),
    )?;
    d.set_item(
        "text_offset",
        entries.iter().map(|e| e.offset).collect::<Vec<_>>(),
    )?;
    d.set_item(
        "token_logprobs",
        entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
    )?;
    let top = PyList::empty(py);
    for e in entries {
        match &e.top {
            Some(t) => top.append(t)?,
            None => top.append(py.None())?,
        }
    }
    d.set_item("top_logprobs", top)?;
    Ok(d)
}

/// `choices[0]["logprobs"]` of a chat completion or one of its chunks (llama-cpp-python's
/// conversion of the completion's: `bytes` is always None).
pub(super) fn chat_logprobs<'py>(
    py: Python<'py>,
    entries: &[Entry<'py>],
) -> PyResult<Bound<'py, PyDict>> {
    let content = PyList::empty(py);
    for e in entries {
        let item = PyDict::new(py);
        item.set_item("token", &e.text)?;
        item.set_item("bytes", py.None())?;
        item.set_item("logprob", e.logprob)?;
        let top = PyList::empty(py);
        if let Some(t) = &e.top {
            for (token, logprob) in t.iter() {
                let alt = PyDict::new(py);
                alt.set_item("token", token)?;
                alt.set_item("logprob", logprob)?;
                alt.set_item("bytes", py.None())?;
                top.append(alt)?;
            }
        }
        item.set_item("top_logprobs", top)?;
        content.append(item)?;
    }
    let d = PyDict::new(py);
    d.set_item("content", content)?;
    d.set_item("refusal", py.None())?;
    Ok(d)
}

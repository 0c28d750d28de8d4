//! The one error type of this crate. Every message names the key, file or template, what was
//! expected and what was found, and the likely cause.

use std::path::PathBuf;

/// A tokenizer that cannot be built, text that cannot be encoded, or a template that fails.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A `tokenizer.ggml.*` key is missing or holds the wrong kind of value.
    #[error("tokenizer metadata '{key}': expected {expected}, got {got}; {hint}")]
    Metadata {
        key: String,
        expected: String,
        got: String,
        hint: &'static str,
    },

    /// `tokenizer.ggml.model` or `tokenizer.ggml.pre` names something this crate cannot build.
    #[error("tokenizer {what} '{name}' is not supported: expected one of {supported}; {hint}")]
    Unsupported {
        what: &'static str,
        name: String,
        supported: String,
        hint: &'static str,
    },

    /// A tokenizer file beside safetensors weights could not be read or parsed.
    #[error("{path}: expected {expected}, got {got}; {hint}")]
    File {
        path: PathBuf,
        expected: String,
        got: String,
        hint: &'static str,
    },

    /// The Hugging Face `tokenizers` library refused to build or run the tokenizer.
    #[error(
        "tokenizer {stage} failed: {detail}; the vocabulary or merges are probably inconsistent"
    )]
    Backend { stage: &'static str, detail: String },

    /// A token id outside the vocabulary.
    #[error(
        "token id {id}: expected an id below the vocabulary size {n_vocab}; the ids come from another model"
    )]
    BadId { id: u32, n_vocab: usize },

    /// The chat template does not parse, or raised an error while rendering.
    #[error(
        "chat template {stage} failed: {detail}; the template uses a Jinja feature or variable minijinja does not provide"
    )]
    Template { stage: &'static str, detail: String },
}

/// Result with [`TextError`].
pub type Result<T, E = TextError> = std::result::Result<T, E>;

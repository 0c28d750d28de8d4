//! The one error type of this crate. Messages are lower-case, name the device, tensor or file,
//! say what was expected and what was found, and the likely cause.

use std::path::PathBuf;

use weightlift_format::FormatError;

/// Why a device operation, a load, a cache access or a collective failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// An allocation that does not fit the device, exactly as a GPU out-of-memory.
    #[error(
        "out of memory on {device}: requested {requested} bytes, {free} bytes free of {capacity} bytes; \
         use a smaller cache or context, a lower-precision dtype, or more devices"
    )]
    OutOfMemory {
        device: String,
        requested: u64,
        free: u64,
        capacity: u64,
    },

    /// A device that cannot be created or used.
    #[error("device {device}: {detail}")]
    Device { device: String, detail: String },

    /// A `cuda:N` device on a machine or build without CUDA.
    #[error("device {device}: cuda is unavailable: {detail}")]
    CudaUnavailable { device: String, detail: String },

    /// The progress callback returned false (or the caller saw a signal); everything allocated
    /// by the load has been freed.
    #[error(
        "load cancelled after {bytes_done} of {bytes_total} bytes; everything it allocated was freed"
    )]
    Cancelled { bytes_done: u64, bytes_total: u64 },

    /// Reading a checkpoint file failed.
    #[error("{path}: reading tensor '{tensor}' failed: {source}")]
    Io {
        path: PathBuf,
        tensor: String,
        #[source]
        source: std::io::Error,
    },

    /// The checkpoint could not be read.
    #[error(transparent)]
    Format(#[from] FormatError),

    /// Planning failed (including a plan that does not fit: `PlanError::OutOfMemory`).
    #[error(transparent)]
    Plan(Box<weightlift_plan::PlanError>),

    /// The checkpoint's tensors do not match the architecture.
    #[error(
        "{path}: tensors do not match the {architecture} architecture: {problems}; \
         the file is incomplete or was converted for a different model"
    )]
    Validation {
        path: PathBuf,
        architecture: String,
        problems: String,
    },

    /// `check_tensors` found a NaN or an infinity in data placed on a device.
    #[error(
        "tensor '{tensor}' on {device} has a non-finite value ({kind}) at element {index}; \
         the file is corrupted or the model diverged"
    )]
    NonFinite {
        tensor: String,
        device: String,
        index: u64,
        kind: &'static str,
    },

    /// An argument outside what the operation accepts.
    #[error("{what}: expected {expected}, got {got}")]
    Invalid {
        what: String,
        expected: String,
        got: String,
    },

    /// A request this build cannot serve (a conversion, a dtype, a device kind).
    #[error("{what} is not supported: {detail}")]
    Unsupported { what: String, detail: String },

    /// transformers' `max_length` (prompt included) that leaves no room for a new token.
    #[error(
        "max_length={max_length} counts the prompt, which is already {prompt} tokens; pass a \
         larger max_length or max_new_tokens"
    )]
    MaxLength { max_length: i64, prompt: i64 },

    /// One knob given under two names with two values (llama.cpp's `repeat_penalty` and
    /// transformers' `repetition_penalty`).
    #[error("{name}={value} and {alias}={alias_value} name the same {what}; pass one of them")]
    Aliased {
        what: &'static str,
        name: &'static str,
        value: f32,
        alias: &'static str,
        alias_value: f32,
    },

    /// A forward call with more tokens than the cache has room for.
    #[error(
        "{tokens} tokens do not fit the cache: {held} of its {max_seq_len} positions are in use; \
         use a larger n_ctx / max_seq_len, a shorter prompt, or reset the cache"
    )]
    ContextFull {
        tokens: u64,
        held: u64,
        max_seq_len: u64,
    },

    /// Positions a sliding-window layer's ring no longer holds: a read, a rewind or a saved
    /// state that needs them, or a forward chunk whose keys would overwrite keys its own queries
    /// read.
    #[error(
        "{what}: layer {layer} attends to a sliding window of {window} tokens and its cache keeps \
         {rows} positions, those from {held_from} on, but position {needed} is needed; {fix}"
    )]
    OutsideWindow {
        what: String,
        layer: usize,
        window: u64,
        rows: u64,
        held_from: u64,
        needed: u64,
        fix: String,
    },

    /// The tokenizer or chat template could not be built or run.
    #[error(transparent)]
    Text(#[from] weightlift_text::TextError),

    /// A GBNF grammar that cannot be used (its line and column, what was expected and what was
    /// found), or a grammar-constrained generation that cannot go on.
    #[error(transparent)]
    Grammar(#[from] crate::grammar::GrammarError),

    /// An operation that needs loaded weights or an allocated cache ran before the load.
    #[error("{what} is not loaded; call load() first")]
    NotLoaded { what: String },

    /// A model used after it was closed ([`crate::session::Session::close`]).
    #[error("{what} is closed; open the checkpoint again to use it")]
    Closed { what: String },

    /// A caller's hook (a logits processor, a stopping criterion) failed; the caller holds
    /// its own error.
    #[error("{what} failed: {detail}")]
    Hook { what: String, detail: String },
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

pub(crate) fn invalid(
    what: impl Into<String>,
    expected: impl Into<String>,
    got: impl std::fmt::Display,
) -> EngineError {
    EngineError::Invalid {
        what: what.into(),
        expected: expected.into(),
        got: got.to_string(),
    }
}

impl From<weightlift_plan::PlanError> for EngineError {
    fn from(e: weightlift_plan::PlanError) -> Self {
        EngineError::Plan(Box::new(e))
    }
}

//! The one error type of this crate. Every message names the file, the key or tensor, what was
//! expected and what was found, and the likely cause.

use std::path::PathBuf;

/// A checkpoint that cannot be read, or a request it cannot answer.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The operating system refused an open, stat or map.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The file is structurally invalid. `what` names the key, tensor or field; `expected` and
    /// `got` say what was wrong; `hint` gives the likely cause.
    #[error("{path}: {what}: expected {expected}, got {got}; {hint}")]
    Invalid {
        path: PathBuf,
        what: String,
        expected: String,
        got: String,
        hint: &'static str,
    },

    /// A valid file that uses something this build does not support (a GGUF version, a type,
    /// an architecture).
    #[error("{path}: {what} is not supported: {detail}")]
    Unsupported {
        path: PathBuf,
        what: String,
        detail: String,
    },

    /// `check_tensors` found a NaN or an infinity.
    #[error(
        "{path}: tensor '{tensor}' has a non-finite value ({kind}) at element {index}; the file is corrupted or the model diverged"
    )]
    NonFinite {
        path: PathBuf,
        tensor: String,
        index: u64,
        kind: &'static str,
    },

    /// A name that the checkpoint does not hold.
    #[error("no tensor named '{name}' in {path}")]
    NoSuchTensor { path: PathBuf, name: String },

    /// The architecture (`ModelSpec`) could not be read from the GGUF metadata or the HF
    /// `config.json`. `key` names the metadata or config key.
    #[error("model spec: {key}: {detail}")]
    Spec { key: String, detail: String },

    /// Dequantising one tensor failed; `source` says why.
    #[error("{path}: cannot dequantize tensor '{tensor}': {source}")]
    Dequantize {
        path: PathBuf,
        tensor: String,
        #[source]
        source: Box<FormatError>,
    },

    /// Block data that the reference dequantiser cannot decode: a type it does not support, or
    /// a byte length that is not what the element count requires. Carries no path; callers
    /// that know the tensor wrap it in `Dequantize`.
    #[error("{dtype} data: {detail}")]
    DequantizeBlocks { dtype: crate::DType, detail: String },

    /// A request that does not fit what it names: a row or column range outside a quantised
    /// linear, or an output buffer of the wrong length. `what` names the thing asked for.
    #[error("{what}: expected {expected}, got {got}")]
    Request {
        what: String,
        expected: String,
        got: String,
    },
}

/// Hints reused across readers, so the same cause reads the same way everywhere.
pub mod hint {
    pub const TRUNCATED: &str = "the file is truncated or still downloading";
    pub const CORRUPT: &str = "the file is corrupted or was not written by a GGUF writer";
    pub const CORRUPT_ST: &str = "the file is corrupted or was not written by a safetensors writer";
    pub const HOSTILE: &str = "the file is corrupted or was crafted to exhaust memory";
    pub const BYTE_ORDER: &str = "the file looks big-endian; convert it on a little-endian machine (gguf-py can rewrite the byte order)";
    pub const SHARDS: &str = "the shard set is incomplete or its index does not match the shards";
    pub const ESCAPE: &str =
        "the index points outside the model folder, which is refused for safety";
    pub const NEWER_WRITER: &str = "the file was written by a newer tool than this build knows";
    pub const SPLIT_NAMES: &str = "split GGUF parts must keep the names gguf-split gave them (name-00001-of-00003.gguf) and sit in one folder";
    pub const QUANT_CONFIG: &str = "the quantisation settings or the architecture in config.json do not match the tensors; the config was edited or belongs to another conversion of the model";
    pub const QUANT_TENSORS: &str =
        "the quantised tensors are incomplete or damaged; re-download or re-convert the checkpoint";
    pub const NO_QUANT_CONFIG: &str = "the quantisation settings were not copied with the weights (GPTQ keeps them in config.json's quantization_config or in quantize_config.json, EXL2 in config.json)";
    pub const OLD_GGUF: &str =
        "the file uses an early GGUF layout; re-convert it with a current llama.cpp or gguf-py";
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;

//! `Checkpoint`: one opened model, whichever format and however many files it spans.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::mapped::MappedFile;
use crate::{FormatError, Metadata, ModelSpec, Result, TensorInfo};

/// The on-disk format of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Gguf,
    Safetensors,
}

impl Format {
    pub const fn name(self) -> &'static str {
        match self {
            Format::Gguf => "gguf",
            Format::Safetensors => "safetensors",
        }
    }
}

/// Options for [`Checkpoint::open`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    /// Scan every float tensor, and the f16 scales of quantised blocks, for NaN and Inf.
    pub check_tensors: bool,
    /// Read only metadata and the tokenizer; no tensor table is kept and no tensor data is touched.
    pub vocab_only: bool,
}

/// What the checkpoint says about its tokenizer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// `tokenizer.ggml.model` (e.g. `"gpt2"`, `"llama"`), or the HF tokenizer model type.
    pub model: Option<String>,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    pub n_tokens: Option<u64>,
    pub n_merges: Option<u64>,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    /// For safetensors folders: whether `tokenizer.json` is present beside the weights.
    pub has_tokenizer_json: bool,
}

/// What a format reader hands back before the checkpoint is assembled.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub files: Vec<MappedFile>,
    pub metadata: Metadata,
    /// Tensors with `layer` and `role` still unset; empty when `vocab_only`.
    pub tensors: Vec<TensorInfo>,
    /// HF `config.json`, when one sits beside safetensors weights.
    pub config: Option<serde_json::Value>,
    pub tokenizer: TokenizerInfo,
}

/// An opened checkpoint. Tensor bytes are views of the memory maps, never copies.
#[derive(Debug)]
pub struct Checkpoint {
    format: Format,
    /// The path the user opened (a file, a folder or an index).
    path: PathBuf,
    files: Vec<MappedFile>,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    config: Option<serde_json::Value>,
    spec: std::result::Result<ModelSpec, String>,
    tokenizer: TokenizerInfo,
}

impl Checkpoint {
    pub fn format(&self) -> Format {
        self.format
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The files that make up the checkpoint, in order; `TensorInfo::file` indexes this.
    pub fn files(&self) -> impl ExactSizeIterator<Item = &Path> {
        self.files.iter().map(MappedFile::path)
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn config(&self) -> Option<&serde_json::Value> {
        self.config.as_ref()
    }

    pub fn tokenizer(&self) -> &TokenizerInfo {
        &self.tokenizer
    }

    /// The architecture, or why it could not be read.
    pub fn spec(&self) -> std::result::Result<&ModelSpec, &str> {
        self.spec.as_ref().map_err(String::as_str)
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| FormatError::NoSuchTensor {
                path: self.path.clone(),
                name: name.to_owned(),
            })
    }

    /// The stored bytes of a tensor: a view into the memory map, validated at open time.
    pub fn bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = info.offset as usize;
        &self.files[info.file].bytes()[start..start + info.nbytes as usize]
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes).sum()
    }

    /// Total number of parameters (elements over all tensors).
    pub fn n_params(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::n_elements).sum()
    }
}

//! `TensorInfo` (one tensor of a checkpoint) and `ModelSpec` (its architecture).

use pyo3::prelude::*;
use pyo3::types::PyTuple;
use weightlift_format as wf;

use super::values::json_to_py;
use crate::errors::{Exc, raise};

/// One tensor of a checkpoint: where it is and what it holds.
#[pyclass(module = "weightlift._native", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name as stored in the file.
    #[pyo3(get)]
    name: String,
    /// The element type's name, e.g. `"Q4_K"`, `"F16"`, `"BF16"`.
    #[pyo3(get)]
    dtype: &'static str,
    shape: Vec<u64>,
    /// Exact bytes on disk.
    #[pyo3(get)]
    nbytes: u64,
    /// The path of the file holding the data.
    #[pyo3(get)]
    file: String,
    /// Absolute byte offset of the data within `file`.
    #[pyo3(get)]
    offset: u64,
    /// The repeating block this tensor belongs to, or None.
    #[pyo3(get)]
    layer: Option<u32>,
    /// What the tensor does (`"attn_q"`, `"ffn_down"`, `"token_embd"`, ...), or None when unknown.
    #[pyo3(get)]
    role: Option<&'static str>,
}

impl TensorInfo {
    /// `t` as a loaded model holds it: in `dtype`, taking `nbytes`.
    pub(crate) fn held(
        ckpt: &wf::Checkpoint,
        t: &wf::TensorInfo,
        dtype: wf::DType,
        nbytes: u64,
    ) -> Self {
        TensorInfo {
            dtype: dtype.name(),
            nbytes,
            ..TensorInfo::new(ckpt, t)
        }
    }

    pub(super) fn new(ckpt: &wf::Checkpoint, t: &wf::TensorInfo) -> Self {
        TensorInfo {
            name: t.name.clone(),
            dtype: t.dtype.name(),
            shape: t.shape.clone(),
            nbytes: t.nbytes,
            file: ckpt
                .files()
                .nth(t.file)
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            offset: t.offset,
            layer: t.layer,
            role: t.role.map(wf::Role::name),
        }
    }
}

#[pymethods]
impl TensorInfo {
    /// The shape in numpy (row-major) order: the reverse of GGUF's `ne`.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// Number of elements (the product of the shape).
    #[getter]
    fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    fn __repr__(&self) -> String {
        let shape: Vec<String> = self.shape.iter().map(u64::to_string).collect();
        format!(
            "TensorInfo(name='{}', dtype='{}', shape=({}{}), nbytes={}, layer={}, role={})",
            self.name,
            self.dtype,
            shape.join(", "),
            if shape.len() == 1 { "," } else { "" },
            self.nbytes,
            self.layer.map_or("None".to_owned(), |l| l.to_string()),
            self.role.map_or("None".to_owned(), |r| format!("'{r}'")),
        )
    }
}

/// The architecture of a checkpoint, read from GGUF metadata or an HF `config.json`.
#[pyclass(module = "weightlift._native", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct ModelSpec {
    pub(crate) inner: wf::ModelSpec,
}

#[pymethods]
impl ModelSpec {
    /// `general.architecture` or the HF `model_type` (e.g. `"llama"`).
    #[getter]
    fn architecture(&self) -> &str {
        &self.inner.architecture
    }
    /// Number of repeating blocks.
    #[getter]
    fn n_layers(&self) -> u32 {
        self.inner.n_layers
    }
    /// Width of the residual stream.
    #[getter]
    fn hidden_size(&self) -> u64 {
        self.inner.hidden_size
    }
    /// Width of the feed-forward layer.
    #[getter]
    fn intermediate_size(&self) -> u64 {
        self.inner.intermediate_size
    }
    /// Attention (query) heads.
    #[getter]
    fn n_heads(&self) -> u32 {
        self.inner.n_heads
    }
    /// KV heads per layer (one entry per layer).
    #[getter]
    fn n_kv_heads(&self) -> Vec<u32> {
        self.inner.n_kv_heads.clone()
    }
    /// Dimension of one attention head.
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim
    }
    /// Vocabulary size.
    #[getter]
    fn vocab_size(&self) -> u64 {
        self.inner.vocab_size
    }
    /// The context length the model was trained for.
    #[getter]
    fn context_length(&self) -> u64 {
        self.inner.context_length
    }
    /// RoPE base frequency.
    #[getter]
    fn rope_theta(&self) -> f64 {
        self.inner.rope_theta
    }
    /// Rotary dimensions, usually `head_dim`.
    #[getter]
    fn rope_dim(&self) -> u32 {
        self.inner.rope_dim
    }
    /// RMSNorm epsilon.
    #[getter]
    fn rms_norm_eps(&self) -> f64 {
        self.inner.rms_norm_eps
    }
    /// True when the output projection reuses the token embedding.
    #[getter]
    fn tie_word_embeddings(&self) -> bool {
        self.inner.tie_word_embeddings
    }
    /// Whether the q/k/v projections carry biases.
    #[getter]
    fn attention_bias(&self) -> bool {
        self.inner.attention_bias
    }

    /// Every field as a plain dict.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let value = serde_json::to_value(&self.inner)
            .map_err(|e| raise(Exc::Weightlift, format!("model spec: {e}")))?;
        json_to_py(py, &value)
    }

    fn __repr__(&self) -> String {
        let s = &self.inner;
        format!(
            "ModelSpec(architecture='{}', n_layers={}, hidden_size={}, n_heads={}, head_dim={}, vocab_size={})",
            s.architecture, s.n_layers, s.hidden_size, s.n_heads, s.head_dim, s.vocab_size
        )
    }
}

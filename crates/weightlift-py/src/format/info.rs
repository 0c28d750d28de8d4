//! `TensorInfo` (one tensor of a checkpoint) and `ModelSpec` (its architecture).

use pyo3::prelude::*;
use pyo3::types::PyTuple;
use weightlift_format as wf;

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
    /// `general.architecture` or the HF `model_type` (e.g. `"llama"`).
    #[pyo3(get)]
    architecture: String,
    /// Number of repeating blocks.
    #[pyo3(get)]
    n_layers: u32,
    /// Width of the residual stream.
    #[pyo3(get)]
    hidden_size: u64,
    /// Width of the feed-forward layer.
    #[pyo3(get)]
    intermediate_size: u64,
    /// Attention (query) heads.
    #[pyo3(get)]
    n_heads: u32,
    /// KV heads per layer (one entry per layer).
    #[pyo3(get)]
    n_kv_heads: Vec<u32>,
    /// Dimension of one attention head.
    #[pyo3(get)]
    head_dim: u32,
    /// Vocabulary size.
    #[pyo3(get)]
    vocab_size: u64,
    /// The context length the model was trained for.
    #[pyo3(get)]
    context_length: u64,
    /// RoPE base frequency.
    #[pyo3(get)]
    rope_theta: f64,
    /// Rotary dimensions, usually `head_dim`.
    #[pyo3(get)]
    rope_dim: u32,
    /// RMSNorm epsilon.
    #[pyo3(get)]
    rms_norm_eps: f64,
    /// True when the output projection reuses the token embedding.
    #[pyo3(get)]
    tie_word_embeddings: bool,
    /// Whether the q/k/v projections carry biases.
    #[pyo3(get)]
    attention_bias: bool,
}

impl From<&wf::ModelSpec> for ModelSpec {
    fn from(s: &wf::ModelSpec) -> Self {
        ModelSpec {
            inner: s.clone(),
            architecture: s.architecture.clone(),
            n_layers: s.n_layers,
            hidden_size: s.hidden_size,
            intermediate_size: s.intermediate_size,
            n_heads: s.n_heads,
            n_kv_heads: s.n_kv_heads.clone(),
            head_dim: s.head_dim,
            vocab_size: s.vocab_size,
            context_length: s.context_length,
            rope_theta: s.rope_theta,
            rope_dim: s.rope_dim,
            rms_norm_eps: s.rms_norm_eps,
            tie_word_embeddings: s.tie_word_embeddings,
            attention_bias: s.attention_bias,
        }
    }
}

#[pymethods]
impl ModelSpec {
    /// Every field as a plain dict.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, &self.inner)?)
    }

    fn __repr__(&self) -> String {
        let s = &self.inner;
        format!(
            "ModelSpec(architecture='{}', n_layers={}, hidden_size={}, n_heads={}, head_dim={}, vocab_size={})",
            s.architecture, s.n_layers, s.hidden_size, s.n_heads, s.head_dim, s.vocab_size
        )
    }
}

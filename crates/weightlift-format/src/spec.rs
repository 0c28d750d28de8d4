//! ModelSpec: the architecture of a checkpoint, read from GGUF metadata or an HF `config.json`,
//! and the mapping of tensor names (both naming schemes) to (layer, role).

use serde::{Deserialize, Serialize};

/// The shape of a decoder-only transformer, as far as placement and loading need it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// `general.architecture` or the HF `model_type` (e.g. `"llama"`, `"qwen2"`).
    pub architecture: String,
    pub n_layers: u32,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub n_heads: u32,
    /// KV heads per layer (`n_layers` entries); GGUF allows a per-layer array.
    pub n_kv_heads: Vec<u32>,
    pub head_dim: u32,
    pub vocab_size: u64,
    pub context_length: u64,
    pub rope_theta: f64,
    /// Rotary dimensions (`rope.dimension_count`), usually `head_dim`.
    pub rope_dim: u32,
    pub rms_norm_eps: f64,
    /// True when the output projection reuses `token_embd` (no separate output tensor).
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections carry biases (qwen2 does).
    pub attention_bias: bool,
}

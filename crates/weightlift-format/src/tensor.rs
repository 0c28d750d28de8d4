//! The tensor table: one `TensorInfo` per tensor, in the order the checkpoint lists them.

use serde::{Deserialize, Serialize};

use crate::DType;

/// What a tensor does in the model. Roles are known for the llama family; other architectures
/// leave `role` as `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    TokenEmbd,
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    AttnOutputBias,
    /// Per-head RMSNorm weight of the queries, before RoPE (qwen3, gemma3), `head_dim` long.
    AttnQNorm,
    /// Per-head RMSNorm weight of the keys, before RoPE (qwen3, gemma3), `head_dim` long.
    AttnKNorm,
    /// q, k and v stacked by rows in one matrix (phi3's `qkv_proj`).
    AttnQkv,
    /// gate and up stacked by rows in one matrix (phi3's `gate_up_proj`; GGUF's `ffn_up` of a
    /// phi3), `2 × intermediate` rows.
    FfnGateUp,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    /// The mixture-of-experts router: one row of scores per expert (GGUF `ffn_gate_inp`,
    /// transformers' `mlp.gate` of qwen3moe and `block_sparse_moe.gate` of mixtral).
    FfnGateInp,
    /// The experts' gate projections: every expert's stacked in one 3-D tensor
    /// `[experts, ffn, hidden]` (GGUF `ffn_gate_exps`), or one expert's `[ffn, hidden]`
    /// (transformers' `experts.E.gate_proj` / mixtral's `w1`; [`expert_of`](crate::expert_of)
    /// names which).
    FfnGateExps,
    /// The experts' up projections (GGUF `ffn_up_exps`; `experts.E.up_proj`, mixtral's `w3`).
    FfnUpExps,
    /// The experts' down projections, `[experts, hidden, ffn]` (GGUF `ffn_down_exps`;
    /// `experts.E.down_proj`, mixtral's `w2`).
    FfnDownExps,
    /// The norm of the attention block's output before the residual add (gemma2, gemma3).
    AttnPostNorm,
    /// The norm of the MLP's output before the residual add (gemma2, gemma3).
    FfnPostNorm,
    OutputNorm,
    Output,
    RopeFreqs,
    /// LongRoPE's per-pair factor lists (`rope_factors_long` and `rope_factors_short`, which
    /// llama.cpp's converter writes from the config of Phi-3's 128k models).
    RopeFactors,
}

impl Role {
    /// The snake_case name used in Python and JSON.
    pub const fn name(self) -> &'static str {
        match self {
            Role::TokenEmbd => "token_embd",
            Role::AttnNorm => "attn_norm",
            Role::AttnQ => "attn_q",
            Role::AttnK => "attn_k",
            Role::AttnV => "attn_v",
            Role::AttnOutput => "attn_output",
            Role::AttnQBias => "attn_q_bias",
            Role::AttnKBias => "attn_k_bias",
            Role::AttnVBias => "attn_v_bias",
            Role::AttnOutputBias => "attn_output_bias",
            Role::AttnQNorm => "attn_q_norm",
            Role::AttnKNorm => "attn_k_norm",
            Role::AttnQkv => "attn_qkv",
            Role::FfnGateUp => "ffn_gate_up",
            Role::FfnNorm => "ffn_norm",
            Role::FfnGate => "ffn_gate",
            Role::FfnUp => "ffn_up",
            Role::FfnDown => "ffn_down",
            Role::FfnGateInp => "ffn_gate_inp",
            Role::FfnGateExps => "ffn_gate_exps",
            Role::FfnUpExps => "ffn_up_exps",
            Role::FfnDownExps => "ffn_down_exps",
            Role::AttnPostNorm => "attn_post_norm",
            Role::FfnPostNorm => "ffn_post_norm",
            Role::OutputNorm => "output_norm",
            Role::Output => "output",
            Role::RopeFreqs => "rope_freqs",
            Role::RopeFactors => "rope_factors",
        }
    }

    /// True for the experts' projections of a mixture-of-experts layer.
    pub const fn is_expert(self) -> bool {
        matches!(
            self,
            Role::FfnGateExps | Role::FfnUpExps | Role::FfnDownExps
        )
    }

    /// True for roles that live inside a repeating block.
    pub const fn is_per_layer(self) -> bool {
        !matches!(
            self,
            Role::TokenEmbd | Role::OutputNorm | Role::Output | Role::RopeFreqs | Role::RopeFactors
        )
    }
}

/// One tensor of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    /// Row-major (numpy) order for both formats: the reverse of GGUF's `ne`.
    pub shape: Vec<u64>,
    /// Exact bytes on disk: `dtype` × `shape`.
    pub nbytes: u64,
    /// Index into the checkpoint's file list.
    pub file: usize,
    /// Absolute byte offset of the data within that file.
    pub offset: u64,
    /// The repeating block this tensor belongs to, if any.
    pub layer: Option<u32>,
    pub role: Option<Role>,
}

impl TensorInfo {
    /// Number of elements (the product of the shape).
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

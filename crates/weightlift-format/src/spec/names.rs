//! Tensor names to (layer, role), in both naming schemes: llama.cpp's GGUF names
//! (`blk.N.attn_q.weight`, llama.cpp's tensor name table) and the HF transformers names
//! (`model.layers.N.self_attn.q_proj.weight`, transformers' Llama modules).

use crate::Role;

/// Architectures whose tensor roles are known (GGUF `general.architecture` or HF `model_type`).
pub(crate) const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "qwen3moe",
    "qwen3_moe",
    "mixtral",
];

/// The Gemma 2 and 3 architectures (GGUF names and HF `model_type`s): four norms a layer, and
/// transformers' `post_attention_layernorm` is the attention block's post-norm there, not the
/// MLP's pre-norm it is in the llama family.
pub(crate) fn is_gemma(architecture: &str) -> bool {
    matches!(architecture, "gemma2" | "gemma3" | "gemma3_text")
}

/// Whether roles are known for this architecture.
pub(crate) fn supports_roles(architecture: &str) -> bool {
    SUPPORTED_ARCHITECTURES.contains(&architecture)
}

/// Architectures whose attention norms each head's queries and keys (an RMSNorm of `head_dim`
/// with its own weight, after the projection and before RoPE): transformers' Qwen3Attention
/// and Gemma3Attention.
const PER_HEAD_QK_NORM: &[&str] = &["qwen3", "gemma3", "gemma3_text", "qwen3moe", "qwen3_moe"];

/// Whether `architecture`'s layers norm each query and key head.
pub(crate) fn per_head_qk_norm(architecture: &str) -> bool {
    PER_HEAD_QK_NORM.contains(&architecture)
}

/// Architectures whose layers hold q/k/v as one matrix and gate/up as one (transformers'
/// Phi3Attention `qkv_proj` and Phi3MLP `gate_up_proj`; llama.cpp's `attn_qkv` and an `ffn_up`
/// of twice the MLP width).
const FUSED_PROJECTIONS: &[&str] = &["phi3"];

/// Whether `architecture`'s layers hold fused qkv and gate_up matrices.
pub(crate) fn fused_projections(architecture: &str) -> bool {
    FUSED_PROJECTIONS.contains(&architecture)
}

/// Architectures whose q/k rows llama.cpp's converter permutes into adjacent RoPE pairs in
/// GGUF (its llama-family `permute`); every other GGUF, and every HF checkpoint, rotates halves.
const GGUF_ADJACENT_ROPE: &[&str] = &["llama", "mistral"];

/// Whether a GGUF of `architecture` pairs adjacent RoPE dimensions.
pub(crate) fn gguf_adjacent_rope(architecture: &str) -> bool {
    GGUF_ADJACENT_ROPE.contains(&architecture)
}

/// Where the decoder blocks' tensor names start: GGUF's, a transformers causal LM's, and a
/// multimodal model's language model, as transformers names it in memory and as it saves it.
/// A vision tower's `encoder.layers.N` are not decoder blocks.
const LAYER_PREFIXES: [&str; 4] = [
    "blk.",
    "model.layers.",
    "model.language_model.layers.",
    "language_model.model.layers.",
];

/// Split `blk.N.rest` / `model.layers.N.rest` (or a multimodal language model's
/// `model.language_model.layers.N.rest`) into the layer number and the rest.
fn split_layer(name: &str) -> Option<(u32, &str)> {
    let rest = LAYER_PREFIXES
        .iter()
        .find_map(|prefix| name.strip_prefix(prefix))?;
    let (num, tail) = rest.split_once('.')?;
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((num.parse().ok()?, tail))
}

/// The repeating block a tensor belongs to, whatever the architecture: `N` in `blk.N.` or
/// `model.layers.N.`.
pub(crate) fn layer_of(name: &str) -> Option<u32> {
    split_layer(name).map(|(n, _)| n)
}

/// The tensors a GPTQ (auto-gptq, gptqmodel) or EXL2 (exllamav2) linear stores in place of its
/// `weight`. They take the role of the weight they replace, so each lands in its layer and a
/// quantised `lm_head` counts as the output projection.
const QUANT_PARTS: [&str; 10] = [
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "q_weight",
    "q_invperm",
    "q_scale",
    "q_scale_max",
    "q_groups",
    "q_perm",
];

/// The parts of a packed linear its product reads each time it runs (GPTQ: codes, zeros and
/// scales; EXL2: codes, scales and the scales' maxima); the others are index tables, read
/// once when the checkpoint opens.
const PRODUCT_PARTS: [&str; 6] = [
    "qweight",
    "qzeros",
    "scales",
    "q_weight",
    "q_scale",
    "q_scale_max",
];

/// Whether `name` is a part of a GPTQ or EXL2 linear that its product reads each time it runs
/// (what an offloaded layer must have beside its compute).
pub fn is_packed_product_part(name: &str) -> bool {
    name.rsplit_once('.')
        .is_some_and(|(_, part)| PRODUCT_PARTS.contains(&part))
}

/// Whether `name` is one of the tensors a GPTQ or EXL2 linear stores in place of its weight
/// (its shapes are the quantisation's, checked when the checkpoint opens).
pub fn is_quantized_part(name: &str) -> bool {
    name.rsplit_once('.')
        .is_some_and(|(_, part)| QUANT_PARTS.contains(&part))
}

/// The role of a tensor in the llama family, in either naming scheme; `None` for a name that
/// matches no role.
pub(crate) fn role_of(name: &str) -> Option<Role> {
    if let Some((module, part)) = name.rsplit_once('.')
        && QUANT_PARTS.contains(&part)
    {
        return role_of(&format!("{module}.weight"));
    }
    if let Some((_, tail)) = split_layer(name) {
        return per_layer_role(tail);
    }
    Some(match name {
        "token_embd.weight" | "model.embed_tokens.weight" => Role::TokenEmbd,
        "output_norm.weight" | "model.norm.weight" => Role::OutputNorm,
        "output.weight" | "lm_head.weight" => Role::Output,
        "rope_freqs.weight" => Role::RopeFreqs,
        "rope_factors_long.weight" | "rope_factors_short.weight" => Role::RopeFactors,
        _ => return None,
    })
}

fn per_layer_role(tail: &str) -> Option<Role> {
    Some(match tail {
        "attn_norm.weight" | "input_layernorm.weight" => Role::AttnNorm,
        "attn_q.weight" | "self_attn.q_proj.weight" => Role::AttnQ,
        "attn_k.weight" | "self_attn.k_proj.weight" => Role::AttnK,
        "attn_v.weight" | "self_attn.v_proj.weight" => Role::AttnV,
        "attn_output.weight" | "self_attn.o_proj.weight" => Role::AttnOutput,
        "attn_q.bias" | "self_attn.q_proj.bias" => Role::AttnQBias,
        "attn_k.bias" | "self_attn.k_proj.bias" => Role::AttnKBias,
        "attn_v.bias" | "self_attn.v_proj.bias" => Role::AttnVBias,
        "attn_output.bias" | "self_attn.o_proj.bias" => Role::AttnOutputBias,
        "attn_q_norm.weight" | "self_attn.q_norm.weight" => Role::AttnQNorm,
        "attn_k_norm.weight" | "self_attn.k_norm.weight" => Role::AttnKNorm,
        "attn_qkv.weight" | "self_attn.qkv_proj.weight" => Role::AttnQkv,
        "mlp.gate_up_proj.weight" => Role::FfnGateUp,
        "ffn_norm.weight" | "post_attention_layernorm.weight" => Role::FfnNorm,
        "ffn_gate.weight" | "mlp.gate_proj.weight" => Role::FfnGate,
        "ffn_up.weight" | "mlp.up_proj.weight" => Role::FfnUp,
        "ffn_down.weight" | "mlp.down_proj.weight" => Role::FfnDown,
        "post_attention_norm.weight" => Role::AttnPostNorm,
        "post_ffw_norm.weight" | "post_feedforward_layernorm.weight" => Role::FfnPostNorm,
        "pre_feedforward_layernorm.weight" => Role::FfnNorm,
        "ffn_gate_inp.weight" | "mlp.gate.weight" | "block_sparse_moe.gate.weight" => {
            Role::FfnGateInp
        }
        "ffn_gate_exps.weight" => Role::FfnGateExps,
        "ffn_up_exps.weight" => Role::FfnUpExps,
        "ffn_down_exps.weight" => Role::FfnDownExps,
        _ => return expert_role(tail).map(|(_, r)| r),
    })
}

/// One expert's projection in transformers' naming: qwen3moe's (and qwen2moe's)
/// `mlp.experts.E.{gate,up,down}_proj.weight`, mixtral's `block_sparse_moe.experts.E.w1` (gate),
/// `w3` (up) and `w2` (down).
fn expert_role(tail: &str) -> Option<(u32, Role)> {
    let rest = tail
        .strip_prefix("mlp.experts.")
        .or_else(|| tail.strip_prefix("block_sparse_moe.experts."))?;
    let (num, part) = rest.split_once('.')?;
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let role = match part {
        "gate_proj.weight" | "w1.weight" => Role::FfnGateExps,
        "up_proj.weight" | "w3.weight" => Role::FfnUpExps,
        "down_proj.weight" | "w2.weight" => Role::FfnDownExps,
        _ => return None,
    };
    Some((num.parse().ok()?, role))
}

/// The expert a tensor of one expert belongs to (`E` in transformers'
/// `model.layers.N.mlp.experts.E.gate_proj.weight`); `None` for every other tensor, GGUF's
/// stacked `ffn_*_exps` included.
pub fn expert_of(name: &str) -> Option<u32> {
    let (_, tail) = split_layer(name)?;
    expert_role(tail).map(|(e, _)| e)
}

/// (layer, role) of a tensor. The layer is parsed for every architecture; the role only for
/// the supported ones (`None` otherwise, or when the name matches no role).
pub(crate) fn classify(name: &str, architecture: &str) -> (Option<u32>, Option<Role>) {
    let layer = layer_of(name);
    let role = if supports_roles(architecture) {
        match role_of(name) {
            Some(Role::FfnNorm)
                if is_gemma(architecture) && name.ends_with("post_attention_layernorm.weight") =>
            {
                Some(Role::AttnPostNorm)
            }
            r => r,
        }
    } else {
        None
    };
    // llama.cpp keeps the name `ffn_up` for phi3's stacked gate and up.
    let role = match role {
        Some(Role::FfnUp) if fused_projections(architecture) && name.starts_with("blk.") => {
            Some(Role::FfnGateUp)
        }
        r => r,
    };
    // A per-layer role outside a block, or a global role inside one, is not that role.
    let role = role.filter(|r| r.is_per_layer() == layer.is_some());
    (layer, role)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gguf-py's `tensor_mapping.py` maps both transformers' routers and experts to llama.cpp's
    /// `ffn_gate_inp` and `ffn_{gate,up,down}_exps`.
    #[test]
    fn experts_in_both_schemes() {
        for (name, role, expert) in [
            ("blk.1.ffn_gate_inp.weight", Role::FfnGateInp, None),
            ("model.layers.1.mlp.gate.weight", Role::FfnGateInp, None),
            (
                "model.layers.1.block_sparse_moe.gate.weight",
                Role::FfnGateInp,
                None,
            ),
            ("blk.1.ffn_gate_exps.weight", Role::FfnGateExps, None),
            ("blk.1.ffn_up_exps.weight", Role::FfnUpExps, None),
            ("blk.1.ffn_down_exps.weight", Role::FfnDownExps, None),
            (
                "model.layers.1.mlp.experts.7.gate_proj.weight",
                Role::FfnGateExps,
                Some(7),
            ),
            (
                "model.layers.1.mlp.experts.7.up_proj.weight",
                Role::FfnUpExps,
                Some(7),
            ),
            (
                "model.layers.1.mlp.experts.12.down_proj.weight",
                Role::FfnDownExps,
                Some(12),
            ),
            (
                "model.layers.1.block_sparse_moe.experts.3.w1.weight",
                Role::FfnGateExps,
                Some(3),
            ),
            (
                "model.layers.1.block_sparse_moe.experts.3.w3.weight",
                Role::FfnUpExps,
                Some(3),
            ),
            (
                "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                Role::FfnDownExps,
                Some(3),
            ),
        ] {
            assert_eq!(classify(name, "qwen3moe"), (Some(1), Some(role)), "{name}");
            assert_eq!(expert_of(name), expert, "{name}");
        }
        for name in [
            "model.layers.1.mlp.experts.x.gate_proj.weight",
            "model.layers.1.mlp.experts.3.w4.weight",
            "model.layers.1.mlp.experts..up_proj.weight",
        ] {
            assert_eq!(role_of(name), None, "{name}");
            assert_eq!(expert_of(name), None, "{name}");
        }
    }

    #[test]
    fn a_multimodal_language_model_has_the_decoder_blocks() {
        for name in [
            "model.language_model.layers.7.mlp.up_proj.weight",
            "language_model.model.layers.7.mlp.up_proj.weight",
        ] {
            assert_eq!(layer_of(name), Some(7), "{name}");
            assert_eq!(role_of(name), Some(Role::FfnUp), "{name}");
        }
        for name in [
            "vision_tower.encoder.layers.0.mlp.fc1.weight",
            "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
            "model.language_model.layers.x.mlp.up_proj.weight",
        ] {
            assert_eq!(layer_of(name), None, "{name}");
        }
    }

    #[test]
    fn both_schemes_agree() {
        let pairs = [
            ("token_embd.weight", "model.embed_tokens.weight"),
            (
                "blk.3.attn_norm.weight",
                "model.layers.3.input_layernorm.weight",
            ),
            (
                "blk.3.attn_q.weight",
                "model.layers.3.self_attn.q_proj.weight",
            ),
            ("blk.3.attn_k.bias", "model.layers.3.self_attn.k_proj.bias"),
            (
                "blk.3.attn_output.weight",
                "model.layers.3.self_attn.o_proj.weight",
            ),
            (
                "blk.3.ffn_norm.weight",
                "model.layers.3.post_attention_layernorm.weight",
            ),
            (
                "blk.3.ffn_gate.weight",
                "model.layers.3.mlp.gate_proj.weight",
            ),
            ("blk.3.ffn_up.weight", "model.layers.3.mlp.up_proj.weight"),
            (
                "blk.3.ffn_down.weight",
                "model.layers.3.mlp.down_proj.weight",
            ),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.3.attn_q_norm.weight",
                "model.layers.3.self_attn.q_norm.weight",
            ),
            (
                "blk.3.attn_k_norm.weight",
                "model.layers.3.self_attn.k_norm.weight",
            ),
        ];
        for (g, h) in pairs {
            let a = classify(g, "llama");
            assert!(a.1.is_some(), "{g}");
            assert_eq!(a, classify(h, "qwen2"), "{g} vs {h}");
        }
        assert_eq!(
            classify("blk.12.attn_v.weight", "mistral"),
            (Some(12), Some(Role::AttnV))
        );
    }

    #[test]
    fn quantised_parts_take_their_weights_role() {
        for part in QUANT_PARTS {
            assert_eq!(
                classify(&format!("model.layers.4.mlp.down_proj.{part}"), "llama"),
                (Some(4), Some(Role::FfnDown)),
                "{part}"
            );
            assert_eq!(
                classify(&format!("lm_head.{part}"), "qwen2"),
                (None, Some(Role::Output)),
                "{part}"
            );
        }
        // The bias of a quantised linear keeps its own role; unknown modules stay unknown.
        assert_eq!(
            classify("model.layers.1.self_attn.k_proj.bias", "qwen2"),
            (Some(1), Some(Role::AttnKBias))
        );
        assert_eq!(
            classify("model.layers.1.mlp.experts.0.qweight", "llama"),
            (Some(1), None)
        );
        assert_eq!(
            classify("model.layers.1.mlp.down_proj.zeros", "llama").1,
            None
        );
    }

    #[test]
    fn phi3_fused_projections_in_both_schemes() {
        for (g, h) in [
            (
                "blk.2.attn_qkv.weight",
                "model.layers.2.self_attn.qkv_proj.weight",
            ),
            (
                "blk.2.ffn_up.weight",
                "model.layers.2.mlp.gate_up_proj.weight",
            ),
        ] {
            let a = classify(g, "phi3");
            assert!(matches!(a.1, Some(Role::AttnQkv | Role::FfnGateUp)), "{g}");
            assert_eq!(a, classify(h, "phi3"), "{g} vs {h}");
        }
        // another architecture's ffn_up stays the up projection
        assert_eq!(
            classify("blk.2.ffn_up.weight", "llama").1,
            Some(Role::FfnUp)
        );
    }

    #[test]
    fn gemma_norms_in_both_schemes() {
        for arch in ["gemma2", "gemma3", "gemma3_text"] {
            for (gguf, hf, role) in [
                (
                    "post_attention_norm",
                    "post_attention_layernorm",
                    Role::AttnPostNorm,
                ),
                ("ffn_norm", "pre_feedforward_layernorm", Role::FfnNorm),
                (
                    "post_ffw_norm",
                    "post_feedforward_layernorm",
                    Role::FfnPostNorm,
                ),
                ("attn_q_norm", "self_attn.q_norm", Role::AttnQNorm),
                ("attn_k_norm", "self_attn.k_norm", Role::AttnKNorm),
            ] {
                let g = classify(&format!("blk.2.{gguf}.weight"), arch);
                let h = classify(&format!("model.layers.2.{hf}.weight"), arch);
                assert_eq!(g, (Some(2), Some(role)), "{arch} {gguf}");
                assert_eq!(h, (Some(2), Some(role)), "{arch} {hf}");
            }
        }
        // the llama family's post_attention_layernorm is the MLP's norm
        assert_eq!(
            classify("model.layers.0.post_attention_layernorm.weight", "llama"),
            (Some(0), Some(Role::FfnNorm))
        );
    }

    #[test]
    fn unsupported_and_unknown() {
        assert_eq!(classify("blk.7.attn_q.weight", "gpt2"), (Some(7), None));
        assert_eq!(
            classify("model.layers.0.mlp.experts.weight", "llama"),
            (Some(0), None)
        );
        assert_eq!(classify("blk.x.attn_q.weight", "llama"), (None, None));
        assert_eq!(
            classify("blk.99999999999.attn_q.weight", "llama"),
            (None, None)
        );
        assert_eq!(classify("blk..attn_q.weight", "llama"), (None, None));
        assert_eq!(classify("blk.+1.attn_q.weight", "llama"), (None, None));
    }
}

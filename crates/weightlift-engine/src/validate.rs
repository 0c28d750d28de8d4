//! Validation at load: the tensors a checkpoint holds against what its architecture needs
//! (missing and unexpected tensors, listed by name, and shape mismatches), in the way
//! llama.cpp's loader checks `create_tensor` against the file.

use std::collections::HashSet;

use weightlift_format::{ModelSpec, MoeSpec, Role};

use crate::error::{EngineError, Result};
use crate::source::Source;

const PER_LAYER: [Role; 9] = [
    Role::AttnNorm,
    Role::AttnQ,
    Role::AttnK,
    Role::AttnV,
    Role::AttnOutput,
    Role::FfnNorm,
    Role::FfnGate,
    Role::FfnUp,
    Role::FfnDown,
];

/// The name a missing tensor would have, in the checkpoint's own naming scheme.
fn name_for(role: Role, layer: Option<u32>, gguf: bool) -> String {
    let l = layer.unwrap_or(0);
    if gguf {
        let base = match role {
            Role::TokenEmbd => return "token_embd.weight".into(),
            // llama.cpp keeps the up projection's name for phi3's stacked gate and up
            Role::FfnGateUp => "ffn_up",
            Role::OutputNorm => return "output_norm.weight".into(),
            Role::Output => return "output.weight".into(),
            r => r.name(),
        };
        format!("blk.{l}.{base}.weight")
    } else {
        let base = match role {
            Role::TokenEmbd => return "model.embed_tokens.weight".into(),
            Role::OutputNorm => return "model.norm.weight".into(),
            Role::Output => return "lm_head.weight".into(),
            Role::AttnNorm => "input_layernorm",
            Role::AttnQ => "self_attn.q_proj",
            Role::AttnK => "self_attn.k_proj",
            Role::AttnV => "self_attn.v_proj",
            Role::AttnOutput => "self_attn.o_proj",
            Role::FfnNorm => "post_attention_layernorm",
            Role::FfnGate => "mlp.gate_proj",
            Role::FfnUp => "mlp.up_proj",
            Role::FfnDown => "mlp.down_proj",
            Role::AttnQNorm => "self_attn.q_norm",
            Role::AttnKNorm => "self_attn.k_norm",
            Role::AttnQkv => "self_attn.qkv_proj",
            Role::FfnGateUp => "mlp.gate_up_proj",
            Role::FfnGateInp => "mlp.gate",
            Role::FfnGateExps => "mlp.experts.<E>.gate_proj",
            Role::FfnUpExps => "mlp.experts.<E>.up_proj",
            Role::FfnDownExps => "mlp.experts.<E>.down_proj",
            r => r.name(),
        };
        format!("model.layers.{l}.{base}.weight")
    }
}

/// The expected numpy-order shape of a weight, when the role has a fixed one.
fn expected_shape(spec: &ModelSpec, role: Role, layer: Option<u32>) -> Option<Vec<u64>> {
    let h = spec.hidden_size;
    let hd = u64::from(spec.head_dim);
    let q = u64::from(spec.n_heads) * hd;
    let kv = u64::from(spec.n_kv_heads_at(layer.unwrap_or(0))) * hd;
    Some(match role {
        Role::TokenEmbd | Role::Output => vec![spec.vocab_size, h],
        Role::AttnNorm | Role::FfnNorm | Role::OutputNorm => vec![h],
        Role::AttnQ => vec![q, h],
        Role::AttnK | Role::AttnV => vec![kv, h],
        Role::AttnOutput => vec![h, q],
        Role::FfnGate | Role::FfnUp => vec![spec.intermediate_size, h],
        Role::FfnDown => vec![h, spec.intermediate_size],
        Role::AttnQNorm | Role::AttnKNorm => vec![hd],
        Role::AttnQkv => vec![q + 2 * kv, h],
        Role::FfnGateUp => vec![2 * spec.intermediate_size, h],
        _ => return None,
    })
}

/// Check `source` against its architecture. Returns warnings (e.g. "architecture unknown,
/// not validated"); fails with [`EngineError::Validation`] listing every problem.
pub fn validate(source: &dyn Source) -> Result<Vec<String>> {
    let Some(spec) = source.spec() else {
        return Ok(vec![format!(
            "{}: no architecture could be read; tensors were not validated",
            source.path().display()
        )]);
    };
    if !ModelSpec::supports_roles(&spec.architecture) {
        return Ok(vec![format!(
            "architecture '{}' has no known tensor roles; tensors were not validated",
            spec.architecture
        )]);
    }
    let tensors = source.tensors();
    let gguf = tensors
        .iter()
        .any(|t| t.name.starts_with("blk.") || t.name == "token_embd.weight");
    let present: HashSet<(Option<u32>, Role)> = tensors
        .iter()
        .filter_map(|t| t.role.map(|r| (t.layer, r)))
        .collect();
    let mut missing = Vec::new();
    let mut globals = vec![Role::TokenEmbd, Role::OutputNorm];
    if !spec.tie_word_embeddings {
        globals.push(Role::Output);
    }
    for r in globals {
        if !present.contains(&(None, r)) {
            missing.push(name_for(r, None, gguf));
        }
    }
    let qk_norm: &[Role] = if spec.per_head_qk_norm() {
        &[Role::AttnQNorm, Role::AttnKNorm]
    } else {
        &[]
    };
    // phi3 stacks q, k and v in one matrix, and gate and up in another
    let fused = [
        Role::AttnNorm,
        Role::AttnQkv,
        Role::AttnOutput,
        Role::FfnNorm,
        Role::FfnGateUp,
        Role::FfnDown,
    ];
    let per_layer: &[Role] = if spec.fused_projections() {
        &fused
    } else {
        &PER_LAYER
    };
    // a mixture-of-experts layer has a router and experts where a dense one has its MLP
    let moe = [
        Role::FfnGateInp,
        Role::FfnGateExps,
        Role::FfnUpExps,
        Role::FfnDownExps,
    ];
    let dense_mlp = [Role::FfnGate, Role::FfnUp, Role::FfnDown, Role::FfnGateUp];
    let has = |l: u32, r: &Role| present.contains(&(Some(l), *r));
    // Each layer's MLP is what its tensors hold: a layer with a router or an expert routes,
    // the others run a dense MLP (a Qwen MoE may mix them; llama.cpp's qwen3moe loader wants
    // a router in every layer). In a model with experts a layer holding neither is named as
    // missing both.
    let moe_model = (0..spec.n_layers).any(|l| moe.iter().any(|r| has(l, r)));
    for l in 0..spec.n_layers {
        let routed = moe.iter().any(|r| has(l, r));
        let no_mlp = moe_model && !routed && !dense_mlp.iter().any(|r| has(l, r));
        if no_mlp {
            missing.push(format!(
                "{} with its experts, or a dense MLP ({})",
                name_for(Role::FfnGateInp, Some(l), gguf),
                name_for(Role::FfnGate, Some(l), gguf)
            ));
        }
        let roles = per_layer.iter().filter(|r| {
            let mlp = matches!(r, Role::FfnGate | Role::FfnUp | Role::FfnDown);
            !(mlp && (routed || no_mlp))
        });
        let experts = if routed { &moe[..] } else { &[] };
        for &r in roles.chain(qk_norm).chain(experts) {
            if !has(l, &r) {
                missing.push(name_for(r, Some(l), gguf));
            }
        }
    }
    // The config (its `decoder_sparse_step` and `mlp_only_layers`) must say of each layer
    // what its tensors hold, as transformers would load them: a plan from the config alone
    // would otherwise differ from the checkpoint's
    let mut disagree = Vec::new();
    let config_moe = source
        .checkpoint()
        .and_then(|c| c.config())
        .map(MoeSpec::from_hf_config);
    if let Some(Ok(Some(m))) = config_moe.filter(|_| moe_model) {
        for l in 0..spec.n_layers {
            let routed = moe.iter().any(|r| has(l, r));
            if routed != m.routes(l) {
                let (holds, says) = if routed {
                    ("a router", "dense")
                } else {
                    ("a dense MLP", "routed")
                };
                disagree.push(format!(
                    "layer {l} holds {holds}, config.json makes it {says}"
                ));
            }
        }
    }
    let mut unexpected = Vec::new();
    let mut shapes = Vec::new();
    for t in tensors {
        let out_of_range = t.layer.is_some_and(|l| l >= spec.n_layers);
        match t.role {
            None => unexpected.push(t.name.clone()),
            Some(_) if out_of_range => unexpected.push(t.name.clone()),
            // a GPTQ/EXL2 part: the format crate checked its shape against the quantisation
            Some(_) if weightlift_format::is_quantized_part(&t.name) => {}
            Some(r) => {
                if let Some(want) = expected_shape(spec, r, t.layer)
                    && want != t.shape
                {
                    shapes.push(format!(
                        "'{}' has shape {:?}, expected {:?}",
                        t.name, t.shape, want
                    ));
                }
            }
        }
    }
    let mut problems = Vec::new();
    if !missing.is_empty() {
        problems.push(format!("missing tensors: {}", missing.join(", ")));
    }
    if !unexpected.is_empty() {
        problems.push(format!("unexpected tensors: {}", unexpected.join(", ")));
    }
    if !shapes.is_empty() {
        problems.push(format!("shape mismatches: {}", shapes.join("; ")));
    }
    if !disagree.is_empty() {
        problems.push(format!(
            "layers against decoder_sparse_step and mlp_only_layers: {}",
            disagree.join("; ")
        ));
    }
    if problems.is_empty() {
        return Ok(Vec::new());
    }
    Err(EngineError::Validation {
        path: source.path().to_path_buf(),
        architecture: spec.architecture.clone(),
        problems: problems.join("; "),
    })
}

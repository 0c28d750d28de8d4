//! Planning from a config alone: the exact tensor table of a llama-family model, derived from its
//! [`ModelSpec`] and a weight type, plus the `dtype=` conversion of float weights.
//!
//! Tensor names follow GGUF (`blk.N.attn_q.weight`); shapes are row-major (`[out, in]`).

use serde::{Deserialize, Serialize};
use weightlift_format::{DType, ModelSpec, MoeSpec, Role, TensorInfo};

use crate::error::{PlanError, Result};

/// A llama.cpp quantisation preset (`llama-quantize`'s ftype), reduced to the rules that decide
/// tensor sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantPreset {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4KS,
    Q4KM,
    Q5KS,
    Q5KM,
    Q6K,
}

impl QuantPreset {
    pub const ALL: &'static [QuantPreset] = &[
        QuantPreset::F32,
        QuantPreset::F16,
        QuantPreset::Bf16,
        QuantPreset::Q8_0,
        QuantPreset::Q4_0,
        QuantPreset::Q4_1,
        QuantPreset::Q5_0,
        QuantPreset::Q5_1,
        QuantPreset::Q4KS,
        QuantPreset::Q4KM,
        QuantPreset::Q5KS,
        QuantPreset::Q5KM,
        QuantPreset::Q6K,
    ];

    /// llama-quantize's spelling, lower-case: `"q4_k_m"`.
    pub const fn name(self) -> &'static str {
        match self {
            QuantPreset::F32 => "f32",
            QuantPreset::F16 => "f16",
            QuantPreset::Bf16 => "bf16",
            QuantPreset::Q8_0 => "q8_0",
            QuantPreset::Q4_0 => "q4_0",
            QuantPreset::Q4_1 => "q4_1",
            QuantPreset::Q5_0 => "q5_0",
            QuantPreset::Q5_1 => "q5_1",
            QuantPreset::Q4KS => "q4_k_s",
            QuantPreset::Q4KM => "q4_k_m",
            QuantPreset::Q5KS => "q5_k_s",
            QuantPreset::Q5KM => "q5_k_m",
            QuantPreset::Q6K => "q6_k",
        }
    }

    /// The default type of 2-D weights.
    const fn base(self) -> DType {
        match self {
            QuantPreset::F32 => DType::F32,
            QuantPreset::F16 => DType::F16,
            QuantPreset::Bf16 => DType::BF16,
            QuantPreset::Q8_0 => DType::Q8_0,
            QuantPreset::Q4_0 => DType::Q4_0,
            QuantPreset::Q4_1 => DType::Q4_1,
            QuantPreset::Q5_0 => DType::Q5_0,
            QuantPreset::Q5_1 => DType::Q5_1,
            QuantPreset::Q4KS | QuantPreset::Q4KM => DType::Q4_K,
            QuantPreset::Q5KS | QuantPreset::Q5KM => DType::Q5_K,
            QuantPreset::Q6K => DType::Q6_K,
        }
    }

    const fn is_quantized(self) -> bool {
        !matches!(
            self,
            QuantPreset::F32 | QuantPreset::F16 | QuantPreset::Bf16
        )
    }
}

/// The weight type a config-only plan assumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum WeightType {
    /// Every tensor, 1-D ones included, in one type: an HF safetensors checkpoint in
    /// `torch_dtype` (`"float16"`, `"bfloat16"`, `"float32"`).
    Dense(DType),
    /// A GGUF file as `llama-quantize` (or `convert_hf_to_gguf --outtype`) would write it:
    /// 1-D tensors stay F32 and 2-D weights follow the preset's mix.
    Gguf(QuantPreset),
}

impl WeightType {
    /// Parse `"float16"`, `"bfloat16"`, `"float32"` (dense, as safetensors) or a llama.cpp
    /// preset name such as `"f16"`, `"q8_0"`, `"q4_k_m"` (GGUF).
    pub fn parse(s: &str) -> Result<WeightType> {
        let l = s.trim().to_ascii_lowercase();
        match l.as_str() {
            "float16" | "fp16" | "half" => return Ok(WeightType::Dense(DType::F16)),
            "bfloat16" => return Ok(WeightType::Dense(DType::BF16)),
            "float32" | "fp32" | "float" => return Ok(WeightType::Dense(DType::F32)),
            _ => {}
        }
        QuantPreset::ALL
            .iter()
            .find(|p| p.name() == l)
            .map(|p| WeightType::Gguf(*p))
            .ok_or_else(|| {
                PlanError::option(
                    "weight type",
                    "float16, bfloat16, float32 or a llama.cpp preset (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k)",
                    format!("'{s}'"),
                )
            })
    }
}

/// llama.cpp's `use_more_bits(i, n)`: the first and last eighth of the layers, and every third
/// one in between, get more bits in the `_M` presets.
fn use_more_bits(i: u64, n: u64) -> bool {
    if i < n / 8 || i >= 7 * n / 8 {
        return true;
    }
    (i - n / 8) % 3 == 2
}

/// The type llama.cpp would give one 2-D tensor under `preset` (`llama_tensor_get_type`,
/// simplified to what decides the bytes):
///
/// - `output.weight` (or `token_embd.weight` when the output is tied to it) gets Q6_K unless
///   the preset's type is already Q8_0 or a float type;
/// - `_M` presets (q4_k_m, q5_k_m): `attn_v` and `ffn_down` get Q6_K in the layers where
///   `use_more_bits(layer, n_layer)` holds;
/// - `_S` presets: q4_k_s gives `ffn_down` Q5_K in the first eighth of the layers; q5_k_s has
///   no exceptions here;
/// - everything else gets the preset's base type.
///
/// `attn_v` stands for every value-bearing matrix here (phi3's fused `attn_qkv` too, as
/// llama.cpp counts it), and `ffn_down` for the experts' stacked `ffn_down_exps` as well:
///
/// - `_M` presets also give Q6_K to `attn_v` in the layers where `use_more_bits` holds, and
///   q4_k_s gives Q5_K to `attn_v` in the first four layers;
/// - a model of exactly 8 experts (Mixtral) gets `attn_v` and `attn_k` in Q8_0, and its
///   `attn_output` in Q5_K under q4_k_s and q4_k_m;
/// - the router (`ffn_gate_inp`) is never quantised: it stays F32, as the converter writes it.
///
/// Then llama.cpp's fallback for rows that are not a whole number of blocks: Q4_K -> Q5_0,
/// Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when even 32 does not divide the row.
/// Other architecture-specific exceptions (Falcon, 70B-GQA `attn_v` Q5_K bumps) are not
/// modelled.
pub fn gguf_type(
    preset: QuantPreset,
    role: Role,
    layer: Option<u32>,
    n_layers: u32,
    tied: bool,
    row: u64,
) -> DType {
    gguf_type_of(preset, role, layer, n_layers, tied, row, 0)
}

/// [`gguf_type`] for a model of `n_experts` routed experts (0 for a dense model).
pub fn gguf_type_of(
    preset: QuantPreset,
    role: Role,
    layer: Option<u32>,
    n_layers: u32,
    tied: bool,
    row: u64,
    n_experts: u32,
) -> DType {
    if role == Role::FfnGateInp {
        return DType::F32;
    }
    if !preset.is_quantized() {
        return preset.base();
    }
    let base = preset.base();
    let is_output = role == Role::Output || (tied && role == Role::TokenEmbd);
    let i = u64::from(layer.unwrap_or(0));
    let n = u64::from(n_layers);
    let eight_experts = n_experts == 8;
    let mut t = if is_output {
        if base == DType::Q8_0 {
            base
        } else {
            DType::Q6_K
        }
    } else {
        match (preset, role) {
            (_, Role::AttnV | Role::AttnQkv | Role::AttnK) if eight_experts => DType::Q8_0,
            (
                QuantPreset::Q4KM | QuantPreset::Q5KM,
                Role::AttnV | Role::AttnQkv | Role::FfnDown | Role::FfnDownExps,
            ) if use_more_bits(i, n) => DType::Q6_K,
            (QuantPreset::Q4KS, Role::AttnV | Role::AttnQkv) if i < 4 => DType::Q5_K,
            (QuantPreset::Q4KS, Role::FfnDown | Role::FfnDownExps) if i < n / 8 => DType::Q5_K,
            (QuantPreset::Q4KS | QuantPreset::Q4KM, Role::AttnOutput) if eight_experts => {
                DType::Q5_K
            }
            _ => base,
        }
    };
    if !row.is_multiple_of(t.block_size()) {
        t = match t {
            DType::Q4_K => DType::Q5_0,
            DType::Q5_K => DType::Q5_1,
            DType::Q6_K => DType::Q8_0,
            other => other,
        };
        if !row.is_multiple_of(t.block_size()) {
            t = DType::F16;
        }
    }
    t
}

fn check_spec(spec: &ModelSpec) -> Result<()> {
    let bad = |d: &str| {
        Err(PlanError::Spec {
            detail: d.to_string(),
        })
    };
    if spec.n_layers == 0
        || spec.hidden_size == 0
        || spec.n_heads == 0
        || spec.head_dim == 0
        || spec.vocab_size == 0
    {
        return bad("n_layers, hidden_size, n_heads, head_dim and vocab_size must all be positive");
    }
    if spec.n_kv_heads.len() != spec.n_layers as usize {
        return bad(&format!(
            "n_kv_heads has {} entries, expected one per layer ({})",
            spec.n_kv_heads.len(),
            spec.n_layers
        ));
    }
    Ok(())
}

/// The exact tensor table of a llama-family model (llama, mistral, qwen2, smollm, ...) derived
/// from its config: `token_embd`, per layer `attn_norm`, `attn_q/k/v/output` (with q/k/v biases
/// when `attention_bias`, as qwen2 has, and per-head `attn_q_norm`/`attn_k_norm` of `head_dim`
/// when the architecture norms its heads, as qwen3 does), `ffn_norm`, `ffn_gate/up/down`, then
/// `output_norm` and
/// `output` unless the embeddings are tied; phi3's layers hold `attn_qkv` and a `ffn_up` of both
/// gate and up in place of the separate projections, and Gemma's a `post_attention_norm` and a
/// `post_ffw_norm`. A model routed to experts (`moe`) holds in every layer it routes
/// ([`MoeSpec::routes`]), in place of the dense MLP, the router `ffn_gate_inp`
/// (`[n_experts, hidden]`, F32 in GGUF) and the experts stacked as llama.cpp's converter
/// writes them: `ffn_gate_exps` and `ffn_up_exps` (`[n_experts, expert_ffn, hidden]`) and
/// `ffn_down_exps` (`[n_experts, hidden, expert_ffn]`); its dense layers (`dense_layers`) hold
/// the dense MLP of `intermediate_size`. LongRoPE's two small factor tables (phi3's 128k
/// variants) are [`longrope_tensors`]. `file` and `offset` are 0: nothing is read.
pub fn synthesize_tensors(
    spec: &ModelSpec,
    weights: WeightType,
    moe: Option<&MoeSpec>,
) -> Result<Vec<TensorInfo>> {
    check_spec(spec)?;
    let n_experts = moe.map_or(0, |m| m.n_experts);
    let h = spec.hidden_size;
    let q_dim = u64::from(spec.n_heads) * u64::from(spec.head_dim);
    let i_dim = spec.intermediate_size;
    let tied = spec.tie_word_embeddings;
    let mut out = Vec::with_capacity(spec.n_layers as usize * 16 + 4);
    let mut push = |name: String, role: Role, layer: Option<u32>, shape: Vec<u64>| -> Result<()> {
        let dtype = match weights {
            WeightType::Dense(d) => d,
            WeightType::Gguf(p) if shape.len() == 1 => {
                let _ = p;
                DType::F32
            }
            WeightType::Gguf(p) => gguf_type_of(
                p,
                role,
                layer,
                spec.n_layers,
                tied,
                *shape.last().unwrap_or(&1),
                n_experts,
            ),
        };
        let n: u64 = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| PlanError::Tensor {
                tensor: name.clone(),
                detail: "element count overflows 64 bits; the config is corrupted".into(),
            })?;
        let nbytes = dtype.bytes_for(n).ok_or_else(|| PlanError::Tensor {
            tensor: name.clone(),
            detail: format!(
                "{n} elements are not a whole number of {dtype} blocks of {}",
                dtype.block_size()
            ),
        })?;
        out.push(TensorInfo {
            name,
            dtype,
            shape,
            nbytes,
            file: 0,
            offset: 0,
            layer,
            role: Some(role),
        });
        Ok(())
    };
    push(
        "token_embd.weight".into(),
        Role::TokenEmbd,
        None,
        vec![spec.vocab_size, h],
    )?;
    for l in 0..spec.n_layers {
        let kv_dim = u64::from(spec.n_kv_heads[l as usize]) * u64::from(spec.head_dim);
        let p = |s: &str| format!("blk.{l}.{s}");
        let ly = Some(l);
        push(p("attn_norm.weight"), Role::AttnNorm, ly, vec![h])?;
        if spec.fused_projections() {
            let rows = q_dim + 2 * kv_dim;
            push(p("attn_qkv.weight"), Role::AttnQkv, ly, vec![rows, h])?;
        } else {
            push(p("attn_q.weight"), Role::AttnQ, ly, vec![q_dim, h])?;
            push(p("attn_k.weight"), Role::AttnK, ly, vec![kv_dim, h])?;
            push(p("attn_v.weight"), Role::AttnV, ly, vec![kv_dim, h])?;
        }
        if spec.attention_bias {
            push(p("attn_q.bias"), Role::AttnQBias, ly, vec![q_dim])?;
            push(p("attn_k.bias"), Role::AttnKBias, ly, vec![kv_dim])?;
            push(p("attn_v.bias"), Role::AttnVBias, ly, vec![kv_dim])?;
        }
        if spec.per_head_qk_norm() {
            let hd = u64::from(spec.head_dim);
            push(p("attn_q_norm.weight"), Role::AttnQNorm, ly, vec![hd])?;
            push(p("attn_k_norm.weight"), Role::AttnKNorm, ly, vec![hd])?;
        }
        push(
            p("attn_output.weight"),
            Role::AttnOutput,
            ly,
            vec![h, q_dim],
        )?;
        if spec.post_norms() {
            push(
                p("post_attention_norm.weight"),
                Role::AttnPostNorm,
                ly,
                vec![h],
            )?;
        }
        push(p("ffn_norm.weight"), Role::FfnNorm, ly, vec![h])?;
        if let Some(m) = moe.filter(|m| m.routes(l)) {
            let (e, f) = (u64::from(m.n_experts), m.expert_ffn);
            push(p("ffn_gate_inp.weight"), Role::FfnGateInp, ly, vec![e, h])?;
            push(
                p("ffn_gate_exps.weight"),
                Role::FfnGateExps,
                ly,
                vec![e, f, h],
            )?;
            push(p("ffn_up_exps.weight"), Role::FfnUpExps, ly, vec![e, f, h])?;
            push(
                p("ffn_down_exps.weight"),
                Role::FfnDownExps,
                ly,
                vec![e, h, f],
            )?;
        } else {
            if spec.fused_projections() {
                push(p("ffn_up.weight"), Role::FfnGateUp, ly, vec![2 * i_dim, h])?;
            } else {
                push(p("ffn_gate.weight"), Role::FfnGate, ly, vec![i_dim, h])?;
                push(p("ffn_up.weight"), Role::FfnUp, ly, vec![i_dim, h])?;
            }
            push(p("ffn_down.weight"), Role::FfnDown, ly, vec![h, i_dim])?;
        }
        if spec.post_norms() {
            push(p("post_ffw_norm.weight"), Role::FfnPostNorm, ly, vec![h])?;
        }
    }
    push("output_norm.weight".into(), Role::OutputNorm, None, vec![h])?;
    if !tied {
        push(
            "output.weight".into(),
            Role::Output,
            None,
            vec![spec.vocab_size, h],
        )?;
    }
    Ok(out)
}

/// The architectures whose LongRoPE factor lists llama.cpp's converter writes as tensors
/// (its phi3 and minicpm models); the others' configs keep them to themselves.
const LONGROPE_ARCHITECTURES: [&str; 2] = ["phi3", "minicpm"];

/// The two global tensors llama.cpp's converter writes, before every other, for a config that
/// scales RoPE by LongRoPE ([`weightlift_format::hf_config::has_longrope_factors`]: Phi-3's
/// 128k models, Phi-3.5-mini, Phi-4-mini): `rope_factors_long.weight` then
/// `rope_factors_short.weight`, each F32 whatever the weight type, one factor per rotated pair
/// (`rope_dim / 2`); none for an architecture the converter writes none for. The engine reads
/// them once, on the host, to turn its RoPE angles, so they are placed with the token
/// embedding. `file` and `offset` are 0: nothing is read.
pub fn longrope_tensors(spec: &ModelSpec) -> Result<Vec<TensorInfo>> {
    check_spec(spec)?;
    if !LONGROPE_ARCHITECTURES.contains(&spec.architecture.as_str()) {
        return Ok(Vec::new());
    }
    let pairs = u64::from(spec.rope_dim / 2);
    let factors = |name: &str| TensorInfo {
        name: name.to_owned(),
        dtype: DType::F32,
        shape: vec![pairs],
        nbytes: pairs * 4,
        file: 0,
        offset: 0,
        layer: None,
        role: Some(Role::RopeFactors),
    };
    Ok(vec![
        factors("rope_factors_long.weight"),
        factors("rope_factors_short.weight"),
    ])
}

/// `dtype=` of `plan()`: a conversion applied to float weights on load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DTypeChoice {
    /// Keep every tensor as stored.
    #[default]
    Auto,
    Float16,
    Bfloat16,
    Float32,
}

impl DTypeChoice {
    pub fn parse(s: &str) -> Result<DTypeChoice> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DTypeChoice::Auto),
            "float16" | "f16" | "fp16" | "half" => Ok(DTypeChoice::Float16),
            "bfloat16" | "bf16" => Ok(DTypeChoice::Bfloat16),
            "float32" | "f32" | "fp32" | "float" => Ok(DTypeChoice::Float32),
            _ => Err(PlanError::option(
                "dtype",
                "auto, float16, bfloat16 or float32",
                format!("'{s}'"),
            )),
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            DTypeChoice::Auto => "auto",
            DTypeChoice::Float16 => "float16",
            DTypeChoice::Bfloat16 => "bfloat16",
            DTypeChoice::Float32 => "float32",
        }
    }

    fn target(self) -> Option<DType> {
        match self {
            DTypeChoice::Auto => None,
            DTypeChoice::Float16 => Some(DType::F16),
            DTypeChoice::Bfloat16 => Some(DType::BF16),
            DTypeChoice::Float32 => Some(DType::F32),
        }
    }
}

/// The dtype and bytes a tensor has after conversion: float tensors (F32, F16, BF16, F64, F8)
/// become the target type; quantised and integer tensors stay as they are.
pub fn converted(t: &TensorInfo, choice: DTypeChoice) -> (DType, u64) {
    match choice.target() {
        Some(target) if t.dtype.is_float() && t.dtype != target => {
            let bytes = t.n_elements().saturating_mul(target.type_size());
            (target, bytes)
        }
        _ => (t.dtype, t.nbytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_cpp() {
        // n = 32: i < 4, i >= 28, and (i - 4) % 3 == 2 -> 6, 9, 12, ..., 27.
        let more: Vec<u64> = (0..32).filter(|&i| use_more_bits(i, 32)).collect();
        assert_eq!(
            more,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
    }

    /// llama.cpp's rules that hang on the expert count and on the value-bearing matrices:
    /// Mixtral's 8 experts raise attn_v and attn_k to Q8_0 and attn_output to Q5_K (q4_k_s and
    /// q4_k_m); stacked experts' ffn_down follows ffn_down's layer rule; the router stays F32;
    /// q4_k_s gives attn_v Q5_K in the first four layers.
    #[test]
    fn expert_and_value_rules_follow_llama_cpp() {
        let t =
            |p, role, layer, experts| gguf_type_of(p, role, Some(layer), 32, false, 4096, experts);
        use QuantPreset::{Q4KM, Q4KS, Q5KM, Q8_0};
        assert_eq!(t(Q4KM, Role::AttnV, 5, 8), DType::Q8_0);
        assert_eq!(t(Q4KM, Role::AttnK, 5, 8), DType::Q8_0);
        assert_eq!(t(Q4KM, Role::AttnOutput, 5, 8), DType::Q5_K);
        assert_eq!(t(Q4KS, Role::AttnOutput, 5, 8), DType::Q5_K);
        assert_eq!(t(Q5KM, Role::AttnOutput, 5, 8), DType::Q5_K);
        assert_eq!(t(Q4KM, Role::AttnQ, 5, 8), DType::Q4_K);
        // 128 experts (Qwen3-30B-A3B) bump nothing
        assert_eq!(t(Q4KM, Role::AttnK, 5, 128), DType::Q4_K);
        assert_eq!(t(Q4KM, Role::AttnOutput, 5, 128), DType::Q4_K);
        // use_more_bits(0, 32) holds, use_more_bits(5, 32) does not
        assert_eq!(t(Q4KM, Role::FfnDownExps, 0, 128), DType::Q6_K);
        assert_eq!(t(Q4KM, Role::FfnDownExps, 5, 128), DType::Q4_K);
        assert_eq!(t(Q4KM, Role::FfnGateExps, 0, 128), DType::Q4_K);
        for p in [Q4KM, Q8_0, QuantPreset::F16] {
            assert_eq!(t(p, Role::FfnGateInp, 0, 8), DType::F32);
        }
        assert_eq!(t(Q4KS, Role::AttnV, 3, 0), DType::Q5_K);
        assert_eq!(t(Q4KS, Role::AttnV, 4, 0), DType::Q4_K);
        assert_eq!(t(Q4KS, Role::AttnQkv, 0, 0), DType::Q5_K);
        assert_eq!(t(Q4KM, Role::AttnQkv, 0, 0), DType::Q6_K);
    }

    #[test]
    fn fallbacks_follow_llama_cpp() {
        // Row of 576 (SmolLM2's hidden size) is not a multiple of 256.
        assert_eq!(
            gguf_type(QuantPreset::Q4KM, Role::FfnUp, Some(5), 30, false, 576),
            DType::Q5_0
        );
        assert_eq!(
            gguf_type(QuantPreset::Q4KM, Role::Output, None, 30, false, 576),
            DType::Q8_0
        );
        assert_eq!(
            gguf_type(QuantPreset::Q5KM, Role::FfnUp, Some(5), 30, false, 576),
            DType::Q5_1
        );
        assert_eq!(
            gguf_type(QuantPreset::Q4_0, Role::FfnUp, Some(5), 30, false, 48),
            DType::F16
        );
        assert_eq!(
            gguf_type(QuantPreset::Q4KM, Role::FfnUp, Some(5), 30, false, 4096),
            DType::Q4_K
        );
        assert_eq!(
            gguf_type(QuantPreset::Q4KM, Role::FfnDown, Some(0), 32, false, 14336),
            DType::Q6_K
        );
        assert_eq!(
            gguf_type(QuantPreset::Q4KM, Role::FfnDown, Some(4), 32, false, 14336),
            DType::Q4_K
        );
        assert_eq!(
            gguf_type(QuantPreset::Q4_0, Role::TokenEmbd, None, 32, true, 4096),
            DType::Q6_K
        );
        assert_eq!(
            gguf_type(QuantPreset::Q4_0, Role::TokenEmbd, None, 32, false, 4096),
            DType::Q4_0
        );
        assert_eq!(
            gguf_type(QuantPreset::Q8_0, Role::Output, None, 32, false, 4096),
            DType::Q8_0
        );
    }

    /// A config's dense layers (`MoeSpec::dense_layers`) hold the dense MLP of
    /// `intermediate_size`, the others the router and stacked experts; LongRoPE's factor lists
    /// are F32 whatever the weight type, one per rotated pair.
    #[test]
    fn dense_layers_and_longrope_factors_are_synthesised() {
        let spec = ModelSpec {
            architecture: "qwen3_moe".into(),
            n_layers: 3,
            hidden_size: 32,
            intermediate_size: 64,
            n_heads: 4,
            n_kv_heads: vec![2; 3],
            head_dim: 8,
            vocab_size: 320,
            context_length: 512,
            rope_theta: 1e6,
            rope_dim: 6,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            attention_bias: false,
        };
        let moe = MoeSpec {
            n_experts: 4,
            n_used: 2,
            expert_ffn: 32,
            norm_topk_prob: true,
            dense_layers: vec![0, 2],
        };
        let t = synthesize_tensors(&spec, WeightType::parse("f16").unwrap(), Some(&moe)).unwrap();
        let ffn = |l: u32| -> Vec<(Role, Vec<u64>)> {
            t.iter()
                .filter(|t| t.layer == Some(l) && t.name.contains(".ffn_"))
                .map(|t| (t.role.unwrap(), t.shape.clone()))
                .collect()
        };
        let dense = vec![
            (Role::FfnNorm, vec![32]),
            (Role::FfnGate, vec![64, 32]),
            (Role::FfnUp, vec![64, 32]),
            (Role::FfnDown, vec![32, 64]),
        ];
        assert_eq!(ffn(0), dense);
        assert_eq!(ffn(2), dense);
        let routed = vec![
            (Role::FfnNorm, vec![32]),
            (Role::FfnGateInp, vec![4, 32]),
            (Role::FfnGateExps, vec![4, 32, 32]),
            (Role::FfnUpExps, vec![4, 32, 32]),
            (Role::FfnDownExps, vec![4, 32, 32]),
        ];
        assert_eq!(ffn(1), routed);
        assert!(
            longrope_tensors(&spec).unwrap().is_empty(),
            "qwen3_moe has none"
        );
        let spec = ModelSpec {
            architecture: "phi3".into(),
            ..spec
        };
        let f = longrope_tensors(&spec).unwrap();
        let got: Vec<_> = f
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.dtype,
                    t.shape.clone(),
                    t.nbytes,
                    t.layer,
                    t.role,
                )
            })
            .collect();
        let want = |name| (name, DType::F32, vec![3], 12, None, Some(Role::RopeFactors));
        assert_eq!(
            got,
            [
                want("rope_factors_long.weight"),
                want("rope_factors_short.weight")
            ]
        );
    }

    #[test]
    fn parses_names() {
        assert_eq!(
            WeightType::parse("q4_k_m").unwrap(),
            WeightType::Gguf(QuantPreset::Q4KM)
        );
        assert_eq!(
            WeightType::parse("bfloat16").unwrap(),
            WeightType::Dense(DType::BF16)
        );
        assert!(
            WeightType::parse("q3_weird")
                .unwrap_err()
                .to_string()
                .contains("'q3_weird'")
        );
        assert_eq!(
            DTypeChoice::parse("bfloat16").unwrap(),
            DTypeChoice::Bfloat16
        );
        assert!(DTypeChoice::parse("int3").is_err());
    }
}

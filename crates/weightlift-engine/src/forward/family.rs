//! The family variants of the graph that are numbers rather than tensors, read once from the
//! checkpoint: the MLP's activation, the embedding scale, the attention scale and soft-caps,
//! each layer's sliding window and RoPE base, and whether norm weights are stored as `w` for
//! a `(1 + w)` norm (gemma in safetensors; llama.cpp's converter stores `1 + w` in GGUF).
//!
//! Gemma 2 and 3 are the families with variants. Their rules, as transformers
//! (`modeling_gemma2.py`, `modeling_gemma3.py`) and llama.cpp (`llama_model_gemma2`/`gemma3`)
//! apply them:
//!
//! - embeddings times √hidden, rounded to the embedding's dtype in transformers (f32 in
//!   llama.cpp);
//! - scores times `query_pre_attn_scalar^-½` (config.json); llama.cpp, whose GGUF carries no
//!   such key, uses `(hidden / heads)^-½` for the 27B models (46 layers for gemma2, 62 for
//!   gemma3) and `head_dim^-½` otherwise;
//! - soft-capping `cap · tanh(x / cap)` of the attention scores (gemma2, default 50 in
//!   llama.cpp) and of the logits (gemma2 default 30; gemma3 only when configured);
//! - sliding-window layers from the plan crate's [`weightlift_plan::SlidingWindow`] rules (for every family:
//!   mistral's and qwen2's windows too);
//! - gemma3's RoPE: the global layers' base (and linear scaling) and the sliding layers' own
//!   base (`rope_parameters.sliding_attention`, `rope.freq_base_swa`, default 10 000).

use weightlift_format::{DType, Format, MetaValue, ModelSpec, Role};
use weightlift_kernels::RopeParams;

use super::graph::Loaded;
use crate::error::{EngineError, Result};

/// The MLP's gating activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// `silu(gate) · up` (llama, mistral, qwen2).
    Silu,
    /// `gelu_tanh(gate) · up` (gemma).
    GeluTanh,
}

/// The numeric variants of one model.
#[derive(Debug, Clone)]
pub(crate) struct Family {
    pub gate: Gate,
    /// Multiplier of the embedding rows, when the family scales them.
    pub embed_scale: Option<f32>,
    /// Multiplier of the attention scores.
    pub attn_scale: f32,
    /// Attention logit soft-cap (0: none).
    pub attn_softcap: f32,
    /// Final logit soft-cap (0: none).
    pub final_softcap: f32,
    /// Added to every norm weight as it is read (1 for a `(1 + w)` norm stored as `w`).
    pub norm_offset: f32,
    /// Per layer: the sliding window (0: full attention).
    pub windows: Vec<usize>,
    /// Per layer: its own RoPE `(base, scale)` where it differs from the model's.
    pub ropes: Vec<Option<(f32, f32)>>,
}

fn is_gemma(arch: &str) -> bool {
    matches!(arch, "gemma2" | "gemma3" | "gemma3_text")
}

fn spec_error(m: &Loaded<'_>, spec: &ModelSpec, detail: String) -> EngineError {
    EngineError::Validation {
        path: m.source.path().to_path_buf(),
        architecture: spec.architecture.clone(),
        problems: detail,
    }
}

impl Family {
    /// Per layer: the RoPE angles of its own base and scale (on top of the model's `rope`),
    /// where it has one.
    pub fn rope_tables(&self, rope: &RopeParams) -> Result<Vec<Option<Vec<f32>>>> {
        self.ropes
            .iter()
            .map(|r| {
                r.map(|(freq_base, freq_scale)| {
                    let p = RopeParams {
                        freq_base,
                        freq_scale,
                        ..*rope
                    };
                    weightlift_kernels::rope_inv_freqs(&p, None)
                        .map_err(|e| super::layer::kernel("rope frequencies", e))
                })
                .transpose()
            })
            .collect()
    }

    /// The variants of `spec`'s checkpoint.
    pub fn of(m: &Loaded<'_>, spec: &ModelSpec) -> Result<Family> {
        let n = spec.n_layers as usize;
        let ck = m.source.checkpoint();
        // every architecture's sliding-window layers (gemma's local layers, mistral's and
        // qwen2's windowed ones), read as the plan and the cache read them
        let window = match ck {
            Some(c) => crate::planned::sliding_window_of(c, spec)
                .map_err(|e| spec_error(m, spec, format!("sliding window: {e}")))?,
            None => None,
        };
        let windows = (0..n)
            .map(|l| match &window {
                Some(w) if w.is_sliding(l) => w.window as usize,
                _ => 0,
            })
            .collect::<Vec<_>>();
        let plain = Family {
            gate: Gate::Silu,
            embed_scale: None,
            attn_scale: 1.0 / (spec.head_dim as f32).sqrt(),
            attn_softcap: 0.0,
            final_softcap: 0.0,
            norm_offset: 0.0,
            windows,
            ropes: vec![None; n],
        };
        let arch = spec.architecture.as_str();
        if !is_gemma(arch) {
            return Ok(plain);
        }
        let gguf = ck.map(|c| c.format()) == Some(Format::Gguf);
        let gemma2 = arch == "gemma2";
        let hidden = spec.hidden_size as f32;
        let heads = spec.n_heads as f32;
        let is_27b = spec.n_layers == if gemma2 { 46 } else { 62 };
        let mut f = Family {
            gate: Gate::GeluTanh,
            ..plain
        };
        let embed_dtype = m
            .source
            .tensors()
            .iter()
            .find(|t| t.role == Some(Role::TokenEmbd))
            .map(|t| t.dtype);
        let sqrt_h = (spec.hidden_size as f64).sqrt() as f32;
        if gguf {
            let md = ck.map(|c| c.metadata());
            let num = |key: &str| -> Option<f32> {
                md.and_then(|md| md.get(&format!("{arch}.{key}")))
                    .and_then(MetaValue::as_f64)
                    .map(|v| v as f32)
            };
            f.embed_scale = Some(sqrt_h);
            let scalar = if is_27b {
                hidden / heads
            } else {
                spec.head_dim as f32
            };
            f.attn_scale = 1.0 / scalar.sqrt();
            // llama.cpp's defaults for gemma2 when the keys are absent
            f.attn_softcap =
                num("attn_logit_softcapping").unwrap_or(if gemma2 { 50.0 } else { 0.0 });
            f.final_softcap =
                num("final_logit_softcapping").unwrap_or(if gemma2 { 30.0 } else { 0.0 });
        } else {
            let cfg = ck.and_then(|c| c.config());
            let text = cfg.map(|c| match c.get("text_config") {
                Some(t @ serde_json::Value::Object(_)) if c.get("num_hidden_layers").is_none() => t,
                _ => c,
            });
            let num = |key: &str| -> Option<f32> {
                text.and_then(|c| c.get(key))
                    .and_then(serde_json::Value::as_f64)
                    .map(|v| v as f32)
            };
            // transformers multiplies by the scale cast to the embedding's dtype
            f.embed_scale = Some(match embed_dtype {
                Some(DType::BF16) => half::bf16::from_f32(sqrt_h).to_f32(),
                Some(DType::F16) => half::f16::from_f32(sqrt_h).to_f32(),
                _ => sqrt_h,
            });
            f.attn_scale = 1.0 / num("query_pre_attn_scalar").unwrap_or(256.0).sqrt();
            f.attn_softcap = num("attn_logit_softcapping").unwrap_or(0.0);
            f.final_softcap = num("final_logit_softcapping").unwrap_or(0.0);
            f.norm_offset = 1.0;
        }
        if let Some([local, global]) = gemma3_ropes(ck, spec)? {
            f.ropes = f
                .windows
                .iter()
                .map(|&w| Some(if w > 0 { local } else { global }))
                .collect();
        }
        Ok(f)
    }
}

/// Gemma 3's RoPE `(base, scale)` of its sliding layers and of its global ones (`None` for
/// another architecture): from GGUF, `rope.freq_base_swa` (default 10 000) and the model's base
/// with its linear scaling; from config.json, `rope_parameters.sliding_attention` and
/// `.full_attention` (default and linear RoPE; defaults 10 000 and 1 000 000).
pub(crate) fn gemma3_ropes(
    ck: Option<&weightlift_format::Checkpoint>,
    spec: &ModelSpec,
) -> Result<Option<[(f32, f32); 2]>> {
    let arch = spec.architecture.as_str();
    if !matches!(arch, "gemma3" | "gemma3_text") {
        return Ok(None);
    }
    if let Some(c) = ck.filter(|c| c.format() == Format::Gguf) {
        let md = c.metadata();
        let num = |key: &str| md.get(&format!("{arch}.{key}")).and_then(MetaValue::as_f64);
        let scale = match md.get(&format!("{arch}.rope.scaling.type")) {
            Some(MetaValue::String(t)) if t == "linear" => {
                1.0 / num("rope.scaling.factor").unwrap_or(1.0) as f32
            }
            _ => 1.0,
        };
        let local = num("rope.freq_base_swa").unwrap_or(10_000.0) as f32;
        return Ok(Some([(local, 1.0), (spec.rope_theta as f32, scale)]));
    }
    let cfg = ck.and_then(|c| c.config());
    let text = cfg.map(|c| match c.get("text_config") {
        Some(t @ serde_json::Value::Object(_)) if c.get("num_hidden_layers").is_none() => t,
        _ => c,
    });
    let rp = text.and_then(|c| c.get("rope_parameters"));
    let kind = |t: &str| -> Result<(f32, f32)> {
        let p = rp.and_then(|r| r.get(t));
        let base = p
            .and_then(|p| p.get("rope_theta"))
            .and_then(serde_json::Value::as_f64)
            .map(|v| v as f32)
            .unwrap_or(if t == "sliding_attention" { 1e4 } else { 1e6 });
        let ty = p
            .and_then(|p| p.get("rope_type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let factor = p
            .and_then(|p| p.get("factor"))
            .and_then(serde_json::Value::as_f64)
            .unwrap_or(1.0) as f32;
        match ty {
            "default" => Ok((base, 1.0)),
            "linear" => Ok((base, 1.0 / factor)),
            other => Err(EngineError::Unsupported {
                what: format!("rope_type '{other}' on gemma3's {t} layers"),
                detail: "the forward pass runs default and linear RoPE for gemma3".into(),
            }),
        }
    };
    Ok(Some([kind("sliding_attention")?, kind("full_attention")?]))
}

//! Rotary position embedding parameters read from the checkpoint: the pairing style, the
//! rotated dimensions, and the per-pair inverse frequencies with any scaling applied.

use weightlift_format::{Format, ModelSpec, Role};
use weightlift_kernels::{RopeParams, RopeStyle};

use super::graph::Loaded;
use super::layer::kernel;
use super::parts::f32_vector;
use crate::error::{EngineError, Result};
use crate::source::Source;

/// The per-pair factor tensors llama.cpp's converter writes for LongRoPE (Phi-3's 128k models).
const LONGROPE_TENSORS: [&str; 2] = ["rope_factors_long.weight", "rope_factors_short.weight"];

/// `Ok` unless the checkpoint scales RoPE in a way the forward pass does not run: LongRoPE
/// (`rope_scaling` of type `longrope`, or `su` as the first Phi-3 128k configs wrote it, with
/// `short_factor`/`long_factor`; in GGUF, the `rope_factors_long`/`rope_factors_short`
/// tensors). Checked before loading, as [`super::check_runs`] is.
pub fn check_rope(source: &dyn Source) -> Result<()> {
    let cfg = source.checkpoint().and_then(|c| c.config());
    let kind = cfg.and_then(scaling_kind);
    let tensor = source
        .tensors()
        .iter()
        .find(|t| LONGROPE_TENSORS.contains(&t.name.as_str()));
    let what = match (kind, tensor) {
        (Some(k @ ("longrope" | "su")), _) => format!("rope_scaling type '{k}' (LongRoPE)"),
        (_, Some(t)) => format!("LongRoPE factors ('{}')", t.name),
        _ => return Ok(()),
    };
    Err(EngineError::Unsupported {
        what,
        detail: "the forward pass scales RoPE linearly or as Llama 3 does, not by LongRoPE's \
                 short and long factors (the 128k Phi-3 models); use a 4k/16k variant"
            .into(),
    })
}

/// RoPE pairing and per-pair angles: adjacent pairs for GGUF llama/mistral (whose q/k rows
/// the converter permuted), rotate-half (NeoX) for every other GGUF (qwen2, qwen3, phi3, gemma) and
/// for Hugging Face checkpoints, over the first `rope_dim` values of each head (phi3's partial
/// rotary); Llama 3 frequency factors from `rope_freqs.weight` or the config's `rope_scaling`.
pub(super) fn rope_of(m: &Loaded<'_>, spec: &ModelSpec) -> Result<(RopeParams, Vec<f32>)> {
    let gguf = m.source.checkpoint().map(|c| c.format()) == Some(Format::Gguf);
    let style = if gguf && spec.gguf_adjacent_rope() {
        RopeStyle::Normal
    } else {
        RopeStyle::Neox
    };
    let head_dim = spec.head_dim as usize;
    let n_dims = (spec.rope_dim as usize).clamp(2, head_dim) & !1;
    let mut p = RopeParams {
        style,
        head_dim,
        n_dims,
        freq_base: spec.rope_theta as f32,
        freq_scale: 1.0,
    };
    let infos = m.source.tensors();
    let factors = match infos.iter().position(|t| t.role == Some(Role::RopeFreqs)) {
        Some(i) => Some(f32_vector(&m.held[i], &infos[i])?),
        None => {
            let cfg = m.source.checkpoint().and_then(|c| c.config());
            match cfg.and_then(rope_scaling) {
                Some(Scaling::Linear(f)) => {
                    p.freq_scale = 1.0 / f;
                    None
                }
                Some(Scaling::Llama3 {
                    factor,
                    low,
                    high,
                    original,
                }) => Some(llama3_factors(&p, factor, low, high, original)),
                None => None,
            }
        }
    };
    let inv = weightlift_kernels::rope_inv_freqs(&p, factors.as_deref())
        .map_err(|e| kernel("rope frequencies", e))?;
    Ok((p, inv))
}

enum Scaling {
    Linear(f32),
    Llama3 {
        factor: f32,
        low: f32,
        high: f32,
        original: f32,
    },
}

/// `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5) of a config.
fn scaling_of(cfg: &serde_json::Value) -> Option<&serde_json::Value> {
    cfg.get("rope_scaling")
        .filter(|v| !v.is_null())
        .or_else(|| cfg.get("rope_parameters"))
}

/// The type of a config's RoPE scaling (`rope_type`, or `type` as older configs write it).
fn scaling_kind(cfg: &serde_json::Value) -> Option<&str> {
    let r = scaling_of(cfg)?;
    r.get("rope_type")
        .or_else(|| r.get("type"))
        .and_then(|v| v.as_str())
}

/// The RoPE scaling of a config that the forward pass applies.
fn rope_scaling(cfg: &serde_json::Value) -> Option<Scaling> {
    let r = scaling_of(cfg)?;
    let kind = scaling_kind(cfg)?;
    let num = |k: &str| {
        r.get(k)
            .and_then(serde_json::Value::as_f64)
            .map(|v| v as f32)
    };
    match kind {
        "linear" => Some(Scaling::Linear(num("factor")?)),
        "llama3" => Some(Scaling::Llama3 {
            factor: num("factor")?,
            low: num("low_freq_factor")?,
            high: num("high_freq_factor")?,
            original: num("original_max_position_embeddings")?,
        }),
        _ => None,
    }
}

/// Llama 3's per-pair divisors of the angle (transformers' `_compute_llama3_parameters`):
/// long wavelengths slow down by `factor`, short ones stay, and the band between is blended.
fn llama3_factors(p: &RopeParams, factor: f32, low: f32, high: f32, original: f32) -> Vec<f32> {
    let low_wavelen = original / low;
    let high_wavelen = original / high;
    (0..p.n_dims / 2)
        .map(|i| {
            let inv = p.freq_base.powf(-2.0 * i as f32 / p.n_dims as f32);
            let wavelen = 2.0 * std::f32::consts::PI / inv;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                let scaled = (1.0 - smooth) * inv / factor + smooth * inv;
                inv / scaled
            }
        })
        .collect()
}

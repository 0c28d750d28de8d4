//! Rotary position embedding parameters read from the checkpoint: the pairing style, the
//! rotated dimensions, and the per-pair inverse frequencies with any scaling applied.

use weightlift_format::{Format, ModelSpec, Role};
use weightlift_kernels::{RopeParams, RopeStyle};

use super::graph::Loaded;
use super::layer::kernel;
use super::parts::f32_vector;
use crate::error::Result;

/// RoPE pairing and per-pair angles: adjacent pairs for GGUF llama/mistral (whose q/k rows
/// the converter permuted), rotate-half (NeoX) for qwen2, gemma and Hugging Face checkpoints;
/// Llama 3 frequency factors from `rope_freqs.weight` or the config's `rope_scaling`.
pub(super) fn rope_of(m: &Loaded<'_>, spec: &ModelSpec) -> Result<(RopeParams, Vec<f32>)> {
    let gguf = m.source.checkpoint().map(|c| c.format()) == Some(Format::Gguf);
    // llama.cpp's converter permutes the q/k rows of llama and mistral only; qwen2 and gemma
    // keep transformers' rotate-half layout (llama.cpp runs them as NEOX)
    let neox_gguf = matches!(
        spec.architecture.as_str(),
        "qwen2" | "gemma2" | "gemma3" | "gemma3_text"
    );
    let style = if gguf && !neox_gguf {
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
fn rope_scaling(cfg: &serde_json::Value) -> Option<Scaling> {
    let r = cfg
        .get("rope_scaling")
        .filter(|v| !v.is_null())
        .or_else(|| cfg.get("rope_parameters"))?;
    let kind = r
        .get("rope_type")
        .or_else(|| r.get("type"))
        .and_then(|v| v.as_str())?;
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

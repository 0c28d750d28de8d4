//! Rotary position embedding parameters read from the checkpoint: the pairing style, the
//! rotated dimensions, and the per-pair inverse frequencies with any scaling applied: linear,
//! Llama 3's, or LongRoPE's (Phi-3's 128k models, Phi-3.5-mini, Phi-4-mini).
//!
//! LongRoPE divides each pair's frequency by a factor from one of two lists, `short_factor`
//! for contexts up to the pretraining length (`original_max_position_embeddings`) and
//! `long_factor` beyond, and scales the cosine and sine by an attention factor
//! (`√(1 + ln s / ln original)` for a stretch `s = max_position_embeddings / original`, or the
//! config's `attention_factor`). llama.cpp picks the list once per context (long when the
//! context exceeds the pretraining length), so that every key in the cache was turned with the
//! same angles; this engine does the same, with the context the model is loaded for.
//! transformers picks it per forward call from the longest position in the call, which gives
//! the same angles whenever the prompt and the context fall on the same side of that length.

use weightlift_format::{Format, MetaValue, ModelSpec, Role, hf_config};
use weightlift_kernels::{RopeParams, RopeStyle};

use super::graph::Loaded;
use super::layer::kernel;
use super::parts::f32_vector;
use crate::error::{EngineError, Result};
use crate::source::Source;

/// The per-pair factor tensors llama.cpp's converter writes for LongRoPE: long, then short.
const LONGROPE_TENSORS: [&str; 2] = ["rope_factors_long.weight", "rope_factors_short.weight"];

/// The RoPE scaling types of a config the forward pass applies (`su` is LongRoPE as the first
/// Phi-3 128k configs wrote it).
const APPLIED: [&str; 5] = ["default", "linear", "llama3", "longrope", "su"];

/// `Ok` unless the checkpoint scales RoPE in a way the forward pass does not run (YaRN,
/// dynamic NTK, ...: a `rope_scaling` type outside [`APPLIED`], or such a
/// `rope.scaling.type` in GGUF), which would otherwise turn every key at the wrong angles.
/// Checked before loading, as [`super::check_runs`] is.
pub fn check_rope(source: &dyn Source) -> Result<()> {
    let ck = source.checkpoint();
    let from_config = ck
        .and_then(|c| c.config())
        .and_then(hf_config::rope_scaling_kind);
    let from_gguf = ck.and_then(|c| {
        let arch = source.spec()?.architecture.clone();
        match c.metadata().get(&format!("{arch}.rope.scaling.type")) {
            Some(MetaValue::String(t)) => Some(t.clone()),
            _ => None,
        }
    });
    let kind = from_config.map(str::to_owned).or(from_gguf);
    match kind {
        Some(k) if !APPLIED.contains(&k.as_str()) && k != "none" => Err(EngineError::Unsupported {
            what: format!("rope scaling type '{k}'"),
            detail: format!(
                "the forward pass scales RoPE as {}; a model scaled otherwise would run at the \
                 wrong angles",
                APPLIED.join(", ")
            ),
        }),
        _ => Ok(()),
    }
}

/// RoPE pairing and per-pair angles: adjacent pairs for GGUF llama/mistral (whose q/k rows
/// the converter permuted), rotate-half (NeoX) for every other GGUF (qwen2, qwen3, phi3, gemma) and
/// for Hugging Face checkpoints, over the first `rope_dim` values of each head (phi3's partial
/// rotary); Llama 3 frequency factors from `rope_freqs.weight` or the config's `rope_scaling`;
/// LongRoPE's factors and attention factor from the config or from llama.cpp's tensors and
/// metadata (see the module docs).
///
/// `context`: the positions the model runs (its cache's), which choose LongRoPE's list.
pub(super) fn rope_of(
    m: &Loaded<'_>,
    spec: &ModelSpec,
    context: u64,
) -> Result<(RopeParams, Vec<f32>)> {
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
        attn_factor: 1.0,
    };
    let infos = m.source.tensors();
    let tensor = |name: &str| infos.iter().position(|t| t.name == name);
    let factors = if let Some(i) = infos.iter().position(|t| t.role == Some(Role::RopeFreqs)) {
        Some(f32_vector(&m.held[i], &infos[i])?)
    } else if let (Some(long), Some(short)) =
        (tensor(LONGROPE_TENSORS[0]), tensor(LONGROPE_TENSORS[1]))
    {
        // llama.cpp's LongRoPE: the lists as tensors, the rest as metadata
        let md = m.source.checkpoint().map(|c| c.metadata());
        let num = |key: &str| {
            md.and_then(|md| md.get(&format!("{}.{key}", spec.architecture)))
                .and_then(MetaValue::as_f64)
        };
        let original = num("rope.scaling.original_context_length").ok_or_else(|| {
            spec_error(
                "LongRoPE factors without rope.scaling.original_context_length in the metadata",
            )
        })?;
        p.attn_factor = num("rope.scaling.attn_factor").unwrap_or(1.0) as f32;
        let i = if context as f64 > original {
            long
        } else {
            short
        };
        Some(f32_vector(&m.held[i], &infos[i])?)
    } else {
        let cfg = m.source.checkpoint().and_then(|c| c.config());
        match cfg.map(rope_scaling).transpose()?.flatten() {
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
            Some(Scaling::LongRope {
                short,
                long,
                original,
                attn_factor,
            }) => {
                p.attn_factor = attn_factor;
                Some(if context as f64 > original {
                    long
                } else {
                    short
                })
            }
            None => None,
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
    /// The two per-pair lists, the pretraining length that chooses between them, and the
    /// cosine and sine's factor.
    LongRope {
        short: Vec<f32>,
        long: Vec<f32>,
        original: f64,
        attn_factor: f32,
    },
}

fn spec_error(detail: &str) -> EngineError {
    EngineError::Unsupported {
        what: "this checkpoint's RoPE scaling".into(),
        detail: detail.into(),
    }
}

/// The RoPE scaling of a config that the forward pass applies (None: plain RoPE, or a kind
/// [`check_rope`] refuses); a LongRoPE config missing a list or its lengths is an error.
fn rope_scaling(cfg: &serde_json::Value) -> Result<Option<Scaling>> {
    let (Some(r), Some(kind)) = (
        hf_config::rope_scaling(cfg),
        hf_config::rope_scaling_kind(cfg),
    ) else {
        return Ok(None);
    };
    let num = |k: &str| {
        r.get(k)
            .and_then(serde_json::Value::as_f64)
            .map(|v| v as f32)
    };
    Ok(match kind {
        "linear" => num("factor").map(Scaling::Linear),
        "llama3" => (|| {
            Some(Scaling::Llama3 {
                factor: num("factor")?,
                low: num("low_freq_factor")?,
                high: num("high_freq_factor")?,
                original: num("original_max_position_embeddings")?,
            })
        })(),
        "longrope" | "su" => Some(longrope(cfg, r)?),
        _ => None,
    })
}

/// LongRoPE's lists and lengths from a config (`rope_scaling` or `rope_parameters` `r`), as
/// transformers' `_compute_longrope_parameters` reads them: the pretraining length in `r` or
/// at the config's top level, the stretch `factor` in `r` or the ratio of the two lengths,
/// and `attention_factor` in `r` or `√(1 + ln factor / ln original)` (1 without a stretch).
fn longrope(cfg: &serde_json::Value, r: &serde_json::Value) -> Result<Scaling> {
    let list = |k: &str| -> Result<Vec<f32>> {
        r.get(k)
            .and_then(serde_json::Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_f64().map(|x| x as f32))
                    .collect::<Option<Vec<f32>>>()
            })
            .ok_or_else(|| spec_error(&format!("LongRoPE without a numeric '{k}' list")))
    };
    let number = |k: &str| {
        r.get(k)
            .or_else(|| cfg.get(k))
            .and_then(serde_json::Value::as_f64)
    };
    let original = number("original_max_position_embeddings").ok_or_else(|| {
        spec_error("LongRoPE without original_max_position_embeddings in the config")
    })?;
    let stretch = match r.get("factor").and_then(serde_json::Value::as_f64) {
        Some(f) => f,
        None => {
            cfg.get("max_position_embeddings")
                .and_then(serde_json::Value::as_f64)
                .ok_or_else(|| spec_error("LongRoPE without max_position_embeddings"))?
                / original
        }
    };
    let attn_factor = match r
        .get("attention_factor")
        .and_then(serde_json::Value::as_f64)
    {
        Some(a) => a,
        None if stretch <= 1.0 => 1.0,
        None => (1.0 + stretch.ln() / original.ln()).sqrt(),
    };
    Ok(Scaling::LongRope {
        short: list("short_factor")?,
        long: list("long_factor")?,
        original,
        attn_factor: attn_factor as f32,
    })
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

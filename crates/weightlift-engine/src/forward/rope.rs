//! Rotary position embedding parameters read from the checkpoint: the pairing style, the
//! rotated dimensions, and the per-pair inverse frequencies with any scaling applied: linear,
//! Llama 3's, YaRN's (Qwen2.5's and Qwen3's long-context configs) or LongRoPE's (Phi-3's 128k
//! models, Phi-3.5-mini, Phi-4-mini), from a Hugging Face config or GGUF metadata.
//!
//! YaRN keeps the fast-turning pairs as they are, slows the slow ones by `factor`, and blends
//! the pairs between (those that turn between `beta_slow` and `beta_fast` times over the
//! pretraining length `original`); the cosine and sine are scaled by an attention factor,
//! `0.1 · ln factor + 1` unless the config gives one (or `mscale` and `mscale_all_dim`), as
//! transformers' `_compute_yarn_parameters` and llama.cpp's `rope_yarn` compute them.
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
const APPLIED: [&str; 6] = ["default", "linear", "llama3", "yarn", "longrope", "su"];

/// GGUF's YaRN variants beyond the plain one (llama.cpp's key, and the value that leaves
/// YaRN plain): an extrapolation mix, an extra attention factor, a log multiplier (DeepSeek's).
const YARN_PLAIN: [(&str, f64); 3] = [
    ("rope.scaling.yarn_ext_factor", 1.0),
    ("rope.scaling.yarn_attn_factor", 1.0),
    ("rope.scaling.yarn_log_multiplier", 0.0),
];

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
    if let (Some(k @ ("linear" | "yarn")), Some(c)) = (kind.as_deref(), ck)
        && c.format() == Format::Gguf
    {
        let arch = source
            .spec()
            .map(|s| s.architecture.clone())
            .unwrap_or_default();
        check_gguf_scaling(c.metadata(), &arch, k)?;
    }
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

/// Refuses GGUF linear or YaRN scaling (`kind`) that [`gguf_scaling`] would not apply as the
/// file asks: a factor or YaRN's pretraining length missing, or a YaRN variant beyond the plain
/// one ([`YARN_PLAIN`]).
fn check_gguf_scaling(md: &weightlift_format::Metadata, arch: &str, kind: &str) -> Result<()> {
    let num = |key: &str| md.get(&format!("{arch}.{key}")).and_then(MetaValue::as_f64);
    let mut needed = vec!["rope.scaling.factor"];
    if kind == "yarn" {
        needed.push("rope.scaling.original_context_length");
    }
    if let Some(key) = needed.iter().find(|k| num(k).is_none_or(|v| v <= 0.0)) {
        return Err(spec_error(&format!(
            "{kind} RoPE scaling without a positive {arch}.{key} in the GGUF metadata"
        )));
    }
    for (key, plain) in YARN_PLAIN.iter().filter(|_| kind == "yarn") {
        if let Some(v) = num(key).filter(|v| v != plain) {
            return Err(EngineError::Unsupported {
                what: format!("YaRN with {arch}.{key} = {v}"),
                detail: format!(
                    "the forward pass runs plain YaRN ({key} {plain}); a model scaled otherwise \
                     would run at the wrong angles"
                ),
            });
        }
    }
    Ok(())
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
    let factors = match scaling_found(m.source, spec)? {
        Some(Found::FreqsTensor(i)) => Some(f32_vector(&m.held[i], &infos[i])?),
        Some(Found::LongRopeTensors {
            long,
            short,
            original,
            attn_factor,
        }) => {
            p.attn_factor = attn_factor;
            let i = if context as f64 > original {
                long
            } else {
                short
            };
            Some(f32_vector(&m.held[i], &infos[i])?)
        }
        Some(Found::Scaling(Scaling::Linear(f))) => {
            p.freq_scale = 1.0 / f;
            None
        }
        Some(Found::Scaling(Scaling::Yarn(y))) => {
            p.attn_factor = y.attn_factor;
            Some(y.divisors(p.freq_base, p.n_dims))
        }
        Some(Found::Scaling(Scaling::Llama3 {
            factor,
            low,
            high,
            original,
        })) => Some(llama3_factors(&p, factor, low, high, original)),
        Some(Found::Scaling(Scaling::LongRope {
            short,
            long,
            original,
            attn_factor,
            ..
        })) => {
            p.attn_factor = attn_factor;
            Some(if context as f64 > original {
                long
            } else {
                short
            })
        }
        None => None,
    };
    let inv = weightlift_kernels::rope_inv_freqs(&p, factors.as_deref())
        .map_err(|e| kernel("rope frequencies", e))?;
    Ok((p, inv))
}

/// Where a checkpoint's RoPE scaling is read from: llama.cpp's tensors, or the scaling of
/// its GGUF metadata or config.json.
enum Found {
    /// Llama 3's per-pair factors as llama.cpp's converter stores them (`rope_freqs.weight`):
    /// the tensor's index.
    FreqsTensor(usize),
    /// LongRoPE's two lists as llama.cpp's converter stores them (the tensors' indexes), with
    /// the metadata's pretraining length and attention factor.
    LongRopeTensors {
        long: usize,
        short: usize,
        original: f64,
        attn_factor: f32,
    },
    Scaling(Scaling),
}

/// The one reading of a checkpoint's RoPE scaling, for the forward pass ([`rope_of`]) and for
/// what `inspect` shows ([`rope_scaling_of`]); `None` for plain RoPE.
fn scaling_found(source: &dyn Source, spec: &ModelSpec) -> Result<Option<Found>> {
    let infos = source.tensors();
    let tensor = |name: &str| infos.iter().position(|t| t.name == name);
    if let Some(i) = infos.iter().position(|t| t.role == Some(Role::RopeFreqs)) {
        return Ok(Some(Found::FreqsTensor(i)));
    }
    let ck = source.checkpoint();
    let md = ck.map(|c| c.metadata());
    let num = |key: &str| {
        md.and_then(|md| md.get(&format!("{}.{key}", spec.architecture)))
            .and_then(MetaValue::as_f64)
    };
    if let (Some(long), Some(short)) = (tensor(LONGROPE_TENSORS[0]), tensor(LONGROPE_TENSORS[1])) {
        // llama.cpp's LongRoPE: the lists as tensors, the rest as metadata
        let original = num("rope.scaling.original_context_length").ok_or_else(|| {
            spec_error(
                "LongRoPE factors without rope.scaling.original_context_length in the metadata",
            )
        })?;
        return Ok(Some(Found::LongRopeTensors {
            long,
            short,
            original,
            attn_factor: num("rope.scaling.attn_factor").unwrap_or(1.0) as f32,
        }));
    }
    let scaling = match ck {
        Some(c) if c.format() == Format::Gguf => gguf_scaling(c.metadata(), &spec.architecture),
        _ => ck
            .and_then(|c| c.config())
            .map(rope_scaling)
            .transpose()?
            .flatten(),
    };
    Ok(scaling.map(Found::Scaling))
}

/// A checkpoint's RoPE scaling, as `weightlift inspect` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RopeScaling {
    /// `linear`, `llama3`, `yarn` or `longrope`.
    pub kind: &'static str,
    /// How many times the pretraining context it stretches to, where the checkpoint says.
    pub factor: Option<f64>,
    /// The pretraining context the scaling starts from, where the checkpoint says.
    pub original_context: Option<f64>,
    /// Where it is read: `config.json`, `metadata` or `tensors` (llama.cpp's converter stores
    /// Llama 3's and LongRoPE's factors as tensors).
    pub from: &'static str,
    /// The layers it scales: `all`, or `full_attention` (Gemma 3 scales its global layers only;
    /// its sliding ones keep their own base unscaled).
    pub layers: &'static str,
}

/// The RoPE scaling the forward pass applies to `source`'s model (`spec`), described;
/// `None` for plain RoPE. The error loading would fail with for a scaling it does not apply
/// ([`check_rope`]).
pub fn rope_scaling_of(source: &dyn Source, spec: &ModelSpec) -> Result<Option<RopeScaling>> {
    check_rope(source)?;
    let from_config = source.checkpoint().map(|c| c.format()) != Some(Format::Gguf);
    let settings = if from_config {
        "config.json"
    } else {
        "metadata"
    };
    if let Some([_, (_, scale)]) = super::family::gemma3_ropes(source.checkpoint(), spec)? {
        return Ok((scale != 1.0).then(|| RopeScaling {
            kind: "linear",
            factor: Some(f64::from(1.0 / scale)),
            original_context: None,
            from: settings,
            layers: "full_attention",
        }));
    }
    Ok(scaling_found(source, spec)?.map(|found| match found {
        Found::FreqsTensor(_) => RopeScaling {
            kind: "llama3",
            factor: None,
            original_context: None,
            from: "tensors",
            layers: "all",
        },
        Found::LongRopeTensors { original, .. } => RopeScaling {
            kind: "longrope",
            factor: Some(spec.context_length as f64 / original),
            original_context: Some(original),
            from: "tensors",
            layers: "all",
        },
        Found::Scaling(s) => {
            let (kind, factor, original) = match s {
                Scaling::Linear(f) => ("linear", f64::from(f), None),
                Scaling::Yarn(y) => ("yarn", y.factor, Some(y.original)),
                Scaling::Llama3 {
                    factor, original, ..
                } => ("llama3", f64::from(factor), Some(f64::from(original))),
                Scaling::LongRope {
                    stretch, original, ..
                } => ("longrope", stretch, Some(original)),
            };
            RopeScaling {
                kind,
                factor: Some(factor),
                original_context: original,
                from: settings,
                layers: "all",
            }
        }
    }))
}

enum Scaling {
    Linear(f32),
    Yarn(Yarn),
    Llama3 {
        factor: f32,
        low: f32,
        high: f32,
        original: f32,
    },
    /// The two per-pair lists, the pretraining length that chooses between them, the stretch
    /// of the context, and the cosine and sine's factor.
    LongRope {
        short: Vec<f32>,
        long: Vec<f32>,
        original: f64,
        stretch: f64,
        attn_factor: f32,
    },
}

/// YaRN's parameters, as the module documentation describes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Yarn {
    pub factor: f64,
    pub original: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Whether the band's ends are rounded out to whole pairs (transformers' `truncate`,
    /// always so in llama.cpp).
    pub truncate: bool,
    pub attn_factor: f32,
}

impl Yarn {
    /// Per pair of `n_dims` rotated values at base `base`: what its angle is divided by.
    pub fn divisors(&self, base: f32, n_dims: usize) -> Vec<f32> {
        let (dim, base) = (n_dims as f64, f64::from(base));
        // the pair that turns `turns` times over the pretraining length
        let pair = |turns: f64| {
            dim * (self.original / (turns * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
        };
        let (mut low, mut high) = (pair(self.beta_fast), pair(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, high) = (low.max(0.0), high.min(dim - 1.0));
        let width = if low == high { 0.001 } else { high - low };
        (0..n_dims / 2)
            .map(|i| {
                // 1 where the pair keeps its angle, 0 where it is slowed by the factor
                let keep = 1.0 - ((i as f64 - low) / width).clamp(0.0, 1.0);
                (1.0 / (keep + (1.0 - keep) / self.factor)) as f32
            })
            .collect()
    }
}

/// `0.1 · mscale · ln factor + 1` (1 without a stretch): YaRN's attention factor.
fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

/// A config's YaRN (`rope_scaling` or `rope_parameters` `r`), as transformers'
/// `_compute_yarn_parameters` reads it: the pretraining length at the config's top level, in
/// `r`, or the config's `max_position_embeddings`; the factor in `r` or the ratio of the two
/// lengths; `attention_factor`, else from `mscale` and `mscale_all_dim`, else from the factor.
fn yarn(cfg: &serde_json::Value, r: &serde_json::Value) -> Result<Scaling> {
    let number = |v: &serde_json::Value, k: &str| v.get(k).and_then(serde_json::Value::as_f64);
    let original = number(cfg, "original_max_position_embeddings")
        .or_else(|| number(r, "original_max_position_embeddings"))
        .or_else(|| number(cfg, "max_position_embeddings"))
        .ok_or_else(|| spec_error("YaRN without original_max_position_embeddings"))?;
    let factor = match number(r, "factor") {
        Some(f) => f,
        None => {
            number(cfg, "max_position_embeddings")
                .ok_or_else(|| spec_error("YaRN without a factor or max_position_embeddings"))?
                / original
        }
    };
    let nonzero = |k: &str| number(r, k).filter(|&v| v != 0.0);
    let attn_factor = match (
        number(r, "attention_factor"),
        nonzero("mscale"),
        nonzero("mscale_all_dim"),
    ) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) => yarn_mscale(factor, m) / yarn_mscale(factor, all),
        _ => yarn_mscale(factor, 1.0),
    };
    Ok(Scaling::Yarn(Yarn {
        factor,
        original,
        beta_fast: nonzero("beta_fast").unwrap_or(32.0),
        beta_slow: nonzero("beta_slow").unwrap_or(1.0),
        truncate: r
            .get("truncate")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(true),
        attn_factor: attn_factor as f32,
    }))
}

/// The RoPE scaling of GGUF metadata that the forward pass applies by angle (linear and
/// YaRN; Llama 3's and LongRoPE's come as tensors): llama.cpp's keys, its defaults where one
/// is absent. [`check_rope`] refused YaRN's other variants.
fn gguf_scaling(md: &weightlift_format::Metadata, arch: &str) -> Option<Scaling> {
    let num = |key: &str| md.get(&format!("{arch}.{key}")).and_then(MetaValue::as_f64);
    let kind = match md.get(&format!("{arch}.rope.scaling.type")) {
        Some(MetaValue::String(t)) => t.as_str(),
        _ => return None,
    };
    let factor = num("rope.scaling.factor").filter(|&f| f > 0.0)?;
    match kind {
        "linear" => Some(Scaling::Linear(factor as f32)),
        "yarn" => Some(Scaling::Yarn(Yarn {
            factor,
            original: num("rope.scaling.original_context_length")?,
            beta_fast: num("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
            beta_slow: num("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
            truncate: true,
            attn_factor: yarn_mscale(factor, 1.0) as f32,
        })),
        _ => None,
    }
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
        "yarn" => Some(yarn(cfg, r)?),
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
        stretch,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// YaRN's angles are transformers' (`_compute_yarn_parameters`, recorded by
    /// `tests/gen_rope_scaling.py` for configs that set each of its knobs: betas,
    /// `attention_factor`, `mscale` with `mscale_all_dim`, `truncate`): every pair's inverse
    /// frequency within 2e-6 of it relatively, and the attention factor.
    #[test]
    fn yarn_angles_are_transformers() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/tiny-qwen3/rope_scaling.json"
        );
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = doc["yarn_inv_freq"].as_array().unwrap();
        assert_eq!(cases.len(), 6);
        for case in cases {
            let r = &case["rope_parameters"];
            let cfg = serde_json::json!({
                "max_position_embeddings": case["max_position_embeddings"],
                "rope_parameters": r,
            });
            let Some(Scaling::Yarn(y)) = rope_scaling(&cfg).unwrap() else {
                panic!("not read as YaRN: {r}");
            };
            let hd = case["head_dim"].as_u64().unwrap() as usize;
            let p = RopeParams {
                style: RopeStyle::Neox,
                head_dim: hd,
                n_dims: hd,
                freq_base: r["rope_theta"].as_f64().unwrap() as f32,
                freq_scale: 1.0,
                attn_factor: 1.0,
            };
            let divisors = y.divisors(p.freq_base, hd);
            let inv = weightlift_kernels::rope_inv_freqs(&p, Some(&divisors)).unwrap();
            let want = case["inv_freq"].as_array().unwrap();
            assert_eq!(inv.len(), want.len(), "{r}");
            for (i, (got, want)) in inv.iter().zip(want).enumerate() {
                let want = want.as_f64().unwrap();
                let err = (f64::from(*got) - want).abs() / want;
                assert!(err <= 2e-6, "{r}: pair {i}: {got} against {want}");
            }
            let attn = case["attention_factor"].as_f64().unwrap();
            assert!(
                (f64::from(y.attn_factor) - attn).abs() <= 1e-6,
                "{r}: {attn}"
            );
        }
    }
}

//! Sliding-window attention: which layers attend only to the most recent tokens, and how many
//! cache cells such a layer keeps.
//!
//! The layers come from the checkpoint: GGUF's `{arch}.attention.sliding_window` with the
//! per-architecture pattern llama.cpp hard-codes (`llama_hparams::set_swa_pattern`), which
//! `{arch}.attention.sliding_window_pattern` overrides; or config.json's `sliding_window` with
//! transformers' per-layer rules (`layer_types`, gemma3's `sliding_window_pattern`, qwen2's
//! `use_sliding_window` and `max_window_layers`, mistral's window on every layer).
//!
//! A sliding-window layer's cache is sized as llama.cpp sizes its SWA cache
//! (`llama_kv_cache_iswa`): the window plus one micro-batch, padded to 256 cells, never more than
//! the full cache. Full-attention layers keep every token. The engine allocates exactly these
//! cells and keeps a sliding layer's cache as a ring over them: the micro-batch is the room a
//! chunk's new keys take without overwriting a key one of its own queries still needs.

use serde::{Deserialize, Serialize};
use weightlift_format::{MetaRef, MetaValue, Metadata, ModelSpec};

use crate::error::{PlanError, Result};
use crate::memory::{CacheSpec, RuntimeSpec};
use crate::request::PlanRequest;

/// llama.cpp pads its SWA cache to this many cells.
pub const SWA_PAD: u64 = 256;

/// The sliding-window layers of a model and the window they attend to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SlidingWindow {
    /// Tokens a sliding-window layer attends to (llama.cpp's `n_swa`).
    pub window: u64,
    /// One entry per layer: true for a sliding-window layer, false for full attention.
    pub layers: Vec<bool>,
}

/// llama.cpp's sliding-window period for the architectures that hard-code one: every
/// `period`-th layer attends to everything, the others to the window
/// (`il % period < period - 1`). Architectures not listed get no window unless the file names
/// its layers: assuming full attention over-estimates the cache rather than under-estimating it.
const GGUF_PERIODS: &[(&str, u64)] = &[
    ("gemma2", 2),
    ("gemma3", 6),
    ("gemma3n", 5),
    ("cohere2", 4),
    ("gpt-oss", 2),
];

fn spec_error(key: &str, detail: String) -> PlanError {
    PlanError::Spec {
        detail: format!("{key}: {detail}; the metadata or config.json is corrupted"),
    }
}

impl SlidingWindow {
    /// Every `period`-th layer (the last of each group) attends to everything, the others to
    /// the window; period 0 makes every layer a sliding-window one, as in llama.cpp.
    pub fn periodic(window: u64, period: u64, n_layers: u32) -> SlidingWindow {
        let layers = (0..u64::from(n_layers))
            .map(|l| period == 0 || (l % period) + 1 < period)
            .collect();
        SlidingWindow { window, layers }
    }

    /// The window of a GGUF checkpoint, `None` when it has none.
    pub fn from_gguf(metadata: &Metadata, spec: &ModelSpec) -> Result<Option<SlidingWindow>> {
        let arch = &spec.architecture;
        let key = format!("{arch}.attention.sliding_window");
        let window = match metadata.get(&key) {
            None => return Ok(None),
            Some(v) => v.as_u64().ok_or_else(|| {
                spec_error(&key, format!("expected an unsigned integer, got {v:?}"))
            })?,
        };
        if window == 0 {
            return Ok(None);
        }
        let pattern_key = format!("{arch}.attention.sliding_window_pattern");
        let n = spec.n_layers;
        let layers = match metadata.get(&pattern_key) {
            Some(MetaValue::Array(a)) => {
                if a.len() != n as usize {
                    return Err(spec_error(
                        &pattern_key,
                        format!("expected one entry per layer ({n}), got {}", a.len()),
                    ));
                }
                let mut flags = Vec::with_capacity(a.len());
                for v in a.iter() {
                    flags.push(match v {
                        MetaRef::Bool(b) => b,
                        other => other.as_u64().map(|x| x != 0).ok_or_else(|| {
                            spec_error(&pattern_key, format!("expected bools, got {other:?}"))
                        })?,
                    });
                }
                flags
            }
            Some(v) => {
                let period = v.as_u64().ok_or_else(|| {
                    spec_error(
                        &pattern_key,
                        format!("expected a period or a per-layer array, got {v:?}"),
                    )
                })?;
                SlidingWindow::periodic(window, period, n).layers
            }
            None => match GGUF_PERIODS.iter().find(|(a, _)| a == arch) {
                Some(&(_, period)) => SlidingWindow::periodic(window, period, n).layers,
                None => return Ok(None),
            },
        };
        Ok(Some(SlidingWindow { window, layers }))
    }

    /// The window of an HF config.json, by transformers' rules, `None` when it has none.
    pub fn from_hf_config(
        config: &serde_json::Value,
        spec: &ModelSpec,
    ) -> Result<Option<SlidingWindow>> {
        // Multimodal configs nest the language model, as ModelSpec::from_hf_config reads it.
        let c = match config.get("text_config") {
            Some(t @ serde_json::Value::Object(_)) if config.get("num_hidden_layers").is_none() => {
                t
            }
            _ => config,
        };
        let window = match c.get("sliding_window") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(v) => v.as_u64().ok_or_else(|| {
                spec_error(
                    "sliding_window",
                    format!("expected an integer or null, got {v}"),
                )
            })?,
        };
        if window == 0 {
            return Ok(None);
        }
        let n = spec.n_layers;
        if let Some(types) = c.get("layer_types").and_then(|v| v.as_array()) {
            if types.len() != n as usize {
                return Err(spec_error(
                    "layer_types",
                    format!("expected one entry per layer ({n}), got {}", types.len()),
                ));
            }
            let layers = types
                .iter()
                .map(|t| t.as_str() == Some("sliding_attention"))
                .collect();
            return Ok(Some(SlidingWindow { window, layers }));
        }
        let uint = |k: &str| c.get(k).and_then(serde_json::Value::as_u64);
        let model_type = c
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or(&spec.architecture);
        let layers = match model_type {
            "gemma3" | "gemma3_text" => {
                SlidingWindow::periodic(window, uint("sliding_window_pattern").unwrap_or(6), n)
                    .layers
            }
            "cohere2" => {
                SlidingWindow::periodic(window, uint("sliding_window_pattern").unwrap_or(4), n)
                    .layers
            }
            "gemma2" => SlidingWindow::periodic(window, 2, n).layers,
            "qwen2" => {
                if c.get("use_sliding_window").and_then(|v| v.as_bool()) != Some(true) {
                    return Ok(None);
                }
                let from = uint("max_window_layers").unwrap_or(28);
                (0..u64::from(n)).map(|l| l >= from).collect()
            }
            "mistral" => vec![true; n as usize],
            _ => return Ok(None),
        };
        Ok(Some(SlidingWindow { window, layers }))
    }

    /// Whether layer `layer` attends to the window only.
    pub fn is_sliding(&self, layer: usize) -> bool {
        self.layers.get(layer).copied().unwrap_or(false)
    }

    /// Cells per sequence a layer keeps with a cache of `max_seq_len` tokens and `ubatch` tokens
    /// per forward chunk: llama.cpp's SWA cache, `pad256(window + ubatch)`, for a
    /// sliding-window layer (capped at `max_seq_len`, since a cache never holds more tokens
    /// than asked for), and `max_seq_len` for a full-attention one.
    pub fn cells(&self, layer: usize, max_seq_len: u64, ubatch: u64) -> u64 {
        if !self.is_sliding(layer) {
            return max_seq_len;
        }
        let want = self
            .window
            .saturating_add(ubatch)
            .div_ceil(SWA_PAD)
            .saturating_mul(SWA_PAD);
        want.min(max_seq_len)
    }

    /// Whether any layer attends to the window only.
    pub fn any(&self) -> bool {
        self.layers.iter().any(|&s| s)
    }

    /// Inclusive ranges of the sliding-window layers.
    pub(crate) fn sliding_ranges(&self) -> Vec<(u32, u32)> {
        crate::plan::to_ranges(
            (0..self.layers.len() as u32).filter(|&l| self.is_sliding(l as usize)),
        )
    }
}

/// The window a plan sizes caches by: the request's, whatever the architecture. The engine keeps
/// a sliding-window layer's cache as a ring of [`SlidingWindow::cells`] rows (position `p` in row
/// `p % cells`), so its caches hold exactly what the plan counts.
pub(crate) fn planned_window(req: &PlanRequest) -> Option<&SlidingWindow> {
    req.sliding_window.as_ref().filter(|w| w.any())
}

/// Tokens per sequence of one forward chunk with a cache of `max_seq_len` tokens: the SWA
/// cache's micro-batch, `ubatch` of [`SlidingWindow::cells`] (the engine's forward pass cuts
/// prompts into chunks of at most this many tokens of one sequence).
pub fn ubatch(runtime: &RuntimeSpec, max_seq_len: u64) -> u64 {
    runtime.effective().0.min(max_seq_len)
}

/// Layer `layer`'s cache: `cache`, or `cache` cut to the window for a sliding-window layer.
pub(crate) fn layer_cache(
    cache: &CacheSpec,
    window: Option<&SlidingWindow>,
    layer: usize,
    runtime: &RuntimeSpec,
) -> CacheSpec {
    match window {
        Some(w) => CacheSpec {
            max_seq_len: w.cells(layer, cache.max_seq_len, ubatch(runtime, cache.max_seq_len)),
            ..*cache
        },
        None => *cache,
    }
}

/// Bytes of the whole cache of `req` with `cache` and `runtime`, sliding windows applied.
pub(crate) fn total_cache_bytes(
    req: &PlanRequest,
    cache: &CacheSpec,
    runtime: &RuntimeSpec,
) -> u64 {
    let window = planned_window(req);
    (0..req.spec.n_layers as usize).fold(0u64, |a, l| {
        a.saturating_add(layer_cache(cache, window, l, runtime).layer_bytes(&req.spec, l))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_cpp_patterns() {
        // gemma3 (period 6): layers 5, 11, ... attend to everything.
        let w = SlidingWindow::periodic(512, 6, 13);
        let full: Vec<usize> = (0..13).filter(|&l| !w.is_sliding(l)).collect();
        assert_eq!(full, [5, 11]);
        // gemma2 (period 2): even layers slide.
        let w = SlidingWindow::periodic(4096, 2, 4);
        assert_eq!(w.layers, [true, false, true, false]);
        // period 1: no sliding layer (llama.cpp's `il % 1 < 0` is never true); period 0: all.
        assert!(SlidingWindow::periodic(8, 1, 3).layers.iter().all(|s| !s));
        assert!(SlidingWindow::periodic(8, 0, 3).layers.iter().all(|s| *s));
    }

    #[test]
    fn cells_are_the_window_plus_a_ubatch_padded() {
        let w = SlidingWindow {
            window: 512,
            layers: vec![true, false],
        };
        // 512 + 512 = 1024, already a multiple of 256.
        assert_eq!(w.cells(0, 32768, 512), 1024);
        // 512 + 100 = 612 -> 768.
        assert_eq!(w.cells(0, 32768, 100), 768);
        // Never more than the full cache.
        assert_eq!(w.cells(0, 700, 100), 700);
        assert_eq!(w.cells(1, 32768, 512), 32768);
    }
}

//! Causal attention over the cache, tiled: keys and values are decoded from the cache
//! `kv_tile` rows at a time and folded, `q_tile` queries at a time, into the running softmax
//! of the kernels' [`Attention`] (its scratch for one fold step's weights is the `scores`
//! region), so no head ever holds more than `max_attention_size` attention weights. The CPU
//! backend's attention operation runs the same kernel over the same tiles, so both paths give
//! the same bits.

use weightlift_kernels::cpu::attention::{Attention, AttnShape};

use super::isa;
use crate::cache::{Cache, Resident};
use crate::error::{EngineError, Result};

/// The sizes one layer's attention runs with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub n_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub kv_tile: usize,
    pub q_tile: usize,
    /// Round queries and attention weights to f16 before they meet an f16 cache, as
    /// llama.cpp's CPU matrix products do (its `vec_dot_type` for f16 is f16): the fast path's
    /// fidelity to llama.cpp.
    pub f16_operands: bool,
    /// Multiplier of the scores.
    pub scale: f32,
    /// The sliding window (0: none).
    pub window: usize,
    /// Attention logit soft-cap (0: none).
    pub softcap: f32,
}

/// Buffers of one device's workspace that attention uses.
pub(crate) struct Tiles<'a> {
    /// Decoded keys of one tile, token-major (`kv_tile × kv_heads × head_dim`).
    pub kt: &'a mut [f32],
    /// Decoded values of one tile.
    pub vt: &'a mut [f32],
    /// Attention weights of one fold step for the `q_tile` queries of every head.
    pub scores: &'a mut [f32],
    /// Running maximum and sum per head and query: `2 × n` per head.
    pub stats: &'a mut [f32],
    /// Output accumulators (`n_heads × n × head_dim`).
    pub acc: &'a mut [f32],
}

/// Attention of the `n` queries in `qo` (token-major, `n × n_heads × head_dim`, already
/// rotated) at positions `start..start + n` over the keys of positions `0..start + n` of
/// `layer` (this chunk's keys and values already written; the cache decodes each position from
/// its row, a sliding-window layer's ring included). The result replaces the queries in `qo`.
pub(crate) fn attend(
    s: Shape,
    cache: &Cache,
    layer: usize,
    resident: Option<&Resident>,
    start: usize,
    qo: &mut [f32],
    t: Tiles<'_>,
) -> Result<()> {
    let kernel = |e| EngineError::Device {
        device: "cpu".into(),
        detail: format!("layer {layer} attention: {e}"),
    };
    let (hd, nh) = (s.head_dim, s.n_heads);
    let n = qo.len() / (nh * hd);
    let shape = AttnShape::new(nh, s.kv_heads, hd, n, start, s.scale, s.f16_operands)
        .map_err(kernel)?
        .masked(s.window, s.softcap);
    let kvd = shape.kv_dim();
    let isa = isa();
    let mut att = Attention::new(shape, s.kv_tile, t.stats, t.acc).map_err(kernel)?;
    let total = start + n;
    // the query tiles that see some of the keys from `k0` (queries before a tile's first key
    // see none of it)
    let q_tile = s.q_tile.max(1);
    let seeing = |k0: usize| {
        (0..n)
            .step_by(q_tile)
            .map(move |q0| q0..n.min(q0 + q_tile))
            .filter(move |queries| start + queries.end > k0)
    };
    // the step form reads an f16 cache's rows in place where it can (the same bits as
    // decoding them: each key and value is read where it is used, where decoding wrote each
    // to a tile and read it back)
    let in_place = !shape.tiled() && resident.is_none();
    // a sliding layer's first query sees no key before `start + 1 - window`: the tiles wholly
    // before it add nothing to any query, so they are neither decoded nor folded (a ring holds
    // none of them)
    let mut k0 = shape.first_tile(s.kv_tile);
    while k0 < total {
        let tk = s.kv_tile.min(total - k0);
        if in_place {
            let folded = cache.with_f16_rows(layer, k0 as u64, tk, |k, v| {
                seeing(k0).try_for_each(|queries| {
                    att.fold_f16_with(isa, qo, queries, k0, k, v, t.scores)
                        .map_err(kernel)
                })
            })?;
            if folded.is_some() {
                k0 += tk;
                continue;
            }
        }
        let (kt, vt) = (&mut t.kt[..tk * kvd], &mut t.vt[..tk * kvd]);
        cache.decode_rows(layer, resident, k0 as u64, kt, vt)?;
        for queries in seeing(k0) {
            att.fold_with(isa, qo, queries, k0, kt, vt, t.scores)
                .map_err(kernel)?;
        }
        k0 += tk;
    }
    att.finish(qo).map_err(kernel)
}

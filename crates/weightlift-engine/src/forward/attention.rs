//! Causal attention over the cache, tiled: keys and values are decoded from the cache
//! `kv_tile` rows at a time, each head meets at most `q_tile × kv_tile` of them at once, and an
//! online softmax (running maximum and sum per query and head) folds the tiles together, so no
//! head ever holds more than `max_attention_size` attention weights.

use rayon::prelude::*;

use weightlift_kernels::cpu::matvec::dot_f32;

use super::isa;
use crate::cache::{Cache, Resident};
use crate::error::Result;

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
}

/// Buffers of one device's workspace that attention uses.
pub(crate) struct Tiles<'a> {
    /// Decoded keys of one tile, token-major (`kv_tile × kv_heads × head_dim`).
    pub kt: &'a mut [f32],
    /// Decoded values of one tile.
    pub vt: &'a mut [f32],
    /// Attention weights of one tile: `q_tile × kv_tile` per head.
    pub scores: &'a mut [f32],
    /// Running maximum and sum per head and query: `2 × n` per head.
    pub stats: &'a mut [f32],
    /// Output accumulators, head-major (`n_heads × n × head_dim`).
    pub acc: &'a mut [f32],
}

/// Attention of the `n` queries in `qo` (token-major, `n × n_heads × head_dim`, already
/// rotated) at positions `start..start + n` over cache rows `0..start + n` of `layer` (this
/// chunk's keys and values already written). The result replaces the queries in `qo`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend(
    s: Shape,
    cache: &Cache,
    layer: usize,
    resident: Option<&Resident>,
    start: usize,
    qo: &mut [f32],
    t: Tiles<'_>,
) -> Result<()> {
    let q: &[f32] = qo;
    let (hd, nh) = (s.head_dim, s.n_heads);
    let n = q.len() / (nh * hd);
    let group = nh / s.kv_heads;
    let kvd = s.kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let total = start + n;
    let isa = isa();
    let acc = &mut t.acc[..nh * n * hd];
    let stats = &mut t.stats[..nh * 2 * n];
    acc.fill(0.0);
    for st in stats.chunks_exact_mut(2 * n) {
        st[..n].fill(f32::NEG_INFINITY);
        st[n..].fill(0.0);
    }
    let mut k0 = 0;
    while k0 < total {
        let tk = s.kv_tile.min(total - k0);
        let (kt, vt) = (&mut t.kt[..tk * kvd], &mut t.vt[..tk * kvd]);
        cache.decode_rows(layer, resident, k0 as u64, kt, vt)?;
        let (kt, vt) = (&*kt, &*vt);
        let mut q0 = 0;
        while q0 < n {
            let tq = s.q_tile.min(n - q0);
            // Queries see keys up to their own position; skip a block that sees none of these.
            if k0 < start + q0 + tq {
                acc.par_chunks_mut(n * hd)
                    .zip(stats.par_chunks_mut(2 * n))
                    .zip(t.scores.par_chunks_mut(s.q_tile * s.kv_tile))
                    .enumerate()
                    .for_each(|(h, ((acc_h, st), sc))| {
                        let kh = h / group;
                        let (m, l) = st.split_at_mut(n);
                        for i in q0..q0 + tq {
                            let seen = (start + i + 1).saturating_sub(k0).min(tk);
                            if seen == 0 {
                                continue;
                            }
                            let mut qr = [0f32; 256];
                            let mut qi = &q[(i * nh + h) * hd..][..hd];
                            if s.f16_operands && hd <= qr.len() {
                                for (d, x) in qr.iter_mut().zip(qi) {
                                    *d = half::f16::from_f32(*x).to_f32();
                                }
                                qi = &qr[..hd];
                            }
                            let row = &mut sc[(i - q0) * s.kv_tile..][..seen];
                            let mut mx = f32::NEG_INFINITY;
                            for (j, w) in row.iter_mut().enumerate() {
                                *w = dot_f32(isa, qi, &kt[j * kvd + kh * hd..][..hd]) * scale;
                                mx = mx.max(*w);
                            }
                            let m_new = m[i].max(mx);
                            let keep = (m[i] - m_new).exp();
                            let a = &mut acc_h[i * hd..][..hd];
                            if keep != 1.0 {
                                a.iter_mut().for_each(|x| *x *= keep);
                            }
                            let mut sum = 0f32;
                            for (j, w) in row.iter().enumerate() {
                                let mut p = (w - m_new).exp();
                                if s.f16_operands {
                                    p = half::f16::from_f32(p).to_f32();
                                }
                                sum += p;
                                let vj = &vt[j * kvd + kh * hd..][..hd];
                                a.iter_mut().zip(vj).for_each(|(x, v)| *x += p * v);
                            }
                            l[i] = l[i] * keep + sum;
                            m[i] = m_new;
                        }
                    });
            }
            q0 += tq;
        }
        k0 += tk;
    }
    // Normalise and lay the heads out token-major for the output projection.
    qo.par_chunks_mut(nh * hd).enumerate().for_each(|(i, o)| {
        for h in 0..nh {
            let inv = 1.0 / stats[h * 2 * n + n + i];
            let a = &acc[(h * n + i) * hd..][..hd];
            o[h * hd..(h + 1) * hd]
                .iter_mut()
                .zip(a)
                .for_each(|(y, x)| *y = x * inv);
        }
    });
    Ok(())
}

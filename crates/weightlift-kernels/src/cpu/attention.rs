//! Causal grouped-query attention over f32 key and value rows, folded into a running (online)
//! softmax a fold step at a time, so no score matrix is ever held: each query row (one token,
//! one head) carries its running maximum `m`, running sum `l` and unnormalised output `o`
//! from one step to the next. The engine's host forward pass folds the cache tile by tile as
//! it decodes it; the CPU backend's attention operation folds the rows it was given through
//! [`attention_with`]. Both go through [`Attention`], so they give the same bits when they use
//! the same tile.
//!
//! For a query row `q` and the keys `j < seen` of a step that its position lets it see:
//!
//! ```text
//! q̃    = q, rounded to f16 and back when f16_operands
//! s_j  = q̃ · k_j
//! w_j  = s_j · scale
//! m'   = max(m, maxⱼ w_j)
//! keep = exp(m − m')
//! p_j  = exp(w_j − m'), rounded to f16 and back when f16_operands
//! l    = l · keep + (((0 + p_0) + p_1) + … + p_{seen−1})
//! o[d] = (…((o[d] · keep) + p_0 · v_0[d]) + …) + p_{seen−1} · v_{seen−1}[d]
//! m    = m'
//! ```
//!
//! and at the end `out = o · (1 / l)`. Rounding `q` and `p` to f16 is what llama.cpp's CPU
//! products do with an f16 cache (they convert the f32 operand to the cache's type), so
//! `compute="fast"` keeps to its numbers. Two forms differ in how `s_j` and `exp` are
//! computed, and in the step:
//!
//! - **The step form**, for calls of fewer than [`TILED_MIN_QUERIES`] queries (decode steps,
//!   short prompts): one step per tile, `s_j` by [`dot_f32`] (the instruction set's own
//!   summation order), libm's `exp`, and each `p_j · v_j[d]` rounded before it is added. This
//!   is the arithmetic the forward pass had for every call before the tiled form, bit for bit.
//!   The engine's greedy agreement with llama.cpp and its prefix-reuse checks were calibrated
//!   on it, and the fast path's margins at some of their steps are a few hundredths (any change
//!   in the last bits can flip them), so short calls keep it, as the matrix products keep
//!   token-by-token products below 8 tokens. Its cost is a small share of a decode step.
//! - **The tiled form**, from [`TILED_MIN_QUERIES`] queries: steps of at most [`FOLD_KEYS`]
//!   keys, `s_j = fma(q̃[hd−1], k_j[hd−1], … fma(q̃[0], k_j[0], 0))` with `d` in order, the
//!   vector exponential of the row operations (≤ 1.5 ulp; [`exp_twin`] is its scalar form),
//!   `μ = m'` (0 while `m'` is −∞) in place of `m'` in both exponentials, and `o[d] + p_j ·
//!   v_j[d]` fused when `f16_operands` (an f16 weight times an f16 cache value is exact in
//!   f32, so that is the same sum). Every sum runs in a fixed order, so the AVX-512, AVX2 and
//!   scalar forms give the same bits on finite inputs, whatever the thread count or the split
//!   of the queries into calls. The SIMD forms (`x86_ops::attention`) only lay the work out
//!   differently: each step's keys are transposed so that 16 (8) keys share a vector while
//!   four query rows meet them in registers, and the weighted values are summed with head
//!   dimensions in lanes. They also add the zero weights of keys a row cannot see within a
//!   block of rows, which leaves `o` unchanged while the values are finite.

use std::ops::Range;

use super::attention_rows::{fold_task_scalar, fold_task_step};

use rayon::prelude::*;

use super::{Isa, check_len};
use crate::error::{KernelError, Result};

/// The most keys one fold step takes (the SIMD forms hold a step's scores for four query rows
/// in registers).
pub const FOLD_KEYS: usize = 64;

/// Values of one step's transposed keys (`head_dim × keys`, keys rounded up to 16) that a SIMD
/// task keeps on its stack (32 KiB); steps take fewer keys for heads wider than 128.
pub(crate) const KT_VALUES: usize = 8192;

/// The widest head the SIMD forms take (four query rows of it live on the stack); wider heads
/// take the scalar form.
pub(crate) const MAX_SIMD_HEAD_DIM: usize = 256;

/// Calls with at least this many queries take the tiled form (see the module documentation).
pub const TILED_MIN_QUERIES: usize = 16;

/// Query rows (token × head of one kv head) per parallel task: enough to amortise transposing
/// each step's keys, few enough that a prompt's queries make many tasks.
const TASK_ROWS: usize = 48;

/// Multiply-adds of a fold below which it runs on the calling thread (a decode step's handful
/// of rows costs less than handing work to another thread).
const MIN_PARALLEL_WORK: usize = 1 << 18;

/// How many multiply-adds one value of the step form counts as, for [`MIN_PARALLEL_WORK`]:
/// each key of each row is a dot, a scalar `exp` and a weighted add (about 20 ns a key and row
/// at 64 values a head, measured on the demo model), so a decode step's fold over a 256-key
/// tile is some 45 µs of work, which ran on the calling thread alone when counted as
/// multiply-adds.
const STEP_COST: usize = 4;

/// The first key position a query at `position` sees under a sliding window of `window` keys
/// (0: none, and every key from 0), as the kernels' `wl_fa_first_key`.
pub fn window_start(position: usize, window: usize) -> usize {
    match window {
        0 => 0,
        w => (position + 1).saturating_sub(w),
    }
}

/// The sizes of one attention call: `n_q` queries at positions `start..start + n_q`, of
/// `n_heads` heads of `head_dim` values, over the keys at positions `0..start + n_q` of
/// `kv_heads` heads (query head `h` reads kv head `h / (n_heads / kv_heads)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    pub n_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub n_q: usize,
    pub start: usize,
    /// Multiplier of the scores (`1/√head_dim`).
    pub scale: f32,
    /// Round each query and each attention weight to f16 before it meets the values (see the
    /// module documentation).
    pub f16_operands: bool,
    /// A sliding window: the query at position `p` sees the keys at `p - window + 1..=p` only
    /// (transformers' and llama.cpp's `p - k < window`); 0 for none.
    pub window: usize,
    /// Attention logit soft-capping (gemma2): each scaled score `w` becomes
    /// `softcap · tanh(w / softcap)` before the softmax; 0 for none.
    pub softcap: f32,
}

impl AttnShape {
    /// The shape, or a shape error naming what is wrong: heads a non-zero multiple of the kv
    /// heads, a non-empty head, and buffer sizes that fit in memory arithmetic.
    pub fn new(
        n_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        n_q: usize,
        start: usize,
        scale: f32,
        f16_operands: bool,
    ) -> Result<AttnShape> {
        let bad = |reason: String| KernelError::Shape {
            op: "attention",
            reason,
        };
        if kv_heads == 0 || n_heads == 0 || !n_heads.is_multiple_of(kv_heads) {
            return Err(bad(format!(
                "{n_heads} query heads are not a non-zero multiple of {kv_heads} kv heads"
            )));
        }
        if head_dim == 0 {
            return Err(bad("head_dim must be above 0".into()));
        }
        let fits = n_q
            .checked_mul(n_heads)
            .and_then(|v| v.checked_mul(head_dim))
            .and_then(|v| v.checked_mul(4))
            .zip(
                start
                    .checked_add(n_q)
                    .and_then(|r| r.checked_mul(n_heads))
                    .and_then(|v| v.checked_mul(head_dim))
                    .and_then(|v| v.checked_mul(4)),
            );
        if fits.is_none() {
            return Err(bad(format!(
                "{n_q} queries at {start} of {n_heads} heads of {head_dim} overflow the buffer sizes"
            )));
        }
        Ok(AttnShape {
            n_heads,
            kv_heads,
            head_dim,
            n_q,
            start,
            scale,
            f16_operands,
            window: 0,
            softcap: 0.0,
        })
    }

    /// This shape with a sliding `window` (0: none) and a logit `softcap` (0: none). A shape
    /// with either folds through the scalar rows (the SIMD tiled forms do not mask or cap).
    pub fn masked(self, window: usize, softcap: f32) -> AttnShape {
        AttnShape {
            window,
            softcap,
            ..self
        }
    }

    /// The first key position any query of the call sees: where the first query's window
    /// starts, 0 without a window.
    pub fn first_key(&self) -> usize {
        window_start(self.start, self.window)
    }

    /// The first key of the first tile (of `tile` keys, counted from key 0) that holds a key
    /// any query sees: the tiles wholly before it add nothing to any query, so no path decodes
    /// or folds them, and every path folds the same tiles from here.
    pub fn first_tile(&self, tile: usize) -> usize {
        self.first_key() / tile.max(1) * tile.max(1)
    }

    /// Checks that a cache of `rows` rows, the key at position `p` in row `p % rows` (a
    /// sliding-window layer's ring), still holds every key the call's queries see once the
    /// call's own keys are written: the `start + n_q - first_key` positions from the first
    /// query's window start up to the last query. A cache of every position has at least
    /// `start + n_q` rows.
    pub fn check_rows(&self, rows: usize) -> Result<()> {
        let seen = (self.start + self.n_q) - self.first_key();
        if seen > rows {
            return Err(KernelError::Shape {
                op: "attention",
                reason: format!(
                    "{} queries from position {} see the keys of {seen} positions (window {}), \
                     more than the cache's {rows} rows hold: the call's own keys would \
                     overwrite keys its queries read",
                    self.n_q,
                    self.start,
                    match self.window {
                        0 => "none".to_owned(),
                        w => w.to_string(),
                    }
                ),
            });
        }
        Ok(())
    }

    /// Whether a window or a soft-cap applies.
    fn is_masked(&self) -> bool {
        self.window > 0 || self.softcap > 0.0
    }

    /// Query heads per kv head.
    fn group(&self) -> usize {
        self.n_heads / self.kv_heads
    }

    /// Values of one cache row (`kv_heads × head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Values of the queries, and of the output.
    pub fn q_values(&self) -> usize {
        self.n_q * self.n_heads * self.head_dim
    }

    /// Whether this call takes the tiled form.
    pub fn tiled(&self) -> bool {
        self.n_q >= TILED_MIN_QUERIES
    }

    /// Keys each fold step takes when the keys come in tiles of `tile`: the whole tile in the
    /// step form; in the tiled form at most [`FOLD_KEYS`], at most the tile, and few enough
    /// that a SIMD task's transposed keys fit its stack. A function of the shape only, so
    /// every path folds at the same keys.
    pub fn fold_keys(&self, tile: usize) -> usize {
        if !self.tiled() {
            return tile.max(1);
        }
        let fit = (KT_VALUES / self.head_dim) / 16 * 16;
        FOLD_KEYS.min(fit.max(16)).min(tile).max(1)
    }

    /// Values of the running maxima and sums [`Attention::new`] needs.
    pub fn stats_len(&self) -> usize {
        2 * self.n_q * self.n_heads
    }

    /// Values of the output accumulators [`Attention::new`] needs.
    pub fn acc_len(&self) -> usize {
        self.q_values()
    }

    /// Values of the weights scratch [`Attention::fold_with`] needs for `queries` queries with
    /// tiles of `tile` keys.
    pub fn scores_len(&self, queries: usize, tile: usize) -> usize {
        queries * self.n_heads * self.fold_keys(tile)
    }
}

/// One attention call in progress: the running state of every query row, in borrowed
/// buffers, grouped by kv head (row `(kh · n_q + t) · group + g` is token `t`, head
/// `kh · group + g`).
pub struct Attention<'a> {
    shape: AttnShape,
    chunk: usize,
    m: &'a mut [f32],
    l: &'a mut [f32],
    o: &'a mut [f32],
}

/// What every task of one fold reads: the queries, one tile of key and value rows (`keys`
/// rows of `kv_dim`, the first at position `k0`; f32 in `k` and `v`, or f16 in `k16` and
/// `v16` for the step form, the other pair empty) and the sizes.
pub(crate) struct Fold<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub k16: &'a [u16],
    pub v16: &'a [u16],
    pub head_dim: usize,
    pub n_heads: usize,
    pub group: usize,
    pub kv_dim: usize,
    pub start: usize,
    pub k0: usize,
    pub keys: usize,
    pub chunk: usize,
    pub scale: f32,
    pub f16: bool,
    pub window: usize,
    pub softcap: f32,
}

impl Fold<'_> {
    /// The first of this tile's keys token `t` sees: 0 without a window.
    pub fn first(&self, t: usize) -> usize {
        if self.window == 0 {
            return 0;
        }
        (self.start + t + 1)
            .saturating_sub(self.window)
            .saturating_sub(self.k0)
            .min(self.keys)
    }

    /// A scaled score, soft-capped when the call caps.
    #[inline]
    pub fn cap(&self, w: f32) -> f32 {
        if self.softcap > 0.0 {
            self.softcap * (w / self.softcap).tanh()
        } else {
            w
        }
    }

    /// The query of token `t`, head `kh · group + g`.
    pub fn q_row(&self, kh: usize, t: usize, g: usize) -> &[f32] {
        let h = kh * self.group + g;
        &self.q[(t * self.n_heads + h) * self.head_dim..][..self.head_dim]
    }

    /// How many of this tile's keys token `t` sees.
    pub fn seen(&self, t: usize) -> usize {
        (self.start + t + 1).saturating_sub(self.k0).min(self.keys)
    }

    /// Key `j` of the tile, kv head `kh`.
    pub fn k_row(&self, kh: usize, j: usize) -> &[f32] {
        &self.k[j * self.kv_dim + kh * self.head_dim..][..self.head_dim]
    }

    /// Value `j` of the tile, kv head `kh`.
    pub fn v_row(&self, kh: usize, j: usize) -> &[f32] {
        &self.v[j * self.kv_dim + kh * self.head_dim..][..self.head_dim]
    }

    /// Key `j` of an f16 tile, kv head `kh`.
    pub fn k16_row(&self, kh: usize, j: usize) -> &[u16] {
        &self.k16[j * self.kv_dim + kh * self.head_dim..][..self.head_dim]
    }
}

/// One tile's key and value rows, as a fold takes them.
#[derive(Clone, Copy)]
enum TileRows<'a> {
    F32(&'a [f32], &'a [f32]),
    /// An f16 cache's own rows (the step form only).
    F16(&'a [u16], &'a [u16]),
}

/// The rows of one kv head that one task folds: tokens from `t0`, `group` rows per token (the
/// first row `g0` of its token's group: 0 except in the step form, whose tasks take single
/// rows), their state and their weights scratch (`chunk` values per row).
pub(crate) struct Task<'a> {
    pub kh: usize,
    pub t0: usize,
    pub g0: usize,
    pub m: &'a mut [f32],
    pub l: &'a mut [f32],
    pub o: &'a mut [f32],
    pub p: &'a mut [f32],
}

impl<'a> Attention<'a> {
    /// Starts an attention call whose keys will come in tiles of `tile` (the first at key 0):
    /// `stats` holds at least [`AttnShape::stats_len`] values and `acc` at least
    /// [`AttnShape::acc_len`]; both are reset.
    pub fn new(
        shape: AttnShape,
        tile: usize,
        stats: &'a mut [f32],
        acc: &'a mut [f32],
    ) -> Result<Attention<'a>> {
        if tile == 0 {
            return Err(KernelError::Shape {
                op: "attention",
                reason: "the key tile must hold at least one key".into(),
            });
        }
        let rows = shape.n_q * shape.n_heads;
        let got = stats.len() + acc.len();
        let (Some(stats), Some(o)) = (stats.get_mut(..2 * rows), acc.get_mut(..shape.acc_len()))
        else {
            return Err(KernelError::LengthMismatch {
                what: "attention state values (stats, acc)",
                expected: shape.stats_len() + shape.acc_len(),
                got,
            });
        };
        let (m, l) = stats.split_at_mut(rows);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        o.fill(0.0);
        Ok(Attention {
            chunk: shape.fold_keys(tile),
            shape,
            m,
            l,
            o,
        })
    }

    /// [`Attention::fold_with`] with the best instruction set.
    pub fn fold(
        &mut self,
        q: &[f32],
        queries: Range<usize>,
        k0: usize,
        k: &[f32],
        v: &[f32],
        scores: &mut [f32],
    ) -> Result<()> {
        self.fold_with(Isa::detect(), q, queries, k0, k, v, scores)
    }

    /// Folds one tile of keys, the cache rows at positions `k0..k0 + k.len() / kv_dim` (`k` and
    /// `v` token-major, `kv_heads × head_dim` per row), into the state of the queries
    /// `queries` (indices into `q`, which holds all `n_q` queries token-major, `n_heads ×
    /// head_dim` per token, already rotated). Each tile must start at a multiple of the
    /// `tile` given to [`Attention::new`] and the tiles must come in order; `scores` holds at
    /// least [`AttnShape::scores_len`]`(queries.len(), tile)` values.
    #[allow(clippy::too_many_arguments)]
    pub fn fold_with(
        &mut self,
        isa: Isa,
        q: &[f32],
        queries: Range<usize>,
        k0: usize,
        k: &[f32],
        v: &[f32],
        scores: &mut [f32],
    ) -> Result<()> {
        self.fold_rows(isa, q, queries, k0, TileRows::F32(k, v), scores)
    }

    /// [`Attention::fold_with`] of a tile of an f16 cache's own rows (`k` and `v` the f16 bits),
    /// read in place: the bits of decoding the tile to f32 first. The step form only (calls of
    /// fewer than [`TILED_MIN_QUERIES`] queries); the tiled form's keys are decoded once for
    /// many queries.
    #[allow(clippy::too_many_arguments)]
    pub fn fold_f16_with(
        &mut self,
        isa: Isa,
        q: &[f32],
        queries: Range<usize>,
        k0: usize,
        k: &[u16],
        v: &[u16],
        scores: &mut [f32],
    ) -> Result<()> {
        if self.shape.tiled() {
            return Err(KernelError::Shape {
                op: "attention",
                reason: format!(
                    "f16 rows fold in the step form, below {TILED_MIN_QUERIES} queries; this \
                     call has {}",
                    self.shape.n_q
                ),
            });
        }
        self.fold_rows(isa, q, queries, k0, TileRows::F16(k, v), scores)
    }

    fn fold_rows(
        &mut self,
        isa: Isa,
        q: &[f32],
        queries: Range<usize>,
        k0: usize,
        rows: TileRows<'_>,
        scores: &mut [f32],
    ) -> Result<()> {
        let s = self.shape;
        let (hd, group, kvd, chunk) = (s.head_dim, s.group(), s.kv_dim(), self.chunk);
        check_len("attention query values", s.q_values(), q.len())?;
        let (k_len, v_len) = match rows {
            TileRows::F32(k, v) => (k.len(), v.len()),
            TileRows::F16(k, v) => (k.len(), v.len()),
        };
        check_len("attention value values", k_len, v_len)?;
        let keys = k_len / kvd;
        let bad = |reason: String| KernelError::Shape {
            op: "attention",
            reason,
        };
        if keys * kvd != k_len || k0 + keys > s.start + s.n_q {
            return Err(bad(format!(
                "{k_len} key values are not whole rows of {kvd} at positions {k0}.. below {}",
                s.start + s.n_q
            )));
        }
        if queries.start > queries.end || queries.end > s.n_q {
            return Err(bad(format!("queries {queries:?} of {}", s.n_q)));
        }
        let nq = queries.len();
        let need = nq * s.n_heads * chunk;
        if scores.len() < need {
            return Err(KernelError::LengthMismatch {
                what: "attention scores values",
                expected: need,
                got: scores.len(),
            });
        }
        if nq == 0 || keys == 0 {
            return Ok(());
        }
        let (k, v, k16, v16): (&[f32], &[f32], &[u16], &[u16]) = match rows {
            TileRows::F32(k, v) => (k, v, &[], &[]),
            TileRows::F16(k, v) => (&[], &[], k, v),
        };
        let f = Fold {
            q,
            k,
            v,
            k16,
            v16,
            head_dim: hd,
            n_heads: s.n_heads,
            group,
            kv_dim: kvd,
            start: s.start,
            k0,
            keys,
            chunk,
            scale: s.scale,
            f16: s.f16_operands,
            window: s.window,
            softcap: s.softcap,
        };
        let tiled = s.tiled();
        // the tiled form's tasks take whole tokens' groups (each step's keys are transposed
        // once for all of them); the step form's take one row each, so a decode step's few
        // rows spread over the threads (its keys are read row by row either way)
        let task_rows = if tiled {
            (TASK_ROWS / group).max(1) * group
        } else {
            1
        };
        let n = s.n_q;
        let mut tasks = Vec::new();
        let per_head = self
            .m
            .chunks_mut(n * group)
            .zip(self.l.chunks_mut(n * group))
            .zip(self.o.chunks_mut(n * group * hd))
            .zip(scores[..need].chunks_mut(nq * group * chunk));
        for (kh, (((m, l), o), p)) in per_head.enumerate() {
            let (a, b) = (queries.start * group, queries.end * group);
            let blocks = m[a..b]
                .chunks_mut(task_rows)
                .zip(l[a..b].chunks_mut(task_rows))
                .zip(o[a * hd..b * hd].chunks_mut(task_rows * hd))
                .zip(p.chunks_mut(task_rows * chunk));
            for (i, (((m, l), o), p)) in blocks.enumerate() {
                let (t0, g0) = (queries.start + i * task_rows / group, i * task_rows % group);
                let last = queries.start + (i * task_rows + m.len() - 1) / group;
                // no token of the block sees this tile's first key
                if s.start + last < k0 {
                    continue;
                }
                tasks.push(Task {
                    kh,
                    t0,
                    g0,
                    m,
                    l,
                    o,
                    p,
                });
            }
        }
        let masked = s.is_masked();
        let cost = if tiled { 1 } else { STEP_COST };
        if nq * s.n_heads * keys * hd * cost < MIN_PARALLEL_WORK {
            tasks
                .into_iter()
                .for_each(|t| fold_task(isa, tiled, masked, &f, t));
        } else {
            tasks
                .into_par_iter()
                .for_each(|t| fold_task(isa, tiled, masked, &f, t));
        }
        Ok(())
    }

    /// Writes the normalised outputs, token-major (`n_q × n_heads × head_dim`), into `out`.
    pub fn finish(self, out: &mut [f32]) -> Result<()> {
        let s = self.shape;
        check_len("attention output values", s.q_values(), out.len())?;
        let (n, nh, hd, group) = (s.n_q, s.n_heads, s.head_dim, s.group());
        let (o, l) = (&*self.o, &*self.l);
        out.par_chunks_mut(nh * hd)
            .with_min_len(16)
            .enumerate()
            .for_each(|(t, orow)| {
                for (h, oh) in orow.chunks_exact_mut(hd).enumerate() {
                    let r = (h / group * n + t) * group + h % group;
                    let inv = 1.0 / l[r];
                    for (y, x) in oh.iter_mut().zip(&o[r * hd..(r + 1) * hd]) {
                        *y = x * inv;
                    }
                }
            });
        Ok(())
    }
}

/// [`attention_with`] with the best instruction set.
pub fn attention(
    shape: AttnShape,
    tile: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
) -> Result<()> {
    attention_with(Isa::detect(), shape, tile, q, k, v, out)
}

/// The whole attention call at once: `k` and `v` hold (at least) the cache rows of positions
/// `0..start + n_q`, folded `tile` keys at a time; the result, token-major, goes to `out`.
pub fn attention_with(
    isa: Isa,
    shape: AttnShape,
    tile: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
) -> Result<()> {
    attention_from(isa, shape, tile, 0, q, k, v, out)
}

/// [`attention_with`] over keys from position `base` on: `k` and `v` hold (at least) the rows of
/// positions `base..start + n_q`, and `base` is at most [`AttnShape::first_tile`] and a multiple
/// of `tile`, so the tiles folded are those [`attention_with`] folds (a sliding-window layer's
/// ring holds no key before its window: its rows are gathered from there).
#[allow(clippy::too_many_arguments)]
pub fn attention_from(
    isa: Isa,
    shape: AttnShape,
    tile: usize,
    base: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let (kvd, keys) = (shape.kv_dim(), shape.start + shape.n_q);
    let first = shape.first_tile(tile);
    if base > first || !base.is_multiple_of(tile.max(1)) {
        return Err(KernelError::Shape {
            op: "attention",
            reason: format!(
                "keys from position {base}: a multiple of the tile {tile} at most the first \
                 tile seen, {first}"
            ),
        });
    }
    let want = (keys - base) * kvd;
    for (what, got) in [
        ("attention key values", k.len()),
        ("attention value values", v.len()),
    ] {
        if got < want {
            return Err(KernelError::LengthMismatch {
                what,
                expected: want,
                got,
            });
        }
    }
    let mut stats = vec![0f32; shape.stats_len()];
    let mut acc = vec![0f32; shape.acc_len()];
    let mut scores = vec![0f32; shape.scores_len(shape.n_q, tile)];
    let mut att = Attention::new(shape, tile, &mut stats, &mut acc)?;
    // with a window, the tiles wholly before the first query's window add nothing: skipped
    let mut k0 = first;
    while k0 < keys {
        let rows = (k0 - base) * kvd..(k0 - base + tile.min(keys - k0)) * kvd;
        let (kt, vt) = (&k[rows.clone()], &v[rows]);
        att.fold_with(isa, q, 0..shape.n_q, k0, kt, vt, &mut scores)?;
        k0 += tile;
    }
    att.finish(out)
}

/// Folds one task with the call's form, the tiled one with the best instruction set for
/// this head size.
fn fold_task(isa: Isa, tiled: bool, masked: bool, f: &Fold<'_>, task: Task<'_>) {
    if !tiled {
        return fold_task_step(isa, f, task);
    }
    if masked {
        return fold_task_scalar(f, task);
    }
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86_ops::imp;
        let fits = f.head_dim <= MAX_SIMD_HEAD_DIM
            && f.head_dim * f.chunk.next_multiple_of(16) <= KT_VALUES;
        if isa.has_avx512() && fits && f.head_dim.is_multiple_of(16) {
            // SAFETY: AVX-512F, AVX2, FMA and F16C detected at run time; fold_with checked the
            // buffers the task's slices and the fold's rows come from, and the head fits.
            return with_key_scratch(|kt| unsafe { imp::fold_task_avx512(f, task, kt) });
        }
        if isa.has_avx2() && fits && f.head_dim.is_multiple_of(8) {
            // SAFETY: AVX2, FMA and F16C detected at run time; sizes as above.
            return with_key_scratch(|kt| unsafe { imp::fold_task_avx2(f, task, kt) });
        }
    }
    let _ = isa;
    fold_task_scalar(f, task);
}

/// Runs `f` with [`KT_VALUES`] values of scratch for a SIMD task's transposed keys, kept per
/// thread (zeroing 32 KiB per task cost as much as a decode step's attention).
#[cfg(target_arch = "x86_64")]
fn with_key_scratch<T>(f: impl FnOnce(&mut [f32]) -> T) -> T {
    thread_local! {
        static KEYS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    KEYS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut kt) => {
            kt.resize(KT_VALUES, 0.0);
            f(&mut kt)
        }
        Err(_) => f(&mut vec![0.0; KT_VALUES]),
    })
}

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;

//! One decoder layer on the host path (the CPU kernels on slices of host memory): the attention
//! block, the MLP block, their norms and RoPE, and the matrix products they and the head are
//! made of.

use std::sync::Arc;

use weightlift_kernels::MatvecMode;
use weightlift_kernels::RopeParams;
use weightlift_kernels::cpu::matvec::{SharedInput, matmul, matmul_shared, matvec};
use weightlift_kernels::types::QuantType;

use super::attention::{self, Shape, Tiles};
use super::family::{Family, Gate};
use super::parts::{Ffn, Layer, Linear, Slot};
use super::weights::Packing;
use super::{Compute, Views, host_bytes};
use crate::cache::Cache;
use crate::error::{EngineError, Result, invalid};
use crate::model::Held;

/// Constants of one forward call.
pub(crate) struct Consts {
    pub hidden: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    pub kv_tile: usize,
    pub q_tile: usize,
    pub eps: f32,
    pub rope: RopeParams,
    pub max_dq: usize,
    pub compute: Compute,
    /// The LLM.int8 outlier threshold.
    pub int8_threshold: f32,
    /// The MLP's gating activation.
    pub gate: Gate,
    /// Multiplier of the attention scores.
    pub attn_scale: f32,
    /// Attention logit soft-cap (0: none).
    pub attn_softcap: f32,
}

impl Consts {
    /// The constants of a call on a model of dimensions `d`, in `compute` mode.
    pub fn new(
        d: &weightlift_plan::Dims,
        (eps, rope, max_dq): (f32, RopeParams, usize),
        (compute, int8_threshold): (Compute, f32),
    ) -> Consts {
        Consts {
            hidden: d.hidden as usize,
            n_heads: d.n_heads as usize,
            head_dim: d.head_dim as usize,
            kv_tile: d.kv_tile as usize,
            q_tile: d.q_tile as usize,
            eps,
            rope,
            max_dq,
            compute,
            int8_threshold,
            gate: Gate::Silu,
            attn_scale: 1.0 / (d.head_dim as f32).sqrt(),
            attn_softcap: 0.0,
        }
    }

    /// These constants with the variants of `f`.
    pub fn with_family(self, f: &Family) -> Consts {
        Consts {
            gate: f.gate,
            attn_scale: f.attn_scale,
            attn_softcap: f.attn_softcap,
            ..self
        }
    }
}

pub(super) fn kernel(what: &str, e: weightlift_kernels::KernelError) -> EngineError {
    EngineError::Device {
        device: "cpu".into(),
        detail: format!("{what}: {e}"),
    }
}

/// Where a layer's matrices are read: the model's tensors, or its group's onload slot.
pub(super) struct Weights<'a> {
    pub held: &'a [Held],
    pub copies: &'a [(usize, Held)],
    pub slot: Option<&'a [u8]>,
}

/// One sequence's tokens in a forward chunk: its cache, the position of its first token, and
/// how many tokens it has. A chunk's pieces take consecutive rows of the workspace, in order.
#[derive(Clone, Copy)]
pub(crate) struct Piece<'a> {
    pub cache: &'a Arc<Cache>,
    pub pos: usize,
    pub n: usize,
}

/// The tokens of a chunk's pieces.
pub(crate) fn tokens(pieces: &[Piece<'_>]) -> usize {
    pieces.iter().map(|p| p.n).sum()
}

/// One decoder layer on the tokens of `pieces` (each at its own positions, attending to its own
/// cache), in place on `w.x`. Everything but attention is per token or a product, so the
/// pieces share it; attention runs piece by piece.
pub(super) fn run_layer(
    c: &Consts,
    l: &Layer,
    li: usize,
    wts: &Weights<'_>,
    pieces: &[Piece<'_>],
    w: &mut Views<'_>,
) -> Result<()> {
    let (h, hd, nh) = (c.hidden, c.head_dim, c.n_heads);
    let (qd, kvd) = (nh * hd, l.kv_heads * hd);
    let n = tokens(pieces);
    let err = |what: &'static str| move |e| kernel(&format!("layer {li} {what}"), e);
    // attention
    weightlift_kernels::rms_norm(&w.x[..n * h], &l.attn_norm.host, c.eps, &mut w.xn[..n * h])
        .map_err(err("attn_norm"))?;
    linear_pieces_shared(c, wts, [&l.q, &l.k, &l.v], pieces, w.xn, [w.q, w.k, w.v])?;
    if let Some([qn, kn]) = &l.qk_norm {
        head_norm_in_place(&mut w.q[..n * qd], &qn.host, c.eps).map_err(err("q_norm"))?;
        head_norm_in_place(&mut w.k[..n * kvd], &kn.host, c.eps).map_err(err("k_norm"))?;
    }
    let mut slots = w.pos[..n].iter_mut();
    for p in pieces {
        for (t, slot) in slots.by_ref().take(p.n).enumerate() {
            *slot = (p.pos + t) as i32;
        }
    }
    let freqs = match &l.rope {
        Some(f) => &f.host[..c.rope.n_dims / 2],
        None => &w.freqs[..c.rope.n_dims / 2],
    };
    let (q, k) = (&mut w.q[..n * qd], &mut w.k[..n * kvd]);
    weightlift_kernels::rope_qk_in_place(q, k, &w.pos[..n], &c.rope, freqs).map_err(err("rope"))?;
    pieces_attention(c, l, li, pieces, w)?;
    linear_pieces(c, wts, &l.o, pieces, w.q, w.xn)?;
    post_norm(c, l.post_attn_norm.as_ref(), n * h, w).map_err(err("post_attention_norm"))?;
    add_in_place(&mut w.x[..n * h], &w.xn[..n * h]);
    // MLP
    weightlift_kernels::rms_norm(&w.x[..n * h], &l.ffn_norm.host, c.eps, &mut w.xn[..n * h])
        .map_err(err("ffn_norm"))?;
    match &l.ffn {
        Ffn::Dense { gate, up, down } => {
            let i = gate.rows;
            linear_pieces_shared(c, wts, [gate, up], pieces, w.xn, [w.gate, w.up])?;
            activate(c.gate, &mut w.gate[..n * i], &w.up[..n * i])
                .map_err(err("gated activation"))?;
            linear_pieces(c, wts, down, pieces, w.gate, w.xn)?;
        }
        Ffn::Moe(m) => super::experts::moe(c, m, li, wts, pieces, w)?,
    }
    post_norm(c, l.post_ffn_norm.as_ref(), n * h, w).map_err(err("post_ffw_norm"))?;
    add_in_place(&mut w.x[..n * h], &w.xn[..n * h]);
    Ok(())
}

/// Each piece's attention over its own cache, its output in place of its rotated queries in
/// `w.q`: the new keys and values stored first, then the attention, piece by piece. A batch
/// of pieces whose keys all fit half a key tile (decode steps of short sequences: each a
/// single tile, and a fold too small to split across threads) runs as two halves side by
/// side, each with half the tile scratch; one tile either way, so every piece gets the bits
/// it gets alone.
fn pieces_attention(
    c: &Consts,
    l: &Layer,
    li: usize,
    pieces: &[Piece<'_>],
    w: &mut Views<'_>,
) -> Result<()> {
    let (qd, kvd) = (c.n_heads * c.head_dim, l.kv_heads * c.head_dim);
    // a ring must still hold what the chunk's queries read once its keys are in
    for p in pieces {
        p.cache
            .check_attend(li, l.window, p.pos as u64, p.n as u64)?;
    }
    // each piece's new keys and values, its queries (replaced by its output), accumulators
    // and running softmax
    let (mut k, mut v) = (&w.k[..], &w.v[..]);
    let (mut q, mut acc, mut stats) = (&mut *w.q, &mut *w.att, &mut *w.stats);
    let mut own = Vec::with_capacity(pieces.len());
    for p in pieces {
        let ((pk, rk), (pv, rv)) = (k.split_at(p.n * kvd), v.split_at(p.n * kvd));
        let (pq, rq) = std::mem::take(&mut q).split_at_mut(p.n * qd);
        let (pa, ra) = std::mem::take(&mut acc).split_at_mut(p.n * qd);
        let (ps, rs) = std::mem::take(&mut stats).split_at_mut(2 * p.n * c.n_heads);
        (k, v, q, acc, stats) = (rk, rv, rq, ra, rs);
        own.push(PieceRows {
            piece: *p,
            kv: [pk, pv],
            q: pq,
            acc: pa,
            stats: ps,
        });
    }
    let half = c.kv_tile / 2;
    let side_by_side = pieces.len() > 1
        && rayon::current_num_threads() > 1
        && half > 0
        && pieces.iter().all(|p| {
            p.pos + p.n <= half
                && p.n * c.n_heads * half <= w.scores.len() / 2
                && !p.cache.is_offloaded()
        });
    if !side_by_side {
        for rows in own {
            let scratch = [&mut *w.kt, &mut *w.vt, &mut *w.scores];
            piece_attention(c, l, li, rows, scratch, c.kv_tile)?;
        }
        return Ok(());
    }
    // the two halves of the pieces, by keys
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let (mut ka, mut kb) = (0, 0);
    for piece in own {
        let keys = piece.piece.pos + piece.piece.n;
        if ka <= kb {
            ka += keys;
            a.push(piece);
        } else {
            kb += keys;
            b.push(piece);
        }
    }
    let (kt_a, kt_b) = w.kt.split_at_mut(half * kvd);
    let (vt_a, vt_b) = w.vt.split_at_mut(half * kvd);
    let (sc_a, sc_b) = w.scores.split_at_mut(w.scores.len() / 2);
    let run = |side: Vec<PieceRows<'_, '_>>, [kt, vt, scores]: [&mut [f32]; 3]| -> Result<()> {
        for rows in side {
            piece_attention(c, l, li, rows, [&mut *kt, &mut *vt, &mut *scores], half)?;
        }
        Ok(())
    };
    let (ra, rb) = rayon::join(|| run(a, [kt_a, vt_a, sc_a]), || run(b, [kt_b, vt_b, sc_b]));
    ra.and(rb)
}

/// One piece's rows of the workspace in [`pieces_attention`].
struct PieceRows<'p, 'w> {
    piece: Piece<'p>,
    /// Its new keys and values, to store.
    kv: [&'w [f32]; 2],
    /// Its rotated queries, replaced by its attention output.
    q: &'w mut [f32],
    acc: &'w mut [f32],
    stats: &'w mut [f32],
}

/// One piece's attention: its new keys and values stored, then its stored keys read
/// `kv_tile` rows at a time into the tile scratch `[kt, vt, scores]`.
fn piece_attention(
    c: &Consts,
    l: &Layer,
    li: usize,
    rows: PieceRows<'_, '_>,
    [kt, vt, scores]: [&mut [f32]; 3],
    kv_tile: usize,
) -> Result<()> {
    let p = rows.piece;
    let [k, v] = rows.kv;
    p.cache.write_rows(li, p.pos as u64, k, v)?;
    let resident = if p.cache.is_offloaded() {
        Some(p.cache.fetch(li)?)
    } else {
        None
    };
    let shape = Shape {
        n_heads: c.n_heads,
        kv_heads: l.kv_heads,
        head_dim: c.head_dim,
        kv_tile,
        q_tile: c.q_tile,
        f16_operands: c.compute.f16_operands(p.cache.config().dtype),
        scale: c.attn_scale,
        window: l.window,
        softcap: c.attn_softcap,
    };
    let tiles = Tiles {
        kt,
        vt,
        scores,
        stats: rows.stats,
        acc: rows.acc,
    };
    // The rotated queries are read from `q`; the attention output replaces them there.
    attention::attend(shape, p.cache, li, resident.as_ref(), p.pos, rows.q, tiles)
}

/// `gate = act(gate) · up`, the family's gated activation.
pub(super) fn activate(act: Gate, gate: &mut [f32], up: &[f32]) -> weightlift_kernels::Result<()> {
    match act {
        Gate::Silu => swiglu_in_place(gate, up),
        Gate::GeluTanh => weightlift_kernels::geglu_tanh_in_place(gate, up),
    }
}

/// Whether a product of `l` with several tokens gives each token the bits of its own
/// matrix-vector product, up to `Q8_BATCH_MAX_TOKENS` tokens: the fast mode's block products.
pub(super) fn shares_rows(c: &Consts, wts: &Weights<'_>, l: &Linear) -> Result<bool> {
    Ok(q8_weights(c, wts, l)?.is_some())
}

/// The block type and bytes of `l` where its product is a fast-mode block product (see
/// [`linear_pieces`]).
pub(super) fn q8_weights<'a>(
    c: &Consts,
    wts: &Weights<'a>,
    l: &Linear,
) -> Result<Option<(QuantType, &'a [u8])>> {
    if l.packed.is_some() {
        return Ok(None);
    }
    Ok(match weight_of(wts.held, wts.copies, l, wts.slot)? {
        (w, Packing::Blocks(ty)) if c.compute.mode(ty) == MatvecMode::Q8 => Some((ty, w)),
        _ => None,
    })
}

/// [`linear_pieces`] of linears that multiply the same input `x` (a layer's query, key and
/// value; its gate and up), into `ys`. The fast-mode block products among them run grouped by
/// block type, each product run of a group's linears together ([`matmul_shared`]: the tokens
/// quantised once, one parallel loop over all their rows; Q4_K_M keeps some values in Q6_K, so
/// its query and key still pair up); the others run one after the other. Every row has the
/// bits [`linear_pieces`] gives it.
pub(super) fn linear_pieces_shared<const N: usize>(
    c: &Consts,
    wts: &Weights<'_>,
    ls: [&Linear; N],
    pieces: &[Piece<'_>],
    x: &[f32],
    ys: [&mut [f32]; N],
) -> Result<()> {
    let mut weights = [None; N];
    for (w, l) in weights.iter_mut().zip(ls) {
        *w = q8_weights(c, wts, l)?.filter(|_| l.cols == ls[0].cols);
    }
    let mut ys = ys.map(Some);
    for (i, y) in ys.iter_mut().enumerate() {
        if weights[i].is_none() {
            let y = y.take().expect("linear_pieces_shared: each output once");
            linear_pieces(c, wts, ls[i], pieces, x, y)?;
        }
    }
    // each type's linears together, from the first linear of the type on
    for i in 0..N {
        let Some((ty, _)) = weights[i] else { continue };
        let mut parts: Vec<(&Linear, &[u8], &mut [f32])> = (i..N)
            .filter_map(|j| match weights[j] {
                Some((t, w)) if t == ty => Some((ls[j], w, ys[j].take()?)),
                _ => None,
            })
            .collect();
        if !parts.is_empty() {
            shared_products(c, ty, &mut parts, pieces, x)?;
        }
    }
    Ok(())
}

/// The products of `parts` (each a linear, its weights and its output), fast-mode block
/// products of `ty` on the same input, run by run of pieces together (see
/// [`linear_pieces_shared`]), biases added.
fn shared_products(
    c: &Consts,
    ty: QuantType,
    parts: &mut [(&Linear, &[u8], &mut [f32])],
    pieces: &[Piece<'_>],
    x: &[f32],
) -> Result<()> {
    let cols = parts[0].0.cols;
    let lens: Vec<usize> = pieces.iter().map(|p| p.n).collect();
    for (start, n) in product_runs(&lens, true) {
        let mut run: Vec<SharedInput<'_>> = parts
            .iter_mut()
            .map(|(l, w, y)| SharedInput {
                w,
                rows: l.rows,
                y: &mut y[start * l.rows..(start + n) * l.rows],
            })
            .collect();
        let xs = &x[start * cols..(start + n) * cols];
        matmul_shared(c.compute.mode(ty), ty, &mut run, cols, xs, n, c.max_dq).map_err(|e| {
            let names: Vec<&str> = parts.iter().map(|(l, ..)| l.name.as_str()).collect();
            kernel(&names.join(", "), e)
        })?;
    }
    let n = tokens(pieces);
    for (l, _, y) in parts.iter_mut() {
        add_bias(l, &mut y[..n * l.rows]);
    }
    Ok(())
}

/// `y = W x` for the tokens of `pieces`, each token's row the bits it gets when its sequence
/// runs alone. A fast-mode block product of at most
/// [`Q8_BATCH_MAX_TOKENS`](weightlift_kernels::cpu::matvec::Q8_BATCH_MAX_TOKENS) tokens gives
/// every token its own matrix–vector bits (each weight block decoded once for all of them), so
/// the pieces of that many tokens or fewer share products of up to that many tokens; a longer
/// piece (a prompt, which alone takes the register tiles) runs alone. Exact mode, LLM.int8
/// weights (their outlier columns are chosen over every token of the product), packed
/// GPTQ/EXL2 linears and the types the fast mode multiplies exactly keep one product per
/// piece: their one-token and several-token kernels sum in different orders.
pub(super) fn linear_pieces(
    c: &Consts,
    wts: &Weights<'_>,
    l: &Linear,
    pieces: &[Piece<'_>],
    x: &[f32],
    y: &mut [f32],
) -> Result<()> {
    if let [p] = pieces {
        return linear_on(c, wts, l, x, p.n, y);
    }
    let q8 = shares_rows(c, wts, l)?;
    let lens: Vec<usize> = pieces.iter().map(|p| p.n).collect();
    for (start, n) in product_runs(&lens, q8) {
        let (xs, ys) = (&x[start * l.cols..], &mut y[start * l.rows..]);
        linear_on(c, wts, l, xs, n, ys)?;
    }
    Ok(())
}

/// The products a linear of a batch takes over pieces of `lens` tokens (consecutive rows), as
/// `(first row, rows)`: where the product `shares` rows (a fast-mode block product, which gives
/// each token its own matrix-vector bits up to
/// [`Q8_BATCH_MAX_TOKENS`](weightlift_kernels::cpu::matvec::Q8_BATCH_MAX_TOKENS) tokens),
/// consecutive pieces of that many tokens or fewer in all share one; else one product a piece.
pub(super) fn product_runs(lens: &[usize], shares: bool) -> Vec<(usize, usize)> {
    use weightlift_kernels::cpu::matvec::Q8_BATCH_MAX_TOKENS as SHARED;
    let mut runs: Vec<(usize, usize)> = Vec::with_capacity(lens.len());
    let mut at = 0;
    for &len in lens {
        match runs.last_mut() {
            Some((_, n)) if shares && *n + len <= SHARED => *n += len,
            _ => runs.push((at, len)),
        }
        at += len;
    }
    runs
}

/// `xn = RMSNorm(xn) · norm` over `len` values, through the gate region, when the block has a
/// post-norm.
fn post_norm(
    c: &Consts,
    norm: Option<&super::parts::Floats>,
    len: usize,
    w: &mut Views<'_>,
) -> weightlift_kernels::Result<()> {
    if let Some(f) = norm {
        let tmp = &mut w.gate[..len];
        weightlift_kernels::rms_norm(&w.xn[..len], &f.host, c.eps, tmp)?;
        w.xn[..len].copy_from_slice(tmp);
    }
    Ok(())
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// Stack-sized pieces a task of [`head_norm_in_place`] takes at least: a decode step's few rows run on the calling thread, where handing them to another
/// thread would cost more than the work.
const PIECES_PER_TASK: usize = 16;

/// Each `weight.len()`-long head vector of `x` RMS-normed by `weight`, in place, through the
/// kernel in stack-sized pieces of whole heads (the backend path norms into a second buffer
/// with the same kernel, so both give the same bits).
pub(super) fn head_norm_in_place(
    x: &mut [f32],
    weight: &[f32],
    eps: f32,
) -> weightlift_kernels::Result<()> {
    use rayon::prelude::*;
    const PIECE: usize = 1024;
    let hd = weight.len().max(1);
    if hd > PIECE {
        let mut tmp = vec![0f32; x.len()];
        weightlift_kernels::rms_norm(x, weight, eps, &mut tmp)?;
        x.copy_from_slice(&tmp);
        return Ok(());
    }
    x.par_chunks_mut(PIECE / hd * hd)
        .with_min_len(PIECES_PER_TASK)
        .try_for_each(|heads| {
            let mut tmp = [0f32; PIECE];
            let t = &mut tmp[..heads.len()];
            weightlift_kernels::rms_norm(heads, weight, eps, t)?;
            heads.copy_from_slice(t);
            Ok(())
        })
}

/// Pieces a task of [`swiglu_in_place`] takes at least: a batched decode step's rows (eight
/// sequences' 1,536 values each, about 5 µs of work) split over two threads in 3.5 µs, where
/// one sequence's stay on the calling thread.
const SWIGLU_PIECES_PER_TASK: usize = 4;

/// `gate = silu(gate) * up`, through the kernel in stack-sized pieces.
pub(super) fn swiglu_in_place(gate: &mut [f32], up: &[f32]) -> weightlift_kernels::Result<()> {
    use rayon::prelude::*;
    const PIECE: usize = 1024;
    gate.par_chunks_mut(PIECE)
        .zip(up.par_chunks(PIECE))
        .with_min_len(SWIGLU_PIECES_PER_TASK)
        .try_for_each(|(g, u)| {
            let mut tmp = [0f32; PIECE];
            let t = &mut tmp[..g.len()];
            weightlift_kernels::swiglu(g, u, t)?;
            g.copy_from_slice(t);
            Ok(())
        })
}

pub(super) fn linear_on(
    c: &Consts,
    wts: &Weights<'_>,
    l: &Linear,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<()> {
    let (x, y) = (&x[..n * l.cols], &mut y[..n * l.rows]);
    match &l.packed {
        Some(p) => {
            let parts = p.parts(wts.held, wts.slot.zip(l.onload_at), &l.name)?;
            p.product(parts, &l.name, l.rows, l.cols, x, n, y, c.max_dq)?;
        }
        None => {
            let (w, packing) = weight_of(wts.held, wts.copies, l, wts.slot)?;
            return product(c, packing, w, l, x, n, y);
        }
    }
    add_bias(l, y);
    Ok(())
}

/// A matrix's bytes and packing: where the model holds it, or in `slot` (its group's onload slot)
/// when the layer is offloaded.
pub(crate) fn weight_of<'a>(
    held: &'a [Held],
    copies: &'a [(usize, Held)],
    l: &Linear,
    slot: Option<&'a [u8]>,
) -> Result<(&'a [u8], Packing)> {
    let h = match l.slot {
        Slot::Tensor(i) => &held[i],
        Slot::Copy(c) => &copies[c].1,
    };
    let (bytes, dtype) = match (h, l.part) {
        // a device's part of a split tensor (tensor parallelism), in host memory
        (Held::Split { parts, .. }, Some(p)) => {
            let t = parts.get(p).ok_or_else(|| {
                invalid(
                    format!("parts of '{}'", l.name),
                    format!("a part {p}"),
                    parts.len(),
                )
            })?;
            let bytes = t.host_bytes().ok_or_else(|| EngineError::Device {
                device: t.device().name().to_owned(),
                detail: format!(
                    "part {p} of '{}' is not in host memory, and the host forward pass reads \
                     it there",
                    l.name
                ),
            })?;
            (bytes, t.dtype())
        }
        _ => host_bytes(h, &l.name)?,
    };
    let packing = Packing::of(&l.name, dtype)?;
    // its rows of the held tensor; an onload slot holds just those, from `onload_at`
    let (from, len) = l.byte_range(bytes.len());
    let (s, at) = match (slot, l.onload_at) {
        (Some(s), Some(at)) => (s, at),
        _ => (bytes, from),
    };
    let b = s.get(at..at + len).ok_or_else(|| {
        invalid(
            format!("rows of '{}'", l.name),
            format!("{len} bytes from offset {at}"),
            format!("{} bytes", s.len()),
        )
    })?;
    Ok((b, packing))
}

/// `y = W x (+ bias)` for `n` tokens: a matrix–vector product for one token, else a matrix
/// product that reuses each decoded weight across the tokens.
fn product(
    c: &Consts,
    packing: Packing,
    w: &[u8],
    l: &Linear,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<()> {
    let r = match packing {
        Packing::Int8 => weightlift_kernels::cpu::int8::int8_matmul_packed(
            w,
            l.rows,
            l.cols,
            x,
            n,
            c.int8_threshold,
            y,
        ),
        Packing::Blocks(ty) if n == 1 => matvec(c.compute.mode(ty), ty, w, l.rows, l.cols, x, y),
        Packing::Blocks(ty) => {
            let mode = c.compute.mode(ty);
            matmul(mode, ty, w, l.rows, l.cols, x, n, y, c.max_dq)
        }
    };
    r.map_err(|e| kernel(&l.name, e))?;
    add_bias(l, y);
    Ok(())
}

/// `y += bias`, per token.
pub(super) fn add_bias(l: &Linear, y: &mut [f32]) {
    if let Some(b) = &l.bias {
        for yr in y.chunks_exact_mut(l.rows) {
            yr.iter_mut().zip(&b.host).for_each(|(v, b)| *v += b);
        }
    }
}

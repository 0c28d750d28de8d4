//! The tensor-parallel forward pass, as exllamav2's TP attention and MLP modules split the
//! work, over a [`TpContext`] built at load from the plan's tables. This file is the host path
//! (`cpu` and `virtual:N` devices, on slices of host memory); `exec.rs` runs the same split
//! through the kernels' backends (`cuda:N`, or host devices with the host backend on):
//!
//! - The residual stream follows the RS table: each device holds its columns of it.
//! - Before attention and before the MLP, the residual is all-gathered (through a staging
//!   buffer, 0 and 1 in turn) to every device of the KV (or ID) table, which normalises it with
//!   its replica of the norm.
//! - Attention is split by heads: each device projects its Q heads and its KV heads (with
//!   their bias rows), rotates them, writes its KV heads into its own part of the cache (on
//!   that device), attends, and multiplies by its columns of `o_proj`: a partial sum of the
//!   whole hidden width. The MLP likewise: its rows of gate and up (the ID table), its columns
//!   of down.
//! - The partial sums are reduced into the residual: each RS device receives its columns of
//!   every other device's partial (one copy per pair) and adds them; an `o_proj`/`down` bias
//!   is added once, by the owner of each column.
//! - A mixture-of-experts block (mixtral, qwen3moe) is split by experts instead (expert
//!   parallelism, the expert table): every device of that table normalises the gathered rows
//!   and scores them with its replica of the router, so each routes every token alike, then
//!   runs only the routed experts it holds, whole, with the layer split's own code
//!   ([`super::experts::experts`], or the backends' op sequence), their weighted outputs its
//!   partial sum, reduced as the dense MLP's. A device may thus get more of a chunk's tokens
//!   than another; every part it holds is a contiguous slice (GGUF's stacked experts cut along
//!   their first axis).
//! - Where a block's output is normed before it joins the residual (gemma's post-norms), its
//!   partial sums are reduced apart from the residual, gathered as whole rows to the residual's
//!   owners, normed there, and each owner adds its columns of the normed rows.
//! - The head: the needed rows are all-gathered to the VC devices, each computes its vocab
//!   rows, and the logits are gathered into the caller's array. Hidden states instead of logits
//!   ([`Output::Hidden`]): the rows are gathered to the first VC device only, which applies its
//!   replica of the output norm and hands the normed rows back.
//!
//! Every device runs the same kernels as the single-device pass; only the order in which the
//! partial sums of `o_proj` and `down` are added differs, so logits agree with a `cpu` run to
//! f32 reduction-order error. Between two collectives the devices' shares run at once on the
//! model's thread pool (each has its own weights, workspace and cache part, and the kernels'
//! bits do not depend on the threads), as the GPUs of a TP group would.

use std::sync::Arc;

use rayon::prelude::*;

use weightlift_format::{ModelSpec, Role, TensorInfo, is_quantized_part};
use weightlift_kernels::MatvecMode;
use weightlift_kernels::cpu::matvec::{Q8_BATCH_MAX_TOKENS, matmul, matvec};
use weightlift_kernels::{QuantType, RopeParams};
use weightlift_plan::{Dims, RuntimeSpec, TpShare, TpWorkspace};

use super::attention::{self, Shape, Tiles};
use super::family::Family;
use super::graph::Loaded;
use super::layer::{Consts, Weights, activate, head_norm_in_place, kernel, product_runs};
use super::parts::{Floats, Linear, Moe, Slot};
use super::rope::rope_of;
use super::weights::Packing;
use super::{Compute, Copies, Logits, Output, Views, carve, check_tokens, chunk_for};
use crate::cache::{Cache, TpPart};
use crate::device::DeviceKind;
use crate::error::{EngineError, Result, invalid};
use crate::model::Held;
use crate::tp::{Collectives, SplitTable, Splits, TpContext};

mod build;
mod exec;

pub(crate) use build::run;

/// A device's slice of one matrix: its part of a split tensor (or of the tied head's copy).
#[derive(Debug)]
struct Mat {
    name: String,
    /// The held tensor, or (`copy`) the model's extra copy.
    index: usize,
    copy: bool,
    part: usize,
    rows: usize,
    cols: usize,
    ty: QuantType,
    /// This device's bias rows.
    bias: Option<Vec<f32>>,
}

#[derive(Debug)]
struct Attn {
    norm: Vec<f32>,
    q: Mat,
    k: Mat,
    v: Mat,
    o: Mat,
    /// Replicas of the per-head q/k RMSNorm weights (qwen3): heads are split whole, so each
    /// device norms its own heads with the same weights.
    qk_norm: Option<[Vec<f32>; 2]>,
    q_heads: usize,
    kv_heads: usize,
    /// Index of this device's part of the cache.
    cache_part: usize,
    /// The layer's sliding window (0: full attention).
    window: usize,
    /// The layer's own RoPE angles (gemma3's local and global bases), else the model's.
    rope: Option<Vec<f32>>,
}

#[derive(Debug)]
struct Mlp {
    norm: Vec<f32>,
    gate: Mat,
    up: Mat,
    down: Mat,
}

/// A device's share of a mixture-of-experts block: replicas of the MLP norm (on a GPU, a copy
/// made there) and of the router, and its range of the expert table, whole experts as the
/// layer split's [`Moe`] reads them (its parts of the split expert tensors).
#[derive(Debug)]
struct Experts {
    norm: Floats,
    moe: Moe,
}

/// One layer: per device (by table index) its attention and MLP (or experts) shares, the
/// biases of `o_proj` and `down` (whole, added once by the residual's owners), and the norms of
/// the attention and MLP outputs where the family has them (gemma's post-norms, whole: each
/// residual owner norms whole rows of the reduced output).
#[derive(Debug)]
struct Layer {
    attn: Vec<Option<Attn>>,
    mlp: Vec<Option<Mlp>>,
    /// A mixture-of-experts layer's shares, by the expert table (shared with the backends'
    /// graph); all `None` in a dense layer.
    experts: Vec<Option<Arc<Experts>>>,
    o_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
    post_norms: [Option<Vec<f32>>; 2],
}

#[derive(Debug)]
struct Head {
    norm: Vec<f32>,
    mat: Mat,
}

/// The tensor-parallel graph of a loaded model.
#[derive(Debug)]
pub(crate) struct TpGraph {
    splits: Splits,
    layers: Vec<Layer>,
    heads: Vec<Option<Head>>,
    /// The embedding (whole, in host memory) and its row type.
    embed: usize,
    embed_ty: QuantType,
    /// Per device: its workspace layout.
    layouts: Vec<TpWorkspace>,
    dims: Dims,
    eps: f32,
    rope: RopeParams,
    inv_freqs: Vec<f32>,
    max_dq: usize,
    /// The family's variants (gemma's scales, soft-caps, activation), as the layer split
    /// reads them.
    family: Family,
    /// The devices' backends and what they read, where the pass runs through them (`cuda:N`
    /// devices, or host devices with the host backend on); `None`: the host path.
    backend: Option<exec::BackendGraph>,
}

/// One device's workspace for a forward call.
struct Work<'a> {
    v: Views<'a>,
    residual: &'a mut [f32],
    recv: &'a mut [f32],
    sum: &'a mut [f32],
}

fn carve_tp<'a>(bytes: &'a mut [u8], w: &TpWorkspace) -> Result<Work<'a>> {
    if (bytes.len() as u64) < w.bytes {
        return Err(invalid(
            "tp forward workspace",
            format!("{} bytes of scratch", w.bytes),
            format!(
                "{} bytes reserved; the model was loaded for another runtime or cache",
                bytes.len()
            ),
        ));
    }
    let (base, tail) = bytes.split_at_mut(w.base.bytes as usize);
    let tail: &mut [f32] =
        bytemuck::try_cast_slice_mut(&mut tail[..(w.bytes - w.base.bytes) as usize])
            .map_err(|e| invalid("tp forward workspace alignment", "4-byte aligned", e))?;
    let at = |r: weightlift_plan::Region| ((r.offset - w.base.bytes) / 4) as usize;
    let (head, rest) = tail.split_at_mut(at(w.recv));
    let (rest, sum) = rest.split_at_mut(at(w.sum) - at(w.recv));
    let residual = &mut head[at(w.residual)..at(w.residual) + w.residual.len as usize];
    Ok(Work {
        v: carve(base, &w.base)?,
        residual,
        recv: &mut rest[..w.recv.len as usize],
        sum: &mut sum[..w.sum.len as usize],
    })
}

impl TpGraph {
    /// Every device's host workspace in `scratch`, laid out as the plan sized it, with the RoPE
    /// frequencies copied in; None for a device whose layout holds nothing.
    fn host_works<'a>(
        &self,
        scratch: crate::tp::ScratchViews<'a>,
    ) -> Result<Vec<Option<Work<'a>>>> {
        let mut ws = Vec::with_capacity(scratch.len());
        for (d, bytes) in scratch.into_iter().enumerate() {
            let layout = self.layouts.get(d).copied().unwrap_or_default();
            ws.push(match bytes {
                Some(b) if layout.bytes > 0 => {
                    let w = carve_tp(b, &layout)?;
                    let len = self.inv_freqs.len().min(w.v.freqs.len());
                    w.v.freqs[..len].copy_from_slice(&self.inv_freqs[..len]);
                    Some(w)
                }
                _ => None,
            });
        }
        Ok(ws)
    }
}

impl Layer {
    /// A mixture-of-experts layer: its MLP is its experts.
    fn is_moe(&self) -> bool {
        self.experts.iter().any(Option::is_some)
    }

    /// The table its MLP follows: the expert table for a mixture-of-experts layer, else the
    /// intermediate one.
    fn mlp_table<'s>(&self, s: &'s Splits) -> &'s SplitTable {
        if self.is_moe() { &s.ex } else { &s.id }
    }
}

/// Constants of one forward call.
struct Run<'a> {
    held: &'a [Held],
    copies: &'a [(usize, Held)],
    compute: Compute,
    max_dq: usize,
    hidden: usize,
    head_dim: usize,
    eps: f32,
    rope: &'a RopeParams,
    kv_tile: usize,
    q_tile: usize,
    /// The layer split's constants, for the experts its code runs.
    consts: Consts,
    family: &'a Family,
}

impl Run<'_> {
    fn bytes(&self, m: &Mat) -> Result<&[u8]> {
        let held = if m.copy {
            self.copies.get(m.index).map(|c| &c.1)
        } else {
            self.held.get(m.index)
        };
        let part = match held {
            Some(Held::Split { parts, .. }) => parts.get(m.part),
            _ => None,
        };
        part.and_then(|t| t.host_bytes()).ok_or_else(|| EngineError::Device {
            device: "cpu".into(),
            detail: format!(
                "part {} of '{}' is not in host memory, and the host forward pass reads it there",
                m.part, m.name
            ),
        })
    }

    /// `y = W x (+ bias)` for `n` tokens.
    fn product(&self, m: &Mat, x: &[f32], n: usize, y: &mut [f32]) -> Result<()> {
        let w = self.bytes(m)?;
        let (x, y) = (&x[..n * m.cols], &mut y[..n * m.rows]);
        let mode = self.compute.mode(m.ty);
        let r = if n == 1 {
            matvec(mode, m.ty, w, m.rows, m.cols, x, y)
        } else {
            matmul(mode, m.ty, w, m.rows, m.cols, x, n, y, self.max_dq)
        };
        r.map_err(|e| kernel(&m.name, e))?;
        if let Some(b) = &m.bias {
            for yr in y.chunks_exact_mut(m.rows) {
                yr.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
        Ok(())
    }

    /// `y = W x (+ bias)` for the tokens of `segs` (consecutive rows), each token's row the
    /// bits it gets when its sequence runs alone: the segments share products as the host
    /// path's batch does (`layer::product_runs`), fast-mode block products up to 16 tokens.
    fn products(&self, m: &Mat, x: &[f32], segs: &[Seg<'_>], y: &mut [f32]) -> Result<()> {
        if let [s] = segs {
            return self.product(m, x, s.n, y);
        }
        let lens: Vec<usize> = segs.iter().map(|s| s.n).collect();
        let shares = self.compute.mode(m.ty) == MatvecMode::Q8;
        for (first, n) in product_runs(&lens, shares) {
            self.product(m, &x[first * m.cols..], n, &mut y[first * m.rows..])?;
        }
        Ok(())
    }

    /// This device's heads of one attention layer on the tokens of `segs`, each segment's at
    /// its positions on its own cache part: the partial sum of `o_proj` lands in `w.xn`.
    fn attention(&self, a: &Attn, li: usize, segs: &[Seg<'_>], w: &mut Views<'_>) -> Result<()> {
        let (h, hd) = (self.hidden, self.head_dim);
        let (qd, kvd) = (a.q_heads * hd, a.kv_heads * hd);
        let n = segs.iter().map(|s| s.n).sum::<usize>();
        let err = |what: &'static str| move |e| kernel(&format!("layer {li} {what}"), e);
        weightlift_kernels::rms_norm(&w.x[..n * h], &a.norm, self.eps, &mut w.xn[..n * h])
            .map_err(err("attn_norm"))?;
        self.products(&a.q, w.xn, segs, w.q)?;
        self.products(&a.k, w.xn, segs, w.k)?;
        self.products(&a.v, w.xn, segs, w.v)?;
        if let Some([qn, kn]) = &a.qk_norm {
            head_norm_in_place(&mut w.q[..n * qd], qn, self.eps).map_err(err("q_norm"))?;
            head_norm_in_place(&mut w.k[..n * kvd], kn, self.eps).map_err(err("k_norm"))?;
        }
        let mut slots = w.pos[..n].iter_mut();
        for s in segs {
            for (t, p) in slots.by_ref().take(s.n).enumerate() {
                *p = (s.pos + t) as i32;
            }
        }
        let freqs = &a.rope.as_deref().unwrap_or(w.freqs)[..self.rope.n_dims / 2];
        let (q, k) = (&mut w.q[..n * qd], &mut w.k[..n * kvd]);
        weightlift_kernels::rope_qk_in_place(q, k, &w.pos[..n], self.rope, freqs)
            .map_err(err("rope"))?;
        let mut at = 0;
        for s in segs {
            let rows = at..at + s.n;
            at += s.n;
            let cache = &s.parts[a.cache_part].cache;
            let kv = rows.start * kvd..rows.end * kvd;
            cache.check_attend(li, a.window, s.pos as u64, s.n as u64)?;
            cache.write_rows(li, s.pos as u64, &w.k[kv.clone()], &w.v[kv])?;
            let shape = Shape {
                n_heads: a.q_heads,
                kv_heads: a.kv_heads,
                head_dim: hd,
                kv_tile: self.kv_tile,
                q_tile: self.q_tile,
                f16_operands: self.compute.f16_operands(cache.config().dtype),
                scale: self.family.attn_scale,
                window: a.window,
                softcap: self.family.attn_softcap,
            };
            let tiles = Tiles {
                kt: &mut *w.kt,
                vt: &mut *w.vt,
                scores: &mut *w.scores,
                stats: &mut *w.stats,
                acc: &mut *w.att,
            };
            let q = &mut w.q[rows.start * qd..rows.end * qd];
            attention::attend(shape, cache, li, None, s.pos, q, tiles)?;
        }
        self.products(&a.o, w.q, segs, w.xn)
    }

    /// This device's columns of one MLP on the tokens of `segs`: the partial sum of `down`
    /// lands in `w.xn`.
    fn mlp(&self, m: &Mlp, li: usize, segs: &[Seg<'_>], w: &mut Views<'_>) -> Result<()> {
        let h = self.hidden;
        let n = segs.iter().map(|s| s.n).sum::<usize>();
        weightlift_kernels::rms_norm(&w.x[..n * h], &m.norm, self.eps, &mut w.xn[..n * h])
            .map_err(|e| kernel(&format!("layer {li} ffn_norm"), e))?;
        let i = m.gate.rows;
        self.products(&m.gate, w.xn, segs, w.gate)?;
        self.products(&m.up, w.xn, segs, w.up)?;
        activate(self.family.gate, &mut w.gate[..n * i], &w.up[..n * i])
            .map_err(|e| kernel(&format!("layer {li} gated activation"), e))?;
        self.products(&m.down, w.gate, segs, w.xn)
    }
}

impl Run<'_> {
    /// This device's experts of one mixture-of-experts block on the tokens of `segs`: the
    /// norm, the router's scores of every token (each segment's products as the layer split
    /// shares them), then the routed experts it holds ([`super::experts::experts`]), their
    /// weighted sum (this device's partial) landing in `w.xn`.
    fn experts(&self, x: &Experts, li: usize, segs: &[Seg<'_>], w: &mut Views<'_>) -> Result<()> {
        let h = self.hidden;
        let lens: Vec<usize> = segs.iter().map(|s| s.n).collect();
        let n = lens.iter().sum::<usize>();
        weightlift_kernels::rms_norm(&w.x[..n * h], &x.norm.host, self.eps, &mut w.xn[..n * h])
            .map_err(|e| kernel(&format!("layer {li} ffn_norm"), e))?;
        let wts = Weights {
            held: self.held,
            copies: self.copies,
            slot: None,
        };
        let (c, router) = (&self.consts, &x.moe.router);
        let mut scores = vec![0f32; n * router.rows];
        let shares = super::layer::shares_rows(c, &wts, router)?;
        for (first, rows) in product_runs(&lens, shares) {
            let xs = &w.xn[first * h..];
            let ys = &mut scores[first * router.rows..];
            super::layer::linear_on(c, &wts, router, xs, rows, ys)?;
        }
        super::experts::experts(c, &x.moe, li, &wts, &lens, &scores, &mut w.xn[..n * h])
    }
}

/// One sequence's tokens in a forward chunk: the parts of its cache (by the KV table's
/// devices), the position of its first token, and how many tokens it has. A chunk's segments
/// take consecutive rows of every workspace, in order.
struct Seg<'a> {
    parts: &'a [TpPart],
    pos: usize,
    n: usize,
}

/// Each device of `table` that has a share of a layer (`per_device`, by device index), with
/// its workspace: the work the devices then do at once.
fn shares<'s, 'a, T>(
    per_device: &'s [Option<T>],
    ws: &'s mut [Option<Work<'a>>],
    table: &SplitTable,
) -> Result<Vec<(&'s T, &'s mut Work<'a>)>> {
    Ok(table
        .iter()
        .zip(pick(ws, table)?)
        .filter_map(|(&(d, _, _), w)| per_device.get(d)?.as_ref().map(|share| (share, w)))
        .collect())
}

/// The entries' workspaces of `table`, mutably, in table order.
fn pick<'s, 'a>(
    ws: &'s mut [Option<Work<'a>>],
    table: &SplitTable,
) -> Result<Vec<&'s mut Work<'a>>> {
    let mut slots: Vec<Option<&'s mut Work<'a>>> = ws.iter_mut().map(Option::as_mut).collect();
    table
        .iter()
        .map(|&(d, _, _)| {
            slots.get_mut(d).and_then(Option::take).ok_or_else(|| {
                invalid(
                    format!("tp device {d}"),
                    "a workspace (scratch reserved by the plan)",
                    "none",
                )
            })
        })
        .collect()
}

/// All-gather rows `first..first + n` of the residual (over the RS table) into `x` of every
/// device of `tb`.
fn gather_residual(
    coll: &mut Collectives<'_>,
    buffer: usize,
    ws: &mut [Option<Work<'_>>],
    rs: &SplitTable,
    tb: &SplitTable,
    rows: (usize, usize, usize),
) -> Result<()> {
    gather_columns(coll, buffer, ws, (rs, tb), rows, false)
}

/// All-gather rows `first..first + n` of the residual owners' columns (over the RS table) into
/// `x` of every device of `tb`: their residual, or (`sums`) the sums [`reduce_sums`] kept
/// apart.
fn gather_columns(
    coll: &mut Collectives<'_>,
    buffer: usize,
    ws: &mut [Option<Work<'_>>],
    (rs, tb): (&SplitTable, &SplitTable),
    (first, n, h): (usize, usize, usize),
    sums: bool,
) -> Result<()> {
    let mut srcs: Vec<Option<&[f32]>> = vec![None; ws.len()];
    let mut dsts: Vec<Option<&mut [f32]>> = (0..ws.len()).map(|_| None).collect();
    let widths: Vec<usize> = rs.iter().map(|&(_, a, b)| (b - a) as usize).collect();
    for (d, w) in ws.iter_mut().enumerate() {
        if let Some(Work {
            v, residual, sum, ..
        }) = w
        {
            let width = rs
                .iter()
                .zip(&widths)
                .find(|(e, _)| e.0 == d)
                .map_or(0, |x| *x.1);
            let from = if sums { &**sum } else { &**residual };
            srcs[d] = from.get(first * width..(first + n) * width);
            dsts[d] = Some(&mut v.x[..]);
        }
    }
    let missing = |d: usize| invalid(format!("tp device {d}"), "a workspace", "none");
    let srcs: Vec<&[f32]> = rs
        .iter()
        .map(|&(d, _, _)| srcs[d].ok_or_else(|| missing(d)))
        .collect::<Result<_>>()?;
    let mut dsts: Vec<&mut [f32]> = tb
        .iter()
        .map(|&(d, _, _)| dsts[d].take().ok_or_else(|| missing(d)))
        .collect::<Result<_>>()?;
    coll.allgather(buffer, n, h, rs, &srcs, tb, &mut dsts)
}

/// Reduce the partial sums in `xn` of the devices of `from` into the residual (RS table), then
/// add `bias` (whole width) once, each owner its columns.
fn reduce_partials(
    coll: &mut Collectives<'_>,
    ws: &mut [Option<Work<'_>>],
    from: &SplitTable,
    rs: &SplitTable,
    (n, h): (usize, usize),
    bias: Option<&[f32]>,
) -> Result<()> {
    reduce_sums(coll, ws, (from, rs), (n, h), bias, false)
}

/// [`reduce_partials`], or kept `apart`: each owner's columns of the sum (and of the bias) stay
/// in its `sum`, for [`post_normed`] to norm before they join the residual, and its `x` (free
/// until the next gather) takes the collective's addition instead of the residual.
fn reduce_sums(
    coll: &mut Collectives<'_>,
    ws: &mut [Option<Work<'_>>],
    (from, rs): (&SplitTable, &SplitTable),
    (n, h): (usize, usize),
    bias: Option<&[f32]>,
    apart: bool,
) -> Result<()> {
    let mut srcs: Vec<Option<&[f32]>> = vec![None; ws.len()];
    type Owned<'r> = (&'r mut [f32], &'r mut [f32], &'r mut [f32]);
    let mut owned: Vec<Option<Owned<'_>>> = (0..ws.len()).map(|_| None).collect();
    for (d, w) in ws.iter_mut().enumerate() {
        if let Some(Work {
            v,
            residual,
            recv,
            sum,
        }) = w
        {
            srcs[d] = Some(&v.xn[..n * h]);
            let into = if apart {
                &mut v.x[..]
            } else {
                &mut residual[..]
            };
            owned[d] = Some((into, &mut recv[..], &mut sum[..]));
        }
    }
    let missing = |d: usize| invalid(format!("tp device {d}"), "a workspace", "none");
    let srcs: Vec<(usize, &[f32])> = from
        .iter()
        .map(|&(d, _, _)| srcs[d].map(|s| (d, s)).ok_or_else(|| missing(d)))
        .collect::<Result<_>>()?;
    let mut residual = Vec::with_capacity(rs.len());
    let mut recv = Vec::with_capacity(rs.len());
    let mut sums = Vec::with_capacity(rs.len());
    for &(d, _, _) in rs {
        let (r, c, s) = owned[d].take().ok_or_else(|| missing(d))?;
        residual.push(r);
        recv.push(c);
        sums.push(s);
    }
    coll.reduce_scatter(n, h, &srcs, rs, &mut residual, &mut recv, &mut sums)?;
    if let Some(b) = bias {
        let to = if apart { &mut sums } else { &mut residual };
        for (res, &(_, a, e)) in to.iter_mut().zip(rs) {
            let cols = &b[a as usize..e as usize];
            for row in res[..n * cols.len()].chunks_exact_mut(cols.len()) {
                row.iter_mut().zip(cols).for_each(|(x, b)| *x += b);
            }
        }
    }
    Ok(())
}

/// The partial sums in `xn` of the devices of `from` into the residual through a norm of the
/// whole block output (gemma's post-attention and post-feed-forward norms), which needs whole
/// rows: the sum is reduced and kept apart ([`reduce_sums`]), all-gathered as whole rows into
/// every residual owner's `x`, normed there with `norm` into `xn`, and each owner adds its
/// columns of the normed rows to its residual.
fn post_normed(
    coll: &mut Collectives<'_>,
    buffer: usize,
    ws: &mut [Option<Work<'_>>],
    (from, rs): (&SplitTable, &SplitTable),
    (n, h): (usize, usize),
    bias: Option<&[f32]>,
    (norm, eps): (&[f32], f32),
) -> Result<()> {
    reduce_sums(coll, ws, (from, rs), (n, h), bias, true)?;
    gather_columns(coll, buffer, ws, (rs, rs), (0, n, h), true)?;
    for (&(_, a, e), w) in rs.iter().zip(pick(ws, rs)?) {
        let (a, width) = (a as usize, (e - a) as usize);
        weightlift_kernels::rms_norm(&w.v.x[..n * h], norm, eps, &mut w.v.xn[..n * h])
            .map_err(|e| kernel("post-norm", e))?;
        for (res, normed) in w.residual[..n * width]
            .chunks_exact_mut(width.max(1))
            .zip(w.v.xn.chunks_exact(h))
        {
            res.iter_mut()
                .zip(&normed[a..a + width])
                .for_each(|(x, y)| *x += y);
        }
    }
    Ok(())
}

impl TpGraph {
    /// Run `ids` through the model tensor-parallel, appending to `cache` (split by kv heads)
    /// at its `seq_len`, and write the `output` asked for into `out`. Returns the copies the
    /// collectives made.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        held: &[Held],
        copies: &[(usize, Held)],
        ctx: &mut TpContext,
        cache: &Arc<Cache>,
        ids: &[u32],
        output: Output,
        (compute, _int8_threshold): (Compute, f32),
        out: &mut Vec<f32>,
    ) -> Result<Copies> {
        let width = output.width(&self.dims);
        let start = check_tokens(ids, self.dims.vocab, cache)? as usize;
        let parts = cache.tp_parts();
        self.check_cache(ctx, &parts)?;
        out.clear();
        out.resize(output.rows(ids.len()) * width, 0.0);
        if ctx.splits() != &self.splits {
            return Err(invalid(
                "tp context tables",
                "the tables the model was loaded with",
                "other tables (the TPContext was changed after the load)",
            ));
        }
        if let Some(bg) = &self.backend {
            return self.forward_backends(
                bg,
                held,
                copies,
                ctx,
                cache,
                (ids, start, output),
                (compute, _int8_threshold),
                out,
            );
        }
        let (mut coll, scratch) = ctx.lend()?;
        let mut ws = self.host_works(scratch)?;
        let run = self.run(held, copies, compute);
        let h = run.hidden;
        let s = &self.splits;
        let chunk = chunk_for(self.dims.tokens, cache);
        let mut done = 0usize;
        let mut buffer = 0usize;
        let mut flip = || {
            buffer ^= 1;
            buffer
        };
        for part in ids.chunks(chunk) {
            let n = part.len();
            let pos = start + done;
            // The embedding rows, looked up on the host into a staging buffer, then scattered
            // to the residual's owners.
            let b = flip();
            self.embed_rows(&run, part, coll.staging(b, n, h)?)?;
            {
                let mut dsts: Vec<&mut [f32]> = pick(&mut ws, &s.rs)?
                    .into_iter()
                    .map(|w| &mut w.residual[..])
                    .collect();
                coll.scatter(b, n, h, &s.rs, &mut dsts)?;
            }
            let segs = [Seg {
                parts: &parts,
                pos,
                n,
            }];
            self.layers_on(&run, &mut coll, &mut flip, &mut ws, &segs)?;
            cache.appended(pos as u64, part)?;
            let Some((first, rows_out)) = output.chunk_rows((done, n, ids.len()), width, out)
            else {
                done += n;
                continue;
            };
            let rows = (first, rows_out.len() / width);
            match output {
                Output::Logits(_) => {
                    let rows = (rows.0, rows.1, self.dims.logit_rows.max(1) as usize);
                    self.head(&run, &mut coll, &mut flip, &mut ws, rows, rows_out)?;
                }
                Output::Hidden => {
                    self.hidden(&run, &mut coll, &mut flip, &mut ws, rows, rows_out)?;
                }
            }
            done += n;
        }
        Ok(coll.copies)
    }

    /// Every layer on the tokens of `segs` (rows `0..n` of the residual, `n` their tokens).
    fn layers_on(
        &self,
        run: &Run<'_>,
        coll: &mut Collectives<'_>,
        flip: &mut dyn FnMut() -> usize,
        ws: &mut [Option<Work<'_>>],
        segs: &[Seg<'_>],
    ) -> Result<()> {
        let (s, h) = (&self.splits, run.hidden);
        let n = segs.iter().map(|s| s.n).sum::<usize>();
        for (li, layer) in self.layers.iter().enumerate() {
            gather_residual(coll, flip(), ws, &s.rs, &s.kv, (0, n, h))?;
            // Each device's heads at once: its weights, workspace and cache parts are its own,
            // and the kernels give the same bits whichever thread runs them.
            shares(&layer.attn, ws, &s.kv)?
                .into_par_iter()
                .try_for_each(|(a, w)| run.attention(a, li, segs, &mut w.v))?;
            let bias = layer.o_bias.as_deref();
            match &layer.post_norms[0] {
                Some(norm) => {
                    let norm = (&norm[..], run.eps);
                    post_normed(coll, flip(), ws, (&s.kv, &s.rs), (n, h), bias, norm)?;
                }
                None => reduce_partials(coll, ws, &s.kv, &s.rs, (n, h), bias)?,
            }
            let table = layer.mlp_table(s);
            gather_residual(coll, flip(), ws, &s.rs, table, (0, n, h))?;
            if layer.is_moe() {
                shares(&layer.experts, ws, table)?
                    .into_par_iter()
                    .try_for_each(|(x, w)| run.experts(x, li, segs, &mut w.v))?;
            } else {
                shares(&layer.mlp, ws, table)?
                    .into_par_iter()
                    .try_for_each(|(m, w)| run.mlp(m, li, segs, &mut w.v))?;
            }
            let bias = layer.down_bias.as_deref();
            match &layer.post_norms[1] {
                Some(norm) => {
                    let norm = (&norm[..], run.eps);
                    post_normed(coll, flip(), ws, (table, &s.rs), (n, h), bias, norm)?;
                }
                None => reduce_partials(coll, ws, table, &s.rs, (n, h), bias)?,
            }
        }
        Ok(())
    }

    /// Whether [`TpGraph::forward_batch`] runs these sequences together: logits of the last
    /// positions, and their tokens within one chunk. On a rank of a multi-process group this is
    /// decided from what every rank given the same sequences has alike (their token counts, the
    /// plan's chunk, the caches' sizes), so the ranks batch together or not at all.
    pub fn batches(&self, seqs: &[(&Arc<Cache>, &[u32])], output: Output) -> bool {
        let tokens = seqs.iter().map(|(_, ids)| ids.len()).sum::<usize>();
        output == Output::Logits(Logits::Last)
            && seqs.len() > 1
            && tokens <= self.dims.tokens as usize
            && seqs
                .iter()
                .all(|(c, ids)| ids.len() <= chunk_for(self.dims.tokens, c))
    }

    /// Several sequences through the model tensor-parallel in one pass (on the host path here,
    /// on the devices' backends in `exec/batch.rs`, on a rank's own device in `exec/rank.rs`,
    /// every rank running the same batch): one product per linear for the tokens of
    /// every sequence on each device (shared as [`Run::products`] keeps each token's bits, or
    /// as `Exec::shared_tokens` does), attention per sequence on its own cache parts, and one
    /// head product for every sequence's last row where they share it. `out` gets each
    /// sequence's logits of its last position, in order: the bits each gets alone. The caller
    /// checks [`TpGraph::batches`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward_batch(
        &self,
        held: &[Held],
        copies: &[(usize, Held)],
        ctx: &mut TpContext,
        seqs: &[(&Arc<Cache>, &[u32])],
        (compute, int8_threshold): (Compute, f32),
        out: &mut Vec<f32>,
    ) -> Result<Copies> {
        let mut parts = Vec::with_capacity(seqs.len());
        let mut starts = Vec::with_capacity(seqs.len());
        for (cache, ids) in seqs {
            starts.push(check_tokens(ids, self.dims.vocab, cache)? as usize);
            let p = cache.tp_parts();
            self.check_cache(ctx, &p)?;
            parts.push(p);
        }
        if ctx.splits() != &self.splits {
            return Err(invalid(
                "tp context tables",
                "the tables the model was loaded with",
                "other tables (the TPContext was changed after the load)",
            ));
        }
        if let Some(bg) = &self.backend {
            let batch: Vec<exec::BatchSeq<'_>> = seqs
                .iter()
                .zip(&parts)
                .zip(&starts)
                .map(|((&(cache, ids), parts), &pos)| (cache, ids, &parts[..], pos))
                .collect();
            out.clear();
            out.resize(seqs.len() * self.dims.vocab as usize, 0.0);
            let on = (held, copies);
            return self.forward_backends_batch(
                bg,
                on,
                ctx,
                &batch,
                (compute, int8_threshold),
                out,
            );
        }
        let segs: Vec<Seg<'_>> = parts
            .iter()
            .zip(&starts)
            .zip(seqs)
            .map(|((parts, &pos), (_, ids))| Seg {
                parts,
                pos,
                n: ids.len(),
            })
            .collect();
        let n = segs.iter().map(|s| s.n).sum::<usize>();
        let vocab = self.dims.vocab as usize;
        out.clear();
        out.resize(seqs.len() * vocab, 0.0);
        let (mut coll, scratch) = ctx.lend()?;
        let mut ws = self.host_works(scratch)?;
        let run = self.run(held, copies, compute);
        let (s, h) = (&self.splits, run.hidden);
        let mut buffer = 0usize;
        let mut flip = || {
            buffer ^= 1;
            buffer
        };
        let b = flip();
        let ids: Vec<u32> = seqs
            .iter()
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect();
        self.embed_rows(&run, &ids, coll.staging(b, n, h)?)?;
        {
            let mut dsts: Vec<&mut [f32]> = pick(&mut ws, &s.rs)?
                .into_iter()
                .map(|w| &mut w.residual[..])
                .collect();
            coll.scatter(b, n, h, &s.rs, &mut dsts)?;
        }
        self.layers_on(&run, &mut coll, &mut flip, &mut ws, &segs)?;
        for ((cache, ids), seg) in seqs.iter().zip(&segs) {
            cache.appended(seg.pos as u64, ids)?;
        }
        // Each sequence's last row moved to the residual's first rows (ascending, so no row is
        // overwritten before it moves), for one head call over them.
        let lasts: Vec<usize> = segs
            .iter()
            .scan(0, |end, seg| {
                *end += seg.n;
                Some(*end - 1)
            })
            .collect();
        for (&(_, a, e), w) in s.rs.iter().zip(pick(&mut ws, &s.rs)?) {
            let width = (e - a) as usize;
            for (j, &r) in lasts.iter().enumerate() {
                w.residual
                    .copy_within(r * width..(r + 1) * width, j * width);
            }
        }
        // Alone, each sequence's last row is one matrix-vector product; fast-mode block
        // products of up to 16 rows give each row those bits, other products one row each.
        let shared = self
            .heads
            .iter()
            .flatten()
            .all(|hd| compute.mode(hd.mat.ty) == MatvecMode::Q8);
        let per = if shared {
            (self.dims.logit_rows.max(1) as usize).min(Q8_BATCH_MAX_TOKENS)
        } else {
            1
        };
        let rows = (0, seqs.len(), per);
        self.head(&run, &mut coll, &mut flip, &mut ws, rows, out)?;
        Ok(coll.copies)
    }

    /// The constants of one forward call on the host path (on the backends' path, what the
    /// embedding lookup reads).
    fn run<'a>(
        &'a self,
        held: &'a [Held],
        copies: &'a [(usize, Held)],
        compute: Compute,
    ) -> Run<'a> {
        Run {
            held,
            copies,
            compute,
            max_dq: self.max_dq,
            hidden: self.dims.hidden as usize,
            head_dim: self.dims.head_dim as usize,
            eps: self.eps,
            rope: &self.rope,
            kv_tile: self.dims.kv_tile as usize,
            q_tile: self.dims.q_tile as usize,
            // LLM.int8 weights are refused under tensor parallelism: no outlier threshold
            consts: self.consts(compute, 0.0),
            family: &self.family,
        }
    }

    /// Logits of residual rows `first..first + need` into `rows_out` (`need × vocab`), `per`
    /// rows a product.
    fn head(
        &self,
        run: &Run<'_>,
        coll: &mut Collectives<'_>,
        flip: &mut dyn FnMut() -> usize,
        ws: &mut [Option<Work<'_>>],
        (first, need, per): (usize, usize, usize),
        rows_out: &mut [f32],
    ) -> Result<()> {
        let (h, vocab) = (run.hidden, self.dims.vocab as usize);
        let s = &self.splits;
        gather_residual(coll, flip(), ws, &s.rs, &s.vc, (first, need, h))?;
        for (&(d, _, _), w) in s.vc.iter().zip(pick(ws, &s.vc)?) {
            // A share wholly in the vocab table's padding has no rows.
            let Some(hd) = self.heads[d].as_ref() else {
                continue;
            };
            weightlift_kernels::rms_norm(
                &w.v.x[..need * h],
                &hd.norm,
                run.eps,
                &mut w.v.xn[..need * h],
            )
            .map_err(|e| kernel("output_norm", e))?;
        }
        for r0 in (0..need).step_by(per.max(1)) {
            let nr = per.min(need - r0);
            let mut blocks: Vec<&[f32]> = Vec::with_capacity(s.vc.len());
            for (&(d, _, _), w) in s.vc.iter().zip(pick(ws, &s.vc)?) {
                let Some(hd) = self.heads[d].as_ref() else {
                    blocks.push(&[]);
                    continue;
                };
                let Work { v, .. } = w;
                let y = &mut v.logits[..nr * hd.mat.rows];
                run.product(&hd.mat, &v.xn[r0 * h..], nr, y)?;
                blocks.push(&v.logits[..nr * hd.mat.rows]);
            }
            let got = coll.gather(flip(), nr, vocab, &s.vc, &blocks)?;
            rows_out[r0 * vocab..(r0 + nr) * vocab].copy_from_slice(got);
        }
        Ok(())
    }

    /// The first entry of the vocab table whose device holds a share of the head, and with it
    /// a replica of the output norm (every entry but one wholly in the table's padding does).
    fn norm_entry(&self) -> Result<(usize, u64, u64)> {
        self.splits
            .vc
            .iter()
            .copied()
            .find(|e| self.heads.get(e.0).is_some_and(Option::is_some))
            .ok_or_else(|| {
                invalid(
                    "tp vocab table",
                    "a device with a share of the head",
                    "none",
                )
            })
    }

    /// The output norm of residual rows `first..first + need` into `rows_out` (`need ×
    /// hidden`): the rows gathered to one device of the vocab table, normed there with its
    /// replica of the norm, as [`TpGraph::head`] norms them before its product.
    fn hidden(
        &self,
        run: &Run<'_>,
        coll: &mut Collectives<'_>,
        flip: &mut dyn FnMut() -> usize,
        ws: &mut [Option<Work<'_>>],
        (first, need): (usize, usize),
        rows_out: &mut [f32],
    ) -> Result<()> {
        let h = run.hidden;
        let entry = self.norm_entry()?;
        let Some(hd) = self.heads.get(entry.0).and_then(Option::as_ref) else {
            return Err(invalid("tp head", "a share of the head", "none"));
        };
        let one: SplitTable = vec![entry];
        gather_residual(coll, flip(), ws, &self.splits.rs, &one, (first, need, h))?;
        for w in pick(ws, &one)? {
            let v = &mut w.v;
            weightlift_kernels::rms_norm(
                &v.x[..need * h],
                &hd.norm,
                run.eps,
                &mut v.xn[..need * h],
            )
            .map_err(|e| kernel("output_norm", e))?;
            rows_out.copy_from_slice(&v.xn[..need * h]);
        }
        Ok(())
    }

    /// Embedding rows of `ids` into `dst` (`ids.len() × hidden`).
    fn embed_rows(&self, run: &Run<'_>, ids: &[u32], dst: &mut [f32]) -> Result<()> {
        let h = run.hidden;
        let (bytes, name) = match run.held.get(self.embed) {
            Some(Held::Whole { tensor, .. }) => (tensor.host_bytes(), "token_embd"),
            _ => (None, "token_embd"),
        };
        let bytes = bytes.ok_or_else(|| EngineError::Unsupported {
            what: "a tensor-parallel embedding outside host memory".into(),
            detail: "the plan keeps the token embedding whole on the host".into(),
        })?;
        let row = bytes.len() / self.dims.vocab.max(1) as usize;
        for (t, &id) in ids.iter().enumerate() {
            let r = id as usize;
            weightlift_kernels::dequantize_f32(
                self.embed_ty,
                &bytes[r * row..(r + 1) * row],
                &mut dst[t * h..(t + 1) * h],
            )
            .map_err(|e| kernel(name, e))?;
        }
        // gemma's √hidden, as the layer split scales the rows
        if let Some(s) = self.family.embed_scale {
            weightlift_kernels::scale_in_place(&mut dst[..ids.len() * h], s);
        }
        Ok(())
    }

    /// The cache must be split as the KV table says, each part on its device.
    fn check_cache(&self, ctx: &TpContext, parts: &[crate::cache::TpPart]) -> Result<()> {
        let want: Vec<(String, u32, u32)> = self
            .splits
            .kv
            .iter()
            // a rank-local cache holds only its rank's heads
            .filter(|e| ctx.rank().is_none_or(|r| r == e.0))
            .map(|&(d, a, b)| Ok((ctx.device(d)?.name().to_owned(), a as u32, b as u32)))
            .collect::<Result<_>>()?;
        let got: Vec<(String, u32, u32)> = parts
            .iter()
            .map(|p| (p.device.name().to_owned(), p.heads.0, p.heads.1))
            .collect();
        if want != got {
            return Err(invalid(
                "cache for a tensor-parallel forward pass",
                format!(
                    "split by kv heads as {want:?} (the model's own cache, or one split like it)"
                ),
                if got.is_empty() {
                    "a cache that is not split".to_owned()
                } else {
                    format!("{got:?}")
                },
            ));
        }
        Ok(())
    }
}

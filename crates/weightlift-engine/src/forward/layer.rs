//! One decoder layer on the host path (the CPU kernels on slices of host memory): the attention
//! block, the MLP block, their norms and RoPE, and the matrix products they and the head are
//! made of.

use std::sync::Arc;

use weightlift_kernels::RopeParams;
use weightlift_kernels::cpu::matvec::{matmul, matvec};

use super::attention::{self, Shape, Tiles};
use super::family::{Family, Gate};
use super::parts::{Layer, Linear, Slot};
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

/// One decoder layer on `n` tokens at positions `pos..pos + n`, in place on `w.x`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_layer(
    c: &Consts,
    l: &Layer,
    li: usize,
    wts: &Weights<'_>,
    cache: &Arc<Cache>,
    pos: usize,
    n: usize,
    w: &mut Views<'_>,
) -> Result<()> {
    let (h, hd, nh) = (c.hidden, c.head_dim, c.n_heads);
    let (qd, kvd) = (nh * hd, l.kv_heads * hd);
    let err = |what: &'static str| move |e| kernel(&format!("layer {li} {what}"), e);
    // attention
    weightlift_kernels::rms_norm(&w.x[..n * h], &l.attn_norm.host, c.eps, &mut w.xn[..n * h])
        .map_err(err("attn_norm"))?;
    linear_on(c, wts, &l.q, w.xn, n, w.q)?;
    linear_on(c, wts, &l.k, w.xn, n, w.k)?;
    linear_on(c, wts, &l.v, w.xn, n, w.v)?;
    // per-head norms, through the attention accumulators (free until attention)
    for (f, x, len) in [
        (&l.q_norm, &mut *w.q, n * qd),
        (&l.k_norm, &mut *w.k, n * kvd),
    ] {
        if let Some(f) = f {
            let tmp = &mut w.att[..len];
            weightlift_kernels::rms_norm(&x[..len], &f.host, c.eps, tmp)
                .map_err(err("q/k norm"))?;
            x[..len].copy_from_slice(tmp);
        }
    }
    for (t, p) in w.pos[..n].iter_mut().enumerate() {
        *p = (pos + t) as i32;
    }
    let freqs = match &l.rope {
        Some(f) => &f.host[..c.rope.n_dims / 2],
        None => &w.freqs[..c.rope.n_dims / 2],
    };
    weightlift_kernels::rope_in_place(&mut w.q[..n * qd], &w.pos[..n], &c.rope, freqs)
        .map_err(err("rope"))?;
    weightlift_kernels::rope_in_place(&mut w.k[..n * kvd], &w.pos[..n], &c.rope, freqs)
        .map_err(err("rope"))?;
    cache.write_rows(li, pos as u64, &w.k[..n * kvd], &w.v[..n * kvd])?;
    let resident = if cache.is_offloaded() {
        Some(cache.fetch(li)?)
    } else {
        None
    };
    let shape = Shape {
        n_heads: nh,
        kv_heads: l.kv_heads,
        head_dim: hd,
        kv_tile: c.kv_tile,
        q_tile: c.q_tile,
        f16_operands: c.compute.f16_operands(cache.config().dtype),
        scale: c.attn_scale,
        window: l.window,
        softcap: c.attn_softcap,
    };
    let tiles = Tiles {
        kt: w.kt,
        vt: w.vt,
        scores: w.scores,
        stats: w.stats,
        acc: w.att,
    };
    // The rotated queries are read from `q`; the attention output replaces them there.
    attention::attend(
        shape,
        cache,
        li,
        resident.as_ref(),
        pos,
        &mut w.q[..n * qd],
        tiles,
    )?;
    drop(resident);
    linear_on(c, wts, &l.o, w.q, n, w.xn)?;
    post_norm(c, l.post_attn_norm.as_ref(), n * h, w).map_err(err("post_attention_norm"))?;
    add_in_place(&mut w.x[..n * h], &w.xn[..n * h]);
    // MLP
    weightlift_kernels::rms_norm(&w.x[..n * h], &l.ffn_norm.host, c.eps, &mut w.xn[..n * h])
        .map_err(err("ffn_norm"))?;
    let i = l.gate.rows;
    linear_on(c, wts, &l.gate, w.xn, n, w.gate)?;
    linear_on(c, wts, &l.up, w.xn, n, w.up)?;
    match c.gate {
        Gate::Silu => {
            swiglu_in_place(&mut w.gate[..n * i], &w.up[..n * i]).map_err(err("swiglu"))?;
        }
        Gate::GeluTanh => {
            weightlift_kernels::geglu_tanh_in_place(&mut w.gate[..n * i], &w.up[..n * i])
                .map_err(err("geglu"))?;
        }
    }
    linear_on(c, wts, &l.down, w.gate, n, w.xn)?;
    post_norm(c, l.post_ffn_norm.as_ref(), n * h, w).map_err(err("post_ffw_norm"))?;
    add_in_place(&mut w.x[..n * h], &w.xn[..n * h]);
    Ok(())
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

/// `gate = silu(gate) * up`, through the kernel in stack-sized pieces.
pub(super) fn swiglu_in_place(gate: &mut [f32], up: &[f32]) -> weightlift_kernels::Result<()> {
    use rayon::prelude::*;
    const PIECE: usize = 1024;
    gate.par_chunks_mut(PIECE)
        .zip(up.par_chunks(PIECE))
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
    let (bytes, dtype) = host_bytes(h, &l.name)?;
    let packing = Packing::of(&l.name, dtype)?;
    match (slot, l.onload_at) {
        (Some(s), Some(at)) => {
            let b = s.get(at..at + bytes.len()).ok_or_else(|| {
                invalid(
                    format!("onloaded '{}'", l.name),
                    format!("{} bytes from offset {at}", bytes.len()),
                    format!("a slot of {} bytes", s.len()),
                )
            })?;
            Ok((b, packing))
        }
        _ => Ok((bytes, packing)),
    }
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
fn add_bias(l: &Linear, y: &mut [f32]) {
    if let Some(b) = &l.bias {
        for yr in y.chunks_exact_mut(l.rows) {
            yr.iter_mut().zip(&b.host).for_each(|(v, b)| *v += b);
        }
    }
}

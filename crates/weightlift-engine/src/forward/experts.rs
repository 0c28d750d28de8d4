//! The routed experts of a mixture-of-experts block on the host: each token's experts from
//! its router scores ([`route`]), in the one order every path meets them
//! ([`for_each_routed`]), and their products on the rows routed to them ([`experts`]). The host
//! forward pass runs it, and so does the backend path for experts kept in host RAM.

use weightlift_kernels::cpu::matvec::{GroupedInput, SharedInput, matmul_grouped, matmul_shared};
use weightlift_kernels::types::QuantType;

use super::Views;
use super::layer::{
    Consts, Piece, Weights, activate, add_bias, kernel, linear_on, linear_pieces, q8_weights,
    tokens,
};
use super::parts::{Linear, Moe};
use crate::error::{Result, invalid};

/// Each token's experts and their weights, from its router scores (`n_experts` per token):
/// the softmax of all the scores, the `n_used` largest (the lower expert first on a tie), and
/// with `norm_topk_prob` those divided by their sum (transformers' Mixtral and Qwen3-MoE
/// routers; llama.cpp's softmax gating). `picks` gets `n_used` `(expert, weight)` per token.
pub(super) fn route(
    scores: &[f32],
    n_experts: usize,
    n_used: usize,
    norm_topk_prob: bool,
    picks: &mut Vec<(usize, f32)>,
) {
    picks.clear();
    let mut probs = vec![0f32; n_experts];
    let mut order: Vec<usize> = (0..n_experts).collect();
    for s in scores.chunks_exact(n_experts) {
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (p, &v) in probs.iter_mut().zip(s) {
            *p = (v - max).exp();
            sum += *p;
        }
        probs.iter_mut().for_each(|p| *p /= sum);
        // a stable sort: equal probabilities keep the lower expert first
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let chosen = &order[..n_used];
        let total: f32 = chosen.iter().map(|&e| probs[e]).sum();
        let scale = if norm_topk_prob { total } else { 1.0 };
        picks.extend(chosen.iter().map(|&e| (e, probs[e] / scale)));
        order.sort_unstable();
    }
}

/// The mixture-of-experts block on the normed tokens in `w.xn`, its output written back there:
/// the router's scores, then [`experts`].
pub(super) fn moe(
    c: &Consts,
    m: &Moe,
    li: usize,
    wts: &Weights<'_>,
    pieces: &[Piece<'_>],
    w: &mut Views<'_>,
) -> Result<()> {
    let n = tokens(pieces);
    let mut scores = vec![0f32; n * m.n_experts()];
    linear_pieces(c, wts, &m.router, pieces, w.xn, &mut scores)?;
    let lens: Vec<usize> = pieces.iter().map(|p| p.n).collect();
    experts(c, m, li, wts, &lens, &scores, &mut w.xn[..n * c.hidden])
}

/// The routed experts of a mixture-of-experts block on the normed tokens `xn` (pieces of
/// `lens` tokens, one a sequence, in row order), given their router scores (`n_experts` a
/// token), the block's output written back into `xn`. Piece by piece (each token's bits as
/// when its sequence runs alone): each token's experts ([`route`]), then per expert one
/// product over the tokens routed to it (their rows gathered), its outputs added into theirs,
/// scaled by their weights, in expert order. Only the routed experts' weights are read, and
/// only the experts `m` holds run: under tensor parallelism `xn` gets this device's partial
/// sum. The host path runs it after its router product; the backend path on the rows it
/// copied to the host (see `exec::moe_on_host`).
pub(super) fn experts(
    c: &Consts,
    m: &Moe,
    li: usize,
    wts: &Weights<'_>,
    lens: &[usize],
    scores: &[f32],
    xn: &mut [f32],
) -> Result<()> {
    let h = c.hidden;
    let n_experts = m.n_experts();
    let n = lens.iter().sum::<usize>();
    if scores.len() != n * n_experts || xn.len() != n * h {
        return Err(invalid(
            format!("layer {li} expert inputs"),
            format!("{n} tokens of {n_experts} router scores and {h} values"),
            format!("{} scores and {} values", scores.len(), xn.len()),
        ));
    }
    let mut groups: Vec<(usize, Vec<(usize, f32)>)> = Vec::new();
    for_each_routed(m, lens, scores, |e, routed| {
        groups.push((e, routed.to_vec()));
        Ok(())
    })?;
    // runs of experts routed the same tokens (every expert a piece of one token chose: a
    // decode step's), whose products run together
    let same_tokens = |a: &[(usize, f32)], b: &[(usize, f32)]| {
        a.iter().map(|&(t, _)| t).eq(b.iter().map(|&(t, _)| t))
    };
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        match runs.last_mut() {
            Some(r) if same_tokens(&groups[r.start].1, &g.1) => r.end = i + 1,
            _ => runs.push(i..i + 1),
        }
    }
    // one set of buffers for every run: the most rows a run's experts take together
    let widest = m.experts.iter().map(|[g, _, _]| g.rows).max().unwrap_or(0);
    let rows = |r: &std::ops::Range<usize>| r.len() * groups[r.start].1.len();
    let most = runs.iter().map(rows).max().unwrap_or(0);
    let most_tokens = groups.iter().map(|g| g.1.len()).max().unwrap_or(0);
    let mut bufs = RunBuffers {
        xs: vec![0f32; most_tokens * h],
        g: vec![0f32; most * widest],
        u: vec![0f32; most * widest],
        y: vec![0f32; most * h],
    };
    let mut out = vec![0f32; n * h];
    for r in runs {
        let run = &groups[r];
        let cnt = run[0].1.len();
        run_products(c, m, li, wts, run, xn, &mut bufs)?;
        for ((_, routed), y) in run.iter().zip(bufs.y.chunks_exact(cnt * h)) {
            for (&(t, wt), yr) in routed.iter().zip(y.chunks_exact(h)) {
                out[t * h..(t + 1) * h]
                    .iter_mut()
                    .zip(yr)
                    .for_each(|(o, v)| *o += wt * v);
            }
        }
    }
    xn.copy_from_slice(&out);
    Ok(())
}

/// The buffers of [`run_products`]: the run's token rows, each expert's gate and up outputs
/// and its output rows, expert after expert.
struct RunBuffers {
    xs: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    y: Vec<f32>,
}

/// The outputs of the experts of `run`, which were all routed the same `cnt` tokens of `xn`,
/// into `b.y` (`cnt × hidden` an expert, in run order). Where every matrix of theirs is a
/// fast-mode block product (the gates and ups of one type, the downs of one type), all their
/// gate and up products run in one call on the tokens quantised once ([`matmul_shared`]) and
/// all their down products in another ([`matmul_grouped`]): one fork and join each for the
/// block, where a decode step's eight experts took 24. Else expert by expert. Every output has
/// the bits of its expert's own products.
fn run_products(
    c: &Consts,
    m: &Moe,
    li: usize,
    wts: &Weights<'_>,
    run: &[(usize, Vec<(usize, f32)>)],
    xn: &[f32],
    b: &mut RunBuffers,
) -> Result<()> {
    let h = c.hidden;
    let cnt = run[0].1.len();
    let xs = &mut b.xs[..cnt * h];
    for (&(t, _), row) in run[0].1.iter().zip(xs.chunks_exact_mut(h)) {
        row.copy_from_slice(&xn[t * h..(t + 1) * h]);
    }
    let xs = &*xs;
    let mats = run
        .iter()
        .map(|(e, _)| held_expert(m, li, *e))
        .collect::<Result<Vec<_>>>()?;
    let f = mats[0][0].rows;
    let k = run.len();
    let ys = &mut b.y[..k * cnt * h];
    let activate_one = |g: &mut [f32], u: &[f32], e: usize| -> Result<()> {
        activate(c.gate, g, u)
            .map_err(|e2| kernel(&format!("layer {li} expert {e} activation"), e2))
    };
    let Some(([gate_ty, down_ty], weights)) = block_products(c, wts, &mats, h)? else {
        // expert by expert, each of its own width
        let (g, u) = (
            &mut b.g[..cnt * widest(&mats)],
            &mut b.u[..cnt * widest(&mats)],
        );
        for ((y, [gate, up, down]), (e, _)) in ys.chunks_exact_mut(cnt * h).zip(&mats).zip(run) {
            let (g, u) = (&mut g[..cnt * gate.rows], &mut u[..cnt * gate.rows]);
            linear_on(c, wts, gate, xs, cnt, g)?;
            linear_on(c, wts, up, xs, cnt, u)?;
            activate_one(g, u, *e)?;
            linear_on(c, wts, down, g, cnt, y)?;
        }
        return Ok(());
    };
    let names = || -> String {
        let names: Vec<&str> = mats.iter().map(|[g, ..]| g.name.as_str()).collect();
        names.join(", ")
    };
    // the run's experts are all `f` wide here (block_products)
    let (gs, us) = (&mut b.g[..k * cnt * f], &mut b.u[..k * cnt * f]);
    let mut parts: Vec<SharedInput<'_>> = Vec::with_capacity(2 * k);
    let per = gs
        .chunks_exact_mut(cnt * f)
        .zip(us.chunks_exact_mut(cnt * f));
    for ((g, u), [wg, wu, _]) in per.zip(&weights) {
        parts.push(SharedInput {
            w: wg,
            rows: f,
            y: g,
        });
        parts.push(SharedInput {
            w: wu,
            rows: f,
            y: u,
        });
    }
    let mode = c.compute.mode(gate_ty);
    matmul_shared(mode, gate_ty, &mut parts, h, xs, cnt, c.max_dq)
        .map_err(|e| kernel(&names(), e))?;
    let per = gs
        .chunks_exact_mut(cnt * f)
        .zip(us.chunks_exact_mut(cnt * f));
    for ((g, u), ([gate, up, _], (e, _))) in per.zip(mats.iter().zip(run)) {
        add_bias(gate, g);
        add_bias(up, u);
        activate_one(g, u, *e)?;
    }
    let mut parts: Vec<GroupedInput<'_>> = gs
        .chunks_exact(cnt * f)
        .zip(ys.chunks_exact_mut(cnt * h))
        .zip(&weights)
        .map(|((g, y), [_, _, wd])| GroupedInput {
            w: wd,
            rows: h,
            x: g,
            y,
        })
        .collect();
    let mode = c.compute.mode(down_ty);
    matmul_grouped(mode, down_ty, &mut parts, f, cnt, c.max_dq).map_err(|e| kernel(&names(), e))?;
    for (y, [.., down]) in ys.chunks_exact_mut(cnt * h).zip(&mats) {
        add_bias(down, y);
    }
    Ok(())
}

/// The widest gate of `mats`.
fn widest(mats: &[&[Linear; 3]]) -> usize {
    mats.iter().map(|[g, ..]| g.rows).max().unwrap_or(0)
}

/// The block types and weights of the experts `mats` (hidden size `h`) when every matrix is a
/// fast-mode block product, the gates and ups of one type and the downs of another (or the
/// same), all of one shape: `([gate and up type, down type], each expert's [gate, up, down])`.
#[allow(clippy::type_complexity)]
fn block_products<'a>(
    c: &Consts,
    wts: &Weights<'a>,
    mats: &[&[Linear; 3]],
    h: usize,
) -> Result<Option<([QuantType; 2], Vec<[&'a [u8]; 3]>)>> {
    let f = mats[0][0].rows;
    let mut types: Option<[QuantType; 2]> = None;
    let mut weights = Vec::with_capacity(mats.len());
    for [gate, up, down] in mats {
        let shaped = gate.rows == f && up.rows == f && gate.cols == h && up.cols == h;
        if !(shaped && down.rows == h && down.cols == f) {
            return Ok(None);
        }
        let (Some((tg, wg)), Some((tu, wu)), Some((td, wd))) = (
            q8_weights(c, wts, gate)?,
            q8_weights(c, wts, up)?,
            q8_weights(c, wts, down)?,
        ) else {
            return Ok(None);
        };
        if tg != tu || types.is_some_and(|t| t != [tg, td]) {
            return Ok(None);
        }
        types = Some([tg, td]);
        weights.push([wg, wu, wd]);
    }
    Ok(types.map(|t| (t, weights)))
}

/// Expert `e`'s matrices in `m`, which routed a token to it.
pub(super) fn held_expert(m: &Moe, li: usize, e: usize) -> Result<&[Linear; 3]> {
    m.expert(e).ok_or_else(|| {
        invalid(
            format!("layer {li} expert {e}"),
            format!(
                "one of experts {}..{} held here",
                m.first,
                m.first + m.experts.len()
            ),
            "a token routed to another",
        )
    })
}

/// The routing of pieces of `lens` tokens (their router `scores`, `n_experts` a token, in
/// order), in the order every MoE block computes it, piece by piece and within a piece expert
/// by expert: `each(e, routed)` for each expert `e` of `m`'s a piece routes tokens to, with
/// `routed` those tokens' rows in the batch and their routing weights. Keeping one order is
/// what gives a token the same sums on the host path and the backend; under tensor
/// parallelism each device meets only its own experts, in that order.
pub(super) fn for_each_routed(
    m: &Moe,
    lens: &[usize],
    scores: &[f32],
    mut each: impl FnMut(usize, &[(usize, f32)]) -> Result<()>,
) -> Result<()> {
    let n_experts = m.n_experts();
    let mut picks = Vec::new();
    let mut routed: Vec<(usize, f32)> = Vec::new();
    let mut at = 0;
    for &len in lens {
        let rows = at..at + len;
        at += len;
        route(
            &scores[rows.start * n_experts..rows.end * n_experts],
            n_experts,
            m.n_used,
            m.norm_topk_prob,
            &mut picks,
        );
        for e in m.first..(m.first + m.experts.len()).min(n_experts) {
            routed.clear();
            routed.extend(
                picks
                    .iter()
                    .enumerate()
                    .filter(|(_, (pe, _))| *pe == e)
                    .map(|(k, &(_, wt))| (rows.start + k / m.n_used, wt)),
            );
            if !routed.is_empty() {
                each(e, &routed)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::route;

    /// Scores ln(1), ln(2), ln(3), ln(4): softmax 0.1, 0.2, 0.3, 0.4; the top two are experts 3
    /// and 2, weighted 0.4 and 0.3, or 4/7 and 3/7 renormalised; equal scores keep the lower
    /// expert first.
    #[test]
    fn route_is_softmax_then_top_k_then_renormalised() {
        let scores: Vec<f32> = [1f32, 2.0, 3.0, 4.0].iter().map(|v| v.ln()).collect();
        let mut picks = Vec::new();
        route(&scores, 4, 2, false, &mut picks);
        let close = |a: f32, b: f32| (a - b).abs() < 1e-6;
        assert_eq!((picks[0].0, picks[1].0), (3, 2));
        assert!(
            close(picks[0].1, 0.4) && close(picks[1].1, 0.3),
            "{picks:?}"
        );
        route(&scores, 4, 2, true, &mut picks);
        assert!(close(picks[0].1, 4.0 / 7.0) && close(picks[1].1, 3.0 / 7.0));
        route(&[0.5; 8], 4, 2, true, &mut picks);
        let experts: Vec<usize> = picks.iter().map(|p| p.0).collect();
        assert_eq!(experts, [0, 1, 0, 1]);
        assert!(picks.iter().all(|p| close(p.1, 0.5)));
    }
}

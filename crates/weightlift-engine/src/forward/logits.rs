//! The head on the host path: the output norm, and the logits of the rows asked for or the
//! normed rows themselves.

use super::Views;
use super::layer::{Consts, Weights, kernel, linear_on};
use super::parts::{Floats, Linear};
use crate::error::Result;

/// `xn = RMSNorm(x) · norm` for rows `first..first + need` of the residual stream, into rows
/// `0..need` of `w.xn`: the head's input.
fn out_norm(c: &Consts, norm: &Floats, first: usize, need: usize, w: &mut Views<'_>) -> Result<()> {
    let h = c.hidden;
    let xs = &w.x[first * h..(first + need) * h];
    weightlift_kernels::rms_norm(xs, &norm.host, c.eps, &mut w.xn[..need * h])
        .map_err(|e| kernel("output_norm", e))
}

/// The output norm and head for rows `first..first + out.len() / vocab` of the residual stream,
/// `rows` logit rows at a time through the workspace, into `out`.
#[allow(clippy::too_many_arguments)]
pub(super) fn head_rows(
    c: &Consts,
    wts: &Weights<'_>,
    norm: &Floats,
    head: &Linear,
    first: usize,
    rows: usize,
    out: &mut [f32],
    w: &mut Views<'_>,
) -> Result<()> {
    let h = c.hidden;
    let vocab = head.rows;
    let need = out.len() / vocab;
    out_norm(c, norm, first, need, w)?;
    for r0 in (0..need).step_by(rows) {
        let nr = rows.min(need - r0);
        let y = &mut w.logits[..nr * vocab];
        linear_on(c, wts, head, &w.xn[r0 * h..], nr, y)?;
        out[r0 * vocab..(r0 + nr) * vocab].copy_from_slice(y);
    }
    Ok(())
}

/// The output norm of rows `first..first + out.len() / hidden` of the residual stream, into
/// `out`: the rows [`head_rows`] would multiply by the head, bit for bit.
pub(super) fn hidden_rows(
    c: &Consts,
    norm: &Floats,
    first: usize,
    out: &mut [f32],
    w: &mut Views<'_>,
) -> Result<()> {
    let need = out.len() / c.hidden;
    out_norm(c, norm, first, need, w)?;
    out.copy_from_slice(&w.xn[..out.len()]);
    Ok(())
}

//! The head on the host path: the output norm and the logits of the rows asked for.

use super::Views;
use super::layer::{Consts, Weights, kernel, linear_on};
use super::parts::{Floats, Linear};
use crate::error::Result;

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
    let xs = &w.x[first * h..(first + need) * h];
    weightlift_kernels::rms_norm(xs, &norm.host, c.eps, &mut w.xn[..need * h])
        .map_err(|e| kernel("output_norm", e))?;
    for r0 in (0..need).step_by(rows) {
        let nr = rows.min(need - r0);
        let y = &mut w.logits[..nr * vocab];
        linear_on(c, wts, head, &w.xn[r0 * h..], nr, y)?;
        out[r0 * vocab..(r0 + nr) * vocab].copy_from_slice(y);
    }
    Ok(())
}

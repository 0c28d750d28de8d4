//! The token embedding on the host path: a row lookup in the embedding matrix.

use super::layer::{kernel, weight_of};
use super::parts::Linear;
use super::weights::Packing;
use crate::error::{Result, invalid};
use crate::model::Held;

/// The embedding rows of `ids`, dequantised into the residual stream `x` (`hidden` values a
/// token).
pub(super) fn embed_rows(
    held: &[Held],
    copies: &[(usize, Held)],
    embed: &Linear,
    ids: &[u32],
    hidden: usize,
    x: &mut [f32],
) -> Result<()> {
    let h = hidden;
    let (ebytes, ety) = match weight_of(held, copies, embed, None)? {
        (b, Packing::Blocks(ty)) => (b, ty),
        _ => {
            return Err(invalid(
                format!("embedding '{}'", embed.name),
                "float or ggml rows",
                "int8 rows",
            ));
        }
    };
    let row_bytes = ebytes.len() / embed.rows;
    for (t, id) in ids.iter().enumerate() {
        let r = *id as usize;
        weightlift_kernels::dequantize_f32(
            ety,
            &ebytes[r * row_bytes..(r + 1) * row_bytes],
            &mut x[t * h..(t + 1) * h],
        )
        .map_err(|e| kernel(&embed.name, e))?;
    }
    Ok(())
}

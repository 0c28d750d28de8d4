//! `check_tensors` on device-placed data: the first NaN or infinity of a float tensor, or of the
//! f16 scales of a quantised one (the shared multi-threaded scan of the format crate).

use weightlift_format::DType;

use crate::error::{EngineError, Result};

/// Fail with `NonFinite` naming `tensor` and `device` at the first NaN/Inf of `bytes`.
pub fn check(tensor: &str, device: &str, dtype: DType, bytes: &[u8]) -> Result<()> {
    match weightlift_format::scan::find_non_finite(dtype, bytes) {
        None => Ok(()),
        Some(nf) => Err(EngineError::NonFinite {
            tensor: tensor.to_owned(),
            device: device.to_owned(),
            index: nf.index,
            kind: nf.kind,
        }),
    }
}

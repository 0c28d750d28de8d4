//! `check_tensors` on device-placed data: the first NaN or infinity of a float tensor, or of the
//! f16 scales of a quantised one, scanned where the tensor lives (the format crate's
//! multi-threaded scan on host memory, the kernels' scan on CUDA memory).

use crate::device::DeviceTensor;
use crate::error::{EngineError, Result};

/// Fail with `NonFinite` naming `tensor` and its device at the first NaN/Inf of `t`.
pub fn check(tensor: &str, t: &DeviceTensor) -> Result<()> {
    match t.find_non_finite()? {
        None => Ok(()),
        Some((index, kind)) => Err(EngineError::NonFinite {
            tensor: tensor.to_owned(),
            device: t.device().name().to_owned(),
            index,
            kind,
        }),
    }
}

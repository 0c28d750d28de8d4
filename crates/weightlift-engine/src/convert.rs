//! Dtype conversion on the way to a device (F32 and BF16 to F16; quantised types are never
//! converted, they stay quantised; anything else is refused with `Unsupported`), and the one
//! dequantiser every user-facing read goes through ([`dequantize_into`]).

use half::{bf16, f16};
use weightlift_format::{DType, FormatError, TensorInfo};

use crate::error::{EngineError, Result};

/// Whether `info` may be held as `to`.
pub fn check(info: &TensorInfo, to: DType) -> Result<()> {
    match (info.dtype, to) {
        (a, b) if a == b => Ok(()),
        (DType::F32 | DType::BF16, DType::F16) => Ok(()),
        (from, to) => Err(EngineError::Unsupported {
            what: format!("converting tensor '{}' from {from} to {to}", info.name),
            detail: "only F32 and BF16 convert (to F16); quantised types stay quantised".into(),
        }),
    }
}

/// Bytes per element in and out of a conversion from `info`'s dtype to `to`.
fn sizes(info: &TensorInfo, to: DType) -> Result<(usize, usize)> {
    match (info.dtype, to) {
        (a, b) if a == b => Ok((1, 1)),
        (DType::F32, DType::F16) => Ok((4, 2)),
        (DType::BF16, DType::F16) => Ok((2, 2)),
        _ => check(info, to).map(|()| (1, 1)),
    }
}

/// Where the conversion of source bytes `at..at + len` lands in the converted tensor:
/// `(offset, length)` in bytes.
pub fn output_range(info: &TensorInfo, to: DType, at: u64, len: usize) -> Result<(usize, usize)> {
    let (in_size, out_size) = sizes(info, to)?;
    let at = usize::try_from(at).unwrap_or(usize::MAX);
    Ok((
        (at / in_size).saturating_mul(out_size),
        len / in_size * out_size,
    ))
}

/// Write the conversion of `data` (source bytes `at..at + data.len()` of the tensor) into the
/// matching range of `dst` (the whole converted tensor).
pub fn convert_into(
    info: &TensorInfo,
    to: DType,
    at: u64,
    data: &[u8],
    dst: &mut [u8],
) -> Result<()> {
    let (out_at, out_len) = output_range(info, to, at, data.len())?;
    let Some(out) = out_at
        .checked_add(out_len)
        .and_then(|end| dst.get_mut(out_at..end))
    else {
        return Err(crate::error::invalid(
            format!("conversion of tensor '{}'", info.name),
            format!("a chunk inside {} bytes", dst.len()),
            format!("bytes {out_at}..{}", out_at + out_len),
        ));
    };
    let kernel = |e: weightlift_kernels::KernelError| EngineError::Unsupported {
        what: format!("converting tensor '{}' to {to}", info.name),
        detail: e.to_string(),
    };
    // The kernels work on aligned words; staging chunks usually are, mmap offsets may not be.
    let mut words = vec![0u16; out.len() / 2];
    match (info.dtype, to) {
        (a, b) if a == b => {
            out.copy_from_slice(data);
            return Ok(());
        }
        (DType::F32, DType::F16) => {
            let src: std::borrow::Cow<'_, [f32]> = match bytemuck::try_cast_slice(data) {
                Ok(s) => s.into(),
                Err(_) => data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            };
            weightlift_kernels::f32_to_f16_slice(&src, &mut words).map_err(kernel)?;
        }
        _ => {
            let src: std::borrow::Cow<'_, [u16]> = match bytemuck::try_cast_slice(data) {
                Ok(s) => s.into(),
                Err(_) => data
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            };
            weightlift_kernels::bf16_to_f16_slice(&src, &mut words).map_err(kernel)?;
        }
    }
    out.copy_from_slice(bytemuck::cast_slice(&words));
    Ok(())
}

/// Whether [`dequantize_into`] can decode `dtype`.
pub fn can_dequantize(dtype: DType) -> bool {
    kernel_type(dtype).is_some() || weightlift_format::dequant::supports(dtype)
}

/// Dequantise `data`, exactly `out.len()` elements of `dtype`, into `out`. The kernels' SIMD
/// dequantisers (threaded, bit-identical to gguf-py) take every type they implement; the format
/// crate's scalar reference takes the rest. `Checkpoint.dequantize` and
/// `Model.tensor(dequantize=True)` both come here, so a tensor reads the same either way.
pub fn dequantize_into(dtype: DType, data: &[u8], out: &mut [f32]) -> Result<(), FormatError> {
    match kernel_type(dtype) {
        Some(qt) => weightlift_kernels::dequantize_f32(qt, data, out).map_err(|e| {
            FormatError::DequantizeBlocks {
                dtype,
                detail: e.to_string(),
            }
        }),
        None => weightlift_format::dequant::dequantize_into(dtype, data, out),
    }
}

fn kernel_type(dtype: DType) -> Option<weightlift_kernels::QuantType> {
    dtype
        .ggml_id()
        .and_then(weightlift_kernels::QuantType::from_ggml_id)
}

/// Decode a float tensor's bytes to f32 (F32, F16, BF16).
pub fn to_f32(dtype: DType, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => return None,
    })
}

//! Dtype conversion on the way to a device (F32 and BF16 to F16; F32, F16 and BF16 matrices to
//! the types quantise-on-load writes, whole rows at a time; quantised types are never
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
        _ if quantizing(info, to) => {
            let cols = info.shape.last().copied().unwrap_or(0);
            if info.shape.len() == 2 && cols > 0 && cols.is_multiple_of(to.block_size()) {
                Ok(())
            } else {
                Err(crate::error::invalid(
                    format!("quantising tensor '{}' to {to}", info.name),
                    format!(
                        "a matrix whose rows are whole {}-value blocks",
                        to.block_size()
                    ),
                    format!("shape {:?}", info.shape),
                ))
            }
        }
        (from, to) => Err(EngineError::Unsupported {
            what: format!("converting tensor '{}' from {from} to {to}", info.name),
            detail: "F32 and BF16 convert to F16, float matrices quantise to INT8, Q4_0, Q4_1, \
                     Q5_0, Q5_1, Q8_0, Q4_K or Q6_K; quantised types stay quantised"
                .into(),
        }),
    }
}

/// Whether holding `info` as `to` quantises it on load.
pub fn quantizing(info: &TensorInfo, to: DType) -> bool {
    let float = matches!(info.dtype, DType::F32 | DType::F16 | DType::BF16);
    let writable =
        to == DType::INT8 || kernel_type(to).is_some_and(weightlift_kernels::can_quantize);
    float && writable
}

/// Source bytes of one row of `info`, the unit a quantising load reads in: every chunk handed
/// to [`quantize_chunk`] is whole rows.
pub fn source_row_bytes(info: &TensorInfo) -> u64 {
    let cols = info.shape.last().copied().unwrap_or(1);
    info.dtype.bytes_for(cols).unwrap_or(1).max(1)
}

/// Quantise whole source rows `data` (source bytes `at..at + data.len()` of `info`) to `to`,
/// and hand each piece of the held tensor to `put(offset, bytes)`: the rows' quants, then, for
/// INT8, their f32 scales, which sit after every quant of the tensor. `scratch` holds the
/// output between the two (at most one chunk's worth), so a load needs no tensor-sized buffer.
pub fn quantize_chunk(
    info: &TensorInfo,
    to: DType,
    at: u64,
    data: &[u8],
    scratch: &mut Vec<u8>,
    put: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let ChunkRows {
        first,
        rows,
        cols,
        src_ty,
    } = chunk_rows(info, to, at, data.len())?;
    let kernel = quantize_error(info, to);
    if to == DType::INT8 {
        let all_rows = (info.n_elements() as usize) / cols.max(1);
        let mut scales = vec![0f32; rows];
        scratch.clear();
        scratch.resize(rows * cols, 0);
        let q: &mut [i8] = bytemuck::cast_slice_mut(scratch.as_mut_slice());
        weightlift_kernels::int8_quantize_rows_from(src_ty, data, cols, q, &mut scales)
            .map_err(kernel)?;
        put(first * cols, scratch)?;
        return put(all_rows * cols + first * 4, bytemuck::cast_slice(&scales));
    }
    let (qt, row_out) = block_rows(info, to, cols)?;
    scratch.clear();
    scratch.resize(rows * row_out, 0);
    // a non-finite value is named by its index in the tensor, as the device path names it
    weightlift_kernels::quantize_rows_from_at(qt, src_ty, data, cols, scratch, first * cols)
        .map_err(kernel)?;
    put(first * row_out, scratch)
}

/// Whole source rows of a quantising chunk (see [`quantize_chunk`]).
struct ChunkRows {
    /// The chunk's first row in the tensor.
    first: usize,
    rows: usize,
    /// Values a row.
    cols: usize,
    src_ty: weightlift_kernels::FloatType,
}

/// The rows of source bytes `at..at + len` of `info` quantised to `to`, or an error when the
/// conversion is not allowed or the chunk is not whole rows.
fn chunk_rows(info: &TensorInfo, to: DType, at: u64, len: usize) -> Result<ChunkRows> {
    check(info, to)?;
    let row_in = source_row_bytes(info) as usize;
    if !len.is_multiple_of(row_in) || !at.is_multiple_of(row_in as u64) {
        return Err(crate::error::invalid(
            format!("quantising tensor '{}'", info.name),
            format!("whole rows of {row_in} bytes"),
            format!("bytes {at}..{}", at + len as u64),
        ));
    }
    let src_ty = match info.dtype {
        DType::F32 => weightlift_kernels::FloatType::F32,
        DType::F16 => weightlift_kernels::FloatType::F16,
        _ => weightlift_kernels::FloatType::BF16,
    };
    Ok(ChunkRows {
        first: usize::try_from(at / row_in as u64).unwrap_or(usize::MAX),
        rows: len / row_in,
        cols: info.shape.last().copied().unwrap_or(0) as usize,
        src_ty,
    })
}

/// The ggml block type `to` names and the bytes of one quantised row of `cols` values.
fn block_rows(
    info: &TensorInfo,
    to: DType,
    cols: usize,
) -> Result<(weightlift_kernels::QuantType, usize)> {
    let Some(qt) = kernel_type(to) else {
        return Err(crate::error::invalid(
            format!("quantising tensor '{}'", info.name),
            "a ggml block type",
            format!("a type the quantisers cannot write: {to}"),
        ));
    };
    let row_out =
        weightlift_kernels::quantized_row_bytes(qt, cols).map_err(quantize_error(info, to))?;
    Ok((qt, row_out))
}

/// How a quantiser's error reads for `info`: the tensor and the type named, the kernels' reason
/// (a non-finite value and its index, a shape) as the detail.
pub fn quantize_error(
    info: &TensorInfo,
    to: DType,
) -> impl Fn(weightlift_kernels::KernelError) -> EngineError + '_ {
    move |e| EngineError::Unsupported {
        what: format!("quantising tensor '{}' to {to}", info.name),
        detail: e.to_string(),
    }
}

/// The environment variable (read once per process) that chooses where quantising loads onto
/// CUDA devices quantise, to measure one path against the other: `host` keeps every type on the host, `device` sends
/// every ggml block type to the device; unset or anything else is the default below.
pub const QUANTIZE_ON_ENV: &str = "WEIGHTLIFT_QUANTIZE_ON";

/// Whether a quantising load of `info` to `to` quantises on its CUDA destination
/// ([`quantize_chunk_on`]). By default the K-quants do: the host runs llama.cpp's reference
/// search at under 1 GB/s of input on two threads (the quantise-on-load bench), so a large
/// checkpoint waits on it. Q8_0 and the legacy types stay on the host, which quantises them at
/// memory speed (17 GB/s for Q8_0 on two threads) and then uploads half the bytes or less of
/// the float rows the device path would. INT8 (its row scales and outlier columns are the
/// host's) never does. [`QUANTIZE_ON_ENV`] overrides the default.
pub fn quantizes_on_device(info: &TensorInfo, to: DType) -> bool {
    if !quantizing(info, to) || to == DType::INT8 {
        return false;
    }
    // read once, as the other switches are: it is asked for every tensor of a load
    static CHOICE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let choice = CHOICE.get_or_init(|| {
        let v = std::env::var(QUANTIZE_ON_ENV).unwrap_or_default();
        v.trim().to_ascii_lowercase()
    });
    match choice.as_str() {
        "host" => false,
        "device" => true,
        _ => matches!(to, DType::Q4_K | DType::Q6_K),
    }
}

/// [`quantize_chunk`] on a device: the chunk's float rows (whole rows, source bytes
/// `at..at + data.len()` of `info`) are quantised by `backend` straight into their blocks of
/// `dst` (the whole held tensor), queued on its stream where it has one. A non-finite value is
/// merged into `found` (8 bytes of `backend`, zeroed before the tensor's first chunk) for
/// [`check_quantized`] to report once the tensor is done; the rows' geometry is
/// [`quantize_chunk`]'s.
pub fn quantize_chunk_on<B: weightlift_kernels::Backend>(
    info: &TensorInfo,
    to: DType,
    at: u64,
    data: &[u8],
    backend: &B,
    dst: &mut B::Buffer,
    found: &mut B::Buffer,
) -> Result<()> {
    let ChunkRows {
        first,
        cols,
        src_ty,
        ..
    } = chunk_rows(info, to, at, data.len())?;
    let (qt, row_out) = block_rows(info, to, cols)?;
    let first_value = first.saturating_mul(cols);
    backend
        .quantize_rows(
            qt,
            src_ty,
            data,
            cols,
            dst,
            first * row_out,
            first_value,
            found,
        )
        .map_err(quantize_error(info, to))
}

/// The error a device quantisation of `info` left in `found` ([`quantize_chunk_on`]): the one
/// [`quantize_chunk`] gives for the tensor's first non-finite value. Waits for the device.
pub fn check_quantized<B: weightlift_kernels::Backend>(
    info: &TensorInfo,
    to: DType,
    backend: &B,
    found: &B::Buffer,
) -> Result<()> {
    backend
        .check_quantized(found)
        .map_err(quantize_error(info, to))
}

/// Source bytes read per quantising step of a shard: a few rows at a time, so a shard needs no
/// float copy of itself beside its quantised destination.
const SHARD_STEP_BYTES: usize = 1 << 20;

/// Quantise one tensor-parallel shard of `info` (stored bytes `bytes`) to `to`: rows
/// `start..end` when `axis` is 0, else columns `start..end` of every row. Each row of a
/// column shard is quantised as blocks of its own, which are the whole row's blocks at those
/// columns because a cut on a block boundary leaves each block's values (and so its scale)
/// unchanged; a cut inside a block is refused. Returns the shard's shape and its bytes, the
/// only buffer the shard's size (the source rows pass through a staging step of about 1 MiB).
pub fn quantize_shard(
    info: &TensorInfo,
    bytes: &[u8],
    axis: u8,
    start: u64,
    end: u64,
    to: DType,
) -> Result<(Vec<u64>, Vec<u8>)> {
    let bad = |expected: String, got: String| {
        crate::error::invalid(
            format!(
                "quantising shard {start}..{end} (axis {axis}) of tensor '{}'",
                info.name
            ),
            expected,
            got,
        )
    };
    let [rows, cols] = *info.shape.as_slice() else {
        return Err(bad("a matrix".into(), format!("shape {:?}", info.shape)));
    };
    let (r0, r1, c0, c1) = if axis == 0 {
        (start.min(rows), end.clamp(start.min(rows), rows), 0, cols)
    } else {
        (0, rows, start.min(cols), end.clamp(start.min(cols), cols))
    };
    if to == DType::INT8 {
        // Its row scales and outlier columns belong to whole rows, not to a shard's columns.
        return Err(bad("a ggml block type".into(), to.to_string()));
    }
    let block = to.block_size().max(1);
    if !c0.is_multiple_of(block) {
        return Err(bad(
            format!("columns starting on a {block}-value block of {to}"),
            format!("columns {c0}..{c1}"),
        ));
    }
    let shard = TensorInfo {
        shape: vec![r1 - r0, c1 - c0],
        nbytes: info.dtype.bytes_for((r1 - r0) * (c1 - c0)).unwrap_or(0),
        ..info.clone()
    };
    // Refuses ragged shards (a column range that is not whole blocks) before any work.
    check(&shard, to)?;
    let elem = info.dtype.bytes_for(1).unwrap_or(1) as usize;
    let row_in = cols as usize * elem;
    let (span0, span1) = (c0 as usize * elem, c1 as usize * elem);
    let shard_row = span1 - span0;
    let held = to.bytes_for_shape(&shard.shape).ok_or_else(|| {
        bad(
            format!("a shard {to} can hold"),
            format!("{:?}", shard.shape),
        )
    })?;
    if bytes.len() < rows as usize * row_in {
        return Err(bad(
            format!("{} stored bytes", rows as usize * row_in),
            bytes.len().to_string(),
        ));
    }
    let mut out = vec![0u8; held as usize];
    let step = (SHARD_STEP_BYTES / shard_row.max(1)).max(1);
    let mut src = Vec::with_capacity(step.min((r1 - r0) as usize) * shard_row);
    let mut scratch = Vec::new();
    let mut r = r0 as usize;
    while r < r1 as usize {
        let n = step.min(r1 as usize - r);
        src.clear();
        for row in r..r + n {
            src.extend_from_slice(&bytes[row * row_in + span0..row * row_in + span1]);
        }
        let at = ((r - r0 as usize) * shard_row) as u64;
        quantize_chunk(&shard, to, at, &src, &mut scratch, &mut |o, q| {
            out[o..o + q.len()].copy_from_slice(q);
            Ok(())
        })?;
        r += n;
    }
    Ok((shard.shape, out))
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
    dtype == DType::INT8
        || kernel_type(dtype).is_some()
        || weightlift_format::dequant::supports(dtype)
}

/// Dequantise `data`, exactly `out.len()` elements of `dtype`, into `out`. The kernels' SIMD
/// dequantisers (threaded, bit-identical to gguf-py) take every type they implement; the format
/// crate's scalar reference takes the rest. `Checkpoint.dequantize` and
/// `Model.tensor(dequantize=True)` both come here, so a tensor reads the same either way.
pub fn dequantize_into(dtype: DType, data: &[u8], out: &mut [f32]) -> Result<(), FormatError> {
    if dtype == DType::INT8 {
        return int8_dequantize_into(data, out);
    }
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

/// `1/127` as bitsandbytes' `int8_vectorwise_dequant` writes it (the same f32 the int8
/// matmul's outlier columns use, so a dequantised weight equals the one the forward pass saw).
const INT8_DEQUANT: f32 = 7.874_016e-3;

/// An INT8 tensor's quants and row scales (see `DType::bytes_for_shape`) back to f32:
/// `q · scale · 1/127`, as bitsandbytes dequantises `CB` with `SCB`.
fn int8_dequantize_into(data: &[u8], out: &mut [f32]) -> Result<(), FormatError> {
    let n = out.len();
    let err = |detail: String| FormatError::DequantizeBlocks {
        dtype: DType::INT8,
        detail,
    };
    let trailer = data.len().checked_sub(n).filter(|t| t % 4 == 0 && *t > 0);
    let Some(rows) = trailer.map(|t| t / 4).filter(|r| n.is_multiple_of(*r)) else {
        return Err(err(format!(
            "expected {n} quants and one 4-byte scale per row after them, got {} bytes",
            data.len()
        )));
    };
    let cols = n / rows;
    let (q, scales) = data.split_at(n);
    for ((y, q), s) in out
        .chunks_exact_mut(cols)
        .zip(q.chunks_exact(cols))
        .zip(scales.chunks_exact(4))
    {
        let s = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        for (y, &q) in y.iter_mut().zip(q) {
            *y = (f32::from(q as i8) * s) * INT8_DEQUANT;
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn info(dtype: DType, shape: &[u64]) -> TensorInfo {
        let n: u64 = shape.iter().product();
        TensorInfo {
            name: "w".into(),
            dtype,
            shape: shape.to_vec(),
            nbytes: dtype.bytes_for(n).unwrap(),
            file: 0,
            offset: 0,
            layer: Some(0),
            role: None,
        }
    }

    /// Quantise `src` (f32 bytes of `info`) in chunks of `rows_per_chunk` rows into one buffer.
    fn in_chunks(info: &TensorInfo, to: DType, src: &[u8], rows_per_chunk: usize) -> Vec<u8> {
        let mut out = vec![0u8; to.bytes_for_shape(&info.shape).unwrap() as usize];
        let step = rows_per_chunk * source_row_bytes(info) as usize;
        let mut scratch = Vec::new();
        for (k, chunk) in src.chunks(step).enumerate() {
            quantize_chunk(
                info,
                to,
                (k * step) as u64,
                chunk,
                &mut scratch,
                &mut |at, b| {
                    out[at..at + b.len()].copy_from_slice(b);
                    Ok(())
                },
            )
            .unwrap();
        }
        out
    }

    #[test]
    fn chunks_of_rows_give_the_whole_tensors_bytes() {
        let (rows, cols) = (6usize, 256usize);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let src: &[u8] = bytemuck::cast_slice(&values);
        let t = info(DType::F32, &[rows as u64, cols as u64]);
        for to in [DType::Q8_0, DType::Q4_K, DType::Q6_K, DType::INT8] {
            let whole = in_chunks(&t, to, src, rows);
            assert_eq!(in_chunks(&t, to, src, 4), whole, "{to}");
            assert_eq!(in_chunks(&t, to, src, 1), whole, "{to}");
            let mut back = vec![0f32; rows * cols];
            dequantize_into(to, &whole, &mut back).unwrap();
            let err = values
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 0.1, "{to}: {err}");
        }
    }

    /// [`in_chunks`] through a backend's `quantize_rows` ([`quantize_chunk_on`], the CUDA
    /// loader's path, here on the CPU backend): the bytes, and the report check's result.
    fn on_backend(
        info: &TensorInfo,
        to: DType,
        src: &[u8],
        rows_per_chunk: usize,
    ) -> (Vec<u8>, Result<()>) {
        use weightlift_kernels::{Backend, CpuBackend};
        let b = CpuBackend::new();
        let mut dst = b
            .alloc(to.bytes_for_shape(&info.shape).unwrap() as usize)
            .unwrap();
        let mut found = b.alloc(8).unwrap();
        let step = rows_per_chunk * source_row_bytes(info) as usize;
        for (k, chunk) in src.chunks(step).enumerate() {
            quantize_chunk_on(info, to, (k * step) as u64, chunk, &b, &mut dst, &mut found)
                .unwrap();
        }
        let checked = check_quantized(info, to, &b, &found);
        (dst.as_bytes().to_vec(), checked)
    }

    #[test]
    fn a_backend_quantises_chunks_into_the_host_quantisers_bytes_and_errors() {
        let (rows, cols) = (7usize, 512usize);
        let mut values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 29) % 113) as f32 / 37.0 - 1.4)
            .collect();
        for dtype in [DType::F32, DType::BF16] {
            let t = info(dtype, &[rows as u64, cols as u64]);
            let src: Vec<u8> = match dtype {
                DType::F32 => bytemuck::cast_slice(&values).to_vec(),
                _ => values
                    .iter()
                    .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
                    .collect(),
            };
            for to in [DType::Q8_0, DType::Q4_K, DType::Q6_K, DType::Q5_1] {
                let host = in_chunks(&t, to, &src, rows);
                for per in [rows, 3, 1] {
                    let (dev, checked) = on_backend(&t, to, &src, per);
                    checked.unwrap();
                    assert!(dev == host, "{to} from {dtype} in chunks of {per} rows");
                }
            }
        }
        // a NaN in the third chunk and an inf in the fifth: both paths name the NaN by its
        // index in the tensor
        values[2 * cols + 300] = f32::NAN;
        values[4 * cols + 7] = f32::INFINITY;
        let t = info(DType::F32, &[rows as u64, cols as u64]);
        let src: &[u8] = bytemuck::cast_slice(&values);
        let (_, checked) = on_backend(&t, DType::Q4_K, src, 1);
        let got = checked.unwrap_err().to_string();
        let mut want = String::new();
        let step = source_row_bytes(&t) as usize;
        for (k, chunk) in src.chunks(step).enumerate() {
            let r = quantize_chunk(
                &t,
                DType::Q4_K,
                (k * step) as u64,
                chunk,
                &mut Vec::new(),
                &mut |_, _| Ok(()),
            );
            if let Err(e) = r {
                want = e.to_string();
                break;
            }
        }
        assert_eq!(got, want);
        let at = 2 * cols + 300;
        assert!(
            got.contains("quantising tensor 'w' to Q4_K")
                && got.contains(&format!("the non-finite source value NaN at index {at}")),
            "{got}"
        );
    }

    #[test]
    fn shards_hold_the_whole_tensors_blocks_and_refuse_cuts_inside_one() {
        let (rows, cols) = (5usize, 512usize);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 53) % 97) as f32 / 40.0 - 1.2)
            .collect();
        let src: &[u8] = bytemuck::cast_slice(&values);
        let t = info(DType::F32, &[rows as u64, cols as u64]);
        for to in [DType::Q8_0, DType::Q4_K, DType::Q6_K] {
            let whole = in_chunks(&t, to, src, rows);
            let row_out = whole.len() / rows;
            let (shape, top) = quantize_shard(&t, src, 0, 1, 4, to).unwrap();
            assert_eq!(shape, vec![3, 512]);
            assert_eq!(top, whole[row_out..4 * row_out], "{to} rows");
            let per_block = to.type_size() as usize;
            let (shape, right) = quantize_shard(&t, src, 1, 256, 512, to).unwrap();
            assert_eq!(shape, vec![5, 256]);
            let blocks = 256 / to.block_size() as usize;
            let want: Vec<u8> = whole
                .chunks(row_out)
                .flat_map(|r| r[row_out - blocks * per_block..].to_vec())
                .collect();
            assert_eq!(right, want, "{to} columns");
        }
        let e = quantize_shard(&t, src, 1, 128, 512, DType::Q4_K)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("256-value block of Q4_K") && e.contains("128..512"),
            "{e}"
        );
        let e = quantize_shard(&t, src, 1, 0, 128, DType::Q6_K)
            .unwrap_err()
            .to_string();
        assert!(e.contains("whole 256-value blocks"), "{e}");
    }

    #[test]
    fn ragged_chunks_and_shapes_are_refused() {
        let t = info(DType::F32, &[4, 256]);
        let e = quantize_chunk(
            &t,
            DType::Q8_0,
            0,
            &[0u8; 100],
            &mut Vec::new(),
            &mut |_, _| Ok(()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("whole rows of 1024 bytes"), "{e}");
        let odd = info(DType::F16, &[4, 48]);
        let e = check(&odd, DType::Q4_K).unwrap_err().to_string();
        assert!(
            e.contains("whole 256-value blocks") && e.contains("[4, 48]"),
            "{e}"
        );
        let e = check(&info(DType::Q4_0, &[4, 256]), DType::Q8_0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("quantised types stay quantised"), "{e}");
        let e = dequantize_into(DType::INT8, &[0u8; 10], &mut [0f32; 8])
            .unwrap_err()
            .to_string();
        assert!(e.contains("one 4-byte scale per row"), "{e}");
    }
}

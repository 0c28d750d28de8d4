//! Reading a loaded model's tensors back: where each is held, its bytes (split tensors
//! reassembled, CUDA memory copied back) and its values dequantised in bounded chunks.

use weightlift_format::{DType, TensorInfo};

use super::{Model, SplitSpec};
use crate::dequantize::zeroed_f32;
use crate::device::DeviceTensor;
use crate::error::{Result, invalid};

/// One loaded tensor.
#[derive(Debug)]
pub enum Held {
    Whole {
        tensor: DeviceTensor,
        device: String,
    },
    /// Parts in shard order, with the spec they follow.
    Split {
        parts: Vec<DeviceTensor>,
        spec: SplitSpec,
    },
}

impl Model {
    pub fn held(&self, name: &str) -> Result<&Held> {
        let i = self.index(name)?;
        Ok(&self.state()?.held[i])
    }

    /// The checkpoint's entry for a tensor.
    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        Ok(&self.source.tensors()[self.index(name)?])
    }

    /// The dtype a loaded tensor is held in and its bytes there (a split tensor's bytes are
    /// those of one copy: its shards together, or one replica).
    pub fn held_type(&self, name: &str) -> Result<(DType, u64)> {
        let info = self.tensor_info(name)?;
        Ok(match self.held(name)? {
            Held::Whole { tensor, .. } => (tensor.dtype(), tensor.nbytes()),
            held @ Held::Split { .. } => held_split_type(info, held),
        })
    }

    /// The device a tensor was placed on (`"tp"` joins the devices of a split tensor).
    pub fn device_of(&self, name: &str) -> Result<String> {
        Ok(match self.held(name)? {
            Held::Whole { device, .. } => device.clone(),
            Held::Split { parts, .. } => parts
                .iter()
                .map(|t| t.device().name())
                .collect::<Vec<_>>()
                .join(","),
        })
    }

    pub fn layer_devices(&self) -> Result<&[String]> {
        Ok(&self.state()?.layer_devices)
    }

    /// The tensor's stored bytes, copied from wherever they live (split tensors are
    /// reassembled, CUDA memory is copied back), with its dtype and shape.
    pub fn tensor_bytes(&self, name: &str) -> Result<(Vec<u8>, DType, Vec<u64>)> {
        let i = self.index(name)?;
        let info = &self.source.tensors()[i];
        match &self.state()?.held[i] {
            Held::Whole { tensor, .. } => {
                Ok((tensor.to_host()?, tensor.dtype(), tensor.shape().to_vec()))
            }
            held @ Held::Split { .. } => {
                let (dtype, nbytes) = held_split_type(info, held);
                let mut out = vec![0u8; nbytes as usize];
                read_held(info, held, 0, &mut out)?;
                Ok((out, dtype, info.shape.clone()))
            }
        }
    }

    /// The tensor dequantised (or converted) to f32 from the bytes on its device, at most
    /// `max_dq_size` values at a time (exllamav2's chunk limit; rounded down to whole blocks,
    /// at least one block). Host-resident tensors are decoded straight from their memory; the
    /// rest (CUDA memory, split tensors) go through one transient host buffer of at most one
    /// chunk's bytes. The output itself is the only allocation the size of the tensor.
    pub fn dequantized(&self, name: &str, max_dq_size: u64) -> Result<Dequantized> {
        let i = self.index(name)?;
        let info = &self.source.tensors()[i];
        let held = &self.state()?.held[i];
        let (dtype, shape) = match held {
            Held::Whole { tensor, .. } => (tensor.dtype(), tensor.shape().to_vec()),
            Held::Split { .. } => (held_split_type(info, held).0, info.shape.clone()),
        };
        let n: u64 = shape.iter().product();
        if dtype == DType::INT8 {
            // Its row scales follow every quant, so it decodes as one buffer.
            let bytes;
            let data = match held {
                Held::Whole { tensor, .. } => match tensor.host_bytes() {
                    Some(h) => h,
                    None => {
                        bytes = tensor.to_host()?;
                        &bytes[..]
                    }
                },
                Held::Split { .. } => {
                    return Err(invalid(
                        format!("dequantising tensor '{name}'"),
                        "a whole INT8 tensor",
                        "a split one",
                    ));
                }
            };
            let mut values = zeroed_f32(usize::try_from(n).unwrap_or(usize::MAX));
            crate::convert::dequantize_into(dtype, data, &mut values)?;
            return Ok(Dequantized {
                values,
                shape,
                chunks: 1,
                transient_bytes: if tensor_on_host(held) {
                    0
                } else {
                    data.len() as u64
                },
            });
        }
        let bs = dtype.block_size().max(1);
        let per = (max_dq_size / bs).max(1) * bs;
        let bytes_of = |e: u64| {
            dtype.bytes_for(e).ok_or_else(|| {
                invalid(
                    format!("dequantising tensor '{name}'"),
                    format!("whole {bs}-element blocks of {dtype}"),
                    format!("{e} elements"),
                )
            })
        };
        let host = match held {
            Held::Whole { tensor, .. } => tensor.host_bytes(),
            Held::Split { .. } => None,
        };
        let mut values = zeroed_f32(usize::try_from(n).unwrap_or(usize::MAX));
        let mut transient: Vec<u8> = Vec::new();
        let mut chunks = 0usize;
        let mut e0 = 0u64;
        while e0 < n {
            let m = per.min(n - e0);
            let (b0, blen) = (bytes_of(e0)? as usize, bytes_of(m)? as usize);
            let data: &[u8] = match host {
                Some(h) => h.get(b0..b0 + blen).ok_or_else(|| {
                    invalid(
                        format!("tensor '{name}'"),
                        format!("{} bytes", b0 + blen),
                        h.len(),
                    )
                })?,
                None => {
                    transient.reserve_exact(blen.saturating_sub(transient.len()));
                    transient.resize(blen, 0);
                    read_held(info, held, b0 as u64, &mut transient[..blen])?;
                    &transient[..blen]
                }
            };
            let out = &mut values[e0 as usize..(e0 + m) as usize];
            crate::convert::dequantize_into(dtype, data, out)?;
            chunks += 1;
            e0 += m;
        }
        Ok(Dequantized {
            values,
            shape,
            chunks,
            transient_bytes: transient.capacity() as u64,
        })
    }
}

/// Bytes `offset..offset + dst.len()` of a held tensor as the checkpoint lays it out: split
/// parts are reassembled (row splits concatenate, column splits interleave per row).
fn read_held(info: &TensorInfo, held: &Held, offset: u64, dst: &mut [u8]) -> Result<()> {
    let (parts, spec) = match held {
        Held::Whole { tensor, .. } => return tensor.read(offset, dst),
        Held::Split { parts, spec } => (parts, spec),
    };
    let want = dst.len();
    let short = |filled: usize| {
        invalid(
            format!("reading split tensor '{}'", info.name),
            format!("{want} bytes at {offset}"),
            format!("{filled} bytes in its parts"),
        )
    };
    if spec.replicated {
        return parts.first().ok_or_else(|| short(0))?.read(offset, dst);
    }
    let mut filled = 0usize;
    let mut off = offset;
    if spec.axis == 0 || info.shape.len() == 1 {
        let mut base = 0u64;
        for t in parts {
            let n = t.nbytes();
            if filled < want && off >= base && off < base + n {
                let take = ((base + n - off) as usize).min(want - filled);
                t.read(off - base, &mut dst[filled..filled + take])?;
                filled += take;
                off += take as u64;
            }
            base += n;
        }
    } else {
        let rows = info.shape.first().copied().unwrap_or(1).max(1);
        let widths: Vec<u64> = parts.iter().map(|t| t.nbytes() / rows).collect();
        let row_bytes: u64 = widths.iter().sum();
        while filled < want && row_bytes > 0 {
            let (r, mut c) = (off / row_bytes, off % row_bytes);
            let mut p = 0;
            while p < widths.len() && c >= widths[p] {
                c -= widths[p];
                p += 1;
            }
            let Some(t) = parts.get(p) else { break };
            let take = ((widths[p] - c) as usize).min(want - filled);
            t.read(r * widths[p] + c, &mut dst[filled..filled + take])?;
            filled += take;
            off += take as u64;
        }
    }
    if filled != want {
        return Err(short(filled));
    }
    Ok(())
}

/// The type a split tensor's parts hold and the bytes of one whole copy of it: the stored
/// type and size, or the type its shards were quantised to and their sum.
fn held_split_type(info: &TensorInfo, held: &Held) -> (DType, u64) {
    match held {
        Held::Split { parts, spec } => {
            let dtype = parts.first().map_or(info.dtype, DeviceTensor::dtype);
            let nbytes = if spec.replicated {
                parts.first().map_or(info.nbytes, DeviceTensor::nbytes)
            } else {
                parts.iter().map(DeviceTensor::nbytes).sum()
            };
            (dtype, nbytes)
        }
        Held::Whole { tensor, .. } => (tensor.dtype(), tensor.nbytes()),
    }
}

/// A tensor dequantised to f32 by [`Model::dequantized`].
#[derive(Debug)]
pub struct Dequantized {
    pub values: Vec<f32>,
    pub shape: Vec<u64>,
    /// How many chunks of at most `max_dq_size` values it took.
    pub chunks: usize,
    /// Bytes of the transient host buffer used (0 when decoded straight from host memory).
    pub transient_bytes: u64,
}

/// Whether a held tensor's bytes are host memory (read in place).
fn tensor_on_host(held: &Held) -> bool {
    matches!(held, Held::Whole { tensor, .. } if tensor.host_bytes().is_some())
}

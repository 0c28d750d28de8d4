//! [`DeviceTensor`]: a tensor's shape and dtype over its [`Storage`], owned memory on a device
//! or a zero-copy view of the mapped checkpoint.

use std::sync::Arc;

use weightlift_format::DType;

use super::{Buffer, Device, pace_link};
use crate::error::{Result, invalid};
use crate::source::Source;

/// Where a tensor's bytes live.
pub enum Storage {
    /// Owned memory on a device.
    Owned(Buffer),
    /// A zero-copy view of tensor `index` of a memory-mapped checkpoint (page cache, not
    /// anonymous memory). Only on `cpu`.
    Mapped {
        source: Arc<dyn Source>,
        index: usize,
    },
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Storage::Owned(b) => write!(f, "Owned({} bytes on {})", b.len(), b.device().name()),
            Storage::Mapped { index, .. } => write!(f, "Mapped(tensor {index})"),
        }
    }
}

/// A tensor held on a device.
#[derive(Debug)]
pub struct DeviceTensor {
    device: Arc<Device>,
    shape: Vec<u64>,
    dtype: DType,
    storage: Storage,
}

impl DeviceTensor {
    /// Wrap storage; the storage length must equal what `dtype` × `shape` needs.
    pub fn new(
        device: Arc<Device>,
        shape: Vec<u64>,
        dtype: DType,
        storage: Storage,
    ) -> Result<Self> {
        let n: u64 = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| {
                invalid(
                    "tensor shape",
                    "a product that fits in u64",
                    format!("{shape:?}"),
                )
            })?;
        let need = dtype.bytes_for_shape(&shape).ok_or_else(|| {
            invalid(
                format!("tensor of {dtype}"),
                format!("a whole number of {}-element blocks", dtype.block_size()),
                format!("{n} elements"),
            )
        })?;
        let t = DeviceTensor {
            device,
            shape,
            dtype,
            storage,
        };
        let have = t.nbytes();
        if have != need {
            return Err(invalid(
                "tensor storage",
                format!("{need} bytes"),
                format!("{have} bytes"),
            ));
        }
        Ok(t)
    }

    /// Copy host bytes onto `device` (counted against its capacity).
    pub fn from_host(
        device: &Arc<Device>,
        shape: Vec<u64>,
        dtype: DType,
        bytes: &[u8],
    ) -> Result<Self> {
        let mut buf = device.alloc(bytes.len() as u64)?;
        buf.write(0, bytes)?;
        DeviceTensor::new(Arc::clone(device), shape, dtype, Storage::Owned(buf))
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// The stored bytes where they are host-addressable (`cpu`, `virtual`, mmap views);
    /// `None` for CUDA memory (use [`DeviceTensor::read`] or [`DeviceTensor::to_host`]).
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match &self.storage {
            Storage::Owned(b) => b.host(),
            Storage::Mapped { source, index } => Some(source.bytes(*index)),
        }
    }

    /// Bytes counted against the device (anonymous memory for owned storage, page cache for
    /// mapped views).
    pub fn nbytes(&self) -> u64 {
        match &self.storage {
            Storage::Owned(b) => b.len() as u64,
            Storage::Mapped { source, index } => source.bytes(*index).len() as u64,
        }
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }

    /// Copy `dst.len()` stored bytes starting at byte `offset` to the host.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        match &self.storage {
            Storage::Owned(b) => {
                let offset = usize::try_from(offset).unwrap_or(usize::MAX);
                b.read(offset, dst)
            }
            Storage::Mapped { source, index } => {
                let bytes = source.bytes(*index);
                let got = usize::try_from(offset)
                    .ok()
                    .and_then(|o| bytes.get(o..o.checked_add(dst.len())?));
                let src = got.ok_or_else(|| {
                    invalid(
                        "tensor read",
                        format!("a range inside {} bytes", bytes.len()),
                        format!("{} bytes at {offset}", dst.len()),
                    )
                })?;
                dst.copy_from_slice(src);
                Ok(())
            }
        }
    }

    /// A host copy of the bytes (from device memory on CUDA).
    pub fn to_host(&self) -> Result<Vec<u8>> {
        match self.host_bytes() {
            Some(b) => Ok(b.to_vec()),
            None => match &self.storage {
                Storage::Owned(b) => b.to_vec(),
                Storage::Mapped { .. } => Ok(Vec::new()),
            },
        }
    }

    /// A copy of this tensor on `device` (a real copy between separate allocations; to or from
    /// CUDA it is staged through host memory).
    pub fn copy_to(&self, device: &Arc<Device>) -> Result<DeviceTensor> {
        let since = std::time::Instant::now();
        let storage = match &self.storage {
            Storage::Owned(b) => {
                let mut dst = device.alloc(b.len() as u64)?;
                b.copy_into(&mut dst)?;
                dst
            }
            Storage::Mapped { source, index } => {
                let bytes = source.bytes(*index);
                let mut dst = device.alloc(bytes.len() as u64)?;
                dst.write(0, bytes)?;
                dst
            }
        };
        pace_link(&self.device, device, self.nbytes(), since);
        DeviceTensor::new(
            Arc::clone(device),
            self.shape.clone(),
            self.dtype,
            Storage::Owned(storage),
        )
    }

    /// The first NaN/Inf element and its kind, scanned where the tensor lives (the kernels'
    /// scan on CUDA).
    pub fn find_non_finite(&self) -> Result<Option<(u64, &'static str)>> {
        match &self.storage {
            Storage::Owned(b) => b.find_non_finite(self.dtype),
            Storage::Mapped { source, index } => Ok(weightlift_format::scan::find_non_finite(
                self.dtype,
                source.bytes(*index),
            )
            .map(|n| (n.index, n.kind))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Inventory;

    #[test]
    fn copies_between_virtual_devices_are_separate() {
        let inv = Inventory::parse("virtual:2x1MiB").unwrap();
        let [a, b] = inv.accelerators() else {
            panic!("two devices")
        };
        let t = DeviceTensor::from_host(a, vec![4], DType::F32, &[1u8; 16]).unwrap();
        let u = t.copy_to(b).unwrap();
        assert_ne!(
            t.host_bytes().unwrap().as_ptr(),
            u.host_bytes().unwrap().as_ptr()
        );
        assert_eq!(t.to_host().unwrap(), u.to_host().unwrap());
        assert_eq!((a.used(), b.used()), (16, 16));
        drop((t, u));
        assert_eq!((a.used(), b.used()), (0, 0));
    }
}

//! [`Buffer`]: bytes held on one device and counted against it until dropped, and the copies
//! between host memory, virtual arenas and CUDA memory.

use std::sync::Arc;

use weightlift_format::DType;
use weightlift_kernels::{Backend, CudaBuffer};

use super::Device;
use crate::error::{Result, invalid};
use crate::hostmem::AlignedBuf;

impl Device {
    /// Allocate `bytes` zeroed bytes on this device (host memory, or device memory through the
    /// kernels' CUDA backend).
    pub fn alloc(self: &Arc<Self>, bytes: u64) -> Result<Buffer> {
        self.alloc_with(bytes, true)
    }

    /// As [`Device::alloc`], but host memory is not advised as a huge-page candidate: for a
    /// buffer the loader fills at once (`pread` from the file, or copies out of staging). With
    /// THP `defrag=madvise` advised faults compact synchronously and stall (2.38 GB read into
    /// cpu buffers: 0.6 to 5.5 s advised, a steady 1.1 s not).
    pub(crate) fn alloc_for_read(self: &Arc<Self>, bytes: u64) -> Result<Buffer> {
        self.alloc_with(bytes, false)
    }

    fn alloc_with(self: &Arc<Self>, bytes: u64, huge: bool) -> Result<Buffer> {
        self.reserve(bytes)?;
        let mem = match self.alloc_mem(bytes, huge) {
            Ok(m) => m,
            Err(e) => {
                self.release(bytes);
                return Err(e);
            }
        };
        Ok(Buffer {
            device: Arc::clone(self),
            mem,
            len: bytes as usize,
        })
    }

    fn alloc_mem(&self, bytes: u64, huge: bool) -> Result<Mem> {
        let Ok(len) = usize::try_from(bytes) else {
            return Err(self.oom(bytes, self.used()));
        };
        match &self.cuda {
            None => AlignedBuf::zeroed_with(len, huge)
                .map(Mem::Host)
                .ok_or_else(|| self.oom(bytes, self.used().saturating_sub(bytes))),
            Some(b) => match b.alloc(len) {
                Ok(m) => Ok(Mem::Cuda(m)),
                Err(weightlift_kernels::KernelError::OutOfMemory { .. }) => {
                    Err(self.oom(bytes, self.used().saturating_sub(bytes)))
                }
                Err(e) => Err(self.kernel_err(&format!("allocating {bytes} bytes"), e)),
            },
        }
    }
}

/// The window [`Buffer::fill`] hands over at a time on host memory: the size of a CUDA
/// backend's pinned staging buffer, so a load fills in the same pieces on either.
const HOST_FILL_WINDOW: usize = 16 << 20;

/// The memory behind a [`Buffer`].
enum Mem {
    /// `cpu` and `virtual` devices: host memory.
    Host(AlignedBuf),
    /// `cuda:N`: device memory of the kernels' backend.
    Cuda(CudaBuffer),
}

impl std::fmt::Debug for Mem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mem::Host(b) => write!(f, "Host({} bytes)", b.len()),
            Mem::Cuda(_) => write!(f, "Cuda"),
        }
    }
}

/// Bytes per step when a copy between a CUDA device and another device bounces through host
/// memory (peer copies are a later step).
pub const BOUNCE_BYTES: usize = 16 << 20;

/// Memory held on one device. Dropping it returns the bytes to the device.
#[derive(Debug)]
pub struct Buffer {
    device: Arc<Device>,
    mem: Mem,
    len: usize,
}

impl Buffer {
    /// A zero-byte host buffer on a device of its own (a placeholder for a moved-out buffer).
    pub(crate) fn empty() -> Buffer {
        Buffer {
            device: Device::cpu(Some(0)),
            mem: Mem::Host(AlignedBuf::empty()),
            len: 0,
        }
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, where they are host memory (`cpu` and `virtual`); `None` on CUDA.
    pub fn host(&self) -> Option<&[u8]> {
        match &self.mem {
            Mem::Host(b) => Some(b.as_slice()),
            Mem::Cuda(_) => None,
        }
    }

    /// The bytes, mutably, where they are host memory; `None` on CUDA.
    pub fn host_mut(&mut self) -> Option<&mut [u8]> {
        match &mut self.mem {
            Mem::Host(b) => Some(b.as_mut_slice()),
            Mem::Cuda(_) => None,
        }
    }

    /// The kernels' CUDA buffer behind this one, where it is device memory (the forward pass
    /// computes on it through the CUDA backend); `None` for host memory.
    pub(crate) fn cuda(&self) -> Option<&CudaBuffer> {
        match &self.mem {
            Mem::Cuda(b) => Some(b),
            Mem::Host(_) => None,
        }
    }

    /// As [`Buffer::cuda`], mutably.
    pub(crate) fn cuda_mut(&mut self) -> Option<&mut CudaBuffer> {
        match &mut self.mem {
            Mem::Cuda(b) => Some(b),
            Mem::Host(_) => None,
        }
    }

    /// Fault in host memory now, over up to `threads` threads (see `AlignedBuf::populate`), so
    /// that filling it afterwards costs a copy, not a page fault per 4 KiB. Nothing on CUDA.
    pub(crate) fn populate(&mut self, threads: usize) {
        if let Mem::Host(b) = &mut self.mem {
            b.populate(threads);
        }
    }

    fn range(&self, what: &str, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(invalid(
                format!("{what} on {}", self.device.name()),
                format!("a range inside {} bytes", self.len),
                format!("{n} bytes at {offset}"),
            )),
        }
    }

    /// Copy `src` into the buffer at `offset`. On CUDA this goes through the backend's pinned
    /// staging buffers and returns once the copy is queued on its stream (a later read, or
    /// [`Device::synchronize`], waits for it); `src` may be reused at once.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.range("write", offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        match &mut self.mem {
            Mem::Host(b) => {
                b.as_mut_slice()[offset..offset + src.len()].copy_from_slice(src);
                Ok(())
            }
            Mem::Cuda(m) => {
                let dev = &self.device;
                dev.backend()?
                    .copy_from_host(src, m, offset)
                    .map_err(|e| dev.kernel_err("copying to the device", e))
            }
        }
    }

    /// Fill `len` bytes from `offset` window by window, `fill(at, window)` writing bytes
    /// `at..at + window.len()` of the range: in place on host memory, and on CUDA straight into
    /// the backend's pinned staging buffers, each window's copy to the device queued on its
    /// stream while the next window is filled (so a file read into the window is the one host
    /// copy). Returns once the last copy is queued, as [`Buffer::write`] does; an error of
    /// `fill` ends the fill and is returned as it is.
    pub fn fill(
        &mut self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(usize, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.range("fill", offset, len)?;
        match &mut self.mem {
            Mem::Host(b) => {
                let range = &mut b.as_mut_slice()[offset..offset + len];
                for (k, window) in range.chunks_mut(HOST_FILL_WINDOW).enumerate() {
                    fill(k * HOST_FILL_WINDOW, window)?;
                }
                Ok(())
            }
            Mem::Cuda(m) => {
                let dev = &self.device;
                dev.backend()?
                    .upload_filled(m, offset, len, fill)
                    .map_err(|e| dev.kernel_err("copying to the device", e))?
            }
        }
    }

    /// Copy `dst.len()` bytes starting at `offset` into host memory `dst` (blocks until done).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.range("read", offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        match &self.mem {
            Mem::Host(b) => {
                dst.copy_from_slice(&b.as_slice()[offset..offset + dst.len()]);
                Ok(())
            }
            Mem::Cuda(m) => {
                let dev = &self.device;
                dev.backend()?
                    .copy_to_host(m, offset, dst)
                    .map_err(|e| dev.kernel_err("copying to the host", e))
            }
        }
    }

    /// A host copy of every byte.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        if let Some(h) = self.host() {
            return Ok(h.to_vec());
        }
        let mut v = vec![0u8; self.len];
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// Copy the first `dst.len()` bytes of `self` into `dst`: a memcpy between host memories,
    /// a copy on one CUDA device, or otherwise bounced through host memory [`BOUNCE_BYTES`] at
    /// a time.
    pub fn copy_into(&self, dst: &mut Buffer) -> Result<()> {
        let len = dst.len;
        if self.len < len {
            return Err(invalid(
                format!("copy from {} to {}", self.device.name(), dst.device.name()),
                format!("a source of at least {len} bytes"),
                self.len,
            ));
        }
        if let (Some(s), Some(d)) = (self.host(), dst.host_mut()) {
            d.copy_from_slice(&s[..len]);
            return Ok(());
        }
        if let (Mem::Cuda(s), Mem::Cuda(d)) = (&self.mem, &mut dst.mem)
            && Arc::ptr_eq(&self.device, &dst.device)
        {
            let dev = &self.device;
            return dev
                .backend()?
                .copy(s, 0, d, 0, len)
                .map_err(|e| dev.kernel_err("copying on the device", e));
        }
        if let Some(s) = self.host() {
            return dst.write(0, &s[..len]);
        }
        if let Some(d) = dst.host_mut() {
            return self.read(0, d);
        }
        let mut bounce = vec![0u8; BOUNCE_BYTES.min(len)];
        let mut at = 0;
        while at < len {
            let n = BOUNCE_BYTES.min(len - at);
            self.read(at, &mut bounce[..n])?;
            dst.write(at, &bounce[..n])?;
            at += n;
        }
        Ok(())
    }

    /// The index of the first NaN/Inf value (kernels' scan: on the GPU for CUDA buffers).
    pub(super) fn find_non_finite(&self, dtype: DType) -> Result<Option<(u64, &'static str)>> {
        match &self.mem {
            Mem::Host(b) => Ok(
                weightlift_format::scan::find_non_finite(dtype, b.as_slice())
                    .map(|n| (n.index, n.kind)),
            ),
            Mem::Cuda(m) => {
                let dev = &self.device;
                let block_bytes = dtype.type_size().max(1) as usize;
                let block_values = dtype.block_size().max(1);
                let host_scan = |data: &[u8]| {
                    weightlift_format::scan::find_non_finite(dtype, data).map(|n| (n.index, n.kind))
                };
                let Some(ty) = weightlift_kernels::QuantType::from_name(dtype.name()) else {
                    // A type the kernels have no scan for: scan on the host, a bounded chunk of
                    // whole blocks at a time.
                    let step = (BOUNCE_BYTES / block_bytes).max(1) * block_bytes;
                    let mut chunk = vec![0u8; step.min(self.len)];
                    let mut at = 0;
                    while at < self.len {
                        let n = step.min(self.len - at);
                        self.read(at, &mut chunk[..n])?;
                        if let Some((i, kind)) = host_scan(&chunk[..n]) {
                            return Ok(Some(((at / block_bytes) as u64 * block_values + i, kind)));
                        }
                        at += n;
                    }
                    return Ok(None);
                };
                let hit = dev
                    .backend()?
                    .scan_non_finite(ty, m, self.len)
                    .map_err(|e| dev.kernel_err("scanning for non-finite values", e))?;
                let Some(i) = hit else { return Ok(None) };
                // Name the kind by scanning the one block that holds the hit on the host.
                let i = i as u64;
                let at = (i / block_values) as usize * block_bytes;
                let mut block = vec![0u8; block_bytes.min(self.len.saturating_sub(at))];
                self.read(at, &mut block)?;
                let kind = host_scan(&block).map_or("nan or inf", |(_, kind)| kind);
                Ok(Some((i, kind)))
            }
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.device.release(self.len as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_name_the_kernels_scan_types() {
        use weightlift_kernels::QuantType as Q;
        for (d, q) in [
            (DType::F32, Q::F32),
            (DType::F16, Q::F16),
            (DType::BF16, Q::BF16),
            (DType::Q4_1, Q::Q4_1),
            (DType::Q8_0, Q::Q8_0),
            (DType::Q4_K, Q::Q4_K),
            (DType::Q6_K, Q::Q6_K),
        ] {
            assert_eq!(Q::from_name(d.name()), Some(q), "{d}");
        }
    }
}

//! Devices and the memory they hold.
//!
//! - `cpu`: host RAM. Optionally capped; every owned allocation is counted.
//! - `virtual:N`: a simulated accelerator, a host-memory arena with a hard capacity. An allocation
//!   past the capacity fails with [`EngineError::OutOfMemory`], as a GPU would, and copies to,
//!   from and between virtual devices are real copies between separate allocations.
//! - `cuda:N`: an NVIDIA GPU through the kernels crate. In a build or on a machine without CUDA,
//!   creating one fails with [`EngineError::CudaUnavailable`].
//!
//! Accounting is of bytes actually held: a [`Buffer`] counts against its device from allocation
//! until it is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use weightlift_format::DType;
use weightlift_kernels::{Backend, CudaBackend, CudaBuffer};
use weightlift_plan::MemoryProbe;

use crate::error::{EngineError, Result, invalid};
use crate::hostmem::AlignedBuf;
use crate::source::Source;

/// What a device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Cpu,
    Virtual,
    Cuda,
}

/// One device of the runtime. Shared as `Arc<Device>`; buffers keep their device alive.
#[derive(Debug)]
pub struct Device {
    name: String,
    kind: DeviceKind,
    ordinal: u32,
    /// Hard capacity in bytes (`None`: unbounded, the default for `cpu`).
    capacity: Option<u64>,
    used: AtomicU64,
    peak: AtomicU64,
    /// A simulated link to the host in bytes/s (virtual devices only, `virtual:8GiB@16GB/s`).
    bandwidth: Option<u64>,
    /// The kernels' CUDA backend of a `cuda:N` device (its context, stream and pinned staging).
    cuda: Option<CudaBackend>,
}

impl Device {
    /// The host device, optionally capped at `capacity` bytes.
    pub fn cpu(capacity: Option<u64>) -> Arc<Device> {
        Arc::new(Device::new("cpu".into(), DeviceKind::Cpu, 0, capacity))
    }

    /// A virtual accelerator `virtual:N` with a hard `capacity`.
    pub fn virtual_device(ordinal: u32, capacity: u64) -> Arc<Device> {
        Arc::new(Device::new(
            format!("virtual:{ordinal}"),
            DeviceKind::Virtual,
            ordinal,
            Some(capacity),
        ))
    }

    /// A virtual accelerator whose copies to and from the host take `bytes_per_second`, as over
    /// a PCIe link, so offload and prefetch can be measured where there is no GPU.
    pub fn virtual_with_link(ordinal: u32, capacity: u64, bytes_per_second: u64) -> Arc<Device> {
        let mut d = Device::new(
            format!("virtual:{ordinal}"),
            DeviceKind::Virtual,
            ordinal,
            Some(capacity),
        );
        d.bandwidth = Some(bytes_per_second.max(1));
        Arc::new(d)
    }

    /// The simulated link rate in bytes/s, if this device has one.
    pub fn bandwidth(&self) -> Option<u64> {
        self.bandwidth
    }

    /// `cuda:N`, through the kernels crate's CUDA backend: device memory per tensor, the
    /// backend's two pinned staging buffers for copies from the host, and its stream. The
    /// capacity is `capacity`, or the free memory the driver reports now. Without a
    /// GPU, libcuda or the `cuda` feature this fails with [`EngineError::CudaUnavailable`]
    /// carrying the backend's reason.
    pub fn cuda(ordinal: u32, capacity: Option<u64>) -> Result<Arc<Device>> {
        let name = format!("cuda:{ordinal}");
        let unavailable = |e: weightlift_kernels::KernelError| EngineError::CudaUnavailable {
            device: name.clone(),
            detail: e.to_string(),
        };
        let backend = CudaBackend::new(ordinal as usize).map_err(unavailable)?;
        let capacity = match capacity {
            Some(c) => c,
            None => cuda_free(&backend).map_err(|e| EngineError::Device {
                device: name.clone(),
                detail: format!("reading free memory from the driver: {e}"),
            })?,
        };
        let mut d = Device::new(name, DeviceKind::Cuda, ordinal, Some(capacity));
        d.cuda = Some(backend);
        Ok(Arc::new(d))
    }

    fn new(name: String, kind: DeviceKind, ordinal: u32, capacity: Option<u64>) -> Device {
        Device {
            name,
            kind,
            ordinal,
            capacity,
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            bandwidth: None,
            cuda: None,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn kind(&self) -> DeviceKind {
        self.kind
    }

    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// Whether buffers on this device are host memory (`cpu`, `virtual`).
    pub fn is_host(&self) -> bool {
        self.kind != DeviceKind::Cuda
    }

    /// The CUDA backend of a `cuda:N` device.
    pub fn cuda_backend(&self) -> Option<&CudaBackend> {
        self.cuda.as_ref()
    }

    fn backend(&self) -> Result<&CudaBackend> {
        self.cuda.as_ref().ok_or_else(|| EngineError::Device {
            device: self.name.clone(),
            detail: "device memory without a CUDA backend".into(),
        })
    }

    /// Wait for every copy queued on this device (CUDA: its stream; host devices: nothing).
    pub fn synchronize(&self) -> Result<()> {
        match &self.cuda {
            Some(b) => b
                .synchronize()
                .map_err(|e| self.kernel_err("synchronising", e)),
            None => Ok(()),
        }
    }

    fn kernel_err(&self, during: &str, e: weightlift_kernels::KernelError) -> EngineError {
        EngineError::Device {
            device: self.name.clone(),
            detail: format!("{during}: {e}"),
        }
    }

    /// Bytes currently held by live buffers on this device.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The most bytes held at once since the device was made or [`Device::reset_peak`].
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// Start a new high-water mark from what is held now (a load does, so a model's peak is
    /// its own, not a previous model's on the same inventory).
    pub fn reset_peak(&self) {
        self.peak.store(self.used(), Ordering::Release);
    }

    /// Bytes that can still be allocated (`u64::MAX` when unbounded).
    pub fn free(&self) -> u64 {
        self.capacity
            .map_or(u64::MAX, |c| c.saturating_sub(self.used()))
    }

    /// Count `bytes` against the capacity, or fail with OutOfMemory naming this device.
    fn reserve(&self, bytes: u64) -> Result<()> {
        let mut cur = self.used.load(Ordering::Acquire);
        loop {
            let next = cur.checked_add(bytes);
            let fits = match (next, self.capacity) {
                (Some(n), Some(c)) => n <= c,
                (Some(_), None) => true,
                (None, _) => false,
            };
            if !fits {
                return Err(self.oom(bytes, cur));
            }
            let next = next.unwrap_or(u64::MAX);
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::AcqRel);
                    return Ok(());
                }
                Err(actual) => cur = actual,
            }
        }
    }

    fn release(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }

    fn oom(&self, requested: u64, used: u64) -> EngineError {
        let capacity = self.capacity.unwrap_or(u64::MAX);
        EngineError::OutOfMemory {
            device: self.name.clone(),
            requested,
            free: capacity.saturating_sub(used),
            capacity,
        }
    }

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

/// Free device memory as the driver reports it.
#[cfg(feature = "cuda")]
fn cuda_free(b: &CudaBackend) -> std::result::Result<u64, String> {
    b.mem_info()
        .map(|(free, _)| free as u64)
        .map_err(|e| e.to_string())
}

/// Without the `cuda` feature no backend exists to ask.
#[cfg(not(feature = "cuda"))]
fn cuda_free(_b: &CudaBackend) -> std::result::Result<u64, String> {
    Err("this build has no cuda support".into())
}

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
    fn find_non_finite(&self, dtype: DType) -> Result<Option<(u64, &'static str)>> {
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

/// The devices a model may use: accelerators in order, then the host.
#[derive(Debug, Clone)]
pub struct Inventory {
    accelerators: Vec<Arc<Device>>,
    cpu: Arc<Device>,
    /// Whether `cpu` was named. The host always runs the model, but unnamed it takes only what
    /// every strategy puts on the host anyway (the input embedding): the plan is asked for
    /// without it, as `plan()` is for the same spec.
    pub cpu_listed: bool,
    /// Whether `disk` was named (weights may stay in the file).
    pub disk: bool,
}

/// Wait out the rest of what a copy of `bytes` between `a` and `b`, begun at `since`, takes
/// over the slower of their simulated links (no wait when neither has one). Sleeping, not
/// spinning, so a prefetching thread's wait overlaps the compute as a DMA engine's would.
pub fn pace_link(a: &Device, b: &Device, bytes: u64, since: std::time::Instant) {
    pace(link_rate(a, b), bytes, since);
}

/// The rate of the slower simulated link between `a` and `b`, if either has one.
pub fn link_rate(a: &Device, b: &Device) -> Option<u64> {
    match (a.bandwidth, b.bandwidth) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (Some(x), None) | (None, Some(x)) => Some(x),
        (None, None) => None,
    }
}

/// [`pace_link`] for a rate already looked up (`None`: no wait).
pub fn pace(rate: Option<u64>, bytes: u64, since: std::time::Instant) {
    let Some(rate) = rate else { return };
    let need = std::time::Duration::from_secs_f64(bytes as f64 / rate as f64);
    if let Some(rest) = need.checked_sub(since.elapsed()) {
        std::thread::sleep(rest);
    }
}

impl Inventory {
    /// Parse a spec such as `"virtual:2x64MiB"`, `"virtual:24GiB,virtual:12GiB,cpu:64GiB,disk"`,
    /// `"cuda:0,cuda:1"` or `"cpu"`, with the planner's grammar. The `cpu` device always
    /// exists (see [`Inventory::cpu_listed`]); without a size its capacity is the host's
    /// MemAvailable, or unbounded where that is unknown.
    pub fn parse(spec: &str) -> Result<Inventory> {
        let mut accelerators = Vec::new();
        // the capacity a listed `cpu` gives, if any; MemAvailable is read once, at the end
        let mut cpu: Option<Option<u64>> = None;
        let mut disk = false;
        for item in weightlift_plan::parse_device_items(spec)? {
            use weightlift_plan::DeviceKind as K;
            match item.kind {
                K::Cpu => cpu = Some(item.capacity),
                K::Disk => disk = true,
                K::Virtual => {
                    let capacity = item.capacity.unwrap_or(u64::MAX);
                    accelerators.push(match item.bandwidth {
                        Some(bw) => Device::virtual_with_link(item.ordinal, capacity, bw),
                        None => Device::virtual_device(item.ordinal, capacity),
                    })
                }
                K::Cuda => accelerators.push(Device::cuda(item.ordinal, item.capacity)?),
            }
        }
        Ok(Inventory {
            accelerators,
            cpu: Device::cpu(cpu.flatten().or_else(mem_available)),
            cpu_listed: cpu.is_some(),
            disk,
        })
    }

    /// Only the host (capacity: MemAvailable).
    pub fn cpu_only() -> Inventory {
        Inventory {
            accelerators: Vec::new(),
            cpu: Device::cpu(mem_available()),
            cpu_listed: true,
            disk: false,
        }
    }

    pub fn accelerators(&self) -> &[Arc<Device>] {
        &self.accelerators
    }

    pub fn cpu(&self) -> &Arc<Device> {
        &self.cpu
    }

    /// Every device: accelerators in order, then `cpu`.
    pub fn all(&self) -> Vec<Arc<Device>> {
        let mut v = self.accelerators.clone();
        v.push(Arc::clone(&self.cpu));
        v
    }

    /// Look a device up by its normalised name (`"cpu"`, `"virtual:1"`, `"cuda:0"`).
    pub fn get(&self, name: &str) -> Result<Arc<Device>> {
        self.all()
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| {
                let names: Vec<String> = self.all().iter().map(|d| d.name().to_owned()).collect();
                invalid(
                    "device",
                    format!("one of {}", names.join(", ")),
                    format!("'{name}'"),
                )
            })
    }
}

impl Inventory {
    /// The real machine, as `weightlift.devices()` reports it: every CUDA device the kernels'
    /// backend sees (at its free memory; none in a build without the `cuda` feature or without
    /// a driver), then `cpu` at MemAvailable. `disk` is not included: weights stay in the file
    /// only where a spec names it.
    pub fn detect() -> Result<Inventory> {
        let mut accelerators = Vec::new();
        for spec in weightlift_plan::inventory(&HostProbe) {
            if spec.kind == weightlift_plan::DeviceKind::Cuda {
                let ordinal = spec
                    .name
                    .strip_prefix("cuda:")
                    .and_then(|o| o.parse().ok())
                    .ok_or_else(|| invalid("probed device", "cuda:N", &spec.name))?;
                accelerators.push(Device::cuda(ordinal, Some(spec.capacity))?);
            }
        }
        Ok(Inventory {
            accelerators,
            cpu: Device::cpu(HostProbe.cpu_available()),
            cpu_listed: true,
            disk: false,
        })
    }

    /// The spec string that names this inventory's devices (`"cuda:0,cpu"`, `"cpu"`).
    pub fn spec(&self) -> String {
        let mut names: Vec<String> = self.all().iter().map(|d| d.name().to_owned()).collect();
        if self.disk {
            names.push("disk".into());
        }
        names.join(",")
    }
}

/// The planner's window on the real machine (the planner does no I/O itself): MemAvailable for
/// the host, and the CUDA driver's free/total memory through the kernels' backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostProbe;

impl weightlift_plan::MemoryProbe for HostProbe {
    fn cpu_available(&self) -> Option<u64> {
        mem_available()
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, ordinal: u32) -> Option<(u64, u64)> {
        let backend = CudaBackend::new(usize::try_from(ordinal).ok()?).ok()?;
        let (free, total) = backend.mem_info().ok()?;
        Some((u64::try_from(free).ok()?, u64::try_from(total).ok()?))
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda(&self, _ordinal: u32) -> Option<(u64, u64)> {
        None
    }

    fn cuda_count(&self) -> u32 {
        CudaBackend::device_count().map_or(0, |n| u32::try_from(n).unwrap_or(0))
    }
}

/// The host's MemAvailable from /proc/meminfo, in bytes.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_capacity_is_hard() {
        let d = Device::virtual_device(0, 1000);
        let a = d.alloc(600).unwrap();
        assert_eq!(d.used(), 600);
        let err = d.alloc(500).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("out of memory on virtual:0"), "{msg}");
        assert!(
            msg.contains("requested 500 bytes, 400 bytes free of 1000"),
            "{msg}"
        );
        assert_eq!(d.used(), 600, "a failed allocation holds nothing");
        drop(a);
        assert_eq!(d.used(), 0);
        assert_eq!(d.peak(), 600);
    }

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

    #[test]
    fn specs_parse() {
        let inv = Inventory::parse("virtual:24GiB, virtual:12GiB,cpu:64GiB,disk").unwrap();
        let names: Vec<_> = inv.all().iter().map(|d| d.name().to_owned()).collect();
        assert_eq!(names, ["virtual:0", "virtual:1", "cpu"]);
        assert_eq!(inv.accelerators()[1].capacity(), Some(12 << 30));
        assert_eq!(inv.cpu().capacity(), Some(64 << 30));
        assert!(inv.disk);
        assert!(
            Inventory::parse("tpu:0")
                .unwrap_err()
                .to_string()
                .contains("'tpu:0'")
        );
        if weightlift_kernels::CudaBackend::unavailable_reason().is_some() {
            for (spec, name) in [("cuda:0", "cuda:0"), ("virtual:1MiB,cuda:1:8GiB", "cuda:1")] {
                let e = Inventory::parse(spec).unwrap_err();
                assert!(matches!(e, EngineError::CudaUnavailable { .. }), "{e}");
                assert!(
                    e.to_string()
                        .starts_with(&format!("device {name}: cuda is unavailable"))
                );
            }
            assert!(Inventory::detect().unwrap().accelerators().is_empty());
        }
        let e = Inventory::parse("cuda:x").unwrap_err();
        assert!(e.to_string().contains("cuda:N or cuda:N:SIZE"), "{e}");
        // the planner's grammar: the same spec names the same devices in plan() and here
        let e = Inventory::parse("gpu:2x1GiB").unwrap_err().to_string();
        assert!(
            e.contains("'2x1GiB'") && e.contains("virtual:2x1GiB"),
            "{e}"
        );
        assert!(!Inventory::parse("virtual:1MiB").unwrap().cpu_listed);
        assert!(Inventory::parse("virtual:1MiB,cpu").unwrap().cpu_listed);
    }
}

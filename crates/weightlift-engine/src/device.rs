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
//!
//! - [`buffer`]: [`Buffer`], memory held on one device, and the copies between devices.
//! - [`tensor`]: [`DeviceTensor`], a typed, shaped tensor in a buffer or a view of the mmap.
//! - [`inventory`]: [`Inventory`], the devices a model may use, parsed from a spec or probed.

mod buffer;
mod inventory;
mod tensor;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use weightlift_kernels::{Backend, CudaBackend};
use weightlift_plan::CudaOverhead;

use crate::error::{EngineError, Result};

pub use buffer::{BOUNCE_BYTES, Buffer};
pub use inventory::{HostProbe, Inventory, mem_available};
pub use tensor::{DeviceTensor, Storage};

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
    /// A `cuda:N` device's overhead as the plan charges it ([`cuda_overhead`]), and the
    /// capacity the plan sees: as given, or the free memory plus the context already held.
    planned: Option<(u64, CudaOverhead)>,
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

    /// The device of rank `rank` of a multi-process tensor-parallel run, as a process driving
    /// another rank sees it: a name for the split tables and messages, with no memory (its
    /// weights, cache and scratch live in that rank's process).
    pub fn elsewhere(rank: usize) -> Arc<Device> {
        Arc::new(Device::new(
            format!("rank {rank} (another process)"),
            DeviceKind::Virtual,
            rank as u32,
            Some(0),
        ))
    }

    /// The simulated link rate in bytes/s, if this device has one.
    pub fn bandwidth(&self) -> Option<u64> {
        self.bandwidth
    }

    /// `cuda:N`, through the kernels crate's CUDA backend: device memory per tensor, the
    /// backend's two pinned staging buffers for copies from the host, and its stream. The
    /// capacity is `capacity`, or the free memory the driver reports now. Its overhead is
    /// measured now ([`cuda_overhead`]) for the plan, which also sees the context this process
    /// holds as part of a driver-read capacity ([`Device::planned`]). Without a GPU, libcuda
    /// or the `cuda` feature this fails with [`EngineError::CudaUnavailable`] carrying the
    /// backend's reason (libcuda missing: install the NVIDIA driver).
    pub fn cuda(ordinal: u32, capacity: Option<u64>) -> Result<Arc<Device>> {
        let name = format!("cuda:{ordinal}");
        let unavailable = |e: weightlift_kernels::KernelError| EngineError::CudaUnavailable {
            device: name.clone(),
            detail: format!("{e}; {}", weightlift_plan::cuda_unavailable_fix(&name)),
        };
        let backend = CudaBackend::new(ordinal as usize).map_err(unavailable)?;
        let overhead = cuda_overhead(&backend);
        let (capacity, planned) = match capacity {
            Some(c) => (c, c),
            None => {
                let free = cuda_free(&backend).map_err(|e| EngineError::Device {
                    device: name.clone(),
                    detail: format!("reading free memory from the driver: {e}"),
                })?;
                (free, free.saturating_add(overhead.held))
            }
        };
        let mut d = Device::new(name, DeviceKind::Cuda, ordinal, Some(capacity));
        d.cuda = Some(backend);
        d.planned = Some((planned, overhead));
        Ok(Arc::new(d))
    }

    /// The capacity and overhead the plan uses for a `cuda:N` device: its capacity as given,
    /// or its free memory plus the context this process already holds (what was free before
    /// the process used the GPU), and the overhead measured when the device was opened.
    /// `None` for the other kinds.
    pub fn planned(&self) -> Option<(u64, CudaOverhead)> {
        self.planned
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
            planned: None,
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

    /// The CUDA backend of a `cuda:N` device, or an error naming the device: what a pass that
    /// computes on it needs.
    pub fn backend(&self) -> Result<&CudaBackend> {
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
}

/// The fixed overhead the plan charges for `backend`'s device: one context, measured beside
/// the backend's own ([`CudaBackend::context_bytes`]), with our kernel modules
/// ([`weightlift_kernels::sources::MODULE_BYTES`]) still to load, and cuBLAS's workspace and the
/// graph allowance for its capability; the defaults for its capability when the context
/// cannot be measured (no memory left for a second one). The one place that measures: the
/// probe behind `plan()` and the devices a model loads onto both come here.
pub fn cuda_overhead(backend: &CudaBackend) -> CudaOverhead {
    let (major, minor) = backend.compute_capability();
    let capability = (
        u32::try_from(major).unwrap_or(0),
        u32::try_from(minor).unwrap_or(0),
    );
    match backend.context_bytes() {
        Ok(context) => CudaOverhead::measured(
            capability,
            context,
            weightlift_kernels::sources::MODULE_BYTES,
        ),
        Err(_) => CudaOverhead::default_for(Some(capability)),
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

    /// What the plan charges a CUDA device for its prompt products is what the kernels
    /// allocate: the cuBLAS workspace per capability, and the dequantised chunk's cap.
    #[test]
    fn the_plan_charges_the_cuda_products_with_the_kernels_sizes() {
        use weightlift_kernels::sources;
        for cc in [(7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0)] {
            let plan_cc = (cc.0 as u32, cc.1 as u32);
            assert_eq!(
                weightlift_plan::overhead::cublas_workspace(Some(plan_cc)),
                sources::cublas_workspace_bytes(cc) as u64,
                "sm_{}{}",
                cc.0,
                cc.1
            );
        }
        assert_eq!(
            weightlift_plan::DQ_CHUNK_VALUES,
            sources::DQ_CHUNK_CAP as u64
        );
    }
}

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

    /// `cuda:N`, through the kernels crate's CUDA backend. Without a GPU, libcuda or the
    /// kernels' `cuda` feature this fails with [`EngineError::CudaUnavailable`] carrying the
    /// backend's reason. Where the backend does come up, the engine still refuses: it cannot
    /// hold tensors in device memory yet (see the crate docs), and says so.
    pub fn cuda(ordinal: u32) -> Result<Arc<Device>> {
        let name = format!("cuda:{ordinal}");
        match weightlift_kernels::CudaBackend::new(ordinal as usize) {
            Err(e) => Err(EngineError::CudaUnavailable {
                device: name,
                detail: e.to_string(),
            }),
            Ok(_) => Err(EngineError::Unsupported {
                what: format!("placing tensors on {name}"),
                detail: "the engine holds tensors on cpu and virtual devices only in this build"
                    .into(),
            }),
        }
    }

    fn new(name: String, kind: DeviceKind, ordinal: u32, capacity: Option<u64>) -> Device {
        Device {
            name,
            kind,
            ordinal,
            capacity,
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
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

    /// Bytes currently held by live buffers on this device.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The most bytes ever held at once.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
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

    /// Allocate `bytes` zeroed bytes on this device.
    pub fn alloc(self: &Arc<Self>, bytes: u64) -> Result<Buffer> {
        self.reserve(bytes)?;
        let mem = usize::try_from(bytes)
            .ok()
            .and_then(AlignedBuf::zeroed)
            .ok_or_else(|| {
                self.release(bytes);
                self.oom(bytes, self.used())
            })?;
        Ok(Buffer {
            device: Arc::clone(self),
            mem,
        })
    }
}

/// Memory held on one device. Dropping it returns the bytes to the device.
#[derive(Debug)]
pub struct Buffer {
    device: Arc<Device>,
    mem: AlignedBuf,
}

impl Buffer {
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub fn len(&self) -> usize {
        self.mem.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }

    /// The bytes. `cpu` and `virtual` buffers are host-addressable.
    pub fn as_slice(&self) -> &[u8] {
        self.mem.as_slice()
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem.as_mut_slice()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.device.release(self.mem.len() as u64);
    }
}

/// Where a tensor's bytes live.
pub enum Storage {
    /// Owned memory on a `cpu` or `virtual` device.
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
        let need = dtype.bytes_for(n).ok_or_else(|| {
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
        let have = t.bytes().len() as u64;
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
        buf.as_mut_slice().copy_from_slice(bytes);
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

    /// The stored bytes (host-addressable for `cpu` and `virtual`).
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Owned(b) => b.as_slice(),
            Storage::Mapped { source, index } => source.bytes(*index),
        }
    }

    /// Bytes counted against the device (anonymous memory for owned storage, page cache for
    /// mapped views).
    pub fn nbytes(&self) -> u64 {
        self.bytes().len() as u64
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }

    /// A host copy of the bytes.
    pub fn to_host(&self) -> Vec<u8> {
        self.bytes().to_vec()
    }

    /// A copy of this tensor on `device` (a real copy between separate allocations).
    pub fn copy_to(&self, device: &Arc<Device>) -> Result<DeviceTensor> {
        DeviceTensor::from_host(device, self.shape.clone(), self.dtype, self.bytes())
    }
}

/// The devices a model may use: accelerators in order, then the host.
#[derive(Debug, Clone)]
pub struct Inventory {
    accelerators: Vec<Arc<Device>>,
    cpu: Arc<Device>,
    /// Whether `disk` was named (weights may stay in the file).
    pub disk: bool,
}

impl Inventory {
    /// Parse a spec such as `"virtual:2x64MiB"`, `"virtual:24GiB,virtual:12GiB,cpu:64GiB,disk"`,
    /// `"cuda:0,cuda:1"` or `"cpu"`. The `cpu` device is always present; without a size its
    /// capacity is the host's MemAvailable (DESIGN.md), or unbounded where that is unknown.
    pub fn parse(spec: &str) -> Result<Inventory> {
        let mut accelerators = Vec::new();
        let mut cpu_cap = None;
        let mut disk = false;
        let mut n_virtual = 0u32;
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (kind, arg) = item.split_once(':').unwrap_or((item, ""));
            match kind.to_ascii_lowercase().as_str() {
                "cpu" => {
                    cpu_cap = if arg.is_empty() {
                        None
                    } else {
                        Some(parse_size(arg)?)
                    }
                }
                "disk" => disk = true,
                "virtual" => {
                    let (count, size) = match arg.split_once(['x', 'X']) {
                        Some((c, s))
                            if c.chars().all(|ch| ch.is_ascii_digit()) && !c.is_empty() =>
                        {
                            let count: u32 = c
                                .parse()
                                .map_err(|_| invalid("device count in spec", "an integer", c))?;
                            (count, s)
                        }
                        _ => (1, arg),
                    };
                    if count > 64 {
                        return Err(invalid("virtual device count", "at most 64", count));
                    }
                    let cap = parse_size(size)?;
                    for _ in 0..count {
                        accelerators.push(Device::virtual_device(n_virtual, cap));
                        n_virtual += 1;
                    }
                }
                "cuda" => {
                    let ordinal: u32 = arg
                        .parse()
                        .map_err(|_| invalid("cuda device in spec", "cuda:N", item))?;
                    accelerators.push(Device::cuda(ordinal)?);
                }
                _ => {
                    return Err(invalid(
                        "device spec",
                        "cpu, cpu:SIZE, virtual:SIZE, virtual:NxSIZE, cuda:N or disk",
                        format!("'{item}'"),
                    ));
                }
            }
        }
        Ok(Inventory {
            accelerators,
            cpu: Device::cpu(cpu_cap.or_else(mem_available)),
            disk,
        })
    }

    /// Only the host (capacity: MemAvailable).
    pub fn cpu_only() -> Inventory {
        Inventory {
            accelerators: Vec::new(),
            cpu: Device::cpu(mem_available()),
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

/// The host's MemAvailable from /proc/meminfo, in bytes.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Parse `"512MiB"`, `"2GiB"`, `"1.5GB"`, `"4096"` (bytes).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        "t" | "tib" => 1024.0f64.powi(4),
        "tb" => 1e12,
        _ => {
            return Err(invalid(
                "memory size",
                "a number with B, KiB, MiB, GiB, KB, MB or GB",
                format!("'{text}'"),
            ));
        }
    };
    let value: f64 = num.parse().map_err(|_| {
        invalid(
            "memory size",
            "a number with an optional unit",
            format!("'{text}'"),
        )
    })?;
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 0.0 || bytes > 2f64.powi(62) {
        return Err(invalid(
            "memory size",
            "between 0 and 4 EiB",
            format!("'{text}'"),
        ));
    }
    Ok(bytes.round() as u64)
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
        assert_ne!(t.bytes().as_ptr(), u.bytes().as_ptr());
        assert_eq!(t.to_host(), u.to_host());
        assert_eq!((a.used(), b.used()), (16, 16));
        drop((t, u));
        assert_eq!((a.used(), b.used()), (0, 0));
    }

    #[test]
    fn specs_parse() {
        let inv = Inventory::parse("virtual:24GiB, virtual:12GiB,cpu:64GiB,disk").unwrap();
        let names: Vec<_> = inv.all().iter().map(|d| d.name().to_owned()).collect();
        assert_eq!(names, ["virtual:0", "virtual:1", "cpu"]);
        assert_eq!(inv.accelerators()[1].capacity(), Some(12 << 30));
        assert_eq!(inv.cpu().capacity(), Some(64 << 30));
        assert!(inv.disk);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert!(
            Inventory::parse("tpu:0")
                .unwrap_err()
                .to_string()
                .contains("'tpu:0'")
        );
        let e = Inventory::parse("cuda:0").unwrap_err();
        assert!(matches!(e, EngineError::CudaUnavailable { .. }), "{e}");
        assert!(e.to_string().contains("cuda:0"));
    }
}

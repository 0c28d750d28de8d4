//! [`Inventory`]: the devices a model may use, from a spec in the planner's grammar or probed
//! from the real machine through [`HostProbe`].

use std::sync::Arc;

use weightlift_kernels::CudaBackend;
use weightlift_plan::MemoryProbe;

use super::Device;
use crate::error::{EngineError, Result, invalid};

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
                // Named as the spec wrote it (`gpu:0 (cuda:0)`), as the planner names it.
                K::Cuda => accelerators.push(Device::cuda(item.ordinal, item.capacity).map_err(
                    |e| match e {
                        EngineError::CudaUnavailable { detail, .. } => {
                            EngineError::CudaUnavailable {
                                device: item.label(),
                                detail,
                            }
                        }
                        other => other,
                    },
                )?),
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

    /// Look a device up by its name (`"cpu"`, `"virtual:1"`, `"cuda:0"`), read as the spec
    /// grammar reads names (`"CUDA:0"` and `"gpu:0"` are `cuda:0`).
    pub fn get(&self, name: &str) -> Result<Arc<Device>> {
        let canonical = weightlift_plan::canonical_device_name(name);
        self.all()
            .into_iter()
            .find(|d| d.name() == canonical)
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
                // the capacity the probe planned with: free memory plus the context held
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

    /// The overhead measured on the device ([`super::cuda_overhead`]); `cuda()` reads the free
    /// memory inside the same kind of context, which is why the planner adds it back.
    fn cuda_overhead(&self, ordinal: u32) -> Option<weightlift_plan::CudaOverhead> {
        let backend = CudaBackend::new(usize::try_from(ordinal).ok()?).ok()?;
        Some(super::cuda_overhead(&backend))
    }

    fn cuda_count(&self) -> u32 {
        CudaBackend::device_count().map_or(0, |n| u32::try_from(n).unwrap_or(0))
    }

    /// What opening the device says ([`Device::cuda`](super::Device::cuda) words its
    /// `CudaUnavailable` from the same error), so a bare `cuda:N` fails alike in `plan()` and
    /// in `Model()`.
    fn cuda_unavailable(&self, ordinal: u32) -> Option<String> {
        let ordinal = usize::try_from(ordinal).ok()?;
        CudaBackend::new(ordinal).err().map(|e| e.to_string())
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
            for (spec, name, fix) in [
                ("cuda:0", "cuda:0", "cuda:0:24GiB"),
                ("virtual:1MiB,cuda:1:8GiB", "cuda:1", "cuda:1:24GiB"),
                ("gpu:2", "gpu:2 (cuda:2)", "cuda:2:24GiB"),
            ] {
                let e = Inventory::parse(spec).unwrap_err();
                assert!(matches!(e, EngineError::CudaUnavailable { .. }), "{e}");
                let msg = e.to_string();
                assert!(
                    msg.starts_with(&format!("device {name}: cuda is unavailable")),
                    "{msg}"
                );
                // The planner's words for the same bare device, fix included; with a size it
                // plans (a what-if), though loading onto it fails.
                let planned = weightlift_plan::parse_devices_with(spec, &HostProbe);
                match planned {
                    Err(planned) => assert_eq!(planned.to_string(), msg),
                    Ok(_) => assert!(spec.contains(":8GiB"), "{spec}"),
                }
                assert!(
                    msg.ends_with(&format!(
                        "plan() and fit() plan for it without a GPU when its size is given \
                         ({fix}); to run here, use cpu or simulated accelerators \
                         (virtual:24GiB)"
                    )),
                    "{msg}"
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

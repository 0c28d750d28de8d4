//! The device inventory: spec strings, normalised names, and the probe trait through which the
//! engine reports real memory (the planner itself does no I/O).
//!
//! Spec syntax (comma-separated, whitespace ignored):
//!
//! | item | meaning |
//! |---|---|
//! | `cpu` | host RAM; capacity from the probe (MemAvailable), unbounded if there is none |
//! | `cpu:64GiB` | host RAM capped at 64 GiB |
//! | `cuda:N` | GPU N; capacity from the probe (free memory): `CudaUnavailable` where the probe says CUDA cannot be used, as opening the device would |
//! | `cuda:N:24GiB` | GPU N with a given capacity (a what-if plan: no GPU needed) |
//! | `cuda:N:24GiB:sm_89` | the same, of compute capability 8.9 (planning without the GPU) |
//! | `gpu:N`, `gpu:N:24GiB`, ... | another spelling of `cuda:N`: plans, device maps and memory reports name the device `cuda:N`; an error about the item says `gpu:N (cuda:N)` |
//! | `virtual:24GiB` | a simulated accelerator of 24 GiB |
//! | `virtual:2x24GiB` | two of them |
//! | `disk` | weights left in the file; unbounded |
//!
//! Virtual devices are numbered in order of appearance: `virtual:24GiB,virtual:12GiB` gives
//! `virtual:0` and `virtual:1`. Sizes are parsed by [`parse_size`]. A device name given
//! elsewhere (a device map, a `reserve` key) is read by [`canonical_device_name`], so `gpu:1`
//! and `CUDA:1` name `cuda:1` there too.
//!
//! Every `cuda:N` device carries its fixed overhead ([`CudaOverhead`]): what the probe measured
//! on the GPU, or, without one, the defaults for the capability the spec names (the largest
//! defaults when it names none).

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};
use crate::overhead::{Capability, CudaOverhead, Overhead, parse_sm};
use crate::size::parse_size;

/// What kind of memory a device has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    Cpu,
    Cuda,
    Virtual,
    Disk,
}

impl DeviceKind {
    /// The name a device spec gives the kind: `"cpu"`, `"cuda"`, `"virtual"` or `"disk"`.
    pub const fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Virtual => "virtual",
            DeviceKind::Disk => "disk",
        }
    }

    /// Accelerators are the devices the GPU-first strategies fill: cuda and virtual.
    pub const fn is_accelerator(self) -> bool {
        matches!(self, DeviceKind::Cuda | DeviceKind::Virtual)
    }
}

/// One device of the inventory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// Normalised name: `"cpu"`, `"cuda:0"`, `"virtual:0"`, `"disk"`.
    pub name: String,
    pub kind: DeviceKind,
    /// Bytes the device has (`u64::MAX` for disk, or for a cpu whose size is unknown).
    pub capacity: u64,
    /// Bytes kept free (exllamav2's `reserve_vram`, llama.cpp's fit margin).
    pub reserve: u64,
    /// Fixed cost of using the device at all, in named parts: for `cuda:N` its context and
    /// modules, cuBLAS workspace and graph memory ([`CudaOverhead`]); none for the other kinds
    /// unless given.
    #[serde(default)]
    pub overhead: Overhead,
}

/// A capacity, `None` for an unbounded device (`u64::MAX`).
pub(crate) fn bounded(capacity: u64) -> Option<u64> {
    (capacity != u64::MAX).then_some(capacity)
}

impl DeviceSpec {
    /// A device of `kind`; a `cuda` one carries the default overhead of a GPU of unknown
    /// capability ([`DeviceSpec::cuda`] names its own).
    pub fn new(name: impl Into<String>, kind: DeviceKind, capacity: u64) -> Self {
        DeviceSpec {
            name: name.into(),
            kind,
            capacity,
            reserve: 0,
            overhead: match kind {
                DeviceKind::Cuda => CudaOverhead::default_for(None).into(),
                _ => Overhead::default(),
            },
        }
    }

    /// Bytes the device has, or `None` when it is unbounded (`disk`, a `cpu` of unknown size).
    pub fn bounded_capacity(&self) -> Option<u64> {
        bounded(self.capacity)
    }

    /// The device as the Python bindings show it: `capacity` is `None` when unbounded, and the
    /// overhead is its total and its parts as `(name, bytes, source)` rows.
    pub fn view(&self) -> impl Serialize + '_ {
        #[derive(Serialize)]
        struct View<'a> {
            name: &'a str,
            kind: DeviceKind,
            capacity: Option<u64>,
            reserve: u64,
            overhead: u64,
            overhead_parts: Vec<(&'a str, u64, &'a str)>,
        }
        View {
            name: &self.name,
            kind: self.kind,
            capacity: self.bounded_capacity(),
            reserve: self.reserve,
            overhead: self.overhead.total(),
            overhead_parts: crate::overhead::rows(self.overhead.parts()),
        }
    }

    /// A CUDA device with its overhead, measured or defaulted.
    pub fn cuda(name: impl Into<String>, capacity: u64, overhead: CudaOverhead) -> Self {
        DeviceSpec {
            overhead: overhead.into(),
            ..DeviceSpec::new(name, DeviceKind::Cuda, capacity)
        }
    }
}

/// Real memory, as the engine sees it. The planner never calls the OS itself.
pub trait MemoryProbe {
    /// Host MemAvailable in bytes.
    fn cpu_available(&self) -> Option<u64>;
    /// `(free, total)` bytes of CUDA device `ordinal`, if it exists.
    fn cuda(&self, ordinal: u32) -> Option<(u64, u64)>;
    /// Number of CUDA devices. The default asks `cuda()` for ordinals 0, 1, ... until one is
    /// missing (at most 64).
    fn cuda_count(&self) -> u32 {
        (0..64).take_while(|&i| self.cuda(i).is_some()).count() as u32
    }
    /// The fixed overhead of CUDA device `ordinal` as the probe found it, if it can tell. A
    /// probe that answers here reads `cuda()`'s free memory from inside its own context, which
    /// already holds [`CudaOverhead::held`] bytes: the planner adds them back to the free
    /// memory, so the capacity is what was free before this process used the device, and
    /// charges them with the rest of the overhead (as nvidia-smi counts them). The default
    /// knows nothing: the planner then uses the defaults for the capability the spec names.
    fn cuda_overhead(&self, _ordinal: u32) -> Option<CudaOverhead> {
        None
    }
    /// Why CUDA device `ordinal` cannot be used, when `cuda()` has no answer for it and the
    /// probe can tell (no driver, a build without CUDA, fewer GPUs than the ordinal): in the
    /// words opening the device would fail with. The planner then refuses a `cuda:N` named
    /// without a size with [`PlanError::CudaUnavailable`], as loading onto it would. The
    /// default cannot tell.
    fn cuda_unavailable(&self, _ordinal: u32) -> Option<String> {
        None
    }
}

/// What to do about a named `cuda:N` that cannot be used here; the planner's and the engine's
/// `CudaUnavailable` messages end with it. `name` is the canonical name (`cuda:0`).
pub fn cuda_unavailable_fix(name: &str) -> String {
    format!(
        "plan() and fit() plan for it without a GPU when its size is given ({name}:24GiB); \
         to run here, use cpu or simulated accelerators (virtual:24GiB)"
    )
}

/// One CUDA device: its overhead from `probe`, else the defaults for `capability`; its
/// capacity as given, else the probe's free memory plus the context the probe holds. Errors
/// name the device as `label` (the spec's spelling, see [`DeviceItem::label`]).
fn cuda_spec(
    ordinal: u32,
    capacity: Option<u64>,
    capability: Option<Capability>,
    label: &str,
    probe: &dyn MemoryProbe,
) -> Result<DeviceSpec> {
    let name = format!("cuda:{ordinal}");
    let measured = probe.cuda_overhead(ordinal);
    let overhead = measured.unwrap_or_else(|| CudaOverhead::default_for(capability));
    let capacity = match capacity {
        Some(c) => c,
        None => {
            let Some((free, _)) = probe.cuda(ordinal) else {
                if let Some(why) = probe.cuda_unavailable(ordinal) {
                    return Err(PlanError::CudaUnavailable {
                        device: label.to_owned(),
                        detail: format!("{why}; {}", cuda_unavailable_fix(&name)),
                    });
                }
                return Err(PlanError::DeviceSpec {
                    spec: label.to_owned(),
                    reason: format!(
                        "capacity of {name} is unknown (no GPU probe read its free memory); \
                         give it as {name}:24GiB"
                    ),
                });
            };
            free.saturating_add(measured.map_or(0, |o| o.held))
        }
    };
    Ok(DeviceSpec::cuda(name, capacity, overhead))
}

/// The real machine as `probe` sees it (Python's `weightlift.devices()`): every CUDA device at
/// what was free before this process used it (with its overhead), then `cpu` at MemAvailable
/// (unbounded when unknown).
pub fn inventory(probe: &dyn MemoryProbe) -> Vec<DeviceSpec> {
    let mut out: Vec<DeviceSpec> = (0..probe.cuda_count())
        .filter_map(|i| cuda_spec(i, None, None, &format!("cuda:{i}"), probe).ok())
        .collect();
    out.push(DeviceSpec::new(
        "cpu",
        DeviceKind::Cpu,
        probe.cpu_available().unwrap_or(u64::MAX),
    ));
    out
}

/// A probe that knows nothing: cpu is unbounded and cuda devices must be given a size.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProbe;

impl MemoryProbe for NoProbe {
    fn cpu_available(&self) -> Option<u64> {
        None
    }
    fn cuda(&self, _ordinal: u32) -> Option<(u64, u64)> {
        None
    }
}

/// Parse a device spec string without probing (see the module docs for the syntax).
pub fn parse_devices(spec: &str) -> Result<Vec<DeviceSpec>> {
    parse_devices_with(spec, &NoProbe)
}

/// One item of a device spec as written: its normalised name, kind, ordinal (cuda and virtual)
/// and capacity when the spec gives one. The planner's inventory and the engine's devices are
/// both built from these, so the two read a spec the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceItem {
    pub name: String,
    pub kind: DeviceKind,
    pub ordinal: u32,
    pub capacity: Option<u64>,
    /// A virtual device's link to the host in bytes per second (`virtual:8GiB@16GB/s`), so
    /// copies to and from it take what they would over that link (PCIe 4.0 x16 is about
    /// 25 GB/s); `None` copies at memory speed.
    pub bandwidth: Option<u64>,
    /// A CUDA device's compute capability as the spec names it (`cuda:0:24GiB:sm_89`), for
    /// the overhead defaults when planning without the GPU; a real GPU's own wins.
    pub capability: Option<Capability>,
    /// The device as the spec spelt it when that was an alias of `name` (`gpu:0` for
    /// `cuda:0`), so that messages about the item can say what the user wrote.
    pub alias: Option<String>,
}

impl DeviceItem {
    /// The device as messages about this item name it: `name`, or `gpu:0 (cuda:0)` where the
    /// spec used an alias.
    pub fn label(&self) -> String {
        match &self.alias {
            Some(a) => format!("{a} ({})", self.name),
            None => self.name.clone(),
        }
    }
}

/// A device name as written elsewhere than a spec (a device map entry, a `reserve` key, a
/// tensor's target) in the inventory's spelling: trimmed, lower-case, with `gpu:N` read as
/// `cuda:N`, the alias the spec grammar takes.
pub fn canonical_device_name(name: &str) -> String {
    let n = name.trim().to_ascii_lowercase();
    match n.strip_prefix("gpu:") {
        Some(rest) => format!("cuda:{rest}"),
        None => n,
    }
}

/// A link rate such as `16GB/s` or `12.5GiB/s`: a size per second, more than zero.
fn parse_bandwidth(item: &str, text: &str) -> Result<u64> {
    let err = |reason: String| PlanError::DeviceSpec {
        spec: item.to_string(),
        reason,
    };
    let Some(size) = text.trim().strip_suffix("/s") else {
        return Err(err(format!(
            "expected a bandwidth such as 16GB/s after '@', got '{text}'"
        )));
    };
    match parse_size(size) {
        Ok(0) => Err(err("a bandwidth of 0 bytes/s never finishes a copy".into())),
        Ok(b) => Ok(b),
        Err(e) => Err(err(format!("bandwidth '{text}': {e}"))),
    }
}

/// Parse a device spec string into its items, without asking any device for its memory.
pub fn parse_device_items(spec: &str) -> Result<Vec<DeviceItem>> {
    let err = |item: &str, reason: String| PlanError::DeviceSpec {
        spec: item.to_string(),
        reason,
    };
    let size = |item: &str, s: &str| parse_size(s).map_err(|e| err(item, e.to_string()));
    let mut out: Vec<DeviceItem> = Vec::new();
    let mut n_virtual: u32 = 0;
    let items: Vec<&str> = spec.split(',').map(str::trim).collect();
    if items.iter().all(|s| s.is_empty()) {
        return Err(err(
            spec,
            "empty; expected e.g. \"cpu\", \"cuda:0\", \"virtual:2x24GiB\" or \"disk\"".into(),
        ));
    }
    for item in items {
        if item.is_empty() {
            return Err(err(spec, "empty item between commas".into()));
        }
        let lower = item.to_ascii_lowercase();
        let (head, rest) = match lower.split_once(':') {
            Some((h, r)) => (h, Some(r)),
            None => (lower.as_str(), None),
        };
        let one =
            |name: String, kind: DeviceKind, ordinal: u32, capacity: Option<u64>| DeviceItem {
                name,
                kind,
                ordinal,
                capacity,
                bandwidth: None,
                capability: None,
                alias: None,
            };
        match head {
            "cpu" => {
                let capacity = rest.map(|s| size(item, s)).transpose()?;
                out.push(one("cpu".into(), DeviceKind::Cpu, 0, capacity));
            }
            "disk" => {
                if rest.is_some() {
                    return Err(err(item, "disk takes no size; it is unbounded".into()));
                }
                out.push(one("disk".into(), DeviceKind::Disk, 0, None));
            }
            "cuda" | "gpu" => {
                let Some(rest) = rest else {
                    return Err(err(
                        item,
                        "expected cuda:N, cuda:N:SIZE or cuda:N:SIZE:sm_XY".into(),
                    ));
                };
                let mut parts = rest.split(':');
                let ord = parts.next().unwrap_or_default();
                // as typed: the item lowercased keeps every byte offset
                let start = head.len() + 1;
                let typed = &item[start..start + ord.len()];
                let ordinal: u32 = ord.parse().map_err(|_| {
                    err(
                        item,
                        format!(
                            "expected {head}:N or {head}:N:SIZE with N a GPU ordinal, got \
                             '{typed}'; several simulated devices are virtual:NxSIZE, e.g. \
                             virtual:2x1GiB"
                        ),
                    )
                })?;
                let (mut capacity, mut capability) = (None, None);
                for part in parts {
                    if part.starts_with("sm_") && capability.is_none() {
                        capability = Some(parse_sm(part).map_err(|e| err(item, e.to_string()))?);
                    } else if capacity.is_none() && capability.is_none() {
                        capacity = Some(size(item, part)?);
                    } else {
                        return Err(err(
                            item,
                            format!(
                                "unexpected '{part}'; expected cuda:N, cuda:N:SIZE or \
                                 cuda:N:SIZE:sm_XY"
                            ),
                        ));
                    }
                }
                let mut d = one(
                    format!("cuda:{ordinal}"),
                    DeviceKind::Cuda,
                    ordinal,
                    capacity,
                );
                d.capability = capability;
                d.alias = (head == "gpu").then(|| format!("gpu:{ordinal}"));
                out.push(d);
            }
            "virtual" => {
                let Some(rest) = rest else {
                    return Err(err(
                        item,
                        "expected virtual:SIZE or virtual:NxSIZE, e.g. virtual:2x24GiB".into(),
                    ));
                };
                let (rest, bandwidth) = match rest.split_once('@') {
                    Some((r, bw)) => (r, Some(parse_bandwidth(item, bw)?)),
                    None => (rest, None),
                };
                let (count, cap) = match rest.split_once('x') {
                    Some((c, s)) if !c.is_empty() && c.chars().all(|ch| ch.is_ascii_digit()) => {
                        let n: u32 = c
                            .parse()
                            .map_err(|_| err(item, format!("bad device count '{c}'")))?;
                        (n, s)
                    }
                    _ => (1, rest),
                };
                if count == 0 || count > 1024 {
                    return Err(err(
                        item,
                        format!("expected 1..=1024 virtual devices, got {count}"),
                    ));
                }
                let capacity = size(item, cap)?;
                for _ in 0..count {
                    let mut d = one(
                        format!("virtual:{n_virtual}"),
                        DeviceKind::Virtual,
                        n_virtual,
                        Some(capacity),
                    );
                    d.bandwidth = bandwidth;
                    out.push(d);
                    n_virtual += 1;
                }
            }
            other => {
                return Err(err(
                    item,
                    format!(
                        "unknown device kind '{other}'; expected cpu, cuda:N, virtual:SIZE or disk"
                    ),
                ));
            }
        }
    }
    for (i, d) in out.iter().enumerate() {
        if let Some(first) = out[..i].iter().find(|o| o.name == d.name) {
            let as_written = match (&first.alias, &d.alias) {
                (None, None) => String::new(),
                (a, b) => format!(
                    " (as {} and {})",
                    a.as_deref().unwrap_or(&first.name),
                    b.as_deref().unwrap_or(&d.name)
                ),
            };
            return Err(err(
                spec,
                format!("device {} is listed twice{as_written}", d.name),
            ));
        }
    }
    Ok(out)
}

/// Parse a device spec string, filling unknown capacities from `probe`.
pub fn parse_devices_with(spec: &str, probe: &dyn MemoryProbe) -> Result<Vec<DeviceSpec>> {
    let mut out = Vec::new();
    for d in parse_device_items(spec)? {
        if d.kind == DeviceKind::Cuda {
            out.push(cuda_spec(
                d.ordinal,
                d.capacity,
                d.capability,
                &d.label(),
                probe,
            )?);
            continue;
        }
        let capacity = match (d.kind, d.capacity) {
            (_, Some(c)) => c,
            (DeviceKind::Cpu, None) => probe.cpu_available().unwrap_or(u64::MAX),
            (_, None) => u64::MAX,
        };
        out.push(DeviceSpec::new(d.name, d.kind, capacity));
    }
    Ok(out)
}

/// Normalise a device name as users write it (`"0"` is the first accelerator, `"CUDA:1"`,
/// `"gpu:1"`, `"cpu"`) against an inventory. Returns the index into `devices`.
pub fn resolve_device(devices: &[DeviceSpec], name: &str, context: &str) -> Result<usize> {
    let n = canonical_device_name(name);
    let found = if let Ok(i) = n.parse::<usize>() {
        devices
            .iter()
            .enumerate()
            .filter(|(_, d)| d.kind.is_accelerator())
            .nth(i)
            .map(|(j, _)| j)
    } else {
        devices.iter().position(|d| d.name == n)
    };
    found.ok_or_else(|| PlanError::UnknownDevice {
        device: name.to_string(),
        context: context.to_string(),
        known: devices
            .iter()
            .map(|d| d.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct FakeProbe;
    impl MemoryProbe for FakeProbe {
        fn cpu_available(&self) -> Option<u64> {
            Some(64 << 30)
        }
        fn cuda(&self, ordinal: u32) -> Option<(u64, u64)> {
            (ordinal < 2).then_some((20 << 30, 24 << 30))
        }
    }

    #[test]
    fn kind_names_are_the_spec_grammar_and_the_json_names() {
        for d in parse_devices("virtual:1GiB,cpu:1GiB,disk").unwrap() {
            assert!(d.name.starts_with(d.kind.name()), "{}", d.name);
            let json = serde_json::to_string(&d.kind).unwrap();
            assert_eq!(json, format!("\"{}\"", d.kind.name()));
        }
        assert_eq!(DeviceKind::Cuda.name(), "cuda");
    }

    #[test]
    fn the_view_shows_an_unbounded_capacity_as_none_and_the_overhead_as_rows() {
        let [gpu, disk] = parse_devices("cuda:0:1GiB:sm_90,disk")
            .unwrap()
            .try_into()
            .unwrap();
        let view = serde_json::to_value(gpu.view()).unwrap();
        assert_eq!(view["capacity"], 1u64 << 30);
        assert_eq!(view["overhead"], gpu.overhead.total());
        let parts = gpu.overhead.parts();
        assert_eq!(view["overhead_parts"][0][0], parts[0].name.as_str());
        assert_eq!(view["overhead_parts"][0][1], parts[0].bytes);
        let view = serde_json::to_value(disk.view()).unwrap();
        assert!(view["capacity"].is_null(), "{view}");
        assert_eq!(view["overhead_parts"], serde_json::json!([]));
    }

    #[test]
    fn parses_the_documented_forms() {
        let d = parse_devices("virtual:24GiB,virtual:12GiB,cpu:64GiB,disk").unwrap();
        let names: Vec<_> = d.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["virtual:0", "virtual:1", "cpu", "disk"]);
        assert_eq!(d[0].capacity, 24 << 30);
        assert_eq!(d[1].capacity, 12 << 30);
        assert_eq!(d[2].capacity, 64 << 30);
        assert_eq!(d[3].capacity, u64::MAX);

        let d = parse_devices("virtual:2x24GiB").unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].name, "virtual:1");
        assert_eq!(d[1].kind, DeviceKind::Virtual);

        let d = parse_devices("cpu").unwrap();
        assert_eq!(d[0].capacity, u64::MAX);

        let d = parse_devices("cuda:0:24GiB, CUDA:1:8GB").unwrap();
        assert_eq!(d[1].name, "cuda:1");
        assert_eq!(d[1].capacity, 8_000_000_000);
    }

    #[test]
    fn virtual_devices_take_a_link_bandwidth() {
        let d = parse_device_items("virtual:2x8GiB@16GB/s,virtual:1GiB,cpu").unwrap();
        assert_eq!(d[0].capacity, Some(8 << 30));
        assert_eq!(d[0].bandwidth, Some(16_000_000_000));
        assert_eq!(d[1].bandwidth, Some(16_000_000_000));
        assert_eq!(d[2].bandwidth, None);
        assert_eq!(
            parse_device_items("virtual:1GiB@512MiB/s").unwrap()[0].bandwidth,
            Some(512 << 20)
        );
        for (bad, says) in [
            ("virtual:1GiB@16GB", "expected a bandwidth such as 16GB/s"),
            ("virtual:1GiB@0GB/s", "never finishes"),
            ("virtual:1GiB@fast/s", "bandwidth 'fast/s'"),
        ] {
            let e = parse_device_items(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn probes_fill_unknown_sizes() {
        let d = parse_devices_with("cuda:0,cuda:1,cpu", &FakeProbe).unwrap();
        assert_eq!(d[0].capacity, 20 << 30);
        assert_eq!(d[2].capacity, 64 << 30);
        let e = parse_devices_with("cuda:5", &FakeProbe)
            .unwrap_err()
            .to_string();
        assert!(e.contains("capacity of cuda:5 is unknown"), "{e}");
    }

    /// A probe that measured cuda:0's context at 300 MiB (16 MiB of modules to come) and reads
    /// free memory inside it.
    struct MeasuringProbe;
    impl MemoryProbe for MeasuringProbe {
        fn cpu_available(&self) -> Option<u64> {
            None
        }
        fn cuda(&self, ordinal: u32) -> Option<(u64, u64)> {
            (ordinal == 0).then_some((20 << 30, 24 << 30))
        }
        fn cuda_overhead(&self, ordinal: u32) -> Option<CudaOverhead> {
            (ordinal == 0).then(|| CudaOverhead::measured((8, 9), 300 << 20, 16 << 20))
        }
    }

    #[test]
    fn cuda_devices_carry_their_overhead() {
        use crate::overhead::{CONTEXT, CUBLAS, GRAPHS};
        // Without a probe: the defaults for the capability the spec names, else the largest.
        let d = parse_devices("cuda:0:24GiB:sm_90,cuda:1:8GiB,virtual:1GiB,cpu").unwrap();
        assert_eq!(d[0].capacity, 24 << 30);
        assert_eq!(
            d[0].overhead,
            CudaOverhead::default_for(Some((9, 0))).into()
        );
        let names: Vec<_> = d[0]
            .overhead
            .parts()
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(names, [CONTEXT, CUBLAS, GRAPHS]);
        assert_eq!(d[1].overhead, CudaOverhead::default_for(None).into());
        assert!(d[2].overhead.parts().is_empty() && d[3].overhead.parts().is_empty());
        assert_eq!(
            parse_device_items("cuda:2:sm_120").unwrap()[0].capability,
            Some((12, 0))
        );
        for (bad, says) in [
            ("cuda:0:sm_9", "sm_XY"),
            ("cuda:0:sm_90:8GiB", "unexpected '8gib'"),
            ("cuda:0:8GiB:4GiB", "unexpected '4gib'"),
        ] {
            let e = parse_devices(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // A probe that measured the context: its overhead wins over the spec's capability, and
        // the context it holds while reading free memory is added back to the capacity.
        let d = parse_devices_with("cuda:0:sm_90,cuda:0:sm_90", &MeasuringProbe);
        assert!(d.is_err(), "listed twice");
        let d = parse_devices_with("cuda:0:sm_90", &MeasuringProbe).unwrap();
        assert_eq!(d[0].capacity, (20 << 30) + (300 << 20));
        assert_eq!(
            d[0].overhead,
            CudaOverhead::measured((8, 9), 300 << 20, 16 << 20).into()
        );
        let given = parse_devices_with("cuda:0:16GiB", &MeasuringProbe).unwrap();
        assert_eq!(
            given[0].capacity,
            16 << 30,
            "a given capacity stays as given"
        );
        // A probe that cannot measure: free memory as read, the defaults charged.
        let d = parse_devices_with("cuda:1", &FakeProbe).unwrap();
        assert_eq!(d[0].capacity, 20 << 30);
        assert_eq!(
            d[0].overhead.total(),
            CudaOverhead::default_for(None).total()
        );
        let inv = inventory(&MeasuringProbe);
        assert_eq!(inv[0].capacity, (20 << 30) + (300 << 20));
        assert_eq!(inv[0].overhead.total(), (316 + 4 + 8) << 20);
    }

    #[test]
    fn inventory_lists_gpus_then_cpu() {
        let d = inventory(&FakeProbe);
        let names: Vec<_> = d.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["cuda:0", "cuda:1", "cpu"]);
        assert_eq!(d[1].capacity, 20 << 30);
        assert_eq!(inventory(&NoProbe).len(), 1);
    }

    #[test]
    fn garbage_is_rejected_clearly() {
        let e = parse_devices("tpu:0").unwrap_err().to_string();
        assert!(e.contains("unknown device kind 'tpu'"), "{e}");
        let e = parse_devices("cuda:0").unwrap_err().to_string();
        assert!(e.contains("give it as cuda:0:24GiB"), "{e}");
        let e = parse_devices("virtual:0x1GiB").unwrap_err().to_string();
        assert!(e.contains("expected 1..=1024"), "{e}");
        let e = parse_devices("virtual:lots").unwrap_err().to_string();
        assert!(e.contains("invalid size"), "{e}");
        assert!(parse_devices("").is_err());
        assert!(parse_devices("cpu,,disk").is_err());
        let e = parse_devices("cpu,cpu").unwrap_err().to_string();
        assert!(e.contains("listed twice"), "{e}");
        assert!(parse_devices("disk:1GiB").is_err());
    }

    /// The real probe on a machine without CUDA: no free memory to read, and a reason.
    struct NoCudaProbe;
    impl MemoryProbe for NoCudaProbe {
        fn cpu_available(&self) -> Option<u64> {
            Some(64 << 30)
        }
        fn cuda(&self, _ordinal: u32) -> Option<(u64, u64)> {
            None
        }
        fn cuda_unavailable(&self, _ordinal: u32) -> Option<String> {
            Some("libcuda.so.1 not found: install the NVIDIA driver".into())
        }
    }

    #[test]
    fn a_bare_cuda_device_without_cuda_is_cuda_unavailable() {
        let e = parse_devices_with("cuda:0,cpu", &NoCudaProbe).unwrap_err();
        assert!(matches!(e, PlanError::CudaUnavailable { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "device cuda:0: cuda is unavailable: libcuda.so.1 not found: install the NVIDIA \
             driver; plan() and fit() plan for it without a GPU when its size is given \
             (cuda:0:24GiB); to run here, use cpu or simulated accelerators (virtual:24GiB)"
        );
        // The spec's spelling is kept where the item is echoed.
        let e = parse_devices_with("virtual:1GiB,GPU:1", &NoCudaProbe)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("device gpu:1 (cuda:1): cuda is unavailable: libcuda.so.1 not found")
                && e.contains("(cuda:1:24GiB)"),
            "{e}"
        );
        // With a size it is a what-if plan, which needs no GPU.
        let d = parse_devices_with("cuda:0:24GiB,gpu:1:8GiB", &NoCudaProbe).unwrap();
        assert_eq!(d[0].capacity, 24 << 30);
        assert_eq!(d[1].name, "cuda:1");
        // A probe that cannot tell why (none at all) asks for the size.
        let e = parse_devices("gpu:0").unwrap_err();
        assert!(matches!(e, PlanError::DeviceSpec { .. }), "{e:?}");
        assert!(
            e.to_string()
                .starts_with("invalid device spec 'gpu:0 (cuda:0)': capacity of cuda:0")
                && e.to_string().contains("give it as cuda:0:24GiB"),
            "{e}"
        );
    }

    #[test]
    fn gpu_is_another_spelling_of_cuda_and_errors_say_what_was_written() {
        let d = parse_device_items("gpu:0:8GiB,Cuda:1:4GiB").unwrap();
        assert_eq!(
            (d[0].name.as_str(), d[0].kind),
            ("cuda:0", DeviceKind::Cuda)
        );
        assert_eq!(d[0].alias.as_deref(), Some("gpu:0"));
        assert_eq!(d[0].label(), "gpu:0 (cuda:0)");
        assert_eq!(
            (d[1].alias.as_deref(), d[1].label()),
            (None, "cuda:1".into())
        );
        let e = parse_devices("cuda:0:1GiB,gpu:0:2GiB")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("device cuda:0 is listed twice (as cuda:0 and gpu:0)"),
            "{e}"
        );
        let e = parse_devices("gpu:x").unwrap_err().to_string();
        assert!(e.contains("'gpu:x'") && e.contains("gpu:N"), "{e}");
        // Names given elsewhere take the alias too.
        let d = parse_devices("cpu,cuda:0:1GiB,cuda:1:1GiB").unwrap();
        assert_eq!(resolve_device(&d, "gpu:1", "device_map").unwrap(), 2);
        assert_eq!(canonical_device_name(" GPU:0 "), "cuda:0");
        assert_eq!(canonical_device_name("Virtual:2"), "virtual:2");
    }

    #[test]
    fn resolves_names() {
        let d = parse_devices("cpu,virtual:2x1GiB").unwrap();
        assert_eq!(resolve_device(&d, "1", "test").unwrap(), 2);
        assert_eq!(resolve_device(&d, "Virtual:0", "test").unwrap(), 1);
        let e = resolve_device(&d, "cuda:3", "device_map")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown device 'cuda:3' in device_map"), "{e}");
    }
}

//! Each device's workspace during one forward call, in the form its compute path uses: f32
//! views for the host path, backend regions for the op sequence.

use weightlift_kernels::{CpuBackend, CpuBuffer, CudaBackend, CudaBuffer};

use super::exec::Regions;
use super::onload::SlotMem;
use super::{Site, SiteExec, Views, carve};
use crate::device::Buffer;
use crate::error::{EngineError, Result, invalid};

/// Runs `$host` with the host path's views, or `$gen` (one body, compiled for each backend)
/// with a backend and its regions.
macro_rules! on_site {
    ($work:expr, $v:ident => $host:expr, ($b:ident, $r:ident) => $gen:expr) => {
        match $work {
            Work::Host($v) => $host,
            Work::Cpu($b, $r) => $gen,
            Work::Cuda($b, $r) => $gen,
        }
    };
}
pub(super) use on_site;

/// One device's workspace for a forward call, as its path sees it.
// One per device per forward call, built once and never moved: the sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum Work<'a> {
    /// The host path: f32 slices of host memory.
    Host(Views<'a>),
    /// The backend path on the CPU backend, over the same host memory.
    Cpu(&'a CpuBackend, Regions<'a, CpuBuffer>),
    /// The backend path on a CUDA device.
    Cuda(&'a CudaBackend, Regions<'a, CudaBuffer>),
}

/// The onload slots' memory, each taken while a copy into it is in flight.
pub(super) type OnloadSlots<'a> = Vec<Option<SlotMem<'a>>>;

/// Every site's workspace at once (distinct buffers), as its path sees it, and the onload slots:
/// the tail of the execution device's workspace buffer, when `onload_site` is `(site, slot
/// bytes, slots)`.
pub(super) fn site_works<'a>(
    sites: &'a mut [Site],
    scratch: &'a mut [Buffer],
    onload_site: Option<(usize, usize, usize)>,
) -> Result<(Vec<Work<'a>>, OnloadSlots<'a>)> {
    let mut spare: Vec<Option<&mut Buffer>> = scratch.iter_mut().map(Some).collect();
    let mut works: Vec<Work<'_>> = Vec::with_capacity(sites.len());
    let mut slot_mem: OnloadSlots<'a> = Vec::new();
    let slots_of = |site: usize| match onload_site {
        Some((os, per, n)) if os == site => (per, n),
        _ => (0, 0),
    };
    for (si, s) in sites.iter_mut().enumerate() {
        let Site {
            device,
            layout,
            own,
            scratch,
            exec,
            ..
        } = s;
        let buf = match (own, *scratch) {
            (Some(b), _) => b,
            (None, Some(i)) => spare[i].take().ok_or_else(|| {
                invalid("forward workspaces", "one per device", "a shared buffer")
            })?,
            (None, None) => {
                return Err(invalid(
                    "forward workspace",
                    "a buffer",
                    format!("none on {}", device.name()),
                ));
            }
        };
        let work = match exec {
            SiteExec::Host => {
                let name = device.name().to_owned();
                let bytes = buf.host_mut().ok_or_else(|| EngineError::Device {
                    device: name,
                    detail: "the host forward pass needs a workspace in host memory".into(),
                })?;
                let bytes = match onload_site {
                    Some((os, per, n)) if os == si => {
                        let ws = layout.bytes as usize;
                        if bytes.len() < ws + per * n {
                            return Err(invalid(
                                format!("scratch on {}", device.name()),
                                format!("{} bytes: workspace and {n} onload slot(s)", ws + per * n),
                                format!("{}; the model was loaded for another plan", bytes.len()),
                            ));
                        }
                        let (ws, mut tail) = bytes.split_at_mut(ws);
                        for _ in 0..n {
                            let (slot, rest) = std::mem::take(&mut tail).split_at_mut(per);
                            slot_mem.push(Some(SlotMem::Host(slot)));
                            tail = rest;
                        }
                        ws
                    }
                    _ => bytes,
                };
                Work::Host(carve(bytes, layout)?)
            }
            SiteExec::Cpu(b) => {
                let (r, slots) = Regions::new(b, buf, layout, slots_of(si))?;
                slot_mem.extend(slots.into_iter().map(|p| Some(SlotMem::Cpu(p))));
                Work::Cpu(b, r)
            }
            SiteExec::Cuda => {
                let b = device.backend()?;
                let (r, slots) = Regions::new(b, buf, layout, slots_of(si))?;
                for p in slots {
                    slot_mem.push(Some(SlotMem::cuda(b, p)?));
                }
                Work::Cuda(b, r)
            }
        };
        works.push(work);
    }
    Ok((works, slot_mem))
}

//! Offloaded execution (`offload="sequential" | "group"`): layers whose weights stay on `cpu`
//! or `disk` run on the execution device, their matrices copied into onload slots there first.
//! The slots are the tail of that device's planned scratch, after its workspace, so what the
//! plan counted is what is held. With two slots the next group is copied by a background
//! copier while the current one computes (a copy stream's work on a GPU); a slot keeps its
//! group across forward calls, so a model with as many groups as slots copies each only once.
//!
//! A matrix is one tensor in the slot; a packed (GPTQ, EXL2) linear is the tensors its product
//! reads, back to back (see [`super::weights::PackedLinear::tensors`]), which the host path
//! reads there. The planner sizes the slot for the same tensors.
//!
//! The copier is one thread per forward call, started with the first offloaded group and
//! blocked on its queue between copies. A thread spawned per group started a millisecond or
//! more after the spawn on a busy two-core host (a new thread queues behind the compute
//! threads, a woken one does not), longer than a decode layer's compute; and the forward pass
//! waits for a prefetch only when it reaches the group being copied, so the copy overlaps every
//! layer of the current group, not the first one alone.
//!
//! On a cuda execution device the slots are regions of its workspace buffer ([`SlotMem`]), the
//! layers read their matrices there through the backend, and every fill of a slot is queued on
//! the device's copy stream ([`CopyStream`]), so it overlaps the kernels of the compute stream.
//! The copy stream is the one the device's backend keeps: a forward call per decoded token pins
//! no staging memory of its own, and the onload state (built by the graph) needs no GPU handle.
//! The host memory of every offloaded matrix is page-locked once, when the graph is built
//! ([`Onload::pin`]), so each fill is DMA straight from where the model holds the weights; what
//! the driver will not lock goes through the copy stream's pinned staging (a host `memcpy`
//! first), and the model's warnings say how much.
//! Two events order the streams, neither a host wait:
//! - before a slot is refilled the copy stream waits for the kernels queued so far, which
//!   include every read of the group the slot held; it is asked on the forward thread when the
//!   fill is handed out, so the current group's kernels, queued after that, overlap the copy;
//! - before the first layer that reads a filled slot the compute stream waits for the copy
//!   stream; it is asked before the next group's copy is handed out, so it waits for this
//!   group's copies only. Each call waits so once per slot even when the slot was filled by the
//!   previous call (group 0, prefetched at its end), and a slot's copies not yet waited for
//!   when its memory drops are waited for then, so nothing the compute stream does with that
//!   memory later (another call's kernels, freeing it) overtakes them.
//!
//! A cuda copy's count and time are those of queuing it (an upload returns once queued). On the
//! host and the CPU backend a fill is a memcpy in order with the layers, and neither event
//! applies. The cuda path is compile-checked only: it has not run on a GPU.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::Instant;

use std::sync::Arc;

use weightlift_kernels::{Backend, CopyStream, CpuBuffer, CudaBackend, CudaBuffer, HostPins};

use crate::device::pace;
use crate::error::{EngineError, Result, invalid};
use crate::model::Held;

use super::Copies;
use super::exec::{PartMut, kernel_on};
use super::layer::weight_of;
use super::parts::Layer;

/// One onload slot's memory: the tail of the execution device's workspace, as the path that
/// computes there sees it.
pub(crate) enum SlotMem<'w> {
    /// Host memory, for the host path.
    Host(&'w mut [u8]),
    /// Host memory as a CPU backend buffer.
    Cpu(PartMut<'w, CpuBuffer>),
    /// Device memory of a cuda device, filled through its copy stream.
    Cuda(CudaSlot<'w>, PartMut<'w, CudaBuffer>),
}

/// How a slot of a cuda device is filled: the device's copy stream, and whether the compute
/// stream has been ordered after the copies into the slot (see the module docs).
pub(crate) struct CudaSlot<'w> {
    backend: &'w CudaBackend,
    copy: CopyStream,
    /// Copies into the slot that the compute stream has not been made to wait for.
    unfenced: bool,
    /// The page-locked host memory the groups are copied from (see [`Onload::pin`]).
    pins: Option<Arc<HostPins>>,
}

impl Drop for CudaSlot<'_> {
    /// The compute stream waits for the copies into the slot not yet waited for, so that what
    /// it does next with this memory (another call's kernels, freeing it) comes after them.
    fn drop(&mut self) {
        if self.unfenced {
            // Nothing to report to from a drop; the next call waits for the slot again anyway.
            let _ = self.copy.before_compute(self.backend);
        }
    }
}

impl<'w> SlotMem<'w> {
    /// A slot of cuda device `b`, filled through its copy stream. Marked as not waited for: a
    /// group the previous call left in it may still be in copy.
    pub fn cuda(b: &'w CudaBackend, part: PartMut<'w, CudaBuffer>) -> Result<SlotMem<'w>> {
        let copy = b
            .copy_stream()
            .map_err(|e| kernel_on(&b.name(), "onload copy stream", e))?;
        let slot = CudaSlot {
            backend: b,
            copy,
            unfenced: true,
            pins: None,
        };
        Ok(SlotMem::Cuda(slot, part))
    }
}

impl SlotMem<'_> {
    /// Copies into a cuda slot go straight from `pins` where they cover the source.
    pub fn use_pins(&mut self, pins: &Arc<HostPins>) {
        if let SlotMem::Cuda(s, _) = self {
            s.pins = Some(Arc::clone(pins));
        }
    }

    /// The slot's bytes, where the host reads them.
    pub fn host(&self) -> Option<&[u8]> {
        match self {
            SlotMem::Host(b) => Some(b),
            SlotMem::Cpu(p) => Some(p.as_bytes()),
            SlotMem::Cuda(..) => None,
        }
    }

    fn len(&self) -> usize {
        match self {
            SlotMem::Host(b) => b.len(),
            SlotMem::Cpu(p) => p.as_bytes().len(),
            SlotMem::Cuda(s, p) => s.backend.len(p),
        }
    }

    /// Before the slot is refilled, on the forward thread: on a cuda device the copy stream
    /// waits for the kernels queued so far (every read of the group the slot held). Nothing to
    /// do on the host, where a fill is in order with the layers.
    fn before_refill(&self) -> Result<()> {
        if let SlotMem::Cuda(s, _) = self {
            let name = s.backend.name();
            s.copy
                .after_compute(s.backend)
                .map_err(|e| kernel_on(&name, "onload copy after compute", e))?;
        }
        Ok(())
    }

    /// Before a layer reads the slot: on a cuda device the compute stream waits for the copies
    /// into it, once per fill. Called before the next group's copy is handed out.
    fn before_read(&mut self) -> Result<()> {
        if let SlotMem::Cuda(s, _) = self
            && s.unfenced
        {
            let name = s.backend.name();
            s.copy
                .before_compute(s.backend)
                .map_err(|e| kernel_on(&name, "onload compute after copy", e))?;
            s.unfenced = false;
        }
        Ok(())
    }

    /// Copies `src` into the slot from byte `at` (checked to fit).
    fn write(&mut self, src: &[u8], at: usize) -> Result<()> {
        let len = self.len();
        let range = at
            .checked_add(src.len())
            .filter(|&end| end <= len)
            .map(|end| at..end)
            .ok_or_else(|| {
                invalid(
                    "onload copy",
                    format!("{} bytes in the slot from offset {at}", src.len()),
                    format!("a slot of {len} bytes"),
                )
            })?;
        match self {
            SlotMem::Host(b) => b[range].copy_from_slice(src),
            SlotMem::Cpu(p) => p.as_bytes_mut()[range].copy_from_slice(src),
            SlotMem::Cuda(s, p) => {
                s.unfenced = true;
                match &s.pins {
                    Some(pins) => s.copy.upload_from(pins, src, p, at),
                    None => s.copy.upload(src, p, at),
                }
                .map_err(|e| kernel_on(&s.backend.name(), "onload copy", e))?
            }
        }
        Ok(())
    }
}

/// The onload state of a graph.
#[derive(Debug)]
pub(crate) struct Onload {
    /// The site the offloaded layers compute on.
    pub site: usize,
    /// Layer indices per group, in execution order.
    pub groups: Vec<Vec<usize>>,
    pub slot_bytes: usize,
    /// The group each slot holds now; one entry per slot.
    pub holds: Vec<Option<usize>>,
    /// The simulated link rate from where the weights are to the execution device.
    pub rate: Option<u64>,
    /// On a cuda execution device, the host memory every group is copied from, page-locked
    /// so its copies go straight from there (see [`Onload::pin`]).
    pub pins: Option<Arc<HostPins>>,
    /// What [`Onload::pin`] could not lock, until the model takes it into its warnings.
    pub pin_warning: Option<String>,
}

impl Onload {
    pub fn slots(&self) -> usize {
        self.holds.len()
    }

    /// Bytes of every slot together.
    pub fn bytes(&self) -> usize {
        self.slot_bytes * self.slots()
    }

    /// Lay out each group's matrices in a slot: sets `Layer::group` and every matrix's offset,
    /// checking that the largest group fits the planned slot. A packed (GPTQ, EXL2) linear
    /// takes the tensors its product reads, back to back from its offset.
    pub fn assign(&self, layers: &mut [Layer], held: &[Held]) -> Result<()> {
        for (g, group) in self.groups.iter().enumerate() {
            let mut at = 0usize;
            for &li in group {
                let layer = layers
                    .get_mut(li)
                    .ok_or_else(|| invalid("offloaded layer", "a layer of the model", li))?;
                layer.group = Some(g);
                for lin in layer.linears_mut() {
                    lin.onload_at = Some(at);
                    let tensors = match &lin.packed {
                        Some(p) => p.tensors().to_vec(),
                        None => vec![lin.index()],
                    };
                    for i in tensors {
                        let whole = lin.packed.is_some();
                        let Some(Held::Whole { tensor, .. }) = held.get(i) else {
                            return Err(invalid(
                                format!("offloaded tensor '{}'", lin.name),
                                "a whole tensor held by the model",
                                "a split or missing one",
                            ));
                        };
                        // a block of a stacked matrix takes its own rows only
                        let nbytes = tensor.nbytes() as usize;
                        at += if whole {
                            nbytes
                        } else {
                            lin.byte_range(nbytes).1
                        };
                    }
                }
            }
            if at > self.slot_bytes {
                return Err(invalid(
                    format!("onload group {g}"),
                    format!("at most the planned slot of {} bytes", self.slot_bytes),
                    format!("{at} bytes of matrices; the plan was made for other weights"),
                ));
            }
        }
        Ok(())
    }

    /// On a cuda execution device, page-lock the host memory of every group's matrices held in
    /// RAM (not those the plan keeps on disk), so
    /// that their copies go from there by DMA (at the link's rate, overlapping compute) instead
    /// of through the copy stream's staging buffers, which a host `memcpy` fills first. The
    /// driver may refuse some of it (what it refuses is copied through staging): the returned
    /// warning says how much. Elsewhere nothing to do.
    ///
    /// The pins must go before `held` and `copies` do: the graph holding this onload state is
    /// dropped before the model's tensors (`model::State` declares it first).
    // Registering host memory with the driver is unsafe: see the SAFETY note on the call.
    #[allow(unsafe_code)]
    pub fn pin(
        &mut self,
        device: &crate::device::Device,
        layers: &[Layer],
        held: &[Held],
        copies: &[(usize, Held)],
    ) -> Result<Option<String>> {
        let Some(b) = device.cuda_backend() else {
            return Ok(None);
        };
        let mut ranges = Vec::new();
        for g in 0..self.groups.len() {
            ranges.extend(
                self.parts(g, layers, held, copies)?
                    .into_iter()
                    .map(|p| p.0),
            );
        }
        // Weights the plan keeps on disk stay pageable: locking them would hold in RAM what
        // the plan left out of it.
        let on_disk: Vec<std::ops::Range<usize>> = held
            .iter()
            .filter_map(|h| match h {
                Held::Whole { tensor, device } if device == "disk" => tensor.host_bytes(),
                _ => None,
            })
            .map(|b| b.as_ptr() as usize..b.as_ptr() as usize + b.len())
            .collect();
        ranges.retain(|r| !on_disk.iter().any(|d| d.contains(&(r.as_ptr() as usize))));
        // SAFETY: the ranges are bytes of the model's held tensors (mapped from the checkpoint
        // or owned), which outlive the graph this state belongs to (see above) and which
        // nothing writes while the model is loaded.
        let pins = unsafe { b.pin_host(&ranges) };
        let warning = match pins.refused() {
            (0, _) => None,
            (bytes, why) => Some(format!(
                "{bytes} bytes of offloaded weights could not be page-locked for {} ({}); \
                 their copies go through staging, at the speed of a host memcpy",
                device.name(),
                why.unwrap_or("no reason given")
            )),
        };
        self.pins = Some(Arc::new(pins));
        Ok(warning)
    }

    /// Where each matrix of group `g` comes from and where it goes in the slot.
    pub fn parts<'a>(
        &self,
        g: usize,
        layers: &[Layer],
        held: &'a [Held],
        copies: &'a [(usize, Held)],
    ) -> Result<Vec<(&'a [u8], usize)>> {
        let mut out = Vec::new();
        for &li in &self.groups[g] {
            for lin in layers[li].linears() {
                let mut at = lin.onload_at.unwrap_or(0);
                match &lin.packed {
                    Some(p) => {
                        for (src, _) in p.parts(held, None, &lin.name)? {
                            out.push((src, at));
                            at += src.len();
                        }
                    }
                    None => out.push((weight_of(held, copies, lin, None)?.0, at)),
                }
            }
        }
        Ok(out)
    }
}

/// Copy `parts` into `slot`, then sleep out what the link would take longer (a paced copy
/// costs no CPU while it waits). One wait per group rather than one per part: each wake-up
/// queues for a core behind the compute threads. Returns the copy's count, bytes and time.
pub(crate) fn fill(
    parts: &[(&[u8], usize)],
    slot: &mut SlotMem<'_>,
    rate: Option<u64>,
) -> Result<Copies> {
    let since = Instant::now();
    let mut bytes = 0u64;
    for &(src, at) in parts {
        slot.write(src, at)?;
        bytes += src.len() as u64;
    }
    pace(rate, bytes, since);
    let mut c = Copies::default();
    c.note(bytes, since);
    Ok(c)
}

/// One group to copy: its parts, and the slot they go to (lent to the copier until it is done).
struct Job<'w> {
    group: usize,
    slot: usize,
    mem: SlotMem<'w>,
    parts: Vec<(&'w [u8], usize)>,
    rate: Option<u64>,
}

/// A finished copy: the group, its slot handed back, and the copy's result.
type Done<'w> = (usize, usize, SlotMem<'w>, Result<Copies>);

/// The background copier of one forward call (see the module docs).
pub(crate) struct Copier<'s, 'w> {
    jobs: Sender<Job<'w>>,
    done: Receiver<Done<'w>>,
    /// The group being copied and its slot.
    in_flight: Option<(usize, usize)>,
    _thread: ScopedJoinHandle<'s, ()>,
}

impl<'s, 'w: 's> Copier<'s, 'w> {
    fn start(scope: &'s Scope<'s, '_>) -> Copier<'s, 'w> {
        let (jobs, queue) = channel::<Job<'w>>();
        let (finished, done) = channel();
        let thread = scope.spawn(move || {
            // Ends when the forward call drops its sender.
            for mut j in queue {
                let r = fill(&j.parts, &mut j.mem, j.rate);
                if finished.send((j.group, j.slot, j.mem, r)).is_err() {
                    return;
                }
            }
        });
        Copier {
            jobs,
            done,
            in_flight: None,
            _thread: thread,
        }
    }

    fn stopped() -> EngineError {
        EngineError::Device {
            device: "cpu".into(),
            detail: "the onload copier thread stopped before its copy was done".into(),
        }
    }

    fn post(&mut self, job: Job<'w>) -> Result<()> {
        self.in_flight = Some((job.group, job.slot));
        self.jobs.send(job).map_err(|_| Self::stopped())
    }

    /// Wait for the copy in flight: its group, slot, slot memory and result.
    fn wait(&mut self) -> Result<Done<'w>> {
        self.in_flight = None;
        self.done.recv().map_err(|_| Self::stopped())
    }
}

/// Make group `g` resident in its slot (`g mod slots`), waiting for its prefetch or copying it
/// now, then hand the next group to the copier for the other slot when there are two. Returns
/// the slot that holds `g`. Called before every offloaded layer; it waits for the copier only
/// when `g` or its slot is what is being copied.
#[allow(clippy::too_many_arguments)]
pub(crate) fn onload_group<'s, 'w: 's, 'h: 'w>(
    o: &mut Onload,
    g: usize,
    layers: &[Layer],
    held: &'h [Held],
    copies: &'h [(usize, Held)],
    slot_mem: &mut [Option<SlotMem<'w>>],
    copier: &mut Option<Copier<'s, 'w>>,
    scope: &'s Scope<'s, '_>,
    made: &mut Copies,
) -> Result<usize> {
    let slots = o.slots();
    let si = g % slots;
    let prefetch = slots > 1 && o.groups.len() > 1;
    if prefetch && copier.is_none() {
        // Started now, while this group is copied, so it is waiting when the next one is due.
        *copier = Some(Copier::start(scope));
    }
    if let Some(c) = copier.as_mut()
        && c.in_flight.is_some_and(|(pg, ps)| pg == g || ps == si)
    {
        let (pg, ps, mem, r) = c.wait()?;
        slot_mem[ps] = Some(mem);
        made.add(r?);
        o.holds[ps] = Some(pg);
    }
    let lost = || invalid("onload slot", "free for a copy", "in use by a prefetch");
    if o.holds[si] != Some(g) {
        o.holds[si] = None;
        let parts = o.parts(g, layers, held, copies)?;
        let mem = slot_mem[si].as_mut().ok_or_else(lost)?;
        mem.before_refill()?;
        made.add(fill(&parts, mem, o.rate)?);
        o.holds[si] = Some(g);
    }
    // before the next copy is queued, so that the layers wait for this group's copies only
    slot_mem[si].as_mut().ok_or_else(lost)?.before_read()?;
    let next = g + 1;
    if let Some(c) = copier.as_mut()
        && next < o.groups.len()
        && o.holds[next % slots] != Some(next)
        && c.in_flight.is_none()
    {
        let sj = next % slots;
        let parts = o.parts(next, layers, held, copies)?;
        slot_mem[sj].as_ref().ok_or_else(lost)?.before_refill()?;
        let mem = slot_mem[sj].take().ok_or_else(lost)?;
        o.holds[sj] = None;
        c.post(Job {
            group: next,
            slot: sj,
            mem,
            parts,
            rate: o.rate,
        })?;
    }
    Ok(si)
}

/// After the last layer of a chunk: hand group 0 to the copier for its slot, when it is not
/// resident and the slot is free, so that its copy overlaps the head (and the next call or
/// chunk finds it in place) instead of starting the next pass with a synchronous copy. With
/// prefetch off, or every group resident, there is nothing to do.
pub(crate) fn prefetch_first<'s, 'w: 's, 'h: 'w>(
    o: &mut Onload,
    layers: &[Layer],
    held: &'h [Held],
    copies: &'h [(usize, Held)],
    slot_mem: &mut [Option<SlotMem<'w>>],
    copier: &mut Option<Copier<'s, 'w>>,
) -> Result<()> {
    let slots = o.slots();
    let Some(c) = copier.as_mut() else {
        return Ok(());
    };
    if o.groups.len() <= slots || o.holds[0] == Some(0) || c.in_flight.is_some() {
        return Ok(());
    }
    let Some(mem) = slot_mem[0].as_ref() else {
        return Ok(());
    };
    // the head's kernels, queued after this, overlap the copy
    mem.before_refill()?;
    let Some(mem) = slot_mem[0].take() else {
        return Ok(());
    };
    o.holds[0] = None;
    let parts = o.parts(0, layers, held, copies)?;
    c.post(Job {
        group: 0,
        slot: 0,
        mem,
        parts,
        rate: o.rate,
    })
}

/// At the end of a forward call: wait for the copy in flight, if any, so that its slot's
/// record is right for the next call; its bytes count in this call's copies.
pub(crate) fn settle<'s, 'w: 's>(
    o: &mut Onload,
    slot_mem: &mut [Option<SlotMem<'w>>],
    copier: &mut Option<Copier<'s, 'w>>,
    made: &mut Copies,
) -> Result<()> {
    if let Some(c) = copier.as_mut()
        && c.in_flight.is_some()
    {
        let (g, si, mem, r) = c.wait()?;
        slot_mem[si] = Some(mem);
        made.add(r?);
        o.holds[si] = Some(g);
    }
    Ok(())
}

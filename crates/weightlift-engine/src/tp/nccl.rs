//! The NCCL transport (feature `nccl`): one cudarc communicator per rank this process drives,
//! each on its CUDA device's stream.
//!
//! - One process over several local GPUs: [`Nccl::single_process`] (`ncclCommInitAll`).
//! - One process per GPU, across machines: rank 0 makes an id ([`Nccl::unique_id`]), the
//!   launcher hands it to every rank ([`NcclUniqueId::from_env`]), and each builds its
//!   communicator with [`Nccl::for_rank`] (`ncclCommInitRank`). NCCL's own bootstrap finds
//!   the other ranks from the id; nothing here opens a socket.
//!
//! The rank-level collectives stage the host path's f32 activations into device buffers on
//! each rank's stream, run the NCCL collective (grouped, so one thread can drive several
//! communicators without deadlock), and copy the result back. Split tables may give ranks
//! different widths, so the gather is a group of broadcasts (one per owner) and the
//! reduce-scatter a group of reduces (one per owner), the way NCCL's documentation builds the
//! uneven ("v") variants. Point-to-point copies go through [`HostStaged`].
//!
//! Compile-checked only: no build of this module has run against libnccl or a GPU yet.
// cudarc's communicator holds a raw NCCL handle and is not `Send`; the one `unsafe` below says
// why moving it between threads, behind a mutex, is sound.
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id, ReduceOp, group_end, group_start};

use super::host::blocks;
use super::{Collective, NCCL_ID_BYTES, NcclUniqueId, RankSlice, World};
use crate::device::{Device, DeviceKind};
use crate::error::{EngineError, Result, invalid};

/// A communicator and the device it lives on.
struct RankComm {
    comm: Comm,
    device: Arc<Device>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no two threads use it at
// once (NCCL's thread-safety rules); `Nccl` only reaches it through its mutex.
unsafe impl Send for RankComm {}

/// Collectives through NCCL over the ranks this process drives.
pub struct Nccl {
    comms: Mutex<Vec<RankComm>>,
    world_size: usize,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

fn nccl_err(during: impl std::fmt::Display) -> impl FnOnce(NcclError) -> EngineError {
    move |e| EngineError::Device {
        device: "nccl".into(),
        detail: format!("{during}: {:?}", e.0),
    }
}

fn driver_err<E: std::fmt::Debug>(rank: usize, during: &str) -> impl FnOnce(E) -> EngineError {
    move |e| EngineError::Device {
        device: format!("nccl rank {rank}"),
        detail: format!("{during}: {e:?}"),
    }
}

/// libnccl must be loadable before cudarc touches it (cudarc panics without it).
fn require_library() -> Result<()> {
    // SAFETY: only tries to dlopen libnccl by its candidate names.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Ok(());
    }
    Err(EngineError::CudaUnavailable {
        device: "nccl".into(),
        detail: "libnccl.so was not found on the library path; install NCCL (or point \
                 LD_LIBRARY_PATH at a directory holding libnccl.so)"
            .into(),
    })
}

fn stream_of(device: &Arc<Device>) -> Result<Arc<CudaStream>> {
    match device.cuda_backend() {
        Some(b) if device.kind() == DeviceKind::Cuda => Ok(Arc::clone(b.stream())),
        _ => Err(invalid(
            "nccl device",
            "a cuda:N device",
            format!("{}; NCCL moves only CUDA memory", device.name()),
        )),
    }
}

impl Nccl {
    /// A fresh unique id, made on rank 0 and handed to every rank by the launcher.
    pub fn unique_id() -> Result<NcclUniqueId> {
        require_library()?;
        let id = Id::new().map_err(nccl_err("making a unique id (ncclGetUniqueId)"))?;
        let mut out = [0u8; NCCL_ID_BYTES];
        out.iter_mut()
            .zip(id.internal())
            .for_each(|(o, &c)| *o = c as u8);
        Ok(NcclUniqueId(out))
    }

    /// One process driving every rank: `devices[r]` is rank `r` (the split tables' index).
    pub fn single_process(devices: &[Arc<Device>]) -> Result<Nccl> {
        require_library()?;
        let streams = devices.iter().map(stream_of).collect::<Result<Vec<_>>>()?;
        let comms = Comm::from_devices(streams).map_err(nccl_err(format!(
            "ncclCommInitAll over {} devices",
            devices.len()
        )))?;
        Ok(Nccl {
            world_size: devices.len(),
            comms: Mutex::new(
                comms
                    .into_iter()
                    .zip(devices)
                    .map(|(comm, d)| RankComm {
                        comm,
                        device: Arc::clone(d),
                    })
                    .collect(),
            ),
        })
    }

    /// This process's one rank of `world`, on `device` (by convention `cuda:{local_rank}`).
    /// Blocks until every rank of the world has called it with the same id.
    pub fn for_rank(world: &World, device: &Arc<Device>, id: &NcclUniqueId) -> Result<Nccl> {
        require_library()?;
        let stream = stream_of(device)?;
        let internal = id.0.map(|b| b as ::core::ffi::c_char);
        let comm = Comm::from_rank(stream, world.rank, world.world_size, Id::uninit(internal))
            .map_err(nccl_err(format!(
                "ncclCommInitRank for rank {} of {}",
                world.rank, world.world_size
            )))?;
        Ok(Nccl {
            world_size: world.world_size,
            comms: Mutex::new(vec![RankComm {
                comm,
                device: Arc::clone(device),
            }]),
        })
    }

    /// Join the run this process is one rank of, as the launcher's environment describes it
    /// ([`World::from_env`]), and make it `ctx`'s transport: `ctx` must be the context of that
    /// rank's rank-local load. Rank 0 makes the unique id and, where `WEIGHTLIFT_NCCL_ID_FILE`
    /// names a file and `WEIGHTLIFT_NCCL_ID` is unset, writes it there; the other ranks read it
    /// ([`NcclUniqueId::from_env`], waiting up to `wait`). Blocks until every rank has joined.
    pub fn join_from_env(ctx: &mut super::TpContext, wait: Duration) -> Result<World> {
        let world = World::from_env()?;
        if ctx.rank() != Some(world.rank) || ctx.devices().len() != world.world_size {
            return Err(invalid(
                "tp context for the launcher's rank",
                format!(
                    "the context of rank {} of {} (a rank-local load of that rank)",
                    world.rank, world.world_size
                ),
                format!("rank {:?} of {}", ctx.rank(), ctx.devices().len()),
            ));
        }
        let writes = world.rank == 0 && std::env::var_os(super::NCCL_ID_VAR).is_none();
        let id = match std::env::var_os(super::NCCL_ID_FILE_VAR) {
            Some(path) if writes => {
                let id = Nccl::unique_id()?;
                id.write_file(std::path::Path::new(&path))?;
                id
            }
            _ => NcclUniqueId::from_env(wait)?,
        };
        let device = Arc::clone(ctx.device(world.rank)?);
        ctx.set_collective(Box::new(Nccl::for_rank(&world, &device, &id)?));
        Ok(world)
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The ranks this process drives, in order.
    pub fn local_ranks(&self) -> Result<Vec<usize>> {
        Ok(self.lock()?.iter().map(|c| c.comm.rank()).collect())
    }

    fn lock(&self) -> Result<MutexGuard<'_, Vec<RankComm>>> {
        self.comms.lock().map_err(|_| EngineError::Device {
            device: "nccl".into(),
            detail: "the communicator lock was poisoned by a panic in another collective".into(),
        })
    }

    /// Pair each part with its communicator (`parts` sorted to the communicators' order) and
    /// upload its values. Every local rank must take part: NCCL waits for all of them, so a
    /// missing one would hang the others.
    /// `len`, where given, is the number of values every buffer must hold; the collectives of
    /// one count on every rank (all-reduce, broadcast) give the first buffer's, since local
    /// ranks of other counts would run one collective with different sizes, which NCCL does
    /// not check: a hang, or reads past the shorter buffers.
    fn stage<'c>(
        what: &str,
        comms: &'c [RankComm],
        parts: &mut [RankSlice<'_>],
        len: Option<usize>,
    ) -> Result<Vec<(&'c RankComm, CudaSlice<f32>)>> {
        parts.sort_by_key(|p| p.rank);
        let local: Vec<usize> = comms.iter().map(|c| c.comm.rank()).collect();
        let given: Vec<usize> = parts.iter().map(|p| p.rank).collect();
        if local != given {
            return Err(invalid(
                format!("nccl {what}"),
                format!("one buffer for each rank this process drives, {local:?}"),
                format!("ranks {given:?}"),
            ));
        }
        comms
            .iter()
            .zip(parts.iter())
            .map(|(c, p)| {
                if p.device.name() != c.device.name() {
                    return Err(invalid(
                        format!("nccl {what} buffer of rank {}", p.rank),
                        format!("memory of {}", c.device.name()),
                        p.device.name(),
                    ));
                }
                let want = len.unwrap_or(p.values.len());
                if p.values.len() != want {
                    return Err(invalid(
                        format!("nccl {what} buffer of rank {}", p.rank),
                        format!("{want} values"),
                        p.values.len(),
                    ));
                }
                let buf = c
                    .comm
                    .stream()
                    .clone_htod(&*p.values)
                    .map_err(driver_err(p.rank, "uploading the values"))?;
                Ok((c, buf))
            })
            .collect()
    }

    /// Run `enqueue` for every staged rank inside one NCCL group, always closing the group.
    fn grouped(
        staged: &mut [(&RankComm, CudaSlice<f32>)],
        mut enqueue: impl FnMut(&Comm, &mut CudaSlice<f32>) -> Result<(), NcclError>,
    ) -> Result<()> {
        group_start().map_err(nccl_err("ncclGroupStart"))?;
        let queued = staged
            .iter_mut()
            .try_for_each(|(c, buf)| enqueue(&c.comm, buf));
        let ended = group_end().map_err(nccl_err("ncclGroupEnd"));
        queued.map_err(nccl_err("enqueueing a collective"))?;
        ended.map(drop)
    }

    /// Copy `range` of each rank's device result back into its values, then wait for it.
    fn finish(
        staged: &[(&RankComm, CudaSlice<f32>)],
        parts: &mut [RankSlice<'_>],
        range: impl Fn(usize) -> (usize, usize),
    ) -> Result<()> {
        for ((c, buf), p) in staged.iter().zip(parts.iter_mut()) {
            let (a, b) = range(p.rank);
            let stream = c.comm.stream();
            stream
                .memcpy_dtoh(&buf.slice(a..b), &mut p.values[a..b])
                .map_err(driver_err(p.rank, "reading the result"))?;
            stream
                .synchronize()
                .map_err(driver_err(p.rank, "waiting for the collective"))?;
        }
        Ok(())
    }
}

impl Collective for Nccl {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn synchronize(&self) -> Result<()> {
        for c in self.lock()?.iter() {
            c.comm
                .stream()
                .synchronize()
                .map_err(driver_err(c.comm.rank(), "synchronising"))?;
        }
        Ok(())
    }

    fn joins_other_ranks(&self) -> bool {
        true
    }

    fn all_reduce_sum(&self, parts: &mut [RankSlice<'_>]) -> Result<()> {
        let comms = self.lock()?;
        let len = parts.first().map(|p| p.values.len());
        let mut staged = Nccl::stage("all-reduce", &comms, parts, len)?;
        Nccl::grouped(&mut staged, |comm, buf| {
            comm.all_reduce_in_place(buf, &ReduceOp::Sum).map(drop)
        })?;
        Nccl::finish(&staged, parts, |r| (0, parts_len(&staged, r)))
    }

    fn broadcast_from(&self, root: usize, parts: &mut [RankSlice<'_>]) -> Result<()> {
        if root >= self.world_size {
            return Err(invalid(
                "broadcast root",
                format!("a rank below {}", self.world_size),
                root,
            ));
        }
        let comms = self.lock()?;
        let len = parts.first().map(|p| p.values.len());
        let mut staged = Nccl::stage("broadcast", &comms, parts, len)?;
        Nccl::grouped(&mut staged, |comm, buf| {
            comm.broadcast_in_place(buf, root as i32).map(drop)
        })?;
        Nccl::finish(&staged, parts, |r| (0, parts_len(&staged, r)))
    }

    fn all_gather(&self, counts: &[usize], parts: &mut [RankSlice<'_>]) -> Result<()> {
        let blocks = blocks("all-gather", counts, self.world_size)?;
        let total = blocks.last().map_or(0, |b| b.1);
        let comms = self.lock()?;
        let mut staged = Nccl::stage("all-gather", &comms, parts, Some(total))?;
        // Each owner broadcasts its block from a buffer of its own, into everyone's copy.
        let mut sends = Vec::with_capacity(staged.len());
        for (c, buf) in &staged {
            let (a, b) = blocks[c.comm.rank()];
            let s = c
                .comm
                .stream()
                .clone_dtod(&buf.slice(a..b))
                .map_err(driver_err(c.comm.rank(), "copying the own block"))?;
            sends.push(s);
        }
        let mut at = 0;
        Nccl::grouped(&mut staged, |comm, buf| {
            let own = &sends[at];
            at += 1;
            for (root, &(a, b)) in blocks.iter().enumerate().filter(|(_, b)| b.1 > b.0) {
                let send = (comm.rank() == root).then_some(own);
                comm.broadcast(send, &mut buf.slice_mut(a..b), root as i32)?;
            }
            Ok(())
        })?;
        Nccl::finish(&staged, parts, |_| (0, total))
    }

    fn reduce_scatter_sum(&self, counts: &[usize], parts: &mut [RankSlice<'_>]) -> Result<()> {
        let blocks = blocks("reduce-scatter", counts, self.world_size)?;
        let total = blocks.last().map_or(0, |b| b.1);
        let comms = self.lock()?;
        let mut staged = Nccl::stage("reduce-scatter", &comms, parts, Some(total))?;
        // Each owner's block is reduced into a separate buffer (NCCL's in-place reduce needs
        // the root's send and receive to coincide, which a sub-range of one buffer cannot say).
        let mut sums = Vec::with_capacity(staged.len());
        for (c, buf) in &staged {
            let s = c
                .comm
                .stream()
                .alloc_zeros::<f32>(buf.len())
                .map_err(driver_err(c.comm.rank(), "allocating the sums"))?;
            sums.push(s);
        }
        let mut at = 0;
        Nccl::grouped(&mut staged, |comm, buf| {
            let sum = &mut sums[at];
            at += 1;
            for (root, &(a, b)) in blocks.iter().enumerate().filter(|(_, b)| b.1 > b.0) {
                let mut out = sum.slice_mut(a..b);
                let recv = (comm.rank() == root).then_some(&mut out);
                comm.reduce(&buf.slice(a..b), recv, &ReduceOp::Sum, root as i32)?;
            }
            Ok(())
        })?;
        // Each rank keeps only its own block; the rest of its values are left as they were
        // (`stage` sorted `parts` into the communicators' order).
        for (((c, _), sum), part) in staged.iter().zip(&sums).zip(parts.iter_mut()) {
            let (a, b) = blocks[part.rank];
            let stream = c.comm.stream();
            stream
                .memcpy_dtoh(&sum.slice(a..b), &mut part.values[a..b])
                .map_err(driver_err(part.rank, "reading the result"))?;
            stream
                .synchronize()
                .map_err(driver_err(part.rank, "waiting for the reduce"))?;
        }
        Ok(())
    }
}

/// The staged length of rank `r`'s buffer.
fn parts_len(staged: &[(&RankComm, CudaSlice<f32>)], r: usize) -> usize {
    staged
        .iter()
        .find(|(c, _)| c.comm.rank() == r)
        .map_or(0, |(_, b)| b.len())
}

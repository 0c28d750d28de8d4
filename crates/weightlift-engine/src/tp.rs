//! Tensor parallelism in the manner of exllamav2's `TPContext`: five split tables,
//! collectives over the devices they name, per-device RoPE tables and scratch.
//!
//! Tensors in collectives are 2-D `(rows, columns)`; a split table entry `(device, a, b)` owns
//! columns `a·dim .. b·dim`. As in exllamav2:
//! - `broadcast` copies the whole tensor to every device of a table;
//! - `gather` concatenates the per-device slices, in table order, into host memory;
//! - `allgather` gathers, then broadcasts the result to the devices of a second table;
//! - `add_residual` adds, on each device, its column slice of `source` into `target`.
//!
//! The copies go through a [`Collective`] so a transport such as NCCL can replace the
//! host-staged one; its rank-level collectives ([`Collective::all_gather`],
//! [`Collective::reduce_scatter_sum`], ...) are what a process driving only some of the
//! ranks calls, and what the `nccl` feature's `Nccl` runs through NCCL. On `cpu` and
//! `virtual` devices every copy is a real copy between separate allocations.

use std::sync::Arc;

use half::f16;
use weightlift_format::DType;

use crate::device::{Buffer, Device, DeviceTensor, pace_link};
use crate::error::{EngineError, Result, invalid};

mod host;
mod lend;
#[cfg(feature = "nccl")]
mod nccl;
mod standalone;
mod threads;
mod world;
pub use lend::{Collectives, ScratchViews};
#[cfg(feature = "nccl")]
pub use nccl::Nccl;
pub use standalone::{Standalone, TpArgs, scratch_dtype};
pub use threads::ThreadGroup;
pub use world::{
    MAX_WORLD_SIZE, NCCL_ID_BYTES, NCCL_ID_FILE_VAR, NCCL_ID_VAR, NcclUniqueId, World,
};

/// exllamav2's broadcast types: which table a collective follows.
pub const BROADCAST_KV: usize = 0;
pub const BROADCAST_ID: usize = 1;
pub const BROADCAST_VC: usize = 2;
pub const BROADCAST_RS: usize = 3;
pub const BROADCAST_Q: usize = 4;
/// The expert table of a mixture-of-experts model (no exllamav2 counterpart: it has no expert
/// parallelism); empty for a dense model.
pub const BROADCAST_EX: usize = 5;

/// One split table: `(device_index, start, end)`, covering `0..total` in device order.
pub type SplitTable = Vec<(usize, u64, u64)>;

/// The five tables of exllamav2 and a mixture-of-experts model's expert table, indexed by the
/// `BROADCAST_*` constants.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Splits {
    pub kv: SplitTable,
    pub id: SplitTable,
    pub vc: SplitTable,
    pub rs: SplitTable,
    pub q: SplitTable,
    /// Whole routed experts per device (expert parallelism, see
    /// [`weightlift_plan::TpSplit::ex`]); empty for a dense model, whose MLPs follow `id`.
    pub ex: SplitTable,
}

impl Splits {
    pub fn get(&self, t: usize) -> Result<&SplitTable> {
        Ok(match t {
            BROADCAST_KV => &self.kv,
            BROADCAST_ID => &self.id,
            BROADCAST_VC => &self.vc,
            BROADCAST_RS => &self.rs,
            BROADCAST_Q => &self.q,
            BROADCAST_EX => &self.ex,
            _ => return Err(invalid("broadcast type", "0 (KV) to 5 (EX)", t)),
        })
    }
}

/// The transport of the collectives: copies between devices and a synchronisation point.
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// A short name for messages (`"host-staged"`, `"nccl"`).
    fn name(&self) -> &'static str;

    // The tensor copies default to [`HostStaged`]'s: a transport whose own wire serves only
    // the rank-level collectives (NCCL, a thread group) moves tensors through host memory.

    /// A copy of `src` on `dst`.
    fn copy(&self, src: &DeviceTensor, dst: &Arc<Device>) -> Result<DeviceTensor> {
        HostStaged.copy(src, dst)
    }

    /// Copy `src`'s bytes into host memory `dst` (same length).
    fn to_host(&self, src: &DeviceTensor, dst: &mut [u8]) -> Result<()> {
        HostStaged.to_host(src, dst)
    }

    /// Upload host bytes as a tensor on `dst`.
    fn upload(
        &self,
        bytes: &[u8],
        shape: Vec<u64>,
        dtype: DType,
        dst: &Arc<Device>,
    ) -> Result<DeviceTensor> {
        HostStaged.upload(bytes, shape, dtype, dst)
    }

    /// Copy `src`, in `from`'s memory, into `dst`, in `to`'s (same length): the transfer the
    /// tensor-parallel forward pass makes between host-addressable devices.
    fn copy_host(&self, src: &[u8], from: &Device, dst: &mut [u8], to: &Device) -> Result<()> {
        HostStaged.copy_host(src, from, dst, to)
    }

    /// Wait until every queued copy has finished (exllamav2's `wait_streams`).
    fn synchronize(&self) -> Result<()>;

    /// Whether the rank-level collectives may be given only this process's rank, the transport
    /// bringing the other ranks' values (NCCL, a [`ThreadGroup`]): what a rank-local forward
    /// pass needs. The default, host-staged bodies need every rank's buffer in the call.
    fn joins_other_ranks(&self) -> bool {
        false
    }

    /// Every rank's `values` becomes the element-wise sum over the ranks, added in rank order.
    /// `parts` are the ranks this process drives; the default moves them with
    /// [`Collective::copy_host`] and needs every rank of the world here.
    fn all_reduce_sum(&self, parts: &mut [RankSlice<'_>]) -> Result<()> {
        host::all_reduce_sum(self, parts)
    }

    /// Every rank's `values` becomes a copy of rank `root`'s.
    fn broadcast_from(&self, root: usize, parts: &mut [RankSlice<'_>]) -> Result<()> {
        host::broadcast_from(self, root, parts)
    }

    /// Rank `r` contributes `counts[r]` values (its block, at `counts[..r].sum()` inside its
    /// `values`, which hold `counts.sum()`); afterwards every rank holds every block. Counts
    /// may differ per rank, as split tables do, and may be 0 for a rank with no share.
    fn all_gather(&self, counts: &[usize], parts: &mut [RankSlice<'_>]) -> Result<()> {
        host::all_gather(self, counts, parts)
    }

    /// Every rank holds a partial sum of `counts.sum()` values; afterwards rank `r`'s block
    /// (laid out as in [`Collective::all_gather`]) holds that block summed over the ranks, in
    /// rank order. The other blocks are left as they were.
    fn reduce_scatter_sum(&self, counts: &[usize], parts: &mut [RankSlice<'_>]) -> Result<()> {
        host::reduce_scatter_sum(self, counts, parts)
    }
}

/// One rank's buffer in a collective over f32 values (the host path's activations).
#[derive(Debug)]
pub struct RankSlice<'a> {
    /// The rank: the split tables' device index, and the NCCL rank.
    pub rank: usize,
    /// The device whose memory `values` is.
    pub device: &'a Device,
    pub values: &'a mut [f32],
}

/// Copies staged through host memory: what exllamav2 does without peer access. Between `cpu`
/// and `virtual` devices they are plain copies between the arenas; to, from and between CUDA
/// devices they go through the kernels' pinned staging (host to device, queued on the device's
/// stream) and synchronous device-to-host reads, bounced [`crate::device::BOUNCE_BYTES`] at a
/// time. Peer (device-to-device across GPUs) copies are a later transport behind the same trait,
/// NCCL (feature `nccl`) another. `synchronize` has nothing of its own to wait for;
/// [`TpContext::wait_streams`] also waits for every CUDA device's stream.
#[derive(Debug, Default)]
pub struct HostStaged;

impl Collective for HostStaged {
    fn name(&self) -> &'static str {
        "host-staged"
    }

    fn copy(&self, src: &DeviceTensor, dst: &Arc<Device>) -> Result<DeviceTensor> {
        src.copy_to(dst)
    }

    fn to_host(&self, src: &DeviceTensor, dst: &mut [u8]) -> Result<()> {
        if src.nbytes() != dst.len() as u64 {
            return Err(invalid(
                "host copy",
                format!("{} bytes", dst.len()),
                src.nbytes(),
            ));
        }
        src.read(0, dst)
    }

    fn upload(
        &self,
        bytes: &[u8],
        shape: Vec<u64>,
        dtype: DType,
        dst: &Arc<Device>,
    ) -> Result<DeviceTensor> {
        DeviceTensor::from_host(dst, shape, dtype, bytes)
    }

    fn copy_host(&self, src: &[u8], from: &Device, dst: &mut [u8], to: &Device) -> Result<()> {
        if src.len() != dst.len() {
            return Err(invalid(
                format!("copy from {} to {}", from.name(), to.name()),
                format!("{} bytes", dst.len()),
                src.len(),
            ));
        }
        let since = std::time::Instant::now();
        dst.copy_from_slice(src);
        // Simulated links (virtual devices given a bandwidth) take their time.
        pace_link(from, to, src.len() as u64, since);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

/// Per-device bump allocator over one reserved buffer (exllamav2's device-context scratch).
#[derive(Debug)]
struct Scratch {
    buffer: Option<Buffer>,
    /// Bytes requested by `reserve_scratch`.
    reserved: u64,
    /// Bump offset since `begin_scratch_alloc_tp`.
    offset: u64,
}

/// A slice of a device's scratch buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScratchSlice {
    pub device: usize,
    pub offset: u64,
    pub rows: u64,
    pub cols: u64,
    pub dtype: DType,
}

/// RoPE parameters for `get_sin_cos`.
#[derive(Debug, Clone, Copy)]
pub struct Rope {
    pub theta: f64,
    pub dim: u32,
    pub head_dim: u32,
    pub max_seq_len: u64,
}

/// A tensor-parallel context over `devices` (indexed by the tables' device indices).
#[derive(Debug)]
pub struct TpContext {
    splits: Splits,
    devices: Vec<Arc<Device>>,
    collective: Box<dyn Collective>,
    rope: Rope,
    /// The two host staging buffers of `gather` (exllamav2's pinned temps), from `finalize`.
    staging: Vec<Buffer>,
    /// The device the staging buffers live on.
    staging_device: Option<Arc<Device>>,
    scratch: Vec<Scratch>,
    sin_cos: Option<Vec<(DeviceTensor, DeviceTensor)>>,
    /// Whether the backend pass may copy device to device where the driver allows.
    peer_copies: bool,
    /// The one table device this process drives in a multi-process run (`None`: every one);
    /// the other entries of `devices` are [`Device::elsewhere`] stand-ins.
    rank: Option<usize>,
}

fn elem_size(dtype: DType) -> Result<u64> {
    match dtype {
        DType::F32 => Ok(4),
        DType::F16 | DType::BF16 => Ok(2),
        _ => Err(invalid(
            "collective tensor dtype",
            "F32, F16 or BF16",
            dtype,
        )),
    }
}

fn rows_cols(t: &DeviceTensor) -> Result<(u64, u64)> {
    match *t.shape() {
        [r, c] => Ok((r, c)),
        [c] => Ok((1, c)),
        _ => Err(invalid(
            "collective tensor",
            "2-D (rows, columns)",
            format!("shape {:?}", t.shape()),
        )),
    }
}

impl TpContext {
    /// `devices[i]` is the device the tables call `i`. Every table entry must name one.
    pub fn new(
        splits: Splits,
        devices: Vec<Arc<Device>>,
        rope: Rope,
        collective: Box<dyn Collective>,
    ) -> Result<TpContext> {
        for t in 0..=BROADCAST_EX {
            for &(d, a, b) in splits.get(t)? {
                if d >= devices.len() || a > b {
                    return Err(invalid(
                        format!("tp split table {t}"),
                        format!("device indices below {} and start <= end", devices.len()),
                        format!("({d}, {a}, {b})"),
                    ));
                }
            }
        }
        let scratch = devices
            .iter()
            .map(|_| Scratch {
                buffer: None,
                reserved: 0,
                offset: 0,
            })
            .collect();
        Ok(TpContext {
            splits,
            devices,
            collective,
            rope,
            staging: Vec::new(),
            staging_device: None,
            scratch,
            sin_cos: None,
            peer_copies: true,
            rank: None,
        })
    }

    /// Whether the forward pass through the devices' backends copies activations device to
    /// device where the driver allows (peer copies, the default), or stages every copy through
    /// host memory as it must between GPUs without peer access (`false`: to compare the two
    /// routes, or where a platform's peer copies misbehave).
    pub fn set_peer_copies(&mut self, on: bool) {
        self.peer_copies = on;
    }

    pub fn peer_copies(&self) -> bool {
        self.peer_copies
    }

    /// Make this the context of one rank of a multi-process run: this process computes only
    /// table device `rank`, and meets the other ranks through the collective's rank-level
    /// operations ([`Collective::all_gather`], [`Collective::reduce_scatter_sum`]), which
    /// [`TpContext::set_collective`] must give a transport that reaches them.
    pub fn set_rank(&mut self, rank: Option<usize>) -> Result<()> {
        if let Some(r) = rank
            && r >= self.devices.len()
        {
            return Err(invalid(
                "tp rank",
                format!("below the world size {}", self.devices.len()),
                r,
            ));
        }
        self.rank = rank;
        Ok(())
    }

    /// The rank this process drives in a multi-process run (`None`: it drives every device).
    pub fn rank(&self) -> Option<usize> {
        self.rank
    }

    /// Join the multi-process run the launcher describes, over NCCL ([`Nccl::join_from_env`]),
    /// waiting up to `wait` seconds for the unique id: `(rank, world_size)`. A build without
    /// the `nccl` feature says how to get one.
    pub fn join_nccl(&mut self, wait: f64) -> Result<(usize, usize)> {
        if !(wait.is_finite() && wait >= 0.0) {
            return Err(invalid(
                "join_nccl",
                "wait in seconds, finite and >= 0",
                wait,
            ));
        }
        join_nccl(self, std::time::Duration::from_secs_f64(wait))
    }

    /// Whether a thread-group member of rank `rank` may join this context: the rank must be
    /// this context's.
    pub fn check_member(&self, rank: usize) -> Result<()> {
        if self.rank == Some(rank) {
            return Ok(());
        }
        let ours = match self.rank {
            Some(r) => format!("a member for this context's rank {r}"),
            None => "a rank-local context (load_tp(world=..., rank=...))".to_owned(),
        };
        Err(invalid("join", ours, format!("a member for rank {rank}")))
    }

    /// Meet the other ranks through `member` of a thread group ([`TpContext::check_member`]);
    /// a refused member is dropped, which leaves its group.
    pub fn join(&mut self, member: ThreadGroup) -> Result<()> {
        self.check_member(member.rank())?;
        self.set_collective(Box::new(member));
        Ok(())
    }

    /// Replace the transport of the collectives (NCCL across processes, a
    /// [`ThreadGroup`] member for ranks run as threads).
    pub fn set_collective(&mut self, collective: Box<dyn Collective>) {
        self.collective = collective;
    }

    pub fn splits(&self) -> &Splits {
        &self.splits
    }

    pub fn get_split(&self, t: usize) -> Result<&SplitTable> {
        self.splits.get(t)
    }

    /// The devices of table `t`, in order.
    pub fn get_devs(&self, t: usize) -> Result<Vec<usize>> {
        Ok(self.splits.get(t)?.iter().map(|&(d, _, _)| d).collect())
    }

    /// Every device named by the KV, ID (or expert) or VC tables, sorted (exllamav2's
    /// `all_devices`).
    pub fn all_devices(&self) -> Vec<usize> {
        let s = &self.splits;
        let mut d: Vec<usize> = [&s.kv, &s.id, &s.ex, &s.vc]
            .into_iter()
            .flatten()
            .map(|&(d, _, _)| d)
            .collect();
        d.sort_unstable();
        d.dedup();
        d
    }

    pub fn device(&self, i: usize) -> Result<&Arc<Device>> {
        self.devices.get(i).ok_or_else(|| {
            invalid(
                "tp device index",
                format!("below {}", self.devices.len()),
                i,
            )
        })
    }

    pub fn collective(&self) -> &dyn Collective {
        self.collective.as_ref()
    }

    /// Allocate the two host staging buffers used by `gather` (`bytes` each, on `cpu`).
    pub fn finalize(&mut self, cpu: &Arc<Device>, bytes: u64) -> Result<()> {
        self.staging.clear();
        let a = cpu.alloc(bytes)?;
        let b = cpu.alloc(bytes)?;
        self.staging = vec![a, b];
        self.staging_device = Some(Arc::clone(cpu));
        Ok(())
    }

    /// Bytes of each staging buffer (0 before [`TpContext::finalize`]).
    pub fn staging_bytes(&self) -> u64 {
        self.staging.first().map_or(0, |b| b.len() as u64)
    }

    /// Bytes this context holds per device name: its scratch and its staging buffers.
    pub fn memory(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = Vec::new();
        let buffers = self
            .scratch
            .iter()
            .filter_map(|s| s.buffer.as_ref())
            .chain(&self.staging);
        for b in buffers {
            let name = b.device().name();
            match out.iter_mut().find(|(n, _)| n == name) {
                Some((_, v)) => *v += b.len() as u64,
                None => out.push((name.to_owned(), b.len() as u64)),
            }
        }
        out
    }

    /// The devices, by table index.
    pub fn devices(&self) -> &[Arc<Device>] {
        &self.devices
    }

    /// Free staging, scratch and RoPE tables.
    pub fn unload(&mut self) {
        self.staging.clear();
        self.staging_device = None;
        self.sin_cos = None;
        for s in &mut self.scratch {
            *s = Scratch {
                buffer: None,
                reserved: 0,
                offset: 0,
            };
        }
    }

    pub fn is_finalized(&self) -> bool {
        !self.staging.is_empty()
    }

    /// One copy of `x` per device of table `t`.
    pub fn broadcast(
        &self,
        _buffer: usize,
        x: &DeviceTensor,
        t: usize,
        _dim: u64,
    ) -> Result<Vec<DeviceTensor>> {
        self.splits
            .get(t)?
            .iter()
            .map(|&(d, _, _)| self.collective.copy(x, &self.devices[d]))
            .collect()
    }

    /// Concatenate `inputs` (one per device of table `t`, `(rows, (b - a)·dim)` each) along the
    /// columns into host memory: returns `(bytes, rows, columns)`.
    pub fn gather(
        &mut self,
        buffer: usize,
        inputs: &[&DeviceTensor],
        t: usize,
        dim: u64,
    ) -> Result<(Vec<u8>, u64, u64)> {
        let split = self.splits.get(t)?.clone();
        if inputs.len() != split.len() {
            return Err(invalid(
                format!("gather over table {t}"),
                format!("{} inputs, one per device", split.len()),
                inputs.len(),
            ));
        }
        let Some(&(_, _, end)) = split.last() else {
            return Err(invalid(
                format!("gather over table {t}"),
                "a non-empty split",
                "an empty one",
            ));
        };
        let dtype = inputs[0].dtype();
        let es = elem_size(dtype)?;
        let (rows, _) = rows_cols(inputs[0])?;
        let total = end * dim;
        let row_bytes = (total * es) as usize;
        let need = rows as usize * row_bytes;
        let mut out = vec![0u8; need];
        // Stage through the chosen host buffer when finalize() made one big enough.
        let staged = self.staging.get_mut(buffer).filter(|b| b.len() >= need);
        let target: &mut [u8] = match staged {
            Some(b) => match b.host_mut() {
                Some(h) => &mut h[..need],
                None => &mut out,
            },
            None => &mut out,
        };
        for (x, &(d, a, b)) in inputs.iter().zip(&split) {
            let (r, c) = rows_cols(x)?;
            if r != rows || c != (b - a) * dim || x.dtype() != dtype {
                return Err(invalid(
                    format!("gather input for device {d}"),
                    format!("{rows} × {} {dtype}", (b - a) * dim),
                    format!("{r} × {c} {}", x.dtype()),
                ));
            }
            // By name: a host-staged gather reads any host-addressable copy; what matters is
            // that the slice comes from the device the table names.
            if x.device().name() != self.devices[d].name() {
                return Err(invalid(
                    format!("gather input {d}"),
                    format!("on {}", self.devices[d].name()),
                    x.device().name(),
                ));
            }
            let mut part = vec![0u8; x.nbytes() as usize];
            self.collective.to_host(x, &mut part)?;
            let w = (c * es) as usize;
            let off = (a * dim * es) as usize;
            for row in 0..rows as usize {
                target[row * row_bytes + off..row * row_bytes + off + w]
                    .copy_from_slice(&part[row * w..(row + 1) * w]);
            }
        }
        if let Some(h) = self
            .staging
            .get(buffer)
            .filter(|b| b.len() >= need)
            .and_then(|b| b.host())
        {
            out.copy_from_slice(&h[..need]);
        }
        Ok((out, rows, total))
    }

    /// Gather over table `tg`, then broadcast the full result to the devices of table `tb`.
    pub fn allgather(
        &mut self,
        buffer: usize,
        inputs: &[&DeviceTensor],
        tg: usize,
        tb: usize,
        dim: u64,
    ) -> Result<Vec<DeviceTensor>> {
        let dtype = inputs.first().map(|x| x.dtype()).unwrap_or(DType::F32);
        let (bytes, rows, cols) = self.gather(buffer, inputs, tg, dim)?;
        self.splits
            .get(tb)?
            .iter()
            .map(|&(d, _, _)| {
                self.collective
                    .upload(&bytes, vec![rows, cols], dtype, &self.devices[d])
            })
            .collect()
    }

    /// On each device `i` of table `t`: `target[i] += source[i][:, a·dim .. b·dim]`.
    pub fn add_residual(
        &self,
        target: &mut [DeviceTensor],
        source: &[&DeviceTensor],
        t: usize,
        dim: u64,
    ) -> Result<()> {
        let split = self.splits.get(t)?;
        if target.len() != split.len() || source.len() != split.len() {
            return Err(invalid(
                format!("add_residual over table {t}"),
                format!("{} targets and sources", split.len()),
                format!("{} and {}", target.len(), source.len()),
            ));
        }
        for ((tg, src), &(d, a, b)) in target.iter_mut().zip(source).zip(split) {
            let (rows, tc) = rows_cols(tg)?;
            let (sr, sc) = rows_cols(src)?;
            let width = (b - a) * dim;
            if tc != width || sr != rows || sc < b * dim || tg.dtype() != src.dtype() {
                return Err(invalid(
                    format!("add_residual on device {d}"),
                    format!(
                        "target {rows} × {width} and source {rows} × ≥{} of one dtype",
                        b * dim
                    ),
                    format!(
                        "{rows} × {tc} {} and {sr} × {sc} {}",
                        tg.dtype(),
                        src.dtype()
                    ),
                ));
            }
            let tvals = crate::convert::to_f32(tg.dtype(), &tg.to_host()?)
                .ok_or_else(|| invalid("add_residual dtype", "F32, F16 or BF16", tg.dtype()))?;
            let svals = crate::convert::to_f32(src.dtype(), &src.to_host()?).unwrap_or_default();
            let mut sum = tvals;
            for r in 0..rows as usize {
                for c in 0..width as usize {
                    sum[r * width as usize + c] += svals[r * sc as usize + (a * dim) as usize + c];
                }
            }
            let bytes = encode(tg.dtype(), &sum);
            let new =
                DeviceTensor::from_host(tg.device(), tg.shape().to_vec(), tg.dtype(), &bytes)?;
            *tg = new;
        }
        Ok(())
    }

    /// exllamav2's `wait_streams`: the transport's queued work, then every device's stream.
    pub fn wait_streams(&self) -> Result<()> {
        self.collective.synchronize()?;
        self.devices.iter().try_for_each(|d| d.synchronize())
    }

    /// Per-device RoPE tables `(sin, cos)`, each `(max_seq_len, head_dim)` f32, neox layout
    /// (`[freqs, freqs]`, as exllamav2 builds them), computed once and kept on each device of
    /// [`TpContext::all_devices`].
    pub fn get_sin_cos(&mut self) -> Result<&[(DeviceTensor, DeviceTensor)]> {
        if self.sin_cos.is_none() {
            let r = self.rope;
            let half = (r.dim / 2) as usize;
            let hd = r.head_dim as usize;
            let n = r.max_seq_len as usize;
            let mut sin = vec![0f32; n * hd];
            let mut cos = vec![1f32; n * hd];
            for p in 0..n {
                for i in 0..half {
                    let inv = r.theta.powf(-(2.0 * i as f64) / f64::from(r.dim));
                    let a = p as f64 * inv;
                    for j in [i, i + half] {
                        sin[p * hd + j] = a.sin() as f32;
                        cos[p * hd + j] = a.cos() as f32;
                    }
                }
            }
            let (sb, cb) = (encode(DType::F32, &sin), encode(DType::F32, &cos));
            let mut tables = Vec::new();
            for d in self.all_devices() {
                let dev = &self.devices[d];
                tables.push((
                    DeviceTensor::from_host(dev, vec![n as u64, hd as u64], DType::F32, &sb)?,
                    DeviceTensor::from_host(dev, vec![n as u64, hd as u64], DType::F32, &cb)?,
                ));
            }
            self.sin_cos = Some(tables);
        }
        Ok(self.sin_cos.as_deref().unwrap_or(&[]))
    }

    /// Reset every device's scratch bump pointer.
    pub fn begin_scratch_alloc_tp(&mut self) {
        self.scratch.iter_mut().for_each(|s| s.offset = 0);
    }

    /// Reserve `bytes[i]` of scratch on device `i` (grows, never shrinks).
    pub fn reserve_scratch(&mut self, bytes: &[u64]) -> Result<()> {
        for (i, &b) in bytes.iter().enumerate() {
            if b == 0 {
                continue;
            }
            let dev = Arc::clone(self.device(i)?);
            let s = &mut self.scratch[i];
            if b > s.reserved {
                s.buffer = None;
                s.buffer = Some(dev.alloc(b)?);
                s.reserved = b;
            }
        }
        Ok(())
    }

    fn slice(&mut self, d: usize, rows: u64, cols: u64, dtype: DType) -> Result<ScratchSlice> {
        let bytes = rows * cols * elem_size(dtype)?;
        let name = self.device(d)?.name().to_owned();
        let s = &mut self.scratch[d];
        let offset = s.offset;
        if offset + bytes > s.reserved {
            return Err(EngineError::OutOfMemory {
                device: format!("{name} scratch"),
                requested: bytes,
                free: s.reserved - offset,
                capacity: s.reserved,
            });
        }
        s.offset += bytes.next_multiple_of(128);
        Ok(ScratchSlice {
            device: d,
            offset,
            rows,
            cols,
            dtype,
        })
    }

    /// One slice per device of table `t`, `(rows, (b - a)·dim)` each.
    pub fn get_scratch_slice_tp(
        &mut self,
        rows: u64,
        dtype: DType,
        t: usize,
        dim: u64,
    ) -> Result<Vec<ScratchSlice>> {
        let split = self.splits.get(t)?.clone();
        split
            .iter()
            .map(|&(d, a, b)| self.slice(d, rows, (b - a) * dim, dtype))
            .collect()
    }

    /// One full-width slice per device of table `t`, `(rows, end·dim)` each.
    pub fn get_scratch_slice_tp_bc(
        &mut self,
        rows: u64,
        dtype: DType,
        t: usize,
        dim: u64,
    ) -> Result<Vec<ScratchSlice>> {
        let split = self.splits.get(t)?.clone();
        let end = split.last().map_or(0, |s| s.2);
        split
            .iter()
            .map(|&(d, _, _)| self.slice(d, rows, end * dim, dtype))
            .collect()
    }
}

#[cfg(feature = "nccl")]
fn join_nccl(ctx: &mut TpContext, wait: std::time::Duration) -> Result<(usize, usize)> {
    Nccl::join_from_env(ctx, wait).map(|w| (w.rank, w.world_size))
}

#[cfg(not(feature = "nccl"))]
fn join_nccl(_ctx: &mut TpContext, _wait: std::time::Duration) -> Result<(usize, usize)> {
    Err(EngineError::Unsupported {
        what: "join_nccl".into(),
        detail: "this build of weightlift has no NCCL transport; build the extension with the \
                 `nccl` feature (maturin develop --features nccl) on a machine with CUDA"
            .into(),
    })
}

/// f32 values to the bytes of `dtype` (F32, F16, BF16).
pub fn encode(dtype: DType, vals: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F16 => vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::BF16 => vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

//! The streaming loader: it carries out a placement tensor by tensor, in layer order.
//!
//! - `cpu` tensors whose dtype already matches stay zero-copy views of the mmap
//!   (`use_mmap = true`), or are `pread` straight into owned memory (`use_mmap = false`). Both
//!   run inline on the calling thread: no thread hop, no staging.
//! - Tensors bound for a virtual or CUDA device in their stored dtype are filled window by
//!   window ([`crate::device::Buffer::fill`]) by the calling thread, each window read by up to
//!   four parallel `pread`s: straight into the virtual device's arena, or into a CUDA backend's
//!   pinned staging buffer whose DMA then overlaps the next window's read. The bytes are copied
//!   on the host once (the read), where staging copied them twice (the read, then into pinned
//!   memory), and the reads of a window run on several cores. Virtual devices take the same
//!   path as CUDA ones: they exist to exercise the accelerator paths.
//! - Everything else bound for a device (dtype conversions, quantising, O_DIRECT reads) goes
//!   through two bounded staging buffers: a reader thread fills one while the other is
//!   converted and copied to the device. The reader thread is started only when some tensor is
//!   staged. Anonymous host memory for the load itself is therefore bounded by
//!   `2 × staging_bytes`, whatever the model size. A staged host destination (a virtual device)
//!   is made cheap to fill: its pages are faulted in over the cores (`MADV_POPULATE_WRITE`) when
//!   the tensor's first chunk arrives, while the reader waits with both buffers full, and the
//!   chunks are then plain copies into resident memory. First-touch faults, not the copies,
//!   were most of the time of a virtual-device load.
//! - A quantising load (`quantize=` on a float checkpoint) reads whole source rows per chunk.
//!   Bound for a CUDA buffer, a chunk goes up as float rows and the device quantises it into
//!   the tensor's blocks on its stream (the backend's `quantize_rows`, the host quantiser's
//!   bytes), so the quantisation overlaps the reader as the copies do; a NaN or inf leaves a
//!   report word on the device, read back once the load's copies are done, and fails the load
//!   with the host quantiser's error. Host and virtual destinations, INT8, and the
//!   types the host quantises fast (see `convert::quantizes_on_device`) quantise on the host.
//! - O_DIRECT (`use_direct_io`, which takes precedence over `use_mmap` as in llama.cpp) reads
//!   aligned blocks into the (page-aligned) staging buffers. A
//!   filesystem that refuses O_DIRECT (EINVAL, as tmpfs does) falls back to buffered reads, and
//!   the load records a warning saying so.
//! - Progress is reported after every chunk or window; a callback that returns false cancels
//!   the load within one, and everything allocated so far is dropped (freed) before returning.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use weightlift_format::{DType, Role, TensorInfo};
use weightlift_kernels::{Backend, CudaBuffer};

use crate::device::{Device, DeviceKind, DeviceTensor, Storage};
use crate::error::{EngineError, Result};
use crate::hostmem::{ALIGN, AlignedBuf};
use crate::source::Source;
use crate::{convert, scan};

/// Where one tensor goes and in what dtype.
#[derive(Debug, Clone)]
pub struct TensorTarget {
    pub device: Arc<Device>,
    /// The dtype to hold it in: the stored dtype, or F16 for an F32/BF16 conversion.
    pub dtype: DType,
    /// Stays a view of the mmap whatever the options say (weights left on `disk`); needs a
    /// `cpu` device and the stored dtype.
    pub mapped: bool,
}

impl TensorTarget {
    pub fn new(device: Arc<Device>, dtype: DType) -> Self {
        TensorTarget {
            device,
            dtype,
            mapped: false,
        }
    }
}

/// How to read.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub use_mmap: bool,
    pub use_direct_io: bool,
    /// Scan float data placed on a device for NaN/Inf.
    pub check_tensors: bool,
    /// Size of each of the two staging buffers. The default, 4 MiB, keeps the pair (the data
    /// `pread` has just written and the consumer copies out) close to the cache: on the 2-core
    /// bench VM, 2.26 GB staged onto virtual devices took ~1.5 CPU-seconds with 2 or 4 MiB
    /// buffers against ~2.0 with 16 MiB, the cost of reading the copy's source back from
    /// memory. Smaller still only adds hand-offs between the threads.
    pub staging_bytes: usize,
    /// Lock memory-mapped tensors in RAM after the load (llama.cpp's `use_mlock`).
    pub mlock: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            use_mmap: true,
            use_direct_io: false,
            check_tensors: false,
            staging_bytes: 4 << 20,
            mlock: false,
        }
    }
}

/// One progress report. `bytes_done` counts checkpoint bytes read (before conversion); it is
/// monotone and ends at `bytes_total`.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub tensor: &'a str,
    pub device: &'a str,
}

impl Progress<'_> {
    /// The fraction done, as llama.cpp's `progress_callback` takes it: 1 for a load with
    /// nothing to read.
    pub fn fraction(&self) -> f64 {
        if self.bytes_total == 0 {
            return 1.0;
        }
        self.bytes_done as f64 / self.bytes_total as f64
    }
}

/// The result of a load: one tensor per checkpoint tensor, in checkpoint order (`None` where
/// the target was `None`).
#[derive(Debug)]
pub struct Loaded {
    pub tensors: Vec<Option<DeviceTensor>>,
    pub warnings: Vec<String>,
}

/// The position of a tensor in load order: embeddings and other globals first, then layers in
/// order, then the output norm and head (as the forward pass uses them).
fn order_key(info: &TensorInfo) -> (u8, u32) {
    match (info.layer, info.role) {
        (Some(l), _) => (1, l),
        (None, Some(Role::Output | Role::OutputNorm)) => (2, 0),
        (None, _) => (0, 0),
    }
}

/// The load order of `tensors`: by layer, then by file position (sequential reads).
pub fn load_order(tensors: &[TensorInfo]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| (order_key(&tensors[i]), tensors[i].file, tensors[i].offset));
    order
}

/// The bytes a tensor of `info` occupies once converted to `dtype`.
pub fn target_bytes(info: &TensorInfo, dtype: DType) -> Result<u64> {
    if dtype == info.dtype {
        return Ok(info.nbytes);
    }
    convert::check(info, dtype)?;
    dtype.bytes_for_shape(&info.shape).ok_or_else(|| {
        crate::error::invalid(
            format!("tensor '{}'", info.name),
            "a convertible shape",
            format!("{:?}", info.shape),
        )
    })
}

enum Msg {
    /// `len` bytes of tensor `index` starting at byte `at`, held at `buf[start..start + len]`.
    Chunk {
        index: usize,
        at: u64,
        buf: AlignedBuf,
        start: usize,
        len: usize,
    },
    Warning(String),
    Err(EngineError),
}

/// What the reader does with each tensor.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path_ {
    View,
    Pread,
    /// Stored bytes bound for a virtual or CUDA device: read by the calling thread straight
    /// into the destination window by window ([`crate::device::Buffer::fill`]: the arena
    /// itself, or a CUDA backend's pinned staging buffer whose DMA overlaps the next read).
    Fill,
    Staged,
}

/// Carry out `targets` (one per tensor of `source`) in layer order.
///
/// `progress` is called after every chunk and every whole tensor; returning false cancels.
/// `on_layer_done(layer)` runs once all of a layer's tensors are in place (the lazy cache
/// allocates that layer there); an error from it aborts the load.
pub fn load(
    source: &Arc<dyn Source>,
    targets: &[Option<TensorTarget>],
    opts: &LoadOptions,
    progress: &mut dyn FnMut(&Progress<'_>) -> bool,
    on_layer_done: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Loaded> {
    let infos = source.tensors();
    if targets.len() != infos.len() {
        return Err(crate::error::invalid(
            "placement",
            format!("one target per tensor ({})", infos.len()),
            targets.len(),
        ));
    }
    let order: Vec<usize> = load_order(infos)
        .into_iter()
        .filter(|&i| targets[i].is_some())
        .collect();
    let mut paths = Vec::with_capacity(infos.len());
    for (info, t) in infos.iter().zip(targets) {
        let Some(t) = t else {
            paths.push(Path_::View);
            continue;
        };
        target_bytes(info, t.dtype)?;
        let on_cpu = t.device.kind() == DeviceKind::Cpu;
        let same = t.dtype == info.dtype;
        if t.mapped {
            if !(on_cpu && same) {
                return Err(crate::error::invalid(
                    format!("tensor '{}' left in the file", info.name),
                    format!("its stored dtype {} on cpu", info.dtype),
                    format!("{} on {}", t.dtype, t.device.name()),
                ));
            }
            paths.push(Path_::View);
            continue;
        }
        // As in llama.cpp, use_direct_io takes precedence over use_mmap.
        paths.push(match (on_cpu, same, opts.use_mmap, opts.use_direct_io) {
            (true, true, true, false) => Path_::View,
            (true, true, false, false) => Path_::Pread,
            (false, true, _, false) => Path_::Fill,
            _ => Path_::Staged,
        });
    }
    let bytes_total: u64 = order.iter().map(|&i| infos[i].nbytes).sum();
    // The last tensor of each layer in load order: the layer is complete after it.
    let mut layer_last: HashMap<usize, u32> = HashMap::new();
    for &i in &order {
        if let Some(l) = infos[i].layer {
            layer_last.retain(|_, v| *v != l);
            layer_last.insert(i, l);
        }
    }

    let staging = opts.staging_bytes.max(ALIGN).next_multiple_of(ALIGN);
    // A quantising load reads whole source rows per chunk, as many as fit the staging buffer.
    let mut units = vec![1u64; infos.len()];
    for (i, (info, t)) in infos.iter().zip(targets).enumerate() {
        if let Some(t) = t
            && convert::quantizing(info, t.dtype)
        {
            let row = convert::source_row_bytes(info);
            if row > staging as u64 {
                return Err(crate::error::invalid(
                    format!("quantising tensor '{}'", info.name),
                    format!("rows of at most the staging size, {staging} bytes"),
                    format!("rows of {row} bytes; raise staging_bytes"),
                ));
            }
            units[i] = row;
        }
    }
    let stop = AtomicBool::new(false);
    let files = source.files();
    let mut out: Vec<Option<DeviceTensor>> = (0..infos.len()).map(|_| None).collect();
    let mut warnings = Vec::new();

    // Views and direct preads need no staging: they run inline on this thread. The reader
    // thread and its two staging buffers exist only when some tensor is staged, and it then
    // handles only those tensors, in the same order as the loop below.
    let any_staged = order.iter().any(|&i| paths[i] == Path_::Staged);
    // The report words of the tensors quantised on a CUDA device, checked after the load.
    let mut reports: Vec<(usize, CudaBuffer)> = Vec::new();
    let result = std::thread::scope(|s| -> Result<()> {
        let (tx, rx) = mpsc::sync_channel::<Msg>(2);
        let (free_tx, free_rx) = mpsc::channel::<AlignedBuf>();
        if any_staged {
            let reader = Reader {
                source,
                files: &files,
                paths: &paths,
                units: &units,
                order: &order,
                staging,
                direct: opts.use_direct_io,
                stop: &stop,
            };
            s.spawn(move || reader.run(&tx, &free_rx));
        } else {
            drop(tx);
            drop(free_rx);
        }

        let threads = crate::forward::logical_cpus().min(MAX_PREAD_THREADS);
        let mut done = 0u64;
        let mut current: Option<(usize, crate::device::Buffer)> = None;
        // The non-finite report word of the tensor being quantised on a CUDA device.
        let mut found: Option<CudaBuffer> = None;
        // Host bytes of a converted chunk bound for device memory (at most one staging size).
        let mut converted: Vec<u8> = Vec::new();
        let mut buffered: Vec<Option<File>> = (0..files.len()).map(|_| None).collect();
        let mut finish =
            |index: usize, storage: Storage, out: &mut Vec<Option<DeviceTensor>>| -> Result<()> {
                let info = &infos[index];
                let Some(target) = &targets[index] else {
                    return Ok(());
                };
                let t = DeviceTensor::new(
                    Arc::clone(&target.device),
                    info.shape.clone(),
                    target.dtype,
                    storage,
                )?;
                // every loaded tensor, wherever it went: a view of the map on the cpu too
                if opts.check_tensors {
                    scan::check(&info.name, &t)?;
                }
                out[index] = Some(t);
                if let Some(&layer) = layer_last.get(&index) {
                    on_layer_done(layer)?;
                }
                Ok(())
            };
        let run = (|| -> Result<()> {
            for &index in &order {
                let info = &infos[index];
                let Some(target) = &targets[index] else {
                    continue;
                };
                let report = |done: u64, progress: &mut dyn FnMut(&Progress<'_>) -> bool| {
                    let p = Progress {
                        bytes_done: done,
                        bytes_total,
                        tensor: &info.name,
                        device: target.device.name(),
                    };
                    if progress(&p) {
                        Ok(())
                    } else {
                        Err(EngineError::Cancelled {
                            bytes_done: done,
                            bytes_total,
                        })
                    }
                };
                match paths[index] {
                    Path_::View => {
                        let storage = Storage::Mapped {
                            source: Arc::clone(source),
                            index,
                        };
                        done += info.nbytes;
                        finish(index, storage, &mut out)?;
                        report(done, progress)?;
                    }
                    Path_::Pread => {
                        let buf = pread_owned(info, &target.device, &files, &mut buffered)?;
                        done += info.nbytes;
                        finish(index, Storage::Owned(buf), &mut out)?;
                        report(done, progress)?;
                    }
                    Path_::Fill => {
                        let file = tensor_file(info, &target.device, &files, &mut buffered)?;
                        let mut buf = target.device.alloc_for_read(info.nbytes)?;
                        if info.nbytes >= POPULATE_BYTES {
                            // an arena's pages faulted in over the cores first, as for the
                            // staged path below (nothing on CUDA)
                            buf.populate(threads);
                        }
                        let len = usize::try_from(info.nbytes).unwrap_or(usize::MAX);
                        let start = done;
                        // progress after every window, so a cancel lands within one
                        buf.fill(0, len, &mut |at, window| {
                            read_parallel(file, info.offset + at as u64, window)
                                .map_err(|e| io_error(info, &files, e))?;
                            report(start + (at + window.len()) as u64, progress)
                        })?;
                        done += info.nbytes;
                        finish(index, Storage::Owned(buf), &mut out)?;
                        if info.nbytes == 0 {
                            report(done, progress)?;
                        }
                    }
                    // The reader sends no chunk for an empty tensor.
                    Path_::Staged if info.nbytes == 0 => {
                        let n = target_bytes(info, target.dtype)?;
                        let buf = target.device.alloc(n)?;
                        finish(index, Storage::Owned(buf), &mut out)?;
                        report(done, progress)?;
                    }
                    Path_::Staged => loop {
                        let Ok(msg) = rx.recv() else {
                            // The reader stopped without an error; the check after the load
                            // names the first missing tensor.
                            return Ok(());
                        };
                        let (at, buf, start, len) = match msg {
                            Msg::Err(e) => return Err(e),
                            Msg::Warning(w) => {
                                warnings.push(w);
                                continue;
                            }
                            Msg::Chunk {
                                index: got,
                                at,
                                buf,
                                start,
                                len,
                            } if got == index => (at, buf, start, len),
                            Msg::Chunk { index: got, .. } => {
                                return Err(EngineError::Device {
                                    device: target.device.name().to_owned(),
                                    detail: format!(
                                        "the reader sent tensor '{}' while '{}' was due",
                                        infos.get(got).map_or("?", |i| i.name.as_str()),
                                        info.name
                                    ),
                                });
                            }
                        };
                        if current.as_ref().is_none_or(|(i, _)| *i != index) {
                            let n = target_bytes(info, target.dtype)?;
                            // Filled chunk by chunk right away: no huge-page advice, whose
                            // faults stall on compaction (virtual:1x2.3GiB, 2.38 GB: 1.1 to
                            // 6.4 s advised, a steady 1.6 to 2.0 s not).
                            let mut dst = target.device.alloc_for_read(n)?;
                            if n >= POPULATE_BYTES {
                                // Fault the whole buffer in over the cores first (the reader
                                // has its two chunks queued and waits meanwhile); the chunk
                                // copies then run at memcpy speed. 2.38 GB onto virtual:2x2GiB
                                // (same run, busy VM): 2.1 s with the faults inside the copies
                                // and 16 MiB staging, 1.2 s populated with 4 MiB.
                                dst.populate(threads);
                            }
                            found = report_word(info, target, &dst)?;
                            current = Some((index, dst));
                        }
                        if let Some((_, dst)) = current.as_mut() {
                            let data = buf.as_slice().get(start..start + len).unwrap_or(&[]);
                            let f = found.as_mut();
                            put_chunk(info, target.dtype, at, data, dst, &mut converted, f)?;
                        }
                        let _ = free_tx.send(buf);
                        done += len as u64;
                        let last = at + len as u64 >= info.nbytes;
                        if last && let Some((_, dst)) = current.take() {
                            if let Some(f) = found.take() {
                                reports.push((index, f));
                            }
                            finish(index, Storage::Owned(dst), &mut out)?;
                        }
                        report(done, progress)?;
                        if last {
                            break;
                        }
                    },
                }
            }
            Ok(())
        })();
        // Stop the reader (on error or cancel) and let it drain: dropping the receivers makes
        // its sends fail, so it exits at its next message.
        stop.store(true, Ordering::Release);
        drop(rx);
        drop(free_tx);
        drop(current);
        run
    });
    result?;
    // Copies to CUDA devices are queued on their streams; wait for them so a finished load
    // means the bytes are in place (and a failed copy is reported here).
    let mut synced: Vec<&Arc<Device>> = Vec::new();
    for t in targets.iter().flatten() {
        if !t.device.is_host() && !synced.iter().any(|d| Arc::ptr_eq(d, &t.device)) {
            t.device.synchronize()?;
            synced.push(&t.device);
        }
    }
    // Tensors quantised on a device are checked now, in load order, for the non-finite values
    // the host quantiser would have refused (one read-back each, after the queued work).
    for (index, word) in &reports {
        if let Some(t) = &targets[*index] {
            convert::check_quantized(&infos[*index], t.dtype, t.device.backend()?, word)?;
        }
    }

    for &i in &order {
        if out[i].is_none() {
            return Err(EngineError::Device {
                device: targets[i]
                    .as_ref()
                    .map_or("cpu", |t| t.device.name())
                    .to_owned(),
                detail: format!(
                    "tensor '{}' was not loaded (the reader stopped early)",
                    infos[i].name
                ),
            });
        }
    }
    Ok(Loaded {
        tensors: out,
        warnings,
    })
}

/// The report word a quantising load onto a CUDA device keeps for `info` while its chunks are
/// quantised there (see [`convert::quantize_chunk_on`]): 8 zeroed bytes of the device, `None`
/// where the host quantises (host destinations, INT8).
fn report_word(
    info: &TensorInfo,
    target: &TensorTarget,
    dst: &crate::device::Buffer,
) -> Result<Option<CudaBuffer>> {
    if !convert::quantizes_on_device(info, target.dtype) || dst.cuda().is_none() {
        return Ok(None);
    }
    let device = &target.device;
    device
        .backend()?
        .alloc(8)
        .map(Some)
        .map_err(|e| EngineError::Device {
            device: device.name().to_owned(),
            detail: format!("allocating the quantisation report of '{}': {e}", info.name),
        })
}

/// Put one staged chunk (source bytes `at..` of the tensor) into the destination buffer,
/// converting on the way. Host buffers are written in place; a CUDA buffer gets the bytes
/// through its backend's pinned double buffer, queued on its stream, so the DMA overlaps the
/// reader thread filling the next staging buffer. A chunk quantised for a CUDA buffer (`found`,
/// its tensor's report word, given) goes up as float rows and is quantised there, on the same
/// stream; host and virtual destinations are quantised on the host.
fn put_chunk(
    info: &TensorInfo,
    to: DType,
    at: u64,
    data: &[u8],
    dst: &mut crate::device::Buffer,
    converted: &mut Vec<u8>,
    found: Option<&mut CudaBuffer>,
) -> Result<()> {
    if convert::quantizing(info, to) {
        if let Some(found) = found {
            let device = Arc::clone(dst.device());
            if let Some(out) = dst.cuda_mut() {
                let backend = device.backend()?;
                return convert::quantize_chunk_on(info, to, at, data, backend, out, found);
            }
        }
        return convert::quantize_chunk(info, to, at, data, converted, &mut |at, bytes| {
            dst.write(at, bytes)
        });
    }
    if let Some(host) = dst.host_mut() {
        return convert::convert_into(info, to, at, data, host);
    }
    if to == info.dtype {
        let at = usize::try_from(at).unwrap_or(usize::MAX);
        return dst.write(at, data);
    }
    // Convert into a host buffer laid out as the output range, then copy that range.
    let (out_at, out_len) = convert::output_range(info, to, at, data.len())?;
    converted.clear();
    converted.resize(out_len, 0);
    convert::convert_into(info, to, 0, data, converted)?;
    dst.write(out_at, converted)
}

struct Reader<'a> {
    source: &'a Arc<dyn Source>,
    files: &'a [PathBuf],
    paths: &'a [Path_],
    /// Chunks of each tensor are whole multiples of this many bytes.
    units: &'a [u64],
    order: &'a [usize],
    staging: usize,
    direct: bool,
    stop: &'a AtomicBool,
}

impl Reader<'_> {
    fn run(self, tx: &mpsc::SyncSender<Msg>, free_rx: &mpsc::Receiver<AlignedBuf>) {
        if let Err(e) = self.run_inner(tx, free_rx) {
            let _ = tx.send(Msg::Err(e));
        }
    }

    fn run_inner(
        &self,
        tx: &mpsc::SyncSender<Msg>,
        free_rx: &mpsc::Receiver<AlignedBuf>,
    ) -> Result<()> {
        let infos = self.source.tensors();
        let mut buffered: Vec<Option<File>> = (0..self.files.len()).map(|_| None).collect();
        let mut direct: Vec<Option<File>> = (0..self.files.len()).map(|_| None).collect();
        let mut direct_ok = self.direct;
        let mut n_bufs = 0;
        for &index in self.order {
            if self.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            if self.paths[index] != Path_::Staged {
                continue;
            }
            let info = &infos[index];
            let path = self
                .files
                .get(info.file)
                .ok_or_else(|| EngineError::Device {
                    device: "cpu".into(),
                    detail: format!(
                        "tensor '{}' names file {} of {}",
                        info.name,
                        info.file,
                        self.files.len()
                    ),
                })?;
            let io = |source| EngineError::Io {
                path: path.clone(),
                tensor: info.name.clone(),
                source,
            };
            match self.paths[index] {
                // Done inline by the caller (skipped above).
                Path_::View | Path_::Pread | Path_::Fill => {}
                Path_::Staged => {
                    let mut at = 0u64;
                    while at < info.nbytes {
                        if self.stop.load(Ordering::Acquire) {
                            return Ok(());
                        }
                        // Two staging buffers, created on first use, then recycled.
                        let mut buf = if n_bufs < 2 {
                            n_bufs += 1;
                            AlignedBuf::zeroed(self.staging + ALIGN).ok_or_else(|| {
                                EngineError::OutOfMemory {
                                    device: "cpu".into(),
                                    requested: (self.staging + ALIGN) as u64,
                                    free: 0,
                                    capacity: 0,
                                }
                            })?
                        } else {
                            match free_rx.recv() {
                                Ok(b) => b,
                                Err(_) => return Ok(()),
                            }
                        };
                        let unit = self.units[index];
                        let want =
                            (info.nbytes - at).min(self.staging as u64 / unit * unit) as usize;
                        let pos = info.offset + at;
                        let mut start = 0usize;
                        let mut got = false;
                        if direct_ok {
                            match open_cached(&mut direct, info.file, path, true) {
                                Ok(f) => match read_direct(f, pos, want, &mut buf) {
                                    Ok(s) => {
                                        start = s;
                                        got = true;
                                    }
                                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                                        direct_ok = false;
                                        let _ = tx.send(Msg::Warning(format!(
                                            "{}: the filesystem refused O_DIRECT reads ({e}); falling back to buffered reads",
                                            path.display()
                                        )));
                                    }
                                    Err(e) => return Err(io(e)),
                                },
                                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                                    direct_ok = false;
                                    let _ = tx.send(Msg::Warning(format!(
                                        "{}: the filesystem refused O_DIRECT ({e}); falling back to buffered reads",
                                        path.display()
                                    )));
                                }
                                Err(e) => return Err(io(e)),
                            }
                        }
                        if !got {
                            let file =
                                open_cached(&mut buffered, info.file, path, false).map_err(io)?;
                            let dst = buf.as_mut_slice().get_mut(..want).unwrap_or(&mut []);
                            file.read_exact_at(dst, pos).map_err(io)?;
                        }
                        let msg = Msg::Chunk {
                            index,
                            at,
                            buf,
                            start,
                            len: want,
                        };
                        if tx.send(msg).is_err() {
                            return Ok(());
                        }
                        at += want as u64;
                    }
                }
            }
        }
        Ok(())
    }
}

/// The open file that holds `info` (buffered reads), opened once per load.
fn tensor_file<'f>(
    info: &TensorInfo,
    device: &Arc<Device>,
    files: &[PathBuf],
    cache: &'f mut [Option<File>],
) -> Result<&'f File> {
    let path = files.get(info.file).ok_or_else(|| EngineError::Device {
        device: device.name().to_owned(),
        detail: format!(
            "tensor '{}' names file {} of {}",
            info.name,
            info.file,
            files.len()
        ),
    })?;
    open_cached(cache, info.file, path, false).map_err(|e| io_error(info, files, e))
}

/// A read of `info`'s file that failed, naming the file and the tensor.
fn io_error(info: &TensorInfo, files: &[PathBuf], source: std::io::Error) -> EngineError {
    EngineError::Io {
        path: files.get(info.file).cloned().unwrap_or_default(),
        tensor: info.name.clone(),
        source,
    }
}

/// Read a tensor stored in its target dtype straight into fresh host memory on `device`
/// ([`read_parallel`]).
fn pread_owned(
    info: &TensorInfo,
    device: &Arc<Device>,
    files: &[PathBuf],
    cache: &mut [Option<File>],
) -> Result<crate::device::Buffer> {
    let mut buf = device.alloc_for_read(info.nbytes)?;
    let file = tensor_file(info, device, files, cache)?;
    let dst = buf.host_mut().ok_or_else(|| EngineError::Device {
        device: device.name().to_owned(),
        detail: format!("tensor '{}': pread needs host memory", info.name),
    })?;
    read_parallel(file, info.offset, dst).map_err(|e| io_error(info, files, e))?;
    Ok(buf)
}

/// Fill `dst` from byte `pos` of `file` with as few `pread` calls as the kernel allows (it caps
/// one call just under 2 GiB); from [`PARALLEL_PREAD`] bytes the read is split over up to
/// [`MAX_PREAD_THREADS`] cores, each with its own large `pread`: copying out of the page cache
/// and faulting in fresh pages are both CPU-bound, and one core does not reach the memory's
/// bandwidth.
fn read_parallel(file: &File, pos: u64, dst: &mut [u8]) -> std::io::Result<()> {
    let parts = if dst.len() >= PARALLEL_PREAD {
        crate::forward::logical_cpus().min(MAX_PREAD_THREADS)
    } else {
        1
    };
    if parts <= 1 {
        return file.read_exact_at(dst, pos);
    }
    let part = dst.len().div_ceil(parts).next_multiple_of(ALIGN);
    let results: Vec<std::io::Result<()>> = std::thread::scope(|s| {
        let mut chunks = dst.chunks_mut(part).enumerate();
        let first = chunks.next();
        let handles: Vec<_> = chunks
            .map(|(k, c)| {
                let at = pos + (k * part) as u64;
                s.spawn(move || file.read_exact_at(c, at))
            })
            .collect();
        let mut results = vec![first.map_or(Ok(()), |(_, c)| file.read_exact_at(c, pos))];
        for h in handles {
            results.push(
                h.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("a pread thread panicked"))),
            );
        }
        results
    });
    results.into_iter().collect()
}

/// Tensors of at least this many bytes are read by several threads at once.
const PARALLEL_PREAD: usize = 8 << 20;
/// At most this many threads read one tensor (or fault in one staged tensor's buffer).
const MAX_PREAD_THREADS: usize = 4;
/// Staged tensors bound for host memory of at least this size have their destination faulted in
/// (in parallel) before the chunks are copied into it.
const POPULATE_BYTES: u64 = 4 << 20;

fn open_cached<'f>(
    cache: &'f mut [Option<File>],
    i: usize,
    path: &std::path::Path,
    direct: bool,
) -> std::io::Result<&'f File> {
    let slot = &mut cache[i];
    if slot.is_none() {
        let mut o = std::fs::OpenOptions::new();
        o.read(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        *slot = Some(o.open(path)?);
    }
    slot.as_ref()
        .ok_or_else(|| std::io::Error::other("file handle missing"))
}

/// Read `want` bytes at `pos` with O_DIRECT: the file offset, length and buffer are all aligned
/// to 4096, so the read covers `[pos & !4095, ...)` and the data starts at `pos % 4096` in `buf`.
fn read_direct(file: &File, pos: u64, want: usize, buf: &mut AlignedBuf) -> std::io::Result<usize> {
    let a = ALIGN as u64;
    let base = pos / a * a;
    let start = (pos - base) as usize;
    let end = start + want;
    let len = end.next_multiple_of(ALIGN).min(buf.len());
    let dst = buf.as_mut_slice();
    let mut filled = 0usize;
    while filled < end {
        let n = file.read_at(&mut dst[filled..len], base + filled as u64)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "file ended inside a tensor; the file is truncated",
            ));
        }
        filled += n;
        if !filled.is_multiple_of(ALIGN) && filled < end {
            // A short read that is not at the end of the file would leave us unaligned.
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
    }
    Ok(start)
}

#[cfg(test)]
mod tests {
    use super::Progress;

    #[test]
    fn the_fraction_done_is_one_for_a_load_with_nothing_to_read() {
        let p = |bytes_done, bytes_total| Progress {
            bytes_done,
            bytes_total,
            tensor: "t",
            device: "cpu",
        };
        assert_eq!(p(0, 0).fraction(), 1.0);
        assert_eq!(p(1, 4).fraction(), 0.25);
        assert_eq!(p(4, 4).fraction(), 1.0);
    }
}

//! Copies of the CUDA backend beyond one linear range: host bytes through pinned staging
//! buffers, strided rows within a device ([`Backend::copy_2d`]) and copies to another device
//! ([`Backend::copy_peer`]).
//!
//! - Staging: two pinned buffers per stream, so the host fills one while the DMA engine drains
//!   the other; an event per buffer says when its last copy was done. The buffers take turns
//!   across calls, not only within one: a small upload right after another (a decode step's
//!   positions after its last one) stages into the buffer the other did not use, whose copy
//!   finished long before, so the host does not wait for the DMA it just queued.
//! - Rows: one `cuMemcpy2DAsync` on the backend's stream, device to device.
//! - Peers: the copy runs on the destination's stream, after an event of the source's stream,
//!   and the source's stream waits for an event recorded after it, so neither side rewrites
//!   or reads the bytes too early and the host never waits. Where `to` cannot reach this
//!   device's memory the bytes go through the host in staging-sized pieces. Strided rows
//!   between two devices are one `cuMemcpy3DPeerAsync` of depth 1.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, PinnedHostSlice,
};

use super::{CudaBackend, CudaBuffer, STAGING_BYTES, drv, wait_in_drop};
use crate::backend::{Backend, Rows, check_range, check_rows, copy_peer_by_rows};
use crate::error::{KernelError, Result};

/// Two pinned host buffers through which host bytes reach a device, the events that say
/// when the copy out of each was done, and the one the next window goes to.
pub(super) struct Staging {
    bufs: [PinnedHostSlice<u8>; 2],
    done: [CudaEvent; 2],
    next: usize,
}

impl Drop for Staging {
    /// A copy out of a staging buffer may still be in flight (copies return once queued), and
    /// cudarc's `PinnedHostSlice` only waits for its own event, which these copies do not
    /// record: wait for ours before the pinned memory is freed.
    fn drop(&mut self) {
        for e in &self.done {
            // Nothing to report to from a drop; the context keeps a sticky error anyway.
            wait_in_drop(e.context(), || e.synchronize());
        }
    }
}

impl Staging {
    fn new(ctx: &Arc<CudaContext>, stream: &CudaStream) -> Result<Staging> {
        // SAFETY: pinned memory is uninitialised until written; every byte copied out of it
        // (in `upload_staged`) was first written from the caller's bytes.
        let a = unsafe { ctx.alloc_pinned::<u8>(STAGING_BYTES) }
            .map_err(drv("allocating pinned staging memory"))?;
        // SAFETY: as above.
        let b = unsafe { ctx.alloc_pinned::<u8>(STAGING_BYTES) }
            .map_err(drv("allocating pinned staging memory"))?;
        let e0 = ctx.new_event(None).map_err(drv("creating an event"))?;
        let e1 = ctx.new_event(None).map_err(drv("creating an event"))?;
        e0.record(stream).map_err(drv("recording an event"))?;
        e1.record(stream).map_err(drv("recording an event"))?;
        Ok(Staging {
            bufs: [a, b],
            done: [e0, e1],
            next: 0,
        })
    }
}

/// Copies `src` into `dst` from byte `offset` on `stream`, through the pinned buffers in
/// `staging` (made on first use): [`upload_filled`] with windows copied from `src`. Returns once
/// the last piece is queued. The caller has checked that `dst` belongs to this device and that
/// the bytes fit.
pub(super) fn upload_staged(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    staging: &Mutex<Option<Staging>>,
    device: &str,
    src: &[u8],
    dst: &mut CudaBuffer,
    offset: usize,
) -> Result<()> {
    let mut copy = |at: usize, window: &mut [u8]| {
        window.copy_from_slice(&src[at..at + window.len()]);
        Ok::<(), std::convert::Infallible>(())
    };
    match upload_filled(
        ctx,
        stream,
        staging,
        device,
        dst,
        offset,
        src.len(),
        &mut copy,
    )? {
        Ok(()) => Ok(()),
        Err(never) => match never {},
    }
}

/// Fills `len` bytes of `dst` from byte `offset` on `stream`: `fill(at, window)` writes bytes
/// `at..at + window.len()` of the range straight into a pinned staging buffer, whose DMA is then
/// queued, so each window's copy to the device overlaps the next window's fill and the bytes
/// are copied on the host once (where [`upload_staged`] copies the caller's bytes in first).
/// Returns once the last window is queued; the outer error is the driver's, the inner one
/// `fill`'s (which ends the fill there).
#[allow(clippy::too_many_arguments)]
pub(super) fn upload_filled<E>(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    staging: &Mutex<Option<Staging>>,
    device: &str,
    dst: &mut CudaBuffer,
    offset: usize,
    len: usize,
    fill: &mut crate::backend::Fill<'_, E>,
) -> Result<std::result::Result<(), E>> {
    let mut guard = staging.lock().map_err(|_| KernelError::Cuda {
        during: format!("staging a copy to {device}"),
        message: "staging lock poisoned".into(),
    })?;
    if guard.is_none() {
        *guard = Some(Staging::new(ctx, stream)?);
    }
    let st = guard.as_mut().ok_or_else(|| KernelError::Cuda {
        during: format!("staging a copy to {device}"),
        message: "no staging buffers".into(),
    })?;
    // the event query below names no context: this device's must be current
    ctx.bind_to_thread()
        .map_err(drv("binding the context for a staged copy"))?;
    for at in (0..len).step_by(STAGING_BYTES) {
        let n = STAGING_BYTES.min(len - at);
        let i = st.next;
        st.next = 1 - i;
        // wait until the DMA that last read this staging buffer has finished (counted when it
        // has not yet: a wait the alternation did not avoid)
        if !st.done[i]
            .try_is_complete()
            .map_err(drv("querying a staging buffer"))?
        {
            crate::backend::record_upload_wait();
            st.done[i]
                .synchronize()
                .map_err(drv("waiting for a staging buffer"))?;
        }
        let pinned = st.bufs[i]
            .as_mut_slice()
            .map_err(drv("mapping pinned memory"))?;
        if let Err(e) = fill(at, &mut pinned[..n]) {
            return Ok(Err(e));
        }
        let to = offset + at;
        let mut view = dst.slice.slice_mut(to..to + n);
        stream
            .memcpy_htod(&pinned[..n], &mut view)
            .map_err(drv(format!("copying {n} bytes to {device}")))?;
        st.done[i]
            .record(stream)
            .map_err(drv("recording an event"))?;
    }
    Ok(Ok(()))
}

/// The pitch the driver is given: one row may have any pitch (nothing follows it), but the
/// driver wants every pitch at least the row width.
fn driver_pitch(side: Rows, width: usize, rows: usize) -> usize {
    if rows == 1 { width } else { side.pitch }
}

impl CudaBackend {
    /// [`Backend::copy_2d`]: one 2-D copy on this backend's stream.
    pub(super) fn copy_rows(
        &self,
        src: &CudaBuffer,
        from: Rows,
        dst: &mut CudaBuffer,
        to: Rows,
        width: usize,
        rows: usize,
    ) -> Result<()> {
        self.own(src)?;
        self.own(dst)?;
        check_rows("copy_2d source bytes", src.slice.len(), from, width, rows)?;
        check_rows(
            "copy_2d destination bytes",
            dst.slice.len(),
            to,
            width,
            rows,
        )?;
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let during = format!(
            "copying {rows} rows of {width} bytes (pitches {} and {}) on {}",
            from.pitch,
            to.pitch,
            self.name()
        );
        self.ctx.bind_to_thread().map_err(drv(&during))?;
        // the guards record the copy in cudarc's read/write events of both buffers
        let (s, _read) = src.slice.device_ptr(&self.stream);
        let (d, _write) = dst.slice.device_ptr_mut(&self.stream);
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: s + from.offset as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: driver_pitch(from, width, rows),
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: d + to.offset as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: driver_pitch(to, width, rows),
            WidthInBytes: width,
            Height: rows,
        };
        // SAFETY: every row of both sides lies inside a live allocation of this device
        // (checked above), the rows of each side do not overlap, and the two buffers are
        // distinct (`&` and `&mut`); the descriptor is read before the call returns.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, self.stream.cu_stream()) }
            .result()
            .map_err(drv(&during))
    }

    /// [`Backend::peer_access`], remembered per destination device.
    pub(super) fn reaches(&self, to: &CudaBackend) -> bool {
        if to.ordinal == self.ordinal {
            return true;
        }
        let Ok(mut peers) = self.peers.lock() else {
            return false;
        };
        if let Some(&known) = peers.get(&to.ordinal) {
            return known;
        }
        // a failed query or enable leaves the host route, which always works
        let ok = self.enable_peer(to).unwrap_or(false);
        peers.insert(to.ordinal, ok);
        ok
    }

    /// Lets `to`'s context (where a peer copy runs) read and write this device's memory, when
    /// the driver allows it.
    fn enable_peer(&self, to: &CudaBackend) -> Result<bool> {
        let during = format!("enabling peer access from {} to {}", to.name(), self.name());
        let mut can = 0;
        // SAFETY: two valid device handles of initialised contexts and a live out-pointer.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, to.ctx.cu_device(), self.ctx.cu_device()) }
            .result()
            .map_err(drv(&during))?;
        if can == 0 {
            return Ok(false);
        }
        to.ctx.bind_to_thread().map_err(drv(&during))?;
        // SAFETY: `to`'s context is current and this one is a live context; flags must be 0.
        match unsafe { sys::cuCtxEnablePeerAccess(self.ctx.cu_ctx(), 0) }.result() {
            Ok(()) => Ok(true),
            // another backend of the same device pair enabled it (primary contexts are shared)
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(true),
            Err(e) => Err(drv(&during)(e)),
        }
    }

    /// [`Backend::copy_peer`].
    /// [`Backend::copy_peer_2d`]: strided rows between two devices with peer access in one
    /// 3-D peer copy of depth 1, ordered as [`Backend::copy_peer`]; row by row otherwise.
    pub(super) fn copy_rows_to_peer(
        &self,
        src: &CudaBuffer,
        from: Rows,
        to: &CudaBackend,
        dst: &mut CudaBuffer,
        to_rows: Rows,
        (width, rows): (usize, usize),
    ) -> Result<()> {
        let contiguous = rows <= 1 || (from.pitch == width && to_rows.pitch == width);
        if contiguous || self.ordinal == to.ordinal || !self.reaches(to) {
            return copy_peer_by_rows(self, src, from, to, dst, to_rows, (width, rows));
        }
        self.own(src)?;
        to.own(dst)?;
        check_rows(
            "copy_peer_2d source bytes",
            src.slice.len(),
            from,
            width,
            rows,
        )?;
        check_rows(
            "copy_peer_2d destination bytes",
            dst.slice.len(),
            to_rows,
            width,
            rows,
        )?;
        if width == 0 {
            return Ok(());
        }
        let during = format!(
            "copying {rows} rows of {width} bytes from {} to {}",
            self.name(),
            to.name()
        );
        let ready = self.stream.record_event(None).map_err(drv(&during))?;
        to.stream.wait(&ready).map_err(drv(&during))?;
        let (s, _read) = src.slice.device_ptr(&self.stream);
        let (d, _write) = dst.slice.device_ptr_mut(&to.stream);
        to.ctx.bind_to_thread().map_err(drv(&during))?;
        let copy = sys::CUDA_MEMCPY3D_PEER {
            srcXInBytes: 0,
            srcY: 0,
            srcZ: 0,
            srcLOD: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: s + from.offset as u64,
            srcArray: std::ptr::null_mut(),
            srcContext: self.ctx.cu_ctx(),
            srcPitch: from.pitch,
            srcHeight: rows,
            dstXInBytes: 0,
            dstY: 0,
            dstZ: 0,
            dstLOD: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: d + to_rows.offset as u64,
            dstArray: std::ptr::null_mut(),
            dstContext: to.ctx.cu_ctx(),
            dstPitch: to_rows.pitch,
            dstHeight: rows,
            WidthInBytes: width,
            Height: rows,
            Depth: 1,
        };
        // SAFETY: every row of both sides lies inside a live allocation of its own device
        // (checked above), each named with its context; the rows of a side do not overlap and
        // the buffers are distinct (`&` and `&mut`); the descriptor is read before the call
        // returns.
        unsafe { sys::cuMemcpy3DPeerAsync(&copy, to.stream.cu_stream()) }
            .result()
            .map_err(drv(&during))?;
        let done = to.stream.record_event(None).map_err(drv(&during))?;
        self.stream.wait(&done).map_err(drv(&during))
    }

    pub(super) fn copy_to_peer(
        &self,
        src: &CudaBuffer,
        so: usize,
        to: &CudaBackend,
        dst: &mut CudaBuffer,
        d_o: usize,
        bytes: usize,
    ) -> Result<()> {
        self.own(src)?;
        to.own(dst)?;
        check_range("copy source bytes", src.slice.len(), so, bytes)?;
        check_range("copy destination bytes", dst.slice.len(), d_o, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        if std::ptr::eq(self, to) {
            return self.copy(src, so, dst, d_o, bytes);
        }
        if !self.reaches(to) {
            return self.copy_through_host(src, so, to, dst, d_o, bytes);
        }
        let during = format!(
            "copying {bytes} bytes from {} to {}",
            self.name(),
            to.name()
        );
        let ready = self.stream.record_event(None).map_err(drv(&during))?;
        to.stream.wait(&ready).map_err(drv(&during))?;
        // cudarc's tracking: the destination stream waits for the buffers' earlier uses; the
        // source's read is recorded (when `_read` drops) on its stream after the wait below
        let (s, _read) = src.slice.device_ptr(&self.stream);
        let (d, _write) = dst.slice.device_ptr_mut(&to.stream);
        let (s, d) = (s + so as u64, d + d_o as u64);
        to.ctx.bind_to_thread().map_err(drv(&during))?;
        let queued = if self.ordinal == to.ordinal {
            // SAFETY: both ranges lie inside live allocations of this one device (checked
            // above) and belong to distinct buffers (`&` and `&mut`).
            unsafe { sys::cuMemcpyDtoDAsync_v2(d, s, bytes, to.stream.cu_stream()) }
        } else {
            // SAFETY: as above, each range in its own device's context, named with it.
            unsafe {
                sys::cuMemcpyPeerAsync(
                    d,
                    to.ctx.cu_ctx(),
                    s,
                    self.ctx.cu_ctx(),
                    bytes,
                    to.stream.cu_stream(),
                )
            }
        };
        queued.result().map_err(drv(&during))?;
        let done = to.stream.record_event(None).map_err(drv(&during))?;
        self.stream.wait(&done).map_err(drv(&during))
    }

    /// A peer copy through host memory, a staging buffer's worth at a time (so the host holds
    /// at most that much): each piece is read back (which waits for this device's queued work)
    /// and queued to `to`.
    fn copy_through_host(
        &self,
        src: &CudaBuffer,
        so: usize,
        to: &CudaBackend,
        dst: &mut CudaBuffer,
        d_o: usize,
        bytes: usize,
    ) -> Result<()> {
        let mut host = vec![0u8; bytes.min(STAGING_BYTES)];
        let mut done = 0;
        while done < bytes {
            let n = (bytes - done).min(host.len());
            self.copy_to_host(src, so + done, &mut host[..n])?;
            to.copy_from_host(&host[..n], dst, d_o + done)?;
            done += n;
        }
        Ok(())
    }
}

//! A second stream on a CUDA device for host-to-device copies, so that they overlap the kernels
//! on the backend's compute stream (the engine's onload copier fills one weight slot while the
//! layers of another compute).
//!
//! The two streams are ordered only where the caller says so, by events and never by a host
//! wait: [`CopyStream::after_compute`] before bytes the compute stream may still read are
//! overwritten, [`CopyStream::before_compute`] before the compute stream reads what was copied.
//!
//! Uploads go through the stream's own two pinned staging buffers, as
//! [`Backend::copy_from_host`](crate::Backend::copy_from_host) does on the compute stream, so an
//! upload returns once its last piece is queued.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};

use super::copies::{Staging, upload_staged};
use super::{CudaBackend, CudaBuffer, HostPins, drv, wait_in_drop};
use crate::backend::{Backend, check_range};
use crate::error::{KernelError, Result};

/// The copy stream of one CUDA device (see the module docs). A handle: clones share the
/// stream and its staging buffers. `Send + Sync`; uploads from several threads are queued one
/// after another.
#[derive(Clone)]
pub struct CopyStream {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    staging: Mutex<Option<Staging>>,
}

impl Drop for Inner {
    /// Copies still queued read the staging buffers and write device memory: let them finish
    /// before the buffers are freed.
    fn drop(&mut self) {
        // Nothing to report to from a drop; the context keeps a sticky error anyway.
        wait_in_drop(&self.ctx, || self.stream.synchronize());
    }
}

impl std::fmt::Debug for CopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyStream")
            .field("device", &self.name())
            .finish()
    }
}

impl CopyStream {
    /// A new stream on `b`'s device; the staging buffers are pinned on the first upload.
    pub(super) fn new(b: &CudaBackend) -> Result<CopyStream> {
        let stream = b
            .ctx
            .new_stream()
            .map_err(drv(format!("creating a copy stream on {}", b.name())))?;
        Ok(CopyStream {
            inner: Arc::new(Inner {
                ordinal: b.ordinal,
                ctx: Arc::clone(&b.ctx),
                stream,
                staging: Mutex::new(None),
            }),
        })
    }

    fn name(&self) -> String {
        format!("cuda:{}", self.inner.ordinal)
    }

    fn same_device(&self, b: &CudaBackend) -> Result<()> {
        if b.ordinal == self.inner.ordinal {
            Ok(())
        } else {
            Err(KernelError::StreamDevice {
                stream: self.name(),
                backend: b.name(),
            })
        }
    }

    /// Queues an upload of `src` into `dst` (a buffer of this device) from byte `offset`;
    /// returns once queued. Not ordered after the compute stream: call
    /// [`CopyStream::after_compute`] first when its kernels may still read those bytes.
    pub fn upload(&self, src: &[u8], dst: &mut CudaBuffer, offset: usize) -> Result<()> {
        let i = &self.inner;
        if dst.ordinal != i.ordinal {
            return Err(KernelError::WrongDevice {
                buffer_device: format!("cuda:{}", dst.ordinal),
                backend: format!("{} (its copy stream)", self.name()),
                got: dst.slice.len(),
            });
        }
        check_range("copy destination bytes", dst.slice.len(), offset, src.len())?;
        upload_staged(
            &i.ctx,
            &i.stream,
            &i.staging,
            &self.name(),
            src,
            dst,
            offset,
        )
    }

    /// [`CopyStream::upload`], straight from page-locked memory where `pins` (of this device)
    /// covers all of `src`: one asynchronous copy the DMA engine reads from where the bytes
    /// are, with no staging and no host wait. Otherwise through staging, as `upload`.
    pub fn upload_from(
        &self,
        pins: &HostPins,
        src: &[u8],
        dst: &mut CudaBuffer,
        offset: usize,
    ) -> Result<()> {
        let i = &self.inner;
        if !Arc::ptr_eq(&pins.ctx, &i.ctx) || !pins.covers(src) || dst.ordinal != i.ordinal {
            return self.upload(src, dst, offset);
        }
        check_range("copy destination bytes", dst.slice.len(), offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let during = || format!("copying {} pinned bytes to {}", src.len(), self.name());
        i.ctx.bind_to_thread().map_err(drv(during()))?;
        let mut view = dst.slice.slice_mut(offset..offset + src.len());
        let (ptr, _written) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut view, &i.stream);
        // SAFETY: `src` lies in pages `pins` registered with this device's context, which the
        // caller of `pin_host` keeps mapped and unchanged while the pins live (and the pins wait
        // for every stream before they go), so the copy reads valid memory whenever it runs;
        // `ptr` is `src.len()` bytes of this device's buffer from `offset` (checked above).
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, src, i.stream.cu_stream()) }
            .map_err(drv(during()))
    }

    /// This stream waits for the work queued on `b`'s compute stream so far (the kernels that
    /// read a slot about to be refilled). No host wait.
    pub fn after_compute(&self, b: &CudaBackend) -> Result<()> {
        self.same_device(b)?;
        let during = format!("ordering {}'s copy stream after its compute", self.name());
        let e = b.stream.record_event(None).map_err(drv(&during))?;
        self.inner.stream.wait(&e).map_err(drv(&during))
    }

    /// `b`'s compute stream waits for the copies queued on this stream so far (before a kernel
    /// reads what they wrote). No host wait.
    pub fn before_compute(&self, b: &CudaBackend) -> Result<()> {
        self.same_device(b)?;
        let during = format!("ordering {}'s compute after its copy stream", self.name());
        let e = self.inner.stream.record_event(None).map_err(drv(&during))?;
        b.stream.wait(&e).map_err(drv(&during))
    }

    /// Blocks until every queued copy has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .stream
            .synchronize()
            .map_err(drv(format!("synchronising {}'s copy stream", self.name())))
    }
}

impl CudaBackend {
    /// This device's copy stream (see [`CopyStream`]): made, with its own two pinned staging
    /// buffers, on the first call and kept by the backend; every later call returns a handle to
    /// the same stream, so a caller per forward call pins no memory of its own.
    pub fn copy_stream(&self) -> Result<CopyStream> {
        let mut kept = self.copy.lock().map_err(|_| KernelError::Cuda {
            during: format!("making {}'s copy stream", self.name()),
            message: "copy stream lock poisoned".into(),
        })?;
        if let Some(c) = kept.as_ref() {
            return Ok(c.clone());
        }
        let c = CopyStream::new(self)?;
        *kept = Some(c.clone());
        Ok(c)
    }
}

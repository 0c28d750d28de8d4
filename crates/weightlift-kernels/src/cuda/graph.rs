//! CUDA graphs: the launches of a sequence of operations recorded once on the backend's stream
//! and replayed as one graph launch, so a decode step costs one launch on the host instead of a
//! few hundred.
//!
//! A replay repeats every launch with the arguments it was recorded with (the same buffers,
//! counts and grids); only what the kernels read from device memory may change between replays.
//! A decode step's position is such a value: RoPE, the cache store at the position's row and
//! attention read it from the positions buffer in their device-position forms
//! ([`Op::RopeKvStore`]'s `cache_rows`, [`Op::Attention`]'s `start_at`). The engine captures a
//! decode step on one device with them and replays it (`forward/graph/step.rs` there).

// cudarc's capture API is safe, but the buffers a graph will touch when replayed are the
// caller's to keep alive: the replay is unsafe.
#![allow(unsafe_code)]

use super::*;

/// Launches recorded by [`CudaBackend::capture`], replayed by [`CudaBackend::replay`], which
/// takes it by `&mut`: the driver does not synchronise calls on one graph, so only its owner
/// may launch it, one call at a time.
pub struct CudaStepGraph {
    graph: cudarc::driver::CudaGraph,
    ordinal: usize,
}

impl std::fmt::Debug for CudaStepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStepGraph")
            .field("device", &format!("cuda:{}", self.ordinal))
            .finish()
    }
}

// SAFETY: the driver's graph handles may be used from any thread, one call at a time; a launch
// binds the graph's context to the calling thread first. Every driver call on the graph needs
// `&mut CudaStepGraph` (a replay) or ownership (its drop), so the borrow rules serialise them,
// and a shared reference can reach no driver call at all.
unsafe impl Send for CudaStepGraph {}
// SAFETY: as above: `&CudaStepGraph` gives only its device ordinal and its `Debug` form.
unsafe impl Sync for CudaStepGraph {}

impl CudaBackend {
    /// Runs `record` with this backend's stream capturing: its operations are recorded into a
    /// graph, not run. Nothing in `record` may wait for the device (no
    /// [`Backend::synchronize`], no copy to the host): the driver refuses, and the capture
    /// fails with its error. Run the same operations once before capturing them, so every
    /// module is loaded and every kept buffer (decode's Q8 activations, the cuBLAS handle)
    /// exists. None is made while recording: a product recorded before them quantises into a
    /// scratch of the graph's, and a prompt product takes the kernels where cuBLAS would run
    /// (other bits than the launched product's). A scratch buffer allocated
    /// inside the capture becomes part of the graph. The capture is relaxed:
    /// other threads may use the driver meanwhile, but not this backend's stream.
    pub fn capture(
        &self,
        record: impl FnOnce(&CudaBackend) -> Result<()>,
    ) -> Result<CudaStepGraph> {
        let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        self.stream
            .begin_capture(mode)
            .map_err(drv(format!("starting a graph capture on {}", self.name())))?;
        let recorded = record(self);
        // cudarc keeps the error of a driver call made in a drop (a stream-ordered free of a
        // buffer dropped inside `record`, refused once the capture is invalidated) and returns
        // it from the next call that binds the context: `end_capture` would return it before
        // ending the capture, leaving the stream capturing and every later launch and copy on
        // it failing. It is taken here, so the capture ends whatever happened and the stream
        // runs work again.
        let dropped = self
            .ctx
            .check_err()
            .map_err(drv(format!("recording a graph on {}", self.name())));
        let ended = self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(drv(format!("ending a graph capture on {}", self.name())));
        recorded?;
        dropped?;
        let graph = ended?.ok_or_else(|| KernelError::Cuda {
            during: format!("ending a graph capture on {}", self.name()),
            message: "the capture recorded nothing".into(),
        })?;
        Ok(CudaStepGraph {
            graph,
            ordinal: self.ordinal,
        })
    }

    /// Enqueues every launch `step` recorded, in order, on this backend's stream (one graph
    /// launch), with the arguments they were recorded with.
    ///
    /// # Safety
    ///
    /// Every buffer the recorded operations read or wrote must still be alive (not freed or
    /// reallocated since the capture), and nothing else may use them until the replay is done
    /// (ordered on this stream, as any launch).
    pub unsafe fn replay(&self, step: &mut CudaStepGraph) -> Result<()> {
        if step.ordinal != self.ordinal {
            return Err(KernelError::WrongDevice {
                buffer_device: format!("cuda:{} (a captured graph)", step.ordinal),
                backend: self.name(),
                got: 0,
            });
        }
        step.graph
            .launch()
            .map_err(drv(format!("replaying a graph on {}", self.name())))
    }
}

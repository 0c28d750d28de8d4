//! CUDA graphs: the launches of a sequence of operations recorded once on the backend's stream
//! and replayed as one graph launch, so a decode step costs one launch on the host instead of a
//! few hundred.
//!
//! Off by default: nothing in the engine captures yet. A replay repeats every launch with the
//! arguments it was recorded with (the same buffers, counts and grids); only what the kernels
//! read from device memory may change between replays. Positions already come from device
//! memory (RoPE reads them from a buffer); what a decode step still passes from the host, and
//! so what the engine must move to device memory before it can replay a step, is named in the
//! README's GPU notes.

// cudarc's capture API is safe, but the buffers a graph will touch when replayed are the
// caller's to keep alive: the replay is unsafe.
#![allow(unsafe_code)]

use super::*;

/// Launches recorded by [`CudaBackend::capture`], replayed by [`CudaBackend::replay`]. Not
/// `Send`: a graph may only be used from one thread at a time (the driver does not
/// synchronise access to it).
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

impl CudaBackend {
    /// Runs `record` with this backend's stream capturing: its operations are recorded into a
    /// graph, not run. Nothing in `record` may wait for the device (no
    /// [`Backend::synchronize`], no copy to the host): the driver refuses, and the capture
    /// fails with its error. Run the same operations once before capturing them, so every
    /// module is loaded and every kept buffer (decode's Q8 activations) exists; a scratch
    /// buffer allocated inside the capture becomes part of the graph. The capture is relaxed:
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
        // the capture ends whatever happened, so the stream runs work again
        let ended = self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(drv(format!("ending a graph capture on {}", self.name())));
        recorded?;
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
    pub unsafe fn replay(&self, step: &CudaStepGraph) -> Result<()> {
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

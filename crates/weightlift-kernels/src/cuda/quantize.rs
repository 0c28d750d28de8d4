//! Quantise-on-load on the device ([`Backend::quantize_rows`]): the source rows go up through
//! the pinned staging buffers into a stream-ordered scratch of their own size, and
//! `quantize_{type}_{src}` (`kernels/quantize.cu`) writes the blocks straight into the
//! destination, all queued on the compute stream.

use super::*;
use crate::sources::QUANTIZE_THREADS;

impl CudaBackend {
    /// [`Backend::quantize_rows`] on this device.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn quantize_rows_on_device(
        &self,
        ty: QuantType,
        src_ty: FloatType,
        src: &[u8],
        n_per_row: usize,
        dst: &mut CudaBuffer,
        offset: usize,
        first: usize,
        found: &mut CudaBuffer,
    ) -> Result<()> {
        self.own(dst)?;
        self.own(found)?;
        need("quantize report bytes", found, 8)?;
        let n_values = crate::cpu::quantize::source_values(src_ty, src)?;
        let row_bytes = crate::cpu::quantize::quantized_row_bytes(ty, n_per_row)?;
        if !n_values.is_multiple_of(n_per_row) {
            return Err(KernelError::Shape {
                op: "quantize",
                reason: format!(
                    "{n_values} source values are not whole rows of {n_per_row}; the tensor's \
                     shape and the row length disagree"
                ),
            });
        }
        let out_bytes = (n_values / n_per_row).saturating_mul(row_bytes);
        check_range(
            "quantize destination bytes",
            dst.slice.len(),
            offset,
            out_bytes,
        )?;
        if src.is_empty() {
            return Ok(());
        }
        let n_blocks = n_values / ty.block_size();
        self.stack_before_quantize
            .get_or_init(|| self.stack_limit().ok());
        // SAFETY: every byte the kernel reads is written by the upload queued before it.
        let slice = unsafe { self.scratch(src.len()) }?;
        let mut scratch = CudaBuffer {
            slice: ManuallyDrop::new(slice),
            ordinal: self.ordinal,
            view: false,
        };
        self.copy_from_host(src, &mut scratch, 0)?;
        let name = format!("quantize_{}_{}", ty.name(), src_ty.name());
        let cfg = LaunchConfig {
            grid_dim: (
                grid_for(n_blocks, QUANTIZE_THREADS, "quantize blocks")?,
                1,
                1,
            ),
            block_dim: (QUANTIZE_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let out = dst.slice.slice_mut(offset..offset + out_bytes);
        let mut args = [
            KArg::In(&scratch.slice),
            KArg::OutView(out),
            KArg::U64(n_blocks as u64),
            KArg::U64(first as u64),
            KArg::Out(&mut found.slice),
        ];
        // SAFETY: one thread per block below n_blocks; the scratch holds n_blocks blocks of
        // source values (src.len() bytes, whole rows), the view n_blocks quantised blocks
        // (out_bytes, checked inside dst), and `found` one u64 (checked); a device allocation
        // is 256-byte aligned, so the kernel's 64-bit atomicMax on it is aligned.
        unsafe { self.launch("quantize", &name, cfg, &mut args) }
        // the scratch is freed in stream order, after the kernel
    }

    /// [`Backend::check_quantized`] on this device: the report, then the context's per-thread
    /// stack limit back to what it was before the quantisers ran. The K-quant quantisers' frame
    /// (a block's values and the search's scratch, about 1.3 KiB a thread in the sm_90 build) is
    /// past the 1 KiB a context reserves a thread; the driver grows the reserve for every
    /// thread the device can hold at their first launch (about 86 MB on an H200) and keeps it,
    /// memory no plan charges. Setting the limit back gives it up (the driver waits for the
    /// queued work, which the report's read has already done).
    pub(super) fn check_quantized_on_device(&self, found: &CudaBuffer) -> Result<()> {
        let mut word = [0u8; 8];
        self.copy_to_host(found, 0, &mut word)?;
        if let Some(Some(before)) = self.stack_before_quantize.get()
            && self.stack_limit()? > *before
        {
            self.set_stack_limit(*before)?;
        }
        crate::cpu::quantize::check_non_finite_report(u64::from_le_bytes(word))
    }

    /// The context's per-thread stack limit in bytes (`cuCtxGetLimit`).
    pub fn stack_limit(&self) -> Result<usize> {
        use cudarc::driver::sys;
        self.ctx
            .bind_to_thread()
            .map_err(drv("binding the context to read its stack limit"))?;
        let mut bytes = 0usize;
        // SAFETY: the context is current on this thread, and the driver writes one usize.
        unsafe { sys::cuCtxGetLimit(&mut bytes, sys::CUlimit::CU_LIMIT_STACK_SIZE) }
            .result()
            .map_err(drv("reading the context's stack limit"))?;
        Ok(bytes)
    }

    /// Sets the context's per-thread stack limit (`cuCtxSetLimit`).
    fn set_stack_limit(&self, bytes: usize) -> Result<()> {
        use cudarc::driver::sys;
        self.ctx
            .bind_to_thread()
            .map_err(drv("binding the context to set its stack limit"))?;
        // SAFETY: the context is current on this thread; the driver waits for queued work
        // before it resizes the reserve.
        unsafe { sys::cuCtxSetLimit(sys::CUlimit::CU_LIMIT_STACK_SIZE, bytes) }
            .result()
            .map_err(drv("restoring the context's stack limit"))
    }
}

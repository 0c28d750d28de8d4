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
}

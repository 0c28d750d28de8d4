//! How each backend sees engine memory ([`Exec`] for the CPU and CUDA backends): held
//! tensors, norms, workspaces and onload slots as buffers of the backend, viewed in place.

// The views are made through the kernels' unsafe view constructors, each wrapped at once in a
// guard that borrows what it views (see the parent module).
#![allow(unsafe_code)]

use super::*;

fn not_host(device: &str, what: &str) -> EngineError {
    EngineError::Device {
        device: device.to_owned(),
        detail: format!("{what} is not in host memory; the host backend cannot read it"),
    }
}

fn not_cuda(device: &str, what: &str) -> EngineError {
    EngineError::Device {
        device: device.to_owned(),
        detail: format!(
            "{what} is not cuda memory of this device; the cuda backend cannot read it"
        ),
    }
}

impl Exec for CpuBackend {
    fn q8_supports(ty: QuantType) -> bool {
        weightlift_kernels::cpu::matvec::q8_supports(ty)
    }

    /// The fast mode's block products of up to `Q8_BATCH_MAX_TOKENS` tokens give every token
    /// its own matrix-vector bits (the host path's rule); every other product sums a
    /// several-token product in another order than one token's, so it runs per sequence.
    fn shared_tokens(_compute: Compute, mode: MatvecMode) -> usize {
        match mode {
            MatvecMode::Q8 => weightlift_kernels::cpu::matvec::Q8_BATCH_MAX_TOKENS,
            MatvecMode::Exact => 0,
        }
    }

    fn tensor<'a>(&self, t: &'a DeviceTensor) -> Result<Part<'a, CpuBuffer>> {
        let bytes = t
            .host_bytes()
            .ok_or_else(|| not_host(&self.name(), &format!("a tensor on {}", t.device().name())))?;
        // SAFETY: the view lives in a guard that borrows the tensor's bytes for 'a; nothing
        // writes through a `Part`.
        Ok(Part::View(unsafe { self.borrow(bytes) }, PhantomData))
    }

    fn floats<'a>(&self, f: &'a Floats, _held: &'a [Held]) -> Result<Part<'a, CpuBuffer>> {
        // SAFETY: as in `tensor`, over the host copy the graph keeps.
        Ok(Part::View(
            unsafe { self.borrow(bytemuck::cast_slice(&f.host)) },
            PhantomData,
        ))
    }

    fn whole_mut<'a>(&self, b: &'a mut Buffer) -> Result<PartMut<'a, CpuBuffer>> {
        let name = b.device().name().to_owned();
        let bytes = b
            .host_mut()
            .ok_or_else(|| not_host(&self.name(), &format!("a buffer on {name}")))?;
        // SAFETY: the view lives in a guard that borrows the bytes mutably for 'a.
        Ok(PartMut::View(
            unsafe { self.borrow_mut(bytes) },
            PhantomData,
        ))
    }

    fn regions<'a>(
        &self,
        b: &'a mut Buffer,
        ranges: &[(usize, usize)],
    ) -> Result<Vec<PartMut<'a, CpuBuffer>>> {
        let name = b.device().name().to_owned();
        let bytes = b
            .host_mut()
            .ok_or_else(|| not_host(&self.name(), &format!("a buffer on {name}")))?;
        carve_bytes(bytes, ranges)?
            .into_iter()
            // SAFETY: each view lives in a guard that borrows its own disjoint piece of the
            // bytes mutably for 'a.
            .map(|piece| {
                Ok(PartMut::View(
                    unsafe { self.borrow_mut(piece) },
                    PhantomData,
                ))
            })
            .collect()
    }

    fn slot_view<'a>(
        &self,
        slot: &'a SlotMem<'_>,
        at: usize,
        len: usize,
    ) -> Result<Part<'a, CpuBuffer>> {
        let bytes = slot
            .host()
            .ok_or_else(|| not_host(&self.name(), "an onload slot"))?;
        let piece = at
            .checked_add(len)
            .and_then(|end| bytes.get(at..end))
            .ok_or_else(|| {
                invalid(
                    "onloaded matrix",
                    format!("{len} bytes from offset {at}"),
                    format!("a slot of {} bytes", bytes.len()),
                )
            })?;
        // SAFETY: the view lives in a guard that borrows the slot for 'a; nothing writes
        // through a `Part`, and the slot is not refilled while the layer computes.
        Ok(Part::View(unsafe { self.borrow(piece) }, PhantomData))
    }
}

/// Disjoint pieces of `bytes` at `ranges`, in the order given (safe `split_at_mut`s).
fn carve_bytes<'a>(bytes: &'a mut [u8], ranges: &[(usize, usize)]) -> Result<Vec<&'a mut [u8]>> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| ranges[i]);
    let mut pieces: Vec<Option<&'a mut [u8]>> = (0..ranges.len()).map(|_| None).collect();
    let mut rest = bytes;
    let mut at = 0usize;
    for i in order {
        let (offset, len) = ranges[i];
        let end = offset.checked_add(len);
        if offset < at || end.is_none_or(|e| e - at > rest.len()) {
            return Err(invalid(
                "workspace regions",
                "disjoint ranges inside the buffer",
                format!("{len} bytes at {offset}"),
            ));
        }
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(offset - at);
        let (piece, tail) = tail.split_at_mut(len);
        rest = tail;
        at = offset + len;
        pieces[i] = Some(piece);
    }
    Ok(pieces.into_iter().map(Option::unwrap_or_default).collect())
}

impl Exec for CudaBackend {
    /// `AddRmsNorm` and a split `Attention` quantise for the products after them.
    const QUANTISES_AHEAD: bool = true;

    /// The Q8 types, and f16 and bf16: fast mode's prompts round their activations to the
    /// weights' type on tensor cores (cuBLAS), and their other products are exact.
    fn q8_supports(ty: QuantType) -> bool {
        sources::CUDA_Q8_TYPES.contains(&ty) || sources::CUDA_FAST_FLOAT_TYPES.contains(&ty)
    }

    /// In fast mode every product takes the whole batch: the several-token kernels quantise
    /// each token's activations as one token's do and differ from them only in the order of
    /// the f32 sums over blocks, far inside the activation quantisation's bound, and rows of
    /// as many tokens as take cuBLAS (`sources::CUBLAS_MIN_TOKENS_BY_TYPE`: from two for Q8_0)
    /// round the activations to f16 or bf16 there, within that bound too. Exact mode
    /// keeps one product per sequence, so each gets its own bits.
    fn shared_tokens(compute: Compute, _mode: MatvecMode) -> usize {
        match compute {
            Compute::Fast => usize::MAX,
            Compute::Exact => 0,
        }
    }

    fn tensor<'a>(&self, t: &'a DeviceTensor) -> Result<Part<'a, CudaBuffer>> {
        match t.storage() {
            Storage::Owned(b) => b.cuda().map(Part::Whole).ok_or_else(|| {
                not_cuda(&self.name(), &format!("a tensor on {}", t.device().name()))
            }),
            Storage::Mapped { .. } => Err(not_cuda(
                &self.name(),
                "a tensor mapped from the checkpoint file",
            )),
        }
    }

    fn floats<'a>(&self, f: &'a Floats, held: &'a [Held]) -> Result<Part<'a, CudaBuffer>> {
        if let Some(b) = &f.device {
            return b
                .cuda()
                .map(Part::Whole)
                .ok_or_else(|| not_cuda(&self.name(), &format!("the copy of '{}'", f.name)));
        }
        match held.get(f.index) {
            Some(Held::Whole { tensor, .. }) if f.held_on_device => self.tensor(tensor),
            _ => Err(not_cuda(&self.name(), &format!("'{}'", f.name))),
        }
    }

    fn whole_mut<'a>(&self, b: &'a mut Buffer) -> Result<PartMut<'a, CudaBuffer>> {
        let name = b.device().name().to_owned();
        b.cuda_mut()
            .map(PartMut::Whole)
            .ok_or_else(|| not_cuda(&self.name(), &format!("a buffer on {name}")))
    }

    fn regions<'a>(
        &self,
        b: &'a mut Buffer,
        ranges: &[(usize, usize)],
    ) -> Result<Vec<PartMut<'a, CudaBuffer>>> {
        let name = b.device().name().to_owned();
        let dev = self.name();
        let buf = b
            .cuda_mut()
            .ok_or_else(|| not_cuda(&dev, &format!("a buffer on {name}")))?;
        split(self, buf, ranges).map_err(|e| kernel_on(&dev, "workspace regions", e))
    }

    fn slot_view<'a>(
        &self,
        slot: &'a SlotMem<'_>,
        at: usize,
        len: usize,
    ) -> Result<Part<'a, CudaBuffer>> {
        let SlotMem::Cuda(_, p) = slot else {
            return Err(not_cuda(&self.name(), "an onload slot in host memory"));
        };
        view(self, p, at, len).map_err(|e| kernel_on(&self.name(), "onload slot", e))
    }
}

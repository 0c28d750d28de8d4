//! Kernel launches: the argument kinds checked against each kernel's signature, and the grid
//! shapes.

// cudarc's launch API is unsafe; each call says why its arguments are sound.
#![allow(unsafe_code)]

use super::*;

/// One kernel argument. [`CudaBackend::launch`] checks their kinds against the kernel's
/// parameter list in [`crate::sources::SIGNATURES`] before anything reaches the driver.
pub(super) enum KArg<'a> {
    /// A buffer the kernel reads.
    In(&'a CudaSlice<u8>),
    /// Part of a buffer the kernel reads (a chunk of weight rows).
    InView(CudaView<'a, u8>),
    /// A buffer the kernel writes.
    Out(&'a mut CudaSlice<u8>),
    /// Part of a buffer the kernel writes (a tensor's blocks from a chunk's offset).
    OutView(CudaViewMut<'a, u8>),
    /// A null pointer, for a pointer parameter the kernel checks before reading.
    Null,
    U64(u64),
    I32(i32),
    F32(f32),
}

impl KArg<'_> {
    pub(super) fn param(&self) -> Param {
        match self {
            KArg::In(_) | KArg::InView(_) | KArg::Out(_) | KArg::OutView(_) | KArg::Null => {
                Param::Ptr
            }
            KArg::U64(_) => Param::U64,
            KArg::I32(_) => Param::I32,
            KArg::F32(_) => Param::F32,
        }
    }
}

impl CudaBackend {
    /// Launches kernel `name` of `module` with `args` on this backend's stream, after checking
    /// that their kinds and order equal the kernel's signature (a mismatch would be silent
    /// corruption on the device, so it is an error here instead).
    ///
    /// # Safety
    ///
    /// Every index the kernel computes from `args` and `cfg` must lie inside the buffers
    /// passed: the caller checks the buffer sizes against the counts it passes.
    pub(super) unsafe fn launch(
        &self,
        module: &'static str,
        name: &str,
        cfg: LaunchConfig,
        args: &mut [KArg<'_>],
    ) -> Result<()> {
        let during = || format!("launching {name} on {}", self.name());
        let want = signature(name).ok_or_else(|| KernelError::Cuda {
            during: during(),
            message: "no parameter list for this kernel in sources::SIGNATURES".into(),
        })?;
        let got: Vec<Param> = args.iter().map(KArg::param).collect();
        if got != want {
            return Err(KernelError::Cuda {
                during: during(),
                message: format!("arguments {got:?} do not match the kernel's parameters {want:?}"),
            });
        }
        let f = self.func(module, name)?;
        let mut b = self.stream.launch_builder(&f);
        for a in args.iter_mut() {
            match a {
                KArg::In(s) => b.arg(*s),
                KArg::InView(v) => b.arg(&*v),
                KArg::Out(s) => b.arg(&mut **s),
                KArg::OutView(v) => b.arg(v),
                // a device pointer is 64 bits wide, as the u64 parameters are
                KArg::Null => b.arg(&NULL_PTR),
                KArg::U64(v) => b.arg(&*v),
                KArg::I32(v) => b.arg(&*v),
                KArg::F32(v) => b.arg(&*v),
            };
        }
        // SAFETY: the argument kinds match the kernel's parameters (checked above), so the
        // driver passes each value in the slot the kernel reads; the caller vouches for the
        // bounds (see this function's contract).
        unsafe { b.launch(cfg) }.map_err(drv(during()))?;
        Ok(())
    }

    /// An elementwise kernel `name(a, b, out, n)` over n f32 values.
    pub(super) fn binary(
        &self,
        name: &str,
        n: usize,
        a: &CudaBuffer,
        b: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.own(a)?;
        self.own(b)?;
        self.own(out)?;
        need("elementwise lhs bytes", a, mul(n, 4))?;
        need("elementwise rhs bytes", b, mul(n, 4))?;
        need("elementwise output bytes", out, mul(n, 4))?;
        let mut args = [
            KArg::In(&a.slice),
            KArg::In(&b.slice),
            KArg::Out(&mut out.slice),
            KArg::U64(n as u64),
        ];
        // SAFETY: one thread per value below n; all three buffers hold n f32 (checked above).
        unsafe { self.launch("ops", name, elementwise(n)?, &mut args) }
    }

    /// `x = name(x, y)` over `n` f32 values (`kernels/ops.cu`), as `binary` without a separate
    /// output.
    pub(super) fn binary_in_place(
        &self,
        name: &str,
        n: usize,
        x: &mut CudaBuffer,
        y: &CudaBuffer,
    ) -> Result<()> {
        self.own(x)?;
        self.own(y)?;
        need("elementwise accumulator bytes", x, mul(n, 4))?;
        need("elementwise operand bytes", y, mul(n, 4))?;
        let mut args = [
            KArg::Out(&mut x.slice),
            KArg::In(&y.slice),
            KArg::U64(n as u64),
        ];
        // SAFETY: one thread per value below n; both buffers hold n f32 (checked above).
        unsafe { self.launch("ops", name, elementwise(n)?, &mut args) }
    }

    /// `{op}_{format}` of `kernels/kv.cu` over `n` values (whole groups for the quantised
    /// formats; the caller checked both buffers against `n`).
    pub(super) fn kv_codec(
        &self,
        op: &str,
        format: KvFormat,
        n: usize,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<u8>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let threads = n / format.granule();
        let name = format!("{op}_{}", format.name());
        let mut args = [KArg::In(src), KArg::Out(dst), KArg::U64(n as u64)];
        // SAFETY: one thread per value (e4m3, bf16) or group of 32 (q8, q4) below n, reading and
        // writing only that value's or group's bytes; the caller checked both sizes for n.
        unsafe { self.launch("kv", &name, elementwise(threads)?, &mut args) }
    }
}

/// The value of [`KArg::Null`].
static NULL_PTR: u64 = 0;

/// CUDA's limit on `gridDim.x` (2^31 − 1).
pub(super) const MAX_GRID_X: usize = i32::MAX as usize;
/// CUDA's limit on `gridDim.y` and `gridDim.z`.
pub(super) const MAX_GRID_YZ: usize = 65535;

pub(super) fn grid_for(n: usize, per_block: usize, what: &str) -> Result<u32> {
    let blocks = n.div_ceil(per_block).max(1);
    if blocks > MAX_GRID_X {
        return Err(KernelError::Shape {
            op: "cuda launch",
            reason: format!(
                "{what}: {n} items need {blocks} blocks, past cuda's grid.x limit of 2^31 - 1"
            ),
        });
    }
    Ok(blocks as u32)
}

/// An `i32` kernel argument, or a shape error naming it.
pub(super) fn arg_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| KernelError::Shape {
        op: "cuda launch",
        reason: format!("{what} {v} does not fit the kernel's 32-bit argument"),
    })
}

pub(super) fn elementwise(n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (grid_for(n, 256, "elements")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Values each thread of a `dequantize_{type}_{f32,f16}` kernel writes (dequant.cu's
/// `WL_DQ_PER_THREAD`).
const DEQUANT_PER_THREAD: usize = 8;

/// The launch of a `dequantize_*` kernel writing `n` values.
pub(super) fn dequantize(n: usize) -> Result<LaunchConfig> {
    elementwise(n.div_ceil(DEQUANT_PER_THREAD))
}

/// One block of 256 threads per row (the row reductions).
pub(super) fn per_row(n_rows: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (grid_for(n_rows, 1, "rows")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(super) fn need(what: &'static str, b: &CudaBuffer, bytes: usize) -> Result<()> {
    check_range(what, b.slice.len(), 0, bytes)
}

pub(super) fn mul(a: usize, b: usize) -> usize {
    a.saturating_mul(b)
}

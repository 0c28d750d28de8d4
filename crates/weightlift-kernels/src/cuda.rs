//! The CUDA backend (feature `cuda`): cudarc with dynamic loading, kernels from `kernels/*.cu`.
//!
//! - `libcuda` is probed with `is_culib_present()` before any context exists (cudarc panics
//!   without it); absence is [`KernelError::CudaUnavailable`].
//! - Modules load lazily per device on first use (our `CUDA_MODULE_LOADING=LAZY`): nvcc's PTX
//!   (compute_80) when the build had nvcc and the device can run it, otherwise NVRTC compiles
//!   the embedded source to a CUBIN for the device's own `sm_XY` (no driver JIT, so a pip NVRTC
//!   newer than the driver still works), and last to PTX for its `compute_XY`.
//! - Each backend owns a stream; operations are asynchronous until [`Backend::synchronize`] or
//!   a copy to the host. Host-to-device copies go through two pinned staging buffers, so the
//!   CPU fills one while the DMA engine drains the other (ordered by events).
//!
//! - Every launch goes through [`CudaBackend::launch`], which checks the argument kinds against
//!   [`crate::sources::SIGNATURES`]; a test checks that table against the PTX of every kernel.
//!
//! - Matmul: [`MatvecMode::Q8`] quantises the activations on the device (`q8_quantize_*`, the
//!   CPU's `Q8Block` bytes) and runs `q8_matmul_{type}` (dp4a, the CPU scalar Q8 order).
//!   [`MatvecMode::Exact`] uses the in-register warp kernels below
//!   [`DQ_PATH_MIN_TOKENS`] tokens; from there on it dequantises chunks of weight rows into a
//!   scratch of at most `max_dq_size` values ([`dq_chunk_rows`]) and multiplies them with the
//!   tiled `gemm_{act}`; when not one row fits in `max_dq_size` it keeps the in-register
//!   kernels (no scratch), where the CPU dequantises one row at a time.
//!
//! - LLM.int8 ([`Op::Int8Matmul`], `kernels/int8.cu`): the outlier columns are listed on the
//!   device, the tokens quantised with them zeroed, and the int8 weights met with them by dp4a,
//!   the outliers added in f32 in the CPU kernel's order (scratch: a flag and an index per
//!   column, and the tokens' quants and scales).
//! - The decoder layer's operations (`kernels/attention.cu`, the in-place forms in
//!   `kernels/ops.cu`): `attention_{f32,f16}` is one block of four warps per (head, query),
//!   each warp folding every fourth key into its own running softmax and the warps merged at
//!   the end; the lanes split the head (at most [`ATTENTION_MAX_HEAD_DIM`] values).
//! - Views ([`Backend::view`], [`Backend::split`]) are slices made from a device pointer inside
//!   the parent allocation (`upgrade_device_ptr`) and leaked, not freed, when dropped. All work
//!   is on the backend's one stream, so a view needs no events of its parent's.
//!
//! These kernels are compile-checked (NVRTC: compute_80/compute_90 PTX, sm_75/sm_80/sm_90
//! CUBIN), and their shared headers (block decoders, per-lane dot products, the Q8 quantiser
//! and lane dots, the GEMM's FMA chain, block scans, KV quantisers) run on the host in the
//! tests; none has run on a GPU yet.
// cudarc's launch and pinned-memory APIs are unsafe; each call says why its arguments are sound.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr,
    DevicePtrMut, LaunchConfig, PinnedHostSlice, PushKernelArg,
};

use crate::backend::{Backend, Op, check_range, check_ranges, quant_bytes};
use crate::cpu::int8::{INT8_MAX_COLS, int8_packed_bytes};
use crate::cpu::kv_format::KvFormat;
use crate::cpu::matvec::MatvecMode;
use crate::cpu::ops::RopeStyle;
use crate::cpu_backend::AttShape;
use crate::error::{KernelError, Result};
use crate::sources::{
    CUDA_EXACT_TYPES, CUDA_Q8_TYPES, DQ_PATH_MIN_TOKENS, GEMM_BLOCK_ROWS, GEMM_BLOCK_TOKENS,
    GEMM_THREADS, Param, Q8_BLOCK_BYTES, dq_chunk_rows, signature,
};
use crate::types::{FloatType, QuantType};

/// Bytes per pinned staging buffer (two per backend).
pub const STAGING_BYTES: usize = 16 << 20;

fn drv<E: std::fmt::Debug>(during: impl Into<String>) -> impl FnOnce(E) -> KernelError {
    let during = during.into();
    move |e| KernelError::Cuda {
        during,
        message: format!("{e:?}"),
    }
}

/// Why CUDA cannot be used on this machine, or `None` when a driver and a device exist.
pub fn unavailable_reason() -> Option<String> {
    // SAFETY: only tries to dlopen libcuda by its candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some("libcuda not found".into());
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("the driver reports no CUDA devices".into()),
        Err(e) => Some(format!("cuInit/cuDeviceGetCount failed: {e:?}")),
    }
}

/// Device memory on one CUDA device: an allocation, or a view of part of one
/// ([`Backend::view`], [`Backend::split`]) that frees nothing when dropped.
#[derive(Debug)]
pub struct CudaBuffer {
    /// A view's slice is made from a raw device pointer and is leaked, never freed.
    slice: ManuallyDrop<CudaSlice<u8>>,
    ordinal: usize,
    view: bool,
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken once, here, and not used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        if self.view {
            // the memory belongs to the buffer this view was made from
            let _ = slice.leak();
        } else {
            drop(slice);
        }
    }
}

struct Staging {
    bufs: [PinnedHostSlice<u8>; 2],
    done: [CudaEvent; 2],
}

impl Drop for Staging {
    /// A copy out of a staging buffer may still be in flight (copies return once queued), and
    /// cudarc's `PinnedHostSlice` only waits for its own event, which these copies do not
    /// record: wait for ours before the pinned memory is freed.
    fn drop(&mut self) {
        for e in &self.done {
            // Nothing to report to from a drop; the context keeps a sticky error anyway.
            let _ = e.synchronize();
        }
    }
}

/// One CUDA device with its own stream.
pub struct CudaBackend {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Compute capability (major, minor).
    cc: (i32, i32),
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    staging: Mutex<Option<Staging>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("compute_capability", &self.cc)
            .finish()
    }
}

impl Drop for CudaBackend {
    /// Work still queued may use this backend's modules and staging buffers: let it finish
    /// before they are unloaded and freed (buffers keep their own stream alive).
    fn drop(&mut self) {
        // Nothing to report to from a drop; the context keeps a sticky error anyway.
        let _ = self.stream.synchronize();
    }
}

impl CudaBackend {
    /// Opens device `ordinal`. Fails with [`KernelError::CudaUnavailable`] when there is no
    /// libcuda or no such device.
    pub fn new(ordinal: usize) -> Result<Self> {
        if let Some(reason) = unavailable_reason() {
            return Err(KernelError::CudaUnavailable { reason });
        }
        let count = CudaContext::device_count().map_err(drv("counting devices"))? as usize;
        if ordinal >= count {
            return Err(KernelError::CudaUnavailable {
                reason: format!(
                    "cuda:{ordinal} requested but the driver reports {count} device(s)"
                ),
            });
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(drv(format!("creating a context on cuda:{ordinal}")))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("reading the compute capability"))?;
        let stream = ctx.new_stream().map_err(drv("creating a stream"))?;
        Ok(CudaBackend {
            ordinal,
            ctx,
            stream,
            cc: (major, minor),
            modules: Mutex::new(HashMap::new()),
            staging: Mutex::new(None),
        })
    }

    /// The number of CUDA devices, or [`KernelError::CudaUnavailable`].
    pub fn device_count() -> Result<usize> {
        // SAFETY: only tries to dlopen libcuda.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(KernelError::CudaUnavailable {
                reason: "libcuda not found".into(),
            });
        }
        Ok(CudaContext::device_count().map_err(drv("counting devices"))? as usize)
    }

    /// Why CUDA cannot be used here, for test skip messages.
    pub fn unavailable_reason() -> Option<String> {
        unavailable_reason()
    }

    /// The stream this backend enqueues on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A new stream on this device (for overlapping independent work).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.stream.fork().map_err(drv("creating a stream"))
    }

    /// Records an event on this backend's stream (`CU_EVENT_DEFAULT`, so it can time).
    pub fn record_event(&self) -> Result<CudaEvent> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        self.stream
            .record_event(flags)
            .map_err(drv("recording an event"))
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(drv("reading memory info"))
    }

    fn module(&self, name: &'static str) -> Result<Arc<CudaModule>> {
        let mut mods = self.modules.lock().map_err(|_| KernelError::Cuda {
            during: "loading a module".into(),
            message: "module cache lock poisoned".into(),
        })?;
        if let Some(m) = mods.get(name) {
            return Ok(m.clone());
        }
        let m = self.load_module(name)?;
        mods.insert(name, m.clone());
        Ok(m)
    }

    /// Loads module `name` from the first image this device and driver accept: nvcc's PTX,
    /// NVRTC's CUBIN for `sm_XY`, NVRTC's PTX for `compute_XY`. Every failure is kept for the
    /// error, so a driver too old for the PTX, or an NVRTC too old for the device, is named.
    fn load_module(&self, name: &'static str) -> Result<Arc<CudaModule>> {
        let during = format!("loading module {name} on cuda:{}", self.ordinal);
        let (major, minor) = self.cc;
        let mut tried = Vec::new();
        let load = |image: cudarc::nvrtc::Ptx, what: &str, tried: &mut Vec<String>| {
            self.ctx
                .load_module(image)
                .map_err(|e| tried.push(format!("{what}: {e:?}")))
                .ok()
        };
        if let Some(ptx) = crate::sources::prebuilt_ptx(name) {
            if major >= 8 {
                let image = cudarc::nvrtc::Ptx::from_src(ptx);
                if let Some(m) = load(image, "nvcc ptx for compute_80", &mut tried) {
                    return Ok(m);
                }
            } else {
                tried.push(format!(
                    "nvcc ptx is for compute_80, the device is {major}.{minor}"
                ));
            }
        }
        let src = crate::sources::source(name).ok_or_else(|| KernelError::Cuda {
            during: during.clone(),
            message: "no such kernel source".into(),
        })?;
        for arch in [
            format!("sm_{major}{minor}"),
            format!("compute_{major}{minor}"),
        ] {
            match crate::nvrtc::compile(name, src, &arch) {
                Ok(c) => {
                    let image = match c.cubin {
                        Some(bin) => cudarc::nvrtc::Ptx::from_binary(bin),
                        None => cudarc::nvrtc::Ptx::from_src(c.ptx),
                    };
                    if let Some(m) = load(image, &format!("nvrtc {arch}"), &mut tried) {
                        return Ok(m);
                    }
                }
                // no libnvrtc: say so plainly (with what else was tried)
                Err(KernelError::CudaUnavailable { reason }) => {
                    tried.push(reason);
                    return Err(KernelError::CudaUnavailable {
                        reason: format!("{during}: {}", tried.join("; ")),
                    });
                }
                Err(e) => tried.push(e.to_string()),
            }
        }
        Err(KernelError::Cuda {
            during,
            message: tried.join("; "),
        })
    }

    fn func(&self, module: &'static str, name: &str) -> Result<CudaFunction> {
        self.module(module)?
            .load_function(name)
            .map_err(drv(format!("finding kernel {name}")))
    }

    /// An allocation failure: [`KernelError::OutOfMemory`] when the driver says so.
    fn alloc_error(&self, bytes: usize, e: cudarc::driver::DriverError) -> KernelError {
        if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            KernelError::OutOfMemory {
                device: self.name(),
                bytes,
            }
        } else {
            KernelError::Cuda {
                during: format!("allocating {bytes} bytes on {}", self.name()),
                message: format!("{e:?}"),
            }
        }
    }

    /// Uninitialised scratch for one operation, freed (stream-ordered) when dropped.
    ///
    /// # Safety
    ///
    /// Every byte a kernel reads from it must have been written by an earlier kernel on this
    /// backend's stream.
    unsafe fn scratch(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: the caller writes before it reads (this function's contract).
        unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(|e| self.alloc_error(bytes, e))
    }

    /// A view of `len` bytes at device address `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` lies inside a live allocation of this device that outlives the view.
    unsafe fn view_at(&self, ptr: u64, len: usize) -> CudaBuffer {
        // SAFETY: the range is valid device memory of this context (the contract above); the
        // slice is leaked when the view is dropped, never freed (see CudaBuffer's Drop).
        let slice = unsafe { self.stream.upgrade_device_ptr::<u8>(ptr, len) };
        CudaBuffer {
            slice: ManuallyDrop::new(slice),
            ordinal: self.ordinal,
            view: true,
        }
    }

    fn own(&self, b: &CudaBuffer) -> Result<()> {
        if b.ordinal == self.ordinal {
            Ok(())
        } else {
            Err(KernelError::WrongDevice {
                buffer_device: format!("cuda:{}", b.ordinal),
                backend: self.name(),
                got: b.slice.len(),
            })
        }
    }
}

/// One kernel argument. [`CudaBackend::launch`] checks their kinds against the kernel's
/// parameter list in [`crate::sources::SIGNATURES`] before anything reaches the driver.
enum KArg<'a> {
    /// A buffer the kernel reads.
    In(&'a CudaSlice<u8>),
    /// Part of a buffer the kernel reads (a chunk of weight rows).
    InView(CudaView<'a, u8>),
    /// A buffer the kernel writes.
    Out(&'a mut CudaSlice<u8>),
    U64(u64),
    I32(i32),
    F32(f32),
}

impl KArg<'_> {
    fn param(&self) -> Param {
        match self {
            KArg::In(_) | KArg::InView(_) | KArg::Out(_) => Param::Ptr,
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
    unsafe fn launch(
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
    fn binary(
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

    /// `{op}_{format}` of `kernels/kv.cu` over `n` values (whole groups for the quantised
    /// formats; the caller checked both buffers against `n`).
    fn kv_codec(
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
        // SAFETY: one thread per value (e4m3) or group of 32 (q8, q4) below n, reading and
        // writing only that value's or group's bytes; the caller checked both sizes for n.
        unsafe { self.launch("kv", &name, elementwise(threads)?, &mut args) }
    }
}

/// The shape of one checked matmul: weight and activation types, `rows × cols` weights,
/// `n_tok` tokens (all buffers already checked against it).
#[derive(Clone, Copy)]
struct MatShape {
    ty: QuantType,
    act: FloatType,
    rows: usize,
    cols: usize,
    n_tok: usize,
}

impl CudaBackend {
    /// Exact mode in registers: `matvec_{type}_{act}` / `matmul_{type}_{act}`, one warp per
    /// (row, token), each weight decoded again per token.
    fn matmul_exact(
        &self,
        m: MatShape,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        let kind = if m.n_tok == 1 { "matvec" } else { "matmul" };
        let name = format!("{kind}_{}_{}", m.ty.name(), m.act.name());
        // 8 warps of 32 per block, one row each; tokens ride grid.y, which CUDA caps at
        // 65535, and the kernel strides over the rest
        let cfg = LaunchConfig {
            grid_dim: (
                grid_for(m.rows, 8, "rows")?,
                m.n_tok.min(MAX_GRID_YZ) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = vec![
            KArg::In(&w.slice),
            KArg::In(&x.slice),
            KArg::Out(&mut y.slice),
            KArg::U64(m.rows as u64),
            KArg::U64(m.cols as u64),
        ];
        if m.n_tok > 1 {
            args.push(KArg::U64(m.n_tok as u64));
        }
        // SAFETY: one warp per (row, token) reads one weight row and one activation row and
        // writes one output, all within the sizes the caller checked.
        unsafe { self.launch("matvec", &name, cfg, &mut args) }
    }

    /// Q8 mode: `q8_quantize_{act}` turns every token's activations into 40-byte blocks in a
    /// scratch buffer, then `q8_matmul_{type}` meets each weight group with them in integers.
    fn matmul_q8(
        &self,
        m: MatShape,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        // cols is a whole number of weight blocks (checked by quant_bytes), so of 32 values
        let n_blocks = mul(m.n_tok, m.cols / 32);
        let bytes = n_blocks
            .checked_mul(Q8_BLOCK_BYTES)
            .ok_or_else(|| KernelError::Shape {
                op: "matmul on cuda (q8 mode)",
                reason: format!(
                    "{} tokens of {} values overflow the activation blocks",
                    m.n_tok, m.cols
                ),
            })?;
        // SAFETY: q8_quantize writes all n_blocks blocks before q8_matmul (later on the same
        // stream) reads them.
        let mut xq = unsafe { self.scratch(bytes) }?;
        let name = format!("q8_quantize_{}", m.act.name());
        let mut args = [
            KArg::In(&x.slice),
            KArg::Out(&mut xq),
            KArg::U64(n_blocks as u64),
        ];
        // SAFETY: one thread per block below n_blocks reads its 32 activations (n_tok * cols
        // were checked) and writes its 40 bytes of the scratch (allocated for n_blocks).
        unsafe { self.launch("matvec", &name, elementwise(n_blocks)?, &mut args) }?;
        // 8 threads per row, 32 rows per block of 256; 4 tokens per thread pass on grid.y
        let cfg = LaunchConfig {
            grid_dim: (
                grid_for(m.rows, 32, "rows")?,
                m.n_tok.div_ceil(4).min(MAX_GRID_YZ) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = format!("q8_matmul_{}", m.ty.name());
        let mut args = [
            KArg::In(&w.slice),
            KArg::In(&xq),
            KArg::Out(&mut y.slice),
            KArg::U64(m.rows as u64),
            KArg::U64(m.cols as u64),
            KArg::U64(m.n_tok as u64),
        ];
        // SAFETY: each row group reads one weight row (rows were checked) and each token's
        // cols / 32 blocks of xq, and writes y[t * rows + r] below n_tok * rows (checked).
        unsafe { self.launch("matvec", &name, cfg, &mut args) }
    }

    /// Exact mode for prompts: `chunk` weight rows at a time are dequantised to f32 into a
    /// scratch buffer of `chunk × cols` values (at most `max_dq_size`, see
    /// [`dq_chunk_rows`]), then `gemm_{act}` multiplies them with every token.
    fn matmul_dq(
        &self,
        m: MatShape,
        chunk: usize,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        let row_bytes = quant_bytes(m.ty, m.cols)?;
        // SAFETY: each chunk's dequantize launch writes the values its gemm launch reads
        // (chunk rows or fewer, from the start), earlier on the same stream.
        let mut wd = unsafe { self.scratch(mul(mul(chunk, m.cols), 4)) }?;
        let dq_name = format!("dequantize_{}_f32", m.ty.name());
        let gemm_name = format!("gemm_{}", m.act.name());
        let mut r0 = 0;
        while r0 < m.rows {
            let nr = chunk.min(m.rows - r0);
            let n = nr * m.cols;
            let view = w.slice.slice(r0 * row_bytes..(r0 + nr) * row_bytes);
            let mut args = [KArg::InView(view), KArg::Out(&mut wd), KArg::U64(n as u64)];
            // SAFETY: n values of nr whole weight rows, inside the checked weight bytes, into
            // the scratch of chunk * cols >= n values.
            unsafe { self.launch("dequant", &dq_name, elementwise(n)?, &mut args) }?;
            let cfg = LaunchConfig {
                grid_dim: (
                    grid_for(nr, GEMM_BLOCK_ROWS, "rows")?,
                    m.n_tok.div_ceil(GEMM_BLOCK_TOKENS).min(MAX_GRID_YZ) as u32,
                    1,
                ),
                block_dim: (GEMM_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut args = [
                KArg::In(&wd),
                KArg::In(&x.slice),
                KArg::Out(&mut y.slice),
                KArg::U64(nr as u64),
                KArg::U64(m.cols as u64),
                KArg::U64(m.n_tok as u64),
                KArg::U64(r0 as u64),
                KArg::U64(m.rows as u64),
            ];
            // SAFETY: the kernel reads nr rows of the scratch and n_tok activation rows, and
            // writes y[t * rows + r0 + r] for r < nr, t < n_tok, below n_tok * rows (checked).
            unsafe { self.launch("matvec", &gemm_name, cfg, &mut args) }?;
            r0 += nr;
        }
        Ok(())
    }
}

impl CudaBackend {
    /// LLM.int8 (`kernels/int8.cu`): `int8_outliers_f32` lists the outlier columns of `x`,
    /// `int8_quantize_f32` quantises every token with them zeroed, and `int8_matmul_f32` meets
    /// the int8 weights with the tokens in i32 (dp4a) and adds the outlier columns in f32, in
    /// the CPU kernel's order.
    #[allow(clippy::too_many_arguments)]
    fn int8_matmul(
        &self,
        rows: usize,
        cols: usize,
        n_tok: usize,
        threshold: f32,
        w: &CudaBuffer,
        x: &CudaBuffer,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        let shape = |reason: String| KernelError::Shape {
            op: "int8 matmul on cuda",
            reason,
        };
        if cols == 0 || cols > INT8_MAX_COLS {
            return Err(shape(format!(
                "rows of {cols} values; int8 needs 1..={INT8_MAX_COLS} (the i32 sums of longer \
                 rows could overflow)"
            )));
        }
        if threshold.is_nan() {
            return Err(shape(
                "the outlier threshold is NaN; give a number (6.0 is bitsandbytes' default, 0 \
                 turns the outlier path off)"
                    .into(),
            ));
        }
        let quants = rows
            .checked_mul(cols)
            .ok_or_else(|| shape(format!("{rows} × {cols} weights overflow usize")))?;
        let packed = int8_packed_bytes(rows, cols).unwrap_or(usize::MAX);
        need(
            "int8 weight bytes (quants, then a scale per row)",
            w,
            packed,
        )?;
        need("int8 matmul activation bytes", x, mul(mul(n_tok, cols), 4))?;
        need("int8 matmul output bytes", y, mul(mul(n_tok, rows), 4))?;
        if n_tok == 0 || rows == 0 {
            return Ok(());
        }
        // The kernel reads the scales as floats: copy them to an aligned scratch when they
        // start at an odd address (rows × cols not a multiple of 4, or a view at an odd
        // offset).
        let (base, record) = w.slice.device_ptr(&self.stream);
        drop(record);
        let scales_view = w.slice.slice(quants..quants + 4 * rows);
        let aligned_copy = if (base + quants as u64).is_multiple_of(4) {
            None
        } else {
            // SAFETY: the copy below writes all 4 × rows bytes before the matmul reads them.
            let mut s = unsafe { self.scratch(4 * rows) }?;
            self.stream
                .memcpy_dtod(&scales_view, &mut s)
                .map_err(drv("aligning the int8 scales"))?;
            Some(s)
        };
        // SAFETY (the three scratches): int8_outliers writes flags[c] for every column, the
        // count, and the first `count` column indices, which are all the matmul reads of them.
        let mut flags = unsafe { self.scratch(cols) }?;
        // SAFETY: as above.
        let mut out_cols = unsafe { self.scratch(mul(cols, 4)) }?;
        // SAFETY: as above.
        let mut n_out = unsafe { self.scratch(4) }?;
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = [
            KArg::In(&x.slice),
            KArg::Out(&mut flags),
            KArg::Out(&mut out_cols),
            KArg::Out(&mut n_out),
            KArg::U64(n_tok as u64),
            KArg::U64(cols as u64),
            KArg::F32(threshold),
        ];
        // SAFETY: one block walks the cols columns of n_tok × cols activations (checked above)
        // and writes cols flags, at most cols indices and one count into scratches of that size.
        unsafe { self.launch("int8", "int8_outliers_f32", one_block, &mut args) }?;
        // SAFETY: int8_quantize writes every token's cols quants and its scale (one block per
        // token) before the matmul, later on the same stream, reads them.
        let mut xq = unsafe { self.scratch(mul(n_tok, cols)) }?;
        // SAFETY: as above.
        let mut xs = unsafe { self.scratch(mul(n_tok, 4)) }?;
        let mut args = [
            KArg::In(&x.slice),
            KArg::In(&flags),
            KArg::Out(&mut xq),
            KArg::Out(&mut xs),
            KArg::U64(n_tok as u64),
            KArg::U64(cols as u64),
            KArg::F32(threshold),
        ];
        // SAFETY: block t reads token t's cols activations and cols flags and writes its cols
        // quants and one scale, all within the sizes checked or allocated above.
        unsafe { self.launch("int8", "int8_quantize_f32", per_row(n_tok)?, &mut args) }?;
        // one warp per (row, token): 8 rows per block of 256, tokens on grid.y (strided past
        // cuda's 65535)
        let cfg = LaunchConfig {
            grid_dim: (grid_for(rows, 8, "rows")?, n_tok.min(MAX_GRID_YZ) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let ws = match &aligned_copy {
            Some(s) => KArg::In(s),
            None => KArg::InView(scales_view),
        };
        let mut args = [
            KArg::InView(w.slice.slice(0..quants)),
            ws,
            KArg::In(&x.slice),
            KArg::In(&xq),
            KArg::In(&xs),
            KArg::In(&out_cols),
            KArg::In(&n_out),
            KArg::Out(&mut y.slice),
            KArg::U64(rows as u64),
            KArg::U64(cols as u64),
            KArg::U64(n_tok as u64),
        ];
        // SAFETY: warp (r, t) reads weight row r (rows × cols quants and rows scales checked),
        // token t's activations, quants and scale, at most `n_out` <= cols outlier indices,
        // and writes y[t * rows + r] below n_tok × rows (checked).
        unsafe { self.launch("int8", "int8_matmul_f32", cfg, &mut args) }
    }
}

/// The attention kernel for a cache stored as `k` keys and `v` values: one per cache dtype
/// (`attention_q8_q4` is the q6 cache).
fn attention_kernel(k: KvFormat, v: KvFormat) -> Result<String> {
    use KvFormat::{E4M3, F16, F32, Q4, Q8};
    match (k, v) {
        (F32, F32) | (F16, F16) | (E4M3, E4M3) | (Q8, Q8) | (Q4, Q4) => {
            Ok(format!("attention_{}", k.name()))
        }
        (Q8, Q4) => Ok("attention_q8_q4".into()),
        _ => Err(KernelError::Unsupported {
            op: "attention on cuda",
            ty: format!(
                "keys stored as {} with values stored as {}",
                k.name(),
                v.name()
            ),
            supported: "f32, f16, e4m3, q8 or q4 for both, or q8 keys with q4 values",
        }),
    }
}

/// The largest head the attention kernel takes (`WL_ATT_MAX_HD` in `kernels/attention.cu`).
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;
/// Threads per attention block: four warps (`WL_ATT_WARPS`).
const ATTENTION_THREADS: u32 = 128;

/// CUDA's limit on `gridDim.x` (2^31 − 1).
const MAX_GRID_X: usize = i32::MAX as usize;
/// CUDA's limit on `gridDim.y` and `gridDim.z`.
const MAX_GRID_YZ: usize = 65535;

fn grid_for(n: usize, per_block: usize, what: &str) -> Result<u32> {
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
fn arg_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| KernelError::Shape {
        op: "cuda launch",
        reason: format!("{what} {v} does not fit the kernel's 32-bit argument"),
    })
}

fn elementwise(n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (grid_for(n, 256, "elements")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One block of 256 threads per row (the row reductions).
fn per_row(n_rows: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (grid_for(n_rows, 1, "rows")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn need(what: &'static str, b: &CudaBuffer, bytes: usize) -> Result<()> {
    check_range(what, b.slice.len(), 0, bytes)
}

fn mul(a: usize, b: usize) -> usize {
    a.saturating_mul(b)
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        let slice = self
            .stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| self.alloc_error(bytes, e))?;
        Ok(CudaBuffer {
            slice: ManuallyDrop::new(slice),
            ordinal: self.ordinal,
            view: false,
        })
    }

    fn len(&self, buf: &CudaBuffer) -> usize {
        buf.slice.len()
    }

    fn copy_from_host(&self, src: &[u8], dst: &mut CudaBuffer, offset: usize) -> Result<()> {
        self.own(dst)?;
        check_range("copy destination bytes", dst.slice.len(), offset, src.len())?;
        let mut guard = self.staging.lock().map_err(|_| KernelError::Cuda {
            during: "staging".into(),
            message: "staging lock poisoned".into(),
        })?;
        if guard.is_none() {
            // SAFETY: pinned memory is uninitialised until written; every byte copied out of it
            // below was first written from `src`.
            let a = unsafe { self.ctx.alloc_pinned::<u8>(STAGING_BYTES) }
                .map_err(drv("allocating pinned staging memory"))?;
            // SAFETY: as above.
            let b = unsafe { self.ctx.alloc_pinned::<u8>(STAGING_BYTES) }
                .map_err(drv("allocating pinned staging memory"))?;
            let e0 = self.ctx.new_event(None).map_err(drv("creating an event"))?;
            let e1 = self.ctx.new_event(None).map_err(drv("creating an event"))?;
            e0.record(&self.stream).map_err(drv("recording an event"))?;
            e1.record(&self.stream).map_err(drv("recording an event"))?;
            *guard = Some(Staging {
                bufs: [a, b],
                done: [e0, e1],
            });
        }
        let st = guard.as_mut().ok_or_else(|| KernelError::Cuda {
            during: "staging".into(),
            message: "no staging buffers".into(),
        })?;
        for (k, chunk) in src.chunks(STAGING_BYTES).enumerate() {
            let i = k % 2;
            // wait until the DMA that last read this staging buffer has finished
            st.done[i]
                .synchronize()
                .map_err(drv("waiting for a staging buffer"))?;
            let pinned = st.bufs[i]
                .as_mut_slice()
                .map_err(drv("mapping pinned memory"))?;
            pinned[..chunk.len()].copy_from_slice(chunk);
            let at = offset + k * STAGING_BYTES;
            let mut view = dst.slice.slice_mut(at..at + chunk.len());
            self.stream
                .memcpy_htod(&pinned[..chunk.len()], &mut view)
                .map_err(drv(format!(
                    "copying {} bytes to {}",
                    chunk.len(),
                    self.name()
                )))?;
            st.done[i]
                .record(&self.stream)
                .map_err(drv("recording an event"))?;
        }
        Ok(())
    }

    fn copy_to_host(&self, src: &CudaBuffer, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.own(src)?;
        check_range("copy source bytes", src.slice.len(), offset, dst.len())?;
        let view = src.slice.slice(offset..offset + dst.len());
        self.stream.memcpy_dtoh(&view, dst).map_err(drv(format!(
            "copying {} bytes from {}",
            dst.len(),
            self.name()
        )))?;
        self.stream
            .synchronize()
            .map_err(drv("synchronising after a copy to the host"))
    }

    fn copy(
        &self,
        src: &CudaBuffer,
        so: usize,
        dst: &mut CudaBuffer,
        d_o: usize,
        bytes: usize,
    ) -> Result<()> {
        self.own(src)?;
        self.own(dst)?;
        check_range("copy source bytes", src.slice.len(), so, bytes)?;
        check_range("copy destination bytes", dst.slice.len(), d_o, bytes)?;
        let view = src.slice.slice(so..so + bytes);
        let mut out = dst.slice.slice_mut(d_o..d_o + bytes);
        self.stream
            .memcpy_dtod(&view, &mut out)
            .map_err(drv("copying between buffers"))
    }

    fn run(&self, op: Op<'_, CudaBuffer>) -> Result<()> {
        let s = &self.stream;
        match op {
            Op::Dequantize {
                ty,
                out,
                n,
                src,
                dst,
            } => {
                self.own(src)?;
                self.own(dst)?;
                if out == FloatType::BF16 {
                    return Err(KernelError::Unsupported {
                        op: "dequantize",
                        ty: "bf16 output".into(),
                        supported: "f32, f16",
                    });
                }
                need("dequantize source bytes", src, quant_bytes(ty, n)?)?;
                need("dequantize output bytes", dst, mul(n, out.size()))?;
                let name = format!("dequantize_{}_{}", ty.name(), out.name());
                let mut args = [
                    KArg::In(&src.slice),
                    KArg::Out(&mut dst.slice),
                    KArg::U64(n as u64),
                ];
                // SAFETY: the kernel reads quant_bytes(ty, n) bytes of src and writes n values of
                // dst, both checked above.
                unsafe { self.launch("dequant", &name, elementwise(n)?, &mut args) }?;
            }
            Op::ConvertToF16 { from, n, src, dst } => {
                self.own(src)?;
                self.own(dst)?;
                need("convert input bytes", src, mul(n, from.size()))?;
                need("convert output bytes", dst, mul(n, 2))?;
                if from == FloatType::F16 {
                    let view = src.slice.slice(0..2 * n);
                    let mut out = dst.slice.slice_mut(0..2 * n);
                    return s
                        .memcpy_dtod(&view, &mut out)
                        .map_err(drv("copying f16 values"));
                }
                let name = format!("convert_{}_f16", from.name());
                let mut args = [
                    KArg::In(&src.slice),
                    KArg::Out(&mut dst.slice),
                    KArg::U64(n as u64),
                ];
                // SAFETY: n values in and out, sizes checked above.
                unsafe { self.launch("convert", &name, elementwise(n)?, &mut args) }?;
            }
            Op::Matmul {
                ty,
                mode,
                act,
                rows,
                cols,
                n_tok,
                max_dq_size,
                w,
                x,
                y,
            } => {
                self.own(w)?;
                self.own(x)?;
                self.own(y)?;
                let (types, names) = match mode {
                    MatvecMode::Q8 => (CUDA_Q8_TYPES, crate::CUDA_Q8_WEIGHT_TYPES),
                    MatvecMode::Exact => {
                        (CUDA_EXACT_TYPES, "q4_0, q4_1, q8_0, q4_k, q6_k, f16, f32")
                    }
                };
                if !types.contains(&ty) {
                    return Err(KernelError::Unsupported {
                        op: match mode {
                            MatvecMode::Q8 => "matmul on cuda (q8 mode)",
                            MatvecMode::Exact => "matmul on cuda",
                        },
                        ty: ty.to_string(),
                        supported: names,
                    });
                }
                if act == FloatType::BF16 {
                    return Err(KernelError::Unsupported {
                        op: "matmul",
                        ty: "bf16 activations".into(),
                        supported: "f32, f16",
                    });
                }
                need("matmul weight bytes", w, mul(rows, quant_bytes(ty, cols)?))?;
                need(
                    "matmul activation bytes",
                    x,
                    mul(mul(n_tok, cols), act.size()),
                )?;
                need("matmul output bytes", y, mul(mul(n_tok, rows), 4))?;
                if n_tok == 0 || rows == 0 {
                    return Ok(());
                }
                let shape = MatShape {
                    ty,
                    act,
                    rows,
                    cols,
                    n_tok,
                };
                match mode {
                    MatvecMode::Q8 => self.matmul_q8(shape, w, x, y)?,
                    MatvecMode::Exact => match dq_chunk_rows(rows, cols, max_dq_size) {
                        Some(chunk) if n_tok >= DQ_PATH_MIN_TOKENS => {
                            self.matmul_dq(shape, chunk, w, x, y)?
                        }
                        _ => self.matmul_exact(shape, w, x, y)?,
                    },
                }
            }
            Op::Int8Matmul {
                rows,
                cols,
                n_tok,
                threshold,
                w,
                x,
                y,
            } => {
                self.own(w)?;
                self.own(x)?;
                self.own(y)?;
                self.int8_matmul(rows, cols, n_tok, threshold, w, x, y)?;
            }
            Op::RmsNorm {
                n_rows,
                n_cols,
                eps,
                x,
                weight,
                out,
            } => {
                self.own(x)?;
                self.own(weight)?;
                self.own(out)?;
                let n = mul(n_rows, n_cols);
                need("rms_norm input bytes", x, mul(n, 4))?;
                need("rms_norm weight bytes", weight, mul(n_cols, 4))?;
                need("rms_norm output bytes", out, mul(n, 4))?;
                if n_rows == 0 {
                    // one block per row: a launch of at least one block would touch row 0
                    return Ok(());
                }
                let mut args = [
                    KArg::In(&x.slice),
                    KArg::In(&weight.slice),
                    KArg::Out(&mut out.slice),
                    KArg::U64(n_cols as u64),
                    KArg::F32(eps),
                ];
                // SAFETY: one block per row below n_rows, n_cols values each; sizes checked above.
                unsafe { self.launch("ops", "rms_norm_f32", per_row(n_rows)?, &mut args) }?;
            }
            Op::Rope {
                params,
                n_tok,
                n_heads,
                x,
                positions,
                out,
            } => {
                self.own(x)?;
                self.own(positions)?;
                self.own(out)?;
                params.check()?;
                let hd = params.head_dim;
                let n = mul(mul(n_tok, n_heads), hd);
                need("rope input bytes", x, mul(n, 4))?;
                need("rope positions bytes", positions, mul(n_tok, 4))?;
                need("rope output bytes", out, mul(n, 4))?;
                let name = match params.style {
                    RopeStyle::Normal => "rope_norm_f32",
                    RopeStyle::Neox => "rope_neox_f32",
                };
                let pairs = mul(mul(n_tok, n_heads), params.n_dims / 2);
                let mut args = [
                    KArg::In(&x.slice),
                    KArg::In(&positions.slice),
                    KArg::Out(&mut out.slice),
                    KArg::U64(pairs as u64),
                    KArg::U64(n_heads as u64),
                    KArg::I32(arg_i32("head_dim", hd)?),
                    KArg::I32(arg_i32("n_dims", params.n_dims)?),
                    KArg::F32(params.freq_base),
                    KArg::F32(params.freq_scale),
                ];
                // SAFETY: one thread per rotated pair, each inside its head; sizes checked above.
                unsafe { self.launch("ops", name, elementwise(pairs)?, &mut args) }?;
            }
            Op::Softmax {
                n_rows,
                n_cols,
                x,
                out,
            } => {
                self.own(x)?;
                self.own(out)?;
                let n = mul(n_rows, n_cols);
                need("softmax input bytes", x, mul(n, 4))?;
                need("softmax output bytes", out, mul(n, 4))?;
                if n_rows == 0 {
                    return Ok(());
                }
                let mut args = [
                    KArg::In(&x.slice),
                    KArg::Out(&mut out.slice),
                    KArg::U64(n_cols as u64),
                ];
                // SAFETY: one block per row below n_rows, n_cols values each; sizes checked above.
                unsafe { self.launch("ops", "softmax_f32", per_row(n_rows)?, &mut args) }?;
            }
            Op::SwiGlu { n, gate, up, out } => self.binary("swiglu_f32", n, gate, up, out)?,
            Op::Add { n, a, b, out } => self.binary("add_f32", n, a, b, out)?,
            Op::KvStore {
                format,
                n,
                src,
                dst,
            } => {
                self.own(src)?;
                self.own(dst)?;
                format.check_values("kv store", 0, n)?;
                need("kv input bytes", src, mul(n, 4))?;
                need("kv cache bytes", dst, format.byte_at(n))?;
                match format {
                    KvFormat::F32 => {
                        let view = src.slice.slice(0..4 * n);
                        let mut out = dst.slice.slice_mut(0..4 * n);
                        s.memcpy_dtod(&view, &mut out)
                            .map_err(drv("copying f32 cache rows"))?;
                    }
                    KvFormat::F16 => self.run(Op::ConvertToF16 {
                        from: FloatType::F32,
                        n,
                        src,
                        dst,
                    })?,
                    _ => self.kv_codec("kv_store", format, n, &src.slice, &mut dst.slice)?,
                }
            }
            Op::KvLoad {
                format,
                n,
                src,
                dst,
            } => {
                self.own(src)?;
                self.own(dst)?;
                format.check_values("kv load", 0, n)?;
                need("kv cache bytes", src, format.byte_at(n))?;
                need("kv output bytes", dst, mul(n, 4))?;
                match format {
                    KvFormat::F32 => {
                        let view = src.slice.slice(0..4 * n);
                        let mut out = dst.slice.slice_mut(0..4 * n);
                        s.memcpy_dtod(&view, &mut out)
                            .map_err(drv("copying f32 cache rows"))?;
                    }
                    KvFormat::F16 => self.run(Op::Dequantize {
                        ty: QuantType::F16,
                        out: FloatType::F32,
                        n,
                        src,
                        dst,
                    })?,
                    _ => self.kv_codec("kv_load", format, n, &src.slice, &mut dst.slice)?,
                }
            }
            Op::RopeInPlace {
                params,
                n_tok,
                n_heads,
                x,
                positions,
                inv_freqs,
            } => {
                self.own(x)?;
                self.own(positions)?;
                self.own(inv_freqs)?;
                params.check()?;
                let hd = params.head_dim;
                let n = mul(mul(n_tok, n_heads), hd);
                need("rope values bytes", x, mul(n, 4))?;
                need("rope positions bytes", positions, mul(n_tok, 4))?;
                need(
                    "rope frequencies bytes",
                    inv_freqs,
                    mul(params.n_dims / 2, 4),
                )?;
                let name = match params.style {
                    RopeStyle::Normal => "rope_inplace_norm_f32",
                    RopeStyle::Neox => "rope_inplace_neox_f32",
                };
                let pairs = mul(mul(n_tok, n_heads), params.n_dims / 2);
                if pairs == 0 {
                    return Ok(());
                }
                let mut args = [
                    KArg::Out(&mut x.slice),
                    KArg::In(&positions.slice),
                    KArg::In(&inv_freqs.slice),
                    KArg::U64(pairs as u64),
                    KArg::U64(n_heads as u64),
                    KArg::I32(arg_i32("head_dim", hd)?),
                    KArg::I32(arg_i32("n_dims", params.n_dims)?),
                ];
                // SAFETY: one thread per rotated pair below n_tok * n_heads * n_dims / 2, each
                // inside its head, reading its token's position and its pair's frequency; sizes
                // checked above.
                unsafe { self.launch("ops", name, elementwise(pairs)?, &mut args) }?;
            }
            Op::AddInPlace { n, x, y } => {
                self.own(x)?;
                self.own(y)?;
                need("add accumulator bytes", x, mul(n, 4))?;
                need("add addend bytes", y, mul(n, 4))?;
                let mut args = [
                    KArg::Out(&mut x.slice),
                    KArg::In(&y.slice),
                    KArg::U64(n as u64),
                ];
                // SAFETY: one thread per value below n; both buffers hold n f32 (checked).
                unsafe { self.launch("ops", "add_inplace_f32", elementwise(n)?, &mut args) }?;
            }
            Op::AddBias {
                n_rows,
                n_cols,
                x,
                bias,
            } => {
                self.own(x)?;
                self.own(bias)?;
                let n = mul(n_rows, n_cols);
                need("biased values bytes", x, mul(n, 4))?;
                need("bias bytes", bias, mul(n_cols, 4))?;
                if n == 0 {
                    return Ok(());
                }
                let mut args = [
                    KArg::Out(&mut x.slice),
                    KArg::In(&bias.slice),
                    KArg::U64(n as u64),
                    KArg::U64(n_cols as u64),
                ];
                // SAFETY: one thread per value below n_rows * n_cols, reading bias[i % n_cols];
                // sizes checked above.
                unsafe { self.launch("ops", "add_bias_f32", elementwise(n)?, &mut args) }?;
            }
            Op::SwiGluInPlace { n, gate, up } => {
                self.own(gate)?;
                self.own(up)?;
                need("swiglu gate bytes", gate, mul(n, 4))?;
                need("swiglu up bytes", up, mul(n, 4))?;
                let mut args = [
                    KArg::Out(&mut gate.slice),
                    KArg::In(&up.slice),
                    KArg::U64(n as u64),
                ];
                // SAFETY: one thread per value below n; both buffers hold n f32 (checked).
                unsafe { self.launch("ops", "swiglu_inplace_f32", elementwise(n)?, &mut args) }?;
            }
            Op::Attention {
                k_format,
                v_format,
                n_heads,
                kv_heads,
                head_dim,
                n_q,
                start,
                scale,
                tile: _,
                f16_operands,
                q,
                k,
                v,
                out,
            } => {
                for b in [q, k, v] {
                    self.own(b)?;
                }
                self.own(out)?;
                let name = attention_kernel(k_format, v_format)?;
                let sh = AttShape::check(n_heads, kv_heads, head_dim, n_q, start, 1)?;
                if head_dim > ATTENTION_MAX_HEAD_DIM {
                    return Err(KernelError::Shape {
                        op: "attention on cuda",
                        reason: format!(
                            "head_dim {head_dim} is above the kernel's {ATTENTION_MAX_HEAD_DIM}"
                        ),
                    });
                }
                need("attention query bytes", q, mul(sh.q_values(), 4))?;
                let turned = k_format.quant().is_some() || v_format.quant().is_some();
                if turned && !head_dim.is_multiple_of(32) {
                    return Err(KernelError::Shape {
                        op: "attention on cuda",
                        reason: format!(
                            "a quantised cache is decoded by whole warps: head_dim {head_dim} \
                             must be a multiple of 32"
                        ),
                    });
                }
                need("attention key bytes", k, k_format.byte_at(sh.kv_values()))?;
                need("attention value bytes", v, v_format.byte_at(sh.kv_values()))?;
                need("attention output bytes", out, mul(sh.q_values(), 4))?;
                if n_q == 0 {
                    return Ok(());
                }
                let cfg = LaunchConfig {
                    grid_dim: (
                        grid_for(n_heads, 1, "heads")?,
                        n_q.min(MAX_GRID_YZ) as u32,
                        1,
                    ),
                    block_dim: (ATTENTION_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut args = [
                    KArg::In(&q.slice),
                    KArg::In(&k.slice),
                    KArg::In(&v.slice),
                    KArg::Out(&mut out.slice),
                    KArg::U64(n_q as u64),
                    KArg::U64(start as u64),
                    KArg::U64(n_heads as u64),
                    KArg::U64(kv_heads as u64),
                    KArg::I32(arg_i32("head_dim", head_dim)?),
                    KArg::F32(scale),
                    KArg::I32(i32::from(f16_operands)),
                ];
                // SAFETY: block (h, i) reads query row i of head h (n_q * n_heads * head_dim
                // checked), cache rows 0..=start + i of kv head h / (n_heads / kv_heads)
                // ((start + n_q) rows checked) and writes output row i of head h; head_dim is
                // within the kernel's shared arrays (checked).
                unsafe { self.launch("attention", &name, cfg, &mut args) }?;
            }
        }
        Ok(())
    }

    #[allow(unsafe_code)]
    unsafe fn view(&self, buf: &CudaBuffer, offset: usize, len: usize) -> Result<CudaBuffer> {
        self.own(buf)?;
        check_range("view bytes", buf.slice.len(), offset, len)?;
        let (base, _record) = buf.slice.device_ptr(&self.stream);
        // SAFETY: the range lies inside `buf` (checked), which the caller keeps alive and
        // unwritten while the view lives (this function's contract).
        Ok(unsafe { self.view_at(base + offset as u64, len) })
    }

    #[allow(unsafe_code)]
    unsafe fn split(
        &self,
        buf: &mut CudaBuffer,
        ranges: &[(usize, usize)],
    ) -> Result<Vec<CudaBuffer>> {
        self.own(buf)?;
        check_ranges(buf.slice.len(), ranges)?;
        let (base, _record) = buf.slice.device_ptr_mut(&self.stream);
        Ok(ranges
            .iter()
            // SAFETY: disjoint ranges inside `buf` (checked), which the caller does not use
            // again before every part is dropped (this function's contract).
            .map(|&(offset, len)| unsafe { self.view_at(base + offset as u64, len) })
            .collect())
    }

    fn scan_non_finite(
        &self,
        ty: QuantType,
        buf: &CudaBuffer,
        bytes: usize,
    ) -> Result<Option<usize>> {
        self.own(buf)?;
        check_range("scan bytes", buf.slice.len(), 0, bytes)?;
        // the float types are scanned per element, the quantised ones per block (their f16
        // scales; see wl_block_scales_non_finite): no host copy of the tensor either way
        let n = ty.blocks_in("scan bytes", bytes)?;
        let name = format!("scan_{}", ty.name());
        // the result word: u64::MAX until a thread finds a bad index (device allocations are
        // 256-byte aligned, so the kernel's 64-bit atomicMin on it is aligned)
        let mut first = self
            .stream
            .clone_htod(&u64::MAX.to_le_bytes())
            .map_err(drv("allocating the scan result"))?;
        let mut args = [
            KArg::In(&buf.slice),
            KArg::U64(n as u64),
            KArg::Out(&mut first),
        ];
        // SAFETY: n whole elements (or blocks) lie within the checked byte range; `first` is
        // one u64 (8 bytes).
        unsafe { self.launch("convert", &name, elementwise(n)?, &mut args) }?;
        let v = self
            .stream
            .clone_dtoh(&first)
            .map_err(drv("reading the scan result"))?;
        // a copy to pageable memory returns once done; the sync makes that explicit
        self.stream
            .synchronize()
            .map_err(drv("waiting for the scan result"))?;
        let word: [u8; 8] = v.as_slice().try_into().map_err(|_| KernelError::Cuda {
            during: format!("reading the scan result from {}", self.name()),
            message: format!("expected 8 bytes, got {}", v.len()),
        })?;
        let first = u64::from_le_bytes(word);
        Ok((first != u64::MAX).then_some(first as usize))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(drv(format!("synchronising {}", self.name())))
    }
}

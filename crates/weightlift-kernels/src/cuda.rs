//! The CUDA backend (feature `cuda`): cudarc with dynamic loading, kernels from `kernels/*.cu`.
//!
//! - `libcuda` is probed with `is_culib_present()` before any context exists (cudarc panics
//!   without it); absence is [`KernelError::CudaUnavailable`].
//! - Modules load lazily per device on first use (our `CUDA_MODULE_LOADING=LAZY`): nvcc's PTX
//!   when the build had nvcc, otherwise NVRTC compiles the embedded source for the device's
//!   compute capability.
//! - Each backend owns a stream; operations are asynchronous until [`Backend::synchronize`] or
//!   a copy to the host. Host-to-device copies go through two pinned staging buffers, so the
//!   CPU fills one while the DMA engine drains the other (ordered by events).
//!
//! These kernels are compile-checked (NVRTC, sm_80/sm_90) but have not run on a GPU here.
// cudarc's launch and pinned-memory APIs are unsafe; each call says why its arguments are sound.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};

use crate::backend::{Backend, Op, check_range, quant_bytes};
use crate::cpu::matvec::MatvecMode;
use crate::cpu::ops::RopeStyle;
use crate::error::{KernelError, Result};
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

/// Device memory on one CUDA device.
#[derive(Debug)]
pub struct CudaBuffer {
    slice: CudaSlice<u8>,
    ordinal: usize,
}

struct Staging {
    bufs: [PinnedHostSlice<u8>; 2],
    done: [CudaEvent; 2],
}

/// One CUDA device with its own stream.
pub struct CudaBackend {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    staging: Mutex<Option<Staging>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("arch", &self.arch)
            .finish()
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
            arch: format!("compute_{major}{minor}"),
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

    /// Records an event on this backend's stream (timing enabled).
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
        let ptx = match crate::sources::prebuilt_ptx(name) {
            Some(p) => p.to_string(),
            None => {
                let src = crate::sources::source(name).ok_or_else(|| KernelError::Cuda {
                    during: format!("loading module {name}"),
                    message: "no such kernel source".into(),
                })?;
                crate::nvrtc::compile(name, src, &self.arch)?.ptx
            }
        };
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(drv(format!(
                "loading module {name} on cuda:{}",
                self.ordinal
            )))?;
        mods.insert(name, m.clone());
        Ok(m)
    }

    fn func(&self, module: &'static str, name: &str) -> Result<CudaFunction> {
        self.module(module)?
            .load_function(name)
            .map_err(drv(format!("finding kernel {name}")))
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

impl CudaBackend {
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
        let f = self.func("ops", name)?;
        let n64 = n as u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&a.slice).arg(&b.slice).arg(&mut out.slice).arg(&n64);
        // SAFETY: one thread per value, sizes checked above.
        unsafe { l.launch(elementwise(n)?) }
            .map_err(drv(format!("launching {name} on {}", self.name())))?;
        Ok(())
    }
}

fn grid_for(n: usize, per_block: usize, what: &str) -> Result<u32> {
    u32::try_from(n.div_ceil(per_block).max(1)).map_err(|_| KernelError::Shape {
        op: "cuda launch",
        reason: format!("{what}: {n} items need more than 2^32 blocks"),
    })
}

fn elementwise(n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (grid_for(n, 256, "elements")?, 1, 1),
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
        let slice =
            self.stream
                .alloc_zeros::<u8>(bytes.max(1))
                .map_err(|e| match format!("{e:?}") {
                    m if m.contains("OUT_OF_MEMORY") => KernelError::OutOfMemory {
                        device: self.name(),
                        bytes,
                    },
                    m => KernelError::Cuda {
                        during: format!("allocating {bytes} bytes on {}", self.name()),
                        message: m,
                    },
                })?;
        Ok(CudaBuffer {
            slice,
            ordinal: self.ordinal,
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
        let launch_err = |k: &str| {
            drv::<cudarc::driver::DriverError>(format!("launching {k} on {}", self.name()))
        };
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
                let f = self.func("dequant", &name)?;
                let n64 = n as u64;
                let mut b = s.launch_builder(&f);
                b.arg(&src.slice).arg(&mut dst.slice).arg(&n64);
                // SAFETY: the kernel reads quant_bytes(ty, n) bytes of src and writes n values of
                // dst, both checked above; argument types match the kernel signature.
                unsafe { b.launch(elementwise(n)?) }.map_err(launch_err(&name))?;
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
                let f = self.func("convert", &name)?;
                let n64 = n as u64;
                let mut b = s.launch_builder(&f);
                b.arg(&src.slice).arg(&mut dst.slice).arg(&n64);
                // SAFETY: n values in and out, sizes checked above.
                unsafe { b.launch(elementwise(n)?) }.map_err(launch_err(&name))?;
            }
            Op::Matmul {
                ty,
                mode,
                act,
                rows,
                cols,
                n_tok,
                max_dq_size: _,
                w,
                x,
                y,
            } => {
                self.own(w)?;
                self.own(x)?;
                self.own(y)?;
                if mode == MatvecMode::Q8 {
                    return Err(KernelError::Unsupported {
                        op: "matmul on cuda",
                        ty: "q8 activation mode".into(),
                        supported: "exact mode",
                    });
                }
                if !matches!(
                    ty,
                    QuantType::Q4_0
                        | QuantType::Q4_1
                        | QuantType::Q8_0
                        | QuantType::Q4_K
                        | QuantType::Q6_K
                        | QuantType::F16
                        | QuantType::F32
                ) {
                    return Err(KernelError::Unsupported {
                        op: "matmul on cuda",
                        ty: ty.to_string(),
                        supported: "q4_0, q4_1, q8_0, q4_k, q6_k, f16, f32",
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
                let kind = if n_tok == 1 { "matvec" } else { "matmul" };
                let name = format!("{kind}_{}_{}", ty.name(), act.name());
                let f = self.func("matvec", &name)?;
                let (r64, c64) = (rows as u64, cols as u64);
                // tokens ride grid.y, which CUDA caps at 65535
                let tok = u32::try_from(n_tok)
                    .ok()
                    .filter(|t| *t <= 65535)
                    .ok_or_else(|| KernelError::Shape {
                        op: "matmul",
                        reason: format!(
                            "{n_tok} tokens exceed cuda's grid.y limit of 65535; split the prompt"
                        ),
                    })?;
                let cfg = LaunchConfig {
                    grid_dim: (grid_for(rows, 8, "rows")?, tok.max(1), 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = s.launch_builder(&f);
                b.arg(&w.slice)
                    .arg(&x.slice)
                    .arg(&mut y.slice)
                    .arg(&r64)
                    .arg(&c64);
                // SAFETY: one warp per (row, token) reads one weight row and one activation row
                // and writes one output, all within the sizes checked above.
                unsafe { b.launch(cfg) }.map_err(launch_err(&name))?;
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
                let f = self.func("ops", "rms_norm_f32")?;
                let c64 = n_cols as u64;
                let cfg = LaunchConfig {
                    grid_dim: (grid_for(n_rows, 1, "rows")?, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = s.launch_builder(&f);
                b.arg(&x.slice)
                    .arg(&weight.slice)
                    .arg(&mut out.slice)
                    .arg(&c64)
                    .arg(&eps);
                // SAFETY: one block per row, sizes checked above.
                unsafe { b.launch(cfg) }.map_err(launch_err("rms_norm_f32"))?;
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
                let hd = params.head_dim;
                if params.n_dims % 2 != 0 || params.n_dims == 0 || params.n_dims > hd {
                    return Err(KernelError::Shape {
                        op: "rope",
                        reason: format!(
                            "n_dims {} must be even, non-zero and at most head_dim {hd}",
                            params.n_dims
                        ),
                    });
                }
                let n = mul(mul(n_tok, n_heads), hd);
                need("rope input bytes", x, mul(n, 4))?;
                need("rope positions bytes", positions, mul(n_tok, 4))?;
                need("rope output bytes", out, mul(n, 4))?;
                let name = match params.style {
                    RopeStyle::Normal => "rope_norm_f32",
                    RopeStyle::Neox => "rope_neox_f32",
                };
                let f = self.func("ops", name)?;
                let pairs = mul(mul(n_tok, n_heads), params.n_dims / 2);
                let (p64, h64) = (pairs as u64, n_heads as u64);
                let (hd32, nd32) = (hd as i32, params.n_dims as i32);
                let mut b = s.launch_builder(&f);
                b.arg(&x.slice)
                    .arg(&positions.slice)
                    .arg(&mut out.slice)
                    .arg(&p64)
                    .arg(&h64)
                    .arg(&hd32)
                    .arg(&nd32)
                    .arg(&params.freq_base)
                    .arg(&params.freq_scale);
                // SAFETY: one thread per rotated pair, each inside its head; sizes checked above.
                unsafe { b.launch(elementwise(pairs)?) }.map_err(launch_err(name))?;
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
                let f = self.func("ops", "softmax_f32")?;
                let c64 = n_cols as u64;
                let cfg = LaunchConfig {
                    grid_dim: (grid_for(n_rows, 1, "rows")?, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = s.launch_builder(&f);
                b.arg(&x.slice).arg(&mut out.slice).arg(&c64);
                // SAFETY: one block per row, sizes checked above.
                unsafe { b.launch(cfg) }.map_err(launch_err("softmax_f32"))?;
            }
            Op::SwiGlu { n, gate, up, out } => self.binary("swiglu_f32", n, gate, up, out)?,
            Op::Add { n, a, b, out } => self.binary("add_f32", n, a, b, out)?,
            Op::KvQuantize { kt, n, x, out } => {
                self.own(x)?;
                self.own(out)?;
                if n % 32 != 0 {
                    return Err(KernelError::Shape {
                        op: "kv quantize",
                        reason: format!("{n} values are not whole groups of 32"),
                    });
                }
                need("kv input bytes", x, mul(n, 4))?;
                need("kv cache bytes", out, kt.bytes_for(n))?;
                let name = format!("kv_quantize_{}", kt.name());
                let f = self.func("kv", &name)?;
                let g64 = (n / 32) as u64;
                let mut b = s.launch_builder(&f);
                b.arg(&x.slice).arg(&mut out.slice).arg(&g64);
                // SAFETY: one thread per group, sizes checked above.
                unsafe { b.launch(elementwise(n / 32)?) }.map_err(launch_err(&name))?;
            }
            Op::KvDequantize { kt, n, src, out } => {
                self.own(src)?;
                self.own(out)?;
                if n % 32 != 0 {
                    return Err(KernelError::Shape {
                        op: "kv dequantize",
                        reason: format!("{n} values are not whole groups of 32"),
                    });
                }
                need("kv cache bytes", src, kt.bytes_for(n))?;
                need("kv output bytes", out, mul(n, 4))?;
                let name = format!("kv_dequantize_{}", kt.name());
                let f = self.func("kv", &name)?;
                let n64 = n as u64;
                let mut b = s.launch_builder(&f);
                b.arg(&src.slice).arg(&mut out.slice).arg(&n64);
                // SAFETY: one thread per value, sizes checked above.
                unsafe { b.launch(elementwise(n)?) }.map_err(launch_err(&name))?;
            }
        }
        Ok(())
    }

    fn scan_non_finite(
        &self,
        ty: QuantType,
        buf: &CudaBuffer,
        bytes: usize,
    ) -> Result<Option<usize>> {
        self.own(buf)?;
        check_range("scan bytes", buf.slice.len(), 0, bytes)?;
        let (name, n) = match ty {
            QuantType::F32 => ("scan_f32", bytes / 4),
            QuantType::F16 => ("scan_f16", bytes / 2),
            QuantType::BF16 => ("scan_bf16", bytes / 2),
            _ => {
                // quantised types: the scales are few; scan them on the host
                let mut host = vec![0u8; bytes];
                self.copy_to_host(buf, 0, &mut host)?;
                return crate::cpu::convert::scan_non_finite(ty, &host);
            }
        };
        let f = self.func("convert", name)?;
        let mut first = self
            .stream
            .clone_htod(&[u64::MAX])
            .map_err(drv("allocating the scan result"))?;
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&buf.slice).arg(&n64).arg(&mut first);
        // SAFETY: n whole elements lie within the checked byte range; `first` is one u64.
        unsafe { b.launch(elementwise(n)?) }.map_err(drv(format!("launching {name}")))?;
        let v = self
            .stream
            .clone_dtoh(&first)
            .map_err(drv("reading the scan result"))?;
        Ok(v.first()
            .copied()
            .filter(|i| *i != u64::MAX)
            .map(|i| i as usize))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(drv(format!("synchronising {}", self.name())))
    }
}

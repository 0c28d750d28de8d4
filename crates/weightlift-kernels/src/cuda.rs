//! The CUDA backend (feature `cuda`): cudarc with dynamic loading, kernels from `kernels/*.cu`.
//!
//! - `libcuda` is probed with `is_culib_present()`, once per process, before any context exists
//!   (cudarc panics without it); absence is [`KernelError::CudaUnavailable`].
//! - Modules load lazily per device on first use (our `CUDA_MODULE_LOADING=LAZY`): nvcc's PTX
//!   (compute_80) when the build had nvcc and the device can run it, otherwise NVRTC compiles
//!   the embedded source to a CUBIN for the device's own `sm_XY` (no driver JIT, so a pip NVRTC
//!   newer than the driver still works), and last to PTX for its `compute_XY`.
//! - Each backend owns a stream; operations are asynchronous until [`Backend::synchronize`] or
//!   a copy to the host. Host-to-device copies go through two pinned staging buffers, so the
//!   CPU fills one while the DMA engine drains the other (ordered by events).
//! - Copies beyond one range (`copies`): strided rows by one `cuMemcpy2DAsync`, and copies to
//!   another device on the destination's stream between events of both streams (peer access
//!   enabled once per pair where the driver allows it, through the host otherwise). A second
//!   stream per device, [`CopyStream`], uploads host bytes while the compute stream runs,
//!   ordered against it only by the caller's events.
//!
//! - Every launch goes through [`CudaBackend::launch`], which checks the argument kinds against
//!   [`crate::sources::SIGNATURES`]; a test checks that table against the PTX of every kernel.
//!
//! - Matmul: [`MatvecMode::Q8`] quantises the activations on the device (`q8_quantize_*`, the
//!   CPU's `Q8Block` bytes) and runs `q8_matmul_{type}` (dp4a, the CPU scalar Q8 order), or
//!   for one token `q8_matvec_{type}` (an order of its own, for bandwidth); one token of
//!   Q4_K or Q6_K takes `q8_wide_matvec_{type}` instead (wide lanes: 64 values a step in far
//!   fewer loads), unless `WEIGHTLIFT_Q8V=narrow` ([`Q8Decode`]).
//!   Float weights (f16, bf16, f32) have bandwidth kernels: 16-byte loads, a row over
//!   [`float_row_threads`] threads chosen from the shape and the SM count.
//!   [`MatvecMode::Exact`] uses the in-register kernels below
//!   [`DQ_PATH_MIN_TOKENS`] tokens; from there on it dequantises chunks of weight rows into a
//!   scratch of at most `max_dq_size` values ([`dq_chunk_rows`]) and multiplies them with the
//!   tiled `gemm_{act}`; when not one row fits in `max_dq_size` it keeps the in-register
//!   kernels (no scratch), where the CPU dequantises one row at a time.
//! - Prompts of [`crate::sources::CUBLAS_MIN_TOKENS`] tokens or more run on cuBLAS where
//!   libcublas is found (`cublas`, loaded at run time as NVRTC is): exact mode as f32 GEMMs
//!   (`CUBLAS_COMPUTE_32F_PEDANTIC`, no TF32) of the same dequantised chunks, fast mode
//!   ([`MatvecMode::Q8`], which f16 and bf16 weights also take on CUDA) on tensor cores with
//!   the activations rounded to f16 (bf16 for bf16 weights) and quantised weights dequantised
//!   to f16 chunk by chunk. Without libcublas those prompts take the kernels above.
//! - A third prompt route, off by default until a GPU run measures it: fast-mode products of
//!   the Q8 types on int8 tensor cores (`q8_mma_{type}`, m16n8k32 on the same quantised
//!   activations, compute capability 8.0 and later) from a count per type
//!   ([`crate::sources::MMQ_MIN_TOKENS_BY_TYPE`], `WEIGHTLIFT_MMQ_MIN_TOKENS`, or
//!   [`CudaBackend::with_cublas_min_tokens`]); between it and cuBLAS the larger count reached
//!   wins ([`crate::sources::CublasMinTokens::route`]).
//!
//! - LLM.int8 ([`Op::Int8Matmul`], `kernels/int8.cu`): the outlier columns are listed on the
//!   device, the tokens quantised with them zeroed, and the int8 weights met with them by dp4a,
//!   the outliers added in f32 in the CPU kernel's order (scratch: a flag and an index per
//!   column, and the tokens' quants and scales).
//! - The decoder layer's operations (`kernels/attention.cu`, `attention_prefill.cu` and
//!   `attention_prefill_mma.cu`, three modules so that a process compiles only the ones it
//!   launches; the in-place forms in `kernels/ops.cu`): `attention_{format}` is one block of four warps per (key split, KV
//!   head, query), taking all the query heads of the KV group (up to
//!   [`crate::sources::attention_block_heads`] of them; wider groups take several blocks), so
//!   each cache row is read once per block. Each warp folds every fourth key of the split into
//!   its own running softmax per head and the warps are merged at the end; the lanes split the
//!   head (at most [`ATTENTION_MAX_HEAD_DIM`] values). The keys are split
//!   ([`crate::sources::attention_grid`]) so that a decode step fills every SM; the splits'
//!   partial results go to the caller's scratch and `attention_reduce_f32` merges them. The
//!   cache is read in its storage format (f32, f16, e4m3, Hadamard-turned q8/q4 groups, decoded
//!   by the warp's 32 lanes together), and written by `kv_store_{format}`. Prompts of
//!   [`crate::sources::ATTENTION_PREFILL_MIN_QUERIES`] queries or more with heads up to
//!   [`crate::sources::ATTENTION_PREFILL_MAX_HEAD_DIM`] take `attention_prefill_{format}`
//!   instead: flash attention in f32, a block of (query, head) rows of one KV group staging
//!   tiles of 32 keys and values in shared memory (decoded from the cache format once per
//!   block) and folding them into each row's online softmax, so the cache is read once per
//!   block of rows rather than once per query; window, soft-cap, f16 operands and a start
//!   offset (a chunked prompt continuing a cache) as `attention_{format}`. No scratch. In fast
//!   mode, heads of 64 or 128 take `attention_prefill_mma_{format}` on compute capability 8.0
//!   and later, for every cache format ([`PrefillAttention`], `WEIGHTLIFT_FA_MMA=0` to keep
//!   them off): the same tiling on tensor cores, `mma.sync` m16n8k16 products of f16 operands
//!   with f32 sums, 64 rows a block, the K/V tiles read through the same readers and rounded
//!   to f16 as they are staged.
//! - Quantise-on-load (`quantize`, [`Backend::quantize_rows`]): a chunk of float rows goes up
//!   through the staging buffers into a scratch of its size, and `quantize_{type}_{src}` writes
//!   the CPU quantiser's blocks into the tensor at the chunk's offset, one thread a block; a
//!   NaN or inf leaves its index in a report word the loader reads after the tensor.
//! - The launch plumbing is in `launch`, the matrix products in `matmul`, and the operation
//!   dispatch in `ops`. `graph` records a sequence of operations as a CUDA graph and replays it
//!   ([`CudaBackend::capture`], [`CudaBackend::replay`]; the engine replays decode steps).
//! - Views ([`Backend::view`], [`Backend::split`]) are slices made from a device pointer inside
//!   the parent allocation (`upgrade_device_ptr`) and leaked, not freed, when dropped. Kernels
//!   run on the backend's one stream, so a view needs no events of its parent's; a copy on a
//!   [`CopyStream`] or to a peer is ordered by the explicit events above.
//!
//! These kernels are compile-checked (NVRTC: compute_75 PTX, sm_90 PTX and CUBIN), and their
//! shared headers (block decoders, per-lane dot products, the Q8 quantiser and lane dots, the
//! GEMM's FMA chain, block scans, KV quantisers) run on the host in the tests; their device
//! cases run where there is a GPU (the GPU bundle, `benches/gpu/run.sh`).
// cudarc's launch and pinned-memory APIs are unsafe; each call says why its arguments are sound.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut,
    DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use crate::backend::{Backend, Op, Rows, check_range, check_ranges, quant_bytes};
use crate::cpu::int8::{INT8_MAX_COLS, int8_packed_bytes};
use crate::cpu::kv_format::KvFormat;
use crate::cpu::matvec::MatvecMode;
use crate::cpu::ops::RopeStyle;
use crate::cpu_backend::AttShape;
use crate::error::{KernelError, Result};
use crate::sources::{
    ATTENTION_PREFILL_MAX_HEAD_DIM, ATTENTION_PREFILL_MIN_QUERIES, ATTENTION_PREFILL_MMA_ROWS,
    ATTENTION_WARPS, CUDA_EXACT_NAMES, CUDA_EXACT_TYPES, CUDA_FAST_FLOAT_TYPES, CUDA_FAST_NAMES,
    CUDA_FLOAT_TYPES, CUDA_Q8_TYPES, CublasRoute, DQ_PATH_MIN_TOKENS, FLOAT_BLOCK_THREADS,
    FLOAT_TOKENS_PER_PASS, GEMM_BLOCK_ROWS, GEMM_BLOCK_TOKENS, GEMM_THREADS, MMQ_BLOCK_ROWS,
    MMQ_BLOCK_TOKENS, MMQ_THREADS, Param, PrefillAttention, PromptRoute, Q8_BLOCK_BYTES,
    Q8_KEPT_BYTES, Q8_MATVEC_THREADS, Q8_WIDE_ALONE_MAX_TOKENS, Q8Decode, attention_grid,
    attention_module, attention_prefill_rows, cublas_route, cuda_kernel_mode, dq_chunk_rows,
    float_row_threads, q8_matvec_warps, q8_wide_matvec_warps, scratch_from_tokens, signature,
};
use crate::types::{FloatType, QuantType};

mod copies;
mod copy_stream;
pub mod cublas;
mod graph;
mod host_pins;
mod launch;
mod matmul;
mod ops;
mod quantize;

use copies::{Staging, upload_filled, upload_staged};
pub use copy_stream::CopyStream;
pub use graph::CudaStepGraph;
pub use host_pins::HostPins;
use launch::*;
pub use ops::ATTENTION_MAX_HEAD_DIM;

/// Bytes per pinned staging buffer (two per backend).
pub const STAGING_BYTES: usize = 16 << 20;

/// Runs `wait` (a wait for work queued on `ctx`) from a drop that then frees memory the work may
/// still read; whether it waited. cudarc keeps the error of a driver call made in an earlier drop
/// and returns it from the next call that binds the context, before that call's own work: the
/// wait would return at once, and the memory would be freed under the copy or kernel still
/// reading it. The kept error is taken first and put back after, for the next call to return.
fn wait_in_drop(
    ctx: &CudaContext,
    wait: impl FnOnce() -> std::result::Result<(), cudarc::driver::DriverError>,
) -> bool {
    let kept = ctx.check_err();
    let waited = wait();
    ctx.record_err(kept);
    waited.is_ok()
}

fn drv<E: std::fmt::Debug>(during: impl Into<String>) -> impl FnOnce(E) -> KernelError {
    let during = during.into();
    move |e| KernelError::Cuda {
        during,
        message: format!("{e:?}"),
    }
}

/// What is missing when libcuda cannot be opened.
const NO_DRIVER: &str = "install the NVIDIA driver (libcuda.so.1 comes with the driver, not \
                         with a CUDA toolkit or pip's nvidia packages)";

/// Whether libcuda opens, asked once per process: each probe tries to open every candidate
/// name, a search of the library path that took most of a millisecond per call on a machine
/// without a driver, and every model and plan on the detected devices asks; a driver does not
/// come or go while a process runs.
fn culib_present() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: only tries to dlopen libcuda by its candidate names.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

/// Why CUDA cannot be used on this machine, or `None` when a driver and a device exist.
fn unavailable() -> Option<KernelError> {
    if !culib_present() {
        return Some(KernelError::LibraryNotFound {
            library: "libcuda.so.1".into(),
            fix: NO_DRIVER.into(),
            detail: String::new(),
        });
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some(KernelError::CudaUnavailable {
            reason: "the driver reports no CUDA devices (are they hidden by \
                     CUDA_VISIBLE_DEVICES, or is the GPU not passed into this container?)"
                .into(),
        }),
        Err(e) => Some(KernelError::CudaUnavailable {
            reason: format!(
                "cuInit/cuDeviceGetCount failed: {e:?}; is the driver loaded (nvidia-smi)?"
            ),
        }),
    }
}

/// Why CUDA cannot be used on this machine, or `None` when a driver and a device exist.
pub fn unavailable_reason() -> Option<String> {
    unavailable().map(|e| e.to_string())
}

/// The driver, NVRTC and every device, for `weightlift devices`.
pub fn report() -> crate::cuda_libs::CudaReport {
    use crate::cuda_libs::{CudaDeviceReport, CudaReport, loaded_path};
    let nvrtc = crate::nvrtc::nvrtc_library()
        .and_then(|p| Ok((p, crate::nvrtc::nvrtc_version()?)))
        .map_err(|e| e.to_string());
    let cublas = cublas::cublas_library()
        .and_then(|p| Ok((p, cublas::cublas_version()?)))
        .map_err(|e| e.to_string());
    if let Some(e) = unavailable() {
        return CudaReport {
            driver: Err(e.to_string()),
            nvrtc,
            cublas,
            devices: Vec::new(),
        };
    }
    let mut version = 0;
    // SAFETY: libcuda is present (checked above); the pointer is valid for a write.
    let driver = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| format!("cuDriverGetVersion failed: {e:?}"))
        .map(|()| {
            let path = loaded_path("libcuda.so").unwrap_or_else(|| "libcuda.so.1".into());
            (path, (version / 1000, version % 1000 / 10))
        });
    let count = CudaBackend::device_count().unwrap_or(0);
    let devices = (0..count)
        .filter_map(|ordinal| {
            let b = CudaBackend::new(ordinal).ok()?;
            let (free, total) = b.mem_info().ok()?;
            Some(CudaDeviceReport {
                ordinal,
                name: b.device_name().unwrap_or_else(|e| e.to_string()),
                capability: b.cc,
                free: free as u64,
                total: total as u64,
                context: b.context_bytes().map_err(|e| e.to_string()),
            })
        })
        .collect();
    CudaReport {
        driver,
        nvrtc,
        cublas,
        devices,
    }
}

/// Bytes one CUDA context took on each device, measured once per process (by ordinal).
static CONTEXT_BYTES: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());

/// Device memory on one CUDA device: an allocation, or a view of part of one
/// ([`Backend::view`], [`Backend::split`]) that frees nothing when dropped.
#[derive(Debug)]
pub struct CudaBuffer {
    /// A view's slice is made from a raw device pointer and is leaked, never freed.
    slice: ManuallyDrop<CudaSlice<u8>>,
    ordinal: usize,
    view: bool,
}

impl CudaBuffer {
    /// The device address of the buffer's first byte. A captured graph keeps the addresses it
    /// was recorded with, so a caller compares them to know whether its buffers are still the
    /// ones a graph reads and writes.
    pub fn device_addr(&self) -> u64 {
        let (ptr, _record) = self.slice.device_ptr(self.slice.stream());
        ptr
    }
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

/// One CUDA device with its own stream.
pub struct CudaBackend {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Compute capability (major, minor).
    cc: (i32, i32),
    /// Streaming multiprocessors: the float matvec kernels size their grid by it, and the
    /// attention splits fill it ([`crate::sources::attention_splits`]).
    sm_count: usize,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// The kernels launched so far, by module and name.
    funcs: Mutex<HashMap<(&'static str, String), CudaFunction>>,
    staging: Mutex<Option<Staging>>,
    /// Whether peer copies to each other device (by ordinal) go device to device.
    peers: Mutex<HashMap<usize, bool>>,
    /// The copy stream, made on first use ([`CudaBackend::copy_stream`]).
    copy: Mutex<Option<CopyStream>>,
    /// Decode's quantised activations ([`Q8_KEPT_BYTES`]), made on first use and kept, so a
    /// product allocates nothing ([`CudaBackend::q8_activations`]).
    q8_kept: Mutex<Option<CudaSlice<u8>>>,
    /// What `q8_kept` holds for the next op to take, when an op quantised its output there
    /// ([`Op::AddRmsNorm`]'s `q8_next`); every op takes it as it starts, so it reaches the very
    /// next op only.
    q8_ready: Mutex<Option<Q8Ready>>,
    /// The cuBLAS handle of the prompt products, made at the first one
    /// ([`CudaBackend::with_cublas`]), or why there is none.
    cublas: Mutex<CublasState>,
    /// Tokens from which prompts take cuBLAS, per weight type and mode
    /// ([`crate::sources::CublasMinTokens`]: the default, `WEIGHTLIFT_CUBLAS_MIN_TOKENS`, or
    /// [`CudaBackend::with_cublas_min_tokens`]).
    cublas_min_tokens: crate::sources::CublasMinTokens,
    /// Decode's Q8-mode kernels ([`Q8Decode`]: `WEIGHTLIFT_Q8V`, or
    /// [`CudaBackend::with_q8_decode`]).
    q8_decode: Q8Decode,
    /// Whether prompts' attention takes tensor cores where it can ([`PrefillAttention`]:
    /// `WEIGHTLIFT_FA_MMA`, or [`CudaBackend::with_prefill_attention`]).
    prefill_attention: PrefillAttention,
    /// The context's per-thread stack limit before the first quantise-on-load launch, restored
    /// once the quantisers are done ([`CudaBackend::check_quantized_on_device`]).
    stack_before_quantize: std::sync::OnceLock<Option<usize>>,
}

/// Whether a backend has a cuBLAS handle.
enum CublasState {
    NotTried,
    Ready(cublas::Handle),
    /// Why not (no libcublas, `WEIGHTLIFT_CUBLAS=0`, a failed create): prompts take the
    /// backend's own kernels.
    Unavailable(String),
}

/// Activations quantised into the kept Q8 buffer for the next op: the f32 activations'
/// device address, and how many blocks of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Q8Ready {
    x: u64,
    n_blocks: usize,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("compute_capability", &self.cc)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

impl Drop for CudaBackend {
    /// Work still queued may use this backend's modules and staging buffers: let it finish
    /// before they are unloaded and freed (buffers keep their own stream alive).
    fn drop(&mut self) {
        // Nothing to report to from a drop; the context keeps a sticky error anyway.
        wait_in_drop(&self.ctx, || self.stream.synchronize());
        // the cuBLAS handle, dropped after this, is destroyed in its own context
        let _ = self.ctx.bind_to_thread();
    }
}

impl CudaBackend {
    /// Opens device `ordinal`. Fails with [`KernelError::CudaUnavailable`] when there is no
    /// libcuda or no such device.
    pub fn new(ordinal: usize) -> Result<Self> {
        if let Some(e) = unavailable() {
            return Err(e);
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
        // cudarc would otherwise record and wait on events for every buffer of every launch
        // (seven driver calls for a matrix product, and two new events for each scratch
        // buffer) once a context has a second stream, as ours do. The backend orders its
        // streams itself: one compute stream, and explicit events for the copy stream and peer
        // copies (`CopyStream::after_compute`/`before_compute`, `copy_rows_to_peer`).
        // SAFETY: no buffer exists yet on this context; every buffer is allocated and freed on
        // the compute stream, and another stream touches one only between the events above.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("reading the compute capability"))?;
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(drv("reading the multiprocessor count"))?;
        let stream = ctx.new_stream().map_err(drv("creating a stream"))?;
        Ok(CudaBackend {
            ordinal,
            ctx,
            stream,
            cc: (major, minor),
            sm_count: usize::try_from(sm_count).unwrap_or(1).max(1),
            modules: Mutex::new(HashMap::new()),
            funcs: Mutex::new(HashMap::new()),
            staging: Mutex::new(None),
            peers: Mutex::new(HashMap::new()),
            copy: Mutex::new(None),
            q8_kept: Mutex::new(None),
            q8_ready: Mutex::new(None),
            cublas: Mutex::new(CublasState::NotTried),
            cublas_min_tokens: cublas::min_tokens_from_env(),
            q8_decode: Q8Decode::from_env(),
            prefill_attention: PrefillAttention::from_env(),
            stack_before_quantize: std::sync::OnceLock::new(),
        })
    }

    /// This backend with decode's Q8-mode products on the kernels `q8` picks, whatever
    /// `WEIGHTLIFT_Q8V` says (a test runs both families side by side in one process).
    pub fn with_q8_decode(mut self, q8: Q8Decode) -> Self {
        self.q8_decode = q8;
        self
    }

    /// This backend with prompt products taking cuBLAS from the counts `min_tokens` gives,
    /// whatever `WEIGHTLIFT_CUBLAS_MIN_TOKENS` says (the bench forces each route on one device
    /// with two backends: [`CublasMinTokens::uniform`](crate::sources::CublasMinTokens::uniform)
    /// of 1 and of `usize::MAX`).
    pub fn with_cublas_min_tokens(mut self, min_tokens: crate::sources::CublasMinTokens) -> Self {
        self.cublas_min_tokens = min_tokens;
        self
    }

    /// This backend with prompts' attention on the kernels `choice` picks, whatever
    /// `WEIGHTLIFT_FA_MMA` says (a test runs the tensor-core and f32 kernels side by side).
    pub fn with_prefill_attention(mut self, choice: PrefillAttention) -> Self {
        self.prefill_attention = choice;
        self
    }

    /// Whether prompts' attention takes tensor cores where it can on this backend.
    pub fn prefill_attention(&self) -> PrefillAttention {
        self.prefill_attention
    }

    /// Which kernels decode's Q8-mode products run on this backend.
    pub fn q8_decode(&self) -> Q8Decode {
        self.q8_decode
    }

    /// The number of CUDA devices, or [`KernelError::CudaUnavailable`].
    pub fn device_count() -> Result<usize> {
        if !culib_present() {
            return Err(KernelError::LibraryNotFound {
                library: "libcuda.so.1".into(),
                fix: NO_DRIVER.into(),
                detail: String::new(),
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

    /// Makes this backend's cuBLAS handle if it has none yet: `Ok` when prompts of
    /// [`CudaBackend::cublas_min_tokens`] tokens or more take cuBLAS, else why they do not
    /// ([`KernelError::LibraryNotFound`] naming libcublas and where it was looked for, when
    /// that is the reason).
    pub fn cublas_ready(&self) -> Result<()> {
        if self.with_cublas(|_| Ok(()))?.is_some() {
            return Ok(());
        }
        cublas::cublas_library()?;
        Err(KernelError::Cuda {
            during: format!("making a cuBLAS handle on {}", self.name()),
            message: self.cublas_unavailable().unwrap_or_default(),
        })
    }

    /// Why this backend runs prompts without cuBLAS, once it has tried to make a handle.
    pub fn cublas_unavailable(&self) -> Option<String> {
        match &*self
            .cublas
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            CublasState::Unavailable(why) => Some(why.clone()),
            _ => None,
        }
    }

    /// Tokens from which prompt products take cuBLAS on this backend, for the weight types and
    /// modes without a count of their own ([`CudaBackend::cublas_min_tokens_for`]).
    pub fn cublas_min_tokens(&self) -> usize {
        self.cublas_min_tokens.every()
    }

    /// Tokens from which prompt products of `ty` in `mode` take cuBLAS on this backend.
    pub fn cublas_min_tokens_for(&self, ty: crate::QuantType, mode: crate::MatvecMode) -> usize {
        self.cublas_min_tokens.of(ty, mode)
    }

    /// The fewest tokens from which any product takes cuBLAS on this backend.
    pub fn cublas_min_tokens_least(&self) -> usize {
        self.cublas_min_tokens.least()
    }

    /// The fewest tokens from which a product of `ty` weights in `mode`, `cols` values a row,
    /// takes scratch memory on this backend ([`scratch_from_tokens`] under its counts).
    pub fn scratch_from_tokens(&self, ty: QuantType, mode: MatvecMode, cols: usize) -> usize {
        scratch_from_tokens(&self.cublas_min_tokens, ty, mode, cols)
    }

    /// The route a prompt product of `n_tok` tokens of `ty` in `mode` takes on this backend
    /// when cuBLAS is there (without it, [`PromptRoute::Cublas`] falls back to the int8
    /// tensor-core kernels where their count is reached, else to the backend's own kernels).
    pub fn prompt_route(&self, ty: QuantType, mode: MatvecMode, n_tok: usize) -> PromptRoute {
        self.cublas_min_tokens.route(ty, mode, n_tok, self.cc)
    }

    /// Runs `f` with this backend's cuBLAS handle (made on first use, on this backend's
    /// stream, with a workspace of [`crate::sources::cublas_workspace_bytes`]); `None` when
    /// there is none (see [`cublas`]), so the caller runs its own kernels instead. The handle's
    /// lock is held while `f` runs: give it the cuBLAS calls only, not the launches and
    /// allocations around them, which need no handle (the workspace's uses are ordered by the
    /// one stream every call on the handle is queued on, not by the lock).
    pub(crate) fn with_cublas<R>(
        &self,
        f: impl FnOnce(&cublas::Handle) -> Result<R>,
    ) -> Result<Option<R>> {
        let mut state = self
            .cublas
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if matches!(*state, CublasState::NotTried) {
            // the handle's workspace is made outside a graph's recording only (see
            // `capturing`): the products recorded take the backend's kernels
            if self.capturing()? {
                return Ok(None);
            }
            *state = match self.make_cublas() {
                Ok(h) => CublasState::Ready(h),
                Err(e) => CublasState::Unavailable(e.to_string()),
            };
        }
        match &*state {
            CublasState::Ready(h) => {
                self.ctx
                    .bind_to_thread()
                    .map_err(drv("binding the context for cuBLAS"))?;
                f(h).map(Some)
            }
            _ => Ok(None),
        }
    }

    fn make_cublas(&self) -> Result<cublas::Handle> {
        if cublas::disabled_by_env() {
            return Err(KernelError::Cuda {
                during: "making a cuBLAS handle".into(),
                message: "turned off by WEIGHTLIFT_CUBLAS=0".into(),
            });
        }
        // the library first: its absence is the common case and allocates nothing
        cublas::cublas_library()?;
        self.ctx
            .bind_to_thread()
            .map_err(drv("binding the context for cuBLAS"))?;
        let bytes = crate::sources::cublas_workspace_bytes(self.cc);
        let workspace = self
            .stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| self.alloc_error(bytes, e))?;
        let (ptr, record) = workspace.device_ptr(&self.stream);
        drop(record);
        cublas::Handle::new(self.stream.cu_stream().cast(), workspace, ptr)
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(drv("reading memory info"))
    }

    /// The compute capability, (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// The device's name as the driver gives it (`"NVIDIA H200"`).
    pub fn device_name(&self) -> Result<String> {
        self.ctx.name().map_err(drv("reading the device name"))
    }

    /// Fills `len` bytes of `dst` from byte `offset` window by window: `fill(at, window)` writes
    /// bytes `at..at + window.len()` of the range straight into a pinned staging buffer, and
    /// each window's DMA overlaps the next window's fill. The host copies the bytes once (a
    /// loader reads the file into the window), where [`Backend::copy_from_host`] copies the
    /// caller's bytes into staging first. Returns once the last window is queued: the outer
    /// error is the driver's, the inner one `fill`'s, which ends the fill there.
    pub fn upload_filled<E>(
        &self,
        dst: &mut CudaBuffer,
        offset: usize,
        len: usize,
        fill: &mut crate::backend::Fill<'_, E>,
    ) -> Result<std::result::Result<(), E>> {
        self.own(dst)?;
        check_range("fill destination bytes", dst.slice.len(), offset, len)?;
        upload_filled(
            &self.ctx,
            &self.stream,
            &self.staging,
            &self.name(),
            dst,
            offset,
            len,
            fill,
        )
    }

    /// The bytes one CUDA context takes on this device. `cuMemGetInfo` answers only inside a
    /// context, so the one this backend holds cannot be measured by itself: the free memory is
    /// read before and after a second, short-lived context is made on the device (an equal
    /// cost: the same device, driver and limits). Measured once per device per process; the
    /// driver's other users come and go meanwhile, so this is close, not exact.
    pub fn context_bytes(&self) -> Result<u64> {
        let cache = || {
            CONTEXT_BYTES
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if let Some(&(_, b)) = cache().iter().find(|(o, _)| *o == self.ordinal) {
            return Ok(b);
        }
        use cudarc::driver::sys;
        self.ctx
            .bind_to_thread()
            .map_err(drv("binding the context to measure it"))?;
        let (before, _) = self.mem_info()?;
        let mut other: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `other` is valid for a write and the device is this backend's; the new
        // context becomes current on this thread until it is destroyed below.
        unsafe { sys::cuCtxCreate_v2(&mut other, 0, self.ctx.cu_device()) }
            .result()
            .map_err(drv("creating a second context to measure one"))?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: a context is current (the new one); both pointers are valid for writes.
        let read = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }.result();
        // SAFETY: `other` was created above and is used no more; destroying the current
        // context also pops it from this thread.
        let destroyed = unsafe { sys::cuCtxDestroy_v2(other) }.result();
        self.ctx
            .bind_to_thread()
            .map_err(drv("binding the context again after measuring"))?;
        read.map_err(drv("reading free memory beside a second context"))?;
        destroyed.map_err(drv("destroying the second context"))?;
        let bytes = (before.saturating_sub(free)) as u64;
        cache().push((self.ordinal, bytes));
        Ok(bytes)
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
    /// NVRTC's CUBIN for `sm_XY`, NVRTC's PTX for `compute_XY` (NVRTC's images through the disk
    /// cache of [`crate::nvrtc_cache`], so only the first process compiles them). Every failure
    /// is kept for the error, so a driver too old for the PTX, or an NVRTC too old for the
    /// device, is named.
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
        let cache = crate::nvrtc_cache::dir();
        for arch in [
            format!("sm_{major}{minor}"),
            format!("compute_{major}{minor}"),
        ] {
            let through_driver = |image: crate::nvrtc_cache::Image, cached: bool| {
                let what = format!("{}nvrtc {arch}", if cached { "cached " } else { "" });
                let image = match image {
                    crate::nvrtc_cache::Image::Cubin(bin) => cudarc::nvrtc::Ptx::from_binary(bin),
                    crate::nvrtc_cache::Image::Ptx(ptx) => cudarc::nvrtc::Ptx::from_src(ptx),
                };
                load(image, &what, &mut tried)
            };
            match crate::nvrtc::load_through_cache(
                name,
                src,
                &arch,
                cache.as_deref(),
                through_driver,
            ) {
                Ok(Some(m)) => return Ok(m),
                Ok(None) => {}
                // no libnvrtc: say so plainly (with what else was tried)
                Err(KernelError::LibraryNotFound {
                    library,
                    fix,
                    detail,
                }) => {
                    tried.push(format!("nvrtc {arch}: {library} not found"));
                    return Err(KernelError::LibraryNotFound {
                        library,
                        fix,
                        detail: format!("{detail}; needed for {during} ({})", tried.join("; ")),
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

    /// Kernel `name` of `module`, looked up in the driver once and kept: a decode step
    /// launches a few hundred kernels, and each lookup is a driver call.
    fn func(&self, module: &'static str, name: &str) -> Result<CudaFunction> {
        let mut funcs = self
            .funcs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (module, name.to_string());
        if let Some(f) = funcs.get(&key) {
            return Ok(f.clone());
        }
        let f = self
            .module(module)?
            .load_function(name)
            .map_err(drv(format!("finding kernel {name}")))?;
        funcs.insert(key, f.clone());
        Ok(f)
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

    /// Whether this backend's stream is recording a graph ([`CudaBackend::capture`]). What is
    /// allocated there is the graph's own memory, valid only while the graph runs: a buffer
    /// the backend keeps past the operation (decode's Q8 activations, the cuBLAS workspace) is
    /// never made then.
    fn capturing(&self) -> Result<bool> {
        use cudarc::driver::sys::CUstreamCaptureStatus;
        let status = self.stream.capture_status().map_err(drv(format!(
            "asking whether {} records a graph",
            self.name()
        )))?;
        Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
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
        crate::backend::record_upload(src.len());
        upload_staged(
            &self.ctx,
            &self.stream,
            &self.staging,
            &self.name(),
            src,
            dst,
            offset,
        )
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

    fn copy_2d(
        &self,
        src: &CudaBuffer,
        from: Rows,
        dst: &mut CudaBuffer,
        to: Rows,
        width: usize,
        rows: usize,
    ) -> Result<()> {
        self.copy_rows(src, from, dst, to, width, rows)
    }

    fn peer_access(&self, to: &CudaBackend) -> bool {
        self.reaches(to)
    }

    fn copy_peer(
        &self,
        src: &CudaBuffer,
        so: usize,
        to: &CudaBackend,
        dst: &mut CudaBuffer,
        d_o: usize,
        bytes: usize,
    ) -> Result<()> {
        self.copy_to_peer(src, so, to, dst, d_o, bytes)
    }

    fn copy_peer_2d(
        &self,
        src: &CudaBuffer,
        from: Rows,
        to: &CudaBackend,
        dst: &mut CudaBuffer,
        to_rows: Rows,
        shape: (usize, usize),
    ) -> Result<()> {
        self.copy_rows_to_peer(src, from, to, dst, to_rows, shape)
    }

    fn run(&self, op: Op<'_, CudaBuffer>) -> Result<()> {
        crate::backend::record(&op);
        self.run_op(op)
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

    fn quantize_rows(
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
        self.quantize_rows_on_device(ty, src_ty, src, n_per_row, dst, offset, first, found)
    }

    fn check_quantized(&self, found: &CudaBuffer) -> Result<()> {
        self.check_quantized_on_device(found)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(drv(format!("synchronising {}", self.name())))
    }
}

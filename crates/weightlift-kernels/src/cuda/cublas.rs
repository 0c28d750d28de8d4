//! cuBLAS for the products of prompts: `cublasGemmEx` through a table of the few functions we
//! call, opened from the file [`crate::cuda_libs`] finds.
//!
//! cudarc's `cublas` feature gives the C types and enum values (its bindgen of `cublas_api.h`),
//! but its loader asks the system loader for names only, and only for `libcublas.so.12` and
//! older: a CUDA 13 toolkit in `/usr/local/cuda/lib64` (off the loader's path, as on the H200
//! of the GPU runs) or pip's `nvidia/cu13/lib/libcublas.so.13` would never be found, and a
//! missing symbol panics. So, as NVRTC is (`nvrtc.rs`), the library is opened by its path and
//! its functions looked up once; `cublasGemmEx`'s C signature is the same in cuBLAS 11, 12 and
//! 13. A pip wheel's `libcublas.so.N` finds its `libcublasLt.so.N` beside it (`$ORIGIN`).
//!
//! **When cuBLAS is absent** the CUDA backend keeps working: prompts take the kernels they took
//! before (the dequantised chunks and the tiled `gemm_f32` in exact mode, the Q8 kernels in
//! fast mode), and [`cublas_library`] says why in a typed error naming `libcublas` and where it
//! was looked for (`weightlift devices` reports it). A missing speed-up is not a reason to
//! refuse a model that runs without it. `WEIGHTLIFT_CUBLAS=0` turns it off on purpose (the
//! bench's A/B), and `WEIGHTLIFT_CUBLAS_MIN_TOKENS` moves the threshold
//! ([`crate::sources::CUBLAS_MIN_TOKENS`], per type [`crate::sources::CublasMinTokens`]).
// cuBLAS is a C API reached through function pointers; each call says what keeps it sound.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasMath_t, cublasOperation_t,
    cublasStatus_t, cudaDataType, cudaStream_t, libraryPropertyType,
};

use crate::cuda_libs::{self, Located};
use crate::error::{KernelError, Result};
use crate::sources::CublasMinTokens;

/// What to install when libcublas is missing.
const CUBLAS_FIX: &str = "install a CUDA toolkit (libcublas in $CUDA_HOME/lib64 or \
                          /usr/local/cuda/lib64) or pip install nvidia-cublas-cu12 (or the cu13 \
                          wheels); without it prompts run on weightlift's own kernels";

type GemmExFn = unsafe extern "C" fn(
    cublasHandle_t,
    cublasOperation_t,
    cublasOperation_t,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    cudaDataType,
    c_int,
    *const c_void,
    cudaDataType,
    c_int,
    *const c_void,
    *mut c_void,
    cudaDataType,
    c_int,
    cublasComputeType_t,
    cublasGemmAlgo_t,
) -> cublasStatus_t;

/// The cuBLAS functions we call, from one opened library.
struct Table {
    located: Located,
    get_property: unsafe extern "C" fn(libraryPropertyType, *mut c_int) -> cublasStatus_t,
    create: unsafe extern "C" fn(*mut cublasHandle_t) -> cublasStatus_t,
    destroy: unsafe extern "C" fn(cublasHandle_t) -> cublasStatus_t,
    set_stream: unsafe extern "C" fn(cublasHandle_t, cudaStream_t) -> cublasStatus_t,
    set_workspace: unsafe extern "C" fn(cublasHandle_t, *mut c_void, usize) -> cublasStatus_t,
    set_math_mode: unsafe extern "C" fn(cublasHandle_t, cublasMath_t) -> cublasStatus_t,
    gemm_ex: GemmExFn,
    /// Keeps the functions above mapped; declared last so it is dropped last.
    _lib: libloading::Library,
}

impl Table {
    fn open(name: &std::ffi::OsStr) -> std::result::Result<Table, String> {
        // SAFETY: libcublas's initialisers only set up the library itself.
        let lib = unsafe { libloading::Library::new(name) }.map_err(|e| e.to_string())?;
        /// Looks one function up; its type is `cublas_api.h`'s declaration of `symbol`.
        macro_rules! sym {
            ($symbol:literal) => {
                // SAFETY: the field this initialises has the C signature of `$symbol` in
                // cublas_api.h (the types are cudarc's bindgen of it), and the pointer does
                // not outlive `lib`, which the table owns.
                *unsafe { lib.get($symbol) }.map_err(|e| format!("{}: {e}", $symbol))?
            };
        }
        Ok(Table {
            located: Located::Loader(String::new()),
            get_property: sym!("cublasGetProperty"),
            create: sym!("cublasCreate_v2"),
            destroy: sym!("cublasDestroy_v2"),
            set_stream: sym!("cublasSetStream_v2"),
            set_workspace: sym!("cublasSetWorkspace_v2"),
            set_math_mode: sym!("cublasSetMathMode"),
            gemm_ex: sym!("cublasGemmEx"),
            _lib: lib,
        })
    }
}

fn table() -> Result<&'static Table> {
    static TABLE: OnceLock<std::result::Result<Table, cuda_libs::NotFound>> = OnceLock::new();
    TABLE
        .get_or_init(|| {
            cuda_libs::open_first("cublas", &Table::open).map(|(mut t, located)| {
                t.located = located;
                t
            })
        })
        .as_ref()
        .map_err(|nf| nf.clone().into_error(CUBLAS_FIX))
}

/// The libcublas file (or loader name) in use, or why there is none.
pub fn cublas_library() -> Result<PathBuf> {
    Ok(match &table()?.located {
        Located::Loader(name) => PathBuf::from(name),
        Located::File(path) => path.clone(),
    })
}

/// The version of the libcublas in use, `(major, minor)`.
pub fn cublas_version() -> Result<(i32, i32)> {
    let t = table()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for one write; the property values are cuBLAS's own.
    let s = unsafe { (t.get_property)(libraryPropertyType::MAJOR_VERSION, &mut major) };
    check(s, "cublasGetProperty")?;
    // SAFETY: as above.
    let s = unsafe { (t.get_property)(libraryPropertyType::MINOR_VERSION, &mut minor) };
    check(s, "cublasGetProperty")?;
    Ok((major, minor))
}

fn check(s: cublasStatus_t, call: &str) -> Result<()> {
    if s == cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(KernelError::Cuda {
            during: format!("calling {call}"),
            message: format!("{s:?}"),
        })
    }
}

/// Whether the environment turns cuBLAS off (`WEIGHTLIFT_CUBLAS=0`).
pub(crate) fn disabled_by_env() -> bool {
    std::env::var("WEIGHTLIFT_CUBLAS").is_ok_and(|v| matches!(v.trim(), "0" | "off" | "false"))
}

/// The token counts from which prompts take cuBLAS: `WEIGHTLIFT_CUBLAS_MIN_TOKENS` for every
/// type when it is a number (the A/B runs move them all), else the default
/// ([`crate::sources::CUBLAS_MIN_TOKENS`] and the counts of its own a type has); and from which
/// they take the int8 tensor-core kernels: `WEIGHTLIFT_MMQ_MIN_TOKENS` for every type of
/// [`crate::sources::MMQ_TYPES`] when it is a number, else the default (none).
pub(crate) fn min_tokens_from_env() -> CublasMinTokens {
    std::env::var("WEIGHTLIFT_CUBLAS_MIN_TOKENS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map_or_else(CublasMinTokens::default, |n| {
            CublasMinTokens::default().with_cublas_every(n)
        })
        .with_mma_env_value(std::env::var(CublasMinTokens::MMA_ENV).ok().as_deref())
}

/// One cuBLAS handle bound to a backend's stream, with the workspace the plan charges
/// (`cublas_workspace_bytes`), given to cuBLAS so it allocates none of its own.
pub(crate) struct Handle {
    table: &'static Table,
    handle: cublasHandle_t,
    /// Kept alive for as long as the handle may use it.
    workspace: cudarc::driver::CudaSlice<u8>,
}

// SAFETY: a cuBLAS handle may be used from any thread as long as calls on it do not overlap;
// the backend keeps it behind a mutex held for each call (and binds its context first).
unsafe impl Send for Handle {}

/// One `cublasGemmEx` in column-major terms: `C[m×n] = op(A)·op(B)`, with `A` read transposed
/// (`k×m`, ld `lda`: our row-major weight rows) and `B` as stored (`k×n`, ld `ldb`: our
/// row-major tokens), `C` f32 with ld `ldc` (our row-major `n_tok × rows` output).
pub(crate) struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub lda: usize,
    pub b: u64,
    pub ldb: usize,
    pub c: u64,
    pub ldc: usize,
    /// The type of both `A` and `B`.
    pub ab: cudaDataType,
    /// Exact: f32 with `CUBLAS_COMPUTE_32F_PEDANTIC` (no TF32 whatever `NVIDIA_TF32_OVERRIDE`
    /// says); fast: f16/bf16 on tensor cores with `CUBLAS_COMPUTE_32F` (f32 accumulate).
    pub compute: cublasComputeType_t,
}

fn c_int_of(what: &str, v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| KernelError::Shape {
        op: "cublas gemm",
        reason: format!("{what} {v} does not fit cuBLAS's 32-bit argument"),
    })
}

impl Handle {
    /// A handle on the current context (the caller bound it), on `stream`, with `workspace`.
    pub(crate) fn new(
        stream: cudaStream_t,
        workspace: cudarc::driver::CudaSlice<u8>,
        workspace_ptr: u64,
    ) -> Result<Handle> {
        let table = table()?;
        let mut handle: cublasHandle_t = std::ptr::null_mut();
        // SAFETY: `handle` is valid for one write; a context is current on this thread.
        check(unsafe { (table.create)(&mut handle) }, "cublasCreate")?;
        let h = Handle {
            table,
            handle,
            workspace,
        };
        // SAFETY: a live handle and the backend's live stream.
        check(
            unsafe { (table.set_stream)(h.handle, stream) },
            "cublasSetStream",
        )?;
        // SAFETY: the workspace is device memory of this context that the handle owns (it
        // lives as long as the handle), of the size passed.
        check(
            unsafe {
                (table.set_workspace)(h.handle, workspace_ptr as *mut c_void, h.workspace.len())
            },
            "cublasSetWorkspace",
        )?;
        // SAFETY: a live handle; the default math mode allows no TF32.
        check(
            unsafe { (table.set_math_mode)(h.handle, cublasMath_t::CUBLAS_DEFAULT_MATH) },
            "cublasSetMathMode",
        )?;
        Ok(h)
    }

    /// Enqueues one GEMM on the handle's stream.
    ///
    /// # Safety
    ///
    /// `a`, `b` and `c` are device addresses of this handle's context that hold the matrices
    /// `g` describes (`lda·(m-1)+k` values of A, `ldb·(n-1)+k` of B, `ldc·(n-1)+m` of C), live
    /// until the stream has run the GEMM; nothing else writes `c` meanwhile.
    pub(crate) unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        let s = unsafe {
            // SAFETY: the caller's contract covers the three matrices; alpha and beta are f32,
            // the scale type of every compute type used here (32F and 32F_PEDANTIC).
            (self.table.gemm_ex)(
                self.handle,
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                c_int_of("m", g.m)?,
                c_int_of("n", g.n)?,
                c_int_of("k", g.k)?,
                (&alpha as *const f32).cast(),
                g.a as *const c_void,
                g.ab,
                c_int_of("lda", g.lda)?,
                g.b as *const c_void,
                g.ab,
                c_int_of("ldb", g.ldb)?,
                (&beta as *const f32).cast(),
                g.c as *mut c_void,
                cudaDataType::CUDA_R_32F,
                c_int_of("ldc", g.ldc)?,
                g.compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check(s, "cublasGemmEx")
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and used no more; nothing to report to from a drop.
        let _ = unsafe { (self.table.destroy)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where a libcublas is found (a toolkit, pip's `nvidia-cublas-*` or `nvidia/cu13` wheel),
    /// its table resolves and it reports its version; where none is, the error names the
    /// library and says what to install.
    #[test]
    fn cublas_is_found_or_named_as_missing() {
        match cublas_library() {
            Ok(path) => {
                let (major, minor) = cublas_version().expect("a loaded cublas has a version");
                assert!(major >= 11, "{} is cuBLAS {major}.{minor}", path.display());
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.starts_with("libcublas not found: install a CUDA toolkit"),
                    "{msg}"
                );
                assert!(msg.contains("/usr/local/cuda/lib64"), "{msg}");
            }
        }
    }
}

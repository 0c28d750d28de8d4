//! NVRTC compilation of the embedded kernel sources (features `nvrtc-check` or `cuda`).
//!
//! Used at run time by the CUDA backend when the build had no nvcc, and by the test that
//! compiles every source for compute_75 (PTX) and sm_90 (PTX and CUBIN) and fails on any error
//! or warning.
//!
//! libnvrtc is found by [`crate::cuda_libs`] (the loader's path, a CUDA toolkit, or pip's
//! `nvidia/*/lib` folders) and opened by its path; its functions are called through the table
//! below. cudarc's own NVRTC loader only tries names (`libnvrtc.so.12` and older), which would
//! miss NVRTC 13 and every library outside the loader's path.
// NVRTC is a C API reached through function pointers; each call says what keeps it sound.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::cuda_libs::{self, Located};
use crate::error::{KernelError, Result};
use crate::nvrtc_cache::{self, Image};

/// What NVRTC produced for one source and architecture.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// PTX text (always produced).
    pub ptx: String,
    /// CUBIN bytes, when the architecture was a real one (`sm_XX`).
    pub cubin: Option<Vec<u8>>,
    /// The compiler log, trimmed (empty when there was nothing to say).
    pub log: String,
}

type Program = *mut c_void;
/// `nvrtcResult`, a C enum: 0 is `NVRTC_SUCCESS`.
type Status = c_int;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> Status;
type CopyFn = unsafe extern "C" fn(Program, *mut c_char) -> Status;

/// The NVRTC functions we call, from one opened library. Their C signatures are the same in
/// NVRTC 11, 12 and 13.
struct Nvrtc {
    located: Located,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    log_size: SizeFn,
    log: CopyFn,
    ptx_size: SizeFn,
    ptx: CopyFn,
    cubin_size: SizeFn,
    cubin: CopyFn,
    destroy: unsafe extern "C" fn(*mut Program) -> Status,
    /// Keeps the functions above mapped; declared last so it is dropped last.
    _lib: libloading::Library,
}

impl Nvrtc {
    /// Opens `name` (a loader name or a path) and looks up every function.
    fn open(name: &std::ffi::OsStr) -> std::result::Result<Nvrtc, String> {
        // SAFETY: libnvrtc's initialisers only set up the library itself.
        let lib = unsafe { libloading::Library::new(name) }.map_err(|e| e.to_string())?;
        /// Looks one function up; its type is the NVRTC header's declaration of `symbol`.
        macro_rules! sym {
            ($symbol:literal) => {
                // SAFETY: the field this initialises has the C signature of `$symbol` in
                // nvrtc.h, and the pointer does not outlive `lib`, which the table owns.
                *unsafe { lib.get($symbol) }.map_err(|e| format!("{}: {e}", $symbol))?
            };
        }
        Ok(Nvrtc {
            located: Located::Loader(String::new()),
            version: sym!("nvrtcVersion"),
            error_string: sym!("nvrtcGetErrorString"),
            create: sym!("nvrtcCreateProgram"),
            compile: sym!("nvrtcCompileProgram"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            ptx_size: sym!("nvrtcGetPTXSize"),
            ptx: sym!("nvrtcGetPTX"),
            cubin_size: sym!("nvrtcGetCUBINSize"),
            cubin: sym!("nvrtcGetCUBIN"),
            destroy: sym!("nvrtcDestroyProgram"),
            _lib: lib,
        })
    }

    /// `NVRTC_ERROR_COMPILATION` for a failed status.
    fn describe(&self, status: Status) -> String {
        // SAFETY: nvrtcGetErrorString takes any status and returns a static string or null.
        let p = unsafe { (self.error_string)(status) };
        if p.is_null() {
            return format!("nvrtc status {status}");
        }
        // SAFETY: non-null: a NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn check(&self, status: Status, call: &str) -> std::result::Result<(), String> {
        if status == 0 {
            Ok(())
        } else {
            Err(format!("{call}: {}", self.describe(status)))
        }
    }

    /// One of the program's outputs (log, PTX, CUBIN) through its size and copy functions.
    fn output(
        &self,
        prog: Program,
        size: SizeFn,
        copy: CopyFn,
        what: &str,
    ) -> std::result::Result<Vec<u8>, String> {
        let mut n = 0usize;
        // SAFETY: `prog` is a live program; `n` is valid for a write.
        self.check(unsafe { size(prog, &mut n) }, &format!("{what} size"))?;
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it writes.
        self.check(unsafe { copy(prog, buf.as_mut_ptr().cast()) }, what)?;
        Ok(buf)
    }
}

/// The library, once loaded. A failure is not kept: a later call searches again (the Python
/// package registers its site folders at import, tests their venv).
static NVRTC: OnceLock<Nvrtc> = OnceLock::new();

fn nvrtc() -> Result<&'static Nvrtc> {
    if let Some(n) = NVRTC.get() {
        return Ok(n);
    }
    match cuda_libs::open_first("nvrtc", &Nvrtc::open) {
        Ok((mut n, located)) => {
            n.located = located;
            Ok(NVRTC.get_or_init(|| n))
        }
        Err(missing) => Err(missing.into_error(
            "install a CUDA toolkit, or NVRTC from pip: pip install weightlift[cuda] \
             (nvidia-cuda-nvrtc-cu12)",
        )),
    }
}

/// Whether libnvrtc can be found and loaded.
pub fn nvrtc_available() -> bool {
    nvrtc().is_ok()
}

/// Where libnvrtc was loaded from: its file, or the name the system loader resolved (with the
/// file it mapped, where the process's maps say).
pub fn nvrtc_library() -> Result<PathBuf> {
    let n = nvrtc()?;
    Ok(match &n.located {
        Located::File(p) => p.clone(),
        Located::Loader(name) => {
            cuda_libs::loaded_path("libnvrtc.so").unwrap_or_else(|| PathBuf::from(name))
        }
    })
}

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let n = nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for writes.
    let r = unsafe { (n.version)(&mut major, &mut minor) };
    n.check(r, "nvrtcVersion")
        .map_err(|log| KernelError::Nvrtc {
            source_name: "-".into(),
            arch: "-".into(),
            log,
        })?;
    Ok((major, minor))
}

fn c_bytes_to_string(v: &[u8]) -> String {
    let text = v.split(|&b| b == 0).next().unwrap_or_default();
    String::from_utf8_lossy(text).trim().to_string()
}

/// NVRTC's options for `arch`. Extra include directories come from `WEIGHTLIFT_CUDA_INCLUDE`
/// when set (the sources need none).
fn options(arch: &str) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
    ];
    if let Ok(inc) = std::env::var("WEIGHTLIFT_CUDA_INCLUDE") {
        opts.push(format!("--include-path={inc}"));
    }
    opts
}

/// Compiles `src` (module `name`) for `arch` (`compute_80`, `sm_90`, ...) with [`options`].
pub fn compile(name: &str, src: &str, arch: &str) -> Result<Compiled> {
    let n = nvrtc()?;
    let err = |log: String| KernelError::Nvrtc {
        source_name: format!("{name}.cu"),
        arch: arch.to_string(),
        log,
    };
    let csrc = CString::new(src).map_err(|_| err("source contains a NUL byte".into()))?;
    let cname =
        CString::new(format!("{name}.cu")).map_err(|_| err("name contains a NUL byte".into()))?;
    let opts = options(arch);
    let copts = opts
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| err("an option contains a NUL byte".into()))?;
    let ptrs: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();
    let count = c_int::try_from(ptrs.len()).map_err(|_| err("too many options".into()))?;
    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: `prog` is valid for a write; the source and name are NUL-terminated and outlive
    // the call; no headers are passed (count 0, null arrays).
    let created = unsafe {
        (n.create)(
            &mut prog,
            csrc.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    n.check(created, "nvrtcCreateProgram").map_err(err)?;
    // SAFETY: `prog` was created above and is destroyed once, at the end; `ptrs` holds `count`
    // NUL-terminated options that outlive the call.
    let compiled = unsafe { (n.compile)(prog, count, ptrs.as_ptr()) };
    let log = n
        .output(prog, n.log_size, n.log, "nvrtcGetProgramLog")
        .map(|l| c_bytes_to_string(&l))
        .unwrap_or_default();
    let out = n
        .check(compiled, "nvrtcCompileProgram")
        .map_err(|e| err(format!("{e}: {log}")))
        .and_then(|()| {
            let ptx = n
                .output(prog, n.ptx_size, n.ptx, "nvrtcGetPTX")
                .map_err(err)?;
            let cubin = if arch.starts_with("sm_") {
                Some(
                    n.output(prog, n.cubin_size, n.cubin, "nvrtcGetCUBIN")
                        .map_err(err)?,
                )
            } else {
                None
            };
            Ok(Compiled {
                ptx: c_bytes_to_string(&ptx),
                cubin,
                log: log.clone(),
            })
        });
    // SAFETY: `prog` is live and not used after this.
    let _ = unsafe { (n.destroy)(&mut prog) };
    out
}

impl Compiled {
    /// The image a device loads: the CUBIN for a real architecture, else the PTX.
    pub fn image(self) -> Image {
        match self.cubin {
            Some(bin) => Image::Cubin(bin),
            None => Image::Ptx(self.ptx),
        }
    }
}

/// Module `name`'s image for `arch`, handed to `load` (the driver's module load: `Some` when it
/// took the image; its second argument says whether the image came from the disk cache in
/// `cache`, see [`nvrtc_cache`]). A cached image is tried first; one `load` refuses is dropped
/// from the cache. Otherwise NVRTC compiles the module, and an image `load` takes is kept in
/// the cache for the next process. `Ok(None)`: `load` refused the fresh image too.
pub fn load_through_cache<T>(
    name: &str,
    src: &str,
    arch: &str,
    cache: Option<&Path>,
    mut load: impl FnMut(Image, bool) -> Option<T>,
) -> Result<Option<T>> {
    // no slot without NVRTC's version: the compile below then says what is missing
    let slot = cache.and_then(|dir| {
        let version = nvrtc_version().ok()?;
        Some((
            dir,
            nvrtc_cache::key(name, src, arch, &options(arch), version),
        ))
    });
    if let Some((dir, key)) = &slot
        && let Some(image) = nvrtc_cache::read(dir, name, arch, key)
    {
        if let Some(m) = load(image, true) {
            return Ok(Some(m));
        }
        nvrtc_cache::forget(dir, name, arch, key);
    }
    let image = compile(name, src, arch)?.image();
    let kept = slot.as_ref().map(|_| image.clone());
    let loaded = load(image, false);
    if let (Some(_), Some((dir, key)), Some(image)) = (&loaded, &slot, kept) {
        nvrtc_cache::write(dir, name, arch, key, &image);
    }
    Ok(loaded)
}

/// Compiles `src` and treats any log output (a warning) as an error.
pub fn compile_strict(name: &str, src: &str, arch: &str) -> Result<Compiled> {
    let c = compile(name, src, arch)?;
    if !c.log.is_empty() {
        return Err(KernelError::Nvrtc {
            source_name: format!("{name}.cu"),
            arch: arch.into(),
            log: format!("warnings: {}", c.log),
        });
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warning_fails_the_strict_compile() {
        crate::cuda_libs::use_repo_venv();
        if let Err(e) = nvrtc() {
            panic!("{e} (make venv installs it into .venv)");
        }
        let src = "extern \"C\" __global__ void k(float* y) { int unused; y[0] = 1.0f; }";
        let err = compile_strict("warn", src, "compute_80").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with(
                "nvrtc could not compile kernel source 'warn.cu' for compute_80: warnings:"
            ),
            "{msg}"
        );
        assert!(msg.contains("unused"), "{msg}");
        let err = compile_strict("bad", "extern \"C\" __global__ void k() { nope; }", "sm_90")
            .unwrap_err();
        assert!(
            err.to_string().contains("identifier \"nope\" is undefined"),
            "{err}"
        );
    }

    /// The first load compiles and keeps what the driver took; the next reads it back with the
    /// same bytes and compiles nothing; a cached image the driver refuses is dropped and
    /// compiled again; an image the driver refuses is not kept; without a cache every load
    /// compiles. The driver is played by the closure (this test needs NVRTC, not a GPU).
    #[test]
    fn the_disk_cache_keeps_what_the_driver_took() {
        crate::cuda_libs::use_repo_venv();
        if let Err(e) = nvrtc() {
            panic!("{e} (make venv installs it into .venv)");
        }
        let dir =
            std::env::temp_dir().join(format!("weightlift-nvrtc-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = "extern \"C\" __global__ void k(float* y) { y[threadIdx.x] = 2.0f; }";
        for arch in ["sm_90", "compute_75"] {
            let mut seen: Vec<(Image, bool)> = Vec::new();
            let run = |refuse: bool, seen: &mut Vec<(Image, bool)>| {
                load_through_cache("cache_probe", src, arch, Some(&dir), |image, cached| {
                    seen.push((image, cached));
                    (!refuse).then_some(())
                })
                .unwrap()
            };
            // compiled, taken, kept
            assert_eq!(run(false, &mut seen), Some(()));
            // read back: the same image, from the cache
            assert_eq!(run(false, &mut seen), Some(()));
            assert_eq!(seen.len(), 2);
            assert!(!seen[0].1 && seen[1].1, "{arch}: compiled, then cached");
            assert_eq!(seen[0].0, seen[1].0, "{arch}: the same image");
            let is_cubin = matches!(seen[0].0, Image::Cubin(_));
            assert_eq!(is_cubin, arch.starts_with("sm_"), "{arch}");
            // refused from the cache and when compiled: dropped, and not kept again
            seen.clear();
            assert_eq!(run(true, &mut seen), None);
            assert_eq!(
                seen.iter().map(|s| s.1).collect::<Vec<_>>(),
                [true, false],
                "{arch}: the cached image, then a fresh one"
            );
            seen.clear();
            assert_eq!(run(false, &mut seen), Some(()));
            assert!(!seen[0].1, "{arch}: nothing was kept of a refused image");
        }
        // no cache: every load compiles
        let mut fresh = 0;
        for _ in 0..2 {
            load_through_cache("cache_probe", src, "sm_90", None, |_, cached| {
                fresh += usize::from(!cached);
                Some(())
            })
            .unwrap();
        }
        assert_eq!(fresh, 2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

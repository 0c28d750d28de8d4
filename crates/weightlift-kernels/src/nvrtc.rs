//! NVRTC compilation of the embedded kernel sources (features `nvrtc-check` or `cuda`).
//!
//! Used at run time by the CUDA backend when the build had no nvcc, and by the test that
//! compiles every source for compute_80/compute_90 (PTX) and sm_80/sm_90 (CUBIN) and fails on
//! any error or warning.
// NVRTC is a C API reached through cudarc's raw bindings; each call says what keeps it sound.
#![allow(unsafe_code)]

use std::ffi::{CString, c_char};

use cudarc::nvrtc::{result, sys};

use crate::error::{KernelError, Result};

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

/// Whether libnvrtc can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names; no NVRTC call is made.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    ensure()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid for writes.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    r.result().map_err(|e| KernelError::Nvrtc {
        source_name: "-".into(),
        arch: "-".into(),
        log: format!("nvrtcVersion failed: {e:?}"),
    })?;
    Ok((major, minor))
}

fn ensure() -> Result<()> {
    if nvrtc_available() {
        Ok(())
    } else {
        Err(KernelError::CudaUnavailable {
            reason: "libnvrtc could not be loaded (install nvidia-cuda-nvrtc-cu12 and put its lib directory on LD_LIBRARY_PATH)".into(),
        })
    }
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// Compiles `src` (module `name`) for `arch` (`compute_80`, `sm_90`, ...). Extra include
/// directories come from `WEIGHTLIFT_CUDA_INCLUDE` when set (the sources need none).
pub fn compile(name: &str, src: &str, arch: &str) -> Result<Compiled> {
    ensure()?;
    let err = |log: String| KernelError::Nvrtc {
        source_name: format!("{name}.cu"),
        arch: arch.to_string(),
        log,
    };
    let csrc = CString::new(src).map_err(|_| err("source contains a NUL byte".into()))?;
    let cname =
        CString::new(format!("{name}.cu")).map_err(|_| err("name contains a NUL byte".into()))?;
    let prog = result::create_program(&csrc, Some(&cname))
        .map_err(|e| err(format!("nvrtcCreateProgram: {e:?}")))?;
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
    ];
    if let Ok(inc) = std::env::var("WEIGHTLIFT_CUDA_INCLUDE") {
        opts.push(format!("--include-path={inc}"));
    }
    // SAFETY: prog was created above and is destroyed once, at the end of this function.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(prog) }
        .map(|l| c_chars_to_string(&l))
        .unwrap_or_default();
    let out = compiled
        .map_err(|e| err(format!("{e:?}: {log}")))
        .and_then(|()| {
            // SAFETY: as above; the program compiled.
            let ptx =
                unsafe { result::get_ptx(prog) }.map_err(|e| err(format!("nvrtcGetPTX: {e:?}")))?;
            let ptx = c_chars_to_string(&ptx);
            let cubin = if arch.starts_with("sm_") {
                let mut size = 0usize;
                // SAFETY: valid program and out-pointer.
                unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
                    .result()
                    .map_err(|e| err(format!("nvrtcGetCUBINSize: {e:?}")))?;
                let mut buf = vec![0u8; size];
                // SAFETY: buf has the size NVRTC reported.
                unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) }
                    .result()
                    .map_err(|e| err(format!("nvrtcGetCUBIN: {e:?}")))?;
                Some(buf)
            } else {
                None
            };
            Ok(Compiled {
                ptx,
                cubin,
                log: log.clone(),
            })
        });
    // SAFETY: prog is valid and not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
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
        assert!(
            nvrtc_available(),
            "libnvrtc could not be loaded: put the pip nvidia/cuda_nvrtc/lib directory on LD_LIBRARY_PATH (make test does)"
        );
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
}

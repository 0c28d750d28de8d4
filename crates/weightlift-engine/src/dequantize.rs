//! Whole tensors decoded to f32, as Python reads them: a checkpoint's straight from the map
//! ([`checkpoint_tensor`], `Checkpoint.dequantize`) and a loaded model's from wherever it is held
//! ([`crate::Model::dequantized`], `Model.tensor(dequantize=True)`). Both decode through
//! [`crate::convert::dequantize_into`] into a [`zeroed_f32`] buffer, so a tensor reads the same
//! either way.

// `zeroed_f32` asks the kernel for huge pages with `madvise`; the SAFETY note there says why it
// is sound.
#![allow(unsafe_code)]

use weightlift_format::{Checkpoint, FormatError, TensorInfo};

use crate::convert;

/// Dequantise one tensor of `ckpt` to a new f32 buffer in row-major order. Allocates
/// `n_elements` floats, a count the reader checked against the file's bytes at open time, and
/// only after the type is known to have a dequantiser. Errors name the file and the tensor.
pub fn checkpoint_tensor(
    ckpt: &Checkpoint,
    info: &TensorInfo,
) -> weightlift_format::Result<Vec<f32>> {
    let n = usize::try_from(info.n_elements()).map_err(|_| {
        wrap_dequant(
            ckpt,
            info,
            FormatError::DequantizeBlocks {
                dtype: info.dtype,
                detail: format!("{} elements do not fit in memory", info.n_elements()),
            },
        )
    })?;
    if !convert::can_dequantize(info.dtype) {
        return Err(no_dequantiser(ckpt, info));
    }
    let mut out = zeroed_f32(n);
    checkpoint_tensor_into(ckpt, info, &mut out)?;
    Ok(out)
}

/// Dequantise one tensor of `ckpt` into `out` (exactly `n_elements` long).
pub fn checkpoint_tensor_into(
    ckpt: &Checkpoint,
    info: &TensorInfo,
    out: &mut [f32],
) -> weightlift_format::Result<()> {
    if !convert::can_dequantize(info.dtype) {
        return Err(no_dequantiser(ckpt, info));
    }
    convert::dequantize_into(info.dtype, ckpt.bytes(info), out)
        .map_err(|e| wrap_dequant(ckpt, info, e))
}

fn no_dequantiser(ckpt: &Checkpoint, info: &TensorInfo) -> FormatError {
    wrap_dequant(
        ckpt,
        info,
        FormatError::DequantizeBlocks {
            dtype: info.dtype,
            detail: "no dequantiser for this type (gguf-py has none either)".into(),
        },
    )
}

fn wrap_dequant(ckpt: &Checkpoint, info: &TensorInfo, source: FormatError) -> FormatError {
    FormatError::Dequantize {
        path: ckpt
            .files()
            .nth(info.file)
            .unwrap_or(ckpt.path())
            .to_path_buf(),
        tensor: info.name.clone(),
        source: Box::new(source),
    }
}

/// A zeroed output buffer. Large ones ask for transparent huge pages first (as numpy does for
/// its own large arrays): a fresh 100 MB output otherwise costs ~25,000 page faults, which on a
/// VM take longer than the dequantisation itself.
pub(crate) fn zeroed_f32(n: usize) -> Vec<f32> {
    let mut v = Vec::<f32>::with_capacity(n);
    #[cfg(target_os = "linux")]
    if n >= 1 << 20 {
        let start = v.as_mut_ptr() as usize;
        let end = start + n * std::mem::size_of::<f32>();
        let page = 4096;
        let (lo, hi) = (start.next_multiple_of(page), end & !(page - 1));
        if hi > lo {
            // SAFETY: [lo, hi) lies inside the allocation `v` owns and is page-aligned;
            // MADV_HUGEPAGE only changes how the kernel backs those pages, never their contents,
            // and a failure is harmless (the memory stays ordinary pages).
            unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
        }
    }
    v.resize(n, 0.0);
    v
}

//! The host C++ build of `kernels/*.cuh` (see `shim/host_shim.cpp`), for tests that compare the
//! device decode maths with the Rust CPU kernels. Present when `build.rs` found a C++ compiler.
// Calling the C++ shim is FFI; each wrapper checks the buffer sizes the shim relies on.
#![allow(unsafe_code)]

use crate::cpu::kv::KvType;
use crate::error::{KernelError, Result};
use crate::types::QuantType;

unsafe extern "C" {
    fn wl_host_dequant(ty: i32, src: *const u8, dst: *mut f32, nblocks: usize) -> i32;
    fn wl_host_f32_to_f16(src: *const f32, dst: *mut u16, n: usize);
    fn wl_host_kv_quantize(x: *const f32, out: *mut u8, n_groups: usize, qmax: i32);
    fn wl_host_kv_dequantize(src: *const u8, out: *mut f32, n_groups: usize, qmax: i32);
}

/// Dequantises with the host build of `wl_dequant.cuh`.
pub fn dequantize_f32(ty: QuantType, src: &[u8], out: &mut [f32]) -> Result<()> {
    let n = ty.blocks_in("src", src.len())?;
    let expected = n * ty.block_size();
    if out.len() != expected {
        return Err(KernelError::LengthMismatch {
            what: "host dequantize output values",
            expected,
            got: out.len(),
        });
    }
    // SAFETY: src holds n whole blocks and out n * block_size floats, which is all the shim touches.
    let ok = unsafe { wl_host_dequant(ty.ggml_id() as i32, src.as_ptr(), out.as_mut_ptr(), n) };
    if ok == 0 {
        return Err(KernelError::Unsupported {
            op: "host dequantize",
            ty: ty.to_string(),
            supported: "all QuantType values",
        });
    }
    Ok(())
}

/// f32 to f16 bits with the header's `wl_f32_to_f16`.
pub fn f32_to_f16(src: &[f32], out: &mut [u16]) {
    let n = src.len().min(out.len());
    // SAFETY: both buffers hold at least n elements.
    unsafe { wl_host_f32_to_f16(src.as_ptr(), out.as_mut_ptr(), n) }
}

/// KV quantisation with `wl_kv.cuh`.
pub fn kv_quantize(kt: KvType, x: &[f32], out: &mut [u8]) -> Result<()> {
    let g = x.len() / 32;
    if !x.len().is_multiple_of(32) || out.len() != kt.bytes_for(x.len()) {
        return Err(KernelError::LengthMismatch {
            what: "host kv bytes",
            expected: kt.bytes_for(x.len()),
            got: out.len(),
        });
    }
    // SAFETY: x has g groups of 32 floats and out g groups of group_bytes.
    unsafe { wl_host_kv_quantize(x.as_ptr(), out.as_mut_ptr(), g, kt.qmax()) };
    Ok(())
}

/// KV dequantisation with `wl_kv.cuh`.
pub fn kv_dequantize(kt: KvType, src: &[u8], out: &mut [f32]) -> Result<()> {
    let g = out.len() / 32;
    if !out.len().is_multiple_of(32) || src.len() != kt.bytes_for(out.len()) {
        return Err(KernelError::LengthMismatch {
            what: "host kv bytes",
            expected: kt.bytes_for(out.len()),
            got: src.len(),
        });
    }
    // SAFETY: src has g groups of group_bytes and out g groups of 32 floats.
    unsafe { wl_host_kv_dequantize(src.as_ptr(), out.as_mut_ptr(), g, kt.qmax()) };
    Ok(())
}

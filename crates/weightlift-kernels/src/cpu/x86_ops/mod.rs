//! AVX2/FMA/F16C and AVX-512 twins of the row operations ([`ops`](super::ops)), the attention
//! fold ([`attention`](super::attention)), the KV-cache quantisers ([`kv`](super::kv)) and the
//! exact-mode matmul micro-kernels ([`matvec`](super::matvec)); the Q8-mode ones are in
//! `x86_gemm`.
//!
//! Each function has a scalar twin in those modules; tests run every level in
//! [`Isa::all_supported`](super::Isa::all_supported). The std::arch intrinsics are unsafe to
//! call: they need the CPU features that `Isa` checked at run time and raw pointers into slices
//! whose bounds each function checks first.

mod attention;
mod attention_kernels;
mod gemm_exact;
mod kv;
mod math;
mod rows;

/// Every form, under one name for the call sites.
pub(crate) mod imp {
    pub(crate) use super::attention::*;
    pub(crate) use super::gemm_exact::*;
    pub(crate) use super::kv::*;
    pub(crate) use super::rows::*;
}

//! The CUDA kernel sources, embedded at build time with their headers inlined, and the PTX
//! that nvcc produced when one was found (`build.rs`).

include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));

/// The source of module `name` (`dequant`, `matvec`, `ops`, `convert`, `kv`).
pub fn source(name: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// nvcc's PTX for module `name`, if the build had nvcc.
pub fn prebuilt_ptx(name: &str) -> Option<&'static str> {
    PTX.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

//! The one error type of this crate.

use crate::types::QuantType;

/// Everything a kernel or backend call can fail with.
///
/// Messages are lower-case, say what was expected and what was found, and name the likely
/// cause, so the engine and the Python layer can pass them on unchanged.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// CUDA cannot be used on this machine: no device, a driver call that failed at start.
    #[error("cuda is unavailable: {reason}")]
    CudaUnavailable {
        /// What was checked and failed, and what to do about it.
        reason: String,
    },
    /// A CUDA library this machine lacks, or has only in a form that does not load: libcuda
    /// (from the NVIDIA driver), libnvrtc (from a CUDA toolkit or pip).
    #[error("{library} not found: {fix}{detail}")]
    LibraryNotFound {
        /// `libcuda.so.1`, `libnvrtc`, ...
        library: String,
        /// What to install.
        fix: String,
        /// Where it was looked for, and why files found there would not load (may be empty).
        detail: String,
    },
    /// The crate was built without the `cuda` cargo feature.
    #[error(
        "weightlift-kernels was built without the `cuda` feature; rebuild with `--features cuda` to use {what}"
    )]
    NotCompiledWithCuda {
        /// What the caller asked for (a device, an operation).
        what: String,
    },
    /// A CUDA driver call failed.
    #[error("cuda driver error during {during}: {message}")]
    Cuda {
        /// The step that failed ("allocating 4096 bytes on cuda:0").
        during: String,
        /// The driver's own message.
        message: String,
    },
    /// NVRTC could not compile a kernel source (or warned about it).
    #[error("nvrtc could not compile kernel source '{source_name}' for {arch}: {log}")]
    Nvrtc {
        /// The kernel source file.
        source_name: String,
        /// The target architecture (compute_80, sm_90, ...).
        arch: String,
        /// The compiler log.
        log: String,
    },
    /// A byte buffer whose length does not fit the quantisation type.
    #[error(
        "{what}: {ty} data of {got} bytes is not a whole number of {block_bytes}-byte blocks; the tensor is truncated or has the wrong type"
    )]
    RaggedBlocks {
        /// The operand ("weights", "src").
        what: &'static str,
        /// The type of the data.
        ty: QuantType,
        /// Bytes given.
        got: usize,
        /// Bytes per block.
        block_bytes: usize,
    },
    /// Two lengths that must agree do not.
    #[error("{what}: expected {expected}, got {got}")]
    LengthMismatch {
        /// Which operand and which dimension.
        what: &'static str,
        /// What the other operands imply.
        expected: usize,
        /// What was given.
        got: usize,
    },
    /// A shape that the operation cannot take.
    #[error("invalid shape for {op}: {reason}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A type the operation does not implement.
    #[error("{op} does not support {ty}; supported: {supported}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// The type asked for.
        ty: String,
        /// The types it does support.
        supported: &'static str,
    },
    /// A buffer handed to a backend that belongs to another device.
    #[error("buffer of {got} bytes on {buffer_device} was used with backend {backend}")]
    WrongDevice {
        /// The buffer's device.
        buffer_device: String,
        /// The backend it was used with.
        backend: String,
        /// Its size.
        got: usize,
    },
    /// A device's copy stream ordered against the compute stream of another device.
    #[error(
        "the copy stream of {stream} was ordered against the compute stream of {backend}; a copy stream orders work on its own device only (use the copy stream of {backend})"
    )]
    StreamDevice {
        /// The copy stream's device.
        stream: String,
        /// The backend it was paired with.
        backend: String,
    },
    /// A rayon thread pool could not be built.
    #[error("could not start a pool of {threads} threads: {message}")]
    ThreadPool {
        /// Threads asked for.
        threads: usize,
        /// rayon's message.
        message: String,
    },
    /// An allocation the host or device could not satisfy.
    #[error("out of memory on {device}: could not allocate {bytes} bytes")]
    OutOfMemory {
        /// The device.
        device: String,
        /// The request.
        bytes: usize,
    },
}

/// Result alias for this crate.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;

//! The device runtime (cpu, virtual, cuda), the streaming loader that carries out a placement,
//! and Model, Cache and TPContext.
//!
//! - [`device`]: `cpu`, `virtual:N` (host arenas with a hard capacity: an allocation past it is an
//!   [`EngineError::OutOfMemory`] naming the device, the request and what is free) and `cuda:N`
//!   (device memory per tensor through the kernels' `CudaBackend`, capacity the driver's free
//!   memory; without a GPU or the `cuda` feature it is [`EngineError::CudaUnavailable`]). Every
//!   [`Buffer`] counts against its device until dropped. [`Inventory::detect`] is the real
//!   machine (`cpu` at MemAvailable plus every CUDA device), through [`HostProbe`], the
//!   planner's `MemoryProbe`.
//! - [`loader`]: carries out a placement tensor by tensor in layer order: zero-copy mmap views,
//!   `pread` into owned memory, or two bounded staging buffers (a reader thread fills one while
//!   the other is converted and copied to the device; on CUDA the copy goes through the kernels'
//!   two pinned buffers, queued on the device's stream with events ordering their reuse, so the
//!   DMA overlaps the next read), O_DIRECT with a buffered fallback, progress after every chunk
//!   and cancellation that frees everything.
//! - [`model`]: [`Model`] ties a checkpoint, an [`Inventory`] and a [`Placement`] (a
//!   `weightlift_plan::Plan` via [`planned`]) together, with the lazy co-located [`Cache`],
//!   split tensors (llama.cpp row split, tensor parallelism), validation and memory accounting.
//! - [`session`]: a [`Model`] as a caller keeps it between calls (the plan of its last load,
//!   its plan and sampling defaults, its last timings, closing), the state behind the Python
//!   `Model`; [`llama_cpp`] loads one as llama-cpp-python's `Llama(...)` does.
//! - [`cache`]: KV caches in fp16, fp8 (e4m3), q8, q6 and q4 with the planner's exact sizes and a
//!   documented error bound per dtype; offloaded caches prefetch the next layer on a thread.
//! - [`forward`] and [`generate`]: the forward pass where the plan put every layer, and text
//!   generation on it (tokenizer, sampler, stop strings, prompt-prefix reuse).
//! - [`embeddings`]: the final-norm hidden states pooled as llama.cpp pools them
//!   ([`Pooling`]), for llama-cpp-python's `embed` and `create_embedding`.
//! - [`tp`]: exllamav2's TPContext: split tables, collectives behind the [`Collective`] trait,
//!   per-device RoPE tables and scratch.
//!
//! Not yet: peer (GPU-to-GPU) copies and NCCL for the collectives (CUDA tensors move through host
//! memory), and reading straight into pinned memory (the reader's staging buffers are pageable;
//! each chunk is copied once more into the kernels' pinned buffers). None of the CUDA paths has
//! run on a GPU here: they are compile-checked, and their tests skip without one.

mod error;
mod hostmem;

pub mod cache;
pub mod convert;
pub mod dequantize;
pub mod device;
pub mod embeddings;
pub mod forward;
pub mod generate;
pub mod grammar;
pub mod keywords;
pub mod llama_cpp;
pub mod loader;
pub mod mlock;
pub mod model;
pub mod planned;
pub mod sample;
pub mod scan;
pub mod session;
pub mod source;
pub mod tp;
pub mod validate;

pub use cache::{Cache, CacheConfig, CacheDType};
pub use device::{Buffer, Device, DeviceKind, DeviceTensor, HostProbe, Inventory, Storage};
pub use embeddings::Pooling;
pub use error::{EngineError, Result};
pub use generate::{FinishReason, GenerateOptions, Generation, Piece, Timings};
pub use loader::{LoadOptions, Loaded, Progress, TensorTarget, load};
pub use model::{Dequantized, Held, Model, Placement, RankPlace};
pub use source::Source;
pub use tp::{Collective, HostStaged, Splits, TpContext};

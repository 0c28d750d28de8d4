//! The device runtime (cpu, virtual, cuda), the streaming loader that carries out a placement,
//! and Model, Cache and TPContext.
//!
//! - [`device`]: `cpu`, `virtual:N` (host arenas with a hard capacity: an allocation past it is an
//!   [`EngineError::OutOfMemory`] naming the device, the request and what is free) and `cuda:N`
//!   (through the kernels crate; without a GPU or the `cuda` feature it is
//!   [`EngineError::CudaUnavailable`]). Every [`Buffer`] counts against its device until dropped.
//! - [`loader`]: carries out a placement tensor by tensor in layer order: zero-copy mmap views,
//!   `pread` into owned memory, or two bounded staging buffers (a reader thread fills one while
//!   the other is converted and copied to the device), O_DIRECT with a buffered fallback,
//!   progress after every chunk and cancellation that frees everything.
//! - [`model`]: [`Model`] ties a checkpoint, an [`Inventory`] and a [`Placement`] (a
//!   `weightlift_plan::Plan` via [`planned`]) together, with the lazy co-located [`Cache`],
//!   split tensors (llama.cpp row split, tensor parallelism), validation and memory accounting.
//! - [`cache`]: KV caches in fp16, fp8 (e4m3), q8, q6 and q4 with DESIGN.md's exact sizes and a
//!   documented error bound per dtype; offloaded caches prefetch the next layer on a thread.
//! - [`tp`]: exllamav2's TPContext: split tables, collectives behind the [`Collective`] trait,
//!   per-device RoPE tables and scratch.
//!
//! Not yet: holding tensors in CUDA memory (the engine refuses `cuda:N` placements even where
//! the kernels' backend comes up), pinned staging, and peer copies.

mod error;
mod hostmem;

pub mod cache;
pub mod convert;
pub mod device;
pub mod loader;
pub mod mlock;
pub mod model;
pub mod planned;
pub mod scan;
pub mod source;
pub mod tp;
pub mod validate;

pub use cache::{Cache, CacheConfig, CacheDType};
pub use device::{Buffer, Device, DeviceKind, DeviceTensor, Inventory, Storage, parse_size};
pub use error::{EngineError, Result};
pub use loader::{LoadOptions, Loaded, Progress, TensorTarget, load};
pub use model::{Held, Model, Placement};
pub use source::Source;
pub use tp::{Collective, HostStaged, Splits, TpContext};

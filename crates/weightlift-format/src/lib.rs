//! Zero-copy, validating readers for GGUF and safetensors checkpoints, the ggml type table,
//! ModelSpec, and scalar reference dequantisation (ggml types, and GPTQ / EXL2 quantised
//! safetensors linears).
//!
//! Every file is treated as hostile: all arithmetic is checked, lengths and counts are capped,
//! and every structural check runs before any tensor view is handed out.

mod checkpoint;
mod dtype;
mod error;
mod mapped;
mod metadata;
mod spec;
mod tensor;

pub mod dequant;
pub mod gguf;
pub mod hf_config;
pub mod quantized;
pub mod safetensors;
pub mod scan;

pub use checkpoint::{Checkpoint, Format, OpenOptions, TokenizerInfo};
pub use dtype::DType;
pub use error::{FormatError, Result, hint};
pub use metadata::{LAZY_ARRAY_MIN_LEN, MetaArray, MetaIter, MetaRef, MetaValue, Metadata};
pub use quantized::{Quantization, QuantizedLinear};
pub use spec::{MAX_EXPERTS, ModelSpec, MoeSpec};
pub use spec::{expert_of, is_packed_product_part, is_quantized_part};
pub use tensor::{Role, TensorInfo};

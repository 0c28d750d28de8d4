//! The element types the kernels understand, with their ggml block layouts.
//!
//! The numeric ids are ggml's (`enum ggml_type` in llama.cpp's `ggml.h`), so the engine can
//! map a GGUF tensor type onto a [`QuantType`] without this crate depending on the format crate.

use std::fmt;

/// A weight storage type: a float type or a ggml block-quantised type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum QuantType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the top half of an f32).
    BF16,
    /// 32 values: f16 d, 16 bytes of nibbles; x = d * (q - 8).
    Q4_0,
    /// 32 values: f16 d, f16 m, 16 bytes of nibbles; x = d * q + m.
    Q4_1,
    /// 32 values: f16 d, u32 high bits, 16 bytes of nibbles; x = d * (q - 16).
    Q5_0,
    /// 32 values: f16 d, f16 m, u32 high bits, 16 bytes of nibbles; x = d * q + m.
    Q5_1,
    /// 32 values: f16 d, 32 signed bytes; x = d * q.
    Q8_0,
    /// 256 values in 16 sub-blocks of 16, 2-bit quants, 4-bit scales and mins.
    Q2_K,
    /// 256 values in 16 sub-blocks of 16, 3-bit quants, 6-bit signed scales.
    Q3_K,
    /// 256 values in 8 sub-blocks of 32, 4-bit quants, 6-bit scales and mins.
    Q4_K,
    /// 256 values in 8 sub-blocks of 32, 5-bit quants, 6-bit scales and mins.
    Q5_K,
    /// 256 values in 16 sub-blocks of 16, 6-bit quants, 8-bit signed scales.
    Q6_K,
    /// 32 values: f16 d, 16 bytes of nibbles indexing a non-linear table.
    IQ4_NL,
}

impl QuantType {
    /// Every type, in ggml id order.
    pub const ALL: [QuantType; 14] = [
        QuantType::F32,
        QuantType::F16,
        QuantType::BF16,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q2_K,
        QuantType::Q3_K,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
        QuantType::IQ4_NL,
    ];

    /// Values per block (1 for the float types).
    pub const fn block_size(self) -> usize {
        match self {
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => 1,
            QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q8_0
            | QuantType::IQ4_NL => 32,
            QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K => 256,
        }
    }

    /// Bytes per block (`sizeof(block_xxx)` in ggml-common.h).
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantType::F32 => 4,
            QuantType::F16 | QuantType::BF16 => 2,
            QuantType::Q4_0 | QuantType::IQ4_NL => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q5_0 => 22,
            QuantType::Q5_1 => 24,
            QuantType::Q8_0 => 34,
            QuantType::Q2_K => 84,
            QuantType::Q3_K => 110,
            QuantType::Q4_K => 144,
            QuantType::Q5_K => 176,
            QuantType::Q6_K => 210,
        }
    }

    /// ggml's numeric type id.
    pub const fn ggml_id(self) -> u32 {
        match self {
            QuantType::F32 => 0,
            QuantType::F16 => 1,
            QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 3,
            QuantType::Q5_0 => 6,
            QuantType::Q5_1 => 7,
            QuantType::Q8_0 => 8,
            QuantType::Q2_K => 10,
            QuantType::Q3_K => 11,
            QuantType::Q4_K => 12,
            QuantType::Q5_K => 13,
            QuantType::Q6_K => 14,
            QuantType::IQ4_NL => 20,
            QuantType::BF16 => 30,
        }
    }

    /// The type with ggml id `id`, if this crate supports it.
    pub fn from_ggml_id(id: u32) -> Option<QuantType> {
        QuantType::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// The lower-case name used in kernel names (`q4_k`, `iq4_nl`, `f16`).
    pub const fn name(self) -> &'static str {
        match self {
            QuantType::F32 => "f32",
            QuantType::F16 => "f16",
            QuantType::BF16 => "bf16",
            QuantType::Q4_0 => "q4_0",
            QuantType::Q4_1 => "q4_1",
            QuantType::Q5_0 => "q5_0",
            QuantType::Q5_1 => "q5_1",
            QuantType::Q8_0 => "q8_0",
            QuantType::Q2_K => "q2_k",
            QuantType::Q3_K => "q3_k",
            QuantType::Q4_K => "q4_k",
            QuantType::Q5_K => "q5_k",
            QuantType::Q6_K => "q6_k",
            QuantType::IQ4_NL => "iq4_nl",
        }
    }

    /// The type named `name` (case-insensitive, as [`QuantType::name`] spells it).
    pub fn from_name(name: &str) -> Option<QuantType> {
        QuantType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// The number of blocks in `bytes` bytes, or a [`KernelError::RaggedBlocks`](crate::KernelError).
    pub fn blocks_in(self, what: &'static str, bytes: usize) -> crate::Result<usize> {
        let bb = self.block_bytes();
        if !bytes.is_multiple_of(bb) {
            return Err(crate::KernelError::RaggedBlocks {
                what,
                ty: self,
                got: bytes,
                block_bytes: bb,
            });
        }
        Ok(bytes / bb)
    }
}

impl fmt::Display for QuantType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The float types an activation or output can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
}

impl FloatType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::F16 | FloatType::BF16 => 2,
        }
    }

    /// The lower-case name used in kernel names.
    pub const fn name(self) -> &'static str {
        match self {
            FloatType::F32 => "f32",
            FloatType::F16 => "f16",
            FloatType::BF16 => "bf16",
        }
    }
}

impl fmt::Display for FloatType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

//! The element types a checkpoint can hold: every ggml type id that llama.cpp defines, plus the
//! safetensors dtypes that ggml has no id for. Every type is described as blocks: `block_size`
//! elements stored in `type_size` bytes (1 and the element width for plain types).

use serde::{Deserialize, Serialize};

macro_rules! dtypes {
    ($( $variant:ident = $name:literal, ggml: $id:expr, block: $block:literal, bytes: $bytes:literal; )*) => {
        /// A tensor element type. `name()` is the spelling used by gguf-py and safetensors.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[allow(non_camel_case_types)]
        pub enum DType { $( #[serde(rename = $name)] $variant, )* }

        impl DType {
            /// Every type, in declaration order.
            pub const ALL: &'static [DType] = &[$( DType::$variant, )*];

            /// The canonical name, e.g. `"Q4_K"`, `"BF16"`, `"F8_E4M3"`.
            pub const fn name(self) -> &'static str {
                match self { $( DType::$variant => $name, )* }
            }

            /// The ggml type id (`enum ggml_type`), when ggml has one.
            pub const fn ggml_id(self) -> Option<u32> {
                match self { $( DType::$variant => $id, )* }
            }

            /// Elements per block.
            pub const fn block_size(self) -> u64 {
                match self { $( DType::$variant => $block, )* }
            }

            /// Bytes per block.
            pub const fn type_size(self) -> u64 {
                match self { $( DType::$variant => $bytes, )* }
            }
        }
    };
}

// Block sizes are ggml's (`sizeof(block_*)`). Q8_1 is 36 bytes there (two f16
// scales); gguf-py's table still lists 40, from an older layout with f32 scales.
dtypes! {
    F32 = "F32", ggml: Some(0), block: 1, bytes: 4;
    F16 = "F16", ggml: Some(1), block: 1, bytes: 2;
    Q4_0 = "Q4_0", ggml: Some(2), block: 32, bytes: 18;
    Q4_1 = "Q4_1", ggml: Some(3), block: 32, bytes: 20;
    Q5_0 = "Q5_0", ggml: Some(6), block: 32, bytes: 22;
    Q5_1 = "Q5_1", ggml: Some(7), block: 32, bytes: 24;
    Q8_0 = "Q8_0", ggml: Some(8), block: 32, bytes: 34;
    Q8_1 = "Q8_1", ggml: Some(9), block: 32, bytes: 36;
    Q2_K = "Q2_K", ggml: Some(10), block: 256, bytes: 84;
    Q3_K = "Q3_K", ggml: Some(11), block: 256, bytes: 110;
    Q4_K = "Q4_K", ggml: Some(12), block: 256, bytes: 144;
    Q5_K = "Q5_K", ggml: Some(13), block: 256, bytes: 176;
    Q6_K = "Q6_K", ggml: Some(14), block: 256, bytes: 210;
    Q8_K = "Q8_K", ggml: Some(15), block: 256, bytes: 292;
    IQ2_XXS = "IQ2_XXS", ggml: Some(16), block: 256, bytes: 66;
    IQ2_XS = "IQ2_XS", ggml: Some(17), block: 256, bytes: 74;
    IQ3_XXS = "IQ3_XXS", ggml: Some(18), block: 256, bytes: 98;
    IQ1_S = "IQ1_S", ggml: Some(19), block: 256, bytes: 50;
    IQ4_NL = "IQ4_NL", ggml: Some(20), block: 32, bytes: 18;
    IQ3_S = "IQ3_S", ggml: Some(21), block: 256, bytes: 110;
    IQ2_S = "IQ2_S", ggml: Some(22), block: 256, bytes: 82;
    IQ4_XS = "IQ4_XS", ggml: Some(23), block: 256, bytes: 136;
    I8 = "I8", ggml: Some(24), block: 1, bytes: 1;
    I16 = "I16", ggml: Some(25), block: 1, bytes: 2;
    I32 = "I32", ggml: Some(26), block: 1, bytes: 4;
    I64 = "I64", ggml: Some(27), block: 1, bytes: 8;
    F64 = "F64", ggml: Some(28), block: 1, bytes: 8;
    IQ1_M = "IQ1_M", ggml: Some(29), block: 256, bytes: 56;
    BF16 = "BF16", ggml: Some(30), block: 1, bytes: 2;
    TQ1_0 = "TQ1_0", ggml: Some(34), block: 256, bytes: 54;
    TQ2_0 = "TQ2_0", ggml: Some(35), block: 256, bytes: 66;
    MXFP4 = "MXFP4", ggml: Some(39), block: 32, bytes: 17;
    NVFP4 = "NVFP4", ggml: Some(40), block: 64, bytes: 36;
    Q1_0 = "Q1_0", ggml: Some(41), block: 128, bytes: 18;
    // safetensors-only dtypes (no ggml id). Sub-byte floats are packed: F4 two to a byte,
    // F6 four to three bytes.
    BOOL = "BOOL", ggml: None, block: 1, bytes: 1;
    U8 = "U8", ggml: None, block: 1, bytes: 1;
    U16 = "U16", ggml: None, block: 1, bytes: 2;
    U32 = "U32", ggml: None, block: 1, bytes: 4;
    U64 = "U64", ggml: None, block: 1, bytes: 8;
    F8_E4M3 = "F8_E4M3", ggml: None, block: 1, bytes: 1;
    F8_E5M2 = "F8_E5M2", ggml: None, block: 1, bytes: 1;
    F8_E8M0 = "F8_E8M0", ggml: None, block: 1, bytes: 1;
    F4 = "F4", ggml: None, block: 2, bytes: 1;
    F6_E2M3 = "F6_E2M3", ggml: None, block: 4, bytes: 3;
    F6_E3M2 = "F6_E3M2", ggml: None, block: 4, bytes: 3;
    C64 = "C64", ggml: None, block: 1, bytes: 8;
    F8_E4M3FNUZ = "F8_E4M3FNUZ", ggml: None, block: 1, bytes: 1;
    F8_E5M2FNUZ = "F8_E5M2FNUZ", ggml: None, block: 1, bytes: 1;
    // Quantised on load, never read from a file: LLM.int8 row-wise weights. The table counts
    // the quants; each row's f32 absmax follows all of them (see `DType::bytes_for_shape`).
    INT8 = "INT8", ggml: None, block: 1, bytes: 1;
}

impl DType {
    /// Look a type up by its ggml id.
    pub fn from_ggml_id(id: u32) -> Option<DType> {
        DType::ALL.iter().copied().find(|t| t.ggml_id() == Some(id))
    }

    /// Look a type up by name (case-insensitive).
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// True for block-quantised types (more than one element per block, or ggml's packed types).
    pub const fn is_quantized(self) -> bool {
        self.block_size() > 1 && self.ggml_id().is_some()
    }

    /// True for plain IEEE-style float types that can hold NaN or Inf.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::F8_E4M3 | DType::F8_E5M2
        )
    }

    /// Bytes needed for `n_elements` of this type, or `None` when `n_elements` is not a whole
    /// number of blocks or the product overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        if !n_elements.is_multiple_of(self.block_size()) {
            return None;
        }
        (n_elements / self.block_size()).checked_mul(self.type_size())
    }

    /// Bytes of a row-major tensor of `shape`: [`DType::bytes_for`] of its elements, plus, for
    /// [`DType::INT8`], one little-endian f32 scale per row stored after every quant (the
    /// layout bitsandbytes keeps as `CB` and `SCB`, in one buffer so a tensor stays one
    /// region of its device). `None` as `bytes_for`.
    pub fn bytes_for_shape(self, shape: &[u64]) -> Option<u64> {
        let n = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))?;
        let quants = self.bytes_for(n)?;
        if self != DType::INT8 {
            return Some(quants);
        }
        let cols = shape.last().copied().unwrap_or(1);
        let rows = n.checked_div(cols).unwrap_or(0);
        quants.checked_add(rows.checked_mul(4)?)
    }

    /// True for types whose values were quantised, by a file's writer or on load: the ggml
    /// block types and [`DType::INT8`].
    pub const fn holds_quants(self) -> bool {
        self.is_quantized() || matches!(self, DType::INT8)
    }

    /// numpy's name for this type, when numpy has one that reads the stored bytes exactly
    /// (little-endian, as every format here stores them).
    pub const fn numpy_name(self) -> Option<&'static str> {
        Some(match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::F64 => "float64",
            DType::I8 | DType::INT8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::BOOL => "bool",
            DType::C64 => "complex64",
            _ => return None,
        })
    }

    /// The type numpy calls `name` (`"float32"`, `"int8"`, ...).
    pub fn from_numpy_name(name: &str) -> Option<DType> {
        DType::ALL
            .iter()
            .copied()
            .find(|t| t.numpy_name() == Some(name))
    }

    /// How a tensor of this type and row-major `shape` reads as a numpy array of its stored
    /// bytes: its own dtype and shape when numpy has the type, else `uint8` rows
    /// (`shape[:-1] + [bytes per row]`), as gguf-py's reader shows quantised tensors.
    pub fn numpy_layout(self, shape: &[u64]) -> (&'static str, Vec<u64>) {
        if let Some(name) = self.numpy_name() {
            return (name, shape.to_vec());
        }
        let mut dims = shape.to_vec();
        match dims.last_mut() {
            Some(last) => *last = self.bytes_for(*last).unwrap_or(0),
            None => dims.push(self.type_size()),
        }
        ("uint8", dims)
    }

    /// The bytes of a tensor of `shape` held as `bytes` that numpy shows in
    /// [`DType::numpy_layout`]: all of them, except that an INT8 tensor reads as its quants, so
    /// the f32 row scales after them are left out.
    pub fn numpy_bytes<'a>(self, bytes: &'a [u8], shape: &[u64]) -> &'a [u8] {
        if self != DType::INT8 {
            return bytes;
        }
        let quants = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        quants
            .and_then(|n| self.bytes_for(n))
            .and_then(|b| usize::try_from(b).ok())
            .and_then(|b| bytes.get(..b))
            .unwrap_or(bytes)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_are_unique() {
        for (i, a) in DType::ALL.iter().enumerate() {
            for b in &DType::ALL[i + 1..] {
                assert_ne!(a.name(), b.name());
                if a.ggml_id().is_some() {
                    assert_ne!(a.ggml_id(), b.ggml_id());
                }
            }
        }
        assert_eq!(DType::from_ggml_id(12), Some(DType::Q4_K));
        assert_eq!(DType::from_ggml_id(4), None, "Q4_2 was removed from ggml");
        assert_eq!(DType::from_name("q6_k"), Some(DType::Q6_K));
    }

    #[test]
    fn numpy_layouts() {
        assert_eq!(DType::F16.numpy_layout(&[2, 3]), ("float16", vec![2, 3]));
        assert_eq!(DType::Q4_K.numpy_layout(&[2, 512]), ("uint8", vec![2, 288]));
        assert_eq!(DType::BF16.numpy_layout(&[4, 8]), ("uint8", vec![4, 16]));
        for t in DType::ALL {
            // INT8 reads as numpy int8 quants; "int8" names the file type I8.
            if let Some(n) = t.numpy_name().filter(|_| *t != DType::INT8) {
                assert_eq!(DType::from_numpy_name(n), Some(*t));
            }
        }
        assert_eq!(DType::from_numpy_name("float128"), None);
    }

    #[test]
    fn numpy_bytes_leave_out_int8_row_scales() {
        // two rows of three int8 quants, then a f32 scale per row
        let held: Vec<u8> = (0..14).collect();
        assert_eq!(DType::INT8.numpy_bytes(&held, &[2, 3]), &held[..6]);
        assert_eq!(DType::U8.numpy_bytes(&held, &[14]), &held[..]);
    }

    #[test]
    fn bytes_for_checks_blocks() {
        assert_eq!(DType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(DType::Q4_K.bytes_for(100), None);
        assert_eq!(DType::F4.bytes_for(6), Some(3));
        assert_eq!(DType::F32.bytes_for(u64::MAX), None);
        assert_eq!(DType::Q8_0.bytes_for_shape(&[3, 64]), Some(3 * 68));
        // 3 rows of 5 quants, then 3 f32 scales.
        assert_eq!(DType::INT8.bytes_for_shape(&[3, 5]), Some(15 + 12));
        assert_eq!(DType::INT8.bytes_for_shape(&[u64::MAX, 2]), None);
    }
}

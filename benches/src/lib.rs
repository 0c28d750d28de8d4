//! Criterion benches for weightlift; see `benches/` beside this file. This library holds what
//! the CPU and CUDA kernel benches share: the shapes, the types and the synthetic weights.

use weightlift_kernels::QuantType;

/// Weight rows × cols for dequantisation and matvec (llama-7B's attention matrices).
pub const ROWS: usize = 4096;
pub const COLS: usize = 4096;

/// Byte offsets of the f16 scales in one block (ggml's block layouts), set to a sane finite value.
fn scale_offsets(ty: QuantType) -> &'static [usize] {
    match ty {
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        QuantType::Q2_K => &[80, 82],
        QuantType::Q3_K => &[108],
        QuantType::Q6_K => &[208],
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => &[],
        _ => &[0],
    }
}

/// `n_values` values of random blocks of `ty`, with finite, moderate scales.
pub fn random_weights(ty: QuantType, n_values: usize) -> Vec<u8> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let n = n_values / ty.block_size() * ty.block_bytes();
    let mut v: Vec<u8> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect();
    if ty == QuantType::F16 || ty == QuantType::BF16 {
        for c in v.chunks_exact_mut(2) {
            c[1] &= 0x3f; // finite, moderate values
        }
    }
    for blk in v.chunks_exact_mut(ty.block_bytes()) {
        for &o in scale_offsets(ty) {
            blk[o..o + 2].copy_from_slice(&0x2000u16.to_le_bytes());
        }
    }
    v
}

/// The types dequantised, in the order the results tables list them.
pub const DEQUANT_TYPES: [QuantType; 13] = [
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
    QuantType::F16,
    QuantType::BF16,
];

/// The weight types of the matrix–vector and matrix–matrix products on every backend.
pub const PRODUCT_TYPES: [QuantType; 5] = [
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q8_0,
    QuantType::Q4_K,
    QuantType::Q6_K,
];

/// Product weight types only the CPU backend has (exact and Q8 mode); the CUDA bench leaves
/// them out.
pub const CPU_ONLY_PRODUCT_TYPES: [QuantType; 4] = [
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q2_K,
    QuantType::Q3_K,
];

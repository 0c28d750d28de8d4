//! Reading packed quantised data: little-endian words at any alignment (safetensors packs
//! tensors back to back, so an int32 tensor may start at any byte), and codes laid out as a
//! little-endian bit stream along one axis of a word matrix, the layout GPTQ (auto-gptq,
//! gptqmodel) and EXL2 (exllamav2's `pack_columns`) share for every width: code `n` of a
//! stream occupies bits `n * bits .. (n + 1) * bits`, so 3-, 5- and 6-bit codes straddle words.

use half::{bf16, f16};

use crate::DType;

/// A row-major matrix of little-endian u32 words over borrowed bytes. The caller checks that
/// `bytes` holds `rows * cols` words; reads past the end give 0 rather than a panic.
#[derive(Clone, Copy)]
pub(super) struct Words<'a> {
    bytes: &'a [u8],
    cols: usize,
}

impl<'a> Words<'a> {
    pub(super) fn new(bytes: &'a [u8], cols: usize) -> Words<'a> {
        Words { bytes, cols }
    }

    #[inline]
    pub(super) fn at(&self, row: usize, col: usize) -> u32 {
        let i = (row * self.cols + col) * 4;
        match self.bytes.get(i..i + 4) {
            Some(b) => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            None => 0,
        }
    }

    /// Code `n` of the bit stream that runs down column `col` from word row `first_row`.
    #[inline]
    pub(super) fn code_down(&self, col: usize, first_row: usize, n: usize, bits: u32) -> u32 {
        let bit = n * bits as usize;
        let (row, shift) = (first_row + bit / 32, (bit % 32) as u32);
        let mut v = self.at(row, col) >> shift;
        if shift + bits > 32 {
            v |= self.at(row + 1, col) << (32 - shift);
        }
        v & mask(bits)
    }

    /// Code `n` of the bit stream that runs along word row `row`.
    #[inline]
    pub(super) fn code_along(&self, row: usize, n: usize, bits: u32) -> u32 {
        let bit = n * bits as usize;
        let (col, shift) = (bit / 32, (bit % 32) as u32);
        let mut v = self.at(row, col) >> shift;
        if shift + bits > 32 {
            v |= self.at(row, col + 1) << (32 - shift);
        }
        v & mask(bits)
    }
}

#[inline]
pub(super) const fn mask(bits: u32) -> u32 {
    (1u32 << bits) - 1
}

/// Words needed for `n` codes of `bits` bits.
pub(super) fn words_for(n: usize, bits: u32) -> Option<usize> {
    Some(n.checked_mul(bits as usize)?.div_ceil(32))
}

/// Element `i` of a float tensor (f16, bf16 or f32) as f32; 0 past the end.
#[inline]
pub(super) fn float_at(bytes: &[u8], dtype: DType, i: usize) -> f32 {
    match dtype {
        DType::F32 => bytes
            .get(i * 4..i * 4 + 4)
            .map_or(0.0, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::BF16 => bytes
            .get(i * 2..i * 2 + 2)
            .map_or(0.0, |b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        _ => bytes
            .get(i * 2..i * 2 + 2)
            .map_or(0.0, |b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
    }
}

/// The little-endian i32 values of a tensor.
pub(super) fn i32_values(bytes: &[u8]) -> impl Iterator<Item = i32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pack codes as a little-endian bit stream, written out bit by bit so it shares no code
    /// with the reader.
    fn pack_bits(codes: &[u32], bits: u32) -> Vec<u32> {
        let mut words = vec![0u32; words_for(codes.len(), bits).unwrap()];
        for (n, &c) in codes.iter().enumerate() {
            for b in 0..bits as usize {
                if c >> b & 1 == 1 {
                    let bit = n * bits as usize + b;
                    words[bit / 32] |= 1 << (bit % 32);
                }
            }
        }
        words
    }

    #[test]
    fn streams_straddle_words_for_every_width() {
        for bits in [2u32, 3, 4, 5, 6, 8] {
            let codes: Vec<u32> = (0..96u32).map(|i| (i * 7 + 3) & mask(bits)).collect();
            let words = pack_bits(&codes, bits);
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            // Along a row.
            let row = Words::new(&bytes, words.len());
            // Down a column: the same words, one per row, in a 1-column matrix.
            let col = Words::new(&bytes, 1);
            for (n, &c) in codes.iter().enumerate() {
                assert_eq!(row.code_along(0, n, bits), c, "bits {bits} code {n}");
                assert_eq!(col.code_down(0, 0, n, bits), c, "bits {bits} code {n}");
            }
        }
    }

    #[test]
    fn reads_past_the_end_are_zero() {
        let w = Words::new(&[1, 0, 0, 0, 2], 1);
        assert_eq!(w.at(0, 0), 1);
        assert_eq!(w.at(1, 0), 0);
        assert_eq!(float_at(&[0, 0x3c], DType::F16, 0), 1.0);
        assert_eq!(float_at(&[0, 0x3c], DType::F16, 1), 0.0);
    }
}

//! `check_tensors`: a multi-threaded NaN/Inf scan.
//!
//! - Float tensors (F32, F16, BF16, F64, F8_E5M2, F8_E4M3) have every value checked.
//! - Block-quantised tensors have their scale fields checked, at ggml's block offsets: the f16 `d`
//!   (and `dmin`/`m`/`s` where the block has one) of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1,
//!   Q2_K..Q6_K, the IQ types and TQ1_0/TQ2_0; the f32 `d` of Q8_K; and IQ1_M's f16 scale,
//!   which is spread over the top nibbles of its four scale words. The quantised values
//!   themselves are small integers and cannot be non-finite.
//! - MXFP4 (E8M0 scale), NVFP4 (UE4M3 scales), Q1_0 and types without NaN (integers) are not
//!   scanned: ggml decodes every one of their bit patterns to a finite number.
//!
//! The work is split into chunks scanned in parallel with rayon; `find_map_first` keeps the
//! answer the first bad value in memory order, whatever thread finds it. The inner loops OR
//! together `word & exponent_mask == exponent_mask` over runs of words, which the compiler
//! vectorises; only a run that contains a non-finite value is re-read element by element.

use rayon::prelude::*;

use crate::DType;

/// The first non-finite value found in a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NonFinite {
    /// Element index of the first bad value; for quantised types, the first element of the
    /// first block whose scale is bad.
    pub index: u64,
    /// `"nan"` or `"inf"`.
    pub kind: &'static str,
}

/// Bytes scanned per parallel task: large enough to amortise scheduling, small enough to
/// spread a single tensor over every core.
const CHUNK_BYTES: usize = 1 << 20;
/// Words reduced before testing for a hit, in the vectorised inner loop.
const RUN: usize = 512;

/// Whether [`find_non_finite`] looks inside tensors of this type.
pub fn scans(dtype: DType) -> bool {
    float_format(dtype).is_some() || scale_fields(dtype).is_some()
}

/// The first NaN or Inf in `data`, a tensor of `dtype`, or `None` when every checked value is
/// finite (or the type has nothing to check). A trailing partial element or block is ignored.
pub fn find_non_finite(dtype: DType, data: &[u8]) -> Option<NonFinite> {
    if let Some(f) = float_format(dtype) {
        let elems_per_chunk = CHUNK_BYTES / f.width;
        return data
            .par_chunks(elems_per_chunk * f.width)
            .enumerate()
            .find_map_first(|(c, chunk)| {
                f.scan(chunk).map(|(i, kind)| NonFinite {
                    index: (c * elems_per_chunk + i) as u64,
                    kind,
                })
            });
    }
    let fields = scale_fields(dtype)?;
    let ts = dtype.type_size() as usize;
    let bs = dtype.block_size();
    let blocks_per_chunk = (CHUNK_BYTES / ts).max(1);
    data.par_chunks(blocks_per_chunk * ts)
        .enumerate()
        .find_map_first(|(c, chunk)| {
            fields.scan(chunk, ts).map(|(b, kind)| NonFinite {
                index: (c * blocks_per_chunk + b) as u64 * bs,
                kind,
            })
        })
}

/// Scan many tensors; returns the name of the first (in the order given) that holds a
/// non-finite value, with where. Tensors are scanned in parallel, and each one in parallel
/// chunks.
pub fn check_tensors<S: AsRef<str> + Sync>(
    tensors: &[(S, DType, &[u8])],
) -> Option<(String, NonFinite)> {
    tensors.par_iter().find_map_first(|(name, dtype, data)| {
        find_non_finite(*dtype, data).map(|nf| (name.as_ref().to_owned(), nf))
    })
}

/// An IEEE-style float encoding: a value is non-finite when all of `exp` is set, and a NaN
/// when, in addition, any of `mant` is set, or always when `nan_only` (formats whose only
/// non-finite pattern is a NaN, such as E4M3).
#[derive(Clone, Copy)]
struct FloatFormat {
    width: usize,
    exp: u64,
    mant: u64,
    nan_only: bool,
}

fn float_format(dtype: DType) -> Option<FloatFormat> {
    let f = |width, exp, mant| FloatFormat {
        width,
        exp,
        mant,
        nan_only: false,
    };
    Some(match dtype {
        DType::F32 => f(4, 0x7f80_0000, 0x007f_ffff),
        DType::F16 => f(2, 0x7c00, 0x03ff),
        DType::BF16 => f(2, 0x7f80, 0x007f),
        DType::F64 => f(8, 0x7ff0_0000_0000_0000, 0x000f_ffff_ffff_ffff),
        DType::F8_E5M2 => f(1, 0x7c, 0x03),
        // E4M3 (the "fn" variant safetensors uses) has no infinity: only S.1111.111 is NaN.
        DType::F8_E4M3 => FloatFormat {
            width: 1,
            exp: 0x7f,
            mant: 0,
            nan_only: true,
        },
        _ => return None,
    })
}

macro_rules! scan_words {
    ($name:ident, $t:ty) => {
        /// Index and kind of the first non-finite word in `data`.
        fn $name(data: &[u8], exp: $t, mant: $t, nan_only: bool) -> Option<(usize, &'static str)> {
            const W: usize = std::mem::size_of::<$t>();
            let load = |c: &[u8]| {
                let mut a = [0u8; W];
                a.copy_from_slice(c);
                <$t>::from_le_bytes(a)
            };
            for (r, run) in data.chunks(RUN * W).enumerate() {
                // Vectorised (SSE2 suffices: and, compare-equal, or): does any value in the
                // run have every exponent bit set?
                let hit = run
                    .chunks_exact(W)
                    .fold(0 as $t, |acc, c| acc | <$t>::from(load(c) & exp == exp));
                if hit == 0 {
                    continue;
                }
                for (i, c) in run.chunks_exact(W).enumerate() {
                    let v = load(c);
                    if v & exp == exp {
                        let kind = if nan_only || v & mant != 0 {
                            "nan"
                        } else {
                            "inf"
                        };
                        return Some((r * RUN + i, kind));
                    }
                }
            }
            None
        }
    };
}

scan_words!(scan_u8, u8);
scan_words!(scan_u16, u16);
scan_words!(scan_u32, u32);
scan_words!(scan_u64, u64);

impl FloatFormat {
    fn scan(&self, data: &[u8]) -> Option<(usize, &'static str)> {
        let (e, m, n) = (self.exp, self.mant, self.nan_only);
        // The masks were built for their width, so the narrowing casts are exact.
        match self.width {
            1 => scan_u8(data, e as u8, m as u8, n),
            2 => scan_u16(data, e as u16, m as u16, n),
            4 => scan_u32(data, e as u32, m as u32, n),
            _ => scan_u64(data, e, m, n),
        }
    }
}

/// Where a quantised block keeps its scales.
#[derive(Clone, Copy)]
enum ScaleFields {
    /// One f16 field at this byte offset within the block.
    F16(usize),
    /// Two f16 fields (`d` and `dmin`/`m`/`s`).
    F16Pair(usize, usize),
    /// One f32 field at this byte offset.
    F32(usize),
    /// IQ1_M: the f16 scale is the top nibbles of the four u16 words at byte 48.
    Iq1m,
}

fn scale_fields(dtype: DType) -> Option<ScaleFields> {
    use DType::*;
    use ScaleFields::{F16, F16Pair};
    Some(match dtype {
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL => F16(0),
        Q4_1 | Q5_1 | Q8_1 | Q4_K | Q5_K => F16Pair(0, 2),
        Q2_K => F16Pair(80, 82),
        Q3_K => F16(108),
        Q6_K => F16(208),
        IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ1_S | IQ4_XS => F16(0),
        TQ1_0 => F16(52),
        TQ2_0 => F16(64),
        Q8_K => ScaleFields::F32(0),
        IQ1_M => ScaleFields::Iq1m,
        _ => return None,
    })
}

const F16_EXP: u16 = 0x7c00;
const F32_EXP: u32 = 0x7f80_0000;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn f32_bits_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn iq1m_scale_bits(b: &[u8]) -> u16 {
    let sc = [u16_at(b, 48), u16_at(b, 50), u16_at(b, 52), u16_at(b, 54)];
    (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000)
}

fn f16_kind(bits: u16) -> Option<&'static str> {
    if bits & F16_EXP != F16_EXP {
        None
    } else if bits & 0x03ff != 0 {
        Some("nan")
    } else {
        Some("inf")
    }
}

/// Block index and kind of the first block in `data` for which `bad` holds. `bad` is a
/// branch-free test, reduced over runs of blocks; `kind` classifies the block it flags.
fn scan_blocks(
    data: &[u8],
    ts: usize,
    bad: impl Fn(&[u8]) -> bool,
    kind: impl Fn(&[u8]) -> Option<&'static str>,
) -> Option<(usize, &'static str)> {
    for (r, run) in data.chunks(RUN * ts).enumerate() {
        if !run.chunks_exact(ts).fold(false, |acc, b| acc | bad(b)) {
            continue;
        }
        for (i, b) in run.chunks_exact(ts).enumerate() {
            if let Some(k) = kind(b) {
                return Some((r * RUN + i, k));
            }
        }
    }
    None
}

impl ScaleFields {
    fn scan(self, data: &[u8], ts: usize) -> Option<(usize, &'static str)> {
        let f16_bad = |bits: u16| bits & F16_EXP == F16_EXP;
        match self {
            ScaleFields::F16(a) => scan_blocks(
                data,
                ts,
                |b| f16_bad(u16_at(b, a)),
                |b| f16_kind(u16_at(b, a)),
            ),
            ScaleFields::F16Pair(a, c) => scan_blocks(
                data,
                ts,
                |b| f16_bad(u16_at(b, a)) | f16_bad(u16_at(b, c)),
                |b| f16_kind(u16_at(b, a)).or_else(|| f16_kind(u16_at(b, c))),
            ),
            ScaleFields::F32(a) => scan_blocks(
                data,
                ts,
                |b| f32_bits_at(b, a) & F32_EXP == F32_EXP,
                |b| {
                    let v = f32::from_bits(f32_bits_at(b, a));
                    if v.is_nan() {
                        Some("nan")
                    } else if v.is_infinite() {
                        Some("inf")
                    } else {
                        None
                    }
                },
            ),
            ScaleFields::Iq1m => scan_blocks(
                data,
                ts,
                |b| f16_bad(iq1m_scale_bits(b)),
                |b| f16_kind(iq1m_scale_bits(b)),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn finds_the_first_bad_value_across_chunks() {
        let n = 3 * CHUNK_BYTES / 4 + 77;
        let mut v = vec![1.5f32; n];
        assert_eq!(find_non_finite(DType::F32, &f32_bytes(&v)), None);
        v[n - 3] = f32::NAN;
        v[CHUNK_BYTES / 4 + 5] = f32::NEG_INFINITY;
        let got = find_non_finite(DType::F32, &f32_bytes(&v)).unwrap();
        assert_eq!(
            got,
            NonFinite {
                index: (CHUNK_BYTES / 4 + 5) as u64,
                kind: "inf"
            }
        );
    }

    #[test]
    fn half_types_and_scales() {
        let h: Vec<u8> = [1.0f32, 2.0, f32::NAN]
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect();
        assert_eq!(find_non_finite(DType::F16, &h).unwrap().index, 2);
        let b: Vec<u8> = [1.0f32, f32::INFINITY]
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect();
        assert_eq!(
            find_non_finite(DType::BF16, &b),
            Some(NonFinite {
                index: 1,
                kind: "inf"
            })
        );
        // Q4_K: two blocks, the second with dmin = -inf.
        let mut q = vec![0u8; 2 * 144];
        q[144 + 2..144 + 4].copy_from_slice(&half::f16::NEG_INFINITY.to_le_bytes());
        assert_eq!(
            find_non_finite(DType::Q4_K, &q),
            Some(NonFinite {
                index: 256,
                kind: "inf"
            })
        );
    }

    #[test]
    fn other_scale_layouts_and_types() {
        // Q8_K: f32 d at byte 0 of each 292-byte block.
        let mut q = vec![0u8; 3 * 292];
        q[2 * 292..2 * 292 + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        assert_eq!(
            find_non_finite(DType::Q8_K, &q),
            Some(NonFinite {
                index: 512,
                kind: "nan"
            })
        );
        // IQ1_M: the f16 scale is spread over the top nibbles of four u16 words.
        let mut q = vec![0u8; 2 * 56];
        let inf = half::f16::INFINITY.to_bits(); // 0x7c00: nibbles 0, 0, c, 7
        for (k, word) in [0u16, 0, 0xc000, 0x7000].iter().enumerate() {
            q[56 + 48 + 2 * k..56 + 50 + 2 * k].copy_from_slice(&word.to_le_bytes());
        }
        assert_eq!(inf, 0x7c00);
        assert_eq!(
            find_non_finite(DType::IQ1_M, &q),
            Some(NonFinite {
                index: 256,
                kind: "inf"
            })
        );
        // Q2_K keeps d and dmin at the end of the block.
        let mut q = vec![0u8; 84];
        q[82..84].copy_from_slice(&half::f16::NAN.to_le_bytes());
        assert_eq!(
            find_non_finite(DType::Q2_K, &q).map(|n| n.kind),
            Some("nan")
        );
        // F64, E5M2, E4M3.
        let d: Vec<u8> = [0.0f64, f64::NEG_INFINITY]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            find_non_finite(DType::F64, &d),
            Some(NonFinite {
                index: 1,
                kind: "inf"
            })
        );
        assert_eq!(
            find_non_finite(DType::F8_E5M2, &[0x3c, 0x7c]).map(|n| n.kind),
            Some("inf")
        );
        assert_eq!(
            find_non_finite(DType::F8_E5M2, &[0xfd]).map(|n| n.kind),
            Some("nan")
        );
        assert_eq!(
            find_non_finite(DType::F8_E4M3, &[0x7e, 0x7f]).map(|n| n.index),
            Some(1)
        );
        // Types without non-finite encodings are not scanned.
        assert!(!scans(DType::I32) && !scans(DType::MXFP4));
        assert_eq!(find_non_finite(DType::I32, &[0xff; 8]), None);
    }

    #[test]
    fn check_tensors_reports_the_first_bad_tensor_in_order() {
        let good = f32_bytes(&[1.0; 64]);
        let bad1 = f32_bytes(&[1.0, f32::INFINITY]);
        let bad2 = f32_bytes(&[f32::NAN]);
        let list = [
            ("a", DType::F32, &good[..]),
            ("b", DType::F32, &bad1[..]),
            ("c", DType::F32, &bad2[..]),
        ];
        assert_eq!(
            check_tensors(&list),
            Some((
                "b".to_string(),
                NonFinite {
                    index: 1,
                    kind: "inf"
                }
            ))
        );
        assert_eq!(check_tensors(&list[..1]), None);
    }
}

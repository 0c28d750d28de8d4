//! Scalar reference dequantisation to f32: the oracle for the fast kernels.
//!
//! Written for clarity, one function per block layout. The layouts are ggml's block structs,
//! and the arithmetic follows gguf-py 0.19.0's `gguf.quants.dequantize`
//! operation for operation in f32, so results are bit-identical to it for every type it
//! supports: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ2_XXS, IQ2_XS, IQ2_S,
//! IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4 and NVFP4.
//!
//! Conveniences beyond gguf-py: F64 (rounded to f32), the integer types I8..I64 (converted with
//! `as f32`) and Q8_K (ggml's `dequantize_row_q8_K`: an f32 scale times int8 values).
//!
//! The IQ codebooks are generated from gguf-py by `tests/gen_iq_tables.py` into
//! `dequant/iq_grids.rs`.

use half::f16;

use crate::{DType, FormatError};

#[rustfmt::skip]
mod iq_grids;

use iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
    KVALUES_IQ4NL, KVALUES_MXFP4,
};

/// ggml's super-block size for the K and IQ types.
const QK_K: usize = 256;
/// ggml's `IQ1S_DELTA`: the offset IQ1_S and IQ1_M add to every grid value.
const IQ1S_DELTA: f32 = 0.125;

/// Whether [`dequantize_into`] can decode this type.
pub fn supports(dtype: DType) -> bool {
    use DType::*;
    matches!(
        dtype,
        F32 | F16
            | BF16
            | F64
            | I8
            | I16
            | I32
            | I64
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_K
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | IQ2_XXS
            | IQ2_XS
            | IQ2_S
            | IQ3_XXS
            | IQ3_S
            | IQ1_S
            | IQ1_M
            | IQ4_NL
            | IQ4_XS
            | TQ1_0
            | TQ2_0
            | MXFP4
            | NVFP4
    )
}

/// Dequantise `data`, which must hold exactly `out.len()` elements of `dtype`, into `out`.
pub fn dequantize_into(dtype: DType, data: &[u8], out: &mut [f32]) -> Result<(), FormatError> {
    let err = |detail: String| FormatError::DequantizeBlocks { dtype, detail };
    if !supports(dtype) {
        return Err(err(
            "the reference dequantiser does not support this type (gguf-py cannot dequantise it either)"
                .into(),
        ));
    }
    let n = out.len() as u64;
    let Some(need) = dtype.bytes_for(n) else {
        return Err(err(format!(
            "expected a multiple of the block size {} elements, got {n}",
            dtype.block_size()
        )));
    };
    if need != data.len() as u64 {
        return Err(err(format!(
            "expected {need} bytes for {n} elements, got {} bytes",
            data.len()
        )));
    }
    decode(dtype, data, out);
    Ok(())
}

/// Dequantise a whole buffer of `dtype` blocks into a new vector.
pub fn dequantize(dtype: DType, data: &[u8]) -> Result<Vec<f32>, FormatError> {
    let ts = dtype.type_size() as usize;
    if !data.len().is_multiple_of(ts) {
        return Err(FormatError::DequantizeBlocks {
            dtype,
            detail: format!(
                "expected a multiple of {ts} bytes (one block), got {} bytes",
                data.len()
            ),
        });
    }
    if !supports(dtype) {
        // Let dequantize_into produce the message, without allocating.
        return dequantize_into(dtype, data, &mut []).map(|()| Vec::new());
    }
    let mut out = vec![0f32; data.len() / ts * dtype.block_size() as usize];
    dequantize_into(dtype, data, &mut out)?;
    Ok(out)
}

/// Run `f` over every (block bytes, block output) pair. Sizes were checked by the caller.
fn blocks(
    data: &[u8],
    out: &mut [f32],
    type_size: usize,
    block_size: usize,
    f: impl Fn(&[u8], &mut [f32]),
) {
    for (b, y) in data
        .chunks_exact(type_size)
        .zip(out.chunks_exact_mut(block_size))
    {
        f(b, y);
    }
}

fn decode(dtype: DType, data: &[u8], out: &mut [f32]) {
    let ts = dtype.type_size() as usize;
    let bs = dtype.block_size() as usize;
    let run = |f: fn(&[u8], &mut [f32]), out: &mut [f32]| blocks(data, out, ts, bs, f);
    match dtype {
        DType::F32 => blocks(data, out, 4, 1, |b, y| y[0] = f32::from_le_bytes(arr(b, 0))),
        DType::F16 => blocks(data, out, 2, 1, |b, y| y[0] = f16_at(b, 0)),
        DType::BF16 => blocks(data, out, 2, 1, |b, y| {
            y[0] = f32::from_bits(u32::from(u16::from_le_bytes(arr(b, 0))) << 16)
        }),
        DType::F64 => blocks(data, out, 8, 1, |b, y| {
            y[0] = f64::from_le_bytes(arr(b, 0)) as f32
        }),
        DType::I8 => blocks(data, out, 1, 1, |b, y| y[0] = f32::from(b[0] as i8)),
        DType::I16 => blocks(data, out, 2, 1, |b, y| {
            y[0] = f32::from(i16::from_le_bytes(arr(b, 0)))
        }),
        DType::I32 => blocks(data, out, 4, 1, |b, y| {
            y[0] = i32::from_le_bytes(arr(b, 0)) as f32
        }),
        DType::I64 => blocks(data, out, 8, 1, |b, y| {
            y[0] = i64::from_le_bytes(arr(b, 0)) as f32
        }),
        DType::Q4_0 => run(q4_0, out),
        DType::Q4_1 => run(q4_1, out),
        DType::Q5_0 => run(q5_0, out),
        DType::Q5_1 => run(q5_1, out),
        DType::Q8_0 => run(q8_0, out),
        DType::Q8_K => run(q8_k, out),
        DType::Q2_K => run(q2_k, out),
        DType::Q3_K => run(q3_k, out),
        DType::Q4_K => run(q4_k, out),
        DType::Q5_K => run(q5_k, out),
        DType::Q6_K => run(q6_k, out),
        DType::TQ1_0 => run(tq1_0, out),
        DType::TQ2_0 => run(tq2_0, out),
        DType::IQ4_NL => run(iq4_nl, out),
        DType::IQ4_XS => run(iq4_xs, out),
        DType::MXFP4 => run(mxfp4, out),
        DType::NVFP4 => run(nvfp4, out),
        DType::IQ2_XXS => run(iq2_xxs, out),
        DType::IQ2_XS => run(iq2_xs, out),
        DType::IQ2_S => run(iq2_s, out),
        DType::IQ3_XXS => run(iq3_xxs, out),
        DType::IQ3_S => run(iq3_s, out),
        DType::IQ1_S => run(iq1_s, out),
        DType::IQ1_M => run(iq1_m, out),
        // `supports` was checked by the caller; nothing else reaches here.
        _ => {}
    }
}

// ---- byte helpers (offsets are within a block of known size) ----

fn arr<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[at..at + N]);
    a
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes(arr(b, at)).to_f32()
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(arr(b, at))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(arr(b, at))
}

// ---- the 32-element types ----

/// `block_q4_0`: d f16, qs[16] (low nibbles are elements 0..16, high nibbles 16..32).
/// x = d × (q − 8).
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * (f32::from(qs[j] & 0x0f) - 8.0);
        y[j + 16] = d * (f32::from(qs[j] >> 4) - 8.0);
    }
}

/// `block_q4_1`: d f16, m f16, qs[16]. x = d × q + m.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = d * f32::from(qs[j] & 0x0f) + m;
        y[j + 16] = d * f32::from(qs[j] >> 4) + m;
    }
}

/// The 5-bit value of element `j` of a Q5 block: a nibble of `qs` plus bit `j` of `qh`.
fn q5_value(qs: &[u8], qh: u32, j: usize) -> u8 {
    let nibble = if j < 16 {
        qs[j] & 0x0f
    } else {
        qs[j - 16] >> 4
    };
    nibble | ((((qh >> j) & 1) as u8) << 4)
}

/// `block_q5_0`: d f16, qh u32 (the fifth bits), qs[16]. x = d × (q − 16).
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32_at(b, 2);
    let qs = &b[6..22];
    for (j, v) in y.iter_mut().enumerate() {
        *v = d * (f32::from(q5_value(qs, qh, j)) - 16.0);
    }
}

/// `block_q5_1`: d f16, m f16, qh u32, qs[16]. x = d × q + m.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32_at(b, 4);
    let qs = &b[8..24];
    for (j, v) in y.iter_mut().enumerate() {
        *v = d * f32::from(q5_value(qs, qh, j)) + m;
    }
}

/// `block_q8_0`: d f16, qs int8[32]. x = q × d.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[2..34]) {
        *v = f32::from(q as i8) * d;
    }
}

/// `block_iq4_nl`: d f16, qs[16] of 4-bit indices into the non-linear `kvalues_iq4nl`.
fn iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * f32::from(KVALUES_IQ4NL[usize::from(qs[j] & 0x0f)]);
        y[j + 16] = d * f32::from(KVALUES_IQ4NL[usize::from(qs[j] >> 4)]);
    }
}

/// An E8M0 exponent as f32, halved (ggml's `ggml_e8m0_to_fp32_half`), to pair with the
/// doubled E2M1 values of `kvalues_mxfp4`.
fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// `block_mxfp4`: e (E8M0 scale), qs[16] of E2M1 codes. x = scale/2 × kvalues_mxfp4[q].
fn mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_to_f32_half(b[0]);
    let qs = &b[1..17];
    for j in 0..16 {
        y[j] = d * f32::from(KVALUES_MXFP4[usize::from(qs[j] & 0x0f)]);
        y[j + 16] = d * f32::from(KVALUES_MXFP4[usize::from(qs[j] >> 4)]);
    }
}

/// An unsigned E4M3 scale (bias 7) as f32, halved for the doubled `kvalues_mxfp4`; 0x00 and
/// 0x7f decode to 0 (gguf-py's `NVFP4.ue4m3_to_fp32`).
fn ue4m3_to_f32_half(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let exp = i32::from((x >> 3) & 0x0f);
    let man = f32::from(x & 0x07);
    let raw = if exp == 0 {
        man * (2f32).powi(-9)
    } else {
        (1.0 + man / 8.0) * (2f32).powi(exp - 7)
    };
    raw * 0.5
}

/// `block_nvfp4` (64 elements): d[4] UE4M3 scales, one per 16 elements, then qs[32]; each
/// 16-element group takes 8 bytes, low nibbles first.
fn nvfp4(b: &[u8], y: &mut [f32]) {
    for s in 0..4 {
        let d = ue4m3_to_f32_half(b[s]);
        let qs = &b[4 + 8 * s..4 + 8 * s + 8];
        let ys = &mut y[16 * s..16 * s + 16];
        for j in 0..8 {
            ys[j] = d * f32::from(KVALUES_MXFP4[usize::from(qs[j] & 0x0f)]);
            ys[j + 8] = d * f32::from(KVALUES_MXFP4[usize::from(qs[j] >> 4)]);
        }
    }
}

// ---- K-quants (256-element super-blocks) ----

/// `block_q8_K`: d f32, qs int8[256], bsums int16[16] (unused here). x = d × q.
fn q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes(arr(b, 0));
    for (v, &q) in y.iter_mut().zip(&b[4..4 + QK_K]) {
        *v = d * f32::from(q as i8);
    }
}

/// `block_q2_K`: scales[16] (low nibble scale, high nibble min, one pair per 16 elements),
/// qs[64] (2-bit values), d f16, dmin f16. x = d·sc × q − dmin·m.
///
/// Element e takes bits 2·((e mod 128) / 32) of `qs[32·(e / 128) + e mod 32]`.
fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for (e, v) in y.iter_mut().enumerate() {
        let sc = scales[e / 16];
        let dl = d * f32::from(sc & 0x0f);
        let ml = dmin * f32::from(sc >> 4);
        let shift = 2 * ((e % 128) / 32);
        let q = (qs[32 * (e / 128) + e % 32] >> shift) & 3;
        *v = dl * f32::from(q) - ml;
    }
}

/// `block_q3_K`: hmask[32] (high bits), qs[64] (low 2 bits), scales[12] (16 6-bit scales),
/// d f16. x = d·(sc − 32) × (q − 4·!hbit).
fn q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let sc = &b[96..108];
    let d = f16_at(b, 108);
    // Scale i: low 4 bits from byte i mod 8 (low nibble for i < 8, high for i ≥ 8), high 2
    // bits from byte 8 + i mod 4, at bit 2·(i / 4).
    let scale = |i: usize| -> f32 {
        let low = (sc[i % 8] >> (4 * (i / 8))) & 0x0f;
        let high = (sc[8 + i % 4] >> (2 * (i / 4))) & 0x03;
        f32::from((low | (high << 4)) as i8 - 32)
    };
    for (e, v) in y.iter_mut().enumerate() {
        let dl = d * scale(e / 16);
        let low = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        let hbit = (hmask[e % 32] >> (e / 32)) & 1;
        let q = low as i8 - if hbit == 0 { 4 } else { 0 };
        *v = dl * f32::from(q);
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of Q4_K/Q5_K (`get_scale_min_k4`).
fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 0x3f, s[j + 4] & 0x3f)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// `block_q4_K`: d f16, dmin f16, scales[12] (8 6-bit scale/min pairs), qs[128]. Sub-block j
/// (32 elements) uses the low (j even) or high (j odd) nibbles of `qs[32·(j/2)..][..32]`.
/// x = d·sc × q − dmin·m.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (j, ys) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(scales, j);
        let dl = d * f32::from(sc);
        let ml = dmin * f32::from(m);
        for (l, v) in ys.iter_mut().enumerate() {
            let q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f;
            *v = dl * f32::from(q) - ml;
        }
    }
}

/// `block_q5_K`: as Q4_K plus qh[32], whose bit j is the fifth bit of sub-block j.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (j, ys) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(scales, j);
        let dl = d * f32::from(sc);
        let ml = dmin * f32::from(m);
        for (l, v) in ys.iter_mut().enumerate() {
            let low = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f;
            let high = (qh[l] >> j) & 1;
            *v = dl * f32::from(low | (high << 4)) - ml;
        }
    }
}

/// `block_q6_K`: ql[128] (low 4 bits), qh[64] (high 2 bits), scales int8[16], d f16.
/// x = d·sc × (q − 32). Within each half h of 128 elements, element r takes nibble r / 64
/// of `ql[64h + r mod 64]` and bits 2·(r / 32) of `qh[32h + r mod 32]`.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = f16_at(b, 208);
    for (e, v) in y.iter_mut().enumerate() {
        let (h, r) = (e / 128, e % 128);
        let low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0f;
        let high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
        let q = (low | (high << 4)) as i8 - 32;
        let dl = d * f32::from(scales[e / 16] as i8);
        *v = dl * f32::from(q);
    }
}

// ---- ternary types ----

/// A base-3 digit packed by TQ1_0: multiplying by 3^k (mod 256) brings digit k to the top,
/// and `(x · 3) >> 8` reads it as 0, 1 or 2.
fn ternary_digit(byte: u8, pow3: u8) -> f32 {
    let x = byte.wrapping_mul(pow3);
    f32::from(((u16::from(x) * 3) >> 8) as i8 - 1)
}

/// `block_tq1_0`: qs[48] (5 trits per byte), qh[4] (4 trits per byte), d f16.
/// Elements 0..160 come from qs[0..32] (digit k of byte l is element 32k + l), 160..240 from
/// qs[32..48] (element 160 + 16k + l), and 240..256 from qh (element 240 + 4k + l).
fn tq1_0(b: &[u8], y: &mut [f32]) {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let qs = &b[0..48];
    let qh = &b[48..52];
    let d = f16_at(b, 52);
    for (k, &p) in POW3.iter().enumerate() {
        for l in 0..32 {
            y[32 * k + l] = d * ternary_digit(qs[l], p);
        }
        for l in 0..16 {
            y[160 + 16 * k + l] = d * ternary_digit(qs[32 + l], p);
        }
    }
    for (k, &p) in POW3[..4].iter().enumerate() {
        for l in 0..4 {
            y[240 + 4 * k + l] = d * ternary_digit(qh[l], p);
        }
    }
}

/// `block_tq2_0`: qs[64] (2-bit values, stored +1), d f16. Element e takes bits
/// 2·((e mod 128) / 32) of `qs[32·(e / 128) + e mod 32]`. x = d × (q − 1).
fn tq2_0(b: &[u8], y: &mut [f32]) {
    let qs = &b[0..64];
    let d = f16_at(b, 64);
    for (e, v) in y.iter_mut().enumerate() {
        let q = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        *v = d * f32::from(q as i8 - 1);
    }
}

// ---- IQ4_XS ----

/// `block_iq4_xs`: d f16, scales_h u16, scales_l[4], qs[128]. Sub-block ib (32 elements) has
/// the 6-bit scale ls = nibble ib of scales_l | bits 2ib of scales_h << 4; x = d·(ls − 32) ×
/// kvalues_iq4nl[q], with low nibbles of `qs[16ib..][..16]` first, then the high nibbles.
fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16_at(b, 2);
    let scales_l = &b[4..8];
    let qs = &b[8..136];
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f;
        let high = ((scales_h >> (2 * ib)) & 3) as u8;
        let ls = (low | (high << 4)) as i8 - 32;
        let dl = d * f32::from(ls);
        let q = &qs[16 * ib..16 * ib + 16];
        for j in 0..16 {
            ys[j] = dl * f32::from(KVALUES_IQ4NL[usize::from(q[j] & 0x0f)]);
            ys[j + 16] = dl * f32::from(KVALUES_IQ4NL[usize::from(q[j] >> 4)]);
        }
    }
}

// ---- grid-based IQ types ----

/// ±1 for bit `j` of a sign byte (set = negative).
fn sign(signs: u8, j: usize) -> f32 {
    if (signs >> j) & 1 == 0 { 1.0 } else { -1.0 }
}

/// `block_iq2_xxs`: d f16, then per 32-element sub-block two u32: the first holds 4 grid
/// indices (one byte each, 8 elements each), the second 4 × 7-bit sign indices and a 4-bit
/// scale in the top bits. x = d·(0.5 + s)·0.25 × grid × sign.
fn iq2_xxs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let aux0 = u32_at(b, 2 + 8 * ib);
        let aux1 = u32_at(b, 2 + 8 * ib + 4);
        let db = d * (0.5 + (aux1 >> 28) as f32) * 0.25;
        for l in 0..4 {
            let grid = &IQ2XXS_GRID[((aux0 >> (8 * l)) & 0xff) as usize];
            let signs = KSIGNS_IQ2XS[((aux1 >> (7 * l)) & 0x7f) as usize];
            for j in 0..8 {
                ys[8 * l + j] = db * f32::from(grid[j]) * sign(signs, j);
            }
        }
    }
}

/// `block_iq2_xs`: d f16, qs u16[32] (9-bit grid index, 7-bit sign index per 8 elements),
/// scales[8] (a 4-bit scale per 16 elements). x = d·(0.5 + s)·0.25 × grid × sign.
fn iq2_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales = &b[66..74];
    for (g, ys) in y.chunks_exact_mut(8).enumerate() {
        let q = u16_at(b, 2 + 2 * g);
        let s = (scales[g / 4] >> (4 * ((g / 2) % 2))) & 0x0f;
        let db = d * (0.5 + f32::from(s)) * 0.25;
        let grid = &IQ2XS_GRID[usize::from(q & 511)];
        let signs = KSIGNS_IQ2XS[usize::from(q >> 9)];
        for j in 0..8 {
            ys[j] = db * f32::from(grid[j]) * sign(signs, j);
        }
    }
}

/// `block_iq2_s`: d f16, qs[32] (low 8 bits of a 10-bit grid index per 8 elements),
/// signs[32] (one sign byte per 8 elements), qh[8] (the top 2 index bits, four per byte),
/// scales[8] (a 4-bit scale per 16 elements). x = d·(0.5 + s)·0.25 × grid × sign.
fn iq2_s(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..34];
    let signs = &b[34..66];
    let qh = &b[66..74];
    let scales = &b[74..82];
    for (g, ys) in y.chunks_exact_mut(8).enumerate() {
        let index = usize::from(qs[g]) | (usize::from((qh[g / 4] >> (2 * (g % 4))) & 3) << 8);
        let s = (scales[g / 4] >> (4 * ((g / 2) % 2))) & 0x0f;
        let db = d * (0.5 + f32::from(s)) * 0.25;
        let grid = &IQ2S_GRID[index];
        for j in 0..8 {
            ys[j] = db * f32::from(grid[j]) * sign(signs[g], j);
        }
    }
}

/// `block_iq3_xxs`: d f16, qs[64] (grid indices, 4 elements each), then one u32 per
/// 32-element sub-block: 4 × 7-bit sign indices and a 4-bit scale on top.
/// x = d·(0.5 + s)·0.5 × grid × sign.
fn iq3_xxs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..66];
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let aux = u32_at(b, 66 + 4 * ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for l in 0..4 {
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 0x7f) as usize];
            let g1 = &IQ3XXS_GRID[usize::from(qs[8 * ib + 2 * l])];
            let g2 = &IQ3XXS_GRID[usize::from(qs[8 * ib + 2 * l + 1])];
            for j in 0..4 {
                ys[8 * l + j] = db * f32::from(g1[j]) * sign(signs, j);
                ys[8 * l + 4 + j] = db * f32::from(g2[j]) * sign(signs, j + 4);
            }
        }
    }
}

/// `block_iq3_s`: d f16, qs[64] (low 8 bits of a 9-bit grid index per 4 elements), qh[8]
/// (the ninth bits), signs[32] (one bit per element), scales[4] (a 4-bit scale per 32
/// elements). x = d·(1 + 2s) × grid × sign.
fn iq3_s(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..66];
    let qh = &b[66..74];
    let signs = &b[74..106];
    let scales = &b[106..110];
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let s = (scales[ib / 2] >> (4 * (ib % 2))) & 0x0f;
        let db = d * f32::from(1 + 2 * s);
        for (k, yk) in ys.chunks_exact_mut(4).enumerate() {
            let i = 8 * ib + k; // index into qs: one per 4 elements
            let index = usize::from(qs[i]) | (usize::from((qh[i / 8] >> (i % 8)) & 1) << 8);
            let grid = &IQ3S_GRID[index];
            for j in 0..4 {
                let e = 32 * ib + 4 * k + j;
                yk[j] = db * f32::from(grid[j]) * sign(signs[e / 8], e % 8);
            }
        }
    }
}

/// `block_iq1_s`: d f16, qs[32] (low 8 bits of an 11-bit grid index per 8 elements),
/// qh u16[8] (per 32 elements: four 3-bit index tops, a 3-bit scale, the delta sign on top).
/// x = d·(2s + 1) × (grid ± 0.125).
fn iq1_s(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..34];
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let qh = u16_at(b, 34 + 2 * ib);
        let dl = d * f32::from(2 * ((qh >> 12) & 7) + 1);
        let delta = if qh & 0x8000 == 0 {
            IQ1S_DELTA
        } else {
            -IQ1S_DELTA
        };
        for l in 0..4 {
            let index = usize::from(qs[4 * ib + l]) | (usize::from((qh >> (3 * l)) & 7) << 8);
            let grid = &IQ1S_GRID[index];
            for j in 0..8 {
                ys[8 * l + j] = dl * (f32::from(grid[j]) + delta);
            }
        }
    }
}

/// `block_iq1_m`: qs[32], qh[16] (per 8 elements a nibble: 3 index bits and the delta sign),
/// scales[8] read as four u16 words: each holds four 3-bit scales (one per 16 elements) in its
/// low 12 bits, and their top nibbles together form the f16 super-block scale.
/// x = d·(2s + 1) × (grid ± 0.125).
fn iq1_m(b: &[u8], y: &mut [f32]) {
    let qs = &b[0..32];
    let qh = &b[32..48];
    let sc = [u16_at(b, 48), u16_at(b, 50), u16_at(b, 52), u16_at(b, 54)];
    let d_bits =
        (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
    let d = f16::from_bits(d_bits).to_f32();
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let s = sc[ib / 2] >> (6 * (ib % 2));
        let dl = [
            d * f32::from(2 * (s & 7) + 1),
            d * f32::from(2 * ((s >> 3) & 7) + 1),
        ];
        for (k, yk) in ys.chunks_exact_mut(8).enumerate() {
            let g = 4 * ib + k; // group of 8 elements
            let nibble = (qh[g / 2] >> (4 * (g % 2))) & 0x0f;
            let index = usize::from(qs[g]) | (usize::from(nibble & 7) << 8);
            let delta = if nibble & 8 == 0 {
                IQ1S_DELTA
            } else {
                -IQ1S_DELTA
            };
            let grid = &IQ1S_GRID[index];
            for j in 0..8 {
                yk[j] = dl[k / 2] * (f32::from(grid[j]) + delta);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_type_decodes_a_zero_block_to_finite_values() {
        for &t in DType::ALL {
            if !supports(t) {
                continue;
            }
            let data = vec![0u8; t.type_size() as usize * 2];
            let out = dequantize(t, &data).unwrap();
            assert_eq!(out.len() as u64, 2 * t.block_size());
            assert!(out.iter().all(|v| v.is_finite()), "{t}");
        }
    }

    #[test]
    fn lengths_are_checked() {
        let mut out = vec![0f32; 32];
        let e = dequantize_into(DType::Q8_0, &[0u8; 33], &mut out).unwrap_err();
        assert!(e.to_string().contains("expected 34 bytes"), "{e}");
        let e = dequantize_into(DType::Q8_1, &[0u8; 36], &mut out).unwrap_err();
        assert!(e.to_string().contains("does not support"), "{e}");
        let e = dequantize(DType::Q4_K, &[0u8; 100]).unwrap_err();
        assert!(e.to_string().contains("multiple of 144"), "{e}");
    }
}

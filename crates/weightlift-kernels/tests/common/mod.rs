//! Shared helpers for the integration tests: a tiny deterministic RNG, fixture loading, and the
//! f64 matvec reference with its Q8-mode error bound.
#![allow(dead_code)]

use std::path::PathBuf;

use weightlift_kernels::{FloatType, QuantType};

/// Finds libnvrtc as the package does, also searching the repository's `.venv` (where `make
/// venv` installs pip's NVRTC), so these tests need no `LD_LIBRARY_PATH`; fails saying why when
/// there is none.
#[cfg(feature = "nvrtc-check")]
pub fn require_nvrtc() {
    use weightlift_kernels::cuda_libs;
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv");
    cuda_libs::add_site_dirs(cuda_libs::site_packages_of(&venv));
    if let Err(e) = weightlift_kernels::nvrtc::nvrtc_library() {
        panic!("{e} (make venv installs pip's NVRTC into .venv)");
    }
}

/// xorshift64*: deterministic, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.next_u64() >> 56) as u8).collect()
    }
}

pub struct Fixture {
    pub ty: QuantType,
    pub raw: Vec<u8>,
    /// gguf-py's dequantisation of `raw`.
    pub want: Vec<f32>,
}

/// Loads `tests/data/<name>.bin` (written by `tests/gen_vectors.py` from gguf-py).
pub fn load(name: &str) -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(format!("{name}.bin"));
    let b = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; run tests/gen_vectors.py", path.display()));
    assert_eq!(&b[..4], b"WLKV");
    let u = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]) as usize;
    let ty = QuantType::from_ggml_id(u(4) as u32).expect("known ggml id");
    let (n_blocks, block_bytes, n_el) = (u(8), u(12), u(16));
    assert_eq!(
        block_bytes,
        ty.block_bytes(),
        "{name}: block size disagrees with ggml-common.h"
    );
    let raw = b[20..20 + n_blocks * block_bytes].to_vec();
    let want: Vec<f32> = b[20 + raw.len()..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(want.len(), n_el);
    Fixture { ty, raw, want }
}

pub const NAMES: [&str; 13] = [
    "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
    "iq4_nl",
];

/// f64 reference of y = W x from gguf-py's f32 weights.
pub fn reference(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0f64; rows * n_tok];
    let mut mag = vec![0f64; rows * n_tok];
    for t in 0..n_tok {
        for r in 0..rows {
            for c in 0..cols {
                let p = f64::from(w[r * cols + c]) * f64::from(x[t * cols + c]);
                y[t * rows + r] += p;
                mag[t * rows + r] += p.abs();
            }
        }
    }
    (y, mag)
}

/// Per-output bound on the Q8 mode's activation error: Σ |w| · 0.57 · d_x of w's block
/// (d_x/2 from rounding plus 127 · d_x · 2⁻¹¹ from storing d_x as f16).
pub fn q8_bound(w: &[f32], rows: usize, cols: usize, x: &[f32], n_tok: usize) -> Vec<f64> {
    let mut b = vec![0f64; rows * n_tok];
    for t in 0..n_tok {
        for r in 0..rows {
            for blk in 0..cols / 32 {
                let xs = &x[t * cols + blk * 32..t * cols + blk * 32 + 32];
                let d = f64::from(xs.iter().fold(0f32, |m, v| m.max(v.abs()))) / 127.0;
                let ws: f64 = w[r * cols + blk * 32..r * cols + blk * 32 + 32]
                    .iter()
                    .map(|v| f64::from(v.abs()))
                    .sum();
                b[t * rows + r] += ws * d * 0.57;
            }
        }
    }
    b
}

/// `rows` rows of `cols` values made of fixture `f`'s blocks in turn (block k of row r is
/// fixture block (r · blocks a row + k) mod the fixture's blocks), with gguf-py's dequantised
/// values laid out the same way: long rows from a short fixture.
pub fn tiled_rows(f: &Fixture, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let (bs, bb) = (f.ty.block_size(), f.ty.block_bytes());
    let n_blocks = f.raw.len() / bb;
    let (mut raw, mut want) = (Vec::new(), Vec::new());
    for i in 0..rows * (cols / bs) {
        let k = i % n_blocks;
        raw.extend_from_slice(&f.raw[k * bb..(k + 1) * bb]);
        want.extend_from_slice(&f.want[k * bs..(k + 1) * bs]);
    }
    (raw, want)
}

/// The offset `m` of 32-value group `g` of a weight row (`w = d·q + m`), read from the block
/// bytes as ggml-common.h lays them out: Q4_1's and Q5_1's `m`, Q4_K's `−dmin·m`, Q2_K's
/// `−dmin·m` of the larger of its two mins; 0 for the symmetric types.
pub fn group_offset(ty: QuantType, row: &[u8], g: usize) -> f64 {
    let f16 = |b: &[u8], o: usize| f64::from(half::f16::from_le_bytes([b[o], b[o + 1]]).to_f32());
    match ty {
        QuantType::Q4_1 => f16(&row[g * 20..], 2),
        QuantType::Q5_1 => f16(&row[g * 24..], 2),
        QuantType::Q4_K => {
            let blk = &row[(g / 8) * 144..];
            let (j, q) = (g % 8, &blk[4..16]);
            let m = if j < 4 {
                q[j + 4] & 63
            } else {
                (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
            };
            -f16(blk, 2) * f64::from(m)
        }
        // the larger of the group's two mins (one per 16 values)
        QuantType::Q2_K => {
            let blk = &row[(g / 8) * 84..];
            let (lo, hi) = (blk[2 * (g % 8)] >> 4, blk[2 * (g % 8) + 1] >> 4);
            -f16(blk, 82) * f64::from(lo.max(hi))
        }
        _ => 0.0,
    }
}

/// `ty`'s bytes of `v` (f16 and bf16 rounded to nearest even by the `half` crate, which the
/// kernels' results are compared against) and the values the kernels see.
pub fn float_weights(ty: QuantType, v: &[f32]) -> (Vec<u8>, Vec<f32>) {
    match ty {
        QuantType::F16 => v
            .iter()
            .map(|x| half::f16::from_f32(*x))
            .map(|h| (h.to_le_bytes(), h.to_f32()))
            .fold((Vec::new(), Vec::new()), |(mut b, mut w), (h, f)| {
                b.extend(h);
                w.push(f);
                (b, w)
            }),
        QuantType::BF16 => v
            .iter()
            .map(|x| half::bf16::from_f32(*x))
            .map(|h| (h.to_le_bytes(), h.to_f32()))
            .fold((Vec::new(), Vec::new()), |(mut b, mut w), (h, f)| {
                b.extend(h);
                w.push(f);
                (b, w)
            }),
        _ => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), v.to_vec()),
    }
}

/// The bytes of `v` as weights of `ty`, rows of `cols` values: [`float_weights`]' for a float
/// type, the crate's quantiser's blocks for the others.
pub fn weight_bytes(ty: QuantType, v: &[f32], cols: usize) -> weightlift_kernels::Result<Vec<u8>> {
    if ty.block_size() == 1 {
        return Ok(float_weights(ty, v).0);
    }
    let mut raw = vec![0u8; v.len() / cols * weightlift_kernels::quantized_row_bytes(ty, cols)?];
    weightlift_kernels::quantize_rows(ty, v, cols, &mut raw)?;
    Ok(raw)
}

/// `bytes` in a new buffer of `b`.
pub fn upload<B: weightlift_kernels::Backend>(
    b: &B,
    bytes: &[u8],
) -> weightlift_kernels::Result<B::Buffer> {
    let mut buf = b.alloc(bytes.len())?;
    b.copy_from_host(bytes, &mut buf, 0)?;
    Ok(buf)
}

/// f32 `v` in a new buffer of `b`.
pub fn f32s<B: weightlift_kernels::Backend>(
    b: &B,
    v: &[f32],
) -> weightlift_kernels::Result<B::Buffer> {
    upload(b, bytemuck::cast_slice(v))
}

/// The first `n` f32 values of `buf`.
pub fn download_f32<B: weightlift_kernels::Backend>(
    b: &B,
    buf: &B::Buffer,
    n: usize,
) -> weightlift_kernels::Result<Vec<f32>> {
    let mut bytes = vec![0u8; n * 4];
    b.copy_to_host(buf, 0, &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// One member of a shared product for [`shared_and_alone`]: its weight type, row count and
/// weights.
pub type Member<'a, B> = (
    QuantType,
    usize,
    &'a <B as weightlift_kernels::Backend>::Buffer,
);

/// Runs `members` as one [`Op::MatmulShared`](weightlift_kernels::Op::MatmulShared) of the
/// `n_tok` tokens `x` (activations of `act`, `cols` values a token), then each as its own
/// [`Op::Matmul`](weightlift_kernels::Op::Matmul), and returns each member's two outputs,
/// `(shared, alone)`.
pub fn shared_and_alone<B: weightlift_kernels::Backend>(
    b: &B,
    (mode, act): (weightlift_kernels::MatvecMode, FloatType),
    (cols, n_tok, max_dq_size): (usize, usize, usize),
    x: &B::Buffer,
    members: &[Member<'_, B>],
) -> weightlift_kernels::Result<Vec<(Vec<f32>, Vec<f32>)>> {
    use weightlift_kernels::{Op, Product};
    let mut ys = members
        .iter()
        .map(|(_, rows, _)| b.alloc(rows * n_tok * 4))
        .collect::<weightlift_kernels::Result<Vec<_>>>()?;
    let products = members
        .iter()
        .zip(ys.iter_mut())
        .map(|(&(ty, rows, w), y)| Product { ty, rows, w, y })
        .collect();
    b.run(Op::MatmulShared {
        mode,
        act,
        cols,
        n_tok,
        max_dq_size,
        x,
        products,
    })?;
    let shape = (mode, act, cols, n_tok, max_dq_size);
    let mut out = Vec::with_capacity(members.len());
    for (&(ty, rows, w), shared) in members.iter().zip(&ys) {
        let mut alone = b.alloc(rows * n_tok * 4)?;
        let y = &mut alone;
        b.run(Product { ty, rows, w, y }.alone(shape, x))?;
        out.push((
            download_f32(b, shared, rows * n_tok)?,
            download_f32(b, &alone, rows * n_tok)?,
        ));
    }
    Ok(out)
}

/// `x` as little-endian bytes of `ft` (f16 and bf16 round to nearest even): a checkpoint's float
/// rows as the quantisers read them.
pub fn float_bytes(ft: FloatType, x: &[f32]) -> Vec<u8> {
    match ft {
        FloatType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        FloatType::F16 => x
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        FloatType::BF16 => x
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
    }
}

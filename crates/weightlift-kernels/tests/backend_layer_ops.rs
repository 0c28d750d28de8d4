//! The operations one decoder layer adds to the backends, on every backend present
//! (`test_device!`): RoPE in place on a frequency table (alone and fused with the cache
//! store), the residual add (alone and fused with
//! the next norm), the bias add, the
//! gated MLP in place (SwiGLU and gemma's GeGLU), gemma's embedding scale, a mixture-of-experts
//! block's row gather and weighted scatter-add, causal grouped-query
//! attention over an f32 or f16 cache (with gemma's sliding window and soft-cap), and views of
//! parts of a buffer. References: f64 closed forms and a plain (two-pass) f64 softmax. The CUDA
//! cases skip, saying why, without a GPU.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

mod common;

use common::{Rng, download_f32, f32s, upload, weight_bytes};
use weightlift_kernels::*;

fn close(got: f32, want: f64, rel: f64) -> bool {
    (f64::from(got) - want).abs() <= rel * want.abs().max(1.0)
}

fn in_place_ops_match_closed_forms<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x1a7e);
    let n = 3000;
    let (x, y) = (rng.vec(n, 4.0), rng.vec(n, 2.0));
    let yb = f32s(b, &y)?;

    let mut xb = f32s(b, &x)?;
    b.run(Op::AddInPlace {
        n,
        x: &mut xb,
        y: &yb,
    })?;
    let got = download_f32(b, &xb, n)?;
    for i in 0..n {
        assert_eq!(got[i], x[i] + y[i], "{} add_inplace at {i}", b.name());
    }

    let mut gb = f32s(b, &x)?;
    b.run(Op::SwiGluInPlace {
        n,
        gate: &mut gb,
        up: &yb,
    })?;
    let got = download_f32(b, &gb, n)?;
    for i in 0..n {
        let (g, u) = (f64::from(x[i]), f64::from(y[i]));
        let want = g / (1.0 + (-g).exp()) * u;
        assert!(
            close(got[i], want, 1e-6),
            "{} swiglu_inplace at {i}",
            b.name()
        );
    }

    // 7 rows of 60 plus a bias of 60 (the rows do not fill a launch block evenly)
    let (rows, cols) = (7, 60);
    let bias = rng.vec(cols, 1.0);
    let bb = f32s(b, &bias)?;
    let mut xb = f32s(b, &x[..rows * cols])?;
    b.run(Op::AddBias {
        n_rows: rows,
        n_cols: cols,
        x: &mut xb,
        bias: &bb,
    })?;
    let got = download_f32(b, &xb, rows * cols)?;
    for r in 0..rows {
        for c in 0..cols {
            let i = r * cols + c;
            assert_eq!(got[i], x[i] + bias[c], "{} add_bias at {r},{c}", b.name());
        }
    }

    // RoPE in place: 3 tokens × 2 heads × head_dim 12, 8 dims rotated, Llama 3-style factors
    // folded into the table
    let (n_tok, heads, hd) = (3, 2, 12);
    let pos = [0i32, 5, 1000];
    let pb = upload(b, bytemuck::cast_slice(&pos))?;
    let xr = rng.vec(n_tok * heads * hd, 1.0);
    for style in [RopeStyle::Normal, RopeStyle::Neox] {
        let params = RopeParams {
            style,
            head_dim: hd,
            n_dims: 8,
            freq_base: 10000.0,
            freq_scale: 0.5,
            attn_factor: 1.0,
        };
        let freqs = rope_inv_freqs(&params, Some(&[1.0, 2.0, 4.0, 8.0]))?;
        let fb = f32s(b, &freqs)?;
        let mut x = f32s(b, &xr)?;
        b.run(Op::RopeInPlace {
            params,
            n_tok,
            n_heads: heads,
            x: &mut x,
            positions: &pb,
            inv_freqs: &fb,
        })?;
        let got = download_f32(b, &x, xr.len())?;
        for t in 0..n_tok {
            for h in 0..heads {
                let base = (t * heads + h) * hd;
                for i in 0..4 {
                    let inv = 0.5 * 10000f64.powf(-2.0 * i as f64 / 8.0) / f64::from(1 << i);
                    let th = f64::from(pos[t]) * inv;
                    let (ia, ib) = match style {
                        RopeStyle::Neox => (i, i + 4),
                        RopeStyle::Normal => (2 * i, 2 * i + 1),
                    };
                    let (a, c) = (f64::from(xr[base + ia]), f64::from(xr[base + ib]));
                    // angles up to 500 rad: f32 rounding of the angle itself dominates
                    let tol = 1e-6 * th.abs().max(1.0) * 4.0;
                    let (wa, wb) = (a * th.cos() - c * th.sin(), a * th.sin() + c * th.cos());
                    assert!(
                        (f64::from(got[base + ia]) - wa).abs() <= tol
                            && (f64::from(got[base + ib]) - wb).abs() <= tol,
                        "{} rope_inplace {style:?} token {t} head {h} pair {i}",
                        b.name()
                    );
                }
                assert_eq!(&got[base + 8..base + hd], &xr[base + 8..base + hd]);
            }
        }
    }
    // an odd n_dims is refused, naming the rule
    let bad = RopeParams {
        style: RopeStyle::Neox,
        head_dim: hd,
        n_dims: 7,
        freq_base: 1e4,
        freq_scale: 1.0,
        attn_factor: 1.0,
    };
    let fb = f32s(b, &[1.0; 4])?;
    let mut x = f32s(b, &xr)?;
    let e = b
        .run(Op::RopeInPlace {
            params: bad,
            n_tok,
            n_heads: heads,
            x: &mut x,
            positions: &pb,
            inv_freqs: &fb,
        })
        .unwrap_err();
    assert!(e.to_string().contains("n_dims 7 must be even"), "{e}");
    b.synchronize()
}
test_device!(in_place_ops_match_closed_forms);

/// A mixture-of-experts block's row moves: rows gathered by index (5 of 9 rows of 37 values,
/// one taken twice, in any order) are those rows; a weighted scatter-add of 4 rows into
/// distinct rows of 9 sums adds `w · y` (the product rounded, then the sum: the bits of a
/// scale then an add) into those rows and leaves the others; an index past the rows is
/// refused on the CPU backends (the CUDA kernels skip it instead and are not asked).
fn row_gather_and_scatter_add_move_the_rows_they_name<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x3e7a);
    let (rows, cols) = (9, 37);
    let src = rng.vec(rows * cols, 3.0);
    let srcb = f32s(b, &src)?;
    let pick: [u32; 5] = [7, 0, 7, 3, 8];
    let pickb = upload(b, bytemuck::cast_slice(&pick))?;
    let mut dst = b.alloc(pick.len() * cols * 4)?;
    b.run(Op::GatherRows {
        n_rows: pick.len(),
        n_cols: cols,
        src_rows: rows,
        rows: &pickb,
        src: &srcb,
        dst: &mut dst,
    })?;
    let got = download_f32(b, &dst, pick.len() * cols)?;
    for (k, &r) in pick.iter().enumerate() {
        let want = &src[r as usize * cols..][..cols];
        assert_eq!(
            &got[k * cols..][..cols],
            want,
            "{} gathered row {k}",
            b.name()
        );
    }

    let into: [u32; 4] = [5, 1, 8, 2];
    let weights = [0.25f32, -1.5, 0.8125, 3.0];
    let y = rng.vec(into.len() * cols, 2.0);
    let (intob, wb, yb) = (
        upload(b, bytemuck::cast_slice(&into))?,
        f32s(b, &weights)?,
        f32s(b, &y)?,
    );
    let mut sums = f32s(b, &src)?;
    b.run(Op::ScatterAddRows {
        n_rows: into.len(),
        n_cols: cols,
        dst_rows: rows,
        rows: &intob,
        weights: &wb,
        src: &yb,
        dst: &mut sums,
    })?;
    let got = download_f32(b, &sums, rows * cols)?;
    let mut want = src.clone();
    for (k, &r) in into.iter().enumerate() {
        for c in 0..cols {
            let scaled = weights[k] * y[k * cols + c];
            want[r as usize * cols + c] += scaled;
        }
    }
    for i in 0..rows * cols {
        assert_eq!(
            got[i].to_bits(),
            want[i].to_bits(),
            "{} scatter-add at {i}",
            b.name()
        );
    }

    if !b.name().starts_with("cuda") {
        let past = upload(b, bytemuck::cast_slice(&[2u32, 9]))?;
        let e = b
            .run(Op::GatherRows {
                n_rows: 2,
                n_cols: cols,
                src_rows: rows,
                rows: &past,
                src: &srcb,
                dst: &mut dst,
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gather_rows") && e.contains("row index 9"),
            "{e}"
        );
        let e = b
            .run(Op::ScatterAddRows {
                n_rows: 2,
                n_cols: cols,
                dst_rows: rows,
                rows: &past,
                weights: &wb,
                src: &yb,
                dst: &mut sums,
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("scatter_add_rows") && e.contains("past the buffer's 9 rows"),
            "{e}"
        );
    }
    Ok(())
}

test_device!(row_gather_and_scatter_add_move_the_rows_they_name);

/// Asserts that each of `parts` has the same bits in `got[1]` (a run with a `q8_next` hint) as
/// in `got[0]` (the run without).
fn same_with_the_hint<const N: usize>(what: &str, parts: &[&str; N], got: &[[Vec<f32>; N]]) {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (k, part) in parts.iter().enumerate() {
        assert_eq!(
            bits(&got[1][k]),
            bits(&got[0][k]),
            "{what}: {part} with the hint against without"
        );
    }
}

/// The Q8-mode products of the `n_tok` rows `x` with the Q4_K matrix `w` (`rows × cols`), as
/// the hint tests below take them.
fn q8_q4k_products<B: Backend>(
    b: &B,
    w: &B::Buffer,
    x: &B::Buffer,
    (rows, cols, n_tok): (usize, usize, usize),
) -> Result<Vec<f32>> {
    let mut y = b.alloc(n_tok * rows * 4)?;
    b.run(Op::Matmul {
        ty: QuantType::Q4_K,
        mode: MatvecMode::Q8,
        act: FloatType::F32,
        rows,
        cols,
        n_tok,
        max_dq_size: 1 << 20,
        w,
        x,
        y: &mut y,
    })?;
    download_f32(b, &y, n_tok * rows)
}

/// A residual add and norm that quantises its output for the next op (`q8_next`: decode's
/// q, k and v, or gate and up) changes no bits: the residual, the normed rows and the next
/// op's Q8 products of them are what a plain add and norm give. An op in between (here one
/// that changes the normed rows, or one on other buffers) leaves the product to quantise the
/// rows itself. One row and three (a batch's), a Q4_K matrix (its few-token product runs the
/// one-token kernel per token on CUDA, on the quantised rows).
fn a_norm_quantising_for_the_next_product_changes_no_bits<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x98e);
    let (cols, rows) = (512usize, 40usize);
    let wm = upload(
        b,
        &weight_bytes(QuantType::Q4_K, &rng.vec(rows * cols, 0.3), cols)?,
    )?;
    for n_rows in [1usize, 3] {
        let n = n_rows * cols;
        let (x0, h0, w) = (rng.vec(n, 3.0), rng.vec(n, 2.0), rng.vec(cols, 1.5));
        let wb = f32s(b, &w)?;
        // 0: the product right after the norm; 1: the normed rows halved first; 2: an add on
        // other buffers first
        for between in 0..3 {
            let mut got: Vec<[Vec<f32>; 3]> = Vec::new();
            for q8_next in [false, true] {
                let (mut x, mut h) = (f32s(b, &x0)?, f32s(b, &h0)?);
                b.run(Op::AddRmsNorm {
                    n_rows,
                    n_cols: cols,
                    eps: 1e-5,
                    x: &mut x,
                    h: &mut h,
                    weight: &wb,
                    q8_next,
                })?;
                match between {
                    1 => b.run(Op::ScaleInPlace {
                        n,
                        s: 0.5,
                        x: &mut h,
                    })?,
                    2 => {
                        let mut other = f32s(b, &x0)?;
                        b.run(Op::AddInPlace {
                            n,
                            x: &mut other,
                            y: &x,
                        })?
                    }
                    _ => {}
                }
                let y = q8_q4k_products(b, &wm, &h, (rows, cols, n_rows))?;
                got.push([download_f32(b, &x, n)?, download_f32(b, &h, n)?, y]);
            }
            let what = format!("{} {n_rows} rows, case {between}", b.name());
            assert!(got[0][2].iter().any(|v| *v != 0.0), "{what}: no products");
            same_with_the_hint(&what, &["residual", "normed rows", "products"], &got);
        }
    }
    Ok(())
}

test_device!(a_norm_quantising_for_the_next_product_changes_no_bits);

/// Attention whose merge quantises its output for the next op (`q8_next`: decode's output
/// projection) changes no bits: the attention rows and the Q8 product of them are what plain
/// attention gives, and an op in between (one that changes the rows) leaves the product to
/// quantise them itself. One decode query over 300 keys of an f16 cache (split across blocks on
/// CUDA, whose merge then quantises), 8 heads of 64, and a Q4_K projection. The plain run comes
/// first: on CUDA its product makes the buffer the quantised rows go to.
fn attention_quantising_for_the_output_projection_changes_no_bits<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0xa77);
    let (nh, kvh, hd, start) = (8usize, 2usize, 64usize, 300usize);
    let (cols, rows) = (nh * hd, 24usize);
    let keys = start + 1;
    let q = rng.vec(cols, 2.0);
    let (kbytes, _) = cache_rows(&rng.vec(keys * kvh * hd, 2.0), KvFormat::F16);
    let (vbytes, _) = cache_rows(&rng.vec(keys * kvh * hd, 1.0), KvFormat::F16);
    let (qb, kb, vb) = (f32s(b, &q)?, upload(b, &kbytes)?, upload(b, &vbytes)?);
    let wm = upload(
        b,
        &weight_bytes(QuantType::Q4_K, &rng.vec(rows * cols, 0.3), cols)?,
    )?;
    let room = nh * sources::ATTENTION_MAX_SPLITS * (hd + 2);
    for between in [false, true] {
        let mut got: Vec<[Vec<f32>; 2]> = Vec::new();
        for q8_next in [false, true] {
            let mut out = b.alloc(cols * 4)?;
            let mut scratch = b.alloc(room * 4)?;
            b.run(Op::Attention {
                window: 0,
                softcap: 0.0,
                cache_rows: keys,
                k_format: KvFormat::F16,
                v_format: KvFormat::F16,
                n_heads: nh,
                kv_heads: kvh,
                head_dim: hd,
                n_q: 1,
                start,
                scale: 0.125,
                tile: 256,
                f16_operands: false,
                q: &qb,
                k: &kb,
                v: &vb,
                out: &mut out,
                scratch: Some(&mut scratch),
                start_at: None,
                q8_next,
            })?;
            if between {
                b.run(Op::ScaleInPlace {
                    n: cols,
                    s: 0.5,
                    x: &mut out,
                })?;
            }
            let y = q8_q4k_products(b, &wm, &out, (rows, cols, 1))?;
            got.push([download_f32(b, &out, cols)?, y]);
        }
        let what = format!("{}, an op in between: {between}", b.name());
        assert!(got[0][1].iter().any(|v| *v != 0.0), "{what}: no products");
        same_with_the_hint(&what, &["attention rows", "products"], &got);
    }
    Ok(())
}

test_device!(attention_quantising_for_the_output_projection_changes_no_bits);

/// The fused residual add and norm: `x` is `x + h` and `h` the RMSNorm of it, bit for bit what
/// the residual add and then the norm give on the same backend, and within 1e-5 of an f64
/// closed form. Three rows of 1,000 values (not a multiple of a block's threads), and of 5,000
/// (longer than a CUDA block holds in registers).
fn add_rms_norm_is_the_add_then_the_norm<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x4d5);
    for n_cols in [1000usize, 5000] {
        let (n_rows, eps) = (3usize, 1e-5f32);
        let (x0, h0, w) = (
            rng.vec(n_rows * n_cols, 3.0),
            rng.vec(n_rows * n_cols, 2.0),
            rng.vec(n_cols, 1.5),
        );
        let wb = f32s(b, &w)?;
        // fused (5,000 values a row are not whole Q8 blocks: the hint is ignored there)
        let (mut x, mut h) = (f32s(b, &x0)?, f32s(b, &h0)?);
        b.run(Op::AddRmsNorm {
            n_rows,
            n_cols,
            eps,
            x: &mut x,
            h: &mut h,
            weight: &wb,
            q8_next: n_cols == 5000,
        })?;
        // separate
        let (mut x2, h2) = (f32s(b, &x0)?, f32s(b, &h0)?);
        let mut out = b.alloc(n_rows * n_cols * 4)?;
        b.run(Op::AddInPlace {
            n: n_rows * n_cols,
            x: &mut x2,
            y: &h2,
        })?;
        b.run(Op::RmsNorm {
            n_rows,
            n_cols,
            eps,
            x: &x2,
            weight: &wb,
            out: &mut out,
        })?;
        let n = n_rows * n_cols;
        let (gx, gh) = (download_f32(b, &x, n)?, download_f32(b, &h, n)?);
        let (wx, wh) = (download_f32(b, &x2, n)?, download_f32(b, &out, n)?);
        for i in 0..n {
            assert_eq!(
                gx[i].to_bits(),
                wx[i].to_bits(),
                "{} residual {i}",
                b.name()
            );
            assert_eq!(gh[i].to_bits(), wh[i].to_bits(), "{} normed {i}", b.name());
        }
        for r in 0..n_rows {
            let row: Vec<f64> = (0..n_cols)
                .map(|c| f64::from(x0[r * n_cols + c]) + f64::from(h0[r * n_cols + c]))
                .collect();
            let ms = row.iter().map(|v| v * v).sum::<f64>() / n_cols as f64;
            let scale = 1.0 / (ms + f64::from(eps)).sqrt();
            for c in 0..n_cols {
                let want = row[c] * scale * f64::from(w[c]);
                assert!(
                    close(gh[r * n_cols + c], want, 1e-5),
                    "{} row {r} col {c}",
                    b.name()
                );
            }
        }
    }
    Ok(())
}
test_device!(add_rms_norm_is_the_add_then_the_norm);

/// RoPE fused with the cache store (`RopeKvStore`) gives the bits of the four ops it stands
/// for (RoPE in place on the queries and on the keys, then the key and value stores) on every
/// backend, for every cache dtype (q8 keys with q4 values too), both pairings, partial rotary
/// dims and heads of 80 values (quantised groups that straddle two heads), at positions 0, 7
/// and 1,000 written from cache row 5. The rotated queries, and the keys as an f32 cache
/// holds them, lie within 4e-6 · max(1, |θ|) of an f64 rotation.
// Parts of a buffer are unsafe (keeping them within their buffer's life is the caller's task).
#[allow(unsafe_code)]
fn rope_kv_store_is_the_rope_then_the_stores<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x7c5);
    let pos = [0i32, 7, 1000];
    let n_tok = pos.len();
    let pb = upload(b, bytemuck::cast_slice(&pos))?;
    let pairs = [
        (KvFormat::F32, KvFormat::F32),
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::BF16, KvFormat::BF16),
        (KvFormat::E4M3, KvFormat::E4M3),
        (KvFormat::Q8, KvFormat::Q8),
        (KvFormat::Q4, KvFormat::Q4),
        (KvFormat::Q8, KvFormat::Q4),
    ];
    for (hd, n_dims) in [(64usize, 64usize), (64, 32), (80, 80)] {
        let (n_heads, kv_heads) = (4, 2);
        let kvn = n_tok * kv_heads * hd;
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            let params = RopeParams {
                style,
                head_dim: hd,
                n_dims,
                freq_base: 10000.0,
                freq_scale: 1.0,
                attn_factor: 1.0,
            };
            let freqs = rope_inv_freqs(&params, None)?;
            let fb = f32s(b, &freqs)?;
            for (kf, vf) in pairs {
                let what = format!(
                    "{} {kf:?}/{vf:?} head_dim {hd} n_dims {n_dims} {style:?}",
                    b.name()
                );
                let (q, k, v) = (
                    rng.vec(n_tok * n_heads * hd, 2.0),
                    rng.vec(kvn, 2.0),
                    rng.vec(kvn, 2.0),
                );
                let vb = f32s(b, &v)?;
                // the cache rows from row 5 on, as a layer's cache is written at a position
                let at = 5 * kv_heads * hd;
                let (k_off, v_off) = (kf.byte_at(at), vf.byte_at(at));
                let (k_len, v_len) = (kf.byte_at(kvn), vf.byte_at(kvn));
                // fused
                let (mut qb, mut kb) = (f32s(b, &q)?, f32s(b, &k)?);
                let mut kc = b.alloc(k_off + k_len)?;
                let mut vc = b.alloc(v_off + v_len)?;
                {
                    // SAFETY: the parts are dropped at the end of this block, before the
                    // caches are used again.
                    let mut kp = unsafe { b.split(&mut kc, &[(k_off, k_len)]) }?;
                    // SAFETY: as above.
                    let mut vp = unsafe { b.split(&mut vc, &[(v_off, v_len)]) }?;
                    b.run(Op::RopeKvStore {
                        params,
                        n_tok,
                        n_heads,
                        kv_heads,
                        q: &mut qb,
                        k: &mut kb,
                        v: &vb,
                        positions: &pb,
                        inv_freqs: &fb,
                        k_format: kf,
                        v_format: vf,
                        k_cache: &mut kp[0],
                        v_cache: &mut vp[0],
                        cache_rows: None,
                    })?;
                }
                // the four ops
                let (mut qb2, mut kb2) = (f32s(b, &q)?, f32s(b, &k)?);
                let (mut kc2, mut vc2) = (b.alloc(k_len)?, b.alloc(v_len)?);
                for (x, heads) in [(&mut qb2, n_heads), (&mut kb2, kv_heads)] {
                    b.run(Op::RopeInPlace {
                        params,
                        n_tok,
                        n_heads: heads,
                        x,
                        positions: &pb,
                        inv_freqs: &fb,
                    })?;
                }
                b.run(Op::KvStore {
                    format: kf,
                    n: kvn,
                    src: &kb2,
                    dst: &mut kc2,
                })?;
                b.run(Op::KvStore {
                    format: vf,
                    n: kvn,
                    src: &vb,
                    dst: &mut vc2,
                })?;
                let bytes = |buf: &B::Buffer, off: usize, n: usize| -> Result<Vec<u8>> {
                    let mut out = vec![0u8; n];
                    b.copy_to_host(buf, off, &mut out)?;
                    Ok(out)
                };
                let got_q = download_f32(b, &qb, q.len())?;
                let want_q = download_f32(b, &qb2, q.len())?;
                for i in 0..q.len() {
                    assert_eq!(
                        got_q[i].to_bits(),
                        want_q[i].to_bits(),
                        "{what}: query value {i}"
                    );
                }
                assert_eq!(
                    bytes(&kc, k_off, k_len)?,
                    bytes(&kc2, 0, k_len)?,
                    "{what}: key cache bytes"
                );
                assert_eq!(
                    bytes(&vc, v_off, v_len)?,
                    bytes(&vc2, 0, v_len)?,
                    "{what}: value cache bytes"
                );
                // the rows before the ones written are untouched
                assert!(bytes(&kc, 0, k_off)?.iter().all(|&x| x == 0), "{what}");
                // against f64: the queries, and the keys where the cache holds them as f32
                let kcache: Vec<f32> = if kf == KvFormat::F32 {
                    bytes(&kc, k_off, k_len)?
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect()
                } else {
                    Vec::new()
                };
                let rotated: [(&[f32], &[f32], usize); 2] =
                    [(&q, &got_q, n_heads), (&k, &kcache, kv_heads)];
                for (src, got, heads) in rotated {
                    if got.is_empty() {
                        continue;
                    }
                    for t in 0..n_tok {
                        for h in 0..heads {
                            let base = (t * heads + h) * hd;
                            for i in 0..n_dims / 2 {
                                let th = f64::from(pos[t]) * f64::from(freqs[i]);
                                let (ia, ib) = match style {
                                    RopeStyle::Neox => (i, i + n_dims / 2),
                                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                                };
                                let (a, c) = (f64::from(src[base + ia]), f64::from(src[base + ib]));
                                let tol = 4e-6 * th.abs().max(1.0);
                                let (wa, wb) =
                                    (a * th.cos() - c * th.sin(), a * th.sin() + c * th.cos());
                                assert!(
                                    (f64::from(got[base + ia]) - wa).abs() <= tol
                                        && (f64::from(got[base + ib]) - wb).abs() <= tol,
                                    "{what}: token {t} head {h} pair {i}"
                                );
                            }
                            assert_eq!(
                                &got[base + n_dims..base + hd],
                                &src[base + n_dims..base + hd],
                                "{what}: dims past n_dims"
                            );
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
test_device!(rope_kv_store_is_the_rope_then_the_stores);

/// The cache rows as stored (`format`) and as the kernels read them (f32), by the cache codec.
fn cache_rows(v: &[f32], format: KvFormat) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = vec![0u8; format.byte_at(v.len())];
    kv_encode(format, v, &mut bytes).unwrap();
    let mut back = vec![0f32; v.len()];
    kv_decode(format, &bytes, &mut back).unwrap();
    (bytes, back)
}

/// Plain two-pass f64 attention: query `i` meets keys `0..=start + i`.
#[allow(clippy::too_many_arguments)]
fn reference_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_q: usize,
    start: usize,
    nh: usize,
    kvh: usize,
    hd: usize,
    round_q: bool,
) -> Vec<f64> {
    let scale = 1.0 / (hd as f64).sqrt();
    let kvd = kvh * hd;
    let mut out = vec![0f64; n_q * nh * hd];
    for i in 0..n_q {
        for h in 0..nh {
            let kh = h / (nh / kvh);
            let qi: Vec<f64> = q[(i * nh + h) * hd..][..hd]
                .iter()
                .map(|x| {
                    if round_q {
                        f64::from(half::f16::from_f32(*x).to_f32())
                    } else {
                        f64::from(*x)
                    }
                })
                .collect();
            let total = start + i + 1;
            let s: Vec<f64> = (0..total)
                .map(|j| {
                    let kr = &k[j * kvd + kh * hd..][..hd];
                    qi.iter()
                        .zip(kr)
                        .map(|(a, b)| a * f64::from(*b))
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = p.iter().sum();
            for d in 0..hd {
                out[(i * nh + h) * hd + d] = (0..total)
                    .map(|j| p[j] * f64::from(v[j * kvd + kh * hd + d]))
                    .sum::<f64>()
                    / z;
            }
        }
    }
    out
}

/// Attention over caches in every storage format (f32, f16 and bf16 with heads of 40 and 64 values;
/// e4m3, q8, q4 and the q6 pair with heads of 64, the quantised groups being whole in a head),
/// 1 and 5 queries after 0, 37 and 300 cached positions, 6 query heads over 2 kv heads and 12
/// over 1 (wider than one CUDA block takes), in tiles of 1, 4 and 256 keys: within 2e-6 of the
/// f64 softmax over the rows the codec decodes (2e-3 with f16 operands, whose weights are
/// rounded to f16 against a running maximum; 1e-5 for the 300-position rows, whose sums are
/// longer). On CUDA the keys are split across blocks where the scratch allows (after 37 and
/// 300 positions the split kernel and its reduce run), cut to a scratch with room for two
/// splits, and unsplit without one.
fn attention_matches_an_f64_softmax<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0xa77e);
    for (nh, kvh) in [(6, 2), (12, 1)] {
        for hd in [40, 64] {
            for (n_q, start) in [(1, 0), (5, 0), (1, 37), (5, 37), (1, 300), (5, 300)] {
                attention_case(b, &mut rng, (nh, kvh, hd), n_q, start)?;
            }
        }
    }
    // refused shapes and short buffers, each naming the problem
    let qb = f32s(b, &[0.0; 64])?;
    let kb = f32s(b, &[0.0; 64])?;
    let mut out = b.alloc(256)?;
    let mut att = |n_heads, kv_heads, start| {
        b.run(Op::Attention {
            window: 0,
            softcap: 0.0,
            cache_rows: 64,
            k_format: KvFormat::F32,
            v_format: KvFormat::F32,
            n_heads,
            kv_heads,
            head_dim: 16,
            n_q: 1,
            start,
            scale: 0.25,
            tile: 8,
            f16_operands: false,
            q: &qb,
            k: &kb,
            v: &kb,
            out: &mut out,
            scratch: None,
            start_at: None,
            q8_next: false,
        })
        .unwrap_err()
        .to_string()
    };
    let e = att(3, 2, 0);
    assert!(
        e.contains("3 query heads are not a non-zero multiple of 2 kv heads"),
        "{e}"
    );
    // 4 rows of one kv head of 16 fit in 64 values; 5 do not
    let e = att(2, 1, 4);
    assert!(e.contains("expected 320, got 256"), "{e}");
    b.synchronize()
}
test_device!(attention_matches_an_f64_softmax);

/// One shape of [`attention_matches_an_f64_softmax`], in every format its head takes.
fn attention_case<B: Backend>(
    b: &B,
    rng: &mut Rng,
    (nh, kvh, hd): (usize, usize, usize),
    n_q: usize,
    start: usize,
) -> Result<()> {
    let rows = start + n_q;
    let q = rng.vec(n_q * nh * hd, 2.0);
    let k = rng.vec(rows * kvh * hd, 2.0);
    let v = rng.vec(rows * kvh * hd, 1.0);
    let qb = f32s(b, &q)?;
    let mut formats = vec![
        (KvFormat::F32, KvFormat::F32),
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::BF16, KvFormat::BF16),
    ];
    if hd % 32 == 0 {
        formats.extend([
            (KvFormat::E4M3, KvFormat::E4M3),
            (KvFormat::Q8, KvFormat::Q8),
            (KvFormat::Q4, KvFormat::Q4),
            (KvFormat::Q8, KvFormat::Q4),
        ]);
    }
    // what the plan reserves per device, and room for two splits of this call
    let full = nh * sources::ATTENTION_MAX_SPLITS * (hd + 2);
    let two = sources::attention_scratch_values(n_q, nh, hd, 2).unwrap();
    for (k_format, v_format) in formats {
        let (kbytes, kf) = cache_rows(&k, k_format);
        let (vbytes, vf) = cache_rows(&v, v_format);
        let (kb, vb) = (upload(b, &kbytes)?, upload(b, &vbytes)?);
        for f16_operands in [false, true] {
            let want = reference_attention(&q, &kf, &vf, n_q, start, nh, kvh, hd, f16_operands);
            for (tile, room) in [(1, full), (4, full), (256, full), (256, two), (256, 0)] {
                let mut out = b.alloc(q.len() * 4)?;
                let mut scratch = if room > 0 {
                    Some(b.alloc(room * 4)?)
                } else {
                    None
                };
                b.run(Op::Attention {
                    window: 0,
                    softcap: 0.0,
                    cache_rows: rows,
                    k_format,
                    v_format,
                    n_heads: nh,
                    kv_heads: kvh,
                    head_dim: hd,
                    n_q,
                    start,
                    scale: 1.0 / (hd as f32).sqrt(),
                    tile,
                    f16_operands,
                    q: &qb,
                    k: &kb,
                    v: &vb,
                    out: &mut out,
                    scratch: scratch.as_mut(),
                    start_at: None,
                    q8_next: false,
                })?;
                let got = download_f32(b, &out, q.len())?;
                let tol = match (f16_operands, rows > 64) {
                    (true, _) => 2e-3,
                    (false, false) => 2e-6,
                    (false, true) => 1e-5,
                };
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(*g) - w).abs() <= tol,
                        "{} attention {k_format:?}/{v_format:?} {nh}/{kvh} heads of {hd} n_q {n_q} \
                         start {start} f16 ops {f16_operands} tile {tile} scratch {room}: value \
                         {i}: {g} vs {w}",
                        b.name()
                    );
                }
            }
        }
    }
    Ok(())
}

/// Gemma's operations: GeGLU with the tanh GELU and the scale in place against their f64 closed
/// forms, and attention with a sliding window and a logit soft-cap against an f64 softmax over
/// the window's capped scores (1 and 6 queries after 0, 9 and 40 cached positions, windows of
/// 1, 4 and 8, caps of 0 and 3, split across blocks on CUDA where the scratch allows).
fn gemma_ops_match_their_definitions<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x6e33);
    let n = 3000;
    let (x, y) = (rng.vec(n, 4.0), rng.vec(n, 2.0));
    let yb = f32s(b, &y)?;
    let mut gb = f32s(b, &x)?;
    b.run(Op::GeGluTanhInPlace {
        n,
        gate: &mut gb,
        up: &yb,
    })?;
    let got = download_f32(b, &gb, n)?;
    for i in 0..n {
        let (g, u) = (f64::from(x[i]), f64::from(y[i]));
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let want = 0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u;
        assert!(
            close(got[i], want, 2e-6),
            "{} geglu at {i}: {} vs {want}",
            b.name(),
            got[i]
        );
    }
    let mut xb = f32s(b, &x)?;
    b.run(Op::ScaleInPlace {
        n,
        s: 8.0,
        x: &mut xb,
    })?;
    let got = download_f32(b, &xb, n)?;
    for i in 0..n {
        assert_eq!(got[i], x[i] * 8.0, "{} scale at {i}", b.name());
    }

    let (nh, kvh, hd) = (4, 2, 32);
    let kvd = kvh * hd;
    for (n_q, start) in [(1, 0), (6, 0), (1, 9), (6, 9), (1, 40), (6, 40)] {
        let rows = start + n_q;
        let q = rng.vec(n_q * nh * hd, 2.0);
        let k = rng.vec(rows * kvd, 2.0);
        let v = rng.vec(rows * kvd, 1.0);
        let (qb, kb, vb) = (f32s(b, &q)?, f32s(b, &k)?, f32s(b, &v)?);
        for window in [1, 4, 8] {
            for cap in [0.0f32, 3.0] {
                let scale = 1.0 / (hd as f64).sqrt();
                let mut want = vec![0f64; q.len()];
                for i in 0..n_q {
                    let p = start + i;
                    let lo = (p + 1).saturating_sub(window);
                    for h in 0..nh {
                        let kh = h / (nh / kvh);
                        let qi = &q[(i * nh + h) * hd..][..hd];
                        let s: Vec<f64> = (lo..=p)
                            .map(|j| {
                                let kr = &k[j * kvd + kh * hd..][..hd];
                                let d: f64 = qi
                                    .iter()
                                    .zip(kr)
                                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                                    .sum();
                                let w = d * scale;
                                if cap > 0.0 {
                                    f64::from(cap) * (w / f64::from(cap)).tanh()
                                } else {
                                    w
                                }
                            })
                            .collect();
                        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                        let z: f64 = e.iter().sum();
                        for d in 0..hd {
                            want[(i * nh + h) * hd + d] = (lo..=p)
                                .zip(&e)
                                .map(|(j, e)| e * f64::from(v[j * kvd + kh * hd + d]))
                                .sum::<f64>()
                                / z;
                        }
                    }
                }
                let full = nh * sources::ATTENTION_MAX_SPLITS * (hd + 2);
                for (tile, room) in [(1, full), (256, full), (256, 0)] {
                    let mut out = b.alloc(q.len() * 4)?;
                    let mut scratch = if room > 0 {
                        Some(b.alloc(room * 4)?)
                    } else {
                        None
                    };
                    b.run(Op::Attention {
                        k_format: KvFormat::F32,
                        v_format: KvFormat::F32,
                        n_heads: nh,
                        kv_heads: kvh,
                        head_dim: hd,
                        n_q,
                        start,
                        scale: scale as f32,
                        window,
                        softcap: cap,
                        cache_rows: rows,
                        tile,
                        f16_operands: false,
                        q: &qb,
                        k: &kb,
                        v: &vb,
                        out: &mut out,
                        scratch: scratch.as_mut(),
                        start_at: None,
                        q8_next: false,
                    })?;
                    let got = download_f32(b, &out, q.len())?;
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (f64::from(*g) - w).abs() <= 2e-6,
                            "{} attention n_q {n_q} start {start} window {window} cap {cap} \
                             tile {tile} scratch {room}: value {i}: {g} vs {w}",
                            b.name()
                        );
                    }
                }
            }
        }
    }
    b.synchronize()
}
test_device!(gemma_ops_match_their_definitions);

/// A sliding-window layer's cache as a ring (`cache_rows`: the key at position `p` in row
/// `p % cache_rows`) gives attention the bits of the same cache holding every position: decode
/// steps (given their position, and reading it from device memory over a span), calls of 5
/// queries, and prompts of 24 (CUDA's prompt kernel), with their keys wrapping past the ring's
/// end, for f16 and the q8/q4 caches, split across blocks where the scratch allows; RoPE with
/// the cache store writes a token past the ring's end at its row. A call whose own keys would
/// overwrite keys it reads is refused by name.
fn attention_over_a_ring_is_attention_over_every_position<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x5a1d);
    let (nh, kvh, hd) = (4usize, 2usize, 64usize);
    let kvd = kvh * hd;
    let scratch_values = nh * sources::ATTENTION_MAX_SPLITS * (hd + 2);
    // (window, ring rows, queries, first position): each ring holds the window and the queries
    for (window, ring, n_q, start) in [
        (8, 16, 1, 57),
        (8, 16, 5, 60),
        (8, 40, 24, 90),
        (32, 64, 1, 301),
        (32, 64, 24, 250),
    ] {
        let keys = start + n_q;
        let q = rng.vec(n_q * nh * hd, 2.0);
        let kx = rng.vec(keys * kvd, 2.0);
        let vx = rng.vec(keys * kvd, 1.0);
        let qb = f32s(b, &q)?;
        for (kf, vf) in [(KvFormat::F16, KvFormat::F16), (KvFormat::Q8, KvFormat::Q4)] {
            let what = format!(
                "{} {kf:?}/{vf:?} window {window} ring {ring} {n_q} at {start}",
                b.name()
            );
            let (kfull, _) = cache_rows(&kx, kf);
            let (vfull, _) = cache_rows(&vx, vf);
            // the ring as a cache leaves it: row r holds the last position p with p % ring == r
            let ring_of = |full: &[u8], f: KvFormat| {
                let row = f.byte_at(kvd);
                let mut out = vec![0u8; ring * row];
                for p in keys.saturating_sub(ring)..keys {
                    let r = p % ring;
                    out[r * row..(r + 1) * row].copy_from_slice(&full[p * row..(p + 1) * row]);
                }
                out
            };
            let (kring, vring) = (ring_of(&kfull, kf), ring_of(&vfull, vf));
            let run =
                |k: &[u8], v: &[u8], rows: usize, at: Option<&B::Buffer>| -> Result<Vec<f32>> {
                    let (kb, vb) = (upload(b, k)?, upload(b, v)?);
                    let mut out = b.alloc(q.len() * 4)?;
                    let mut scratch = b.alloc(scratch_values * 4)?;
                    b.run(Op::Attention {
                        k_format: kf,
                        v_format: vf,
                        n_heads: nh,
                        kv_heads: kvh,
                        head_dim: hd,
                        n_q,
                        start,
                        scale: 0.125,
                        window,
                        softcap: 0.0,
                        cache_rows: rows,
                        tile: 16,
                        f16_operands: false,
                        q: &qb,
                        k: &kb,
                        v: &vb,
                        out: &mut out,
                        scratch: Some(&mut scratch),
                        start_at: at.map(|positions| StartAt {
                            positions,
                            span: sources::attention_decode_span(keys, 1 << 20),
                        }),
                        q8_next: false,
                    })?;
                    download_f32(b, &out, q.len())
                };
            let pos = upload(b, bytemuck::cast_slice(&[start as i32]))?;
            let forms: &[Option<&B::Buffer>] = if n_q == 1 {
                &[None, Some(&pos)]
            } else {
                &[None]
            };
            for &at in forms {
                let full = run(&kfull, &vfull, keys, at)?;
                let got = run(&kring, &vring, ring, at)?;
                let same = got
                    .iter()
                    .zip(&full)
                    .all(|(g, w)| g.to_bits() == w.to_bits());
                assert!(
                    same,
                    "{what} (position on the device: {}): ring and full differ",
                    at.is_some()
                );
                assert!(full.iter().all(|x| x.is_finite()), "{what}");
            }
        }
    }
    // the queries of a call see more positions than the ring holds: refused by name
    let kb = f32s(b, &vec![0.5; 16 * kvd])?;
    let qb = f32s(b, &vec![0.5; 10 * nh * hd])?;
    let mut out = b.alloc(10 * nh * hd * 4)?;
    let e = b
        .run(Op::Attention {
            k_format: KvFormat::F32,
            v_format: KvFormat::F32,
            n_heads: nh,
            kv_heads: kvh,
            head_dim: hd,
            n_q: 10,
            start: 100,
            scale: 0.125,
            window: 8,
            softcap: 0.0,
            cache_rows: 16,
            tile: 16,
            f16_operands: false,
            q: &qb,
            k: &kb,
            v: &kb,
            out: &mut out,
            scratch: None,
            start_at: None,
            q8_next: false,
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("see the keys of 17 positions (window 8), more than the cache's 16 rows hold"),
        "{e}"
    );
    b.synchronize()
}
test_device!(attention_over_a_ring_is_attention_over_every_position);

/// Views read and write their part of a buffer in place; overlapping or out-of-range parts are
/// errors.
#[allow(unsafe_code)]
fn views_are_parts_of_their_buffer<B: Backend>(b: &B) -> Result<()> {
    let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let mut buf = f32s(b, &x)?;
    let ones = f32s(b, &[1.0; 16])?;
    {
        // SAFETY: the parts are dropped at the end of this block, before `buf` is used again.
        let mut parts = unsafe { b.split(&mut buf, &[(64, 64), (192, 32)]) }?;
        assert_eq!(b.len(&parts[0]), 64);
        b.run(Op::AddInPlace {
            n: 16,
            x: &mut parts[0],
            y: &ones,
        })?;
        // a part is offset 0 for copies too: write 8 values at its byte 0
        b.copy_from_host(bytemuck::cast_slice(&[-1f32; 8]), &mut parts[1], 0)?;
        let e = b
            .run(Op::AddInPlace {
                n: 9,
                x: &mut parts[1],
                y: &ones,
            })
            .unwrap_err();
        assert!(e.to_string().contains("expected 36, got 32"), "{e}");
    }
    let got = download_f32(b, &buf, 64)?;
    for (i, g) in got.iter().enumerate() {
        let want = match i {
            16..32 => i as f32 + 1.0,
            48..56 => -1.0,
            _ => i as f32,
        };
        assert_eq!(
            *g,
            want,
            "{} value {i} after writing through parts",
            b.name()
        );
    }
    {
        // SAFETY: the view is dropped at the end of this block and nothing writes through it.
        let view = unsafe { b.view(&buf, 32 * 4, 16 * 4) }?;
        let mut out = b.alloc(64)?;
        b.run(Op::Add {
            n: 16,
            a: &view,
            b: &ones,
            out: &mut out,
        })?;
        let got = download_f32(b, &out, 16)?;
        assert_eq!(got, (33..49).map(|i| i as f32).collect::<Vec<_>>());
        let mut host = [0u8; 8];
        b.copy_to_host(&view, 8, &mut host)?;
        assert_eq!(
            host,
            [34f32.to_le_bytes(), 35f32.to_le_bytes()].concat()[..]
        );
    }
    // SAFETY: the calls fail before any view exists.
    let Err(e) = (unsafe { b.split(&mut buf, &[(0, 64), (60, 8)]) }) else {
        panic!("{}: overlapping parts were made", b.name());
    };
    assert!(
        e.to_string()
            .contains("byte range 60..68 overlaps one ending at 64"),
        "{e}"
    );
    // SAFETY: as above.
    let Err(e) = (unsafe { b.view(&buf, 250, 8) }) else {
        panic!("{}: a view past the end was made", b.name());
    };
    assert!(
        e.to_string().contains("view bytes: expected 258, got 256"),
        "{e}"
    );
    b.synchronize()
}
test_device!(views_are_parts_of_their_buffer);

/// One token through `Op::Matmul` on the CPU is the matrix-vector product, bit for bit (the
/// engine's host forward pass calls `matvec` for one token, and the backend path must agree).
#[test]
fn cpu_matmul_of_one_token_is_the_matvec() -> Result<()> {
    let b = CpuBackend::new();
    let f = common::load("q4_1");
    let cols = 256;
    let rows = f.want.len() / cols;
    let x = Rng(5).vec(cols, 1.0);
    let (w, xb) = (upload(&b, &f.raw)?, f32s(&b, &x)?);
    for mode in [MatvecMode::Exact, MatvecMode::Q8] {
        let mut y = b.alloc(rows * 4)?;
        b.run(Op::Matmul {
            ty: f.ty,
            mode,
            act: FloatType::F32,
            rows,
            cols,
            n_tok: 1,
            max_dq_size: 1 << 20,
            w: &w,
            x: &xb,
            y: &mut y,
        })?;
        let mut want = vec![0f32; rows];
        matvec(mode, f.ty, &f.raw, rows, cols, &x, &mut want)?;
        assert_eq!(download_f32(&b, &y, rows)?, want, "{mode:?}");
    }
    Ok(())
}

/// Borrowed host memory is a buffer of the backend that reads and writes it in place, without
/// counting against the backend's capacity.
#[test]
#[allow(unsafe_code)]
fn cpu_borrowed_memory_is_computed_on_in_place() -> Result<()> {
    let b = CpuBackend::with_capacity("virtual:0", 64);
    let mut acc = vec![1f32; 100];
    let add = vec![2f32; 100];
    {
        // SAFETY: both views are dropped at the end of this block, while `acc` and `add` live,
        // and nothing writes through `y`.
        let (mut x, y) = unsafe {
            (
                b.borrow_mut(bytemuck::cast_slice_mut(&mut acc)),
                b.borrow(bytemuck::cast_slice(&add)),
            )
        };
        assert!(x.is_view() && b.allocated() == 0);
        b.run(Op::AddInPlace {
            n: 100,
            x: &mut x,
            y: &y,
        })?;
    }
    assert!(acc.iter().all(|v| *v == 3.0));
    assert_eq!(b.allocated(), 0);
    // a view at an odd address cannot be read as f32: an error, not a panic
    let words = [0u32; 16];
    let bytes: &[u8] = bytemuck::cast_slice(&words);
    // SAFETY: dropped at the end of the statement; read only.
    let odd = unsafe { b.borrow(&bytes[1..33]) };
    let e = odd.typed::<f32>("odd values", 4).unwrap_err();
    assert!(e.to_string().contains("not aligned to 4"), "{e}");
    Ok(())
}

/// The device-position forms of decode's ops (what a captured CUDA graph replays): RoPE with
/// the cache store given whole cache layers of 40 rows writes each token at the row of its
/// position, `position % 40` (5 and 111 here: rows 5 and 31, a sliding-window layer's ring),
/// the bytes the rows form writes there, and nothing else; attention reading its position from
/// the positions buffer, with the keys split over the 300-row span, gives the call with that
/// `start` (the same bits on the CPU, within the reference's bound on CUDA, whose splits
/// differ), with its scratch as the plan sizes it. A negative position (or one whose queries
/// pass the span) is refused by the CPU backend and writes nothing on CUDA, which does not read
/// it on the host.
fn decode_ops_read_the_position_from_device_memory<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0xd3c0);
    let (n_heads, kv_heads, hd, cap) = (4usize, 2usize, 64usize, 40usize);
    let kvd = kv_heads * hd;
    let params = RopeParams {
        style: RopeStyle::Neox,
        head_dim: hd,
        n_dims: hd,
        freq_base: 10000.0,
        freq_scale: 1.0,
        attn_factor: 1.0,
    };
    let fb = f32s(b, &rope_inv_freqs(&params, None)?)?;
    let bytes = |buf: &B::Buffer, off: usize, n: usize| -> Result<Vec<u8>> {
        let mut out = vec![0u8; n];
        b.copy_to_host(buf, off, &mut out)?;
        Ok(out)
    };
    let formats = [
        (KvFormat::F32, KvFormat::F32),
        (KvFormat::F16, KvFormat::F16),
        (KvFormat::BF16, KvFormat::BF16),
        (KvFormat::E4M3, KvFormat::E4M3),
        (KvFormat::Q8, KvFormat::Q8),
        (KvFormat::Q4, KvFormat::Q4),
        (KvFormat::Q8, KvFormat::Q4),
    ];
    let pos = [5i32, 111];
    let pb = upload(b, bytemuck::cast_slice(&pos))?;
    for (kf, vf) in formats {
        let what = format!("{} {kf:?}/{vf:?}", b.name());
        let (q, k, v) = (
            rng.vec(2 * n_heads * hd, 2.0),
            rng.vec(2 * kvd, 2.0),
            rng.vec(2 * kvd, 2.0),
        );
        let vb = f32s(b, &v)?;
        let (mut qb, mut kb) = (f32s(b, &q)?, f32s(b, &k)?);
        let mut kc = b.alloc(kf.byte_at(cap * kvd))?;
        let mut vc = b.alloc(vf.byte_at(cap * kvd))?;
        b.run(Op::RopeKvStore {
            params,
            n_tok: 2,
            n_heads,
            kv_heads,
            q: &mut qb,
            k: &mut kb,
            v: &vb,
            positions: &pb,
            inv_freqs: &fb,
            k_format: kf,
            v_format: vf,
            k_cache: &mut kc,
            v_cache: &mut vc,
            cache_rows: Some(cap),
        })?;
        // the rows form, a token at a time, into rows of their own
        let mut want_q = Vec::new();
        for t in 0..2 {
            let one = |x: &[f32], per: usize| f32s(b, &x[t * per..(t + 1) * per]);
            let (mut q1, mut k1, v1) = (one(&q, n_heads * hd)?, one(&k, kvd)?, one(&v, kvd)?);
            let p1 = upload(b, bytemuck::cast_slice(&pos[t..t + 1]))?;
            let (mut kr, mut vr) = (b.alloc(kf.byte_at(kvd))?, b.alloc(vf.byte_at(kvd))?);
            b.run(Op::RopeKvStore {
                params,
                n_tok: 1,
                n_heads,
                kv_heads,
                q: &mut q1,
                k: &mut k1,
                v: &v1,
                positions: &p1,
                inv_freqs: &fb,
                k_format: kf,
                v_format: vf,
                k_cache: &mut kr,
                v_cache: &mut vr,
                cache_rows: None,
            })?;
            want_q.extend(download_f32(b, &q1, n_heads * hd)?);
            let row = pos[t] as usize % cap;
            assert_eq!(
                bytes(&kc, kf.byte_at(row * kvd), kf.byte_at(kvd))?,
                bytes(&kr, 0, kf.byte_at(kvd))?,
                "{what}: key row {row}"
            );
            assert_eq!(
                bytes(&vc, vf.byte_at(row * kvd), vf.byte_at(kvd))?,
                bytes(&vr, 0, vf.byte_at(kvd))?,
                "{what}: value row {row}"
            );
        }
        let got_q = download_f32(b, &qb, q.len())?;
        let same = got_q
            .iter()
            .zip(&want_q)
            .all(|(g, w)| g.to_bits() == w.to_bits());
        assert!(same, "{what}: queries");
        // every other row is untouched
        for row in (0..cap).filter(|r| pos.iter().all(|&p| p as usize % cap != *r)) {
            let k_row = bytes(&kc, kf.byte_at(row * kvd), kf.byte_at(kvd))?;
            assert!(k_row.iter().all(|&x| x == 0), "{what}: key row {row}");
            let v_row = bytes(&vc, vf.byte_at(row * kvd), vf.byte_at(kvd))?;
            assert!(v_row.iter().all(|&x| x == 0), "{what}: value row {row}");
        }
    }
    // a negative position: refused, or nothing written
    let (mut qb, mut kb, vb) = (
        f32s(b, &[0.5; 4 * 64])?,
        f32s(b, &[0.5; 2 * 64])?,
        f32s(b, &[0.5; 2 * 64])?,
    );
    let past = upload(b, bytemuck::cast_slice(&[-1i32]))?;
    let mut kc = b.alloc(cap * kvd * 4)?;
    let mut vc = b.alloc(cap * kvd * 4)?;
    let r = b.run(Op::RopeKvStore {
        params,
        n_tok: 1,
        n_heads,
        kv_heads,
        q: &mut qb,
        k: &mut kb,
        v: &vb,
        positions: &past,
        inv_freqs: &fb,
        k_format: KvFormat::F32,
        v_format: KvFormat::F32,
        k_cache: &mut kc,
        v_cache: &mut vc,
        cache_rows: Some(cap),
    });
    match r {
        Err(e) => assert!(
            e.to_string()
                .contains("token 0 is at position -1, which no row of the cache's 40 rows holds"),
            "{e}"
        ),
        Ok(()) => {
            let k_all = bytes(&kc, 0, cap * kvd * 4)?;
            assert!(k_all.iter().all(|&x| x == 0), "{}: a row written", b.name());
        }
    }

    // attention after 0, 37 and 298 positions of a 300-row span
    let span = 300;
    let kx = rng.vec(span * kvd, 2.0);
    let vx = rng.vec(span * kvd, 1.0);
    let scratch_values = n_heads * sources::ATTENTION_MAX_SPLITS * (hd + 2);
    for (kf, vf) in [(KvFormat::F16, KvFormat::F16), (KvFormat::Q8, KvFormat::Q4)] {
        let (kbytes, _) = cache_rows(&kx, kf);
        let (vbytes, _) = cache_rows(&vx, vf);
        let (kb, vb) = (upload(b, &kbytes)?, upload(b, &vbytes)?);
        for start in [0usize, 37, 298] {
            let what = format!("{} {kf:?}/{vf:?} at {start}", b.name());
            let q = rng.vec(n_heads * hd, 2.0);
            let qb = f32s(b, &q)?;
            let pos = upload(b, bytemuck::cast_slice(&[start as i32]))?;
            let run = |at: Option<&B::Buffer>| -> Result<Vec<f32>> {
                let mut out = b.alloc(q.len() * 4)?;
                let mut scratch = b.alloc(scratch_values * 4)?;
                b.run(Op::Attention {
                    window: 0,
                    softcap: 0.0,
                    cache_rows: span,
                    k_format: kf,
                    v_format: vf,
                    n_heads,
                    kv_heads,
                    head_dim: hd,
                    n_q: 1,
                    // not read when the position is
                    start: if at.is_some() { 7 } else { start },
                    scale: 0.125,
                    tile: 32,
                    f16_operands: false,
                    q: &qb,
                    k: &kb,
                    v: &vb,
                    out: &mut out,
                    scratch: Some(&mut scratch),
                    start_at: at.map(|positions| StartAt { positions, span }),
                    q8_next: false,
                })?;
                download_f32(b, &out, q.len())
            };
            let (given, read) = (run(None)?, run(Some(&pos))?);
            for (i, (g, w)) in read.iter().zip(&given).enumerate() {
                if !b.name().starts_with("cuda") {
                    assert_eq!(g.to_bits(), w.to_bits(), "{what}: value {i}");
                } else {
                    assert!((g - w).abs() <= 1e-5, "{what}: value {i}: {g} against {w}");
                }
            }
        }
        // one query from position 300 passes the span: refused, or nothing written
        let past = upload(b, bytemuck::cast_slice(&[span as i32]))?;
        let qb = f32s(b, &[0.5; 4 * 64])?;
        let mut out = b.alloc(4 * 64 * 4)?;
        let r = b.run(Op::Attention {
            window: 0,
            softcap: 0.0,
            cache_rows: span,
            k_format: kf,
            v_format: vf,
            n_heads,
            kv_heads,
            head_dim: hd,
            n_q: 1,
            start: 0,
            scale: 0.125,
            tile: 32,
            f16_operands: false,
            q: &qb,
            k: &kb,
            v: &vb,
            out: &mut out,
            scratch: None,
            start_at: Some(StartAt {
                positions: &past,
                span,
            }),
            q8_next: false,
        });
        match r {
            Err(e) => assert!(
                e.to_string()
                    .contains("1 queries from position 300 pass the span of 300 cache rows"),
                "{e}"
            ),
            Ok(()) => {
                let o = download_f32(b, &out, 4 * 64)?;
                assert!(
                    o.iter().all(|&x| x == 0.0),
                    "{}: an output written",
                    b.name()
                );
            }
        }
    }
    b.synchronize()
}
test_device!(decode_ops_read_the_position_from_device_memory);

/// On cuda:0, a captured graph of decode's fused ops (RoPE with the f16 cache store at the
/// position's row of a 1,024-row cache, attention reading its position from the same buffer,
/// the gate and up products with SwiGLU over f16 weights) replays them: after new queries, keys
/// and a new position are uploaded (outside the graph, as a decode step would), each replay
/// gives bit for bit what running the ops again gives (the caches and the attention output
/// too), and a different position turns the queries differently.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
// The replay touches buffers the graph recorded; the test keeps them alive (see below).
#[allow(unsafe_code)]
fn cuda_graph_replays_the_fused_decode_ops() -> Result<()> {
    let b = CudaBackend::new(0)?;
    let mut rng = Rng(0x96a9);
    let (n_heads, kv_heads, hd, rows, cols) = (8usize, 2usize, 64usize, 256usize, 512usize);
    let params = RopeParams {
        style: RopeStyle::Neox,
        head_dim: hd,
        n_dims: hd,
        freq_base: 10000.0,
        freq_scale: 1.0,
        attn_factor: 1.0,
    };
    let fb = f32s(&b, &rope_inv_freqs(&params, None)?)?;
    let f16_bytes = |v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect()
    };
    let wg = upload(&b, &f16_bytes(&rng.vec(rows * cols, 0.5)))?;
    let wu = upload(&b, &f16_bytes(&rng.vec(rows * cols, 0.5)))?;
    let kvn = kv_heads * hd;
    let cap = 1024;
    // one set of buffers for the graph, one for the ops run directly
    struct Set<T> {
        q: T,
        k: T,
        v: T,
        pos: T,
        kc: T,
        vc: T,
        att: T,
        part: T,
        x: T,
        gy: T,
        uy: T,
    }
    let set = |b: &CudaBackend| -> Result<Set<CudaBuffer>> {
        Ok(Set {
            q: b.alloc(n_heads * hd * 4)?,
            k: b.alloc(kvn * 4)?,
            v: b.alloc(kvn * 4)?,
            pos: b.alloc(4)?,
            kc: b.alloc(cap * kvn * 2)?,
            vc: b.alloc(cap * kvn * 2)?,
            att: b.alloc(n_heads * hd * 4)?,
            part: b.alloc(n_heads * sources::ATTENTION_MAX_SPLITS * (hd + 2) * 4)?,
            x: b.alloc(cols * 4)?,
            gy: b.alloc(rows * 4)?,
            uy: b.alloc(rows * 4)?,
        })
    };
    let run = |b: &CudaBackend, s: &mut Set<CudaBuffer>| -> Result<()> {
        b.run(Op::RopeKvStore {
            params,
            n_tok: 1,
            n_heads,
            kv_heads,
            q: &mut s.q,
            k: &mut s.k,
            v: &s.v,
            positions: &s.pos,
            inv_freqs: &fb,
            k_format: KvFormat::F16,
            v_format: KvFormat::F16,
            k_cache: &mut s.kc,
            v_cache: &mut s.vc,
            cache_rows: Some(cap),
        })?;
        b.run(Op::Attention {
            k_format: KvFormat::F16,
            v_format: KvFormat::F16,
            n_heads,
            kv_heads,
            head_dim: hd,
            n_q: 1,
            start: 0,
            scale: 0.125,
            window: 0,
            softcap: 0.0,
            cache_rows: cap,
            tile: 32,
            f16_operands: false,
            q: &s.q,
            k: &s.kc,
            v: &s.vc,
            out: &mut s.att,
            scratch: Some(&mut s.part),
            start_at: Some(StartAt {
                positions: &s.pos,
                span: cap,
            }),
            q8_next: false,
        })?;
        b.run(Op::MatmulSwiGlu {
            mode: MatvecMode::Exact,
            act: FloatType::F32,
            cols,
            n_tok: 1,
            max_dq_size: 1 << 20,
            x: &s.x,
            gate: Product {
                ty: QuantType::F16,
                rows,
                w: &wg,
                y: &mut s.gy,
            },
            up: Product {
                ty: QuantType::F16,
                rows,
                w: &wu,
                y: &mut s.uy,
            },
        })
    };
    let (mut g, mut d) = (set(&b)?, set(&b)?);
    // once directly on a third set, so every module is loaded before the capture and the two
    // compared hold the same rows
    run(&b, &mut set(&b)?)?;
    b.synchronize()?;
    let mut graph = b.capture(|b| run(b, &mut g))?;
    for p in [3i32, 900] {
        let (q, k, v, x) = (
            rng.vec(n_heads * hd, 1.0),
            rng.vec(kvn, 1.0),
            rng.vec(kvn, 1.0),
            rng.vec(cols, 1.0),
        );
        for s in [&mut g, &mut d] {
            b.copy_from_host(bytemuck::cast_slice(&q), &mut s.q, 0)?;
            b.copy_from_host(bytemuck::cast_slice(&k), &mut s.k, 0)?;
            b.copy_from_host(bytemuck::cast_slice(&v), &mut s.v, 0)?;
            b.copy_from_host(bytemuck::cast_slice(&[p]), &mut s.pos, 0)?;
            b.copy_from_host(bytemuck::cast_slice(&x), &mut s.x, 0)?;
        }
        // SAFETY: every buffer the graph recorded (`g`, the weights, the angles) lives until
        // the end of this test, and nothing else uses them while the replay runs (one stream).
        unsafe { b.replay(&mut graph) }?;
        run(&b, &mut d)?;
        let bytes = |buf: &CudaBuffer, n: usize| -> Result<Vec<u8>> {
            let mut out = vec![0u8; n];
            b.copy_to_host(buf, 0, &mut out)?;
            Ok(out)
        };
        for (what, gb, db, n) in [
            ("queries", &g.q, &d.q, n_heads * hd * 4),
            ("key cache", &g.kc, &d.kc, cap * kvn * 2),
            ("value cache", &g.vc, &d.vc, cap * kvn * 2),
            ("attention", &g.att, &d.att, n_heads * hd * 4),
            ("gated product", &g.gy, &d.gy, rows * 4),
        ] {
            assert_eq!(bytes(gb, n)?, bytes(db, n)?, "position {p}: {what}");
        }
        // the same queries at another position turn differently: the graph read the new one
        assert_ne!(download_f32(&b, &g.q, 1)?[0], q[0], "position {p}");
    }
    Ok(())
}

/// On cuda:0, a capture that fails still ends. A wait inside the recording is refused and
/// invalidates the capture; a buffer dropped after it is freed in stream order, which the
/// invalidated capture refuses too, inside the drop, where cudarc keeps the error for the next
/// call that binds the context (`end_capture`'s own). The capture returns an error, and the
/// stream is out of capture: allocations, copies and launches run on it as before.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn a_failed_capture_leaves_the_stream_running() -> Result<()> {
    let b = CudaBackend::new(0)?;
    let early = b.alloc(256)?;
    b.synchronize()?;
    let capture = b.capture(|b| {
        assert!(b.synchronize().is_err(), "a wait on a capturing stream");
        // freed on the invalidated capture
        let _freed = early;
        Ok(())
    });
    assert!(capture.is_err(), "an invalidated capture made a graph");
    let x = f32s(&b, &[1.0, 2.0, 3.0, 4.0])?;
    let mut y = f32s(&b, &[0.5; 4])?;
    b.run(Op::AddInPlace {
        n: 4,
        x: &mut y,
        y: &x,
    })?;
    assert_eq!(download_f32(&b, &y, 4)?, [1.5, 2.5, 3.5, 4.5]);
    Ok(())
}

/// On cuda:0, a decode product whose first run on a backend is recorded into a graph: the
/// quantised activations go to a scratch of the graph's own, not to the buffer the backend
/// keeps (made there, it would be the graph's memory: a replay would find it still allocated by
/// the last one, and a launch outside the graph would read it unmapped). The graph replays
/// twice, around a launched run of the same product, and all three agree bit for bit.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
// The replays touch buffers the graph recorded; the test keeps them alive (see below).
#[allow(unsafe_code)]
fn a_decode_product_first_run_in_a_capture_keeps_no_graph_memory() -> Result<()> {
    let b = CudaBackend::new(0)?;
    let mut rng = Rng(0x5eed);
    // Q8_0 rows: an f16 scale of 1/64 a block, then 32 quants
    let weights = |rng: &mut Rng, rows: usize, cols: usize| -> Result<CudaBuffer> {
        let blocks: Vec<u8> = (0..rows * cols / 32)
            .flat_map(|_| {
                let quants: Vec<u8> = rng.vec(32, 100.0).iter().map(|q| *q as i8 as u8).collect();
                [0x00u8, 0x24].into_iter().chain(quants)
            })
            .collect();
        upload(&b, &blocks)
    };
    let product = |b: &CudaBackend, w: &CudaBuffer, x: &CudaBuffer, y: &mut CudaBuffer| {
        let (rows, cols) = (b.len(y) / 4, b.len(x) / 4);
        b.run(Op::Matmul {
            ty: QuantType::Q8_0,
            mode: MatvecMode::Q8,
            act: FloatType::F32,
            rows,
            cols,
            n_tok: 1,
            max_dq_size: 1 << 20,
            w,
            x,
            y,
        })
    };
    // the module and both kernels loaded first, as a decode step's warm-up loads them, by a
    // token too long for the kept buffer (1,664 blocks of 40 bytes), so none is made yet
    let long = 53_248;
    let mut y1 = b.alloc(4)?;
    product(
        &b,
        &weights(&mut rng, 1, long)?,
        &f32s(&b, &rng.vec(long, 1.0))?,
        &mut y1,
    )?;
    b.synchronize()?;
    let (rows, cols) = (64usize, 256usize);
    let w = weights(&mut rng, rows, cols)?;
    let x = f32s(&b, &rng.vec(cols, 1.0))?;
    let mut y = b.alloc(rows * 4)?;
    let mut graph = b.capture(|b| product(b, &w, &x, &mut y))?;
    // SAFETY: the weights, activations and `y` the graph recorded live until the end of this
    // test, and nothing else uses them while a replay runs (one stream).
    unsafe { b.replay(&mut graph) }?;
    let first = download_f32(&b, &y, rows)?;
    let mut launched = b.alloc(rows * 4)?;
    product(&b, &w, &x, &mut launched)?;
    assert_eq!(download_f32(&b, &launched, rows)?, first);
    // SAFETY: as above.
    unsafe { b.replay(&mut graph) }?;
    assert_eq!(download_f32(&b, &y, rows)?, first);
    Ok(())
}

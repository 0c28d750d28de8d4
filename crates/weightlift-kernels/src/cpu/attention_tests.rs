use super::*;
use crate::cpu::attention_rows::round_f16;

/// Deterministic values in [−a, a) (xorshift64*).
fn values(seed: u64, n: usize, a: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * a
        })
        .collect()
}

/// Queries and cache rows for a shape; the queries are large enough that the softmax is peaked
/// (the fold's rescaling matters) and some keys fall far below the maximum.
struct Case {
    shape: AttnShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

fn case(heads: (usize, usize, usize), n_q: usize, start: usize, f16: bool, seed: u64) -> Case {
    let (nh, kvh, hd) = heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let shape = AttnShape::new(nh, kvh, hd, n_q, start, scale, f16).unwrap();
    let keys = start + n_q;
    Case {
        shape,
        q: values(seed, shape.q_values(), 3.0),
        k: values(seed + 1, keys * shape.kv_dim(), 2.0),
        v: values(seed + 2, keys * shape.kv_dim(), 1.0),
    }
}

fn run(isa: Isa, c: &Case, tile: usize) -> Vec<f32> {
    let mut out = vec![0f32; c.shape.q_values()];
    attention_with(isa, c.shape, tile, &c.q, &c.k, &c.v, &mut out).unwrap();
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Heads (n_heads, kv_heads, head_dim): SmolLM2's, plain multi-head, one kv head for eight,
/// wide heads, and sizes only some forms take (8: AVX2 only; 24: AVX2 on either SIMD level;
/// 144: fewer keys per step; 320: the scalar form everywhere).
const HEADS: [(usize, usize, usize); 8] = [
    (9, 3, 64),
    (4, 4, 32),
    (8, 1, 16),
    (6, 2, 128),
    (2, 1, 8),
    (3, 1, 24),
    (4, 2, 144),
    (2, 1, 320),
];

/// (n_q, start, tile): decode steps inside and across fold steps and tiles, prompts shorter and
/// longer than a tile, a prompt after a cached prefix, and tiles smaller than a fold step.
const SPANS: [(usize, usize, usize); 7] = [
    (1, 0, 256),
    (1, 75, 256),
    (1, 300, 256),
    (40, 0, 256),
    (33, 100, 64),
    (7, 5, 3),
    (70, 0, 20),
];

#[test]
fn the_tiled_form_gives_the_scalar_levels_bits_on_every_instruction_set() {
    for (i, heads) in HEADS.into_iter().enumerate() {
        for (j, (n_q, start, tile)) in SPANS.into_iter().enumerate() {
            for f16 in [false, true] {
                let c = case(heads, n_q, start, f16, (i * 16 + j) as u64);
                assert_eq!(c.shape.tiled(), n_q >= TILED_MIN_QUERIES);
                let want = run(Isa::Scalar, &c, tile);
                for isa in Isa::all_supported() {
                    let got = run(isa, &c, tile);
                    let what = format!(
                        "{isa:?} heads {heads:?} n_q {n_q} start {start} tile {tile} f16 {f16}"
                    );
                    if c.shape.tiled() {
                        assert!(bits(&got) == bits(&want), "{what}");
                    } else {
                        // the step form sums q·k in each level's own order
                        let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs());
                        let tol = if f16 { 2e-3 } else { 1e-5 };
                        assert!(d.fold(0f32, f32::max) <= tol, "{what}");
                    }
                }
            }
        }
    }
}

#[test]
fn round_f16_is_the_half_crates_rounding() {
    let mut b = 0u32;
    loop {
        let x = f32::from_bits(b);
        let want = half::f16::from_f32(x).to_f32();
        let got = round_f16(x);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "{x:e} ({b:#010x}): {got:e} against {want:e}"
        );
        match b.checked_add(4093) {
            Some(n) => b = n,
            None => break,
        }
    }
    for x in [
        65504.0f32,
        65519.996,
        65520.0,
        6.1035156e-5,
        6.1035153e-5,
        2.9802322e-8,
        1e-9,
    ] {
        for x in [x, -x] {
            assert_eq!(
                round_f16(x).to_bits(),
                half::f16::from_f32(x).to_f32().to_bits()
            );
        }
    }
}

/// Plain softmax attention in f64 (q, and p when `f16`, rounded as the kernel documents).
fn reference(c: &Case) -> Vec<f64> {
    let s = c.shape;
    let (nh, hd, kvd) = (s.n_heads, s.head_dim, s.kv_dim());
    let group = nh / s.kv_heads;
    let r16 = |x: f32| if s.f16_operands { round_f16(x) } else { x };
    let mut out = vec![0f64; s.q_values()];
    for t in 0..s.n_q {
        for h in 0..nh {
            let q = &c.q[(t * nh + h) * hd..][..hd];
            let kh = h / group;
            let keys = s.start + t + 1;
            let w: Vec<f64> = (0..keys)
                .map(|j| {
                    let k = &c.k[j * kvd + kh * hd..][..hd];
                    let dot: f64 = q
                        .iter()
                        .zip(k)
                        .map(|(a, b)| f64::from(r16(*a)) * f64::from(*b))
                        .sum();
                    dot * f64::from(s.scale)
                })
                .collect();
            let m = w.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = w.iter().map(|x| (x - m).exp()).collect();
            let l: f64 = p.iter().sum();
            let o = &mut out[(t * nh + h) * hd..][..hd];
            for (j, pj) in p.iter().enumerate() {
                let v = &c.v[j * kvd + kh * hd..][..hd];
                for (x, vv) in o.iter_mut().zip(v) {
                    *x += pj / l * f64::from(*vv);
                }
            }
        }
    }
    out
}

#[test]
fn matches_plain_softmax_attention_in_f64() {
    for heads in [(9, 3, 64), (6, 2, 128), (3, 1, 24)] {
        for (n_q, start, tile) in [(1, 300, 256), (40, 0, 256), (33, 100, 64), (7, 5, 3)] {
            for f16 in [false, true] {
                let c = case(heads, n_q, start, f16, 7);
                let want = reference(&c);
                // f32 sums over ≤ 320 terms and a 1.5-ulp exp; rounding each weight to f16
                // (relative 2⁻¹¹, renormalised by a sum of the same rounded weights) costs
                // a few parts in 10⁴ of the largest value
                let tol = if f16 { 1e-3 } else { 2e-6 };
                for isa in Isa::all_supported() {
                    let got = run(isa, &c, tile);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (f64::from(*g) - w).abs() <= tol,
                            "{isa:?} {heads:?} n_q {n_q} start {start} f16 {f16} value {i}: {g} against {w}"
                        );
                    }
                }
            }
        }
    }
}

/// The engine folds queries `q_tile` at a time: neither that split nor the thread count
/// changes a row's bits.
#[test]
fn query_splits_and_threads_keep_the_bits() {
    let c = case((9, 3, 64), 70, 30, true, 3);
    let s = c.shape;
    let tile = 32;
    let whole = bits(&run(Isa::detect(), &c, tile));
    let kvd = s.kv_dim();
    for (q_tile, threads) in [(1, 1), (7, 3), (70, 2)] {
        let pool = crate::thread_pool(threads).unwrap();
        let got = pool.install(|| {
            let mut stats = vec![0f32; s.stats_len()];
            let mut acc = vec![0f32; s.acc_len()];
            let mut scores = vec![0f32; s.scores_len(q_tile, tile)];
            let mut att = Attention::new(s, tile, &mut stats, &mut acc).unwrap();
            let keys = s.start + s.n_q;
            for k0 in (0..keys).step_by(tile) {
                let r = k0 * kvd..(k0 + tile).min(keys) * kvd;
                for q0 in (0..s.n_q).step_by(q_tile) {
                    let qs = q0..(q0 + q_tile).min(s.n_q);
                    att.fold(&c.q, qs, k0, &c.k[r.clone()], &c.v[r.clone()], &mut scores)
                        .unwrap();
                }
            }
            let mut out = vec![0f32; s.q_values()];
            att.finish(&mut out).unwrap();
            out
        });
        assert!(bits(&got) == whole, "q_tile {q_tile}, {threads} threads");
    }
}

#[test]
fn bad_shapes_and_buffers_are_typed_errors() {
    let e = AttnShape::new(9, 2, 64, 1, 0, 0.125, false).unwrap_err();
    assert!(
        e.to_string()
            .contains("9 query heads are not a non-zero multiple of 2 kv heads"),
        "{e}"
    );
    let e = AttnShape::new(4, 4, 0, 1, 0, 0.125, false).unwrap_err();
    assert!(e.to_string().contains("head_dim must be above 0"), "{e}");
    let e = AttnShape::new(4, 4, 64, usize::MAX / 8, 0, 0.125, false).unwrap_err();
    assert!(e.to_string().contains("overflow the buffer sizes"), "{e}");

    let c = case((4, 2, 32), 3, 2, false, 1);
    let s = c.shape;
    let mut stats = vec![0f32; s.stats_len() - 1];
    let mut acc = vec![0f32; s.acc_len()];
    let e = Attention::new(s, 8, &mut stats, &mut acc).err().unwrap();
    assert!(e.to_string().contains("attention state values"), "{e}");
    let mut stats = vec![0f32; s.stats_len()];
    let e = Attention::new(s, 0, &mut stats, &mut acc).err().unwrap();
    assert!(e.to_string().contains("at least one key"), "{e}");

    let mut att = Attention::new(s, 8, &mut stats, &mut acc).unwrap();
    let mut scores = vec![0f32; s.scores_len(3, 8)];
    let kvd = s.kv_dim();
    // keys past the last query's position
    let e = att
        .fold(&c.q, 0..3, 1, &c.k[..5 * kvd], &c.v[..5 * kvd], &mut scores)
        .unwrap_err();
    assert!(e.to_string().contains("at positions 1.. below 5"), "{e}");
    let e = att
        .fold(&c.q, 0..4, 0, &c.k, &c.v, &mut scores)
        .unwrap_err();
    assert!(e.to_string().contains("queries 0..4 of 3"), "{e}");
    let e = att
        .fold(&c.q, 0..3, 0, &c.k, &c.v, &mut scores[..10])
        .unwrap_err();
    assert!(e.to_string().contains("attention scores values"), "{e}");
    let mut out = vec![0f32; s.q_values()];
    let e = attention(s, 8, &c.q, &c.k[..kvd], &c.v, &mut out).unwrap_err();
    assert!(e.to_string().contains("attention key values"), "{e}");
}

/// Sliding-window and soft-capped attention against a direct f64 evaluation of its definition:
/// query `i` (position `start + i`) meets the keys at positions `p` with
/// `start + i - window < p ≤ start + i`, each scaled score `w` capped to `cap · tanh(w / cap)`.
#[test]
fn windows_and_soft_caps_follow_their_definition() {
    for (n_q, start, tile) in [
        (1, 40, 256),
        (1, 40, 7),
        (20, 0, 256),
        (33, 10, 16),
        (5, 3, 2),
    ] {
        for (window, cap) in [(8, 0.0), (0, 4.0), (8, 4.0), (1, 0.0), (100, 0.0)] {
            let mut c = case((4, 2, 32), n_q, start, false, 7);
            c.shape = c.shape.masked(window, cap);
            let (nh, hd, kvd) = (4, 32, c.shape.kv_dim());
            let got = run(Isa::detect(), &c, tile);
            let mut worst = 0f64;
            for i in 0..n_q {
                let p = start + i;
                let lo = if window == 0 {
                    0
                } else {
                    (p + 1).saturating_sub(window)
                };
                for h in 0..nh {
                    let kh = h / 2;
                    let q = &c.q[(i * nh + h) * hd..][..hd];
                    let w: Vec<f64> = (lo..=p)
                        .map(|j| {
                            let k = &c.k[j * kvd + kh * hd..][..hd];
                            let s: f64 = q.iter().zip(k).map(|(a, b)| f64::from(a * b)).sum();
                            let s = s * f64::from(c.shape.scale);
                            if cap > 0.0 {
                                f64::from(cap) * (s / f64::from(cap)).tanh()
                            } else {
                                s
                            }
                        })
                        .collect();
                    let m = w.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = w.iter().map(|x| (x - m).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for d in 0..hd {
                        let o: f64 = (lo..=p)
                            .zip(&e)
                            .map(|(j, e)| e * f64::from(c.v[j * kvd + kh * hd + d]))
                            .sum::<f64>()
                            / sum;
                        let g = f64::from(got[(i * nh + h) * hd + d]);
                        worst = worst.max((g - o).abs());
                    }
                }
            }
            assert!(
                worst < 1e-5,
                "n_q {n_q} start {start} tile {tile} window {window} cap {cap}: {worst}"
            );
        }
    }
}

/// The step form folds an f16 cache's rows in place with the bits of folding them decoded to
/// f32: every head shape, every instruction set, decode steps and short prompts over several
/// tiles, with and without a window (each row its own task, on the calling thread or across
/// threads); the tiled form refuses f16 rows.
#[test]
fn f16_rows_in_place_give_the_bits_of_the_decoded_rows() {
    use crate::cpu::half::{f16_to_f32, f32_to_f16};
    for (i, heads) in HEADS.into_iter().enumerate() {
        for (n_q, start, window) in [(1, 700, 0), (5, 40, 0), (3, 300, 64)] {
            let c = case(heads, n_q, start, true, 90 + i as u64);
            let shape = c.shape.masked(window, 0.0);
            let k16: Vec<u16> = c.k.iter().map(|x| f32_to_f16(*x)).collect();
            let v16: Vec<u16> = c.v.iter().map(|x| f32_to_f16(*x)).collect();
            let k: Vec<f32> = k16.iter().map(|h| f16_to_f32(*h)).collect();
            let v: Vec<f32> = v16.iter().map(|h| f16_to_f32(*h)).collect();
            let (tile, kvd) = (128, shape.kv_dim());
            for isa in Isa::all_supported() {
                let fold = |f16_rows: bool| {
                    let (mut stats, mut acc) =
                        (vec![0f32; shape.stats_len()], vec![0f32; shape.acc_len()]);
                    let mut scores = vec![0f32; shape.scores_len(n_q, tile)];
                    let mut att = Attention::new(shape, tile, &mut stats, &mut acc).unwrap();
                    let mut k0 = shape.first_tile(tile);
                    while k0 < start + n_q {
                        let rows = k0 * kvd..(start + n_q).min(k0 + tile) * kvd;
                        if f16_rows {
                            let (kt, vt) = (&k16[rows.clone()], &v16[rows]);
                            att.fold_f16_with(isa, &c.q, 0..n_q, k0, kt, vt, &mut scores)
                                .unwrap();
                        } else {
                            let (kt, vt) = (&k[rows.clone()], &v[rows]);
                            att.fold_with(isa, &c.q, 0..n_q, k0, kt, vt, &mut scores)
                                .unwrap();
                        }
                        k0 += tile;
                    }
                    let mut out = vec![0f32; shape.q_values()];
                    att.finish(&mut out).unwrap();
                    out
                };
                let (in_place, decoded) = (fold(true), fold(false));
                assert_eq!(
                    bits(&in_place),
                    bits(&decoded),
                    "{heads:?} {n_q} queries from {start}, window {window}, {isa:?}"
                );
                assert!(in_place.iter().all(|x| x.is_finite()));
            }
        }
    }
    let c = case((4, 2, 32), TILED_MIN_QUERIES, 0, true, 5);
    let (mut stats, mut acc) = (
        vec![0f32; c.shape.stats_len()],
        vec![0f32; c.shape.acc_len()],
    );
    let mut att = Attention::new(c.shape, 64, &mut stats, &mut acc).unwrap();
    let rows = vec![0u16; TILED_MIN_QUERIES * c.shape.kv_dim()];
    let mut scores = vec![0f32; c.shape.scores_len(TILED_MIN_QUERIES, 64)];
    let err = att
        .fold_f16_with(
            Isa::detect(),
            &c.q,
            0..TILED_MIN_QUERIES,
            0,
            &rows,
            &rows,
            &mut scores,
        )
        .unwrap_err();
    assert!(err.to_string().contains("step form"), "{err}");
}

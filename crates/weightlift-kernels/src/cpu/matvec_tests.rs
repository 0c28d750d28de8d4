use super::*;

/// Deterministic bytes (xorshift64*).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// `rows` rows of `cols` values of `ty` with random quants and finite scales of mixed sizes
/// and signs (every f16 field a block holds is rewritten).
fn weights(ty: QuantType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut w = bytes(seed, rows * cols / ty.block_size() * bb);
    let scales: &[usize] = match ty {
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        QuantType::Q2_K => &[80, 82],
        QuantType::Q3_K => &[108],
        QuantType::Q6_K => &[208],
        _ => &[0],
    };
    for (k, blk) in w.chunks_exact_mut(bb).enumerate() {
        for (j, off) in scales.iter().enumerate() {
            let v = (0.001 + 0.0137 * ((k * 7 + j * 3) % 11) as f32)
                * if k % 3 == j { -1.0 } else { 1.0 };
            blk[*off..off + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
        }
    }
    w
}

/// Activations with a wide range of block maxima, exact halves and a zero block.
fn activations(n: usize, seed: u64) -> Vec<f32> {
    bytes(seed, n)
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let block = i / 32;
            if block % 7 == 3 {
                return 0.0;
            }
            let scale = [1.0, 0.01, 40.0, 3.0][block % 4];
            (f32::from(*b) - 127.5) / 127.5 * scale + if i % 13 == 0 { 0.5 } else { 0.0 }
        })
        .collect()
}

/// The Q8-mode matvec takes its rows four (and two, with AVX-512) at a time and the rest one by
/// one: every row count, instruction set and VNNI choice gives the scalar path's bits.
#[test]
fn q8_matvec_rows_at_a_time_give_the_scalar_bits() {
    let types = [
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
    ];
    for (k, ty) in types.into_iter().enumerate() {
        let cols = 512;
        for rows in [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 37] {
            let w = weights(ty, rows, cols, (k * 100 + rows) as u64);
            let x = activations(cols, rows as u64);
            let mut want = vec![0f32; rows];
            matvec_with_vnni(
                Isa::Scalar,
                false,
                MatvecMode::Q8,
                ty,
                &w,
                rows,
                cols,
                &x,
                &mut want,
            )
            .unwrap();
            for isa in Isa::all_supported() {
                for vnni in [false, true] {
                    let mut y = vec![0f32; rows];
                    matvec_with_vnni(isa, vnni, MatvecMode::Q8, ty, &w, rows, cols, &x, &mut y)
                        .unwrap();
                    let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{ty} {rows} rows {isa:?} vnni {vnni}: {y:?} against {want:?}"
                    );
                }
            }
        }
    }
}

/// The quantiser the matvec uses writes [`quantize_q8_blocks`]'s blocks on every instruction
/// set, specials included, and lane offsets equal to `−off` times the sums of four quants.
#[test]
fn the_matvec_quantiser_is_quantize_q8_blocks() {
    let mut x = activations(32 * 40, 5);
    x[3] = f32::NAN;
    x[40] = f32::INFINITY;
    x[77] = f32::NEG_INFINITY;
    x[100] = -0.0;
    x[130] = 1e-42;
    for (i, v) in x[32 * 20..32 * 21].iter_mut().enumerate() {
        *v = (i as f32 - 16.0) + 0.5;
    }
    let want = quantize_q8_blocks(&x);
    for isa in Isa::all_supported() {
        for off in [0, 8, 128] {
            let mut a = Q8Activations::default();
            a.fill(isa, &x, off);
            assert_eq!(a.q.len(), want.len());
            for (k, (g, w)) in a.q.iter().zip(&want).enumerate() {
                assert!(
                    g.d.to_bits() == w.d.to_bits() && g.sum == w.sum && g.qs == w.qs,
                    "{isa:?} block {k}: {g:?} against {w:?}"
                );
            }
            assert_eq!(a.bias.len(), if off == 0 { 0 } else { want.len() });
            for (l, w) in a.bias.iter().zip(&want) {
                let sums: [i32; 8] = std::array::from_fn(|j| {
                    w.qs[4 * j..4 * j + 4].iter().map(|v| i32::from(*v)).sum()
                });
                assert_eq!(*l, sums.map(|s| -off * s), "{isa:?}");
            }
        }
    }
}

/// F32 rows are read in place where they are aligned and copied out where they are not; both
/// take the same tiles and sums, so they give the same bits at every instruction set level,
/// within rounding of a sum in f64.
#[test]
fn f32_matvec_reads_aligned_rows_in_place_with_the_copying_bits() {
    let (rows, cols) = (37, 2500);
    let w: Vec<f32> = activations(rows * cols, 5);
    let x = activations(cols, 6);
    let aligned: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    // The same bytes one past an aligned start, so every row is misaligned.
    let mut shifted = vec![0u8; aligned.len() + 1];
    shifted[1..].copy_from_slice(&aligned);
    let (in_place, copied) = (&aligned[..], &shifted[1..]);
    assert!(f32_values(QuantType::F32, &in_place[..cols * 4]).is_some());
    assert!(f32_values(QuantType::F32, &copied[..cols * 4]).is_none());
    for isa in Isa::all_supported() {
        let mut a = vec![0f32; rows];
        let mut b = vec![0f32; rows];
        matvec_with(
            isa,
            MatvecMode::Exact,
            QuantType::F32,
            in_place,
            rows,
            cols,
            &x,
            &mut a,
        )
        .unwrap();
        matvec_with(
            isa,
            MatvecMode::Exact,
            QuantType::F32,
            copied,
            rows,
            cols,
            &x,
            &mut b,
        )
        .unwrap();
        assert_eq!(a, b, "{isa:?}");
        for (r, got) in a.iter().enumerate() {
            let want: f64 = w[r * cols..(r + 1) * cols]
                .iter()
                .zip(&x)
                .map(|(p, q)| f64::from(*p) * f64::from(*q))
                .sum();
            let scale: f64 = w[r * cols..(r + 1) * cols]
                .iter()
                .zip(&x)
                .map(|(p, q)| (f64::from(*p) * f64::from(*q)).abs())
                .sum();
            assert!(
                (f64::from(*got) - want).abs() <= 1e-5 * scale,
                "{isa:?} row {r}"
            );
        }
    }
}

/// The scalar Q8-mode matvec of each token of `x` (`cols` values a token) alone, token-major.
fn per_token_matvec(ty: QuantType, w: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    let mut want = vec![0f32; x.len() / cols * rows];
    for (xt, yt) in x.chunks_exact(cols).zip(want.chunks_exact_mut(rows)) {
        matvec_with_vnni(
            Isa::Scalar,
            false,
            MatvecMode::Q8,
            ty,
            w,
            rows,
            cols,
            xt,
            yt,
        )
        .unwrap();
    }
    want
}

/// The Q8-mode matmul of the `n_tok` tokens of `x` at `isa` (VNNI form allowed or not).
fn q8_matmul(
    (isa, vnni): (Isa, bool),
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
) -> Vec<f32> {
    let mut y = vec![f32::NAN; n_tok * rows];
    matmul_with_vnni(
        isa,
        vnni,
        MatvecMode::Q8,
        ty,
        w,
        rows,
        cols,
        x,
        n_tok,
        &mut y,
        usize::MAX,
    )
    .unwrap();
    y
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits())
}

/// A Q8-mode matmul of 2 to 16 tokens decodes each weight block once for all of them, and
/// every token's output has the bits of the scalar matvec of that token alone, on every
/// instruction set, VNNI choice, odd row count and token count.
#[test]
fn q8_matmul_of_few_tokens_gives_each_token_its_matvec_bits() {
    let types = [
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
    ];
    for (k, ty) in types.into_iter().enumerate() {
        for (rows, cols) in [(1, 256), (3, 512), (17, 256), (37, 768)] {
            let w = weights(ty, rows, cols, (k * 1000 + rows) as u64);
            let x = activations(16 * cols, (k + rows) as u64);
            let want = per_token_matvec(ty, &w, rows, cols, &x);
            for n_tok in 1..=16 {
                for isa in Isa::all_supported() {
                    for vnni in [false, true] {
                        let (x, good) = (&x[..n_tok * cols], &want[..n_tok * rows]);
                        let y = q8_matmul((isa, vnni), ty, &w, rows, cols, x, n_tok);
                        assert!(
                            same_bits(&y, good),
                            "{ty} {rows}x{cols} {n_tok} tokens {isa:?} vnni {vnni}: \
                             {y:?} against {good:?}"
                        );
                    }
                }
            }
        }
    }
}

/// The same values read as tokens of another width (12 tokens of 64 values, then 6 of 128, in
/// passes of 6 tokens where a pass holds at most 8) are laid out for that width.
#[test]
fn the_same_values_as_tokens_of_another_width_are_laid_out_again() {
    let ty = QuantType::Q8_0;
    let x = activations(768, 7);
    for isa in Isa::all_supported() {
        for (n_tok, cols) in [(12, 64), (6, 128), (12, 64)] {
            let rows = 5;
            let w = weights(ty, rows, cols, cols as u64);
            let want = per_token_matvec(ty, &w, rows, cols, &x);
            let y = q8_matmul((isa, false), ty, &w, rows, cols, &x, n_tok);
            assert!(
                same_bits(&y, &want),
                "{isa:?} {n_tok} tokens of {cols}: {y:?} against {want:?}"
            );
        }
    }
}

/// Wide tokens' passes are built in runs of blocks on the pool's threads (a run per thread,
/// at most 64 blocks): on one thread and on three, with and without VNNI lane offsets (Q4_0
/// against Q4_1 under VNNI), row pairs or not, the K-quants' 256-value blocks, and one or two
/// passes, every token keeps its matvec bits.
#[test]
fn token_passes_built_in_runs_give_each_token_its_matvec_bits() {
    let (rows, cols) = (5, 19 * 256);
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        for (k, ty) in [
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q2_K,
            QuantType::Q3_K,
            QuantType::Q6_K,
        ]
        .into_iter()
        .enumerate()
        {
            let w = weights(ty, rows, cols, 40 + k as u64);
            let x = activations(16 * cols, 50 + k as u64);
            let want = per_token_matvec(ty, &w, rows, cols, &x);
            for n_tok in [2, 5, 16] {
                for isa in Isa::all_supported() {
                    for vnni in [false, true] {
                        let (x, good) = (&x[..n_tok * cols], &want[..n_tok * rows]);
                        let y =
                            pool.install(|| q8_matmul((isa, vnni), ty, &w, rows, cols, x, n_tok));
                        assert!(
                            same_bits(&y, good),
                            "{threads} threads {ty} {n_tok} tokens {isa:?} vnni {vnni}"
                        );
                    }
                }
            }
        }
    }
}

/// Matrices that multiply the same tokens together ([`matmul_shared`]: one parallel loop over
/// all their rows, the tokens quantised once) give each matrix the bits of its own product, for
/// one token (matvecs), the shared few-token products and the tiles past them, in both modes,
/// on every instruction set and VNNI choice, with row counts that split tasks and row pairs.
#[test]
fn matrices_sharing_their_tokens_get_the_bits_of_their_own_products() {
    let shapes = [33usize, 16, 5];
    let cols = 256;
    for (k, ty) in [QuantType::Q4_1, QuantType::Q8_0, QuantType::Q4_K]
        .into_iter()
        .enumerate()
    {
        let ws: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&rows| weights(ty, rows, cols, (100 * k + rows) as u64))
            .collect();
        let x = activations(20 * cols, k as u64);
        for n_tok in [1, 2, 7, 16, 20] {
            let x = &x[..n_tok * cols];
            for mode in [MatvecMode::Q8, MatvecMode::Exact] {
                for isa in Isa::all_supported() {
                    for vnni in [false, true] {
                        let mut ys: Vec<Vec<f32>> =
                            shapes.iter().map(|&r| vec![f32::NAN; n_tok * r]).collect();
                        let mut parts: Vec<SharedInput<'_>> = ws
                            .iter()
                            .zip(&shapes)
                            .zip(&mut ys)
                            .map(|((w, &rows), y)| SharedInput { w, rows, y })
                            .collect();
                        matmul_shared_with_vnni(
                            isa, vnni, mode, ty, &mut parts, cols, x, n_tok, 4096,
                        )
                        .unwrap();
                        for ((w, &rows), y) in ws.iter().zip(&shapes).zip(&ys) {
                            let mut want = vec![f32::NAN; n_tok * rows];
                            matmul_with_vnni(
                                isa, vnni, mode, ty, w, rows, cols, x, n_tok, &mut want, 4096,
                            )
                            .unwrap();
                            assert!(
                                same_bits(y, &want),
                                "{ty} {mode:?} {rows} rows {n_tok} tokens {isa:?} vnni {vnni}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// A matrix of the wrong size among those sharing tokens is refused by name before any runs.
#[test]
fn a_shared_product_checks_every_matrix() {
    let (ty, cols) = (QuantType::Q8_0, 64);
    let (a, b) = (weights(ty, 4, cols, 1), weights(ty, 3, cols, 2));
    let x = activations(2 * cols, 3);
    let (mut ya, mut yb) = (vec![0f32; 8], vec![0f32; 8]);
    let mut parts = [
        SharedInput {
            w: &a,
            rows: 4,
            y: &mut ya,
        },
        SharedInput {
            w: &b,
            rows: 4,
            y: &mut yb,
        },
    ];
    let err = matmul_shared(MatvecMode::Q8, ty, &mut parts, cols, &x, 2, 4096).unwrap_err();
    assert!(
        matches!(err, crate::KernelError::LengthMismatch { .. }),
        "{err}"
    );
    assert!(
        ya.iter().all(|v| *v == 0.0),
        "the first matrix ran before the check"
    );
}

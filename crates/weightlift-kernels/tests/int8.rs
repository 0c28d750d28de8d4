//! LLM.int8 against bitsandbytes 0.50.2 on the CPU (`tests/gen_quant_vectors.py int8` stored
//! its `int8_vectorwise_quant` and `int8_mixed_scaled_mm` / `int8_scaled_mm` results) and
//! against an f64 product of the unquantised values with the quantisation error bound; every
//! instruction set level gives the same bits.

mod common;

use std::path::PathBuf;

use weightlift_kernels::FloatType;
use weightlift_kernels::cpu::Isa;
use weightlift_kernels::cpu::int8::{
    INT8_MAX_COLS, Int8Weights, int8_matmul_with, int8_quantize_activations_with,
    int8_quantize_rows_from_with, int8_quantize_rows_with,
};

/// bitsandbytes' case: everything `gen_quant_vectors.py int8` wrote.
struct Case {
    rows: usize,
    cols: usize,
    n_tok: usize,
    threshold: f32,
    w: Vec<f32>,
    cb: Vec<i8>,
    scb: Vec<f32>,
    w16: Vec<u8>,
    cb16: Vec<i8>,
    scb16: Vec<f32>,
    x: Vec<f32>,
    outliers: Vec<usize>,
    ca: Vec<i8>,
    sca: Vec<f32>,
    ca0: Vec<i8>,
    sca0: Vec<f32>,
    y: Vec<f32>,
    y0: Vec<f32>,
}

struct Reader(Vec<u8>, usize);

impl Reader {
    fn take(&mut self, n: usize) -> &[u8] {
        assert!(self.1 + n <= self.0.len(), "int8_case.bin is truncated");
        self.1 += n;
        &self.0[self.1 - n..self.1]
    }
    fn u32(&mut self) -> usize {
        u32::from_le_bytes(self.take(4).try_into().unwrap()) as usize
    }
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        self.take(4 * n)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
    fn i8s(&mut self, n: usize) -> Vec<i8> {
        self.take(n).iter().map(|b| *b as i8).collect()
    }
}

fn case() -> Case {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/int8_case.bin");
    let b = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run tests/gen_quant_vectors.py int8 (see its docstring)",
            path.display()
        )
    });
    let mut r = Reader(b, 0);
    assert_eq!(r.take(4), b"WLI8");
    let (rows, cols, n_tok, n_out) = (r.u32(), r.u32(), r.u32(), r.u32());
    let threshold = r.f32s(1)[0];
    let c = Case {
        rows,
        cols,
        n_tok,
        threshold,
        w: r.f32s(rows * cols),
        cb: r.i8s(rows * cols),
        scb: r.f32s(rows),
        w16: r.take(8 * cols * 2).to_vec(),
        cb16: r.i8s(8 * cols),
        scb16: r.f32s(8),
        x: r.f32s(n_tok * cols),
        outliers: (0..n_out).map(|_| r.u32()).collect(),
        ca: r.i8s(n_tok * cols),
        sca: r.f32s(n_tok),
        ca0: r.i8s(n_tok * cols),
        sca0: r.f32s(n_tok),
        y: r.f32s(n_tok * rows),
        y0: r.f32s(n_tok * rows),
    };
    assert_eq!(r.1, r.0.len(), "int8_case.bin has trailing bytes");
    c
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn weight_quantiser_equals_bitsandbytes_int8_vectorwise_quant() {
    let c = case();
    for isa in Isa::all_supported() {
        let (mut q, mut s) = (vec![0i8; c.rows * c.cols], vec![0f32; c.rows]);
        int8_quantize_rows_with(isa, &c.w, c.cols, &mut q, &mut s).unwrap();
        assert_eq!(q, c.cb, "{isa:?}: quants");
        assert_eq!(bits(&s), bits(&c.scb), "{isa:?}: scales");
        // from the checkpoint's f16 bytes (bitsandbytes computed in f32 after promotion)
        let (mut q, mut s) = (vec![0i8; 8 * c.cols], vec![0f32; 8]);
        int8_quantize_rows_from_with(isa, FloatType::F16, &c.w16, c.cols, &mut q, &mut s).unwrap();
        assert_eq!(q, c.cb16, "{isa:?}: f16 quants");
        assert_eq!(bits(&s), bits(&c.scb16), "{isa:?}: f16 scales");
    }
    // the zero row: scale 0, quants 0, as bitsandbytes' CPU path leaves them
    assert_eq!(c.scb[3], 0.0);
    assert!(c.cb[3 * c.cols..4 * c.cols].iter().all(|q| *q == 0));
}

#[test]
fn activation_quantiser_equals_bitsandbytes_with_and_without_the_threshold() {
    let c = case();
    assert_eq!(c.outliers, [10, 50, 100], "the fixture's outlier columns");
    for isa in Isa::all_supported() {
        let a = int8_quantize_activations_with(isa, &c.x, c.cols, c.threshold).unwrap();
        assert_eq!(a.outliers, c.outliers, "{isa:?}");
        assert_eq!(a.q, c.ca, "{isa:?}: quants at threshold {}", c.threshold);
        assert_eq!(bits(&a.scales), bits(&c.sca), "{isa:?}: scales");
        let a = int8_quantize_activations_with(isa, &c.x, c.cols, 0.0).unwrap();
        assert!(a.outliers.is_empty());
        assert_eq!(a.q, c.ca0, "{isa:?}: quants at threshold 0");
        assert_eq!(
            bits(&a.scales),
            bits(&c.sca0),
            "{isa:?}: scales at threshold 0"
        );
    }
}

#[test]
fn matmul_without_outliers_equals_bitsandbytes_int8_scaled_mm_bit_for_bit() {
    let c = case();
    let w = Int8Weights {
        q: &c.cb,
        scales: &c.scb,
        rows: c.rows,
        cols: c.cols,
    };
    for isa in Isa::all_supported() {
        let mut y = vec![0f32; c.n_tok * c.rows];
        int8_matmul_with(isa, &w, &c.x, c.n_tok, 0.0, &mut y).unwrap();
        assert_eq!(bits(&y), bits(&c.y0), "{isa:?}");
    }
}

/// `ŵ = (q · s) · (1/127)` as bitsandbytes dequantises, in f32.
fn dequant(q: i8, s: f32) -> f32 {
    (f32::from(q) * s) * 7.874_016e-3 // bitsandbytes' 7.874015718698502e-3 as f32
}

#[test]
fn matmul_with_outliers_matches_bitsandbytes_to_the_rounding_of_its_outlier_sum() {
    let c = case();
    let w = Int8Weights {
        q: &c.cb,
        scales: &c.scb,
        rows: c.rows,
        cols: c.cols,
    };
    let mut first: Option<Vec<f32>> = None;
    for isa in Isa::all_supported() {
        let mut y = vec![0f32; c.n_tok * c.rows];
        int8_matmul_with(isa, &w, &c.x, c.n_tok, c.threshold, &mut y).unwrap();
        // bitsandbytes adds the outlier columns with a BLAS addmm (its own order and fusing):
        // allow a few f32 roundings of the outlier terms and of the sum
        for t in 0..c.n_tok {
            for o in 0..c.rows {
                let mag: f32 = c
                    .outliers
                    .iter()
                    .map(|col| {
                        (c.x[t * c.cols + col] * dequant(c.cb[o * c.cols + col], c.scb[o])).abs()
                    })
                    .sum();
                let (got, want) = (y[t * c.rows + o], c.y[t * c.rows + o]);
                let tol = 8.0 * f32::EPSILON * (mag + want.abs());
                assert!(
                    (got - want).abs() <= tol,
                    "{isa:?} token {t} row {o}: {got} vs bitsandbytes {want} (tolerance {tol})"
                );
            }
        }
        match &first {
            None => first = Some(y),
            Some(f) => assert_eq!(bits(&y), bits(f), "{isa:?} differs from the scalar result"),
        }
    }
}

/// Random weights and activations with outlier columns, odd sizes (vector tails).
fn random_case(rows: usize, cols: usize, n_tok: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = common::Rng(seed);
    let w = rng.vec(rows * cols, 0.08);
    let mut x = rng.vec(n_tok * cols, 2.0);
    for t in 0..n_tok {
        x[t * cols + (7 * t + 3) % cols] = 9.0 + t as f32; // an outlier column per token
    }
    (w, x)
}

#[test]
fn matmul_is_within_the_quantisation_bound_of_the_f64_product_on_every_isa() {
    for (rows, cols, n_tok) in [(37, 300, 1), (37, 300, 6), (20, 64, 9), (5, 1000, 4)] {
        let (wf, x) = random_case(rows, cols, n_tok, (rows * cols + n_tok) as u64);
        let (mut q, mut s) = (vec![0i8; rows * cols], vec![0f32; rows]);
        int8_quantize_rows_with(Isa::Scalar, &wf, cols, &mut q, &mut s).unwrap();
        let w = Int8Weights {
            q: &q,
            scales: &s,
            rows,
            cols,
        };
        let act = int8_quantize_activations_with(Isa::Scalar, &x, cols, 6.0).unwrap();
        assert_eq!(
            act.outliers.len(),
            n_tok.min(cols),
            "one outlier column per token"
        );
        let mut first: Option<Vec<f32>> = None;
        for isa in Isa::all_supported() {
            let mut y = vec![0f32; n_tok * rows];
            int8_matmul_with(isa, &w, &x, n_tok, 6.0, &mut y).unwrap();
            for t in 0..n_tok {
                // half a step of each quantiser; outlier columns carry only the weight's error
                let dx = f64::from(act.scales[t]) / 254.0;
                for o in 0..rows {
                    let dw = f64::from(s[o]) / 254.0;
                    let (mut exact, mut bound) = (0f64, 0f64);
                    for i in 0..cols {
                        let (xv, wv) = (f64::from(x[t * cols + i]), f64::from(wf[o * cols + i]));
                        exact += xv * wv;
                        bound += if act.outliers.contains(&i) {
                            xv.abs() * dw
                        } else {
                            xv.abs() * dw + wv.abs() * dx + dx * dw
                        };
                        bound += 4.0 * f64::from(f32::EPSILON) * (xv * wv).abs();
                    }
                    let got = f64::from(y[t * rows + o]);
                    assert!(
                        (got - exact).abs() <= bound * 1.001 + 1e-30,
                        "{isa:?} {rows}x{cols}x{n_tok} token {t} row {o}: {got} vs {exact} (bound {bound})"
                    );
                }
            }
            match &first {
                None => first = Some(y),
                Some(f) => assert_eq!(bits(&y), bits(f), "{isa:?} differs from the scalar result"),
            }
        }
    }
}

#[test]
fn outlier_columns_are_the_f32_product_with_the_dequantised_weights() {
    // activations zero outside the outlier columns: the int8 part is 0, and what is left is
    // Σ x·ŵ over the outlier columns, which the f64 sum of the same f32 terms bounds tightly
    let (rows, cols, n_tok) = (9, 96, 3);
    let (wf, _) = random_case(rows, cols, n_tok, 5);
    let (mut q, mut s) = (vec![0i8; rows * cols], vec![0f32; rows]);
    int8_quantize_rows_with(Isa::Scalar, &wf, cols, &mut q, &mut s).unwrap();
    let w = Int8Weights {
        q: &q,
        scales: &s,
        rows,
        cols,
    };
    let outl = [4usize, 40, 41, 95];
    let mut x = vec![0f32; n_tok * cols];
    for t in 0..n_tok {
        for (k, c) in outl.iter().enumerate() {
            x[t * cols + c] = (-1f32).powi((t + k) as i32) * (6.0 + 1.25 * (t * 4 + k) as f32);
        }
    }
    for isa in Isa::all_supported() {
        let mut y = vec![0f32; n_tok * rows];
        int8_matmul_with(isa, &w, &x, n_tok, 6.0, &mut y).unwrap();
        for t in 0..n_tok {
            for o in 0..rows {
                let terms: Vec<f64> = outl
                    .iter()
                    .map(|c| f64::from(x[t * cols + c] * dequant(q[o * cols + c], s[o])))
                    .collect();
                let exact: f64 = terms.iter().sum();
                let mag: f64 = terms.iter().map(|v| v.abs()).sum();
                let got = f64::from(y[t * rows + o]);
                assert!(
                    (got - exact).abs() <= 4.0 * f64::from(f32::EPSILON) * mag,
                    "{isa:?} token {t} row {o}: {got} vs {exact}"
                );
            }
        }
    }
}

#[test]
fn one_token_at_a_time_equals_the_batch_without_outliers() {
    let (rows, cols, n_tok) = (33, 200, 5);
    let (wf, x) = random_case(rows, cols, n_tok, 11);
    let (mut q, mut s) = (vec![0i8; rows * cols], vec![0f32; rows]);
    int8_quantize_rows_with(Isa::Scalar, &wf, cols, &mut q, &mut s).unwrap();
    let w = Int8Weights {
        q: &q,
        scales: &s,
        rows,
        cols,
    };
    for isa in Isa::all_supported() {
        let mut batch = vec![0f32; n_tok * rows];
        int8_matmul_with(isa, &w, &x, n_tok, 0.0, &mut batch).unwrap();
        for t in 0..n_tok {
            let mut one = vec![0f32; rows];
            int8_matmul_with(isa, &w, &x[t * cols..(t + 1) * cols], 1, -1.0, &mut one).unwrap();
            assert_eq!(
                bits(&one),
                bits(&batch[t * rows..(t + 1) * rows]),
                "{isa:?} token {t}"
            );
        }
    }
}

#[test]
fn bad_inputs_are_refused_by_name() {
    let (mut q, mut s) = (vec![0i8; 8], vec![0f32; 2]);
    let e = int8_quantize_rows_with(Isa::Scalar, &[1.0; 8], 4, &mut q, &mut s[..1]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "int8 scales (one per row): expected 2, got 1"
    );
    let e = int8_quantize_rows_with(Isa::Scalar, &[1.0; 8], 3, &mut q, &mut s).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid shape for int8 quantize: 8 source values are not whole rows of 3"
    );
    let mut x = [1.0f32; 8];
    x[6] = f32::NAN;
    let e = int8_quantize_rows_with(Isa::Scalar, &x, 4, &mut q, &mut s).unwrap_err();
    assert!(
        e.to_string()
            .contains("the non-finite source value NaN at index 6"),
        "{e}"
    );
    let big = vec![0f32; INT8_MAX_COLS + 1];
    let mut qb = vec![0i8; big.len()];
    let e =
        int8_quantize_rows_with(Isa::Scalar, &big, big.len(), &mut qb, &mut s[..1]).unwrap_err();
    assert!(
        e.to_string()
            .contains("the i32 sums of longer rows could overflow"),
        "{e}"
    );

    let w = Int8Weights {
        q: &q,
        scales: &s,
        rows: 2,
        cols: 4,
    };
    let mut y = vec![0f32; 6];
    let e = int8_matmul_with(Isa::Scalar, &w, &[0.5; 12], 3, 6.0, &mut y[..5]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "int8 matmul output (n_tok × rows): expected 6, got 5"
    );
    let e = int8_matmul_with(Isa::Scalar, &w, &[0.5; 11], 3, 6.0, &mut y).unwrap_err();
    assert_eq!(
        e.to_string(),
        "int8 matmul activations (n_tok × cols): expected 12, got 11"
    );
    let e = int8_matmul_with(Isa::Scalar, &w, &[0.5; 12], 3, f32::NAN, &mut y).unwrap_err();
    assert!(
        e.to_string().contains("the outlier threshold is NaN"),
        "{e}"
    );
    let bad = Int8Weights { q: &q[..7], ..w };
    let e = int8_matmul_with(Isa::Scalar, &bad, &[0.5; 12], 3, 6.0, &mut y).unwrap_err();
    assert_eq!(e.to_string(), "int8 weight quants: expected 8, got 7");
}

/// The CUDA twin (`kernels/int8.cu`) compiles for the GPUs we target, has every kernel the
/// host side will launch, and its matmul's integer dot is `dp4a` on the device. It has not run
/// on a GPU: the machines these tests run on have none.
#[cfg(feature = "nvrtc-check")]
#[test]
fn the_cuda_int8_kernels_compile_and_the_matmul_uses_dp4a() {
    use weightlift_kernels::{nvrtc, sources};
    common::require_nvrtc();
    let src = sources::source("int8").expect("kernels/int8.cu is embedded");
    for arch in ["compute_80", "sm_75", "sm_90"] {
        let ptx = nvrtc::compile_strict("int8", src, arch).unwrap().ptx;
        for k in [
            "int8_outliers_f32",
            "int8_quantize_f32",
            "int8_quantize_f16",
            "int8_matmul_f32",
        ] {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{arch}: no kernel {k}"
            );
            assert!(sources::signature(k).is_some(), "{k} has no signature");
        }
        let mm = ptx.split(".entry int8_matmul_f32(").nth(1).unwrap();
        let mm = mm.split(".entry ").next().unwrap();
        assert!(
            mm.contains("dp4a.s32.s32"),
            "{arch}: int8_matmul_f32 does not use dp4a"
        );
        // no fused multiply-add in the epilogue: the CPU rounds every product and sum
        assert!(
            !mm.contains("fma.rn.f32"),
            "{arch}: int8_matmul_f32 fuses a multiply-add"
        );
    }
}

//! `Op::Int8Matmul` on every backend present (`test_device!`): bitsandbytes' own quants
//! (`int8_case.bin`, from `tests/gen_quant_vectors.py int8`) in the one-buffer layout give
//! `int8_scaled_mm`'s output bit for bit without outliers, and the CPU kernel's bits (checked
//! against `int8_mixed_scaled_mm` in `tests/int8.rs`) with them; the scales are read at any
//! alignment; bad shapes are refused by name.

mod common;

use std::path::PathBuf;

use common::{Rng, download_f32, upload};
use weightlift_kernels::cpu::int8::{
    Int8Weights, int8_matmul, int8_matmul_packed, int8_pack_rows, int8_packed_bytes,
};
use weightlift_kernels::*;

/// What the backend test needs of bitsandbytes' case.
struct Case {
    rows: usize,
    cols: usize,
    n_tok: usize,
    threshold: f32,
    /// `CB` then `SCB`, as one buffer.
    packed: Vec<u8>,
    x: Vec<f32>,
    /// `int8_scaled_mm` (threshold 0).
    y0: Vec<f32>,
}

fn case() -> Case {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/int8_case.bin");
    let b = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run tests/gen_quant_vectors.py int8 (see its docstring)",
            path.display()
        )
    });
    let mut at = 0usize;
    let mut take = |n: usize| {
        assert!(at + n <= b.len(), "int8_case.bin is truncated");
        at += n;
        b[at - n..at].to_vec()
    };
    let u32_of = |v: Vec<u8>| u32::from_le_bytes(v.try_into().unwrap()) as usize;
    let f32s = |v: Vec<u8>| -> Vec<f32> {
        v.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    assert_eq!(take(4), b"WLI8");
    let (rows, cols, n_tok, n_out) = (
        u32_of(take(4)),
        u32_of(take(4)),
        u32_of(take(4)),
        u32_of(take(4)),
    );
    let threshold = f32s(take(4))[0];
    take(rows * cols * 4); // w
    let mut packed = take(rows * cols); // CB
    packed.extend(take(rows * 4)); // SCB
    take(8 * cols * 2 + 8 * cols + 8 * 4); // the f16 weights, their quants and scales
    let x = f32s(take(n_tok * cols * 4));
    take(n_out * 4 + 2 * (n_tok * cols + n_tok * 4)); // outliers, CA/SCA at 6 and at 0
    take(n_tok * rows * 4); // y (int8_mixed_scaled_mm)
    let y0 = f32s(take(n_tok * rows * 4));
    Case {
        rows,
        cols,
        n_tok,
        threshold,
        packed,
        x,
        y0,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[allow(clippy::too_many_arguments)]
fn int8_op<B: Backend>(
    b: &B,
    w: &B::Buffer,
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    threshold: f32,
) -> Result<Vec<f32>> {
    let xb = upload(b, bytemuck::cast_slice(x))?;
    let mut y = b.alloc(n_tok * rows * 4)?;
    b.run(Op::Int8Matmul {
        rows,
        cols,
        n_tok,
        threshold,
        w,
        x: &xb,
        y: &mut y,
    })?;
    download_f32(b, &y, n_tok * rows)
}

fn int8_op_equals_bitsandbytes<B: Backend>(b: &B) -> Result<()> {
    let c = case();
    let w = upload(b, &c.packed)?;
    let y0 = int8_op(b, &w, c.rows, c.cols, &c.x, c.n_tok, 0.0)?;
    assert_eq!(bits(&y0), bits(&c.y0), "{}: int8_scaled_mm", b.name());
    let y = int8_op(b, &w, c.rows, c.cols, &c.x, c.n_tok, c.threshold)?;
    let mut want = vec![0f32; c.n_tok * c.rows];
    int8_matmul_packed(
        &c.packed,
        c.rows,
        c.cols,
        &c.x,
        c.n_tok,
        c.threshold,
        &mut want,
    )?;
    assert_eq!(bits(&y), bits(&want), "{}: with outliers", b.name());
    Ok(())
}
weightlift_kernels::test_device!(int8_op_equals_bitsandbytes);

/// 5 rows of 33 values: the scales start at byte 165, and the weights sit one byte into their
/// buffer, so the scales are read unaligned (copied first) on every backend.
#[allow(unsafe_code)]
fn int8_op_reads_scales_at_any_alignment<B: Backend>(b: &B) -> Result<()> {
    let (rows, cols) = (5, 33);
    let mut rng = Rng(7);
    let wf = rng.vec(rows * cols, 0.1);
    let mut packed = vec![0u8; int8_packed_bytes(rows, cols).unwrap()];
    int8_pack_rows(&wf, cols, &mut packed)?;
    let (mut q, mut s) = (vec![0i8; rows * cols], vec![0f32; rows]);
    int8_quantize_rows(&wf, cols, &mut q, &mut s)?;
    assert_eq!(bytemuck::cast_slice::<i8, u8>(&q), &packed[..rows * cols]);
    let split = Int8Weights {
        q: &q,
        scales: &s,
        rows,
        cols,
    };
    let mut shifted = vec![0xAAu8];
    shifted.extend_from_slice(&packed);
    let buf = upload(b, &shifted)?;
    // SAFETY: the view is dropped at the end of this function, before `buf`, and only read.
    let w = unsafe { b.view(&buf, 1, packed.len()) }?;
    for n_tok in [1, 3] {
        let mut x = rng.vec(n_tok * cols, 2.0);
        x[(n_tok - 1) * cols + 4] = 9.0; // an outlier column in the last token
        let mut want = vec![0f32; n_tok * rows];
        int8_matmul(&split, &x, n_tok, INT8_DEFAULT_THRESHOLD, &mut want)?;
        let got = int8_op(b, &w, rows, cols, &x, n_tok, INT8_DEFAULT_THRESHOLD)?;
        assert_eq!(bits(&got), bits(&want), "{}: {n_tok} tokens", b.name());
    }
    Ok(())
}
weightlift_kernels::test_device!(int8_op_reads_scales_at_any_alignment);

fn int8_op_refuses_bad_shapes_by_name<B: Backend>(b: &B) -> Result<()> {
    let (rows, cols) = (4, 8);
    let short = upload(b, &vec![0u8; rows * cols + 4 * rows - 1])?;
    let x = vec![0.5f32; cols];
    let e = int8_op(b, &short, rows, cols, &x, 1, 6.0).unwrap_err();
    assert!(
        e.to_string().contains("int8 weight bytes"),
        "{}: {e}",
        b.name()
    );
    let w = upload(b, &vec![0u8; rows * cols + 4 * rows])?;
    let e = int8_op(b, &w, rows, cols, &x, 1, f32::NAN).unwrap_err();
    assert!(
        e.to_string().contains("threshold is NaN"),
        "{}: {e}",
        b.name()
    );
    let e = int8_op(b, &w, rows * cols, 0, &[], 1, 6.0).unwrap_err();
    assert!(
        e.to_string().contains("rows of 0 values"),
        "{}: {e}",
        b.name()
    );
    Ok(())
}
weightlift_kernels::test_device!(int8_op_refuses_bad_shapes_by_name);

//! The ggml row quantisers against llama.cpp itself: `tests/gen_quant_vectors.py ggml` ran
//! `ggml_quantize_chunk` (llama-cpp-python 0.3.36's libggml-base, no importance matrix) on
//! seeded and adversarial rows and stored its bytes; every instruction set level, the parallel
//! and the one-row entry points, and the f16 / bf16 byte sources must write the same bytes.

use crate::common;

use std::path::PathBuf;

use weightlift_kernels::cpu::Isa;
use weightlift_kernels::cpu::quantize::{
    QUANTIZE_TYPES, can_quantize, quantize_row_with, quantize_rows, quantize_rows_from_with,
    quantize_rows_with, quantized_row_bytes,
};
use weightlift_kernels::{FloatType, QuantType, thread_pool};

pub(crate) fn data(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run tests/gen_quant_vectors.py ggml (see its docstring)",
            path.display()
        )
    })
}

pub(crate) fn u32_at(b: &[u8], o: usize) -> usize {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]) as usize
}

/// (rows, n_per_row, source bytes) of `quant_in_<src>.bin`.
pub(crate) fn input(src: &str) -> (usize, usize, Vec<u8>) {
    let b = data(&format!("quant_in_{src}.bin"));
    assert_eq!(&b[..4], b"WLQI");
    let (rows, n) = (u32_at(&b, 8), u32_at(&b, 12));
    let es = if src == "f32" { 4 } else { 2 };
    assert_eq!(
        b.len(),
        16 + rows * n * es,
        "quant_in_{src}.bin is truncated"
    );
    (rows, n, b[16..].to_vec())
}

/// ggml's bytes for `ty` from source `src`.
pub(crate) fn expected(ty: QuantType, src: &str, rows: usize, n: usize) -> Vec<u8> {
    let b = data(&format!("quant_{}_{src}.bin", ty.name()));
    assert_eq!(&b[..4], b"WLQO");
    assert_eq!(u32_at(&b, 4) as u32, ty.ggml_id());
    assert_eq!((u32_at(&b, 8), u32_at(&b, 12)), (rows, n));
    let len = u32_at(&b, 16);
    assert_eq!(len, rows * quantized_row_bytes(ty, n).unwrap());
    assert_eq!(b.len(), 20 + len, "quant_{ty}_{src}.bin is truncated");
    b[20..].to_vec()
}

pub(crate) fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The first differing block, for a readable failure.
pub(crate) fn first_diff(ty: QuantType, got: &[u8], want: &[u8]) -> String {
    let bb = ty.block_bytes();
    let b = got
        .chunks(bb)
        .zip(want.chunks(bb))
        .position(|(g, w)| g != w)
        .unwrap_or(0);
    format!(
        "block {b} (value {}):\n got  {:?}\n want {:?}",
        b * ty.block_size(),
        &got[b * bb..(b + 1) * bb],
        &want[b * bb..(b + 1) * bb]
    )
}

#[test]
fn every_type_matches_ggml_quantize_chunk_byte_for_byte_on_every_isa() {
    let (rows, n, raw) = input("f32");
    let x = f32s(&raw);
    for ty in QUANTIZE_TYPES {
        let want = expected(ty, "f32", rows, n);
        for isa in Isa::all_supported() {
            let mut got = vec![0xa5u8; want.len()];
            quantize_rows_with(isa, ty, &x, n, &mut got).unwrap();
            assert!(got == want, "{ty} {isa:?}: {}", first_diff(ty, &got, &want));
        }
    }
}

/// The rows `gen_quant_vectors.py`'s `xorshift_rows` builds: 256 values per block from
/// xorshift64*, cubed in every third block, scaled by 1, 0.02, 1e-3, 30 in turn.
pub(crate) fn xorshift_rows(seed: u64, n_blocks: usize) -> Vec<f32> {
    let mut rng = common::Rng(seed);
    let mut x = rng.vec(n_blocks * 256, 1.0);
    for (b, blk) in x.chunks_exact_mut(256).enumerate() {
        let scale = [1.0f32, 0.02, 1e-3, 30.0][b % 4];
        for v in blk {
            if b % 3 == 2 {
                *v = *v * *v * *v;
            }
            *v *= scale;
        }
    }
    x
}

pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[test]
fn two_thousand_random_blocks_hash_to_ggml_s_bytes() {
    // ggml's bytes for 2048 blocks per type would be half a megabyte; the generator stored
    // their FNV-1a hashes, and the values come from the same xorshift64* on both sides
    let b = data("quant_hashes.bin");
    assert_eq!(&b[..4], b"WLQH");
    let seed = u64::from_le_bytes(b[4..12].try_into().unwrap());
    let (n_blocks, n_types) = (u32_at(&b, 12), u32_at(&b, 16));
    assert_eq!(n_types, QUANTIZE_TYPES.len());
    let x = xorshift_rows(seed, n_blocks);
    for rec in b[20..].chunks_exact(12) {
        let ty = QuantType::from_ggml_id(u32_at(rec, 0) as u32).unwrap();
        let want = u64::from_le_bytes(rec[4..12].try_into().unwrap());
        for isa in Isa::all_supported() {
            let mut got = vec![0u8; n_blocks * quantized_row_bytes(ty, 256).unwrap()];
            quantize_rows_with(isa, ty, &x, 256, &mut got).unwrap();
            assert_eq!(
                fnv1a64(&got),
                want,
                "{ty} {isa:?}: bytes differ from ggml's"
            );
        }
    }
}

#[test]
fn one_row_at_a_time_writes_the_same_bytes() {
    let (rows, n, raw) = input("f32");
    let x = f32s(&raw);
    for ty in QUANTIZE_TYPES {
        let want = expected(ty, "f32", rows, n);
        let rb = quantized_row_bytes(ty, n).unwrap();
        for isa in Isa::all_supported() {
            for r in 0..rows {
                let mut got = vec![0u8; rb];
                quantize_row_with(isa, ty, &x[r * n..(r + 1) * n], &mut got).unwrap();
                assert!(
                    got == want[r * rb..(r + 1) * rb],
                    "{ty} {isa:?} row {r}: {}",
                    first_diff(ty, &got, &want[r * rb..(r + 1) * rb])
                );
            }
        }
    }
}

#[test]
fn f16_and_bf16_sources_match_ggml_on_the_widened_values() {
    for (src, ft) in [("f16", FloatType::F16), ("bf16", FloatType::BF16)] {
        let (rows, n, raw) = input(src);
        for ty in [QuantType::Q8_0, QuantType::Q4_K, QuantType::Q6_K] {
            let want = expected(ty, src, rows, n);
            for isa in Isa::all_supported() {
                let mut got = vec![0u8; want.len()];
                quantize_rows_from_with(isa, ty, ft, &raw, n, &mut got).unwrap();
                assert!(
                    got == want,
                    "{ty} from {src} {isa:?}: {}",
                    first_diff(ty, &got, &want)
                );
            }
        }
    }
    // f32 bytes read through the same path
    let (rows, n, raw) = input("f32");
    let want = expected(QuantType::Q4_K, "f32", rows, n);
    let mut got = vec![0u8; want.len()];
    quantize_rows_from_with(
        Isa::Scalar,
        QuantType::Q4_K,
        FloatType::F32,
        &raw,
        n,
        &mut got,
    )
    .unwrap();
    assert!(got == want);
}

#[test]
fn thread_count_and_long_tensors_do_not_change_the_bytes() {
    // 300 rows of 512: more blocks than one parallel run, so the work is split
    let (rows, n, raw) = input("f32");
    let x = f32s(&raw);
    let big: Vec<f32> = (0..300 * 512)
        .map(|i| x[(i * 7) % (rows * n)] * (1.0 + (i % 5) as f32))
        .collect();
    for ty in [QuantType::Q8_0, QuantType::Q4_K, QuantType::Q6_K] {
        let rb = quantized_row_bytes(ty, 512).unwrap();
        let mut serial = vec![0u8; 300 * rb];
        for (r, out) in serial.chunks_exact_mut(rb).enumerate() {
            quantize_row_with(Isa::Scalar, ty, &big[r * 512..(r + 1) * 512], out).unwrap();
        }
        for threads in [1, 2, 3] {
            let pool = thread_pool(threads).unwrap();
            let mut par = vec![0u8; serial.len()];
            pool.install(|| quantize_rows(ty, &big, 512, &mut par))
                .unwrap();
            assert!(par == serial, "{ty} with {threads} threads");
        }
    }
}

#[test]
fn bad_shapes_and_types_are_refused_by_name() {
    assert!(can_quantize(QuantType::Q4_K) && !can_quantize(QuantType::Q5_K));
    let x = vec![0.5f32; 512];
    let mut out = vec![0u8; 1024];
    let e = quantize_rows_with(Isa::Scalar, QuantType::Q5_K, &x, 256, &mut out).unwrap_err();
    assert_eq!(
        e.to_string(),
        "quantize does not support q5_k; supported: q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q6_k"
    );
    let e = quantize_rows_with(Isa::Scalar, QuantType::Q4_K, &x, 128, &mut out).unwrap_err();
    assert!(
        e.to_string().starts_with(
            "invalid shape for quantize: rows of 128 values are not a positive multiple of q4_k's 256-value block"
        ),
        "{e}"
    );
    let e = quantize_rows_with(Isa::Scalar, QuantType::Q8_0, &x[..500], 256, &mut out).unwrap_err();
    assert!(
        e.to_string()
            .contains("500 source values are not whole rows of 256"),
        "{e}"
    );
    let e = quantize_rows_with(Isa::Scalar, QuantType::Q8_0, &x, 256, &mut out).unwrap_err();
    assert_eq!(
        e.to_string(),
        "quantize destination bytes: expected 544, got 1024"
    );
    let bytes = vec![0u8; 1023];
    let e = quantize_rows_from_with(
        Isa::Scalar,
        QuantType::Q8_0,
        FloatType::F16,
        &bytes,
        256,
        &mut out,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("quantize source: f16 data of 1023 bytes"),
        "{e}"
    );
}

#[test]
fn non_finite_values_are_refused_with_their_index_on_every_isa() {
    for ty in QUANTIZE_TYPES {
        for (at, bad) in [
            (300usize, f32::NAN),
            (511, f32::INFINITY),
            (0, f32::NEG_INFINITY),
        ] {
            let mut x = vec![0.25f32; 512];
            x[at] = bad;
            let mut out = vec![0u8; 2 * quantized_row_bytes(ty, 256).unwrap()];
            for isa in Isa::all_supported() {
                let e = quantize_rows_with(isa, ty, &x, 256, &mut out).unwrap_err();
                let msg = e.to_string();
                assert!(
                    msg.contains(&format!("the non-finite source value {bad} at index {at}")),
                    "{ty} {isa:?}: {msg}"
                );
                assert!(msg.contains("finite values only"), "{msg}");
            }
            // the same through f16 bytes (f16 inf and NaN widen to f32 inf and NaN)
            let h: Vec<u8> = x
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
                .collect();
            for isa in Isa::all_supported() {
                let e = quantize_rows_from_with(isa, ty, FloatType::F16, &h, 256, &mut out)
                    .unwrap_err();
                assert!(
                    e.to_string().contains(&format!("at index {at}")),
                    "{ty} {isa:?}: {e}"
                );
            }
        }
    }
}

//! Dequantisation against gguf-py: fixtures written by `tests/gen_vectors.py` from
//! `gguf.quants.dequantize`. Tolerance: bit-exact (0 ulp) for f32 output, on every instruction
//! set this CPU has; f16 output must equal numpy's round-to-nearest-even of gguf-py's f32.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

use crate::common;

use common::{NAMES, load};
use weightlift_kernels::cpu::{dequantize_f16_with, dequantize_f32_with};
use weightlift_kernels::{Isa, QuantType};

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn dequantize_f32_is_bit_exact_with_gguf_py_on_every_isa() {
    for name in NAMES {
        let f = load(name);
        for isa in Isa::all_supported() {
            let mut out = vec![0f32; f.want.len()];
            dequantize_f32_with(isa, f.ty, &f.raw, &mut out).unwrap();
            for (i, (g, w)) in out.iter().zip(&f.want).enumerate() {
                assert!(
                    same(*g, *w),
                    "{name} {isa:?} element {i}: got {g:e} ({:#010x}), gguf-py {w:e} ({:#010x})",
                    g.to_bits(),
                    w.to_bits()
                );
            }
        }
    }
}

#[test]
fn dequantize_f16_rounds_gguf_py_values_to_nearest_even() {
    for name in NAMES {
        let f = load(name);
        for isa in Isa::all_supported() {
            let mut out = vec![0u16; f.want.len()];
            dequantize_f16_with(isa, f.ty, &f.raw, &mut out).unwrap();
            for (i, (g, w)) in out.iter().zip(&f.want).enumerate() {
                let want = half::f16::from_f32(*w);
                let ok =
                    *g == want.to_bits() || (want.is_nan() && half::f16::from_bits(*g).is_nan());
                assert!(
                    ok,
                    "{name} {isa:?} element {i}: got {g:#06x}, want {:#06x}",
                    want.to_bits()
                );
            }
        }
    }
}

#[test]
fn larger_inputs_split_over_threads_match_the_fixture_tiled() {
    // tile each fixture so the parallel path (many chunks) runs; every tile must match
    // and past 8 MiB of output, where the AVX2 path switches to non-temporal stores
    for (name, min_values) in [
        ("q4_0", 64 * 1024),
        ("q8_0", 2_200_000),
        ("q4_k", 2_200_000),
        ("q6_k", 64 * 1024),
        ("f16", 2_200_000),
    ] {
        let f = load(name);
        let reps = min_values / f.want.len() + 2;
        let raw: Vec<u8> = f
            .raw
            .iter()
            .copied()
            .cycle()
            .take(f.raw.len() * reps)
            .collect();
        let mut out = vec![0f32; f.want.len() * reps];
        weightlift_kernels::dequantize_f32(f.ty, &raw, &mut out).unwrap();
        for (i, v) in out.iter().enumerate() {
            assert!(same(*v, f.want[i % f.want.len()]), "{name} element {i}");
        }
    }
}

#[test]
fn ragged_input_is_a_typed_error_naming_the_type() {
    let mut out = vec![0f32; 32];
    let err =
        weightlift_kernels::dequantize_f32(QuantType::Q4_0, &[0u8; 17], &mut out).unwrap_err();
    assert_eq!(
        err.to_string(),
        "src: q4_0 data of 17 bytes is not a whole number of 18-byte blocks; the tensor is truncated or has the wrong type"
    );
    let err = weightlift_kernels::dequantize_f32(QuantType::Q4_0, &[0u8; 18], &mut out[..31])
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "dequantize output values: expected 32, got 31"
    );
}

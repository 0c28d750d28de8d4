//! Dequantisation on every instruction set this CPU has (scalar, AVX2, AVX-512), for every type
//! and both outputs, against gguf-py's fixtures (`tests/gen_vectors.py`): odd block counts,
//! windows that start mid-fixture, F16/BF16 tails shorter than a vector, misaligned outputs,
//! and outputs large enough for the streaming-store path. Blocks decode independently, so any
//! window of a fixture is checked against the same window of gguf-py's values. f32 must be
//! bit-exact; f16 must be numpy's round-to-nearest-even of gguf-py's f32 (the `half` crate).
//!
//! An extra check, not a reference: on random blocks (any scale bits, NaN and inf included) the
//! SIMD paths agree with the scalar path bit for bit.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

use crate::common;

use common::{Fixture, NAMES, Rng, load};
use weightlift_kernels::cpu::{dequantize_f16_with, dequantize_f32_with};
use weightlift_kernels::{Isa, QuantType};

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn same_f16(got: u16, want_f32: f32) -> bool {
    let want = half::f16::from_f32(want_f32);
    got == want.to_bits() || (want.is_nan() && half::f16::from_bits(got).is_nan())
}

/// Checks blocks `first..first + count` of `f` on `isa`, writing at element `pad` of the output
/// buffers (so the output is misaligned when `pad` is not a multiple of 16 bytes).
fn check_window(f: &Fixture, name: &str, isa: Isa, first: usize, count: usize, pad: usize) {
    let (bb, bs) = (f.ty.block_bytes(), f.ty.block_size());
    let raw = &f.raw[first * bb..(first + count) * bb];
    let want = &f.want[first * bs..(first + count) * bs];
    let n = want.len();

    let mut o32 = vec![f32::NAN; n + pad];
    dequantize_f32_with(isa, f.ty, raw, &mut o32[pad..]).unwrap();
    for i in 0..n {
        assert!(
            same(o32[pad + i], want[i]),
            "{name} {isa:?} blocks {first}+{count} pad {pad} element {i}: got {:e}, gguf-py {:e}",
            o32[pad + i],
            want[i]
        );
    }

    let mut o16 = vec![0xffffu16; n + pad];
    dequantize_f16_with(isa, f.ty, raw, &mut o16[pad..]).unwrap();
    for i in 0..n {
        assert!(
            same_f16(o16[pad + i], want[i]),
            "{name} {isa:?} f16 blocks {first}+{count} pad {pad} element {i}: got {:#06x}, want {:#06x}",
            o16[pad + i],
            half::f16::from_f32(want[i]).to_bits()
        );
    }
}

#[test]
fn every_isa_matches_gguf_py_on_odd_counts_offsets_and_tails() {
    for name in NAMES {
        let f = load(name);
        let blocks = f.raw.len() / f.ty.block_bytes();
        for isa in Isa::all_supported() {
            // one block, a few odd counts, odd windows starting mid-fixture, the whole fixture
            let mut windows = vec![(0, 1), (blocks - 1, 1), (0, 3), (1, 5), (2, blocks - 3)];
            windows.push((0, blocks));
            if f.ty.block_size() == 1 {
                // F16 / BF16: lengths that leave 1..7 elements after the last 8-wide vector
                windows.extend([(3, 1021), (5, 13), (0, 7), (8, 9)]);
            }
            for (first, count) in windows {
                for pad in [0, 1, 3] {
                    check_window(&f, name, isa, first, count, pad);
                }
            }
        }
    }
}

/// Repeats the fixture's blocks until they decode to at least `min_values`.
fn tiled(f: &Fixture, min_values: usize) -> (Vec<u8>, usize) {
    let reps = min_values.div_ceil(f.want.len()) + 1;
    let raw: Vec<u8> = f
        .raw
        .iter()
        .copied()
        .cycle()
        .take(f.raw.len() * reps)
        .collect();
    (raw, reps)
}

#[test]
fn large_outputs_on_every_isa_match_gguf_py_tiled() {
    // past 8 MiB of output the SIMD paths use streaming stores (16-byte aligned outputs only;
    // pad 1 takes the ordinary-store path at the same size), and rayon splits the work
    for name in NAMES {
        let f = load(name);
        let (raw, reps) = tiled(&f, (8 << 20) / 2 + 1);
        let n = f.want.len() * reps;
        for isa in Isa::all_supported()
            .into_iter()
            .filter(|i| *i != Isa::Scalar)
        {
            for pad in [0usize, 1] {
                let mut o16 = vec![0u16; n + pad];
                dequantize_f16_with(isa, f.ty, &raw, &mut o16[pad..]).unwrap();
                for i in 0..n {
                    let w = f.want[i % f.want.len()];
                    assert!(
                        same_f16(o16[pad + i], w),
                        "{name} {isa:?} f16 pad {pad} element {i}: got {:#06x}, want {:#06x}",
                        o16[pad + i],
                        half::f16::from_f32(w).to_bits()
                    );
                }
            }
            let mut o32 = vec![0f32; n];
            dequantize_f32_with(isa, f.ty, &raw, &mut o32).unwrap();
            for i in 0..n {
                assert!(
                    same(o32[i], f.want[i % f.want.len()]),
                    "{name} {isa:?} f32 element {i}"
                );
            }
        }
    }
}

#[test]
fn simd_paths_equal_the_scalar_path_on_random_blocks() {
    let mut rng = Rng(0xdec0de);
    for ty in QuantType::ALL {
        for n_blocks in [1usize, 7, 37] {
            let n_blocks = if ty.block_size() == 1 {
                n_blocks * 33
            } else {
                n_blocks
            };
            // every byte random: scales of any magnitude, subnormal, inf and NaN included
            let raw = rng.bytes(n_blocks * ty.block_bytes());
            let n = n_blocks * ty.block_size();
            let mut s32 = vec![0f32; n];
            dequantize_f32_with(Isa::Scalar, ty, &raw, &mut s32).unwrap();
            for isa in Isa::all_supported() {
                let mut o32 = vec![0f32; n];
                dequantize_f32_with(isa, ty, &raw, &mut o32).unwrap();
                let mut o16 = vec![0u16; n];
                dequantize_f16_with(isa, ty, &raw, &mut o16).unwrap();
                for i in 0..n {
                    assert!(
                        same(o32[i], s32[i]),
                        "{ty} {isa:?} {n_blocks} blocks element {i}: {:e} vs scalar {:e}",
                        o32[i],
                        s32[i]
                    );
                    if ty == QuantType::F16 {
                        // f16 to f16 is a copy of the input bits
                        let bits = u16::from_le_bytes([raw[2 * i], raw[2 * i + 1]]);
                        assert_eq!(o16[i], bits, "{ty} {isa:?} element {i}");
                    } else {
                        assert!(
                            same_f16(o16[i], s32[i]),
                            "{ty} {isa:?} f16 {n_blocks} blocks element {i}"
                        );
                    }
                }
            }
        }
    }
}

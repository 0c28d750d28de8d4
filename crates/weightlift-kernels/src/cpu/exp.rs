//! The exponential the vector kernels share: its constants, and [`exp_twin`], a scalar form
//! that does the vector `exp8`/`exp16` operations one lane at a time, so a kernel that needs
//! the same bits on every instruction set (attention) can use it in its scalar fallback.

/// Above this `exp` overflows to +inf (the f32 just below ln(f32::MAX)).
pub(crate) const EXP_HI: f32 = 88.722_83;
/// Below this `exp` rounds to 0 (ln of 2⁻¹⁵⁰, half the smallest subnormal).
pub(crate) const EXP_LO: f32 = -103.972_08;
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
// ln 2 split so that n·LN2_HI is exact for |n| ≤ 2⁹ (Cephes' C1, C2)
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes expf: e^r ≈ 1 + r + r²·P(r) on |r| ≤ ln2/2, Horner from the highest coefficient
/// (Cephes' last one, 5.0000001201e-1, rounds to 0.5 in f32).
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` by the vector exponential's operations on one value: clamp, `n = round(x·log2 e)`
/// (ties to even), `r = x − n·ln2` in two fused steps, the degree-7 polynomial by fused
/// multiply-adds, and the scaling by 2ⁿ in two exact steps; +inf above [`EXP_HI`], 0 below
/// [`EXP_LO`], NaN kept. Bit for bit the result of `x86_ops::math::exp8`/`exp16` on the
/// same input (tested there), within 1.5 ulp of the exact value.
///
/// Without a hardware FMA, `mul_add` is a correctly rounded software fused multiply-add, so
/// the bits stay the same (only slower).
#[inline]
pub(crate) fn exp_twin(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_HI {
        return f32::INFINITY;
    }
    if x < EXP_LO {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p.mul_add(r, *c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // 2ⁿ = 2^(n>>1) · 2^(n − n>>1): both factors normal for n in [−150, 128]
    let ni = n as i32;
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    (y * s1) * s2
}

#[cfg(test)]
mod tests {
    use super::exp_twin;

    #[test]
    fn twin_is_within_one_and_a_half_ulp_of_the_exact_value() {
        let mut b = 0u32;
        while b < 0xffff_ffff - 9973 {
            let x = f32::from_bits(b);
            b += 9973;
            if !(-87.3..=88.72).contains(&x) {
                continue;
            }
            let want = f64::from(x).exp();
            let w32 = want as f32;
            let ulp = f64::from(f32::from_bits(w32.to_bits() + 1) - w32);
            let got = f64::from(exp_twin(x));
            assert!((got - want).abs() <= 1.5 * ulp, "exp({x:e}) = {got:e}");
        }
        assert!(exp_twin(f32::NAN).is_nan());
        assert_eq!(exp_twin(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_twin(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_twin(0.0), 1.0);
        assert_eq!(exp_twin(-104.0), 0.0);
        assert_eq!(exp_twin(89.0), f32::INFINITY);
    }
}

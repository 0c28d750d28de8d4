//! The forms of the attention fold that go one query row at a time (see
//! [`attention`](super::attention)): the step form, and the tiled form's scalar level, which
//! the SIMD levels match bit for bit.

use super::Isa;
use super::attention::{Fold, Task};
use super::exp::exp_twin;
use super::matvec::dot_f32;

/// `x` rounded to the nearest f16 (ties to even) and back, as F16C's `vcvtps2ph` and the
/// `half` crate round: ±inf from 65520 up, multiples of 2⁻²⁴ below 2⁻¹⁴, NaN kept.
#[inline]
pub(crate) fn round_f16(x: f32) -> f32 {
    let a = x.abs();
    if a.is_nan() {
        return x;
    }
    if a >= 65520.0 {
        return f32::INFINITY.copysign(x);
    }
    if a < 1.0 / 16384.0 {
        // a · 2²⁴ < 2¹⁰ rounded to an integer, ties to even, by the add and subtract of 2²³
        // (exact in the default rounding: round_ties_even itself is a libm call here, on
        // every small weight of a long context's softmax)
        const SHIFT: f32 = 8_388_608.0;
        let q = ((a * 16_777_216.0 + SHIFT) - SHIFT) * (1.0 / 16_777_216.0);
        return q.copysign(x);
    }
    // drop 13 of f32's 23 mantissa bits, ties to even (a carry moves into the exponent)
    let b = x.to_bits();
    f32::from_bits((b + 0x0fff + ((b >> 13) & 1)) & !0x1fff)
}

/// The step form: the attention module documentation's operations, one row at a time, one
/// step per tile. The tile's rows are f32, or an f16 cache's rows read in place (each value
/// widened as the cache's decoding widens it, in the same sums: the bits of the decoded tile).
pub(crate) fn fold_task_step(isa: Isa, f: &Fold<'_>, task: Task<'_>) {
    let hd = f.head_dim;
    let in_place = !f.k16.is_empty();
    let mut q = vec![0f32; hd];
    for r in 0..task.m.len() {
        let (t, h) = (task.t0 + (task.g0 + r) / f.group, (task.g0 + r) % f.group);
        let (first, seen) = (f.first(t), f.seen(t));
        if seen <= first {
            continue;
        }
        for (d, x) in q.iter_mut().zip(f.q_row(task.kh, t, h)) {
            *d = if f.f16 { round_f16(*x) } else { *x };
        }
        let (m, l) = (&mut task.m[r], &mut task.l[r]);
        let o = &mut task.o[r * hd..(r + 1) * hd];
        let w = &mut task.p[r * f.chunk + first..r * f.chunk + seen];
        // in place at AVX-512, whole heads of 32: 16 keys' dots at a time (the same bits)
        let by_16 = if in_place && isa.has_avx512() && hd.is_multiple_of(32) {
            w.len() / 16 * 16
        } else {
            0
        };
        #[cfg(target_arch = "x86_64")]
        for (b, w16) in w[..by_16].chunks_exact_mut(16).enumerate() {
            let mut dots = [0f32; 16];
            let at = (first + 16 * b) * f.kv_dim + task.kh * hd;
            // SAFETY: AVX-512F with F16C detected at run time; the tile holds these 16 keys'
            // rows of kv_dim, each with this kv head's hd values.
            unsafe { super::x86_ops::imp::dot16_f16_avx512(&q, &f.k16[at..], f.kv_dim, &mut dots) };
            for (wj, s) in w16.iter_mut().zip(dots) {
                *wj = f.cap(s * f.scale);
            }
        }
        for (j, wj) in w.iter_mut().enumerate().skip(by_16) {
            let s = if in_place {
                dot_f16(isa, &q, f.k16_row(task.kh, first + j))
            } else {
                dot_f32(isa, &q, f.k_row(task.kh, first + j))
            };
            *wj = f.cap(s * f.scale);
        }
        let m_new = m.max(w.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)));
        let keep = (*m - m_new).exp();
        if keep != 1.0 {
            o.iter_mut().for_each(|x| *x *= keep);
        }
        let mut sum = 0f32;
        for wj in w.iter_mut() {
            let mut p = (*wj - m_new).exp();
            if f.f16 {
                p = round_f16(p);
            }
            sum += p;
            *wj = p;
        }
        let at = first * f.kv_dim + task.kh * hd;
        if in_place {
            add_weighted_rows_f16(isa, o, w, &f.v16[at..], f.kv_dim);
        } else {
            add_weighted_rows_isa(isa, o, w, &f.v[at..], f.kv_dim);
        }
        *l = *l * keep + sum;
        *m = m_new;
    }
}

/// [`add_weighted_rows`] at the instruction set's width (the same bits at every width).
#[inline]
fn add_weighted_rows_isa(isa: Isa, o: &mut [f32], p: &[f32], v: &[f32], stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 (and AVX-512F where has_avx512) detected at run time; `v` holds the
        // rows of `p` at `stride`, each as long as `o`.
        unsafe {
            if isa.has_avx512() {
                super::x86_ops::imp::add_weighted_rows_avx512(o, p, v, stride);
            } else {
                super::x86_ops::imp::add_weighted_rows_avx2(o, p, v, stride);
            }
        }
        return;
    }
    let _ = isa;
    add_weighted_rows(o, p, v, stride);
}

/// [`add_weighted_rows`] over f16 value rows, each value widened as the cache's f16 decoding
/// at this instruction set widens it.
#[inline]
fn add_weighted_rows_f16(isa: Isa, o: &mut [f32], p: &[f32], v: &[u16], stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 with F16C (and AVX-512F where has_avx512) detected at run time; `v`
        // holds the rows of `p` at `stride`, each as long as `o`.
        unsafe {
            if isa.has_avx512() {
                super::x86_ops::imp::add_weighted_rows_f16_avx512(o, p, v, stride);
            } else {
                super::x86_ops::imp::add_weighted_rows_f16_avx2(o, p, v, stride);
            }
        }
        return;
    }
    let _ = isa;
    add_weighted_rows_of(o, p, v, stride, super::half::f16_to_f32);
}

/// [`dot_f32`] of `a` with the f16 values `b`, each widened as the cache's f16 decoding at
/// this instruction set widens it, in `dot_f32`'s order: the bits of the dot with the decoded
/// row.
#[inline]
fn dot_f16(isa: Isa, a: &[f32], b: &[u16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if isa.has_avx512() {
            // SAFETY: AVX-512F with F16C detected at run time.
            return unsafe { super::x86_ops::imp::dot_f16_avx512(a, b) };
        }
        if isa.has_avx2() {
            // SAFETY: AVX2, FMA and F16C detected at run time.
            return unsafe { super::x86_ops::imp::dot_f16_avx2(a, b) };
        }
    }
    let _ = isa;
    super::matvec::dot_scalar_of(a, b, super::half::f16_to_f32)
}

/// `o += p_j · v_j` for each weight `p_j` in order, the row `v_j` at `j · stride` of `v`, each
/// product rounded before it is added: the step form's values pass (its SIMD twins in
/// `x86_ops::attention` are this loop compiled for wider vectors, lane for lane the same).
#[inline(always)]
pub(crate) fn add_weighted_rows(o: &mut [f32], p: &[f32], v: &[f32], stride: usize) {
    add_weighted_rows_of(o, p, v, stride, |x| x);
}

/// [`add_weighted_rows`] with each value of `v` read as f32 by `value` (the identity, or an f16
/// cache row's widening).
#[inline(always)]
fn add_weighted_rows_of<T: Copy>(
    o: &mut [f32],
    p: &[f32],
    v: &[T],
    stride: usize,
    value: impl Fn(T) -> f32,
) {
    for (j, pj) in p.iter().enumerate() {
        for (x, vv) in o.iter_mut().zip(&v[j * stride..]) {
            *x += pj * value(*vv);
        }
    }
}

/// The tiled form's scalar level: the attention module documentation's operations, one row at
/// a time.
pub(crate) fn fold_task_scalar(f: &Fold<'_>, task: Task<'_>) {
    let hd = f.head_dim;
    let mut q = vec![0f32; hd];
    for r in 0..task.m.len() {
        let t = task.t0 + r / f.group;
        for (d, x) in q.iter_mut().zip(f.q_row(task.kh, t, r % f.group)) {
            *d = if f.f16 { round_f16(*x) } else { *x };
        }
        let (m, l) = (&mut task.m[r], &mut task.l[r]);
        let o = &mut task.o[r * hd..(r + 1) * hd];
        let p = &mut task.p[r * f.chunk..(r + 1) * f.chunk];
        let seen_all = f.seen(t);
        // the keys before the window's first are skipped whole steps at a time, and the
        // step holding it starts there: without a window, every step from 0
        let first = f.first(t);
        let mut c0 = first - first % f.chunk;
        while c0 < seen_all {
            let lo = first.max(c0);
            let seen = (seen_all - c0).min(f.chunk);
            let w = &mut p[lo - c0..seen];
            for (j, wj) in w.iter_mut().enumerate() {
                let mut s = 0f32;
                for (a, b) in q.iter().zip(f.k_row(task.kh, lo + j)) {
                    s = a.mul_add(*b, s);
                }
                *wj = f.cap(s * f.scale);
            }
            let m_new = m.max(w.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)));
            let mu = if m_new == f32::NEG_INFINITY {
                0.0
            } else {
                m_new
            };
            let keep = exp_twin(*m - mu);
            o.iter_mut().for_each(|x| *x *= keep);
            let mut sum = 0f32;
            for (j, wj) in w.iter().enumerate() {
                let mut pj = exp_twin(wj - mu);
                if f.f16 {
                    pj = round_f16(pj);
                }
                sum += pj;
                let vr = f.v_row(task.kh, lo + j);
                if f.f16 {
                    o.iter_mut()
                        .zip(vr)
                        .for_each(|(x, v)| *x = pj.mul_add(*v, *x));
                } else {
                    o.iter_mut().zip(vr).for_each(|(x, v)| *x += pj * v);
                }
            }
            *l = *l * keep + sum;
            *m = m_new;
            c0 += f.chunk;
        }
    }
}

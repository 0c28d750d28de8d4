//! AVX-512 and AVX2 forms of the attention fold (see [`crate::cpu::attention`]): each fold
//! step's keys of one kv head are transposed so that 16 (AVX-512) or 8 (AVX2) keys share a
//! vector, four query rows meet them at once in registers (`s_j` summed over `d` in order,
//! one lane per key), and the weighted values are summed with head dimensions in lanes (over
//! `j` in order). Per query row these are the scalar form's operations, so the results have
//! its bits.

use std::arch::x86_64::*;

use super::attention_kernels::{
    scores_256, scores_512, transpose_keys_256, transpose_keys_512, values_by_256, values_by_512,
};
use super::math::{exp8, exp16, hmax8, mask8, mask16};
use crate::cpu::attention::{FOLD_KEYS, Fold, KT_VALUES, MAX_SIMD_HEAD_DIM, Task};
use crate::cpu::attention_rows::add_weighted_rows;
use crate::cpu::exp::exp_twin;
use crate::cpu::x86::imp::{dot_by_avx2, dot_by_avx512};

/// Query rows that meet a step's keys together.
pub(super) const BLOCK: usize = 4;

/// The step's scores (then weights) of a block's rows.
pub(super) type Weights = [[f32; FOLD_KEYS]; BLOCK];

/// The rows of a block that the step reaches, and what the softmax hands to the values pass.
struct Block {
    rb: usize,
    nr: usize,
    seen: [usize; BLOCK],
    keep: [f32; BLOCK],
    m_new: [f32; BLOCK],
}

impl Block {
    /// Rows `rb..` of `task` (at most four) at the step from tile key `c0` with `kn` keys.
    fn new(f: &Fold<'_>, task: &Task<'_>, rb: usize, c0: usize, kn: usize) -> Block {
        let nr = BLOCK.min(task.m.len() - rb);
        let mut seen = [0; BLOCK];
        for (i, s) in seen.iter_mut().enumerate().take(nr) {
            *s = (f.seen(task.t0 + (rb + i) / f.group) - c0).min(kn);
        }
        Block {
            rb,
            nr,
            seen,
            keep: [1.0; BLOCK],
            m_new: [0.0; BLOCK],
        }
    }

    /// The new maximum of row `i` from its step maximum `mx`; returns `μ` and records `keep`.
    fn update_max(&mut self, task: &Task<'_>, i: usize, mx: f32) -> f32 {
        let m = task.m[self.rb + i];
        let m_new = m.max(mx);
        let mu = if m_new == f32::NEG_INFINITY {
            0.0
        } else {
            m_new
        };
        self.keep[i] = exp_twin(m - mu);
        self.m_new[i] = m_new;
        mu
    }

    /// The step's last key any row of the block sees, plus one.
    fn reach(&self) -> usize {
        self.seen[..self.nr].iter().copied().max().unwrap_or(0)
    }

    /// Pointers to each row's weights and output (rows past `nr` read zero weights and write
    /// into `spare`), for the values pass.
    fn rows(
        &self,
        f: &Fold<'_>,
        task: &mut Task<'_>,
        zero: &[f32; FOLD_KEYS],
        spare: &mut [f32; BLOCK * MAX_SIMD_HEAD_DIM],
    ) -> ([*const f32; BLOCK], [*mut f32; BLOCK]) {
        let mut pp = [zero.as_ptr(); BLOCK];
        let mut op = [spare.as_mut_ptr(); BLOCK];
        let (p, o) = (task.p.as_ptr(), task.o.as_mut_ptr());
        for i in 0..BLOCK {
            let r = self.rb + i;
            // SAFETY: row r < rows of the task: its weights and output are in its slices; the
            // spare rows are in `spare`.
            unsafe {
                if i < self.nr {
                    pp[i] = p.add(r * f.chunk);
                    op[i] = o.add(r * f.head_dim);
                } else {
                    op[i] = op[i].add(i * MAX_SIMD_HEAD_DIM);
                }
            }
        }
        (pp, op)
    }

    /// `l = l · keep + sum` and `m = m'` for each row.
    fn finish(&self, task: &mut Task<'_>, sums: &[f32; BLOCK]) {
        let rows = self.keep.iter().zip(&self.m_new).zip(sums).take(self.nr);
        for (i, ((keep, m_new), sum)) in rows.enumerate() {
            let r = self.rb + i;
            task.l[r] = task.l[r] * keep + sum;
            task.m[r] = *m_new;
        }
    }
}

/// The first task row whose token sees tile key `c0` (rows run in token order).
fn first_row(f: &Fold<'_>, task: &Task<'_>, c0: usize) -> usize {
    let t_first = (f.k0 + c0).saturating_sub(f.start);
    (t_first.saturating_sub(task.t0) * f.group).min(task.m.len())
}

/// The AVX-512 form of one task: per fold step, the keys transposed once, then blocks of four
/// query rows.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C; `head_dim` a multiple of 16 and at most
/// [`MAX_SIMD_HEAD_DIM`], `head_dim · chunk` (rounded up to 16 keys) within [`KT_VALUES`], `f`
/// and `task` as `Attention::fold_with` builds them; `kt` (at least [`KT_VALUES`]) is scratch
/// for the transposed keys.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(crate) unsafe fn fold_task_avx512(f: &Fold<'_>, mut task: Task<'_>, kt: &mut [f32]) {
    let hd = f.head_dim;
    assert!(kt.len() >= KT_VALUES, "fold_task_avx512: key scratch");
    // the block's queries, its padding rows' outputs and zero weights, its scores
    let mut qb = [0f32; BLOCK * MAX_SIMD_HEAD_DIM];
    let mut spare = [0f32; BLOCK * MAX_SIMD_HEAD_DIM];
    let zero = [0f32; FOLD_KEYS];
    let mut w: Weights = [[0.0; FOLD_KEYS]; BLOCK];
    let mut c0 = 0;
    while c0 < f.keys {
        let kn = f.chunk.min(f.keys - c0);
        let kp = kn.next_multiple_of(16);
        let r_first = first_row(f, &task, c0);
        if r_first == task.m.len() {
            break; // later steps start later still
        }
        // SAFETY: as the contract (kp · hd <= KT_VALUES).
        unsafe { transpose_keys_512(f, task.kh, c0, kn, kp, kt) };
        for rb in (r_first..task.m.len()).step_by(BLOCK) {
            let mut b = Block::new(f, &task, rb, c0, kn);
            for i in 0..b.nr {
                let r = rb + i;
                let src = f.q_row(task.kh, task.t0 + r / f.group, r % f.group);
                for d in (0..hd).step_by(16) {
                    // SAFETY: d + 16 <= head_dim within the row and within qb's row i.
                    unsafe {
                        let mut x = _mm512_loadu_ps(src.as_ptr().add(d));
                        if f.f16 {
                            x = _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
                        }
                        _mm512_storeu_ps(qb.as_mut_ptr().add(i * hd + d), x);
                    }
                }
            }
            // SAFETY: kt holds hd rows of kp keys; qb four rows of hd.
            unsafe {
                match kp / 16 {
                    1 => scores_512::<1>(&qb, hd, kt, kp, f.scale, &mut w),
                    2 => scores_512::<2>(&qb, hd, kt, kp, f.scale, &mut w),
                    3 => scores_512::<3>(&qb, hd, kt, kp, f.scale, &mut w),
                    _ => scores_512::<4>(&qb, hd, kt, kp, f.scale, &mut w),
                }
            }
            for (i, wi) in w.iter_mut().enumerate().take(b.nr) {
                let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
                let mut mx = ninf;
                let mut s = [ninf; FOLD_KEYS / 16];
                for (v, sv) in s.iter_mut().enumerate().take(kp / 16) {
                    let lanes = mask16(b.seen[i].saturating_sub(16 * v).min(16));
                    // SAFETY: 16·v + 16 <= kp <= 64 values of the row.
                    *sv = unsafe { _mm512_mask_loadu_ps(ninf, lanes, wi.as_ptr().add(16 * v)) };
                    mx = _mm512_max_ps(mx, *sv);
                }
                let mu = _mm512_set1_ps(b.update_max(&task, i, _mm512_reduce_max_ps(mx)));
                for (v, sv) in s.iter().enumerate().take(kp / 16) {
                    let mut p = exp16(_mm512_sub_ps(*sv, mu));
                    if f.f16 {
                        p = _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(p));
                    }
                    // SAFETY: as above.
                    unsafe { _mm512_storeu_ps(wi.as_mut_ptr().add(16 * v), p) };
                }
                let r = rb + i;
                task.p[r * f.chunk..r * f.chunk + kn].copy_from_slice(&wi[..kn]);
            }
            let (pp, op) = b.rows(f, &mut task, &zero, &mut spare);
            let reach = b.reach();
            let mut sums = [0f32; BLOCK];
            // SAFETY: tile key c0 at kv head kh is in bounds.
            let vrow = unsafe { f.v.as_ptr().add(c0 * f.kv_dim + task.kh * hd) };
            for d0 in (0..hd).step_by(64) {
                let op = op.map(|p| p.wrapping_add(d0));
                let (keep, v, kvd) = (&b.keep, vrow.wrapping_add(d0), f.kv_dim);
                // SAFETY: the weights hold reach <= kn values per row, the outputs hd values
                // per row, and the tile `reach` value rows after key c0; AVX-512F.
                unsafe {
                    values_by_512(
                        (hd - d0).min(64) / 16,
                        d0 == 0,
                        f.f16,
                        &pp,
                        &op,
                        keep,
                        v,
                        kvd,
                        reach,
                        &mut sums,
                    )
                };
            }
            b.finish(&mut task, &sums);
        }
        c0 += f.chunk;
    }
}

/// The AVX2 form of one task (as [`fold_task_avx512`], with 8-lane vectors).
///
/// # Safety
/// AVX2, FMA and F16C; `head_dim` a multiple of 8, otherwise as [`fold_task_avx512`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn fold_task_avx2(f: &Fold<'_>, mut task: Task<'_>, kt: &mut [f32]) {
    let hd = f.head_dim;
    assert!(kt.len() >= KT_VALUES, "fold_task_avx2: key scratch");
    // the block's queries, its padding rows' outputs and zero weights, its scores
    let mut qb = [0f32; BLOCK * MAX_SIMD_HEAD_DIM];
    let mut spare = [0f32; BLOCK * MAX_SIMD_HEAD_DIM];
    let zero = [0f32; FOLD_KEYS];
    let mut w: Weights = [[0.0; FOLD_KEYS]; BLOCK];
    let mut c0 = 0;
    while c0 < f.keys {
        let kn = f.chunk.min(f.keys - c0);
        let kp = kn.next_multiple_of(16);
        let r_first = first_row(f, &task, c0);
        if r_first == task.m.len() {
            break;
        }
        // SAFETY: as the contract (kp · hd <= KT_VALUES).
        unsafe { transpose_keys_256(f, task.kh, c0, kn, kp, kt) };
        for rb in (r_first..task.m.len()).step_by(BLOCK) {
            let mut b = Block::new(f, &task, rb, c0, kn);
            for i in 0..b.nr {
                let r = rb + i;
                let src = f.q_row(task.kh, task.t0 + r / f.group, r % f.group);
                for d in (0..hd).step_by(8) {
                    // SAFETY: d + 8 <= head_dim within the row and within qb's row i.
                    unsafe {
                        let mut x = _mm256_loadu_ps(src.as_ptr().add(d));
                        if f.f16 {
                            x = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
                        }
                        _mm256_storeu_ps(qb.as_mut_ptr().add(i * hd + d), x);
                    }
                }
            }
            // SAFETY: kt holds hd rows of kp keys; qb four rows of hd.
            unsafe { scores_256(&qb, hd, kt, kp, f.scale, &mut w) };
            for (i, wi) in w.iter_mut().enumerate().take(b.nr) {
                let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
                let mut mx = ninf;
                let mut s = [ninf; FOLD_KEYS / 8];
                for (v, sv) in s.iter_mut().enumerate().take(kp / 8) {
                    let lanes = mask8(b.seen[i].saturating_sub(8 * v).min(8));
                    // SAFETY: 8·v + 8 <= kp <= 64 values of the row.
                    let x = unsafe { _mm256_loadu_ps(wi.as_ptr().add(8 * v)) };
                    *sv = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(lanes));
                    mx = _mm256_max_ps(mx, *sv);
                }
                let mu = _mm256_set1_ps(b.update_max(&task, i, hmax8(mx)));
                for (v, sv) in s.iter().enumerate().take(kp / 8) {
                    let mut p = exp8(_mm256_sub_ps(*sv, mu));
                    if f.f16 {
                        p = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(p));
                    }
                    // SAFETY: as above.
                    unsafe { _mm256_storeu_ps(wi.as_mut_ptr().add(8 * v), p) };
                }
                let r = rb + i;
                task.p[r * f.chunk..r * f.chunk + kn].copy_from_slice(&wi[..kn]);
            }
            let (pp, op) = b.rows(f, &mut task, &zero, &mut spare);
            let reach = b.reach();
            let mut sums = [0f32; BLOCK];
            // SAFETY: tile key c0 at kv head kh is in bounds.
            let vrow = unsafe { f.v.as_ptr().add(c0 * f.kv_dim + task.kh * hd) };
            for d0 in (0..hd).step_by(16) {
                let op = op.map(|p| p.wrapping_add(d0));
                let (keep, v, kvd) = (&b.keep, vrow.wrapping_add(d0), f.kv_dim);
                // SAFETY: as in the AVX-512 form, with 8-value vectors.
                unsafe {
                    values_by_256(
                        (hd - d0).min(16) / 8,
                        d0 == 0,
                        f.f16,
                        &pp,
                        &op,
                        keep,
                        v,
                        kvd,
                        reach,
                        &mut sums,
                    )
                };
            }
            b.finish(&mut task, &sums);
        }
        c0 += f.chunk;
    }
}

/// The step form's values pass (`attention::add_weighted_rows`) compiled for AVX-512: the same
/// products and sums, element by element, in 16-lane vectors.
///
/// # Safety
/// AVX-512F; `v` holds `p.len()` rows of `o.len()` values at stride `stride`.
#[target_feature(enable = "avx2,avx512f")]
pub(crate) unsafe fn add_weighted_rows_avx512(o: &mut [f32], p: &[f32], v: &[f32], stride: usize) {
    add_weighted_rows(o, p, v, stride);
}

/// [`add_weighted_rows_avx512`] in 8-lane vectors.
///
/// # Safety
/// AVX2; as [`add_weighted_rows_avx512`].
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn add_weighted_rows_avx2(o: &mut [f32], p: &[f32], v: &[f32], stride: usize) {
    add_weighted_rows(o, p, v, stride);
}

/// `dot_f32_avx512` (in `x86`) of `a` with the f16 values `b`, each widened as the cache's
/// f16 decoding widens it (F16C; the tail as its tail): its loop (`dot_by_avx512`), so the
/// bits of the dot with the decoded row.
///
/// # Safety
/// AVX-512F and F16C.
#[target_feature(enable = "avx2,f16c,avx512f")]
pub(crate) unsafe fn dot_f16_avx512(a: &[f32], b: &[u16]) -> f32 {
    let n = a.len().min(b.len());
    // SAFETY: dot_by_avx512 loads 16 values at `at` only while at + 16 <= n.
    let load =
        |at: usize| unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(b.as_ptr().add(at).cast())) };
    dot_by_avx512(a, n, load, |j| crate::cpu::half::f16_to_f32(b[j]))
}

/// [`dot_f16_avx512`] of `a` with 16 rows of f16 values (row `k` at `rows[k · stride..]`),
/// into `out[k]`, each with the bits of its own dot: the 16 sums share their reductions, whose
/// shuffles pair the lanes as `_mm512_reduce_add_ps` does (the halves of 16 lanes, then of 8,
/// then of 4, then the last two), so every sum is the same tree of the same values. `a.len()`
/// is a multiple of 32 (no scalar tail).
///
/// # Safety
/// AVX-512F and F16C; `rows` holds `15 · stride + a.len()` values.
#[target_feature(enable = "avx2,f16c,avx512f")]
pub(crate) unsafe fn dot16_f16_avx512(a: &[f32], rows: &[u16], stride: usize, out: &mut [f32; 16]) {
    let n = a.len();
    assert!(n.is_multiple_of(32) && rows.len() >= 15 * stride + n);
    let (pa, pb) = (a.as_ptr(), rows.as_ptr());
    // each row's two accumulators, added: the vector dot_f16_avx512 reduces
    let sums: [__m512; 16] = std::array::from_fn(|k| {
        let mut acc = [_mm512_setzero_ps(); 2];
        let mut i = 0;
        while i < n {
            // SAFETY: i + 32 <= n values of `a` and of row k.
            unsafe {
                for (h, acc_h) in acc.iter_mut().enumerate() {
                    let at = k * stride + i + 16 * h;
                    let w = _mm512_cvtph_ps(_mm256_loadu_si256(pb.add(at).cast()));
                    *acc_h = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16 * h)), w, *acc_h);
                }
            }
            i += 32;
        }
        _mm512_add_ps(acc[0], acc[1])
    });
    // lane i + lane i + 8 of each row: rows 2m and 2m + 1 in one vector, 8 lanes each
    let s1: [__m512; 8] = std::array::from_fn(|m| {
        let (x, y) = (sums[2 * m], sums[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    });
    // then i + i + 4: rows 4n..4n + 4, one in each 128-bit quarter
    let s2: [__m512; 4] = std::array::from_fn(|m| {
        let (x, y) = (s1[2 * m], s1[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    });
    // then 0 + 2 and 1 + 3 within each quarter: two rows a quarter
    let s3: [__m512; 2] = std::array::from_fn(|m| {
        let (x, y) = (s2[2 * m], s2[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
            _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
        )
    });
    // and the last two: lane 4q + r holds row 4r + q
    let last = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(s3[0], s3[1]),
        _mm512_shuffle_ps::<0b11_01_11_01>(s3[0], s3[1]),
    );
    let rows_in_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    // SAFETY: out holds 16 values.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_permutexvar_ps(rows_in_order, last)) };
}

/// `dot_f32_avx2` (in `x86`) of `a` with the f16 values `b`, through its loop
/// (`dot_by_avx2`) as [`dot_f16_avx512`] goes through the 512-bit one.
///
/// # Safety
/// AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_f16_avx2(a: &[f32], b: &[u16]) -> f32 {
    let n = a.len().min(b.len());
    // SAFETY: dot_by_avx2 loads 8 values at `at` only while at + 8 <= n.
    let load = |at: usize| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().add(at).cast())) };
    dot_by_avx2(a, n, load, |j| crate::cpu::half::f16_to_f32(b[j]))
}

/// The step form's values pass (`attention::add_weighted_rows`) over an f16 cache's value
/// rows, each value widened as the cache's f16 decoding widens it: `o[d] += p_j · v_j[d]`,
/// product then sum, `j` in order for each `d`. The outputs stay in registers while every row
/// adds to them: 64 at a time, then 16, then one by one.
///
/// # Safety
/// AVX-512F and F16C; `v` holds `p.len()` rows of `o.len()` values at stride `stride`.
#[target_feature(enable = "avx2,f16c,avx512f")]
pub(crate) unsafe fn add_weighted_rows_f16_avx512(
    o: &mut [f32],
    p: &[f32],
    v: &[u16],
    stride: usize,
) {
    const L: usize = 16;
    // SAFETY (each call): `at + 16` is within the row of its `j`, as the callers' bounds show.
    let widen =
        |at: usize| unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(at).cast())) };
    let n = o.len();
    let mut d = 0;
    while d + 4 * L <= n {
        // SAFETY: d + 64 <= o.len(), and each row holds o.len() values.
        unsafe {
            let mut acc: [__m512; 4] =
                std::array::from_fn(|b| _mm512_loadu_ps(o.as_ptr().add(d + L * b)));
            for (j, pj) in p.iter().enumerate() {
                let pv = _mm512_set1_ps(*pj);
                for (b, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(pv, widen(j * stride + d + L * b)));
                }
            }
            for (b, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(o.as_mut_ptr().add(d + L * b), *a);
            }
        }
        d += 4 * L;
    }
    while d + L <= n {
        // SAFETY: d + 16 <= o.len(), and each row holds o.len() values.
        unsafe {
            let mut acc = _mm512_loadu_ps(o.as_ptr().add(d));
            for (j, pj) in p.iter().enumerate() {
                acc = _mm512_add_ps(
                    acc,
                    _mm512_mul_ps(_mm512_set1_ps(*pj), widen(j * stride + d)),
                );
            }
            _mm512_storeu_ps(o.as_mut_ptr().add(d), acc);
        }
        d += L;
    }
    weighted_f16_tail(o, p, v, stride, d);
}

/// [`add_weighted_rows_f16_avx512`] in 8-lane vectors.
///
/// # Safety
/// AVX2 and F16C; as [`add_weighted_rows_f16_avx512`].
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn add_weighted_rows_f16_avx2(
    o: &mut [f32],
    p: &[f32],
    v: &[u16],
    stride: usize,
) {
    let n = o.len();
    let mut d = 0;
    while d + 8 <= n {
        // SAFETY: d + 8 <= o.len(), and each row holds o.len() values.
        unsafe {
            let mut acc = _mm256_loadu_ps(o.as_ptr().add(d));
            for (j, pj) in p.iter().enumerate() {
                let w = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(j * stride + d).cast()));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(*pj), w));
            }
            _mm256_storeu_ps(o.as_mut_ptr().add(d), acc);
        }
        d += 8;
    }
    weighted_f16_tail(o, p, v, stride, d);
}

/// Elements `d..` of the f16 values pass, one at a time (as the decoding's tail widens them).
fn weighted_f16_tail(o: &mut [f32], p: &[f32], v: &[u16], stride: usize, d: usize) {
    for (e, x) in o.iter_mut().enumerate().skip(d) {
        for (j, pj) in p.iter().enumerate() {
            *x += pj * crate::cpu::half::f16_to_f32(v[j * stride + e]);
        }
    }
}

//! Mirostat (Basu et al., "Mirostat: a neural text decoding algorithm that directly controls
//! perplexity", ICLR 2021) as llama.cpp's `mirostat` and `mirostat-v2` samplers run it.
//!
//! Both keep a running threshold `mu`, started at `2·tau`, and after every draw move it against
//! the error between the drawn token's surprise and the target: `mu ← mu − eta·(s − tau)`, where
//! `s = −log2 p` is the surprise of the drawn token under the distribution it was drawn from
//! (renormalised over what the truncation kept).
//!
//! - Version 1 estimates the Zipf exponent `ŝ` of the distribution from its `m = 100` most
//!   likely tokens by least squares, `ŝ = Σ tᵢbᵢ / Σ tᵢ²` with `tᵢ = ln((i+2)/(i+1))` and
//!   `bᵢ = ln(pᵢ/pᵢ₊₁)`, then keeps the top `k = (ε̂·2^mu / (1 − N^−ε̂))^(1/ŝ)` tokens, with
//!   `ε̂ = ŝ − 1` and `N` the vocabulary size.
//! - Version 2 keeps every token whose surprise is at most `mu` (at least the most likely one).
//!
//! Two edge cases where llama.cpp's arithmetic is undefined get a defined answer here. `bᵢ` is
//! the logit difference, which is `ln(pᵢ/pᵢ₊₁)` without the underflow of `pᵢ₊₁` to 0, and the
//! estimate stops at the first token that cannot be drawn (a logit of −inf, as a grammar leaves
//! it): llama.cpp divides by that zero probability and, on x86, ends with `k = 1`. A `k` too
//! large for an integer keeps every candidate (llama.cpp's float-to-int conversion is undefined
//! there; on x86 it gives `k = 1`, on ARM every candidate).

use std::collections::BinaryHeap;

use crate::error::{Result, invalid};

use super::cands::{Cands, Worst, by_rank, fill_all, fill_top_k, softmax};
use super::steps::draw;

/// Mirostat's settings: llama-cpp-python's `mirostat_mode`, `mirostat_tau` and `mirostat_eta`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Mirostat {
    /// The usual chain: top-k, typical, top-p, min-p, temperature.
    #[default]
    Off,
    /// Version 1: top `k` from the estimated Zipf exponent (`mirostat_mode=1`).
    V1 {
        /// The target surprise in bits (`mirostat_tau`); `mu` starts at twice it.
        tau: f32,
        /// How fast `mu` follows the error (`mirostat_eta`).
        eta: f32,
    },
    /// Version 2: every token whose surprise is at most `mu` (`mirostat_mode=2`).
    V2 { tau: f32, eta: f32 },
}

impl Mirostat {
    /// llama-cpp-python's arguments: `mode` 0 (off), 1 or 2, the target surprise `tau` and the
    /// learning rate `eta`, each finite and >= 0. The error names the argument that is out of
    /// range.
    pub fn from_mode(mode: i64, tau: f32, eta: f32) -> Result<Mirostat> {
        let m = match mode {
            0 => return Ok(Mirostat::Off),
            1 => Mirostat::V1 { tau, eta },
            2 => Mirostat::V2 { tau, eta },
            _ => {
                return Err(invalid(
                    "sampling mirostat_mode",
                    "0 (off), 1 (mirostat) or 2 (mirostat 2.0)",
                    mode,
                ));
            }
        };
        m.validate()?;
        Ok(m)
    }

    /// `tau` and `eta`, when on.
    pub fn tau_eta(&self) -> Option<(f32, f32)> {
        match *self {
            Mirostat::Off => None,
            Mirostat::V1 { tau, eta } | Mirostat::V2 { tau, eta } => Some((tau, eta)),
        }
    }

    /// Checks `tau` and `eta`: each finite and >= 0.
    pub fn validate(&self) -> Result<()> {
        let Some((tau, eta)) = self.tau_eta() else {
            return Ok(());
        };
        for (what, expected, value) in [
            (
                "sampling mirostat_tau",
                "a finite target surprise in bits >= 0",
                tau,
            ),
            ("sampling mirostat_eta", "a finite learning rate >= 0", eta),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(invalid(what, expected, value));
            }
        }
        Ok(())
    }
}

/// llama-cpp-python's `mirostat_m`: how many of the most likely tokens estimate `ŝ` (version 1).
pub(super) const MIROSTAT_M: usize = 100;

/// Fills `c` with the `k` best candidates of `src`, sorted best first.
fn fill_best(src: &[f32], k: usize, heap: &mut BinaryHeap<Worst>, c: &mut Cands) {
    if k < src.len() {
        fill_top_k(src, k, heap, c);
    } else {
        fill_all(src, c);
        c.v.sort_unstable_by(by_rank);
        c.sorted = true;
    }
}

/// `ŝ`, the least-squares Zipf exponent over the first `m` candidates of a best-first list; NaN
/// when fewer than two of them can be drawn.
pub(super) fn zipf_exponent(c: &Cands, m: usize) -> f32 {
    let mut sum_tb = 0.0f32;
    let mut sum_tt = 0.0f32;
    for (i, pair) in c.v.windows(2).take(m.saturating_sub(1)).enumerate() {
        if pair[1].logit == f32::NEG_INFINITY {
            break;
        }
        let t = ((i + 2) as f32 / (i + 1) as f32).ln();
        let b = pair[0].logit - pair[1].logit;
        sum_tb += t * b;
        sum_tt += t * t;
    }
    sum_tb / sum_tt
}

/// Version 1's `k` for exponent `s_hat`, threshold `mu` and a vocabulary of `n` tokens: at least
/// 1, and `usize::MAX` when the formula overflows.
pub(super) fn v1_k(s_hat: f32, mu: f32, n: usize) -> usize {
    let eps = s_hat - 1.0;
    let k = ((eps * 2f32.powf(mu)) / (1.0 - (n as f32).powf(-eps))).powf(1.0 / s_hat);
    // `as` truncates like C's int conversion, saturates at the top and maps NaN to 0.
    (k as usize).max(1)
}

/// Version 2's truncation: keep the candidates whose surprise `−log2 p` is at most `mu`, or the
/// most likely one when none is. `c` must hold probabilities (see [`softmax`]).
pub(super) fn keep_unsurprising(c: &mut Cands, mu: f32) {
    let best = c.v.iter().copied().min_by(by_rank);
    c.v.retain(|x| -x.p.log2() <= mu);
    if c.v.is_empty() {
        c.v.extend(best);
    }
}

/// `mu ← mu − eta·(−log2 p − tau)` for a drawn token of probability `p`.
pub(super) fn update_mu(mu: &mut f32, tau: f32, eta: f32, p: f32) {
    let surprise = -p.log2();
    *mu -= eta * (surprise - tau);
}

/// Draws from the softmax of `c` with `u` uniform in [0, 1); the token and its probability.
fn draw_with_p(c: &mut Cands, u: f64) -> (u32, f32) {
    let id = draw(c, u);
    // `draw` leaves each candidate's unnormalised weight in `p`.
    let total: f64 = c.v.iter().map(|x| f64::from(x.p)).sum();
    let weight =
        c.v.iter()
            .find(|x| x.id == id)
            .map_or(0.0, |x| f64::from(x.p));
    (id, (weight / total) as f32)
}

/// One draw of Mirostat version 1 over `src`, updating `mu`.
pub(super) fn v1(
    src: &[f32],
    (tau, eta): (f32, f32),
    mu: &mut f32,
    heap: &mut BinaryHeap<Worst>,
    c: &mut Cands,
    u: f64,
) -> u32 {
    fill_best(src, MIROSTAT_M, heap, c);
    let k = v1_k(zipf_exponent(c, MIROSTAT_M), *mu, src.len());
    if k <= c.v.len() {
        c.v.truncate(k);
    } else if k < src.len() {
        fill_top_k(src, k, heap, c);
    } else {
        // Everything stays; the draw needs no order.
        fill_all(src, c);
    }
    let (id, p) = draw_with_p(c, u);
    update_mu(mu, tau, eta, p);
    id
}

/// One draw of Mirostat version 2 over `src`, updating `mu`.
pub(super) fn v2(src: &[f32], (tau, eta): (f32, f32), mu: &mut f32, c: &mut Cands, u: f64) -> u32 {
    fill_all(src, c);
    softmax(c);
    keep_unsurprising(c, *mu);
    let (id, p) = draw_with_p(c, u);
    update_mu(mu, tau, eta, p);
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{Sampler, SamplingParams};
    use proptest::prelude::*;

    /// Probabilities in f64 from logits, independently of the sampler's softmax.
    fn probs(logits: &[f32]) -> Vec<f64> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = logits.iter().map(|&l| f64::from(l - max).exp()).collect();
        let total: f64 = w.iter().sum();
        w.iter().map(|x| x / total).collect()
    }

    fn mirostat(version: u8, tau: f32, eta: f32, seed: u64) -> Sampler {
        let m = if version == 1 {
            Mirostat::V1 { tau, eta }
        } else {
            Mirostat::V2 { tau, eta }
        };
        Sampler::new(SamplingParams {
            mirostat: m,
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        })
        .unwrap()
    }

    /// Version 2's kept set by the paper's rule, in f64: surprise −log2 p at most mu, or the
    /// most likely token alone.
    fn v2_reference_kept(p: &[f64], mu: f32) -> Vec<usize> {
        let kept: Vec<usize> = (0..p.len())
            .filter(|&i| -p[i].log2() <= f64::from(mu))
            .collect();
        if kept.is_empty() {
            let best = (0..p.len())
                .max_by(|&a, &b| p[a].total_cmp(&p[b]).then(b.cmp(&a)))
                .unwrap();
            vec![best]
        } else {
            kept
        }
    }

    /// Whether some probability sits so close to the threshold that f32 and f64 may disagree.
    fn near_threshold(p: &[f64], mu: f32) -> bool {
        p.iter().any(|&x| (-x.log2() - f64::from(mu)).abs() < 1e-3)
    }

    /// The paper's update, in f64, for a token of probability `p_kept` within the kept set.
    fn reference_mu(mu: f32, tau: f32, eta: f32, p_kept: f64) -> f64 {
        f64::from(mu) - f64::from(eta) * (-p_kept.log2() - f64::from(tau))
    }

    #[test]
    fn mu_starts_at_twice_tau_and_only_with_mirostat_on() {
        assert_eq!(mirostat(1, 3.0, 0.1, 1).mirostat_mu(), Some(6.0));
        assert_eq!(mirostat(2, 5.0, 0.1, 1).mirostat_mu(), Some(10.0));
        let off = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(off.mirostat_mu(), None);
    }

    #[test]
    fn from_mode_takes_llama_cpp_python_arguments_and_names_bad_ones() {
        assert_eq!(
            Mirostat::from_mode(0, f32::NAN, -1.0).unwrap(),
            Mirostat::Off
        );
        assert_eq!(
            Mirostat::from_mode(1, 5.0, 0.1).unwrap(),
            Mirostat::V1 { tau: 5.0, eta: 0.1 }
        );
        assert_eq!(
            Mirostat::from_mode(2, 3.0, 0.5).unwrap(),
            Mirostat::V2 { tau: 3.0, eta: 0.5 }
        );
        for (mode, tau, eta, message) in [
            (
                3,
                5.0,
                0.1,
                "sampling mirostat_mode: expected 0 (off), 1 (mirostat) or 2 (mirostat 2.0), got 3",
            ),
            (
                2,
                f32::NAN,
                0.1,
                "sampling mirostat_tau: expected a finite target surprise in bits >= 0, got NaN",
            ),
            (
                1,
                5.0,
                -0.1,
                "sampling mirostat_eta: expected a finite learning rate >= 0, got -0.1",
            ),
        ] {
            let err = Mirostat::from_mode(mode, tau, eta).unwrap_err();
            assert_eq!(err.to_string(), message);
        }
    }

    #[test]
    fn the_zipf_exponent_of_an_exact_zipf_distribution_is_its_exponent() {
        // p(rank r) ∝ r^−s: ln(pᵢ/pᵢ₊₁) = s·tᵢ, so the least-squares slope is exactly s.
        for s in [0.7f32, 1.0, 1.3, 2.0] {
            let logits: Vec<f32> = (1..=500).map(|r| -s * (r as f32).ln()).collect();
            let mut c = Cands::default();
            fill_best(&logits, MIROSTAT_M, &mut BinaryHeap::new(), &mut c);
            let got = zipf_exponent(&c, MIROSTAT_M);
            assert!((got - s).abs() < 1e-4, "{got} vs {s}");
        }
    }

    #[test]
    fn v1_k_is_the_papers_formula() {
        // k = (ε̂·2^μ / (1 − N^−ε̂))^(1/ŝ), worked in f64.
        for (s, mu, n) in [
            (1.2f32, 10.0f32, 1000usize),
            (1.05, 6.0, 49_152),
            (2.0, 4.0, 100),
        ] {
            let (s64, mu64) = (f64::from(s), f64::from(mu));
            let eps = s64 - 1.0;
            let k = (eps * 2f64.powf(mu64) / (1.0 - (n as f64).powf(-eps))).powf(1.0 / s64);
            assert_eq!(v1_k(s, mu, n), (k as usize).max(1), "s {s} mu {mu} n {n}");
        }
        // No estimate (fewer than two drawable tokens): one token. Overflow: all of them.
        assert_eq!(v1_k(f32::NAN, 10.0, 100), 1);
        assert_eq!(v1_k(0.01, 20.0, 49_152), usize::MAX);
    }

    #[test]
    fn temperature_zero_is_greedy_and_leaves_mu_alone() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.0,
            mirostat: Mirostat::V2 { tau: 5.0, eta: 0.1 },
            ..SamplingParams::default()
        })
        .unwrap();
        assert_eq!(s.sample(&[0.0, 3.0, 1.0], &[]), 1);
        assert_eq!(s.mirostat_mu(), Some(10.0));
    }

    #[test]
    fn the_same_seed_gives_the_same_sequence() {
        let logits: Vec<f32> = (0..2000).map(|i| ((i * 37 % 101) as f32) / 20.0).collect();
        for version in [1, 2] {
            let run = |seed| {
                let mut s = mirostat(version, 5.0, 0.1, seed);
                (0..100)
                    .map(|_| s.sample(&logits, &[]))
                    .collect::<Vec<u32>>()
            };
            assert_eq!(run(42), run(42), "mirostat {version}");
            assert_ne!(run(42), run(43), "mirostat {version}");
        }
    }

    #[test]
    fn tokens_the_grammar_forbids_are_never_drawn_and_stop_the_estimate() {
        // Only ids 3 and 7 can be drawn, as a grammar's mask leaves them.
        let mut logits = vec![f32::NEG_INFINITY; 300];
        logits[3] = 1.0;
        logits[7] = 0.5;
        for version in [1, 2] {
            let mut s = mirostat(version, 5.0, 0.1, 9);
            for _ in 0..200 {
                let t = s.sample(&logits, &[]);
                assert!(t == 3 || t == 7, "mirostat {version} drew {t}");
                assert!(s.mirostat_mu().unwrap().is_finite());
            }
        }
    }

    /// Version 1's k by the paper's formulas, in f64: ŝ by least squares over the 100 most
    /// likely of `order` (ids best first), then k, truncated and within 1..=n. Also the k before
    /// truncation, to tell how close it is to an integer.
    fn v1_reference_k(p: &[f64], order: &[usize], mu: f32) -> (usize, f64) {
        let n = p.len();
        let (mut tb, mut tt) = (0.0f64, 0.0f64);
        for i in 0..(MIROSTAT_M - 1).min(n - 1) {
            let t = ((i + 2) as f64 / (i + 1) as f64).ln();
            tb += t * (p[order[i]] / p[order[i + 1]]).ln();
            tt += t * t;
        }
        let s_hat = tb / tt;
        let eps = s_hat - 1.0;
        let k = (eps * 2f64.powf(f64::from(mu)) / (1.0 - (n as f64).powf(-eps))).powf(1.0 / s_hat);
        ((k as usize).clamp(1, n), k)
    }

    fn best_first(p: &[f64]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        order
    }

    /// Draws `n` tokens from fixed Zipf logits; the mean surprise of the drawn tokens under the
    /// distribution they were drawn from (renormalised over what was kept).
    fn mean_surprise(version: u8, tau: f32, n: usize) -> f64 {
        let logits: Vec<f32> = (1..=5000).map(|r| -1.1 * (r as f32).ln()).collect();
        let p = probs(&logits);
        let order = best_first(&p);
        let mut s = mirostat(version, tau, 0.1, 11);
        let mut total = 0.0;
        for _ in 0..n {
            let mu = s.mirostat_mu().unwrap();
            let t = s.sample(&logits, &[]) as usize;
            let kept_mass: f64 = if version == 2 {
                v2_reference_kept(&p, mu).iter().map(|&i| p[i]).sum()
            } else {
                let (k, _) = v1_reference_k(&p, &order, mu);
                order[..k].iter().map(|&i| p[i]).sum()
            };
            total += -(p[t] / kept_mass).log2();
        }
        total / n as f64
    }

    #[test]
    fn the_feedback_holds_the_mean_surprise_at_tau() {
        // The paper's claim: mu's feedback makes the observed surprise average tau.
        for version in [1, 2] {
            for tau in [2.0f32, 5.0] {
                let mean = mean_surprise(version, tau, 3000);
                assert!(
                    (mean - f64::from(tau)).abs() < 0.25,
                    "mirostat {version}, tau {tau}: mean surprise {mean}"
                );
            }
        }
    }

    proptest! {
        #[test]
        fn v2_keeps_exactly_the_tokens_within_mu(
            logits in prop::collection::vec(-8.0f32..8.0, 1..400),
            mu in 0.0f32..14.0,
        ) {
            let p = probs(&logits);
            prop_assume!(!near_threshold(&p, mu));
            let mut c = Cands::default();
            fill_all(&logits, &mut c);
            softmax(&mut c);
            keep_unsurprising(&mut c, mu);
            let mut got: Vec<usize> = c.v.iter().map(|x| x.id as usize).collect();
            got.sort_unstable();
            prop_assert_eq!(got, v2_reference_kept(&p, mu));
        }

        #[test]
        fn v2_draws_within_the_kept_set_and_updates_mu_by_the_formula(
            logits in prop::collection::vec(-8.0f32..8.0, 1..400),
            tau in 0.5f32..7.0,
            eta in 0.0f32..1.0,
            seed in any::<u64>(),
        ) {
            let p = probs(&logits);
            let mut s = mirostat(2, tau, eta, seed);
            for _ in 0..3 {
                let mu = s.mirostat_mu().unwrap();
                prop_assume!(!near_threshold(&p, mu));
                let kept = v2_reference_kept(&p, mu);
                let t = s.sample(&logits, &[]) as usize;
                prop_assert!(kept.contains(&t), "{} not in {:?}", t, kept);
                let mass: f64 = kept.iter().map(|&i| p[i]).sum();
                let want = reference_mu(mu, tau, eta, p[t] / mass);
                let got = f64::from(s.mirostat_mu().unwrap());
                prop_assert!((got - want).abs() < 1e-3 * (1.0 + want.abs()), "mu {} vs {}", got, want);
            }
        }

        #[test]
        fn v1_draws_within_the_top_k_and_updates_mu_by_the_formula(
            s_true in 0.6f32..2.5,
            noise in prop::collection::vec(-0.3f32..0.3, 50..600),
            tau in 1.0f32..7.0,
            eta in 0.0f32..1.0,
            seed in any::<u64>(),
        ) {
            // Near-Zipf logits, shuffled so that ids do not follow ranks.
            let n = noise.len();
            let logits: Vec<f32> = (0..n)
                .map(|i| {
                    let rank = (i * 7919) % n + 1;
                    -s_true * (rank as f32).ln() + noise[i]
                })
                .collect();
            let p = probs(&logits);
            let order = best_first(&p);
            let mut sampler = mirostat(1, tau, eta, seed);
            let mu = sampler.mirostat_mu().unwrap();
            let (k, raw) = v1_reference_k(&p, &order, mu);
            // Away from integer boundaries, where f32 and f64 may truncate differently.
            prop_assume!(raw.is_finite() && (raw - raw.round()).abs() > 1e-2);
            let t = sampler.sample(&logits, &[]) as usize;
            let rank = order.iter().position(|&i| i == t).unwrap();
            prop_assert!(rank < k, "rank {} outside the top {}", rank, k);
            let mass: f64 = order[..k].iter().map(|&i| p[i]).sum();
            let want = reference_mu(mu, tau, eta, p[t] / mass);
            let got = f64::from(sampler.mirostat_mu().unwrap());
            prop_assert!((got - want).abs() < 1e-3 * (1.0 + want.abs()), "mu {} vs {}", got, want);
        }
    }
}

use std::cmp::Ordering;

use super::cands::by_rank;
use super::*;
use proptest::prelude::*;

/// A 6-token vocabulary whose logits are ln(p): softmax gives p back exactly enough for
/// hand-computed thresholds.
const P6: [f32; 6] = [0.05, 0.4, 0.1, 0.25, 0.15, 0.05];

fn logits6() -> Vec<f32> {
    P6.iter().map(|p| p.ln()).collect()
}

fn cands(logits: &[f32]) -> Cands {
    let mut c = Cands::default();
    fill_all(logits, &mut c);
    c
}

fn ids(c: &Cands) -> Vec<u32> {
    let mut ids: Vec<u32> = c.v.iter().map(|x| x.id).collect();
    ids.sort_unstable();
    ids
}

/// Only the sampling steps, no truncation: temperature 1 draws from softmax(logits).
fn plain() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        typical_p: 1.0,
        seed: Some(7),
        ..SamplingParams::default()
    }
}

fn frequencies(s: &mut Sampler, logits: &[f32], draws: usize) -> Vec<f64> {
    let mut hits = vec![0usize; logits.len()];
    for _ in 0..draws {
        hits[s.sample(logits, &[]) as usize] += 1;
    }
    hits.iter().map(|&h| h as f64 / draws as f64).collect()
}

#[test]
fn defaults_are_llama_cpp_python_create_completion() {
    let d = SamplingParams::default();
    assert_eq!(
        (d.temperature, d.top_k, d.top_p, d.min_p, d.typical_p),
        (0.8, 40, 0.95, 0.05, 1.0)
    );
    assert_eq!(
        (d.repeat_penalty, d.presence_penalty, d.frequency_penalty),
        (1.0, 0.0, 0.0)
    );
    assert_eq!((d.penalty_last_n, d.seed), (64, None));
    d.validate().unwrap();
}

#[test]
fn validate_names_the_field_the_range_and_the_value() {
    let cases: [(SamplingParams, &str); 9] = [
        (
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            "sampling temperature: expected a finite number >= 0 (0 samples greedily), got NaN",
        ),
        (
            SamplingParams {
                temperature: -0.5,
                ..Default::default()
            },
            "sampling temperature: expected a finite number >= 0 (0 samples greedily), got -0.5",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            "sampling top_p: expected (0, 1] (1 turns top-p off), got 0",
        ),
        (
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            "sampling top_p: expected (0, 1] (1 turns top-p off), got 1.5",
        ),
        (
            SamplingParams {
                min_p: -0.1,
                ..Default::default()
            },
            "sampling min_p: expected [0, 1] (0 turns min-p off), got -0.1",
        ),
        (
            SamplingParams {
                typical_p: f32::NAN,
                ..Default::default()
            },
            "sampling typical_p: expected (0, 1] (1 turns typical sampling off), got NaN",
        ),
        (
            SamplingParams {
                repeat_penalty: 0.0,
                ..Default::default()
            },
            "sampling repeat_penalty: expected a finite number > 0 (1 turns it off), got 0",
        ),
        (
            SamplingParams {
                presence_penalty: f32::INFINITY,
                ..Default::default()
            },
            "sampling presence_penalty: expected a finite number (0 turns it off), got inf",
        ),
        (
            SamplingParams {
                frequency_penalty: f32::NEG_INFINITY,
                ..Default::default()
            },
            "sampling frequency_penalty: expected a finite number (0 turns it off), got -inf",
        ),
    ];
    for (params, message) in cases {
        let err = Sampler::new(params).unwrap_err();
        assert!(matches!(err, crate::EngineError::Invalid { .. }), "{err:?}");
        assert_eq!(err.to_string(), message);
    }
    // The edges that are allowed.
    let edges = SamplingParams {
        temperature: 0.0,
        top_k: -1,
        top_p: 1.0,
        min_p: 1.0,
        typical_p: 1.0,
        repeat_penalty: 0.5,
        presence_penalty: -2.0,
        frequency_penalty: 2.0,
        penalty_last_n: 0,
        seed: Some(0),
        mirostat: Mirostat::V2 { tau: 0.0, eta: 0.0 },
    };
    edges.validate().unwrap();
}

#[test]
fn top_k_keeps_the_k_largest_sorted() {
    let mut heap = BinaryHeap::new();
    let mut c = Cands::default();
    fill_top_k(&logits6(), 2, &mut heap, &mut c);
    assert_eq!(c.v.iter().map(|x| x.id).collect::<Vec<_>>(), [1, 3]);
    assert!(c.sorted);
    // Ties go to the lower id: ids 0 and 5 share p = 0.05.
    fill_top_k(&logits6(), 5, &mut heap, &mut c);
    assert_eq!(
        c.v.iter().map(|x| x.id).collect::<Vec<_>>(),
        [1, 3, 4, 2, 0]
    );
}

#[test]
fn top_p_keeps_the_minimal_prefix_reaching_p() {
    // Sorted: 0.4 (id 1), 0.25 (3), 0.15 (4), 0.1 (2), 0.05, 0.05.
    for (p, kept) in [
        (0.3, vec![1]),
        (0.5, vec![1, 3]),
        (0.7, vec![1, 3, 4]),
        (0.85, vec![1, 2, 3, 4]),
    ] {
        let mut c = cands(&logits6());
        top_p(&mut c, p);
        assert_eq!(ids(&c), kept, "top_p {p}");
        assert!(c.sorted);
    }
}

#[test]
fn min_p_keeps_tokens_within_a_factor_of_the_best() {
    // p_max = 0.4: min_p 0.3 keeps p >= 0.12, min_p 0.5 keeps p >= 0.2.
    for (p, kept) in [(0.3, vec![1, 3, 4]), (0.5, vec![1, 3]), (0.9, vec![1])] {
        let mut unsorted = cands(&logits6());
        min_p(&mut unsorted, p);
        assert_eq!(ids(&unsorted), kept, "min_p {p}, unsorted");
        let mut sorted = cands(&logits6());
        sorted.v.sort_unstable_by(by_rank);
        sorted.sorted = true;
        min_p(&mut sorted, p);
        assert_eq!(ids(&sorted), kept, "min_p {p}, sorted");
    }
}

#[test]
fn typical_keeps_the_tokens_closest_to_the_entropy() {
    // H = -Σ p ln p = 1.5275 nats. |−ln p − H|: id 3 0.141, id 4 0.370, id 1 0.611,
    // id 2 0.775, ids 0 and 5 1.468. Mass in that order: 0.25, 0.40, 0.80, 0.90, ...
    for (p, kept) in [(0.2, vec![3]), (0.3, vec![3, 4]), (0.5, vec![1, 3, 4])] {
        let mut scored = Vec::new();
        let mut c = cands(&logits6());
        typical(&mut c, p, &mut scored);
        assert_eq!(ids(&c), kept, "typical_p {p}");
        assert!(!c.sorted);
    }
}

#[test]
fn temperature_divides_the_logits() {
    let mut c = cands(&[2.0, -1.0, 0.5]);
    temperature(&mut c, 0.5);
    let logits: Vec<f32> = c.v.iter().map(|x| x.logit).collect();
    assert_eq!(logits, [4.0, -2.0, 1.0]);
}

#[test]
fn draw_walks_the_cumulative_distribution() {
    // Weights after max subtraction: 0.4/0.4 = 1, 0.25/0.4, 0.15/0.4 → probs 0.5, 0.3125, 0.1875.
    let logits = [0.4f32.ln(), 0.25f32.ln(), 0.15f32.ln()];
    for (u, want) in [
        (0.0, 0),
        (0.49, 0),
        (0.51, 1),
        (0.81, 1),
        (0.82, 2),
        (0.999, 2),
    ] {
        let mut c = cands(&logits);
        assert_eq!(draw(&mut c, u), want, "u = {u}");
    }
    // A token that cannot be drawn is never drawn, even at u = 0.
    let mut c = cands(&[f32::NEG_INFINITY, 0.0]);
    assert_eq!(draw(&mut c, 0.0), 1);
    // All -inf: uniform among them rather than NaN.
    let mut c = cands(&[f32::NEG_INFINITY; 3]);
    assert_eq!(draw(&mut c, 0.5), 1);
}

#[test]
fn repeat_penalty_divides_positive_and_multiplies_non_positive_logits() {
    let params = SamplingParams {
        repeat_penalty: 2.0,
        ..plain()
    };
    let mut logits = [2.0, -1.0, 0.5, 0.0, 3.0];
    apply_penalties(&mut logits, &[0, 1, 0, 3, 99], &mut Vec::new(), &params);
    // Id 99 is past the vocabulary and is skipped.
    assert_eq!(logits, [1.0, -2.0, 0.5, 0.0, 3.0]);
}

#[test]
fn presence_and_frequency_subtract_once_and_per_occurrence() {
    let params = SamplingParams {
        presence_penalty: 0.25,
        frequency_penalty: 0.5,
        ..plain()
    };
    let mut logits = [2.0, -1.0, 0.5];
    apply_penalties(&mut logits, &[0, 0, 0, 1], &mut Vec::new(), &params);
    // Id 0: 2 − (3·0.5 + 0.25); id 1: −1 − (0.5 + 0.25); id 2 unseen.
    assert_eq!(logits, [0.25, -1.75, 0.5]);
}

#[test]
fn penalties_look_only_at_the_last_n_tokens() {
    let params = SamplingParams {
        temperature: 0.0,
        repeat_penalty: 4.0,
        penalty_last_n: 2,
        ..plain()
    };
    let mut s = Sampler::new(params).unwrap();
    let logits = [1.0, 3.0, 2.0];
    // Id 1 is outside the window of 2: not penalised, still the argmax.
    assert_eq!(s.sample(&logits, &[1, 0, 0]), 1);
    // Inside it: 3 / 4 < 2, so id 2 wins.
    assert_eq!(s.sample(&logits, &[0, 1, 0]), 2);
    // penalty_last_n = 0 turns the penalties off.
    let mut off = Sampler::new(SamplingParams {
        penalty_last_n: 0,
        ..params
    })
    .unwrap();
    assert_eq!(off.sample(&logits, &[1, 1, 1]), 1);
}

#[test]
fn greedy_ignores_truncation_and_takes_the_lowest_id_on_ties() {
    let params = SamplingParams {
        temperature: 0.0,
        top_k: 1,
        ..plain()
    };
    let mut s = Sampler::new(params).unwrap();
    assert_eq!(s.sample(&[0.0, 5.0, f32::NAN, 5.0, -1.0], &[]), 1);
    assert_eq!(s.sample(&[f32::NAN, 1.0], &[]), 1);
    assert_eq!(s.sample(&[f32::NEG_INFINITY; 4], &[]), 0);
    assert_eq!(s.sample(&[f32::NAN, f32::NEG_INFINITY], &[]), 1);
    assert_eq!(s.sample(&[f32::NAN; 3], &[]), 0);
}

#[test]
fn the_chain_truncates_before_the_temperature() {
    // min_p 0.3 on the untempered distribution keeps ids 1, 3, 4. Tempering first
    // (p ∝ √p at T = 2) would keep ids 0, 2 and 5 as well.
    let params = SamplingParams {
        temperature: 2.0,
        min_p: 0.3,
        ..plain()
    };
    let mut s = Sampler::new(params).unwrap();
    let f = frequencies(&mut s, &logits6(), 5000);
    assert_eq!((f[0], f[2], f[5]), (0.0, 0.0, 0.0), "{f:?}");
    assert!(f[1] > 0.0 && f[3] > 0.0 && f[4] > 0.0, "{f:?}");
}

#[test]
fn the_chain_runs_top_p_within_the_top_k() {
    // top_k 2 keeps 0.4 and 0.25, renormalised to 0.615 and 0.385; top_p 0.6 then keeps
    // only id 1. Top-p first would keep ids 1 and 3 (0.4 + 0.25 >= 0.6).
    let params = SamplingParams {
        top_k: 2,
        top_p: 0.6,
        ..plain()
    };
    let mut s = Sampler::new(params).unwrap();
    for _ in 0..1000 {
        assert_eq!(s.sample(&logits6(), &[]), 1);
    }
}

/// 20,000 draws: the standard error of a frequency is at most √(0.25/20000) = 0.0035, so
/// 0.015 is over 4 standard errors (and the seed is fixed, so the test is deterministic).
const DRAWS: usize = 20_000;
const TOLERANCE: f64 = 0.015;

#[test]
fn sampled_frequencies_match_softmax() {
    let mut s = Sampler::new(plain()).unwrap();
    let f = frequencies(&mut s, &logits6(), DRAWS);
    for (got, want) in f.iter().zip(P6) {
        assert!((got - f64::from(want)).abs() < TOLERANCE, "{f:?} vs {P6:?}");
    }
}

#[test]
fn sampled_frequencies_match_the_chain() {
    // min_p 0.3 keeps 0.4, 0.25, 0.15; temperature 0.5 squares them: 0.16, 0.0625, 0.0225,
    // normalised 0.6531, 0.2551, 0.0918.
    let params = SamplingParams {
        temperature: 0.5,
        min_p: 0.3,
        ..plain()
    };
    let mut s = Sampler::new(params).unwrap();
    let f = frequencies(&mut s, &logits6(), DRAWS);
    let want = [0.0, 0.16 / 0.245, 0.0, 0.0625 / 0.245, 0.0225 / 0.245, 0.0];
    for (got, want) in f.iter().zip(want) {
        assert!((got - want).abs() < TOLERANCE, "{f:?} vs {want:?}");
    }
}

#[test]
fn the_same_seed_gives_the_same_sequence() {
    let logits: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32) / 25.0).collect();
    let run = |seed| {
        let params = SamplingParams {
            seed,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params).unwrap();
        let mut history = Vec::new();
        for _ in 0..200 {
            let t = s.sample(&logits, &history);
            history.push(t);
        }
        history
    };
    assert_eq!(run(Some(42)), run(Some(42)));
    assert_ne!(run(Some(42)), run(Some(43)));
    // Unseeded samplers draw from different seeds.
    assert_ne!(run(None), run(None));
}

#[test]
fn buffers_are_reused_across_tokens() {
    let params = SamplingParams {
        repeat_penalty: 1.1,
        typical_p: 0.9,
        seed: Some(1),
        ..SamplingParams::default()
    };
    let mut s = Sampler::new(params).unwrap();
    let vocab = 32_000;
    let logits = |t: usize| -> Vec<f32> {
        (0..vocab)
            .map(|i| (((i * 7919 + t * 104_729) % 1000) as f32) / 100.0)
            .collect()
    };
    let mut history = vec![5, 6, 7];
    history.push(s.sample(&logits(0), &history));
    let ptrs = |s: &Sampler| {
        (
            s.penalized.as_ptr(),
            s.cands.v.as_ptr(),
            s.cands.v.capacity(),
            s.scored.as_ptr(),
            s.heap.capacity(),
        )
    };
    let before = ptrs(&s);
    for t in 1..20 {
        history.push(s.sample(&logits(t), &history));
    }
    assert_eq!(ptrs(&s), before);
}

#[test]
fn top_p_on_a_long_unsorted_list_takes_both_paths() {
    // Peaked (logits 0.04 apart): the best 256 of 5000 hold 1 − e^−10 of the mass. Flat: they
    // hold about 5%, so the rest is sorted too.
    for (spread, p) in [(200.0f32, 0.9f32), (0.01, 0.999)] {
        let logits: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919 % 5000) as f32 / 5000.0) * spread)
            .collect();
        let mut c = cands(&logits);
        top_p(&mut c, p);
        check_top_p(&logits, &c, p);
    }
}

/// Kept = a best-first prefix that reaches p, and one token shorter would not.
fn check_top_p(logits: &[f32], c: &Cands, p: f32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let prob = |id: u32| f64::from(logits[id as usize] - max).exp() / total;
    assert!(
        c.v.windows(2)
            .all(|w| by_rank(&w[0], &w[1]) == Ordering::Less)
    );
    let worst_kept = c.v.last().unwrap().logit;
    let kept = ids(c);
    for (id, &l) in logits.iter().enumerate() {
        if kept.binary_search(&(id as u32)).is_err() {
            assert!(l <= worst_kept);
        }
    }
    let mass: f64 = c.v.iter().map(|x| prob(x.id)).sum();
    let without_last = mass - prob(c.v.last().unwrap().id);
    assert!(
        mass >= f64::from(p) - 1e-4 || kept.len() == logits.len(),
        "{mass} < {p}"
    );
    assert!(
        without_last < f64::from(p) + 1e-4,
        "{without_last} already reaches {p}"
    );
}

/// The first index of the largest non-NaN value; 0 when every value is NaN.
fn reference_argmax(xs: &[f32]) -> usize {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    xs.iter().position(|&x| x == max).unwrap_or(0)
}

proptest! {
    #[test]
    fn greedy_is_argmax(xs in prop::collection::vec(-100.0f32..100.0, 1..3000)) {
        let params = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
        let mut s = Sampler::new(params).unwrap();
        prop_assert_eq!(s.sample(&xs, &[]) as usize, reference_argmax(&xs));
    }

    #[test]
    fn greedy_is_argmax_with_ties_and_nan(small in prop::collection::vec(-4i8..4, 1..500)) {
        let xs: Vec<f32> = small
            .iter()
            .map(|&x| if x == -4 { f32::NAN } else { f32::from(x) })
            .collect();
        let params = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
        let mut s = Sampler::new(params).unwrap();
        prop_assert_eq!(s.sample(&xs, &[]) as usize, reference_argmax(&xs));
    }

    #[test]
    fn greedy_over_all_nan_logits_is_the_first_id(n in 1usize..50) {
        let params = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
        let mut s = Sampler::new(params).unwrap();
        prop_assert_eq!(s.sample(&vec![f32::NAN; n], &[]), 0);
    }

    #[test]
    fn top_k_selection_equals_a_full_sort(
        small in prop::collection::vec(-20i8..20, 2..2000),
        k_frac in 0.0f64..1.0,
    ) {
        let xs: Vec<f32> = small.iter().map(|&x| f32::from(x) / 4.0).collect();
        let k = 1 + (k_frac * (xs.len() - 1) as f64) as usize;
        let mut c = Cands::default();
        fill_top_k(&xs, k, &mut BinaryHeap::new(), &mut c);
        let mut all: Vec<u32> = (0..xs.len() as u32).collect();
        all.sort_by(|&a, &b| xs[b as usize].partial_cmp(&xs[a as usize]).unwrap().then(a.cmp(&b)));
        let got: Vec<u32> = c.v.iter().map(|x| x.id).collect();
        prop_assert_eq!(got, &all[..k]);
    }

    #[test]
    fn top_p_keeps_a_minimal_best_prefix(
        xs in prop::collection::vec(-8.0f32..8.0, 1..4000),
        p in 0.05f32..0.999,
    ) {
        let mut c = cands(&xs);
        top_p(&mut c, p);
        check_top_p(&xs, &c, p);
    }

    #[test]
    fn sampled_tokens_survive_every_truncation(
        xs in prop::collection::vec(-10.0f32..10.0, 1..3000),
        seed in any::<u64>(),
    ) {
        let params = SamplingParams { top_k: 5, seed: Some(seed), ..SamplingParams::default() };
        let mut s = Sampler::new(params).unwrap();
        let t = s.sample(&xs, &[]) as usize;
        // It is among the 5 best and within min_p 0.05 of the best.
        let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        prop_assert!(xs.iter().filter(|&&x| x > xs[t]).count() < 5);
        prop_assert!(xs[t] >= max + 0.05f32.ln());
    }
}

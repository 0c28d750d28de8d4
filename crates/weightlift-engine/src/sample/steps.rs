//! The chain's steps after the candidates are gathered: llama.cpp's typical, top-p, min-p,
//! temperature and dist samplers, and the repetition penalties that run before them.

use super::SamplingParams;
use super::cands::{Cand, Cands, by_rank, softmax, weight};

/// llama-cpp-python passes `min_keep = max(1, n_probs)` with `n_probs = 0` to every truncation.
const MIN_KEEP: usize = 1;

/// llama.cpp's top-p first sorts only the best 256 candidates when there are more than 1024,
/// and sorts the rest only if those 256 do not reach `top_p`.
const TOP_P_PARTIAL: usize = 256;
const TOP_P_PARTIAL_ABOVE: usize = 1024;

/// llama.cpp's `llama_sampler_typical_apply`: order by |surprise − entropy| and keep the prefix
/// whose mass first exceeds `p` (strictly, unlike top-p).
pub(super) fn typical(c: &mut Cands, p: f32, scored: &mut Vec<(f32, Cand)>) {
    softmax(c);
    // 0·ln 0 is 0; llama.cpp would get NaN from an underflowed probability.
    let entropy: f32 =
        c.v.iter()
            .filter(|x| x.p > 0.0)
            .map(|x| -x.p * x.p.ln())
            .sum();
    scored.clear();
    // A zero probability has infinite surprise and sorts last.
    scored.extend(c.v.iter().map(|x| ((-x.p.ln() - entropy).abs(), *x)));
    scored.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then_with(|| by_rank(&a.1, &b.1)));
    let mut cum = 0.0f32;
    let mut last = scored.len();
    for (i, (_, x)) in scored.iter().enumerate() {
        cum += x.p;
        if cum > p && i + 1 >= MIN_KEEP {
            last = i + 1;
            break;
        }
    }
    c.v.clear();
    c.v.extend(scored[..last].iter().map(|s| s.1));
    c.sorted = false;
}

/// llama.cpp's `llama_sampler_top_p_apply`: the smallest best-first prefix whose probability
/// reaches `p`, sorting only the best 256 first when the list is long and unsorted.
pub(super) fn top_p(c: &mut Cands, p: f32) {
    softmax(c);
    let n = c.v.len();
    let mut sorted_upto = n;
    if !c.sorted {
        if n > TOP_P_PARTIAL_ABOVE {
            c.v.select_nth_unstable_by(TOP_P_PARTIAL - 1, by_rank);
            c.v[..TOP_P_PARTIAL].sort_unstable_by(by_rank);
            sorted_upto = TOP_P_PARTIAL;
        } else {
            c.v.sort_unstable_by(by_rank);
        }
    }
    let mut cum = 0.0f32;
    let mut last = n;
    for i in 0..n {
        if i == sorted_upto {
            // The best 256 did not reach p: everything after them is worse, sort it too.
            c.v[i..].sort_unstable_by(by_rank);
        }
        cum += c.v[i].p;
        if cum >= p && i + 1 >= MIN_KEEP {
            last = i + 1;
            break;
        }
    }
    c.v.truncate(last);
    c.sorted = true;
}

/// llama.cpp's `llama_sampler_min_p_apply`: keep tokens with `p >= min_p · p_max`, compared as
/// `logit >= max_logit + ln(min_p)` so no softmax is needed.
pub(super) fn min_p(c: &mut Cands, p: f32) {
    let min_logit = c.max_logit() + p.ln();
    if c.sorted {
        // The first token always stays.
        let keep =
            c.v.iter()
                .skip(MIN_KEEP)
                .position(|x| x.logit < min_logit)
                .map_or(c.v.len(), |i| i + MIN_KEEP);
        c.v.truncate(keep);
    } else {
        // min_p <= 1, so the maximum always passes and at least one token stays.
        c.v.retain(|x| x.logit >= min_logit);
    }
}

/// llama.cpp's `llama_sampler_temp_impl` for `temp > 0`.
pub(super) fn temperature(c: &mut Cands, temp: f32) {
    for x in &mut c.v {
        x.logit /= temp;
    }
}

/// llama.cpp's `llama_sampler_dist_apply`: the first candidate at which the running sum of
/// `exp(logit - max)` passes `u` times the total, `u` uniform in [0, 1). Zero weights are never
/// chosen.
pub(super) fn draw(c: &mut Cands, u: f64) -> u32 {
    let max = c.max_logit();
    let mut sum = 0.0f64;
    for x in &mut c.v {
        x.p = weight(x.logit, max);
        sum += f64::from(x.p);
    }
    let target = sum * u;
    let mut run = 0.0f64;
    let mut chosen = 0;
    for x in &c.v {
        if x.p > 0.0 {
            run += f64::from(x.p);
            chosen = x.id;
            if run > target {
                break;
            }
        }
    }
    chosen
}

/// llama.cpp's `llama_sampler_penalties_apply` over `window`. Ids past the vocabulary are
/// skipped, as llama.cpp skips tokens it has no candidate for.
pub(super) fn apply_penalties(
    logits: &mut [f32],
    window: &[u32],
    counts: &mut Vec<u32>,
    p: &SamplingParams,
) {
    counts.clear();
    counts.extend_from_slice(window);
    counts.sort_unstable();
    for run in counts.chunk_by(|a, b| a == b) {
        let Some(logit) = logits.get_mut(run[0] as usize) else {
            continue;
        };
        // Dividing a negative logit would make the token more likely; llama.cpp multiplies
        // those (and 0) instead.
        if *logit <= 0.0 {
            *logit *= p.repeat_penalty;
        } else {
            *logit /= p.repeat_penalty;
        }
        *logit -= run.len() as f32 * p.frequency_penalty + p.presence_penalty;
    }
}

//! Token sampling as llama-cpp-python 0.3.x does it, and stop strings for streamed text.
//!
//! [`Sampler`] runs the chain that llama-cpp-python's `Llama._init_sampler` builds from
//! llama.cpp samplers, in its order:
//!
//! 1. penalties over the last `penalty_last_n` tokens (`llama_sampler_init_penalties`);
//! 2. if the temperature is 0, greedy: the argmax over the whole vocabulary, lowest id on ties;
//! 3. otherwise top-k, typical, top-p, min-p (each with `min_keep = 1`), temperature, and a draw
//!    from the softmax of what is left (`llama_sampler_init_dist`).
//!
//! Each step follows llama.cpp's samplers. Two consequences are easy to miss:
//! the truncations run *before* the temperature, so top-p, min-p and typical see the model's own
//! distribution, not the tempered one; and top-p and typical renormalise over what the earlier
//! steps kept (top-p after top-k measures mass within the top k).
//!
//! Differences from llama-cpp-python, all deliberate: a negative temperature is an error here
//! (llama-cpp-python silently samples from the untruncated distribution); ties between equal
//! logits are broken by the lower id everywhere (llama.cpp leaves them to `std::sort`); and the
//! RNG is xoshiro256++ rather than `std::mt19937`, so a seed gives a reproducible sequence here
//! but not llama.cpp's sequence.
//!
//! [`StopMatcher`] is `create_completion(stop=[...], stream=True)`'s stop handling: text that could
//! still become a stop string is held back, and the stop string itself is never emitted.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;

use rand_core::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::error::{Result, invalid};

/// llama-cpp-python passes `min_keep = max(1, n_probs)` with `n_probs = 0` to every truncation.
const MIN_KEEP: usize = 1;

/// llama.cpp's top-p first sorts only the best 256 candidates when there are more than 1024,
/// and sorts the rest only if those 256 do not reach `top_p`.
const TOP_P_PARTIAL: usize = 256;
const TOP_P_PARTIAL_ABOVE: usize = 1024;

/// What [`Sampler`] does to each token's logits. [`Default`] is llama-cpp-python's
/// `Llama.create_completion` defaults (and `Llama(last_n_tokens_size=64)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Divides the logits after truncation; 0 samples greedily. Finite and >= 0.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; <= 0 turns it off.
    pub top_k: i32,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; in (0, 1],
    /// 1 turns it off.
    pub top_p: f32,
    /// Keep tokens whose probability is at least `min_p` times the largest; in [0, 1], 0 turns
    /// it off.
    pub min_p: f32,
    /// Locally typical sampling (Meister et al. 2022): keep the tokens whose surprise is closest
    /// to the entropy until their mass exceeds `typical_p`; in (0, 1], 1 turns it off.
    pub typical_p: f32,
    /// Divides the positive logits and multiplies the non-positive ones of every token seen in
    /// the penalty window; finite and > 0, 1 turns it off.
    pub repeat_penalty: f32,
    /// Subtracted once from the logit of every token seen in the penalty window; finite.
    pub presence_penalty: f32,
    /// Subtracted from the logit of every token seen in the penalty window, once per occurrence;
    /// finite.
    pub frequency_penalty: f32,
    /// How many of the most recent tokens of the history the penalties look at; 0 turns the
    /// penalties off.
    pub penalty_last_n: usize,
    /// The RNG seed; `None` seeds from the OS's randomness and the clock.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Checks every field against the range it accepts; the error names the field, the range
    /// and the value.
    pub fn validate(&self) -> Result<()> {
        let temperature = self.temperature;
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(invalid(
                "sampling temperature",
                "a finite number >= 0 (0 samples greedily)",
                temperature,
            ));
        }
        check_unit(
            "sampling top_p",
            "(0, 1] (1 turns top-p off)",
            self.top_p,
            false,
        )?;
        check_unit(
            "sampling min_p",
            "[0, 1] (0 turns min-p off)",
            self.min_p,
            true,
        )?;
        check_unit(
            "sampling typical_p",
            "(0, 1] (1 turns typical sampling off)",
            self.typical_p,
            false,
        )?;
        let repeat = self.repeat_penalty;
        if !(repeat.is_finite() && repeat > 0.0) {
            return Err(invalid(
                "sampling repeat_penalty",
                "a finite number > 0 (1 turns it off)",
                repeat,
            ));
        }
        for (what, value) in [
            ("sampling presence_penalty", self.presence_penalty),
            ("sampling frequency_penalty", self.frequency_penalty),
        ] {
            if !value.is_finite() {
                return Err(invalid(what, "a finite number (0 turns it off)", value));
            }
        }
        Ok(())
    }

    fn penalties_active(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repeat_penalty != 1.0
                || self.frequency_penalty != 0.0
                || self.presence_penalty != 0.0)
    }
}

/// `value` in (0, 1], or in [0, 1] when `zero_ok`; NaN is outside both.
fn check_unit(what: &str, expected: &str, value: f32, zero_ok: bool) -> Result<()> {
    let low_ok = if zero_ok { value >= 0.0 } else { value > 0.0 };
    if low_ok && value <= 1.0 {
        Ok(())
    } else {
        Err(invalid(what, expected, value))
    }
}

/// One token in the candidate list, as llama.cpp's `llama_token_data`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cand {
    id: u32,
    logit: f32,
    p: f32,
}

/// Best first: the higher logit, then the lower id. Logits are never NaN here (see [`not_nan`]),
/// so this is a total order and a seed's draws do not depend on the sort algorithm.
fn by_rank(a: &Cand, b: &Cand) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// A NaN logit (a diverged model) ranks below everything instead of poisoning the softmax.
fn not_nan(logit: f32) -> f32 {
    if logit.is_nan() {
        f32::NEG_INFINITY
    } else {
        logit
    }
}

/// A heap entry whose greatest element is the worst-ranked candidate, so `peek` is the one to
/// evict when a better one arrives.
#[derive(Debug)]
struct Worst(Cand);

impl Ord for Worst {
    fn cmp(&self, other: &Self) -> Ordering {
        by_rank(&self.0, &other.0)
    }
}

impl PartialOrd for Worst {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Worst {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Worst {}

/// llama.cpp's `llama_token_data_array`: the candidates and whether they are sorted by rank.
/// Every step keeps at least one candidate.
#[derive(Debug, Default)]
struct Cands {
    v: Vec<Cand>,
    sorted: bool,
}

impl Cands {
    fn max_logit(&self) -> f32 {
        if self.sorted {
            self.v.first().map_or(f32::NEG_INFINITY, |c| c.logit)
        } else {
            self.v.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit))
        }
    }
}

/// `exp(logit - max)`, with the maximum itself weighing exactly 1 so that all-`-inf` or `+inf`
/// logits give a uniform choice among the maxima instead of NaN.
fn weight(logit: f32, max: f32) -> f32 {
    if logit == max {
        1.0
    } else {
        (logit - max).exp()
    }
}

/// Sets every `p` to the softmax of the logits (`llama_sampler_softmax_impl` without sorting).
fn softmax(c: &mut Cands) {
    let max = c.max_logit();
    let mut sum = 0.0f64;
    for x in &mut c.v {
        x.p = weight(x.logit, max);
        sum += f64::from(x.p);
    }
    // sum >= 1: the maximum weighs 1.
    let inv = (1.0 / sum) as f32;
    for x in &mut c.v {
        x.p *= inv;
    }
}

/// Every token is a candidate, in id order (top-k off, or k >= the vocabulary).
fn fill_all(src: &[f32], c: &mut Cands) {
    c.v.clear();
    c.v.extend(src.iter().enumerate().map(|(i, &l)| Cand {
        id: i as u32,
        logit: not_nan(l),
        p: 0.0,
    }));
    c.sorted = false;
}

/// llama.cpp's top-k: the `k` best tokens, sorted. One pass with a k-entry heap instead of
/// sorting the vocabulary: past the first few thousand tokens almost none beats the heap's
/// worst, so whole blocks of 8 are skipped with one vectorised compare.
fn fill_top_k(src: &[f32], k: usize, heap: &mut BinaryHeap<Worst>, c: &mut Cands) {
    const BLOCK: usize = 8;
    heap.clear();
    // The worst kept logit once the heap is full. Ids arrive in increasing order, so a later
    // token with an equal logit ranks lower and only a strictly larger logit gets in (NaN
    // never does).
    let mut worst = f32::NEG_INFINITY;
    for (b, block) in src.chunks(BLOCK).enumerate() {
        if heap.len() == k && !block.iter().fold(false, |any, &l| any | (l > worst)) {
            continue;
        }
        for (j, &l) in block.iter().enumerate() {
            let cand = Cand {
                id: (b * BLOCK + j) as u32,
                logit: not_nan(l),
                p: 0.0,
            };
            if heap.len() < k {
                heap.push(Worst(cand));
            } else if cand.logit > worst {
                if let Some(mut top) = heap.peek_mut() {
                    *top = Worst(cand);
                }
            } else {
                continue;
            }
            if heap.len() == k {
                worst = heap.peek().map_or(f32::NEG_INFINITY, |w| w.0.logit);
            }
        }
    }
    c.v.clear();
    c.v.extend(heap.drain().map(|w| w.0));
    c.v.sort_unstable_by(by_rank);
    c.sorted = true;
}

/// llama.cpp's `llama_sampler_typical_apply`: order by |surprise − entropy| and keep the prefix
/// whose mass first exceeds `p` (strictly, unlike top-p).
fn typical(c: &mut Cands, p: f32, scored: &mut Vec<(f32, Cand)>) {
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
fn top_p(c: &mut Cands, p: f32) {
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
fn min_p(c: &mut Cands, p: f32) {
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
fn temperature(c: &mut Cands, temp: f32) {
    for x in &mut c.v {
        x.logit /= temp;
    }
}

/// llama.cpp's `llama_sampler_dist_apply`: the first candidate at which the running sum of
/// `exp(logit - max)` passes `u` times the total, `u` uniform in [0, 1). Zero weights are never
/// chosen.
fn draw(c: &mut Cands, u: f64) -> u32 {
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
fn apply_penalties(logits: &mut [f32], window: &[u32], counts: &mut Vec<u32>, p: &SamplingParams) {
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

/// The index of the largest value, the lowest on ties; NaN never wins (all NaN gives 0).
/// llama.cpp's greedy. Two passes that the compiler vectorises, the maximum over 8 lanes and
/// then its first position, run several times faster than one pass tracking the index.
fn argmax(xs: &[f32]) -> usize {
    const LANES: usize = 8;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            if v > *m {
                *m = v;
            }
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    xs.iter().position(|&v| v == max).unwrap_or(0)
}

/// A uniform f64 in [0, 1) from the top 53 bits.
fn unit(rng: &mut Xoshiro256PlusPlus) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A seed nobody chose: std's per-process OS randomness (`RandomState`) hashed with the clock.
fn entropy_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher, RandomState};
    let mut h = RandomState::new().build_hasher();
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish()
}

/// Picks the next token from a logits vector: llama-cpp-python's sampler chain (see the module
/// docs). Holds its RNG and scratch buffers, so one `Sampler` serves one generation; after the
/// first token it allocates nothing as long as the vocabulary size stays the same.
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256PlusPlus,
    /// The logits with penalties applied; used only when a penalty is on.
    penalized: Vec<f32>,
    /// The penalty window, sorted to count occurrences.
    counts: Vec<u32>,
    cands: Cands,
    /// Typical sampling's candidates with their scores.
    scored: Vec<(f32, Cand)>,
    heap: BinaryHeap<Worst>,
}

impl fmt::Debug for Sampler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// Validates `params` (see [`SamplingParams::validate`]) and seeds the RNG.
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(entropy_seed);
        Ok(Sampler {
            params,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
            penalized: Vec::new(),
            counts: Vec::new(),
            cands: Cands::default(),
            scored: Vec::new(),
            heap: BinaryHeap::new(),
        })
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token id, given the logits of the last position and the tokens so far.
    ///
    /// The penalties look at the last `penalty_last_n` ids of `history`. llama-cpp-python 0.3.x
    /// builds a fresh sampler per `generate` call and feeds it only the tokens it sampled, so to
    /// match it pass the completion so far, without the prompt.
    ///
    /// # Panics
    ///
    /// If `logits` is empty or longer than `u32::MAX` (no token id could name the choice).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        assert!(
            !logits.is_empty() && u32::try_from(logits.len()).is_ok(),
            "sampling needs 1 to u32::MAX logits, got {}",
            logits.len()
        );
        let Sampler {
            params,
            rng,
            penalized,
            counts,
            cands,
            scored,
            heap,
        } = self;

        let src: &[f32] = if params.penalties_active() {
            let start = history.len().saturating_sub(params.penalty_last_n);
            penalized.clear();
            penalized.extend_from_slice(logits);
            apply_penalties(penalized, &history[start..], counts, params);
            penalized
        } else {
            logits
        };

        if params.temperature == 0.0 {
            return argmax(src) as u32;
        }

        // A negative top_k is off, like 0.
        let k = usize::try_from(params.top_k).unwrap_or(0);
        if k > 0 && k < src.len() {
            fill_top_k(src, k, heap, cands);
        } else {
            fill_all(src, cands);
        }
        if params.typical_p < 1.0 {
            typical(cands, params.typical_p, scored);
        }
        if params.top_p < 1.0 {
            top_p(cands, params.top_p);
        }
        if params.min_p > 0.0 {
            min_p(cands, params.min_p);
        }
        temperature(cands, params.temperature);
        draw(cands, unit(rng))
    }
}

/// Stop strings over streamed text, as llama-cpp-python's `create_completion(stop=[...],
/// stream=True)`: each [`push`](Self::push) returns the text that can no longer turn into a
/// stop string, holding back any tail that is the start of one; once a stop string appears,
/// the text before it is released and the stop string itself is dropped.
///
/// The earliest occurrence of any stop string wins (llama-cpp-python takes the first one in list
/// order that occurs, which can cut later in the text). Empty stop strings are ignored
/// (llama-cpp-python would stop at once with no text). Pieces are `&str`: bytes that do not yet
/// form a whole UTF-8 character must be held by the caller's detokenizer, as llama-cpp-python's
/// `multibyte_fix` does; held-back text is always cut at character boundaries.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings among them are dropped.
    pub fn new<I, S>(stops: I) -> StopMatcher
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        StopMatcher {
            stops: stops
                .into_iter()
                .map(Into::into)
                .filter(|s: &String| !s.is_empty())
                .collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Adds the next piece of text; returns the text safe to emit now and whether a stop string
    /// has been seen. After a stop, every push returns `("", true)`.
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.held.push_str(piece);
        let held = &self.held;
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| held.find(s.as_str()))
            .min()
        {
            self.held.truncate(at);
            self.stopped = true;
            return (std::mem::take(&mut self.held), true);
        }
        let hold = self
            .stops
            .iter()
            .map(|s| partial_stop_len(held, s))
            .max()
            .unwrap_or(0);
        // `held` ends with a whole-character prefix of a stop string, so this is a boundary.
        let rest = self.held.split_off(self.held.len() - hold);
        (std::mem::replace(&mut self.held, rest), false)
    }

    /// Whether a stop string has been seen.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// The text still held back when generation ends without a stop string (empty after one).
    pub fn finish(self) -> String {
        self.held
    }
}

/// The length of the longest proper prefix of `stop`, cut at a character boundary, that `text`
/// ends with; 0 if none.
fn partial_stop_len(text: &str, stop: &str) -> usize {
    let longest = (stop.len() - 1).min(text.len());
    (1..=longest)
        .rev()
        .filter(|&l| stop.is_char_boundary(l))
        .find(|&l| text.ends_with(&stop[..l]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
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

    fn stream(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let mut m = StopMatcher::new(stops.iter().copied());
        let mut out = Vec::new();
        let mut stopped = false;
        for piece in pieces {
            let (text, stop) = m.push(piece);
            out.push(text);
            stopped = stop;
        }
        (out, stopped, m.finish())
    }

    #[test]
    fn stop_split_across_pieces_is_held_then_dropped() {
        let (out, stopped, rest) = stream(&["</s>"], &["Hello </", "s> more"]);
        assert_eq!(out, ["Hello ", ""]);
        assert!(stopped);
        assert_eq!(rest, "");
        // Held text that does not complete the stop is released with the next piece.
        let (out, stopped, rest) = stream(&["</s>"], &["a <", "/b>", " c"]);
        assert_eq!(out, ["a ", "</b>", " c"]);
        assert!(!stopped);
        assert_eq!(rest, "");
    }

    #[test]
    fn stop_at_the_very_start_emits_nothing() {
        let (out, stopped, _) = stream(&["Q:"], &["Q: what", "ever"]);
        assert_eq!(out, ["", ""]);
        assert!(stopped);
    }

    #[test]
    fn overlapping_prefixes_release_only_what_cannot_match() {
        let (out, stopped, _) = stream(&["ab"], &["a", "a", "b"]);
        assert_eq!(out, ["", "a", ""]);
        assert!(stopped);
        let (out, _, _) = stream(&["abab"], &["ab", "a", "bab"]);
        assert_eq!(out, ["", "", ""]);
        let (out, stopped, rest) = stream(&["aaa"], &["aa", "aa"]);
        assert_eq!(out, ["", ""]);
        assert!(stopped);
        assert_eq!(rest, "");
        let (out, stopped, _) = stream(&["aaa"], &["aa", "b", "aa"]);
        assert_eq!(out, ["", "aab", ""]);
        assert!(!stopped);
    }

    #[test]
    fn multi_byte_characters_are_never_split() {
        let (out, stopped, _) = stream(&["世界"], &["你好世", "界!"]);
        assert_eq!(out, ["你好", ""]);
        assert!(stopped);
        // "→" and "←" share their first two bytes; only whole characters can be held.
        let (out, _, _) = stream(&["←a"], &["→", "←", "b"]);
        assert_eq!(out, ["→", "", "←b"]);
        let (out, stopped, rest) = stream(&["é!"], &["café"]);
        assert_eq!(out, ["caf"]);
        assert!(!stopped);
        assert_eq!(rest, "é");
    }

    #[test]
    fn the_earliest_stop_wins_and_finish_releases_the_held_tail() {
        let (out, stopped, _) = stream(&["b", "a"], &["xab"]);
        assert_eq!(out, ["x"]);
        assert!(stopped);
        let (out, stopped, rest) = stream(&["###", ""], &["done #"]);
        assert_eq!(out, ["done "]);
        assert!(!stopped);
        assert_eq!(rest, "#");
        let mut m = StopMatcher::new(["x"]);
        assert_eq!(m.push("axb"), ("a".to_owned(), true));
        assert!(m.is_stopped());
        assert_eq!(m.push("more"), (String::new(), true));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn a_stop_completed_first_ends_generation_before_a_longer_one_can() {
        // "éab" starts before "a" but is still incomplete when "éa" arrives.
        let (out, stopped, _) = stream(&["a", "éab"], &["éa", "b"]);
        assert_eq!(out, ["é", ""]);
        assert!(stopped);
    }

    proptest! {
        #[test]
        fn streamed_text_is_the_text_before_the_first_stop(
            chars in prop::collection::vec(prop::sample::select(vec!['a', 'b', 'é', '世', '→']), 0..40),
            cuts in prop::collection::vec(0usize..40, 0..10),
            stops in prop::collection::vec(
                prop::collection::vec(prop::sample::select(vec!['a', 'b', 'é', '世']), 1..4), 1..3),
        ) {
            let text: String = chars.iter().collect();
            let stops: Vec<String> = stops.iter().map(|s| s.iter().collect()).collect();
            // Split the text at arbitrary character positions.
            let mut bounds: Vec<usize> = cuts.iter().map(|&c| c.min(chars.len())).collect();
            bounds.push(0);
            bounds.push(chars.len());
            bounds.sort_unstable();
            let offsets: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
            let mut m = StopMatcher::new(stops.clone());
            let mut emitted = String::new();
            let mut stopped = false;
            for w in bounds.windows(2) {
                let (out, stop) = m.push(&text[offsets[w[0]]..offsets[w[1]]]);
                emitted.push_str(&out);
                stopped |= stop;
            }
            // Generation ends at the first piece that completes any stop string, and the text is
            // cut at the earliest stop found in what has arrived by then: a longer stop that
            // starts earlier but would complete later never gets the chance.
            let cut = bounds.windows(2).find_map(|w| {
                let seen = &text[..offsets[w[1]]];
                stops.iter().filter_map(|s| seen.find(s.as_str())).min()
            });
            if !stopped {
                emitted.push_str(&m.finish());
            }
            prop_assert_eq!(stopped, cut.is_some());
            prop_assert_eq!(emitted, &text[..cut.unwrap_or(text.len())]);
        }
    }
}

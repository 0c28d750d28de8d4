//! Token sampling as llama-cpp-python 0.3.x does it, and stop strings for streamed text.
//!
//! [`Sampler`] runs the chain that llama-cpp-python's `Llama._init_sampler` builds from
//! llama.cpp samplers, in its order:
//!
//! 1. penalties over the last `penalty_last_n` tokens (`llama_sampler_init_penalties`);
//! 2. a constraint, when [`Sampler::sample_masked`] is given one (a grammar: the tokens it
//!    forbids get a logit of −inf, as `llama_sampler_init_grammar` does);
//! 3. if the temperature is 0, greedy: the argmax over the whole vocabulary, lowest id on ties;
//! 4. otherwise, with [`Mirostat`] on, Mirostat alone (`llama_sampler_init_mirostat` or
//!    `_v2`): no top-k, typical, top-p, min-p or temperature, as llama-cpp-python builds it;
//! 5. otherwise top-k, typical, top-p, min-p (each with `min_keep = 1`), temperature, and a draw
//!    from the softmax of what is left (`llama_sampler_init_dist`).
//!
//! Each step follows llama.cpp's samplers. Two consequences are easy to miss:
//! the truncations run *before* the temperature, so top-p, min-p and typical see the model's own
//! distribution, not the tempered one; and top-p and typical renormalise over what the earlier
//! steps kept (top-p after top-k measures mass within the top k).
//!
//! Differences from llama-cpp-python, all deliberate: a negative temperature is an error here
//! (llama-cpp-python silently samples from the untruncated distribution), and so is a
//! `mirostat_mode` other than 0, 1 or 2 (llama-cpp-python takes it as 0); ties between equal
//! logits are broken by the lower id everywhere (llama.cpp leaves them to `std::sort`); and the
//! RNG is xoshiro256++ rather than `std::mt19937`, so a seed gives a reproducible sequence here
//! but not llama.cpp's sequence.
//!
//! [`StopMatcher`] is `create_completion(stop=[...], stream=True)`'s stop handling: text that could
//! still become a stop string is held back, and the stop string itself is never emitted.

mod cands;
mod mirostat;
mod steps;
mod stop;

#[cfg(test)]
mod tests;

use std::collections::BinaryHeap;
use std::fmt;

use rand_core::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::error::{Result, invalid};
use cands::{Cand, Cands, Worst, argmax, fill_all, fill_top_k};
pub use mirostat::Mirostat;
use steps::{apply_penalties, draw, min_p, temperature, top_p, typical};
pub use stop::StopMatcher;

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
    /// Mirostat in place of the truncations and the temperature (a temperature of 0 is still
    /// greedy).
    pub mirostat: Mirostat,
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
            mirostat: Mirostat::Off,
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
        self.mirostat.validate()
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
    /// Mirostat's threshold in bits: `2·tau` at the start, then moved after every draw.
    mu: f32,
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
            mu: params.mirostat.tau_eta().map_or(0.0, |(tau, _)| 2.0 * tau),
        })
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Mirostat's current threshold `mu` in bits, when Mirostat is on.
    pub fn mirostat_mu(&self) -> Option<f32> {
        self.params.mirostat.tau_eta().map(|_| self.mu)
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
        check_len(logits);
        let Sampler {
            params,
            rng,
            penalized,
            counts,
            cands,
            scored,
            heap,
            mu,
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
        pick(params, src, rng, cands, scored, heap, mu)
    }

    /// [`Sampler::sample`] with a constraint between the penalties and the rest of the chain:
    /// `mask` gets the penalised logits and sets those of the tokens it forbids to −inf (a
    /// grammar's step); its error ends the sampling. A forbidden token is never chosen as long as
    /// `mask` leaves one token allowed.
    ///
    /// # Panics
    ///
    /// As [`Sampler::sample`].
    pub fn sample_masked(
        &mut self,
        logits: &[f32],
        history: &[u32],
        mask: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<u32> {
        check_len(logits);
        let Sampler {
            params,
            rng,
            penalized,
            counts,
            cands,
            scored,
            heap,
            mu,
        } = self;
        penalized.clear();
        penalized.extend_from_slice(logits);
        if params.penalties_active() {
            let start = history.len().saturating_sub(params.penalty_last_n);
            apply_penalties(penalized, &history[start..], counts, params);
        }
        mask(penalized)?;
        Ok(pick(params, penalized, rng, cands, scored, heap, mu))
    }
}

fn check_len(logits: &[f32]) {
    assert!(
        !logits.is_empty() && u32::try_from(logits.len()).is_ok(),
        "sampling needs 1 to u32::MAX logits, got {}",
        logits.len()
    );
}

/// The chain after the penalties and any constraint: greedy, Mirostat, or the truncations, the
/// temperature and a draw.
fn pick(
    params: &SamplingParams,
    src: &[f32],
    rng: &mut Xoshiro256PlusPlus,
    cands: &mut Cands,
    scored: &mut Vec<(f32, Cand)>,
    heap: &mut BinaryHeap<Worst>,
    mu: &mut f32,
) -> u32 {
    if params.temperature == 0.0 {
        return argmax(src) as u32;
    }
    match params.mirostat {
        Mirostat::V1 { tau, eta } => {
            return mirostat::v1(src, (tau, eta), mu, heap, cands, unit(rng));
        }
        Mirostat::V2 { tau, eta } => return mirostat::v2(src, (tau, eta), mu, cands, unit(rng)),
        Mirostat::Off => {}
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

//! A generation request: the sampler's knobs under llama-cpp-python's names and what a call
//! asks for beyond the prompt, resolved here once into [`GenerateOptions`]. The keywords that
//! make one ([`super::keywords::Keywords`]) are read the same way by the Python bindings, the
//! server and any Rust caller.

use std::sync::Arc;

use crate::error::{Result, invalid};
use crate::generate::GenerateOptions;
use crate::grammar::Grammar;
use crate::llama_cpp::Seed;
use crate::sample::{Mirostat, SamplingParams};

/// The sampler's knobs under llama-cpp-python's names, Mirostat as its three arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub typical_p: f32,
    pub repeat_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// None: the model's seed (`default_seed` of [`Sampling::params`]).
    pub seed: Option<Seed>,
    pub mirostat_mode: i64,
    pub mirostat_tau: f32,
    pub mirostat_eta: f32,
}

impl Default for Sampling {
    /// llama-cpp-python's `create_completion` defaults.
    fn default() -> Self {
        Sampling {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            mirostat_mode: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
        }
    }
}

impl Sampling {
    /// The sampler's parameters; `default_seed` when the request names none (the model's
    /// `seed=` at load, as `Llama(seed=...)`), a random one when it asks for one (-1).
    /// A bad Mirostat mode or rate is refused by name.
    pub fn params(&self, default_seed: Option<u64>) -> Result<SamplingParams> {
        Ok(SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            typical_p: self.typical_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed.map_or(default_seed, Seed::value),
            mirostat: Mirostat::from_mode(
                self.mirostat_mode,
                self.mirostat_tau,
                self.mirostat_eta,
            )?,
            ..SamplingParams::default()
        })
    }
}

impl Sampling {
    /// One token from `logits` (one row of the vocabulary's) through the sampler chain, with
    /// the penalties over `history`: llama-cpp-python's `Llama.sample` on logits the caller
    /// holds. `temperature=0` is the argmax, lowest id on ties.
    pub fn sample_row(&self, logits: &[f32], history: &[u32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(invalid(
                "logits",
                "one row of the vocabulary's logits",
                "an empty array",
            ));
        }
        let mut sampler = crate::sample::Sampler::new(self.params(None)?)?;
        Ok(sampler.sample(logits, history))
    }
}

/// What a request asks for beyond the prompt.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub sampling: Sampling,
    /// llama-cpp-python's `max_tokens`: `None` or <= 0 generates until the cache is full.
    pub max_tokens: Option<i64>,
    pub stop: Vec<String>,
    pub logprobs: Option<usize>,
    pub grammar: Option<Arc<Grammar>>,
    pub logit_bias: Vec<(u32, f32)>,
    /// transformers' `eos_token_id`: these end the generation in place of the tokenizer's.
    pub eog_tokens: Option<Vec<u32>>,
    /// Tokens before an end-of-generation token may end it ([`GenerateOptions::min_tokens`]).
    pub min_tokens: u64,
}

impl Request {
    /// The engine's options for this request.
    pub fn options(self, default_seed: Option<u64>) -> Result<GenerateOptions> {
        Ok(GenerateOptions {
            max_tokens: token_budget(self.max_tokens),
            sampling: self.sampling.params(default_seed)?,
            stop: self.stop,
            stop_at_eog: true,
            min_tokens: self.min_tokens,
            eog_tokens: self.eog_tokens,
            logprobs: self.logprobs,
            grammar: self.grammar,
            logit_bias: self.logit_bias,
            ..GenerateOptions::default()
        })
    }
}

/// `max_tokens`: `None` or <= 0 generates until the cache is full (llama-cpp-python).
pub fn token_budget(n: Option<i64>) -> Option<u64> {
    n.and_then(|n| u64::try_from(n).ok()).filter(|&n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_row_samples_its_argmax_at_temperature_zero_and_an_empty_row_is_refused() {
        let greedy = Sampling {
            temperature: 0.0,
            ..Sampling::default()
        };
        assert_eq!(greedy.sample_row(&[0.5, 2.0, 2.0, -1.0], &[]).unwrap(), 1);
        let e = greedy.sample_row(&[], &[]).unwrap_err().to_string();
        assert_eq!(
            e,
            "logits: expected one row of the vocabulary's logits, got an empty array"
        );
        let bad = Sampling {
            mirostat_mode: 3,
            ..Sampling::default()
        };
        assert!(bad.sample_row(&[1.0], &[]).is_err());
    }

    #[test]
    fn budgets_below_one_run_until_the_cache_is_full() {
        assert_eq!(token_budget(None), None);
        assert_eq!(token_budget(Some(0)), None);
        assert_eq!(token_budget(Some(-3)), None);
        assert_eq!(token_budget(Some(16)), Some(16));
    }

    #[test]
    fn a_request_becomes_options_with_the_default_seed_when_it_names_none() {
        let o = Request {
            max_tokens: Some(0),
            stop: vec!["\n".into()],
            ..Request::default()
        }
        .options(Some(7))
        .unwrap();
        assert_eq!(o.max_tokens, None);
        assert_eq!(o.sampling.seed, Some(7));
        assert!(o.stop_at_eog);
        // a request's own seed wins over the model's, and -1 asks for a random one
        let seeded = |seed| Sampling {
            seed: Some(seed),
            ..Sampling::default()
        };
        let params = seeded(Seed::Fixed(3)).params(Some(7)).unwrap();
        assert_eq!(params.seed, Some(3));
        assert_eq!(seeded(Seed::Random).params(Some(7)).unwrap().seed, None);
        let bad = Request {
            sampling: Sampling {
                mirostat_mode: 3,
                ..Sampling::default()
            },
            ..Request::default()
        };
        assert!(bad.options(None).is_err());
    }
}

//! A generation request as the peers' entry points word it: llama-cpp-python's
//! `create_completion` and `create_chat_completion` arguments, transformers' `generate`
//! vocabulary (`do_sample`, `max_length`, `repetition_penalty`, ...) and OpenAI's JSON
//! `logit_bias`, each resolved here once into [`GenerateOptions`], so the Python bindings, the
//! server and any Rust caller read them the same way.

use std::sync::Arc;

use crate::error::{EngineError, Result, invalid};
use crate::generate::GenerateOptions;
use crate::grammar::Grammar;
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
    pub seed: Option<u64>,
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
    /// `seed=` at load, as `Llama(seed=...)`). A bad Mirostat mode or rate is refused by name.
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
            seed: self.seed.or(default_seed),
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
}

impl Request {
    /// The engine's options for this request.
    pub fn options(self, default_seed: Option<u64>) -> Result<GenerateOptions> {
        Ok(GenerateOptions {
            max_tokens: token_budget(self.max_tokens),
            sampling: self.sampling.params(default_seed)?,
            stop: self.stop,
            stop_at_eog: true,
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

/// The arguments of llama-cpp-python's completion calls that this build refuses by name:
/// `tfs_z` other than 1 (llama.cpp removed tail-free sampling).
pub fn refuse_tfs_z(tfs_z: f32) -> Result<()> {
    refuse(
        "tfs_z",
        tfs_z != 1.0,
        "llama.cpp removed tail-free sampling; use 1.0",
    )
}

fn refuse(what: &str, given: bool, detail: &str) -> Result<()> {
    if given {
        return Err(EngineError::Unsupported {
            what: what.to_owned(),
            detail: detail.to_owned(),
        });
    }
    Ok(())
}

/// A count of alternatives per token (`logprobs`, `top_logprobs`), refused when negative.
pub fn alternatives(n: i64, what: &str) -> Result<usize> {
    usize::try_from(n).map_err(|_| {
        invalid(
            what,
            "a number of alternatives per token >= 0",
            format!("{n}; pass None for no log-probabilities"),
        )
    })
}

/// A chat's `logprobs` and `top_logprobs`: llama-cpp-python passes `top_logprobs if logprobs
/// else None` on as the completion's `logprobs`, so `logprobs=True` alone scores nothing.
pub fn chat_logprobs(logprobs: Option<bool>, top_logprobs: Option<i64>) -> Result<Option<usize>> {
    match (logprobs, top_logprobs) {
        (Some(true), Some(n)) => alternatives(n, "top_logprobs").map(Some),
        _ => Ok(None),
    }
}

/// A `logit_bias` key as a caller gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum BiasKey {
    /// An integer.
    Id(i64),
    /// A string: OpenAI's JSON sends token ids as decimal strings.
    Text(String),
    /// Anything else, as the caller shows it.
    Other(String),
}

/// `logit_bias`: token id (an int, or its decimal string as OpenAI's JSON sends it) → the number
/// added to that token's logit. Whether each id is in the vocabulary, and each value a number
/// the sampler takes, is checked when the generation starts.
pub fn logit_bias(entries: Vec<(BiasKey, f32)>) -> Result<Vec<(u32, f32)>> {
    entries
        .into_iter()
        .map(|(key, bias)| {
            let id = match &key {
                BiasKey::Id(n) => u32::try_from(*n).ok(),
                BiasKey::Text(s) => s.trim().parse::<u32>().ok(),
                BiasKey::Other(_) => None,
            };
            let shown = match key {
                BiasKey::Id(n) => n.to_string(),
                BiasKey::Text(s) => format!("'{s}'"),
                BiasKey::Other(r) => r,
            };
            id.map(|id| (id, bias)).ok_or_else(|| {
                invalid(
                    "logit_bias",
                    "token ids (ints >= 0, or their decimal strings) as keys",
                    shown,
                )
            })
        })
        .collect()
}

/// transformers' `generate` words beside llama.cpp's, as `Model.generate` takes them. Each
/// sampler knob is `None` when not given.
#[derive(Debug, Clone, Default)]
pub struct TransformersArgs {
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_k: Option<i32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    /// llama.cpp's name for the repetition penalty.
    pub repeat_penalty: Option<f32>,
    /// transformers' name for it.
    pub repetition_penalty: Option<f32>,
    pub max_new_tokens: Option<i64>,
    /// The length of prompt and generated text together.
    pub max_length: Option<i64>,
    pub num_return_sequences: i64,
}

/// New tokens when neither `max_new_tokens` nor `max_length` is given.
pub const DEFAULT_NEW_TOKENS: i64 = 32;

impl TransformersArgs {
    /// The sampling knobs and the token budget for a prompt of `prompt_len` tokens, `rest`
    /// giving the knobs these words do not touch.
    ///
    /// Without `do_sample` the defaults are llama.cpp's and a missing temperature is greedy;
    /// with it they are transformers' (temperature 1, top-k 50, top-p 1, no min-p), and
    /// `do_sample=False` is greedy whatever the temperature. `max_new_tokens` wins over
    /// `max_length`, which counts the prompt; with neither, [`DEFAULT_NEW_TOKENS`].
    pub fn resolve(&self, rest: Sampling, prompt_len: usize) -> Result<(Sampling, Option<i64>)> {
        let (top_k, top_p, min_p) = match self.do_sample {
            Some(_) => (50, 1.0, 0.0),
            None => (40, 0.95, 0.05),
        };
        let temperature = match self.do_sample {
            Some(false) => 0.0,
            Some(true) => self.temperature.unwrap_or(1.0),
            None => self.temperature.unwrap_or(0.0),
        };
        let repeat_penalty = match (self.repeat_penalty, self.repetition_penalty) {
            (Some(value), Some(alias_value)) if value != alias_value => {
                return Err(EngineError::Aliased {
                    what: "penalty",
                    name: "repeat_penalty",
                    value,
                    alias: "repetition_penalty",
                    alias_value,
                });
            }
            (a, b) => a.or(b).unwrap_or(1.0),
        };
        if self.num_return_sequences < 1 {
            return Err(invalid(
                "num_return_sequences",
                "at least 1",
                self.num_return_sequences,
            ));
        }
        // as transformers: greedy decoding would return the same sequence every time
        refuse(
            "num_return_sequences above 1 with greedy decoding",
            self.num_return_sequences > 1 && temperature == 0.0,
            "every sequence would be the same; pass do_sample=True (or a temperature above 0)",
        )?;
        let sampling = Sampling {
            temperature,
            top_k: self.top_k.unwrap_or(top_k),
            top_p: self.top_p.unwrap_or(top_p),
            min_p: self.min_p.unwrap_or(min_p),
            repeat_penalty,
            ..rest
        };
        Ok((sampling, self.new_tokens(prompt_len)?))
    }

    fn new_tokens(&self, prompt_len: usize) -> Result<Option<i64>> {
        match (self.max_new_tokens, self.max_length) {
            (Some(n), _) => Ok(Some(n)),
            (None, Some(total)) => {
                let prompt = i64::try_from(prompt_len).unwrap_or(i64::MAX);
                if total <= prompt {
                    return Err(EngineError::MaxLength {
                        max_length: total,
                        prompt,
                    });
                }
                Ok(Some(total - prompt))
            }
            (None, None) => Ok(Some(DEFAULT_NEW_TOKENS)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> TransformersArgs {
        TransformersArgs {
            num_return_sequences: 1,
            ..TransformersArgs::default()
        }
    }

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
    fn do_sample_picks_transformers_defaults_and_false_is_greedy() {
        // transformers' GenerationConfig: temperature 1.0, top_k 50, top_p 1.0.
        let (s, _) = TransformersArgs {
            do_sample: Some(true),
            ..args()
        }
        .resolve(Sampling::default(), 3)
        .unwrap();
        assert_eq!(
            (s.temperature, s.top_k, s.top_p, s.min_p),
            (1.0, 50, 1.0, 0.0)
        );
        let (s, _) = TransformersArgs {
            do_sample: Some(false),
            temperature: Some(0.7),
            ..args()
        }
        .resolve(Sampling::default(), 3)
        .unwrap();
        assert_eq!(s.temperature, 0.0);
        // Without do_sample: llama.cpp's truncations, greedy unless a temperature is given.
        let (s, _) = args().resolve(Sampling::default(), 3).unwrap();
        assert_eq!(
            (s.temperature, s.top_k, s.top_p, s.min_p),
            (0.0, 40, 0.95, 0.05)
        );
        let (s, _) = TransformersArgs {
            temperature: Some(0.5),
            top_k: Some(7),
            ..args()
        }
        .resolve(Sampling::default(), 3)
        .unwrap();
        assert_eq!((s.temperature, s.top_k), (0.5, 7));
    }

    #[test]
    fn max_length_counts_the_prompt_and_max_new_tokens_wins() {
        let budget = |new, total, prompt| {
            TransformersArgs {
                max_new_tokens: new,
                max_length: total,
                ..args()
            }
            .resolve(Sampling::default(), prompt)
            .map(|(_, n)| n)
        };
        assert_eq!(budget(None, Some(13), 5).unwrap(), Some(8));
        assert_eq!(budget(Some(4), Some(13), 5).unwrap(), Some(4));
        assert_eq!(budget(None, None, 5).unwrap(), Some(DEFAULT_NEW_TOKENS));
        let e = budget(None, Some(5), 5).unwrap_err().to_string();
        assert!(e.contains("max_length=5 counts the prompt"), "{e}");
        assert!(e.contains("already 5 tokens"), "{e}");
    }

    #[test]
    fn the_two_penalty_names_must_agree_and_many_sequences_are_refused() {
        let both = |a, b| {
            TransformersArgs {
                repeat_penalty: a,
                repetition_penalty: b,
                ..args()
            }
            .resolve(Sampling::default(), 1)
        };
        assert_eq!(both(None, Some(1.3)).unwrap().0.repeat_penalty, 1.3);
        assert_eq!(both(Some(1.3), Some(1.3)).unwrap().0.repeat_penalty, 1.3);
        assert_eq!(both(None, None).unwrap().0.repeat_penalty, 1.0);
        let e = both(Some(1.1), Some(1.3)).unwrap_err().to_string();
        assert!(e.contains("repetition_penalty=1.3"), "{e}");
        let e = TransformersArgs {
            num_return_sequences: 2,
            ..args()
        }
        .resolve(Sampling::default(), 1)
        .unwrap_err();
        assert!(matches!(e, EngineError::Unsupported { .. }), "{e}");
        let sampled = TransformersArgs {
            num_return_sequences: 2,
            do_sample: Some(true),
            ..args()
        };
        assert!(sampled.resolve(Sampling::default(), 1).is_ok());
        let e = TransformersArgs {
            num_return_sequences: 0,
            ..args()
        }
        .resolve(Sampling::default(), 1)
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("num_return_sequences: expected at least 1"),
            "{e}"
        );
        assert!(e.to_string().contains("num_return_sequences"), "{e}");
    }

    #[test]
    fn logit_bias_takes_ints_and_openai_decimal_strings() {
        let got = logit_bias(vec![
            (BiasKey::Id(198), 100.0),
            (BiasKey::Text(" 42 ".into()), -1.0),
        ])
        .unwrap();
        assert_eq!(got, vec![(198, 100.0), (42, -1.0)]);
        for bad in [
            BiasKey::Id(-1),
            BiasKey::Text("Paris".into()),
            BiasKey::Other("1.5".into()),
        ] {
            let e = logit_bias(vec![(bad, 1.0)]).unwrap_err().to_string();
            assert!(e.starts_with("logit_bias: expected token ids"), "{e}");
        }
    }

    #[test]
    fn budgets_counts_and_refusals() {
        assert_eq!(token_budget(None), None);
        assert_eq!(token_budget(Some(0)), None);
        assert_eq!(token_budget(Some(-3)), None);
        assert_eq!(token_budget(Some(16)), Some(16));
        assert_eq!(alternatives(3, "logprobs").unwrap(), 3);
        let e = alternatives(-1, "logprobs").unwrap_err().to_string();
        assert!(
            e.contains("logprobs: expected a number of alternatives"),
            "{e}"
        );
        assert_eq!(chat_logprobs(Some(true), Some(2)).unwrap(), Some(2));
        assert_eq!(chat_logprobs(Some(true), None).unwrap(), None);
        assert_eq!(chat_logprobs(None, Some(2)).unwrap(), None);
        assert!(refuse_tfs_z(1.0).is_ok());
        assert!(refuse_tfs_z(0.9).unwrap_err().to_string().contains("tfs_z"));
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

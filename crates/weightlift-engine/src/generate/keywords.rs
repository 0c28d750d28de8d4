//! The keywords of a generation call as one serde type, [`Keywords`]: llama-cpp-python's
//! `create_completion` and `create_chat_completion` arguments, transformers' `generate` words
//! (`do_sample`, `max_length`, `repetition_penalty`, ...) and OpenAI's JSON (`logit_bias` keyed
//! by decimal strings), read alike from a Python keyword dict or an OpenAI request's JSON.
//!
//! Reading checks each keyword's kind; one that takes several kinds is refused in the words
//! "expected ..., got ...". The methods apply the defaults, check the values (a wrong value is
//! an [`EngineError`]), refuse what this build does not do, and make the engine's [`Request`].

use std::fmt;
use std::sync::Arc;

use indexmap::IndexMap;
use serde::Deserialize;
use serde::de::{self, Deserializer, Unexpected, Visitor};
use serde_json::Value;
use weightlift_text::ChatTools;

use super::request::{Request, Sampling};
use super::tools::chat_tools;
use crate::error::{EngineError, invalid};
use crate::grammar::Grammar;
use crate::llama_cpp::Seed;
use crate::session::Prompt;

/// Every keyword of a generation call, each `None` when not given (or given as None). Keys it
/// does not name (the live objects a binding keeps: a cache, a batch, hooks) are skipped.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Keywords {
    /// The text or token ids to continue (None given for it is refused).
    #[serde(deserialize_with = "given")]
    pub prompt: Option<PromptArg>,
    /// A chat's messages, as OpenAI's JSON.
    pub messages: Option<Vec<Value>>,
    /// The text after the gap a completion fills.
    pub suffix: Option<Text>,
    /// Whether a text prompt starts with BOS (None: as the tokenizer does).
    #[serde(deserialize_with = "maybe_flag")]
    pub add_bos: Option<bool>,

    pub temperature: Option<f32>,
    pub top_k: Option<i32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// An int from 0 to 2^64 - 1, or -1 for a random seed ([`Seed`]).
    pub seed: Option<i128>,
    pub mirostat_mode: Option<i64>,
    pub mirostat_tau: Option<f32>,
    pub mirostat_eta: Option<f32>,
    /// Tail-free sampling, which llama.cpp removed: only 1 (off) is taken.
    pub tfs_z: Option<f32>,

    /// llama-cpp-python's budget: `None` or <= 0 generates until the cache is full.
    pub max_tokens: Option<i64>,
    /// llama-cpp-python's server's: tokens before an end-of-generation token may end the text.
    pub min_tokens: Option<i64>,
    pub stop: Option<Stop>,
    pub grammar: Option<Gbnf>,
    /// Token id → the number added to its logit.
    pub logit_bias: Option<IndexMap<BiasKey, f32>>,
    /// A completion's count of alternatives per token; a chat's switch for `top_logprobs`.
    pub logprobs: Option<Logprobs>,
    pub top_logprobs: Option<i64>,
    #[serde(deserialize_with = "flag")]
    pub stream: bool,
    #[serde(deserialize_with = "flag")]
    pub echo: bool,
    /// The name a response carries (the model's path when None).
    pub model: Option<String>,

    pub response_format: Option<ResponseFormat>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,

    #[serde(deserialize_with = "maybe_flag")]
    pub do_sample: Option<bool>,
    pub max_new_tokens: Option<i64>,
    /// The length of prompt and generated text together.
    pub max_length: Option<i64>,
    /// transformers' `min_tokens`, and its count with the prompt's tokens.
    pub min_new_tokens: Option<i64>,
    pub min_length: Option<i64>,
    /// transformers' name for `repeat_penalty`.
    pub repetition_penalty: Option<f32>,
    /// These end the generation in place of the tokenizer's end-of-generation tokens.
    pub eos_token_id: Option<TokenIds>,
    pub num_return_sequences: Option<i64>,
}

/// A minimum length, `name`'s value: 0 or more (none when not given). One above the budget is
/// taken, and the budget wins, as in llama-cpp-python and transformers.
fn at_least(name: &'static str, min: Option<i64>) -> Result<u64, EngineError> {
    min.map_or(Ok(0), |n| {
        u64::try_from(n).map_err(|_| invalid(name, "0 or more", n))
    })
}

/// New tokens when neither `max_new_tokens` nor `max_length` is given.
pub const DEFAULT_NEW_TOKENS: i64 = 32;

impl Keywords {
    /// The sampler settings: each keyword given over llama-cpp-python's `create_completion`
    /// defaults.
    pub fn sampling(&self) -> Result<Sampling, EngineError> {
        let d = Sampling::default();
        Ok(Sampling {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            typical_p: self.typical_p.unwrap_or(d.typical_p),
            repeat_penalty: self.repeat_penalty.unwrap_or(d.repeat_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: self.seed.map(|s| Seed::read(s, "seed")).transpose()?,
            mirostat_mode: self.mirostat_mode.unwrap_or(d.mirostat_mode),
            mirostat_tau: self.mirostat_tau.unwrap_or(d.mirostat_tau),
            mirostat_eta: self.mirostat_eta.unwrap_or(d.mirostat_eta),
        })
    }

    /// `create_completion`'s request (its grammar from GBNF text).
    pub fn completion(&self) -> Result<Request, EngineError> {
        self.refuse_tfs_z()?;
        let logprobs = match self.logprobs {
            None | Some(Logprobs::Flag(false)) => None,
            // A bool is an int to llama-cpp-python: True lists one alternative.
            Some(Logprobs::Flag(true)) => Some(1),
            Some(Logprobs::Count(n)) => Some(alternatives(n, "logprobs")?),
        };
        Ok(Request {
            logprobs,
            grammar: self.grammar()?,
            ..self.request()?
        })
    }

    /// `create_chat_completion`'s request; its grammar is the chat's
    /// ([`crate::model::Model::chat`]). llama-cpp-python passes `top_logprobs if logprobs else
    /// None` on as the completion's `logprobs`, so `logprobs=True` alone scores nothing.
    pub fn chat(&self) -> Result<Request, EngineError> {
        self.refuse_tfs_z()?;
        let on = matches!(self.logprobs, Some(Logprobs::Flag(true))) || self.counts_logprobs();
        let logprobs = match self.top_logprobs {
            Some(n) if on => Some(alternatives(n, "top_logprobs")?),
            _ => None,
        };
        Ok(Request {
            logprobs,
            ..self.request()?
        })
    }

    fn counts_logprobs(&self) -> bool {
        matches!(self.logprobs, Some(Logprobs::Count(n)) if n != 0)
    }

    /// What the completion calls share: sampler, budget, stop strings and logit bias.
    fn request(&self) -> Result<Request, EngineError> {
        Ok(Request {
            sampling: self.sampling()?,
            max_tokens: self.max_tokens,
            min_tokens: at_least("min_tokens", self.min_tokens)?,
            stop: self.stop.clone().unwrap_or_default().0,
            logit_bias: self.logit_bias()?,
            ..Request::default()
        })
    }

    /// `Model.generate`'s request for a prompt of `prompt_len` tokens, in transformers' words
    /// beside llama.cpp's.
    ///
    /// Without `do_sample` the defaults are llama.cpp's and a missing temperature is greedy;
    /// with it they are transformers' (temperature 1, top-k 50, top-p 1, no min-p), and
    /// `do_sample=False` is greedy whatever the temperature. `max_new_tokens` wins over
    /// `max_length`, which counts the prompt; with neither, [`DEFAULT_NEW_TOKENS`].
    pub fn generate(&self, prompt_len: usize) -> Result<Request, EngineError> {
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
        // as transformers: greedy decoding would return the same sequence every time
        refuse(
            "num_return_sequences above 1 with greedy decoding",
            self.sequences(false)? > 1 && temperature == 0.0,
            "every sequence would be the same; pass do_sample=True (or a temperature above 0)",
        )?;
        let sampling = Sampling {
            temperature,
            top_k: self.top_k.unwrap_or(top_k),
            top_p: self.top_p.unwrap_or(top_p),
            min_p: self.min_p.unwrap_or(min_p),
            repeat_penalty,
            ..self.sampling()?
        };
        let max_tokens = self.new_tokens(prompt_len)?;
        let min_tokens = match (self.min_new_tokens, self.min_length) {
            (Some(n), _) => at_least("min_new_tokens", Some(n))?,
            (None, Some(total)) => {
                // a minimum the prompt already reaches asks for nothing more
                let prompt = u64::try_from(prompt_len).unwrap_or(u64::MAX);
                at_least("min_length", Some(total))?.saturating_sub(prompt)
            }
            (None, None) => 0,
        };
        Ok(Request {
            sampling,
            max_tokens,
            min_tokens,
            stop: self.stop.clone().unwrap_or_default().0,
            grammar: self.grammar()?,
            eog_tokens: self.eos_token_id.clone().map(|ids| ids.0),
            ..Request::default()
        })
    }

    fn new_tokens(&self, prompt_len: usize) -> Result<Option<i64>, EngineError> {
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

    /// transformers' `num_return_sequences` (1 when not given), at least 1. Above 1 the
    /// sequences run in slots of their own and return whole texts: not streamed, nor appended
    /// to a `cache` the caller gives.
    pub fn sequences(&self, cache: bool) -> Result<usize, EngineError> {
        let n = self.num_return_sequences.unwrap_or(1);
        let count = usize::try_from(n).ok().filter(|&n| n >= 1);
        let count = count.ok_or_else(|| invalid("num_return_sequences", "at least 1", n))?;
        if count > 1 && (self.stream || cache) {
            return Err(invalid(
                format!("num_return_sequences={n}"),
                "neither stream=True nor cache= with it (the sequences run in slots of their \
                 own and return whole texts)",
                if self.stream { "stream=True" } else { "cache=" },
            ));
        }
        Ok(count)
    }

    /// `tfs_z` other than 1 is refused: llama.cpp removed tail-free sampling.
    fn refuse_tfs_z(&self) -> Result<(), EngineError> {
        refuse(
            "tfs_z",
            self.tfs_z.is_some_and(|z| z != 1.0),
            "llama.cpp removed tail-free sampling; use 1.0",
        )
    }

    /// The prompt: text (bytes checked for UTF-8) or ids.
    pub fn prompt(&self) -> Result<Prompt, EngineError> {
        match self.prompt.clone() {
            None => Err(invalid("prompt", "text or token ids", "nothing")),
            Some(PromptArg::Ids(ids)) => Ok(Prompt::Ids(ids)),
            Some(PromptArg::Text(t)) => t.into_string("prompt").map(Prompt::Text),
        }
    }

    /// The suffix, its bytes checked for UTF-8.
    pub fn suffix(&self) -> Result<Option<String>, EngineError> {
        self.suffix
            .clone()
            .map(|s| s.into_string("suffix"))
            .transpose()
    }

    /// The grammar GBNF text `grammar` names.
    pub fn grammar(&self) -> Result<Option<Arc<Grammar>>, EngineError> {
        let Some(Gbnf(text)) = &self.grammar else {
            return Ok(None);
        };
        Ok(Some(Arc::new(Grammar::parse(text)?)))
    }

    /// The grammar `response_format` picks ([`Grammar::for_response_format`]).
    pub fn response_format(&self) -> Result<Option<Arc<Grammar>>, EngineError> {
        match &self.response_format {
            None => Ok(None),
            Some(ResponseFormat(f)) => Grammar::for_response_format(&f.to_string()),
        }
    }

    /// A chat's `tools` and `tool_choice`, the legacy `functions` and `function_call` included.
    pub fn tools(&self) -> ChatTools {
        chat_tools(
            self.functions.clone(),
            self.function_call.clone(),
            self.tools.clone(),
            self.tool_choice.clone(),
        )
    }

    /// `logit_bias` as token ids: an int, or its decimal string as OpenAI's JSON sends it.
    /// Whether each id is in the vocabulary, and each value a number the sampler takes, is
    /// checked when the generation starts.
    pub fn logit_bias(&self) -> Result<Vec<(u32, f32)>, EngineError> {
        let Some(bias) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        bias.iter()
            .map(|(key, &bias)| {
                let id = match key {
                    BiasKey::Id(n) => u32::try_from(*n).ok(),
                    BiasKey::Text(s) => s.trim().parse::<u32>().ok(),
                    BiasKey::Other(_) => None,
                };
                let shown = match key {
                    BiasKey::Id(n) => n.to_string(),
                    BiasKey::Text(s) => format!("'{s}'"),
                    BiasKey::Other(r) => r.clone(),
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
}

/// A count of alternatives per token (`logprobs`, `top_logprobs`), refused when negative.
fn alternatives(n: i64, what: &str) -> Result<usize, EngineError> {
    usize::try_from(n).map_err(|_| {
        invalid(
            what,
            "a number of alternatives per token >= 0",
            format!("{n}; pass None for no log-probabilities"),
        )
    })
}

fn refuse(what: &str, given: bool, detail: &str) -> Result<(), EngineError> {
    if given {
        return Err(EngineError::Unsupported {
            what: what.to_owned(),
            detail: detail.to_owned(),
        });
    }
    Ok(())
}

/// Stop strings: one string, or a list of them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stop(pub Vec<String>);

/// GBNF text (a parsed grammar is an object a binding keeps).
#[derive(Debug, Clone, PartialEq)]
pub struct Gbnf(pub String);

/// `response_format`: an object such as `{"type": "json_object"}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseFormat(pub Value);

/// Token ids: one id, or a list of them.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenIds(pub Vec<u32>);

/// A completion's `logprobs` as llama-cpp-python takes it: a count, or a bool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Logprobs {
    Flag(bool),
    Count(i64),
}

/// A `logit_bias` key as a caller gave it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BiasKey {
    /// An integer.
    Id(i64),
    /// A string: OpenAI's JSON sends token ids as decimal strings.
    Text(String),
    /// Anything else, as JSON shows it.
    Other(String),
}

/// Text as callers give it: a string, or bytes that should hold UTF-8 (llama-cpp-python passes
/// UTF-8 bytes).
#[derive(Debug, Clone, PartialEq)]
pub enum Text {
    Str(String),
    Bytes(Vec<u8>),
}

impl Text {
    /// The text, bytes checked for UTF-8; `what` names it in the error.
    pub fn into_string(self, what: &str) -> Result<String, EngineError> {
        match self {
            Text::Str(s) => Ok(s),
            Text::Bytes(b) => String::from_utf8(b).map_err(|e| {
                invalid(
                    what,
                    "UTF-8 text",
                    format!("bytes that are not UTF-8 ({e})"),
                )
            }),
        }
    }
}

/// A prompt as callers give it: text, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptArg {
    Text(Text),
    Ids(Vec<u32>),
}

/// `Err` for a value of the wrong kind, worded as every keyword's: "expected ..., got ...".
fn wrong<E: de::Error>(got: Unexpected<'_>, expected: &dyn de::Expected) -> E {
    E::custom(format_args!("expected {expected}, got {got}"))
}

fn unexpected(v: &Value) -> Unexpected<'_> {
    match v {
        Value::Null => Unexpected::Other("null"),
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Unexpected::Signed(i),
            (_, Some(u)) => Unexpected::Unsigned(u),
            _ => Unexpected::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => Unexpected::Str(s),
        Value::Array(_) => Unexpected::Seq,
        Value::Object(_) => Unexpected::Map,
    }
}

/// A keyword of several kinds: its value read as JSON, then taken by `take`, which hands back
/// a value it refuses.
fn one_of<'de, D: Deserializer<'de>, T>(
    d: D,
    expected: &str,
    take: impl FnOnce(Value) -> Result<T, Value>,
) -> Result<T, D::Error> {
    take(Value::deserialize(d)?).map_err(|v| wrong(unexpected(&v), &expected))
}

/// A switch: a bool, and nothing that merely converts to one (`"false"` is no switch).
fn flag<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    one_of(d, "a bool", |v| v.as_bool().ok_or(v))
}

fn maybe_flag<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    one_of(d, "a bool or None", |v| match v {
        Value::Null => Ok(None),
        v => v.as_bool().map(Some).ok_or(v),
    })
}

/// A value that must be given: None is refused as every other kind outside the keyword's.
fn given<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

fn token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        one_of(d, "a string or a list of strings", |v| match v {
            Value::String(s) => Ok(Stop(vec![s])),
            Value::Array(a) if a.iter().all(Value::is_string) => Ok(Stop(
                a.into_iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect(),
            )),
            v => Err(v),
        })
    }
}

impl<'de> Deserialize<'de> for Gbnf {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        one_of(d, "GBNF text (a string) or a LlamaGrammar", |v| match v {
            Value::String(s) => Ok(Gbnf(s)),
            v => Err(v),
        })
    }
}

impl<'de> Deserialize<'de> for ResponseFormat {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        one_of(
            d,
            "a dict such as {\"type\": \"json_object\"}",
            |v| match v {
                Value::Object(_) => Ok(ResponseFormat(v)),
                v => Err(v),
            },
        )
    }
}

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        one_of(d, "a token id (an int >= 0) or a list of them", |v| {
            let ids = match &v {
                Value::Array(a) => a.iter().map(token_id).collect(),
                one => token_id(one).map(|id| vec![id]),
            };
            ids.map(TokenIds).ok_or(v)
        })
    }
}

impl<'de> Deserialize<'de> for Logprobs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        one_of(d, "an int or None", |v| match (&v, v.as_i64()) {
            (Value::Bool(b), _) => Ok(Logprobs::Flag(*b)),
            (_, Some(n)) => Ok(Logprobs::Count(n)),
            _ => Err(v),
        })
    }
}

impl<'de> Deserialize<'de> for BiasKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Value::deserialize(d)? {
            Value::String(s) => BiasKey::Text(s),
            v => match v.as_i64() {
                Some(n) => BiasKey::Id(n),
                None => BiasKey::Other(v.to_string()),
            },
        })
    }
}

/// Reads text, or (for a prompt) token ids: a string, bytes, or a list of ids.
struct TextVisitor {
    ids: bool,
}

impl<'de> Visitor<'de> for TextVisitor {
    type Value = PromptArg;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("text (a string, or UTF-8 bytes)")?;
        if self.ids {
            f.write_str(" or a list of token ids")?;
        }
        Ok(())
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptArg, E> {
        Ok(PromptArg::Text(Text::Str(s.to_owned())))
    }

    fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<PromptArg, E> {
        Ok(PromptArg::Text(Text::Bytes(b.to_vec())))
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<PromptArg, A::Error> {
        if !self.ids {
            return Err(wrong(Unexpected::Seq, &self));
        }
        let mut ids = Vec::new();
        while let Some(v) = seq.next_element::<Value>()? {
            ids.push(token_id(&v).ok_or_else(|| wrong(unexpected(&v), &"token ids (ints >= 0)"))?);
        }
        Ok(PromptArg::Ids(ids))
    }

    // Any other kind, worded as every keyword's.
    fn visit_bool<E: de::Error>(self, b: bool) -> Result<PromptArg, E> {
        Err(wrong(Unexpected::Bool(b), &self))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<PromptArg, E> {
        Err(wrong(Unexpected::Signed(n), &self))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<PromptArg, E> {
        Err(wrong(Unexpected::Unsigned(n), &self))
    }

    fn visit_f64<E: de::Error>(self, x: f64) -> Result<PromptArg, E> {
        Err(wrong(Unexpected::Float(x), &self))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<PromptArg, A::Error> {
        Err(wrong(Unexpected::Map, &self))
    }

    fn visit_unit<E: de::Error>(self) -> Result<PromptArg, E> {
        Err(wrong(Unexpected::Other("null"), &self))
    }
}

impl<'de> Deserialize<'de> for PromptArg {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TextVisitor { ids: true })
    }
}

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match d.deserialize_any(TextVisitor { ids: false })? {
            PromptArg::Text(t) => Ok(t),
            PromptArg::Ids(_) => Err(wrong(Unexpected::Seq, &"text")),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn read(v: Value) -> Keywords {
        serde_json::from_value(v).unwrap()
    }

    fn refused(v: Value) -> String {
        serde_json::from_value::<Keywords>(v)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn each_keyword_reads_its_kinds_and_names_the_others() {
        let k = read(json!({
            "prompt": [1, 2], "stop": "\n", "logprobs": 3, "eos_token_id": 7,
            "logit_bias": {"42": 1.5}, "grammar": "root ::= \"a\"", "stream": true,
            "cache": {"a live object": "skipped"},
        }));
        assert_eq!(k.prompt, Some(PromptArg::Ids(vec![1, 2])));
        assert_eq!(k.stop, Some(Stop(vec!["\n".into()])));
        assert_eq!(k.logprobs, Some(Logprobs::Count(3)));
        assert_eq!(k.eos_token_id, Some(TokenIds(vec![7])));
        assert!(k.stream && k.grammar().unwrap().is_some());
        assert_eq!(k.logit_bias().unwrap(), vec![(42, 1.5)]);
        let k = read(
            json!({"prompt": "hi", "stop": ["a", "b"], "logprobs": false,
                            "eos_token_id": [1, 2], "temperature": null}),
        );
        assert_eq!(k.prompt, Some(PromptArg::Text(Text::Str("hi".into()))));
        assert_eq!(k.stop.unwrap().0, ["a", "b"]);
        assert_eq!(k.logprobs, Some(Logprobs::Flag(false)));
        assert_eq!(k.eos_token_id, Some(TokenIds(vec![1, 2])));
        assert_eq!(k.temperature, None);
        for (given, want) in [
            (
                json!({"logprobs": "3"}),
                "expected an int or None, got string \"3\"",
            ),
            (
                json!({"stop": ["a", 1]}),
                "expected a string or a list of strings, got sequence",
            ),
            (
                json!({"grammar": 42}),
                "expected GBNF text (a string) or a LlamaGrammar, got integer `42`",
            ),
            (
                json!({"eos_token_id": -1}),
                "expected a token id (an int >= 0) or a list of them",
            ),
            (
                json!({"response_format": "json"}),
                "expected a dict such as {\"type\": \"json_object\"}",
            ),
            (
                json!({"prompt": 3.5}),
                "expected text (a string, or UTF-8 bytes) or a list of token ids, got floating point `3.5`",
            ),
            (
                json!({"prompt": [1, -2]}),
                "expected token ids (ints >= 0), got integer `-2`",
            ),
            (
                json!({"suffix": [1]}),
                "expected text (a string, or UTF-8 bytes), got sequence",
            ),
            (json!({"prompt": null}), "or a list of token ids, got null"),
            (
                json!({"stream": "false"}),
                "expected a bool, got string \"false\"",
            ),
            (
                json!({"do_sample": 1}),
                "expected a bool or None, got integer `1`",
            ),
        ] {
            let e = refused(given);
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn text_is_checked_for_utf8_and_a_missing_prompt_is_named() {
        let k = Keywords {
            prompt: Some(PromptArg::Text(Text::Bytes(vec![0xff]))),
            suffix: Some(Text::Bytes(b"end".to_vec())),
            ..Keywords::default()
        };
        let e = k.prompt().unwrap_err().to_string();
        assert!(
            e.starts_with("prompt: expected UTF-8 text, got bytes that are not UTF-8"),
            "{e}"
        );
        assert_eq!(k.suffix().unwrap().as_deref(), Some("end"));
        let e = Keywords::default().prompt().unwrap_err().to_string();
        assert_eq!(e, "prompt: expected text or token ids, got nothing");
    }

    #[test]
    fn sampling_takes_each_keyword_given_over_the_defaults() {
        let s = read(json!({"temperature": 0.1, "top_k": 5, "seed": 9, "top_p": null}));
        let s = s.sampling().unwrap();
        assert_eq!(
            (s.temperature, s.top_k, s.seed),
            (0.1, 5, Some(Seed::Fixed(9)))
        );
        assert_eq!(
            read(json!({"seed": -1})).sampling().unwrap().seed,
            Some(Seed::Random)
        );
        let e = read(json!({"seed": -2}))
            .sampling()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("seed") && e.contains("-1 for a random seed"),
            "{e}"
        );
        assert_eq!(s.top_p, Sampling::default().top_p);
        assert_eq!(Keywords::default().sampling().unwrap(), Sampling::default());
    }

    #[test]
    fn do_sample_picks_transformers_defaults_and_false_is_greedy() {
        // transformers' GenerationConfig: temperature 1.0, top_k 50, top_p 1.0.
        let s = |v: Value| read(v).generate(3).unwrap().sampling;
        let t = s(json!({"do_sample": true}));
        assert_eq!(
            (t.temperature, t.top_k, t.top_p, t.min_p),
            (1.0, 50, 1.0, 0.0)
        );
        assert_eq!(
            s(json!({"do_sample": false, "temperature": 0.7})).temperature,
            0.0
        );
        // Without do_sample: llama.cpp's truncations, greedy unless a temperature is given.
        let t = s(json!({}));
        assert_eq!(
            (t.temperature, t.top_k, t.top_p, t.min_p),
            (0.0, 40, 0.95, 0.05)
        );
        let t = s(json!({"temperature": 0.5, "top_k": 7}));
        assert_eq!((t.temperature, t.top_k), (0.5, 7));
    }

    #[test]
    fn minimum_lengths_are_read_in_both_words() {
        let min = |v: Value| read(v).completion().map(|r| r.min_tokens);
        assert_eq!(min(json!({"min_tokens": 5, "max_tokens": 8})).unwrap(), 5);
        // above the budget it is taken, and the budget wins (llama-cpp-python)
        assert_eq!(min(json!({"min_tokens": 50, "max_tokens": 8})).unwrap(), 50);
        assert_eq!(min(json!({})).unwrap(), 0);
        let e = min(json!({"min_tokens": -1})).unwrap_err().to_string();
        assert_eq!(e, "min_tokens: expected 0 or more, got -1");
        let chat = read(json!({"min_tokens": 3})).chat().unwrap();
        assert_eq!(chat.min_tokens, 3);
        // transformers' words: min_new_tokens, or min_length counting the prompt
        let new = |v: Value, prompt| read(v).generate(prompt).map(|r| r.min_tokens);
        assert_eq!(new(json!({"min_new_tokens": 3}), 5).unwrap(), 3);
        assert_eq!(new(json!({"min_length": 7}), 5).unwrap(), 2);
        assert_eq!(new(json!({"min_length": 3}), 5).unwrap(), 0);
        let e = new(json!({"min_length": -2}), 5).unwrap_err().to_string();
        assert_eq!(e, "min_length: expected 0 or more, got -2");
    }

    #[test]
    fn max_length_counts_the_prompt_and_max_new_tokens_wins() {
        let budget = |v: Value, prompt| read(v).generate(prompt).map(|r| r.max_tokens);
        assert_eq!(budget(json!({"max_length": 13}), 5).unwrap(), Some(8));
        assert_eq!(
            budget(json!({"max_new_tokens": 4, "max_length": 13}), 5).unwrap(),
            Some(4)
        );
        assert_eq!(budget(json!({}), 5).unwrap(), Some(DEFAULT_NEW_TOKENS));
        let e = budget(json!({"max_length": 5}), 5).unwrap_err().to_string();
        assert!(e.contains("max_length=5 counts the prompt"), "{e}");
        assert!(e.contains("already 5 tokens"), "{e}");
    }

    #[test]
    fn the_two_penalty_names_must_agree_and_many_sequences_are_refused() {
        let penalty = |v: Value| read(v).generate(1).map(|r| r.sampling.repeat_penalty);
        assert_eq!(penalty(json!({"repetition_penalty": 1.5})).unwrap(), 1.5);
        assert_eq!(
            penalty(json!({"repeat_penalty": 1.5, "repetition_penalty": 1.5})).unwrap(),
            1.5
        );
        assert_eq!(penalty(json!({})).unwrap(), 1.0);
        let e = penalty(json!({"repeat_penalty": 1.25, "repetition_penalty": 1.5}));
        assert!(
            e.unwrap_err()
                .to_string()
                .contains("repetition_penalty=1.5")
        );
        let e = read(json!({"num_return_sequences": 2}))
            .generate(1)
            .unwrap_err();
        assert!(matches!(e, EngineError::Unsupported { .. }), "{e}");
        assert!(
            read(json!({"num_return_sequences": 2, "do_sample": true}))
                .generate(1)
                .is_ok()
        );
        let e = read(json!({"num_return_sequences": 0}))
            .generate(1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("num_return_sequences: expected at least 1"),
            "{e}"
        );
        let three = read(json!({"num_return_sequences": 3}));
        assert_eq!(three.sequences(false).unwrap(), 3);
        let e = three.sequences(true).unwrap_err().to_string();
        assert!(e.starts_with("num_return_sequences=3: expected neither stream=True nor cache="));
        let e = read(json!({"num_return_sequences": 3, "stream": true})).sequences(false);
        assert!(e.unwrap_err().to_string().ends_with("got stream=True"));
    }

    #[test]
    fn logit_bias_takes_ints_and_openai_decimal_strings() {
        let got = read(json!({"logit_bias": {" 42 ": -1.0}}))
            .logit_bias()
            .unwrap();
        assert_eq!(got, vec![(42, -1.0)]);
        let k = Keywords {
            logit_bias: Some(IndexMap::from([(BiasKey::Id(198), 100.0)])),
            ..Keywords::default()
        };
        assert_eq!(k.logit_bias().unwrap(), vec![(198, 100.0)]);
        for bad in [
            BiasKey::Id(-1),
            BiasKey::Text("Paris".into()),
            BiasKey::Other("1.5".into()),
        ] {
            let k = Keywords {
                logit_bias: Some(IndexMap::from([(bad, 1.0)])),
                ..Keywords::default()
            };
            let e = k.logit_bias().unwrap_err().to_string();
            assert!(e.starts_with("logit_bias: expected token ids"), "{e}");
        }
    }

    #[test]
    fn logprobs_counts_chat_switches_and_tfs_z_refusals() {
        let completion = |v: Value| read(v).completion().map(|r| r.logprobs);
        assert_eq!(completion(json!({"logprobs": 3})).unwrap(), Some(3));
        assert_eq!(completion(json!({"logprobs": true})).unwrap(), Some(1));
        assert_eq!(completion(json!({"logprobs": false})).unwrap(), None);
        let e = completion(json!({"logprobs": -1})).unwrap_err().to_string();
        assert!(
            e.contains("logprobs: expected a number of alternatives"),
            "{e}"
        );
        let chat = |v: Value| read(v).chat().map(|r| r.logprobs);
        assert_eq!(
            chat(json!({"logprobs": true, "top_logprobs": 2})).unwrap(),
            Some(2)
        );
        assert_eq!(chat(json!({"logprobs": true})).unwrap(), None);
        assert_eq!(chat(json!({"top_logprobs": 2})).unwrap(), None);
        let e = chat(json!({"logprobs": true, "top_logprobs": -1}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("top_logprobs: expected a number of alternatives"),
            "{e}"
        );
        assert!(completion(json!({"tfs_z": 1.0})).is_ok());
        let e = completion(json!({"tfs_z": 0.9})).unwrap_err();
        assert!(matches!(e, EngineError::Unsupported { .. }) && e.to_string().contains("tfs_z"));
        assert!(chat(json!({"tfs_z": 0.5})).is_err());
    }

    #[test]
    fn a_chat_reads_its_tools_and_reply_format_as_json() {
        let k = read(json!({
            "messages": [{"role": "user", "content": "hi"}],
            "functions": [{"name": "f"}], "function_call": {"name": "f"},
            "response_format": {"type": "json_object"},
        }));
        assert_eq!(k.messages.as_ref().map(Vec::len), Some(1));
        let tools = k.tools();
        assert_eq!(
            tools.tools,
            Some(json!([{"type": "function", "function": {"name": "f"}}]))
        );
        assert!(k.response_format().unwrap().is_some());
    }
}

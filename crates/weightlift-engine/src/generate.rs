//! Text generation: a prompt in, sampled tokens and their text out, one step at a time.
//!
//! A [`Generation`] is llama-cpp-python's `create_completion` loop as a state machine, so a
//! caller can pull pieces one by one (a Python iterator, a CLI that prints as it goes) or run it
//! to the end with [`Generation::run`]. Each [`Generation::step`] runs one forward call (the
//! prompt first, then one token), samples with the [`Sampler`], detokenizes with the
//! [`StreamDecoder`] (whole UTF-8 only) and holds back text that could still become a stop
//! string ([`StopMatcher`]).
//!
//! As llama-cpp-python:
//! - generation ends at an end-of-generation token (not emitted, not counted), at a stop string
//!   (cut before it), or after `max_tokens` tokens, which is capped to the room left in the cache
//!   (finish reason `length` either way);
//! - a prompt that does not fit the cache is an error before anything runs;
//! - on the model's own cache, the longest prefix the cache already holds is reused (at least
//!   one prompt token is always run, to get logits).
//!
//! With a [`Grammar`], every token is sampled from those whose text continues it (the grammar's
//! [`Constraint`] masks the rest between the penalties and the rest of the chain, as
//! llama-cpp-python's sampler chain places llama.cpp's grammar sampler), and an
//! end-of-generation token is allowed only where the grammar can end.
//!
//! With `logprobs` set, every sampled token also gets its log-probability and the most likely
//! alternatives ([`logprobs::TokenLogprobs`], from the raw logits as llama-cpp-python reports
//! them); with `prompt_logprobs` the prompt tokens do too, which runs the whole prompt with
//! logits at every position and reuses nothing.
//!
//! With an explicit cache the prompt is appended at its `seq_len` (exllamav2's way of continuing
//! a sequence). A failed step (a device out of memory) ends the generation with the error; the
//! cache keeps the tokens written before it, so model and cache stay usable.

pub mod batch;
pub mod keywords;
pub mod logprobs;
pub mod openai;
pub mod request;
pub mod respond;
pub mod tools;

use std::sync::Arc;
use std::time::Instant;

use weightlift_text::{StreamDecoder, Tokenizer};

use crate::cache::Cache;
use crate::error::{EngineError, Result, invalid};
use crate::forward::Logits;
use crate::grammar::{Constraint, Grammar};
use crate::model::Model;
use crate::sample::{Sampler, SamplingParams, StopMatcher};
use logprobs::TokenLogprobs;

/// Logits a prompt run with `prompt_logprobs` may hold at once (rows × vocabulary): the prompt
/// runs in slices of this many floats' worth of positions, so a long prompt over a large
/// vocabulary never needs its whole `rows × vocab` matrix.
const PROMPT_LOGITS_FLOATS: usize = 1 << 24;

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate at most; `None` until the cache is full (llama-cpp-python's
    /// `max_tokens <= 0` or `None`).
    pub max_tokens: Option<u64>,
    pub sampling: SamplingParams,
    /// Stop strings: the text ends before the first one to appear.
    pub stop: Vec<String>,
    /// Whether an end-of-generation token ends the generation.
    pub stop_at_eog: bool,
    /// Tokens to generate before an end-of-generation token may end the generation
    /// (llama-cpp-python's server's `min_tokens`, transformers' `min_new_tokens`): until then
    /// those tokens are held back from sampling, unless nothing else may come (a grammar that
    /// must end there). A stop string, `max_tokens` or a full cache still ends it sooner, as
    /// there.
    pub min_tokens: u64,
    /// The end-of-generation tokens, in place of the tokenizer's (transformers'
    /// `eos_token_id`); `None` keeps the tokenizer's.
    pub eog_tokens: Option<Vec<u32>>,
    /// Score every sampled token, with this many most likely alternatives per position
    /// (llama-cpp-python's `logprobs`); `None` scores nothing.
    pub logprobs: Option<usize>,
    /// With `logprobs`, score the prompt tokens too (llama-cpp-python's `echo=True`).
    pub prompt_logprobs: bool,
    /// Keep the text inside this grammar (llama-cpp-python's `grammar=`).
    pub grammar: Option<Arc<Grammar>>,
    /// Added to these tokens' logits before every sample (OpenAI's and llama-cpp-python's
    /// `logit_bias`; `-inf` bans a token). Log-probabilities are still of the model's own
    /// logits, as llama-cpp-python reports them.
    pub logit_bias: Vec<(u32, f32)>,
    /// Changes the logits before every sample, after the bias (llama-cpp-python's
    /// `logits_processor`).
    pub logits_hook: Option<Hook<LogitsFn>>,
    /// Ends the generation when it says so, before the token just sampled is kept
    /// (llama-cpp-python's `stopping_criteria`; finish reason `stop`).
    pub stop_hook: Option<Hook<StopFn>>,
}

impl GenerateOptions {
    /// Whether the prompt is scored (`logprobs` with `prompt_logprobs`): it then runs whole,
    /// since reused positions have no logits to score.
    pub fn scores_prompt(&self) -> bool {
        self.logprobs.is_some() && self.prompt_logprobs
    }
}

/// A logits processor: the ids so far (prompt and generated) and the logits to change.
pub type LogitsFn = dyn Fn(&[u32], &mut [f32]) -> Result<()> + Send + Sync;
/// A stopping criterion: the ids so far and the logits the next token was sampled from.
pub type StopFn = dyn Fn(&[u32], &[f32]) -> Result<bool> + Send + Sync;

/// A caller's function in a generation; two are equal when they are the same function.
pub struct Hook<F: ?Sized>(pub Arc<F>);

impl<F: ?Sized> Clone for Hook<F> {
    fn clone(&self) -> Self {
        Hook(Arc::clone(&self.0))
    }
}

impl<F: ?Sized> PartialEq for Hook<F> {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl<F: ?Sized> std::fmt::Debug for Hook<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hook(..)")
    }
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: Some(16),
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            stop_at_eog: true,
            min_tokens: 0,
            eog_tokens: None,
            logprobs: None,
            prompt_logprobs: false,
            grammar: None,
            logit_bias: Vec::new(),
            logits_hook: None,
            stop_hook: None,
        }
    }
}

/// Why a generation ended, as OpenAI's `finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens`, or the cache is full.
    Length,
}

impl FinishReason {
    pub const fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Where the time went, as llama.cpp's `prompt eval` and `eval` lines.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Prompt tokens run (after the reused prefix) and the seconds the forward call took.
    pub prompt_tokens: u64,
    pub prompt_secs: f64,
    /// Prompt tokens whose keys and values the cache already held.
    pub reused_tokens: u64,
    /// Tokens run one at a time after the prompt, and the seconds their forward calls and
    /// sampling took.
    pub eval_tokens: u64,
    pub eval_secs: f64,
    /// Seconds spent sampling, included in neither of the above.
    pub sample_secs: f64,
}

impl Timings {
    /// Tokens per second, 0 when nothing ran.
    pub fn rate(tokens: u64, secs: f64) -> f64 {
        if secs > 0.0 {
            tokens as f64 / secs
        } else {
            0.0
        }
    }
}

/// [`Timings`] as llama.cpp's timing lines and `Model.timings` report them: milliseconds and
/// tokens per second.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TimingsReport {
    pub prompt_tokens: u64,
    pub prompt_ms: f64,
    pub prompt_per_second: f64,
    pub reused_tokens: u64,
    pub eval_tokens: u64,
    pub eval_ms: f64,
    pub eval_per_second: f64,
    pub sample_ms: f64,
}

impl Timings {
    pub fn report(&self) -> TimingsReport {
        TimingsReport {
            prompt_tokens: self.prompt_tokens,
            prompt_ms: self.prompt_secs * 1e3,
            prompt_per_second: Timings::rate(self.prompt_tokens, self.prompt_secs),
            reused_tokens: self.reused_tokens,
            eval_tokens: self.eval_tokens,
            eval_ms: self.eval_secs * 1e3,
            eval_per_second: Timings::rate(self.eval_tokens, self.eval_secs),
            sample_ms: self.sample_secs * 1e3,
        }
    }
}

#[cfg(test)]
mod timings_tests {
    use super::Timings;

    #[test]
    fn a_report_is_in_milliseconds_and_tokens_per_second() {
        let r = Timings {
            prompt_tokens: 10,
            prompt_secs: 0.5,
            reused_tokens: 3,
            eval_tokens: 4,
            eval_secs: 0.0,
            sample_secs: 0.25,
        }
        .report();
        assert_eq!((r.prompt_ms, r.prompt_per_second), (500.0, 20.0));
        assert_eq!((r.eval_ms, r.eval_per_second), (0.0, 0.0));
        assert_eq!((r.reused_tokens, r.sample_ms), (3, 250.0));
    }
}

/// One step's output: the sampled token (none on the final step that only flushes held text),
/// the text that is safe to show now, and the finish reason on the last step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Piece {
    pub token: Option<u32>,
    pub text: String,
    pub finish: Option<FinishReason>,
}

/// A generation in progress. It owns its cache handle and tokenizer, and borrows the model only
/// during a [`Generation::step`].
pub struct Generation {
    tokenizer: Arc<Tokenizer>,
    cache: Arc<Cache>,
    sampler: Sampler,
    /// Where the text is in the grammar, when there is one.
    grammar: Option<Constraint>,
    logit_bias: Vec<(u32, f32)>,
    /// The logits with the bias and the hook applied, sampled in place of `logits` when there
    /// is either.
    biased: Vec<f32>,
    logits_hook: Option<Hook<LogitsFn>>,
    stop_hook: Option<Hook<StopFn>>,
    /// The prompt's ids followed by the sampled ones, kept for the hooks only.
    history: Vec<u32>,
    stops: StopMatcher,
    decoder: StreamDecoder,
    stop_at_eog: bool,
    eog_tokens: Option<Vec<u32>>,
    /// [`GenerateOptions::min_tokens`], and the end-of-generation ids it holds back (sorted).
    min_tokens: u64,
    held_back: Vec<u32>,
    prompt_tokens: u64,
    /// Ids to run next: the unreused prompt, then the last sampled token.
    pending: Vec<u32>,
    /// Sampled tokens (the penalty window, as llama-cpp-python's sampler sees them).
    tokens: Vec<u32>,
    max_tokens: u64,
    logits: Vec<f32>,
    /// Alternatives per scored position, when scoring.
    top_logprobs: Option<usize>,
    /// Whether the first step scores the prompt.
    score_prompt: bool,
    /// One entry per prompt token run (none for the first: nothing here predicted it).
    prompt_logprobs: Vec<Option<TokenLogprobs>>,
    /// One entry per sampled token.
    token_logprobs: Vec<TokenLogprobs>,
    finish: Option<FinishReason>,
    done: bool,
    timings: Timings,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("prompt_tokens", &self.prompt_tokens)
            .field("tokens", &self.tokens.len())
            .field("max_tokens", &self.max_tokens)
            .field("finish", &self.finish)
            .finish_non_exhaustive()
    }
}

impl Generation {
    /// [`Generation::new`] on a model that may have no cache of its own yet: with `cache: None`
    /// the model's own cache is made (or grown) first with room for the prompt and the tokens
    /// asked for ([`weightlift_plan::SEQ_STEP`] of them when the length is open), as
    /// transformers' `generate` sizes its cache.
    pub fn start(
        model: &mut Model,
        prompt: &[u32],
        cache: Option<&Arc<Cache>>,
        options: GenerateOptions,
    ) -> Result<Generation> {
        if cache.is_none() {
            let asked = options.max_tokens.unwrap_or(weightlift_plan::SEQ_STEP);
            model.own_cache_for((prompt.len() as u64).saturating_add(asked))?;
        }
        Generation::new(model, prompt, cache, options)
    }

    /// Start generating from `prompt` ids. `cache: None` uses the model's own cache, reusing the
    /// prefix it holds; a cache given here is appended to.
    pub fn new(
        model: &Model,
        prompt: &[u32],
        cache: Option<&Arc<Cache>>,
        options: GenerateOptions,
    ) -> Result<Generation> {
        match cache {
            Some(c) => Generation::begin(model, prompt, Arc::clone(c), false, options),
            None => Generation::begin(model, prompt, model.own_cache()?, true, options),
        }
    }

    /// [`Generation::new`] in `cache`, reusing the prefix of `prompt` it already holds as the
    /// model's own cache is reused: a slot that served an earlier request
    /// ([`batch::Batch`]).
    pub fn in_slot(
        model: &Model,
        prompt: &[u32],
        cache: &Arc<Cache>,
        options: GenerateOptions,
    ) -> Result<Generation> {
        Generation::begin(model, prompt, Arc::clone(cache), true, options)
    }

    /// Start in `cache`; `reuse` keeps the prefix of `prompt` it holds, else the prompt is
    /// appended at its `seq_len`.
    fn begin(
        model: &Model,
        prompt: &[u32],
        cache: Arc<Cache>,
        reuse: bool,
        options: GenerateOptions,
    ) -> Result<Generation> {
        let tokenizer = model.tokenizer()?;
        let sampler = Sampler::new(options.sampling)?;
        let vocab = model.vocab_size()?;
        crate::forward::check_ids(prompt, vocab)?;
        check_bias(&options.logit_bias, vocab)?;
        if let Some(ids) = &options.eog_tokens {
            crate::forward::check_ids(ids, vocab)?;
        }
        let max_seq_len = cache.config().max_seq_len;
        let score_prompt = options.scores_prompt();
        let held = if reuse && score_prompt {
            // Reused positions have no logits to score.
            0
        } else if reuse {
            // at least the last token runs, for its logits
            cache.common_prefix_under(&prompt[..prompt.len() - 1], model.kv_settings())
        } else {
            cache.seq_len()
        };
        let start = if reuse { 0 } else { held };
        let end = start + prompt.len() as u64;
        if end > max_seq_len {
            return Err(EngineError::ContextFull {
                tokens: prompt.len() as u64,
                held: start,
                max_seq_len,
            });
        }
        // Sampled token i (from 1) needs position end + i - 2 for its successor's forward call;
        // the last one is never run, so the room is one more than the free positions.
        let room = max_seq_len - end + 1;
        if reuse {
            cache.set_seq_len(held)?;
        }
        let max_tokens = options
            .max_tokens
            .filter(|&n| n > 0)
            .map_or(room, |n| n.min(room));
        let pending = if reuse {
            prompt[held as usize..].to_vec()
        } else {
            prompt.to_vec()
        };
        let held_back = if options.min_tokens > 0 && options.stop_at_eog {
            let mut ids = match &options.eog_tokens {
                Some(ids) => ids.clone(),
                None => tokenizer.eog_ids().to_vec(),
            };
            ids.sort_unstable();
            ids.dedup();
            ids
        } else {
            Vec::new()
        };
        let grammar = match options.grammar {
            Some(g) => Some(Constraint::new(
                g,
                &tokenizer,
                usize::try_from(vocab).unwrap_or(usize::MAX),
            )?),
            None => None,
        };
        Ok(Generation {
            decoder: tokenizer.stream(true),
            grammar,
            logit_bias: options.logit_bias,
            biased: Vec::new(),
            history: if options.logits_hook.is_some() || options.stop_hook.is_some() {
                prompt.to_vec()
            } else {
                Vec::new()
            },
            logits_hook: options.logits_hook,
            stop_hook: options.stop_hook,
            tokenizer,
            cache,
            sampler,
            stops: StopMatcher::new(options.stop),
            stop_at_eog: options.stop_at_eog,
            min_tokens: options.min_tokens,
            held_back,
            eog_tokens: options.eog_tokens,
            prompt_tokens: prompt.len() as u64,
            pending,
            tokens: Vec::new(),
            max_tokens,
            logits: Vec::new(),
            top_logprobs: options.logprobs,
            score_prompt,
            prompt_logprobs: Vec::new(),
            token_logprobs: Vec::new(),
            finish: None,
            done: false,
            timings: Timings {
                reused_tokens: if reuse { held } else { 0 },
                ..Timings::default()
            },
        })
    }

    /// What this step does before sampling.
    fn next(&mut self) -> Next {
        if self.done {
            return Next::Done;
        }
        if self.finish.is_none() && self.tokens.len() as u64 >= self.max_tokens {
            self.finish = Some(FinishReason::Length);
        }
        if let Some(reason) = self.finish {
            return Next::Flush(reason);
        }
        match self.top_logprobs {
            Some(n) if self.tokens.is_empty() && self.score_prompt => Next::Scored(n),
            _ => Next::Forward,
        }
    }

    /// The next piece, or `None` once the final piece (the one with a finish reason) was
    /// returned.
    pub fn step(&mut self, model: &mut Model) -> Result<Option<Piece>> {
        let t0 = Instant::now();
        let ran = match self.next() {
            Next::Done => return Ok(None),
            Next::Flush(reason) => return Ok(Some(self.flush(reason))),
            Next::Scored(n) => self.run_scored_prompt(model, n),
            Next::Forward => model
                .forward(
                    &self.pending,
                    Some(&self.cache),
                    Logits::Last,
                    &mut self.logits,
                )
                .map(|_| ()),
        };
        if let Err(e) = ran {
            self.done = true;
            return Err(e);
        }
        self.sampled(t0.elapsed().as_secs_f64())
    }

    /// The rest of a step once its forward call left the logits (it took `ran` seconds):
    /// sample, check the end, detokenize.
    fn sampled(&mut self, ran: f64) -> Result<Option<Piece>> {
        let first = self.tokens.is_empty();
        let t1 = Instant::now();
        let token = match self.sample() {
            Ok(t) => t,
            Err(e) => {
                self.done = true;
                return Err(e);
            }
        };
        let t2 = Instant::now();
        if first {
            self.timings.prompt_tokens = self.pending.len() as u64;
            self.timings.prompt_secs = ran;
        } else {
            self.timings.eval_tokens += 1;
            self.timings.eval_secs += ran;
        }
        self.timings.sample_secs += t2.duration_since(t1).as_secs_f64();

        let eog = match &self.eog_tokens {
            Some(ids) => ids.contains(&token),
            None => self.tokenizer.is_eog(token),
        };
        if self.stop_at_eog && eog {
            return Ok(Some(self.flush(FinishReason::Stop)));
        }
        if let Some(Hook(stop)) = &self.stop_hook {
            match stop(&self.history, &self.logits) {
                Ok(true) => return Ok(Some(self.flush(FinishReason::Stop))),
                Ok(false) => {}
                Err(e) => {
                    self.done = true;
                    return Err(e);
                }
            }
        }
        if !self.history.is_empty() {
            self.history.push(token);
        }
        if let Some(n) = self.top_logprobs {
            let t = Instant::now();
            self.token_logprobs
                .push(TokenLogprobs::of(&self.logits, token, n));
            self.timings.sample_secs += t.elapsed().as_secs_f64();
        }
        self.tokens.push(token);
        self.pending.clear();
        self.pending.push(token);
        let text = self.decoder.push(&self.tokenizer, token)?;
        let (text, stopped) = self.stops.push(&text);
        if stopped {
            self.done = true;
            self.finish = Some(FinishReason::Stop);
            return Ok(Some(Piece {
                token: Some(token),
                text,
                finish: self.finish,
            }));
        }
        Ok(Some(Piece {
            token: Some(token),
            text,
            finish: None,
        }))
    }

    /// The next token from the last logits: through the grammar when there is one, which then
    /// moves past it.
    fn sample(&mut self) -> Result<u32> {
        let logits = if self.logit_bias.is_empty() && self.logits_hook.is_none() {
            &self.logits
        } else {
            self.biased.clone_from(&self.logits);
            for &(t, b) in &self.logit_bias {
                self.biased[t as usize] += b;
            }
            if let Some(Hook(f)) = &self.logits_hook {
                f(&self.history, &mut self.biased)?;
            }
            &self.biased
        };
        // the end-of-generation ids min_tokens still holds back
        let early = (self.tokens.len() as u64) < self.min_tokens;
        let held: &[u32] = if early { &self.held_back } else { &[] };
        let Some(grammar) = &mut self.grammar else {
            if held.is_empty() {
                return Ok(self.sampler.sample(logits, &self.tokens));
            }
            return self.sampler.sample_masked(logits, &self.tokens, |logits| {
                hold_back(logits, held);
                Ok(())
            });
        };
        let token = self.sampler.sample_masked(logits, &self.tokens, |logits| {
            grammar.mask(logits)?;
            hold_back(logits, held);
            Ok(())
        })?;
        grammar.accept(token)?;
        Ok(token)
    }

    /// Run to the end, handing every piece to `on_piece`; it returns `false` to stop early (the
    /// finish reason is then `Stop`). Returns the whole text.
    pub fn run(
        &mut self,
        model: &mut Model,
        mut on_piece: impl FnMut(&Piece) -> bool,
    ) -> Result<String> {
        let mut text = String::new();
        while let Some(piece) = self.step(model)? {
            text.push_str(&piece.text);
            if !on_piece(&piece) && !self.done {
                self.finish = Some(FinishReason::Stop);
            }
        }
        Ok(text)
    }

    /// Run the prompt with logits at every position, in slices that bound the logits held, and
    /// score each prompt token against the row before it; the last row is left for sampling.
    fn run_scored_prompt(&mut self, model: &mut Model, n: usize) -> Result<()> {
        let vocab = usize::try_from(model.vocab_size()?)
            .unwrap_or(usize::MAX)
            .max(1);
        let rows_per_call = (PROMPT_LOGITS_FLOATS / vocab).max(1);
        let mut rows = Vec::new();
        self.prompt_logprobs.clear();
        self.prompt_logprobs.push(None);
        let prompt = &self.pending;
        for (c, slice) in prompt.chunks(rows_per_call).enumerate() {
            model.forward(slice, Some(&self.cache), Logits::All, &mut rows)?;
            for (r, row) in rows.chunks_exact(vocab).enumerate() {
                let next = c * rows_per_call + r + 1;
                match prompt.get(next) {
                    Some(&t) => self
                        .prompt_logprobs
                        .push(Some(TokenLogprobs::of(row, t, n))),
                    None => {
                        self.logits.clear();
                        self.logits.extend_from_slice(row);
                    }
                }
            }
        }
        Ok(())
    }

    /// The final piece: text the decoder and the stop matcher still hold.
    fn flush(&mut self, reason: FinishReason) -> Piece {
        self.done = true;
        self.finish = Some(reason);
        let tail = self.decoder.finish();
        let (mut text, stopped) = self.stops.push(&tail);
        if stopped {
            self.finish = Some(FinishReason::Stop);
        } else {
            let stops = std::mem::replace(&mut self.stops, StopMatcher::new(Vec::<String>::new()));
            text.push_str(&stops.finish());
        }
        Piece {
            token: None,
            text,
            finish: self.finish,
        }
    }

    /// Tokens sampled so far (without a final end-of-generation token).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The log-probabilities of the sampled tokens, one per token of [`Generation::tokens`]
    /// (empty unless `logprobs` was asked for).
    pub fn token_logprobs(&self) -> &[TokenLogprobs] {
        &self.token_logprobs
    }

    /// The log-probabilities of the prompt tokens, one per prompt token, the first `None`
    /// (empty unless `logprobs` and `prompt_logprobs` were asked for, and until the first step).
    pub fn prompt_logprobs(&self) -> &[Option<TokenLogprobs>] {
        &self.prompt_logprobs
    }

    /// Tokens in the prompt (reused ones included).
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens
    }

    /// The most tokens this generation can produce.
    pub fn max_tokens(&self) -> u64 {
        self.max_tokens
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    pub fn timings(&self) -> Timings {
        self.timings
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }
}

/// What a step does before sampling.
enum Next {
    /// Nothing: the final piece was returned.
    Done,
    /// Return the final piece, for this reason.
    Flush(FinishReason),
    /// Run the pending ids for the last position's logits.
    Forward,
    /// Run the prompt with logits at every position, scoring it with this many alternatives.
    Scored(usize),
}

/// One step of each of several generations, their forward calls as one
/// [`Model::forward_batch`]: the step of continuous batching. A new generation's prompt and the
/// others' last tokens run together; a finished generation returns its final piece (or `None`
/// after it) and takes no part. A generation that scores its prompt runs that step alone (it
/// needs every position's logits). Each generation keeps its own sampler, stops and grammar, so
/// its tokens are those it samples alone from the same logits.
///
/// Each entry of the answer is that generation's [`Generation::step`]. When the batch's forward
/// call fails (a device out of memory), every generation in it ends and the error is returned;
/// their caches keep what was written before it.
pub fn step_batch(
    model: &mut Model,
    gens: &mut [&mut Generation],
) -> Result<Vec<Result<Option<Piece>>>> {
    let mut out: Vec<Option<Result<Option<Piece>>>> = Vec::with_capacity(gens.len());
    let mut batch = Vec::new();
    for (i, g) in gens.iter_mut().enumerate() {
        out.push(match g.next() {
            Next::Done => Some(Ok(None)),
            Next::Flush(reason) => Some(Ok(Some(g.flush(reason)))),
            Next::Scored(_) => Some(g.step(model)),
            Next::Forward => {
                batch.push(i);
                None
            }
        });
    }
    if !batch.is_empty() {
        let t0 = Instant::now();
        let mut rows = Vec::new();
        let seqs: Vec<(&Arc<Cache>, &[u32])> = batch
            .iter()
            .map(|&i| (&gens[i].cache, gens[i].pending.as_slice()))
            .collect();
        let ran = model.forward_batch(&seqs, &mut rows);
        let secs = t0.elapsed().as_secs_f64();
        if let Err(e) = ran {
            for &i in &batch {
                gens[i].done = true;
            }
            return Err(e);
        }
        let vocab = rows.len() / batch.len();
        for (&i, row) in batch.iter().zip(rows.chunks_exact(vocab)) {
            let g = &mut *gens[i];
            g.logits.clear();
            g.logits.extend_from_slice(row);
            out[i] = Some(g.sampled(secs));
        }
    }
    Ok(out.into_iter().map(|r| r.unwrap_or(Ok(None))).collect())
}

impl Model {
    /// The ids of a text prompt: special tokens in it are parsed (as llama-cpp-python's
    /// `create_completion` does), and BOS follows `add_bos`, or the tokenizer when `None`.
    pub fn prompt_ids(&self, text: &str, add_bos: Option<bool>) -> Result<Vec<u32>> {
        Ok(self.tokenizer()?.encode(text, add_bos, true)?)
    }

    /// The prompt of a fill-in-the-middle completion of the text between `prefix` and
    /// `suffix`, as llama.cpp lays it out: BOS (when the tokenizer adds one), then the prefix
    /// token and the prefix, the suffix token and the suffix, and the middle token
    /// (`spm`: suffix part first). `None` when the vocabulary has no FIM tokens: the caller then
    /// completes `prefix` alone and puts `suffix` after the text, as llama-cpp-python does.
    pub fn infill_prompt(&self, prefix: &str, suffix: &str, spm: bool) -> Result<Option<Vec<u32>>> {
        let tok = self.tokenizer()?;
        let Some(fim) = tok.fim() else {
            return Ok(None);
        };
        let mut pre = vec![fim.prefix];
        pre.extend(tok.encode(prefix, Some(false), false)?);
        let mut suf = vec![fim.suffix];
        suf.extend(tok.encode(suffix, Some(false), false)?);
        let mut ids: Vec<u32> = tok.bos_id().filter(|_| tok.add_bos()).into_iter().collect();
        if spm {
            ids.extend(suf.into_iter().chain(pre));
        } else {
            ids.extend(pre.into_iter().chain(suf));
        }
        ids.push(fim.middle);
        Ok(Some(ids))
    }

    /// The prompt of a completion of the text between `prefix` and `suffix`
    /// (llama-cpp-python's `suffix=`): the fill-in-the-middle prompt ([`Model::infill_prompt`])
    /// where the vocabulary has FIM tokens; else the completion prompt of `prefix`, with
    /// `suffix` handed back to be put after the generated text, as llama-cpp-python does.
    pub fn suffixed_prompt(
        &self,
        prefix: &str,
        suffix: &str,
        spm: bool,
    ) -> Result<(Vec<u32>, Option<String>)> {
        Ok(match self.infill_prompt(prefix, suffix, spm)? {
            Some(ids) => (ids, None),
            None => (self.completion_prompt(prefix)?, Some(suffix.to_owned())),
        })
    }

    /// The prompt ids of a text completion: [`Model::prompt_ids`], except that an empty prompt
    /// is BOS alone, as llama-cpp-python runs it.
    pub fn completion_prompt(&self, text: &str) -> Result<Vec<u32>> {
        if text.is_empty() {
            return Ok(self.tokenizer()?.bos_id().into_iter().collect());
        }
        self.prompt_ids(text, None)
    }

    /// The prompt ids for a chat: the model's chat template rendered with `messages` and the
    /// generation prompt, tokenized with special tokens parsed and no BOS added beyond what the
    /// template writes (llama-cpp-python's `Jinja2ChatFormatter` path); with a built-in chat
    /// format, BOS by the vocabulary's rule (llama-cpp-python's formatter path).
    pub fn chat_prompt(&self, messages: &[weightlift_text::Message]) -> Result<Vec<u32>> {
        self.chat_prompt_with(messages, &weightlift_text::ChatTools::default())
    }

    /// [`Model::chat_prompt`] with the request's `tools` and `tool_choice` for the template.
    pub fn chat_prompt_with(
        &self,
        messages: &[weightlift_text::Message],
        tools: &weightlift_text::ChatTools,
    ) -> Result<Vec<u32>> {
        let template = self
            .chat_template()?
            .ok_or_else(|| EngineError::Unsupported {
                what: "a chat completion with this model".into(),
                detail: "its checkpoint has no chat template (tokenizer.chat_template); name \
                     a built-in chat format (chat_format=, or --chat-format on the command \
                     line: chatml, llama-2, llama-3, ...) or use create_completion with a \
                     prompt you format yourself"
                    .into(),
            })?;
        let text = template.render_with(messages, true, tools)?;
        let bos = if self.chat_format().is_some() {
            None
        } else {
            Some(false)
        };
        self.prompt_ids(&text, bos)
    }
}

/// Sets the logits of `ids` (sorted) to −inf, unless no other token could then be sampled (a
/// grammar that must end here, a bias that banned the rest): the end may then come.
fn hold_back(logits: &mut [f32], ids: &[u32]) {
    if ids.is_empty() {
        return;
    }
    let other = logits.iter().enumerate().any(|(i, &v)| {
        v != f32::NEG_INFINITY && u32::try_from(i).map_or(true, |i| ids.binary_search(&i).is_err())
    });
    if other {
        for &id in ids {
            if let Some(v) = logits.get_mut(id as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}

/// Every biased token is in the vocabulary and every bias is a number (`-inf` bans a token).
fn check_bias(bias: &[(u32, f32)], vocab: u64) -> Result<()> {
    for &(t, b) in bias {
        if u64::from(t) >= vocab {
            return Err(invalid(
                "logit_bias",
                format!("token ids below the vocabulary size {vocab}"),
                t,
            ));
        }
        if b.is_nan() || b == f32::INFINITY {
            return Err(invalid(
                format!("logit_bias[{t}]"),
                "a finite number, or -inf to ban the token",
                b,
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod hold_back_tests {
    use super::hold_back;

    const NO: f32 = f32::NEG_INFINITY;

    #[test]
    fn the_held_ids_are_banned_unless_nothing_else_could_come() {
        let mut logits = [0.5, 2.0, -1.0, 3.0];
        hold_back(&mut logits, &[1, 3]);
        assert_eq!(logits, [0.5, NO, -1.0, NO]);
        // a grammar that allows only the end: it stays
        let mut only_end = [NO, 2.0, NO, NO];
        hold_back(&mut only_end, &[1, 3]);
        assert_eq!(only_end, [NO, 2.0, NO, NO]);
        let mut untouched = [1.0, 2.0];
        hold_back(&mut untouched, &[]);
        assert_eq!(untouched, [1.0, 2.0]);
    }
}

//! A [`Generation`]'s output as llama-cpp-python's `create_completion` and
//! `create_chat_completion` return it: a whole [`Response`] at the end, or one chunk per step
//! of a stream ([`Responder`]).
//!
//! Log-probabilities are listed as llama-cpp-python lists them: a token's text is its own bytes
//! with invalid UTF-8 dropped (special tokens empty), `text_offset` counts the characters of
//! the listed tokens before it, and the alternatives are keyed by their text (a later token
//! with the same text overwrites the value but keeps the first one's place; the chosen token is
//! added last). BOS is never listed, and with `echo` the first echoed token is unscored.
//!
//! With a `tool` (a forced `tool_choice`), the generated text is that tool's arguments, and the
//! message is a tool call (`content` null, `finish_reason` `"tool_calls"`), as
//! llama-cpp-python's chat handlers return it.

use std::sync::Arc;

use indexmap::IndexMap;
use weightlift_text::Tokenizer;

use super::logprobs::{TextOffsets, TokenLogprobs, text_ignoring_invalid};
use super::openai::{
    ChatChoice, ChatCompletion, ChatLogprobs, ChatMessage, Completion, CompletionChoice,
    CompletionLogprobs, Delta, Field, FunctionCall, Response, ToolCall, Usage,
};
use super::{FinishReason, Generation, Piece};
use crate::error::Result;

/// Which object a response is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `text_completion`.
    Completion,
    /// `chat.completion`.
    Chat,
}

/// What a response says besides the generation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResponseOptions {
    /// The `model` field.
    pub model: String,
    /// `echo=True`: the prompt's text, put before the generated text.
    pub echo: Option<String>,
    /// Characters of the prompt's text: where `text_offset` starts when it is not echoed.
    pub prompt_chars: usize,
    /// The prompt's ids, when its tokens are scored (a whole completion with `echo` and
    /// `logprobs`).
    pub prompt_ids: Vec<u32>,
    /// A chat answering by calling this tool.
    pub tool: Option<String>,
    /// Text put after the generated text (`suffix=` on a model without fill-in-the-middle
    /// tokens, as llama-cpp-python does).
    pub append: Option<String>,
}

impl ResponseOptions {
    /// A completion's options for `prompt`, named `model`: with `echo` the prompt's text goes
    /// before the generated text, and without it `text_offset`s start after that text. A whole
    /// completion with `echo` and log-probabilities scores the prompt's tokens too (this sets
    /// `generate.prompt_logprobs`); a stream sends the echoed prompt as its first chunk before
    /// anything runs, so its tokens are not scored there (llama-cpp-python does not echo a
    /// stream at all).
    pub fn completion(
        tokenizer: &Tokenizer,
        prompt: &[u32],
        model: String,
        echo: bool,
        stream: bool,
        generate: &mut super::GenerateOptions,
    ) -> Result<ResponseOptions> {
        let text = tokenizer.decode(prompt, true)?;
        generate.prompt_logprobs = generate.logprobs.is_some() && echo && !stream;
        Ok(ResponseOptions {
            model,
            prompt_chars: text.chars().count(),
            echo: echo.then_some(text),
            prompt_ids: if generate.prompt_logprobs {
                prompt.to_vec()
            } else {
                Vec::new()
            },
            ..ResponseOptions::default()
        })
    }
}

impl crate::Model {
    /// What a response of `kind` to `prompt` says besides the generation: named `name`, or
    /// without one by the model's path (llama-cpp-python names responses by its
    /// `model_path`); a completion's echo and offsets as [`ResponseOptions::completion`] sets
    /// them (and `generate`'s prompt scoring with them).
    pub fn response_options(
        &self,
        kind: Kind,
        name: Option<String>,
        prompt: &[u32],
        echo: bool,
        stream: bool,
        generate: &mut super::GenerateOptions,
    ) -> Result<ResponseOptions> {
        let model = name.unwrap_or_else(|| self.source().path().display().to_string());
        match kind {
            Kind::Completion => {
                let tok = self.tokenizer()?;
                ResponseOptions::completion(&tok, prompt, model, echo, stream, generate)
            }
            Kind::Chat => Ok(ResponseOptions {
                model,
                ..ResponseOptions::default()
            }),
        }
    }
}

/// Builds the response of one generation: the whole of it, or its stream chunk by chunk.
#[derive(Debug)]
pub struct Responder {
    kind: Kind,
    id: String,
    created: u64,
    options: ResponseOptions,
    /// With log-probabilities, while streaming: names and places each token.
    lister: Option<Lister>,
    /// The opening chunk (the chat role, or the echoed prompt) is still to be sent.
    opening: bool,
    /// A finish reason held for a closing chunk of its own.
    closing: Option<&'static str>,
}

impl Responder {
    /// A responder for `job`, whose options say whether it scores tokens.
    pub fn new(kind: Kind, job: &Generation, options: ResponseOptions) -> Responder {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let base = options
            .echo
            .as_ref()
            .map_or(options.prompt_chars, |e| e.chars().count());
        let lister = job
            .top_logprobs
            .is_some()
            .then(|| Lister::new(Arc::clone(job.tokenizer()), base));
        Responder {
            kind,
            id: random_hex(),
            created,
            options,
            lister,
            opening: true,
            closing: None,
        }
    }

    fn id(&self) -> String {
        match self.kind {
            Kind::Chat => format!("chatcmpl-{}", self.id),
            Kind::Completion => format!("cmpl-{}", self.id),
        }
    }

    fn tool_call(&self, name: &str, arguments: String, index: Option<u32>) -> ToolCall {
        ToolCall {
            index,
            id: format!("call__0_{name}_cmpl-{}", self.id),
            kind: "function",
            function: FunctionCall {
                name: name.to_owned(),
                arguments,
            },
        }
    }

    /// The whole response of a finished `job` whose pieces' text was `text`.
    pub fn whole(&self, job: &Generation, text: &str) -> Result<Response> {
        let usage = Some(Usage::new(job.prompt_tokens(), job.tokens().len() as u64));
        let logprobs = match &self.lister {
            Some(_) => Some(self.whole_logprobs(job)?),
            None => None,
        };
        let finish = job.finish_reason().map(FinishReason::name);
        Ok(match self.kind {
            Kind::Completion => Response::Completion(Completion {
                id: self.id(),
                object: "text_completion",
                created: self.created,
                model: self.options.model.clone(),
                choices: vec![CompletionChoice {
                    text: self.options.echo.clone().unwrap_or_default()
                        + text
                        + self.options.append.as_deref().unwrap_or_default(),
                    index: 0,
                    logprobs,
                    finish_reason: finish,
                }],
                usage,
            }),
            Kind::Chat => {
                let (message, finish) = match &self.options.tool {
                    Some(name) => {
                        let call = FunctionCall {
                            name: name.clone(),
                            arguments: text.to_owned(),
                        };
                        let message = ChatMessage {
                            role: "assistant",
                            content: None,
                            function_call: Some(call),
                            tool_calls: Some(vec![self.tool_call(name, text.to_owned(), None)]),
                        };
                        (message, Some("tool_calls"))
                    }
                    None => (
                        ChatMessage {
                            role: "assistant",
                            content: Some(text.to_owned()),
                            function_call: None,
                            tool_calls: None,
                        },
                        finish,
                    ),
                };
                Response::Chat(ChatCompletion {
                    id: self.id(),
                    object: "chat.completion",
                    created: self.created,
                    model: self.options.model.clone(),
                    choices: vec![ChatChoice {
                        message: Some(message),
                        delta: None,
                        index: 0,
                        logprobs: logprobs.as_ref().map(ChatLogprobs::from),
                        finish_reason: finish,
                    }],
                    usage,
                })
            }
        })
    }

    /// A chunk to send before the next step, if one is due: the opening chunk (the chat
    /// role, or the echoed prompt) or a closing one.
    pub fn ready(&mut self) -> Option<Response> {
        if std::mem::take(&mut self.opening) {
            match self.kind {
                Kind::Chat => {
                    let delta = Delta {
                        role: Field::Set("assistant"),
                        ..self.closing_delta()
                    };
                    return Some(self.chat_chunk(delta, None, None));
                }
                Kind::Completion => {
                    if let Some(echo) = self.options.echo.clone().filter(|e| !e.is_empty()) {
                        return Some(self.completion_chunk(echo, None, None));
                    }
                }
            }
        }
        let finish = self.closing.take()?;
        Some(match self.kind {
            Kind::Completion => self.completion_chunk(String::new(), None, Some(finish)),
            Kind::Chat => self.chat_chunk(self.closing_delta(), None, Some(finish)),
        })
    }

    /// The chunk of a step's `piece`, or `None` when it has nothing to send (text held back
    /// and no log-probabilities).
    pub fn chunk(&mut self, job: &Generation, piece: &Piece) -> Result<Option<Response>> {
        // With log-probabilities every token gets its chunk, even one whose text is held back
        // for now (a possible stop string, part of a character).
        let entry = match (&mut self.lister, piece.token) {
            (Some(lister), Some(t)) => {
                let mut one = CompletionLogprobs::default();
                lister.push(&mut one, t, job.token_logprobs().last())?;
                Some(one)
            }
            _ => None,
        };
        let finish = match (&self.options.tool, piece.finish) {
            (Some(_), Some(_)) => Some("tool_calls"),
            (_, f) => f.map(FinishReason::name),
        };
        if piece.text.is_empty() && finish.is_none() && entry.is_none() {
            return Ok(None);
        }
        // As llama-cpp-python: a token's chunk, then a closing chunk with the finish reason and
        // no log-probabilities; a tool call always closes in a chunk of its own.
        let finish = if (entry.is_some() || self.options.tool.is_some()) && finish.is_some() {
            self.closing = finish;
            None
        } else {
            finish
        };
        if self.options.tool.is_some() && piece.text.is_empty() && entry.is_none() {
            return Ok(self.ready());
        }
        let text = piece.text.clone();
        Ok(Some(match self.kind {
            Kind::Completion => self.completion_chunk(text, entry, finish),
            Kind::Chat => {
                let delta = match &self.options.tool {
                    Some(name) => Delta {
                        function_call: Field::Set(FunctionCall {
                            name: name.clone(),
                            arguments: text.clone(),
                        }),
                        tool_calls: Field::Set(vec![self.tool_call(name, text, Some(0))]),
                        ..self.closing_delta()
                    },
                    // A token's chunk keeps its (empty) content; the closing chunk is `{}`.
                    None if text.is_empty() && entry.is_none() => Delta::default(),
                    None => Delta {
                        content: Field::Set(text),
                        ..Delta::default()
                    },
                };
                self.chat_chunk(delta, entry.as_ref().map(ChatLogprobs::from), finish)
            }
        }))
    }

    /// The delta with nothing in it: `{}` for text, every field null for a tool call (as
    /// llama-cpp-python writes a tool call's chunks).
    fn closing_delta(&self) -> Delta {
        match self.options.tool {
            Some(_) => Delta {
                role: Field::Null,
                content: Field::Null,
                function_call: Field::Null,
                tool_calls: Field::Null,
            },
            None => Delta::default(),
        }
    }

    fn completion_chunk(
        &self,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish: Option<&'static str>,
    ) -> Response {
        Response::Completion(Completion {
            id: self.id(),
            object: "text_completion",
            created: self.created,
            model: self.options.model.clone(),
            choices: vec![CompletionChoice {
                text,
                index: 0,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
        })
    }

    fn chat_chunk(
        &self,
        delta: Delta,
        logprobs: Option<ChatLogprobs>,
        finish: Option<&'static str>,
    ) -> Response {
        Response::Chat(ChatCompletion {
            id: self.id(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.options.model.clone(),
            choices: vec![ChatChoice {
                message: None,
                delta: Some(delta),
                index: 0,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
        })
    }

    /// The log-probabilities of a whole completion: with `echo` the prompt's tokens first
    /// (the first one unscored), then the generated ones.
    fn whole_logprobs(&self, job: &Generation) -> Result<CompletionLogprobs> {
        let echo = self.options.echo.is_some();
        let base = if echo { 0 } else { self.options.prompt_chars };
        let mut lister = Lister::new(Arc::clone(job.tokenizer()), base);
        let bos = job.tokenizer().bos_id();
        let scored_prompt = job.prompt_logprobs();
        let prompt_part = self
            .options
            .prompt_ids
            .iter()
            .enumerate()
            .map(|(j, &t)| (t, scored_prompt.get(j).and_then(Option::as_ref)));
        let generated = job
            .tokens()
            .iter()
            .zip(job.token_logprobs())
            .map(|(&t, s)| (t, Some(s)));
        let mut out = CompletionLogprobs::default();
        for (token, scored) in prompt_part.chain(generated) {
            if Some(token) == bos {
                continue;
            }
            // llama-cpp-python writes null for the first echoed token, whatever came before.
            let scored = if echo && out.tokens.is_empty() {
                None
            } else {
                scored
            };
            lister.push(&mut out, token, scored)?;
        }
        Ok(out)
    }
}

/// Names and places tokens for their log-probability entries.
#[derive(Debug)]
struct Lister {
    tokenizer: Arc<Tokenizer>,
    offsets: TextOffsets,
    base: usize,
}

impl Lister {
    fn new(tokenizer: Arc<Tokenizer>, base: usize) -> Lister {
        Lister {
            tokenizer,
            offsets: TextOffsets::new(),
            base,
        }
    }

    fn text(&self, id: u32) -> Result<String> {
        let piece = self.tokenizer.token_piece(id, false)?;
        Ok(text_ignoring_invalid(&piece))
    }

    /// Append `token`'s entry, scored or not (the first token of an echoed prompt).
    fn push(
        &mut self,
        out: &mut CompletionLogprobs,
        token: u32,
        scored: Option<&TokenLogprobs>,
    ) -> Result<()> {
        let piece = self.tokenizer.token_piece(token, false)?;
        let text = text_ignoring_invalid(&piece);
        out.text_offset.push(self.base + self.offsets.chars());
        self.offsets.push(&piece);
        let top = match scored {
            None => None,
            Some(s) => {
                let mut m = IndexMap::new();
                for &(id, logprob) in &s.top {
                    m.insert(self.text(id)?, logprob);
                }
                m.insert(text.clone(), s.logprob);
                Some(m)
            }
        };
        out.tokens.push(text);
        out.token_logprobs.push(scored.map(|s| s.logprob));
        out.top_logprobs.push(top);
        Ok(())
    }
}

/// 32 hex digits for response ids (uniqueness, not secrecy: std's randomly keyed hasher).
fn random_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut out = String::new();
    for i in 0..2u8 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u8(i);
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out
}

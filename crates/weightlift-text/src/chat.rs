//! [`ChatTemplate`]: a model's Jinja chat template rendered with minijinja.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TextError};

/// One chat message: its role and text, and any other fields the caller gave (an assistant's
/// `tool_calls`, a tool result's `tool_call_id` or `name`), which templates that know them read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            extra: serde_json::Map::new(),
        }
    }
}

/// What a chat request offers the model besides its messages: OpenAI's `tools` and
/// `tool_choice`, which templates that support tool use render (llama-cpp-python's
/// `Jinja2ChatFormatter` passes both).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatTools {
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
}

/// A compiled chat template. Rendering passes what llama-cpp-python's `Jinja2ChatFormatter`
/// passes: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools`,
/// `tool_choice`, and the functions `raise_exception(msg)` and `strftime_now(format)`, with
/// `trim_blocks` and `lstrip_blocks` on (as it and transformers set them), Python string
/// methods (`.strip()`, `.startswith()`, ...) and transformers' `tojson` (Python's
/// `json.dumps` layout).
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// `strftime_now`'s time: unix seconds, or `i64::MIN` for the clock.
    now: Arc<AtomicI64>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

fn template_err(stage: &'static str, e: &minijinja::Error) -> TextError {
    let mut detail = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        detail.push_str(": ");
        detail.push_str(&s.to_string());
        src = s.source();
    }
    TextError::Template { stage, detail }
}

impl ChatTemplate {
    /// Compile `source`; a syntax error is [`TextError::Template`].
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_filter("tojson", crate::pyjson::tojson);
        let now = Arc::new(AtomicI64::new(i64::MIN));
        let clock = Arc::clone(&now);
        env.add_function("strftime_now", move |format: String| {
            match clock.load(Ordering::Relaxed) {
                i64::MIN => crate::pyjson::strftime_now(&format),
                t => crate::pyjson::strftime(&format, t),
            }
        });
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| template_err("parse", &e))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            now,
        })
    }

    /// Render `strftime_now` at `unix` seconds (UTC) rather than now: a prompt that does not
    /// change with the day, for a test or a cached prefix.
    pub fn pin_clock(&self, unix: i64) {
        self.now.store(unix, Ordering::Relaxed);
    }

    /// Render `messages`; with `add_generation_prompt` the template opens the assistant's turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &ChatTools::default())
    }

    /// [`ChatTemplate::render`] with `tools` and `tool_choice` (undefined when not given, as
    /// templates test them with `is defined`).
    pub fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: &ChatTools,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| template_err("lookup", &e))?;
        let value = |v: &Option<serde_json::Value>| {
            v.as_ref().map_or(
                minijinja::Value::UNDEFINED,
                minijinja::Value::from_serialize,
            )
        };
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => value(&tools.tools),
            tool_choice => value(&tools.tool_choice),
        })
        .map_err(|e| template_err("render", &e))
    }
}

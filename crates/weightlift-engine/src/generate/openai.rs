//! OpenAI's completion and chat-completion objects, field for field as llama-cpp-python returns
//! them (its `llama_types`), as typed structs that serialise to the same JSON. The Python
//! bindings hand them to Python as dicts and a server writes them as they are.
//!
//! Field order follows llama-cpp-python's dicts; `None` fields it writes as `null` are
//! `Option`s that always serialise, and fields it leaves out are skipped.

use indexmap::IndexMap;
use serde::Serialize;

/// `usage`: the tokens a response took.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

impl Usage {
    pub fn new(prompt_tokens: u64, completion_tokens: u64) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// A `text_completion` response or stream chunk (a chunk has no `usage`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    pub text: String,
    pub index: u32,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// A completion's `logprobs`: one entry per listed token in each list.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub text_offset: Vec<usize>,
    pub token_logprobs: Vec<Option<f64>>,
    /// The most likely tokens at each position keyed by their text (null where unscored).
    pub top_logprobs: Vec<Option<IndexMap<String, f64>>>,
}

/// A `chat.completion` response or `chat.completion.chunk`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    /// A whole response's message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<ChatMessage>,
    /// A chunk's delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta>,
    pub index: u32,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// The assistant's message: text, or a call of a tool (`content` null).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatMessage {
    pub role: &'static str,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub function_call: Option<FunctionCall>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// What a chunk adds to the message. A text chunk carries only the fields it sets (the
/// opening `{"role": "assistant"}`, then `{"content": ...}`, then `{}`); a tool call's chunks
/// carry every field, null where unset, as llama-cpp-python's.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Field::is_absent")]
    pub role: Field<&'static str>,
    #[serde(skip_serializing_if = "Field::is_absent")]
    pub content: Field<String>,
    #[serde(skip_serializing_if = "Field::is_absent")]
    pub function_call: Field<FunctionCall>,
    #[serde(skip_serializing_if = "Field::is_absent")]
    pub tool_calls: Field<Vec<ToolCall>>,
}

/// A delta field: left out, written as null, or set.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Field<T> {
    #[default]
    Absent,
    Null,
    Set(T),
}

impl<T> Field<T> {
    pub fn is_absent(&self) -> bool {
        matches!(self, Field::Absent)
    }
}

impl<T: Serialize> Serialize for Field<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Field::Set(v) => v.serialize(s),
            Field::Absent | Field::Null => s.serialize_none(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolCall {
    /// Set in stream chunks only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

/// A chat's `logprobs`: llama-cpp-python's conversion of the completion's (`bytes` null).
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    pub refusal: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub bytes: Option<Vec<u8>>,
    pub logprob: Option<f64>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f64,
    pub bytes: Option<Vec<u8>>,
}

impl From<&CompletionLogprobs> for ChatLogprobs {
    fn from(c: &CompletionLogprobs) -> ChatLogprobs {
        let content = c
            .tokens
            .iter()
            .zip(&c.token_logprobs)
            .zip(&c.top_logprobs)
            .map(|((token, &logprob), top)| ChatTokenLogprob {
                token: token.clone(),
                bytes: None,
                logprob,
                top_logprobs: top
                    .iter()
                    .flatten()
                    .map(|(t, &l)| TopLogprob {
                        token: t.clone(),
                        logprob: l,
                        bytes: None,
                    })
                    .collect(),
            })
            .collect();
        ChatLogprobs {
            content,
            refusal: None,
        }
    }
}

/// A whole response or a stream chunk, of either kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Response {
    Completion(Completion),
    Chat(ChatCompletion),
}

impl Response {
    /// The JSON text of this response (what a server sends, what the bindings parse).
    pub fn to_json(&self) -> String {
        // Every field is a string, number, bool, list or string-keyed map: this cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// A chat message as OpenAI's JSON (and llama-cpp-python) writes it: `role`, `content` (a
/// string, null, or a list of parts of which only `{"type": "text"}` ones are taken, joined),
/// and its other fields (`tool_calls`, `tool_call_id`, `name`, ...) kept for the chat template.
pub fn chat_message(value: serde_json::Value) -> crate::error::Result<weightlift_text::Message> {
    use crate::error::{EngineError, invalid};
    use serde_json::Value;
    let Value::Object(mut fields) = value else {
        return Err(invalid(
            "messages",
            "a list of dicts",
            "a message that is not one",
        ));
    };
    let role = match fields.remove("role") {
        Some(Value::String(role)) => role,
        other => {
            return Err(invalid(
                "message role",
                "a string ('system', 'user', 'assistant', 'tool')",
                other.map_or("none".into(), |v| v.to_string()),
            ));
        }
    };
    let content = match fields.remove("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text,
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (Some("text"), None) => {}
                    (Some("text"), Some(other)) => {
                        return Err(invalid("message text part", "a string", other.to_string()));
                    }
                    (kind, _) => {
                        return Err(EngineError::Unsupported {
                            what: format!("message content part of type {kind:?}"),
                            detail: "only text parts are".into(),
                        });
                    }
                }
            }
            text
        }
        Some(other) => {
            return Err(invalid(
                "message content",
                "a string or a list of parts",
                other.to_string(),
            ));
        }
    };
    let mut message = weightlift_text::Message::new(role, content);
    // null fields are left out, as Python's `None` was.
    message.extra = fields.into_iter().filter(|(_, v)| !v.is_null()).collect();
    Ok(message)
}

#[cfg(test)]
mod message_tests {
    use serde_json::json;

    use super::chat_message;

    #[test]
    fn messages_take_text_parts_and_keep_their_other_fields() {
        let m = chat_message(json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}))
        .unwrap();
        assert_eq!((m.role.as_str(), m.content.as_str()), ("user", "ab"));
        let m = chat_message(json!({"role": "assistant", "content": null, "name": null,
            "tool_calls": [{"id": "1"}]}))
        .unwrap();
        assert_eq!(m.content, "");
        assert_eq!(m.extra.keys().collect::<Vec<_>>(), ["tool_calls"]);
        let e = chat_message(json!({"role": "user", "content": [{"type": "image_url"}]}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"image_url\"") && e.contains("only text parts"),
            "{e}"
        );
        assert!(chat_message(json!({"content": "x"})).is_err());
        assert!(chat_message(json!("x")).is_err());
    }
}

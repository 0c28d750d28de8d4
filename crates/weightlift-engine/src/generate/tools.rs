//! Tool use in a chat, as llama-cpp-python's chat handlers do it for a model's own template:
//!
//! - the legacy `functions` / `function_call` become `tools` / `tool_choice`;
//! - the template renders `tools` and `tool_choice` (templates that know tool use list them);
//! - a `tool_choice` naming one tool forces a call of it: the reply is constrained to that
//!   tool's `parameters` schema (to any JSON object when the schema cannot be turned into a
//!   grammar, as llama-cpp-python falls back) and returned as a tool call
//!   ([`super::respond::ResponseOptions::tool`]);
//! - with `"auto"`, `"none"` or no choice the reply is text: the model may write a call in its
//!   own format, which is returned as it is (llama-cpp-python does not parse it either).

use std::sync::Arc;

use serde_json::{Value, json};
use weightlift_text::ChatTools;

use super::openai::chat_message;
use crate::error::{Result, invalid};
use crate::grammar::Grammar;
use crate::model::Model;

/// `tools` and `tool_choice` from a request's four fields, llama-cpp-python's conversion of
/// the legacy pair included: `functions` become function tools, and `function_call` (`"none"`,
/// `"auto"` or `{"name": ...}`) the choice.
pub fn chat_tools(
    functions: Option<Value>,
    function_call: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
) -> ChatTools {
    let tools = match functions {
        Some(Value::Array(fs)) => Some(Value::Array(
            fs.into_iter()
                .map(|f| json!({"type": "function", "function": f}))
                .collect(),
        )),
        _ => tools,
    };
    let tool_choice = match function_call {
        Some(Value::String(s)) => Some(Value::String(s)),
        Some(Value::Object(call)) => Some(json!({
            "type": "function",
            "function": {"name": call.get("name").cloned().unwrap_or(Value::Null)},
        })),
        _ => tool_choice,
    };
    ChatTools { tools, tool_choice }
}

/// The tool a request forces (`tool_choice={"type": "function", "function": {"name": ...}}`)
/// and its `parameters` schema; `None` when the choice is `"auto"`, `"none"` or absent.
pub fn forced_tool(tools: &ChatTools) -> Result<Option<(String, Value)>> {
    let Some(Value::Object(choice)) = &tools.tool_choice else {
        return Ok(None);
    };
    let name = choice
        .get("function")
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .ok_or_else(|| {
            invalid(
                "tool_choice",
                "\"auto\", \"none\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                Value::Object(choice.clone()).to_string(),
            )
        })?;
    let listed = tools.tools.as_ref().and_then(Value::as_array);
    let tool = listed.and_then(|ts| {
        ts.iter().find(|t| {
            t.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                == Some(name)
        })
    });
    let Some(tool) = tool else {
        let names: Vec<&str> = listed
            .into_iter()
            .flatten()
            .filter_map(|t| t.get("function")?.get("name")?.as_str())
            .collect();
        return Err(invalid(
            "tool_choice",
            format!("one of the tools given ({})", names.join(", ")),
            format!("'{name}', which is not among them"),
        ));
    };
    let schema = tool
        .get("function")
        .and_then(|f| f.get("parameters"))
        .cloned()
        .unwrap_or_else(|| json!({"type": "object"}));
    Ok(Some((name.to_owned(), schema)))
}

/// The grammar a forced call of a tool with `parameters` keeps its arguments in: the schema's,
/// or, for a schema with a keyword the converter cannot enforce, any JSON object (what
/// llama-cpp-python falls back to, so a tool whose schema says `pattern` still runs).
pub fn tool_grammar(parameters: &Value) -> Result<Arc<Grammar>> {
    match Grammar::from_json_schema(&parameters.to_string()) {
        Ok(g) => Ok(Arc::new(g)),
        Err(crate::grammar::GrammarError::SchemaUnsupported { .. }) => Ok(Grammar::json()),
        Err(e) => Err(e.into()),
    }
}

/// The grammar a chat generates under, as llama-cpp-python picks it: the forced tool's
/// arguments schema ([`tool_grammar`]), else the JSON of `response_format`, else `grammar`.
pub fn chat_grammar(
    forced: Option<&(String, Value)>,
    response_format: Option<Arc<Grammar>>,
    grammar: Option<Arc<Grammar>>,
) -> Result<Option<Arc<Grammar>>> {
    Ok(match (forced, response_format) {
        (Some((_, schema)), _) => Some(tool_grammar(schema)?),
        (None, Some(json)) => Some(json),
        (None, None) => grammar,
    })
}

/// A chat request resolved against a model ([`Model::chat`]).
#[derive(Debug, Clone)]
pub struct Chat {
    /// The rendered template's ids.
    pub prompt: Vec<u32>,
    /// What the reply is kept inside ([`chat_grammar`]).
    pub grammar: Option<Arc<Grammar>>,
    /// The stop string of the model's built-in chat format, which ends the reply beside the
    /// request's own.
    pub stop: Option<&'static str>,
    /// The tool a forced `tool_choice` answers by calling.
    pub tool: Option<String>,
}

impl Model {
    /// A chat of `messages` (OpenAI's message objects) with `tools`, as llama-cpp-python's chat
    /// handlers make it: the template rendered with the tools and a generation prompt, the
    /// grammar of a forced tool, else of `response_format`, else `grammar`, and the built-in
    /// chat format's stop string.
    pub fn chat(
        &self,
        messages: Vec<Value>,
        tools: ChatTools,
        response_format: Option<Arc<Grammar>>,
        grammar: Option<Arc<Grammar>>,
    ) -> Result<Chat> {
        let forced = forced_tool(&tools)?;
        let grammar = chat_grammar(forced.as_ref(), response_format, grammar)?;
        let messages = messages
            .into_iter()
            .map(chat_message)
            .collect::<Result<Vec<_>>>()?;
        Ok(Chat {
            prompt: self.chat_prompt_with(&messages, &tools)?,
            grammar,
            stop: self.chat_stop(),
            tool: forced.map(|(name, _)| name),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forced_tool_beats_a_response_format_which_beats_a_grammar() {
        let given = Arc::new(Grammar::parse("root ::= \"x\"").unwrap());
        let json = Grammar::json();
        let pick = |forced, format: Option<&Arc<Grammar>>| {
            chat_grammar(forced, format.cloned(), Some(Arc::clone(&given))).unwrap()
        };
        assert!(Arc::ptr_eq(&pick(None, None).unwrap(), &given));
        assert!(Arc::ptr_eq(&pick(None, Some(&json)).unwrap(), &json));
        let tool = ("f".to_owned(), json!({"type": "object"}));
        let g = pick(Some(&tool), Some(&json)).unwrap();
        assert!(!Arc::ptr_eq(&g, &json) && !Arc::ptr_eq(&g, &given));
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
    }

    #[test]
    fn legacy_functions_become_tools_and_a_named_call_forces_one() {
        let t = chat_tools(
            Some(json!([{"name": "f", "parameters": {"type": "object"}}])),
            Some(json!({"name": "f"})),
            None,
            None,
        );
        assert_eq!(
            t.tools,
            Some(
                json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
            )
        );
        let (name, schema) = forced_tool(&t).unwrap().unwrap();
        assert_eq!((name.as_str(), schema), ("f", json!({"type": "object"})));
    }

    #[test]
    fn auto_forces_nothing_and_an_unknown_name_is_an_error_listing_the_tools() {
        let auto = chat_tools(None, None, Some(weather()), Some(json!("auto")));
        assert_eq!(forced_tool(&auto).unwrap(), None);
        let bad = chat_tools(
            None,
            None,
            Some(weather()),
            Some(json!({"type": "function", "function": {"name": "nope"}})),
        );
        let e = forced_tool(&bad).unwrap_err().to_string();
        assert!(e.contains("get_weather") && e.contains("'nope'"), "{e}");
    }
}

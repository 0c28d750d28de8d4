//! Chat templates as llama.cpp ships them give the text llama-cpp-python 0.3.36's
//! `Jinja2ChatFormatter` gives (`data/tool_templates.json`, written by `gen_tool_templates.py`
//! with jinja2): those of tool-using models (Qwen2.5, Hermes 3, Llama 3.2, Mistral Nemo, Qwen3)
//! with tools, an assistant's tool call and a tool's result, and those of the families the
//! engine runs (Qwen3, Phi-3.5, Gemma 2, Mixtral's [INST] form in Mistral Nemo's) with turns, a
//! system message and, for Qwen3, an earlier turn's reasoning, which its template drops.

use serde_json::Value;
use weightlift_text::{ChatTemplate, ChatTools, Message};

/// The fixture's `strftime_now` time: 2026-11-28 00:00 UTC.
const FIXTURE_NOW: i64 = 1_795_824_000;

fn messages(v: &Value) -> Vec<Message> {
    serde_json::from_value(v.clone()).expect("messages")
}

#[test]
fn tool_templates_render_as_llama_cpp_python_renders_them() {
    let text = include_str!("data/tool_templates.json");
    let data: Value = serde_json::from_str(text).unwrap();
    let cases = data["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 23);
    for case in cases {
        let name = format!(
            "{} ({})",
            case["template_name"].as_str().unwrap(),
            case["case"].as_str().unwrap()
        );
        let t = ChatTemplate::new(
            case["template"].as_str().unwrap(),
            case["bos_token"].as_str().unwrap(),
            case["eos_token"].as_str().unwrap(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        t.pin_clock(FIXTURE_NOW);
        let some = |k: &str| Some(case[k].clone()).filter(|v| !v.is_null());
        let tools = ChatTools {
            tools: some("tools"),
            tool_choice: some("tool_choice"),
        };
        let got = t
            .render_with(&messages(&case["messages"]), true, &tools)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, case["rendered"].as_str().unwrap(), "{name}");
    }
}

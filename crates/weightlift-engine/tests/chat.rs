//! [`Model::chat`] on the SmolLM2 demo GGUF: the checkpoint's template renders the messages
//! with a generation prompt, a forced tool call brings its name and grammar, and a built-in chat
//! format brings its stop string; and what [`Model::response_options`] names and echoes.

use std::sync::Arc;

use serde_json::json;
use weightlift_engine::generate::respond::Kind;
use weightlift_engine::generate::tools::chat_tools;
use weightlift_engine::grammar::Grammar;
use weightlift_engine::{GenerateOptions, Inventory, Model, Source};
use weightlift_format::{Checkpoint, OpenOptions};
use weightlift_text::ChatTools;

fn demo() -> Model {
    let path = weightlift_testdata::demo_gguf();
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(&path, OpenOptions::default()).unwrap());
    Model::new(src, Inventory::parse("cpu").unwrap())
}

fn text(m: &Model, ids: &[u32]) -> String {
    m.tokenizer().unwrap().decode(ids, false).unwrap()
}

#[test]
fn the_template_renders_the_messages_and_a_given_grammar_stays() {
    let m = demo();
    let given = Arc::new(Grammar::parse("root ::= \"yes\" | \"no\"").unwrap());
    let messages = vec![json!({"role": "user", "content": "Is water wet?"})];
    let chat = m
        .chat(
            messages,
            ChatTools::default(),
            None,
            Some(Arc::clone(&given)),
        )
        .unwrap();
    // SmolLM2's own template (ChatML with a default system turn) and its generation prompt.
    let rendered = text(&m, &chat.prompt);
    assert!(
        rendered.ends_with("<|im_start|>user\nIs water wet?<|im_end|>\n<|im_start|>assistant\n"),
        "{rendered:?}"
    );
    assert!(Arc::ptr_eq(chat.grammar.as_ref().unwrap(), &given));
    assert_eq!((chat.stop, chat.tool), (None, None));
    // The response format's grammar wins over the one given.
    let json = Grammar::json();
    let messages = vec![json!({"role": "user", "content": "hi"})];
    let chat = m
        .chat(
            messages,
            ChatTools::default(),
            Some(Arc::clone(&json)),
            Some(given),
        )
        .unwrap();
    assert!(Arc::ptr_eq(chat.grammar.as_ref().unwrap(), &json));
}

#[test]
fn a_forced_tool_answers_by_calling_it_and_a_chat_format_stops_at_its_string() {
    let mut m = demo();
    m.set_chat_format(Some("chatml")).unwrap();
    let tools = chat_tools(
        None,
        None,
        Some(
            json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]),
        ),
        Some(json!({"type": "function", "function": {"name": "get_weather"}})),
    );
    let messages = vec![json!({"role": "user", "content": "Weather in Oslo?"})];
    let chat = m.chat(messages, tools, None, None).unwrap();
    assert_eq!(chat.tool.as_deref(), Some("get_weather"));
    assert!(chat.grammar.is_some());
    // llama-cpp-python's chatml format ends a reply at its end-of-turn marker.
    assert_eq!(chat.stop, Some("<|im_end|>"));

    let bad = vec![json!({"content": "no role"})];
    let e = m.chat(bad, ChatTools::default(), None, None).unwrap_err();
    assert!(e.to_string().contains("role"), "{e}");
}

#[test]
fn responses_are_named_by_the_model_path_unless_named_and_a_completion_echoes_its_prompt() {
    let m = demo();
    let prompt = m.completion_prompt("The sky is").unwrap();
    let mut generate = GenerateOptions {
        logprobs: Some(1),
        ..GenerateOptions::default()
    };
    let o = m
        .response_options(Kind::Completion, None, &prompt, true, false, &mut generate)
        .unwrap();
    let path = weightlift_testdata::demo_gguf().display().to_string();
    assert_eq!(o.model, path);
    assert_eq!(o.echo.as_deref(), Some("The sky is"));
    assert_eq!(o.prompt_chars, "The sky is".len());
    // a whole echoed completion with log-probabilities scores the prompt's tokens too
    assert!(generate.prompt_logprobs);
    assert_eq!(o.prompt_ids, prompt);

    let mut generate = GenerateOptions::default();
    let named = Some("smol".to_owned());
    let o = m
        .response_options(Kind::Chat, named, &prompt, true, false, &mut generate)
        .unwrap();
    assert_eq!(o.model, "smol");
    assert_eq!((o.echo, o.prompt_chars), (None, 0));
    assert!(!generate.prompt_logprobs);
}

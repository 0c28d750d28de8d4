//! The built-in chat formats against the prompts and stop strings llama-cpp-python's own
//! formatters make of the same conversations (`tests/data/chat_formats.json`, written by
//! `tests/gen_chat_formats.py`).

use weightlift_text::{CHAT_FORMATS, ChatTemplate, Message, chat_format};

fn reference() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/chat_formats.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("the chat format reference"))
        .expect("JSON")
}

#[test]
fn every_format_renders_llama_cpp_pythons_prompt_and_stop() {
    let doc = reference();
    let formats = doc["formats"].as_object().expect("formats");
    assert_eq!(
        formats.len(),
        CHAT_FORMATS.len(),
        "a reference for every format"
    );
    for (name, cases) in formats {
        let f = chat_format(name).unwrap();
        let t = ChatTemplate::new(&f.template(), "<s>", "</s>").unwrap();
        for (i, case) in cases.as_array().unwrap().iter().enumerate() {
            let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
            let got = t
                .render(&messages, true)
                .unwrap_or_else(|e| panic!("{name} {i}: {e}"));
            assert_eq!(
                got,
                case["prompt"].as_str().unwrap(),
                "{name}, conversation {i}"
            );
            let stop: Option<Vec<String>> = serde_json::from_value(case["stop"].clone()).unwrap();
            assert_eq!(f.stop.map(|s| vec![s.to_owned()]), stop, "{name} stop");
            assert_eq!(
                case["added_special"], false,
                "{name}: BOS is the tokenizer's"
            );
        }
    }
}

#[test]
fn an_unknown_format_names_the_known_ones() {
    let e = chat_format("chatml2").unwrap_err().to_string();
    assert!(e.contains("'chatml2'") && e.contains("llama-3") && e.contains("chat_format=None"));
}

//! Error messages: typed, lower-case, naming the thing, expected vs got and the likely cause.

use weightlift_format::{MetaValue, Metadata};
use weightlift_text::{ChatTemplate, Message, TextError, Tokenizer};

fn md(pairs: &[(&str, MetaValue)]) -> Metadata {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect()
}

fn s(v: &str) -> MetaValue {
    MetaValue::String(v.to_owned())
}

#[test]
fn unsupported_model_names_it_and_the_supported_ones() {
    let err = Tokenizer::from_gguf(&md(&[("tokenizer.ggml.model", s("t5"))])).unwrap_err();
    assert!(matches!(err, TextError::Unsupported { .. }));
    assert_eq!(
        err.to_string(),
        "tokenizer model 't5' is not supported: expected one of gpt2, llama; this crate builds \
         byte-level BPE and SentencePiece BPE vocabularies only (not t5/ugm, bert/wpm, rwkv or others)"
    );
}

#[test]
fn missing_and_mistyped_keys() {
    let err = Tokenizer::from_gguf(&md(&[])).unwrap_err();
    assert!(
        err.to_string().starts_with(
            "tokenizer metadata 'tokenizer.ggml.model': expected a tokenizer model name such as \
             \"gpt2\" or \"llama\", got no such key;"
        ),
        "{err}"
    );
    let err = Tokenizer::from_gguf(&md(&[
        ("tokenizer.ggml.model", s("llama")),
        ("tokenizer.ggml.tokens", s("oops")),
    ]))
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "tokenizer metadata 'tokenizer.ggml.tokens': expected an array, got a string; the GGUF was \
         written by a converter that does not follow llama.cpp's tokenizer keys, or it is corrupted"
    );
}

#[test]
fn unsupported_pre_tokenizer_is_named() {
    let tokens: MetaValue = MetaValue::Array(vec![s("a"), s("b"), s("ab")].into());
    let merges: MetaValue = MetaValue::Array(vec![s("a b")].into());
    let err = Tokenizer::from_gguf(&md(&[
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("klingon")),
        ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.merges", merges),
    ]))
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with(
            "tokenizer pre-tokenizer 'klingon' is not supported: expected one of default, llama3,"
        ),
        "{msg}"
    );
    assert!(msg.ends_with("add its regexes to pretok.rs"), "{msg}");
}

#[test]
fn bad_token_id_in_decode() {
    let tokens: MetaValue = MetaValue::Array(vec![s("a"), s("b"), s("ab")].into());
    let merges: MetaValue = MetaValue::Array(vec![s("a b")].into());
    let tok = Tokenizer::from_gguf(&md(&[
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("gpt-2")),
        ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.merges", merges),
    ]))
    .unwrap();
    assert_eq!(tok.encode("ab", None, false).unwrap(), vec![2]);
    assert_eq!(
        tok.decode(&[7], true).unwrap_err().to_string(),
        "token id 7: expected an id below the vocabulary size 3; the ids come from another model"
    );
}

#[test]
fn padded_ids_decode_to_nothing() {
    let tokens: MetaValue = MetaValue::Array(vec![s("a"), s("b"), s("ab")].into());
    let merges: MetaValue = MetaValue::Array(vec![s("a b")].into());
    let mut tok = Tokenizer::from_gguf(&md(&[
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("gpt-2")),
        ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.merges", merges),
    ]))
    .unwrap();
    tok.pad_to(8);
    assert_eq!(tok.n_vocab(), 8);
    assert_eq!(tok.token_text(7), Some("[PAD7]"));
    // as transformers decodes ids its tokenizer lacks, and llama.cpp the converter's [PAD]s
    assert_eq!(tok.decode(&[2, 7, 5, 0], false).unwrap(), "aba");
    assert_eq!(tok.encode("[PAD7]ab", None, true).unwrap().last(), Some(&2));
    assert!(tok.decode(&[8], true).is_err());
    tok.pad_to(4);
    assert_eq!(tok.n_vocab(), 8);
}

#[test]
fn template_errors_are_typed() {
    let err = ChatTemplate::new("{% for m in messages %}", "", "").unwrap_err();
    assert!(
        matches!(err, TextError::Template { stage: "parse", .. }),
        "{err}"
    );
    assert!(
        err.to_string().starts_with("chat template parse failed: "),
        "{err}"
    );

    let t = ChatTemplate::new(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok",
        "<s>",
        "</s>",
    )
    .unwrap();
    assert_eq!(t.render(&[Message::new("user", "x")], false).unwrap(), "ok");
    let err = t.render(&[Message::new("system", "x")], false).unwrap_err();
    assert!(matches!(
        err,
        TextError::Template {
            stage: "render",
            ..
        }
    ));
    assert!(
        err.to_string()
            .contains("first message must be from the user"),
        "{err}"
    );
}

#[test]
fn template_python_methods_and_tokens() {
    let t = ChatTemplate::new(
        "{{ bos_token }}{% for m in messages %}{{ m.role.upper() }}: {{ m.content.strip() }}{% if m.content.startswith(' ') %}!{% endif %}\n{% endfor %}{{ eos_token }}",
        "<s>",
        "</s>",
    )
    .unwrap();
    // trim_blocks (as Jinja2 in transformers and llama-cpp-python) eats the newline after a tag.
    assert_eq!(
        t.render(&[Message::new("user", "  hi  ")], false).unwrap(),
        "<s>USER: hi!</s>"
    );
}

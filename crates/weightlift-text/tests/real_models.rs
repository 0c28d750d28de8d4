//! Real tokenizers against ids and text from llama.cpp and transformers
//! (the reference data): the SmolLM2 demo GGUF (byte-level BPE, `smollm`),
//! and tiny-llama's SentencePiece vocabulary from `tokenizer.json` and from its GGUF.

use std::path::{Path, PathBuf};

use serde_json::Value;
use weightlift_format::{Checkpoint, OpenOptions};
use weightlift_text::{Message, Tokenizer};

fn reference() -> PathBuf {
    weightlift_testdata::reference()
}

fn json(path: PathBuf) -> Value {
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn gguf_tokenizer(path: &Path) -> Tokenizer {
    let opts = OpenOptions {
        vocab_only: true,
        ..Default::default()
    };
    let ck = Checkpoint::open(path, opts).unwrap();
    Tokenizer::from_gguf(ck.metadata()).unwrap()
}

/// The SmolLM2 demo model's tokenizer.
fn smollm2() -> Tokenizer {
    gguf_tokenizer(&weightlift_testdata::demo_gguf())
}

fn tiny_llama_gguf() -> Tokenizer {
    gguf_tokenizer(&reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf"))
}

fn tiny_llama_json() -> Tokenizer {
    Tokenizer::from_files(reference().join("tiny-llama/safetensors")).unwrap()
}

/// Text with 2-, 3- and 4-byte characters, emoji sequences and a combining mark.
const MULTIBYTE: &str = "Grüße aus Köln — 東京タワー, naïve café 🦀🎉 👩‍💻 e\u{301} ½ €100";

#[test]
fn smollm2_prompts_match_llama_cpp_ids() {
    let tok = smollm2();
    let prompts = json(reference().join("smollm2-135m/prompts.json"));
    assert!(!tok.add_bos(), "the GGUF has add_bos_token = false");
    for (k, p) in prompts["prompts"].as_object().unwrap() {
        let text = p["text"].as_str().unwrap();
        let want = ids(&p["ids_llamacpp"]);
        // Llama.tokenize(text, add_bos=True, special=False): BOS only if the vocab asks.
        assert_eq!(tok.encode(text, None, false).unwrap(), want, "prompt {k}");
        assert_eq!(tok.decode(&want, true).unwrap(), text, "prompt {k}");
    }
}

#[test]
fn smollm2_greedy_text_matches_both_detokenizers() {
    let tok = smollm2();
    let g = json(reference().join("smollm2-135m/greedy.json"));
    // llama-cpp-python's detokenize() drops control tokens; transformers' decode() keeps them.
    let lc = &g["llamacpp"];
    assert_eq!(
        tok.decode(&ids(&lc["ids"]), true).unwrap(),
        lc["text"].as_str().unwrap()
    );
    let hf = &g["transformers"];
    assert_eq!(
        tok.decode(&ids(&hf["ids"]), false).unwrap(),
        hf["text"].as_str().unwrap()
    );
}

#[test]
fn smollm2_special_tokens_and_eog() {
    let tok = smollm2();
    assert_eq!(
        (tok.bos_id(), tok.eos_id(), tok.n_vocab()),
        (Some(1), Some(2), 49152)
    );
    assert_eq!(tok.token_text(1), Some("<|im_start|>"));
    // <|im_end|> is EOS; <|endoftext|> and the FIM repository token <reponame> end a
    // generation by their text, as in llama.cpp (`tests/eog.rs` checks every vocabulary).
    assert_eq!(tok.eog_ids(), &[0, 2, 4]);
    assert!(tok.is_eog(2) && tok.is_eog(0) && !tok.is_eog(1));

    let text = "<|im_start|>user\nHi<|im_end|>";
    let parsed = tok.encode(text, None, true).unwrap();
    assert_eq!(parsed.first(), Some(&1));
    assert_eq!(parsed.last(), Some(&2));
    assert_eq!(tok.decode(&parsed, false).unwrap(), text);
    assert_eq!(tok.decode(&parsed, true).unwrap(), "user\nHi");
    // Without `special` the markers are plain text: no control ids, same text back.
    let plain = tok.encode(text, None, false).unwrap();
    assert!(!plain.contains(&1) && !plain.contains(&2), "{plain:?}");
    assert_eq!(tok.decode(&plain, true).unwrap(), text);
    assert_eq!(tok.encode("", Some(true), false).unwrap(), vec![1]);
}

#[test]
fn smollm2_chat_template_renders_like_transformers() {
    let tok = smollm2();
    let chat = tok.chat().unwrap().expect("SmolLM2 has a chat template");
    // The format of SmolLM2's template (ChatML), written out by hand from the template text.
    let two = [
        Message::new("user", "What is the capital of France?"),
        Message::new("assistant", "Paris."),
    ];
    assert_eq!(
        chat.render(&two, false).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
         <|im_start|>assistant\nParis.<|im_end|>\n"
    );
    let with_system = [
        Message::new("system", "Be brief."),
        Message::new("user", "Hi"),
    ];
    assert_eq!(
        chat.render(&with_system, true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn tiny_llama_json_matches_transformers_ids() {
    let r = json(reference().join("tiny-llama/ids.json"));
    let (text, want) = (r["text"].as_str().unwrap(), ids(&r["ids"]));
    let tok = tiny_llama_json();
    assert!(tok.add_bos(), "the post-processor adds <s>");
    assert_eq!(tok.encode(text, None, false).unwrap(), want);
    assert_eq!(tok.decode(&want, true).unwrap(), text);
    assert_eq!(
        (tok.bos_id(), tok.eos_id(), tok.n_vocab()),
        (Some(1), Some(2), 32000)
    );
    assert_eq!(tok.chat_template(), None);
}

#[test]
fn tiny_llama_gguf_matches_transformers_ids() {
    let r = json(reference().join("tiny-llama/ids.json"));
    let (text, want) = (r["text"].as_str().unwrap(), ids(&r["ids"]));
    let tok = tiny_llama_gguf();
    assert!(tok.add_bos(), "tokenizer.ggml.add_bos_token = true");
    assert_eq!(tok.encode(text, None, false).unwrap(), want);
    assert_eq!(tok.decode(&want, true).unwrap(), text);
    for (i, t) in r["tokens"].as_array().unwrap().iter().enumerate() {
        assert_eq!(tok.token_text(want[i]), t.as_str());
    }
    // The GGUF and tokenizer.json tokenizers agree beyond the reference sentence too. (Not on
    // runs of spaces: there llama.cpp's score order picks "▁▁" where the tokenizer.json merge
    // order picks "▁" twice; the GGUF path follows llama.cpp, checked by vocab_vectors.rs.)
    let json_tok = tiny_llama_json();
    for text in [MULTIBYTE, "two spaces\n\ttab\n", "<s> is text here", ""] {
        assert_eq!(
            tok.encode(text, None, false).unwrap(),
            json_tok.encode(text, None, false).unwrap(),
            "{text:?}"
        );
    }
}

/// Feed `ids` one at a time; check every piece and the whole against `decode`.
fn check_stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> usize {
    let mut stream = tok.stream(skip_special);
    let mut joined = String::new();
    let mut held_back = 0;
    for &id in ids {
        let piece = stream.push(tok, id).unwrap();
        // A `String` is valid UTF-8 by construction; a piece that is empty while the token had
        // bytes means the decoder held back part of a character.
        if piece.is_empty() && !tok.token_piece(id, !skip_special).unwrap().is_empty() {
            held_back += 1;
        }
        joined.push_str(&piece);
    }
    joined.push_str(&stream.finish());
    assert_eq!(joined, tok.decode(ids, skip_special).unwrap());
    held_back
}

#[test]
fn stream_decoder_never_splits_a_character_spm() {
    let tok = tiny_llama_gguf();
    let ids = tok.encode(MULTIBYTE, None, false).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), MULTIBYTE);
    // Byte-fallback tokens (<0xF0> <0x9F> ...) carry the emoji a byte at a time.
    assert!(check_stream(&tok, &ids, true) > 0);
    check_stream(&tok, &ids, false);
}

#[test]
fn stream_decoder_never_splits_a_character_byte_level() {
    let tok = smollm2();
    let ids = tok.encode(MULTIBYTE, None, false).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), MULTIBYTE);
    assert!(check_stream(&tok, &ids, true) > 0);
    let chat = tok
        .encode("<|im_start|>assistant\n🦀 ok<|im_end|>", None, true)
        .unwrap();
    check_stream(&tok, &chat, true);
    check_stream(&tok, &chat, false);
}

#[test]
fn stream_decoder_flushes_an_incomplete_character_like_decode() {
    let tok = tiny_llama_gguf();
    // "🦀" is F0 9F A6 80, four byte-fallback tokens; stop after two of them, then go on with
    // an ASCII token.
    let crab = tok.encode("🦀", Some(false), false).unwrap();
    let bytes: Vec<u32> = crab
        .iter()
        .copied()
        .filter(|&i| tok.token_text(i).unwrap().starts_with("<0x"))
        .collect();
    assert_eq!(bytes.len(), 4, "{crab:?}");
    let a = tok.encode("a", Some(false), false).unwrap();
    let ids = [&bytes[..2], &a[..]].concat();
    check_stream(&tok, &ids, true);
    check_stream(&tok, &bytes[..2], true);
    assert_eq!(tok.decode(&bytes[..2], true).unwrap(), "\u{FFFD}");
}

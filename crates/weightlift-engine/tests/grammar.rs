//! Grammar masks over the SmolLM2 demo vocabulary, checked token by token against llama.cpp's
//! grammar sampler along the generations llama-cpp-python made with them, and greedy
//! constrained generation on the demo model against llama-cpp-python's ids
//! (`tests/data/grammar_reference.json`, written by `tests/gen_grammar_reference.py`).
//!
//! End-of-generation tokens are compared apart (allowed or not); the set is llama.cpp's (the
//! demo vocabulary's fill-in-the-middle token `<reponame>` included).

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;

use weightlift_engine::forward::Logits;
use weightlift_engine::grammar::{Constraint, Grammar};
use weightlift_engine::sample::SamplingParams;
use weightlift_engine::{CacheDType, FinishReason, GenerateOptions, Generation};
use weightlift_text::{Message, Tokenizer};

/// llama.cpp's logit margins below which our greedy choice may differ from its: about the
/// largest gap measured between our log-probabilities and llama.cpp's on the demo model. A
/// margin below 0 in the fixture is a step where llama.cpp's own two evaluations (one token at
/// a time while generating, all at once when scoring) disagree.
const NEAR_TIE: f64 = 0.15;

/// A case's prompt (completion or chat) and grammar, on model `m`.
fn prompt_and_grammar(
    m: &weightlift_engine::Model,
    case: &serde_json::Value,
) -> (Vec<u32>, Arc<Grammar>) {
    match case["grammar"].as_str() {
        Some(g) => (
            m.completion_prompt(case["prompt"].as_str().unwrap())
                .unwrap(),
            Arc::new(Grammar::parse(g).unwrap()),
        ),
        None => {
            let messages: Vec<Message> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| Message::new(x["role"].as_str().unwrap(), x["content"].as_str().unwrap()))
                .collect();
            (m.chat_prompt(&messages).unwrap(), Grammar::json())
        }
    }
}

/// The first id of the largest value.
fn argmax(xs: &[f32]) -> u32 {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    xs.iter().position(|&x| x == max).unwrap() as u32
}

#[test]
fn on_llama_cpps_path_our_greedy_constrained_choice_is_its_own_at_every_step() {
    let doc = fixture();
    let path = weightlift_testdata::demo_gguf();
    let (mut m, cache) = common::load_on(&common::open(path), "cpu", "cpu", 512, CacheDType::Fp16);
    let tok = m.tokenizer().unwrap();
    let n_vocab = m.vocab_size().unwrap() as usize;
    let (mut steps, mut ties) = (0, Vec::new());
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (prompt, grammar) = prompt_and_grammar(&m, case);
        let mut c = Constraint::new(grammar, &tok, n_vocab).unwrap();
        cache.reset();
        let mut logits = Vec::new();
        m.forward(&prompt, Some(&cache), Logits::Last, &mut logits)
            .unwrap();
        for (k, &want) in ids(&case["ids"]).iter().enumerate() {
            c.mask(&mut logits).unwrap();
            let got = argmax(&logits);
            let margin = case["masks"][k]["margin"].as_f64().unwrap_or(f64::INFINITY);
            if got != want {
                assert!(
                    margin < NEAR_TIE,
                    "{name}, token {k}: ours {got}, llama.cpp's {want}, by a margin of {margin}"
                );
                ties.push(format!("{name} token {k} (margin {margin})"));
            }
            steps += 1;
            c.accept(want).unwrap();
            if tok.is_eog(want) {
                break;
            }
            m.forward(&[want], Some(&cache), Logits::Last, &mut logits)
                .unwrap();
        }
    }
    assert!(steps > 80);
    // Near ties are rare: a handful of the steps at most.
    assert!(ties.len() <= 4, "{ties:?}");
}

fn fixture() -> serde_json::Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/grammar_reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run tests/gen_grammar_reference.py",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

fn demo_tokenizer() -> Tokenizer {
    let path = weightlift_testdata::demo_gguf();
    let ckpt =
        weightlift_format::Checkpoint::open(&path, weightlift_format::OpenOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(ckpt.metadata()).unwrap()
}

/// The 64-bit FNV-1a hash the fixture writes for long masks.
fn fnv1a64(data: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn masks_are_llama_cpp_masks_along_its_generations() {
    let doc = fixture();
    let tok = demo_tokenizer();
    let n_vocab = tok.n_vocab();
    let their_eog = ids(&doc["eog"]);
    let ours: Vec<u32> = tok.eog_ids().to_vec();
    assert_eq!(ours, their_eog, "end-of-generation ids");
    // The ids compared token by token: every one that neither side treats as end of generation.
    let text_ids: Vec<u32> = (0..n_vocab as u32)
        .filter(|i| !their_eog.contains(i))
        .collect();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 6);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        // JSON mode is checked with our own JSON grammar, which must be llama-cpp-python's
        // language.
        let grammar = match case["grammar"].as_str() {
            Some(g) => Arc::new(Grammar::parse(g).unwrap()),
            None => Grammar::json(),
        };
        let mut c = Constraint::new(grammar, &tok, n_vocab).unwrap();
        let path = ids(&case["ids"]);
        let masks = case["masks"].as_array().unwrap();
        assert_eq!(path.len(), masks.len(), "{name}");
        for (step, (&token, want)) in path.iter().zip(masks).enumerate() {
            let mut logits = vec![0.0f32; n_vocab];
            let n = c.mask(&mut logits).unwrap();
            let at = format!("{name}, step {step}");
            assert_eq!(
                n,
                logits.iter().filter(|&&l| l == 0.0).count(),
                "{at}: the count returned"
            );
            let eog_allowed = want["eog_allowed"].as_bool().unwrap();
            for &e in &ours {
                assert_eq!(logits[e as usize] == 0.0, eog_allowed, "{at}: eog {e}");
            }
            let allowed: Vec<u32> = text_ids
                .iter()
                .copied()
                .filter(|&i| logits[i as usize] == 0.0)
                .collect();
            assert_eq!(
                allowed.len() as u64,
                want["n_allowed"].as_u64().unwrap(),
                "{at}"
            );
            if let Some(list) = want.get("allowed") {
                assert_eq!(allowed, ids(list), "{at}");
            } else if let Some(list) = want.get("forbidden") {
                let forbidden: Vec<u32> = text_ids
                    .iter()
                    .copied()
                    .filter(|&i| logits[i as usize] != 0.0)
                    .collect();
                assert_eq!(forbidden, ids(list), "{at}");
            } else {
                let joined: Vec<String> = allowed.iter().map(u32::to_string).collect();
                let hash = fnv1a64(joined.join(",").as_bytes());
                assert_eq!(hash, want["fnv1a64"].as_str().unwrap(), "{at}");
            }
            c.accept(token).unwrap();
        }
    }
}

#[test]
fn every_fixture_case_is_a_grammar_that_parses_and_json_mode_is_llama_cpp_pythons_text() {
    let doc = fixture();
    // Our JSON grammar differs from llama-cpp-python's in layout only; the masks test above
    // checks the language along real generations, this that theirs parses here too.
    Grammar::parse(doc["json_gbnf"].as_str().unwrap()).unwrap();
}

#[test]
fn greedy_constrained_generation_gives_llama_cpp_pythons_ids() {
    let doc = fixture();
    let path = weightlift_testdata::demo_gguf();
    let (mut m, _) = common::load_on(&common::open(path), "cpu", "cpu", 512, CacheDType::Fp16);
    let mut diverged = Vec::new();
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (prompt, grammar) = prompt_and_grammar(&m, case);
        let options = GenerateOptions {
            max_tokens: case["max_tokens"].as_u64(),
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            grammar: Some(grammar),
            ..GenerateOptions::default()
        };
        let mut job = Generation::new(&m, &prompt, None, options).unwrap();
        let text = job.run(&mut m, |_| true).unwrap();
        // llama-cpp-python's ids end with the end-of-generation token when it stopped there.
        let mut want = ids(&case["ids"]);
        let stopped = want.last().is_some_and(|&t| job.tokenizer().is_eog(t));
        if stopped {
            want.pop();
        }
        // The same tokens, or the same up to a token llama.cpp chose by a hair.
        let got = job.tokens();
        if let Some(k) = (0..want.len()).find(|&k| got.get(k) != Some(&want[k])) {
            let margin = case["masks"][k]["margin"].as_f64().unwrap_or(f64::INFINITY);
            assert!(
                margin < NEAR_TIE,
                "{name}: token {k} is {:?}, llama.cpp's {} (by a logit margin of {margin})",
                got.get(k),
                want[k]
            );
            diverged.push(format!("{name} at token {k} (margin {margin})"));
            continue;
        }
        assert_eq!(got, want, "{name}");
        assert_eq!(text, case["text"].as_str().unwrap(), "{name}");
        let finish = if stopped {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        assert_eq!(job.finish_reason(), Some(finish), "{name}");
    }
    // Half the cases at least agree all the way.
    assert!(diverged.len() <= 3, "diverged at near ties: {diverged:?}");
}

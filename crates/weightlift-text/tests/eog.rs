//! End-of-generation tokens against llama.cpp's: for the SmolLM2 demo model, every test
//! vocabulary this crate reads and the tiny family fixtures (qwen2, qwen3, phi3, gemma2,
//! gemma3), `Tokenizer::eog_ids` equals the ids llama.cpp 0.3.36's
//! `llama_vocab_is_eog` reports (`tests/data/eog_reference.json`, written by
//! `tests/gen_eog_reference.py`). Generation stops at these, so a missing one runs on past
//! where llama.cpp stops.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use weightlift_format::{Checkpoint, OpenOptions};
use weightlift_text::Tokenizer;

fn reference() -> BTreeMap<String, Vec<u32>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/eog_reference.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["vocabs"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, ids)| {
            let mut ids: Vec<u32> = ids
                .as_object()
                .unwrap()
                .keys()
                .map(|k| k.parse().unwrap())
                .collect();
            ids.sort_unstable();
            (name.clone(), ids)
        })
        .collect()
}

fn path_of(name: &str) -> PathBuf {
    if name.starts_with("ggml-vocab-") {
        weightlift_testdata::vocab_dir().join(name)
    } else if let Some(family) = name.strip_suffix("-F16.gguf") {
        // a tiny family fixture: tests/data/tiny-<family>/tiny-<family>-F16.gguf
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/data")
            .join(family)
            .join(name)
    } else {
        weightlift_testdata::demo_gguf()
    }
}

#[test]
fn end_of_generation_ids_equal_llama_cpp() {
    let mut compared = Vec::new();
    let mut mismatches = Vec::new();
    for (name, want) in reference() {
        let path = path_of(&name);
        assert!(
            path.is_file(),
            "{} is missing: run `make vocab`",
            path.display()
        );
        let opts = OpenOptions {
            vocab_only: true,
            ..Default::default()
        };
        let ck = Checkpoint::open(&path, opts).unwrap();
        // vocabularies of a kind this crate does not read (WordPiece, ...) are left out
        let Ok(tok) = Tokenizer::from_gguf(ck.metadata()) else {
            continue;
        };
        if tok.eog_ids() != want.as_slice() {
            mismatches.push(format!(
                "{name}: ours {:?}, llama.cpp {want:?}",
                tok.eog_ids()
            ));
        }
        compared.push(name);
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    for must in [
        "SmolLM2",
        "llama-spm",
        "llama-bpe",
        "qwen2",
        "starcoder",
        "refact",
        "phi-3",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-phi3",
        "tiny-gemma2",
        "tiny-gemma3",
    ] {
        assert!(
            compared.iter().any(|n| n.contains(must)),
            "{must} was not compared: {compared:?}"
        );
    }
}

/// The tiny family fixtures' Hugging Face folders (`tokenizer.json` and its config) give the
/// end-of-generation ids llama.cpp reports for the GGUF its converter made from the same folder.
#[test]
fn a_family_folder_ends_where_llama_cpp_ends_its_gguf() {
    let reference = reference();
    let mut checked = 0;
    for (name, want) in reference.iter().filter(|(n, _)| n.starts_with("tiny-")) {
        let dir = path_of(name).parent().unwrap().to_path_buf();
        let tok = Tokenizer::from_files(&dir).unwrap();
        assert_eq!(tok.eog_ids(), want.as_slice(), "{}", dir.display());
        checked += 1;
    }
    assert_eq!(checked, 5, "the five family fixtures");
}

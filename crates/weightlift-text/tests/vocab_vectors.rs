//! llama.cpp's tokenizer test vectors: `models/ggml-vocab-*.gguf` with `.gguf.inp` / `.gguf.out`,
//! from the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist (`make vocab`). They are
//! read and compared as llama.cpp's `tests/test-tokenizer-0.cpp` does: texts separated by
//! `\n__ggml_vocab_test__\n`, one line of space-separated ids per text, tokenized with
//! `add_special = false, parse_special = false`.

use std::path::{Path, PathBuf};

use weightlift_format::{Checkpoint, OpenOptions};
use weightlift_text::Tokenizer;

/// The vocabularies this crate claims; every vector of each must match.
const SUPPORTED: &[&str] = &[
    "llama-spm",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "gpt-2",
    "starcoder",
    "refact",
    "command-r",
    "mpt",
    "falcon",
    "deepseek-llm",
    "deepseek-coder",
    "phi-3",
];

/// Missing is a failure, not a skip: these vectors are the tokenizer's reference.
fn vocab_dir() -> PathBuf {
    let dir = weightlift_testdata::vocab_dir();
    assert!(
        dir.join("ggml-vocab-llama-spm.gguf.inp").is_file(),
        "llama.cpp's vocab test vectors are not in {}: run `make vocab`",
        dir.display()
    );
    dir
}

/// (text, expected ids) pairs, as llama.cpp's own tokenizer test reads them.
fn read_vectors(gguf: &Path) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(gguf.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(gguf.with_extension("gguf.out")).unwrap();
    let sep = "\n__ggml_vocab_test__\n";
    let mut texts = Vec::new();
    let mut rest = inp.as_str();
    while !rest.is_empty() {
        match rest.find(sep) {
            Some(at) => {
                texts.push(rest[..at].to_owned());
                rest = &rest[at + sep.len()..];
            }
            None => {
                texts.push(rest.to_owned());
                break;
            }
        }
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(
        texts.len(),
        ids.len(),
        "{}: .inp and .out disagree",
        gguf.display()
    );
    texts.into_iter().zip(ids).collect()
}

fn load(dir: &Path, name: &str) -> Tokenizer {
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    let ck = Checkpoint::open(
        &path,
        OpenOptions {
            vocab_only: true,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    Tokenizer::from_gguf(ck.metadata()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Mismatching vectors of one vocabulary, described.
fn failures(dir: &Path, name: &str) -> Vec<String> {
    let tok = load(dir, name);
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    let mut bad = Vec::new();
    for (text, want) in read_vectors(&path) {
        match tok.encode(&text, Some(false), false) {
            Ok(got) if got == want => {}
            Ok(got) => bad.push(format!("{text:?}: expected {want:?}, got {got:?}")),
            Err(e) => bad.push(format!("{text:?}: {e}")),
        }
    }
    bad
}

#[test]
fn every_supported_vocab_matches_llama_cpp() {
    let dir = vocab_dir();
    let mut report = Vec::new();
    for name in SUPPORTED {
        let bad = failures(&dir, name);
        if !bad.is_empty() {
            report.push(format!(
                "{name}: {} vectors differ, first: {}",
                bad.len(),
                bad[0]
            ));
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

/// Survey of every vocabulary with vectors (supported or not); `--ignored --nocapture`.
#[test]
#[ignore]
fn survey_all_vocabs() {
    let dir = vocab_dir();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let n = e.unwrap().file_name().into_string().unwrap();
            n.strip_prefix("ggml-vocab-")?
                .strip_suffix(".gguf.inp")
                .map(str::to_owned)
        })
        .collect();
    names.sort();
    for name in names {
        let path = dir.join(format!("ggml-vocab-{name}.gguf"));
        let ck = Checkpoint::open(
            &path,
            OpenOptions {
                vocab_only: true,
                ..Default::default()
            },
        )
        .unwrap();
        match Tokenizer::from_gguf(ck.metadata()) {
            Err(e) => eprintln!("{name}: not built: {e}"),
            Ok(_) => {
                let n = read_vectors(&path).len();
                let bad = failures(&dir, &name);
                eprintln!(
                    "{name}: {}/{n} pass{}",
                    n - bad.len(),
                    bad.first()
                        .map(|b| format!("; first failure {b}"))
                        .unwrap_or_default()
                );
            }
        }
    }
}

/// Fill-in-the-middle tokens, found by their texts as llama.cpp finds them (these vocabularies
/// declare no ids): StarCoder's `<fim_prefix>`/`<fim_suffix>`/`<fim_middle>` and DeepSeek
/// Coder's `<｜fim▁begin｜>`/`<｜fim▁hole｜>`/`<｜fim▁end｜>`; none in llama's SPM vocabulary.
#[test]
fn fim_tokens_are_found_by_their_texts() {
    let dir = vocab_dir();
    let open = |name: &str| {
        let ckpt = Checkpoint::open(
            dir.join(format!("ggml-vocab-{name}.gguf")),
            OpenOptions::default(),
        )
        .unwrap();
        Tokenizer::from_gguf(ckpt.metadata()).unwrap()
    };
    for (name, texts) in [
        (
            "starcoder",
            ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
        ),
        (
            "deepseek-coder",
            ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"],
        ),
    ] {
        let t = open(name);
        let fim = t.fim().unwrap_or_else(|| panic!("{name}: no FIM tokens"));
        let got = [fim.prefix, fim.suffix, fim.middle].map(|id| t.token_text(id).unwrap());
        assert_eq!(got, texts, "{name}");
    }
    assert_eq!(open("llama-spm").fim(), None);
}

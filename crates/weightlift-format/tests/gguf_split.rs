//! Split GGUF checkpoints (`name-00001-of-00003.gguf`, as llama.cpp's gguf-split writes them:
//! `split.no` is 0-based, `split.count` the number of parts, `split.tensors.count` the total
//! number of tensors, and the metadata lives in the first part).

use crate::gguf_util;

use std::path::{Path, PathBuf};

use gguf_util::{Gguf, V, s, t, temp_dir, write};
use weightlift_format::{Checkpoint, MetaValue, OpenOptions};

fn part(no: u16, count: u16, total: i32, tensors: &[(&str, u64)]) -> Gguf {
    let mut g = Gguf::default();
    if no == 0 {
        g = g
            .kv("general.architecture", s("llama"))
            .kv("tokenizer.ggml.model", s("llama"))
            .kv("tokenizer.ggml.tokens", V::Arr(8, vec![s("a"), s("b")]));
    }
    g = g
        .kv("split.no", V::U16(no))
        .kv("split.count", V::U16(count))
        .kv("split.tensors.count", V::I32(total));
    for (name, n) in tensors {
        g = g.tensor(t(name, &[*n], 0));
    }
    g.fill = no as u8 + 1;
    g
}

fn parts() -> Vec<Gguf> {
    vec![
        part(0, 3, 4, &[("a", 8), ("b", 16)]),
        part(1, 3, 4, &[("c", 4)]),
        part(2, 3, 4, &[("d", 2)]),
    ]
}

fn write_set(tag: &str, parts: &[Gguf]) -> (PathBuf, Vec<PathBuf>) {
    let dir = temp_dir(tag);
    let n = parts.len();
    let paths: Vec<PathBuf> = (1..=n)
        .map(|i| dir.join(format!("model-{i:05}-of-{n:05}.gguf")))
        .collect();
    for (p, g) in paths.iter().zip(parts) {
        write(p, &g.bytes());
    }
    (dir, paths)
}

fn open(p: &Path) -> weightlift_format::Result<Checkpoint> {
    Checkpoint::open(p, OpenOptions::default())
}

fn open_err(p: &Path) -> String {
    match open(p) {
        Ok(_) => panic!("expected {} to fail", p.display()),
        Err(e) => e.to_string(),
    }
}

#[track_caller]
fn has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message lacks {p:?}: {msg}");
    }
}

#[test]
fn opens_all_parts_as_one_checkpoint() {
    let (dir, paths) = write_set("split-ok", &parts());
    for start in [&paths[0], &paths[1], &paths[2]] {
        let ck = open(start).unwrap();
        let names: Vec<&str> = ck.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c", "d"]);
        let files: Vec<usize> = ck.tensors().iter().map(|t| t.file).collect();
        assert_eq!(files, [0, 0, 1, 2]);
        assert_eq!(
            ck.files().collect::<Vec<_>>(),
            paths.iter().map(PathBuf::as_path).collect::<Vec<_>>()
        );
        // Metadata comes from the first part.
        assert_eq!(
            ck.metadata().get("general.architecture"),
            Some(&MetaValue::String("llama".into()))
        );
        assert_eq!(ck.metadata().get("split.no"), Some(&MetaValue::U16(0)));
        assert_eq!(ck.tokenizer().n_tokens, Some(2));
        // Each tensor's bytes come from its own part (parts are filled with no + 1).
        for (t, fill) in ck.tensors().iter().zip([1u8, 1, 2, 3]) {
            let b = ck.bytes(t);
            assert_eq!(b.len() as u64, t.nbytes);
            assert!(b.iter().all(|&x| x == fill), "{}", t.name);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn vocab_only_reads_metadata_of_every_part() {
    let (dir, paths) = write_set("split-vocab", &parts());
    let ck = Checkpoint::open(
        &paths[0],
        OpenOptions {
            vocab_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(ck.tensors().is_empty());
    assert_eq!(ck.tokenizer().n_tokens, Some(2));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn missing_part_is_named() {
    let (dir, paths) = write_set("split-missing", &parts());
    std::fs::remove_file(&paths[2]).unwrap();
    let msg = open_err(&paths[0]);
    has(
        &msg,
        &[
            "model-00003-of-00003.gguf",
            "split part 3 of 3",
            "no such file",
        ],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn split_no_must_match_position() {
    let mut p = parts();
    p[1] = part(2, 3, 4, &[("c", 4)]);
    let (dir, paths) = write_set("split-no", &p);
    let msg = open_err(&paths[0]);
    has(
        &msg,
        &[
            "model-00002-of-00003.gguf",
            "key 'split.no'",
            "expected 1 (0-based) for part 2",
            "got 2",
        ],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn split_count_must_match_names() {
    let mut p = parts();
    p[2] = part(2, 4, 4, &[("d", 2)]);
    let (dir, paths) = write_set("split-count", &p);
    has(
        &open_err(&paths[0]),
        &[
            "model-00003-of-00003.gguf",
            "key 'split.count'",
            "expected 3",
            "got 4",
        ],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn total_tensor_count_must_match() {
    let p = vec![
        part(0, 3, 5, &[("a", 8), ("b", 16)]),
        part(1, 3, 5, &[("c", 4)]),
        part(2, 3, 5, &[("d", 2)]),
    ];
    let (dir, paths) = write_set("split-total", &p);
    has(
        &open_err(&paths[1]),
        &[
            "model-00001-of-00003.gguf",
            "key 'split.tensors.count'",
            "expected 5 tensors over the 3 parts",
            "got 4",
        ],
    );
    // Parts that disagree on the total.
    let mut p = parts();
    p[1] = part(1, 3, 7, &[("c", 4)]);
    let (dir2, paths) = write_set("split-total2", &p);
    has(
        &open_err(&paths[0]),
        &[
            "model-00002-of-00003.gguf",
            "expected 4, as in part 1",
            "got 7",
        ],
    );
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(dir2);
}

#[test]
fn missing_split_key() {
    let mut p = parts();
    let mut g = Gguf::default()
        .kv("split.no", V::U16(1))
        .kv("split.count", V::U16(3));
    g = g.tensor(t("c", &[4], 0));
    p[1] = g;
    let (dir, paths) = write_set("split-key", &p);
    has(
        &open_err(&paths[0]),
        &[
            "model-00002-of-00003.gguf",
            "key 'split.tensors.count'",
            "no such key",
        ],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn duplicate_tensor_across_parts() {
    let mut p = parts();
    p[2] = part(2, 3, 4, &[("a", 2)]);
    let (dir, paths) = write_set("split-dup", &p);
    has(
        &open_err(&paths[0]),
        &[
            "model-00003-of-00003.gguf",
            "tensor 'a'",
            "each tensor name once",
        ],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn split_metadata_in_a_plain_file_name() {
    let dir = temp_dir("split-plain");
    let p = dir.join("model.gguf");
    write(&p, &part(0, 3, 4, &[("a", 8)]).bytes());
    has(
        &open_err(&p),
        &["key 'split.count'", "name-00001-of-00003.gguf", "3 parts"],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_bad_part_is_named() {
    let mut p = parts();
    p[1].version = 1;
    let (dir, paths) = write_set("split-bad", &p);
    has(
        &open_err(&paths[0]),
        &["model-00002-of-00003.gguf", "gguf version 1"],
    );
    let _ = std::fs::remove_dir_all(dir);
}

//! Shard indexes that lie, escape the model folder, or point at missing files. Shards are
//! written by the official `safetensors` crate; the index is tampered with by hand. Every case
//! must fail with a message that names the offending path or tensor.

use crate::st_util;

use std::path::Path;

use st_util::{Scratch, open_err, sharded, st_f32, write_index};
use weightlift_format::{Checkpoint, FormatError, OpenOptions};

const S1: &str = "model-00001-of-00002.safetensors";
const S2: &str = "model-00002-of-00002.safetensors";

fn set(map: &mut [(String, String)], tensor: &str, shard: &str) {
    for (k, v) in map.iter_mut() {
        if k == tensor {
            *v = shard.to_owned();
        }
    }
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message lacks {p:?}: {msg}");
    }
}

#[test]
fn valid_fixture_opens_from_folder_and_index() {
    let s = Scratch::new("idx-ok");
    sharded(s.path());
    for p in [
        s.path().to_path_buf(),
        s.path().join("model.safetensors.index.json"),
    ] {
        let c = Checkpoint::open(&p, OpenOptions::default()).unwrap();
        assert_eq!(c.tensors().len(), 4);
        assert_eq!(c.files().len(), 2);
        let norm = c.tensor("model.norm.weight").unwrap();
        assert_eq!(norm.file, 1);
        let expected: Vec<u8> = [3.0f32, 4.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(c.bytes(norm), expected.as_slice());
        assert_eq!(c.metadata()["format"].as_str(), Some("pt"));
        // No config.json: the spec says so, and the checkpoint still opens.
        assert!(
            c.spec().unwrap_err().contains("no config.json"),
            "{:?}",
            c.spec()
        );
    }
}

#[test]
fn parent_dir_path_is_refused() {
    let s = Scratch::new("idx-dotdot");
    std::fs::create_dir(s.path().join("m")).unwrap();
    let dir = s.path().join("m");
    let mut map = sharded(&dir);
    // The file exists one level up: only the path check stops it.
    std::fs::copy(dir.join(S2), s.path().join(S2)).unwrap();
    let bad = format!("../{S2}");
    set(&mut map, "model.norm.weight", &bad);
    write_index(&dir, &map);
    let msg = open_err(&dir);
    assert_has(
        &msg,
        &[
            "'../model-00002-of-00002.safetensors'",
            "model.norm.weight",
            "outside the model folder",
        ],
    );

    set(&mut map, "model.norm.weight", &format!("sub/../../{S2}"));
    write_index(&dir, &map);
    assert_has(&open_err(&dir), &["sub/../../", "outside the model folder"]);
}

#[test]
fn absolute_path_is_refused() {
    let s = Scratch::new("idx-abs");
    let mut map = sharded(s.path());
    let abs = s.path().join(S2);
    let abs = abs.to_str().unwrap();
    set(&mut map, "model.norm.weight", abs);
    write_index(s.path(), &map);
    let msg = open_err(s.path());
    assert_has(
        &msg,
        &[abs, "model.norm.weight", "outside the model folder"],
    );
    set(&mut map, "model.norm.weight", "/etc/passwd");
    write_index(s.path(), &map);
    assert_has(&open_err(s.path()), &["/etc/passwd"]);
}

#[cfg(unix)]
#[test]
fn symlink_outside_is_refused_and_inside_is_followed() {
    let s = Scratch::new("idx-link");
    let dir = s.path().join("m");
    std::fs::create_dir(&dir).unwrap();
    sharded(&dir);
    // Move shard 2 outside the folder and link to it.
    let outside = s.path().join("elsewhere.safetensors");
    std::fs::rename(dir.join(S2), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join(S2)).unwrap();
    let msg = open_err(&dir);
    assert_has(
        &msg,
        &[S2, "elsewhere.safetensors", "outside the model folder"],
    );

    // A link that stays inside the folder is fine.
    std::fs::remove_file(dir.join(S2)).unwrap();
    std::fs::rename(&outside, dir.join("blobs-abc")).unwrap();
    std::os::unix::fs::symlink("blobs-abc", dir.join(S2)).unwrap();
    let c = Checkpoint::open(&dir, OpenOptions::default()).unwrap();
    assert_eq!(c.tensors().len(), 4);

    // A dangling link is a missing shard.
    std::fs::remove_file(dir.join("blobs-abc")).unwrap();
    assert_has(&open_err(&dir), &[S2, "no such file"]);
}

#[test]
fn missing_shard() {
    let s = Scratch::new("idx-missing");
    sharded(s.path());
    std::fs::remove_file(s.path().join(S2)).unwrap();
    let msg = open_err(s.path());
    assert_has(&msg, &[S2, "no such file", "incomplete"]);
}

#[test]
fn tensor_listed_but_absent() {
    let s = Scratch::new("idx-absent");
    let mut map = sharded(s.path());
    map.push(("lm_head.weight".into(), S2.into()));
    write_index(s.path(), &map);
    let msg = open_err(s.path());
    assert_has(&msg, &["lm_head.weight", S2, "does not hold it"]);
}

#[test]
fn tensor_present_but_unlisted() {
    let s = Scratch::new("idx-unlisted");
    let mut map = sharded(s.path());
    map.retain(|(k, _)| k != "model.layers.0.input_layernorm.weight");
    write_index(s.path(), &map);
    let msg = open_err(s.path());
    assert_has(
        &msg,
        &["model.layers.0.input_layernorm.weight", S1, "does not list"],
    );
}

#[test]
fn tensor_listed_under_another_shard() {
    let s = Scratch::new("idx-moved");
    let mut map = sharded(s.path());
    set(&mut map, "model.norm.weight", S1);
    write_index(s.path(), &map);
    let msg = open_err(s.path());
    assert_has(&msg, &["model.norm.weight", S1, S2]);
}

#[test]
fn tensor_in_two_shards() {
    let s = Scratch::new("idx-dup");
    let map = sharded(s.path());
    // A third shard that repeats a tensor of shard 1, listed in the index through another name.
    let c = st_f32(
        &[
            ("model.embed_tokens.weight", vec![1], vec![0.0]),
            ("extra", vec![1], vec![0.0]),
        ],
        None,
    );
    s.write("model-3.safetensors", c);
    let mut map2 = map.clone();
    map2.push(("extra".into(), "model-3.safetensors".into()));
    write_index(s.path(), &map2);
    let msg = open_err(s.path());
    assert_has(
        &msg,
        &["model.embed_tokens.weight", "model-3.safetensors", S1],
    );
}

#[test]
fn tensor_listed_twice_in_index() {
    let s = Scratch::new("idx-twice");
    let mut map = sharded(s.path());
    map.push(("model.norm.weight".into(), S2.into()));
    write_index(s.path(), &map);
    assert_has(&open_err(s.path()), &["model.norm.weight", "listed twice"]);
}

#[test]
fn weight_map_shape() {
    let s = Scratch::new("idx-shape");
    sharded(s.path());
    let idx = s.path().join("model.safetensors.index.json");
    for (text, want) in [
        (r#"{"weight_map": [1, 2]}"#, "got an array"),
        (r#"{"weight_map": "x"}"#, "got a string"),
        (r#"{"weight_map": null}"#, "got null"),
        (r#"{"weight_map": {}}"#, "an empty object"),
        (r#"{"metadata": {}}"#, "not a safetensors shard index"),
        (
            r#"{"weight_map": {"model.norm.weight": 3}}"#,
            "got a number",
        ),
        (
            r#"{"weight_map": {"a": "x"}, "weight_map": {"a": "x"}}"#,
            "the key twice",
        ),
        (r#"{"weight_map": {"#, "parse error"),
        ("[]", "parse error"),
        (
            r#"{"weight_map": {"model.norm.weight": ""}}"#,
            "the path ''",
        ),
    ] {
        std::fs::write(&idx, text).unwrap();
        let msg = open_err(&idx);
        assert_has(&msg, &["model.safetensors.index.json", want]);
    }
}

#[test]
fn oversized_index_is_refused_before_reading() {
    let s = Scratch::new("idx-big");
    sharded(s.path());
    let idx = s.path().join("model.safetensors.index.json");
    // Sparse: costs no disk and must cost no memory either.
    std::fs::File::options()
        .write(true)
        .open(&idx)
        .unwrap()
        .set_len(65 << 20)
        .unwrap();
    let e = Checkpoint::open(&idx, OpenOptions::default()).unwrap_err();
    assert!(matches!(e, FormatError::Invalid { .. }));
    assert_has(
        &e.to_string(),
        &["at most 67108864 bytes", "68157440 bytes"],
    );
}

#[test]
fn oversized_or_broken_config_is_refused() {
    let s = Scratch::new("idx-config");
    sharded(s.path());
    let cfg = s.write("config.json", "{\"model_type\": ");
    assert_has(&open_err(s.path()), &["config.json", "parse error"]);
    std::fs::write(&cfg, "[1]").unwrap();
    assert_has(
        &open_err(s.path()),
        &["config.json", "expected a json object, got an array"],
    );
    std::fs::File::options()
        .write(true)
        .open(&cfg)
        .unwrap()
        .set_len(65 << 20)
        .unwrap();
    assert_has(
        &open_err(s.path()),
        &["config.json", "at most 67108864 bytes"],
    );
}

#[test]
fn folder_resolution() {
    let s = Scratch::new("folder");
    assert_has(&open_err(s.path()), &["no safetensors weights"]);
    // a tokenizer's folder opens for its vocabulary only, holding no file
    s.write(
        "tokenizer.json",
        br#"{"model": {"type": "BPE", "vocab": {}, "merges": []}}"#,
    );
    assert_has(&open_err(s.path()), &["no safetensors weights"]);
    let vocab = OpenOptions {
        vocab_only: true,
        ..Default::default()
    };
    let c = Checkpoint::open(s.path(), vocab).unwrap();
    assert!(c.tensors().is_empty() && c.vocab_only());
    std::fs::remove_file(s.path().join("tokenizer.json")).unwrap();
    assert_has(
        &Checkpoint::open(s.path(), vocab).unwrap_err().to_string(),
        &["no safetensors weights"],
    );
    let one = st_f32(&[("x", vec![1], vec![1.0])], None);
    s.write("weights.safetensors", &one);
    let c = Checkpoint::open(s.path(), OpenOptions::default()).unwrap();
    assert_eq!(c.tensors()[0].name, "x");
    s.write("other.safetensors", &one);
    assert_has(
        &open_err(s.path()),
        &[
            "2 *.safetensors files",
            "other.safetensors",
            "weights.safetensors",
        ],
    );
    // model.safetensors wins, as in transformers.
    s.write(
        "model.safetensors",
        st_f32(&[("y", vec![1], vec![1.0])], None),
    );
    let c = Checkpoint::open(s.path(), OpenOptions::default()).unwrap();
    assert_eq!(c.tensors()[0].name, "y");
    assert_eq!(
        c.files().next().unwrap(),
        Path::new(&s.path().join("model.safetensors"))
    );
}

#[cfg(unix)]
#[test]
fn hub_cache_snapshot_links_into_blobs_are_followed() {
    // huggingface_hub's layout: snapshots/<rev>/<file> -> ../../blobs/<sha>.
    let s = Scratch::new("hub");
    let repo = s.path().join("models--org--tiny");
    let snap = repo.join("snapshots/0123abcd");
    let blobs = repo.join("blobs");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(&blobs).unwrap();
    sharded(&snap);
    for (i, shard) in [S1, S2].into_iter().enumerate() {
        let blob = blobs.join(format!("sha{i}"));
        std::fs::rename(snap.join(shard), &blob).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/sha{i}"), snap.join(shard)).unwrap();
    }
    let c = Checkpoint::open(&snap, OpenOptions::default()).unwrap();
    assert_eq!(c.tensors().len(), 4);

    // The same links from a folder that is not a hub snapshot are refused.
    let plain = repo.join("snapshots2/0123abcd");
    std::fs::create_dir_all(&plain).unwrap();
    for f in ["model.safetensors.index.json", S1, S2] {
        let target = std::fs::read_link(snap.join(f)).unwrap_or_else(|_| snap.join(f));
        let target = if target.is_relative() {
            snap.join(target)
        } else {
            target
        };
        std::os::unix::fs::symlink(target, plain.join(f)).unwrap();
    }
    assert_has(&open_err(&plain), &["outside the model folder"]);
}

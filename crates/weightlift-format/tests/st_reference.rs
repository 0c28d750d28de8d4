//! The real tiny-llama safetensors (single file and three shards) against references nobody
//! here wrote: `model.json` (written by the transformers script that made the model) and
//! `data/st_tiny_llama_digest.json` (what the official `safetensors` Python package reads from
//! the same files; see `data/st_gen_digest.py`).

use std::path::{Path, PathBuf};

use weightlift_format::{Checkpoint, DType, Format, OpenOptions, Role};

fn reference() -> PathBuf {
    weightlift_testdata::reference_file("tiny-llama")
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn digest() -> serde_json::Value {
    json(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/st_tiny_llama_digest.json"))
}

fn fnv1a64(data: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn open(p: &Path) -> Checkpoint {
    Checkpoint::open(p, OpenOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Names, shapes and dtypes equal model.json; bytes equal what the safetensors package reads.
fn check_against_references(
    ckpt: &Checkpoint,
    digest: &serde_json::Map<String, serde_json::Value>,
) {
    let model = json(&reference().join("model.json"));
    let expected = model["tensors"].as_object().unwrap();
    assert_eq!(ckpt.tensors().len(), 20);
    assert_eq!(ckpt.tensors().len(), expected.len());
    for t in ckpt.tensors() {
        let (shape, dtype) = (&expected[&t.name][0], &expected[&t.name][1]);
        let shape: Vec<u64> = shape
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.shape, shape, "{}", t.name);
        assert_eq!(dtype, "bfloat16");
        assert_eq!(t.dtype, DType::BF16);

        let d = &digest[&t.name];
        assert_eq!(d["dtype"], "BF16");
        assert_eq!(t.nbytes, d["nbytes"].as_u64().unwrap(), "{}", t.name);
        let bytes = ckpt.bytes(t);
        let sum: u64 = bytes.iter().map(|&b| u64::from(b)).sum();
        assert_eq!(sum, d["sum"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(fnv1a64(bytes), d["fnv1a64"].as_str().unwrap(), "{}", t.name);
        assert_eq!(ckpt.raw_bytes(&t.name).unwrap(), bytes);
    }
    assert_eq!(ckpt.n_params(), model["n_params"].as_u64().unwrap());
}

fn check_spec(ckpt: &Checkpoint) {
    let s = ckpt.spec().unwrap();
    assert_eq!(s.architecture, "llama");
    assert_eq!(s.n_layers, 2);
    assert_eq!(s.hidden_size, 256);
    assert_eq!(s.intermediate_size, 768);
    assert_eq!(s.n_heads, 4);
    assert_eq!(s.n_kv_heads, vec![2, 2]);
    assert_eq!(s.head_dim, 64);
    assert_eq!(s.vocab_size, 32000);
    assert_eq!(s.context_length, 512);
    assert_eq!(s.rope_theta, 10000.0);
    assert_eq!(s.rope_dim, 64);
    assert_eq!(s.rms_norm_eps, 1e-5);
    assert!(s.tie_word_embeddings);
    assert!(!s.attention_bias);
}

fn check_roles(ckpt: &Checkpoint) {
    assert!(ckpt.roles_known());
    assert!(ckpt.warnings().is_empty(), "{:?}", ckpt.warnings());
    assert_eq!(ckpt.unknown_tensors().count(), 0);
    for t in ckpt.tensors() {
        let role = t.role.unwrap_or_else(|| panic!("{} has no role", t.name));
        assert_eq!(role.is_per_layer(), t.layer.is_some(), "{}", t.name);
    }
    let q = ckpt
        .tensor("model.layers.1.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!((q.layer, q.role), (Some(1), Some(Role::AttnQ)));
    let e = ckpt.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!((e.layer, e.role), (None, Some(Role::TokenEmbd)));
    let per_layer = ckpt.tensors().iter().filter(|t| t.layer == Some(0)).count();
    assert_eq!(per_layer, 9);
}

#[test]
fn single_file_folder_and_path() {
    let r = reference();
    let digest = digest();
    let digest = digest["single"].as_object().unwrap();
    for p in [
        r.join("safetensors"),
        r.join("safetensors/model.safetensors"),
    ] {
        let ckpt = open(&p);
        assert_eq!(ckpt.format(), Format::Safetensors);
        assert_eq!(ckpt.files().len(), 1);
        check_against_references(&ckpt, digest);
        check_spec(&ckpt);
        check_roles(&ckpt);
        // Offsets are absolute: 8 + header length + data_offsets[0].
        let header_len = {
            let b = std::fs::read(r.join("safetensors/model.safetensors")).unwrap();
            u64::from_le_bytes(b[..8].try_into().unwrap())
        };
        let first = &ckpt.tensors()[0];
        assert_eq!(first.offset, 8 + header_len);
        assert_eq!(first.name, "model.embed_tokens.weight");
        assert_eq!(ckpt.metadata()["format"].as_str(), Some("pt"));
        assert!(ckpt.tokenizer().has_tokenizer_json);
        assert_eq!(ckpt.tokenizer().bos_token_id, Some(1));
        assert_eq!(ckpt.tokenizer().eos_token_id, Some(2));
        assert_eq!(ckpt.config().unwrap()["model_type"], "llama");
        assert_eq!(ckpt.total_bytes(), 19_532_288);
    }
}

#[test]
fn sharded_folder_and_index_equal_single() {
    let r = reference();
    let digest = digest();
    let mut from_shards = serde_json::Map::new();
    for (_, tensors) in digest["shards"].as_object().unwrap() {
        from_shards.extend(tensors.as_object().unwrap().clone());
    }
    let single = open(&r.join("safetensors"));
    for p in [
        r.join("safetensors-sharded"),
        r.join("safetensors-sharded/model.safetensors.index.json"),
    ] {
        let ckpt = open(&p);
        assert_eq!(ckpt.files().len(), 3);
        let names: Vec<_> = ckpt
            .files()
            .map(|f| f.file_name().unwrap().to_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            names,
            [
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors"
            ]
        );
        check_against_references(&ckpt, &from_shards);
        check_spec(&ckpt);
        check_roles(&ckpt);
        for t in single.tensors() {
            let s = ckpt.tensor(&t.name).unwrap();
            assert_eq!((s.dtype, &s.shape), (t.dtype, &t.shape));
            assert!(ckpt.bytes(s) == single.bytes(t), "{} differs", t.name);
        }
        // The index says which shard holds each tensor.
        let index = json(&r.join("safetensors-sharded/model.safetensors.index.json"));
        for t in ckpt.tensors() {
            let shard = index["weight_map"][&t.name].as_str().unwrap();
            let file = ckpt.files().nth(t.file).unwrap();
            assert_eq!(file.file_name().unwrap(), shard);
        }
    }
}

#[test]
fn vocab_only_has_no_tensors() {
    let r = reference();
    let opts = OpenOptions {
        vocab_only: true,
        ..OpenOptions::default()
    };
    let ckpt = Checkpoint::open(r.join("safetensors-sharded"), opts).unwrap();
    assert!(ckpt.vocab_only());
    assert!(ckpt.tensors().is_empty());
    assert!(ckpt.tokenizer().has_tokenizer_json);
    assert_eq!(ckpt.spec().unwrap().n_layers, 2);
    assert!(ckpt.tensor("model.norm.weight").is_err());
}

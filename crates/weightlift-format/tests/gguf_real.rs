//! Real GGUF files: the tiny-llama files of the reference pack and the SmolLM2 demo
//! model. Expected values are what gguf-py 0.19.0's `GGUFReader` reports for the same files
//! (its `shape` is `ne`; ours is the reverse).

use std::collections::BTreeMap;
use std::path::PathBuf;

use weightlift_format::gguf;
use weightlift_format::{Checkpoint, DType, MetaArray, MetaRef, MetaValue, OpenOptions};

fn tiny(name: &str) -> PathBuf {
    weightlift_testdata::reference_file(&format!("tiny-llama/gguf/{name}"))
}

fn smollm2() -> PathBuf {
    weightlift_testdata::demo_gguf()
}

fn histogram(ck: &Checkpoint) -> BTreeMap<DType, usize> {
    let mut h = BTreeMap::new();
    for t in ck.tensors() {
        *h.entry(t.dtype).or_default() += 1;
    }
    h
}

#[test]
fn tiny_llama_q8_0_matches_gguf_py() {
    let p = tiny("tiny-llama-Q8_0.gguf");
    let bytes = std::fs::read(&p).unwrap();
    let h = gguf::parse(&bytes, &p).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.alignment, 32);
    assert_eq!(h.data_offset, 725_280);
    assert_eq!(h.tensors.len(), 20);
    let first = &h.tensors[0];
    assert_eq!(first.name, "output_norm.weight");
    assert_eq!(
        (
            first.dtype,
            first.shape.as_slice(),
            first.offset,
            first.nbytes
        ),
        (DType::F32, &[256u64][..], 725_280, 1024)
    );
    let last = &h.tensors[19];
    assert_eq!(last.name, "blk.1.ffn_up.weight");
    assert_eq!(
        (last.dtype, last.shape.as_slice(), last.offset, last.nbytes),
        (DType::Q8_0, &[768u64, 256][..], 10_896_672, 208_896)
    );
    let m = &h.metadata;
    assert_eq!(m["general.architecture"], MetaValue::String("llama".into()));
    assert_eq!(m["llama.block_count"], MetaValue::U32(2));
    assert_eq!(m["llama.rope.freq_base"], MetaValue::F32(10000.0));
    assert_eq!(m["tokenizer.ggml.add_bos_token"], MetaValue::Bool(true));
    assert_eq!(
        m["tokenizer.ggml.tokens"].as_array().map(MetaArray::len),
        Some(32000)
    );
    assert_eq!(
        m["tokenizer.ggml.scores"].as_array().map(MetaArray::len),
        Some(32000)
    );

    let ck = Checkpoint::open(&p, OpenOptions::default()).unwrap();
    let counts = histogram(&ck);
    assert_eq!(counts[&DType::Q8_0], 15);
    assert_eq!(counts[&DType::F32], 5);
    let tok = ck.tokenizer();
    assert_eq!(tok.model.as_deref(), Some("llama"));
    assert_eq!(tok.pre.as_deref(), Some("default"));
    assert_eq!((tok.n_tokens, tok.n_merges), (Some(32000), None));
    assert_eq!((tok.bos_token_id, tok.eos_token_id), (Some(1), Some(2)));
}

#[test]
fn tiny_llama_k_quants_table() {
    let p = tiny("tiny-llama-Q4_K_M.gguf");
    let ck = Checkpoint::open(&p, OpenOptions::default()).unwrap();
    let counts = histogram(&ck);
    assert_eq!(counts.get(&DType::Q4_K), Some(&12));
    assert_eq!(counts.get(&DType::Q6_K), Some(&3));
    assert_eq!(counts.get(&DType::F32), Some(&5));
    let last = ck.tensor("blk.1.ffn_up.weight").unwrap();
    assert_eq!((last.offset, last.nbytes), (8_283_680, 110_592));
}

#[test]
fn vocab_only_returns_no_tensors() {
    let p = tiny("tiny-llama-Q8_0.gguf");
    let ck = Checkpoint::open(
        &p,
        OpenOptions {
            vocab_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(ck.tensors().is_empty());
    assert_eq!(ck.tokenizer().n_tokens, Some(32000));
}

#[test]
fn smollm2_parses() {
    let p = smollm2();
    let bytes = std::fs::read(&p).unwrap();
    let h = gguf::parse(&bytes, &p).unwrap();
    assert_eq!(h.tensors.len(), 272);
    assert_eq!(h.data_offset, 1_785_664);
    let ck = Checkpoint::open(&p, OpenOptions::default()).unwrap();
    assert_eq!(ck.tensors().len(), 272);
    assert_eq!(
        ck.metadata()["llama.block_count"].as_u64(),
        Some(30),
        "30 blocks"
    );
    let counts = histogram(&ck);
    assert_eq!(counts.get(&DType::Q4_1), Some(&210));
    assert_eq!(counts.get(&DType::Q8_0), Some(&1));
    assert_eq!(counts.get(&DType::F32), Some(&61));
    let emb = ck.tensor("token_embd.weight").unwrap();
    assert_eq!(emb.shape, vec![49152, 576]);
    assert_eq!(
        (emb.dtype, emb.offset, emb.nbytes),
        (DType::Q8_0, 1_785_664, 30_081_024)
    );
    let tok = ck.tokenizer();
    assert_eq!(tok.model.as_deref(), Some("gpt2"));
    assert_eq!(tok.pre.as_deref(), Some("smollm"));
    assert_eq!((tok.n_tokens, tok.n_merges), (Some(49152), Some(48900)));
}

/// Vocabulary arrays stay in the map: lazy, decoded on demand, and alive after the checkpoint
/// is dropped. Expected elements are what gguf-py 0.19.0 reads from the same file.
#[test]
fn tiny_llama_vocabulary_is_lazy_and_outlives_the_checkpoint() {
    let p = tiny("tiny-llama-Q8_0.gguf");
    let ck = Checkpoint::open(&p, OpenOptions::default()).unwrap();
    let tokens = ck.metadata()["tokenizer.ggml.tokens"].clone();
    let types = ck.metadata()["tokenizer.ggml.token_type"].clone();
    let scores = ck.metadata()["tokenizer.ggml.scores"].clone();
    drop(ck);
    let tokens = tokens.as_array().unwrap();
    assert!(tokens.is_lazy());
    let first: Vec<&str> = tokens.iter().take(3).filter_map(MetaRef::as_str).collect();
    assert_eq!(first, ["<unk>", "<s>", "</s>"]);
    assert_eq!(tokens.get(1000), Some(MetaRef::String("ied")));
    assert_eq!(tokens.get(31_999), Some(MetaRef::String("给")));
    assert_eq!(tokens.iter().count(), 32_000);
    let types = types.as_array().unwrap();
    assert!(types.is_lazy());
    let first: Vec<MetaRef> = types.iter().take(5).collect();
    assert_eq!(
        first,
        [3, 3, 3, 6, 6].map(MetaRef::I32),
        "token types are i32"
    );
    assert_eq!(types.get(1000), Some(MetaRef::I32(1)));
    let scores = scores.as_array().unwrap();
    assert_eq!(scores.get(0), Some(MetaRef::F32(-1000.0)));
    assert_eq!(scores.len(), 32_000);
}

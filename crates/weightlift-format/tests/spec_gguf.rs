//! ModelSpec from real GGUF files (written by llama.cpp's converter) against the HF config the
//! same model came from, and the SmolLM2 demo model against its published architecture.

use std::path::PathBuf;

use weightlift_format::{Checkpoint, Format, OpenOptions, Role};

/// A file of the tiny llama's reference folder; a missing one fails the test, naming the
/// `make` target that provides it.
fn tiny(rel: &str) -> PathBuf {
    weightlift_testdata::reference_file(&format!("tiny-llama/{rel}"))
}

#[test]
fn tiny_llama_gguf_spec_matches_its_hf_config() {
    let hf_dir = tiny("safetensors");
    let hf = Checkpoint::open(&hf_dir, OpenOptions::default()).unwrap();
    let hf = hf.spec().unwrap().clone();
    for q in ["Q8_0", "Q4_K_M", "Q6_K"] {
        let p = tiny(&format!("gguf/tiny-llama-{q}.gguf"));
        let c = Checkpoint::open(&p, OpenOptions::default()).unwrap();
        assert_eq!(c.format(), Format::Gguf);
        let s = c.spec().unwrap();
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
        assert_eq!(s.rms_norm_eps as f32, 1e-5);
        // No output.weight in the file: llama.cpp reuses token_embd.
        assert!(c.tensor("output.weight").is_err());
        assert!(s.tie_word_embeddings);
        assert!(!s.attention_bias);

        let mut g = s.clone();
        g.rms_norm_eps = hf.rms_norm_eps;
        assert_eq!(g, hf, "{q}");

        assert_eq!(c.tensors().len(), 20);
        assert!(c.warnings().is_empty(), "{:?}", c.warnings());
        for t in c.tensors() {
            assert!(t.role.is_some(), "{}", t.name);
        }
        let k = c.tensor("blk.1.attn_k.weight").unwrap();
        assert_eq!((k.layer, k.role), (Some(1), Some(Role::AttnK)));
        // The same tensor in both schemes has the same role, layer and shape.
        let hk = Checkpoint::open(&hf_dir, OpenOptions::default()).unwrap();
        let hk = hk
            .tensor("model.layers.1.self_attn.k_proj.weight")
            .unwrap()
            .clone();
        assert_eq!((k.layer, k.role, &k.shape), (hk.layer, hk.role, &hk.shape));
    }
}

#[test]
fn tiny_llama_gguf_vocab_only() {
    let p = tiny("gguf/tiny-llama-Q8_0.gguf");
    let opts = OpenOptions {
        vocab_only: true,
        ..OpenOptions::default()
    };
    let c = Checkpoint::open(&p, opts).unwrap();
    assert!(c.vocab_only());
    assert!(c.tensors().is_empty());
    assert_eq!(c.spec().unwrap().vocab_size, 32000);
    assert_eq!(c.tokenizer().model.as_deref(), Some("llama"));
}

#[test]
fn smollm2_spec() {
    let p = weightlift_testdata::demo_gguf();
    let c = Checkpoint::open(&p, OpenOptions::default()).unwrap();
    let s = c.spec().unwrap();
    assert_eq!(s.architecture, "llama");
    assert_eq!(s.n_layers, 30);
    assert_eq!(s.hidden_size, 576);
    assert_eq!(s.intermediate_size, 1536);
    assert_eq!(s.n_heads, 9);
    assert_eq!(s.n_kv_heads, vec![3; 30]);
    assert_eq!(s.head_dim, 64);
    assert_eq!(s.vocab_size, 49152);
    assert_eq!(s.context_length, 8192);
    assert_eq!(s.rope_theta, 100000.0);
    assert_eq!(s.rope_dim, 64);
    assert!(s.tie_word_embeddings);
    assert!(!s.attention_bias);
    assert_eq!(c.tensors().len(), 272);
    assert_eq!(c.unknown_tensors().count(), 0);
    assert!(c.warnings().is_empty(), "{:?}", c.warnings());
    // 9 per-layer tensors in each of 30 layers, plus token_embd and output_norm.
    for layer in 0..30 {
        let n = c
            .tensors()
            .iter()
            .filter(|t| t.layer == Some(layer))
            .count();
        assert_eq!(n, 9, "layer {layer}");
    }
    assert_eq!(
        c.tensor("token_embd.weight").unwrap().role,
        Some(Role::TokenEmbd)
    );
    assert_eq!(
        c.tensor("output_norm.weight").unwrap().role,
        Some(Role::OutputNorm)
    );
}

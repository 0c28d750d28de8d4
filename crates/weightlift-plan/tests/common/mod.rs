//! Shared model specs for the planner's tests.
#![allow(dead_code)]

use weightlift_format::{DType, ModelSpec, Role, TensorInfo};
use weightlift_plan::{DeviceSpec, PlanRequest, WeightType, parse_devices, synthesize_tensors};

/// A llama-family spec (kv heads the same in every layer).
#[allow(clippy::too_many_arguments)] // mirrors the config fields one to one
pub fn llama(
    n_layers: u32,
    hidden: u64,
    inter: u64,
    heads: u32,
    kv: u32,
    head_dim: u32,
    vocab: u64,
    tied: bool,
) -> ModelSpec {
    ModelSpec {
        architecture: "llama".into(),
        n_layers,
        hidden_size: hidden,
        intermediate_size: inter,
        n_heads: heads,
        n_kv_heads: vec![kv; n_layers as usize],
        head_dim,
        vocab_size: vocab,
        context_length: 8192,
        rope_theta: 10000.0,
        rope_dim: head_dim,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tied,
        attention_bias: false,
    }
}

/// SmolLM2-135M: 30 layers, hidden 576, ffn 1536, 9 heads, 3 kv heads, head_dim 64, vocab
/// 49152, tied embeddings, context 8192 (the GGUF's metadata).
pub fn smollm2() -> ModelSpec {
    llama(30, 576, 1536, 9, 3, 64, 49152, true)
}

/// The reference pack's tiny-llama, as its `model.json` describes it.
pub fn tiny_llama() -> ModelSpec {
    let mut s = llama(2, 256, 768, 4, 2, 64, 32000, true);
    s.context_length = 512;
    s
}

pub fn request(spec: ModelSpec, w: &str, devices: &str) -> PlanRequest {
    let tensors = synthesize_tensors(&spec, WeightType::parse(w).unwrap(), None).unwrap();
    PlanRequest::new(spec, tensors, parse_devices(devices).unwrap())
}

pub fn devices(spec: &str) -> Vec<DeviceSpec> {
    parse_devices(spec).unwrap()
}

/// A toy model of `n` layers whose layer `i` holds F32 tensors of the given byte sizes (each a
/// multiple of 4), with no embedding or head: for reproducing accelerate's unit examples.
pub fn toy(layers: &[&[u64]]) -> (ModelSpec, Vec<TensorInfo>) {
    let spec = llama(layers.len() as u32, 8, 8, 1, 1, 8, 8, true);
    let mut t = Vec::new();
    for (l, sizes) in layers.iter().enumerate() {
        for (k, &b) in sizes.iter().enumerate() {
            t.push(TensorInfo {
                name: format!("{l}.m{k}.weight"),
                dtype: DType::F32,
                shape: vec![b / 4],
                nbytes: b,
                file: 0,
                offset: 0,
                layer: Some(l as u32),
                role: Some(Role::AttnNorm),
            });
        }
    }
    (spec, t)
}

//! Quantise on load under tensor parallelism, part by part: tiny-llama's bf16 safetensors
//! loaded tensor-parallel over two virtual devices with `quantize=q8_0`, and every shard a
//! device holds compared byte for byte with the matching slice of llama.cpp's own Q8_0
//! quantisation of the same weights (`tiny-llama-Q8_0.gguf` in the reference data):
//! whole rows for q/k/v/gate/up, each row's block range for o_proj/down.

use crate::common;

use std::sync::Arc;

use common::{load_planned, open, reference};
use weightlift_engine::{Held, Inventory, Model};
use weightlift_format::DType;
use weightlift_plan as wp;

/// llama.cpp's tensor names for transformers' linears.
const LINEARS: [(&str, &str); 7] = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];
const HEAD_DIM: usize = 64;
/// Q8_0: 32 values in 34 bytes.
const BLOCK: u64 = 32;
const BLOCK_BYTES: u64 = 34;

/// Rows of a q/k projection in llama.cpp's order (its converter interleaves each head's two
/// rope halves); quantised rows are independent, so whole byte rows move.
fn gguf_row_order(bytes: &[u8], rows: usize) -> Vec<u8> {
    let row = bytes.len() / rows;
    let half = HEAD_DIM / 2;
    let mut out = Vec::with_capacity(bytes.len());
    for r in 0..rows {
        let (h, k) = (r / HEAD_DIM, r % HEAD_DIM);
        let src = h * HEAD_DIM + (k % 2) * half + k / 2;
        out.extend_from_slice(&bytes[src * row..(src + 1) * row]);
    }
    out
}

#[test]
fn each_shard_is_llama_cpps_q8_0_slice() {
    let src = open(reference().join("tiny-llama/safetensors"));
    let gguf = open(reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf"));
    let mut m = Model::new(
        Arc::clone(&src),
        Inventory::parse("virtual:2x48MiB,cpu").unwrap(),
    );
    let mut req = m.plan_request().unwrap();
    req.quantize = Some(wp::Quantize::Q8_0);
    wp::PlanOptions {
        strategy: Some("tensor_parallel".into()),
        expect_cache: Some(wp::ExpectCache {
            tokens: 64,
            dtype: wp::CacheDType::F32,
        }),
        ..wp::PlanOptions::default()
    }
    .apply(&mut req)
    .unwrap();
    let plan = wp::plan(&req).unwrap();
    let _cache = load_planned(&mut m, &plan).unwrap();

    let mut shards = 0;
    for layer in 0..2 {
        for (hf, ggml) in LINEARS {
            let name = format!("model.layers.{layer}.{hf}.weight");
            let ref_name = format!("blk.{layer}.{ggml}.weight");
            let i = gguf
                .tensors()
                .iter()
                .position(|t| t.name == ref_name)
                .unwrap();
            let (want, shape) = (gguf.bytes(i), &gguf.tensors()[i].shape);
            assert_eq!(gguf.tensors()[i].dtype, DType::Q8_0, "{ref_name}");
            let Held::Split { parts, spec } = m.held(&name).unwrap() else {
                panic!("{name} is not split");
            };
            assert!(!spec.replicated && parts.len() == 2, "{name}");
            let rows = shape[0] as usize;
            let row_bytes = want.len() / rows;
            for (part, (dev, a, b)) in parts.iter().zip(&spec.shards) {
                assert_eq!(
                    (part.dtype(), part.device().name()),
                    (DType::Q8_0, dev.as_str())
                );
                let got = part.to_host().unwrap();
                let expect: Vec<u8> = if spec.axis == 1 {
                    assert!(a % BLOCK == 0 && b % BLOCK == 0, "{name}: {a}..{b}");
                    let (c0, c1) = (
                        (a / BLOCK * BLOCK_BYTES) as usize,
                        (b / BLOCK * BLOCK_BYTES) as usize,
                    );
                    want.chunks(row_bytes)
                        .flat_map(|r| r[c0..c1].to_vec())
                        .collect()
                } else {
                    want[*a as usize * row_bytes..*b as usize * row_bytes].to_vec()
                };
                let got = if hf.ends_with("q_proj") || hf.ends_with("k_proj") {
                    gguf_row_order(&got, (b - a) as usize)
                } else {
                    got
                };
                assert!(
                    got == expect,
                    "{name} on {dev} ({a}..{b}, axis {})",
                    spec.axis
                );
                shards += 1;
            }
        }
    }
    assert_eq!(shards, 28);
}

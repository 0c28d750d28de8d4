//! Architectures without a role table (cohere2 and the like): the head is tied from the tensor
//! table, the plan warns that the engine cannot run them, and sliding-window layers keep only
//! llama.cpp's SWA cache. The expected cells and layers come from llama.cpp's own log of a
//! gemma3 (tests/data/swa_reference.json, written by tests/gen_swa_reference.py) and the
//! per-layer rules from transformers' config classes. The SWA sizes are checked on an
//! architecture the engine does not run, with gemma3's layers and window, and on those it runs
//! (whose sliding layers it keeps as rings of those cells).

use crate::common;

use std::path::PathBuf;

use common::*;
use serde_json::Value;
use weightlift_format::{ModelSpec, TensorInfo};
use weightlift_plan::{
    CacheDType, CacheSpec, PlanRequest, RuntimeSpec, SlidingWindow, Strategy, WeightType, plan,
    synthesize_tensors,
};

fn reference() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/swa_reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; regenerate it with tests/gen_swa_reference.py",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

/// A table as the format crate gives it for an architecture it has no roles for: layers
/// parsed, no role anywhere.
fn without_roles(spec: &ModelSpec, arch: &str) -> (ModelSpec, Vec<TensorInfo>) {
    let mut tensors = synthesize_tensors(spec, WeightType::parse("f16").unwrap(), None).unwrap();
    for t in &mut tensors {
        t.role = None;
    }
    let mut spec = spec.clone();
    spec.architecture = arch.into();
    (spec, tensors)
}

#[test]
fn a_head_without_a_tensor_is_tied_for_every_architecture() {
    // Tied: no output.weight in the table.
    let (spec, tensors) = without_roles(&tiny_llama(), "cohere2");
    assert!(tensors.iter().all(|t| t.name != "output.weight"));
    let embd = tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .unwrap()
        .nbytes;
    let mut req = PlanRequest::new(spec, tensors, devices("virtual:64MiB,cpu"));
    req.strategy = Strategy::parse("layers").unwrap();
    req.runtime = RuntimeSpec::none();
    let p = plan(&req).unwrap();
    // llama.cpp keeps token_embd on the host and loads the tied head as a copy on the GPU.
    assert_eq!(p.embed_device(), "cpu");
    assert_eq!(p.tied_output_copy(), Some("virtual:0"));
    assert_eq!(p.tied_output_parts(), [("virtual:0".to_string(), embd)]);
    let gpu = &p.devices()[0];
    let placed: u64 = p
        .tensors()
        .iter()
        .filter(|t| t.device == "virtual:0")
        .map(|t| t.bytes)
        .sum();
    assert_eq!(gpu.weights, placed + embd, "the head is not 0 B");
    assert!(gpu.holds.iter().any(|h| h == "output (tied copy)"));
    assert!(p.devices()[1].holds.iter().any(|h| h == "token_embd"));
    // The engine does not run this architecture: the plan says so, and what it runs.
    let w = p.warnings().join("\n");
    assert!(
        w.contains("architecture 'cohere2'")
            && w.contains("llama, mistral, qwen2, qwen3, phi3, gemma2"),
        "{w}"
    );
}

#[test]
fn hf_names_are_recognised_without_roles() {
    let (spec, mut tensors) = without_roles(&tiny_llama(), "cohere2");
    for t in &mut tensors {
        if t.name == "token_embd.weight" {
            t.name = "model.embed_tokens.weight".into();
        } else if t.name == "output_norm.weight" {
            t.name = "model.norm.weight".into();
        }
    }
    let mut req = PlanRequest::new(spec, tensors, devices("virtual:64MiB,cpu"));
    req.strategy = Strategy::Sequential;
    req.runtime = RuntimeSpec::none();
    let p = plan(&req).unwrap();
    // accelerate keeps a tied head with the embedding.
    assert_eq!(p.head_device(), p.embed_device());
    let holds = &p.devices()[0].holds;
    assert!(
        holds.iter().any(|h| h == "token_embd") && holds.iter().any(|h| h == "output_norm"),
        "{}",
        p.explain()
    );
}

/// The tiny gemma3 of the reference, as a spec of an architecture the engine does not run: 8
/// layers, 1 KV head of 32, window 300, every sixth layer full (llama.cpp's gemma3 pattern).
fn gemma3_request(n_ctx: u64, n_ubatch: u64) -> PlanRequest {
    let r = reference();
    let m = &r["model"];
    let n_layers = m["n_layers"].as_u64().unwrap() as u32;
    let mut spec = llama(n_layers, 64, 128, 2, 1, 32, 64, true);
    spec.architecture = "cohere2".into();
    let tensors = synthesize_tensors(&spec, WeightType::parse("f16").unwrap(), None).unwrap();
    let mut req = PlanRequest::new(spec, tensors, devices("cpu:1GiB"));
    req.sliding_window = Some(SlidingWindow::periodic(
        m["sliding_window"].as_u64().unwrap(),
        6,
        n_layers,
    ));
    req.cache = Some(CacheSpec::new(n_ctx, 1, CacheDType::Fp16));
    req.runtime = RuntimeSpec {
        max_input_len: n_ubatch,
        ..RuntimeSpec::default()
    };
    req
}

#[test]
fn sliding_window_kv_is_llama_cpps_swa_cache() {
    let r = reference();
    let row = 2 * 32 * 2; // K and V of one cell: 1 head × 32 values × 2 B each
    for case in r["cases"].as_array().unwrap() {
        let n_ctx = case["n_ctx"].as_u64().unwrap();
        let n_ubatch = case["n_ubatch"].as_u64().unwrap();
        let cells = |c: &Value| c["cells"].as_u64().unwrap() * c["layers"].as_u64().unwrap();
        let want = (cells(&case["base"]) + cells(&case["swa"])) * row;
        let p = plan(&gemma3_request(n_ctx, n_ubatch)).unwrap();
        let kv: u64 = p.devices().iter().map(|d| d.kv).sum();
        assert_eq!(kv, want, "n_ctx {n_ctx}, n_ubatch {n_ubatch}");
        let w = p.warnings().join("\n");
        assert!(
            w.contains("layers 0-4, 6-7 attend to a sliding window of 300"),
            "{w}"
        );
    }
}

#[test]
fn engine_architectures_cut_sliding_caches_as_llama_cpp() {
    // The engine keeps a sliding layer's cache as a ring of the SWA cache's cells, so the
    // architectures it runs are planned as llama.cpp sizes them, as the others are.
    let r = reference();
    let row = 2 * 32 * 2;
    for arch in ["mistral", "qwen2", "gemma3", "gemma2"] {
        for case in r["cases"].as_array().unwrap() {
            let (n_ctx, n_ubatch) = (
                case["n_ctx"].as_u64().unwrap(),
                case["n_ubatch"].as_u64().unwrap(),
            );
            let cells = |c: &Value| c["cells"].as_u64().unwrap() * c["layers"].as_u64().unwrap();
            let mut req = gemma3_request(n_ctx, n_ubatch);
            req.spec.architecture = arch.into();
            let p = plan(&req).unwrap();
            let kv: u64 = p.devices().iter().map(|d| d.kv).sum();
            assert_eq!(
                kv,
                (cells(&case["base"]) + cells(&case["swa"])) * row,
                "{arch} {n_ctx} {n_ubatch}"
            );
            assert!(
                p.warnings()
                    .iter()
                    .all(|w| !w.contains("keeps every position")),
                "{:?}",
                p.warnings()
            );
        }
    }
}

#[test]
fn hf_config_rules_follow_transformers() {
    let r = reference();
    let cases = r["hf_configs"]["cases"].as_array().unwrap();
    assert!(cases.len() >= 6);
    for case in cases {
        let config = &case["config"];
        let model_type = config["model_type"].as_str().unwrap();
        let mut spec = llama(8, 64, 128, 2, 1, 32, 64, true);
        spec.architecture = model_type.into();
        let got = SlidingWindow::from_hf_config(config, &spec).unwrap();
        let want: Option<Vec<bool>> = match (&case["sliding_window"], &case["layer_types"]) {
            (Value::Null, _) | (_, Value::Null) => None,
            (_, Value::Array(types)) => {
                let v: Vec<bool> = types.iter().map(|t| t == "sliding_attention").collect();
                v.iter().any(|&s| s).then_some(v)
            }
            other => panic!("unexpected reference {other:?}"),
        };
        assert_eq!(
            got.as_ref().map(|w| w.layers.clone()),
            want,
            "{model_type}: {config}"
        );
        if let Some(w) = got {
            assert_eq!(Some(w.window), case["sliding_window"].as_u64());
        }
    }
}

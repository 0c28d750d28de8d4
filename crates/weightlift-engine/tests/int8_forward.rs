//! LLM.int8 linears ([`DType::INT8`], quantised on load) run on the host path and through the
//! backend op sequence: tiny-qwen2 with every projection of its layers held as int8 rows against
//! bitsandbytes' LLM.int8 product in transformers' forward pass, tiny-llama against
//! transformers' float32 logits, a `quantize=int8` plan end to end, and the two paths against
//! each other bit for bit.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{
    argmax, forward_all, json_ids, load_planned, max_abs_diff, open, read_npy, reference,
};
use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::{
    Cache, CacheDType, EngineError, Inventory, LoadOptions, Model, Placement, Source,
};
use weightlift_format::{DType, Role};

fn tiny_llama() -> Arc<dyn Source> {
    open(reference().join("tiny-llama/safetensors"))
}

fn tiny_ids() -> Vec<u32> {
    json_ids(&reference().join("tiny-llama/ids.json"), "ids")
}

/// The projections of the decoder layers, the tensors `quantize="int8"` holds as INT8 (the
/// embedding and the head stay float, as transformers' `load_in_8bit` keeps them).
fn is_layer_linear(role: Option<Role>, layer: Option<u32>) -> bool {
    layer.is_some()
        && matches!(
            role,
            Some(
                Role::AttnQ
                    | Role::AttnK
                    | Role::AttnV
                    | Role::AttnOutput
                    | Role::FfnGate
                    | Role::FfnUp
                    | Role::FfnDown
            )
        )
}

/// `src` whole on `device`, its layer projections held as INT8 (the loader quantises them row
/// by row on the way), with a cache of 64 positions.
fn load_int8(src: &Arc<dyn Source>, devices: &str, device: &str) -> (Model, Arc<Cache>) {
    let mut m = Model::new(Arc::clone(src), Inventory::parse(devices).unwrap());
    let config = m.cache_config(64, 1, CacheDType::F32, false).unwrap();
    let cache = Arc::new(Cache::new(config).unwrap());
    let mut p = Placement::all_on(src.as_ref(), device, m.n_layers());
    let mut n = 0;
    for (t, info) in p.tensors.iter_mut().zip(src.tensors()) {
        if is_layer_linear(info.role, info.layer) {
            t.dtype = DType::INT8;
            n += 1;
        }
    }
    assert_eq!(
        n,
        7 * m.n_layers() as usize,
        "the projections of every layer"
    );
    m.load(&p, &LoadOptions::default(), Some(&cache), true, &mut |_| {
        true
    })
    .unwrap_or_else(|e| panic!("loading tiny-llama with int8 linears: {e}"));
    (m, cache)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn tiny_qwen2() -> Arc<dyn Source> {
    open(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/tiny-qwen2"))
}

fn int8_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/int8")
}

/// tiny-qwen2 (q/k/v biases) with int8 projections against bitsandbytes' LLM.int8 product
/// put in place of transformers' projections (`tests/gen_int8_logits.py`), at threshold 6 and 0:
/// each product is bitsandbytes' bit for bit but for the order of its outlier sum, and the rest
/// of the pass is transformers' to f32 rounding, so the logits (up to 5.9) agree to 2e-5
/// (2.4e-6 measured). The int8 error itself, against transformers' float32 logits, is up to
/// 0.38 here (bound 0.5); the argmax is the same at every position.
#[test]
fn int8_logits_match_bitsandbytes_llm_int8_on_tiny_qwen2() {
    let src = tiny_qwen2();
    let ids = json_ids(&int8_data().join("meta.json"), "ids");
    let (shape, float) = read_npy(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/data/tiny-qwen2/hf_logits.npy"),
    );
    for (threshold, file) in [(6.0, "tiny_qwen2_t6.npy"), (0.0, "tiny_qwen2_t0.npy")] {
        let (_, want) = read_npy(&int8_data().join(file));
        for compute in [Compute::Exact, Compute::Fast] {
            let (mut m, cache) = load_int8(&src, "cpu", "cpu");
            m.set_compute(compute);
            m.set_int8_threshold(threshold).unwrap();
            let out = forward_all(&mut m, &cache, &ids);
            assert_eq!(out.len(), shape[0] * shape[1]);
            let d = max_abs_diff(&out, &want);
            let d_float = max_abs_diff(&out, &float);
            eprintln!(
                "threshold {threshold} ({}): max|Δ| {d:.2e} vs bitsandbytes, {d_float:.3} vs \
                 float32",
                compute.name()
            );
            assert!(
                d <= 2e-5,
                "threshold {threshold}: max|Δ| {d} against bitsandbytes"
            );
            assert!(
                d_float <= 0.5,
                "threshold {threshold}: max|Δ| {d_float} against f32"
            );
            for (i, (a, b)) in out.chunks(shape[1]).zip(float.chunks(shape[1])).enumerate() {
                assert_eq!(argmax(a), argmax(b), "threshold {threshold}: position {i}");
            }
        }
    }
}

/// tiny-llama (bf16 weights, 32000-token vocabulary): int8 projections move the logits (up to
/// 8.5) by at most 0.6 from transformers' float32 ones (0.49 measured), and keep the argmax
/// wherever the float margin is above that.
#[test]
fn int8_tiny_llama_stays_within_its_bound_of_the_float_logits() {
    let src = tiny_llama();
    let ids = tiny_ids();
    let (shape, hf) = read_npy(&reference().join("tiny-llama/hf_logits.npy"));
    let (mut m, cache) = load_int8(&src, "cpu", "cpu");
    let out = forward_all(&mut m, &cache, &ids);
    assert_eq!(out.len(), hf.len());
    let d = max_abs_diff(&out, &hf);
    let scale = hf.iter().fold(0f32, |a, v| a.max(v.abs()));
    eprintln!("tiny-llama int8: max|Δ| {d:.4} vs transformers f32 (max|logit| {scale:.3})");
    assert!(d <= 0.6, "max|Δ| {d}");
    for (i, (a, b)) in out.chunks(shape[1]).zip(hf.chunks(shape[1])).enumerate() {
        if common::margin(b) > 0.6 {
            assert_eq!(argmax(a), argmax(b), "position {i}");
        }
    }
}

/// The backend op sequence (`Op::Int8Matmul` on the CPU backend, the op a cuda device runs)
/// gives the host path's logits bit for bit, on cpu and on a virtual device, for a prompt and
/// for decoding after it.
#[test]
fn int8_host_path_and_backend_path_agree_bit_for_bit() {
    let qwen_ids = json_ids(&int8_data().join("meta.json"), "ids");
    let cases = [
        (tiny_llama(), tiny_ids(), "cpu", "cpu"),
        (tiny_llama(), tiny_ids(), "virtual:64MiB,cpu", "virtual:0"),
        (tiny_qwen2(), qwen_ids, "cpu", "cpu"),
    ];
    for (src, ids, devices, device) in cases {
        let mut runs = Vec::new();
        for backend in [false, true] {
            let (mut m, cache) = load_int8(&src, devices, device);
            m.set_host_backend(backend);
            let mut all = forward_all(&mut m, &cache, &ids[..12]);
            let mut out = Vec::new();
            for id in &ids[12..] {
                m.forward(&[*id], Some(&cache), Logits::Last, &mut out)
                    .unwrap();
                all.extend_from_slice(&out);
            }
            runs.push(all);
        }
        assert_eq!(bits(&runs[0]), bits(&runs[1]), "{device}");
    }
}

/// The outlier threshold is a runtime setting: 6.0 by default (transformers'
/// `llm_int8_threshold`), 0 quantises every column, and a value that is not a finite number of
/// at least 0 is refused by name.
#[test]
fn the_int8_threshold_is_a_checked_runtime_setting() {
    let src = tiny_qwen2();
    let ids = json_ids(&int8_data().join("meta.json"), "ids");
    let (mut m, cache) = load_int8(&src, "cpu", "cpu");
    assert_eq!(m.int8_threshold(), 6.0);
    let default = forward_all(&mut m, &cache, &ids);
    m.set_int8_threshold(0.0).unwrap();
    let none = forward_all(&mut m, &cache, &ids);
    // a huge threshold also leaves no column out, through the other branch of the kernel
    m.set_int8_threshold(1e30).unwrap();
    let huge = forward_all(&mut m, &cache, &ids);
    assert_eq!(bits(&none), bits(&huge));
    let d = max_abs_diff(&default, &none);
    eprintln!("threshold 6 vs 0: max|Δ| {d:.2e}");
    for bad in [f32::NAN, -1.0, f32::INFINITY] {
        let e = m.set_int8_threshold(bad).unwrap_err();
        assert!(matches!(e, EngineError::Invalid { .. }), "{e}");
        assert!(e.to_string().contains("int8_threshold"), "{e}");
    }
    assert_eq!(m.int8_threshold(), 1e30);
}

/// End to end through the planner: `quantize=int8` plans the projections as INT8 (sized with
/// their row scales) on a virtual device, the loader quantises them on the way, the memory held
/// there is the plan's (within 1 %, the planner tests' rule), and the forward pass gives the
/// logits of the placement built by hand on cpu bit for bit.
#[test]
fn a_planned_int8_load_runs_and_equals_the_hand_placed_one() {
    let src = tiny_llama();
    let ids = tiny_ids();
    let inv = Inventory::parse("virtual:64MiB,cpu").unwrap();
    let mut m = Model::new(Arc::clone(&src), inv);
    let mut req = m.plan_request().unwrap();
    req.quantize = Some(weightlift_plan::Quantize::Int8);
    req.cache = Some(weightlift_plan::CacheSpec::new(
        64,
        1,
        weightlift_plan::CacheDType::F32,
    ));
    let plan = weightlift_plan::plan(&req).unwrap();
    let int8: Vec<_> = plan
        .tensors()
        .iter()
        .filter(|t| t.dtype == DType::INT8)
        .collect();
    assert_eq!(int8.len(), 7 * m.n_layers() as usize);
    assert!(int8.iter().all(|t| t.device == "virtual:0"), "{int8:?}");
    let cache = load_planned(&mut m, &plan).unwrap();
    let planned = forward_all(&mut m, &cache, &ids);
    let mem = m.memory();
    let d = plan
        .devices()
        .iter()
        .find(|d| d.name == "virtual:0")
        .unwrap();
    let want = d.weights + d.kv + d.scratch;
    let got = mem
        .iter()
        .find(|(n, _)| *n == d.name)
        .map_or(0, |(_, b)| *b);
    assert!(
        got.abs_diff(want) <= want / 100,
        "virtual:0: plan {want} B, held {got} B"
    );
    let (mut h, hcache) = load_int8(&src, "cpu", "cpu");
    let by_hand = forward_all(&mut h, &hcache, &ids);
    assert_eq!(bits(&planned), bits(&by_hand));
}

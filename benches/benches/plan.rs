//! Planner benches on a Llama-3.1-405B-class config (hidden 16384, 126 layers, 128 heads,
//! 8 KV heads, intermediate 53248, vocab 128256), planned from the config alone in q4_k_m on
//! 8 × 80 GiB devices. Targets: `plan` < 10 ms, `fit` < 100 ms.
//!
//! Baseline measured in the same run: cloning the synthesized tensor table (1,137 tensors) —
//! the least a planner that produced a per-tensor answer could do.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use weightlift_format::ModelSpec;
use weightlift_plan::{
    CacheDType, CacheSpec, FitTarget, LayerOptions, PlanRequest, Strategy, TpOptions, WeightType,
    fit, parse_devices, plan, synthesize_tensors,
};

fn spec_405b() -> ModelSpec {
    ModelSpec {
        architecture: "llama".into(),
        n_layers: 126,
        hidden_size: 16384,
        intermediate_size: 53248,
        n_heads: 128,
        n_kv_heads: vec![8; 126],
        head_dim: 128,
        vocab_size: 128256,
        context_length: 131072,
        rope_theta: 500000.0,
        rope_dim: 128,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        attention_bias: false,
    }
}

fn request(strategy: Strategy) -> PlanRequest {
    let spec = spec_405b();
    let tensors = synthesize_tensors(&spec, WeightType::parse("q4_k_m").expect("preset"), None)
        .expect("synth");
    let devices = parse_devices("virtual:8x80GiB,cpu:512GiB").expect("devices");
    let mut req = PlanRequest::new(spec, tensors, devices);
    req.strategy = strategy;
    req.cache = Some(CacheSpec::new(32768, 1, CacheDType::Q8));
    req
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_405b_q4_k_m_8x80GiB");
    g.measurement_time(Duration::from_secs(3));
    let req = request(Strategy::Autosplit);
    g.bench_function("baseline_clone_tensor_table", |b| {
        b.iter(|| black_box(req.tensors.clone()))
    });
    g.bench_function("synthesize_tensors", |b| {
        b.iter(|| {
            black_box(synthesize_tensors(
                &req.spec,
                WeightType::parse("q4_k_m").expect("preset"),
                None,
            ))
        })
    });
    for (name, strategy) in [
        ("plan_autosplit", Strategy::Autosplit),
        ("plan_balanced", Strategy::Balanced),
        ("plan_layers", Strategy::Layers(LayerOptions::default())),
        (
            "plan_tensor_parallel",
            Strategy::TensorParallel(TpOptions::default()),
        ),
    ] {
        let r = request(strategy);
        g.bench_function(name, |b| {
            b.iter(|| black_box(plan(black_box(&r)).expect("fits")))
        });
    }
    // fit: batch 4 with an fp16 cache, so the 128k context does not fit and the search runs.
    let mut fit_req = request(Strategy::Autosplit);
    fit_req.devices = parse_devices("virtual:8x80GiB,cpu:64GiB").expect("devices");
    fit_req.cache = Some(CacheSpec::new(32768, 8, CacheDType::Fp16));
    let answer = fit(&fit_req, FitTarget::MaxSeqLen).expect("fit");
    eprintln!("fit(405B q4_k_m, 8 x 80 GiB, fp16 cache, batch 8) = max_seq_len {answer}");
    g.bench_function("fit_max_seq_len_autosplit", |b| {
        b.iter(|| black_box(fit(black_box(&fit_req), FitTarget::MaxSeqLen).expect("fit")))
    });
    let layers = request(Strategy::Layers(LayerOptions::default()));
    g.bench_function("fit_n_gpu_layers", |b| {
        b.iter(|| black_box(fit(black_box(&layers), FitTarget::NGpuLayers).expect("fit")))
    });
    g.finish();
}

criterion_group!(plan_benches, benches);
criterion_main!(plan_benches);

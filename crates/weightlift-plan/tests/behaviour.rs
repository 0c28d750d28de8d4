//! Device maps, out-of-memory reports, fit, JSON, explain and SVG.

use crate::common;

use common::*;
use weightlift_format::DType;
use weightlift_plan::*;

fn map_req(entries: &[(&str, &str)], overrides: &[(&str, &str)]) -> PlanRequest {
    let mut req = request(smollm2(), "q4_1", "virtual:2x1GiB,cpu:4GiB,disk");
    req.strategy = Strategy::Map(DeviceMap {
        entries: entries
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect(),
        overrides: overrides
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect(),
    });
    req
}

#[test]
fn device_map_prefixes_ranges_and_overrides() {
    let req = map_req(
        &[
            ("model.embed_tokens", "cpu"),
            ("layers.0-14", "virtual:0"),
            ("blk.15-29", "1"),
            ("model.norm", "virtual:1"),
        ],
        &[(r"blk\.\d+\.ffn_(up|gate)", "cpu")],
    );
    let p = plan(&req).unwrap();
    assert_eq!(p.device_of("token_embd.weight").as_deref(), Some("cpu"));
    assert_eq!(
        p.device_of("blk.3.attn_q.weight").as_deref(),
        Some("virtual:0")
    );
    assert_eq!(
        p.device_of("blk.20.attn_q.weight").as_deref(),
        Some("virtual:1")
    );
    assert_eq!(
        p.device_of("blk.20.ffn_down.weight").as_deref(),
        Some("virtual:1")
    );
    assert_eq!(p.device_of("blk.20.ffn_up.weight").as_deref(), Some("cpu"));
    assert_eq!(
        p.device_of("output_norm.weight").as_deref(),
        Some("virtual:1")
    );
    assert_eq!(p.layer_devices()[14], "virtual:0");
    assert_eq!(p.layer_devices()[15], "virtual:1");
    // accelerate ties lm_head to embed_tokens: the head is where the embedding is.
    assert_eq!(p.head_device(), "cpu");
    // A default entry covers the rest.
    let p = plan(&map_req(&[("", "cpu"), ("blk.0", "virtual:0")], &[])).unwrap();
    assert_eq!(
        p.device_of("blk.0.attn_k.weight").as_deref(),
        Some("virtual:0")
    );
    assert_eq!(p.device_of("blk.1.attn_k.weight").as_deref(), Some("cpu"));
    // Plain name prefixes.
    let p = plan(&map_req(&[("", "cpu"), ("blk.2.attn_q", "disk")], &[])).unwrap();
    assert_eq!(p.device_of("blk.2.attn_q.weight").as_deref(), Some("disk"));
}

#[test]
fn device_map_errors_name_the_tensors() {
    let e = plan(&map_req(&[("blk.0-29", "cpu")], &[]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("leaves 2 tensor(s) without a device: token_embd.weight, output_norm.weight"),
        "{e}"
    );
    let e = plan(&map_req(
        &[
            ("", "cpu"),
            ("blk.0-3", "virtual:0"),
            ("blk.3", "virtual:1"),
        ],
        &[],
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("tensor 'blk.3.attn_norm.weight' is matched by 'blk.0-3' -> virtual:0 and by 'blk.3' -> virtual:1"),
        "{e}"
    );
    let e = plan(&map_req(&[("", "cuda:7")], &[]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown device 'cuda:7' in device_map"), "{e}");
    let e = plan(&map_req(&[("", "cpu")], &[("blk(", "cpu")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("invalid regex override 'blk('"), "{e}");
    assert_eq!(
        DeviceMap::parse_overrides(r"blk\.\d+\.ffn_.*=cpu,output=cuda:0").unwrap(),
        [
            (r"blk\.\d+\.ffn_.*".to_string(), "cpu".to_string()),
            ("output".into(), "cuda:0".into())
        ]
    );
}

fn big_req() -> PlanRequest {
    // Llama-3-8B-like in f16 (~15 GiB) on 2 × 8 GiB and a 4 GiB cpu: fits with an fp16 8k
    // cache, not with the fp16 32k one (4 GiB) set here. Each device that computes layers holds
    // the 2048-token workspace, 434.51 MiB (x, xn, q, att: 2048 × 4096 × 4 B = 32 MiB each; k,
    // v: 8 MiB each; gate, up: 2048 × 14336 × 4 B = 112 MiB each; 2 MiB of key/value tiles; 64
    // MiB of scores, 32 heads × 2048 × 256; 0.5 MiB of softmax stats), plus 15.66 MiB of logits
    // (32 rows × 128256) where the head is: 450.16 MiB.
    let mut spec = llama(32, 4096, 14336, 32, 8, 128, 128256, false);
    spec.context_length = 131072;
    let mut req = request(spec, "float16", "virtual:2x8GiB,cpu:4GiB");
    req.cache = Some(CacheSpec::new(32768, 1, CacheDType::Fp16));
    req
}

#[test]
fn out_of_memory_names_devices_and_checked_fixes() {
    let mut req = big_req();
    req.dtype = DTypeChoice::Auto;
    // The model's full context, 131072 tokens: a 16 GiB fp16 cache (512 MiB per layer). At
    // 32768 the GPUs keep most layers, and the KV of the few left to the host fits the cpu, so
    // disk offload would fix it; at 131072 it cannot (see below).
    req.cache = Some(CacheSpec::new(131072, 1, CacheDType::Fp16));
    let err = plan(&req).unwrap_err();
    let PlanError::OutOfMemory(oom) = &err else {
        panic!("expected OutOfMemory, got {err}");
    };
    let msg = err.to_string();
    assert!(
        msg.starts_with("out of memory: the model does not fit with strategy autosplit"),
        "{msg}"
    );
    assert!(!oom.shortfalls.is_empty());
    for s in &oom.shortfalls {
        assert!(s.needed > s.available);
        assert!(msg.contains(&s.device), "{msg}");
    }
    assert!(msg.contains("kv at ctx 131072"), "{msg}");
    // The fixes were each checked by re-planning: ctx N fits must really fit.
    let ctx_fix = oom
        .fixes
        .iter()
        .find(|f| f.starts_with("ctx "))
        .expect("a ctx fix");
    let n: u64 = ctx_fix.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut r2 = req.clone();
    r2.cache = Some(CacheSpec::new(n, 1, CacheDType::Fp16));
    plan(&r2).expect("the suggested ctx fits");
    // Layers left on disk are computed by the host and keep their KV in host RAM: the GPUs
    // hold 8 layers each (416 MiB of weights + 512 MiB of KV per layer, beside the workspace),
    // and the KV of the other 16 layers, 8 GiB, cannot sit in the 4 GiB cpu, so disk offload is
    // no fix here.
    assert!(
        !oom.fixes.iter().any(|f| f.contains("--allow-disk")),
        "{:?}",
        oom.fixes
    );
    // Bigger than the GPUs and the cpu together: no cache type alone saves it (even with q4,
    // 4.5 GiB, the cpu would need 5.69 GiB for 6 layers, the embedding, the head, their KV and
    // the workspace).
    assert!(
        oom.fixes.iter().any(|f| f.starts_with("cache q4 saves")),
        "{:?}",
        oom.fixes
    );
}

#[test]
fn cache_fix_is_offered_when_it_fits() {
    // Weights fit; an fp16 cache at 32k (4 GiB) does not, q8 (2.13 GiB) does. A 4 GiB cpu
    // would take the layers that the GPUs cannot, fp16 cache and all, beside its 450 MiB
    // workspace; a 1.5 GiB one cannot (it is short by 657 MiB).
    let mut spec = llama(32, 4096, 14336, 32, 8, 128, 128256, false);
    spec.context_length = 32768;
    let mut req = request(spec, "q4_k_m", "virtual:2x4GiB,cpu:1536MiB");
    req.cache = Some(CacheSpec::new(32768, 1, CacheDType::Fp16));
    let e = plan(&req).unwrap_err();
    let PlanError::OutOfMemory(oom) = &e else {
        panic!("{e}")
    };
    let fix = oom
        .fixes
        .iter()
        .find(|f| f.starts_with("cache "))
        .expect("cache fix");
    assert!(fix.ends_with("and fits"), "{fix}");
    let dtype = CacheDType::parse(fix.split_whitespace().nth(1).unwrap()).unwrap();
    req.cache = Some(CacheSpec::new(32768, 1, dtype));
    plan(&req).expect("suggested cache dtype fits");
}

#[test]
fn reserve_and_max_memory_are_respected() {
    let mut req = request(smollm2(), "q4_1", "virtual:2x1GiB,cpu:4GiB");
    req.runtime = RuntimeSpec::none();
    req.strategy = Strategy::Sequential;
    req.max_memory.insert("virtual:0".into(), 40 << 20);
    req.reserve.insert("virtual:1".into(), 900 << 20);
    let p = plan(&req).unwrap();
    let d0 = &p.devices()[0];
    assert_eq!(d0.capacity, 40 << 20);
    assert!(d0.used() <= 40 << 20);
    assert_eq!(p.devices()[1].reserve, 900 << 20);
    // Unknown names are an error.
    req.reserve.insert("cuda:3".into(), 1);
    let e = plan(&req).unwrap_err().to_string();
    assert!(e.contains("unknown device 'cuda:3' in reserve"), "{e}");
    // Reserve lists follow accelerator order.
    let mut r = request(smollm2(), "q4_1", "cpu,virtual:2x1GiB");
    PlanOptions {
        reserve: Some(PerDevice::List(vec![256 << 20, 64 << 20])),
        ..PlanOptions::default()
    }
    .apply(&mut r)
    .unwrap();
    assert_eq!(r.reserve["virtual:1"], 64 << 20);
    assert!(!r.reserve.contains_key("cpu"));
}

#[test]
fn fit_finds_the_largest_context_batch_and_layers() {
    let mut req = big_req();
    req.devices = devices("virtual:2x12GiB,cpu:3GiB");
    let ctx = fit(&req, FitTarget::MaxSeqLen).unwrap();
    assert!(ctx < req.spec.context_length, "{ctx}");
    assert_eq!(ctx % 256, 0);
    let mut r = req.clone();
    r.cache = Some(CacheSpec::new(ctx, 1, CacheDType::Fp16));
    plan(&r).unwrap();
    r.cache = Some(CacheSpec::new(ctx + 256, 1, CacheDType::Fp16));
    assert!(matches!(plan(&r), Err(PlanError::OutOfMemory(_))));

    req.cache = Some(CacheSpec::new(4096, 1, CacheDType::Q4));
    let b = fit(&req, FitTarget::BatchSize).unwrap();
    assert!(b > 1);
    let mut r = req.clone();
    r.cache = Some(CacheSpec::new(4096, b + 1, CacheDType::Q4));
    assert!(plan(&r).is_err());

    let mut l = req.clone();
    l.strategy = Strategy::Layers(LayerOptions::default());
    l.devices = devices("virtual:8GiB,cpu:64GiB");
    let n = fit(&l, FitTarget::NGpuLayers).unwrap();
    assert!(n > 0 && n < 33, "{n}");
    let e = fit(&req, FitTarget::NGpuLayers).unwrap_err().to_string();
    assert!(e.contains("the layers strategy"), "{e}");
    // Nothing fits at all: fit returns the OutOfMemory of the smallest setting.
    let mut tiny = req.clone();
    tiny.devices = devices("virtual:1GiB,cpu:1GiB");
    assert!(matches!(
        fit(&tiny, FitTarget::MaxSeqLen),
        Err(PlanError::OutOfMemory(_))
    ));
}

#[test]
fn json_round_trip_explain_and_svg() {
    let mut req = request(smollm2(), "q4_1", "virtual:2x72MiB,cpu:1GiB");
    req.cache = Some(CacheSpec::new(1024, 1, CacheDType::Q8));
    req.runtime = RuntimeSpec {
        max_input_len: 64,
        max_attention_size: 64 * 64,
        max_dq_size: 1 << 20,
        low_mem: false,
    };
    let p = plan(&req).unwrap();
    let j = p.to_json();
    let back = Plan::from_json(&j).unwrap();
    assert_eq!(back, p);
    assert_eq!(back.to_json(), j);
    // The `plan` keyword (`Model.load(plan)`) is the same JSON.
    let kw = Keywords::from_json(serde_json::json!({ "plan": j })).unwrap();
    assert_eq!(kw.get::<Plan>("plan").unwrap(), Some(p.clone()));
    assert!(
        Plan::from_json("{")
            .unwrap_err()
            .to_string()
            .starts_with("plan json is invalid")
    );
    let e = p.explain();
    assert!(
        e.contains("virtual:0") && e.contains("layers 0-") && e.contains("(MiB)"),
        "{e}"
    );
    let svg = p.to_svg();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("virtual:1") && svg.contains("kv cache") && svg.contains("layers "));
    if let Ok(dir) = std::env::var("WEIGHTLIFT_PLAN_SVG_DIR") {
        std::fs::write(format!("{dir}/smollm2.svg"), &svg).unwrap();
    }
}

#[test]
fn weight_dtype_conversion_applies_to_floats_only() {
    let mut req = request(tiny_llama(), "bfloat16", "cpu:1GiB");
    req.dtype = DTypeChoice::Float32;
    let p = plan(&req).unwrap();
    assert_eq!(
        p.tensors().iter().map(|t| t.bytes).sum::<u64>(),
        4 * 9_766_144
    );
    let mut req = request(tiny_llama(), "q4_k_m", "cpu:1GiB");
    req.dtype = DTypeChoice::Float16;
    let p = plan(&req).unwrap();
    // Quantised tensors stay; the F32 norms become F16.
    assert_eq!(p.tensors()[0].bytes, 6_720_000);
    let norm = p
        .tensors()
        .iter()
        .find(|t| t.name == "output_norm.weight")
        .unwrap();
    assert_eq!(norm.bytes, 512);
    // Converted CPU tensors are owned copies, not mmap views.
    assert!(p.host().owned_weights >= 512);
}

#[test]
fn allow_disk_fix_is_offered_when_it_fits() {
    let mut req = big_req();
    req.cache = Some(CacheSpec::new(8192, 1, CacheDType::Fp16));
    // The 8k cache fits big_req's 2 × 8 GiB; on 2 × 6 GiB the GPUs hold 12 layers each and the
    // other 8 layers, the embedding and the head (5.21 GiB of weights, 256 MiB of KV) overflow
    // the 4 GiB cpu, which can still hold a few layers and the KV and compute of those left on
    // disk.
    req.devices = devices("virtual:2x6GiB,cpu:4GiB");
    let e = plan(&req).unwrap_err();
    let PlanError::OutOfMemory(oom) = &e else {
        panic!("{e}")
    };
    assert!(
        oom.fixes.iter().any(|f| f.contains("--allow-disk")),
        "{:?}",
        oom.fixes
    );
    req.allow_disk = true;
    let p = plan(&req).expect("the suggested --allow-disk fits");
    // With a disk to spill to, the layers take the host first and the embedding, a lookup
    // that reads a few rows per token, is what the 4 GiB cpu leaves on disk.
    assert_eq!(p.embed_device(), "disk");
    assert!(p.layer_devices()[24..].iter().all(|d| d == "cpu"));
    // On a 3 GiB cpu, layers 29-31 stay on disk too.
    req.devices = devices("virtual:2x6GiB,cpu:3GiB");
    let p = plan(&req).expect("the suggested --allow-disk fits");
    assert!(p.host().disk_weights > 0);
    // The KV and compute scratch of the disk layers are the host's.
    let disk = p.devices().iter().find(|d| d.name == "disk").unwrap();
    assert_eq!((disk.kv, disk.scratch), (0, 0));
    let cpu = p.devices().iter().find(|d| d.name == "cpu").unwrap();
    let kv_layer = CacheSpec::new(8192, 1, CacheDType::Fp16).layer_bytes(&req.spec, 0);
    let host_layers = p
        .layer_devices()
        .iter()
        .filter(|d| *d == "cpu" || *d == "disk")
        .count() as u64;
    assert!(p.layer_devices().iter().any(|d| d == "disk"));
    assert_eq!(cpu.kv, host_layers * kv_layer);
    assert_eq!(p.host().kv, cpu.kv);
    assert!(cpu.used() <= cpu.capacity, "{}", p.explain());
}

/// Engine report: `virtual:1x4MiB,cpu:8MiB,disk`, sequential, allow_disk: everything went to
/// disk and the plan put 31 MiB of staging (and no compute scratch at all) on the 8 MiB cpu
/// without an error, because a device holding no weights and no kv was never checked, and the
/// disk layers' compute was charged nowhere.
#[test]
fn host_staging_and_disk_compute_count_against_a_small_cpu() {
    let mut req = request(tiny_llama(), "float32", "virtual:1x4MiB,cpu:8MiB,disk");
    req.strategy = Strategy::Sequential;
    req.allow_disk = true;
    // Staging buffers of 64 MiB (each bounded by the largest tensor): with the 4 MiB default
    // the 100 MiB cpu below would take the layers, and this test is about layers on disk.
    req.staging_bytes = 64 << 20;
    let e = plan(&req).unwrap_err();
    let PlanError::OutOfMemory(oom) = &e else {
        panic!("expected OutOfMemory, got {e}")
    };
    let cpu = oom
        .shortfalls
        .iter()
        .find(|s| s.device == "cpu")
        .unwrap_or_else(|| panic!("the cpu is short: {e}"));
    assert_eq!(cpu.available, 8 << 20);
    let msg = e.to_string();
    assert!(msg.contains("staging"), "{msg}");
    assert!(msg.contains("disk layers 0-1"), "{msg}");
    // No cheaper option helps (the staging alone is over 8 MiB): the fix is the memory the
    // cpu needs, checked by re-planning.
    let fix = oom
        .fixes
        .iter()
        .find(|f| f.starts_with("cpu with "))
        .unwrap_or_else(|| panic!("{:?}", oom.fixes));
    assert!(fix.ends_with(" fits"), "{fix}");
    // With room for the compute but not the weights, the layers stay on disk and the cpu
    // carries their compute scratch on top of the staging buffers: 2 × 31.25 MiB of staging
    // (the f32 embedding is the largest tensor) and the 2048-token workspace, 34.23 MiB
    // (x, xn, q, att: 2 MiB each; k, v: 1 MiB each; gate, up: 6 MiB each; 8 MiB of scores, 4
    // heads × 2048 × 256; 0.25 MiB of key/value tiles; 3.91 MiB of logits, 32 × 32000; and
    // the softmax stats, positions and frequencies), 96.73 MiB in all, leave 3.27 MiB of the
    // 100 MiB: not enough for the 37.25 MiB of weights.
    req.devices = devices("virtual:1x4MiB,cpu:100MiB,disk");
    let p = plan(&req).unwrap();
    assert!(
        p.layer_devices().iter().all(|d| d == "disk"),
        "{}",
        p.explain()
    );
    let cpu = p.devices().iter().find(|d| d.name == "cpu").unwrap();
    assert_eq!(cpu.weights, 0);
    assert!(cpu.scratch > p.host().staging, "{}", p.explain());
    assert_eq!(p.host().scratch + p.host().staging, cpu.scratch);
    assert!(cpu.used() <= cpu.capacity);
}

#[test]
fn disk_spill_when_allowed() {
    let mut req = big_req();
    req.cache = None;
    // ~15 GiB of weights with no cache fit 2 × 8 GiB and 4 GiB; 2 × 6 GiB and 4 GiB, with a
    // 434.51 MiB workspace on each GPU and 450.16 MiB on the cpu, do not.
    req.devices = devices("virtual:2x6GiB,cpu:4GiB");
    req.strategy = Strategy::Sequential;
    req.allow_disk = true;
    let p = plan(&req).unwrap();
    assert!(p.host().disk_weights > 0);
    assert!(p.warnings().iter().any(|w| w.contains("stay on disk")));
    assert!(p.layer_devices().iter().any(|d| d == "disk"));
}

#[test]
fn plan_options_map_the_python_keywords() {
    let spec = smollm2();
    let tensors = synthesize_tensors(&spec, WeightType::parse("q4_1").unwrap(), None).unwrap();
    let devs = devices("virtual:2x72MiB,cpu:1GiB");
    // No strategy + n_gpu_layers -> llama.cpp layers.
    let req = PlanOptions {
        n_gpu_layers: Some(10),
        reserve: Some(PerDevice::List(vec![1 << 20, 2 << 20])),
        ..PlanOptions::default()
    }
    .into_request(
        ModelSource::Tensors(spec.clone(), tensors.clone()),
        devs.clone(),
    )
    .unwrap();
    assert!(matches!(&req.strategy, Strategy::Layers(o) if o.n_gpu_layers == 10));
    assert_eq!(req.reserve["virtual:1"], 2 << 20);
    // device_map -> map.
    let req = PlanOptions {
        device_map: Some(DeviceMapArg::Named("cpu".into())),
        ..PlanOptions::default()
    }
    .into_request(
        ModelSource::Tensors(spec.clone(), tensors.clone()),
        devs.clone(),
    )
    .unwrap();
    assert_eq!(req.strategy.name(), "map");
    // Options of another strategy are refused, naming both.
    let e = PlanOptions {
        strategy: Some("balanced".into()),
        n_gpu_layers: Some(3),
        ..PlanOptions::default()
    }
    .into_request(
        ModelSource::Tensors(spec.clone(), tensors.clone()),
        devs.clone(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("expected strategy='layers'") && e.contains("got strategy='balanced'"),
        "{e}"
    );
    // gpu_split in GB, as exllamav2 takes it.
    let req = PlanOptions {
        gpu_split: Some(vec![0.0625, 0.03125]),
        ..PlanOptions::default()
    }
    .into_request(ModelSource::Tensors(spec, tensors), devs)
    .unwrap();
    assert_eq!(
        req.strategy,
        Strategy::TensorParallel(TpOptions {
            gpu_split_mib: Some(vec![64, 32])
        })
    );
    let e = Strategy::parse("fastest").unwrap_err().to_string();
    assert!(e.contains("expected autosplit, sequential"), "{e}");
}

#[test]
fn reserve_fix_is_checked() {
    // No cpu in the list: only the embedding goes to the host, nothing spills there.
    let mut req = request(smollm2(), "q4_1", "virtual:2x72MiB");
    req.cache = Some(CacheSpec::new(1024, 1, CacheDType::Q8));
    req.runtime = RuntimeSpec {
        max_input_len: 64,
        max_attention_size: 64 * 64,
        max_dq_size: 1 << 20,
        low_mem: false,
    };
    assert!(plan(&req).is_ok());
    PlanOptions {
        reserve: Some(PerDevice::All(16 << 20)),
        ..PlanOptions::default()
    }
    .apply(&mut req)
    .unwrap();
    let Err(e) = plan(&req) else {
        panic!("expected out of memory")
    };
    let PlanError::OutOfMemory(oom) = &e else {
        panic!("{e}")
    };
    let fix = oom
        .fixes
        .iter()
        .find(|f| f.starts_with("reserve "))
        .expect("a reserve fix");
    assert!(fix.ends_with("less on each device fits"), "{fix}");
    assert!(e.to_string().contains("16.00 MiB reserve"), "{e}");
}

#[test]
fn hostile_sizes_do_not_panic() {
    let mut spec = llama(
        2,
        1 << 40,
        1 << 40,
        1 << 20,
        1 << 20,
        1 << 20,
        u64::MAX / 2,
        false,
    );
    spec.context_length = u64::MAX;
    let e = synthesize_tensors(&spec, WeightType::parse("f16").unwrap(), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("overflows"), "{e}");
    // A tensor table claiming absurd sizes plans to an out-of-memory error, not a panic.
    let small = llama(2, 64, 128, 2, 2, 32, 100, false);
    let mut tensors = synthesize_tensors(&small, WeightType::parse("f16").unwrap(), None).unwrap();
    for t in &mut tensors {
        t.nbytes = u64::MAX;
    }
    for s in [
        "autosplit",
        "sequential",
        "balanced",
        "balanced_low_0",
        "layers",
        "tensor_parallel",
    ] {
        let mut req = PlanRequest::new(
            spec.clone(),
            tensors.clone(),
            devices("virtual:2x1GiB,cpu:1GiB"),
        );
        req.strategy = Strategy::parse(s).unwrap();
        req.cache = Some(CacheSpec::new(u64::MAX, u64::MAX, CacheDType::Q4));
        let _ = plan(&req);
        let _ = fit(&req, FitTarget::BatchSize);
    }
}

#[test]
fn scratch_fixes_are_offered_and_checked() {
    // tiny-llama in f32 (37.25 MiB of weights) on a 64 MiB host: the 2048-token workspace
    // (34.23 MiB, see host_staging_and_disk_compute_count_against_a_small_cpu) does not fit
    // beside the weights; exllamav2's low_mem (1024-token chunks and 1024² attention weights)
    // does: 19.19 MiB (x, xn, q, att: 1 MiB each; k, v: 0.5 MiB each; gate, up: 3 MiB each; 4
    // MiB of scores, 4 heads × 1024 × 256; 0.25 MiB of key/value tiles; 3.91 MiB of logits).
    let mut req = request(tiny_llama(), "float32", "cpu:64MiB");
    let e = plan(&req).unwrap_err();
    let PlanError::OutOfMemory(oom) = &e else {
        panic!("{e}")
    };
    assert!(
        oom.fixes.iter().any(|f| f.starts_with("low_mem=True")),
        "{:?}",
        oom.fixes
    );
    req.runtime.low_mem = true;
    plan(&req).expect("the suggested low_mem fits");
    // Already low_mem and still short: a shorter max_input_len, checked by re-planning (48
    // MiB leaves 10.75 MiB beside the weights; 256-token chunks need 7.92 MiB).
    req.devices = devices("cpu:48MiB");
    let e = plan(&req).unwrap_err();
    let PlanError::OutOfMemory(oom) = &e else {
        panic!("{e}")
    };
    let fix = oom
        .fixes
        .iter()
        .find(|f| f.starts_with("max_input_len "))
        .unwrap_or_else(|| panic!("{:?}", oom.fixes));
    let n: u64 = fix.split_whitespace().nth(1).unwrap().parse().unwrap();
    req.runtime.max_input_len = n;
    plan(&req).expect("the suggested max_input_len fits");
}

#[test]
fn the_n_gpu_layers_fix_says_which_layers_it_means() {
    // Room for every repeating layer but not the output layer too.
    let used = |ngl: i64, devs: &str| {
        let mut req = request(smollm2(), "q4_1", devs);
        req.strategy = Strategy::Layers(LayerOptions {
            n_gpu_layers: ngl,
            ..LayerOptions::default()
        });
        (req.clone(), plan(&req).map(|p| p.devices()[0].used()))
    };
    let (_, repeating) = used(30, "virtual:1GiB,cpu");
    let (_, all) = used(-1, "virtual:1GiB,cpu");
    let (repeating, all) = (repeating.unwrap(), all.unwrap());
    assert!(repeating < all);
    let between = (repeating + all) / 2;
    let (_, r) = used(-1, &format!("virtual:{between},cpu"));
    let Err(PlanError::OutOfMemory(oom)) = r else {
        panic!("expected out of memory")
    };
    let fix = oom
        .fixes
        .iter()
        .find(|f| f.starts_with("n_gpu_layers"))
        .expect("an n_gpu_layers fix");
    assert_eq!(
        fix,
        "n_gpu_layers 30 (every repeating layer; the output layer on the host) fits (asked -1 \
         (all 30 repeating layers and the output layer))"
    );
}

#[test]
fn overrides_apply_over_the_layer_split_as_llama_cpp_applies_ot_over_ngl() {
    let ot = || vec![(r"blk\.\d+\.ffn_(up|gate)".to_string(), "cpu".to_string())];
    let base = || request(smollm2(), "q4_1", "virtual:2x1GiB,cpu:4GiB");
    // -ngl 20 -ot ...: layers 10..29 offloaded, their ffn_up/gate kept on the cpu.
    let mut req = base();
    PlanOptions {
        n_gpu_layers: Some(20),
        overrides: ot(),
        ..PlanOptions::default()
    }
    .apply(&mut req)
    .unwrap();
    let p = plan(&req).unwrap();
    assert_eq!(p.strategy(), "layers");
    assert_eq!(p.layer_devices()[12], "virtual:0");
    assert_eq!(
        p.device_of("blk.12.attn_q.weight").as_deref(),
        Some("virtual:0")
    );
    assert_eq!(p.device_of("blk.12.ffn_up.weight").as_deref(), Some("cpu"));
    assert_eq!(
        p.device_of("blk.12.ffn_down.weight").as_deref(),
        Some("virtual:0")
    );
    assert_eq!(p.device_of("blk.3.attn_q.weight").as_deref(), Some("cpu"));
    // -ot alone: over the default -ngl, which offloads everything.
    let mut req = base();
    PlanOptions {
        overrides: ot(),
        ..PlanOptions::default()
    }
    .apply(&mut req)
    .unwrap();
    let p = plan(&req).unwrap();
    assert_eq!(p.strategy(), "layers");
    assert_ne!(p.layer_devices()[0], "cpu");
    assert_eq!(p.device_of("blk.0.ffn_gate.weight").as_deref(), Some("cpu"));
    // Rules under a strategy that has no place for them are refused.
    let mut req = base();
    let e = PlanOptions {
        strategy: Some("autosplit".into()),
        overrides: ot(),
        ..PlanOptions::default()
    }
    .apply(&mut req)
    .unwrap_err();
    assert!(e.to_string().contains("map or layers"), "{e}");
}

/// A bf16 checkpoint on a cuda device keeps bf16 with `dtype="auto"`: every tensor placed on
/// cuda:0 is held as stored (the CUDA kernels multiply, look up and cache bf16 as it is), at 2
/// bytes a value, and the cuda column holds exactly those bytes plus a bf16 cache (2 bytes a
/// value too). `float16` still converts, to the same bytes.
#[test]
fn bf16_checkpoint_on_cuda_keeps_bf16() {
    // 1 GiB: room for the model beside the fixed overhead every cuda device is charged
    let mut req = request(tiny_llama(), "bfloat16", "cuda:0:1GiB,cpu:1GiB");
    req.dtype = DTypeChoice::Auto;
    req.cache = Some(CacheSpec::new(512, 1, CacheDType::Bf16));
    let p = plan(&req).unwrap();
    let on_cuda: Vec<_> = p
        .tensors()
        .iter()
        .filter(|t| t.device == "cuda:0")
        .collect();
    assert!(
        p.layer_devices().iter().all(|d| d == "cuda:0"),
        "{:?}",
        p.layer_devices()
    );
    assert!(!on_cuda.is_empty());
    for t in &on_cuda {
        assert_eq!(t.dtype, DType::BF16, "{}", t.name);
    }
    for (t, info) in p.tensors().iter().zip(&req.tensors) {
        assert_eq!(t.dtype, DType::BF16, "{}", t.name);
        assert_eq!(t.bytes, info.nbytes, "{}: held as stored", t.name);
    }
    // the head on cuda:0 holds the tied embedding's second copy, as stored (bf16) too
    let cuda = p.devices().iter().find(|d| d.name == "cuda:0").unwrap();
    let embd = p
        .tensors()
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .unwrap();
    let tied: u64 = p
        .tied_output_parts()
        .iter()
        .filter(|(d, _)| d == "cuda:0")
        .map(|(_, b)| *b)
        .sum();
    assert!(tied == 0 || tied == embd.bytes, "{tied}");
    let weights: u64 = on_cuda.iter().map(|t| t.bytes).sum();
    assert_eq!(cuda.weights, weights + tied);
    // 2 layers × (K, V) × 2 kv heads × 64 × 512 positions × 2 bytes
    assert_eq!(cuda.kv, 2 * 2 * 2 * 64 * 512 * 2);
    assert!(p.explain().contains("cache bf16"), "{}", p.explain());
    req.dtype = DTypeChoice::Float16;
    let p16 = plan(&req).unwrap();
    assert!(p16.tensors().iter().all(|t| t.dtype == DType::F16));
    assert_eq!(
        p16.tensors().iter().map(|t| t.bytes).sum::<u64>(),
        p.tensors().iter().map(|t| t.bytes).sum::<u64>()
    );
}

/// A cuda device computing the layers and the head is charged the kernel-attention workspace
/// (no host attention tiles) and its prompt products' own tiles as scratch, the tiles named as
/// the kernels' share (`kernel_scratch`); its overhead is the three fixed parts. A virtual
/// device of the same size holds the full workspace and no kernel share.
#[test]
fn cuda_devices_hold_kernel_attention_scratch_and_are_charged_prompt_tiles() {
    let mut req = request(tiny_llama(), "bfloat16", "cuda:0:1GiB,cpu:1GiB");
    req.cache = Some(CacheSpec::new(512, 1, CacheDType::Fp16));
    let p = plan(&req).unwrap();
    assert!(p.layer_devices().iter().all(|d| d == "cuda:0"));
    assert_eq!(p.head_device(), "cuda:0");
    let d = Dims::new(&req.spec, &req.runtime, 512, 1);
    let hosts = |embed| Hosts {
        layers: true,
        head: true,
        embed,
    };
    let cuda = p.devices().iter().find(|d| d.name == "cuda:0").unwrap();
    let tiles = cuda_product_tiles(&d, req.runtime.max_dq_size, hosts(true));
    assert!(tiles > 0);
    assert_eq!(cuda.kernel_scratch, tiles);
    assert!(
        [true, false]
            .iter()
            .any(|&e| cuda.scratch == Workspace::for_kernel_attention(&d, hosts(e)).bytes + tiles),
        "{}",
        cuda.scratch
    );
    let names: Vec<&str> = cuda
        .overhead_parts
        .iter()
        .map(|o| o.name.as_str())
        .collect();
    assert_eq!(
        names,
        [overhead::CONTEXT, overhead::CUBLAS, overhead::GRAPHS]
    );
    let mut req = request(tiny_llama(), "bfloat16", "virtual:1x1GiB,cpu:1GiB");
    req.cache = Some(CacheSpec::new(512, 1, CacheDType::Fp16));
    let p = plan(&req).unwrap();
    let v = p.devices().iter().find(|d| d.name == "virtual:0").unwrap();
    assert!(
        [true, false]
            .iter()
            .any(|&e| v.scratch == Workspace::new(&d, hosts(e)).bytes),
        "{}",
        v.scratch
    );
    assert_eq!(v.kernel_scratch, 0);
}

/// A quantising load onto a cuda device quantises each chunk there, from a scratch copy of the
/// chunk's float rows (at most one staging size): that scratch is charged as the kernels'
/// share, with the prompt tiles (never both at once: the larger of the two), and not on a
/// virtual device, whose loads quantise on the host.
#[test]
fn a_quantising_load_onto_cuda_is_charged_its_chunk_scratch() {
    let mut req = request(tiny_llama(), "float32", "cuda:0:1GiB,cpu:1GiB");
    // small prompt tiles (short prompts, small dequantised chunks), so a chunk can be larger
    req.cache = Some(CacheSpec::new(32, 1, CacheDType::Fp16));
    req.runtime.max_input_len = 32;
    req.runtime.max_dq_size = 4096;
    let plain = plan(&req).unwrap();
    let tiles = plain.devices()[0].kernel_scratch;
    req.quantize = Some(Quantize::Q8_0);
    // a staging size past every tensor: the largest quantised tensor on cuda:0 is the chunk
    req.staging_bytes = 1 << 40;
    let p = plan(&req).unwrap();
    let largest = p
        .tensors()
        .iter()
        .zip(&req.tensors)
        .filter(|(t, src)| {
            t.device == "cuda:0" && t.dtype == DType::Q8_0 && src.dtype == DType::F32
        })
        .map(|(_, src)| src.nbytes)
        .max()
        .unwrap();
    assert!(
        largest > tiles,
        "{largest} <= {tiles}: the test needs a chunk past the tiles"
    );
    let cuda = &p.devices()[0];
    assert_eq!(cuda.name, "cuda:0");
    assert_eq!(cuda.kernel_scratch, largest);
    assert_eq!(
        cuda.scratch - cuda.kernel_scratch,
        plain.devices()[0].scratch - tiles
    );
    // the staging size bounds the chunk
    req.staging_bytes = 64 << 10;
    let p = plan(&req).unwrap();
    assert_eq!(p.devices()[0].kernel_scratch, tiles.max(64 << 10));
    let mut req = request(tiny_llama(), "float32", "virtual:1x1GiB,cpu:1GiB");
    req.quantize = Some(Quantize::Q8_0);
    req.staging_bytes = 1 << 40;
    assert_eq!(plan(&req).unwrap().devices()[0].kernel_scratch, 0);
}

#[test]
fn the_view_names_what_the_accessors_return() {
    let mut req = request(tiny_llama(), "float32", "virtual:1x1GiB,cpu:1GiB");
    req.cache = Some(CacheSpec::new(512, 2, CacheDType::Q8).with_offload(true));
    req.quantize = Some(Quantize::Q4K);
    let p = plan(&req).unwrap();
    let v = serde_json::to_value(p.view()).unwrap();
    assert_eq!(v["strategy"], p.strategy());
    assert_eq!(
        (v["architecture"].as_str(), v["n_layers"].as_u64()),
        (Some("llama"), Some(2))
    );
    assert_eq!(v["quantize"], "q4_k");
    let cache =
        serde_json::json!({"max_seq_len": 512, "batch_size": 2, "dtype": "q8", "offload": true});
    assert_eq!(v["cache"], cache);
    assert_eq!(v["runtime"]["max_input_len"], p.runtime().max_input_len);
    assert_eq!(v["layer_devices"], serde_json::json!(p.layer_devices()));
    assert_eq!(v["embed_device"], p.embed_device());
    assert_eq!(v["head_device"], p.head_device());
    assert_eq!(
        v["tied_output_copy"],
        serde_json::json!(p.tied_output_copy())
    );
    assert_eq!(
        v["tensors"][0],
        serde_json::to_value(p.tensors()[0].view()).unwrap()
    );
    assert_eq!(
        v["devices"][1],
        serde_json::to_value(p.devices()[1].view()).unwrap()
    );
    assert_eq!(v["host"], serde_json::to_value(p.host()).unwrap());
    assert_eq!(v["warnings"], serde_json::json!(p.warnings()));
}

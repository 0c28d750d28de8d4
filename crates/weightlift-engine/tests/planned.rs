//! Plans from the planner, carried out by the loader: memory actually held equals the plan's
//! prediction (weights + KV per device) within 1 %, on the SmolLM2 GGUF and tiny-llama.

use std::path::PathBuf;
use std::sync::Arc;

use weightlift_engine::planned::{cache_dtype, splits};
use weightlift_engine::{Cache, Inventory, LoadOptions, Model, Source};
use weightlift_format::{Checkpoint, OpenOptions};
use weightlift_plan::{
    CacheDType, CacheSpec, LayerOptions, Plan, RuntimeSpec, Strategy, TpOptions,
};

fn demo() -> Option<PathBuf> {
    let p = std::env::var_os("WEIGHTLIFT_DEMO_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    p.exists().then_some(p)
}

fn tiny(sub: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/reference/tiny-llama")
        .join(sub)
}

fn check(path: &PathBuf, devices: &str, strategy: Strategy, cache: Option<CacheSpec>) -> Plan {
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(path, OpenOptions::default()).unwrap());
    let inv = Inventory::parse(devices).unwrap();
    let mut model = Model::new(Arc::clone(&src), inv.clone());
    let mut req = model.plan_request().unwrap();
    req.strategy = strategy;
    req.cache = cache;
    // Small forward passes keep the scratch small (the default runtime plans 2048-token prompts).
    req.runtime = RuntimeSpec {
        max_input_len: 32,
        max_attention_size: 32 * 32,
        max_dq_size: 1 << 16,
        low_mem: false,
    };
    let plan = weightlift_plan::plan(&req).unwrap();
    let cache = plan.cache().map(|c| {
        let cfg = model
            .cache_config(c.max_seq_len, c.batch_size, cache_dtype(c.dtype), false)
            .unwrap();
        Arc::new(Cache::new(cfg).unwrap())
    });
    let placement = model.placement(&plan).unwrap();
    model
        .load(
            &placement,
            &LoadOptions::default(),
            cache.as_ref(),
            true,
            &mut |_| true,
        )
        .unwrap();
    let mem = model.memory();
    for d in plan.devices() {
        let want = d.weights + d.kv + d.scratch;
        let got = mem
            .iter()
            .find(|(n, _)| *n == d.name)
            .map_or(0, |(_, b)| *b);
        let tol = want / 100;
        assert!(
            got.abs_diff(want) <= tol,
            "{} {}: plan {want} B, held {got} B",
            plan.strategy(),
            d.name
        );
    }
    if let Some(c) = &cache {
        for (l, dev) in plan.layer_devices().iter().enumerate() {
            assert_eq!(&c.device_of(l).unwrap(), dev);
        }
    }
    for (i, t) in src.tensors().iter().enumerate() {
        assert!(
            model.tensor_bytes(&t.name).unwrap().0 == src.bytes(i),
            "{}",
            t.name
        );
    }
    model.unload();
    assert!(inv.all().iter().all(|d| d.used() == 0));
    plan
}

#[test]
fn strategies_on_tiny_llama() {
    let cache = Some(CacheSpec::new(512, 1, CacheDType::Q8));
    for sub in [
        "safetensors",
        "safetensors-sharded",
        "gguf/tiny-llama-Q4_K_M.gguf",
    ] {
        let p = tiny(sub);
        check(&p, "virtual:2x12MiB", Strategy::Autosplit, cache);
        check(&p, "virtual:3x16MiB", Strategy::Balanced, cache);
        check(&p, "virtual:2x32MiB", Strategy::Sequential, None);
        let layers = LayerOptions {
            n_gpu_layers: 1,
            tensor_split: vec![3.0, 1.0],
            ..LayerOptions::default()
        };
        check(&p, "virtual:2x32MiB", Strategy::Layers(layers), cache);
    }
}

#[test]
fn tensor_parallel_plan_on_tiny_llama() {
    for sub in ["safetensors", "gguf/tiny-llama-Q8_0.gguf"] {
        let plan = check(
            &tiny(sub),
            "virtual:2x32MiB",
            Strategy::TensorParallel(TpOptions::default()),
            None,
        );
        let s = splits(plan.tp().unwrap());
        assert_eq!(s.kv.len(), 2);
    }
}

#[test]
fn demo_model_over_two_virtual_devices() {
    let Some(p) = demo() else {
        eprintln!("skipped: the demo model is not downloaded (make demo-model)");
        return;
    };
    check(
        &p,
        "virtual:2x64MiB",
        Strategy::Autosplit,
        Some(CacheSpec::new(2048, 1, CacheDType::Q4)),
    );
    let layers = LayerOptions {
        n_gpu_layers: -1,
        tensor_split: vec![1.0, 1.0, 1.0],
        ..LayerOptions::default()
    };
    check(
        &p,
        "virtual:3x64MiB",
        Strategy::Layers(layers),
        Some(CacheSpec::new(1024, 1, CacheDType::Fp16)),
    );
}

/// An offloaded cache: planned as the whole cache on `cpu` plus two layers' slots per
/// accelerator (reserved, since the planner has no offload option); what is held equals the
/// plan's weights and scratch plus the cache's expected memory for the plan's layer devices.
#[test]
fn offloaded_cache_matches_its_expected_memory() {
    let path = tiny("gguf/tiny-llama-Q8_0.gguf");
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(&path, OpenOptions::default()).unwrap());
    let inv = Inventory::parse("virtual:2x6MiB").unwrap();
    let mut model = Model::new(Arc::clone(&src), inv.clone());
    let cfg = model
        .cache_config(512, 2, weightlift_engine::CacheDType::Fp16, true)
        .unwrap();
    let mut req = model.plan_request().unwrap();
    req.strategy = Strategy::Autosplit;
    req.runtime = RuntimeSpec {
        max_input_len: 32,
        max_attention_size: 32 * 32,
        max_dq_size: 1 << 16,
        low_mem: false,
    };
    weightlift_engine::planned::charge_offloaded_cache(&mut req, &cfg);
    let plan = weightlift_plan::plan(&req).unwrap();
    let total: u64 = (0..cfg.n_kv_heads.len()).map(|l| cfg.layer_bytes(l)).sum();
    let slot = 2 * cfg.layer_bytes(0);
    let reserve = |name: &str| plan.devices().iter().find(|d| d.name == name).unwrap();
    assert_eq!(reserve("cpu").reserve, total);
    assert_eq!(reserve("virtual:0").reserve, slot);
    assert!(plan.devices().iter().all(|d| d.kv == 0));
    let cache = Arc::new(Cache::new(cfg.clone()).unwrap());
    let placement = model.placement(&plan).unwrap();
    model
        .load(
            &placement,
            &LoadOptions::default(),
            Some(&cache),
            true,
            &mut |_| true,
        )
        .unwrap();
    let expected = cfg.expected_memory(plan.layer_devices());
    assert_eq!(cache.expected_memory().unwrap(), expected);
    let mem = model.memory();
    for d in plan.devices() {
        let kv = expected
            .iter()
            .find(|(n, _)| *n == d.name)
            .map_or(0, |(_, b)| *b);
        let want = d.weights + d.scratch + kv;
        let got = mem
            .iter()
            .find(|(n, _)| *n == d.name)
            .map_or(0, |(_, b)| *b);
        assert!(
            got.abs_diff(want) <= want / 100,
            "{}: plan {want} B, held {got} B",
            d.name
        );
        // The reserve covers what the cache holds there.
        assert!(
            kv <= d.reserve,
            "{}: cache {kv} B, reserve {}",
            d.name,
            d.reserve
        );
    }
    model.unload();
    assert!(inv.all().iter().all(|d| d.used() == 0));
}

//! Offloaded KV cache (`CacheSpec::offload`, transformers' `OffloadedCache`): the whole cache
//! on `cpu`, `min(layers, 2) × largest layer` prefetch slots on each device that computes
//! layers. Every expected number is worked out by hand from the model's config and the cache's
//! bytes per element, not by asking the planner twice.

use crate::common;

use common::{devices, request, smollm2, tiny_llama, toy};
use weightlift_plan::{
    CacheDType, CacheSpec, LayerOptions, OFFLOAD_SLOTS, Plan, PlanError, PlanRequest, RuntimeSpec,
    Strategy, TpOptions, plan,
};

fn kv(p: &Plan, dev: &str) -> u64 {
    p.devices()
        .iter()
        .find(|d| d.name == dev)
        .unwrap_or_else(|| panic!("no device {dev} in {:?}", p.devices()))
        .kv
}

fn count(p: &Plan, dev: &str) -> usize {
    p.layer_devices().iter().filter(|d| *d == dev).count()
}

/// Six (or `n`) toy layers of 100,000 weight bytes each; one KV head of head_dim 8, so an fp16
/// cache at ctx 1024 is 2 (K, V) × 1 × 8 × 1024 × 2 B = 32,768 B per layer.
fn toy_req(n: usize, devs: &str, offload: bool) -> PlanRequest {
    let layer: &[u64] = &[100_000];
    let layers: Vec<&[u64]> = vec![layer; n];
    let (spec, tensors) = toy(&layers);
    let mut req = PlanRequest::new(spec, tensors, devices(devs));
    req.runtime = RuntimeSpec::none();
    // No host staging buffers, so the cpu column holds only the cache.
    req.staging_bytes = 0;
    req.cache = Some(CacheSpec::new(1024, 1, CacheDType::Fp16).with_offload(offload));
    req
}

const TOY_LAYER_KV: u64 = 2 * 8 * 1024 * 2;

#[test]
fn slot_count_matches_the_engine() {
    assert_eq!(OFFLOAD_SLOTS, 2);
    assert_eq!(CacheSpec::offload_slots_bytes(0, 10), 0);
    assert_eq!(CacheSpec::offload_slots_bytes(1, 10), 10);
    assert_eq!(CacheSpec::offload_slots_bytes(2, 10), 20);
    assert_eq!(CacheSpec::offload_slots_bytes(30, 10), 20);
}

/// Autosplit: a device of 370,000 B holds 2 layers with their KV beside them (2 × 132,768 =
/// 265,536; 3 would be 398,304) but 3 with an offloaded cache (3 × 100,000 + 2 slots × 32,768
/// = 365,536; 4 would be 465,536). A 140,000 B device holds one offloaded layer and one slot
/// (132,768).
#[test]
fn autosplit_counts_slots_not_the_cache_on_devices() {
    let devs = "virtual:370000B,virtual:370000B,virtual:140000B,cpu:1GiB";
    let beside = plan(&toy_req(7, devs, false)).unwrap();
    assert_eq!(
        beside.layer_devices(),
        [
            "virtual:0",
            "virtual:0",
            "virtual:1",
            "virtual:1",
            "virtual:2",
            "cpu",
            "cpu"
        ]
    );
    assert_eq!(kv(&beside, "virtual:0"), 2 * TOY_LAYER_KV);
    assert_eq!(kv(&beside, "virtual:2"), TOY_LAYER_KV);
    assert_eq!(kv(&beside, "cpu"), 2 * TOY_LAYER_KV);

    let off = plan(&toy_req(7, devs, true)).unwrap();
    assert_eq!(
        off.layer_devices(),
        [
            "virtual:0",
            "virtual:0",
            "virtual:0",
            "virtual:1",
            "virtual:1",
            "virtual:1",
            "virtual:2"
        ]
    );
    // Three layers each: two slots of one layer's cache. One layer: one slot.
    assert_eq!(kv(&off, "virtual:0"), 65_536);
    assert_eq!(kv(&off, "virtual:1"), 65_536);
    assert_eq!(kv(&off, "virtual:2"), 32_768);
    // The whole cache in host RAM: 7 × 32,768; the cpu computes no layer, so no slots.
    assert_eq!(kv(&off, "cpu"), 229_376);
    assert_eq!(off.host().kv, 229_376);
    let v0 = &off.devices()[0];
    assert_eq!(v0.weights, 300_000);
    assert_eq!(v0.free, 370_000 - 300_000 - 65_536);
    assert!(off.explain().contains("offloaded kv cache of all 7 layers"));
    assert!(off.explain().contains("cache fp16 offloaded to host ram"));
    assert!(
        off.explain().contains("2 kv prefetch slot(s) of 32.00 KiB"),
        "{}",
        off.explain()
    );
}

/// Layers the cpu computes keep their prefetch slots there too (the engine computes from a slot
/// on every layer device), on top of the whole cache.
#[test]
fn cpu_layers_add_slots_to_the_whole_cache() {
    // One 140,000 B device: one offloaded layer; the other five go to the cpu.
    let off = plan(&toy_req(6, "virtual:140000B,cpu:1GiB", true)).unwrap();
    assert_eq!(count(&off, "virtual:0"), 1);
    assert_eq!(count(&off, "cpu"), 5);
    assert_eq!(kv(&off, "virtual:0"), 32_768);
    assert_eq!(kv(&off, "cpu"), 6 * 32_768 + 2 * 32_768);
}

/// The cpu must hold the whole cache: when it cannot, the plan is an OutOfMemory naming the cpu
/// and the offloaded kv, with checked fixes.
#[test]
fn a_cpu_too_small_for_the_cache_is_out_of_memory() {
    // 6 × 32,768 = 196,608 B of cache against a 150,000 B cpu. Cheaper dtypes are tried from
    // the dearest down: q8, 6 × 2 × 256 groups × 34 B = 104,448 B, fits.
    let req = toy_req(6, "virtual:400000B,virtual:400000B,cpu:150000B", true);
    let e = plan(&req).unwrap_err();
    let msg = e.to_string();
    let PlanError::OutOfMemory(oom) = &e else {
        panic!("expected OutOfMemory, got {e}")
    };
    let cpu = oom
        .shortfalls
        .iter()
        .find(|s| s.device == "cpu")
        .unwrap_or_else(|| panic!("{msg}"));
    assert_eq!(cpu.needed, 196_608);
    assert_eq!(cpu.available, 150_000);
    assert!(
        msg.contains("cpu is short by 45.52 KiB (needs 192.00 KiB, has 146.48 KiB)"),
        "{msg}"
    );
    assert!(msg.contains("offloaded kv cache of all 6 layers"), "{msg}");
    assert!(
        msg.contains("kv at ctx 1024 × batch 1 (fp16, offloaded)"),
        "{msg}"
    );
    assert!(
        oom.fixes
            .iter()
            .any(|f| f.starts_with("cache q8 saves 90.00 KiB and fits")),
        "{:?}",
        oom.fixes
    );

    // 50,000 B: no cheaper dtype fits (q4 is 6 × 2 × 256 groups × 18 B = 55,296 B), but the
    // cache beside the layers does (3 layers of 132,768 B on each 400,000 B device).
    let req = toy_req(6, "virtual:400000B,virtual:400000B,cpu:50000B", true);
    let PlanError::OutOfMemory(oom) = plan(&req).unwrap_err() else {
        panic!("expected OutOfMemory")
    };
    let fix = oom
        .fixes
        .iter()
        .find(|f| f.contains("offload=False"))
        .unwrap_or_else(|| panic!("{:?}", oom.fixes));
    assert!(
        fix.contains("fits and frees 192.00 KiB of host ram"),
        "{fix}"
    );
    let mut beside = req.clone();
    beside.cache = beside.cache.map(|c| c.with_offload(false));
    let p = plan(&beside).unwrap();
    assert_eq!(kv(&p, "cpu"), 0);
}

/// SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) at ctx 2048: one layer's K is
/// 3 × 64 × 2048 = 393,216 values, and so is its V. Per layer, by the bytes per element:
/// fp16 2 B → 1,572,864; fp8 1 B → 786,432; q8 12,288 groups × 34 B per half → 835,584;
/// q6 = 417,792 (8-bit K) + 221,184 (4-bit V) → 638,976; q4 12,288 × 18 B per half → 442,368.
#[test]
fn smollm2_kv_columns_by_hand() {
    let per_layer = [
        (CacheDType::Fp16, 1_572_864u64),
        (CacheDType::Fp8, 786_432),
        (CacheDType::Q8, 835_584),
        (CacheDType::Q6, 638_976),
        (CacheDType::Q4, 442_368),
    ];
    for (dtype, layer) in per_layer {
        let mut req = request(smollm2(), "q4_1", "virtual:2x128MiB,cpu:4GiB");
        req.runtime = RuntimeSpec::none();
        // llama.cpp, all 31 layers (30 and the output) over two devices split 1:1: layer il
        // goes to device 0 while il / 31 < 0.5, so repeating layers 0-15 there, 16-29 on 1.
        req.strategy = Strategy::Layers(LayerOptions {
            tensor_split: vec![1.0, 1.0],
            ..LayerOptions::default()
        });
        req.cache = Some(CacheSpec::new(2048, 1, dtype));
        let beside = plan(&req).unwrap();
        assert_eq!(count(&beside, "virtual:0"), 16);
        assert_eq!(kv(&beside, "virtual:0"), 16 * layer, "{dtype:?}");
        assert_eq!(kv(&beside, "virtual:1"), 14 * layer, "{dtype:?}");
        assert_eq!(kv(&beside, "cpu"), 0);

        req.cache = Some(CacheSpec::new(2048, 1, dtype).with_offload(true));
        let off = plan(&req).unwrap();
        assert_eq!(off.layer_devices(), beside.layer_devices());
        assert_eq!(kv(&off, "virtual:0"), 2 * layer, "{dtype:?}");
        assert_eq!(kv(&off, "virtual:1"), 2 * layer, "{dtype:?}");
        assert_eq!(kv(&off, "cpu"), 30 * layer, "{dtype:?}");
        // Weights and scratch do not move.
        for (a, b) in off.devices().iter().zip(beside.devices()) {
            assert_eq!((a.weights, a.scratch), (b.weights, b.scratch));
        }
    }
}

/// Autosplit of SmolLM2 fp16 at ctx 8192 (6,291,456 B of KV per layer, 188,743,680 B in all):
/// beside the layers the two 64 MiB devices hold few layers, offloaded they hold many more,
/// and the cpu column carries the whole cache.
#[test]
fn smollm2_autosplit_fits_more_layers_offloaded() {
    let mut req = request(smollm2(), "q4_1", "virtual:2x64MiB,cpu:4GiB");
    req.runtime = RuntimeSpec::none();
    req.cache = Some(CacheSpec::new(8192, 1, CacheDType::Fp16));
    let beside = plan(&req).unwrap();
    req.cache = req.cache.map(|c| c.with_offload(true));
    let off = plan(&req).unwrap();
    let on_devices = |p: &Plan| count(p, "virtual:0") + count(p, "virtual:1");
    assert!(on_devices(&off) > on_devices(&beside));
    assert_eq!(on_devices(&off), 30);
    assert_eq!(kv(&off, "cpu"), 188_743_680);
    assert_eq!(kv(&off, "virtual:0"), 2 * 6_291_456);
    assert_eq!(kv(&off, "virtual:1"), 2 * 6_291_456);
    for d in off.devices() {
        assert!(
            d.used() <= d.capacity,
            "{}: {} > {}",
            d.name,
            d.used(),
            d.capacity
        );
    }
}

/// Tensor parallelism over two devices: tiny-llama's 2 KV heads split 1 + 1, so each device
/// computes a one-head slice of both layers: 2 × 1 × 64 × 512 × 2 B = 131,072 B per slice, two
/// slots each. The cpu holds both whole layers, 2 × 262,144 B.
#[test]
fn tensor_parallel_slots_are_per_slice() {
    let mut req = request(tiny_llama(), "float16", "virtual:2x64MiB,cpu:1GiB");
    req.runtime = RuntimeSpec::none();
    req.strategy = Strategy::TensorParallel(TpOptions::default());
    req.cache = Some(CacheSpec::new(512, 1, CacheDType::Fp16).with_offload(true));
    let p = plan(&req).unwrap();
    assert_eq!(kv(&p, "virtual:0"), 2 * 131_072);
    assert_eq!(kv(&p, "virtual:1"), 2 * 131_072);
    assert_eq!(kv(&p, "cpu"), 524_288);
}

/// The flag survives JSON, and is left out of plans that do not use it (their JSON is as
/// before the option existed).
#[test]
fn json_carries_the_flag_only_when_set() {
    let mut req = toy_req(2, "virtual:1MiB,cpu:1GiB", true);
    let p = plan(&req).unwrap();
    let json = p.to_json();
    assert!(json.contains("\"offload\": true"), "{json}");
    let back = Plan::from_json(&json).unwrap();
    assert_eq!(back, p);
    assert!(back.cache().unwrap().offload);
    req.cache = req.cache.map(|c| c.with_offload(false));
    let json = plan(&req).unwrap().to_json();
    assert!(!json.contains("offload"), "{json}");
}

/// fit() keeps the offload flag: the longest context is bounded by host RAM for the cache and
/// by the devices only for two slots.
#[test]
fn fit_with_an_offloaded_cache() {
    // Toy: 2 layers, one 1 MiB device. Per layer at ctx s: 2 × 1 × 8 × s × 2 B = 32·s.
    // Device: 200,000 B of weights + 2 slots × 32·s ≤ 1 MiB → s ≤ 13,259. Host: the whole
    // cache, 64·s ≤ cpu. The toy's context_length, 8192, caps the answer: a 1 MiB or a
    // 512 KiB cpu (64 × 8192 = 524,288 exactly) gives 8192, a 256 KiB cpu 4096.
    for (cpu, want) in [("1MiB", 8192u64), ("512KiB", 8192), ("256KiB", 4096)] {
        let req = toy_req(2, &format!("virtual:1MiB,cpu:{cpu}"), true);
        let got = weightlift_plan::fit(&req, weightlift_plan::FitTarget::MaxSeqLen).unwrap();
        assert_eq!(got, want, "cpu {cpu}");
    }
}

/// A layer left on disk is computed by the host, so its prefetch slots are the host's too, and
/// the fill keeps room for them. Four toy layers; the 140,000 B device takes layer 0 with one
/// slot (132,768 B). The cpu (246,608 B) must hold the whole cache (4 × 32,768 = 131,072 B) and
/// the two slots of the layers it will compute (65,536 B): that leaves 50,000 B, too little
/// for a 100,000 B layer, so layers 1-3 stay on disk.
#[test]
fn disk_layers_keep_their_slots_on_the_host() {
    let mut req = toy_req(4, "virtual:140000B,cpu:246608B", true);
    req.allow_disk = true;
    let p = plan(&req).unwrap();
    assert_eq!(p.layer_devices(), ["virtual:0", "disk", "disk", "disk"]);
    assert_eq!(kv(&p, "virtual:0"), 32_768);
    assert_eq!(kv(&p, "cpu"), 131_072 + 65_536);
    assert_eq!(kv(&p, "disk"), 0);
    // One byte less and the host cannot hold the cache and the slots of the disk layers.
    let mut req = toy_req(4, "virtual:140000B,cpu:196607B", true);
    req.allow_disk = true;
    assert!(matches!(plan(&req), Err(PlanError::OutOfMemory(_))));
}

/// Every fill strategy charges the same way: the cpu holds the whole cache plus the slots of
/// the layers it computes, each device `min(layers, 2)` slots, and nothing exceeds its capacity.
#[test]
fn every_strategy_charges_cache_and_slots() {
    let devs = "virtual:370000B,virtual:370000B,cpu:1GiB";
    for strategy in [
        Strategy::Autosplit,
        Strategy::Sequential,
        Strategy::Balanced,
        Strategy::BalancedLow0,
        // llama.cpp: the last 4 layers offloaded, 2 per device; the cpu computes 0-1.
        Strategy::Layers(LayerOptions {
            n_gpu_layers: 4,
            ..LayerOptions::default()
        }),
    ] {
        let mut req = toy_req(6, devs, true);
        req.strategy = strategy.clone();
        let p = plan(&req).unwrap_or_else(|e| panic!("{strategy:?}: {e}"));
        for name in ["virtual:0", "virtual:1"] {
            let n = count(&p, name) as u64;
            assert_eq!(kv(&p, name), n.min(2) * TOY_LAYER_KV, "{strategy:?} {name}");
        }
        let on_cpu = count(&p, "cpu") as u64;
        assert_eq!(
            kv(&p, "cpu"),
            6 * TOY_LAYER_KV + on_cpu.min(2) * TOY_LAYER_KV,
            "{strategy:?}"
        );
        for d in p.devices() {
            assert!(d.used() <= d.capacity, "{strategy:?} {}", d.name);
        }
    }
}

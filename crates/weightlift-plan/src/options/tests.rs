//! Option rules as plain data: strategy inference, per-device sizes, fit and TP defaults.

use super::*;
use crate::device::parse_devices;

#[test]
fn per_device_sizes_resolve_by_name_index_and_order() {
    let devs = parse_devices("cpu:1GiB,virtual:2x64MiB").unwrap();
    let all = PerDevice::All(7).resolve(&devs, "reserve").unwrap();
    assert_eq!(all.keys().collect::<Vec<_>>(), ["virtual:0", "virtual:1"]);
    let list = PerDevice::List(vec![1, 2])
        .resolve(&devs, "reserve")
        .unwrap();
    assert_eq!((list["virtual:0"], list["virtual:1"]), (1, 2));
    let e = PerDevice::List(vec![1, 2, 3])
        .resolve(&devs, "reserve_vram")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("reserve_vram") && e.contains("at most one value per accelerator (2)"),
        "{e}"
    );
    let map = PerDevice::Map(vec![("1".into(), 5), ("CPU".into(), 9)])
        .resolve(&devs, "max_memory")
        .unwrap();
    assert_eq!((map["virtual:1"], map["cpu"]), (5, 9));
    let e = PerDevice::Map(vec![("cuda:3".into(), 5)])
        .resolve(&devs, "max_memory")
        .unwrap_err()
        .to_string();
    assert!(e.contains("cuda:3") && e.contains("virtual:0"), "{e}");
}

#[test]
fn a_world_means_tensor_parallel_and_only_that() {
    let world = |strategy: Option<&str>| PlanOptions {
        strategy: strategy.map(str::to_string),
        world: Some("node0:2,node1:1".into()),
        ..PlanOptions::default()
    };
    assert!(matches!(
        world(None).strategy().unwrap(),
        Some(Strategy::TensorParallel(_))
    ));
    let e = world(Some("autosplit")).strategy().unwrap_err().to_string();
    assert!(
        e.contains("gpu_split/expect_cache/world") && e.contains("strategy='autosplit'"),
        "{e}"
    );
    let spec = ModelSpec::from_hf_config(&serde_json::json!({
        "model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 32,
        "max_position_embeddings": 256,
    }))
    .unwrap();
    let mut req = PlanRequest::new(spec, vec![], parse_devices("virtual:3x1GiB").unwrap());
    world(None).apply(&mut req).unwrap();
    assert_eq!(req.world.as_ref().map(|w| w.world_size()), Some(3));
    let bad = PlanOptions {
        world: Some("node0".into()),
        ..PlanOptions::default()
    };
    assert!(
        bad.apply(&mut req)
            .unwrap_err()
            .to_string()
            .contains("world")
    );
}

#[test]
fn tensor_parallel_options_expect_an_fp16_cache_unless_told() {
    let o = PlanOptions::tensor_parallel(Some(vec![0.5, 0.25]), 0, None);
    let fp16 = ExpectCache {
        tokens: 0,
        dtype: CacheDType::Fp16,
    };
    assert_eq!(o.expect_cache, Some(fp16));
    assert_eq!(
        o.strategy().unwrap(),
        Some(Strategy::TensorParallel(TpOptions {
            gpu_split_mib: Some(vec![512, 256])
        }))
    );
    let q4 = PlanOptions::tensor_parallel(None, 100, Some(CacheDType::Q4));
    assert_eq!(
        (q4.gpu_split, q4.expect_cache.map(|e| (e.tokens, e.dtype))),
        (None, Some((100, CacheDType::Q4)))
    );
}

#[test]
fn device_map_presets_and_entries() {
    let s = |m: DeviceMapArg| {
        PlanOptions {
            device_map: Some(m),
            ..PlanOptions::default()
        }
        .strategy()
        .unwrap()
        .unwrap()
    };
    assert_eq!(s(DeviceMapArg::Named("auto".into())), Strategy::Balanced);
    assert_eq!(
        s(DeviceMapArg::Named("balanced_low_0".into())),
        Strategy::BalancedLow0
    );
    assert_eq!(
        s(DeviceMapArg::Named("cpu".into())),
        Strategy::Map(DeviceMap {
            entries: vec![(String::new(), "cpu".into())],
            overrides: vec![],
        })
    );
    assert_eq!(
        s(DeviceMapArg::Entries(vec![
            ("blk.0".into(), "0".into()),
            ("re:ffn_.*".into(), "cpu".into())
        ])),
        Strategy::Map(DeviceMap {
            entries: vec![("blk.0".into(), "0".into())],
            overrides: vec![("ffn_.*".into(), "cpu".into())],
        })
    );
    // A preset that contradicts the strategy named is refused, naming both.
    let e = PlanOptions {
        strategy: Some("sequential".into()),
        device_map: Some(DeviceMapArg::Named("balanced".into())),
        ..PlanOptions::default()
    }
    .strategy()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("strategy='sequential'") && e.contains("strategy='balanced'"),
        "{e}"
    );
}

#[test]
fn fitting_n_gpu_layers_means_the_layers_strategy() {
    let s = |o: PlanOptions| {
        o.for_fit(FitTarget::NGpuLayers, None)
            .unwrap()
            .strategy()
            .unwrap()
    };
    assert_eq!(s(PlanOptions::default()).map(|s| s.name()), Some("layers"));
    let named = PlanOptions {
        strategy: Some("balanced".into()),
        ..PlanOptions::default()
    };
    assert_eq!(s(named).map(|s| s.name()), Some("balanced"));
    let other = PlanOptions::default()
        .for_fit(FitTarget::MaxSeqLen, None)
        .unwrap();
    assert_eq!(other.strategy().unwrap(), None);
}

#[test]
fn fit_cache_dtype_and_offload() {
    let fit = |o: PlanOptions, d: Option<&str>| o.for_fit(FitTarget::MaxSeqLen, d);
    let q4 = fit(PlanOptions::default(), Some("q4")).unwrap();
    assert_eq!(q4.cache, Some(CacheSpec::new(256, 1, CacheDType::Q4)));
    let q8 = PlanOptions {
        cache: Some(CacheSpec::new(512, 2, CacheDType::Q8)),
        ..PlanOptions::default()
    };
    assert_eq!(fit(q8.clone(), Some("q8_0")).unwrap().cache, q8.cache);
    let e = fit(q8, Some("q4")).unwrap_err().to_string();
    assert_eq!(
        e,
        "cache_dtype: 'q4' contradicts cache.dtype 'q8'; give one of them"
    );
    // Offloaded with no cache: fit's own search cache, offloaded when applied.
    let offloaded = PlanOptions {
        cache_offload: true,
        ..PlanOptions::default()
    };
    let o = fit(offloaded.clone(), None).unwrap();
    assert_eq!(o.cache, Some(CacheSpec::new(256, 1, CacheDType::Fp16)));
    let devs = crate::device::parse_devices("cpu").unwrap();
    let spec = ModelSpec::from_hf_config(&serde_json::json!({
        "model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 32,
        "max_position_embeddings": 256,
    }))
    .unwrap();
    let mut req = PlanRequest::new(spec, Vec::new(), devs);
    o.apply(&mut req).unwrap();
    assert_eq!(req.cache.map(|c| c.offload), Some(true));
    // plan() has no cache of its own to fall back to.
    let e = offloaded.apply(&mut req).unwrap_err().to_string();
    assert!(
        e.starts_with("cache_offload=True: there is no cache to offload"),
        "{e}"
    );
}

#[test]
fn strategy_is_inferred_and_misplaced_options_refused() {
    let infer = |o: PlanOptions| o.strategy().unwrap().map(|s| s.name());
    assert_eq!(infer(PlanOptions::default()), None);
    let ngl = PlanOptions {
        n_gpu_layers: Some(3),
        ..PlanOptions::default()
    };
    assert_eq!(infer(ngl.clone()), Some("layers"));
    let tp = PlanOptions {
        // 0.0301 GB = 30.82 MiB: rounded to the nearest MiB, never truncated
        gpu_split: Some(vec![1.5, 0.0301]),
        ..PlanOptions::default()
    };
    assert_eq!(
        tp.strategy().unwrap(),
        Some(Strategy::TensorParallel(TpOptions {
            gpu_split_mib: Some(vec![1536, 31])
        }))
    );
    let e = PlanOptions {
        strategy: Some("autosplit".into()),
        ..ngl
    }
    .strategy()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("n_gpu_layers") && e.contains("got strategy='autosplit'"),
        "{e}"
    );
    let e = PlanOptions {
        gpu_split: Some(vec![f64::NAN]),
        ..PlanOptions::default()
    }
    .strategy()
    .unwrap_err()
    .to_string();
    assert!(e.contains("gpu_split") && e.contains("NaN"), "{e}");
}

#[test]
fn a_rank_plans_the_world_over_stand_ins_for_its_own_gpu() {
    let spec = ModelSpec::from_hf_config(&serde_json::json!({
        "model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 32,
        "max_position_embeddings": 256,
    }))
    .unwrap();
    let rank = |devices: &str, world: Option<&str>, rank: usize| {
        let mut req = PlanRequest::new(spec.clone(), vec![], parse_devices(devices).unwrap());
        PlanOptions {
            world: world.map(str::to_string),
            rank: Some(rank),
            ..PlanOptions::default()
        }
        .apply(&mut req)
        .map(|()| req)
    };
    let req = rank("virtual:3GiB,cpu:8GiB", Some("node0:2,node1:1"), 2).unwrap();
    let got: Vec<(&str, u64)> = req
        .devices
        .iter()
        .map(|d| (d.name.as_str(), d.capacity))
        .collect();
    let gib = 1 << 30;
    assert_eq!(
        got,
        [
            ("virtual:0", 3 * gib),
            ("virtual:1", 3 * gib),
            ("virtual:2", 3 * gib),
            ("cpu", 8 * gib)
        ]
    );
    assert!(matches!(req.strategy, Strategy::TensorParallel(_)));
    assert_eq!(req.world.as_ref().map(|w| w.world_size()), Some(3));
    for (devices, world, r, want) in [
        ("virtual:1GiB", None, 0, "rank: expected a world too"),
        (
            "virtual:1GiB",
            Some("a:2"),
            2,
            "rank: expected below the world's 2 ranks ('a:2'), got 2",
        ),
        (
            "virtual:2x1GiB",
            Some("a:2"),
            0,
            "expected one accelerator, this rank's GPU (cuda:$LOCAL_RANK), got 2 accelerators",
        ),
    ] {
        let e = rank(devices, world, r).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
}

#[test]
fn entry_point_presets_name_their_strategies() {
    let s = |o: PlanOptions| o.strategy().unwrap().unwrap().name().to_owned();
    assert_eq!(s(PlanOptions::autosplit(None)), "autosplit");
    // transformers' from_pretrained: "auto" (balanced) when no map is given.
    assert_eq!(s(PlanOptions::from_pretrained(None, None)), "balanced");
    let seq = DeviceMapArg::Named("sequential".into());
    assert_eq!(
        s(PlanOptions::from_pretrained(Some(seq), None)),
        "sequential"
    );
    // llama.cpp's numbers mean the layers strategy; with no accelerator, all on the cpu.
    let gpu = PlanOptions::llama(-1, "layer", None, 0, true);
    assert_eq!(s(gpu.clone()), "layers");
    assert_eq!((gpu.n_gpu_layers, gpu.main_gpu), (Some(-1), Some(0)));
    assert_eq!(
        PlanOptions::llama(-1, "row", Some(vec![1.0]), 1, false)
            .strategy()
            .unwrap(),
        Some(Strategy::Map(DeviceMap {
            entries: vec![(String::new(), "cpu".into())],
            overrides: vec![],
        }))
    );
}

#[test]
fn n_cpu_moe_is_overrides_after_the_explicit_ones() {
    let opts = PlanOptions {
        n_cpu_moe: Some(2),
        overrides: vec![("attn_q".into(), "cpu".into())],
        ..PlanOptions::default()
    };
    let Some(Strategy::Layers(o)) = opts.strategy().unwrap() else {
        panic!("n_cpu_moe means llama.cpp's layers strategy");
    };
    let rules: Vec<&str> = o.overrides.iter().map(|(re, _)| re.as_str()).collect();
    assert_eq!(rules.len(), 5);
    assert_eq!(rules[0], "attn_q");
    assert!(o.overrides.iter().all(|(_, d)| d == "cpu"));
    let hits = |name: &str| {
        rules
            .iter()
            .filter(|re| regex::Regex::new(re).unwrap().is_match(name))
            .count()
    };
    for name in [
        "blk.0.ffn_gate_exps.weight",
        "blk.1.ffn_down_exps.weight",
        "model.layers.1.mlp.experts.5.up_proj.weight",
        "model.layers.0.block_sparse_moe.experts.0.w2.weight",
    ] {
        assert_eq!(hits(name), 1, "{name}");
    }
    for name in [
        "blk.2.ffn_gate_exps.weight",
        "blk.10.ffn_up_exps.weight",
        "blk.0.ffn_gate_inp.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.12.mlp.experts.0.up_proj.weight",
    ] {
        assert_eq!(hits(name), 0, "{name}");
    }
    // another strategy than layers or map is named with it: refused, naming both
    let e = PlanOptions {
        n_cpu_moe: Some(1),
        strategy: Some("balanced".into()),
        ..PlanOptions::default()
    }
    .strategy()
    .unwrap_err()
    .to_string();
    assert!(e.contains("n_cpu_moe") && e.contains("balanced"), "{e}");
    // tensor parallelism places every expert by its expert table: named, with the fix
    for opts in [
        PlanOptions {
            n_cpu_moe: Some(1),
            strategy: Some("tensor_parallel".into()),
            ..PlanOptions::default()
        },
        PlanOptions {
            overrides: vec![("exps".into(), "cpu".into())],
            strategy: Some("tensor_parallel".into()),
            ..PlanOptions::default()
        },
    ] {
        let e = opts.strategy().unwrap_err().to_string();
        assert!(
            e.contains("overrides/n_cpu_moe")
                && e.contains("got strategy='tensor_parallel'")
                && e.contains("expert table")
                && e.contains("use strategy='layers'"),
            "{e}"
        );
    }
}

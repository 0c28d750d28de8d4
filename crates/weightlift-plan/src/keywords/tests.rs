//! The keyword grammar as plain data: each form of each keyword, and each refusal.

use serde_json::json;

use super::*;

fn kw(v: Value) -> Keywords {
    Keywords::from_json(v).unwrap()
}

fn plan(v: Value) -> Result<PlanOptions> {
    kw(v).plan_options()
}

/// The message of the refusal of `v`'s plan options.
fn refusal(v: Value) -> String {
    plan(v).unwrap_err().to_string()
}

fn is_type_error(e: &PlanError) -> bool {
    matches!(
        e,
        PlanError::KeywordType { .. } | PlanError::UnknownField { .. }
    )
}

#[test]
fn sizes_are_ints_or_strings_per_device_one_a_list_or_a_map() {
    let o = plan(json!({
        "reserve": "3MiB",
        "max_memory": ["4MiB", 1048576],
        "overhead": {"cuda:1": "1GB", "0": 7},
    }))
    .unwrap();
    assert_eq!(o.reserve, Some(PerDevice::All(3 << 20)));
    assert_eq!(o.max_memory, Some(PerDevice::List(vec![4 << 20, 1 << 20])));
    let map = vec![("cuda:1".to_owned(), 1_000_000_000), ("0".to_owned(), 7)];
    assert_eq!(o.overhead, Some(PerDevice::Map(map)));
}

#[test]
fn int_map_keys_read_as_accelerator_indices() {
    // serde_json keys are strings; a Python dict's int keys reach json_value as ints
    let v = json_value(serde::de::value::MapDeserializer::<
        _,
        serde::de::value::Error,
    >::new([(1u64, "2MiB")].into_iter()))
    .unwrap();
    assert_eq!(v, json!({"1": "2MiB"}));
    let sizes = PerDevice::from_keyword(&v, "reserve").unwrap();
    assert_eq!(sizes, PerDevice::Map(vec![("1".into(), 2 << 20)]));
}

#[test]
fn a_nan_or_an_infinity_is_refused_by_name_not_read_as_absent() {
    use serde::de::value::{Error, SeqDeserializer};
    for (v, shown) in [
        (f64::NAN, "NaN"),
        (f64::INFINITY, "inf"),
        (f64::NEG_INFINITY, "-inf"),
    ] {
        // inside a list, as tensor_split = [nan, 2] reaches the grammar
        let seq = SeqDeserializer::<_, Error>::new([1.0, v].into_iter());
        let e = json_value(seq).unwrap_err().to_string();
        assert_eq!(e, format!("{NON_FINITE}{shown}"));
        let refusal = non_finite_refusal("tensor_split", &e).unwrap();
        assert!(!is_type_error(&refusal));
        assert_eq!(
            refusal.to_string(),
            format!("invalid option tensor_split: expected finite numbers, got {shown}")
        );
    }
    // finite floats stay numbers; other failures are not this refusal
    let seq = SeqDeserializer::<_, Error>::new([1.5f64].into_iter());
    assert_eq!(json_value(seq).unwrap(), json!([1.5]));
    assert!(non_finite_refusal("tensor_split", "unsupported type").is_none());
}

#[test]
fn a_size_of_the_wrong_kind_is_a_type_error_and_a_bad_size_a_value_error() {
    for (v, got) in [
        (json!(1.5), "float"),
        (json!(-1), "negative int"),
        (json!(true), "bool"),
    ] {
        let e = plan(json!({"reserve": v})).unwrap_err();
        assert!(is_type_error(&e), "{e}");
        assert_eq!(
            e.to_string(),
            format!(
                "reserve: expected a size: an int of bytes (≥ 0) or a string such as \"512MiB\", \
                 got {got}"
            )
        );
    }
    let e = plan(json!({"max_memory": {"cpu": "12 furlongs"}})).unwrap_err();
    assert!(!is_type_error(&e));
    let msg = e.to_string();
    assert!(
        msg.starts_with("max_memory: invalid size '12 furlongs': unknown unit"),
        "{msg}"
    );
    assert!(refusal(json!({"overhead": [[1]]})).ends_with("got list"));
}

#[test]
fn device_map_is_a_name_or_a_map_to_devices_by_name_or_index() {
    let o = plan(json!({"device_map": "balanced_low_0"})).unwrap();
    assert_eq!(
        o.device_map,
        Some(DeviceMapArg::Named("balanced_low_0".into()))
    );
    let o = plan(json!({"device_map": {"re:ffn_up": "cpu", "": 1}})).unwrap();
    let entries = vec![("re:ffn_up".into(), "cpu".into()), ("".into(), "1".into())];
    assert_eq!(o.device_map, Some(DeviceMapArg::Entries(entries)));
    let e = refusal(json!({"device_map": 3}));
    assert!(
        e.starts_with("device_map: expected 'auto', 'balanced'"),
        "{e}"
    );
    assert!(e.ends_with("got int"), "{e}");
    let e = refusal(json!({"device_map": {"": [0]}}));
    assert!(
        e.contains("expected a device name such as \"cuda:0\" or an accelerator index, got list"),
        "{e}"
    );
}

#[test]
fn overrides_are_a_string_a_list_or_a_map() {
    let rules = |v| plan(json!({ "overrides": v })).unwrap().overrides;
    let two = vec![
        ("ffn_.*".to_owned(), "cpu".to_owned()),
        ("attn".into(), "1".into()),
    ];
    assert_eq!(rules(json!("ffn_.*=cpu, attn=1")), two);
    assert_eq!(rules(json!(["ffn_.*=cpu", "attn=1"])), two);
    assert_eq!(rules(json!({"ffn_.*": "cpu", "attn": 1})), two);
    assert!(rules(json!(null)).is_empty());
    let e = plan(json!({"overrides": "ffn_.*"})).unwrap_err();
    assert!(
        !is_type_error(&e) && e.to_string().contains("REGEX=DEVICE"),
        "{e}"
    );
    let e = refusal(json!({"overrides": ["a=cpu", 2]}));
    assert_eq!(
        e,
        "overrides: expected \"REGEX=DEVICE\" rules: a string, a list or a dict, got int"
    );
    assert!(refusal(json!({"overrides": 2})).ends_with("got int"));
}

#[test]
fn devices_are_a_spec_or_a_list_of_its_parts() {
    let devices = |v| kw(json!({ "devices": v })).devices();
    assert_eq!(
        devices(json!("virtual:8GiB,cpu")).unwrap().unwrap(),
        "virtual:8GiB,cpu"
    );
    assert_eq!(
        devices(json!(["virtual:8GiB", "cpu"])).unwrap().unwrap(),
        "virtual:8GiB,cpu"
    );
    assert_eq!(devices(json!(null)).unwrap(), None);
    let e = devices(json!(42)).unwrap_err();
    assert!(is_type_error(&e));
    assert_eq!(
        e.to_string(),
        "devices: expected a device spec such as \"virtual:2x8GiB,cpu\" or a list of such \
         strings, got int"
    );
    assert!(
        devices(json!(["cpu", 1]))
            .unwrap_err()
            .to_string()
            .ends_with("got int")
    );
}

#[test]
fn cache_is_a_map_of_cache_spec_fields_with_its_defaults() {
    let o = plan(json!({"cache": {"max_seq_len": 256}})).unwrap();
    assert_eq!(o.cache, Some(CacheSpec::new(256, 1, CacheDType::Fp16)));
    let o = plan(
        json!({"cache": {"max_seq_len": 8, "batch_size": 2, "dtype": "q8_0", "offload": true}}),
    )
    .unwrap();
    assert_eq!(
        o.cache,
        Some(CacheSpec::new(8, 2, CacheDType::Q8).with_offload(true))
    );
    // a plan's own JSON of a cache reads back
    let spec = CacheSpec::new(64, 1, CacheDType::Q4);
    let back = CacheSpec::from_keyword(&serde_json::to_value(spec).unwrap(), "cache").unwrap();
    assert_eq!(back, spec);

    let e = plan(json!({"cache": {"dtype": "q8"}})).unwrap_err();
    assert!(
        is_type_error(&e) && e.to_string().contains("'max_seq_len'"),
        "{e}"
    );
    let e = plan(json!({"cache": {"max_seq_len": 8, "size": 1}})).unwrap_err();
    assert!(is_type_error(&e), "{e}");
    assert_eq!(
        e.to_string(),
        "cache: unknown field 'size'; expected max_seq_len, batch_size, dtype, offload"
    );
    let e = plan(json!({"cache": {"max_seq_len": 8, "dtype": "q3"}})).unwrap_err();
    assert!(
        !is_type_error(&e) && e.to_string().contains("cache dtype"),
        "{e}"
    );
    let e = plan(json!({"cache": {"max_seq_len": 0}})).unwrap_err();
    assert!(
        !is_type_error(&e) && e.to_string().contains("max_seq_len"),
        "{e}"
    );
    let e = refusal(json!({"cache": {"max_seq_len": "long"}}));
    assert_eq!(e, "cache.max_seq_len: expected an int ≥ 0, got str");
    assert!(refusal(json!({"cache": 8})).starts_with("cache: expected a CacheSpec"));
}

#[test]
fn runtime_is_a_map_of_runtime_spec_fields_the_rest_default() {
    let o = plan(json!({"runtime": {"max_input_len": 16, "low_mem": true}})).unwrap();
    let rt = o.runtime.unwrap();
    assert_eq!((rt.max_input_len, rt.low_mem), (16, true));
    assert_eq!(rt.max_dq_size, RuntimeSpec::default().max_dq_size);
    let e = plan(json!({"runtime": {"max_len": 8}})).unwrap_err();
    assert!(is_type_error(&e));
    assert!(
        e.to_string()
            .starts_with("runtime: unknown field 'max_len'; expected max_input_len")
    );
    let e = refusal(json!({"runtime": {"low_mem": 1}}));
    assert_eq!(e, "runtime.low_mem: expected True or False, got int");
}

#[test]
fn offload_takes_blocks_per_group_and_prefetch() {
    let offload = |v| kw(v).offload();
    assert_eq!(offload(json!({})).unwrap(), None);
    assert_eq!(
        offload(json!({"offload": "sequential"})).unwrap(),
        Some(WeightOffload::Sequential)
    );
    assert_eq!(
        offload(json!({"offload": "group"})).unwrap(),
        Some(WeightOffload::Group {
            blocks_per_group: 1,
            prefetch: true
        })
    );
    let g = offload(json!({"offload": "group", "blocks_per_group": 3, "prefetch": false}));
    assert_eq!(
        g.unwrap(),
        Some(WeightOffload::Group {
            blocks_per_group: 3,
            prefetch: false
        })
    );
    let e = offload(json!({"offload": "group", "blocks_per_group": 0})).unwrap_err();
    assert!(e.to_string().contains("blocks_per_group"), "{e}");
    assert!(
        offload(json!({"offload": "eager"}))
            .unwrap_err()
            .to_string()
            .contains("'eager'")
    );
    let e = offload(json!({"offload": "group", "blocks_per_group": -1})).unwrap_err();
    assert!(
        !is_type_error(&e) && e.to_string().contains("an int from 0 to"),
        "{e}"
    );
}

#[test]
fn scalars_are_read_by_kind() {
    let o = plan(json!({
        "strategy": "layers", "n_gpu_layers": -1, "split_mode": "row", "tensor_split": [1, 3.5],
        "main_gpu": 1, "gpu_split": null, "allow_disk": true, "use_mmap": false, "n_cpu_moe": 2,
    }))
    .unwrap();
    assert_eq!(o.strategy.as_deref(), Some("layers"));
    assert_eq!(
        (o.n_gpu_layers, o.main_gpu, o.n_cpu_moe),
        (Some(-1), Some(1), Some(2))
    );
    assert_eq!(o.tensor_split, Some(vec![1.0, 3.5]));
    assert_eq!(
        (o.allow_disk, o.use_mmap, o.gpu_split),
        (Some(true), Some(false), None)
    );
    assert_eq!(
        refusal(json!({"strategy": 1})),
        "strategy: expected a string, got int"
    );
    assert_eq!(
        refusal(json!({"n_gpu_layers": "all"})),
        "n_gpu_layers: expected an int, got str"
    );
    assert_eq!(
        refusal(json!({"tensor_split": [1, "x"]})),
        "tensor_split[1]: expected a number, got str"
    );
    assert_eq!(
        refusal(json!({"main_gpu": 1.5})),
        "main_gpu: expected an int ≥ 0, got float"
    );
}

#[test]
fn load_leaves_cache_and_use_mmap_to_the_load() {
    let k = kw(json!({"cache": {"max_seq_len": 8}, "use_mmap": false, "n_gpu_layers": 2}));
    let o = k.load_plan_options().unwrap();
    assert_eq!((o.cache, o.use_mmap, o.n_gpu_layers), (None, None, Some(2)));
    // so a cache that only the load reads is never refused by the placement keywords
    let k = kw(json!({"cache": "a Cache object"}));
    assert!(k.load_plan_options().is_ok() && k.plan_options().is_err());
}

#[test]
fn each_loader_keeps_its_own_defaults() {
    let k = kw(json!({"reserve_vram": [1, 2], "offload": "sequential"}));
    let o = k.autosplit_options().unwrap();
    assert_eq!(o.strategy.as_deref(), Some("autosplit"));
    assert_eq!(
        (o.reserve, o.offload),
        (
            Some(PerDevice::List(vec![1, 2])),
            Some(WeightOffload::Sequential)
        )
    );
    let o = kw(json!({"gpu_split": [0.5], "expect_cache_base": "q4"}))
        .tensor_parallel_options()
        .unwrap();
    let e = o.expect_cache.unwrap();
    assert_eq!(
        (e.tokens, e.dtype, o.gpu_split),
        (0, CacheDType::Q4, Some(vec![0.5]))
    );
    let o = kw(json!({})).pretrained_options().unwrap();
    assert_eq!(o.device_map, Some(DeviceMapArg::Named("auto".into())));
    let (target, o) = kw(json!({"target": "n_gpu_layers"})).fit_options().unwrap();
    assert_eq!(
        (target, o.strategy.as_deref()),
        (FitTarget::NGpuLayers, Some("layers"))
    );
    assert_eq!(kw(json!({})).fit_options().unwrap().0, FitTarget::MaxSeqLen);
}

#[test]
fn a_foreign_object_is_refused_in_the_keyword_s_own_words() {
    let mut k = Keywords::default();
    k.insert_foreign("cache", "object");
    k.insert_foreign("callback", "function");
    let e = k.plan_options().unwrap_err();
    assert!(is_type_error(&e));
    assert_eq!(
        e.to_string(),
        "cache: expected a CacheSpec or a dict of its fields, got object"
    );
    // a keyword nobody reads is never looked at
    assert!(k.load_plan_options().is_ok());
}

#[test]
fn plan_options_deserialise_from_any_serde_data() {
    let o: PlanOptions =
        serde_json::from_str(r#"{"reserve": {"0": "1MiB"}, "device_map": "auto"}"#).unwrap();
    assert_eq!(o.reserve, Some(PerDevice::Map(vec![("0".into(), 1 << 20)])));
    let e = serde_json::from_str::<PlanOptions>(r#"{"reserve": 1.5}"#).unwrap_err();
    assert!(e.to_string().starts_with("reserve: expected a size"), "{e}");
    let sizes: PerDevice = serde_json::from_str(r#"["1KiB", 2]"#).unwrap();
    assert_eq!(sizes, PerDevice::List(vec![1024, 2]));
    assert!(Keywords::from_json(json!([1])).is_err());
}

#[test]
fn a_plan_is_its_json() {
    let e = kw(json!({"plan": 3})).get::<Plan>("plan").unwrap_err();
    assert!(is_type_error(&e), "{e}");
    assert_eq!(e.to_string(), "plan: expected a Plan or its JSON, got int");
    let e = kw(json!({"plan": "{"})).get::<Plan>("plan").unwrap_err();
    assert!(e.to_string().starts_with("plan json is invalid"), "{e}");
}

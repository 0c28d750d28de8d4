//! Device maps against the ones transformers' `from_pretrained` and accelerate compute for the
//! same configs and `max_memory` budgets (tests/data/device_map_goldens, written by
//! tests/gen_device_map_goldens.py on meta-device models). The configs are planned from
//! config.json alone, through the options every entry point fills: a `device_map` preset for
//! transformers, a strategy name for accelerate.

use std::path::PathBuf;

use serde_json::Value;
use weightlift_format::ModelSpec;
use weightlift_plan::{
    DeviceMapArg, ModelSource, PerDevice, Plan, PlanOptions, RuntimeSpec, parse_devices, plan,
};

fn goldens() -> Vec<(String, Value)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/device_map_goldens");
    let names = [
        "tiny-llama",
        "smollm2-135m",
        "llama-3.1-8b",
        "llama-2-7b-3gpu",
    ];
    names
        .iter()
        .map(|n| {
            let path = dir.join(format!("{n}.json"));
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e}; regenerate it with tests/gen_device_map_goldens.py",
                    path.display()
                )
            });
            (n.to_string(), serde_json::from_str(&text).unwrap())
        })
        .collect()
}

/// A golden device name as ours: accelerator index `i` is `virtual:i`.
fn device(v: &Value) -> String {
    match v {
        Value::Number(n) => format!("virtual:{n}"),
        Value::String(s) => s.clone(),
        other => panic!("unexpected device {other}"),
    }
}

/// `(embed_tokens, layers, norm, lm_head)` of a plan, named as the goldens' units.
fn units(p: &Plan) -> Value {
    let of = |name: &str| {
        p.device_of(name)
            .unwrap_or_else(|| p.head_device().to_string())
    };
    serde_json::json!({
        "embed_tokens": p.embed_device(),
        "layers": p.layer_devices(),
        "norm": of("output_norm.weight"),
        // A tied head has no tensor of its own: it is computed where the plan says.
        "lm_head": of("output.weight"),
    })
}

fn golden_units(u: &Value) -> Value {
    serde_json::json!({
        "embed_tokens": device(&u["embed_tokens"]),
        "layers": u["layers"].as_array().unwrap().iter().map(device).collect::<Vec<_>>(),
        "norm": device(&u["norm"]),
        "lm_head": device(&u["lm_head"]),
    })
}

fn plan_for(config: &Value, budget: &Value, options: PlanOptions) -> Plan {
    let spec = ModelSpec::from_hf_config(config).unwrap();
    let dtype = config["torch_dtype"]
        .as_str()
        .or(config["dtype"].as_str())
        .map(str::to_owned);
    let gpus = budget
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.parse::<u32>().is_ok())
        .count();
    // The devices are large: the budgets are max_memory, as in the goldens.
    let devices = parse_devices(&format!("virtual:{gpus}x1TiB,cpu:1TiB,disk")).unwrap();
    let max_memory = budget
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
        .collect();
    let options = PlanOptions {
        max_memory: Some(PerDevice::Map(max_memory)),
        // accelerate and transformers count weights only: no forward-pass scratch.
        runtime: Some(RuntimeSpec::none()),
        ..options
    };
    let mut req = options
        .into_request(ModelSource::Config(spec, dtype, None, false), devices)
        .unwrap();
    // Neither library has upload staging buffers in host RAM.
    req.staging_bytes = 0;
    plan(&req).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn module_sizes_match_transformers() {
    for (name, g) in goldens() {
        let p = plan_for(
            &g["config"],
            &g["cases"][0]["max_memory"],
            PlanOptions::default(),
        );
        let sizes = &g["module_sizes"];
        let bytes = |prefix: &str| -> u64 {
            p.tensors()
                .iter()
                .filter(|t| t.name == prefix || t.name.starts_with(&format!("{prefix}.")))
                .map(|t| t.bytes)
                .sum()
        };
        assert_eq!(
            bytes("token_embd"),
            sizes["model.embed_tokens"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            bytes("blk.0"),
            sizes["model.layers.0"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            bytes("output_norm"),
            sizes["model.norm"].as_u64().unwrap(),
            "{name}"
        );
        // transformers does not count a tied head: it is the embedding.
        assert_eq!(
            bytes("output"),
            sizes["lm_head"].as_u64().unwrap(),
            "{name}"
        );
    }
}

#[test]
fn from_pretrained_presets_give_transformers_maps() {
    let mut checked = 0;
    for (name, g) in goldens() {
        for (i, case) in g["cases"].as_array().unwrap().iter().enumerate() {
            for (preset, want) in case["transformers"].as_object().unwrap() {
                let p = plan_for(
                    &g["config"],
                    &case["max_memory"],
                    PlanOptions {
                        device_map: Some(DeviceMapArg::Named(preset.clone())),
                        ..PlanOptions::default()
                    },
                );
                assert_eq!(
                    units(&p),
                    golden_units(&want["units"]),
                    "{name} budget {i} device_map={preset}\n{}",
                    p.explain()
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 4 * 3 * 4);
}

#[test]
fn strategies_give_accelerate_maps() {
    let mut checked = 0;
    for (name, g) in goldens() {
        for (i, case) in g["cases"].as_array().unwrap().iter().enumerate() {
            for (strategy, want) in case["accelerate"].as_object().unwrap() {
                let p = plan_for(
                    &g["config"],
                    &case["max_memory"],
                    PlanOptions {
                        strategy: Some(strategy.clone()),
                        ..PlanOptions::default()
                    },
                );
                assert_eq!(
                    units(&p),
                    golden_units(&want["units"]),
                    "{name} budget {i} strategy={strategy}\n{}",
                    p.explain()
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 4 * 3 * 3);
}

/// With no `max_memory` at all, transformers' `get_max_memory` keeps 10% of the host free for
/// `from_pretrained`; accelerate's does not.
#[test]
fn presets_without_max_memory_budget_90_percent_of_the_cpu() {
    let g = &goldens()[0].1;
    let spec = ModelSpec::from_hf_config(&g["config"]).unwrap();
    let cpu = |options: PlanOptions| {
        let req = options
            .into_request(
                ModelSource::Config(spec.clone(), Some("bfloat16".into()), None, false),
                parse_devices("virtual:1GiB,cpu:100MiB").unwrap(),
            )
            .unwrap();
        let p = plan(&req).unwrap();
        p.devices()
            .iter()
            .find(|d| d.name == "cpu")
            .unwrap()
            .capacity
    };
    let preset = |name: &str| PlanOptions {
        device_map: Some(DeviceMapArg::Named(name.into())),
        ..PlanOptions::default()
    };
    assert_eq!(cpu(preset("auto")), 90 << 20);
    assert_eq!(cpu(preset("sequential")), 90 << 20);
    let named = PlanOptions {
        strategy: Some("balanced".into()),
        ..PlanOptions::default()
    };
    assert_eq!(cpu(named), 100 << 20);
    // A max_memory for any device is the user's budget: the cpu keeps its capacity.
    let capped = PlanOptions {
        max_memory: Some(PerDevice::Map(vec![("0".into(), 1 << 30)])),
        ..preset("auto")
    };
    assert_eq!(cpu(capped), 100 << 20);
}

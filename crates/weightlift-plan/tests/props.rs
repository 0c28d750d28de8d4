//! Property tests over random models, inventories and strategies.

use crate::common;

use common::*;
use proptest::prelude::*;
use weightlift_format::ModelSpec;
use weightlift_plan::{
    CacheDType, CacheSpec, DeviceKind, DeviceMap, FitTarget, LayerOptions, Plan, PlanError,
    PlanRequest, RuntimeSpec, SEQ_STEP, SplitMode, TpInputs, TpOptions, define_split, fit, plan,
};

fn arb_spec() -> impl Strategy<Value = ModelSpec> {
    (
        1u32..10,
        1u64..8,
        1u64..12,
        prop::sample::select(vec![1u32, 2, 4]),
        1u32..4,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(layers, h32, i128, kv, groups, tied, bias)| {
            let head_dim = 32;
            let heads = kv * groups;
            let mut s = llama(
                layers,
                h32 * 64,
                i128 * 128,
                heads,
                kv,
                head_dim,
                1000 + h32 * 37,
                tied,
            );
            s.attention_bias = bias;
            s.context_length = 4096;
            s
        })
}

fn arb_strategy() -> impl Strategy<Value = weightlift_plan::Strategy> {
    prop_oneof![
        Just(weightlift_plan::Strategy::Autosplit),
        Just(weightlift_plan::Strategy::Sequential),
        Just(weightlift_plan::Strategy::Balanced),
        Just(weightlift_plan::Strategy::BalancedLow0),
        (
            -1i64..12,
            prop::sample::select(vec![SplitMode::None, SplitMode::Layer, SplitMode::Row])
        )
            .prop_map(|(n, m)| {
                weightlift_plan::Strategy::Layers(LayerOptions {
                    n_gpu_layers: n,
                    split_mode: m,
                    ..LayerOptions::default()
                })
            }),
        Just(weightlift_plan::Strategy::TensorParallel(
            TpOptions::default()
        )),
        (0u32..10, 0u32..10).prop_map(|(a, b)| weightlift_plan::Strategy::Map(DeviceMap {
            entries: vec![
                ("".into(), "cpu".into()),
                (format!("blk.{}-{}", a.min(b), a.max(b)), "0".into())
            ],
            overrides: vec![(r"ffn_down".into(), "cpu".into())],
        })),
    ]
}

fn arb_request() -> impl Strategy<Value = PlanRequest> {
    (
        arb_spec(),
        prop::sample::select(vec!["float16", "q8_0", "q4_k_m", "q4_0"]),
        prop::collection::vec(1u64..64, 1..4),
        prop::option::of(1u64..128),
        prop::bool::weighted(0.2),
        arb_strategy(),
        prop::option::of((
            1u64..16,
            1u64..3,
            prop::sample::select(CacheDType::ALL.to_vec()),
        )),
        (
            // A tiny cpu (down to 16 KiB, less than the staging buffers) is as likely as a
            // roomy one; `disk` may be listed as well as allowed.
            prop::option::of(prop_oneof![1u64..64, 64u64..4096]),
            any::<bool>(),
            // (device index, reserve, overhead) in 16 KiB units, device index past the list
            // meaning the cpu.
            prop::collection::vec((0usize..5, 0u64..64, 0u64..64), 0..3),
            prop::sample::select(vec![4u64 << 10, 64 << 10, 1 << 20, 64 << 20]),
        ),
    )
        .prop_map(
            |(
                spec,
                w,
                gpus,
                cpu,
                disk,
                strategy,
                cache,
                (tiny_cpu, list_disk, extras, staging),
            )| {
                // Sizes in units of 256 KiB so that plans fit about half the time.
                let mut d: Vec<String> = gpus
                    .iter()
                    .map(|m| format!("virtual:{}KiB", m * 256))
                    .collect();
                match (cpu, tiny_cpu) {
                    (_, Some(t)) => d.push(format!("cpu:{}KiB", t * 16)),
                    (Some(c), None) => d.push(format!("cpu:{}KiB", c * 256)),
                    (None, None) => {}
                }
                if list_disk {
                    d.push("disk".into());
                }
                let mut req = request(spec, w, &d.join(","));
                req.allow_disk = disk;
                req.staging_bytes = staging;
                for (i, r, o) in extras {
                    let names: Vec<String> = req
                        .devices
                        .iter()
                        .filter(|x| x.kind != DeviceKind::Disk)
                        .map(|x| x.name.clone())
                        .collect();
                    let name = names[i.min(names.len() - 1)].clone();
                    req.reserve.insert(name.clone(), r << 14);
                    req.overhead.insert(name, o << 14);
                }
                req.strategy = strategy;
                req.cache = cache.map(|(s, b, dt)| CacheSpec::new(s * 256, b, dt));
                req.runtime = RuntimeSpec {
                    max_input_len: 128,
                    max_attention_size: 128 * 128,
                    max_dq_size: 1 << 16,
                    low_mem: false,
                };
                req
            },
        )
}

/// "No device goes over its budget", recomputed from the request rather than trusted from the
/// plan: every device that allocates anything (weights, kv, compute scratch, host staging)
/// fits weights + kv + scratch + overhead + reserve in its capacity, the cpu included; the
/// reserve and overhead are the ones asked for; the KV cache is all there, on the device of
/// each layer (the host for a layer left on disk, which the host computes); `disk` holds no
/// KV and no scratch; and the host's staging buffers are charged whenever there is an
/// accelerator.
fn check_budgets(req: &PlanRequest, p: &Plan) -> Result<(), TestCaseError> {
    let dev = |name: &str| p.devices().iter().find(|d| d.name == name);
    let accel = req.devices.iter().any(|d| d.kind.is_accelerator());
    let largest = p.tensors().iter().map(|t| t.bytes).max().unwrap_or(0);
    let staging = if accel {
        2 * req.staging_bytes.min(largest)
    } else {
        0
    };
    prop_assert_eq!(p.host().staging, staging);
    let cpu = dev("cpu").expect("the host is always in the plan");
    prop_assert_eq!(cpu.scratch, p.host().scratch + staging, "{}", p.explain());
    prop_assert_eq!(cpu.kv, p.host().kv);
    for d in p.devices() {
        let spec = req.devices.iter().find(|x| x.name == d.name);
        let reserve = req
            .reserve
            .get(&d.name)
            .copied()
            .or(spec.map(|x| x.reserve))
            .unwrap_or(0);
        prop_assert_eq!(d.reserve, reserve, "{}", d.name);
        let active = d.weights > 0 || d.kv > 0 || d.scratch > 0;
        let overhead = req
            .overhead
            .get(&d.name)
            .copied()
            .or(spec.map(|x| x.overhead.total()))
            .unwrap_or(0);
        prop_assert_eq!(d.overhead, if active { overhead } else { 0 }, "{}", d.name);
        let parts: u64 = d.overhead_parts.iter().map(|p| p.bytes).sum();
        prop_assert_eq!(parts, d.overhead, "{}", d.name);
        prop_assert_eq!(
            d.used(),
            d.weights + d.kv + d.scratch + d.overhead + d.reserve
        );
        if d.kind == DeviceKind::Disk {
            prop_assert_eq!((d.kv, d.scratch), (0, 0), "{}", p.explain());
        }
        let capacity = spec.map_or(u64::MAX, |x| {
            x.capacity
                .min(req.max_memory.get(&d.name).copied().unwrap_or(u64::MAX))
        });
        prop_assert_eq!(d.capacity, capacity, "{}", d.name);
        if active && capacity != u64::MAX {
            prop_assert!(
                d.used() <= capacity,
                "{} over its budget: {}",
                d.name,
                p.explain()
            );
            prop_assert_eq!(d.free, capacity - d.used());
        }
    }
    // The KV cache: every layer's, on the device that computes the layer.
    if let Some(c) = &req.cache {
        let total: u64 = p.devices().iter().map(|d| d.kv).sum();
        prop_assert_eq!(total, c.total_bytes(&req.spec));
        if p.tp().is_none() {
            for d in p.devices() {
                let want: u64 = p
                    .layer_devices()
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| {
                        let n = if n.as_str() == "disk" {
                            "cpu"
                        } else {
                            n.as_str()
                        };
                        n == d.name
                    })
                    .map(|(l, _)| c.layer_bytes(&req.spec, l))
                    .sum();
                prop_assert_eq!(d.kv, want, "{}: {}", d.name, p.explain());
            }
        }
    } else {
        prop_assert!(p.devices().iter().all(|d| d.kv == 0));
    }
    Ok(())
}

fn layer_mode(s: &weightlift_plan::Strategy) -> bool {
    match s {
        weightlift_plan::Strategy::Autosplit
        | weightlift_plan::Strategy::Sequential
        | weightlift_plan::Strategy::Balanced
        | weightlift_plan::Strategy::BalancedLow0 => true,
        weightlift_plan::Strategy::Layers(o) => o.split_mode != SplitMode::Row,
        _ => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn plans_are_complete_within_budget_and_deterministic(req in arb_request()) {
        match plan(&req) {
            Ok(p) => {
                // Every tensor placed exactly once, in table order, on a known device.
                prop_assert_eq!(p.tensors().len(), req.tensors.len());
                for (pt, t) in p.tensors().iter().zip(&req.tensors) {
                    prop_assert_eq!(&pt.name, &t.name);
                    prop_assert!(p.devices().iter().any(|d| d.name == pt.device));
                    if let Some(s) = &pt.split
                        && !s.replicated
                    {
                        prop_assert_eq!(s.shards.iter().map(|x| x.bytes).sum::<u64>(), pt.bytes);
                    }
                }
                check_budgets(&req, &p)?;
                // Unsplit weights add up per device.
                if p.tp().is_none() && p.tensors().iter().all(|t| t.split.is_none()) {
                    for d in p.devices() {
                        let sum: u64 = p.tensors().iter().filter(|t| t.device == d.name).map(|t| t.bytes).sum();
                        let copy: u64 = p.tied_output_parts().iter().filter(|x| x.0 == d.name).map(|x| x.1).sum();
                        prop_assert_eq!(d.weights, sum + copy);
                    }
                }
                // Blocks are never split in layer modes.
                if layer_mode(&req.strategy) {
                    for t in p.tensors() {
                        if let Some(l) = t.layer {
                            prop_assert_eq!(&t.device, &p.layer_devices()[l as usize]);
                        }
                    }
                }
                // Deterministic, and JSON round-trips.
                let again = plan(&req).unwrap();
                prop_assert_eq!(&again, &p);
                prop_assert_eq!(Plan::from_json(&p.to_json()).unwrap(), p);
            }
            Err(PlanError::OutOfMemory(oom)) => {
                prop_assert!(!oom.shortfalls.is_empty());
                for s in &oom.shortfalls {
                    prop_assert!(s.needed > s.available, "{:?}", s);
                    prop_assert!(req.devices.iter().any(|d| d.name == s.device) || s.device == "cpu");
                }
            }
            Err(e) => {
                // Only option errors that the random strategy can legitimately hit.
                let m = e.to_string();
                prop_assert!(m.contains("tensor_parallel") || m.contains("no room") || m.contains("main_gpu"), "{}", m);
            }
        }
    }

    #[test]
    fn more_memory_never_breaks_a_fitting_plan(req in arb_request(), extra in 1u64..64, which in 0usize..4, seq in any::<bool>()) {
        let mut req = req;
        // Monotone by construction: greedy fills (exllamav2 autosplit, accelerate sequential)
        // and fixed maps. Not monotone, as in the systems they reproduce: llama.cpp's default
        // tensor_split, exllamav2's TP split and accelerate's balanced caps, which all share
        // layers in proportion to the devices' memory, so more memory on one device can move
        // work onto a device that was full.
        if !matches!(req.strategy, weightlift_plan::Strategy::Map(_)) {
            req.strategy = if seq { weightlift_plan::Strategy::Sequential } else { weightlift_plan::Strategy::Autosplit };
        }
        if plan(&req).is_ok() {
            let i = which % req.devices.len();
            if req.devices[i].capacity != u64::MAX {
                req.devices[i].capacity += extra << 20;
            }
            prop_assert!(plan(&req).is_ok());
        }
    }

    #[test]
    fn fit_answer_fits_and_one_more_step_does_not(req in arb_request()) {
        let mut req = req;
        req.strategy = weightlift_plan::Strategy::Autosplit;
        if let Ok(ctx) = fit(&req, FitTarget::MaxSeqLen) {
            let base = req.cache.unwrap_or(CacheSpec::new(256, 1, CacheDType::Fp16));
            let mut r = req.clone();
            r.cache = Some(CacheSpec { max_seq_len: ctx, ..base });
            prop_assert!(plan(&r).is_ok());
            if ctx < req.spec.context_length {
                r.cache = Some(CacheSpec { max_seq_len: ctx + SEQ_STEP, ..base });
                prop_assert!(plan(&r).is_err());
            }
        }
        // Batch size at the request's cache length (256 tokens without one).
        if let Ok(b) = fit(&req, FitTarget::BatchSize) {
            let base = req.cache.unwrap_or(CacheSpec::new(256, 1, CacheDType::Fp16));
            let mut r = req.clone();
            r.cache = Some(CacheSpec { batch_size: b, ..base });
            prop_assert!(plan(&r).is_ok());
            if b < 1 << 24 {
                r.cache = Some(CacheSpec { batch_size: b + 1, ..base });
                prop_assert!(plan(&r).is_err());
            }
        }
        // llama.cpp n_gpu_layers: the answer fits and one more layer does not.
        let mut r = req.clone();
        r.strategy = weightlift_plan::Strategy::Layers(LayerOptions::default());
        if let Ok(n) = fit(&r, FitTarget::NGpuLayers) {
            let with = |n: u64| {
                let mut x = r.clone();
                x.strategy = weightlift_plan::Strategy::Layers(LayerOptions {
                    n_gpu_layers: n as i64,
                    ..LayerOptions::default()
                });
                x
            };
            prop_assert!(plan(&with(n)).is_ok());
            if n <= u64::from(req.spec.n_layers) {
                prop_assert!(plan(&with(n + 1)).is_err());
            }
        }
    }

    #[test]
    fn tp_tables_cover_each_dimension_once(
        budgets in prop::collection::vec(0u64..100_000, 1..6),
        kv in prop::sample::select(vec![1u64, 2, 4, 8, 16]),
        groups in 1u64..8,
        i128 in 1u64..500,
        h32 in 1u64..600,
        vocab in 1u64..200_000,
        cache in 0u64..(64 << 30),
    ) {
        prop_assume!(budgets.iter().any(|&b| b > 0));
        let inp = TpInputs {
            budgets_mib: budgets.clone(),
            n_kv_heads: kv,
            n_heads: kv * groups,
            intermediate_size: i128 * 128,
            hidden_size: h32 * 32,
            vocab_size: vocab,
            cache_bytes: cache,
            attn_footprints: vec![1 << 24; 4],
            n_experts: 0,
            dense_layers: false,
        };
        match define_split(&inp) {
            Ok(s) => {
                for (table, total, unit) in [
                    (&s.kv, kv, 1),
                    (&s.q, kv * groups, groups),
                    (&s.id, i128 * 128, 128),
                    (&s.rs, h32 * 32, 32),
                    (&s.vc, vocab.div_ceil(32) * 32, 32),
                ] {
                    let mut at = 0;
                    let mut last_dev = None;
                    for &(d, a, b) in table.iter() {
                        prop_assert_eq!(a, at);
                        prop_assert!(b > a && (b - a) % unit == 0);
                        prop_assert!(d < budgets.len());
                        prop_assert!(last_dev.is_none_or(|l| d > l));
                        last_dev = Some(d);
                        at = b;
                    }
                    prop_assert_eq!(at, total);
                }
            }
            Err(e) => prop_assert!(e.to_string().contains("no room"), "{}", e),
        }
    }
}

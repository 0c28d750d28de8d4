//! A CUDA device's fixed overhead: a `cuda:N` planned without its GPU is charged the default
//! context, cuBLAS workspace and graph memory of its compute capability, part by part, in
//! `explain()`, the JSON, `fit` and out-of-memory messages; `overhead=` replaces them.

use crate::common;

use common::*;
use weightlift_plan::overhead::{CONTEXT, CUBLAS, GIVEN, GRAPHS};
use weightlift_plan::{
    CacheDType, CacheSpec, CudaOverhead, FitTarget, PerDevice, Plan, PlanError, PlanOptions,
    PlanRequest, RuntimeSpec, fit, fmt_bytes, plan,
};

const MIB: u64 = 1 << 20;

/// SmolLM2 in q8_0 on `devices`, with a small compute scratch.
fn smollm2_on(devices: &str) -> PlanRequest {
    let mut req = request(smollm2(), "q8_0", devices);
    req.runtime = RuntimeSpec {
        max_input_len: 64,
        max_attention_size: 64 * 64,
        ..RuntimeSpec::default()
    };
    req
}

fn usage<'a>(p: &'a Plan, device: &str) -> &'a weightlift_plan::DeviceUsage {
    p.devices()
        .iter()
        .find(|d| d.name == device)
        .unwrap_or_else(|| panic!("no {device} in\n{}", p.explain()))
}

#[test]
fn a_cuda_stand_in_is_charged_the_defaults_of_its_capability() {
    for (spec, capability) in [
        ("cuda:0:4GiB:sm_90,cpu", Some((9, 0))),
        ("cuda:0:4GiB:sm_86,cpu", Some((8, 6))),
        ("cuda:0:4GiB,cpu", None),
    ] {
        let p = plan(&smollm2_on(spec)).unwrap();
        let gpu = usage(&p, "cuda:0");
        let expected = CudaOverhead::default_for(capability);
        assert_eq!(gpu.overhead, expected.total(), "{spec}");
        assert_eq!(
            gpu.used(),
            gpu.weights + gpu.kv + gpu.scratch + expected.total(),
            "{spec}"
        );
        let parts: Vec<(&str, u64)> = gpu
            .overhead_parts
            .iter()
            .map(|x| (x.name.as_str(), x.bytes))
            .collect();
        assert_eq!(
            parts,
            [
                (CONTEXT, expected.context),
                (CUBLAS, expected.cublas_workspace),
                (GRAPHS, expected.graphs)
            ],
            "{spec}"
        );
        // the host has none, and says nothing about it
        assert_eq!(usage(&p, "cpu").overhead, 0);
        assert!(usage(&p, "cpu").overhead_parts.is_empty());
    }

    let p = plan(&smollm2_on("cuda:0:4GiB:sm_90,cpu")).unwrap();
    let text = p.explain();
    assert!(
        text.contains(
            "overhead of cuda:0: 543.00 MiB cuda context and modules (default, sm_90) + \
             32.00 MiB cublas workspace (cuBLAS's recommendation, sm_90) + 8.00 MiB cuda \
             graphs (allowance)\n"
        ),
        "{text}"
    );
    assert!(!text.contains("overhead of cpu"), "{text}");
    let back = Plan::from_json(&p.to_json()).unwrap();
    assert_eq!(back, p, "the parts survive the JSON round trip");
    assert!(p.to_json().contains("\"overhead_parts\""));
}

#[test]
fn a_given_overhead_replaces_the_defaults() {
    let mut req = smollm2_on("cuda:0:4GiB:sm_90,cpu");
    PlanOptions {
        overhead: Some(PerDevice::All(100 * MIB)),
        ..PlanOptions::default()
    }
    .apply(&mut req)
    .unwrap();
    let p = plan(&req).unwrap();
    let gpu = usage(&p, "cuda:0");
    assert_eq!(gpu.overhead, 100 * MIB);
    assert_eq!(gpu.overhead_parts.len(), 1);
    assert_eq!(gpu.overhead_parts[0].name, GIVEN);
    assert!(
        p.explain()
            .contains("overhead of cuda:0: 100.00 MiB given (overhead=)\n"),
        "{}",
        p.explain()
    );
    // overhead=0 charges nothing at all
    req.overhead.insert("cuda:0".into(), 0);
    let p = plan(&req).unwrap();
    assert_eq!(usage(&p, "cuda:0").overhead, 0);
    assert!(!p.explain().contains("overhead of"), "{}", p.explain());
}

#[test]
fn fit_leaves_room_for_the_overhead() {
    let mut req = smollm2_on("cuda:0:800MiB:sm_90");
    req.cache = Some(CacheSpec::new(256, 1, CacheDType::Fp16));
    let with = fit(&req, FitTarget::MaxSeqLen).unwrap();
    req.overhead.insert("cuda:0".into(), 0);
    let without = fit(&req, FitTarget::MaxSeqLen).unwrap();
    assert!(with < without, "{with} vs {without}");
    // the context fit found fits with the overhead, and one cache page more does not
    req.overhead.clear();
    req.cache = Some(CacheSpec::new(with, 1, CacheDType::Fp16));
    let p = plan(&req).unwrap();
    let gpu = usage(&p, "cuda:0");
    assert_eq!(
        gpu.overhead,
        CudaOverhead::default_for(Some((9, 0))).total()
    );
    assert!(gpu.used() <= gpu.capacity);
    req.cache = Some(CacheSpec::new(with + 256, 1, CacheDType::Fp16));
    assert!(matches!(plan(&req), Err(PlanError::OutOfMemory(_))));
}

#[test]
fn out_of_memory_names_the_overhead_when_it_is_what_does_not_fit() {
    // What the model takes on cuda:0 without any overhead, then a device 64 MiB larger.
    let mut req = smollm2_on("cuda:0:8GiB:sm_90");
    req.overhead.insert("cuda:0".into(), 0);
    let bare = usage(&plan(&req).unwrap(), "cuda:0").used();
    req.overhead.clear();
    let cap = bare + 64 * MIB;
    req.devices = devices(&format!("cuda:0:{cap}B:sm_90"));
    let msg = match plan(&req) {
        Err(e @ PlanError::OutOfMemory(_)) => e.to_string(),
        other => panic!("expected OutOfMemory, got {other:?}"),
    };
    let total = CudaOverhead::default_for(Some((9, 0))).total();
    assert!(
        msg.contains(&format!(
            "{} fixed overhead (543.00 MiB cuda context and modules (default, sm_90) + 32.00 \
             MiB cublas workspace (cuBLAS's recommendation, sm_90) + 8.00 MiB cuda graphs \
             (allowance))",
            fmt_bytes(total)
        )),
        "{msg}"
    );
    assert!(
        msg.contains(&format!(
            "; the fixed overhead is what does not fit: the rest takes {} of {}",
            fmt_bytes(bare),
            fmt_bytes(cap)
        )),
        "{msg}"
    );
    // a device too small for the rest as well does not blame the overhead
    req.devices = devices(&format!("cuda:0:{}B:sm_90", bare / 2));
    let msg = plan(&req).unwrap_err().to_string();
    assert!(msg.contains("fixed overhead ("), "{msg}");
    assert!(!msg.contains("is what does not fit"), "{msg}");
}

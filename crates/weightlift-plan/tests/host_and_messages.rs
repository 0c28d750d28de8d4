//! A host too small for its share spills to disk instead of failing, and the texts of what
//! does fail: the low_mem and max_input_len fixes state what they save on the plan they give,
//! and a device with no part of the model says so rather than "-".

use crate::common;

use common::*;
use weightlift_plan::{
    CacheDType, CacheSpec, Dims, Hosts, Plan, PlanError, PlanRequest, RuntimeSpec, Strategy,
    Workspace, fmt_bytes, plan,
};

fn small_runtime() -> RuntimeSpec {
    RuntimeSpec {
        max_input_len: 64,
        max_attention_size: 64 * 64,
        ..RuntimeSpec::default()
    }
}

fn oom(req: &PlanRequest) -> Box<weightlift_plan::OutOfMemory> {
    match plan(req) {
        Err(PlanError::OutOfMemory(o)) => o,
        Err(e) => panic!("expected OutOfMemory, got {e}"),
        Ok(p) => panic!("expected OutOfMemory, got a plan:\n{}", p.explain()),
    }
}

/// tiny-llama in f32: a 31.25 MiB embedding on a 24 MiB cpu that has room for the staging
/// buffers (2 × 4 MiB) and its compute, but not for the embedding.
fn tight_host(strategy: &str, devs: &str) -> PlanRequest {
    let mut req = request(tiny_llama(), "float32", devs);
    req.strategy = Strategy::parse(strategy).unwrap();
    req.runtime = small_runtime();
    req
}

#[test]
fn autosplit_streams_the_embedding_from_disk_when_the_host_is_tight() {
    // exllamav2 keeps the embedding on the cpu: without a disk that cannot fit.
    let e = oom(&tight_host("autosplit", "virtual:64MiB,cpu:24MiB"));
    assert!(e.shortfalls.iter().any(|s| s.device == "cpu"), "{e}");
    let p = plan(&tight_host("autosplit", "virtual:64MiB,cpu:24MiB,disk")).unwrap();
    assert_eq!(p.embed_device(), "disk", "{}", p.explain());
    assert!(p.layer_devices().iter().all(|d| d == "virtual:0"));
    let cpu = p.devices().iter().find(|d| d.name == "cpu").unwrap();
    assert_eq!(cpu.weights, 0);
    assert!(cpu.used() <= cpu.capacity);
    // The head on the GPU gets its own copy of the tied embedding.
    assert_eq!(p.tied_output_copy(), Some("virtual:0"));
}

#[test]
fn llama_cpp_layers_spill_the_host_share_to_disk() {
    let e = oom(&tight_host("layers", "virtual:64MiB,cpu:24MiB"));
    assert!(e.shortfalls.iter().any(|s| s.device == "cpu"), "{e}");
    let p = plan(&tight_host("layers", "virtual:64MiB,cpu:24MiB,disk")).unwrap();
    assert_eq!(p.embed_device(), "disk", "{}", p.explain());
    assert!(p.layer_devices().iter().all(|d| d == "virtual:0"));

    // SmolLM2 with 10 layers offloaded: the embedding leaves first, then the host's layers from
    // the last, until the 48 MiB host fits.
    let mut req = request(smollm2(), "q4_1", "virtual:1GiB,cpu:48MiB,disk");
    req.strategy = Strategy::Layers(weightlift_plan::LayerOptions {
        n_gpu_layers: 10,
        ..weightlift_plan::LayerOptions::default()
    });
    req.runtime = small_runtime();
    let p = plan(&req).unwrap();
    assert_eq!(p.embed_device(), "disk", "{}", p.explain());
    let layers = p.layer_devices();
    let on_cpu = layers.iter().take_while(|d| *d == "cpu").count();
    assert!(on_cpu > 0 && on_cpu < 20, "{}", p.explain());
    assert!(layers[on_cpu..20].iter().all(|d| d == "disk"));
    assert!(layers[20..].iter().all(|d| d == "virtual:0"));
    let cpu = p.devices().iter().find(|d| d.name == "cpu").unwrap();
    assert!(cpu.used() <= cpu.capacity);
    // One more layer on the cpu would not fit: the fewest went to disk.
    let mut fewer = req.clone();
    fewer.strategy = Strategy::Map(weightlift_plan::DeviceMap {
        entries: vec![
            (format!("blk.0-{on_cpu}"), "cpu".into()),
            (format!("blk.{}-19", on_cpu + 1), "disk".into()),
            ("blk.20-29".into(), "virtual:0".into()),
            ("token_embd".into(), "disk".into()),
            ("".into(), "cpu".into()),
        ],
        overrides: vec![],
    });
    assert!(plan(&fewer).is_err());
}

/// Scratch a device computing `hosts` holds under `rt`, from the workspace definition.
fn scratch(req: &PlanRequest, rt: &RuntimeSpec, hosts: Hosts) -> u64 {
    let c = req.cache.unwrap();
    Workspace::new(
        &Dims::new(&req.spec, rt, c.max_seq_len, c.batch_size),
        hosts,
    )
    .bytes
}

/// What each device of `p` computes.
fn hosts_of(p: &Plan, device: &str) -> Hosts {
    Hosts {
        layers: p.layer_devices().iter().any(|d| d == device),
        head: p.head_device() == device,
        embed: p.embed_device() == device,
    }
}

#[test]
fn the_low_mem_fix_states_what_it_saves() {
    // SmolLM2 at ctx 4096 on one 170 MiB device: the 2048-token workspace does not fit,
    // low_mem's 1024 does.
    let mut req = request(smollm2(), "q4_1", "virtual:170MiB");
    req.cache = Some(CacheSpec::new(4096, 1, CacheDType::Q4));
    let e = oom(&req);
    let fix = e
        .fixes
        .iter()
        .find(|f| f.starts_with("low_mem=True"))
        .unwrap_or_else(|| panic!("{:?}", e.fixes));
    let low = RuntimeSpec {
        low_mem: true,
        ..req.runtime
    };
    let mut fixed = req.clone();
    fixed.runtime = low;
    let p = plan(&fixed).expect("the fix fits");
    let mut total = 0;
    for d in ["virtual:0", "cpu"] {
        let h = hosts_of(&p, d);
        let saved = scratch(&req, &req.runtime, h) - scratch(&req, &low, h);
        assert!(saved > 0, "{d}");
        assert!(
            fix.contains(&format!("{} on {d}", fmt_bytes(saved))),
            "{d} saves {saved}: {fix}"
        );
        total += saved;
    }
    assert!(
        fix.contains(&format!("saves {} of scratch", fmt_bytes(total))),
        "{fix}"
    );
    assert!(
        fix.contains("max_input_len 1024 and max_attention_size 1048576"),
        "{fix}"
    );
    // The cpu computes only the embedding lookup: it saves far less than the GPU.
    let gpu = scratch(&req, &req.runtime, hosts_of(&p, "virtual:0"))
        - scratch(&req, &low, hosts_of(&p, "virtual:0"));
    assert!(total - gpu < gpu / 4, "{fix}");
}

#[test]
fn the_max_input_len_fix_states_what_it_saves() {
    // Already low_mem: the next fix is a shorter input chunk.
    let mut req = request(smollm2(), "q4_1", "virtual:140MiB");
    req.cache = Some(CacheSpec::new(4096, 1, CacheDType::Q4));
    req.runtime.low_mem = true;
    let e = oom(&req);
    let fix = e
        .fixes
        .iter()
        .find(|f| f.starts_with("max_input_len "))
        .unwrap_or_else(|| panic!("{:?}", e.fixes));
    let n: u64 = fix["max_input_len ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let shorter = RuntimeSpec {
        max_input_len: n,
        ..req.runtime
    };
    let mut fixed = req.clone();
    fixed.runtime = shorter;
    let p = plan(&fixed).expect("the fix fits");
    let h = hosts_of(&p, "virtual:0");
    let saved = scratch(&req, &req.runtime, h) - scratch(&req, &shorter, h);
    assert!(
        fix.contains(&format!("{} on virtual:0", fmt_bytes(saved))),
        "{fix}"
    );
}

#[test]
fn a_device_with_no_model_weights_says_so() {
    // Everything fits the GPU, so the 1 MiB cpu holds nothing of the model, but it is where
    // the upload staging buffers live.
    let mut req = request(tiny_llama(), "float32", "virtual:1GiB,cpu:1MiB");
    req.strategy = Strategy::Sequential;
    req.runtime = small_runtime();
    let e = oom(&req);
    let msg = e.to_string();
    assert!(!msg.contains("for -"), "{msg}");
    assert!(
        msg.contains(
            "cpu is short by 7.00 MiB (needs 8.00 MiB, has 1.00 MiB) for no model weights, \
             but 8.00 MiB host staging buffers for uploads to the accelerators"
        ),
        "{msg}"
    );
    let fix = e
        .fixes
        .iter()
        .find(|f| f.starts_with("cpu with "))
        .unwrap_or_else(|| panic!("{msg}"));
    assert_eq!(fix, "cpu with 8.00 MiB fits");
    req.devices = devices("virtual:1GiB,cpu:8MiB");
    plan(&req).expect("the fix fits");
}

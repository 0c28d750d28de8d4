//! Plans over real checkpoints' tensor tables: the SmolLM2 GGUF and the reference tiny-llama
//! safetensors. Predicted weight bytes per device must equal the sum of the real tensor sizes
//! placed there. A missing file fails the test.

use std::path::Path;

use weightlift_format::{Checkpoint, MoeSpec, OpenOptions};
use weightlift_plan::*;

fn open(path: &Path) -> Option<Checkpoint> {
    assert!(
        path.exists(),
        "{} is missing (the demo model comes from `make demo-model`; the tiny-llama files from `make reference`)",
        path.display()
    );
    Some(
        Checkpoint::open(path, OpenOptions::default())
            .expect("the format crate opens the reference file"),
    )
}

fn check(ckpt: &Checkpoint, devices: &str, strategy: Strategy, cache: Option<CacheSpec>) -> Plan {
    let spec = ckpt.spec().expect("spec").clone();
    let mut req = PlanRequest::new(
        spec,
        ckpt.tensors().to_vec(),
        parse_devices(devices).unwrap(),
    );
    req.strategy = strategy;
    req.cache = cache;
    req.runtime = RuntimeSpec {
        max_input_len: 64,
        max_attention_size: 64 * 64,
        max_dq_size: 1 << 20,
        low_mem: false,
    };
    let p = plan(&req).unwrap_or_else(|e| panic!("{devices}: {e}"));
    for d in p.devices() {
        let mut sum = 0u64;
        for (t, info) in p.tensors().iter().zip(ckpt.tensors()) {
            assert_eq!(t.name, info.name);
            match &t.split {
                Some(s) => {
                    sum += s
                        .shards
                        .iter()
                        .filter(|x| x.device == d.name)
                        .map(|x| x.bytes)
                        .sum::<u64>()
                }
                None if t.device == d.name => sum += info.nbytes,
                None => {}
            }
        }
        sum += p
            .tied_output_parts()
            .iter()
            .filter(|x| x.0 == d.name)
            .map(|x| x.1)
            .sum::<u64>();
        assert_eq!(d.weights, sum, "{devices} {}: {}", d.name, p.explain());
        if d.capacity != u64::MAX {
            assert!(d.used() <= d.capacity);
        }
    }
    // A tied output copy is the whole token_embd, once.
    let copies: u64 = p.tied_output_parts().iter().map(|x| x.1).sum();
    if copies > 0 {
        assert_eq!(copies, ckpt.tensor("token_embd.weight").unwrap().nbytes);
    }
    p
}

#[test]
fn smollm2_gguf_under_several_inventories() {
    let Some(ckpt) = open(&weightlift_testdata::demo_gguf()) else {
        return;
    };
    assert_eq!(
        ckpt.total_bytes(),
        96_576_768,
        "gguf-py's total for this file"
    );
    let cache = Some(CacheSpec::new(1024, 1, CacheDType::Q8));
    let p = check(
        &ckpt,
        "virtual:2x72MiB,cpu:1GiB",
        Strategy::Autosplit,
        cache,
    );
    assert!(p.layer_devices().iter().any(|d| d == "virtual:1"));
    check(
        &ckpt,
        "virtual:2x64MiB,cpu:1GiB",
        Strategy::Sequential,
        cache,
    );
    check(&ckpt, "virtual:3x48MiB,cpu:1GiB", Strategy::Balanced, cache);
    check(
        &ckpt,
        "virtual:2x64MiB,cpu:1GiB",
        Strategy::Layers(LayerOptions {
            n_gpu_layers: 20,
            ..LayerOptions::default()
        }),
        cache,
    );
    check(
        &ckpt,
        "virtual:2x96MiB,cpu:1GiB",
        Strategy::Layers(LayerOptions {
            split_mode: SplitMode::Row,
            ..LayerOptions::default()
        }),
        cache,
    );
    // 9 heads / 3 kv heads: the TP tables split 3 kv heads.
    let p = check(
        &ckpt,
        "virtual:2x128MiB,cpu:1GiB",
        Strategy::TensorParallel(TpOptions::default()),
        cache,
    );
    assert_eq!(p.tp_split(TpKind::Kv).unwrap().last().unwrap().2, 3);
    check(
        &ckpt,
        "virtual:64MiB,cpu:1GiB",
        Strategy::Map(DeviceMap {
            entries: vec![
                ("".into(), "cpu".into()),
                ("blk.0-14".into(), "virtual:0".into()),
            ],
            overrides: vec![],
        }),
        cache,
    );
    // The synthesized table of the same config plans to the same bytes.
    let spec = ckpt.spec().unwrap().clone();
    let synth = synthesize_tensors(&spec, WeightType::parse("q4_1").unwrap(), None).unwrap();
    let mut a = PlanRequest::new(
        spec.clone(),
        synth,
        parse_devices("virtual:2x72MiB,cpu:1GiB").unwrap(),
    );
    let mut b = PlanRequest::new(
        spec,
        ckpt.tensors().to_vec(),
        parse_devices("virtual:2x72MiB,cpu:1GiB").unwrap(),
    );
    a.cache = cache;
    b.cache = cache;
    let (pa, pb) = (plan(&a).unwrap(), plan(&b).unwrap());
    assert_eq!(pa.layer_devices(), pb.layer_devices());
    for (x, y) in pa.devices().iter().zip(pb.devices()) {
        assert_eq!((x.weights, x.kv, x.scratch), (y.weights, y.kv, y.scratch));
    }
}

#[test]
fn tiny_llama_safetensors_under_several_inventories() {
    let Some(ckpt) = open(&weightlift_testdata::reference_file(
        "tiny-llama/safetensors/model.safetensors",
    )) else {
        return;
    };
    let cache = Some(CacheSpec::new(512, 1, CacheDType::Fp16));
    check(
        &ckpt,
        "virtual:2x16MiB,cpu:1GiB",
        Strategy::Autosplit,
        cache,
    );
    check(
        &ckpt,
        "virtual:2x16MiB,cpu:1GiB",
        Strategy::BalancedLow0,
        cache,
    );
    check(
        &ckpt,
        "virtual:16MiB,cpu:1GiB",
        Strategy::Map(DeviceMap {
            entries: vec![
                ("model.embed_tokens".into(), "cpu".into()),
                ("model.layers.0".into(), "virtual:0".into()),
                ("model.layers.1".into(), "cpu".into()),
                ("model.norm".into(), "cpu".into()),
            ],
            overrides: vec![],
        }),
        cache,
    );
}

/// The engine team's report, on the real file: `virtual:1x4MiB,cpu:8MiB,disk`, sequential,
/// allow_disk. Nothing fits the 4 MiB device, so every layer stays on disk and is computed by
/// the host, which also needs the upload staging buffers: the 8 MiB cpu is short, and the
/// planner must say so instead of handing the engine a plan it cannot allocate.
#[test]
fn tiny_llama_all_on_disk_charges_the_small_cpu() {
    let Some(ckpt) = open(&weightlift_testdata::reference_file(
        "tiny-llama/safetensors/model.safetensors",
    )) else {
        return;
    };
    let spec = ckpt.spec().expect("spec").clone();
    let mut req = PlanRequest::new(
        spec,
        ckpt.tensors().to_vec(),
        parse_devices("virtual:1x4MiB,cpu:8MiB,disk").unwrap(),
    );
    req.strategy = Strategy::Sequential;
    req.allow_disk = true;
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
    // 2 × the largest tensor (the 32000 × 256 bf16 embedding) of staging alone is over 8 MiB.
    let largest = ckpt.tensors().iter().map(|t| t.nbytes).max().unwrap();
    assert!(cpu.needed >= 2 * largest, "{e}");
    // Given the host RAM for the compute, the same request plans: weights on disk, the disk's
    // compute and staging on the cpu, within its capacity. 48 MiB holds the 8 MiB of staging
    // (2 × the 4 MiB default) and the 2048-token workspace, 34.23 MiB (the f32 workspace does
    // not depend on the weights' bf16), but not the 18.63 MiB of weights as well.
    req.devices = parse_devices("virtual:1x4MiB,cpu:48MiB,disk").unwrap();
    let p = plan(&req).unwrap();
    assert!(
        p.layer_devices().iter().all(|d| d == "disk") && p.host().disk_weights > 0,
        "{}",
        p.explain()
    );
    for d in p.devices() {
        if d.capacity != u64::MAX {
            assert!(d.used() <= d.capacity, "{}", p.explain());
        }
    }
    let disk = p.devices().iter().find(|d| d.name == "disk").unwrap();
    assert_eq!((disk.kv, disk.scratch), (0, 0));
}

/// The tensor table a config-only plan synthesises is the one llama.cpp writes: for every
/// family fixture, made by llama.cpp's converter (F16) and its quantiser (Q8_0, and the wide
/// copies' Q4_K_M), the synthesised table from the file's own spec and routing, with
/// LongRoPE's two factor tables where the family's config.json scales RoPE by LongRoPE (phi3),
/// is the file's: every tensor by name with the file's type, shape and bytes, none missing,
/// and the factor tables first, where the converter writes them (F16).
#[test]
fn synthesised_tables_are_llama_cpp_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data");
    let families = [
        "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3moe",
    ];
    let mut files = Vec::new();
    for f in families {
        for (name, preset) in [("F16", QuantPreset::F16), ("Q8_0", QuantPreset::Q8_0)] {
            files.push((root.join(format!("tiny-{f}/tiny-{f}-{name}.gguf")), preset));
        }
        files.push((
            root.join(format!("wide-q4k/{f}/wide-{f}-Q4_K_M.gguf")),
            QuantPreset::Q4KM,
        ));
    }
    let mut longrope_files = 0;
    for (path, preset) in files {
        let ckpt = open(&path).unwrap();
        let spec = ckpt.spec().expect("spec");
        let moe = MoeSpec::from_gguf(ckpt.metadata()).expect("routing");
        // the tiny model's config (the wide copies follow the same recipe)
        let family = path.file_name().unwrap().to_string_lossy();
        let family = family.split('-').nth(1).unwrap();
        let config =
            weightlift_format::hf_config::read(&root.join(format!("tiny-{family}/config.json")))
                .unwrap();
        let mut synth = Vec::new();
        if weightlift_format::hf_config::has_longrope_factors(&config) {
            synth = longrope_tensors(spec).unwrap();
            longrope_files += 1;
        }
        synth.extend(
            synthesize_tensors(spec, WeightType::Gguf(preset), moe.as_ref())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        );
        let want: std::collections::HashMap<&str, _> = ckpt
            .tensors()
            .iter()
            .map(|t| (t.name.as_str(), t))
            .collect();
        for t in &synth {
            let w = want
                .get(t.name.as_str())
                .unwrap_or_else(|| panic!("{}: {} is not in the file", path.display(), t.name));
            assert_eq!(
                (t.dtype, &t.shape, t.nbytes, t.role),
                (w.dtype, &w.shape, w.nbytes, w.role),
                "{}: {}",
                path.display(),
                t.name
            );
        }
        let missing: Vec<&str> = ckpt
            .tensors()
            .iter()
            .filter(|w| !synth.iter().any(|t| t.name == w.name))
            .map(|w| w.name.as_str())
            .collect();
        assert!(
            missing.is_empty(),
            "{}: not synthesised: {missing:?}",
            path.display()
        );
        // llama.cpp's quantiser (Q8_0, the Q4_K_M copies) writes the table in its own order
        if synth[0].name.starts_with("rope_factors_") && preset == QuantPreset::F16 {
            let names = |t: &[weightlift_format::TensorInfo]| -> Vec<String> {
                t.iter().take(2).map(|t| t.name.clone()).collect()
            };
            assert_eq!(
                names(&synth),
                names(ckpt.tensors()),
                "{}: the first tensors",
                path.display()
            );
        }
    }
    // tiny-phi3's F16 and Q8_0 files and its wide Q4_K_M copy
    assert_eq!(longrope_files, 3);
}

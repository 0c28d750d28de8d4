//! Plans from the planner, carried out by the loader: memory actually held equals the plan's
//! prediction (weights + KV + scratch per device) within 1 %, on the SmolLM2 GGUF and
//! tiny-llama, with the cache beside the layers or offloaded to host RAM.

use std::path::PathBuf;
use std::sync::Arc;

use crate::common;

use weightlift_engine::planned::splits;
use weightlift_engine::{Cache, Inventory, LoadOptions, Model, Source};
use weightlift_format::{Checkpoint, OpenOptions};
use weightlift_plan::{
    CacheDType, CacheSpec, LayerOptions, Plan, RuntimeSpec, Strategy, TpOptions,
};

fn demo() -> PathBuf {
    weightlift_testdata::demo_gguf()
}

fn tiny(sub: &str) -> PathBuf {
    weightlift_testdata::reference()
        .join("tiny-llama")
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
            .cache_config(c.max_seq_len, c.batch_size, c.dtype, c.offload)
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
    assert_holds_the_plan(&model, &plan);
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

/// What `model` holds per device equals what `plan` charges it (weights, KV, scratch) within
/// 1 %.
fn assert_holds_the_plan(model: &Model, plan: &Plan) {
    let mem = model.memory();
    for d in plan.devices() {
        let want = d.weights + d.kv + d.scratch;
        let got = mem
            .iter()
            .find(|(n, _)| *n == d.name)
            .map_or(0, |(_, b)| *b);
        assert!(
            got.abs_diff(want) <= want / 100,
            "{} {}: plan {want} B, held {got} B",
            plan.strategy(),
            d.name
        );
    }
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
        check(&p, "virtual:2x12MiB,cpu", Strategy::Autosplit, cache);
        check(&p, "virtual:3x16MiB,cpu", Strategy::Balanced, cache);
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
    let p = demo();
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

fn kv_of(plan: &Plan, dev: &str) -> u64 {
    plan.devices()
        .iter()
        .find(|d| d.name == dev)
        .map_or(0, |d| d.kv)
}

/// An offloaded cache, planned with the planner's offload option: the plan's kv column holds
/// the whole cache on `cpu` and two prefetch slots on each layer device, and what the loaded
/// model holds equals it within 1 % (`check`). tiny-llama: 2 layers, 2 KV heads of 64, so at
/// ctx 512 × batch 2 in fp16 one layer is 2 × 2 × 64 × 512 × 2 × 2 B = 524,288 B.
#[test]
fn offloaded_cache_is_planned_and_held() {
    let path = tiny("gguf/tiny-llama-Q8_0.gguf");
    let cache = CacheSpec::new(512, 2, CacheDType::Fp16).with_offload(true);
    let plan = check(
        &path,
        "virtual:2x6MiB,cpu",
        Strategy::Autosplit,
        Some(cache),
    );
    assert!(plan.cache().unwrap().offload);
    assert_eq!(kv_of(&plan, "cpu"), 2 * 524_288);
    let mut on_devices = 0;
    for dev in ["virtual:0", "virtual:1"] {
        let n = plan.layer_devices().iter().filter(|d| *d == dev).count() as u64;
        assert_eq!(kv_of(&plan, dev), n.min(2) * 524_288, "{dev}");
        on_devices += n;
    }
    assert_eq!(on_devices, 2, "{}", plan.explain());
    // The engine's own prediction agrees with the plan.
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(&path, OpenOptions::default()).unwrap());
    let model = Model::new(src, Inventory::parse("virtual:2x6MiB,cpu").unwrap());
    let cfg = model
        .cache_config(512, 2, weightlift_engine::CacheDType::Fp16, true)
        .unwrap();
    assert_eq!(weightlift_engine::planned::cache_spec(&cfg), cache);
    for (dev, bytes) in cfg.expected_memory(plan.layer_devices()) {
        assert_eq!(kv_of(&plan, &dev), bytes, "{dev}");
    }
}

/// The demo model offloaded over two virtual devices and over llama.cpp's layer split: SmolLM2
/// (30 layers, 3 KV heads of 64) at ctx 2048 in q4 is 2 × 12,288 groups × 18 B = 442,368 B per
/// layer, 13,271,040 B on the cpu.
#[test]
fn demo_model_with_an_offloaded_cache() {
    let p = demo();
    let cache = CacheSpec::new(2048, 1, CacheDType::Q4).with_offload(true);
    let plan = check(&p, "virtual:2x64MiB", Strategy::Autosplit, Some(cache));
    assert_eq!(kv_of(&plan, "cpu"), 13_271_040);
    // Autosplit fills virtual:0 with layers 0-28; virtual:1 computes layer 29 (and the tied
    // head), so it needs a single slot.
    let n = |dev: &str| plan.layer_devices().iter().filter(|d| *d == dev).count();
    assert_eq!(
        (n("virtual:0"), n("virtual:1")),
        (29, 1),
        "{}",
        plan.explain()
    );
    assert_eq!(kv_of(&plan, "virtual:0"), 2 * 442_368);
    assert_eq!(kv_of(&plan, "virtual:1"), 442_368);
    let layers = LayerOptions {
        n_gpu_layers: 10,
        ..LayerOptions::default()
    };
    // The last 10 layers on the devices; the cpu computes 20, so it holds 2 slots as well.
    let plan = check(&p, "virtual:2x64MiB", Strategy::Layers(layers), Some(cache));
    assert_eq!(kv_of(&plan, "cpu"), 13_271_040 + 2 * 442_368);
}

#[test]
fn plan_sources_from_a_checkpoint_a_config_or_a_spec() {
    use weightlift_engine::planned::PlanSource;
    use weightlift_plan::PlanOptions;
    let devices = || weightlift_plan::parse_devices("virtual:64MiB,cpu").unwrap();
    // A GGUF path opens as a checkpoint: its real tensor table is planned.
    let ckpt = Checkpoint::open(demo(), OpenOptions::default()).unwrap();
    let req = PlanSource::path(&demo())
        .unwrap()
        .request(PlanOptions::default(), devices())
        .unwrap();
    assert_eq!(req.tensors.len(), ckpt.tensors().len());
    // transformers' config.json (tiny-llama says bfloat16) synthesises the table.
    let config = weightlift_testdata::repo_root().join("tests/data/tiny-llama/config.json");
    let plan = weightlift_plan::plan(
        &PlanSource::path(&config)
            .unwrap()
            .request(PlanOptions::default(), devices())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(plan.architecture(), "llama");
    // A bare spec needs a weight type.
    let spec = PlanSource::spec(ckpt.spec().unwrap().clone());
    let e = spec
        .request(PlanOptions::default(), devices())
        .unwrap_err()
        .to_string();
    assert!(e.contains("weight_dtype"), "{e}");
    // A vocab-only checkpoint has no table to plan.
    let vocab = Checkpoint::open(
        demo(),
        OpenOptions {
            vocab_only: true,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    let e = PlanSource::checkpoint(&vocab).unwrap_err().to_string();
    assert!(e.contains("vocab_only"), "{e}");
}

#[test]
fn a_caller_cache_defaults_to_the_context_length_and_is_lazy_until_the_load() {
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(demo(), OpenOptions::default()).unwrap());
    let mut model = Model::new(src, Inventory::parse("virtual:64MiB").unwrap());
    // SmolLM2-135M's trained context (llama.context_length) is 8192.
    let cache = model
        .new_cache(None, 1, CacheDType::Fp16, false, true)
        .unwrap();
    assert_eq!(cache.config().max_seq_len, 8192);
    assert!(!cache.is_allocated());
    let e = model
        .new_cache(Some(64), 1, CacheDType::Fp16, false, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("non-lazy cache needs a loaded model"), "{e}");
}

/// A plan's cache of several sequences (a server's `--parallel 3`) is held as three caches of
/// one beside the layers: the model's own and two for a batch's slots. What the model holds
/// equals the plan within 1 %, a batch of three takes those slots without allocating, and
/// the unload frees them.
#[test]
fn a_planned_cache_of_several_sequences_is_held_as_that_many_slots() {
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(demo(), OpenOptions::default()).unwrap());
    let inv = Inventory::parse("virtual:2x96MiB,cpu").unwrap();
    let mut model = Model::new(Arc::clone(&src), inv.clone());
    let options = weightlift_plan::PlanOptions {
        cache: Some(CacheSpec::new(512, 3, CacheDType::Fp16)),
        runtime: Some(RuntimeSpec {
            max_input_len: 32,
            max_attention_size: 32 * 32,
            max_dq_size: 1 << 16,
            low_mem: false,
        }),
        ..Default::default()
    };
    let plan = common::plan_and_load(&mut model, options);
    let own = model.own_cache().unwrap();
    let more = model.planned_sequences();
    assert_eq!((own.config().batch_size, more.len()), (1, 2));
    assert!(
        more.iter()
            .all(|c| c.config().max_seq_len == 512 && c.is_allocated())
    );
    assert_holds_the_plan(&model, &plan);
    let held = model.memory();
    assert!(plan.devices().iter().map(|d| d.kv).sum::<u64>() > 0);
    let batch = weightlift_engine::generate::batch::Batch::new(&model, 3).unwrap();
    assert_eq!(model.memory(), held);
    drop(batch);
    model.unload();
    assert!(inv.all().iter().all(|d| d.used() == 0));
}

/// An embedding runs in a planned sequence that no batch took (`weightlift serve` plans one
/// beyond its slots): nothing is allocated, the peak stays where it was, and the sequence is
/// left empty. With every sequence in a batch it runs on a scratch cache, with the same bits.
#[test]
fn an_embedding_runs_in_a_planned_sequence_no_batch_took() {
    use weightlift_engine::Pooling;
    use weightlift_engine::generate::batch::{Answer, Batch};
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(demo(), OpenOptions::default()).unwrap());
    let inv = Inventory::parse("virtual:2x96MiB,cpu").unwrap();
    let mut model = Model::new(Arc::clone(&src), inv.clone());
    let options = weightlift_plan::PlanOptions {
        cache: Some(CacheSpec::new(256, 3, CacheDType::Fp16)),
        ..Default::default()
    };
    common::plan_and_load(&mut model, options);
    let ids: Vec<u32> = (1..40).collect();
    // two slots of three: the third sequence is the embeddings'
    let mut batch = Batch::new(&model, 2).unwrap();
    let options = weightlift_engine::generate::GenerateOptions {
        max_tokens: Some(2),
        ..Default::default()
    };
    batch
        .start(&model, &[1, 2, 3], options, Answer::Text)
        .unwrap();
    while batch.running() > 0 {
        batch.step(&mut model).unwrap();
    }
    let (usage, peak) = (model.device_usage(), model.peak_memory());
    let planned = model.embed(&ids, Pooling::None, false).unwrap();
    assert_eq!(model.device_usage(), usage);
    assert_eq!(model.peak_memory(), peak, "no scratch cache");
    // the batch's second slot is the first planned sequence; the second is left empty
    assert_eq!(model.planned_sequences()[1].seq_len(), 0);
    drop(batch);
    let all = Batch::new(&model, 3).unwrap();
    let scratch = model.embed(&ids, Pooling::None, false).unwrap();
    assert_eq!(model.device_usage(), usage, "the scratch cache is freed");
    assert!(model.peak_memory() > peak, "a scratch cache");
    let bits = |v: &[Vec<f32>]| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&planned), bits(&scratch));
    drop(all);
}

/// The same under tensor parallelism (a server's `--parallel 3` on a tensor-parallel plan):
/// three caches of one sequence, each split by kv heads over the devices, holding what the
/// plan says; a batch of three runs in them.
#[test]
fn a_tensor_parallel_cache_of_several_sequences_is_held_as_that_many_split_slots() {
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(demo(), OpenOptions::default()).unwrap());
    let inv = Inventory::parse("virtual:2x256MiB,cpu").unwrap();
    let mut model = Model::new(Arc::clone(&src), inv.clone());
    let options = weightlift_plan::PlanOptions {
        strategy: Some("tensor_parallel".into()),
        cache: Some(CacheSpec::new(128, 3, CacheDType::Fp16)),
        ..Default::default()
    };
    let plan = common::plan_and_load(&mut model, options);
    assert!(plan.tp().is_some());
    let own = model.own_cache().unwrap();
    let more = model.planned_sequences();
    assert_eq!((own.config().batch_size, more.len()), (1, 2));
    for c in std::iter::once(&own).chain(&more) {
        assert_eq!(c.config().max_seq_len, 128);
        assert_eq!(c.tp_parts().len(), 2, "split over both devices");
    }
    assert_holds_the_plan(&model, &plan);
    let mut batch = weightlift_engine::generate::batch::Batch::new(&model, 3).unwrap();
    for prompt in [&[1u32, 2, 3][..], &[4, 5], &[6]] {
        let options = weightlift_engine::generate::GenerateOptions {
            max_tokens: Some(2),
            ..Default::default()
        };
        batch
            .start(
                &model,
                prompt,
                options,
                weightlift_engine::generate::batch::Answer::Text,
            )
            .unwrap();
    }
    while batch.running() > 0 {
        batch.step(&mut model).unwrap();
    }
}

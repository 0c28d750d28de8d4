//! A [`Session`] on the SmolLM2 demo GGUF: a cache given as a shape is planned with the layers
//! (or made beside a given plan), a closed session refuses every use, `load_llama` places
//! and sizes as llama-cpp-python's `Llama(...)`, a generation's steps leave their timings on
//! the session, and dequantisation runs in chunks of the runtime's `max_dq_size`. Each load
//! call reads its own keywords, and the session's view and settings are what the Python
//! `Model`'s properties show and change.

use std::sync::Arc;

use serde_json::json;
use weightlift_engine::keywords::LoadCall;
use weightlift_engine::llama_cpp::{CacheType, DEFAULT_SEED, LlamaLoad, Seed};
use weightlift_engine::session::{LoadCache, Prompt, Session, Setting, Settings};
use weightlift_engine::{CacheDType, GenerateOptions, Generation, Inventory, LoadOptions, Source};
use weightlift_format::{Checkpoint, OpenOptions};
use weightlift_plan::{CacheSpec, Keywords, PlanOptions, RuntimeSpec};

/// Small forward passes keep the scratch small (the default runtime plans 2048-token prompts).
const SMALL: RuntimeSpec = RuntimeSpec {
    max_input_len: 32,
    max_attention_size: 32 * 32,
    max_dq_size: 1 << 16,
    low_mem: false,
};

fn session(devices: Option<&str>) -> (Session, Inventory) {
    let path = weightlift_testdata::demo_gguf();
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(&path, OpenOptions::default()).unwrap());
    let inv = match devices {
        Some(spec) => Inventory::parse(spec).unwrap(),
        None => Inventory::parse("cpu").unwrap(),
    };
    let settings = Settings::parse("auto", "fast", None, Some(SMALL), Some(1)).unwrap();
    let s = Session::new(src, inv.clone(), devices.map(str::to_owned), settings).unwrap();
    (s, inv)
}

#[test]
fn a_cache_shape_is_planned_with_the_layers_or_made_beside_a_given_plan() {
    let (mut s, inv) = session(Some("virtual:2x96MiB,cpu"));
    assert_eq!(s.devices, "virtual:2x96MiB,cpu");
    let shape = CacheSpec::new(256, 1, CacheDType::Q8);
    let opts = LoadOptions::default();
    s.load(
        None,
        PlanOptions::default(),
        LoadCache::Shape(shape),
        &opts,
        &mut |_| true,
    )
    .unwrap();
    let plan = s.plan.clone().unwrap();
    assert_eq!(plan.cache(), Some(&shape));
    assert_eq!(plan.runtime(), &SMALL);
    let own = s.model.own_cache().unwrap();
    assert_eq!(weightlift_engine::planned::cache_spec(own.config()), shape);
    let planned_kv: u64 = plan.devices().iter().map(|d| d.kv).sum();
    let held_kv: u64 = own.memory().iter().map(|(_, b)| b).sum();
    assert_eq!(planned_kv, held_kv);

    // The same plan again, given: it takes no options, so the shape's cache is made here.
    s.unload();
    assert!(s.plan.is_none());
    assert!(inv.all().iter().all(|d| d.used() == 0));
    let other = CacheSpec::new(128, 1, CacheDType::Fp16);
    s.load(
        Some(plan.clone()),
        PlanOptions::default(),
        LoadCache::Shape(other),
        &opts,
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(s.plan.as_ref(), Some(&plan));
    let own = s.model.own_cache().unwrap();
    assert_eq!(weightlift_engine::planned::cache_spec(own.config()), other);
    assert_eq!(own.device_of(0).unwrap(), plan.layer_devices()[0]);

    let both = s.load(
        Some(plan),
        PlanOptions::autosplit(None),
        LoadCache::None,
        &opts,
        &mut |_| true,
    );
    let e = both.unwrap_err().to_string();
    assert!(
        e.starts_with("load: expected a plan or placement options"),
        "{e}"
    );
}

#[test]
fn a_closed_session_refuses_every_use_and_holds_nothing() {
    let (mut s, inv) = session(Some("virtual:2x96MiB,cpu"));
    s.check_open().unwrap();
    let opts = LoadOptions::default();
    s.load(
        None,
        PlanOptions::default(),
        LoadCache::None,
        &opts,
        &mut |_| true,
    )
    .unwrap();
    assert!(s.model.is_loaded() && s.plan.is_some());
    s.close();
    assert!(s.is_closed() && !s.model.is_loaded() && s.plan.is_none());
    assert!(inv.all().iter().all(|d| d.used() == 0));
    let path = weightlift_testdata::demo_gguf();
    let want = format!(
        "Model('{}') is closed; open the checkpoint again to use it",
        path.display()
    );
    assert_eq!(s.check_open().unwrap_err().to_string(), want);
    s.close();
    assert!(s.is_closed());
}

#[test]
fn without_a_device_spec_the_session_names_the_inventory() {
    let (s, inv) = session(None);
    assert_eq!(s.devices, inv.spec());
    assert_eq!(s.model.n_threads(), 1);
}

#[test]
fn load_llama_makes_the_n_ctx_cache_of_type_k_and_type_v_and_places_by_n_gpu_layers() {
    let (mut s, _) = session(Some("virtual:2x96MiB,cpu"));
    s.set_llama(Some(Seed::Fixed(DEFAULT_SEED)), true, None)
        .unwrap();
    assert_eq!((s.seed, s.spm_infill), (None, true));
    s.set_llama(Some(Seed::Fixed(7)), false, Some("chatml"))
        .unwrap();
    assert_eq!(s.seed, Some(7));
    s.set_llama(Some(Seed::Random), false, Some("chatml"))
        .unwrap();
    assert_eq!(s.seed, None);
    s.set_llama(Some(Seed::Fixed(7)), false, Some("chatml"))
        .unwrap();
    assert_eq!(s.seed, Some(7));
    assert!(s.model.chat_stop().is_some());
    assert!(s.set_llama(None, false, Some("no-such-format")).is_err());
    let args = LlamaLoad {
        n_gpu_layers: -1,
        n_ctx: 256,
        n_batch: 16,
        type_k: Some(CacheType::Ggml(8)),
        type_v: Some(CacheType::Name("q4_0".into())),
        ..LlamaLoad::default()
    };
    s.load_llama(args, None, &mut |_| true).unwrap();
    let plan = s.plan.clone().unwrap();
    assert_eq!(plan.strategy(), "layers");
    assert!(
        plan.layer_devices()
            .iter()
            .all(|d| d.starts_with("virtual:"))
    );
    let own = s.model.own_cache().unwrap();
    assert_eq!(
        (own.config().max_seq_len, own.config().dtype),
        (256, CacheDType::Q6)
    );
    // n_batch is the prompt chunk, the rest of the runtime llama.cpp has no word for
    assert_eq!(s.defaults.runtime.max_input_len, 16);
    assert_eq!(
        s.defaults.runtime.max_dq_size,
        RuntimeSpec::default().max_dq_size
    );

    // A runtime given to the model wins over n_batch.
    s.unload();
    s.load_llama(LlamaLoad::default(), Some(SMALL), &mut |_| true)
        .unwrap();
    assert_eq!(s.defaults.runtime, SMALL);
    let own = s.model.own_cache().unwrap();
    assert_eq!(
        (own.config().max_seq_len, own.config().dtype),
        (512, CacheDType::Fp16)
    );
}

#[test]
fn load_llama_without_an_accelerator_puts_everything_on_the_cpu() {
    let (mut s, _) = session(Some("cpu"));
    let args = LlamaLoad {
        n_gpu_layers: -1,
        ..LlamaLoad::default()
    };
    s.load_llama(args, None, &mut |_| true).unwrap();
    let plan = s.plan.unwrap();
    assert!(plan.layer_devices().iter().all(|d| d == "cpu"));
    assert_eq!(plan.head_device(), "cpu");
}

#[test]
fn steps_leave_the_generation_timings_and_dequantisation_is_chunked_by_the_runtime() {
    let (mut s, _) = session(Some("cpu"));
    s.load(
        None,
        PlanOptions::default(),
        LoadCache::None,
        &LoadOptions::default(),
        &mut |_| true,
    )
    .unwrap();
    assert!(s.timings.is_none());
    let prompt = s.model.completion_prompt("One, two,").unwrap();
    let mut options = GenerateOptions {
        max_tokens: Some(3),
        ..GenerateOptions::default()
    };
    options.sampling.temperature = 0.0;
    let mut job = Generation::start(&mut s.model, &prompt, None, options).unwrap();
    let mut steps = 0;
    while s.step(&mut job).unwrap().is_some() {
        steps += 1;
        assert_eq!(s.timings, Some(job.timings()));
    }
    assert!(steps > 0);
    let t = s.timings.unwrap();
    assert_eq!(t.prompt_tokens, prompt.len() as u64);

    // token_embd is 49152 × 576 values: many chunks of SMALL's 65536.
    let d = s.dequantized("token_embd.weight").unwrap();
    assert_eq!(d.shape, [49152, 576]);
    assert_eq!(d.chunks, (49152 * 576usize).div_ceil(1 << 16));
    let path = weightlift_testdata::demo_gguf();
    let ckpt = Checkpoint::open(&path, OpenOptions::default()).unwrap();
    let info = ckpt.tensor("token_embd.weight").unwrap();
    let whole = weightlift_engine::dequantize::checkpoint_tensor(&ckpt, info).unwrap();
    assert_eq!(d.values, whole);
}

#[test]
fn a_completion_prompt_is_ids_as_given_text_tokenized_or_text_before_a_suffix() {
    let (s, _) = session(None);
    let ids = vec![504, 3575];
    let given = s.completion_ids(Prompt::Ids(ids.clone()), None).unwrap();
    assert_eq!(given, (ids.clone(), None));
    assert_eq!(s.prompt_ids(Prompt::Ids(ids.clone()), None).unwrap(), ids);
    let text = s
        .completion_ids(Prompt::Text("def add(".into()), None)
        .unwrap();
    assert_eq!(text, (s.model.completion_prompt("def add(").unwrap(), None));
    // The demo vocabulary has no fill-in-the-middle tokens: as llama-cpp-python, the prompt is
    // completed and the suffix is put after the generated text.
    let suffixed = s
        .completion_ids(Prompt::Text("def add(".into()), Some("\n"))
        .unwrap();
    assert_eq!(suffixed, (text.0, Some("\n".to_owned())));
    let e = s
        .completion_ids(Prompt::Ids(ids), Some("x"))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("suffix: expected a text prompt"), "{e}");
}

fn kw(v: serde_json::Value) -> Keywords {
    Keywords::from_json(v).unwrap()
}

#[test]
fn each_load_call_reads_its_own_keywords() {
    let (mut s, _) = session(Some("virtual:2x96MiB,cpu"));
    let cache = json!({"max_seq_len": 64, "dtype": "q8"});
    let load = kw(json!({"cache": cache, "strategy": "layers", "n_gpu_layers": 2}));
    s.load_keywords(LoadCall::Load, &load, None, &mut |_| true)
        .unwrap();
    let plan = s.plan.clone().unwrap();
    assert_eq!(plan.strategy(), "layers");
    assert_eq!(plan.cache(), Some(&CacheSpec::new(64, 1, CacheDType::Q8)));

    // A plan's JSON loads that plan; the shape's cache is made beside it.
    s.unload();
    let again = kw(json!({"plan": plan.to_json(), "cache": {"max_seq_len": 32}}));
    s.load_keywords(LoadCall::Load, &again, None, &mut |_| true)
        .unwrap();
    assert_eq!(s.plan.as_ref(), Some(&plan));
    assert_eq!(s.model.own_cache().unwrap().config().max_seq_len, 32);

    // load_autosplit takes only a Cache the caller made, never a shape.
    s.unload();
    let e = s
        .load_keywords(
            LoadCall::Autosplit,
            &kw(json!({"cache": cache})),
            None,
            &mut |_| true,
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "cache: expected a Cache made for this model, got dict"
    );
    assert!(!s.model.is_loaded());

    // load_gguf's vocab_only takes the llama settings and loads nothing.
    let llama = kw(json!({"vocab_only": true, "seed": 7}));
    s.load_keywords(LoadCall::Llama, &llama, None, &mut |_| true)
        .unwrap();
    assert_eq!(s.seed, Some(7));
    assert!(!s.model.is_loaded());
    assert!(LoadCall::parse("autosplit").is_ok() && LoadCall::parse("fast").is_err());
}

#[test]
fn the_view_shows_the_session_and_settings_change_how_it_runs() {
    let (mut s, _) = session(Some("cpu"));
    let view = serde_json::to_value(s.view()).unwrap();
    assert_eq!(view["devices"], "cpu");
    assert_eq!(view["loaded"], false);
    assert_eq!(view["memory"], json!({"cpu": 0}));
    assert_eq!(
        view["transfer_stats"],
        json!({"copies": 0, "bytes": 0, "seconds": 0.0})
    );
    assert_eq!(view["cuda_graph_counts"], json!([0, 0, null]));
    assert_eq!(view["compute"], "fast");

    s.set(Setting::Compute("exact".into())).unwrap();
    s.set(Setting::CudaGraphs(false)).unwrap();
    s.set(Setting::Int8Threshold(0.0)).unwrap();
    let view = serde_json::to_value(s.view()).unwrap();
    assert_eq!(view["compute"], "exact");
    assert_eq!(
        (view["cuda_graphs"].clone(), view["int8_threshold"].clone()),
        (json!(false), json!(0.0))
    );
    let e = s.set(Setting::Compute("fastest".into())).unwrap_err();
    assert!(e.to_string().starts_with("compute: expected"), "{e}");
    assert!(s.set(Setting::Int8Threshold(f32::NAN)).is_err());

    s.load_keywords(LoadCall::Load, &kw(json!({})), None, &mut |_| true)
        .unwrap();
    let view = serde_json::to_value(s.view()).unwrap();
    assert_eq!(view["loaded"], true);
    assert!(view["memory"]["cpu"].as_u64().unwrap() > 0);
}

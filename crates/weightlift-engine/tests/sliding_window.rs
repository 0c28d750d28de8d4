//! Sliding-window layers kept as rings: the tiny gemma3 and gemma2 fixtures (a window of 8
//! tokens; see `forward_gemma.rs` for their checks against transformers) with a cache of 1,024
//! positions whose forward chunks hold 32 tokens, so each sliding layer keeps llama.cpp's SWA
//! cells, `pad256(8 + 32)` = 256 rows, and a prompt of 600 tokens with 250 generated after it
//! wraps each ring more than three times. Against the same model over a cache that holds every
//! position: the same logits bit for bit at every position, on the host path and through the
//! backend op sequence (what a cuda device runs), on cpu and over virtual devices with the cache
//! offloaded; the memory the plan counts is what the cache holds; what a ring no longer holds is
//! refused by name (reads, rewinds, prefix reuse, states that start too late) and what it holds
//! comes back (a rewind within the window, a saved state).

use std::path::Path;
use std::sync::Arc;

use crate::common;

use common::batch::assert_a_system_prompt_is_prefilled_once;
use common::family::Family;
use common::{argmax, max_abs_diff, open};
use weightlift_engine::cache::{Cache, CacheConfig, CacheState, Ring};
use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::{CacheDType, EngineError, Inventory, LoadOptions, Model};
use weightlift_plan as wp;

const FAMILIES: [Family; 2] = [Family("gemma3"), Family("gemma2")];
const MAX_SEQ_LEN: u64 = 1024;
const CHUNK: u64 = 32;
const PROMPT: usize = 600;
const STEPS: usize = 250;

/// The runtime of every load here: chunks of [`CHUNK`] tokens.
fn runtime() -> wp::RuntimeSpec {
    wp::RuntimeSpec {
        max_input_len: CHUNK,
        max_attention_size: CHUNK * 256,
        max_dq_size: 1 << 16,
        low_mem: false,
    }
}

/// `path` planned on `devices` with a cache of [`MAX_SEQ_LEN`] positions in `dtype` (offloaded
/// when asked) and chunks of [`CHUNK`] tokens, and loaded by the plan, which makes the cache:
/// the model, its cache and the plan.
fn planned(
    path: &Path,
    devices: &str,
    dtype: CacheDType,
    offload: bool,
) -> (Model, Arc<Cache>, wp::Plan) {
    let mut m = Model::new(open(path), Inventory::parse(devices).unwrap());
    let options = wp::PlanOptions {
        cache: Some(wp::CacheSpec::new(MAX_SEQ_LEN, 1, dtype).with_offload(offload)),
        runtime: Some(runtime()),
        ..Default::default()
    };
    let plan = common::plan_and_load(&mut m, options);
    m.set_compute(Compute::Exact);
    let cache = m.own_cache().unwrap();
    (m, cache, plan)
}

/// A cache like `ring` that keeps every position of every layer, allocated beside the layers.
fn full_beside(m: &mut Model, ring: &Cache) -> Arc<Cache> {
    let full = Arc::new(
        Cache::new(CacheConfig {
            ring: None,
            ..ring.config().clone()
        })
        .unwrap(),
    );
    m.attach_cache(&full).unwrap();
    full
}

/// A prompt of [`PROMPT`] ids: the fixture's prompt over and over.
fn long_prompt(f: Family) -> Vec<u32> {
    f.ids().into_iter().cycle().take(PROMPT).collect()
}

/// The logits of every prompt position, then of each of [`STEPS`] greedy steps (one forward
/// call a token) after it, from a reset `cache`; and the ids generated.
fn run(m: &mut Model, cache: &Arc<Cache>, prompt: &[u32]) -> (Vec<f32>, Vec<u32>) {
    cache.reset();
    let mut all = Vec::new();
    m.forward(prompt, Some(cache), Logits::All, &mut all)
        .unwrap();
    let vocab = all.len() / prompt.len();
    let mut next = argmax(&all[all.len() - vocab..]) as u32;
    let mut ids = Vec::new();
    let mut out = Vec::new();
    for _ in 0..STEPS {
        ids.push(next);
        m.forward(&[next], Some(cache), Logits::Last, &mut out)
            .unwrap();
        all.extend_from_slice(&out);
        next = argmax(&out) as u32;
    }
    (all, ids)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Each sliding layer keeps 256 rows (the window and a chunk, padded as llama.cpp pads), each
/// full layer all 1,024, and a chunk holds at most 32 tokens.
#[test]
fn sliding_layers_keep_llama_cpps_swa_cells() {
    for f in FAMILIES {
        let (m, cache, _) = planned(&f.data(), "cpu", CacheDType::F32, false);
        let c = cache.config();
        let w = m.sliding_window().unwrap().unwrap();
        assert_eq!(w.window, f.stats()["window"].as_u64().unwrap());
        for l in 0..cache.n_layers() {
            let (rows, window) = if w.is_sliding(l) {
                (256, w.window)
            } else {
                (MAX_SEQ_LEN, 0)
            };
            assert_eq!(
                (c.rows(l), c.window(l)),
                (rows, window),
                "{} layer {l}",
                f.0
            );
        }
        assert!(w.any() && w.layers.iter().any(|s| !s), "{}", f.0);
        assert_eq!(c.max_chunk(), 256 + 1 - w.window);
    }
}

/// The rings give the full cache's logits bit for bit at every position of a prompt and a
/// generation that wrap them several times, on the host path and through the backend op
/// sequence, from the safetensors folder and the F16 GGUF.
#[test]
fn rings_give_the_full_caches_bits() {
    for f in FAMILIES {
        let prompt = long_prompt(f);
        for path in [f.data(), f.gguf("F16")] {
            let (mut m, ring, _) = planned(&path, "cpu", CacheDType::F32, false);
            let full = full_beside(&mut m, &ring);
            for backend in [false, true] {
                m.set_host_backend(backend);
                let (want, want_ids) = run(&mut m, &full, &prompt);
                let (got, got_ids) = run(&mut m, &ring, &prompt);
                let what = format!("{} backend {backend}", path.display());
                assert_eq!(got_ids, want_ids, "{what}");
                assert!(
                    same_bits(&got, &want),
                    "{what}: max|Δ| {}",
                    max_abs_diff(&got, &want)
                );
                // the rings wrapped: the sliding layers hold their last 256 positions only
                assert_eq!(ring.held_from(0), (PROMPT + STEPS) as u64 - 256);
                assert_eq!(full.held_from(0), 0);
            }
        }
    }
}

/// In fast mode over an fp16 cache (f16 operands against the cache), over two virtual devices
/// with the cache offloaded (each layer fetched to its device's slots), the rings give the bits
/// of the full cache on cpu; and each device holds what the plan counts, the rings' cells.
#[test]
fn offloaded_rings_over_virtual_devices_hold_the_plan_and_give_the_same_bits() {
    let f = Family("gemma3");
    let prompt = long_prompt(f);
    let (mut cpu, ring_cpu, _) = planned(&f.data(), "cpu", CacheDType::Fp16, false);
    cpu.set_compute(Compute::Fast);
    let full = full_beside(&mut cpu, &ring_cpu);
    let (want, _) = run(&mut cpu, &full, &prompt);
    let (mut m, ring, plan) = planned(&f.data(), "virtual:2x4MiB,cpu", CacheDType::Fp16, true);
    m.set_compute(Compute::Fast);
    assert!(ring.is_offloaded());
    assert_holds_the_plan(&m, &plan);
    let (got, _) = run(&mut m, &ring, &prompt);
    assert!(
        same_bits(&got, &want),
        "max|Δ| {}",
        max_abs_diff(&got, &want)
    );
}

/// Every device holds what the plan says, and the cache's kv is the plan's kv column: the rings'
/// cells on the sliding layers, every position on the full ones.
fn assert_holds_the_plan(m: &Model, plan: &wp::Plan) {
    common::assert_holds_the_plan_exactly(m, plan, "plan vs held");
    let cache = m.own_cache().unwrap();
    let kv: u64 = plan.devices().iter().map(|d| d.kv).sum();
    let held: u64 = cache.memory().iter().map(|(_, b)| b).sum();
    assert_eq!(held, kv, "the cache against the plan's kv column");
}

/// The plan's kv column is what the cache holds, on cpu and over three virtual devices, and it
/// is the rings' size: 256 cells on each sliding layer instead of 1,024.
#[test]
fn the_plans_kv_is_what_the_rings_hold() {
    for f in FAMILIES {
        for (devices, dtype) in [
            ("cpu", CacheDType::F32),
            ("virtual:3x4MiB,cpu", CacheDType::Fp16),
        ] {
            let (m, cache, plan) = planned(&f.data(), devices, dtype, false);
            assert_holds_the_plan(&m, &plan);
            let c = cache.config();
            let w = m.sliding_window().unwrap().unwrap();
            let sliding = w.layers.iter().filter(|&&s| s).count() as u64;
            let cells = sliding * 256 + (w.layers.len() as u64 - sliding) * MAX_SEQ_LEN;
            let row = u64::from(c.n_kv_heads[0]) * u64::from(c.head_dim);
            let (k, v) = dtype.kv_bytes(cells * row);
            let kv: u64 = plan.devices().iter().map(|d| d.kv).sum();
            assert_eq!(kv, k + v, "{} {devices}", f.0);
        }
    }
}

/// What a ring no longer holds is refused by name; what it holds comes back: a read of the
/// window, a rewind that keeps the window (whose continuation is the full cache's), a prefix
/// reuse within it; a saved state round-trips through its bytes and continues as the cache it
/// came from, and a cache that attends to every position refuses it.
#[test]
fn what_a_ring_no_longer_holds_is_refused_and_what_it_holds_comes_back() {
    let f = Family("gemma3");
    let prompt = long_prompt(f);
    let (mut m, ring, _) = planned(&f.data(), "cpu", CacheDType::F32, false);
    let full = full_beside(&mut m, &ring);
    let (_, ids) = run(&mut m, &ring, &prompt);
    run(&mut m, &full, &prompt);
    let held = (PROMPT + STEPS) as u64;
    assert_eq!((ring.seq_len(), ring.held_from(0)), (held, held - 256));
    // reads: the ring's last 256 positions are the full cache's, and before them refused
    let (a, b) = (
        ring.read(0, held - 256, held).unwrap(),
        full.read(0, held - 256, held).unwrap(),
    );
    assert!(same_bits(&a.0, &b.0) && same_bits(&a.1, &b.1));
    let e = ring.read(0, 10, 20).unwrap_err();
    assert!(matches!(
        e,
        EngineError::OutsideWindow {
            layer: 0,
            window: 8,
            rows: 256,
            ..
        }
    ));
    let e = e.to_string();
    assert!(
        e.contains(
            "reading cache positions 10..20: layer 0 attends to a sliding window of 8 \
                    tokens and its cache keeps 256 positions, those from 594 on, but position \
                    10 is needed; read from position 594 on"
        ),
        "{e}"
    );
    // the full layer 5 holds everything
    assert!(ring.read(5, 0, 10).is_ok());
    // rewinds: past the window refused, naming the shortest length allowed
    let e = ring.truncate(100).unwrap_err().to_string();
    assert!(
        e.contains("cache truncate to 100 tokens: layer 0 attends to a sliding window of 8")
            && e.contains("keep at least 601 tokens, or reset the cache"),
        "{e}"
    );
    assert_eq!(ring.seq_len(), held, "a refused truncate changes nothing");
    // a rewind that keeps the window: the continuation is the full cache's, bit for bit
    let keep = 700;
    let mut seq: Vec<u32> = prompt.clone();
    seq.extend(&ids);
    for c in [&ring, &full] {
        c.truncate(keep).unwrap();
    }
    let tail = &seq[keep as usize..keep as usize + 40];
    let (mut a, mut b) = (Vec::new(), Vec::new());
    m.forward(tail, Some(&ring), Logits::All, &mut a).unwrap();
    m.forward(tail, Some(&full), Logits::All, &mut b).unwrap();
    assert!(
        same_bits(&a, &b),
        "after a rewind: max|Δ| {}",
        max_abs_diff(&a, &b)
    );
    // prefix reuse: only where the rewind is allowed (the ids were noted by the forward calls)
    let n = ring.seq_len();
    assert_eq!(ring.common_prefix(&seq[..n as usize]), n);
    assert_eq!(ring.common_prefix(&seq[..650]), 650);
    assert_eq!(full.common_prefix(&seq[..300]), 300);
    assert_eq!(
        ring.common_prefix(&seq[..300]),
        0,
        "the window of 300 is gone"
    );
    // a saved state: the rows from where each ring starts, through its bytes and back
    let state = ring.save_state().unwrap();
    assert_eq!(state.starts[0], ring.held_from(0));
    assert_eq!(state.starts[5], 0);
    let back = CacheState::from_bytes(&state.to_bytes()).unwrap();
    assert_eq!(back, state);
    let other = Arc::new(Cache::new(ring.config().clone()).unwrap());
    m.attach_cache(&other).unwrap();
    other.load_state(&back).unwrap();
    assert_eq!(other.seq_len(), ring.seq_len());
    let next = &seq[n as usize..n as usize + 8];
    let (mut a, mut b) = (Vec::new(), Vec::new());
    m.forward(next, Some(&ring), Logits::All, &mut a).unwrap();
    m.forward(next, Some(&other), Logits::All, &mut b).unwrap();
    assert!(
        same_bits(&a, &b),
        "after load_state: max|Δ| {}",
        max_abs_diff(&a, &b)
    );
    // a larger ring (chunks of 300: 512 rows) takes the state too, and holds its layers from
    // where the state starts: a rewind before that is refused
    let wider = Arc::new(
        Cache::new(CacheConfig {
            ring: ring
                .config()
                .ring
                .clone()
                .map(|r| Ring { ubatch: 300, ..r }),
            ..ring.config().clone()
        })
        .unwrap(),
    );
    assert_eq!(wider.config().rows(0), 512);
    m.attach_cache(&wider).unwrap();
    wider.load_state(&back).unwrap();
    assert_eq!(wider.held_from(0), back.starts[0]);
    let e = wider.truncate(back.starts[0] + 5).unwrap_err().to_string();
    assert!(e.contains("cache truncate to"), "{e}");
    wider.truncate(back.starts[0] + 7).unwrap();
    // a cache of every position needs every position of a sliding layer's state from 0
    let e = full.load_state(&back).unwrap_err().to_string();
    assert!(
        e.contains("loading a state of")
            && e.contains("layer 0")
            && e.contains("same model and runtime"),
        "{e}"
    );
    // and a full cache's state loads into a ring (its last rows)
    let whole = full.save_state().unwrap();
    other.load_state(&whole).unwrap();
    let (mut c, mut d) = (Vec::new(), Vec::new());
    m.forward(&next[..1], Some(&other), Logits::Last, &mut c)
        .unwrap();
    m.forward(&next[..1], Some(&full), Logits::Last, &mut d)
        .unwrap();
    assert!(same_bits(&c, &d), "a full cache's state in a ring");
}

/// A forward call longer than a chunk runs in chunks the rings hold room for, whatever the
/// runtime the model was loaded with: a cache made for chunks of 32 on a model whose graph
/// takes 1,024 gives the bits of the same prompt over a cache of every position in chunks of
/// 249 (the most the rings hold past their window).
#[test]
fn a_forward_call_runs_in_chunks_the_rings_hold() {
    let f = Family("gemma2");
    let prompt = long_prompt(f);
    let src = open(f.data());
    let mut m = Model::new(Arc::clone(&src), Inventory::parse("cpu").unwrap());
    m.set_runtime(runtime());
    let config = m
        .cache_config(MAX_SEQ_LEN, 1, CacheDType::F32, false)
        .unwrap();
    assert_eq!(config.max_chunk(), 249);
    let ring = Arc::new(Cache::new(config).unwrap());
    let placement = weightlift_engine::Placement::all_on(src.as_ref(), "cpu", m.n_layers());
    m.load(
        &placement,
        &LoadOptions::default(),
        Some(&ring),
        true,
        &mut |_| true,
    )
    .unwrap();
    m.set_compute(Compute::Exact);
    let mut got = Vec::new();
    m.forward(&prompt, Some(&ring), Logits::All, &mut got)
        .unwrap();
    assert_eq!(ring.seq_len(), PROMPT as u64);
    // the same chunks over every position
    let full = full_beside(&mut m, &ring);
    let mut want = Vec::new();
    for part in prompt.chunks(249) {
        let mut out = Vec::new();
        m.forward(part, Some(&full), Logits::All, &mut out).unwrap();
        want.extend(out);
    }
    assert!(
        same_bits(&got, &want),
        "max|Δ| {}",
        max_abs_diff(&got, &want)
    );
}

/// `path` loaded tensor-parallel over two virtual devices with a cache of [`MAX_SEQ_LEN`]
/// positions, split by kv heads (the layers `sliding` as rings of 256 rows in every part): the
/// logits of every position of `prompt`, in exact mode on the host path and through the
/// backends, are `want` within 1e-5 of its largest. The cache and its parts.
fn tp_rings_match(
    path: &Path,
    prompt: &[u32],
    want: &[f32],
    sliding: &[usize],
) -> (Arc<Cache>, Vec<weightlift_engine::cache::TpPart>) {
    let mut tp = Model::new(open(path), Inventory::parse("virtual:2x64MiB,cpu").unwrap());
    let options = wp::PlanOptions {
        strategy: Some("tensor_parallel".into()),
        expect_cache: Some(wp::ExpectCache {
            tokens: MAX_SEQ_LEN,
            dtype: CacheDType::F32,
        }),
        runtime: Some(runtime()),
        ..Default::default()
    };
    common::plan_and_load(&mut tp, options);
    tp.set_compute(Compute::Exact);
    let cache = tp.own_cache().unwrap();
    let parts = cache.tp_parts();
    assert!(!parts.is_empty());
    for &l in sliding {
        assert!(parts.iter().all(|p| p.cache.config().rows(l) == 256));
    }
    let top = want.iter().fold(0f32, |a, x| a.max(x.abs()));
    for backend in [false, true] {
        tp.set_host_backend(backend);
        cache.reset();
        let mut got = Vec::new();
        tp.forward(prompt, Some(&cache), Logits::All, &mut got)
            .unwrap();
        let d = max_abs_diff(&got, want);
        eprintln!(
            "{}: tensor parallel (backend {backend}): max|Δ| {d:e} of {top}",
            path.display()
        );
        assert!(
            d <= 1e-5 * top,
            "tensor parallel (backend {backend}) against the layer split: max|Δ| {d} of {top}"
        );
    }
    (cache, parts)
}

/// Gemma's sliding layers under tensor parallelism over two virtual devices (the MLP widened so
/// the tables can split it; see `Family::widened`): each device's rings of its kv heads, with
/// each layer's RoPE base, give the layer split's logits at every position of the long prompt
/// (within 1e-5 of the largest), on the host path and through the backends.
#[test]
fn gemma_rings_run_under_tensor_parallelism() {
    for f in FAMILIES {
        let (mut m, ring, _) = planned(&f.data(), "cpu", CacheDType::F32, false);
        let prompt = long_prompt(f);
        let want = cache_reset_and_run(&mut m, &ring, &prompt);
        let (_dirs, wide) = f.widened();
        let sliding: Vec<usize> = (0..m.n_layers() as usize)
            .filter(|&l| ring.config().is_ring(l))
            .collect();
        assert!(!sliding.is_empty());
        let (cache, _) = tp_rings_match(&wide[0], &prompt, &want, &sliding);
        assert_eq!(cache.held_from(sliding[0]), PROMPT as u64 - 256);
    }
}

/// Every position's logits of `prompt` from a reset `cache`.
fn cache_reset_and_run(m: &mut Model, cache: &Arc<Cache>, prompt: &[u32]) -> Vec<f32> {
    cache.reset();
    let mut all = Vec::new();
    m.forward(prompt, Some(cache), Logits::All, &mut all)
        .unwrap();
    all
}

/// A qwen2 whose config turns its window on (`use_sliding_window`, a window of 8 on layer 1 of
/// 2): the engine runs that window (past it, the logits leave those of the same weights
/// without one) and keeps the layer as a ring of 256 rows, whose bits are a full cache's on the
/// host path and through the backend op sequence; tensor-parallel over two virtual devices (on
/// the host path and through the backends), each device's ring of its kv heads gives the layer
/// split's prompt logits (within 1e-5 of the largest).
#[test]
fn a_qwen2_window_runs_as_a_ring_on_a_layer_split_and_under_tensor_parallelism() {
    let qwen2 = Family("qwen2");
    let data = qwen2.data();
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("config.json")).unwrap()).unwrap();
    config["use_sliding_window"] = true.into();
    config["sliding_window"] = 8.into();
    config["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"]);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        data.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let prompt: Vec<u32> = qwen2.ids().into_iter().cycle().take(PROMPT).collect();
    let (mut m, ring, _) = planned(dir.path(), "cpu", CacheDType::F32, false);
    let c = ring.config();
    assert_eq!((c.rows(0), c.rows(1), c.window(1)), (MAX_SEQ_LEN, 256, 8));
    let full = full_beside(&mut m, &ring);
    let mut windowed = Vec::new();
    for backend in [false, true] {
        m.set_host_backend(backend);
        let (want, _) = run(&mut m, &full, &prompt);
        let (got, _) = run(&mut m, &ring, &prompt);
        assert!(
            same_bits(&got, &want),
            "backend {backend}: max|Δ| {}",
            max_abs_diff(&got, &want)
        );
        windowed = got;
    }
    // the window is run: without it the same weights give other logits past it
    let (mut plain, plain_cache, _) = planned(&data, "cpu", CacheDType::F32, false);
    assert!(!plain_cache.config().is_ring(1));
    plain.set_host_backend(true);
    let (unwindowed, _) = run(&mut plain, &plain_cache, &prompt);
    let vocab = windowed.len() / (PROMPT + STEPS);
    let past = 16 * vocab..PROMPT * vocab;
    assert!(max_abs_diff(&windowed[past.clone()], &unwindowed[past]) > 1e-2);
    // tensor parallelism over two virtual devices: its cache split by kv heads, ring and all
    let (cache, parts) = tp_rings_match(dir.path(), &prompt, &windowed[..PROMPT * vocab], &[1]);
    assert_eq!(parts[0].cache.held_from(1), PROMPT as u64 - 256);
    // the split cache keeps its sequence: a rewind past the window is refused there too
    assert_eq!(cache.held_from(1), PROMPT as u64 - 256);
    let e = cache.truncate(100).unwrap_err().to_string();
    assert!(
        e.contains("layer 1 attends to a sliding window of 8"),
        "{e}"
    );
}

/// A system prompt shorter than the window and one longer than the rings (300 tokens: the
/// donor's rings have wrapped) is copied from a running slot's rings into a new generation's,
/// which runs only the rest with the bits it gets alone. A copy needs the window its next token
/// reads: from a ring that has run past it, it is refused by name and the donor is left as it
/// was; within it, the copy continues as a cache of every position does.
#[test]
fn a_system_prompt_is_copied_between_slots_from_rings_that_hold_its_window() {
    for f in FAMILIES {
        let (mut m, _, _) = planned(&f.data(), "cpu", CacheDType::F32, false);
        let long = long_prompt(f);
        let (q1, q2) = (&long[1..4], &long[5..8]);
        for n in [5, 300] {
            assert_a_system_prompt_is_prefilled_once(
                &format!("{}, a system prompt of {n}", f.0),
                &mut m,
                &long[..n],
                [q1, q2],
            );
        }
    }
    let f = Family("gemma3");
    let prompt = long_prompt(f);
    let (mut m, ring, _) = planned(&f.data(), "cpu", CacheDType::F32, false);
    let full = full_beside(&mut m, &ring);
    let (_, ids) = run(&mut m, &ring, &prompt);
    run(&mut m, &full, &prompt);
    let held = (PROMPT + STEPS) as u64;
    let other = m.sequence_cache(MAX_SEQ_LEN).unwrap();
    let e = other.copy_prefix_from(&ring, 300).unwrap_err().to_string();
    assert!(
        e.contains("copying a prefix to 300 tokens: layer 0 attends to a sliding window of 8")
            && e.contains("those from 594 on, but position 293 is needed"),
        "{e}"
    );
    assert_eq!((ring.seq_len(), ring.held_from(0)), (held, held - 256));
    other.copy_prefix_from(&ring, 700).unwrap();
    assert_eq!((other.seq_len(), other.held_from(0)), (700, held - 256));
    full.truncate(700).unwrap();
    let mut seq = prompt.clone();
    seq.extend(&ids);
    assert_eq!(other.common_prefix(&seq), 700);
    let tail = &seq[700..740];
    let (mut a, mut b) = (Vec::new(), Vec::new());
    m.forward(tail, Some(&other), Logits::All, &mut a).unwrap();
    m.forward(tail, Some(&full), Logits::All, &mut b).unwrap();
    assert!(
        same_bits(&a, &b),
        "after a copy: max|Δ| {}",
        max_abs_diff(&a, &b)
    );
}

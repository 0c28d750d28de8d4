//! The forward pass through the kernels' `Backend` trait: the op sequence `cuda:N` layers run,
//! checked here on the CPU backend (`Model::set_host_backend`) against logits transformers
//! computed (the reference data, with the tolerances it states; the tiny Qwen2 of
//! `tests/data`) and against the host path, which it must equal bit for bit. One test runs the
//! tiny llama's layers on `cuda:0` (the reference pack's GGUF, which the GPU bundle lays out,
//! where the demo model is too large to travel); it needs a GPU and is `#[ignore]`d (`cargo test
//! --features cuda -- --ignored` on a machine with one).

mod common;

use std::sync::Arc;

use std::path::PathBuf;

use common::{
    argmax, forward_all, greedy, json_ids, max_abs_diff, open, read_npy, reference, rows_at,
    smollm2, smollm2_hf_logits, smollm2_prompt, split_load,
};
use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::{Cache, CacheDType, Model};

/// SmolLM2 exact, f32 cache, through the backend: within 1e-3 of transformers with the same
/// argmax at every position, and transformers' greedy ids; and the host path's bits.
#[test]
fn smollm2_exact_through_the_backend_matches_transformers() {
    let src = smollm2();
    let (mut m, cache) = common::load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
    m.set_compute(Compute::Exact);
    let host = forward_all(&mut m, &cache, &smollm2_prompt(2));
    m.set_host_backend(true);
    assert!(m.host_backend());
    for k in [1, 2] {
        let out = forward_all(&mut m, &cache, &smollm2_prompt(k));
        let (positions, vocab, want) = smollm2_hf_logits(k);
        let out = rows_at(&out, vocab, &positions);
        let d = max_abs_diff(&out, &want);
        assert!(d <= 1e-3, "prompt {k}: max|Δ| {d}");
        for (&i, (a, b)) in positions
            .iter()
            .zip(out.chunks(vocab).zip(want.chunks(vocab)))
        {
            assert_eq!(argmax(a), argmax(b), "prompt {k}: position {i}");
        }
        if k == 2 {
            let host = rows_at(&host, vocab, &positions);
            assert!(
                out == host,
                "backend and host paths differ (max|Δ| {})",
                max_abs_diff(&out, &host)
            );
        }
    }
    let g = reference().join("smollm2-135m/greedy.json");
    let ids = greedy(&mut m, &cache, &json_ids(&g, "prompt_ids"), 32);
    assert_eq!(ids, json_ids(&g, "transformers.ids"));
}

/// The fast path (Q8 activations, fp16 cache, f16 attention operands) through the backend is
/// the host fast path bit for bit: prompt logits at every position and 24 greedy tokens, whose
/// logits are compared at each step too.
#[test]
fn smollm2_fast_through_the_backend_is_the_host_path() {
    let src = smollm2();
    let prompt = smollm2_prompt(1);
    let (mut m, cache) = common::load_on(&src, "cpu", "cpu", 64, CacheDType::Fp16);
    m.set_compute(Compute::Fast);
    let run = |m: &mut Model| -> (Vec<f32>, Vec<Vec<f32>>) {
        let all = forward_all(m, &cache, &prompt);
        let mut steps = Vec::new();
        let mut out = Vec::new();
        cache.reset();
        m.forward(&prompt, Some(&cache), Logits::Last, &mut out)
            .unwrap();
        for _ in 0..24 {
            steps.push(out.clone());
            let next = argmax(&out) as u32;
            m.forward(&[next], Some(&cache), Logits::Last, &mut out)
                .unwrap();
        }
        (all, steps)
    };
    let (host_all, host_steps) = run(&mut m);
    m.set_host_backend(true);
    let (all, steps) = run(&mut m);
    assert!(
        all == host_all,
        "prompt logits differ (max|Δ| {})",
        max_abs_diff(&all, &host_all)
    );
    for (i, (a, b)) in steps.iter().zip(&host_steps).enumerate() {
        assert!(a == b, "step {i}: max|Δ| {}", max_abs_diff(a, b));
    }
    // and back to the host path
    m.set_host_backend(false);
    assert_eq!(run(&mut m).0, host_all);
}

/// Across two virtual devices the backend path copies the hidden state at each boundary (cpu
/// embedding → virtual:0 → virtual:1 → cpu head: 3 copies per call), holds no more device
/// memory than the host path, and gives its logits.
#[test]
fn backend_path_across_devices_copies_and_matches() {
    let src = smollm2();
    let prompt = smollm2_prompt(2);
    let devs = ["virtual:0", "virtual:1"];
    let run = |backend: bool| {
        let (mut m, cache) = split_load(
            &src,
            "virtual:2x256MiB,cpu",
            &devs,
            CacheDType::Fp16,
            0,
            false,
        );
        m.set_host_backend(backend);
        let all = forward_all(&mut m, &cache, &prompt);
        let mut next = Vec::new();
        let copies = m
            .forward(&[42], Some(&cache), Logits::Last, &mut next)
            .unwrap();
        let used = m.device_usage();
        (all, next, copies, used)
    };
    let (host_all, host_next, host_copies, host_used) = run(false);
    let (all, next, copies, used) = run(true);
    assert!(
        all == host_all,
        "prompt logits differ (max|Δ| {})",
        max_abs_diff(&all, &host_all)
    );
    assert!(next == host_next, "next-token logits differ");
    assert_eq!(copies.count, 3, "copies per forward");
    assert_eq!(
        (copies.count, copies.bytes),
        (host_copies.count, host_copies.bytes)
    );
    assert_eq!(copies.bytes, 3 * 576 * 4, "one row of 576 f32 per copy");
    assert_eq!(
        used, host_used,
        "device memory held after the forward calls"
    );
}

/// The plan reserves the split attention's partial results (the workspace's `parts`) with the
/// CUDA launch's own bounds: a cache of `n` positions gets the room for the most splits a call
/// over `n` keys can take on any GPU, the largest `n_heads × splits × (head_dim + 2)` the launch
/// may write; a device that computes no layers gets none.
#[test]
fn split_attention_scratch_is_planned_with_the_kernels_bounds() {
    use weightlift_kernels::sources;
    use weightlift_plan::{Dims, Hosts, RuntimeSpec, Workspace};
    assert_eq!(
        weightlift_plan::ATTENTION_SPLITS,
        sources::ATTENTION_MAX_SPLITS as u64
    );
    assert_eq!(
        weightlift_plan::ATTENTION_SPLIT_KEYS,
        sources::ATTENTION_MIN_SPLIT_KEYS as u64
    );
    let path =
        std::env::var("WEIGHTLIFT_DEMO_GGUF").expect("WEIGHTLIFT_DEMO_GGUF (make test-rust)");
    let ckpt =
        weightlift_format::Checkpoint::open(&path, weightlift_format::OpenOptions::default())
            .unwrap();
    let spec = ckpt.spec().unwrap();
    let (nh, hd) = (spec.n_heads as usize, spec.head_dim as usize);
    let layers = Hosts {
        layers: true,
        ..Hosts::default()
    };
    for seq in [1, 31, 64, 2048, 4096, 1 << 16] {
        let d = Dims::new(spec, &RuntimeSpec::default(), seq as u64, 1);
        let most = sources::attention_splits(seq, 1, usize::MAX);
        let want = sources::attention_scratch_values(1, nh, hd, most).unwrap();
        assert_eq!(
            Workspace::new(&d, layers).parts.len as usize,
            want,
            "max_seq_len {seq}"
        );
        let head = Hosts {
            head: true,
            ..Hosts::default()
        };
        assert_eq!(Workspace::new(&d, head).parts.len, 0);
    }
}

fn qwen2_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/tiny-qwen2")
}

/// qwen2's q/k/v biases and rotate-half RoPE through the backend (the bias op): within 1e-3
/// of transformers, argmax at every position, and the host path's bits.
#[test]
fn tiny_qwen2_through_the_backend_matches_transformers() {
    let ids = json_ids(&qwen2_data().join("stats.json"), "ids");
    let (shape, want) = read_npy(&qwen2_data().join("hf_logits.npy"));
    for file in ["tiny-qwen2-F16.gguf", ""] {
        let path = qwen2_data().join(file);
        let (mut m, cache) = common::load_on(&open(&path), "cpu", "cpu", 64, CacheDType::F32);
        m.set_compute(Compute::Exact);
        let host = forward_all(&mut m, &cache, &ids);
        m.set_host_backend(true);
        let out = forward_all(&mut m, &cache, &ids);
        let d = max_abs_diff(&out, &want);
        assert!(d <= 1e-3, "{file}: max|Δ| {d}");
        for (i, (a, b)) in out.chunks(shape[1]).zip(want.chunks(shape[1])).enumerate() {
            assert_eq!(argmax(a), argmax(b), "{file}: position {i}");
        }
        assert!(out == host, "{file}: backend and host paths differ");
    }
}

/// What a run leaves to compare: the prompt's logits at every position, the next step's, and
/// every layer's cache rows decoded.
type Outcome = (Vec<f32>, Vec<f32>, Vec<(Vec<f32>, Vec<f32>)>);

fn prompt_step_rows(m: &mut Model, cache: &Arc<Cache>, prompt: &[u32]) -> Outcome {
    let all = forward_all(m, cache, prompt);
    let mut next = Vec::new();
    m.forward(&[42], Some(cache), Logits::Last, &mut next)
        .unwrap();
    let n = cache.seq_len();
    let rows = (0..m.n_layers() as usize)
        .map(|l| cache.read(l, 0, n).unwrap())
        .collect();
    (all, next, rows)
}

fn assert_same(what: &str, backend: &Outcome, host: &Outcome) {
    assert!(
        backend.0 == host.0,
        "{what}: prompt logits differ (max|Δ| {})",
        max_abs_diff(&backend.0, &host.0)
    );
    assert!(backend.1 == host.1, "{what}: next-token logits differ");
    assert!(backend.2 == host.2, "{what}: cache rows differ");
}

/// Every quantised cache (q8, q6, q4, fp8) and the bf16 one through the backend: the cache
/// rows are written by the backend's store operation and read by its attention in their own
/// storage, and give the host path's bits: the prompt's logits at every position, a decode step
/// after it, and the cache's decoded rows, in both compute modes.
#[test]
fn backend_path_reads_and_writes_every_cache_dtype_as_the_host_path() {
    let src = smollm2();
    let prompt = smollm2_prompt(2);
    for dtype in [
        CacheDType::Bf16,
        CacheDType::Q8,
        CacheDType::Q6,
        CacheDType::Q4,
        CacheDType::Fp8,
    ] {
        for compute in [Compute::Fast, Compute::Exact] {
            let (mut m, cache) = common::load_on(&src, "cpu", "cpu", 64, dtype);
            m.set_compute(compute);
            let host = prompt_step_rows(&mut m, &cache, &prompt);
            m.set_host_backend(true);
            let backend = prompt_step_rows(&mut m, &cache, &prompt);
            assert_same(
                &format!("{} cache, {compute:?}", dtype.name()),
                &backend,
                &host,
            );
        }
    }
}

/// An offloaded cache through the backend: each layer's slot on its device is lent to the
/// backend's store and attention, the new rows go back to host RAM, and the logits, the next
/// step's and the cache rows are the host path's bits (layers split over two virtual devices,
/// q4 and fp16 caches).
#[test]
fn backend_path_runs_an_offloaded_cache_as_the_host_path() {
    let src = smollm2();
    let prompt = smollm2_prompt(2);
    let devs = ["virtual:0", "virtual:1"];
    for dtype in [CacheDType::Q4, CacheDType::Fp16] {
        let run = |backend: bool| {
            let (mut m, cache) = split_load(&src, "virtual:2x256MiB,cpu", &devs, dtype, 0, true);
            assert!(cache.is_offloaded());
            m.set_host_backend(backend);
            prompt_step_rows(&mut m, &cache, &prompt)
        };
        let what = format!("offloaded {} cache", dtype.name());
        assert_same(&what, &run(true), &run(false));
    }
}

/// The tiny llama's layers (Q4_K_M, the reference GGUF) on `cuda:0`, embedding and head on
/// cpu, exact compute with an f32 cache and fast compute with an fp16 cache, against the host
/// path on cpu: the prompt's logits and those of 16 decode steps along the host path's greedy
/// ids within 0.05 (exact) or with the same argmax wherever the host margin is above 0.25
/// (fast). Then exact compute over each quantised cache (q8, q6, q4, fp8) and bf16, which the
/// GPU stores and reads in place: the same 0.05 against the host path over the same cache dtype
/// (the cache's bytes are the codec's on both, only the sums' order differs). Its decode steps
/// are fed the host path's ids rather than compared as greedy ids: the tiny model's random
/// weights leave near ties (a margin of 0.01 in transformers' logits of this prompt) that a
/// sum's order may break either way.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn cuda_layers_match_the_host_path() {
    if let Some(reason) = weightlift_kernels::CudaBackend::unavailable_reason() {
        panic!("this test needs cuda:0: {reason}");
    }
    let src = open(reference().join("tiny-llama/gguf/tiny-llama-Q4_K_M.gguf"));
    let prompt = json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    for (compute, dtype) in [
        (Compute::Exact, CacheDType::F32),
        (Compute::Fast, CacheDType::Fp16),
        (Compute::Exact, CacheDType::Q8),
        (Compute::Exact, CacheDType::Q6),
        (Compute::Exact, CacheDType::Q4),
        (Compute::Exact, CacheDType::Fp8),
        (Compute::Exact, CacheDType::Bf16),
    ] {
        let (mut cpu, cc) = common::load_on(&src, "cpu", "cpu", 64, dtype);
        cpu.set_compute(compute);
        let want_ids = greedy(&mut cpu, &cc, &prompt, 16);
        let want = prompt_then_steps(&mut cpu, &cc, &prompt, &want_ids);
        let (mut gpu, gc) = split_load(&src, "cuda:0,cpu", &["cuda:0"], dtype, 0, false);
        gpu.set_compute(compute);
        let got = prompt_then_steps(&mut gpu, &gc, &prompt, &want_ids);
        let vocab = got.len() / (prompt.len() + want_ids.len());
        match compute {
            Compute::Exact => {
                let d = max_abs_diff(&got, &want);
                assert!(
                    d <= 0.05,
                    "{compute:?}, {} cache: max|Δ| {d} against the host path",
                    dtype.name()
                );
            }
            Compute::Fast => {
                for (i, (a, b)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
                    if common::margin(b) > 0.25 {
                        assert_eq!(argmax(a), argmax(b), "{compute:?}: position {i}");
                    }
                }
            }
        }
        let mut out = Vec::new();
        let copies = gpu
            .forward(&[42], Some(&gc), Logits::Last, &mut out)
            .unwrap();
        assert_eq!(copies.count, 2, "cpu embedding → cuda:0 → cpu head");
    }
}

/// The logits of every position of `prompt` from an empty cache, then of one decode step per
/// id of `steps` fed in turn.
fn prompt_then_steps(m: &mut Model, cache: &Arc<Cache>, prompt: &[u32], steps: &[u32]) -> Vec<f32> {
    let mut all = forward_all(m, cache, prompt);
    let mut out = Vec::new();
    for &id in steps {
        m.forward(&[id], Some(cache), Logits::Last, &mut out)
            .unwrap();
        all.extend_from_slice(&out);
    }
    all
}

/// Decode steps whose attention reads its position from the positions buffer split the keys of
/// a span that grows at powers of two (256, then 512): twelve steps from position 250 of a
/// 512-row cache cross from the first span to the second and keep the host path's bits (the CPU
/// backend refuses a position past the span it is given, so a span left behind fails here).
#[test]
fn decode_steps_across_an_attention_span_are_the_host_path() {
    let src = open(reference().join("tiny-llama/safetensors"));
    let ids = json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    let prompt: Vec<u32> = ids.iter().copied().cycle().take(250).collect();
    let (mut m, cache) = common::load_on(&src, "cpu", "cpu", 512, CacheDType::Fp16);
    m.set_compute(Compute::Fast);
    let mut run = |host_backend: bool| {
        m.set_host_backend(host_backend);
        cache.reset();
        let mut out = Vec::new();
        m.forward(&prompt, Some(&cache), Logits::Last, &mut out)
            .unwrap();
        let mut steps = Vec::new();
        for _ in 0..12 {
            let next = argmax(&out) as u32;
            m.forward(&[next], Some(&cache), Logits::Last, &mut out)
                .unwrap();
            steps.push(out.clone());
        }
        assert_eq!(cache.seq_len(), 262);
        steps
    };
    let host = run(false);
    let backend = run(true);
    for (i, (a, b)) in backend.iter().zip(&host).enumerate() {
        assert!(
            a == b,
            "step {i} (position {}): max|Δ| {}",
            250 + i,
            max_abs_diff(a, b)
        );
    }
}

//! Hidden states after the output norm (`Model::forward_hidden`) and the embeddings pooled from
//! them (`Model::embed`):
//! - multiplied by the head's matrix, dequantised by the checkpoint reader and summed in f64
//!   here, the rows give transformers' logits (the reference data, with the tolerance the
//!   logits tests use) and the engine's own logits to f32 summation error;
//! - the backend op sequence (`set_host_backend`) and every placement give the host path's bits;
//! - tensor parallelism gives the single-device rows within its reduction-order bound, its
//!   backend pass and its ranks the host pass's bits;
//! - `embed` pools the rows as llama.cpp does, leaves the model's own cache as it was, frees
//!   its scratch cache, runs long inputs in prompt chunks, and refuses bad input by name.

use crate::common;

use std::sync::Arc;

use common::{json_ids, kept_rows, load_on, max_abs_diff, open, reference, rows_at, split_load};
use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::tp::{HostStaged, ThreadGroup};
use weightlift_engine::{Cache, CacheDType, Inventory, Model, Pooling, Source};
use weightlift_format::Role;
use weightlift_plan as wp;

fn llama_gguf() -> Arc<dyn Source> {
    open(reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf"))
}

fn llama_ids() -> Vec<u32> {
    json_ids(&reference().join("tiny-llama/ids.json"), "ids")
}

/// Every position's hidden state of `ids` from an empty `cache`.
fn hidden_all(m: &mut Model, cache: &Arc<Cache>, ids: &[u32]) -> Vec<f32> {
    cache.reset();
    let mut out = Vec::new();
    m.forward_hidden(ids, Some(cache), &mut out).unwrap();
    out
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The head's matrix of `src` (`output.weight`, else the tied token embedding) dequantised by
/// the checkpoint reader: `(columns, rows × columns values)`.
fn head_matrix(src: &Arc<dyn Source>) -> (usize, Vec<f32>) {
    let ckpt = src.checkpoint().unwrap();
    let find = |role: Role| ckpt.tensors().iter().find(|t| t.role == Some(role));
    let info = find(Role::Output)
        .or_else(|| find(Role::TokenEmbd))
        .unwrap();
    let w = weightlift_engine::dequantize::checkpoint_tensor(ckpt, info).unwrap();
    (info.shape[1] as usize, w)
}

/// `hidden` rows times the head's rows, summed in f64: logits, row by row.
fn head_product((cols, w): &(usize, Vec<f32>), hidden: &[f32]) -> Vec<f32> {
    hidden
        .chunks_exact(*cols)
        .flat_map(|x| {
            w.chunks_exact(*cols).map(move |row| {
                row.iter()
                    .zip(x)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum::<f64>() as f32
            })
        })
        .collect()
}

fn scale(v: &[f32]) -> f32 {
    v.iter().fold(1f32, |m, x| m.max(x.abs()))
}

/// Exact mode, f32 cache: the hidden rows times the dequantised head are transformers' logits
/// (on the same dequantised weights: within 1e-3, the same argmax at every position the
/// reference keeps), and the engine's own logits within 1e-4 of their scale (f32 against f64
/// summation).
#[test]
fn hidden_states_times_the_head_are_the_logits() {
    let tiny = (
        llama_gguf(),
        llama_ids(),
        kept_rows("tiny-llama/hf_dequant_logits_Q8_0"),
    );
    let smollm2 = (
        common::smollm2(),
        common::smollm2_prompt(1),
        common::smollm2_hf_logits(1),
    );
    for (src, ids, (positions, vocab, want)) in [tiny, smollm2] {
        let what = src.path().display().to_string();
        let (mut m, cache) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
        m.set_compute(Compute::Exact);
        let hidden = hidden_all(&mut m, &cache, &ids);
        let head = head_matrix(&src);
        assert_eq!(hidden.len(), ids.len() * head.0, "{what}: rows × hidden");
        assert_eq!(cache.seq_len(), ids.len() as u64, "{what}");
        let product = head_product(&head, &hidden);

        let kept = rows_at(&product, vocab, &positions);
        let d = max_abs_diff(&kept, &want);
        assert!(d <= 1e-3, "{what}: against transformers, max|Δ| {d}");
        for ((a, b), p) in kept.chunks(vocab).zip(want.chunks(vocab)).zip(&positions) {
            assert_eq!(common::argmax(a), common::argmax(b), "{what}: position {p}");
        }

        let logits = common::forward_all(&mut m, &cache, &ids);
        let d = max_abs_diff(&product, &logits);
        let bound = 1e-4 * scale(&logits);
        eprintln!("{what}: head product against the engine's logits: max|Δ| {d:.2e}");
        assert!(
            d <= bound,
            "{what}: against the engine's logits, max|Δ| {d} > {bound}"
        );
        // the last row alone, from a call for the last position's logits
        let mut last = Vec::new();
        cache.reset();
        m.forward(&ids, Some(&cache), Logits::Last, &mut last)
            .unwrap();
        let tail = &product[product.len() - last.len()..];
        assert!(max_abs_diff(tail, &last) <= bound, "{what}: last row");
    }
}

/// The backend op sequence and every placement (virtual devices, layers on disk) give the cpu
/// host path's hidden rows bit for bit, in both compute modes, tiny llama and tiny qwen2
/// (biases, rotate-half RoPE); across devices the rows cross as many boundaries as the logits
/// of every position do.
#[test]
fn the_backend_path_and_placement_give_the_host_rows() {
    let qwen2 = open(common::qwen2_data().join("tiny-qwen2-F16.gguf"));
    let qwen2_ids = json_ids(&common::qwen2_data().join("stats.json"), "ids");
    for (src, ids) in [(llama_gguf(), llama_ids()), (qwen2, qwen2_ids)] {
        let what = src.path().display().to_string();
        for compute in [Compute::Exact, Compute::Fast] {
            let (mut cpu, cpu_cache) =
                split_load(&src, "cpu", &["cpu"], CacheDType::Fp16, 0, false);
            cpu.set_compute(compute);
            let want = hidden_all(&mut cpu, &cpu_cache, &ids);
            assert!(want.iter().all(|v| v.is_finite()), "{what}");
            for (place, inv, devs, disk) in [
                ("cpu", "cpu", &["cpu"][..], 0),
                (
                    "2 virtual devices",
                    "virtual:2x64MiB,cpu",
                    &["virtual:0", "virtual:1"][..],
                    0,
                ),
                (
                    "a layer on disk",
                    "virtual:64MiB,cpu",
                    &["virtual:0"][..],
                    1,
                ),
            ] {
                let (mut m, cache) = split_load(&src, inv, devs, CacheDType::Fp16, disk, false);
                m.set_compute(compute);
                for backend in [false, true] {
                    m.set_host_backend(backend);
                    let case = format!("{what}, {place}, {}, backend {backend}", compute.name());
                    cache.reset();
                    let mut got = Vec::new();
                    let hidden_copies = m.forward_hidden(&ids, Some(&cache), &mut got).unwrap();
                    assert!(
                        same_bits(&got, &want),
                        "{case}: max|Δ| {}",
                        max_abs_diff(&got, &want)
                    );
                    cache.reset();
                    let mut logits = Vec::new();
                    let logit_copies = m
                        .forward(&ids, Some(&cache), Logits::All, &mut logits)
                        .unwrap();
                    assert_eq!(
                        (hidden_copies.count, hidden_copies.bytes),
                        (logit_copies.count, logit_copies.bytes),
                        "{case}: copies"
                    );
                }
            }
        }
    }
}

/// `embed` pools `forward_hidden`'s rows as llama.cpp does and normalises to unit length; the
/// model's own cache keeps its rows, its length and its token history (the next decode step
/// gives the logits it gives without the embedding between), and the scratch cache is freed.
#[test]
fn embed_pools_the_rows_and_leaves_the_cache_alone() {
    let src = llama_gguf();
    let ids = llama_ids();
    let (mut m, cache) = load_on(&src, "virtual:64MiB,cpu", "virtual:0", 64, CacheDType::Q8);
    let n = ids.len();
    let prompt = &ids[..5];

    // the decode step after the prompt, with nothing between
    let mut out = Vec::new();
    let mut want_next = Vec::new();
    cache.reset();
    m.forward(prompt, Some(&cache), Logits::Last, &mut out)
        .unwrap();
    m.forward(&[42], Some(&cache), Logits::Last, &mut want_next)
        .unwrap();

    // the prompt again, then embeddings between it and the decode step
    cache.reset();
    m.forward(prompt, Some(&cache), Logits::Last, &mut out)
        .unwrap();
    let rows_before: Vec<_> = (0..2).map(|l| cache.read(l, 0, 5).unwrap()).collect();
    let usage = m.device_usage();
    let mut pooled = Vec::new();
    for pooling in [Pooling::None, Pooling::Mean, Pooling::Cls, Pooling::Last] {
        for normalize in [false, true] {
            pooled.push((
                (pooling, normalize),
                m.embed(&ids, pooling, normalize).unwrap(),
            ));
        }
    }
    assert_eq!(cache.seq_len(), 5, "the own cache's length");
    assert_eq!(
        cache.common_prefix(&ids),
        5,
        "the own cache's token history"
    );
    for (l, before) in rows_before.iter().enumerate() {
        let after = cache.read(l, 0, 5).unwrap();
        assert!(
            same_bits(&after.0, &before.0) && same_bits(&after.1, &before.1),
            "layer {l}: cache rows changed"
        );
    }
    assert_eq!(m.device_usage(), usage, "the scratch cache is freed");
    let mut next = Vec::new();
    m.forward(&[42], Some(&cache), Logits::Last, &mut next)
        .unwrap();
    assert!(same_bits(&next, &want_next), "the decode step after embed");

    // the rows themselves, on the own cache (its type: the scratch cache's)
    let rows = hidden_all(&mut m, &cache, &ids);
    let h = rows.len() / n;
    let row = |i: usize| rows[i * h..(i + 1) * h].to_vec();
    for ((pooling, normalize), got) in pooled {
        let case = format!("{} pooling, normalize {normalize}", pooling.name());
        let want: Vec<Vec<f32>> = match pooling {
            Pooling::None => (0..n).map(row).collect(),
            Pooling::Cls => vec![row(0)],
            Pooling::Last => vec![row(n - 1)],
            Pooling::Mean => vec![
                (0..h)
                    .map(|c| (0..n).map(|i| f64::from(rows[i * h + c])).sum::<f64>() / n as f64)
                    .map(|v| v as f32)
                    .collect(),
            ],
        };
        assert_eq!(got.len(), want.len(), "{case}: vectors");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.len(), h, "{case}");
            if !normalize {
                assert!(same_bits(g, w), "{case}: max|Δ| {}", max_abs_diff(g, w));
                continue;
            }
            let norm = w.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
            let unit: Vec<f32> = w.iter().map(|&x| (f64::from(x) / norm) as f32).collect();
            assert!(max_abs_diff(g, &unit) <= 1e-7, "{case}");
            let len = g.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
            assert!((len - 1.0).abs() <= 1e-6, "{case}: length {len}");
        }
    }
}

/// A prompt longer than the runtime's input length runs in prompt chunks (8 tokens here): the
/// rows are those of one 16-token chunk to f32 summation error, and their head product is the
/// chunked run's own logits.
#[test]
fn long_inputs_run_in_prompt_chunks() {
    let src = llama_gguf();
    let ids = llama_ids();
    assert!(ids.len() > 8);
    let (mut whole, _) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
    let (mut chunked, cache, _, _) = common::planned_layers(&src, "virtual:64MiB,cpu", 2, None);
    for m in [&mut whole, &mut chunked] {
        m.set_compute(Compute::Exact);
    }
    let want = whole.embed(&ids, Pooling::None, false).unwrap().concat();
    let got = chunked.embed(&ids, Pooling::None, false).unwrap().concat();
    let d = max_abs_diff(&got, &want);
    eprintln!("8-token chunks against one chunk: max|Δ| {d:.2e}");
    assert!(d <= 1e-4 * scale(&want), "max|Δ| {d}");
    let logits = common::forward_all(&mut chunked, &cache, &ids);
    let product = head_product(&head_matrix(&src), &got);
    let d = max_abs_diff(&product, &logits);
    assert!(d <= 1e-4 * scale(&logits), "head product: max|Δ| {d}");
}

/// Empty input, input longer than the context and ids outside the vocabulary are typed errors
/// that name what was expected and what came, before anything runs; the pooling integers map
/// as llama.cpp's, the unspecified one to the model's default (none: no pooling key).
#[test]
fn bad_input_is_refused_by_name() {
    let src = llama_gguf();
    let (mut m, cache) = load_on(&src, "cpu", "cpu", 64, CacheDType::Fp16);
    let mut out = Vec::new();
    m.forward(&[1, 2, 3], None, Logits::Last, &mut out).unwrap();
    let e = m.embed(&[], Pooling::Mean, true).unwrap_err().to_string();
    assert_eq!(
        e,
        "embedding input: expected at least one token, got an empty input"
    );
    let e = m
        .embed(&[1; 65], Pooling::Mean, true)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("65 tokens do not fit the cache: 0 of its 64 positions are in use"),
        "{e}"
    );
    let e = m
        .embed(&[1, 32000], Pooling::None, false)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "token id at position 1: expected below the vocabulary size 32000, got 32000"
    );
    assert_eq!(m.context_len().unwrap(), 64);
    assert_eq!(m.embed(&[1; 64], Pooling::Last, true).unwrap().len(), 1);
    assert_eq!(cache.seq_len(), 3, "the own cache after the refusals");

    assert_eq!(m.default_pooling().unwrap(), Pooling::None);
    assert_eq!(m.pooling_for(-1).unwrap(), Pooling::None);
    assert_eq!(m.pooling_for(1).unwrap(), Pooling::Mean);
    assert_eq!(m.pooling_for(3).unwrap(), Pooling::Last);
    let e = m.pooling_for(4).unwrap_err().to_string();
    assert!(e.starts_with("rank pooling"), "{e}");
}

const RT: wp::RuntimeSpec = wp::RuntimeSpec {
    max_input_len: 16,
    max_attention_size: 256,
    max_dq_size: 1 << 16,
    low_mem: false,
};

/// Each rank of `plan` loaded on a one-device inventory of its own, all embedding `ids` at once
/// (one thread each, joined by a thread group): each rank's rows.
fn rank_rows(src: &Arc<dyn Source>, plan: &wp::Plan, n: usize, ids: &[u32]) -> Vec<Vec<f32>> {
    let mut ranks: Vec<(Model, Arc<Cache>)> = (0..n)
        .map(|r| {
            let mut m = Model::new(
                Arc::clone(src),
                Inventory::parse("virtual:48MiB,cpu").unwrap(),
            );
            let placement = m.rank_placement(plan, r, Some("virtual:0")).unwrap();
            let cache = common::load_placed(&mut m, plan, &placement).unwrap();
            m.set_compute(Compute::Exact);
            (m, cache)
        })
        .collect();
    let members = ThreadGroup::new(n).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .zip(members)
            .map(|((m, _), member)| {
                let tp = m.tp_context_shared().unwrap();
                tp.lock().unwrap().set_collective(Box::new(member));
                s.spawn(move || {
                    // A rank that fails leaves the group, so the others fail rather than wait.
                    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        m.embed(ids, Pooling::None, false).unwrap().concat()
                    }));
                    let mut ctx = tp.lock().unwrap_or_else(|e| e.into_inner());
                    ctx.set_collective(Box::new(HostStaged));
                    got.unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Tensor parallelism over 2 virtual devices (exact mode, f32 cache): the single-device rows
/// within the tensor-parallel bound of `tp_forward.rs` (1e-4 of their scale); the backend pass,
/// `embed` (on a scratch cache split like the model's) and each rank of a rank-local load give
/// the host pass's rows bit for bit.
#[test]
fn tensor_parallel_hidden_states() {
    let src = llama_gguf();
    let ids = llama_ids();
    let (mut cpu, cpu_cache) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
    cpu.set_compute(Compute::Exact);
    let want = hidden_all(&mut cpu, &cpu_cache, &ids);

    let (mut m, cache, plan) =
        common::load_tp_planned(&src, "virtual:2x48MiB,cpu", RT, CacheDType::F32);
    m.set_compute(Compute::Exact);
    let host = hidden_all(&mut m, &cache, &ids);
    let d = max_abs_diff(&host, &want);
    eprintln!("tensor parallel against cpu: max|Δ| {d:.2e}");
    assert!(d <= 1e-4 * scale(&want), "max|Δ| {d}");
    let held = cache.seq_len();
    let embedded = m.embed(&ids, Pooling::None, false).unwrap().concat();
    assert!(same_bits(&embedded, &host), "embed on the tp model");
    assert_eq!(cache.seq_len(), held, "the own (split) cache's length");

    m.set_host_backend(true);
    for peer in [true, false] {
        let tp = m.tp_context_shared().unwrap();
        tp.lock().unwrap().set_peer_copies(peer);
        let got = hidden_all(&mut m, &cache, &ids);
        assert!(
            same_bits(&got, &host),
            "backend pass (peer copies {peer}): max|Δ| {}",
            max_abs_diff(&got, &host)
        );
    }

    for (r, got) in rank_rows(&src, &plan, 2, &ids).iter().enumerate() {
        assert!(
            same_bits(got, &host),
            "rank {r}: max|Δ| {}",
            max_abs_diff(got, &host)
        );
    }
}

//! The tensor-parallel pass through the kernels' backends (the op sequence `cuda:N` devices
//! run), on virtual devices through the CPU backend, against the host tensor-parallel pass:
//! the same logits and cache rows bit for bit, by either route of the collectives (device to
//! device, and staged through host memory), in both compute modes, over 2 and 3 devices, for
//! a GGUF llama, a qwen2 with q/k/v biases and the demo model. The host pass is itself checked
//! against `cpu` and transformers (`tp_forward.rs`).

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::open;
use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::{Cache, CacheDType, Model, Source};
use weightlift_plan as wp;

const RT: wp::RuntimeSpec = wp::RuntimeSpec {
    max_input_len: 16,
    max_attention_size: 256,
    max_dq_size: 1 << 16,
    low_mem: false,
};

fn load_tp(src: &Arc<dyn Source>, devices: &str, dtype: CacheDType) -> (Model, Arc<Cache>) {
    let (m, cache, _) = load_tp_plan(src, devices, dtype);
    (m, cache)
}

fn load_tp_plan(
    src: &Arc<dyn Source>,
    devices: &str,
    dtype: CacheDType,
) -> (Model, Arc<Cache>, wp::Plan) {
    common::load_tp_planned(src, devices, RT, dtype)
}

/// [`common::tp_run`], the parts' cache rows one after another.
fn run(m: &mut Model, cache: &Arc<Cache>, ids: &[u32]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (logits, parts) = common::tp_run(m, cache, ids);
    (logits, parts.into_iter().flatten().collect())
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn check(path: &PathBuf, devices: &str, ids: &[u32], dtypes: &[CacheDType]) {
    let src = open(path);
    for &dtype in dtypes {
        let (mut m, cache) = load_tp(&src, devices, dtype);
        for compute in [Compute::Exact, Compute::Fast] {
            m.set_compute(compute);
            m.set_host_backend(false);
            let (want, want_rows) = run(&mut m, &cache, ids);
            m.set_host_backend(true);
            for peer in [true, false] {
                let tp = m.tp_context_shared().unwrap();
                tp.lock().unwrap().set_peer_copies(peer);
                let (got, got_rows) = run(&mut m, &cache, ids);
                let what = format!(
                    "{} on {devices}, {} cache, {}, peer copies {peer}",
                    path.display(),
                    dtype.name(),
                    compute.name()
                );
                assert!(want.iter().all(|v| v.is_finite()), "{what}");
                assert!(same_bits(&got, &want), "{what}: logits differ");
                assert_eq!(got_rows.len(), want_rows.len());
                for (i, (g, w)) in got_rows.iter().zip(&want_rows).enumerate() {
                    assert!(same_bits(g, w), "{what}: cache rows {i} differ");
                }
                let copies = m.transfer_stats().count;
                eprintln!("{what}: {copies} copies in the last call");
                assert!(copies > 0, "{what}: no copies counted");
            }
            m.tp_context_shared()
                .unwrap()
                .lock()
                .unwrap()
                .set_peer_copies(true);
        }
    }
}

/// The peer route copies each residual slice straight to each device that needs it and each
/// partial's columns straight to their owner: one copy per pair of distinct devices with a
/// share, and nothing through the host but the embedding and the logits.
#[test]
fn the_peer_route_copies_once_per_pair_of_devices() {
    let path = weightlift_testdata::demo_gguf();
    let (mut m, cache, plan) = load_tp_plan(&open(&path), "virtual:3x256MiB,cpu", CacheDType::Fp16);
    let tp = plan.tp().unwrap();
    m.set_host_backend(true);
    cache.reset();
    m.forward(&[1, 2, 3], Some(&cache), Logits::Last, &mut Vec::new())
        .unwrap();
    let copies = m
        .forward(&[4], Some(&cache), Logits::Last, &mut Vec::new())
        .unwrap();
    let pairs = |from: &[(usize, u64, u64)], to: &[(usize, u64, u64)], widths_of_to: bool| {
        let mut n = 0u64;
        for &(d, da, db) in to {
            for &(s, sa, sb) in from {
                let width = if widths_of_to { db - da } else { sb - sa };
                n += u64::from(s != d && width > 0);
            }
        }
        n
    };
    let (rs, kv, id, vc) = (&tp.rs[..], &tp.kv[..], &tp.id[..], &tp.vc[..]);
    let per_layer =
        pairs(rs, kv, false) + pairs(kv, rs, true) + pairs(rs, id, false) + pairs(id, rs, true);
    let vocab = m.vocab_size().unwrap();
    let heads = vc.iter().filter(|e| e.1 < vocab).count() as u64;
    let want = rs.len() as u64 + u64::from(m.n_layers()) * per_layer + pairs(rs, vc, false) + heads;
    assert_eq!(copies.count, want, "tables {tp:?}");
}

#[test]
fn llama_gguf_backend_pass_equals_the_host_pass() {
    let path = common::reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf");
    let ids = common::json_ids(&common::reference().join("tiny-llama/ids.json"), "ids");
    let dtypes = [
        CacheDType::F32,
        CacheDType::Fp16,
        CacheDType::Q8,
        CacheDType::Q4,
    ];
    check(&path, "virtual:2x48MiB,cpu", &ids, &dtypes);
    check(&path, "virtual:3x48MiB,cpu", &ids, &[CacheDType::Fp16]);
}

#[test]
fn qwen2_backend_pass_equals_the_host_pass() {
    let ids = common::json_ids(&common::qwen2_data().join("stats.json"), "ids");
    let path = common::qwen2();
    check(&path, "virtual:2x48MiB,cpu", &ids, &[CacheDType::F32]);
    check(&path, "virtual:3x48MiB,cpu", &ids, &[CacheDType::Fp16]);
}

#[test]
fn demo_model_backend_pass_equals_the_host_pass() {
    let path = weightlift_testdata::demo_gguf();
    let ids = common::smollm2_prompt(1);
    check(&path, "virtual:2x256MiB,cpu", &ids, &[CacheDType::Fp16]);
    check(&path, "virtual:3x256MiB,cpu", &ids, &[CacheDType::Q8]);
}

/// On two GPUs, the pass on `cuda:0` and `cuda:1` (peer copies where the driver allows, then
/// staged through the host) against the host pass over two virtual devices: logits within the
/// tensor-parallel bound of `tp_forward.rs`, the same greedy ids.
#[test]
#[ignore = "needs two CUDA GPUs: cargo test --features cuda -- --ignored on a machine with them"]
fn two_cuda_devices_give_the_host_pass_logits() {
    match weightlift_kernels::CudaBackend::device_count() {
        Ok(n) if n >= 2 => {}
        other => panic!("this test needs cuda:0 and cuda:1: {other:?}"),
    }
    let path = common::reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf");
    let ids = common::json_ids(&common::reference().join("tiny-llama/ids.json"), "ids");
    let src = open(&path);
    let (mut host, host_cache) = load_tp(&src, "virtual:2x48MiB,cpu", CacheDType::F32);
    let (mut gpu, gpu_cache) = load_tp(&src, "cuda:0,cuda:1,cpu", CacheDType::F32);
    for compute in [Compute::Exact, Compute::Fast] {
        host.set_compute(compute);
        gpu.set_compute(compute);
        let (want, _) = run(&mut host, &host_cache, &ids);
        for peer in [true, false] {
            gpu.tp_context_shared()
                .unwrap()
                .lock()
                .unwrap()
                .set_peer_copies(peer);
            let (got, _) = run(&mut gpu, &gpu_cache, &ids);
            let scale = want.iter().fold(1f32, |a, v| a.max(v.abs()));
            let d = common::max_abs_diff(&got, &want) / scale;
            eprintln!(
                "cuda tp ({}, peer {peer}): max|Δ|/scale {d:e}",
                compute.name()
            );
            assert!(d <= 1e-3, "{}: {d}", compute.name());
            let g1 = common::greedy(&mut host, &host_cache, &ids[..4], 12);
            let g2 = common::greedy(&mut gpu, &gpu_cache, &ids[..4], 12);
            assert_eq!(g1, g2, "greedy ids");
        }
    }
}

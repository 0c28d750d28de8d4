//! `cuda:N` through the kernels' CUDA backend. One test checks the clean `CudaUnavailable` error
//! where there is no GPU; the rest need one and are `#[ignore]`d (reported as ignored, never
//! passed): on a machine with a GPU, `cargo test --features cuda -- --ignored` checks device
//! memory, loading, copies back, accounting, caches and unload against the checkpoint.

mod common;

use std::sync::Arc;

use weightlift_engine::model::TensorPlace;
use weightlift_engine::{
    Cache, CacheDType, DeviceTensor, EngineError, Inventory, LoadOptions, Model, Placement, Source,
};
use weightlift_format::{Checkpoint, DType, OpenOptions};
use weightlift_kernels::CudaBackend;

fn open(sub: &str) -> Arc<dyn Source> {
    let p = weightlift_testdata::reference()
        .join("tiny-llama")
        .join(sub);
    Arc::new(Checkpoint::open(p, OpenOptions::default()).unwrap())
}

/// Without a GPU, libcuda or the `cuda` feature, asking for `cuda:0` is the clean
/// `CudaUnavailable` error naming the device, and the real inventory is the host alone; with
/// one, `cuda:0` parses. A build with the feature on a machine without the driver says what is
/// missing and what to install.
#[test]
fn cuda_unavailable_is_a_clean_error() {
    match CudaBackend::unavailable_reason() {
        Some(_) => {
            let e = Inventory::parse("cuda:0").unwrap_err();
            assert!(
                matches!(e, EngineError::CudaUnavailable { ref device, .. } if device == "cuda:0"),
                "{e}"
            );
            assert!(e.to_string().contains("cuda:0"), "{e}");
            let no_driver = !std::path::Path::new("/proc/driver/nvidia").exists();
            if cfg!(feature = "cuda") && no_driver {
                assert!(
                    e.to_string().starts_with(
                        "device cuda:0: cuda is unavailable: libcuda.so.1 not found: install \
                         the NVIDIA driver"
                    ),
                    "{e}"
                );
            }
            let inv = Inventory::detect().unwrap();
            assert!(inv.accelerators().is_empty());
        }
        None => assert!(Inventory::parse("cuda:0,cpu").is_ok()),
    }
}

/// The CUDA inventory; the GPU tests are `#[ignore]`d, so this runs only where asked for.
fn cuda() -> Inventory {
    if let Some(reason) = CudaBackend::unavailable_reason() {
        panic!("this test needs cuda:0: {reason}");
    }
    Inventory::parse("cuda:0,cpu").unwrap()
}

/// The plan counts what the GPU really holds: after loading the tiny llama on `cuda:0` as
/// planned (and one forward pass, so the kernel modules it uses are loaded), what the driver
/// reports used (`cuMemGetInfo`: total less free) is the plan's column for `cuda:0` (weights,
/// kv, scratch and the overhead measured when the device was opened) within 64 MiB. Run it on a
/// GPU nothing else uses: other processes' memory counts as used.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn the_plan_counts_what_the_gpu_holds() {
    let inv = cuda();
    let src = common::open(common::reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf"));
    let mut m = Model::new(Arc::clone(&src), inv.clone());
    let mut req = m.plan_request().unwrap();
    req.cache = Some(weightlift_plan::CacheSpec::new(64, 1, CacheDType::Fp16));
    req.runtime = weightlift_plan::RuntimeSpec {
        max_input_len: 16,
        max_attention_size: 16 * 64,
        max_dq_size: 1 << 20,
        low_mem: false,
    };
    let plan = weightlift_plan::plan(&req).unwrap();
    let cache = common::load_planned(&mut m, &plan).unwrap();
    common::forward_all(&mut m, &cache, &[1, 2, 3, 4]);
    let gpu = &inv.accelerators()[0];
    let backend = gpu.cuda_backend().unwrap();
    weightlift_kernels::Backend::synchronize(backend).unwrap();
    let (free, total) = backend.mem_info().unwrap();
    let used = (total - free) as i64;
    let planned = plan.devices().iter().find(|d| d.name == "cuda:0").unwrap();
    let diff = used - planned.used() as i64;
    assert!(
        diff.abs() <= 64 << 20,
        "the driver reports {used} bytes used on cuda:0, the plan {} ({} weights, {} kv, {} \
         scratch, overhead {:?}; the engine holds {}): {diff} bytes apart\n{}",
        planned.used(),
        planned.weights,
        planned.kv,
        planned.scratch,
        planned.overhead_parts,
        gpu.used(),
        plan.explain()
    );
}

/// Layer-1 float tensors are converted to F16 on the way (in the staging path).
fn to_f16(t: &weightlift_format::TensorInfo) -> Option<DType> {
    (t.layer == Some(1) && matches!(t.dtype, DType::F32 | DType::BF16)).then_some(DType::F16)
}

/// The F16 bytes of F32 or BF16 data, by the `half` crate.
fn f16_bytes(dtype: DType, bytes: &[u8]) -> Vec<u8> {
    let vals: Vec<f32> = match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    };
    vals.iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn device_memory_round_trips_and_is_accounted() {
    let inv = cuda();
    let gpu = &inv.accelerators()[0];
    assert_eq!(gpu.name(), "cuda:0");
    assert!(gpu.capacity().unwrap() > 0);
    let bytes: Vec<u8> = (0..(40u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    let n = bytes.len() as u64 / 4;
    let t = DeviceTensor::from_host(gpu, vec![n], DType::F32, &bytes).unwrap();
    assert!(
        t.host_bytes().is_none(),
        "device memory is not host-addressable"
    );
    assert_eq!(gpu.used(), bytes.len() as u64);
    assert!(t.to_host().unwrap() == bytes);
    let mut part = vec![0u8; 4096];
    t.read(12_345, &mut part).unwrap();
    assert!(part == bytes[12_345..12_345 + 4096]);
    let virt = Inventory::parse("virtual:64MiB").unwrap();
    let on_virtual = t.copy_to(&virt.accelerators()[0]).unwrap();
    assert!(on_virtual.host_bytes().unwrap() == bytes.as_slice());
    let back = on_virtual.copy_to(gpu).unwrap();
    assert!(back.to_host().unwrap() == bytes);
    let e = gpu.alloc(gpu.capacity().unwrap() + 1).unwrap_err();
    assert!(e.to_string().contains("out of memory on cuda:0"), "{e}");
    drop((t, back));
    assert_eq!(gpu.used(), 0);
}

/// Writes 3 tokens of 2 kv heads × 64 values into layer 1 of a q8 `cache` (2 kv heads, head_dim
/// 64) at position 5 and reads them back: each value within the q8 cache's documented bound,
/// [`CacheDType::error_bound`], which is stated on its group's L2 norm because the groups are
/// stored Hadamard-turned (the largest value's `amax/254` held before the turn; on these values
/// the turned groups exceed it).
fn q8_cache_round_trips_within_its_bound(cache: &Cache) {
    let n = 2 * 64 * 3;
    let k: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    cache.write(1, 5, 3, &k, &k).unwrap();
    let (k2, v2) = cache.read(1, 5, 8).unwrap();
    // (batch, head, token, dim) order: every 32 values are one group of one head and token
    for (is_v, back) in [(false, &k2), (true, &v2)] {
        for (g, b) in k.chunks(32).zip(back.chunks(32)) {
            for (x, y) in g.iter().zip(b) {
                let bound = CacheDType::Q8.error_bound(is_v, *x, g);
                assert!((x - y).abs() <= bound, "{x} -> {y}, bound {bound}");
            }
        }
    }
}

/// The round trip of the q8 cache test on `cuda:0`, on a virtual device: the cache encodes and
/// decodes rows with the same codec there, so the bound that test checks is checked here on
/// every machine.
#[test]
fn q8_cache_round_trip_bound_holds_on_a_virtual_device() {
    let inv = Inventory::parse("virtual:1x8MiB").unwrap();
    let dev = Arc::clone(&inv.accelerators()[0]);
    let cfg = weightlift_engine::CacheConfig {
        max_seq_len: 16,
        batch_size: 1,
        dtype: CacheDType::Q8,
        n_kv_heads: vec![2, 2],
        head_dim: 64,
        offload: false,
        ring: None,
    };
    let cache = Cache::new(cfg).unwrap();
    for l in 0..2 {
        cache.allocate_layer(l, &dev, inv.cpu()).unwrap();
    }
    q8_cache_round_trips_within_its_bound(&cache);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn load_onto_cuda_copies_back_the_checkpoint_and_unload_frees() {
    let inv = cuda();
    let src = open("safetensors");
    // Layers on cuda:0 (staged: pinned double buffer, async copies), globals on cpu, with an
    // F32→F16 conversion on the way for one of the layer-1 tensors.
    let placement = Placement {
        tensors: src
            .tensors()
            .iter()
            .map(|t| TensorPlace {
                device: if t.layer.is_some() { "cuda:0" } else { "cpu" }.into(),
                dtype: to_f16(t).unwrap_or(t.dtype),
                split: None,
            })
            .collect(),
        layers: vec!["cuda:0".into(); 2],
        copies: Vec::new(),
        scratch: vec![("cuda:0".into(), 1 << 20)],
        forward: None,
        onload: None,
    };
    let mut model = Model::new(Arc::clone(&src), inv.clone());
    let cfg = model.cache_config(256, 1, CacheDType::Q8, false).unwrap();
    let cache = Arc::new(Cache::new(cfg.clone()).unwrap());
    let opts = LoadOptions {
        check_tensors: true,
        staging_bytes: 64 << 10,
        ..LoadOptions::default()
    };
    model
        .load(&placement, &opts, Some(&cache), true, &mut |_| true)
        .unwrap();
    let mut layer_bytes = 0u64;
    for (i, t) in src.tensors().iter().enumerate() {
        let want = match to_f16(t) {
            Some(_) => f16_bytes(t.dtype, src.bytes(i)),
            None => src.bytes(i).to_vec(),
        };
        assert!(model.tensor_bytes(&t.name).unwrap().0 == want, "{}", t.name);
        if t.layer.is_some() {
            layer_bytes += want.len() as u64;
        }
        let d = model.dequantized(&t.name, 1000).unwrap();
        assert!(d.transient_bytes <= 4000, "{}", t.name);
    }
    let gpu = &inv.accelerators()[0];
    let kv = cfg.layer_bytes(0) + cfg.layer_bytes(1);
    let held = model
        .memory()
        .into_iter()
        .find(|(n, _)| n == "cuda:0")
        .unwrap()
        .1;
    assert_eq!(held, layer_bytes + kv + (1 << 20));
    assert_eq!(gpu.used(), held);
    // The cache on CUDA memory round-trips within the q8 bound.
    q8_cache_round_trips_within_its_bound(&cache);
    model.unload();
    assert_eq!(gpu.used(), 0);
    assert!(!cache.is_allocated());
}

/// Quantise-on-load onto cuda:0 quantises the K-quants on the device (the rows go up as bf16
/// and `quantize_{type}_bf16` writes the blocks) and Q8_0 on the host: every tensor read back
/// equals the same load onto the cpu, which quantises on the host, for q4_k, q6_k and q8_0, with
/// chunks of a few rows so each tensor is quantised in several launches at their offsets. (The
/// `backends` suite's `quantize_rows_match_the_cpu_quantiser` checks every type on the device.)
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn quantising_onto_cuda_writes_the_host_quantisers_bytes() {
    let inv = cuda();
    let src = open("safetensors");
    for to in [DType::Q4_K, DType::Q6_K, DType::Q8_0] {
        let held = |t: &weightlift_format::TensorInfo| {
            let float = matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16);
            let whole = t.shape.len() == 2 && t.shape[1].is_multiple_of(to.block_size());
            if float && whole { to } else { t.dtype }
        };
        let placement = |layers: &str| Placement {
            tensors: src
                .tensors()
                .iter()
                .map(|t| TensorPlace {
                    device: if t.layer.is_some() { layers } else { "cpu" }.into(),
                    dtype: held(t),
                    split: None,
                })
                .collect(),
            layers: vec![layers.into(); 2],
            copies: Vec::new(),
            scratch: Vec::new(),
            forward: None,
            onload: None,
        };
        let opts = LoadOptions {
            staging_bytes: 64 << 10,
            ..LoadOptions::default()
        };
        let mut on_gpu = Model::new(Arc::clone(&src), inv.clone());
        on_gpu
            .load(&placement("cuda:0"), &opts, None, true, &mut |_| true)
            .unwrap();
        let mut on_cpu = Model::new(Arc::clone(&src), inv.clone());
        on_cpu
            .load(&placement("cpu"), &opts, None, true, &mut |_| true)
            .unwrap();
        let mut quantised = 0;
        for t in src.tensors() {
            let (gpu, dtype, _) = on_gpu.tensor_bytes(&t.name).unwrap();
            let (cpu, _, _) = on_cpu.tensor_bytes(&t.name).unwrap();
            assert_eq!(dtype, held(t), "{}", t.name);
            assert!(gpu == cpu, "{} as {to}: the device's bytes differ", t.name);
            quantised += usize::from(t.layer.is_some() && dtype == to);
        }
        assert!(
            quantised >= 14,
            "only {quantised} layer tensors quantised to {to}"
        );
    }
}

/// The K-quant quantisers of a quantising load (`quantize_q4_k_*`, `quantize_q6_k_*`) keep
/// 1,344 bytes a thread on the stack in NVRTC's sm_90 build, past the 1,024 a context reserves
/// for every thread the device can hold (the default stack limit). The driver grows that
/// reserve to the frame at the first launch and keeps it while the context lives: on an H200,
/// 320 bytes × 2,048 threads × 132 SMs, about 86 MB, which no plan charges. `check_quantized`,
/// which a load calls once the quantisers are done, sets the limit back, which gives the reserve
/// up. This measures the free memory on a backend of its own after a Q8_0 launch (1,024 bytes a
/// thread, and the module then loaded) and after a Q4_K launch and its report, prints what the
/// launch held meanwhile, and holds what stays to 16 MiB.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn device_quantisers_give_back_the_stack_reserve() {
    use weightlift_kernels::{Backend, FloatType, QuantType};
    if let Some(reason) = CudaBackend::unavailable_reason() {
        panic!("this test needs cuda:0: {reason}");
    }
    let b = CudaBackend::new(0).unwrap();
    let row: Vec<u8> = (0..256)
        .flat_map(|i| (i as f32 * 0.01 - 1.0).to_le_bytes())
        .collect();
    // free memory after a quantiser of `ty` ran, before and after its report was read
    let free_after = |ty: QuantType| {
        let (grown, checked) = {
            let mut dst = b.alloc(512).unwrap();
            let mut found = b.alloc(8).unwrap();
            b.quantize_rows(ty, FloatType::F32, &row, 256, &mut dst, 0, 0, &mut found)
                .unwrap();
            b.synchronize().unwrap();
            let grown = b.mem_info().unwrap().0;
            b.check_quantized(&found).unwrap();
            (grown, b.mem_info().unwrap().0)
        };
        // the buffers and the quantiser's scratch freed
        b.synchronize().unwrap();
        (grown, checked, b.mem_info().unwrap().0)
    };
    let (_, _, before) = free_after(QuantType::Q8_0);
    let (grown, checked, after) = free_after(QuantType::Q4_K);
    eprintln!(
        "free device memory: {before} before the Q4_K quantiser, {grown} while its launch's \
         stack reserve is held, {checked} once its report was read, {after} at the end"
    );
    let kept = before.saturating_sub(after);
    assert!(
        kept <= 16 << 20,
        "the quantize_q4_k_f32 launch kept {kept} bytes of device memory ({before} free before, \
         {after} after the report was read) that no plan counts: the driver's per-thread stack \
         reserve grew to the quantiser's frame and check_quantized did not give it back"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn offloaded_cache_prefetches_into_cuda() {
    let inv = cuda();
    let gpu = &inv.accelerators()[0];
    let cfg = weightlift_engine::CacheConfig {
        max_seq_len: 64,
        batch_size: 1,
        dtype: CacheDType::Fp16,
        n_kv_heads: vec![2, 2],
        head_dim: 64,
        offload: true,
        ring: None,
    };
    let cache = Arc::new(Cache::new(cfg.clone()).unwrap());
    cache.allocate_layer(0, gpu, inv.cpu()).unwrap();
    cache.allocate_layer(1, gpu, inv.cpu()).unwrap();
    assert_eq!(gpu.used(), 2 * cfg.layer_bytes(0), "two slots");
    let n = 2 * 64 * 4;
    let k: Vec<f32> = (0..n).map(|i| i as f32 / 8.0).collect();
    cache.write(1, 0, 4, &k, &k).unwrap();
    let r0 = cache.fetch(0).unwrap();
    assert_eq!(cache.prefetched("cuda:0"), [1]);
    drop(r0);
    let r1 = cache.fetch(1).unwrap();
    assert_eq!(
        cache.read_resident(&r1, 0, 4).unwrap(),
        cache.read(1, 0, 4).unwrap()
    );
    drop(r1);
    cache.free();
    assert_eq!(gpu.used(), 0);
}

/// The tiny llama's bf16 safetensors on `cuda:0` as stored (its placement keeps every dtype, as
/// `dtype="auto"` does): the embedding lookup, the layers and the tied head run the CUDA
/// kernels on bf16 (the bandwidth matvec one token at a time, the dequantised GEMM for the
/// 16-token prompt). Exact compute with an f32 cache: within 1e-3 of the cpu path and of
/// transformers (the reference README's f32 check), the same argmax, and the same per-token
/// decode; with a bf16 cache, within the bf16 cache bound of `tests/forward.rs` (0.1) of
/// transformers and of the cpu path over a bf16 cache.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn tiny_llama_bf16_runs_on_cuda_as_stored() {
    use common::{argmax, forward_all, json_ids, max_abs_diff, read_npy, reference};
    use weightlift_engine::forward::{Compute, Logits};
    cuda();
    let src = common::open(reference().join("tiny-llama/safetensors"));
    let ids = json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    let (shape, hf) = read_npy(&reference().join("tiny-llama/hf_logits.npy"));
    for (dtype, bound) in [(CacheDType::F32, 1e-3f32), (CacheDType::Bf16, 0.1)] {
        let (mut cpu, cc) = common::load_on(&src, "cpu", "cpu", 64, dtype);
        cpu.set_compute(Compute::Exact);
        let want = forward_all(&mut cpu, &cc, &ids);
        let (mut gpu, gc) = common::load_on(&src, "cuda:0,cpu", "cuda:0", 64, dtype);
        gpu.set_compute(Compute::Exact);
        for (i, t) in src.tensors().iter().enumerate() {
            let (bytes, held, _) = gpu.tensor_bytes(&t.name).unwrap();
            assert_eq!(held, DType::BF16, "{}: held as stored", t.name);
            assert!(bytes == src.bytes(i), "{}", t.name);
        }
        let got = forward_all(&mut gpu, &gc, &ids);
        let (d_cpu, d_hf) = (max_abs_diff(&got, &want), max_abs_diff(&got, &hf));
        eprintln!(
            "{} cache: max|Δ| {d_cpu:.2e} against the cpu path, {d_hf:.2e} against transformers",
            dtype.name()
        );
        assert!(d_cpu <= bound && d_hf <= bound, "{} cache", dtype.name());
        if dtype == CacheDType::F32 {
            for (i, (a, b)) in got.chunks(shape[1]).zip(hf.chunks(shape[1])).enumerate() {
                assert_eq!(argmax(a), argmax(b), "position {i}");
            }
        }
        // token by token: every step is a one-token pass through the matvec kernels
        gc.reset();
        let mut out = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            gpu.forward(&[*id], Some(&gc), Logits::Last, &mut out)
                .unwrap();
            let row = &want[i * shape[1]..(i + 1) * shape[1]];
            let d = max_abs_diff(&out, row);
            assert!(d <= bound, "{} cache, step {i}: max|Δ| {d}", dtype.name());
        }
    }
}

/// A batch on `cuda:0` (three prompts in one call, then their decode steps in one call each)
/// gives each sequence what it gets alone: the same bits in exact mode (one product per
/// sequence), and in fast mode (every product shared) logits within
/// [`common::batch::FAST_BATCH_BOUND`] (Q8 blocks on one side, f16/bf16 activations on the
/// other where the batch's rows reach the cuBLAS route and a sequence alone does not), with
/// the same argmax wherever the top two alone are further apart than that (the tiny model's
/// random weights leave near ties: the first GPU run found one), for bf16 weights and Q4_K_M
/// blocks.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn a_batch_on_cuda_gives_each_sequence_what_it_gets_alone() {
    use common::{argmax, json_ids, max_abs_diff, reference};
    use weightlift_engine::forward::{Compute, Logits};
    const STEPS: usize = 4;
    cuda();
    let ids = json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    let prompts = [
        ids.clone(),
        ids[..ids.len() / 2].to_vec(),
        ids[2..].to_vec(),
    ];
    for path in ["safetensors", "gguf/tiny-llama-Q4_K_M.gguf"] {
        let src = common::open(reference().join("tiny-llama").join(path));
        for compute in [Compute::Exact, Compute::Fast] {
            let (mut m, _) = common::load_on(&src, "cuda:0,cpu", "cuda:0", 64, CacheDType::Fp16);
            m.set_compute(compute);
            let mut want = Vec::new();
            for p in &prompts {
                let cache = m.sequence_cache(64).unwrap();
                let mut out = Vec::new();
                m.forward(p, Some(&cache), Logits::Last, &mut out).unwrap();
                let mut rows = vec![out.clone()];
                for _ in 0..STEPS {
                    let next = argmax(&out) as u32;
                    m.forward(&[next], Some(&cache), Logits::Last, &mut out)
                        .unwrap();
                    rows.push(out.clone());
                }
                want.push(rows);
            }
            let alone_row = |s: usize, step: usize| &want[s][step];
            let caches: Vec<Arc<Cache>> = prompts
                .iter()
                .map(|_| m.sequence_cache(64).unwrap())
                .collect();
            let mut next: Vec<Vec<u32>> = prompts.to_vec();
            for step in 0..=STEPS {
                let seqs: Vec<(&Arc<Cache>, &[u32])> = caches
                    .iter()
                    .zip(&next)
                    .map(|(c, i)| (c, i.as_slice()))
                    .collect();
                let mut out = Vec::new();
                m.forward_batch(&seqs, &mut out).unwrap();
                let vocab = out.len() / prompts.len();
                for (s, row) in out.chunks_exact(vocab).enumerate() {
                    let w = alone_row(s, step);
                    let what = format!("{path}, {compute:?}, sequence {s}, step {step}");
                    match compute {
                        Compute::Exact => {
                            assert!(row == &w[..], "{what}: max|Δ| {}", max_abs_diff(row, w))
                        }
                        Compute::Fast => {
                            let bound = common::batch::FAST_BATCH_BOUND;
                            let d = max_abs_diff(row, w);
                            assert!(d <= bound, "{what}: max|Δ| {d}");
                            if common::margin(w) > bound {
                                assert_eq!(argmax(row), argmax(w), "{what}");
                            }
                        }
                    }
                    // each sequence follows its own greedy tokens from when it ran alone
                    next[s] = vec![argmax(w) as u32];
                }
            }
        }
    }
}

/// A state saved from a q4 cache on `device` comes back bit for bit: after `load_state` the
/// next tokens' logits are those before it, and a cache on the cpu takes the same stored bytes.
fn a_q4_state_comes_back_bit_for_bit_on(devices: &str, device: &str) {
    use common::{json_ids, reference};
    use weightlift_engine::forward::Logits;
    let ids = json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    let src = common::open(reference().join("tiny-llama/safetensors"));
    let (mut m, cache) = common::load_on(&src, devices, device, 64, CacheDType::Q4);
    let mut out = Vec::new();
    m.forward(&ids, Some(&cache), Logits::Last, &mut out)
        .unwrap();
    let state = cache.save_state().unwrap();
    let (mut want, mut got) = (Vec::new(), Vec::new());
    m.forward(&[5, 6], Some(&cache), Logits::All, &mut want)
        .unwrap();
    m.forward(&ids[..4], Some(&cache), Logits::Last, &mut out)
        .unwrap();
    cache.load_state(&state).unwrap();
    m.forward(&[5, 6], Some(&cache), Logits::All, &mut got)
        .unwrap();
    assert!(
        got == want,
        "{device}: max|Δ| {}",
        common::max_abs_diff(&got, &want)
    );
    let inv = Inventory::parse("cpu").unwrap();
    let host = Cache::new(cache.config().clone()).unwrap();
    for l in 0..host.n_layers() {
        host.allocate_layer(l, inv.cpu(), inv.cpu()).unwrap();
    }
    host.load_state(&state).unwrap();
    assert!(host.save_state().unwrap() == state, "{device}");
}

#[test]
fn a_q4_state_comes_back_bit_for_bit_on_a_virtual_device() {
    a_q4_state_comes_back_bit_for_bit_on("virtual:1x64MiB,cpu", "virtual:0");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn a_q4_state_comes_back_bit_for_bit_on_cuda() {
    cuda();
    a_q4_state_comes_back_bit_for_bit_on("cuda:0,cpu", "cuda:0");
}

/// Weight offload onto `cuda:0` (both layers of the tiny llama kept on the cpu, copied into
/// slots of the GPU's scratch for every pass, sequential and grouped with prefetch): the
/// offloaded matrices are page-locked, so each copy goes straight from where the model holds
/// them by DMA (no warning that the driver refused them), and the logits are those of the
/// same model loaded whole on `cuda:0` (within 1e-3, the same argmax: the plan may put the
/// head on the cpu), on two passes (the second starting from what the first left in the slots).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn offloaded_weights_are_copied_from_page_locked_memory() {
    use common::{json_ids, reference};
    use weightlift_engine::forward::{Compute, Logits};
    use weightlift_plan::{CacheSpec, LayerOptions, Strategy, WeightOffload};
    let inv = cuda();
    let src = common::open(reference().join("tiny-llama/safetensors"));
    let ids = json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    let (mut whole, wc) = common::load_on(&src, "cuda:0,cpu", "cuda:0", 64, CacheDType::Fp16);
    whole.set_compute(Compute::Exact);
    let mut want = Vec::new();
    whole
        .forward(&ids, Some(&wc), Logits::All, &mut want)
        .unwrap();
    let group = WeightOffload::Group {
        blocks_per_group: 1,
        prefetch: true,
    };
    for mode in [WeightOffload::Sequential, group] {
        let mut m = Model::new(Arc::clone(&src), inv.clone());
        let mut req = m.plan_request().unwrap();
        req.strategy = Strategy::Layers(LayerOptions {
            n_gpu_layers: 0,
            ..LayerOptions::default()
        });
        req.cache = Some(CacheSpec::new(64, 1, CacheDType::Fp16));
        req.offload = Some(mode);
        let plan = weightlift_plan::plan(&req).unwrap();
        assert_eq!(plan.onload().expect("an onload plan").device, "cuda:0");
        let cache = common::load_planned(&mut m, &plan).unwrap();
        m.set_compute(Compute::Exact);
        for pass in 0..2 {
            cache.reset();
            let mut got = Vec::new();
            m.forward(&ids, Some(&cache), Logits::All, &mut got)
                .unwrap();
            let d = common::max_abs_diff(&got, &want);
            assert!(
                d <= 1e-3,
                "{mode:?} pass {pass}: max|Δ| {d} from cuda:0 whole"
            );
            let vocab = got.len() / ids.len();
            for (i, (a, b)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
                let at = format!("{mode:?} pass {pass} position {i}");
                assert_eq!(common::argmax(a), common::argmax(b), "{at}");
            }
            if pass == 0 {
                assert!(m.transfer_stats().bytes > 0, "{mode:?}: nothing was copied");
            }
        }
        let refused: Vec<&String> = m
            .warnings()
            .iter()
            .filter(|w| w.contains("page-locked"))
            .collect();
        assert!(refused.is_empty(), "{mode:?}: {refused:?}");
    }
}

/// llama.cpp's `--n-cpu-moe N` (N every layer: 2, and 6 for the mixed qwen3moe whose layers
/// 0, 2, 3 and 4 are dense) on `cuda:0` for the tiny mixtral and qwen3moe, the narrow qwen3moe
/// whose experts and queries are narrower than its hidden size and the mixed one (F16 GGUF
/// where there is one, and safetensors): attention, norms, routers and dense MLPs on the GPU,
/// every expert in host RAM and
/// computed there. Exact compute with an f32 cache: every prompt position within 1e-3 of
/// transformers with its argmax, and greedy decoding (one routed token per step, the row and
/// scores copied to the host and the experts' row back) is transformers' continuation.
/// Loaded whole on `cuda:0` instead, the experts run on the GPU (the routed rows gathered,
/// each expert's gated product, its rows added into their tokens' sums by weight): within 1e-3
/// of transformers too, with its greedy continuation.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn moe_on_cuda_with_experts_on_the_host_or_the_gpu() {
    use common::family::Family;
    use common::{argmax, forward_all, greedy, json_ids, max_abs_diff, read_npy};
    use weightlift_engine::forward::Compute;
    use weightlift_format::Role;
    use weightlift_plan as wp;
    let inv = cuda();
    for f in [
        Family("mixtral"),
        Family("qwen3moe"),
        Family("qwen3moe-narrow"),
        Family("qwen3moe-mixed"),
    ] {
        let ids = f.ids();
        let greedy_want = json_ids(&f.data().join("stats.json"), "greedy_ids");
        let (shape, hf) = read_npy(&f.data().join("hf_logits.npy"));
        let same_weights = f.checkpoints().into_iter();
        for path in same_weights.filter(|p| !p.to_string_lossy().contains("Q8_0")) {
            let file = path.display().to_string();
            let src = common::open(&path);
            let mut m = Model::new(Arc::clone(&src), inv.clone());
            let mut req = m.plan_request().unwrap();
            wp::PlanOptions {
                n_cpu_moe: Some(src.spec().unwrap().n_layers),
                cache: Some(wp::CacheSpec::new(64, 1, CacheDType::F32)),
                ..wp::PlanOptions::default()
            }
            .apply(&mut req)
            .unwrap();
            let plan = wp::plan(&req).unwrap();
            assert!(plan.layer_devices().iter().all(|d| d == "cuda:0"), "{file}");
            for (t, info) in plan.tensors().iter().zip(src.tensors()) {
                if info.role.is_some_and(Role::is_expert) {
                    assert_eq!(t.device, "cpu", "{file}: {}", t.name);
                }
            }
            let cache = common::load_planned(&mut m, &plan).unwrap();
            m.set_compute(Compute::Exact);
            let got = forward_all(&mut m, &cache, &ids);
            let d = max_abs_diff(&got, &hf);
            eprintln!("{file} n_cpu_moe on cuda:0: max|Δ| {d:.2e} against transformers");
            assert!(d <= 1e-3, "{file}: max|Δ| {d}");
            for (i, (a, b)) in got.chunks(shape[1]).zip(hf.chunks(shape[1])).enumerate() {
                assert_eq!(argmax(a), argmax(b), "{file} position {i}");
            }
            let steps = greedy(&mut m, &cache, &ids, greedy_want.len());
            assert_eq!(steps, greedy_want, "{file} greedy");

            let (mut whole, wc) =
                common::load_on(&src, "cuda:0,cpu", "cuda:0", 64, CacheDType::F32);
            whole.set_compute(Compute::Exact);
            let on_gpu = forward_all(&mut whole, &wc, &ids);
            let d = max_abs_diff(&on_gpu, &hf);
            eprintln!("{file} whole on cuda:0: max|Δ| {d:.2e} against transformers");
            assert!(d <= 1e-3, "{file} whole on cuda:0: max|Δ| {d}");
            let steps = greedy(&mut whole, &wc, &ids, greedy_want.len());
            assert_eq!(steps, greedy_want, "{file} greedy whole on cuda:0");
        }
    }
}

/// Decode steps on `cuda:0` replayed from a captured CUDA graph are the steps launched kernel by
/// kernel, bit for bit: greedy decode of 8 tokens after the reference prompt, with graphs on and
/// off, gives the same logits at every step, for bf16 weights and Q4_K_M blocks, an fp16 cache
/// and a q8 one, in fast and exact mode; and so do 8 steps of a batch of two sequences (after
/// their prompts, which launch as before). With graphs on, the first step ran as a warm-up, the
/// second was captured, and every step from the second on replayed the graph (one capture,
/// seven replays), and the batch, another key, did the same with its own graph unless two
/// tokens take some weight type's products to cuBLAS (whose scratch a graph would keep), when
/// it launches as usual; with graphs off nothing was captured.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn decode_steps_replayed_from_a_cuda_graph_are_the_launched_steps() {
    use common::{argmax, json_ids, max_abs_diff, reference};
    use weightlift_engine::forward::{Compute, Logits};
    const STEPS: usize = 8;
    cuda();
    let ids = json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    for path in ["safetensors", "gguf/tiny-llama-Q4_K_M.gguf"] {
        let src = common::open(reference().join("tiny-llama").join(path));
        for dtype in [CacheDType::Fp16, CacheDType::Q8] {
            for compute in [Compute::Fast, Compute::Exact] {
                let what = format!("{path}, {} cache, {compute:?}", dtype.name());
                let run = |graphs: bool| {
                    let (mut m, cache) = common::load_on(&src, "cuda:0,cpu", "cuda:0", 64, dtype);
                    m.set_compute(compute);
                    m.set_cuda_graphs(graphs);
                    assert_eq!(m.cuda_graphs(), graphs);
                    let mut out = Vec::new();
                    m.forward(&ids, Some(&cache), Logits::Last, &mut out)
                        .unwrap();
                    let mut rows = Vec::new();
                    for _ in 0..STEPS {
                        let next = argmax(&out) as u32;
                        m.forward(&[next], Some(&cache), Logits::Last, &mut out)
                            .unwrap();
                        rows.push(out.clone());
                    }
                    let counts = m.cuda_graph_counts();
                    // two sequences: their prompts in one call, then a token of each a call
                    let (a, b) = (m.sequence_cache(64).unwrap(), m.sequence_cache(64).unwrap());
                    m.forward_batch(&[(&a, &ids[..]), (&b, &ids[..ids.len() / 2])], &mut out)
                        .unwrap();
                    for _ in 0..STEPS {
                        let vocab = out.len() / 2;
                        let next: Vec<u32> =
                            out.chunks_exact(vocab).map(|r| argmax(r) as u32).collect();
                        m.forward_batch(&[(&a, &next[..1]), (&b, &next[1..])], &mut out)
                            .unwrap();
                        rows.push(out.clone());
                    }
                    (rows, counts, m.cuda_graph_counts())
                };
                let (off, off_counts, off_batch) = run(false);
                let (on, on_counts, on_batch) = run(true);
                assert_eq!(off_counts, (0, 0, None), "{what}: graphs off");
                assert_eq!(off_batch, (0, 0, None), "{what}: graphs off, a batch");
                // a batch of two is its own key: no product of these files (BF16; Q4_K and
                // Q6_K, 256 values a row) takes scratch below 8 tokens (cuBLAS, the
                // dequantised path, Q8 activations past the kept buffer; see
                // `sources::scratch_from_tokens`), so its step is recorded too
                assert_eq!(
                    (on_batch.0, on_batch.1),
                    (2, 2 * (STEPS as u64 - 1)),
                    "{what}: (captures, replays) after the batch"
                );
                eprintln!("{what}: graphs on {on_counts:?}");
                assert_eq!(on_counts.2, None, "{what}: the driver refused the capture");
                assert_eq!(
                    (on_counts.0, on_counts.1),
                    (1, STEPS as u64 - 1),
                    "{what}: (captures, replays)"
                );
                for (step, (g, l)) in on.iter().zip(&off).enumerate() {
                    assert!(
                        g == l,
                        "{what}, step {step}: max|Δ| {} between graphs on and off",
                        max_abs_diff(g, l)
                    );
                }
            }
        }
    }
}

/// A model planned for `cuda:0` alone, as `Model(devices="cuda:0")` plans it (the input
/// embedding in host memory, every layer and the head on the GPU), replays its decode steps
/// from a CUDA graph: each step's embedding row is copied to the GPU before the replay, as its
/// position is. Graphs on and off give the same logits over 8 greedy steps, in both modes.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn a_planned_model_with_its_embedding_in_host_memory_replays_its_steps() {
    use common::{json_ids, reference};
    use weightlift_engine::forward::Compute;
    use weightlift_format::Role;
    const STEPS: usize = 8;
    cuda();
    let ids = json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    let src = common::open(reference().join("tiny-llama/gguf/tiny-llama-Q4_K_M.gguf"));
    for compute in [Compute::Fast, Compute::Exact] {
        let run = |graphs: bool| {
            let mut m = Model::new(Arc::clone(&src), Inventory::parse("cuda:0").unwrap());
            let options = weightlift_plan::PlanOptions {
                cache: Some(weightlift_plan::CacheSpec::new(64, 1, CacheDType::Fp16)),
                ..Default::default()
            };
            let plan = common::plan_and_load(&mut m, options);
            let placement = m.placement(&plan).unwrap();
            let embd = src
                .tensors()
                .iter()
                .position(|t| t.role == Some(Role::TokenEmbd))
                .unwrap();
            assert_eq!(
                placement.tensors[embd].device, "cpu",
                "the plan's embedding"
            );
            assert!(placement.layers.iter().all(|d| d == "cuda:0"));
            let cache = m.own_cache().unwrap();
            m.set_compute(compute);
            m.set_cuda_graphs(graphs);
            let rows = greedy_steps(&mut m, &cache, &ids, STEPS);
            (rows, m.cuda_graph_counts())
        };
        let (off, off_counts) = run(false);
        let (on, on_counts) = run(true);
        assert_eq!(off_counts, (0, 0, None), "{compute:?}: graphs off");
        assert_eq!(
            on_counts,
            (1, STEPS as u64 - 1, None),
            "{compute:?}: (captures, replays, refused)"
        );
        assert_same_steps(&format!("{compute:?}"), &on, &off);
    }
}

/// `prompt` into `cache`, then `steps` greedy decode steps: each step's logits.
fn greedy_steps(m: &mut Model, cache: &Arc<Cache>, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    use weightlift_engine::forward::Logits;
    let mut out = Vec::new();
    m.forward(prompt, Some(cache), Logits::Last, &mut out)
        .unwrap();
    (0..steps)
        .map(|_| {
            let next = common::argmax(&out) as u32;
            m.forward(&[next], Some(cache), Logits::Last, &mut out)
                .unwrap();
            out.clone()
        })
        .collect()
}

/// The steps replayed from graphs (`on`) are the launched ones (`off`), bit for bit.
fn assert_same_steps(what: &str, on: &[Vec<f32>], off: &[Vec<f32>]) {
    assert_eq!(on.len(), off.len(), "{what}: steps");
    for (step, (g, l)) in on.iter().zip(off).enumerate() {
        assert!(
            g == l,
            "{what}, step {step}: max|Δ| {} between graphs on and off",
            common::max_abs_diff(g, l)
        );
    }
}

/// A generation that crosses an attention span (the keys rounded up to a power of two, at least
/// 256): twelve steps from position 250 of a 512-row cache replay the graph of span 256 up to
/// 256 keys, then warm up and capture the graph of span 512 (two captures, ten replays), and
/// every step's logits are the launched steps'.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn a_generation_crossing_an_attention_span_captures_the_next() {
    use common::{json_ids, reference};
    use weightlift_engine::forward::Compute;
    cuda();
    let ids = json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    let prompt: Vec<u32> = ids.iter().copied().cycle().take(250).collect();
    let src = common::open(reference().join("tiny-llama/gguf/tiny-llama-Q4_K_M.gguf"));
    let run = |graphs: bool| {
        let (mut m, cache) = common::load_on(&src, "cuda:0,cpu", "cuda:0", 512, CacheDType::Fp16);
        m.set_compute(Compute::Fast);
        m.set_cuda_graphs(graphs);
        let rows = greedy_steps(&mut m, &cache, &prompt, 12);
        (rows, m.cuda_graph_counts())
    };
    let (off, _) = run(false);
    let (on, counts) = run(true);
    assert_eq!(counts, (2, 10, None), "(captures, replays, refused)");
    assert_same_steps("a span crossed", &on, &off);
}

/// The q8 cache, a step replayed from a graph after the cache was reset and refilled, and after
/// another cache of another size took its place: a reset keeps the graph (the positions come from
/// the device), a new cache captures a new one (its layers are other memory), going back to the
/// first replays its kept graph at once, and the logits stay those of the launched steps.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn a_cuda_graph_follows_its_cache() {
    use common::{argmax, json_ids, reference};
    use weightlift_engine::forward::{Compute, Logits};
    cuda();
    let ids = json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    let src = common::open(reference().join("tiny-llama/gguf/tiny-llama-Q4_K_M.gguf"));
    let decode = |m: &mut Model, cache: &Arc<Cache>, steps: usize| {
        let mut out = Vec::new();
        m.forward(&ids, Some(cache), Logits::Last, &mut out)
            .unwrap();
        let mut rows = Vec::new();
        for _ in 0..steps {
            let next = argmax(&out) as u32;
            m.forward(&[next], Some(cache), Logits::Last, &mut out)
                .unwrap();
            rows.push(out.clone());
        }
        rows
    };
    let (mut off, oc) = common::load_on(&src, "cuda:0,cpu", "cuda:0", 64, CacheDType::Q8);
    off.set_compute(Compute::Fast);
    off.set_cuda_graphs(false);
    let want = decode(&mut off, &oc, 4);
    let (mut m, cache) = common::load_on(&src, "cuda:0,cpu", "cuda:0", 64, CacheDType::Q8);
    m.set_compute(Compute::Fast);
    m.set_cuda_graphs(true);
    assert_eq!(decode(&mut m, &cache, 4), want, "first pass");
    assert_eq!(m.cuda_graph_counts(), (1, 3, None));
    cache.reset();
    assert_eq!(decode(&mut m, &cache, 4), want, "after a reset");
    assert_eq!(
        m.cuda_graph_counts(),
        (1, 7, None),
        "a reset keeps the graph"
    );
    let other = m.sequence_cache(128).unwrap();
    let got = decode(&mut m, &other, 4);
    // another size splits attention's keys otherwise: the same argmax, close logits
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(argmax(g), argmax(w));
    }
    assert_eq!(
        m.cuda_graph_counts(),
        (2, 10, None),
        "a new cache: a warm-up step, a capture and two more replays"
    );
    cache.reset();
    assert_eq!(decode(&mut m, &cache, 4), want, "back on the first cache");
    assert_eq!(m.cuda_graph_counts(), (2, 14, None), "its graph was kept");
}

/// A sliding-window layer's ring on `cuda:0` (the tiny gemma3's window of 8 with a cache of
/// 1,024 positions in chunks of 32: each sliding layer keeps 256 rows): a prompt of 600 tokens
/// (the prompt kernel storing past the ring's end at its positions' rows) and 250 decode steps
/// (replayed from CUDA graphs, the row and the keys' rows found on the device) give the bits of
/// the same model over a cache of every position, in fast mode over an fp16 cache and in exact
/// mode over an f32 one; and, exact, the prompt's logits within 1e-3 of the host path's.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn sliding_rings_on_cuda_give_the_full_caches_bits() {
    use common::{argmax, max_abs_diff};
    use weightlift_engine::CacheConfig;
    use weightlift_engine::forward::{Compute, Logits};
    cuda();
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/tiny-gemma3");
    let ids: Vec<u32> = common::json_ids(&path.join("stats.json"), "ids")
        .into_iter()
        .cycle()
        .take(600)
        .collect();
    let runtime = weightlift_plan::RuntimeSpec {
        max_input_len: 32,
        max_attention_size: 32 * 256,
        max_dq_size: 1 << 16,
        low_mem: false,
    };
    let load = |devices: &str, dtype: CacheDType| {
        let mut m = Model::new(common::open(&path), Inventory::parse(devices).unwrap());
        let options = weightlift_plan::PlanOptions {
            cache: Some(weightlift_plan::CacheSpec::new(1024, 1, dtype)),
            runtime: Some(runtime),
            ..Default::default()
        };
        common::plan_and_load(&mut m, options);
        let ring = m.own_cache().unwrap();
        assert_eq!(ring.config().rows(0), 256);
        let full = Arc::new(
            Cache::new(CacheConfig {
                ring: None,
                ..ring.config().clone()
            })
            .unwrap(),
        );
        m.attach_cache(&full).unwrap();
        (m, ring, full)
    };
    let run = |m: &mut Model, cache: &Arc<Cache>| {
        cache.reset();
        let mut all = Vec::new();
        m.forward(&ids, Some(cache), Logits::All, &mut all).unwrap();
        let mut out = all[all.len() - all.len() / ids.len()..].to_vec();
        for _ in 0..250 {
            let next = argmax(&out) as u32;
            m.forward(&[next], Some(cache), Logits::Last, &mut out)
                .unwrap();
            all.extend_from_slice(&out);
        }
        all
    };
    for (dtype, compute) in [
        (CacheDType::Fp16, Compute::Fast),
        (CacheDType::F32, Compute::Exact),
    ] {
        let (mut m, ring, full) = load("cuda:0,cpu", dtype);
        m.set_compute(compute);
        let want = run(&mut m, &full);
        let got = run(&mut m, &ring);
        assert!(
            got == want,
            "{compute:?}: ring and full differ on cuda, max|Δ| {}",
            max_abs_diff(&got, &want)
        );
        assert_eq!(ring.held_from(0), 850 - 256);
        if compute == Compute::Exact {
            // the prompt's logits against the host path's over its rings
            let (mut host, host_ring, _) = load("cpu", dtype);
            host.set_compute(compute);
            let on_host = run(&mut host, &host_ring);
            let n = ids.len() * (got.len() / (ids.len() + 250));
            let d = max_abs_diff(&got[..n], &on_host[..n]);
            assert!(d <= 1e-3, "cuda against the host path, max|Δ| {d}");
        }
    }
}

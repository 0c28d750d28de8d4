//! EXL2 checkpoints run on the host path: the format crate's fixture (a 1-layer qwen2 with q/k/v
//! biases whose linears exllamav2 0.3.2's `AdaptiveGPTQ.pack` packed at widths 2 to 8 bits with
//! random input permutations, and an 8/6-bit lm_head whose 48 outputs are stored padded to 64)
//! against transformers' float32 forward pass over the weights exllamav2's arithmetic gives
//! (`tests/gen_exl2_logits.py` wrote `tests/data/exl2/`); the same logits from cpu, a virtual
//! device, disk, and offloaded execution from onload slots; the plan's memory what a virtual
//! device holds at its peak; and the paths EXL2 does not run (the backend op sequence, tensor
//! parallelism) refused by name.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{
    OFFLOAD_MODES, argmax, check_packed_offload, forward_all, json_ids, load_planned, max_abs_diff,
    open, planned_layers, read_npy,
};
use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::{CacheDType, EngineError, Inventory, Model, Source};
use weightlift_format::quantized::LinearScheme;
use weightlift_plan as wp;

fn exl2() -> Arc<dyn Source> {
    open(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../weightlift-format/tests/data/exl2/model.safetensors"),
    )
}

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/exl2")
}

fn ids() -> Vec<u32> {
    json_ids(&data().join("meta.json"), "ids")
}

/// Every position's logits of the reference ids, on `devices` (everything on `device`).
fn run(src: &Arc<dyn Source>, devices: &str, device: &str, compute: Compute) -> Vec<f32> {
    let (mut m, cache) = common::load_on(src, devices, device, 32, CacheDType::F32);
    m.set_compute(compute);
    forward_all(&mut m, &cache, &ids())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The logits equal transformers' on exllamav2's weights to f32 rounding: the weights are the
/// same numbers (the format crate checks its dequantiser against their digests; the engine's
/// unit tests check the product against the dequantised weight bit for bit), so what is left is
/// the order of f32 sums. The logits reach 19.5, so the bound is 4·10⁻⁶ of the largest; every
/// position's argmax is the same (the reference's smallest top-1 margin is 0.85).
#[test]
fn exl2_logits_match_transformers_on_exllamav2s_weights() {
    let (shape, want) = read_npy(&data().join("logits.npy"));
    assert_eq!(shape, [ids().len(), 48]);
    let src = exl2();
    for compute in [Compute::Exact, Compute::Fast] {
        let out = run(&src, "cpu", "cpu", compute);
        assert_eq!(out.len(), want.len());
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = max_abs_diff(&out, &want);
        eprintln!(
            "exl2 ({}): max|Δ| {d:.3e}, max|logit| {scale:.3}",
            compute.name()
        );
        assert!(d <= 4e-6 * scale.max(1.0), "max|Δ| {d}");
        for (i, (a, b)) in out.chunks(shape[1]).zip(want.chunks(shape[1])).enumerate() {
            assert_eq!(argmax(a), argmax(b), "position {i}");
        }
    }
}

/// Placement never changes results: the packed tensors on a virtual device, or the layer left
/// on disk, give the cpu run's logits bit for bit; decoding token by token gives each position
/// of the prompt pass to f32 rounding (the one-token products and attention sum in another
/// order; measured 4.1e-5 at most, 2.1e-6 of the largest logit; the float32 test below shows
/// the same difference without any packing).
#[test]
fn exl2_on_a_virtual_device_or_disk_equals_cpu_and_decode_follows_the_prompt() {
    let src = exl2();
    let cpu = run(&src, "cpu", "cpu", Compute::Exact);
    let virt = run(&src, "virtual:64MiB,cpu", "virtual:0", Compute::Exact);
    assert_eq!(bits(&cpu), bits(&virt), "virtual:0");
    let (mut m, cache) = common::split_load(&src, "cpu,disk", &["cpu"], CacheDType::F32, 1, false);
    assert_eq!(m.layer_devices().unwrap(), ["disk"]);
    m.set_compute(Compute::Exact);
    assert_eq!(
        bits(&cpu),
        bits(&forward_all(&mut m, &cache, &ids())),
        "disk"
    );

    let (mut m, cache) = common::load_on(&src, "cpu", "cpu", 32, CacheDType::F32);
    m.set_compute(Compute::Exact);
    let ids = ids();
    let vocab = cpu.len() / ids.len();
    let scale = cpu.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (mut out, mut worst) = (Vec::new(), 0f32);
    for (t, id) in ids.iter().enumerate() {
        m.forward(&[*id], Some(&cache), Logits::Last, &mut out)
            .unwrap();
        let d = max_abs_diff(&out, &cpu[t * vocab..(t + 1) * vocab]);
        worst = worst.max(d);
        assert!(
            d <= 4e-6 * scale,
            "position {t}: decode vs prompt max|Δ| {d}"
        );
    }
    eprintln!("decode vs prompt: max|Δ| {worst:.3e}, max|logit| {scale:.3}");
}

/// An EXL2 model equals, bit for bit, the float32 checkpoint of its dequantised weights (the
/// format crate's `dequantize_linear`), in a prompt pass and in decode steps, in both compute
/// modes: the forward pass multiplies exactly those weights with the float products.
#[test]
fn exl2_equals_its_dequantised_float32_checkpoint_bit_for_bit() {
    use safetensors::SafeTensors;
    use safetensors::tensor::{Dtype, TensorView};
    let folder =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../weightlift-format/tests/data/exl2");
    let ckpt = weightlift_format::Checkpoint::open(
        folder.join("model.safetensors"),
        weightlift_format::OpenOptions::default(),
    )
    .unwrap();
    let dense: Vec<(String, Vec<usize>, Vec<u8>)> = ckpt
        .quantization()
        .unwrap()
        .linears()
        .iter()
        .map(|l| {
            let w = ckpt.dequantize_linear(l).unwrap();
            let shape = vec![l.out_features(), l.in_features()];
            let name = format!("{}.weight", l.prefix());
            (name, shape, bytemuck::cast_slice(&w).to_vec())
        })
        .collect();
    let bytes = std::fs::read(folder.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut views: Vec<(String, TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| !weightlift_format::is_quantized_part(n))
        .collect();
    for (name, shape, data) in &dense {
        let view = TensorView::new(Dtype::F32, shape.clone(), data).unwrap();
        views.push((name.clone(), view));
    }
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(folder.join("config.json")).unwrap()).unwrap();
    let config_map = config.as_object_mut().unwrap();
    config_map.remove("quantization_config");
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    let float = open(dir.path());
    assert!(float.checkpoint().unwrap().quantization().is_none());
    let steps = |src: &Arc<dyn Source>, compute: Compute| {
        let (mut m, cache) = common::load_on(src, "cpu", "cpu", 32, CacheDType::F32);
        m.set_compute(compute);
        let ids = ids();
        let mut all = forward_all(&mut m, &cache, &ids[..8]);
        let mut out = Vec::new();
        for id in &ids[8..] {
            m.forward(&[*id], Some(&cache), Logits::Last, &mut out)
                .unwrap();
            all.extend_from_slice(&out);
        }
        bits(&all)
    };
    for compute in [Compute::Exact, Compute::Fast] {
        assert_eq!(
            steps(&exl2(), compute),
            steps(&float, compute),
            "{}",
            compute.name()
        );
    }
}

/// A planned load onto a virtual device holds exactly what the plan says: the packed tensors at
/// their stored bytes, the cache and the workspace, through a prompt in two chunks and decode
/// steps. (The dequantised tiles of the packed product are transient host scratch that the
/// plan does not reserve; see the engine's `forward::weights`.)
#[test]
fn the_plan_is_what_a_virtual_device_holds_at_its_peak() {
    let src = exl2();
    let inv = Inventory::parse("virtual:8MiB,cpu").unwrap();
    let mut m = Model::new(Arc::clone(&src), inv.clone());
    let mut req = m.plan_request().unwrap();
    req.strategy = wp::Strategy::Autosplit;
    req.cache = Some(wp::CacheSpec::new(64, 1, CacheDType::F32));
    req.runtime = wp::RuntimeSpec {
        max_input_len: 8,
        max_attention_size: 8 * 64,
        max_dq_size: 1 << 12,
        low_mem: false,
    };
    let plan = wp::plan(&req).unwrap();
    let cache = load_planned(&mut m, &plan).unwrap();
    assert_eq!(m.layer_devices().unwrap(), ["virtual:0"]);
    m.set_compute(Compute::Exact);
    let ids = ids();
    let mut out = Vec::new();
    m.forward(&ids, Some(&cache), Logits::All, &mut out)
        .unwrap();
    let (_, want) = read_npy(&data().join("logits.npy"));
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(max_abs_diff(&out, &want) <= 4e-6 * scale);
    for id in &ids[..4] {
        m.forward(&[*id], Some(&cache), Logits::Last, &mut out)
            .unwrap();
    }
    let d = plan
        .devices()
        .iter()
        .find(|d| d.name == "virtual:0")
        .unwrap();
    let want = d.weights + d.kv + d.scratch;
    let peak = inv.get("virtual:0").unwrap().peak();
    eprintln!(
        "virtual:0: plan {want} B (weights {}, kv {}, scratch {}), peak {peak} B",
        d.weights, d.kv, d.scratch
    );
    assert!(d.weights > 0 && d.kv > 0 && d.scratch > 0);
    assert_eq!(peak, want);
}

/// EXL2 linears run on the host path; the backend op sequence refuses them by name, naming the
/// linear, instead of multiplying packed integers.
#[test]
fn exl2_through_the_backend_op_sequence_is_refused_by_name() {
    let (mut m, cache) = common::load_on(&exl2(), "cpu", "cpu", 16, CacheDType::F32);
    m.set_host_backend(true);
    let e = m
        .forward(&[1, 2, 3], Some(&cache), Logits::Last, &mut Vec::new())
        .unwrap_err();
    assert!(matches!(e, EngineError::Unsupported { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("EXL2 linear 'model.layers.0.self_attn.q_proj' computed on cpu")
            && msg.contains("host path"),
        "{msg}"
    );
}

/// Bytes of the tensors an EXL2 layer's packed products read (`q_weight`, `q_scale`,
/// `q_scale_max`), from the checkpoint's byte ranges: what an onload slot holds of layer `l`.
fn packed_layer_bytes(src: &Arc<dyn Source>, l: u32) -> u64 {
    common::packed_layer_bytes(src, l, |q| {
        let LinearScheme::Exl2(e) = q.scheme() else {
            panic!("{}: not EXL2", q.prefix())
        };
        [e.q_weight(), e.q_scale(), e.q_scale_max()].map(str::to_owned)
    })
}

/// The fixture with its layer stored twice (layers 0 and 1, the same tensors), so offloaded
/// groups can outnumber the slots; the folder it was written to.
fn two_layers() -> tempfile::TempDir {
    use safetensors::SafeTensors;
    let folder =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../weightlift-format/tests/data/exl2");
    let bytes = std::fs::read(folder.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut views = Vec::new();
    for (name, view) in st.tensors() {
        if let Some(rest) = name.strip_prefix("model.layers.0.") {
            views.push((format!("model.layers.1.{rest}"), view.clone()));
        }
        views.push((name, view));
    }
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(folder.join("config.json")).unwrap()).unwrap();
    config["num_hidden_layers"] = 2.into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

/// Offloaded execution (`offload="sequential" | "group"`, with and without prefetch), on the
/// fixture and on its two-layer copy: the layers kept on the cpu run on the virtual device from
/// their packed tensors copied into the onload slots (`q_scale_max`, 1-D, among them), and give
/// the all-on-cpu logits bit for bit (the fixture's cpu run is checked against transformers
/// above) in a two-chunk prompt and decode steps, in both compute modes. The slot is the
/// largest group's `q_weight` + `q_scale` + `q_scale_max` as the file stores them; with more
/// groups than slots every call copies each kept layer's again; the device's peak is the
/// plan's weights + kv + scratch (workspace and slots). The backend op sequence still refuses
/// an offloaded EXL2 linear by name.
#[test]
fn offloaded_exl2_equals_cpu_bit_for_bit_within_the_planned_memory() {
    let copy = two_layers();
    for (model, src) in [("fixture", exl2()), ("two layers", open(copy.path()))] {
        let (mut cpu, cpu_cache, _, _) = planned_layers(&src, "cpu", 0, None);
        for (ngl, mode) in (0..src.spec().unwrap().n_layers as i64)
            .flat_map(|ngl| OFFLOAD_MODES.iter().map(move |&m| (ngl, m)))
        {
            let what = format!("{model}, n_gpu_layers={ngl}, {mode:?}");
            let (mut m, cache) = check_packed_offload(
                &what,
                &src,
                (ngl, mode),
                (&mut cpu, &cpu_cache, &ids()),
                |l| packed_layer_bytes(&src, l),
            );
            m.set_host_backend(true);
            let e = m
                .forward(&[1, 2, 3], Some(&cache), Logits::Last, &mut Vec::new())
                .unwrap_err();
            assert!(matches!(e, EngineError::Unsupported { .. }), "{what}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains("EXL2 linear 'model.layers.0.self_attn.q_proj' computed on virtual:0")
                    && msg.contains("host path"),
                "{what}: {msg}"
            );
        }
    }
}

/// Tensor parallelism splits linears by their columns, and EXL2 packs across them: refused by
/// name, naming a tensor of a quantised linear.
#[test]
fn tensor_parallel_exl2_is_refused_by_name() {
    let src = exl2();
    let mut m = Model::new(
        Arc::clone(&src),
        Inventory::parse("virtual:2x8MiB,cpu").unwrap(),
    );
    let mut req = m.plan_request().unwrap();
    let opts = wp::PlanOptions {
        strategy: Some("tensor_parallel".into()),
        expect_cache: Some(wp::ExpectCache {
            tokens: 32,
            dtype: CacheDType::F32,
        }),
        ..wp::PlanOptions::default()
    };
    opts.apply(&mut req).unwrap();
    let e = match wp::plan(&req) {
        Err(e) => EngineError::from(e),
        Ok(plan) => match load_planned(&mut m, &plan) {
            Err(e) => e,
            Ok(cache) => m
                .forward(&[1, 2, 3], Some(&cache), Logits::Last, &mut Vec::new())
                .unwrap_err(),
        },
    };
    let msg = e.to_string();
    assert!(
        msg.contains("tensor-parallel forward pass over quantised linear '")
            && msg.contains("EXL2"),
        "{msg}"
    );
}

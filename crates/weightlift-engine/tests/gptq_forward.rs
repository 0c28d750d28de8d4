//! GPTQ checkpoints run: the format crate's fixtures (tiny llama and qwen2 models whose linears
//! auto-gptq 0.7.1 packed at 2, 3, 4 and 8 bits, with act-order, v1 and v2 zero points, one
//! group over all inputs, and a quantised lm_head) against transformers' float32 forward pass
//! over the weights gptqmodel 7.7.0's dequantiser reads back from the same files
//! (`tests/gen_gptq_logits.py` wrote `tests/data/gptq/*.npy`). EXL2 runs the same way
//! (`tests/exl2_forward.rs`).

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{
    OFFLOAD_MODES, argmax, check_packed_offload, forward_all, json_ids, max_abs_diff, open,
    planned_layers, read_npy,
};
use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::{CacheDType, EngineError, Source};
use weightlift_format::quantized::LinearScheme;
use weightlift_plan as wp;

const VARIANTS: [&str; 7] = [
    "g32",
    "act_order",
    "int8",
    "int3",
    "int2",
    "v2",
    "per_channel",
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../weightlift-format/tests/data")
}

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/gptq")
}

fn ids() -> Vec<u32> {
    json_ids(&data().join("meta.json"), "ids")
}

fn gptq(variant: &str) -> Arc<dyn Source> {
    open(
        fixtures()
            .join("gptq")
            .join(variant)
            .join("model.safetensors"),
    )
}

/// Every position's logits of the reference ids, on `devices` (everything on `device`).
fn run(src: &Arc<dyn Source>, devices: &str, device: &str, compute: Compute) -> Vec<f32> {
    let (mut m, cache) = common::load_on(src, devices, device, 32, CacheDType::F32);
    m.set_compute(compute);
    forward_all(&mut m, &cache, &ids())
}

/// The logits equal transformers' on gptqmodel's dequantised weights to f32 rounding: the
/// weights are the same numbers (checked bit for bit in the engine's unit tests), so what is
/// left is the order of f32 sums. The logits are below 0.6 (4.4 for `v2`), so the bound is
/// about 2⁻¹⁸ of them.
#[test]
fn gptq_logits_match_transformers_on_gptqmodels_dequantised_weights() {
    for variant in VARIANTS {
        let (shape, want) = read_npy(&data().join(format!("{variant}.npy")));
        let src = gptq(variant);
        for compute in [Compute::Exact, Compute::Fast] {
            let out = run(&src, "cpu", "cpu", compute);
            assert_eq!(out.len(), shape[0] * shape[1], "{variant}");
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = max_abs_diff(&out, &want);
            eprintln!(
                "{variant} ({}): max|Δ| {d:.3e}, max|logit| {scale:.3}",
                compute.name()
            );
            assert!(d <= 4e-6 * scale.max(1.0), "{variant}: max|Δ| {d}");
            for (i, (a, b)) in out.chunks(shape[1]).zip(want.chunks(shape[1])).enumerate() {
                assert_eq!(argmax(a), argmax(b), "{variant}: position {i}");
            }
        }
    }
}

/// A GPTQ model equals, bit for bit, the float32 checkpoint of its dequantised weights (the
/// format crate's `dequantize_linear`, which equals gptqmodel's): the forward pass multiplies
/// exactly those weights, chunk by chunk, with the float product.
#[test]
fn gptq_equals_its_dequantised_float32_checkpoint_bit_for_bit() {
    use safetensors::SafeTensors;
    use safetensors::tensor::{Dtype, TensorView};
    for variant in ["g32", "act_order", "v2"] {
        let folder = fixtures().join("gptq").join(variant);
        let ckpt = weightlift_format::Checkpoint::open(
            folder.join("model.safetensors"),
            weightlift_format::OpenOptions::default(),
        )
        .unwrap();
        let quant = ckpt.quantization().unwrap();
        let dense: Vec<(String, Vec<usize>, Vec<u8>)> = quant
            .linears()
            .iter()
            .map(|l| {
                let w = ckpt.dequantize_linear(l).unwrap();
                let shape = vec![l.out_features(), l.in_features()];
                (
                    format!("{}.weight", l.prefix()),
                    shape,
                    bytemuck::cast_slice(&w).to_vec(),
                )
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
            views.push((
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), data).unwrap(),
            ));
        }
        let dir = tempfile::tempdir().unwrap();
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(folder.join("config.json")).unwrap()).unwrap();
        config
            .as_object_mut()
            .unwrap()
            .remove("quantization_config");
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        let float = open(dir.path());
        assert!(
            float.checkpoint().unwrap().quantization().is_none(),
            "{variant}: the float copy still reads as GPTQ"
        );
        for compute in [Compute::Exact, Compute::Fast] {
            let q = run(&gptq(variant), "cpu", "cpu", compute);
            let f = run(&float, "cpu", "cpu", compute);
            assert_eq!(
                q.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                f.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{variant} ({})",
                compute.name()
            );
        }
    }
}

/// Placement never changes results: a GPTQ model whose packed tensors live on a virtual device
/// gives the cpu run's logits bit for bit, and decoding token by token after a prompt gives
/// the prompt pass's last row to f32 rounding.
#[test]
fn gptq_on_a_virtual_device_equals_cpu_and_decode_follows_the_prompt() {
    let src = gptq("act_order");
    let cpu = run(&src, "cpu", "cpu", Compute::Exact);
    let virt = run(&src, "virtual:64MiB,cpu", "virtual:0", Compute::Exact);
    assert_eq!(
        cpu.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        virt.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    let (mut m, cache) = common::load_on(&src, "cpu", "cpu", 32, CacheDType::F32);
    m.set_compute(Compute::Exact);
    let ids = ids();
    let mut out = Vec::new();
    m.forward(&ids[..1], Some(&cache), Logits::Last, &mut out)
        .unwrap();
    for id in &ids[1..] {
        m.forward(&[*id], Some(&cache), Logits::Last, &mut out)
            .unwrap();
    }
    let vocab = out.len();
    let last = &cpu[cpu.len() - vocab..];
    let d = max_abs_diff(&out, last);
    assert!(d <= 1e-6, "decode vs prompt: max|Δ| {d}");
}

/// GPTQ linears run on the host path; the backend op sequence refuses them by name, naming
/// the linear, instead of multiplying packed integers.
#[test]
fn gptq_through_the_backend_op_sequence_is_refused_by_name() {
    let src = gptq("g32");
    let (mut m, cache) = common::load_on(&src, "cpu", "cpu", 16, CacheDType::F32);
    m.set_host_backend(true);
    let e = m
        .forward(&[1, 2, 3], Some(&cache), Logits::Last, &mut Vec::new())
        .unwrap_err();
    assert!(matches!(e, EngineError::Unsupported { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("GPTQ linear 'model.layers.0.self_attn.q_proj'") && msg.contains("host path"),
        "{msg}"
    );
}

/// Bytes of the tensors a GPTQ layer's packed products read (`qweight`, `qzeros`, `scales`),
/// from the checkpoint's byte ranges: what an onload slot holds of layer `l`.
fn packed_layer_bytes(src: &Arc<dyn Source>, l: u32) -> u64 {
    common::packed_layer_bytes(src, l, |q| {
        let LinearScheme::Gptq(g) = q.scheme() else {
            panic!("{}: not GPTQ", q.prefix())
        };
        [g.qweight(), g.qzeros(), g.scales()].map(str::to_owned)
    })
}

/// Offloaded execution (`offload="sequential" | "group"`, with and without prefetch): the
/// layers kept on the cpu run on the virtual device from their packed tensors copied into the
/// onload slots, and give the all-on-cpu logits bit for bit (the cpu run is checked against
/// transformers above), in a two-chunk prompt and decode steps, in both compute modes. The
/// slot is the largest group's `qweight` + `qzeros` + `scales` as the file stores them; with
/// more groups than slots every call copies each kept layer's again; the device's peak is the
/// plan's weights + kv + scratch (workspace and slots).
#[test]
fn offloaded_gptq_equals_cpu_bit_for_bit_within_the_planned_memory() {
    use wp::WeightOffload::Sequential;
    let modes = OFFLOAD_MODES;
    // g32 has two layers: both kept, or layer 0 kept and layer 1 on the device; the other
    // fixtures have one, kept.
    let mut cases: Vec<(&str, i64, wp::WeightOffload)> = Vec::new();
    for ngl in [0, 1] {
        cases.extend(modes.iter().map(|&m| ("g32", ngl, m)));
    }
    for variant in VARIANTS.iter().filter(|&&v| v != "g32") {
        cases.extend([(*variant, 0, Sequential), (*variant, 0, modes[1])]);
    }
    for (variant, ngl, mode) in cases {
        let src = gptq(variant);
        let what = format!("{variant}, n_gpu_layers={ngl}, {mode:?}");
        let (mut cpu, cpu_cache, _, _) = planned_layers(&src, "cpu", 0, None);
        check_packed_offload(
            &what,
            &src,
            (ngl, mode),
            (&mut cpu, &cpu_cache, &ids()),
            |l| packed_layer_bytes(&src, l),
        );
    }
}

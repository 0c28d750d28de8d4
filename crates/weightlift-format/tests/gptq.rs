//! GPTQ checkpoints against references nobody here wrote: the fixtures in `data/gptq/` were
//! packed by auto-gptq 0.7.1 (`QuantLinear.pack`) from known integer codes, and each
//! `expected.json` holds what gptqmodel 7.7.0's dequantiser (`convert_gptq_file`) reads back
//! from the saved file (see `gen_gptq.py`, run with
//! `.cache/qwen2-venv/bin/python crates/weightlift-format/tests/gen_gptq.py`).

use crate::quant_util;
use crate::st_util;

use quant_util::{
    Raw, assert_has, check_blocks, check_sizes, check_weights, expected, fixture, i32_le,
    i32_values, open, open_err, tampered,
};
use safetensors::tensor::Dtype;
use st_util::Scratch;
use weightlift_format::quantized::{GptqFormat, LinearScheme, QuantConfig};
use weightlift_format::{FormatError, Role};

const VARIANTS: [&str; 7] = [
    "g32",
    "act_order",
    "int8",
    "int3",
    "int2",
    "v2",
    "per_channel",
];

fn dir(variant: &str) -> std::path::PathBuf {
    fixture(&format!("gptq/{variant}"))
}

#[test]
fn settings_are_read_from_either_file() {
    // (variant, bits, group size, desc_act, sym, format, settings file)
    let cases = [
        (
            "g32",
            4,
            Some(32),
            false,
            false,
            GptqFormat::V1,
            "config.json",
        ),
        (
            "act_order",
            4,
            Some(32),
            true,
            true,
            GptqFormat::V1,
            "quantize_config.json",
        ),
        (
            "int8",
            8,
            Some(64),
            false,
            false,
            GptqFormat::V1,
            "config.json",
        ),
        (
            "int3",
            3,
            Some(32),
            true,
            false,
            GptqFormat::V1,
            "config.json",
        ),
        (
            "int2",
            2,
            Some(32),
            false,
            false,
            GptqFormat::V1,
            "config.json",
        ),
        (
            "v2",
            4,
            Some(32),
            false,
            false,
            GptqFormat::V2,
            "config.json",
        ),
        (
            "per_channel",
            4,
            None,
            false,
            false,
            GptqFormat::V1,
            "config.json",
        ),
    ];
    for (variant, bits, group, desc_act, sym, format, file) in cases {
        let ckpt = open(&dir(variant));
        let q = ckpt.quantization().expect("GPTQ settings");
        assert_eq!(q.method(), "gptq");
        assert!(
            q.source().ends_with(file),
            "{variant}: {}",
            q.source().display()
        );
        let QuantConfig::Gptq(c) = q.config() else {
            panic!("{variant}: not GPTQ")
        };
        assert_eq!(
            (c.bits, c.group_size, c.desc_act, c.sym, c.format),
            (bits, group, desc_act, sym, format),
            "{variant}"
        );
        assert!(
            ckpt.warnings().is_empty(),
            "{variant}: {:?}",
            ckpt.warnings()
        );
        assert_eq!(ckpt.unknown_tensors().count(), 0, "{variant}");
    }
}

#[test]
fn linears_have_the_shapes_and_groups_of_the_reference() {
    for variant in VARIANTS {
        let d = dir(variant);
        let ckpt = open(&d);
        let exp = expected(&d);
        let q = ckpt.quantization().unwrap();
        for (prefix, e) in exp["linears"].as_object().unwrap() {
            let lin = q.linear(prefix).unwrap();
            assert_eq!(lin.in_features() as u64, e["in_features"].as_u64().unwrap());
            assert_eq!(
                lin.out_features() as u64,
                e["out_features"].as_u64().unwrap()
            );
            let LinearScheme::Gptq(g) = lin.scheme() else {
                panic!("{prefix}: not GPTQ")
            };
            assert_eq!(
                g.n_groups() as u64,
                e["n_groups"].as_u64().unwrap(),
                "{prefix}"
            );
            assert_eq!(
                g.act_order(),
                matches!(variant, "act_order" | "int3"),
                "{prefix}"
            );
            assert_eq!(g.g_idx().is_some(), variant != "per_channel", "{prefix}");
            for name in lin.tensor_names() {
                assert_eq!(
                    q.linear_of_tensor(name).map(|l| l.prefix()),
                    Some(prefix.as_str())
                );
            }
        }
    }
}

#[test]
fn dequantised_weights_match_gptqmodel() {
    for variant in VARIANTS {
        check_weights(&dir(variant));
    }
}

#[test]
fn blocks_of_rows_and_columns_match_the_whole_weight() {
    for variant in ["g32", "act_order", "int3"] {
        check_blocks(&dir(variant));
    }
}

#[test]
fn sizes_are_the_stored_byte_ranges() {
    for variant in VARIANTS {
        check_sizes(&dir(variant));
    }
}

#[test]
fn quantised_tensors_sit_in_their_layer_with_their_weights_role() {
    let ckpt = open(&dir("g32"));
    let t = ckpt.tensor("model.layers.1.mlp.down_proj.qzeros").unwrap();
    assert_eq!((t.layer, t.role), (Some(1), Some(Role::FfnDown)));
    let lin = ckpt
        .quantization()
        .unwrap()
        .linear("model.layers.1.self_attn.k_proj")
        .unwrap();
    assert_eq!((lin.layer(), lin.role()), (Some(1), Some(Role::AttnK)));

    // A quantised lm_head is the output projection: the model is not tied.
    let ckpt = open(&dir("v2"));
    assert_eq!(
        ckpt.tensor("lm_head.qweight").unwrap().role,
        Some(Role::Output)
    );
    assert!(!ckpt.spec().unwrap().tie_word_embeddings);

    // qwen2's q/k/v biases belong to their linears and stay float vectors.
    let ckpt = open(&dir("act_order"));
    let lin = ckpt
        .quantization()
        .unwrap()
        .linear("model.layers.0.self_attn.v_proj")
        .unwrap();
    assert_eq!(lin.bias(), Some("model.layers.0.self_attn.v_proj.bias"));
    assert!(ckpt.spec().unwrap().attention_bias);
}

#[test]
fn requests_outside_the_linear_are_typed_errors() {
    let ckpt = open(&dir("g32"));
    let lin = ckpt
        .quantization()
        .unwrap()
        .linear("model.layers.0.self_attn.k_proj")
        .unwrap();
    let mut out = vec![0f32; 64];
    let e = ckpt
        .dequantize_linear_into(lin, 30..34, 0..16, &mut out)
        .unwrap_err();
    assert!(matches!(e, FormatError::Request { .. }), "{e:?}");
    assert_has(
        &e.to_string(),
        &[
            "rows of quantised linear 'model.layers.0.self_attn.k_proj'",
            "0..32",
            "30..34",
        ],
    );
    let e = ckpt
        .dequantize_linear_into(lin, 0..4, 60..65, &mut out)
        .unwrap_err()
        .to_string();
    assert_has(&e, &["columns", "0..64", "60..65"]);
    let e = ckpt
        .dequantize_linear_into(lin, 0..4, 0..15, &mut out)
        .unwrap_err()
        .to_string();
    assert_has(&e, &["output buffer", "4 rows x 15 columns", "64 elements"]);
}

// ---------------------------------------------------------------------------------------------
// Hostile and contradictory files

const Q: &str = "model.layers.0.self_attn.q_proj";

fn tamper(
    variant: &str,
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, Raw>),
    edit_config: impl FnOnce(&mut serde_json::Value),
) -> (Scratch, std::path::PathBuf) {
    let s = Scratch::new("gptq");
    let p = tampered(&s, &dir(variant), edit, edit_config);
    (s, p)
}

#[test]
fn wrong_qweight_shape() {
    let (_s, p) = tamper(
        "g32",
        |t| {
            let q = t.get_mut(&format!("{Q}.qweight")).unwrap();
            q.shape = vec![4, 64];
            q.data.truncate(4 * 64 * 4);
        },
        |_| {},
    );
    let e = open_err(&p);
    assert_has(
        &e,
        &[
            "tensor 'model.layers.0.self_attn.q_proj.qweight'",
            "expected shape [8, 64] (64 inputs at 4 bits)",
            "got [4, 64]",
        ],
    );
}

#[test]
fn g_idx_out_of_range() {
    let (_s, p) = tamper(
        "act_order",
        |t| {
            let g = t.get_mut(&format!("{Q}.g_idx")).unwrap();
            let mut v = i32_values(&g.data);
            v[17] = 2;
            g.data = i32_le(&v);
        },
        |_| {},
    );
    assert_has(
        &open_err(&p),
        &[
            "tensor 'model.layers.0.self_attn.q_proj.g_idx'",
            "group numbers in 0..2",
            "got 2 at input 17",
        ],
    );
}

#[test]
fn five_bits_is_unsupported() {
    let (_s, p) = tamper(
        "g32",
        |_| {},
        |c| c["quantization_config"]["bits"] = 5.into(),
    );
    let e = open_err(&p);
    assert_has(
        &e,
        &[
            "config.json: GPTQ bits 5 is not supported",
            "gptq_p",
            "2, 3, 4 and 8",
        ],
    );
    // The error is an Unsupported, not a corrupt file.
    let err = weightlift_format::Checkpoint::open(&p, Default::default()).unwrap_err();
    assert!(matches!(err, FormatError::Unsupported { .. }), "{err:?}");
}

#[test]
fn missing_scales() {
    let (_s, p) = tamper("g32", |t| drop(t.remove(&format!("{Q}.scales"))), |_| {});
    assert_has(
        &open_err(&p),
        &[
            "tensor 'model.layers.0.self_attn.q_proj.scales'",
            "expected the scales of quantised linear 'model.layers.0.self_attn.q_proj'",
            "got no such tensor",
        ],
    );
}

#[test]
fn missing_g_idx_under_act_order() {
    let (_s, p) = tamper("int3", |t| drop(t.remove(&format!("{Q}.g_idx"))), |_| {});
    assert_has(
        &open_err(&p),
        &[
            "'model.layers.0.self_attn.q_proj.g_idx'",
            "desc_act is true",
        ],
    );
}

#[test]
fn group_size_that_contradicts_the_scales() {
    let (_s, p) = tamper(
        "g32",
        |_| {},
        |c| c["quantization_config"]["group_size"] = 64.into(),
    );
    assert_has(
        &open_err(&p),
        &[
            "tensor 'model.layers.0.mlp.down_proj.scales'",
            "expected shape [2, 64] (64 inputs per group, 2 in all)",
            "got [4, 64]",
        ],
    );
}

#[test]
fn architecture_that_contradicts_the_tensors() {
    let (_s, p) = tamper("int2", |_| {}, |c| c["intermediate_size"] = 96.into());
    assert_has(
        &open_err(&p),
        &[
            "tensor 'model.layers.0.mlp.down_proj.qweight'",
            "expected 96 inputs and 64 outputs, as config.json's architecture gives this projection",
            "got 64 inputs and 64 outputs at 2 bits",
        ],
    );
}

#[test]
fn scales_of_the_wrong_dtype() {
    let (_s, p) = tamper(
        "int8",
        |t| {
            let s = t.get_mut(&format!("{Q}.scales")).unwrap();
            s.dtype = Dtype::I16;
        },
        |_| {},
    );
    assert_has(
        &open_err(&p),
        &["scales'", "expected dtype F16 or BF16 or F32", "got I16"],
    );
}

#[test]
fn a_part_without_its_qweight() {
    let (_s, p) = tamper("g32", |t| drop(t.remove(&format!("{Q}.qweight"))), |_| {});
    assert_has(
        &open_err(&p),
        &[
            "model.layers.0.self_attn.q_proj.",
            "expected 'model.layers.0.self_attn.q_proj.qweight' beside this",
        ],
    );
}

#[test]
fn quantised_tensors_without_settings() {
    let (_s, p) = tamper(
        "g32",
        |_| {},
        |c| drop(c.as_object_mut().unwrap().remove("quantization_config")),
    );
    assert_has(
        &open_err(&p),
        &[
            "quantised tensor '",
            ".qweight'",
            "a quantization_config in config.json, or a quantize_config.json",
            "got neither",
        ],
    );
}

#[test]
fn settings_without_quantised_tensors() {
    let (_s, p) = tamper("g32", |t| t.retain(|n, _| !n.contains("_proj.")), |_| {});
    assert_has(
        &open_err(&p),
        &[
            "quantisation config",
            "GPTQ tensors (names ending in .qweight)",
            "none in the checkpoint",
        ],
    );
}

#[test]
fn two_settings_files_that_disagree() {
    let (s, p) = tamper(
        "act_order",
        |_| {},
        |c| {
            c["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": true});
        },
    );
    let e = open_err(&p);
    assert_has(
        &e,
        &["quantize_config.json: quantisation settings", "bits: 8"],
    );
    drop(s);
}

#[test]
fn dense_weight_beside_a_quantised_one() {
    let (_s, p) = tamper(
        "int2",
        |t| {
            let norm = t["model.norm.weight"].data.clone();
            t.insert(
                format!("{Q}.weight"),
                Raw {
                    dtype: Dtype::F16,
                    shape: vec![64],
                    data: norm,
                },
            );
        },
        |_| {},
    );
    assert_has(
        &open_err(&p),
        &[
            "tensor 'model.layers.0.self_attn.q_proj.weight'",
            "no dense weight beside",
        ],
    );
}

#[test]
fn other_methods_open_with_a_warning() {
    let (_s, p) = tamper(
        "int2",
        |_| {},
        |c| c["quantization_config"]["quant_method"] = "awq".into(),
    );
    let ckpt = open(&p);
    assert!(ckpt.quantization().is_none());
    assert!(
        ckpt.warnings()
            .iter()
            .any(|w| w.contains("quantisation method 'awq' is not read")),
        "{:?}",
        ckpt.warnings()
    );
}

#[test]
fn vocab_only_reads_the_settings_without_linears() {
    let ckpt = weightlift_format::Checkpoint::open(
        dir("g32"),
        weightlift_format::OpenOptions {
            vocab_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    let q = ckpt.quantization().unwrap();
    assert_eq!(q.method(), "gptq");
    assert!(q.linears().is_empty());
}

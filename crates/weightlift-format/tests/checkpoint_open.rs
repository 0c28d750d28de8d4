//! `Checkpoint::open` end to end: format detection, roles and their warnings, spec failures
//! that still open, `check_tensors`, `dequantize` and `raw_bytes`.

use crate::st_util;

use st_util::{Scratch, open_err, st_f32, st_raw};
use weightlift_format::{Checkpoint, DType, FormatError, OpenOptions, Role};

fn llama_config(model_type: &str) -> String {
    format!(
        r#"{{"model_type": "{model_type}", "num_hidden_layers": 1, "hidden_size": 2,
            "intermediate_size": 4, "num_attention_heads": 1, "vocab_size": 4,
            "max_position_embeddings": 16, "rms_norm_eps": 1e-6}}"#
    )
}

fn tiny_model(s: &Scratch, extra: &[(&str, Vec<usize>, Vec<f32>)]) {
    let mut t: Vec<(&str, Vec<usize>, Vec<f32>)> = vec![
        ("model.embed_tokens.weight", vec![4, 2], vec![0.25; 8]),
        (
            "model.layers.0.input_layernorm.weight",
            vec![2],
            vec![1.0, 2.0],
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            vec![2, 2],
            vec![0.5; 4],
        ),
        ("model.norm.weight", vec![2], vec![3.0, 4.0]),
    ];
    t.extend(extra.iter().cloned());
    s.write("model.safetensors", st_f32(&t, None));
}

#[test]
fn detection_by_magic_and_extension() {
    let s = Scratch::new("detect");
    let zip = s.write("model.bin", b"PK\x03\x04rest of a zip");
    let msg = open_err(&zip);
    assert!(
        msg.contains("got 50 4b 03 04 ('PK..')")
            && msg.contains("47 47 55 46 ('GGUF')")
            && msg.contains("pickle"),
        "{msg}"
    );

    let bad = s.write("model.gguf", b"GGML\x03\0\0\0");
    let msg = open_err(&bad);
    assert!(
        msg.contains(
            "magic: expected the GGUF magic 47 47 55 46 ('GGUF'), got 47 47 4d 4c ('GGML')"
        ),
        "{msg}"
    );
    // Bytes that are not text: hex, the printable ones beside, never a Rust escape.
    let binary = s.write("binary.gguf", b"\x18\x00\xaf\x3c\0\0\0\0");
    let msg = open_err(&binary);
    assert!(
        msg.contains("got 18 00 af 3c ('...<')") && !msg.contains("\\u{"),
        "{msg}"
    );

    let empty = s.write("empty.gguf", b"");
    assert!(open_err(&empty).contains("a 0-byte file"));

    // The byte-swapped magic goes to the GGUF reader, which explains the byte order.
    let mut be = b"FUGG".to_vec();
    be.extend_from_slice(&3u32.to_be_bytes());
    be.extend_from_slice(&[0; 16]);
    let be = s.write("be.gguf", &be);
    let msg = open_err(&be);
    assert!(msg.contains("big-endian"), "{msg}");

    // A safetensors file under another name is recognised by its header.
    let st = s.write("weights.bin", st_f32(&[("x", vec![1], vec![1.0])], None));
    let c = Checkpoint::open(&st, OpenOptions::default()).unwrap();
    assert_eq!(c.tensors()[0].name, "x");

    let missing = s.path().join("nope.gguf");
    let e = Checkpoint::open(&missing, OpenOptions::default()).unwrap_err();
    assert!(matches!(e, FormatError::Io { .. }), "{e:?}");
    assert!(e.to_string().contains("nope.gguf"));
}

#[test]
fn llama_roles_and_unknown_tensors() {
    let s = Scratch::new("roles");
    tiny_model(
        &s,
        &[("model.layers.0.mlp.mystery.weight", vec![2], vec![0.0; 2])],
    );
    s.write("config.json", llama_config("llama"));
    let c = Checkpoint::open(s.path(), OpenOptions::default()).unwrap();
    let spec = c.spec().unwrap();
    assert_eq!(spec.n_layers, 1);
    // No lm_head.weight: tied, whatever the config says (LlamaConfig defaults to untied).
    assert!(spec.tie_word_embeddings);
    let unknown: Vec<_> = c.unknown_tensors().map(|t| t.name.as_str()).collect();
    assert_eq!(unknown, ["model.layers.0.mlp.mystery.weight"]);
    assert_eq!(
        c.tensor("model.layers.0.mlp.mystery.weight").unwrap().layer,
        Some(0)
    );
    assert!(
        c.warnings()
            .iter()
            .any(|w| w.contains("1 tensor(s) match no known role")),
        "{:?}",
        c.warnings()
    );
    assert!(
        c.warnings().iter().any(|w| w.contains("no lm_head.weight")),
        "{:?}",
        c.warnings()
    );
    assert_eq!(
        c.tensor("model.norm.weight").unwrap().role,
        Some(Role::OutputNorm)
    );
}

#[test]
fn qwen2_biases_and_untied_head() {
    let s = Scratch::new("qwen2");
    tiny_model(
        &s,
        &[
            (
                "model.layers.0.self_attn.q_proj.bias",
                vec![2],
                vec![0.1, 0.2],
            ),
            ("lm_head.weight", vec![4, 2], vec![0.5; 8]),
        ],
    );
    s.write("config.json", llama_config("qwen2"));
    let c = Checkpoint::open(s.path(), OpenOptions::default()).unwrap();
    let spec = c.spec().unwrap();
    assert!(spec.attention_bias);
    assert!(!spec.tie_word_embeddings);
    assert!(c.warnings().is_empty(), "{:?}", c.warnings());
    let b = c.tensor("model.layers.0.self_attn.q_proj.bias").unwrap();
    assert_eq!((b.layer, b.role), (Some(0), Some(Role::AttnQBias)));
    assert_eq!(c.tensor("lm_head.weight").unwrap().role, Some(Role::Output));
}

#[test]
fn unsupported_architecture_still_opens() {
    let s = Scratch::new("gpt2");
    tiny_model(&s, &[]);
    s.write("config.json", llama_config("gpt2"));
    let c = Checkpoint::open(s.path(), OpenOptions::default()).unwrap();
    assert_eq!(c.spec().unwrap().architecture, "gpt2");
    // No lm_head.weight: the head is tied whatever the architecture, and the config that
    // said otherwise is named.
    assert_eq!(
        c.warnings(),
        [
            "unsupported architecture 'gpt2' for tensor roles (supported: llama, mistral, qwen2, \
             qwen3, phi3, gemma2, gemma3, gemma3_text, qwen3moe, qwen3_moe, mixtral)",
            "config.json says tie_word_embeddings is false, but there is no lm_head.weight; the \
             output will reuse the embedding"
        ]
    );
    assert!(c.spec().unwrap().tie_word_embeddings);
    assert!(!c.roles_known());
    let q = c.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!((q.layer, q.role), (Some(0), None));
    assert_eq!(c.unknown_tensors().count(), 0);
}

#[test]
fn broken_config_keeps_inspect_working() {
    let s = Scratch::new("badspec");
    tiny_model(&s, &[]);
    s.write(
        "config.json",
        r#"{"model_type": "llama", "num_hidden_layers": 1}"#,
    );
    let c = Checkpoint::open(s.path(), OpenOptions::default()).unwrap();
    assert_eq!(
        c.spec().unwrap_err(),
        "config.json: model spec: hidden_size: missing from config.json"
    );
    // Roles still come from model_type.
    assert_eq!(
        c.tensor("model.norm.weight").unwrap().role,
        Some(Role::OutputNorm)
    );
    s.write(
        "config.json",
        r#"{"model_type": "llama", "num_hidden_layers": "two"}"#,
    );
    let c = Checkpoint::open(s.path(), OpenOptions::default()).unwrap();
    assert!(
        c.spec()
            .unwrap_err()
            .contains("num_hidden_layers: expected a non-negative integer, got the string \"two\"")
    );
}

#[test]
fn the_view_holds_what_the_bindings_show() {
    let s = Scratch::new("view");
    tiny_model(&s, &[]);
    s.write("config.json", llama_config("llama"));
    let c = Checkpoint::open(s.path(), OpenOptions::default()).unwrap();
    let v = serde_json::to_value(c.view()).unwrap();
    let file = c.files().next().unwrap().display().to_string();
    assert_eq!(v["files"], serde_json::json!([file]));
    assert_eq!(v["spec"]["n_layers"], 1);
    assert!(v["spec_error"].is_null(), "{v}");
    assert_eq!(v["config"]["model_type"], "llama");
    assert_eq!(v["tokenizer"]["has_tokenizer_json"], false);
    assert_eq!(v["warnings"], serde_json::json!(c.warnings()));
    assert_eq!(
        (v["n_params"].as_u64(), v["nbytes"].as_u64()),
        (Some(16), Some(64))
    );
    assert_eq!(v["n_tensors"], 4);
    assert!(
        v.get("metadata").is_none() && v.get("tensors").is_none(),
        "{v}"
    );

    s.write("config.json", r#"{"model_type": "llama"}"#);
    let c = Checkpoint::open(s.path(), OpenOptions::default()).unwrap();
    let v = serde_json::to_value(c.view()).unwrap();
    assert!(v["spec"].is_null(), "{v}");
    assert_eq!(v["spec_error"], c.spec().unwrap_err());
}

#[test]
fn check_tensors_reports_first_bad_tensor_in_file_order() {
    let s = Scratch::new("scan");
    let mut bad = vec![1.0f32; 10];
    bad[5] = f32::NAN;
    let mut worse = vec![1.0f32; 10];
    worse[0] = f32::INFINITY;
    // The official writer lays tensors out by dtype, then name; file order is checked below.
    s.write(
        "model.safetensors",
        st_f32(
            &[
                ("a_fine", vec![10], vec![0.0; 10]),
                ("b_nan", vec![10], bad),
                ("c_inf", vec![10], worse),
            ],
            None,
        ),
    );
    let plain = Checkpoint::open(s.path(), OpenOptions::default()).unwrap();
    let order: Vec<_> = plain.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(order, ["a_fine", "b_nan", "c_inf"]);
    let opts = OpenOptions {
        check_tensors: true,
        ..OpenOptions::default()
    };
    let e = Checkpoint::open(s.path(), opts).unwrap_err();
    match &e {
        FormatError::NonFinite {
            tensor,
            index,
            kind,
            ..
        } => {
            assert_eq!((tensor.as_str(), *index, *kind), ("b_nan", 5, "nan"));
        }
        other => panic!("{other:?}"),
    }
    assert!(
        e.to_string()
            .contains("tensor 'b_nan' has a non-finite value (nan) at element 5"),
        "{e}"
    );
}

#[test]
fn check_tensors_passes_on_real_files() {
    let r = weightlift_testdata::reference().join("tiny-llama");
    let opts = OpenOptions {
        check_tensors: true,
        ..OpenOptions::default()
    };
    for p in [
        r.join("safetensors-sharded"),
        r.join("gguf/tiny-llama-Q4_K_M.gguf"),
    ] {
        Checkpoint::open(&p, opts).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn dequantize_and_raw_bytes() {
    let s = Scratch::new("deq");
    let vals: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
    // A BF16 tensor whose f32 values are those of `half` (not our code) converting the bits.
    let bf: Vec<half::bf16> = vals
        .iter()
        .map(|&v| half::bf16::from_f32(v * 3.1))
        .collect();
    let bf_bytes: Vec<u8> = bf.iter().flat_map(|b| b.to_le_bytes()).collect();
    let header = r#"{"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"f":{"dtype":"F32","shape":[6],"data_offsets":[12,36]},"u":{"dtype":"U8","shape":[2],"data_offsets":[36,38]}}"#;
    let mut data = bf_bytes.clone();
    data.extend(st_util::f32_bytes(&vals));
    data.extend([7u8, 9]);
    let p = s.write("m.safetensors", st_raw(header, &data));
    let c = Checkpoint::open(&p, OpenOptions::default()).unwrap();

    assert_eq!(c.dequantize("f").unwrap(), vals);
    let want: Vec<f32> = bf.iter().map(|b| b.to_f32()).collect();
    assert_eq!(c.dequantize("w").unwrap(), want);
    assert_eq!(c.raw_bytes("w").unwrap(), bf_bytes.as_slice());
    assert_eq!(c.raw_bytes("u").unwrap(), &[7, 9]);
    assert_eq!(c.tensor("u").unwrap().dtype, DType::U8);

    let e = c.dequantize("u").unwrap_err();
    assert!(matches!(e, FormatError::Dequantize { .. }), "{e:?}");
    assert!(
        e.to_string().contains("cannot dequantize tensor 'u'"),
        "{e}"
    );
    let e = c.dequantize("nope").unwrap_err();
    assert!(matches!(e, FormatError::NoSuchTensor { .. }), "{e:?}");
    assert!(
        c.raw_bytes("nope")
            .unwrap_err()
            .to_string()
            .contains("no tensor named 'nope'")
    );
}

//! EXL2 checkpoints against exllamav2's own packing: the fixture in `data/exl2/` was written by
//! exllamav2 0.3.2's `AdaptiveGPTQ.pack`, with the CUDA packing kernels it calls compiled for the
//! host, from known integer codes of every width (8, 6, 5, 4, 3 and 2 bits); `expected.json`
//! holds the weights exllamav2's arithmetic gives (see `gen_exl2.py`, run with
//! `.cache/qwen2-venv/bin/python crates/weightlift-format/tests/gen_exl2.py`).

use crate::quant_util;
use crate::st_util;

use quant_util::{
    Raw, assert_has, check_blocks, check_sizes, check_weights, expected, fixture, i32_le,
    i32_values, open, open_err, tampered,
};
use safetensors::tensor::Dtype;
use st_util::Scratch;
use weightlift_format::Role;
use weightlift_format::quantized::{LinearScheme, QuantConfig};

fn dir() -> std::path::PathBuf {
    fixture("exl2")
}

#[test]
fn settings_and_groups_are_read() {
    let d = dir();
    let ckpt = open(&d);
    let q = ckpt.quantization().expect("EXL2 settings");
    assert_eq!(q.method(), "exl2");
    let QuantConfig::Exl2(c) = q.config() else {
        panic!("not EXL2")
    };
    assert_eq!(
        (c.bits, c.head_bits, c.version.as_deref()),
        (Some(4.6), Some(8), Some("0.3.2"))
    );
    assert!(ckpt.warnings().is_empty(), "{:?}", ckpt.warnings());
    assert_eq!(ckpt.unknown_tensors().count(), 0);

    let exp = expected(&d);
    let linears = exp["linears"].as_object().unwrap();
    assert_eq!(q.linears().len(), linears.len());
    for (prefix, e) in linears {
        let lin = q.linear(prefix).unwrap();
        assert_eq!(lin.in_features() as u64, e["in_features"].as_u64().unwrap());
        assert_eq!(
            lin.out_features() as u64,
            e["out_features"].as_u64().unwrap()
        );
        let LinearScheme::Exl2(x) = lin.scheme() else {
            panic!("{prefix}: not EXL2")
        };
        let groups: Vec<(u64, u64)> = x
            .groups()
            .iter()
            .map(|g| (g.bits.into(), g.rows as u64))
            .collect();
        let want: Vec<(u64, u64)> = e["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| (g[0].as_u64().unwrap(), g[1].as_u64().unwrap()))
            .collect();
        assert_eq!(groups, want, "{prefix}");
    }
    // The 48-output head is stored padded to 64 columns.
    let head = q.linear("lm_head").unwrap();
    let LinearScheme::Exl2(x) = head.scheme() else {
        panic!()
    };
    assert_eq!((head.out_features(), x.stored_columns()), (48, 64));
    assert_eq!(head.role(), Some(Role::Output));
    assert!(!ckpt.spec().unwrap().tie_word_embeddings);
    let v = q.linear("model.layers.0.self_attn.v_proj").unwrap();
    assert_eq!((v.layer(), v.role()), (Some(0), Some(Role::AttnV)));
    assert_eq!(v.bias(), Some("model.layers.0.self_attn.v_proj.bias"));
}

#[test]
fn dequantised_weights_match_exllamav2() {
    check_weights(&dir());
}

#[test]
fn blocks_of_rows_and_columns_match_the_whole_weight() {
    check_blocks(&dir());
}

#[test]
fn sizes_are_the_stored_byte_ranges() {
    check_sizes(&dir());
}

// ---------------------------------------------------------------------------------------------
// Hostile and contradictory files

const DOWN: &str = "model.layers.0.mlp.down_proj";

fn tamper(
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, Raw>),
) -> (Scratch, std::path::PathBuf) {
    let s = Scratch::new("exl2");
    let p = tampered(&s, &dir(), edit, |_| {});
    (s, p)
}

fn edit_groups(t: &mut std::collections::BTreeMap<String, Raw>, f: impl FnOnce(&mut Vec<i16>)) {
    let g = t.get_mut(&format!("{DOWN}.q_groups")).unwrap();
    let mut v: Vec<i16> = g
        .data
        .chunks_exact(2)
        .map(|b| i16::from_le_bytes([b[0], b[1]]))
        .collect();
    f(&mut v);
    g.data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
}

#[test]
fn a_width_exllamav2_does_not_write() {
    // down_proj's groups: (8, 0), (6, 8), (4, 14), (2, 18).
    let (_s, p) = tamper(|t| edit_groups(t, |v| v[2] = 7));
    assert_has(
        &open_err(&p),
        &[
            "tensor 'model.layers.0.mlp.down_proj.q_groups'",
            "widths of 2, 3, 4, 5, 6 or 8 bits",
            "got 7 bits in group 1",
        ],
    );
}

#[test]
fn widths_out_of_order() {
    let (_s, p) = tamper(|t| edit_groups(t, |v| v[4] = 8));
    assert_has(
        &open_err(&p),
        &[
            "q_groups'",
            "descending order",
            "got 8 bits after 6 bits in group 2",
        ],
    );
}

#[test]
fn group_rows_that_do_not_add_up() {
    let (_s, p) = tamper(|t| edit_groups(t, |v| v[5] = 15));
    assert_has(
        &open_err(&p),
        &[
            "q_groups'",
            "a whole number of 6-bit inputs in its word rows",
            "got 7 word rows in group 1",
        ],
    );
}

#[test]
fn invperm_that_is_not_a_permutation() {
    let (_s, p) = tamper(|t| {
        let g = t.get_mut(&format!("{DOWN}.q_invperm")).unwrap();
        let mut v = i32_values(&g.data);
        v[9] = v[3];
        g.data = i32_le(&v);
    });
    assert_has(
        &open_err(&p),
        &[
            "tensor 'model.layers.0.mlp.down_proj.q_invperm'",
            "a permutation of 0..128",
            "at input 9 (out of range or repeated)",
        ],
    );
}

#[test]
fn q_perm_that_is_not_the_inverse() {
    let (_s, p) = tamper(|t| {
        let inv = i32_values(&t[&format!("{DOWN}.q_invperm")].data);
        let mut perm = vec![0i32; inv.len()];
        for (i, &r) in inv.iter().enumerate() {
            perm[r as usize] = i as i32;
        }
        perm.swap(0, 1);
        t.insert(
            format!("{DOWN}.q_perm"),
            Raw {
                dtype: Dtype::I32,
                shape: vec![perm.len()],
                data: i32_le(&perm),
            },
        );
    });
    assert_has(
        &open_err(&p),
        &["q_perm'", "the inverse of q_invperm", "at stored row 0"],
    );
}

#[test]
fn a_correct_q_perm_is_accepted() {
    let (_s, p) = tamper(|t| {
        let inv = i32_values(&t[&format!("{DOWN}.q_invperm")].data);
        let mut perm = vec![0i32; inv.len()];
        for (i, &r) in inv.iter().enumerate() {
            perm[r as usize] = i as i32;
        }
        t.insert(
            format!("{DOWN}.q_perm"),
            Raw {
                dtype: Dtype::I32,
                shape: vec![perm.len()],
                data: i32_le(&perm),
            },
        );
    });
    let ckpt = open(&p);
    let lin = ckpt.quantization().unwrap().linear(DOWN).unwrap();
    assert!(
        lin.tensor_names()
            .contains(&"model.layers.0.mlp.down_proj.q_perm")
    );
}

#[test]
fn scale_max_of_the_wrong_dtype() {
    let (_s, p) = tamper(|t| {
        let m = t.get_mut(&format!("{DOWN}.q_scale_max")).unwrap();
        m.dtype = Dtype::BF16;
    });
    assert_has(
        &open_err(&p),
        &["q_scale_max'", "expected dtype F16", "got BF16"],
    );
}

#[test]
fn missing_q_scale() {
    let (_s, p) = tamper(|t| drop(t.remove(&format!("{DOWN}.q_scale"))));
    assert_has(
        &open_err(&p),
        &[
            "tensor 'model.layers.0.mlp.down_proj.q_scale'",
            "expected the q_scale of quantised linear",
            "got no such tensor",
        ],
    );
}

#[test]
fn q_weight_rows_that_do_not_match_the_groups() {
    let (_s, p) = tamper(|t| {
        let w = t.get_mut(&format!("{DOWN}.q_weight")).unwrap();
        w.shape[0] -= 1;
        w.data.truncate(w.shape[0] * w.shape[1] * 4);
    });
    assert_has(
        &open_err(&p),
        &[
            "q_groups'",
            "inputs that add up to 128 (from q_invperm)",
            "in 1 word rows in group 3",
        ],
    );
}

#[test]
fn a_bias_that_contradicts_the_padding() {
    // 64 stored columns are 48 outputs padded, not 20.
    let (_s, p) = tamper(|t| {
        t.insert(
            "lm_head.bias".into(),
            Raw {
                dtype: Dtype::F16,
                shape: vec![20],
                data: vec![0; 40],
            },
        );
    });
    assert_has(
        &open_err(&p),
        &[
            "tensor 'lm_head.q_weight'",
            "20 outputs (from its bias)",
            "got 64 columns",
        ],
    );
}

#[test]
fn gptq_tensors_in_an_exl2_checkpoint() {
    let (_s, p) = tamper(|t| {
        let w = t.remove(&format!("{DOWN}.q_weight")).unwrap();
        t.insert(format!("{DOWN}.qweight"), w);
    });
    assert_has(
        &open_err(&p),
        &[
            "tensor 'model.layers.0.mlp.down_proj.qweight'",
            "EXL2 tensors only",
        ],
    );
}

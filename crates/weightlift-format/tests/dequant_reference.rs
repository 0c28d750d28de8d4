//! Reference dequantisation: hand-built blocks whose values follow from ggml's documented block
//! layouts (ggml's block structs and its `dequantize_row_*` functions), and the tiny-llama GGUF files
//! against the bf16 safetensors weights they were converted from.
//!
//! The bit-exact comparison with `gguf.quants.dequantize` for every type lives in the Python
//! suite (tests/), where gguf-py is.

use half::{bf16, f16};
use weightlift_format::dequant::{dequantize, dequantize_into, supports};
use weightlift_format::{Checkpoint, DType, FormatError, OpenOptions};

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

#[test]
fn q8_0_is_scale_times_int8() {
    let mut b = h(0.5).to_vec();
    let qs: Vec<i8> = (0..32).map(|i| (i * 8 - 128) as i8).collect();
    b.extend(qs.iter().map(|&q| q as u8));
    let y = dequantize(DType::Q8_0, &b).unwrap();
    let want: Vec<f32> = qs.iter().map(|&q| 0.5 * f32::from(q)).collect();
    assert_eq!(y, want);
}

#[test]
fn q4_0_low_nibbles_then_high_nibbles() {
    let mut b = h(2.0).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequantize(DType::Q4_0, &b).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], 2.0 * (j as f32 - 8.0));
        assert_eq!(y[j + 16], 2.0 * ((15 - j) as f32 - 8.0));
    }
}

#[test]
fn q4_1_adds_the_min() {
    let mut b = h(0.25).to_vec();
    b.extend(h(-1.0));
    b.extend((0..16u8).map(|j| j | (j << 4)));
    let y = dequantize(DType::Q4_1, &b).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], 0.25 * j as f32 - 1.0);
        assert_eq!(y[j + 16], 0.25 * j as f32 - 1.0);
    }
}

#[test]
fn q5_0_and_q5_1_take_the_fifth_bit_from_qh() {
    // qh bit j set for odd j: those elements get +16.
    let qh: u32 = 0xaaaa_aaaa;
    let qs: Vec<u8> = (0..16u8).map(|j| j | (j << 4)).collect();
    let mut b = h(1.0).to_vec();
    b.extend(qh.to_le_bytes());
    b.extend(&qs);
    let y = dequantize(DType::Q5_0, &b).unwrap();
    for (e, v) in y.iter().enumerate() {
        let q = (e % 16) as f32 + if e % 2 == 1 { 16.0 } else { 0.0 };
        assert_eq!(*v, q - 16.0, "element {e}");
    }
    let mut b = h(0.5).to_vec();
    b.extend(h(3.0));
    b.extend(qh.to_le_bytes());
    b.extend(&qs);
    let y = dequantize(DType::Q5_1, &b).unwrap();
    for (e, v) in y.iter().enumerate() {
        let q = (e % 16) as f32 + if e % 2 == 1 { 16.0 } else { 0.0 };
        assert_eq!(*v, 0.5 * q + 3.0, "element {e}");
    }
}

#[test]
fn q4_k_scales_and_mins() {
    // Every sub-block: scale 2, min 1 (6-bit fields; for j >= 4 they sit in bytes 8..12).
    let mut b = h(1.0).to_vec();
    b.extend(h(0.5));
    b.extend([2, 2, 2, 2, 1, 1, 1, 1, 0x12, 0x12, 0x12, 0x12]);
    b.extend((0..128u32).map(|i| (i % 16) as u8 | ((15 - (i % 16) as u8) << 4)));
    let y = dequantize(DType::Q4_K, &b).unwrap();
    // Sub-block j uses the low (j even) or high (j odd) nibbles of bytes 32*(j/2)..+32.
    for (e, v) in y.iter().enumerate() {
        let (j, l) = (e / 32, e % 32);
        let byte = (32 * (j / 2) + l) % 16;
        let q = if j % 2 == 0 { byte } else { 15 - byte };
        assert_eq!(*v, 2.0 * q as f32 - 0.5, "element {e}");
    }
}

#[test]
fn iq4_nl_uses_the_non_linear_table() {
    // ggml's `kvalues_iq4nl`, the IQ4_NL codebook.
    const K: [f32; 16] = [
        -127., -104., -83., -65., -49., -35., -22., -10., 1., 13., 25., 38., 53., 69., 89., 113.,
    ];
    let mut b = h(0.5).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequantize(DType::IQ4_NL, &b).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], 0.5 * K[j]);
        assert_eq!(y[j + 16], 0.5 * K[15 - j]);
    }
}

#[test]
fn mxfp4_decodes_e2m1_with_an_e8m0_scale() {
    // OCP MX: E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, sign in bit 3; scale 2^(e - 127).
    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for (e, scale) in [(127u8, 1.0f32), (130, 8.0), (120, 1.0 / 128.0)] {
        let mut b = vec![e];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dequantize(DType::MXFP4, &b).unwrap();
        let val = |q: usize| {
            let m = E2M1[q & 7] * scale;
            if q & 8 != 0 { -m } else { m }
        };
        for j in 0..16 {
            assert_eq!(y[j], val(j), "e={e} j={j}");
            assert_eq!(y[j + 16], val(15 - j), "e={e} j={j}");
        }
    }
}

#[test]
fn tq2_0_is_ternary() {
    let mut b: Vec<u8> = (0..64u32)
        .map(|i| ((i % 3) | (((i + 1) % 3) << 2) | (((i + 2) % 3) << 4) | ((i % 3) << 6)) as u8)
        .collect();
    b.extend(h(1.5));
    let y = dequantize(DType::TQ2_0, &b).unwrap();
    for (e, v) in y.iter().enumerate() {
        let (i, shift) = (32 * (e / 128) + e % 32, (e % 128) / 32);
        let q = [i % 3, (i + 1) % 3, (i + 2) % 3, i % 3][shift] as f32;
        assert_eq!(*v, 1.5 * (q - 1.0), "element {e}");
    }
}

#[test]
fn plain_types() {
    let x = [1.5f32, -0.0, f32::INFINITY, 65504.0];
    let b: Vec<u8> = x
        .iter()
        .flat_map(|v| f16::from_f32(*v).to_le_bytes())
        .collect();
    assert_eq!(dequantize(DType::F16, &b).unwrap(), x);
    let b: Vec<u8> = x
        .iter()
        .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
        .collect();
    assert_eq!(dequantize(DType::BF16, &b).unwrap()[..3], x[..3]);
    let b: Vec<u8> = [0.1f64, -2.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(dequantize(DType::F64, &b).unwrap(), [0.1f32, -2.0]);
    assert_eq!(dequantize(DType::I8, &[0xff, 7]).unwrap(), [-1.0, 7.0]);
    let b: Vec<u8> = [-5i32, 1 << 20]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(dequantize(DType::I32, &b).unwrap(), [-5.0, 1048576.0]);
}

#[test]
fn unsupported_and_wrong_lengths() {
    for t in [DType::Q8_1, DType::Q1_0, DType::F8_E4M3, DType::C64] {
        assert!(!supports(t));
        let e = dequantize(t, &vec![0u8; t.type_size() as usize]).unwrap_err();
        assert!(
            matches!(e, FormatError::DequantizeBlocks { dtype, .. } if dtype == t),
            "{e}"
        );
        assert!(e.to_string().contains("does not support"), "{e}");
    }
    let mut out = vec![0f32; 256];
    let e = dequantize_into(DType::Q6_K, &[0u8; 200], &mut out).unwrap_err();
    assert_eq!(
        e.to_string(),
        "Q6_K data: expected 210 bytes for 256 elements, got 200 bytes"
    );
    let mut out = vec![0f32; 100];
    let e = dequantize_into(DType::Q6_K, &[0u8; 210], &mut out).unwrap_err();
    assert!(e.to_string().contains("block size 256"), "{e}");
}

// ---- tiny-llama: GGUF dequantised against the bf16 weights it was converted from ----

/// HF name for a GGUF name, and the number of heads whose rows llama.cpp's converter permuted
/// (q and k are reordered for its rope layout: within each head, rows (2, d/2) become (d/2, 2)).
fn hf_name(gguf: &str) -> (String, Option<usize>) {
    let Some(rest) = gguf.strip_prefix("blk.") else {
        return match gguf {
            "token_embd.weight" => ("model.embed_tokens.weight".into(), None),
            "output_norm.weight" => ("model.norm.weight".into(), None),
            other => (other.into(), None),
        };
    };
    let (layer, role) = rest.split_once('.').unwrap();
    let (hf, heads) = match role {
        "attn_norm.weight" => ("input_layernorm.weight", None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", None),
        "attn_q.weight" => ("self_attn.q_proj.weight", Some(4)),
        "attn_k.weight" => ("self_attn.k_proj.weight", Some(2)),
        "attn_v.weight" => ("self_attn.v_proj.weight", None),
        "attn_output.weight" => ("self_attn.o_proj.weight", None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", None),
        "ffn_up.weight" => ("mlp.up_proj.weight", None),
        "ffn_down.weight" => ("mlp.down_proj.weight", None),
        other => panic!("unexpected tensor {other}"),
    };
    (format!("model.layers.{layer}.{hf}"), heads)
}

/// The HF row that GGUF row `r` holds, for a tensor with `rows` rows over `heads` heads.
fn unpermute_row(r: usize, rows: usize, heads: usize) -> usize {
    let d = rows / heads;
    let (head, within) = (r / d, r % d);
    let (i, j) = (within / 2, within % 2);
    head * d + j * (d / 2) + i
}

struct Compared {
    tensors: usize,
    max_err_over_scale: f32,
    rel_rmse: BTreeMap<DType, f64>,
}

use std::collections::BTreeMap;

fn compare(file: &str) -> Compared {
    let gguf = weightlift_testdata::reference_file(&format!("tiny-llama/gguf/{file}"));
    let st = weightlift_testdata::reference_file("tiny-llama/safetensors/model.safetensors");
    let st_bytes = std::fs::read(&st).unwrap();
    let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
    let ck = Checkpoint::open(&gguf, OpenOptions::default()).unwrap();
    let mut out = Compared {
        tensors: 0,
        max_err_over_scale: 0.0,
        rel_rmse: BTreeMap::new(),
    };
    let mut sums: BTreeMap<DType, (f64, f64)> = BTreeMap::new();
    for t in ck.tensors() {
        let (name, heads) = hf_name(&t.name);
        let view = st.tensor(&name).unwrap();
        assert_eq!(view.dtype(), safetensors::Dtype::BF16);
        let want_shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
        assert_eq!(t.shape, want_shape, "{}", t.name);
        let want: Vec<f32> = view
            .data()
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let data = ck.bytes(t);
        let got = dequantize(t.dtype, data).unwrap();
        assert_eq!(got.len(), want.len(), "{}", t.name);
        let cols = *t.shape.last().unwrap() as usize;
        let rows = got.len() / cols;
        let (se, ss) = sums.entry(t.dtype).or_default();
        for r in 0..rows {
            let hr = heads.map_or(r, |h| unpermute_row(r, rows, h));
            for c in 0..cols {
                let g = got[r * cols + c];
                let w = want[hr * cols + c];
                *se += f64::from(g - w).powi(2);
                *ss += f64::from(w).powi(2);
                match t.dtype {
                    DType::F32 => assert_eq!(g, w, "{} [{r}, {c}]", t.name),
                    DType::Q8_0 => {
                        // Q8_0 rounds x/d to an integer with d = amax/127 before d is rounded to
                        // f16: the error is at most d/2 plus 127·|d − f16(d)| < 0.07·d.
                        let e = r * cols + c;
                        let block = &data[(e / 32) * 34..];
                        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                        let ratio = (g - w).abs() / d;
                        out.max_err_over_scale = out.max_err_over_scale.max(ratio);
                        assert!(
                            ratio <= 0.57,
                            "{} [{r}, {c}]: got {g}, want {w}, d {d}",
                            t.name
                        );
                    }
                    _ => {}
                }
            }
        }
        out.tensors += 1;
    }
    out.rel_rmse = sums
        .into_iter()
        .map(|(t, (se, ss))| (t, (se / ss).sqrt()))
        .collect();
    out
}

#[test]
fn tiny_llama_q8_0_matches_bf16_weights() {
    let c = compare("tiny-llama-Q8_0.gguf");
    assert_eq!(c.tensors, 20);
    eprintln!(
        "Q8_0: max |error| / d = {:.3}, relative rmse {:?}",
        c.max_err_over_scale, c.rel_rmse
    );
    assert!(c.rel_rmse[&DType::Q8_0] < 0.01);
    assert_eq!(c.rel_rmse[&DType::F32], 0.0);
}

#[test]
fn tiny_llama_k_quants_match_bf16_weights() {
    // Typical relative rms errors: Q6_K ~1-2 %, Q4_K ~5-8 % on Gaussian weights; a wrong
    // element order or scale unpacking gives errors near 100 %.
    for (file, bounds) in [
        ("tiny-llama-Q6_K.gguf", vec![(DType::Q6_K, 0.03)]),
        (
            "tiny-llama-Q4_K_M.gguf",
            vec![(DType::Q4_K, 0.12), (DType::Q6_K, 0.03)],
        ),
    ] {
        let c = compare(file);
        eprintln!("{file}: relative rmse {:?}", c.rel_rmse);
        for (t, bound) in bounds {
            let e = c.rel_rmse[&t];
            assert!(e < bound, "{file} {t}: relative rmse {e} ≥ {bound}");
        }
        assert_eq!(c.rel_rmse[&DType::F32], 0.0);
    }
}

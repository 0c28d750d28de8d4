//! Helpers for the GPTQ and EXL2 tests: the committed fixtures (written by `gen_gptq.py` and
//! `gen_exl2.py` with auto-gptq, gptqmodel and exllamav2), their `expected.json`, and copies of a
//! fixture with one tensor or setting changed, rewritten by the official `safetensors` crate.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::f16;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;
use weightlift_format::{Checkpoint, OpenOptions};

use crate::st_util::Scratch;

/// A committed fixture folder; a missing one fails the test.
pub fn fixture(rel: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(rel);
    assert!(
        p.join("model.safetensors").is_file() && p.join("expected.json").is_file(),
        "{} is missing: run the generator named in its tests file",
        p.display()
    );
    p
}

pub fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

pub fn expected(dir: &Path) -> Value {
    json(&dir.join("expected.json"))
}

pub fn open(dir: &Path) -> Checkpoint {
    Checkpoint::open(dir, OpenOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

pub fn fnv1a64(bytes: impl IntoIterator<Item = u8>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn f32_digest(v: &[f32]) -> String {
    fnv1a64(v.iter().flat_map(|x| x.to_le_bytes()))
}

fn f16_digest(v: &[f16]) -> String {
    fnv1a64(v.iter().flat_map(|x| x.to_le_bytes()))
}

/// Every dequantised weight against the reference's digests and samples, f32 and f16.
pub fn check_weights(dir: &Path) {
    let ckpt = open(dir);
    let exp = expected(dir);
    let q = ckpt.quantization().expect("a quantised checkpoint");
    let linears = exp["linears"].as_object().unwrap();
    assert_eq!(q.linears().len(), linears.len(), "{}", dir.display());
    for (prefix, e) in linears {
        let lin = q
            .linear(prefix)
            .unwrap_or_else(|| panic!("no linear '{prefix}'"));
        let (n_out, n_in) = (lin.out_features(), lin.in_features());
        assert_eq!(
            [n_out as u64, n_in as u64],
            [
                e["shape"][0].as_u64().unwrap(),
                e["shape"][1].as_u64().unwrap()
            ],
            "{prefix}"
        );
        let w = ckpt.dequantize_linear(lin).unwrap();
        for s in e["samples"].as_array().unwrap() {
            let (o, i) = (
                s[0].as_u64().unwrap() as usize,
                s[1].as_u64().unwrap() as usize,
            );
            assert_eq!(
                w[o * n_in + i],
                s[2].as_f64().unwrap() as f32,
                "{prefix} [{o}, {i}]"
            );
        }
        assert_eq!(f32_digest(&w), e["f32_fnv1a64"], "{prefix}: f32 weights");
        let mut h = vec![f16::ZERO; n_out * n_in];
        ckpt.dequantize_linear_f16_into(lin, 0..n_out, 0..n_in, &mut h)
            .unwrap();
        assert_eq!(f16_digest(&h), e["f16_fnv1a64"], "{prefix}: f16 weights");
    }
}

/// Blocks of rows and columns equal the same block of the whole weight, for every linear.
pub fn check_blocks(dir: &Path) {
    let ckpt = open(dir);
    for lin in ckpt.quantization().unwrap().linears() {
        let (n_out, n_in) = (lin.out_features(), lin.in_features());
        let whole = ckpt.dequantize_linear(lin).unwrap();
        for (rows, cols) in [
            (0..1, 0..n_in),
            (n_out - 1..n_out, n_in / 2..n_in),
            (3..n_out.min(17), 5..n_in.min(40)),
            (0..n_out, 31..33),
            (2..2, 0..n_in),
        ] {
            let mut block = vec![f32::NAN; rows.len() * cols.len()];
            ckpt.dequantize_linear_into(lin, rows.clone(), cols.clone(), &mut block)
                .unwrap();
            for (k, o) in rows.clone().enumerate() {
                let want = &whole[o * n_in + cols.start..o * n_in + cols.end];
                let got = &block[k * cols.len()..(k + 1) * cols.len()];
                assert_eq!(got, want, "{} rows {rows:?} cols {cols:?}", lin.prefix());
            }
        }
    }
}

/// Each tensor's dtype, shape and byte range equal what the safetensors header says (as the
/// generator read it with the format's own rules): the plan sizes tensors by these bytes.
pub fn check_sizes(dir: &Path) {
    let ckpt = open(dir);
    let table = expected(dir)["tensors"].as_object().unwrap().clone();
    assert_eq!(ckpt.tensors().len(), table.len());
    let mut total = 0;
    for t in ckpt.tensors() {
        let e = &table[&t.name];
        assert_eq!(
            t.dtype.name().to_ascii_uppercase(),
            e["dtype"].as_str().unwrap(),
            "{}",
            t.name
        );
        let shape: Vec<u64> = e["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.shape, shape, "{}", t.name);
        assert_eq!(t.offset, e["offset"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(t.nbytes, e["nbytes"].as_u64().unwrap(), "{}", t.name);
        total += t.nbytes;
    }
    assert_eq!(ckpt.total_bytes(), total);
    // Every tensor of every linear is one of them, so a linear's size is its tensors' bytes.
    for lin in ckpt.quantization().unwrap().linears() {
        for name in lin.tensor_names() {
            assert!(table.contains_key(name), "{name}");
        }
    }
}

/// A tensor as the rewrite helpers hold it.
pub struct Raw {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// Copy a fixture folder into `scratch`, rewriting model.safetensors after `edit` and
/// config.json after `edit_config`. Returns the copy's path.
pub fn tampered(
    scratch: &Scratch,
    src: &Path,
    edit: impl FnOnce(&mut BTreeMap<String, Raw>),
    edit_config: impl FnOnce(&mut Value),
) -> PathBuf {
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: BTreeMap<String, Raw> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let raw = Raw {
                dtype: v.dtype(),
                shape: v.shape().to_vec(),
                data: v.data().to_vec(),
            };
            (n, raw)
        })
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, r)| {
            (
                n.clone(),
                TensorView::new(r.dtype, r.shape.clone(), &r.data).unwrap(),
            )
        })
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    scratch.write("model.safetensors", out);
    for f in ["config.json", "quantize_config.json"] {
        if src.join(f).is_file() {
            std::fs::copy(src.join(f), scratch.path().join(f)).unwrap();
        }
    }
    let mut config = json(&scratch.path().join("config.json"));
    edit_config(&mut config);
    scratch.write("config.json", serde_json::to_vec_pretty(&config).unwrap());
    scratch.path().to_path_buf()
}

pub fn i32_le(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i32_values(data: &[u8]) -> Vec<i32> {
    data.chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The error message of a failed open.
pub fn open_err(dir: &Path) -> String {
    match Checkpoint::open(dir, OpenOptions::default()) {
        Ok(_) => panic!("{} opened, but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

pub fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "{p:?} not in: {msg}");
    }
}

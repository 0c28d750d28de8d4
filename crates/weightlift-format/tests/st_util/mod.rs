//! Helpers shared by the safetensors and checkpoint tests: scratch folders and fixtures written
//! by the official `safetensors` crate (`safetensors::serialize`), or by hand where a file must
//! be broken in a way no writer would produce.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use safetensors::tensor::{Dtype, TensorView};

/// A scratch folder removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "wl-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn write(&self, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
        let p = self.0.join(name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A safetensors file of F32 tensors, written by the official crate.
pub fn st_f32(tensors: &[(&str, Vec<usize>, Vec<f32>)], meta: Option<&[(&str, &str)]>) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| f32_bytes(v)).collect();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            (
                (*n).to_owned(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let meta: Option<HashMap<String, String>> = meta.map(|m| {
        m.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    });
    safetensors::serialize(views, meta).unwrap()
}

/// A safetensors file with a hand-written header and `data` after it.
pub fn st_raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A small sharded llama-named model in `dir`: two shards and an index (JSON `weight_map`).
/// Returns the weight_map entries so a test can tamper with them.
pub fn sharded(dir: &Path) -> Vec<(String, String)> {
    let a = st_f32(
        &[
            (
                "model.embed_tokens.weight",
                vec![4, 2],
                (0..8).map(|i| i as f32).collect(),
            ),
            (
                "model.layers.0.input_layernorm.weight",
                vec![2],
                vec![1.0, 2.0],
            ),
        ],
        Some(&[("format", "pt")]),
    );
    let b = st_f32(
        &[
            (
                "model.layers.0.self_attn.q_proj.weight",
                vec![2, 2],
                vec![0.5; 4],
            ),
            ("model.norm.weight", vec![2], vec![3.0, 4.0]),
        ],
        Some(&[("format", "pt")]),
    );
    std::fs::write(dir.join("model-00001-of-00002.safetensors"), a).unwrap();
    std::fs::write(dir.join("model-00002-of-00002.safetensors"), b).unwrap();
    let map = vec![
        (
            "model.embed_tokens.weight".to_owned(),
            "model-00001-of-00002.safetensors".to_owned(),
        ),
        (
            "model.layers.0.input_layernorm.weight".to_owned(),
            "model-00001-of-00002.safetensors".to_owned(),
        ),
        (
            "model.layers.0.self_attn.q_proj.weight".to_owned(),
            "model-00002-of-00002.safetensors".to_owned(),
        ),
        (
            "model.norm.weight".to_owned(),
            "model-00002-of-00002.safetensors".to_owned(),
        ),
    ];
    write_index(dir, &map);
    map
}

/// Write `model.safetensors.index.json` with these entries, in this order (duplicates kept).
pub fn write_index(dir: &Path, map: &[(String, String)]) -> PathBuf {
    let entries: Vec<String> = map
        .iter()
        .map(|(k, v)| {
            format!(
                "{}: {}",
                serde_json::Value::from(k.as_str()),
                serde_json::Value::from(v.as_str())
            )
        })
        .collect();
    let text = format!(
        "{{\"metadata\": {{\"total_size\": 0}}, \"weight_map\": {{{}}}}}",
        entries.join(", ")
    );
    let p = dir.join("model.safetensors.index.json");
    std::fs::write(&p, text).unwrap();
    p
}

/// The error message of a failed open (panics if the open succeeds).
pub fn open_err(p: &Path) -> String {
    match weightlift_format::Checkpoint::open(p, Default::default()) {
        Ok(_) => panic!("{} opened, but should not", p.display()),
        Err(e) => e.to_string(),
    }
}

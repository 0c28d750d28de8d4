//! Shared helpers of the forward-pass tests: the reference folder, a reader for its float32
//! `.npy` files, and opening and loading a checkpoint whole on one device.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `../shared/reference` beside the repository.
pub fn reference() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/reference")
}

/// A little-endian float32, C-order `.npy` file: `(shape, values)`. Panics (failing the test)
/// on anything else, naming the file.
pub fn read_npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        &data[..6],
        b"\x93NUMPY",
        "{}: not an npy file",
        path.display()
    );
    let (hlen, start) = match data[6] {
        1 => (u16::from_le_bytes([data[8], data[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([data[8], data[9], data[10], data[11]]) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&data[start..start + hlen]).unwrap();
    assert!(
        header.contains("'descr': '<f4'"),
        "{}: {header}",
        path.display()
    );
    assert!(header.contains("'fortran_order': False"), "{header}");
    let shape_txt = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let shape: Vec<usize> = shape_txt
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let body = &data[start + hlen..];
    let values: Vec<f32> = body
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(
        values.len(),
        shape.iter().product::<usize>(),
        "{}",
        path.display()
    );
    (shape, values)
}

/// Index of the largest value (the first of equals).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best
}

/// Top-1 minus top-2.
pub fn margin(row: &[f32]) -> f32 {
    let mut a = f32::NEG_INFINITY;
    let mut b = f32::NEG_INFINITY;
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// Rank of `id` in `row` (0: the largest).
pub fn rank(row: &[f32], id: usize) -> usize {
    row.iter().filter(|v| **v > row[id]).count()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The ids of a reference JSON list field, e.g. `"ids"`.
pub fn json_ids(path: &Path, key: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut cur = &v;
    for k in key.split('.') {
        cur = &cur[k];
    }
    cur.as_array()
        .unwrap_or_else(|| panic!("{}: no list at {key}", path.display()))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Open a checkpoint (a GGUF file or a safetensors folder), failing the test with the reason.
pub fn open(path: impl AsRef<Path>) -> std::sync::Arc<dyn weightlift_engine::Source> {
    let path = path.as_ref();
    std::sync::Arc::new(
        weightlift_format::Checkpoint::open(path, weightlift_format::OpenOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
}

/// Load `src` whole onto `device` of the inventory `devices`, with a cache of `max_seq_len`
/// positions in `dtype`; the model and its cache.
pub fn load_on(
    src: &std::sync::Arc<dyn weightlift_engine::Source>,
    devices: &str,
    device: &str,
    max_seq_len: u64,
    dtype: weightlift_engine::CacheDType,
) -> (
    weightlift_engine::Model,
    std::sync::Arc<weightlift_engine::Cache>,
) {
    use weightlift_engine::{Cache, Inventory, LoadOptions, Model, Placement};
    let mut m = Model::new(
        std::sync::Arc::clone(src),
        Inventory::parse(devices).unwrap(),
    );
    let config = m.cache_config(max_seq_len, 1, dtype, false).unwrap();
    let cache = std::sync::Arc::new(Cache::new(config).unwrap());
    let placement = Placement::all_on(src.as_ref(), device, m.n_layers());
    m.load(
        &placement,
        &LoadOptions::default(),
        Some(&cache),
        true,
        &mut |_| true,
    )
    .unwrap();
    (m, cache)
}

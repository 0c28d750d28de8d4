//! Peak anonymous host memory during a load is bounded by the staging buffers, not by the model.
//! Its own test binary (one test), so no other test's allocations disturb the measurement.

use std::collections::HashMap;
use std::sync::Arc;

use safetensors::tensor::{Dtype, TensorView};
use weightlift_engine::{Inventory, LoadOptions, Source, TensorTarget, load};
use weightlift_format::{Checkpoint, OpenOptions};

/// A field of /proc/self/status in bytes.
fn status_bytes(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

#[test]
fn peak_anonymous_memory_is_bounded_by_staging() {
    // A synthetic llama-shaped checkpoint of 96 MiB of F32 (4 layers of 24 MiB), written by the
    // official safetensors crate.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    {
        let per = 6 << 20; // f32 elements per tensor: 24 MiB
        let data: Vec<u8> = (0..per * 4).map(|i| (i % 251) as u8).collect();
        let names: Vec<String> = (0..4)
            .map(|l| format!("model.layers.{l}.mlp.up_proj.weight"))
            .collect();
        let mut views = HashMap::new();
        for n in &names {
            views.insert(
                n.clone(),
                TensorView::new(Dtype::F32, vec![per / 1024, 1024], &data).unwrap(),
            );
        }
        safetensors::serialize_to_file(&views, None, &path).unwrap();
    }
    let file_size = std::fs::metadata(&path).unwrap().len();
    let src: Arc<dyn Source> = Arc::new(Checkpoint::open(&path, OpenOptions::default()).unwrap());
    let inv = Inventory::parse("virtual:1x256MiB").unwrap();
    let dev = Arc::clone(&inv.accelerators()[0]);
    let cpu = Arc::clone(inv.cpu());
    let staging = 4 << 20;

    // Device-placed: anonymous memory beyond what the device arena holds stays within the two
    // staging buffers (plus a little slack for thread stacks and the allocator).
    let t: Vec<_> = src
        .tensors()
        .iter()
        .map(|i| Some(TensorTarget::new(Arc::clone(&dev), i.dtype)))
        .collect();
    let base = status_bytes("RssAnon:");
    let mut extra_peak = 0i64;
    let opts = LoadOptions {
        staging_bytes: staging,
        ..Default::default()
    };
    let loaded = load(
        &src,
        &t,
        &opts,
        &mut |_| {
            let extra = status_bytes("RssAnon:") as i64 - base as i64 - dev.used() as i64;
            extra_peak = extra_peak.max(extra);
            true
        },
        &mut |_| Ok(()),
    )
    .unwrap();
    assert_eq!(dev.used(), file_size - src.tensors()[0].offset);
    let bound = 2 * staging as i64 + (8 << 20);
    eprintln!(
        "device load: file {file_size} B, device holds {} B, peak anonymous beyond the device {extra_peak} B (bound {bound})",
        dev.used()
    );
    assert!(
        extra_peak <= bound,
        "peak extra anonymous {extra_peak} > {bound}"
    );
    drop(loaded);
    assert_eq!(dev.used(), 0);

    // cpu + mmap: page cache only, no anonymous memory.
    let t: Vec<_> = src
        .tensors()
        .iter()
        .map(|i| Some(TensorTarget::new(Arc::clone(&cpu), i.dtype)))
        .collect();
    let base = status_bytes("RssAnon:");
    let file_base = status_bytes("RssFile:");
    let loaded = load(
        &src,
        &t,
        &LoadOptions::default(),
        &mut |_| true,
        &mut |_| Ok(()),
    )
    .unwrap();
    let sum: u64 = loaded
        .tensors
        .iter()
        .flatten()
        .map(|t| {
            t.host_bytes()
                .unwrap()
                .iter()
                .step_by(4096)
                .map(|&b| u64::from(b))
                .sum::<u64>()
        })
        .sum();
    assert!(sum > 0);
    let anon = status_bytes("RssAnon:") as i64 - base as i64;
    let file = status_bytes("RssFile:") as i64 - file_base as i64;
    eprintln!(
        "cpu mmap load: anonymous +{anon} B, file-backed +{file} B after touching every page"
    );
    assert!(anon < 4 << 20, "mmap views must not copy: anon grew {anon}");
}

//! Load throughput against a plain `read()` of the same file, measured in the same run, and peak
//! anonymous memory against the file size.
//!
//! `cargo run --release -p weightlift-engine --example load_throughput [PATH] [GiB]`
//!
//! Without PATH a synthetic safetensors checkpoint (F32, 8 layers, `GiB` GiB, default 2) is
//! written to a temporary folder. Every figure is taken with the file in the page cache (a warm-up
//! read runs first), so both sides measure the same thing: copying out of the page cache.
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use safetensors::tensor::{Dtype, TensorView};
use weightlift_engine::{Inventory, LoadOptions, Source, TensorTarget, load};
use weightlift_format::{Checkpoint, OpenOptions};

fn status(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

fn synth(dir: &Path, gib: f64) -> PathBuf {
    let path = dir.join("model.safetensors");
    let layers = 8usize;
    let per = ((gib * (1u64 << 30) as f64) as usize / layers / 4) / 1024 * 1024;
    let data: Vec<u8> = (0..per * 4).map(|i| (i % 251) as u8).collect();
    let mut views = HashMap::new();
    for l in 0..layers {
        views.insert(
            format!("model.layers.{l}.mlp.up_proj.weight"),
            TensorView::new(Dtype::F32, vec![per / 1024, 1024], &data).expect("view"),
        );
    }
    safetensors::serialize_to_file(&views, None, &path).expect("write synthetic checkpoint");
    path
}

fn plain_read(path: &Path, buf: &mut [u8]) -> f64 {
    let t = Instant::now();
    let mut f = std::fs::File::open(path).expect("open");
    f.read_exact(buf).expect("read");
    t.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let gib: f64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2.0);
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = match args.get(1).filter(|a| !a.is_empty() && *a != "-") {
        Some(p) => PathBuf::from(p),
        None => synth(tmp.path(), gib),
    };
    let size = std::fs::metadata(&path).expect("stat").len();
    let src: Arc<dyn Source> =
        Arc::new(Checkpoint::open(&path, OpenOptions::default()).expect("open checkpoint"));
    let inv = Inventory::parse(&format!("virtual:1x{}", size + (64 << 20))).expect("devices");
    let cpu = Arc::clone(inv.cpu());
    let dev = Arc::clone(&inv.accelerators()[0]);
    let on = |d: &Arc<weightlift_engine::Device>| -> Vec<Option<TensorTarget>> {
        src.tensors()
            .iter()
            .map(|t| Some(TensorTarget::new(Arc::clone(d), t.dtype)))
            .collect()
    };
    let mut buf = vec![0u8; size as usize];
    plain_read(&path, &mut buf); // warm the page cache
    buf.iter_mut().step_by(4096).for_each(|b| *b = 0);

    let gbs = |bytes: u64, s: f64| bytes as f64 / s / 1e9;
    println!("file: {} ({:.2} GB)", path.display(), size as f64 / 1e9);
    for round in 0..4 {
        let t_read = plain_read(&path, &mut buf);
        let t = Instant::now();
        let fresh = std::fs::read(&path).expect("read");
        let t_fresh = t.elapsed().as_secs_f64();
        drop(fresh);

        let base = status("RssAnon:");
        let t = Instant::now();
        let opts = LoadOptions {
            use_mmap: false,
            ..LoadOptions::default()
        };
        let loaded = load(&src, &on(&cpu), &opts, &mut |_| true, &mut |_| Ok(())).expect("load");
        let t_cpu = t.elapsed().as_secs_f64();
        let anon_cpu = status("RssAnon:").saturating_sub(base);
        drop(loaded);

        let base = status("RssAnon:");
        let mut peak_extra = 0u64;
        let t = Instant::now();
        let loaded = load(
            &src,
            &on(&dev),
            &LoadOptions::default(),
            &mut |_| {
                peak_extra = peak_extra.max(
                    status("RssAnon:")
                        .saturating_sub(base)
                        .saturating_sub(dev.used()),
                );
                true
            },
            &mut |_| Ok(()),
        )
        .expect("load");
        let t_dev = t.elapsed().as_secs_f64();
        drop(loaded);

        let t = Instant::now();
        let loaded = load(
            &src,
            &on(&cpu),
            &LoadOptions::default(),
            &mut |_| true,
            &mut |_| Ok(()),
        )
        .expect("load");
        let t_mmap = t.elapsed().as_secs_f64();
        drop(loaded);

        println!(
            "round {round}: read() into a resident buffer {:.2} GB/s, std::fs::read (fresh buffer) {:.2} GB/s | \
             use_mmap=False (cpu) {:.2} GB/s = {:.0}% of std::fs::read, anon +{:.2} GB | \
             virtual device via 2x16 MiB staging {:.2} GB/s = {:.0}%, peak anon beyond the arena {:.1} MiB | mmap views {:.3} ms",
            gbs(size, t_read),
            gbs(size, t_fresh),
            gbs(size, t_cpu),
            100.0 * t_fresh / t_cpu,
            anon_cpu as f64 / 1e9,
            gbs(size, t_dev),
            100.0 * t_fresh / t_dev,
            peak_extra as f64 / (1 << 20) as f64,
            t_mmap * 1e3,
        );
    }
}

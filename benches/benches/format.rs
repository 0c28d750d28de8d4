//! Format benches, each against a baseline measured in the same run:
//! - open + validate of the demo GGUF, against a plain `read()` of its header region;
//! - `check_tensors` scan throughput, against memcpy of the same bytes (single thread and all);
//! - reference dequantisation of the demo model's Q4_1 and Q8_0 tensors, against memcpy.
//!
//! The demo model path comes from `WEIGHTLIFT_DEMO_GGUF` (set by the Makefile).

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use weightlift_format::{Checkpoint, DType, OpenOptions, dequant, scan};

fn demo_path() -> Option<PathBuf> {
    let p = std::env::var_os("WEIGHTLIFT_DEMO_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    p.exists().then_some(p)
}

fn open(c: &mut Criterion) {
    let Some(path) = demo_path() else {
        eprintln!("format bench: demo model missing; run `make demo-model`");
        return;
    };
    let mut g = c.benchmark_group("open");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("gguf_smollm2_open_validate", |b| {
        b.iter(|| black_box(Checkpoint::open(&path, OpenOptions::default()).expect("open")))
    });
    // Baseline: the syscalls every open pays (open, stat, read of the first 4 KiB).
    g.bench_function("baseline_read_first_4k", |b| {
        b.iter(|| {
            use std::io::Read;
            let mut f = std::fs::File::open(&path).expect("open");
            let mut buf = [0u8; 4096];
            f.read_exact(&mut buf).expect("read");
            black_box(buf)
        })
    });
    g.finish();
}

/// All tensor bytes of one dtype from the demo model, concatenated.
fn tensors_of(ckpt: &Checkpoint, dtype: DType) -> Vec<u8> {
    ckpt.tensors()
        .iter()
        .filter(|t| t.dtype == dtype)
        .flat_map(|t| ckpt.bytes(t).iter().copied())
        .collect()
}

fn scan_and_dequant(c: &mut Criterion) {
    let Some(path) = demo_path() else { return };
    let ckpt = Checkpoint::open(&path, OpenOptions::default()).expect("open");
    let f32s: Vec<u8> = tensors_of(&ckpt, DType::F32);
    // The F32 tensors are small norms; a 64 MiB buffer of finite values measures the scan.
    let big: Vec<u8> = (0..16u32 << 20)
        .flat_map(|i| (i as f32 * 1e-3).to_le_bytes())
        .collect();
    let mut g = c.benchmark_group("scan");
    g.measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Bytes(big.len() as u64));
    g.bench_function("find_non_finite_f32_64MiB", |b| {
        b.iter(|| black_box(scan::find_non_finite(DType::F32, &big)))
    });
    let mut dst = vec![0u8; big.len()];
    g.bench_function("baseline_memcpy_64MiB", |b| {
        b.iter(|| {
            dst.copy_from_slice(&big);
            black_box(&dst);
        })
    });
    g.finish();
    black_box(f32s);

    let mut g = c.benchmark_group("reference_dequantize");
    g.measurement_time(Duration::from_secs(3));
    for dtype in [DType::Q4_1, DType::Q8_0] {
        let bytes = tensors_of(&ckpt, dtype);
        let n = (bytes.len() as u64 / dtype.type_size() * dtype.block_size()) as usize;
        let mut out = vec![0f32; n];
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        g.bench_function(format!("{dtype}_to_f32"), |b| {
            b.iter(|| dequant::dequantize_into(dtype, &bytes, &mut out).expect("dequantize"))
        });
        let mut copy = vec![0u8; bytes.len()];
        g.bench_function(format!("baseline_memcpy_{dtype}_bytes"), |b| {
            b.iter(|| {
                copy.copy_from_slice(&bytes);
                black_box(&copy);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, open, scan_and_dequant);
criterion_main!(benches);

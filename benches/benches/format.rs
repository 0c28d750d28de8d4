//! Format benches, each against a baseline measured in the same run:
//! - open + validate of the demo GGUF, against a plain `read()` of its header region;
//! - `check_tensors` scan throughput, against memcpy of the same bytes (single thread and all);
//! - reference dequantisation of the demo model's Q4_1 and Q8_0 tensors, against memcpy;
//! - EXL2 dequantisation of a synthetic 4096 × 4096 linear (exllamav2's layout: groups of 32
//!   inputs at 6, 5, 4 and 3 bits, about 4.4 bits per weight, a random input permutation),
//!   whole and in the 16-row blocks the forward pass asks for, against memcpy of its f32 rows.
//!
//! The demo model path comes from `WEIGHTLIFT_DEMO_GGUF` (set by the Makefile), else
//! `.cache/models/` at the repository root, wherever cargo is run from.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use weightlift_format::{Checkpoint, DType, OpenOptions, dequant, scan};

/// The demo model, or where it was looked for when it is not there.
fn demo_path() -> Result<PathBuf, PathBuf> {
    let p = std::env::var_os("WEIGHTLIFT_DEMO_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // cargo runs a bench in its package folder, whichever folder it was started from;
            // the model cache sits at the repository root, one level up from this package.
            let package = Path::new(env!("CARGO_MANIFEST_DIR"));
            package
                .parent()
                .unwrap_or(package)
                .join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if p.is_file() { Ok(p) } else { Err(p) }
}

fn open(c: &mut Criterion) {
    let path = match demo_path() {
        Ok(path) => path,
        Err(missing) => {
            eprintln!(
                "format bench: demo model {} is missing; run `make demo-model` \
                 (open, scan and dequantise not timed)",
                missing.display()
            );
            return;
        }
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
    let Ok(path) = demo_path() else { return };
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

/// A safetensors file of `(name, dtype, shape, bytes)` tensors, written by hand (the format is
/// an 8-byte header length, a JSON header of dtypes, shapes and byte ranges, then the data).
fn write_safetensors(path: &std::path::Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = Vec::new();
    let mut at = 0usize;
    for (name, dtype, shape, bytes) in tensors {
        let shape: Vec<String> = shape.iter().map(usize::to_string).collect();
        header.push(format!(
            "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":[{}],\"data_offsets\":[{at},{}]}}",
            shape.join(","),
            at + bytes.len()
        ));
        at += bytes.len();
    }
    let mut header = format!("{{{}}}", header.join(",")).into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    for (_, _, _, bytes) in tensors {
        file.extend_from_slice(bytes);
    }
    std::fs::write(path, file).expect("write the synthetic checkpoint");
}

/// A synthetic `n × n` EXL2 linear as exllamav2's converter lays it out (see the module docs),
/// with random codes, scales and permutation, in a folder under the temp dir.
fn synthetic_exl2(n: usize) -> PathBuf {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let widths = [(6u32, n / 8), (5, n / 4), (4, n / 2), (3, n / 8)];
    let (mut groups, mut qrows) = (Vec::new(), 0usize);
    for (bits, inputs) in widths {
        for _ in 0..inputs / 32 {
            groups.extend([bits as i16, qrows as i16]);
            qrows += bits as usize; // 32 codes of `bits` bits
        }
    }
    let n_groups = groups.len() / 2;
    let words = |k: usize, next: &mut dyn FnMut() -> u64| -> Vec<u8> {
        (0..k).flat_map(|_| (next() as u32).to_le_bytes()).collect()
    };
    let q_weight = words(qrows * n, &mut next);
    let q_scale = words(n_groups * n / 8, &mut next);
    // f16 bit patterns from 0x2100 (about 0.0098) to 0x2e00 (0.094)
    let q_scale_max: Vec<u8> = (0..n_groups)
        .flat_map(|_| (0x2100 + (next() % 0xd00) as u16).to_le_bytes())
        .collect();
    let mut perm: Vec<i32> = (0..n as i32).collect();
    for i in (1..n).rev() {
        perm.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    let dir =
        std::env::temp_dir().join(format!("weightlift-bench-exl2-{n}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(
        dir.join("config.json"),
        r#"{"quantization_config": {"quant_method": "exl2", "version": "0.3.2", "bits": 4.375}}"#,
    )
    .expect("write config.json");
    let p = "model.layers.0.self_attn.q_proj";
    let shorts = groups.iter().flat_map(|g| g.to_le_bytes()).collect();
    let invperm = perm.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_safetensors(
        &dir.join("model.safetensors"),
        &[
            (&format!("{p}.q_weight"), "I32", vec![qrows, n], q_weight),
            (
                &format!("{p}.q_scale"),
                "I32",
                vec![n_groups, n / 8],
                q_scale,
            ),
            (
                &format!("{p}.q_scale_max"),
                "F16",
                vec![n_groups],
                q_scale_max,
            ),
            (&format!("{p}.q_groups"), "I16", vec![2 * n_groups], shorts),
            (&format!("{p}.q_invperm"), "I32", vec![n], invperm),
        ],
    );
    dir
}

fn exl2_dequant(c: &mut Criterion) {
    let n = 4096;
    let dir = synthetic_exl2(n);
    let ckpt = Checkpoint::open(dir.join("model.safetensors"), OpenOptions::default())
        .expect("open the synthetic EXL2 checkpoint");
    let quant = ckpt.quantization().expect("EXL2 settings");
    let lin = &quant.linears()[0];
    let mut out = vec![0f32; n * n];
    let mut g = c.benchmark_group("exl2_dequantize");
    g.measurement_time(Duration::from_secs(5));
    g.sample_size(20);
    g.throughput(Throughput::Elements((n * n) as u64));
    g.bench_function("exl2_4096x4096_to_f32", |b| {
        b.iter(|| {
            ckpt.dequantize_linear_into(lin, 0..n, 0..n, &mut out)
                .expect("dequantize")
        })
    });
    // The forward pass's pattern: blocks of 16 output rows, one at a time.
    g.bench_function("exl2_4096x4096_to_f32_16_row_blocks", |b| {
        b.iter(|| {
            for (k, block) in out.chunks_mut(16 * n).enumerate() {
                ckpt.dequantize_linear_into(lin, k * 16..(k + 1) * 16, 0..n, block)
                    .expect("dequantize");
            }
        })
    });
    let src = vec![1f32; n * n];
    g.bench_function("baseline_memcpy_4096x4096_f32", |b| {
        b.iter(|| {
            out.copy_from_slice(&src);
            black_box(&out);
        })
    });
    g.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, open, scan_and_dequant, exl2_dequant);
criterion_main!(benches);

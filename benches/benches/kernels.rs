//! Kernel benches: every CPU operation on 1 and 2 threads, reported as GB/s moved (bytes read
//! plus bytes written) and as a fraction of a memcpy of the same bytes measured in the same run.
//!
//! Two outputs:
//! - criterion groups (`kernels_1t`, `kernels_2t`) with byte throughput, for `cargo bench`;
//! - a summary table, timed here with the median of repeated runs, printed and written to
//!   `benches/results/kernels.md` and `kernels.json`, each figure with its memcpy fraction.
//!
//! Set `WEIGHTLIFT_BENCH_QUICK=1` for short runs and `WEIGHTLIFT_BENCH_FILTER=matvec` to run
//! only the kernels whose name contains it. The CUDA kernels have their own bench,
//! `kernels_cuda.rs`, which needs a GPU and the `cuda` feature.
#![allow(clippy::print_stdout)] // a bench reports on stdout

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use weightlift_benches::{
    COLS, CPU_ONLY_PRODUCT_TYPES, DEQUANT_TYPES, PRODUCT_TYPES, ROWS, random_weights,
};
use weightlift_kernels::cpu::kv::KvType;
use weightlift_kernels::cpu::quantize;
use weightlift_kernels::{FloatType, MatvecMode, QuantType, RopeParams, RopeStyle};

/// Median wall time of `f` over enough runs to fill ~`budget` (the project quotes medians, since
/// these machines are noisy; kernel and baseline get the same rule).
fn time_median(budget: Duration, mut f: impl FnMut()) -> Duration {
    f(); // warm-up (page faults, pool start)
    let mut t = Vec::new();
    let start = Instant::now();
    while t.len() < 5 || (start.elapsed() < budget && t.len() < 200) {
        let s = Instant::now();
        f();
        t.push(s.elapsed());
    }
    t.sort();
    t[t.len() / 2]
}

struct Case {
    name: String,
    bytes: usize,
    run: Box<dyn Fn() + Sync>,
}

fn cases() -> Vec<Case> {
    let mut v: Vec<Case> = Vec::new();
    let n = ROWS * COLS;
    for ty in DEQUANT_TYPES {
        let w = random_weights(ty, n);
        let bytes = w.len() + n * 4;
        let out = std::sync::Mutex::new(vec![0f32; n]);
        v.push(Case {
            name: format!("dequantize_{ty}_f32"),
            bytes,
            run: Box::new(move || {
                let mut o = out.lock().expect("bench lock");
                weightlift_kernels::dequantize_f32(ty, &w, &mut o).expect("dequantize");
                black_box(&*o);
            }),
        });
    }
    for ty in DEQUANT_TYPES {
        let w = random_weights(ty, n);
        let bytes = w.len() + n * 2;
        let out = std::sync::Mutex::new(vec![0u16; n]);
        v.push(Case {
            name: format!("dequantize_{ty}_f16"),
            bytes,
            run: Box::new(move || {
                let mut o = out.lock().expect("bench lock");
                weightlift_kernels::dequantize_f16(ty, &w, &mut o).expect("dequantize");
                black_box(&*o);
            }),
        });
    }
    for ty in PRODUCT_TYPES.into_iter().chain(CPU_ONLY_PRODUCT_TYPES) {
        for mode in [MatvecMode::Exact, MatvecMode::Q8] {
            let w = random_weights(ty, n);
            let x: Vec<f32> = (0..COLS).map(|i| (i as f32 * 0.01).sin()).collect();
            let mut xh = vec![0u16; COLS];
            weightlift_kernels::f32_to_f16_slice(&x, &mut xh).expect("convert");
            let m = if mode == MatvecMode::Exact {
                "exact"
            } else {
                "q8"
            };
            let y = std::sync::Mutex::new(vec![0f32; ROWS]);
            let w2 = w.clone();
            v.push(Case {
                name: format!("matvec_{ty}_f32_{m}_4096x4096"),
                bytes: w.len() + COLS * 4 + ROWS * 4,
                run: Box::new(move || {
                    let mut o = y.lock().expect("bench lock");
                    weightlift_kernels::matvec(mode, ty, &w, ROWS, COLS, &x, &mut o)
                        .expect("matvec");
                    black_box(&*o);
                }),
            });
            let y = std::sync::Mutex::new(vec![0f32; ROWS]);
            v.push(Case {
                name: format!("matvec_{ty}_f16_{m}_4096x4096"),
                bytes: w2.len() + COLS * 2 + ROWS * 4,
                run: Box::new(move || {
                    let mut o = y.lock().expect("bench lock");
                    weightlift_kernels::matvec_f16(mode, ty, &w2, ROWS, COLS, &xh, &mut o)
                        .expect("matvec");
                    black_box(&*o);
                }),
            });
        }
    }
    for ty in PRODUCT_TYPES.into_iter().chain(CPU_ONLY_PRODUCT_TYPES) {
        // prompt matmul: 4096×4096 against 32 tokens (bytes: weights + activations + output;
        // the md table also gives GFLOP/s for these rows)
        let nt = 32;
        let w = random_weights(ty, n);
        let x: Vec<f32> = (0..COLS * nt).map(|i| (i as f32 * 0.01).sin()).collect();
        let bytes = w.len() + x.len() * 4 + ROWS * nt * 4;
        for mode in [MatvecMode::Exact, MatvecMode::Q8] {
            let (w, x) = (w.clone(), x.clone());
            let y = std::sync::Mutex::new(vec![0f32; ROWS * nt]);
            let m = if mode == MatvecMode::Exact {
                "exact"
            } else {
                "q8"
            };
            v.push(Case {
                name: format!("matmul_{ty}_f32_{m}_4096x4096x32"),
                bytes,
                run: Box::new(move || {
                    let mut o = y.lock().expect("bench lock");
                    weightlift_kernels::matmul(mode, ty, &w, ROWS, COLS, &x, nt, &mut o, 64 << 20)
                        .expect("matmul");
                    black_box(&*o);
                }),
            });
        }
    }
    v.extend(decode_batch_cases());
    let f: Vec<f32> = (0..n).map(|i| (i as f32 * 1e-3).sin()).collect();
    let g: Vec<f32> = (0..n).map(|i| (i as f32 * 7e-4).cos()).collect();
    {
        let (f, o) = (f.clone(), std::sync::Mutex::new(vec![0u16; n]));
        v.push(Case {
            name: "convert_f32_f16".into(),
            bytes: n * 6,
            run: Box::new(move || {
                let mut o = o.lock().expect("bench lock");
                weightlift_kernels::f32_to_f16_slice(&f, &mut o).expect("convert");
            }),
        });
    }
    {
        let fb: Vec<u8> = f.iter().flat_map(|v| v.to_le_bytes()).collect();
        v.push(Case {
            name: "scan_f32".into(),
            bytes: n * 4,
            run: Box::new(move || {
                black_box(weightlift_kernels::scan_non_finite(QuantType::F32, &fb).expect("scan"));
            }),
        });
    }
    let row = 4096;
    let w_norm: Vec<f32> = (0..row).map(|i| 1.0 + i as f32 * 1e-4).collect();
    {
        let (f, o) = (f.clone(), std::sync::Mutex::new(vec![0f32; n]));
        v.push(Case {
            name: "rms_norm_f32".into(),
            bytes: n * 8,
            run: Box::new(move || {
                let mut o = o.lock().expect("bench lock");
                weightlift_kernels::rms_norm(&f, &w_norm, 1e-5, &mut o).expect("rms_norm");
            }),
        });
    }
    {
        let (f, o) = (f.clone(), std::sync::Mutex::new(vec![0f32; n]));
        v.push(Case {
            name: "softmax_f32".into(),
            bytes: n * 8,
            run: Box::new(move || {
                let mut o = o.lock().expect("bench lock");
                weightlift_kernels::softmax(&f, row, &mut o).expect("softmax");
            }),
        });
    }
    for style in [RopeStyle::Normal, RopeStyle::Neox] {
        let (f, o) = (f.clone(), std::sync::Mutex::new(vec![0f32; n]));
        let n_tok = n / (32 * 128);
        let pos: Vec<i32> = (0..n_tok as i32).collect();
        let p = RopeParams {
            style,
            head_dim: 128,
            n_dims: 128,
            freq_base: 10000.0,
            freq_scale: 1.0,
            attn_factor: 1.0,
        };
        let s = if style == RopeStyle::Normal {
            "norm"
        } else {
            "neox"
        };
        v.push(Case {
            name: format!("rope_{s}_f32"),
            bytes: n * 8,
            run: Box::new(move || {
                let mut o = o.lock().expect("bench lock");
                weightlift_kernels::rope(&f, &pos, &p, &mut o).expect("rope");
            }),
        });
    }
    {
        let (a, b, o) = (f.clone(), g.clone(), std::sync::Mutex::new(vec![0f32; n]));
        v.push(Case {
            name: "swiglu_f32".into(),
            bytes: n * 12,
            run: Box::new(move || {
                let mut o = o.lock().expect("bench lock");
                weightlift_kernels::swiglu(&a, &b, &mut o).expect("swiglu");
            }),
        });
    }
    {
        let (a, b, o) = (f.clone(), g.clone(), std::sync::Mutex::new(vec![0f32; n]));
        v.push(Case {
            name: "add_f32".into(),
            bytes: n * 12,
            run: Box::new(move || {
                let mut o = o.lock().expect("bench lock");
                weightlift_kernels::add(&a, &b, &mut o).expect("add");
            }),
        });
    }
    for kt in [KvType::Q8, KvType::Q4] {
        let f = f.clone();
        let q = std::sync::Mutex::new(vec![0u8; kt.bytes_for(n)]);
        let back = std::sync::Mutex::new(vec![0f32; n]);
        let qb = kt.bytes_for(n);
        v.push(Case {
            name: format!("kv_quantize_dequantize_{}", kt.name()),
            bytes: 2 * (n * 4 + qb),
            run: Box::new(move || {
                let mut q = q.lock().expect("bench lock");
                let mut b = back.lock().expect("bench lock");
                weightlift_kernels::kv_quantize(kt, &f, &mut q).expect("kv quantize");
                weightlift_kernels::kv_dequantize(kt, &q, &mut b).expect("kv dequantize");
            }),
        });
    }
    // quantise-on-load: a 1024 × 4096 tensor (f32 or the checkpoint's bf16 bytes) to ggml
    // blocks, bytes as llama.cpp's reference quantisers write them
    let qn = 1024 * COLS;
    let qf: Vec<f32> = (0..qn).map(|i| (i as f32 * 1e-3).sin() * 0.05).collect();
    let qbf: Vec<u8> = qf
        .iter()
        .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
        .collect();
    for ty in [QuantType::Q8_0, QuantType::Q4_K, QuantType::Q6_K] {
        let out_bytes = qn / ty.block_size() * ty.block_bytes();
        let (f, o) = (qf.clone(), std::sync::Mutex::new(vec![0u8; out_bytes]));
        v.push(Case {
            name: format!("quantize_{ty}_from_f32"),
            bytes: qn * 4 + out_bytes,
            run: Box::new(move || {
                let mut o = o.lock().expect("bench lock");
                quantize::quantize_rows(ty, &f, COLS, &mut o).expect("quantize");
            }),
        });
        let (b, o) = (qbf.clone(), std::sync::Mutex::new(vec![0u8; out_bytes]));
        v.push(Case {
            name: format!("quantize_{ty}_from_bf16"),
            bytes: qn * 2 + out_bytes,
            run: Box::new(move || {
                let mut o = o.lock().expect("bench lock");
                quantize::quantize_rows_from(ty, FloatType::BF16, &b, COLS, &mut o)
                    .expect("quantize");
            }),
        });
    }
    // LLM.int8: the weight quantiser (bf16 checkpoint bytes), and the mixed product at one and
    // 32 tokens with two outlier columns (bitsandbytes' default threshold 6.0)
    {
        let (b, q, sc) = (
            qbf.clone(),
            std::sync::Mutex::new(vec![0i8; qn]),
            std::sync::Mutex::new(vec![0f32; 1024]),
        );
        v.push(Case {
            name: "int8_quantize_from_bf16".into(),
            bytes: qn * 2 + qn + 1024 * 4,
            run: Box::new(move || {
                let (mut q, mut sc) = (
                    q.lock().expect("bench lock"),
                    sc.lock().expect("bench lock"),
                );
                weightlift_kernels::int8_quantize_rows_from(
                    FloatType::BF16,
                    &b,
                    COLS,
                    &mut q,
                    &mut sc,
                )
                .expect("int8 quantize");
            }),
        });
    }
    {
        let wf: Vec<f32> = (0..n).map(|i| (i as f32 * 1e-3).sin() * 0.05).collect();
        let (mut wq, mut ws) = (vec![0i8; n], vec![0f32; ROWS]);
        weightlift_kernels::int8_quantize_rows(&wf, COLS, &mut wq, &mut ws).expect("int8 quantize");
        let (wq, ws) = (std::sync::Arc::new(wq), std::sync::Arc::new(ws));
        for nt in [1usize, 32] {
            let mut x: Vec<f32> = (0..COLS * nt).map(|i| (i as f32 * 0.01).sin()).collect();
            x[17] = 9.0;
            x[COLS * (nt - 1) + 4000] = -7.0;
            let (wq, ws) = (wq.clone(), ws.clone());
            let y = std::sync::Mutex::new(vec![0f32; ROWS * nt]);
            v.push(Case {
                name: format!("int8_matmul_f32_{ROWS}x{COLS}x{nt}"),
                bytes: n + ROWS * 4 + x.len() * 4 + ROWS * nt * 4,
                run: Box::new(move || {
                    let mut o = y.lock().expect("bench lock");
                    let w = weightlift_kernels::Int8Weights {
                        q: &wq,
                        scales: &ws,
                        rows: ROWS,
                        cols: COLS,
                    };
                    weightlift_kernels::int8_matmul(&w, &x, nt, 6.0, &mut o).expect("int8 matmul");
                    black_box(&*o);
                }),
            });
        }
    }
    v
}

/// memcpy of `bytes / 2` bytes (it reads and writes each byte: `bytes` moved).
/// SmolLM2-135M's linear layers (30 layers of q, k, v, o: 576 → 576, 192, 192, 576; gate, up:
/// 576 → 1536; down: 1536 → 576) as one forward call of continuous batching meets them: each a
/// Q8-mode product with `n` tokens, one per sequence (Q4_1 weights, the Q8_0 head of 49152
/// rows apart).
const SMOLLM2_LAYERS: usize = 30;
const SMOLLM2_MATRICES: [(usize, usize); 7] = [
    (576, 576),
    (192, 576),
    (192, 576),
    (576, 576),
    (1536, 576),
    (1536, 576),
    (576, 1536),
];

/// Decode-batch cases: `decode_{what}_x{n}` runs the matrices with `n` tokens through
/// `matmul`, `decode_{what}_matvec_x{n}` through `n` matvecs (one per token), both Q8 mode,
/// so their ratio in one run is the batch's gain. Distinct copies of every layer's weights, so
/// the forward streams them from memory as a decode step does. The K-quant rows take a
/// 2048 × 2048 matrix (SmolLM2's 576 is not a multiple of 256).
fn decode_batch_cases() -> Vec<Case> {
    let mut v = Vec::new();
    let mats: Vec<(QuantType, usize, usize, std::sync::Arc<Vec<u8>>)> = (0..SMOLLM2_LAYERS)
        .flat_map(|_| SMOLLM2_MATRICES)
        .map(|(r, c)| {
            (
                QuantType::Q4_1,
                r,
                c,
                random_weights(QuantType::Q4_1, r * c).into(),
            )
        })
        .collect();
    let head = vec![(
        QuantType::Q8_0,
        49152,
        576,
        std::sync::Arc::new(random_weights(QuantType::Q8_0, 49152 * 576)),
    )];
    let k_mats = |ty: QuantType| vec![(ty, 2048, 2048, random_weights(ty, 2048 * 2048).into())];
    let sets = [
        ("smollm2_layers_q4_1", mats),
        ("smollm2_head_q8_0", head),
        ("q4_k_2048x2048", k_mats(QuantType::Q4_K)),
        ("q6_k_2048x2048", k_mats(QuantType::Q6_K)),
        ("q5_k_2048x2048", k_mats(QuantType::Q5_K)),
        ("q3_k_2048x2048", k_mats(QuantType::Q3_K)),
        ("q2_k_2048x2048", k_mats(QuantType::Q2_K)),
    ];
    for (what, set) in sets {
        let bytes: usize = set.iter().map(|m| m.3.len()).sum();
        // every count for the layers; the head at 1, 8 and 16 (a full run times each case for
        // several seconds); the K-quants also at 2 to 4, where `batch_min_tokens` chooses
        // between the batched kernels and one matvec a token
        let counts: &[usize] = if what.starts_with("smollm2_layers") {
            &[1, 2, 4, 8, 12, 16]
        } else if what.starts_with("smollm2_head") {
            &[1, 8, 16]
        } else {
            &[1, 2, 3, 4, 8, 16]
        };
        for &n_tok in counts {
            for per_token in [false, true] {
                let set = set.clone();
                let x: Vec<f32> = (0..2048 * n_tok)
                    .map(|i| (i as f32 * 0.013).sin())
                    .collect();
                let y = std::sync::Mutex::new(vec![0f32; 49152 * n_tok]);
                let name = if per_token {
                    format!("decode_{what}_matvec_x{n_tok}")
                } else {
                    format!("decode_{what}_x{n_tok}")
                };
                v.push(Case {
                    name,
                    bytes,
                    run: Box::new(move || {
                        let mut o = y.lock().expect("bench lock");
                        for (ty, rows, cols, w) in &set {
                            let (x, o) = (&x[..cols * n_tok], &mut o[..rows * n_tok]);
                            if per_token {
                                for (xt, ot) in x.chunks_exact(*cols).zip(o.chunks_exact_mut(*rows))
                                {
                                    weightlift_kernels::matvec(
                                        MatvecMode::Q8,
                                        *ty,
                                        w,
                                        *rows,
                                        *cols,
                                        xt,
                                        ot,
                                    )
                                    .expect("matvec");
                                }
                            } else {
                                weightlift_kernels::matmul(
                                    MatvecMode::Q8,
                                    *ty,
                                    w,
                                    *rows,
                                    *cols,
                                    x,
                                    n_tok,
                                    o,
                                    64 << 20,
                                )
                                .expect("matmul");
                            }
                        }
                        black_box(&*o);
                    }),
                });
            }
        }
    }
    v
}

fn memcpy_case(bytes: usize) -> impl Fn() {
    let src = vec![1u8; bytes / 2];
    let dst = std::sync::Mutex::new(vec![0u8; bytes / 2]);
    move || {
        let mut d = dst.lock().expect("bench lock");
        d.copy_from_slice(&src);
        black_box(&*d);
    }
}

/// DRAM read bandwidth on `threads` threads: a sum over 512 MiB (far past L2; note that the
/// bench VM reports a 480 MiB L3, so this is the best "memory" figure we can take here).
fn dram_read_gbs(threads: usize, budget: Duration) -> f64 {
    let words = 64usize << 20; // 512 MiB of u64
    let buf: Vec<u64> = (0..words as u64).collect();
    let t = time_median(budget, || {
        let per = words / threads;
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(per)
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, v| a.wrapping_add(*v))))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0, u64::wrapping_add)
        });
        black_box(total);
    });
    (words * 8) as f64 / t.as_secs_f64() / 1e9
}

fn bench(c: &mut Criterion) {
    let quick = std::env::var("WEIGHTLIFT_BENCH_QUICK").is_ok_and(|v| v == "1");
    let budget = if quick {
        Duration::from_millis(400)
    } else {
        Duration::from_secs(2)
    };
    let filter = std::env::var("WEIGHTLIFT_BENCH_FILTER").unwrap_or_default();
    let all: Vec<Case> = cases()
        .into_iter()
        .filter(|c| c.name.contains(&filter))
        .collect();
    let mut rows = Vec::new();
    let dram = [dram_read_gbs(1, budget), dram_read_gbs(2, budget)];
    for threads in [1usize, 2] {
        let pool = weightlift_kernels::thread_pool(threads).expect("thread pool");
        let mut g = c.benchmark_group(format!("kernels_{threads}t"));
        g.sample_size(10);
        g.warm_up_time(Duration::from_millis(if quick { 100 } else { 500 }));
        g.measurement_time(if quick {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(3)
        });
        for case in &all {
            // memcpy of the same bytes, single-threaded, timed right before the case
            let mc = memcpy_case(case.bytes);
            let t_mem = time_median(budget, &mc);
            let t = pool.install(|| time_median(budget, || (case.run)()));
            let gbs = case.bytes as f64 / t.as_secs_f64() / 1e9;
            let mem_gbs = case.bytes as f64 / t_mem.as_secs_f64() / 1e9;
            rows.push((case.name.clone(), threads, gbs, mem_gbs, t));
            g.throughput(Throughput::Bytes(case.bytes as u64));
            g.bench_function(&case.name, |b| b.iter(|| pool.install(|| (case.run)())));
        }
        g.finish();
    }
    report(&rows, dram, filter.is_empty());
}

/// Multiply-adds × 2 of a `..._{rows}x{cols}[x{tokens}]` product case, from its name.
fn flops(name: &str) -> Option<f64> {
    let dims: Vec<f64> = name
        .rsplit('_')
        .next()?
        .split('x')
        .map(|d| d.parse::<f64>().ok())
        .collect::<Option<_>>()?;
    (dims.len() >= 2).then(|| 2.0 * dims.iter().product::<f64>())
}

fn report(rows: &[(String, usize, f64, f64, Duration)], dram: [f64; 2], write: bool) {
    let mut md = format!(
        "# Kernel bench (CPU)\n\nGB/s moved (bytes read + written); `vs memcpy` divides by a single-thread memcpy of the same byte count timed in the same run; `vs DRAM read` divides by a sum over 512 MiB on the same number of threads ({:.2} GB/s on 1 thread, {:.2} GB/s on 2). Times are medians of repeated runs. CUDA: see `kernels_cuda.rs`, which times only where a GPU is present (none was on this machine).\n\n| kernel | threads | time | GB/s | memcpy GB/s | vs memcpy | vs DRAM read | GFLOP/s |\n|---|---|---|---|---|---|---|---|\n",
        dram[0], dram[1]
    );
    let mut json = String::from("[\n");
    for (i, (name, th, gbs, mem, t)) in rows.iter().enumerate() {
        let dr = dram[(*th).clamp(1, 2) - 1];
        let gflops = flops(name).map(|f| f / t.as_secs_f64() / 1e9);
        md.push_str(&format!(
            "| {name} | {th} | {:.3} ms | {gbs:.2} | {mem:.2} | {:.0}% | {:.0}% | {} |\n",
            t.as_secs_f64() * 1e3,
            100.0 * gbs / mem,
            100.0 * gbs / dr,
            gflops.map_or("—".to_string(), |g| format!("{g:.1}"))
        ));
        json.push_str(&format!(
            "  {{\"kernel\": \"{name}\", \"threads\": {th}, \"seconds\": {:.6e}, \"gb_per_s\": {gbs:.4}, \"memcpy_gb_per_s\": {mem:.4}, \"fraction_of_memcpy\": {:.4}, \"dram_read_gb_per_s\": {:.4}, \"gflop_per_s\": {}}}{}\n",
            t.as_secs_f64(),
            gbs / mem,
            dram[(*th).clamp(1, 2) - 1],
            gflops.map_or("null".to_string(), |g| format!("{g:.2}")),
            if i + 1 < rows.len() { "," } else { "" }
        ));
    }
    json.push_str("]\n");
    println!("\n{md}");
    // a filtered run prints its rows but leaves the full results in place
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    if write && std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join("kernels.md"), &md);
        let _ = std::fs::write(dir.join("kernels.json"), &json);
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);

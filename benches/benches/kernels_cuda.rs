//! CUDA kernel bench: the same operations and shapes as `kernels.rs`, run through the
//! [`Backend`] trait on `cuda:0`, as GB/s moved and as a fraction of a device-to-device copy of
//! the same bytes timed in the same run.
//!
//! Every timed run ends with a device synchronise, so a figure covers the work, not the launch.
//! Build with `--features cuda` (`make bench` does); without the feature, or without a GPU and
//! driver, the bench says why and times nothing. Results go to `benches/results/kernels_cuda.md`
//! and `.json` only when a GPU was timed. `WEIGHTLIFT_BENCH_QUICK=1` and
//! `WEIGHTLIFT_BENCH_FILTER` work as in `kernels.rs`.
#![allow(clippy::print_stdout)] // a bench reports on stdout

use std::time::{Duration, Instant};

use weightlift_benches::{COLS, DEQUANT_TYPES, PRODUCT_TYPES, ROWS, random_weights};
use weightlift_kernels::{
    Backend, CudaBackend, FloatType, KernelError, KvFormat, MatvecMode, Op, QuantType, RopeParams,
    RopeStyle,
};

type Buf = <CudaBackend as Backend>::Buffer;

fn f32_bytes(v: impl Iterator<Item = f32>) -> Vec<u8> {
    v.flat_map(f32::to_le_bytes).collect()
}

/// Median wall time of `f` (which ends with a device synchronise) over ~`budget`.
fn time_median(budget: Duration, mut f: impl FnMut()) -> Duration {
    f();
    let mut t = Vec::new();
    let start = Instant::now();
    while t.len() < 5 || (start.elapsed() < budget && t.len() < 500) {
        let s = Instant::now();
        f();
        t.push(s.elapsed());
    }
    t.sort();
    t[t.len() / 2]
}

/// One case: its name, bytes moved, and a closure that enqueues it on the backend.
struct Case<'a> {
    name: String,
    bytes: usize,
    run: Box<dyn FnMut() -> weightlift_kernels::Result<()> + 'a>,
}

fn upload(be: &CudaBackend, host: &[u8]) -> weightlift_kernels::Result<Buf> {
    let mut b = be.alloc(host.len().max(1))?;
    be.copy_from_host(host, &mut b, 0)?;
    Ok(b)
}

/// Device buffers leaked for the bench's lifetime, so that cases can borrow them freely.
fn leak(b: Buf) -> &'static mut Buf {
    Box::leak(Box::new(b))
}

fn cases(be: &CudaBackend) -> weightlift_kernels::Result<Vec<Case<'_>>> {
    let n = ROWS * COLS;
    let mut v = Vec::new();
    for out in [FloatType::F32, FloatType::F16] {
        let ob = if out == FloatType::F32 { 4 } else { 2 };
        for ty in DEQUANT_TYPES {
            let w = random_weights(ty, n);
            let bytes = w.len() + n * ob;
            let src = &*leak(upload(be, &w)?);
            let dst = leak(be.alloc(n * ob)?);
            v.push(Case {
                name: format!("dequantize_{ty}_{}", if ob == 4 { "f32" } else { "f16" }),
                bytes,
                run: Box::new(move || {
                    be.run(Op::Dequantize {
                        ty,
                        out,
                        n,
                        src,
                        dst: &mut *dst,
                    })
                }),
            });
        }
    }
    for nt in [1, 32] {
        for ty in PRODUCT_TYPES {
            for mode in [MatvecMode::Exact, MatvecMode::Q8] {
                for act in [FloatType::F32, FloatType::F16] {
                    if nt > 1 && act == FloatType::F16 {
                        continue;
                    }
                    let w = random_weights(ty, n);
                    let xf = (0..COLS * nt).map(|i| (i as f32 * 0.01).sin());
                    let x: Vec<u8> = if act == FloatType::F32 {
                        f32_bytes(xf)
                    } else {
                        let xf: Vec<f32> = xf.collect();
                        let mut h = vec![0u16; xf.len()];
                        weightlift_kernels::f32_to_f16_slice(&xf, &mut h)?;
                        h.iter().flat_map(|v| v.to_le_bytes()).collect()
                    };
                    let bytes = w.len() + x.len() + ROWS * nt * 4;
                    let (w, x) = (&*leak(upload(be, &w)?), &*leak(upload(be, &x)?));
                    let y = leak(be.alloc(ROWS * nt * 4)?);
                    let m = if mode == MatvecMode::Exact {
                        "exact"
                    } else {
                        "q8"
                    };
                    let a = if act == FloatType::F32 { "f32" } else { "f16" };
                    let name = if nt == 1 {
                        format!("matvec_{ty}_{a}_{m}_4096x4096")
                    } else {
                        format!("matmul_{ty}_{a}_{m}_4096x4096x{nt}")
                    };
                    v.push(Case {
                        name,
                        bytes,
                        run: Box::new(move || {
                            be.run(Op::Matmul {
                                ty,
                                mode,
                                act,
                                rows: ROWS,
                                cols: COLS,
                                n_tok: nt,
                                max_dq_size: 64 << 20,
                                w,
                                x,
                                y: &mut *y,
                            })
                        }),
                    });
                }
            }
        }
    }
    // The float weights' bandwidth kernels at decode, on a 1.1B llama's shapes (projections,
    // MLP, head) and an 8B's MLP: every weight byte read once, so the copy ratio is the
    // kernel's share of the memory bandwidth (the kernels aim at 70 % or more).
    for (rows, cols) in [
        (2048, 2048),
        (5632, 2048),
        (2048, 5632),
        (32000, 2048),
        (4096, 14336),
        (14336, 4096),
    ] {
        for ty in [QuantType::F16, QuantType::BF16, QuantType::F32] {
            let w = random_weights(ty, rows * cols);
            let x = f32_bytes((0..cols).map(|i| (i as f32 * 0.01).sin()));
            let bytes = w.len() + x.len() + rows * 4;
            let (w, x) = (&*leak(upload(be, &w)?), &*leak(upload(be, &x)?));
            let y = leak(be.alloc(rows * 4)?);
            v.push(Case {
                name: format!("matvec_{ty}_f32_exact_{rows}x{cols}"),
                bytes,
                run: Box::new(move || {
                    be.run(Op::Matmul {
                        ty,
                        mode: MatvecMode::Exact,
                        act: FloatType::F32,
                        rows,
                        cols,
                        n_tok: 1,
                        max_dq_size: 64 << 20,
                        w,
                        x,
                        y: &mut *y,
                    })
                }),
            });
        }
    }
    let f = &*leak(upload(
        be,
        &f32_bytes((0..n).map(|i| (i as f32 * 1e-3).sin())),
    )?);
    let g = &*leak(upload(
        be,
        &f32_bytes((0..n).map(|i| (i as f32 * 7e-4).cos())),
    )?);
    let row = 4096;
    let w_norm = &*leak(upload(
        be,
        &f32_bytes((0..row).map(|i| 1.0 + i as f32 * 1e-4)),
    )?);
    let n_tok = n / (32 * 128);
    let pos: Vec<u8> = (0..n_tok as i32).flat_map(i32::to_le_bytes).collect();
    let pos = &*leak(upload(be, &pos)?);
    let o = leak(be.alloc(n * 4)?);
    v.push(Case {
        name: "convert_f32_f16".into(),
        bytes: n * 6,
        run: Box::new(move || {
            be.run(Op::ConvertToF16 {
                from: FloatType::F32,
                n,
                src: f,
                dst: &mut *o,
            })
        }),
    });
    v.push(Case {
        name: "scan_f32".into(),
        bytes: n * 4,
        run: Box::new(move || be.scan_non_finite(QuantType::F32, f, n * 4).map(drop)),
    });
    let o = leak(be.alloc(n * 4)?);
    v.push(Case {
        name: "rms_norm_f32".into(),
        bytes: n * 8,
        run: Box::new(move || {
            be.run(Op::RmsNorm {
                n_rows: n / row,
                n_cols: row,
                eps: 1e-5,
                x: f,
                weight: w_norm,
                out: &mut *o,
            })
        }),
    });
    let o = leak(be.alloc(n * 4)?);
    v.push(Case {
        name: "softmax_f32".into(),
        bytes: n * 8,
        run: Box::new(move || {
            be.run(Op::Softmax {
                n_rows: n / row,
                n_cols: row,
                x: f,
                out: &mut *o,
            })
        }),
    });
    for style in [RopeStyle::Normal, RopeStyle::Neox] {
        let params = RopeParams {
            style,
            head_dim: 128,
            n_dims: 128,
            freq_base: 10000.0,
            freq_scale: 1.0,
        };
        let s = if style == RopeStyle::Normal {
            "norm"
        } else {
            "neox"
        };
        let o = leak(be.alloc(n * 4)?);
        v.push(Case {
            name: format!("rope_{s}_f32"),
            bytes: n * 8,
            run: Box::new(move || {
                be.run(Op::Rope {
                    params,
                    n_tok,
                    n_heads: 32,
                    x: f,
                    positions: pos,
                    out: &mut *o,
                })
            }),
        });
    }
    let o = leak(be.alloc(n * 4)?);
    v.push(Case {
        name: "swiglu_f32".into(),
        bytes: n * 12,
        run: Box::new(move || {
            be.run(Op::SwiGlu {
                n,
                gate: f,
                up: g,
                out: &mut *o,
            })
        }),
    });
    let o = leak(be.alloc(n * 4)?);
    v.push(Case {
        name: "add_f32".into(),
        bytes: n * 12,
        run: Box::new(move || {
            be.run(Op::Add {
                n,
                a: f,
                b: g,
                out: &mut *o,
            })
        }),
    });
    for format in [KvFormat::E4M3, KvFormat::Q8, KvFormat::Q4] {
        let qb = format.byte_at(n);
        let q = leak(be.alloc(qb)?);
        let o = leak(be.alloc(n * 4)?);
        v.push(Case {
            name: format!("kv_store_load_{}", format.name()),
            bytes: 2 * (n * 4 + qb),
            run: Box::new(move || {
                be.run(Op::KvStore {
                    format,
                    n,
                    src: f,
                    dst: &mut *q,
                })?;
                be.run(Op::KvLoad {
                    format,
                    n,
                    src: &*q,
                    dst: &mut *o,
                })
            }),
        });
    }
    Ok(v)
}

fn main() {
    let be = match CudaBackend::new(0) {
        Ok(be) => Box::leak(Box::new(be)),
        // A root `cargo bench` builds this without the feature, and a GPU-less machine runs it:
        // both are normal, so say which and exit cleanly rather than fail the whole run.
        Err(KernelError::NotCompiledWithCuda { .. }) => {
            println!(
                "CUDA kernel bench: not timed: built without the `cuda` feature \
                 (run `cargo bench -p weightlift-benches --features cuda` or `make bench`)"
            );
            return;
        }
        Err(e) => {
            println!("CUDA kernel bench: not timed: no usable GPU here: {e}");
            return;
        }
    };
    if let Err(e) = run(be) {
        println!("CUDA kernel bench failed: {e}");
        std::process::exit(1);
    }
}

fn run(be: &'static CudaBackend) -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::var("WEIGHTLIFT_BENCH_QUICK").is_ok_and(|v| v == "1");
    let budget = Duration::from_millis(if quick { 300 } else { 1500 });
    let filter = std::env::var("WEIGHTLIFT_BENCH_FILTER").unwrap_or_default();
    let mut rows = Vec::new();
    for mut case in cases(be)?.into_iter().filter(|c| c.name.contains(&filter)) {
        // Baseline: a device-to-device copy of half the bytes (it reads and writes each one).
        let half = (case.bytes / 2).max(1);
        let src = be.alloc(half)?;
        let mut dst = be.alloc(half)?;
        let mut err = None;
        let t_copy = time_median(budget, || {
            if let Err(e) = be
                .copy(&src, 0, &mut dst, 0, half)
                .and_then(|()| be.synchronize())
            {
                err.get_or_insert(e);
            }
        });
        let t = time_median(budget, || {
            if let Err(e) = (case.run)().and_then(|()| be.synchronize()) {
                err.get_or_insert(e);
            }
        });
        if let Some(e) = err {
            return Err(e.into());
        }
        let gbs = case.bytes as f64 / t.as_secs_f64() / 1e9;
        let copy_gbs = case.bytes as f64 / t_copy.as_secs_f64() / 1e9;
        println!(
            "{:<40} {:>9.3} ms {gbs:>8.1} GB/s  copy {copy_gbs:>8.1} GB/s  {:>4.0}%",
            case.name,
            t.as_secs_f64() * 1e3,
            100.0 * gbs / copy_gbs
        );
        rows.push((case.name, t, gbs, copy_gbs));
    }
    if !filter.is_empty() {
        return Ok(());
    }
    let mut md = format!(
        "# Kernel bench (CUDA, {})\n\nGB/s moved (bytes read + written); `vs copy` divides by a device-to-device copy of the same bytes timed in the same run. Each timed run ends with a device synchronise. Times are medians.\n\n| kernel | time | GB/s | copy GB/s | vs copy |\n|---|---|---|---|---|\n",
        be.name()
    );
    let mut json = String::from("[\n");
    for (i, (name, t, gbs, copy)) in rows.iter().enumerate() {
        md.push_str(&format!(
            "| {name} | {:.3} ms | {gbs:.1} | {copy:.1} | {:.0}% |\n",
            t.as_secs_f64() * 1e3,
            100.0 * gbs / copy
        ));
        json.push_str(&format!(
            "  {{\"kernel\": \"{name}\", \"seconds\": {:.6e}, \"gb_per_s\": {gbs:.3}, \"copy_gb_per_s\": {copy:.3}}}{}\n",
            t.as_secs_f64(),
            if i + 1 < rows.len() { "," } else { "" }
        ));
    }
    json.push_str("]\n");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("kernels_cuda.md"), md)?;
    std::fs::write(dir.join("kernels_cuda.json"), json)?;
    Ok(())
}

//! Kernel bench through the [`Backend`] trait on one device: the CUDA backend on `cuda:0` (the
//! default), or the CPU backend with `--device cpu`, which is how the GPU bundle's `--cpu`
//! rehearsal runs the same cases and writes the same tables on a machine without a GPU.
//!
//! Every figure is GB/s moved (bytes read plus written) and a share of the device's copy
//! bandwidth: a device-to-device copy of a large buffer, timed in the same run before and after
//! the cases (the shares divide by the faster of the two). Two tables:
//! - decode's matrix-vector products, for each shape from 2048×2048 to 4096×14336 and each
//!   weight type the CUDA matmul runs (`sources::CUDA_EXACT_TYPES` exactly,
//!   `sources::CUDA_Q8_TYPES` with 8-bit activations): µs per call, GB/s and % of the copy;
//!   the `q8` rows on the narrow lanes (`WEIGHTLIFT_Q8V=narrow`) for every type; then the
//!   wide-lane Q8 kernels (`q8-wide`, the default for their types, on a second backend of the
//!   same device) for `sources::Q8_WIDE_WEIGHT_TYPES` on the same shapes
//!   and the 32000×2048 head, and the Q8 rows of those types on the head for comparison;
//!   their gate and up with SwiGLU (`q8-wide`, fused and separate) join the second table;
//! - the other operations at llama-7B's 4096×4096 (dequantisation, 32-token products, norms,
//!   RoPE, the KV codecs);
//! - the prompt-product route table: TinyLlama's three shapes at 2 to 512 tokens for bf16, f16,
//!   q8_0 and q4_k in exact and fast mode, µs per call through the backend's own kernels and
//!   through cuBLAS, and in fast mode for the quantised types through the int8 tensor-core
//!   kernels `q8_mma_{type}` (three more backends of the device, one with cuBLAS from one
//!   token, one with the int8 kernels from one token and one with neither,
//!   `CudaBackend::with_cublas_min_tokens`), and per type and mode the counts from which the
//!   int8 kernels and cuBLAS win for good (`sources::prompt_crossovers`), printed as the lines
//!   of `sources::MMQ_MIN_TOKENS_BY_TYPE` and `sources::CUBLAS_MIN_TOKENS_BY_TYPE` that would
//!   set them. On the CPU device the cuBLAS and int8 columns say not applicable, and fewer
//!   counts are timed.
//!
//! A sample queues `k` calls and ends with one device synchronise, `k` chosen so that a sample
//! lasts about [`SAMPLE`]; the figure is the median of the samples' per-call times. Calls queued
//! back to back overlap their launch latency as decode's do, where one call per synchronise
//! would time the launch and the synchronise instead of the kernel. The weights of a product
//! rotate over copies that hold [`ROTATE_BYTES`] together, several times an H100's or H200's L2
//! cache, so each call reads its weights from device memory as decode does (every layer's
//! weights are different) rather than from the cache.
//!
//! Arguments: `--device cuda|cpu` and `--out DIR` (default `benches/results`); `cargo bench`
//! adds `--bench`, which is ignored. Without the `cuda` feature, a GPU or a driver, the CUDA
//! device says why and times nothing. `WEIGHTLIFT_BENCH_QUICK=1` and `WEIGHTLIFT_BENCH_FILTER`
//! work as in `kernels.rs`. Writes `kernels_cuda.md` and `.json` (`kernels_cuda_on_cpu.*` for
//! the CPU device) when every case ran.
#![allow(clippy::print_stdout)] // a bench reports on stdout

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use weightlift_benches::{COLS, DEQUANT_TYPES, PRODUCT_TYPES, ROWS, random_weights};
use weightlift_kernels::sources::{
    CUBLAS_MIN_TOKENS, CUDA_EXACT_TYPES, CUDA_Q8_TYPES, CublasMinTokens, MMQ_TYPES,
    Q8_WIDE_WEIGHT_TYPES, Q8Decode, RouteTimes, cublas_route, prompt_crossovers,
};
use weightlift_kernels::{
    Backend, CpuBackend, CudaBackend, FloatType, KernelError, KvFormat, MatvecMode, Op, Product,
    QuantType, Result, RopeParams, RopeStyle, matmul_swiglu_unfused, rope_inv_freqs,
    rope_kv_store_unfused,
};

/// Decode's matrix-vector shapes, rows × cols: TinyLlama-1.1B's attention, FFN up and FFN down
/// (2048×2048, 5632×2048, 2048×5632), then llama-7B's and llama-3-8B's (4096×4096, 14336×4096,
/// 4096×14336).
const MATVEC_SHAPES: [(usize, usize); 6] = [
    (2048, 2048),
    (5632, 2048),
    (2048, 5632),
    (4096, 4096),
    (14336, 4096),
    (4096, 14336),
];

/// The head of a 1.1B llama (32,000 rows of 2,048 values), for the wide-lane Q8 kernels.
const HEAD_SHAPE: (usize, usize) = (32000, 2048);

/// Weight types a llama checkpoint may hold; those missing from the CUDA lists are named as
/// such under the table, so a kernel that is absent reads as absent, not as slow.
const CHECKPOINT_TYPES: [QuantType; 10] = [
    QuantType::F32,
    QuantType::F16,
    QuantType::BF16,
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q8_0,
    QuantType::Q4_K,
    QuantType::Q6_K,
];

/// The route table's shapes: TinyLlama-1.1B's attention, FFN up and FFN down.
const ROUTE_SHAPES: [(usize, usize); 3] = [(2048, 2048), (5632, 2048), (2048, 5632)];
/// The route table's weight types.
const ROUTE_TYPES: [QuantType; 4] = [
    QuantType::BF16,
    QuantType::F16,
    QuantType::Q8_0,
    QuantType::Q4_K,
];
/// The route table's token counts.
const ROUTE_TOKENS: [usize; 10] = [2, 4, 8, 16, 24, 32, 48, 64, 128, 512];
/// The CPU rehearsal's: its products take most of a second at 512 tokens.
const ROUTE_TOKENS_CPU: [usize; 4] = [2, 8, 32, 64];
/// `max_dq_size` of every product: enough for a whole matrix's chunk.
const MAX_DQ_SIZE: usize = 64 << 20;

/// Bytes of weight copies a product rotates over (H100: 50 MB of L2, H200: 60 MB).
const ROTATE_BYTES: usize = 256 << 20;
/// At most this many copies, for the smallest matrices.
const MAX_COPIES: usize = 256;
/// How long one sample of queued calls should last.
const SAMPLE: Duration = Duration::from_millis(2);
/// Bytes of each buffer of the copy baseline (a copy moves twice this).
const COPY_BYTES: usize = 512 << 20;

/// The device the bench runs on, chosen by `--device`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Device {
    Cuda,
    Cpu,
}

#[derive(Clone)]
struct Args {
    device: Device,
    out: PathBuf,
    quick: bool,
    filter: String,
}

impl Args {
    fn parse() -> std::result::Result<Self, String> {
        let mut device = Device::Cuda;
        let mut out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results");
        let mut it = std::env::args().skip(1);
        while let Some(a) = it.next() {
            match a.as_str() {
                "--device" => match it.next().as_deref() {
                    Some("cuda") => device = Device::Cuda,
                    Some("cpu") => device = Device::Cpu,
                    other => {
                        return Err(format!(
                            "--device takes cuda or cpu, got {}",
                            other.unwrap_or("nothing")
                        ));
                    }
                },
                "--out" => match it.next() {
                    Some(d) => out = PathBuf::from(d),
                    None => return Err("--out takes a folder".into()),
                },
                _ => {} // `cargo bench` passes --bench; criterion-style flags mean nothing here
            }
        }
        Ok(Self {
            device,
            out,
            quick: std::env::var("WEIGHTLIFT_BENCH_QUICK").is_ok_and(|v| v == "1"),
            filter: std::env::var("WEIGHTLIFT_BENCH_FILTER").unwrap_or_default(),
        })
    }

    /// Time spent sampling one case, after its warm-up.
    fn budget(&self) -> Duration {
        Duration::from_millis(if self.quick { 20 } else { 60 })
    }

    fn min_samples(&self) -> usize {
        if self.quick { 3 } else { 5 }
    }
}

fn main() -> ExitCode {
    let args = match Args::parse() {
        Ok(a) => a,
        Err(e) => {
            println!("kernel bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let done = match args.device {
        // the `q8` rows are the narrow lanes for every type, the `q8-wide` rows (the default
        // for their types) come from a backend of their own
        Device::Cuda => match CudaBackend::new(0).map(|b| b.with_q8_decode(Q8Decode::Narrow)) {
            Ok(be) => cuda_bench(&be, &args),
            // A root `cargo bench` builds this without the feature, and a GPU-less machine runs
            // it: both are normal, so say which and end cleanly rather than fail the whole run.
            Err(KernelError::NotCompiledWithCuda { .. }) => {
                println!(
                    "CUDA kernel bench: not timed: built without the `cuda` feature \
                     (run `cargo bench -p weightlift-benches --features cuda` or `make bench`)"
                );
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                println!("CUDA kernel bench: not timed: no usable GPU here: {e}");
                return ExitCode::SUCCESS;
            }
        },
        // the CPU has no wide lanes: its rows run its own Q8 mode, so the tables keep their
        // shape; nor cuBLAS or int8 tensor cores: the route table has its kernels' column only
        Device::Cpu => {
            let cpu = CpuBackend::new();
            let routes = Routes {
                kernels: &cpu,
                mma: Err("not applicable: the CPU backend has no int8 tensor-core route".into()),
                cublas: Err("not applicable: the CPU backend has no cuBLAS route".into()),
            };
            bench(&cpu, &cpu, &routes, &args)
        }
    };
    match done {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            println!("kernel bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The bench on `be` (`cuda:0` with decode's narrow Q8 lanes) and more backends of the same
/// device: decode's wide Q8 lanes (the default), and the prompt products forced onto each
/// route.
fn cuda_bench(be: &CudaBackend, args: &Args) -> Result<bool> {
    let wide = CudaBackend::new(0)?.with_q8_decode(Q8Decode::Wide);
    let kernels = CudaBackend::new(0)?.with_cublas_min_tokens(CublasMinTokens::uniform(usize::MAX));
    let cublas = CudaBackend::new(0)?.with_cublas_min_tokens(CublasMinTokens::uniform(1));
    let mma = CudaBackend::new(0)?
        .with_cublas_min_tokens(CublasMinTokens::uniform(usize::MAX).with_mma_every(1));
    let routes = Routes {
        kernels: &kernels,
        mma: match mma.compute_capability() {
            cc if cc >= (8, 0) => Ok(&mma),
            cc => Err(format!("no int8 tensor cores: compute capability {cc:?}")),
        },
        cublas: match cublas.cublas_ready() {
            Ok(()) => Ok(&cublas),
            Err(e) => Err(format!("no cuBLAS on this device: {e}")),
        },
    };
    bench(be, &wide, &routes, args)
}

/// Median time of one call of `call(i)` (`i` counts the calls, so a case can rotate its
/// buffers), in samples of `k` queued calls ended by one synchronise.
fn per_call<B: Backend>(
    be: &B,
    args: &Args,
    mut call: impl FnMut(usize) -> Result<()>,
) -> Result<Duration> {
    call(0)?; // warm-up: module load, first-touch of the pages
    be.synchronize()?;
    let s = Instant::now();
    call(1)?;
    be.synchronize()?;
    let one = s.elapsed().max(Duration::from_nanos(100));
    let k = (SAMPLE.as_secs_f64() / one.as_secs_f64()).clamp(1.0, 512.0) as usize;
    let mut i = 2;
    let mut t = Vec::new();
    let start = Instant::now();
    while t.len() < args.min_samples() || (start.elapsed() < args.budget() && t.len() < 200) {
        let s = Instant::now();
        for _ in 0..k {
            call(i)?;
            i += 1;
        }
        be.synchronize()?;
        t.push(s.elapsed() / k as u32);
    }
    t.sort();
    Ok(t[t.len() / 2])
}

fn upload<B: Backend>(be: &B, host: &[u8]) -> Result<B::Buffer> {
    let mut b = be.alloc(host.len().max(1))?;
    be.copy_from_host(host, &mut b, 0)?;
    Ok(b)
}

fn f32_bytes(v: impl Iterator<Item = f32>) -> Vec<u8> {
    v.flat_map(f32::to_le_bytes).collect()
}

/// The copy baseline in GB/s (bytes read plus written), timed as the cases are.
fn copy_gbs<B: Backend>(be: &B, args: &Args, bytes: usize) -> Result<f64> {
    let src = be.alloc(bytes)?;
    let mut dst = be.alloc(bytes)?;
    let t = per_call(be, args, |_| be.copy(&src, 0, &mut dst, 0, bytes))?;
    Ok(2.0 * bytes as f64 / t.as_secs_f64() / 1e9)
}

/// One measured row of a table.
struct Row {
    name: String,
    shape: String,
    ty: String,
    mode: String,
    bytes: usize,
    /// The median per-call time, or why the case did not run.
    time: std::result::Result<Duration, String>,
}

impl Row {
    fn gbs(&self) -> Option<f64> {
        self.time
            .as_ref()
            .ok()
            .map(|t| self.bytes as f64 / t.as_secs_f64() / 1e9)
    }
}

/// A case refused by name (a type the device has no kernel for) is a row that says so; any
/// other error is a failure of the bench.
fn outcome(r: Result<Duration>) -> (std::result::Result<Duration, String>, bool) {
    match r {
        Ok(t) => (Ok(t), true),
        Err(e @ KernelError::Unsupported { .. }) => (Err(format!("unsupported: {e}")), true),
        Err(e) => (Err(format!("error: {e}")), false),
    }
}

/// The decode products: every shape × every type the CUDA matmul runs, in each mode.
fn matvec_rows<B: Backend>(be: &B, args: &Args, ok: &mut bool) -> Result<Vec<Row>> {
    let types: Vec<QuantType> = CUDA_EXACT_TYPES
        .iter()
        .chain(
            CUDA_Q8_TYPES
                .iter()
                .filter(|t| !CUDA_EXACT_TYPES.contains(*t)),
        )
        .copied()
        .collect();
    let mut rows = matvec_cases(be, args, ok, &types, &MATVEC_SHAPES, "")?;
    // the head, for the wide rows to compare with
    rows.extend(matvec_cases(
        be,
        args,
        ok,
        &types
            .iter()
            .copied()
            .filter(|t| Q8_WIDE_WEIGHT_TYPES.contains(t))
            .collect::<Vec<_>>(),
        &[HEAD_SHAPE],
        "q8",
    )?);
    Ok(rows)
}

/// Decode's wide-lane Q8 products on `wide` (a backend with [`Q8Decode::Wide`]): their types
/// on every shape and the head.
fn wide_rows<B: Backend>(wide: &B, args: &Args, ok: &mut bool) -> Result<Vec<Row>> {
    let mut shapes = MATVEC_SHAPES.to_vec();
    shapes.push(HEAD_SHAPE);
    matvec_cases(wide, args, ok, Q8_WIDE_WEIGHT_TYPES, &shapes, "q8-wide")
}

/// Products of `types` on `shapes`, in each mode the CUDA matmul runs them; with a `label`,
/// Q8 mode only, named so.
fn matvec_cases<B: Backend>(
    be: &B,
    args: &Args,
    ok: &mut bool,
    types: &[QuantType],
    shapes: &[(usize, usize)],
    label: &str,
) -> Result<Vec<Row>> {
    let label_of = |m: MatvecMode| {
        if label.is_empty() {
            mode_name(m)
        } else {
            label
        }
    };
    let mut rows = Vec::new();
    for &ty in types {
        for &(r, c) in shapes {
            let modes: Vec<MatvecMode> = [MatvecMode::Exact, MatvecMode::Q8]
                .into_iter()
                .filter(|m| match m {
                    MatvecMode::Exact => CUDA_EXACT_TYPES.contains(&ty),
                    MatvecMode::Q8 => CUDA_Q8_TYPES.contains(&ty),
                })
                .filter(|&m| label.is_empty() || m == MatvecMode::Q8)
                .collect();
            let names: Vec<String> = modes
                .iter()
                .map(|&m| format!("matvec_{ty}_f32_{}_{r}x{c}", label_of(m)))
                .collect();
            if !names.iter().any(|n| n.contains(&args.filter)) {
                continue;
            }
            let w = rotating_weights(be, ty, r * c)?;
            let x = upload(be, &f32_bytes((0..c).map(|i| (i as f32 * 0.01).sin())))?;
            let mut y = be.alloc(r * 4)?;
            let bytes = be.len(&w[0]) + c * 4 + r * 4;
            for (mode, name) in modes.into_iter().zip(names) {
                if !name.contains(&args.filter) {
                    continue;
                }
                let t = per_call(be, args, |i| {
                    be.run(Op::Matmul {
                        ty,
                        mode,
                        act: FloatType::F32,
                        rows: r,
                        cols: c,
                        n_tok: 1,
                        max_dq_size: 64 << 20,
                        w: &w[i % w.len()],
                        x: &x,
                        y: &mut y,
                    })
                });
                let (time, fine) = outcome(t);
                *ok &= fine;
                let row = Row {
                    name,
                    shape: format!("{r}×{c}"),
                    ty: ty.to_string(),
                    mode: label_of(mode).into(),
                    bytes,
                    time,
                };
                print_row(&row);
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

fn mode_name(m: MatvecMode) -> &'static str {
    match m {
        MatvecMode::Exact => "exact",
        MatvecMode::Q8 => "q8",
    }
}

/// A case of the second table: its buffers (inputs first) and the call that runs it.
struct Case<B: Backend> {
    name: String,
    bytes: usize,
    bufs: Vec<B::Buffer>,
    n_in: usize,
    run: OpFn<B>,
}

type OpFn<B> =
    Box<dyn Fn(&B, &[<B as Backend>::Buffer], &mut [<B as Backend>::Buffer]) -> Result<()>>;

/// Builds one case on the device; the cases are built one at a time, run, and freed.
type Build<B> = Box<dyn Fn(&B) -> Result<Case<B>>>;

fn case<B: Backend>(
    name: String,
    bytes: usize,
    bufs: Vec<B::Buffer>,
    n_in: usize,
    run: impl Fn(&B, &[B::Buffer], &mut [B::Buffer]) -> Result<()> + 'static,
) -> Case<B> {
    Case {
        name,
        bytes,
        bufs,
        n_in,
        run: Box::new(run),
    }
}

/// The other operations at 4096×4096, as `kernels.rs` times them on the CPU.
fn other_cases<B: Backend + 'static>() -> Vec<Build<B>> {
    let n = ROWS * COLS;
    let mut v: Vec<Build<B>> = Vec::new();
    for out in [FloatType::F32, FloatType::F16] {
        let ob = if out == FloatType::F32 { 4 } else { 2 };
        for ty in DEQUANT_TYPES {
            v.push(Box::new(move |be: &B| {
                let w = random_weights(ty, n);
                let bytes = w.len() + n * ob;
                let bufs = vec![upload(be, &w)?, be.alloc(n * ob)?];
                Ok(case(
                    format!("dequantize_{ty}_{}", out.name()),
                    bytes,
                    bufs,
                    1,
                    move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                        be.run(Op::Dequantize {
                            ty,
                            out,
                            n,
                            src: &i[0],
                            dst: &mut o[0],
                        })
                    },
                ))
            }));
        }
    }
    let nt = 32;
    for ty in PRODUCT_TYPES {
        for mode in [MatvecMode::Exact, MatvecMode::Q8] {
            v.push(Box::new(move |be: &B| {
                let w = random_weights(ty, n);
                let x = f32_bytes((0..COLS * nt).map(|i| (i as f32 * 0.01).sin()));
                let bytes = w.len() + x.len() + ROWS * nt * 4;
                let bufs = vec![upload(be, &w)?, upload(be, &x)?, be.alloc(ROWS * nt * 4)?];
                Ok(case(
                    format!("matmul_{ty}_f32_{}_4096x4096x{nt}", mode_name(mode)),
                    bytes,
                    bufs,
                    2,
                    move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                        be.run(Op::Matmul {
                            ty,
                            mode,
                            act: FloatType::F32,
                            rows: ROWS,
                            cols: COLS,
                            n_tok: nt,
                            max_dq_size: 64 << 20,
                            w: &i[0],
                            x: &i[1],
                            y: &mut o[0],
                        })
                    },
                ))
            }));
        }
    }
    let row = 4096;
    let n_tok = n / (32 * 128);
    let f = move || f32_bytes((0..n).map(|i| (i as f32 * 1e-3).sin()));
    let g = move || f32_bytes((0..n).map(|i| (i as f32 * 7e-4).cos()));
    v.push(Box::new(move |be: &B| {
        let bufs = vec![upload(be, &f())?, be.alloc(n * 2)?];
        Ok(case(
            "convert_f32_f16".into(),
            n * 6,
            bufs,
            1,
            move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                be.run(Op::ConvertToF16 {
                    from: FloatType::F32,
                    n,
                    src: &i[0],
                    dst: &mut o[0],
                })
            },
        ))
    }));
    v.push(Box::new(move |be: &B| {
        let bufs = vec![upload(be, &f())?];
        Ok(case(
            "scan_f32".into(),
            n * 4,
            bufs,
            1,
            move |be: &B, i: &[B::Buffer], _: &mut [B::Buffer]| {
                be.scan_non_finite(QuantType::F32, &i[0], n * 4).map(drop)
            },
        ))
    }));
    v.push(Box::new(move |be: &B| {
        let w = f32_bytes((0..row).map(|i| 1.0 + i as f32 * 1e-4));
        let bufs = vec![upload(be, &f())?, upload(be, &w)?, be.alloc(n * 4)?];
        Ok(case(
            "rms_norm_f32".into(),
            n * 8,
            bufs,
            2,
            move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                be.run(Op::RmsNorm {
                    n_rows: n / row,
                    n_cols: row,
                    eps: 1e-5,
                    x: &i[0],
                    weight: &i[1],
                    out: &mut o[0],
                })
            },
        ))
    }));
    v.push(Box::new(move |be: &B| {
        let bufs = vec![upload(be, &f())?, be.alloc(n * 4)?];
        Ok(case(
            "softmax_f32".into(),
            n * 8,
            bufs,
            1,
            move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                be.run(Op::Softmax {
                    n_rows: n / row,
                    n_cols: row,
                    x: &i[0],
                    out: &mut o[0],
                })
            },
        ))
    }));
    for style in [RopeStyle::Normal, RopeStyle::Neox] {
        v.push(Box::new(move |be: &B| {
            let params = RopeParams {
                style,
                head_dim: 128,
                n_dims: 128,
                freq_base: 10000.0,
                freq_scale: 1.0,
                attn_factor: 1.0,
            };
            let pos: Vec<u8> = (0..n_tok as i32).flat_map(i32::to_le_bytes).collect();
            let bufs = vec![upload(be, &f())?, upload(be, &pos)?, be.alloc(n * 4)?];
            let s = if style == RopeStyle::Normal {
                "norm"
            } else {
                "neox"
            };
            Ok(case(
                format!("rope_{s}_f32"),
                n * 8,
                bufs,
                2,
                move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                    be.run(Op::Rope {
                        params,
                        n_tok,
                        n_heads: 32,
                        x: &i[0],
                        positions: &i[1],
                        out: &mut o[0],
                    })
                },
            ))
        }));
    }
    v.push(Box::new(move |be: &B| {
        let bufs = vec![upload(be, &f())?, upload(be, &g())?, be.alloc(n * 4)?];
        Ok(case(
            "swiglu_f32".into(),
            n * 12,
            bufs,
            2,
            move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                be.run(Op::SwiGlu {
                    n,
                    gate: &i[0],
                    up: &i[1],
                    out: &mut o[0],
                })
            },
        ))
    }));
    v.push(Box::new(move |be: &B| {
        let bufs = vec![upload(be, &f())?, upload(be, &g())?, be.alloc(n * 4)?];
        Ok(case(
            "add_f32".into(),
            n * 12,
            bufs,
            2,
            move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                be.run(Op::Add {
                    n,
                    a: &i[0],
                    b: &i[1],
                    out: &mut o[0],
                })
            },
        ))
    }));
    for format in [KvFormat::E4M3, KvFormat::Q8, KvFormat::Q4] {
        v.push(Box::new(move |be: &B| {
            let qb = format.byte_at(n);
            let bufs = vec![upload(be, &f())?, be.alloc(qb)?, be.alloc(n * 4)?];
            Ok(case(
                format!("kv_store_load_{}", format.name()),
                2 * (n * 4 + qb),
                bufs,
                1,
                move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                    let (q, out) = o.split_at_mut(1);
                    be.run(Op::KvStore {
                        format,
                        n,
                        src: &i[0],
                        dst: &mut q[0],
                    })?;
                    be.run(Op::KvLoad {
                        format,
                        n,
                        src: &q[0],
                        dst: &mut out[0],
                    })
                },
            ))
        }));
    }
    // decode's fused ops against the separate ones they replace, one token: the gate and up
    // products with SwiGLU (TinyLlama's FFN; both matrices are read, so the bytes are twice a
    // matvec's; the two bf16 matrices, 46 MB, may stay partly in an H200's 60 MB of L2 between
    // calls, which the first table's rotating copies avoid: compare the fused row with the
    // separate one), and RoPE with the f16 cache store (TinyLlama's 32 query and 4 KV heads of
    // 64)
    for (ty, mode) in [
        (QuantType::BF16, MatvecMode::Exact),
        (QuantType::F16, MatvecMode::Exact),
        (QuantType::Q8_0, MatvecMode::Q8),
        (QuantType::Q4_K, MatvecMode::Q8),
    ] {
        for (r, c) in [(5632usize, 2048usize)] {
            for fused in [true, false] {
                v.push(swiglu_case(ty, mode, mode_name(mode), r, c, fused));
            }
        }
    }
    for fused in [true, false] {
        v.push(Box::new(move |be: &B| {
            let (n_heads, kv_heads, hd) = (32usize, 4usize, 64usize);
            let params = RopeParams {
                style: RopeStyle::Normal,
                head_dim: hd,
                n_dims: hd,
                freq_base: 10000.0,
                freq_scale: 1.0,
                attn_factor: 1.0,
            };
            let freqs = rope_inv_freqs(&params, None)?;
            let kvn = kv_heads * hd;
            let vals = |n: usize| f32_bytes((0..n).map(|i| (i as f32 * 0.37).sin()));
            let bufs = vec![
                upload(be, &vals(kvn))?,
                upload(be, &70i32.to_le_bytes())?,
                upload(be, &f32_bytes(freqs.into_iter()))?,
                upload(be, &vals(n_heads * hd))?,
                upload(be, &vals(kvn))?,
                be.alloc(kvn * 2)?,
                be.alloc(kvn * 2)?,
            ];
            let how = if fused { "fused" } else { "separate" };
            Ok(case(
                format!("rope_kv_store_f16_decode_{how}"),
                n_heads * hd * 8 + kvn * 8 + kvn * 4,
                bufs,
                3,
                move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                    let [q, k, kc, vc] = o else {
                        unreachable!("four output buffers");
                    };
                    let op = Op::RopeKvStore {
                        params,
                        n_tok: 1,
                        n_heads,
                        kv_heads,
                        q,
                        k,
                        v: &i[0],
                        positions: &i[1],
                        inv_freqs: &i[2],
                        k_format: KvFormat::F16,
                        v_format: KvFormat::F16,
                        k_cache: kc,
                        v_cache: vc,
                        cache_rows: None,
                    };
                    if fused {
                        be.run(op)
                    } else {
                        rope_kv_store_unfused(op, |op| be.run(op))
                    }
                },
            ))
        }));
    }
    v
}

/// Decode's gate and up products with SwiGLU, one token of `r × c` weights of `ty` in `mode`
/// (`label` names the mode in the case's name): one `MatmulSwiGlu` when `fused`, else the ops
/// it replaces.
fn swiglu_case<B: Backend + 'static>(
    ty: QuantType,
    mode: MatvecMode,
    label: &'static str,
    r: usize,
    c: usize,
    fused: bool,
) -> Build<B> {
    Box::new(move |be: &B| {
        let (wg, wu) = (random_weights(ty, r * c), random_weights(ty, r * c));
        let x = f32_bytes((0..c).map(|i| (i as f32 * 0.01).sin()));
        let bytes = wg.len() + wu.len() + x.len() + r * 4;
        let bufs = vec![
            upload(be, &wg)?,
            upload(be, &wu)?,
            upload(be, &x)?,
            be.alloc(r * 4)?,
            be.alloc(r * 4)?,
        ];
        let how = if fused { "fused" } else { "separate" };
        Ok(case(
            format!("swiglu_matvec_{ty}_f32_{label}_{r}x{c}_{how}"),
            bytes,
            bufs,
            3,
            move |be: &B, i: &[B::Buffer], o: &mut [B::Buffer]| {
                let (gy, uy) = o.split_at_mut(1);
                let gate = Product {
                    ty,
                    rows: r,
                    w: &i[0],
                    y: &mut gy[0],
                };
                let up = Product {
                    ty,
                    rows: r,
                    w: &i[1],
                    y: &mut uy[0],
                };
                let (cols, n_tok, max_dq_size, x) = (c, 1, 64 << 20, &i[2]);
                let op = Op::MatmulSwiGlu {
                    mode,
                    act: FloatType::F32,
                    cols,
                    n_tok,
                    max_dq_size,
                    x,
                    gate,
                    up,
                };
                if fused {
                    be.run(op)
                } else {
                    // the ops it replaces, each counted as a run of its own
                    matmul_swiglu_unfused(op, |op| be.run(op))
                }
            },
        ))
    })
}

fn other_rows<B: Backend + 'static>(be: &B, args: &Args, ok: &mut bool) -> Result<Vec<Row>> {
    run_cases(be, args, ok, other_cases::<B>())
}

/// The wide-lane Q8 kernels' rows of the second table, on `wide` (a backend with
/// [`Q8Decode::Wide`]): gate and up with SwiGLU of their types, fused and separate.
fn wide_other_rows<B: Backend + 'static>(wide: &B, args: &Args, ok: &mut bool) -> Result<Vec<Row>> {
    let mut builds = Vec::new();
    for &ty in Q8_WIDE_WEIGHT_TYPES {
        for fused in [true, false] {
            builds.push(swiglu_case(
                ty,
                MatvecMode::Q8,
                "q8-wide",
                5632,
                2048,
                fused,
            ));
        }
    }
    run_cases(wide, args, ok, builds)
}

/// Builds, runs and frees `builds` one at a time: a row each.
fn run_cases<B: Backend + 'static>(
    be: &B,
    args: &Args,
    ok: &mut bool,
    builds: Vec<Build<B>>,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for build in builds {
        let mut c = build(be)?;
        if !c.name.contains(&args.filter) {
            continue;
        }
        let (i, o) = c.bufs.split_at_mut(c.n_in);
        let (time, fine) = outcome(per_call(be, args, |_| (c.run)(be, i, o)));
        *ok &= fine;
        let row = Row {
            name: c.name,
            shape: String::new(),
            ty: String::new(),
            mode: String::new(),
            bytes: c.bytes,
            time,
        };
        print_row(&row);
        rows.push(row);
    }
    Ok(rows)
}

/// The three routes of a prompt product on one device: a backend whose products take neither
/// cuBLAS nor the int8 tensor-core kernels, one whose fast-mode products of the Q8 types take
/// the int8 kernels from one token, and one whose products take cuBLAS from one token, or why
/// there is none.
struct Routes<'a, B> {
    kernels: &'a B,
    mma: std::result::Result<&'a B, String>,
    cublas: std::result::Result<&'a B, String>,
}

/// One line of the route table: a product of `ty` in `mode` at each count of `tokens`, through
/// each route (a time, or why the case did not run).
struct RouteRow {
    ty: QuantType,
    mode: MatvecMode,
    shape: (usize, usize),
    tokens: Vec<usize>,
    kernels: Vec<std::result::Result<Duration, String>>,
    mma: Vec<std::result::Result<Duration, String>>,
    cublas: Vec<std::result::Result<Duration, String>>,
}

/// The route table's counts on this device.
fn route_tokens(args: &Args) -> &'static [usize] {
    match args.device {
        Device::Cuda => &ROUTE_TOKENS,
        Device::Cpu => &ROUTE_TOKENS_CPU,
    }
}

/// Prompt products of every route type and shape, in each mode, through each route. Each case
/// is sampled as in quick mode (20 ms): the table has 540 of them on a GPU.
fn route_rows<B: Backend>(
    routes: &Routes<'_, B>,
    args: &Args,
    ok: &mut bool,
) -> Result<Vec<RouteRow>> {
    let quick = Args {
        quick: true,
        ..args.clone()
    };
    let tokens = route_tokens(args);
    let mut rows = Vec::new();
    for ty in ROUTE_TYPES {
        for mode in [MatvecMode::Exact, MatvecMode::Q8] {
            for (r, c) in ROUTE_SHAPES {
                if !route_name(ty, mode, (r, c)).contains(&args.filter) {
                    continue;
                }
                let kernels = route_times(routes.kernels, &quick, ok, ty, mode, (r, c), tokens)?;
                let fast = mode == MatvecMode::Q8;
                let mma = match &routes.mma {
                    Ok(be) if fast && MMQ_TYPES.contains(&ty) => {
                        route_times(*be, &quick, ok, ty, mode, (r, c), tokens)?
                    }
                    Ok(_) => vec![Err("no int8 tensor-core route".into()); tokens.len()],
                    Err(why) => vec![Err(why.clone()); tokens.len()],
                };
                let cublas = match (&routes.cublas, cublas_route(fast, ty, r, c, MAX_DQ_SIZE)) {
                    (Ok(be), Some(_)) => route_times(*be, &quick, ok, ty, mode, (r, c), tokens)?,
                    (Ok(_), None) => vec![Err("no cuBLAS route".into()); tokens.len()],
                    (Err(why), _) => vec![Err(why.clone()); tokens.len()],
                };
                let row = RouteRow {
                    ty,
                    mode,
                    shape: (r, c),
                    tokens: tokens.to_vec(),
                    kernels,
                    mma,
                    cublas,
                };
                print_route_row(&row);
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

fn route_name(ty: QuantType, mode: MatvecMode, (r, c): (usize, usize)) -> String {
    format!("route_{ty}_f32_{}_{r}x{c}", mode_name(mode))
}

/// `n` random weights of `ty` on `be`, in as many copies as hold [`ROTATE_BYTES`] together
/// (at most [`MAX_COPIES`]), so calls that rotate over them read device memory, not the cache.
fn rotating_weights<B: Backend>(be: &B, ty: QuantType, n: usize) -> Result<Vec<B::Buffer>> {
    let host = random_weights(ty, n);
    let first = upload(be, &host)?;
    drop(host);
    let copies = ROTATE_BYTES.div_ceil(be.len(&first)).clamp(1, MAX_COPIES);
    let mut w = vec![first];
    for _ in 1..copies {
        let mut b = be.alloc(be.len(&w[0]))?;
        be.copy(&w[0], 0, &mut b, 0, be.len(&w[0]))?;
        w.push(b);
    }
    Ok(w)
}

/// One product's times at each of `tokens` on `be`, its weights rotating over copies as the
/// decode rows' do.
fn route_times<B: Backend>(
    be: &B,
    args: &Args,
    ok: &mut bool,
    ty: QuantType,
    mode: MatvecMode,
    (r, c): (usize, usize),
    tokens: &[usize],
) -> Result<Vec<std::result::Result<Duration, String>>> {
    let most = tokens.iter().copied().max().unwrap_or(1);
    let w = rotating_weights(be, ty, r * c)?;
    let x = upload(
        be,
        &f32_bytes((0..c * most).map(|i| (i as f32 * 0.01).sin())),
    )?;
    let mut y = be.alloc(r * most * 4)?;
    let mut times = Vec::new();
    for &n_tok in tokens {
        let t = per_call(be, args, |i| {
            be.run(Op::Matmul {
                ty,
                mode,
                act: FloatType::F32,
                rows: r,
                cols: c,
                n_tok,
                max_dq_size: MAX_DQ_SIZE,
                w: &w[i % w.len()],
                x: &x,
                y: &mut y,
            })
        });
        let (time, fine) = outcome(t);
        *ok &= fine;
        times.push(time);
    }
    Ok(times)
}

/// A route's cell: µs per call, or a short word for why there is none.
fn route_cell(t: &std::result::Result<Duration, String>) -> String {
    match t {
        Ok(t) => format!("{:.1}", t.as_secs_f64() * 1e6),
        Err(why) if why.starts_with("not applicable") => "n/a".into(),
        Err(why) if why.starts_with("unsupported") => "unsupported".into(),
        Err(_) => "—".into(),
    }
}

fn print_route_row(r: &RouteRow) {
    let cells = |v: &[std::result::Result<Duration, String>]| {
        v.iter().map(route_cell).collect::<Vec<_>>().join(" ")
    };
    println!(
        "{:<44} kernels µs: {}; int8 mma µs: {}; cuBLAS µs: {}",
        route_name(r.ty, r.mode, r.shape),
        cells(&r.kernels),
        cells(&r.mma),
        cells(&r.cublas)
    );
}

/// The crossovers of one type and mode on the sum of the three shapes' times (a layer's
/// products, roughly), by [`prompt_crossovers`]: where cuBLAS wins for good against the faster
/// of the other two, and where the int8 tensor-core kernels win for good against the backend's
/// kernels below that. Each `Err` when that route did not run for it (why), `Ok(None)` when it
/// ran and never won for good.
struct Crossover {
    ty: QuantType,
    mode: MatvecMode,
    min_tokens: std::result::Result<Option<usize>, String>,
    mma_tokens: std::result::Result<Option<usize>, String>,
}

fn crossovers(rows: &[RouteRow]) -> Vec<Crossover> {
    let mut out = Vec::new();
    for ty in ROUTE_TYPES {
        for mode in [MatvecMode::Exact, MatvecMode::Q8] {
            let of: Vec<&RouteRow> = rows
                .iter()
                .filter(|r| r.ty == ty && r.mode == mode)
                .collect();
            let Some(first) = of.first() else {
                continue;
            };
            let sum = |pick: fn(&RouteRow) -> &[std::result::Result<Duration, String>],
                       i: usize| {
                of.iter()
                    .map(|r| pick(r)[i].as_ref().ok().map(Duration::as_secs_f64))
                    .sum::<Option<f64>>()
            };
            let times: Vec<RouteTimes> = first
                .tokens
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    (
                        n,
                        sum(|r| &r.kernels, i),
                        sum(|r| &r.mma, i),
                        sum(|r| &r.cublas, i),
                    )
                })
                .collect();
            let (mma, cublas) = prompt_crossovers(&times);
            let why = |v: &[std::result::Result<Duration, String>]| {
                v.iter()
                    .find_map(|t| t.as_ref().err().cloned())
                    .unwrap_or_default()
            };
            let min_tokens = match times.iter().any(|t| t.3.is_some()) {
                true => Ok(cublas),
                false => Err(why(&first.cublas)),
            };
            let mma_tokens = match times.iter().any(|t| t.2.is_some()) {
                true => Ok(mma),
                false => Err(why(&first.mma)),
            };
            out.push(Crossover {
                ty,
                mode,
                min_tokens,
                mma_tokens,
            });
        }
    }
    out
}

/// The route table's markdown: the times, the crossovers, and the lines that would set them.
fn route_markdown(rows: &[RouteRow], cross: &[Crossover]) -> String {
    let mut md = String::new();
    let Some(first) = rows.first() else {
        return md;
    };
    md.push_str(
        "\n## Prompt products: the backend's kernels, int8 tensor cores or cuBLAS (TinyLlama's \
         shapes)\n\n\
         µs per call of one product of f32 activations at each token count, through the \
         backend's own kernels (`kernels`), through the int8 tensor-core kernels `q8_mma_{type}` \
         (`int8 mma`: fast mode, quantised weights, compute capability 8.0 and later) and \
         through cuBLAS (`cuBLAS`), each forced on a backend of its own; the weights rotate as in the first table. `exact` is exact mode \
         (cuBLAS: f32 GEMMs of dequantised chunks, no TF32), `q8` fast mode (cuBLAS: tensor \
         cores, f16 or bf16 operands, f32 accumulation). Each case is sampled for 20 ms; the \
         CPU rehearsal times fewer counts.\n\n",
    );
    let _ = write!(md, "| weights | mode | rows × cols | route |");
    for n in &first.tokens {
        let _ = write!(md, " {n} |");
    }
    md.push_str("\n|---|---|---|---|");
    md.push_str(&"---:|".repeat(first.tokens.len()));
    md.push('\n');
    for r in rows {
        for (route, times) in [
            ("kernels", &r.kernels),
            ("int8 mma", &r.mma),
            ("cuBLAS", &r.cublas),
        ] {
            let _ = write!(
                md,
                "| {} | {} | {}×{} | {route} |",
                r.ty,
                mode_name(r.mode),
                r.shape.0,
                r.shape.1
            );
            for t in times {
                let _ = write!(md, " {} |", route_cell(t));
            }
            md.push('\n');
        }
    }
    let notes: Vec<String> = rows
        .iter()
        .flat_map(|r| r.kernels.iter().chain(&r.mma).chain(&r.cublas))
        .filter_map(|t| t.as_ref().err().cloned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if !notes.is_empty() {
        md.push('\n');
    }
    for n in notes {
        let _ = writeln!(md, "- {n}");
    }
    let _ = writeln!(
        md,
        "\n### Where the int8 kernels and cuBLAS win\n\n\
         Per type and mode, the smallest token count from which cuBLAS is faster than the faster \
         of the other two routes on the sum of the three shapes at that count and every larger \
         one measured, and the smallest from which the int8 tensor-core kernels are faster than \
         the backend's kernels in the same way below that (`sources::prompt_crossovers`). Today \
         every type takes cuBLAS from `CUBLAS_MIN_TOKENS` = {CUBLAS_MIN_TOKENS} tokens, and \
         none the int8 kernels (`MMQ_MIN_TOKENS_BY_TYPE` is empty).\n\n\
         | weights | mode | int8 mma wins from | suggested int8 count | cuBLAS wins from | \
         suggested cuBLAS count |\n|---|---|---:|---:|---:|---:|"
    );
    let cells = |c: &std::result::Result<Option<usize>, String>| match c {
        Ok(Some(n)) => (format!("{n} tokens"), n.to_string()),
        Ok(None) => ("never for good".to_string(), "usize::MAX".to_string()),
        Err(why) if why.starts_with("not applicable") => ("n/a".into(), "n/a".into()),
        Err(why) if why.starts_with("no int8") => ("—".into(), "n/a".into()),
        Err(why) => (format!("did not run: {why}"), "n/a".into()),
    };
    let (mut cublas_lines, mut mma_lines) = (Vec::new(), Vec::new());
    for x in cross {
        let mode = mode_name(x.mode);
        let (mma_wins, mma_suggested) = cells(&x.mma_tokens);
        let (wins, suggested) = cells(&x.min_tokens);
        let _ = writeln!(
            md,
            "| {} | {mode} | {mma_wins} | {mma_suggested} | {wins} | {suggested} |",
            x.ty
        );
        let variant = match x.mode {
            MatvecMode::Exact => "Exact",
            MatvecMode::Q8 => "Q8",
        };
        let line = |n: &str| format!("    (QuantType::{:?}, MatvecMode::{variant}, {n}),", x.ty);
        if x.min_tokens.is_ok() {
            cublas_lines.push(line(&suggested));
        }
        // an int8 count only where the kernels win (the table's default is none)
        if let Ok(Some(_)) = x.mma_tokens {
            mma_lines.push(line(&mma_suggested));
        }
    }
    if cublas_lines.is_empty() {
        md.push_str("\nNo cuBLAS crossover measured (cuBLAS did not run here).\n");
    } else {
        let _ = writeln!(
            md,
            "\nAs the entries of `sources::CUBLAS_MIN_TOKENS_BY_TYPE`:\n\n```rust\n{}\n```",
            cublas_lines.join("\n")
        );
    }
    if mma_lines.is_empty() {
        md.push_str("\nThe int8 tensor-core kernels won for good nowhere here (or did not run).\n");
    } else {
        let _ = writeln!(
            md,
            "\nAs the entries of `sources::MMQ_MIN_TOKENS_BY_TYPE`:\n\n```rust\n{}\n```",
            mma_lines.join("\n")
        );
    }
    md
}

/// The route table and crossovers as JSON members (`cublas_min_tokens_now`, the common count
/// of this build; `routes`; `cublas_crossovers`, with the int8 tensor-core kernels' count
/// beside cuBLAS's).
fn route_json(rows: &[RouteRow], cross: &[Crossover]) -> String {
    let secs = |t: &std::result::Result<Duration, String>| {
        t.as_ref()
            .map_or("null".to_string(), |t| format!("{:.6e}", t.as_secs_f64()))
    };
    let mut routes = Vec::new();
    for r in rows {
        for (i, n) in r.tokens.iter().enumerate() {
            routes.push(format!(
                "    {{\"type\": \"{}\", \"mode\": \"{}\", \"shape\": \"{}x{}\", \"tokens\": {n}, \"kernels_seconds\": {}, \"mma_seconds\": {}, \"cublas_seconds\": {}}}",
                r.ty,
                mode_name(r.mode),
                r.shape.0,
                r.shape.1,
                secs(&r.kernels[i]),
                secs(&r.mma[i]),
                secs(&r.cublas[i])
            ));
        }
    }
    let cross: Vec<String> = cross
        .iter()
        .map(|x| {
            let count = |c: &std::result::Result<Option<usize>, String>| match c {
                Ok(Some(n)) => n.to_string(),
                _ => "null".into(),
            };
            format!(
                "    {{\"type\": \"{}\", \"mode\": \"{}\", \"cublas_ran\": {}, \"min_tokens\": {}, \"mma_ran\": {}, \"mma_min_tokens\": {}}}",
                x.ty,
                mode_name(x.mode),
                x.min_tokens.is_ok(),
                count(&x.min_tokens),
                x.mma_tokens.is_ok(),
                count(&x.mma_tokens)
            )
        })
        .collect();
    format!(
        ",\n  \"cublas_min_tokens_now\": {CUBLAS_MIN_TOKENS},\n  \"routes\": [\n{}\n  ],\n  \"cublas_crossovers\": [\n{}\n  ]",
        routes.join(",\n"),
        cross.join(",\n")
    )
}

fn print_row(r: &Row) {
    match (&r.time, r.gbs()) {
        (Ok(t), Some(gbs)) => println!(
            "{:<44} {:>10.1} µs {gbs:>8.1} GB/s",
            r.name,
            t.as_secs_f64() * 1e6
        ),
        (Err(why), _) => println!("{:<44} {why}", r.name),
        (Ok(_), None) => {}
    }
}

/// Runs every case; false when one failed (an error other than an unsupported type).
fn bench<B: Backend + 'static>(
    be: &B,
    wide: &B,
    routes: &Routes<'_, B>,
    args: &Args,
) -> Result<bool> {
    let mut ok = true;
    let started = Instant::now();
    // The CPU rehearsal copies less: the copy's speed settles well below 512 MiB there.
    let copy_bytes = if args.device == Device::Cpu {
        COPY_BYTES / 4
    } else {
        COPY_BYTES
    };
    let copy_before = copy_gbs(be, args, copy_bytes)?;
    println!(
        "{}: device copy {copy_before:.1} GB/s ({} MiB, read plus written)",
        be.name(),
        (2 * copy_bytes) >> 20
    );
    let mut matvec = matvec_rows(be, args, &mut ok)?;
    matvec.extend(wide_rows(wide, args, &mut ok)?);
    let mut others = other_rows(be, args, &mut ok)?;
    others.extend(wide_other_rows(wide, args, &mut ok)?);
    let route = route_rows(routes, args, &mut ok)?;
    let cross = crossovers(&route);
    let copy_after = copy_gbs(be, args, copy_bytes)?;
    let copy = copy_before.max(copy_after);
    println!(
        "{}: device copy {copy_after:.1} GB/s after the cases; {:.0} s in all",
        be.name(),
        started.elapsed().as_secs_f64()
    );
    if !args.filter.is_empty() {
        return Ok(ok);
    }
    let mut md = markdown(
        be,
        args,
        (copy_before, copy_after, copy_bytes),
        &matvec,
        &others,
    );
    md.push_str(&route_markdown(&route, &cross));
    println!("\n{md}");
    let stem = match args.device {
        Device::Cuda => "kernels_cuda",
        Device::Cpu => "kernels_cuda_on_cpu",
    };
    let json = json_rows(
        copy,
        matvec.iter().chain(&others),
        &route_json(&route, &cross),
    );
    let written = std::fs::create_dir_all(&args.out)
        .and_then(|()| std::fs::write(args.out.join(format!("{stem}.md")), md))
        .and_then(|()| std::fs::write(args.out.join(format!("{stem}.json")), json));
    if let Err(e) = written {
        println!("kernel bench: cannot write {}: {e}", args.out.display());
        return Ok(false);
    }
    println!("wrote {}/{stem}.md and .json", args.out.display());
    Ok(ok)
}

fn markdown<B: Backend>(
    be: &B,
    args: &Args,
    (before, after, bytes): (f64, f64, usize),
    matvec: &[Row],
    others: &[Row],
) -> String {
    let copy = before.max(after);
    let mut md = String::new();
    let device = match args.device {
        Device::Cuda => format!("CUDA, {}", be.name()),
        Device::Cpu => format!(
            "the CUDA cases on the CPU backend, {}: a rehearsal of the GPU bundle, not a GPU figure",
            be.name()
        ),
    };
    let _ = writeln!(md, "# Kernel bench ({device})\n");
    let _ = writeln!(
        md,
        "Device copy bandwidth: {before:.1} GB/s before the cases and {after:.1} GB/s after \
         (a device-to-device copy of {} MiB, bytes read plus written). `% copy` divides by the \
         faster, {copy:.1} GB/s. GB/s counts bytes read plus written. A time is the median per \
         call over samples of calls queued back to back and ended by one synchronise.\n",
        bytes >> 20
    );
    let _ = writeln!(
        md,
        "## Matrix-vector products (decode: one token, f32 activations)\n\n\
         Bytes per call: the weights, the activations and the f32 output. The weights rotate \
         over copies holding {} MiB together, so each call reads them from device memory, not \
         from the L2 cache. `exact` dequantises in registers; `q8` quantises the activations \
         to 8 bits first (the fast compute mode).\n",
        ROTATE_BYTES >> 20
    );
    md.push_str("| weights | mode | rows × cols | µs / call | GB/s | % copy |\n");
    md.push_str("|---|---|---|---:|---:|---:|\n");
    for r in matvec {
        match (&r.time, r.gbs()) {
            (Ok(t), Some(gbs)) => {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {:.1} | {gbs:.1} | {:.0}% |",
                    r.ty,
                    r.mode,
                    r.shape,
                    t.as_secs_f64() * 1e6,
                    100.0 * gbs / copy
                );
            }
            _ => {
                let why = r.time.as_ref().err().map_or("", String::as_str);
                let _ = writeln!(md, "| {} | {} | {} | {why} | | |", r.ty, r.mode, r.shape);
            }
        }
    }
    let absent = |list: &[QuantType]| {
        CHECKPOINT_TYPES
            .iter()
            .filter(|t| !list.contains(t))
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        md,
        "\nNo CUDA kernel (so not in the table): exact mode {}; q8 mode {}.\n",
        absent(CUDA_EXACT_TYPES),
        absent(CUDA_Q8_TYPES)
    );
    md.push_str("## Other operations (4096 × 4096 values)\n\n");
    md.push_str("| kernel | time | GB/s | % copy |\n|---|---:|---:|---:|\n");
    for r in others {
        match (&r.time, r.gbs()) {
            (Ok(t), Some(gbs)) => {
                let _ = writeln!(
                    md,
                    "| {} | {:.3} ms | {gbs:.1} | {:.0}% |",
                    r.name,
                    t.as_secs_f64() * 1e3,
                    100.0 * gbs / copy
                );
            }
            _ => {
                let why = r.time.as_ref().err().map_or("", String::as_str);
                let _ = writeln!(md, "| {} | {why} | | |", r.name);
            }
        }
    }
    md
}

/// The JSON of the results: the copy baseline, the rows, then `more` (members, each after a
/// comma).
fn json_rows<'a>(copy: f64, rows: impl Iterator<Item = &'a Row>, more: &str) -> String {
    let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
    let rows: Vec<String> = rows
        .map(|r| {
            let (secs, gbs, pct) = match (&r.time, r.gbs()) {
                (Ok(t), Some(g)) => (
                    format!("{:.6e}", t.as_secs_f64()),
                    format!("{g:.3}"),
                    format!("{:.2}", 100.0 * g / copy),
                ),
                _ => ("null".into(), "null".into(), "null".into()),
            };
            let note = r.time.as_ref().err().map_or("", String::as_str);
            format!(
                "    {{\"kernel\": \"{}\", \"type\": \"{}\", \"mode\": \"{}\", \"shape\": \"{}\", \"bytes\": {}, \"seconds\": {secs}, \"gb_per_s\": {gbs}, \"percent_of_copy\": {pct}, \"note\": \"{}\"}}",
                r.name,
                r.ty,
                r.mode,
                r.shape,
                r.bytes,
                esc(note)
            )
        })
        .collect();
    format!(
        "{{\n  \"copy_gb_per_s\": {copy:.3},\n  \"rows\": [\n{}\n  ]{more}\n}}\n",
        rows.join(",\n")
    )
}

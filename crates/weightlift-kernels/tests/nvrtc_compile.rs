//! Every kernel source compiles with NVRTC to PTX for compute_75 (T4-class, the oldest ISA we
//! expect) and to PTX and CUBIN for sm_90 (the backend compiles for the device's own `sm_XY` at
//! run time), with no error and no warning; every kernel's PTX parameters equal the argument
//! list the CUDA backend launches it with, and its launch bounds hold the blocks the backend
//! launches it with; and no block decoder loads a multi-byte field through a cast pointer (a
//! misaligned load faults on the GPU, and the host twin cannot see it). Needs libnvrtc (pip
//! nvidia-cuda-nvrtc-cu12 in the repository's `.venv`, a CUDA toolkit, or on
//! `LD_LIBRARY_PATH`); without it they fail, saying so.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

mod common;

/// The architectures every kernel module is compiled for. The oldest is compiled to PTX only:
/// the front end is where `__CUDA_ARCH__` chooses code and where an instruction the
/// architecture lacks is refused. ptxas runs for sm_90, whose CUBIN the module-size check reads;
/// for sm_75 it took 63 more CPU seconds (most of them the attention modules') and checked no
/// code path of its own. The other kernels have no code for particular architectures (nothing
/// tests `__CUDA_ARCH__` beyond its presence), so the oldest and the newest bound the ones
/// between. The kernels with code for particular architectures, `attention_prefill_mma_{format}`
/// and `q8_mma_{type}` (tensor-core `mma.sync` from 8.0, an empty body before), have both of
/// their paths compiled here.
#[cfg(feature = "nvrtc-check")]
const ARCHES: [&str; 2] = [OLDEST, "sm_90"];

/// The oldest architecture, compiled to PTX only (see [`ARCHES`]).
#[cfg(feature = "nvrtc-check")]
const OLDEST: &str = "compute_75";

/// One strict compile: `(module, arch)` and the result or the error's text.
#[cfg(feature = "nvrtc-check")]
type Compile = (
    (&'static str, &'static str),
    Result<weightlift_kernels::nvrtc::Compiled, String>,
);

/// Every module of [`weightlift_kernels::sources::SOURCES`] compiled strictly (warnings are
/// errors) for each of [`ARCHES`], once for all the tests of this file: `(module, arch)` and the
/// result or the error's text. The compiles are independent and single-threaded, so they are
/// spread over the cores: each thread takes the next job from one queue, the real architecture
/// first (ptxas takes most of the time: 105 of 131 CPU seconds here), the longest sources first
/// within each, so no long compile is left for the end.
#[cfg(feature = "nvrtc-check")]
fn compiled() -> &'static [Compile] {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use weightlift_kernels::{nvrtc, sources};
    static ALL: OnceLock<Vec<Compile>> = OnceLock::new();
    ALL.get_or_init(|| {
        common::require_nvrtc();
        let mut jobs: Vec<(&str, &str, &str)> = sources::SOURCES
            .iter()
            .flat_map(|&(name, src)| ARCHES.map(|arch| (name, src, arch)))
            .collect();
        jobs.sort_by_key(|&(_, src, arch)| (arch == OLDEST, std::cmp::Reverse(src.len())));
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (jobs, next) = (&jobs, &AtomicUsize::new(0));
        let mut out: Vec<Compile> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(move || {
                        let mut done = Vec::new();
                        while let Some(&(name, src, arch)) =
                            jobs.get(next.fetch_add(1, Ordering::Relaxed))
                        {
                            let r =
                                nvrtc::compile_strict(name, src, arch).map_err(|e| e.to_string());
                            done.push(((name, arch), r));
                        }
                        done
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("a compile thread panicked"))
                .collect()
        });
        out.sort_by_key(|((name, arch), _)| (*name, *arch));
        out
    })
}

/// The compile of `module` for `arch` (one of [`ARCHES`]), failing the test with its error.
#[cfg(feature = "nvrtc-check")]
fn compiled_for(module: &str, arch: &str) -> &'static weightlift_kernels::nvrtc::Compiled {
    let (_, r) = compiled()
        .iter()
        .find(|((m, a), _)| *m == module && *a == arch)
        .unwrap_or_else(|| panic!("{module} was not compiled for {arch}"));
    r.as_ref().unwrap_or_else(|e| panic!("{e}"))
}

#[cfg(feature = "nvrtc-check")]
#[test]
fn every_kernel_compiles_without_warnings_for_compute75_and_sm90() {
    use weightlift_kernels::{nvrtc, sources};
    common::require_nvrtc();
    let (major, minor) = nvrtc::nvrtc_version().unwrap();
    eprintln!("nvrtc {major}.{minor}");
    assert!(
        sources::SOURCES.len() >= 8,
        "expected the attention, attention_prefill, attention_prefill_mma, convert, dequant, kv, \
         matvec and ops modules"
    );
    let mut failures = Vec::new();
    for ((name, arch), r) in compiled() {
        match r {
            Ok(c) => {
                if !c.ptx.contains(".entry") {
                    failures.push(format!("{name} {arch}: no kernel entry in the PTX"));
                }
                let elf = c.cubin.as_ref().is_some_and(|b| b.starts_with(b"\x7fELF"));
                if elf != arch.starts_with("sm_") {
                    failures.push(format!("{name} {arch}: CUBIN {elf}, want it for sm_ only"));
                }
            }
            Err(e) => failures.push(e.clone()),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[cfg(feature = "nvrtc-check")]
#[test]
fn kernels_follow_the_op_dtype_naming_and_cover_every_operation() {
    use weightlift_kernels::sources;
    let all: String = sources::SOURCES.iter().map(|(_, s)| *s).collect();
    for k in expected_kernels() {
        // kernels generated by macros appear as `dequantize_##NAME##_f32` plus the invocation;
        // check the PTX-level name through the macro arguments instead
        let direct = all.contains(&format!("void {k}("));
        let via_macro = k.split('_').count() >= 2 && macro_generated(&all, &k);
        assert!(direct || via_macro, "kernel {k} is missing");
    }

    fn macro_generated(all: &str, k: &str) -> bool {
        for (prefix, suffixes) in [
            ("dequantize_", ["_f32", "_f16"]),
            // three source types, over two entries of two suffixes
            ("quantize_", ["_bf16", "_f32"]),
            ("quantize_", ["_f16", "_f16"]),
            ("matvec_", ["_f32", "_f16"]),
            ("matmul_", ["_f32", "_f16"]),
            ("scan_", ["", ""]),
            ("q8_matmul_", ["", ""]),
            ("q8_matvec_", ["", ""]),
            ("q8_matvec3_", ["", ""]),
            ("q8_wide_matvec3_", ["", ""]),
            ("matvec3_", ["_f32", "_f16"]),
            ("q8_mma_", ["", ""]),
            ("swiglu_q8_matvec_", ["", ""]),
            ("q8_wide_matvec_", ["", ""]),
            ("swiglu_q8_wide_matvec_", ["", ""]),
            ("swiglu_matvec_", ["_f32", "_f16"]),
            ("gemm_", ["", ""]),
            ("kv_store_", ["", ""]),
            ("rope_kv_store_", ["", ""]),
            ("kv_load_", ["", ""]),
            ("attention_prefill_mma_", ["", ""]),
            ("attention_prefill_", ["", ""]),
            ("attention_", ["", ""]),
        ] {
            if let Some(rest) = k.strip_prefix(prefix) {
                for s in suffixes {
                    if let Some(t) = rest.strip_suffix(s) {
                        let m = match prefix {
                            "dequantize_" => format!("WL_DEQUANT({t},"),
                            "quantize_" => format!("WL_QUANTIZE_FROM({t},"),
                            "scan_" => format!("WL_SCAN_BLOCKS({t},"),
                            "kv_store_" | "kv_load_" => format!("WL_KV({t},"),
                            "rope_kv_store_" => format!("WL_ROPE_KV({t},"),
                            "attention_prefill_mma_" => format!("WL_ATTENTION_PREFILL_MMA({t},"),
                            "attention_prefill_" => format!("WL_ATTENTION_PREFILL({t},"),
                            "attention_" => format!("WL_ATTENTION({t},"),
                            "q8_matmul_" | "q8_matvec_" | "q8_matvec3_" | "swiglu_q8_matvec_" => {
                                format!("WL_Q8_KERNELS({t},")
                            }
                            "q8_mma_" => format!("WL_Q8_MMA({t})"),
                            "q8_wide_matvec_" | "q8_wide_matvec3_" | "swiglu_q8_wide_matvec_" => {
                                format!("WL_Q8W_KERNELS({t},")
                            }
                            "swiglu_matvec_" => format!("WL_FV_GLU_KERNELS({t},"),
                            "matvec3_" => format!("WL_FV_KERNELS({t},"),
                            "gemm_" => format!("WL_GEMM({t},"),
                            // the float weights' bandwidth kernels, or the warp-per-row ones
                            _ if all.contains(&format!("WL_FV_KERNELS({t},")) => return true,
                            _ => format!("WL_MATMUL_BOTH({t})"),
                        };
                        return all.contains(&m);
                    }
                }
            }
        }
        false
    }
}

/// Every kernel the CUDA backend launches (by the names `cuda.rs` builds), and the ones the API promises.
#[cfg(feature = "nvrtc-check")]
fn expected_kernels() -> Vec<String> {
    let mut expected: Vec<String> = Vec::new();
    for t in [
        "f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k",
        "q5_k", "q6_k", "iq4_nl",
    ] {
        expected.push(format!("dequantize_{t}_f32"));
        expected.push(format!("dequantize_{t}_f16"));
    }
    for t in [
        "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "f16",
        "bf16", "f32",
    ] {
        for a in ["f32", "f16"] {
            expected.push(format!("matvec_{t}_{a}"));
            expected.push(format!("matmul_{t}_{a}"));
        }
    }
    for t in [
        "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl",
    ] {
        expected.push(format!("scan_{t}"));
    }
    // the Q8-activation mode and the dequantised path's dense product
    for t in ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"] {
        expected.push(format!("q8_matmul_{t}"));
        expected.push(format!("q8_matvec_{t}"));
        expected.push(format!("q8_matvec3_{t}"));
        expected.push(format!("swiglu_q8_matvec_{t}"));
    }
    // the Q8 mode's prompt product on int8 tensor cores (compute capability 8.0 and later)
    for t in weightlift_kernels::sources::MMQ_TYPES {
        expected.push(format!("q8_mma_{}", t.name()));
    }
    // decode's wide lanes (the default for their types)
    for t in weightlift_kernels::sources::Q8_WIDE_WEIGHT_TYPES {
        let t = t.name();
        expected.push(format!("q8_wide_matvec_{t}"));
        expected.push(format!("q8_wide_matvec3_{t}"));
        expected.push(format!("swiglu_q8_wide_matvec_{t}"));
    }
    // decode's gate and up products with SwiGLU, and q, k and v in one launch, float weights
    for t in ["f16", "bf16", "f32"] {
        for a in ["f32", "f16"] {
            expected.push(format!("swiglu_matvec_{t}_{a}"));
            expected.push(format!("matvec3_{t}_{a}"));
        }
    }
    // quantise-on-load, from each float source type
    for t in weightlift_kernels::QUANTIZE_TYPES {
        for src in ["f32", "f16", "bf16"] {
            expected.push(format!("quantize_{}_{src}", t.name()));
        }
    }
    for a in ["f32", "f16"] {
        expected.push(format!("q8_quantize_{a}"));
        expected.push(format!("gemm_{a}"));
    }
    for k in [
        "convert_f32_f16",
        "convert_f32_bf16",
        "convert_bf16_f16",
        "scan_f32",
        "scan_f16",
        "scan_bf16",
        "rms_norm_f32",
        "add_rms_norm_f32",
        "add_rms_norm_q8_f32",
        "rope_norm_f32",
        "rope_neox_f32",
        "softmax_f32",
        "swiglu_f32",
        "add_f32",
        "kv_store_q8",
        "kv_store_q4",
        "kv_store_e4m3",
        "kv_load_q8",
        "kv_load_q4",
        "kv_load_e4m3",
        "kv_store_bf16",
        "kv_load_bf16",
        // the forward pass's in-place forms and its attention over the cache
        "rope_inplace_norm_f32",
        "rope_inplace_neox_f32",
        "add_inplace_f32",
        "swiglu_inplace_f32",
        "add_bias_f32",
        // a mixture-of-experts block's rows: gathered for an expert, added back weighted
        "gather_rows_f32",
        "scatter_add_rows_f32",
        "attention_f32",
        "attention_f16",
        "attention_bf16",
        "attention_e4m3",
        "attention_q8",
        "attention_q4",
        "attention_q8_q4",
        "attention_reduce_f32",
        "attention_reduce_q8_f32",
        // prompts: flash attention over the cache, by cache dtype
        "attention_prefill_f32",
        "attention_prefill_f16",
        "attention_prefill_bf16",
        "attention_prefill_e4m3",
        "attention_prefill_q8",
        "attention_prefill_q4",
        "attention_prefill_q8_q4",
        // the same in fast mode on tensor cores (compute capability 8.0 and later)
        "attention_prefill_mma_f32",
        "attention_prefill_mma_f16",
        "attention_prefill_mma_bf16",
        "attention_prefill_mma_e4m3",
        "attention_prefill_mma_q8",
        "attention_prefill_mma_q4",
        "attention_prefill_mma_q8_q4",
        // RoPE fused with the cache store, by cache dtype
        "rope_kv_store_f32",
        "rope_kv_store_f16",
        "rope_kv_store_bf16",
        "rope_kv_store_e4m3",
        "rope_kv_store_q8",
        "rope_kv_store_q4",
        "rope_kv_store_q8_q4",
    ] {
        expected.push(k.to_string());
    }
    expected
}

/// The `.entry` kernels of a PTX text with their `.param` types, in order.
#[cfg(feature = "nvrtc-check")]
fn ptx_entries(ptx: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        rest = &rest[at + ".entry ".len()..];
        let open = rest.find('(').expect("an .entry has a parameter list");
        let close = rest.find(')').expect("an .entry parameter list is closed");
        let name = rest[..open].trim().to_string();
        let params = rest[open + 1..close]
            .split(',')
            .filter(|p| !p.trim().is_empty())
            .map(|p| {
                // `.param .u64 name_param_0` (newer NVRTC may add `.ptr .global .align N`)
                let words: Vec<&str> = p.split_whitespace().collect();
                assert_eq!(words.first(), Some(&".param"), "{name}: {p}");
                words[1].to_string()
            })
            .collect();
        out.push((name, params));
        rest = &rest[close..];
    }
    out
}

#[cfg(feature = "nvrtc-check")]
#[test]
fn every_kernel_takes_exactly_the_arguments_the_backend_launches_it_with() {
    use weightlift_kernels::sources;
    common::require_nvrtc();
    let mut seen_families = std::collections::HashSet::new();
    let mut entries = std::collections::HashSet::new();
    let mut n_kernels = 0;
    for (module, _) in sources::SOURCES {
        let c = compiled_for(module, "sm_90");
        for (name, params) in ptx_entries(&c.ptx) {
            entries.insert(name.clone());
            let Some(want) = sources::signature(&name) else {
                panic!("{module}.cu: kernel {name} has no entry in sources::SIGNATURES");
            };
            let want: Vec<&str> = want.iter().map(|p| p.ptx_type()).collect();
            assert_eq!(
                params, want,
                "{module}.cu: kernel {name} takes {params:?}, the backend pushes {want:?}"
            );
            let family = sources::SIGNATURES
                .iter()
                .position(|(prefix, _)| name.starts_with(prefix));
            seen_families.insert(family);
            n_kernels += 1;
        }
    }
    assert!(n_kernels >= 96, "only {n_kernels} kernels found");
    for k in expected_kernels() {
        assert!(
            entries.contains(&k),
            "no kernel {k} in the PTX of any module"
        );
    }
    assert_eq!(
        seen_families.len(),
        sources::SIGNATURES.len(),
        "a SIGNATURES family matches no kernel"
    );
}

/// The backend launches each attention kernel from the module
/// [`weightlift_kernels::sources::attention_module`] names: that module's PTX holds its entry,
/// and no other module's does.
#[cfg(feature = "nvrtc-check")]
#[test]
fn every_attention_kernel_is_in_the_module_it_is_launched_from() {
    use weightlift_kernels::sources;
    common::require_nvrtc();
    let attention: Vec<String> = expected_kernels()
        .into_iter()
        .filter(|k| k.starts_with("attention_"))
        .collect();
    assert!(attention.len() >= 22, "{attention:?}");
    // each module's entry names, read from its PTX once
    let entries: Vec<(&str, Vec<String>)> = sources::SOURCES
        .iter()
        .map(|&(module, _)| {
            let ptx = &compiled_for(module, "sm_90").ptx;
            (
                module,
                ptx_entries(ptx).into_iter().map(|(name, _)| name).collect(),
            )
        })
        .collect();
    for k in &attention {
        let holders: Vec<&str> = entries
            .iter()
            .filter(|(_, names)| names.contains(k))
            .map(|&(module, _)| module)
            .collect();
        assert_eq!(holders, [sources::attention_module(k)], "{k}");
    }
}

#[test]
fn block_decoders_load_multi_byte_fields_a_byte_at_a_time() {
    // GGUF blocks are 18, 20, 22, 34, 84, 110, 210 bytes: their f16 fields sit at odd or
    // 2-mod-4 addresses. Kernel parameters are typed pointers to whole buffers (aligned by the
    // allocator), so a cast of a byte pointer to a wider type is the only way a misaligned
    // load can appear.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if !matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("cu" | "cuh")
        ) {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let squashed: String = code.chars().filter(|c| !c.is_whitespace()).collect();
            for bad in [
                "reinterpret_cast",
                "(constwl_u16*)",
                "(wl_u16*)",
                "(constwl_u32*)",
                "(wl_u32*)",
                "(constwl_u64*)",
                "(wl_u64*)",
                "(constfloat*)",
                "(float*)",
                "(constunsignedshort*)",
                "(constunsignedint*)",
                "(consthalf*)",
                "(constint*)",
                "(int*)",
                "(constuint2*)",
                "(constuint4*)",
                "(constint4*)",
                "(constfloat4*)",
            ] {
                assert!(
                    !squashed.contains(bad),
                    "{}:{}: pointer cast `{bad}` may load a misaligned field: {line}",
                    path.display(),
                    i + 1
                );
            }
        }
        checked += 1;
    }
    assert!(
        checked >= 8,
        "only {checked} kernel files found in {}",
        dir.display()
    );
}

#[cfg(not(feature = "nvrtc-check"))]
#[test]
#[ignore = "the NVRTC checks need --features nvrtc-check (or cuda); make test enables it"]
fn nvrtc_compile_check_needs_the_feature() {
    panic!("rebuild the tests with --features nvrtc-check (or cuda) to compile every kernel");
}

/// The Q8 kernels' per-lane integer dot is `__dp4a` on the device (wl_q8.cuh keeps a scalar
/// twin for the host): check the PTX really uses the instruction, so the `__CUDA_ARCH__` guard
/// did not silently select the fallback; and decode's kernels (`q8_matvec_`, `q8_matvec3_`
/// with q, k and v, and `swiglu_q8_matvec_` with its gate and up) read weights and
/// activations with 16- and 32-bit loads, not byte by byte only, and the wide-lane ones
/// (`q8_wide_matvec_`, `q8_wide_matvec3_`, `swiglu_q8_wide_matvec_`) with 128-bit loads (Q4_K)
/// or realigned words and 64-bit loads (Q6_K).
#[cfg(feature = "nvrtc-check")]
#[test]
fn q8_matmul_kernels_use_dp4a_on_the_device() {
    common::require_nvrtc();
    let ptx = &compiled_for("matvec", OLDEST).ptx;
    let (mut prompt, mut decode, mut wide) = (0, 0, 0);
    for body in ptx.split(".entry ").skip(1) {
        let name = body.split('(').next().unwrap_or("");
        if body.starts_with("q8_wide_matvec") || body.starts_with("swiglu_q8_wide_matvec_") {
            wide += 1;
            // Q4_K's blocks and activation pairs are 16-byte aligned; Q6_K's 210-byte blocks
            // are realigned from 32-bit words by a byte permute, its activations 8 bytes a load
            let ops: &[&str] = if name.ends_with("q6_k") {
                &[
                    "dp4a.s32.s32",
                    "ld.global.nc.v2.u32",
                    "ld.global.nc.u32",
                    "prmt.b32",
                ]
            } else {
                &["dp4a.s32.s32", "ld.global.nc.v4.u32"]
            };
            for op in ops {
                assert!(body.contains(op), "{name}: no {op} in its PTX");
            }
            continue;
        }
        if !body.starts_with("q8_mat") && !body.starts_with("swiglu_q8_matvec_") {
            continue;
        }
        assert!(
            body.contains("dp4a.s32.s32"),
            "{name}: no dp4a.s32.s32 in its PTX"
        );
        if body.starts_with("q8_matmul_") {
            prompt += 1;
        } else {
            decode += 1;
            for load in ["ld.global.nc.u16", "ld.global.nc.u32"] {
                assert!(body.contains(load), "{name}: no {load} in its PTX");
            }
        }
    }
    assert_eq!(
        (prompt, decode, wide),
        (
            7,
            21,
            3 * weightlift_kernels::sources::Q8_WIDE_WEIGHT_TYPES.len()
        ),
        "q8_matmul, q8_matvec (with swiglu_q8_matvec) and wide-lane kernels in the matvec PTX"
    );
}

/// The float-weight kernels read their weights with 128-bit loads (`wl_fv_load`'s PTX) and have
/// launch bounds: check the PTX of every `matvec_`/`matvec3_`/`matmul_`/`swiglu_matvec_` kernel of f16,
/// bf16 and f32, so
/// the `__CUDA_ARCH__` guard did not silently select the byte-by-byte fallback alone.
#[cfg(feature = "nvrtc-check")]
#[test]
fn float_matvec_kernels_load_128_bits_at_a_time() {
    common::require_nvrtc();
    let ptx = &compiled_for("matvec", "sm_90").ptx;
    let mut entries = 0;
    for body in ptx.split(".entry ").skip(1) {
        let name = body.split('(').next().unwrap_or("").trim();
        let float = ["f16", "bf16", "f32"].iter().any(|t| {
            ["matvec_", "matvec3_", "matmul_", "swiglu_matvec_"]
                .iter()
                .any(|k| name.starts_with(&format!("{k}{t}_")))
        });
        if !float {
            continue;
        }
        entries += 1;
        // the entry's body runs up to the next .entry; the directives sit before its `{`
        let head = body.split('{').next().unwrap_or("");
        assert!(head.contains(".maxntid 256"), "{name}: no launch bounds");
        assert!(
            body.contains("ld.global.nc.v4.u32"),
            "{name}: no 128-bit weight load in its PTX"
        );
        if name.ends_with("_f32") {
            assert!(
                body.contains("ld.global.nc.v4.f32"),
                "{name}: no 128-bit activation load in its PTX"
            );
        }
    }
    assert_eq!(
        entries, 24,
        "float matvec/matvec3/matmul/swiglu_matvec kernels in the matvec PTX"
    );
}

/// The dequantise kernels write eight values a thread: an f16 kernel one 128-bit store of
/// them, an f32 kernel two (where the output is 16-byte aligned; see dequant.cu).
#[cfg(feature = "nvrtc-check")]
#[test]
fn dequantize_kernels_store_128_bits_at_a_time() {
    common::require_nvrtc();
    let ptx = &compiled_for("dequant", "sm_90").ptx;
    let mut entries = 0;
    for body in ptx.split(".entry ").skip(1) {
        let name = body.split('(').next().unwrap_or("").trim();
        if !name.starts_with("dequantize_") {
            continue;
        }
        entries += 1;
        // the compiler may name the stored words u32 or f32
        assert!(
            body.contains("st.global.v4."),
            "{name}: no 128-bit store in its PTX"
        );
    }
    assert_eq!(
        entries, 28,
        "dequantize kernels (14 types, f32 and f16) in the dequant PTX"
    );
}

/// The plan charges [`sources::MODULE_BYTES`] for our kernel modules beside a measured CUDA
/// context: it must cover every module's sm_90 CUBIN (code and constants), each rounded up to
/// the 2 MiB granularity the driver allocates device memory in.
#[cfg(feature = "nvrtc-check")]
#[test]
fn the_module_allowance_covers_every_cubin() {
    use weightlift_kernels::sources;
    common::require_nvrtc();
    let granule = 2u64 << 20;
    let mut needed = 0u64;
    for (name, _) in sources::SOURCES {
        let cubin = compiled_for(name, "sm_90").cubin.as_ref().unwrap();
        eprintln!("{name}: {} bytes of sm_90 cubin", cubin.len());
        needed += (cubin.len() as u64).div_ceil(granule) * granule;
    }
    assert!(
        needed <= sources::MODULE_BYTES,
        "the modules need {needed} bytes; raise sources::MODULE_BYTES"
    );
}

/// The prompt attention kernel for tensor cores of every cache format multiplies with
/// `mma.sync` in its sm_90 PTX, so the `__CUDA_ARCH__ >= 800` guard did not leave it empty
/// there, and has no such instruction (nor any product) in its compute_75 PTX, where the host never
/// launches it.
#[cfg(feature = "nvrtc-check")]
#[test]
fn prompt_attention_mma_kernel_uses_tensor_cores_from_sm80() {
    common::require_nvrtc();
    let body = |name: &str, arch: &str| -> String {
        let ptx = &compiled_for("attention_prefill_mma", arch).ptx;
        let at = ptx
            .find(&format!(".entry {name}("))
            .unwrap_or_else(|| panic!("no {name} in the {arch} PTX"));
        let rest = &ptx[at + 1..];
        rest[..rest.find(".entry ").unwrap_or(rest.len())].to_string()
    };
    let mma = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32";
    for t in ["f32", "f16", "bf16", "e4m3", "q8", "q4", "q8_q4"] {
        let name = format!("attention_prefill_mma_{t}");
        // S = Q K^T and O += P V: at least one product each in the unrolled tile
        assert!(
            body(&name, "sm_90").matches(mma).count() >= 2,
            "{name}: no {mma} in its sm_90 PTX"
        );
        assert!(
            !body(&name, OLDEST).contains("mma.sync"),
            "{name}: an mma.sync in its {OLDEST} PTX"
        );
    }
}

/// The Q8 mode's int8 tensor-core prompt kernels multiply with `mma.sync` m16n8k32 on s8
/// operands in their sm_90 PTX (so the `__CUDA_ARCH__ >= 800` guard did not leave them empty
/// there), Q6_K with two products a group, and have no such instruction in their compute_75 PTX,
/// where the host never launches them.
#[cfg(feature = "nvrtc-check")]
#[test]
fn q8_mma_kernels_use_int8_tensor_cores_from_sm80() {
    common::require_nvrtc();
    let body = |arch: &str, name: &str| -> String {
        let ptx = &compiled_for("matvec", arch).ptx;
        let at = ptx
            .find(&format!(".entry {name}("))
            .unwrap_or_else(|| panic!("no {name} in the {arch} PTX"));
        let rest = &ptx[at + 1..];
        rest[..rest.find(".entry ").unwrap_or(rest.len())].to_string()
    };
    let mma = "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32";
    for ty in weightlift_kernels::sources::MMQ_TYPES {
        let name = format!("q8_mma_{}", ty.name());
        // eight n-blocks a group, unrolled: eight products (sixteen for Q6_K's halves)
        let want = if *ty == weightlift_kernels::QuantType::Q6_K {
            16
        } else {
            8
        };
        let n = body("sm_90", &name).matches(mma).count();
        assert!(
            n >= want,
            "{name}: {n} of {mma} in its sm_90 PTX, want {want}"
        );
        assert!(
            !body(OLDEST, &name).contains("mma.sync"),
            "{name}: an mma.sync in its {OLDEST} PTX"
        );
    }
}

/// The threads a block the CUDA backend launches kernel `name` with: the configs of
/// `cuda/matmul.rs`, `cuda/ops.rs`, `cuda/quantize.rs` and `cuda/launch.rs` (whose elementwise,
/// per-row and one-block launches, the int8, exact quantised and several-token Q8 products all
/// take 256).
#[cfg(feature = "nvrtc-check")]
fn launch_threads(name: &str) -> usize {
    use weightlift_kernels::sources::{
        ATTENTION_WARPS, FLOAT_BLOCK_THREADS, GEMM_THREADS, MMQ_THREADS, Q8_MATVEC_THREADS,
        QUANTIZE_THREADS,
    };
    let starts = |prefixes: &[&str]| prefixes.iter().any(|p| name.starts_with(p));
    let float = ["f16", "bf16", "f32"].iter().any(|t| {
        ["matvec_", "matmul_", "swiglu_matvec_"]
            .iter()
            .any(|k| name.starts_with(&format!("{k}{t}_")))
    });
    if starts(&["attention_"]) {
        ATTENTION_WARPS * 32
    } else if starts(&["quantize_"]) {
        QUANTIZE_THREADS
    } else if starts(&[
        "q8_matvec_",
        "q8_wide_matvec_",
        "swiglu_q8_matvec_",
        "swiglu_q8_wide_matvec_",
    ]) {
        Q8_MATVEC_THREADS
    } else if starts(&["gemm_"]) {
        GEMM_THREADS
    } else if starts(&["q8_mma_"]) {
        MMQ_THREADS
    } else if float {
        FLOAT_BLOCK_THREADS
    } else {
        256
    }
}

/// Every launch fits its kernel: a block of more threads than the kernel's `__launch_bounds__`
/// (PTX `.maxntid`) fails on the device with "too many resources requested for launch", since
/// ptxas gave each thread the registers of the bound; a kernel without bounds may take 255
/// registers a thread, so its blocks stay at 256 threads (255 × 256 of the 65,536 registers an
/// SM holds).
#[cfg(feature = "nvrtc-check")]
#[test]
fn every_launch_fits_its_kernels_launch_bounds() {
    use weightlift_kernels::sources;
    common::require_nvrtc();
    let mut bounded = 0;
    for (module, _) in sources::SOURCES {
        for arch in ARCHES {
            let ptx = &compiled_for(module, arch).ptx;
            for body in ptx.split(".entry ").skip(1) {
                let name = body.split('(').next().unwrap_or("").trim();
                let threads = launch_threads(name);
                // the directives sit between the parameter list and the body's `{`
                let head = body.split('{').next().unwrap_or("");
                let bound = head.split(".maxntid").nth(1).map(|dims| {
                    dims.split(['\n', '.'])
                        .next()
                        .unwrap_or("")
                        .split(',')
                        .map(|d| d.trim().parse::<usize>().expect("a .maxntid dimension"))
                        .product::<usize>()
                });
                match bound {
                    Some(most) => {
                        bounded += 1;
                        assert!(
                            threads <= most,
                            "{name} ({arch}): launched with {threads} threads a block, its \
                             launch bounds allow {most}"
                        );
                    }
                    None => assert!(
                        threads <= 256,
                        "{name} ({arch}): {threads} threads a block without launch bounds"
                    ),
                }
            }
        }
    }
    // the attention, float and Q8 decode products and quantisers: 73 a compile now
    assert!(bounded >= 140, "only {bounded} kernels with launch bounds");
}

//! Build script: embeds the CUDA sources (headers inlined) for NVRTC, compiles them to PTX with
//! nvcc when one is found, and builds the host twin of the shared headers for the tests.

// A build script talks to cargo through stdout.
#![allow(clippy::print_stdout)]

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Inlines `#include "x.cuh"` (local headers only, once each), so NVRTC needs no include path.
fn expand(path: &Path, dir: &Path, seen: &mut Vec<String>, out: &mut String) {
    let text =
        fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    for line in text.lines() {
        let t = line.trim();
        if t == "#pragma once" {
            continue;
        }
        if let Some(rest) = t.strip_prefix("#include \"") {
            let name = rest.trim_end_matches('"').to_string();
            if !seen.contains(&name) {
                seen.push(name.clone());
                expand(&dir.join(&name), dir, seen, out);
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
}

fn find_nvcc() -> Option<PathBuf> {
    if let Ok(p) = env::var("WEIGHTLIFT_NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Ok(home) = env::var("CUDA_HOME") {
        let p = Path::new(&home).join("bin/nvcc");
        if p.exists() {
            return Some(p);
        }
    }
    env::var_os("PATH").and_then(|paths| {
        env::split_paths(&paths)
            .map(|d| d.join("nvcc"))
            .find(|p| p.exists())
    })
}

fn main() {
    let manifest =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kdir = manifest.join("../../kernels");
    println!("cargo::rerun-if-changed={}", kdir.display());
    println!("cargo::rerun-if-changed=shim/host_shim.cpp");
    println!("cargo::rerun-if-env-changed=WEIGHTLIFT_NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_HOME");
    println!("cargo::rustc-check-cfg=cfg(wl_host_shim)");
    println!("cargo::rustc-check-cfg=cfg(wl_nvcc_ptx)");

    let mut files: Vec<PathBuf> = fs::read_dir(&kdir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", kdir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("cu" | "cuh")))
        .collect();
    files.sort();
    for f in &files {
        println!("cargo::rerun-if-changed={}", f.display());
    }

    let cuda_feature = env::var_os("CARGO_FEATURE_CUDA").is_some();
    let nvcc = if cuda_feature { find_nvcc() } else { None };
    let mut sources = String::from(
        "/// Kernel sources with their headers inlined: (module name, CUDA C++).\npub const SOURCES: &[(&str, &str)] = &[\n",
    );
    let mut ptx = String::from(
        "/// PTX built by nvcc at build time (empty when no nvcc was found): (module name, PTX).\npub const PTX: &[(&str, &str)] = &[\n",
    );
    let mut any_ptx = false;
    for f in files
        .iter()
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("cu"))
    {
        let stem = f
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 kernel file name")
            .to_string();
        let mut text = String::new();
        expand(f, &kdir, &mut Vec::new(), &mut text);
        let flat = out_dir.join(format!("{stem}.cu"));
        fs::write(&flat, &text).expect("writing expanded kernel source");
        sources.push_str(&format!(
            "    ({stem:?}, include_str!(concat!(env!(\"OUT_DIR\"), \"/{stem}.cu\"))),\n"
        ));
        if let Some(nvcc) = &nvcc {
            let ptx_path = out_dir.join(format!("{stem}.ptx"));
            let ok = Command::new(nvcc)
                .args(["-ptx", "-arch=compute_80", "-O3", "-o"])
                .arg(&ptx_path)
                .arg(&flat)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ok {
                ptx.push_str(&format!(
                    "    ({stem:?}, include_str!(concat!(env!(\"OUT_DIR\"), \"/{stem}.ptx\"))),\n"
                ));
                any_ptx = true;
            } else {
                println!(
                    "cargo::warning=nvcc at {} could not compile {stem}.cu; NVRTC will compile it at first use",
                    nvcc.display()
                );
            }
        }
    }
    sources.push_str("];\n");
    ptx.push_str("];\n");
    fs::write(out_dir.join("kernel_sources.rs"), sources + &ptx)
        .expect("writing kernel_sources.rs");
    if any_ptx {
        println!("cargo::rustc-cfg=wl_nvcc_ptx");
    }

    // The host twin of the shared headers, for tests. A missing C++ compiler only disables
    // those tests (they say so), it never breaks the build.
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .cpp_link_stdlib(None)
        .file(manifest.join("shim/host_shim.cpp"))
        .include(&kdir)
        .flag_if_supported("-ffp-contract=off")
        .flag_if_supported("-fno-fast-math")
        .warnings(true)
        .cargo_warnings(true);
    match build.try_compile("wl_host_shim") {
        Ok(()) => println!("cargo::rustc-cfg=wl_host_shim"),
        Err(e) => {
            println!("cargo::warning=host shim not built ({e}); the host-twin tests will fail")
        }
    }
}

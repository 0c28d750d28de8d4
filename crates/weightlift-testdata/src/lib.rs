//! Where the tests find their data, and the failure that names the `make` target providing it.
//!
//! Every test of every crate reaches the reference pack, the demo model and llama.cpp's
//! tokenizer vectors through these functions, so a missing file fails the same way everywhere:
//! with the path and the target that makes it. Each location can be moved by an environment
//! variable (a GPU bundle runs the test binaries away from the build folder); otherwise it is
//! a folder of this checkout that `make` fills.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The repository root, as this crate was built from.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn from_env_or(var: &str, default: impl FnOnce() -> PathBuf) -> PathBuf {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(default)
}

/// The reference pack (`tiny-llama/`, `smollm2-135m/`) as `make reference` lays it out from
/// `tests/reference/`: `$WEIGHTLIFT_REFERENCE`, else `.cache/reference`.
///
/// Panics, failing the test, when the folder is missing or was laid out from another
/// `tests/reference/manifest.json` than this checkout's. The folder is checked once a process.
pub fn reference() -> PathBuf {
    static CHECKED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match CHECKED.get_or_init(check_reference) {
        Ok(dir) => dir.clone(),
        Err(why) => panic!("{why}"),
    }
}

fn check_reference() -> Result<PathBuf, String> {
    let dir = from_env_or("WEIGHTLIFT_REFERENCE", || {
        repo_root().join(".cache/reference")
    });
    let stamp = dir.join("manifest.json");
    let Ok(laid_out) = std::fs::read(&stamp) else {
        return Err(format!(
            "the reference data is missing: {} does not exist; run `make reference` \
             (`make test` does), which lays it out from tests/reference/",
            stamp.display()
        ));
    };
    if std::env::var_os("WEIGHTLIFT_REFERENCE").is_none() {
        let want = repo_root().join("tests/reference/manifest.json");
        if std::fs::read(&want).is_ok_and(|w| w != laid_out) {
            return Err(format!(
                "the reference data in {} is out of date with {}; run `make reference`",
                dir.display(),
                want.display()
            ));
        }
    }
    Ok(dir)
}

/// A file of the reference pack, which must exist (see [`reference`]).
pub fn reference_file(rel: &str) -> PathBuf {
    let path = reference().join(rel);
    assert!(
        path.exists(),
        "reference file {} is missing; run `make reference` (`make test` does)",
        path.display()
    );
    path
}

/// The SmolLM2 demo model: `$WEIGHTLIFT_DEMO_GGUF` (the Makefile exports it), else the repo's
/// `.cache/models`. Panics, naming `make demo-model`, when it is not there.
pub fn demo_gguf() -> PathBuf {
    let path = from_env_or("WEIGHTLIFT_DEMO_GGUF", || {
        repo_root().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(
        path.is_file(),
        "the demo model {} is missing; run `make demo-model` (`make test` does)",
        path.display()
    );
    path
}

/// llama.cpp's tokenizer test vectors: `$WEIGHTLIFT_VOCAB_DIR`, else the repo's `.cache/vocab`.
/// Panics, naming `make vocab`, when the folder is not there.
pub fn vocab_dir() -> PathBuf {
    let dir = from_env_or("WEIGHTLIFT_VOCAB_DIR", || repo_root().join(".cache/vocab"));
    assert!(
        dir.is_dir(),
        "llama.cpp's tokenizer vectors are missing at {}; run `make vocab` (`make test` does)",
        dir.display()
    );
    dir
}

/// Fails unless every `tests/*.rs` file of the crate at `manifest_dir` runs: as a module of
/// `tests/suite.rs` (a `mod NAME;` line) or as a `[[test]]` of its own in the crate's
/// Cargo.toml (`path = "tests/NAME.rs"`). The crates list their test binaries by hand
/// (`autotests = false`), so a new file that is in neither would silently never run.
pub fn assert_every_test_file_runs(manifest_dir: &str) {
    let dir = Path::new(manifest_dir);
    let read =
        |p: &Path| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let manifest = read(&dir.join("Cargo.toml"));
    let suite = read(&dir.join("tests/suite.rs"));
    let mut missing = Vec::new();
    let entries = std::fs::read_dir(dir.join("tests"))
        .unwrap_or_else(|e| panic!("{}/tests: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a tests/ entry").path();
        let (Some(stem), Some("rs")) = (
            path.file_stem().and_then(|s| s.to_str()),
            path.extension().and_then(|s| s.to_str()),
        ) else {
            continue;
        };
        let own_binary = manifest.contains(&format!("path = \"tests/{stem}.rs\""));
        let module = suite.lines().any(|l| l.trim() == format!("mod {stem};"));
        if !own_binary && !module {
            missing.push(format!("tests/{stem}.rs"));
        }
    }
    assert!(
        missing.is_empty(),
        "{}: {missing:?} would never run: add `mod NAME;` to tests/suite.rs, or a [[test]] \
         with `path = \"tests/NAME.rs\"` to Cargo.toml when the file needs a process of its own",
        dir.display()
    );
}

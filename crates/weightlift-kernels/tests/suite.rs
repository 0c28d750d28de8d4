//! Every integration test of this crate that can share a process, as one test binary: the
//! shared helpers compiled and the binary linked once instead of once per file.
//! Each file is a module (`cargo test --test suite <file>::` runs one). A file that needs a
//! process of its own (a GPU suite the GPU bundle runs by name, a process-wide counter or
//! memory measurement) is a `[[test]]` of its own in Cargo.toml, and
//! `every_test_file_runs` fails when a file is in neither place.

mod common;

mod cpu_matmul;
mod cpu_ops;
mod cpu_simd_ops;
mod dequant_isa;
mod host_twin;
mod known_answers;
mod quantize;
mod quantize_twin;

#[test]
fn every_test_file_runs() {
    weightlift_testdata::assert_every_test_file_runs(env!("CARGO_MANIFEST_DIR"));
}

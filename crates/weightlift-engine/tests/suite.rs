//! Every integration test of this crate that can share a process, as one test binary: the
//! shared helpers compiled and the binary linked once instead of once per file.
//! Each file is a module (`cargo test --test suite <file>::` runs one). A file that needs a
//! process of its own (a GPU suite the GPU bundle runs by name, a process-wide counter or
//! memory measurement) is a `[[test]]` of its own in Cargo.toml, and
//! `every_test_file_runs` fails when a file is in neither place.

mod common;

mod batch_forward;
mod cache;
mod chat;
mod embeddings;
mod exl2_forward;
mod forward;
mod forward_gemma;
mod forward_moe;
mod forward_phi3;
mod forward_qwen2;
mod forward_qwen3;
mod forward_wide_q4k;
mod generate;
mod gptq_forward;
mod grammar;
mod int8_forward;
mod loader;
mod model;
mod planned;
mod session;
mod sliding_window;
mod tp_forward;
mod tp_quantize;

#[test]
fn every_test_file_runs() {
    weightlift_testdata::assert_every_test_file_runs(env!("CARGO_MANIFEST_DIR"));
}

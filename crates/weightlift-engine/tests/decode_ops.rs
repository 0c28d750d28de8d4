//! How many backend operations one decode step issues, per layer and around the layers.
//!
//! On a GPU every operation is at least one kernel launch, and decode of a small model is
//! bound by launches as much as by bandwidth. The CPU backend runs the operation sequence the
//! CUDA backend runs, so counting it here pins the launch budget without a GPU: a change that
//! adds an operation to the layer fails this test, and a fusion that removes one updates the
//! expected table on purpose.
//!
//! The same counter counts the host bytes a step copies to the device: a decode step's own
//! position, nothing else (the RoPE table stays in the workspace from the graph's first call).
//!
//! Two llama models with tied heads and different depths (the tiny llama, 2 layers; SmolLM2,
//! 30 layers) separate the per-layer share from the fixed one: what the deeper model issues
//! beyond the shallower one, divided by the extra layers, is one layer's operations.
//! Its own test binary: the counter sees every backend in the process, and the tests here take
//! turns ([`SERIAL`]).

mod common;

use std::collections::BTreeMap;

use common::{argmax, open, reference, smollm2, smollm2_prompt};
use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::{CacheDType, Model};
use weightlift_kernels::{OpCounter, Uploads};

/// Held by each test while it counts: a counter sees the operations of every test running.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Operations of one decode step (one new token, the last row's logits) after `prompt`, with
/// the layers run through the CPU backend.
fn decode_step_ops(
    src: &std::sync::Arc<dyn weightlift_engine::Source>,
    prompt: &[u32],
) -> BTreeMap<&'static str, usize> {
    let (mut m, cache) = common::load_on(src, "cpu", "cpu", 64, CacheDType::Fp16);
    m.set_compute(Compute::Fast);
    m.set_host_backend(true);
    assert!(m.host_backend());
    let mut out = Vec::new();
    m.forward(prompt, Some(&cache), Logits::Last, &mut out)
        .unwrap();
    let next = argmax(&out) as u32;
    let counter = OpCounter::start();
    step(&mut m, &cache, next, &mut out);
    counter.counts()
}

fn step(
    m: &mut Model,
    cache: &std::sync::Arc<weightlift_engine::Cache>,
    id: u32,
    out: &mut Vec<f32>,
) {
    m.forward(&[id], Some(cache), Logits::Last, out).unwrap();
}

#[test]
fn a_decode_step_issues_a_fixed_number_of_operations_per_layer() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tiny = open(reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf"));
    let tiny_ops = decode_step_ops(&tiny, &[1, 9038, 2501, 263]);
    let smol_ops = decode_step_ops(&smollm2(), &smollm2_prompt(1));
    let (tiny_layers, smol_layers) = (2usize, 30usize);

    let names: Vec<&str> = tiny_ops.keys().chain(smol_ops.keys()).copied().collect();
    let mut per_layer = BTreeMap::new();
    let mut fixed = BTreeMap::new();
    for name in names {
        let (t, s) = (
            tiny_ops.get(name).copied().unwrap_or(0),
            smol_ops.get(name).copied().unwrap_or(0),
        );
        let extra = s
            .checked_sub(t)
            .unwrap_or_else(|| panic!("{name}: {s} ops at 30 layers, {t} at 2"));
        assert_eq!(
            extra % (smol_layers - tiny_layers),
            0,
            "{name}: {t} ops at 2 layers, {s} at 30: not a whole number per layer"
        );
        let n = extra / (smol_layers - tiny_layers);
        if n > 0 {
            per_layer.insert(name, n);
        }
        // around the layers, which may take one off: a fusion across two layers leaves the
        // first layer's half unfused
        let edge = t as i64 - (n * tiny_layers) as i64;
        if edge != 0 {
            fixed.insert(name, edge);
        }
    }
    eprintln!("per layer: {per_layer:?}\naround the layers: {fixed:?}");

    // One layer, fast mode: the previous layer's MLP residual fused with the attention norm;
    // the q/k/v products (one shared op, so the normed activation is quantised once), RoPE on
    // q and k with the two cache stores (one op), attention, the output product; its residual
    // fused with the MLP norm; the gate and up products with SwiGLU (one op) and the down
    // product.
    let want_layer = BTreeMap::from([
        ("add_rms_norm", 2),
        ("attention", 1),
        ("matmul", 2),
        ("matmul_shared", 1),
        ("matmul_swiglu", 1),
        ("rope_kv_store", 1),
    ]);
    assert_eq!(
        per_layer, want_layer,
        "operations per layer of a decode step"
    );
    let per_layer_total: usize = per_layer.values().sum();
    assert_eq!(per_layer_total, 8, "operations per layer");
    // Around the layers: the new token's embedding row (dequantised from the tied table); the
    // first layer's attention norm alone (one plain norm, one fused add-and-norm fewer); the
    // last layer's MLP residual alone; the final norm and the head product.
    let want_fixed = BTreeMap::from([
        ("add_in_place", 1),
        ("add_rms_norm", -1),
        ("dequantize", 1),
        ("matmul", 1),
        ("rms_norm", 2),
    ]);
    assert_eq!(
        fixed, want_fixed,
        "operations around the layers of a decode step"
    );
}

/// A decode step copies one upload of host bytes to the device: its position (one i32). The
/// RoPE table is written once, by the graph's first call (the prompt, with its positions), and
/// stays in the workspace; a new graph (here: the host path and back) writes it again. On a GPU
/// each upload is a copy the host queues through pinned staging, and a second one in the same
/// step had the host wait for the first's copy.
#[test]
fn a_decode_step_uploads_its_position_only() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let prompt = smollm2_prompt(1);
    let (mut m, cache) = common::load_on(&smollm2(), "cpu", "cpu", 64, CacheDType::Fp16);
    m.set_compute(Compute::Fast);
    m.set_host_backend(true);
    // SmolLM2's heads are 64 values wide: 32 f32 frequencies
    let table = 32 * 4;
    let counter = OpCounter::start();
    let mut out = Vec::new();
    m.forward(&prompt, Some(&cache), Logits::Last, &mut out)
        .unwrap();
    let prompt_bytes = prompt.len() * 4;
    assert_eq!(
        counter.uploads(),
        Uploads {
            calls: 2,
            bytes: table + prompt_bytes,
            waits: 0
        },
        "the first call: the RoPE table and the prompt's positions"
    );
    let since = |before: Uploads| {
        let now = counter.uploads();
        (now.calls - before.calls, now.bytes - before.bytes)
    };
    for k in 0..3 {
        let before = counter.uploads();
        step(&mut m, &cache, argmax(&out) as u32, &mut out);
        assert_eq!(since(before), (1, 4), "decode step {k}: its position only");
    }
    m.set_host_backend(false);
    m.set_host_backend(true);
    let before = counter.uploads();
    step(&mut m, &cache, argmax(&out) as u32, &mut out);
    assert_eq!(
        since(before),
        (2, table + 4),
        "a new graph's first step: the table again, and the position"
    );
    let before = counter.uploads();
    step(&mut m, &cache, argmax(&out) as u32, &mut out);
    assert_eq!(since(before), (1, 4), "its next step: the position only");
}

/// On `cuda:0` the same holds through a captured step's warm-up, capture and replays (the
/// table's upload is the first call's, outside every recorded step), and the host never waits
/// for an earlier upload's copy before staging the next: a step's position goes through the
/// staging buffer the last upload did not use, whose copy the last step's logits waited for.
/// On the reference pack's tiny llama (heads of 64 values, as SmolLM2's), which the GPU bundle
/// carries where the demo model is too large to.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn a_cuda_decode_step_uploads_its_position_without_waiting() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let prompt = common::json_ids(&reference().join("tiny-llama/ids.json"), "ids");
    let src = open(reference().join("tiny-llama/gguf/tiny-llama-Q4_K_M.gguf"));
    let (mut m, cache) = common::load_on(&src, "cuda:0,cpu", "cuda:0", 64, CacheDType::Fp16);
    m.set_compute(Compute::Fast);
    m.set_cuda_graphs(true);
    let counter = OpCounter::start();
    let mut out = Vec::new();
    m.forward(&prompt, Some(&cache), Logits::Last, &mut out)
        .unwrap();
    let first = counter.uploads();
    assert_eq!(
        (first.calls, first.bytes),
        (2, 32 * 4 + prompt.len() * 4),
        "the first call: the RoPE table and the prompt's positions"
    );
    for k in 0..5 {
        let before = counter.uploads();
        step(&mut m, &cache, argmax(&out) as u32, &mut out);
        let now = counter.uploads();
        assert_eq!(
            (
                now.calls - before.calls,
                now.bytes - before.bytes,
                now.waits - before.waits
            ),
            (1, 4, 0),
            "decode step {k}: (uploads, bytes, host waits)"
        );
    }
    let (captures, replays, refused) = m.cuda_graph_counts();
    assert_eq!(
        (captures, replays, refused),
        (1, 4, None),
        "(captures, replays, refused)"
    );
}

/// A mixture-of-experts layer through the backend with its experts on the host (the tiny
/// mixtral and qwen3moe, 2 layers, Q8_0, tied heads, whole on cpu) issues the dense layer's
/// operations up to the MLP norm, then one product, the router's, where a dense layer issues
/// its fused gate-up-SwiGLU and its down product: the routed experts run on the host with the
/// host path's kernels, not as backend operations, so no expert weight is read by the device.
/// With the experts on the device (the layers on a virtual device standing for a GPU), each of
/// the token's 2 experts adds 4: the gather of its row, its fused gate-up-SwiGLU, its down
/// product and the weighted add of its row into the token's sum.
#[test]
fn a_moe_decode_step_issues_the_router_product_and_each_routed_experts_operations() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let data = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data");
    for (family, qk_norms) in [("mixtral", 0), ("qwen3moe", 2)] {
        let src = open(data.join(format!("tiny-{family}/tiny-{family}-Q8_0.gguf")));
        let prompt = [1, 5, 9, 13];
        let ops = decode_step_ops(&src, &prompt);
        // per layer: attention norm (the first alone, the second fused with the first's MLP
        // residual), the shared q/k/v product, qwen3's q and k norms, RoPE with the cache
        // stores, attention, the output product, its residual fused with the MLP norm, the
        // router product; around them: the embedding row, the last residual, the output norm
        // and the head product
        let want = std::collections::BTreeMap::from([
            ("add_in_place", 1),
            ("add_rms_norm", 3),
            ("attention", 2),
            ("dequantize", 1),
            ("matmul", 2 * 2 + 1),
            ("matmul_shared", 2),
            ("rms_norm", 1 + 2 * qk_norms + 1),
            ("rope_kv_store", 2),
        ]);
        assert_eq!(ops, want, "{family}: operations of a decode step");

        let (mut m, cache) = common::load_on(
            &src,
            "virtual:1x64MiB,cpu",
            "virtual:0",
            64,
            CacheDType::Fp16,
        );
        m.set_compute(Compute::Fast);
        m.set_host_backend(true);
        let mut out = Vec::new();
        m.forward(&prompt, Some(&cache), Logits::Last, &mut out)
            .unwrap();
        let next = argmax(&out) as u32;
        let counter = OpCounter::start();
        step(&mut m, &cache, next, &mut out);
        let ops = counter.counts();
        let (layers, used) = (2, 2);
        let mut want = want;
        *want.get_mut("matmul").unwrap() += layers * used;
        want.insert("gather_rows", layers * used);
        want.insert("matmul_swiglu", layers * used);
        want.insert("scatter_add_rows", layers * used);
        assert_eq!(
            ops, want,
            "{family}: operations of a decode step, experts on the device"
        );
    }
}

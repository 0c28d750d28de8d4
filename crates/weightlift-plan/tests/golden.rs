//! Golden cases taken from the anchors' own code and tests: exllamav2's `integer_split` and
//! `define_split`, accelerate's `get_balanced_memory` / `infer_auto_device_map` test cases,
//! llama.cpp's `n_gpu_layers` rule and its quantiser's type mix (reference GGUFs written by
//! llama.cpp, read with gguf-py).

use crate::common;

use common::*;
use weightlift_format::DType;
use weightlift_plan::*;

// ---------------------------------------------------------------------------------------------
// exllamav2's integer_split: expected values worked out from its rounding rule.

#[test]
fn integer_split_examples() {
    // Even split.
    assert_eq!(integer_split(8, &[24, 24], 0).unwrap(), [4, 4]);
    // 8·3/4 = 6, 8·1/4 = 2.
    assert_eq!(integer_split(8, &[3, 1], 0).unwrap(), [6, 2]);
    // 10/3 = 3.33 each; the one leftover goes to the first of the equal remainders.
    assert_eq!(integer_split(10, &[1, 1, 1], 0).unwrap(), [4, 3, 3]);
    // 20·10/11 = 18.18, 20/11 = 1.82: leftover to the larger remainder (index 1) -> [18, 2];
    // 2 is not below the minimum of 2, so it stays.
    assert_eq!(integer_split(20, &[10, 1], 2).unwrap(), [18, 2]);
    // 20·12/13 = 18.46, 20/13 = 1.54 -> [18, 2]; 2 < 3 is zeroed and handed to the smallest
    // non-zero share -> [20, 0].
    assert_eq!(integer_split(20, &[12, 1], 3).unwrap(), [20, 0]);
    // 16·10/21 = 7.62, 7.62, 0.76 -> [7, 7, 0] + 2 leftovers: index 2 (0.76), then index 0
    // (0.62, first of the ties) -> [8, 7, 1]; 1 < 2 is zeroed and given to the smallest
    // non-zero share, index 1 -> [8, 8, 0].
    assert_eq!(integer_split(16, &[10, 10, 1], 2).unwrap(), [8, 8, 0]);
    let e = integer_split(4, &[0, 0], 0).unwrap_err().to_string();
    assert!(e.contains("no room on any device"), "{e}");
}

fn tp_inputs(budgets: Vec<u64>, cache: u64) -> TpInputs {
    // Llama-3-8B shapes: 8 kv heads, 32 heads, 14336 intermediate, 4096 hidden, 128256 vocab.
    TpInputs {
        budgets_mib: budgets,
        n_kv_heads: 8,
        n_heads: 32,
        intermediate_size: 14336,
        hidden_size: 4096,
        vocab_size: 128256,
        cache_bytes: cache,
        attn_footprints: vec![],
        n_experts: 0,
        dense_layers: false,
    }
}

#[test]
fn define_split_example() {
    // gpu_split=[24, 12] (GB) -> [24576, 12288] MiB.
    let s = define_split(&tp_inputs(vec![24576, 12288], 0)).unwrap();
    // kv: 8·2/3 = 5.33, 2.67 -> [5, 2] + leftover to index 1 -> [5, 3]; q = kv × 4.
    assert_eq!(s.kv, [(0, 0, 5), (1, 5, 8)]);
    assert_eq!(s.q, [(0, 0, 20), (1, 20, 32)]);
    // id: 112 units of 128: 74.67, 37.33 -> [74, 37] + 1 to index 0 -> [75, 37].
    assert_eq!(s.id, [(0, 0, 9600), (1, 9600, 14336)]);
    // rs: 128 units of 32: 85.33, 42.67 -> [85, 43].
    assert_eq!(s.rs, [(0, 0, 2720), (1, 2720, 4096)]);
    // vc: ceil(128256/32) = 4008 units: 2672, 1336 exactly.
    assert_eq!(s.vc, [(0, 0, 85504), (1, 85504, 128256)]);

    // An expected cache of 8 GiB is taken off in proportion to the kv split (5/8 and 3/8):
    // budgets become [19456, 9216] MiB and id = 112·19456/28672 = 76 exactly.
    let s = define_split(&tp_inputs(vec![24576, 12288], 8 << 30)).unwrap();
    assert_eq!(s.id, [(0, 0, 76 * 128), (1, 76 * 128, 14336)]);

    // A device squeezed to nothing by the attention weights gets no MLP share: budgets
    // [1000, 1000] MiB, kv [4, 4]; 32 layers of 60 MiB attention take 30 MiB each per device
    // per layer -> 1000 - 960 = 40 MiB each, still even.
    let mut inp = tp_inputs(vec![1000, 1000], 0);
    inp.attn_footprints = vec![60 << 20; 32];
    let s = define_split(&inp).unwrap();
    assert_eq!(s.id, [(0, 0, 7168), (1, 7168, 14336)]);

    // exllamav2 refuses intermediate sizes not divisible by 128.
    let mut bad = tp_inputs(vec![1, 1], 0);
    bad.intermediate_size = 1000;
    assert!(
        define_split(&bad)
            .unwrap_err()
            .to_string()
            .contains("divisible by 128")
    );
}

/// A mixture-of-experts model's MLPs follow the expert table alone; one with dense layers
/// beside its expert ones (a Qwen MoE's `mlp_only_layers`) has the intermediate table too, made
/// as a dense model's, and needs its dense width in whole units of 128 as a dense model does.
#[test]
fn define_split_of_a_moe_model_with_dense_layers_has_both_tables() {
    let dense = define_split(&tp_inputs(vec![1000, 1000], 0)).unwrap();
    let mut moe = tp_inputs(vec![1000, 1000], 0);
    moe.n_experts = 8;
    let s = define_split(&moe).unwrap();
    assert_eq!(s.ex, [(0, 0, 4), (1, 4, 8)]);
    assert!(s.id.is_empty());
    moe.dense_layers = true;
    let s = define_split(&moe).unwrap();
    assert_eq!(s.ex, [(0, 0, 4), (1, 4, 8)]);
    assert_eq!(s.id, dense.id);
    assert_eq!((s.kv, s.rs, s.vc), (dense.kv, dense.rs, dense.vc));
    moe.intermediate_size = 64;
    let e = define_split(&moe).unwrap_err().to_string();
    assert!(
        e.contains("divisible by 128 for the dense layers' MLP") && e.contains("got 64"),
        "{e}"
    );
    moe.dense_layers = false;
    assert!(
        define_split(&moe).is_ok(),
        "an unused dense width is not split"
    );
}

#[test]
fn tensor_parallel_plan_uses_the_tables() {
    let spec = llama(4, 4096, 14336, 32, 8, 128, 128256, false);
    let mut req = request(spec, "q4_k_m", "virtual:24GiB,virtual:12GiB,cpu:64GiB");
    req.strategy = Strategy::TensorParallel(TpOptions {
        gpu_split_mib: Some(vec![24576, 12288]),
    });
    let p = plan(&req).unwrap();
    assert_eq!(p.tp_split(TpKind::Kv).unwrap(), [(0, 0, 5), (1, 5, 8)]);
    assert_eq!(p.tp_split(TpKind::Q).unwrap(), [(0, 0, 20), (1, 20, 32)]);
    assert_eq!(
        p.require_tp_split(TpKind::Q).unwrap(),
        p.tp_split(TpKind::Q).unwrap()
    );
    // attn_q rows follow Q × head_dim.
    let q = p
        .tensors()
        .iter()
        .find(|t| t.name == "blk.0.attn_q.weight")
        .unwrap();
    let split = q.split.as_ref().unwrap();
    assert_eq!((split.shards[0].start, split.shards[0].end), (0, 20 * 128));
    assert_eq!(split.shards.iter().map(|s| s.bytes).sum::<u64>(), q.bytes);
    assert_eq!(p.embed_device(), "cpu");
    // KV: 5 of 8 heads on device 0.
    assert!(
        p.devices()[0].kv == 0 && p.devices()[1].kv == 0,
        "no cache asked"
    );
}

// ---------------------------------------------------------------------------------------------
// accelerate's get_balanced_memory, with the model and budgets of accelerate's own test of it.
// ModelForTest: linear1 64 B, batchnorm 72 B, linear2 100 B, total 236, no no-split classes:
// mean leaf = int(236 / 3) = 78.

#[test]
fn accelerate_balanced_memory_examples() {
    let b = |mm: &[u64], low_zero: bool| balanced_max_memory(236, 0, 78, mm, low_zero, true);
    assert_eq!(b(&[200, 200], false), [200, 200]);
    assert_eq!(b(&[300, 300], false), [215, 300]);
    // "Last device always get max memory to give more buffer".
    assert_eq!(b(&[300, 500], false), [215, 500]);
    // "If we set a device to 0, it's not counted."
    assert_eq!(b(&[0, 300, 300], false), [0, 215, 300]);
    // One GPU with a cpu: unchanged.
    assert_eq!(b(&[300], false), [300]);
    // low_zero by the same code: per_gpu = 236/1 + 97 = 333, GPU 0 keeps what GPUs 1.. cannot
    // hold: max(0, 236 - 300) = 0.
    assert_eq!(b(&[300, 300], true), [0, 300]);
    // One GPU and no user max_memory: 90%.
    assert_eq!(
        balanced_max_memory(236, 0, 78, &[1000], false, false),
        [900]
    );
}

/// accelerate's own test of infer_auto_device_map, with each
/// ModelForTest module a layer (decoder blocks are never split).
#[test]
fn accelerate_infer_auto_device_map_examples() {
    let run = |layers: &[&[u64]], devs: &str| -> Vec<String> {
        let (spec, tensors) = toy(layers);
        let mut req = PlanRequest::new(spec, tensors, devices(devs));
        req.strategy = Strategy::Sequential;
        req.runtime = RuntimeSpec::none();
        plan(&req).unwrap().layer_devices().to_vec()
    };
    // "only linear1 fits on device 0 as we keep memory available for the maximum layer".
    assert_eq!(
        run(&[&[64], &[72], &[100]], "virtual:200B,virtual:200B"),
        ["virtual:0", "virtual:1", "virtual:1"]
    );
    // "On device 1, we don't care about keeping size available for the max layer".
    assert_eq!(
        run(
            &[&[64], &[72], &[100]],
            "virtual:200B,virtual:172B,virtual:200B"
        ),
        ["virtual:0", "virtual:1", "virtual:1"]
    );
    // no_split_module_classes=["ModelForTest"] over three of them, {0: 500, 1: 500} ->
    // {"0": 0, "1": 1, "2": 1}.
    let m: &[u64] = &[64, 72, 100];
    assert_eq!(
        run(&[m, m, m], "virtual:500B,virtual:500B"),
        ["virtual:0", "virtual:1", "virtual:1"]
    );
}

#[test]
fn balanced_spreads_and_low_0_keeps_gpu0_light() {
    let mut req = request(
        llama(8, 1024, 4096, 8, 8, 128, 32000, false),
        "float16",
        "virtual:4x1GiB,cpu:8GiB",
    );
    req.runtime = RuntimeSpec::none();
    req.strategy = Strategy::Sequential;
    let seq = plan(&req).unwrap();
    req.strategy = Strategy::Balanced;
    let bal = plan(&req).unwrap();
    req.strategy = Strategy::BalancedLow0;
    let low = plan(&req).unwrap();
    let count = |p: &Plan, d: &str| p.layer_devices().iter().filter(|x| *x == d).count();
    // Sequential fills virtual:0 first; balanced uses all four.
    assert!(count(&seq, "virtual:0") > count(&bal, "virtual:0"));
    assert!(
        bal.devices()[..4].iter().all(|d| d.weights > 0),
        "{}",
        bal.explain()
    );
    assert!(count(&low, "virtual:0") <= count(&bal, "virtual:0"));
}

// ---------------------------------------------------------------------------------------------
// llama.cpp n_gpu_layers (its loader's `load_tensors`): the last N repeating layers on the
// GPUs, the output layer too when N > n_layer, the input layer always on the CPU.

fn layers_plan(ngl: i64, mode: SplitMode, ts: Vec<f32>, devs: &str) -> Plan {
    let mut req = request(llama(30, 512, 1024, 8, 8, 64, 1000, false), "q8_0", devs);
    req.strategy = Strategy::Layers(LayerOptions {
        n_gpu_layers: ngl,
        split_mode: mode,
        tensor_split: ts,
        ..LayerOptions::default()
    });
    plan(&req).unwrap()
}

#[test]
fn llama_cpp_n_gpu_layers_semantics() {
    let p = layers_plan(10, SplitMode::Layer, vec![], "cuda:0:8GiB,cpu");
    for (l, d) in p.layer_devices().iter().enumerate() {
        assert_eq!(d, if l >= 20 { "cuda:0" } else { "cpu" }, "layer {l}");
    }
    assert_eq!(p.device_of("output.weight").as_deref(), Some("cpu"));
    assert_eq!(p.device_of("token_embd.weight").as_deref(), Some("cpu"));

    // 30 offloads every repeating layer but not the output; 31 adds the output layer.
    let p = layers_plan(30, SplitMode::Layer, vec![], "cuda:0:8GiB,cpu");
    assert!(p.layer_devices().iter().all(|d| d == "cuda:0"));
    assert_eq!(p.device_of("output.weight").as_deref(), Some("cpu"));
    let p = layers_plan(31, SplitMode::Layer, vec![], "cuda:0:8GiB,cpu");
    assert_eq!(p.device_of("output.weight").as_deref(), Some("cuda:0"));
    assert_eq!(p.device_of("output_norm.weight").as_deref(), Some("cuda:0"));
    assert_eq!(p.device_of("token_embd.weight").as_deref(), Some("cpu"));
    let p = layers_plan(-1, SplitMode::Layer, vec![], "cuda:0:8GiB,cpu");
    assert_eq!(p.device_of("output.weight").as_deref(), Some("cuda:0"));
    let p = layers_plan(0, SplitMode::Layer, vec![], "cuda:0:8GiB,cpu");
    assert!(p.layer_devices().iter().all(|d| d == "cpu"));
}

#[test]
fn a_device_reports_its_layers_and_an_unbounded_one_no_capacity() {
    let p = layers_plan(10, SplitMode::Layer, vec![], "cuda:0:8GiB,cpu:64GiB,disk");
    let usage = |name: &str| p.devices().iter().find(|d| d.name == name).unwrap();
    let gpu = usage("cuda:0");
    assert_eq!(
        (gpu.n_layers(), gpu.bounded_capacity()),
        (10, Some(8 << 30))
    );
    assert_eq!(gpu.bounded_free(), Some(gpu.free));
    assert_eq!(usage("cpu").n_layers(), 20);
    let disk = usage("disk");
    assert_eq!((disk.bounded_capacity(), disk.bounded_free()), (None, None));
    // Not tensor-parallel: the split tables are refused with what to plan instead.
    let e = p.require_tp_split(TpKind::Kv).unwrap_err().to_string();
    assert!(e.contains("plan with strategy=\"tensor_parallel\""), "{e}");
}

#[test]
fn llama_cpp_layer_split_follows_cumulative_tensor_split() {
    // ngl=-1 over 30 layers: 31 offloaded units. tensor_split [3, 1] -> cumulative [0.75, 1];
    // unit il goes to upper_bound(il/31): il/31 < 0.75 for il <= 23.
    let p = layers_plan(
        -1,
        SplitMode::Layer,
        vec![3.0, 1.0],
        "cuda:0:8GiB,cuda:1:8GiB,cpu",
    );
    for (l, d) in p.layer_devices().iter().enumerate() {
        assert_eq!(d, if l <= 23 { "cuda:0" } else { "cuda:1" }, "layer {l}");
    }
    assert_eq!(p.device_of("output.weight").as_deref(), Some("cuda:1"));
    // Default split follows free memory: 6 GiB and 2 GiB behave like [3, 1].
    let q = layers_plan(-1, SplitMode::Layer, vec![], "cuda:0:6GiB,cuda:1:2GiB,cpu");
    assert_eq!(p.layer_devices(), q.layer_devices());
    // split_mode none: everything offloaded on main_gpu.
    let n = layers_plan(
        -1,
        SplitMode::None,
        vec![3.0, 1.0],
        "cuda:0:8GiB,cuda:1:8GiB,cpu",
    );
    assert!(n.layer_devices().iter().all(|d| d == "cuda:0"));
    assert_eq!(n.devices()[1].weights, 0);
}

#[test]
fn llama_cpp_row_split_records_row_ranges() {
    let p = layers_plan(
        -1,
        SplitMode::Row,
        vec![1.0, 1.0],
        "cuda:0:8GiB,cuda:1:8GiB,cpu",
    );
    assert!(p.layer_devices().iter().all(|d| d == "cuda:0"));
    let t = p
        .tensors()
        .iter()
        .find(|t| t.name == "blk.3.ffn_up.weight")
        .unwrap();
    let s = t.split.as_ref().unwrap();
    // 1024 rows split at 512 (a multiple of the 64-row rounding).
    assert_eq!(
        s.shards
            .iter()
            .map(|x| (x.device.as_str(), x.start, x.end))
            .collect::<Vec<_>>(),
        [("cuda:0", 0, 512), ("cuda:1", 512, 1024)]
    );
    assert_eq!(s.shards.iter().map(|x| x.bytes).sum::<u64>(), t.bytes);
    // Norms are not split and stay on main_gpu.
    let n = p
        .tensors()
        .iter()
        .find(|t| t.name == "blk.3.attn_norm.weight")
        .unwrap();
    assert!(n.split.is_none() && n.device == "cuda:0");
    // Every byte is accounted once.
    let total: u64 = p.tensors().iter().map(|t| t.bytes).sum();
    assert_eq!(p.devices().iter().map(|d| d.weights).sum::<u64>(), total);
}

#[test]
fn llama_cpp_row_split_names_every_slice() {
    let p = layers_plan(
        -1,
        SplitMode::Row,
        vec![1.0, 1.0],
        "cuda:0:8GiB,cuda:1:8GiB,cpu",
    );
    // A split tensor lives on every device that holds a slice, as the loaded model says.
    assert_eq!(
        p.device_of("blk.3.ffn_up.weight").as_deref(),
        Some("cuda:0,cuda:1")
    );
    assert_eq!(
        p.device_of("output.weight").as_deref(),
        Some("cuda:0,cuda:1")
    );
    assert_eq!(
        p.device_of("blk.3.attn_norm.weight").as_deref(),
        Some("cuda:0")
    );
    // 1000 vocabulary rows split at 500, rounded down to 448 (a multiple of 64).
    let holds = |d: usize| p.devices()[d].holds.clone();
    assert_eq!(holds(0), ["output_norm", "rows 0..448 of output"]);
    assert_eq!(
        holds(1),
        ["rows 448..1000 of output", "row slices of layers 0-29"]
    );
    let table = p.explain();
    assert!(
        table.contains("layers 0-29 + output_norm + rows 0..448 of output"),
        "{table}"
    );
    assert!(
        table.contains("rows 448..1000 of output + row slices of layers 0-29"),
        "{table}"
    );
}

// ---------------------------------------------------------------------------------------------
// llama.cpp's quantiser mix, checked against GGUFs that llama.cpp wrote
// (the reference pack's tiny-llama GGUFs, tensor types and byte sizes read with gguf-py 0.19.0).

fn synth_bytes(spec: &weightlift_format::ModelSpec, w: &str) -> Vec<(String, DType, u64)> {
    synthesize_tensors(spec, WeightType::parse(w).unwrap(), None)
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.dtype, t.nbytes))
        .collect()
}

#[test]
fn tiny_llama_q4_k_m_mix_matches_llama_quantize() {
    let t = synth_bytes(&tiny_llama(), "q4_k_m");
    let get = |n: &str| t.iter().find(|x| x.0 == n).map(|x| (x.1, x.2)).unwrap();
    // gguf-py on tiny-llama-Q4_K_M.gguf:
    assert_eq!(get("token_embd.weight"), (DType::Q6_K, 6_720_000));
    assert_eq!(get("blk.0.attn_v.weight"), (DType::Q4_K, 18_432));
    assert_eq!(get("blk.1.attn_v.weight"), (DType::Q6_K, 26_880));
    assert_eq!(get("blk.0.ffn_down.weight"), (DType::Q4_K, 110_592));
    assert_eq!(get("blk.1.ffn_down.weight"), (DType::Q6_K, 161_280));
    assert_eq!(get("blk.1.attn_q.weight"), (DType::Q4_K, 36_864));
    assert_eq!(get("output_norm.weight"), (DType::F32, 1_024));
    assert_eq!(t.iter().map(|x| x.2).sum::<u64>(), 7_668_992);
    assert_eq!(
        synth_bytes(&tiny_llama(), "q6_k")
            .iter()
            .map(|x| x.2)
            .sum::<u64>(),
        8_015_360
    );
    assert_eq!(
        synth_bytes(&tiny_llama(), "q8_0")
            .iter()
            .map(|x| x.2)
            .sum::<u64>(),
        10_380_288
    );
    // model.json: 9,766,144 parameters saved as bfloat16.
    assert_eq!(
        synth_bytes(&tiny_llama(), "bfloat16")
            .iter()
            .map(|x| x.2)
            .sum::<u64>(),
        2 * 9_766_144
    );
}

#[test]
fn smollm2_q4_1_matches_the_real_file() {
    // gguf-py on SmolLM2-135M-Instruct.Q4_1.gguf: 272 tensors, 96,576,768 bytes of data;
    // blk matrices Q4_1, norms F32, tied token_embd Q8_0 (Q6_K falls back: 576 % 256 != 0).
    let t = synth_bytes(&smollm2(), "q4_1");
    assert_eq!(t.len(), 272);
    assert_eq!(t.iter().map(|x| x.2).sum::<u64>(), 96_576_768);
    assert_eq!(t[0].1, DType::Q8_0);
}

// ---------------------------------------------------------------------------------------------
// exllamav2 autosplit behaviour.

#[test]
fn autosplit_fills_in_order_with_kv_beside_each_layer() {
    let mut req = request(smollm2(), "q4_1", "virtual:2x72MiB,cpu:1GiB");
    req.cache = Some(CacheSpec::new(1024, 1, CacheDType::Fp16));
    req.runtime = RuntimeSpec {
        max_input_len: 64,
        max_attention_size: 64 * 64,
        max_dq_size: 1 << 20,
        low_mem: false,
    };
    let p = plan(&req).unwrap();
    // exllamav2 keeps the embedding on the CPU and loads the tied head as its own copy.
    assert_eq!(p.embed_device(), "cpu");
    eprintln!("{}", p.explain());
    assert_eq!(p.tied_output_copy(), Some("virtual:1"));
    // Layers fill virtual:0 first, contiguously, then virtual:1.
    let ld = p.layer_devices();
    let first1 = ld.iter().position(|d| d == "virtual:1").unwrap();
    assert!(
        first1 > 10
            && ld[..first1].iter().all(|d| d == "virtual:0")
            && ld[first1..].iter().all(|d| d == "virtual:1")
    );
    // KV beside each layer: 2 × 3 × 64 × 1024 × 2 B = 768 KiB per layer.
    assert_eq!(p.devices()[0].kv, first1 as u64 * 786_432);
    assert_eq!(p.devices()[1].kv, (30 - first1) as u64 * 786_432);
}

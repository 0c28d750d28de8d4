//! The forward pass of the mixture-of-experts families, mixtral and qwen3moe (a router scoring
//! 4 experts per token, each token's 2 best run and summed by their softmax weights renormalised
//! to 1, the prompt's tokens grouped by expert, GGUF's experts read as row blocks of one 3-D
//! tensor per projection, quantised ones included), against logits and greedy ids that
//! transformers computed for tiny random models as f16 safetensors and as GGUF files written by
//! llama.cpp's converter (`tests/data/tiny-qwen3moe` and `tiny-mixtral`, made by
//! `tests/gen_qwen3moe.py` and `gen_mixtral.py`, and `tiny-qwen3moe-narrow`, whose experts are
//! narrower than its hidden size, by `gen_qwen3moe.py --narrow`; their READMEs give the recipe
//! and the measurements). The checks of `common/family.rs` that do not go through the backend op
//! sequence apply as they are; the others are restated here for the host path. Through the
//! backend op sequence (the path cuda devices take, run here on the CPU backend) a MoE layer's
//! attention and router run on the device and its experts on the host (from host RAM) or on
//! the device (where it holds them): held to the host path's bits, and refusing by name a
//! layer whose experts are split between the two.

use crate::common;

use common::family::Family;
use common::{
    forward_all, greedy, json_ids, load_on, max_abs_diff, open, prompt_and_decode, split_load,
};
use weightlift_engine::CacheDType;
use weightlift_engine::forward::{Compute, Logits};
use weightlift_format::{Checkpoint, Format, MoeSpec, OpenOptions, Role};

const QWEN3MOE: Family = Family("qwen3moe");
const MIXTRAL: Family = Family("mixtral");
/// Experts 32 wide under a hidden size of 64, as every released Qwen3-MoE has them narrower
/// than its hidden size, and a dense width of 32 (`tests/data/tiny-qwen3moe-narrow`, F16 only):
/// a hidden-wide row put in a region sized by the MLP's width would overrun it.
const NARROW: Family = Family("qwen3moe-narrow");
/// The fixtures with a Q8_0 file.
const BOTH: [Family; 2] = [QWEN3MOE, MIXTRAL];
const ALL: [Family; 3] = [QWEN3MOE, MIXTRAL, NARROW];

/// Each checkpoint's routing and expert tensors, from GGUF metadata and from config.json: 4
/// experts, 2 used, renormalised; qwen3moe's experts 32 wide (`moe_intermediate_size`,
/// `expert_feed_forward_length`), mixtral's 16 (`intermediate_size`, `feed_forward_length`).
#[test]
fn tiny_moe_specs_and_expert_tensors() {
    for (f, ffn, arch_gguf, arch_hf) in [
        (QWEN3MOE, 32, "qwen3moe", "qwen3_moe"),
        (MIXTRAL, 16, "llama", "mixtral"),
        (NARROW, 32, "qwen3moe", "qwen3_moe"),
    ] {
        for path in f.checkpoints() {
            let file = path.display();
            let ck = Checkpoint::open(&path, OpenOptions::default()).unwrap();
            let gguf = ck.format() == Format::Gguf;
            let moe = if gguf {
                MoeSpec::from_gguf(ck.metadata())
            } else {
                MoeSpec::from_hf_config(ck.config().unwrap())
            }
            .unwrap();
            let want = MoeSpec {
                n_experts: 4,
                n_used: 2,
                expert_ffn: ffn,
                norm_topk_prob: true,
                dense_layers: Vec::new(),
            };
            assert_eq!(moe, Some(want), "{file}");
            let spec = ck.spec().unwrap();
            let arch = if gguf { arch_gguf } else { arch_hf };
            assert_eq!(spec.architecture, arch, "{file}");
            let count = |role: Role| ck.tensors().iter().filter(|t| t.role == Some(role)).count();
            assert_eq!(count(Role::FfnGateInp), 2, "{file}: a router per layer");
            for role in [Role::FfnGateExps, Role::FfnUpExps, Role::FfnDownExps] {
                // GGUF stacks a layer's experts in one 3-D tensor; transformers keeps one each
                let (n, shape) = if gguf { (2, 3) } else { (8, 2) };
                assert_eq!(count(role), n, "{file} {role:?}");
                for t in ck.tensors().iter().filter(|t| t.role == Some(role)) {
                    assert_eq!(t.shape.len(), shape, "{}", t.name);
                    assert!(t.layer.is_some(), "{}", t.name);
                    let e = weightlift_format::expert_of(&t.name);
                    assert_eq!(e.is_some(), !gguf, "{}", t.name);
                }
            }
            assert!(ck.tensors().iter().all(|t| t.role.is_some()), "{file}");
        }
    }
}

#[test]
fn tiny_moe_safetensors_exact_matches_transformers() {
    ALL.into_iter()
        .for_each(Family::safetensors_exact_matches_transformers);
}

#[test]
fn tiny_moe_f16_gguf_exact_matches_transformers() {
    ALL.into_iter()
        .for_each(Family::f16_gguf_exact_matches_transformers);
}

#[test]
fn tiny_moe_q8_0_gguf_exact_matches_transformers_on_dequantised_weights() {
    BOTH.into_iter()
        .for_each(Family::q8_0_gguf_exact_matches_transformers_on_dequantised_weights);
}

#[test]
fn tiny_moe_gguf_within_llamacpps_distance_to_transformers() {
    ALL.into_iter()
        .for_each(Family::gguf_within_llamacpps_distance_to_transformers);
}

/// Placement never changes the bits: whole on cpu, layers over 2 and 3 virtual devices (the
/// hidden state crossing device boundaries between expert layers), a layer on disk, and the
/// backend op sequence with the experts on the device computing their layer: the checks every
/// family is held to.
#[test]
fn tiny_moe_same_bits_on_cpu_and_virtual_devices() {
    for f in ALL {
        f.same_bits_on_cpu_virtual_devices_and_the_backend();
    }
}

/// Greedy decoding, one token per forward call from the cache (one token routed at a time),
/// from the safetensors folder and the F16 GGUF, on the host path and through the backend, is
/// transformers' greedy continuation.
#[test]
fn tiny_moe_greedy_ids_are_transformers() {
    ALL.into_iter()
        .for_each(Family::greedy_ids_are_transformers);
}

/// The plan sizes and places the router and every expert with its layer: what each device
/// holds is what the plan says, and the planned model is transformers' within 1e-3.
#[test]
fn tiny_moe_plan_is_what_the_load_holds() {
    ALL.into_iter()
        .for_each(Family::plan_is_what_the_load_holds);
}

/// A model whose every layer routes runs no dense MLP, so its workspace's MLP regions are
/// sized by the experts (and the router's scores) alone: tiny-qwen3moe's dense width 64
/// (`intermediate_size`, `feed_forward_length`) does not count beside its experts' 32, and
/// the narrow fixture's are 32 wide under its hidden size 64 (its query and attention output
/// regions, 4 heads of 8, widen to the hidden size: the experts' rows pass through them).
/// Planned whole on one virtual device, for each checkpoint, the device's scratch is that
/// workspace, the load holds what the plan says, and the logits are transformers'.
#[test]
fn tiny_moe_workspace_is_sized_by_the_experts() {
    for (f, dense, hidden) in [(QWEN3MOE, 64, 32), (NARROW, 32, 64)] {
        for path in f.checkpoints() {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let src = open(&path);
            let spec = src.spec().unwrap();
            assert_eq!(
                (spec.intermediate_size, spec.hidden_size),
                (dense, hidden),
                "{file}"
            );
            let whole = WholeOnOneDevice::plan(f, &src);
            assert!(
                !weightlift_plan::has_dense_layers(spec.n_layers, &whole.tensors),
                "{file}"
            );
            let plan = whole.plan.clone();
            let device = &plan.devices()[0];
            let experts = whole.workspace(32);
            assert_eq!(device.scratch, experts, "{file}: {}", device.name);
            if dense > 32 {
                assert!(experts < whole.workspace(dense), "{file}");
            }
            let (mut m, cache) = whole.load();
            let got = m
                .memory()
                .iter()
                .find(|(n, _)| *n == device.name)
                .map_or(0, |(_, b)| *b);
            assert_eq!(got, device.weights + device.kv + device.scratch, "{file}");
            m.set_compute(Compute::Exact);
            let out = forward_all(&mut m, &cache, &f.ids());
            f.assert_matches(&file, &out, Family::reference_of(&path));
        }
    }
}

/// A checkpoint of `f` planned whole on one virtual device, with a cache of 64 f32 positions
/// and a runtime of `f`'s prompt, before it is loaded.
struct WholeOnOneDevice {
    model: weightlift_engine::Model,
    plan: weightlift_plan::Plan,
    tensors: Vec<weightlift_format::TensorInfo>,
    /// The dims the planner sizes the device's workspace from, the query regions at least
    /// hidden-wide (the experts' rows pass through them).
    dims: weightlift_plan::Dims,
}

impl WholeOnOneDevice {
    fn plan(f: Family, src: &std::sync::Arc<dyn weightlift_engine::Source>) -> Self {
        use weightlift_plan as wp;
        let n = f.ids().len() as u64;
        let runtime = wp::RuntimeSpec {
            max_input_len: n,
            max_attention_size: n * 64,
            max_dq_size: 1 << 16,
            low_mem: false,
        };
        let model = weightlift_engine::Model::new(
            std::sync::Arc::clone(src),
            weightlift_engine::Inventory::parse("virtual:1x64MiB").unwrap(),
        );
        let mut req = model.plan_request().unwrap();
        req.cache = Some(wp::CacheSpec::new(64, 1, CacheDType::F32));
        req.runtime = runtime;
        let plan = wp::plan(&req).unwrap();
        let spec = src.spec().unwrap();
        let dims = wp::Dims::new(spec, &runtime, 64, 1);
        let dims = wp::Dims {
            q_dim: dims.q_dim.max(spec.hidden_size),
            ..dims
        };
        WholeOnOneDevice {
            model,
            plan,
            tensors: req.tensors,
            dims,
        }
    }

    /// The bytes of a device workspace holding everything for MLPs `inter` wide.
    fn workspace(&self, inter: u64) -> u64 {
        let everything = weightlift_plan::Hosts {
            layers: true,
            head: true,
            embed: true,
        };
        weightlift_plan::Workspace::new(&weightlift_plan::Dims { inter, ..self.dims }, everything)
            .bytes
    }

    /// The model loaded as planned, and its cache.
    fn load(
        mut self,
    ) -> (
        weightlift_engine::Model,
        std::sync::Arc<weightlift_engine::Cache>,
    ) {
        let cache = common::load_planned(&mut self.model, &self.plan).unwrap();
        (self.model, cache)
    }
}

/// `src` planned with llama.cpp's `--n-cpu-moe n` over two virtual devices standing for GPUs
/// (the layers split evenly, as `tensor_split` 1,1) and the cpu, with a cache of 64 f32
/// positions, and loaded as planned: the model, its cache and the plan.
fn n_cpu_moe_model(
    src: &std::sync::Arc<dyn weightlift_engine::Source>,
    n: u32,
) -> (
    weightlift_engine::Model,
    std::sync::Arc<weightlift_engine::Cache>,
    weightlift_plan::Plan,
) {
    use weightlift_engine::{Inventory, Model};
    use weightlift_plan as wp;
    let mut m = Model::new(
        std::sync::Arc::clone(src),
        Inventory::parse("virtual:2x64MiB,cpu").unwrap(),
    );
    let mut req = m.plan_request().unwrap();
    wp::PlanOptions {
        n_cpu_moe: Some(n),
        tensor_split: Some(vec![1.0, 1.0]),
        cache: Some(wp::CacheSpec::new(64, 1, CacheDType::F32)),
        ..wp::PlanOptions::default()
    }
    .apply(&mut req)
    .unwrap();
    let plan = wp::plan(&req).unwrap();
    let cache = common::load_planned(&mut m, &plan).unwrap();
    (m, cache, plan)
}

/// The backend op sequence (the path `cuda:N` takes, here on the CPU backend) runs a MoE
/// layer's attention, norms and router on the device and its routed experts on the host, from
/// host RAM: whole on cpu through the backend, and with `n_cpu_moe` covering both layers
/// (attention and router on two virtual devices standing for GPUs, every expert in host RAM),
/// the prompt's logits at every position and three decode steps' are the bits of the host path
/// with the model whole on cpu, in exact and in fast mode, for each checkpoint; greedy decoding
/// through the backend is transformers' greedy continuation.
#[test]
fn tiny_moe_backend_with_experts_on_the_host_gives_the_host_path_bits() {
    for f in ALL {
        let ids = f.ids();
        let greedy_want = json_ids(&f.data().join("stats.json"), "greedy_ids");
        for path in f.checkpoints() {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let src = open(&path);
            let (mut whole, cache) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
            let (mut split, split_cache, _) = n_cpu_moe_model(&src, 2);
            for compute in [Compute::Exact, Compute::Fast] {
                whole.set_compute(compute);
                whole.set_host_backend(false);
                let want = prompt_and_decode(&mut whole, &cache, &ids);
                whole.set_host_backend(true);
                let got = prompt_and_decode(&mut whole, &cache, &ids);
                let d = max_abs_diff(&floats(&got), &floats(&want));
                eprintln!("{file} {compute:?} whole on cpu through the backend: max|Δ| {d:e}");
                assert!(got == want, "{file} {compute:?} cpu backend: max|Δ| {d}");
                split.set_compute(compute);
                split.set_host_backend(true);
                let got = prompt_and_decode(&mut split, &split_cache, &ids);
                let d = max_abs_diff(&floats(&got), &floats(&want));
                eprintln!("{file} {compute:?} n_cpu_moe=2 through the backend: max|Δ| {d:e}");
                assert!(got == want, "{file} {compute:?} n_cpu_moe=2: max|Δ| {d}");
            }
            if !file.contains("Q8_0") {
                split.set_compute(Compute::Exact);
                let got = greedy(&mut split, &split_cache, &ids, greedy_want.len());
                assert_eq!(got, greedy_want, "{file} greedy through the backend");
            }
        }
    }
}

fn floats(bits: &[u32]) -> Vec<f32> {
    bits.iter().map(|b| f32::from_bits(*b)).collect()
}

/// With its experts on the host, a layer through the backend copies only rows across: each
/// MoE layer of a decode step sends the token's normed row and its router scores to the host
/// and takes one row back (3 copies of `2·hidden + n_experts` floats in all), beyond the
/// hidden state's moves between devices that the host path makes too. No expert byte moves,
/// every expert tensor is held on the cpu, and each device holds what the plan says before and
/// after the forward calls.
#[test]
fn tiny_moe_backend_copies_rows_not_experts() {
    use weightlift_engine::Held;
    for f in ALL {
        let ids = f.ids();
        for path in f.checkpoints() {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let src = open(&path);
            let (mut m, cache, plan) = n_cpu_moe_model(&src, 2);
            let expert_bytes: u64 = src
                .tensors()
                .iter()
                .enumerate()
                .filter(|(_, t)| t.role.is_some_and(Role::is_expert))
                .map(|(i, t)| {
                    match m.held(&t.name).unwrap() {
                        Held::Whole { device, .. } => assert_eq!(device, "cpu", "{}", t.name),
                        Held::Split { .. } => panic!("{}: split", t.name),
                    }
                    src.bytes(i).len() as u64
                })
                .sum();
            let held_as_planned = |m: &weightlift_engine::Model, when: &str| {
                common::assert_holds_the_plan_exactly(m, &plan, &format!("{file} {when}"));
            };
            held_as_planned(&m, "after the load");
            m.set_compute(Compute::Exact);
            let step = |m: &mut weightlift_engine::Model, backend: bool| {
                m.set_host_backend(backend);
                cache.reset();
                let mut out = Vec::new();
                m.forward(&ids, Some(&cache), Logits::Last, &mut out)
                    .unwrap();
                let next = common::argmax(&out) as u32;
                m.forward(&[next], Some(&cache), Logits::Last, &mut out)
                    .unwrap()
            };
            let host = step(&mut m, false);
            let backend = step(&mut m, true);
            held_as_planned(&m, "after the forward calls");
            let spec = src.spec().unwrap();
            let (h, layers) = (spec.hidden_size, u64::from(spec.n_layers));
            let experts = 4;
            assert_eq!(backend.count - host.count, 3 * layers, "{file}");
            assert_eq!(
                backend.bytes - host.bytes,
                layers * (2 * h + experts) * 4,
                "{file}: {} bytes copied through the backend, {} on the host path, the \
                 experts hold {expert_bytes}",
                backend.bytes,
                host.bytes
            );
            assert!(backend.bytes < expert_bytes / 10, "{file}");
        }
    }
}

/// Experts the plan leaves on the device that computes their layer (a virtual device standing
/// for a GPU) run there through the backend op sequence (the rows routed to an expert
/// gathered, its gated product as a dense MLP's, its output rows added into their tokens' sums
/// by weight); only the router's scores go to the host, to be routed, and the routing comes
/// back. Every expert on the two virtual devices, and layer 0's on the host with layer 1's on
/// its device (`n_cpu_moe=1`), give the host path's bits with the model whole on cpu: the
/// prompt at every position and three decode steps, in exact and fast mode, for each
/// checkpoint.
#[test]
fn tiny_moe_backend_with_experts_on_the_device_gives_the_host_path_bits() {
    for f in ALL {
        let ids = f.ids();
        for path in f.checkpoints() {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let src = open(&path);
            let (mut whole, cache) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
            let (mut all, all_cache) = split_load(
                &src,
                "virtual:2x64MiB,cpu",
                &["virtual:0", "virtual:1"],
                CacheDType::F32,
                0,
                false,
            );
            let (mut mixed, mixed_cache, plan) = n_cpu_moe_model(&src, 1);
            assert!(plan.layer_devices()[1].starts_with("virtual:"), "{file}");
            for compute in [Compute::Exact, Compute::Fast] {
                whole.set_compute(compute);
                let want = prompt_and_decode(&mut whole, &cache, &ids);
                for (what, m, c) in [
                    ("every expert on its device", &mut all, &all_cache),
                    ("n_cpu_moe=1", &mut mixed, &mixed_cache),
                ] {
                    m.set_compute(compute);
                    m.set_host_backend(true);
                    let got = prompt_and_decode(m, c, &ids);
                    let d = max_abs_diff(&floats(&got), &floats(&want));
                    eprintln!("{file} {compute:?} {what} through the backend: max|Δ| {d:e}");
                    assert!(got == want, "{file} {compute:?} {what}: max|Δ| {d}");
                }
            }
        }
    }
}

/// A layer whose experts are split between the host and its device (an override moving only
/// layer 0's up projections to the cpu) is refused through the backend op sequence, naming the
/// expert, where it is held, where the layer computes and how to keep the experts together.
/// The host path still runs the placement.
#[test]
fn tiny_moe_backend_refuses_experts_split_between_host_and_device_by_name() {
    use weightlift_engine::{Inventory, Model};
    use weightlift_plan as wp;
    for f in BOTH {
        let src = open(f.gguf("F16"));
        let mut m = Model::new(
            std::sync::Arc::clone(&src),
            Inventory::parse("virtual:1x64MiB,cpu").unwrap(),
        );
        let mut req = m.plan_request().unwrap();
        req.strategy = wp::Strategy::Layers(wp::LayerOptions {
            n_gpu_layers: -1,
            overrides: vec![(r"^blk\.0\.ffn_up_exps\.".into(), "cpu".into())],
            ..wp::LayerOptions::default()
        });
        req.cache = Some(wp::CacheSpec::new(64, 1, CacheDType::F32));
        let plan = wp::plan(&req).unwrap();
        let cache = common::load_planned(&mut m, &plan).unwrap();
        m.set_host_backend(true);
        let mut out = Vec::new();
        let e = m
            .forward(&f.ids(), Some(&cache), Logits::All, &mut out)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "expert 'blk.0.ffn_up_exps.weight expert 0' of layer 0 held on cpu while the \
                 layer computes on virtual:0 through the backend op sequence"
            ),
            "{e}"
        );
        assert!(e.contains("n_cpu_moe") && e.contains("exps"), "{e}");
        m.set_host_backend(false);
        m.set_compute(Compute::Exact);
        let out = forward_all(&mut m, &cache, &f.ids());
        f.assert_matches("host path", &out, "hf_logits.npy");
    }
}

/// The routing matters in these fixtures: sending every token to experts 0 and 1 moves
/// transformers' logits by more than 1 (the generator's measurement), so an engine that routed
/// wrongly could not pass the checks above.
#[test]
fn tiny_moe_routing_moves_the_logits() {
    for f in ALL {
        let s = f.stats();
        let moved = s["sensitivity"]["every_token_to_experts_0_1"]["max_abs"]
            .as_f64()
            .unwrap();
        assert!(moved > 1.0, "{}: {moved}", f.0);
        for layer in s["routing"]["experts"].as_array().unwrap() {
            let mut used = [false; 4];
            for pair in layer.as_array().unwrap() {
                for e in pair.as_array().unwrap() {
                    used[e.as_u64().unwrap() as usize] = true;
                }
            }
            assert!(used.iter().filter(|u| **u).count() >= 3, "{}", f.0);
        }
    }
    // qwen3moe's norm_topk_prob (true, as the model ships) matters as much
    let s = QWEN3MOE.stats();
    let unnormed = s["sensitivity"]["norm_topk_prob_false"]["max_abs"]
        .as_f64()
        .unwrap();
    assert!(unnormed > 1.0, "{unnormed}");
}

/// llama.cpp's `--n-cpu-moe 1` through the planner's options: layer 0's experts stay in host
/// RAM (`cpu`) while its attention, norms and router go where the layers strategy puts them (a
/// virtual device, standing for a GPU), layer 1 whole on its device. The plan says so tensor by
/// tensor, the load holds what the plan says on each device, and the experts are computed from
/// where they are held, not copied in: the logits are transformers' and the bits those of the
/// model loaded whole on cpu.
#[test]
fn tiny_moe_n_cpu_moe_keeps_the_first_layers_experts_on_the_host() {
    use std::sync::Arc;
    use weightlift_engine::{Inventory, Model};
    use weightlift_plan as wp;
    for f in ALL {
        let ids = f.ids();
        for path in f.checkpoints() {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let src = open(&path);
            let (mut whole, cache) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
            whole.set_compute(Compute::Exact);
            let cpu = forward_all(&mut whole, &cache, &ids);

            let inv = Inventory::parse("virtual:2x64MiB,cpu").unwrap();
            let mut m = Model::new(Arc::clone(&src), inv.clone());
            let mut req = m.plan_request().unwrap();
            wp::PlanOptions {
                n_cpu_moe: Some(1),
                tensor_split: Some(vec![1.0, 1.0]),
                cache: Some(wp::CacheSpec::new(64, 1, CacheDType::F32)),
                ..wp::PlanOptions::default()
            }
            .apply(&mut req)
            .unwrap();
            assert_eq!(
                req.strategy.name(),
                "layers",
                "n_cpu_moe implies llama.cpp's layers"
            );
            let plan = wp::plan(&req).unwrap();
            let layers = plan.layer_devices().to_vec();
            assert!(
                layers.iter().all(|d| d.starts_with("virtual:")),
                "{file}: {layers:?}"
            );
            let mut on_cpu = 0;
            for (t, info) in plan.tensors().iter().zip(src.tensors()) {
                let expert = info.role.is_some_and(Role::is_expert);
                match info.layer {
                    Some(0) if expert => {
                        assert_eq!(t.device, "cpu", "{file}: {}", t.name);
                        on_cpu += t.bytes;
                    }
                    Some(l) => assert_eq!(t.device, layers[l as usize], "{}", t.name),
                    None => {}
                }
            }
            let cpu_plan = plan.devices().iter().find(|d| d.name == "cpu").unwrap();
            assert!(cpu_plan.weights >= on_cpu && on_cpu > 0, "{file}");
            assert!(
                cpu_plan.holds.iter().any(|h| h == "experts of layers 0"),
                "{file}: {:?}",
                cpu_plan.holds
            );
            let cache = common::load_planned(&mut m, &plan).unwrap();
            common::assert_holds_the_plan_exactly(&m, &plan, &file);
            m.set_compute(Compute::Exact);
            let out = forward_all(&mut m, &cache, &ids);
            f.assert_matches(
                &format!("{file} n_cpu_moe=1"),
                &out,
                Family::reference_of(&path),
            );
            assert!(
                out == cpu,
                "{file}: max|Δ| {} from cpu",
                max_abs_diff(&out, &cpu)
            );
        }
    }
}

/// `weightlift plan --n-cpu-moe N` for a GPU (a what-if `cuda:0` of 8 GiB, no GPU needed):
/// every layer's attention, norms and router on `cuda:0`, the first N layers' experts on the
/// cpu, and the plan's text says so on each device's line.
#[test]
fn tiny_moe_plan_for_a_gpu_shows_the_experts_on_the_host() {
    use weightlift_engine::{Inventory, Model};
    use weightlift_plan as wp;
    for f in BOTH {
        let src = open(f.gguf("Q8_0"));
        let m = Model::new(
            std::sync::Arc::clone(&src),
            Inventory::parse("cpu").unwrap(),
        );
        for (n, named) in [(1, "experts of layers 0"), (2, "experts of layers 0-1")] {
            let mut req = m.plan_request().unwrap();
            req.devices = wp::parse_devices("cuda:0:8GiB:sm_90,cpu:16GiB").unwrap();
            wp::PlanOptions {
                n_cpu_moe: Some(n),
                cache: Some(wp::CacheSpec::new(64, 1, CacheDType::F32)),
                ..wp::PlanOptions::default()
            }
            .apply(&mut req)
            .unwrap();
            let plan = wp::plan(&req).unwrap();
            assert!(plan.layer_devices().iter().all(|d| d == "cuda:0"), "{n}");
            for (t, info) in plan.tensors().iter().zip(src.tensors()) {
                let Some(l) = info.layer else { continue };
                let host = info.role.is_some_and(Role::is_expert) && l < n;
                let want = if host { "cpu" } else { "cuda:0" };
                assert_eq!(t.device, want, "n_cpu_moe={n}: {}", t.name);
            }
            let text = plan.explain();
            let line = |dev: &str| {
                text.lines()
                    .find(|l| l.starts_with(dev))
                    .unwrap_or_else(|| panic!("no {dev} line in\n{text}"))
                    .to_owned()
            };
            assert!(line("cuda:0").contains("layers 0-1"), "{text}");
            assert!(line("cpu").ends_with(named), "{text}");
        }
    }
}

/// The safetensors folder, and the Q8_0 file where the fixture has one (quantised experts).
fn safetensors_and_q8_0(f: Family) -> Vec<std::path::PathBuf> {
    let q8 = f
        .checkpoints()
        .into_iter()
        .filter(|p| p.to_string_lossy().contains("Q8_0"));
    std::iter::once(f.data()).chain(q8).collect()
}

/// Several sequences in one forward call route and group their tokens piece by piece: a
/// sequence's logits in a batch (prompts joining while others decode) are the bits it gets
/// alone, in exact and in fast mode, on the Q8_0 file (quantised experts) and the safetensors,
/// and on the mixed model's dense and routed layers.
#[test]
fn tiny_moe_batched_logits_are_the_bits_of_each_sequence_alone() {
    const STEPS: usize = 4;
    for f in BOTH.into_iter().chain([MIXED]) {
        let ids = f.ids();
        let chat = json_ids(&f.data().join("stats.json"), "chat_prompt_ids");
        // (prompt, the step it joins)
        let reqs: Vec<(Vec<u32>, usize)> = vec![
            (ids.clone(), 0),
            (ids[..3].to_vec(), 0),
            (chat.clone(), 1),
            (ids[4..].to_vec(), 2),
        ];
        for path in safetensors_and_q8_0(f) {
            let (mut m, _) = load_on(&open(&path), "cpu", "cpu", 64, CacheDType::F32);
            for compute in [Compute::Exact, Compute::Fast] {
                m.set_compute(compute);
                let what = format!("{} {compute:?}", path.display());
                let want = common::batch::alone(&mut m, &reqs, STEPS);
                let got = common::batch::batched(&mut m, &reqs, STEPS);
                common::batch::assert_same_bits(&what, &got, &want);
            }
        }
    }
}

/// Through the backend op sequence with every expert on the host (`n_cpu_moe=2`, attention
/// and routers on two virtual devices; on the mixed model layer 1's experts, layer 5's on its
/// device) and with every expert on the device computing its layer, a batch of sequences
/// (prompts joining while others decode) gives each sequence the bits it gets alone on the
/// host path whole on cpu, in exact and in fast mode, on the Q8_0 file (quantised experts) and
/// the safetensors: the router's products and the experts' run piece by piece, as on the host.
#[test]
fn tiny_moe_backend_batches_with_the_bits_of_each_sequence_alone() {
    const STEPS: usize = 4;
    for f in BOTH.into_iter().chain([MIXED]) {
        let ids = f.ids();
        let reqs = common::batch::joining_requests(&ids);
        for path in safetensors_and_q8_0(f) {
            let src = open(&path);
            let (mut whole, _) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
            let (mut host, _, _) = n_cpu_moe_model(&src, 2);
            let (mut device, _) = split_load(
                &src,
                "virtual:2x64MiB,cpu",
                &["virtual:0", "virtual:1"],
                CacheDType::F32,
                0,
                false,
            );
            for compute in [Compute::Exact, Compute::Fast] {
                whole.set_compute(compute);
                let want = common::batch::alone(&mut whole, &reqs, STEPS);
                for (experts, m) in [("host", &mut host), ("device", &mut device)] {
                    m.set_host_backend(true);
                    m.set_compute(compute);
                    let what = format!(
                        "{} {compute:?} through the backend, experts on the {experts}",
                        path.display()
                    );
                    let got = common::batch::batched(m, &reqs, STEPS);
                    common::batch::assert_same_bits(&what, &got, &want);
                }
            }
        }
    }
}

/// `fit` with the `n_cpu_moe` target: the fewest layers whose experts stay in host RAM for the
/// rest to fit on the accelerator. On a virtual device of exactly what the plan with N layers'
/// experts on the host needs there, the answer is N; a dense model is refused by name.
#[test]
fn tiny_moe_fit_finds_the_fewest_layers_with_experts_on_the_host() {
    use std::sync::Arc;
    use weightlift_engine::{Inventory, Model};
    use weightlift_plan as wp;
    let src = open(QWEN3MOE.gguf("F16"));
    let request = |devices: &str, n_cpu_moe: Option<u32>| {
        let m = Model::new(Arc::clone(&src), Inventory::parse(devices).unwrap());
        let mut req = m.plan_request().unwrap();
        wp::PlanOptions {
            n_cpu_moe,
            cache: Some(wp::CacheSpec::new(64, 1, CacheDType::F32)),
            ..wp::PlanOptions::default()
        }
        .for_fit(wp::FitTarget::NCpuMoe, None)
        .unwrap()
        .apply(&mut req)
        .unwrap();
        req
    };
    // what virtual:0 must have with the experts of the first n layers on the host
    let needs: Vec<u64> = (0..=2)
        .map(|n| {
            let req = request("virtual:1x64MiB,cpu", None);
            let mut with = req.clone();
            if let wp::Strategy::Layers(o) = &mut with.strategy {
                o.overrides = wp::PlanOptions::moe_overrides(n);
            }
            let plan = wp::plan(&with).unwrap();
            let d = plan
                .devices()
                .iter()
                .find(|d| d.name == "virtual:0")
                .unwrap();
            d.capacity - d.free
        })
        .collect();
    assert!(needs[0] > needs[1] && needs[1] > needs[2], "{needs:?}");
    for (n, &need) in needs.iter().enumerate() {
        let req = request(&format!("virtual:1x{need}B,cpu"), None);
        assert_eq!(
            wp::fit(&req, wp::FitTarget::NCpuMoe).unwrap(),
            n as u64,
            "{needs:?}"
        );
    }
    let e = wp::PlanOptions {
        n_cpu_moe: Some(1),
        ..wp::PlanOptions::default()
    }
    .for_fit(wp::FitTarget::NCpuMoe, None)
    .unwrap_err()
    .to_string();
    assert!(e.contains("n_cpu_moe"), "{e}");
    let dense = Model::new(
        open(Family("qwen3").gguf("F16")),
        Inventory::parse("virtual:1x64MiB,cpu").unwrap(),
    );
    let mut req = dense.plan_request().unwrap();
    wp::PlanOptions::default()
        .for_fit(wp::FitTarget::NCpuMoe, None)
        .unwrap()
        .apply(&mut req)
        .unwrap();
    let e = wp::fit(&req, wp::FitTarget::NCpuMoe)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a mixture-of-experts model") && e.contains("qwen3"),
        "{e}"
    );
}

/// Offloaded execution (`offload="sequential"` and `"group"`): layer 0 kept on the cpu and run
/// on the virtual device after its router and experts are copied into an onload slot, each
/// expert of a stacked GGUF tensor its own rows. The logits are the all-on-cpu bits, for every
/// checkpoint, on the host path and through the backend op sequence (which computes the
/// offloaded layer's experts from the slot on the device), and with `n_cpu_moe=2` as well
/// through the backend (layer 1's experts in host RAM, computed by the host). The mixed model
/// offloads five layers, dense and routed, around its last on the device.
#[test]
fn tiny_moe_offloaded_layers_give_the_all_on_cpu_bits() {
    use std::sync::Arc;
    use weightlift_engine::{Inventory, Model};
    use weightlift_plan as wp;
    for f in ALL.into_iter().chain([MIXED]) {
        let ids = f.ids();
        for path in f.checkpoints() {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let src = open(&path);
            let (mut whole, cache) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
            whole.set_compute(Compute::Exact);
            let cpu = forward_all(&mut whole, &cache, &ids);
            for (mode, n_cpu_moe, backend) in [
                wp::WeightOffload::Sequential,
                wp::WeightOffload::Group {
                    blocks_per_group: 1,
                    prefetch: true,
                },
            ]
            .into_iter()
            .flat_map(|mode| [(mode, 0, false), (mode, 0, true), (mode, 2, true)])
            {
                let mut m = Model::new(
                    Arc::clone(&src),
                    Inventory::parse("virtual:1x64MiB,cpu").unwrap(),
                );
                let mut req = m.plan_request().unwrap();
                req.strategy = wp::Strategy::Layers(wp::LayerOptions {
                    n_gpu_layers: 1,
                    overrides: wp::PlanOptions::moe_overrides(n_cpu_moe),
                    ..wp::LayerOptions::default()
                });
                req.cache = Some(wp::CacheSpec::new(64, 1, CacheDType::F32));
                req.offload = Some(mode);
                let plan = wp::plan(&req).unwrap();
                assert!(plan.onload().is_some(), "{file} {mode:?}");
                let cache = common::load_planned(&mut m, &plan).unwrap();
                common::assert_holds_the_plan_exactly(&m, &plan, &file);
                m.set_compute(Compute::Exact);
                m.set_host_backend(backend);
                let out = forward_all(&mut m, &cache, &ids);
                assert!(
                    out == cpu,
                    "{file} {mode:?} n_cpu_moe={n_cpu_moe} backend {backend}: max|Δ| {} from cpu",
                    max_abs_diff(&out, &cpu)
                );
            }
        }
    }
}

/// A config that contradicts the tensors is refused with what it expected and what it got:
/// more experts used than there are, and an expert count the router's rows disagree with.
#[test]
fn tiny_moe_bad_routing_config_is_refused_by_name() {
    use std::sync::Arc;
    use weightlift_engine::{Cache, Inventory, LoadOptions, Model, Placement};
    let run = |edit: &dyn Fn(&mut serde_json::Value)| -> String {
        let dir = qwen3moe_edited(edit);
        let src = open(dir.path());
        let mut m = Model::new(Arc::clone(&src), Inventory::parse("cpu").unwrap());
        let config = m.cache_config(64, 1, CacheDType::F32, false).unwrap();
        let cache = Arc::new(Cache::new(config).unwrap());
        let placement = Placement::all_on(src.as_ref(), "cpu", m.n_layers());
        let loaded = m.load(
            &placement,
            &LoadOptions::default(),
            Some(&cache),
            true,
            &mut |_| true,
        );
        let e = match loaded {
            Err(e) => e,
            Ok(()) => {
                let mut out = Vec::new();
                m.forward(&QWEN3MOE.ids(), Some(&cache), Logits::All, &mut out)
                    .unwrap_err()
            }
        };
        e.to_string()
    };
    let e = run(&|c| c["num_experts_per_tok"] = 5.into());
    assert!(
        e.contains("num_experts_per_tok") && e.contains("1..=4"),
        "{e}"
    );
    // transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    let e = run(&|c| c["num_local_experts"] = 3.into());
    assert!(
        e.contains("model.layers.0.mlp.gate.weight") && e.contains("3 × 32"),
        "{e}"
    );
}

const TP_RT: weightlift_plan::RuntimeSpec = weightlift_plan::RuntimeSpec {
    max_input_len: 16,
    max_attention_size: 256,
    max_dq_size: 1 << 16,
    low_mem: false,
};

/// A plan's expert table: `(device, first expert, end)`.
type ExpertTable = Vec<(usize, u64, u64)>;

/// The device of expert `e` in the plan's expert table.
fn device_of_expert(ex: &[(usize, u64, u64)], e: u64) -> usize {
    ex.iter().find(|x| x.1 <= e && e < x.2).unwrap().0
}

/// `src` planned tensor-parallel over `devices` (with `gpu_split` in GB, else their room) and
/// loaded as `load_tp` loads it, with an f32 cache of 64 positions.
fn tp_load(
    src: &std::sync::Arc<dyn weightlift_engine::Source>,
    devices: &str,
    gpu_split: Option<Vec<f64>>,
) -> weightlift_engine::Result<(
    weightlift_engine::Model,
    std::sync::Arc<weightlift_engine::Cache>,
    weightlift_plan::Plan,
)> {
    use weightlift_plan as wp;
    let inventory = weightlift_engine::Inventory::parse(devices).unwrap();
    let mut m = weightlift_engine::Model::new(std::sync::Arc::clone(src), inventory);
    let mut req = m.plan_request().unwrap();
    req.runtime = TP_RT;
    wp::PlanOptions {
        strategy: Some("tensor_parallel".into()),
        gpu_split,
        expect_cache: Some(wp::ExpectCache {
            tokens: 64,
            dtype: CacheDType::F32,
        }),
        ..wp::PlanOptions::default()
    }
    .apply(&mut req)
    .unwrap();
    let plan = wp::plan(&req).unwrap();
    let cache = common::load_planned(&mut m, &plan)?;
    Ok((m, cache, plan))
}

/// The plan's split of every expert tensor is the expert table's: GGUF's stacked tensors cut
/// at its experts, transformers' per-expert tensors whole on their expert's device; and the
/// routing transformers recorded for the prompt (`stats.json`) reaches every device of the
/// table in every layer.
fn check_expert_split(
    f: Family,
    what: &str,
    src: &dyn weightlift_engine::Source,
    plan: &weightlift_plan::Plan,
) {
    let ex = plan.tp_split(weightlift_plan::TpKind::Ex).unwrap().to_vec();
    let exps = [Role::FfnGateExps, Role::FfnUpExps, Role::FfnDownExps];
    let mut seen = 0;
    for (t, info) in plan.tensors().iter().zip(src.tensors()) {
        if !info.role.is_some_and(|r| exps.contains(&r)) {
            continue;
        }
        seen += 1;
        let got: Vec<(String, u64, u64)> = t
            .split
            .as_ref()
            .unwrap()
            .shards
            .iter()
            .map(|s| (s.device.clone(), s.start, s.end))
            .collect();
        let want: Vec<(String, u64, u64)> = match weightlift_format::expert_of(&t.name) {
            Some(e) => {
                let d = device_of_expert(&ex, u64::from(e));
                vec![(format!("virtual:{d}"), 0, info.shape[0])]
            }
            None => ex
                .iter()
                .map(|&(d, a, b)| (format!("virtual:{d}"), a, b))
                .collect(),
        };
        assert_eq!(got, want, "{what}: {}", t.name);
    }
    assert!(seen >= 6, "{what}: {seen} expert tensors");
    let routing = f.stats()["routing"]["experts"].clone();
    for (l, layer) in routing.as_array().unwrap().iter().enumerate() {
        let mut hit = vec![false; ex.len()];
        for pair in layer.as_array().unwrap() {
            for e in pair.as_array().unwrap() {
                let d = device_of_expert(&ex, e.as_u64().unwrap());
                hit[ex.iter().position(|x| x.0 == d).unwrap()] = true;
            }
        }
        assert!(hit.iter().all(|h| *h), "{what}: layer {l} reaches {hit:?}");
    }
}

/// Tensor parallelism splits the experts whole (expert parallelism): over 2 and 3 virtual
/// devices the plan's expert table gives every device a contiguous range of the 4 experts
/// (there is no ID table), its expert tensors split as [`check_expert_split`] says, the
/// routers replicated. In exact mode, on the host path and through the backend op sequence
/// (the CPU backend standing in for a GPU), every position's logits are the layer split's
/// within 1e-5 (the devices' partial sums are added in another order) and transformers' within
/// 1e-3, for every checkpoint.
///
/// The Q8_0 files' attention cannot be split by heads here (two heads of 8 are 16 columns of
/// `attn_output`, inside a 32-value block), which the load refuses by name; budgets that keep
/// both kv heads on the first device (`gpu_split`) still split their experts 3 + 1.
#[test]
fn tiny_moe_tensor_parallel_matches_the_layer_split_and_transformers() {
    for f in ALL {
        let ids = f.ids();
        for path in f.checkpoints() {
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let src = open(&path);
            let split = f.exact_logits(&path, false);
            let mut runs: Vec<(usize, Option<Vec<f64>>, ExpertTable)> = vec![
                (2, None, vec![(0, 0, 2), (1, 2, 4)]),
                (3, None, vec![(0, 0, 2), (1, 2, 3), (2, 3, 4)]),
            ];
            if file.contains("Q8_0") {
                for (n, _, _) in runs.drain(..) {
                    let e = tp_load(&src, &format!("virtual:{n}x64MiB"), None)
                        .err()
                        .unwrap()
                        .to_string();
                    assert!(
                        e.contains("attn_output") && e.contains("32-element block"),
                        "{file} over {n}: {e}"
                    );
                }
                runs.push((2, Some(vec![0.064, 0.016]), vec![(0, 0, 3), (1, 3, 4)]));
            }
            for (n, gpu_split, want) in runs {
                let devices = format!("virtual:{n}x64MiB");
                let (mut m, cache, plan) = tp_load(&src, &devices, gpu_split).unwrap();
                let what = format!("{file} tensor parallel over {n}");
                let tp = plan.tp().unwrap();
                assert!(tp.id.is_empty(), "{what}: an ID table beside the experts");
                assert_eq!(tp.ex, want, "{what}");
                let text = plan.explain();
                let table: Vec<String> = want
                    .iter()
                    .map(|(d, a, b)| format!("{d}:{a}..{b}"))
                    .collect();
                assert!(
                    text.contains(&format!("ex [{}]", table.join(" "))),
                    "{text}"
                );
                check_expert_split(f, &what, src.as_ref(), &plan);
                m.set_compute(Compute::Exact);
                for backend in [false, true] {
                    m.set_host_backend(backend);
                    let got = forward_all(&mut m, &cache, &ids);
                    let d = max_abs_diff(&got, &split);
                    let what = format!("{what}{}", if backend { ", backend" } else { "" });
                    eprintln!("{what}: max|Δ| {d:e} against the layer split");
                    assert!(d <= 1e-5, "{what}: max|Δ| {d} against the layer split");
                    f.assert_matches(&what, &got, Family::reference_of(&path));
                }
            }
        }
    }
}

/// Tensor-parallel batches of sequences (prompts joining while others decode) over 2 and 3
/// virtual devices, on the host path and through the backend op sequence, in exact and in
/// fast mode: each sequence's logits are the bits it gets alone under the same split, the
/// devices' routers and experts taking the sequences' rows piece by piece as a layer split
/// does.
#[test]
fn tiny_moe_tensor_parallel_batches_with_the_bits_of_each_sequence_alone() {
    const STEPS: usize = 4;
    for f in ALL {
        let ids = f.ids();
        let reqs = common::batch::joining_requests(&ids);
        let src = open(f.gguf("F16"));
        for n in [2, 3] {
            let (mut m, _, _) = tp_load(&src, &format!("virtual:{n}x64MiB"), None).unwrap();
            for backend in [false, true] {
                m.set_host_backend(backend);
                for compute in [Compute::Exact, Compute::Fast] {
                    m.set_compute(compute);
                    let want = common::batch::alone(&mut m, &reqs, STEPS);
                    let what = format!("{} over {n}, backend {backend}, {compute:?}", f.0);
                    let got = common::batch::batched(&mut m, &reqs, STEPS);
                    common::batch::assert_same_bits(&what, &got, &want);
                }
            }
        }
    }
}

/// A copy of the tiny qwen3moe safetensors folder (weights and tokenizer) with its config.json
/// changed by `edit`.
fn qwen3moe_edited(edit: &dyn Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(QWEN3MOE.data().join(f), dir.path().join(f)).unwrap();
    }
    let text = std::fs::read_to_string(QWEN3MOE.data().join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// A copy of the tiny qwen3moe F16 GGUF with its dense width (`qwen3moe.feed_forward_length`,
/// a u32) set to `dense`, in the directory `dir`.
fn qwen3moe_gguf_with_dense_width(dir: &std::path::Path, dense: u32) -> std::path::PathBuf {
    let mut bytes = std::fs::read(QWEN3MOE.gguf("F16")).unwrap();
    // the key as GGUF writes it: its u64 length, its bytes, then the value's type (4: u32)
    let key = b"qwen3moe.feed_forward_length";
    let mut pattern = (key.len() as u64).to_le_bytes().to_vec();
    pattern.extend_from_slice(key);
    pattern.extend_from_slice(&4u32.to_le_bytes());
    let at = bytes
        .windows(pattern.len())
        .position(|w| w == pattern.as_slice())
        .expect("the F16 GGUF has a u32 qwen3moe.feed_forward_length")
        + pattern.len();
    bytes[at..at + 4].copy_from_slice(&dense.to_le_bytes());
    let path = dir.join(format!("tiny-qwen3moe-F16-dense{dense}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A model whose every layer is MoE never runs its dense width (`intermediate_size`, GGUF's
/// `feed_forward_length`), and converted files may carry one below the experts' width or 0:
/// the tiny qwen3moe with a dense width of 16 or 0 under its experts' 32 (in config.json and
/// in the F16 GGUF's metadata; it has no dense MLP weights) runs, planned with `n_cpu_moe` 0,
/// 1 and 2 over two virtual devices standing for GPUs, through the backend op sequence
/// (experts on their device, on the host, and both), and on the host path, giving the bits of
/// the unchanged file on cpu; each device holds what the plan says, its workspace sized for
/// the experts and the router's scores.
#[test]
fn tiny_moe_dense_width_below_the_experts_runs_as_planned() {
    let f = QWEN3MOE;
    let ids = f.ids();
    let ggufs = tempfile::tempdir().unwrap();
    for dense in [16u32, 0] {
        let folder = qwen3moe_edited(&|c| c["intermediate_size"] = dense.into());
        for (original, narrowed) in [
            (f.data(), folder.path().to_path_buf()),
            (
                f.gguf("F16"),
                qwen3moe_gguf_with_dense_width(ggufs.path(), dense),
            ),
        ] {
            let file = original.file_name().unwrap().to_string_lossy().into_owned();
            let what = format!("{file} with dense width {dense}");
            let (mut whole, cache) = load_on(&open(&original), "cpu", "cpu", 64, CacheDType::F32);
            whole.set_compute(Compute::Exact);
            let want = prompt_and_decode(&mut whole, &cache, &ids);
            let src = open(&narrowed);
            assert_eq!(src.spec().unwrap().intermediate_size, u64::from(dense));
            let (mut m, c) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
            m.set_compute(Compute::Exact);
            for backend in [false, true] {
                m.set_host_backend(backend);
                let got = prompt_and_decode(&mut m, &c, &ids);
                let d = max_abs_diff(&floats(&got), &floats(&want));
                assert!(got == want, "{what} on cpu, backend {backend}: max|Δ| {d}");
            }
            for n in [0, 1, 2] {
                let (mut m, c, plan) = n_cpu_moe_model(&src, n);
                common::assert_holds_the_plan_exactly(&m, &plan, &format!("{what} n_cpu_moe={n}"));
                m.set_compute(Compute::Exact);
                m.set_host_backend(true);
                let got = prompt_and_decode(&mut m, &c, &ids);
                let d = max_abs_diff(&floats(&got), &floats(&want));
                assert!(got == want, "{what} n_cpu_moe={n}: max|Δ| {d}");
            }
            // tensor-parallel, each device computing whole experts: within the pass's 1e-5
            let (mut m, c, plan) = tp_load(&src, "virtual:2x64MiB", None).unwrap();
            common::assert_holds_the_plan_exactly(&m, &plan, &format!("{what} tp"));
            m.set_compute(Compute::Exact);
            for backend in [false, true] {
                m.set_host_backend(backend);
                let got = prompt_and_decode(&mut m, &c, &ids);
                let d = max_abs_diff(&floats(&got), &floats(&want));
                assert!(d <= 1e-5, "{what} tp, backend {backend}: max|Δ| {d}");
            }
        }
    }
}

// A Qwen3-MoE whose config gives some layers a dense MLP.

/// Six layers, `decoder_sparse_step` 2 and `mlp_only_layers` [3]: by transformers' rule layers
/// 1 and 5 route to the 4 experts (32 wide) and 0, 2, 3 and 4 run a dense MLP of
/// `intermediate_size` 64 (`tests/data/tiny-qwen3moe-mixed`, `gen_qwen3moe.py --mixed`).
/// Safetensors only: llama.cpp's converter refuses the checkpoint (its qwen3moe tensor list has
/// no dense MLP), as its `stats.json` records.
const MIXED: Family = Family("qwen3moe-mixed");
/// The layers of [`MIXED`] with a dense MLP.
const MIXED_DENSE: [u32; 4] = [0, 2, 3, 4];

/// The checkpoint and its config agree with transformers' rule, and a plan made from the
/// config alone (`PlanSource::hf_config`) holds, layer by layer, what the checkpoint holds: a
/// router and experts in layers 1 and 5, a dense MLP of `intermediate_size` elsewhere, each
/// with its shapes, beside every layer's attention and norms.
#[test]
fn mixed_moe_layers_follow_the_config() {
    use std::collections::BTreeSet;
    use weightlift_plan as wp;
    let ck = Checkpoint::open(MIXED.data(), OpenOptions::default()).unwrap();
    assert!(
        MIXED.stats()["gguf_refused"]
            .as_str()
            .unwrap()
            .contains("Can not map tensor")
    );
    let moe = MoeSpec::from_hf_config(ck.config().unwrap())
        .unwrap()
        .unwrap();
    assert_eq!(moe.dense_layers, MIXED_DENSE);
    let spec = ck.spec().unwrap();
    assert_eq!(
        (spec.n_layers, spec.intermediate_size, moe.expert_ffn),
        (6, 64, 32)
    );
    let layers_with = |tensors: &[weightlift_format::TensorInfo], role: Role| -> BTreeSet<u32> {
        tensors
            .iter()
            .filter(|t| t.role == Some(role))
            .filter_map(|t| t.layer)
            .collect()
    };
    let dense: BTreeSet<u32> = MIXED_DENSE.into_iter().collect();
    let routed: BTreeSet<u32> = [1, 5].into_iter().collect();
    for role in [Role::FfnGate, Role::FfnUp, Role::FfnDown] {
        assert_eq!(layers_with(ck.tensors(), role), dense, "{role:?}");
    }
    for role in [Role::FfnGateInp, Role::FfnGateExps, Role::FfnDownExps] {
        assert_eq!(layers_with(ck.tensors(), role), routed, "{role:?}");
    }
    assert!(wp::has_dense_layers(spec.n_layers, ck.tensors()));

    // the config alone: the same (layer, role) pairs, the dense MLP's shapes the file's
    let req = weightlift_engine::planned::PlanSource::hf_config(ck.config().unwrap())
        .unwrap()
        .request(
            wp::PlanOptions::default(),
            wp::parse_devices("cpu").unwrap(),
        )
        .unwrap();
    let roles = |tensors: &[weightlift_format::TensorInfo]| -> BTreeSet<(Option<u32>, Role)> {
        tensors.iter().map(|t| (t.layer, t.role.unwrap())).collect()
    };
    assert_eq!(roles(&req.tensors), roles(ck.tensors()));
    assert_eq!(req.moe.as_ref(), Some(&moe));
    for t in req.tensors.iter().filter(|t| t.layer == Some(2)) {
        let want = match t.role.unwrap() {
            Role::FfnGate | Role::FfnUp => vec![64, 32],
            Role::FfnDown => vec![32, 64],
            _ => continue,
        };
        assert_eq!(t.shape, want, "{}", t.name);
    }
}

/// A config that says of a layer other than its tensors hold (here `mlp_only_layers` emptied,
/// so by `decoder_sparse_step` layer 3 would route, while it holds a dense MLP) is refused
/// before loading, naming the layer, what it holds and what the config makes it; the
/// checkpoint as shipped validates.
#[test]
fn mixed_moe_config_disagreeing_with_the_tensors_is_refused_by_name() {
    use weightlift_engine::validate::validate;
    assert!(validate(open(MIXED.data()).as_ref()).is_ok());
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(MIXED.data().join(f), dir.path().join(f)).unwrap();
    }
    let text = std::fs::read_to_string(MIXED.data().join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg["mlp_only_layers"] = serde_json::json!([]);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let e = validate(open(dir.path()).as_ref()).unwrap_err().to_string();
    assert!(
        e.contains(
            "layers against decoder_sparse_step and mlp_only_layers: layer 3 holds a dense \
             MLP, config.json makes it routed"
        ),
        "{e}"
    );
}

/// Each layer runs its MLP as the checkpoint has it: in exact mode the logits at every
/// position are transformers' within 1e-3 with its argmax (on cpu, over 2 and 3 virtual
/// devices and through the backend op sequence, with the same bits everywhere), greedy decoding
/// is transformers' continuation, and a plan over virtual devices is what the load holds. A
/// layer on disk gives the cpu bits too. Skipping the dense layers' MLP would move the
/// logits by more than 1 (the generator's measurement).
#[test]
fn mixed_moe_runs_each_layers_mlp_as_the_checkpoint_has_it() {
    let s = MIXED.stats();
    let skipped = s["sensitivity"]["dense_mlp_skipped"]["max_abs"]
        .as_f64()
        .unwrap();
    assert!(skipped > 1.0, "{skipped}");
    MIXED.safetensors_exact_matches_transformers();
    MIXED.same_bits_on_cpu_virtual_devices_and_the_backend();
    MIXED.greedy_ids_are_transformers();
    MIXED.plan_is_what_the_load_holds();
    // layers 0 (dense) and 1 (experts) on disk, the rest over two virtual devices
    let path = MIXED.data();
    MIXED.disk_layers_give_these_bits(&path, 2, &MIXED.exact_logits(&path, false));
}

/// The workspace holds the widest MLP the model runs: its dense layers' 64 beside the experts'
/// 32, so a device holding the whole model has the workspace of a 64-wide MLP (the query
/// regions hidden-wide for the experts' rows), the load holds the plan, and the logits are
/// transformers'.
#[test]
fn mixed_moe_workspace_holds_the_dense_mlp() {
    let src = open(MIXED.data());
    let whole = WholeOnOneDevice::plan(MIXED, &src);
    assert!(whole.workspace(32) < whole.workspace(64));
    let plan = whole.plan.clone();
    let device = &plan.devices()[0];
    assert_eq!(device.scratch, whole.workspace(64), "{}", device.name);
    let (mut m, cache) = whole.load();
    common::assert_holds_the_plan_exactly(&m, &plan, "mixed whole on one device");
    m.set_compute(Compute::Exact);
    let out = forward_all(&mut m, &cache, &MIXED.ids());
    MIXED.assert_matches("whole on one device", &out, "hf_logits.npy");
}

/// `n_cpu_moe=N` is llama.cpp's `--n-cpu-moe N`: the expert tensors of layers `0..N` stay in
/// host RAM, and a dense layer among them has none, its MLP going with its layer. So N = 1
/// keeps nothing on the host (layer 0 is dense), N = 2 to 5 layer 1's experts, N = 6 both
/// expert layers'; the plan says so tensor by tensor and in `holds`, the load holds the plan,
/// and on the host path and through the backend op sequence (layer 1's experts on the host,
/// layer 5's on its device for N = 2) the prompt and three decode steps are the bits of the
/// model whole on cpu.
#[test]
fn mixed_moe_n_cpu_moe_counts_layers_as_llama_cpp() {
    let ids = MIXED.ids();
    let src = open(MIXED.data());
    let (mut whole, cache) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
    whole.set_compute(Compute::Exact);
    let want = prompt_and_decode(&mut whole, &cache, &ids);
    for (n, held) in [
        (1, None),
        (2, Some("experts of layers 1")),
        (6, Some("experts of layers 1, 5")),
    ] {
        let (mut m, c, plan) = n_cpu_moe_model(&src, n);
        let what = format!("n_cpu_moe={n}");
        let layers = plan.layer_devices().to_vec();
        assert!(
            layers.iter().all(|d| d.starts_with("virtual:")),
            "{what}: {layers:?}"
        );
        for (t, info) in plan.tensors().iter().zip(src.tensors()) {
            let Some(l) = info.layer else { continue };
            let host = info.role.is_some_and(Role::is_expert) && l < n;
            let want = if host {
                "cpu"
            } else {
                layers[l as usize].as_str()
            };
            assert_eq!(t.device, want, "{what}: {}", t.name);
        }
        let cpu = plan.devices().iter().find(|d| d.name == "cpu").unwrap();
        let holds: Vec<&String> = cpu
            .holds
            .iter()
            .filter(|h| h.starts_with("experts"))
            .collect();
        assert_eq!(
            holds.first().map(|h| h.as_str()),
            held,
            "{what}: {:?}",
            cpu.holds
        );
        common::assert_holds_the_plan_exactly(&m, &plan, &what);
        m.set_compute(Compute::Exact);
        for backend in [false, true] {
            m.set_host_backend(backend);
            let got = prompt_and_decode(&mut m, &c, &ids);
            let d = max_abs_diff(&floats(&got), &floats(&want));
            assert!(got == want, "{what}, backend {backend}: max|Δ| {d}");
        }
    }
}

/// Tensor parallelism splits each layer's MLP as it is: the dense layers' by the intermediate
/// table (exllamav2's ID table, whole units of 128), the expert layers' by the expert table,
/// both in one plan. The checkpoint's dense width 64 cannot be cut in units of 128, which the
/// plan refuses by name; widened with zeros to 768 (the logits unchanged), over 2 and 3 virtual
/// devices the plan has both tables, the dense MLP tensors split by the first and the experts
/// by the second ([`check_expert_split`]), the load holds the plan, and in exact mode on the
/// host path and through the backend op sequence every position is the layer split's within
/// 1e-5 and transformers' within 1e-3.
#[test]
fn mixed_moe_tensor_parallel_splits_dense_layers_by_columns_and_experts_whole() {
    let ids = MIXED.ids();
    let src = open(MIXED.data());
    let m = weightlift_engine::Model::new(
        std::sync::Arc::clone(&src),
        weightlift_engine::Inventory::parse("virtual:2x64MiB").unwrap(),
    );
    let mut req = m.plan_request().unwrap();
    weightlift_plan::PlanOptions {
        strategy: Some("tensor_parallel".into()),
        ..weightlift_plan::PlanOptions::default()
    }
    .apply(&mut req)
    .unwrap();
    let e = weightlift_plan::plan(&req).unwrap_err().to_string();
    assert!(
        e.contains("divisible by 128 for the dense layers' MLP") && e.contains("64"),
        "{e}"
    );
    let split = MIXED.exact_logits(&MIXED.data(), false);
    let wide = common::widened_mlp(&MIXED.data());
    let src = open(wide.path());
    for (n, ex) in [
        (2, vec![(0, 0, 2), (1, 2, 4)]),
        (3, vec![(0, 0, 2), (1, 2, 3), (2, 3, 4)]),
    ] {
        let what = format!("tensor parallel over {n}");
        let (mut m, cache, plan) = tp_load(&src, &format!("virtual:{n}x64MiB"), None).unwrap();
        let tp = plan.tp().unwrap();
        assert_eq!(tp.ex, ex, "{what}");
        assert_eq!(tp.id.last().map(|x| x.2), Some(768), "{what}: {:?}", tp.id);
        assert_eq!(tp.id.len(), n, "{what}: {:?}", tp.id);
        check_expert_split(MIXED, &what, src.as_ref(), &plan);
        for (t, info) in plan.tensors().iter().zip(src.tensors()) {
            let axis = match info.role {
                Some(Role::FfnGate | Role::FfnUp) => 0,
                Some(Role::FfnDown) => 1,
                _ => continue,
            };
            let got: Vec<(String, u64, u64)> = t
                .split
                .as_ref()
                .unwrap()
                .shards
                .iter()
                .map(|s| (s.device.clone(), s.start, s.end))
                .collect();
            let want: Vec<(String, u64, u64)> = tp
                .id
                .iter()
                .map(|&(d, a, b)| (format!("virtual:{d}"), a, b))
                .collect();
            assert_eq!(got, want, "{what}: {} (axis {axis})", t.name);
        }
        common::assert_holds_the_plan_exactly(&m, &plan, &what);
        m.set_compute(Compute::Exact);
        for backend in [false, true] {
            m.set_host_backend(backend);
            let got = forward_all(&mut m, &cache, &ids);
            let d = max_abs_diff(&got, &split);
            let what = format!("{what}, backend {backend}");
            eprintln!("{what}: max|Δ| {d:e} against the layer split");
            assert!(d <= 1e-5, "{what}: max|Δ| {d} against the layer split");
            MIXED.assert_matches(&what, &got, "hf_logits.npy");
        }
    }
}

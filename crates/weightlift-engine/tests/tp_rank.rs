//! Multi-process tensor parallelism, with each rank run as a thread holding a model of its
//! own: every model loads only its rank's share of the plan (on its own device, as a process
//! on another machine would), and the ranks meet only through the collective's rank-level
//! operations (here a `ThreadGroup`; NCCL across processes). Against the single-process pass,
//! which is itself checked against `cpu` and transformers in `tp_forward.rs`:
//! - every rank returns the same logits bit for bit, prompt chunks and decode steps alike;
//! - a batch of sequences on the ranks gives each the bits it gets alone, and those of the
//!   single-process batch, in one step's collectives;
//! - each rank's cache holds exactly its kv heads' rows of the single-process cache;
//! - each rank's device holds exactly the plan's column for its rank, after the load and at
//!   the forward pass's peak, and nothing else is allocated on an accelerator.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::batch::{
    FAST_BATCH_BOUND, alone, assert_same_bits, assert_within, batched, batched_following,
};
use common::{TpRan, open, tp_run};
use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::tp::{Collective, HostStaged, RankSlice, ThreadGroup};
use weightlift_engine::{Cache, CacheDType, Inventory, Model, Source};
use weightlift_plan as wp;

const RT: wp::RuntimeSpec = wp::RuntimeSpec {
    max_input_len: 16,
    max_attention_size: 256,
    max_dq_size: 1 << 16,
    low_mem: false,
};

/// The tensor-parallel plan over `devices`, and the single-process model loaded by it.
fn single_process(
    src: &Arc<dyn Source>,
    devices: &str,
    dtype: CacheDType,
) -> (Model, Arc<Cache>, wp::Plan) {
    common::load_tp_planned(src, devices, RT, dtype)
}

/// Rank `rank` of `plan`, loaded by a model of its own with the devices `inventory` (its share
/// on `device`, or where the plan puts it).
fn load_rank(
    src: &Arc<dyn Source>,
    inventory: &str,
    plan: &wp::Plan,
    rank: usize,
    device: Option<&str>,
) -> (Model, Arc<Cache>) {
    let mut m = Model::new(Arc::clone(src), Inventory::parse(inventory).unwrap());
    let placement = m.rank_placement(plan, rank, device).unwrap();
    let cache = common::load_placed(&mut m, plan, &placement).unwrap();
    (m, cache)
}

/// A thread-group member that counts the rank-level collectives its rank makes.
#[derive(Debug)]
struct Counted {
    member: ThreadGroup,
    calls: Arc<AtomicUsize>,
}

impl Counted {
    fn count(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }
}

impl Collective for Counted {
    fn name(&self) -> &'static str {
        self.member.name()
    }

    fn synchronize(&self) -> weightlift_engine::Result<()> {
        self.member.synchronize()
    }

    fn joins_other_ranks(&self) -> bool {
        self.member.joins_other_ranks()
    }

    fn all_reduce_sum(&self, parts: &mut [RankSlice<'_>]) -> weightlift_engine::Result<()> {
        self.count();
        self.member.all_reduce_sum(parts)
    }

    fn broadcast_from(
        &self,
        root: usize,
        parts: &mut [RankSlice<'_>],
    ) -> weightlift_engine::Result<()> {
        self.count();
        self.member.broadcast_from(root, parts)
    }

    fn all_gather(
        &self,
        counts: &[usize],
        parts: &mut [RankSlice<'_>],
    ) -> weightlift_engine::Result<()> {
        self.count();
        self.member.all_gather(counts, parts)
    }

    fn reduce_scatter_sum(
        &self,
        counts: &[usize],
        parts: &mut [RankSlice<'_>],
    ) -> weightlift_engine::Result<()> {
        self.count();
        self.member.reduce_scatter_sum(counts, parts)
    }
}

/// Run `job` on every rank at once (given the rank, its model and its cache), one thread each,
/// joined by a thread group: each rank's answer, and the rank-level collectives it made.
fn on_ranks<T: Send>(
    ranks: &mut [(Model, Arc<Cache>)],
    job: impl Fn(usize, &mut Model, &Arc<Cache>) -> T + Sync,
) -> Vec<(T, usize)> {
    let members = ThreadGroup::new(ranks.len()).unwrap();
    let job = &job;
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .zip(members)
            .enumerate()
            .map(|(r, ((m, cache), member))| {
                let calls = Arc::new(AtomicUsize::new(0));
                let tp = m.tp_context_shared().unwrap();
                let counted = Counted {
                    member,
                    calls: Arc::clone(&calls),
                };
                tp.lock().unwrap().set_collective(Box::new(counted));
                s.spawn(move || {
                    // A rank that fails leaves the group, so the others fail rather than wait.
                    let got =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(r, m, cache)));
                    let mut ctx = tp.lock().unwrap_or_else(|e| e.into_inner());
                    ctx.set_collective(Box::new(HostStaged));
                    (got.unwrap(), calls.load(Ordering::SeqCst))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// [`tp_run`] on every rank at once.
fn run_ranks(ranks: &mut [(Model, Arc<Cache>)], ids: &[u32]) -> Vec<TpRan> {
    on_ranks(ranks, |_, m, cache| tp_run(m, cache, ids))
        .into_iter()
        .map(|(got, _)| got)
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// `n` ranks of `path` planned over `n` virtual devices of `size`, each loaded on a one-device
/// inventory of its own (`virtual:0`, as each process of a multi-node run sees its GPU),
/// against the single-process pass: logits, cache rows and memory.
fn check(path: &PathBuf, n: usize, size: &str, ids: &[u32], dtype: CacheDType) {
    let src = open(path);
    let devices = format!("virtual:{n}x{size},cpu");
    let (mut whole, whole_cache, plan) = single_process(&src, &devices, dtype);
    let local = format!("virtual:{size},cpu");
    let mut ranks: Vec<(Model, Arc<Cache>)> = (0..n)
        .map(|r| load_rank(&src, &local, &plan, r, Some("virtual:0")))
        .collect();
    for (r, (m, _)) in ranks.iter().enumerate() {
        let planned = &plan.devices()[r];
        let want = planned.weights + planned.kv + planned.scratch;
        let held = m.memory();
        let got = held
            .iter()
            .find(|(d, _)| d == "virtual:0")
            .map_or(0, |x| x.1);
        let rel = (got as f64 - want as f64).abs() / want as f64;
        eprintln!("rank {r}: plan {want} for {}, held {got}", planned.name);
        assert!(rel <= 0.01, "rank {r}: plan {want}, held {got} ({held:?})");
    }
    for compute in [Compute::Exact, Compute::Fast] {
        whole.set_compute(compute);
        ranks.iter_mut().for_each(|(m, _)| m.set_compute(compute));
        let (want, want_parts) = tp_run(&mut whole, &whole_cache, ids);
        let got = run_ranks(&mut ranks, ids);
        let what = format!(
            "{} over {n} ranks, {} cache, {}",
            path.display(),
            dtype.name(),
            compute.name()
        );
        assert!(want.iter().all(|v| v.is_finite()), "{what}");
        let kv = &plan.tp().unwrap().kv;
        for (r, (logits, parts)) in got.iter().enumerate() {
            assert!(same_bits(logits, &want), "{what}: rank {r}'s logits differ");
            // A rank without kv heads (3 ranks over 2 heads) holds no part of the cache.
            let Some(k) = kv.iter().position(|e| e.0 == r) else {
                assert!(parts.is_empty(), "{what}: rank {r} holds no kv heads");
                continue;
            };
            assert_eq!(
                parts.len(),
                1,
                "{what}: rank {r} holds one part of the cache"
            );
            assert_eq!(parts[0].len(), want_parts[k].len());
            for (i, (g, w)) in parts[0].iter().zip(&want_parts[k]).enumerate() {
                assert!(same_bits(g, w), "{what}: rank {r}'s cache rows {i} differ");
            }
        }
        let copies = ranks[0].0.transfer_stats().count;
        assert!(copies > 0, "{what}: no copies counted");
        // What the forward pass held at its peak is still the plan's column for the rank.
        for (r, (m, _)) in ranks.iter().enumerate() {
            let planned = &plan.devices()[r];
            let want = planned.weights + planned.kv + planned.scratch;
            let peak = m.peak_memory();
            let got = peak
                .iter()
                .find(|(d, _)| d == "virtual:0")
                .map_or(0, |x| x.1);
            assert_eq!(got, want, "{what}: rank {r}'s peak");
        }
    }
}

#[test]
fn llama_gguf_ranks_equal_the_single_process_pass() {
    let path = common::reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf");
    let ids = common::json_ids(&common::reference().join("tiny-llama/ids.json"), "ids");
    check(&path, 2, "48MiB", &ids, CacheDType::F32);
    check(&path, 3, "48MiB", &ids, CacheDType::Q8);
}

#[test]
fn qwen2_ranks_equal_the_single_process_pass() {
    let ids = common::json_ids(&common::qwen2_data().join("stats.json"), "ids");
    check(&common::qwen2(), 2, "48MiB", &ids, CacheDType::Fp16);
}

/// Gemma's post-norms on the reduced rows, its soft-caps and sliding layers, and phi3's
/// stacked matrices (each rank's parts of them several row ranges), rank by rank (the MLP
/// widened so the tables can split it; see `Family::widened`): the safetensors folder and the
/// Q8_0 GGUF, each rank holding the plan's bytes.
#[test]
fn gemma_and_phi3_ranks_equal_the_single_process_pass() {
    for f in ["gemma2", "gemma3", "phi3"] {
        let f = common::family::Family(f);
        let (_dirs, [folder, _, q8]) = f.widened();
        check(&folder, 2, "48MiB", &f.ids(), CacheDType::F32);
        check(&q8, 3, "48MiB", &f.ids(), CacheDType::Fp16);
    }
}

/// Mixtral's and qwen3moe's ranks (and the narrow qwen3moe's, experts narrower than its hidden
/// size) each hold and run their experts of the expert table (the routers replicated), from
/// safetensors over 2 ranks and F16 GGUF over 3.
#[test]
fn moe_ranks_equal_the_single_process_pass() {
    for family in ["mixtral", "qwen3moe", "qwen3moe-narrow"] {
        let f = common::family::Family(family);
        check(&f.data(), 2, "48MiB", &f.ids(), CacheDType::F32);
        check(&f.gguf("F16"), 3, "48MiB", &f.ids(), CacheDType::Fp16);
    }
}

/// The mixed qwen3moe (layers 1 and 5 routed, the others dense; its dense MLP widened with
/// zeros to 768 so the ID table can split it): each rank holds its columns of the dense MLPs
/// and its experts of the routed layers, over 2 and 3 ranks, from safetensors.
#[test]
fn mixed_moe_ranks_equal_the_single_process_pass() {
    let f = common::family::Family("qwen3moe-mixed");
    let wide = common::widened_mlp(&f.data());
    check(
        &wide.path().to_path_buf(),
        2,
        "48MiB",
        &f.ids(),
        CacheDType::F32,
    );
    check(
        &wide.path().to_path_buf(),
        3,
        "48MiB",
        &f.ids(),
        CacheDType::Fp16,
    );
}

#[test]
fn demo_model_ranks_equal_the_single_process_pass() {
    let path = weightlift_testdata::demo_gguf();
    check(
        &path,
        3,
        "256MiB",
        &common::smollm2_prompt(1),
        CacheDType::Fp16,
    );
}

/// Greedy decode steps each sequence of [`rank_requests`] runs after its prompt.
const STEPS: usize = 4;

/// Prompts of several lengths from the tiny model's reference ids, and the step each joins at:
/// batches of prompts and decode steps, and a whole prompt that joins when its tokens and the
/// others' overflow a chunk (it runs alone beside a batch of the rest).
fn rank_requests(ids: &[u32]) -> Vec<(Vec<u32>, usize)> {
    vec![
        (ids[..12].to_vec(), 0),
        (ids[3..7].to_vec(), 0),
        (ids.to_vec(), 1),
        (ids[..9].to_vec(), 2),
    ]
}

/// The ranks of a 2- and a 3-rank group (one without kv heads), each running the same
/// continuous batch: every sequence's logits are the bits it gets alone on the same ranks,
/// and the single-process batch's, in both compute modes.
#[test]
fn ranks_batch_with_the_bits_of_each_sequence_alone() {
    let path = common::reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf");
    let ids = common::json_ids(&common::reference().join("tiny-llama/ids.json"), "ids");
    let reqs = rank_requests(&ids);
    let src = open(&path);
    check_rank_batches(
        &src,
        "tiny llama",
        &reqs,
        &[(2, CacheDType::F32), (3, CacheDType::Q8)],
    );
}

/// The ranks of each `(n, cache dtype)` group, each running the continuous batch `reqs`:
/// every sequence's logits are the bits it gets alone on the same ranks, and the
/// single-process batch's, in both compute modes.
fn check_rank_batches(
    src: &Arc<dyn Source>,
    label: &str,
    reqs: &[(Vec<u32>, usize)],
    groups: &[(usize, CacheDType)],
) {
    for &(n, dtype) in groups {
        let devices = format!("virtual:{n}x48MiB,cpu");
        let (mut whole, _, plan) = single_process(src, &devices, dtype);
        let mut ranks: Vec<(Model, Arc<Cache>)> = (0..n)
            .map(|r| load_rank(src, "virtual:48MiB,cpu", &plan, r, Some("virtual:0")))
            .collect();
        for compute in [Compute::Exact, Compute::Fast] {
            whole.set_compute(compute);
            ranks.iter_mut().for_each(|(m, _)| m.set_compute(compute));
            let what = format!(
                "{label}, {n} ranks, {} cache, {}",
                dtype.name(),
                compute.name()
            );
            let want = batched(&mut whole, reqs, STEPS);
            assert_same_bits(
                &format!("{what}: single process"),
                &alone(&mut whole, reqs, STEPS),
                &want,
            );
            let got = on_ranks(&mut ranks, |_, m, _| {
                (alone(m, reqs, STEPS), batched(m, reqs, STEPS))
            });
            for (r, ((one, many), _)) in got.iter().enumerate() {
                assert_same_bits(&format!("{what}: rank {r} alone"), one, &want);
                assert_same_bits(&format!("{what}: rank {r} batched"), many, &want);
            }
        }
    }
}

/// Mixtral's and both qwen3moe fixtures' ranks of a 2- and a 3-rank group, each running the same
/// continuous batch: every sequence's logits are the bits it gets alone, and the
/// single-process batch's, each rank's experts routing the batch sequence by sequence, in both
/// compute modes.
#[test]
fn moe_ranks_batch_with_the_bits_of_each_sequence_alone() {
    for family in ["mixtral", "qwen3moe", "qwen3moe-narrow"] {
        let f = common::family::Family(family);
        let ids = f.ids();
        let reqs = common::batch::joining_requests(&ids);
        let src = open(f.gguf("F16"));
        check_rank_batches(
            &src,
            family,
            &reqs,
            &[(2, CacheDType::F32), (3, CacheDType::F32)],
        );
    }
}

/// A decode step of three sequences on the ranks makes the collectives of one sequence's step
/// (two all-gathers and two reduce-scatters a layer, the head's all-gather of the residual and
/// of the logits), where the sequences one at a time make three times as many.
#[test]
fn a_rank_batch_step_makes_one_step_of_collectives() {
    let path = common::reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf");
    let ids = common::json_ids(&common::reference().join("tiny-llama/ids.json"), "ids");
    let src = open(&path);
    let (_, _, plan) = single_process(&src, "virtual:2x48MiB,cpu", CacheDType::F32);
    let mut ranks: Vec<(Model, Arc<Cache>)> = (0..2)
        .map(|r| load_rank(&src, "virtual:48MiB,cpu", &plan, r, Some("virtual:0")))
        .collect();
    let layers = ranks[0].0.n_layers() as usize;
    let caches: Vec<Vec<Arc<Cache>>> = ranks
        .iter()
        .map(|(m, _)| (0..3).map(|_| m.sequence_cache(64).unwrap()).collect())
        .collect();
    for compute in [Compute::Exact, Compute::Fast] {
        ranks.iter_mut().for_each(|(m, _)| m.set_compute(compute));
        on_ranks(&mut ranks, |r, m, _| {
            for (c, at) in caches[r].iter().zip([0, 2, 5]) {
                c.reset();
                m.forward(&ids[at..at + 6], Some(c), Logits::Last, &mut Vec::new())
                    .unwrap();
            }
        });
        let step = [42u32, 7, 11];
        let one_by_one = on_ranks(&mut ranks, |r, m, _| {
            let mut rows = Vec::new();
            for (c, id) in caches[r].iter().zip(&step) {
                let mut out = Vec::new();
                m.forward(&[*id], Some(c), Logits::Last, &mut out).unwrap();
                rows.extend(out);
            }
            caches[r].iter().for_each(|c| c.truncate(6).unwrap());
            rows
        });
        let together = on_ranks(&mut ranks, |r, m, _| {
            let seqs: Vec<(&Arc<Cache>, &[u32])> = caches[r]
                .iter()
                .zip(&step)
                .map(|(c, id)| (c, std::slice::from_ref(id)))
                .collect();
            let mut out = Vec::new();
            m.forward_batch(&seqs, &mut out).unwrap();
            out
        });
        let one_step = 4 * layers + 2;
        for (r, ((a, calls_a), (b, calls_b))) in one_by_one.iter().zip(&together).enumerate() {
            let what = format!("{}, rank {r}", compute.name());
            eprintln!("{what}: {calls_a} collectives one at a time, {calls_b} batched");
            assert!(same_bits(b, a), "{what}: the batch's logits");
            assert_eq!(*calls_a, 3 * one_step, "{what}: one at a time");
            assert_eq!(*calls_b, one_step, "{what}: batched");
        }
    }
}

/// Without a rank given a device, each loads on the accelerator that stood for it in the plan,
/// and the inventory's other accelerators hold nothing.
#[test]
fn a_rank_loads_only_its_share() {
    let path = common::reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf");
    let src = open(&path);
    let (_, _, plan) = single_process(&src, "virtual:2x48MiB,cpu", CacheDType::Fp16);
    let (m, cache) = load_rank(&src, "virtual:2x48MiB,cpu", &plan, 1, None);
    let held = m.memory();
    let on = |d: &str| held.iter().find(|(n, _)| n == d).map_or(0, |x| x.1);
    assert_eq!(on("virtual:0"), 0, "{held:?}");
    assert!(on("virtual:1") > 0, "{held:?}");
    let parts = cache.tp_parts();
    let kv = &plan.tp().unwrap().kv;
    let (_, a, b) = kv.iter().find(|e| e.0 == 1).copied().unwrap();
    assert_eq!(parts.len(), 1);
    assert_eq!(parts[0].device.name(), "virtual:1");
    assert_eq!(parts[0].heads, (a as u32, b as u32));
}

/// What a rank-local load cannot do is refused by name, and a rank whose peer fails does not
/// wait for it.
#[test]
fn rank_errors_are_clear() {
    let path = common::reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf");
    let src = open(&path);
    let (_, _, plan) = single_process(&src, "virtual:2x48MiB,cpu", CacheDType::Fp16);
    let m = Model::new(
        Arc::clone(&src),
        Inventory::parse("virtual:48MiB,cpu").unwrap(),
    );
    let e = m.rank_placement(&plan, 2, None).unwrap_err().to_string();
    assert_eq!(
        e,
        "tp rank: expected below the plan's 2 ranks (its accelerators), got 2"
    );
    let layers = common::load_on(&src, "virtual:48MiB,cpu", "virtual:0", 64, CacheDType::Fp16);
    let mut req = layers.0.plan_request().unwrap();
    req.runtime = RT;
    let layer_plan = wp::plan(&req).unwrap();
    let e = m
        .rank_placement(&layer_plan, 0, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected a tensor_parallel plan"), "{e}");

    // The default transport cannot reach ranks in other processes.
    let (mut r0, cache) = load_rank(&src, "virtual:48MiB,cpu", &plan, 0, Some("virtual:0"));
    let e = r0
        .forward(&[1, 2], Some(&cache), Logits::Last, &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "a rank-local tensor-parallel pass through the host-staged collectives is not \
         supported: the other ranks' values live in other processes: give the TPContext a transport that \
         reaches them (TpContext::set_collective with tp::Nccl::for_rank, or a tp::ThreadGroup \
         member)"
    );
    assert_eq!(cache.seq_len(), 0, "nothing ran");

    // A rank whose peer has gone fails instead of waiting.
    let mut members = ThreadGroup::new(2).unwrap();
    drop(members.pop());
    r0.tp_context_shared()
        .unwrap()
        .lock()
        .unwrap()
        .set_collective(Box::new(members.pop().unwrap()));
    let e = r0
        .forward(&[1, 2], Some(&cache), Logits::Last, &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 1 left the group"), "{e}");
}

/// Two ranks as threads, each a model of its own on `cuda:0` (one GPU stands for both ranks'
/// devices), through the CUDA backend: the single-process host pass's logits within the
/// tensor-parallel bound of `tp_forward.rs`, and the same greedy ids.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features weightlift-kernels/cuda -- --ignored"]
fn ranks_on_cuda_give_the_host_pass_logits() {
    let path = common::reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf");
    let ids = common::json_ids(&common::reference().join("tiny-llama/ids.json"), "ids");
    check_cuda_ranks(&open(&path), &ids, "tiny llama");
}

/// Two ranks of `src` as threads on `cuda:0`: the single-process host pass's logits within
/// the tensor-parallel bound, and the same greedy ids, in exact mode. In fast mode the ranks'
/// prompt products of a few tokens take cuBLAS on f16 activations where the host pass
/// quantises them to 8 bits, two roundings that part by fast mode's own bound, not by the
/// tensor-parallel one (0.05 of the largest logit on the tiny llama's Q8_0 blocks).
fn check_cuda_ranks(src: &Arc<dyn Source>, ids: &[u32], label: &str) {
    let (mut whole, whole_cache, plan) =
        single_process(src, "virtual:2x48MiB,cpu", CacheDType::F32);
    whole.set_compute(Compute::Exact);
    let mut ranks: Vec<(Model, Arc<Cache>)> = (0..2)
        .map(|r| load_rank(src, "cuda:0,cpu", &plan, r, Some("cuda:0")))
        .collect();
    ranks
        .iter_mut()
        .for_each(|(m, _)| m.set_compute(Compute::Exact));
    let (want, _) = tp_run(&mut whole, &whole_cache, ids);
    let got = run_ranks(&mut ranks, ids);
    let scale = want.iter().fold(1f32, |a, v| a.max(v.abs()));
    for (r, (logits, _)) in got.iter().enumerate() {
        let d = common::max_abs_diff(logits, &want) / scale;
        eprintln!("{label} cuda rank {r}: max|Δ|/scale {d:e}");
        assert!(d <= 1e-3, "{label} rank {r}: {d}");
    }
    let vocab = whole.vocab_size().unwrap() as usize;
    let argmaxes =
        |l: &[f32]| -> Vec<usize> { l.chunks_exact(vocab).map(common::argmax).collect() };
    assert_eq!(argmaxes(&got[0].0), argmaxes(&want), "{label}: greedy ids");
}

/// Two ranks as threads on `cuda:0`, through the CUDA backend, running the same continuous
/// batch: each sequence's logits are the bits it gets alone on the same ranks in exact mode,
/// and in fast mode (whose batch rows may take cuBLAS and its f16 activations, where a sequence
/// alone decodes on the Q8 kernels) within [`FAST_BATCH_BOUND`] along its greedy ids alone.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features weightlift-kernels/cuda -- --ignored"]
fn ranks_on_cuda_batch_with_the_bits_of_each_sequence_alone() {
    let path = common::reference().join("tiny-llama/gguf/tiny-llama-Q8_0.gguf");
    let ids = common::json_ids(&common::reference().join("tiny-llama/ids.json"), "ids");
    let reqs = rank_requests(&ids);
    let src = open(&path);
    let (_, _, plan) = single_process(&src, "virtual:2x48MiB,cpu", CacheDType::F32);
    let mut ranks: Vec<(Model, Arc<Cache>)> = (0..2)
        .map(|r| load_rank(&src, "cuda:0,cpu", &plan, r, Some("cuda:0")))
        .collect();
    for compute in [Compute::Exact, Compute::Fast] {
        ranks.iter_mut().for_each(|(m, _)| m.set_compute(compute));
        let got = on_ranks(&mut ranks, |_, m, _| {
            let one = alone(m, &reqs, STEPS);
            let many = batched_following(m, &reqs, STEPS, &one);
            (one, many)
        });
        for (r, ((one, many), _)) in got.iter().enumerate() {
            let what = format!("cuda rank {r}, {}", compute.name());
            match compute {
                Compute::Exact => assert_same_bits(&what, many, one),
                Compute::Fast => assert_within(&what, many, one, FAST_BATCH_BOUND),
            }
        }
    }
}

/// Mixtral's and both qwen3moe fixtures' two ranks as threads on `cuda:0` through the CUDA backend, each
/// running its experts of the expert table on the device: the single-process host pass's
/// logits within the tensor-parallel bound, and the same greedy ids.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features weightlift-kernels/cuda -- --ignored"]
fn moe_ranks_on_cuda_give_the_host_pass_logits() {
    for family in ["mixtral", "qwen3moe", "qwen3moe-narrow"] {
        let f = common::family::Family(family);
        check_cuda_ranks(&open(f.gguf("F16")), &f.ids(), family);
    }
}

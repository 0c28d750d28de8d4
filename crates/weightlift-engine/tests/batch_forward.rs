//! Several sequences in one forward call (`Model::forward_batch`): prompts joining between
//! decode steps, finished sequences leaving, each sequence on its own cache. A sequence's
//! logits in a batch are the bits it gets alone, in exact and in fast mode, on every placement,
//! on the host path and through the backend op sequence a GPU runs.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use common::batch::{
    alone, assert_a_system_prompt_is_prefilled_once, assert_same_bits, batched, new_cache,
};
use common::family::Family;
use common::{load_on, load_tp_planned, smollm2, smollm2_prompt, split_load};
use weightlift_engine::forward::{Compute, Logits};
use weightlift_engine::generate::batch::{Answer, Batch, Event};
use weightlift_engine::generate::{FinishReason, GenerateOptions, Generation, Timings, step_batch};
use weightlift_engine::sample::SamplingParams;
use weightlift_engine::{Cache, CacheDType, EngineError};

/// Greedy decode steps each sequence runs after its prompt.
const STEPS: usize = 6;

/// Prompts of several lengths from the reference prompts, and the step at which each joins the
/// batch (so prompts arrive while other sequences decode, and sequences leave at different
/// steps).
fn requests() -> Vec<(Vec<u32>, usize)> {
    let (short, long) = (smollm2_prompt(1), smollm2_prompt(2));
    vec![
        (long.clone(), 0),
        (short.clone(), 0),
        (long[..17].to_vec(), 2),
        (short[..3].to_vec(), 3),
        (long[5..30].to_vec(), 3),
    ]
}

#[test]
fn exact_batched_logits_are_the_bits_of_each_sequence_alone() {
    let (mut m, _) = load_on(&smollm2(), "cpu", "cpu", 64, CacheDType::F32);
    m.set_compute(Compute::Exact);
    let reqs = requests();
    let want = alone(&mut m, &reqs, STEPS);
    assert_same_bits("cpu", &batched(&mut m, &reqs, STEPS), &want);
}

#[test]
fn exact_batches_give_the_same_bits_across_virtual_devices_disk_and_offloaded_caches() {
    let reqs = requests();
    let (mut one, _) = load_on(&smollm2(), "cpu", "cpu", 64, CacheDType::F32);
    one.set_compute(Compute::Exact);
    let want = alone(&mut one, &reqs, STEPS);
    for (inv, devs, disk_below, offload) in [
        (
            "virtual:2x1GiB,cpu",
            &["virtual:0", "virtual:1"][..],
            0,
            false,
        ),
        (
            "virtual:3x1GiB,cpu",
            &["virtual:0", "virtual:1", "virtual:2"][..],
            0,
            false,
        ),
        (
            "virtual:2x1GiB,cpu,disk",
            &["virtual:0", "virtual:1"][..],
            4,
            false,
        ),
        // offloaded caches: each sequence's layer rows fetched to the device as it attends
        (
            "virtual:2x1GiB,cpu",
            &["virtual:0", "virtual:1"][..],
            0,
            true,
        ),
    ] {
        let (mut m, _) = split_load(&smollm2(), inv, devs, CacheDType::F32, disk_below, offload);
        m.set_compute(Compute::Exact);
        assert_same_bits(inv, &batched(&mut m, &reqs, STEPS), &want);
    }
}

#[test]
fn the_backend_op_sequence_batches_with_the_bits_of_each_sequence_alone() {
    // The op sequence a GPU runs, on the CPU backend: the products shared where the backend
    // keeps each token's bits (fast mode's block products of up to 16 tokens), one per
    // sequence otherwise; RoPE, the cache stores and attention per sequence.
    let reqs = requests();
    for compute in [Compute::Exact, Compute::Fast] {
        let (mut m, _) = load_on(&smollm2(), "cpu", "cpu", 64, CacheDType::F32);
        m.set_compute(compute);
        m.set_host_backend(true);
        let want = alone(&mut m, &reqs, STEPS);
        assert_same_bits(
            &format!("host backend, {compute:?}"),
            &batched(&mut m, &reqs, STEPS),
            &want,
        );
        // the same through two devices and with offloaded caches (each sequence's layer rows
        // fetched to the device as it attends)
        for offload in [false, true] {
            let inv = "virtual:2x1GiB,cpu";
            let devs = ["virtual:0", "virtual:1"];
            let (mut m, _) = split_load(&smollm2(), inv, &devs, CacheDType::F32, 0, offload);
            m.set_compute(compute);
            m.set_host_backend(true);
            assert_same_bits(
                &format!("host backend over {inv}, {compute:?}, offloaded caches {offload}"),
                &batched(&mut m, &reqs, STEPS),
                &want,
            );
        }
    }
}

/// Requests over a family fixture's prompt: it whole, its first half, a middle piece and its
/// first three ids, joining at steps 0, 0, 2 and 3.
fn family_requests(ids: &[u32]) -> Vec<(Vec<u32>, usize)> {
    let n = ids.len();
    vec![
        (ids.to_vec(), 0),
        (ids[..n / 2].to_vec(), 0),
        (ids[1..n - 1].to_vec(), 2),
        (ids[..3].to_vec(), 3),
    ]
}

#[test]
fn every_family_batches_with_the_bits_of_each_sequence_alone() {
    // qwen2's biases, qwen3's q/k norms, phi3's stacked matrices, gemma's post-norms, sliding
    // windows (the whole prompt is longer than the window) and gemma2's final soft-cap, on the
    // host path and through the backend, in both modes.
    for family in ["qwen2", "qwen3", "phi3", "gemma2", "gemma3"] {
        let fixture = Family(family);
        let reqs = family_requests(&fixture.ids());
        let src = common::open(fixture.data());
        for compute in [Compute::Exact, Compute::Fast] {
            for backend in [false, true] {
                let (mut m, _) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
                m.set_compute(compute);
                m.set_host_backend(backend);
                let want = alone(&mut m, &reqs, STEPS);
                let what = format!("{family}, {compute:?}, backend {backend}");
                assert_same_bits(&what, &batched(&mut m, &reqs, STEPS), &want);
            }
        }
    }
}

#[test]
fn q4_k_m_batches_with_the_bits_of_each_sequence_alone() {
    // llama.cpp's Q4_K_M keeps some value matrices in Q6_K: there a layer's query and key
    // products run together and its value product on its own, each row with its bits alone.
    for family in ["qwen3", "gemma3"] {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/data/wide-q4k")
            .join(family);
        let src = common::open(dir.join(format!("wide-{family}-Q4_K_M.gguf")));
        let dtype = |name: &str| {
            src.tensors()
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.dtype)
        };
        let mut mixed = (0..).map_while(|i| {
            let q = dtype(&format!("blk.{i}.attn_q.weight"))?;
            Some(q != dtype(&format!("blk.{i}.attn_v.weight"))?)
        });
        assert!(
            mixed.any(|b| b),
            "{family}: no layer of the fixture mixes types in its q/k/v any more"
        );
        let stats: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("stats.json")).unwrap())
                .unwrap();
        let ids: Vec<u32> = stats["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let reqs = family_requests(&ids);
        for compute in [Compute::Exact, Compute::Fast] {
            let (mut m, _) = load_on(&src, "cpu", "cpu", 64, CacheDType::F32);
            m.set_compute(compute);
            let want = alone(&mut m, &reqs, STEPS);
            let what = format!("{family} Q4_K_M, {compute:?}");
            assert_same_bits(&what, &batched(&mut m, &reqs, STEPS), &want);
        }
    }
}

#[test]
fn fast_batched_logits_are_the_bits_of_each_sequence_alone() {
    // Sequences of at most 16 tokens share block products that give each token its own
    // matrix-vector bits; a longer prompt runs its products alone, as it does alone.
    let (mut m, _) = load_on(&smollm2(), "cpu", "cpu", 64, CacheDType::F32);
    m.set_compute(Compute::Fast);
    let reqs = requests();
    assert!(reqs.iter().any(|(p, _)| p.len() > 16) && reqs.iter().any(|(p, _)| p.len() <= 16));
    let want = alone(&mut m, &reqs, STEPS);
    assert_same_bits("fast", &batched(&mut m, &reqs, STEPS), &want);
}

#[test]
fn tensor_parallel_batches_with_the_bits_of_each_sequence_alone() {
    // Each device's products shared over the sequences (fast mode's block products of up to
    // 16 tokens), attention per sequence on its own cache parts, one head product for every
    // sequence's last row; 2 and 3 virtual devices, both modes. A chunk of 16 tokens also
    // sends the longer prompts through alone, beside batches of the rest.
    let reqs = requests();
    for (devices, chunk) in [
        ("virtual:2x256MiB,cpu", 64),
        ("virtual:3x256MiB,cpu", 64),
        ("virtual:2x256MiB,cpu", 16),
    ] {
        let runtime = weightlift_plan::RuntimeSpec {
            max_input_len: chunk,
            max_attention_size: 256,
            max_dq_size: 1 << 16,
            low_mem: false,
        };
        let (mut m, _, _) = load_tp_planned(&smollm2(), devices, runtime, CacheDType::F32);
        for compute in [Compute::Exact, Compute::Fast] {
            m.set_compute(compute);
            let want = alone(&mut m, &reqs, STEPS);
            let what = format!("tp over {devices}, chunk {chunk}, {compute:?}");
            assert_same_bits(&what, &batched(&mut m, &reqs, STEPS), &want);
        }
    }
}

#[test]
fn a_tensor_parallel_decode_step_of_several_sequences_is_one_pass() {
    // One pass makes the collectives' copies of one sequence's step, whatever the sequences.
    let runtime = weightlift_plan::RuntimeSpec {
        max_input_len: 64,
        max_attention_size: 256,
        max_dq_size: 1 << 16,
        low_mem: false,
    };
    let (mut m, _, _) =
        load_tp_planned(&smollm2(), "virtual:2x256MiB,cpu", runtime, CacheDType::F32);
    m.set_compute(Compute::Fast);
    let prompt = smollm2_prompt(1);
    let caches: Vec<Arc<Cache>> = (0..4).map(|_| new_cache(&m)).collect();
    let mut out = Vec::new();
    for c in &caches {
        m.forward(&prompt, Some(c), Logits::Last, &mut out).unwrap();
    }
    let mut alone = Vec::new();
    m.forward(&[42], Some(&caches[0]), Logits::Last, &mut alone)
        .unwrap();
    let one = m.transfer_stats();
    let seqs: Vec<(&Arc<Cache>, &[u32])> = caches[1..].iter().map(|c| (c, &[42u32][..])).collect();
    m.forward_batch(&seqs, &mut out).unwrap();
    let three = m.transfer_stats();
    assert!(one.count > 0);
    assert_eq!(three.count, one.count, "one pass's copies");
    // each had the first one's history: each row is the bits it got alone
    assert_eq!(out.len(), 3 * alone.len());
    let bits = |r: &[f32]| r.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    for row in out.chunks_exact(alone.len()) {
        assert!(bits(row) == bits(&alone));
    }
}

#[test]
fn the_tensor_parallel_backend_pass_batches_with_the_bits_of_each_sequence_alone() {
    // The op sequence `cuda:N` devices run, on virtual devices through the CPU backend: three
    // sequences (prompts of different lengths joining between decode steps), each sequence's
    // logits the bits it gets alone, in both modes and by both routes of the collectives, over
    // 2 devices and over 3 (uneven shares).
    let reqs: Vec<(Vec<u32>, usize)> = requests().into_iter().take(3).collect();
    for devices in ["virtual:2x256MiB,cpu", "virtual:3x256MiB,cpu"] {
        let (mut m, _, _) = load_tp_planned(&smollm2(), devices, tp_runtime(), CacheDType::F32);
        m.set_host_backend(true);
        for compute in [Compute::Exact, Compute::Fast] {
            m.set_compute(compute);
            // the sequences alone by the peer route; the batches by both routes match them
            let tp = m.tp_context_shared().unwrap();
            tp.lock().unwrap().set_peer_copies(true);
            let want = alone(&mut m, &reqs, STEPS);
            for peer in [true, false] {
                tp.lock().unwrap().set_peer_copies(peer);
                let what = format!("tp backends over {devices}, {compute:?}, peer copies {peer}");
                assert_same_bits(&what, &batched(&mut m, &reqs, STEPS), &want);
            }
        }
    }
}

#[test]
fn the_tensor_parallel_backend_pass_copies_no_more_per_sequence_than_the_host_path() {
    // A decode step of three sequences against one of one: the backends' pass adds no copies
    // per sequence where the host path adds none (fast mode: none; exact mode's head takes
    // the sequences' rows one product each on both paths).
    let (mut m, _, _) = load_tp_planned(
        &smollm2(),
        "virtual:2x256MiB,cpu",
        tp_runtime(),
        CacheDType::F32,
    );
    let prompt = smollm2_prompt(1);
    for compute in [Compute::Exact, Compute::Fast] {
        m.set_compute(compute);
        let mut growth = Vec::new();
        for backend in [false, true] {
            m.set_host_backend(backend);
            let caches: Vec<Arc<Cache>> = (0..4).map(|_| new_cache(&m)).collect();
            let mut out = Vec::new();
            for c in &caches {
                m.forward(&prompt, Some(c), Logits::Last, &mut out).unwrap();
            }
            let mut alone = Vec::new();
            m.forward(&[42], Some(&caches[0]), Logits::Last, &mut alone)
                .unwrap();
            let one = m.transfer_stats().count;
            let seqs: Vec<(&Arc<Cache>, &[u32])> =
                caches[1..].iter().map(|c| (c, &[42u32][..])).collect();
            m.forward_batch(&seqs, &mut out).unwrap();
            let three = m.transfer_stats().count;
            assert!(one > 0, "{compute:?}, backend {backend}: no copies counted");
            let bits = |r: &[f32]| r.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            assert_eq!(out.len(), 3 * alone.len());
            for row in out.chunks_exact(alone.len()) {
                assert!(bits(row) == bits(&alone), "{compute:?}, backend {backend}");
            }
            eprintln!("{compute:?}, backend {backend}: {one} copies alone, {three} for three");
            growth.push(three as i64 - one as i64);
        }
        assert_eq!(
            growth[1], growth[0],
            "{compute:?}: copies added by two more sequences"
        );
        if compute == Compute::Fast {
            assert_eq!(growth[1], 0, "fast mode: one pass's copies");
        }
    }
}

fn tp_runtime() -> weightlift_plan::RuntimeSpec {
    weightlift_plan::RuntimeSpec {
        max_input_len: 64,
        max_attention_size: 256,
        max_dq_size: 1 << 16,
        low_mem: false,
    }
}

#[test]
fn a_bad_batch_is_refused_before_any_cache_moves() {
    let (mut m, _) = load_on(&smollm2(), "cpu", "cpu", 64, CacheDType::F32);
    let (a, b) = (new_cache(&m), new_cache(&m));
    let prompt = smollm2_prompt(1);
    let mut out = Vec::new();

    let e = m.forward_batch(&[], &mut out).unwrap_err();
    assert!(e.to_string().contains("at least one sequence"), "{e}");

    let e = m
        .forward_batch(&[(&a, &prompt), (&a, &prompt)], &mut out)
        .unwrap_err();
    assert!(e.to_string().contains("a cache of its own"), "{e}");

    // the second sequence does not fit its cache: neither cache is written
    let long = vec![1u32; 70];
    let e = m
        .forward_batch(&[(&a, &prompt), (&b, &long)], &mut out)
        .unwrap_err();
    assert!(matches!(e, EngineError::ContextFull { .. }), "{e}");
    assert_eq!((a.seq_len(), b.seq_len()), (0, 0));

    let e = m
        .forward_batch(&[(&a, &prompt), (&b, &[])], &mut out)
        .unwrap_err();
    assert!(e.to_string().contains("at least one token"), "{e}");
    assert_eq!((a.seq_len(), b.seq_len()), (0, 0));
}

/// Generations of several kinds: greedy, seeded sampling, a stop string, a short max_tokens.
fn generation_options() -> Vec<GenerateOptions> {
    let sampled = |seed| SamplingParams {
        temperature: 0.8,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    vec![
        GenerateOptions {
            max_tokens: Some(12),
            sampling: greedy,
            ..GenerateOptions::default()
        },
        GenerateOptions {
            max_tokens: Some(10),
            sampling: sampled(7),
            ..GenerateOptions::default()
        },
        GenerateOptions {
            max_tokens: Some(4),
            sampling: sampled(11),
            ..GenerateOptions::default()
        },
        GenerateOptions {
            max_tokens: Some(12),
            sampling: greedy,
            stop: vec![" the".into()],
            ..GenerateOptions::default()
        },
    ]
}

#[test]
fn generations_stepped_together_give_what_each_gives_alone() {
    let (mut m, _) = load_on(&smollm2(), "cpu", "cpu", 64, CacheDType::F32);
    m.set_compute(Compute::Exact);
    let reqs = requests();
    let opts = generation_options();
    let alone: Vec<(String, Vec<u32>, Option<FinishReason>)> = reqs
        .iter()
        .zip(&opts)
        .map(|((prompt, _), o)| {
            let cache = new_cache(&m);
            let mut g = Generation::new(&m, prompt, Some(&cache), o.clone()).unwrap();
            let text = g.run(&mut m, |_| true).unwrap();
            (text, g.tokens().to_vec(), g.finish_reason())
        })
        .collect();
    // one ends at its stop string, the others at their lengths
    let ends: Vec<_> = alone.iter().map(|a| a.2).collect();
    assert!(ends.contains(&Some(FinishReason::Stop)), "{alone:?}");
    assert!(ends.contains(&Some(FinishReason::Length)), "{alone:?}");

    // joined at their steps; each leaves when it returns its final piece
    let caches: Vec<Arc<Cache>> = opts.iter().map(|_| new_cache(&m)).collect();
    let mut gens: Vec<Option<Generation>> = opts.iter().map(|_| None).collect();
    let mut texts = vec![String::new(); opts.len()];
    let mut steps_with_several = 0;
    for step in 0.. {
        for (i, ((prompt, join), o)) in reqs.iter().zip(&opts).enumerate() {
            if *join == step {
                gens[i] = Some(Generation::new(&m, prompt, Some(&caches[i]), o.clone()).unwrap());
            }
        }
        let mut live: Vec<(usize, &mut Generation)> = gens
            .iter_mut()
            .enumerate()
            .filter_map(|(i, g)| g.as_mut().filter(|g| !g.is_done()).map(|g| (i, g)))
            .collect();
        if live.is_empty() && step > 3 {
            break;
        }
        steps_with_several += usize::from(live.len() > 1);
        let (idx, mut refs): (Vec<usize>, Vec<&mut Generation>) =
            live.iter_mut().map(|(i, g)| (*i, &mut **g)).unzip();
        for (i, piece) in idx.iter().zip(step_batch(&mut m, &mut refs).unwrap()) {
            if let Some(p) = piece.unwrap() {
                texts[*i].push_str(&p.text);
            }
        }
    }
    assert!(steps_with_several >= 4, "{steps_with_several}");
    for (i, g) in gens.iter().enumerate() {
        let g = g.as_ref().unwrap();
        let got = (texts[i].clone(), g.tokens().to_vec(), g.finish_reason());
        assert_eq!(got, alone[i], "generation {i}");
    }
}

/// The text of every `Event::Text` of `events` per id, and the ids that ended with their
/// timings.
fn collect(
    events: Vec<(u64, Event)>,
    texts: &mut HashMap<u64, String>,
    ended: &mut HashMap<u64, Timings>,
) {
    for (id, e) in events {
        match e {
            Event::Text(t) => texts.entry(id).or_default().push_str(&t),
            Event::End(_, t) => {
                ended.insert(id, t);
            }
            other => panic!("unexpected event of {id}: {other:?}"),
        }
    }
}

#[test]
fn a_batch_runs_generations_in_slots_that_keep_their_prefix() {
    let (mut m, _) = load_on(&smollm2(), "cpu", "cpu", 64, CacheDType::F32);
    m.set_compute(Compute::Exact);
    assert!(matches!(
        Batch::new(&m, 0),
        Err(EngineError::Invalid { what, .. }) if what == "parallel"
    ));
    let opts = generation_options();
    let prompts = [smollm2_prompt(2)[..17].to_vec(), smollm2_prompt(1)];
    let alone: Vec<String> = prompts
        .iter()
        .zip(&opts)
        .map(|(p, o)| {
            let cache = new_cache(&m);
            let mut g = Generation::new(&m, p, Some(&cache), o.clone()).unwrap();
            g.run(&mut m, |_| true).unwrap()
        })
        .collect();

    let mut batch = Batch::new(&m, 2).unwrap();
    assert_eq!((batch.parallel(), batch.n_ctx()), (2, 64));
    let ids: Vec<u64> = prompts
        .iter()
        .zip(&opts)
        .map(|(p, o)| batch.start(&m, p, o.clone(), Answer::Text).unwrap())
        .collect();
    // a third has no slot, and starting it changes nothing
    let refused = batch.start(&m, &prompts[0], opts[0].clone(), Answer::Text);
    assert!(
        matches!(refused, Err(EngineError::Invalid { .. })),
        "{refused:?}"
    );
    assert_eq!(batch.running(), 2);
    let (mut texts, mut ended) = (HashMap::new(), HashMap::new());
    while batch.running() > 0 {
        collect(batch.step(&mut m).unwrap(), &mut texts, &mut ended);
    }
    for (id, want) in ids.iter().zip(&alone) {
        assert_eq!(texts.get(id).map(String::as_str).unwrap_or(""), want);
        assert_eq!(ended[id].reused_tokens, 0);
    }

    // the same prompt again goes to the slot holding it and runs only its last token
    let again = batch
        .start(&m, &prompts[1], opts[0].clone(), Answer::Text)
        .unwrap();
    // a client that leaves frees its slot at once
    let gone = batch
        .start(&m, &prompts[0], opts[0].clone(), Answer::Text)
        .unwrap();
    collect(batch.step(&mut m).unwrap(), &mut texts, &mut ended);
    assert!(batch.cancel(gone) && !batch.cancel(gone));
    assert_eq!(batch.running(), 1);
    while batch.running() > 0 {
        collect(batch.step(&mut m).unwrap(), &mut texts, &mut ended);
    }
    let held = prompts[1].len() as u64 - 1;
    assert_eq!(
        (ended[&again].reused_tokens, ended[&again].prompt_tokens),
        (held, 1)
    );
    assert!(!ended.contains_key(&gone));
}

/// A system prompt another slot holds is copied into a new generation's slot, which runs only
/// the rest of its prompt, with the bits it gets alone: in caches of f32, fp16, q8 and q4 (whose
/// groups are copied as they are stored), over virtual devices and offloaded, and split by kv
/// heads under tensor parallelism (part to part).
#[test]
fn a_system_prompt_is_prefilled_once_across_slots() {
    let (long, short) = (smollm2_prompt(2), smollm2_prompt(1));
    let (system, q1, q2) = (&long[..16], &long[16..22], &short[1..]);
    for dtype in [
        CacheDType::F32,
        CacheDType::Fp16,
        CacheDType::Q8,
        CacheDType::Q4,
    ] {
        let (mut m, _) = load_on(&smollm2(), "cpu", "cpu", 64, dtype);
        m.set_compute(Compute::Exact);
        let counts = assert_a_system_prompt_is_prefilled_once(
            &format!("{dtype:?} cache"),
            &mut m,
            system,
            [q1, q2],
        );
        // joining while A runs, B computes its 4 own tokens where it computed 20
        assert_eq!(counts[..2], [(20, 0), (4, 16)]);
    }
    for offload in [false, true] {
        let devs = ["virtual:0", "virtual:1"];
        let (mut m, _) = split_load(
            &smollm2(),
            "virtual:2x1GiB,cpu",
            &devs,
            CacheDType::Q8,
            0,
            offload,
        );
        m.set_compute(Compute::Exact);
        assert_a_system_prompt_is_prefilled_once(
            &format!("virtual devices, offloaded {offload}"),
            &mut m,
            system,
            [q1, q2],
        );
    }
    let devices = "virtual:2x256MiB,cpu";
    let (mut m, _, _) = load_tp_planned(&smollm2(), devices, tp_runtime(), CacheDType::F32);
    m.set_compute(Compute::Exact);
    assert_a_system_prompt_is_prefilled_once(
        &format!("tensor parallel over {devices}"),
        &mut m,
        system,
        [q1, q2],
    );
}

//! Several sequences run one at a time and as a continuous batch (`Model::forward_batch`): the
//! two drivers the batch tests compare, and their comparison.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use weightlift_engine::forward::Logits;
use weightlift_engine::generate::batch::{Answer, Batch, Event};
use weightlift_engine::generate::{GenerateOptions, Generation, Hook};
use weightlift_engine::sample::SamplingParams;
use weightlift_engine::{Cache, Model};

/// A cache of 64 positions of the model's own cache type (f32 here), allocated beside its layers.
pub fn new_cache(m: &Model) -> Arc<Cache> {
    m.sequence_cache(64).unwrap()
}

/// Requests over a fixture's prompt ids, each with the step it joins at: the whole prompt and
/// a short one from the start, a middle slice joining at step 1 and a tail at step 2, so
/// prompts join while others decode.
pub fn joining_requests(ids: &[u32]) -> Vec<(Vec<u32>, usize)> {
    vec![
        (ids.to_vec(), 0),
        (ids[..3].to_vec(), 0),
        (ids[1..ids.len() - 1].to_vec(), 1),
        (ids[4..].to_vec(), 2),
    ]
}

/// Each request alone on a fresh cache: the logits after its prompt and after each greedy step.
pub fn alone(m: &mut Model, reqs: &[(Vec<u32>, usize)], steps: usize) -> Vec<Vec<Vec<f32>>> {
    reqs.iter()
        .map(|(prompt, _)| {
            let cache = new_cache(m);
            let mut rows = Vec::new();
            let mut out = Vec::new();
            m.forward(prompt, Some(&cache), Logits::Last, &mut out)
                .unwrap();
            rows.push(out.clone());
            for _ in 0..steps {
                let next = super::argmax(&out) as u32;
                m.forward(&[next], Some(&cache), Logits::Last, &mut out)
                    .unwrap();
                rows.push(out.clone());
            }
            rows
        })
        .collect()
}

/// The requests as a continuous batch: at each step every active sequence appends its prompt
/// (the step it joins) or its last greedy token, all in one `forward_batch` call. The same rows
/// as [`alone`].
pub fn batched(m: &mut Model, reqs: &[(Vec<u32>, usize)], steps: usize) -> Vec<Vec<Vec<f32>>> {
    batched_with(m, reqs, steps, |_, rows| {
        super::argmax(rows.last().unwrap()) as u32
    })
}

/// [`batched`], each sequence fed the greedy ids of its rows alone (`alone`'s) instead of its
/// own: where a batch rounds otherwise than a sequence alone (fast mode on CUDA), a near tie may
/// go either way, and the sequences would then part.
pub fn batched_following(
    m: &mut Model,
    reqs: &[(Vec<u32>, usize)],
    steps: usize,
    alone: &[Vec<Vec<f32>>],
) -> Vec<Vec<Vec<f32>>> {
    batched_with(m, reqs, steps, |i, rows| {
        super::argmax(&alone[i][rows.len() - 1]) as u32
    })
}

/// Fast mode's bound for a sequence's logits in a CUDA batch against its logits alone, on the
/// tiny llama: the batch's rows of several tokens may take cuBLAS, which rounds activations
/// (and dequantised weights) to f16, where a sequence's own decode step takes the Q8 kernels'
/// 8-bit blocks. Each side lies within fast mode's own rounding of the exact logits, about 0.25
/// on this model, so the two within twice that (the first GPU run measured 0.28 between them
/// with Q4_K_M blocks).
pub const FAST_BATCH_BOUND: f32 = 0.5;

/// Each row of `got` within `bound` of `want`'s, with the same argmax wherever `want`'s top two
/// are further apart than `bound` (the tiny model's random weights leave near ties).
pub fn assert_within(what: &str, got: &[Vec<Vec<f32>>], want: &[Vec<Vec<f32>>], bound: f32) {
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: sequence {s}");
        for (t, (a, b)) in g.iter().zip(w).enumerate() {
            let d = super::max_abs_diff(a, b);
            assert!(d <= bound, "{what}: sequence {s} step {t}: max|Δ| {d}");
            if super::margin(b) > bound {
                assert_eq!(
                    super::argmax(a),
                    super::argmax(b),
                    "{what}: sequence {s} step {t}"
                );
            }
        }
    }
}

/// The continuous batch of [`batched`], each sequence's next id from `next(i, its rows)`.
fn batched_with(
    m: &mut Model,
    reqs: &[(Vec<u32>, usize)],
    steps: usize,
    next: impl Fn(usize, &[Vec<f32>]) -> u32,
) -> Vec<Vec<Vec<f32>>> {
    let caches: Vec<Arc<Cache>> = reqs.iter().map(|_| new_cache(m)).collect();
    let mut rows: Vec<Vec<Vec<f32>>> = vec![Vec::new(); reqs.len()];
    let mut step = 0;
    while rows.iter().any(|r| r.len() <= steps) {
        let active: Vec<usize> = (0..reqs.len())
            .filter(|&i| reqs[i].1 <= step && rows[i].len() <= steps)
            .collect();
        let ids: Vec<Vec<u32>> = active
            .iter()
            .map(|&i| match rows[i].is_empty() {
                true => reqs[i].0.clone(),
                false => vec![next(i, &rows[i])],
            })
            .collect();
        let seqs: Vec<(&Arc<Cache>, &[u32])> = active
            .iter()
            .zip(&ids)
            .map(|(&i, ids)| (&caches[i], ids.as_slice()))
            .collect();
        let mut out = Vec::new();
        m.forward_batch(&seqs, &mut out).unwrap();
        let vocab = out.len() / active.len();
        for (&i, row) in active.iter().zip(out.chunks_exact(vocab)) {
            rows[i].push(row.to_vec());
        }
        step += 1;
    }
    for ((prompt, _), cache) in reqs.iter().zip(&caches) {
        assert_eq!(cache.seq_len() as usize, prompt.len() + steps);
    }
    rows
}

pub fn assert_same_bits(what: &str, got: &[Vec<Vec<f32>>], want: &[Vec<Vec<f32>>]) {
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: sequence {s}");
        for (t, (a, b)) in g.iter().zip(w).enumerate() {
            let same =
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{what}: sequence {s} step {t}: max|Δ| {}",
                super::max_abs_diff(a, b)
            );
        }
    }
}

/// The texts and sampled-from logits of greedy generations of `prompt`, and the tokens of its
/// prompt that ran and that were reused, as a [`Batch`] generation or one alone reports them.
#[derive(Debug, Default, PartialEq)]
pub struct Run {
    pub text: String,
    pub logits: Vec<Vec<f32>>,
    /// `(prompt tokens run, prompt tokens reused)`.
    pub prompt: (u64, u64),
}

/// Greedy options of `max_tokens` whose hook records every logits row sampled from into `rows`.
fn recording(max_tokens: u64, rows: &Arc<Mutex<Vec<Vec<f32>>>>) -> GenerateOptions {
    let rows = Arc::clone(rows);
    GenerateOptions {
        max_tokens: Some(max_tokens),
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        stop_at_eog: false,
        logits_hook: Some(Hook(Arc::new(move |_, l: &mut [f32]| {
            rows.lock().unwrap().push(l.to_vec());
            Ok(())
        }))),
        ..GenerateOptions::default()
    }
}

/// `prompt` alone on a cache of `n_ctx` positions that ran `before` first (from empty), reusing
/// the prefix of it that `prompt` shares as a slot does ([`Generation::in_slot`]).
fn run_alone(m: &mut Model, before: &[u32], prompt: &[u32], n_ctx: u64, max_tokens: u64) -> Run {
    let rows = Arc::new(Mutex::new(Vec::new()));
    let cache = m.sequence_cache(n_ctx).unwrap();
    if !before.is_empty() {
        m.forward(before, Some(&cache), Logits::Last, &mut Vec::new())
            .unwrap();
    }
    let mut g = Generation::in_slot(m, prompt, &cache, recording(max_tokens, &rows)).unwrap();
    let text = g.run(m, |_| true).unwrap();
    let t = g.timings();
    let logits = std::mem::take(&mut *rows.lock().unwrap());
    Run {
        text,
        logits,
        prompt: (t.prompt_tokens, t.reused_tokens),
    }
}

/// A batch of 3 slots runs `system + q1` (A), then `system + q2` (B) three ways: B joining
/// before A's first step (nothing held yet: B runs its whole prompt, with the bits it gets
/// alone from an empty cache), after it (B's slot gets the system prompt A's running slot holds
/// and runs only `q2`) and after A has ended (B runs only `q2` in A's slot). Reusing, B has the
/// bits it gets alone on a cache that ran A's prompt first: the rows of the system prompt are
/// A's, and its own tokens run as one chunk after them (a prompt run in other chunks may move
/// the last bits, in exact mode too). A has the bits it gets alone each way. Returns B's
/// `(prompt tokens run, reused)` of each way.
pub fn assert_a_system_prompt_is_prefilled_once(
    what: &str,
    m: &mut Model,
    system: &[u32],
    [q1, q2]: [&[u32]; 2],
) -> Vec<(u64, u64)> {
    const MAX_TOKENS: u64 = 3;
    assert_ne!(q1[0], q2[0], "{what}: the questions share no first token");
    let [a, b] = [q1, q2].map(|q| [system, q].concat());
    let n_ctx = Batch::new(m, 1).unwrap().n_ctx();
    let a_alone = run_alone(m, &[], &a, n_ctx, MAX_TOKENS);
    let b_alone = run_alone(m, &[], &b, n_ctx, MAX_TOKENS);
    let b_after_a = run_alone(m, &a, &b, n_ctx, MAX_TOKENS);
    let held = system.len() as u64;
    assert_eq!(b_alone.prompt, (b.len() as u64, 0));
    assert_eq!(b_after_a.prompt, (q2.len() as u64, held));
    let mut counts = Vec::new();
    for b_joins_at in [0, 1, MAX_TOKENS as usize + 1] {
        // slot 0 is the model's own cache: empty, as the others start
        m.own_cache().unwrap().reset();
        let mut batch = Batch::new(m, 3).unwrap();
        let rows = [(); 2].map(|_| Arc::new(Mutex::new(Vec::new())));
        let mut ids: [Option<u64>; 2] = [None, None];
        ids[0] = Some(
            batch
                .start(m, &a, recording(MAX_TOKENS, &rows[0]), Answer::Text)
                .unwrap(),
        );
        let mut runs: HashMap<u64, Run> = HashMap::new();
        for step in 0.. {
            if step == b_joins_at {
                ids[1] = Some(
                    batch
                        .start(m, &b, recording(MAX_TOKENS, &rows[1]), Answer::Text)
                        .unwrap(),
                );
            }
            if batch.running() == 0 && ids[1].is_some() {
                break;
            }
            for (id, event) in batch.step(m).unwrap() {
                let run = runs.entry(id).or_default();
                match event {
                    Event::Text(t) => run.text.push_str(&t),
                    Event::End(_, t) => run.prompt = (t.prompt_tokens, t.reused_tokens),
                    other => panic!("{what}: unexpected event of {id}: {other:?}"),
                }
            }
        }
        for (i, (id, rows)) in ids.iter().zip(&rows).enumerate() {
            let run = runs.get_mut(&id.unwrap()).unwrap();
            run.logits = std::mem::take(&mut *rows.lock().unwrap());
            let want = match (i, b_joins_at) {
                (0, _) => &a_alone,
                (_, 0) => &b_alone,
                _ => &b_after_a,
            };
            let label = format!("{what}, B joining at step {b_joins_at}, generation {i}");
            assert_eq!(
                (&run.text, run.prompt),
                (&want.text, want.prompt),
                "{label}"
            );
            assert_same_bits(
                &label,
                std::slice::from_ref(&run.logits),
                std::slice::from_ref(&want.logits),
            );
        }
        counts.push(runs[&ids[1].unwrap()].prompt);
    }
    assert_eq!(
        counts,
        [
            (b.len() as u64, 0),
            (q2.len() as u64, held),
            (q2.len() as u64, held)
        ],
        "{what}: B's prompt tokens (run, reused) joining before A's first step, after it, and \
         after A ended"
    );
    counts
}

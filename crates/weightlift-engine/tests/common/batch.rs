//! Several sequences run one at a time and as a continuous batch (`Model::forward_batch`): the
//! two drivers the batch tests compare, and their comparison.

use std::sync::Arc;

use weightlift_engine::forward::Logits;
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
    let caches: Vec<Arc<Cache>> = reqs.iter().map(|_| new_cache(m)).collect();
    let mut rows: Vec<Vec<Vec<f32>>> = vec![Vec::new(); reqs.len()];
    let mut step = 0;
    while rows.iter().any(|r| r.len() <= steps) {
        let active: Vec<usize> = (0..reqs.len())
            .filter(|&i| reqs[i].1 <= step && rows[i].len() <= steps)
            .collect();
        let ids: Vec<Vec<u32>> = active
            .iter()
            .map(|&i| match rows[i].last() {
                None => reqs[i].0.clone(),
                Some(last) => vec![super::argmax(last) as u32],
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

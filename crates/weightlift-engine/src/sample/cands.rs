//! The candidate list the chain works on (llama.cpp's `llama_token_data_array`), how it is
//! filled from the logits (all of them, or the top k through a heap), its softmax, and greedy's
//! argmax.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// One token in the candidate list, as llama.cpp's `llama_token_data`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Cand {
    pub(super) id: u32,
    pub(super) logit: f32,
    pub(super) p: f32,
}

/// Best first: the higher logit, then the lower id. Logits are never NaN here (see [`not_nan`]),
/// so this is a total order and a seed's draws do not depend on the sort algorithm.
pub(super) fn by_rank(a: &Cand, b: &Cand) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// A NaN logit (a diverged model) ranks below everything instead of poisoning the softmax.
pub(super) fn not_nan(logit: f32) -> f32 {
    if logit.is_nan() {
        f32::NEG_INFINITY
    } else {
        logit
    }
}

/// A heap entry whose greatest element is the worst-ranked candidate, so `peek` is the one to
/// evict when a better one arrives.
#[derive(Debug)]
pub(super) struct Worst(pub(super) Cand);

impl Ord for Worst {
    fn cmp(&self, other: &Self) -> Ordering {
        by_rank(&self.0, &other.0)
    }
}

impl PartialOrd for Worst {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Worst {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Worst {}

/// llama.cpp's `llama_token_data_array`: the candidates and whether they are sorted by rank.
/// Every step keeps at least one candidate.
#[derive(Debug, Default)]
pub(super) struct Cands {
    pub(super) v: Vec<Cand>,
    pub(super) sorted: bool,
}

impl Cands {
    pub(super) fn max_logit(&self) -> f32 {
        if self.sorted {
            self.v.first().map_or(f32::NEG_INFINITY, |c| c.logit)
        } else {
            self.v.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit))
        }
    }
}

/// `exp(logit - max)`, with the maximum itself weighing exactly 1 so that all-`-inf` or `+inf`
/// logits give a uniform choice among the maxima instead of NaN.
pub(super) fn weight(logit: f32, max: f32) -> f32 {
    if logit == max {
        1.0
    } else {
        (logit - max).exp()
    }
}

/// Sets every `p` to the softmax of the logits (`llama_sampler_softmax_impl` without sorting).
pub(super) fn softmax(c: &mut Cands) {
    let max = c.max_logit();
    let mut sum = 0.0f64;
    for x in &mut c.v {
        x.p = weight(x.logit, max);
        sum += f64::from(x.p);
    }
    // sum >= 1: the maximum weighs 1.
    let inv = (1.0 / sum) as f32;
    for x in &mut c.v {
        x.p *= inv;
    }
}

/// Every token is a candidate, in id order (top-k off, or k >= the vocabulary).
pub(super) fn fill_all(src: &[f32], c: &mut Cands) {
    c.v.clear();
    c.v.extend(src.iter().enumerate().map(|(i, &l)| Cand {
        id: i as u32,
        logit: not_nan(l),
        p: 0.0,
    }));
    c.sorted = false;
}

/// llama.cpp's top-k: the `k` best tokens, sorted. One pass with a k-entry heap instead of
/// sorting the vocabulary: past the first few thousand tokens almost none beats the heap's
/// worst, so whole blocks of 8 are skipped with one vectorised compare.
pub(super) fn fill_top_k(src: &[f32], k: usize, heap: &mut BinaryHeap<Worst>, c: &mut Cands) {
    const BLOCK: usize = 8;
    heap.clear();
    // The worst kept logit once the heap is full. Ids arrive in increasing order, so a later
    // token with an equal logit ranks lower and only a strictly larger logit gets in (NaN
    // never does).
    let mut worst = f32::NEG_INFINITY;
    for (b, block) in src.chunks(BLOCK).enumerate() {
        if heap.len() == k && !block.iter().fold(false, |any, &l| any | (l > worst)) {
            continue;
        }
        for (j, &l) in block.iter().enumerate() {
            let cand = Cand {
                id: (b * BLOCK + j) as u32,
                logit: not_nan(l),
                p: 0.0,
            };
            if heap.len() < k {
                heap.push(Worst(cand));
            } else if cand.logit > worst {
                if let Some(mut top) = heap.peek_mut() {
                    *top = Worst(cand);
                }
            } else {
                continue;
            }
            if heap.len() == k {
                worst = heap.peek().map_or(f32::NEG_INFINITY, |w| w.0.logit);
            }
        }
    }
    c.v.clear();
    c.v.extend(heap.drain().map(|w| w.0));
    c.v.sort_unstable_by(by_rank);
    c.sorted = true;
}

/// The index of the largest value, the lowest on ties; NaN never wins (all NaN gives 0).
/// llama.cpp's greedy. Two passes that the compiler vectorises, the maximum over 8 lanes and
/// then its first position, run several times faster than one pass tracking the index.
pub(super) fn argmax(xs: &[f32]) -> usize {
    const LANES: usize = 8;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            if v > *m {
                *m = v;
            }
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    xs.iter().position(|&v| v == max).unwrap_or(0)
}

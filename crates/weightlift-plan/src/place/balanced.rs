//! accelerate's `balanced` and `balanced_low_0`: `get_balanced_memory`'s per-GPU caps, which
//! the accelerate fill (`fill`) then respects, sized by accelerate's rule or by transformers
//! 5's ([`BudgetRule`]). [`balanced_max_memory`] is the rule on plain numbers, public so that
//! it can be checked against both libraries directly.

use std::collections::BTreeMap;

use super::{Ctx, UnitKind};
use crate::request::BudgetRule;
use crate::workspace::Hosts;

impl Ctx<'_> {
    /// accelerate `get_balanced_memory` caps (bytes for weights + kv) per device index;
    /// `None` means uncapped.
    pub(super) fn balanced_caps(&self, low_zero: bool) -> Vec<Option<u64>> {
        let full = Hosts {
            layers: true,
            head: true,
            embed: true,
        };
        let max_memory: Vec<u64> = self
            .accel
            .iter()
            .map(|&d| {
                self.devs[d]
                    .room()
                    .saturating_sub(self.scratch.charged(full, self.devs[d].kind))
            })
            .collect();
        let mut total: u64 = self
            .units
            .iter()
            .map(|u| u.weights.saturating_add(self.dev_kv(u)))
            .fold(0u64, u64::saturating_add);
        if self.offload {
            // Every accelerator that computes layers holds its prefetch slots.
            let slots = self.offload_slots_estimate();
            total = total.saturating_add(slots.saturating_mul(self.accel.len() as u64));
        }
        let blocks = self
            .units
            .iter()
            .filter(|u| matches!(u.kind, UnitKind::Layer(_)))
            .map(|u| u.weights.saturating_add(self.dev_kv(u)));
        // accelerate's "final modules": one per weight/bias pair (q_proj, input_layernorm, ...).
        let mut modules: BTreeMap<&str, u64> = BTreeMap::new();
        for (t, b) in self.tensors().iter().zip(&self.bytes) {
            let m = t
                .name
                .strip_suffix(".weight")
                .or_else(|| t.name.strip_suffix(".bias"))
                .unwrap_or(&t.name);
            let e = modules.entry(m).or_default();
            *e = e.saturating_add(*b);
        }
        let (no_split, leaf) = match self.req.budget_rule {
            // accelerate: the first no-split block found, and the mean final module.
            BudgetRule::Accelerate => (
                blocks.clone().next().unwrap_or(0),
                modules.values().fold(0u64, |a, &b| a.saturating_add(b))
                    / (modules.len().max(1) as u64),
            ),
            // transformers 5: the largest no-split block and the largest leaf module.
            BudgetRule::Transformers => (
                blocks.max().unwrap_or(0),
                modules.values().copied().max().unwrap_or(0),
            ),
        };
        // A max_memory given for any device, the host included, is the user's budget.
        let user_set = !self.req.max_memory.is_empty();
        let caps = balanced_max_memory(total, no_split, leaf, &max_memory, low_zero, user_set);
        let mut out = vec![None; self.devs.len()];
        for (&d, c) in self.accel.iter().zip(caps) {
            out[d] = Some(c);
        }
        out
    }
}

/// accelerate's `get_balanced_memory` on plain numbers: `max_memory` holds the GPUs' limits in
/// order; returns the balanced caps. `no_split` and `leaf` are accelerate's first no-split
/// block and mean leaf module, or transformers 5's largest no-split block and largest leaf.
///
/// `per_gpu = total / n` (`n - 1` with `low_zero`) + `1.25 × max(no_split, leaf)`;
/// every GPU but the last is capped at `per_gpu`; with `low_zero` GPU 0 gets only what the
/// others cannot hold. GPUs with a zero limit are not counted. With one GPU and no
/// user-given `max_memory`, accelerate keeps 10% free.
pub fn balanced_max_memory(
    total: u64,
    no_split: u64,
    leaf: u64,
    max_memory: &[u64],
    low_zero: bool,
    user_set: bool,
) -> Vec<u64> {
    let mut mm = max_memory.to_vec();
    let gpus: Vec<usize> = (0..mm.len()).filter(|&i| mm[i] > 0).collect();
    let n = gpus.len() as u64;
    if n == 0 {
        return mm;
    }
    let mut low_zero = low_zero;
    if n == 1 {
        low_zero = false;
        if !user_set {
            mm[gpus[0]] = mm[gpus[0]] / 10 * 9 + (mm[gpus[0]] % 10) * 9 / 10;
        }
    }
    let per = total / if low_zero { n - 1 } else { n };
    let buffer = no_split.max(leaf).saturating_mul(5) / 4;
    let per_gpu = per.saturating_add(buffer);
    let first = mm[0];
    for &i in &gpus[..gpus.len() - 1] {
        let v = if low_zero && i == 0 { first } else { per_gpu };
        mm[i] = v.min(mm[i]);
    }
    if low_zero {
        let others = (1..(n as usize).min(mm.len())).fold(0u64, |a, i| a.saturating_add(mm[i]));
        let min_zero = total.saturating_sub(others);
        mm[0] = min_zero.min(mm[0]);
    }
    mm
}

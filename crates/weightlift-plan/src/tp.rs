//! Tensor-parallel split tables, following exllamav2's `TPContext.define_split` and its
//! `integer_split` helper.

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};
use crate::workspace::{ALIGN, Dims, Hosts, Region, Workspace};

/// Which dimension a table splits (exllamav2's `BROADCAST_*` constants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TpKind {
    /// KV heads.
    Kv,
    /// Intermediate (MLP) dimension, in units of 128.
    Id,
    /// Vocabulary, in units of 32 (padded up to a multiple of 32).
    Vc,
    /// Residual stream (hidden size), in units of 32.
    Rs,
    /// Query heads: the KV split times the number of KV groups.
    Q,
    /// Routed experts of a mixture-of-experts model, whole experts in units of 1 (expert
    /// parallelism; empty for a dense model).
    Ex,
}

impl TpKind {
    pub fn parse(s: &str) -> Result<TpKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "kv" => Ok(TpKind::Kv),
            "id" => Ok(TpKind::Id),
            "vc" => Ok(TpKind::Vc),
            "rs" => Ok(TpKind::Rs),
            "q" => Ok(TpKind::Q),
            "ex" => Ok(TpKind::Ex),
            _ => Err(PlanError::option(
                "tp_split kind",
                "kv, id, vc, rs, q or ex",
                format!("'{s}'"),
            )),
        }
    }
}

/// One table: `(device_index, start, end)` for every device with a non-empty share, in device
/// order, covering `0..total` exactly once. Device indices count the plan's accelerators.
pub type SplitTable = Vec<(usize, u64, u64)>;

/// The five tables of a TPContext, and for a mixture-of-experts model the expert table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpSplit {
    pub kv: SplitTable,
    pub id: SplitTable,
    pub vc: SplitTable,
    pub rs: SplitTable,
    pub q: SplitTable,
    /// Expert parallelism: each device computes whole routed experts, a contiguous range of
    /// expert indices (GGUF's stacked `ffn_*_exps` cut along their first axis, transformers'
    /// per-expert tensors whole on their expert's device), with the router replicated; the
    /// experts' weighted outputs are partial sums reduced into the residual as the dense MLP's
    /// are. Empty for a dense model; a mixture-of-experts model has no ID table, its MLPs
    /// being its experts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ex: SplitTable,
    /// Where each rank runs, when the request gave a multi-process [`TpWorld`]: rank `r` is
    /// the tables' device `r`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Vec<TpRank>>,
}

/// More ranks than any run has: a guard against a garbled world spec.
pub const MAX_TP_RANKS: usize = 1 << 16;

/// One rank of a multi-process tensor-parallel run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpRank {
    pub rank: usize,
    /// The machine it runs on.
    pub host: String,
    /// Its device on that machine (`cuda:{local_rank}`, as torchrun's `LOCAL_RANK` picks it).
    pub device: String,
    /// The request's accelerator that stands for it (whose capacity the plan used); filled in
    /// by the planner.
    #[serde(default)]
    pub planned_as: String,
}

/// The processes of a tensor-parallel run, one per GPU, in rank order: torchrun's layout,
/// where node `k`'s `n` processes are the ranks after those of the nodes before it and take
/// `cuda:0 .. cuda:{n-1}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpWorld {
    pub ranks: Vec<TpRank>,
}

impl TpWorld {
    /// Parse `host:gpus[,host:gpus...]`, such as `node0:4,node1:4` (eight ranks, 0-3 on
    /// `node0`).
    pub fn parse(spec: &str) -> Result<TpWorld> {
        let bad = |got: String| PlanError::option("world", "host:gpus[,host:gpus...]", got);
        let mut ranks: Vec<TpRank> = Vec::new();
        let mut hosts: Vec<&str> = Vec::new();
        for entry in spec.split(',').map(str::trim) {
            let Some((host, n)) = entry.rsplit_once(':') else {
                return Err(bad(format!("'{entry}' (no ':gpus')")));
            };
            let host = host.trim();
            let n: usize =
                n.trim().parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                    bad(format!("'{entry}' (gpus must be a whole number from 1)"))
                })?;
            if host.is_empty() || hosts.contains(&host) {
                return Err(bad(format!("'{entry}' (an empty or repeated host)")));
            }
            if ranks.len().saturating_add(n) > MAX_TP_RANKS {
                return Err(bad(format!("more than {MAX_TP_RANKS} ranks")));
            }
            hosts.push(host);
            for local in 0..n {
                ranks.push(TpRank {
                    rank: ranks.len(),
                    host: host.to_owned(),
                    device: format!("cuda:{local}"),
                    planned_as: String::new(),
                });
            }
        }
        Ok(TpWorld { ranks })
    }

    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }
}

impl TpSplit {
    pub fn table(&self, kind: TpKind) -> &[(usize, u64, u64)] {
        match kind {
            TpKind::Kv => &self.kv,
            TpKind::Id => &self.id,
            TpKind::Vc => &self.vc,
            TpKind::Rs => &self.rs,
            TpKind::Q => &self.q,
            TpKind::Ex => &self.ex,
        }
    }
}

/// exllamav2's `integer_split(x, split, minimum)`: split `x` in proportion to `split` by largest
/// remainder (ties to the lowest index), then zero every share below `minimum` and hand those
/// units, one at a time, to the smallest non-zero share (lowest index on ties).
///
/// exllamav2 compares float remainders; we compare the exact rationals `x·p mod Σ / Σ`, which
/// only differs where two float remainders would round to equal. Returns an error when every
/// weight is zero (exllamav2 divides by zero there).
pub fn integer_split(x: u64, split: &[u64], minimum: u64) -> Result<Vec<u64>> {
    let sum: u128 = split.iter().map(|&p| u128::from(p)).sum();
    if sum == 0 {
        return Err(PlanError::option(
            "tensor_parallel split",
            "at least one device with room left after the cache and attention weights",
            "no room on any device",
        ));
    }
    let x128 = u128::from(x);
    let mut portions: Vec<u64> = split
        .iter()
        .map(|&p| (x128 * u128::from(p) / sum) as u64)
        .collect();
    // Remainders as numerators over `sum`; decrementing by 1 subtracts `sum`.
    let mut rem: Vec<i128> = split
        .iter()
        .map(|&p| ((x128 * u128::from(p)) % sum) as i128)
        .collect();
    let remaining = x - portions.iter().sum::<u64>();
    for _ in 0..remaining {
        let mut best = 0;
        for (i, r) in rem.iter().enumerate() {
            if *r > rem[best] {
                best = i;
            }
        }
        portions[best] += 1;
        rem[best] -= sum as i128;
    }
    let adjust: u64 = portions.iter().filter(|&&p| p < minimum).sum();
    for p in portions.iter_mut() {
        if *p < minimum {
            *p = 0;
        }
    }
    for _ in 0..adjust {
        let mut min_idx: Option<usize> = None;
        for (i, &p) in portions.iter().enumerate() {
            if p != 0 && min_idx.is_none_or(|m| p < portions[m]) {
                min_idx = Some(i);
            }
        }
        // exllamav2 uses index -1 (the last device) when every share is zero.
        let idx = min_idx.unwrap_or(portions.len() - 1);
        portions[idx] += 1;
    }
    Ok(portions)
}

/// exllamav2's `set_split`: turn shares into `(device, start, end)` ranges, skipping empty ones.
pub fn to_table(shares: &[u64], unit: u64) -> SplitTable {
    let mut b = 0u64;
    let mut out = Vec::new();
    for (d, &s) in shares.iter().enumerate() {
        let a = b;
        b = a.saturating_add(s.saturating_mul(unit));
        if s > 0 {
            out.push((d, a, b));
        }
    }
    out
}

/// Inputs of `define_split`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpInputs {
    /// Per-device budgets in MiB (exllamav2's `gpu_split` × 1024, or free memory in MiB).
    pub budgets_mib: Vec<u64>,
    pub n_kv_heads: u64,
    pub n_heads: u64,
    pub intermediate_size: u64,
    pub hidden_size: u64,
    pub vocab_size: u64,
    /// Bytes of the whole expected cache (all layers, all KV heads).
    pub cache_bytes: u64,
    /// `weight_footprint()` of each attention module, in bytes.
    pub attn_footprints: Vec<u64>,
    /// Routed experts per layer (0: a dense model). A mixture-of-experts model's MLPs are
    /// split by the expert table in place of the ID table.
    pub n_experts: u64,
    /// Whether a mixture-of-experts model also has layers with a dense MLP (a Qwen MoE's
    /// `mlp_only_layers` or `decoder_sparse_step`): those MLPs are split by an ID table, as a
    /// dense model's are, beside the expert table.
    pub dense_layers: bool,
}

/// exllamav2's `TPContext.define_split`:
///
/// 1. KV heads by `integer_split(n_kv_heads, budgets)`; Q = KV × `n_heads / n_kv_heads`.
/// 2. Each device's budget loses its share (`kv_i / n_kv_heads`) of the cache, then of every
///    attention layer's weights, layer by layer, each rounded down to MiB and floored at 0.
/// 3. Intermediate: 128 × `integer_split(inter / 128, budgets, 2)`; residual:
///    32 × `integer_split(hidden / 32, budgets, 8)`; vocab:
///    32 × `integer_split(ceil(vocab / 32), budgets, 16)`.
///
/// A mixture-of-experts model (`n_experts > 0`, which exllamav2's TP does not run) has its
/// experts split whole, `integer_split(n_experts, budgets, 0)` with the budgets of step 3, each
/// device's share a contiguous range of experts; it has an ID table only for its dense layers
/// (`dense_layers`), made as a dense model's.
pub fn define_split(inp: &TpInputs) -> Result<TpSplit> {
    if inp.n_kv_heads == 0 || !inp.n_heads.is_multiple_of(inp.n_kv_heads) {
        return Err(PlanError::option(
            "tensor_parallel",
            "n_heads a multiple of n_kv_heads",
            format!("{} heads, {} kv heads", inp.n_heads, inp.n_kv_heads),
        ));
    }
    let moe = inp.n_experts > 0;
    let dense = !moe || inp.dense_layers;
    if dense && !inp.intermediate_size.is_multiple_of(128) {
        let expected = if moe {
            "an intermediate size divisible by 128 for the dense layers' MLP beside the experts \
             (exllamav2 requires it of a dense MLP)"
        } else {
            "an intermediate size divisible by 128 (exllamav2 requires it)"
        };
        return Err(PlanError::option(
            "tensor_parallel",
            expected,
            inp.intermediate_size,
        ));
    }
    let groups = inp.n_heads / inp.n_kv_heads;
    let kv = integer_split(inp.n_kv_heads, &inp.budgets_mib, 0)?;
    let q: Vec<u64> = kv.iter().map(|s| s * groups).collect();
    let mib = 1u128 << 20;
    let nkv = u128::from(inp.n_kv_heads);
    let mut gs = inp.budgets_mib.clone();
    for (g, &k) in gs.iter_mut().zip(&kv) {
        let sub = u128::from(inp.cache_bytes) * u128::from(k) / nkv / mib;
        *g = g.saturating_sub(u64::try_from(sub).unwrap_or(u64::MAX));
    }
    for &wfp in &inp.attn_footprints {
        for (g, &k) in gs.iter_mut().zip(&kv) {
            let sub = u128::from(wfp) * u128::from(k) / nkv / mib;
            *g = g.saturating_sub(u64::try_from(sub).unwrap_or(u64::MAX));
        }
    }
    let ex = if moe {
        to_table(&integer_split(inp.n_experts, &gs, 0)?, 1)
    } else {
        Vec::new()
    };
    let id = if dense {
        to_table(&integer_split(inp.intermediate_size / 128, &gs, 2)?, 128)
    } else {
        Vec::new()
    };
    let rs = integer_split(inp.hidden_size / 32, &gs, 8)?;
    let vc = integer_split(inp.vocab_size.div_ceil(32), &gs, 16)?;
    Ok(TpSplit {
        kv: to_table(&kv, 1),
        id,
        vc: to_table(&vc, 32),
        rs: to_table(&rs, 32),
        q: to_table(&q, 1),
        ex,
        ranks: None,
    })
}

/// One device's share of every table (0 where the table does not name it), in the tables'
/// units: heads for KV and Q, columns for ID, VC and RS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TpShare {
    pub kv_heads: u64,
    pub q_heads: u64,
    pub inter: u64,
    /// Vocabulary rows, cut at the real vocabulary (the table is padded to 32).
    pub vocab: u64,
    pub residual: u64,
    /// Routed experts (whole ones).
    pub experts: u64,
}

impl TpSplit {
    /// The share of accelerator `device` (an index of the tables), with the vocab table cut at
    /// `vocab_size`.
    pub fn share(&self, device: usize, vocab_size: u64) -> TpShare {
        let width = |t: &[(usize, u64, u64)], cap: u64| {
            t.iter()
                .filter(|x| x.0 == device)
                .map(|&(_, a, b)| b.min(cap).saturating_sub(a.min(cap)))
                .sum::<u64>()
        };
        TpShare {
            kv_heads: width(&self.kv, u64::MAX),
            q_heads: width(&self.q, u64::MAX),
            inter: width(&self.id, u64::MAX),
            vocab: width(&self.vc, vocab_size),
            residual: width(&self.rs, u64::MAX),
            experts: width(&self.ex, u64::MAX),
        }
    }
}

/// The tensor-parallel forward pass's working memory on one accelerator: the [`Workspace`] of
/// a device that computes the heads, MLP columns and vocabulary rows of its share (the
/// all-gathered hidden state in `x`, partial sums in `xn`), then its slice of the residual
/// stream, a receive buffer for the partial sums other devices send it and the sum of those
/// partials (added to the residual once, as one device adds its whole product), `T·rs` values
/// each. A device with experts computes a whole expert's rows where the dense MLP computes its
/// columns: its regions are as wide as the single-device workspace's (the queries and the
/// attention output for the gathered rows and their weighted sums, the MLP's for an expert's
/// gate and up products and the router's scores, the keys and values for the routed rows'
/// indices and weights), which the engine checks against the experts before a token runs.
/// The planner charges these bytes as the device's scratch and the engine carves its buffers
/// by the same layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TpWorkspace {
    pub base: Workspace,
    pub residual: Region,
    pub recv: Region,
    pub sum: Region,
    /// Total bytes.
    pub bytes: u64,
}

impl TpWorkspace {
    /// The layout for a device with `share`, under the model-wide dimensions `d`.
    pub fn new(d: &Dims, share: TpShare) -> TpWorkspace {
        let experts = share.experts > 0;
        let wide = |own: u64, whole: u64| if experts { own.max(whole) } else { own };
        let local = Dims {
            q_dim: wide(share.q_heads.saturating_mul(d.head_dim), d.q_dim),
            kv_dim: wide(share.kv_heads.saturating_mul(d.head_dim), d.kv_dim),
            inter: wide(share.inter, d.inter),
            vocab: share.vocab,
            n_heads: share.q_heads,
            ..*d
        };
        let hosts = Hosts {
            layers: share.kv_heads > 0 || share.inter > 0 || share.residual > 0 || experts,
            head: share.vocab > 0,
            embed: false,
        };
        let base = Workspace::new(&local, hosts);
        let mut at = base.bytes;
        let mut take = |len: u64| {
            let r = Region { offset: at, len };
            at = at.saturating_add(len.saturating_mul(4).next_multiple_of(ALIGN));
            r
        };
        let rows = if base.bytes == 0 { 0 } else { d.tokens };
        let residual = take(rows.saturating_mul(share.residual));
        let recv = take(rows.saturating_mul(share.residual));
        let sum = take(rows.saturating_mul(share.residual));
        TpWorkspace {
            base,
            residual,
            recv,
            sum,
            bytes: at,
        }
    }
}

/// Bytes of each of the two host staging buffers of a tensor-parallel forward pass (exllamav2's
/// pinned temps, used alternately): the largest host-side collective, the hidden state of a
/// whole chunk (`T·h` f32) or a block of logits (`R·V` f32).
pub fn tp_staging_bytes(d: &Dims) -> u64 {
    let values = d
        .tokens
        .saturating_mul(d.hidden)
        .max(d.logit_rows.saturating_mul(d.vocab));
    values.saturating_mul(4).next_multiple_of(ALIGN)
}

//! exllamav2's tensor parallelism: the split tables of `tp::define_split` turned into
//! shards of every attention and MLP matrix and of the head, norms replicated on every TP
//! device, the embedding on the CPU, and each layer's KV cache split by kv heads. A
//! mixture-of-experts model's experts are split whole by the expert table (expert
//! parallelism), its routers replicated.

use weightlift_format::{DType, Role, TensorInfo, expert_of};

use super::{Assign, Ctx, ShardIdx};
use crate::error::{PlanError, Result};
use crate::request::TpOptions;
use crate::tp::{TpInputs, TpRank, TpWorkspace, TpWorld, define_split, tp_staging_bytes};
use crate::window::{layer_cache, total_cache_bytes};
use crate::workspace::{Dims, has_dense_layers};

impl Ctx<'_> {
    /// exllamav2 TPContext: split tables from `define_split`, tensors sharded by them.
    pub(super) fn tensor_parallel(&self, o: &TpOptions) -> Result<Assign> {
        let spec = &self.req.spec;
        if self.accel.is_empty() {
            return Err(PlanError::option(
                "tensor_parallel",
                "at least one cuda or virtual device",
                "none",
            ));
        }
        let budgets = match &o.gpu_split_mib {
            Some(b) if b.len() == self.accel.len() => b.clone(),
            Some(b) => {
                return Err(PlanError::option(
                    "gpu_split",
                    &format!("one budget per accelerator ({})", self.accel.len()),
                    format!("{} budgets", b.len()),
                ));
            }
            None => self
                .accel
                .iter()
                .map(|&d| self.devs[d].room() >> 20)
                .collect(),
        };
        let nkv = spec.n_kv_heads[0];
        if spec.n_kv_heads.iter().any(|&k| k != nkv) {
            return Err(PlanError::option(
                "tensor_parallel",
                "the same number of kv heads in every layer (exllamav2 TP assumes it)",
                "per-layer kv head counts",
            ));
        }
        let attn_roles = |r: Option<Role>| {
            matches!(
                r,
                Some(
                    Role::AttnNorm
                        | Role::AttnQ
                        | Role::AttnQkv
                        | Role::AttnK
                        | Role::AttnV
                        | Role::AttnOutput
                        | Role::AttnQBias
                        | Role::AttnKBias
                        | Role::AttnVBias
                        | Role::AttnOutputBias
                )
            )
        };
        let mut footprints = vec![0u64; self.n_layers()];
        for ((t, &b), &role) in self.tensors().iter().zip(&self.bytes).zip(&self.roles) {
            if let (Some(l), true) = (t.layer, attn_roles(role)) {
                footprints[l as usize] = footprints[l as usize].saturating_add(b);
            }
        }
        let inputs = TpInputs {
            budgets_mib: budgets,
            n_kv_heads: u64::from(nkv),
            n_heads: u64::from(spec.n_heads),
            intermediate_size: spec.intermediate_size,
            hidden_size: spec.hidden_size,
            vocab_size: spec.vocab_size,
            // Offloaded, the devices hold only the prefetch slots of the cache.
            cache_bytes: if self.offload {
                self.offload_slots_estimate()
            } else {
                self.cache
                    .map_or(0, |c| total_cache_bytes(self.req, &c, &self.runtime))
            },
            attn_footprints: footprints,
            n_experts: self.n_experts(),
            dense_layers: has_dense_layers(spec.n_layers, &self.req.tensors),
        };
        let mut tp = define_split(&inputs)?;
        let hd = u64::from(spec.head_dim);
        let acc = |i: usize| self.accel[i];
        if let Some(world) = &self.req.world {
            tp.ranks = Some(self.ranks(world)?);
        }
        let scale = |t: &[(usize, u64, u64)], m: u64| -> Vec<(usize, u64, u64)> {
            t.iter()
                .map(|&(d, a, b)| (acc(d), a.saturating_mul(m), b.saturating_mul(m)))
                .collect()
        };
        let q = scale(&tp.q, hd);
        let kv = scale(&tp.kv, hd);
        let id = scale(&tp.id, 1);
        let vc = scale(&tp.vc, 1);
        let ex = scale(&tp.ex, 1);
        let mut all: Vec<usize> = q
            .iter()
            .chain(&kv)
            .chain(&id)
            .chain(&vc)
            .chain(&ex)
            .map(|x| x.0)
            .collect();
        all.sort_unstable();
        all.dedup();
        let first = all.first().copied().unwrap_or(self.accel[0]);
        let mut a = self.empty_assign();
        let (q_rows, kv_rows) = (u64::from(spec.n_heads) * hd, u64::from(nkv) * hd);
        let inter = spec.intermediate_size;
        for (i, t) in self.tensors().iter().enumerate() {
            let b = self.bytes[i];
            // A stacked matrix (phi3's qkv, gate|up) is cut block by block, each block's rows
            // by its own table: a device's part of it is several row ranges, one shard each,
            // in row order (so the shards laid end to end are the tensor).
            let blocks: &[Block<'_>] = match self.roles[i] {
                Some(Role::AttnQkv) => &[(&q, q_rows), (&kv, kv_rows), (&kv, kv_rows)],
                Some(Role::FfnGateUp) => &[(&id, inter), (&id, inter)],
                _ => &[],
            };
            let total: u64 = blocks.iter().map(|x| x.1).sum();
            if !blocks.is_empty() && t.shape.len() == 2 && t.shape.first() == Some(&total) {
                let mut shards = Vec::new();
                let mut first_row = 0u64;
                for &(table, rows) in blocks {
                    let block = (u128::from(b) * u128::from(rows) / u128::from(total)) as u64;
                    for (d, s, e, bytes) in shard_bytes(table, rows, block) {
                        shards.push((d, first_row + s, first_row + e, bytes));
                    }
                    first_row += rows;
                }
                a.tensor_dev[i] = shards.first().map_or(first, |x| x.0);
                a.splits[i] = Some((0, false, shards));
                continue;
            }
            let (table, axis): (&[(usize, u64, u64)], u8) = match self.roles[i] {
                Some(Role::AttnQ | Role::AttnQBias) => (&q, 0),
                Some(Role::AttnK | Role::AttnV | Role::AttnKBias | Role::AttnVBias) => (&kv, 0),
                Some(Role::AttnOutput) => (&q, 1),
                Some(Role::FfnGate | Role::FfnUp) => (&id, 0),
                Some(Role::FfnDown) => (&id, 1),
                Some(Role::Output) => (&vc, 0),
                Some(Role::FfnGateExps | Role::FfnUpExps | Role::FfnDownExps) => {
                    match expert_of(&t.name) {
                        // transformers' own tensor of expert `e`: whole on its device
                        Some(e) => {
                            let e = u64::from(e);
                            let Some(&(d, _, _)) = ex.iter().find(|x| x.1 <= e && e < x.2) else {
                                return Err(PlanError::Tensor {
                                    tensor: t.name.clone(),
                                    detail: format!(
                                        "expert {e} is beyond the expert table's {} experts",
                                        tp.ex.last().map_or(0, |x| x.2)
                                    ),
                                });
                            };
                            let rows = t.shape.first().copied().unwrap_or(0);
                            a.tensor_dev[i] = d;
                            a.splits[i] = Some((0, false, vec![(d, 0, rows, b)]));
                            continue;
                        }
                        // GGUF's stacked `[experts, rows, columns]`: cut along the experts
                        None => {
                            let dim = t.shape.first().copied().unwrap_or(0);
                            a.tensor_dev[i] = ex.first().map_or(first, |x| x.0);
                            a.splits[i] = Some((0, false, shard_bytes(&ex, dim, b)));
                            continue;
                        }
                    }
                }
                Some(Role::TokenEmbd | Role::RopeFreqs | Role::RopeFactors)
                    if t.layer.is_none() =>
                {
                    a.tensor_dev[i] = self.host;
                    continue;
                }
                _ => {
                    // Norms and anything unrecognised are replicated on every TP device.
                    let shards = all.iter().map(|&d| (d, 0, 1, b)).collect();
                    a.tensor_dev[i] = first;
                    a.splits[i] = Some((0, true, shards));
                    continue;
                }
            };
            let dim = if axis == 0 {
                t.shape.first().copied().unwrap_or(0)
            } else {
                t.shape.last().copied().unwrap_or(0)
            };
            if dim == 0 || t.shape.len() > 2 {
                // Not a shape the tables describe: keep it whole on the first TP device.
                a.tensor_dev[i] = first;
                continue;
            }
            a.tensor_dev[i] = table.first().map_or(first, |x| x.0);
            let shards = shard_bytes(table, dim, b);
            // Only shards quantised on load are checked here; a checkpoint stored in blocks is
            // refused by the loader when its cut falls inside one, as before quantize= existed.
            if axis == 1 && self.dtypes[i] != t.dtype {
                whole_blocks(t, self.dtypes[i], &shards, dim)?;
            }
            a.splits[i] = Some((axis, false, shards));
        }
        for l in 0..self.n_layers() {
            a.layer_dev[l] = first;
            if let Some(c) = &self.cache {
                let c = layer_cache(c, self.window, l, &self.runtime);
                a.kv_dev[l] = tp
                    .kv
                    .iter()
                    .map(|&(d, s, e)| (acc(d), c.bytes_for_heads(spec, e - s)))
                    .collect();
            }
        }
        for &d in &all {
            a.hosts[d].layers = true;
        }
        a.shared_layers = all.clone();
        for &(d, _, _) in &vc {
            a.hosts[d].head = true;
        }
        a.embed_dev = self.host;
        a.hosts[self.host].embed = true;
        a.head_dev = vc.first().map_or(first, |x| x.0);
        if self.tied_bytes > 0 {
            let rows = spec.vocab_size;
            a.tied_copy = shard_bytes(&vc, rows, self.tied_bytes)
                .into_iter()
                .map(|(d, _, _, b)| (d, b))
                .collect();
        }
        a.scratch = Some(self.tp_scratch(&tp));
        a.tp = Some(tp);
        Ok(a)
    }
}

impl Ctx<'_> {
    /// The routed experts per layer of a mixture-of-experts checkpoint (0: dense), from its
    /// expert tensors: the first axis of GGUF's stacked `ffn_*_exps`, or one past the highest
    /// expert index of transformers' per-expert tensors.
    fn n_experts(&self) -> u64 {
        let exps = |r: Option<Role>| {
            matches!(
                r,
                Some(Role::FfnGateExps | Role::FfnUpExps | Role::FfnDownExps)
            )
        };
        self.tensors()
            .iter()
            .zip(&self.roles)
            .filter(|(_, r)| exps(**r))
            .map(|(t, _)| match expert_of(&t.name) {
                Some(e) => u64::from(e) + 1,
                None if t.shape.len() == 3 => t.shape[0],
                None => 0,
            })
            .max()
            .unwrap_or(0)
    }

    /// The world's ranks, each standing for the accelerator of the same index (its capacity
    /// is that rank's budget).
    fn ranks(&self, world: &TpWorld) -> Result<Vec<TpRank>> {
        if world.world_size() != self.accel.len() {
            return Err(PlanError::option(
                "world",
                &format!(
                    "one rank per accelerator of the device list ({}), each giving that \
                     rank's capacity",
                    self.accel.len()
                ),
                format!("{} ranks", world.world_size()),
            ));
        }
        Ok(world
            .ranks
            .iter()
            .zip(&self.accel)
            .map(|(r, &d)| TpRank {
                planned_as: self.devs[d].name.clone(),
                ..r.clone()
            })
            .collect())
    }

    /// Per-device scratch of the tensor-parallel forward pass: each accelerator its
    /// [`TpWorkspace`], the host the two staging buffers the collectives go through (the host
    /// computes only the embedding lookup, into a staging buffer).
    fn tp_scratch(&self, tp: &crate::tp::TpSplit) -> Vec<u64> {
        let spec = &self.req.spec;
        let (seq, batch) = self
            .cache
            .map_or((self.runtime.max_input_len.max(1), 1), |c| {
                (c.max_seq_len, c.batch_size)
            });
        let dense = has_dense_layers(spec.n_layers, &self.req.tensors);
        let dims =
            Dims::new(spec, &self.runtime, seq, batch).with_experts(self.req.moe.as_ref(), dense);
        let mut out = vec![0u64; self.devs.len()];
        if dims.tokens == 0 {
            return out;
        }
        for (i, &d) in self.accel.iter().enumerate() {
            out[d] = TpWorkspace::new(&dims, tp.share(i, spec.vocab_size)).bytes;
        }
        out[self.host] = tp_staging_bytes(&dims).saturating_mul(2);
        out
    }
}

/// Refuse column shards of `t` (held as `dtype`) that cut inside a block: each row's blocks
/// are whole values runs, so a shard starting or ending mid-block would share a block (and its
/// scale) with its neighbour. The TP tables cut the output projection at whole heads and the
/// down projection at multiples of 128, which Q8_0's 32-value blocks always meet and the
/// 256-value K-quants meet only for some head counts and splits.
fn whole_blocks(t: &TensorInfo, dtype: DType, shards: &[ShardIdx], dim: u64) -> Result<()> {
    let block = dtype.block_size();
    let inside = |c: u64| c != 0 && c != dim && !c.is_multiple_of(block);
    let cut = shards
        .iter()
        .flat_map(|&(_, s, e, _)| [s, e.min(dim)])
        .find(|&c| inside(c));
    match cut {
        Some(cut) => Err(PlanError::Tensor {
            tensor: t.name.clone(),
            detail: format!(
                "tensor parallelism cuts its {dim} columns at column {cut}, inside a \
                 {block}-value block of {dtype}; a column shard must be whole blocks (the split \
                 tables cut at whole heads and at multiples of 128: pick a type with smaller \
                 blocks such as q8_0, or a device count that cuts on {block}-value boundaries)"
            ),
        }),
        None => Ok(()),
    }
}

/// A block of a stacked matrix: the table that cuts its rows, and how many rows it has.
type Block<'t> = (&'t [(usize, u64, u64)], u64);

/// Shard `bytes` of a tensor whose split dimension has `dim` entries by `table`
/// (`(device, start, end)` in that dimension, possibly padded past `dim`). The last shard takes
/// any rounding remainder so the shards sum to `bytes`.
fn shard_bytes(table: &[(usize, u64, u64)], dim: u64, bytes: u64) -> Vec<ShardIdx> {
    let mut out = Vec::with_capacity(table.len());
    let mut given = 0u64;
    let live: Vec<&(usize, u64, u64)> = table.iter().filter(|x| x.1 < dim).collect();
    for (k, &&(d, s, e)) in live.iter().enumerate() {
        let e = e.min(dim);
        let b = if k + 1 == live.len() {
            bytes - given
        } else {
            (u128::from(bytes) * u128::from(e - s) / u128::from(dim.max(1))) as u64
        };
        given = given.saturating_add(b);
        out.push((d, s, e, b));
    }
    out
}

#[cfg(test)]
mod tests {
    use weightlift_format::ModelSpec;

    use crate::request::{Strategy, TpOptions};
    use crate::tp::TpWorld;
    use crate::{PlanRequest, WeightType, parse_devices, plan, synthesize_tensors};

    /// SmolLM2-135M's shape: 3 kv heads, so up to three ranks get heads.
    fn smollm2() -> ModelSpec {
        crate::workspace::tests::spec()
    }

    fn tp_request(devices: &str, world: Option<&str>) -> PlanRequest {
        let spec = smollm2();
        let tensors = synthesize_tensors(&spec, WeightType::parse("q4_1").unwrap(), None).unwrap();
        let mut req = PlanRequest::new(spec, tensors, parse_devices(devices).unwrap());
        req.strategy = Strategy::TensorParallel(TpOptions::default());
        req.world = world.map(|w| TpWorld::parse(w).unwrap());
        req
    }

    #[test]
    fn a_world_names_each_ranks_host_and_device() {
        let p = plan(&tp_request("virtual:3x1GiB", Some("node0:2,node1:1"))).unwrap();
        let ranks = p.tp_ranks().unwrap();
        let got: Vec<(usize, &str, &str, &str)> = ranks
            .iter()
            .map(|r| {
                (
                    r.rank,
                    r.host.as_str(),
                    r.device.as_str(),
                    r.planned_as.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (0, "node0", "cuda:0", "virtual:0"),
                (1, "node0", "cuda:1", "virtual:1"),
                (2, "node1", "cuda:0", "virtual:2"),
            ]
        );
        let text = p.explain();
        assert!(text.contains("ranks (3, one process per gpu):"), "{text}");
        assert!(
            text.contains("rank   2  node1 cuda:0  (planned as virtual:2)"),
            "{text}"
        );
        // Without a world the plan is one process's, and says nothing of ranks.
        let single = plan(&tp_request("virtual:3x1GiB", None)).unwrap();
        assert!(single.tp_ranks().is_none());
        assert!(!single.explain().contains("ranks ("));
        // The world names the ranks; it does not move the split.
        let mut tables = p.tp().unwrap().clone();
        tables.ranks = None;
        assert_eq!(single.tp(), Some(&tables));
    }

    #[test]
    fn a_world_must_match_the_accelerators() {
        let e = plan(&tp_request("virtual:2x1GiB", Some("node0:2,node1:1")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("one rank per accelerator of the device list (2)") && e.contains("3 ranks"),
            "{e}"
        );
    }

    /// tiny-llama's shape: 4 heads of 64 over 2 kv heads, a 768-wide MLP, bf16 weights.
    fn tiny_llama(quantize: crate::Quantize) -> PlanRequest {
        let spec = ModelSpec {
            architecture: "llama".into(),
            n_layers: 2,
            hidden_size: 256,
            intermediate_size: 768,
            n_heads: 4,
            n_kv_heads: vec![2; 2],
            head_dim: 64,
            vocab_size: 32000,
            context_length: 2048,
            rope_theta: 10000.0,
            rope_dim: 64,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            attention_bias: false,
        };
        let tensors =
            synthesize_tensors(&spec, WeightType::parse("bfloat16").unwrap(), None).unwrap();
        let mut req = PlanRequest::new(spec, tensors, parse_devices("virtual:2x1GiB").unwrap());
        req.strategy = Strategy::TensorParallel(TpOptions::default());
        req.quantize = Some(quantize);
        req
    }

    /// phi3's stacked matrices: `attn_qkv` cut block by block (each device its q heads' rows,
    /// then its kv heads' k rows, then their v rows) and `ffn_up` holding gate and up likewise,
    /// one shard per block in row order; each shard's bytes are its rows', and every device's
    /// weights in the plan are the sum of its shards.
    #[test]
    fn stacked_matrices_are_cut_block_by_block() {
        let mut req = tiny_llama(crate::Quantize::Q8_0);
        req.spec.architecture = "phi3".into();
        req.tensors =
            synthesize_tensors(&req.spec, WeightType::parse("bfloat16").unwrap(), None).unwrap();
        req.quantize = None;
        let p = plan(&req).unwrap();
        let shards = |name: &str| -> Vec<(String, u64, u64, u64)> {
            let t = p.tensors.iter().find(|t| t.name == name).unwrap();
            let split = t.split.as_ref().unwrap();
            assert!(!split.replicated && split.axis == 0, "{name}");
            let got: Vec<_> = split
                .shards
                .iter()
                .map(|s| (s.device.clone(), s.start, s.end, s.bytes))
                .collect();
            assert_eq!(got.iter().map(|s| s.3).sum::<u64>(), t.bytes, "{name}");
            got
        };
        let v = |d: &str| d.to_owned();
        // bf16 rows of 256 columns: 512 bytes each
        let row = 512;
        assert_eq!(
            shards("blk.0.attn_qkv.weight"),
            vec![
                (v("virtual:0"), 0, 128, 128 * row),
                (v("virtual:1"), 128, 256, 128 * row),
                (v("virtual:0"), 256, 320, 64 * row),
                (v("virtual:1"), 320, 384, 64 * row),
                (v("virtual:0"), 384, 448, 64 * row),
                (v("virtual:1"), 448, 512, 64 * row),
            ]
        );
        let up = shards("blk.0.ffn_up.weight");
        let cuts: Vec<(u64, u64)> = up.iter().map(|s| (s.1, s.2)).collect();
        let id = &p.tp().unwrap().id;
        let half: Vec<(u64, u64)> = id.iter().map(|e| (e.1, e.2)).collect();
        let mut want = half.clone();
        want.extend(half.iter().map(|&(a, b)| (768 + a, 768 + b)));
        assert_eq!(cuts, want);
    }

    #[test]
    fn ggml_quantize_shards_in_the_quantised_type() {
        let p = plan(&tiny_llama(crate::Quantize::Q8_0)).unwrap();
        let t = p
            .tensors
            .iter()
            .find(|t| t.name == "blk.0.attn_output.weight")
            .unwrap();
        // 256 rows of 256 columns cut at column 128 (two heads of 64): 4 Q8_0 blocks of 34
        // bytes per row on each side.
        assert_eq!(t.dtype, weightlift_format::DType::Q8_0);
        let split = t.split.as_ref().unwrap();
        let got: Vec<(u64, u64, u64)> = split
            .shards
            .iter()
            .map(|s| (s.start, s.end, s.bytes))
            .collect();
        assert_eq!(got, vec![(0, 128, 256 * 4 * 34), (128, 256, 256 * 4 * 34)]);
    }

    #[test]
    fn a_cut_inside_a_block_and_int8_are_refused() {
        let e = plan(&tiny_llama(crate::Quantize::Q4K))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blk.0.attn_output.weight")
                && e.contains("column 128")
                && e.contains("256-value block of Q4_K"),
            "{e}"
        );
        let e = plan(&tiny_llama(crate::Quantize::Int8))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("quantize=int8 with tensor_parallel") && e.contains("outlier columns"),
            "{e}"
        );
    }

    #[test]
    fn world_specs_parse_in_torchrun_order() {
        let w = TpWorld::parse("a:1, b.example:2").unwrap();
        let names: Vec<String> = w
            .ranks
            .iter()
            .map(|r| format!("{}={}/{}", r.rank, r.host, r.device))
            .collect();
        assert_eq!(
            names,
            ["0=a/cuda:0", "1=b.example/cuda:0", "2=b.example/cuda:1"]
        );
        for (bad, why) in [
            ("node0", "no ':gpus'"),
            ("node0:0", "whole number from 1"),
            ("node0:x", "whole number from 1"),
            (":2", "empty or repeated host"),
            ("a:1,a:1", "empty or repeated host"),
            ("a:70000", "more than 65536 ranks"),
        ] {
            let e = TpWorld::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("expected host:gpus[,host:gpus...]") && e.contains(why),
                "{bad}: {e}"
            );
        }
    }
}

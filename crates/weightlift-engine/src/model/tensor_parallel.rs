//! Tensor parallelism: exllamav2's `load_tp` placement (each role cut by its split table) and
//! the [`TpContext`] a loaded `tensor_parallel` plan runs through.

use std::sync::{Arc, Mutex};

use weightlift_format::{Role, TensorInfo};

use super::{ForwardPlan, Model, Placement, RankPlace, SplitSpec, TensorPlace};
use crate::device::Device;
use crate::error::{EngineError, Result, invalid};
use crate::tp::{
    BROADCAST_ID, BROADCAST_KV, BROADCAST_Q, HostStaged, SplitTable, Splits, TpContext,
};

/// How a TP-loaded tensor is cut (exllamav2's `load_tp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Rows `a·unit .. b·unit` of table `t` on each device.
    Rows { table: usize, unit: u64 },
    /// Columns `a·unit .. b·unit` of table `t` on each device.
    Cols { table: usize, unit: u64 },
    /// A full copy on every device of the KV, ID, expert and VC tables.
    Replicate,
    /// A routed expert's weights, by the expert table: GGUF's stacked `[experts, rows,
    /// columns]` cut along the experts, transformers' tensor of one expert whole on its device.
    Experts,
}

impl Model {
    /// The tensor-parallel context the forward pass runs through, once loaded with a
    /// `tensor_parallel` plan: shared, so the bindings' `Model.tp` is this very context.
    pub fn tp_context_shared(&self) -> Option<Arc<Mutex<TpContext>>> {
        self.state.as_ref().and_then(|s| s.tp.clone())
    }

    /// The cache's split by the kv table: `(device, first head, end head)`.
    pub(super) fn tp_cache_parts(&self, splits: &Splits) -> Result<Vec<(Arc<Device>, u32, u32)>> {
        let accel = self.inventory.accelerators();
        splits
            .kv
            .iter()
            .map(|&(d, a, b)| {
                let dev = accel.get(d).ok_or_else(|| {
                    invalid("tp kv table device", format!("below {}", accel.len()), d)
                })?;
                Ok((Arc::clone(dev), a as u32, b as u32))
            })
            .collect()
    }

    /// The kv heads a rank-local load holds, on its device (`None`: the rank has none).
    pub(super) fn tp_cache_share(
        &self,
        splits: &Splits,
        rank: &RankPlace,
    ) -> Result<Option<(Arc<Device>, u32, u32)>> {
        match splits.kv.iter().find(|e| e.0 == rank.rank) {
            Some(&(_, a, b)) => Ok(Some((self.resolve(&rank.device)?, a as u32, b as u32))),
            None => Ok(None),
        }
    }

    /// The table devices of a context: the accelerators, or for a rank-local load its device
    /// at its rank and [`Device::elsewhere`] stand-ins for the others.
    fn tp_devices(&self, rank: Option<&RankPlace>) -> Result<Vec<Arc<Device>>> {
        match rank {
            None => Ok(self.inventory.accelerators().to_vec()),
            Some(r) => (0..r.world_size)
                .map(|i| {
                    if i == r.rank {
                        self.resolve(&r.device)
                    } else {
                        Ok(Device::elsewhere(i))
                    }
                })
                .collect(),
        }
    }

    /// exllamav2's TPContext for a loaded plan: the plan's tables over the accelerators,
    /// host-staged collectives, each accelerator's scratch as the plan reserved it
    /// ([`weightlift_plan::TpWorkspace`]) and the two staging buffers of
    /// [`weightlift_plan::tp_staging_bytes`] on the host.
    pub(super) fn tp_context(
        &self,
        splits: &Splits,
        f: &ForwardPlan,
        planned: &[(String, u64)],
    ) -> Result<TpContext> {
        let spec = self.source.spec().ok_or_else(|| EngineError::Unsupported {
            what: "tensor-parallel loading".into(),
            detail: "the checkpoint's architecture could not be read".into(),
        })?;
        let accel = self.tp_devices(f.rank.as_ref())?;
        let rope = crate::tp::Rope {
            theta: spec.rope_theta,
            dim: spec.rope_dim,
            head_dim: spec.head_dim,
            max_seq_len: f.max_seq_len,
        };
        let mut ctx = TpContext::new(splits.clone(), accel.clone(), rope, Box::new(HostStaged))?;
        ctx.set_rank(f.rank.as_ref().map(|r| r.rank))?;
        let dims = weightlift_plan::Dims::new(spec, &f.runtime, f.max_seq_len, f.batch);
        if dims.tokens > 0 {
            ctx.finalize(
                self.inventory.cpu(),
                weightlift_plan::tp_staging_bytes(&dims),
            )?;
        }
        let scratch: Vec<u64> = accel
            .iter()
            .map(|d| {
                planned
                    .iter()
                    .find(|(n, _)| n == d.name())
                    .map_or(0, |x| x.1)
            })
            .collect();
        ctx.reserve_scratch(&scratch)?;
        Ok(ctx)
    }

    /// The placement of exllamav2's `load_tp` for `splits`: Q/K/V rows and the output
    /// projection's columns by the Q/KV tables, the MLP by the ID table (routed experts whole
    /// by the expert table), the embedding and head by the VC table; norms and routers are
    /// replicated on every device of the tables. Table device indices name the inventory's
    /// accelerators.
    pub fn tp_placement(&self, splits: &Splits) -> Result<Placement> {
        let spec = self.source.spec().ok_or_else(|| EngineError::Unsupported {
            what: "tensor-parallel loading".into(),
            detail: "the checkpoint's architecture could not be read".into(),
        })?;
        let hd = u64::from(spec.head_dim);
        let accel = self.inventory.accelerators();
        let name = |d: usize| -> Result<String> {
            accel
                .get(d)
                .map(|x| x.name().to_owned())
                .ok_or_else(|| invalid("tp device index", format!("below {}", accel.len()), d))
        };
        // a replica on every device that computes with it (the plan's rule)
        let mut everywhere: SplitTable = [&splits.kv, &splits.id, &splits.ex, &splits.vc]
            .into_iter()
            .flatten()
            .map(|&(d, _, _)| (d, 0, 1))
            .collect();
        everywhere.sort_unstable();
        everywhere.dedup();
        let mut tensors = Vec::new();
        let (nh, nkv) = (u64::from(spec.n_heads), u64::from(spec.n_kv_heads_at(0)));
        let inter = spec.intermediate_size;
        for info in self.source.tensors() {
            // A stacked matrix (phi3's qkv, gate|up): each block's rows cut by its own table,
            // a device's part one shard per block, in row order.
            let blocks: &[(usize, u64, u64)] = match info.role {
                Some(Role::AttnQkv) => &[
                    (BROADCAST_Q, nh, hd),
                    (BROADCAST_KV, nkv, hd),
                    (BROADCAST_KV, nkv, hd),
                ],
                Some(Role::FfnGateUp) => &[(BROADCAST_ID, inter, 1), (BROADCAST_ID, inter, 1)],
                _ => &[],
            };
            if !blocks.is_empty() {
                let mut shards = Vec::new();
                let mut first_row = 0u64;
                for &(t, len, unit) in blocks {
                    for &(d, a, b) in splits.get(t)? {
                        let (s, e) = ((a * unit).min(len * unit), (b * unit).min(len * unit));
                        shards.push((name(d)?, first_row + s, first_row + e));
                    }
                    first_row += len * unit;
                }
                tensors.push(TensorPlace {
                    device: shards
                        .first()
                        .map_or_else(|| "cpu".to_owned(), |s| s.0.clone()),
                    dtype: info.dtype,
                    split: Some(SplitSpec {
                        axis: 0,
                        replicated: false,
                        shards,
                    }),
                });
                continue;
            }
            let cut = tp_cut(info, hd);
            let one: SplitTable;
            let (table, axis, unit, replicated): (&SplitTable, u8, u64, bool) =
                match cut {
                    Cut::Rows { table, unit } => (splits.get(table)?, 0, unit, false),
                    Cut::Cols { table, unit } => (splits.get(table)?, 1, unit, false),
                    Cut::Replicate => (&everywhere, 0, 1, true),
                    Cut::Experts => match weightlift_format::expert_of(&info.name) {
                        Some(e) => {
                            let e = u64::from(e);
                            let d = splits.ex.iter().find(|x| x.1 <= e && e < x.2).ok_or_else(
                                || {
                                    invalid(
                                        format!("expert {e} of '{}'", info.name),
                                        "an expert of the tp expert table",
                                        format!("{:?}", splits.ex),
                                    )
                                },
                            )?;
                            let rows = info.shape.first().copied().unwrap_or(0);
                            one = vec![(d.0, 0, rows)];
                            (&one, 0, 1, false)
                        }
                        None => (&splits.ex, 0, 1, false),
                    },
                };
            let axis = if info.shape.len() == 1 { 0 } else { axis };
            let len = if axis == 0 {
                info.shape.first().copied().unwrap_or(0)
            } else {
                info.shape.last().copied().unwrap_or(0)
            };
            let mut shards = Vec::new();
            for &(d, a, b) in table {
                let (s, e) = if replicated {
                    (0, len)
                } else {
                    ((a * unit).min(len), (b * unit).min(len))
                };
                shards.push((name(d)?, s, e));
            }
            let device = shards
                .first()
                .map_or_else(|| "cpu".to_owned(), |s| s.0.clone());
            tensors.push(TensorPlace {
                device,
                dtype: info.dtype,
                split: Some(SplitSpec {
                    axis,
                    replicated,
                    shards,
                }),
            });
        }
        let kv_dev = splits
            .kv
            .first()
            .map_or(Ok("cpu".to_owned()), |&(d, _, _)| name(d))?;
        Ok(Placement {
            tensors,
            layers: vec![kv_dev; spec.n_layers as usize],
            copies: Vec::new(),
            scratch: Vec::new(),
            forward: None,
            onload: None,
        })
    }
}

/// exllamav2's TP cut of each role.
pub fn tp_cut(info: &TensorInfo, head_dim: u64) -> Cut {
    use crate::tp::{BROADCAST_ID, BROADCAST_KV, BROADCAST_Q, BROADCAST_VC};
    match info.role {
        Some(Role::AttnQ | Role::AttnQBias) => Cut::Rows {
            table: BROADCAST_Q,
            unit: head_dim,
        },
        Some(Role::AttnK | Role::AttnV | Role::AttnKBias | Role::AttnVBias) => Cut::Rows {
            table: BROADCAST_KV,
            unit: head_dim,
        },
        Some(Role::AttnOutput) => Cut::Cols {
            table: BROADCAST_Q,
            unit: head_dim,
        },
        Some(Role::FfnGate | Role::FfnUp) => Cut::Rows {
            table: BROADCAST_ID,
            unit: 1,
        },
        Some(Role::FfnDown) => Cut::Cols {
            table: BROADCAST_ID,
            unit: 1,
        },
        Some(Role::FfnGateExps | Role::FfnUpExps | Role::FfnDownExps) => Cut::Experts,
        Some(Role::TokenEmbd | Role::Output) => Cut::Rows {
            table: BROADCAST_VC,
            unit: 1,
        },
        _ => Cut::Replicate,
    }
}

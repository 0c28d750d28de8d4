//! Where every tensor goes: the Plan reduced to what the loader needs.

use weightlift_format::DType;

use crate::source::Source;
use crate::tp::Splits;

/// How a tensor is spread over several devices (tensor parallelism, llama.cpp's row split).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitSpec {
    /// 0: rows (the first numpy axis), 1: columns (the last).
    pub axis: u8,
    /// Every shard is a full copy (norms under tensor parallelism).
    pub replicated: bool,
    /// `(device name, start, end)` along the axis.
    pub shards: Vec<(String, u64, u64)>,
}

/// Where one tensor goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlace {
    /// `"cpu"`, `"virtual:1"`, `"cuda:0"` or `"disk"` (the main device of a split tensor).
    pub device: String,
    /// The dtype to hold it in (the stored one, or F16 for a conversion).
    pub dtype: DType,
    pub split: Option<SplitSpec>,
}

/// Where every tensor goes: the Plan, reduced to what the loader needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Per tensor, in checkpoint order.
    pub tensors: Vec<TensorPlace>,
    /// Per layer: the device name.
    pub layers: Vec<String>,
    /// Extra copies: `(tensor index, where)`: a tied output head beside the last layer, or split
    /// by the vocab table under tensor parallelism.
    pub copies: Vec<(usize, TensorPlace)>,
    /// Compute scratch to reserve per device, in bytes: each device's forward workspace.
    pub scratch: Vec<(String, u64)>,
    /// The runtime and cache shape the scratch was planned for (`None`: no scratch was
    /// planned; the first forward pass allocates each workspace for the attached cache).
    pub forward: Option<ForwardPlan>,
    /// Offloaded execution: the layers whose weights stay on cpu or disk and are copied to
    /// the device in `layers` before they run (`layers` names where each layer computes).
    pub onload: Option<weightlift_plan::OnloadPlan>,
}

/// What a plan sized the forward workspaces for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardPlan {
    pub runtime: weightlift_plan::RuntimeSpec,
    pub max_seq_len: u64,
    pub batch: u64,
    /// Tensor parallelism: the plan's split tables (device indices count the accelerators).
    /// The load then splits the cache by kv heads and builds the [`TpContext`] the forward
    /// pass runs through.
    pub tp: Option<Splits>,
    /// A multi-process tensor-parallel load: the one rank this process holds and computes.
    pub rank: Option<RankPlace>,
}

/// One process's share of a multi-process tensor-parallel plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlace {
    /// The rank: the split tables' device index.
    pub rank: usize,
    /// Ranks in the run: the plan's accelerators.
    pub world_size: usize,
    /// The device this process holds the rank's parts on (`cuda:{local_rank}`).
    pub device: String,
}

impl Placement {
    /// Every tensor on one device in its stored dtype.
    pub fn all_on(source: &dyn Source, device: &str, n_layers: u32) -> Placement {
        Placement {
            tensors: source
                .tensors()
                .iter()
                .map(|t| TensorPlace {
                    device: device.to_owned(),
                    dtype: t.dtype,
                    split: None,
                })
                .collect(),
            layers: vec![device.to_owned(); n_layers as usize],
            copies: Vec::new(),
            scratch: Vec::new(),
            forward: None,
            onload: None,
        }
    }
}

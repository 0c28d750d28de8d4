//! Offloaded execution, as accelerate's `cpu_offload` and diffusers' group offloading do it:
//! layers whose weights stay on `cpu` or `disk` execute on the main accelerator (the first one
//! listed). Their matrices are copied into onload slots there before they run:
//!
//! - `sequential`: one layer at a time into one slot, synchronously;
//! - `group`: `blocks_per_group` layers at a time; with `prefetch`, two slots, the next group
//!   copied by a background copier while the current one computes (one slot when there is a
//!   single group); without, one slot and synchronous copies.
//!
//! The slots are counted in the execution device's scratch column, so the plan's figure is
//! what the forward pass holds. An offloaded layer's KV cache and compute workspace are on the
//! execution device too (where it computes), as transformers keeps them.

use serde::{Deserialize, Serialize};
use weightlift_format::{TensorInfo, is_packed_product_part, is_quantized_part};

use crate::error::{PlanError, Result};

/// Whether the forward pass copies tensor `t` of an offloaded layer into its onload slot: the
/// layer's matrices (its 2-D float and ggml weights, and a MoE layer's 3-D stacked experts) and, of a packed (GPTQ, EXL2) linear, the
/// parts its product reads ([`is_packed_product_part`]). Norms and biases are read once into
/// host memory, and the packed linears' index tables when the checkpoint opened; none of them
/// is copied.
pub fn copied_to_slot(t: &TensorInfo) -> bool {
    if is_quantized_part(&t.name) {
        is_packed_product_part(&t.name)
    } else {
        // a MoE layer's stacked experts (GGUF's 3-D `ffn_*_exps`) are matrices too
        matches!(t.shape.len(), 2 | 3)
    }
}

/// How layers kept on `cpu`/`disk` execute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightOffload {
    /// One layer at a time, copied in right before it runs, no prefetch.
    Sequential,
    /// `blocks_per_group` layers at a time, the next group prefetched when `prefetch`.
    Group {
        blocks_per_group: u32,
        prefetch: bool,
    },
}

impl WeightOffload {
    /// `offload=None | "sequential" | "group"` with its two companions, as the Python
    /// loaders take them. `blocks_per_group` and `prefetch` only mean something for `group`.
    pub fn parse(
        mode: Option<&str>,
        blocks_per_group: u32,
        prefetch: bool,
    ) -> Result<Option<Self>> {
        let Some(mode) = mode else {
            return Ok(None);
        };
        match mode.trim().to_ascii_lowercase().as_str() {
            "sequential" => Ok(Some(WeightOffload::Sequential)),
            "group" if blocks_per_group == 0 => Err(PlanError::option(
                "blocks_per_group",
                "at least 1 layer per group",
                "0".to_string(),
            )),
            "group" => Ok(Some(WeightOffload::Group {
                blocks_per_group,
                prefetch,
            })),
            other => Err(PlanError::option(
                "offload",
                "None, \"sequential\" or \"group\"",
                format!("'{other}'"),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightOffload::Sequential => "sequential",
            WeightOffload::Group { .. } => "group",
        }
    }

    fn group_len(self) -> usize {
        match self {
            WeightOffload::Sequential => 1,
            WeightOffload::Group {
                blocks_per_group, ..
            } => blocks_per_group as usize,
        }
    }

    fn prefetch(self) -> bool {
        matches!(self, WeightOffload::Group { prefetch: true, .. })
    }
}

/// What the plan decided: which layers visit which device, in which groups, and the slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OnloadPlan {
    pub mode: WeightOffload,
    /// The device the offloaded layers execute on.
    pub device: String,
    /// The offloaded layers, in execution order, cut into groups.
    pub groups: Vec<Vec<u32>>,
    /// Bytes of one slot: the largest group's copied tensors.
    pub slot_bytes: u64,
    /// 1, or 2 with prefetch and more than one group.
    pub slots: u64,
}

impl OnloadPlan {
    /// Groups and slots for `layers` (offloaded, in order), `matrix_bytes[l]` being the bytes
    /// of layer `l`'s tensors that the forward pass copies ([`copied_to_slot`]).
    pub fn new(mode: WeightOffload, device: String, layers: &[u32], matrix_bytes: &[u64]) -> Self {
        let groups: Vec<Vec<u32>> = layers
            .chunks(mode.group_len().max(1))
            .map(<[u32]>::to_vec)
            .collect();
        let slot_bytes = groups
            .iter()
            .map(|g| g.iter().map(|&l| matrix_bytes[l as usize]).sum::<u64>())
            .max()
            .unwrap_or(0);
        let slots = match groups.len() {
            0 => 0,
            1 => 1,
            _ if mode.prefetch() => 2,
            _ => 1,
        };
        OnloadPlan {
            mode,
            device,
            groups,
            slot_bytes,
            slots,
        }
    }

    /// Bytes the slots hold on the execution device.
    pub fn bytes(&self) -> u64 {
        self.slot_bytes.saturating_mul(self.slots)
    }

    pub fn prefetch(&self) -> bool {
        self.slots > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_modes_and_refuses_the_rest() {
        assert_eq!(WeightOffload::parse(None, 1, true).unwrap(), None);
        assert_eq!(
            WeightOffload::parse(Some("sequential"), 4, true).unwrap(),
            Some(WeightOffload::Sequential)
        );
        assert_eq!(
            WeightOffload::parse(Some("Group"), 2, false).unwrap(),
            Some(WeightOffload::Group {
                blocks_per_group: 2,
                prefetch: false
            })
        );
        let e = WeightOffload::parse(Some("disk"), 1, true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"sequential\" or \"group\"") && e.contains("'disk'"),
            "{e}"
        );
        let e = WeightOffload::parse(Some("group"), 0, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("blocks_per_group"), "{e}");
    }

    /// What a slot holds per linear: a float or ggml matrix; GPTQ's `qweight`, `qzeros` and
    /// `scales` (not `g_idx`); EXL2's `q_weight`, `q_scale` and `q_scale_max` (not
    /// `q_invperm`, `q_perm`, `q_groups`); never a norm or a bias.
    #[test]
    fn slots_hold_what_the_products_read() {
        use weightlift_format::DType;
        let t = |name: &str, shape: &[u64]| TensorInfo {
            name: name.into(),
            dtype: DType::I32,
            shape: shape.to_vec(),
            nbytes: shape.iter().product::<u64>() * 4,
            file: 0,
            offset: 0,
            layer: Some(0),
            role: None,
        };
        let p = "model.layers.0.mlp.down_proj";
        let copied = |name: &str, shape: &[u64]| copied_to_slot(&t(&format!("{p}.{name}"), shape));
        assert!(copied("weight", &[64, 128]));
        for (part, shape) in [
            ("qweight", &[16, 64][..]),
            ("qzeros", &[4, 8]),
            ("scales", &[4, 64]),
        ] {
            assert!(copied(part, shape), "{part}");
        }
        for (part, shape) in [
            ("q_weight", &[20, 64][..]),
            ("q_scale", &[4, 8]),
            ("q_scale_max", &[4]),
        ] {
            assert!(copied(part, shape), "{part}");
        }
        for part in ["g_idx", "q_invperm", "q_perm", "q_groups", "bias"] {
            assert!(!copied(part, &[128]), "{part}");
        }
        assert!(!copied_to_slot(&t(
            "model.layers.0.input_layernorm.weight",
            &[64]
        )));
    }

    #[test]
    fn groups_and_slots() {
        let bytes = [10, 20, 30, 40, 50];
        let g = WeightOffload::Group {
            blocks_per_group: 2,
            prefetch: true,
        };
        let p = OnloadPlan::new(g, "virtual:0".into(), &[1, 2, 3, 4], &bytes);
        assert_eq!(p.groups, vec![vec![1, 2], vec![3, 4]]);
        assert_eq!((p.slot_bytes, p.slots, p.bytes()), (90, 2, 180));
        let p = OnloadPlan::new(g, "virtual:0".into(), &[3, 4], &bytes);
        assert_eq!((p.slots, p.bytes()), (1, 90), "one group needs one slot");
        let p = OnloadPlan::new(WeightOffload::Sequential, "v".into(), &[0, 4], &bytes);
        assert_eq!((p.groups.len(), p.slot_bytes, p.slots), (2, 50, 1));
    }
}

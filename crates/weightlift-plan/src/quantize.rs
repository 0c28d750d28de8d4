//! Quantise on load (`quantize=`): the type each tensor of a float checkpoint is held in, decided
//! before a byte is read, so the plan sizes every tensor as the loader will write it.
//!
//! - **Linears of the repeating blocks** (q, k, v, o, gate, up, down) take the requested type.
//!   A ggml type needs whole blocks per row; a row that is not falls back as llama.cpp's
//!   quantiser falls back (Q4_K → Q5_0, Q6_K → Q8_0), and a row of fewer than whole 32-value
//!   blocks stays in its float type.
//! - **Embedding and output head.** `int8` keeps them in full precision, as transformers keeps
//!   the output and tied weights out of `load_in_8bit`. The ggml types promote them: Q6_K
//!   (Q8_0 when the row is not whole 256-value blocks) under `q4_k` and `q6_k`, Q8_0 under
//!   `q8_0`, the rule llama.cpp's presets apply to the output matrix.
//! - **Norms, biases and every other 1-D tensor** stay as they are (`dtype=` may still convert
//!   them).
//!
//! - **Tensors left on `disk`** stay views of the file in their stored type, as a `dtype=`
//!   conversion leaves them: the host streams them at every forward pass, and quantising them
//!   there would repeat the work each time.
//!
//! Only float checkpoints quantise: a checkpoint whose linears already hold quants (a quantised
//! GGUF, GPTQ, EXL2) is refused before loading, as is a row split (its shards cut rows of the
//! stored type). Tensor parallelism takes the ggml types: each shard is quantised by itself,
//! row shards whole rows, column shards each row's column range as blocks of their own, which
//! are the whole row's blocks there when the cut falls between blocks (the planner refuses a
//! cut inside one). `int8` stays off tensor parallelism: its row scales and outlier columns
//! are the whole row's.

use serde::{Deserialize, Serialize};
use weightlift_format::{DType, Role, TensorInfo};

use crate::error::{PlanError, Result};

/// A `quantize=` mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Quantize {
    /// LLM.int8: row-wise absmax int8 ([`DType::INT8`]).
    Int8,
    Q8_0,
    Q4K,
    Q6K,
}

impl Quantize {
    pub const ALL: [Quantize; 4] = [Quantize::Int8, Quantize::Q8_0, Quantize::Q4K, Quantize::Q6K];

    /// The option's spelling: `"int8"`, `"q8_0"`, `"q4_k"`, `"q6_k"`.
    pub const fn name(self) -> &'static str {
        match self {
            Quantize::Int8 => "int8",
            Quantize::Q8_0 => "q8_0",
            Quantize::Q4K => "q4_k",
            Quantize::Q6K => "q6_k",
        }
    }

    /// Parse an option value (case-insensitive; `"q4_k_m"`-style preset names are refused,
    /// since a preset mixes types by layer and these modes do not).
    pub fn parse(s: &str) -> Result<Quantize> {
        let l = s.trim().to_ascii_lowercase();
        Quantize::ALL
            .into_iter()
            .find(|q| q.name() == l)
            .ok_or_else(|| {
                PlanError::option(
                    "quantize",
                    "int8, q8_0, q4_k or q6_k (the types the kernels run after quantising on load)",
                    format!("'{s}'"),
                )
            })
    }

    /// The type the linears of the blocks take.
    const fn linear_type(self) -> DType {
        match self {
            Quantize::Int8 => DType::INT8,
            Quantize::Q8_0 => DType::Q8_0,
            Quantize::Q4K => DType::Q4_K,
            Quantize::Q6K => DType::Q6_K,
        }
    }

    /// The type the embedding and head take, when they are quantised at all.
    const fn head_type(self) -> Option<DType> {
        match self {
            Quantize::Int8 => None,
            Quantize::Q8_0 => Some(DType::Q8_0),
            Quantize::Q4K | Quantize::Q6K => Some(DType::Q6_K),
        }
    }

    /// The type `t` is held in under this mode, or `None` when it keeps its own. `role` is
    /// the tensor's role, with the globals' roles filled in from their names.
    pub fn target(self, t: &TensorInfo, role: Option<Role>) -> Option<DType> {
        if !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16) || t.shape.len() != 2 {
            return None;
        }
        let wanted = match role? {
            Role::AttnQ
            | Role::AttnK
            | Role::AttnV
            | Role::AttnOutput
            | Role::FfnGate
            | Role::FfnUp
            | Role::FfnDown
                if t.layer.is_some() =>
            {
                self.linear_type()
            }
            Role::TokenEmbd | Role::Output if t.layer.is_none() => self.head_type()?,
            _ => return None,
        };
        fit_row(wanted, t.shape[1])
    }

    /// Refuse a request this mode cannot serve: linears that already hold quants.
    pub fn check(self, tensors: &[TensorInfo]) -> Result<()> {
        let held = tensors
            .iter()
            .find(|t| t.dtype.holds_quants() || weightlift_format::is_quantized_part(&t.name));
        match held {
            Some(t) => Err(PlanError::option(
                "quantize",
                "a checkpoint with f32, f16 or bf16 weights",
                format!(
                    "tensor '{}' is already {}; quantize={} cannot requantise it (load it \
                     without quantize=, or start from the float checkpoint)",
                    t.name,
                    if t.dtype.holds_quants() {
                        t.dtype.name()
                    } else {
                        "part of a GPTQ/EXL2 linear"
                    },
                    self.name()
                ),
            )),
            None => Ok(()),
        }
    }
}

/// `wanted`, or the type llama.cpp falls back to when a row of `cols` values is not whole
/// blocks of it; `None` when no quantised type fits.
fn fit_row(wanted: DType, cols: u64) -> Option<DType> {
    let whole = |d: DType| cols > 0 && cols.is_multiple_of(d.block_size());
    let fallback = match wanted {
        DType::Q4_K => DType::Q5_0,
        DType::Q6_K => DType::Q8_0,
        other => other,
    };
    [wanted, fallback].into_iter().find(|&d| whole(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, dtype: DType, shape: &[u64], layer: Option<u32>, role: Role) -> TensorInfo {
        let n: u64 = shape.iter().product();
        TensorInfo {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            file: 0,
            offset: 0,
            nbytes: dtype.bytes_for(n).unwrap(),
            layer,
            role: Some(role),
        }
    }

    #[test]
    fn linears_take_the_type_and_fall_back_as_llama_cpp() {
        let q = t(
            "blk.0.attn_q.weight",
            DType::BF16,
            &[512, 512],
            Some(0),
            Role::AttnQ,
        );
        assert_eq!(Quantize::Q4K.target(&q, q.role), Some(DType::Q4_K));
        assert_eq!(Quantize::Int8.target(&q, q.role), Some(DType::INT8));
        // SmolLM2's 576-wide rows are not whole 256-value blocks.
        let up = t(
            "blk.0.ffn_up.weight",
            DType::F16,
            &[1536, 576],
            Some(0),
            Role::FfnUp,
        );
        assert_eq!(Quantize::Q4K.target(&up, up.role), Some(DType::Q5_0));
        assert_eq!(Quantize::Q6K.target(&up, up.role), Some(DType::Q8_0));
        let odd = t(
            "blk.0.ffn_up.weight",
            DType::F32,
            &[8, 40],
            Some(0),
            Role::FfnUp,
        );
        assert_eq!(Quantize::Q8_0.target(&odd, odd.role), None);
        assert_eq!(Quantize::Int8.target(&odd, odd.role), Some(DType::INT8));
    }

    #[test]
    fn heads_and_norms() {
        let out = t(
            "output.weight",
            DType::F16,
            &[1000, 512],
            None,
            Role::Output,
        );
        assert_eq!(Quantize::Int8.target(&out, out.role), None);
        assert_eq!(Quantize::Q4K.target(&out, out.role), Some(DType::Q6_K));
        assert_eq!(Quantize::Q8_0.target(&out, out.role), Some(DType::Q8_0));
        let norm = t(
            "blk.0.attn_norm.weight",
            DType::F32,
            &[512],
            Some(0),
            Role::AttnNorm,
        );
        assert_eq!(Quantize::Q4K.target(&norm, norm.role), None);
    }

    #[test]
    fn quantised_checkpoints_are_refused() {
        let q = t(
            "blk.0.attn_q.weight",
            DType::Q4_1,
            &[32, 64],
            Some(0),
            Role::AttnQ,
        );
        let e = Quantize::Q8_0.check(&[q]).unwrap_err().to_string();
        assert!(
            e.contains("blk.0.attn_q.weight") && e.contains("Q4_1"),
            "{e}"
        );
        assert!(
            Quantize::parse("q4_k_m")
                .unwrap_err()
                .to_string()
                .contains("int8, q8_0")
        );
        assert_eq!(Quantize::parse("Q6_K").unwrap(), Quantize::Q6K);
    }
}

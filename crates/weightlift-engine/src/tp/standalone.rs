//! exllamav2's `TPContext(model, gpu_split, expect_cache_tokens, expect_cache_base)`: a
//! context made beside a model rather than by its `load_tp`, with the tables of the model's
//! tensor-parallel plan, or planned now.

use std::sync::Arc;

use weightlift_format::DType;
use weightlift_plan as wp;

use super::{HostStaged, Rope, TpContext};
use crate::device::Device;
use crate::error::{EngineError, Result, invalid};
use crate::model::Model;

/// A context made for a model, with where its staging buffers go and how large they are.
#[derive(Debug)]
pub struct Standalone {
    pub ctx: TpContext,
    /// The host device of [`TpContext::finalize`]'s staging buffers.
    pub cpu: Arc<Device>,
    /// Bytes of each staging buffer.
    pub staging_bytes: u64,
}

/// exllamav2's `TPContext` arguments.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TpArgs {
    /// GB per accelerator; `None` is each device's free memory.
    pub gpu_split: Option<Vec<f64>>,
    /// Cache tokens subtracted before splitting; 0 is the model's context length.
    pub expect_cache_tokens: u64,
    /// The dtype of that cache (fp16 when not given).
    pub expect_cache_base: Option<wp::CacheDType>,
}

impl Model {
    /// A context over this model's accelerators. The tables are `plan`'s when it is
    /// tensor-parallel and no `gpu_split` is given (a `load_tp` plan); otherwise they are
    /// planned now over the model's request with `runtime`. RoPE tables cover the expected
    /// cache tokens, at most the context length. The staging buffers are sized as exllamav2
    /// sizes its pinned temps: `max_input_len × max(vocab, intermediate)` halves.
    pub fn standalone_tp(
        &self,
        plan: Option<&wp::Plan>,
        runtime: wp::RuntimeSpec,
        args: TpArgs,
    ) -> Result<Standalone> {
        let spec = self
            .source()
            .spec()
            .ok_or_else(|| EngineError::Unsupported {
                what: "tensor parallelism on a checkpoint without its architecture".into(),
                detail: "the model's spec could not be read; see Checkpoint.spec_error".into(),
            })?
            .clone();
        let tokens = match args.expect_cache_tokens {
            0 => spec.context_length,
            n => n,
        };
        let tables = match plan.and_then(wp::Plan::tp) {
            Some(tp) if args.gpu_split.is_none() => tp.clone(),
            _ => {
                let mut req = self.plan_request()?;
                req.runtime = runtime;
                wp::PlanOptions::tensor_parallel(
                    args.gpu_split,
                    args.expect_cache_tokens,
                    args.expect_cache_base,
                )
                .apply(&mut req)?;
                let plan = wp::plan(&req)?;
                plan.tp().cloned().ok_or_else(|| {
                    invalid(
                        "tensor-parallel plan",
                        "split tables",
                        format!("a plan by strategy {}", plan.strategy()),
                    )
                })?
            }
        };
        let rope = Rope {
            theta: spec.rope_theta,
            dim: spec.rope_dim,
            head_dim: spec.head_dim,
            max_seq_len: tokens.min(spec.context_length.max(1)),
        };
        let ctx = TpContext::new(
            crate::planned::splits(&tables),
            self.inventory().accelerators().to_vec(),
            rope,
            Box::new(HostStaged),
        )?;
        Ok(Standalone {
            ctx,
            cpu: Arc::clone(self.inventory().cpu()),
            staging_bytes: runtime
                .max_input_len
                .saturating_mul(spec.vocab_size.max(spec.intermediate_size))
                .saturating_mul(2),
        })
    }
}

/// A scratch dtype as exllamav2 names torch's: float16 (half) or float32 (float).
pub fn scratch_dtype(name: &str) -> Result<DType> {
    match name {
        "float16" | "half" | "f16" => Ok(DType::F16),
        "float32" | "float" | "f32" => Ok(DType::F32),
        _ => Err(invalid(
            "scratch dtype",
            "'float16' or 'float32'",
            format!("'{name}'"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_dtypes_by_torch_name() {
        assert_eq!(scratch_dtype("half").unwrap(), DType::F16);
        assert_eq!(scratch_dtype("float32").unwrap(), DType::F32);
        let e = scratch_dtype("bfloat16").unwrap_err().to_string();
        assert!(
            e.contains("'float16' or 'float32'") && e.contains("'bfloat16'"),
            "{e}"
        );
    }
}

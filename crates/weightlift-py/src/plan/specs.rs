//! The shapes a plan is asked for: `CacheSpec` (the KV cache) and `RuntimeSpec` (the limits
//! that size each device's scratch).

use pyo3::prelude::*;
use weightlift_plan as wp;

use crate::errors::py_err;
use crate::format::ModelSpec;

/// The KV cache to plan for: `max_seq_len` tokens × `batch_size`, in `dtype` (fp16, bf16, fp8,
/// q8, q6, q4 or f32; the quantised ones carry one f16 scale per 32 values, q6 is 8-bit K,
/// 4-bit V).
/// `offload=True` plans transformers' `OffloadedCache`: the whole cache in host RAM (the cpu's
/// kv column) and, on each device that computes layers, two prefetch slots of its largest layer
/// (one when it computes a single layer).
#[pyclass(module = "weightlift._native", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct CacheSpec {
    pub(crate) inner: wp::CacheSpec,
}

#[pymethods]
impl CacheSpec {
    #[new]
    #[pyo3(signature = (max_seq_len, batch_size = 1, dtype = "fp16", offload = false))]
    pub(crate) fn new(
        max_seq_len: u64,
        batch_size: u64,
        dtype: &str,
        offload: bool,
    ) -> PyResult<Self> {
        let dtype = wp::CacheDType::parse(dtype).map_err(py_err)?;
        let inner = wp::CacheSpec::new(max_seq_len, batch_size, dtype).with_offload(offload);
        inner.check().map_err(py_err)?;
        Ok(CacheSpec { inner })
    }
    #[getter]
    fn max_seq_len(&self) -> u64 {
        self.inner.max_seq_len
    }
    #[getter]
    fn batch_size(&self) -> u64 {
        self.inner.batch_size
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }
    /// True for a cache offloaded to host RAM.
    #[getter]
    fn offload(&self) -> bool {
        self.inner.offload
    }
    /// Bytes of the whole cache for a model.
    fn nbytes(&self, spec: ModelSpec) -> u64 {
        self.inner.total_bytes(&spec.inner)
    }
    fn __repr__(&self) -> String {
        let offload = if self.inner.offload {
            ", offload=True"
        } else {
            ""
        };
        format!(
            "CacheSpec(max_seq_len={}, batch_size={}, dtype='{}'{offload})",
            self.inner.max_seq_len,
            self.inner.batch_size,
            self.inner.dtype.name()
        )
    }
}

/// Runtime limits that decide per-device scratch, named and defaulted as exllamav2's config.
#[pyclass(module = "weightlift._native", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RuntimeSpec {
    pub(crate) inner: wp::RuntimeSpec,
}

#[pymethods]
impl RuntimeSpec {
    #[new]
    // Defaults are exllamav2's: 2048 tokens, 2048² attention elements, 512 Mi dequant elements.
    #[pyo3(signature = (max_input_len = 2048, max_attention_size = 4_194_304, max_dq_size = 536_870_912, low_mem = false))]
    fn new(max_input_len: u64, max_attention_size: u64, max_dq_size: u64, low_mem: bool) -> Self {
        RuntimeSpec {
            inner: wp::RuntimeSpec {
                max_input_len,
                max_attention_size,
                max_dq_size,
                low_mem,
            },
        }
    }
    #[getter]
    fn max_input_len(&self) -> u64 {
        self.inner.max_input_len
    }
    #[getter]
    fn max_attention_size(&self) -> u64 {
        self.inner.max_attention_size
    }
    #[getter]
    fn max_dq_size(&self) -> u64 {
        self.inner.max_dq_size
    }
    #[getter]
    fn low_mem(&self) -> bool {
        self.inner.low_mem
    }
    fn __repr__(&self) -> String {
        let r = &self.inner;
        format!(
            "RuntimeSpec(max_input_len={}, max_attention_size={}, max_dq_size={}, low_mem={})",
            r.max_input_len,
            r.max_attention_size,
            r.max_dq_size,
            if r.low_mem { "True" } else { "False" }
        )
    }
}

//! `Cache`: a KV cache of a model, allocated beside each layer.

use std::collections::HashMap;
use std::sync::Arc;

use numpy::{PyArray1, PyReadonlyArrayDyn};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use weightlift_engine::cache::{Cache as ECache, CacheDType, CacheState};

use crate::errors::{eng, enter, py_err};
use crate::model::Model;

/// A KV cache for a model. `max_seq_len` and `batch_size` are keyword-only (exllamav2 takes
/// `batch_size` first, so a positional `Cache(model, 1, 8192)` would mean opposite things);
/// `max_seq_len=None` is the model's trained context length, as exllamav2's `-1`. `dtype`: fp16,
/// bf16, fp8 (e4m3), q8, q6 (8-bit K, 4-bit V), q4 or f32, the quantised ones with one f16 scale
/// per 32 values. A lazy cache is allocated during the load,
/// layer by layer on each layer's device; on a loaded model it is allocated at once. `offload`
/// keeps it in host RAM and prefetches the next layer to its device on a second thread.
#[pyclass(module = "weightlift._native", frozen)]
pub struct Cache {
    pub(crate) cache: Arc<ECache>,
}

#[pymethods]
impl Cache {
    #[new]
    #[pyo3(signature = (model, *, max_seq_len = None, batch_size = 1, dtype = "fp16", lazy = true, offload = false))]
    fn new(
        model: &Bound<'_, Model>,
        max_seq_len: Option<u64>,
        batch_size: u64,
        dtype: &str,
        lazy: bool,
        offload: bool,
    ) -> PyResult<Self> {
        let d = CacheDType::parse(dtype).map_err(py_err)?;
        let mut inner = model.get().lock()?;
        let cache = eng(inner
            .model
            .new_cache(max_seq_len, batch_size, d, offload, lazy))?;
        Ok(Cache { cache })
    }

    #[getter]
    fn max_seq_len(&self) -> u64 {
        self.cache.config().max_seq_len
    }

    #[getter]
    fn batch_size(&self) -> u64 {
        self.cache.config().batch_size
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        self.cache.config().dtype.name()
    }

    #[getter]
    fn offload(&self) -> bool {
        self.cache.config().offload
    }

    #[getter]
    fn allocated(&self) -> bool {
        self.cache.is_allocated()
    }

    /// Tokens held: where the next `Model.forward(ids, cache=...)` appends.
    #[getter]
    fn seq_len(&self) -> u64 {
        self.cache.seq_len()
    }

    /// Forget every token (the memory stays allocated).
    fn reset(&self) {
        self.cache.reset();
    }

    /// Keep the first `n` tokens (at most `seq_len`) and forget the rest.
    fn truncate(&self, n: u64) -> PyResult<()> {
        eng(self.cache.truncate(n))
    }

    /// The token ids at positions `0..seq_len`; empty when some were written directly with
    /// `write()`.
    #[getter]
    fn tokens(&self) -> Vec<u32> {
        self.cache.ids()
    }

    /// The tokens held and their keys and values, as bytes `load_state()` takes back (into this
    /// cache or another of the same model, of any dtype).
    fn save_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let c = Arc::clone(&self.cache);
        let bytes = enter(py, || c.save_state().map(|s| s.to_bytes()))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Replace what the cache holds with a `save_state()` result.
    fn load_state(&self, py: Python<'_>, state: &[u8]) -> PyResult<()> {
        let c = Arc::clone(&self.cache);
        enter(py, || {
            let s = CacheState::from_bytes(state)?;
            c.load_state(&s)
        })
    }

    /// Bytes held per device: the layers, and an offloaded cache's prefetch slots.
    fn memory(&self) -> HashMap<String, u64> {
        self.cache.memory().into_iter().collect()
    }

    /// What `memory()` should hold for the devices the layers were allocated for: each layer's
    /// K and V on its device; offloaded, every layer on `cpu` plus, on each layer device, two
    /// prefetch slots of its largest layer (one when it computes a single layer). A plan made
    /// for this cache predicts the same bytes in its kv column.
    fn expected_memory(&self) -> PyResult<HashMap<String, u64>> {
        Ok(eng(self.cache.expected_memory())?.into_iter().collect())
    }

    /// The device layer `layer` computes on (and, unless offloaded, lives on).
    fn device_of(&self, layer: usize) -> PyResult<String> {
        eng(self.cache.device_of(layer))
    }

    /// Write `k` and `v` (float32, `(batch, n_kv_heads, n_tokens, head_dim)`) at position `pos`.
    fn write(
        &self,
        py: Python<'_>,
        layer: usize,
        pos: u64,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let np = py.import("numpy")?;
        let kk = np.call_method1("ascontiguousarray", (k, "float32"))?;
        let vv = np.call_method1("ascontiguousarray", (v, "float32"))?;
        let shape: Vec<u64> = kk.getattr("shape")?.extract()?;
        let vshape: Vec<u64> = vv.getattr("shape")?.extract()?;
        let n_tokens = shape.get(2).copied().unwrap_or(0);
        let [batch, heads, _, head_dim] = self.cache.config().kv_shape(layer, n_tokens);
        if shape != [batch, heads, n_tokens, head_dim] || vshape != shape {
            return Err(PyValueError::new_err(format!(
                "k and v must both be float32 ({batch}, {heads}, n_tokens, {head_dim}); got \
                 {shape:?} and {vshape:?}"
            )));
        }
        let ka: PyReadonlyArrayDyn<'_, f32> = kk.extract()?;
        let va: PyReadonlyArrayDyn<'_, f32> = vv.extract()?;
        let ks = ka
            .as_slice()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let vs = va
            .as_slice()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        eng(self.cache.write(layer, pos, n_tokens, ks, vs))
    }

    /// Read positions `start..end` back as float32 `(k, v)`, each
    /// `(batch, n_kv_heads, end - start, head_dim)`.
    fn read<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        start: u64,
        end: u64,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let (k, v) = eng(self.cache.read(layer, start, end))?;
        let shape = self.cache.config().kv_shape(layer, end - start);
        let shape = PyTuple::new(py, shape)?;
        let k = PyArray1::from_vec(py, k).call_method1("reshape", (&shape,))?;
        let v = PyArray1::from_vec(py, v).call_method1("reshape", (&shape,))?;
        Ok((k, v))
    }

    /// Offload: copy `layer` to its device (taking the prefetched copy when there is one) and
    /// start prefetching the next layer on a second thread. Returns the device name.
    fn fetch(&self, py: Python<'_>, layer: usize) -> PyResult<String> {
        let c = Arc::clone(&self.cache);
        let r = enter(py, || c.fetch(layer))?;
        Ok(r.k.device().name().to_owned())
    }

    /// Free every layer.
    fn free(&self) {
        self.cache.free();
    }

    fn __repr__(&self) -> String {
        let c = self.cache.config();
        format!(
            "Cache(max_seq_len={}, batch_size={}, dtype='{}', offload={})",
            c.max_seq_len,
            c.batch_size,
            c.dtype.name(),
            c.offload
        )
    }
}

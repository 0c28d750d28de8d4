//! `Cache`: a KV cache of a model, allocated beside each layer. `weightlift.Cache` is declared
//! over this class in `weightlift/_objects.py` (its docs, its shape properties and `write`'s
//! conversion to float32); this converts.

use std::collections::HashMap;
use std::sync::Arc;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use weightlift_engine::cache::{Cache as ECache, CacheDType, CacheState};

use crate::errors::{eng, enter, py_err};
use crate::model::Model;

#[pyclass(module = "weightlift._native", frozen, subclass)]
pub struct Cache {
    pub(crate) cache: Arc<ECache>,
}

/// `native` as the class `name` of `weightlift/_objects.py` that declares it (the class users
/// see): a handle made by the native `__new__`, given `native` as its `model`.
pub(crate) fn declared<T: pyo3::PyClass>(
    py: Python<'_>,
    native: Py<T>,
    name: &str,
) -> PyResult<Py<T>> {
    let class = py.import("weightlift._objects")?.getattr(name)?;
    let view = py
        .get_type::<T>()
        .call_method1("__new__", (class, native))?;
    Ok(view.cast_into::<T>()?.unbind())
}

impl Cache {
    /// `cache` as `weightlift.Cache`.
    pub(crate) fn object(py: Python<'_>, cache: Arc<ECache>) -> PyResult<Py<Cache>> {
        declared(py, Py::new(py, Cache { cache })?, "Cache")
    }
}

#[pymethods]
impl Cache {
    /// `model` may be a `Cache`: another handle of it (how [`declared`] makes one).
    #[new]
    #[pyo3(signature = (model, *, max_seq_len = None, batch_size = 1, dtype = "fp16", lazy = true, offload = false))]
    fn new(
        model: &Bound<'_, PyAny>,
        max_seq_len: Option<i64>,
        batch_size: i64,
        dtype: &str,
        lazy: bool,
        offload: bool,
    ) -> PyResult<Self> {
        if let Ok(c) = model.cast::<Cache>() {
            let cache = Arc::clone(&c.get().cache);
            return Ok(Cache { cache });
        }
        let d = CacheDType::parse(dtype).map_err(py_err)?;
        let (max_seq_len, batch_size) = eng(weightlift_engine::Model::cache_shape_args(
            max_seq_len,
            batch_size,
        ))?;
        let mut inner = model.cast::<Model>()?.get().lock()?;
        let cache = eng(inner
            .model
            .new_cache(max_seq_len, batch_size, d, offload, lazy))?;
        Ok(Cache { cache })
    }

    /// `(max_seq_len, batch_size, dtype, offload)`.
    fn _config(&self) -> (u64, u64, &'static str, bool) {
        let c = self.cache.config();
        (c.max_seq_len, c.batch_size, c.dtype.name(), c.offload)
    }

    #[getter]
    fn allocated(&self) -> bool {
        self.cache.is_allocated()
    }

    #[getter]
    fn seq_len(&self) -> u64 {
        self.cache.seq_len()
    }

    fn reset(&self) {
        self.cache.reset();
    }

    fn truncate(&self, n: u64) -> PyResult<()> {
        eng(self.cache.truncate(n))
    }

    /// Whether the rows held were computed under `model`'s current settings (its compute mode
    /// and int8 threshold), so that a prefix of them may be reused.
    fn _held_under(&self, model: &Bound<'_, Model>) -> PyResult<bool> {
        let under = model.get().lock()?.model.kv_settings();
        Ok(self.cache.held_under(under))
    }

    #[getter]
    fn tokens(&self) -> Vec<u32> {
        self.cache.ids()
    }

    fn save_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let c = Arc::clone(&self.cache);
        let bytes = enter(py, || c.save_state().map(|s| s.to_bytes()))?;
        Ok(PyBytes::new(py, &bytes))
    }

    fn load_state(&self, py: Python<'_>, state: &[u8]) -> PyResult<()> {
        let c = Arc::clone(&self.cache);
        enter(py, || c.load_state(&CacheState::from_bytes(state)?))
    }

    fn memory(&self) -> HashMap<String, u64> {
        self.cache.memory().into_iter().collect()
    }

    fn expected_memory(&self) -> PyResult<HashMap<String, u64>> {
        Ok(eng(self.cache.expected_memory())?.into_iter().collect())
    }

    fn device_of(&self, layer: usize) -> PyResult<String> {
        eng(self.cache.device_of(layer))
    }

    /// `Cache.write` on float32 arrays.
    fn _write(
        &self,
        layer: usize,
        pos: u64,
        k: PyReadonlyArrayDyn<'_, f32>,
        v: PyReadonlyArrayDyn<'_, f32>,
    ) -> PyResult<()> {
        let shape = |a: &PyReadonlyArrayDyn<'_, f32>| a.shape().iter().map(|&d| d as u64).collect();
        let (ks, vs): (Vec<u64>, Vec<u64>) = (shape(&k), shape(&v));
        let n_tokens = eng(self.cache.config().positions_of(layer, &ks, &vs))?;
        eng(self
            .cache
            .write(layer, pos, n_tokens, k.as_slice()?, v.as_slice()?))
    }

    fn read<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        start: u64,
        end: u64,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let (k, v) = eng(self.cache.read(layer, start, end))?;
        let shape = self
            .cache
            .config()
            .kv_shape(layer, end - start)
            .map(|d| d as usize);
        let k = PyArray1::from_vec(py, k).reshape(shape)?.into_any();
        let v = PyArray1::from_vec(py, v).reshape(shape)?.into_any();
        Ok((k, v))
    }

    fn fetch(&self, py: Python<'_>, layer: usize) -> PyResult<String> {
        let c = Arc::clone(&self.cache);
        let r = enter(py, || c.fetch(layer))?;
        Ok(r.k.device().name().to_owned())
    }

    fn free(&self) {
        self.cache.free();
    }
}

//! Running a loaded model: `Model.forward`, `forward_batch` and `embed` (documented in
//! `weightlift/_api.py`). Conversion only; the forward pass is the engine's.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use weightlift_engine::Pooling;
use weightlift_engine::forward::Logits;

use crate::cache::Cache;
use crate::errors::{eng, enter, py_err};
use crate::model::Model;
use crate::options::{Kw, TokenIds};

/// `out` as `rows` rows of logits.
fn logit_rows(py: Python<'_>, out: Vec<f32>, rows: usize) -> PyResult<Bound<'_, PyArray2<f32>>> {
    let vocab = out.len().checked_div(rows).unwrap_or(0);
    PyArray1::from_vec(py, out).reshape([rows, vocab])
}

#[pymethods]
impl Model {
    #[pyo3(signature = (ids, *, cache = None, logits = "last"))]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        ids: TokenIds,
        cache: Option<&Bound<'py, Cache>>,
        logits: &str,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let ids = ids.0;
        let mode = eng(Logits::parse(logits))?;
        let cache = cache.map(|c| &c.get().cache);
        let (mut inner, mut out) = (self.lock()?, Vec::new());
        let model = &mut inner.model;
        enter(py, || model.forward(&ids, cache, mode, &mut out))?;
        logit_rows(py, out, mode.n_rows(ids.len()))
    }

    fn forward_batch<'py>(
        &self,
        py: Python<'py>,
        seqs: Vec<(Bound<'py, Cache>, TokenIds)>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let batch: Vec<_> = (seqs.iter())
            .map(|(c, ids)| (&c.get().cache, ids.0.as_slice()))
            .collect();
        let (mut inner, mut out) = (self.lock()?, Vec::new());
        let model = &mut inner.model;
        enter(py, || model.forward_batch(&batch, &mut out))?;
        logit_rows(py, out, batch.len())
    }

    #[getter]
    fn n_threads(&self) -> PyResult<usize> {
        Ok(self.lock()?.model.n_threads())
    }

    /// llama.cpp's `pooling_type` integer that `llama_type` resolves to for this model
    /// (`-1`: the GGUF's `{arch}.pooling_type`, else none).
    fn _pooling_type(&self, llama_type: i32) -> PyResult<i32> {
        let inner = self.lock()?;
        let pooling = inner.model.pooling_for(llama_type).map_err(py_err)?;
        Ok(pooling.llama_type())
    }

    /// `Model.embed`, whose signature and docstring are in `weightlift/_api.py`: one vector per
    /// token without pooling, else the one vector.
    fn _embed<'py>(
        &self,
        py: Python<'py>,
        ids: TokenIds,
        kw: Kw<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids = ids.0;
        let (kw, mut inner) = (kw.data()?, self.lock()?);
        let model = &mut inner.model;
        let (pooling, mut vectors) = enter(py, || model.embed_keywords(&ids, &kw))?;
        if pooling == Pooling::None {
            return vectors.into_pyobject(py);
        }
        vectors.pop().unwrap_or_default().into_pyobject(py)
    }
}

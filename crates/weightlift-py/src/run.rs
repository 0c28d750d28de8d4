//! Running a loaded model: `Model.forward`, `Model.embed`, its compute mode and threads. Conversion only; the
//! forward pass is the engine's.

use numpy::{PyArray2, ndarray::Array2};
use pyo3::prelude::*;
use weightlift_engine::Pooling;
use weightlift_engine::forward::{Compute, Logits};

use crate::cache::Cache;
use crate::errors::{eng, enter};
use crate::model::Model;

/// `out` as `rows` rows of logits.
fn logit_rows(py: Python<'_>, out: Vec<f32>, rows: usize) -> PyResult<Bound<'_, PyArray2<f32>>> {
    let vocab = out.len().checked_div(rows).unwrap_or(0);
    let arr = Array2::from_shape_vec((rows, vocab), out)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok(PyArray2::from_owned_array(py, arr))
}

#[pymethods]
impl Model {
    #[pyo3(signature = (ids, *, cache = None, logits = "last"))]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        cache: Option<&Bound<'py, Cache>>,
        logits: &str,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let mode = eng(Logits::parse(logits))?;
        let cache = cache.map(|c| std::sync::Arc::clone(&c.get().cache));
        let mut inner = self.lock()?;
        let model = &mut inner.model;
        let out = enter(py, || {
            let mut out = Vec::new();
            model
                .forward(&ids, cache.as_ref(), mode, &mut out)
                .map(|_| out)
        })?;
        logit_rows(py, out, mode.n_rows(ids.len()))
    }

    fn forward_batch<'py>(
        &self,
        py: Python<'py>,
        seqs: Vec<(Bound<'py, Cache>, Vec<u32>)>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let caches: Vec<_> = seqs
            .iter()
            .map(|(c, _)| std::sync::Arc::clone(&c.get().cache))
            .collect();
        let batch: Vec<_> = caches
            .iter()
            .zip(&seqs)
            .map(|(c, (_, ids))| (c, ids.as_slice()))
            .collect();
        let mut inner = self.lock()?;
        let model = &mut inner.model;
        let out = enter(py, || {
            let mut out = Vec::new();
            model.forward_batch(&batch, &mut out).map(|_| out)
        })?;
        logit_rows(py, out, batch.len())
    }

    #[getter]
    fn compute(&self) -> PyResult<&'static str> {
        Ok(self.lock()?.model.compute().name())
    }

    #[setter]
    fn set_compute(&self, value: &str) -> PyResult<()> {
        let c = eng(Compute::parse(value))?;
        self.lock()?.model.set_compute(c);
        Ok(())
    }

    #[getter]
    fn cuda_graphs(&self) -> PyResult<bool> {
        Ok(self.lock()?.model.cuda_graphs())
    }

    #[setter]
    fn set_cuda_graphs(&self, on: bool) -> PyResult<()> {
        self.lock()?.model.set_cuda_graphs(on);
        Ok(())
    }

    fn cuda_graph_counts(&self) -> PyResult<(u64, u64, Option<String>)> {
        Ok(self.lock()?.model.cuda_graph_counts())
    }

    #[getter]
    fn n_threads(&self) -> PyResult<usize> {
        Ok(self.lock()?.model.n_threads())
    }

    #[getter]
    fn int8_threshold(&self) -> PyResult<f32> {
        Ok(self.lock()?.model.int8_threshold())
    }

    #[setter]
    fn set_int8_threshold(&self, value: f32) -> PyResult<()> {
        eng(self.lock()?.model.set_int8_threshold(value))
    }
}

#[pymethods]
impl Model {
    #[pyo3(signature = (ids, *, pooling = None, normalize = false))]
    fn embed<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        pooling: Option<&Bound<'py, PyAny>>,
        normalize: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut inner = self.lock()?;
        let model = &mut inner.model;
        let pooling = match pooling.filter(|p| !p.is_none()) {
            None => eng(model.pooling_for(weightlift_engine::embeddings::POOLING_UNSPECIFIED))?,
            Some(p) => match p.extract::<i32>() {
                Ok(n) => eng(model.pooling_for(n))?,
                Err(_) => eng(Pooling::parse(&p.extract::<String>().map_err(|_| {
                    pyo3::exceptions::PyTypeError::new_err(
                        "pooling: expected llama.cpp's pooling number or a name ('none', \
                         'mean', 'cls', 'last')",
                    )
                })?))?,
            },
        };
        let mut vectors = enter(py, || model.embed(&ids, pooling, normalize))?;
        if pooling == Pooling::None {
            return Ok(pyo3::types::PyList::new(py, vectors)?.into_any());
        }
        let one = vectors.pop().unwrap_or_default();
        Ok(pyo3::types::PyList::new(py, one)?.into_any())
    }
}

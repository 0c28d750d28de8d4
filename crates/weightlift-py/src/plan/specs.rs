//! The shapes a plan is asked for, `CacheSpec` (the KV cache) and `RuntimeSpec` (the limits
//! that size each device's scratch): frozen dataclasses of `weightlift/_specs.py`, whose fields
//! the core's keyword grammar checks as it reads a `cache=` or `runtime=` dict.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde::Serialize;
use weightlift_plan as wp;

use crate::format::ModelSpec;
use crate::options::keyword;

/// A core spec, handed to Python as the dataclass of `weightlift/_specs.py` of its name.
pub struct Spec<T> {
    pub(crate) inner: T,
}

pub type CacheSpec = Spec<wp::CacheSpec>;
pub type RuntimeSpec = Spec<wp::RuntimeSpec>;

/// The name of a spec's dataclass.
pub trait Named {
    const NAME: &'static str;
}

impl Named for wp::CacheSpec {
    const NAME: &'static str = "CacheSpec";
}

impl Named for wp::RuntimeSpec {
    const NAME: &'static str = "RuntimeSpec";
}

impl<'py, T: Named + Serialize> IntoPyObject<'py> for Spec<T> {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        let fields = pythonize::pythonize(py, &self.inner)?.cast_into::<PyDict>()?;
        let class = py.import("weightlift._specs")?.getattr(T::NAME)?;
        class.call((), Some(&fields))
    }
}

/// The fields of a spec (`key` `"cache"` or `"runtime"`) as the keyword grammar reads them:
/// checked, and a cache dtype by its one name.
#[pyfunction]
pub(super) fn _spec_fields<'py>(
    key: &str,
    spec: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = spec.py();
    Ok(match key {
        "cache" => pythonize::pythonize(py, &keyword::<wp::CacheSpec>(key, spec)?)?,
        _ => pythonize::pythonize(py, &keyword::<wp::RuntimeSpec>(key, spec)?)?,
    })
}

/// `CacheSpec.nbytes`: bytes of the whole cache for the model `spec`.
#[pyfunction]
pub(super) fn _cache_nbytes(cache: &Bound<'_, PyAny>, spec: ModelSpec) -> PyResult<u64> {
    let cache = keyword::<wp::CacheSpec>("cache", cache)?;
    Ok(cache.map_or(0, |c| c.total_bytes(&spec.inner)))
}

//! The shapes a plan is asked for, `CacheSpec` (the KV cache) and `RuntimeSpec` (the limits
//! that size each device's scratch): frozen dataclasses of `weightlift/_specs.py`, whose fields
//! the core's keyword grammar checks as it reads a `cache=` or `runtime=` dict.

use pyo3::prelude::*;
use weightlift_plan as wp;

use crate::format::ModelSpec;
use crate::options::keyword;

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

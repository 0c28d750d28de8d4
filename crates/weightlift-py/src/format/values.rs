//! Checkpoint metadata as Python values: numbers, strings and lists.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyList, PyString};
use weightlift_format::{MetaRef, MetaValue};

pub(super) fn meta_to_py<'py>(py: Python<'py>, value: &MetaValue) -> PyResult<Bound<'py, PyAny>> {
    meta_ref_to_py(py, value.view())
}

/// One value, or (for arrays, lazy ones decoded from the map here) a list of its elements.
fn meta_ref_to_py<'py>(py: Python<'py>, value: MetaRef<'_>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        MetaRef::U8(v) => v.into_pyobject(py)?.into_any(),
        MetaRef::I8(v) => v.into_pyobject(py)?.into_any(),
        MetaRef::U16(v) => v.into_pyobject(py)?.into_any(),
        MetaRef::I16(v) => v.into_pyobject(py)?.into_any(),
        MetaRef::U32(v) => v.into_pyobject(py)?.into_any(),
        MetaRef::I32(v) => v.into_pyobject(py)?.into_any(),
        MetaRef::U64(v) => v.into_pyobject(py)?.into_any(),
        MetaRef::I64(v) => v.into_pyobject(py)?.into_any(),
        MetaRef::F32(v) => PyFloat::new(py, f64::from(v)).into_any(),
        MetaRef::F64(v) => PyFloat::new(py, v).into_any(),
        MetaRef::Bool(v) => PyBool::new(py, v).to_owned().into_any(),
        MetaRef::String(s) => PyString::new(py, s).into_any(),
        MetaRef::Array(items) => {
            let mut list = Vec::with_capacity(items.len());
            for item in items {
                list.push(meta_ref_to_py(py, item)?);
            }
            PyList::new(py, list)?.into_any()
        }
    })
}

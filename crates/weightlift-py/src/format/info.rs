//! The read-only records (`TensorInfo`, `ModelSpec`, `Device`, `DeviceUsage`, `Placement`):
//! frozen dataclasses declared and documented in `weightlift/_types.py`. Each is built here from
//! a serde view of the core value, pythonized, as `errors.rs` raises the classes of
//! `weightlift._errors` by name.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;
use serde::Serialize;
use weightlift_format as wf;

use crate::errors::{Exc, raise};

static TYPES_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// The class `name` of `weightlift._types`.
pub(crate) fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    TYPES_MODULE
        .get_or_try_init(py, || py.import("weightlift._types").map(Bound::unbind))?
        .bind(py)
        .getattr(name)
}

/// `weightlift._types.<name>(**view)`.
pub(crate) fn record<'py>(
    py: Python<'py>,
    name: &str,
    view: &impl Serialize,
) -> PyResult<Bound<'py, PyAny>> {
    let fields = pythonize::pythonize(py, view)?.cast_into::<PyDict>()?;
    class(py, name)?.call((), Some(&fields))
}

/// One tensor of a checkpoint as `TensorInfo` shows it: the core's row, with its file as a path.
pub struct TensorInfo(wf::TensorInfo, String);

impl TensorInfo {
    /// `t` as a loaded model holds it: in `dtype`, taking `nbytes`.
    pub(crate) fn held(
        ckpt: &wf::Checkpoint,
        t: &wf::TensorInfo,
        dtype: wf::DType,
        nbytes: u64,
    ) -> Self {
        let file = ckpt.files().nth(t.file).map(|p| p.display().to_string());
        let row = wf::TensorInfo {
            dtype,
            nbytes,
            ..t.clone()
        };
        TensorInfo(row, file.unwrap_or_default())
    }

    pub(super) fn new(ckpt: &wf::Checkpoint, t: &wf::TensorInfo) -> Self {
        TensorInfo::held(ckpt, t, t.dtype, t.nbytes)
    }
}

impl<'py> IntoPyObject<'py> for TensorInfo {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        let fields = pythonize::pythonize(py, &self.0)?.cast_into::<PyDict>()?;
        fields.set_item("file", self.1)?;
        class(py, "TensorInfo")?.call((), Some(&fields))
    }
}

/// A checkpoint's architecture: the core's [`wf::ModelSpec`], whose fields are the Python
/// `ModelSpec`'s. Python hands one back (a plan source, `CacheSpec.nbytes`) as its `to_dict()`.
pub struct ModelSpec {
    pub(crate) inner: wf::ModelSpec,
}

impl ModelSpec {
    /// The spec `obj` holds when it is a `ModelSpec`, else `None`.
    pub(crate) fn of(obj: &Bound<'_, PyAny>) -> PyResult<Option<Self>> {
        if !obj.is_instance(&class(obj.py(), "ModelSpec")?)? {
            return Ok(None);
        }
        let inner = pythonize::depythonize(&obj.call_method0("to_dict")?).map_err(|e| {
            let fix = "take one from Checkpoint.spec and change it with dataclasses.replace";
            raise(Exc::Plan, format!("ModelSpec: {e}; {fix}"))
        })?;
        Ok(Some(ModelSpec { inner }))
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for ModelSpec {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        ModelSpec::of(&obj)?.ok_or_else(|| {
            let got = obj.get_type().name().map(|n| n.to_string());
            PyTypeError::new_err(format!(
                "expected a ModelSpec (Checkpoint.spec), got {}",
                got.unwrap_or_default()
            ))
        })
    }
}

//! Python bindings for weightlift-format: `open()` and `Checkpoint`, and (in `info`) the
//! read-only records the bindings hand out.

// `raw()` hands numpy a pointer into the memory map (`PyArray::borrow_from_array`), which is
// unsafe by signature; the SAFETY note there says why it is sound.
#![allow(unsafe_code)]

mod info;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use numpy::ndarray::{ArrayView1, IxDyn};
use numpy::{PyArray, PyArray1, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use weightlift_engine::dequantize::checkpoint_tensor_into;
use weightlift_format as wf;

use crate::errors::{Exc, enter, py_err, raise};
pub(crate) use info::record;
pub use info::{ModelSpec, TensorInfo};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(open, m)?)?;
    m.add_class::<Checkpoint>()?;
    Ok(())
}

/// Open a GGUF file (or the first of a split set), a safetensors file, a folder of safetensors
/// shards, or a `model.safetensors.index.json`. Nothing is copied: tensors stay in the memory
/// map. Every structural check runs before this returns.
///
/// `check_tensors` also scans every float tensor, and the scales of quantised blocks, for NaN and
/// Inf. `vocab_only` reads the metadata and tokenizer only (no tensor table).
///
/// Raises `FormatError` for a corrupt or unsupported file and an `OSError` subclass when the
/// operating system refuses it.
#[pyfunction]
#[pyo3(signature = (path, *, check_tensors = false, vocab_only = false))]
fn open(
    py: Python<'_>,
    path: PathBuf,
    check_tensors: bool,
    vocab_only: bool,
) -> PyResult<Checkpoint> {
    let options = wf::OpenOptions {
        check_tensors,
        vocab_only,
    };
    let ckpt = enter(py, || wf::Checkpoint::open(&path, options))?;
    Ok(Checkpoint::new(ckpt))
}

/// An opened checkpoint. Tensor data stays in the memory map; `raw()` views share it.
///
/// Usable as a context manager. `close()` drops this object's hold on the files; views already
/// handed out by `raw()` keep the map alive until the last of them is gone.
#[pyclass(module = "weightlift._native", frozen)]
pub struct Checkpoint {
    inner: Mutex<Option<Arc<wf::Checkpoint>>>,
    path: String,
    format: &'static str,
}

/// The owner of the memory a `raw()` view points into: numpy holds it as the array's base.
#[pyclass(module = "weightlift._native", frozen, name = "_MappedView")]
struct MappedView {
    _ckpt: Arc<wf::Checkpoint>,
}

impl Checkpoint {
    pub(crate) fn new(ckpt: wf::Checkpoint) -> Self {
        Checkpoint {
            path: ckpt.path().display().to_string(),
            format: ckpt.format().name(),
            inner: Mutex::new(Some(Arc::new(ckpt))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Arc<wf::Checkpoint>>> {
        // A poisoned lock only means another thread panicked while holding it; the Option inside
        // is always in a valid state.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The checkpoint, shared; fails once `close()` has been called.
    pub(crate) fn shared(&self) -> PyResult<Arc<wf::Checkpoint>> {
        self.lock().clone().ok_or_else(|| {
            raise(
                Exc::Closed,
                format!(
                    "checkpoint '{}' is closed; open it again to read it",
                    self.path
                ),
            )
        })
    }
}

#[pymethods]
impl Checkpoint {
    /// `"gguf"` or `"safetensors"`.
    #[getter]
    fn format(&self) -> &'static str {
        self.format
    }

    /// The path that was opened (a file, a folder or an index).
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// True once `close()` has been called.
    #[getter]
    fn closed(&self) -> bool {
        self.lock().is_none()
    }

    /// The files that make up the checkpoint, in order.
    #[getter]
    fn files(&self) -> PyResult<Vec<String>> {
        let ckpt = self.shared()?;
        Ok(ckpt.files().map(|p| p.display().to_string()).collect())
    }

    /// GGUF key/value metadata, or safetensors `__metadata__`, as Python values in file order.
    /// Arrays (nested ones too) become lists.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, self.shared()?.metadata())?)
    }

    /// The architecture, or None when it could not be read (see `spec_error`).
    #[getter]
    fn spec<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let ckpt = self.shared()?;
        ckpt.spec()
            .ok()
            .map(|s| record(py, "ModelSpec", s))
            .transpose()
    }

    /// Why `spec` is None, or None when it is present.
    #[getter]
    fn spec_error(&self) -> PyResult<Option<String>> {
        let ckpt = self.shared()?;
        Ok(ckpt.spec().err().map(str::to_owned))
    }

    /// Things that did not stop the checkpoint from opening: an architecture whose tensor roles
    /// are unknown, tensors that match no role, a tie the config contradicts.
    #[getter]
    fn warnings(&self) -> PyResult<Vec<String>> {
        Ok(self.shared()?.warnings().to_vec())
    }

    /// The tensor table, in the order the checkpoint lists it (empty when opened `vocab_only`).
    #[getter]
    fn tensors(&self) -> PyResult<Vec<TensorInfo>> {
        let ckpt = self.shared()?;
        Ok(ckpt
            .tensors()
            .iter()
            .map(|t| TensorInfo::new(&ckpt, t))
            .collect())
    }

    /// A summary of the tokenizer: `model`, `pre`, `n_tokens`, `n_merges`, `bos_token_id`,
    /// `eos_token_id` and `has_tokenizer_json`.
    #[getter]
    fn tokenizer<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, self.shared()?.tokenizer())?)
    }

    /// The HF `config.json` beside safetensors weights, as a dict; None for GGUF.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let ckpt = self.shared()?;
        Ok(ckpt
            .config()
            .map(|c| pythonize::pythonize(py, c))
            .transpose()?)
    }

    /// Total number of parameters (elements over all tensors).
    #[getter]
    fn n_params(&self) -> PyResult<u64> {
        Ok(self.shared()?.n_params())
    }

    /// Total bytes of tensor data.
    #[getter]
    fn nbytes(&self) -> PyResult<u64> {
        Ok(self.shared()?.total_bytes())
    }

    /// The stored bytes of a tensor as a read-only numpy view that shares the memory map (no
    /// copy) and keeps it alive, even after `close()`.
    ///
    /// Plain types numpy can represent (F32, F16, F64, I8..I64, U8..U64, BOOL, C64) come back
    /// typed and shaped as `TensorInfo.shape`. Everything else (BF16, the F8/F6/F4 floats and
    /// every block-quantised type) comes back as uint8 rows of the stored bytes,
    /// `shape[:-1] + (bytes per row,)`, as gguf-py's reader shows them and as `Model.tensor`
    /// returns the same tensor.
    fn raw<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        let ckpt = self.shared()?;
        let info = ckpt.tensor(name).map_err(py_err)?;
        let bytes = ckpt.bytes(info);
        let owner = Bound::new(
            py,
            MappedView {
                _ckpt: Arc::clone(&ckpt),
            },
        )?;
        // SAFETY: `bytes` points into a read-only memory map owned by `wf::Checkpoint`, which
        // `owner` keeps alive through its Arc for as long as numpy holds `owner` as the array's
        // base. The map is never remapped, resized or written through while it is shared, and
        // the view is made non-writeable below before Python can see it.
        let array = unsafe {
            PyArray1::<u8>::borrow_from_array(&ArrayView1::from(bytes), owner.into_any())
        };
        let kwargs = PyDict::new(py);
        kwargs.set_item("write", false)?;
        array.call_method("setflags", (), Some(&kwargs))?;
        let (name, dims) = info.dtype.numpy_layout(&info.shape);
        // numpy handles an unaligned start itself (the view is flagged not ALIGNED).
        array
            .call_method1("view", (name,))?
            .call_method1("reshape", (PyTuple::new(py, dims)?,))
    }

    /// The tensor dequantised to float32, shaped as `TensorInfo.shape`.
    ///
    /// With `out`, the values are written into that array instead (C-contiguous, writeable,
    /// float32, of the tensor's shape), which is returned; without it a new array is made.
    /// Raises `FormatError` for a name the checkpoint does not hold, or a type without a
    /// dequantiser, and `ValueError` for an unsuitable `out`.
    #[pyo3(signature = (name, out = None))]
    fn dequantize<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        out: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray<f32, IxDyn>>> {
        let ckpt = self.shared()?;
        let shape = ckpt.tensor(name).map_err(py_err)?.shape.clone();
        let unfit =
            |what: String| PyValueError::new_err(format!("dequantize('{name}', out=...): {what}"));
        let out = match out.filter(|o| !o.is_none()) {
            Some(out) => {
                let out = out.cast_into::<PyArrayDyn<f32>>().map_err(|e| {
                    let got = e.into_inner();
                    let what = got
                        .getattr("dtype")
                        .map(|d| format!("a numpy array of {d}"))
                        .unwrap_or_else(|_| {
                            got.get_type()
                                .name()
                                .map_or_else(|_| "?".to_owned(), |n| n.to_string())
                        });
                    PyTypeError::new_err(format!(
                        "dequantize('{name}', out=...): expected a float32 numpy array of shape \
                         {shape:?}, got {what}; allocate it with np.empty(shape, np.float32)"
                    ))
                })?;
                let got: Vec<u64> = out.shape().iter().map(|&d| d as u64).collect();
                if got != shape {
                    return Err(unfit(format!(
                        "expected an array of shape {shape:?}, got {got:?}"
                    )));
                }
                // `as_slice_mut` below takes a Fortran-ordered array too.
                if !out.is_c_contiguous() {
                    return Err(unfit("the array must be C-contiguous".into()));
                }
                out
            }
            // Without `out`, a new array that the dequantiser fills as it would a given one.
            None => {
                let dims: Vec<usize> = shape
                    .iter()
                    .map(|&d| usize::try_from(d))
                    .collect::<Result<_, _>>()
                    .map_err(|_| {
                        raise(
                            Exc::Format,
                            format!("tensor '{name}' shape {shape:?} does not fit in memory"),
                        )
                    })?;
                PyArrayDyn::zeros(py, dims, false)
            }
        };
        {
            let mut rw = out.try_readwrite().map_err(|e| unfit(e.to_string()))?;
            let slice = rw
                .as_slice_mut()
                .map_err(|_| unfit("the array must be C-contiguous".into()))?;
            enter(py, || {
                checkpoint_tensor_into(&ckpt, ckpt.tensor(name)?, slice)
            })?;
        }
        Ok(out)
    }

    /// Drop this object's hold on the files. Later reads raise `ClosedError`; views from `raw()`
    /// stay valid.
    fn close(&self) {
        self.lock().take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        self.close();
        false
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.shared()?.tensors().len())
    }

    fn __contains__(&self, name: &str) -> PyResult<bool> {
        Ok(self.shared()?.tensor(name).is_ok())
    }

    /// The `TensorInfo` of a tensor by name; KeyError when absent.
    fn __getitem__(&self, name: &str) -> PyResult<TensorInfo> {
        let ckpt = self.shared()?;
        match ckpt.tensor(name) {
            Ok(t) => Ok(TensorInfo::new(&ckpt, t)),
            Err(_) => Err(pyo3::exceptions::PyKeyError::new_err(name.to_owned())),
        }
    }

    /// Iterate over tensor names.
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let ckpt = self.shared()?;
        let names: Vec<&str> = ckpt.tensors().iter().map(|t| t.name.as_str()).collect();
        PyList::new(py, names)?.try_iter().map(Bound::into_any)
    }

    fn __repr__(&self) -> String {
        match self.lock().as_ref() {
            Some(c) => format!(
                "<Checkpoint {} '{}': {} tensors, {} bytes>",
                self.format,
                self.path,
                c.tensors().len(),
                c.total_bytes()
            ),
            None => format!("<Checkpoint {} '{}' (closed)>", self.format, self.path),
        }
    }
}

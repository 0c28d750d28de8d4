//! Python bindings for weightlift-format: the native side of `weightlift.Checkpoint`, and (in
//! `info`) the read-only records the bindings hand out.

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
use pyo3::types::{PyCapsule, PyTuple};
use weightlift_engine::dequantize::checkpoint_tensor_into;
use weightlift_format as wf;

use crate::errors::{Exc, enter, py_err, raise};
pub use info::{ModelSpec, TensorInfo};
pub(crate) use info::{class, record};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Checkpoint>()?;
    Ok(())
}

/// The native side of `weightlift.Checkpoint` (declared in `weightlift/_types.py`): the shared
/// checkpoint, its views and what reads the tensor data.
#[pyclass(module = "weightlift._native", frozen, subclass)]
pub struct Checkpoint {
    inner: Mutex<Option<Arc<wf::Checkpoint>>>,
    /// The path that was opened (a file, a folder or an index).
    #[pyo3(get)]
    path: String,
    /// `"gguf"` or `"safetensors"`.
    #[pyo3(get)]
    format: &'static str,
}

impl Checkpoint {
    fn lock(&self) -> MutexGuard<'_, Option<Arc<wf::Checkpoint>>> {
        // A poisoned lock only means another thread panicked while holding it; the Option inside
        // is always in a valid state.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The checkpoint, shared; fails once `close()` has been called.
    pub(crate) fn shared(&self) -> PyResult<Arc<wf::Checkpoint>> {
        self.lock().clone().ok_or_else(|| {
            let path = &self.path;
            raise(
                Exc::Closed,
                format!("checkpoint '{path}' is closed; open it again to read it"),
            )
        })
    }
}

#[pymethods]
impl Checkpoint {
    /// `weightlift.open`, whose docstring is in `weightlift/_types.py`.
    #[new]
    #[pyo3(signature = (path, *, check_tensors = false, vocab_only = false))]
    fn new(py: Python<'_>, path: PathBuf, check_tensors: bool, vocab_only: bool) -> PyResult<Self> {
        let options = wf::OpenOptions {
            check_tensors,
            vocab_only,
        };
        let ckpt = enter(py, || wf::Checkpoint::open(&path, options))?;
        Ok(Checkpoint {
            path: ckpt.path().display().to_string(),
            format: ckpt.format().name(),
            inner: Mutex::new(Some(Arc::new(ckpt))),
        })
    }

    /// True once `close()` has been called.
    #[getter]
    fn closed(&self) -> bool {
        self.lock().is_none()
    }

    /// What the properties of `weightlift.Checkpoint` read ([`wf::Checkpoint::view`]).
    fn _view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, &self.shared()?.view())?)
    }

    /// How the layers route to experts (`n_experts`, `n_used`, `expert_ffn`, `norm_topk_prob`,
    /// `dense_layers`), or None for a dense model: the reading plans and the forward pass use.
    fn _experts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let moe = weightlift_engine::planned::moe_of(&*self.shared()?).map_err(py_err)?;
        let shown = moe.map(|m| {
            serde_json::json!({
                "n_experts": m.n_experts,
                "n_used": m.n_used,
                "expert_ffn": m.expert_ffn,
                "norm_topk_prob": m.norm_topk_prob,
                "dense_layers": m.dense_layers,
            })
        });
        Ok(pythonize::pythonize(py, &shown)?)
    }

    /// The sliding-window layers (`window`, and `layers`: the indexes of the layers that attend
    /// to it), or None: the reading plans, the cache and the forward pass use.
    fn _sliding_window<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let ckpt = self.shared()?;
        let Ok(spec) = ckpt.spec() else {
            return Ok(py.None().into_bound(py));
        };
        let window = weightlift_engine::planned::sliding_window_of(&ckpt, spec).map_err(py_err)?;
        let shown = window.map(|w| {
            let layers: Vec<usize> = (0..w.layers.len()).filter(|&l| w.is_sliding(l)).collect();
            serde_json::json!({"window": w.window, "layers": layers})
        });
        Ok(pythonize::pythonize(py, &shown)?)
    }

    /// The RoPE scaling the forward pass applies (`kind`, `factor`, `original_context`,
    /// `from`), or None for plain RoPE.
    fn _rope_scaling<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let ckpt = self.shared()?;
        let Ok(spec) = ckpt.spec() else {
            return Ok(py.None().into_bound(py));
        };
        let scaling = weightlift_engine::forward::rope_scaling_of(ckpt.as_ref(), spec);
        Ok(pythonize::pythonize(py, &scaling.map_err(py_err)?)?)
    }

    /// GGUF key/value metadata, or safetensors `__metadata__`, as Python values in file order.
    /// Arrays (nested ones too) become lists.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, self.shared()?.metadata())?)
    }

    /// [`Checkpoint::metadata`] without the arrays (a vocabulary's tokens, merges and types),
    /// which are most of its conversion time: what `Llama.metadata` lists.
    fn _scalar_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let ckpt = self.shared()?;
        let scalars: weightlift_format::Metadata = (ckpt.metadata())
            .iter()
            .filter(|(_, v)| !matches!(v, weightlift_format::MetaValue::Array(_)))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Ok(pythonize::pythonize(py, &scalars)?)
    }

    /// The number of tensors, without building the rest of the view.
    fn __len__(&self) -> PyResult<usize> {
        Ok(self.shared()?.tensors().len())
    }

    /// The tensor names, in the order the checkpoint lists them.
    fn _names(&self) -> PyResult<Vec<String>> {
        let ckpt = self.shared()?;
        Ok(ckpt.tensors().iter().map(|t| t.name.clone()).collect())
    }

    /// Every tensor's `TensorInfo`, in the order the checkpoint lists them.
    fn _tensors(&self) -> PyResult<Vec<TensorInfo>> {
        let ckpt = self.shared()?;
        let rows = ckpt.tensors().iter();
        Ok(rows.map(|t| TensorInfo::new(&ckpt, t)).collect())
    }

    /// The `TensorInfo` of tensor `name`, or None when the checkpoint has none of that name.
    fn _tensor(&self, name: &str) -> PyResult<Option<TensorInfo>> {
        let ckpt = self.shared()?;
        Ok(ckpt.tensor(name).ok().map(|t| TensorInfo::new(&ckpt, t)))
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
        // The owner of the memory the view points into, which numpy holds as the array's base.
        let owner = PyCapsule::new_with_value(py, Arc::clone(&ckpt), c"weightlift.checkpoint")?;
        // SAFETY: `bytes` points into a read-only memory map owned by `wf::Checkpoint`, which
        // `owner` keeps alive through its Arc for as long as numpy holds `owner` as the array's
        // base. The map is never remapped, resized or written through while it is shared, and
        // the view is made non-writeable below before Python can see it.
        let array = unsafe {
            PyArray1::<u8>::borrow_from_array(&ArrayView1::from(bytes), owner.into_any())
        };
        array.call_method1("setflags", (false,))?;
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
        let shape = &ckpt.tensor(name).map_err(py_err)?.shape;
        let unfit =
            |what: String| PyValueError::new_err(format!("dequantize('{name}', out=...): {what}"));
        // Without `out`, a new array that the dequantiser fills as it would a given one.
        let out = match out.filter(|o| !o.is_none()) {
            Some(out) => out,
            None => py
                .import("numpy")?
                .call_method1("zeros", (shape, "float32"))?,
        };
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
        if got != *shape {
            return Err(unfit(format!(
                "expected an array of shape {shape:?}, got {got:?}"
            )));
        }
        // `as_slice_mut` below takes a Fortran-ordered array too.
        if !out.is_c_contiguous() {
            return Err(unfit("the array must be C-contiguous".into()));
        }
        {
            let mut rw = out.try_readwrite().map_err(|e| unfit(e.to_string()))?;
            let slice = rw.as_slice_mut().map_err(|e| unfit(e.to_string()))?;
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
}

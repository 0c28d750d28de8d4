//! `Model`: the engine's [`Session`] behind a lock. `weightlift/_api.py` declares and documents
//! the class; its loads and properties reach the session through the few calls here. A load's
//! progress goes to the user's callback, which may cancel it, as Ctrl-C does. (`progress=True`'s
//! bar is the command line's, put in front of the callback by `weightlift/_api.py`.)

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use numpy::PyArray1;
use pyo3::exceptions::{PyAttributeError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyBool;
use weightlift_engine::keywords::LoadCall;
use weightlift_engine::session::{Session, Setting, Settings};
use weightlift_engine::{EngineError, Progress};
use weightlift_format as wf;

use crate::cache::Cache;
use crate::devices::{inventory_for, to_numpy};
use crate::errors::{eng, enter, py_err};
use crate::format::{Checkpoint, TensorInfo};
use crate::options::Kw;
use crate::tp::TPContext;

/// A model's state behind its lock: the engine session, and the `Model.tp` object handed out
/// for the current load.
pub(crate) struct ModelInner {
    pub(crate) session: Session,
    tp_obj: Option<Py<TPContext>>,
}

impl Deref for ModelInner {
    type Target = Session;
    fn deref(&self) -> &Session {
        &self.session
    }
}

impl DerefMut for ModelInner {
    fn deref_mut(&mut self) -> &mut Session {
        &mut self.session
    }
}

/// A model: a checkpoint and the devices it may use. Nothing is loaded until `load()`,
/// `load_autosplit()` or `load_tp()`.
#[pyclass(module = "weightlift._native", frozen, subclass)]
pub struct Model {
    pub(crate) inner: Mutex<ModelInner>,
    pub(crate) checkpoint: Arc<wf::Checkpoint>,
}

impl Model {
    /// The model's state, for any call but `close()`: `ClosedError` once closed.
    pub(crate) fn lock(&self) -> PyResult<MutexGuard<'_, ModelInner>> {
        let g = self.lock_even_closed()?;
        eng(g.check_open())?;
        Ok(g)
    }

    fn lock_even_closed(&self) -> PyResult<MutexGuard<'_, ModelInner>> {
        match self.inner.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(PyRuntimeError::new_err(
                "the model is busy: a load or a generation is running (on another thread, or this \
                 call came from a logits processor or stopping criterion of that generation)",
            )),
        }
    }
}

#[pymethods]
impl Model {
    /// `weightlift.Model(checkpoint, **kw)`, whose signature and docstring are in
    /// `weightlift/_api.py` (which opens a path).
    #[new]
    fn new(checkpoint: &Bound<'_, Checkpoint>, kw: Kw<'_>) -> PyResult<Self> {
        let (checkpoint, kw) = (checkpoint.get().shared()?, kw.data()?);
        let settings = eng(Settings::from_keywords(&kw))?;
        let devices = kw.devices().map_err(py_err)?;
        let inventory = inventory_for(devices.as_deref())?;
        let source = Arc::clone(&checkpoint) as _;
        let session = eng(Session::new(source, inventory, devices, settings))?;
        let inner = Mutex::new(ModelInner {
            session,
            tp_obj: None,
        });
        Ok(Model { inner, checkpoint })
    }

    /// The load `call` ([`LoadCall`]: `Model.load`, `load_autosplit`, `load_tp`, and the loads
    /// of `from_pretrained` and `load_gguf`, declared in `weightlift/_api.py`) with its keywords
    /// `kw`, which the core reads; a `Cache` and the callbacks are taken here. The GIL is
    /// released while it runs, and taken again only to check for Ctrl-C and to call the
    /// callback; a cancellation by either raises their exception once everything is freed.
    fn _load(&self, py: Python<'_>, call: &str, kw: Kw<'_>) -> PyResult<()> {
        let call = eng(LoadCall::parse(call))?;
        let cache = kw.any("cache")?;
        let cache = cache.and_then(|c| Some(Arc::clone(&c.cast::<Cache>().ok()?.get().cache)));
        // llama.cpp's `progress_callback` takes one float, the fraction done.
        let (is_fraction, callback) = match kw.any("progress_callback")? {
            Some(f) => (true, Some(f.unbind())),
            None => (false, kw.opt("callback")?),
        };
        let (data, mut error) = (kw.data()?, None);
        let mut report = |p: &Progress<'_>| {
            Python::attach(|py| {
                let go_on = py.check_signals().and_then(|()| {
                    let Some(f) = &callback else { return Ok(true) };
                    let v = match is_fraction {
                        true => f.call1(py, (p.fraction(),)),
                        false => f.call1(py, (p.bytes_done, p.bytes_total, p.tensor, p.device)),
                    }?;
                    Ok(!v.is(&*PyBool::new(py, false)))
                });
                go_on.unwrap_or_else(|e| {
                    error = Some(e);
                    false
                })
            })
        };
        let mut inner = self.lock()?;
        let session = &mut inner.session;
        let r = py.detach(|| session.load_keywords(call, &data, cache, &mut report));
        match (r, error) {
            (Err(EngineError::Cancelled { .. }), Some(e)) => Err(e),
            (r, _) => eng(r),
        }
    }

    fn unload(&self, py: Python<'_>) -> PyResult<()> {
        let mut inner = self.lock()?;
        let session = &mut inner.session;
        enter(py, || {
            session.unload();
            Ok::<(), PyErr>(())
        })
    }

    /// The session as the properties of `weightlift/_api.py` read it ([`Session::view`]).
    fn _state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, &self.lock()?.view())?)
    }

    /// Change the setting `name` (a [`Setting`]) to `value`: the setters of `weightlift/_api.py`.
    fn _set(&self, name: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let setting = match name {
            "compute" => Setting::Compute(value.extract()?),
            "cuda_graphs" => Setting::CudaGraphs(value.extract()?),
            "int8_threshold" => Setting::Int8Threshold(value.extract()?),
            "chat_format" => Setting::ChatFormat(value.extract()?),
            _ => return Err(PyAttributeError::new_err(name.to_owned())),
        };
        eng(self.lock()?.set(setting))
    }

    /// The same object for as long as the load it was made for lasts.
    #[getter]
    fn tp(&self, py: Python<'_>) -> PyResult<Option<Py<TPContext>>> {
        let mut inner = self.lock()?;
        let Some(shared) = inner.model.tp_context_shared() else {
            inner.tp_obj = None;
            return Ok(None);
        };
        if let Some(obj) = inner.tp_obj.as_ref().filter(|o| o.get().shares(&shared)) {
            return Ok(Some(obj.clone_ref(py)));
        }
        let cpu = Arc::clone(inner.model.inventory().cpu());
        let obj = crate::tp::TPContext::from_shared(py, shared, cpu)?;
        inner.tp_obj = Some(obj.clone_ref(py));
        Ok(Some(obj))
    }

    #[getter]
    fn plan(&self) -> PyResult<Option<crate::plan::Plan>> {
        let plan = self.lock()?.plan.clone();
        Ok(plan.map(|inner| crate::plan::Plan { inner }))
    }

    fn device_of(&self, name: &str) -> PyResult<String> {
        eng(self.lock()?.model.device_of(name))
    }

    #[getter]
    fn layer_devices(&self) -> PyResult<Vec<String>> {
        Ok(eng(self.lock()?.model.layer_devices())?.to_vec())
    }

    #[pyo3(signature = (name, dequantize = false))]
    fn tensor<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        dequantize: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.lock()?;
        if dequantize {
            let session = &inner.session;
            let d = enter(py, || session.dequantized(name))?;
            drop(inner);
            return PyArray1::from_vec(py, d.values).call_method1("reshape", (d.shape,));
        }
        let (bytes, dtype, shape) = eng(inner.model.tensor_bytes(name))?;
        drop(inner);
        to_numpy(py, &bytes, dtype, &shape)
    }

    fn tensor_info(&self, name: &str) -> PyResult<TensorInfo> {
        let inner = self.lock()?;
        let (dtype, nbytes) = eng(inner.model.held_type(name))?;
        let info = eng(inner.model.tensor_info(name))?;
        Ok(TensorInfo::held(&self.checkpoint, info, dtype, nbytes))
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let mut inner = self.lock_even_closed()?;
        inner.tp_obj = None;
        let session = &mut inner.session;
        enter(py, || {
            session.close();
            Ok::<(), PyErr>(())
        })
    }

    #[getter]
    fn closed(&self) -> PyResult<bool> {
        Ok(self.lock_even_closed()?.is_closed())
    }

    #[getter]
    fn cache(&self, py: Python<'_>) -> PyResult<Option<Py<crate::cache::Cache>>> {
        let cache = self.lock()?.model.own_cache().ok();
        cache
            .map(|c| crate::cache::Cache::object(py, c))
            .transpose()
    }

    fn __repr__(&self) -> String {
        let path = self.checkpoint.path().display();
        match self.inner.try_lock() {
            Ok(i) if i.is_closed() => format!("Model('{path}', closed)"),
            // Python's spelling of the flag, as the repr of a Python object shows it.
            Ok(i) => format!(
                "Model('{path}', devices='{}', loaded={})",
                i.devices,
                if i.model.is_loaded() { "True" } else { "False" }
            ),
            Err(_) => format!("Model('{path}', loading)"),
        }
    }
}

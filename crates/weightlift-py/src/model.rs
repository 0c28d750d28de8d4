//! `Model`: a checkpoint, its devices and, once loaded, its tensors and plan.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use numpy::PyArray1;
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use weightlift_engine::session::{LoadCache, Session, Settings};
use weightlift_engine::{self as we, LoadOptions, Progress};
use weightlift_format as wf;
use weightlift_plan as wp;

use crate::cache::Cache;
use crate::devices::{inventory_for, to_numpy};
use crate::errors::{eng, enter, py_err};
use crate::options::Kw;
use crate::progress::Reporter;

/// A model's state behind its lock: the engine session, and the `Model.tp` object handed out
/// for the current load.
pub(crate) struct ModelInner {
    pub(crate) session: Session,
    tp_obj: Option<Py<crate::tp::TPContext>>,
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

    pub(crate) fn open_source(
        source: &Bound<'_, PyAny>,
        open: wf::OpenOptions,
    ) -> PyResult<Arc<wf::Checkpoint>> {
        if let Ok(c) = source.cast::<crate::format::Checkpoint>() {
            return c.get().shared();
        }
        let path: PathBuf = source.extract().map_err(|_| {
            PyTypeError::new_err("source must be a weightlift.Checkpoint or a path")
        })?;
        enter(source.py(), || wf::Checkpoint::open(&path, open)).map(Arc::new)
    }

    /// `load` (a [`Session`] load, reporting progress) with the GIL released.
    pub(crate) fn run_load<F>(
        &self,
        py: Python<'_>,
        mut reporter: Reporter,
        load: F,
    ) -> PyResult<()>
    where
        F: FnOnce(&mut Session, &mut dyn FnMut(&Progress<'_>) -> bool) -> we::Result<()> + Send,
    {
        let mut inner = self.lock()?;
        let session = &mut inner.session;
        // Released by hand rather than through `enter`: the reporter re-attaches during the
        // load to call the user's callback and check for Ctrl-C, and `finish` maps a
        // cancellation (by either) to its exception once everything is freed.
        let r = py.detach(|| load(session, &mut |p| reporter.report(p)));
        reporter.finish(r)
    }
}

/// The engine cache a `Cache` shares (a `TypeError` for any other object).
fn cache_of(obj: &Bound<'_, PyAny>) -> PyResult<Arc<we::cache::Cache>> {
    let cache = (obj.cast::<Cache>()).map_err(|e| PyTypeError::new_err(format!("cache: {e}")))?;
    Ok(Arc::clone(&cache.get().cache))
}

fn plan_from_obj(plan: &Bound<'_, PyAny>) -> PyResult<wp::Plan> {
    let json: String = if let Ok(s) = plan.extract::<String>() {
        s
    } else {
        plan.call_method0("to_json")?.extract()?
    };
    wp::Plan::from_json(&json).map_err(py_err)
}

#[pymethods]
impl Model {
    /// `weightlift.Model(source, **kw)` (the signature and docstring are in
    /// `weightlift/_api.py`); `vocab_only` opens the metadata and tokenizer only.
    #[new]
    pub(crate) fn new(source: &Bound<'_, PyAny>, kw: Kw<'_>) -> PyResult<Self> {
        let kw = kw.data()?;
        let vocab_only = kw.get("vocab_only").map_err(py_err)?.unwrap_or_default();
        let open = wf::OpenOptions {
            check_tensors: false,
            vocab_only,
        };
        let ckpt = Model::open_source(source, open)?;
        let settings = eng(Settings::from_keywords(&kw))?;
        let devices = kw.devices().map_err(py_err)?;
        let inv = inventory_for(devices.as_deref())?;
        let src: Arc<dyn we::Source> = Arc::clone(&ckpt) as Arc<dyn we::Source>;
        let session = eng(Session::new(src, inv, devices, settings))?;
        Ok(Model {
            inner: Mutex::new(ModelInner {
                session,
                tp_obj: None,
            }),
            checkpoint: ckpt,
        })
    }

    /// `Model.load`; see `weightlift/_api.py`. `cache` is a `Cache` to load beside the layers,
    /// or the shape of one that the load makes itself, so that what is held is what the plan
    /// counted.
    fn _load(&self, py: Python<'_>, kw: Kw<'_>) -> PyResult<()> {
        let plan = kw.any("plan")?.map(|p| plan_from_obj(&p)).transpose()?;
        let data = kw.data()?;
        let cache = match kw.any("cache")? {
            Some(c) if c.is_instance_of::<Cache>() => LoadCache::Given(cache_of(&c)?),
            _ => (data.get("cache").map_err(py_err)?).map_or(LoadCache::None, LoadCache::Shape),
        };
        let options = data.load_plan_options().map_err(py_err)?;
        let read = eng(LoadOptions::from_keywords(&data))?;
        self.run_load(py, Reporter::from_kw(&kw)?, |s, p| {
            s.load(plan, options, cache, &read, p)
        })
    }

    /// `Model.load_autosplit`; see `weightlift/_api.py`.
    fn _load_autosplit(&self, py: Python<'_>, kw: Kw<'_>) -> PyResult<()> {
        let cache = kw.any("cache")?.map(|c| cache_of(&c)).transpose()?;
        let cache = cache.map_or(LoadCache::None, LoadCache::Given);
        let options = kw.data()?.autosplit_options().map_err(py_err)?;
        self.run_load(py, Reporter::from_kw(&kw)?, |s, p| {
            s.load(None, options, cache, &LoadOptions::default(), p)
        })
    }

    /// `Model.load_tp`; see `weightlift/_api.py`.
    fn _load_tp(&self, py: Python<'_>, kw: Kw<'_>) -> PyResult<()> {
        let options = kw.data()?.tensor_parallel_options().map_err(py_err)?;
        self.run_load(py, Reporter::from_kw(&kw)?, |s, p| {
            s.load(None, options, LoadCache::None, &LoadOptions::default(), p)
        })
    }

    fn unload(&self, py: Python<'_>) -> PyResult<()> {
        let mut inner = self.lock()?;
        let session = &mut inner.session;
        enter(py, || {
            session.unload();
            Ok::<(), PyErr>(())
        })
    }

    #[getter]
    fn tp(slf: &Bound<'_, Self>) -> PyResult<Option<Py<crate::tp::TPContext>>> {
        let py = slf.py();
        let m = slf.get();
        let mut inner = m.lock()?;
        let Some(shared) = inner.model.tp_context_shared() else {
            inner.tp_obj = None;
            return Ok(None);
        };
        if let Some(obj) = &inner.tp_obj
            && obj.get().shares(&shared)
        {
            return Ok(Some(obj.clone_ref(py)));
        }
        let cpu = Arc::clone(inner.model.inventory().cpu());
        let obj = crate::tp::TPContext::from_shared(py, shared, cpu)?;
        inner.tp_obj = Some(obj.clone_ref(py));
        Ok(Some(obj))
    }

    #[getter]
    fn loaded(&self) -> PyResult<bool> {
        Ok(self.lock()?.model.is_loaded())
    }

    #[getter]
    fn plan(&self) -> PyResult<Option<crate::plan::Plan>> {
        let plan = self.lock()?.plan.clone();
        Ok(plan.map(|inner| crate::plan::Plan { inner }))
    }

    fn plan_json(&self) -> PyResult<Option<String>> {
        Ok(self.lock()?.plan.as_ref().map(wp::Plan::to_json))
    }

    fn memory(&self) -> PyResult<HashMap<String, u64>> {
        Ok(self.lock()?.model.memory().into_iter().collect())
    }

    fn device_usage(&self) -> PyResult<HashMap<String, u64>> {
        Ok(self.lock()?.model.device_usage().into_iter().collect())
    }

    fn peak_memory(&self) -> PyResult<HashMap<String, u64>> {
        Ok(self.lock()?.model.peak_memory().into_iter().collect())
    }

    fn transfer_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.lock()?.model.transfer_stats();
        let d = PyDict::new(py);
        d.set_item("copies", c.count)?;
        d.set_item("bytes", c.bytes)?;
        d.set_item("seconds", c.seconds())?;
        Ok(d)
    }

    #[getter]
    fn devices(&self) -> PyResult<String> {
        Ok(self.lock()?.devices.clone())
    }

    #[getter]
    fn locked_bytes(&self) -> PyResult<u64> {
        Ok(self.lock()?.model.locked_bytes())
    }

    #[getter]
    fn warnings(&self) -> PyResult<Vec<String>> {
        Ok(self.lock()?.model.warnings().to_vec())
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
            let arr = PyArray1::from_vec(py, d.values);
            return arr.call_method1("reshape", (PyTuple::new(py, d.shape)?,));
        }
        let (bytes, dtype, shape) = eng(inner.model.tensor_bytes(name))?;
        drop(inner);
        to_numpy(py, &bytes, dtype, &shape)
    }

    fn tensor_info(&self, name: &str) -> PyResult<crate::format::TensorInfo> {
        let inner = self.lock()?;
        let (dtype, nbytes) = eng(inner.model.held_type(name))?;
        let info = eng(inner.model.tensor_info(name))?;
        Ok(crate::format::TensorInfo::held(
            &self.checkpoint,
            info,
            dtype,
            nbytes,
        ))
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

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    #[getter]
    fn cache(&self, py: Python<'_>) -> PyResult<Option<Py<crate::cache::Cache>>> {
        let inner = self.lock()?;
        if !inner.model.is_loaded() {
            return Ok(None);
        }
        inner
            .model
            .own_cache()
            .ok()
            .map(|cache| crate::cache::Cache::object(py, cache))
            .transpose()
    }

    fn __repr__(&self) -> String {
        match self.inner.try_lock() {
            Ok(i) if i.is_closed() => {
                format!("Model('{}', closed)", self.checkpoint.path().display())
            }
            Ok(i) => format!(
                "Model('{}', devices='{}', loaded={})",
                self.checkpoint.path().display(),
                i.devices,
                i.model.is_loaded()
            ),
            Err(_) => format!("Model('{}', loading)", self.checkpoint.path().display()),
        }
    }
}

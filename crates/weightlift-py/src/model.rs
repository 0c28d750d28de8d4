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

use crate::devices::{inventory_for, to_numpy};
use crate::errors::{eng, enter, py_err};
use crate::options::{
    CacheDTypeArg, CacheRef, CacheShape, DeviceMapValue, DevicesSpec, Overrides, RuntimeArg, Sizes,
};
use crate::plan::offload_arg;
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
#[pyclass(module = "weightlift._native", frozen)]
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

    /// A model of `ckpt` on `devices` (None: the real machine), nothing loaded yet.
    pub(crate) fn with_checkpoint(
        ckpt: Arc<wf::Checkpoint>,
        devices: Option<DevicesSpec>,
        settings: Settings,
    ) -> PyResult<Self> {
        let devices = devices.map(|d| d.0);
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
    /// `source`: a `Checkpoint` or a path. `devices`: the accelerator inventory as a spec
    /// (`"virtual:2x64MiB,cpu"`, `"cuda:0,cuda:1"`); unlisted, `cpu` holds only the input
    /// embedding (see `weightlift.plan`). `None` is the real
    /// machine: `cpu` plus every CUDA device found (in a build with the `cuda` feature). `dtype`: `"auto"`
    /// keeps stored dtypes, `"float16"` converts F32/BF16 weights. `runtime`: a `RuntimeSpec`
    /// or dict (`max_input_len`, `max_attention_size`, `max_dq_size`, `low_mem`). `compute`:
    /// `"fast"` (8-bit activations with quantised weights, as llama.cpp) or `"exact"` (f32 on
    /// dequantised weights). `n_threads`: the forward pass's threads (default: physical cores).
    /// `quantize`: `"int8"` (LLM.int8, as transformers' `load_in_8bit`), `"q8_0"`, `"q4_k"` or
    /// `"q6_k"` quantises a float checkpoint's linears while it loads; every plan of this model
    /// sizes them in that type (see `weightlift.plan`).
    #[new]
    #[pyo3(signature = (source, *, devices = None, dtype = "auto", runtime = None, compute = "fast", n_threads = None, quantize = None))]
    pub(crate) fn new(
        source: &Bound<'_, PyAny>,
        devices: Option<DevicesSpec>,
        dtype: &str,
        runtime: Option<RuntimeArg>,
        compute: &str,
        n_threads: Option<usize>,
        quantize: Option<&str>,
    ) -> PyResult<Self> {
        let ckpt = Model::open_source(source, wf::OpenOptions::default())?;
        let runtime = runtime.map(|r| r.0);
        let settings = eng(Settings::parse(
            dtype, compute, quantize, runtime, n_threads,
        ))?;
        Model::with_checkpoint(ckpt, devices, settings)
    }

    /// Load by `plan` (a `Plan` or its JSON), or plan now with the placement keywords of
    /// `weightlift.plan` (`strategy`, `reserve`, `max_memory`, `overhead`, `n_gpu_layers`,
    /// `split_mode`, `tensor_split`, `main_gpu`, `device_map`, `overrides`, `gpu_split`,
    /// `allow_disk`, `n_cpu_moe`), which mean here what they mean there. `offload="sequential"` or
    /// `"group"` runs the layers kept on cpu or disk on the first accelerator, copying their
    /// matrices in first (`blocks_per_group` layers at a time; `prefetch` copies the next group
    /// while one computes), as accelerate's and diffusers' offloading; `None` computes each
    /// layer where it is placed. `cache` is a `Cache` (allocated
    /// lazily, layer by layer beside each layer) or a `CacheSpec` or dict (the model allocates
    /// that cache itself).
    ///
    /// `callback(bytes_done, bytes_total, tensor, device)` returning False cancels: everything
    /// is freed and `LoadCancelled` is raised. Ctrl-C raises KeyboardInterrupt the same way.
    #[pyo3(signature = (plan = None, *, progress = false, callback = None, cache = None,
                        use_mmap = true, use_direct_io = false, check_tensors = false,
                        staging_bytes = None, strategy = None, reserve = None, max_memory = None,
                        overhead = None, n_gpu_layers = None, split_mode = None,
                        tensor_split = None, main_gpu = None, device_map = None, overrides = None,
                        gpu_split = None, allow_disk = None, offload = None, blocks_per_group = 1,
                        prefetch = true, n_cpu_moe = None))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        &self,
        py: Python<'_>,
        plan: Option<&Bound<'_, PyAny>>,
        progress: bool,
        callback: Option<Py<PyAny>>,
        cache: Option<CacheShape>,
        use_mmap: bool,
        use_direct_io: bool,
        check_tensors: bool,
        staging_bytes: Option<u64>,
        strategy: Option<String>,
        reserve: Option<Sizes>,
        max_memory: Option<Sizes>,
        overhead: Option<Sizes>,
        n_gpu_layers: Option<i64>,
        split_mode: Option<String>,
        tensor_split: Option<Vec<f32>>,
        main_gpu: Option<usize>,
        device_map: Option<DeviceMapValue>,
        overrides: Option<Overrides>,
        gpu_split: Option<Vec<f64>>,
        allow_disk: Option<bool>,
        offload: Option<String>,
        blocks_per_group: u32,
        prefetch: bool,
        n_cpu_moe: Option<u32>,
    ) -> PyResult<()> {
        let plan = plan
            .filter(|p| !p.is_none())
            .map(plan_from_obj)
            .transpose()?;
        let options = wp::PlanOptions {
            strategy,
            reserve: reserve.map(|s| s.0),
            max_memory: max_memory.map(|s| s.0),
            overhead: overhead.map(|s| s.0),
            n_gpu_layers,
            split_mode,
            tensor_split,
            main_gpu,
            device_map: device_map.map(|d| d.0),
            overrides: overrides.map(|o| o.0).unwrap_or_default(),
            gpu_split,
            allow_disk,
            offload: offload_arg(offload, blocks_per_group, prefetch)?,
            n_cpu_moe,
            ..wp::PlanOptions::default()
        };
        let mut opts = LoadOptions {
            use_mmap,
            use_direct_io,
            check_tensors,
            ..LoadOptions::default()
        };
        if let Some(s) = staging_bytes {
            opts.staging_bytes = s as usize;
        }
        let cache = cache.map_or(LoadCache::None, |c| c.0);
        self.run_load(py, Reporter::new(callback, progress), |s, p| {
            s.load(plan, options, cache, &opts, p)
        })
    }

    /// exllamav2's `load_autosplit`: fill the accelerators in order, each layer's cache beside
    /// it, keeping `reserve_vram` free (one size for every accelerator, a list in accelerator
    /// order, or a dict by device; bytes or strings such as `"256MiB"`).
    /// `offload` (with `blocks_per_group`, `prefetch`) runs the layers that spill to the cpu on
    /// the first accelerator, as in `load()`.
    #[pyo3(signature = (cache = None, reserve_vram = None, *, progress = false, callback = None,
                        offload = None, blocks_per_group = 1, prefetch = true))]
    #[allow(clippy::too_many_arguments)]
    fn load_autosplit(
        &self,
        py: Python<'_>,
        cache: Option<CacheRef>,
        reserve_vram: Option<Sizes>,
        progress: bool,
        callback: Option<Py<PyAny>>,
        offload: Option<String>,
        blocks_per_group: u32,
        prefetch: bool,
    ) -> PyResult<()> {
        let options = wp::PlanOptions {
            offload: offload_arg(offload, blocks_per_group, prefetch)?,
            ..wp::PlanOptions::autosplit(reserve_vram.map(|r| r.0))
        };
        let cache = cache.map_or(LoadCache::None, |c| LoadCache::Given(c.0));
        self.run_load(py, Reporter::new(callback, progress), |s, p| {
            s.load(None, options, cache, &LoadOptions::default(), p)
        })
    }

    /// exllamav2's `load_tp`: weights split over the accelerators by the TPContext tables.
    /// `gpu_split` in GB per device (None: each device's free memory); the expected cache
    /// (`expect_cache_tokens`, 0 = the model's context length; `expect_cache_base` a cache dtype)
    /// is subtracted when splitting, and the model holds that cache, each device its kv heads.
    /// `forward` and `generate` then run tensor-parallel on cpu and virtual devices, through
    /// `Model.tp`.
    ///
    /// Across processes (one per GPU, as torchrun starts them), `world` names the run's ranks
    /// (`"node0:4,node1:4"`) and `rank` this process's: the model's one accelerator stands for
    /// every rank in the plan, and only this rank's share is loaded on it. Its forward pass
    /// then meets the other ranks through the transport `Model.tp` is given
    /// (`TPContext.join_nccl()`, or a `TPContext.thread_group` member).
    #[pyo3(signature = (gpu_split = None, expect_cache_tokens = 0, expect_cache_base = None, *, progress = false, callback = None, world = None, rank = None))]
    #[allow(clippy::too_many_arguments)]
    fn load_tp(
        &self,
        py: Python<'_>,
        gpu_split: Option<Vec<f64>>,
        expect_cache_tokens: u64,
        expect_cache_base: Option<CacheDTypeArg>,
        progress: bool,
        callback: Option<Py<PyAny>>,
        world: Option<String>,
        rank: Option<usize>,
    ) -> PyResult<()> {
        let options = wp::PlanOptions {
            world,
            rank,
            ..wp::PlanOptions::tensor_parallel(
                gpu_split,
                expect_cache_tokens,
                expect_cache_base.map(|d| d.0),
            )
        };
        self.run_load(py, Reporter::new(callback, progress), |s, p| {
            s.load(None, options, LoadCache::None, &LoadOptions::default(), p)
        })
    }

    /// Free every tensor and cache layer this model holds.
    fn unload(&self, py: Python<'_>) -> PyResult<()> {
        let mut inner = self.lock()?;
        let session = &mut inner.session;
        enter(py, || {
            session.unload();
            Ok::<(), PyErr>(())
        })
    }

    /// The `TPContext` the forward pass runs through after `load_tp()` (its tables, its
    /// collectives and its staging buffers), the same object on every access; None otherwise.
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
        let obj = Py::new(py, crate::tp::TPContext::from_shared(shared, cpu))?;
        inner.tp_obj = Some(obj.clone_ref(py));
        Ok(Some(obj))
    }

    #[getter]
    fn loaded(&self) -> PyResult<bool> {
        Ok(self.lock()?.model.is_loaded())
    }

    /// The plan of the last load, or None.
    #[getter]
    fn plan(&self) -> PyResult<Option<crate::plan::Plan>> {
        let plan = self.lock()?.plan.clone();
        Ok(plan.map(|inner| crate::plan::Plan { inner }))
    }

    /// The last plan as JSON (None before a load).
    fn plan_json(&self) -> PyResult<Option<String>> {
        Ok(self.lock()?.plan.as_ref().map(wp::Plan::to_json))
    }

    /// Bytes held per device: weights (mmap views count on `cpu`), cache layers, scratch.
    fn memory(&self) -> PyResult<HashMap<String, u64>> {
        Ok(self.lock()?.model.memory().into_iter().collect())
    }

    /// Bytes allocated right now per device (arena accounting; mmap views are not allocations).
    fn device_usage(&self) -> PyResult<HashMap<String, u64>> {
        Ok(self.lock()?.model.device_usage().into_iter().collect())
    }

    /// The most bytes allocated at once per device since the last load began (the same
    /// accounting as `device_usage`): weights, cache, scratch and what forward passes held.
    fn peak_memory(&self) -> PyResult<HashMap<String, u64>> {
        Ok(self.lock()?.model.peak_memory().into_iter().collect())
    }

    /// Copies between devices during the last forward call: `copies` (count), `bytes` and
    /// `seconds` (wall time spent copying).
    fn transfer_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.lock()?.model.transfer_stats();
        let d = PyDict::new(py);
        d.set_item("copies", c.count)?;
        d.set_item("bytes", c.bytes)?;
        d.set_item("seconds", c.seconds())?;
        Ok(d)
    }

    /// The device spec this model was made with (with `devices=None`, the detected machine's,
    /// e.g. `"cuda:0,cpu"`).
    #[getter]
    fn devices(&self) -> PyResult<String> {
        Ok(self.lock()?.devices.clone())
    }

    /// Bytes of memory-mapped tensors locked in RAM (`use_mlock`).
    #[getter]
    fn locked_bytes(&self) -> PyResult<u64> {
        Ok(self.lock()?.model.locked_bytes())
    }

    /// Warnings from the last load (O_DIRECT fallback, unvalidated architecture, ...).
    #[getter]
    fn warnings(&self) -> PyResult<Vec<String>> {
        Ok(self.lock()?.model.warnings().to_vec())
    }

    /// The device of a tensor; a split tensor gives its devices joined by commas.
    fn device_of(&self, name: &str) -> PyResult<String> {
        eng(self.lock()?.model.device_of(name))
    }

    /// The device of each layer.
    #[getter]
    fn layer_devices(&self) -> PyResult<Vec<String>> {
        Ok(eng(self.lock()?.model.layer_devices())?.to_vec())
    }

    /// A numpy copy of a tensor from wherever it lives (split tensors are reassembled, CUDA
    /// memory is copied back). Raw quantised blocks come back as uint8 rows; `dequantize=True`
    /// gives float32, decoded at most `runtime.max_dq_size` values at a time so transient
    /// buffers stay within that chunk limit.
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

    /// A loaded tensor as it is held: its checkpoint entry with the held `dtype` (`"Q8_0"`,
    /// `"INT8"`, ... after a quantising load; `"F16"` after `dtype="float16"`) and the held
    /// `nbytes` (an INT8 tensor's include its f32 row scales).
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

    /// Free everything the model holds (as `unload()`, the own cache included) and refuse
    /// every later call with `ClosedError`. Closing twice does nothing; `with` closes on exit.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let mut inner = self.lock_even_closed()?;
        inner.tp_obj = None;
        let session = &mut inner.session;
        enter(py, || {
            session.close();
            Ok::<(), PyErr>(())
        })
    }

    /// True once `close()` has run.
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

    /// The cache generation and `forward(cache=None)` use: the one the model was loaded with,
    /// or the one it made for a prompt; None before either.
    #[getter]
    fn cache(&self) -> PyResult<Option<crate::cache::Cache>> {
        let inner = self.lock()?;
        if !inner.model.is_loaded() {
            return Ok(None);
        }
        Ok(inner
            .model
            .own_cache()
            .ok()
            .map(|cache| crate::cache::Cache { cache }))
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

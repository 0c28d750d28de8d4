//! `TPContext`: exllamav2's tensor-parallel context over the model's accelerators.
//! `weightlift.TPContext` is declared over this class in `weightlift/_objects.py` (its docs and
//! the split tables' properties); this converts.

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use weightlift_engine::tp::{TpArgs, TpContext, scratch_dtype};
use weightlift_engine::{self as we, Device};
use weightlift_format::DType;

use crate::devices::{DeviceTensor, to_numpy};
use crate::errors::{Exc, eng, enter, raise};
use crate::model::Model;
use crate::options::CacheDTypeArg;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TPContext>()?;
    m.add_class::<TPGroupMember>()?;
    m.add("BROADCAST_KV", we::tp::BROADCAST_KV)?;
    m.add("BROADCAST_ID", we::tp::BROADCAST_ID)?;
    m.add("BROADCAST_VC", we::tp::BROADCAST_VC)?;
    m.add("BROADCAST_RS", we::tp::BROADCAST_RS)?;
    m.add("BROADCAST_Q", we::tp::BROADCAST_Q)?;
    m.add("BROADCAST_EX", we::tp::BROADCAST_EX)?;
    Ok(())
}

#[pyclass(module = "weightlift._native", frozen, subclass, name = "TPContext")]
pub struct TPContext {
    ctx: Arc<Mutex<TpContext>>,
    cpu: Arc<Device>,
    staging_bytes: u64,
    /// The model a standalone context was made for (None for `Model.tp`, which the model owns).
    _model: Option<Py<Model>>,
}

/// One rank of a `TPContext.thread_group`: ranks run as threads of one process, each a model
/// of its own, meeting in shared memory. Given to that rank's context with `TPContext.join`.
#[pyclass(module = "weightlift._native", frozen, name = "TPGroupMember")]
pub struct TPGroupMember {
    rank: usize,
    member: Mutex<Option<we::tp::ThreadGroup>>,
}

#[pymethods]
impl TPGroupMember {
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    fn __repr__(&self) -> String {
        format!("TPGroupMember(rank={})", self.rank)
    }
}

/// `f` on the engine tensors of `list` (each held locked meanwhile); `what` names them when one
/// was freed.
fn with_tensors<T>(
    list: &[Bound<'_, DeviceTensor>],
    what: &str,
    f: impl FnOnce(&[&we::DeviceTensor]) -> PyResult<T>,
) -> PyResult<T> {
    let guards: Vec<_> = list.iter().map(|t| t.get().lock()).collect();
    let refs = guards
        .iter()
        .map(|g| g.as_ref())
        .collect::<Option<Vec<&we::DeviceTensor>>>()
        .ok_or_else(|| raise(Exc::Device, format!("{what} was freed")))?;
    f(&refs)
}

impl TPContext {
    /// The context a loaded model's forward pass runs through, as `weightlift.TPContext`.
    pub(crate) fn from_shared(
        py: Python<'_>,
        ctx: Arc<Mutex<TpContext>>,
        cpu: Arc<Device>,
    ) -> PyResult<Py<TPContext>> {
        let staging_bytes = ctx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .staging_bytes();
        let native = TPContext {
            ctx,
            cpu,
            staging_bytes,
            _model: None,
        };
        crate::cache::declared(py, Py::new(py, native)?, "TPContext")
    }

    /// Whether this is `ctx`.
    pub(crate) fn shares(&self, ctx: &Arc<Mutex<TpContext>>) -> bool {
        Arc::ptr_eq(&self.ctx, ctx)
    }

    fn lock(&self) -> MutexGuard<'_, TpContext> {
        self.ctx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[pymethods]
impl TPContext {
    /// `model` may be a `TPContext`: another handle of it (how [`crate::cache::declared`]
    /// makes one).
    #[new]
    #[pyo3(signature = (model, gpu_split = None, expect_cache_tokens = 0, expect_cache_base = None))]
    fn new(
        py: Python<'_>,
        model: &Bound<'_, PyAny>,
        gpu_split: Option<Vec<f64>>,
        expect_cache_tokens: u64,
        expect_cache_base: Option<CacheDTypeArg>,
    ) -> PyResult<Self> {
        if let Ok(t) = model.cast::<TPContext>() {
            let t = t.get();
            return Ok(TPContext {
                ctx: Arc::clone(&t.ctx),
                cpu: Arc::clone(&t.cpu),
                staging_bytes: t.staging_bytes,
                _model: t._model.as_ref().map(|m| m.clone_ref(py)),
            });
        }
        let model = model.cast::<Model>()?;
        let m = model.get();
        let inner = m.lock()?;
        let args = TpArgs {
            gpu_split,
            expect_cache_tokens,
            expect_cache_base: expect_cache_base.map(|d| d.0),
        };
        let session = &inner.session;
        let made = enter(py, || session.standalone_tp(args))?;
        drop(inner);
        Ok(TPContext {
            ctx: Arc::new(Mutex::new(made.ctx)),
            cpu: made.cpu,
            staging_bytes: made.staging_bytes,
            _model: Some(model.clone().unbind()),
        })
    }

    #[getter]
    fn peer_copies(&self) -> bool {
        self.lock().peer_copies()
    }
    #[setter]
    fn set_peer_copies(&self, on: bool) {
        self.lock().set_peer_copies(on);
    }

    #[getter]
    fn rank(&self) -> Option<usize> {
        self.lock().rank()
    }

    #[getter]
    fn transport(&self) -> &'static str {
        self.lock().collective().name()
    }

    #[staticmethod]
    fn thread_group(world_size: usize) -> PyResult<Vec<TPGroupMember>> {
        let members = eng(we::tp::ThreadGroup::new(world_size))?;
        Ok(members
            .into_iter()
            .map(|m| TPGroupMember {
                rank: m.rank(),
                member: Mutex::new(Some(m)),
            })
            .collect())
    }

    fn join(&self, member: &TPGroupMember) -> PyResult<()> {
        let mut ctx = self.lock();
        // Checked before the member is taken, so a refused one can still join its own rank.
        eng(ctx.check_member(member.rank))?;
        let taken = member
            .member
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(m) = taken else {
            return Err(PyValueError::new_err(format!(
                "join: the member for rank {} has joined a context already",
                member.rank
            )));
        };
        eng(ctx.join(m))
    }

    #[pyo3(signature = (wait = 300.0))]
    fn join_nccl(&self, py: Python<'_>, wait: f64) -> PyResult<(usize, usize)> {
        let ctx = &self.ctx;
        enter(py, || {
            let mut ctx = ctx
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            ctx.join_nccl(wait)
        })
    }

    fn get_split(&self, broadcast_type: usize) -> PyResult<Vec<(usize, u64, u64)>> {
        eng(self.lock().get_split(broadcast_type).cloned())
    }

    fn get_devs(&self, broadcast_type: usize) -> PyResult<Vec<usize>> {
        eng(self.lock().get_devs(broadcast_type))
    }

    fn all_devices(&self) -> Vec<usize> {
        self.lock().all_devices()
    }

    fn device_name(&self, i: usize) -> PyResult<String> {
        eng(self.lock().device(i).map(|d| d.name().to_owned()))
    }

    fn finalize(&self) -> PyResult<()> {
        eng(self.lock().finalize(&self.cpu, self.staging_bytes))
    }

    fn unload(&self) {
        self.lock().unload();
    }

    #[pyo3(signature = (buffer, tensor, broadcast_type, dim = 1))]
    fn broadcast(
        &self,
        buffer: usize,
        tensor: &Bound<'_, DeviceTensor>,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<Vec<DeviceTensor>> {
        let ctx = self.lock();
        tensor.get().with(|t| {
            eng(ctx.broadcast(buffer, t, broadcast_type, dim))
                .map(|v| v.into_iter().map(DeviceTensor::new).collect())
        })
    }

    #[pyo3(signature = (buffer, inputs, broadcast_type, dim = 1))]
    fn gather<'py>(
        &self,
        py: Python<'py>,
        buffer: usize,
        inputs: Vec<Bound<'py, DeviceTensor>>,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (bytes, rows, cols, dtype) = with_tensors(&inputs, "a gather input", |refs| {
            let dtype = refs.first().map_or(DType::F32, |t| t.dtype());
            let (bytes, rows, cols) = eng(self.lock().gather(buffer, refs, broadcast_type, dim))?;
            Ok((bytes, rows, cols, dtype))
        })?;
        to_numpy(py, &bytes, dtype, &[rows, cols])
    }

    #[pyo3(signature = (buffer, inputs, broadcast_type_g, broadcast_type_b, dim = 1))]
    fn allgather(
        &self,
        buffer: usize,
        inputs: Vec<Bound<'_, DeviceTensor>>,
        broadcast_type_g: usize,
        broadcast_type_b: usize,
        dim: u64,
    ) -> PyResult<Vec<DeviceTensor>> {
        let out = with_tensors(&inputs, "an allgather input", |refs| {
            eng(self
                .lock()
                .allgather(buffer, refs, broadcast_type_g, broadcast_type_b, dim))
        })?;
        Ok(out.into_iter().map(DeviceTensor::new).collect())
    }

    #[pyo3(signature = (target, source, broadcast_type, dim = 1))]
    fn add_residual(
        &self,
        target: Vec<Bound<'_, DeviceTensor>>,
        source: Vec<Bound<'_, DeviceTensor>>,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<()> {
        // Taken out while they are written, so a target also given as a source reads as freed.
        let mut taken = Vec::with_capacity(target.len());
        for t in &target {
            match t.get().lock().take() {
                Some(x) => taken.push(x),
                None => {
                    for (t, x) in target.iter().zip(taken) {
                        *t.get().lock() = Some(x);
                    }
                    return Err(raise(Exc::Device, "an add_residual target was freed"));
                }
            }
        }
        let result = with_tensors(
            &source,
            "an add_residual source (or one that is also a target)",
            |refs| {
                eng(self
                    .lock()
                    .add_residual(&mut taken, refs, broadcast_type, dim))
            },
        );
        for (t, x) in target.iter().zip(taken) {
            *t.get().lock() = Some(x);
        }
        result
    }

    fn wait_streams(&self) -> PyResult<()> {
        eng(self.lock().wait_streams())
    }

    fn get_sin_cos(&self) -> PyResult<(Vec<DeviceTensor>, Vec<DeviceTensor>)> {
        let mut ctx = self.lock();
        let tables = eng(ctx.get_sin_cos())?;
        let mut sin = Vec::new();
        let mut cos = Vec::new();
        for (s, c) in tables {
            sin.push(DeviceTensor::new(eng(s.copy_to(s.device()))?));
            cos.push(DeviceTensor::new(eng(c.copy_to(c.device()))?));
        }
        Ok((sin, cos))
    }

    fn begin_scratch_alloc_tp(&self) {
        self.lock().begin_scratch_alloc_tp();
    }

    fn reserve_scratch(&self, scratch: Vec<u64>) -> PyResult<()> {
        eng(self.lock().reserve_scratch(&scratch))
    }

    /// `get_scratch_slice_tp`, or with `full` `get_scratch_slice_tp_bc`, as tuples
    /// `(device_index, offset, rows, cols)`.
    fn _scratch_slices(
        &self,
        rows: u64,
        dtype: &str,
        broadcast_type: usize,
        dim: u64,
        full: bool,
    ) -> PyResult<Vec<(usize, u64, u64, u64)>> {
        let d = eng(scratch_dtype(dtype))?;
        let mut ctx = self.lock();
        let slices = match full {
            false => eng(ctx.get_scratch_slice_tp(rows, d, broadcast_type, dim))?,
            true => eng(ctx.get_scratch_slice_tp_bc(rows, d, broadcast_type, dim))?,
        };
        Ok(slices
            .into_iter()
            .map(|x| (x.device, x.offset, x.rows, x.cols))
            .collect())
    }
}

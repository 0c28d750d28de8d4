//! `TPContext`: exllamav2's tensor-parallel context over the model's accelerators.

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::{PyTypeError, PyValueError};
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
    Ok(())
}

/// exllamav2's `TPContext`: the five split tables (from the planner), collectives over the
/// accelerators (host-staged copies; real copies between virtual arenas), per-device RoPE
/// tables and scratch.
///
/// `Model.tp` is the context a `load_tp()` model's forward pass runs through: its collectives
/// and staging buffers are what `forward` and `generate` use.
#[pyclass(module = "weightlift._native", frozen, name = "TPContext")]
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

/// `f` on the engine tensors of `list` (DeviceTensors, each held locked meanwhile); `what`
/// names them when one was freed.
fn with_tensors<T>(
    list: &Bound<'_, PyAny>,
    what: &str,
    f: impl FnOnce(&[&we::DeviceTensor]) -> PyResult<T>,
) -> PyResult<T> {
    let list = tensors_of(list)?;
    let guards: Vec<_> = list.iter().map(|t| t.get().lock()).collect();
    let refs = guards
        .iter()
        .map(|g| g.as_ref())
        .collect::<Option<Vec<&we::DeviceTensor>>>()
        .ok_or_else(|| raise(Exc::Device, format!("{what} was freed")))?;
    f(&refs)
}

fn tensors_of(list: &Bound<'_, PyAny>) -> PyResult<Vec<Py<DeviceTensor>>> {
    let list: Vec<Bound<'_, PyAny>> = list.extract()?;
    list.iter()
        .map(|t| {
            t.cast::<DeviceTensor>()
                .map(|b| b.clone().unbind())
                .map_err(|_| PyTypeError::new_err("expected a list of DeviceTensor"))
        })
        .collect()
}

impl TPContext {
    /// The context a loaded model's forward pass runs through.
    pub(crate) fn from_shared(ctx: Arc<Mutex<TpContext>>, cpu: Arc<Device>) -> Self {
        let staging_bytes = ctx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .staging_bytes();
        TPContext {
            ctx,
            cpu,
            staging_bytes,
            _model: None,
        }
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
    /// `gpu_split`: GB per accelerator (None: each device's free memory). `expect_cache_tokens`
    /// (0: the model's context length × batch 1) of `expect_cache_base` (a cache dtype) are
    /// subtracted before splitting, as exllamav2 does.
    #[new]
    #[pyo3(signature = (model, gpu_split = None, expect_cache_tokens = 0, expect_cache_base = None))]
    fn new(
        py: Python<'_>,
        model: &Bound<'_, Model>,
        gpu_split: Option<Vec<f64>>,
        expect_cache_tokens: u64,
        expect_cache_base: Option<CacheDTypeArg>,
    ) -> PyResult<Self> {
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
    fn kv_split(&self) -> Vec<(usize, u64, u64)> {
        self.lock().splits().kv.clone()
    }
    #[getter]
    fn id_split(&self) -> Vec<(usize, u64, u64)> {
        self.lock().splits().id.clone()
    }
    #[getter]
    fn vc_split(&self) -> Vec<(usize, u64, u64)> {
        self.lock().splits().vc.clone()
    }
    #[getter]
    fn rs_split(&self) -> Vec<(usize, u64, u64)> {
        self.lock().splits().rs.clone()
    }
    #[getter]
    fn q_split(&self) -> Vec<(usize, u64, u64)> {
        self.lock().splits().q.clone()
    }

    /// Whether the forward pass on GPUs copies activations device to device where the driver
    /// allows (the default), or stages every copy through host memory.
    #[getter]
    fn peer_copies(&self) -> bool {
        self.lock().peer_copies()
    }
    #[setter]
    fn set_peer_copies(&self, on: bool) {
        self.lock().set_peer_copies(on);
    }

    /// The rank this process drives in a multi-process run (`load_tp(world=..., rank=...)`);
    /// None when it drives every device.
    #[getter]
    fn rank(&self) -> Option<usize> {
        self.lock().rank()
    }

    /// The transport of the collectives: `"host-staged"`, `"threads"` or `"nccl"`.
    #[getter]
    fn transport(&self) -> &'static str {
        self.lock().collective().name()
    }

    /// One member per rank of a group whose ranks run as threads of this process (each rank a
    /// model of its own, its forward calls on a thread of its own).
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

    /// Meet the other ranks through `member` of a thread group: its rank must be this
    /// context's. A member joins once.
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

    /// Join the multi-process run the launcher describes (torchrun's `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`; the NCCL id in `WEIGHTLIFT_NCCL_ID` or the file `WEIGHTLIFT_NCCL_ID_FILE`
    /// names, which rank 0 writes), waiting up to `wait` seconds for the id: the collectives
    /// then run over NCCL. Returns `(rank, world_size)`. Needs a build with the `nccl` feature.
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

    /// The device name of table index `i`.
    fn device_name(&self, i: usize) -> PyResult<String> {
        eng(self.lock().device(i).map(|d| d.name().to_owned()))
    }

    /// Allocate the two host staging buffers (exllamav2's pinned temps).
    fn finalize(&self) -> PyResult<()> {
        eng(self.lock().finalize(&self.cpu, self.staging_bytes))
    }

    fn unload(&self) {
        self.lock().unload();
    }

    /// One copy of `tensor` on each device of table `broadcast_type`.
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

    /// Concatenate per-device slices (one per device of the table, in order) along the columns
    /// into a host numpy array `(rows, end·dim)`.
    #[pyo3(signature = (buffer, inputs, broadcast_type, dim = 1))]
    fn gather<'py>(
        &self,
        py: Python<'py>,
        buffer: usize,
        inputs: &Bound<'py, PyAny>,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (bytes, rows, cols, dtype) = with_tensors(inputs, "a gather input", |refs| {
            let dtype = refs.first().map_or(DType::F32, |t| t.dtype());
            let (bytes, rows, cols) = eng(self.lock().gather(buffer, refs, broadcast_type, dim))?;
            Ok((bytes, rows, cols, dtype))
        })?;
        to_numpy(py, &bytes, dtype, &[rows, cols])
    }

    /// Gather over `broadcast_type_g`, then broadcast the result to table `broadcast_type_b`.
    #[pyo3(signature = (buffer, inputs, broadcast_type_g, broadcast_type_b, dim = 1))]
    fn allgather(
        &self,
        buffer: usize,
        inputs: &Bound<'_, PyAny>,
        broadcast_type_g: usize,
        broadcast_type_b: usize,
        dim: u64,
    ) -> PyResult<Vec<DeviceTensor>> {
        let out = with_tensors(inputs, "an allgather input", |refs| {
            eng(self
                .lock()
                .allgather(buffer, refs, broadcast_type_g, broadcast_type_b, dim))
        })?;
        Ok(out.into_iter().map(DeviceTensor::new).collect())
    }

    /// On each device `i` of the table: `target[i] += source[i][:, a·dim : b·dim]` (in place).
    #[pyo3(signature = (target, source, broadcast_type, dim = 1))]
    fn add_residual(
        &self,
        target: &Bound<'_, PyAny>,
        source: &Bound<'_, PyAny>,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<()> {
        let targets = tensors_of(target)?;
        let mut taken = Vec::with_capacity(targets.len());
        for t in &targets {
            match t.get().lock().take() {
                Some(x) => taken.push(x),
                None => {
                    for (t, x) in targets.iter().zip(taken) {
                        *t.get().lock() = Some(x);
                    }
                    return Err(raise(Exc::Device, "an add_residual target was freed"));
                }
            }
        }
        let result = with_tensors(
            source,
            "an add_residual source (or one that is also a target)",
            |refs| {
                eng(self
                    .lock()
                    .add_residual(&mut taken, refs, broadcast_type, dim))
            },
        );
        for (t, x) in targets.iter().zip(taken) {
            *t.get().lock() = Some(x);
        }
        result
    }

    fn wait_streams(&self) -> PyResult<()> {
        eng(self.lock().wait_streams())
    }

    /// Per-device RoPE tables: `(sin, cos)`, two lists of DeviceTensors `(max_seq_len, head_dim)`
    /// f32, one per device of `all_devices()`.
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

    /// Reserve scratch bytes per device index.
    fn reserve_scratch(&self, scratch: Vec<u64>) -> PyResult<()> {
        eng(self.lock().reserve_scratch(&scratch))
    }

    /// One scratch slice per device of the table, `(rows, (b - a)·dim)`: a list of
    /// `(device_index, offset, rows, cols)`.
    #[pyo3(signature = (rows, dtype, broadcast_type, dim = 1))]
    fn get_scratch_slice_tp(
        &self,
        rows: u64,
        dtype: &str,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<Vec<(usize, u64, u64, u64)>> {
        let d = eng(scratch_dtype(dtype))?;
        let s = eng(self
            .lock()
            .get_scratch_slice_tp(rows, d, broadcast_type, dim))?;
        Ok(slice_tuples(s))
    }

    /// One full-width scratch slice per device of the table, `(rows, end·dim)`.
    #[pyo3(signature = (rows, dtype, broadcast_type, dim = 1))]
    fn get_scratch_slice_tp_bc(
        &self,
        rows: u64,
        dtype: &str,
        broadcast_type: usize,
        dim: u64,
    ) -> PyResult<Vec<(usize, u64, u64, u64)>> {
        let d = eng(scratch_dtype(dtype))?;
        let s = eng(self
            .lock()
            .get_scratch_slice_tp_bc(rows, d, broadcast_type, dim))?;
        Ok(slice_tuples(s))
    }
}

/// Scratch slices as Python tuples `(device_index, offset, rows, cols)`.
fn slice_tuples<S: IntoIterator<Item = weightlift_engine::tp::ScratchSlice>>(
    slices: S,
) -> Vec<(usize, u64, u64, u64)> {
    slices
        .into_iter()
        .map(|x| (x.device, x.offset, x.rows, x.cols))
        .collect()
}

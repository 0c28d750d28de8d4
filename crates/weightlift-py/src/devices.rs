//! Devices for `tensor()` and `use_devices()`, `DeviceTensor`, and the DType ↔ numpy table.

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use weightlift_engine::{self as we, Device, Inventory};
use weightlift_format::DType;

use crate::errors::{Exc, eng, enter, raise};

/// The devices `tensor()` resolves names against: the last inventory made by `use_devices` or
/// a `Model(devices=...)`, else the real machine's (`cpu` plus any CUDA devices).
static REGISTRY: Mutex<Option<Inventory>> = Mutex::new(None);

fn registry() -> MutexGuard<'static, Option<Inventory>> {
    REGISTRY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The devices of `spec`, or with `None` the real inventory: `cpu` at MemAvailable plus every
/// CUDA device the kernels' backend reports (the same devices as `weightlift.devices()`, less
/// `disk`; none in a build without the `cuda` feature).
pub(crate) fn inventory_for(devices: Option<&str>) -> PyResult<Inventory> {
    let inv = match devices {
        Some(spec) => eng(Inventory::parse(spec))?,
        None => eng(Inventory::detect())?,
    };
    *registry() = Some(inv.clone());
    Ok(inv)
}

fn resolve_device(name: &str) -> PyResult<Arc<Device>> {
    // Its own statement, so the lock is released before `inventory_for` takes it.
    let registered = registry().clone();
    let inv = match registered {
        Some(inv) => inv,
        None => inventory_for(None)?,
    };
    inv.get(name).map_err(|_| {
        let known: Vec<String> = inv.all().iter().map(|d| d.name().to_owned()).collect();
        raise(
            Exc::Device,
            format!(
                "no device '{name}' (known: {}); create devices with use_devices('virtual:2x64MiB') or Model(..., devices=...)",
                known.join(", ")
            ),
        )
    })
}

/// Create the devices of `spec` (e.g. `"virtual:2x64MiB"`; `cpu` is always there) and make them
/// the ones `tensor()` places on. Returns `[(name, capacity or None)]`.
#[pyfunction]
pub fn use_devices(spec: &str) -> PyResult<Vec<(String, Option<u64>)>> {
    let inv = inventory_for(Some(spec))?;
    Ok(inv
        .all()
        .iter()
        .map(|d| (d.name().to_owned(), d.capacity()))
        .collect())
}

/// What this machine offers for CUDA, as `weightlift devices` prints it: `driver` (`path`
/// and `cuda_version`, or `error`), `nvrtc` and `cublas` (`path` and `version`, or `error`;
/// without cuBLAS, prompts run on weightlift's own kernels) and `devices`,
/// one dict per GPU (`name`, `model`, `capability` such as `"sm_90"`, `free` and `total`
/// bytes, and `context`: the bytes one CUDA context takes there, or None when it could not be
/// measured). Nothing here needs a GPU: what is missing is reported, not raised.
#[pyfunction]
pub fn cuda_info(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    Ok(pythonize::pythonize(
        py,
        &py.detach(weightlift_kernels::cuda::report),
    )?)
}

/// Bytes as a numpy array, laid out as `Checkpoint.raw` lays out the same tensor
/// (`DType::numpy_layout`): plain types get their dtype and `shape`; BF16, the small floats and
/// quantised blocks come back as `uint8` rows.
pub(crate) fn to_numpy<'py>(
    py: Python<'py>,
    bytes: &[u8],
    dtype: DType,
    shape: &[u64],
) -> PyResult<Bound<'py, PyAny>> {
    let np = py.import("numpy")?;
    let (name, dims) = dtype.numpy_layout(shape);
    let buf = PyBytes::new(py, dtype.numpy_bytes(bytes, shape));
    let arr = np.call_method1("frombuffer", (buf, name))?;
    arr.call_method1("reshape", (PyTuple::new(py, dims)?,))?
        .call_method0("copy")
}

/// A tensor held on a device. `numpy()` copies it back to the host.
#[pyclass(module = "weightlift._native", frozen)]
pub struct DeviceTensor {
    inner: Mutex<Option<we::DeviceTensor>>,
}

impl DeviceTensor {
    pub(crate) fn new(t: we::DeviceTensor) -> Self {
        DeviceTensor {
            inner: Mutex::new(Some(t)),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Option<we::DeviceTensor>> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn with<T>(&self, f: impl FnOnce(&we::DeviceTensor) -> PyResult<T>) -> PyResult<T> {
        match self.lock().as_ref() {
            Some(t) => f(t),
            None => Err(raise(Exc::Device, "this device tensor was freed")),
        }
    }
}

#[pymethods]
impl DeviceTensor {
    /// The device name, e.g. `"virtual:1"`.
    #[getter]
    fn device(&self) -> PyResult<String> {
        self.with(|t| Ok(t.device().name().to_owned()))
    }

    #[getter]
    fn shape(&self) -> PyResult<Vec<u64>> {
        self.with(|t| Ok(t.shape().to_vec()))
    }

    /// The weightlift dtype name (`"F32"`, `"Q4_K"`, ...).
    #[getter]
    fn dtype(&self) -> PyResult<&'static str> {
        self.with(|t| Ok(t.dtype().name()))
    }

    /// Bytes held on the device.
    #[getter]
    fn nbytes(&self) -> PyResult<u64> {
        self.with(|t| Ok(t.nbytes()))
    }

    /// A host copy as a numpy array.
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (bytes, dtype, shape) =
            self.with(|t| Ok((eng(t.to_host())?, t.dtype(), t.shape().to_vec())))?;
        to_numpy(py, &bytes, dtype, &shape)
    }

    /// A copy on another device.
    fn to(&self, device: &str) -> PyResult<DeviceTensor> {
        let dev = resolve_device(device)?;
        self.with(|t| eng(t.copy_to(&dev)).map(DeviceTensor::new))
    }

    /// Release the device memory now.
    fn free(&self) {
        *self.lock() = None;
    }

    fn __repr__(&self) -> String {
        let Some(t) = &*self.lock() else {
            return "DeviceTensor(freed)".into();
        };
        let (device, shape, dtype) = (t.device().name(), t.shape(), t.dtype());
        format!("DeviceTensor(device='{device}', shape={shape:?}, dtype={dtype})")
    }
}

/// Copy a numpy array onto `device` (`"cpu"`, `"virtual:0"`, ...). The allocation counts against
/// the device's capacity; past it, `OutOfMemoryError` names the device, the request and what is
/// free.
#[pyfunction]
pub fn tensor(py: Python<'_>, array: &Bound<'_, PyAny>, device: &str) -> PyResult<DeviceTensor> {
    let np = py.import("numpy")?;
    let arr = np.call_method1("ascontiguousarray", (array,))?;
    let name: String = arr.getattr("dtype")?.getattr("name")?.extract()?;
    let dtype = DType::from_numpy_name(&name).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "numpy dtype {name} has no weightlift dtype; expected one of float32, float16, \
             float64, int8..int64, uint8..uint64, bool or complex64"
        ))
    })?;
    let shape: Vec<u64> = arr.getattr("shape")?.extract()?;
    let bytes: Vec<u8> = arr.call_method0("tobytes")?.extract()?;
    let dev = resolve_device(device)?;
    enter(py, || {
        we::DeviceTensor::from_host(&dev, shape, dtype, &bytes)
    })
    .map(DeviceTensor::new)
}

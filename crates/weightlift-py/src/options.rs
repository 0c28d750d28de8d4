//! Python values → the planner's option types. Conversion only: what an option means is decided
//! once, by `weightlift_plan::PlanOptions`, for every entry point.
//!
//! Each type here is a `FromPyObject`, so a wrong type fails at the argument with PyO3's
//! "argument 'NAME': ..." prefix, and a wrong value with the planner's typed error.

use std::sync::Arc;

use pyo3::conversion::FromPyObjectOwned;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use weightlift_engine as we;
use weightlift_engine::cache::Cache as ECache;
use weightlift_engine::session::LoadCache;
use weightlift_plan as wp;

use crate::cache::Cache;
use crate::errors::py_err;
use crate::plan::{CacheSpec, RuntimeSpec};

/// The keyword arguments of a call, as the Python wrapper that declares them (signature,
/// defaults and docstring, in `weightlift/_api.py`) hands them on: its `locals()`.
pub struct Kw<'py>(Bound<'py, PyDict>);

impl<'a, 'py> FromPyObject<'a, 'py> for Kw<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Kw(obj.cast::<PyDict>()?.to_owned()))
    }
}

impl<'py> Kw<'py> {
    /// Argument `key`, converted as PyO3 converts a declared one (a note names the argument).
    pub fn get<T: FromPyObjectOwned<'py>>(&self, key: &str) -> PyResult<T> {
        let value = self
            .0
            .get_item(key)?
            .ok_or_else(|| PyTypeError::new_err(format!("missing required argument '{key}'")))?;
        value.extract::<T>().map_err(|e| {
            let e: PyErr = e.into();
            let _ = e
                .value(self.0.py())
                .call_method1("add_note", (format!("while processing '{key}'"),));
            e
        })
    }

    /// Argument `key`, None when absent or None.
    pub fn opt<T: FromPyObjectOwned<'py>>(&self, key: &str) -> PyResult<Option<T>> {
        match self.0.get_item(key)? {
            Some(_) => self.get(key),
            None => Ok(None),
        }
    }

    /// Argument `key` as a Python object, None when absent or None.
    pub fn any(&self, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.0.get_item(key)?.filter(|v| !v.is_none()))
    }
}

/// The placement keywords `plan()`, `fit()` and `Model.load()` share, as the planner's options.
/// `load` leaves out the keys that mean something else there (`cache`, `use_mmap`).
pub fn plan_options(kw: &Kw<'_>, load: bool) -> PyResult<wp::PlanOptions> {
    let cache = if load {
        None
    } else {
        kw.opt::<CacheArg>("cache")?
    };
    let use_mmap = if load { None } else { kw.opt("use_mmap")? };
    Ok(wp::PlanOptions {
        strategy: kw.opt("strategy")?,
        dtype: kw.opt("dtype")?,
        weight_dtype: kw.opt("weight_dtype")?,
        cache: cache.map(|c| c.0),
        cache_offload: kw.opt("cache_offload")?.unwrap_or_default(),
        runtime: kw.opt::<RuntimeArg>("runtime")?.map(|r| r.0),
        reserve: kw.opt::<Sizes>("reserve")?.map(|s| s.0),
        max_memory: kw.opt::<Sizes>("max_memory")?.map(|s| s.0),
        overhead: kw.opt::<Sizes>("overhead")?.map(|s| s.0),
        n_gpu_layers: kw.opt("n_gpu_layers")?,
        n_cpu_moe: kw.opt("n_cpu_moe")?,
        split_mode: kw.opt("split_mode")?,
        tensor_split: kw.opt("tensor_split")?,
        main_gpu: kw.opt("main_gpu")?,
        device_map: kw.opt::<DeviceMapValue>("device_map")?.map(|d| d.0),
        overrides: kw
            .opt::<Overrides>("overrides")?
            .map(|o| o.0)
            .unwrap_or_default(),
        gpu_split: kw.opt("gpu_split")?,
        allow_disk: kw.opt("allow_disk")?,
        use_mmap,
        quantize: kw.opt("quantize")?,
        offload: offload_arg(kw)?,
        world: kw.opt("world")?,
        ..wp::PlanOptions::default()
    })
}

/// `offload=` with `blocks_per_group` and `prefetch`, as the planner reads them.
pub fn offload_arg(kw: &Kw<'_>) -> PyResult<Option<wp::WeightOffload>> {
    let Some(mode) = kw.opt::<String>("offload")? else {
        return Ok(None);
    };
    let (blocks, prefetch) = (kw.get("blocks_per_group")?, kw.get("prefetch")?);
    wp::WeightOffload::parse(Some(&mode), blocks, prefetch).map_err(py_err)
}

fn type_error(expected: &str, obj: &Bound<'_, PyAny>) -> PyErr {
    let got = obj
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string());
    PyTypeError::new_err(format!("expected {expected}, got {got}"))
}

/// A size: a non-negative int of bytes, or a string such as `"512MiB"` or `"8G"`.
pub struct Size(pub u64);

impl<'a, 'py> FromPyObject<'a, 'py> for Size {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(s) = obj.cast::<PyString>() {
            return wp::parse_size(s.to_str()?).map(Size).map_err(py_err);
        }
        obj.extract::<u64>().map(Size).map_err(|_| {
            type_error(
                "a size: an int of bytes (≥ 0) or a string such as \"512MiB\"",
                &obj,
            )
        })
    }
}

/// A device as users name it: a name (`"cuda:1"`, `"cpu"`) or an accelerator index (`0`).
pub struct DeviceKey(pub String);

impl<'a, 'py> FromPyObject<'a, 'py> for DeviceKey {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(i) = obj.extract::<u64>() {
            return Ok(DeviceKey(i.to_string()));
        }
        obj.extract::<String>().map(DeviceKey).map_err(|_| {
            type_error(
                "a device name such as \"cuda:0\" or an accelerator index",
                &obj,
            )
        })
    }
}

/// Sizes per device: one size (every accelerator), a list (accelerator order) or a dict keyed
/// by device name or accelerator index.
pub struct Sizes(pub wp::PerDevice);

impl<'a, 'py> FromPyObject<'a, 'py> for Sizes {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(d) = obj.cast::<PyDict>() {
            let mut entries = Vec::new();
            for (k, v) in d.iter() {
                entries.push((k.extract::<DeviceKey>()?.0, v.extract::<Size>()?.0));
            }
            return Ok(Sizes(wp::PerDevice::Map(entries)));
        }
        if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
            let mut values = Vec::new();
            for v in obj.try_iter()? {
                values.push(v?.extract::<Size>()?.0);
            }
            return Ok(Sizes(wp::PerDevice::List(values)));
        }
        Ok(Sizes(wp::PerDevice::All(obj.extract::<Size>()?.0)))
    }
}

/// A `device_map`: a preset or device name, or a dict of module/layer prefix → device with
/// `"re:PATTERN"` keys as llama.cpp `-ot` overrides.
pub struct DeviceMapValue(pub wp::DeviceMapArg);

impl<'a, 'py> FromPyObject<'a, 'py> for DeviceMapValue {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(s) = obj.cast::<PyString>() {
            return Ok(DeviceMapValue(wp::DeviceMapArg::Named(
                s.to_str()?.to_owned(),
            )));
        }
        let d = obj.cast::<PyDict>().map_err(|_| {
            type_error(
                "'auto', 'balanced', 'balanced_low_0', 'sequential', a device name, or a dict \
                 of module or layer prefix -> device",
                &obj,
            )
        })?;
        let mut entries = Vec::new();
        for (k, v) in d.iter() {
            entries.push((k.extract::<String>()?, v.extract::<DeviceKey>()?.0));
        }
        Ok(DeviceMapValue(wp::DeviceMapArg::Entries(entries)))
    }
}

/// llama.cpp `-ot` rules: `"REGEX=DEVICE,..."`, a list of such strings, or a dict
/// regex → device.
pub struct Overrides(pub Vec<(String, String)>);

impl<'a, 'py> FromPyObject<'a, 'py> for Overrides {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let mut rules = Vec::new();
        if let Ok(s) = obj.cast::<PyString>() {
            rules = wp::DeviceMap::parse_overrides(s.to_str()?).map_err(py_err)?;
        } else if let Ok(d) = obj.cast::<PyDict>() {
            for (k, v) in d.iter() {
                rules.push((k.extract::<String>()?, v.extract::<DeviceKey>()?.0));
            }
        } else {
            let items = obj.try_iter().map_err(|_| {
                type_error("\"REGEX=DEVICE\" rules: a string, a list or a dict", &obj)
            })?;
            for rule in items {
                let rule: String = rule?.extract()?;
                rules.extend(wp::DeviceMap::parse_overrides(&rule).map_err(py_err)?);
            }
        }
        Ok(Overrides(rules))
    }
}

/// A device spec: a string (`"virtual:2x8GiB,cpu"`) or a list of such strings.
pub struct DevicesSpec(pub String);

impl<'a, 'py> FromPyObject<'a, 'py> for DevicesSpec {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(s) = obj.cast::<PyString>() {
            return Ok(DevicesSpec(s.to_str()?.to_owned()));
        }
        let expected = "a device spec such as \"virtual:2x8GiB,cpu\" or a list of such strings";
        let items = obj.try_iter().map_err(|_| type_error(expected, &obj))?;
        let mut parts = Vec::new();
        for item in items {
            let item = item?;
            parts.push(
                item.extract::<String>()
                    .map_err(|_| type_error(expected, &item))?,
            );
        }
        Ok(DevicesSpec(parts.join(",")))
    }
}

/// A KV cache shape: a `Cache`, a `CacheSpec` or a dict of `CacheSpec`'s keywords.
pub struct CacheArg(pub wp::CacheSpec);

impl<'a, 'py> FromPyObject<'a, 'py> for CacheArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(c) = obj.cast::<CacheSpec>() {
            return Ok(CacheArg(c.get().inner));
        }
        if let Ok(c) = obj.cast::<Cache>() {
            return Ok(CacheArg(we::planned::cache_spec(c.get().cache.config())));
        }
        let obj = obj.to_owned();
        let Ok(d) = obj.cast::<PyDict>() else {
            return Err(type_error("a Cache, a CacheSpec or a dict", &obj));
        };
        // The dict holds CacheSpec's keywords, with the class's defaults.
        let spec = obj.py().get_type::<CacheSpec>().call((), Some(d))?;
        Ok(CacheArg(spec.cast::<CacheSpec>()?.get().inner))
    }
}

/// A `Cache` object, by the engine cache it shares (`load_autosplit(cache=...)`).
pub struct CacheRef(pub Arc<ECache>);

impl<'a, 'py> FromPyObject<'a, 'py> for CacheRef {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.cast::<Cache>() {
            Ok(c) => Ok(CacheRef(Arc::clone(&c.get().cache))),
            Err(_) => Err(type_error("a weightlift.Cache", &obj)),
        }
    }
}

/// `Model.load(cache=...)`: a `Cache` to load beside the layers, or the shape of one (a
/// `CacheSpec` or a dict, as [`CacheArg`]) that the model allocates itself, so what is held is
/// what the plan counted.
pub struct CacheShape(pub LoadCache);

impl<'a, 'py> FromPyObject<'a, 'py> for CacheShape {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(c) = obj.cast::<Cache>() {
            return Ok(CacheShape(LoadCache::Given(Arc::clone(&c.get().cache))));
        }
        obj.extract::<CacheArg>()
            .map(|c| CacheShape(LoadCache::Shape(c.0)))
    }
}

/// A cache dtype name (`"fp16"`, `"q4"`, ...), parsed by the planner's grammar.
pub struct CacheDTypeArg(pub wp::CacheDType);

impl<'a, 'py> FromPyObject<'a, 'py> for CacheDTypeArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let name: String = obj.extract()?;
        wp::CacheDType::parse(&name)
            .map(CacheDTypeArg)
            .map_err(py_err)
    }
}

/// Runtime limits: a `RuntimeSpec` or a dict of its fields (the rest default).
pub struct RuntimeArg(pub wp::RuntimeSpec);

impl<'a, 'py> FromPyObject<'a, 'py> for RuntimeArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(r) = obj.cast::<RuntimeSpec>() {
            return Ok(RuntimeArg(r.get().inner));
        }
        let obj = obj.to_owned();
        let Ok(d) = obj.cast::<PyDict>() else {
            return Err(type_error("a RuntimeSpec or a dict", &obj));
        };
        let mut rt = wp::RuntimeSpec::default();
        for (k, v) in d.iter() {
            let key: String = k.extract()?;
            match key.as_str() {
                "max_input_len" => rt.max_input_len = v.extract()?,
                "max_attention_size" => rt.max_attention_size = v.extract()?,
                "max_dq_size" => rt.max_dq_size = v.extract()?,
                "low_mem" => rt.low_mem = v.extract()?,
                _ => {
                    return Err(PyTypeError::new_err(format!(
                        "runtime: unknown field '{key}'; expected max_input_len, \
                         max_attention_size, max_dq_size or low_mem"
                    )));
                }
            }
        }
        Ok(RuntimeArg(rt))
    }
}

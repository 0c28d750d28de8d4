//! The convenience loaders' loads: accelerate's `from_pretrained` and llama-cpp-python's
//! `load_gguf` (their signatures and docstrings are in `weightlift/_api.py`).

use pyo3::prelude::*;
use weightlift_engine::LoadOptions;
use weightlift_engine::llama_cpp::{CacheType, LlamaLoad};
use weightlift_engine::session::LoadCache;
use weightlift_plan as wp;

use crate::errors::eng;
use crate::model::Model;
use crate::options::{DeviceMapValue, Kw, RuntimeArg, Sizes, offload_arg};
use crate::progress::Reporter;

#[pymethods]
impl Model {
    /// `from_pretrained`'s load: `device_map` and `max_memory` as transformers reads them.
    fn _load_pretrained(&self, py: Python<'_>, kw: Kw<'_>) -> PyResult<()> {
        let device_map = kw.opt::<DeviceMapValue>("device_map")?.map(|d| d.0);
        let options = wp::PlanOptions {
            offload: offload_arg(&kw)?,
            ..wp::PlanOptions::from_pretrained(
                device_map,
                kw.opt::<Sizes>("max_memory")?.map(|m| m.0),
            )
        };
        self.run_load(py, Reporter::from_kw(&kw)?, |s, p| {
            s.load(None, options, LoadCache::None, &LoadOptions::default(), p)
        })
    }

    /// `load_gguf`'s llama-cpp-python settings and, unless `vocab_only`, its load.
    fn _load_llama(&self, py: Python<'_>, kw: Kw<'_>) -> PyResult<()> {
        let chat_format = kw.opt::<String>("chat_format")?;
        let (seed, spm_infill) = (kw.opt("seed")?, kw.get("spm_infill")?);
        eng(self
            .lock()?
            .set_llama(seed, spm_infill, chat_format.as_deref()))?;
        if kw.get("vocab_only")? {
            return Ok(());
        }
        let args = LlamaLoad {
            n_gpu_layers: kw.get("n_gpu_layers")?,
            split_mode: kw.get("split_mode")?,
            tensor_split: kw.opt("tensor_split")?,
            main_gpu: kw.get("main_gpu")?,
            n_ctx: kw.get("n_ctx")?,
            n_batch: kw.get("n_batch")?,
            type_k: cache_type(&kw, "type_k")?,
            type_v: cache_type(&kw, "type_v")?,
            read: LoadOptions {
                use_mmap: kw.get("use_mmap")?,
                use_direct_io: kw.get("use_direct_io")?,
                check_tensors: kw.get("check_tensors")?,
                mlock: kw.get("use_mlock")?,
                ..LoadOptions::default()
            },
            offload: offload_arg(&kw)?,
        };
        let runtime = kw.opt::<RuntimeArg>("runtime")?.map(|r| r.0);
        let mut reporter = Reporter::from_kw(&kw)?;
        if let Some(f) = kw.opt("progress_callback")? {
            reporter = Reporter::new(Some(f), false);
            reporter.fraction = true;
        }
        self.run_load(py, reporter, |s, p| s.load_llama(args, runtime, p))
    }
}

/// `type_k` / `type_v`: a cache type name, or the ggml type number llama-cpp-python passes.
fn cache_type(kw: &Kw<'_>, what: &str) -> PyResult<Option<CacheType>> {
    let Some(obj) = kw.any(what)? else {
        return Ok(None);
    };
    if let Ok(name) = obj.extract::<String>() {
        return Ok(Some(CacheType::Name(name)));
    }
    obj.extract()
        .map(|id| Some(CacheType::Ggml(id)))
        .map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "{what}: expected a cache type name ('f16', 'q8_0', ...) or a ggml type number"
            ))
        })
}

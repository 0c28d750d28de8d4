//! The convenience loaders' loads: accelerate's `from_pretrained` and llama-cpp-python's
//! `load_gguf` (their signatures and docstrings are in `weightlift/_api.py`).

use pyo3::prelude::*;
use weightlift_engine::LoadOptions;
use weightlift_engine::llama_cpp::LlamaLoad;
use weightlift_engine::session::LoadCache;

use crate::errors::{eng, py_err};
use crate::model::Model;
use crate::options::Kw;
use crate::progress::Reporter;

#[pymethods]
impl Model {
    /// `from_pretrained`'s load: `device_map` and `max_memory` as transformers reads them.
    fn _load_pretrained(&self, py: Python<'_>, kw: Kw<'_>) -> PyResult<()> {
        let options = kw.data()?.pretrained_options().map_err(py_err)?;
        self.run_load(py, Reporter::from_kw(&kw)?, |s, p| {
            s.load(None, options, LoadCache::None, &LoadOptions::default(), p)
        })
    }

    /// `load_gguf`'s llama-cpp-python settings and, unless `vocab_only`, its load.
    fn _load_llama(&self, py: Python<'_>, kw: Kw<'_>) -> PyResult<()> {
        let data = kw.data()?;
        eng(self.lock()?.set_llama_keywords(&data))?;
        if data.get("vocab_only").map_err(py_err)? == Some(true) {
            return Ok(());
        }
        let args = eng(LlamaLoad::from_keywords(&data))?;
        let runtime = data.get("runtime").map_err(py_err)?;
        let reporter = match kw.any("progress_callback")? {
            Some(f) => Reporter::fraction(f.unbind()),
            None => Reporter::from_kw(&kw)?,
        };
        self.run_load(py, reporter, |s, p| s.load_llama(args, runtime, p))
    }
}

//! The PyO3 module `weightlift._native`: argument conversion, error mapping, GIL release and
//! progress callbacks. No logic of its own. The entry points with long keyword lists (`plan`,
//! `fit`, the loaders, generation) are declared, defaulted and documented once, in Python
//! (`weightlift/_api.py`), and hand their keywords here as one dict ([`options::Kw`]).

use pyo3::prelude::*;

mod cache;
mod devices;
mod errors;
mod format;
mod generate;
mod model;
mod options;
mod plan;
mod run;
mod tp;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // the GGUF key of a chat template, for llama-cpp-python's format pick in weightlift/_llama.py
    // (set, not added: the module's __all__ lists the public API only)
    m.setattr("_CHAT_TEMPLATE_KEY", weightlift_text::CHAT_TEMPLATE_KEY)?;
    // pip's NVRTC (and later cuBLAS) sit in nvidia/*/lib under a site folder the loader does
    // not search: hand the kernels' library search this Python's folders. Nothing is opened
    // here; the search runs at the first kernel compile.
    let path = m.py().import("sys")?.getattr("path")?;
    let dirs = path
        .try_iter()?
        .filter_map(|p| p.ok()?.extract::<String>().ok());
    let dirs = dirs.filter(|p| !p.is_empty()).map(std::path::PathBuf::from);
    weightlift_kernels::cuda_libs::add_site_dirs(dirs);
    format::register(m)?;
    plan::register(m)?;
    m.add_function(wrap_pyfunction!(devices::tensor, m)?)?;
    m.add_function(wrap_pyfunction!(devices::use_devices, m)?)?;
    m.add_function(wrap_pyfunction!(devices::cuda_info, m)?)?;
    // Private (set, not added to `__all__`): `weightlift.sample` is its Python wrapper.
    m.setattr("_sample", wrap_pyfunction!(generate::_sample, m)?)?;
    m.add_class::<devices::DeviceTensor>()?;
    m.add_class::<model::Model>()?;
    m.add_class::<cache::Cache>()?;
    m.add_class::<generate::Batch>()?;
    m.add_class::<generate::CompletionStream>()?;
    m.add_class::<generate::LlamaGrammar>()?;
    tp::register(m)?;
    Ok(())
}

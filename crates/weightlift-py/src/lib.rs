//! The PyO3 module `weightlift._native`: argument conversion, error mapping, GIL release and
//! progress callbacks. No logic of its own.

use pyo3::prelude::*;

mod cache;
mod devices;
mod errors;
mod format;
mod generate;
mod loaders;
mod model;
mod options;
mod plan;
mod progress;
mod run;
mod tp;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    format::register(m)?;
    plan::register(m)?;
    m.add_function(wrap_pyfunction!(devices::tensor, m)?)?;
    m.add_function(wrap_pyfunction!(devices::use_devices, m)?)?;
    m.add_function(wrap_pyfunction!(loaders::from_pretrained, m)?)?;
    m.add_function(wrap_pyfunction!(loaders::load_gguf, m)?)?;
    m.add_class::<devices::DeviceTensor>()?;
    m.add_class::<model::Model>()?;
    m.add_class::<cache::Cache>()?;
    m.add_class::<generate::CompletionStream>()?;
    m.add_class::<generate::LlamaGrammar>()?;
    tp::register(m)?;
    Ok(())
}

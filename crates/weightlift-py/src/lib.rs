//! The PyO3 module `weightlift._native`: argument conversion, error mapping, GIL release and
//! progress callbacks. No logic of its own.

use pyo3::prelude::*;

mod engine;
mod errors;
mod format;
mod generate;
mod plan;
mod run;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    format::register(m)?;
    plan::register(m)?;
    engine::register(m)?;
    m.add_class::<generate::CompletionStream>()?;
    Ok(())
}

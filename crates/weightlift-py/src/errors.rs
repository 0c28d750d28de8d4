//! The one place where Rust errors become Python exceptions, and the one helper that releases
//! the GIL around core work.
//!
//! The classes live in `weightlift._errors` (so they can inherit from both `WeightliftError` and
//! a builtin such as `ValueError`); this module raises them by name. Each core crate's error enum
//! gets a [`ToPyErr`] impl here, so a binding never decides a mapping on its own (the way
//! polars' `From<PyPolarsErr> for PyErr` keeps every mapping in one file).

use std::path::Path;

use weightlift_engine::EngineError;
use weightlift_engine::grammar::GrammarError;
use weightlift_format::hf_config;

use pyo3::exceptions::{PyBaseException, PyOSError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The Python exception classes of `weightlift._errors`.
#[derive(Clone, Copy, Debug)]
pub enum Exc {
    Weightlift,
    Format,
    OutOfMemory,
    Device,
    CudaUnavailable,
    Unsupported,
    LoadCancelled,
    Closed,
    Plan,
    ContextFull,
    Grammar,
}

impl Exc {
    fn class_name(self) -> &'static str {
        match self {
            Exc::Weightlift => "WeightliftError",
            Exc::Format => "FormatError",
            Exc::OutOfMemory => "OutOfMemoryError",
            Exc::Device => "DeviceError",
            Exc::CudaUnavailable => "CudaUnavailable",
            Exc::Unsupported => "UnsupportedError",
            Exc::LoadCancelled => "LoadCancelled",
            Exc::Closed => "ClosedError",
            Exc::Plan => "PlanError",
            Exc::ContextFull => "ContextFullError",
            Exc::Grammar => "GrammarError",
        }
    }
}

static ERRORS_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// Build a `PyErr` of the given weightlift class with `message`.
pub fn raise(exc: Exc, message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| {
        let class = ERRORS_MODULE
            .get_or_try_init(py, || py.import("weightlift._errors").map(Bound::unbind))
            .and_then(|m| m.bind(py).getattr(exc.class_name()))
            .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
        match class {
            Ok(class) => PyErr::from_type(class, message),
            Err(e) => e,
        }
    })
}

/// An OS error about `path`, as the matching `OSError` subclass with `errno`, `strerror` and
/// `filename` set, exactly as `open()` in Python would raise it.
pub fn io_error(path: &Path, err: &std::io::Error) -> PyErr {
    io_error_in(path, None, err)
}

/// [`io_error`] for a failure while reading `tensor`, which the message names.
pub fn io_error_in(path: &Path, tensor: Option<&str>, err: &std::io::Error) -> PyErr {
    let filename = path.display().to_string();
    let mut context = tensor.map_or_else(String::new, |t| format!(" (reading tensor '{t}')"));
    if err.kind() == std::io::ErrorKind::NotFound
        && let Some(hint) = hf_config::hub_id_hint(path, hf_config::hub_cache().as_deref())
    {
        context.push_str("; ");
        context.push_str(&hint);
    }
    if let Some(errno) = err.raw_os_error() {
        // OSError(errno, strerror, filename) picks the subclass (FileNotFoundError, ...) from the
        // errno itself; strerror comes from the C library so it reads like Python's own.
        let strerror = Python::attach(|py| {
            py.import("os")
                .and_then(|os| os.call_method1("strerror", (errno,)))
                .and_then(|s| s.extract::<String>())
                .unwrap_or_else(|_| err.to_string())
        });
        let strerror = format!("{strerror}{context}");
        return PyOSError::new_err((errno, strerror, filename));
    }
    // Without an errno, pyo3 picks the subclass from the error's kind, as Python would.
    let message = format!("{filename}: {err}{context}");
    std::io::Error::new(err.kind(), message).into()
}

/// Conversion of a core crate's error into its Python exception.
pub trait ToPyErr {
    fn to_pyerr(self) -> PyErr;
}

impl ToPyErr for PyErr {
    fn to_pyerr(self) -> PyErr {
        self
    }
}

impl ToPyErr for weightlift_format::FormatError {
    /// Everything from the format crate is a `FormatError` (a bad, unsupported or mismatched
    /// file, or a tensor the file does not hold), except operating-system failures, which are
    /// `OSError` subclasses.
    fn to_pyerr(self) -> PyErr {
        use weightlift_format::FormatError as E;
        match self {
            E::Io { path, source } => io_error(&path, &source),
            other => raise(Exc::Format, other.to_string()),
        }
    }
}

impl ToPyErr for weightlift_plan::PlanError {
    /// A plan that does not fit is an `OutOfMemoryError` carrying `.shortfalls` (a list of
    /// dicts: device, needed, available, missing, what) and `.fixes` (strings); a `cuda:N`
    /// without a size where CUDA cannot be used is `CudaUnavailable`, as `Model()` raises for
    /// it; every other planner error is an invalid request, a `PlanError` (a ValueError).
    fn to_pyerr(self) -> PyErr {
        use weightlift_plan::PlanError as E;
        match self {
            E::OutOfMemory(oom) => Python::attach(|py| {
                let err = raise(Exc::OutOfMemory, oom.to_string());
                let shortfalls: Vec<_> = oom.shortfalls.iter().map(|s| s.view()).collect();
                let attach = |value: &Bound<'_, PyBaseException>| -> PyResult<()> {
                    value.setattr("shortfalls", pythonize::pythonize(py, &shortfalls)?)?;
                    value.setattr("fixes", &oom.fixes)
                };
                attach(err.value(py)).map_or_else(|e| e, |()| err)
            }),
            E::CudaUnavailable { .. } => raise(Exc::CudaUnavailable, self.to_string()),
            E::KeywordType { .. } | E::UnknownField { .. } => {
                PyTypeError::new_err(self.to_string())
            }
            other => raise(Exc::Plan, other.to_string()),
        }
    }
}

impl ToPyErr for weightlift_text::TextError {
    /// Metadata or tokenizer files that cannot make a tokenizer are a `FormatError`; a tokenizer
    /// model this build does not have is an `UnsupportedError`; an id outside the vocabulary is
    /// a `PlanError` (a ValueError), like every other invalid argument; a failing chat template
    /// or tokenizer library is a `WeightliftError`.
    fn to_pyerr(self) -> PyErr {
        use weightlift_text::TextError as E;
        let exc = match &self {
            E::Metadata { .. } | E::File { .. } => Exc::Format,
            E::Unsupported { .. } => Exc::Unsupported,
            E::BadId { .. } => Exc::Plan,
            E::Backend { .. } | E::Template { .. } => Exc::Weightlift,
        };
        raise(exc, self.to_string())
    }
}

/// `Result::map_err` shorthand: `.map_err(py_err)`.
pub fn py_err<E: ToPyErr>(e: E) -> PyErr {
    e.to_pyerr()
}

/// Run core work with the GIL released: arguments are extracted before the call, the closure
/// touches no Python object, and its error is mapped on the way back (polars' `enter_polars`).
pub fn enter<T, E, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    F: FnOnce() -> Result<T, E> + Send,
    T: Send,
    E: ToPyErr + Send,
{
    let out = py.detach(f).map_err(ToPyErr::to_pyerr)?;
    // A Ctrl-C that arrived while the GIL was released becomes a KeyboardInterrupt now.
    py.check_signals()?;
    Ok(out)
}

impl ToPyErr for EngineError {
    fn to_pyerr(self) -> PyErr {
        use EngineError as E;
        let exc = match self {
            E::Io {
                path,
                tensor,
                source,
            } => return io_error_in(&path, Some(&tensor), &source),
            E::Format(e) => return e.to_pyerr(),
            E::Plan(e) => return e.to_pyerr(),
            E::Text(e) => return e.to_pyerr(),
            E::OutOfMemory { .. } => Exc::OutOfMemory,
            E::Device { .. } => Exc::Device,
            E::CudaUnavailable { .. } => Exc::CudaUnavailable,
            E::Cancelled { .. } => Exc::LoadCancelled,
            E::Validation { .. } | E::NonFinite { .. } => Exc::Format,
            E::Invalid { .. }
            | E::OutsideWindow { .. }
            | E::MaxLength { .. }
            | E::Aliased { .. } => Exc::Plan,
            E::Unsupported { .. } => Exc::Unsupported,
            E::NotLoaded { .. } | E::Hook { .. } => Exc::Weightlift,
            E::ContextFull { .. } => Exc::ContextFull,
            E::Closed { .. } => Exc::Closed,
            // A schema keyword the converter does not enforce is a feature not built.
            E::Grammar(GrammarError::SchemaUnsupported { .. }) => Exc::Unsupported,
            E::Grammar(_) => Exc::Grammar,
        };
        raise(exc, self.to_string())
    }
}

/// `Result::map_err` shorthand for engine results.
pub fn eng<T>(r: Result<T, EngineError>) -> PyResult<T> {
    r.map_err(ToPyErr::to_pyerr)
}

//! Load progress: the user's callback, cancellation and Ctrl-C. (`progress=True`'s bar is the
//! command line's, put in front of the callback by `weightlift/_api.py`.)

use pyo3::prelude::*;
use pyo3::types::PyBool;
use weightlift_engine::{EngineError, Progress};

use crate::errors::ToPyErr;
use crate::options::Kw;

/// The progress path of a load: the user's callback, and signal checks. Runs on the loading
/// thread with the GIL re-acquired only for the call.
pub(crate) struct Reporter {
    callback: Option<Py<PyAny>>,
    /// llama.cpp style: the callback takes one float (the fraction done).
    fraction: bool,
    error: Option<PyErr>,
}

impl Reporter {
    /// The reporter of a load call's `callback` keyword.
    pub(crate) fn from_kw(kw: &Kw<'_>) -> PyResult<Self> {
        Ok(Reporter {
            callback: kw.opt("callback")?,
            fraction: false,
            error: None,
        })
    }

    /// llama.cpp's style: `callback` takes one float, the fraction done.
    pub(crate) fn fraction(callback: Py<PyAny>) -> Self {
        Reporter {
            callback: Some(callback),
            fraction: true,
            error: None,
        }
    }

    pub(crate) fn report(&mut self, p: &Progress<'_>) -> bool {
        Python::attach(|py| {
            if let Err(e) = py.check_signals() {
                self.error = Some(e);
                return false;
            }
            let Some(cb) = &self.callback else {
                return true;
            };
            let r = if self.fraction {
                cb.bind(py).call1((p.fraction(),))
            } else {
                cb.bind(py)
                    .call1((p.bytes_done, p.bytes_total, p.tensor, p.device))
            };
            match r {
                Ok(v) => !v.is(&*PyBool::new(py, false)),
                Err(e) => {
                    self.error = Some(e);
                    false
                }
            }
        })
    }

    /// The error to raise: the callback's own exception or KeyboardInterrupt first.
    pub(crate) fn finish<T>(self, r: Result<T, EngineError>) -> PyResult<T> {
        match (r, self.error) {
            (Ok(v), _) => Ok(v),
            (Err(EngineError::Cancelled { .. }), Some(e)) => Err(e),
            (Err(e), _) => Err(e.to_pyerr()),
        }
    }
}

//! Load progress: the user's callback or a progress bar, cancellation and Ctrl-C.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};
use weightlift_engine::{EngineError, Progress};

use crate::errors::ToPyErr;
use crate::options::Kw;

// ---------------------------------------------------------------------------------------------
// Progress and cancellation

/// The progress path of a load: the user's callback and/or a tqdm bar, and signal checks. Runs
/// on the loading thread with the GIL re-acquired only for the call.
pub(crate) struct Reporter {
    callback: Option<Py<PyAny>>,
    /// llama.cpp style: the callback takes one float (the fraction done).
    fraction: bool,
    bar: Option<Py<PyAny>>,
    want_bar: bool,
    last: u64,
    error: Option<PyErr>,
}

impl Reporter {
    pub(crate) fn new(callback: Option<Py<PyAny>>, progress: bool) -> Self {
        Reporter {
            callback,
            fraction: false,
            bar: None,
            want_bar: progress,
            last: 0,
            error: None,
        }
    }

    /// llama.cpp's style: `callback` takes one float, the fraction done.
    pub(crate) fn fraction(callback: Py<PyAny>) -> Self {
        Reporter {
            fraction: true,
            ..Reporter::new(Some(callback), false)
        }
    }

    /// The reporter of a load call's `callback` and `progress` keywords.
    pub(crate) fn from_kw(kw: &Kw<'_>) -> PyResult<Self> {
        Ok(Reporter::new(kw.opt("callback")?, kw.get("progress")?))
    }

    pub(crate) fn report(&mut self, p: &Progress<'_>) -> bool {
        Python::attach(|py| {
            if let Err(e) = py.check_signals() {
                self.error = Some(e);
                return false;
            }
            if self.want_bar && self.bar.is_none() {
                let bar = py.import("tqdm").and_then(|m| {
                    let kw = PyDict::new(py);
                    kw.set_item("total", p.bytes_total)?;
                    kw.set_item("unit", "B")?;
                    kw.set_item("unit_scale", true)?;
                    kw.set_item("desc", "loading")?;
                    m.getattr("tqdm")?.call((), Some(&kw))
                });
                match bar {
                    Ok(b) => self.bar = Some(b.unbind()),
                    Err(_) => self.want_bar = false,
                }
            }
            if let Some(bar) = &self.bar {
                let _ = bar
                    .bind(py)
                    .call_method1("update", (p.bytes_done.saturating_sub(self.last),));
                if p.bytes_done >= p.bytes_total {
                    let _ = bar.bind(py).call_method0("close");
                }
            }
            self.last = p.bytes_done;
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
        if let Some(bar) = self.bar {
            Python::attach(|py| {
                let _ = bar.bind(py).call_method0("close");
            });
        }
        match (r, self.error) {
            (Ok(v), _) => Ok(v),
            (Err(EngineError::Cancelled { .. }), Some(e)) => Err(e),
            (Err(e), _) => Err(e.to_pyerr()),
        }
    }
}

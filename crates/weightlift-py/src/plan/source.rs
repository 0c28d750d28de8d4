//! What `plan()` and `fit()` plan for, from whatever Python passed: a `Checkpoint`, a path (a
//! checkpoint, an HF config.json, or a folder holding only a config.json), an HF config dict,
//! or a `ModelSpec`.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use weightlift_format as wf;
use weightlift_plan as wp;

use crate::errors::{Exc, enter, py_err, raise};
use crate::format::{Checkpoint, ModelSpec};

/// What a plan is made for, with the model's sliding-window layers.
pub(super) struct Source {
    model: wp::ModelSource,
    window: Option<wp::SlidingWindow>,
}

impl Source {
    /// What `source` names; opening a checkpoint path releases the GIL.
    pub(super) fn resolve(py: Python<'_>, source: &Bound<'_, PyAny>) -> PyResult<Source> {
        if let Ok(ckpt) = source.cast::<Checkpoint>() {
            let ckpt = ckpt.get().shared()?;
            return Source::checkpoint(&ckpt);
        }
        if let Ok(spec) = source.cast::<ModelSpec>() {
            return Ok(Source {
                model: wp::ModelSource::Config(spec.get().inner.clone(), None),
                window: None,
            });
        }
        if let Ok(dict) = source.cast::<PyDict>() {
            let text: String = py
                .import("json")?
                .call_method1("dumps", (dict,))?
                .extract()?;
            let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                raise(
                    Exc::Plan,
                    format!("config dict: not JSON-serialisable: {e}"),
                )
            })?;
            return Source::config(&value);
        }
        let path: PathBuf = source.extract().map_err(|_| {
            raise(
                Exc::Plan,
                format!(
                    "source: expected a Checkpoint, a path, an HF config (path or dict) or a ModelSpec, got {}",
                    source.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                ),
            )
        })?;
        if let Some(config) = wf::hf_config::config_only(&path) {
            return Source::config(&wf::hf_config::read(&config).map_err(py_err)?);
        }
        let ckpt = enter(py, || {
            wf::Checkpoint::open(&path, wf::OpenOptions::default())
        })?;
        Source::checkpoint(&ckpt)
    }

    /// The request for these options on `devices`.
    pub(super) fn request(
        self,
        options: wp::PlanOptions,
        devices: Vec<wp::DeviceSpec>,
    ) -> PyResult<wp::PlanRequest> {
        let mut req = options.into_request(self.model, devices).map_err(py_err)?;
        req.sliding_window = self.window;
        Ok(req)
    }

    fn config(config: &serde_json::Value) -> PyResult<Source> {
        let spec = wf::ModelSpec::from_hf_config(config).map_err(py_err)?;
        let window = wp::SlidingWindow::from_hf_config(config, &spec).map_err(py_err)?;
        let dtype = wf::hf_config::stored_dtype(config).map(str::to_owned);
        Ok(Source {
            model: wp::ModelSource::Config(spec, dtype),
            window,
        })
    }

    fn checkpoint(ckpt: &wf::Checkpoint) -> PyResult<Source> {
        if ckpt.vocab_only() {
            return Err(raise(
                Exc::Plan,
                format!(
                    "{}: opened with vocab_only=True, so it has no tensor table to plan; open it without vocab_only",
                    ckpt.path().display()
                ),
            ));
        }
        let spec = ckpt.spec().map_err(|e| {
            raise(
                Exc::Format,
                format!(
                    "{}: cannot plan without the architecture: {e}",
                    ckpt.path().display()
                ),
            )
        })?;
        let window = match (ckpt.format(), ckpt.config()) {
            (wf::Format::Gguf, _) => wp::SlidingWindow::from_gguf(ckpt.metadata(), spec),
            (wf::Format::Safetensors, Some(config)) => {
                wp::SlidingWindow::from_hf_config(config, spec)
            }
            (wf::Format::Safetensors, None) => Ok(None),
        }
        .map_err(|e| raise(Exc::Format, format!("{}: {e}", ckpt.path().display())))?;
        Ok(Source {
            model: wp::ModelSource::Tensors(spec.clone(), ckpt.tensors().to_vec()),
            window,
        })
    }
}

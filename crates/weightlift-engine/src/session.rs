//! A model as a caller keeps it between calls: the engine [`Model`], the plan of its last load,
//! what every plan and generation of it takes by default (its dtype, quantise-on-load mode and
//! runtime limits; llama-cpp-python's `seed` and `spm_infill`), the timings of its last
//! generation, and whether it was closed.
//!
//! The Python `Model` is a [`Session`] behind a lock; a Rust caller holds one the same way, so
//! the rules of opening, loading (with a cache given, or only its shape) and closing a model
//! are the same for both.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;
use weightlift_plan::{CacheSpec, DTypeChoice, Plan, PlanOptions, Quantize, RuntimeSpec};

use crate::Inventory;
use crate::cache::Cache;
use crate::error::{EngineError, Result, invalid};
use crate::forward::Compute;
use crate::generate::{Generation, Piece, Timings};
use crate::loader::{LoadOptions, Progress};
use crate::model::{Dequantized, Model};
use crate::planned::PlanDefaults;
use crate::source::Source;
use crate::tp::{Standalone, TpArgs};

/// How a model computes and what its plans assume, as users name them: `Model(dtype=...,
/// runtime=..., compute=..., n_threads=..., quantize=...)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// `"auto"` keeps the stored dtypes; `"float16"` and the like convert float weights.
    pub dtype: DTypeChoice,
    pub quantize: Option<Quantize>,
    pub runtime: RuntimeSpec,
    pub compute: Compute,
    /// The forward pass's threads; `None` is the physical cores.
    pub n_threads: Option<usize>,
}

impl Settings {
    /// The settings of these names (`compute` `"fast"` or `"exact"`, `quantize` `"int8"`,
    /// `"q8_0"`, `"q4_k"` or `"q6_k"`), each refused by name when unknown.
    pub fn parse(
        dtype: &str,
        compute: &str,
        quantize: Option<&str>,
        runtime: Option<RuntimeSpec>,
        n_threads: Option<usize>,
    ) -> Result<Settings> {
        Ok(Settings {
            compute: Compute::parse(compute)?,
            quantize: quantize.map(Quantize::parse).transpose()?,
            dtype: DTypeChoice::parse(dtype)?,
            runtime: runtime.unwrap_or_default(),
            n_threads,
        })
    }
}

/// The KV cache a load is handed: none (a plan may still reserve one, which the load makes), a
/// cache made by the caller, or only its shape, which the load plans for and makes itself so
/// that what is held is what the plan counted.
#[derive(Debug, Clone, Default)]
pub enum LoadCache {
    #[default]
    None,
    Given(Arc<Cache>),
    Shape(CacheSpec),
}

/// A model, the plan it was loaded by, and its defaults; see the module docs.
#[derive(Debug)]
pub struct Session {
    pub model: Model,
    /// The plan of the last load; `None` before one and after `unload`.
    pub plan: Option<Plan>,
    /// The dtype, quantise-on-load mode and runtime limits every plan of this model takes.
    pub defaults: PlanDefaults,
    /// The device spec the model was made with (with none given, the detected machine's, as
    /// `"cuda:0,cpu"`).
    pub devices: String,
    /// The sampling seed when a call gives none (llama-cpp-python's `Llama(seed=...)`).
    pub seed: Option<u64>,
    /// Fill-in-the-middle prompts put the suffix first (`Llama(spm_infill=True)`).
    pub spm_infill: bool,
    /// The last generation's timings.
    pub timings: Option<Timings>,
    closed: bool,
}

/// A setting of how a model runs that a caller may change between calls (the Python `Model`'s
/// settable properties).
#[derive(Debug, Clone, PartialEq)]
pub enum Setting {
    /// `"fast"` or `"exact"` ([`Compute::parse`]).
    Compute(String),
    /// CUDA graph replay of decode steps ([`Model::set_cuda_graphs`]).
    CudaGraphs(bool),
    /// LLM.int8's outlier threshold ([`Model::set_int8_threshold`]).
    Int8Threshold(f32),
    /// A built-in chat format in place of the checkpoint's template, or the template again
    /// (`None`) ([`Model::set_chat_format`]).
    ChatFormat(Option<String>),
}

/// A prompt as callers give it: text, or token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

impl Session {
    /// A model of `source` on `inventory`, nothing loaded yet. `devices` is the spec the
    /// inventory was made from; `None` (the detected machine) names the inventory's devices.
    pub fn new(
        source: Arc<dyn Source>,
        inventory: Inventory,
        devices: Option<String>,
        settings: Settings,
    ) -> Result<Session> {
        let devices = devices.unwrap_or_else(|| inventory.spec());
        let mut model = Model::new(source, inventory);
        model.set_compute(settings.compute);
        model.set_runtime(settings.runtime);
        if let Some(n) = settings.n_threads {
            model.set_threads(n)?;
        }
        Ok(Session {
            model,
            plan: None,
            defaults: PlanDefaults {
                dtype: settings.dtype,
                quantize: settings.quantize,
                runtime: settings.runtime,
            },
            devices,
            seed: None,
            spm_infill: false,
            timings: None,
            closed: false,
        })
    }

    /// Refuses every use of a closed session: a closed model holds nothing, and loading it
    /// again would hide that the caller closed it.
    pub fn check_open(&self) -> Result<()> {
        if self.closed {
            return Err(EngineError::Closed {
                what: format!("Model('{}')", self.model.source().path().display()),
            });
        }
        Ok(())
    }

    /// Whether [`Session::close`] has run.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The session as the Python `Model`'s properties show it, read at once: the devices it was
    /// made with, whether it is loaded, what it holds per device ([`Model::memory`]), allocates
    /// now ([`Model::device_usage`]) and allocated at most ([`Model::peak_memory`]), the copies
    /// of the last forward call, the last load's warnings, and how it computes. Each is cheap to
    /// read (the threads, [`Model::n_threads`], may read the CPU topology, so they are not here).
    pub fn view(&self) -> impl Serialize + '_ {
        #[derive(Serialize)]
        struct Copies {
            copies: u64,
            bytes: u64,
            seconds: f64,
        }
        #[derive(Serialize)]
        struct View<'a> {
            devices: &'a str,
            loaded: bool,
            memory: BTreeMap<String, u64>,
            device_usage: BTreeMap<String, u64>,
            peak_memory: BTreeMap<String, u64>,
            transfer_stats: Copies,
            locked_bytes: u64,
            warnings: &'a [String],
            compute: &'static str,
            int8_threshold: f32,
            chat_format: Option<&'a str>,
            cuda_graphs: bool,
            cuda_graph_counts: (u64, u64, Option<String>),
        }
        let (m, copies) = (&self.model, self.model.transfer_stats());
        View {
            devices: &self.devices,
            loaded: m.is_loaded(),
            memory: m.memory().into_iter().collect(),
            device_usage: m.device_usage().into_iter().collect(),
            peak_memory: m.peak_memory().into_iter().collect(),
            transfer_stats: Copies {
                copies: copies.count,
                bytes: copies.bytes,
                seconds: copies.seconds(),
            },
            locked_bytes: m.locked_bytes(),
            warnings: m.warnings(),
            compute: m.compute().name(),
            int8_threshold: m.int8_threshold(),
            chat_format: m.chat_format_name(),
            cuda_graphs: m.cuda_graphs(),
            cuda_graph_counts: m.cuda_graph_counts(),
        }
    }

    /// Change how the model runs from its next forward call.
    pub fn set(&mut self, setting: Setting) -> Result<()> {
        match setting {
            Setting::Compute(name) => self.model.set_compute(Compute::parse(&name)?),
            Setting::CudaGraphs(on) => self.model.set_cuda_graphs(on),
            Setting::Int8Threshold(t) => self.model.set_int8_threshold(t)?,
            Setting::ChatFormat(name) => self.model.set_chat_format(name.as_deref())?,
        }
        Ok(())
    }

    /// Load by `plan`, or plan now with `options` over the model's own request and its
    /// defaults ([`Model::plan_and_load`]), with `cache`. A cache given as a shape is planned
    /// with the rest; beside a given plan, which takes no options, it is made here. The plan
    /// loaded is kept in [`Session::plan`].
    pub fn load(
        &mut self,
        plan: Option<Plan>,
        mut options: PlanOptions,
        cache: LoadCache,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(&Progress<'_>) -> bool,
    ) -> Result<()> {
        let cache = match cache {
            LoadCache::None => None,
            LoadCache::Given(c) => Some(c),
            LoadCache::Shape(spec) if plan.is_none() => {
                options.cache = Some(spec);
                None
            }
            LoadCache::Shape(spec) => Some(Arc::new(self.model.cache_for(&spec)?)),
        };
        let loaded =
            self.model
                .plan_and_load(plan, options, &self.defaults, cache, opts, progress)?;
        self.plan = Some(loaded);
        Ok(())
    }

    /// The ids of a generation's `prompt`: ids as given, text tokenized with `add_bos` (None
    /// follows the tokenizer) and special tokens parsed.
    pub fn prompt_ids(&self, prompt: Prompt, add_bos: Option<bool>) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Ids(ids) => Ok(ids),
            Prompt::Text(text) => self.model.prompt_ids(&text, add_bos),
        }
    }

    /// The ids of a completion's (`create_completion`'s) `prompt`, and the text to put after
    /// the generated text. With a `suffix`, the prompt is text and the completion fills the
    /// middle ([`Model::suffixed_prompt`], the suffix first for a load that asked for
    /// `spm_infill`).
    pub fn completion_ids(
        &self,
        prompt: Prompt,
        suffix: Option<&str>,
    ) -> Result<(Vec<u32>, Option<String>)> {
        match (prompt, suffix) {
            (Prompt::Ids(ids), None) => Ok((ids, None)),
            (Prompt::Text(text), None) => Ok((self.model.completion_prompt(&text)?, None)),
            (Prompt::Text(text), Some(sfx)) => {
                self.model.suffixed_prompt(&text, sfx, self.spm_infill)
            }
            (Prompt::Ids(_), Some(_)) => Err(invalid(
                "suffix",
                "a text prompt (str or bytes) to fill in the middle of",
                "a prompt of token ids",
            )),
        }
    }

    /// One step of `job` on this model; its timings become the model's last.
    pub fn step(&mut self, job: &mut Generation) -> Result<Option<Piece>> {
        let piece = job.step(&mut self.model);
        self.timings = Some(job.timings());
        piece
    }

    /// A tensor's values as float32 ([`Model::dequantized`]), decoded at most the runtime's
    /// `max_dq_size` values at a time.
    pub fn dequantized(&self, name: &str) -> Result<Dequantized> {
        self.model
            .dequantized(name, self.defaults.runtime.max_dq_size)
    }

    /// A tensor-parallel context over this model's accelerators by its last plan (or a plan
    /// made now) and its runtime, as exllamav2's `TPContext(model, ...)`
    /// ([`Model::standalone_tp`]).
    pub fn standalone_tp(&self, args: TpArgs) -> Result<Standalone> {
        let runtime = self.defaults.runtime;
        self.model.standalone_tp(self.plan.as_ref(), runtime, args)
    }

    /// Free every tensor and cache layer the model holds, and forget its plan.
    pub fn unload(&mut self) {
        self.model.unload();
        self.plan = None;
    }

    /// [`Session::unload`], then refuse every later use ([`Session::check_open`]). Closing
    /// twice does nothing.
    pub fn close(&mut self) {
        if !self.closed {
            self.unload();
            self.closed = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_parsed_by_name_and_refused_by_name() {
        let s = Settings::parse("float16", "exact", Some("q8_0"), None, Some(2)).unwrap();
        assert_eq!(s.dtype, DTypeChoice::parse("float16").unwrap());
        assert_eq!(s.compute, Compute::Exact);
        assert_eq!(s.quantize, Some(Quantize::parse("q8_0").unwrap()));
        assert_eq!(s.runtime, RuntimeSpec::default());
        assert_eq!(s.n_threads, Some(2));
        let e = Settings::parse("auto", "fastest", None, None, None).unwrap_err();
        assert!(e.to_string().starts_with("compute: expected"), "{e}");
        let e = Settings::parse("auto", "fast", Some("q3"), None, None).unwrap_err();
        assert!(matches!(e, EngineError::Plan(_)), "{e}");
        let e = Settings::parse("float12", "fast", None, None, None).unwrap_err();
        assert!(matches!(e, EngineError::Plan(_)), "{e}");
    }
}

//! `Model`: a checkpoint, the devices it may use, and (once loaded) every tensor in place, with
//! the lazily allocated cache beside each layer.
//!
//! - [`placement`]: where every tensor goes ([`Placement`]), the plan reduced to what a load needs.
//! - [`load`]: carrying a placement out ([`Model::load`]), split tensors cut from the mmap.
//! - [`tensor_parallel`]: exllamav2's `load_tp` placement and the TPContext a loaded plan runs on.
//! - [`kv_cache`]: the cache calls run on: attached at load or by the caller, or made by the model.
//! - [`tensors`]: reading loaded tensors back ([`Held`]): bytes, types, devices, dequantised values.
//! - [`memory`]: what the model holds per device, and the devices' own accounting.

mod kv_cache;
mod load;
mod memory;
mod placement;
mod tensor_parallel;
mod tensors;

use std::sync::{Arc, Mutex};

use crate::cache::Cache;
use crate::device::{Device, Inventory};
use crate::error::{EngineError, Result, invalid};
use crate::source::Source;
use crate::tp::TpContext;

pub use placement::{ForwardPlan, Placement, RankPlace, SplitSpec, TensorPlace};
pub use tensor_parallel::{Cut, tp_cut};
pub use tensors::{Dequantized, Held};

#[derive(Debug)]
pub(crate) struct State {
    /// Declared first: unlocked before the tensors that own the mapped ranges are dropped.
    pub locked: crate::mlock::Locked,
    /// Declared before the tensors: its workspaces are returned before the weights.
    pub graph: Option<crate::forward::Graph>,
    pub held: Vec<Held>,
    pub copies: Vec<(usize, Held)>,
    pub scratch: Vec<crate::device::Buffer>,
    pub layer_devices: Vec<String>,
    pub cache: Option<Arc<Cache>>,
    /// `cache` was made by [`Model::own_cache_for`], not handed in: it may be replaced by a
    /// larger one.
    pub cache_made: bool,
    /// More sequences the plan counted beside `cache` (a plan's cache of batch_size N: the
    /// own cache is sequence 0 and these the other N − 1), each a cache of its own for a
    /// [`crate::generate::batch::Batch`].
    pub sequences: Vec<Arc<Cache>>,
    pub warnings: Vec<String>,
    pub forward: Option<ForwardPlan>,
    pub onload: Option<weightlift_plan::OnloadPlan>,
    /// Tensor parallelism: the context the forward pass runs through (shared with the
    /// bindings' `Model.tp`), and the graph built on first use.
    pub tp: Option<Arc<Mutex<TpContext>>>,
    pub tp_graph: Option<crate::forward::TpGraph>,
}

/// The device named `name` in `inv`; `disk` resolves to the cpu, which computes and holds what
/// stays on disk.
pub(crate) fn resolve_in(inv: &Inventory, name: &str) -> Result<Arc<Device>> {
    if name == "disk" {
        return Ok(Arc::clone(inv.cpu()));
    }
    inv.get(name)
}

/// llama-cpp-python's `chat_format` name for the checkpoint's own template.
const DEFAULT_TEMPLATE: &str = "chat_template.default";

/// The template a model's chats take (see [`Model::set_chat_format`]).
#[derive(Debug, Clone)]
enum ChatChoice {
    Checkpoint,
    /// `"chat_template.NAME"` and the text of `tokenizer.chat_template.NAME`.
    Named(String, String),
    Builtin(&'static weightlift_text::ChatFormat),
}

/// A model: nothing is loaded until [`Model::load`] (tensor parallelism: [`Model::tp_placement`]).
pub struct Model {
    source: Arc<dyn Source>,
    inventory: Inventory,
    pub(crate) state: Option<State>,
    pub(crate) runner: crate::forward::Runner,
    /// Built on first use from the checkpoint's metadata or tokenizer files.
    tokenizer: std::sync::OnceLock<Arc<weightlift_text::Tokenizer>>,
    /// The tokenizer's chat template, compiled on first use (`None`: the model has none).
    chat: std::sync::OnceLock<Option<Arc<weightlift_text::ChatTemplate>>>,
    /// The template chats take: the checkpoint's, another it names, or a built-in format.
    chat_choice: ChatChoice,
    /// The runtime a cache made before a load is sized for ([`Model::runtime`]).
    runtime: weightlift_plan::RuntimeSpec,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("source", &self.source.path())
            .field("inventory", &self.inventory)
            .field("loaded", &self.state.is_some())
            .finish()
    }
}

impl Model {
    pub fn new(source: Arc<dyn Source>, inventory: Inventory) -> Model {
        Model {
            source,
            inventory,
            state: None,
            runner: crate::forward::Runner::default(),
            tokenizer: std::sync::OnceLock::new(),
            chat: std::sync::OnceLock::new(),
            chat_choice: ChatChoice::Checkpoint,
            runtime: weightlift_plan::RuntimeSpec::default(),
        }
    }

    /// The tokenizer: from the GGUF's `tokenizer.ggml.*` keys, or from `tokenizer.json` in a
    /// safetensors checkpoint's folder. Built once, on first use; needs no load.
    pub fn tokenizer(&self) -> Result<Arc<weightlift_text::Tokenizer>> {
        if let Some(t) = self.tokenizer.get() {
            return Ok(Arc::clone(t));
        }
        let ckpt = self
            .source
            .checkpoint()
            .ok_or_else(|| EngineError::Unsupported {
                what: "a tokenizer for this model".into(),
                detail: "it was not opened from a checkpoint file".into(),
            })?;
        let built = match ckpt.format() {
            weightlift_format::Format::Gguf => {
                weightlift_text::Tokenizer::from_gguf(ckpt.metadata())?
            }
            weightlift_format::Format::Safetensors => {
                let path = ckpt.path();
                let dir = if path.is_dir() {
                    path
                } else {
                    path.parent().unwrap_or(path)
                };
                let mut t = weightlift_text::Tokenizer::from_files(dir)?;
                // ids past tokenizer.json's up to the embedding's rows, as a GGUF holds them
                if let Some(spec) = self.source.spec() {
                    t.pad_to(usize::try_from(spec.vocab_size).unwrap_or(usize::MAX));
                }
                t
            }
        };
        Ok(Arc::clone(self.tokenizer.get_or_init(|| Arc::new(built))))
    }

    /// Format chats by llama-cpp-python's `chat_format` name `name`:
    /// - a built-in format (`"chatml"`, `"llama-3"`, ...; see [`weightlift_text::CHAT_FORMATS`])
    ///   in place of the checkpoint's template. Its stop string then ends chat replies
    ///   ([`Model::chat_stop`]) and the prompt gets BOS by the vocabulary's rule;
    /// - `"chat_template.NAME"`: the template a GGUF keeps as `tokenizer.chat_template.NAME`
    ///   (Command-R's `tool_use` and `rag`, say);
    /// - `None` or `"chat_template.default"`: the checkpoint's own template again.
    pub fn set_chat_format(&mut self, name: Option<&str>) -> Result<()> {
        self.chat_choice = match name {
            None | Some(DEFAULT_TEMPLATE) => ChatChoice::Checkpoint,
            Some(name) => {
                let named = name.strip_prefix("chat_template.").and_then(|n| {
                    let key = format!("{}.{n}", weightlift_text::CHAT_TEMPLATE_KEY);
                    let md = self.source.checkpoint()?.metadata();
                    md.get(&key)?.as_str().map(str::to_owned)
                });
                match (named, weightlift_text::chat_format(name)) {
                    (Some(src), _) => ChatChoice::Named(name.to_owned(), src),
                    (None, Ok(f)) => ChatChoice::Builtin(f),
                    (None, Err(_)) => return Err(self.unknown_chat_format(name)),
                }
            }
        };
        self.chat = std::sync::OnceLock::new();
        Ok(())
    }

    /// An unknown `chat_format` name, with every name this model takes.
    fn unknown_chat_format(&self, name: &str) -> EngineError {
        let prefix = format!("{}.", weightlift_text::CHAT_TEMPLATE_KEY);
        let named = self.source.checkpoint().into_iter().flat_map(|c| {
            let keys = c.metadata().keys();
            keys.filter_map(|k| Some(format!("chat_template.{}", k.strip_prefix(&prefix)?)))
        });
        let builtin = weightlift_text::CHAT_FORMATS
            .iter()
            .map(|f| f.name.to_owned());
        let supported: Vec<String> = std::iter::once(DEFAULT_TEMPLATE.to_owned())
            .chain(named)
            .chain(builtin)
            .collect();
        weightlift_text::TextError::Unsupported {
            what: "chat format",
            name: name.to_owned(),
            supported: supported.join(", "),
            hint: "chat_format=None uses the model's own chat template",
        }
        .into()
    }

    /// The built-in chat format in use, if any.
    pub fn chat_format(&self) -> Option<&'static weightlift_text::ChatFormat> {
        match self.chat_choice {
            ChatChoice::Builtin(f) => Some(f),
            _ => None,
        }
    }

    /// The `chat_format` name in use: a built-in format's or `"chat_template.NAME"`, or `None`
    /// for the checkpoint's own template.
    pub fn chat_format_name(&self) -> Option<&str> {
        match &self.chat_choice {
            ChatChoice::Checkpoint => None,
            ChatChoice::Named(name, _) => Some(name),
            ChatChoice::Builtin(f) => Some(f.name),
        }
    }

    /// The stop string of the built-in chat format in use: a chat reply ends there.
    pub fn chat_stop(&self) -> Option<&'static str> {
        self.chat_format().and_then(|f| f.stop)
    }

    /// The chat template compiled once: the built-in format's when one is set, else the
    /// checkpoint's, or `None` when it has none.
    pub fn chat_template(&self) -> Result<Option<Arc<weightlift_text::ChatTemplate>>> {
        if let Some(t) = self.chat.get() {
            return Ok(t.clone());
        }
        let built = match &self.chat_choice {
            ChatChoice::Builtin(f) => {
                Some(weightlift_text::ChatTemplate::new(&f.template(), "", "")?)
            }
            ChatChoice::Named(_, src) => Some(self.tokenizer()?.compile_chat(src)?),
            ChatChoice::Checkpoint => self.tokenizer()?.chat()?,
        }
        .map(Arc::new);
        Ok(self.chat.get_or_init(|| built).clone())
    }

    /// Rows of the embedding: token ids must be below it.
    pub fn vocab_size(&self) -> Result<u64> {
        self.source
            .spec()
            .map(|s| s.vocab_size)
            .ok_or_else(|| EngineError::Unsupported {
                what: "running this checkpoint".into(),
                detail: "its architecture could not be read from the metadata or config.json"
                    .into(),
            })
    }

    pub fn source(&self) -> &Arc<dyn Source> {
        &self.source
    }

    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    pub fn is_loaded(&self) -> bool {
        self.state.is_some()
    }

    /// Record a warning about the current load (shown by `warnings()` until unload).
    pub fn push_warning(&mut self, w: String) {
        if let Some(s) = self.state.as_mut() {
            s.warnings.push(w);
        }
    }

    /// Bytes of mapped tensors locked in RAM by `use_mlock`.
    pub fn locked_bytes(&self) -> u64 {
        self.state.as_ref().map_or(0, |s| s.locked.bytes())
    }

    pub fn warnings(&self) -> &[String] {
        self.state.as_ref().map_or(&[], |s| &s.warnings)
    }

    /// Number of repeating layers (from the spec, else from the tensor names).
    pub fn n_layers(&self) -> u32 {
        self.source.spec().map(|s| s.n_layers).unwrap_or_else(|| {
            self.source
                .tensors()
                .iter()
                .filter_map(|t| t.layer)
                .max()
                .map_or(0, |l| l + 1)
        })
    }

    fn resolve(&self, name: &str) -> Result<Arc<Device>> {
        resolve_in(&self.inventory, name)
    }

    /// Free every tensor and the cache layers this model allocated.
    pub fn unload(&mut self) {
        if let Some(s) = self.state.take() {
            for c in s.cache.iter().chain(&s.sequences) {
                c.free();
            }
            // The bindings may still hold the context: its buffers go now all the same.
            if let Some(tp) = &s.tp {
                tp.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .unload();
            }
        }
    }

    fn index(&self, name: &str) -> Result<usize> {
        self.source
            .tensors()
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| {
                invalid(
                    "tensor name",
                    format!("a tensor of {}", self.source.path().display()),
                    format!("'{name}'"),
                )
            })
    }

    fn state(&self) -> Result<&State> {
        self.state.as_ref().ok_or_else(|| EngineError::NotLoaded {
            what: "the model".into(),
        })
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        self.unload();
    }
}

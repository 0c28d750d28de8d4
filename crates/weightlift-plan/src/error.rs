//! The planner's one error enum. Messages are lower-case, name the device, tensor or option,
//! and say what was expected, what was found and the likely cause.

use serde::{Deserialize, Serialize};

use crate::size::fmt_bytes;

/// One device that is short of memory in a plan that does not fit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shortfall {
    /// Normalised device name (`"cuda:0"`, `"virtual:1"`, `"cpu"`).
    pub device: String,
    /// Bytes the plan needs on this device (weights, kv, scratch, overhead and reserve).
    pub needed: u64,
    /// Bytes the device has (its capacity, after any `max_memory` cap).
    pub available: u64,
    /// What the bytes are for, e.g. `"layers 12-29 weights + kv at ctx 8192"`.
    pub what: String,
}

impl Shortfall {
    /// How many bytes are missing.
    pub fn missing(&self) -> u64 {
        self.needed.saturating_sub(self.available)
    }

    /// The shortfall as the Python bindings show it: its fields, with
    /// [`missing`](Shortfall::missing) before `what`.
    pub fn view(&self) -> impl Serialize + '_ {
        #[derive(Serialize)]
        struct View<'a> {
            device: &'a str,
            needed: u64,
            available: u64,
            missing: u64,
            what: &'a str,
        }
        View {
            device: &self.device,
            needed: self.needed,
            available: self.available,
            missing: self.missing(),
            what: &self.what,
        }
    }
}

/// A plan that does not fit: every short device, and the cheapest fixes, each checked by
/// re-planning.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutOfMemory {
    pub strategy: String,
    pub shortfalls: Vec<Shortfall>,
    /// Human-readable fixes with numbers, cheapest first, e.g. `"cache q4 saves 2.10 GiB and fits"`.
    pub fixes: Vec<String>,
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "out of memory: the model does not fit with strategy {}",
            self.strategy
        )?;
        for s in &self.shortfalls {
            write!(
                f,
                "; {} is short by {} (needs {}, has {}) for {}",
                s.device,
                fmt_bytes(s.missing()),
                fmt_bytes(s.needed),
                fmt_bytes(s.available),
                s.what
            )?;
        }
        if self.fixes.is_empty() {
            write!(
                f,
                "; no single change found that makes it fit: add devices or quantise the weights further"
            )?;
        } else {
            write!(f, "; fixes: {}", self.fixes.join("; "))?;
        }
        Ok(())
    }
}

/// Everything that can go wrong while planning.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("invalid device spec '{spec}': {reason}")]
    DeviceSpec { spec: String, reason: String },

    /// A `cuda:N` named without a size where the probe says CUDA cannot be used (no driver, a
    /// build without CUDA, fewer GPUs), in the words of the engine's error for opening it.
    /// `device` is the device as the spec named it (`cuda:0`, or `gpu:0 (cuda:0)`); `detail`
    /// says why, then what to do ([`cuda_unavailable_fix`](crate::cuda_unavailable_fix)).
    #[error("device {device}: cuda is unavailable: {detail}")]
    CudaUnavailable { device: String, detail: String },

    #[error("invalid size '{text}': {reason}")]
    Size { text: String, reason: String },

    #[error("invalid option {option}: expected {expected}, got {got}")]
    Option {
        option: String,
        expected: String,
        got: String,
    },

    /// A keyword's value of the wrong kind (Python raises `TypeError` for it), in the words of
    /// the keyword grammar ([`crate::keywords`]).
    #[error("{keyword}: expected {expected}, got {got}")]
    KeywordType {
        keyword: String,
        expected: String,
        got: String,
    },

    /// A field that a map keyword (`cache`, `runtime`) does not have (a `TypeError` in Python,
    /// as an unknown keyword argument is).
    #[error("{keyword}: unknown field '{field}'; expected {known}")]
    UnknownField {
        keyword: String,
        field: String,
        known: String,
    },

    /// A keyword's value refused for a reason that does not name the keyword itself.
    #[error("{keyword}: {source}")]
    Keyword {
        keyword: String,
        source: Box<PlanError>,
    },

    /// Options that each make sense alone but not together, or one that needs another.
    #[error("{option}: {detail}")]
    OptionConflict { option: String, detail: String },

    #[error("unknown device '{device}' in {context}; the plan's devices are {known}")]
    UnknownDevice {
        device: String,
        context: String,
        known: String,
    },

    #[error("model spec is unusable for planning: {detail}")]
    Spec { detail: String },

    #[error("tensor '{tensor}': {detail}")]
    Tensor { tensor: String, detail: String },

    #[error(
        "device_map leaves {count} tensor(s) without a device: {tensors}; add an entry (or \"\" as a default) that covers them"
    )]
    MapIncomplete { count: usize, tensors: String },

    #[error(
        "device_map is contradictory: tensor '{tensor}' is matched by '{first}' -> {first_device} and by '{second}' -> {second_device}; make the entries disjoint or use a regex override"
    )]
    MapConflict {
        tensor: String,
        first: String,
        first_device: String,
        second: String,
        second_device: String,
    },

    #[error("invalid regex override '{pattern}': {reason}")]
    Regex { pattern: String, reason: String },

    #[error("plan json is invalid: {0}")]
    Json(String),

    #[error("{0}")]
    OutOfMemory(Box<OutOfMemory>),
}

impl PlanError {
    /// An option given a value it does not take: `expected` says what it takes.
    pub fn option(option: &str, expected: &str, got: impl std::fmt::Display) -> Self {
        PlanError::Option {
            option: option.to_string(),
            expected: expected.to_string(),
            got: got.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, PlanError>;

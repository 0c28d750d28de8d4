//! A device's fixed overhead: what it holds beyond the plan's weights, cache and scratch, kept
//! in named parts so that `explain()`, `fit` and out-of-memory messages can say what it is.
//!
//! A `cuda:N` device holds three parts ([`CudaOverhead`]):
//!
//! - **the context and our kernel modules**: measured by the engine when it probes or opens the
//!   device, or, when planning without the device, the default for its compute capability
//!   ([`context_default`]);
//! - **the cuBLAS workspace**, the size cuBLAS's `cublasSetWorkspace` documentation recommends
//!   for the architecture ([`cublas_workspace`]);
//! - **CUDA graph memory**, an allowance for the captured decode step ([`GRAPHS_BYTES`]).
//!
//! Every other device (cpu, virtual, disk) has no overhead unless `overhead=` gives one. A
//! given `overhead=` replaces the parts with one part of that size: the user's figure wins.

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};
use crate::size::fmt_bytes;

/// A compute capability as `(major, minor)`: `(9, 0)` is sm_90.
pub type Capability = (u32, u32);

/// One named part of a device's fixed overhead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverheadPart {
    /// What the bytes are for: [`CONTEXT`], [`CUBLAS`], [`GRAPHS`] or [`GIVEN`].
    pub name: String,
    pub bytes: u64,
    /// Where the figure comes from: `"measured"`, `"default for sm_90"`, ...
    pub source: String,
}

/// The part name of a CUDA context with our loaded kernel modules.
pub const CONTEXT: &str = "cuda context and modules";
/// The part name of the cuBLAS workspace.
pub const CUBLAS: &str = "cublas workspace";
/// The part name of captured CUDA graphs.
pub const GRAPHS: &str = "cuda graphs";
/// The part name of an overhead given with `overhead=`.
pub const GIVEN: &str = "given";

/// Graph memory charged per CUDA device: an allowance for the decode step captured as one CUDA
/// graph. An instantiated graph keeps its nodes' launch parameters on the device; a decode step
/// of a few hundred kernels, each with at most 4 KiB of parameters, holds about 2 MiB. Rounded
/// up to 8 MiB until the graph capture measures its own.
pub const GRAPHS_BYTES: u64 = 8 << 20;

/// A device's fixed overhead, as named parts (none: no overhead).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Overhead(pub Vec<OverheadPart>);

impl Overhead {
    /// One part of `bytes`, given by the user (`overhead=`); 0 bytes is no overhead.
    pub fn given(bytes: u64) -> Overhead {
        if bytes == 0 {
            return Overhead::default();
        }
        Overhead(vec![OverheadPart {
            name: GIVEN.into(),
            bytes,
            source: "overhead=".into(),
        }])
    }

    /// The sum of the parts.
    pub fn total(&self) -> u64 {
        self.0.iter().fold(0u64, |a, p| a.saturating_add(p.bytes))
    }

    pub fn parts(&self) -> &[OverheadPart] {
        &self.0
    }

    /// `"543.00 MiB cuda context and modules (measured) + 32.00 MiB cublas workspace (...)"`.
    pub fn describe(&self) -> String {
        describe(&self.0)
    }
}

/// `"543.00 MiB cuda context and modules (measured) + ..."` for any list of parts.
pub(crate) fn describe(parts: &[OverheadPart]) -> String {
    parts
        .iter()
        .map(|p| format!("{} {} ({})", fmt_bytes(p.bytes), p.name, p.source))
        .collect::<Vec<_>>()
        .join(" + ")
}

/// Parts as `(name, bytes, source)` rows: how the views of a device ([`DeviceSpec::view`],
/// [`DeviceUsage::view`]) list them.
///
/// [`DeviceSpec::view`]: crate::DeviceSpec::view
/// [`DeviceUsage::view`]: crate::DeviceUsage::view
pub(crate) fn rows(parts: &[OverheadPart]) -> Vec<(&str, u64, &str)> {
    parts
        .iter()
        .map(|p| (p.name.as_str(), p.bytes, p.source.as_str()))
        .collect()
}

/// What a CUDA device holds beyond the plan's allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaOverhead {
    /// The device's compute capability, when known.
    pub capability: Option<Capability>,
    /// The context with our kernel modules loaded.
    pub context: u64,
    /// Whether `context` was measured on the device (else it is [`context_default`]).
    pub measured: bool,
    /// The part of `context` this process already held when the probe read the device's free
    /// memory (its own context; the modules load later): the planner adds it back to the free
    /// memory. 0 for the defaults.
    #[serde(default)]
    pub held: u64,
    pub cublas_workspace: u64,
    pub graphs: u64,
}

impl CudaOverhead {
    /// The overhead of a device that is not here to measure: the defaults for `capability`
    /// (the largest defaults when it is unknown).
    pub fn default_for(capability: Option<Capability>) -> CudaOverhead {
        CudaOverhead {
            capability,
            context: context_default(capability),
            measured: false,
            held: 0,
            cublas_workspace: cublas_workspace(capability),
            graphs: GRAPHS_BYTES,
        }
    }

    /// The overhead of a device on which one context was measured at `context` bytes, with
    /// `modules` bytes of kernel modules still to load; the probe holds such a context.
    pub fn measured(capability: Capability, context: u64, modules: u64) -> CudaOverhead {
        CudaOverhead {
            context: context.saturating_add(modules),
            measured: true,
            held: context,
            ..CudaOverhead::default_for(Some(capability))
        }
    }

    pub fn total(&self) -> u64 {
        self.context
            .saturating_add(self.cublas_workspace)
            .saturating_add(self.graphs)
    }

    /// The three named parts, each with where its figure comes from.
    pub fn parts(&self) -> Overhead {
        let arch = self
            .capability
            .map_or_else(|| "capability unknown".to_string(), sm);
        let context_source = if self.measured {
            format!("measured on this {arch}")
        } else {
            format!("default, {arch}")
        };
        let part = |name: &str, bytes: u64, source: String| OverheadPart {
            name: name.into(),
            bytes,
            source,
        };
        Overhead(vec![
            part(CONTEXT, self.context, context_source),
            part(
                CUBLAS,
                self.cublas_workspace,
                format!("cuBLAS's recommendation, {arch}"),
            ),
            part(GRAPHS, self.graphs, "allowance".into()),
        ])
    }
}

impl From<CudaOverhead> for Overhead {
    fn from(o: CudaOverhead) -> Overhead {
        o.parts()
    }
}

/// `"sm_90"`.
pub fn sm((major, minor): Capability) -> String {
    format!("sm_{major}{minor}")
}

/// Parse `sm_90`, `sm_89`, `sm_120` (the last digit is the minor version).
pub fn parse_sm(text: &str) -> Result<Capability> {
    let err = || {
        PlanError::option(
            "compute capability",
            "sm_XY, e.g. sm_80, sm_89, sm_90 or sm_120",
            format!("'{text}'"),
        )
    };
    let digits = text
        .trim()
        .to_ascii_lowercase()
        .strip_prefix("sm_")
        .map(str::to_owned)
        .ok_or_else(err)?;
    if !(2..=3).contains(&digits.len()) || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(err());
    }
    let (major, minor) = digits.split_at(digits.len() - 1);
    match (major.parse(), minor.parse()) {
        (Ok(major), Ok(minor)) if major > 0 => Ok((major, minor)),
        _ => Err(err()),
    }
}

const MIB: u64 = 1 << 20;

/// What a CUDA context with our kernel modules holds on a device of `capability` that is not
/// here to measure. A context's memory grows with the number
/// of SMs (each SM's share of local memory and driver state), so each figure is that of the
/// largest device of its architectures: a plan for a smaller one keeps a little room to spare.
///
/// - sm_100 and later: 555 MiB, a bare context on an RTX PRO 6000 Blackwell (sm_120, 188 SMs),
///   measured with `cudaMemGetInfo` before and after creating it by llama.cpp's developers
///   (ggml-org/llama.cpp pull request 23604).
/// - sm_90: 543 MiB, measured on an H200 (132 SMs, driver 580, CUDA 13.0) with our modules
///   loaded: nvidia-smi showed 2.80 GiB where the plan charged 2.27 GiB.
/// - sm_80 to sm_89: 448 MiB. Bare contexts took 256 MiB on an RTX 3090 (82 SMs; InvokeAI issue
///   9413) and 107 MiB on an RTX 4060 Ti (34 SMs; the llama.cpp measurement above), about
///   3.1 MiB per SM, which on the 142 SMs of an L40S is 440 MiB.
/// - sm_75 and older: 256 MiB, the same 3.1 MiB per SM on the 80 SMs of a V100.
/// - unknown: the largest of these, so a plan for an unnamed GPU does not under-count; name
///   the capability (`cuda:0:24GiB:sm_89`) to plan with its own default.
pub fn context_default(capability: Option<Capability>) -> u64 {
    match capability {
        Some((major, _)) if major >= 10 => 555 * MIB,
        Some((9, _)) => 543 * MIB,
        Some((8, _)) => 448 * MIB,
        Some(_) => 256 * MIB,
        None => 555 * MIB,
    }
}

/// The cuBLAS workspace for `capability`: 32 MiB on Hopper (sm_90) and later, 4 MiB before, as
/// the cuBLAS documentation of `cublasSetWorkspace` recommends; 32 MiB when unknown. The CUDA
/// backend allocates exactly this at its first prompt product on cuBLAS and gives it to its
/// handle, so cuBLAS allocates none of its own (weightlift-kernels'
/// `cublas_workspace_bytes`; the engine tests that the two agree).
pub fn cublas_workspace(capability: Option<Capability>) -> u64 {
    match capability {
        Some((major, _)) if major < 9 => 4 * MIB,
        _ => 32 * MIB,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_capability() {
        let h = CudaOverhead::default_for(Some((9, 0)));
        assert_eq!(h.context, 543 << 20);
        assert_eq!(h.cublas_workspace, 32 << 20);
        assert_eq!(h.graphs, GRAPHS_BYTES);
        assert_eq!(h.total(), (543 + 32 + 8) << 20);
        let a = CudaOverhead::default_for(Some((8, 6)));
        assert_eq!((a.context, a.cublas_workspace), (448 << 20, 4 << 20));
        let unknown = CudaOverhead::default_for(None);
        assert!(
            [(7, 5), (8, 9), (9, 0), (12, 0)]
                .iter()
                .all(|&c| CudaOverhead::default_for(Some(c)).total() <= unknown.total()),
            "an unknown gpu gets the largest default"
        );
        let parts = h.parts();
        assert_eq!(parts.total(), h.total());
        let names: Vec<_> = parts.parts().iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, [CONTEXT, CUBLAS, GRAPHS]);
        assert_eq!(parts.parts()[0].source, "default, sm_90");
        let m = CudaOverhead::measured((8, 9), 300 << 20, 16 << 20);
        assert_eq!(m.parts().parts()[0].source, "measured on this sm_89");
        assert_eq!((m.context, m.held), (316 << 20, 300 << 20));
        assert_eq!(m.total(), (316 + 4 + 8) << 20);
        assert!(
            parts
                .describe()
                .starts_with("543.00 MiB cuda context and modules (default, sm_90) + 32.00 MiB"),
            "{}",
            parts.describe()
        );
    }

    #[test]
    fn given_overhead_is_one_part() {
        let g = Overhead::given(1 << 30);
        assert_eq!(g.total(), 1 << 30);
        assert_eq!(g.describe(), "1.00 GiB given (overhead=)");
        assert!(Overhead::given(0).parts().is_empty());
    }

    #[test]
    fn capabilities_parse() {
        assert_eq!(parse_sm("sm_90").unwrap(), (9, 0));
        assert_eq!(parse_sm("SM_89").unwrap(), (8, 9));
        assert_eq!(parse_sm("sm_120").unwrap(), (12, 0));
        assert_eq!(sm((12, 0)), "sm_120");
        for bad in ["sm_9", "90", "sm_9x", "sm_1234", "sm_05"] {
            let e = parse_sm(bad).unwrap_err().to_string();
            assert!(e.contains("sm_XY"), "{bad}: {e}");
        }
    }
}

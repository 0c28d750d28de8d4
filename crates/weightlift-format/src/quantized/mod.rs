//! Quantised safetensors checkpoints: GPTQ (auto-gptq / gptqmodel) and EXL2 (exllamav2).
//!
//! At open time the scheme is read from `config.json`'s `quantization_config` (or the
//! `quantize_config.json` auto-gptq writes beside it), every quantised linear is found by its
//! tensors (`<prefix>.qweight`, ... or `<prefix>.q_weight`, ...), and each is checked against the
//! settings and the model's architecture: a tensor that is missing, has the wrong dtype or
//! shape, or holds an out-of-range group index or a broken permutation is a `FormatError`
//! naming it. Sizes need nothing special: every tensor is sized by its stored bytes.
//!
//! [`Checkpoint::dequantize_linear_into`] then writes any block of rows (outputs) and columns
//! (inputs) of a linear's weight, in the `[out_features, in_features]` layout of
//! `nn.Linear.weight`, so a caller can bound its memory.

mod config;
mod exl2;
mod gptq;
mod packed;
mod part;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::f16;
use rayon::prelude::*;

pub(crate) use config::BESIDE_NAMES;
pub use config::{Exl2Config, GPTQ_BITS, GptqConfig, GptqFormat, QuantConfig};
pub use exl2::{EXL2_BITS, Exl2Bytes, Exl2Group, Exl2Linear};
pub use gptq::GptqLinear;

use crate::error::hint;
use crate::{Checkpoint, DType, FormatError, ModelSpec, Result, Role, TensorInfo};
use part::{Part, expect_dtype};

const GPTQ_PARTS: [&str; 4] = ["qweight", "qzeros", "scales", "g_idx"];
const EXL2_PARTS: [&str; 6] = [
    "q_weight",
    "q_invperm",
    "q_scale",
    "q_scale_max",
    "q_groups",
    "q_perm",
];

/// The quantisation of a checkpoint: its settings and every quantised linear.
#[derive(Debug, Clone)]
pub struct Quantization {
    config: QuantConfig,
    source: PathBuf,
    linears: Vec<QuantizedLinear>,
    by_prefix: HashMap<String, usize>,
    by_tensor: HashMap<String, usize>,
}

impl Quantization {
    pub fn config(&self) -> &QuantConfig {
        &self.config
    }

    /// `"gptq"` or `"exl2"`.
    pub fn method(&self) -> &'static str {
        match self.config {
            QuantConfig::Gptq(_) => "gptq",
            QuantConfig::Exl2(_) => "exl2",
        }
    }

    /// The file the settings were read from (`config.json` or `quantize_config.json`).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Every quantised linear, by layer, then by name. Empty when the checkpoint was opened
    /// with `vocab_only`.
    pub fn linears(&self) -> &[QuantizedLinear] {
        &self.linears
    }

    /// The linear whose tensors start with `prefix` (e.g. `model.layers.0.self_attn.q_proj`).
    pub fn linear(&self, prefix: &str) -> Option<&QuantizedLinear> {
        self.by_prefix.get(prefix).map(|&i| &self.linears[i])
    }

    /// The linear a tensor (`qweight`, `scales`, `bias`, ...) belongs to.
    pub fn linear_of_tensor(&self, name: &str) -> Option<&QuantizedLinear> {
        self.by_tensor.get(name).map(|&i| &self.linears[i])
    }
}

/// The scheme-specific layout of a quantised linear.
#[derive(Debug, Clone, PartialEq)]
pub enum LinearScheme {
    Gptq(GptqLinear),
    Exl2(Exl2Linear),
}

/// One quantised linear, validated at open time.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedLinear {
    prefix: String,
    in_features: usize,
    out_features: usize,
    layer: Option<u32>,
    role: Option<Role>,
    bias: Option<String>,
    scheme: LinearScheme,
}

impl QuantizedLinear {
    /// The module name its tensors share (`lm_head`, `model.layers.3.mlp.down_proj`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// The real output count (EXL2 stores it padded to a multiple of 32).
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn layer(&self) -> Option<u32> {
        self.layer
    }

    /// The role of the weight it replaces, when the architecture's roles are known.
    pub fn role(&self) -> Option<Role> {
        self.role
    }

    /// The bias tensor, which stays a plain float vector of `out_features`.
    pub fn bias(&self) -> Option<&str> {
        self.bias.as_deref()
    }

    pub fn scheme(&self) -> &LinearScheme {
        &self.scheme
    }

    /// Every tensor of the linear, the bias included.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = match &self.scheme {
            LinearScheme::Gptq(g) => g.tensor_names().collect(),
            LinearScheme::Exl2(e) => e.tensor_names().collect(),
        };
        names.extend(self.bias.as_deref());
        names
    }

    /// As [`Checkpoint::dequantize_linear_into`] for an EXL2 linear, decoding its tensors from
    /// `bytes` (a copy loaded anywhere in host memory, of the sizes it opened with) instead of
    /// from the checkpoint's file: the same values, bit for bit.
    pub fn dequantize_exl2_into(
        &self,
        bytes: Exl2Bytes<'_>,
        rows: Range<usize>,
        cols: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let LinearScheme::Exl2(e) = &self.scheme else {
            return Err(FormatError::Request {
                what: format!("quantised linear '{}'", self.prefix),
                expected: "an EXL2 linear".into(),
                got: "a GPTQ linear".into(),
            });
        };
        self.check_region(&rows, &cols, out.len())?;
        exl2::dequantize_bytes(e, bytes, self.in_features, rows, cols, out)
    }

    /// `rows` and `cols` lie within the weight and `out` holds exactly their block.
    fn check_region(&self, rows: &Range<usize>, cols: &Range<usize>, len: usize) -> Result<()> {
        let request = |what: &str, expected: String, got: String| FormatError::Request {
            what: format!("{what} of quantised linear '{}'", self.prefix),
            expected,
            got,
        };
        if rows.start > rows.end || rows.end > self.out_features {
            return Err(request(
                "rows",
                format!("a range within 0..{} (the outputs)", self.out_features),
                format!("{rows:?}"),
            ));
        }
        if cols.start > cols.end || cols.end > self.in_features {
            return Err(request(
                "columns",
                format!("a range within 0..{} (the inputs)", self.in_features),
                format!("{cols:?}"),
            ));
        }
        if rows.len().checked_mul(cols.len()) != Some(len) {
            return Err(request(
                "output buffer",
                format!("{} rows x {} columns", rows.len(), cols.len()),
                format!("{len} elements"),
            ));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantisation

/// What a dequantised weight can be written as.
pub(crate) trait Element: Copy + Send + Sync {
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// Below this many output elements one thread does the work.
const PARALLEL_MIN: usize = 1 << 15;

/// Run `body(state, row, out_row)` for every row, in parallel for large blocks; `init` makes
/// each thread's scratch state.
pub(crate) fn for_each_row<T: Send, S>(
    out: &mut [T],
    rows: Range<usize>,
    width: usize,
    init: impl Fn() -> S + Send + Sync,
    body: impl Fn(&mut S, usize, &mut [T]) + Send + Sync,
) {
    if width == 0 || rows.is_empty() {
        return;
    }
    if out.len() < PARALLEL_MIN {
        let mut state = init();
        for (dst, o) in out.chunks_mut(width).zip(rows) {
            body(&mut state, o, dst);
        }
    } else {
        out.par_chunks_mut(width)
            .zip(rows.into_par_iter())
            .for_each_init(init, |state, (dst, o)| body(state, o, dst));
    }
}

impl Checkpoint {
    /// Dequantise rows `rows` (outputs) and columns `cols` (inputs) of a quantised linear's
    /// weight into `out`, row-major `[rows.len(), cols.len()]`: the matching block of
    /// `nn.Linear.weight`. GPTQ values are `(q - z) * s` computed in f32 (gptqmodel's
    /// dequantiser); EXL2 values are f16 by definition (exllamav2 rounds every product to f16)
    /// and are widened. The bias is not added.
    pub fn dequantize_linear_into(
        &self,
        linear: &QuantizedLinear,
        rows: Range<usize>,
        cols: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        self.dequantize_region(linear, rows, cols, out)
    }

    /// As [`Checkpoint::dequantize_linear_into`], rounded to f16: bit-identical to exllamav2's
    /// reconstruction for EXL2, and to gptqmodel's f16 dequantisation for GPTQ.
    pub fn dequantize_linear_f16_into(
        &self,
        linear: &QuantizedLinear,
        rows: Range<usize>,
        cols: Range<usize>,
        out: &mut [f16],
    ) -> Result<()> {
        self.dequantize_region(linear, rows, cols, out)
    }

    /// The whole weight of a quantised linear as f32, `[out_features, in_features]`.
    pub fn dequantize_linear(&self, linear: &QuantizedLinear) -> Result<Vec<f32>> {
        let n = linear
            .out_features
            .checked_mul(linear.in_features)
            .ok_or_else(|| FormatError::Request {
                what: format!("quantised linear '{}'", linear.prefix),
                expected: "a weight that fits in memory".into(),
                got: format!("{} x {}", linear.out_features, linear.in_features),
            })?;
        let mut out = vec![0f32; n];
        self.dequantize_region(
            linear,
            0..linear.out_features,
            0..linear.in_features,
            &mut out,
        )?;
        Ok(out)
    }

    fn dequantize_region<T: Element>(
        &self,
        linear: &QuantizedLinear,
        rows: Range<usize>,
        cols: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        linear.check_region(&rows, &cols, out.len())?;
        match &linear.scheme {
            LinearScheme::Gptq(g) => gptq::dequantize(
                self,
                g,
                (linear.in_features, linear.out_features),
                rows,
                cols,
                out,
            ),
            LinearScheme::Exl2(e) => exl2::dequantize(self, e, linear.in_features, rows, cols, out),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Detection at open time

/// The result of looking for a quantisation: the scheme and its linears, if any, and warnings
/// for the checkpoint (a scheme weightlift does not read).
pub(crate) struct Detected {
    pub quantization: Option<Quantization>,
    pub warnings: Vec<String>,
}

/// Read the settings (`config` is `config.json`, `beside` the settings file next to it) and
/// check every quantised linear of a safetensors checkpoint.
pub(crate) fn detect(
    ckpt: &Checkpoint,
    config: Option<(&Path, &serde_json::Value)>,
    beside: Option<(&Path, &serde_json::Value)>,
) -> Result<Detected> {
    let mut warnings = Vec::new();
    match config::find(config, beside)? {
        config::Found::None => {
            let marker = ckpt
                .tensors()
                .iter()
                .find(|t| t.name.ends_with(".qweight") || t.name.ends_with(".q_weight"));
            if let Some(t) = marker {
                return Err(FormatError::Invalid {
                    path: config.map_or(ckpt.path(), |c| c.0).to_path_buf(),
                    what: format!("quantised tensor '{}'", t.name),
                    expected: "a quantization_config in config.json, or a quantize_config.json beside it".into(),
                    got: "neither".into(),
                    hint: hint::NO_QUANT_CONFIG,
                });
            }
        }
        config::Found::Other(method) => warnings.push(format!(
            "quantisation method '{method}' is not read by weightlift: its tensors are listed as stored and cannot be dequantised"
        )),
        config::Found::Known { config, source } => {
            return Ok(Detected {
                quantization: Some(collect(ckpt, config, source)?),
                warnings,
            });
        }
    }
    Ok(Detected {
        quantization: None,
        warnings,
    })
}

fn scheme_name(config: &QuantConfig) -> &'static str {
    match config {
        QuantConfig::Gptq(_) => "GPTQ",
        QuantConfig::Exl2(_) => "EXL2",
    }
}

fn collect(ckpt: &Checkpoint, config: QuantConfig, source: PathBuf) -> Result<Quantization> {
    let (parts, foreign_main): (&[&'static str], &str) = match config {
        QuantConfig::Gptq(_) => (&GPTQ_PARTS, EXL2_PARTS[0]),
        QuantConfig::Exl2(_) => (&EXL2_PARTS, GPTQ_PARTS[0]),
    };
    let main = parts[0];
    let split = |name: &str| -> Option<(String, &'static str)> {
        let (prefix, suffix) = name.rsplit_once('.')?;
        let part = parts.iter().copied().find(|p| *p == suffix)?;
        Some((prefix.to_owned(), part))
    };
    let foreign = format!(".{foreign_main}");
    if let Some(t) = ckpt.tensors().iter().find(|t| t.name.ends_with(&foreign)) {
        return Err(FormatError::Invalid {
            path: ckpt.path().to_path_buf(),
            what: format!("tensor '{}'", t.name),
            expected: format!(
                "{} tensors only, as the quantisation config says",
                scheme_name(&config)
            ),
            got: "a tensor of the other scheme".into(),
            hint: hint::QUANT_CONFIG,
        });
    }
    let mut prefixes: Vec<(&TensorInfo, String)> = Vec::new();
    for t in ckpt.tensors() {
        match split(&t.name) {
            Some((prefix, part)) if part == main => prefixes.push((t, prefix)),
            Some((prefix, part)) if ckpt.tensor(&format!("{prefix}.{main}")).is_err() => {
                return Err(FormatError::Invalid {
                    path: ckpt.path().to_path_buf(),
                    what: format!("tensor '{}'", t.name),
                    expected: format!("'{prefix}.{main}' beside this {part}"),
                    got: "no such tensor".into(),
                    hint: hint::QUANT_TENSORS,
                });
            }
            _ => {}
        }
    }
    if prefixes.is_empty() && !ckpt.vocab_only() {
        return Err(FormatError::Invalid {
            path: source,
            what: "quantisation config".into(),
            expected: format!(
                "{} tensors (names ending in .{main}), since the config says so",
                scheme_name(&config)
            ),
            got: "none in the checkpoint".into(),
            hint: hint::QUANT_CONFIG,
        });
    }
    prefixes.sort_by(|a, b| {
        (a.0.layer.unwrap_or(u32::MAX), &a.1).cmp(&(b.0.layer.unwrap_or(u32::MAX), &b.1))
    });

    let spec = ckpt.spec().ok();
    let mut linears = Vec::with_capacity(prefixes.len());
    for (info, prefix) in prefixes {
        let weight = format!("{prefix}.weight");
        if ckpt.tensor(&weight).is_ok() {
            return Err(FormatError::Invalid {
                path: ckpt.path().to_path_buf(),
                what: format!("tensor '{weight}'"),
                expected: format!("no dense weight beside the quantised '{}'", info.name),
                got: "both".into(),
                hint: hint::QUANT_TENSORS,
            });
        }
        let bias = match ckpt.tensor(&format!("{prefix}.bias")) {
            Ok(b) => {
                let part = Part::new(ckpt, b);
                expect_dtype(&part, &[DType::F16, DType::BF16, DType::F32])?;
                Some((b.name.clone(), part.vector()?))
            }
            Err(_) => None,
        };
        let expect = spec.and_then(|s| expected_dims(s, info.role?, info.layer));
        let (scheme, n_in, n_out) = match &config {
            QuantConfig::Gptq(cfg) => {
                let (g, n_in, n_out) = gptq::validate(ckpt, cfg, &prefix, expect)?;
                (LinearScheme::Gptq(g), n_in, n_out)
            }
            QuantConfig::Exl2(_) => {
                let (e, n_in, n_out) =
                    exl2::validate(ckpt, &prefix, expect, bias.as_ref().map(|b| b.1))?;
                (LinearScheme::Exl2(e), n_in, n_out)
            }
        };
        if let Some((name, len)) = &bias
            && *len != n_out
        {
            let part = Part::new(ckpt, ckpt.tensor(name)?);
            return Err(part.invalid(
                format!("{n_out} values, one per output of '{prefix}'"),
                format!("{len}"),
                hint::QUANT_TENSORS,
            ));
        }
        linears.push(QuantizedLinear {
            prefix,
            in_features: n_in,
            out_features: n_out,
            layer: info.layer,
            role: info.role,
            bias: bias.map(|b| b.0),
            scheme,
        });
    }
    let by_prefix = linears
        .iter()
        .enumerate()
        .map(|(i, l)| (l.prefix.clone(), i))
        .collect();
    let by_tensor = linears
        .iter()
        .enumerate()
        .flat_map(|(i, l)| l.tensor_names().into_iter().map(move |n| (n.to_owned(), i)))
        .collect();
    Ok(Quantization {
        config,
        source,
        linears,
        by_prefix,
        by_tensor,
    })
}

/// (in, out) of a projection of the llama family, from the architecture.
fn expected_dims(spec: &ModelSpec, role: Role, layer: Option<u32>) -> Option<(usize, usize)> {
    let n = |v: u64| usize::try_from(v).ok();
    let hidden = n(spec.hidden_size)?;
    let head = n(u64::from(spec.head_dim))?;
    let q = n(u64::from(spec.n_heads))?.checked_mul(head)?;
    let kv = layer.map(|l| u64::from(spec.n_kv_heads_at(l)));
    let kv = n(kv.unwrap_or(0))?.checked_mul(head)?;
    let inter = n(spec.intermediate_size)?;
    Some(match role {
        Role::AttnQ => (hidden, q),
        Role::AttnK | Role::AttnV => (hidden, kv),
        Role::AttnOutput => (q, hidden),
        Role::FfnGate | Role::FfnUp => (hidden, inter),
        Role::FfnDown => (inter, hidden),
        Role::Output => (hidden, n(spec.vocab_size)?),
        _ => return None,
    })
}

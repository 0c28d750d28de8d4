//! `Checkpoint`: one opened model, whichever format and however many files it spans.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{hint, show_bytes};
use crate::mapped::MappedFile;
use crate::{FormatError, Metadata, ModelSpec, Result, Role, TensorInfo};

/// The on-disk format of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Gguf,
    Safetensors,
}

impl Format {
    pub const fn name(self) -> &'static str {
        match self {
            Format::Gguf => "gguf",
            Format::Safetensors => "safetensors",
        }
    }
}

/// Options for [`Checkpoint::open`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    /// Scan every float tensor, and the f16 scales of quantised blocks, for NaN and Inf.
    pub check_tensors: bool,
    /// Read only metadata and the tokenizer; no tensor table is kept and no tensor data is touched.
    pub vocab_only: bool,
}

/// What the checkpoint says about its tokenizer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// `tokenizer.ggml.model` (e.g. `"gpt2"`, `"llama"`), or the HF tokenizer model type.
    pub model: Option<String>,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    pub n_tokens: Option<u64>,
    pub n_merges: Option<u64>,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    /// For safetensors folders: whether `tokenizer.json` is present beside the weights.
    pub has_tokenizer_json: bool,
}

/// What a format reader hands back before the checkpoint is assembled.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub files: Vec<Arc<MappedFile>>,
    pub metadata: Metadata,
    /// Tensors with `layer` and `role` still unset; empty when `vocab_only`.
    pub tensors: Vec<TensorInfo>,
    /// HF `config.json`, when one sits beside safetensors weights.
    pub config: Option<serde_json::Value>,
    pub tokenizer: TokenizerInfo,
}

/// An opened checkpoint. Tensor bytes are views of the memory maps, never copies.
#[derive(Debug)]
pub struct Checkpoint {
    format: Format,
    /// The path the user opened (a file, a folder or an index).
    path: PathBuf,
    files: Vec<Arc<MappedFile>>,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    config: Option<serde_json::Value>,
    spec: std::result::Result<ModelSpec, String>,
    tokenizer: TokenizerInfo,
    vocab_only: bool,
    /// Whether tensor roles are known for the architecture.
    roles_known: bool,
    warnings: Vec<String>,
    /// GPTQ or EXL2 settings and linears, for safetensors checkpoints that have them.
    quantization: Option<crate::Quantization>,
}

/// The byte-swapped GGUF magic: what a big-endian writer (gguf-py with `endianess=BIG`) puts
/// first. The GGUF reader refuses such files with a byte-order hint.
const GGUF_MAGIC_SWAPPED: [u8; 4] = *b"FUGG";

impl Checkpoint {
    /// Open a checkpoint: a GGUF file (or any part of a split set), a `.safetensors` file, a
    /// model folder, or a `model.safetensors.index.json`. Every structural check runs here,
    /// before any tensor view is handed out; with `check_tensors` every tensor is also scanned
    /// for NaN and Inf (in parallel), and the first bad tensor in file order is reported.
    pub fn open(path: impl AsRef<Path>, opts: OpenOptions) -> Result<Checkpoint> {
        let path = path.as_ref();
        let format = detect(path)?;
        let parsed = match format {
            Format::Gguf => crate::gguf::read(path, opts.vocab_only)?,
            Format::Safetensors => crate::safetensors::read(path, opts.vocab_only)?,
        };
        let mut ckpt = Checkpoint::assemble(format, path, parsed, opts.vocab_only)?;
        if format == Format::Safetensors {
            ckpt.read_quantization()?;
        }
        if opts.check_tensors {
            ckpt.check_tensors()?;
        }
        Ok(ckpt)
    }

    fn assemble(
        format: Format,
        path: &Path,
        parsed: Parsed,
        vocab_only: bool,
    ) -> Result<Checkpoint> {
        let Parsed {
            files,
            metadata,
            mut tensors,
            config,
            tokenizer,
        } = parsed;
        let mut warnings = Vec::new();

        // Reader output is re-checked against the maps, so `bytes()` can never slice outside
        // a file whatever a reader lets through.
        let mut by_name = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            let Some(file) = files.get(t.file) else {
                return Err(FormatError::Invalid {
                    path: path.to_path_buf(),
                    what: format!("tensor '{}'", t.name),
                    expected: format!("a file index below {}", files.len()),
                    got: t.file.to_string(),
                    hint: hint::CORRUPT,
                });
            };
            let end = t.offset.checked_add(t.nbytes);
            if end.is_none_or(|e| e > file.len()) || usize::try_from(t.offset).is_err() {
                return Err(FormatError::Invalid {
                    path: file.path().to_path_buf(),
                    what: format!("tensor '{}' data", t.name),
                    expected: format!("to lie within the file ({} bytes)", file.len()),
                    got: format!("{} bytes at offset {}", t.nbytes, t.offset),
                    hint: hint::TRUNCATED,
                });
            }
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(FormatError::Invalid {
                    path: file.path().to_path_buf(),
                    what: format!("tensor '{}'", t.name),
                    expected: "each tensor name once".into(),
                    got: "the name twice".into(),
                    hint: hint::CORRUPT,
                });
            }
        }

        let mut spec = match format {
            Format::Gguf => ModelSpec::from_gguf(&metadata).map_err(|e| e.to_string()),
            Format::Safetensors => match &config {
                Some(c) => ModelSpec::from_hf_config(c).map_err(|e| format!("config.json: {e}")),
                None => Err(
                    "no config.json beside the safetensors weights, so the architecture is unknown"
                        .to_owned(),
                ),
            },
        };

        // The architecture for roles: from the spec, or straight from the metadata when the
        // spec is incomplete, so a partial file still gets its roles.
        let arch = match (&spec, format) {
            (Ok(s), _) => Some(s.architecture.clone()),
            (Err(_), Format::Gguf) => metadata
                .get("general.architecture")
                .and_then(|v| v.as_str())
                .map(str::to_owned),
            (Err(_), Format::Safetensors) => config
                .as_ref()
                .and_then(|c| c.get("model_type"))
                .and_then(|v| v.as_str())
                .map(str::to_owned),
        };
        let arch_name = arch.as_deref().unwrap_or("");
        let roles_known = ModelSpec::supports_roles(arch_name);
        if !roles_known && !tensors.is_empty() {
            warnings.push(format!(
                "unsupported architecture '{}' for tensor roles (supported: {})",
                arch.as_deref().unwrap_or("unknown"),
                ModelSpec::SUPPORTED_ARCHITECTURES.join(", ")
            ));
        }
        for t in &mut tensors {
            let (layer, role) = ModelSpec::classify(&t.name, arch_name);
            t.layer = layer;
            t.role = role;
        }

        if let Ok(s) = &mut spec
            && !tensors.is_empty()
        {
            let has = |r: Role| tensors.iter().any(|t| t.role == Some(r));
            if has(Role::AttnQBias) || has(Role::AttnKBias) || has(Role::AttnVBias) {
                s.attention_bias = true;
            }
            // Whatever the architecture: without roles, the head is found by its name in
            // either naming scheme (a multimodal checkpoint prefixes it).
            let has_head = if roles_known {
                has(Role::Output)
            } else {
                tensors.iter().any(|t| {
                    t.name == "output.weight"
                        || t.name == "lm_head.weight"
                        || t.name.ends_with(".lm_head.weight")
                })
            };
            match format {
                // llama.cpp ties when there is no `output.weight` (it falls back to token_embd).
                Format::Gguf => s.tie_word_embeddings = !has_head,
                Format::Safetensors => {
                    if !s.tie_word_embeddings && !has_head {
                        warnings.push(
                            "config.json says tie_word_embeddings is false, but there is no lm_head.weight; the output will reuse the embedding"
                                .to_owned(),
                        );
                        s.tie_word_embeddings = true;
                    }
                }
            }
            if let Some(t) = tensors
                .iter()
                .find(|t| t.layer.is_some_and(|l| l >= s.n_layers))
            {
                warnings.push(format!(
                    "tensor '{}' belongs to layer {}, but the model has {} layers",
                    t.name,
                    t.layer.unwrap_or(0),
                    s.n_layers
                ));
            }
        }
        if roles_known {
            let unknown = tensors.iter().filter(|t| t.role.is_none()).count();
            if unknown > 0 {
                warnings.push(format!(
                    "{unknown} tensor(s) match no known role (see unknown_tensors())"
                ));
            }
        }

        Ok(Checkpoint {
            format,
            path: path.to_path_buf(),
            files,
            metadata,
            tensors,
            by_name,
            config,
            spec,
            tokenizer,
            vocab_only,
            roles_known,
            warnings,
            quantization: None,
        })
    }

    /// Read the quantisation settings beside a safetensors checkpoint and check its quantised
    /// linears (see the `quantized` module).
    fn read_quantization(&mut self) -> Result<()> {
        let folder = crate::safetensors::model_folder(&self.path);
        let beside = crate::hf_config::quantize_config_beside(&folder)?;
        let config_path = folder.join("config.json");
        let detected = crate::quantized::detect(
            self,
            self.config.as_ref().map(|c| (config_path.as_path(), c)),
            beside.as_ref().map(|(p, v)| (p.as_path(), v)),
        )?;
        self.warnings.extend(detected.warnings);
        self.quantization = detected.quantization;
        Ok(())
    }

    /// Scan every tensor for NaN and Inf, in parallel; the error names the first bad tensor in
    /// file order and the index of its first bad element.
    pub fn check_tensors(&self) -> Result<()> {
        use rayon::prelude::*;
        let bad = self.tensors.par_iter().find_map_first(|t| {
            crate::scan::find_non_finite(t.dtype, self.bytes(t)).map(|nf| (t, nf))
        });
        match bad {
            None => Ok(()),
            Some((t, nf)) => Err(FormatError::NonFinite {
                path: self.files[t.file].path().to_path_buf(),
                tensor: t.name.clone(),
                index: nf.index,
                kind: nf.kind,
            }),
        }
    }

    /// A tensor as f32, in its stored (row-major) order. Allocates `n_elements` floats; the
    /// element count was checked against the file at open time.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        let wrap = |source: FormatError| FormatError::Dequantize {
            path: self.files[t.file].path().to_path_buf(),
            tensor: t.name.clone(),
            source: Box::new(source),
        };
        let n = usize::try_from(t.n_elements()).map_err(|_| {
            wrap(FormatError::DequantizeBlocks {
                dtype: t.dtype,
                detail: format!("{} elements do not fit in memory", t.n_elements()),
            })
        })?;
        if !crate::dequant::supports(t.dtype) {
            // The dequantiser's own message, before anything is allocated.
            crate::dequant::dequantize_into(t.dtype, &[], &mut []).map_err(wrap)?;
        }
        let mut out = vec![0f32; n];
        crate::dequant::dequantize_into(t.dtype, self.bytes(t), &mut out).map_err(wrap)?;
        Ok(out)
    }

    /// The stored bytes of a tensor, by name: a view into the memory map.
    pub fn raw_bytes(&self, name: &str) -> Result<&[u8]> {
        self.tensor(name).map(|t| self.bytes(t))
    }

    /// The GPTQ or EXL2 quantisation of a safetensors checkpoint: its settings and every
    /// quantised linear, validated at open time. `None` for unquantised checkpoints and GGUF.
    pub fn quantization(&self) -> Option<&crate::Quantization> {
        self.quantization.as_ref()
    }

    /// Whether the checkpoint was opened with `vocab_only` (no tensor table).
    pub fn vocab_only(&self) -> bool {
        self.vocab_only
    }

    /// Things that do not stop the checkpoint from opening: an architecture whose tensor roles
    /// are unknown, tensors that match no role, a tie that the config contradicts.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Tensors of a supported architecture whose names match no role (empty when roles are
    /// unknown for the architecture: then no tensor has a role).
    pub fn unknown_tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        let known = self.roles_known;
        self.tensors
            .iter()
            .filter(move |t| known && t.role.is_none())
    }

    /// Whether tensor roles are known for this checkpoint's architecture.
    pub fn roles_known(&self) -> bool {
        self.roles_known
    }

    pub fn format(&self) -> Format {
        self.format
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The files that make up the checkpoint, in order; `TensorInfo::file` indexes this.
    pub fn files(&self) -> impl ExactSizeIterator<Item = &Path> {
        self.files.iter().map(|f| f.path())
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn config(&self) -> Option<&serde_json::Value> {
        self.config.as_ref()
    }

    pub fn tokenizer(&self) -> &TokenizerInfo {
        &self.tokenizer
    }

    /// The architecture, or why it could not be read.
    pub fn spec(&self) -> std::result::Result<&ModelSpec, &str> {
        self.spec.as_ref().map_err(String::as_str)
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| FormatError::NoSuchTensor {
                path: self.path.clone(),
                name: name.to_owned(),
            })
    }

    /// The stored bytes of a tensor: a view into the memory map, validated at open time.
    /// A `TensorInfo` that does not come from this checkpoint gets an empty slice if it points
    /// outside the files.
    pub fn bytes(&self, info: &TensorInfo) -> &[u8] {
        let Some(file) = self.files.get(info.file) else {
            return &[];
        };
        let range = usize::try_from(info.offset)
            .ok()
            .zip(usize::try_from(info.nbytes).ok())
            .and_then(|(s, n)| Some(s..s.checked_add(n)?));
        range.and_then(|r| file.bytes().get(r)).unwrap_or(&[])
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes).sum()
    }

    /// Total number of parameters (elements over all tensors).
    pub fn n_params(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::n_elements).sum()
    }

    /// The checkpoint as the Python bindings show it, less its metadata (whose arrays decode as
    /// they are read) and its tensor rows (built one at a time, on request): the files as
    /// paths, the architecture or why it could not be read, the warnings, the tokenizer summary,
    /// the HF config, and the counts of parameters, bytes and tensors.
    pub fn view(&self) -> impl Serialize + '_ {
        #[derive(Serialize)]
        struct View<'a> {
            files: Vec<String>,
            spec: Option<&'a ModelSpec>,
            spec_error: Option<&'a str>,
            warnings: &'a [String],
            tokenizer: &'a TokenizerInfo,
            config: Option<&'a serde_json::Value>,
            n_params: u64,
            nbytes: u64,
            n_tensors: usize,
        }
        View {
            files: self.files().map(|p| p.display().to_string()).collect(),
            spec: self.spec().ok(),
            spec_error: self.spec().err(),
            warnings: &self.warnings,
            tokenizer: &self.tokenizer,
            config: self.config(),
            n_params: self.n_params(),
            nbytes: self.total_bytes(),
            n_tensors: self.tensors.len(),
        }
    }
}

/// Work out the format: a folder is safetensors; a file starting with the GGUF magic (either
/// byte order) is GGUF; a `.safetensors` or `.json` file, or one whose header looks like a
/// safetensors header, is safetensors.
fn detect(path: &Path) -> Result<Format> {
    let io = |source| FormatError::Io {
        path: path.to_path_buf(),
        source,
    };
    let md = std::fs::metadata(path).map_err(io)?;
    if md.is_dir() {
        return Ok(Format::Safetensors);
    }
    let mut head = [0u8; 9];
    let mut n = 0;
    let mut f = std::fs::File::open(path).map_err(io)?;
    while n < head.len() {
        match f.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
    if n >= 4 && (head[..4] == crate::gguf::MAGIC || head[..4] == GGUF_MAGIC_SWAPPED) {
        return Ok(Format::Gguf);
    }
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext.eq_ignore_ascii_case("safetensors") || ext.eq_ignore_ascii_case("json") {
        return Ok(Format::Safetensors);
    }
    // A safetensors file under another name: an 8-byte length, then the JSON header.
    if n == head.len() && head[8] == b'{' {
        return Ok(Format::Safetensors);
    }
    if ext.eq_ignore_ascii_case("gguf") || n < 4 {
        return Err(FormatError::Invalid {
            path: path.to_path_buf(),
            what: "magic".into(),
            expected: format!("the GGUF magic {}", show_bytes(&crate::gguf::MAGIC)),
            got: if n < 4 {
                format!("a {n}-byte file")
            } else {
                show_bytes(&head[..4])
            },
            hint: if n < 4 {
                hint::TRUNCATED
            } else {
                hint::NOT_GGUF
            },
        });
    }
    Err(FormatError::Invalid {
        path: path.to_path_buf(),
        what: "magic".into(),
        expected: format!(
            "the GGUF magic {}, or a safetensors file, folder or index",
            show_bytes(&crate::gguf::MAGIC)
        ),
        got: show_bytes(&head[..4]),
        hint: "the file is neither GGUF nor safetensors (a pickle .bin or .pt checkpoint is not supported)",
    })
}

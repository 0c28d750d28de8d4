//! safetensors reader (file, folder, sharded index) over mmap, through the official crate.
//!
//! The official `safetensors` crate parses and validates each header (header length, UTF-8,
//! JSON, dtypes, packed non-overlapping offsets that cover the data section exactly). On top of
//! that this module refuses duplicate tensor names (which the crate's hash map would silently
//! merge), checks shard indexes against their shards, and keeps every shard path inside the
//! model folder.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use ::safetensors::SafeTensorError;
use ::safetensors::SafeTensors;
use ::safetensors::tensor::Dtype;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::checkpoint::{Parsed, TokenizerInfo};
use crate::error::hint;
use crate::hf_config::JSON_CAP;
use crate::mapped::MappedFile;
use crate::{DType, FormatError, MetaValue, Metadata, Result, TensorInfo};

/// The safetensors header-length prefix.
const N_LEN: usize = 8;
/// The official crate's header cap (`MAX_HEADER_SIZE`).
const MAX_HEADER: u64 = 100_000_000;

const SINGLE_NAME: &str = "model.safetensors";
const INDEX_NAME: &str = "model.safetensors.index.json";

/// Read a safetensors checkpoint: a `.safetensors` file, a model folder, or a shard index.
/// With `vocab_only`, a folder of tokenizer files and a config without weights (a tokenizer's
/// own repository, as transformers' `AutoTokenizer` opens one) opens too, holding no file.
pub(crate) fn read(path: &Path, vocab_only: bool) -> Result<Parsed> {
    let (folder, files, metadata, tensors) = match resolve(path) {
        Ok((folder, Layout::Single(file))) => {
            let mapped = MappedFile::open(&file)?;
            let shard = read_shard(&mapped, 0)?;
            let metadata = shard_metadata(std::iter::once(&shard.metadata));
            (folder, vec![mapped], metadata, shard.tensors)
        }
        Ok((folder, Layout::Index(index))) => {
            let (files, metadata, tensors) = read_index(&index, &folder)?;
            (folder, files, metadata, tensors)
        }
        Err(_) if vocab_only && holds_tokenizer(path) => {
            (path.to_path_buf(), Vec::new(), Metadata::new(), Vec::new())
        }
        Err(e) => return Err(e),
    };
    let config = crate::hf_config::beside(&folder)?;
    let tokenizer = tokenizer_info(&folder, config.as_ref())?;
    Ok(Parsed {
        files: files.into_iter().map(std::sync::Arc::new).collect(),
        metadata,
        tensors: if vocab_only { Vec::new() } else { tensors },
        config,
        tokenizer,
    })
}

/// Whether `path` is a folder with transformers' tokenizer files in it.
fn holds_tokenizer(path: &Path) -> bool {
    path.is_dir()
        && ["tokenizer.json", "tokenizer.model"]
            .iter()
            .any(|f| path.join(f).is_file())
}

enum Layout {
    Single(PathBuf),
    Index(PathBuf),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> FormatError + '_ {
    move |source| FormatError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn invalid(
    path: &Path,
    what: impl Into<String>,
    expected: impl Into<String>,
    got: impl Into<String>,
    hint: &'static str,
) -> FormatError {
    FormatError::Invalid {
        path: path.to_path_buf(),
        what: what.into(),
        expected: expected.into(),
        got: got.into(),
        hint,
    }
}

/// Work out the folder and whether it holds one file or an index. Transformers' order is kept:
/// `model.safetensors` first, then `model.safetensors.index.json`.
fn resolve(path: &Path) -> Result<(PathBuf, Layout)> {
    let md = fs::metadata(path).map_err(io_err(path))?;
    if md.is_dir() {
        let single = path.join(SINGLE_NAME);
        if single.is_file() {
            return Ok((path.to_path_buf(), Layout::Single(single)));
        }
        let index = path.join(INDEX_NAME);
        if index.is_file() {
            return Ok((path.to_path_buf(), Layout::Index(index)));
        }
        let mut found = Vec::new();
        for entry in fs::read_dir(path).map_err(io_err(path))? {
            let entry = entry.map_err(io_err(path))?;
            let p = entry.path();
            if p.extension().is_some_and(|e| e == "safetensors") && p.is_file() {
                found.push(p);
                if found.len() > 16 {
                    break;
                }
            }
        }
        found.sort();
        return match found.len() {
            1 => Ok((path.to_path_buf(), Layout::Single(found.remove(0)))),
            0 => Err(invalid(
                path,
                "model folder",
                format!("{SINGLE_NAME}, {INDEX_NAME} or one *.safetensors file"),
                "no safetensors weights",
                "the path is not a safetensors model folder, or the download is incomplete",
            )),
            n => {
                let names: Vec<String> = found
                    .iter()
                    .take(4)
                    .filter_map(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
                    .collect();
                Err(invalid(
                    path,
                    "model folder",
                    format!("{SINGLE_NAME}, {INDEX_NAME} or exactly one *.safetensors file"),
                    format!(
                        "{}{} *.safetensors files ({}, ...) and no index",
                        if n > 16 { "more than " } else { "" },
                        n.min(16),
                        names.join(", ")
                    ),
                    "open one file, or add the model.safetensors.index.json that lists the shards",
                ))
            }
        };
    }
    let folder = model_folder(path);
    if path.extension().is_some_and(|e| e == "json") {
        Ok((folder, Layout::Index(path.to_path_buf())))
    } else {
        Ok((folder, Layout::Single(path.to_path_buf())))
    }
}

/// Read a whole small file, refusing anything over `cap` before reading it.
pub(crate) fn read_capped(path: &Path, cap: u64, what: &str) -> Result<Vec<u8>> {
    let file = fs::File::open(path).map_err(io_err(path))?;
    let len = file.metadata().map_err(io_err(path))?.len();
    if len > cap {
        return Err(invalid(
            path,
            what,
            format!("at most {cap} bytes"),
            format!("{len} bytes"),
            hint::HOSTILE,
        ));
    }
    let mut buf = Vec::with_capacity(len as usize);
    // `take` guards against a file that grows after the size check.
    file.take(cap).read_to_end(&mut buf).map_err(io_err(path))?;
    Ok(buf)
}

// ---------------------------------------------------------------------------------------------
// One file

struct Shard {
    tensors: Vec<TensorInfo>,
    metadata: Option<HashMap<String, String>>,
}

fn map_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::BOOL => DType::BOOL,
        Dtype::U8 => DType::U8,
        Dtype::I8 => DType::I8,
        Dtype::I16 => DType::I16,
        Dtype::U16 => DType::U16,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I32 => DType::I32,
        Dtype::U32 => DType::U32,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::I64 => DType::I64,
        Dtype::U64 => DType::U64,
        Dtype::C64 => DType::C64,
        Dtype::F8_E4M3 => DType::F8_E4M3,
        Dtype::F8_E5M2 => DType::F8_E5M2,
        Dtype::F8_E8M0 => DType::F8_E8M0,
        Dtype::F4 => DType::F4,
        Dtype::F6_E2M3 => DType::F6_E2M3,
        Dtype::F6_E3M2 => DType::F6_E3M2,
        Dtype::F8_E4M3FNUZ => DType::F8_E4M3FNUZ,
        Dtype::F8_E5M2FNUZ => DType::F8_E5M2FNUZ,
        // Whatever later versions add (`Dtype` is non-exhaustive).
        _ => return None,
    })
}

/// Parse, validate and list the tensors of one mapped safetensors file. `file` is its index in
/// the checkpoint's file list.
fn read_shard(mapped: &MappedFile, file: usize) -> Result<Shard> {
    let path = mapped.path();
    let bytes = mapped.bytes();
    let (n, meta) = SafeTensors::read_metadata(bytes).map_err(|e| explain(path, bytes, e))?;
    // The crate parses the header into a hash map, so a repeated name is merged silently when
    // its offsets still line up; look at the raw header for repeats.
    let header = header_str(bytes, n);
    if let Ok(HeaderKeys(Some(name))) = serde_json::from_str::<HeaderKeys>(header) {
        return Err(invalid(
            path,
            format!("tensor '{name}'"),
            "each tensor name once in the header",
            "the name twice",
            hint::CORRUPT_ST,
        ));
    }
    let data_start = (N_LEN + n) as u64;
    let names = meta.offset_keys();
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let Some(info) = meta.info(&name) else {
            continue;
        };
        let Some(dtype) = map_dtype(info.dtype) else {
            return Err(FormatError::Unsupported {
                path: path.to_path_buf(),
                what: format!("tensor '{name}' dtype {}", info.dtype),
                detail: "weightlift has no element type for it".into(),
            });
        };
        let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        let (s, e) = info.data_offsets;
        let nbytes = e.saturating_sub(s) as u64;
        // The crate has checked this already (`Metadata::validate`); keep our own type table
        // honest against it.
        let n_elements = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if n_elements.and_then(|k| dtype.bytes_for(k)) != Some(nbytes) {
            return Err(invalid(
                path,
                format!("tensor '{name}'"),
                format!("{dtype} x {shape:?} to take the bytes between its data_offsets"),
                format!("{nbytes} bytes"),
                hint::CORRUPT_ST,
            ));
        }
        let offset = data_start.checked_add(s as u64).ok_or_else(|| {
            invalid(
                path,
                format!("tensor '{name}' offset"),
                "a 64-bit offset",
                "an overflow",
                hint::HOSTILE,
            )
        })?;
        tensors.push(TensorInfo {
            name,
            dtype,
            shape,
            nbytes,
            file,
            offset,
            layer: None,
            role: None,
        });
    }
    Ok(Shard {
        tensors,
        metadata: meta.metadata().clone(),
    })
}

fn header_str(bytes: &[u8], n: usize) -> &str {
    bytes
        .get(N_LEN..N_LEN.saturating_add(n))
        .and_then(|h| std::str::from_utf8(h).ok())
        .unwrap_or("")
}

fn header_len(bytes: &[u8]) -> Option<u64> {
    let arr: [u8; N_LEN] = bytes.get(..N_LEN)?.try_into().ok()?;
    Some(u64::from_le_bytes(arr))
}

/// Turn the official crate's error into one that names the tensor, the expected and found
/// values, and the likely cause. The crate's errors are terse (some name no tensor), so the raw
/// header is re-read leniently to find the culprit.
fn explain(path: &Path, bytes: &[u8], e: SafeTensorError) -> FormatError {
    let file_len = bytes.len() as u64;
    let claimed = header_len(bytes).unwrap_or(0);
    let raw = || {
        let n = usize::try_from(claimed).unwrap_or(usize::MAX);
        serde_json::from_str::<RawHeader>(header_str(bytes, n)).ok()
    };
    // A repeated name makes the crate's hash map drop an entry, which then shows up as a gap
    // or a size mismatch; name the real cause.
    let after_parse = !matches!(
        e,
        SafeTensorError::HeaderTooSmall
            | SafeTensorError::HeaderTooLarge
            | SafeTensorError::InvalidHeaderLength
            | SafeTensorError::InvalidHeader(_)
    );
    if after_parse && let Some(name) = raw().and_then(|r| r.duplicate) {
        return invalid(
            path,
            format!("tensor '{name}'"),
            "each tensor name once in the header",
            "the name twice",
            hint::CORRUPT_ST,
        );
    }
    match e {
        SafeTensorError::HeaderTooSmall => invalid(
            path,
            "header length",
            "an 8-byte little-endian header length",
            format!("a {file_len}-byte file"),
            hint::TRUNCATED,
        ),
        SafeTensorError::HeaderTooLarge => invalid(
            path,
            "header length",
            format!("at most {MAX_HEADER} bytes"),
            format!("{claimed} bytes"),
            hint::HOSTILE,
        ),
        SafeTensorError::InvalidHeaderLength => invalid(
            path,
            "header length",
            format!(
                "at most {} bytes (the file size minus the 8-byte prefix)",
                file_len.saturating_sub(N_LEN as u64)
            ),
            format!("{claimed} bytes"),
            hint::TRUNCATED,
        ),
        SafeTensorError::InvalidHeader(u) => invalid(
            path,
            "header",
            "utf-8 json",
            format!("invalid utf-8 at header byte {}", u.valid_up_to()),
            hint::CORRUPT_ST,
        ),
        SafeTensorError::InvalidHeaderDeserialization(j) => {
            if let Some(raw) = raw() {
                for (name, v) in &raw.entries {
                    if let Some(dt) = v.get("dtype").and_then(|d| d.as_str())
                        && serde_json::from_value::<Dtype>(serde_json::Value::String(dt.into()))
                            .is_err()
                    {
                        return FormatError::Unsupported {
                            path: path.to_path_buf(),
                            what: format!("tensor '{name}' dtype '{dt}'"),
                            detail: "the safetensors format defines no such dtype (a newer writer, or a corrupted header)".into(),
                        };
                    }
                }
            }
            invalid(
                path,
                "header json",
                "an object of {\"dtype\", \"shape\", \"data_offsets\"} tensor entries",
                format!("a parse error: {j}"),
                hint::CORRUPT_ST,
            )
        }
        SafeTensorError::InvalidOffset(name) => {
            let mut got = String::from("offsets that leave a gap, overlap, or run backwards");
            if let Some(raw) = raw() {
                let mut entries: Vec<(&String, (u64, u64))> = raw
                    .entries
                    .iter()
                    .filter_map(|(k, v)| Some((k, raw_offsets(v)?)))
                    .collect();
                entries.sort_by_key(|(_, o)| *o);
                let mut prev_end = 0;
                for (k, (s, e)) in entries {
                    if *k == name {
                        got = format!("[{s}, {e}] where the previous tensor ends at {prev_end}");
                        break;
                    }
                    prev_end = e;
                }
            }
            invalid(
                path,
                format!("tensor '{name}' data_offsets"),
                "each tensor to start where the previous one ends (packed, no gaps or overlaps)",
                got,
                hint::CORRUPT_ST,
            )
        }
        SafeTensorError::TensorInvalidInfo
        | SafeTensorError::ValidationOverflow
        | SafeTensorError::MisalignedSlice => {
            let culprit = raw().and_then(|raw| {
                raw.entries.iter().find_map(|(k, v)| {
                    let (s, e) = raw_offsets(v)?;
                    let dt = v.get("dtype").and_then(|d| d.as_str())?;
                    let dtype = DType::from_name(dt)?;
                    let shape: Vec<u64> = v
                        .get("shape")?
                        .as_array()?
                        .iter()
                        .map(|d| d.as_u64())
                        .collect::<Option<_>>()?;
                    let need = shape
                        .iter()
                        .try_fold(1u64, |a, &d| a.checked_mul(d))
                        .and_then(|n| dtype.bytes_for(n));
                    let have = e.checked_sub(s);
                    (need != have).then(|| {
                        let need = need.map_or_else(
                            || "a size that overflows or is not whole bytes".to_owned(),
                            |b| format!("{b} bytes"),
                        );
                        let have =
                            have.map_or_else(|| format!("[{s}, {e}]"), |h| format!("{h} bytes"));
                        (k.clone(), format!("{dt} x {shape:?} = {need}"), have)
                    })
                })
            });
            match culprit {
                Some((name, expected, got)) => invalid(
                    path,
                    format!("tensor '{name}'"),
                    expected,
                    format!("data_offsets spanning {got}"),
                    hint::CORRUPT_ST,
                ),
                None => invalid(
                    path,
                    "tensor table",
                    "dtype x shape to match every tensor's data_offsets",
                    e.to_string(),
                    hint::CORRUPT_ST,
                ),
            }
        }
        SafeTensorError::MetadataIncompleteBuffer => {
            let data = file_len.saturating_sub(N_LEN as u64 + claimed);
            let end = raw()
                .and_then(|r| {
                    r.entries
                        .iter()
                        .filter_map(|(_, v)| raw_offsets(v))
                        .map(|o| o.1)
                        .max()
                })
                .unwrap_or(0);
            invalid(
                path,
                "data section",
                format!("{end} bytes (the end of the last tensor)"),
                format!("{data} bytes"),
                if data < end {
                    hint::TRUNCATED
                } else {
                    "the file has trailing bytes after the last tensor; it is corrupted or was concatenated"
                },
            )
        }
        other => invalid(
            path,
            "header",
            "a valid safetensors header",
            other.to_string(),
            hint::CORRUPT_ST,
        ),
    }
}

fn raw_offsets(v: &serde_json::Value) -> Option<(u64, u64)> {
    let o = v.get("data_offsets")?.as_array()?;
    match o.as_slice() {
        [s, e] => Some((s.as_u64()?, e.as_u64()?)),
        _ => None,
    }
}

/// The header as written: entries in order, and the first repeated name, if any.
#[derive(Default)]
struct RawHeader {
    entries: Vec<(String, serde_json::Value)>,
    duplicate: Option<String>,
}

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a safetensors header object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<RawHeader, A::Error> {
                let mut out = RawHeader::default();
                let mut seen = std::collections::HashSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        map.next_value::<IgnoredAny>()?;
                        if !seen.insert(key.clone()) && out.duplicate.is_none() {
                            out.duplicate = Some(key);
                        }
                        continue;
                    }
                    let v = map.next_value::<serde_json::Value>()?;
                    if !seen.insert(key.clone()) && out.duplicate.is_none() {
                        out.duplicate = Some(key.clone());
                    }
                    out.entries.push((key, v));
                }
                Ok(out)
            }
        }
        d.deserialize_map(V)
    }
}

/// The first repeated top-level key of a header, skipping every value.
struct HeaderKeys(Option<String>);

impl<'de> serde::Deserialize<'de> for HeaderKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = HeaderKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a safetensors header object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<HeaderKeys, A::Error> {
                // The whole map is read even after a repeat: serde_json fails a visitor that
                // stops early.
                let mut seen = std::collections::HashSet::new();
                let mut first = None;
                while let Some(key) = map.next_key::<String>()? {
                    map.next_value::<IgnoredAny>()?;
                    if first.is_none() && seen.contains(&key) {
                        first = Some(key);
                    } else {
                        seen.insert(key);
                    }
                }
                Ok(HeaderKeys(first))
            }
        }
        d.deserialize_map(V)
    }
}

/// `__metadata__` of every shard, keys sorted; the first shard wins on a repeated key.
fn shard_metadata<'a>(
    shards: impl Iterator<Item = &'a Option<HashMap<String, String>>>,
) -> Metadata {
    let mut merged = BTreeMap::new();
    for m in shards.flatten() {
        for (k, v) in m {
            merged.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    merged
        .into_iter()
        .map(|(k, v)| (k, MetaValue::String(v)))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Shard index

/// `weight_map` as written: entries in order, or what it was instead of an object.
enum WeightMap {
    Entries(Vec<(String, serde_json::Value)>),
    NotObject(&'static str),
}

struct RawIndex {
    weight_map: Option<WeightMap>,
    duplicate: Option<String>,
}

impl<'de> serde::Deserialize<'de> for WeightMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WeightMap;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any json value")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<WeightMap, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    out.push((k, map.next_value()?));
                }
                Ok(WeightMap::Entries(out))
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<WeightMap, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(WeightMap::NotObject("an array"))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> std::result::Result<WeightMap, E> {
                Ok(WeightMap::NotObject("a string"))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<WeightMap, E> {
                Ok(WeightMap::NotObject("a bool"))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> std::result::Result<WeightMap, E> {
                Ok(WeightMap::NotObject("a number"))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> std::result::Result<WeightMap, E> {
                Ok(WeightMap::NotObject("a number"))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> std::result::Result<WeightMap, E> {
                Ok(WeightMap::NotObject("a number"))
            }
            fn visit_unit<E: de::Error>(self) -> std::result::Result<WeightMap, E> {
                Ok(WeightMap::NotObject("null"))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> serde::Deserialize<'de> for RawIndex {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawIndex;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a json object with a \"weight_map\" key")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<RawIndex, A::Error> {
                let mut out = RawIndex {
                    weight_map: None,
                    duplicate: None,
                };
                while let Some(k) = map.next_key::<String>()? {
                    if k == "weight_map" {
                        let wm: WeightMap = map.next_value()?;
                        if out.weight_map.is_some() {
                            out.duplicate = Some("weight_map".into());
                        }
                        out.weight_map = Some(wm);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_map(V)
    }
}

/// The one place outside the model folder a shard may live: the Hugging Face hub cache keeps
/// each revision as `models--org--name/snapshots/<rev>/` whose files are symlinks into
/// `models--org--name/blobs/` (huggingface_hub's documented cache layout). For such a folder
/// this returns that `blobs` folder.
fn hub_cache_blobs(folder_canon: &Path) -> Option<PathBuf> {
    let snapshots = folder_canon.parent()?;
    let repo = snapshots.parent()?;
    let repo_name = repo.file_name()?.to_str()?;
    (snapshots.file_name()? == "snapshots" && repo_name.starts_with("models--"))
        .then(|| repo.join("blobs"))
}

/// Check one shard name from the index and return its path. Refuses absolute paths, `..`, and
/// anything (a symlink, say) whose canonical target lies outside the canonical folder (or, for a
/// hub-cache snapshot, outside its repository's `blobs`).
fn shard_path(
    index: &Path,
    folder: &Path,
    folder_canon: &Path,
    tensor: &str,
    name: &str,
) -> Result<PathBuf> {
    let p = Path::new(name);
    let plain = !name.is_empty()
        && p.components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if !plain {
        return Err(invalid(
            index,
            format!("weight_map entry for tensor '{tensor}'"),
            "a shard file name inside the model folder",
            format!("the path '{name}'"),
            hint::ESCAPE,
        ));
    }
    let joined = folder.join(p);
    let canon = match fs::canonicalize(&joined) {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(invalid(
                index,
                format!("shard '{name}' (holding tensor '{tensor}')"),
                format!("the file {}", joined.display()),
                "no such file (or a dangling symlink)",
                hint::SHARDS,
            ));
        }
        Err(e) => return Err(io_err(&joined)(e)),
    };
    if !canon.starts_with(folder_canon)
        && !hub_cache_blobs(folder_canon).is_some_and(|b| canon.starts_with(b))
    {
        return Err(invalid(
            index,
            format!("shard '{name}'"),
            format!("a file inside {}", folder_canon.display()),
            format!("a link to {}", canon.display()),
            hint::ESCAPE,
        ));
    }
    if !canon.is_file() {
        return Err(invalid(
            index,
            format!("shard '{name}'"),
            "a regular file",
            "a directory or special file",
            hint::SHARDS,
        ));
    }
    Ok(joined)
}

type Read3 = (Vec<MappedFile>, Metadata, Vec<TensorInfo>);

fn read_index(index: &Path, folder: &Path) -> Result<Read3> {
    let text = read_capped(index, JSON_CAP, "index file")?;
    let raw: RawIndex = serde_json::from_slice(&text).map_err(|e| {
        invalid(
            index,
            "index json",
            "a json object with a \"weight_map\" of tensor name to shard file",
            format!("a parse error: {e}"),
            hint::SHARDS,
        )
    })?;
    if let Some(k) = raw.duplicate {
        return Err(invalid(
            index,
            k,
            "the key once",
            "the key twice",
            hint::SHARDS,
        ));
    }
    let entries = match raw.weight_map {
        None => {
            return Err(invalid(
                index,
                "weight_map",
                "a \"weight_map\" object of tensor name to shard file",
                "no such key",
                "the json file is not a safetensors shard index",
            ));
        }
        Some(WeightMap::NotObject(kind)) => {
            return Err(invalid(
                index,
                "weight_map",
                "an object of tensor name to shard file",
                kind,
                hint::SHARDS,
            ));
        }
        Some(WeightMap::Entries(e)) => e,
    };
    if entries.is_empty() {
        return Err(invalid(
            index,
            "weight_map",
            "at least one tensor",
            "an empty object",
            hint::SHARDS,
        ));
    }

    let folder_canon = fs::canonicalize(folder).map_err(io_err(folder))?;
    // tensor -> shard name, and shard name -> its checked path.
    let mut listed: HashMap<&str, &str> = HashMap::with_capacity(entries.len());
    let mut shards: BTreeMap<&str, PathBuf> = BTreeMap::new();
    for (tensor, v) in &entries {
        let Some(shard) = v.as_str() else {
            return Err(invalid(
                index,
                format!("weight_map entry for tensor '{tensor}'"),
                "a shard file name (a string)",
                super_kind(v),
                hint::SHARDS,
            ));
        };
        if listed.insert(tensor, shard).is_some() {
            return Err(invalid(
                index,
                format!("weight_map entry for tensor '{tensor}'"),
                "each tensor listed once",
                "the tensor listed twice",
                hint::SHARDS,
            ));
        }
        if !shards.contains_key(shard) {
            let p = shard_path(index, folder, &folder_canon, tensor, shard)?;
            shards.insert(shard, p);
        }
    }

    let mut files = Vec::with_capacity(shards.len());
    let mut read = Vec::with_capacity(shards.len());
    for (i, p) in shards.values().enumerate() {
        let mapped = MappedFile::open(p)?;
        read.push(read_shard(&mapped, i)?);
        files.push(mapped);
    }

    // Every tensor of every shard: in one shard only, listed, and listed under that shard.
    let mut found_in: HashMap<&str, &str> = HashMap::with_capacity(entries.len());
    for (shard, got) in shards.keys().zip(&read) {
        for t in &got.tensors {
            if let Some(other) = found_in.insert(&t.name, shard) {
                return Err(invalid(
                    index,
                    format!("tensor '{}'", t.name),
                    "each tensor in exactly one shard",
                    format!("the tensor in both '{other}' and '{shard}'"),
                    hint::SHARDS,
                ));
            }
            match listed.get(t.name.as_str()) {
                None => {
                    return Err(invalid(
                        index,
                        format!("tensor '{}' in shard '{shard}'", t.name),
                        "every tensor of every shard listed in the weight_map",
                        "a tensor the index does not list",
                        hint::SHARDS,
                    ));
                }
                Some(s) if s != shard => {
                    return Err(invalid(
                        index,
                        format!("tensor '{}'", t.name),
                        format!("it in shard '{s}', where the index lists it"),
                        format!("it in shard '{shard}'"),
                        hint::SHARDS,
                    ));
                }
                Some(_) => {}
            }
        }
    }
    // And every listed tensor present (in its shard, by the check above).
    for (tensor, v) in &entries {
        if !found_in.contains_key(tensor.as_str()) {
            return Err(invalid(
                index,
                format!("tensor '{tensor}'"),
                format!(
                    "it in shard '{}', where the index lists it",
                    v.as_str().unwrap_or("")
                ),
                "a shard that does not hold it",
                hint::SHARDS,
            ));
        }
    }

    let metadata = shard_metadata(read.iter().map(|s| &s.metadata));
    let all = read.into_iter().flat_map(|s| s.tensors).collect();
    Ok((files, metadata, all))
}

pub(crate) fn super_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a bool",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json

/// The folder that holds a safetensors checkpoint's config files: the path itself when it is
/// a folder, else the folder of the file (a single file or the shard index).
pub(crate) fn model_folder(path: &Path) -> PathBuf {
    if path.is_dir() {
        return path.to_path_buf();
    }
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn tokenizer_info(folder: &Path, config: Option<&serde_json::Value>) -> Result<TokenizerInfo> {
    let mut info = TokenizerInfo::default();
    if let Some(c) = config {
        info.bos_token_id = c.get("bos_token_id").and_then(serde_json::Value::as_u64);
        info.eos_token_id = c.get("eos_token_id").and_then(serde_json::Value::as_u64);
    }
    let path = folder.join("tokenizer.json");
    if !path.is_file() {
        return Ok(info);
    }
    // Presence only: skimming a 3.6 MB tokenizer.json for its model type and counts takes
    // about 4 ms (80 times the rest of the open), and more for larger vocabularies.
    info.has_tokenizer_json = true;
    Ok(info)
}

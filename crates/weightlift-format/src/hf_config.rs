//! HF `config.json` and the settings files beside it: what transformers keeps next to the
//! weights, read as JSON objects under a size cap.

use std::path::{Path, PathBuf};

use crate::Result;
use crate::safetensors::{invalid, read_capped, super_kind};

/// Cap on `config.json` and index files: real ones are kilobytes.
pub(crate) const JSON_CAP: u64 = 64 << 20;

/// Read an HF `config.json` as a JSON object. A file over the cap, one that is not JSON, or
/// JSON that is not an object is a [`crate::FormatError::Invalid`] naming the file.
pub fn read(path: &Path) -> Result<serde_json::Value> {
    read_object(path, "config")
}

/// The config a path names when it holds no weights: a `.json` file other than a shard index,
/// or a folder with a `config.json` and no weights (no `.safetensors`, `.gguf` or
/// `.index.json` file). `None` for anything else, which opens as a checkpoint.
pub fn config_only(path: &Path) -> Option<PathBuf> {
    if path.is_file() {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let config = name.ends_with(".json") && !name.ends_with(".index.json");
        return config.then(|| path.to_path_buf());
    }
    let config = path.join("config.json");
    if !path.is_dir() || !config.is_file() {
        return None;
    }
    let entries = std::fs::read_dir(path).ok()?;
    let has_weights = entries.flatten().any(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        name.ends_with(".safetensors") || name.ends_with(".gguf") || name.ends_with(".index.json")
    });
    (!has_weights).then_some(config)
}

/// The type a config says its weights are stored in: `torch_dtype`, or `dtype` as
/// transformers 5 writes it.
pub fn stored_dtype(config: &serde_json::Value) -> Option<&str> {
    ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| config.get(k).and_then(serde_json::Value::as_str))
}

/// A config's RoPE scaling: `rope_scaling` as transformers 4 writes it, else
/// `rope_parameters` as transformers 5 does.
pub fn rope_scaling(config: &serde_json::Value) -> Option<&serde_json::Value> {
    config
        .get("rope_scaling")
        .filter(|v| !v.is_null())
        .or_else(|| config.get("rope_parameters"))
}

/// The type of a config's RoPE scaling (`rope_type`, or `type` as older configs write it).
pub fn rope_scaling_kind(config: &serde_json::Value) -> Option<&str> {
    let r = rope_scaling(config)?;
    r.get("rope_type")
        .or_else(|| r.get("type"))
        .and_then(serde_json::Value::as_str)
}

/// Whether a config scales RoPE by LongRoPE with its own factor lists (type `longrope`, or
/// `su` as the first Phi-3 128k configs wrote it, and a non-empty `long_factor`): llama.cpp's
/// converter then writes the lists as two tensors, `rope_factors_long` and
/// `rope_factors_short`.
pub fn has_longrope_factors(config: &serde_json::Value) -> bool {
    let long = rope_scaling(config)
        .and_then(|r| r.get("long_factor"))
        .and_then(serde_json::Value::as_array)
        .is_some_and(|a| !a.is_empty());
    long && matches!(rope_scaling_kind(config), Some("longrope" | "su"))
}

/// The `config.json` in a safetensors checkpoint's folder, if there is one.
pub(crate) fn beside(folder: &Path) -> Result<Option<serde_json::Value>> {
    let path = folder.join("config.json");
    if !path.is_file() {
        return Ok(None);
    }
    read_object(&path, "config.json").map(Some)
}

/// The quantisation settings file auto-gptq and gptqmodel write beside `config.json`, if any.
pub(crate) fn quantize_config_beside(
    folder: &Path,
) -> Result<Option<(PathBuf, serde_json::Value)>> {
    for name in crate::quantized::BESIDE_NAMES {
        let path = folder.join(name);
        if path.is_file() {
            let v = read_object(&path, name)?;
            return Ok(Some((path, v)));
        }
    }
    Ok(None)
}

fn read_object(path: &Path, what: &str) -> Result<serde_json::Value> {
    let text = read_capped(path, JSON_CAP, what)?;
    let v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| {
        invalid(
            path,
            what,
            "a json object",
            format!("a parse error: {e}"),
            "the config is corrupted or incomplete",
        )
    })?;
    if !v.is_object() {
        return Err(invalid(
            path,
            what,
            "a json object",
            super_kind(&v),
            "the config is corrupted",
        ));
    }
    Ok(v)
}

/// The Hugging Face Hub cache: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub`, as huggingface_hub finds it.
pub fn hub_cache() -> Option<PathBuf> {
    std::env::var_os("HF_HUB_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HF_HOME").map(|h| Path::new(&h).join("hub")))
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/huggingface/hub")))
}

/// For a missing `path` that reads like a Hub ID (`org/name`, no file extension): what to run to
/// download it and where to point, naming the snapshot when `hub` (the hub's cache,
/// [`hub_cache`]) already has one. `None` for anything else.
pub fn hub_id_hint(path: &Path, hub: Option<&Path>) -> Option<String> {
    let text = path.to_str()?;
    let (org, name) = text.split_once('/')?;
    let word = |w: &str| {
        !w.is_empty()
            && !w.starts_with('.')
            && w.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    let file = [".gguf", ".safetensors", ".json", ".bin"]
        .iter()
        .any(|ext| name.ends_with(ext));
    if !word(org) || !word(name) || file {
        return None;
    }
    let snapshots = hub?
        .join(format!("models--{org}--{name}"))
        .join("snapshots");
    let cached = std::fs::read_dir(snapshots)
        .ok()
        .and_then(|mut d| d.find_map(|e| e.ok()))
        .map(|snap| snap.path());
    Some(match cached {
        Some(snap) => format!(
            "'{text}' looks like a Hugging Face Hub ID, and the hub's cache holds it: pass '{}'",
            snap.display()
        ),
        None => format!(
            "'{text}' looks like a Hugging Face Hub ID, and weightlift reads local files only: \
             download it first with `huggingface-cli download {text} --local-dir {name}` and \
             pass '{name}'"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_get_a_download_hint_or_their_cached_snapshot() {
        let hub_dir = folder(&[]);
        let hub = hub_dir.path();
        let e = hub_id_hint(Path::new("org/tiny-model"), Some(hub)).unwrap();
        assert!(
            e.contains("huggingface-cli download org/tiny-model --local-dir tiny-model"),
            "{e}"
        );
        let snap = hub.join("models--org--tiny-model/snapshots/abc123");
        std::fs::create_dir_all(&snap).unwrap();
        let e = hub_id_hint(Path::new("org/tiny-model"), Some(hub)).unwrap();
        assert!(
            e.contains("the hub's cache holds it") && e.contains(&*snap.to_string_lossy()),
            "{e}"
        );
        for not_an_id in ["org/model.gguf", "a/b/c", "model", "./x", "/abs/path"] {
            assert_eq!(
                hub_id_hint(Path::new(not_an_id), Some(hub)),
                None,
                "{not_an_id}"
            );
        }
    }

    /// A fresh temporary folder holding `files`, removed when the guard drops.
    fn folder(files: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::Builder::new()
            .prefix("wl-hf-config-")
            .tempdir()
            .unwrap();
        for f in files {
            std::fs::write(dir.path().join(f), "{}").unwrap();
        }
        dir
    }

    #[test]
    fn config_only_paths() {
        let only_dir = folder(&["config.json", "tokenizer.json"]);
        let only = only_dir.path();
        assert_eq!(config_only(only), Some(only.join("config.json")));
        assert_eq!(
            config_only(&only.join("tokenizer.json")),
            Some(only.join("tokenizer.json"))
        );
        for weights in [
            "model.safetensors",
            "m.gguf",
            "model.safetensors.index.json",
        ] {
            let dir = folder(&["config.json", weights]);
            let dir = dir.path();
            assert_eq!(config_only(dir), None, "{weights}");
            assert_eq!(config_only(&dir.join(weights)), None, "{weights}");
        }
        assert_eq!(config_only(folder(&[]).path()), None);
        assert_eq!(config_only(&only.join("missing.json")), None);
    }

    #[test]
    fn reads_objects_only() {
        let dir = folder(&[]);
        let path = dir.path().join("config.json");
        std::fs::write(&path, r#"{"torch_dtype": "bfloat16"}"#).unwrap();
        assert_eq!(stored_dtype(&read(&path).unwrap()), Some("bfloat16"));
        std::fs::write(&path, "[1]").unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("expected a json object, got an array"), "{e}");
        std::fs::write(&path, "{").unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("a parse error"), "{e}");
        let v = serde_json::json!({"dtype": "float16"});
        assert_eq!(stored_dtype(&v), Some("float16"));
        assert_eq!(stored_dtype(&serde_json::json!({})), None);
    }
}

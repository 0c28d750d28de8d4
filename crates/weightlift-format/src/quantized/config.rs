//! The quantisation settings of a safetensors checkpoint, read from `config.json`'s
//! `quantization_config` or from the `quantize_config.json` that auto-gptq writes beside it.
//!
//! GPTQ keys follow transformers' `GPTQConfig` and gptqmodel's `QuantizeConfig` (`bits`,
//! `group_size`, `desc_act`, `sym`, and the layout in `checkpoint_format` or `format`); EXL2
//! keys are the ones exllamav2's converter writes (`quant_method: "exl2"`, `version`, `bits`,
//! `head_bits`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{FormatError, Result};

/// GPTQ widths whose packing weightlift reads: codes are a little-endian bit stream in int32
/// words (3-bit codes straddle words), as auto-gptq and gptqmodel pack them.
pub const GPTQ_BITS: [u32; 4] = [2, 3, 4, 8];

/// How a GPTQ checkpoint stores its zero points.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GptqFormat {
    /// `"gptq"`: the stored zero is the zero point minus 1, wrapped to the code width (what
    /// auto-gptq writes; gptqmodel adds the 1 back when it loads one).
    V1,
    /// `"gptq_v2"`: the stored zero is the zero point.
    V2,
}

impl GptqFormat {
    pub const fn name(self) -> &'static str {
        match self {
            GptqFormat::V1 => "gptq",
            GptqFormat::V2 => "gptq_v2",
        }
    }
}

/// The GPTQ settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GptqConfig {
    /// Code width: 2, 3, 4 or 8.
    pub bits: u32,
    /// Inputs per group; `None` for `group_size: -1` (one group over all inputs).
    pub group_size: Option<u32>,
    /// Act-order: inputs were quantised in a permuted order, so `g_idx` is not `i / group_size`.
    pub desc_act: bool,
    pub sym: bool,
    pub format: GptqFormat,
    /// gptqmodel's `lm_head`: the output projection is quantised too.
    pub lm_head: bool,
}

/// The EXL2 settings: informational, since every EXL2 linear carries its own bit widths.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Exl2Config {
    /// Target average bits per weight.
    pub bits: Option<f64>,
    /// Bits of the output projection.
    pub head_bits: Option<u32>,
    /// The exllamav2 version that converted the model.
    pub version: Option<String>,
}

/// A quantisation scheme weightlift reads, with its settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "method", rename_all = "snake_case")]
pub enum QuantConfig {
    Gptq(GptqConfig),
    Exl2(Exl2Config),
}

/// What the config files say: a scheme weightlift reads, one it does not, or none.
pub(crate) enum Found {
    None,
    Known {
        config: QuantConfig,
        /// The file the settings came from.
        source: PathBuf,
    },
    /// A `quant_method` weightlift does not read (awq, bitsandbytes, fp8, ...).
    Other(String),
}

/// The names auto-gptq and gptqmodel give the settings file beside `config.json`.
pub(crate) const BESIDE_NAMES: [&str; 2] = ["quantize_config.json", "quant_config.json"];

fn invalid(path: &Path, key: &str, expected: &str, got: String) -> FormatError {
    FormatError::Invalid {
        path: path.to_path_buf(),
        what: format!("quantisation setting '{key}'"),
        expected: expected.to_owned(),
        got,
        hint: "the quantisation config is corrupted or was written by a tool this build does not know",
    }
}

fn unsupported(path: &Path, what: String, detail: String) -> FormatError {
    FormatError::Unsupported {
        path: path.to_path_buf(),
        what,
        detail,
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
        other => other.to_string(),
    }
}

struct Keys<'a> {
    path: &'a Path,
    map: &'a Map<String, Value>,
}

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn int(&self, key: &str) -> Result<Option<i64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| invalid(self.path, key, "an integer", describe(v))),
        }
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| invalid(self.path, key, "true or false", describe(v))),
        }
    }

    fn string(&self, key: &str) -> Result<Option<String>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.trim().to_ascii_lowercase()))
                .ok_or_else(|| invalid(self.path, key, "a string", describe(v))),
        }
    }
}

/// Work out the scheme from `config.json`'s `quantization_config` and the settings file beside
/// it (`beside`: its path and parsed JSON). When both exist they must agree.
pub(crate) fn find(
    config: Option<(&Path, &Value)>,
    beside: Option<(&Path, &Value)>,
) -> Result<Found> {
    let from_config = config.and_then(|(p, c)| Some((p, c.get("quantization_config")?)));
    let primary = match (from_config, beside) {
        (Some(a), _) => a,
        (None, Some(b)) => b,
        (None, None) => return Ok(Found::None),
    };
    let found = parse(primary.0, primary.1)?;
    if let (Some(a), Some(b)) = (from_config, beside) {
        let other = parse(b.0, b.1)?;
        if let (Found::Known { config: x, .. }, Found::Known { config: y, .. }) = (&found, &other)
            && x != y
        {
            return Err(FormatError::Invalid {
                path: b.0.to_path_buf(),
                what: "quantisation settings".into(),
                expected: format!(
                    "the settings of {}'s quantization_config ({x:?})",
                    a.0.display()
                ),
                got: format!("{y:?}"),
                hint: "two conversions left their settings in one folder; keep the file that matches the weights",
            });
        }
    }
    Ok(found)
}

fn parse(path: &Path, v: &Value) -> Result<Found> {
    let Some(map) = v.as_object() else {
        return Err(invalid(
            path,
            "quantization_config",
            "a json object",
            describe(v),
        ));
    };
    let keys = Keys { path, map };
    // auto-gptq's files from before `quant_method` existed hold only GPTQ keys.
    let method = keys
        .string("quant_method")?
        .unwrap_or_else(|| "gptq".into());
    let config = match method.as_str() {
        "gptq" => QuantConfig::Gptq(gptq(&keys)?),
        "exl2" => QuantConfig::Exl2(exl2(&keys)?),
        _ => return Ok(Found::Other(method)),
    };
    Ok(Found::Known {
        config,
        source: path.to_path_buf(),
    })
}

fn gptq(keys: &Keys<'_>) -> Result<GptqConfig> {
    let path = keys.path;
    let Some(bits) = keys.int("bits")? else {
        return Err(invalid(
            path,
            "bits",
            "the GPTQ code width",
            "no such key".into(),
        ));
    };
    let bits = match u32::try_from(bits) {
        Ok(b) if GPTQ_BITS.contains(&b) => b,
        _ => {
            let detail = if (5..=7).contains(&bits) {
                "gptqmodel writes 5-, 6- and 7-bit GPTQ only in its planar gptq_p layout, which weightlift does not read; supported widths are 2, 3, 4 and 8"
            } else {
                "supported GPTQ widths are 2, 3, 4 and 8"
            };
            return Err(unsupported(
                path,
                format!("GPTQ bits {bits}"),
                detail.into(),
            ));
        }
    };
    // transformers' and auto-gptq's default.
    let group_size = match keys.int("group_size")?.unwrap_or(128) {
        -1 => None,
        g if g > 0 => Some(u32::try_from(g).map_err(|_| {
            invalid(
                path,
                "group_size",
                "-1 or a group size below 2^32",
                g.to_string(),
            )
        })?),
        g => {
            return Err(invalid(
                path,
                "group_size",
                "-1 or a positive group size",
                g.to_string(),
            ));
        }
    };
    let checkpoint_format = keys.string("checkpoint_format")?;
    let format_key = keys.string("format")?;
    let format = match (checkpoint_format, format_key) {
        (Some(a), Some(b)) if a != b => {
            return Err(invalid(
                path,
                "format",
                &format!("the same layout as checkpoint_format ({a:?})"),
                format!("{b:?}"),
            ));
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => "gptq".into(),
    };
    let format = match format.as_str() {
        "gptq" => GptqFormat::V1,
        "gptq_v2" => GptqFormat::V2,
        other => {
            return Err(unsupported(
                path,
                format!("GPTQ checkpoint_format '{other}'"),
                "weightlift reads the gptq (v1) and gptq_v2 layouts; convert the checkpoint to one of them with gptqmodel".into(),
            ));
        }
    };
    if keys.boolean("is_marlin_format")? == Some(true) {
        return Err(unsupported(
            path,
            "GPTQ is_marlin_format".into(),
            "marlin-repacked weights are not read; use the checkpoint saved before repacking"
                .into(),
        ));
    }
    if let Some(p) = keys.string("pack_dtype")?
        && p != "int32"
    {
        return Err(unsupported(
            path,
            format!("GPTQ pack_dtype '{p}'"),
            "weightlift reads codes packed in int32 words, the layout every published GPTQ checkpoint uses".into(),
        ));
    }
    if keys
        .get("dynamic")
        .is_some_and(|d| d.as_object().is_none_or(|m| !m.is_empty()))
    {
        return Err(unsupported(
            path,
            "GPTQ 'dynamic' per-module settings".into(),
            "modules with their own bits or group size are not read yet".into(),
        ));
    }
    Ok(GptqConfig {
        bits,
        group_size,
        desc_act: keys.boolean("desc_act")?.unwrap_or(false),
        sym: keys.boolean("sym")?.unwrap_or(true),
        format,
        lm_head: keys.boolean("lm_head")?.unwrap_or(false),
    })
}

fn exl2(keys: &Keys<'_>) -> Result<Exl2Config> {
    let bits = match keys.get("bits") {
        None => None,
        Some(v) => Some(
            v.as_f64()
                .ok_or_else(|| invalid(keys.path, "bits", "a number", describe(v)))?,
        ),
    };
    let head_bits = match keys.int("head_bits")? {
        None => None,
        Some(b) => Some(u32::try_from(b).map_err(|_| {
            invalid(
                keys.path,
                "head_bits",
                "a non-negative integer",
                b.to_string(),
            )
        })?),
    };
    let version = match keys.get("version") {
        Some(Value::String(s)) => Some(s.clone()),
        _ => None,
    };
    Ok(Exl2Config {
        bits,
        head_bits,
        version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gptq_of(v: Value) -> Result<GptqConfig> {
        match parse(Path::new("config.json"), &v)? {
            Found::Known {
                config: QuantConfig::Gptq(g),
                ..
            } => Ok(g),
            _ => panic!("not gptq"),
        }
    }

    #[test]
    fn gptq_defaults_and_formats() {
        let g = gptq_of(json!({"bits": 4})).unwrap();
        assert_eq!(g.group_size, Some(128));
        assert_eq!(g.format, GptqFormat::V1);
        assert!(g.sym && !g.desc_act);
        let g = gptq_of(
            json!({"quant_method": "GPTQ", "bits": 8, "group_size": -1, "format": "GPTQ_V2"}),
        )
        .unwrap();
        assert_eq!((g.bits, g.group_size, g.format), (8, None, GptqFormat::V2));
        let g = gptq_of(json!({"bits": 3, "checkpoint_format": "gptq_v2", "format": "gptq_v2"}))
            .unwrap();
        assert_eq!(g.format, GptqFormat::V2);
    }

    #[test]
    fn gptq_refusals_name_the_setting() {
        let e = gptq_of(json!({"bits": 5})).unwrap_err().to_string();
        assert!(
            e.contains("GPTQ bits 5 is not supported") && e.contains("gptq_p"),
            "{e}"
        );
        let e = gptq_of(json!({"bits": 16})).unwrap_err().to_string();
        assert!(e.contains("GPTQ bits 16 is not supported"), "{e}");
        let e = gptq_of(json!({"bits": "4"})).unwrap_err().to_string();
        assert!(
            e.contains("'bits'") && e.contains("expected an integer"),
            "{e}"
        );
        let e = gptq_of(json!({"bits": 4, "group_size": 0}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'group_size'") && e.contains("got 0"), "{e}");
        let e = gptq_of(json!({"bits": 4, "checkpoint_format": "marlin"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("checkpoint_format 'marlin'"), "{e}");
        let e = gptq_of(json!({"bits": 4, "checkpoint_format": "gptq", "format": "gptq_v2"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'format'") && e.contains("\"gptq_v2\""), "{e}");
        let e = gptq_of(json!({"bits": 4, "pack_dtype": "int16"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("pack_dtype 'int16'"), "{e}");
        let e = gptq_of(json!({"bits": 4, "dynamic": {"-:.*down": {}}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'dynamic'"), "{e}");
        assert!(gptq_of(json!({"bits": 4, "dynamic": {}})).is_ok());
    }

    #[test]
    fn other_methods_and_disagreement() {
        let p = Path::new("config.json");
        assert!(matches!(
            parse(p, &json!({"quant_method": "awq", "bits": 4})).unwrap(),
            Found::Other(m) if m == "awq"
        ));
        let cfg = json!({"quantization_config": {"quant_method": "gptq", "bits": 4}});
        let beside = json!({"bits": 8});
        let e = find(
            Some((p, &cfg)),
            Some((Path::new("quantize_config.json"), &beside)),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("quantize_config.json: quantisation settings"),
            "{e}"
        );
        let same = json!({"bits": 4, "group_size": 128});
        assert!(matches!(
            find(Some((p, &cfg)), Some((Path::new("q.json"), &same))).unwrap(),
            Found::Known { source, .. } if source == p
        ));
    }
}

//! The keyword grammar: the keywords of `plan()`, `fit()` and the loads as users write them (a
//! Python call's keyword arguments, a JSON request, a config file), read into the planner's
//! option types here, once, for every caller.
//!
//! A call's keywords are a [`Keywords`] map of name → JSON-like value, deserialised from any
//! serde data model. Maps may be keyed by ints (a Python dict keyed by accelerator index); such
//! a key reads as its decimal text. Each keyword is read as its type through [`FromKeyword`]:
//!
//! - a size: an int of bytes ≥ 0, or a string [`parse_size`] reads (`"512MiB"`, `"8GB"`);
//! - sizes per device ([`PerDevice`]; `reserve`, `max_memory`, `overhead`, `reserve_vram`): one
//!   size, a list in accelerator order, or a map keyed by device name or accelerator index;
//! - `device_map` ([`DeviceMapArg`]): a preset or device name, or a map of module or layer
//!   prefix → device name or accelerator index;
//! - `overrides`: llama.cpp `-ot` rules, `"REGEX=DEVICE,..."`, a list of such strings, or a map
//!   regex → device;
//! - `devices` ([`DevicesArg`]): a device spec string or a list of them;
//! - `cache` ([`CacheSpec`]): a map of its fields, `max_seq_len` required, `batch_size` 1,
//!   `dtype` fp16 and `offload` false when not given;
//! - `runtime` ([`RuntimeSpec`]): a map of its fields, the rest at their defaults;
//! - `offload` (`"sequential"` or `"group"`) with `blocks_per_group` (1) and `prefetch` (true);
//! - `plan` ([`Plan`]): a plan's JSON.
//!
//! A keyword absent or null is not given. A value of the wrong kind is a
//! [`PlanError::KeywordType`] or [`PlanError::UnknownField`] (Python raises `TypeError` for
//! them); a value of the right kind that the grammar refuses is any other [`PlanError`].

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use crate::error::{PlanError, Result};
use crate::memory::{CacheDType, CacheSpec, RuntimeSpec};
use crate::onload::WeightOffload;
use crate::options::{DeviceMapArg, PerDevice, PlanOptions};
use crate::plan::Plan;
use crate::request::{DeviceMap, FitTarget};
use crate::size::parse_size;

/// The keywords of one call, by name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Keywords {
    values: Map<String, Value>,
    /// Keywords whose value no grammar reads (an object of the caller's language, such as a
    /// Python callback), by the name of its type.
    foreign: BTreeMap<String, String>,
}

/// A type that a keyword's value is read as, by the grammar in the module docs.
pub trait FromKeyword: Sized {
    /// `value` read as this type; `key` names it in errors (a field as `runtime.low_mem`).
    fn from_keyword(value: &Value, key: &str) -> Result<Self>;
}

impl Keywords {
    /// Keyword `key` set to `value`.
    pub fn insert(&mut self, key: impl Into<String>, value: Value) {
        self.values.insert(key.into(), value);
    }

    /// Keyword `key` set to an object no grammar reads, of type `type_name`: a caller takes it
    /// itself, and reading it as a keyword is refused by that name.
    pub fn insert_foreign(&mut self, key: impl Into<String>, type_name: impl Into<String>) {
        self.foreign.insert(key.into(), type_name.into());
    }

    /// The keywords of a JSON object.
    pub fn from_json(value: Value) -> Result<Keywords> {
        match value {
            Value::Object(values) => Ok(Keywords {
                values,
                ..Keywords::default()
            }),
            other => Err(type_error(
                "keywords",
                "an object of keyword → value",
                &other,
            )),
        }
    }

    /// Keyword `key` read as `T`; `None` when absent or null.
    pub fn get<T: FromKeyword>(&self, key: &str) -> Result<Option<T>> {
        self.read(key, T::from_keyword)
    }

    /// Keyword `key` read by `grammar`; `None` when absent or null.
    fn read<T>(&self, key: &str, grammar: fn(&Value, &str) -> Result<T>) -> Result<Option<T>> {
        if let Some(type_name) = self.foreign.get(key) {
            let expected = grammar(&Value::Null, key).err().and_then(|e| match e {
                PlanError::KeywordType { expected, .. } => Some(expected),
                _ => None,
            });
            return Err(PlanError::KeywordType {
                keyword: key.to_owned(),
                expected: expected.unwrap_or_else(|| "plain data".into()),
                got: type_name.clone(),
            });
        }
        match self.values.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => grammar(v, key).map(Some),
        }
    }

    /// `devices`: a device spec, a list's parts joined with commas.
    pub fn devices(&self) -> Result<Option<String>> {
        Ok(self.get::<DevicesArg>("devices")?.map(|d| d.0))
    }

    /// `offload` with `blocks_per_group` and `prefetch`, as the planner reads them.
    pub fn offload(&self) -> Result<Option<WeightOffload>> {
        let Some(mode) = self.get::<String>("offload")? else {
            return Ok(None);
        };
        let blocks = self.get("blocks_per_group")?.unwrap_or(1);
        let prefetch = self.get("prefetch")?.unwrap_or(true);
        WeightOffload::parse(Some(&mode), blocks, prefetch)
    }

    /// The placement keywords of `plan()` and `fit()` as the planner's options.
    pub fn plan_options(&self) -> Result<PlanOptions> {
        Ok(PlanOptions {
            cache: self.get("cache")?,
            use_mmap: self.get("use_mmap")?,
            ..self.load_plan_options()?
        })
    }

    /// `Model.load()`'s placement keywords: `plan()`'s but `cache` and `use_mmap`, which say
    /// there what the load holds and how it reads.
    pub fn load_plan_options(&self) -> Result<PlanOptions> {
        Ok(PlanOptions {
            strategy: self.get("strategy")?,
            dtype: self.get("dtype")?,
            weight_dtype: self.get("weight_dtype")?,
            cache_offload: self.get("cache_offload")?.unwrap_or_default(),
            runtime: self.get("runtime")?,
            reserve: self.get("reserve")?,
            max_memory: self.get("max_memory")?,
            overhead: self.get("overhead")?,
            n_gpu_layers: self.get("n_gpu_layers")?,
            n_cpu_moe: self.get("n_cpu_moe")?,
            split_mode: self.get("split_mode")?,
            tensor_split: self.get("tensor_split")?,
            main_gpu: self.get("main_gpu")?,
            device_map: self.get("device_map")?,
            overrides: self.read("overrides", overrides)?.unwrap_or_default(),
            gpu_split: self.get("gpu_split")?,
            allow_disk: self.get("allow_disk")?,
            quantize: self.get("quantize")?,
            offload: self.offload()?,
            world: self.get("world")?,
            ..PlanOptions::default()
        })
    }

    /// `fit()`'s `target` (`max_seq_len` when not given) and options, with `cache_dtype`.
    pub fn fit_options(&self) -> Result<(FitTarget, PlanOptions)> {
        let target = self.get::<String>("target")?;
        let target = FitTarget::parse(target.as_deref().unwrap_or("max_seq_len"))?;
        let cache_dtype = self.get::<String>("cache_dtype")?;
        let options = self.plan_options()?;
        Ok((target, options.for_fit(target, cache_dtype.as_deref())?))
    }

    /// exllamav2's `load_autosplit`: `reserve_vram`, and `offload`.
    pub fn autosplit_options(&self) -> Result<PlanOptions> {
        Ok(PlanOptions {
            offload: self.offload()?,
            ..PlanOptions::autosplit(self.get("reserve_vram")?)
        })
    }

    /// exllamav2's `load_tp`: `gpu_split`, `expect_cache_tokens` (0), `expect_cache_base`, and a
    /// multi-process run's `world` and `rank`.
    pub fn tensor_parallel_options(&self) -> Result<PlanOptions> {
        Ok(PlanOptions {
            world: self.get("world")?,
            rank: self.get("rank")?,
            ..PlanOptions::tensor_parallel(
                self.get("gpu_split")?,
                self.get("expect_cache_tokens")?.unwrap_or(0),
                self.get("expect_cache_base")?,
            )
        })
    }

    /// transformers' `from_pretrained`: `device_map` (`"auto"`), `max_memory`, and `offload`.
    pub fn pretrained_options(&self) -> Result<PlanOptions> {
        Ok(PlanOptions {
            offload: self.offload()?,
            ..PlanOptions::from_pretrained(self.get("device_map")?, self.get("max_memory")?)
        })
    }
}

/// The refusal of `got` where `expected` was wanted.
pub fn type_error(key: &str, expected: &str, got: &Value) -> PlanError {
    let got = match got {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_u64() => "int",
        Value::Number(n) if n.is_i64() => "negative int",
        Value::Number(_) => "float",
        Value::String(_) => "str",
        Value::Array(_) => "list",
        Value::Object(_) => "dict",
    };
    PlanError::KeywordType {
        keyword: key.to_owned(),
        expected: expected.to_owned(),
        got: got.to_owned(),
    }
}

impl FromKeyword for bool {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        v.as_bool()
            .ok_or_else(|| type_error(key, "True or False", v))
    }
}

impl FromKeyword for String {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        let s = v.as_str().ok_or_else(|| type_error(key, "a string", v))?;
        Ok(s.to_owned())
    }
}

impl FromKeyword for f64 {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        v.as_f64().ok_or_else(|| type_error(key, "a number", v))
    }
}

impl FromKeyword for f32 {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        f64::from_keyword(v, key).map(|x| x as f32)
    }
}

impl FromKeyword for i64 {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        match v {
            Value::Number(n) if n.is_u64() => i64::try_from(n.as_u64().unwrap_or(u64::MAX))
                .map_err(|_| PlanError::option(key, "an int that fits 64 bits", n)),
            _ => v.as_i64().ok_or_else(|| type_error(key, "an int", v)),
        }
    }
}

/// Unsigned ints: a negative or too large one is a value refused, not a type.
macro_rules! unsigned_keyword {
    ($($t:ty),*) => {$(
        impl FromKeyword for $t {
            fn from_keyword(v: &Value, key: &str) -> Result<Self> {
                let n = match v {
                    Value::Number(n) if n.is_u64() || n.is_i64() => n,
                    _ => return Err(type_error(key, "an int ≥ 0", v)),
                };
                n.as_u64()
                    .and_then(|x| <$t>::try_from(x).ok())
                    .ok_or_else(|| PlanError::option(key, &format!("an int from 0 to {}", <$t>::MAX), n))
            }
        }
    )*};
}
unsigned_keyword!(u32, u64, usize);

impl<T: FromKeyword> FromKeyword for Vec<T> {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        let items = v.as_array().ok_or_else(|| type_error(key, "a list", v))?;
        items
            .iter()
            .enumerate()
            .map(|(i, x)| T::from_keyword(x, &format!("{key}[{i}]")))
            .collect()
    }
}

impl FromKeyword for CacheDType {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        let name = v
            .as_str()
            .ok_or_else(|| type_error(key, "a cache dtype name such as \"fp16\" or \"q8\"", v))?;
        CacheDType::parse(name)
    }
}

/// A size: an int of bytes ≥ 0, or a string such as `"512MiB"`.
fn size(v: &Value, key: &str) -> Result<u64> {
    match v {
        Value::Number(n) if n.is_u64() => Ok(n.as_u64().unwrap_or_default()),
        Value::String(s) => parse_size(s).map_err(|e| PlanError::Keyword {
            keyword: key.to_owned(),
            source: Box::new(e),
        }),
        _ => Err(type_error(
            key,
            "a size: an int of bytes (≥ 0) or a string such as \"512MiB\"",
            v,
        )),
    }
}

/// A device as users name it: a name (`"cuda:1"`, `"cpu"`) or an accelerator index (`0`).
fn device_key(v: &Value, key: &str) -> Result<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) if n.is_u64() => Ok(n.to_string()),
        _ => Err(type_error(
            key,
            "a device name such as \"cuda:0\" or an accelerator index",
            v,
        )),
    }
}

impl FromKeyword for PerDevice {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        match v {
            Value::Array(items) => Ok(PerDevice::List(
                items.iter().map(|x| size(x, key)).collect::<Result<_>>()?,
            )),
            Value::Object(m) => Ok(PerDevice::Map(
                m.iter()
                    .map(|(k, x)| Ok((k.clone(), size(x, key)?)))
                    .collect::<Result<_>>()?,
            )),
            _ => size(v, key).map(PerDevice::All),
        }
    }
}

impl FromKeyword for DeviceMapArg {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        match v {
            Value::String(s) => Ok(DeviceMapArg::Named(s.clone())),
            Value::Object(m) => Ok(DeviceMapArg::Entries(
                m.iter()
                    .map(|(k, d)| Ok((k.clone(), device_key(d, key)?)))
                    .collect::<Result<_>>()?,
            )),
            _ => Err(type_error(
                key,
                "'auto', 'balanced', 'balanced_low_0', 'sequential', a device name, or a dict of \
                 module or layer prefix -> device",
                v,
            )),
        }
    }
}

/// llama.cpp `-ot` rules: `"REGEX=DEVICE,..."`, a list of such strings, or a map regex → device.
fn overrides(v: &Value, key: &str) -> Result<Vec<(String, String)>> {
    let expected = "\"REGEX=DEVICE\" rules: a string, a list or a dict";
    match v {
        Value::String(s) => DeviceMap::parse_overrides(s),
        Value::Object(m) => m
            .iter()
            .map(|(k, d)| Ok((k.clone(), device_key(d, key)?)))
            .collect(),
        Value::Array(rules) => {
            let mut out = Vec::new();
            for rule in rules {
                let rule = rule
                    .as_str()
                    .ok_or_else(|| type_error(key, expected, rule))?;
                out.extend(DeviceMap::parse_overrides(rule)?);
            }
            Ok(out)
        }
        _ => Err(type_error(key, expected, v)),
    }
}

/// A device spec (`"virtual:2x8GiB,cpu"`), given as one string or a list of its parts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DevicesArg(pub String);

impl FromKeyword for DevicesArg {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        let expected = "a device spec such as \"virtual:2x8GiB,cpu\" or a list of such strings";
        let parts = match v {
            Value::String(s) => return Ok(DevicesArg(s.clone())),
            Value::Array(parts) => parts,
            _ => return Err(type_error(key, expected, v)),
        };
        let parts: Vec<&str> = parts
            .iter()
            .map(|p| p.as_str().ok_or_else(|| type_error(key, expected, p)))
            .collect::<Result<_>>()?;
        Ok(DevicesArg(parts.join(",")))
    }
}

/// The fields of a map keyword, each known; `expected` says what the keyword takes.
fn fields<'a>(
    v: &'a Value,
    key: &str,
    known: &[&str],
    expected: &str,
) -> Result<&'a Map<String, Value>> {
    let m = v.as_object().ok_or_else(|| type_error(key, expected, v))?;
    if let Some(field) = m.keys().find(|f| !known.contains(&f.as_str())) {
        return Err(PlanError::UnknownField {
            keyword: key.to_owned(),
            field: field.clone(),
            known: known.join(", "),
        });
    }
    Ok(m)
}

/// Field `name` of a map keyword's fields `m`; `None` when absent or null.
fn field<T: FromKeyword>(m: &Map<String, Value>, key: &str, name: &str) -> Result<Option<T>> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => T::from_keyword(v, &format!("{key}.{name}")).map(Some),
    }
}

impl FromKeyword for CacheSpec {
    /// `CacheSpec(max_seq_len, batch_size=1, dtype="fp16", offload=False)` as a map.
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        let known = ["max_seq_len", "batch_size", "dtype", "offload"];
        let m = fields(v, key, &known, "a CacheSpec or a dict of its fields")?;
        let Some(max_seq_len) = field(m, key, "max_seq_len")? else {
            return Err(PlanError::KeywordType {
                keyword: key.to_owned(),
                expected: "the cache's 'max_seq_len' (its tokens per sequence)".into(),
                got: "none".into(),
            });
        };
        let dtype = field(m, key, "dtype")?.unwrap_or_default();
        let spec = CacheSpec::new(
            max_seq_len,
            field(m, key, "batch_size")?.unwrap_or(1),
            dtype,
        )
        .with_offload(field(m, key, "offload")?.unwrap_or_default());
        spec.check()?;
        Ok(spec)
    }
}

impl FromKeyword for RuntimeSpec {
    /// Some of the runtime limits as a map; the rest keep their defaults.
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        let known = [
            "max_input_len",
            "max_attention_size",
            "max_dq_size",
            "low_mem",
        ];
        let m = fields(v, key, &known, "a RuntimeSpec or a dict of its fields")?;
        let d = RuntimeSpec::default();
        Ok(RuntimeSpec {
            max_input_len: field(m, key, known[0])?.unwrap_or(d.max_input_len),
            max_attention_size: field(m, key, known[1])?.unwrap_or(d.max_attention_size),
            max_dq_size: field(m, key, known[2])?.unwrap_or(d.max_dq_size),
            low_mem: field(m, key, known[3])?.unwrap_or(d.low_mem),
        })
    }
}

/// A JSON-like value from any serde data model: what [`Keywords`] holds. A map key that is a
/// number or a bool reads as its text. A NaN or an infinity fails with [`NON_FINITE`] and the
/// value: JSON has no such number, and the null it would become reads as an absent keyword.
pub fn json_value<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Value, D::Error> {
    d.deserialize_any(JsonVisitor)
}

/// How [`json_value`]'s error for a NaN or an infinity begins; the value follows.
pub const NON_FINITE: &str = "a number that is not finite: ";

/// Keyword `key`'s refusal when [`json_value`] failed on it with `message`, if that failure was
/// a NaN or an infinity somewhere in its value; None for any other failure (a value that is not
/// plain data, which the grammar refuses by its type).
pub fn non_finite_refusal(key: &str, message: &str) -> Option<PlanError> {
    let got = message.strip_prefix(NON_FINITE)?;
    Some(PlanError::option(key, "finite numbers", got))
}

struct Json(Value);

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        json_value(d).map(Json)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("plain data: null, a bool, a number, a string, a list or a map")
    }
    fn visit_bool<E>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom(format!("{NON_FINITE}{v}")))
    }
    fn visit_str<E>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(v.into())
    }
    fn visit_none<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_unit<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Value, D::Error> {
        json_value(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Json(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some((Json(k), Json(v))) = map.next_entry()? {
            let key = match k {
                Value::String(s) => s,
                Value::Number(_) | Value::Bool(_) => k.to_string(),
                _ => return Err(de::Error::custom("map keys must be strings or ints")),
            };
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

/// `Deserialize` by the keyword grammar; `what` names the value in errors.
macro_rules! deserialize_by_grammar {
    ($($t:ty => $what:literal),*) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                <$t>::from_keyword(&json_value(d)?, $what).map_err(de::Error::custom)
            }
        }
    )*};
}
deserialize_by_grammar!(PerDevice => "sizes", DeviceMapArg => "device_map", DevicesArg => "devices");

impl FromKeyword for Keywords {
    fn from_keyword(v: &Value, _key: &str) -> Result<Self> {
        Keywords::from_json(v.clone())
    }
}

impl FromKeyword for Plan {
    /// A plan's JSON ([`Plan::to_json`]).
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        let json = v
            .as_str()
            .ok_or_else(|| type_error(key, "a Plan or its JSON", v))?;
        Plan::from_json(json)
    }
}

impl FromKeyword for PlanOptions {
    fn from_keyword(v: &Value, key: &str) -> Result<Self> {
        Keywords::from_keyword(v, key)?.plan_options()
    }
}

deserialize_by_grammar!(Keywords => "keywords", PlanOptions => "keywords");

#[cfg(test)]
mod tests;

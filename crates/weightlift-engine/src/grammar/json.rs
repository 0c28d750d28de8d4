//! A JSON value that keeps its objects' key order, and JSON text written as Python's
//! `json.dumps` writes it, for the schema converter.
//!
//! Order matters to a schema: llama.cpp's converter lays an object's properties out in the order
//! the schema lists them. `serde_json::Value` sorts keys unless its `preserve_order` feature is
//! on, a feature that would reorder every map of the workspace, so schemas are read into this
//! type instead (through serde_json's parser and its nesting limit).

use std::collections::HashMap;
use std::fmt::{self, Write};

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A JSON value whose objects keep their keys in text order. A key given twice keeps its first
/// place and its last value, as Python's `json.loads` does.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Json {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Parses JSON text.
    pub(super) fn parse(text: &str) -> Result<Json, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The value of key `key` of an object; `None` for other values.
    pub(super) fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The JSON type's name, as a schema's `type` keyword spells it (`integer` for numbers
    /// without a fraction, as JSON Schema counts `1.0` an integer).
    pub(super) fn type_name(&self) -> &'static str {
        match self {
            Json::Null => "null",
            Json::Bool(_) => "boolean",
            Json::Int(_) | Json::UInt(_) => "integer",
            Json::Float(f) if f.fract() == 0.0 => "integer",
            Json::Float(_) => "number",
            Json::Str(_) => "string",
            Json::Array(_) => "array",
            Json::Object(_) => "object",
        }
    }

    /// The text Python's `json.dumps(value)` writes with its defaults: `", "` and `": "`
    /// between items, every character past ASCII as a `\uXXXX` escape (`ensure_ascii`), floats
    /// as `repr` writes them. llama.cpp's converter spells `const` and `enum` values this way.
    pub(super) fn python_dumps(&self) -> String {
        let mut out = String::new();
        self.write_python(&mut out);
        out
    }

    fn write_python(&self, out: &mut String) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Int(i) => {
                let _ = write!(out, "{i}");
            }
            Json::UInt(u) => {
                let _ = write!(out, "{u}");
            }
            Json::Float(f) => out.push_str(&python_float(*f)),
            Json::Str(s) => python_string(s, out),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    item.write_python(out);
                }
                out.push(']');
            }
            Json::Object(members) => {
                out.push('{');
                for (i, (k, v)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_string(k, out);
                    out.push_str(": ");
                    v.write_python(out);
                }
                out.push('}');
            }
        }
    }
}

/// A JSON string literal as `json.dumps` writes it: printable ASCII as itself, the rest escaped
/// (lower-case hex).
pub(super) fn python_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// A float as Python's `repr` writes it: the shortest digits that read back to it, in positional
/// notation when the decimal exponent is in [-4, 16), else as `d.ddde+XX`; always with a `.` or
/// an exponent (`1.0`, `1e+16`, `1.5e-05`).
fn python_float(f: f64) -> String {
    // Rust's `{:e}` gives the same shortest digits: `-1.5e-5`.
    let sci = format!("{f:e}");
    let Some((mantissa, exp)) = sci.split_once('e') else {
        return sci;
    };
    let Ok(exp) = exp.parse::<i32>() else {
        return sci;
    };
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        if exp < 0 {
            let zeros = "0".repeat((-exp - 1) as usize);
            return format!("{sign}0.{zeros}{digits}");
        }
        let whole = exp as usize + 1;
        if digits.len() <= whole {
            let zeros = "0".repeat(whole - digits.len());
            return format!("{sign}{digits}{zeros}.0");
        }
        return format!("{sign}{}.{}", &digits[..whole], &digits[whole..]);
    }
    let (first, rest) = digits.split_at(1);
    let dot = if rest.is_empty() { "" } else { "." };
    let exp_sign = if exp < 0 { '-' } else { '+' };
    format!(
        "{sign}{first}{dot}{rest}e{exp_sign}{:02}",
        exp.unsigned_abs()
    )
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Json, E> {
        Ok(Json::Bool(b))
    }

    fn visit_i64<E: de::Error>(self, i: i64) -> Result<Json, E> {
        Ok(Json::Int(i))
    }

    fn visit_u64<E: de::Error>(self, u: u64) -> Result<Json, E> {
        Ok(match i64::try_from(u) {
            Ok(i) => Json::Int(i),
            Err(_) => Json::UInt(u),
        })
    }

    fn visit_f64<E: de::Error>(self, f: f64) -> Result<Json, E> {
        Ok(Json::Float(f))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Json, E> {
        Ok(Json::Str(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Json, E> {
        Ok(Json::Str(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut members: Vec<(String, Json)> = Vec::new();
        let mut at: HashMap<String, usize> = HashMap::new();
        while let Some((key, value)) = map.next_entry::<String, Json>()? {
            match at.get(&key) {
                Some(&i) => members[i].1 = value,
                None => {
                    at.insert(key.clone(), members.len());
                    members.push((key, value));
                }
            }
        }
        Ok(Json::Object(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_keep_their_key_order_and_the_last_of_a_repeated_key() {
        let v = Json::parse(r#"{"b": 1, "a": [true, null], "b": 2}"#).unwrap();
        let Json::Object(members) = &v else {
            panic!("{v:?}")
        };
        let keys: Vec<&str> = members.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["b", "a"]);
        assert_eq!(v.get("b"), Some(&Json::Int(2)));
    }

    #[test]
    fn python_dumps_writes_as_json_dumps() {
        // Each expected text is what CPython 3.11's `json.dumps` prints for the same value.
        let cases = [
            (r#"{"a":1,"b":[1.5,"x"]}"#, r#"{"a": 1, "b": [1.5, "x"]}"#),
            (r#""é\n\"\\ 😀""#, r#""\u00e9\n\"\\ \ud83d\ude00""#),
            ("\"\\u007f\\u0001\"", "\"\\u007f\\u0001\""),
            ("1.0", "1.0"),
            ("-0.0", "-0.0"),
            ("1e16", "1e+16"),
            ("123456789012345.6", "123456789012345.6"),
            ("0.0001", "0.0001"),
            ("0.00001", "1e-05"),
            ("1.5e-7", "1.5e-07"),
            ("2.5e300", "2.5e+300"),
            ("18446744073709551615", "18446744073709551615"),
            ("-9223372036854775808", "-9223372036854775808"),
            ("[]", "[]"),
            ("{}", "{}"),
        ];
        for (text, want) in cases {
            assert_eq!(Json::parse(text).unwrap().python_dumps(), want, "{text}");
        }
    }
}

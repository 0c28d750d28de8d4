//! JSON Schema to GBNF: a grammar for JSON texts that satisfy a schema, as llama.cpp's converter
//! writes one (`json_schema_to_gbnf` in llama-cpp-python 0.3.36's `llama_grammar.py`, which
//! `LlamaGrammar.from_json_schema` and `response_format` schemas use).
//!
//! The layout is llama.cpp's: whitespace between tokens is at most one space (`space ::= " "?`);
//! an object's required properties come first, in the order the schema lists them, then its
//! optional ones in that order; an object with `properties` and no `additionalProperties` takes
//! no other keys; numbers have at most 16 digits in each part; `const` and `enum` values are
//! spelt as Python's `json.dumps` spells them, with no space after; an empty schema (or `true`)
//! matches any object, while a missing `items` matches any value; a tuple (`prefixItems`) is
//! written whole. Within that layout the language is llama.cpp's, except where llama.cpp's
//! grammar lets through text that breaks the schema or is not JSON; there this one is narrower:
//!
//! - strings take no raw control characters (JSON forbids them);
//! - `const` and `enum` strings holding `\` are escaped (llama.cpp's literal is not);
//! - keys taken by `additionalProperties` cannot be the name of a declared property (llama.cpp's
//!   let an optional property come back with any value), and are written without escapes up to
//!   where they part from every declared name;
//! - a `required` name missing from `properties` is written (llama.cpp's leaves it out);
//! - `type` lists keep the schema's other keywords for each type, `enum` values of another
//!   `type` are dropped, `prefixItems` with `items` take both (llama.cpp's drops the prefix), and
//!   `allOf` merges the objects' own `required` lists (llama.cpp's makes every property of a
//!   component required);
//! - `date` is a calendar date from year 0001, February 29 in leap years only (llama.cpp's
//!   takes any day 01 to 31);
//! - in a string with `minLength` or `maxLength`, a character past U+FFFF is written as itself,
//!   not as a pair of `\u` escapes that would count as two.
//!
//! It also enforces integer `minimum`, `maximum`, `exclusiveMinimum` and `exclusiveMaximum`,
//! which llama.cpp's ignores, as digit ranges (with no `-0`), and `minItems`/`maxItems` where
//! `items` is not given.
//!
//! What it cannot enforce it refuses, naming the keyword and its place in the schema
//! ([`GrammarError::SchemaUnsupported`]), rather than ignore it as llama.cpp does: `pattern`,
//! `format`s other than `date`, `time`, `date-time` and `uuid`, bounds and `multipleOf` on
//! `number`, `multipleOf` on integers, `uniqueItems`, `contains`, `not`, `if`, property counts,
//! `patternProperties`, `propertyNames`, dependencies, `unevaluated*`, `$ref`s outside the
//! document, keywords beside `$ref`, `anyOf` or `oneOf`, and `allOf` over anything but objects.
//! Keywords JSON Schema does not define are annotations and are ignored, as validators do.
//! `oneOf` is read as `anyOf`, as llama.cpp reads it: where two alternatives accept the same
//! value, text matching both can come out.
//!
//! Bounds on repetition (`minItems`, `maxItems`, `minLength`, `maxLength`) are at most 2000,
//! llama.cpp's limit on a GBNF repetition; a schema nested more than 128 levels deep is refused.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write;

use super::error::GrammarError;
use super::json::{Json, python_string};

/// How deep schemas may nest (the converter recurses once per level).
const MAX_DEPTH: usize = 128;
/// llama.cpp's `MAX_REPETITION_THRESHOLD`: the largest count a GBNF repetition may give.
const MAX_COUNT: u64 = 2000;
/// The largest integer the `integer` rule spells: 16 digits, llama.cpp's `integral-part`.
const INT_LIMIT: i64 = 9_999_999_999_999_999;

/// Rule names the converter gives its fixed rules; names taken from the schema that equal one
/// get a `-` appended, as llama.cpp's converter does.
const RESERVED: &[&str] = &[
    "root",
    "space",
    "char",
    "bounded-char",
    "string",
    "value",
    "object",
    "array",
    "number",
    "integer",
    "boolean",
    "null",
    "integral-part",
    "decimal-part",
    "uuid",
    "date",
    "time",
    "date-time",
    "date-string",
    "time-string",
    "date-time-string",
];

/// The keywords JSON Schema gives each type: ignored when the schema's `type` leaves that type
/// out, as validators ignore them.
const OBJECT_WORDS: &[&str] = &[
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
];
const ARRAY_WORDS: &[&str] = &[
    "items",
    "prefixItems",
    "additionalItems",
    "minItems",
    "maxItems",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "unevaluatedItems",
];
const STRING_WORDS: &[&str] = &["minLength", "maxLength", "pattern", "format"];
const NUMBER_WORDS: &[&str] = &[
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
];
/// The keywords that apply to every type.
const ANY_WORDS: &[&str] = &[
    "type",
    "enum",
    "const",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "$ref",
    "$dynamicRef",
    "$recursiveRef",
];

const TYPES: &[&str] = &[
    "object", "array", "string", "number", "integer", "boolean", "null",
];

/// The GBNF grammar (root rule `root`) for the JSON texts `schema` (JSON text) accepts, as
/// described in the module docs. Properties are laid out in the order the text lists them.
pub fn json_schema_to_gbnf(schema: &str) -> Result<String, GrammarError> {
    let schema = Json::parse(schema).map_err(|e| GrammarError::SchemaInvalid {
        path: "#".into(),
        expected: "JSON text".into(),
        got: e.to_string(),
    })?;
    convert(&schema)
}

/// [`json_schema_to_gbnf`] of a parsed schema.
pub(super) fn convert(schema: &Json) -> Result<String, GrammarError> {
    let mut c = Converter {
        root: schema,
        rules: Vec::new(),
        names: HashMap::new(),
        suffixes: HashMap::new(),
        refs: HashMap::new(),
        pending: HashSet::new(),
        prims: HashMap::new(),
    };
    // `root` first; the top schema's own rule defines it.
    let root = c.reserve("root");
    c.pending.insert(root.clone());
    let top = c.visit(schema, "#", "", 0)?;
    if c.pending.remove(&root) {
        c.define(&root, top);
    }
    let mut out = String::new();
    for (name, body) in &c.rules {
        let _ = writeln!(out, "{name} ::= {}", body.as_deref().unwrap_or(""));
    }
    Ok(out)
}

/// The fixed rules, each made once and on first use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Prim {
    Space,
    Char,
    BoundedChar,
    Str,
    Value,
    Object,
    Array,
    IntegralPart,
    DecimalPart,
    Number,
    Integer,
    Boolean,
    Null,
    Uuid,
    Date,
    Time,
    DateTime,
    DateString,
    TimeString,
    DateTimeString,
}

/// The object `allOf` makes of its components.
#[derive(Default)]
struct Merged<'s> {
    /// Name, schema, and where in the schema.
    props: Vec<(&'s str, &'s Json, String)>,
    /// Name to place in `props`.
    index: HashMap<&'s str, usize>,
    required: Vec<String>,
    /// `$ref`s already merged.
    refs: HashSet<&'s str>,
}

/// What an object takes besides its declared properties.
enum Extra<'s> {
    /// No other key (`additionalProperties: false`).
    Nothing,
    /// No other key written, though the schema allows them (llama.cpp's layout where
    /// `properties` is given without `additionalProperties`); a required name missing from
    /// `properties` takes any value.
    Closed,
    /// Other keys with any value.
    AnyValue,
    /// Other keys with values of this schema (at this path).
    Schema(&'s Json, String),
}

struct Converter<'s> {
    root: &'s Json,
    /// Rules in the order made: name and body (`None` while a `$ref` is being converted).
    rules: Vec<(String, Option<String>)>,
    names: HashMap<String, usize>,
    /// The next suffix to try per name hint.
    suffixes: HashMap<String, usize>,
    /// `$ref` target to its rule.
    refs: HashMap<String, String>,
    /// Rules of `$ref`s being converted, to be defined by the first [`Converter::named`] with
    /// their name: their schema's own rule.
    pending: HashSet<String>,
    prims: HashMap<Prim, String>,
}

fn unsupported(keyword: &str, path: &str, detail: impl Into<String>) -> GrammarError {
    GrammarError::SchemaUnsupported {
        keyword: keyword.into(),
        path: path.into(),
        detail: detail.into(),
    }
}

fn invalid(path: &str, expected: impl Into<String>, got: impl Into<String>) -> GrammarError {
    GrammarError::SchemaInvalid {
        path: path.into(),
        expected: expected.into(),
        got: got.into(),
    }
}

/// `path` with one more JSON pointer segment (`~` and `/` escaped).
fn child(path: &str, segment: &str) -> String {
    format!("{path}/{}", segment.replace('~', "~0").replace('/', "~1"))
}

/// A rule-name hint `name-suffix` (or `suffix` at the top), with the suffix made of rule-name
/// characters.
fn hint(name: &str, suffix: &str) -> String {
    let mut clean = String::new();
    for c in suffix.chars() {
        if c.is_ascii_alphanumeric() || c == '-' {
            clean.push(c);
        } else if !clean.ends_with('-') {
            clean.push('-');
        }
    }
    let clean = clean.trim_matches('-');
    let clean = if clean.is_empty() { "x" } else { clean };
    if name.is_empty() {
        clean.to_owned()
    } else {
        format!("{name}-{clean}")
    }
}

/// A GBNF string literal matching exactly `s`.
fn lit(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\x{:02X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A character for inside a GBNF class, escaped unless a letter or digit.
fn class_char(c: char) -> String {
    match c as u32 {
        _ if c.is_ascii_alphanumeric() => c.to_string(),
        u @ 0..=0xFF => format!("\\x{u:02X}"),
        u @ 0..=0xFFFF => format!("\\u{u:04X}"),
        u => format!("\\U{u:08X}"),
    }
}

/// `body` in parentheses when it has alternatives at its top (outside groups, literals and
/// classes).
fn group(body: &str) -> String {
    let (mut depth, mut quoted, mut class, mut escaped) = (0usize, false, false, false);
    let mut top_alt = false;
    for c in body.chars() {
        if escaped {
            escaped = false;
            continue;
        }
        match c {
            '\\' if quoted || class => escaped = true,
            '"' if !class => quoted = !quoted,
            '[' if !quoted => class = true,
            ']' if !quoted => class = false,
            '(' if !quoted && !class => depth += 1,
            ')' if !quoted && !class => depth = depth.saturating_sub(1),
            '|' if !quoted && !class && depth == 0 => top_alt = true,
            _ => {}
        }
    }
    if top_alt {
        format!("({body})")
    } else {
        body.to_owned()
    }
}

/// A count keyword (`minItems`, `maxLength`, ...): a whole number up to [`MAX_COUNT`].
fn count(schema: &Json, key: &str, path: &str) -> Result<Option<u64>, GrammarError> {
    let Some(v) = schema.get(key) else {
        return Ok(None);
    };
    let n = match *v {
        Json::Int(i) if i >= 0 => i as u64,
        Json::UInt(u) => u,
        Json::Float(f) if f >= 0.0 && f.fract() == 0.0 && f <= u64::MAX as f64 => f as u64,
        _ => {
            return Err(invalid(
                &child(path, key),
                "a whole number of at least 0",
                v.python_dumps(),
            ));
        }
    };
    if n > MAX_COUNT {
        return Err(unsupported(
            key,
            path,
            format!("{n} is past {MAX_COUNT}, llama.cpp's limit on a grammar repetition"),
        ));
    }
    Ok(Some(n))
}

/// `{m,n}` after an item: `min` copies and up to `max` (`None`: no limit).
fn repeat(item: &str, min: u64, max: Option<u64>) -> String {
    match (min, max) {
        (0, Some(0)) => String::new(),
        (0, None) => format!("{item}*"),
        (1, None) => format!("{item}+"),
        (m, None) => format!("{item}{{{m},}}"),
        (0, Some(1)) => format!("{item}?"),
        (m, Some(n)) if m == n => format!("{item}{{{m}}}"),
        (m, Some(n)) => format!("{item}{{{m},{n}}}"),
    }
}

/// Items separated by `"," space`: between `min` and `max` of them (`max` ≥ `min`).
fn separated(item: &str, sp: &str, min: u64, max: Option<u64>) -> String {
    let rest = |min: u64| repeat(&format!("(\",\" {sp} {item})"), min, max.map(|n| n - 1));
    match (min, max) {
        (_, Some(0)) => String::new(),
        (0, _) => format!("({item} {})?", rest(0)),
        (m, _) => format!("{item} {}", rest(m - 1)),
    }
}

impl<'s> Converter<'s> {
    /// A rule with body `body`, named `hint`, or `hint0`, `hint1`, ... when `hint` is taken by
    /// another body.
    fn add(&mut self, hint: &str, body: String) -> String {
        if let Some(&at) = self.names.get(hint)
            && self.rules[at].1.as_deref() == Some(body.as_str())
        {
            return hint.to_owned();
        }
        let name = self.fresh(hint);
        self.names.insert(name.clone(), self.rules.len());
        self.rules.push((name.clone(), Some(body)));
        name
    }

    /// A name for a rule defined later ([`Converter::define`]).
    fn reserve(&mut self, hint: &str) -> String {
        let name = self.fresh(hint);
        self.names.insert(name.clone(), self.rules.len());
        self.rules.push((name.clone(), None));
        name
    }

    /// `hint`, or the next `hintN` not taken (counted per hint, so many alike stay linear).
    fn fresh(&mut self, hint: &str) -> String {
        if !self.names.contains_key(hint) {
            return hint.to_owned();
        }
        let i = self.suffixes.entry(hint.to_owned()).or_insert(0);
        loop {
            let name = format!("{hint}{i}");
            *i += 1;
            if !self.names.contains_key(&name) {
                return name;
            }
        }
    }

    fn define(&mut self, name: &str, body: String) {
        if let Some(&at) = self.names.get(name) {
            self.rules[at].1 = Some(body);
        }
    }

    /// A rule for a schema at `name` (empty at the top): `name`, or `name-` when that is a name
    /// the converter keeps.
    fn named(&mut self, name: &str, body: String) -> String {
        let name = match name {
            "" => "root".to_owned(),
            n if RESERVED.contains(&n) => format!("{n}-"),
            n => n.to_owned(),
        };
        if self.pending.remove(&name) {
            self.define(&name, body);
            return name;
        }
        self.add(&name, body)
    }

    /// [`Converter::named`] for a fixed rule.
    fn named_prim(&mut self, name: &str, p: Prim) -> String {
        let body = self.prim(p);
        self.named(name, body)
    }

    /// The fixed rule `p`, and those it uses.
    fn prim(&mut self, p: Prim) -> String {
        if let Some(name) = self.prims.get(&p) {
            return name.clone();
        }
        let hint = match p {
            Prim::Space => "space",
            Prim::Char => "char",
            Prim::BoundedChar => "bounded-char",
            Prim::Str => "string",
            Prim::Value => "value",
            Prim::Object => "object",
            Prim::Array => "array",
            Prim::IntegralPart => "integral-part",
            Prim::DecimalPart => "decimal-part",
            Prim::Number => "number",
            Prim::Integer => "integer",
            Prim::Boolean => "boolean",
            Prim::Null => "null",
            Prim::Uuid => "uuid",
            Prim::Date => "date",
            Prim::Time => "time",
            Prim::DateTime => "date-time",
            Prim::DateString => "date-string",
            Prim::TimeString => "time-string",
            Prim::DateTimeString => "date-time-string",
        };
        // Reserved first: value, object and array use each other.
        let name = self.reserve(hint);
        self.prims.insert(p, name.clone());
        let body = match p {
            // llama.cpp's converter: at most one space, so the model cannot run on in whitespace.
            Prim::Space => r#"" "?"#.to_owned(),
            // As llama.cpp's, without the raw control characters JSON forbids.
            Prim::Char => {
                r#"[^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})"#.to_owned()
            }
            // A character of a string with minLength or maxLength: as `char`, but no `\u` escape
            // of a UTF-16 surrogate, which would count one character past U+FFFF as two.
            Prim::BoundedChar => r#"[^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" ([0-9a-cA-CeEfF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2}))"#.to_owned(),
            Prim::Str => format!(r#""\"" {}* "\"" {}"#, self.prim(Prim::Char), self.space()),
            Prim::Value => {
                let alts = [
                    Prim::Object,
                    Prim::Array,
                    Prim::Str,
                    Prim::Number,
                    Prim::Boolean,
                    Prim::Null,
                ];
                let names: Vec<String> = alts.iter().map(|&a| self.prim(a)).collect();
                names.join(" | ")
            }
            Prim::Object => {
                let (s, v, sp) = (self.prim(Prim::Str), self.prim(Prim::Value), self.space());
                format!(
                    r#""{{" {sp} ({s} ":" {sp} {v} ("," {sp} {s} ":" {sp} {v})*)? "}}" {sp}"#
                )
            }
            Prim::Array => {
                let (v, sp) = (self.prim(Prim::Value), self.space());
                format!(r#""[" {sp} ({v} ("," {sp} {v})*)? "]" {sp}"#)
            }
            // llama.cpp's: `0`, or up to 16 digits without a leading zero.
            Prim::IntegralPart => r#""0" | [1-9] [0-9]{0,15}"#.to_owned(),
            Prim::DecimalPart => "[0-9]{1,16}".to_owned(),
            Prim::Number => {
                let (i, d, sp) = (
                    self.prim(Prim::IntegralPart),
                    self.prim(Prim::DecimalPart),
                    self.space(),
                );
                format!(r#""-"? {i} ("." {d})? ([eE] [-+]? {i})? {sp}"#)
            }
            Prim::Integer => {
                let (i, sp) = (self.prim(Prim::IntegralPart), self.space());
                format!(r#""-"? {i} {sp}"#)
            }
            Prim::Boolean => format!(r#"("true" | "false") {}"#, self.space()),
            Prim::Null => format!(r#""null" {}"#, self.space()),
            Prim::Uuid => format!(
                r#""\"" [0-9a-fA-F]{{8}} "-" [0-9a-fA-F]{{4}} "-" [0-9a-fA-F]{{4}} "-" [0-9a-fA-F]{{4}} "-" [0-9a-fA-F]{{12}} "\"" {}"#,
                self.space()
            ),
            // Calendar dates from 0001 (Python's `date.fromisoformat`, which jsonschema's format
            // check uses, has no year 0), with February 29 in leap years only; llama.cpp's takes
            // any day 01 to 31 of any month of any year.
            Prim::Date => [
                r#"([1-9] [0-9]{3} | "0" ([1-9] [0-9]{2} | "0" ([1-9] [0-9] | "0" [1-9]))) "-" ("#,
                r#"("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]) | "#,
                r#"("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30") | "#,
                r#""02-" ("0" [1-9] | "1" [0-9] | "2" [0-8])) | "#,
                r#"([0-9]{2} ([02468] [48] | [13579] [26] | [2468] "0") | "#,
                r#"("0" [48] | [2468] [048] | [13579] [26]) "00") "-02-29""#,
            ]
            .concat(),
            // llama.cpp's: milliseconds optional, the offset required.
            Prim::Time => r#"([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{3})? ("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])"#.to_owned(),
            Prim::DateTime => {
                format!(r#"{} "T" {}"#, self.prim(Prim::Date), self.prim(Prim::Time))
            }
            Prim::DateString | Prim::TimeString | Prim::DateTimeString => {
                let inner = self.prim(match p {
                    Prim::DateString => Prim::Date,
                    Prim::TimeString => Prim::Time,
                    _ => Prim::DateTime,
                });
                format!(r#""\"" {inner} "\"" {}"#, self.space())
            }
        };
        self.define(&name, body);
        name
    }

    fn space(&mut self) -> String {
        self.prim(Prim::Space)
    }

    /// The rule for `schema` at `path`, named after `name`.
    fn visit(
        &mut self,
        schema: &'s Json,
        path: &str,
        name: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        if depth > MAX_DEPTH {
            return Err(invalid(
                path,
                format!("a schema nested at most {MAX_DEPTH} levels deep"),
                "a deeper one",
            ));
        }
        let depth = depth + 1;
        let map = match schema {
            // `true` is the empty schema.
            Json::Bool(true) => return Ok(self.named_prim(name, Prim::Object)),
            Json::Bool(false) => {
                return Err(invalid(path, "a schema some value satisfies", "false"));
            }
            Json::Object(map) => map,
            other => {
                return Err(invalid(
                    path,
                    "a schema (an object or a boolean)",
                    format!("{} {}", other.type_name(), other.python_dumps()),
                ));
            }
        };

        if let Some(r) = schema.get("$ref") {
            only(map, path, "$ref", &["$ref"])?;
            let Json::Str(r) = r else {
                return Err(invalid(&child(path, "$ref"), "a string", r.python_dumps()));
            };
            let target = self.reference(r, path, depth)?;
            return Ok(self.named(name, target));
        }
        for word in ["$dynamicRef", "$recursiveRef"] {
            if map.iter().any(|(k, _)| k == word) {
                return Err(unsupported(
                    word,
                    path,
                    "dynamic references are not resolved",
                ));
            }
        }

        let any_of = schema.get("anyOf");
        let one_of = schema.get("oneOf");
        if let Some((word, alts)) = any_of
            .map(|a| ("anyOf", a))
            .or(one_of.map(|a| ("oneOf", a)))
        {
            if any_of.is_some() && one_of.is_some() {
                return Err(unsupported(
                    "oneOf",
                    path,
                    "anyOf and oneOf in one schema are not combined; nest one in the other",
                ));
            }
            only(map, path, word, &[word])?;
            let alts = schema_list(alts, &child(path, word), false)?;
            let mut names = Vec::with_capacity(alts.len());
            for (i, alt) in alts.iter().enumerate() {
                let at = child(&child(path, word), &i.to_string());
                let n = if name.is_empty() {
                    format!("alternative-{i}")
                } else {
                    format!("{name}-{i}")
                };
                names.push(self.visit(alt, &at, &n, depth)?);
            }
            return Ok(self.named(name, names.join(" | ")));
        }

        if let Some(all) = schema.get("allOf") {
            let parts = schema_list(all, &child(path, "allOf"), false)?;
            let own = map.iter().any(|(k, _)| k != "allOf" && is_keyword(k));
            if let ([one], false) = (parts, own) {
                let at = child(&child(path, "allOf"), "0");
                let inner = self.visit(one, &at, &hint(name, "allOf-0"), depth)?;
                return Ok(self.named(name, inner));
            }
            return self.all_of(schema, path, name, depth);
        }

        let types = type_list(schema, path)?;

        if let Some(value) = schema.get("const") {
            only(map, path, "const", &["const", "type"])?;
            if let Some(types) = &types
                && !types.iter().any(|t| is_of_type(value, t))
            {
                return Err(invalid(
                    path,
                    format!("a const of type {}", types.join(" or ")),
                    value.python_dumps(),
                ));
            }
            // llama.cpp's: json.dumps text, no space after.
            return Ok(self.named(name, lit(&value.python_dumps())));
        }

        if let Some(values) = schema.get("enum") {
            only(map, path, "enum", &["enum", "type"])?;
            let Json::Array(values) = values else {
                return Err(invalid(
                    &child(path, "enum"),
                    "an array of values",
                    values.python_dumps(),
                ));
            };
            let alts: Vec<String> = values
                .iter()
                .filter(|v| match &types {
                    Some(types) => types.iter().any(|t| is_of_type(v, t)),
                    None => true,
                })
                .map(|v| lit(&v.python_dumps()))
                .collect();
            if alts.is_empty() {
                return Err(invalid(
                    path,
                    "an enum with a value of the schema's type",
                    "none",
                ));
            }
            return Ok(self.named(name, alts.join(" | ")));
        }

        let types = match types {
            Some(t) => t,
            None => {
                let inferred = inferred_types(map);
                if inferred.is_empty() {
                    // llama.cpp's converter reads an empty schema as any object.
                    only(map, path, "", &[])?;
                    return Ok(self.named_prim(name, Prim::Object));
                }
                inferred
            }
        };
        check_typed_keywords(map, path, &types)?;
        if let [t] = types.as_slice() {
            return self.typed(schema, path, name, t, depth);
        }
        let mut names = Vec::with_capacity(types.len());
        for t in &types {
            let n = hint(name, t);
            names.push(self.typed(schema, path, &n, t, depth)?);
        }
        Ok(self.named(name, names.join(" | ")))
    }

    /// The rule for `$ref` `r` (met at `path`): a rule per target, made on first use, so that
    /// recursive schemas become recursive rules.
    fn reference(&mut self, r: &str, path: &str, depth: usize) -> Result<String, GrammarError> {
        if let Some(name) = self.refs.get(r) {
            return Ok(name.clone());
        }
        let (target, at) = self.resolve(r, path)?;
        let mut rule = match at.rsplit_once('/') {
            Some((_, last)) => hint("", last),
            None => "ref".to_owned(),
        };
        if RESERVED.contains(&rule.as_str()) {
            rule.push('-');
        }
        // Named before it is converted, so that a reference back to it inside is to this rule.
        let rule = self.reserve(&rule);
        self.refs.insert(r.to_owned(), rule.clone());
        self.pending.insert(rule.clone());
        // Names inside are `rule-...`, so the first `named(rule)` is this schema's own rule.
        let own = self.visit(target, &at, &rule, depth)?;
        if self.pending.remove(&rule) {
            self.define(&rule, own);
        }
        Ok(rule)
    }

    /// The subschema `$ref` `r` points at, and its path.
    fn resolve(&self, r: &str, path: &str) -> Result<(&'s Json, String), GrammarError> {
        let Some(pointer) = r.strip_prefix('#') else {
            return Err(unsupported(
                "$ref",
                path,
                format!(
                    "'{r}' is not in this document; only references within it ('#/$defs/name') \
                     are resolved"
                ),
            ));
        };
        if !pointer.is_empty() && !pointer.starts_with('/') {
            return Err(unsupported(
                "$ref",
                path,
                format!("'{r}' names an anchor; only JSON pointers ('#/$defs/name') are resolved"),
            ));
        }
        let mut target = self.root;
        let mut at = String::from("#");
        for raw in pointer.split('/').skip(1) {
            let segment = percent_decoded(raw).replace("~1", "/").replace("~0", "~");
            let next = match target {
                Json::Object(_) => target.get(&segment),
                Json::Array(items) => segment.parse::<usize>().ok().and_then(|i| items.get(i)),
                _ => None,
            };
            let Some(next) = next else {
                return Err(invalid(
                    &child(path, "$ref"),
                    format!(
                        "a reference to a part of the schema ('{}' has no '{segment}')",
                        at
                    ),
                    format!("'{r}'"),
                ));
            };
            target = next;
            at = child(&at, &segment);
        }
        Ok((target, at))
    }

    /// A schema of one type.
    fn typed(
        &mut self,
        schema: &'s Json,
        path: &str,
        name: &str,
        t: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        match t {
            "object" => self.object(schema, path, name, depth),
            "array" => self.array(schema, path, name, depth),
            "string" => self.string(schema, path, name),
            "integer" => self.integer(schema, path, name),
            "number" => Ok(self.named_prim(name, Prim::Number)),
            "boolean" => Ok(self.named_prim(name, Prim::Boolean)),
            _ => Ok(self.named_prim(name, Prim::Null)),
        }
    }

    fn object(
        &mut self,
        schema: &'s Json,
        path: &str,
        name: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        let properties = match schema.get("properties") {
            None => None,
            Some(Json::Object(props)) => Some(props),
            Some(other) => {
                return Err(invalid(
                    &child(path, "properties"),
                    "an object of schemas",
                    other.python_dumps(),
                ));
            }
        };
        let required = required_names(schema, path)?;
        let additional = schema.get("additionalProperties");
        // As llama.cpp's: with `properties`, no other keys unless `additionalProperties` says so.
        let extra = match additional {
            Some(Json::Bool(false)) => Extra::Nothing,
            None if properties.is_some() => Extra::Closed,
            None | Some(Json::Bool(true)) if properties.is_none() => Extra::AnyValue,
            Some(s) => Extra::Schema(s, child(path, "additionalProperties")),
            None => Extra::Closed,
        };
        if properties.is_none() && required.is_empty() && matches!(extra, Extra::AnyValue) {
            return Ok(self.named_prim(name, Prim::Object));
        }
        let props: Vec<(&str, &'s Json, String)> = properties
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.as_str(), v, child(&child(path, "properties"), k)))
            .collect();
        self.build_object(&props, &required, extra, path, name, depth)
    }

    /// `allOf` over object schemas: one object with every component's properties, required
    /// where some component requires them.
    fn all_of(
        &mut self,
        schema: &'s Json,
        path: &str,
        name: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        let mut merged = Merged::default();
        self.collect(schema, path, &mut merged, 0)?;
        let Merged {
            props, required, ..
        } = merged;
        self.build_object(&props, &required, Extra::Closed, path, name, depth)
    }

    /// The properties and `required` of an `allOf` component (and of its own `allOf`), into
    /// `merged`.
    fn collect(
        &self,
        schema: &'s Json,
        path: &str,
        merged: &mut Merged<'s>,
        depth: usize,
    ) -> Result<(), GrammarError> {
        if depth > MAX_DEPTH {
            return Err(invalid(
                path,
                format!("allOf nested at most {MAX_DEPTH} levels deep"),
                "a deeper one",
            ));
        }
        let Json::Object(map) = schema else {
            return Err(unsupported(
                "allOf",
                path,
                "allOf is combined only over object schemas",
            ));
        };
        if let Some(r) = schema.get("$ref") {
            only(map, path, "$ref", &["$ref"])?;
            let Json::Str(r) = r else {
                return Err(invalid(&child(path, "$ref"), "a string", r.python_dumps()));
            };
            if !merged.refs.insert(r.as_str()) {
                return Ok(());
            }
            let (target, at) = self.resolve(r, path)?;
            return self.collect(target, &at, merged, depth + 1);
        }
        let object_only = |path: &str| {
            unsupported(
                "allOf",
                path,
                "allOf is combined only over object schemas (type, properties, required)",
            )
        };
        match schema.get("type") {
            None => {}
            Some(Json::Str(t)) if t == "object" => {}
            Some(Json::Array(ts)) if ts == &[Json::Str("object".into())] => {}
            Some(_) => return Err(object_only(path)),
        }
        match schema.get("additionalProperties") {
            None | Some(Json::Bool(true)) => {}
            Some(_) => {
                return Err(unsupported(
                    "additionalProperties",
                    path,
                    "inside allOf it would forbid the other components' properties",
                ));
            }
        }
        only(
            map,
            path,
            "allOf",
            &[
                "allOf",
                "type",
                "properties",
                "required",
                "additionalProperties",
            ],
        )?;
        match schema.get("properties") {
            None => {}
            Some(Json::Object(own)) => {
                for (k, v) in own {
                    match merged.index.get(k.as_str()).map(|&i| &merged.props[i]) {
                        Some((_, prev, _)) if *prev == v => {}
                        Some(_) => {
                            return Err(unsupported(
                                "allOf",
                                path,
                                format!("property '{k}' is defined by two components differently"),
                            ));
                        }
                        None => {
                            merged.index.insert(k, merged.props.len());
                            let at = child(&child(path, "properties"), k);
                            merged.props.push((k, v, at));
                        }
                    }
                }
            }
            Some(other) => {
                return Err(invalid(
                    &child(path, "properties"),
                    "an object of schemas",
                    other.python_dumps(),
                ));
            }
        }
        merged.required.extend(required_names(schema, path)?);
        if let Some(all) = schema.get("allOf") {
            let at = child(path, "allOf");
            for (i, part) in schema_list(all, &at, false)?.iter().enumerate() {
                let p = child(&at, &i.to_string());
                self.collect(part, &p, merged, depth + 1)?;
            }
        }
        Ok(())
    }

    /// An object: the required properties in schema order (then required names `properties`
    /// lacks), then the optional ones in order, each or none, then keys `extra` allows.
    fn build_object(
        &mut self,
        props: &[(&str, &'s Json, String)],
        required: &[String],
        extra: Extra<'s>,
        path: &str,
        name: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        let sp = self.space();
        let kv = |this: &mut Self, key: &str, value: String| {
            let mut k = String::new();
            python_string(key, &mut k);
            this.add(
                &hint(name, &format!("{key}-kv")),
                format!("{} {sp} \":\" {sp} {value}", lit(&k)),
            )
        };
        let required_set: HashSet<&str> = required.iter().map(String::as_str).collect();
        let mut req = Vec::new();
        let mut opt = Vec::new();
        for (key, schema, at) in props {
            let is_required = required_set.contains(key);
            if *schema == &Json::Bool(false) {
                if is_required {
                    return Err(invalid(
                        at,
                        format!("a schema for required property '{key}' some value satisfies"),
                        "false",
                    ));
                }
                continue;
            }
            let value = self.visit(schema, at, &hint(name, key), depth)?;
            let rule = kv(self, key, value);
            if is_required { &mut req } else { &mut opt }.push(rule);
        }
        let mut declared: Vec<&str> = props.iter().map(|(k, _, _)| *k).collect();
        let mut is_declared: HashSet<&str> = declared.iter().copied().collect();
        for key in required {
            if !is_declared.insert(key) {
                continue;
            }
            declared.push(key);
            let value = match &extra {
                Extra::Nothing => {
                    return Err(invalid(
                        &child(path, "required"),
                        format!(
                            "required properties that the object may have ('{key}' is not in \
                             properties, and no other keys are allowed)"
                        ),
                        format!("'{key}'"),
                    ));
                }
                Extra::Closed | Extra::AnyValue => self.prim(Prim::Value),
                Extra::Schema(s, at) => self.visit(s, at, &hint(name, key), depth)?,
            };
            req.push(kv(self, key, value));
        }
        let extra_kv = match extra {
            Extra::Nothing | Extra::Closed | Extra::Schema(Json::Bool(false), _) => None,
            Extra::AnyValue | Extra::Schema(..) => {
                let value = match extra {
                    Extra::Schema(s, at) => {
                        self.visit(s, &at, &hint(name, "additional-value"), depth)?
                    }
                    _ => self.prim(Prim::Value),
                };
                let key = self.key_not_in(&declared, &hint(name, "additional-key"));
                Some(self.add(
                    &hint(name, "additional-kv"),
                    format!("{key} \":\" {sp} {value}"),
                ))
            }
        };

        let mut body = format!("\"{{\" {sp} ");
        body.push_str(&req.join(&format!(" \",\" {sp} ")));
        if !opt.is_empty() || extra_kv.is_some() {
            // One alternative per first optional key: it, then each later one or not (a chain
            // of rules, so the grammar grows linearly), then any extra keys.
            let mut tail = extra_kv
                .as_ref()
                .map(|e| self.add(&hint(name, "additional-kvs"), format!("(\",\" {sp} {e})*")));
            let mut alts = Vec::new();
            if let Some(e) = &extra_kv {
                alts.push(format!("{e} {}", tail.clone().unwrap_or_default()));
            }
            for (i, o) in opt.iter().enumerate().rev() {
                alts.push(match &tail {
                    Some(t) => format!("{o} {t}"),
                    None => o.clone(),
                });
                if i == 0 {
                    break;
                }
                let rest = match &tail {
                    Some(t) => format!("(\",\" {sp} {o})? {t}"),
                    None => format!("(\",\" {sp} {o})?"),
                };
                tail = Some(self.add(&hint(name, &format!("rest-{i}")), rest));
            }
            alts.reverse();
            let alts = group(&alts.join(" | "));
            if req.is_empty() {
                let _ = write!(body, "({alts})?");
            } else {
                let _ = write!(body, " (\",\" {sp} {alts})?");
            }
        }
        let _ = write!(body, " \"}}\" {sp}");
        Ok(self.named(name, body))
    }

    /// A JSON string that is none of `names`: written without escapes up to where it parts
    /// from every name (a trie, a rule per node), freely after.
    fn key_not_in(&mut self, names: &[&str], name: &str) -> String {
        let sp = self.space();
        if names.is_empty() {
            return self.prim(Prim::Str);
        }
        let ch = self.prim(Prim::Char);
        let mut nodes: Vec<(BTreeMap<char, usize>, bool)> = vec![(BTreeMap::new(), false)];
        for n in names {
            let mut at = 0;
            for c in n.chars() {
                let next = nodes.len();
                at = *nodes[at].0.entry(c).or_insert(next);
                if at == next {
                    nodes.push((BTreeMap::new(), false));
                }
            }
            nodes[at].1 = true;
        }
        let rules: Vec<String> = (0..nodes.len())
            .map(|i| self.reserve(&format!("{name}-{i}")))
            .collect();
        for (i, (children, end)) in nodes.iter().enumerate() {
            let mut alts = Vec::new();
            let mut others = String::from(r#"[^"\\\x00-\x1F"#);
            for (&c, &next) in children {
                others.push_str(&class_char(c));
                // Only a character JSON writes as itself follows the trie.
                if c != '"' && c != '\\' && c as u32 >= 0x20 {
                    alts.push(format!("{} {}", lit(&c.to_string()), rules[next]));
                }
            }
            alts.push(format!("{others}] {ch}*"));
            // A name's prefix may end the key; a whole name may not.
            let empty = if *end { "" } else { "| " };
            self.define(&rules[i], format!("{empty}{}", alts.join(" | ")));
        }
        self.add(name, format!(r#""\"" {} "\"" {sp}"#, rules[0]))
    }

    fn array(
        &mut self,
        schema: &'s Json,
        path: &str,
        name: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        let sp = self.space();
        let min = count(schema, "minItems", path)?.unwrap_or(0);
        let max = count(schema, "maxItems", path)?;
        if let Some(max) = max.filter(|&m| m < min) {
            return Err(invalid(
                &child(path, "maxItems"),
                format!("at least minItems ({min})"),
                max.to_string(),
            ));
        }
        // The tuple form: `prefixItems` (2020-12), or `items` as an array (earlier drafts) with
        // `additionalItems`; then what follows it.
        let items = schema.get("items");
        let (prefix, rest, rest_word) = match (schema.get("prefixItems"), items) {
            (Some(_), Some(Json::Array(_))) => {
                return Err(invalid(
                    &child(path, "items"),
                    "a schema for the items after prefixItems",
                    "an array",
                ));
            }
            (Some(p), rest) => (Some(("prefixItems", p)), rest, "items"),
            (None, Some(p @ Json::Array(_))) => (
                Some(("items", p)),
                schema.get("additionalItems"),
                "additionalItems",
            ),
            (None, rest) => (None, rest, "items"),
        };
        let mut body = format!("\"[\" {sp} ");
        let mut follow_min = min;
        let mut follow_max = max;
        let mut first = true;
        if let Some((word, p)) = prefix {
            let at = child(path, word);
            let parts = schema_list(p, &at, true)?;
            let n = parts.len() as u64;
            if max.is_some_and(|m| m < n) {
                return Err(unsupported(
                    "maxItems",
                    path,
                    format!("below the {n} {word}: arrays shorter than the tuple are not written"),
                ));
            }
            let mut names = Vec::new();
            for (i, part) in parts.iter().enumerate() {
                let p = child(&at, &i.to_string());
                names.push(self.visit(part, &p, &hint(name, &format!("tuple-{i}")), depth)?);
            }
            body.push_str(&names.join(&format!(" \",\" {sp} ")));
            first = names.is_empty();
            follow_min = min.saturating_sub(n);
            follow_max = max.map(|m| m - n);
            if rest.is_none() {
                // Llama.cpp's: exactly the tuple.
                if follow_min > 0 {
                    return Err(unsupported(
                        "minItems",
                        path,
                        format!(
                            "above the {n} {word} with no {rest_word} schema for the items after \
                             them"
                        ),
                    ));
                }
                follow_max = Some(0);
            }
        }
        let item = match rest {
            Some(Json::Bool(false)) => {
                if follow_min > 0 {
                    return Err(invalid(
                        &child(path, rest_word),
                        format!("items allowed, for minItems ({min})"),
                        "false",
                    ));
                }
                follow_max = Some(0);
                None
            }
            Some(s) => Some(self.visit(s, &child(path, rest_word), &hint(name, "item"), depth)?),
            None if prefix.is_some() => None,
            None => Some(self.prim(Prim::Value)),
        };
        if let (Some(item), false) = (item, follow_max == Some(0)) {
            if first {
                body.push_str(&separated(&item, &sp, follow_min, follow_max));
            } else {
                let more = format!("(\",\" {sp} {item})");
                body.push(' ');
                body.push_str(&repeat(&more, follow_min, follow_max));
            }
        }
        let _ = write!(body, " \"]\" {sp}");
        Ok(self.named(name, body))
    }

    fn string(&mut self, schema: &Json, path: &str, name: &str) -> Result<String, GrammarError> {
        if schema.get("pattern").is_some() {
            return Err(unsupported(
                "pattern",
                path,
                "regular expressions are not converted; list the values with enum, or pass a \
                 GBNF grammar with grammar=",
            ));
        }
        let min = count(schema, "minLength", path)?;
        let max = count(schema, "maxLength", path)?;
        if let Some(f) = schema.get("format") {
            let Json::Str(f) = f else {
                return Err(invalid(
                    &child(path, "format"),
                    "a string",
                    f.python_dumps(),
                ));
            };
            let prim = match f.as_str() {
                "date" => Prim::DateString,
                "time" => Prim::TimeString,
                "date-time" => Prim::DateTimeString,
                // llama.cpp's: uuid and uuid1 to uuid5 alike.
                "uuid" | "uuid1" | "uuid2" | "uuid3" | "uuid4" | "uuid5" => Prim::Uuid,
                other => {
                    return Err(unsupported(
                        "format",
                        path,
                        format!(
                            "format '{other}' is not built; the formats written are date, time, \
                             date-time and uuid"
                        ),
                    ));
                }
            };
            if min.is_some() || max.is_some() {
                let word = if min.is_some() {
                    "minLength"
                } else {
                    "maxLength"
                };
                return Err(unsupported(word, path, "together with format"));
            }
            return Ok(self.named_prim(name, prim));
        }
        if min.is_none() && max.is_none() {
            return Ok(self.named_prim(name, Prim::Str));
        }
        let min = min.unwrap_or(0);
        if let Some(max) = max.filter(|&m| m < min) {
            return Err(invalid(
                &child(path, "maxLength"),
                format!("at least minLength ({min})"),
                max.to_string(),
            ));
        }
        let (ch, sp) = (self.prim(Prim::BoundedChar), self.space());
        // A character here is one JSON character: a `\` escape counts as one.
        let chars = if max == Some(0) {
            String::new()
        } else {
            format!("{} ", repeat(&ch, min, max))
        };
        Ok(self.named(name, format!(r#""\"" {chars}"\"" {sp}"#)))
    }

    fn integer(&mut self, schema: &Json, path: &str, name: &str) -> Result<String, GrammarError> {
        if schema.get("multipleOf").is_some() {
            return Err(unsupported(
                "multipleOf",
                path,
                "multiples are not written into grammar",
            ));
        }
        // A bound as an integer rounded down or up, exactly; past ±10^17 is past every bound.
        let bound = |key: &str, up: bool| -> Result<Option<i64>, GrammarError> {
            const FAR: i64 = 100_000_000_000_000_000;
            match schema.get(key) {
                None | Some(Json::Bool(_)) => Ok(None),
                Some(Json::Int(i)) => Ok(Some((*i).clamp(-FAR, FAR))),
                Some(Json::UInt(_)) => Ok(Some(FAR)),
                Some(Json::Float(f)) => {
                    let f = if up { f.ceil() } else { f.floor() };
                    Ok(Some(f.clamp(-FAR as f64, FAR as f64) as i64))
                }
                Some(v) => Err(invalid(&child(path, key), "a number", v.python_dumps())),
            }
        };
        // Draft 4 writes an exclusive bound as `exclusiveMinimum: true` beside `minimum`.
        let draft4 = |key: &str| matches!(schema.get(key), Some(Json::Bool(true)));
        let mut lo = -INT_LIMIT;
        let mut hi = INT_LIMIT;
        if draft4("exclusiveMinimum") {
            if let Some(m) = bound("minimum", false)? {
                lo = lo.max(m + 1);
            }
        } else if let Some(m) = bound("minimum", true)? {
            lo = lo.max(m);
        }
        if let Some(m) = bound("exclusiveMinimum", false)? {
            lo = lo.max(m + 1);
        }
        if draft4("exclusiveMaximum") {
            if let Some(m) = bound("maximum", true)? {
                hi = hi.min(m - 1);
            }
        } else if let Some(m) = bound("maximum", false)? {
            hi = hi.min(m);
        }
        if let Some(m) = bound("exclusiveMaximum", true)? {
            hi = hi.min(m - 1);
        }
        if lo > hi {
            return Err(invalid(
                path,
                "integer bounds that some integer of at most 16 digits is within",
                format!("none from {lo} to {hi}"),
            ));
        }
        if lo == -INT_LIMIT && hi == INT_LIMIT {
            return Ok(self.named_prim(name, Prim::Integer));
        }
        let range = int_range(lo, hi);
        let sp = self.space();
        Ok(self.named(name, format!("{} {sp}", group(&range))))
    }
}

/// Refuses every keyword of `map` but those in `allowed` (`word` is the one they sit beside).
fn only(
    map: &[(String, Json)],
    path: &str,
    word: &str,
    allowed: &[&str],
) -> Result<(), GrammarError> {
    for (k, v) in map {
        if allowed.contains(&k.as_str()) || !is_keyword(k) || is_no_op(k, v) {
            continue;
        }
        let detail = if word.is_empty() {
            "the converter does not write it into grammar".to_owned()
        } else {
            format!("keywords beside {word} are not combined with it; move it inside")
        };
        return Err(unsupported(k, path, detail));
    }
    Ok(())
}

/// Whether JSON Schema defines `k` as a keyword that constrains values (others, such as
/// `title`, `description` or `$defs`, are annotations).
fn is_keyword(k: &str) -> bool {
    [
        OBJECT_WORDS,
        ARRAY_WORDS,
        STRING_WORDS,
        NUMBER_WORDS,
        ANY_WORDS,
    ]
    .iter()
    .any(|words| words.contains(&k))
}

/// A keyword whose value constrains nothing.
fn is_no_op(k: &str, v: &Json) -> bool {
    matches!(
        (k, v),
        (
            "uniqueItems" | "exclusiveMinimum" | "exclusiveMaximum",
            Json::Bool(false)
        ) | (
            "minProperties" | "minItems" | "minLength" | "minContains",
            Json::Int(0)
        )
    )
}

/// Refuses a keyword of a type in `types` that the converter does not write.
fn check_typed_keywords(
    map: &[(String, Json)],
    path: &str,
    types: &[&str],
) -> Result<(), GrammarError> {
    let handled = |t: &str| -> &[&str] {
        match t {
            "object" => &["properties", "required", "additionalProperties"],
            "array" => &[
                "items",
                "prefixItems",
                "additionalItems",
                "minItems",
                "maxItems",
            ],
            "string" => &["minLength", "maxLength", "pattern", "format"],
            "integer" => &[
                "minimum",
                "maximum",
                "exclusiveMinimum",
                "exclusiveMaximum",
                "multipleOf",
            ],
            _ => &[],
        }
    };
    for (k, v) in map {
        if k == "type" || !is_keyword(k) || is_no_op(k, v) {
            continue;
        }
        let owners: Vec<&str> = types
            .iter()
            .copied()
            .filter(|t| words_of(t).contains(&k.as_str()))
            .collect();
        let general = ANY_WORDS.contains(&k.as_str());
        if !general && owners.iter().all(|t| handled(t).contains(&k.as_str())) {
            continue;
        }
        let detail = match owners.as_slice() {
            [] => "the converter does not write it into grammar".to_owned(),
            ["number", ..] if NUMBER_WORDS.contains(&k.as_str()) => {
                "bounds are written for integers only; use type integer, or leave it out".into()
            }
            _ => format!(
                "the converter does not write it into grammar for type {}",
                owners.join(" or ")
            ),
        };
        return Err(unsupported(k, path, detail));
    }
    Ok(())
}

fn words_of(t: &str) -> &'static [&'static str] {
    match t {
        "object" => OBJECT_WORDS,
        "array" => ARRAY_WORDS,
        "string" => STRING_WORDS,
        "integer" | "number" => NUMBER_WORDS,
        _ => &[],
    }
}

/// The types a schema with no `type` must have for its keywords to mean something, in
/// llama.cpp's order (object first); empty when it has none.
fn inferred_types(map: &[(String, Json)]) -> Vec<&'static str> {
    let has = |words: &[&str]| map.iter().any(|(k, _)| words.contains(&k.as_str()));
    [
        ("object", OBJECT_WORDS),
        ("array", ARRAY_WORDS),
        ("string", STRING_WORDS),
        ("number", NUMBER_WORDS),
    ]
    .into_iter()
    .filter(|(_, words)| has(words))
    .map(|(t, _)| t)
    .collect()
}

/// `type`: one type name or a list of them; `None` when absent.
fn type_list<'a>(schema: &'a Json, path: &str) -> Result<Option<Vec<&'a str>>, GrammarError> {
    let bad = |v: &Json| {
        invalid(
            &child(path, "type"),
            format!("a type name ({}) or a list of them", TYPES.join(", ")),
            v.python_dumps(),
        )
    };
    match schema.get("type") {
        None => Ok(None),
        Some(Json::Str(t)) if TYPES.contains(&t.as_str()) => Ok(Some(vec![t.as_str()])),
        Some(Json::Array(ts)) if !ts.is_empty() => {
            let mut out = Vec::with_capacity(ts.len());
            for t in ts {
                match t {
                    Json::Str(s) if TYPES.contains(&s.as_str()) => {
                        if !out.contains(&s.as_str()) {
                            out.push(s.as_str());
                        }
                    }
                    other => return Err(bad(other)),
                }
            }
            Ok(Some(out))
        }
        Some(other) => Err(bad(other)),
    }
}

/// Whether `v` is of JSON Schema type `t` (an integer is a number too).
fn is_of_type(v: &Json, t: &str) -> bool {
    let own = v.type_name();
    own == t || (t == "number" && own == "integer")
}

/// `required`: a list of names.
fn required_names(schema: &Json, path: &str) -> Result<Vec<String>, GrammarError> {
    match schema.get("required") {
        None => Ok(Vec::new()),
        Some(Json::Array(names)) => names
            .iter()
            .map(|n| match n {
                Json::Str(s) => Ok(s.clone()),
                other => Err(invalid(
                    &child(path, "required"),
                    "a list of property names",
                    other.python_dumps(),
                )),
            })
            .collect(),
        Some(other) => Err(invalid(
            &child(path, "required"),
            "a list of property names",
            other.python_dumps(),
        )),
    }
}

/// A keyword's list of schemas (`anyOf`, `allOf`: not empty; `prefixItems`: any).
fn schema_list<'a>(
    v: &'a Json,
    path: &str,
    may_be_empty: bool,
) -> Result<&'a [Json], GrammarError> {
    match v {
        Json::Array(items) if may_be_empty || !items.is_empty() => Ok(items),
        other => Err(invalid(
            path,
            if may_be_empty {
                "a list of schemas"
            } else {
                "a non-empty list of schemas"
            },
            other.python_dumps(),
        )),
    }
}

/// A URI fragment's `%XX` escapes decoded (left as written where they do not make UTF-8).
fn percent_decoded(s: &str) -> String {
    if !s.contains('%') {
        return s.to_owned();
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b.get(i + 1..i + 3).and_then(|h| {
            std::str::from_utf8(h)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        });
        match (b[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_owned())
}

/// GBNF alternatives for the integers from `lo` to `hi` (`lo` ≤ `hi`, both within ±10^16),
/// written without leading zeros or `-0`.
fn int_range(lo: i64, hi: i64) -> String {
    if lo >= 0 {
        return naturals(lo.unsigned_abs(), hi.unsigned_abs());
    }
    if hi < 0 {
        let abs = naturals(hi.unsigned_abs(), lo.unsigned_abs());
        return format!("\"-\" {}", group(&abs));
    }
    let negative = naturals(1, lo.unsigned_abs());
    let rest = naturals(0, hi.unsigned_abs());
    format!("\"-\" {} | {rest}", group(&negative))
}

fn pow10(d: u32) -> u64 {
    10u64.pow(d)
}

fn n_digits(n: u64) -> u32 {
    n.checked_ilog10().unwrap_or(0) + 1
}

/// `[0-9]{n}`, or nothing for 0.
fn any_digits(n: usize) -> String {
    match n {
        0 => String::new(),
        1 => "[0-9]".into(),
        n => format!("[0-9]{{{n}}}"),
    }
}

/// Alternatives for the naturals from `lo` to `hi`: a run per digit count, and the counts
/// whose every number is in, in one `[1-9] [0-9]{m,n}`.
fn naturals(lo: u64, hi: u64) -> String {
    let mut alts = Vec::new();
    let top = n_digits(hi);
    let mut d = n_digits(lo);
    while d <= top {
        let first = if d == 1 { 0 } else { pow10(d - 1) };
        let last = pow10(d) - 1;
        let (a, b) = (lo.max(first), hi.min(last));
        if d > 1 && a == first && b == last {
            let mut e = d;
            while e < top && hi >= pow10(e + 1) - 1 {
                e += 1;
            }
            alts.push(match (d - 1, e - 1) {
                (m, n) if m == n => format!("[1-9] {}", any_digits(m as usize)),
                (m, n) => format!("[1-9] [0-9]{{{m},{n}}}"),
            });
            d = e + 1;
            continue;
        }
        alts.push(same_length(
            a.to_string().as_bytes(),
            b.to_string().as_bytes(),
        ));
        d += 1;
    }
    alts.join(" | ")
}

/// Alternatives for the digit strings of one length from `a` to `b` (`a` ≤ `b`): split at the
/// first digit where they differ, into `a`'s first digit with the rest from `a`'s rest up, the
/// digits between with any rest, and `b`'s first digit with the rest up to `b`'s.
fn same_length(a: &[u8], b: &[u8]) -> String {
    let digit_lit = |d: &[u8]| format!("\"{}\"", String::from_utf8_lossy(d));
    let prefix = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    if prefix == a.len() {
        return digit_lit(a);
    }
    let lead = if prefix > 0 {
        format!("{} ", digit_lit(&a[..prefix]))
    } else {
        String::new()
    };
    let (a, b) = (&a[prefix..], &b[prefix..]);
    let rest = a.len() - 1;
    let class = |x: u8, y: u8| {
        if x == y {
            format!("\"{}\"", x as char)
        } else {
            format!("[{}-{}]", x as char, y as char)
        }
    };
    let join = |head: String, tail: String| {
        if tail.is_empty() {
            head
        } else {
            format!("{head} {tail}")
        }
    };
    let mut alts = Vec::new();
    let (mut from, mut to) = (a[0], b[0]);
    if a[1..].iter().any(|&c| c != b'0') {
        let up = same_length(&a[1..], &vec![b'9'; rest]);
        alts.push(join(class(a[0], a[0]), group(&up)));
        from += 1;
    }
    let b_full = b[1..].iter().all(|&c| c == b'9');
    if !b_full {
        to -= 1;
    }
    if from <= to {
        alts.push(join(class(from, to), any_digits(rest)));
    }
    if !b_full {
        let down = same_length(&vec![b'0'; rest], &b[1..]);
        alts.push(join(class(b[0], b[0]), group(&down)));
    }
    format!("{lead}{}", group(&alts.join(" | ")))
}

//! The JSON Schema converter: strings each schema's grammar takes or refuses, against hand-labelled
//! instances and llama.cpp's converter (`tests/data/json_schema_reference.json`, written by
//! `tests/gen_json_schema_reference.py` from llama-cpp-python 0.3.36's `llama_grammar.py`);
//! integer ranges against arithmetic; and the refusals, by message.

use std::path::PathBuf;
use std::sync::Arc;

use proptest::prelude::*;

use super::dfa::{DEAD, Dfa, StateId};
use super::*;

/// Whole-string acceptance by one grammar, the automaton kept across strings.
struct Matcher {
    dfa: Dfa,
    start: StateId,
}

impl Matcher {
    fn new(gbnf: &str) -> Matcher {
        let g = Grammar::parse(gbnf).unwrap_or_else(|e| panic!("{e}\n{gbnf}"));
        let (dfa, start) = Dfa::new(Arc::new(g)).unwrap();
        Matcher { dfa, start }
    }

    fn of_schema(schema: &str) -> Matcher {
        let gbnf = json_schema_to_gbnf(schema).unwrap_or_else(|e| panic!("{schema}: {e}"));
        Matcher::new(&gbnf)
    }

    fn accepts(&mut self, text: &str) -> bool {
        let mut s = self.start;
        for &b in text.as_bytes() {
            s = self.dfa.step(s, b).unwrap();
            if s == DEAD {
                return false;
            }
        }
        self.dfa.can_end(s)
    }
}

fn error(schema: &str) -> String {
    match json_schema_to_gbnf(schema) {
        Ok(g) => panic!("{schema} converted:\n{g}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn strings_match_hand_labels_and_llama_cpps_converter() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/json_schema_reference.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut checked = 0;
    let mut wrong = Vec::new();
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut ours = Matcher::of_schema(case["schema"].as_str().unwrap());
        let mut theirs = Matcher::new(case["llama_cpp_gbnf"].as_str().unwrap());
        for inst in case["instances"].as_array().unwrap() {
            let text = inst["text"].as_str().unwrap();
            let valid = inst["valid"].as_bool().unwrap();
            let want_ours = inst["ours"].as_bool().unwrap();
            let want_theirs = inst["llama_cpp"].as_bool().unwrap();
            // The fixture's own promise: what we accept is valid.
            assert!(
                !want_ours || valid,
                "{name}: {text:?} is labelled invalid yet ours"
            );
            for (who, got, want) in [
                ("ours", ours.accepts(text), want_ours),
                ("llama.cpp's", theirs.accepts(text), want_theirs),
            ] {
                if got != want {
                    wrong.push(format!(
                        "{name}: {who} grammar on {text:?}: {got}, not {want}"
                    ));
                }
            }
            checked += 1;
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(checked > 100, "{checked}");
}

#[test]
fn integer_ranges_match_arithmetic() {
    let ranges: &[(i64, i64)] = &[
        (0, 0),
        (0, 9),
        (1, 9),
        (0, 10),
        (7, 7),
        (5, 123),
        (10, 99),
        (100, 999),
        (99, 1000),
        (0, 120),
        (-40, 50),
        (-39, 49),
        (-1000, -1),
        (-999, -100),
        (-5, 5),
        (-1, 0),
        (37, 1064),
        (101, 199),
        (190, 201),
    ];
    for &(lo, hi) in ranges {
        let mut m = Matcher::of_schema(&format!(
            r#"{{"type": "integer", "minimum": {lo}, "maximum": {hi}}}"#
        ));
        for n in -1200..=1200 {
            let inside = lo <= n && n <= hi;
            assert_eq!(m.accepts(&n.to_string()), inside, "[{lo}, {hi}] on {n}");
        }
        for bad in ["-0", "00", "01", "-01", "", "-", "1.0", "+1"] {
            assert!(!m.accepts(bad), "[{lo}, {hi}] took {bad:?}");
        }
        assert!(m.accepts(&format!("{lo} ")), "one space after");
        assert!(!m.accepts(&format!("{lo}  ")), "two spaces after");
    }
    // Exclusive bounds, fractional bounds, draft 4's boolean form, one side only.
    let cases: &[(&str, i64, i64)] = &[
        (r#""exclusiveMinimum": -3, "exclusiveMaximum": 7"#, -2, 6),
        (r#""minimum": 2.5, "maximum": 9.5"#, 3, 9),
        (r#""minimum": -2.5, "maximum": -0.5"#, -2, -1),
        (
            r#""minimum": 3, "exclusiveMinimum": true, "maximum": 8, "exclusiveMaximum": true"#,
            4,
            7,
        ),
        (r#""minimum": 3, "exclusiveMinimum": false"#, 3, INT_MAX),
        (r#""minimum": 995"#, 995, INT_MAX),
        (r#""maximum": -995"#, -INT_MAX, -995),
        (r#""exclusiveMaximum": 0"#, -INT_MAX, -1),
    ];
    for &(bounds, lo, hi) in cases {
        let mut m = Matcher::of_schema(&format!(r#"{{"type": "integer", {bounds}}}"#));
        for n in -1200..=1200 {
            assert_eq!(
                m.accepts(&n.to_string()),
                lo <= n && n <= hi,
                "{bounds} on {n}"
            );
        }
    }
}

/// 16 digits: the `integer` rule's limit.
const INT_MAX: i64 = 9_999_999_999_999_999;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn wide_integer_ranges_match_arithmetic(
        a in -INT_MAX..=INT_MAX,
        b in -INT_MAX..=INT_MAX,
        near in proptest::collection::vec(-3i64..=3, 8),
        anywhere in proptest::collection::vec(-INT_MAX..=INT_MAX, 8),
    ) {
        let (lo, hi) = (a.min(b), a.max(b));
        let mut m = Matcher::of_schema(&format!(
            r#"{{"type": "integer", "minimum": {lo}, "maximum": {hi}}}"#
        ));
        let mut probes: Vec<i64> = anywhere;
        for d in near {
            probes.extend([lo.saturating_add(d), hi.saturating_add(d), d]);
        }
        for n in probes {
            prop_assert_eq!(m.accepts(&n.to_string()), lo <= n && n <= hi, "[{}, {}] on {}", lo, hi, n);
        }
        prop_assert!(!m.accepts("10000000000000000"));
    }

    /// Whatever the schema, conversion ends in a grammar that parses or a typed error.
    #[test]
    fn any_schema_converts_or_is_refused(schema in schema_strategy()) {
        if let Ok(gbnf) = json_schema_to_gbnf(&schema) {
            match Grammar::parse(&gbnf) {
                Ok(_) | Err(GrammarError::LeftRecursion { .. }) => {}
                Err(e) => prop_assert!(false, "{}: {}\n{}", schema, e, gbnf),
            }
        }
    }
}

/// JSON texts built from schema keywords, with values of the right and the wrong kinds.
fn schema_strategy() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("{}".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        Just(r#"{"type": "string", "maxLength": 3}"#.to_owned()),
        Just(r#"{"type": ["integer", "null"], "minimum": -7}"#.to_owned()),
        Just(r#"{"enum": ["a", 1, null, {"k": [1.5]}]}"#.to_owned()),
        Just(r#"{"const": "a\"\\b"}"#.to_owned()),
        Just(r##"{"$ref": "#"}"##.to_owned()),
        Just(r##"{"$ref": "#/$defs/d"}"##.to_owned()),
        Just(r##"{"$ref": "#/properties/p"}"##.to_owned()),
        Just(r#"{"format": "date"}"#.to_owned()),
        Just(r#"{"type": "number", "minimum": 1}"#.to_owned()),
        Just(r#"{"minItems": 2}"#.to_owned()),
        Just("7".to_owned()),
        Just(r#"{"type": 7}"#.to_owned()),
        Just(r#"{"required": ["x", 1]}"#.to_owned()),
    ];
    leaf.prop_recursive(4, 48, 4, |inner| {
        let list = proptest::collection::vec(inner.clone(), 0..4).prop_map(|v| v.join(", "));
        prop_oneof![
            (list.clone(), proptest::bool::ANY).prop_map(|(items, any)| format!(
                r#"{{"{}": [{items}]}}"#,
                if any { "anyOf" } else { "allOf" }
            )),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!(
                r#"{{"type": "object", "properties": {{"p": {a}, "": {b}, "q~/": {a}}}, "required": ["p", "r"], "additionalProperties": {b}}}"#
            )),
            (inner.clone(), list.clone()).prop_map(|(a, l)| format!(
                r#"{{"prefixItems": [{l}], "items": {a}, "maxItems": 5}}"#
            )),
            (inner.clone(), inner.clone()).prop_map(|(a, d)| format!(
                r#"{{"$defs": {{"d": {d}}}, "items": {a}}}"#
            )),
            (inner.clone(), inner).prop_map(|(a, b)| format!(
                r#"{{"type": ["object", "array"], "items": {a}, "additionalProperties": {b}}}"#
            )),
        ]
    })
}

#[test]
fn the_layout_is_llama_cpps() {
    // Required first in property order, then the optional ones; one space at most.
    let mut m = Matcher::of_schema(
        r#"{"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "boolean"},
            "c": {"type": "null"}, "d": {"type": "number"}}, "required": ["d", "a"]}"#,
    );
    for ok in [
        r#"{"a": true, "d": 1}"#,
        r#"{"a":true,"d":1.5e3,"b":2}"#,
        r#"{ "a" : false , "d" : 0 , "c" : null } "#,
        r#"{"a": true, "d": 1, "b": 2, "c": null}"#,
    ] {
        assert!(m.accepts(ok), "{ok}");
    }
    for bad in [
        r#"{"d": 1, "a": true}"#,
        r#"{"a": true, "d": 1, "c": null, "b": 2}"#,
        r#"{"a":  true, "d": 1}"#,
        "{\"a\":\ntrue, \"d\": 1}",
        r#"{"a": true, "d": 1, "e": 2}"#,
    ] {
        assert!(!m.accepts(bad), "{bad}");
    }
    let gbnf = json_schema_to_gbnf(r#"{"type": "string"}"#).unwrap();
    assert!(gbnf.starts_with("root ::= string\n"), "{gbnf}");
    assert!(gbnf.contains("space ::= \" \"?\n"), "{gbnf}");
}

#[test]
fn additional_keys_are_never_declared_names() {
    let mut m = Matcher::of_schema(
        r#"{"properties": {"ab": {"type": "integer"}, "a": {"type": "integer"},
            "é\"": {"type": "integer"}}, "additionalProperties": {"type": "string"}}"#,
    );
    for ok in [
        r#"{"b": "x"}"#,
        r#"{"abc": "x"}"#,
        r#"{"": "x"}"#,
        r#"{"ac": "x", "b\n": "y"}"#,
        r#"{"ab": 1, "x": "y"}"#,
        r#"{"é": "x"}"#,
        r#"{"\u00e9\"": 1}"#,
    ] {
        assert!(m.accepts(ok), "{ok}");
    }
    for bad in [
        r#"{"ab": "x"}"#,
        r#"{"a": "x"}"#,
        r#"{"\u0061": "x"}"#,
        r#"{"a\u0062": "x"}"#,
        r#"{"é\"": "x"}"#,
        r#"{"b": 1}"#,
        // Valid, but spelt with an escape before it parts from `é"`: not written.
        r#"{"é\"x": "y"}"#,
    ] {
        assert!(!m.accepts(bad), "{bad}");
    }
}

#[test]
fn refusals_name_the_keyword_and_where_it_is() {
    let cases = [
        (
            r#"{"properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}}"#,
            "json schema keyword 'pattern' at #/properties/code is not supported: regular \
             expressions are not converted; list the values with enum, or pass a GBNF grammar \
             with grammar=",
        ),
        (
            r#"{"type": "string", "format": "email"}"#,
            "json schema keyword 'format' at # is not supported: format 'email' is not built; \
             the formats written are date, time, date-time and uuid",
        ),
        (
            r#"{"type": "object", "properties": {"price": {"type": "number", "minimum": 0}}}"#,
            "json schema keyword 'minimum' at #/properties/price is not supported: bounds are \
             written for integers only; use type integer, or leave it out",
        ),
        (
            r#"{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}"#,
            "json schema keyword 'uniqueItems' at # is not supported: the converter does not \
             write it into grammar for type array",
        ),
        (
            r#"{"type": "integer", "multipleOf": 5}"#,
            "json schema keyword 'multipleOf' at # is not supported: multiples are not written \
             into grammar",
        ),
        (
            r#"{"not": {"type": "null"}}"#,
            "json schema keyword 'not' at # is not supported: the converter does not write it \
             into grammar",
        ),
        (
            r##"{"$defs": {"a/b": {"$ref": "other.json#/x"}}, "items": {"$ref": "#/$defs/a~1b"}}"##,
            "json schema keyword '$ref' at #/$defs/a~1b is not supported: 'other.json#/x' is \
             not in this document; only references within it ('#/$defs/name') are resolved",
        ),
        (
            r##"{"$ref": "#/$defs/x", "type": "object"}"##,
            "json schema keyword 'type' at # is not supported: keywords beside $ref are not \
             combined with it; move it inside",
        ),
        (
            r#"{"allOf": [{"type": "string"}, {"maxLength": 3}]}"#,
            "json schema keyword 'allOf' at #/allOf/0 is not supported: allOf is combined only \
             over object schemas (type, properties, required)",
        ),
        (
            r#"{"allOf": [{"properties": {"a": {"type": "string"}}, "additionalProperties": false},
                {"properties": {"b": {}}}]}"#,
            "json schema keyword 'additionalProperties' at #/allOf/0 is not supported: inside \
             allOf it would forbid the other components' properties",
        ),
        (
            r#"{"type": "array", "maxItems": 5000}"#,
            "json schema keyword 'maxItems' at # is not supported: 5000 is past 2000, llama.cpp's \
             limit on a grammar repetition",
        ),
        (
            r#"{"type": "object", "patternProperties": {"^x": {}}}"#,
            "json schema keyword 'patternProperties' at # is not supported: the converter does \
             not write it into grammar for type object",
        ),
    ];
    for (schema, want) in cases {
        assert_eq!(error(schema), want, "{schema}");
    }
    let e = json_schema_to_gbnf(r#"{"pattern": "x"}"#).unwrap_err();
    assert!(matches!(
        &e,
        GrammarError::SchemaUnsupported { keyword, path, .. } if keyword == "pattern" && path == "#"
    ));
    // The bindings raise this one as UnsupportedError (a feature not built), other grammar
    // errors as GrammarError.
    assert!(matches!(
        crate::EngineError::from(e),
        crate::EngineError::Grammar(GrammarError::SchemaUnsupported { .. })
    ));
}

#[test]
fn schemas_that_cannot_be_read_are_invalid() {
    let cases = [
        (
            "{\"type\": ",
            "json schema at #: expected JSON text, got EOF while parsing a value at line 1 column 9",
        ),
        (
            r#"{"type": "text"}"#,
            "json schema at #/type: expected a type name (object, array, string, number, integer, \
             boolean, null) or a list of them, got \"text\"",
        ),
        (
            r##"{"items": {"$ref": "#/$defs/missing"}}"##,
            "json schema at #/items/$ref: expected a reference to a part of the schema ('#' has no \
             '$defs'), got '#/$defs/missing'",
        ),
        (
            r#"{"properties": {"a": {"type": "integer"}}, "required": ["b"],
                "additionalProperties": false}"#,
            "json schema at #/required: expected required properties that the object may have \
             ('b' is not in properties, and no other keys are allowed), got 'b'",
        ),
        (
            r#"{"type": "integer", "minimum": 5, "maximum": 4.5}"#,
            "json schema at #: expected integer bounds that some integer of at most 16 digits is \
             within, got none from 5 to 4",
        ),
        (
            r#"{"type": "string", "minLength": 3, "maxLength": 2}"#,
            "json schema at #/maxLength: expected at least minLength (3), got 2",
        ),
        (
            r#"{"type": "string", "minLength": -1}"#,
            "json schema at #/minLength: expected a whole number of at least 0, got -1",
        ),
        (
            r#"{"type": "string", "enum": [1, 2]}"#,
            "json schema at #: expected an enum with a value of the schema's type, got none",
        ),
        (
            "false",
            "json schema at #: expected a schema some value satisfies, got false",
        ),
        (
            r#"{"anyOf": []}"#,
            "json schema at #/anyOf: expected a non-empty list of schemas, got []",
        ),
    ];
    for (schema, want) in cases {
        assert_eq!(error(schema), want, "{schema}");
    }
}

#[test]
fn hostile_schemas_end_in_errors() {
    // Nested past serde_json's limit; recursion with no character between; a $ref cycle in
    // allOf; a long property name (one rule per character, no deep nesting).
    let deep = format!("{}{}", r#"{"items": "#.repeat(200), "}".repeat(200));
    assert!(
        error(&deep).contains("recursion limit exceeded"),
        "{}",
        error(&deep)
    );
    for schema in [
        r##"{"$ref": "#"}"##,
        r##"{"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}"##,
    ] {
        let gbnf = json_schema_to_gbnf(schema).unwrap();
        assert!(matches!(
            Grammar::parse(&gbnf),
            Err(GrammarError::LeftRecursion { .. })
        ));
    }
    let cycle = r##"{"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}, {"properties": {"x": {}}}]}},
        "$ref": "#/$defs/a"}"##;
    let mut m = Matcher::of_schema(cycle);
    assert!(m.accepts(r#"{"x": {}}"#));
    let long = "k".repeat(5000);
    let mut m = Matcher::of_schema(&format!(
        r#"{{"properties": {{"{long}": {{"type": "null"}}}}, "additionalProperties": true}}"#
    ));
    assert!(m.accepts(&format!(r#"{{"{long}": null}}"#)));
    assert!(!m.accepts(&format!(r#"{{"{long}": {{}}}}"#)));
    assert!(m.accepts(&format!(r#"{{"{long}k": {{}}}}"#)));
    // Many properties, a key given many times: linear work.
    let props: Vec<String> = (0..5000)
        .map(|i| format!(r#""p{i}": {{"type": "null"}}"#))
        .collect();
    let many = format!(
        r#"{{"properties": {{{}}}, "additionalProperties": {{"type": "integer"}}, {}"x": 1}}"#,
        props.join(", "),
        r#""x": 1, "#.repeat(50_000)
    );
    let mut m = Matcher::of_schema(&many);
    assert!(m.accepts(r#"{"p7": null, "p4999": null, "p5000": 3}"#));
    assert!(!m.accepts(r#"{"p7": null, "p4999": 3}"#));
}

#[test]
fn response_formats() {
    let grammar = |f: &str| Grammar::for_response_format(f).map_err(|e| e.to_string());
    assert_eq!(grammar(r#"{"type": "text"}"#), Ok(None));
    let json = grammar(r#"{"type": "json_object"}"#).unwrap().unwrap();
    assert_eq!(json.source(), JSON_GBNF);
    let plain = grammar(r#"{"type": "json_object", "schema": null}"#)
        .unwrap()
        .unwrap();
    assert_eq!(plain.source(), JSON_GBNF);
    let schema =
        r#"{"type": "object", "properties": {"z": {"type": "integer"}, "a": {"const": 1}}}"#;
    let want = json_schema_to_gbnf(schema).unwrap();
    let llama = grammar(&format!(r#"{{"type": "json_object", "schema": {schema}}}"#));
    assert_eq!(llama.unwrap().unwrap().source(), want);
    let openai = grammar(&format!(
        r#"{{"type": "json_schema", "json_schema": {{"name": "r", "strict": true, "schema": {schema}}}}}"#
    ));
    assert_eq!(openai.unwrap().unwrap().source(), want);
    let bare = grammar(r#"{"type": "json_schema", "json_schema": {"name": "r"}}"#);
    assert_eq!(bare.unwrap().unwrap().source(), JSON_GBNF);
    for (f, want) in [
        (
            r#"{"type": "json_schema"}"#,
            "response_format[\"json_schema\"]: expected an object with the schema, such as \
             {\"name\": \"reply\", \"schema\": {...}}, got nothing",
        ),
        (
            r#"{"type": "yaml"}"#,
            "response_format type 'yaml' is not supported: expected 'json_object', 'json_schema' \
             or 'text'",
        ),
        (
            r#"{}"#,
            "response_format type (none given) is not supported: expected 'json_object', \
             'json_schema' or 'text'",
        ),
        (
            r#"{"type": "json_object", "schema": {"pattern": "a+"}}"#,
            "json schema keyword 'pattern' at # is not supported: regular expressions are not \
             converted; list the values with enum, or pass a GBNF grammar with grammar=",
        ),
        (
            r#"["json_object"]"#,
            "response_format: expected an object such as {\"type\": \"json_object\"}, got \
             [\"json_object\"]",
        ),
    ] {
        assert_eq!(grammar(f).unwrap_err(), want, "{f}");
    }
}

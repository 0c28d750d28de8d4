"""Write tests/data/json_schema_reference.json: JSON schemas, llama.cpp's grammar for each, and
strings labelled valid or invalid, for the engine's converter test
(`crates/weightlift-engine/src/grammar/schema_tests.rs`).

llama.cpp's grammars come from its Python converter as llama-cpp-python 0.3.36 ships it
(`json_schema_to_gbnf` in `llama_cpp/llama_grammar.py`, read straight out of the sdist, whose
sha256 is checked; the module needs nothing but the standard library):

    .venv/bin/python tests/gen_json_schema_reference.py \\
        .cache/wheels/llama_cpp_python-0.3.36.tar.gz tests/data/json_schema_reference.json

(`make vocab` downloads that sdist.) Every string is labelled by hand: `valid` says whether it
is JSON that satisfies the schema (formats checked). When the `jsonschema` package is importable
(it is not in requirements-dev.txt; `pip install jsonschema rfc3339-validator` into any venv),
each label is checked with it, format checks on, and the file records the version used.

Each string also says whether our grammar takes it (`ours`) and whether llama.cpp's does
(`llama_cpp`), and `why` where they part or where a valid string is left out:

- `both`: valid and both take it; `neither`: invalid and both refuse it;
- `layout`: valid, and both leave it out (key order, whitespace, number length, llama.cpp's
  reading of an empty schema as an object): a grammar for generation need not take every
  instance, only never take a wrong one;
- `differ`: the grammars part, with the reason; ours never takes an invalid string.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
import tarfile
import types
from pathlib import Path
from typing import Any

SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MODULE = "llama_cpp_python-0.3.36/llama_cpp/llama_grammar.py"

UUID = "123e4567-e89b-12d3-a456-426614174000"

# name, schema, then lists of strings: `both` (valid, both take), `neither` (invalid, both
# refuse), `layout` (valid, both refuse: (text, why)), `differ` ((text, valid, ours, llama_cpp,
# why)).
CASES: list[dict[str, Any]] = [
    {
        "name": "object_required_optional",
        "schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "email": {"type": "string"},
            },
            "required": ["name", "age"],
        },
        "both": [
            '{"name": "Ann", "age": 30}',
            '{"name":"Ann","age":30,"email":"a@b.c"}',
            '{ "name" : "x" , "age" : -5 , "email" : "" } ',
            '{"name": "\\u00e9\\n\\"", "age": 0}',
            '{"name": "é世", "age": 1234567890123456}',
        ],
        "neither": [
            '{"name": "Ann"}',
            '{"name": "Ann", "age": "30"}',
            '{"name": "Ann", "age": 3.5}',
            '{"name": "Ann", "age": 30,}',
            '{"name": Ann, "age": 1}',
            '{"name": "Ann", "age": 30} {}',
        ],
        "layout": [
            ('{"age": 30, "name": "Ann"}', "properties come in schema order, required first"),
            ('{"name": "Ann", "age": 30, "nick": "A"}', "no other keys beside properties"),
            ('{"name":  "Ann", "age": 30}', "at most one space"),
            ('{\n"name": "Ann", "age": 30}', "no newlines"),
            ('{"name": "Ann", "age": 12345678901234567}', "at most 16 digits"),
        ],
        "differ": [
            ('{"name": "a\tb", "age": 1}', False, False, True, "a raw tab: not JSON"),
        ],
    },
    {
        "name": "optional_only",
        "schema": {
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "b": {"type": "integer"},
                "c": {"type": "integer"},
            },
        },
        "both": [
            "{}",
            '{"b": 2}',
            '{"a": 1, "c": 3}',
            '{"a": 1, "b": 2, "c": 3}',
        ],
        "neither": ['{"a": 1,}', '{,"a": 1}', '{"a": "1"}', '{"a": 1 "b": 2}'],
        "layout": [('{"c": 3, "a": 1}', "properties come in schema order")],
    },
    {
        "name": "array_items_bounds",
        "schema": {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string"},
                    "minItems": 1,
                    "maxItems": 3,
                }
            },
            "required": ["tags"],
        },
        "both": ['{"tags": ["a"]}', '{"tags": ["a", "b", "c"]}', '{"tags":[ "a" ,"b" ]}'],
        "neither": [
            '{"tags": []}',
            '{"tags": ["a", "b", "c", "d"]}',
            '{"tags": [1]}',
            '{"tags": "a"}',
        ],
        "layout": [('{"tags": ["a",  "b"]}', "at most one space")],
    },
    {
        "name": "enum_const",
        "schema": {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", 1, None, {"k": [1.5, True]}]},
                "kind": {"const": "fixed"},
            },
            "required": ["color", "kind"],
        },
        "both": [
            '{"color": "red", "kind": "fixed"}',
            '{"color":1,"kind":"fixed"}',
            '{"color": null, "kind": "fixed"}',
            '{"color": {"k": [1.5, true]}, "kind": "fixed"}',
        ],
        "neither": [
            '{"color": "blue", "kind": "fixed"}',
            '{"color": "red", "kind": "other"}',
            '{"color": "red"}',
            '{"color": 2, "kind": "fixed"}',
        ],
        "layout": [
            ('{"color": "red" , "kind": "fixed"}', "no space after an enum value"),
            ('{"color": "red", "kind": "fixed" }', "no space after a const value"),
            ('{"color": {"k":[1.5,true]}, "kind": "fixed"}', "values spelt as json.dumps"),
        ],
    },
    {
        "name": "escaped_const",
        "schema": {"const": "C:\\temp"},
        "both": [],
        "neither": ['"C:/temp"'],
        "differ": [
            (
                '"C:\\\\temp"',
                True,
                True,
                False,
                "llama.cpp's literal leaves json.dumps's backslash unescaped",
            ),
            ('"C:\\temp"', False, False, True, "so it takes \\t, a tab, instead"),
        ],
    },
    {
        "name": "type_list_keeps_keywords",
        "schema": {"type": ["string", "null"], "maxLength": 3},
        "both": ['"abc"', "null", '""', '"a\\"b"', '"😀😀😀"'],
        "neither": ["1", "true", "[]", '"abc'],
        "differ": [
            ('"abcd"', False, False, True, "llama.cpp's drops maxLength in a type list"),
        ],
    },
    {
        "name": "any_of",
        "schema": {
            "anyOf": [
                {"type": "integer"},
                {"type": "boolean"},
                {
                    "type": "object",
                    "properties": {"x": {"type": "number"}},
                    "required": ["x"],
                },
            ]
        },
        "both": ["5", "-12", "true", '{"x": 1.5e3}', '{"x": -0.25E-2}', '{"x": 1.5e+3}'],
        "neither": ['"5"', '{"y": 1}', "[]", "null", '{"x": "1"}', "01"],
        "layout": [
            ('{"x": 1, "y": 2}', "no other keys beside properties"),
            ('{"x": 1e05}', "exponents without leading zeros"),
        ],
    },
    {
        "name": "one_of_formats",
        "schema": {
            "oneOf": [
                {"type": "string", "format": "date"},
                {"type": "string", "format": "uuid"},
                {"type": "null"},
            ]
        },
        "both": [
            '"2024-02-29"',
            '"2000-02-29"',
            '"1999-12-31"',
            '"0001-01-01"',
            '"123e4567-E89B-12d3-a456-426614174000"',
            "null",
        ],
        "neither": [
            '"2024-13-01"',
            '"2024-1-01"',
            '"123e4567e89b12d3a456426614174000"',
            '"tomorrow"',
            "2024",
        ],
        "differ": [
            ('"2023-02-29"', False, False, True, "llama.cpp's takes any day 01-31"),
            ('"1900-02-29"', False, False, True, "llama.cpp's takes any day 01-31"),
            ('"2024-04-31"', False, False, True, "llama.cpp's takes any day 01-31"),
            ('"0000-01-01"', False, False, True, "Python's dates start at year 1"),
        ],
    },
    {
        "name": "date_time_formats",
        "schema": {
            "type": "object",
            "properties": {
                "day": {"type": "string", "format": "date"},
                "at": {"type": "string", "format": "time"},
                "ts": {"type": "string", "format": "date-time"},
            },
            "required": ["day", "at", "ts"],
        },
        "both": [
            '{"day": "2024-05-01", "at": "12:30:00Z", "ts": "2024-05-01T12:30:00.123+02:00"}',
            '{"day": "2024-05-31", "at": "23:59:59.999-11:30", "ts": "2024-02-29T00:00:00Z"}',
        ],
        "neither": [
            '{"day": "2024-05-01", "at": "24:00:00Z", "ts": "2024-05-01T12:30:00Z"}',
            '{"day": "2024-05-01", "at": "12:30:00", "ts": "2024-05-01T12:30:00Z"}',
            '{"day": "2024-05-01", "at": "12:30:00Z", "ts": "2024-05-01"}',
        ],
        "layout": [
            (
                '{"day": "2024-05-01", "at": "12:30:00.5Z", "ts": "2024-05-01T12:30:00Z"}',
                "fractions of a second have 3 digits",
            ),
        ],
        "differ": [
            (
                '{"day": "2024-05-01", "at": "12:30:00Z", "ts": "2023-02-29T12:30:00Z"}',
                False,
                False,
                True,
                "llama.cpp's takes any day 01-31",
            ),
        ],
    },
    {
        "name": "additional_false",
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
            "additionalProperties": False,
        },
        "both": ["{}", '{"a": 1}', '{"b": true}', '{"a": 1, "b": false}'],
        "neither": ['{"c": 1}', '{"a": 1, "c": 2}', '{"a": true}'],
        "layout": [('{"b": true, "a": 1}', "properties come in schema order")],
    },
    {
        "name": "additional_schema",
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": {"type": "string"},
        },
        "both": ['{"b": "x", "c": "y"}', "{}", '{"ab": "x"}', '{"": "x"}'],
        "neither": ['{"b": 1}', '{"a": 1, "b": 2}', '{"a": 1, "a": "x"}'],
        "layout": [('{"b": "x", "a": 1}', "declared properties come first")],
        "differ": [
            # llama-cpp-python 0.3.36's object rule: `a-kv a-rest | additional-kvs` with
            # `a-rest ::= additional-kvs`, so after a declared property it wants other keys, and
            # no comma before them.
            ('{"a": 1, "b": "x"}', True, True, False, "llama.cpp's wants no comma before b"),
            ('{"a": 1}', True, True, False, "llama.cpp's wants another key after a"),
            ('{"a": 1"b": "x"}', False, False, True, "the comma it leaves out: not JSON"),
            ('{"a": "x"}', False, False, True, "llama.cpp's takes a declared name as another key"),
            ('{"b": "x", "a": "y"}', False, False, True, "the same"),
            (
                '{"\\u0062": "x"}',
                True,
                False,
                True,
                "ours writes another key without escapes until it parts from the declared names",
            ),
        ],
    },
    {
        "name": "additional_true",
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": True,
        },
        "both": ['{"b": {"c": [1, "x"]}}', '{"b": {}, "c": {}}'],
        "neither": ['{"a": "1"}'],
        "layout": [('{"b": 1}', "llama.cpp reads an empty schema (true) as any object")],
        "differ": [
            ('{"a": 1, "b": {}}', True, True, False, "llama.cpp's wants no comma before b"),
            ('{"a": 1}', True, True, False, "llama.cpp's wants another key after a"),
            ('{"a": {}}', False, False, True, "llama.cpp's takes a declared name as another key"),
        ],
    },
    {
        "name": "required_undeclared",
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a", "b"],
        },
        "both": [],
        "neither": ['{"b": 1}'],
        "layout": [('{"b": 1, "a": 1}', "properties come in schema order")],
        "differ": [
            ('{"a": 1}', False, False, True, "llama.cpp's leaves out required names it lacks"),
            ('{"a": 1, "b": "anything"}', True, True, False, "the same"),
            ('{"a": 1, "b": [1, {"c": null}]}', True, True, False, "the same"),
        ],
    },
    {
        "name": "recursive_defs",
        "schema": {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "integer"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["value"],
                }
            },
            # Not `$ref` at the top: llama-cpp-python 0.3.36's converter then fails (KeyError)
            # on the reference inside, never reaching the `$defs` beside it.
            "type": "object",
            "properties": {"tree": {"$ref": "#/$defs/node"}},
            "required": ["tree"],
        },
        "both": [
            '{"tree": {"value": 1}}',
            '{"tree": {"value": 1, "children": []}}',
            '{"tree": {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}, '
            '{"value": 4}]}}',
        ],
        "neither": [
            '{"tree": {"value": 1, "children": [{}]}}',
            '{"tree": {"children": []}}',
            '{"tree": {"value": 1, "children": [1]}}',
            '{"tree": null}',
        ],
    },
    {
        "name": "definitions_minimum",
        "schema": {
            "definitions": {"pos": {"type": "integer", "minimum": 1}},
            "type": "array",
            "items": {"$ref": "#/definitions/pos"},
        },
        "both": ["[1, 2, 300]", "[]", "[ 9999999999999999 ]"],
        "neither": ['["1"]', "[1, 2,]", "[1.5]"],
        "differ": [
            ("[0]", False, False, True, "llama.cpp's ignores minimum"),
            ("[-1]", False, False, True, "the same"),
        ],
    },
    {
        "name": "integer_ranges",
        "schema": {
            "type": "object",
            "properties": {
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "temp": {"type": "integer", "exclusiveMinimum": -40, "exclusiveMaximum": 50},
            },
            "required": ["age", "temp"],
        },
        "both": [
            '{"age": 0, "temp": -39}',
            '{"age": 120, "temp": 49}',
            '{"age": 37, "temp": 0}',
        ],
        "neither": ['{"age": 007, "temp": 0}', '{"age": 5}'],
        "differ": [
            ('{"age": 121, "temp": 0}', False, False, True, "llama.cpp's ignores maximum"),
            ('{"age": -1, "temp": 0}', False, False, True, "llama.cpp's ignores minimum"),
            ('{"age": 5, "temp": -40}', False, False, True, "it ignores exclusiveMinimum"),
            ('{"age": 5, "temp": 50}', False, False, True, "it ignores exclusiveMaximum"),
            ('{"age": -0, "temp": 0}', True, False, True, "ours does not write -0"),
        ],
    },
    {
        "name": "string_lengths",
        "schema": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "minLength": 2, "maxLength": 4},
                "id": {"type": "string", "format": "uuid"},
            },
            "required": ["code", "id"],
        },
        "both": [
            f'{{"code": "ab", "id": "{UUID}"}}',
            f'{{"code": "a\\"bc", "id": "{UUID}"}}',
            f'{{"code": "éé", "id": "{UUID}"}}',
            f'{{"code": "\\u00e9\\n", "id": "{UUID}"}}',
        ],
        "neither": [
            f'{{"code": "a", "id": "{UUID}"}}',
            f'{{"code": "abcde", "id": "{UUID}"}}',
            '{"code": "ab", "id": "xyz"}',
        ],
        "differ": [
            (
                f'{{"code": "a\x01b", "id": "{UUID}"}}',
                False,
                False,
                True,
                "a raw control character: not JSON",
            ),
            (
                f'{{"code": "\\ud83d\\ude00", "id": "{UUID}"}}',
                False,
                False,
                True,
                "one character, escaped as two: llama.cpp's counts two",
            ),
            (
                f'{{"code": "\\ud83d\\ude00x", "id": "{UUID}"}}',
                True,
                False,
                True,
                "ours writes no surrogate escapes where length counts",
            ),
        ],
    },
    {
        "name": "tuple",
        "schema": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
        "both": ['["a", 1]', '[ "a" , 1 ]'],
        "neither": ['[1, "a"]', '["a", "b"]'],
        "layout": [
            ('["a", 1, 2]', "exactly the tuple when items is not given"),
            ('["a"]', "the whole tuple"),
            ("[]", "the whole tuple"),
        ],
    },
    {
        "name": "prefix_then_items",
        "schema": {
            "type": "array",
            "prefixItems": [{"type": "string"}],
            "items": {"type": "integer"},
            "maxItems": 3,
        },
        "both": [],
        "neither": ['["a", "b"]', '["a", 1, 2, 3]'],
        "differ": [
            ('["a"]', True, True, False, "llama.cpp's uses items alone, dropping prefixItems"),
            ('["a", 1]', True, True, False, "the same"),
            ('["a", 1, 2]', True, True, False, "the same"),
            ("[1]", False, False, True, "the same"),
            ("[1, 2, 3]", False, False, True, "the same"),
        ],
    },
    {
        "name": "all_of",
        "schema": {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "boolean"}}},
            ]
        },
        "both": ['{"a": "x", "b": true}'],
        "neither": ['{"b": true}', '{"a": 1, "b": true}', '{"a": "x", "b": 1}'],
        "differ": [
            ('{"a": "x"}', True, True, False, "llama.cpp's makes every allOf property required"),
        ],
    },
    {
        "name": "enum_type_filter",
        "schema": {"type": "string", "enum": ["a", "b", 1]},
        "both": ['"a"', '"b"'],
        "neither": ['"c"', "a"],
        "differ": [("1", False, False, True, "llama.cpp's keeps enum values of another type")],
    },
    {
        "name": "empty_schema",
        "schema": {},
        "both": ["{}", '{"a": [1, "x", null]}', '{"a": {"b": -1.5}}'],
        "neither": ['{"a": }'],
        "layout": [
            ("1", "llama.cpp reads an empty schema as any object"),
            ('"x"', "the same"),
            ("[]", "the same"),
        ],
    },
]


def load_converter(sdist: Path) -> types.ModuleType:
    """llama-cpp-python's `llama_grammar` module, run from the sdist (standard library only)."""
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"{sdist}: expected sha256 {SDIST_SHA256}, got {digest}")
    with tarfile.open(sdist, "r:gz") as tf:
        member = tf.extractfile(MODULE)
        assert member is not None, f"no {MODULE} in {sdist}"
        source = member.read().decode()
    module = types.ModuleType("llama_grammar")
    exec(compile(source, MODULE, "exec"), module.__dict__)
    return module


def instances(case: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for text in case.get("both", []):
        out.append({"text": text, "valid": True, "ours": True, "llama_cpp": True, "why": ""})
    for text in case.get("neither", []):
        out.append({"text": text, "valid": False, "ours": False, "llama_cpp": False, "why": ""})
    for text, why in case.get("layout", []):
        out.append({"text": text, "valid": True, "ours": False, "llama_cpp": False, "why": why})
    for text, valid, ours, theirs, why in case.get("differ", []):
        assert valid or not ours, f"{case['name']}: {text!r}: ours takes an invalid string"
        out.append({"text": text, "valid": valid, "ours": ours, "llama_cpp": theirs, "why": why})
    return out


def check_labels(case: dict[str, Any], insts: list[dict[str, Any]]) -> bool:
    """Checks each `valid` label with the jsonschema package; False when it is not installed."""
    try:
        import jsonschema
    except ImportError:
        return False
    cls = jsonschema.validators.validator_for(case["schema"], jsonschema.Draft202012Validator)
    validator = cls(case["schema"], format_checker=cls.FORMAT_CHECKER)
    for inst in insts:
        try:
            value = json.loads(inst["text"])
        except json.JSONDecodeError:
            valid = False
        else:
            valid = validator.is_valid(value)
        assert valid == inst["valid"], f"{case['name']}: {inst['text']!r}: jsonschema says {valid}"
    return True


def main() -> int:
    sdist, out = Path(sys.argv[1]), Path(sys.argv[2])
    converter = load_converter(sdist)
    cases = []
    checked = True
    for case in CASES:
        text = json.dumps(case["schema"])
        insts = instances(case)
        checked = check_labels(case, insts) and checked
        cases.append(
            {
                "name": case["name"],
                "schema": text,
                "llama_cpp_gbnf": converter.json_schema_to_gbnf(text),
                "instances": insts,
            }
        )
    labels = (
        f"checked with jsonschema {importlib.metadata.version('jsonschema')}, formats on"
        if checked
        else "by hand (jsonschema not installed)"
    )
    doc = {
        "about": (
            "JSON schemas with llama.cpp's grammars for them (llama-cpp-python 0.3.36's "
            "json_schema_to_gbnf) and labelled strings; written by "
            "tests/gen_json_schema_reference.py"
        ),
        "labels": labels,
        "cases": cases,
    }
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    n = sum(len(c["instances"]) for c in cases)
    print(f"wrote {out}: {len(cases)} schemas, {n} strings, labels {labels}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

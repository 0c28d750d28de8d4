"""JSON schemas as grammars from Python: `LlamaGrammar.from_json_schema` and `response_format`
schemas (llama-cpp-python's `{"type": "json_object", "schema": ...}` and OpenAI's
`{"type": "json_schema", "json_schema": {...}}`), end to end on the demo model.

Which strings a schema's grammar takes is checked in the engine, against strings labelled by
hand (and by the `jsonschema` package) and against llama.cpp's own converter
(`tests/data/json_schema_reference.json`, from `tests/gen_json_schema_reference.py`). Here the
replies are checked against the schemas by hand: each check below is the schema's rule written
out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import weightlift as wl

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with their name and age."}]


def check_person(reply: Any) -> None:
    """PERSON's rules, one by one."""
    assert isinstance(reply, dict), reply
    assert set(reply) <= {"name", "age", "pet"} and {"name", "age"} <= set(reply), reply
    assert isinstance(reply["name"], str) and 1 <= len(reply["name"]) <= 12, reply
    age = reply["age"]
    assert isinstance(age, int) and not isinstance(age, bool) and 0 <= age <= 120, reply
    assert reply.get("pet") in ("cat", "dog", None), reply


@pytest.fixture(scope="module")
def model(demo_gguf: Path) -> wl.Model:
    return wl.load_gguf(demo_gguf, n_ctx=512, seed=7)


def test_from_json_schema_writes_llama_cpps_layout() -> None:
    g = wl.LlamaGrammar.from_json_schema(json.dumps(PERSON))
    lines = g.text.splitlines()
    # Required properties in schema order, then the optional one; at most one space.
    assert lines[0] == 'root ::= "{" space name-kv "," space age-kv ("," space pet-kv)? "}" space'
    assert 'space ::= " "?' in lines
    assert 'pet ::= "\\"cat\\"" | "\\"dog\\"" | "null"' in lines
    assert wl.LlamaGrammar.from_json_schema('{"type": "boolean"}', verbose=False).text == (
        'root ::= boolean\nboolean ::= ("true" | "false") space\nspace ::= " "?\n'
    )


def test_from_json_schema_refuses_by_keyword_and_place() -> None:
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}}
    with pytest.raises(wl.UnsupportedError) as e:
        wl.LlamaGrammar.from_json_schema(json.dumps(schema))
    assert str(e.value) == (
        "json schema keyword 'pattern' at #/properties/code is not supported: regular "
        "expressions are not converted; list the values with enum, or pass a GBNF grammar with "
        "grammar="
    )
    with pytest.raises(wl.GrammarError) as e:
        wl.LlamaGrammar.from_json_schema("{'type': 'object'}")
    assert isinstance(e.value, ValueError)
    assert str(e.value) == (
        "json schema at #: expected JSON text, got key must be a string at line 1 column 2"
    )
    with pytest.raises(wl.GrammarError, match=r"json schema at #/\$ref: expected a reference"):
        wl.LlamaGrammar.from_json_schema('{"$ref": "#/$defs/missing"}')


def test_response_format_schema_constrains_the_reply(model: wl.Model) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 64}
    openai = {"name": "person", "schema": PERSON, "strict": True}
    for response_format in [
        {"type": "json_object", "schema": PERSON},
        {"type": "json_schema", "json_schema": openai},
    ]:
        r = model.create_chat_completion(ASK, response_format=response_format, **greedy)
        choice = r["choices"][0]
        # The grammar ends the reply: a bounded name, age and pet, so no length cut-off.
        assert choice["finish_reason"] == "stop", choice
        check_person(json.loads(choice["message"]["content"]))
    # Sampled replies keep to it too, and so does a completion with the grammar object.
    grammar = wl.LlamaGrammar.from_json_schema(json.dumps(PERSON))
    for seed in range(3):
        r = model.create_completion(
            "A person as JSON:", grammar=grammar, temperature=1.0, seed=seed, max_tokens=64
        )
        assert r["choices"][0]["finish_reason"] == "stop", r
        check_person(json.loads(r["choices"][0]["text"]))


def test_response_format_errors(model: wl.Model) -> None:
    with pytest.raises(wl.UnsupportedError, match="keyword 'format' at #/properties/mail"):
        model.create_chat_completion(
            ASK,
            response_format={
                "type": "json_object",
                "schema": {"properties": {"mail": {"type": "string", "format": "email"}}},
            },
        )
    with pytest.raises(wl.PlanError, match=r'response_format\["json_schema"\]: expected an obj'):
        model.create_chat_completion(ASK, response_format={"type": "json_schema"})
    with pytest.raises(wl.UnsupportedError, match="type 'yaml' is not supported"):
        model.create_chat_completion(ASK, response_format={"type": "yaml"})
    # What is not JSON-like data is a TypeError naming where it sits (a set reads as a list).
    with pytest.raises(TypeError, match="response_format.schema: unsupported type object"):
        model.create_chat_completion(
            ASK, response_format={"type": "json_object", "schema": object()}
        )

"""Write crates/weightlift-text/tests/data/tool_templates.json: chat templates of tool-using
models rendered with tools, tool calls and tool results, and those of the families the engine
runs rendered with turns, a system message and reasoning, as llama-cpp-python 0.3.36 renders
them.

The templates are the ones llama.cpp ships in models/templates/, read from the llama-cpp-python
0.3.36 sdist (`make vocab` fetches it, sha256 checked). The environment is the one that
version's `Jinja2ChatFormatter` builds (jinja2's ImmutableSandboxedEnvironment with trim_blocks,
lstrip_blocks, loop controls and a pass-through `generation` tag; transformers' `tojson`;
`raise_exception`, `strftime_now`; `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `tools`, `tool_choice` in the context), so the Rust test compares our rendering
with theirs. Only jinja2 is needed:

    python3 -m venv /tmp/jvenv && /tmp/jvenv/bin/pip install jinja2
    /tmp/jvenv/bin/python crates/weightlift-text/tests/gen_tool_templates.py \
        .cache/wheels/llama_cpp_python-0.3.36.tar.gz \
        crates/weightlift-text/tests/data/tool_templates.json
"""

from __future__ import annotations

import json
import sys
import tarfile
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
TOOL_CASES = ["tool call", "tool result", "no tools"]
PLAIN_CASES = ["no tools", "turns"]
# name: (bos, eos, the cases it renders). Qwen3's and the plain templates are the families the
# engine runs (Qwen3 and its MoE, Phi-3.5/Phi-4-style, Gemma 2 and 3, and Mixtral's [INST]
# form, which Mistral Nemo's template shares); Qwen3's also drops earlier turns' reasoning.
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("<|endoftext|>", "<|im_end|>", TOOL_CASES),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": (
        "<|begin_of_text|>",
        "<|eot_id|>",
        TOOL_CASES,
    ),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>", TOOL_CASES),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("<s>", "</s>", [*TOOL_CASES, "turns"]),
    "Qwen-Qwen3-0.6B.jinja": ("<|endoftext|>", "<|im_end|>", [*TOOL_CASES, "turns", "reasoning"]),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("<s>", "<|endoftext|>", [*PLAIN_CASES, "system"]),
    "google-gemma-2-2b-it.jinja": ("<bos>", "<eos>", PLAIN_CASES),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city — now",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]

CALL = {
    "id": "abc123xyz",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}

CASES = {
    "tool call": {
        "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": "auto",
    },
    "tool result": {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {
                "role": "tool",
                "tool_call_id": "abc123xyz",
                "name": "get_weather",
                "content": '{"temperature": 21, "unit": "celsius"}',
            },
        ],
        "tools": TOOLS,
        "tool_choice": None,
    },
    "no tools": {
        "messages": [{"role": "user", "content": "Hello"}],
        "tools": None,
        "tool_choice": None,
    },
    "turns": {
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another, with an accent: é?"},
        ],
        "tools": None,
        "tool_choice": None,
    },
    "system": {
        "messages": [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour."},
        ],
        "tools": None,
        "tool_choice": None,
    },
    "reasoning": {
        "messages": [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4."},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        "tools": None,
        "tool_choice": None,
    },
}


class IgnoreGenerationTags(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):  # type: ignore[no-untyped-def]
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # type: ignore[no-untyped-def]
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def render(template: str, bos: str, eos: str, case: dict) -> str:
    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[IgnoreGenerationTags, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    compiled = env.from_string(template)
    kwargs = {"tools": case["tools"], "tool_choice": case["tool_choice"]}
    return compiled.render(
        messages=case["messages"],
        eos_token=eos,
        bos_token=bos,
        raise_exception=raise_exception,
        add_generation_prompt=True,
        strftime_now=lambda f: datetime(2026, 11, 28).strftime(f),
        **{k: v for k, v in kwargs.items() if v is not None},
    )


def main(sdist: str, out: str) -> None:
    entries = []
    with tarfile.open(sdist) as tar:
        for name, (bos, eos, cases) in TEMPLATES.items():
            member = tar.extractfile(PREFIX + name)
            assert member is not None, name
            template = member.read().decode()
            for case_name in cases:
                case = CASES[case_name]
                entries.append(
                    {
                        "template_name": name,
                        "case": case_name,
                        "template": template,
                        "bos_token": bos,
                        "eos_token": eos,
                        **case,
                        "rendered": render(template, bos, eos, case),
                    }
                )
    with open(out, "w", encoding="utf-8") as f:
        json.dump(
            {
                "source": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp/models/templates",
                "renderer": f"jinja2 {jinja2.__version__}, as Jinja2ChatFormatter sets it up",
                "strftime_now": "2026-11-28 00:00:00 UTC (unix 1795824000)",
                "cases": entries,
            },
            f,
            ensure_ascii=False,
            indent=1,
        )
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

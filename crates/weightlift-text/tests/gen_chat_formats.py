"""Write ``tests/data/chat_formats.json``: the prompts and stop strings that llama-cpp-python's
built-in chat formats (``Llama(chat_format=NAME)``) make of a few conversations.

Nothing here is weightlift code: every prompt is the output of the formatter llama-cpp-python
0.3.36 registers under the name (``llama_cpp.llama_chat_format``), found through its handler
registry. Run it with an interpreter that has llama-cpp-python 0.3.36 installed::

    python crates/weightlift-text/tests/gen_chat_formats.py

The output is the same on every run.
"""

from __future__ import annotations

import json
from pathlib import Path

import llama_cpp
import llama_cpp.llama_chat_format as chat_format

OUT = Path(__file__).resolve().parent / "data" / "chat_formats.json"

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Why?"},
    ],
    [{"role": "user", "content": "Name three colours."}],
    [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two"},
        {"role": "user", "content": "Three"},
    ],
    # a second system message, an empty assistant turn, a tool message the formats drop
    [
        {"role": "system", "content": "First."},
        {"role": "system", "content": "Second."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "ok"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "x"}],
]


def formatter(name: str):
    """The formatter function a registered chat format's handler wraps."""
    handler = chat_format.LlamaChatCompletionHandlerRegistry().get_chat_completion_handler_by_name(
        name
    )
    cells = [c.cell_contents for c in handler.__closure__ or ()]
    found = [c for c in cells if callable(c)]
    assert len(found) == 1, (name, cells)
    return found[0]


def main() -> None:
    names = [
        "chatml",
        "qwen",
        "llama-2",
        "llama-3",
        "mistral-instruct",
        "gemma",
        "zephyr",
        "alpaca",
        "vicuna",
        "openchat",
        "pygmalion",
        "redpajama-incite",
        "snoozy",
        "chatglm3",
        "baichuan",
        "baichuan-2",
        "oasst_llama",
        "mistrallite",
        "saiga",
    ]
    formats = {}
    for name in names:
        f = formatter(name)
        cases = []
        for messages in CONVERSATIONS:
            r = f(messages=messages)
            stop = r.stop if isinstance(r.stop, list) or r.stop is None else [r.stop]
            cases.append(
                {
                    "messages": messages,
                    "prompt": r.prompt,
                    "stop": stop,
                    "added_special": bool(r.added_special),
                }
            )
        formats[name] = cases
    doc = {"llama_cpp_python": llama_cpp.__version__, "formats": formats}
    OUT.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

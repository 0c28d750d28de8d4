"""Write tests/data/llama_metadata.json: what llama-cpp-python's ``Llama`` reports of a GGUF's
metadata and which chat format it picks, for the demo model and the family fixtures, and the
prompt it makes with a template a GGUF names (``tokenizer.chat_template.NAME``).

Run with a llama-cpp-python 0.3.36 venv (see benches/engine_load.py for how to build one):

    .cache/bench/llama-venv/bin/python tests/gen_llama_metadata.py \
        .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf tests/data/llama_metadata.json

Everything recorded is llama-cpp-python's own output:
- ``models``: ``Llama(path, vocab_only=True)``'s ``metadata``, ``chat_format`` (its guess
  from the template, ``chat_template.default``, or the ``llama-2`` fallback), ``token_bos()``
  and ``token_eos()`` (llama.cpp's defaults for the tokenizer model where the GGUF has none);
- ``guesses``: ``guess_chat_format_from_gguf_metadata`` on each template it knows by heart, and
  on one that differs from the first by a trailing space;
- ``named_template``: the prompt and ids of the chat handler llama-cpp-python registers for a
  ``tokenizer.chat_template.NAME`` key (a ``Jinja2ChatFormatter`` over the template, with the
  vocabulary's BOS and EOS texts, then ``tokenize(add_bos=not added_special, special=True)``),
  for the tiny-qwen2 vocabulary and a template written here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llama_cpp
from llama_cpp import Llama
from llama_cpp import llama_chat_format as chat_format

DATA = Path(__file__).resolve().parent / "data"
FIXTURES = [
    "tiny-qwen2/tiny-qwen2-F16.gguf",
    "tiny-qwen3/tiny-qwen3-F16.gguf",
    "tiny-gemma2/tiny-gemma2-F16.gguf",
    "tiny-phi3/tiny-phi3-F16.gguf",
    "tiny-mixtral/tiny-mixtral-F16.gguf",
]
KNOWN = [
    "CHATML_CHAT_TEMPLATE",
    "MISTRAL_INSTRUCT_CHAT_TEMPLATE",
    "MIXTRAL_INSTRUCT_CHAT_TEMPLATE",
    "LLAMA3_INSTRUCT_CHAT_TEMPLATE",
]
# A template of our own for the named-template case: the vocabulary's BOS and EOS texts show
# that the formatter got them.
NAMED_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + eos_token "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)
NAMED_MESSAGES = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 2 + 2?"},
]


def described(path: str) -> dict[str, object]:
    llm = Llama(path, vocab_only=True, verbose=False)
    return {
        "metadata": llm.metadata,
        "chat_format": llm.chat_format,
        "token_bos": llm.token_bos(),
        "token_eos": llm.token_eos(),
    }


def named_prompt(path: str) -> dict[str, object]:
    llm = Llama(path, vocab_only=True, verbose=False)
    text = llm._model.token_get_text
    eos_id, bos_id = llm.token_eos(), llm.token_bos()
    fmt = chat_format.Jinja2ChatFormatter(
        template=NAMED_TEMPLATE,
        eos_token=text(eos_id) if eos_id != -1 else "",
        bos_token=text(bos_id) if bos_id != -1 else "",
        stop_token_ids=[eos_id],
    )
    r = fmt(messages=NAMED_MESSAGES)
    ids = llm.tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True)
    return {"prompt": r.prompt, "ids": ids}


def main(demo: str, out: str) -> None:
    models = {"demo": described(demo)}
    for rel in FIXTURES:
        models[rel] = described(str(DATA / rel))
    guesses = []
    for name in KNOWN:
        template = getattr(chat_format, name)
        for t in (template, template + " ") if name == KNOWN[0] else (template,):
            meta = {"tokenizer.chat_template": t}
            guesses.append(
                {"template": t, "guess": chat_format.guess_chat_format_from_gguf_metadata(meta)}
            )
    named = {
        "model": FIXTURES[0],
        "name": "tool_use",
        "template": NAMED_TEMPLATE,
        "messages": NAMED_MESSAGES,
        **named_prompt(str(DATA / FIXTURES[0])),
    }
    doc = {
        "source": f"llama-cpp-python {llama_cpp.__version__}: Llama(vocab_only=True).metadata "
        "and .chat_format, guess_chat_format_from_gguf_metadata, and the Jinja2ChatFormatter "
        "handler of a tokenizer.chat_template.NAME key",
        "models": models,
        "guesses": guesses,
        "named_template": named,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Write tests/data/smollm2_chat.json: the prompt ids llama-cpp-python builds for chat
completions on the SmolLM2 demo model, from the chat template in the GGUF.

Run with a llama-cpp-python 0.3.36 venv (see benches/engine_load.py for how to build one):

    .cache/bench/llama-venv/bin/python tests/gen_chat_reference.py \
        .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf tests/data/smollm2_chat.json

It uses llama-cpp-python's own chat path (`Jinja2ChatFormatter` over `tokenizer.chat_template`,
then `Llama.tokenize(..., add_bos=not added_special, special=True)`), so the test compares our
template rendering and tokenization with theirs.
"""

from __future__ import annotations

import json
import sys

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with an accent: é?"},
    ],
]


def main(model: str, out: str) -> None:
    llm = Llama(model, n_ctx=256, vocab_only=True, verbose=False)
    meta = llm.metadata
    template = meta["tokenizer.chat_template"]
    bos = llm._model.token_get_text(llm.token_bos())
    eos = llm._model.token_get_text(llm.token_eos())
    fmt = Jinja2ChatFormatter(template=template, bos_token=bos, eos_token=eos)
    cases = []
    for messages in CONVERSATIONS:
        r = fmt(messages=messages)
        ids = llm.tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True)
        cases.append({"messages": messages, "prompt": r.prompt, "ids": ids})
    doc = {
        "source": f"llama-cpp-python {llama_cpp.__version__}, Jinja2ChatFormatter over the GGUF's "
        "tokenizer.chat_template, then Llama.tokenize(add_bos=not added_special, special=True)",
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (the demo model)",
        "cases": cases,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Write tests/data/llama_api.json: what llama-cpp-python's smaller ``Llama`` methods return on
the SmolLM2 demo model, for the tests of the same methods on weightlift's ``Llama``.

Run with a llama-cpp-python 0.3.36 venv (see benches/engine_load.py for how to build one):

    .cache/bench/llama-venv/bin/python tests/gen_llama_api.py \
        .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf tests/data/llama_api.json

Recorded, all llama-cpp-python's own output:
- ``pooling_type``: ``Llama(...).pooling_type()`` for a few constructor keywords;
- ``logprobs``: ``Llama.logits_to_logprobs`` on a few arrays (``-inf`` entries, a row of them);
- ``prefix``: ``Llama.longest_token_prefix`` on a few pairs;
- ``tokenizer``: ``Llama.tokenizer()``'s ``encode``, ``decode``, ``tokenize`` and
  ``detokenize`` (whose defaults differ from ``Llama.tokenize``'s);
- ``eval_tokens``: ``list(llm.eval_tokens)`` after an ``eval``.
"""

from __future__ import annotations

import json
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama

POOLING = [{}, {"embedding": True}, {"embedding": True, "pooling_type": 1}, {"pooling_type": 3}]
LOGITS = [
    [1.0, 2.0, float("-inf"), 0.5],
    [[1.0, 2.0], [3.0, 3.0], [float("-inf"), float("-inf")]],
    [[100.0, -100.0, 0.0], [1e-3, 2e-3, 3e-3]],
]
PREFIXES = [([1, 2, 3], [1, 2, 4]), ([], [1]), ([5, 6], [5, 6, 7]), ([9], [8])]
TEXT = "Hi <|im_start|>user\nCafé ☕"


def main(model: str, out: str) -> None:
    pooling = []
    for kw in POOLING:
        llm = Llama(model, n_ctx=64, verbose=False, **kw)
        pooling.append({"kwargs": kw, "pooling_type": int(llm.pooling_type())})
    logprobs = [{"logits": x, "logprobs": Llama.logits_to_logprobs(x).tolist()} for x in LOGITS]
    prefix = [{"a": a, "b": b, "n": Llama.longest_token_prefix(a, b)} for a, b in PREFIXES]
    llm = Llama(model, n_ctx=64, verbose=False)
    tok = llm.tokenizer()
    ids = tok.encode(TEXT)
    coffee = tok.encode("☕", add_bos=False)
    tokenizer = {
        "text": TEXT,
        "encode": ids,
        "encode_plain": tok.encode(TEXT, add_bos=False, special=False),
        "tokenize": tok.tokenize(TEXT.encode()),
        "decode": tok.decode(ids),
        "detokenize_special": tok.detokenize(ids, special=True).decode(),
        "cut": coffee[:-1],
        "decode_cut": tok.decode(coffee[:-1]),
    }
    llm.eval(llm.tokenize(b"Hello world"))
    doc = {
        "source": f"llama-cpp-python {llama_cpp.__version__} on the demo model",
        "numpy": np.__version__,
        "pooling_type": pooling,
        "logprobs": logprobs,
        "prefix": prefix,
        "tokenizer": tokenizer,
        "eval_tokens": list(llm.eval_tokens),
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Write tests/data/smollm2_logprobs.json: what llama-cpp-python returns for `logprobs` on the
SmolLM2 demo model (greedy completions, echo, a stream, a chat completion), so the tests can
compare our dicts' keys, types and values with theirs.

Run with a llama-cpp-python 0.3.36 venv (see benches/engine_load.py for how to build one):

    .cache/bench/llama-venv/bin/python tests/gen_logprobs_reference.py \
        .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf tests/data/smollm2_logprobs.json

`logits_all=True` is what llama-cpp-python needs to report logprobs at all. The response ids,
timestamps and model paths are dropped: they differ on every run. Values are written as JSON
numbers; the Python type each one had is recorded in `types` (llama-cpp-python's whole
completion returns numpy float32 logprobs, its stream Python floats).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from llama_cpp import Llama

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def strip(response: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in response.items() if k not in ("id", "created", "model")}


def plain(value: Any, types: dict[str, set[str]], path: str = "") -> Any:
    """`value` as JSON, noting the type of every leaf (list items as `[]`, token texts as `*`)."""
    if isinstance(value, dict):
        # A completion's top_logprobs are keyed by token text.
        by_text = path.endswith("logprobs.top_logprobs[]")
        return {k: plain(v, types, f"{path}.{'*' if by_text else k}") for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v, types, f"{path}[]") for v in value]
    types.setdefault(path, set()).add(type(value).__name__)
    return float(value) if type(value).__name__ == "float32" else value


def main(model: str, out: str) -> None:
    llm = Llama(model, n_ctx=256, logits_all=True, seed=7, verbose=False)
    greedy = {"temperature": 0.0, "max_tokens": 8, "stop": ["\n\n"]}
    cases = {
        "completion": llm.create_completion(PROMPT, logprobs=3, **greedy),
        "completion_n0": llm.create_completion(PROMPT, logprobs=0, **greedy),
        "echo": llm.create_completion(PROMPT, logprobs=2, echo=True, **greedy),
        "stream": list(llm.create_completion(PROMPT, logprobs=3, stream=True, **greedy)),
        "chat": llm.create_chat_completion(
            CHAT, logprobs=True, top_logprobs=3, temperature=0.0, max_tokens=6
        ),
        "chat_stream": list(
            llm.create_chat_completion(
                CHAT, logprobs=True, top_logprobs=3, temperature=0.0, max_tokens=6, stream=True
            )
        ),
    }
    types: dict[str, set[str]] = {}
    stripped = {
        k: [strip(c) for c in v] if isinstance(v, list) else strip(v) for k, v in cases.items()
    }
    record = {
        "engine": "llama-cpp-python 0.3.36 (llama.cpp CPU, logits_all=True, n_ctx=256)",
        "prompt": PROMPT,
        "prompt_ids": llm.tokenize(PROMPT.encode(), add_bos=True, special=True),
        "chat_messages": CHAT,
        "cases": plain(stripped, types),
        "types": {k: sorted(v) for k, v in types.items()},
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Write tests/data/grammar_reference.json: llama-cpp-python's greedy grammar-constrained
completions on the SmolLM2 demo model, and llama.cpp's grammar masks along them.

Run with a llama-cpp-python 0.3.36 venv (see benches/engine_load.py for how to build one):

    .cache/bench/llama-venv/bin/python tests/gen_grammar_reference.py \
        .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf tests/data/grammar_reference.json

For every case it records:

- `text` and `finish_reason`: what `create_completion(..., temperature=0, grammar=...)` (or
  `create_chat_completion(..., response_format={"type": "json_object"})`) returns;
- `ids`: the tokens `Llama.generate` samples for the same prompt and grammar (the loop
  `create_completion` runs), the final end-of-generation token included when there is one;
- `masks`: before each of those tokens, which tokens llama.cpp's grammar sampler
  (`llama_sampler_init_grammar`, then `llama_sampler_apply` over the whole vocabulary) leaves
  allowed. End-of-generation tokens (llama.cpp's set is `eog`) are recorded apart, as
  `eog_allowed`, since the grammar treats them apart; for the others, their count, and the ids
  themselves when there are few (else the ids it forbids when those are few, else `fnv1a64`: the
  64-bit FNV-1a hash of the allowed ids written as comma-separated decimals, in hex; a checksum
  any test can recompute without a library), and `margin`: llama.cpp's logit of the token it
  chose minus the largest logit of any other token the grammar allowed (null when it allowed no
  other), from a second `Llama(logits_all=True)` run over the same ids. Where that margin is
  near 0, another engine's rounding may pick the other token, and the tests say so.

Each prompt is run whole (no prefix reuse between calls). So the tests compare our text with
llama.cpp's, and our masks with llama.cpp's masks token by
token, independently of the logits.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

import llama_cpp
from llama_cpp import Llama, LlamaGrammar
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from llama_cpp.llama_grammar import JSON_GBNF

# A mask is written out as a list when it has at most this many ids.
LISTED = 40

CASES: list[dict[str, Any]] = [
    {
        "name": "choice",
        "prompt": "Question: Is the sky blue on a clear day? Answer yes or no.\nAnswer: ",
        "grammar": 'root ::= "yes" | "no"',
        "max_tokens": 8,
    },
    {
        "name": "number",
        "prompt": "The boiling point of water in degrees Fahrenheit is",
        "grammar": 'root ::= " "? "-"? [0-9]+ ("." [0-9]+)?',
        "max_tokens": 8,
    },
    {
        "name": "json_record",
        "prompt": "A JSON record of a famous scientist: ",
        "grammar": "\n".join(
            [
                'root ::= "{" ws "\\"name\\":" ws string "," ws "\\"born\\":" ws year ws "}"',
                'string ::= "\\"" [A-Za-z .]{1,30} "\\""',
                "year ::= [0-9]{4}",
                'ws ::= " "?',
            ]
        ),
        "max_tokens": 40,
    },
    {
        "name": "list",
        "prompt": "Three fruits:\n",
        "grammar": "\n".join(
            [
                "# two or three capitalised items, one per line",
                "root ::= item{2,3}",
                'item ::= "- " [A-Z] [a-z]{2,12} "\\n"',
            ]
        ),
        "max_tokens": 30,
    },
    {
        "name": "quote",
        "prompt": "A famous quote: ",
        "grammar": 'root ::= "\\"" [^"\\n]{1,60} "\\""',
        "max_tokens": 30,
    },
    {
        "name": "chat_json_object",
        "messages": [
            {
                "role": "user",
                "content": "Describe a cat as a JSON object with a name and an age.",
            }
        ],
        "response_format": {"type": "json_object"},
        "max_tokens": 40,
    },
]


def eog_ids(llm: Llama) -> list[int]:
    vocab = llm._model.vocab
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    return [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def describe_mask(allowed: list[int], n_vocab: int, eog: list[int]) -> dict[str, Any]:
    eog_allowed = {i in allowed for i in eog}
    assert len(eog_allowed) == 1, "end-of-generation tokens are allowed all or none"
    allowed = [i for i in allowed if i not in eog]
    others = [i for i in range(n_vocab) if i not in eog]
    entry: dict[str, Any] = {"eog_allowed": eog_allowed.pop(), "n_allowed": len(allowed)}
    if len(allowed) <= LISTED:
        entry["allowed"] = allowed
    elif len(others) - len(allowed) <= LISTED:
        allowed_set = set(allowed)
        entry["forbidden"] = [i for i in others if i not in allowed_set]
    else:
        entry["fnv1a64"] = fnv1a64(",".join(str(i) for i in allowed).encode())
    return entry


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def masks(llm: Llama, grammar: str, ids: list[int], rows: Any) -> list[dict[str, Any]]:
    """llama.cpp's grammar sampler over the whole vocabulary before each of `ids`; `rows[i]` are
    the logits `ids[i]` was chosen from."""
    vocab = llm._model.vocab
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    eog = eog_ids(llm)
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    assert sampler, "llama.cpp refused the grammar"
    data = (llama_cpp.llama_token_data * n_vocab)()
    out = []
    try:
        for token in ids:
            for i in range(n_vocab):
                data[i].id = i
                data[i].logit = 0.0
                data[i].p = 0.0
            arr = llama_cpp.llama_token_data_array(
                data=ctypes.cast(data, llama_cpp.llama_token_data_p),
                size=n_vocab,
                selected=-1,
                sorted=False,
            )
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(arr))
            allowed = [data[i].id for i in range(n_vocab) if data[i].logit != float("-inf")]
            assert token in allowed, (token, "was sampled but is not allowed")
            entry = describe_mask(sorted(allowed), n_vocab, eog)
            row = rows[len(out)]
            others = [float(row[i]) for i in allowed if i != token]
            entry["margin"] = round(float(row[token]) - max(others), 4) if others else None
            out.append(entry)
            llama_cpp.llama_sampler_accept(sampler, token)
    finally:
        llama_cpp.llama_sampler_free(sampler)
    return out


def generated_ids(llm: Llama, prompt: list[int], grammar: str, max_tokens: int) -> list[int]:
    """The tokens `create_completion`'s loop samples: greedy, through the grammar."""
    ids: list[int] = []
    g = LlamaGrammar.from_string(grammar, verbose=False)
    llm.reset()
    for token in llm.generate(prompt, temp=0.0, grammar=g):
        ids.append(token)
        if llama_cpp.llama_token_is_eog(llm._model.vocab, token) or len(ids) == max_tokens:
            break
    return ids


def chat_prompt(llm: Llama, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids llama-cpp-python's chat path builds (as tests/gen_chat_reference.py)."""
    template = llm.metadata["tokenizer.chat_template"]
    bos = llm._model.token_get_text(llm.token_bos())
    eos = llm._model.token_get_text(llm.token_eos())
    r = Jinja2ChatFormatter(template=template, bos_token=bos, eos_token=eos)(messages=messages)
    return llm.tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True)


def logit_rows(scorer: Llama, prompt: list[int], ids: list[int]) -> Any:
    """The logits before each of `ids`, after `prompt`."""
    scorer.reset()
    scorer.eval(prompt + ids[:-1])
    return scorer.scores[len(prompt) - 1 : len(prompt) - 1 + len(ids)]


def main(model: str, out: str) -> None:
    llm = Llama(model, n_ctx=512, n_threads=2, seed=0, verbose=False)
    scorer = Llama(model, n_ctx=512, n_threads=2, seed=0, verbose=False, logits_all=True)
    results = []
    for case in CASES:
        entry = dict(case)
        # Every prompt runs whole, in one batch: reusing a cached prefix runs its last token
        # alone, which rounds differently and can flip a near tie.
        llm.reset()
        if "messages" in case:
            grammar = JSON_GBNF
            r = llm.create_chat_completion(
                case["messages"],
                response_format=case["response_format"],
                temperature=0.0,
                max_tokens=case["max_tokens"],
            )
            choice = r["choices"][0]
            entry["text"] = choice["message"]["content"]
            prompt = chat_prompt(llm, case["messages"])
        else:
            grammar = case["grammar"]
            r = llm.create_completion(
                case["prompt"],
                temperature=0.0,
                max_tokens=case["max_tokens"],
                grammar=LlamaGrammar.from_string(grammar, verbose=False),
            )
            choice = r["choices"][0]
            entry["text"] = choice["text"]
            prompt = llm.tokenize(case["prompt"].encode("utf-8"), special=True)
        entry["finish_reason"] = choice["finish_reason"]
        ids = generated_ids(llm, prompt, grammar, case["max_tokens"])
        shown = [t for t in ids if not llama_cpp.llama_token_is_eog(llm._model.vocab, t)]
        assert llm.detokenize(shown).decode("utf-8") == entry["text"], (ids, entry["text"])
        entry["ids"] = ids
        entry["masks"] = masks(llm, grammar, ids, logit_rows(scorer, prompt, ids))
        results.append(entry)
        print(f"{case['name']}: {entry['text']!r} ({entry['finish_reason']})", file=sys.stderr)
    doc = {
        "source": f"llama-cpp-python {llama_cpp.__version__}: create_completion / "
        "create_chat_completion with temperature=0 and a grammar, Llama.generate for the ids, "
        "llama_sampler_init_grammar + llama_sampler_apply over the whole vocabulary for the "
        "masks",
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (the demo model)",
        "json_gbnf": JSON_GBNF,
        "eog": eog_ids(llm),
        "cases": results,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

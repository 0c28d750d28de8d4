"""Gemma 2 and Gemma 3 (text) through the Python surface: the tiny models of
``tests/gen_gemma.py`` (``tests/data/tiny-gemma{2,3}``) tokenized from GGUF metadata and from
``tokenizer.json`` as sentencepiece and transformers tokenize, chatted with through gemma's chat
template, and generating transformers' greedy ids, from both formats, through the API and
``weightlift run --chat``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import weightlift as wl

DATA = Path(__file__).parent / "data"
FAMILIES = ["gemma3", "gemma2"]


def stats(family: str) -> dict:
    return json.loads((DATA / f"tiny-{family}" / "stats.json").read_text())


def load(family: str, fmt: str) -> wl.Model:
    """The model in exact compute with an f32 cache (transformers' arithmetic)."""
    folder = DATA / f"tiny-{family}"
    if fmt == "gguf":
        return wl.load_gguf(
            folder / f"tiny-{family}-F16.gguf",
            n_ctx=64,
            type_k="f32",
            type_v="f32",
            compute="exact",
            n_threads=2,
            verbose=False,
        )
    m = wl.Model(folder, compute="exact", n_threads=2)
    m.load(cache=wl.CacheSpec(64, 1, "f32"))
    return m


@pytest.fixture(scope="module", params=[(f, fmt) for f in FAMILIES for fmt in ("gguf", "st")])
def model(request) -> tuple[str, wl.Model]:
    family, fmt = request.param
    return family, load(family, fmt)


def test_sentencepiece_vocabulary_tokenizes_as_transformers(model) -> None:
    family, m = model
    s = stats(family)
    for text, ids in s["tokenize"].items():
        assert m.tokenize(text, add_bos=False, special=True) == ids, text
    # BOS first, as Gemma's tokenizer adds it (tokenizer.ggml.add_bos_token, tokenizer.json's
    # post-processor)
    assert m.tokenize(s["prompt"])[: len(s["ids"])] == s["ids"]
    assert m.token_bos() == 2 and m.token_eos() == 1


def test_generate_is_transformers_greedy_text(model) -> None:
    family, m = model
    s = stats(family)
    text = m.detokenize(s["ids"][1:])
    out = m.generate(text, max_new_tokens=len(s["greedy_ids"]))
    assert out == m.detokenize(s["greedy_ids"]), (out, s["greedy_text"])
    assert s["greedy_text"] == m.detokenize(s["greedy_ids"])


def test_chat_completion_uses_gemmas_template(model) -> None:
    family, m = model
    chat = stats(family)["chat"]
    n = len(chat["greedy_ids"])
    r = m.create_chat_completion(chat["messages"], max_tokens=n, temperature=0)
    # the rendered prompt is transformers' ids, BOS once
    assert r["usage"]["prompt_tokens"] == len(chat["prompt_ids"]), r["usage"]
    assert r["usage"]["completion_tokens"] == n
    assert r["choices"][0]["message"]["content"] == m.detokenize(chat["greedy_ids"])
    assert m.tokenize(chat["prompt"], add_bos=False, special=True) == chat["prompt_ids"]


def test_end_of_turn_ends_a_generation(model) -> None:
    """``<end_of_turn>`` (id 6) ends a turn by llama.cpp's end-of-generation rule: pushed to the
    top by a logit bias, the reply stops there, empty."""
    _, m = model
    r = m.create_chat_completion(
        [{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, logit_bias={6: 100.0}
    )
    assert r["choices"][0]["finish_reason"] == "stop", r
    assert r["choices"][0]["message"]["content"] == ""


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["gguf", "st"])
def test_run_chat_answers_transformers_greedy_reply(family: str, fmt: str) -> None:
    folder = DATA / f"tiny-{family}"
    path = folder / f"tiny-{family}-F16.gguf" if fmt == "gguf" else folder
    chat = stats(family)["chat"]
    [message] = chat["messages"]
    n = len(chat["greedy_ids"])
    p = subprocess.run(
        [sys.executable, "-m", "weightlift.cli", "run", str(path), "--chat", "-n", str(n)]
        + ["--temp", "0", "--ctx", "64", "--compute", "exact", "--threads", "2"]
        + ["-p", message["content"]],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "prompt eval time" in p.stderr, p.stderr
    # the reply's text as gemma's vocabulary spells transformers' greedy ids (the tokenizer
    # tests above hold it to sentencepiece and transformers)
    with wl.Model(folder) as m:
        reply = m.detokenize(chat["greedy_ids"])
    assert p.stdout == reply + "\n", (p.stdout, reply)


def test_sliding_layers_keep_rings_of_the_cells_the_plan_counts() -> None:
    """``Llama(n_ctx=1024, n_batch=32)`` on the tiny gemma3 (window 8): each of its five sliding
    layers keeps a ring of llama.cpp's SWA cells (8 + 32, padded to 256), which the plan counts
    and the cache holds, and a prompt of 600 tokens wraps them. A rewind past the window is
    refused by name; one within it is kept; ``generate(reset=True)`` with a prefix whose window
    is gone runs its tokens again from position 0."""
    llm = wl.Llama(
        str(DATA / "tiny-gemma3" / "tiny-gemma3-F16.gguf"),
        n_ctx=1024,
        n_batch=32,
        type_k="f32",
        type_v="f32",
        n_threads=2,
        verbose=False,
    )
    m = llm.model
    cache = m.cache
    kv = sum(d.kv for d in m.plan.devices)
    # K and V of one f32 kv head of 16: 5 rings of 256 rows and a full layer of 1024
    assert kv == (5 * 256 + 1024) * 16 * 4 * 2
    assert sum(cache.memory().values()) == kv
    ids = (stats("gemma3")["ids"] * 40)[:600]
    llm.eval(ids)
    assert llm.n_tokens == 600
    with pytest.raises(
        wl.PlanError,
        match="cache truncate to 100 tokens: layer 0 attends to a sliding window of 8 tokens "
        "and its cache keeps 256 positions, those from 344 on",
    ):
        cache.truncate(100)
    assert llm.n_tokens == 600
    cache.truncate(590)
    assert llm.n_tokens == 590
    tokens = [*ids[:50], 5, 6, 7]
    next(llm.generate(tokens, top_k=1, reset=True))
    assert list(llm.input_ids) == tokens


# ``tests/gen_vocab_gemma.py``: the same recipe's vocabulary at 3072 pieces, trained on llama.cpp's
# documentation, with no model; llama.cpp's own tokenizer test texts and more.
VOCAB = DATA / "vocab-gemma"


def vocab_reference() -> dict:
    return json.loads((VOCAB / "reference.json").read_text())


def test_a_vocabulary_of_thousands_tokenizes_from_gguf_as_llama_cpp() -> None:
    ref = vocab_reference()
    m = wl.Llama(str(VOCAB / "vocab-gemma.gguf"), vocab_only=True, verbose=False)
    assert m.n_vocab() == ref["vocab_size"] == 3072
    cases = zip(
        ref["texts"],
        ref["llamacpp"],
        ref["llamacpp_special"],
        ref["llamacpp_detokenized"],
        strict=True,
    )
    for text, plain, special, back in cases:
        data = text.encode()
        assert m.tokenize(data, add_bos=False, special=False) == plain, text
        assert m.tokenize(data, add_bos=False, special=True) == special, text
        assert list(m.detokenize(plain)) == back, text


def test_a_vocabulary_of_thousands_tokenizes_from_tokenizer_json_as_transformers() -> None:
    # a tokenizer's folder, with no weights, opens for its vocabulary as AutoTokenizer opens it
    ref = vocab_reference()
    m = wl.Llama(str(VOCAB), vocab_only=True, verbose=False)
    assert m.n_vocab() == ref["vocab_size"]
    for text, ids, pieces in zip(
        ref["texts"], ref["transformers"], ref["sentencepiece"], strict=True
    ):
        assert m.tokenize(text.encode(), add_bos=False, special=True) == ids == pieces, text
    assert m.tokenize(b"hi")[0] == m.token_bos() == 2 and m.token_eos() == 1

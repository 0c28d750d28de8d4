"""Text generation from Python: tokenize, generate, and llama-cpp-python's completion API, checked
against llama.cpp's greedy continuation (the shared reference data's `greedy.json`) and the
chat prompts llama-cpp-python builds (`tests/data/smollm2_chat.json`, from
`tests/gen_chat_reference.py`)."""

from __future__ import annotations

import _thread
import json
import os
import threading
from pathlib import Path

import pytest
import weightlift as wl
from conftest import DATA, REFERENCE

GREEDY = json.loads((REFERENCE / "smollm2-135m" / "greedy.json").read_text())
PROMPTS = json.loads((REFERENCE / "smollm2-135m" / "prompts.json").read_text())
CHAT = json.loads((DATA / "smollm2_chat.json").read_text())


@pytest.fixture(scope="module")
def model() -> wl.Model:
    path = os.environ.get("WEIGHTLIFT_DEMO_GGUF")
    assert path, "WEIGHTLIFT_DEMO_GGUF is not set: run the suite through `make test`"
    return wl.load_gguf(Path(path), n_ctx=256, seed=7)


def test_tokenize_matches_llamacpp_and_round_trips(model: wl.Model) -> None:
    for p in PROMPTS["prompts"].values():
        assert model.tokenize(p["text"]) == p["ids_llamacpp"]
        assert model.tokenize(p["text"].encode()) == p["ids_llamacpp"]
        assert model.detokenize(p["ids_llamacpp"]) == p["text"]
    # Special tokens are text unless asked for.
    assert model.tokenize("<|im_end|>", special=True) == [model.token_eos()]
    assert len(model.tokenize("<|im_end|>")) > 1
    assert model.detokenize([model.token_eos()]) == ""
    assert model.detokenize([model.token_eos()], special=True) == "<|im_end|>"


def test_greedy_generate_is_llamacpp_text(model: wl.Model) -> None:
    text = model.generate(GREEDY["prompt"], max_new_tokens=32)
    assert text == GREEDY["llamacpp"]["text"]
    pieces = list(model.generate(GREEDY["prompt"], max_new_tokens=32, stream=True))
    assert len(pieces) > 10 and "".join(pieces) == text
    assert model.generate(GREEDY["prompt_ids"], max_new_tokens=32) == text
    t = model.timings
    # The same prompt again: all but its last token came from the cache.
    assert t["reused_tokens"] == len(GREEDY["prompt_ids"]) - 1
    assert t["eval_tokens"] == 31 and t["eval_per_second"] > 0


def test_create_completion_returns_llamacpp_shaped_dicts(model: wl.Model) -> None:
    r = model.create_completion(GREEDY["prompt"], max_tokens=8, temperature=0, stop=["\n\n"])
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    (choice,) = r["choices"]
    assert choice == {"text": " Paris.", "index": 0, "logprobs": None, "finish_reason": "stop"}
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    echoed = model(GREEDY["prompt"], max_tokens=2, temperature=0, echo=True)
    assert echoed["choices"][0]["text"] == GREEDY["prompt"] + " Paris."
    assert echoed["choices"][0]["finish_reason"] == "length"

    chunks = list(model(GREEDY["prompt"], max_tokens=6, temperature=0, stream=True))
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    joined = "".join(c["choices"][0]["text"] for c in chunks)
    assert joined == model(GREEDY["prompt"], max_tokens=6, temperature=0)["choices"][0]["text"]


def test_a_seed_reproduces_a_sampled_completion(model: wl.Model) -> None:
    a = model("Once upon a time", max_tokens=12, seed=3)["choices"][0]["text"]
    b = model("Once upon a time", max_tokens=12, seed=3)["choices"][0]["text"]
    assert a == b
    # The model's seed (load_gguf(seed=7)) is the default.
    c = model("Once upon a time", max_tokens=12)["choices"][0]["text"]
    d = model("Once upon a time", max_tokens=12, seed=7)["choices"][0]["text"]
    assert c == d


def test_chat_prompts_are_llamacpp_prompts(model: wl.Model) -> None:
    for case in CHAT["cases"]:
        r = model.create_chat_completion(case["messages"], max_tokens=1, temperature=0)
        assert r["usage"]["prompt_tokens"] == len(case["ids"])
    # The ids themselves: generating greedily from them equals the chat call.
    case = CHAT["cases"][0]
    r = model.create_chat_completion(case["messages"], max_tokens=8, temperature=0)
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert msg["content"] == model.generate(case["ids"], max_new_tokens=8)

    chunks = list(
        model.create_chat_completion(case["messages"], max_tokens=8, temperature=0, stream=True)
    )
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant"} and deltas[-1] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]


def test_unsupported_arguments_and_bad_prompts_are_typed_errors(model: wl.Model) -> None:
    with pytest.raises(wl.UnsupportedError, match="grammar"):
        model("hi", grammar="root ::= x")
    with pytest.raises(wl.UnsupportedError, match="mirostat"):
        model("hi", mirostat_mode=2)
    with pytest.raises(wl.UnsupportedError, match="tool"):
        model.create_chat_completion([{"role": "user", "content": "hi"}], tools=[{}])
    with pytest.raises(wl.ContextFullError, match="300 tokens do not fit"):
        model.generate([504] * 300)
    with pytest.raises(wl.WeightliftError, match="vocabulary size 49152"):
        model.generate([49152])
    with pytest.raises(wl.WeightliftError, match="empty prompt"):
        model.generate([])
    with pytest.raises(wl.WeightliftError, match="temperature"):
        model.generate("hi", temperature=-1)
    with pytest.raises(TypeError, match="prompt"):
        model.generate(3.5)
    # Nothing was lost.
    assert model.generate(GREEDY["prompt"], max_new_tokens=2) == " Paris."


def test_ctrl_c_stops_a_generation_and_the_model_still_runs(model: wl.Model) -> None:
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            model.generate("Once upon a time", max_new_tokens=240, temperature=0.8)
    finally:
        timer.cancel()
    assert model.generate(GREEDY["prompt"], max_new_tokens=2) == " Paris."

"""Text generation from Python: tokenize, generate, and llama-cpp-python's completion API, checked
against llama.cpp's greedy continuation (the reference data's `greedy.json`) and the
chat prompts llama-cpp-python builds (`tests/data/smollm2_chat.json`, from
`tests/gen_chat_reference.py`)."""

from __future__ import annotations

import _thread
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import weightlift as wl
from conftest import DATA, ReferenceJson, engine_greedy_ids

GREEDY = ReferenceJson("smollm2-135m/greedy.json")
PROMPTS = ReferenceJson("smollm2-135m/prompts.json")
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
    # llama.cpp's 32 ids, or ids parting from a reference only at a near-tie (conftest), up to
    # the end-of-generation token, where generation stops
    ids = engine_greedy_ids(model)
    if ids == GREEDY["llamacpp"]["ids"]:
        assert model.detokenize(ids) == GREEDY["llamacpp"]["text"]
    n = ids.index(model.token_eos()) if model.token_eos() in ids else len(ids)
    text = model.generate(GREEDY["prompt"], max_new_tokens=32)
    assert text == model.detokenize(ids[:n])
    pieces = list(model.generate(GREEDY["prompt"], max_new_tokens=32, stream=True))
    assert len(pieces) > 10 and "".join(pieces) == text
    assert model.generate(GREEDY["prompt_ids"], max_new_tokens=32) == text
    t = model.timings
    # The same prompt again: all but its last token came from the cache.
    assert t["reused_tokens"] == len(GREEDY["prompt_ids"]) - 1
    # every token generated but the last is run
    assert t["eval_tokens"] == min(n, 31) and t["eval_per_second"] > 0


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


def test_seed_minus_one_draws_a_random_seed(model: wl.Model) -> None:
    # llama.cpp's and llama-cpp-python's "-1 for random": not the model's seed (7), so draws
    # flat enough to differ do differ
    flat = {"max_tokens": 12, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    seeded = model("Once upon a time", seed=7, **flat)["choices"][0]["text"]
    drawn = {model("Once upon a time", seed=-1, **flat)["choices"][0]["text"] for _ in range(4)}
    assert drawn != {seeded}
    for bad in (-2, 2**64):
        with pytest.raises(
            wl.PlanError, match=r"seed: expected an int from 0 to .*-1 for a random"
        ):
            model("Once upon a time", max_tokens=1, seed=bad)
    with pytest.raises(wl.PlanError, match="or -1 for a random seed, got -3"):
        wl.load_gguf(os.environ["WEIGHTLIFT_DEMO_GGUF"], vocab_only=True, seed=-3)
    assert wl.load_gguf(os.environ["WEIGHTLIFT_DEMO_GGUF"], vocab_only=True, seed=-1)


def test_chat_prompts_are_llamacpp_prompts(model: wl.Model) -> None:
    for case in CHAT["cases"]:
        r = model.create_chat_completion(case["messages"], max_tokens=1, temperature=0)
        assert r["usage"]["prompt_tokens"] == len(case["ids"])
    # The ids themselves: generating greedily from them equals the chat call. Each runs the
    # prompt whole on an empty cache: a prompt run in other pieces (the part a cached prefix
    # leaves) rounds its 8-bit activations otherwise, which may move a near-tie.
    case = CHAT["cases"][0]
    model.cache.reset()
    r = model.create_chat_completion(case["messages"], max_tokens=8, temperature=0)
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant"
    model.cache.reset()
    assert msg["content"] == model.generate(case["ids"], max_new_tokens=8)

    model.cache.reset()
    chunks = list(
        model.create_chat_completion(case["messages"], max_tokens=8, temperature=0, stream=True)
    )
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant"} and deltas[-1] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]


def test_unsupported_arguments_and_bad_prompts_are_typed_errors(model: wl.Model) -> None:
    with pytest.raises(wl.WeightliftError, match="tool_choice"):
        model.create_chat_completion(
            [{"role": "user", "content": "hi"}], tools=[{}], tool_choice={"type": "function"}
        )
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


# llama-cpp-python 0.3.36's logprobs dicts for the same calls (tests/gen_logprobs_reference.py).
LOGPROBS = json.loads((DATA / "smollm2_logprobs.json").read_text())
# Our fast path and llama.cpp's kernels round differently on the Q4_1 demo model: the largest
# gap measured between their log-probabilities on these calls is about 0.15.
LLAMACPP_ATOL = 0.3


def log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def greedy_reference(model: wl.Model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """`n` greedy tokens after `prompt` and the log-softmax rows of every position, run as a
    generation runs them (the prompt in one call, then one token per call) in a cache of its
    own, so the logits are the same numbers."""
    cache = wl.Cache(model, max_seq_len=64)
    rows = [model.forward(prompt, cache=cache, logits="all").reshape(len(prompt), -1)]
    tokens = [int(np.argmax(rows[-1][-1]))]
    while len(tokens) < n:
        rows.append(model.forward([tokens[-1]], cache=cache).reshape(1, -1))
        tokens.append(int(np.argmax(rows[-1][-1])))
    return tokens, log_softmax(np.concatenate(rows))


def check_shape_like_llamacpp(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs) == {"tokens", "text_offset", "token_logprobs", "top_logprobs"}
    for key in ("tokens", "text_offset"):
        assert all(type(v) is type(w) for v, w in zip(ours[key], theirs[key], strict=False))
    # llama-cpp-python's whole completion gives numpy float32 values, its stream Python floats;
    # ours are Python floats everywhere.
    assert all(v is None or type(v) is float for v in ours["token_logprobs"])
    for top in ours["top_logprobs"]:
        assert top is None or all(type(k) is str and type(v) is float for k, v in top.items())


def test_min_tokens_hold_back_the_end_of_generation(model: wl.Model) -> None:
    # llama-cpp-python's server's min_tokens (transformers' min_new_tokens): the
    # end-of-generation token waits until that many tokens. Greedy, so up to where the end came,
    # the text is the one without it. (Each compared call reuses the same prompt prefix from the
    # cache, so each has the same bits.) A stop string and the budget still end it sooner.
    chat = [{"role": "user", "content": "Say hi"}]
    model.create_chat_completion(chat, max_tokens=96, temperature=0)
    plain = model.create_chat_completion(chat, max_tokens=96, temperature=0)
    n = plain["usage"]["completion_tokens"]
    assert plain["choices"][0]["finish_reason"] == "stop" and n <= 80  # it ends by itself
    longer = model.create_chat_completion(chat, max_tokens=96, temperature=0, min_tokens=n + 10)
    assert longer["usage"]["completion_tokens"] >= n + 10
    said = plain["choices"][0]["message"]["content"]
    assert longer["choices"][0]["message"]["content"].startswith(said)
    assert len(longer["choices"][0]["message"]["content"]) > len(said)
    capped = model.create_chat_completion(chat, max_tokens=n + 4, temperature=0, min_tokens=n + 10)
    assert capped["usage"]["completion_tokens"] == n + 4
    assert capped["choices"][0]["finish_reason"] == "length"

    prompt = "One, two, three,"
    model.create_completion(prompt, max_tokens=16, temperature=0)
    free = model.create_completion(prompt, max_tokens=16, temperature=0)["choices"][0]["text"]
    assert "," in free
    cut = model.create_completion(prompt, max_tokens=16, temperature=0, stop=",", min_tokens=12)
    assert cut["choices"][0]["text"] == free[: free.index(",")]
    assert cut["choices"][0]["finish_reason"] == "stop"
    # transformers' word says the same: a chat prompt's reply, then one held past its end
    ended = []
    for case in CHAT["cases"]:
        model.generate(case["ids"], max_new_tokens=64)
        reply = model.generate(case["ids"], max_new_tokens=64)
        if len(model.tokenize(reply)) < 48:  # it ended by itself
            ended.append((case["ids"], reply))
    assert ended, "no reference chat reply ends within 48 tokens"
    ids, reply = ended[0]
    held = model.generate(ids, max_new_tokens=64, min_new_tokens=60)
    assert held.startswith(reply) and len(held) > len(reply)
    with pytest.raises(ValueError, match="min_tokens: expected 0 or more, got -1"):
        model.create_completion(prompt, max_tokens=8, min_tokens=-1)


def test_completion_logprobs_are_the_log_softmax_of_the_logits(model: wl.Model) -> None:
    prompt = LOGPROBS["prompt"]
    ids = model.tokenize(prompt)
    r = model.create_completion(
        prompt, logprobs=3, echo=True, temperature=0, max_tokens=8, stop=["\n\n"]
    )
    lp = r["choices"][0]["logprobs"]
    generated, ref = greedy_reference(model, ids, r["usage"]["completion_tokens"])
    all_ids = ids + generated
    assert len(lp["tokens"]) == len(all_ids)
    # Entry i scores token i against the row before it; the first has none (null, as
    # llama-cpp-python writes it).
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = ref[np.arange(len(all_ids) - 1), all_ids[1:]]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, rtol=0, atol=2e-5)
    for i, top in enumerate(lp["top_logprobs"][1:]):
        best = np.argsort(-ref[i], kind="stable")[:3]
        assert list(top.values())[:3] == pytest.approx(ref[i][best], abs=2e-5)
        assert list(top)[:3] == [model.detokenize([int(b)]) for b in best]
    # Greedy: the chosen token leads every generated position's alternatives.
    for token, top in zip(lp["tokens"][len(ids) :], lp["top_logprobs"][len(ids) :], strict=True):
        assert next(iter(top)) == token and len(top) == 3
    assert lp["tokens"] == [model.detokenize([t]) for t in all_ids]
    assert lp["text_offset"] == [len(model.detokenize(all_ids[:i])) for i in range(len(all_ids))]
    check_shape_like_llamacpp(lp, LOGPROBS["cases"]["echo"]["choices"][0]["logprobs"])

    # Without echo: the generated tokens only, offsets after the prompt, as llama-cpp-python.
    plain = model.create_completion(prompt, logprobs=3, temperature=0, max_tokens=8, stop=["\n\n"])[
        "choices"
    ][0]
    theirs = LOGPROBS["cases"]["completion"]["choices"][0]
    assert plain["text"] == theirs["text"]
    got = plain["logprobs"]
    check_shape_like_llamacpp(got, theirs["logprobs"])
    assert got["tokens"] == theirs["logprobs"]["tokens"] == lp["tokens"][len(ids) :]
    assert got["text_offset"] == theirs["logprobs"]["text_offset"] == lp["text_offset"][len(ids) :]
    np.testing.assert_allclose(
        got["token_logprobs"], lp["token_logprobs"][len(ids) :], rtol=0, atol=1e-4
    )
    np.testing.assert_allclose(
        got["token_logprobs"], theirs["logprobs"]["token_logprobs"], rtol=0, atol=LLAMACPP_ATOL
    )
    for top, their_top in zip(got["top_logprobs"], theirs["logprobs"]["top_logprobs"], strict=True):
        assert list(top) == list(their_top)
        assert list(top.values()) == pytest.approx(list(their_top.values()), abs=LLAMACPP_ATOL)


def test_logprobs_zero_lists_the_chosen_token_and_none_lists_nothing(model: wl.Model) -> None:
    args = {"temperature": 0, "max_tokens": 8, "stop": ["\n\n"]}
    got = model(LOGPROBS["prompt"], logprobs=0, **args)["choices"][0]["logprobs"]
    theirs = LOGPROBS["cases"]["completion_n0"]["choices"][0]["logprobs"]
    assert [list(t) for t in got["top_logprobs"]] == [list(t) for t in theirs["top_logprobs"]]
    assert [t[k] for t, k in zip(got["top_logprobs"], got["tokens"], strict=True)] == got[
        "token_logprobs"
    ]
    for off in (None, False):
        assert model(LOGPROBS["prompt"], logprobs=off, **args)["choices"][0]["logprobs"] is None
    with pytest.raises(wl.PlanError, match="logprobs: expected a number of alternatives"):
        model("hi", logprobs=-1)
    with pytest.raises(TypeError, match="logprobs: expected an int or None, got str"):
        model("hi", logprobs="3")


def test_streamed_chunks_carry_their_tokens_logprobs(model: wl.Model) -> None:
    args = {"logprobs": 3, "temperature": 0, "max_tokens": 8, "stop": ["\n\n"]}
    # Run once so the two calls compared below both reuse the same cached prefix.
    model(LOGPROBS["prompt"], **args)
    whole = model(LOGPROBS["prompt"], **args)["choices"][0]
    chunks = [c["choices"][0] for c in model(LOGPROBS["prompt"], stream=True, **args)]
    theirs = [c["choices"][0] for c in LOGPROBS["cases"]["stream"]]
    # One token per chunk, then a closing chunk with the finish reason and no logprobs.
    assert all(len(c["logprobs"]["tokens"]) == 1 for c in chunks[:-1])
    assert chunks[-1]["logprobs"] is None and chunks[-1]["text"] == ""
    assert chunks[-1]["finish_reason"] == theirs[-1]["finish_reason"] == "stop"
    assert theirs[-1]["logprobs"] is None
    for c, t in zip(chunks, theirs[:-1], strict=False):
        assert c["text"] == t["text"]
        check_shape_like_llamacpp(c["logprobs"], t["logprobs"])
        assert c["logprobs"]["tokens"] == t["logprobs"]["tokens"]
        assert c["logprobs"]["text_offset"] == t["logprobs"]["text_offset"]
    # llama-cpp-python's stream drops the tokens of a stop string after the first; its whole
    # completion lists them, and so does our stream.
    merged = {k: [v for c in chunks[:-1] for v in c["logprobs"][k]] for k in whole["logprobs"]}
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["text_offset"] == whole["logprobs"]["text_offset"]
    assert merged["token_logprobs"] == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-6)
    assert "".join(c["text"] for c in chunks) == whole["text"]


def test_chat_logprobs_are_llamacpp_shaped(model: wl.Model) -> None:
    messages = LOGPROBS["chat_messages"]
    args = {"temperature": 0, "max_tokens": 6}
    r = model.create_chat_completion(messages, logprobs=True, top_logprobs=3, **args)
    theirs = LOGPROBS["cases"]["chat"]["choices"][0]
    lp = r["choices"][0]["logprobs"]
    assert set(lp) == set(theirs["logprobs"]) == {"content", "refusal"} and lp["refusal"] is None
    assert r["choices"][0]["message"]["content"] == theirs["message"]["content"]
    assert len(lp["content"]) == len(theirs["logprobs"]["content"]) == 6
    for ours, their in zip(lp["content"], theirs["logprobs"]["content"], strict=True):
        assert set(ours) == set(their) == {"token", "logprob", "bytes", "top_logprobs"}
        assert ours["token"] == their["token"] and ours["bytes"] is None
        assert ours["logprob"] == pytest.approx(their["logprob"], abs=LLAMACPP_ATOL)
        assert ours["top_logprobs"][0] == {**ours["top_logprobs"][0], "token": ours["token"]}
        assert [set(t) for t in ours["top_logprobs"]] == [set(t) for t in their["top_logprobs"]]
        # Alternatives a few hundredths apart may swap places between the two engines.
        assert ours["top_logprobs"][0]["token"] == their["top_logprobs"][0]["token"]
        values = [t["logprob"] for t in ours["top_logprobs"]]
        assert values == sorted(values, reverse=True)
    # The numbers are a completion's on the chat prompt's ids. (With echo, so that the prompt runs
    # whole as it did for the chat: a reused prefix runs the rest in smaller batches, whose
    # rounding on the fast path moves log-probabilities by up to about 0.1.)
    ids = CHAT["cases"][0]["ids"]
    assert model.token_bos() in ids  # listed by neither engine: count from the end
    plain = model.create_completion(ids, logprobs=3, echo=True, **args)["choices"][0]["logprobs"]
    n = len(lp["content"])
    assert [e["token"] for e in lp["content"]] == plain["tokens"][-n:]
    assert [e["logprob"] for e in lp["content"]] == pytest.approx(
        plain["token_logprobs"][-n:], abs=1e-4
    )
    # As llama-cpp-python: logprobs=True alone, or top_logprobs alone, lists nothing.
    assert (
        model.create_chat_completion(messages, logprobs=True, **args)["choices"][0]["logprobs"]
        is None
    )
    assert (
        model.create_chat_completion(messages, top_logprobs=3, **args)["choices"][0]["logprobs"]
        is None
    )

    chunks = list(
        model.create_chat_completion(messages, logprobs=True, top_logprobs=3, stream=True, **args)
    )
    their_chunks = LOGPROBS["cases"]["chat_stream"]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        c["choices"][0]["delta"] for c in their_chunks
    ]
    assert [c["choices"][0]["logprobs"] is None for c in chunks] == [
        c["choices"][0]["logprobs"] is None for c in their_chunks
    ]
    streamed = [e for c in chunks[1:-1] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in lp["content"]]


def leaf_types(value: object, out: dict[str, set[str]], path: str = "") -> dict[str, set[str]]:
    """The type names of `value`'s leaves by path, as tests/gen_logprobs_reference.py records."""
    if isinstance(value, dict):
        by_text = path.endswith("logprobs.top_logprobs[]")
        for k, v in value.items():
            leaf_types(v, out, f"{path}.{'*' if by_text else k}")
    elif isinstance(value, list):
        for v in value:
            leaf_types(v, out, f"{path}[]")
    else:
        out.setdefault(path, set()).add(type(value).__name__)
    return out


def test_logprobs_fields_have_llamacpp_types(model: wl.Model) -> None:
    prompt, messages = LOGPROBS["prompt"], LOGPROBS["chat_messages"]
    greedy = {"temperature": 0.0, "max_tokens": 8, "stop": ["\n\n"]}
    chat = {"logprobs": True, "top_logprobs": 3, "temperature": 0.0, "max_tokens": 6}
    ours = {
        "completion": model.create_completion(prompt, logprobs=3, **greedy),
        "completion_n0": model.create_completion(prompt, logprobs=0, **greedy),
        "echo": model.create_completion(prompt, logprobs=2, echo=True, **greedy),
        "stream": list(model.create_completion(prompt, logprobs=3, stream=True, **greedy)),
        "chat": model.create_chat_completion(messages, **chat),
        "chat_stream": list(model.create_chat_completion(messages, stream=True, **chat)),
    }
    got = {k: v for k, v in leaf_types(ours, {}).items() if "logprobs" in k}
    theirs = {k: v for k, v in LOGPROBS["types"].items() if "logprobs" in k}
    assert set(got) == set(theirs)
    for path, names in got.items():
        # Python floats where llama-cpp-python's whole responses have numpy float32.
        assert names == {"float" if t == "float32" else t for t in theirs[path]}, path

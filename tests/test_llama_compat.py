"""llama-cpp-python's `Llama` and transformers' `generate` words on weightlift.

Checked against outputs nobody here wrote:
- llama-cpp-python's own example programs (from the 0.3.36 sdist that `make vocab` fetches,
  sha256 checked), run with only the import changed;
- the shapes of llama-cpp-python's own tests (`tests/test_llama.py` in that sdist): its
  tokenizer test on llama.cpp's SPM vocabulary verbatim, and its save/load-state and grammar
  test on the demo model;
- llama.cpp's greedy continuation of the demo model (the reference data's `greedy.json`);
- what llama-cpp-python's `Llama` reports of GGUFs (`metadata`, the chat format it picks) and the
  prompt of a template a GGUF names (`tests/data/llama_metadata.json`).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import weightlift as wl
from conftest import REPO, ReferenceJson, engine_greedy_ids

GREEDY = ReferenceJson("smollm2-135m/greedy.json")
SDIST = REPO / ".cache" / "wheels" / "llama_cpp_python-0.3.36.tar.gz"
VOCAB = Path(os.environ.get("WEIGHTLIFT_VOCAB_DIR") or REPO / ".cache" / "vocab")


def sdist_file(rel: str) -> str:
    """A file of the llama-cpp-python sdist; fails the test, naming `make vocab`, without it."""
    if not SDIST.is_file():
        pytest.fail(f"{SDIST} is missing; run `make vocab` (`make test` does)", pytrace=False)
    with tarfile.open(SDIST) as tar:
        member = tar.extractfile(f"llama_cpp_python-0.3.36/{rel}")
        assert member is not None, rel
        return member.read().decode()


@pytest.fixture(scope="module")
def llm(demo_gguf: Path) -> wl.Llama:
    return wl.Llama(str(demo_gguf), n_ctx=256, verbose=False)


def run_example(tmp_path: Path, rel: str, *args: str) -> str:
    """Run one of llama-cpp-python's example programs with `llama_cpp` swapped for
    `weightlift`, and return its stdout."""
    source = sdist_file(rel)
    assert "from llama_cpp import Llama" in source, rel
    script = tmp_path / Path(rel).name
    script.write_text(source.replace("from llama_cpp import Llama", "from weightlift import Llama"))
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_llamacpp_inference_example_runs_with_the_import_changed(
    tmp_path: Path, demo_gguf: Path
) -> None:
    out = json.loads(
        run_example(
            tmp_path, "examples/high_level_api/high_level_api_inference.py", "-m", str(demo_gguf)
        )
    )
    assert out["object"] == "text_completion"
    choice = out["choices"][0]
    # echo=True: the text starts with the prompt; stop=["\n"] cut it at the first newline.
    assert choice["text"].startswith("Question: What are the names of the planets")
    assert "\n" not in choice["text"]
    assert choice["finish_reason"] in ("stop", "length")
    assert set(out["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_llamacpp_streaming_example_runs_with_the_import_changed(
    tmp_path: Path, demo_gguf: Path
) -> None:
    out = run_example(
        tmp_path, "examples/high_level_api/high_level_api_streaming.py", "-m", str(demo_gguf)
    )
    # One json.dumps(chunk, indent=2) per chunk, back to back.
    chunks, at, decoder = [], 0, json.JSONDecoder()
    while at < len(out.rstrip()):
        chunk, at = decoder.raw_decode(out, at)
        chunks.append(chunk)
        while at < len(out) and out[at].isspace():
            at += 1
    assert len(chunks) > 1
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_llamacpp_tokenization_test_passes_verbatim_on_its_spm_vocabulary() -> None:
    # llama-cpp-python's test_llama_cpp_tokenization, on the same vocabulary file.
    path = VOCAB / "ggml-vocab-llama-spm.gguf"
    if not path.is_file():
        pytest.fail(f"{path} is missing; run `make vocab`", pytrace=False)
    llama = wl.Llama(model_path=str(path), vocab_only=True, verbose=False)
    text = b"Hello World"
    tokens = llama.tokenize(text)
    assert tokens[0] == llama.token_bos()
    assert tokens == [1, 15043, 2787]
    assert llama.detokenize(tokens) == text
    tokens = llama.tokenize(text, add_bos=False)
    assert tokens == [15043, 2787]
    assert llama.detokenize(tokens) != text
    text = b"Hello World</s>"
    tokens = llama.tokenize(text)
    assert tokens == [1, 15043, 2787, 829, 29879, 29958]
    tokens = llama.tokenize(text, special=True)
    assert tokens[-1] == llama.token_eos()
    assert tokens == [1, 15043, 2787, 2]
    text = b""
    tokens = llama.tokenize(text, add_bos=True, special=True)
    assert tokens == [llama.token_bos()]
    assert text == llama.detokenize(tokens)


def test_greedy_completion_is_llamacpp_text(llm: wl.Llama) -> None:
    # llama.cpp's ids, or ids parting from a reference only at a near-tie (conftest), up to the
    # end-of-generation token
    ids = engine_greedy_ids(llm.model)
    if ids == GREEDY["llamacpp"]["ids"]:
        assert llm.detokenize(ids).decode() == GREEDY["llamacpp"]["text"]
    eos = llm.token_eos()
    ids = ids[: ids.index(eos)] if eos in ids else ids
    out = llm.create_completion(GREEDY["prompt"], max_tokens=32, temperature=0.0)
    assert out["choices"][0]["text"] == llm.detokenize(ids).decode()


def test_state_grammar_and_seed_behave_as_llamacpp_tests_them(llm: wl.Llama) -> None:
    # The shape of llama-cpp-python's test_real_llama, on the demo model.
    out = llm.create_completion(
        "The capital of france is paris, 'true' or 'false'?:\n",
        max_tokens=4,
        temperature=0.8,
        seed=1337,
        grammar=wl.LlamaGrammar.from_string('root ::= "true" | "false"'),
    )
    assert out["choices"][0]["text"] in ("true", "false")
    llm.set_seed(1337)
    state = llm.save_state()
    pick = wl.LlamaGrammar.from_string(
        'root ::= "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9" | "10"'
    )
    kw = dict(max_tokens=4, top_k=50, top_p=0.9, temperature=1.0, grammar=pick)
    # Several draws: two in a row must differ somewhere (the seed moves on), and the draws
    # after load_state repeat the first ones (the seed comes back with the state).
    first = [llm.create_completion("Pick a number from 1 to 10?:\n", **kw) for _ in range(4)]
    llm.load_state(pickle.loads(pickle.dumps(state)))
    again = [llm.create_completion("Pick a number from 1 to 10?:\n", **kw) for _ in range(4)]
    texts = [o["choices"][0]["text"] for o in first]
    assert texts == [o["choices"][0]["text"] for o in again]
    assert len(set(texts)) > 1


def test_eval_sample_and_generate_follow_the_greedy_continuation(llm: wl.Llama) -> None:
    ids = llm.tokenize(GREEDY["prompt"].encode())
    assert ids == GREEDY["prompt_ids"]
    want = engine_greedy_ids(llm.model)
    llm.reset()
    assert llm.n_tokens == 0
    llm.eval(ids)
    assert llm.n_tokens == len(ids) and llm.input_ids.tolist() == ids
    assert llm.sample(temp=0.0) == want[0]
    gen = llm.generate(ids, temp=0.0)
    assert [next(gen) for _ in range(6)] == want[:6]
    # The prompt was reused, not run again: the cache holds prompt + the 5 tokens fed back.
    assert llm.n_tokens == len(ids) + 5
    assert (
        llm.detokenize(want[:2], prev_tokens=ids)
        == llm.detokenize(ids + want[:2])[len(llm.detokenize(ids)) :]
    )


def test_save_state_restores_the_cache_exactly(llm: wl.Llama) -> None:
    ids = GREEDY["prompt_ids"]
    llm.reset()
    llm.eval(ids)
    state = llm.save_state()
    logits = llm.scores.copy()
    llm.reset()
    llm.eval(llm.tokenize(b"Something else entirely, longer than before"))
    llm.load_state(state)
    assert llm.n_tokens == len(ids) and llm.input_ids.tolist() == ids
    # The next token's logits from the restored cache are those of the original cache.
    llm.eval([GREEDY["llamacpp"]["ids"][0]])
    restored = llm.scores.copy()
    llm.reset()
    llm.eval(ids + [GREEDY["llamacpp"]["ids"][0]])
    np.testing.assert_array_equal(restored, llm.scores)
    assert logits.shape == (1, llm.n_vocab())
    with pytest.raises(ValueError, match="WLKVSTAT"):
        llm.model.cache.load_state(b"not a state")
    # a state of another kind is refused by name, and the cache keeps what it held
    with pytest.raises(TypeError, match="the LlamaState that save_state returned, got bytes"):
        llm.load_state(b"not a state")  # type: ignore[arg-type]
    assert llm.n_tokens == len(ids) + 1


def test_logit_bias_bans_and_forces_tokens(llm: wl.Llama) -> None:
    prompt = GREEDY["prompt"]
    paris = GREEDY["llamacpp"]["ids"][0]
    out = llm(prompt, max_tokens=1, temperature=0.0, logprobs=1)
    assert out["choices"][0]["text"] == " Paris"
    banned = llm(prompt, max_tokens=1, temperature=0.0, logit_bias={str(paris): -float("inf")})
    assert banned["choices"][0]["text"] != " Paris"
    forced = llm(prompt, max_tokens=1, temperature=0.0, logit_bias={198: 100.0})
    assert forced["choices"][0]["text"] == "\n"
    with pytest.raises(ValueError, match="logit_bias: expected token ids below the vocabulary"):
        llm(prompt, max_tokens=1, logit_bias={10**6: 1.0})
    with pytest.raises(ValueError, match=r"logit_bias\[198\]: expected a finite number"):
        llm(prompt, max_tokens=1, logit_bias={198: float("nan")})
    with pytest.raises(wl.WeightliftError, match="logit_bias"):
        llm(prompt, max_tokens=1, logit_bias={"Paris": 1.0})
    chat = llm.create_chat_completion(
        [{"role": "user", "content": "Say hi"}],
        max_tokens=1,
        temperature=0.0,
        logit_bias={198: 100.0},
    )
    assert chat["choices"][0]["message"]["content"] == "\n"


def test_constructor_keywords_map_or_are_refused_by_name(demo_gguf: Path) -> None:
    with pytest.raises(wl.UnsupportedError, match="chat format 'chatml2'.*llama-3"):
        wl.Llama(str(demo_gguf), chat_format="chatml2", verbose=False)
    with pytest.raises(wl.UnsupportedError, match="lora_path"):
        wl.Llama(str(demo_gguf), lora_path="adapter.gguf", verbose=False)
    with pytest.raises(wl.UnsupportedError, match="type_k"):
        wl.Llama(str(demo_gguf), type_k=12, verbose=False)
    with pytest.raises(TypeError, match="no_such_thing"):
        wl.Llama(str(demo_gguf), no_such_thing=1, verbose=False)
    # Scheduling knobs of llama.cpp's own are accepted; n_ctx=0 is the trained context.
    with wl.Llama(
        str(demo_gguf),
        n_ctx=0,
        n_ubatch=64,
        n_threads_batch=2,
        flash_attn=True,
        type_k=8,
        type_v=8,
        seed=5,
        verbose=False,
    ) as m:
        assert m.n_ctx() == 8192
        assert m.model.cache.dtype == "q8"
    with pytest.raises(wl.ClosedError):
        m("hi", max_tokens=1)
    # llama-cpp-python's explicit free: __del__ closes, and a second close is fine
    freed = wl.Llama(str(demo_gguf), n_ctx=64, verbose=False)
    freed.__del__()
    with pytest.raises(wl.ClosedError):
        freed("hi", max_tokens=1)
    freed.close()
    # load_gguf takes llama.cpp's n_ctx=0 alike
    with wl.load_gguf(demo_gguf, n_ctx=0) as g:
        assert g.n_ctx() == 8192


def test_model_is_a_context_manager_and_close_frees_it(demo_gguf: Path) -> None:
    with wl.load_gguf(demo_gguf, n_ctx=64) as m:
        assert repr(m).endswith("loaded=True)")
        assert m.generate("Hi", max_new_tokens=2)
        assert sum(m.memory().values()) > 0
    assert m.closed
    with pytest.raises(wl.ClosedError, match="closed"):
        m.generate("Hi")
    with pytest.raises(wl.ClosedError):
        m.memory()
    m.close()  # twice is fine
    assert "closed" in repr(m)


def test_transformers_generate_words(llm: wl.Llama) -> None:
    m = llm.model
    prompt = GREEDY["prompt"]
    want = m.detokenize(engine_greedy_ids(m))
    greedy = m.generate(prompt, max_new_tokens=8)
    assert m.generate(prompt, do_sample=False, temperature=0.7, max_new_tokens=8) == greedy
    # max_length counts the prompt's 5 tokens.
    assert m.generate(prompt, max_length=13) == greedy
    assert want.startswith(greedy)
    with pytest.raises(wl.WeightliftError, match="max_length=5 counts the prompt"):
        m.generate(prompt, max_length=5)
    # eos_token_id replaces the end-of-generation tokens: stop at the first newline (198).
    assert m.generate(prompt, max_new_tokens=8, eos_token_id=198) == " Paris."
    assert m.generate(prompt, max_new_tokens=8, eos_token_id=[198, 30]) == " Paris"
    assert m.generate(prompt, max_new_tokens=8, repetition_penalty=1.0, pad_token_id=0) == greedy
    with pytest.raises(wl.WeightliftError, match="repetition_penalty"):
        m.generate(prompt, repeat_penalty=1.1, repetition_penalty=1.3)
    with pytest.raises(wl.UnsupportedError, match="num_return_sequences above 1 with greedy"):
        m.generate(prompt, num_return_sequences=2)
    a = m.generate(prompt, do_sample=True, seed=3, max_new_tokens=8)
    assert a == m.generate(prompt, do_sample=True, seed=3, max_new_tokens=8)
    # several samples at once: sequence i is the one seed 3 + i gives alone
    many = m.generate(prompt, do_sample=True, seed=3, max_new_tokens=8, num_return_sequences=3)
    assert many[0] == a and len(many) == 3
    assert many[1:] == [
        m.generate(prompt, do_sample=True, seed=s, max_new_tokens=8) for s in (4, 5)
    ]
    with pytest.raises(ValueError, match="stream=True"):
        m.generate(prompt, do_sample=True, num_return_sequences=2, stream=True)


def test_a_hub_id_says_how_to_download_it_and_where_to_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="huggingface-cli download org/tiny-model"):
        wl.from_pretrained("org/tiny-model")
    snap = tmp_path / "hub" / "models--org--tiny-model" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="the hub's cache holds it") as e:
        wl.from_pretrained("org/tiny-model")
    assert str(snap) in str(e.value)
    # A missing file path is only that.
    with pytest.raises(FileNotFoundError) as e:
        wl.load_gguf("org/model.gguf")
    assert "Hub" not in str(e.value)


def test_llamacpp_embedding_example_runs_with_the_import_changed(
    tmp_path: Path, demo_gguf: Path
) -> None:
    out = run_example(
        tmp_path, "examples/high_level_api/high_level_api_embedding.py", "-m", str(demo_gguf)
    )
    # It prints the response dict's repr: one embedding of "Hello world!".
    assert out.startswith("{'object': 'list', 'data': [{'object': 'embedding', 'embedding': [")
    assert "'usage': {'prompt_tokens':" in out


def test_embeddings_have_llamacpps_shapes_and_pooling(demo_gguf: Path) -> None:
    # The shape of llama-cpp-python's test_real_llama_embeddings, with mean pooling.
    with wl.Llama(
        str(demo_gguf),
        n_ctx=64,
        embedding=True,
        pooling_type=wl.LLAMA_POOLING_TYPE_MEAN,
        verbose=False,
    ) as model:
        embedding = model.embed("Hello World")
        assert len(embedding) == model.n_embd() == 576
        prompts = ["Hello World", "A different prompt"]
        individual = [model.embed(p) for p in prompts]
        batched = model.embed(prompts)
        assert len(batched) == len(prompts)
        for one, many in zip(individual, batched, strict=True):
            np.testing.assert_allclose(many, one, rtol=1e-4, atol=1e-4)
        # Mean pooling is the mean of the unpooled rows; normalising gives unit vectors.
        rows = np.array(model.model.embed(model.tokenize(b"Hello World"), pooling="none"))
        np.testing.assert_allclose(rows.mean(axis=0), embedding, rtol=1e-5, atol=1e-6)
        unit = model.embed("Hello World", normalize=True)
        assert abs(np.linalg.norm(unit) - 1.0) < 1e-5
        # The cache generation uses is left alone.
        model.eval(model.tokenize(b"The sky is"))
        held = model.input_ids.tolist()
        model.embed("Something else")
        assert model.input_ids.tolist() == held
        resp = model.create_embedding(prompts)
        assert [d["index"] for d in resp["data"]] == [0, 1]
        assert resp["usage"]["prompt_tokens"] == sum(
            len(model.tokenize(p.encode())) for p in prompts
        )
    # The model's default (no pooling_type in the GGUF): one vector per token, as llama.cpp.
    with wl.Llama(str(demo_gguf), n_ctx=64, embedding=True, verbose=False) as model:
        per_token = model.embed("Hello World")
        assert len(per_token) == len(model.tokenize(b"Hello World")) and len(per_token[0]) == 576
    with wl.Llama(str(demo_gguf), n_ctx=64, verbose=False) as model:
        with pytest.raises(RuntimeError, match="embedding=True"):
            model.embed("Hello")


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_a_forced_tool_choice_returns_llamacpps_tool_call_shapes(llm: wl.Llama) -> None:
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    kw = dict(
        tools=WEATHER,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0.0,
    )
    llm.reset()
    whole = llm.create_chat_completion(msgs, **kw)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["role"] == "assistant" and msg["content"] is None
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["id"] == f"call__0_get_weather_cmpl-{whole['id'].removeprefix('chatcmpl-')}"
    assert msg["function_call"] == call["function"]
    # The arguments are kept inside the tool's parameters schema by the grammar.
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args["city"], str) and set(args) <= {"city", "unit"}
    llm.reset()
    chunks = list(llm.create_chat_completion(msgs, stream=True, **kw))
    first, middle, last = chunks[0], chunks[1:-1], chunks[-1]
    assert first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": None,
        "function_call": None,
        "tool_calls": None,
    }
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    assert all(v is None for v in last["choices"][0]["delta"].values())
    assert all(c["choices"][0]["delta"]["tool_calls"][0]["index"] == 0 for c in middle)
    streamed = "".join(c["choices"][0]["delta"]["function_call"]["arguments"] for c in middle)
    assert streamed == call["function"]["arguments"]
    # The legacy pair says the same.
    llm.reset()
    legacy = llm.create_chat_completion(
        msgs,
        functions=[WEATHER[0]["function"]],
        function_call={"name": "get_weather"},
        max_tokens=48,
        temperature=0.0,
    )
    assert legacy["choices"][0]["message"]["function_call"] == msg["function_call"]
    with pytest.raises(ValueError, match="'nope', which is not among them"):
        llm.create_chat_completion(
            msgs, tools=WEATHER, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    # "auto": the tools go to the template and the reply is text.
    auto = llm.create_chat_completion(msgs, tools=WEATHER, tool_choice="auto", max_tokens=4)
    assert auto["choices"][0]["message"]["content"] is not None


def test_load_gguf_takes_llamacpps_keywords(demo_gguf: Path) -> None:
    with wl.load_gguf(model_path=str(demo_gguf), n_ctx=64, verbose=False) as m:
        assert m.n_ctx() == 64
    with pytest.raises(wl.UnsupportedError, match="chat format 'nope'.*chatml.*chat_format=None"):
        wl.load_gguf(demo_gguf, chat_format="nope")
    with pytest.raises(TypeError, match="both path and model_path"):
        wl.load_gguf(demo_gguf, model_path=str(demo_gguf))
    with pytest.raises(TypeError, match="missing the GGUF"):
        wl.load_gguf()


def test_logits_processors_and_stopping_criteria_run_as_llamacpps(llm: wl.Llama) -> None:
    # The logits-processor part of llama-cpp-python's test_real_llama.
    tokens = llm.tokenize(b"rot", add_bos=True, special=True)

    def logit_processor_func(input_ids, logits):  # type: ignore[no-untyped-def]
        for token in tokens:
            logits[token] *= 1000
        return logits

    output = llm.create_completion(
        "The capital of france is par",
        max_tokens=4,
        top_k=50,
        top_p=0.9,
        temperature=0.8,
        seed=1337,
        logits_processor=wl.LogitsProcessorList([logit_processor_func]),
    )
    assert output["choices"][0]["text"].lower().startswith("rot")
    # A criterion sees the ids so far (prompt, then generated) and the logits; true stops
    # before the token just sampled is kept.
    seen: list[int] = []
    vocab = llm.n_vocab()

    def stop_after_three(input_ids, logits):  # type: ignore[no-untyped-def]
        assert logits.shape == (vocab,) and input_ids.dtype == np.intc
        seen.append(len(input_ids))
        return len(input_ids) >= len(GREEDY["prompt_ids"]) + 3

    out = llm.create_completion(
        GREEDY["prompt"],
        max_tokens=10,
        temperature=0.0,
        stopping_criteria=wl.StoppingCriteriaList([stop_after_three]),
    )
    assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == llm.detokenize(GREEDY["llamacpp"]["ids"][:3]).decode()
    assert seen == [5, 6, 7, 8]

    # A processor's exception comes out as it is, and the model goes on.
    def broken(input_ids, logits):  # type: ignore[no-untyped-def]
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        llm("hi", logits_processor=broken, max_tokens=2)
    with pytest.raises(ValueError, match="expected 49152 scores back, got 3"):
        llm("hi", logits_processor=lambda ids, s: s[:3], max_tokens=2)
    # A hook that calls back into its own model is told why that cannot work.
    with pytest.raises(RuntimeError, match="logits processor or stopping criterion"):
        llm("hi", max_tokens=2, stopping_criteria=lambda ids, s: llm.n_vocab() > 0)
    assert llm(GREEDY["prompt"], max_tokens=2, temperature=0.0)["choices"][0]["text"] == " Paris."


def test_a_ram_cache_hit_loads_the_state_once_and_matches_a_fresh_run(demo_gguf: Path) -> None:
    # The shape of llama-cpp-python's _assert_ram_cache_exact_prompt_hit_matches_fresh.
    def make() -> wl.Llama:
        return wl.Llama(str(demo_gguf), n_ctx=64, verbose=False)

    fresh = make()
    tokens = fresh.tokenize(b"The quick brown fox", add_bos=True, special=True)
    expected = fresh.create_completion(tokens, max_tokens=1, temperature=0.0, seed=1337)
    cache = wl.LlamaRAMCache()
    writer = make()
    writer.set_cache(cache)
    writer.create_completion(tokens, max_tokens=1, temperature=0.0, seed=1337)
    assert tokens in cache and cache.cache_size > 0
    cached = make()
    cached.set_cache(cache)
    calls = 0
    original = cached.load_state

    def tracking(state: wl.LlamaState) -> None:
        nonlocal calls
        calls += 1
        original(state)

    cached.load_state = tracking  # type: ignore[method-assign]
    actual = cached.create_completion(tokens, max_tokens=1, temperature=0.0, seed=1337)
    assert calls == 1
    assert actual["choices"][0]["text"] == expected["choices"][0]["text"]
    assert actual["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    # The prompt ran from the loaded state: all but its last token were reused.
    assert cached.model.timings["reused_tokens"] == len(tokens) - 1
    # A capacity of one byte keeps nothing.
    small = wl.LlamaRAMCache(capacity_bytes=1)
    small[tokens] = cached.save_state()
    assert tokens not in small


def test_a_disk_cache_outlives_its_object_and_a_hit_matches_a_fresh_run(
    tmp_path: Path, demo_gguf: Path
) -> None:
    def make() -> wl.Llama:
        return wl.Llama(str(demo_gguf), n_ctx=64, verbose=False)

    fresh = make()
    tokens = fresh.tokenize(b"The quick brown fox", add_bos=True, special=True)
    expected = fresh.create_completion(tokens, max_tokens=2, temperature=0.0, seed=7)
    writer = make()
    writer.set_cache(wl.LlamaDiskCache(str(tmp_path / "prompts")))
    writer.create_completion(tokens, max_tokens=2, temperature=0.0, seed=7)
    # a new cache object over the same directory finds what the first one stored
    reopened = wl.LlamaDiskCache(str(tmp_path / "prompts"))
    assert tokens in reopened and reopened.cache_size > 0
    assert tokens + [42] in reopened  # the longest stored prefix answers a longer key
    cached = make()
    cached.set_cache(reopened)
    actual = cached.create_completion(tokens, max_tokens=2, temperature=0.0, seed=7)
    assert actual["choices"][0]["text"] == expected["choices"][0]["text"]
    assert cached.model.timings["reused_tokens"] == len(tokens) - 1
    assert tokens in reopened  # a hit keeps the state
    small = wl.LlamaDiskCache(str(tmp_path / "small"), capacity_bytes=1)
    small[tokens] = cached.save_state()
    assert tokens not in small


def test_llamacpp_infill_example_runs_with_the_import_changed(
    tmp_path: Path, demo_gguf: Path
) -> None:
    # The demo model has no fill-in-the-middle tokens: as llama-cpp-python, the prompt is
    # completed and the suffix put after the text (the example then strips it again).
    out = run_example(
        tmp_path, "examples/high_level_api/high_level_api_infill.py", "-m", str(demo_gguf)
    )
    assert out.startswith("Fill-in-Middle completion")
    with wl.Llama(str(demo_gguf), n_ctx=128, verbose=False) as llm:
        plain = llm("def add(", max_tokens=8, temperature=0.0)["choices"][0]["text"]
        filled = llm("def add(", suffix="\n    return sum\n", max_tokens=8, temperature=0.0)
        assert filled["choices"][0]["text"] == plain + "\n    return sum\n"
        with pytest.raises(TypeError, match="suffix"):
            llm([504, 3575], suffix="x", max_tokens=1)


CHAT_FORMATS = Path(__file__).parent.parent / "crates/weightlift-text/tests/data/chat_formats.json"


@pytest.mark.parametrize("name", ["llama-2", "zephyr", "alpaca", "mistral-instruct"])
def test_a_built_in_chat_format_makes_llama_cpp_pythons_prompt(demo_gguf: Path, name: str) -> None:
    # The prompt llama-cpp-python's formatter made of this conversation (its formatters'
    # output, recorded by crates/weightlift-text/tests/gen_chat_formats.py), tokenized as its
    # chat handler does: BOS by the vocabulary's rule, special tokens parsed.
    case = json.loads(CHAT_FORMATS.read_text())["formats"][name][0]
    with wl.Llama(str(demo_gguf), chat_format=name, n_ctx=256, verbose=False) as llm:
        assert llm.chat_format == name
        want = llm.tokenize(case["prompt"].encode(), add_bos=True, special=True)
        reply = llm.create_chat_completion(case["messages"], max_tokens=1, temperature=0.0)
        assert reply["usage"]["prompt_tokens"] == len(want)
        llm.reset()
        llm.eval(want)
        assert reply["choices"][0]["message"]["content"] == llm.detokenize(
            [int(np.argmax(llm.scores[-1]))]
        ).decode("utf-8", "ignore")


def test_a_models_chat_format_is_set_and_cleared_after_the_load(demo_gguf: Path) -> None:
    case = json.loads(CHAT_FORMATS.read_text())["formats"]["zephyr"][0]
    m = wl.load_gguf(demo_gguf, n_ctx=256)

    def prompt_tokens() -> int:
        r = m.create_chat_completion(case["messages"], max_tokens=1, temperature=0.0)
        return r["usage"]["prompt_tokens"]

    assert m.chat_format is None
    own = prompt_tokens()
    m.chat_format = "zephyr"
    assert m.chat_format == "zephyr"
    # BOS by the vocabulary's rule, as the chat prompt gets it
    want = m.tokenize(case["prompt"].encode(), special=True)
    assert prompt_tokens() == len(want) != own
    # an unknown name is refused by name, and the format in use stays
    with pytest.raises(wl.UnsupportedError, match="chat format 'nope'.*chatml"):
        m.chat_format = "nope"
    assert m.chat_format == "zephyr"
    m.chat_format = None
    assert m.chat_format is None and prompt_tokens() == own
    # Llama's attribute is the model's
    with wl.Llama(str(demo_gguf), n_ctx=256, verbose=False) as llm:
        assert llm.chat_format == "chat_template.default"
        llm.chat_format = "zephyr"
        assert llm.model.chat_format == "zephyr"
        reply = llm.create_chat_completion(case["messages"], max_tokens=1, temperature=0.0)
        assert reply["usage"]["prompt_tokens"] == len(want)


def test_a_chat_formats_stop_string_ends_the_reply(demo_gguf: Path) -> None:
    # pygmalion's stop is a newline: the chat reply is the plain completion of its prompt cut at
    # the first one.
    case = json.loads(CHAT_FORMATS.read_text())["formats"]["pygmalion"][1]
    with wl.Llama(str(demo_gguf), chat_format="pygmalion", n_ctx=256, verbose=False) as llm:
        plain = llm.create_completion(case["prompt"], max_tokens=48, temperature=0.0)
        text = plain["choices"][0]["text"]
        assert "\n" in text
        reply = llm.create_chat_completion(case["messages"], max_tokens=48, temperature=0.0)
        assert reply["choices"][0]["message"]["content"] == text.split("\n")[0]
        assert reply["choices"][0]["finish_reason"] == "stop"


def test_a_prefix_computed_in_another_compute_mode_runs_again(demo_gguf: Path) -> None:
    llm = wl.Llama(str(demo_gguf), n_ctx=128, verbose=False)
    # Longer than the 16 tokens whose fast-mode products keep every token's own bits.
    ids = llm.tokenize(
        b"In the beginning of the twentieth century, many scientists across Europe were studying "
        b"the structure of the atom and the nature of light, and one of them wrote"
    )
    assert len(ids) > 16
    args = {"max_tokens": 6, "temperature": 0.0, "logprobs": 3}
    cold = {}
    for mode in ("fast", "exact"):
        llm.reset()
        llm.model.compute = mode
        next(llm.generate(ids, temp=0.0))
        scores = llm.scores[-1].copy()
        llm.reset()
        cold[mode] = (scores, llm.create_completion(ids, **args)["choices"][0])
    for before, now in (("fast", "exact"), ("exact", "fast")):
        llm.reset()
        llm.model.compute = before
        next(llm.generate(ids, temp=0.0))
        llm.model.compute = now
        # generate(reset=True) keeps the longest prefix held only if its rows are this mode's
        next(llm.generate(ids, temp=0.0))
        np.testing.assert_array_equal(llm.scores[-1], cold[now][0])
        llm.model.compute = before
        llm.create_completion(ids, **args)
        llm.model.compute = now
        assert llm.create_completion(ids, **args)["choices"][0] == cold[now][1]


# What llama-cpp-python's Llama reports of GGUFs and which chat format it picks
# (tests/gen_llama_metadata.py).
LLAMA_METADATA = Path(__file__).parent / "data" / "llama_metadata.json"
TINY_QWEN2 = Path(__file__).parent / "data" / "tiny-qwen2" / "tiny-qwen2-F16.gguf"


def gguf_with(src: Path, dest: Path, strings: dict[str, str]) -> Path:
    """A copy of `src` with string keys set, by gguf-py's own metadata copier."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dest, arch=arch, endianess=reader.endianess)
    new = {k: MetadataDetails(gguf.GGUFValueType.STRING, v) for k, v in strings.items()}
    copy_with_new_metadata(reader, writer, new, [])
    return dest


def test_metadata_and_chat_format_are_llama_cpp_pythons(demo_gguf: Path) -> None:
    # Every key but the arrays, each value a string as llama.cpp writes it; the chat format
    # picked from the template, or llama-2 without one.
    assert "tokenizer.ggml.bos_token_id" not in wl.open(TINY_QWEN2).metadata
    models = json.loads(LLAMA_METADATA.read_text())["models"]
    assert len(models) == 6
    for rel, want in models.items():
        path = demo_gguf if rel == "demo" else Path(__file__).parent / "data" / rel
        llm = wl.Llama(str(path), vocab_only=True, verbose=False)
        assert llm.metadata == want["metadata"], rel
        assert llm.chat_format == want["chat_format"], rel
        # BOS and EOS, llama.cpp's defaults where the GGUF has none (tiny-qwen2 has no BOS id)
        assert (llm.token_bos(), llm.token_eos()) == (want["token_bos"], want["token_eos"]), rel


def test_a_template_llama_cpp_python_knows_by_heart_takes_its_built_in_format(
    tmp_path: Path,
) -> None:
    from weightlift._llama import _chat_format_of

    guesses = json.loads(LLAMA_METADATA.read_text())["guesses"]
    assert {g["guess"] for g in guesses} == {"chatml", "mistral-instruct", "llama-3", None}
    for g in guesses:
        want = g["guess"] or "chat_template.default"
        assert _chat_format_of({"tokenizer.chat_template": g["template"]}) == want
    # end to end: a GGUF whose template is ChatML's, as llama-cpp-python's guess says
    chatml = gguf_with(
        TINY_QWEN2, tmp_path / "chatml.gguf", {"tokenizer.chat_template": guesses[0]["template"]}
    )
    assert wl.Llama(str(chatml), vocab_only=True, verbose=False).chat_format == "chatml"


def test_a_gguf_without_a_template_chats_in_llama_2(tmp_path: Path) -> None:
    # llama-cpp-python's fallback: the prompt its llama-2 formatter makes, BOS by the vocabulary.
    case = json.loads(CHAT_FORMATS.read_text())["formats"]["llama-2"][0]
    with wl.Llama(str(TINY_QWEN2), n_ctx=256, verbose=False) as llm:
        assert llm.chat_format == "llama-2"
        want = llm.tokenize(case["prompt"].encode(), add_bos=True, special=True)
        reply = llm.create_chat_completion(case["messages"], max_tokens=1, temperature=0.0)
        assert reply["usage"]["prompt_tokens"] == len(want)
        # chat_format=None asks for the model's own template, which it does not have
        llm.chat_format = None
        assert llm.chat_format is None
        with pytest.raises(wl.UnsupportedError, match="no chat template.*chat_format=.*chatml"):
            llm.create_chat_completion(case["messages"], max_tokens=1)


def test_a_template_the_gguf_names_formats_chats(tmp_path: Path) -> None:
    named = json.loads(LLAMA_METADATA.read_text())["named_template"]
    key = f"tokenizer.chat_template.{named['name']}"
    path = gguf_with(TINY_QWEN2, tmp_path / "named.gguf", {key: named["template"]})
    name = f"chat_template.{named['name']}"
    with wl.Llama(str(path), chat_format=name, n_ctx=256, verbose=False) as llm:
        assert llm.chat_format == llm.model.chat_format == name
        assert llm.metadata[key] == named["template"]
        reply = llm.create_chat_completion(named["messages"], max_tokens=1, temperature=0.0)
        assert reply["usage"]["prompt_tokens"] == len(named["ids"])
        # the greedy reply to llama-cpp-python's ids (a byte-level token here that ends inside a
        # character, which the reply shows as U+FFFD)
        llm.reset()
        llm.eval(named["ids"])
        assert reply["choices"][0]["message"]["content"] == llm.detokenize(
            [int(np.argmax(llm.scores[-1]))]
        ).decode("utf-8", "replace")
        # a name the GGUF does not have is refused with the ones it has
        with pytest.raises(
            wl.UnsupportedError,
            match=r"chat format 'chat_template.nope'.*chat_template.default, "
            r"chat_template.tool_use, chatml",
        ):
            llm.chat_format = "chat_template.nope"
        assert llm.chat_format == name
        # chat_template.default is the model's own template: here none, so llama-2 is gone too
        llm.chat_format = "chat_template.default"
        assert llm.model.chat_format is None


# llama-cpp-python's smaller Llama methods on the demo model (tests/gen_llama_api.py).
LLAMA_API = Path(__file__).parent / "data" / "llama_api.json"


def test_pooling_type_is_llama_cpp_pythons(demo_gguf: Path) -> None:
    cases = json.loads(LLAMA_API.read_text())["pooling_type"]
    assert {c["pooling_type"] for c in cases} == {0, 1, 3}
    for case in cases:
        llm = wl.Llama(str(demo_gguf), n_ctx=64, verbose=False, **case["kwargs"])
        assert llm.pooling_type() == case["pooling_type"], case["kwargs"]


def test_logprobs_and_prefixes_are_llama_cpp_pythons() -> None:
    ref = json.loads(LLAMA_API.read_text())
    for case in ref["logprobs"]:
        # a row of only -inf gives NaN, with numpy's warning (as llama-cpp-python's does)
        with np.errstate(invalid="ignore"):
            got = wl.Llama.logits_to_logprobs(case["logits"])
        assert got.dtype == np.single
        np.testing.assert_allclose(got, np.array(case["logprobs"]), rtol=1e-6, atol=1e-7)
    for case in ref["prefix"]:
        assert wl.Llama.longest_token_prefix(case["a"], case["b"]) == case["n"]


def test_the_tokenizer_object_is_llama_cpp_pythons(llm: wl.Llama) -> None:
    # LlamaTokenizer parses special tokens by default, where Llama.tokenize does not.
    ref = json.loads(LLAMA_API.read_text())["tokenizer"]
    tok = llm.tokenizer()
    assert isinstance(tok, wl.LlamaTokenizer)
    text = ref["text"]
    assert tok.encode(text) == ref["encode"]
    assert tok.encode(text, add_bos=False, special=False) == ref["encode_plain"]
    assert tok.tokenize(text.encode()) == ref["tokenize"]
    assert tok.decode(ref["encode"]) == ref["decode"]
    assert tok.detokenize(ref["encode"], special=True).decode() == ref["detokenize_special"]
    assert tok.decode(ref["cut"]) == ref["decode_cut"] == ""


def test_eval_tokens_and_logits(demo_gguf: Path) -> None:
    want = json.loads(LLAMA_API.read_text())["eval_tokens"]
    for logits_all in (False, True):
        llm = wl.Llama(str(demo_gguf), n_ctx=64, logits_all=logits_all, verbose=False)
        llm.eval(llm.tokenize(b"Hello world"))
        assert list(llm.eval_tokens) == want and llm.eval_tokens.maxlen == 64
        rows = llm.eval_logits
        assert len(rows) == (len(want) if logits_all else 1)
        np.testing.assert_array_equal(np.array(rows[-1], dtype=np.single), llm.scores[-1])


def test_a_pickled_llama_loads_again_with_its_arguments(demo_gguf: Path, tmp_path: Path) -> None:
    llm = wl.Llama(str(demo_gguf), n_ctx=96, seed=7, chat_format="zephyr", verbose=False)
    llm("The capital of France is", max_tokens=4, temperature=0.0)  # moves the seed on
    again = pickle.loads(pickle.dumps(llm))
    assert (again.n_ctx(), again.chat_format, again.n_tokens) == (96, "zephyr", 0)
    # the next sampled completion draws the same seed in both, from an empty cache
    llm.reset()
    a = llm("Once", max_tokens=6, temperature=1.0)["choices"][0]["text"]
    b = again("Once", max_tokens=6, temperature=1.0)["choices"][0]["text"]
    assert a == b and again._seed == llm._seed


def test_chat_completion_openai_v1_gives_the_openai_types(llm: wl.Llama) -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    # each from an empty cache (fast mode's prompt products round by how many tokens run)
    msgs = [{"role": "user", "content": "Say hi"}]
    llm.reset()
    plain = llm.create_chat_completion(msgs, max_tokens=3, temperature=0.0)
    llm.reset()
    typed = llm.create_chat_completion_openai_v1(msgs, max_tokens=3, temperature=0.0)
    assert isinstance(typed, ChatCompletion)
    assert typed.choices[0].message.content == plain["choices"][0]["message"]["content"]
    assert typed.usage is not None and typed.usage.prompt_tokens == plain["usage"]["prompt_tokens"]
    llm.reset()
    chunks = list(
        llm.create_chat_completion_openai_v1(msgs, max_tokens=3, temperature=0.0, stream=True)
    )
    assert chunks and all(isinstance(c, ChatCompletionChunk) for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain["choices"][0]["message"]["content"]


def fake_hub(monkeypatch: pytest.MonkeyPatch, repo_files: dict[str, Path]) -> list[dict]:
    """A stand-in for the `huggingface_hub` package (no network here): its file system lists
    `repo_files` and `hf_hub_download` returns the local file it maps to, recording each call."""
    import types

    calls: list[dict] = []

    class HfFileSystem:
        def ls(self, repo_id: str, recursive: bool = False) -> list[dict]:
            assert recursive
            return [{"name": f"{repo_id}/{name}", "type": "file"} for name in repo_files]

    def hf_hub_download(**kw: object) -> str:
        calls.append(kw)
        name = f"{kw['subfolder']}/{kw['filename']}" if kw["subfolder"] else kw["filename"]
        return str(repo_files[str(name)])

    def validate_repo_id(repo_id: str) -> None:
        if repo_id.count("/") != 1:
            raise ValueError(f"bad repo id {repo_id!r}")

    hub = types.ModuleType("huggingface_hub")
    hub.HfFileSystem = HfFileSystem  # type: ignore[attr-defined]
    hub.hf_hub_download = hf_hub_download  # type: ignore[attr-defined]
    utils = types.ModuleType("huggingface_hub.utils")
    utils.validate_repo_id = validate_repo_id  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setitem(sys.modules, "huggingface_hub.utils", utils)
    return calls


def test_from_pretrained_downloads_the_one_matching_file_and_opens_it(
    demo_gguf: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    files = {
        "README.md": tmp_path / "README.md",
        "SmolLM2-Q4_1.gguf": demo_gguf,
        "more/SmolLM2-Q8_0.gguf": demo_gguf,
        "more/extra.txt": tmp_path / "extra.txt",
    }
    calls = fake_hub(monkeypatch, files)
    llm = wl.Llama.from_pretrained(
        "org/smollm2",
        "*Q4_1.gguf",
        additional_files=["more/*.txt"],
        cache_dir=tmp_path,
        n_ctx=64,
        verbose=False,
    )
    assert llm.model_path == str(demo_gguf) and llm.n_ctx() == 64
    assert [(c["filename"], c["subfolder"], c["cache_dir"]) for c in calls] == [
        ("SmolLM2-Q4_1.gguf", None, tmp_path),
        ("extra.txt", "more", tmp_path),
    ]
    # a pattern must match exactly one file; the error lists what the repository has
    with pytest.raises(
        ValueError, match=r"expected one file of org/smollm2 to match '\*\.gguf', got 2"
    ):
        wl.Llama.from_pretrained("org/smollm2", "*.gguf")
    with pytest.raises(ValueError, match=r"got none; its files: .*README\.md"):
        wl.Llama.from_pretrained("org/smollm2", "*Q6_K.gguf")
    with pytest.raises(ValueError, match="bad repo id"):
        wl.Llama.from_pretrained("smollm2", "*.gguf")
    # without the package: llama-cpp-python's ImportError, with the install line
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError, match="pip install huggingface-hub"):
        wl.Llama.from_pretrained("org/smollm2", "*Q4_1.gguf")


def test_a_vocabulary_only_llama_has_the_context_it_asked_for(demo_gguf: Path) -> None:
    # llama-cpp-python's n_ctx() is its context's even without weights (512 by default)
    llm = wl.Llama(str(demo_gguf), vocab_only=True, verbose=False)
    assert llm.n_ctx() == 512 and list(llm.eval_tokens) == [] and llm.eval_tokens.maxlen == 512
    assert wl.Llama(str(demo_gguf), vocab_only=True, n_ctx=100, verbose=False).n_ctx() == 100
    trained = int(llm.metadata["llama.context_length"])
    assert wl.Llama(str(demo_gguf), vocab_only=True, n_ctx=0, verbose=False).n_ctx() == trained
    again = pickle.loads(pickle.dumps(llm))
    assert again.n_ctx() == 512 and again.tokenize(b"Hi") == llm.tokenize(b"Hi")

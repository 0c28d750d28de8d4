"""`weightlift.Batch`: completions stepped together on one model, each answering exactly what it
answers alone (exact compute), in the shapes llama-cpp-python returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import weightlift

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "Name a fruit"}]


@pytest.fixture(scope="module")
def model(demo_gguf: Path) -> weightlift.Model:
    return weightlift.load_gguf(str(demo_gguf), n_ctx=256, n_threads=2, compute="exact")


def _drain(batch: weightlift.Batch) -> dict[int, list[tuple[str, Any, Any]]]:
    got: dict[int, list[tuple[str, Any, Any]]] = {}
    while batch.running:
        for id, kind, value, timings in batch.step():
            got.setdefault(id, []).append((kind, value, timings))
    return got


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same response but for its id and creation time."""
    for key in ("id", "created"):
        a.pop(key), b.pop(key)
    assert a == b


def test_batched_completions_answer_what_each_answers_alone(model: weightlift.Model):
    kw: dict[str, Any] = {"max_tokens": 10, "temperature": 0}
    alone = [model.create_completion(p, **kw) for p in PROMPTS]
    alone_chat = list(model.create_chat_completion(CHAT, stream=True, **kw))
    batch = weightlift.Batch(model, parallel=4)
    assert (batch.parallel, batch.n_ctx, batch.running) == (4, 256, 0)
    ids = [model.create_completion(p, batch=batch, **kw) for p in PROMPTS]
    chat = model.create_chat_completion(CHAT, batch=batch, stream=True, **kw)
    assert batch.running == 4
    got = _drain(batch)
    for id, want in zip(ids, alone, strict=True):
        [(kind, whole, timings)] = got[id]
        assert kind == "whole" and timings["eval_tokens"] == whole["usage"]["completion_tokens"] - 1
        _same(whole, want)
    *chunks, (end, usage, timings) = got[chat]
    whole = model.create_chat_completion(CHAT, **kw)
    assert (end, usage) == ("end", whole["usage"]) and timings["prompt_tokens"] > 0
    assert [c[0] for c in chunks] == ["chunk"] * len(alone_chat)
    for (_, c, _), want in zip(chunks, alone_chat, strict=True):
        _same(c, want)


def test_batch_refusals_name_the_argument(model: weightlift.Model, demo_gguf: Path):
    with pytest.raises(weightlift.WeightliftError, match="parallel: expected at least 1"):
        weightlift.Batch(model, parallel=0)
    batch = weightlift.Batch(model, parallel=1)
    first = model.create_completion("Hi", max_tokens=40, batch=batch)
    with pytest.raises(weightlift.WeightliftError, match="every slot busy"):
        model.create_completion("Hi", max_tokens=4, batch=batch)
    assert batch.cancel(first) and batch.running == 0 and not batch.cancel(first)
    with pytest.raises(weightlift.ContextFullError):
        model.create_completion("word " * 300, batch=batch)
    other = weightlift.load_gguf(str(demo_gguf), n_ctx=64)
    with pytest.raises(ValueError, match="a Batch of this model"):
        other.create_completion("Hi", batch=batch)
    assert batch.running == 0


def test_a_cache_of_several_sequences_is_planned_and_held_as_slots(demo_gguf: Path):
    m = weightlift.Model(str(demo_gguf), devices="virtual:2x96MiB,cpu", compute="exact")
    m.load(cache=weightlift.CacheSpec(256, 3, "fp16"))
    assert m.cache is not None and (m.cache.batch_size, m.cache.max_seq_len) == (1, 256)
    plan = m.plan
    assert plan is not None and plan.cache is not None and plan.cache.batch_size == 3
    one = weightlift.Model(str(demo_gguf), devices="virtual:2x96MiB,cpu")
    one.load(cache=weightlift.CacheSpec(256, 1, "fp16"))
    assert one.plan is not None
    kv = sum(d.kv for d in plan.devices)
    assert kv == 3 * sum(d.kv for d in one.plan.devices) > 0
    held = m.memory()
    for d in plan.devices:
        want = d.weights + d.kv + d.scratch
        assert abs(held[d.name] - want) <= want // 100, (d.name, held[d.name], want)
    batch = weightlift.Batch(m, parallel=3)
    assert m.memory() == held  # the planned slots, no new allocation
    ids = [m.create_completion(p, max_tokens=6, temperature=0, batch=batch) for p in PROMPTS]
    got = _drain(batch)
    alone = [m.create_completion(p, max_tokens=6, temperature=0) for p in PROMPTS]
    for id, want in zip(ids, alone, strict=True):
        assert got[id][0][1]["choices"] == want["choices"]


@pytest.mark.parametrize(("dtype", "offload"), [("q8", False), ("q4", False), ("fp16", True)])
def test_quantised_and_offloaded_slots_answer_what_each_answers_alone(
    demo_gguf: Path, dtype: str, offload: bool
):
    m = weightlift.Model(str(demo_gguf), devices="virtual:2x96MiB,cpu", compute="exact")
    m.load(cache=weightlift.CacheSpec(128, 2, dtype, offload=offload))
    assert m.cache is not None and (m.cache.dtype, m.cache.offload) == (dtype, offload)
    batch = weightlift.Batch(m, parallel=2)
    ids = [m.create_completion(p, max_tokens=6, temperature=0, batch=batch) for p in PROMPTS[:2]]
    got = _drain(batch)
    alone = [m.create_completion(p, max_tokens=6, temperature=0) for p in PROMPTS[:2]]
    for id, want in zip(ids, alone, strict=True):
        assert got[id][0][1]["choices"] == want["choices"]


@pytest.mark.parametrize("compute", ["exact", "fast"])
def test_tensor_parallel_slots_batch_and_answer_what_each_answers_alone(
    demo_gguf: Path, compute: str
):
    # three slots of a tensor-parallel load: each a cache split by kv heads over the devices,
    # stepped in one pass per token
    m = weightlift.Model(str(demo_gguf), devices="virtual:2x256MiB,cpu", compute=compute)
    m.load(cache=weightlift.CacheSpec(128, 3, "fp16"), strategy="tensor_parallel")
    assert m.cache is not None and (m.cache.batch_size, m.cache.max_seq_len) == (1, 128)
    batch = weightlift.Batch(m, parallel=3)
    ids = [m.create_completion(p, max_tokens=6, temperature=0, batch=batch) for p in PROMPTS]
    got = _drain(batch)
    alone = [m.create_completion(p, max_tokens=6, temperature=0) for p in PROMPTS]
    for id, want in zip(ids, alone, strict=True):
        assert got[id][0][1]["choices"] == want["choices"]

"""Multi-process tensor parallelism from Python: each rank is a model of its own that loads only
its share (``load_tp(world=..., rank=...)``, its one device standing for every rank), and the
ranks, run here as threads joined by ``TPContext.thread_group``, meet only through the
collectives. Compared with the single-process ``load_tp`` over as many devices, itself checked
against ``cpu`` and transformers in test_engine_tp.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import weightlift as wl
from weightlift import PlanError, UnsupportedError, WeightliftError

RT = {"max_input_len": 16, "max_attention_size": 256, "max_dq_size": 1 << 16}
SIZE = "48MiB"


def gguf(tiny_llama_st: Path) -> Path:
    return tiny_llama_st.parent / "gguf" / "tiny-llama-Q8_0.gguf"


def load_ranks(path: Path, n: int, **load: Any) -> list[wl.Model]:
    ranks = []
    for r in range(n):
        m = wl.Model(path, devices=f"virtual:{SIZE},cpu", runtime=RT)
        m.load_tp(world=f"localhost:{n}", rank=r, **load)
        ranks.append(m)
    return ranks


def on_threads(ranks: list[wl.Model], job: Any) -> list[Any]:
    members = wl.TPContext.thread_group(len(ranks))
    for m, member in zip(ranks, members, strict=True):
        tp = m.tp
        assert tp is not None
        tp.join(member)
    with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
        return list(pool.map(job, ranks))


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_give_the_single_process_logits_and_text(tiny_llama_st: Path, n: int) -> None:
    path = gguf(tiny_llama_st)
    ids = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889] * 2
    whole = wl.Model(path, devices=f"virtual:{n}x{SIZE},cpu", runtime=RT)
    whole.load_tp(expect_cache_tokens=64, expect_cache_base="f32")
    ranks = load_ranks(path, n, expect_cache_tokens=64, expect_cache_base="f32")
    plan = whole.plan
    assert plan is not None
    for r, m in enumerate(ranks):
        tp = m.tp
        assert tp is not None and tp.rank == r and tp.transport == "host-staged"
        assert whole.tp is not None and tp.kv_split == whole.tp.kv_split
        # The rank's device holds exactly the single-process plan's column for that rank.
        d = plan.devices[r]
        assert m.memory()["virtual:0"] == d.weights + d.kv + d.scratch, r
    for compute in ("exact", "fast"):
        whole.compute = compute
        for m in ranks:
            m.compute = compute
        want = whole.forward(ids, logits="all")
        got = on_threads(ranks, lambda m: m.forward(ids, logits="all"))
        for r, g in enumerate(got):
            assert np.array_equal(g, want), f"rank {r} of {n}, {compute}"
        text = whole.generate(ids[:4], max_new_tokens=8, temperature=0.0)
        texts = on_threads(ranks, lambda m: m.generate(ids[:4], max_new_tokens=8, temperature=0.0))
        assert texts == [text] * n
    assert ranks[0].tp is not None and ranks[0].tp.transport == "threads"


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("compute", ["exact", "fast"])
def test_ranks_batch_and_answer_what_each_answers_alone(
    tiny_llama_st: Path, n: int, compute: str
) -> None:
    """``Batch`` on ranks that all make the same calls: its steps run each as one batch over the
    ranks (a step's prompts and decode tokens together), and every completion answers what it
    answers alone and in the single-process batch (the logits' bits are checked in Rust, in
    tp_rank.rs). Fresh models per mode: a slot's kept prefix was computed in its model's mode."""
    path = gguf(tiny_llama_st)
    whole = wl.Model(path, devices=f"virtual:{n}x{SIZE},cpu", runtime=RT)
    whole.load_tp(expect_cache_tokens=64, expect_cache_base="f32")
    ranks = load_ranks(path, n, expect_cache_tokens=64, expect_cache_base="f32")
    for m in [whole, *ranks]:
        m.compute = compute
    texts = ["Once upon a time", "The cat", "1, 2, 3,"]
    kw: dict[str, Any] = {"max_tokens": 6, "temperature": 0}

    def batched(m: wl.Model) -> list[Any]:
        batch = wl.Batch(m, parallel=3)
        jobs = [m.create_completion(t, batch=batch, **kw) for t in texts]
        got: dict[int, list[Any]] = {}
        while batch.running:
            for job, _, value, _ in batch.step():
                got.setdefault(job, []).append(value)
        return [got[job][0]["choices"] for job in jobs]

    def alone(m: wl.Model) -> list[Any]:
        return [m.create_completion(t, **kw)["choices"] for t in texts]

    want = alone(whole)
    assert batched(whole) == want
    assert on_threads(ranks, batched) == [want] * n
    assert on_threads(ranks, alone) == [want] * n


def test_rank_errors_name_the_cause(tiny_llama_st: Path) -> None:
    path = gguf(tiny_llama_st)
    m = wl.Model(path, devices=f"virtual:{SIZE},cpu", runtime=RT)
    with pytest.raises(PlanError, match="rank: expected a world too"):
        m.load_tp(expect_cache_tokens=64, rank=0)
    with pytest.raises(PlanError, match="below the world's 2 ranks"):
        m.load_tp(expect_cache_tokens=64, world="localhost:2", rank=2)
    two = wl.Model(path, devices=f"virtual:2x{SIZE},cpu", runtime=RT)
    with pytest.raises(PlanError, match="one accelerator, this rank's GPU"):
        two.load_tp(expect_cache_tokens=64, world="localhost:2", rank=0)

    m.load_tp(expect_cache_tokens=64, world="localhost:2", rank=1)
    # Without a transport that reaches the other rank, nothing runs.
    with pytest.raises(UnsupportedError, match="through the host-staged collectives"):
        m.forward([1, 2])
    tp = m.tp
    assert tp is not None
    members = wl.TPContext.thread_group(2)
    with pytest.raises(ValueError, match="this context's rank 1, got a member for rank 0"):
        tp.join(members[0])
    tp.join(members[1])
    with pytest.raises(ValueError, match="has joined a context already"):
        tp.join(members[1])
    # Rank 0 never comes: its member is dropped, so rank 1 fails instead of waiting.
    del members
    with pytest.raises(WeightliftError, match="rank 0 left the group"):
        m.forward([1, 2])
    with pytest.raises(UnsupportedError, match="no NCCL transport"):
        tp.join_nccl()
    with pytest.raises(ValueError, match=r"join_nccl: expected wait in seconds, finite and >= 0"):
        tp.join_nccl(wait=float("nan"))


def test_a_cache_made_for_a_rank_is_its_share_and_batches(tiny_llama_st: Path) -> None:
    path = gguf(tiny_llama_st)
    whole = wl.Model(path, devices=f"virtual:2x{SIZE},cpu", runtime=RT)
    whole.load_tp(expect_cache_tokens=64, expect_cache_base="f32")
    ranks = load_ranks(path, 2, expect_cache_tokens=64, expect_cache_base="f32")
    seqs = [[1, 450, 4996, 17354, 1701], [1, 432, 17204], [975]]
    want = [whole.forward(ids, logits="last")[-1] for ids in seqs]

    def batched(m: wl.Model) -> Any:
        # the planned cache's dtype, so that the rows are the ones the whole model computes
        caches = [wl.Cache(m, max_seq_len=64, dtype="fp32") for _ in seqs]
        return m.forward_batch(list(zip(caches, seqs, strict=True)))

    for r, got in enumerate(on_threads(ranks, batched)):
        for row, w in zip(got, want, strict=True):
            assert np.array_equal(row.view(np.uint32), w.view(np.uint32)), f"rank {r}"

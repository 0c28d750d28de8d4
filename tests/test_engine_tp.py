"""Tensor parallelism: load_tp over 2 and 3 virtual devices, TPContext tables and collectives
compared with numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import weightlift as wl
from gguf import GGUFReader
from tensor_truth import gguf_truth, truth_of

RT = {"max_input_len": 16, "max_attention_size": 256, "max_dq_size": 1 << 16}


def covers(table: list[tuple[int, int, int]], total: int) -> bool:
    pos = 0
    for _, a, b in table:
        if a != pos or b <= a:
            return False
        pos = b
    return pos == total


@pytest.mark.parametrize("n_dev", [2, 3])
@pytest.mark.parametrize("sub", ["safetensors", "safetensors-sharded", "gguf/tiny-llama-Q8_0.gguf"])
def test_load_tp_parts_reassemble(tiny_llama_st: Path, sub: str, n_dev: int) -> None:
    path = tiny_llama_st.parent / sub
    m = wl.Model(path, devices=f"virtual:{n_dev}x48MiB", runtime=RT)
    m.load_tp(gpu_split=[0.04] * n_dev, expect_cache_tokens=256)
    truth = truth_of(path)
    for name, want in truth.items():
        assert m.tensor(name).tobytes() == want, name
    q = next(n for n in truth if "q_proj" in n or "attn_q" in n)
    assert "," in m.device_of(q), "attention weights are split"
    usage = m.device_usage()
    assert sum(v for k, v in usage.items() if k.startswith("virtual")) >= sum(
        map(len, truth.values())
    )
    m.unload()
    assert all(v == 0 for v in m.device_usage().values())


@pytest.fixture()
def tp(tiny_llama_st: Path) -> wl.TPContext:
    m = wl.Model(tiny_llama_st, devices="virtual:3x48MiB", runtime=RT)
    ctx = wl.TPContext(m, gpu_split=[0.03, 0.02, 0.02], expect_cache_tokens=256)
    ctx.finalize()
    return ctx


def test_tables_cover_each_dimension(tp: wl.TPContext) -> None:
    # tiny-llama: 2 KV heads, 4 heads, intermediate 768, hidden 256, vocab 32000.
    assert covers(tp.kv_split, 2) and covers(tp.q_split, 4)
    assert covers(tp.id_split, 768) and all((b - a) % 128 == 0 for _, a, b in tp.id_split)
    assert covers(tp.rs_split, 256) and all((b - a) % 32 == 0 for _, a, b in tp.rs_split)
    assert covers(tp.vc_split, 32000)
    assert [2 * (b - a) for _, a, b in tp.kv_split] == [b - a for _, a, b in tp.q_split]
    assert tp.ex_split == []  # a dense model: its MLPs follow the id table
    for t, name in enumerate(["kv", "id", "vc", "rs", "q", "ex"]):
        assert tp.get_split(t) == getattr(tp, f"{name}_split")
        assert tp.get_devs(t) == [d for d, _, _ in tp.get_split(t)]
    assert tp.all_devices() == sorted({d for t in (0, 1, 2) for d, _, _ in tp.get_split(t)})
    kinds = (wl.BROADCAST_KV, wl.BROADCAST_ID, wl.BROADCAST_VC, wl.BROADCAST_RS, wl.BROADCAST_Q)
    assert (*kinds, wl.BROADCAST_EX) == (0, 1, 2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"0 \(KV\) to 5 \(EX\)"):
        tp.get_split(6)


def test_broadcast_gather_allgather_add_residual_equal_numpy(tp: wl.TPContext) -> None:
    rng = np.random.default_rng(0)
    rows = 5
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    src = wl.tensor(x, "cpu")
    split = tp.rs_split
    copies = tp.broadcast(0, src, wl.BROADCAST_RS)
    assert [c.device for c in copies] == [tp.device_name(d) for d, _, _ in split]
    for c in copies:
        assert np.array_equal(c.numpy(), x)

    parts = [wl.tensor(x[:, a:b], "cpu").to(tp.device_name(d)) for d, a, b in split]
    assert np.array_equal(tp.gather(0, parts, wl.BROADCAST_RS), x)
    assert np.array_equal(tp.gather(1, parts, wl.BROADCAST_RS), x)

    everywhere = tp.allgather(0, parts, wl.BROADCAST_RS, wl.BROADCAST_KV)
    assert [t.device for t in everywhere] == [tp.device_name(d) for d, _, _ in tp.kv_split]
    for t in everywhere:
        assert np.array_equal(t.numpy(), x)

    # add_residual: target[i] += source[i][:, a*dim:b*dim], with dim = head_dim over the KV table.
    hd = 64
    kv = tp.kv_split
    r = rng.standard_normal((rows, 2 * hd)).astype(np.float32)
    y = rng.standard_normal((rows, 2 * hd)).astype(np.float32)
    targets = [wl.tensor(r[:, a * hd : b * hd], "cpu").to(tp.device_name(d)) for d, a, b in kv]
    sources = [wl.tensor(y, "cpu").to(tp.device_name(d)) for d, _, _ in kv]
    tp.add_residual(targets, sources, wl.BROADCAST_KV, hd)
    for t, (_, a, b) in zip(targets, kv, strict=True):
        np.testing.assert_array_equal(t.numpy(), r[:, a * hd : b * hd] + y[:, a * hd : b * hd])
    tp.wait_streams()

    # f16 gathers keep their dtype.
    h = x.astype(np.float16)
    parts16 = [wl.tensor(h[:, a:b], "cpu").to(tp.device_name(d)) for d, a, b in split]
    g = tp.gather(0, parts16, wl.BROADCAST_RS)
    assert g.dtype == np.float16 and np.array_equal(g, h)


def test_gather_rejects_wrong_shapes(tp: wl.TPContext) -> None:
    x = np.zeros((2, 7), dtype=np.float32)
    parts = [wl.tensor(x, "cpu").to(tp.device_name(d)) for d, _, _ in tp.rs_split]
    with pytest.raises(ValueError, match="gather input for device") as e:
        tp.gather(0, parts, wl.BROADCAST_RS)
    assert "got 2 × 7 F32" in str(e.value)


def test_sin_cos_match_numpy(tp: wl.TPContext) -> None:
    sin, cos = tp.get_sin_cos()
    assert [s.device for s in sin] == [tp.device_name(d) for d in tp.all_devices()]
    s = sin[0].numpy()
    n, hd = s.shape
    inv = 10000.0 ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    freqs = np.outer(np.arange(n, dtype=np.float64), inv)
    emb = np.concatenate([freqs, freqs], axis=1)
    np.testing.assert_allclose(s, np.sin(emb), atol=1e-6)
    np.testing.assert_allclose(cos[-1].numpy(), np.cos(emb), atol=1e-6)


def test_scratch_slices(tp: wl.TPContext) -> None:
    n = max(tp.all_devices()) + 1
    tp.reserve_scratch([1 << 16] * n)
    tp.begin_scratch_alloc_tp()
    a = tp.get_scratch_slice_tp(4, "float16", wl.BROADCAST_ID)
    b = tp.get_scratch_slice_tp_bc(4, "float32", wl.BROADCAST_ID)
    assert [(d, r, c) for d, _, r, c in a] == [(d, 4, e - s) for d, s, e in tp.id_split]
    assert all(c == 768 for _, _, _, c in b)
    for (d1, o1, r1, c1), (d2, o2, _, _) in zip(a, b, strict=True):
        assert d1 == d2 and o2 >= o1 + r1 * c1 * 2, "slices do not overlap"
    tp.begin_scratch_alloc_tp()
    assert tp.get_scratch_slice_tp(4, "float16", wl.BROADCAST_ID)[0][1] == 0
    from weightlift._errors import OutOfMemoryError

    with pytest.raises(OutOfMemoryError, match="scratch"):
        tp.get_scratch_slice_tp(1 << 20, "float32", wl.BROADCAST_ID)
    tp.unload()


def test_load_tp_demo_model_three_devices(demo_gguf: Path, demo_reader: GGUFReader) -> None:
    # SmolLM2: 3 KV heads, 9 heads, intermediate 1536, Q4_1 blocks split on block boundaries.
    m = wl.Model(demo_gguf, devices="virtual:3x64MiB", runtime=RT)
    m.load_tp(expect_cache_tokens=512, expect_cache_base="q4")
    truth = gguf_truth(demo_reader)
    for name, want in truth.items():
        assert m.tensor(name).tobytes() == want, name
    assert m.device_of("blk.0.attn_k.weight") == "virtual:0,virtual:1,virtual:2"
    tp = wl.TPContext(m)
    assert covers(tp.kv_split, 3) and covers(tp.q_split, 9) and covers(tp.id_split, 1536)
    m.unload()


# --- The tensor-parallel forward pass: load_tp, then forward and generate on the devices. ---

TINY_LLAMA_IDS = [1, 415, 2936, 9060, 285, 1142, 28705, 28770, 28734]


def widened_mlp(src: Path, dst: Path) -> Path:
    """A tiny safetensors model with its MLP widened to 768 by zero rows of gate/up (each half
    of phi3's stacked gate_up on its own) and zero columns of down (exllamav2's split wants
    128-wide units); the added units contribute exact zeros, so transformers' logits of the
    original still hold."""
    import json

    from safetensors.numpy import load_file, save_file

    dst.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    inter = cfg["intermediate_size"]
    cfg["intermediate_size"] = 768
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())

    def rows(t: np.ndarray) -> np.ndarray:
        return np.concatenate([t, np.zeros((768 - t.shape[0], t.shape[1]), t.dtype)], axis=0)

    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith("gate_up_proj.weight"):
            t = np.concatenate([rows(t[:inter]), rows(t[inter:])], axis=0)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            t = rows(t)
        elif name.endswith("down_proj.weight"):
            t = np.concatenate([t, np.zeros((t.shape[0], 768 - t.shape[1]), t.dtype)], axis=1)
        out[name] = np.ascontiguousarray(t)
    save_file(out, dst / "model.safetensors")
    return dst


QWEN2 = Path(__file__).parent / "data" / "tiny-qwen2"


def cases(tiny_llama_st: Path, tmp: Path) -> list[tuple[str, Path, list[int]]]:
    import json

    qwen_ids = json.loads((QWEN2 / "stats.json").read_text())["ids"]
    llama_ids = json.loads((tiny_llama_st.parent / "ids.json").read_text())["ids"]
    return [
        ("llama-gguf", tiny_llama_st.parent / "gguf" / "tiny-llama-Q8_0.gguf", llama_ids),
        ("qwen2-safetensors", widened_mlp(QWEN2, tmp / "qwen2"), qwen_ids),
    ]


@pytest.mark.parametrize("n_dev", [2, 3])
def test_tp_forward_and_generate_equal_cpu(tiny_llama_st: Path, tmp_path: Path, n_dev: int) -> None:
    for name, path, ids in cases(tiny_llama_st, tmp_path):
        for compute in ("exact", "fast"):
            one = wl.Model(path, devices="cpu", runtime=RT, compute=compute)
            one.load(cache={"max_seq_len": 256, "dtype": "f32"})
            tp = wl.Model(path, devices=f"virtual:{n_dev}x48MiB,cpu", runtime=RT, compute=compute)
            tp.load_tp(expect_cache_tokens=256, expect_cache_base="f32")
            want = one.forward(ids, logits="all")
            got = tp.forward(ids, logits="all")
            scale = max(1.0, float(np.abs(want).max()))
            d = float(np.abs(got - want).max()) / scale
            # f32 reduction order of the partial sums only (the Rust tp_forward test says why).
            assert d <= 1e-4, f"{name} {compute} on {n_dev}: max|Δ|/scale {d}"
            assert np.array_equal(got.argmax(-1), want.argmax(-1))
            a = one.generate(ids[:4], max_new_tokens=8, temperature=0.0)
            b = tp.generate(ids[:4], max_new_tokens=8, temperature=0.0)
            assert a == b, f"{name} {compute}: greedy text"
            stats = tp.transfer_stats()
            assert stats["copies"] > 0 and stats["bytes"] > 0 and stats["seconds"] > 0


def test_tp_qwen2_matches_transformers(tmp_path: Path) -> None:
    import json

    ids = json.loads((QWEN2 / "stats.json").read_text())["ids"]
    m = wl.Model(
        widened_mlp(QWEN2, tmp_path / "q"),
        devices="virtual:2x48MiB,cpu",
        runtime=RT,
        compute="exact",
    )
    m.load_tp(expect_cache_tokens=64, expect_cache_base="f32")
    got = m.forward(ids, logits="all")
    want = np.load(QWEN2 / "hf_logits.npy")
    assert float(np.abs(got - want).max()) <= 1e-3
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3"])
def test_tp_gemma_and_phi3_match_transformers(tmp_path: Path, family: str) -> None:
    """Gemma's post-norms, soft-caps and sliding layers, and phi3's stacked qkv and gate_up
    matrices (each device its rows of every block), through load_tp over 2 and 3 devices."""
    import json

    data = Path(__file__).parent / "data" / f"tiny-{family}"
    ids = json.loads((data / "stats.json").read_text())["ids"]
    path = widened_mlp(data, tmp_path / family)
    want = np.load(data / "hf_logits.npy")
    for n_dev in (2, 3):
        m = wl.Model(path, devices=f"virtual:{n_dev}x48MiB,cpu", runtime=RT, compute="exact")
        m.load_tp(expect_cache_tokens=64, expect_cache_base="f32")
        got = m.forward(ids, logits="all")
        assert float(np.abs(got - want).max()) <= 1e-3, f"{family} on {n_dev}"
        assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_model_tp_is_the_context_the_forward_uses(tiny_llama_st: Path) -> None:
    path = tiny_llama_st.parent / "gguf" / "tiny-llama-Q8_0.gguf"
    m = wl.Model(path, devices="virtual:2x48MiB,cpu", runtime=RT)
    assert m.tp is None
    m.load_tp(gpu_split=[0.04, 0.04], expect_cache_tokens=256)
    tp = m.tp
    assert tp is not None and m.tp is tp
    plan = m.plan
    assert plan is not None
    assert covers(tp.kv_split, 2) and covers(tp.rs_split, 256)
    m.forward(TINY_LLAMA_IDS, logits="last")
    stats = m.transfer_stats()
    # The embedding scattered, per layer two all-gathers and two reductions, then the head's
    # all-gather and gather: every transfer one copy.
    rs, kv, idt, vc = (len(t) for t in (tp.rs_split, tp.kv_split, tp.id_split, tp.vc_split))

    def pairs(src: list[tuple[int, int, int]]) -> int:
        return sum(1 for r in tp.rs_split for s in src if s[0] != r[0])

    per_layer = (rs + kv) + (rs + idt) + pairs(tp.kv_split) + pairs(tp.id_split)
    assert stats["copies"] == rs + 2 * per_layer + (rs + vc) + vc
    # Peer copies (device to device on GPUs that allow it) are on by default and can be
    # turned off for the host-staged route; the host path's copies are the same either way.
    assert tp.peer_copies is True
    tp.peer_copies = False
    assert tp.peer_copies is False and m.tp.peer_copies is False
    m.forward(TINY_LLAMA_IDS, logits="last")
    assert m.transfer_stats()["copies"] == stats["copies"]
    tp.peer_copies = True
    # Unloading the context frees its staging: the forward pass then refuses by name.
    tp.unload()
    with pytest.raises(Exception, match="staging"):
        m.forward(TINY_LLAMA_IDS)
    m.unload()
    assert m.tp is None
    assert all(v == 0 for v in m.device_usage().values())


@pytest.mark.parametrize("n_dev", [2, 3])
def test_tp_plan_equals_forward_peak(tiny_llama_st: Path, n_dev: int) -> None:
    path = tiny_llama_st.parent / "gguf" / "tiny-llama-Q8_0.gguf"
    m = wl.Model(path, devices=f"virtual:{n_dev}x48MiB,cpu", runtime=RT)
    m.load_tp(expect_cache_tokens=256)
    m.forward(list(range(1, 40)), logits="all")
    plan = m.plan
    assert plan is not None
    peak = m.peak_memory()
    for d in plan.devices:
        if not d.name.startswith("virtual"):
            continue
        want = d.weights + d.kv + d.scratch
        assert abs(peak[d.name] - want) <= 0.01 * want, (d.name, want, peak[d.name])
        assert m.memory()[d.name] == want


def test_tp_refuses_what_it_cannot_run(tiny_llama_st: Path) -> None:
    path = tiny_llama_st.parent / "gguf" / "tiny-llama-Q8_0.gguf"
    m = wl.Model(path, devices="virtual:2x48MiB,cpu", runtime=RT)
    m.load_tp(gpu_split=[0.04, 0.04], expect_cache_tokens=64)
    # A cache laid out for one device, not split by kv heads like the model's.
    other = wl.Model(path, devices="cpu", runtime=RT)
    cache = wl.Cache(other, max_seq_len=64)
    other.load(cache=cache)
    with pytest.raises(ValueError, match="split by kv heads") as e:
        m.forward([1, 2], cache=cache)
    assert "a cache that is not split" in str(e.value)
    assert cache.seq_len == 0, "refused before any compute"


def test_a_cache_made_for_a_tp_model_is_split_and_batches(tiny_llama_st: Path) -> None:
    path = tiny_llama_st.parent / "gguf" / "tiny-llama-Q8_0.gguf"
    m = wl.Model(path, devices="virtual:2x48MiB,cpu", runtime=RT)
    m.load_tp(gpu_split=[0.04, 0.04], expect_cache_tokens=64)
    seqs = [TINY_LLAMA_IDS, [1, 5, 9, 12, 40, 41], [3]]
    caches = [wl.Cache(m, max_seq_len=64) for _ in seqs]
    got = m.forward_batch(list(zip(caches, seqs, strict=True)))
    assert [c.seq_len for c in caches] == [len(s) for s in seqs]
    for row, cache, ids in zip(got, caches, seqs, strict=True):
        cache.reset()
        alone = m.forward(ids, cache=cache, logits="last")
        assert np.array_equal(row.view(np.uint32), alone[-1].view(np.uint32))

"""Tensor parallelism: load_tp over 2 and 3 virtual devices, TPContext tables and collectives
compared with numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors
import weightlift._native as wl
from gguf import GGUFReader

RT = {"max_input_len": 16, "max_attention_size": 256, "max_dq_size": 1 << 16}


def truth_of(path: Path) -> dict[str, bytes]:
    if path.suffix == ".gguf":
        return {t.name: np.ascontiguousarray(t.data).tobytes() for t in GGUFReader(path).tensors}
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, info in safetensors.deserialize(f.read_bytes()):
            out[name] = bytes(info["data"])
    return out


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
    for t, name in enumerate(["kv", "id", "vc", "rs", "q"]):
        assert tp.get_split(t) == getattr(tp, f"{name}_split")
        assert tp.get_devs(t) == [d for d, _, _ in tp.get_split(t)]
    assert tp.all_devices() == sorted({d for t in (0, 1, 2) for d, _, _ in tp.get_split(t)})
    assert (wl.BROADCAST_KV, wl.BROADCAST_ID, wl.BROADCAST_VC, wl.BROADCAST_RS, wl.BROADCAST_Q) == (
        0,
        1,
        2,
        3,
        4,
    )


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


def test_load_tp_demo_model_three_devices(demo_gguf: Path) -> None:
    # SmolLM2: 3 KV heads, 9 heads, intermediate 1536, Q4_1 blocks split on block boundaries.
    m = wl.Model(demo_gguf, devices="virtual:3x64MiB", runtime=RT)
    m.load_tp(expect_cache_tokens=512, expect_cache_base="q4")
    truth = truth_of(demo_gguf)
    for name, want in truth.items():
        assert m.tensor(name).tobytes() == want, name
    assert m.device_of("blk.0.attn_k.weight") == "virtual:0,virtual:1,virtual:2"
    tp = wl.TPContext(m)
    assert covers(tp.kv_split, 3) and covers(tp.q_split, 9) and covers(tp.id_split, 1536)
    m.unload()

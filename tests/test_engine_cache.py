"""Cache: exact sizes, lazy co-location, round-trip error bounds per dtype (computed with numpy),
offload."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import weightlift
import weightlift as wl

RT = {"max_input_len": 16, "max_attention_size": 256, "max_dq_size": 1 << 16}

# Bytes per element of K and V in each cache dtype.
BYTES = {
    "fp16": (2.0, 2.0),
    "bf16": (2.0, 2.0),
    "fp8": (1.0, 1.0),
    "q8": (8.5 / 8, 8.5 / 8),
    "q6": (8.5 / 8, 4.5 / 8),
    "q4": (4.5 / 8, 4.5 / 8),
}


def bound(dtype: str, is_v: bool, x: np.ndarray) -> np.ndarray:
    """The documented bound per value. Quantised kinds store each group of 32 consecutive
    head_dim values Hadamard-turned, so their bound is on the group's L2 norm `‖g‖`."""
    kind = {"q6": ("q8", "q4")}.get(dtype, (dtype, dtype))[int(is_v)]
    groups = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    norm = np.sqrt((groups**2).sum(axis=-1)) * np.sqrt(32)
    norm = np.repeat(norm, 32, axis=-1).reshape(x.shape)
    ax = np.abs(x)
    return {
        "fp16": ax * 2.0**-11 + 2.0**-25,
        "bf16": ax * 2.0**-8 + 2.0**-133,
        "fp8": ax * 2.0**-4 + 2.0**-10,
        "q8": norm / 254 * (1 + 2.0**-9) + 2.0**-17,
        "q4": norm / 14 * (1 + 2.0**-9) + 2.0**-17,
    }[kind]


def nearest_bf16(x: np.ndarray) -> np.ndarray:
    """The bf16 value nearest each f32 (ties to the even one), picked by distance in float64
    from the two bf16 values around it: numpy has no bfloat16, and this does not reuse the
    engine's carry-based rounding."""
    bits = x.astype(np.float32).view(np.uint32)
    down = bits & np.uint32(0xFFFF0000)
    up = down + np.uint32(0x10000)
    lo = down.view(np.float32).astype(np.float64)
    hi = up.view(np.float32).astype(np.float64)
    xd = x.astype(np.float64)
    d_lo, d_hi = np.abs(xd - lo), np.abs(hi - xd)
    odd = ((down >> np.uint32(16)) & np.uint32(1)).astype(bool)
    pick_up = (d_hi < d_lo) | ((d_hi == d_lo) & odd)
    return np.where(pick_up, up, down).view(np.float32)


@pytest.fixture()
def model(demo_gguf: Path) -> wl.Model:
    return wl.Model(demo_gguf, devices="virtual:2x64MiB", runtime=RT)


@pytest.mark.parametrize("dtype", list(BYTES))
def test_lazy_cache_sizes_and_colocation(model: wl.Model, dtype: str) -> None:
    cache = wl.Cache(model, max_seq_len=512, batch_size=2, dtype=dtype)
    assert not cache.allocated
    model.load_autosplit(cache)
    assert cache.allocated
    k, v = BYTES[dtype]
    # SmolLM2: 3 KV heads × head_dim 64 per layer.
    per_layer = 3 * 64 * 512 * 2 * (k + v)
    mem = cache.memory()
    for layer, dev in enumerate(model.layer_devices):
        assert cache.device_of(layer) == dev
    for dev in set(model.layer_devices):
        n = model.layer_devices.count(dev)
        assert mem[dev] == per_layer * n
    plan = model.plan
    for d in plan.devices:
        assert mem.get(d.name, 0) == d.kv
    # Not offloaded, the cache's own prediction is the plan's kv column.
    assert cache.expected_memory() == mem
    model.unload()
    assert not cache.allocated


@pytest.mark.parametrize("dtype", list(BYTES))
def test_round_trip_within_bound(model: wl.Model, dtype: str) -> None:
    model.load(n_gpu_layers=-1)
    cache = wl.Cache(model, max_seq_len=64, batch_size=2, dtype=dtype, lazy=False)
    rng = np.random.default_rng(1)
    scale = np.array([0.01, 1.0, 30.0, 200.0], dtype=np.float32).repeat(16)
    k = (rng.standard_normal((2, 3, 9, 64)) * scale).astype(np.float32)
    v = (rng.standard_normal((2, 3, 9, 64)) * scale).astype(np.float32)
    cache.write(7, 40, k, v)
    k2, v2 = cache.read(7, 40, 49)
    assert k2.shape == (2, 3, 9, 64) and k2.dtype == np.float32
    if dtype == "fp8":
        # e4m3 saturates at ±448 (CUDA's satfinite conversion); the bound holds below that.
        big = np.abs(k) > 448
        assert big.any() and np.array_equal(k2[big], np.sign(k[big]) * 448)
        k, k2 = np.where(big, 0, k), np.where(big, 0, k2)
        big = np.abs(v) > 448
        v, v2 = np.where(big, 0, v), np.where(big, 0, v2)
    assert np.all(np.abs(k2 - k) <= bound(dtype, False, k))
    assert np.all(np.abs(v2 - v) <= bound(dtype, True, v))
    if dtype == "fp16":
        assert np.array_equal(k2, k.astype(np.float16).astype(np.float32))
    if dtype == "bf16":
        assert np.array_equal(k2, nearest_bf16(k))
    zeros, _ = cache.read(7, 0, 40)
    assert not zeros.any(), "other positions untouched"
    with pytest.raises(ValueError, match="within max_seq_len 64"):
        cache.read(7, 60, 70)
    with pytest.raises(ValueError, match=r"\(2, 3, n_tokens, 64\)"):
        cache.write(7, 0, k[:, :2], v[:, :2])


def test_non_lazy_cache_needs_a_loaded_model(model: wl.Model) -> None:
    from weightlift._errors import WeightliftError

    with pytest.raises(WeightliftError, match="non-lazy cache needs a loaded model"):
        wl.Cache(model, max_seq_len=64, lazy=False)


def test_offloaded_cache_lives_on_the_host(model: wl.Model) -> None:
    cache = wl.Cache(model, max_seq_len=256, dtype="fp16", offload=True)
    model.load_autosplit(cache)
    assert cache.device_of(29) == model.layer_devices[29]
    # Every layer on the host (the cache formula), plus two slots (the layer in use and the
    # one being prefetched) on each device that computes two or more layers.
    layer = int(2 * 3 * 64 * 256 * BYTES["fp16"][0])
    devs = model.layer_devices
    want = {"cpu": 30 * layer} | {d: min(2, devs.count(d)) * layer for d in set(devs)}
    assert cache.memory() == want == cache.expected_memory()
    # The plan charged exactly that as kv (the whole cache on the cpu, the slots on each layer
    # device), and what is held is the plan's weights + kv + scratch, within 1 %.
    mem = model.memory()
    plan = model.plan
    assert plan.cache is not None and plan.cache.offload
    for d in plan.devices:
        assert d.kv == want.get(d.name, 0), d.name
        assert d.reserve == 0
        expect = d.weights + d.kv + d.scratch
        assert abs(mem.get(d.name, 0) - expect) <= expect / 100, (d.name, expect, mem)
    k = np.ones((1, 3, 2, 64), dtype=np.float32)
    cache.write(0, 0, k, -k)
    assert cache.fetch(0) == model.layer_devices[0]
    assert cache.fetch(1) == model.layer_devices[1]
    k2, v2 = cache.read(0, 0, 2)
    assert np.array_equal(k2, k) and np.array_equal(v2, -k)
    model.unload()
    assert cache.memory() == {} and all(v == 0 for v in model.device_usage().values())


def test_cache_oom_names_the_device(demo_gguf: Path) -> None:
    from weightlift._errors import OutOfMemoryError

    # With the host capped too, a 65536-token fp16 cache (1.4 GiB) has nowhere to go.
    model = wl.Model(demo_gguf, devices="virtual:2x64MiB,cpu:256MiB", runtime=RT)
    cache = wl.Cache(model, max_seq_len=65536, dtype="fp16")
    with pytest.raises(OutOfMemoryError) as e:
        model.load_autosplit(cache)
    assert "cpu is short by" in str(e.value) and "ctx 8192 fits" in str(e.value)
    assert all(v == 0 for v in model.device_usage().values())
    assert not cache.allocated


@pytest.mark.parametrize("dtype", list(BYTES))
def test_plan_cache_offload_matches_the_loaded_model(demo_gguf: Path, dtype: str) -> None:
    """wl.plan(..., cache_offload=True) predicts the kv column the loaded model then holds."""
    k, v = BYTES[dtype]
    layer = int(3 * 64 * 1024 * (k + v))  # SmolLM2: 3 KV heads × head_dim 64, ctx 1024
    rt = wl.RuntimeSpec(**RT)
    spec = wl.CacheSpec(1024, dtype=dtype)
    plan = wl.plan(demo_gguf, devices="virtual:2x64MiB", cache=spec, runtime=rt, cache_offload=True)
    assert plan.cache == wl.CacheSpec(1024, dtype=dtype, offload=True)
    devs = plan.layer_devices
    kv = {d.name: d.kv for d in plan.devices}
    assert kv["cpu"] == 30 * layer
    for name in ("virtual:0", "virtual:1"):
        assert kv[name] == min(2, devs.count(name)) * layer, name
    # The same request beside the layers: the whole cache on the layer devices.
    beside = wl.plan(demo_gguf, devices="virtual:2x64MiB", cache=spec, runtime=rt)
    assert {d.name: d.kv for d in beside.devices}.get(
        "cpu", 0
    ) == layer * beside.layer_devices.count("cpu")
    assert sum(d.kv for d in beside.devices) == 30 * layer

    model = wl.Model(demo_gguf, devices="virtual:2x64MiB", runtime=RT)
    cache = wl.Cache(model, max_seq_len=1024, dtype=dtype, offload=True)
    model.load_autosplit(cache)
    assert model.layer_devices == devs
    held = model.memory()
    for d in model.plan.devices:
        assert d.kv == kv[d.name], d.name
        expect = d.weights + d.kv + d.scratch
        assert abs(held.get(d.name, 0) - expect) <= expect / 100, (d.name, expect, held)
    assert cache.memory() == {n: b for n, b in kv.items() if b}
    model.unload()


def test_cache_offload_needs_a_cache(demo_gguf: Path) -> None:
    from weightlift._errors import PlanError

    with pytest.raises(PlanError, match="cache_offload=True: there is no cache to offload"):
        wl.plan(demo_gguf, devices="virtual:2x64MiB", cache_offload=True)


def test_a_host_too_small_for_an_offloaded_cache(demo_gguf: Path) -> None:
    """The cpu must hold the whole offloaded cache, 30 × 1,572,864 B = 45 MiB at ctx 2048 in
    fp16, beside the mapped token_embd (28.69 MiB) and the two 4 MiB staging buffers: an
    80 MiB cpu cannot (81.71 MiB with 18 KiB of cpu scratch). The checked fixes: a q8 cache
    (23.91 MiB), or the cache beside the layers."""
    from weightlift._errors import OutOfMemoryError

    spec = wl.CacheSpec(2048, offload=True)
    with pytest.raises(OutOfMemoryError) as e:
        wl.plan(
            demo_gguf,
            devices="virtual:2x64MiB,cpu:80MiB",
            cache=spec,
            runtime=wl.RuntimeSpec(**RT),
        )
    msg = str(e.value)
    assert "cpu is short by 1.72 MiB" in msg and "has 80.00 MiB" in msg, msg
    assert "45.00 MiB kv at ctx 2048 × batch 1 (fp16, offloaded)" in msg, msg
    assert "offloaded kv cache of all 30 layers" in msg, msg
    fixes = e.value.fixes
    assert "cache q8 saves 21.09 MiB and fits" in fixes, fixes
    assert (
        "the cache beside the layers instead of offloaded (offload=False) fits and frees "
        "45.00 MiB of host ram" in fixes
    ), fixes


def test_fit_with_cache_offload(demo_gguf: Path) -> None:
    """fit(cache_offload=True) keeps the cache offloaded while it searches: the answer plans,
    256 tokens more runs the cpu out of room. A 50 MiB cpu holds 36.69 MiB of token_embd and
    staging (2 × 4 MiB), leaving 13.31 MiB for a q4 cache of 30 × 216 B per token: 2048 tokens
    (in steps of 256)."""
    from weightlift._errors import OutOfMemoryError

    devices, rt = "virtual:2x64MiB,cpu:50MiB", wl.RuntimeSpec(**RT)
    best = wl.fit(demo_gguf, devices=devices, runtime=rt, cache_dtype="q4", cache_offload=True)
    assert best == 2048
    spec = wl.CacheSpec(best, dtype="q4", offload=True)
    plan = wl.plan(demo_gguf, devices=devices, runtime=rt, cache=spec)
    assert {d.name: d.kv for d in plan.devices}["cpu"] == 30 * 216 * best
    spec = wl.CacheSpec(best + 256, dtype="q4", offload=True)
    with pytest.raises(OutOfMemoryError, match="cpu is short by"):
        wl.plan(demo_gguf, devices=devices, runtime=rt, cache=spec)


def test_length_and_batch_are_keyword_only(model: wl.Model, demo_gguf: Path) -> None:
    """exllamav2 takes batch_size before max_seq_len, so positional sizes are refused rather
    than read one way or the other; max_seq_len defaults to the model's trained context."""
    with pytest.raises(TypeError):
        wl.Cache(model, 1, 8192)  # type: ignore[misc]
    cache = wl.Cache(model)
    assert cache.max_seq_len == wl.open(demo_gguf).spec.context_length == 8192
    assert cache.batch_size == 1
    # exllamav2's own default, -1, is the trained context too; other sizes below 1 are refused
    assert wl.Cache(model, max_seq_len=-1).max_seq_len == 8192
    with pytest.raises(wl.PlanError, match=r"max_seq_len: expected an int of at least 1, or -1"):
        wl.Cache(model, max_seq_len=-2)
    with pytest.raises(wl.PlanError, match=r"batch_size: expected an int of at least 1, got -1"):
        wl.Cache(model, max_seq_len=16, batch_size=-1)


def test_forward_batch_gives_each_sequence_its_own_bits_in_exact_mode(demo_gguf: Path) -> None:
    m = wl.load_gguf(demo_gguf, n_ctx=64, compute="exact")
    a, b = wl.Cache(m, max_seq_len=64), wl.Cache(m, max_seq_len=64)
    p1, p2 = [1, 504, 3201, 18908, 592], [9, 8, 7]
    rows = m.forward_batch([(a, p1), (b, p2)])
    for ids, row in ((p1, rows[0]), (p2, rows[1])):
        alone = m.forward(ids, cache=wl.Cache(m, max_seq_len=64))
        assert rows.shape == (2, alone.shape[1])
        assert np.array_equal(alone[0], row)
    # a decode step of one sequence beside a new prompt of another
    c = wl.Cache(m, max_seq_len=64)
    step = m.forward_batch([(a, [int(rows[0].argmax())]), (c, p2)])
    assert (a.seq_len, b.seq_len, c.seq_len) == (6, 3, 3)
    assert np.array_equal(step[1], rows[1])
    with pytest.raises(ValueError, match="a cache of its own"):
        m.forward_batch([(a, [1]), (a, [2])])
    with pytest.raises(weightlift.ContextFullError):
        m.forward_batch([(b, [1]), (c, [1] * 70)])
    assert (b.seq_len, c.seq_len) == (3, 3)


@pytest.mark.parametrize(
    ("devices", "dtype", "strategy"),
    [
        ("cpu", "q4", None),
        ("cpu", "q8", None),
        ("virtual:2x96MiB,cpu", "q6", "layers"),
        ("virtual:2x256MiB,cpu", "q4", "tensor_parallel"),
    ],
)
def test_a_restored_state_gives_the_next_token_the_bits_it_had(
    demo_gguf: Path, devices: str, dtype: str, strategy: str | None
) -> None:
    # llama-cpp-python's prompt caches restore a state and carry on: the next logits must be
    # those the cache gave before, on a quantised cache (whose groups a decode and encode
    # again would move) and on one split by heads too
    m = wl.Model(demo_gguf, devices=devices, compute="exact")
    m.load(cache=wl.CacheSpec(128, 1, dtype), **({"strategy": strategy} if strategy else {}))
    cache = m.cache
    assert cache is not None and cache.dtype == dtype
    m.forward(list(range(100, 130)), cache=cache)
    state = cache.save_state()
    want = m.forward([7, 8], cache=cache, logits="all")
    m.forward(list(range(200, 240)), cache=cache)
    cache.load_state(state)
    assert cache.seq_len == 30
    got = m.forward([7, 8], cache=cache, logits="all")
    assert got.tobytes() == want.tobytes()
    # into an f32 cache of the same model: the values the saved rows decode to
    wide = wl.Cache(m, max_seq_len=128, dtype="f32", lazy=False)
    wide.load_state(state)
    for layer in (0, 29):
        for a, b in zip(wide.read(layer, 0, 30), cache.read(layer, 0, 30), strict=True):
            assert a.tobytes() == b.tobytes()

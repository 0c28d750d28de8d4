"""Cache: exact sizes, lazy co-location, round-trip error bounds per dtype (computed with numpy),
offload."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import weightlift._native as wl

RT = {"max_input_len": 16, "max_attention_size": 256, "max_dq_size": 1 << 16}

# DESIGN.md's bytes per element of K and V.
BYTES = {
    "fp16": (2.0, 2.0),
    "fp8": (1.0, 1.0),
    "q8": (8.5 / 8, 8.5 / 8),
    "q6": (8.5 / 8, 4.5 / 8),
    "q4": (4.5 / 8, 4.5 / 8),
}


def bound(dtype: str, is_v: bool, x: np.ndarray) -> np.ndarray:
    """The documented bound per value, with group absmax over 32 consecutive head_dim values."""
    kind = {"q6": ("q8", "q4")}.get(dtype, (dtype, dtype))[int(is_v)]
    groups = np.abs(x).reshape(*x.shape[:-1], -1, 32).max(axis=-1)
    absmax = np.repeat(groups, 32, axis=-1).reshape(x.shape)
    ax = np.abs(x)
    return {
        "fp16": ax * 2.0**-11 + 2.0**-25,
        "fp8": ax * 2.0**-4 + 2.0**-10,
        "q8": absmax / 254 * (1 + 2.0**-9) + 2.0**-17,
        "q4": absmax / 14 * (1 + 2.0**-9) + 2.0**-17,
    }[kind]


@pytest.fixture()
def model(demo_gguf: Path) -> wl.Model:
    return wl.Model(demo_gguf, devices="virtual:2x64MiB", runtime=RT)


@pytest.mark.parametrize("dtype", list(BYTES))
def test_lazy_cache_sizes_and_colocation(model: wl.Model, dtype: str) -> None:
    cache = wl.Cache(model, 512, batch_size=2, dtype=dtype)
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
    cache = wl.Cache(model, 64, batch_size=2, dtype=dtype, lazy=False)
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
    zeros, _ = cache.read(7, 0, 40)
    assert not zeros.any(), "other positions untouched"
    with pytest.raises(ValueError, match="within max_seq_len 64"):
        cache.read(7, 60, 70)
    with pytest.raises(ValueError, match=r"\(2, 3, n_tokens, 64\)"):
        cache.write(7, 0, k[:, :2], v[:, :2])


def test_non_lazy_cache_needs_a_loaded_model(model: wl.Model) -> None:
    from weightlift._errors import WeightliftError

    with pytest.raises(WeightliftError, match="non-lazy cache needs a loaded model"):
        wl.Cache(model, 64, lazy=False)


def test_offloaded_cache_lives_on_the_host(model: wl.Model) -> None:
    cache = wl.Cache(model, 256, dtype="fp16", offload=True)
    model.load_autosplit(cache)
    assert cache.device_of(29) == model.layer_devices[29]
    # Every layer on the host (DESIGN.md's formula), plus two slots (the layer in use and the
    # one being prefetched) on each device that computes two or more layers.
    layer = int(2 * 3 * 64 * 256 * BYTES["fp16"][0])
    devs = model.layer_devices
    want = {"cpu": 30 * layer} | {d: min(2, devs.count(d)) * layer for d in set(devs)}
    assert cache.memory() == want == cache.expected_memory()
    # The planner has no offload option: the cache is planned as reserves (all of it on the
    # cpu, a slot on each accelerator), and what is held is the plan's weights and scratch
    # plus the cache's expected memory, within 1 %.
    mem = model.memory()
    for d in model.plan.devices:
        assert d.kv == 0
        assert want.get(d.name, 0) <= d.reserve, d.name
        expect = d.weights + d.scratch + want.get(d.name, 0)
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
    cache = wl.Cache(model, 65536, dtype="fp16")
    with pytest.raises(OutOfMemoryError) as e:
        model.load_autosplit(cache)
    assert "cpu is short by" in str(e.value) and "ctx 8192 fits" in str(e.value)
    assert all(v == 0 for v in model.device_usage().values())
    assert not cache.allocated

"""The engine: devices, the streaming loader, Model introspection and memory hygiene.

Every tensor read back is compared with what code nobody here wrote reads from the same file:
gguf-py's GGUFReader and the `safetensors` package.
"""

from __future__ import annotations

import threading
from pathlib import Path

import gen_fixtures as gen
import numpy as np
import pytest
import safetensors
import weightlift as wl
from gguf import GGUFReader
from tensor_truth import gguf_truth, st_truth
from weightlift._errors import FormatError, LoadCancelled, OutOfMemoryError, PlanError

# Small forward passes keep the planned scratch small (the default plans 2048-token prompts).
RT = {"max_input_len": 16, "max_attention_size": 256, "max_dq_size": 1 << 16}


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def assert_bit_exact(model: wl.Model, truth: dict[str, bytes]) -> None:
    for name, want in truth.items():
        got = model.tensor(name)
        assert got.tobytes() == want, name


def assert_memory_matches_plan(model: wl.Model) -> None:
    plan = model.plan
    mem = model.memory()
    for d in plan.devices:
        want = d.weights + d.kv + d.scratch
        got = mem.get(d.name, 0)
        assert abs(got - want) <= want / 100, (d.name, want, got)


# ----------------------------------------------------------------------------------------------
# Devices


def test_tensor_on_virtual_devices_counts_against_capacity() -> None:
    wl.use_devices("virtual:2x1MiB")
    a = np.arange(1000, dtype=np.float32).reshape(10, 100)
    t = wl.tensor(a, "virtual:0")
    assert (t.device, t.shape, t.dtype, t.nbytes) == ("virtual:0", [10, 100], "F32", 4000)
    back = t.numpy()
    assert back.dtype == np.float32 and np.array_equal(back, a)
    u = t.to("virtual:1")
    assert u.device == "virtual:1" and np.array_equal(u.numpy(), a)
    with pytest.raises(OutOfMemoryError) as e:
        wl.tensor(np.zeros(300_000, dtype=np.float32), "virtual:1")
    msg = str(e.value)
    assert "out of memory on virtual:1" in msg
    assert "requested 1200000 bytes" in msg and "1044576 bytes free of 1048576" in msg
    f16 = wl.tensor(a.astype(np.float16), "cpu")
    assert f16.dtype == "F16" and np.array_equal(f16.numpy(), a.astype(np.float16))


def cuda_names() -> list[str]:
    return [d.name for d in wl.devices() if d.kind == "cuda"]


def test_cuda_fails_cleanly(demo_gguf: Path) -> None:
    from weightlift._errors import CudaUnavailable, DeviceError

    if cuda_names():
        pytest.skip(f"this machine has {cuda_names()}; the no-GPU errors are not reachable")
    with pytest.raises(CudaUnavailable, match="cuda:0") as e:
        wl.use_devices("cuda:0")
    assert isinstance(e.value, DeviceError)
    if not Path("/proc/driver/nvidia").exists():
        # no driver at all (the package always has the CUDA backend): say what to install
        assert str(e.value).startswith(
            "device cuda:0: cuda is unavailable: libcuda.so.1 not found: install the NVIDIA "
            "driver (libcuda.so.1 comes with the driver, not with a CUDA toolkit or pip's "
            "nvidia packages)"
        ), str(e.value)
        info = wl.cuda_info()
        assert info["driver"]["error"].startswith("libcuda.so.1 not found"), info
        assert info["devices"] == []
        # cuBLAS is looked for without a driver: found (torch's pip wheel, a toolkit), or
        # missing with where it was looked for
        assert ("path" in info["cublas"]) != ("error" in info["cublas"]), info
    for make in (
        lambda: wl.Model(demo_gguf, devices="cuda:0"),
        lambda: wl.load_gguf(demo_gguf, devices="cuda:0,cuda:1"),
        lambda: wl.from_pretrained(demo_gguf, devices="cuda:1"),
        lambda: wl.plan(demo_gguf, devices="cuda:0,cpu"),
        lambda: wl.fit(demo_gguf, devices="cuda:1"),
        lambda: wl.parse_devices("virtual:1GiB,cuda:0"),
    ):
        with pytest.raises(CudaUnavailable, match=r"device cuda:\d: cuda is unavailable"):
            make()


def test_a_bare_cuda_device_is_the_same_error_in_plan_and_model(demo_gguf: Path) -> None:
    """A `cuda:N` without a size that cannot be opened (no CUDA here, or past the last GPU) is
    CudaUnavailable from the planner as from Model(), in the same words: the device as written,
    why, and what to do instead."""
    from weightlift._errors import CudaUnavailable

    n = len(cuda_names())  # the first ordinal this machine does not have
    for spec, named, fix in [
        (f"cuda:{n}", f"cuda:{n}", f"cuda:{n}:24GiB"),
        (f"gpu:{n + 1},cpu", f"gpu:{n + 1} (cuda:{n + 1})", f"cuda:{n + 1}:24GiB"),
    ]:
        with pytest.raises(CudaUnavailable) as planned:
            wl.plan(demo_gguf, devices=spec)
        with pytest.raises(CudaUnavailable) as loaded:
            wl.Model(demo_gguf, devices=spec)
        assert str(planned.value) == str(loaded.value)
        msg = str(planned.value)
        assert msg.startswith(f"device {named}: cuda is unavailable: "), msg
        assert msg.endswith(
            f"plan() and fit() plan for it without a GPU when its size is given ({fix}); "
            "to run here, use cpu or simulated accelerators (virtual:24GiB)"
        ), msg
    # With a size it is a what-if plan, which needs no GPU; the plan names the device cuda:N.
    p = wl.plan(demo_gguf, devices=f"gpu:{n}:24GiB,cpu")
    assert [d.name for d in p.devices] == [f"cuda:{n}", "cpu"]
    assert p.devices[0].capacity == 24 << 30


def test_default_devices_are_the_real_inventory(demo_gguf: Path, tiny_llama_st: Path) -> None:
    # weightlift.devices() lists the machine: cpu (MemAvailable), every CUDA GPU, then disk.
    real = [d for d in wl.devices() if d.kind != "disk"]
    names = {d.name for d in real}
    m = wl.Model(demo_gguf, runtime=RT)
    assert set(m.devices.split(",")) == names
    assert set(m.memory()) == names
    m.load()
    assert set(m.memory()) == names
    cpu_cap = next(d.capacity for d in real if d.name == "cpu")
    planned_cpu = next(d for d in m.plan.devices if d.name == "cpu").capacity
    # MemAvailable moves a little between the two reads.
    assert abs(planned_cpu - cpu_cap) <= cpu_cap / 10
    m.unload()
    g = wl.load_gguf(demo_gguf, runtime=RT)
    assert set(g.memory()) == names and g.loaded
    g.unload()
    f = wl.from_pretrained(tiny_llama_st, runtime=RT)
    assert set(f.devices.split(",")) == names and f.loaded
    f.unload()
    if not cuda_names():
        # TPContext(gpu_split=None) detects free memory per device: with no GPU there is
        # nothing to split over, and the planner says so.
        with pytest.raises(PlanError, match="expected at least one cuda or virtual device"):
            wl.TPContext(wl.Model(tiny_llama_st, runtime=RT), None, expect_cache_tokens=256)


def test_cuda_load_bit_exact_and_unload_frees(demo_gguf: Path) -> None:
    """On a GPU (a build with the `cuda` feature): every tensor read back from cuda:0 equals
    gguf-py's bytes, memory matches the plan, and unload frees the device memory."""
    if not cuda_names():
        pytest.skip("no CUDA device (no GPU, no libcuda, or a build without the cuda feature)")
    m = wl.load_gguf(demo_gguf, n_gpu_layers=-1, devices="cuda:0", runtime=RT, check_tensors=True)
    assert m.layer_devices[0] == "cuda:0"
    assert_bit_exact(m, gguf_truth(demo_gguf))
    assert_memory_matches_plan(m)
    m.unload()
    assert m.device_usage()["cuda:0"] == 0


# ----------------------------------------------------------------------------------------------
# Loading onto the cpu: mmap, read and O_DIRECT give the checkpoint's bytes


def test_gguf_on_cpu_paths_identical(demo_gguf: Path, demo_reader: GGUFReader) -> None:
    truth = gguf_truth(demo_reader)
    results = []
    # use_direct_io takes precedence over use_mmap, as in llama.cpp.
    variants = ({"use_mmap": True}, {"use_mmap": False}, {"use_direct_io": True})
    for kw in variants:
        m = wl.load_gguf(demo_gguf, runtime=RT, **kw)
        assert m.loaded and set(m.memory()) == {"cpu"}
        assert_bit_exact(m, truth)
        results.append({n: m.tensor(n).tobytes() for n in list(truth)[:20]})
        if not kw.get("use_mmap", True) or kw.get("use_direct_io"):
            assert m.device_usage()["cpu"] >= sum(len(b) for b in truth.values())
        else:
            assert m.device_usage()["cpu"] < (16 << 20), "mmap views are not anonymous copies"
        m.unload()
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("sub", ["safetensors", "safetensors-sharded"])
def test_safetensors_on_cpu_paths_identical(tiny_llama_st: Path, sub: str) -> None:
    folder = tiny_llama_st.parent / sub
    truth = st_truth(folder)
    for kw in ({"use_mmap": True}, {"use_mmap": False}, {"use_direct_io": True, "use_mmap": False}):
        m = wl.Model(folder, runtime=RT)
        m.load(device_map="cpu", **kw)
        assert all(m.device_of(n) == "cpu" for n in truth)
        assert_bit_exact(m, truth)
        m.unload()


# ----------------------------------------------------------------------------------------------
# Virtual devices under each strategy


STRATEGIES = [
    (
        "virtual:2x12MiB,cpu",
        {"strategy": "autosplit", "cache": {"max_seq_len": 256, "dtype": "q8"}},
    ),
    ("virtual:3x12MiB,cpu", {"strategy": "balanced"}),
    ("virtual:2x32MiB", {"n_gpu_layers": 1}),
    ("virtual:3x32MiB", {"n_gpu_layers": -1, "tensor_split": [3, 1, 1]}),
    (
        "virtual:2x32MiB",
        {
            "device_map": {
                "model.embed_tokens": "cpu",
                "model.layers.0": "virtual:1",
                "": "virtual:0",
            }
        },
    ),
]


@pytest.mark.parametrize(("devices", "options"), STRATEGIES)
def test_tiny_llama_strategies_bit_exact(tiny_llama_st: Path, devices: str, options: dict) -> None:
    truth = st_truth(tiny_llama_st)
    m = wl.Model(tiny_llama_st, devices=devices, runtime=RT)
    m.load(**options)
    plan = m.plan
    for name in truth:
        assert m.device_of(name) == plan.device_of(name)
    assert_bit_exact(m, truth)
    assert_memory_matches_plan(m)
    used = set(m.layer_devices)
    assert used <= {f"virtual:{i}" for i in range(3)} | {"cpu"}
    m.unload()
    assert all(v == 0 for v in m.device_usage().values())


def test_explicit_map_puts_layer_where_asked(tiny_llama_st_sharded: Path) -> None:
    m = wl.Model(tiny_llama_st_sharded, devices="virtual:2x32MiB", runtime=RT)
    m.load(device_map={"model.layers.0": "virtual:1", "": "virtual:0"})
    assert m.device_of("model.layers.0.mlp.up_proj.weight") == "virtual:1"
    assert m.device_of("model.layers.1.mlp.up_proj.weight") == "virtual:0"
    assert_bit_exact(m, st_truth(tiny_llama_st_sharded))


def test_demo_model_over_two_virtual_devices(demo_gguf: Path, demo_reader: GGUFReader) -> None:
    m = wl.Model(demo_gguf, devices="virtual:2x64MiB", runtime=RT)
    cache = wl.Cache(m, max_seq_len=1024, dtype="q4")
    m.load_autosplit(cache, reserve_vram=["1MiB", "1MiB"])
    assert_memory_matches_plan(m)
    for layer, dev in enumerate(m.layer_devices):
        assert cache.device_of(layer) == dev
    assert_bit_exact(m, gguf_truth(demo_reader))
    # Dequantised read-back agrees with gguf-py's reference dequantisation.
    from gguf.quants import dequantize

    r = {t.name: t for t in demo_reader.tensors}["blk.3.ffn_down.weight"]
    want = dequantize(r.data, r.tensor_type)
    got = m.tensor("blk.3.ffn_down.weight", dequantize=True)
    np.testing.assert_allclose(got, want.reshape(got.shape), rtol=0, atol=1e-6)


@pytest.mark.parametrize("tp", [False, True])
def test_dequantize_in_chunks_agrees_with_gguf_py(tiny_llama_st: Path, tp: bool) -> None:
    """`tensor(dequantize=True)` decodes `max_dq_size` values at a time (here 96, so every
    tensor takes many chunks; under TP the column-split parts are reassembled chunk by chunk)."""
    from gguf.quants import dequantize

    path = tiny_llama_st.parent / "gguf" / "tiny-llama-Q8_0.gguf"
    m = wl.Model(path, devices="virtual:2x48MiB", runtime=RT | {"max_dq_size": 96})
    if tp:
        m.load_tp(gpu_split=[0.04, 0.04], expect_cache_tokens=256)
    else:
        m.load(strategy="balanced")
    ckpt = wl.open(path)
    for t in GGUFReader(path).tensors:
        want = dequantize(t.data, t.tensor_type)
        got = m.tensor(t.name, dequantize=True)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg=t.name)
        # One dequantiser: the checkpoint's read gives the same bits as the model's.
        np.testing.assert_array_equal(ckpt.dequantize(t.name), got, err_msg=t.name)


# ----------------------------------------------------------------------------------------------
# Errors, progress, cancellation, threads, unload hygiene


def test_oom_is_clear_and_leaves_nothing(tiny_llama_st: Path) -> None:
    m = wl.Model(tiny_llama_st, devices="virtual:2x1MiB", runtime=RT)
    with pytest.raises(OutOfMemoryError, match="virtual:0") as e:
        m.load(device_map="virtual:0")
    assert "virtual" in str(e.value)
    assert not m.loaded
    assert all(v == 0 for v in m.device_usage().values())


def test_progress_sequence(tiny_llama_st_sharded: Path) -> None:
    m = wl.Model(tiny_llama_st_sharded, devices="virtual:2x32MiB", runtime=RT)
    seen: list[tuple[int, int, str, str]] = []
    m.load(n_gpu_layers=-1, staging_bytes=1 << 20, callback=lambda *a: seen.append(a))
    total = sum(len(b) for b in st_truth(tiny_llama_st_sharded).values())
    done = [s[0] for s in seen]
    assert done == sorted(done) and done[-1] == seen[-1][1]
    assert seen[-1][1] >= total
    assert {s[2] for s in seen} >= set(st_truth(tiny_llama_st_sharded))
    for _, _, tensor, device in seen:
        assert device in {"cpu", "virtual:0", "virtual:1"}
        if tensor.startswith("model.layers."):
            assert device == m.device_of(tensor) or "," in m.device_of(tensor)


@pytest.mark.parametrize("stop_after", [1, 4, 12])
def test_cancel_frees_everything(tiny_llama_st: Path, stop_after: int) -> None:
    m = wl.Model(tiny_llama_st, devices="virtual:2x32MiB", runtime=RT)
    cache = wl.Cache(m, max_seq_len=128, dtype="fp16")
    calls = []

    def cb(done: int, total: int, tensor: str, device: str) -> bool:
        calls.append(tensor)
        return len(calls) < stop_after

    with pytest.raises(LoadCancelled, match="cancelled"):
        m.load_autosplit(cache, callback=cb)
    assert len(calls) == stop_after, "no progress after cancelling"
    assert not m.loaded and not cache.allocated
    assert all(v == 0 for v in m.device_usage().values())


def test_keyboard_interrupt_from_callback_frees(tiny_llama_st: Path) -> None:
    m = wl.Model(tiny_llama_st, devices="virtual:1x64MiB", runtime=RT)

    def cb(*_: object) -> bool:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        m.load(n_gpu_layers=-1, callback=cb)
    assert all(v == 0 for v in m.device_usage().values())


def test_load_from_a_thread_releases_the_gil(demo_gguf: Path) -> None:
    m = wl.Model(demo_gguf, devices="virtual:2x64MiB", runtime=RT)
    errors: list[BaseException] = []
    ticks = 0

    def run() -> None:
        try:
            m.load(n_gpu_layers=-1, use_mmap=False, staging_bytes=1 << 20)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    th = threading.Thread(target=run)
    th.start()
    while th.is_alive():
        ticks += 1
    th.join()
    assert not errors, errors
    assert m.loaded and ticks > 10, "the main thread kept running during the load"


def test_twenty_cycles_return_to_baseline(demo_gguf: Path) -> None:
    m = wl.Model(demo_gguf, devices="virtual:2x64MiB", runtime=RT)
    cache = wl.Cache(m, max_seq_len=512, dtype="q8")
    m.load_autosplit(cache)
    m.unload()
    base = rss_anon()
    for _ in range(20):
        m.load_autosplit(cache)
        assert sum(m.device_usage().values()) > 0
        m.unload()
        assert all(v == 0 for v in m.device_usage().values())
    assert rss_anon() - base < 16 << 20


def test_check_tensors_passes_on_clean_files(tiny_llama_gguf_dir: Path) -> None:
    m = wl.load_gguf(
        tiny_llama_gguf_dir / "tiny-llama-Q4_K_M.gguf",
        devices="virtual:2x16MiB",
        n_gpu_layers=-1,
        check_tensors=True,
        runtime=RT,
    )
    assert set(m.layer_devices) <= {"virtual:0", "virtual:1"}
    assert_bit_exact(m, gguf_truth(tiny_llama_gguf_dir / "tiny-llama-Q4_K_M.gguf"))


def test_check_tensors_scans_what_stays_on_the_cpu(tmp_path: Path) -> None:
    """A NaN in a tensor every strategy keeps on the host is found too, by every loader."""
    path = tmp_path / "nan_norm.gguf"
    gen.write_tiny_llama_gguf(path, poison="nan_output_norm")
    with pytest.raises(FormatError, match="output_norm.weight") as info:
        wl.load_gguf(path, runtime=RT, check_tensors=True)
    assert "cpu" in str(info.value) and "nan" in str(info.value)
    m = wl.Model(path, devices="virtual:2x16MiB,cpu", runtime=RT)
    with pytest.raises(FormatError, match="output_norm.weight"):
        m.load(check_tensors=True, device_map="cpu")
    assert not m.loaded
    m.load(device_map="cpu")  # unchecked, it loads
    assert m.loaded
    m.unload()


def test_load_gguf_progress_is_a_fraction_and_can_cancel(demo_gguf: Path) -> None:
    fractions: list[float] = []
    wl.load_gguf(
        demo_gguf, devices="virtual:2x80MiB", runtime=RT, progress_callback=fractions.append
    )
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    with pytest.raises(LoadCancelled):
        wl.load_gguf(
            demo_gguf, devices="virtual:2x80MiB", runtime=RT, progress_callback=lambda f: f < 0.5
        )


def test_from_pretrained_balanced(tiny_llama_st_sharded: Path) -> None:
    m = wl.from_pretrained(
        tiny_llama_st_sharded,
        device_map="auto",
        max_memory={0: "12MiB", 1: "12MiB", "cpu": "1GiB"},
        devices="virtual:2x32MiB,cpu",
        runtime=RT,
    )
    assert m.plan.strategy == "balanced"
    assert_bit_exact(m, st_truth(tiny_llama_st_sharded))
    assert_memory_matches_plan(m)


def _rewrite_tiny_llama(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001 - a small helper
    """Copy tiny-llama's config and weights to `dst`, passing the tensor dict through `edit`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = {
        name: {"dtype": info["dtype"], "shape": info["shape"], "data": bytes(info["data"])}
        for name, info in safetensors.deserialize((src / "model.safetensors").read_bytes())
    }
    assert all(t["dtype"] == "BF16" for t in tensors.values())
    # TensorSpec points at memory the caller keeps alive: hold the arrays until serialised.
    arrays = {n: np.frombuffer(t["data"], np.uint8).copy() for n, t in edit(tensors).items()}
    specs = {
        n: safetensors.TensorSpec(
            dtype="bfloat16", shape=tensors[n]["shape"], data_ptr=a.ctypes.data, data_len=a.nbytes
        )
        for n, a in arrays.items()
    }
    (dst / "model.safetensors").write_bytes(safetensors.serialize(specs))
    return dst


def test_missing_tensor_is_named(tiny_llama_st: Path, tmp_path: Path) -> None:
    from weightlift._errors import FormatError

    def drop(t: dict) -> dict:
        del t["model.layers.1.self_attn.k_proj.weight"]
        return t

    folder = _rewrite_tiny_llama(tiny_llama_st, tmp_path / "m", drop)
    m = wl.Model(folder, runtime=RT)
    with pytest.raises(
        FormatError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"
    ):
        m.load(device_map="cpu")
    assert not m.loaded


def test_check_tensors_finds_nan_on_a_device(tiny_llama_st: Path, tmp_path: Path) -> None:
    from weightlift._errors import FormatError

    def poison(t: dict) -> dict:
        w = bytearray(t["model.layers.0.post_attention_layernorm.weight"]["data"])
        w[10:12] = (0x7FC0).to_bytes(2, "little")  # bf16 quiet NaN at element 5
        t["model.layers.0.post_attention_layernorm.weight"]["data"] = bytes(w)
        return t

    folder = _rewrite_tiny_llama(tiny_llama_st, tmp_path / "m", poison)
    m = wl.Model(folder, devices="virtual:2x32MiB", runtime=RT)
    m.load(n_gpu_layers=-1)  # without the check the load succeeds
    m.unload()
    with pytest.raises(FormatError) as e:
        m.load(n_gpu_layers=-1, check_tensors=True)
    msg = str(e.value)
    assert "model.layers.0.post_attention_layernorm.weight" in msg
    assert "virtual:" in msg and "(nan) at element 5" in msg
    assert all(v == 0 for v in m.device_usage().values())


def test_float16_conversion_on_the_way(tiny_llama_st: Path) -> None:
    m = wl.Model(tiny_llama_st, devices="virtual:2x32MiB", dtype="float16", runtime=RT)
    m.load(n_gpu_layers=-1)
    truth = st_truth(tiny_llama_st)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.input_layernorm.weight"):
        bf16 = np.frombuffer(truth[name], dtype=np.uint16).astype(np.uint32) << 16
        want = bf16.view(np.float32).astype(np.float16)
        got = m.tensor(name)
        assert got.dtype == np.float16 and np.array_equal(got.ravel(), want)
    assert_memory_matches_plan(m)


def test_sigint_during_load_raises_keyboard_interrupt(tiny_llama_st: Path) -> None:
    import os
    import signal

    m = wl.Model(tiny_llama_st, devices="virtual:1x64MiB", runtime=RT)
    calls = 0

    def cb(*_: object) -> bool:
        nonlocal calls
        calls += 1
        if calls == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return True

    with pytest.raises(KeyboardInterrupt):
        m.load(n_gpu_layers=-1, staging_bytes=1 << 20, callback=cb)
    assert calls <= 3
    assert not m.loaded and all(v == 0 for v in m.device_usage().values())


def test_progress_bar(tiny_llama_st: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = wl.Model(tiny_llama_st, devices="virtual:1x64MiB", runtime=RT)
    m.load(n_gpu_layers=-1, progress=True)
    err = capsys.readouterr().err
    assert "loading" in err and "100%" in err


def test_load_a_plan_from_the_planner(tiny_llama_st: Path) -> None:
    ckpt = wl.open(tiny_llama_st)
    plan = wl.plan(
        ckpt,
        devices="virtual:2x12MiB,cpu",
        strategy="autosplit",
        runtime=wl.RuntimeSpec(**RT),
    )
    m = wl.Model(ckpt, devices="virtual:2x12MiB", runtime=RT)
    m.load(plan)
    assert m.plan == plan
    for name in st_truth(tiny_llama_st):
        assert m.device_of(name) == plan.device_of(name)
    assert_memory_matches_plan(m)
    # The same plan on a model without virtual:1 names the missing device.
    small = wl.Model(ckpt, devices="virtual:1x64MiB", runtime=RT)
    if "virtual:1" in plan.layer_devices:
        with pytest.raises(ValueError, match="virtual:1"):
            small.load(plan)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def test_use_mlock_locks_the_mapped_tensors(demo_gguf: Path, demo_reader: GGUFReader) -> None:
    base = _status("VmLck:")
    m = wl.load_gguf(demo_gguf, use_mlock=True, runtime=RT)
    total = sum(int(t.n_bytes) for t in demo_reader.tensors)
    if m.warnings:  # a locked-memory limit refused; the warning says so
        assert "ulimit -l" in m.warnings[0]
    else:
        assert m.locked_bytes == total
        # The kernel counts whole pages: at least the tensors' bytes are locked.
        assert _status("VmLck:") - base >= total
    m.unload()
    assert _status("VmLck:") == base


def test_disk_placement_stays_mapped(tiny_llama_st: Path) -> None:
    m = wl.Model(tiny_llama_st, devices="virtual:1x4MiB,cpu:40MiB,disk", runtime=RT)
    # Two 16 MiB staging buffers and the scratch fill the 40 MiB cpu: every weight goes to disk.
    m.load(strategy="sequential", allow_disk=True, use_mmap=False, staging_bytes=16 << 20)
    assert m.device_of("model.layers.1.mlp.up_proj.weight") == "disk"
    # Disk weights stay views of the file even with use_mmap=False: no anonymous copies.
    assert m.device_usage()["cpu"] == m.plan.devices[1].scratch
    assert_bit_exact(m, st_truth(tiny_llama_st))
    assert_memory_matches_plan(m)
    mem = m.memory()
    assert mem["disk"] == sum(len(b) for b in st_truth(tiny_llama_st).values())


@pytest.mark.parametrize(
    "options",
    [
        {"n_gpu_layers": -1, "split_mode": "row", "tensor_split": [1, 1]},
        {"n_gpu_layers": -1, "split_mode": "none", "main_gpu": 1},
        {"n_gpu_layers": 1, "tensor_split": [1, 3]},
    ],
)
def test_llama_cpp_split_modes(tiny_llama_gguf_dir: Path, options: dict) -> None:
    path = tiny_llama_gguf_dir / "tiny-llama-Q4_K_M.gguf"
    m = wl.load_gguf(path, devices="virtual:2x32MiB", runtime=RT, **options)
    assert_bit_exact(m, gguf_truth(path))
    assert_memory_matches_plan(m)
    if options.get("split_mode") == "row":
        assert m.device_of("blk.0.ffn_up.weight") == "virtual:0,virtual:1"
    if options.get("split_mode") == "none":
        assert set(m.layer_devices) == {"virtual:1"}

"""One meaning per option: plan(), fit(), Model.load(), the exllamav2 and accelerate loaders and
load_gguf() take placement options through one builder, so the same arguments place the same
way everywhere."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import weightlift as wl
from gguf import GGUFReader
from weightlift._errors import OutOfMemoryError, PlanError

RT = {"max_input_len": 16, "max_attention_size": 256, "max_dq_size": 1 << 16}
DEVICES = "virtual:2x48MiB,cpu"


def placed(plan: wl.Plan) -> list[tuple[str, str]]:
    return [(t.name, t.device) for t in plan.tensors]


def budgets(plan: wl.Plan) -> dict[str, tuple[int | None, int]]:
    return {d.name: (d.capacity, d.reserve) for d in plan.devices if d.name != "cpu"}


@pytest.mark.parametrize(
    "options",
    [
        {"reserve": ["4MiB", 1 << 20]},
        {"reserve": "3MiB"},
        {"reserve": {1: "2MiB"}},
        {"max_memory": {"virtual:0": "20MiB"}},
        {"max_memory": "30MiB"},
        {"device_map": "sequential"},
        {"device_map": "auto"},
        {"n_gpu_layers": 20},
        {"n_gpu_layers": -1, "split_mode": "row", "tensor_split": [1, 3]},
        {"overrides": ["ffn_down=cpu"], "device_map": {"": 1}},
        {"device_map": {"re:ffn_up": "cpu", "": 0}},
    ],
    ids=repr,
)
def test_plan_and_model_load_place_alike(tiny_llama_gguf: Path, options: dict) -> None:
    p = wl.plan(tiny_llama_gguf, devices=DEVICES, runtime=RT, **options)
    m = wl.Model(tiny_llama_gguf, devices=DEVICES, runtime=RT)
    m.load(**options)
    assert m.plan is not None
    assert m.plan.strategy == p.strategy
    assert placed(m.plan) == placed(p)
    assert budgets(m.plan) == budgets(p)
    m.unload()


def test_sizes_lists_follow_accelerator_order(tiny_llama_gguf: Path) -> None:
    # cpu listed first: a list still means the accelerators, in order
    p = wl.plan(tiny_llama_gguf, devices="cpu,virtual:2x48MiB", reserve=["5MiB", "7MiB"])
    reserve = {d.name: d.reserve for d in p.devices}
    assert (reserve["virtual:0"], reserve["virtual:1"]) == (5 << 20, 7 << 20)
    with pytest.raises(PlanError, match=r"at most one value per accelerator \(2\)"):
        wl.plan(tiny_llama_gguf, devices="cpu,virtual:2x48MiB", reserve=[1, 2, 3])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=repr)
def test_a_nan_or_an_infinity_in_an_option_is_refused_by_name(tiny_llama_gguf: Path, bad) -> None:
    # JSON has no such number: it must not read as an absent option (the default placement)
    shown = "NaN" if bad != bad else repr(bad)
    for key, options in (
        ("tensor_split", {"n_gpu_layers": -1, "tensor_split": [bad, 1.0]}),
        ("gpu_split", {"gpu_split": bad}),
        ("max_memory", {"max_memory": {"virtual:0": bad}}),
    ):
        words = f"invalid option {key}: expected finite numbers, got {shown}"
        with pytest.raises(PlanError, match=words):
            wl.plan(tiny_llama_gguf, devices=DEVICES, **options)
    m = wl.Model(tiny_llama_gguf, devices=DEVICES, runtime=RT)
    words = f"option tensor_split: expected finite numbers, got {shown}"
    with pytest.raises(PlanError, match=words):
        m.load(n_gpu_layers=-1, tensor_split=[1.0, bad])
    assert not m.loaded


def test_gpu_split_means_the_same_in_plan_and_load_tp(tiny_llama_gguf: Path) -> None:
    split = [0.01, 0.03]  # GB of 1024 MiB per accelerator
    p = wl.plan(tiny_llama_gguf, devices="virtual:2x64MiB", gpu_split=split, runtime=RT)
    assert p.strategy == "tensor_parallel"
    m = wl.Model(tiny_llama_gguf, devices="virtual:2x64MiB", runtime=RT)
    m.load_tp(gpu_split=split, expect_cache_tokens=1)
    assert m.plan is not None and m.plan.strategy == "tensor_parallel"
    for kind in ("kv", "id", "vc", "rs", "q"):
        assert m.plan.tp_split(kind) == p.tp_split(kind), kind
    # the budgets decide the split: 10 MiB on virtual:0 is too little for a share
    assert {row[0] for row in p.tp_split("id")} == {1}
    m.unload()


def test_a_device_map_preset_must_agree_with_the_strategy(tiny_llama_gguf: Path) -> None:
    with pytest.raises(PlanError, match="strategy='sequential'") as info:
        wl.plan(tiny_llama_gguf, devices=DEVICES, strategy="sequential", device_map="balanced")
    assert "strategy='balanced'" in str(info.value)


def test_load_refuses_a_plan_with_placement_options(tiny_llama_gguf: Path) -> None:
    p = wl.plan(tiny_llama_gguf, devices=DEVICES, runtime=RT)
    m = wl.Model(tiny_llama_gguf, devices=DEVICES, runtime=RT)
    with pytest.raises(PlanError, match="pass one or the other"):
        m.load(p, n_gpu_layers=3)
    assert not m.loaded
    m.load(p)
    assert m.loaded
    m.unload()


def test_cache_and_runtime_take_spec_objects_or_dicts(tiny_llama_gguf: Path) -> None:
    spec = wl.CacheSpec(256, 1, "q8")
    a = wl.plan(tiny_llama_gguf, devices=DEVICES, cache=spec, runtime=wl.RuntimeSpec(**RT))
    b = wl.plan(
        tiny_llama_gguf, devices=DEVICES, cache={"max_seq_len": 256, "dtype": "q8"}, runtime=RT
    )
    assert placed(a) == placed(b)
    assert [d.kv for d in a.devices] == [d.kv for d in b.devices]
    assert sum(d.kv for d in a.devices) == spec.nbytes(wl.open(tiny_llama_gguf).spec)
    with pytest.raises(TypeError, match="runtime: unknown field 'max_len'"):
        wl.plan(tiny_llama_gguf, devices=DEVICES, runtime={"max_len": 8})
    with pytest.raises(TypeError, match="'max_seq_len'"):
        wl.plan(tiny_llama_gguf, devices=DEVICES, cache={"dtype": "q8"})


def test_devices_take_a_string_or_a_list_everywhere(tiny_llama_gguf: Path) -> None:
    a = wl.plan(tiny_llama_gguf, devices=["virtual:2x48MiB", "cpu"], runtime=RT)
    m = wl.Model(tiny_llama_gguf, devices=["virtual:2x48MiB", "cpu"], runtime=RT)
    assert m.devices == "virtual:2x48MiB,cpu"
    m.load()
    assert m.plan is not None and placed(m.plan) == placed(a)
    m.unload()


def test_model_tensor_and_checkpoint_raw_agree_on_layout(tiny_llama_gguf_dir: Path) -> None:
    path = tiny_llama_gguf_dir / "tiny-llama-Q4_K_M.gguf"
    reader = {t.name: t for t in GGUFReader(path).tensors}
    m = wl.load_gguf(path, runtime=RT)
    with wl.open(path) as ckpt:
        for name in ("blk.0.ffn_down.weight", "blk.0.attn_norm.weight", "token_embd.weight"):
            raw, held = ckpt.raw(name), m.tensor(name)
            assert (raw.dtype, raw.shape) == (held.dtype, held.shape), name
            assert raw.shape == reader[name].data.shape, name
            assert np.array_equal(raw, held), name
    m.unload()


def test_load_gguf_takes_every_loader_s_callback_or_llamacpp_s(demo_gguf: Path) -> None:
    seen: list[tuple[int, int, str, str]] = []
    m = wl.load_gguf(demo_gguf, runtime=RT, callback=lambda *a: seen.append(a))
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert all(len(a) == 4 for a in seen)
    m.unload()
    with pytest.raises(PlanError, match="pass one"):
        wl.load_gguf(demo_gguf, runtime=RT, callback=print, progress_callback=print)


def test_load_gguf_defaults_to_llamacpp_s_no_offload(tiny_llama_gguf: Path) -> None:
    """n_gpu_layers=0, llama-cpp-python's default: everything on the cpu."""
    m = wl.load_gguf(tiny_llama_gguf, devices="virtual:2x48MiB", runtime=RT)
    assert set(m.layer_devices) == {"cpu"}
    m.unload()
    m = wl.load_gguf(tiny_llama_gguf, devices="virtual:2x48MiB", runtime=RT, n_gpu_layers=-1)
    assert set(m.layer_devices) <= {"virtual:0", "virtual:1"}
    m.unload()


def test_an_unlisted_cpu_means_the_same_in_plan_and_load(tiny_llama_st: Path) -> None:
    """Not in `devices`, the cpu holds only the input embedding, in plan() and in every loader:
    a model that needs host RAM beyond it raises the same OutOfMemoryError, whose fixes say to
    add cpu; listed, the same request fits."""
    with pytest.raises(OutOfMemoryError) as planned:
        wl.plan(tiny_llama_st, devices="virtual:2x12MiB", runtime=RT)
    m = wl.Model(tiny_llama_st, devices="virtual:2x12MiB", runtime=RT)
    with pytest.raises(OutOfMemoryError) as loaded:
        m.load()
    assert not m.loaded
    for e in (planned.value, loaded.value):
        assert any(f.startswith("add cpu to devices") for f in e.fixes), e.fixes
    p = wl.plan(tiny_llama_st, devices="virtual:2x12MiB,cpu", runtime=RT)
    m = wl.Model(tiny_llama_st, devices="virtual:2x12MiB,cpu", runtime=RT)
    m.load()
    assert m.plan is not None and placed(m.plan) == placed(p)
    m.unload()


def test_a_plan_with_a_cache_loads_that_cache(tiny_llama_gguf: Path) -> None:
    p = wl.plan(tiny_llama_gguf, devices=DEVICES, runtime=RT, cache=wl.CacheSpec(64, 1, "q8"))
    m = wl.Model(tiny_llama_gguf, devices=DEVICES, runtime=RT)
    m.load(p)
    kv = {d.name: d.kv for d in p.devices}
    assert sum(kv.values()) > 0
    held = m.memory()
    for name, planned_kv in kv.items():
        if planned_kv:
            assert held[name] >= planned_kv, (name, held, kv)
    assert m.n_ctx() == 64
    m.unload()


def test_fit_n_gpu_layers_needs_no_strategy(tiny_llama_gguf: Path) -> None:
    n = wl.fit(tiny_llama_gguf, devices="virtual:1GiB,cpu", target="n_gpu_layers", runtime=RT)
    assert n == wl.open(tiny_llama_gguf).spec.n_layers + 1  # every layer and the output


def test_dequantize_into_a_wrong_array_names_what_it_wants(tiny_llama_gguf: Path) -> None:
    with wl.open(tiny_llama_gguf) as ckpt:
        shape = ckpt["blk.0.ffn_down.weight"].shape
        with pytest.raises(TypeError, match="expected a float32 numpy array") as info:
            ckpt.dequantize("blk.0.ffn_down.weight", out=np.empty(shape, np.float64))
        assert "float64" in str(info.value) and "np.float32" in str(info.value)
        out = np.empty(shape, np.float32)
        assert ckpt.dequantize("blk.0.ffn_down.weight", out=out) is out


def test_n_threads_is_at_most_the_cpus_the_process_may_use(tiny_llama_gguf: Path) -> None:
    # Threads beyond the CPUs only wait for each other: ten thousand of them made one token
    # take minutes. The pool keeps at most as many threads as the CPUs the process may run on.
    cpus = len(os.sched_getaffinity(0))
    m = wl.load_gguf(tiny_llama_gguf, n_threads=10_000)
    assert 1 <= m.n_threads <= cpus
    # greedy: a sampled token may be the end of generation (one call in a hundred here)
    out = m.create_completion([1, 2, 3], max_tokens=2, temperature=0)
    assert out["usage"]["completion_tokens"] == 2, out["usage"]
    assert wl.load_gguf(tiny_llama_gguf, n_threads=1).n_threads == 1
    # llama.cpp's -1 (its default) is the physical cores, as 0 and None are
    default = wl.load_gguf(tiny_llama_gguf).n_threads
    assert wl.load_gguf(tiny_llama_gguf, n_threads=-1).n_threads == default
    assert wl.load_gguf(tiny_llama_gguf, n_threads=0).n_threads == default
    with pytest.raises(wl.PlanError, match=r"n_threads: expected an int of at least 1, .*got -2"):
        wl.load_gguf(tiny_llama_gguf, n_threads=-2)


def test_n_batch_of_zero_is_refused_at_load(tiny_llama_gguf: Path) -> None:
    with pytest.raises(PlanError, match=r"n_batch: expected at least 1 .*got 0"):
        wl.load_gguf(tiny_llama_gguf, n_batch=0)

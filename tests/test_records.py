"""The read-only records (TensorInfo, ModelSpec, Device, DeviceUsage, Placement): frozen
dataclasses that compare by value, pickle, keep their reprs, and (ModelSpec) go back to the
planner."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import weightlift as wl

SMALL_RT = wl.RuntimeSpec(max_input_len=256, max_attention_size=256 * 256, max_dq_size=1 << 20)


def test_tensor_info_is_a_frozen_dataclass(tiny_llama_gguf: Path) -> None:
    with wl.open(tiny_llama_gguf) as ckpt:
        t = ckpt["blk.1.ffn_down.weight"]
        assert isinstance(t, wl.TensorInfo) and dataclasses.is_dataclass(t)
        assert t == ckpt.tensors[[x.name for x in ckpt.tensors].index(t.name)]
        assert pickle.loads(pickle.dumps(t)) == t
        assert isinstance(t.shape, tuple) and t.n_elements == t.shape[0] * t.shape[1]
        assert t.file == ckpt.files[0] and t.offset > 0
        assert repr(t) == (
            f"TensorInfo(name='blk.1.ffn_down.weight', dtype='{t.dtype}', shape={t.shape}, "
            f"nbytes={t.nbytes}, layer=1, role='ffn_down')"
        )
        with pytest.raises(dataclasses.FrozenInstanceError):
            t.nbytes = 0  # type: ignore[misc]


def test_model_spec_goes_back_to_the_planner(tiny_llama_gguf: Path) -> None:
    spec = wl.open(tiny_llama_gguf).spec
    assert spec is not None and isinstance(spec, wl.ModelSpec)
    assert list(spec.to_dict()) == [f.name for f in dataclasses.fields(spec)]
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert repr(spec) == (
        f"ModelSpec(architecture='llama', n_layers={spec.n_layers}, "
        f"hidden_size={spec.hidden_size}, n_heads={spec.n_heads}, head_dim={spec.head_dim}, "
        f"vocab_size={spec.vocab_size})"
    )
    kw: dict[str, Any] = dict(devices="cpu", weight_dtype="q8_0", runtime=SMALL_RT)
    one = dataclasses.replace(spec, n_layers=1, n_kv_heads=spec.n_kv_heads[:1])
    assert wl.plan(spec, **kw).n_layers == spec.n_layers
    assert wl.plan(one, **kw).n_layers == 1
    assert wl.CacheSpec(64).nbytes(one) * spec.n_layers == wl.CacheSpec(64).nbytes(spec)


def test_a_model_spec_that_does_not_convert_names_the_fix(tiny_llama_gguf: Path) -> None:
    spec = wl.open(tiny_llama_gguf).spec
    assert spec is not None
    bad = dataclasses.replace(spec, n_layers=-1)
    with pytest.raises(wl.PlanError, match="ModelSpec: .*take one from Checkpoint.spec"):
        wl.plan(bad, devices="cpu", weight_dtype="q8_0")
    with pytest.raises(TypeError, match=r"expected a ModelSpec \(Checkpoint.spec\), got dict"):
        wl.CacheSpec(64).nbytes(spec.to_dict())  # type: ignore[arg-type]


def test_device_rows(tiny_llama_gguf: Path) -> None:
    gpu, cpu, disk = wl.parse_devices("cuda:0:1GiB:sm_90,cpu:2GiB,disk")
    assert isinstance(gpu, wl.Device) and repr(gpu) == f"Device('cuda:0', capacity={1 << 30})"
    assert gpu.overhead == sum(b for _, b, _ in gpu.overhead_parts) > 0
    assert all(isinstance(p, tuple) for p in gpu.overhead_parts)
    assert (cpu.capacity, disk.capacity, disk.kind) == (2 << 30, None, "disk")
    assert pickle.loads(pickle.dumps(gpu)) == gpu == wl.parse_devices("cuda:0:1GiB:sm_90")[0]

    p = wl.plan(tiny_llama_gguf, devices="cuda:0:1GiB:sm_90,cpu", runtime=SMALL_RT)
    usage = {d.name: d for d in p.devices}
    g = usage["cuda:0"]
    assert isinstance(g, wl.DeviceUsage) and g.overhead_parts == gpu.overhead_parts
    assert g.used == g.weights + g.kv + g.scratch + g.overhead + g.reserve
    assert g.capacity is not None and g.free == g.capacity - g.used
    assert 0 <= g.kernel_scratch <= g.scratch
    assert repr(g).startswith("DeviceUsage('cuda:0', weights=")
    assert g.layers and all(isinstance(r, tuple) for r in g.layers)


def test_placement_rows_of_a_row_split(tiny_llama_gguf: Path) -> None:
    p = wl.plan(
        tiny_llama_gguf,
        devices="virtual:2x1GiB,cpu",
        strategy="layers",
        n_gpu_layers=99,
        split_mode="row",
        runtime=SMALL_RT,
    )
    split = [t for t in p.tensors if t.shards]
    assert split and all(isinstance(t, wl.Placement) for t in p.tensors)
    t = split[0]
    assert t.shards is not None
    assert {s[0] for s in t.shards} <= {"virtual:0", "virtual:1"}
    assert all(isinstance(s, tuple) for s in t.shards)
    assert sum(s[3] for s in t.shards) == t.nbytes
    assert repr(t) == f"Placement('{t.name}' -> {t.device}, {t.nbytes} bytes {t.dtype})"
    assert pickle.loads(pickle.dumps(t)) == t


def test_checkpoint_is_declared_in_python_over_the_native_class(tiny_llama_gguf: Path) -> None:
    ckpt = wl.open(tiny_llama_gguf)
    assert type(ckpt) is wl.Checkpoint and isinstance(ckpt, wl._native.Checkpoint)
    assert wl.Checkpoint.__doc__ and wl.Checkpoint.files.__doc__ and wl.open.__doc__
    # The planner and the engine take it as the native class.
    spec = ckpt.spec
    assert spec is not None
    assert wl.plan(ckpt, devices="cpu", runtime=SMALL_RT).n_layers == spec.n_layers
    m = wl.Model(ckpt, devices="cpu", runtime=SMALL_RT)
    m.load()
    assert m.tensor_info("output.weight") == ckpt["output.weight"]
    m.close()
    names = list(ckpt)
    assert len(ckpt) == len(names) == len(ckpt.tensors) and names[0] in ckpt
    ckpt.files.append("x")
    assert ckpt.files == [str(tiny_llama_gguf)]
    ckpt.close()
    for read in (len, list, lambda c: c.files, lambda c: "output.weight" in c):
        with pytest.raises(wl.ClosedError, match="is closed"):
            read(ckpt)
    assert repr(ckpt) == f"<Checkpoint gguf '{tiny_llama_gguf}' (closed)>"
    with pytest.raises(AttributeError):
        ckpt.extra = 1  # type: ignore[attr-defined]


def test_plan_is_declared_in_python_over_the_native_class(tiny_llama_gguf: Path) -> None:
    p = wl.plan(
        tiny_llama_gguf, devices="cpu", cache=wl.CacheSpec(64, dtype="q8"), runtime=SMALL_RT
    )
    again = wl.Plan.from_json(p.to_json())
    assert type(p) is type(again) is wl.Plan and isinstance(p, wl._native.Plan)
    assert p == again and p != wl.plan(tiny_llama_gguf, devices="cpu", runtime=SMALL_RT)
    with pytest.raises(TypeError):
        hash(p)
    assert p.cache == wl.CacheSpec(64, dtype="q8") and p.runtime == SMALL_RT
    # Every read hands out its own copy of what the plan holds.
    p.layer_devices.append("x")
    p.host["kv"] = -1
    p.warnings.append("x")
    assert p.layer_devices == again.layer_devices and p.host == again.host
    assert p.warnings == again.warnings and p.tensors == again.tensors
    m = wl.Model(tiny_llama_gguf, devices="cpu", runtime=SMALL_RT)
    m.load(p)
    assert type(m.plan) is wl.Plan and m.plan == p
    m.close()

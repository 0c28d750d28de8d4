"""The planner through its Python API: plans of real checkpoints whose predicted bytes per device
must equal the actual tensor sizes placed there, KV bytes against the cache formula worked out by
hand, llama.cpp's documented n_gpu_layers rule, fit(), JSON round trips, errors, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gen_fixtures as gen
import pytest
import weightlift as wl
from conftest import DATA

GiB, MiB = 1024**3, 1024**2
# Scratch scaled down so small models fit small devices; the defaults are exllamav2's.
SMALL_RT = wl.RuntimeSpec(max_input_len=256, max_attention_size=256 * 256, max_dq_size=1 << 20)


def expected_weights(ckpt: wl.Checkpoint, p: wl.Plan) -> dict[str, int]:
    """Bytes per device summed from the checkpoint's own tensor table, following the plan's
    placement (row-split tensors by their shards), plus exllamav2's separate copy of a tied
    head on the device that `tied_output_copy` names."""
    sizes = {t.name: t.nbytes for t in ckpt.tensors}
    out: dict[str, int] = {d.name: 0 for d in p.devices}
    for pl in p.tensors:
        assert pl.nbytes == sizes[pl.name], pl.name  # dtype="auto": stored bytes
        if pl.shards:
            assert sum(s[3] for s in pl.shards) == pl.nbytes, pl.name
            for dev, _start, _end, nbytes in pl.shards:
                out[dev] += nbytes
        else:
            out[p.device_of(pl.name)] += pl.nbytes
    if p.tied_output_copy is not None:
        embd = next(t for t in ckpt.tensors if t.role == "token_embd")
        out[p.tied_output_copy] += embd.nbytes
    return out


def check_plan(ckpt: wl.Checkpoint, p: wl.Plan, whole_layers: bool = True) -> None:
    assert sorted(pl.name for pl in p.tensors) == sorted(t.name for t in ckpt.tensors)
    want = expected_weights(ckpt, p)
    for d in p.devices:
        assert d.weights == want[d.name], (d.name, d.weights, want[d.name])
        if d.capacity is not None:
            assert d.used <= d.capacity, d.name
            assert d.free == d.capacity - d.used, d.name
    for t in ckpt.tensors:
        if t.layer is not None and whole_layers:
            assert p.device_of(t.name) == p.layer_devices[t.layer] or any(
                pl.shards for pl in p.tensors if pl.name == t.name
            ), t.name
    assert len(p.layer_devices) == ckpt.spec.n_layers


DEVICE_SPECS = [
    ("virtual:2x300MiB,cpu", "autosplit"),
    ("virtual:2x60MiB,cpu", "autosplit"),
    ("virtual:60MiB,virtual:30MiB,cpu,disk", "autosplit"),
    ("virtual:2x300MiB,cpu", "sequential"),
    ("virtual:2x300MiB,cpu", "balanced"),
    ("virtual:3x300MiB,cpu", "balanced_low_0"),
    ("virtual:2x300MiB,cpu", "layers"),
    ("virtual:40MiB,cpu:2GiB,disk", "sequential"),
]


@pytest.fixture(scope="module")
def smollm(demo_gguf):
    with wl.open(demo_gguf) as ckpt:
        yield ckpt


@pytest.mark.parametrize("devices, strategy", DEVICE_SPECS)
def test_smollm_weight_bytes_per_device(smollm, devices, strategy):
    p = wl.plan(smollm, devices=devices, strategy=strategy, runtime=SMALL_RT, allow_disk=True)
    check_plan(smollm, p)
    assert p.strategy == strategy
    assert sum(d.weights for d in p.devices) >= smollm.nbytes


@pytest.mark.parametrize("devices, strategy", DEVICE_SPECS[:4])
def test_tiny_llama_safetensors_weight_bytes_per_device(tiny_llama_st, devices, strategy):
    for path in (tiny_llama_st, tiny_llama_st.parent / "safetensors-sharded"):
        with wl.open(path) as ckpt:
            p = wl.plan(
                ckpt,
                devices=devices.replace("300MiB", "12MiB").replace("60MiB", "8MiB"),
                strategy=strategy,
                runtime=SMALL_RT,
                allow_disk=True,
            )
            check_plan(ckpt, p)


def test_row_split_weight_bytes(tiny_llama_gguf):
    with wl.open(tiny_llama_gguf) as ckpt:
        p = wl.plan(
            ckpt,
            devices="virtual:2x64MiB,cpu",
            strategy="layers",
            split_mode="row",
            tensor_split=[1, 1],
            runtime=SMALL_RT,
        )
        check_plan(ckpt, p)


def test_kv_bytes_follow_design_formula(smollm):
    """The cache formula: 2 x n_kv_heads x head_dim x max_seq_len x batch elements per layer;
    fp16 and bf16 2 B, fp8 1 B, q8 8.5/8 B, q4 4.5/8 B, q6 K at 8.5/8 and V at 4.5/8 (one f16
    scale per 32)."""
    s = smollm.spec
    ctx, batch = 2048, 2
    n = s.n_kv_heads[0] * s.head_dim * ctx * batch  # K (or V) elements of one layer
    per_layer = {
        "fp16": 2 * n * 2,
        "bf16": 2 * n * 2,
        "fp8": 2 * n,
        "q8": 2 * n // 32 * 34,
        "q6": n // 32 * 34 + n // 32 * 18,
        "q4": 2 * n // 32 * 18,
    }
    for dtype, bytes_per_layer in per_layer.items():
        cache = wl.CacheSpec(ctx, batch, dtype)
        assert cache.nbytes(s) == bytes_per_layer * s.n_layers, dtype
        p = wl.plan(smollm, devices="virtual:2x1GiB,cpu", cache=cache, runtime=SMALL_RT)
        assert sum(d.kv for d in p.devices) == bytes_per_layer * s.n_layers, dtype
        for d in p.devices:
            n_layers_here = sum(b - a + 1 for a, b in d.layers)
            assert d.kv == n_layers_here * bytes_per_layer, (dtype, d.name)


def test_llama_cpp_n_gpu_layers_rule(tiny_llama_gguf, smollm):
    """llama.cpp offloads the LAST n_gpu_layers repeating layers, the output layer too when
    n_gpu_layers > n_layer, and keeps token_embd on the CPU."""
    n = smollm.spec.n_layers
    for ngl in (0, 1, 10, n):
        p = wl.plan(smollm, devices="virtual:1GiB,cpu", n_gpu_layers=ngl, runtime=SMALL_RT)
        assert p.strategy == "layers"
        assert p.layer_devices == ["cpu"] * (n - ngl) + ["virtual:0"] * ngl, ngl
        assert p.embed_device == "cpu"
    with wl.open(tiny_llama_gguf) as ckpt:
        n = ckpt.spec.n_layers
        p = wl.plan(ckpt, devices="virtual:1GiB,cpu", n_gpu_layers=n, runtime=SMALL_RT)
        assert p.device_of("output.weight") == "cpu"
        for ngl in (n + 1, -1):
            p = wl.plan(ckpt, devices="virtual:1GiB,cpu", n_gpu_layers=ngl, runtime=SMALL_RT)
            assert p.device_of("output.weight") == "virtual:0", ngl
            assert p.device_of("token_embd.weight") == "cpu"
            check_plan(ckpt, p)


def test_fit_answer_fits_and_one_more_does_not(smollm):
    devices = "virtual:2x72MiB"
    kw = {"devices": devices, "runtime": SMALL_RT}
    best = wl.fit(smollm, cache=wl.CacheSpec(256, dtype="q4"), **kw)
    assert best % 256 == 0 and 256 <= best < smollm.spec.context_length
    wl.plan(smollm, cache=wl.CacheSpec(best, dtype="q4"), **kw)
    with pytest.raises(wl.OutOfMemoryError):
        wl.plan(smollm, cache=wl.CacheSpec(best + 256, dtype="q4"), **kw)
    assert wl.fit(smollm, cache_dtype="q4", **kw) == best
    with pytest.raises(wl.PlanError, match="contradicts"):
        wl.fit(smollm, cache=wl.CacheSpec(256, dtype="q8"), cache_dtype="q4", **kw)
    # A smaller cache dtype never fits less.
    assert wl.fit(smollm, cache=wl.CacheSpec(256, dtype="fp16"), **kw) <= best


def test_out_of_memory_names_devices_and_fixes(smollm):
    with pytest.raises(wl.OutOfMemoryError) as info:
        wl.plan(smollm, devices="virtual:2x20MiB", cache=wl.CacheSpec(8192), runtime=SMALL_RT)
    e = info.value
    assert isinstance(e, MemoryError) and isinstance(e, wl.WeightliftError)
    msg = str(e)
    assert "virtual:" in msg and "short by" in msg
    assert e.shortfalls and all(s["missing"] > 0 for s in e.shortfalls)
    assert {s["device"] for s in e.shortfalls} <= {"virtual:0", "virtual:1"}
    for s in e.shortfalls:
        assert s["needed"] - s["available"] == s["missing"]
        assert s["device"] in msg
    assert e.fixes and "allow_disk" in " ".join(e.fixes)
    p = wl.plan(
        smollm,
        devices="virtual:2x20MiB,disk",
        cache=wl.CacheSpec(8192),
        runtime=SMALL_RT,
        allow_disk=True,
    )
    check_plan(smollm, p)


def test_small_cpu_is_checked_when_everything_spills_to_disk(tiny_llama_st):
    """Engine report: with everything on disk the 8 MiB cpu still computes the streamed layers
    and holds the upload staging buffers; the plan must raise, not hand the engine 31 MiB of
    scratch for an 8 MiB host."""
    with wl.open(tiny_llama_st) as ckpt:
        kw = dict(strategy="sequential", allow_disk=True)
        with pytest.raises(wl.OutOfMemoryError) as info:
            wl.plan(ckpt, devices="virtual:1x4MiB,cpu:8MiB,disk", **kw)
        short = {s["device"]: s for s in info.value.shortfalls}
        assert "cpu" in short and short["cpu"]["available"] == 8 * MiB, str(info.value)
        assert "staging" in str(info.value)
        p = wl.plan(ckpt, devices="virtual:1x4MiB,cpu:512MiB,disk", **kw)
        check_plan(ckpt, p)
        disk = next(d for d in p.devices if d.name == "disk")
        assert (disk.kv, disk.scratch) == (0, 0)


def test_json_round_trip_explain_and_svg(smollm, tmp_path):
    # The host's size is given: a bare `cpu` is the memory free at planning time, which the
    # other test workers change between the two plans below.
    p = wl.plan(
        smollm,
        devices="virtual:2x60MiB,cpu:8GiB",
        cache=wl.CacheSpec(1024, dtype="q8"),
        runtime=SMALL_RT,
    )
    text = p.to_json()
    json.loads(text)
    q = wl.Plan.from_json(text)
    assert q == p and q.to_json() == text
    assert q.layer_devices == p.layer_devices and q.cache == wl.CacheSpec(1024, 1, "q8")
    again = wl.plan(
        smollm,
        devices="virtual:2x60MiB,cpu:8GiB",
        cache=wl.CacheSpec(1024, dtype="q8"),
        runtime=SMALL_RT,
    )
    assert again == p, "deterministic"
    table = p.explain()
    for d in p.devices:
        assert d.name in table
    svg = tmp_path / "plan.svg"
    p.save_svg(svg)
    body = svg.read_text()
    assert body.lstrip().startswith("<svg") and body.rstrip().endswith("</svg>")
    assert "virtual:0" in body and "virtual:1" in body
    with pytest.raises(wl.PlanError, match="plan json"):
        wl.Plan.from_json("{not json")
    with pytest.raises(FileNotFoundError):
        p.save_svg(tmp_path / "missing-dir" / "x.svg")


def test_plan_from_config_matches_real_checkpoint(tiny_llama_st):
    """A config-only plan derives the tensor list from the architecture; its bytes must equal
    the real checkpoint's (written by transformers)."""
    cfg_path = DATA / "tiny-llama" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    with wl.open(tiny_llama_st) as ckpt:
        real = wl.plan(ckpt, devices="virtual:64MiB,cpu", runtime=SMALL_RT)
        total = ckpt.nbytes
        assert total == 19_532_288
    for source in (cfg_path, str(cfg_path), cfg):
        p = wl.plan(source, devices="virtual:64MiB,cpu", runtime=SMALL_RT)  # config says bfloat16
        weights = sum(d.weights for d in p.devices)
        copy = 32000 * 256 * 2 if p.tied_output_copy else 0
        assert weights - copy == total
        assert sorted(pl.name.replace("model.", "") for pl in p.tensors) == sorted(
            pl.name.replace("model.", "") for pl in real.tensors
        ) or len(p.tensors) == len(real.tensors)
    spec = wl.open(tiny_llama_st).spec
    with pytest.raises(wl.PlanError, match="weight_dtype"):
        wl.plan(spec, devices="virtual:64MiB")
    p = wl.plan(spec, devices="virtual:64MiB,cpu", weight_dtype="q8_0", runtime=SMALL_RT)
    assert sum(d.weights for d in p.devices) < total
    with pytest.raises(wl.PlanError, match="weight_dtype"):
        wl.plan(wl.open(tiny_llama_st), devices="cpu", weight_dtype="q8_0")


def test_tensor_parallel_tables_cover_dimensions(tiny_llama_st):
    with wl.open(tiny_llama_st) as ckpt:
        s = ckpt.spec
        p = wl.plan(ckpt, devices="virtual:2x64MiB", strategy="tensor_parallel", runtime=SMALL_RT)
        sizes = {
            "kv": s.n_kv_heads[0],
            "q": s.n_heads,
            "id": s.intermediate_size,
            "rs": s.hidden_size,
            "vc": s.vocab_size,
        }
        for kind, total in sizes.items():
            table = p.tp_split(kind)
            assert table[0][1] == 0 and table[-1][2] == total, kind
            for (_, _, end), (_, start, _) in zip(table, table[1:], strict=False):
                assert end == start, kind
            assert [d for d, _, _ in table] == sorted(d for d, _, _ in table), kind
        kv, q = p.tp_split("kv"), p.tp_split("q")
        groups = s.n_heads // s.n_kv_heads[0]
        assert [(d, a * groups, b * groups) for d, a, b in kv] == q
        with pytest.raises(wl.PlanError, match="kind"):
            p.tp_split("nope")
        autosplit = wl.plan(ckpt, devices="virtual:64MiB", runtime=SMALL_RT)
        with pytest.raises(wl.PlanError, match="tensor_parallel"):
            autosplit.tp_split("kv")


def test_device_map_and_overrides(tiny_llama_gguf):
    with wl.open(tiny_llama_gguf) as ckpt:
        p = wl.plan(
            ckpt,
            devices="virtual:2x64MiB,cpu",
            device_map={"blk.0": "virtual:0", "blk.1": 1, "": "cpu"},
            overrides=[r"ffn_(up|down)=cpu"],
            runtime=SMALL_RT,
        )
        assert p.strategy == "map"
        for t in ckpt.tensors:
            dev = p.device_of(t.name)
            if "ffn_up" in t.name or "ffn_down" in t.name or t.layer is None:
                assert dev == "cpu", t.name
            else:
                assert dev == f"virtual:{t.layer}", t.name
        check_plan(ckpt, p, whole_layers=False)
        with pytest.raises(wl.PlanError, match="contradictory|conflict"):
            wl.plan(
                ckpt,
                devices="virtual:2x64MiB,cpu",
                device_map={"blk.0": "virtual:0", "blk.0-1": "virtual:1", "": "cpu"},
            )
        with pytest.raises(wl.PlanError, match="without a device"):
            wl.plan(ckpt, devices="virtual:2x64MiB,cpu", device_map={"blk.0": "cpu"})


def test_reserve_and_max_memory(tiny_llama_gguf):
    with wl.open(tiny_llama_gguf) as ckpt:
        p = wl.plan(
            ckpt,
            devices="virtual:2x64MiB,cpu",
            reserve=["1MiB", 2 * MiB],
            max_memory={"cpu": "1GiB", 0: "32MiB"},
            runtime=SMALL_RT,
        )
        by = {d.name: d for d in p.devices}
        assert by["virtual:0"].reserve == MiB and by["virtual:1"].reserve == 2 * MiB
        assert by["virtual:0"].used <= 32 * MiB
        p = wl.plan(ckpt, devices="virtual:2x64MiB", reserve="3MiB", runtime=SMALL_RT)
        assert [d.reserve for d in p.devices if d.kind == "virtual"] == [3 * MiB, 3 * MiB]
        with pytest.raises(wl.PlanError, match="reserve"):
            wl.plan(ckpt, devices="virtual:64MiB", reserve=[1, 2, 3])
        with pytest.raises(wl.PlanError, match="unknown device"):
            wl.plan(ckpt, devices="virtual:64MiB", reserve={"cuda:3": 1})


def test_bad_requests_are_plan_errors(tiny_llama_gguf):
    with wl.open(tiny_llama_gguf) as ckpt:
        cases = [
            ({"devices": "foo:1"}, "foo"),
            ({"devices": "virtual:2xlots"}, "lots"),
            ({"devices": "virtual:8GiB", "strategy": "fastest"}, "fastest"),
            ({"devices": "virtual:8GiB", "dtype": "int3"}, "int3"),
            ({"devices": "virtual:8GiB", "strategy": "balanced", "n_gpu_layers": 3}, "layers"),
            ({"devices": "virtual:8GiB", "split_mode": "diagonal"}, "diagonal"),
            # gpu:N is cuda:N spelt another way; the message says what was written.
            ({"devices": "gpu:0:8GiB,cuda:0:8GiB"}, "cuda:0 is listed twice (as gpu:0 and cuda:0)"),
        ]
        for kwargs, needle in cases:
            with pytest.raises(wl.PlanError) as info:
                wl.plan(ckpt, **kwargs)
            assert isinstance(info.value, ValueError)
            assert needle in str(info.value), (kwargs, str(info.value))
        # A value of the wrong type is a TypeError naming the argument and what it takes.
        with pytest.raises(TypeError, match="devices") as info:
            wl.plan(ckpt, devices=42)
        assert "expected a device spec" in str(info.value) and "got int" in str(info.value)
    with pytest.raises(wl.PlanError, match="cache dtype"):
        wl.CacheSpec(1024, dtype="q3")
    with pytest.raises(wl.PlanError, match="max_seq_len"):
        wl.CacheSpec(0)
    with pytest.raises(wl.PlanError, match="source"):
        wl.plan(3.5, devices="cpu")
    with pytest.raises(FileNotFoundError):
        wl.plan("/nonexistent/model.gguf", devices="cpu")
    with pytest.raises(wl.PlanError, match="vocab_only"):
        wl.plan(wl.open(tiny_llama_gguf, vocab_only=True), devices="cpu")


def test_devices_and_parse_devices():
    devs = wl.parse_devices("virtual:2x8GiB, cpu:64GiB,disk")
    assert [d.name for d in devs] == ["virtual:0", "virtual:1", "cpu", "disk"]
    assert [d.kind for d in devs] == ["virtual", "virtual", "cpu", "disk"]
    assert [d.capacity for d in devs] == [8 * GiB, 8 * GiB, 64 * GiB, None]
    assert wl.parse_devices(["virtual:24GiB", "virtual:12GiB"])[1].name == "virtual:1"
    assert wl.parse_devices("cuda:1:24GiB")[0].name == "cuda:1"
    real = wl.devices()
    assert real[0].name == "cpu" and real[0].capacity and real[0].capacity > 0
    assert real[-1].name == "disk" and real[-1].capacity is None
    with pytest.raises(wl.PlanError, match="listed twice"):
        wl.parse_devices("cpu,cpu")


def test_a_cuda_device_is_charged_its_overhead(tiny_llama_gguf):
    """A cuda:N planned without its GPU is charged the default context, cuBLAS workspace and
    graph memory of its compute capability, part by part; overhead= replaces them; an
    out-of-memory error names them, and fit() leaves room for them."""
    with wl.open(tiny_llama_gguf) as ckpt:
        p = wl.plan(ckpt, devices="cuda:0:4GiB:sm_90,cpu", runtime=SMALL_RT)
        gpu = next(d for d in p.devices if d.name == "cuda:0")
        assert gpu.overhead_parts == [
            ("cuda context and modules", 543 * MiB, "default, sm_90"),
            ("cublas workspace", 32 * MiB, "cuBLAS's recommendation, sm_90"),
            ("cuda graphs", 8 * MiB, "allowance"),
        ]
        assert gpu.overhead == 583 * MiB
        assert gpu.used == gpu.weights + gpu.kv + gpu.scratch + gpu.overhead + gpu.reserve
        assert (
            "overhead of cuda:0: 543.00 MiB cuda context and modules (default, sm_90) + 32.00 "
            "MiB cublas workspace (cuBLAS's recommendation, sm_90) + 8.00 MiB cuda graphs "
            "(allowance)\n"
        ) in p.explain()
        assert json.loads(p.to_json())["devices"][0]["overhead_parts"][0]["bytes"] == 543 * MiB
        cpu = next(d for d in p.devices if d.name == "cpu")
        assert cpu.overhead == 0 and cpu.overhead_parts == []
        # a GPU of unknown capability gets the largest default
        [dev] = wl.parse_devices("cuda:1:24GiB")
        assert dev.overhead == (555 + 32 + 8) * MiB
        assert dev.overhead_parts[0] == (
            "cuda context and modules",
            555 * MiB,
            "default, capability unknown",
        )
        # overhead= wins
        p = wl.plan(ckpt, devices="cuda:0:4GiB:sm_90,cpu", runtime=SMALL_RT, overhead="100MiB")
        gpu = next(d for d in p.devices if d.name == "cuda:0")
        assert gpu.overhead_parts == [("given", 100 * MiB, "overhead=")]
        # a device with room for everything but the overhead
        every = {"runtime": SMALL_RT, "strategy": "layers", "n_gpu_layers": -1}
        bare = wl.plan(ckpt, devices="cuda:0:4GiB,cpu", overhead=0, **every)
        need = next(d for d in bare.devices if d.name == "cuda:0").used
        tight = f"cuda:0:{need + 16 * MiB}B:sm_90,cpu"
        with pytest.raises(wl.OutOfMemoryError) as info:
            wl.plan(ckpt, devices=tight, **every)
        msg = str(info.value)
        assert "583.00 MiB fixed overhead (543.00 MiB cuda context and modules" in msg, msg
        assert "; the fixed overhead is what does not fit" in msg, msg
        wl.plan(ckpt, devices=tight, overhead=0, **every)
        # fit counts the overhead too: every layer fits only without it
        kw = {"devices": tight, "runtime": SMALL_RT, "strategy": "layers"}
        assert wl.fit(ckpt, target="n_gpu_layers", **kw) < ckpt.spec.n_layers + 1
        assert wl.fit(ckpt, target="n_gpu_layers", overhead=0, **kw) == ckpt.spec.n_layers + 1


def test_cache_and_runtime_specs():
    c = wl.CacheSpec(4096)
    assert (c.max_seq_len, c.batch_size, c.dtype) == (4096, 1, "fp16")
    assert c == wl.CacheSpec(4096, 1, "fp16") and hash(c) == hash(wl.CacheSpec(4096))
    assert "4096" in repr(c)
    r = wl.RuntimeSpec()
    assert (r.max_input_len, r.max_attention_size, r.max_dq_size, r.low_mem) == (
        2048,
        2048**2,
        512 * 1024**2,
        False,
    )


# --------------------------------------------------------------------------------------------
# CLI

EXE = Path(sys.executable).with_name("weightlift")


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    return subprocess.run(
        [str(EXE), *map(str, args)], capture_output=True, text=True, timeout=120, env=env
    )


def test_cli_plan(demo_gguf, tmp_path):
    svg = tmp_path / "plan.svg"
    p = run(
        "plan",
        demo_gguf,
        "--devices",
        "virtual:2x200MiB,cpu",
        "--ctx",
        "2048",
        "--cache",
        "q8",
        "--max-input-len",
        "256",
        "--svg",
        svg,
    )
    assert p.returncode == 0, p.stderr
    assert "virtual:0" in p.stdout and "virtual:1" in p.stdout and "q8" in p.stdout
    assert svg.read_text().lstrip().startswith("<svg")
    p = run(
        "plan",
        demo_gguf,
        "--devices",
        "virtual:2x200MiB,cpu",
        "--json",
        "-ngl",
        "12",
        "--max-input-len",
        "256",
    )
    assert p.returncode == 0, p.stderr
    plan = wl.Plan.from_json(p.stdout)
    assert plan.strategy == "layers" and plan.layer_devices.count("cpu") == 18


def test_cli_plan_from_config():
    p = run(
        "plan",
        DATA / "tiny-llama" / "config.json",
        "--devices",
        "virtual:2x64MiB,cpu",
        "--strategy",
        "tensor_parallel",
        "--max-input-len",
        "128",
    )
    assert p.returncode == 0, p.stderr
    assert "tensor parallel" in p.stdout


def test_cli_fit(demo_gguf):
    p = run("fit", demo_gguf, "--devices", "virtual:2x200MiB", "--cache", "q4", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["target"] == "max_seq_len" and doc["value"] % 256 == 0 and doc["value"] > 0
    p = run(
        "fit",
        demo_gguf,
        "--devices",
        "virtual:50MiB,cpu",
        "--target",
        "n_gpu_layers",
        "--strategy",
        "layers",
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("n_gpu_layers ")


def test_plan_and_fit_default_to_this_machines_devices(demo_gguf):
    """Without devices, plan() and fit() take this machine's devices (every CUDA GPU, then cpu)
    as Model() does, and the CLI's plan and fit default the way load and run do."""
    real = [d.name for d in wl.devices() if d.kind != "disk"]
    assert [d.name for d in wl.plan(demo_gguf).devices] == real
    assert wl.Model(demo_gguf).devices.split(",") == real
    spec = ",".join(real)
    assert wl.fit(demo_gguf, cache_dtype="q4") == wl.fit(demo_gguf, devices=spec, cache_dtype="q4")
    for cmd in ("plan", "fit"):
        p = run(cmd, demo_gguf, "--json")
        assert p.returncode == 0, p.stderr
        q = run(cmd, demo_gguf, "--devices", spec, "--json")
        if cmd == "plan":
            planned = wl.Plan.from_json(p.stdout)
            assert [d.name for d in planned.devices] == real
            assert planned.layer_devices == wl.Plan.from_json(q.stdout).layer_devices
        else:
            assert json.loads(p.stdout) == json.loads(q.stdout)
    # --help says so, for all four commands alike.
    for cmd in ("plan", "fit", "load", "run"):
        p = run(cmd, "--help")
        assert p.returncode == 0, p.stderr
        text = " ".join(p.stdout.split())
        assert (
            "(default: this machine's devices, every CUDA GPU then cpu, as `weightlift devices` "
            "lists them" in text
        ), text


def test_cli_plan_errors(demo_gguf, tmp_path):
    p = run("plan", demo_gguf, "--devices", "virtual:2x10MiB")
    assert p.returncode == 2
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightlift: error: out of memory")
    assert "Traceback" not in p.stderr
    p = run("plan", demo_gguf, "--devices", "floppy:1")
    assert p.returncode == 2 and "floppy" in p.stderr and len(p.stderr.splitlines()) == 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF")
    p = run("plan", bad, "--devices", "cpu")
    assert p.returncode == 2 and "bad.gguf" in p.stderr and "Traceback" not in p.stderr


def test_gen_fixtures_llama_plans(tmp_path):
    """The gguf-py tiny llama with mixed quant types: bytes per device stay exact."""
    path = tmp_path / "m.gguf"
    gen.write_tiny_llama_gguf(path)
    with wl.open(path) as ckpt:
        for strategy in ("autosplit", "sequential", "balanced", "balanced_low_0", "layers"):
            p = wl.plan(
                ckpt,
                devices="virtual:2x1MiB,cpu",
                strategy=strategy,
                runtime=wl.RuntimeSpec(0, 0, 0),
            )
            check_plan(ckpt, p)


# --------------------------------------------------------------------------------------------
# Row split, architectures without roles, sliding windows


def test_row_split_plan_agrees_with_the_loaded_model():
    """llama.cpp `-sm row`: the plan names every device a tensor's rows went to, as the loaded
    model does, and explain() words row slices as such."""
    path = DATA / "tiny-qwen2" / "tiny-qwen2-Q8_0.gguf"
    m = wl.load_gguf(
        path,
        devices="virtual:2x32MiB",
        n_gpu_layers=-1,
        split_mode="row",
        tensor_split=[1, 1],
        runtime=SMALL_RT,
    )
    p = m.plan
    names = [t.name for t in wl.open(path).tensors]
    split = [pl.name for pl in p.tensors if pl.shards]
    assert "output.weight" in split and "blk.0.ffn_up.weight" in split
    for name in names:
        assert p.device_of(name) == m.device_of(name), name
    assert p.device_of("output.weight") == "virtual:0,virtual:1"
    # 320 vocabulary rows split at 160, rounded down to 128 (a multiple of 64).
    out = next(pl for pl in p.tensors if pl.name == "output.weight")
    assert [(d, a, b) for d, a, b, _ in out.shards] == [
        ("virtual:0", 0, 128),
        ("virtual:1", 128, 320),
    ]
    by = {d.name: d for d in p.devices}
    assert "rows 0..128 of output" in by["virtual:0"].holds
    assert "output" not in by["virtual:1"].holds
    n = p.n_layers - 1
    assert by["virtual:1"].holds == ["rows 128..320 of output", f"row slices of layers 0-{n}"]
    table = p.explain()
    line = next(s for s in table.splitlines() if s.startswith("virtual:1"))
    assert line.endswith(f"rows 128..320 of output + row slices of layers 0-{n}"), table
    m.unload()


def test_gemma3_plans_with_sliding_window_and_tied_head(tmp_path):
    """A gemma3-like GGUF (gguf-py): its head is tied (no output.weight), and its sliding-window
    layers are named. The engine runs gemma3 and keeps each sliding layer's cache as a ring of
    llama.cpp's SWA cells, so the plan counts exactly the cells llama.cpp allocates
    (tests/data/swa_reference.json, from llama.cpp's own log) and says so."""
    import gen_swa_reference as swa

    path = tmp_path / "gemma3.gguf"
    swa.write_gemma3_gguf(path)
    ref = json.loads((DATA / "swa_reference.json").read_text())
    kv_row = 2 * ref["model"]["n_kv_heads"] * ref["model"]["head_dim"] * 2  # K and V, f16
    n_layers = ref["model"]["n_layers"]
    with wl.open(path) as ckpt:
        assert ckpt.spec.architecture == "gemma3"
        # No output.weight: tied, whatever the architecture (as llama.cpp falls back).
        assert ckpt.spec.tie_word_embeddings
        embd = next(t.nbytes for t in ckpt.tensors if t.name == "token_embd.weight")
        for case in ref["cases"]:
            p = wl.plan(
                ckpt,
                devices="virtual:64MiB,cpu",
                n_gpu_layers=-1,
                cache=wl.CacheSpec(case["n_ctx"]),
                runtime=wl.RuntimeSpec(max_input_len=case["n_ubatch"]),
            )
            cells = sum(case[c]["cells"] * case[c]["layers"] for c in ("base", "swa"))
            assert cells <= case["n_ctx"] * n_layers, case
            assert sum(d.kv for d in p.devices) == cells * kv_row, case
            assert p.tied_output_copy == "virtual:0"
            gpu = next(d for d in p.devices if d.name == "virtual:0")
            assert "output (tied copy)" in gpu.holds
            assert gpu.weights == sum(t.nbytes for t in ckpt.tensors if t.layer is not None) + (
                next(t.nbytes for t in ckpt.tensors if t.name == "output_norm.weight") + embd
            )
            w = "\n".join(p.warnings)
            assert (
                "layers 0-4, 6-7 attend to a sliding window of 300 tokens: each keeps "
                f"{case['swa']['cells']} cells of kv per sequence"
            ) in w, w
            assert "is planned, but the engine runs only" not in w, w


def test_a_multimodal_checkpoint_plans_its_language_model_layers() -> None:
    """transformers saves Gemma3ForConditionalGeneration with its decoder blocks under
    `language_model.model.layers.N` and a vision tower with layers of its own
    (tests/gen_gemma3_multimodal.py): the blocks are the model's layers, the vision tower's
    are not, and the norm under the language model is the output norm."""
    path = DATA / "tiny-gemma3-mm"
    ck = wl.open(path)
    layers = {t.name: t.layer for t in ck.tensors}
    assert layers["language_model.model.layers.1.mlp.up_proj.weight"] == 1
    assert layers["vision_tower.encoder.layers.0.mlp.fc1.weight"] is None
    per_layer = [sum(t.nbytes for t in ck.tensors if t.layer == n) for n in (0, 1)]
    assert per_layer[0] == per_layer[1] > 0
    plan = wl.plan(path, devices="virtual:1MiB,cpu", cache=wl.CacheSpec(64))
    on_device = sum(p.nbytes for p in plan.tensors if p.device == "virtual:0")
    assert on_device >= sum(per_layer), "the decoder layers carry their weights"
    assert plan.device_of("language_model.model.norm.weight") == "virtual:0"
    assert "layers 0-1 + output_norm" in plan.explain()
    # The engine runs gemma3's text model, not the multimodal wrapper's naming: load refuses
    # before reading a byte, naming what it looked for.
    with pytest.raises(wl.FormatError, match="missing tensors: model.embed_tokens.weight"):
        wl.Model(path).load()


def test_a_multi_process_world_lists_its_ranks(demo_gguf: Path) -> None:
    """world= plans a torchrun-style tensor-parallel run: it implies tensor_parallel, each rank
    stands for the accelerator of its index, and explain() names its host and device."""
    plan = wl.plan(demo_gguf, devices="virtual:3x1GiB,cpu", world="node0:2,node1:1")
    assert plan.strategy == "tensor_parallel"
    text = plan.explain()
    assert "ranks (3, one process per gpu)" in text
    assert "rank   2  node1 cuda:0  (planned as virtual:2)" in text
    with pytest.raises(wl.PlanError, match="one rank per accelerator"):
        wl.plan(demo_gguf, devices="virtual:3x1GiB,cpu", world="node0:2")
    with pytest.raises(wl.PlanError, match="world"):
        wl.plan(demo_gguf, devices="virtual:3x1GiB,cpu", world="node0:3", strategy="autosplit")

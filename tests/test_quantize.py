"""Quantise on load (`quantize=`) against files and logits nobody here wrote: llama.cpp's own
Q8_0, Q6_K and Q4_K_M quantisations of the tiny-llama reference model (made by
`llama-quantize` from the same weights, in the reference data) and transformers'
f32 forward pass over those files' dequantised weights (`hf_dequant_logits_*_rows.npy`, at
the positions the reference keeps)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import weightlift as wl
from conftest import TINY_LLAMA, kept_rows
from reference.materialize import N_HEAD, N_KV_HEAD, gguf_rows, hf_name

# Every test here reads the reference pack: without it each fails, naming `make reference`.
pytestmark = pytest.mark.usefixtures("reference_data")

SAFETENSORS = TINY_LLAMA / "safetensors"
GGUF = {
    "q8_0": TINY_LLAMA / "gguf" / "tiny-llama-Q8_0.gguf",
    "q6_k": TINY_LLAMA / "gguf" / "tiny-llama-Q6_K.gguf",
    "q4_k": TINY_LLAMA / "gguf" / "tiny-llama-Q4_K_M.gguf",
}
# hf_name and gguf_rows (the converter's naming and q/k row order) come from the reference
# builder, which rebuilds llama.cpp's files with them.


def ids() -> list[int]:
    data = json.loads((TINY_LLAMA / "ids.json").read_text())
    return data["ids"] if isinstance(data, dict) else data


def load(quantize: str, devices: str = "cpu", staging_bytes: int | None = None) -> wl.Model:
    m = wl.Model(SAFETENSORS, devices=devices, quantize=quantize, compute="exact", n_threads=1)
    m.load(cache=wl.CacheSpec(32, dtype="f32"), staging_bytes=staging_bytes)
    return m


@pytest.mark.parametrize(
    ("quantize", "devices", "staging_bytes"),
    [
        ("q8_0", "cpu", None),
        # The smallest staging buffer (4 KiB: two 1536-byte rows of ffn_down per chunk, eight
        # of the others), into a device arena and into host memory.
        ("q6_k", "virtual:64MiB,cpu", 4096),
        ("q4_k", "cpu", 4096),
    ],
)
def test_quantised_tensors_are_llama_cpps_bytes(
    quantize: str, devices: str, staging_bytes: int | None
) -> None:
    m = load(quantize, devices, staging_bytes)
    assert m.plan is not None and m.plan.quantize == quantize
    ref = wl.open(GGUF[quantize])
    compared = 0
    for t in ref.tensors:
        if len(t.shape) != 2:
            continue
        name = hf_name(t.name)
        info = m.tensor_info(name)
        if info.dtype != t.dtype:
            # Q4_K_M gives blk.1.attn_v and blk.1.ffn_down more bits; q4_k does not.
            assert quantize == "q4_k" and t.name in {"blk.1.attn_v.weight", "blk.1.ffn_down.weight"}
            continue
        ours = m.tensor(name)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            ours = gguf_rows(ours, N_HEAD if ".attn_q." in t.name else N_KV_HEAD)
        assert np.array_equal(ours, np.asarray(ref.raw(t.name))), t.name
        assert info.nbytes == t.nbytes
        compared += 1
    assert compared == (13 if quantize == "q4_k" else 15)
    # Norms stay as stored.
    assert m.tensor_info("model.norm.weight").dtype == "BF16"


@pytest.mark.parametrize("quantize", ["q8_0", "q6_k"])
def test_quantised_logits_match_transformers_on_the_dequantised_file(quantize: str) -> None:
    m = load(quantize)
    # The reference keeps 6 of the 16 positions, whole rows.
    positions, want = kept_rows(f"tiny-llama/hf_dequant_logits_{quantize.upper()}")
    got = m.forward(ids(), logits="all")
    assert got.shape == (len(ids()), want.shape[1])
    got = got[positions]
    assert np.abs(got - want).max() <= 1e-3
    assert (got.argmax(1) == want.argmax(1)).all()


def test_int8_holds_row_wise_absmax_quants() -> None:
    m = load("int8")
    name = "model.layers.0.mlp.down_proj.weight"
    info = m.tensor_info(name)
    rows, cols = info.shape
    assert info.dtype == "INT8" and info.nbytes == rows * cols + 4 * rows
    # bitsandbytes' int8_vectorwise_quant: round(w · (127.0 / absmax(row))), the scale as torch
    # divides a number by a tensor: the tensor's f32 reciprocal times the number.
    w = wl.open(SAFETENSORS).dequantize(name).reshape(rows, cols)
    absmax = np.abs(w).max(axis=1, keepdims=True)
    q = m.tensor(name)
    assert q.dtype == np.int8 and q.shape == (rows, cols)
    scale = np.float32(127) * (np.float32(1) / absmax)
    assert np.array_equal(q, np.rint(w * scale).astype(np.int8))
    back = m.tensor(name, dequantize=True)
    assert np.abs(back - w).max() <= absmax.max() / 127
    # The embedding (also the head) stays in full precision, as transformers keeps it.
    assert m.tensor_info("model.embed_tokens.weight").dtype == "BF16"


@pytest.mark.parametrize("quantize", ["int8", "q8_0", "q4_k"])
def test_the_plan_sizes_what_the_load_holds(quantize: str) -> None:
    plan = wl.plan(
        SAFETENSORS, devices="virtual:64MiB,cpu", quantize=quantize, cache=wl.CacheSpec(32)
    )
    m = wl.Model(SAFETENSORS, devices="virtual:64MiB,cpu", quantize=quantize)
    m.load(plan, cache=wl.CacheSpec(32))
    for p in plan.tensors:
        info = m.tensor_info(p.name)
        assert (info.dtype, info.nbytes) == (p.dtype, p.nbytes), p.name
    assert m.memory()["virtual:0"] == plan.devices[0].used
    plain = wl.plan(SAFETENSORS, devices="virtual:64MiB,cpu", cache=wl.CacheSpec(32))
    assert plan.devices[0].weights < plain.devices[0].weights
    assert f"quantize {quantize}" in plan.explain()


def test_refusals_name_the_reason() -> None:
    with pytest.raises(wl.PlanError, match=r"token_embd.weight.*already Q8_0"):
        wl.plan(GGUF["q8_0"], devices="cpu", quantize="q4_k")
    with pytest.raises(wl.PlanError, match=r"int8, q8_0, q4_k or q6_k.*'q5_k'"):
        wl.Model(SAFETENSORS, quantize="q5_k")
    with pytest.raises(wl.PlanError, match="int8 with tensor_parallel"):
        wl.plan(SAFETENSORS, devices="virtual:2x64MiB", strategy="tensor_parallel", quantize="int8")
    with pytest.raises(wl.PlanError, match="split_mode='row'"):
        wl.plan(SAFETENSORS, devices="virtual:2x64MiB", split_mode="row", quantize="q8_0")
    # Nothing was loaded by a refused request.
    m = wl.Model(GGUF["q8_0"], quantize="q8_0")
    with pytest.raises(wl.PlanError, match="already"):
        m.load()
    assert not m.loaded


def test_cli_quantize_flag() -> None:
    from test_cli import run

    out = run("plan", SAFETENSORS, "--devices", "cpu", "--quantize", "q6_k", "--json")
    assert out.returncode == 0, out.stderr
    placed = {t["name"]: t for t in json.loads(out.stdout)["tensors"]}
    assert placed["model.layers.1.mlp.up_proj.weight"]["dtype"] == "Q6_K"
    out = run("load", SAFETENSORS, "--quantize", "int8")
    assert out.returncode == 0, out.stderr
    assert "quantize int8" in out.stdout
    bad = run("load", SAFETENSORS, "--quantize", "q5_k")
    assert bad.returncode != 0 and "invalid choice: 'q5_k'" in bad.stderr


def test_a_quantising_load_on_the_cpu_is_charged_its_staging_buffers() -> None:
    plain = wl.plan(SAFETENSORS, devices="cpu")
    quantised = wl.plan(SAFETENSORS, devices="cpu", quantize="q8_0")
    # Two 4 MiB buffers, the chunks rows are quantised from.
    assert quantised.devices[0].scratch - plain.devices[0].scratch == 2 * 4 * 2**20


def test_gptq_parts_keep_their_stored_types_under_dtype() -> None:
    gptq = Path(__file__).resolve().parents[1] / "crates/weightlift-format/tests/data/gptq/g32"
    placed = {p.name: p for p in wl.plan(gptq, devices="cpu", dtype="float32").tensors}
    scales = [p for n, p in placed.items() if n.endswith(".scales")]
    assert scales and all(p.dtype == "F16" for p in scales)
    # The float tensors around them do convert.
    assert placed["model.norm.weight"].dtype == "F32"
    with pytest.raises(wl.PlanError, match="part of a GPTQ/EXL2 linear"):
        wl.plan(gptq, devices="cpu", quantize="int8")


def test_an_exl2_checkpoint_runs_on_the_host_path() -> None:
    """exllamav2's packing (the format crate's EXL2 fixture) against transformers' f32 logits
    over the weights exllamav2's arithmetic gives (crates/weightlift-engine/tests/
    gen_exl2_logits.py), with the packed tensors on a virtual device."""
    repo = Path(__file__).resolve().parents[1]
    exl2 = repo / "crates/weightlift-format/tests/data/exl2"
    data = repo / "crates/weightlift-engine/tests/data/exl2"
    ids = json.loads((data / "meta.json").read_text())["ids"]
    want = np.load(data / "logits.npy")
    m = wl.Model(exl2, devices="virtual:64MiB,cpu", compute="exact", n_threads=1)
    m.load(cache=wl.CacheSpec(32, dtype="f32"))
    q_weight = "model.layers.0.mlp.down_proj.q_weight"
    assert (m.device_of(q_weight), m.tensor_info(q_weight).dtype) == ("virtual:0", "I32")
    got = m.forward(ids, logits="all")
    assert np.abs(got - want).max() <= 4e-6 * np.abs(want).max()
    assert np.array_equal(got.argmax(1), want.argmax(1))


def test_int8_runs_llm_int8_and_its_threshold_is_a_setting() -> None:
    """The int8 forward pass against transformers' f32 logits of the same bf16 weights (the
    engine's own tests check it against bitsandbytes' ops bit for bit)."""
    m = load("int8")
    want = np.load(TINY_LLAMA / "hf_logits.npy")
    assert m.int8_threshold == 6.0
    got = m.forward(ids(), logits="all")
    assert np.abs(got - want).max() <= 0.6
    m.int8_threshold = 0.0  # every column an outlier: f32 on the dequantised weights
    wl.Cache(m, max_seq_len=32, dtype="f32")
    exact = m.forward(ids(), logits="all")
    assert not np.array_equal(exact, got)
    with pytest.raises(wl.WeightliftError, match="threshold"):
        m.int8_threshold = float("nan")


@pytest.mark.parametrize("quantize", ["int8", "q8_0"])
def test_layers_left_on_disk_stay_in_their_stored_type(quantize: str) -> None:
    # The host streams a disk layer from the file at every forward pass, so quantising it
    # would repeat the work each time: it stays a view of the file, as under dtype=.
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    kw = dict(devices="cpu,disk", device_map=device_map, quantize=quantize)
    plan = wl.plan(SAFETENSORS, cache=wl.CacheSpec(32, dtype="f32"), **kw)
    m = wl.Model(SAFETENSORS, devices="cpu,disk", quantize=quantize, compute="exact", n_threads=1)
    m.load(plan, cache=wl.CacheSpec(32, dtype="f32"))
    stored = wl.open(SAFETENSORS)
    name = "model.layers.1.mlp.down_proj.weight"
    assert plan.device_of(name) == "disk"
    assert m.tensor_info(name).dtype == "BF16"
    assert np.array_equal(m.tensor(name), np.asarray(stored.raw(name)))
    assert m.tensor_info("model.layers.0.mlp.down_proj.weight").dtype == quantize.upper()
    for p in plan.tensors:
        info = m.tensor_info(p.name)
        assert (info.dtype, info.nbytes) == (p.dtype, p.nbytes), p.name
    # Half the linears quantised: as close to transformers' f32 logits as the whole model is.
    want = np.load(TINY_LLAMA / "hf_logits.npy")
    got = m.forward(ids(), logits="all")
    assert np.abs(got - want).max() <= 0.6
    assert (got.argmax(1) == want.argmax(1)).sum() >= 15

"""Quantise on load under tensor parallelism: tiny-llama's bf16 safetensors loaded with
`load_tp` over two virtual devices and `quantize="q8_0"`, each shard against the matching slice
of llama.cpp's own Q8_0 quantisation of the same weights (rows for q/k/v/gate/up, each row's
block range for o_proj/down), and the logits against the single-device quantised model and
transformers' forward pass over llama.cpp's dequantised file."""

from __future__ import annotations

import numpy as np
import pytest
import weightlift as wl
from conftest import kept_rows
from test_quantize import GGUF, N_HEAD, N_KV_HEAD, SAFETENSORS, gguf_rows, hf_name, ids

pytestmark = pytest.mark.usefixtures("reference_data")

RT = {"max_input_len": 16, "max_attention_size": 256, "max_dq_size": 1 << 16}
DEVICES = "virtual:2x48MiB,cpu"
HEAD_DIM = 64
# Q8_0: 32 values in 34 bytes (an f16 scale and 32 int8 quants).
BLOCK, BLOCK_BYTES = 32, 34
COLUMN_SPLIT = ("o_proj", "down_proj")


def load_tp(quantize: str) -> wl.Model:
    m = wl.Model(SAFETENSORS, devices=DEVICES, runtime=RT, compute="exact", quantize=quantize)
    m.load_tp(expect_cache_tokens=256, expect_cache_base="f32")
    return m


def test_each_shard_is_llama_cpps_q8_0_slice() -> None:
    m = load_tp("q8_0")
    plan = m.plan
    assert plan is not None and plan.quantize == "q8_0"
    placed = {p.name: p for p in plan.tensors}
    ref = wl.open(GGUF["q8_0"])
    split = 0
    for t in ref.tensors:
        if len(t.shape) != 2:
            continue
        name = hf_name(t.name)
        want = np.asarray(ref.raw(t.name))
        info = m.tensor_info(name)
        assert (info.dtype, info.nbytes) == ("Q8_0", t.nbytes), name
        ours = m.tensor(name)
        shards = placed[name].shards
        if name == "model.embed_tokens.weight":
            # The embedding stays whole on the host (its tied head copy is checked by logits).
            assert not shards
            assert np.array_equal(ours, want), name
            continue
        assert len(shards) == 2 and len({s[0] for s in shards}) == 2, name
        for dev, a, b, nbytes in shards:
            if name.endswith(tuple(f"{c}.weight" for c in COLUMN_SPLIT)):
                # Whole blocks of every row: the cut falls on a block boundary.
                assert a % BLOCK == 0 and b % BLOCK == 0, (name, a, b)
                cols = slice(a // BLOCK * BLOCK_BYTES, b // BLOCK * BLOCK_BYTES)
                got, expect = ours[:, cols], want[:, cols]
            else:
                got, expect = ours[a:b], want[a:b]
                if "q_proj" in name or "k_proj" in name:
                    # llama.cpp's rope row order permutes within each head; shards are whole heads.
                    assert (b - a) % HEAD_DIM == 0
                    got = gguf_rows(got, (b - a) // HEAD_DIM)
            assert got.nbytes == nbytes, (name, dev)
            assert np.array_equal(got, expect), (name, dev, a, b)
            split += 1
        if "q_proj" in name or "k_proj" in name:
            ours = gguf_rows(ours, N_HEAD if "q_proj" in name else N_KV_HEAD)
        assert np.array_equal(ours, want), name
    assert split == 2 * 14
    # The plan's per-device weights are what the load holds: the shards above, norms, cache.
    for d in plan.devices:
        if d.name.startswith("virtual"):
            assert m.memory()[d.name] == d.weights + d.kv + d.scratch, d.name
    assert m.tensor_info("model.norm.weight").dtype == "BF16"


def test_tp_q8_0_logits_equal_one_device_q8_0() -> None:
    tp = load_tp("q8_0")
    one = wl.Model(SAFETENSORS, devices="cpu", runtime=RT, compute="exact", quantize="q8_0")
    one.load(cache=wl.CacheSpec(256, dtype="f32"))
    want = one.forward(ids(), logits="all")
    got = tp.forward(ids(), logits="all")
    scale = max(1.0, float(np.abs(want).max()))
    # The f32 reduction order of the partial sums only, as test_engine_tp bounds it.
    assert float(np.abs(got - want).max()) / scale <= 1e-4
    assert np.array_equal(got.argmax(-1), want.argmax(-1))
    # And transformers over llama.cpp's dequantised Q8_0 file, the single-device bound, at the
    # positions the reference keeps.
    positions, hf = kept_rows("tiny-llama/hf_dequant_logits_Q8_0")
    assert float(np.abs(got[positions] - hf).max()) <= 1e-3
    prompt = ids()[:4]
    assert tp.generate(prompt, max_new_tokens=8, temperature=0.0) == one.generate(
        prompt, max_new_tokens=8, temperature=0.0
    )


def test_int8_and_cuts_inside_a_block_are_refused() -> None:
    with pytest.raises(wl.PlanError, match="int8 with tensor_parallel") as e:
        load_tp("int8")
    assert "outlier columns" in str(e.value)
    # Two heads of 64 per device cut o_proj's 256 columns at 128, inside a 256-value block.
    for quantize, dtype in (("q4_k", "Q4_K"), ("q6_k", "Q6_K")):
        with pytest.raises(wl.PlanError, match=rf"256-value block of {dtype}") as e:
            load_tp(quantize)
        assert "o_proj.weight" in str(e.value) or "down_proj.weight" in str(e.value)

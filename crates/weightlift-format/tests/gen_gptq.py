"""Write the GPTQ fixtures in data/gptq/: tiny llama-family checkpoints whose linears were packed
by auto-gptq 0.7.1 (`QuantLinear.pack`) from known integers, and the dense weights that
gptqmodel 7.7.0's dequantiser (`convert_gptq_file`) reads back from each saved file.

Every linear starts from random integer codes q[in, out], zero points z[group, out], f16 scales
s[group, out] and a group index g_idx[in]. Its float weight W[o, i] = (q[i, o] - z[g, o]) * s[g, o]
(g = g_idx[i]) is exact in f32, so auto-gptq's packer recovers exactly those codes; the generator
checks that gptqmodel's dequantised weight equals W bit for bit before writing anything.

Variants (folder: what it covers):
  g32          llama, 2 layers, 4-bit, group 32, asymmetric, v1 zeros, config.json's
               quantization_config
  act_order    qwen2 (q/k/v biases), 4-bit, group 32, desc_act with a shuffled g_idx, symmetric,
               auto-gptq's quantize_config.json beside a config.json without quantization_config
  int8         8-bit, group 64
  int3         3-bit, group 32 (codes straddle int32 words), desc_act
  int2         2-bit, group 32
  v2           checkpoint_format gptq_v2 (zero points stored as they are, zero 0 included), its
               qzeros packed by gptqmodel's `pack_cols`; lm_head quantised too
  per_channel  group_size -1 (one group over all inputs), saved without g_idx

Each folder holds config.json, model.safetensors and expected.json (per linear: shape and the
FNV-1a-64 of the dequantised f32 and f16 weights with a few sampled values; per tensor: dtype,
shape and byte range from the safetensors header).

Run: .cache/qwen2-venv/bin/python crates/weightlift-format/tests/gen_gptq.py
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import quant_refs as refs
import torch
from safetensors.torch import save_file

OUT = refs.DATA / "gptq"

VARIANTS = [
    dict(
        name="g32",
        model_type="llama",
        layers=2,
        inter=128,
        bits=4,
        group=32,
        desc_act=False,
        sym=False,
        fmt="gptq",
        beside=False,
    ),
    dict(
        name="act_order",
        model_type="qwen2",
        layers=1,
        inter=64,
        bits=4,
        group=32,
        desc_act=True,
        sym=True,
        fmt="gptq",
        beside=True,
    ),
    dict(
        name="int8",
        model_type="llama",
        layers=1,
        inter=64,
        bits=8,
        group=64,
        desc_act=False,
        sym=False,
        fmt="gptq",
        beside=False,
    ),
    dict(
        name="int3",
        model_type="llama",
        layers=1,
        inter=64,
        bits=3,
        group=32,
        desc_act=True,
        sym=False,
        fmt="gptq",
        beside=False,
    ),
    dict(
        name="int2",
        model_type="llama",
        layers=1,
        inter=64,
        bits=2,
        group=32,
        desc_act=False,
        sym=False,
        fmt="gptq",
        beside=False,
    ),
    dict(
        name="v2",
        model_type="llama",
        layers=1,
        inter=64,
        bits=4,
        group=32,
        desc_act=False,
        sym=False,
        fmt="gptq_v2",
        beside=False,
        lm_head=True,
    ),
    dict(
        name="per_channel",
        model_type="llama",
        layers=1,
        inter=64,
        bits=4,
        group=-1,
        desc_act=False,
        sym=False,
        fmt="gptq",
        beside=False,
        no_g_idx=True,
    ),
]
HIDDEN = 64
VOCAB = 32


def known_linear(rng, v: dict, n_in: int, n_out: int) -> dict:
    bits, maxq = v["bits"], (1 << v["bits"]) - 1
    gs = n_in if v["group"] == -1 else v["group"]
    n_groups = math.ceil(n_in / gs)
    if v["desc_act"]:
        # act-order: inputs are quantised in a permuted order and grouped by that order.
        perm = rng.permutation(n_in)
        g_idx = np.empty(n_in, dtype=np.int32)
        g_idx[perm] = np.arange(n_in) // gs
    else:
        g_idx = (np.arange(n_in) // gs).astype(np.int32)
    q = rng.integers(0, maxq + 1, size=(n_in, n_out))
    if v["sym"]:
        z = np.full((n_groups, n_out), 1 << (bits - 1))
    elif v["fmt"] == "gptq_v2":
        z = rng.integers(0, maxq + 1, size=(n_groups, n_out))
        z[0, 0], z[-1, -1] = 0, maxq
    else:
        # v1 stores zero - 1 and auto-gptq's packer cannot store -1, so v1 zero points start at 1
        # (the reason gptq_v2 exists).
        z = rng.integers(1, maxq + 1, size=(n_groups, n_out))
    s = rng.uniform(0.002, 0.03, size=(n_groups, n_out)).astype(np.float16)
    w = (q.T - z[g_idx].T).astype(np.float32) * s[g_idx].T.astype(np.float32)
    return dict(q=q, z=z, s=s, g_idx=g_idx, w=w, gs=gs)


def pack(QuantLinear, gm, v: dict, k: dict, bias: np.ndarray | None) -> dict:
    n_out, n_in = k["w"].shape
    ql = QuantLinear(v["bits"], v["group"], n_in, n_out, bias is not None)
    lin = torch.nn.Linear(n_in, n_out, bias=bias is not None)
    lin.weight.data = torch.from_numpy(k["w"].copy())
    if bias is not None:
        lin.bias.data = torch.from_numpy(bias.astype(np.float32))
    scales = torch.from_numpy(k["s"].astype(np.float32)).T.clone()
    zeros = torch.from_numpy(k["z"].astype(np.float32)).T.clone()
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.pack(lin, scales, zeros, torch.from_numpy(k["g_idx"]))
    out = {
        "qweight": ql.qweight.to(torch.int32),
        "qzeros": ql.qzeros.to(torch.int32),
        "scales": ql.scales.to(torch.float16),
        "g_idx": ql.g_idx.to(torch.int32),
    }
    if v["fmt"] == "gptq_v2":
        out["qzeros"] = gm.pack_cols(
            torch.from_numpy(k["z"]).to(torch.int32), v["bits"], pack_dtype=torch.int32
        )
    if bias is not None:
        out["bias"] = torch.from_numpy(bias)
    # The packer must have kept the codes: gptqmodel's unpacker reads them back.
    codes = gm.unpack_rows(out["qweight"], v["bits"]).numpy()
    assert (codes[:n_in] == k["q"]).all(), "auto-gptq packed other codes than it was given"
    return out


def quant_config(v: dict) -> dict:
    if v["beside"]:
        # auto-gptq 0.7.1 `BaseQuantizeConfig.to_dict()`.
        return {
            "bits": v["bits"],
            "group_size": v["group"],
            "damp_percent": 0.01,
            "desc_act": v["desc_act"],
            "static_groups": False,
            "sym": v["sym"],
            "true_sequential": True,
            "model_name_or_path": None,
            "model_file_base_name": "model",
            "is_marlin_format": False,
            "quant_method": "gptq",
        }
    qc = {
        "quant_method": "gptq",
        "bits": v["bits"],
        "group_size": v["group"],
        "desc_act": v["desc_act"],
        "sym": v["sym"],
        "damp_percent": 0.01,
        "true_sequential": True,
        "checkpoint_format": v["fmt"],
        "pack_dtype": "int32",
    }
    if v["fmt"] == "gptq_v2":
        qc["format"] = v["fmt"]
    if v.get("lm_head"):
        qc["lm_head"] = True
    return qc


def build(QuantLinear, gm, v: dict, seed: int) -> None:
    rng = np.random.default_rng(seed)
    config = refs.tiny_config(v["model_type"], v["layers"], HIDDEN, v["inter"], VOCAB)
    qc = quant_config(v)
    if not v["beside"]:
        config["quantization_config"] = qc

    tensors: dict[str, torch.Tensor] = {}
    known: dict[str, dict] = {}

    def f16(*shape, scale=0.02):
        return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float16))

    tensors["model.embed_tokens.weight"] = f16(VOCAB, HIDDEN)
    tensors["model.norm.weight"] = f16(HIDDEN, scale=1.0)
    linears = [
        (f"model.layers.{layer}.{suffix}", n_in, n_out)
        for layer in range(v["layers"])
        for suffix, n_in, n_out in refs.linear_shapes(config)
    ]
    if v.get("lm_head"):
        linears.append(("lm_head", HIDDEN, VOCAB))
    else:
        tensors["lm_head.weight"] = f16(VOCAB, HIDDEN)
    for layer in range(v["layers"]):
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = f16(HIDDEN, scale=1.0)
        tensors[f"model.layers.{layer}.post_attention_layernorm.weight"] = f16(HIDDEN, scale=1.0)
    for prefix, n_in, n_out in linears:
        k = known_linear(rng, v, n_in, n_out)
        has_bias = v["model_type"] == "qwen2" and prefix.split(".")[-1] in (
            "q_proj",
            "k_proj",
            "v_proj",
        )
        bias = (rng.standard_normal(n_out) * 0.1).astype(np.float16) if has_bias else None
        for part, t in pack(QuantLinear, gm, v, k, bias).items():
            tensors[f"{prefix}.{part}"] = t
        known[prefix] = k

    # The reference reads back every saved linear; a variant saved without g_idx is read from
    # a copy that still has it (g_idx = i // group_size, which is what its absence means).
    folder = OUT / v["name"]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "model.safetensors"
        save_file({k: t.contiguous() for k, t in tensors.items()}, full, metadata={"format": "pt"})
        dense32 = gm.convert_gptq_file(full, torch.float32, qc, "cpu")
        dense16 = gm.convert_gptq_file(full, torch.float16, qc, "cpu")
    if v.get("no_g_idx"):
        tensors = {k: t for k, t in tensors.items() if not k.endswith(".g_idx")}
    model = folder / "model.safetensors"
    save_file({k: t.contiguous() for k, t in tensors.items()}, model, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if v["beside"]:
        (folder / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")

    expected = {"linears": {}, "tensors": refs.header_table(model)}
    for prefix, n_in, n_out in linears:
        w32 = dense32[f"{prefix}.weight"].numpy()
        w16 = dense16[f"{prefix}.weight"].numpy()
        if not np.array_equal(w32, known[prefix]["w"]):
            raise SystemExit(
                f"{v['name']}: {prefix}: gptqmodel's dequantised weight differs from "
                "the weight auto-gptq packed"
            )
        entry = refs.digest_weight(w32, w16, rng)
        entry.update(
            in_features=n_in, out_features=n_out, n_groups=int(known[prefix]["s"].shape[0])
        )
        expected["linears"][prefix] = entry
    refs.write_json(folder / "expected.json", expected)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder.relative_to(refs.REPO)}: {len(linears)} linears, {size} bytes")


def main() -> None:
    QuantLinear = refs.auto_gptq_quant_linear()
    gm = refs.gptqmodel_dequant()
    torch.manual_seed(0)
    for seed, v in enumerate(VARIANTS):
        build(QuantLinear, gm, v, seed)


if __name__ == "__main__":
    main()

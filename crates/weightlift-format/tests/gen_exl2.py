"""Write the EXL2 fixture in data/exl2/: a tiny qwen2 checkpoint (1 layer, q/k/v biases, a
quantised lm_head whose 48 outputs are padded to 64) whose linears were packed by exllamav2
0.3.2's own `AdaptiveGPTQ.pack`, with the CUDA packing kernels it calls compiled for the host
(see quant_refs.py), from known integer codes.

Each linear has groups of every width exllamav2 writes (8, 6, 5, 4, 3 and 2 bits, in the
descending order its kernels walk), a random input permutation (`q_invperm`), 4-bit scale codes
`q_scale` in 1..16 and f16 `q_scale_max` per group, some small enough that `q_scale_max / 256`
is an f16 subnormal.

The expected weight follows exllamav2's arithmetic, all in f16 as its kernels do: the scale is
`f16(code^2) * f16(q_scale_max * 2^-8)` (the expression `AdaptiveQuantizer.find_params` uses,
and what `dq_scale` computes after the loader divides `q_scale_max` by 256), and each weight is
`f16(q - 2^(bits-1)) * scale` (`fused_quantize_adjust_kernel`, `dq_ns` then `__hmul2`), placed
at input row `perm[j]` for stored row j, perm = argsort(q_invperm) as the loader computes it.

Writes config.json, model.safetensors and expected.json (as in gen_gptq.py; the f32 digest is
of the f16 weights widened, since exllamav2 defines its weights in f16).

Run: .cache/qwen2-venv/bin/python crates/weightlift-format/tests/gen_exl2.py
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import quant_refs as refs
import torch
from safetensors.torch import save_file

OUT = refs.DATA / "exl2"
HIDDEN, INTER, VOCAB = 64, 128, 48

# (bits, rows) of each group, per projection.
GROUPS = {
    "self_attn.q_proj": [(6, 32), (5, 32)],
    "self_attn.k_proj": [(8, 32), (4, 32)],
    "self_attn.v_proj": [(4, 64)],
    "self_attn.o_proj": [(3, 32), (2, 32)],
    "mlp.gate_proj": [(5, 32), (5, 32)],
    "mlp.up_proj": [(4, 32), (3, 32)],
    "mlp.down_proj": [(8, 32), (6, 32), (4, 32), (2, 32)],
    "lm_head": [(8, 32), (6, 32)],
}


class _Layer:
    def __init__(self, bias):
        self.bias = bias


def pack_linear(AdaptiveGPTQ, rng, key: str, n_in: int, n_out: int, groups, bias):
    """Known codes in, exllamav2's packed tensors and the expected f16 weight out."""
    assert sum(r for _, r in groups) == n_in
    perm = rng.permutation(n_in)
    qweight = np.zeros((n_in, n_out), dtype=np.int16)  # stored (permuted) row order
    qscale = rng.integers(1, 17, size=(len(groups), n_out)).astype(np.int16)
    qscale_max = rng.uniform(0.002, 0.08, size=len(groups)).astype(np.float16)
    qgroups, group_size, row = [], {}, 0
    w16 = torch.zeros((n_out, n_in), dtype=torch.float16)
    prescale = torch.tensor([1 / 256], dtype=torch.half)
    for g, (bits, rows) in enumerate(groups):
        assert group_size.setdefault(bits, rows) == rows
        qgroups += [bits, 0]
        codes = rng.integers(0, 1 << bits, size=(rows, n_out))
        qweight[row : row + rows] = codes
        qs = torch.from_numpy(qscale[g].astype(np.int64))
        scale = (qs * qs).to(torch.half) * (torch.tensor(qscale_max[g]).half() * prescale)
        dq = torch.from_numpy(codes - (1 << (bits - 1))).to(torch.half) * scale
        w16[:, torch.from_numpy(perm[row : row + rows])] = dq.T
        row += rows

    obj = AdaptiveGPTQ.__new__(AdaptiveGPTQ)
    obj.layer = _Layer(None if bias is None else torch.from_numpy(bias))
    obj.device = torch.device("cpu")
    obj.rows, obj.columns = n_in, n_out
    obj.group_size = group_size
    obj.qweight = torch.from_numpy(qweight)
    obj.qscale = torch.from_numpy(qscale)
    obj.qscale_max = torch.from_numpy(qscale_max)
    obj.qgroups = torch.tensor(qgroups, dtype=torch.short)
    obj.invperm = torch.argsort(torch.from_numpy(perm))

    class QParams:
        scale_bits = 4

    with refs.cuda_moves_stay_on_cpu():
        packed = AdaptiveGPTQ.pack(obj, key, QParams())
    return {k: v.contiguous() for k, v in packed.items()}, w16


def main() -> None:
    AdaptiveGPTQ = refs.exllamav2_adaptive_gptq()
    rng = np.random.default_rng(7)
    config = refs.tiny_config("qwen2", 1, HIDDEN, INTER, VOCAB)
    config["quantization_config"] = {
        # The keys exllamav2's `compile.py` writes.
        "quant_method": "exl2",
        "version": "0.3.2",
        "bits": 4.6,
        "head_bits": 8,
        "calibration": {"rows": 1, "length": 32, "dataset": "(known integer codes)"},
    }

    def f16(*shape, scale=0.02):
        return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float16))

    tensors = {
        "model.embed_tokens.weight": f16(VOCAB, HIDDEN),
        "model.norm.weight": f16(HIDDEN, scale=1.0),
        "model.layers.0.input_layernorm.weight": f16(HIDDEN, scale=1.0),
        "model.layers.0.post_attention_layernorm.weight": f16(HIDDEN, scale=1.0),
    }
    linears = [
        (f"model.layers.0.{s}", n_in, n_out) for s, n_in, n_out in refs.linear_shapes(config)
    ]
    linears.append(("lm_head", HIDDEN, VOCAB))
    dense = {}
    for prefix, n_in, n_out in linears:
        suffix = prefix.removeprefix("model.layers.0.")
        has_bias = suffix in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        bias = (rng.standard_normal(n_out) * 0.1).astype(np.float16) if has_bias else None
        packed, w16 = pack_linear(AdaptiveGPTQ, rng, prefix, n_in, n_out, GROUPS[suffix], bias)
        tensors.update(packed)
        dense[prefix] = w16

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    model = OUT / "model.safetensors"
    save_file(tensors, model, metadata={"format": "pt"})
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    expected = {"linears": {}, "tensors": refs.header_table(model)}
    for prefix, n_in, n_out in linears:
        w16 = dense[prefix].numpy()
        entry = refs.digest_weight(w16.astype(np.float32), w16, rng)
        entry.update(
            in_features=n_in,
            out_features=n_out,
            groups=[list(g) for g in GROUPS[prefix.removeprefix("model.layers.0.")]],
        )
        expected["linears"][prefix] = entry
    refs.write_json(OUT / "expected.json", expected)
    size = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"{OUT.relative_to(refs.REPO)}: {len(linears)} linears, {size} bytes")


if __name__ == "__main__":
    main()

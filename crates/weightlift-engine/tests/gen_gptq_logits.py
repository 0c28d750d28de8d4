"""Reference logits for the GPTQ forward tests (tests/gptq_forward.rs): transformers' forward pass
in float32 over the weights gptqmodel 7.7.0's dequantiser (`convert_gptq_file`) reads back from
each GPTQ fixture of the format crate (crates/weightlift-format/tests/data/gptq, packed by
auto-gptq 0.7.1's `QuantLinear.pack`; see gen_gptq.py there).

For every fixture: the dense float32 state dict from gptqmodel, loaded into transformers'
`LlamaForCausalLM` / `Qwen2ForCausalLM` built from the fixture's config.json (without its
quantization_config), eager attention, run over IDS; the logits of every position go to
data/gptq/<variant>.npy (float32, [len(IDS), vocab]). A fixture saved without g_idx
(`per_channel`) is read by gptqmodel from a copy with the g_idx its absence means
(`i // group_size`, all 0 for one group).

Run: .cache/qwen2-venv/bin/python crates/weightlift-engine/tests/gen_gptq_logits.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parents[1] / "weightlift-format" / "tests" / "data" / "gptq"
OUT = HERE / "data" / "gptq"
sys.path.insert(0, str(FIXTURES.parents[1]))

import quant_refs as refs  # noqa: E402

VARIANTS = ["g32", "act_order", "int8", "int3", "int2", "v2", "per_channel"]
IDS = [1, 5, 9, 30, 2, 17, 3, 3, 25, 11, 0, 31]


def quant_config(folder: Path) -> tuple[dict, dict]:
    config = json.loads((folder / "config.json").read_text())
    qc = config.pop("quantization_config", None)
    if qc is None:
        qc = json.loads((folder / "quantize_config.json").read_text())
    return config, qc


def dense(gm, folder: Path, qc: dict) -> dict[str, torch.Tensor]:
    tensors = load_file(folder / "model.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        for name in [k for k in tensors if k.endswith(".qweight")]:
            prefix = name[: -len(".qweight")]
            if f"{prefix}.g_idx" not in tensors:
                n_in = tensors[name].shape[0] * 32 // qc["bits"]
                gs = n_in if qc["group_size"] == -1 else qc["group_size"]
                tensors[f"{prefix}.g_idx"] = torch.arange(n_in, dtype=torch.int32) // gs
        save_file(tensors, path, metadata={"format": "pt"})
        return gm.convert_gptq_file(path, torch.float32, qc, "cpu")


def logits(config: dict, state: dict[str, torch.Tensor]) -> np.ndarray:
    import transformers

    arch = config["architectures"][0]
    cfg_cls = transformers.Qwen2Config if arch.startswith("Qwen2") else transformers.LlamaConfig
    cfg = cfg_cls(**config)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, arch)(cfg).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # rotary buffers are computed, not stored
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        out = model(torch.tensor([IDS]), use_cache=False).logits[0]
    return out.to(torch.float32).numpy()


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    gm = refs.gptqmodel_dequant()
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"ids": IDS, "transformers": None, "torch": torch.__version__, "variants": {}}
    for variant in VARIANTS:
        folder = FIXTURES / variant
        config, qc = quant_config(folder)
        state = dense(gm, folder, qc)
        out = logits(config, state)
        np.save(OUT / f"{variant}.npy", out.astype("<f4"))
        meta["variants"][variant] = {
            "shape": list(out.shape),
            "max_abs": float(np.abs(out).max()),
        }
        print(f"{variant}: logits {out.shape}, max |logit| {np.abs(out).max():.4f}")
    import transformers

    meta["transformers"] = transformers.__version__
    (OUT / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Reference logits for the LLM.int8 forward tests (tests/int8_forward.rs): tiny-qwen2
(tests/data/tiny-qwen2, f16 weights read as float32, with q/k/v biases) run by transformers in
float32, every
projection of its decoder layers replaced by bitsandbytes 0.50.2's LLM.int8 product on the CPU.

Each projection's weight is quantised once by `bitsandbytes.functional.int8_vectorwise_quant`
(row-wise absmax, threshold 0: `CB`, `SCB`); at every call its float32 input is quantised by the
same function with the outlier threshold, and `torch.ops.bitsandbytes.int8_mixed_scaled_mm`
(threshold > 0) or `int8_scaled_mm` (threshold 0) multiplies, then the bias is added. This is
`MatMul8bitLt.forward`'s sequence with float32 activations (bitsandbytes itself first casts them
to float16; the engine keeps float32 activations, which the same functions accept). The logits of
every position of the tiny-qwen2 reference ids go to data/int8/tiny_qwen2_t6.npy (threshold 6.0,
transformers' `llm_int8_threshold`) and tiny_qwen2_t0.npy (threshold 0), float32 [16, 320].

Run (bitsandbytes installed with `pip install --target .cache/bnb-site --no-deps
bitsandbytes==0.50.2`, torch and transformers from the qwen2 venv):
  PYTHONPATH=.cache/bnb-site .cache/qwen2-venv/bin/python \\
      crates/weightlift-engine/tests/gen_int8_logits.py
"""

from __future__ import annotations

import importlib.metadata as md
import json
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
MODEL = REPO / "tests" / "data" / "tiny-qwen2"
OUT = HERE / "data" / "int8"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Int8Linear(torch.nn.Module):
    def __init__(self, lin: torch.nn.Linear, threshold: float):
        import bitsandbytes.functional as F

        super().__init__()
        self.cb, self.scb, _ = F.int8_vectorwise_quant(lin.weight.detach().float(), threshold=0.0)
        self.bias = None if lin.bias is None else lin.bias.detach().float()
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes.functional as F

        a = x.reshape(-1, x.shape[-1]).float()
        ca, sca, cols = F.int8_vectorwise_quant(a, threshold=self.threshold)
        if self.threshold > 0.0:
            if cols is None:
                cols = torch.empty(0, dtype=torch.int64)
            y = torch.ops.bitsandbytes.int8_mixed_scaled_mm(
                a, ca, self.cb, sca, self.scb, cols, self.bias
            )[0]
        else:
            y = torch.ops.bitsandbytes.int8_scaled_mm.default(
                ca, self.cb, sca, self.scb, bias=self.bias, dtype=torch.float32
            )
        return y.reshape(*x.shape[:-1], y.shape[-1])


def run(threshold: float, ids: list[int]) -> np.ndarray:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        MODEL, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    n = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                if hasattr(parent, name):
                    setattr(parent, name, Int8Linear(getattr(parent, name), threshold))
                    n += 1
    assert n == 7 * len(model.model.layers), n
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def main() -> None:
    torch.set_num_threads(1)
    ids = json.loads((MODEL / "stats.json").read_text())["ids"]
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {
        "ids": ids,
        "bitsandbytes": md.version("bitsandbytes"),
        "transformers": md.version("transformers"),
        "torch": torch.__version__,
        "files": {},
    }
    for threshold, name in [(6.0, "tiny_qwen2_t6"), (0.0, "tiny_qwen2_t0")]:
        out = run(threshold, ids)
        np.save(OUT / f"{name}.npy", out.astype("<f4"))
        meta["files"][f"{name}.npy"] = {"threshold": threshold, "shape": list(out.shape)}
        print(f"{name}: {out.shape}, max |logit| {np.abs(out).max():.4f}")
    (OUT / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Reference logits for the EXL2 forward tests (tests/exl2_forward.rs): transformers' forward pass
in float32 over the weights exllamav2's arithmetic gives the EXL2 fixture of the format crate
(crates/weightlift-format/tests/data/exl2, packed by exllamav2 0.3.2's `AdaptiveGPTQ.pack`; see
gen_exl2.py there).

That fixture's expected.json holds digests of each linear's weight, not the weight, so this
script runs the fixture's generator again into a temporary folder, keeping the dense f16 weight
of every linear it packs. The regenerated config.json, model.safetensors and expected.json must
equal the committed ones byte for byte, and each kept weight must have the f16 digest
expected.json records: the weights below are then exactly the fixture's.

Those weights (widened to f32) and the fixture's float tensors (embedding, norms, q/k/v biases,
widened from f16) go into transformers' `Qwen2ForCausalLM`, built from the fixture's config.json
without its quantization_config, eager attention, run over IDS; the logits of every position go
to data/exl2/logits.npy (float32, [len(IDS), vocab]) and the ids and versions to
data/exl2/meta.json.

Run: .cache/qwen2-venv/bin/python crates/weightlift-engine/tests/gen_exl2_logits.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
FORMAT_TESTS = HERE.parents[1] / "weightlift-format" / "tests"
FIXTURE = FORMAT_TESTS / "data" / "exl2"
OUT = HERE / "data" / "exl2"
sys.path.insert(0, str(FORMAT_TESTS))

import gen_exl2  # noqa: E402
import quant_refs as refs  # noqa: E402

# Every id below the fixture's vocabulary of 48 is valid; 47 is the last real row of the head,
# whose 48 outputs are stored padded to 64 columns.
IDS = [1, 5, 9, 30, 2, 17, 3, 3, 25, 11, 0, 31, 47, 40, 22, 8]


def fixture_weights() -> dict[str, torch.Tensor]:
    """The f16 weight of every linear, as the fixture's generator computes it."""
    kept: dict[str, torch.Tensor] = {}
    pack = gen_exl2.pack_linear

    def keeping(adaptive_gptq, rng, key, *args):
        packed, w16 = pack(adaptive_gptq, rng, key, *args)
        kept[key] = w16.clone()
        return packed, w16

    # under the repository: the generator names its output folder relative to it
    refs.CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=refs.CACHE) as tmp:
        gen_exl2.pack_linear = keeping
        gen_exl2.OUT = Path(tmp) / "exl2"
        try:
            gen_exl2.main()
        finally:
            gen_exl2.pack_linear = pack
        for name in ("config.json", "model.safetensors", "expected.json"):
            again = (gen_exl2.OUT / name).read_bytes()
            if again != (FIXTURE / name).read_bytes():
                raise SystemExit(f"{name}: the generator no longer writes the committed fixture")
    expected = json.loads((FIXTURE / "expected.json").read_text())["linears"]
    if sorted(kept) != sorted(expected):
        raise SystemExit(f"linears {sorted(kept)} differ from expected.json's {sorted(expected)}")
    for prefix, w16 in kept.items():
        digest = refs.fnv1a64(w16.numpy().astype("<f2").tobytes())
        if digest != expected[prefix]["f16_fnv1a64"]:
            raise SystemExit(f"{prefix}: f16 digest {digest}, expected.json has another")
    return kept


def state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stored = load_file(FIXTURE / "model.safetensors")
    state = {
        name: t.to(torch.float32)
        for name, t in stored.items()
        if name.endswith(".weight") or name.endswith(".bias")
    }
    for prefix, w16 in weights.items():
        state[f"{prefix}.weight"] = w16.to(torch.float32)
    return state


def logits(config: dict, state: dict[str, torch.Tensor]) -> np.ndarray:
    import transformers

    cfg = transformers.Qwen2Config(**config)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # rotary buffers are computed, not stored
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        out = model(torch.tensor([IDS]), use_cache=False).logits[0]
    return out.to(torch.float32).numpy()


def main() -> None:
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = json.loads((FIXTURE / "config.json").read_text())
    config.pop("quantization_config")
    out = logits(config, state_dict(fixture_weights()))
    OUT.mkdir(parents=True, exist_ok=True)
    np.save(OUT / "logits.npy", out.astype("<f4"))
    top2 = np.sort(out, axis=1)[:, -2:]
    meta = {
        "ids": IDS,
        "shape": list(out.shape),
        "max_abs": float(np.abs(out).max()),
        "min_top1_margin": float((top2[:, 1] - top2[:, 0]).min()),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    (OUT / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(
        f"logits {out.shape}, max |logit| {meta['max_abs']:.4f}, "
        f"smallest top-1 margin {meta['min_top1_margin']:.3e}"
    )


if __name__ == "__main__":
    main()

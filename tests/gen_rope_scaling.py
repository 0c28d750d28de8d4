"""References for RoPE scaled by a config or by GGUF metadata (linear, and YaRN as Qwen2.5's
and Qwen3's long-context configs ask for it), on the weights of ``tests/data/tiny-qwen3``.

Run it with the fixture venv of ``gen_qwen3.py`` (torch, transformers, llama-cpp-python
0.3.36, the converter out of the pinned sdist)::

    .cache/fixture-venv/bin/python tests/gen_rope_scaling.py

For each variant of ``VARIANTS`` it copies the fixture's folder with ``config.json``'s
``rope_parameters`` replaced, and writes into ``tests/data/tiny-qwen3/``:

- ``hf_logits_<variant>.npy``: transformers' f32 logits of ``stats.json``'s ids;
- ``tiny-qwen3-<variant>.gguf.header``: the header (metadata and tensor table) of the F16 GGUF
  llama.cpp's converter writes for that folder. Its tensor data is ``tiny-qwen3-F16.gguf``'s
  byte for byte (checked here), so only the header is kept: the tests append that data and
  check the whole file against the sha256 in ``rope_scaling.json``;
- ``llamacpp_logits_<variant>.npy``: llama.cpp's logits on that GGUF;

and ``rope_scaling.json``: the variants, the GGUFs' data offsets and sha256, the distances
between the references, and transformers' YaRN inverse frequencies and attention factors for
the configs of ``YARN_CONFIGS`` (``attention_factor``, ``mscale``, ``truncate``, betas).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import fixture_lib as fl  # before torch: it sets the thread counts
import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

OUT = fl.DATA / "tiny-qwen3"
STEM = "tiny-qwen3"
THETA = 1_000_000.0
# The fixture's 16 positions with a pretraining length of 64 put YaRN's band over the first
# three of its 16 pairs: pairs kept, blended and slowed all occur.
VARIANTS: dict[str, dict[str, object]] = {
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": THETA,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "rope_theta": THETA, "factor": 4.0},
}
# YaRN's other knobs, for the inverse frequencies alone (head_dim 32 and 128).
YARN_CONFIGS: list[dict[str, object]] = [
    {"factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 4.0, "original_max_position_embeddings": 4096, "head_dim": 128},
    {"factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2},
    {"factor": 4.0, "original_max_position_embeddings": 512, "attention_factor": 1.25},
    {
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "head_dim": 128,
    },
    {"factor": 2.5, "original_max_position_embeddings": 300, "truncate": False},
]


def copy_with_rope(dest: Path, rope: dict[str, object]) -> Path:
    """The fixture's folder (weights, tokenizer, templates) with ``rope_parameters`` set."""
    folder = dest / STEM
    folder.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(OUT / name, folder / name)
    for name in ("generation_config.json", "chat_template.jinja"):
        if (OUT / name).exists():
            shutil.copy(OUT / name, folder / name)
    config = json.loads((OUT / "config.json").read_text())
    config["rope_parameters"] = rope
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def hf_logits(folder: Path, ids: list[int]) -> np.ndarray:
    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return fl.logits(model, ids)


def data_offset(path: Path) -> int:
    import gguf

    return int(gguf.GGUFReader(path).data_offset)


def yarn_reference(extra: dict[str, object]) -> dict[str, object]:
    """transformers' inverse frequencies and attention factor for a qwen3 config with YaRN."""
    rope = {"rope_type": "yarn", "rope_theta": THETA, **extra}
    head_dim = int(rope.pop("head_dim", 32))  # type: ignore[call-overload]
    config = Qwen3Config(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=int(rope["original_max_position_embeddings"]) * 4,  # type: ignore[call-overload]
        rope_parameters=rope,
    )
    inv, attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    return {
        "rope_parameters": rope,
        "head_dim": head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "inv_freq": [float(x) for x in inv.tolist()],
        "attention_factor": float(attention),
    }


def main() -> int:
    root = fl.start()
    stats = json.loads((OUT / "stats.json").read_text())
    ids = [int(i) for i in stats["ids"]]
    plain = np.load(OUT / "hf_logits.npy")
    base = OUT / f"{STEM}-F16.gguf"
    base_data = base.read_bytes()[data_offset(base) :]
    report: dict[str, object] = {"ids_from": "stats.json", "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        # the procedure gives the fixture's own logits for its own config
        (Path(tmp) / "plain").mkdir()
        own = {"rope_type": "default", "rope_theta": THETA}
        same = hf_logits(copy_with_rope(Path(tmp) / "plain", own), ids)
        report["max_abs_plain_vs_fixture"] = float(np.abs(same - plain).max())
        assert report["max_abs_plain_vs_fixture"] <= 1e-5, report
        for name, rope in VARIANTS.items():
            work = Path(tmp) / name
            work.mkdir()
            folder = copy_with_rope(work, rope)
            hf = hf_logits(folder, ids)
            np.save(OUT / f"hf_logits_{name}.npy", hf)
            gguf_path = work / f"{STEM}-{name}-F16.gguf"
            fl.convert(folder, "f16", gguf_path, root, "qwen2")
            raw = gguf_path.read_bytes()
            offset = data_offset(gguf_path)
            assert raw[offset:] == base_data, f"{name}: the converter's tensors differ"
            header = OUT / f"{STEM}-{name}.gguf.header"
            header.write_bytes(raw[:offset])
            cpp = fl.llamacpp_logits(gguf_path, ids)
            np.save(OUT / f"llamacpp_logits_{name}.npy", cpp)
            report["variants"][name] = {  # type: ignore[index]
                "rope_parameters": rope,
                "gguf_header": header.name,
                "gguf_data_from": base.name,
                "gguf_data_offset": offset,
                "gguf_sha256": fl.sha256(gguf_path),
                "gguf_metadata": {
                    k: v for k, v in fl.gguf_metadata(gguf_path, "qwen3", ()).items() if "rope" in k
                },
                "max_abs_hf_vs_plain": float(np.abs(hf - plain).max()),
                "max_abs_llamacpp_vs_hf": float(np.abs(cpp - hf).max()),
            }
    report["yarn_inv_freq"] = [yarn_reference(c) for c in YARN_CONFIGS]
    report["versions"] = fl.versions(root)
    (OUT / "rope_scaling.json").write_text(json.dumps(report, indent=1) + "\n")
    for name, v in report["variants"].items():  # type: ignore[union-attr]
        print(name, v["max_abs_hf_vs_plain"], v["max_abs_llamacpp_vs_hf"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

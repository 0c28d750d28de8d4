"""Write tests/data/device_map_goldens/*.json: the device maps that transformers' `from_pretrained`
and accelerate compute for llama configs under fixed `max_memory` budgets.

Each model is built on the meta device from its config (no weights), then:

- transformers: `integrations.accelerate._get_device_map(model, preset, max_memory, None)`, the
  call `PreTrainedModel.from_pretrained` makes for `device_map="auto" | "balanced" |
  "balanced_low_0" | "sequential"`;
- accelerate: `infer_auto_device_map(model, get_balanced_memory(model, max_memory, ...))` for
  `balanced` / `balanced_low_0`, and `infer_auto_device_map(model, max_memory)` for `sequential`.

Integer device keys are accelerators in order; "cpu" and "disk" are the host and the disk.
The machine needs no GPU: both libraries plan for the devices named in `max_memory`.

Run with a venv holding torch, transformers 5.x and accelerate:

    .cache/devmap-venv/bin/python tests/gen_device_map_goldens.py
"""

from __future__ import annotations

import copy
import json
import logging
import re
import warnings
from pathlib import Path

import accelerate
import torch
import transformers
from accelerate import infer_auto_device_map
from accelerate.utils import get_balanced_memory
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.accelerate import _get_device_map, compute_module_sizes

OUT = Path(__file__).resolve().parent / "data" / "device_map_goldens"
DATA = Path(__file__).resolve().parent / "data"
MiB, GiB = 1 << 20, 1 << 30
PRESETS = ["auto", "balanced", "balanced_low_0", "sequential"]

# The published configs, reduced to the keys that decide the tensor shapes.
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


def tiny_llama() -> dict:
    return json.loads((DATA / "tiny-llama" / "config.json").read_text())


# (name, config, budgets): each budget is one `max_memory`; together they put everything on
# the accelerators, spill to the cpu, and spill to the cpu and the disk.
MODELS = [
    (
        "tiny-llama",
        tiny_llama(),
        [
            {0: 18 * MiB, 1: 18 * MiB, "cpu": 8 * MiB},
            {0: 17 * MiB, 1: 1 * MiB, "cpu": 32 * MiB},
            {0: 2 * MiB, 1: 2 * MiB, "cpu": 18 * MiB},
        ],
    ),
    (
        "smollm2-135m",
        SMOLLM2_135M,
        [
            {0: 200 * MiB, 1: 200 * MiB, "cpu": 100 * MiB},
            {0: 80 * MiB, 1: 80 * MiB, "cpu": 200 * MiB},
            {0: 64 * MiB, 1: 48 * MiB, "cpu": 64 * MiB},
        ],
    ),
    (
        "llama-3.1-8b",
        LLAMA_3_1_8B,
        [
            {0: 10 * GiB, 1: 10 * GiB, "cpu": 8 * GiB},
            {0: 6 * GiB, 1: 5 * GiB, "cpu": 8 * GiB},
            {0: 4 * GiB, 1: 4 * GiB, "cpu": 3 * GiB},
        ],
    ),
    (
        "llama-2-7b-3gpu",
        LLAMA_2_7B,
        [
            {0: 6 * GiB, 1: 6 * GiB, 2: 6 * GiB, "cpu": 8 * GiB},
            {0: 3 * GiB, 1: 3 * GiB, 2: 4 * GiB, "cpu": 8 * GiB},
            {0: 2 * GiB, 1: 3 * GiB, 2: 3 * GiB, "cpu": 2 * GiB},
        ],
    ),
]


def meta_model(config: dict) -> torch.nn.Module:
    cfg = AutoConfig.for_model(**config)
    dtype = getattr(torch, config.get("torch_dtype") or config.get("dtype"))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def device_of(device_map: dict, module: str):
    """The device of `module`: its own entry or its closest ancestor's."""
    name = module
    while True:
        if name in device_map:
            return device_map[name]
        if name == "":
            raise KeyError(module)
        name = name.rsplit(".", 1)[0] if "." in name else ""


def units(device_map: dict, n_layers: int) -> dict:
    return {
        "embed_tokens": device_of(device_map, "model.embed_tokens"),
        "layers": [device_of(device_map, f"model.layers.{i}") for i in range(n_layers)],
        "norm": device_of(device_map, "model.norm"),
        "lm_head": device_of(device_map, "lm_head"),
    }


def jsonable(mapping: dict) -> dict:
    return {str(k): v for k, v in mapping.items()}


def golden(name: str, config: dict, budgets: list[dict]) -> dict:
    model = meta_model(config)
    n_layers = config["num_hidden_layers"]
    no_split = sorted(model._no_split_modules)
    sizes, _ = compute_module_sizes(model)
    wanted = ["", "model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"]
    wanted += [f"model.layers.{i}" for i in range(n_layers)]
    cases = []
    for budget in budgets:
        tf = {}
        for preset in PRESETS:
            dm = _get_device_map(model, preset, copy.deepcopy(budget), None)
            tf[preset] = {"device_map": jsonable(dm), "units": units(dm, n_layers)}
        acc = {}
        for preset in ["balanced", "balanced_low_0", "sequential"]:
            if preset == "sequential":
                caps = copy.deepcopy(budget)
            else:
                caps = get_balanced_memory(
                    model,
                    max_memory=copy.deepcopy(budget),
                    no_split_module_classes=no_split,
                    low_zero=preset == "balanced_low_0",
                )
            dm = infer_auto_device_map(
                model, max_memory=copy.deepcopy(caps), no_split_module_classes=no_split
            )
            acc[preset] = {
                "max_memory": jsonable(caps),
                "device_map": jsonable(dm),
                "units": units(dm, n_layers),
            }
        cases.append({"max_memory": jsonable(budget), "transformers": tf, "accelerate": acc})
    return {
        "generator": "tests/gen_device_map_goldens.py",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
        },
        "model": name,
        "config": config,
        "no_split_modules": no_split,
        "module_sizes": {k: int(sizes[k]) for k in wanted},
        "cases": cases,
    }


def compact(text: str) -> str:
    """Lists of plain values on one line: the per-layer lists stay readable and small."""
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]", text)


def main() -> None:
    # Both libraries warn that the accelerators in max_memory are absent; that is the point.
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    OUT.mkdir(parents=True, exist_ok=True)
    for name, config, budgets in MODELS:
        doc = golden(name, config, budgets)
        path = OUT / f"{name}.json"
        path.write_text(compact(json.dumps(doc, indent=1)) + "\n")
        print(f"{path}: {len(doc['cases'])} budgets")


if __name__ == "__main__":
    main()

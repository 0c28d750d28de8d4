"""Device maps against transformers' `from_pretrained` and accelerate, computed by the libraries
themselves on meta-device models (tests/data/device_map_goldens, written by
tests/gen_device_map_goldens.py): `plan(config, device_map=PRESET)` and `from_pretrained`
give transformers 5's maps, `plan(config, strategy=NAME)` accelerate's, layer by layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import weightlift as wl
from conftest import DATA

GOLDENS = DATA / "device_map_goldens"
NAMES = ["tiny-llama", "smollm2-135m", "llama-3.1-8b", "llama-2-7b-3gpu"]
MiB = 1 << 20
# accelerate and transformers count weights only: no forward pass, so no scratch.
NO_SCRATCH = wl.RuntimeSpec(0, 0, 0)
# The loader's two 4 MiB upload buffers live in host RAM, which neither library counts: the
# cpu's budget gets them on top (each is bounded by the largest tensor; every model here has
# an embedding larger than 4 MiB).
STAGING = 2 * 4 * MiB


def golden(name: str) -> dict:
    # A missing golden is a failure: regenerate it with tests/gen_device_map_goldens.py.
    return json.loads((GOLDENS / f"{name}.json").read_text())


def budgets(case: dict) -> tuple[str, dict[int | str, int]]:
    """Devices large enough that `max_memory` decides, and the golden's max_memory."""
    mm: dict[int | str, int] = {
        int(k) if k.isdigit() else k: v for k, v in case["max_memory"].items()
    }
    gpus = sum(isinstance(k, int) for k in mm)
    mm["cpu"] += STAGING
    return f"virtual:{gpus}x1TiB,cpu:1TiB,disk", mm


def want(units: dict) -> dict:
    def dev(d: int | str) -> str:
        return f"virtual:{d}" if isinstance(d, int) else d

    return {
        "embed_tokens": dev(units["embed_tokens"]),
        "layers": [dev(d) for d in units["layers"]],
        "norm": dev(units["norm"]),
        "lm_head": dev(units["lm_head"]),
    }


def got(p: wl.Plan, norm: str, head: str) -> dict:
    names = {t.name for t in p.tensors}
    return {
        "embed_tokens": p.embed_device,
        "layers": p.layer_devices,
        "norm": p.device_of(norm),
        # A tied head has no tensor: it is computed where the plan says.
        "lm_head": p.device_of(head) if head in names else p.head_device,
    }


def cases(lib: str) -> list[tuple[str, int, str]]:
    out = []
    for name in NAMES:
        path = GOLDENS / f"{name}.json"
        n = len(json.loads(path.read_text())["cases"]) if path.exists() else 1
        presets = (
            ["auto", "balanced", "balanced_low_0", "sequential"]
            if lib == "transformers"
            else ["balanced", "balanced_low_0", "sequential"]
        )
        out += [(name, i, preset) for i in range(n) for preset in presets]
    return out


@pytest.mark.parametrize(("name", "i", "preset"), cases("transformers"))
def test_device_map_presets_give_transformers_maps(name: str, i: int, preset: str) -> None:
    g = golden(name)
    case = g["cases"][i]
    devices, mm = budgets(case)
    p = wl.plan(
        g["config"],
        devices=devices,
        device_map=preset,
        max_memory=mm,
        runtime=NO_SCRATCH,
    )
    assert got(p, "output_norm.weight", "output.weight") == want(
        case["transformers"][preset]["units"]
    ), p.explain()


@pytest.mark.parametrize(("name", "i", "strategy"), cases("accelerate"))
def test_strategies_give_accelerate_maps(name: str, i: int, strategy: str) -> None:
    g = golden(name)
    case = g["cases"][i]
    devices, mm = budgets(case)
    p = wl.plan(g["config"], devices=devices, strategy=strategy, max_memory=mm, runtime=NO_SCRATCH)
    assert got(p, "output_norm.weight", "output.weight") == want(
        case["accelerate"][strategy]["units"]
    ), p.explain()


def test_the_two_balanced_rules_differ_where_the_libraries_do() -> None:
    """SmolLM2 on 2 x 200 MiB: transformers 5 budgets GPU 0 by the embedding (the largest
    module), accelerate by one decoder layer, so their balanced splits differ."""
    g = golden("smollm2-135m")
    case = g["cases"][0]
    devices, mm = budgets(case)
    tf = wl.plan(
        g["config"], devices=devices, device_map="balanced", max_memory=mm, runtime=NO_SCRATCH
    )
    acc = wl.plan(
        g["config"], devices=devices, strategy="balanced", max_memory=mm, runtime=NO_SCRATCH
    )
    assert tf.layer_devices.count("virtual:0") == 19
    assert acc.layer_devices.count("virtual:0") == 11


@pytest.mark.parametrize("preset", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_from_pretrained_loads_transformers_maps(tiny_llama_st: Path, preset: str) -> None:
    """The real tiny-llama checkpoint, loaded over virtual devices with every budget: the
    loaded model's map is transformers' for the same config."""
    g = golden("tiny-llama")
    assert g["config"]["num_hidden_layers"] == 2 and g["config"]["tie_word_embeddings"]
    names = [t.name for t in wl.open(tiny_llama_st).tensors]
    for case in g["cases"]:
        _, mm = budgets(case)
        m = wl.from_pretrained(
            tiny_llama_st,
            device_map=preset,
            max_memory=mm,
            devices="virtual:2x64MiB,cpu:1GiB,disk",
            runtime=NO_SCRATCH,
        )
        p = m.plan
        assert got(p, "model.norm.weight", "lm_head.weight") == want(
            case["transformers"][preset]["units"]
        ), p.explain()
        for name in names:
            assert m.device_of(name) == p.device_of(name), name
        m.unload()

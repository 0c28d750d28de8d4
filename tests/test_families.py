"""The model families beyond llama, through the Python API and the CLI, against what
transformers computed for their tiny random fixtures (``tests/data/tiny-<family>/``, made by
``tests/gen_<family>.py``): the tokenizer's ids, greedy ``generate``, a chat completion with
the checkpoint's chat template, and ``weightlift run --chat``; ``inspect`` and ``plan`` without
loading; and what stays refused (a RoPE scaling the engine does not apply) refused by name. The
phi3 fixture is scaled by LongRoPE, as Phi-3.5-mini and Phi-4-mini are."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import weightlift as wl

DATA = Path(__file__).parent / "data"
QWEN3 = DATA / "tiny-qwen3"
PHI3 = DATA / "tiny-phi3"
EXE = Path(sys.executable).with_name("weightlift")
# family: (fixture folder, the end-of-turn token its checkpoint names as eos)
FAMILIES = {
    "qwen3": (QWEN3, "<|im_end|>"),
    "phi3": (PHI3, "<|endoftext|>"),
    # the mixture-of-experts fixtures borrow tiny-qwen3's tokenizer and ChatML template
    "qwen3moe": (DATA / "tiny-qwen3moe", "<|im_end|>"),
    "mixtral": (DATA / "tiny-mixtral", "<|im_end|>"),
    # experts narrower than the hidden size, as every released Qwen3-MoE has them (F16 only)
    "qwen3moe-narrow": (DATA / "tiny-qwen3moe-narrow", "<|im_end|>"),
    # layers 1 and 5 of 6 route to experts, the others run a dense MLP (decoder_sparse_step 2,
    # mlp_only_layers [3]); safetensors only: llama.cpp's converter refuses it
    "qwen3moe-mixed": (DATA / "tiny-qwen3moe-mixed", "<|im_end|>"),
}
# family: the architecture its safetensors folder (config.json's model_type) and its GGUF files
# (general.architecture) name, where that is not the family's name: llama.cpp's converter
# writes a Mixtral as a llama with experts.
ARCHITECTURES = {
    "qwen3moe": ("qwen3_moe", "qwen3moe"),
    "mixtral": ("mixtral", "llama"),
    "qwen3moe-narrow": ("qwen3_moe", "qwen3moe"),
    "qwen3moe-mixed": ("qwen3_moe", "qwen3moe"),
}
MOE_FAMILIES = ["mixtral", "qwen3moe", "qwen3moe-narrow"]


def architecture(family: str, gguf_file: bool) -> str:
    hf, gguf_arch = ARCHITECTURES.get(family, (family, family))
    return gguf_arch if gguf_file else hf


def stats(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "stats.json").read_text())


def gguf_types(family: str) -> list[str]:
    """The GGUF files the family's generator wrote: F16, then Q8_0 where there is one; none
    where llama.cpp's converter refused the checkpoint (``gguf_refused``)."""
    return list(stats(FAMILIES[family][0]).get("gguf", {}))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``weightlift ARGS``, which must exit 0."""
    p = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p


def checkpoints(family: str) -> list[Path]:
    """The family's safetensors folder, then each of its GGUF files."""
    folder = FAMILIES[family][0]
    return [folder, *(folder / f"tiny-{family}-{ty}.gguf" for ty in gguf_types(family))]


def models() -> list[tuple[str, str, Any]]:
    """Each family's tiny model loaded from safetensors and from each GGUF file, exact mode."""
    out = []
    for family, (folder, _) in FAMILIES.items():
        out.append(
            (
                family,
                "safetensors",
                lambda f=folder: wl.from_pretrained(f, devices="cpu", compute="exact"),
            )
        )
        for ty in gguf_types(family):
            path = folder / f"tiny-{family}-{ty}.gguf"
            out.append(
                (family, f"gguf-{ty}", lambda p=path: wl.load_gguf(p, n_ctx=64, compute="exact"))
            )
    return out


@pytest.mark.parametrize(
    ("family", "name", "load"), models(), ids=[f"{f}-{n}" for f, n, _ in models()]
)
def test_generate_and_chat_match_transformers(family, name, load):
    folder, eos = FAMILIES[family]
    s = stats(folder)
    m = load()
    assert m.plan.architecture == architecture(family, name != "safetensors")
    # the BPE from tokenizer.json and from the GGUF vocabulary: transformers' ids
    assert m.tokenize(s["prompt"], add_bos=False)[: len(s["ids"])] == s["ids"]
    assert m.token_eos() == m.tokenize(eos, add_bos=False, special=True)[0]
    # The config's vocabulary is padded past tokenizer.json's (as real checkpoints are), and the
    # random model's greedy ids reach the padding (tiny-phi3's: 318 and 319): from safetensors
    # as from GGUF (the converter's [PAD] tokens) they render as nothing, as transformers
    # renders them. Q8_0's own greedy ids are not transformers' (other weights).
    same_weights = name != "gguf-Q8_0"
    if same_weights:
        # transformers' greedy continuation (16 tokens, none an end of generation)
        out = m.generate(s["ids"], max_new_tokens=len(s["greedy_ids"]), do_sample=False)
        assert out == s["greedy_text"]
    r = m.create_chat_completion(
        s["chat_messages"], max_tokens=len(s["chat_greedy_ids"]), temperature=0, repeat_penalty=1.0
    )
    # the checkpoint's chat template rendered as transformers renders it, then its greedy answer
    assert r["usage"]["prompt_tokens"] == len(s["chat_prompt_ids"])
    if same_weights:
        assert r["choices"][0]["message"]["content"] == s["chat_greedy_text"]
        assert r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("family", [f for f in FAMILIES if "Q8_0" in gguf_types(f)])
def test_q8_0_greedy_keeps_transformers_first_token(family):
    # Q8_0's own greedy text is not transformers' (other weights); its prompt logits are held
    # to transformers' on the dequantised weights in the Rust tests. Here: the prompt's last
    # argmax through the API is transformers' first greedy token.
    folder, _ = FAMILIES[family]
    s = stats(folder)
    m = wl.load_gguf(folder / f"tiny-{family}-Q8_0.gguf", n_ctx=64, compute="exact")
    out = m.generate(s["ids"], max_new_tokens=1, do_sample=False)
    assert out == m.detokenize(s["greedy_ids"][:1])


@pytest.mark.parametrize("family", FAMILIES)
def test_run_chat_answers_as_transformers(family):
    folder, _ = FAMILIES[family]
    s = stats(folder)
    cmd = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "weightlift.cli"]
    # the F16 GGUF, or the safetensors folder of a family without one
    path = checkpoints(family)[1 if gguf_types(family) else 0]
    args = [
        "run", str(path), "--chat",
        "-p", s["chat_messages"][0]["content"], "-n", str(len(s["chat_greedy_ids"])),
        "--temp", "0", "--ctx", "64", "--compute", "exact", "--threads", "2",
    ]  # fmt: skip
    p = subprocess.run(
        [*cmd, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == s["chat_greedy_text"] + "\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_and_plan_without_loading(family):
    for path in (checkpoints(family)[0], checkpoints(family)[-1]):
        spec = wl.open(path).spec
        arch = architecture(family, path.suffix == ".gguf")
        assert spec.architecture == arch, path
        plan = wl.plan(path, devices="virtual:2x4MiB,cpu", cache=wl.CacheSpec(64, 1, "f32"))
        assert plan.architecture == arch
        assert {t.name for t in plan.tensors} == {t.name for t in wl.open(path).tensors}


def test_qwen3_head_dim_is_read_not_derived():
    assert wl.open(QWEN3).spec.head_dim == 32  # hidden 64 / 4 heads would be 16


def _gguf_and_folder(folder: Path) -> list[Path]:
    return [folder, *sorted(folder.glob("*-F16.gguf"))]


def test_inspect_shows_the_experts_the_window_and_the_rope_scaling(tmp_path):
    # what the layers do beyond the spec, read as plans and the forward pass read it, against
    # the fixtures' config.json (written by transformers), what transformers' models routed
    # (stats.json) and the GGUF metadata llama.cpp's converter wrote, from both formats
    for family in ["mixtral", "qwen3moe", "qwen3moe-narrow", "qwen3moe-mixed"]:
        folder = FAMILIES[family][0]
        c = json.loads((folder / "config.json").read_text())
        routed = stats(folder).get("routing", {}).get("layers", range(c["num_hidden_layers"]))
        want = {
            "n_experts": c.get("num_local_experts") or c["num_experts"],
            "n_used": c["num_experts_per_tok"],
            "expert_ffn": c.get("moe_intermediate_size") or c["intermediate_size"],
            # Mixtral renormalises whatever its config says
            "norm_topk_prob": c.get("norm_topk_prob", True),
            "dense_layers": sorted(set(range(c["num_hidden_layers"])) - set(routed)),
        }
        for path in _gguf_and_folder(folder):
            ck = wl.open(path)
            assert (ck.experts, ck.sliding_window, ck.rope_scaling) == (want, None, None), path
    for name in ["tiny-gemma2", "tiny-gemma3"]:
        c = json.loads((DATA / name / "config.json").read_text())
        sliding = [i for i, t in enumerate(c["layer_types"]) if t == "sliding_attention"]
        want = {"window": c["sliding_window"], "layers": sliding}
        # Gemma 3 scales its global layers' RoPE only
        rp = c.get("rope_parameters", {}).get("full_attention", {})
        scaled = rp.get("rope_type") == "linear"
        assert scaled == (name == "tiny-gemma3")
        for path in _gguf_and_folder(DATA / name):
            ck = wl.open(path)
            assert (ck.experts, ck.sliding_window) == (None, want), path
            from_ = "metadata" if path.suffix == ".gguf" else "config.json"
            rope = {"kind": "linear", "factor": rp.get("factor"), "original_context": None}
            rope |= {"from": from_, "layers": "full_attention"}
            assert ck.rope_scaling == (rope if scaled else None), path
    c = json.loads((PHI3 / "config.json").read_text())
    original = c["rope_parameters"]["original_max_position_embeddings"]
    stretch = c["max_position_embeddings"] / original
    for path, source in [(PHI3, "config.json"), (PHI3 / "tiny-phi3-F16.gguf", "tensors")]:
        want = {"kind": "longrope", "factor": stretch, "original_context": original}
        assert wl.open(path).rope_scaling == {**want, "from": source, "layers": "all"}, path
    for variant, v in ROPE_SCALING["variants"].items():
        r = v["rope_parameters"]
        original = r.get("original_max_position_embeddings")
        want = {"kind": r["rope_type"], "factor": r["factor"], "original_context": original}
        want["layers"] = "all"
        folder, path = _scaled_qwen3(tmp_path / variant, variant)
        assert wl.open(folder).rope_scaling == {**want, "from": "config.json"}
        assert wl.open(path).rope_scaling == {**want, "from": "metadata"}
    assert wl.open(QWEN3).experts is None and wl.open(QWEN3).rope_scaling is None
    # and the command's lines
    out = run_cli("inspect", str(DATA / "tiny-gemma3" / "tiny-gemma3-F16.gguf")).stdout
    assert "attention     a window of 8 tokens on layers 0-4 (5 of 6)" in out
    assert "rope scaling  linear ×8 on the full-attention layers (metadata)" in out
    out = run_cli("inspect", str(FAMILIES["qwen3moe-mixed"][0])).stdout
    assert "experts       4 a layer, 2 a token, ffn 32, chosen weights renormalised, " in out
    assert "dense layers 0, 2-4" in out
    out = run_cli("inspect", str(PHI3 / "tiny-phi3-F16.gguf")).stdout
    assert "rope scaling  longrope ×8 from 8 positions (tensors)" in out


def _phi3_gguf_with(path: Path, keys: dict[str, Any]) -> Path:
    """The phi3 fixture's F16 GGUF with more metadata keys, written by gguf-py."""
    src = gguf.GGUFReader(PHI3 / "tiny-phi3-F16.gguf")
    w = gguf.GGUFWriter(path, arch="phi3")
    for name, field in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for name, value in keys.items():
        if isinstance(value, str):
            w.add_string(name, value)
        else:
            w.add_float32(name, value)
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        # a scaling type the forward pass does not apply
        ({"phi3.rope.scaling.type": "dynamic"}, "rope scaling type 'dynamic'"),
        # YaRN as DeepSeek's GGUFs write it, with a log multiplier
        (
            {
                "phi3.rope.scaling.type": "yarn",
                "phi3.rope.scaling.factor": 4.0,
                "phi3.rope.scaling.original_context_length": 16.0,
                "phi3.rope.scaling.yarn_log_multiplier": 0.1,
            },
            "YaRN with phi3.rope.scaling.yarn_log_multiplier",
        ),
        # YaRN without its factor
        ({"phi3.rope.scaling.type": "yarn"}, "without a positive phi3.rope.scaling.factor"),
    ],
)
def test_an_unapplied_rope_scaling_in_gguf_is_refused_by_name(tmp_path, keys, words):
    # refused before loading, by name, where it would turn every key at the wrong angles;
    # inspect and plan still read the file
    path = _phi3_gguf_with(tmp_path / "scaled.gguf", keys)
    assert wl.open(path).spec.architecture == "phi3"
    assert wl.plan(path, devices="cpu").architecture == "phi3"
    lines = run_cli("inspect", str(path)).stdout.splitlines()
    warning = next(ln for ln in lines if ln.startswith("warning"))
    assert warning.startswith("warning       rope scaling: ") and words in warning
    for refused in (lambda: wl.open(path).rope_scaling, lambda: wl.load_gguf(path, n_ctx=64)):
        with pytest.raises(wl.UnsupportedError, match=re.escape(words)):
            refused()


ROPE_SCALING = json.loads((QWEN3 / "rope_scaling.json").read_text())


def _exact_logits(path: Path, ids: list[int]) -> np.ndarray:
    m = wl.Model(str(path), devices="cpu", compute="exact")
    m.load(cache=wl.CacheSpec(64, 1, "f32"))
    return m.forward(ids, logits="all").astype(np.float64)


def _scaled_qwen3(tmp_path: Path, variant: str) -> tuple[Path, Path]:
    """tiny-qwen3 with RoPE scaling ``variant``: its folder with config.json's
    ``rope_parameters`` set so, and the F16 GGUF llama.cpp's converter writes for that folder
    (its header kept, its tensors tiny-qwen3-F16.gguf's, the whole checked by its sha256)."""
    v = ROPE_SCALING["variants"][variant]
    folder = tmp_path / "hf"
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((QWEN3 / name).read_bytes())
    config = json.loads((QWEN3 / "config.json").read_text())
    config["rope_parameters"] = v["rope_parameters"]
    (folder / "config.json").write_text(json.dumps(config))
    path = tmp_path / f"tiny-qwen3-{variant}-F16.gguf"
    data = (QWEN3 / v["gguf_data_from"]).read_bytes()
    base_offset = gguf.GGUFReader(QWEN3 / v["gguf_data_from"]).data_offset
    path.write_bytes((QWEN3 / v["gguf_header"]).read_bytes() + data[base_offset:])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == v["gguf_sha256"]
    return folder, path


@pytest.mark.parametrize("variant", ["yarn", "linear"])
def test_rope_scaled_by_config_or_gguf_metadata_is_transformers(tmp_path, variant):
    # tiny-qwen3's weights with config.json's rope_parameters set to YaRN (Qwen2.5's and
    # Qwen3's long-context recipe) or linear scaling, and the F16 GGUF llama.cpp's converter
    # writes for that folder (its header kept, its tensors tiny-qwen3-F16.gguf's): each within
    # 1e-3 of transformers, the same argmax, and no farther from llama.cpp than llama.cpp is
    # from transformers (its f16 KV cache) plus that
    ids = stats(QWEN3)["ids"]
    hf = np.load(QWEN3 / f"hf_logits_{variant}.npy").astype(np.float64)
    plain = np.load(QWEN3 / "hf_logits.npy").astype(np.float64)
    assert np.abs(hf - plain).max() > 1.0  # the scaling moves the logits far past 1e-3
    folder, path = _scaled_qwen3(tmp_path, variant)
    cpp = np.load(QWEN3 / f"llamacpp_logits_{variant}.npy").astype(np.float64)
    for what, source in [("config", folder), ("gguf", path)]:
        got = _exact_logits(source, ids)
        assert np.abs(got - hf).max() <= 1e-3, what
        assert (got.argmax(axis=1) == hf.argmax(axis=1)).all(), what
        assert np.abs(got - cpp).max() <= np.abs(cpp - hf).max() + 1e-3, what


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_config_alone_plans_the_experts_as_the_gguf_holds_them(family):
    # planning before downloading: the config.json of a mixture-of-experts model gives the
    # tensor table llama.cpp's converter writes (the router and the stacked experts, not a dense
    # MLP), so n_cpu_moe, the placement and every device's bytes are those of the real file
    folder, _ = FAMILIES[family]
    gguf = folder / f"tiny-{family}-F16.gguf"
    kw = {"devices": "virtual:64MiB,cpu", "n_gpu_layers": 99, "n_cpu_moe": 1}
    want = wl.plan(gguf, **kw)
    got = wl.plan(folder / "config.json", weight_dtype="f16", **kw)
    table = lambda p: {(t.name, t.device, t.nbytes) for t in p.tensors}  # noqa: E731
    assert table(got) == table(want)
    assert [(d.name, d.weights, d.scratch) for d in got.devices] == [
        (d.name, d.weights, d.scratch) for d in want.devices
    ]
    assert any("experts of layers 0" in h for d in got.devices for h in d.holds)


def test_n_cpu_moe_keeps_the_first_layers_experts_in_host_ram():
    # llama.cpp's --n-cpu-moe: layer 0's experts stay on the cpu, everything else of the layers
    # goes to the accelerator (a virtual device here); the model loaded so gives transformers'
    # greedy ids; fit finds the fewest such layers for a device too small for every expert.
    folder = FAMILIES["qwen3moe"][0]
    path = folder / "tiny-qwen3moe-F16.gguf"
    plan = wl.plan(path, devices="virtual:64MiB,cpu", n_gpu_layers=99, n_cpu_moe=1)
    experts = {t.name: t.device for t in plan.tensors if "_exps" in t.name}
    assert experts and all(d == ("cpu" if ".0." in n else "virtual:0") for n, d in experts.items())
    others = {t.device for t in plan.tensors if t.layer is not None and "_exps" not in t.name}
    assert others == {"virtual:0"}
    assert any("experts of layers 0" in h for d in plan.devices for h in d.holds)

    m = wl.Model(path, devices="virtual:64MiB,cpu", compute="exact")
    m.load(cache={"max_seq_len": 64}, n_gpu_layers=99, n_cpu_moe=1)
    assert m.device_of("blk.0.ffn_up_exps.weight") == "cpu"
    assert m.device_of("blk.1.ffn_up_exps.weight") == "virtual:0"
    s = stats(folder)
    out = m.generate(s["ids"], max_new_tokens=len(s["greedy_ids"]), do_sample=False)
    assert out == s["greedy_text"]
    m.close()

    # the experts of one layer take a fixed share: a device that holds everything but one
    # layer's experts needs n_cpu_moe of 1
    whole = wl.plan(path, devices="virtual:1GiB,cpu", n_gpu_layers=99)
    gpu = next(d for d in whole.devices if d.name == "virtual:0").used
    one_layer = sum(t.nbytes for t in plan.tensors if "_exps" in t.name and ".0." in t.name)
    small = f"virtual:{(gpu - one_layer // 2) // 1024}KiB,cpu"
    assert wl.fit(path, devices=small, target="n_cpu_moe", n_gpu_layers=99) == 1

    out = subprocess.run(
        [str(EXE), "plan", str(path), "--devices", "virtual:64MiB,cpu", "--n-cpu-moe", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "experts of layers 0" in out.stdout, out.stdout


def test_an_exps_override_keeps_every_expert_in_host_ram():
    # llama.cpp's `-ot exps=CPU`: the same placement as n_cpu_moe over every layer, and the
    # model loaded so gives transformers' greedy text. On a safetensors folder, whose names are
    # transformers', the rule matches nothing: the plan says so, and `experts` does the job.
    folder = FAMILIES["qwen3moe"][0]
    path = folder / "tiny-qwen3moe-F16.gguf"
    kw = {"devices": "virtual:64MiB,cpu", "n_gpu_layers": 99}
    plan = wl.plan(path, overrides={"exps": "cpu"}, **kw)
    every = wl.plan(path, n_cpu_moe=99, **kw)
    assert [(t.name, t.device) for t in plan.tensors] == [(t.name, t.device) for t in every.tensors]
    assert {t.device for t in plan.tensors if "_exps" in t.name} == {"cpu"}
    assert any("experts of layers 0-1" in h for d in plan.devices for h in d.holds)
    assert not [w for w in plan.warnings if "matches no tensor" in w]

    m = wl.Model(path, devices="virtual:64MiB,cpu", compute="exact")
    m.load(cache={"max_seq_len": 64}, n_gpu_layers=99, overrides={"exps": "cpu"})
    assert m.device_of("blk.1.ffn_up_exps.weight") == "cpu"
    assert m.device_of("blk.1.attn_q.weight") == "virtual:0"
    s = stats(folder)
    out = m.generate(s["ids"], max_new_tokens=len(s["greedy_ids"]), do_sample=False)
    assert out == s["greedy_text"]
    m.close()

    unmatched = wl.plan(folder, overrides={"exps": "cpu"}, **kw)
    assert {t.device for t in unmatched.tensors if ".experts." in t.name} == {"virtual:0"}
    said = [w for w in unmatched.warnings if "the override 'exps=cpu' matches no tensor" in w]
    assert said and "model.layers." in said[0], unmatched.warnings
    held = wl.plan(folder, overrides={"experts": "cpu"}, **kw)
    assert {t.device for t in held.tensors if ".experts." in t.name} == {"cpu"}


# The Q4_K_M copies: wide siblings of the family fixtures (rows of 256, as Q4_K and Q6_K blocks
# need), quantised by llama.cpp (``tests/data/wide-q4k/<family>``, made by
# ``tests/gen_wide_q4k.py``). The Rust suite ``forward_wide_q4k`` holds every check; here, the
# same files through the Python API.
WIDE_Q4K = DATA / "wide-q4k"
WIDE_FAMILIES = ["qwen3", "gemma3", "phi3", "mixtral", "qwen3moe", "gemma2", "qwen2"]


@pytest.mark.parametrize("family", WIDE_FAMILIES)
def test_q4_k_m_copy_is_transformers_on_its_weights_and_within_llamacpps_distance(family):
    folder = WIDE_Q4K / family
    s = stats(folder)
    m = wl.load_gguf(
        folder / f"wide-{family}-Q4_K_M.gguf",
        n_ctx=64,
        type_k="f32",
        type_v="f32",
        compute="exact",
    )
    assert m.plan.architecture == s["architecture"]
    got = m.forward(s["ids"], logits="all").astype(np.float64)
    dequant = np.load(folder / "hf_dequant_logits_Q4_K_M.npy")
    hf = np.load(folder / "hf_logits.npy")
    lc = np.load(folder / "llamacpp_logits_Q4_K_M.npy")
    # transformers on the weights gguf-py dequantised from the file, within 1e-3
    assert np.abs(got - dequant).max() <= 1e-3
    # no farther from transformers on the f16 weights than llama.cpp is (the Rust suite's
    # slack of 1.1: the two round differently on top of the same 4-bit weights)
    bound = np.abs(lc.astype(np.float64) - hf).max()
    assert bound == pytest.approx(s["summary"]["llamacpp_vs_hf"]["max_abs"])
    assert np.abs(got - hf).max() <= 1.1 * bound
    # the prompt's next token through generate is the dequantised reference's argmax
    assert np.sort(dequant[-1])[-1] - np.sort(dequant[-1])[-2] > 2e-3
    out = m.generate(s["ids"], max_new_tokens=1, do_sample=False)
    assert out == m.detokenize([int(dequant[-1].argmax())])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tensor_parallel_splits_the_experts_whole(family):
    # expert parallelism: load_tp over two virtual devices gives each two of the four experts
    # (the plan's expert table, which explain shows), routers replicated; the logits are
    # transformers' at every position, the greedy text transformers' too. Experts kept in host
    # RAM beside tensor_parallel are refused by name, with the strategies that keep them there.
    folder, _ = FAMILIES[family]
    s = stats(folder)
    path = folder / f"tiny-{family}-F16.gguf"
    plan = wl.plan(path, devices="virtual:2x64MiB", strategy="tensor_parallel")
    assert plan.tp_split("ex") == [(0, 0, 2), (1, 2, 4)]
    assert plan.tp_split("id") == []
    assert "ex [0:0..2 1:2..4]" in plan.explain()
    shards = {t.name: [x[:3] for x in t.shards or []] for t in plan.tensors}
    assert shards["blk.0.ffn_up_exps.weight"] == [("virtual:0", 0, 2), ("virtual:1", 2, 4)]
    m = wl.Model(path, devices="virtual:2x64MiB", compute="exact")
    m.load_tp(expect_cache_tokens=64, expect_cache_base="f32")
    # the context the forward pass runs through shows the same expert table
    assert m.tp.ex_split == plan.tp_split("ex")
    assert m.tp.get_split(wl.BROADCAST_EX) == m.tp.ex_split
    assert m.tp.all_devices() == [0, 1]
    got = m.forward(s["ids"], logits="all")
    want = np.load(folder / "hf_logits.npy")
    assert float(np.abs(got - want).max()) <= 1e-3
    assert np.array_equal(got.argmax(-1), want.argmax(-1))
    out = m.generate(s["ids"], max_new_tokens=len(s["greedy_ids"]), do_sample=False)
    assert out == s["greedy_text"]
    m.close()
    with pytest.raises(wl.PlanError, match=r"overrides/n_cpu_moe.*expert table.*strategy='layers'"):
        wl.plan(path, devices="virtual:2x64MiB", strategy="tensor_parallel", n_cpu_moe=1)


def test_a_longrope_config_alone_plans_the_factor_tables_as_the_gguf_holds_them():
    # planning before downloading a Phi-3.5-mini: its config.json scales RoPE by LongRoPE, so
    # the table llama.cpp's converter writes holds rope_factors_long and rope_factors_short
    # (f32, one factor per rotated pair) first, and a plan from the config alone holds them
    # too, with the file's bytes, on the host beside the token embedding
    gguf_file = PHI3 / "tiny-phi3-F16.gguf"
    kw = {"devices": "virtual:64MiB,cpu", "n_gpu_layers": 99}
    want = wl.plan(gguf_file, **kw)
    got = wl.plan(PHI3 / "config.json", weight_dtype="f16", **kw)
    table = lambda p: [(t.name, t.device, t.dtype, t.nbytes) for t in p.tensors]  # noqa: E731
    assert sorted(table(got)) == sorted(table(want))
    assert table(got)[:2] == [
        ("rope_factors_long.weight", "cpu", "F32", 16),
        ("rope_factors_short.weight", "cpu", "F32", 16),
    ]
    assert [(d.name, d.weights, d.scratch) for d in got.devices] == [
        (d.name, d.weights, d.scratch) for d in want.devices
    ]


MIXED = DATA / "tiny-qwen3moe-mixed"


def test_a_mixed_moe_config_alone_plans_each_layers_mlp():
    # transformers' rule: layer i routes when (i + 1) % decoder_sparse_step == 0 and i is not
    # in mlp_only_layers (here 2 and [3]: layers 1 and 5), the others hold a dense MLP of
    # intermediate_size; the config alone plans the layers as the checkpoint holds them
    plan = wl.plan(MIXED / "config.json", weight_dtype="f16", devices="cpu")
    ffn = {(t.layer, t.name.split(".")[2]) for t in plan.tensors if ".ffn_" in t.name}
    for layer in range(6):
        want = (
            {"ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
            if layer in (1, 5)
            else {"ffn_norm", "ffn_gate", "ffn_up", "ffn_down"}
        )
        assert {n for lay, n in ffn if lay == layer} == want, layer
    # the dense MLP at the checkpoint's width and bytes (f16: 64 x 32 x 2)
    held = {t.name: t.nbytes for t in wl.plan(MIXED, devices="cpu").tensors}
    got = {t.name: t.nbytes for t in plan.tensors}
    for gguf_name, hf_name in [
        ("ffn_gate", "gate_proj"),
        ("ffn_up", "up_proj"),
        ("ffn_down", "down_proj"),
    ]:
        for layer in (0, 2, 3, 4):
            want = held[f"model.layers.{layer}.mlp.{hf_name}.weight"]
            assert got[f"blk.{layer}.{gguf_name}.weight"] == want == 4096


@pytest.mark.parametrize(
    ("n", "held"), [(1, []), (2, ["experts of layers 1"]), (6, ["experts of layers 1, 5"])]
)
def test_n_cpu_moe_counts_layers_as_llama_cpp_with_dense_layers(n, held):
    # llama.cpp's --n-cpu-moe N keeps the experts of layers 0..N-1 in host RAM; a dense layer
    # has none, so N=1 keeps nothing here (layer 0 is dense) and N=2 layer 1's experts
    m = wl.Model(MIXED, devices="virtual:2x64MiB,cpu", compute="exact")
    m.load(cache={"max_seq_len": 64}, n_gpu_layers=99, n_cpu_moe=n)
    assert [h for d in m.plan.devices for h in d.holds if h.startswith("experts")] == held
    s = stats(MIXED)
    out = m.generate(s["ids"], max_new_tokens=len(s["greedy_ids"]), do_sample=False)
    assert out == s["greedy_text"]


def test_a_gguf_layer_without_its_router_is_refused_by_name(tmp_path):
    # llama.cpp's qwen3moe loader wants a router in every layer (its converter refuses a
    # checkpoint with dense layers); a file missing one is named tensor by tensor before loading
    src = gguf.GGUFReader(DATA / "tiny-qwen3moe" / "tiny-qwen3moe-F16.gguf")
    experts = [f"blk.0.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    for drop, said in [
        (["blk.0.ffn_gate_inp.weight"], "missing tensors: blk.0.ffn_gate_inp.weight;"),
        (
            ["blk.0.ffn_gate_inp.weight", *experts],
            "missing tensors: blk.0.ffn_gate_inp.weight with its experts, or a dense MLP "
            "(blk.0.ffn_gate.weight)",
        ),
    ]:
        path = tmp_path / f"drop{len(drop)}.gguf"
        w = gguf.GGUFWriter(path, arch="qwen3moe")
        for name, field in src.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
        for t in src.tensors:
            if t.name not in drop:
                w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(wl.FormatError, match=re.escape(said)):
            wl.load_gguf(path, n_ctx=64)


def write_unrun_gguf(path: Path, arch: gguf.MODEL_ARCH, hparams: dict[str, Any]) -> None:
    """A two-layer GGUF of `arch` with every tensor gguf-py names for it (zeros of a small
    shape: planning reads names and sizes only) and `hparams` through gguf-py's writer."""
    w = gguf.GGUFWriter(path, arch=gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(4096)
    w.add_embedding_length(16)
    w.add_block_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_token_list([f"t{i}" for i in range(32)])
    for key, value in hparams.items():
        getattr(w, f"add_{key}")(value)
    for tensor in gguf.MODEL_TENSORS[arch]:
        name = gguf.TENSOR_NAMES[tensor]
        for bid in range(2) if "{bid}" in name else [None]:
            w.add_tensor(f"{name.format(bid=bid)}.weight", np.zeros((4, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


UNRUN = {
    # llama.cpp's mamba: state-space layers, no attention (no head counts in its metadata)
    "mamba": (
        gguf.MODEL_ARCH.MAMBA,
        {"ssm_conv_kernel": 4, "ssm_inner_size": 32, "ssm_state_size": 8, "ssm_time_step_rank": 2},
        "state-space",
    ),
    # DeepSeek-V2/V3: multi-head latent attention and routed experts
    "deepseek2": (
        gguf.MODEL_ARCH.DEEPSEEK2,
        {
            "head_count": 2,
            "head_count_kv": 2,
            "feed_forward_length": 32,
            "kv_lora_rank": 8,
            "key_length": 12,
            "value_length": 8,
            "rope_dimension_count": 4,
            "expert_count": 4,
            "expert_used_count": 2,
        },
        "multi-head latent attention",
    ),
}


@pytest.mark.parametrize("arch", UNRUN)
def test_an_architecture_we_do_not_run_is_refused_by_name_and_still_plans(tmp_path, arch):
    kind, hparams, needs = UNRUN[arch]
    path = tmp_path / f"{arch}.gguf"
    write_unrun_gguf(path, kind, hparams)
    ckpt = wl.open(path)
    assert ckpt.spec.architecture == arch
    plan = wl.plan(path, devices="virtual:2x1MiB,cpu")
    assert plan.architecture == arch
    assert {t.name for t in plan.tensors} == {t.name for t in ckpt.tensors}
    assert sum(d.weights for d in plan.devices) == sum(t.nbytes for t in ckpt.tensors)
    assert any(f"'{arch}'" in w for w in plan.warnings), plan.warnings
    if arch == "mamba":  # no attention, so no KV cache to place
        assert sum(d.kv for d in plan.devices) == 0
    said = rf"running the '{arch}' architecture is not supported: .* '{arch}' needs {needs}"
    for load in (
        lambda: wl.load_gguf(path, n_ctx=64),
        lambda: wl.Model(path).load(),
        lambda: wl.from_pretrained(path),
    ):
        with pytest.raises(wl.UnsupportedError, match=said):
            load()
    for cmd in (["inspect", str(path)], ["plan", str(path), "--devices", "virtual:2x1MiB,cpu"]):
        p = subprocess.run([EXE, *cmd], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert arch in p.stdout

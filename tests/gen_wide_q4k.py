"""Regenerate ``tests/data/wide-q4k/<family>/``: for each family fixture, a sibling wide enough
for llama.cpp's Q4_K and Q6_K blocks, quantised by llama.cpp to ``Q4_K_M``, and the logits
transformers and llama.cpp compute for it.

The tiny fixtures (``tests/data/tiny-<family>``) are 32-128 values wide, and Q4_K and Q6_K blocks
are 256 wide: llama.cpp's quantiser falls back to Q5_0 and Q8_0 for every matrix of them. Here
every matrix's input width is 256 (hidden 256, 4 query heads of 64, an MLP or experts 256 wide),
and nothing else is wider than the check needs (1 KV head, 1 layer; 2 for the gemmas, a sliding
and a global one; 3 experts for the MoE families), each model made by its family's own
generator (``make_model`` with this module's config overrides: the same recipe, norm
perturbation, f16 rounding and tokenizer), converted to an F16 GGUF by the vendored converter
and quantised by ``llama_model_quantize`` (``MOSTLY_Q4_K_M``: Q4_K, with Q6_K where llama.cpp
spends more bits). Only the Q4_K_M file and the logits the tests read are kept; the f16 weights
are made again by this script (two runs give byte-identical files; ``stats.json`` holds the
sha256 of every file, the F16 GGUF's too).

Nothing here is weightlift code. It runs in the venv of ``tests/gen_qwen3.py``::

    python tests/gen_wide_q4k.py            # every family
    python tests/gen_wide_q4k.py qwen3 phi3 # some
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import fixture_lib as fl  # before torch: it sets the thread counts
import gen_gemma
import gen_mixtral
import gen_phi3
import gen_qwen2
import gen_qwen3
import gen_qwen3moe
import numpy as np
import sentencepiece as spm
import torch

ROOT = fl.DATA / "wide-q4k"
QUANT = "Q4_K_M"
# The block types a Q4_K_M file may hold for a matrix whose rows are multiples of 256 wide:
# anything else is a fallback, and the file would not test what it is for.
K_TYPES = {"Q4_K", "Q6_K"}
# Every family's shape: hidden 256 and 4 heads of 64 (the attention output's rows are 256 wide),
# an MLP 256 wide (the down projection's rows), so that every matrix is Q4_K or Q6_K; otherwise
# as small as the files can be: 1 KV head, 1 layer. The init's spread is halved from the tiny
# fixtures' 0.2, as the fan-in is 4 times theirs: activations and logits keep the same scale.
WIDE = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=256,
    num_hidden_layers=1,
    initializer_range=0.1,
)
# The MoE siblings route 2 of 3 experts (the tiny fixtures' 2 of 4).
N_EXPERTS = 3


@dataclass
class Recipe:
    """What one family's wide model needs from its generator module."""

    module: str
    arch: str  # general.architecture of its GGUF
    overrides: dict
    # the tokenizer files written to the converter's folder, and the prompt ids
    tokenizer: Callable[[Path], list[int]]
    gguf_to_hf: dict[str, str]
    metadata: Callable[[Path], dict[str, object]]
    norm_shift: float = 0.0
    pre: str | None = None
    args: list[str] = field(default_factory=list)
    fix: Callable | None = None
    # the model from the config overrides, when the family's make_model takes more than them
    make: Callable[[dict], torch.nn.Module] | None = None
    # write the config's layer_types into the GGUF as llama.cpp's sliding-window pattern
    swa_pattern: bool = False


def qwen_tokenizer(n_ids: int) -> Callable[[Path], list[int]]:
    """tiny-qwen3's tokenizer (the MoE fixtures borrow it too), and the first `n_ids` ids of
    its prompt."""

    def write(folder: Path) -> list[int]:
        tok = gen_qwen3.make_tokenizer()
        tok.save_pretrained(folder)
        ids = tok.encode(gen_qwen3.PROMPT, add_special_tokens=False)[:n_ids]
        assert len(ids) == n_ids, ids
        return ids

    return write


def qwen2_tokenizer(folder: Path) -> list[int]:
    tok = gen_qwen2.make_tokenizer()
    tok.save_pretrained(folder)
    return tok.encode(gen_qwen2.PROMPT, add_special_tokens=False)[: gen_qwen2.N_IDS]


def phi3_tokenizer(folder: Path) -> list[int]:
    tok = gen_phi3.make_tokenizer()
    tok.save_pretrained(folder)
    # as tiny-phi3's: the class Phi-4 names, for the converter's BPE path
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "GPT2Tokenizer"
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    return tok.encode(gen_phi3.PROMPT, add_special_tokens=False)[: gen_phi3.N_IDS]


def gemma_tokenizer(folder: Path) -> list[int]:
    sp_model = gen_gemma.train_vocab()
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    gen_gemma.make_tokenizer(sp).save_pretrained(folder)
    gen_gemma.mark_specials(folder, sp)
    (folder / "tokenizer.model").write_bytes(sp_model)
    return [sp.bos_id()] + sp.encode(gen_gemma.PROMPT)[: gen_gemma.N_IDS - 1]


def phi3_rope() -> dict:
    """tiny-phi3's LongRoPE, with a factor per rotated pair of the wider heads (64 values, half
    rotated: 16 pairs), growing from the fastest pair to the slowest as Phi-3.5-mini's lists
    do, to the same ends as tiny-phi3's."""
    pairs = WIDE["head_dim"] // 4
    short = np.geomspace(gen_phi3.SHORT_FACTOR[0], gen_phi3.SHORT_FACTOR[-1], pairs)
    long = np.geomspace(gen_phi3.LONG_FACTOR[0], gen_phi3.LONG_FACTOR[-1], pairs)
    return {
        **gen_phi3.ROPE,
        "short_factor": [round(float(x), 4) for x in short],
        "long_factor": [round(float(x), 4) for x in long],
    }


def recipes() -> dict[str, Recipe]:
    return {
        "qwen3": Recipe(
            "gen_qwen3",
            "qwen3",
            WIDE,
            qwen_tokenizer(gen_qwen3.N_IDS),
            gen_qwen3.GGUF_TO_HF,
            lambda p: fl.gguf_metadata(p, "qwen3", gen_qwen3.METADATA),
            pre="qwen2",
        ),
        # a sliding layer and a global one, named in the config: transformers' default (and
        # llama.cpp's, without a pattern in the GGUF) is 5 sliding layers and a global one
        "gemma3": Recipe(
            "gen_gemma",
            "gemma3",
            dict(
                WIDE,
                num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=64,
            ),
            gemma_tokenizer,
            gen_gemma.GGUF_TO_HF,
            lambda p: gen_gemma.gguf_metadata(p, "gemma3"),
            norm_shift=1.0,
            make=lambda o: gen_gemma.make_model("gemma3", overrides=o),
            swa_pattern=True,
        ),
        # 2 layers: one layer's fused q/k/v and down projection are Q6_K (where llama.cpp spends
        # more bits), and the other's Q4_K, so that Q4_K holds most matrices
        "phi3": Recipe(
            "gen_phi3",
            "phi3",
            {
                **{k: v for k, v in WIDE.items() if k != "head_dim"},
                "num_hidden_layers": 2,
                "rope_parameters": phi3_rope(),
            },
            phi3_tokenizer,
            gen_phi3.GGUF_TO_HF,
            lambda p: fl.gguf_metadata(p, "phi3", gen_phi3.METADATA),
            pre="gpt-2",
            args=["--model-name", "Wide Phi 4"],
        ),
        "mixtral": Recipe(
            "gen_mixtral",
            "llama",
            dict(WIDE, num_local_experts=N_EXPERTS),
            qwen_tokenizer(gen_mixtral.N_IDS),
            gen_mixtral.GGUF_TO_HF,
            lambda p: fl.gguf_metadata(p, "llama", gen_qwen3.METADATA),
            pre="qwen2",
            fix=lambda sd: gen_mixtral.fix(
                sd, WIDE["num_attention_heads"], WIDE["num_key_value_heads"]
            ),
        ),
        "qwen3moe": Recipe(
            "gen_qwen3moe",
            "qwen3moe",
            # the unused dense width wider than an expert, as Qwen3-30B-A3B's (6144 over 768):
            # the engine sizes its device workspace for the wider of the two
            dict(WIDE, moe_intermediate_size=256, intermediate_size=512, num_experts=N_EXPERTS),
            qwen_tokenizer(gen_qwen3moe.N_IDS),
            gen_qwen3moe.GGUF_TO_HF,
            lambda p: fl.gguf_metadata(p, "qwen3moe", gen_qwen3.METADATA),
            pre="qwen2",
            fix=fl.fuse_experts,
        ),
        # 2 layers, as tiny-gemma2: a sliding one and a global one (llama.cpp's pattern of 2)
        "gemma2": Recipe(
            "gen_gemma",
            "gemma2",
            dict(WIDE, num_hidden_layers=2, query_pre_attn_scalar=64),
            gemma_tokenizer,
            gen_gemma.GGUF_TO_HF,
            lambda p: gen_gemma.gguf_metadata(p, "gemma2"),
            norm_shift=1.0,
            make=lambda o: gen_gemma.make_model("gemma2", overrides=o),
        ),
        "qwen2": Recipe(
            "gen_qwen2",
            "qwen2",
            {k: v for k, v in WIDE.items() if k != "head_dim"},
            qwen2_tokenizer,
            gen_qwen2.GGUF_TO_HF,
            lambda p: fl.gguf_metadata(p, "qwen2", gen_qwen2.METADATA),
            pre="qwen2",
        ),
    }


def make(r: Recipe) -> tuple[torch.nn.Module, Callable]:
    """The wide model (the family's own seed and recipe), and `load(sd)`: a copy of it with
    `sd`'s tensors (the family's variant)."""
    mod = __import__(r.module)
    model = r.make(r.overrides) if r.make is not None else mod.make_model(overrides=r.overrides)

    def load(sd):
        return mod.variant(model, None if sd is None else lambda s: s.update(sd))

    return model, load


def build(family: str, r: Recipe, root: Path) -> dict[str, object]:
    out = ROOT / family
    fl.clean(out)
    model, load = make(r)
    with tempfile.TemporaryDirectory() as tmp:
        # The folder's name becomes the GGUF's general.name, so it is fixed.
        src = Path(tmp) / f"wide-{family}"
        fl.save_f16(model, src)
        ids = r.tokenizer(src)
        ref = fl.logits(model, ids)
        np.save(out / "hf_logits.npy", ref)
        kw = dict(
            load=load,
            gguf_to_hf=r.gguf_to_hf,
            metadata=r.metadata,
            norm_shift=r.norm_shift,
            fix=r.fix,
        )
        f16 = src / f"wide-{family}-F16.gguf"
        fl.convert(src, "f16", f16, root, r.pre, r.args)
        if r.swa_pattern:
            write_swa_pattern(f16, r.arch, model.config.layer_types)
        # measured (llama.cpp's logits of it too), not kept: no test reads them
        entries = {"F16": fl.measure_gguf(Path(tmp), f16, "F16", model, ids, ref, **kw)}
        q = out / f"wide-{family}-{QUANT}.gguf"
        fl.quantize(f16, q, QUANT)
        entries[QUANT] = fl.measure_gguf(out, q, QUANT, model, ids, ref, **kw)
    types = entries[QUANT]["types"]
    # every matrix in a K-quant block type, Q4_K among them (the norms, LongRoPE's lists and
    # the MoE routers, which llama.cpp never quantises, stay F32)
    matrices = {k: v for k, v in types.items() if v != "F32"}
    assert set(matrices.values()) <= K_TYPES, matrices
    assert "Q4_K" in matrices.values(), matrices
    ref64 = fl.logits_f64(load, ids)
    q4 = entries[QUANT]
    report: dict[str, object] = {
        "family": family,
        "architecture": r.arch,
        "generator": r.module,
        "seed": seed_of(r),
        "config_overrides": r.overrides,
        "config": json.loads(model.config.to_json_string(use_diff=True)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "ids": ids,
        "logit_std": float(ref.std()),
        "top1_minus_top2": fl.margins(ref),
        "hf_dequant_top1_minus_top2": fl.margins(np.load(out / f"hf_dequant_logits_{QUANT}.npy")),
        "llamacpp_top1_minus_top2": fl.margins(np.load(out / f"llamacpp_logits_{QUANT}.npy")),
        "noise_floor": {"float32_vs_float64": fl.stats(ref, ref64)},
        "type_counts": dict(sorted(Counter(types.values()).items())),
        "gguf": entries,
        "summary": {
            "hf_dequant_vs_hf": q4["hf_dequant_vs_hf_logits"],
            "llamacpp_vs_hf": q4["llamacpp_vs_hf_logits"],
            "llamacpp_vs_hf_dequant": q4["llamacpp_vs_hf_dequant_logits"],
            "llamacpp_F16_vs_hf": entries["F16"]["llamacpp_vs_hf_logits"],
        },
    }
    if r.swa_pattern:
        # how far the logits are with every layer sliding, as llama.cpp would run the file
        # without the pattern (llama.cpp's F16 distance to transformers shows it follows it)
        every = ["sliding_attention"] * len(model.config.layer_types)
        sliding = fl.logits(__import__(r.module).variant(model, layer_types=every), ids)
        report["every_layer_sliding_vs_hf"] = fl.stats(ref, sliding)
    if getattr(model.config, "num_experts_per_tok", None):
        # which experts each layer picks, and how near a tie the k-th pick is
        report["routing"] = fl.routing(model, ids)
    report["files"] = fl.files(out)
    report["versions"] = fl.versions(root, sentencepiece=spm.__version__)
    fl.write_stats(out, report)
    return report


def write_swa_pattern(path: Path, arch: str, layer_types: list[str]) -> None:
    """`{arch}.attention.sliding_window_pattern` added to the GGUF at `path`: a flag per layer,
    true where the config's `layer_types` slide. llama.cpp reads it when a file has it, and
    otherwise takes its own period (6 for gemma3), which a model of fewer layers does not
    follow; the converter writes none for gemma3. Added by gguf-py's own metadata copier (the
    code of its ``gguf_new_metadata`` script), every tensor as it is."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    key = gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch)
    flags = [t == "sliding_attention" for t in layer_types]
    reader = gguf.GGUFReader(path)
    assert reader.get_field(key) is None, f"{path}: {key} is there already"
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(
        reader, writer, {key: MetadataDetails(gguf.GGUFValueType.ARRAY, flags)}, []
    )
    tmp.replace(path)


def seed_of(r: Recipe) -> int:
    """The seed the family's generator makes its models with."""
    mod = __import__(r.module)
    if r.module == "gen_gemma":
        return mod.SEEDS[r.arch]
    return mod.SEED


def main() -> int:
    root = fl.start()
    all_recipes = recipes()
    for family in sys.argv[1:] or all_recipes:
        r = build(family, all_recipes[family], root)
        print(
            family,
            json.dumps(
                {
                    "bytes": r["gguf"][QUANT]["bytes"],
                    "types": r["type_counts"],
                    "min_margin": min(r["top1_minus_top2"]),
                    "min_dequant_margin": min(r["hf_dequant_top1_minus_top2"]),
                    **r["summary"],
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

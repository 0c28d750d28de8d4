"""Regenerate ``tests/data/tiny-mixtral/``: a tiny random Mixtral made by transformers, converted
to GGUF by llama.cpp's own converter, and the logits transformers computes for it.

Nothing here is weightlift code: the weights come from ``MixtralForCausalLM`` (rounded to f16, see
``tests/fixture_lib.py``), the F16 GGUF from the ``convert_hf_to_gguf.py`` and gguf-py vendored in
the llama-cpp-python 0.3.36 sdist, the Q8_0 GGUF from it by llama.cpp's quantiser, the reference
logits, greedy ids and the routing from transformers, and llama.cpp's logits for the GGUF files
from llama-cpp-python 0.3.36.

It runs in a venv with torch 2.13.0, transformers 5.23.0, safetensors 0.8.0, tokenizers 0.23.3,
numpy 2.4.6 and llama-cpp-python 0.3.36::

    python tests/gen_mixtral.py
"""

from __future__ import annotations

import json
import os
import sys

import fixture_lib as fl  # before torch: it sets the thread counts
import gen_qwen3
import numpy as np
import torch
from transformers import MixtralConfig, MixtralForCausalLM

OUT = fl.DATA / "tiny-mixtral"
# Seeds 0-23 were screened as for tiny-qwen3moe, then 13, 5, 3, 19, 1 and 7 converted; 5 is the
# first whose Q8_0 file keeps transformers' argmax at every position (in transformers on its
# dequantised weights and in llama.cpp, so routing did not flip), with smallest top-1/top-2
# margins of 0.136 (prompt), 0.014 (greedy) and 0.021 (chat), and no special token answered.
SEED = int(os.environ.get("MIXTRAL_SEED", "5"))
# 12 positions, not 16, and an expert FFN of 16: the two MoE fixtures share a 600 KB budget.
N_IDS = 12
GREEDY_STEPS = 16
CHAT_STEPS = 8
N_EXPERTS = 4
N_HEADS, N_KV_HEADS = 4, 2

CONFIG = dict(
    vocab_size=gen_qwen3.VOCAB,
    hidden_size=32,
    # Mixtral's experts are intermediate_size wide. 16 is below llama.cpp's Q8_0 block of 32, so
    # the Q8_0 file keeps ffn_down_exps in F16 (llama.cpp's quantiser's fallback): one file holds
    # quantised and float experts.
    intermediate_size=16,
    num_local_experts=N_EXPERTS,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=N_HEADS,
    num_key_value_heads=N_KV_HEADS,
    head_dim=8,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    # Mixtral unties its head; tied here to fit the budget (the head's own tensor is covered by
    # the dense fixtures).
    tie_word_embeddings=True,
    sliding_window=None,
    router_jitter_noise=0.0,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=gen_qwen3.BPE_VOCAB,  # <|endoftext|>
    pad_token_id=None,
)

GGUF_TO_HF = {
    **{
        k: v
        for k, v in gen_qwen3.GGUF_TO_HF.items()
        if not k.startswith(("ffn_", "attn_q_norm", "attn_k_norm"))
    },
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **fl.MOE_GGUF_TO_HF,
}


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama's converter reorders each head's q/k rows from rotate-half pairs (i, i + d/2) to
    adjacent pairs (2i, 2i + 1); this puts them back."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def fix(
    sd: dict[str, torch.Tensor], n_head: int = N_HEADS, n_kv_head: int = N_KV_HEADS
) -> dict[str, torch.Tensor]:
    """The GGUF's tensors as transformers holds them: experts fused, q/k rows unpermuted (of a
    model with `n_head` query heads and `n_kv_head` KV heads)."""
    sd = fl.fuse_experts(sd)
    for k in sd:
        if k.endswith("q_proj.weight"):
            sd[k] = unpermute(sd[k], n_head)
        elif k.endswith("k_proj.weight"):
            sd[k] = unpermute(sd[k], n_kv_head)
    return sd


def config(kw: dict) -> MixtralConfig:
    """The config with sdpa attention and transformers' plain per-expert loop (its grouped
    matmul refuses f64)."""
    cfg = MixtralConfig(**kw)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    return cfg


def make_model(seed: int = SEED, overrides: dict | None = None) -> MixtralForCausalLM:
    """Seeded random weights, every norm weight drawn in [0.5, 1.5], all rounded to f16.
    `seed` and config `overrides` make a sibling (``gen_wide_q4k.py``'s wide models)."""
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config({**CONFIG, **(overrides or {})})).eval()
    fl.perturb_norms(model, 0.5, 1.5)
    fl.round_to_f16(model)
    return model


def variant(model: MixtralForCausalLM, edit=None) -> MixtralForCausalLM:
    """A copy of `model` with `edit(state_dict)` applied."""
    other = MixtralForCausalLM(model.config).eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if edit is not None:
        edit(sd)
    other.load_state_dict(sd, strict=True)
    return other


def main() -> int:
    root = fl.start()
    fl.clean(OUT)
    tok = gen_qwen3.make_tokenizer()
    model = make_model()
    fl.save_f16(model, OUT)
    tok.save_pretrained(OUT)

    ids = tok.encode(gen_qwen3.PROMPT, add_special_tokens=False)[:N_IDS]
    assert len(ids) == N_IDS, ids
    ref = fl.logits(model, ids)
    np.save(OUT / "hf_logits.npy", ref)
    route = fl.routing(model, ids)
    fl.check_routing(route, N_EXPERTS)
    greedy_ids, greedy_gaps = fl.greedy(model, ids, GREEDY_STEPS)
    chat_text = tok.apply_chat_template(gen_qwen3.CHAT, add_generation_prompt=True, tokenize=False)
    chat_ids = tok.encode(chat_text, add_special_tokens=False)
    chat_greedy, chat_gaps = fl.greedy(model, chat_ids, CHAT_STEPS)

    def first_two(sd):
        for k in sd:
            if k.endswith("mlp.gate.weight"):
                sd[k].zero_()
                sd[k][:2] = 1.0

    fixed = fl.logits(variant(model, first_two), ids)

    def load(sd):
        return variant(model, None if sd is None else lambda s: s.update(sd))

    ref64 = fl.logits_f64(load, ids)
    report: dict[str, object] = {
        "seed": SEED,
        "ids": ids,
        "ids_text": tok.decode(ids),
        "prompt": gen_qwen3.PROMPT,
        "greedy_ids": greedy_ids,
        "greedy_text": tok.decode(greedy_ids, skip_special_tokens=True),
        "greedy_top1_minus_top2": greedy_gaps,
        "chat_messages": gen_qwen3.CHAT,
        "chat_prompt_text": chat_text,
        "chat_prompt_ids": chat_ids,
        "chat_greedy_ids": chat_greedy,
        "chat_greedy_text": tok.decode(chat_greedy, skip_special_tokens=True),
        "tokenizer_size": len(tok),
        "chat_greedy_top1_minus_top2": chat_gaps,
        "parameters": sum(p.numel() for p in model.parameters()),
        "routing": route,
        "logit_std": float(ref.std()),
        "top1_minus_top2": fl.margins(ref),
        "noise_floor": {"float32_vs_float64": fl.stats(ref, ref64)},
        "sensitivity": {"every_token_to_experts_0_1": fl.stats(ref, fixed)},
    }
    report["gguf"] = fl.write_ggufs(
        OUT,
        "tiny-mixtral",
        model,
        ids,
        ref,
        root,
        load=load,
        gguf_to_hf=GGUF_TO_HF,
        metadata=lambda p: fl.gguf_metadata(p, "llama", gen_qwen3.METADATA),
        pre="qwen2",
        fix=fix,
    )
    report["files"] = fl.files(OUT)
    report["versions"] = fl.versions(root)
    fl.write_stats(OUT, report)
    print(
        json.dumps(
            {
                "seed": SEED,
                "min_margin": min(report["top1_minus_top2"]),
                "min_greedy_margin": min(greedy_gaps),
                "min_chat_margin": min(chat_gaps),
                "router_gap": route["kth_gap_min"],
                "q8_min_margin": report["gguf"]["Q8_0"]["hf_dequant_top1_minus_top2_min"],
                "q8": report["gguf"]["Q8_0"]["hf_dequant_vs_hf_logits"],
                "lc_q8": report["gguf"]["Q8_0"]["llamacpp_vs_hf_logits"],
                "lc_f16": report["gguf"]["F16"]["llamacpp_vs_hf_logits"],
                "types": report["gguf"]["Q8_0"]["types"],
                "bytes": sum(f["bytes"] for f in report["files"].values()),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

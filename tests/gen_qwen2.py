"""Regenerate ``tests/data/tiny-qwen2/``: a tiny random Qwen2 made by transformers, converted to
GGUF by llama.cpp's own converter, and the logits transformers computes for it.

Nothing here is weightlift code: the weights come from ``Qwen2ForCausalLM`` (rounded to f16, see
``tests/fixture_lib.py``), the F16 GGUF from the ``convert_hf_to_gguf.py`` and gguf-py vendored in
the llama-cpp-python 0.3.36 sdist (``.cache/wheels/llama_cpp_python-0.3.36.tar.gz``), the Q8_0 GGUF
from it by llama.cpp's quantiser, and the reference logits from transformers.

It runs in a venv of its own (a few GB: PyPI's torch wheel brings the CUDA libraries, which stay
unused)::

    python3.11 -m venv .cache/fixture-venv
    .cache/fixture-venv/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors==0.8.0 \\
        tokenizers==0.23.3 numpy==2.4.6 sentencepiece==0.2.3 llama-cpp-python==0.3.36
    .cache/fixture-venv/bin/python tests/gen_qwen2.py

Every run writes the same bytes (checked by running it twice).
"""

from __future__ import annotations

import copy
import json
import os
import sys

import fixture_lib as fl  # before torch: it sets the thread counts
import numpy as np
import tokenizers
import torch
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

OUT = fl.DATA / "tiny-qwen2"
# Seed 0 has, over the 16 positions, a smallest top-1/top-2 logit margin of 0.139, and 0.090 for
# the Q8_0 weights' logits: far above the 1e-3 tolerance of the tests, so honest f32 rounding
# cannot flip an argmax (seeds 1-4 have 0.003 to 0.016 somewhere).
SEED = int(os.environ.get("QWEN2_SEED", "0"))
# Qwen2's pre-tokenizer regex and special tokens (Qwen/Qwen2-0.5B tokenizer.json).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_VOCAB = 301  # 256 byte tokens and 45 merges; the 3 specials follow, as in Qwen2
VOCAB = 320  # config vocab_size: padded past the tokenizer, as real Qwen2 checkpoints are
CORPUS = [
    "Once upon a time, a small cat lived in a big old house.",
    "The cat liked to sleep in the sun by the window.",
    "Rivers have shaped human settlement for thousands of years.",
    "Early farmers relied on seasonal floods to enrich their fields.",
    "Traders used the water as a road to carry grain, timber and stone.",
    "In 2024 there were 365 days, and 12 months; what's next?",
]
PROMPT = "Once upon a time, the small cat slept by the river."
N_IDS = 16

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    # Narrower than the usual 3 x hidden, to keep the files small (fixture_lib.py), yet two
    # 64-row blocks wide, so that a row split cuts every layer's gate and up.
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=False,
    use_sliding_window=False,
    # 0.2 rather than the default 0.02: peaked attention (mean max weight ~0.6 at positions 8-15),
    # so that RoPE and mask mistakes move the logits a lot.
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=BPE_VOCAB,  # <|endoftext|>
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with Qwen2's normalizer, pre-tokenizer and decoder, trained on CORPUS."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    assert tok.get_vocab_size() == BPE_VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    assert fast.convert_tokens_to_ids(SPECIALS) == [BPE_VOCAB, BPE_VOCAB + 1, BPE_VOCAB + 2]
    return fast


def make_model(seed: int = SEED, overrides: dict | None = None) -> Qwen2ForCausalLM:
    """Seeded random weights. Norm weights and q/k/v biases are drawn again from the same
    stream, because the default init leaves norms at 1 and biases at 0, which would hide a
    missing norm weight or bias. `seed` and config `overrides` make a sibling
    (``gen_wide_q4k.py``'s wide models)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(**{**CONFIG, **(overrides or {})})
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0.0, 0.5)
    fl.perturb_norms(model, 0.5, 1.5)
    fl.round_to_f16(model)
    return model


def attention_peak(eager: Qwen2ForCausalLM, ids: list[int]) -> float:
    """Mean over layers, heads and positions 8-15 of the largest attention weight."""
    with torch.no_grad():
        att = eager(torch.tensor([ids]), use_cache=False, output_attentions=True).attentions
    return float(torch.stack(att).max(-1).values[..., 8:].mean())


def variant(model: Qwen2ForCausalLM, edit) -> Qwen2ForCausalLM:
    """A copy of `model` with `edit(state_dict)` applied (state_dict maps names to tensors)."""
    other = Qwen2ForCausalLM(model.config).eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if edit is not None:
        edit(sd)
    other.load_state_dict(sd, strict=True)
    return other


def adjacent_to_neox(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of q/k (or their bias) reordered so that rotate-half RoPE on the result equals
    adjacent-pair RoPE on `w`: running transformers on them shows what an engine that paired
    qwen2's dimensions the llama.cpp `llama` way would compute (q·k itself is unchanged)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


METADATA = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
)


def main() -> int:
    root = fl.start()
    fl.clean(OUT)
    tok = make_tokenizer()
    model = make_model()
    # The folder's name becomes the GGUF's general.name, so it is fixed.
    fl.save_f16(model, OUT)
    tok.save_pretrained(OUT)

    ids = tok.encode(PROMPT, add_special_tokens=False)[:N_IDS]
    assert len(ids) == N_IDS, ids
    ref = fl.logits(model, ids)
    np.save(OUT / "hf_logits.npy", ref)

    # The same forward pass with the q/k/v biases zeroed: how far a bias-less engine would be.
    def zero_bias(sd):
        for k in sd:
            if k.endswith("_proj.bias"):
                sd[k].zero_()

    nobias = fl.logits(variant(model, zero_bias), ids)
    np.save(OUT / "hf_logits_nobias.npy", nobias)

    # What the check would see from other wrong turns (measured, not shipped).
    heads = {"q_proj": CONFIG["num_attention_heads"], "k_proj": CONFIG["num_key_value_heads"]}

    def adjacent_pairs(sd):
        # Rotate-half on these rows equals adjacent pairs on the original rows.
        for k in sd:
            for proj, n in heads.items():
                if f".{proj}." in k:
                    sd[k] = adjacent_to_neox(sd[k], n)

    wrong_rope = fl.logits(variant(model, adjacent_pairs), ids)
    theta_cfg = Qwen2Config(
        **{**CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    )
    theta_cfg._attn_implementation = "sdpa"
    default_theta = Qwen2ForCausalLM(theta_cfg).eval()
    default_theta.load_state_dict(model.state_dict())
    wrong_theta = fl.logits(default_theta, ids)
    eager_cfg = copy.deepcopy(model.config)
    eager_cfg._attn_implementation = "eager"
    eager = Qwen2ForCausalLM(eager_cfg).eval()
    eager.load_state_dict(model.state_dict())

    def load(sd):
        return variant(model, None if sd is None else lambda s: s.update(sd))

    ref64 = fl.logits_f64(load, ids)
    report: dict[str, object] = {
        "ids": ids,
        "ids_text": tok.decode(ids),
        "prompt": PROMPT,
        "logit_std": float(ref.std()),
        "top1_minus_top2": fl.margins(ref),
        "mean_max_attention_weight_positions_8_15": attention_peak(eager, ids),
        "noise_floor": {
            "float32_vs_float64": fl.stats(ref, ref64),
            "sdpa_vs_eager": fl.stats(ref, fl.logits(eager, ids)),
        },
        "sensitivity": {
            "q_k_v_biases_zeroed": fl.stats(ref, nobias),
            "adjacent_rope_pairs_instead_of_rotate_half": fl.stats(ref, wrong_rope),
            "rope_theta_10000_instead_of_1e6": fl.stats(ref, wrong_theta),
        },
    }
    report["gguf"] = fl.write_ggufs(
        OUT,
        "tiny-qwen2",
        model,
        ids,
        ref,
        root,
        load=load,
        gguf_to_hf=GGUF_TO_HF,
        metadata=lambda p: fl.gguf_metadata(p, "qwen2", METADATA),
        pre="qwen2",
        # qwen2's tests hold the engine to transformers alone
        llamacpp=False,
    )
    report["files"] = fl.files(OUT)
    report["versions"] = fl.versions(root)
    fl.write_stats(OUT, report)
    print(
        json.dumps(
            {
                "min_margin": min(report["top1_minus_top2"]),
                "q8_min_margin": report["gguf"]["Q8_0"]["hf_dequant_top1_minus_top2_min"],
                "sensitivity": report["sensitivity"],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

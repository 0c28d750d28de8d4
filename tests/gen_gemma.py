"""Regenerate ``tests/data/tiny-gemma3/`` and ``tests/data/tiny-gemma2/``: tiny random Gemma 3
(text) and Gemma 2 models made by transformers, converted to GGUF by llama.cpp's own converter,
and the logits transformers computes for them.

Nothing here is weightlift code: the vocabulary is trained by the sentencepiece library, the
weights come from ``Gemma3ForCausalLM`` / ``Gemma2ForCausalLM`` (rounded to f16, see
``tests/fixture_lib.py``), the F16 GGUF from the ``convert_hf_to_gguf.py`` and gguf-py vendored in
the llama-cpp-python 0.3.36 sdist (``.cache/wheels/llama_cpp_python-0.3.36.tar.gz``), the Q8_0 GGUF
from it by llama.cpp's quantiser, and the reference logits and greedy continuations from
transformers (eager attention: gemma2's attention soft-capping is eager-only), and llama.cpp's
logits for the GGUF files from llama-cpp-python 0.3.36.

Run it in the venv of ``tests/gen_qwen2.py`` (with sentencepiece 0.2.3)::

    python tests/gen_gemma.py

What each fixture exercises:

- a sliding window of 8 tokens and a prompt of 20, so the sliding layers' mask matters at
  positions 8..19;
- gemma3: 6 layers, llama.cpp's and transformers' pattern of 6 (layers 0-4 slide, layer 5 is
  global), a local RoPE base of 10k and a global one of 1M with linear scaling 8 on the global
  layer, per-head q/k norms, heads of 16 values (to keep the files small);
- gemma2: 2 layers (0 slides, 1 is global), attention and final logit soft-capping, 2 heads of
  16 values over a hidden size of 64 (so ``query_pre_attn_scalar`` = head_dim differs from
  hidden / heads);
- both: every norm weight drawn in [-0.5, 0.5] (the model multiplies by 1 + w, so a norm applied
  as w alone shows; on a grid of 2^-8, so that the 1 + w the converter stores is exact in f16),
  four norms per layer, GeGLU with the tanh GELU, embeddings scaled by
  √hidden, a tied head; ``query_pre_attn_scalar`` = head_dim = 16, and a second reference,
  ``hf_logits_query_scalar_32.npy``, with the config's scalar set to hidden / heads = 32 (the
  GGUF has no such key: llama.cpp takes head_dim, or hidden / heads for the 27B models).

The vocabulary is a SentencePiece BPE with byte fallback trained on a toy corpus, with Gemma's
special-token layout (<pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4, <start_of_turn> 5,
<end_of_turn> 6); ``tokenizer.json`` is transformers' GemmaTokenizer over the same pieces and
merges, checked here to encode as the sentencepiece model does.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import fixture_lib as fl  # before torch: it sets the thread counts
import numpy as np
import sentencepiece as spm
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaTokenizer,
)

# Each family's seed, the first tried (gemma3: 0-5, gemma2: 0) whose smallest top-1/top-2 margin
# over the prompt, the greedy steps and the Q8_0 weights' logits is above 0.1 (far above the
# tests' 1e-3, and above what 8-bit activations move the logits by), and whose Q8_0 weights keep
# transformers' argmax at every position, in transformers and in llama.cpp (gemma3, seed 5:
# 0.145, 1.64, 0.134; gemma2, seed 0: 0.127, 1.38, 0.126).
SEEDS = {
    "gemma3": int(os.environ.get("GEMMA3_SEED", "5")),
    "gemma2": int(os.environ.get("GEMMA2_SEED", "0")),
}
CORPUS = [
    "Once upon a time, a small cat lived in a big old house.",
    "The cat liked to sleep in the sun by the window.",
    "Rivers have shaped human settlement for thousands of years.",
    "Early farmers relied on seasonal floods to enrich their fields.",
    "Traders used the water as a road to carry grain, timber and stone.",
    "In 2024 there were 365 days, and 12 months; what's next?",
]
SPECIALS = ["<mask>", "<start_of_turn>", "<end_of_turn>"]
VOCAB = 384
PROMPT = "Once upon a time, the small cat slept by the river in the sun."
N_IDS = 20  # BOS and 19 prompt tokens: more than twice the window
WINDOW = 8
N_NEW = 12
# Strings whose ids the tokenizer tests compare (sentencepiece's and transformers' agree on all).
TOKENIZE = [
    "Once upon a time, the small cat",
    " hello  world\n42",
    "Ünïcode ✓ 🙂",
    "<start_of_turn>user\nhi<end_of_turn>",
    "Rivers have shaped 2024 fields.",
]
# Gemma's chat template, in the layout Google's checkpoints use (system text folded into the
# first user turn, "assistant" called "model").
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set rest = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{{ (first if loop.first else '') + message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

COMMON = dict(
    vocab_size=VOCAB,
    # √64 = 8 is exact in every float type (transformers casts the embedding scale to the
    # embedding's dtype; the f32 references and the f16 files then agree).
    hidden_size=64,
    intermediate_size=64,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    sliding_window=WINDOW,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    initializer_range=0.2,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
FAMILIES = {
    "gemma3": dict(
        cls=Gemma3ForCausalLM,
        config=Gemma3TextConfig,
        kw=dict(
            COMMON,
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        ),
    ),
    "gemma2": dict(
        cls=Gemma2ForCausalLM,
        config=Gemma2Config,
        kw=dict(
            COMMON,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            attn_logit_softcapping=4.0,
            final_logit_softcapping=6.0,
        ),
    ),
}


def train_vocab(sentences: list[str] | None = None, size: int = VOCAB) -> bytes:
    """A SentencePiece BPE of `size` pieces with byte fallback and Gemma's special ids, trained
    on `sentences` (CORPUS, four times, by default)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4 if sentences is None else sentences),
        model_writer=model,
        model_type="bpe",
        vocab_size=size,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        eos_piece="<eos>",
        bos_piece="<bos>",
        user_defined_symbols=SPECIALS,
        byte_fallback=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def make_tokenizer(
    sp: spm.SentencePieceProcessor, checks: list[str] | None = None
) -> GemmaTokenizer:
    """transformers' GemmaTokenizer over the sentencepiece model's pieces, with the merges that
    rebuild each piece from two pieces (ordered by the merged piece's rank, as transformers'
    sentencepiece extractor orders them); it must encode `checks` (TOKENIZE and CORPUS by
    default) as the sentencepiece model does."""
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_unknown(pid) or sp.is_byte(pid) or piece in SPECIALS:
            continue
        for i in range(1, len(piece)):
            a, b = piece[:i], piece[i:]
            if a in vocab and b in vocab:
                merges.append((pid, vocab[a], vocab[b], a, b))
    merges.sort()
    tok = GemmaTokenizer(
        vocab=vocab,
        merges=[(a, b) for *_, a, b in merges],
        additional_special_tokens=SPECIALS[1:],
        add_bos_token=True,
    )
    tok.chat_template = CHAT_TEMPLATE
    for s in TOKENIZE + CORPUS if checks is None else checks:
        got, want = tok.encode(s, add_special_tokens=False), sp.encode(s)
        assert got == want, (s, got, want)
    assert tok.encode("hi") == [sp.bos_id()] + sp.encode("hi"), tok.encode("hi")
    return tok


def mark_specials(folder: Path, sp: spm.SentencePieceProcessor) -> None:
    """Google's Gemma repositories list their special tokens in tokenizer_config.json's
    ``added_tokens_decoder`` (transformers 5 keeps them in tokenizer.json only); the GGUF
    converter reads them there to type them CONTROL, so they are written the same way here."""
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg["added_tokens_decoder"] = {
        str(i): {
            "content": sp.id_to_piece(i),
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i in range(7)
    }
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_model(family: str, seed: int | None = None, overrides: dict | None = None):
    """Seeded random weights, every norm weight drawn in [-0.5, 0.5], all rounded to f16.
    `seed` and config `overrides` make a sibling (``gen_wide_q4k.py``'s wide models)."""
    f = FAMILIES[family]
    torch.manual_seed(SEEDS[family] if seed is None else seed)
    cfg = f["config"](**{**f["kw"], **(overrides or {})})
    cfg._attn_implementation = "eager"
    model = f["cls"](cfg).eval()
    fl.perturb_norms(model, -0.5, 0.5)
    fl.round_to_f16(model)
    return model


def variant(model, edit=None, **config):
    """A copy of `model` with config keys replaced and `edit(state_dict)` applied."""
    cfg = model.config.to_dict()
    cfg.update(config)
    c = type(model.config)(**cfg)
    c._attn_implementation = "eager"
    other = type(model)(c).eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if edit is not None:
        edit(sd)
    other.load_state_dict(sd, strict=True)
    return other


GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


METADATA = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
)


def gguf_metadata(path: Path, arch: str) -> dict[str, object]:
    import gguf

    keep = fl.gguf_metadata(path, arch, METADATA)
    keep["has_chat_template"] = "tokenizer.chat_template" in gguf.GGUFReader(path).fields
    return keep


def build(family: str, root: Path, sp_model: bytes) -> dict[str, object]:
    out = fl.DATA / f"tiny-{family}"
    fl.clean(out)
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    tok = make_tokenizer(sp)
    model = make_model(family)
    fl.save_f16(model, out)
    tok.save_pretrained(out)
    mark_specials(out, sp)
    # The converter reads the sentencepiece model itself.
    (out / "tokenizer.model").write_bytes(sp_model)

    ids = [sp.bos_id()] + sp.encode(PROMPT)[: N_IDS - 1]
    assert len(ids) == N_IDS, ids
    ref = fl.logits(model, ids)
    np.save(out / "hf_logits.npy", ref)
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None
        )[0, len(ids) :].tolist()
    # the same continuation recomputed from scratch at each step, with each step's margin
    again, gaps = fl.greedy(model, ids, N_NEW)
    assert again == gen, (again, gen)

    kw = FAMILIES[family]["kw"]
    n_layers = kw["num_hidden_layers"]
    sens: dict[str, object] = {
        "no_sliding_window": fl.stats(
            ref, fl.logits(variant(model, layer_types=["full_attention"] * n_layers), ids)
        ),
        "norms_as_w_not_1_plus_w": fl.stats(
            ref,
            fl.logits(
                variant(
                    model,
                    lambda sd: [sd[k].sub_(1.0) for k in sd if k.endswith("norm.weight")],
                ),
                ids,
            ),
        ),
    }
    if family == "gemma3":
        rp = json.loads(json.dumps(kw["rope_parameters"]))
        rp["sliding_attention"]["rope_theta"] = 1e6
        sens["local_rope_base_1e6_instead_of_1e4"] = fl.stats(
            ref, fl.logits(variant(model, rope_parameters=rp), ids)
        )
        rp = json.loads(json.dumps(kw["rope_parameters"]))
        rp["full_attention"] = {"rope_type": "default", "rope_theta": 1e6}
        sens["no_linear_scaling_on_global_layers"] = fl.stats(
            ref, fl.logits(variant(model, rope_parameters=rp), ids)
        )
        sens["q_k_norm_weights_ignored"] = fl.stats(
            ref,
            fl.logits(
                variant(
                    model,
                    lambda sd: [
                        sd[k].fill_(0.0)
                        for k in sd
                        if k.endswith(("q_norm.weight", "k_norm.weight"))
                    ],
                ),
                ids,
            ),
        )
    else:
        sens["no_attention_softcap"] = fl.stats(
            ref, fl.logits(variant(model, attn_logit_softcapping=None), ids)
        )
        sens["no_final_softcap"] = fl.stats(
            ref, fl.logits(variant(model, final_logit_softcapping=None), ids)
        )
    # query_pre_attn_scalar is head_dim here, the scale every other family takes: a second
    # reference with hidden / heads instead (llama.cpp's choice for the 27B models), which a
    # config's scalar read wrongly, or not at all, would miss.
    scalar = kw["hidden_size"] // kw["num_attention_heads"]
    assert scalar != kw["query_pre_attn_scalar"] == kw["head_dim"], scalar
    scaled = fl.logits(variant(model, query_pre_attn_scalar=scalar), ids)
    np.save(out / f"hf_logits_query_scalar_{scalar}.npy", scaled)
    sens["scale_by_hidden_over_heads_not_query_pre_attn_scalar"] = fl.stats(ref, scaled)

    def load(sd):
        # the converter's + 1 is taken off the norms by fl.gguf_state_dict
        return variant(model, None if sd is None else lambda s: s.update(sd))

    ref64 = fl.logits_f64(load, ids)

    report: dict[str, object] = {
        "ids": ids,
        "prompt": PROMPT,
        "window": WINDOW,
        "seed": SEEDS[family],
        "greedy_ids": gen,
        "greedy_top1_minus_top2": gaps,
        "greedy_text": sp.decode(gen),
        "tokenize": {s: sp.encode(s) for s in TOKENIZE},
        "chat": {
            "messages": [{"role": "user", "content": "Tell me about the cat."}],
            "prompt": tok.apply_chat_template(
                [{"role": "user", "content": "Tell me about the cat."}],
                tokenize=False,
                add_generation_prompt=True,
            ),
        },
        "logit_std": float(ref.std()),
        "top1_minus_top2": fl.margins(ref),
        "noise_floor": {"float32_vs_float64": fl.stats(ref, ref64)},
        "sensitivity": sens,
        "query_scalar": {"value": scalar, "top1_minus_top2": fl.margins(scaled)},
    }
    chat_ids = tok.apply_chat_template(
        report["chat"]["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert chat_ids == [sp.bos_id()] + sp.encode(report["chat"]["prompt"][len("<bos>") :])
    report["chat"]["prompt_ids"] = chat_ids
    with torch.no_grad():
        report["chat"]["greedy_ids"] = model.generate(
            torch.tensor([chat_ids]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None
        )[0, len(chat_ids) :].tolist()

    report["gguf"] = fl.write_ggufs(
        out,
        f"tiny-{family}",
        model,
        ids,
        ref,
        root,
        load=load,
        gguf_to_hf=GGUF_TO_HF,
        metadata=lambda p: gguf_metadata(p, family),
        # the converter stores 1 + w for every norm (what the model multiplies by)
        norm_shift=1.0,
    )
    report["files"] = fl.files(out)
    report["versions"] = fl.versions(root, sentencepiece=spm.__version__)
    fl.write_stats(out, report)
    return report


def main() -> int:
    root = fl.start()
    sp_model = train_vocab()
    # `python tests/gen_gemma.py gemma3` rebuilds one family
    for family in sys.argv[1:] or FAMILIES:
        r = build(family, root, sp_model)
        margins = {
            "prompt": min(r["top1_minus_top2"]),
            "greedy": min(r["greedy_top1_minus_top2"]),
            "q8_0": r["gguf"]["Q8_0"]["hf_dequant_top1_minus_top2_min"],
        }
        print(family, json.dumps({"min_margins": margins, "greedy": r["greedy_ids"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate ``tests/data/tiny-phi3/``: a tiny random Phi-3 (the ``phi3`` architecture of Phi-3
and Phi-4, with its fused ``qkv_proj`` and ``gate_up_proj``, and LongRoPE as Phi-3.5-mini and
Phi-4-mini scale it) made by transformers, converted to GGUF by llama.cpp's own converter, and
the logits transformers computes for it.

LongRoPE: a pretraining length of ORIGINAL positions stretched to 64, so the prompt's 16 ids
turn with the long factors and an attention factor of sqrt(2) (in transformers, whose choice
follows the longest position of a call, and in llama.cpp, whose choice follows the context of
64), and the first ORIGINAL ids alone with the short ones (``hf_logits_short.npy``).

Nothing here is weightlift code: the weights come from ``Phi3ForCausalLM`` (rounded to f16, see
``tests/fixture_lib.py``), the F16 GGUF from the ``convert_hf_to_gguf.py`` and gguf-py vendored in
the llama-cpp-python 0.3.36 sdist (``.cache/wheels/llama_cpp_python-0.3.36.tar.gz``), the Q8_0 GGUF
from it by llama.cpp's quantiser, the reference logits and greedy ids from transformers, and
llama.cpp's logits for the GGUF files from llama-cpp-python 0.3.36.

It runs in the venv of ``tests/gen_qwen2.py``::

    python tests/gen_phi3.py
"""

from __future__ import annotations

import json
import os
import sys

import fixture_lib as fl  # before torch: it sets the thread counts
import numpy as np
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import Phi3Config, Phi3ForCausalLM, PreTrainedTokenizerFast

OUT = fl.DATA / "tiny-phi3"

# Seeds 0-6 were tried with LongRoPE; 1 is the one whose smallest top-1/top-2 margin over the
# prompt's 16 positions (0.087), the short prompt's 8 (0.097), the greedy steps (0.026), the
# chat answer (0.047) and the Q8_0 weights' logits (0.019) is well above the tests' 1e-3
# tolerance, whose Q8_0 and F16 files keep transformers' argmax at every position in llama.cpp,
# and whose greedy answers hold no special token.
SEED = int(os.environ.get("PHI3_SEED", "1"))
# Phi-3's specials; Phi-4's vocabulary is byte-level BPE (GPT2Tokenizer), which the converter
# reads from tokenizer.json (Phi-3-mini's SentencePiece model needs a tokenizer.model instead).
SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]
BPE_VOCAB = 300  # 256 byte tokens and 44 merges; the 4 specials follow
VOCAB = 320  # config vocab_size: padded past the tokenizer, as Phi-3's 32064 is
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
GREEDY_STEPS = 16
# A conversation for the chat-completion check: the prompt transformers' template renders, and
# its greedy answer.
CHAT = [{"role": "user", "content": "Where did the small cat sleep?"}]
CHAT_STEPS = 8
# Phi-3's chat layout (Phi-3-mini-4k-instruct's template, without its system-message branch).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + '\\n' + message['content'] + '<|end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' + '\\n' }}{% endif %}"
)

# LongRoPE (one factor per rotated pair: head_dim 16, half of it rotated, 4 pairs), shaped as
# Phi-3.5-mini's lists are: 1 for the fastest pair, growing for the slow ones, the long list
# more so.
ORIGINAL = 8
SHORT_FACTOR = [1.0, 1.15, 1.4, 1.9]
LONG_FACTOR = [1.0, 2.0, 5.0, 13.0]
ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10_000.0,
    # Phi-4-mini rotates 3/4 of each head; half here, so that the unrotated part shows.
    "partial_rotary_factor": 0.5,
    "short_factor": SHORT_FACTOR,
    "long_factor": LONG_FACTOR,
    "original_max_position_embeddings": ORIGINAL,
}

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    # Half the hidden size rather than the usual 3 x, to keep the files small (fixture_lib.py).
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    original_max_position_embeddings=ORIGINAL,
    rms_norm_eps=1e-5,
    rope_parameters=ROPE,
    tie_word_embeddings=False,
    # None: no sliding window (Phi-4; the converter writes 0).
    sliding_window=None,
    # 0.2 rather than the default 0.02: peaked attention, so that RoPE, norm and mask mistakes
    # move the logits a lot.
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=BPE_VOCAB,  # <|endoftext|>
    pad_token_id=BPE_VOCAB,
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with GPT-2's pre-tokenizer and decoder (as Phi-4's), trained on CORPUS,
    with Phi-3's chat template."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    assert tok.get_vocab_size() == BPE_VOCAB, tok.get_vocab_size()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    assert fast.convert_tokens_to_ids(SPECIALS) == list(range(BPE_VOCAB, BPE_VOCAB + 4))
    return fast


def make_model(seed: int = SEED, overrides: dict | None = None) -> Phi3ForCausalLM:
    """Seeded random weights, every norm weight drawn in [0.5, 1.5], all rounded to f16.
    `seed` and config `overrides` make a sibling (``gen_wide_q4k.py``'s wide models)."""
    torch.manual_seed(seed)
    cfg = Phi3Config(**{**CONFIG, **(overrides or {})})
    cfg._attn_implementation = "sdpa"
    model = Phi3ForCausalLM(cfg).eval()
    fl.perturb_norms(model, 0.5, 1.5)
    fl.round_to_f16(model)
    return model


def variant(model: Phi3ForCausalLM, edit) -> Phi3ForCausalLM:
    """A copy of `model` with `edit(state_dict)` applied (state_dict maps names to tensors)."""
    other = Phi3ForCausalLM(model.config).eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if edit is not None:
        edit(sd)
    other.load_state_dict(sd, strict=True)
    return other


GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    # gate and up stacked, gate first, as transformers' gate_up_proj
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


METADATA = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def main() -> int:
    root = fl.start()
    fl.clean(OUT)
    tok = make_tokenizer()
    model = make_model()
    # The folder's name becomes the GGUF's general.name, so it is fixed.
    fl.save_f16(model, OUT)
    tok.save_pretrained(OUT)
    # The class Phi-4 names, which sends the converter to the BPE vocabulary of tokenizer.json.
    tc_path = OUT / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "GPT2Tokenizer"
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")

    ids = tok.encode(PROMPT, add_special_tokens=False)[:N_IDS]
    assert len(ids) == N_IDS, ids
    ref = fl.logits(model, ids)
    np.save(OUT / "hf_logits.npy", ref)
    # within the pretraining length: the short factors
    short = fl.logits(model, ids[:ORIGINAL])
    np.save(OUT / "hf_logits_short.npy", short)
    greedy_ids, greedy_gaps = fl.greedy(model, ids, GREEDY_STEPS)
    chat_text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat_ids = tok.encode(chat_text, add_special_tokens=False)
    chat_greedy, chat_gaps = fl.greedy(model, chat_ids, CHAT_STEPS)

    # What the checks would see from wrong turns: gate and up swapped in the fused gate_up_proj,
    # and every head rotated whole instead of its first half (measured, not shipped).
    def swap_gate_up(sd):
        for k in sd:
            if k.endswith("gate_up_proj.weight"):
                gate, up = sd[k].chunk(2, dim=0)
                sd[k] = torch.cat([up, gate]).contiguous()

    swapped = fl.logits(variant(model, swap_gate_up), ids)

    def with_rope(**rope) -> Phi3ForCausalLM:
        cfg = Phi3Config(**{**CONFIG, "rope_parameters": {**ROPE, **rope}})
        cfg._attn_implementation = "sdpa"
        other = Phi3ForCausalLM(cfg).eval()
        other.load_state_dict(model.state_dict())
        return other

    # twice the pairs when the whole head turns
    whole_heads = fl.logits(
        with_rope(
            partial_rotary_factor=1.0,
            short_factor=SHORT_FACTOR * 2,
            long_factor=LONG_FACTOR * 2,
        ),
        ids,
    )
    short_at_16 = fl.logits(with_rope(long_factor=SHORT_FACTOR), ids)
    no_attention_factor = fl.logits(with_rope(attention_factor=1.0), ids)

    def load(sd):
        return variant(model, None if sd is None else lambda s: s.update(sd))

    ref64 = fl.logits_f64(load, ids)

    n_params = sum(p.numel() for p in model.parameters())
    report: dict[str, object] = {
        "seed": SEED,
        "ids": ids,
        "ids_text": tok.decode(ids),
        "prompt": PROMPT,
        "greedy_ids": greedy_ids,
        # as llama.cpp detokenizes for output: control tokens render as nothing
        "greedy_text": tok.decode(greedy_ids, skip_special_tokens=True),
        "greedy_top1_minus_top2": greedy_gaps,
        "chat_messages": CHAT,
        "chat_prompt_text": chat_text,
        "chat_prompt_ids": chat_ids,
        "chat_greedy_ids": chat_greedy,
        "chat_greedy_text": tok.decode(chat_greedy, skip_special_tokens=True),
        # ids from here to the config's vocab_size are padding that tokenizer.json lacks
        "tokenizer_size": len(tok),
        "chat_greedy_top1_minus_top2": chat_gaps,
        "parameters": n_params,
        "logit_std": float(ref.std()),
        "top1_minus_top2": fl.margins(ref),
        "noise_floor": {"float32_vs_float64": fl.stats(ref, ref64)},
        "sensitivity": {
            "gate_and_up_swapped": fl.stats(ref, swapped),
            "rope_on_whole_heads_instead_of_half": fl.stats(ref, whole_heads),
            "short_factors_past_the_pretraining_length": fl.stats(ref, short_at_16),
            "no_attention_factor": fl.stats(ref, no_attention_factor),
        },
        "longrope": {
            "original_max_position_embeddings": ORIGINAL,
            "short_factor": SHORT_FACTOR,
            "long_factor": LONG_FACTOR,
            "short_ids": ids[:ORIGINAL],
            "short_top1_minus_top2": fl.margins(short),
        },
    }
    report["gguf"] = fl.write_ggufs(
        OUT,
        "tiny-phi3",
        model,
        ids,
        ref,
        root,
        load=load,
        gguf_to_hf=GGUF_TO_HF,
        metadata=lambda p: fl.gguf_metadata(p, "phi3", METADATA),
        # GPT-2's exact pre-tokenizer. The model is named as a Phi-4: llama.cpp gives a model
        # whose name holds "phi3" or "phi-3" the SentencePiece specials of Phi-3-mini (`</s>`,
        # `<unk>`, `<s>`), which a byte-level vocabulary does not have.
        pre="gpt-2",
        args=["--model-name", "Tiny Phi 4"],
    )
    # the converter's LongRoPE: the config's lists as tensors, the attention factor sqrt(2)
    import gguf

    reader = gguf.GGUFReader(OUT / "tiny-phi3-F16.gguf")
    lists = {t.name: [float(x) for x in t.data] for t in reader.tensors if "rope_factors" in t.name}
    f32 = lambda xs: [float(np.float32(x)) for x in xs]  # noqa: E731
    assert lists == {
        "rope_factors_long.weight": f32(LONG_FACTOR),
        "rope_factors_short.weight": f32(SHORT_FACTOR),
    }, lists
    attn = report["gguf"]["F16"]["metadata"]["phi3.rope.scaling.attn_factor"]
    assert abs(attn - 2**0.5) < 1e-6, attn
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
                "chat": [report["chat_prompt_text"], chat_greedy, report["chat_greedy_text"]],
                "q8_min_margin": report["gguf"]["Q8_0"]["hf_dequant_top1_minus_top2_min"],
                "sensitivity": report["sensitivity"],
                "greedy_text": report["greedy_text"],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

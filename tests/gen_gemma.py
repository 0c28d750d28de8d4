"""Regenerate ``tests/data/tiny-gemma3/`` and ``tests/data/tiny-gemma2/``: tiny random Gemma 3
(text) and Gemma 2 models made by transformers, converted to GGUF by llama.cpp's own converter,
and the logits transformers computes for them.

Nothing here is weightlift code: the vocabulary is trained by the sentencepiece library, the
weights come from ``Gemma3ForCausalLM`` / ``Gemma2ForCausalLM``, the GGUF files from the
``convert_hf_to_gguf.py`` and gguf-py vendored in the llama-cpp-python 0.3.36 sdist
(``.cache/wheels/llama_cpp_python-0.3.36.tar.gz``), and the reference logits and greedy
continuations from transformers (eager attention: gemma2's attention soft-capping is eager-only).

Run it with the torch 2.13 / transformers 5.23 environment of ``tests/gen_qwen2.py``::

    python tests/gen_gemma.py

What each fixture exercises:

- a sliding window of 8 tokens and a prompt of 20, so the sliding layers' mask matters at
  positions 8..19;
- gemma3: 6 layers, llama.cpp's and transformers' pattern of 6 (layers 0-4 slide, layer 5 is
  global), a local RoPE base of 10k and a global one of 1M with linear scaling 8 on the global
  layer, per-head q/k norms;
- gemma2: 2 layers (0 slides, 1 is global), attention and final logit soft-capping, heads of 32
  values over a hidden size of 64 (so ``query_pre_attn_scalar`` = head_dim differs from
  hidden / heads);
- both: every norm weight drawn in [-0.5, 0.5] (the model multiplies by 1 + w, so a norm applied
  as w alone shows), four norms per layer, GeGLU with the tanh GELU, embeddings scaled by
  √hidden, a tied head.

The vocabulary is a SentencePiece BPE with byte fallback trained on a toy corpus, with Gemma's
special-token layout (<pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4, <start_of_turn> 5,
<end_of_turn> 6); ``tokenizer.json`` is transformers' GemmaTokenizer over the same pieces and
merges, checked here to encode as the sentencepiece model does.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import safetensors
import sentencepiece as spm
import tokenizers
import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaTokenizer,
)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
SDIST = REPO / ".cache" / "wheels" / "llama_cpp_python-0.3.36.tar.gz"
LLAMACPP = REPO / ".cache" / "gemma-llamacpp"
VENDOR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"

SEED = 0
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
            head_dim=32,
            query_pre_attn_scalar=32,
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
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=32,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            attn_logit_softcapping=4.0,
            final_logit_softcapping=6.0,
        ),
    ),
}
GGUF_TYPES = ["F32", "Q8_0"]


def unpack_llamacpp() -> Path:
    root = LLAMACPP / VENDOR
    if not (root / "convert_hf_to_gguf.py").exists():
        with tarfile.open(SDIST) as tf:
            members = [
                m
                for m in tf.getmembers()
                if m.name == VENDOR + "convert_hf_to_gguf.py"
                or m.name.startswith(VENDOR + "conversion/")
                or m.name.startswith(VENDOR + "gguf-py/")
            ]
            tf.extractall(LLAMACPP, members=members, filter="data")
    sys.path.insert(0, str(root / "gguf-py"))
    return root


def train_vocab() -> bytes:
    """A SentencePiece BPE with byte fallback and Gemma's special ids, trained on CORPUS."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB,
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


def make_tokenizer(sp: spm.SentencePieceProcessor) -> GemmaTokenizer:
    """transformers' GemmaTokenizer over the sentencepiece model's pieces, with the merges that
    rebuild each piece from two pieces (ordered by the merged piece's rank, as transformers'
    sentencepiece extractor orders them)."""
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
    for s in TOKENIZE + CORPUS:
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


def make_model(family: str):
    f = FAMILIES[family]
    torch.manual_seed(SEED)
    cfg = f["config"](**f["kw"])
    cfg._attn_implementation = "eager"
    model = f["cls"](cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    return model


def logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False).logits[0]
    return out.float().numpy().astype("<f4")


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


def convert(src: Path, outtype: str, dest: Path, root: Path) -> None:
    boot = (
        "import sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        f"sys.path.insert(1, {str(root / 'gguf-py')!r})\n"
        "import convert_hf_to_gguf as c\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(src)!r}, '--outtype', {outtype!r},"
        f" '--outfile', {str(dest)!r}]\n"
        "c.main()\n"
    )
    subprocess.run([sys.executable, "-c", boot], check=True, cwd=root, capture_output=True)


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


def gguf_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the GGUF dequantised to f32 by gguf-py, under its transformers name (the
    norm weights with the converter's + 1 taken off again), and each tensor's GGUF type."""
    import gguf

    reader = gguf.GGUFReader(path)
    sd, types = {}, {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}." + GGUF_TO_HF[".".join(parts[2:])]
        else:
            hf = GGUF_TO_HF[t.name]
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = [int(n) for n in reversed(t.shape.tolist())]
        x = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
        sd[hf] = x
        types[t.name] = t.tensor_type.name
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd, types


def gguf_metadata(path: Path, arch: str) -> dict[str, object]:
    import gguf

    reader = gguf.GGUFReader(path)
    keep = {}
    for name, field in reader.fields.items():
        if name.startswith((arch + ".", "general.architecture", "general.file_type")) or name in (
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.add_eos_token",
            "tokenizer.ggml.add_space_prefix",
        ):
            keep[name] = field.contents()
    keep["n_tokens"] = len(reader.fields["tokenizer.ggml.tokens"].contents())
    keep["has_chat_template"] = "tokenizer.chat_template" in reader.fields
    return keep


def margins(a: np.ndarray) -> list[float]:
    s = np.sort(a.astype(np.float64), -1)
    return [float(m) for m in s[:, -1] - s[:, -2]]


def stats(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {
        "max_abs": float(d.max()),
        "mean_abs": float(d.mean()),
        "argmax_agree": int((a.argmax(-1) == b.argmax(-1)).sum()),
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray | None:
    """llama.cpp's logits for every position, when llama-cpp-python is importable."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(
        model_path=str(path), logits_all=True, n_ctx=64, n_threads=2, verbose=False, seed=0
    )
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype="<f4")


def build(family: str, root: Path, sp_model: bytes) -> dict[str, object]:
    out = DATA / f"tiny-{family}"
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.name != "README.md":
            p.unlink()
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    tok = make_tokenizer(sp)
    model = make_model(family)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    mark_specials(out, sp)
    # The converter reads the sentencepiece model itself.
    (out / "tokenizer.model").write_bytes(sp_model)

    ids = [sp.bos_id()] + sp.encode(PROMPT)[: N_IDS - 1]
    assert len(ids) == N_IDS, ids
    ref = logits(model, ids)
    np.save(out / "hf_logits.npy", ref)
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None
        )[0, len(ids) :].tolist()

    kw = FAMILIES[family]["kw"]
    n_layers = kw["num_hidden_layers"]
    sens: dict[str, object] = {
        "no_sliding_window": stats(
            ref, logits(variant(model, layer_types=["full_attention"] * n_layers), ids)
        ),
        "norms_as_w_not_1_plus_w": stats(
            ref,
            logits(
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
        sens["local_rope_base_1e6_instead_of_1e4"] = stats(
            ref, logits(variant(model, rope_parameters=rp), ids)
        )
        rp = json.loads(json.dumps(kw["rope_parameters"]))
        rp["full_attention"] = {"rope_type": "default", "rope_theta": 1e6}
        sens["no_linear_scaling_on_global_layers"] = stats(
            ref, logits(variant(model, rope_parameters=rp), ids)
        )
        sens["q_k_norm_weights_ignored"] = stats(
            ref,
            logits(
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
        sens["no_attention_softcap"] = stats(
            ref, logits(variant(model, attn_logit_softcapping=None), ids)
        )
        sens["no_final_softcap"] = stats(
            ref, logits(variant(model, final_logit_softcapping=None), ids)
        )
        sens["scale_by_hidden_over_heads_not_query_pre_attn_scalar"] = stats(
            ref, logits(variant(model, query_pre_attn_scalar=16), ids)
        )
    with torch.no_grad():
        ref64 = variant(model).double()(torch.tensor([ids]), use_cache=False).logits[0].numpy()

    report: dict[str, object] = {
        "ids": ids,
        "prompt": PROMPT,
        "window": WINDOW,
        "greedy_ids": gen,
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
        "top1_minus_top2": margins(ref),
        "noise_floor": {"float32_vs_float64": stats(ref, ref64)},
        "sensitivity": sens,
        "gguf": {},
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

    for ty in GGUF_TYPES:
        dest = out / f"tiny-{family}-{ty}.gguf"
        convert(out, ty.lower(), dest, root)
        sd, types = gguf_state_dict(dest)
        want = model.state_dict()
        entry: dict[str, object] = {
            "bytes": dest.stat().st_size,
            "sha256": sha256(dest),
            "types": dict(sorted(types.items())),
            "metadata": gguf_metadata(dest, family),
        }
        if ty == "F32":
            # the converter stores 1 + w for every norm (what the model multiplies by)
            for k, v in want.items():
                g = sd[k]
                if k.endswith("norm.weight"):
                    assert torch.equal(g, v + 1.0), k
                else:
                    assert torch.equal(g, v), k
            entry["tensors_equal_safetensors_norms_plus_1"] = True
        deq = variant(
            model,
            lambda s, sd=sd: s.update(
                {k: (v - 1.0 if k.endswith("norm.weight") else v) for k, v in sd.items()}
            ),
        )
        got = logits(deq, ids)
        if ty != "F32":
            np.save(out / f"hf_dequant_logits_{ty}.npy", got)
            entry["hf_dequant_top1_minus_top2_min"] = min(margins(got))
        entry["hf_dequant_vs_hf_logits"] = stats(ref, got)
        lc = llama_cpp_logits(dest, ids)
        if lc is not None:
            np.save(out / f"llamacpp_logits_{ty}.npy", lc)
            entry["llamacpp_vs_hf_logits"] = stats(ref, lc)
        else:
            entry["llamacpp_vs_hf_logits"] = "llama-cpp-python was not importable"
        report["gguf"][ty] = entry

    report["files"] = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(out.iterdir())
        if p.suffix != ".md" and p.name != "stats.json"
    }
    report["versions"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "sentencepiece": spm.__version__,
        "numpy": np.__version__,
        "converter": "convert_hf_to_gguf.py of llama-cpp-python 0.3.36 (sdist, vendored)",
        "gguf-py": re.search(
            r'^version = "(.+)"', (root / "gguf-py/pyproject.toml").read_text(), re.M
        )[1],
    }
    (out / "stats.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return report


def main() -> int:
    torch.set_num_threads(2)
    root = unpack_llamacpp()
    sp_model = train_vocab()
    for family in FAMILIES:
        r = build(family, root, sp_model)
        print(family, json.dumps({"sensitivity": r["sensitivity"], "greedy": r["greedy_ids"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

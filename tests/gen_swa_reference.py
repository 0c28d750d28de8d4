"""A tiny gemma3-like GGUF (sliding-window attention on five layers of six) and the KV cache
llama.cpp allocates for it, written to tests/data/swa_reference.json.

`write_gemma3_gguf` is gguf-py's GGUFWriter and nothing else; the tests call it to get the same
file back. Run as a script (with gguf-py) to record what llama.cpp's `llama_kv_cache_iswa`
makes of it: the cells and layers of its full and sliding-window caches, read from llama.cpp's
own log when llama-cpp-python (in the interpreter given, by default the bench venv's) loads the
file at several context lengths and micro-batch sizes:

    .venv/bin/python tests/gen_swa_reference.py [LLAMA_CPP_PYTHON [TRANSFORMERS_PYTHON]]

It also records transformers' per-layer rule (`layer_types`, as its config classes fill it in
from `sliding_window`, `sliding_window_pattern`, `use_sliding_window` and `max_window_layers`)
for a few configs, with an interpreter that has transformers 5 (default .cache/devmap-venv).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

OUT = Path(__file__).resolve().parent / "data" / "swa_reference.json"

N_LAYERS = 8
HIDDEN = 64
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 32
FFN = 128
VOCAB = 64
WINDOW = 300
CONTEXT = 8192


def write_gemma3_gguf(path: Path) -> None:
    """Deterministic weights; only the shapes and the metadata matter for the cache."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(WINDOW)
    w.add_rope_freq_base(1_000_000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([1] * VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float16))

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    t("token_embd.weight", VOCAB, HIDDEN)
    for layer in range(N_LAYERS):
        p = f"blk.{layer}."
        norm(p + "attn_norm.weight", HIDDEN)
        t(p + "attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        t(p + "attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        t(p + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        norm(p + "attn_q_norm.weight", HEAD_DIM)
        norm(p + "attn_k_norm.weight", HEAD_DIM)
        t(p + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        norm(p + "post_attention_norm.weight", HIDDEN)
        norm(p + "ffn_norm.weight", HIDDEN)
        t(p + "ffn_gate.weight", FFN, HIDDEN)
        t(p + "ffn_up.weight", FFN, HIDDEN)
        t(p + "ffn_down.weight", HIDDEN, FFN)
        norm(p + "post_ffw_norm.weight", HIDDEN)
    norm("output_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# llama.cpp: "llama_kv_cache: size = 0.44 MiB ( 1024 cells, 1 layers, 1/1 seqs), K (f16): ..."
CACHE_LINE = re.compile(r"llama_kv_cache: +size = .*?\( *(\d+) cells, +(\d+) layers")

# Loads the model with llama-cpp-python; llama.cpp logs its caches to stderr. swa_full=False is
# the default of llama.cpp's own tools (llama-cli, llama-server: no --swa-full); its C API and
# so llama-cpp-python default to a full-size sliding-window cache.
LOAD = """
import sys, llama_cpp
llama_cpp.Llama(sys.argv[1], n_ctx=int(sys.argv[2]), n_batch=int(sys.argv[3]),
                n_ubatch=int(sys.argv[3]), n_gpu_layers=0, swa_full=False, verbose=True)
print(llama_cpp.__version__)
"""


def llama_cpp_caches(python: str, path: Path, n_ctx: int, n_ubatch: int) -> tuple[str, list]:
    """llama-cpp-python's version, and the caches llama.cpp allocates as it logs them: the
    full-attention one first, then the sliding-window one."""
    r = subprocess.run(
        [python, "-c", LOAD, str(path), str(n_ctx), str(n_ubatch)],
        capture_output=True,
        text=True,
        check=True,
    )
    caches = [
        {"cells": int(m.group(1)), "layers": int(m.group(2))} for m in CACHE_LINE.finditer(r.stderr)
    ]
    if len(caches) != 2:
        sys.exit(f"expected a full and a sliding-window cache in llama.cpp's log, got:\n{r.stderr}")
    return r.stdout.strip(), caches


# transformers' per-layer rule for each config: `layer_types` as its config class fills it in.
CONFIGS = [
    {"model_type": "gemma3_text", "sliding_window": 512, "sliding_window_pattern": 6},
    {"model_type": "gemma3_text", "sliding_window": 1024, "sliding_window_pattern": 3},
    {"model_type": "gemma2", "sliding_window": 4096},
    {"model_type": "cohere2", "sliding_window": 4096},
    {
        "model_type": "qwen2",
        "sliding_window": 4096,
        "use_sliding_window": True,
        "max_window_layers": 5,
    },
    {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},
    {"model_type": "mistral", "sliding_window": 4096},
    {"model_type": "llama"},
]
LAYER_TYPES = """
import json, sys, transformers
out = []
for c in json.loads(sys.argv[1]):
    cfg = transformers.AutoConfig.for_model(
        **c, num_hidden_layers=8, hidden_size=64, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=64)
    types = getattr(cfg, "layer_types", None)
    sliding = getattr(cfg, "sliding_window", None)
    if c["model_type"] == "mistral":
        # MistralConfig has no layer_types: its attention masks every layer by the window.
        types = ["sliding_attention"] * 8 if sliding else None
    out.append({"config": {**c, "num_hidden_layers": 8}, "sliding_window": sliding,
                "layer_types": types})
print(json.dumps({"transformers": transformers.__version__, "cases": out}))
"""


def transformers_layer_types(python: str) -> dict:
    r = subprocess.run(
        [python, "-c", LAYER_TYPES, json.dumps(CONFIGS)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(r.stdout)


def main() -> None:
    python = sys.argv[1] if len(sys.argv) > 1 else ".cache/bench/llama-venv/bin/python"
    tf_python = sys.argv[2] if len(sys.argv) > 2 else ".cache/devmap-venv/bin/python"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gemma3-tiny.gguf"
        write_gemma3_gguf(path)
        cases = []
        version = ""
        for n_ctx, n_ubatch in [(4096, 512), (4096, 100), (512, 512), (2048, 64)]:
            version, (base, swa) = llama_cpp_caches(python, path, n_ctx, n_ubatch)
            cases.append({"n_ctx": n_ctx, "n_ubatch": n_ubatch, "base": base, "swa": swa})
    doc = {
        "generator": "tests/gen_swa_reference.py",
        "llama_cpp_python": version,
        "model": {
            "n_layers": N_LAYERS,
            "n_kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "sliding_window": WINDOW,
            "cache_type": "f16",
            "swa_full": False,
        },
        "cases": cases,
        "hf_configs": transformers_layer_types(tf_python),
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(OUT)
    for c in cases:
        print(c)


if __name__ == "__main__":
    main()

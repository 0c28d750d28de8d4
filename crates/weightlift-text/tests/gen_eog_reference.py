"""Write tests/data/eog_reference.json: the end-of-generation token ids llama.cpp reports
(`llama_vocab_is_eog`) for the SmolLM2 demo model, every `ggml-vocab-*.gguf` test vocabulary
of the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist, and the F16 GGUF of every tiny
family fixture (`tests/data/tiny-<family>/tiny-<family>-F16.gguf`: qwen2, qwen3, phi3, gemma2
and gemma3, each with its family's special tokens), with each id's text.

Run with a llama-cpp-python 0.3.36 venv (see benches/engine_load.py for how to build one):

    .cache/bench/llama-venv/bin/python crates/weightlift-text/tests/gen_eog_reference.py \
        .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf .cache/vocab tests/data \
        crates/weightlift-text/tests/data/eog_reference.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llama_cpp
from llama_cpp import llama_cpp as C


def eog_of(path: Path) -> dict[str, str]:
    m = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = C.llama_model_get_vocab(m.model)
    n = C.llama_vocab_n_tokens(vocab)
    return {
        str(i): C.llama_vocab_get_text(vocab, i).decode("utf-8", "replace")
        for i in range(n)
        if C.llama_vocab_is_eog(vocab, i)
    }


def main() -> None:
    demo, vocab_dir, families = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    out = Path(sys.argv[4])
    result = {"llama_cpp_python": llama_cpp.__version__, "vocabs": {}}
    paths = [
        demo,
        *sorted(vocab_dir.glob("ggml-vocab-*.gguf")),
        *sorted(families.glob("tiny-*/tiny-*-F16.gguf")),
    ]
    for path in paths:
        try:
            result["vocabs"][path.name] = eog_of(path)
        except Exception as e:  # a vocabulary this llama.cpp cannot load is left out
            print(f"skipped {path.name}: {e}", file=sys.stderr)
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

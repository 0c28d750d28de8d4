"""Regenerate ``tests/data/vocab-gemma/``: a Gemma-style SentencePiece vocabulary of a few
thousand pieces, with no model, and the ids llama.cpp, transformers and sentencepiece give a set
of texts with it.

The model fixtures (``tests/gen_gemma.py``) keep vocabularies of a few hundred pieces, which the
repository's test-data budget allows beside their weights and logits. This folder checks the
tokenizer at the size the family fixtures would have had, where merges chain and pieces
compete: the same recipe as ``gen_gemma.py`` (SentencePiece BPE with byte fallback, digits
split, no dummy prefix, Gemma's special-token layout, transformers' GemmaTokenizer over the
same pieces and merges), trained on llama.cpp's documentation, the markdown under
``vendor/llama.cpp/docs/`` of the pinned llama-cpp-python 0.3.36 sdist.

Nothing here is weightlift code: the vocabulary is trained by the sentencepiece library,
``tokenizer.json`` is transformers', the vocabulary-only GGUF comes from the
``convert_hf_to_gguf.py --vocab-only`` vendored in the sdist, and the reference ids from
llama-cpp-python 0.3.36 (the GGUF), transformers (``tokenizer.json``) and sentencepiece
(``tokenizer.model``). The texts are llama.cpp's own tokenizer test texts
(``models/ggml-vocab-llama-spm.gguf.inp`` in the same sdist), ``gen_gemma.py``'s, and a few
more with the chat turn's special tokens.

Run it in the venv of ``tests/gen_qwen2.py`` (with sentencepiece 0.2.3)::

    python tests/gen_vocab_gemma.py
"""

from __future__ import annotations

import json
import tarfile

import fixture_lib as fl  # before torch: it sets the thread counts
import gen_gemma as gg
import sentencepiece as spm
from transformers import Gemma3TextConfig

OUT = fl.DATA / "vocab-gemma"
VOCAB = 3072
DOCS = fl.VENDOR + "docs/"
LLAMA_TEXTS = fl.VENDOR + "models/ggml-vocab-llama-spm.gguf.inp"
# Texts besides llama.cpp's: a chat turn as the template writes it, and lines of the corpus's
# kind that it does not hold.
MORE = [
    "<start_of_turn>user\nHow do I build llama.cpp with CUDA?<end_of_turn>\n<start_of_turn>model\n",
    "cmake -B build -DGGML_CUDA=ON && cmake --build build --config Release -j 8",
    "The quantized model (Q4_K_M) needs 4.58 GiB; offload 33/33 layers to the GPU.",
    "| model | size | params | backend | ngl | test | t/s |",
    "    def forward(self, x):\n        return self.w2(F.silu(self.w1(x)) * self.w3(x))",
    "Ünïcode ✓ 🙂 — «quotes» and 日本語のテキスト",
]


def corpus() -> list[str]:
    """The documentation's non-empty lines, its files in name order."""
    with tarfile.open(fl.SDIST) as tf:
        members = sorted(
            (m for m in tf.getmembers() if m.name.startswith(DOCS) and m.name.endswith(".md")),
            key=lambda m: m.name,
        )
        text = "\n".join(tf.extractfile(m).read().decode() for m in members)  # type: ignore[union-attr]
    return [line for line in text.splitlines() if line.strip()]


def llama_texts() -> list[str]:
    """llama.cpp's tokenizer test texts, split as its test-tokenizer-0 splits them."""
    with tarfile.open(fl.SDIST) as tf:
        raw = tf.extractfile(LLAMA_TEXTS).read().decode()  # type: ignore[union-attr]
    texts = raw.split("\n__ggml_vocab_test__\n")
    return texts[:-1] if raw.endswith("\n__ggml_vocab_test__\n") else texts


def main() -> int:
    root = fl.start()
    fl.clean(OUT)
    lines = corpus()
    sp_model = gg.train_vocab(lines, VOCAB)
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    texts = llama_texts() + gg.TOKENIZE + MORE
    tok = gg.make_tokenizer(sp, texts + lines[:2000])
    tok.save_pretrained(OUT)
    # the same tokenizer.json without the indentation (a third of its bytes)
    tok.backend_tokenizer.save(str(OUT / "tokenizer.json"), pretty=False)
    gg.mark_specials(OUT, sp)
    (OUT / "tokenizer.model").write_bytes(sp_model)
    # The converter reads the architecture and the vocabulary size from the config; a vocabulary-
    # only conversion reads no weights.
    cfg = Gemma3TextConfig(
        vocab_size=sp.get_piece_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg.to_json_file(OUT / "config.json")
    gguf_path = OUT / "vocab-gemma.gguf"
    fl.convert(OUT, "f16", gguf_path, root, args=["--vocab-only"])

    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    ref: dict[str, object] = {
        "vocab_size": sp.get_piece_size(),
        "corpus_lines": len(lines),
        "texts": texts,
        # add_bos False; special False as llama.cpp's test-tokenizer-0, and True as a chat
        # template's text is tokenized
        "llamacpp": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts],
        "llamacpp_special": [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts],
        "transformers": [tok.encode(t, add_special_tokens=False) for t in texts],
        "sentencepiece": [sp.encode(t) for t in texts],
    }
    # the bytes llama.cpp's detokenizer gives back for its own ids
    ref["llamacpp_detokenized"] = [
        list(llm.detokenize(ids))
        for ids in ref["llamacpp"]  # type: ignore[union-attr]
    ]
    ref["gguf"] = gg.gguf_metadata(gguf_path, "gemma3")
    ref["files"] = fl.files(OUT)
    ref["versions"] = fl.versions(root, sentencepiece=spm.__version__)
    (OUT / "reference.json").write_text(json.dumps(ref, ensure_ascii=False) + "\n")
    pairs = zip(ref["llamacpp_special"], ref["transformers"], strict=True)  # type: ignore[call-overload]
    agree = sum(a == b for a, b in pairs)
    print(f"{OUT}: {len(sp)} pieces; llama.cpp and transformers agree on {agree}/{len(texts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

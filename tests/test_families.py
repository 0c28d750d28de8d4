"""The model families beyond llama, through the Python API and the CLI, against what
transformers computed for their tiny random fixtures (``tests/data/tiny-<family>/``, made by
``tests/gen_<family>.py``): the tokenizer's ids, greedy ``generate``, a chat completion with
the checkpoint's chat template, and ``weightlift run --chat``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import weightlift as wl

DATA = Path(__file__).parent / "data"
QWEN3 = DATA / "tiny-qwen3"
EXE = Path(sys.executable).with_name("weightlift")


def stats(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "stats.json").read_text())


def qwen3_models() -> list[tuple[str, Any]]:
    """The tiny Qwen3 loaded from safetensors and from each GGUF file, in exact mode."""
    return [
        ("safetensors", lambda: wl.from_pretrained(QWEN3, devices="cpu", compute="exact")),
        *(
            (
                f"gguf-{ty}",
                lambda ty=ty: wl.load_gguf(
                    QWEN3 / f"tiny-qwen3-{ty}.gguf", n_ctx=64, compute="exact"
                ),
            )
            for ty in ("F32", "Q8_0")
        ),
    ]


@pytest.mark.parametrize(("name", "load"), qwen3_models(), ids=[n for n, _ in qwen3_models()])
def test_qwen3_generate_and_chat_match_transformers(name, load):
    s = stats(QWEN3)
    m = load()
    assert m.plan.architecture == "qwen3"
    # qwen2-style BPE from tokenizer.json and from the GGUF vocabulary: transformers' ids
    assert m.tokenize(s["prompt"], add_bos=False)[: len(s["ids"])] == s["ids"]
    # <|im_end|> is the end of a turn, by the checkpoint's eos and by llama.cpp's EOG rule
    assert m.token_eos() == m.tokenize("<|im_end|>", add_bos=False, special=True)[0]
    if name != "gguf-Q8_0":
        # transformers' greedy continuation (16 tokens, none an end of generation)
        out = m.generate(s["ids"], max_new_tokens=len(s["greedy_ids"]), do_sample=False)
        assert out == s["greedy_text"]
    r = m.create_chat_completion(
        s["chat_messages"], max_tokens=len(s["chat_greedy_ids"]), temperature=0, repeat_penalty=1.0
    )
    # the chat template rendered as transformers renders it, then its greedy answer
    assert r["usage"]["prompt_tokens"] == len(s["chat_prompt_ids"])
    if name != "gguf-Q8_0":
        assert r["choices"][0]["message"]["content"] == s["chat_greedy_text"]
        assert r["choices"][0]["finish_reason"] == "length"


def test_qwen3_q8_0_greedy_keeps_transformers_argmax_on_the_prompt():
    # Q8_0's own greedy text is not transformers' (other weights); its prompt logits are held
    # to transformers' on the dequantised weights in forward_qwen3.rs. Here: the prompt's last
    # argmax through the API is transformers' first greedy token (margin 0.10).
    s = stats(QWEN3)
    m = wl.load_gguf(QWEN3 / "tiny-qwen3-Q8_0.gguf", n_ctx=64, compute="exact")
    out = m.generate(s["ids"], max_new_tokens=1, do_sample=False)
    assert out == m.detokenize(s["greedy_ids"][:1])


def test_qwen3_run_chat_answers_as_transformers():
    s = stats(QWEN3)
    cmd = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "weightlift.cli"]
    args = [
        "run", str(QWEN3 / "tiny-qwen3-F32.gguf"), "--chat",
        "-p", s["chat_messages"][0]["content"], "-n", str(len(s["chat_greedy_ids"])),
        "--temp", "0", "--ctx", "64", "--compute", "exact", "--threads", "2",
    ]  # fmt: skip
    p = subprocess.run(
        [*cmd, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == s["chat_greedy_text"] + "\n"


def test_qwen3_inspect_and_plan_without_loading():
    for path in (QWEN3, QWEN3 / "tiny-qwen3-Q8_0.gguf"):
        spec = wl.open(path).spec
        assert spec.architecture == "qwen3" and spec.head_dim == 32, path
        plan = wl.plan(path, devices="virtual:2x4MiB,cpu", cache=wl.CacheSpec(64, 1, "f32"))
        assert plan.architecture == "qwen3"
        # every tensor is placed, q_norm and k_norm among them
        placed = {t.name for t in plan.tensors}
        assert {"blk.1.attn_q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} & placed

"""K-quant decode bench: weightlift's CPU forward pass against llama-cpp-python on Q2_K, Q3_K_M,
Q4_K_M and Q5_K_M files whose rows are whole 256-value blocks (so the matrices are Q2_K, Q3_K,
Q4_K, Q5_K and Q6_K, as in the files people download), the same token ids and the same thread
count. Two models (the dense one in the four file types, the MoE in Q4_K_M):

  dense   a Qwen3-shaped model (8 layers, hidden 2048, feed-forward 5632): every matrix is
          read each step
  moe     a Qwen3-MoE-shaped model (8 layers, hidden 1024, 32 experts of width 512, 8 a
          token): the host half of the "experts in host RAM" setup (llama.cpp's
          `--n-cpu-moe`), where each token runs only the experts its router chose

Each is made once, in .cache/bench/kquant/: random f16 weights (seeded numpy) written by gguf-py
in llama.cpp's qwen3 / qwen3moe layout, with the metadata and tokenizer of the repository's tiny
Qwen3 / Qwen3-MoE fixture and the shape keys changed, then quantised by llama.cpp's quantiser
(in the llama venv).

Rows, per model at 1 and 2 threads, medians of interleaved rounds (decode.py's method: the
peers take turns within every round, the order flips each round, and a round waits for a
quiet machine):

  decode tok/s        DECODE_TOKENS greedy single-token forward calls after a short prompt
  prompt tok/s        one forward over a PROMPT_TOKENS-id prompt into an empty cache
  decode GB/s         the weight bytes a decode step reads (the MoE's experts counted at
                      n_used / n_experts, as the routing picks them on average) times decode
                      tok/s

Run it with a release build of weightlift (`make build-release`) and llama-cpp-python in its
venv (see benches/decode.py):

    .venv/bin/python benches/kquant_decode.py

Environment: WEIGHTLIFT_BENCH_LLAMA_VENV, WEIGHTLIFT_BENCH_REPEAT (rounds, default 9),
WEIGHTLIFT_BENCH_QUIET_WAIT (as decode.py), WEIGHTLIFT_BENCH_KQUANT_FILES (a subset of the
files, as `model:ftype` separated by commas, e.g. `dense:Q2_K,dense:Q3_K_M`). Writes
benches/results/kquant_decode.json and .md, or for a subset kquant_decode_<files>.json and .md
(so a run on another machine does not replace the full table).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as d  # noqa: E402  (the peer, our side and the interleaved rounds are decode.py's)
from quantize import copy_gguf_metadata  # noqa: E402

DATA = d.ROOT / "tests" / "data"
OUT_DIR = d.BENCH_DIR / "kquant"
# (model, llama.cpp file type) benched, in order: Q4_K_M is mostly Q4_K and Q6_K, Q5_K_M mostly
# Q5_K and Q6_K, Q3_K_M mostly Q3_K with Q4_K, Q5_K and Q6_K, Q2_K mostly Q2_K with Q3_K, Q4_K
# and Q6_K
FILES = [
    ("dense", "Q4_K_M"),
    ("dense", "Q5_K_M"),
    ("dense", "Q3_K_M"),
    ("dense", "Q2_K"),
    ("moe", "Q4_K_M"),
]


def chosen_files() -> list[tuple[str, str]]:
    """FILES, or the subset WEIGHTLIFT_BENCH_KQUANT_FILES names (in its order)."""
    spec = os.environ.get("WEIGHTLIFT_BENCH_KQUANT_FILES", "").strip()
    if not spec:
        return FILES
    chosen = [tuple(f.strip().split(":", 1)) for f in spec.split(",")]
    unknown = [f for f in chosen if f not in FILES]
    if unknown:
        raise SystemExit(
            f"WEIGHTLIFT_BENCH_KQUANT_FILES: {unknown} not among "
            f"{', '.join(f'{m}:{t}' for m, t in FILES)}"
        )
    return chosen  # type: ignore[return-value]


def results_stem(files: list[tuple[str, str]]) -> str:
    """The results' file name: kquant_decode for every file, else one naming the subset."""
    if files == FILES:
        return "kquant_decode"
    return "kquant_decode_" + "_".join(f"{m}-{t}" for m, t in files)


SEED = 0
# name: (architecture, the fixture whose metadata and tokenizer it takes, its shape keys)
MODELS = {
    "dense": (
        "qwen3",
        DATA / "tiny-qwen3" / "tiny-qwen3-F16.gguf",
        {
            "block_count": 8,
            "embedding_length": 2048,
            "feed_forward_length": 5632,
            "attention.head_count": 16,
            "attention.head_count_kv": 4,
            "attention.key_length": 128,
            "attention.value_length": 128,
            "context_length": 4096,
        },
    ),
    "moe": (
        "qwen3moe",
        DATA / "tiny-qwen3moe" / "tiny-qwen3moe-F16.gguf",
        {
            "block_count": 8,
            "embedding_length": 1024,
            "feed_forward_length": 2048,  # unused: every layer routes
            "expert_feed_forward_length": 512,
            "expert_count": 32,
            "expert_used_count": 8,
            "attention.head_count": 16,
            "attention.head_count_kv": 4,
            "attention.key_length": 64,
            "attention.value_length": 64,
            "context_length": 4096,
        },
    ),
}
PROMPT_TOKENS = 512
DECODE_TOKENS = 64
THREADS = (1, 2)


def make_f16(name: str, path: Path) -> None:
    """Model `name` as described above: its fixture's metadata with the model's shape keys, and
    random weights in llama.cpp's tensor layout (numpy shapes, outermost first)."""
    arch, fixture, shape = MODELS[name]
    reader = gguf.GGUFReader(fixture)
    writer = gguf.GGUFWriter(path, arch)
    copy_gguf_metadata(reader, writer, frozenset(f"{arch}.{k}" for k in shape))
    for key, value in shape.items():
        writer.add_uint32(f"{arch}.{key}", value)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    h, hd = shape["embedding_length"], shape["attention.key_length"]
    q, kv = shape["attention.head_count"] * hd, shape["attention.head_count_kv"] * hd
    rng = np.random.default_rng(SEED)

    def matrix(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    writer.add_tensor("token_embd.weight", matrix(vocab, h))
    writer.add_tensor("output_norm.weight", norm(h))
    for i in range(shape["block_count"]):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", norm(h))
        writer.add_tensor(b + "attn_q.weight", matrix(q, h))
        writer.add_tensor(b + "attn_k.weight", matrix(kv, h))
        writer.add_tensor(b + "attn_v.weight", matrix(kv, h))
        writer.add_tensor(b + "attn_output.weight", matrix(h, q))
        writer.add_tensor(b + "attn_q_norm.weight", norm(hd))
        writer.add_tensor(b + "attn_k_norm.weight", norm(hd))
        writer.add_tensor(b + "ffn_norm.weight", norm(h))
        if arch == "qwen3moe":
            n_exp, f = shape["expert_count"], shape["expert_feed_forward_length"]
            # a router whose scores spread the tokens over the experts
            router = rng.standard_normal((n_exp, h), dtype=np.float32) * 0.5
            writer.add_tensor(b + "ffn_gate_inp.weight", router)
            writer.add_tensor(b + "ffn_gate_exps.weight", matrix(n_exp, f, h))
            writer.add_tensor(b + "ffn_up_exps.weight", matrix(n_exp, f, h))
            writer.add_tensor(b + "ffn_down_exps.weight", matrix(n_exp, h, f))
        else:
            f = shape["feed_forward_length"]
            writer.add_tensor(b + "ffn_gate.weight", matrix(f, h))
            writer.add_tensor(b + "ffn_up.weight", matrix(f, h))
            writer.add_tensor(b + "ffn_down.weight", matrix(h, f))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def model(peer: d.LlamaPeer, name: str, ftype: str) -> Path:
    """Model `name` in llama.cpp's file type `ftype`, made once."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    f16 = OUT_DIR / f"{name}-F16.gguf"
    quant = OUT_DIR / f"{name}-{ftype}.gguf"
    if not quant.exists():
        if not f16.exists():
            make_f16(name, f16)
        tmp = quant.with_suffix(".tmp")
        rc = peer.call("quantize", src=str(f16), dst=str(tmp), ftype=ftype, threads=2)["rc"]
        if rc != 0:
            raise SystemExit(f"llama.cpp's quantiser failed on {f16} (rc {rc})")
        tmp.rename(quant)
    return quant


def bytes_per_token(name: str, path: Path) -> int:
    """Weight bytes a decode step reads: every tensor (the embedding is tied, so it is read as
    the head), a MoE's stacked experts at n_used / n_experts (a token's experts)."""
    shape = MODELS[name][2]
    share = shape.get("expert_used_count", 1) / shape.get("expert_count", 1)
    with d.wl.open(path) as ck:
        return int(sum(t.nbytes * (share if "_exps" in t.name else 1.0) for t in ck.tensors))


def bench(peer: d.LlamaPeer, name: str, ftype: str, path: Path) -> tuple[list[dict], list[dict]]:
    rows: list[dict] = []
    groups: list[dict] = []
    vocab = d.wl.open(path).spec.vocab_size
    rng = np.random.default_rng(1)
    # ids of the tokenizer's ordinary pieces (the fixture's last ids are special tokens)
    long_ids = [int(i) for i in rng.integers(3, vocab - 32, PROMPT_TOKENS)]
    prompt = long_ids[:12]
    nbytes = bytes_per_token(name, path)
    for t in THREADS:
        key = f"{name} {ftype}@{t}"
        peer.call("load", key=key, path=str(path), threads=t, n_ctx=d.N_CTX, n_batch=d.N_BATCH)
        ours = d.Ours(path, t)
        cases = {
            "ours_decode": lambda o=ours: o.decode(prompt, DECODE_TOKENS),
            "llama_decode": lambda k=key: peer.call(
                "decode", key=k, prompt=prompt, n=DECODE_TOKENS
            ),
            "ours_prompt": lambda o=ours: o.prefill(long_ids),
            "llama_prompt": lambda k=key: peer.call("prefill", key=k, ids=long_ids),
        }
        print(f"[k-quant bench] {key}: {d.REPEAT} rounds", file=sys.stderr, flush=True)
        waits: list[float] = []
        load0 = os.getloadavg()[0]
        res = d.interleaved(cases, d.REPEAT, waits)
        groups.append(d.group_record(f"{name} {ftype}", t, load0, waits, res))
        med = {k: d.median_s(v) for k, v in res.items()}
        for metric, a, b, n in [
            ("decode tok/s", "ours_decode", "llama_decode", DECODE_TOKENS),
            (f"prompt tok/s ({PROMPT_TOKENS})", "ours_prompt", "llama_prompt", PROMPT_TOKENS),
        ]:
            rows.append(
                {
                    "model": name,
                    "ftype": ftype,
                    "threads": t,
                    "metric": metric,
                    "ours": n / med[a],
                    "llama_cpp": n / med[b],
                    "ratio": med[b] / med[a],
                    "ratio_paired": d.paired(res[a], res[b]),
                    "ours_range_s": d.spread(res[a]),
                    "llama_range_s": d.spread(res[b]),
                }
            )
        # how far the two engines' greedy ids agree (random weights: near-ties come early)
        a, b = res["ours_decode"][0]["ids"], res["llama_decode"][0]["ids"]
        agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        rows[-2]["greedy_ids_agree"] = f"{agree} of {len(a)}"
        rows.append(
            {
                "model": name,
                "ftype": ftype,
                "threads": t,
                "metric": "decode GB/s",
                "ours": DECODE_TOKENS / med["ours_decode"] * nbytes / d.GB,
                "llama_cpp": DECODE_TOKENS / med["llama_decode"] * nbytes / d.GB,
                "bytes_per_token": nbytes,
            }
        )
        ours.close()
        peer.call("free", key=key)
    return rows, groups


def describe(name: str, ftype: str, path: Path) -> dict:
    arch, _, shape = MODELS[name]
    with d.wl.open(path) as ck:
        types: dict[str, int] = {}
        for t in ck.tensors:
            types[t.dtype] = types.get(t.dtype, 0) + 1
        return {
            "name": name,
            "ftype": ftype,
            "architecture": arch,
            "shape": shape,
            "parameters": ck.n_params,
            "nbytes": ck.nbytes,
            "types": types,
            "bytes_per_token": bytes_per_token(name, path),
        }


def markdown(res: dict) -> str:
    lines = [
        "# K-quant decode bench (CPU)",
        "",
        f"{res['date']}; {res['machine'].get('cpu', '')}; llama-cpp-python "
        f"{res['llama']['version']}; medians of {res['repeat']} interleaved rounds.",
        "",
    ]
    for m in res["models"]:
        shape = ", ".join(f"{k} {v}" for k, v in m["shape"].items())
        agree = [
            f"{r['greedy_ids_agree']} at {r['threads']} thread(s)"
            for r in res["rows"]
            if (r["model"], r["ftype"]) == (m["name"], m["ftype"]) and "greedy_ids_agree" in r
        ]
        lines += [
            f"**{m['name']} {m['ftype']}**: a random {m['architecture']} model, {shape} "
            f"({m['parameters'] / 1e6:.0f} M parameters, {m['nbytes'] / 2**20:.0f} MiB: "
            f"{m['types']}); {m['bytes_per_token'] / 2**20:.1f} MiB of weights read "
            f"a decode step. The greedy ids agree for the first {', '.join(agree)}.",
            "",
        ]
    lines += [
        "| model | file | threads | metric | weightlift | llama.cpp | ratio (medians) "
        "| ratio (paired) |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        ratios = f"{r['ratio']:.2f}x | {r['ratio_paired']:.2f}x" if "ratio" in r else " | "
        lines.append(
            f"| {r['model']} | {r['ftype']} | {r['threads']} | {r['metric']} | {r['ours']:.1f} "
            f"| {r['llama_cpp']:.1f} | {ratios} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    files = chosen_files()
    stem = results_stem(files)
    if sys.argv[1:] == ["--md"]:
        md = markdown(json.loads((d.RESULTS / f"{stem}.json").read_text()))
        (d.RESULTS / f"{stem}.md").write_text(md)
        print(md)
        return
    py = d.LLAMA_VENV / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"no llama-cpp-python venv at {d.LLAMA_VENV} (see benches/decode.py)")
    info = d.machine()
    peer = d.LlamaPeer(py)
    rows: list[dict] = []
    groups: list[dict] = []
    models: list[dict] = []
    try:
        llama = peer.call("info")
        for name, ftype in files:
            path = model(peer, name, ftype)
            r, g = bench(peer, name, ftype, path)
            rows += r
            groups += g
            models.append(describe(name, ftype, path))
        for name in MODELS:  # only the quantised files are kept
            (OUT_DIR / f"{name}-F16.gguf").unlink(missing_ok=True)
    finally:
        peer.close()
    res = {
        "date": datetime.date.today().isoformat(),
        "machine": info,
        "llama": {**llama, "cmake_args": d.LLAMA_CMAKE_ARGS},
        "repeat": d.REPEAT,
        "models": models,
        "rows": rows,
        "groups": groups,
    }
    d.RESULTS.mkdir(parents=True, exist_ok=True)
    (d.RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    (d.RESULTS / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

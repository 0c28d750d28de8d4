"""Decode bench: weightlift's CPU forward pass against llama-cpp-python on the same GGUF, the
same token ids and the same thread count. Each number is a median of interleaved repeats (the
2-core machine is shared, so the peers take turns within every round and the order flips each
round); every ratio is ours / llama.cpp, measured in the same run.

Rows, for the SmolLM2-135M demo model (Q4_1) and a Q4_K_M quantisation of it, at 1 and 2 threads:

  1. decode tok/s     after a short prompt, DECODE_TOKENS greedy single-token forward calls
                      (argmax of the last logits row fed back in), the loop timed as a whole
  1b. decode tok/s after DEEP_TOKENS
                      the same decode loop after a DEEP_TOKENS-id prompt (the long prompt's ids
                      repeated), where attention over the cached keys weighs on every step
  2. prompt tok/s     one forward over a PROMPT_TOKENS-id prompt into an empty cache (ours with
                      n_batch=512, so it is one chunk; llama.cpp with n_batch=512 too)
  3. decode GB/s      weight bytes streamed per decoded token (the GGUF's tensor bytes; a tied
                      embedding counted once, as the output matrix; with a separate output
                      matrix the token-embedding row gather is left out) x decode tok/s, set
                      against a DRAM read baseline timed in the same rounds (numpy add.reduce
                      over a 512 MiB uint64 array, split over the same number of threads)
  4. split placement  (demo model) our decode tok/s with the layers split over two virtual
                      devices (SPLIT_DEVICES) against the same model all on cpu; target within 5 %
  5. by weight type   (1 thread) the demo model requantised to one type throughout (Q4_0,
                      Q5_0, Q8_0, and the demo's Q4_1): decode and the 512-token prompt,
                      ours in the fast and the exact compute mode against llama.cpp, to show
                      which types each side has a fast path for (WEIGHTLIFT_BENCH_TYPES=0
                      skips it)

It also checks that the two engines decode the same greedy ids for the first AGREE_TOKENS tokens
(fast path, demo model, 1 thread), and reports them.

The Q4_K_M model is made once, in .cache/bench/, from the demo GGUF with llama.cpp's quantiser
(`llama_model_quantize`, allow_requantize, inside the llama venv); SmolLM2's 576-wide rows are
not whole 256-value K-quant blocks, so llama.cpp falls back to other types for most tensors and
the report lists the resulting type counts. If weightlift cannot run a type that quantiser chose,
the next of Q4_K_S and Q4_0 is tried, and the report says so.

Run it with a release build of weightlift in its own venv (so it neither uses nor disturbs the
dev build in .venv) and llama-cpp-python in its venv (see benches/engine_load.py; the numbers in
benches/results/decode.md come from a build with CMAKE_ARGS as in LLAMA_CMAKE_ARGS below):

    .venv/bin/maturin build --release -o .cache/bench/wheels
    python3 -m venv .cache/bench/wl-venv
    .cache/bench/wl-venv/bin/pip install numpy .cache/bench/wheels/weightlift-*.whl
    .cache/bench/wl-venv/bin/python benches/decode.py

Environment: WEIGHTLIFT_DEMO_GGUF (the demo model), WEIGHTLIFT_BENCH_LLAMA_VENV (default
.cache/bench/llama-venv), WEIGHTLIFT_BENCH_REPEAT (rounds per group, default 9),
WEIGHTLIFT_BENCH_SPLIT (default virtual:2x160MiB,cpu), WEIGHTLIFT_BENCH_TYPE_REPEAT (default 5),
WEIGHTLIFT_BENCH_QUIET_WAIT (seconds a round may wait for the machine to go quiet, default 30).

Writes benches/results/decode.json and benches/results/decode.md (`--md` rewrites the markdown
from the JSON without timing anything).
"""

from __future__ import annotations

import collections
import datetime
import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import weightlift as wl

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
DEMO = Path(
    os.environ.get(
        "WEIGHTLIFT_DEMO_GGUF", ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
)
BENCH_DIR = ROOT / ".cache" / "bench"
LLAMA_VENV = Path(os.environ.get("WEIGHTLIFT_BENCH_LLAMA_VENV", BENCH_DIR / "llama-venv"))
REPEAT = int(os.environ.get("WEIGHTLIFT_BENCH_REPEAT", "9"))
SPLIT_DEVICES = os.environ.get("WEIGHTLIFT_BENCH_SPLIT", "virtual:2x160MiB,cpu")
THREADS = (1, 2)
N_CTX = 1024
N_BATCH = 512
DECODE_TOKENS = 64
PROMPT_TOKENS = 512
# the decode row after a long prompt: DEEP_TOKENS cached positions, then DECODE_TOKENS more
# (within N_CTX), so each step's attention reads some 900 keys a layer
DEEP_TOKENS = 900
AGREE_TOKENS = 16
QUIET_WAIT_S = float(os.environ.get("WEIGHTLIFT_BENCH_QUIET_WAIT", "30"))
DRAM_BYTES = 512 << 20
GB = 1e9
# How the llama-cpp-python in LLAMA_VENV was built (recorded, not checked: llama.cpp reports
# the instruction sets it uses through llama_print_system_info, which the JSON keeps too).
LLAMA_CMAKE_ARGS = (
    "-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "
    "-DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
)
# llama.cpp's file type names; the first whose tensors weightlift runs is benched.
KQUANT_FTYPES = ("Q4_K_M", "Q4_K_S", "Q4_0")
# Single-type files for the by-type rows (with the demo's Q4_1).
TYPE_FTYPES = ("Q4_0", "Q5_0", "Q8_0")
TYPE_REPEAT = int(os.environ.get("WEIGHTLIFT_BENCH_TYPE_REPEAT", "5"))

DECODE_PROMPT = "The three most useful things to know about the moon are"
LONG_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "out loud as his father had done before him. At the top he trimmed the wick, polished the "
    "great lens until it caught the last of the daylight, and wrote the weather in a ledger "
    "whose oldest pages were nearly a century old. Ships passed far out on the horizon, their "
    "lights no bigger than stars, and he wondered where each one was going: to ports with "
    "names he had only read on charts, carrying grain, timber, machines, letters and people. "
    "In winter the storms came in from the north-west and the whole tower hummed with the "
    "wind; in summer the sea lay flat and silver and the gulls argued on the rocks below. "
)


# ---------------------------------------------------------------------------------------------
# llama-cpp-python, in its own venv: a worker that reads one JSON command a line on stdin and
# answers one JSON line; its own stdout is pointed at stderr so llama.cpp's prints cannot mix in.

LLAMA_WORKER = r"""
import ctypes, json, os, sys, time
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
import numpy as np
import llama_cpp
from llama_cpp import Llama

models = {}

def load(key, path, threads, n_ctx, n_batch):
    models[key] = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads,
                        n_threads_batch=threads, n_batch=n_batch, n_gpu_layers=0,
                        verbose=False, logits_all=False)
    return {}

def last_logits(llm):
    # with logits_all=False, Llama.eval no longer copies logits into Llama.scores (0.3.x):
    # read the context's last row in place
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))

def decode(key, prompt, n):
    llm = models[key]
    llm.reset()
    llm.eval(prompt)
    ids = []
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(last_logits(llm)))
        ids.append(tok)
        llm.eval([tok])
    return {"seconds": time.perf_counter() - t0, "ids": ids}

def prefill(key, ids):
    llm = models[key]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    return {"seconds": time.perf_counter() - t0}

def tokenize(key, text):
    return {"ids": models[key].tokenize(text.encode(), add_bos=True)}

def free(key):
    models.pop(key).close()
    return {}

def quantize(src, dst, ftype, threads):
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
    p.allow_requantize = True
    p.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    return {"rc": rc}

def info():
    return {"version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip()}

ops = dict(load=load, decode=decode, prefill=prefill, tokenize=tokenize, free=free,
           quantize=quantize, info=info)
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        res = ops[cmd.pop("op")](**cmd)
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {e}"}
    out.write(json.dumps(res) + "\n")
"""


class LlamaPeer:
    """The llama-cpp-python worker process."""

    def __init__(self, python: Path) -> None:
        self.proc = subprocess.Popen(
            [str(python), "-c", LLAMA_WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )

    def call(self, op: str, **kw) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama worker exited during {op!r} (rc {self.proc.poll()})")
        res = json.loads(line)
        if "error" in res:
            raise RuntimeError(f"llama worker {op!r}: {res['error']}")
        return res

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---------------------------------------------------------------------------------------------
# our side


class Ours:
    """A loaded model with its own cache, so decode steps append instead of starting over."""

    def __init__(
        self, path: Path, threads: int, *, devices: str | None = None, compute: str = "fast"
    ) -> None:
        self.model = wl.load_gguf(
            path,
            n_ctx=N_CTX,
            n_batch=N_BATCH,
            n_threads=threads,
            compute=compute,
            devices=devices,
            n_gpu_layers=-1,
            type_k="f16",
            type_v="f16",
        )
        self.cache = wl.Cache(self.model, max_seq_len=N_CTX, dtype="f16")

    def decode(self, prompt: list[int], n: int) -> dict:
        m, c = self.model, self.cache
        c.reset()
        logits = m.forward(prompt, cache=c)
        ids = []
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(logits[0].argmax())
            ids.append(tok)
            logits = m.forward([tok], cache=c)
        return {"seconds": time.perf_counter() - t0, "ids": ids}

    def prefill(self, ids: list[int]) -> dict:
        self.cache.reset()
        t0 = time.perf_counter()
        self.model.forward(ids, cache=self.cache)
        return {"seconds": time.perf_counter() - t0}

    def close(self) -> None:
        self.cache.free()
        self.model.unload()


# ---------------------------------------------------------------------------------------------
# the DRAM read baseline


class Dram:
    def __init__(self) -> None:
        self.array = np.ones(DRAM_BYTES // 8, dtype=np.uint64)
        self.pool = ThreadPoolExecutor(max(THREADS))

    def read(self, threads: int) -> dict:
        parts = np.array_split(self.array, threads)
        t0 = time.perf_counter()
        list(self.pool.map(np.add.reduce, parts))  # ufunc reductions release the GIL
        return {"seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------
# models


def tensor_types(path: Path) -> dict[str, int]:
    with wl.open(path) as ck:
        return dict(collections.Counter(t.dtype for t in ck.tensors).most_common())


def types_by_role(path: Path) -> dict[str, dict[str, int]]:
    by: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with wl.open(path) as ck:
        for t in ck.tensors:
            by[t.role or t.name][t.dtype] += 1
    return {role: dict(c.most_common()) for role, c in sorted(by.items())}


def bytes_per_token(path: Path) -> int:
    """Weight bytes one decode step reads: every tensor once, except that with a separate
    output matrix the token embedding is only gathered (one row per token)."""
    with wl.open(path) as ck:
        names = {t.name: t.nbytes for t in ck.tensors}
    total = sum(names.values())
    if "output.weight" in names:
        total -= names.get("token_embd.weight", 0)
    return total


def runs_here(path: Path) -> str | None:
    """None when weightlift loads the file and decodes a few tokens, else the error."""
    try:
        o = Ours(path, 1)
        try:
            o.decode([1, 504, 3575, 282], 4)
        finally:
            o.close()
    except Exception as e:  # the report names whatever the engine refused
        return f"{type(e).__name__}: {e}"
    return None


def quantized(peer: LlamaPeer, ftype: str, notes: list[str]) -> Path | None:
    """The demo model quantised by llama.cpp to `ftype` (made once, kept in BENCH_DIR)."""
    dst = BENCH_DIR / f"{DEMO.stem.rsplit('.', 1)[0]}.{ftype}.gguf"
    if not dst.exists():
        tmp = dst.with_suffix(".tmp")
        rc = peer.call("quantize", src=str(DEMO), dst=str(tmp), ftype=ftype, threads=2)["rc"]
        if rc != 0:
            notes.append(f"llama_model_quantize to {ftype} failed (rc {rc}).")
            tmp.unlink(missing_ok=True)
            return None
        tmp.rename(dst)
    return dst


def make_kquant(peer: LlamaPeer, notes: list[str]) -> tuple[str, Path]:
    """Quantise the demo model with llama.cpp; return the first file type weightlift runs."""
    for ftype in KQUANT_FTYPES:
        dst = quantized(peer, ftype, notes)
        if dst is None:
            continue
        err = runs_here(dst)
        if err is None:
            return ftype, dst
        notes.append(
            f"{ftype} ({tensor_types(dst)}): weightlift's forward pass rejects it: {err}; "
            "trying the next type."
        )
    raise SystemExit(f"weightlift runs none of {KQUANT_FTYPES}")


# ---------------------------------------------------------------------------------------------
# timing


def busy_cores(seconds: float = 0.5) -> float:
    """Cores' worth of CPU time the rest of the machine used over `seconds` (we sleep)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as h:
            v = [int(x) for x in h.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(t1 - t0, 1))


def wait_quiet(waits: list[float], limit: float = QUIET_WAIT_S) -> None:
    """Before a round, wait (up to `limit` seconds) until other processes use < 0.25 core:
    llama.cpp's spinning thread barrier degrades badly when a peer thread is descheduled."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit and busy_cores() > 0.25:
        pass
    waits.append(time.perf_counter() - t0)


def interleaved(
    cases: dict[str, Callable[[], dict]], repeat: int, waits: list[float]
) -> dict[str, list[dict]]:
    """Every case once per round (after one warm-up round), the order reversed on odd rounds."""
    for f in cases.values():
        f()
    out: dict[str, list[dict]] = {k: [] for k in cases}
    keys = list(cases)
    for r in range(repeat):
        wait_quiet(waits)
        for k in keys if r % 2 == 0 else reversed(keys):
            gc.collect()
            out[k].append(cases[k]())
    return out


def median_s(runs: list[dict]) -> float:
    return statistics.median(r["seconds"] for r in runs)


def paired(ours: list[dict], theirs: list[dict]) -> float:
    """Median over rounds of ours' speed / theirs (their time / ours): a slow round, which
    slows both, cancels out."""
    return statistics.median(b["seconds"] / a["seconds"] for a, b in zip(ours, theirs, strict=True))


def spread(runs: list[dict]) -> tuple[float, float]:
    s = [r["seconds"] for r in runs]
    return min(s), max(s)


def group_record(label: str, t: int, load0: float, waits: list[float], res: dict) -> dict:
    return {
        "model": label,
        "threads": t,
        "loadavg_1min": (load0, os.getloadavg()[0]),
        "quiet_waits_s": waits,
        "seconds": {k: [r["seconds"] for r in v] for k, v in res.items()},
    }


def bench_model(
    label: str,
    path: Path,
    peer: LlamaPeer,
    dram: Dram,
    prompt: list[int],
    long_ids: list[int],
    split: bool,
) -> tuple[list[dict], list[dict], dict, list[dict]]:
    rows: list[dict] = []
    splits: list[dict] = []
    ids: dict = {}
    groups: list[dict] = []
    nbytes = bytes_per_token(path)
    deep = (long_ids * (DEEP_TOKENS // len(long_ids) + 1))[:DEEP_TOKENS]
    for t in THREADS:
        key = f"{label}@{t}"
        peer.call("load", key=key, path=str(path), threads=t, n_ctx=N_CTX, n_batch=N_BATCH)
        ours = Ours(path, t)
        split_model = Ours(path, t, devices=SPLIT_DEVICES) if split else None
        cases: dict[str, Callable[[], dict]] = {
            "ours_decode": lambda o=ours: o.decode(prompt, DECODE_TOKENS),
            "ours_decode_deep": lambda o=ours, d=deep: o.decode(d, DECODE_TOKENS),
            "llama_decode_deep": lambda k=key, d=deep: peer.call(
                "decode", key=k, prompt=d, n=DECODE_TOKENS
            ),
        }
        if split_model is not None:  # next to ours on cpu, so both see the same machine
            cases["ours_split_decode"] = lambda o=split_model: o.decode(prompt, DECODE_TOKENS)
        cases |= {
            "llama_decode": lambda k=key: peer.call(
                "decode", key=k, prompt=prompt, n=DECODE_TOKENS
            ),
            "ours_prompt": lambda o=ours: o.prefill(long_ids),
            "llama_prompt": lambda k=key: peer.call("prefill", key=k, ids=long_ids),
            "dram": lambda t=t: dram.read(t),
        }
        print(f"[decode bench] {key}: {REPEAT} rounds", file=sys.stderr, flush=True)
        waits: list[float] = []
        load0 = os.getloadavg()[0]
        res = interleaved(cases, REPEAT, waits)
        groups.append(group_record(label, t, load0, waits, res))
        med = {k: median_s(v) for k, v in res.items()}
        ids[key] = {k: v[0]["ids"] for k, v in res.items() if "ids" in v[0]}

        dec_ours = DECODE_TOKENS / med["ours_decode"]
        dec_llama = DECODE_TOKENS / med["llama_decode"]
        pp_ours = len(long_ids) / med["ours_prompt"]
        pp_llama = len(long_ids) / med["llama_prompt"]
        dram_gbps = DRAM_BYTES / med["dram"] / GB
        dec_paired = paired(res["ours_decode"], res["llama_decode"])
        common = {"model": label, "threads": t}
        rows += [
            {
                **common,
                "metric": "decode tok/s",
                "ours": dec_ours,
                "llama_cpp": dec_llama,
                "ratio": dec_ours / dec_llama,
                "ratio_paired": dec_paired,
                "ours_range_s": spread(res["ours_decode"]),
                "llama_range_s": spread(res["llama_decode"]),
            },
            {
                **common,
                "metric": f"decode tok/s after {DEEP_TOKENS}",
                "ours": DECODE_TOKENS / med["ours_decode_deep"],
                "llama_cpp": DECODE_TOKENS / med["llama_decode_deep"],
                "ratio": med["llama_decode_deep"] / med["ours_decode_deep"],
                "ratio_paired": paired(res["ours_decode_deep"], res["llama_decode_deep"]),
                "ours_range_s": spread(res["ours_decode_deep"]),
                "llama_range_s": spread(res["llama_decode_deep"]),
            },
            {
                **common,
                "metric": f"prompt tok/s ({len(long_ids)})",
                "ours": pp_ours,
                "llama_cpp": pp_llama,
                "ratio": pp_ours / pp_llama,
                "ratio_paired": paired(res["ours_prompt"], res["llama_prompt"]),
                "ours_range_s": spread(res["ours_prompt"]),
                "llama_range_s": spread(res["llama_prompt"]),
            },
            {
                **common,
                "metric": "decode GB/s",
                "ours": dec_ours * nbytes / GB,
                "llama_cpp": dec_llama * nbytes / GB,
                "ratio": dec_ours / dec_llama,
                "ratio_paired": dec_paired,
                "bytes_per_token": nbytes,
                "dram_read_gbps": dram_gbps,
                "ours_of_dram": dec_ours * nbytes / GB / dram_gbps,
                "llama_of_dram": dec_llama * nbytes / GB / dram_gbps,
            },
        ]
        if split_model is not None:
            dec_split = DECODE_TOKENS / med["ours_split_decode"]
            split_paired = paired(res["ours_split_decode"], res["ours_decode"])
            plan = split_model.model.plan
            splits.append(
                {
                    **common,
                    "devices": SPLIT_DEVICES,
                    "layers_per_device": dict(collections.Counter(split_model.model.layer_devices)),
                    "head_device": plan.head_device if plan else None,
                    "tied_output_copy": plan.tied_output_copy if plan else None,
                    "cpu_tok_s": dec_ours,
                    "split_tok_s": dec_split,
                    "ratio": dec_split / dec_ours,
                    "ratio_paired": split_paired,
                    "target": "within 5 %",
                    "met": split_paired >= 0.95,
                    "split_range_s": spread(res["ours_split_decode"]),
                    "same_ids_as_cpu": res["ours_split_decode"][0]["ids"]
                    == res["ours_decode"][0]["ids"],
                }
            )
            split_model.close()
        ours.close()
        peer.call("free", key=key)
    return rows, splits, ids, groups


def bench_types(
    peer: LlamaPeer, prompt: list[int], long_ids: list[int], notes: list[str]
) -> tuple[list[dict], list[dict]]:
    """Every matrix of one type, 1 thread: ours in both compute modes against llama.cpp, to
    show which weight types have a fast path on each side."""
    rows: list[dict] = []
    groups: list[dict] = []
    files = [("Q4_1", DEMO)] + [(ft, quantized(peer, ft, notes)) for ft in TYPE_FTYPES]
    for ftype, path in files:
        if path is None:
            continue
        fast, exact = Ours(path, 1), Ours(path, 1, compute="exact")
        key = f"type-{ftype}"
        peer.call("load", key=key, path=str(path), threads=1, n_ctx=N_CTX, n_batch=N_BATCH)
        cases: dict[str, Callable[[], dict]] = {
            "ours_fast_decode": lambda o=fast: o.decode(prompt, DECODE_TOKENS),
            "ours_exact_decode": lambda o=exact: o.decode(prompt, DECODE_TOKENS),
            "llama_decode": lambda k=key: peer.call(
                "decode", key=k, prompt=prompt, n=DECODE_TOKENS
            ),
            "ours_fast_prompt": lambda o=fast: o.prefill(long_ids),
            "ours_exact_prompt": lambda o=exact: o.prefill(long_ids),
            "llama_prompt": lambda k=key: peer.call("prefill", key=k, ids=long_ids),
        }
        print(f"[decode bench] {key}: {TYPE_REPEAT} rounds", file=sys.stderr, flush=True)
        waits: list[float] = []
        load0 = os.getloadavg()[0]
        res = interleaved(cases, TYPE_REPEAT, waits)
        groups.append(group_record(key, 1, load0, waits, res))
        med = {k: median_s(v) for k, v in res.items()}
        rows.append(
            {
                "weights": ftype,
                "file": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
                "tensor_types": tensor_types(path),
                "bytes_per_token": bytes_per_token(path),
                "threads": 1,
                "ours_fast_tok_s": DECODE_TOKENS / med["ours_fast_decode"],
                "ours_exact_tok_s": DECODE_TOKENS / med["ours_exact_decode"],
                "llama_tok_s": DECODE_TOKENS / med["llama_decode"],
                "decode_ratio_paired": paired(res["ours_fast_decode"], res["llama_decode"]),
                "ours_prompt_tok_s": len(long_ids) / med["ours_fast_prompt"],
                "ours_exact_prompt_tok_s": len(long_ids) / med["ours_exact_prompt"],
                "llama_prompt_tok_s": len(long_ids) / med["llama_prompt"],
                "prompt_ratio_paired": paired(res["ours_fast_prompt"], res["llama_prompt"]),
            }
        )
        fast.close()
        exact.close()
        peer.call("free", key=key)
    return rows, groups


def agreement(ids: dict) -> dict:
    a = ids["ours_decode"][:AGREE_TOKENS]
    b = ids["llama_decode"][:AGREE_TOKENS]
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return {
        "tokens": AGREE_TOKENS,
        "same_position": sum(x == y for x, y in zip(a, b, strict=True)),
        "common_prefix": prefix,
        "ours": a,
        "llama_cpp": b,
    }


# ---------------------------------------------------------------------------------------------
# report


def machine() -> dict:
    cpu, flags = "", []
    with open("/proc/cpuinfo") as h:
        for line in h:
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break
    simd = [f for f in flags if f.startswith(("avx", "fma", "f16c", "amx"))]
    from weightlift import _native

    so = Path(_native.__file__)
    git = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpu": cpu,
        "simd_flags": simd,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "weightlift": wl.__version__,
        "extension": str(so),
        "extension_md5": hashlib.md5(so.read_bytes()).hexdigest(),
        "git_head": git,
        "extension_built": datetime.datetime.fromtimestamp(
            so.stat().st_mtime, datetime.timezone.utc
        ).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_isa_env": os.environ.get("WEIGHTLIFT_CPU_ISA", "(unset: best supported)"),
        "loadavg_start": os.getloadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def fmt(v: float) -> str:
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def markdown(res: dict) -> str:
    info, llama = res["machine"], res["llama"]
    waits = [w for g in res["groups"] for w in g["quiet_waits_s"]]
    capped = sum(w >= res["quiet_wait_s"] for w in waits)
    out = [
        "# Decode bench (CPU): weightlift vs llama-cpp-python",
        "",
        f"{info['cpu']}, {info['cores']} cores (SIMD flags: {' '.join(info['simd_flags'])}); "
        f"Python {info['python']}, numpy {info['numpy']}; {info['date']}. Load average at "
        f"start / end: {info['loadavg_start'][0]:.2f} / {info['loadavg_end'][0]:.2f} (the "
        "machine is shared; expect noise).",
        "",
        f"- **weightlift** {info['weightlift']}: release wheel (`maturin build --release`, "
        f"thin LTO) built {info['extension_built']} (extension md5 "
        f"{info['extension_md5'][:12]}; repository HEAD when the bench ran: {info['git_head']})"
        + f', in its own venv; `compute="fast"`, ISA {info["cpu_isa_env"]}, f16 KV cache, '
        f"n_ctx={N_CTX}, n_batch={N_BATCH}.",
        f"- **llama-cpp-python** {llama['version']}, built from the sdist with "
        f'`CMAKE_ARGS="{LLAMA_CMAKE_ARGS}"` (GGML_NATIVE on, AMX off, OpenMP off); '
        f"system info: `{llama['system_info']}`. `Llama(n_ctx={N_CTX}, n_batch={N_BATCH}, "
        "n_threads=T, n_threads_batch=T, logits_all=False)`, f16 KV cache, driven through "
        "`Llama.eval`, greedy over the context's last logits row, in a worker process.",
        f"- Same token ids on both sides (tokenised by llama.cpp). Decode: "
        f"{res['prompt_tokens']}-token prompt, then {DECODE_TOKENS} greedy single-token forward "
        f"calls, timed as one loop; 'after {DEEP_TOKENS}': the same loop after a "
        f"{DEEP_TOKENS}-id prompt (the long prompt's ids repeated), not timed. Prompt: "
        f"{PROMPT_TOKENS} ids in one forward into an empty cache. Medians of {res['repeat']} "
        "interleaved rounds after a warm-up round, peers taking "
        "turns within each round, the order reversed every other round; each round starts once "
        "the rest of the machine uses under 0.25 core (waiting "
        f"{res['quiet_wait_s']:.0f} s at most: {capped} of {len(waits)} rounds started busy).",
        f"- GB/s = weight bytes per decoded token × tok/s; DRAM read = numpy `add.reduce` over "
        f"{DRAM_BYTES >> 20} MiB of uint64 split over the same threads, timed in the same "
        "rounds.",
        "- Ratio = ours / llama.cpp of the medians; 'per round' is the median over rounds of "
        "the same ratio taken within each round (drift that slows a whole round cancels).",
        "",
        "| model | threads | metric | ours | llama.cpp | ratio (ours / llama.cpp) | per round |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        extra = ""
        if r["metric"] == "decode GB/s":
            extra = (
                f"; DRAM read {r['dram_read_gbps']:.1f} GB/s: ours {r['ours_of_dram']:.0%}, "
                f"llama.cpp {r['llama_of_dram']:.0%}"
            )
        out.append(
            f"| {r['model']} | {r['threads']} | {r['metric']} | {fmt(r['ours'])} | "
            f"{fmt(r['llama_cpp'])} | {r['ratio']:.2f}{extra} | {r['ratio_paired']:.2f} |"
        )
    out += [
        "",
        "## Split placement (ours)",
        "",
        "Decode over two virtual devices (host-memory arenas: the weights are copied in, the "
        "hidden state is copied across the boundary) against the same model all on cpu, timed "
        "next to each other in every round. 'Met' takes the per-round ratio.",
        "",
        "| model | threads | devices | layers per device | head on | all on cpu tok/s | "
        "split tok/s | split / cpu | per round | target | met | same ids |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in res["split"]:
        layers = ", ".join(f"{d}: {n}" for d, n in s["layers_per_device"].items())
        out.append(
            f"| {s['model']} | {s['threads']} | `{s['devices']}` | {layers} | "
            f"{s['head_device']} | {fmt(s['cpu_tok_s'])} | {fmt(s['split_tok_s'])} | "
            f"{s['ratio']:.3f} | {s['ratio_paired']:.3f} | {s['target']} | "
            f"{'yes' if s['met'] else '**no**'} | "
            f"{'yes' if s['same_ids_as_cpu'] else 'no'} |"
        )
    out += ["", "## Models", ""]
    for m in res["models"]:
        types = ", ".join(f"{k} × {v}" for k, v in m["tensor_types"].items())
        out.append(
            f"- **{m['label']}** (`{m['file']}`, {m['file_bytes'] / 2**20:.1f} MiB): "
            f"{m['bytes_per_token'] / 2**20:.1f} MiB of weights per decoded token; "
            f"tensor types {types}."
        )
        if len(m["tensor_types"]) > 3:  # a mixed file: say which roles got which type
            by_role = "; ".join(
                f"{role} " + ", ".join(f"{k} × {v}" for k, v in c.items())
                for role, c in m["tensor_types_by_role"].items()
            )
            out.append(f"  - by role: {by_role}.")
    if res["by_type"]:
        out += [
            "",
            "## Decode by weight type (1 thread)",
            "",
            "The demo model requantised by llama.cpp so that every matrix has one type "
            "(the token embedding, also the output matrix, stays Q8_0 except in the Q8_0 row "
            "where it is that too). Ours in both compute modes; llama.cpp as above; "
            f"medians of {res['type_repeat']} interleaved rounds. weightlift's fast mode "
            "(8-bit activations) covers Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K "
            "(`Q8_WEIGHT_TYPES` in crates/weightlift-kernels/src/cpu/matvec.rs); other types "
            "run the exact kernel.",
            "",
            "| weights | MiB / token | ours fast tok/s | ours exact tok/s | llama.cpp tok/s | "
            "fast / llama.cpp (per round) | ours fast prompt tok/s | ours exact prompt tok/s | "
            "llama.cpp prompt tok/s | ours fast / llama.cpp (per round) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in res["by_type"]:
            out.append(
                f"| {t['weights']} | {t['bytes_per_token'] / 2**20:.1f} | "
                f"{fmt(t['ours_fast_tok_s'])} | {fmt(t['ours_exact_tok_s'])} | "
                f"{fmt(t['llama_tok_s'])} | {t['decode_ratio_paired']:.2f} | "
                f"{fmt(t['ours_prompt_tok_s'])} | {fmt(t['ours_exact_prompt_tok_s'])} | "
                f"{fmt(t['llama_prompt_tok_s'])} | "
                f"{t['prompt_ratio_paired']:.2f} |"
            )
    a = res["agreement"]
    out += [
        "",
        "## Greedy agreement",
        "",
        f"Demo model, fast path, 1 thread, first {a['tokens']} decoded ids: "
        f"{a['same_position']} of {a['tokens']} equal position by position, common prefix "
        f"{a['common_prefix']}.",
        "",
        f"- ours:      `{a['ours']}`",
        f"- llama.cpp: `{a['llama_cpp']}`",
    ]
    notes = list(res["notes"])
    for g in res["groups"]:
        for case, secs in g["seconds"].items():
            med, worst = statistics.median(secs), max(secs)
            if worst > 3 * med:
                notes.append(
                    f"{g['model']}, {g['threads']} thread(s), {case}: the worst round took "
                    f"{worst / med:.0f}× the median ({worst * 1e3:.0f} ms against "
                    f"{med * 1e3:.0f} ms); the median leaves it out."
                )
    if notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def main() -> None:
    if sys.argv[1:] == ["--md"]:  # rewrite the markdown from the last JSON, no timing
        md = markdown(json.loads((RESULTS / "decode.json").read_text()))
        (RESULTS / "decode.md").write_text(md)
        print(md)
        return
    if not DEMO.exists():
        raise SystemExit(f"demo model not found at {DEMO}; run `make demo-model`")
    py = LLAMA_VENV / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"no llama-cpp-python venv at {LLAMA_VENV} (see benches/engine_load.py)")
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    info = machine()
    peer = LlamaPeer(py)
    try:
        llama = peer.call("info")
        ftype, kq = make_kquant(peer, notes)
        models = [("SmolLM2-135M Q4_1", DEMO), (f"SmolLM2-135M {ftype}", kq)]

        peer.call("load", key="tok", path=str(DEMO), threads=1, n_ctx=N_CTX, n_batch=N_BATCH)
        prompt = peer.call("tokenize", key="tok", text=DECODE_PROMPT)["ids"]
        long_ids = peer.call("tokenize", key="tok", text=LONG_TEXT * 8)["ids"][:PROMPT_TOKENS]
        peer.call("free", key="tok")
        if len(long_ids) != PROMPT_TOKENS:
            raise SystemExit(f"long prompt has {len(long_ids)} tokens, want {PROMPT_TOKENS}")

        dram = Dram()
        rows: list[dict] = []
        splits: list[dict] = []
        ids: dict = {}
        groups: list[dict] = []
        for i, (label, path) in enumerate(models):
            r, s, d, g = bench_model(label, path, peer, dram, prompt, long_ids, split=i == 0)
            rows += r
            splits += s
            ids |= d
            groups += g
        by_type: list[dict] = []
        if os.environ.get("WEIGHTLIFT_BENCH_TYPES", "1") != "0":
            by_type, g = bench_types(peer, prompt, long_ids, notes)
            groups += g
    finally:
        peer.close()

    info["loadavg_end"] = os.getloadavg()
    demo_ids = ids[f"{models[0][0]}@1"]
    for key, d in ids.items():
        if d["ours_decode"] != demo_ids["ours_decode"] and key.startswith(models[0][0]):
            notes.append(f"our greedy ids differ between thread counts ({key}).")
    notes.append(
        f"The {ftype} model is requantised from the Q4_1 demo file (allow_requantize), so its "
        "text quality is worse than a quantisation from f16 would give; it is here for speed."
    )
    res = {
        "machine": info,
        "llama": {**llama, "cmake_args": LLAMA_CMAKE_ARGS},
        "prompt_tokens": len(prompt),
        "prompt_ids": prompt,
        "models": [
            {
                "label": label,
                "file": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
                "file_bytes": path.stat().st_size,
                "bytes_per_token": bytes_per_token(path),
                "tensor_types": tensor_types(path),
                "tensor_types_by_role": types_by_role(path),
            }
            for label, path in models
        ],
        "rows": rows,
        "split": splits,
        "agreement": agreement(demo_ids),
        "greedy_ids": ids,
        "repeat": REPEAT,
        "type_repeat": TYPE_REPEAT,
        "quiet_wait_s": QUIET_WAIT_S,
        "by_type": by_type,
        "groups": groups,
        "notes": notes,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "decode.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    (RESULTS / "decode.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

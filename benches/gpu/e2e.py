"""End-to-end bench: weightlift against transformers on one device, on a random-weight llama
shaped like TinyLlama-1.1B (hidden 2048, 22 layers, 32 query and 4 KV heads, FFN 5632, vocab
32000), stored as bf16 safetensors.

The checkpoint is made here: with transformers (`LlamaForCausalLM(config)` after
`torch.manual_seed(0)`, then `save_pretrained`) where torch and transformers import, otherwise
with numpy and the `safetensors` package (the same tensor names, shapes and dtype; random normal
weights of std 0.02, the initializer_range, with unit norms), and then the transformers peer is
skipped by name. It is kept in WEIGHTLIFT_E2E_DIR (default $TMPDIR/weightlift-e2e) for the
next run.

Rows, batch 1, greedy, fp16 KV cache, through weightlift's Python API the way
benches/decode.py times it (a loaded model, a Cache of its own, `forward` one token at a time
with the argmax of the last logits fed back in, the loop timed as a whole):

  load           open, plan and load (bf16 as stored, f16 converted on load, q8_0 and q4_k
                 quantised on load), from the page cache; also in parts: open and plan
                 (`Model(...)`), the cache's allocation and the weights' load (`load`), with
                 the weights' rate in checkpoint GB/s
  copy baselines measured in the same run, before the rows: reading the page-cached
                 checkpoint into page-locked memory, and a page-locked and a pageable
                 host-to-device copy (torch's `copy_`, which is `cuMemcpyHtoDAsync`), so the
                 load rate reads against what the machine can move
  decode @64     tok/s over DECODE_TOKENS tokens after a 64-token prompt
  decode @2048   tok/s over DECODE_TOKENS tokens after a 2,048-token prompt
  prefill        ms for a 512- and a 2,048-token prompt into an empty cache (on CUDA the
                 products on cuBLAS, the attention in attention_prefill_*; run.sh repeats the
                 prefills with WEIGHTLIFT_CUBLAS=0 and --prefill-only for the A/B)
  (decode on CUDA replays a captured CUDA graph per step unless WEIGHTLIFT_CUDA_GRAPHS=0;
                 run.sh repeats the decode rows with it and --decode-only for the A/B)
  (decode's Q4_K and Q6_K products take the wide-lane kernels unless WEIGHTLIFT_Q8V=narrow;
                 run.sh repeats the q4_k decode rows with it and --decode-only for the A/B)
  memory         the plan's total for the device, Model.memory() and Model.peak_memory() after
                 the runs, and the GPU memory this process holds (nvidia-smi's used memory less
                 what was used before the bench, so the CUDA context counts), against each other

and transformers (bf16, sdpa, its default dynamic cache) on the same device in the same run,
after weightlift's rows, so that torch's CUDA context is not in weightlift's memory figures.

Five minutes on the GPU by design: DECODE_TOKENS = 32 tokens per decode measurement, medians of
REPEATS = 3 (after one untimed warm-up, which compiles the kernels), and once --budget-s is spent
what is left is skipped by name. `--cpu` runs the same rows on the cpu with a smaller model of
the same family (SMALL below), so that the rehearsal finishes in a few minutes on two cores.

    python benches/gpu/e2e.py --device cuda:0 --out benches/results/gpu
    python benches/gpu/e2e.py --cpu --out /tmp/e2e

Writes e2e.md and e2e.json in --out, and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# TinyLlama-1.1B's shape, and the rehearsal's (head_dim 64 in both; FFN a whole number of the
# 256-value K-quant blocks, so q4_k applies to every matrix).
TINYLLAMA = {
    "hidden_size": 2048,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "intermediate_size": 5632,
    "vocab_size": 32000,
}
SMALL = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "intermediate_size": 768,
    "vocab_size": 32000,
}
COMMON = {
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SEED = 0

DECODE_TOKENS = 32
REPEATS = 3
SHORT = 64
PROMPTS = (512, 2048)
MAX_SEQ = max(PROMPTS) + DECODE_TOKENS

# weightlift's rows: label, Model keyword arguments.
OURS: list[tuple[str, dict[str, Any]]] = [
    ("bf16", {"dtype": "auto"}),
    ("f16", {"dtype": "float16"}),
    ("q8_0", {"quantize": "q8_0"}),
    ("q4_k", {"quantize": "q4_k"}),
]
PEER = "transformers bf16"


def say(msg: str) -> None:
    print(msg, flush=True)


class Budget:
    """Wall-clock budget; what does not start in time is skipped by name."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds
        self.seconds = seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.end - time.perf_counter()

    def allows(self, what: str) -> bool:
        if self.left() > 0:
            return True
        self.skipped.append(what)
        say(f"skipped: time budget ({self.seconds:.0f} s) spent: {what}")
        return False


# ---------------------------------------------------------------------------------------------
# The checkpoint


def tensor_shapes(shape: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Hugging Face llama's tensor names and shapes for `shape`."""
    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    out |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return out


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bit patterns, rounding to nearest even (as torch does)."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_with_numpy(folder: Path, shape: dict[str, int]) -> None:
    import safetensors

    rng = np.random.default_rng(SEED)
    arrays = {}
    for name, dims in tensor_shapes(shape).items():
        if name.endswith("norm.weight"):
            arrays[name] = bf16_bits(np.ones(dims, np.float32))
        else:
            w = rng.standard_normal(dims, dtype=np.float32) * COMMON["initializer_range"]
            arrays[name] = bf16_bits(w)
    specs: dict[str, Any] = {}
    for name, a in arrays.items():
        if hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.7: pointers, no copies
            specs[name] = safetensors.TensorSpec(
                dtype="bfloat16", shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes
            )
        else:
            specs[name] = {"dtype": "bfloat16", "shape": list(a.shape), "data": a.tobytes()}
    safetensors.serialize_file(specs, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        **COMMON,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_with_transformers(folder: Path, shape: dict[str, int]) -> None:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**shape, **COMMON)
    torch.manual_seed(SEED)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: half the memory and time
    try:
        model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    model.to(torch.bfloat16).save_pretrained(folder)


def has_transformers() -> str | None:
    """None when torch and transformers import, else why not."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"{e.name or e} is not installed"
    return None


def checkpoint_root() -> Path:
    """Where the benches keep their checkpoints between runs: WEIGHTLIFT_E2E_DIR, else
    $TMPDIR/weightlift-e2e."""
    default = Path(tempfile.gettempdir()) / "weightlift-e2e"
    return Path(os.environ.get("WEIGHTLIFT_E2E_DIR", default))


def checkpoint(shape: dict[str, int], root: Path) -> tuple[Path, dict[str, Any]]:
    """The bf16 checkpoint for `shape`, made once in `root` and reused."""
    maker = "transformers" if has_transformers() is None else "numpy + safetensors"
    key = {"shape": shape, "common": COMMON, "seed": SEED, "made with": maker}
    name = f"llama-h{shape['hidden_size']}-l{shape['num_hidden_layers']}-{maker.split()[0]}"
    folder = root / name
    stamp = folder / "e2e-stamp.json"
    info: dict[str, Any] = {"made_with": maker, "path": str(folder)}
    if stamp.is_file() and json.loads(stamp.read_text()) == key:
        info["seconds_to_make"] = None
    else:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        say(f"making the checkpoint with {maker} in {folder}")
        t0 = time.perf_counter()
        if maker == "transformers":
            write_with_transformers(folder, shape)
        else:
            write_with_numpy(folder, shape)
        info["seconds_to_make"] = time.perf_counter() - t0
        stamp.write_text(json.dumps(key) + "\n")
    info["bytes"] = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return folder, info


# ---------------------------------------------------------------------------------------------
# GPU memory, from nvidia-smi (no CUDA context of our own is needed to read it)


def gpu_used_bytes(index: int) -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
                "-i",
                str(index),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return int(out.strip().splitlines()[0]) << 20
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


# ---------------------------------------------------------------------------------------------
# Timing


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# Prefill only (--prefill-only): the A/B run of run.sh without cuBLAS measures no decode.
PREFILL_ONLY = False
DECODE_ONLY = False


def measure(
    run: Callable[[list[int], int], tuple[float, float]], ids: list[int], budget: Budget, what: str
) -> dict[str, Any]:
    """One warm-up, then REPEATS rounds of: decode after SHORT positions, each prefill, and
    decode after the longest prompt (with PREFILL_ONLY, the prefills alone; with DECODE_ONLY,
    the decodes alone, the longest prompt run untimed before its decode). `run(prompt, n)`
    resets the cache, runs the prompt, decodes n tokens and returns (prefill seconds, decode
    seconds)."""
    run(ids[: PROMPTS[0]], 2)  # compiles and loads the kernels, touches the cache
    got: dict[str, list[float]] = {} if PREFILL_ONLY else {"decode_short": [], "decode_long": []}
    for n in PROMPTS:
        if not DECODE_ONLY:
            got[f"prefill_{n}"] = []
    for r in range(REPEATS):
        if r > 0 and not budget.allows(f"{what}: rounds {r + 1}-{REPEATS}"):
            break
        if not PREFILL_ONLY:
            _, d = run(ids[:SHORT], DECODE_TOKENS)
            got["decode_short"].append(DECODE_TOKENS / d)
        for n in PROMPTS:
            long = n == max(PROMPTS) and not PREFILL_ONLY
            if DECODE_ONLY and not long:
                continue
            p, d = run(ids[:n], DECODE_TOKENS if long else 0)
            if not DECODE_ONLY:
                got[f"prefill_{n}"].append(p * 1e3)
            if long:
                got["decode_long"].append(DECODE_TOKENS / d)
    return {"samples": got, "median": {k: median(v) for k, v in got.items()}}


def ours_forward(m: Any, cache: Any, prompt: list[int], n: int) -> tuple[float, float]:
    """The prompt into an emptied cache, then n greedy tokens: (prefill s, decode s)."""
    cache.reset()
    t = time.perf_counter()
    logits = m.forward(prompt, cache=cache)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n):
        logits = m.forward([int(logits[0].argmax())], cache=cache)
    return prefill, time.perf_counter() - t


def bench_ours(
    label: str,
    kw: dict[str, Any],
    path: Path,
    device: str,
    ids: list[int],
    budget: Budget,
    gpu_before: int | None,
) -> dict[str, Any]:
    import weightlift as wl

    row: dict[str, Any] = {"engine": "weightlift", "label": label, "options": kw}
    m = cache = None
    try:
        t0 = time.perf_counter()
        m = wl.Model(path, devices=device, compute="fast", **kw)
        t1 = time.perf_counter()
        cache = wl.Cache(m, max_seq_len=MAX_SEQ, dtype="fp16")
        t2 = time.perf_counter()
        m.load(cache=cache)
        t3 = time.perf_counter()
        row["load_s"] = t3 - t0
        row["load_parts_s"] = {"open_plan": t1 - t0, "cache": t2 - t1, "weights": t3 - t2}

        loaded, c = m, cache
        row |= measure(
            lambda p, n: ours_forward(loaded, c, p, n), ids, budget, f"weightlift {label}"
        )
        plan = m.plan
        row["plan"] = {
            d.name: {
                "weights": d.weights,
                "kv": d.kv,
                "scratch": d.scratch,
                "overhead": d.overhead,
                "used": d.used,
            }
            for d in (plan.devices if plan is not None else [])
            if d.used
        }
        row["memory"] = dict(m.memory())
        row["peak_memory"] = dict(m.peak_memory())
        if device.startswith("cuda"):
            # whether the decode steps replayed CUDA graphs: (captures, replays, refused)
            row["cuda_graph_counts"] = list(m.cuda_graph_counts())
        if gpu_before is not None:
            now = gpu_used_bytes(device_index(device))
            row["gpu_used"] = None if now is None else now - gpu_before
    except Exception as e:  # the report names whatever the engine refused, and goes on
        row["error"] = f"{type(e).__name__}: {e}"
        say(f"weightlift {label}: {row['error']}")
    finally:
        if cache is not None:
            cache.free()
        if m is not None:
            m.unload()
        m = cache = None
        gc.collect()
    return row


def peer_forward(model: Any, dev: Any, prompt: list[int], n: int) -> tuple[float, float]:
    """As `ours_forward`, for transformers: a fresh dynamic cache per call."""
    import torch

    def sync() -> None:
        if dev != "cpu":
            torch.cuda.synchronize(dev)

    with torch.inference_mode():
        x = torch.tensor([prompt], device=dev)
        sync()
        t = time.perf_counter()
        out = model(input_ids=x, use_cache=True)
        tok = int(out.logits[0, -1].argmax())
        prefill = time.perf_counter() - t
        past = out.past_key_values
        t = time.perf_counter()
        for _ in range(n):
            x = torch.tensor([[tok]], device=dev)
            out = model(input_ids=x, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = int(out.logits[0, -1].argmax())  # the host sees each token, as ours does
        return prefill, time.perf_counter() - t


def bench_peer(
    path: Path, device: str, ids: list[int], budget: Budget, gpu_before: int | None
) -> dict[str, Any]:
    import torch
    import transformers

    row: dict[str, Any] = {"engine": "transformers", "label": PEER, "options": {"attn": "sdpa"}}
    row["version"] = transformers.__version__
    dev = torch.device("cuda", device_index(device)) if device.startswith("cuda") else "cpu"

    def sync() -> None:
        if dev != "cpu":
            torch.cuda.synchronize(dev)

    model = None
    try:
        t0 = time.perf_counter()
        try:
            model = transformers.LlamaForCausalLM.from_pretrained(
                path, dtype=torch.bfloat16, attn_implementation="sdpa"
            )
        except TypeError:  # transformers 4 names it torch_dtype
            model = transformers.LlamaForCausalLM.from_pretrained(
                path, torch_dtype=torch.bfloat16, attn_implementation="sdpa"
            )
        t1 = time.perf_counter()
        model = model.to(dev).eval()
        sync()
        t2 = time.perf_counter()
        row["load_s"] = t2 - t0
        row["load_parts_s"] = {"from_pretrained": t1 - t0, "to_device": t2 - t1}

        loaded = model
        row |= measure(lambda p, n: peer_forward(loaded, dev, p, n), ids, budget, PEER)
        if dev != "cpu":
            row["torch_max_allocated"] = torch.cuda.max_memory_allocated(dev)
            free, total = torch.cuda.mem_get_info(dev)
            row["torch_mem_get_info_used"] = total - free
            if gpu_before is not None:
                now = gpu_used_bytes(device_index(device))
                row["gpu_used"] = None if now is None else now - gpu_before
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        say(f"{PEER}: {row['error']}")
    finally:
        model = None
        gc.collect()
        if dev != "cpu":
            torch.cuda.empty_cache()
    return row


def device_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


# Bytes of each host-to-device copy the baselines time: large enough that the link, not the
# call, sets the rate.
COPY_BYTES = 256 << 20


def copy_baselines(path: Path, device: str, notes: list[str]) -> dict[str, float]:
    """GB/s of what a load does at the most: the page-cached checkpoint read into
    page-locked memory, and page-locked and pageable host-to-device copies (medians of
    REPEATS + 2). Without torch, or on the cpu, only the read is timed (into plain memory), and
    the note says which were skipped."""
    files = sorted(path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    out: dict[str, float] = {}
    torch = None
    if device.startswith("cuda"):
        try:
            import torch as torch_mod

            if torch_mod.cuda.is_available():
                torch = torch_mod
        except ImportError:
            pass
        if torch is None:
            notes.append("copy baselines: torch with CUDA does not import; only the read ran")
    if torch is not None:
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        buf = host.numpy()
        where = "page-locked"
    else:
        buf = np.empty(size, dtype=np.uint8)
        where = "plain"
    buf[:: 1 << 12] = 0  # fault the pages in before timing

    def read_all() -> None:
        at = 0
        for f in files:
            with f.open("rb", buffering=0) as fh:
                n = fh.readinto(memoryview(buf)[at : at + f.stat().st_size])
                at += n or 0

    read_all()  # into the page cache
    times = []
    for _ in range(REPEATS + 2):
        t = time.perf_counter()
        read_all()
        times.append(time.perf_counter() - t)
    out[f"read_into_{where.replace('-', '_')}_gbs"] = size / statistics.median(times) / 1e9
    if torch is None:
        return out
    dev = torch.device("cuda", device_index(device))
    n = min(COPY_BYTES, size)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    pinned = host[:n]
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(1)
    for name, src in (("htod_pinned_gbs", pinned), ("htod_pageable_gbs", pageable)):
        times = []
        for _ in range(REPEATS + 2):
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
        out[name] = n / statistics.median(times[1:]) / 1e9
    return out


def copy_baselines_apart(path: Path, device: str, notes: list[str]) -> dict[str, float]:
    """`copy_baselines` in a process of its own, so torch's CUDA context is never in this
    process (weightlift measures its own context when it plans, and its rows come first)."""
    cmd = [sys.executable, __file__, "--copy-baselines", str(path), "--device", device]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        got = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        notes.append(f"copy baselines failed: {type(e).__name__}: {str(e)[-300:]}")
        return {}
    notes += got.get("notes", [])
    return got.get("gbs", {})


# ---------------------------------------------------------------------------------------------
# Report


def fmt(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def gib(v: int | None) -> str:
    return "—" if v is None else f"{v / 2**30:.2f}"


def markdown(res: dict[str, Any]) -> str:
    rows = res["rows"]
    cols = [r["label"] if r["engine"] == "transformers" else f"ours {r['label']}" for r in rows]
    out = [
        f"# End-to-end bench ({res['device']})",
        "",
        res["header"],
        "",
        f"Model: random-weight llama, {res['shape_name']}: hidden {res['shape']['hidden_size']}, "
        f"{res['shape']['num_hidden_layers']} layers, {res['shape']['num_attention_heads']} query "
        f"and {res['shape']['num_key_value_heads']} KV heads, FFN "
        f"{res['shape']['intermediate_size']}, vocab {res['shape']['vocab_size']}; bf16 "
        f"safetensors, {res['checkpoint']['bytes'] / 1e9:.2f} GB, made with "
        f"{res['checkpoint']['made_with']}. Batch 1, greedy, fp16 KV cache; weightlift "
        f"{res['weightlift']} in its fast compute mode. Medians of {REPEATS} rounds after a "
        f"warm-up; each decode figure times {DECODE_TOKENS} tokens.",
        "",
        "| | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]

    def line(title: str, get: Callable[[dict[str, Any]], str]) -> None:
        cells = []
        for r in rows:
            if "error" in r:
                cells.append("failed")
            elif "median" not in r:
                cells.append("skipped")
            else:
                cells.append(get(r))
        out.append(f"| {title} | " + " | ".join(cells) + " |")

    med = lambda k: lambda r: fmt(r["median"].get(k))  # noqa: E731
    line(f"decode tok/s @{SHORT}", med("decode_short"))
    line(f"decode tok/s @{max(PROMPTS)}", med("decode_long"))
    for n in PROMPTS:
        line(f"prefill {n} ms", med(f"prefill_{n}"))
    line("load s", lambda r: fmt(r.get("load_s"), 2))

    def part(*names: str) -> Callable[[dict[str, Any]], str]:
        def get(r: dict[str, Any]) -> str:
            parts = r.get("load_parts_s", {})
            return next((fmt(parts[n], 3) for n in names if n in parts), "—")

        return get

    line("↳ open and plan s (transformers: from_pretrained)", part("open_plan", "from_pretrained"))
    line("↳ cache s", part("cache"))
    line("↳ weights s (transformers: .to(device))", part("weights", "to_device"))
    size = res["checkpoint"]["bytes"]

    def weights_rate(r: dict[str, Any]) -> str:
        parts = r.get("load_parts_s", {})
        t = parts.get("weights", parts.get("to_device"))
        return "—" if not t else fmt(size / t / 1e9, 2)

    line("↳ checkpoint GB/s of that", weights_rate)
    dev = res["device"]
    line(f"plan for {dev}, GiB", lambda r: gib(r.get("plan", {}).get(dev, {}).get("used")))
    line("memory(), GiB", lambda r: gib(r.get("memory", {}).get(dev)))
    line("peak_memory(), GiB", lambda r: gib(r.get("peak_memory", {}).get(dev)))
    line("torch max allocated, GiB", lambda r: gib(r.get("torch_max_allocated")))
    line("GPU used by the process (nvidia-smi), GiB", lambda r: gib(r.get("gpu_used")))
    out += [
        "",
        "The plan's figure is its total for the device (weights, KV, scratch, overhead); GPU "
        "used is nvidia-smi's used memory after the rounds less before the bench, so it holds "
        "the CUDA context (which weightlift's first row creates and later rows share).",
    ]
    base = res.get("copy_baselines", {})
    if base:
        names = {
            "read_into_page_locked_gbs": "the page-cached checkpoint read into page-locked memory",
            "read_into_plain_gbs": "the page-cached checkpoint read into plain memory",
            "htod_pinned_gbs": f"host to device from page-locked memory ({COPY_BYTES >> 20} MiB)",
            "htod_pageable_gbs": f"host to device from pageable memory ({COPY_BYTES >> 20} MiB)",
        }
        out += ["", "Copy baselines of the same run (GB/s, medians):", ""]
        out += [f"- {names.get(k, k)}: {v:,.2f}" for k, v in base.items()]
    notes = [f"{r['label']}: {r['error']}" for r in rows if "error" in r]
    notes += [
        f"{r['label']}: CUDA graphs (captures, replays, refused) {tuple(r['cuda_graph_counts'])}"
        for r in rows
        if "cuda_graph_counts" in r
    ]
    notes += [f"skipped: {s}" for s in res["skipped"]]
    notes += res["notes"]
    if notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--cpu", action="store_true", help="the rehearsal: cpu, smaller model")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "gpu"
    )
    ap.add_argument("--budget-s", type=float, default=180.0)
    ap.add_argument(
        "--prefill-only",
        action="store_true",
        help="measure the prefills only (run.sh's A/B run with WEIGHTLIFT_CUBLAS=0)",
    )
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="measure the decodes only (run.sh's A/B run with WEIGHTLIFT_CUDA_GRAPHS=0)",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated row labels (bf16, f16, q8_0, q4_k, transformers); default all",
    )
    ap.add_argument("--copy-baselines", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.copy_baselines is not None:  # the child of copy_baselines_apart
        said: list[str] = []
        gbs = copy_baselines(args.copy_baselines, args.device, said)
        print(json.dumps({"gbs": gbs, "notes": said}))
        return 0
    global PREFILL_ONLY, DECODE_ONLY
    PREFILL_ONLY = args.prefill_only
    DECODE_ONLY = args.decode_only and not PREFILL_ONLY
    only = {s for s in args.only.split(",") if s}
    device = "cpu" if args.cpu else args.device
    shape, shape_name = (
        (SMALL, "the --cpu rehearsal's small shape")
        if args.cpu
        else (
            TINYLLAMA,
            "TinyLlama-1.1B's shape",
        )
    )
    if args.cpu:
        say(
            f"--cpu: a smaller model than TinyLlama-1.1B's shape (hidden {SMALL['hidden_size']}, "
            f"{SMALL['num_hidden_layers']} layers), on the cpu"
        )
    budget = Budget(args.budget_s)
    notes: list[str] = []
    # the prompt products' route (cuBLAS from WEIGHTLIFT_CUBLAS_MIN_TOKENS tokens, unless
    # WEIGHTLIFT_CUBLAS=0) and the prompt attention kernel are chosen in the engine; say how
    # this run asked for them
    cublas = os.environ.get("WEIGHTLIFT_CUBLAS", "on (default)")
    min_tokens = os.environ.get("WEIGHTLIFT_CUBLAS_MIN_TOKENS", "default")
    notes.append(f"WEIGHTLIFT_CUBLAS={cublas}, WEIGHTLIFT_CUBLAS_MIN_TOKENS={min_tokens}")
    graphs = os.environ.get("WEIGHTLIFT_CUDA_GRAPHS", "on (default)")
    notes.append(f"WEIGHTLIFT_CUDA_GRAPHS={graphs}")
    # decode's Q8 kernels for Q4_K and Q6_K: the wide lanes, or the narrow ones with =narrow
    q8v = os.environ.get("WEIGHTLIFT_Q8V", "wide (default)")
    notes.append(f"WEIGHTLIFT_Q8V={q8v}")
    if PREFILL_ONLY:
        notes.append("prefill only: no decode rows were measured")
    if DECODE_ONLY:
        notes.append("decode only: no prefill rows were measured")
    path, ck = checkpoint(shape, checkpoint_root())
    say(f"checkpoint: {path} ({ck['bytes'] / 1e9:.2f} GB, made with {ck['made_with']})")

    import weightlift as wl

    ids = np.random.default_rng(SEED).integers(3, shape["vocab_size"], size=max(PROMPTS)).tolist()
    baselines = {} if PREFILL_ONLY or DECODE_ONLY else copy_baselines_apart(path, device, notes)
    gpu_before = gpu_used_bytes(device_index(device)) if device.startswith("cuda") else None
    rows = []
    for label, kw in OURS:
        if only and label not in only:
            continue
        if not budget.allows(f"weightlift {label}"):
            continue
        say(f"weightlift {label} on {device}")
        r = bench_ours(label, kw, path, device, ids, budget, gpu_before)
        rows.append(r)
        say(summary_line(r))
    if only and "transformers" not in only:
        say(f"transformers peer: not in --only ({args.only})")
    elif (why_not := has_transformers()) is not None:
        say(f"skipped: {why_not}: transformers peer")
        budget.skipped.append(f"{why_not}: transformers peer")
    elif budget.allows("transformers peer"):
        say(f"{PEER} on {device}")
        r = bench_peer(path, device, ids, budget, gpu_before)
        rows.append(r)
        say(summary_line(r))
    res = {
        "header": os.environ.get("WEIGHTLIFT_RUN_HEADER", f"Run {time.strftime('%Y-%m-%d %H:%M')}"),
        "device": device,
        "shape": shape,
        "shape_name": shape_name,
        "weightlift": getattr(wl, "__version__", "?"),
        "python": platform.python_version(),
        "checkpoint": ck,
        "decode_tokens": DECODE_TOKENS,
        "repeats": REPEATS,
        "rows": rows,
        "copy_baselines": baselines,
        "skipped": budget.skipped,
        "notes": notes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "e2e.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    (args.out / "e2e.md").write_text(md)
    say("\n" + md)
    return 0


def summary_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  {r['label']}: failed"
    m = r.get("median", {})
    prefill = " / ".join(fmt(m.get(f"prefill_{n}")) for n in PROMPTS)
    return (
        f"  {r['label']}: load {fmt(r.get('load_s'), 2)} s, "
        f"decode {fmt(m.get('decode_short'))} tok/s @{SHORT}, "
        f"{fmt(m.get('decode_long'))} @{max(PROMPTS)}, prefill {prefill} ms"
    )


if __name__ == "__main__":
    sys.exit(main())

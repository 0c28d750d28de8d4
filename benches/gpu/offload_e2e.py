"""Offload bench: decode with 1 GiB of GPU and the rest of the model in host RAM, weightlift
against accelerate (transformers' `device_map="auto"` with `max_memory`) on the same GPU in
the same run, on the end-to-end bench's checkpoint (the TinyLlama-1.1B-shaped bf16 llama of
`e2e.py`, made there once and reused).

Rows, batch 1, greedy, bf16 weights as stored, fp16 KV cache (weightlift) or transformers'
dynamic cache (accelerate), `device_map="auto"` and `max_memory={gpu: 1 GiB, cpu: 64 GiB}` in
both:

  weightlift, offload=None          the layers that do not fit compute on the cpu, where they
                                    are (llama.cpp's way: nothing is copied but the hidden state)
  weightlift, sequential            each kept layer's matrices copied to the GPU, then run
  weightlift, group of 2, no prefetch
                                    2 layers at a time, each group copied, then run
  weightlift, group of 2, prefetch  2 layers at a time, the next group copied while one computes
  accelerate                        its hooks move each offloaded layer's weights to the GPU

Each row: decode tok/s over DECODE_TOKENS tokens after a PROMPT-token prompt (median of
REPEATS, after one untimed warm-up), and for weightlift the bytes its last decode step copied
and the rate of those copies (`Model.transfer_stats()`); the GPU copies come from page-locked
memory where the driver allowed it (`Model.warnings` says what it refused, reported here).
From the two group rows, the share of the copy time prefetch hides, by the formula
benches/offload.py uses on virtual devices (`prefetch_hid`): 1 - (prefetch time - compute) /
copy time a token, compute being the time without prefetch less its copies.
`--cpu` rehearses on a `virtual:` device with the small model, without the peer.

    python benches/gpu/offload_e2e.py --device cuda:0 --out benches/results/gpu

Writes offload_e2e.md and offload_e2e.json in --out, and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import e2e  # noqa: E402  (the checkpoint, the budget and the transformers check are shared)
from offload import prefetch_hid  # noqa: E402  (the virtual-device bench's formula)

DECODE_TOKENS = 16
PROMPT = 16
REPEATS = 3
GPU_BYTES = "1GiB"
CPU_BYTES = "64GiB"

NO_PREFETCH = "weightlift, group of 2, no prefetch"
PREFETCH = "weightlift, group of 2, prefetch"
OURS: list[tuple[str, dict[str, Any]]] = [
    ("weightlift, offload=None", {}),
    ("weightlift, sequential", {"offload": "sequential"}),
    (NO_PREFETCH, {"offload": "group", "blocks_per_group": 2, "prefetch": False}),
    (PREFETCH, {"offload": "group", "blocks_per_group": 2}),
]
PEER = "accelerate (transformers bf16, device_map=auto)"


def decode_rate(step: Any, first: int) -> float:
    """Tokens per second of DECODE_TOKENS greedy steps, `step(token) -> next token`."""
    tok = first
    t = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        tok = step(tok)
    return DECODE_TOKENS / (time.perf_counter() - t)


def bench_ours(
    label: str,
    kw: dict[str, Any],
    path: Path,
    devices: tuple[str, str],
    ids: list[int],
    budget: e2e.Budget,
    gpu_bytes: str | None,
) -> dict[str, Any]:
    """`devices`: the inventory spec and the name of the device that stands for the GPU, given
    `gpu_bytes` of it through accelerate's `max_memory` (None: `kw` places the model)."""
    import weightlift as wl

    row: dict[str, Any] = {"engine": "weightlift", "label": label, "options": kw}
    m = None
    try:
        t0 = time.perf_counter()
        m = wl.Model(path, devices=devices[0], compute="fast")
        share = {}
        if gpu_bytes is not None:
            share = {"device_map": "auto", "max_memory": {devices[1]: gpu_bytes, "cpu": CPU_BYTES}}
        m.load(cache={"max_seq_len": PROMPT + DECODE_TOKENS, "dtype": "fp16"}, **share, **kw)
        row["load_s"] = time.perf_counter() - t0
        row["layers_on"] = {d: m.layer_devices.count(d) for d in set(m.layer_devices)}
        if m.plan is not None:
            gpu = next(u for u in m.plan.devices if u.name == devices[1])
            row["gpu_planned_bytes"] = gpu.weights + gpu.kv + gpu.scratch + gpu.overhead
        cache = m.cache
        loaded = m

        def step(tok: int) -> int:
            return int(loaded.forward([tok], cache=cache)[0].argmax())

        rates = []
        for r in range(REPEATS + 1):
            if r > 1 and not budget.allows(f"{label}: rounds {r}-{REPEATS}"):
                break
            cache.reset()
            first = int(m.forward(ids[:PROMPT], cache=cache)[-1].argmax())
            rate = decode_rate(step, first)
            if r > 0:  # the first round warms up (kernels, page cache, pins)
                rates.append(rate)
        row["decode_tok_s"] = statistics.median(rates) if rates else None
        row["samples"] = rates
        t = m.transfer_stats()
        row["copy_bytes_per_token"] = t["bytes"]
        row["copy_gb_s"] = t["bytes"] / t["seconds"] / 1e9 if t["seconds"] else None
        row["copy_s_per_token"] = t["seconds"]
        row["warnings"] = [w for w in m.warnings if "page-locked" in w]
    except Exception as e:  # the report names whatever the engine refused, and goes on
        row["error"] = f"{type(e).__name__}: {e}"
        e2e.say(f"{label}: {row['error']}")
    finally:
        if m is not None:
            m.close()
        m = None
        gc.collect()
    return row


def bench_peer(
    path: Path,
    device: str,
    ids: list[int],
    budget: e2e.Budget,
    gpu_bytes: str,
    model_class: str = "LlamaForCausalLM",
    label: str = PEER,
) -> dict[str, Any]:
    """accelerate's offload of the transformers `model_class` at `path`, `gpu_bytes` of the
    GPU through `max_memory`."""
    import torch
    import transformers

    row: dict[str, Any] = {"engine": "accelerate", "label": label}
    row["version"] = transformers.__version__
    index = e2e.device_index(device)
    dev = torch.device("cuda", index)
    model = None
    try:
        t0 = time.perf_counter()
        model = (
            getattr(transformers, model_class)
            .from_pretrained(
                path,
                dtype=torch.bfloat16,
                attn_implementation="sdpa",
                device_map="auto",
                max_memory={index: gpu_bytes, "cpu": CPU_BYTES},
            )
            .eval()
        )
        row["load_s"] = time.perf_counter() - t0
        placed = getattr(model, "hf_device_map", {})
        row["modules_on"] = {str(d): list(placed.values()).count(d) for d in set(placed.values())}
        rates = []
        with torch.inference_mode():
            for r in range(REPEATS + 1):
                if r > 1 and not budget.allows(f"{label}: rounds {r}-{REPEATS}"):
                    break
                out = model(input_ids=torch.tensor([ids[:PROMPT]], device=dev), use_cache=True)
                past = out.past_key_values

                def step(tok: int) -> int:
                    nonlocal past
                    o = model(
                        input_ids=torch.tensor([[tok]], device=dev),
                        past_key_values=past,
                        use_cache=True,
                    )
                    past = o.past_key_values
                    return int(o.logits[0, -1].argmax())

                rate = decode_rate(step, int(out.logits[0, -1].argmax()))
                if r > 0:
                    rates.append(rate)
        row["decode_tok_s"] = statistics.median(rates) if rates else None
        row["samples"] = rates
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        e2e.say(f"{label}: {row['error']}")
    finally:
        model = None
        gc.collect()
        torch.cuda.empty_cache()
    return row


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# Offload: decode with 1 GiB of GPU, the rest in host RAM",
        "",
        f"{res['machine']}; {res['checkpoint']['bytes'] / 2**30:.2f} GiB bf16 checkpoint, "
        f"{GPU_BYTES} for the GPU, {DECODE_TOKENS} decode tokens after {PROMPT}, median of "
        f"{REPEATS}.",
        "",
        "| engine | decode, tok/s | copied per token | copy rate | placement |",
        "|---|---:|---:|---:|---|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['error']} | | | |")
            continue
        rate = e2e.fmt(r.get("decode_tok_s"))
        copied = r.get("copy_bytes_per_token")
        copied_s = "" if copied is None else f"{copied / 2**20:.0f} MiB"
        gbs = r.get("copy_gb_s")
        gbs_s = "" if gbs is None else f"{gbs:.1f} GB/s"
        where = r.get("layers_on") or r.get("modules_on") or {}
        lines.append(f"| {r['label']} | {rate} | {copied_s} | {gbs_s} | {where} |")
    peer = next((r for r in res["rows"] if r["engine"] == "accelerate"), None)
    if peer and peer.get("decode_tok_s"):
        lines.append("")
        for r in res["rows"]:
            if r["engine"] == "weightlift" and r.get("decode_tok_s"):
                ratio = r["decode_tok_s"] / peer["decode_tok_s"]
                lines.append(f"- {r['label']}: **{ratio:.2f}x** accelerate")
    if (hid := res.get("prefetch_hid")) is not None:
        lines.append("")
        if hid["share"] is None:
            lines.append(
                f"- prefetch hides nothing here: the group of 2 copies "
                f"{hid['copied_bytes'] / 2**10:.0f} KiB a token without prefetch (the "
                "hidden-state rows; its groups stay resident)"
            )
        else:
            lines.append(
                f"- prefetch hides **{hid['share'] * 100:.0f} %** of the copy time (group of "
                f"2: {hid['copied_bytes'] / 2**20:.0f} MiB in {hid['copy_ms']:.2f} ms of "
                f"copies a token, {hid['sync_ms']:.2f} ms a token without prefetch, "
                f"{hid['prefetch_ms']:.2f} ms with)"
            )
    for r in res["rows"]:
        for w in r.get("warnings", []):
            lines.append(f"- {r['label']}: {w}")
    for s in res["skipped"]:
        lines.append(f"- skipped: {s}")
    return "\n".join(lines) + "\n"


def hidden_share(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The share of the copy time prefetch hides, from the group rows without and with
    prefetch (None unless both measured a rate). Its `share` is None where the row without
    prefetch copied less than a MiB a token: the hidden-state rows alone, its groups resident
    (as in the rehearsal's small model), so there is no copy time to hide."""
    by = {r["label"]: r for r in rows}
    sync, pre = by.get(NO_PREFETCH, {}), by.get(PREFETCH, {})
    if not (sync.get("decode_tok_s") and pre.get("decode_tok_s")):
        return None
    sync_ms, pre_ms = 1e3 / sync["decode_tok_s"], 1e3 / pre["decode_tok_s"]
    copy_ms = (sync.get("copy_s_per_token") or 0.0) * 1e3
    copied = sync.get("copy_bytes_per_token") or 0
    share = prefetch_hid(sync_ms, copy_ms, pre_ms) if copied >= 2**20 else None
    return {
        "share": share,
        "copied_bytes": copied,
        "copy_ms": copy_ms,
        "sync_ms": sync_ms,
        "prefetch_ms": pre_ms,
    }


def report(
    out: Path,
    name: str,
    markdown: Callable[[dict[str, Any]], str],
    device: str,
    info: dict[str, Any],
    rows: list[dict[str, Any]],
    budget: e2e.Budget,
    **figures: Any,
) -> int:
    """Writes a bench's `name`.json and `name`.md (its table, by `markdown`) in `out` and prints
    the table; `figures` go into both beside the rows. The exit status is 1 when a row
    failed."""
    res = {
        "machine": f"{platform.machine()}, {device}",
        "device": device,
        "checkpoint": info,
        "rows": rows,
        "skipped": budget.skipped,
        **figures,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    md = markdown(res)
    (out / f"{name}.md").write_text(md)
    print(md)
    return 1 if any("error" in r for r in rows) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--cpu", action="store_true", help="the rehearsal: a virtual device")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=120.0)
    a = ap.parse_args()
    global GPU_BYTES
    budget = e2e.Budget(a.budget_s)
    shape = e2e.SMALL if a.cpu else e2e.TINYLLAMA
    path, info = e2e.checkpoint(shape, e2e.checkpoint_root())
    device = a.device
    devices = (f"{device},cpu", device)
    if a.cpu:
        # a virtual device of a third of the small model's bytes stands for the GPU
        GPU_BYTES = f"{info['bytes'] // 3 // 2**10}KiB"
        device = "virtual:0"
        devices = (f"virtual:{GPU_BYTES},cpu", device)
    ids = [(7 + 13 * i) % shape["vocab_size"] for i in range(PROMPT)]
    rows = []
    for label, kw in OURS:
        e2e.say(f"{label} ...")
        rows.append(bench_ours(label, kw, path, devices, ids, budget, GPU_BYTES))
    if a.cpu:
        budget.skipped.append(f"{PEER}: no GPU in the rehearsal")
    elif (why := e2e.has_transformers()) is not None:
        budget.skipped.append(f"{PEER}: {why}")
    else:
        e2e.say(f"{PEER} ...")
        rows.append(bench_peer(path, device, ids, budget, GPU_BYTES))
    hid = hidden_share(rows)
    return report(a.out, "offload_e2e", markdown, device, info, rows, budget, prefetch_hid=hid)


if __name__ == "__main__":
    raise SystemExit(main())

"""Kernel profile of weightlift's decode and prefill on one GPU: which kernels a token costs,
how many launches, and how long each takes, recorded with torch.profiler (CUPTI sees every
kernel launched in this process, weightlift's included).

On the end-to-end bench's checkpoint (e2e.py makes it in WEIGHTLIFT_E2E_DIR and keeps it), for
each weight type: STEPS greedy decode steps after a SHORT-token prompt, and one PREFILL-token
prompt into an empty cache. Writes profile.md and profile.json in --out.

Decode steps replay a captured CUDA graph (the warm-up's steps captured it) unless
WEIGHTLIFT_CUDA_GRAPHS=0: CUPTI still sees each kernel of a replayed graph, so the launches
counted are the kernels a token runs, and the wall time against the kernel time is what the
graph saves on the host's launches.

    python benches/gpu/kernel_profile.py --device cuda:0 --out benches/results/gpu
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (the checkpoint and the weight types are the end-to-end bench's)

STEPS = 16
SHORT = 64
PREFILL = 512
TOP = 12


def is_device(ev: Any) -> bool:
    return str(getattr(ev, "device_type", None)) == "DeviceType.CUDA"


# A gap between two kernels at least this long is the host's turnaround between steps (or a
# wait within one), not the device's own latency from one kernel (or graph node) to the next.
LONG_GAP_US = 10.0


def host_side(prof: Any, per: int) -> dict[str, Any]:
    """Where a decode step's wall time beyond its kernels goes: the device's idle time between
    its kernels and copies (the union of their intervals against their span), split into gaps
    under LONG_GAP_US (kernel to kernel) and longer ones (the host's turnaround), and the host's
    CUDA API calls (driver and runtime, as CUPTI records them on the CPU side) by total time,
    all per step."""
    busy = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events() if is_device(ev))
    idle = short = 0.0
    long_gaps = 0
    if busy:
        end = busy[0][1]
        for s, e in busy[1:]:
            gap = max(0.0, s - end)
            idle += gap
            if gap < LONG_GAP_US:
                short += gap
            else:
                long_gaps += 1
            end = max(end, e)
    calls: dict[str, list[float]] = {}
    for ev in prof.events():
        if not is_device(ev) and ev.name.startswith("cu"):
            calls.setdefault(ev.name, []).append(ev.time_range.elapsed_us())
    api = [
        {"call": k, "calls_per": len(v) / per, "mean_us": sum(v) / len(v), "us_per": sum(v) / per}
        for k, v in calls.items()
    ]
    api.sort(key=lambda r: -r["us_per"])
    return {
        "device_idle_us_per_token": idle / per,
        "short_gaps_us_per_token": short / per,
        "long_gaps_per_token": long_gaps / per,
        "api": api[:TOP],
    }


def kernel_table(prof: Any, per: int) -> tuple[list[dict[str, Any]], float]:
    """Device kernels by total time: name, calls per unit, mean µs, share; and the total µs."""
    by: dict[str, list[float]] = {}
    for ev in prof.events():
        if not is_device(ev):
            continue
        by.setdefault(ev.name, []).append(ev.time_range.elapsed_us())
    total = sum(sum(v) for v in by.values())
    rows = [
        {
            "kernel": k,
            "calls_per": len(v) / per,
            "mean_us": sum(v) / len(v),
            "share": sum(v) / total if total else 0.0,
        }
        for k, v in by.items()
    ]
    rows.sort(key=lambda r: -r["share"])
    return rows, total


def profile_one(label: str, kw: dict[str, Any], path: Path, device: str, ids: list[int]) -> dict:
    import torch
    import weightlift as wl
    from torch.profiler import ProfilerActivity, profile

    res: dict[str, Any] = {"label": label}
    m = cache = None
    try:
        m = wl.Model(path, devices=device, compute="fast", **kw)
        cache = wl.Cache(m, max_seq_len=PREFILL + STEPS + SHORT, dtype="fp16")
        m.load(cache=cache)
        e2e.ours_forward(m, cache, ids[:SHORT], 4)  # compiles the kernels
        e2e.ours_forward(m, cache, ids[:PREFILL], 0)
        cache.reset()
        logits = m.forward(ids[:SHORT], cache=cache)
        # the host's side too (its CUDA calls), for where the wall time past the kernels goes
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(STEPS):
                logits = m.forward([int(logits[0].argmax())], cache=cache)
            wall = time.perf_counter() - t
        rows, total = kernel_table(prof, STEPS)
        res["decode"] = {
            "wall_us_per_token": wall / STEPS * 1e6,
            "kernel_us_per_token": total / STEPS,
            "launches_per_token": sum(r["calls_per"] for r in rows),
            "kernels": rows[:TOP],
            "host": host_side(prof, STEPS),
            "cuda_graph_counts": list(m.cuda_graph_counts()),
        }
        cache.reset()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            m.forward(ids[:PREFILL], cache=cache)
            wall = time.perf_counter() - t
        rows, total = kernel_table(prof, 1)
        res["prefill"] = {
            "wall_ms": wall * 1e3,
            "kernel_ms": total / 1e3,
            "launches": sum(r["calls_per"] for r in rows),
            "kernels": rows[:TOP],
        }
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        if cache is not None:
            cache.free()
        if m is not None:
            m.unload()
        gc.collect()
        torch.cuda.synchronize()
    return res


def markdown(header: str, results: list[dict[str, Any]]) -> str:
    graphs = os.environ.get("WEIGHTLIFT_CUDA_GRAPHS", "on (default)")
    out = ["# Kernel profile", "", header, "", f"WEIGHTLIFT_CUDA_GRAPHS={graphs}", ""]
    for r in results:
        out.append(f"## {r['label']}")
        out.append("")
        if "error" in r:
            out += [f"failed: {r['error']}", ""]
            continue
        d, p = r["decode"], r["prefill"]
        out.append(
            f"Decode after {SHORT} positions: {d['wall_us_per_token']:.0f} µs a token wall, "
            f"{d['kernel_us_per_token']:.0f} µs of kernels, {d['launches_per_token']:.0f} launches."
        )
        out += ["", "| kernel | calls/token | µs/call | share |", "|---|---:|---:|---:|"]
        for k in d["kernels"]:
            out.append(
                f"| `{k['kernel'][:60]}` | {k['calls_per']:.1f} | {k['mean_us']:.1f} | "
                f"{100 * k['share']:.0f} % |"
            )
        if "cuda_graph_counts" in d:
            c, r_, why = d["cuda_graph_counts"]
            out += ["", f"CUDA graphs since the load: {c} captured, {r_} replayed, refused: {why}."]
        h = d.get("host")
        if h:
            out += [
                "",
                f"The device idles {h['device_idle_us_per_token']:.0f} µs a token between its "
                f"kernels and copies: {h.get('short_gaps_us_per_token', 0):.0f} µs in gaps "
                f"under {LONG_GAP_US:.0f} µs (kernel to kernel), the rest in "
                f"{h.get('long_gaps_per_token', 0):.1f} longer ones a token (the host's "
                "turnaround). The host's CUDA calls a token:",
                "",
                "| call | calls/token | µs/call | µs/token |",
                "|---|---:|---:|---:|",
            ]
            for c in h["api"]:
                out.append(
                    f"| `{c['call'][:60]}` | {c['calls_per']:.1f} | {c['mean_us']:.1f} | "
                    f"{c['us_per']:.1f} |"
                )
        out += [
            "",
            f"Prefill of {PREFILL} tokens: {p['wall_ms']:.1f} ms wall, {p['kernel_ms']:.1f} ms of "
            f"kernels, {p['launches']:.0f} launches.",
            "",
            "| kernel | calls | µs/call | share |",
            "|---|---:|---:|---:|",
        ]
        for k in p["kernels"]:
            out.append(
                f"| `{k['kernel'][:60]}` | {k['calls_per']:.0f} | {k['mean_us']:.1f} | "
                f"{100 * k['share']:.0f} % |"
            )
        out.append("")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="", help="comma-separated labels (default: all)")
    args = ap.parse_args()
    path, _ = e2e.checkpoint(e2e.TINYLLAMA, e2e.checkpoint_root())
    ids = np.random.default_rng(e2e.SEED).integers(3, 32000, size=PREFILL + SHORT).tolist()
    wanted = {s for s in args.only.split(",") if s}
    results = []
    for label, kw in e2e.OURS:
        if wanted and label not in wanted:
            continue
        r = profile_one(label, kw, path, args.device, ids)
        results.append(r)
        print(f"{label}: {r.get('error') or 'done'}", flush=True)
    header = os.environ.get("WEIGHTLIFT_RUN_HEADER", time.strftime("Run %Y-%m-%d %H:%M"))
    md = markdown(header, results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.md").write_text(md)
    (args.out / "profile.json").write_text(json.dumps(results, indent=2) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

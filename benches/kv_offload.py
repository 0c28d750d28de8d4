"""Offloaded KV cache bench: what a decoded token costs when the cache lives in host RAM
(`Cache(offload=True)`, transformers' `OffloadedCache`) against the same cache on the device.

The demo model (SmolLM2-135M Q4_1, 30 layers) with every layer on a virtual device whose link
to the host is throttled to RATE (`virtual:512MiB@RATE`), so the copies of cache layers into
the device's two slots cost what they would over PCIe. Each run: a prompt of P tokens in one
forward call, then DECODE_TOKENS greedy single-token steps timed as one loop. The offloaded
cache copies, per layer and token, the rows written so far into a slot (the next layer's while
the current one computes, on the cache's prefetch thread), and writes each new row to host
RAM. Reported: ms per decoded token for both caches and their ratio (the baseline is the
on-device cache measured in the same rounds), and the bytes the offloaded cache copied in the
last decode step (`Model.transfer_stats()`, less the on-device run's hidden-state copies).
Medians of REPEAT interleaved rounds. The logits of both caches are checked equal first.

Run with a weightlift build in the current Python (`make build` or a release wheel):

    .venv/bin/python benches/kv_offload.py

Writes benches/results/kv_offload.json and benches/results/kv_offload.md.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time

import numpy as np
import weightlift as wl
from offload import DEMO, PROMPT, REPEAT, RESULTS, THREADS

RATES = ("16GB/s", "4GB/s")
PROMPTS = (64, 1024)
N_CTX = 2048
DECODE_TOKENS = 16


def decode(m: wl.Model, cache: wl.Cache, prompt: list[int]) -> tuple[float, int]:
    """ms per decoded token after `prompt`, and the bytes the last step copied."""
    cache.reset()
    row = m.forward(prompt, cache=cache)
    ids = [int(row[0].argmax())]
    t = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        row = m.forward(ids[-1:], cache=cache)
        ids.append(int(row[0].argmax()))
    return (time.perf_counter() - t) * 1e3 / DECODE_TOKENS, m.transfer_stats()["bytes"]


def main() -> None:
    rows = []
    for rate in RATES:
        m = wl.load_gguf(
            DEMO,
            n_ctx=64,
            n_threads=THREADS,
            devices=f"virtual:512MiB@{rate},cpu",
            n_gpu_layers=-1,
        )
        caches = {
            "on device": wl.Cache(m, max_seq_len=N_CTX),
            "offloaded": wl.Cache(m, max_seq_len=N_CTX, offload=True),
        }
        want = m.forward(PROMPT, cache=caches["on device"], logits="all")
        got = m.forward(PROMPT, cache=caches["offloaded"], logits="all")
        assert np.array_equal(want, got), "offloaded cache changed the logits"
        for p in PROMPTS:
            prompt = (PROMPT * (p // len(PROMPT) + 1))[:p]
            samples: dict[str, list[tuple[float, int]]] = {name: [] for name in caches}
            for r in range(REPEAT + 1):
                order = list(caches) if r % 2 == 0 else list(reversed(caches))
                for name in order:
                    got = decode(m, caches[name], prompt)
                    if r > 0:  # the first round warms up
                        samples[name].append(got)
            med = {name: statistics.median(s[0] for s in ss) for name, ss in samples.items()}
            moved = {name: samples[name][-1][1] for name in caches}
            rows.append(
                {
                    "rate": rate,
                    "prompt": p,
                    "on_device_ms": med["on device"],
                    "offloaded_ms": med["offloaded"],
                    "ratio": med["offloaded"] / med["on device"],
                    "offloaded_bytes_per_token": moved["offloaded"] - moved["on device"],
                }
            )
            print(f"[kv offload bench] {rate} {p}-token prompt: {rows[-1]}", flush=True)
    info = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": THREADS,
        "repeat": REPEAT,
        "n_ctx": N_CTX,
        "decode_tokens": DECODE_TOKENS,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_offload.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    lines = [
        "# Offloaded KV cache: decode cost",
        "",
        f"{info['date']}, {info['cpus']} CPUs, {THREADS} threads, SmolLM2-135M Q4_1 on "
        f"`virtual:512MiB@RATE`, cache of {N_CTX} positions, {DECODE_TOKENS} decoded tokens "
        f"after the prompt, medians of {REPEAT} interleaved rounds. Logits of both caches "
        "checked equal.",
        "",
        "| link | prompt | on-device cache ms/token | offloaded cache ms/token | ratio "
        "| cache bytes copied per token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['prompt']} | {r['on_device_ms']:.2f} | "
            f"{r['offloaded_ms']:.2f} | {r['ratio']:.2f}x | "
            f"{r['offloaded_bytes_per_token'] / 2**20:.2f} MiB |"
        )
    (RESULTS / "kv_offload.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Offloaded-execution bench: what each `offload` mode moves per token and what a token costs,
on virtual devices whose link to the host is throttled (`virtual:96MiB@RATE`) so that copies
take what they would over PCIe.

The demo model (SmolLM2-135M Q4_1, 30 layers) with its last 10 layers on the virtual device
(`n_gpu_layers=10`) and the first 20 kept on the cpu. Modes:

  none                 offload=None: the cpu computes the 20 kept layers (nothing is copied
                       but the hidden state)
  sequential           one layer at a time copied in, then run, no prefetch
  group (no prefetch)  4 layers at a time, copied synchronously
  group (prefetch)     4 layers at a time, the next group copied by a background copier while
                       the current one computes

For each link rate, three runs: decode (a greedy single-token forward after an 11-token
prompt, DECODE_TOKENS steps timed as one loop: little compute per group, so the copies
dominate), and prompts of 64 and 512 tokens in one forward call (more compute per group; at
512 tokens a group computes longer than its copy takes on every link here). Reported per
token: ms, the bytes copied and the seconds those copies took (`Model.transfer_stats()` of the
last call), and `hidden` = 1 - (prefetch time - compute time) / copy time: the share of the
copy time prefetch hid behind compute, where compute time is the synchronous group's time
minus its copy time. Beside it, per forward call, one group's copy and compute (offload=None's
time for the 20 kept layers, a 20/30 share of the call, over the 5 groups; an estimate) and the
most prefetch can hide: the first group is copied before anything computes, and the others
only as far as their predecessor's compute covers them, so
`bound = (groups - 1) / groups * min(1, compute / copy)`. Medians of REPEAT interleaved rounds,
all modes in each round. The logits of every mode are checked equal to offload=None's first.

Run with a weightlift build in the current Python (`make build` or a release wheel):

    .venv/bin/python benches/offload.py

Writes benches/results/offload.json and benches/results/offload.md.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
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
REPEAT = int(os.environ.get("WEIGHTLIFT_BENCH_REPEAT", "5"))
RATES = ("16GB/s", "4GB/s", "1GB/s")
DECODE_TOKENS = 16
THREADS = 2
PROMPT = [1, 504, 3575, 282, 4649, 314, 253, 1789, 8760, 30, 198]
PROMPTS = (64, 512)
N_CTX = 640
GROUPS = 5  # the 20 kept layers, 4 per group
KEPT_SHARE = 20 / 30  # of a forward call's layers
MODES = {
    "none": {},
    "sequential": {"offload": "sequential"},
    "group (no prefetch)": {"offload": "group", "blocks_per_group": 4, "prefetch": False},
    "group (prefetch)": {"offload": "group", "blocks_per_group": 4, "prefetch": True},
}


def prefetch_hid(sync_ms: float, sync_copy_ms: float, prefetch_ms: float) -> float:
    """The share of the copy time prefetch hid behind compute, from a synchronous run (its time
    and the time its copies took) and the same run with prefetch, all per token:
    `1 - (prefetch - compute) / copy`, where compute is the synchronous time less its copies.
    NaN where nothing was copied. `benches/gpu/offload_e2e.py` reports it on a GPU."""
    if sync_copy_ms <= 0:
        return float("nan")
    compute = sync_ms - sync_copy_ms
    return 1 - (prefetch_ms - compute) / sync_copy_ms


def load(rate: str, kw: dict) -> wl.Model:
    return wl.load_gguf(
        DEMO,
        n_ctx=N_CTX,
        n_threads=THREADS,
        devices=f"virtual:96MiB@{rate},cpu",
        n_gpu_layers=10,
        **kw,
    )


def prompt_of(tokens: int):
    """A run: ms per token of a `tokens`-token prompt in one forward call, and its stats."""
    ids = (PROMPT * (tokens // len(PROMPT) + 1))[:tokens]

    def run(m: wl.Model) -> tuple[float, dict]:
        cache = wl.Cache(m, max_seq_len=N_CTX)
        t = time.perf_counter()
        m.forward(ids, cache=cache)
        return (time.perf_counter() - t) * 1e3 / len(ids), m.transfer_stats()

    return run


def decode(m: wl.Model) -> tuple[float, dict]:
    """ms per decoded token, and the last step's transfer stats."""
    logits = m.forward(PROMPT)
    ids = [int(logits[0].argmax())]
    cache = wl.Cache(m, max_seq_len=N_CTX)
    m.forward(PROMPT, cache=cache)
    t = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        row = m.forward(ids[-1:], cache=cache)
        ids.append(int(row[0].argmax()))
    ms = (time.perf_counter() - t) * 1e3 / DECODE_TOKENS
    return ms, m.transfer_stats()


def main() -> None:
    rows = []
    for rate in RATES:
        models = {name: load(rate, kw) for name, kw in MODES.items()}
        want = models["none"].forward(PROMPT, logits="all")
        for name, m in models.items():
            assert np.array_equal(m.forward(PROMPT, logits="all"), want), name
        runs = [("decode", 1, decode)]
        runs += [(f"{n}-token prompt", n, prompt_of(n)) for n in PROMPTS]
        for what, per, run in runs:
            samples: dict[str, list[tuple[float, dict]]] = {name: [] for name in MODES}
            for r in range(REPEAT + 1):
                order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
                for name in order:
                    got = run(models[name])
                    if r > 0:  # the first round warms up
                        samples[name].append(got)
            med = {
                name: {
                    "ms_per_token": statistics.median(s[0] for s in ss),
                    "bytes_per_token": statistics.median(s[1]["bytes"] for s in ss) / per,
                    "copy_ms_per_token": statistics.median(s[1]["seconds"] * 1e3 for s in ss) / per,
                }
                for name, ss in samples.items()
            }
            sync, pre = med["group (no prefetch)"], med["group (prefetch)"]
            hidden = prefetch_hid(
                sync["ms_per_token"], sync["copy_ms_per_token"], pre["ms_per_token"]
            )
            copy_group = sync["copy_ms_per_token"] * per / GROUPS
            compute_group = med["none"]["ms_per_token"] * per * KEPT_SHARE / GROUPS
            bound = (GROUPS - 1) / GROUPS * min(1.0, compute_group / copy_group)
            for name, v in med.items():
                rows.append({"rate": rate, "what": what, "mode": name, **v})
            rows.append(
                {
                    "rate": rate,
                    "what": what,
                    "mode": "prefetch hid",
                    "hidden": hidden,
                    "bound": bound,
                    "copy_ms_per_group": copy_group,
                    "compute_ms_per_group": compute_group,
                }
            )
        print(f"[offload bench] {rate}: done", flush=True)
    info = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "weightlift": wl.__file__,
        "threads": THREADS,
        "repeat": REPEAT,
        "decode_tokens": DECODE_TOKENS,
        "loadavg": os.getloadavg(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "offload.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    lines = [
        "# Offloaded execution bench (virtual devices with a throttled link)",
        "",
        f"SmolLM2-135M Q4_1, last 10 layers on `virtual:96MiB@RATE`, the first 20 kept on the "
        f"cpu; {THREADS} threads; decode after an 11-token prompt, {DECODE_TOKENS} steps, and "
        f"prompts of {' and '.join(map(str, PROMPTS))} tokens; "
        f"medians of {REPEAT} interleaved rounds; {info['date']}, load average "
        f"{info['loadavg'][0]:.2f} (the machine is shared; expect noise). Logits of every mode "
        "equal offload=None's, checked before timing. `prefetch hid`: the share of the copy "
        "time hidden, against the most that can be (bound), with one group's copy and "
        "(estimated) compute per forward call.",
        "",
        "| link | run | mode | ms / token | MB copied / token | copy ms / token |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in rows:
        if row["mode"] == "prefetch hid":
            lines.append(
                f"| {row['rate']} | {row['what']} | prefetch hid | "
                f"{row['hidden'] * 100:.0f} % of the copy time "
                f"(bound {row['bound'] * 100:.0f} %) | "
                f"group: copy {row['copy_ms_per_group']:.2f} ms | "
                f"compute {row['compute_ms_per_group']:.2f} ms |"
            )
        else:
            lines.append(
                f"| {row['rate']} | {row['what']} | {row['mode']} | {row['ms_per_token']:.2f} | "
                f"{row['bytes_per_token'] / 1e6:.1f} | {row['copy_ms_per_token']:.2f} |"
            )
    (RESULTS / "offload.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

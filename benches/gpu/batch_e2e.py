"""Batched decode on one device: the aggregate decode rate of N sequences stepped together
(`Model.forward_batch`, one call a step, every product shared by the N tokens) against one
sequence alone, on the end-to-end bench's checkpoint (e2e.py makes it and keeps it).

For each weight type (bf16 as stored, q4_k quantised on load), fast mode, an fp16 cache of
MAX_SEQ positions per sequence: every batch size in SEQUENCES gets a distinct PROMPT-token prompt
per sequence (all prompts in one forward_batch call, untimed), then DECODE_TOKENS greedy steps of
all of them, timed as a whole. The rate is sequences x steps / seconds; the ratio is against the
batch of 1 in the same row (the same model, the same call). Medians of REPEATS rounds after one
untimed warm-up round of each size (which compiles the kernels and records the CUDA graphs).
This is what `weightlift serve --parallel N` asks of the device at each step.

    python benches/gpu/batch_e2e.py --device cuda:0 --out benches/results/gpu
    python benches/gpu/batch_e2e.py --cpu --out /tmp/batch

Writes batch_e2e.md and batch_e2e.json in --out, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (the checkpoint, the budget and the weight types are the end-to-end bench's)

SEQUENCES = (1, 2, 4, 8, 16, 32)
PROMPT = 64
DECODE_TOKENS = 32
MAX_SEQ = PROMPT + DECODE_TOKENS + 32
REPEATS = 3
LABELS = ("bf16", "q4_k")


def round_of(m: Any, caches: list[Any], prompts: list[list[int]]) -> float:
    """Every prompt in one call, then DECODE_TOKENS steps of all sequences: the steps' seconds."""
    for c in caches:
        c.reset()
    rows = m.forward_batch(list(zip(caches, prompts, strict=True)))
    t = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        rows = m.forward_batch([(c, [int(r.argmax())]) for c, r in zip(caches, rows, strict=True)])
    return time.perf_counter() - t


def bench_row(label: str, kw: dict[str, Any], path: Path, device: str, budget: e2e.Budget) -> dict:
    import weightlift as wl

    row: dict[str, Any] = {"label": label, "options": kw, "sizes": {}}
    try:
        m = wl.Model(path, devices=device, compute="fast", **kw)
        first = wl.Cache(m, max_seq_len=MAX_SEQ, dtype="fp16")
        m.load(cache=first)
        caches = [first] + [
            wl.Cache(m, max_seq_len=MAX_SEQ, dtype="fp16") for _ in range(max(SEQUENCES) - 1)
        ]
        rng = np.random.default_rng(e2e.SEED)
        prompts = [rng.integers(3, 32000, size=PROMPT).tolist() for _ in caches]
        for n in SEQUENCES:
            if not budget.allows(f"batch {label} x{n}"):
                continue
            round_of(m, caches[:n], prompts[:n])  # warm-up: kernels, graphs
            rates = []
            for r in range(REPEATS):
                if r > 0 and not budget.allows(f"batch {label} x{n}: rounds {r + 1}-{REPEATS}"):
                    break
                rates.append(n * DECODE_TOKENS / round_of(m, caches[:n], prompts[:n]))
            row["sizes"][str(n)] = {"samples": rates, "tok_s": e2e.median(rates)}
            e2e.say(f"  {label} x{n}: {e2e.fmt(e2e.median(rates))} tok/s")
        row["cuda_graphs"] = m.cuda_graphs
    except Exception as e:  # noqa: BLE001  (a failed row is reported, the others still run)
        row["error"] = f"{type(e).__name__}: {e}"
        e2e.say(f"  {label}: failed: {row['error']}")
    return row


def markdown(res: dict[str, Any]) -> str:
    sizes = [str(n) for n in SEQUENCES]
    lines = [
        f"# Batched decode ({res['device']})",
        "",
        res["header"],
        "",
        f"{res['shape_name']}; fast mode, fp16 cache; {PROMPT}-token prompts, "
        f"{DECODE_TOKENS} greedy steps of every sequence, `Model.forward_batch` one call a step; "
        f"aggregate tok/s, median of {REPEATS}; the ratio is against 1 sequence in the same row.",
        "",
        "| weights | "
        + " | ".join(f"{n} seq, tok/s" for n in sizes)
        + " | "
        + " | ".join(f"{n} / 1" for n in sizes[1:])
        + " |",
        "|---|" + "---:|" * (2 * len(sizes) - 1),
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['error']} |")
            continue
        got = {n: r["sizes"].get(n, {}).get("tok_s") for n in sizes}
        ratios = [e2e.fmt(got[n] / got["1"], 2) if got[n] and got["1"] else "" for n in sizes[1:]]
        lines.append(
            f"| {r['label']} | "
            + " | ".join(e2e.fmt(got[n]) for n in sizes)
            + " | "
            + " | ".join(ratios)
            + " |"
        )
    for s in res["skipped"]:
        lines.append(f"\n- skipped: {s}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--cpu", action="store_true", help="the rehearsal: cpu, smaller model")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=60.0)
    args = ap.parse_args()
    device = "cpu" if args.cpu else args.device
    shape, shape_name = (
        (e2e.SMALL, "the --cpu rehearsal's small shape")
        if args.cpu
        else (e2e.TINYLLAMA, "TinyLlama-1.1B's shape")
    )
    path, ck = e2e.checkpoint(shape, e2e.checkpoint_root())
    budget = e2e.Budget(args.budget_s)
    rows = []
    for label, kw in e2e.OURS:
        if label not in LABELS or not budget.allows(f"batch {label}"):
            continue
        e2e.say(f"batched decode, {label} on {device}")
        rows.append(bench_row(label, kw, path, device, budget))
    res = {
        "header": os.environ.get("WEIGHTLIFT_RUN_HEADER", f"Run {time.strftime('%Y-%m-%d %H:%M')}"),
        "device": device,
        "shape_name": shape_name,
        "checkpoint": ck,
        "rows": rows,
        "skipped": budget.skipped,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch_e2e.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    (args.out / "batch_e2e.md").write_text(md)
    e2e.say("\n" + md)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

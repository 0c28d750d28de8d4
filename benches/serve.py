"""Server throughput bench: `weightlift serve --parallel 8` against `--parallel 1`, the same
server binary and model, measured in the same run.

Each round starts a server, sends it REQUESTS completions from CLIENTS concurrent clients (the
official `openai` client over 127.0.0.1, no streaming, greedy, a bias against the end-of-text
tokens so every reply runs to `max_tokens`), and takes the aggregate decode rate: generated
tokens over the wall time of the whole load. Rounds alternate between the two settings, and
each figure is the median of ROUNDS rounds.

Writes benches/results/serve.json and benches/results/serve.md. Build the extension in release
first (`make build-release`).

Environment: WEIGHTLIFT_DEMO_GGUF (the demo model), WEIGHTLIFT_BENCH_ROUNDS (3),
WEIGHTLIFT_BENCH_THREADS (2).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"
MODEL = Path(
    os.environ.get("WEIGHTLIFT_DEMO_GGUF", ROOT / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
)
ROUNDS = int(os.environ.get("WEIGHTLIFT_BENCH_ROUNDS", "3"))
THREADS = os.environ.get("WEIGHTLIFT_BENCH_THREADS", "2")
CLIENTS = 16
REQUESTS = 32
MAX_TOKENS = 64
SETTINGS = (1, 8)
# <|endoftext|> and <|im_end|> of the demo model, biased away so replies run to max_tokens.
NO_EOS = {"0": -100, "2": -100}
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "Write a list of fruits:",
    "The three primary colours are",
    "In the beginning",
    "A recipe for bread:",
    "The history of Rome",
    "Dear diary,",
]


def start(parallel: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    exe = Path(sys.executable).with_name("weightlift")
    cmd = [
        str(exe),
        "serve",
        str(MODEL),
        "--port",
        "0",
        "-t",
        THREADS,
        "--ctx",
        "512",
        "--model-alias",
        "bench",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--parallel", str(parallel), "--queue", str(REQUESTS)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if m:
            url = m.group(1)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the server did not start:\n{log.read_text()}")


def load(url: str) -> tuple[int, float]:
    """Generated tokens and the wall seconds of the whole load."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

    def one(i: int) -> int:
        out = client.completions.create(
            model="bench",
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logit_bias=NO_EOS,
        )
        assert out.usage is not None
        return out.usage.completion_tokens

    # one request first, so the model's pages are in and the first round is not penalised
    one(0)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        tokens = sum(pool.map(one, range(REQUESTS)))
    return tokens, time.perf_counter() - t0


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rates: dict[int, list[float]] = {p: [] for p in SETTINGS}
    log = RESULTS / ".serve-bench.log"
    for r in range(ROUNDS):
        for parallel in SETTINGS:
            proc, url = start(parallel, log)
            try:
                tokens, secs = load(url)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
            rates[parallel].append(tokens / secs)
            print(
                f"round {r + 1}: --parallel {parallel}: {tokens} tokens in {secs:.2f} s "
                f"= {tokens / secs:.1f} tok/s",
                flush=True,
            )
    log.unlink(missing_ok=True)
    med = {p: statistics.median(v) for p, v in rates.items()}
    ratio = med[8] / med[1]
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "model": MODEL.name,
        "threads": int(THREADS),
        "clients": CLIENTS,
        "requests": REQUESTS,
        "max_tokens": MAX_TOKENS,
        "rounds": ROUNDS,
        "tok_s": {str(p): v for p, v in rates.items()},
        "median_tok_s": {str(p): v for p, v in med.items()},
        "ratio_8_over_1": ratio,
    }
    (RESULTS / "serve.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        "# Server throughput: --parallel 8 against --parallel 1",
        "",
        f"{result['date']}, {result['machine']}; {MODEL.name}, fast compute, "
        f"{THREADS} threads; {REQUESTS} completions of {MAX_TOKENS} tokens from {CLIENTS} "
        f"concurrent clients; median of {ROUNDS} rounds (same run, alternating).",
        "",
        "| server | aggregate decode, tok/s | rounds |",
        "|---|---:|---|",
    ]
    for p in SETTINGS:
        runs = ", ".join(f"{v:.1f}" for v in rates[p])
        md.append(f"| `--parallel {p}` | {med[p]:.1f} | {runs} |")
    md += ["", f"**--parallel 8 / --parallel 1: {ratio:.2f}x**", ""]
    (RESULTS / "serve.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""Peer comparisons run from Python, each against a baseline measured in the same run.

Writes benches/results/python_peers.json and prints a Markdown table. Medians throughout,
because these machines are noisy.

  open + validate of the demo GGUF      vs gguf.GGUFReader
  open of a safetensors checkpoint      vs safetensors.safe_open
  check_tensors scan throughput         vs a plain read of the same bytes
  dequantisation to float32             vs gguf.quants.dequantize
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import weightlift as wl
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
DEMO = Path(
    os.environ.get(
        "WEIGHTLIFT_DEMO_GGUF", ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
)
# The reference pack as `make reference` lays it out.
REFERENCE = Path(os.environ.get("WEIGHTLIFT_REFERENCE") or ROOT / ".cache" / "reference")


def median_seconds(fn, *, repeat: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_open_gguf(rows: list[dict]) -> None:
    ours = median_seconds(lambda: wl.open(DEMO).close(), repeat=50)
    peer = median_seconds(lambda: gguf.GGUFReader(DEMO), repeat=5)
    rows.append(
        {
            "what": "open + validate SmolLM2 GGUF (98 MB, 272 tensors)",
            "ours_ms": ours * 1e3,
            "peer": "gguf.GGUFReader",
            "peer_ms": peer * 1e3,
            "speedup": peer / ours,
        }
    )


def bench_open_safetensors(rows: list[dict]) -> None:
    for label, path in [
        ("single file", REFERENCE / "tiny-llama" / "safetensors" / "model.safetensors"),
        ("3 shards + index", REFERENCE / "tiny-llama" / "safetensors-sharded"),
    ]:
        if not path.exists():
            continue
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))

        def peer(files=files):
            for f in files:
                with safe_open(f, framework="numpy") as h:
                    h.keys()

        ours = median_seconds(lambda p=path: wl.open(p).close(), repeat=50)
        theirs = median_seconds(peer, repeat=50)
        rows.append(
            {
                "what": f"open tiny-llama safetensors ({label})",
                "ours_ms": ours * 1e3,
                "peer": "safetensors.safe_open",
                "peer_ms": theirs * 1e3,
                "speedup": theirs / ours,
            }
        )


def bench_check_tensors(rows: list[dict]) -> None:
    size = DEMO.stat().st_size
    DEMO.read_bytes()  # page-cache the file
    ours = median_seconds(lambda: wl.open(DEMO, check_tensors=True).close(), repeat=10)
    base = median_seconds(lambda: wl.open(DEMO).close(), repeat=10)
    scanned = sum(t.nbytes for t in wl.open(DEMO).tensors)
    rows.append(
        {
            "what": "check_tensors scan of SmolLM2 (page-cached)",
            "ours_ms": (ours - base) * 1e3,
            "gb_per_s": scanned / max(ours - base, 1e-9) / 1e9,
            "threads": os.cpu_count(),
            "file_bytes": size,
        }
    )


def bench_dequantize(rows: list[dict]) -> None:
    reader = gguf.GGUFReader(DEMO)
    ckpt = wl.open(DEMO)
    for ttype in ("Q4_1", "Q8_0"):
        t = next(
            t for t in reader.tensors if t.tensor_type.name == ttype and t.n_elements > 500_000
        )
        raw = np.array(t.data)
        ours = median_seconds(lambda name=t.name: ckpt.dequantize(name), repeat=10)
        out = np.empty(ckpt[t.name].shape, dtype=np.float32)
        into = median_seconds(
            lambda name=t.name, out=out: ckpt.dequantize(name, out=out), repeat=10
        )
        peer = median_seconds(
            lambda raw=raw, tt=t.tensor_type: gguf.quants.dequantize(raw, tt), repeat=3
        )
        what = f"dequantize {ttype} '{t.name}' ({t.n_elements:,} values) to f32"
        for label, secs in (("new array", ours), ("into out=", into)):
            rows.append(
                {
                    "what": f"{what}, {label}",
                    "ours_ms": secs * 1e3,
                    "peer": "gguf.quants.dequantize",
                    "peer_ms": peer * 1e3,
                    "speedup": peer / secs,
                }
            )


def q4_k_fixture(path: Path) -> None:
    """A 4096 x 4096 Q4_K tensor of random blocks with finite f16 scales, written by gguf-py."""
    rng = np.random.default_rng(0)
    n_blocks = 4096 * 4096 // 256
    blocks = rng.integers(0, 256, size=(n_blocks, 144), dtype=np.uint8)
    scales = rng.uniform(-0.01, 0.01, size=(n_blocks, 2)).astype(np.float16)
    blocks[:, :4] = scales.view(np.uint8).reshape(n_blocks, 4)  # d and dmin lead the block
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor(
        "w", blocks.reshape(4096, 4096 // 256 * 144), raw_dtype=gguf.GGMLQuantizationType.Q4_K
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def bench_dequantize_q4_k(rows: list[dict], tmp: Path) -> None:
    path = tmp / "q4_k_4096.gguf"
    q4_k_fixture(path)
    t = gguf.GGUFReader(path).tensors[0]
    raw = np.array(t.data)
    ckpt = wl.open(path)
    ours = median_seconds(lambda: ckpt.dequantize("w"), repeat=10)
    out = np.empty(ckpt["w"].shape, dtype=np.float32)
    into = median_seconds(lambda: ckpt.dequantize("w", out=out), repeat=10)
    peer = median_seconds(lambda: gguf.quants.dequantize(raw, t.tensor_type), repeat=3)
    for label, secs in (("new array", ours), ("into out=", into)):
        rows.append(
            {
                "what": f"dequantize Q4_K 4096 x 4096 (random blocks) to f32, {label}",
                "ours_ms": secs * 1e3,
                "peer": "gguf.quants.dequantize",
                "peer_ms": peer * 1e3,
                "speedup": peer / secs,
            }
        )


def main() -> int:
    if not DEMO.exists():
        print(f"demo model missing at {DEMO}; run `make demo-model`", file=sys.stderr)
        return 1
    rows: list[dict] = []
    for bench in (bench_open_gguf, bench_open_safetensors, bench_check_tensors, bench_dequantize):
        bench(rows)
    with tempfile.TemporaryDirectory() as tmp:
        bench_dequantize_q4_k(rows, Path(tmp))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    (RESULTS / "python_peers.json").write_text(json.dumps(out, indent=2) + "\n")
    print("| what | ours | peer | peer time | ratio |")
    print("|---|---:|---|---:|---:|")
    for r in rows:
        if "peer" in r:
            print(
                f"| {r['what']} | {r['ours_ms']:.2f} ms | {r['peer']} | {r['peer_ms']:.2f} ms "
                f"| {r['speedup']:.1f}x |"
            )
        else:
            print(f"| {r['what']} | {r['ours_ms']:.2f} ms | — | — | {r['gb_per_s']:.1f} GB/s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

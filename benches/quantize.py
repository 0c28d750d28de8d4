"""Quantise-on-load bench: what `quantize=` costs at load and what it does to the logits.

Rows:

  1. load time      a synthetic ~1 GB bf16 llama safetensors checkpoint (random weights) loaded
                    onto cpu with each `quantize=` mode, against the same load without it
                    (`use_mmap=False`: the bf16 bytes read into owned memory) and a plain
                    `read()` of the file, timed in the same rounds (page cache warm); GB/s are
                    checkpoint bytes per second
  2. peak host RAM  the same loads in a fresh process each: peak anonymous RSS during the load
                    beyond the anonymous RSS held when it returns, against the staging buffers
                    (2 × 4 MiB)
  3. logits         each mode against the f32 forward pass of the same weights, exact compute
                    and an f32 cache: max|Δ| of the logits, argmax agreement, and perplexity on
                    a fixed text (next-token NLL over its ids):
                      - tiny-llama (the reference pack's bf16 safetensors), the 16
                        reference ids, f32 = transformers' `hf_logits.npy`;
                      - SmolLM2-135M as an F32 GGUF (the demo Q4_1 file dequantised by gguf-py,
                        written to .cache/bench/), the reference's second prompt (41 ids);
                        f32 = transformers on the dequantised file (`hf_logits_2_rows.npy`,
                        11 of its positions).

Quantise throughput per kernel (GB/s of input, 1 and 2 threads) is in benches/results/kernels.md
(`quantize_*` and `int8_quantize_*` rows of `cargo bench --bench kernels`).

Run with a release build (see benches/decode.py for the venv):

    .cache/bench/wl-venv/bin/python benches/quantize.py

Writes benches/results/quantize.json and quantize.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from engine_load import llama_config, llama_shapes

REPO = Path(__file__).resolve().parents[1]
# The reference pack as `make reference` lays it out.
REFERENCE = Path(os.environ.get("WEIGHTLIFT_REFERENCE") or REPO / ".cache" / "reference")
BENCH_DIR = REPO / ".cache" / "bench"
SYNTH = BENCH_DIR / "synthetic-llama-bf16-1g"
SMOL_F32 = BENCH_DIR / "SmolLM2-135M-Instruct.F32.gguf"
DEMO = Path(
    os.environ.get(
        "WEIGHTLIFT_DEMO_GGUF", REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
)
RESULTS = REPO / "benches" / "results"
MODES = ["int8", "q8_0", "q6_k", "q4_k"]
REPEAT = int(os.environ.get("WEIGHTLIFT_BENCH_REPEAT", "3"))
GB = 1e9


# ---------------------------------------------------------------------------------------------
# fixtures


def write_synthetic(directory: Path, n_layers: int = 9) -> Path:
    """A llama checkpoint of random bf16 weights (1.05 GB with 9 layers), written by hand:
    numpy has no bfloat16, so the header is the safetensors layout itself."""
    cfg = {**llama_config(n_layers), "torch_dtype": "bfloat16"}
    shapes = llama_shapes(cfg)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    target = directory / "model.safetensors"
    rng = np.random.default_rng(0)
    with open(target, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                values = np.ones(shape, dtype=np.float32)
            else:
                values = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
            out.write((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    return target


def copy_gguf_metadata(reader, writer, skip: frozenset[str] = frozenset()) -> None:
    """Every key of gguf-py's `reader` but the file's own (`GGUF.*`), the architecture (the
    writer's) and `skip`, into `writer`, with its type."""
    import gguf

    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture" or name in skip:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                value = [str(bytes(field.parts[i]), "utf-8") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(name, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, str(bytes(field.parts[-1]), "utf-8"))
        else:
            writer.add_key_value(name, field.parts[-1].tolist()[0], kind)


def write_smollm2_f32(path: Path) -> None:
    """The demo model with every tensor dequantised to F32 by gguf-py, metadata kept."""
    import gguf

    reader = gguf.GGUFReader(DEMO)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = gguf.GGUFWriter(path, arch)
    copy_gguf_metadata(reader, writer)
    if "general.file_type" not in reader.fields:
        writer.add_file_type(0)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------------------------------------
# load time and RSS


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as h:
        for line in h:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child(mode: str, path: str) -> None:
    """One load in this process: prints seconds, peak anonymous RSS and the weights held."""
    import weightlift as wl

    base = _status_kib("RssAnon")
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _status_kib("RssAnon"))
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    m = wl.Model(path, quantize=None if mode == "none" else mode)
    m.load(use_mmap=False)
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    now = _status_kib("RssAnon")
    peak_anon = (max(peak[0], now) - base) * 1024
    held_anon = (now - base) * 1024
    held = m.memory()["cpu"]
    print(
        json.dumps(
            {
                "mode": mode,
                "seconds": seconds,
                "peak_anon": peak_anon,
                "held_anon": held_anon,
                "held": held,
            }
        )
    )


def run_child(mode: str, path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_load(path: Path) -> list[dict]:
    size = path.stat().st_size
    times: dict[str, list[float]] = {m: [] for m in ["read", "none", *MODES]}
    peaks: dict[str, list[dict]] = {m: [] for m in ["none", *MODES]}
    for r in range(REPEAT):
        order = ["read", "none", *MODES]
        if r % 2:
            order.reverse()
        for mode in order:
            if mode == "read":
                t0 = time.perf_counter()
                with open(path, "rb") as h:
                    h.read()
                times[mode].append(time.perf_counter() - t0)
                continue
            res = run_child(mode, path.parent)
            times[mode].append(res["seconds"])
            peaks[mode].append(res)
    rows = []
    base = statistics.median(times["none"])
    read = statistics.median(times["read"])
    for mode in ["none", *MODES]:
        s = statistics.median(times[mode])
        rows.append(
            {
                "mode": mode,
                "seconds": s,
                "gbps": size / s / GB,
                "vs_no_quantize": s / base,
                "vs_read": s / read,
                "read_seconds": read,
                "held_bytes": peaks[mode][-1]["held"],
                "peak_anon_beyond_held": statistics.median(
                    p["peak_anon"] - p["held_anon"] for p in peaks[mode]
                ),
                "file_bytes": size,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# logits


def nll(logits: np.ndarray, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood of ids[1:] (perplexity = exp of it)."""
    x = logits[:-1].astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    return float(-np.mean(logp[np.arange(len(ids) - 1), ids[1:]]))


def logits_of(path: Path, mode: str | None, ids: list[int]) -> np.ndarray:
    import weightlift as wl

    m = wl.Model(path, quantize=mode, compute="exact")
    m.load(cache=wl.CacheSpec(len(ids) + 8, dtype="f32"))
    return m.forward(ids, logits="all")


def bench_logits(
    name: str, path: Path, ids: list[int], f32: np.ndarray, positions: list[int] | None = None
) -> list[dict]:
    """`f32` holds the reference's rows at `positions` (every position when None); the
    reference's perplexity needs every row, so it is left out (nan) when some are missing."""
    positions = list(range(len(ids))) if positions is None else positions
    whole = len(positions) == len(ids)
    rows = [
        {
            "model": name,
            "mode": "f32 reference",
            "max_abs": 0.0,
            "argmax": len(positions),
            "n": len(positions),
            "ppl": float(np.exp(nll(f32, ids))) if whole else float("nan"),
        }
    ]
    for mode in [None, *MODES]:
        got = logits_of(path, mode, ids)
        at = got[positions]
        rows.append(
            {
                "model": name,
                "mode": mode or "none (exact, stored type)",
                "max_abs": float(np.abs(at - f32).max()),
                "argmax": int((at.argmax(1) == f32.argmax(1)).sum()),
                "n": len(positions),
                "ppl": float(np.exp(nll(got, ids))),
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# report


def markdown(info: dict, load: list[dict], logits: list[dict]) -> str:
    lines = [
        "# Quantise-on-load bench",
        "",
        f"{info['machine']}; {info['when']}. weightlift {info['weightlift']} ({info['build']}).",
        "",
        "## Load time and host RAM",
        "",
        f"Synthetic llama checkpoint, {load[0]['file_bytes'] / GB:.2f} GB of bf16 (9 layers, "
        "hidden 2048, random weights), loaded onto cpu in a fresh process per load, page cache "
        f"warm; medians of {REPEAT} interleaved rounds. 'none' reads the bf16 bytes into owned "
        "memory (`use_mmap=False`). Peak RAM beyond held = peak anonymous RSS during the load "
        "minus the anonymous RSS still held when it returns: what the load needed on top of "
        "the model (the staging buffers are 2 × 4 MiB). Held = the model's bytes on cpu.",
        "",
        "| quantize | load s | GB/s of checkpoint | vs none | vs read() | held "
        "| peak RAM beyond held |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in load:
        lines.append(
            f"| {r['mode']} | {r['seconds']:.2f} | {r['gbps']:.2f} | {r['vs_no_quantize']:.2f}× | "
            f"{r['vs_read']:.2f}× | {r['held_bytes'] / 2**20:.0f} MiB | "
            f"{r['peak_anon_beyond_held'] / 2**20:.1f} MiB |"
        )
    lines.append(f"\n`read()` of the file: {load[0]['read_seconds']:.2f} s.\n")
    lines += [
        "## Logits against f32",
        "",
        "Exact compute (f32 activations on the dequantised weights), f32 KV cache. max|Δ| over "
        "all positions and the vocabulary; argmax = positions whose top token matches the f32 "
        "run (SmolLM2: at the 11 positions whose transformers rows the reference keeps); ppl = "
        "exp(mean next-token NLL) over the text's own ids.",
        "",
        "| model | quantize | max abs Δ | argmax | ppl |",
        "|---|---|---|---|---|",
    ]
    for r in logits:
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['max_abs']:.4f} | {r['argmax']}/{r['n']} | "
            f"{r['ppl']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    import platform

    import weightlift as wl

    if not (SYNTH / "model.safetensors").exists():
        write_synthetic(SYNTH)
    if not SMOL_F32.exists():
        write_smollm2_f32(SMOL_F32)
    load = bench_load(SYNTH / "model.safetensors")
    tiny_ids = json.loads((REFERENCE / "tiny-llama" / "ids.json").read_text())
    tiny_ids = tiny_ids["ids"] if isinstance(tiny_ids, dict) else tiny_ids
    tiny_f32 = np.load(REFERENCE / "tiny-llama" / "hf_logits.npy")
    logits = bench_logits(
        "tiny-llama (bf16)", REFERENCE / "tiny-llama" / "safetensors", tiny_ids, tiny_f32
    )
    prompts = json.loads((REFERENCE / "smollm2-135m" / "prompts.json").read_text())
    smol_ids = prompts["prompts"]["2"]["ids_llamacpp"]
    # transformers' logits are kept at 11 of prompt 2's 41 positions, whole rows.
    smol_f32 = np.load(REFERENCE / "smollm2-135m" / "hf_logits_2_rows.npy")
    kept = json.loads((REFERENCE / "smollm2-135m" / "hf_logits_2_rows.json").read_text())
    logits += bench_logits(
        "SmolLM2-135M (F32 GGUF)", SMOL_F32, smol_ids, smol_f32, kept["positions"]
    )
    info = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "weightlift": wl.__version__,
        "build": os.environ.get("WEIGHTLIFT_BENCH_BUILD", "release wheel"),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quantize.json").write_text(
        json.dumps({"info": info, "load": load, "logits": logits}, indent=2)
    )
    (RESULTS / "quantize.md").write_text(markdown(info, load, logits))
    sys.stdout.write(markdown(info, load, logits))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()

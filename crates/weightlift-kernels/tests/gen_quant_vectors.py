#!/usr/bin/env python3
"""Write the quantiser fixtures for weightlift-kernels from llama.cpp and bitsandbytes.

Two references, two commands (each needs its own environment; CI runs neither, it reads the
committed outputs in tests/data/):

ggml (llama.cpp's reference quantisers, through ggml_quantize_chunk with no importance matrix):

    .venv/bin/python crates/weightlift-kernels/tests/gen_quant_vectors.py ggml [--ggml-lib PATH]

  (PATH defaults to libggml-base.so inside .cache/bench/llama-venv, llama-cpp-python 0.3.36
  built from source.)

  Builds seeded rows of 256 values (random normal at several scales, and adversarial rows: all
  zeros, constants, one huge outlier, exact .5 ties after scaling, subnormal values, all
  negative, a zero or tiny sub-block inside a block, values past the f16 range), quantises them
  with llama.cpp's own library, and writes

    quant_in_<src>.bin       magic b"WLQI" | u32 src ggml type (0 f32, 1 f16, 30 bf16)
                             | u32 n_rows | u32 n_per_row | the source values, little-endian
    quant_<type>_<src>.bin   magic b"WLQO" | u32 ggml type | u32 n_rows | u32 n_per_row
                             | u32 n_bytes | the bytes ggml_quantize_chunk wrote

  for the f32 rows (every type) and for the first rows rounded to f16 and bf16 (Q8_0, Q4_K,
  Q6_K, quantised by ggml from the exactly widened values). gguf-py's numpy quantisers (Q8_0
  and the legacy types) are run on the same rows and must agree with ggml.

int8 (bitsandbytes' LLM.int8 on the CPU):

    PYTHONPATH=.cache/bnb-site .cache/qwen2-venv/bin/python \\
        crates/weightlift-kernels/tests/gen_quant_vectors.py int8

  (bitsandbytes installed with `pip install --target .cache/bnb-site --no-deps
  bitsandbytes==0.50.2` into a scratch directory, torch from the transformers venv.) Writes
  int8_case.bin: weights (f32 and f16), their int8_vectorwise_quant, activations with outlier
  columns, their quantisation at threshold 6.0 and 0.0, and int8_mixed_scaled_mm's outputs.

Both commands record the library versions in quant_vectors.json beside the data.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import struct
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "data"
META = OUT / "quant_vectors.json"
N_PER_ROW = 256
SEED = 20260611

# ggml type ids (enum ggml_type) and block geometry (block values, block bytes)
TYPES = {
    "q4_0": (2, 32, 18),
    "q4_1": (3, 32, 20),
    "q5_0": (6, 32, 22),
    "q5_1": (7, 32, 24),
    "q8_0": (8, 32, 34),
    "q4_k": (12, 256, 144),
    "q6_k": (14, 256, 210),
}
MAIN_TYPES = ["q8_0", "q4_k", "q6_k"]
SRC_IDS = {"f32": 0, "f16": 1, "bf16": 30}
N_HALF_ROWS = 8  # rows also written as f16 and bf16 sources
HASH_SEED = 0x5EED_0F_0A11  # the xorshift rows whose quantised bytes are stored as hashes
HASH_BLOCKS = 2048


def ggml_rows(rng: np.random.Generator) -> np.ndarray:
    """The f32 rows: the first N_HALF_ROWS fit f16, the rest are the adversarial ones."""
    n = N_PER_ROW
    rows = []
    rows.append(rng.standard_normal(n))  # 0: unit normal
    rows.append(rng.standard_normal(n) * 0.02)  # 1: weight-sized
    rows.append(rng.standard_t(3, n) * 1e-3)  # 2: heavy tails, small
    outlier = rng.standard_normal(n) * 0.02
    outlier[37] = 50.0
    rows.append(outlier)  # 3: one huge outlier
    ties = (rng.integers(-127, 127, n) + 0.5).astype(np.float64)
    ties[::32] = 127.0  # every Q8_0 block: amax 127, so d = 1 and x/d keeps the .5
    rows.append(ties)  # 4: exact .5 ties after scaling
    rows.append(-np.abs(rng.standard_normal(n)) * 3.0)  # 5: all negative
    rows.append(np.abs(rng.standard_normal(n)) + 0.25)  # 6: all positive (min clamps to 0)
    mixed = rng.standard_normal(n)
    mixed[:32] = 0.0  # a zero sub-block and zero Q8_0 block
    mixed[64:96] *= 1e-7  # a sub-block whose 6-bit scale rounds to 0
    mixed[200:216] = 0.75  # a constant Q6_K sub-block
    rows.append(mixed)  # 7: zero / tiny / constant sub-blocks
    rows.append(np.zeros(n))  # 8: all zeros
    rows.append(np.full(n, 0.5))  # 9: constant positive
    rows.append(np.full(n, -3.0))  # 10: constant negative
    rows.append(rng.standard_normal(n) * 1e-39)  # 11: subnormal f32 values (1/d overflows)
    rows.append(rng.standard_normal(n) * 1e-6)  # 12: subnormal f16 scales
    rows.append(rng.standard_normal(n) * 1e5)  # 13: past the f16 range (scales overflow)
    return np.stack(rows).astype(np.float32)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """f32 to bf16 bit patterns, round to nearest even (finite inputs)."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


class Ggml:
    """ggml_quantize_chunk from llama.cpp's libggml-base, through ctypes."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        f = self.lib.ggml_quantize_chunk
        # size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst,
        #     int64_t start, int64_t nrows, int64_t n_per_row, const float * imatrix)
        f.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        f.restype = ctypes.c_size_t
        self.f = f
        for name in ("ggml_version", "ggml_commit"):
            getattr(self.lib, name).restype = ctypes.c_char_p

    def version(self) -> str:
        v = self.lib.ggml_version().decode()
        return f"{v} (commit {self.lib.ggml_commit().decode()})"

    def quantize(self, name: str, x: np.ndarray) -> bytes:
        ty, bs, bb = TYPES[name]
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows, n = x.shape
        out = np.zeros(rows * n // bs * bb, dtype=np.uint8)
        wrote = self.f(ty, x.ctypes.data, out.ctypes.data, 0, rows, n, None)
        assert wrote == out.size, (name, wrote, out.size)
        return out.tobytes()


def xorshift_rows(seed: int, n_blocks: int) -> np.ndarray:
    """Values the Rust test makes itself (tests/common's xorshift64* and `unit`), so only a
    hash of ggml's bytes needs storing: uniform in [-1, 1), cubed in every third block for
    heavy tails, times a scale that cycles through 1, 0.02, 1e-3 and 30 by block."""
    mask = (1 << 64) - 1
    s = seed
    out = np.empty(n_blocks * N_PER_ROW, dtype=np.float32)
    for i in range(out.size):
        s ^= s >> 12
        s ^= (s << 25) & mask
        s ^= s >> 27
        r = (s * 0x2545F4914F6CDD1D) & mask
        out[i] = np.float32((r >> 40) / float(1 << 23) - 1.0)
    x = out.reshape(n_blocks, N_PER_ROW)
    x[2::3] = x[2::3] * x[2::3] * x[2::3]
    scales = np.array([1.0, 0.02, 1e-3, 30.0], dtype=np.float32)
    return x * scales[np.arange(n_blocks) % 4][:, None]


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & ((1 << 64) - 1)
    return h


def write_in(src: str, rows: int, payload: bytes) -> int:
    data = b"WLQI" + struct.pack("<III", SRC_IDS[src], rows, N_PER_ROW) + payload
    (OUT / f"quant_in_{src}.bin").write_bytes(data)
    return len(data)


def write_out(name: str, src: str, rows: int, q: bytes) -> int:
    head = b"WLQO" + struct.pack("<IIII", TYPES[name][0], rows, N_PER_ROW, len(q))
    (OUT / f"quant_{name}_{src}.bin").write_bytes(head + q)
    return len(head) + len(q)


def gguf_py_check(x: np.ndarray, name: str, want: bytes) -> dict:
    """Compare gguf-py's numpy quantiser with ggml's bytes, per row."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    ty = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "q8_0": T.Q8_0}[name]
    got = quants.quantize(x, ty).tobytes()
    row = len(want) // x.shape[0]
    differ = [
        r
        for r in range(x.shape[0])
        if got[r * row : (r + 1) * row] != want[r * row : (r + 1) * row]
    ]
    return {"rows": x.shape[0], "rows_differing": differ}


def cmd_ggml(lib_path: str) -> None:
    import importlib.metadata as md

    OUT.mkdir(parents=True, exist_ok=True)
    ggml = Ggml(lib_path)
    x = ggml_rows(np.random.default_rng(SEED))
    total = write_in("f32", x.shape[0], x.astype("<f4").tobytes())
    gguf_py = {}
    with np.errstate(all="ignore"):
        for name in TYPES:
            q = ggml.quantize(name, x)
            total += write_out(name, "f32", x.shape[0], q)
            if name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
                gguf_py[name] = gguf_py_check(x, name, q)
    half = x[:N_HALF_ROWS]
    h16 = half.astype(np.float16)
    total += write_in("f16", N_HALF_ROWS, h16.astype("<f2").tobytes())
    b16 = to_bf16_bits(half)
    total += write_in("bf16", N_HALF_ROWS, b16.astype("<u2").tobytes())
    for name in MAIN_TYPES:
        total += write_out(name, "f16", N_HALF_ROWS, ggml.quantize(name, h16.astype(np.float32)))
        total += write_out(name, "bf16", N_HALF_ROWS, ggml.quantize(name, bf16_bits_to_f32(b16)))
    many = xorshift_rows(HASH_SEED, HASH_BLOCKS)
    hashes = b"".join(
        struct.pack("<IQ", TYPES[name][0], fnv1a64(ggml.quantize(name, many))) for name in TYPES
    )
    head = b"WLQH" + struct.pack("<QII", HASH_SEED, HASH_BLOCKS, len(TYPES))
    (OUT / "quant_hashes.bin").write_bytes(head + hashes)
    total += len(head) + len(hashes)
    lib = Path(lib_path).resolve()
    meta = json.loads(META.read_text()) if META.exists() else {}
    meta["ggml"] = {
        "reference": "ggml_quantize_chunk(type, src, dst, 0, nrows, n_per_row, NULL)",
        "library": lib.name,
        "ggml_version": ggml.version(),
        "llama_cpp_python": "0.3.36 (vendored llama.cpp, built from the sdist)",
        "gguf_py": md.version("gguf"),
        "numpy": np.__version__,
        "seed": SEED,
        "hash_rows": {"xorshift_seed": HASH_SEED, "rows": HASH_BLOCKS, "hash": "fnv-1a 64"},
        "rows": int(x.shape[0]),
        "n_per_row": N_PER_ROW,
        "gguf_py_agreement": gguf_py,
        "bytes_written": total,
    }
    META.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(f"wrote {total} bytes; gguf-py agreement: {gguf_py}")


def cmd_int8() -> None:
    import importlib.metadata as md

    import bitsandbytes.functional as F
    import torch

    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED + 1)
    rows, cols, n_tok, threshold = 16, 128, 5, 6.0
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[3] = 0.0  # a zero row: scale 0, quants 0
    w[7, 11] = 2.5  # a weight outlier: the rest of its row quantises coarsely
    w[9] = (rng.integers(-127, 128, cols) + 0.5) / 127.0 * 0.5  # ties after scaling
    w[9, 0] = 0.5
    w16 = w[:8].astype(np.float16)
    x = rng.standard_normal((n_tok, cols)).astype(np.float32)
    x[1, 10] = 8.0  # outlier columns: 10, 50 (exactly at the threshold) and 100
    x[0, 50] = 6.0
    x[3, 100] = -7.5
    x[2, 60] = 5.99  # just below: stays in the int8 part
    x[4] = 0.0  # a zero token

    def quant(a: np.ndarray, thr: float):
        q, s, cols_ = F.int8_vectorwise_quant(torch.from_numpy(a.copy()), threshold=thr)
        cols_ = [] if cols_ is None else cols_.tolist()
        return q.numpy(), s.numpy(), cols_

    cb, scb, _ = quant(w, 0.0)
    cb16, scb16, _ = quant(w16, 0.0)
    ca, sca, outliers = quant(x, threshold)
    ca0, sca0, _ = quant(x, 0.0)
    xt = torch.from_numpy(x)
    y = torch.ops.bitsandbytes.int8_mixed_scaled_mm(
        xt,
        torch.from_numpy(ca),
        torch.from_numpy(cb),
        torch.from_numpy(sca),
        torch.from_numpy(scb),
        torch.tensor(outliers, dtype=torch.int64),
        None,
    )[0].numpy()
    y0 = torch.ops.bitsandbytes.int8_scaled_mm(
        torch.from_numpy(ca0),
        torch.from_numpy(cb),
        torch.from_numpy(sca0),
        torch.from_numpy(scb),
        dtype=torch.float32,
    ).numpy()

    parts = [
        b"WLI8",
        struct.pack("<IIIIf", rows, cols, n_tok, len(outliers), threshold),
        w.astype("<f4").tobytes(),
        cb.astype(np.int8).tobytes(),
        scb.astype("<f4").tobytes(),
        w16.astype("<f2").tobytes(),
        cb16.astype(np.int8).tobytes(),
        scb16.astype("<f4").tobytes(),
        x.astype("<f4").tobytes(),
        np.asarray(outliers, dtype="<u4").tobytes(),
        ca.astype(np.int8).tobytes(),
        sca.astype("<f4").tobytes(),
        ca0.astype(np.int8).tobytes(),
        sca0.astype("<f4").tobytes(),
        y.astype("<f4").tobytes(),
        y0.astype("<f4").tobytes(),
    ]
    data = b"".join(parts)
    (OUT / "int8_case.bin").write_bytes(data)
    meta = json.loads(META.read_text()) if META.exists() else {}
    meta["int8"] = {
        "reference": "bitsandbytes.functional.int8_vectorwise_quant, "
        "torch.ops.bitsandbytes.int8_mixed_scaled_mm / int8_scaled_mm (CPU)",
        "bitsandbytes": md.version("bitsandbytes"),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "seed": SEED + 1,
        "rows": rows,
        "cols": cols,
        "n_tok": n_tok,
        "threshold": threshold,
        "outlier_cols": outliers,
        "bytes_written": len(data),
    }
    META.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(data)} bytes; outlier columns {outliers}")


def default_ggml_lib() -> str:
    root = Path(__file__).resolve().parents[3]
    pattern = ".cache/bench/llama-venv/lib/python3*/site-packages/llama_cpp/lib/libggml-base.so"
    found = sorted(root.glob(pattern))
    if not found:
        raise SystemExit(f"no {pattern} under {root}; pass --ggml-lib")
    return str(found[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("ggml", help="ggml row quantisers (llama.cpp's libggml-base)")
    g.add_argument("--ggml-lib", default=None, help="path to libggml-base.so")
    sub.add_parser("int8", help="LLM.int8 (bitsandbytes on the CPU)")
    a = p.parse_args()
    if a.cmd == "ggml":
        cmd_ggml(a.ggml_lib or default_ggml_lib())
    else:
        cmd_int8()


if __name__ == "__main__":
    main()

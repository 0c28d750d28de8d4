#!/usr/bin/env python3
"""Write known-answer dequantisation fixtures for weightlift-kernels from gguf-py.

gguf-py (gguf.quants) is the external reference: for each ggml type this script makes a few
blocks, asks gguf-py to dequantise them, and writes both to tests/data/<type>.bin:

    magic b"WLKV" | u32 ggml type id | u32 n_blocks | u32 block_bytes | u32 n_elements
    | raw blocks (n_blocks * block_bytes) | f32 little-endian dequantised values (n_elements)

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks come from gguf-py's own quantize() of random normal
data. K-quants, IQ4_NL, F16 and BF16 have no quantiser in gguf-py, so their blocks are random
bytes with every f16 scale forced to a random *finite* value (subnormals included).

Run with the project venv:  .venv/bin/python crates/weightlift-kernels/tests/gen_vectors.py
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

OUT = Path(__file__).resolve().parent / "data"

QUANTISED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
RANDOM = {
    # type: byte offsets of f16 scales inside one block (ggml-common.h layouts)
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
}


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random f16 bit patterns that are finite (any exponent but the all-ones one)."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    bad = (bits & 0x7C00) == 0x7C00
    bits[bad] &= 0xBBFF  # clear one exponent bit: still random, now finite
    return bits


def small_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Scales of realistic size, as a real model has."""
    return (rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint16)


def write(ty: T, raw: np.ndarray, deq: np.ndarray) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ty]
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    assert raw.size % type_size == 0
    n_blocks = raw.size // type_size
    deq = np.ascontiguousarray(deq, dtype="<f4").reshape(-1)
    assert deq.size == n_blocks * block_size
    head = b"WLKV" + struct.pack("<IIII", int(ty), n_blocks, type_size, deq.size)
    path = OUT / f"{ty.name.lower()}.bin"
    data = head + raw.tobytes() + deq.tobytes()
    path.write_bytes(data)
    return len(data)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20260522)
    total = 0
    for ty in QUANTISED:
        x = rng.standard_normal(48 * 32).astype(np.float32)
        x[:32] = 0.0  # an all-zero block: d == 0
        x[32:64] *= 1e-6  # tiny values: subnormal f16 scales
        raw = quants.quantize(x.reshape(1, -1), ty)
        total += write(ty, raw, quants.dequantize(raw, ty))
    for ty, offsets in RANDOM.items():
        block_size, type_size = GGML_QUANT_SIZES[ty]
        n_blocks = 12 if block_size == 256 else 48
        raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint32).astype(np.uint8)
        for off in offsets:
            half = n_blocks // 2
            scales = np.concatenate([small_f16(rng, half), finite_f16(rng, n_blocks - half)])
            raw[:, off : off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
        total += write(ty, raw, quants.dequantize(raw, ty))
    # F16: every finite pattern class; BF16: random finite patterns.
    f16 = finite_f16(rng, 1024)
    total += write(T.F16, f16.view(np.uint8), quants.dequantize(f16.view(np.uint8), T.F16))
    bf = rng.integers(0, 1 << 16, size=1024, dtype=np.uint32).astype(np.uint16)
    bf[(bf & 0x7F80) == 0x7F80] &= 0xBFFF
    total += write(T.BF16, bf.view(np.uint8), quants.dequantize(bf.view(np.uint8), T.BF16))
    print(f"wrote {total} bytes to {OUT}")


if __name__ == "__main__":
    main()

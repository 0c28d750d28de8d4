#!/usr/bin/env python3
"""Write the Q8 activation-quantiser fixture for weightlift-kernels from gguf-py.

gguf-py's Q8_0 quantize() is llama.cpp's quantize_row_q8_0_ref in numpy (d = amax / 127,
q = round-half-away(x * (1 / d)), d stored as f16), the scheme the Q8 matvec mode applies to
activations. Writes tests/data/q8_act.bin:

    magic b"WLQ8" | u32 n_blocks | f32 little-endian x (n_blocks * 32) | gguf-py Q8_0 blocks
    (n_blocks * 34: f16 d, 32 x int8)

Run with the project venv:  .venv/bin/python crates/weightlift-kernels/tests/gen_q8_act.py
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = Path(__file__).resolve().parent / "data" / "q8_act.bin"


def main() -> None:
    rng = np.random.default_rng(0x0A8)
    blocks = [rng.standard_normal(32) * s for s in (1.0, 1e-3, 30.0, 1e4, 0.2, 5.0)]
    blocks.append(np.zeros(32))  # d = 0: every q is 0
    # amax 127 gives d = 1: values at exact halves check round-half-away-from-zero
    blocks.append(np.array([127.0, -127.0] + [k + 0.5 for k in range(-15, 15)]))
    blocks.append(np.where(np.arange(32) % 2 == 0, 1.0, -1.0) * 1e-6)  # tiny scale
    blocks.append(np.full(32, -3.25))  # one value repeated, negative
    x = np.concatenate(blocks).astype(np.float32)
    q = quants.quantize(x.reshape(1, -1), T.Q8_0)
    n_blocks = x.size // 32
    assert q.nbytes == n_blocks * 34
    OUT.write_bytes(b"WLQ8" + struct.pack("<I", n_blocks) + x.astype("<f4").tobytes() + q.tobytes())
    print(f"wrote {OUT} ({n_blocks} blocks)")


if __name__ == "__main__":
    main()

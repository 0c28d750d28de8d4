"""Every tensor's bytes as the format's own reader gives them: what a loaded model's read-back
is compared with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import safetensors
from gguf import GGUFReader


def st_truth(folder: Path) -> dict[str, bytes]:
    """name -> raw bytes, as the safetensors package deserialises every shard."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, info in safetensors.deserialize(f.read_bytes()):
            out[name] = bytes(info["data"])
    return out


def gguf_truth(src: Path | GGUFReader) -> dict[str, bytes]:
    """name -> raw bytes, as gguf-py reads them (the demo model's reader is a session fixture:
    reading its metadata takes gguf-py seconds)."""
    reader = src if isinstance(src, GGUFReader) else GGUFReader(src)
    return {t.name: np.ascontiguousarray(t.data).tobytes() for t in reader.tensors}


def truth_of(path: Path) -> dict[str, bytes]:
    """A GGUF file's or a safetensors folder's tensors."""
    return gguf_truth(path) if path.suffix == ".gguf" else st_truth(path)

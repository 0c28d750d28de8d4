"""Write st_tiny_llama_digest.json: per-tensor dtype, shape, size, byte sum and FNV-1a-64 of the
tiny-llama safetensors (single file and each shard), as the official `safetensors` Python
package (`safetensors.deserialize`) reads them. The Rust tests compare weightlift's tensor
table and bytes with this.

Run: .venv/bin/python crates/weightlift-format/tests/data/st_gen_digest.py
"""

import json
import os
import pathlib

from safetensors import deserialize

# The reference pack as `make reference` lays it out (or `$WEIGHTLIFT_REFERENCE`).
REF = (
    pathlib.Path(
        os.environ.get("WEIGHTLIFT_REFERENCE")
        or pathlib.Path(__file__).resolve().parents[4] / ".cache" / "reference"
    )
    / "tiny-llama"
)
OUT = pathlib.Path(__file__).with_name("st_tiny_llama_digest.json")


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def digest(path: pathlib.Path) -> dict:
    out = {}
    for name, t in deserialize(path.read_bytes()):
        data = bytes(t["data"])
        out[name] = {
            "dtype": t["dtype"],
            "shape": t["shape"],
            "nbytes": len(data),
            "sum": sum(data),
            "fnv1a64": fnv1a64(data),
        }
    return out


def main() -> None:
    single = digest(REF / "safetensors" / "model.safetensors")
    shards = {}
    for p in sorted((REF / "safetensors-sharded").glob("*.safetensors")):
        shards[p.name] = digest(p)
    OUT.write_text(json.dumps({"single": single, "shards": shards}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

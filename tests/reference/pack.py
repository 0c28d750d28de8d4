"""Pack the reference data (llama.cpp's and transformers' outputs, see README.md) into this
folder, small enough to live in the repository. Run once, by hand, on the full pack::

    python tests/reference/pack.py SOURCE_DIR

SOURCE_DIR holds `tiny-llama/` and `smollm2-135m/` as their generator wrote them. What is kept,
and how `materialize.py` gives every file back (each checked against the sha256 of the
original, recorded in `manifest.json`):

- small JSON files are copied as they are;
- large files are xz-compressed, each in the smallest of three ways: byte for byte (`.xz`);
  with the words after the header (float32 logits, bf16 weights) split into byte planes, all
  first bytes, then all second bytes, ... (`.planes.xz`: the plane of sign and exponent
  bytes compresses well, where whole words hardly do); or, for a file of logits close to another
  file's, the bitwise XOR of their payloads in byte planes (`.xor-planes.xz`: equal sign,
  exponent and leading mantissa bits XOR to zero bytes);
- a GGUF keeps only its header (metadata and tensor table, xz-compressed): its tensor bytes
  are quantised again from the safetensors weights and must hash to llama.cpp's file;
- the sharded safetensors copy is not kept: it is written again from the single file by the
  `safetensors` package, in the same shards, and must hash to the original shards;
- llama.cpp's logits are kept as each position's top 8 (ids and exact values): the tests
  read only llama.cpp's argmax, its top-1/top-2 margin and the rank of our top-1 in its top 3;
- some transformers logits are kept at chosen positions, whole rows (`<name>_rows.npy`, the
  positions listed in `<name>_rows.json`), so the f32 comparisons still cover every vocabulary
  entry of those positions: SmolLM2's prompt 2 (11 of 41) and the tiny model's logits on each
  GGUF's dequantised weights (6 of 16, XORed with the same rows of `hf_logits.npy`);
- a GGUF header close to another GGUF's is kept as the XOR with it (the headers differ only
  in the tensor types and offsets).
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
from materialize import xor_prefix

HERE = Path(__file__).resolve().parent
TOP_K = 8
# Prompt 2 of SmolLM2: the first and last positions, every fifth, and 21-22 (where llama.cpp
# and transformers disagree, and our near-tie).
SMOL_PROMPT2_ROWS = [0, 1, 5, 10, 15, 20, 21, 22, 30, 35, 40]
# Rows kept of the tiny model's logits on each GGUF's dequantised weights (`dequant_rows`).
DEQUANT_ROWS = 6

COPY = [
    "tiny-llama/ids.json",
    "tiny-llama/model.json",
    "tiny-llama/stats.json",
    "tiny-llama/safetensors/config.json",
    "tiny-llama/safetensors/generation_config.json",
    "tiny-llama/safetensors/tokenizer_config.json",
    "smollm2-135m/greedy.json",
    "smollm2-135m/model.json",
    "smollm2-135m/prompts.json",
    "smollm2-135m/stats.json",
]
# file -> the size of its words, for byte planes, and the file whose payload its own is XORed
# with before the planes are split (None: that way is not tried).
COMPRESS: dict[str, tuple[int | None, str | None]] = {
    "tiny-llama/safetensors/model.safetensors": (2, None),
    "tiny-llama/safetensors/tokenizer.json": (None, None),
    "tiny-llama/hf_logits.npy": (4, None),
    "smollm2-135m/hf_logits_1.npy": (4, None),
}
# The first is kept whole; the others' headers as the XOR with its header.
GGUFS = ["Q8_0", "Q6_K", "Q4_K_M"]
SHARDED = "tiny-llama/safetensors-sharded"
LLAMACPP_TOP = {
    "tiny-llama/llamacpp_logits_Q8_0.npy": "tiny-llama/llamacpp_top8_Q8_0.json",
    "tiny-llama/llamacpp_logits_Q6_K.npy": "tiny-llama/llamacpp_top8_Q6_K.json",
    "tiny-llama/llamacpp_logits_Q4_K_M.npy": "tiny-llama/llamacpp_top8_Q4_K_M.json",
    "smollm2-135m/llamacpp_logits_1.npy": "smollm2-135m/llamacpp_top8_1.json",
    "smollm2-135m/llamacpp_logits_2.npy": "smollm2-135m/llamacpp_top8_2.json",
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(rel: str, data: bytes) -> None:
    path = HERE / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def xz(data: bytes) -> bytes:
    return lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)


def header_bytes(rel: str, data: bytes) -> int:
    """Where the words start: after an `.npy` file's header, or a safetensors file's."""
    if rel.endswith(".npy"):
        stream = io.BytesIO(data)
        fmt = np.lib.format
        if fmt.read_magic(stream) == (1, 0):
            fmt.read_array_header_1_0(stream)
        else:
            fmt.read_array_header_2_0(stream)
        return stream.tell()
    if rel.endswith(".safetensors"):
        return 8 + int.from_bytes(data[:8], "little")
    raise ValueError(f"{rel}: no known header to keep before byte planes")


def byte_planes(payload: bytes, word: int) -> bytes:
    """The `word`-byte words' first bytes, then their second bytes, and so on."""
    return np.frombuffer(payload, dtype=np.uint8).reshape(-1, word).T.tobytes()


def compressed(
    rel: str,
    data: bytes,
    word: int | None,
    xor: str | None,
    src: Path,
    xor_rows: list[int] | None = None,
) -> tuple[dict, bytes]:
    """The smallest of the ways to xz `rel` that apply: (the manifest entry, the `.xz` bytes).
    With `xor_rows`, `rel` holds those rows of a file laid out as `xor`, and its payload is
    XORed with the same rows of `xor`."""
    ways = [({"how": "xz", "from": rel + ".xz"}, xz(data))]
    if word is not None:
        start = header_bytes(rel, data)
        assert (len(data) - start) % word == 0, f"{rel}: payload is not whole {word}-byte words"
        planes = {"header_bytes": start, "word": word}
        payload = data[start:]
        entry = {"how": "xz-planes", "from": rel + ".planes.xz", **planes}
        ways.append((entry, xz(data[:start] + byte_planes(payload, word))))
        if xor is not None:
            other = (src / xor).read_bytes()
            theirs = np.frombuffer(other, dtype=np.uint8, offset=start)
            entry = {"how": "xz-xor-planes", "from": rel + ".xor-planes.xz", **planes, "xor": xor}
            if xor_rows is not None:
                theirs = theirs.reshape(-1, len(payload) // len(xor_rows))[xor_rows].reshape(-1)
                entry["xor_rows"] = xor_rows
            assert header_bytes(xor, other) == start and theirs.size == len(payload), (
                f"{rel}: {xor} does not lay out its payload as {rel} does"
            )
            mixed = np.bitwise_xor(np.frombuffer(payload, dtype=np.uint8), theirs).tobytes()
            ways.append((entry, xz(data[:start] + byte_planes(mixed, word))))
    return min(ways, key=lambda way: len(way[1]))


def top_k(logits: np.ndarray) -> dict:
    """Each row's `TOP_K` largest logits, best first (ties: the lower id first, as argmax)."""
    order = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]
    values = np.take_along_axis(logits, order, axis=1)
    return {
        "k": TOP_K,
        "vocab": int(logits.shape[1]),
        "ids": order.tolist(),
        # float32 values written as the shortest decimal that reads back to the same float32.
        "logits": [
            [float(np.format_float_positional(v, unique=True)) for v in row] for row in values
        ],
    }


def gguf_header(path: Path) -> tuple[bytes, dict]:
    """The bytes before the tensor data, and what `materialize.py` needs to fill in the rest."""
    data = path.read_bytes()
    reader = gguf.GGUFReader(path)
    tensors = []
    filled = bytearray(data[: reader.data_offset])
    filled.extend(bytes(len(data) - reader.data_offset))
    for t in reader.tensors:
        start = int(t.data_offset)
        end = start + int(t.n_bytes)
        filled[start:end] = data[start:end]
        tensors.append({"name": t.name, "type": t.tensor_type.name, "start": start, "end": end})
    # Everything that is not a tensor's bytes is header or zero padding.
    assert bytes(filled) == data, f"{path}: bytes outside the header and tensors are not zero"
    info = {"header_bytes": reader.data_offset, "size": len(data), "tensors": tensors}
    return data[: reader.data_offset], info


def dequant_rows(src: Path, ty: str) -> list[int]:
    """The positions kept of `hf_dequant_logits_<ty>.npy`: the first two and the last, then
    where `stats.json` records argmaxes that differ for that GGUF (llama.cpp's, the dequantised
    weights', the bf16 weights'), then the rest; in each group the smallest top-1/top-2 margin
    of the file's own logits first, where an error would soonest flip the argmax the tests
    check against it."""
    logits = np.load(src / f"tiny-llama/hf_dequant_logits_{ty}.npy")
    stats = json.loads((src / "tiny-llama/stats.json").read_text())["gguf"][ty]
    compared = ("llamacpp_vs_hf_logits", "llamacpp_vs_hf_dequant", "hf_dequant_vs_hf_logits")
    differ = {int(p) for c in compared for p in stats[c]["argmax_mismatch_positions"]}
    top2 = np.sort(logits, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    last = len(logits) - 1
    rest = sorted(
        set(range(len(logits))) - {0, 1, last},
        key=lambda p: (p not in differ, float(margin[p]), p),
    )
    return sorted([0, 1, last, *rest[: DEQUANT_ROWS - 3]])


def keep_rows(
    src: Path, manifest: dict, rel: str, positions: list[int], xor: str | None = None
) -> None:
    """Keep the logits of `rel` at `positions`, whole rows: `<name>_rows.npy` (packed the
    smallest way, its payload XORed with the same rows of `xor` where given), and the
    positions in `<name>_rows.json`."""
    logits = np.load(src / rel)
    stem = rel.removesuffix(".npy")
    stream = io.BytesIO()
    np.save(stream, np.ascontiguousarray(logits[positions], dtype="<f4"))
    data = stream.getvalue()
    rows = stem + "_rows.npy"
    entry, packed = compressed(rows, data, 4, xor, src, positions if xor else None)
    write(entry["from"], packed)
    manifest["files"][rows] = {"sha256": sha256(data), **entry}
    listed = {"positions": positions, "of": Path(rel).name, "n_positions": len(logits)}
    write(stem + "_rows.json", (json.dumps(listed) + "\n").encode())
    manifest["files"][stem + "_rows.json"] = {
        "sha256": sha256((HERE / (stem + "_rows.json")).read_bytes()),
        "how": "copy",
    }


def main(src: Path) -> None:
    manifest: dict = {"files": {}}
    for rel in COPY:
        data = (src / rel).read_bytes()
        write(rel, data)
        manifest["files"][rel] = {"sha256": sha256(data), "how": "copy"}
    for rel, (word, xor) in COMPRESS.items():
        data = (src / rel).read_bytes()
        entry, packed = compressed(rel, data, word, xor, src)
        write(entry["from"], packed)
        manifest["files"][rel] = {"sha256": sha256(data), **entry}
    for ty in GGUFS:
        rel = f"tiny-llama/hf_dequant_logits_{ty}.npy"
        keep_rows(src, manifest, rel, dequant_rows(src, ty), xor="tiny-llama/hf_logits.npy")
    first: tuple[str, bytes] | None = None
    for ty in GGUFS:
        rel = f"tiny-llama/gguf/tiny-llama-{ty}.gguf"
        data = (src / rel).read_bytes()
        header, info = gguf_header(src / rel)
        entry: dict = {"sha256": sha256(data), "how": "gguf"}
        if first is None:
            first = (rel, header)
            entry["from"] = rel + ".header.xz"
            write(entry["from"], xz(header))
        else:
            entry["from"] = rel + ".header.xor.xz"
            entry["xor"] = first[0]
            write(entry["from"], xz(xor_prefix(header, first[1])))
        manifest["files"][rel] = {**entry, **info}
    index = json.loads((src / SHARDED / "model.safetensors.index.json").read_text())
    for name in sorted((src / SHARDED).iterdir()):
        rel = f"{SHARDED}/{name.name}"
        data = name.read_bytes()
        if name.suffix == ".safetensors":
            entry = {"how": "shard", "from": "tiny-llama/safetensors/model.safetensors"}
            entry["tensors"] = sorted(k for k, v in index["weight_map"].items() if v == name.name)
        else:
            twin = src / "tiny-llama/safetensors" / name.name
            if twin.is_file() and twin.read_bytes() == data:
                entry = {"how": "same", "from": f"tiny-llama/safetensors/{name.name}"}
            else:
                write(rel, data)
                entry = {"how": "copy"}
        manifest["files"][rel] = {"sha256": sha256(data), **entry}
    for rel, out in LLAMACPP_TOP.items():
        logits = np.load(src / rel)
        write(out, (json.dumps(top_k(logits)) + "\n").encode())
        manifest["files"][out] = {"sha256": sha256((HERE / out).read_bytes()), "how": "copy"}
    keep_rows(src, manifest, "smollm2-135m/hf_logits_2.npy", SMOL_PROMPT2_ROWS)
    write("manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: pack.py SOURCE_DIR (holding tiny-llama/ and smollm2-135m/)")
    for old in ("tiny-llama", "smollm2-135m"):
        shutil.rmtree(HERE / old, ignore_errors=True)
    main(Path(sys.argv[1]))

"""Lay out the reference data (README.md) in full, from what this folder keeps::

    python tests/reference/materialize.py [OUT [FILE ...]]   # OUT defaults to .cache/reference

With FILEs (paths as manifest.json names them), only those and what they are rebuilt from (the
GPU run lays out the few files its tests read this way).

`make reference` runs it. Every file written is checked against the sha256 of the original
(recorded in `manifest.json` by `pack.py`), so what the tests read is byte for byte what
llama.cpp, transformers and the `safetensors` package wrote. Files already present with the
right hash are left alone.

Large files are unpacked from xz; some were packed as byte planes (all first bytes of the
payload's words, then all second bytes, ...) after a header kept as is, and some of those as
the XOR of their payload with another file's (or with some of its rows, for a file that keeps
only those rows of logits), which is laid out and checked first.

Two kinds of file are rebuilt rather than unpacked:
- the sharded safetensors copy is written again by the `safetensors` package from the single
  file's tensors, in the index's shards;
- a GGUF's tensor bytes are quantised again from the safetensors weights by weightlift's
  quantise-on-load, which writes llama.cpp's reference quantisers' bytes. The hash check is
  what makes this sound: a rebuilt GGUF is used only if it hashes to llama.cpp's own file, so
  a test that compares our quantiser with these files still compares it with llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_OUT = REPO / ".cache" / "reference"
SAFETENSORS = "tiny-llama/safetensors/model.safetensors"
N_HEAD, N_KV_HEAD = 4, 2
# llama.cpp's roles for transformers' names.
HF_ROLE = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# safetensors' header dtype names, as its serializer takes them.
SPEC_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
# The GGUF tensor type, as weightlift's `quantize=` names it.
QUANTIZE = {"Q8_0": "q8_0", "Q6_K": "q6_k", "Q4_K": "q4_k"}


class ReferenceError(Exception):
    """A file could not be rebuilt to its recorded hash."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    blk, layer, role, _ = gguf_name.split(".")
    if blk != "blk" or role not in HF_ROLE:
        raise ReferenceError(f"no transformers name for GGUF tensor '{gguf_name}'")
    return f"model.layers.{layer}.{HF_ROLE[role]}.weight"


def gguf_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (rope on adjacent pairs) from transformers' order.
    Quantised rows are independent blocks, so the permutation moves whole byte rows."""
    out = rows.shape[0]
    return rows.reshape(n_head, 2, out // n_head // 2, -1).swapaxes(1, 2).reshape(rows.shape)


def read_safetensors(data: bytes) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, bytes), read by the `safetensors` package."""
    from safetensors import deserialize

    return {name: (t["dtype"], t["shape"], bytes(t["data"])) for name, t in deserialize(data)}


def xor_prefix(data: bytes, other: bytes) -> bytes:
    """`data` XOR `other` over the bytes both have, then the rest of `data` as it is (its own
    inverse: packing and unpacking are the same call)."""
    n = min(len(data), len(other))
    mixed = np.bitwise_xor(np.frombuffer(data, np.uint8, n), np.frombuffer(other, np.uint8, n))
    return mixed.tobytes() + data[n:]


def bf16_to_f32(raw: bytes) -> np.ndarray:
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view("<f4")


class Builder:
    def __init__(self, out: Path, manifest: dict) -> None:
        self.out = out
        self.files = manifest["files"]
        self._tensors: dict | None = None
        self._quantised: dict[str, object] = {}
        self._checked: set[str] = set()

    def tensors(self) -> dict[str, tuple[str, list[int], bytes]]:
        if self._tensors is None:
            self._tensors = read_safetensors(self.get(SAFETENSORS))
        return self._tensors

    def get(self, rel: str) -> bytes:
        """The checked bytes of `rel`, built first if need be."""
        return self.ensure(rel).read_bytes()

    def ensure(self, rel: str) -> Path:
        """The path of `rel` in the output, holding the recorded bytes (checked once a run)."""
        path = self.out / rel
        if rel in self._checked:
            return path
        want = self.files[rel]["sha256"]
        if not (path.is_file() and sha256(path.read_bytes()) == want):
            data = self.build(rel, self.files[rel])
            got = sha256(data)
            if got != want:
                raise ReferenceError(
                    f"{rel}: rebuilt file has sha256 {got}, expected {want} (the original's); "
                    "the weights or the quantiser that rebuilds it changed"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        self._checked.add(rel)
        return path

    def build(self, rel: str, entry: dict) -> bytes:
        how = entry["how"]
        if how == "copy":
            return (HERE / rel).read_bytes()
        if how == "xz":
            return lzma.decompress((HERE / entry["from"]).read_bytes())
        if how in ("xz-planes", "xz-xor-planes"):
            return self.planes(rel, entry)
        if how == "same":
            return self.get(entry["from"])
        if how == "shard":
            return self.shard(entry["tensors"])
        if how == "gguf":
            return self.gguf(entry)
        raise ReferenceError(f"{rel}: unknown way '{how}' in manifest.json")

    def planes(self, rel: str, entry: dict) -> bytes:
        """A file packed as its header, then its payload's words as byte planes. For
        `xz-xor-planes` the payload was first XORed with that of `entry["xor"]` (whose header is
        as long), or with its rows `entry["xor_rows"]`, one for each row of `rel`."""
        data = lzma.decompress((HERE / entry["from"]).read_bytes())
        start, word = entry["header_bytes"], entry["word"]
        if (len(data) - start) % word:
            raise ReferenceError(f"{rel}: {len(data) - start} payload bytes are not whole words")
        payload = np.frombuffer(data, dtype=np.uint8, offset=start).reshape(word, -1).T
        if entry["how"] == "xz-planes":
            return data[:start] + payload.tobytes()
        other = self.get(entry["xor"])
        theirs = np.frombuffer(other, dtype=np.uint8, offset=start)
        rows = entry.get("xor_rows")
        if rows is not None:
            width = payload.size // len(rows) if rows else 0
            if not width or width * len(rows) != payload.size or theirs.size % width:
                raise ReferenceError(
                    f"{rel}: {len(rows)} rows in {payload.size} payload bytes do not divide "
                    f"the {theirs.size} of {entry['xor']} into rows; manifest.json and the "
                    "packed files disagree"
                )
            n_rows = theirs.size // width
            if not all(0 <= r < n_rows for r in rows):
                raise ReferenceError(
                    f"{rel}: xor_rows {rows} are not all rows of {entry['xor']}, which has "
                    f"{n_rows}; manifest.json and the packed files disagree"
                )
            theirs = theirs.reshape(n_rows, width)[rows].reshape(-1)
        if theirs.size != payload.size:
            raise ReferenceError(
                f"{rel}: unpacks to {payload.size} payload bytes, but {entry['xor']}, whose "
                f"payload is XORed into it, has {theirs.size}; manifest.json and the packed "
                "files disagree"
            )
        return data[:start] + np.bitwise_xor(payload, theirs.reshape(-1, word)).tobytes()

    def shard(self, names: list[str]) -> bytes:
        from safetensors import TensorSpec, serialize

        tensors = self.tensors()
        keep = []
        specs = {}
        for name in names:
            dtype, shape, raw = tensors[name]
            buf = np.frombuffer(raw, dtype=np.uint8)
            keep.append(buf)
            specs[name] = TensorSpec(
                dtype=SPEC_DTYPE[dtype], shape=shape, data_ptr=buf.ctypes.data, data_len=buf.nbytes
            )
        # transformers' save_pretrained writes this metadata into every shard.
        return bytes(serialize(specs, metadata={"format": "pt"}))

    def quantised(self, qtype: str):
        """The tiny llama loaded with `quantize=` (weightlift's quantise-on-load)."""
        if qtype not in self._quantised:
            try:
                import weightlift as wl
            except ImportError as e:
                raise ReferenceError(
                    f"rebuilding the GGUF files needs the weightlift extension ({e}); "
                    "run `make build` first (`make reference` does)"
                ) from e
            m = wl.Model(
                self.out / "tiny-llama" / "safetensors",
                devices="cpu",
                quantize=qtype,
                compute="exact",
                n_threads=1,
            )
            m.load(cache=wl.CacheSpec(32, dtype="f32"))
            self._quantised[qtype] = m
        return self._quantised[qtype]

    def gguf_header(self, entry: dict) -> bytes:
        """The header of a `gguf` entry's file: kept as it is, or as the XOR with the header of
        the GGUF `entry["xor"]` (read from what this folder keeps; that file is not built)."""
        header = lzma.decompress((HERE / entry["from"]).read_bytes())
        if "xor" in entry:
            other = self.files.get(entry["xor"], {})
            if other.get("how") != "gguf" or "xor" in other:
                raise ReferenceError(
                    f"{entry['from']}: XORed with {entry['xor']}, which manifest.json does not "
                    "list as a GGUF kept with its own header"
                )
            header = xor_prefix(header, self.gguf_header(other))
        if len(header) != entry["header_bytes"]:
            raise ReferenceError(f"{entry['from']}: {len(header)} bytes, expected header_bytes")
        return header

    def gguf(self, entry: dict) -> bytes:
        # quantise-on-load opens the safetensors folder: its config and weights must be there
        self.ensure("tiny-llama/safetensors/config.json")
        self.ensure(SAFETENSORS)
        out = bytearray(entry["size"])
        header = self.gguf_header(entry)
        out[: len(header)] = header
        for t in entry["tensors"]:
            name, ty = hf_name(t["name"]), t["type"]
            if ty == "F32":
                dtype, _, raw = self.tensors()[name]
                if dtype != "BF16":
                    raise ReferenceError(f"{name}: stored as {dtype}, expected bfloat16")
                data = bf16_to_f32(raw).tobytes()
            elif ty in QUANTIZE:
                m = self.quantised(QUANTIZE[ty])
                got = m.tensor_info(name).dtype
                if got != ty:
                    raise ReferenceError(f"{name}: quantize={QUANTIZE[ty]} gave {got}, not {ty}")
                rows = np.asarray(m.tensor(name))
                if ".attn_q." in t["name"] or ".attn_k." in t["name"]:
                    rows = gguf_rows(rows, N_HEAD if ".attn_q." in t["name"] else N_KV_HEAD)
                data = np.ascontiguousarray(rows).tobytes()
            else:
                raise ReferenceError(f"{t['name']}: no way to rebuild a {ty} tensor")
            if len(data) != t["end"] - t["start"]:
                raise ReferenceError(
                    f"{t['name']}: {len(data)} bytes rebuilt, expected {t['end'] - t['start']}"
                )
            out[t["start"] : t["end"]] = data
        return bytes(out)


def main(out: Path, only: list[str] | None = None) -> int:
    manifest = json.loads((HERE / "manifest.json").read_text())
    builder = Builder(out, manifest)
    wanted = list(only) if only else list(manifest["files"])
    unknown = [rel for rel in wanted if rel not in manifest["files"]]
    if unknown:
        print(f"materialize.py: not in manifest.json: {', '.join(unknown)}", file=sys.stderr)
        return 2
    (out / "manifest.json").unlink(missing_ok=True)
    try:
        for rel in wanted:
            builder.ensure(rel)
    except ReferenceError as e:
        print(f"materialize.py: {e}", file=sys.stderr)
        return 1
    # Written last: the tests take a copy equal to the checkout's manifest as "complete and
    # current".
    stamp = out / "manifest.json"
    stamp.write_bytes((HERE / "manifest.json").read_bytes())
    print(f"reference data: {len(wanted)} files in {out}, each matching its sha256")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(Path(args[0]) if args else DEFAULT_OUT, args[1:]))

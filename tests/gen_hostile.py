"""A corpus of hostile checkpoint files: every case must be refused with a FormatError.

Each case is a small set of files (GGUF bytes built field by field here, or files written by
gguf-py / the `safetensors` package and then damaged) plus the substrings its error message must
contain: the file, and the key, tensor or field at fault. The base files are checked to be valid
by gguf-py's reader and `safetensors.deserialize`, so every refusal is down to the damage.

``python tests/gen_hostile.py OUTDIR`` writes the corpus to a folder, one sub-folder per case.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file

# GGUF value type ids (gguf.GGUFValueType) and ggml type ids used below.
T_U8, T_U32, T_BOOL, T_STRING, T_ARRAY, T_U64 = 0, 4, 7, 8, 9, 10
F32, F16, Q8_0 = 0, 1, 8


@dataclass
class Case:
    """One hostile input: `files` (relative path -> bytes, or a callable that builds it inside
    the case folder, for symlinks), the path to open, and substrings the message must contain
    (matched case-insensitively)."""

    name: str
    files: dict[str, bytes]
    open: str
    expect: list[str] = field(default_factory=list)
    build: Callable[[Path], None] | None = None
    # "header" when the damage is in what `vocab_only` reads too (magic, version, metadata);
    # "tensors" when it is confined to the tensor table, data or shards.
    region: str = "header"

    def materialise(self, root: Path) -> Path:
        folder = root / self.name
        folder.mkdir(parents=True, exist_ok=True)
        for rel, data in self.files.items():
            p = folder / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        if self.build is not None:
            self.build(folder)
        return folder / self.open


# --------------------------------------------------------------------------------------------
# A GGUF writer with every field under control. `marks` records the offset of every structural
# boundary, for the truncation cases.


class Gguf:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.marks: list[tuple[int, str]] = []
        # Byte ranges of named fields, for targeted bit flips: label -> (offset, size).
        self.fields: dict[str, tuple[int, int]] = {}

    def mark(self, label: str) -> None:
        self.marks.append((len(self.buf), label))

    def put(self, label: str, fmt: str, value: int | float) -> None:
        self.mark(label)
        self.fields[label] = (len(self.buf), struct.calcsize("<" + fmt))
        self.buf += struct.pack("<" + fmt, value)

    def raw(self, label: str, data: bytes) -> None:
        self.mark(label)
        self.fields[label] = (len(self.buf), len(data))
        self.buf += data

    def string(self, label: str, s: bytes, length: int | None = None) -> None:
        self.put(f"{label}.len", "Q", len(s) if length is None else length)
        if s:
            self.raw(f"{label}.bytes", s)


@dataclass
class KV:
    key: bytes
    vtype: int
    value: bytes  # the encoded value, after the type id
    key_len: int | None = None


@dataclass
class TI:
    name: bytes
    dims: list[int]  # ggml `ne` order
    ttype: int
    offset: int
    n_dims: int | None = None
    name_len: int | None = None


def enc_str(s: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(s) if length is None else length) + s


def enc_array(elem_type: int, items: list[bytes], length: int | None = None) -> bytes:
    n = len(items) if length is None else length
    return struct.pack("<IQ", elem_type, n) + b"".join(items)


def default_kvs() -> list[KV]:
    return [
        KV(b"general.architecture", T_STRING, enc_str(b"testarch")),
        KV(b"general.alignment", T_U32, struct.pack("<I", 32)),
        KV(b"test.flag", T_BOOL, b"\x01"),
        KV(b"test.bytes", T_ARRAY, enc_array(T_U8, [b"\x01", b"\x02", b"\x03"])),
        KV(b"test.words", T_ARRAY, enc_array(T_STRING, [enc_str(b"alpha"), enc_str(b"")])),
        KV(b"test.nested", T_ARRAY, enc_array(T_ARRAY, [enc_array(T_U32, [b"\x07\0\0\0"])])),
    ]


def tensor_bytes(ttype: int, n: int) -> int:
    return {F32: 4 * n, F16: 2 * n, Q8_0: n // 32 * 34}[ttype]


def default_tensors() -> list[TI]:
    # tensor.alpha: F32 [8] (32 bytes) at 0; tensor.beta: Q8_0 ne=[32, 2] (68 bytes) at 32;
    # tensor.gamma: F16 [16] (32 bytes) at 128.
    return [
        TI(b"tensor.alpha", [8], F32, 0),
        TI(b"tensor.beta", [32, 2], Q8_0, 32),
        TI(b"tensor.gamma", [16], F16, 128),
    ]


def build_gguf(
    kvs: list[KV] | None = None,
    tensors: list[TI] | None = None,
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    alignment: int = 32,
    data_len: int | None = None,
) -> Gguf:
    kvs = default_kvs() if kvs is None else kvs
    tensors = default_tensors() if tensors is None else tensors
    g = Gguf()
    g.raw("magic", magic)
    g.put("version", "I", version)
    g.put("n_tensors", "Q", len(tensors) if n_tensors is None else n_tensors)
    g.put("n_kv", "Q", len(kvs) if n_kv is None else n_kv)
    for i, kv in enumerate(kvs):
        g.string(f"kv{i}.key", kv.key, kv.key_len)
        g.put(f"kv{i}.type", "I", kv.vtype)
        g.raw(f"kv{i}.value", kv.value)
    for i, t in enumerate(tensors):
        g.string(f"ti{i}.name", t.name, t.name_len)
        g.put(f"ti{i}.n_dims", "I", len(t.dims) if t.n_dims is None else t.n_dims)
        for j, d in enumerate(t.dims):
            g.put(f"ti{i}.dim{j}", "Q", d)
        g.put(f"ti{i}.type", "I", t.ttype)
        g.put(f"ti{i}.offset", "Q", t.offset)
    pad = -len(g.buf) % alignment if alignment > 0 else 0
    if pad:
        g.raw("padding", b"\0" * pad)
    g.mark("data")
    if data_len is None:
        # The data section of the undamaged layout: damaged dims or offsets never change it.
        data_len = max(
            t.offset + tensor_bytes(t.ttype, int(np.prod(t.dims))) for t in default_tensors()
        )
    data = bytearray(np.random.default_rng(0).integers(0, 256, data_len, dtype=np.uint8))
    # Keep every f16 value and Q8_0 scale finite and small, so the base file is clean.
    for t in default_tensors():
        if t.ttype == Q8_0:
            for b in range(2):
                data[t.offset + 34 * b : t.offset + 34 * b + 2] = b"\x00\x3c"  # f16 1.0
        else:
            n = tensor_bytes(t.ttype, int(np.prod(t.dims)))
            data[t.offset : t.offset + n] = b"\0" * n
    for i, t in enumerate(tensors):
        if t.offset < data_len:
            g.marks.append((len(g.buf) + t.offset + 1, f"data of tensor {i}"))
    g.buf += data
    return g


BASE = "base.gguf"


def check_base_is_valid(tmp: Path) -> None:
    """gguf-py's reader must accept the undamaged file (so the damage is what is refused)."""
    path = tmp / BASE
    path.write_bytes(bytes(build_gguf().buf))
    r = gguf.GGUFReader(path)
    assert [t.name for t in r.tensors] == ["tensor.alpha", "tensor.beta", "tensor.gamma"]


TENSOR_CASES = (
    "n-tensors",
    "tensor-",
    "n-dims",
    "duplicate-tensor",
    "zero-dimension",
    "five-dims",
    "dim",
    "row-",
    "offset",
    "overlapping",
    "misaligned",
    "data-short",
    "alignment",
    "flip-n_tensors",
    "flip-tensor",
    "flip-n-dims",
    "flip-offset",
    "flip-dim",
)


def g(name: str, data: bytes | bytearray, *expect: str, region: str | None = None) -> Case:
    if region is None:
        region = "tensors" if name.startswith(TENSOR_CASES) else "header"
    return Case(name, {BASE: bytes(data)}, BASE, [BASE, *expect], region=region)


def with_field(label: str, fmt: str, value: int, **kw) -> bytes:
    """The base file with one fixed-width field overwritten in place."""
    gg = build_gguf(**kw)
    off, size = gg.fields[label]
    gg.buf[off : off + size] = struct.pack("<" + fmt, value)
    return bytes(gg.buf)


# --------------------------------------------------------------------------------------------
# GGUF cases


def gguf_truncations() -> Iterator[Case]:
    base = build_gguf()
    first_ti = base.fields["ti0.name.len"][0]
    seen: set[int] = set()
    for off, label in base.marks:
        if off >= len(base.buf) or off in seen:
            continue
        seen.add(off)
        expect = ["tensor.alpha"] if label == "data of tensor 0" else []
        if label == "data of tensor 1":
            expect = ["tensor.beta"]
        elif label == "data of tensor 2":
            expect = ["tensor.gamma"]
        region = "tensors" if off >= first_ti else "header"
        name = f"truncate-at-{off:04d}-{label.replace(' ', '-')}"
        yield g(name, base.buf[:off], *expect, region=region)
    rng = random.Random(1234)
    for k in range(24):
        off = rng.randrange(0, len(base.buf) - 1)
        region = "tensors" if off >= first_ti else "header"
        yield g(f"truncate-random-{k:02d}-at-{off:04d}", base.buf[:off], region=region)


def gguf_bit_flips() -> Iterator[Case]:
    """Flips chosen so the result can never be a valid file (a flip inside a string or a value
    can be, so those bytes are not flipped)."""
    base = build_gguf()

    def flip(label: str, bit: int) -> bytes:
        b = bytearray(base.buf)
        off, _ = base.fields[label]
        b[off + bit // 8] ^= 1 << (bit % 8)
        return bytes(b)

    for bit in range(32):
        yield g(f"flip-magic-bit{bit:02d}", flip("magic", bit), "magic")
    # version 3 = 0b11: bit 0 gives 2, which is valid, so it is not flipped.
    for bit in [1, *range(2, 32, 3)]:
        yield g(f"flip-version-bit{bit:02d}", flip("version", bit), "version")
    for label in ("n_tensors", "n_kv"):
        for bit in range(40, 64, 4):
            yield g(f"flip-{label}-bit{bit:02d}", flip(label, bit), label.replace("n_", ""))
    for bit in range(32, 64, 5):
        yield g(f"flip-key-len-bit{bit:02d}", flip("kv0.key.len", bit))
        yield g(f"flip-tensor-name-len-bit{bit:02d}", flip("ti1.name.len", bit))
    for bit in range(5, 32, 3):
        yield g(f"flip-value-type-bit{bit:02d}", flip("kv2.type", bit), "test.flag")
        yield g(f"flip-tensor-type-bit{bit:02d}", flip("ti1.type", bit), "tensor.beta")
    for bit in range(3, 32, 4):
        yield g(f"flip-n-dims-bit{bit:02d}", flip("ti0.n_dims", bit), "tensor.alpha")
    for bit in range(40, 64, 4):
        yield g(f"flip-dim-bit{bit:02d}", flip("ti2.dim0", bit), "tensor.gamma")
        yield g(f"flip-offset-bit{bit:02d}", flip("ti2.offset", bit), "tensor.gamma")


def gguf_structural() -> Iterator[Case]:
    huge62, huge63 = 2**62, 2**63
    yield g("empty-file", b"")
    yield g("magic-only", b"GGUF")
    yield g("wrong-magic-ggml", with_field("version", "I", 3, magic=b"GGML"), "magic")
    yield g("text-file", b"this is not a model file at all\n" * 4, "magic")
    yield g("version-1", with_field("version", "I", 1), "version")
    yield g("version-0", with_field("version", "I", 0), "version")
    yield g("version-4", with_field("version", "I", 4), "version")

    # absurd counts and lengths
    yield g("n-tensors-2^62", with_field("n_tensors", "Q", huge62), "tensor")
    yield g("n-kv-2^62", with_field("n_kv", "Q", huge62))
    yield g("n-tensors-u64-max", with_field("n_tensors", "Q", 2**64 - 1), "tensor")
    kvs = default_kvs()
    kvs[0].key_len = huge63
    yield g("key-length-2^63", build_gguf(kvs).buf)
    kvs = default_kvs()
    kvs[0].value = enc_str(b"testarch", huge63)
    yield g("string-length-2^63", build_gguf(kvs).buf, "general.architecture")
    kvs = default_kvs()
    kvs[3].value = enc_array(T_U8, [b"\x01"], huge62)
    yield g("u8-array-2^62", build_gguf(kvs).buf, "test.bytes")
    kvs = default_kvs()
    kvs[4].value = enc_array(T_STRING, [enc_str(b"a")], huge62)
    yield g("string-array-2^62", build_gguf(kvs).buf, "test.words")
    kvs = default_kvs()
    kvs[5].value = enc_array(T_ARRAY, [enc_array(T_U32, [b"\0" * 4], huge62)])
    yield g("nested-array-2^62", build_gguf(kvs).buf, "test.nested")
    kvs = default_kvs()
    deep = enc_array(T_U32, [b"\0" * 4])
    for _ in range(64):
        deep = enc_array(T_ARRAY, [deep])
    kvs[5].value = deep
    yield g("array-nested-64-deep", build_gguf(kvs).buf, "test.nested")
    tis = default_tensors()
    tis[0].name_len = huge63
    yield g("tensor-name-length-2^63", build_gguf(tensors=tis).buf)
    tis = default_tensors()
    tis[0].n_dims = 2**31
    yield g("n-dims-2^31", build_gguf(tensors=tis).buf, "tensor.alpha")

    # types
    kvs = default_kvs()
    kvs[2].vtype = 13
    yield g("value-type-13", build_gguf(kvs).buf, "test.flag")
    kvs = default_kvs()
    kvs[2].value = b"\x02"
    yield g("bool-byte-2", build_gguf(kvs).buf, "test.flag")
    kvs = default_kvs()
    kvs[3].value = enc_array(99, [b"\x01"])
    yield g("array-element-type-99", build_gguf(kvs).buf, "test.bytes")
    for tid in (4, 5, 31, 99, 2**31):
        tis = default_tensors()
        tis[1].ttype = tid
        yield g(f"tensor-type-{tid}", build_gguf(tensors=tis).buf, "tensor.beta", str(tid))

    # duplicates
    kvs = default_kvs()
    kvs.append(KV(b"test.flag", T_BOOL, b"\x00"))
    yield g("duplicate-key", build_gguf(kvs).buf, "test.flag")
    tis = default_tensors()
    tis[2].name = b"tensor.alpha"
    yield g("duplicate-tensor-name", build_gguf(tensors=tis).buf, "tensor.alpha")

    # shapes
    tis = default_tensors()
    tis[2].dims = [16, 0]
    yield g("zero-dimension", build_gguf(tensors=tis).buf, "tensor.gamma")
    tis = default_tensors()
    tis[0].dims = [2, 2, 2, 1, 1]
    yield g("five-dims", build_gguf(tensors=tis).buf, "tensor.alpha")
    tis = default_tensors()
    tis[0].dims = [2**32, 2**32, 2**32]
    yield g("dims-product-overflow", build_gguf(tensors=tis).buf, "tensor.alpha")
    tis = default_tensors()
    tis[0].dims = [2**63]
    yield g("dim-2^63", build_gguf(tensors=tis).buf, "tensor.alpha")
    tis = default_tensors()
    tis[1].dims = [48, 2]  # Q8_0 rows must be a multiple of 32
    yield g("row-not-multiple-of-block", build_gguf(tensors=tis).buf, "tensor.beta", "32")

    # offsets
    tis = default_tensors()
    tis[2].offset = 2**40
    yield g("offset-past-end", build_gguf(tensors=tis, data_len=160).buf, "tensor.gamma")
    tis = default_tensors()
    tis[2].offset = 2**64 - 32
    yield g("offset-overflows", build_gguf(tensors=tis, data_len=160).buf, "tensor.gamma")
    tis = default_tensors()
    tis[1].offset = 0
    yield g("overlapping-tensors", build_gguf(tensors=tis).buf, "tensor.beta")
    tis = default_tensors()
    tis[2].offset = 100  # overlaps beta (32..100) by nothing, but is not 32-aligned
    yield g("misaligned-offset", build_gguf(tensors=tis).buf, "tensor.gamma")
    yield g(
        "data-short-by-one",
        build_gguf().buf[:-1],
        "tensor.gamma",
    )

    # alignment
    for value, label in ((0, "0"), (3, "3"), (48, "48")):
        kvs = default_kvs()
        kvs[1].value = struct.pack("<I", value)
        yield g(f"alignment-{label}", build_gguf(kvs).buf, "general.alignment")
    # A power of two, so a legal alignment, but the offsets in the file do not honour it.
    kvs = default_kvs()
    kvs[1].value = struct.pack("<I", 2**31)
    yield g("alignment-2^31", build_gguf(kvs).buf, "tensor.beta", "alignment")
    kvs = default_kvs()
    kvs[1] = KV(b"general.alignment", T_STRING, enc_str(b"32"))
    yield g("alignment-is-a-string", build_gguf(kvs).buf, "general.alignment")


def gguf_big_endian(tmp: Path) -> Iterator[Case]:
    """A big-endian file written by gguf-py itself."""
    path = tmp / "be.gguf"
    w = gguf.GGUFWriter(path, arch="llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("tensor.alpha", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    yield Case(
        "big-endian-gguf-py", {"be.gguf": path.read_bytes()}, "be.gguf", ["be.gguf", "endian"]
    )


def gguf_split(tmp: Path) -> Iterator[Case]:
    """Split sets written by gguf-py, then broken: a missing part, and a part from another set."""

    def write_set(folder: Path, per_part: int) -> list[Path]:
        folder.mkdir(parents=True, exist_ok=True)
        w = gguf.GGUFWriter(folder / "m.gguf", arch="llama", split_max_tensors=per_part)
        w.add_block_count(1)
        for i in range(6):
            w.add_tensor(f"tensor.{i}", np.full(8, i, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return sorted(folder.glob("m-*-of-*.gguf"))

    three = write_set(tmp / "three", 2)
    two = write_set(tmp / "two", 3)
    assert len(three) == 3 and len(two) == 2
    files = {p.name: p.read_bytes() for p in three}
    missing = dict(files)
    del missing[three[1].name]
    yield Case("split-missing-part", missing, three[0].name, [three[1].name], region="tensors")
    mixed = dict(files)
    mixed[three[1].name] = two[1].read_bytes()  # says "part 2 of 2"
    yield Case(
        "split-part-from-another-set",
        mixed,
        three[0].name,
        ["split", three[1].name],
        region="tensors",
    )


# --------------------------------------------------------------------------------------------
# safetensors cases


def st_file(header: dict | bytes, data: bytes, header_len: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(text) if header_len is None else header_len
    return struct.pack("<Q", n) + text + data


def st_cases() -> Iterator[Case]:
    name = "model.safetensors"

    def s(case: str, data: bytes, *expect: str) -> Case:
        return Case(case, {name: data}, name, [name, *expect], region="tensors")

    ok = {"w.a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    yield s("st-empty", b"")
    yield s("st-seven-bytes", b"\x10\0\0\0\0\0\0")
    yield s("st-header-len-2^63", st_file(ok, b"\0" * 16, 2**63))
    yield s("st-header-len-past-end", st_file(ok, b"\0" * 16, 10_000))
    yield s("st-header-not-json", st_file(b"{not json", b""))
    yield s("st-header-not-utf8", st_file(b'{"\xff\xfe": 1}', b""))
    yield s("st-header-is-a-list", st_file(b"[1, 2, 3]", b""))
    bad = {"w.a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}
    yield s("st-unknown-dtype", st_file(bad, b"\0" * 8), "w.a")
    bad = {"w.a": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 16]}}
    yield s("st-size-mismatch", st_file(bad, b"\0" * 16), "w.a")
    bad = {"w.a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    yield s("st-data-truncated", st_file(bad, b"\0" * 12), "truncated")
    bad = {"w.a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}}
    yield s("st-offsets-reversed", st_file(bad, b"\0" * 16), "w.a")
    bad = {
        "w.a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "w.b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]},
    }
    yield s("st-overlapping", st_file(bad, b"\0" * 24))
    bad = {
        "w.a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "w.b": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]},
    }
    yield s("st-hole-between-tensors", st_file(bad, b"\0" * 32))
    bad = {"w.a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}
    yield s("st-shape-overflow", st_file(bad, b"\0" * 16), "w.a")
    bad = {"w.a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [2**64 - 8, 8]}}
    yield s("st-offset-2^64", st_file(bad, b"\0" * 16), "w.a")
    dup = b'{"w.a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
    dup += b'"w.a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'
    yield s("st-duplicate-name", st_file(dup, b"\0" * 8), "w.a")
    bad = {"__metadata__": {"k": 1}, **ok}
    yield s("st-metadata-not-strings", st_file(bad, b"\0" * 16))


def st_index_cases(tmp: Path) -> Iterator[Case]:
    """Sharded folders (`model/`) whose index is hostile. Shards come from
    `safetensors.numpy.save_file`; `outside.safetensors` sits beside the folder, not in it."""
    shard_path = tmp / "shard.safetensors"
    save_file({"w.a": np.ones((2, 2), np.float32), "w.b": np.zeros(3, np.float16)}, str(shard_path))
    s1 = shard_path.read_bytes()
    shard2_path = tmp / "shard2.safetensors"
    save_file({"w.c": np.ones(4, np.float32)}, str(shard2_path))
    s2 = shard2_path.read_bytes()
    index_name = "model.safetensors.index.json"
    two = {"w.a": "s1.safetensors", "w.b": "s1.safetensors", "w.c": "s2.safetensors"}

    def case(name: str, index: bytes | dict, shards: dict[str, bytes], *expect: str, build=None):
        if isinstance(index, dict):
            index = json.dumps({"metadata": {}, "weight_map": index}).encode()
        files = {f"model/{index_name}": index, **{f"model/{k}": v for k, v in shards.items()}}
        files["outside.safetensors"] = s2
        return Case(f"index-{name}", files, "model", list(expect), build, region="tensors")

    both = {"s1.safetensors": s1, "s2.safetensors": s2}
    yield case("dotdot", {**two, "w.c": "../outside.safetensors"}, both, "../outside.safetensors")
    yield case("absolute", {**two, "w.c": "/etc/passwd"}, both, "/etc/passwd")

    def link_outside(folder: Path) -> None:
        (folder / "model" / "s2.safetensors").symlink_to(folder / "outside.safetensors")

    yield case("symlink-outside", two, {"s1.safetensors": s1}, "s2.safetensors", build=link_outside)
    yield case("missing-shard", two, {"s1.safetensors": s1}, "s2.safetensors")
    yield case("tensor-missing-from-shard", {**two, "w.d": "s2.safetensors"}, both, "w.d", "s2")
    yield case(
        "tensor-missing-from-index", {"w.a": "s1.safetensors", "w.c": "s2.safetensors"}, both, "w.b"
    )
    yield case("not-json", b"{this is not json", both, index_name)
    yield case(
        "without-weight-map", json.dumps({"metadata": {}}).encode(), both, index_name, "weight_map"
    )
    yield case(
        "value-not-string", json.dumps({"weight_map": {"w.a": 7}}).encode(), both, index_name
    )
    yield case("empty-shard-name", {**two, "w.c": ""}, both, "w.c")


def all_cases(tmp: Path) -> list[Case]:
    check_base_is_valid(tmp)
    cases = [
        *gguf_truncations(),
        *gguf_bit_flips(),
        *gguf_structural(),
        *gguf_big_endian(tmp),
        *gguf_split(tmp),
        *st_cases(),
        *st_index_cases(tmp),
    ]
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "hostile")
    scratch = out / "_scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    corpus = all_cases(scratch)
    for c in corpus:
        c.materialise(out)
    sys.stderr.write(f"{len(corpus)} hostile cases written to {out}\n")

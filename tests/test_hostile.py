"""Every file of the hostile corpus (tests/gen_hostile.py) is refused with a FormatError whose
message names the file and the key, tensor or field at fault; none crashes or hangs."""

from __future__ import annotations

import time
from pathlib import Path

import gen_hostile
import pytest
import weightlift as wl


def _cases() -> list[gen_hostile.Case]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return gen_hostile.all_cases(Path(tmp))


CASES = _cases()
# A generous bound that only a hang, or work proportional to a claimed size, could exceed.
HANG_GUARD_S = 5.0


def test_corpus_is_large():
    assert len(CASES) >= 200


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("mode", ["full", "vocab_only"])
def test_hostile_file_is_refused(tmp_path, case, mode):
    path = case.materialise(tmp_path)
    vocab_only = mode == "vocab_only"
    start = time.monotonic()
    try:
        ckpt = wl.open(path, vocab_only=vocab_only, check_tensors=not vocab_only)
    except wl.FormatError as e:
        elapsed = time.monotonic() - start
        err: Exception = e
    else:
        elapsed = time.monotonic() - start
        if vocab_only and case.region == "tensors":
            # vocab_only reads no tensor table, so damage confined to it goes unseen.
            ckpt.close()
            return
        pytest.fail(f"{case.name}: opened without error: {ckpt!r}")
    assert isinstance(err, ValueError) and isinstance(err, wl.WeightliftError)
    msg = str(err)
    low = msg.lower()
    for needle in case.expect:
        assert needle.lower() in low, f"{case.name}: {needle!r} not in message: {msg}"
    assert len(msg) >= 40, f"{case.name}: message too terse: {msg}"
    # Says what was wanted: "expected X, got Y", or names what is unsupported.
    assert "expected" in low or "not supported" in low or "endian" in low, msg
    assert elapsed < HANG_GUARD_S, f"{case.name}: took {elapsed:.1f}s"


def test_random_header_bit_flips_never_crash(tmp_path):
    """Single-bit flips anywhere in the header (seeded). A flip inside a string or a value can
    leave a valid file, so here the rule is weaker: open() either raises FormatError or returns
    a checkpoint whose every tensor reads back (raw and dequantize) without error."""
    import random

    base = gen_hostile.build_gguf()
    header_end = base.fields["ti2.offset"][0] + 8
    rng = random.Random(20261122)
    refused = opened = 0
    for k in range(400):
        data = bytearray(base.buf)
        bit = rng.randrange(header_end * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        path = tmp_path / f"flip{k}.gguf"
        path.write_bytes(bytes(data))
        try:
            ckpt = wl.open(path, check_tensors=True)
        except wl.FormatError as e:
            assert "flip" in str(e) and len(str(e)) >= 40
            refused += 1
            continue
        with ckpt:
            for t in ckpt.tensors:
                assert ckpt.raw(t.name).nbytes == t.nbytes
                ckpt.dequantize(t.name)
        opened += 1
    assert refused > 200 and opened > 0, (refused, opened)


def test_magic_and_version_errors_show_what_was_read(tmp_path):
    """The bytes read where the magic should be show as hex with their printable text, never as
    an escape; a version just above 3 is a newer tool's, a wild one a corrupt header."""
    import struct

    binary = tmp_path / "binary.gguf"
    binary.write_bytes(b"\x18\x00\xaf\x3c" + bytes(28))
    with pytest.raises(wl.FormatError) as e:
        wl.open(binary)
    msg = str(e.value)
    assert "magic: expected the GGUF magic 47 47 55 46 ('GGUF'), got 18 00 af 3c ('...<')" in msg
    assert "\\u{" not in msg and "not a GGUF file" in msg, msg

    def with_version(version: int) -> Path:
        path = tmp_path / f"v{version}.gguf"
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, 0))
        return path

    with pytest.raises(wl.FormatError) as e:
        wl.open(with_version(4))
    assert "gguf version 4 is not supported" in str(e.value)
    assert "newer tool" in str(e.value)

    wild = 0x3CFA12AB
    with pytest.raises(wl.FormatError) as e:
        wl.open(with_version(wild))
    msg = str(e.value)
    assert "header version: expected 2 or 3 (a later GGUF revision would be a small number" in msg
    assert f"got {wild} (bytes ab 12 fa 3c ('...<'))" in msg, msg
    assert "the header is corrupted, or the file is not a GGUF file this tool can read" in msg
    assert "newer" not in msg, msg

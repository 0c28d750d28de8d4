"""Fetch llama.cpp's tokenizer test vectors from the llama-cpp-python sdist on PyPI.

The sdist vendors llama.cpp, whose models/ggml-vocab-*.gguf files (vocabulary-only GGUFs) come
with .gguf.inp / .gguf.out test vectors (read as llama.cpp's tests/test-tokenizer-0.cpp reads
them). Only those files are extracted.

Usage: fetch_vocab.py WHEEL_DIR DEST_DIR
"""

import hashlib
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

PKG = "llama-cpp-python==0.3.36"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-"


def main() -> int:
    wheel_dir, dest = Path(sys.argv[1]), Path(sys.argv[2])
    sdist = wheel_dir / SDIST
    if not sdist.exists():
        # --no-binary only for this package: `:all:` would also build pip's build
        # dependencies (cmake) from source while pip prepares the sdist's metadata.
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check"]
        cmd += ["--no-deps", "--no-binary", "llama-cpp-python", PKG, "-d", str(wheel_dir)]
        subprocess.run(cmd, check=True)
    digest = hashlib.sha256()
    with sdist.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != SHA256:
        print(
            f"fetch_vocab: {sdist}: expected sha256 {SHA256}, got {digest.hexdigest()}",
            file=sys.stderr,
        )
        return 1
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n = 0
    with tarfile.open(sdist, "r:gz") as tf:
        for member in tf:
            if not (member.isfile() and member.name.startswith(PREFIX)):
                continue
            name = Path(member.name).name
            src = tf.extractfile(member)
            assert src is not None
            with src, (tmp / name).open("wb") as out:
                shutil.copyfileobj(src, out)
            n += 1
    if n == 0:
        print(f"fetch_vocab: no {PREFIX}* files in {sdist}", file=sys.stderr)
        return 1
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    print(f"vocab test vectors: {n} files in {dest} (sha256 ok)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

